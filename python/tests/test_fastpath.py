"""The Python fast path: recv(as_torch=True) and recv_batch(as_torch=True)
(torch tensors made in C, leases tied to their lives), the one wait loop
(spin, then sleep; timeout=None forever; connect waiting for its
listener), the vectorcall argument parsing, and no leak over many sends.

torch cannot run on the CUDA driver emulator, so the as_torch tests use a
stand-in (tests/faketorch) that has what the C glue looks up when torch's
DLPack C exchange API is absent; they are skipped, saying so, where a real
torch is importable (test_gpu_fastpath covers it on a GPU)."""
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc

import pytest

import gpuipc
from cudrv import drv, pattern

HERE = os.path.dirname(os.path.abspath(__file__))


def _real_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return not getattr(torch, "FAKE", False)


_fake = []


@pytest.fixture
def fake_torch():
    """The stand-in as "torch" for the test's length only (other tests must
    not find it). One module object for the whole run: the C glue keeps
    what it looked up in the first."""
    if _real_torch():
        pytest.skip("a real torch is importable here: as_torch is tested with it on a GPU "
                    "(test_gpu_fastpath)")
    if not _fake:
        path = os.path.join(HERE, "faketorch")
        sys.path.insert(0, path)
        try:
            import torch
        finally:
            sys.path.remove(path)
        assert torch.FAKE
        _fake.append(torch)
    torch = _fake[0]
    sys.modules["torch"] = torch
    torch.calls.clear()
    torch.current_stream[0] = 0
    try:
        yield torch
    finally:
        gc.collect()
        sys.modules.pop("torch", None)


def report(conn):
    return json.loads(conn.recv_msg(timeout=30))


# --- peers (run in a spawned child) --------------------------------------------


def block_sender(conn, n, k):
    """Sends n blocks of 64 int32 (block i holds pattern(256, i), meta
    b"%d" % i), in batches of k when k > 1; then, on each "count", reports
    its arena's leases; "bye" ends it."""
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    blocks = [a.alloc(256, shape=(64,), dtype="int32") for _ in range(n)]
    for i, b in enumerate(blocks):
        drv().htod(b.ptr, pattern(256, i))
    if k > 1:
        for i in range(0, n, k):
            conn.send_batch(blocks[i:i + k], metas=[b"%d" % j for j in range(i, min(n, i + k))])
    else:
        for i, b in enumerate(blocks):
            conn.send(b, meta=b"%d" % i)
    while True:
        try:
            m = conn.recv_msg(timeout=60)
        except (gpuipc.PeerGoneError, gpuipc.ClosedError):
            return  # the parent closed
        if m == b"bye":
            return
        end = time.monotonic() + 20
        want = int(m.split()[1])
        while a.stats()["leases"] != want and time.monotonic() < end:
            conn.progress(0.02)
        conn.send_msg(json.dumps({"leases": a.stats()["leases"]}).encode())


def late_sender(conn, delay):
    """Sends one block after the parent's "go" and delay seconds."""
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(64)
    conn.recv_msg(timeout=60)
    time.sleep(delay)
    conn.send(b, meta=b"late")
    conn.recv_msg(timeout=60)


def late_listener(conn, name, delay):
    """Listens on name only after delay seconds; accepts one peer and says
    hello to it."""
    time.sleep(delay)
    with gpuipc.listen(name) as lst:
        conn.send_msg(b"listening")
        c = lst.accept(timeout=60)
        c.send_msg(b"hello")
        c.recv_msg(timeout=60)


def many_sender(conn, n):
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    blocks = [a.alloc(256, shape=(64,), dtype="int32") for _ in range(32)]
    for i in range(n):
        conn.send(blocks[i % 32], meta=b"%d" % (i % 1000))
    conn.recv_msg(timeout=120)


def leases_of(p, want):
    p.conn.send_msg(b"count %d" % want)
    return report(p.conn)["leases"]


# --- as_torch -------------------------------------------------------------------


def test_as_torch_tensor_holds_the_lease_until_it_dies(fake_torch):
    with gpuipc.spawn(block_sender, 2, 1) as p:
        c0 = gpuipc._gpuipc.counters()
        t = p.conn.recv(as_torch=True, timeout=30)
        assert isinstance(t, fake_torch.Tensor)
        assert t.shape == (64,) and t.dtype == (0, 32, 1)  # int32
        assert drv().dtoh(t.data_ptr(), 256) == pattern(256, 0)
        t2, meta = p.conn.recv(as_torch=True, with_meta=True, timeout=30)
        assert meta == b"1" and drv().dtoh(t2.data_ptr(), 256) == pattern(256, 1)
        assert ("from_dlpack",) in fake_torch.calls and ("stream", 0) in fake_torch.calls
        assert gpuipc._gpuipc.counters()["received"] == c0["received"] + 2
        assert p.conn.outstanding()[1] == 2
        assert leases_of(p, 2) == 2  # the producer's blocks stay leased
        del t2  # the second goes first: release order follows the tensors
        assert p.conn.outstanding()[1] == 1
        assert leases_of(p, 1) == 1
        del t
        assert p.conn.outstanding()[1] == 0
        assert leases_of(p, 0) == 0
        c1 = gpuipc._gpuipc.counters()
        assert c1["received"] == c0["received"] and c1["capsule_refs"] == c0["capsule_refs"]
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


def test_as_torch_waits_on_torch_current_stream(fake_torch):
    s = drv().stream()
    fake_torch.current_stream[0] = s
    with gpuipc.spawn(block_sender, 1, 1) as p:
        t = p.conn.recv(as_torch=True, timeout=30)
        assert ("stream", 0) in fake_torch.calls
        # the lease goes back on that stream: the Received behind the tensor says so
        assert drv().dtoh(t.data_ptr(), 256) == pattern(256, 0)
        del t
        assert leases_of(p, 0) == 0
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


def test_recv_batch_as_torch_gives_the_batch_back_with_its_last_tensor(fake_torch):
    with gpuipc.spawn(block_sender, 4, 4) as p:
        c0 = gpuipc._gpuipc.counters()
        ts = []
        while len(ts) < 4:
            ts += p.conn.recv_batch(4, as_torch=True, timeout=30)
        assert len(ts) == 4
        for i, t in enumerate(ts):
            assert isinstance(t, fake_torch.Tensor)
            assert drv().dtoh(t.data_ptr(), 256) == pattern(256, i)
        del t
        assert p.conn.outstanding()[1] == 4
        last = ts.pop()
        del ts
        gc.collect()
        assert p.conn.outstanding()[1] == 4  # one release for the batch, with the last
        assert leases_of(p, 4) == 4
        del last
        assert p.conn.outstanding()[1] == 0
        assert leases_of(p, 0) == 0
        assert gpuipc._gpuipc.counters()["received"] == c0["received"]
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


def test_recv_batch_as_torch_with_meta(fake_torch):
    with gpuipc.spawn(block_sender, 3, 3) as p:
        got = []
        while len(got) < 3:
            got += p.conn.recv_batch(8, as_torch=True, with_meta=True, timeout=30)
        assert [m for _, m in got] == [b"0", b"1", b"2"]
        del got
        assert leases_of(p, 0) == 0
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


def test_as_torch_after_close_keeps_the_memory_until_the_tensor_dies(fake_torch):
    with gpuipc.spawn(block_sender, 1, 1) as p:
        t = p.conn.recv(as_torch=True, timeout=30)
        p.conn.close()
        assert drv().dtoh(t.data_ptr(), 256) == pattern(256, 0)  # still mapped
        del t
        assert p.join(30) == 0


def no_torch_child(conn):
    """Without torch anywhere on its path: reports what recv(as_torch=True)
    says, and that the buffer is still there to receive."""
    out = {}
    try:
        conn.recv(as_torch=True, timeout=10)
        out["error"] = None
    except ImportError as e:
        out["error"] = str(e)
    rx = conn.recv(timeout=10)  # nothing was taken
    out["after"] = rx.nbytes
    rx.release()
    conn.send_msg(json.dumps(out).encode())
    conn.recv_msg(timeout=30)


def test_as_torch_without_torch_is_a_clear_error():
    if _real_torch():
        pytest.skip("a real torch is importable here")
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(64)
    with gpuipc.spawn(no_torch_child) as p:
        p.conn.send(b)
        r = report(p.conn)
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0
    assert r["error"] and "as_torch=True needs torch" in r["error"], r
    assert r["after"] == 64


def exchange_child(conn):
    """With the stand-in offering the DLPack C exchange API (a capsule of
    ctypes functions): reports what recv(as_torch=True) made and called."""
    sys.path.insert(0, os.path.join(HERE, "faketorch"))
    import torch
    t = conn.recv(as_torch=True, timeout=30)
    out = {"type": type(t).__name__, "version": list(t.version), "shape": list(t.shape),
           "data": drv().dtoh(t.data_ptr(), 256).hex(), "calls": [c[0] for c in torch.calls],
           "held": conn.outstanding()[1]}
    del t
    out["held_after"] = conn.outstanding()[1]
    out["capsule_refs"] = gpuipc._gpuipc.counters()["capsule_refs"]
    conn.send_msg(json.dumps(out).encode())
    conn.recv_msg(timeout=30)


def test_as_torch_through_the_dlpack_c_exchange_api():
    if _real_torch():
        pytest.skip("a real torch is importable here")
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(256, shape=(64,), dtype="int32")
    drv().htod(b.ptr, pattern(256, 7))
    with gpuipc.spawn(exchange_child, env={"FAKETORCH_EXCHANGE": "1"}) as p:
        p.conn.send(b)
        r = report(p.conn)
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0
    assert r["type"] == "VTensor" and r["version"] == [1, 0] and r["shape"] == [64], r
    assert bytes.fromhex(r["data"]) == pattern(256, 7)
    assert "exchange_to_py" in r["calls"] and "exchange_stream" in r["calls"], r
    assert "from_dlpack" not in r["calls"] and "stream" not in r["calls"], r
    assert r["held"] == 1 and r["held_after"] == 0 and r["capsule_refs"] == 0, r


# --- arguments --------------------------------------------------------------------


def test_fastcall_arguments_are_checked():
    with gpuipc.spawn(late_sender, 0) as p:
        ca = p.conn
        with pytest.raises(TypeError, match="unexpected keyword argument 'strem'"):
            ca.recv(strem=None)
        with pytest.raises(TypeError, match="positional"):
            ca.recv(None)
        with pytest.raises(TypeError, match="as_torch must be True or False"):
            ca.recv(as_torch=1)
        with pytest.raises(ValueError, match="with_meta"):
            ca.recv(with_meta=True, timeout=0)
        with pytest.raises(ValueError, match="spin_us"):
            ca.recv(spin_us=-1, timeout=0)
        with pytest.raises(TypeError, match="missing required argument 'obj'"):
            ca.send()
        with pytest.raises(TypeError, match="multiple values"):
            ca.send(1, obj=2)
        with pytest.raises(TypeError, match="missing required argument 'max'"):
            ca.recv_batch()
        ca.send_msg(b"go")
        ca.recv(timeout=30).release()  # nothing was lost to the bad calls
        ca.send_msg(b"bye")
        assert p.join(30) == 0


def test_a_miss_without_waiting_is_a_timeout_error():
    with gpuipc.spawn(late_sender, 0) as p:
        for _ in range(3):
            with pytest.raises(gpuipc.TimeoutError) as ei:
                p.conn.recv(timeout=0)
            assert ei.value.status_name == "GPUIPC_E_TIMEOUT" and "recv" in str(ei.value)
        p.conn.send_msg(b"go")
        rx = p.conn.recv(timeout=30)
        assert rx.meta == b"late"
        rx.release()
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


def test_two_dlpack_exports_at_once():
    """The first export uses the Received's own storage, a second one made
    while the first lives gets its own; both release their reference."""
    with gpuipc.spawn(block_sender, 1, 1) as p:
        rx = p.conn.recv(timeout=30)
        c0 = gpuipc._gpuipc.counters()["capsule_refs"]
        cap1 = rx.__dlpack__()
        cap2 = rx.__dlpack__(stream=None, max_version=(1, 0))
        assert gpuipc._gpuipc.counters()["capsule_refs"] == c0 + 2
        del cap1
        cap3 = rx.__dlpack__(None)
        del cap2, cap3
        assert gpuipc._gpuipc.counters()["capsule_refs"] == c0
        with pytest.raises(TypeError):
            rx.__dlpack__(None, None)
        rx.release()
        assert leases_of(p, 0) == 0
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


# --- the wait loop ------------------------------------------------------------------


@pytest.mark.parametrize("spin_us", [0, 200000])
def test_spin_then_sleep_both_deliver(spin_us):
    """A buffer sent while the receiver spins (spin_us long), and one sent
    while it sleeps (a delay past any spin), both arrive."""
    with gpuipc.spawn(late_sender, 0.0) as p:
        p.conn.send_msg(b"go")
        rx = p.conn.recv(timeout=30, spin_us=spin_us)
        assert rx.meta == b"late"
        rx.release()
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0
    with gpuipc.spawn(late_sender, 0.4) as p:
        p.conn.send_msg(b"go")
        rx = p.conn.recv(timeout=30, spin_us=spin_us)
        assert rx.meta == b"late"
        rx.release()
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


def test_timeout_none_waits_past_the_connection_timeout():
    with gpuipc.spawn(late_sender, 0.6) as p:
        p.conn.timeout = 0.1
        p.conn.send_msg(b"go")
        rx = p.conn.recv(timeout=None)  # None: forever, not the connection's 0.1 s
        assert rx.meta == b"late"
        rx.release()
        p.conn.send_msg(b"bye")
        assert p.join(30) == 0


class _Alarm(Exception):
    pass


def test_a_signal_interrupts_a_wait_without_end():
    """recv(timeout=None) waits in slices: a signal handler that raises
    ends it (Ctrl-C works), and the connection stays usable."""
    import signal

    def on_alarm(sig, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with gpuipc.spawn(late_sender, 0.0) as p:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(_Alarm):
                p.conn.recv(timeout=None, spin_us=0)  # nothing comes until "go"
            p.conn.send_msg(b"go")
            rx = p.conn.recv(timeout=30)
            assert rx.meta == b"late"
            rx.release()
            p.conn.send_msg(b"bye")
            assert p.join(30) == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def waits_for_go(conn):
    """Waits for the parent's "go", then exits 0."""
    conn.recv_msg(timeout=120)


@pytest.mark.parametrize("wait", ["recv_msg", "join", "accept", "subscriber_recv"])
def test_a_signal_interrupts_every_wait_without_end(wait):
    """Each of the package's waits with timeout=None (the one loop,
    gpy_wait_loop) ends when a signal handler raises, and what it waited
    on stays usable afterwards."""
    import signal

    def on_alarm(sig, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with gpuipc.spawn(waits_for_go) as p:
            lst = gpuipc.listen("pyt-sig-%d" % os.getpid()) if wait == "accept" else None
            sub = gpuipc.Subscriber(p.conn) if wait == "subscriber_recv" else None
            call = {
                "recv_msg": lambda: p.conn.recv_msg(timeout=None),
                "join": lambda: p.join(None),
                "accept": lambda: lst.accept(timeout=None),
                "subscriber_recv": lambda: sub.recv(timeout=None),
            }[wait]
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            t0 = time.monotonic()
            with pytest.raises(_Alarm):
                call()  # nothing comes: only the signal ends it
            assert time.monotonic() - t0 < 20
            if sub is not None:
                sub.close()
            if lst is not None:
                lst.close()
            p.conn.send_msg(b"go")  # the connection still works
            assert p.join(30) == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_connect_waits_for_the_listener_to_appear():
    name = "pyt-late-%d" % os.getpid()
    with gpuipc.spawn(late_listener, name, 0.5) as p:
        c = gpuipc.connect(name, timeout=30)  # nobody listens yet when this starts
        assert c.recv_msg(timeout=30) == b"hello"
        assert p.conn.recv_msg(timeout=30) == b"listening"
        c.send_msg(b"bye")
        c.close()
        assert p.join(30) == 0


def test_connect_with_timeout_none_waits_too():
    name = "pyt-late-none-%d" % os.getpid()
    with gpuipc.spawn(late_listener, name, 0.3) as p:
        c = gpuipc.connect(name, timeout=None)
        assert c.recv_msg(timeout=30) == b"hello"
        c.send_msg(b"bye")
        c.close()
        assert p.join(30) == 0


def test_connect_to_nobody_says_not_found_after_its_timeout():
    with pytest.raises(gpuipc.NotFoundError, match="nobody"):
        gpuipc.connect("pyt-nobody-%d" % os.getpid(), timeout=0.2)
    with pytest.raises(gpuipc.NotFoundError):
        gpuipc.connect("pyt-nobody-%d" % os.getpid(), timeout=0)


# --- no leak ----------------------------------------------------------------------

N_SENDS = int(os.environ.get("GPUIPC_TEST_SENDS", "10000"))


@pytest.mark.parametrize("as_torch", [False, True])
def test_no_reference_leak_over_many_receives(as_torch, request):
    """N_SENDS buffers (10,000; GPUIPC_TEST_SENDS=100000 for the long run)
    received, viewed and dropped: no memory grows (tracemalloc), the
    package's counters come back, the producer gets every block back."""
    if as_torch:
        request.getfixturevalue("fake_torch")
    n = N_SENDS
    with gpuipc.spawn(many_sender, n) as p:
        gc.collect()
        c0 = gpuipc._gpuipc.counters()
        tracemalloc.start()
        snap0 = None
        for i in range(n):
            if as_torch:
                t = p.conn.recv(as_torch=True, timeout=30)
                del t
            else:
                rx = p.conn.recv(timeout=30)
                cap = rx.__dlpack__()
                del cap, rx
            if i == 500:
                gc.collect()
                snap0 = tracemalloc.take_snapshot()
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        assert grown < 64 * 1024, f"{grown} bytes more after {n} receives"
        c1 = gpuipc._gpuipc.counters()
        assert c1["received"] == c0["received"] and c1["capsule_refs"] == c0["capsule_refs"]
        assert p.conn.outstanding()[1] == 0
        p.conn.send_msg(b"go")
        assert p.join(60) == 0
