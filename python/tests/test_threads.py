"""Objects closed by one thread while another uses them: the user sees an
error (closed), never a crash (use after free, double free)."""
import threading
import time

import pytest

import gpuipc
import peers


def test_subscriber_close_during_recv():
    """Subscriber.close() while another thread waits in recv(): the waiting
    recv ends with ClosedError when it next wakes; nothing freed is used."""
    p = gpuipc.spawn(peers.closed_by_parent)
    try:
        sub = gpuipc._gpuipc.TensorSetSub(p.conn)
        got = []
        started = threading.Event()

        def waiter():
            started.set()
            try:
                sub.recv(timeout=20)
                got.append("version")
            except gpuipc.Error as e:
                got.append(type(e).__name__)

        t = threading.Thread(target=waiter)
        t.start()
        started.wait(30)
        time.sleep(0.2)  # let it wait in recv (the close is checked either way)
        sub.close()
        p.kill()  # wakes the waiting recv (its socket hangs up): it looks again
        t.join(30)
        assert got == ["ClosedError"]
    finally:
        p.close(timeout=0)


@pytest.mark.parametrize("rounds", [50])
def test_buffer_close_from_two_threads(rounds):
    """Buffer.close() from two threads at once frees the buffer once."""
    pool = gpuipc.Pool(kind="legacy")
    n0 = gpuipc._gpuipc.counters()["buffers"]
    for _ in range(rounds):
        b = pool.alloc(4096)
        go = threading.Barrier(2)

        def closer():
            go.wait(30)
            b.close()

        ts = [threading.Thread(target=closer) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
    assert gpuipc._gpuipc.counters()["buffers"] == n0


def test_event_close_during_synchronize():
    """Event.close() while another thread synchronizes it: both return; the
    event is destroyed once, by the last of them."""
    for _ in range(50):
        ev = gpuipc.Event()
        ev.record()
        go = threading.Barrier(2)
        errs = []

        def sync():
            go.wait(30)
            try:
                ev.synchronize()
            except ValueError:
                errs.append("closed")  # the close came first

        t = threading.Thread(target=sync)
        t.start()
        go.wait(30)
        ev.close()
        t.join(30)
        with pytest.raises(ValueError):
            ev.synchronize()
