"""The collector sees the references gpuipc objects hold: a reference cycle
through a Buffer's owner (an object that keeps the Buffer wrapping its
memory), or through a Shared and its Buffer, is collected; one whose
Buffer a peer still holds is left alone (its owner's finalizer would free
the memory the peer maps) until the peer is gone."""
import gc
import json
import signal
import time
import weakref

import gpuipc
import peers
from cudrv import DeviceArray


class Holder(DeviceArray):
    """Device memory that keeps what gpuipc made of it."""


def test_cycle_through_a_wrapped_buffer_is_collected():
    h = Holder((256,))
    h.buf = gpuipc.Buffer.wrap(h)
    w, wb = weakref.ref(h), weakref.ref(h.buf)
    n0 = gpuipc._gpuipc.counters()["buffers"]
    del h
    gc.collect()
    assert w() is None and wb() is None
    assert gpuipc._gpuipc.counters()["buffers"] == n0 - 1


def test_cycle_through_shared_is_collected():
    h = Holder((256,))
    h.shared = gpuipc.share(h)
    w = weakref.ref(h)
    del h
    gc.collect()
    assert w() is None


def test_cycle_whose_buffer_a_peer_holds_keeps_the_memory_until_it_is_gone():
    p = gpuipc.spawn(peers.holder, 1)
    try:
        h = Holder((256,))
        h.buf = gpuipc.Buffer.wrap(h)
        p.conn.send(h.buf)
        assert json.loads(p.conn.recv_msg(timeout=30)) == {"holding": 1}
        w = weakref.ref(h)
        del h
        gc.collect()
        # garbage, but the peer maps the memory: not finalized (its
        # __del__ would free the memory)
        assert w() is not None
        p.kill(signal.SIGKILL)
        p.join(30)
        end = time.monotonic() + 30
        while w() is not None and time.monotonic() < end:
            try:
                p.conn.progress(0.05)
            except (gpuipc.PeerGoneError, gpuipc.ClosedError):
                pass
            gpuipc.collect()
            gc.collect()
        assert w() is None
    finally:
        p.close()
