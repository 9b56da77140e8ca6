"""A peer in another pid namespace (as a sibling container, whose pid
reads 0 here): wrapped memory sent to it and the connection closed here
stays kept while the peer lives, and comes back once its process is gone
(the library's pidfd of the peer says so); so does an object of the
application's kept with Connection.keep_until_peer_exits. The exporter runs under
unshare --pid --fork --mount-proc, so the importer (in the test's
namespace) is outside its view."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _unshare_works():
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"unshare --pid --fork --mount-proc is not permitted here: {r.stderr.strip()}"
    return None


def _start(args, env):
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def _read(p):
    line = p.stdout.readline()
    assert line, f"{p.args} ended early (status {p.wait(30)})"
    return json.loads(line)


def test_wrapped_memory_to_another_pid_namespace_kept_after_close_until_peer_dies():
    why = _unshare_works()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.environ.get("GPUIPC_PKG_DIR", os.path.dirname(HERE)), HERE])
    rt = tempfile.mkdtemp(prefix="gpuipc-ns-")
    os.chmod(rt, 0o700)
    script = os.path.join(HERE, "ns_peers.py")
    ex = _start(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, script,
                 "exporter", rt], env)
    im = None
    try:
        assert _read(ex) == {"listening": True}
        im = _start([sys.executable, script, "importer", rt], env)
        assert _read(im) == {"held": True}
        r = _read(ex)
        assert r["peer_pid"] == 0  # outside the exporter's pid namespace
        assert r["msg"] == "held"
        # closed there while the peer maps the memory: kept
        assert r["alive_after_close"] and r["mine_after_close"] and r["kept"] == 2
        im.send_signal(signal.SIGKILL)
        im.wait(30)
        ex.stdin.write(json.dumps({"dead": True}) + "\n")
        ex.stdin.flush()
        r = _read(ex)
        assert not r["alive_after_death"] and not r["mine_after_death"] and r["kept"] == 0
        assert ex.wait(30) == 0
    finally:
        for p in (im, ex):
            if p and p.poll() is None:
                p.kill()
                p.wait(30)
        shutil.rmtree(rt, ignore_errors=True)
