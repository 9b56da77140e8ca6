"""Connections: making them, messages with fds, selectors, timeouts, the
GIL released while waiting."""
import os
import sys
import selectors
import threading
import time

import pytest

import gpuipc

_n = 0


def name():
    global _n
    _n += 1
    return f"pyt-{os.getpid()}-{_n}"


def pair(**kw):
    """A connected pair in this process (listener thread)."""
    nm = name()
    out = {}
    with gpuipc.listen(nm, **kw) as lst:
        t = threading.Thread(target=lambda: out.setdefault("a", lst.accept(timeout=10)))
        t.start()
        c = gpuipc.connect(nm, **kw)
        t.join()
    return out["a"], c


def test_listen_connect_accept_and_peer():
    a, c = pair()
    with a, c:
        pid, uid, gid = a.peer
        assert pid == os.getpid() and uid == os.getuid()
        assert isinstance(a.fileno(), int) and a.fileno() >= 0
        assert not a.closed
    assert a.closed and c.closed
    with pytest.raises(gpuipc.ClosedError):
        a.send_msg(b"x")


def test_listener_path_and_accept_timeout():
    nm = name()
    with gpuipc.listen(nm) as lst:
        assert nm in lst.path
        t0 = time.monotonic()
        with pytest.raises(gpuipc.TimeoutError):
            lst.accept(timeout=0.2)
        assert time.monotonic() - t0 >= 0.15
        with pytest.raises(gpuipc.ExistsError):
            gpuipc.listen(nm)


def test_silent_client_does_not_hold_accept():
    """A client that connects and never says anything holds accept() no
    longer than accept's own timeout (not the handshake's), and a client
    that does complete its handshake is accepted meanwhile."""
    import socket
    nm = name()
    with gpuipc.listen(nm, timeout=30) as lst:
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = lst.path
        silent.connect("\0" + path[1:] if path.startswith("@") else path)
        t0 = time.monotonic()
        with pytest.raises((gpuipc.WouldBlockError, gpuipc.TimeoutError)):
            lst.accept(timeout=0)
        with pytest.raises(gpuipc.TimeoutError):
            lst.accept(timeout=0.3)
        assert time.monotonic() - t0 < 10, "accept waited for the silent peer's handshake"
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("c", gpuipc.connect(nm)))
        t.start()
        a = lst.accept(timeout=20)
        t.join()
        with a, out["c"]:
            assert a.peer[0] == os.getpid()
        silent.close()


def test_messages_in_order_with_fds():
    a, c = pair()
    r, w = os.pipe()
    try:
        c.send_msg(b"one")
        c.send_msg(b"two", [w])
        c.send_msg(b"")
        assert a.recv_msg() == b"one"
        data, fds = a.recv_msg(with_fds=True)
        assert data == b"two" and len(fds) == 1
        os.write(fds[0], b"through the fd")
        os.close(fds[0])
        assert os.read(r, 100) == b"through the fd"
        assert a.recv_msg() == b""
        big = os.urandom(gpuipc._gpuipc.MSG_MAX)
        c.send_msg(big)
        assert a.recv_msg() == big
    finally:
        os.close(r)
        os.close(w)
        a.close()
        c.close()


def test_recv_timeout_and_default_timeout():
    a, c = pair(timeout=0.3)
    with a, c:
        assert a.timeout == pytest.approx(0.3)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            a.recv_msg()
        assert 0.25 <= time.monotonic() - t0 < 3
        with pytest.raises(gpuipc.TimeoutError):
            a.recv(timeout=0)
        a.timeout = None
        assert a.timeout is None


def test_peer_closed_is_peer_gone():
    a, c = pair()
    c.close()
    with pytest.raises((gpuipc.PeerGoneError, gpuipc.ClosedError)):
        a.recv_msg(timeout=5)
    a.close()


def test_fileno_works_with_selectors():
    a, c = pair()
    with a, c:
        sel = selectors.DefaultSelector()
        sel.register(a.fileno(), selectors.EVENT_READ)
        assert sel.select(timeout=0.05) == []
        c.send_msg(b"wake")
        assert len(sel.select(timeout=5)) == 1
        assert a.recv_msg(timeout=0) == b"wake"
        sel.close()


def test_gil_released_while_waiting():
    """A thread blocked in recv_msg lets another thread run Python code."""
    a, c = pair()
    with a, c:
        state = {}

        def waiter():
            state["started"] = time.monotonic()
            state["msg"] = a.recv_msg(timeout=10)
            state["done"] = time.monotonic()

        t = threading.Thread(target=waiter)
        t.start()
        while "started" not in state:
            time.sleep(0.001)
        count = 0
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            count += 1
        assert "done" not in state, "the waiter returned without a message"
        # Holding the GIL the whole wait would leave this loop nearly frozen.
        assert count > 10000, count
        c.send_msg(b"now")
        t.join(5)
        assert state["msg"] == b"now"


def test_gil_released_in_accept():
    nm = name()
    with gpuipc.listen(nm) as lst:
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("c", lst.accept(timeout=10)))
        t.start()
        count = 0
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            count += 1
        assert count > 10000
        c = gpuipc.connect(nm)
        t.join(5)
        res["c"].close()
        c.close()


def test_conn_pair_and_from_fd():
    fa, fb = gpuipc.conn_pair()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", gpuipc.from_fd(fb)))
    t.start()
    a = gpuipc.from_fd(fa)
    t.join(10)
    b = out["b"]
    with a, b:
        a.send_msg(b"hi")
        assert b.recv_msg() == b"hi"


_CLOSE_RACE = r"""
import threading, time, gpuipc

def pair():
    fa, fb = gpuipc.conn_pair()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", gpuipc.from_fd(fb)))
    t.start()
    a = gpuipc.from_fd(fa)
    t.join()
    return a, out["b"]

busy, _other = pair()
stop = []
def spin():  # another thread's calls, each taking the module lock
    while not stop:
        busy.progress(0)
th = threading.Thread(target=spin)
th.start()
n, end = 0, time.monotonic() + 3
while time.monotonic() < end:
    a, b = pair()
    a.close()
    b.close()
    n += 1
stop.append(1)
th.join()
print("closed", n)
"""


def test_close_while_another_thread_calls():
    """close() waits for the device without the GIL and with the module
    lock; it used to take the GIL back before letting the lock go, while a
    thread that held the GIL waited for the lock: both waited for ever."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", _CLOSE_RACE], env=env, timeout=60,
                           capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("close() and progress() in two threads deadlocked")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("closed ")


@pytest.mark.parametrize("carrier", ["auto", "socket", "ring"])
def test_carrier_options_carry_buffers(carrier):
    """carrier=, spin_us= and polling= where connections are made: a block
    goes over each carrier, with polling switched on and off, and one sent
    with complete=True (the host wrote it: nothing to order) arrives whole."""
    import json

    import peers
    from cudrv import drv, pattern

    with gpuipc.spawn(peers.check_consumer, 2, carrier=carrier, spin_us=50,
                      polling=(carrier == "ring")) as p:
        arena = gpuipc.Arena(chunk_bytes=1 << 20)
        b = arena.alloc(256)
        drv().htod(b.ptr, pattern(256, 3))
        p.conn.send(b)
        assert bytes.fromhex(json.loads(p.conn.recv_msg(timeout=30))["data"]) == pattern(256, 3)
        p.conn.set_polling(True)
        p.conn.set_polling(False)
        while b.holders:
            p.conn.progress(timeout=5)  # its release
        drv().htod(b.ptr, pattern(256, 4))
        p.conn.send(b, complete=True)
        assert bytes.fromhex(json.loads(p.conn.recv_msg(timeout=30))["data"]) == pattern(256, 4)
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


@pytest.mark.parametrize("carrier", ["socket", "ring"])
def test_release_complete(carrier):
    """Received.release(complete=True): the consumer says its use is done.
    A block sent with complete=True, then from the idle legacy stream, then
    from an idle stream of its own, arrives whole each time and comes back
    (the driver calls it saves are counted by the C suite,
    handoff_release_complete)."""
    import json

    import peers
    from cudrv import drv, pattern

    with gpuipc.spawn(peers.complete_consumer, 3, carrier=carrier) as p:
        arena = gpuipc.Arena(chunk_bytes=1 << 20)
        b = arena.alloc(256)
        for i, how in enumerate(("complete", "idle", "stream")):
            drv().htod(b.ptr, pattern(256, 10 + i))
            if how == "complete":
                p.conn.send(b, complete=True)
            elif how == "idle":
                p.conn.send(b)
            else:
                p.conn.send(b, stream=drv().stream())
            got = json.loads(p.conn.recv_msg(timeout=30))
            assert bytes.fromhex(got["data"]) == pattern(256, 10 + i), how
            assert got["bad_refused"], how
            while b.holders:
                p.conn.progress(timeout=5)  # its release
        p.conn.send_msg(b"go")
        assert p.join(30) == 0
        b.free()
        arena.close()


def test_ring_is_refused_by_a_socket_only_peer():
    nm = name()
    out = {}
    with gpuipc.listen(nm, carrier="socket", timeout=5) as lst:
        def acc():
            try:
                out["a"] = lst.accept(timeout=5)
            except gpuipc.Error as e:
                out["e"] = e
        t = threading.Thread(target=acc)
        t.start()
        with pytest.raises(gpuipc.Error):
            gpuipc.connect(nm, carrier="ring", timeout=5)
        t.join()
    if "a" in out:
        out["a"].close()


@pytest.mark.parametrize("kw, exc, msg", [
    ({"carrier": "pipe"}, ValueError, "carrier must be 'auto', 'socket' or 'ring'"),
    ({"carrier": 2}, TypeError, "carrier must be"),
    ({"spin_us": -1}, ValueError, "spin_us must be from 0 to 1000000"),
    ({"spin_us": 1000001}, ValueError, "spin_us must be from 0 to 1000000"),
    ({"spin_us": 1 << 70}, ValueError, "spin_us must be from 0 to 1000000"),
    ({"spin_us": 1.5}, TypeError, "spin_us must be an int"),
    ({"spin_us": True}, TypeError, "spin_us must be an int"),
    ({"polling": 1}, TypeError, "polling must be True or False"),
    ({"polling": "yes"}, TypeError, "polling must be True or False"),
])
def test_bad_carrier_options_are_refused(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        gpuipc.listen(name(), **kw)
    with pytest.raises(exc, match=msg):
        gpuipc.connect(name(), **kw)
    with pytest.raises(exc, match=msg):
        gpuipc.spawn(len, **kw)
    fds = gpuipc.conn_pair()
    os.close(fds[1])
    with pytest.raises(exc, match=msg):
        gpuipc.from_fd(fds[0], **kw)
    os.close(fds[0])  # refused before the connection took it


def test_set_polling_and_complete_bad_values():
    a, c = pair()
    with a, c:
        for bad in (1, "on", None):
            with pytest.raises(TypeError, match="set_polling: give True or False"):
                c.set_polling(bad)
        arena = gpuipc.Arena(chunk_bytes=1 << 20)
        b = arena.alloc(64)
        with pytest.raises(TypeError, match="complete must be True or False"):
            a.send(b, complete=1)
        buf = gpuipc.Pool(kind="legacy").alloc(64)
        with pytest.raises(ValueError, match="complete=True is for arena blocks"):
            a.send(buf, complete=True)
        assert a.outstanding() == (0, 0)  # nothing was sent
        buf.close()
    with pytest.raises(gpuipc.ClosedError):
        c.set_polling(True)
