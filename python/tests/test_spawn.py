"""gpuipc.spawn: children with a connection, CUDA initialized first."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import gpuipc
import peers


def test_spawn_workers_know_their_index():
    procs = gpuipc.spawn_workers(peers.worker, 3)
    try:
        seen = sorted((json.loads(p.conn.recv_msg(timeout=30))["index"], p) for p in procs)
        assert [i for i, _ in seen] == [0, 1, 2]
        codes = [p.join(30) for _, p in seen]
        assert codes == [3, 0, 0]
        assert all(p.status.startswith("exit code") for _, p in seen)
    finally:
        for p in procs:
            p.close()


def test_exit_code_and_kill():
    with gpuipc.spawn(peers.exits, 7) as p:
        assert p.join(30) == 7
    with gpuipc.spawn(peers.holder, 1) as p:
        assert p.is_alive()
        p.kill()
        assert p.join(30) == -9


def test_target_in_main_script(tmp_path):
    script = tmp_path / "main_script.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(gpuipc.__path__[0])!r})
        import gpuipc

        def child(conn, word):
            conn.send_msg(word.encode() * 2)

        if __name__ == "__main__":
            with gpuipc.spawn(child, "ab") as p:
                print(p.conn.recv_msg(timeout=30).decode())
                print(p.join(30))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["abab", "0"]


def test_forked_child_gets_a_clear_error():
    gpuipc.init()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            gpuipc.Arena()
            msg = "no error"
        except gpuipc.ForkedError as e:
            msg = str(e)
        except BaseException as e:
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    msg = os.read(r, 4096).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert "forked" in msg and "gpuipc.spawn()" in msg, msg


def test_closing_the_connection_is_seen_by_the_child():
    """Connection.close() of a spawned child's connection: the child's recv
    says PeerGoneError at once, its send fails, and the block it held comes
    back once it exited (the arena closes), as over listen/connect."""
    arena = gpuipc.Arena(chunk_bytes=4 << 20)
    p = gpuipc.spawn(peers.closed_by_parent)
    try:
        b = arena.alloc(4096)
        p.conn.send(b)
        assert json.loads(p.conn.recv_msg(timeout=30)) == {"holding": 1}
        b.free()
        p.conn.close()
        assert p.join(30) == 5
    finally:
        p.close(timeout=0)
    arena.close()


class _Obj:
    pass


def _dropped(ref, limit=15.0):
    import time
    end = time.monotonic() + limit
    while time.monotonic() < end:
        gpuipc.collect()  # where the library's drops are taken
        if ref() is None:
            return True
        time.sleep(0.02)
    return False


def test_keep_until_peer_exits():
    """Connection.keep_until_peer_exits: the object is kept while the peer's
    process lives, also after the connection closed at both ends, and
    dropped once it was killed; for a peer gone already, at once."""
    import time
    import weakref
    p = gpuipc.spawn(peers.lives_on_after_close)
    try:
        o = _Obj()
        ref = weakref.ref(o)
        p.conn.keep_until_peer_exits(o)
        del o
        p.conn.close()
        for _ in range(5):  # past the watcher's rescans: kept
            time.sleep(0.1)
            gpuipc.collect()
        assert ref() is not None, "dropped while the peer lives"
        p.kill()
        p.join(30)
        assert _dropped(ref), "kept after the peer was killed"
        with pytest.raises(gpuipc.ClosedError):
            p.conn.keep_until_peer_exits(_Obj())
    finally:
        p.close(timeout=0)
    q = gpuipc.spawn(peers.exits_at_once)
    try:
        assert q.join(30) == 0
        o = _Obj()
        ref = weakref.ref(o)
        q.conn.keep_until_peer_exits(o)
        del o
        assert ref() is None, "a peer gone already: kept"
    finally:
        q.close(timeout=0)
