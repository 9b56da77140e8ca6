"""Processes of test_ns.py, run as scripts: an exporter that may be started
in a pid namespace of its own (unshare), and an importer. They talk to the
test over stdin/stdout, one JSON object a line."""
import ctypes
import gc
import json
import os
import sys
import time
import weakref

sys.path.insert(0, os.environ.get("GPUIPC_PKG_DIR") or os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpuipc  # noqa: E402
from cudrv import drv, pattern  # noqa: E402


def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def hear():
    return json.loads(sys.stdin.readline())


class PoolArray:
    """Device memory of a stream-ordered pool with POSIX fd export (what a
    legacy handle cannot do, this crosses pid namespaces), allocated
    outside gpuipc: gpuipc wraps it when it is sent."""

    def __init__(self, n):
        d = drv()
        d._current()
        props = (ctypes.c_int * 32)()  # CUmemPoolProps, zeroed
        props[0] = 1  # allocType: PINNED
        props[1] = 1  # handleTypes: POSIX_FILE_DESCRIPTOR
        props[2] = 1  # location.type: DEVICE
        props[3] = 0  # location.id
        self.pool = ctypes.c_void_p()
        d._check(d.lib.cuMemPoolCreate(ctypes.byref(self.pool), props), "cuMemPoolCreate")
        p = ctypes.c_uint64()
        d._check(d.lib.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(n), self.pool,
                                               ctypes.c_void_p(0)), "cuMemAllocFromPoolAsync")
        d._check(d.lib.cuCtxSynchronize(), "cuCtxSynchronize")
        self.ptr = p.value
        self.n = n

    @property
    def __cuda_array_interface__(self):
        return {"version": 3, "shape": (self.n,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "stream": None}


class Mine:
    pass


def exporter(runtime_dir):
    lst = gpuipc.listen("ns", runtime_dir=runtime_dir)
    say(listening=True)
    c = lst.accept(timeout=30)
    peer_pid = c.peer[0]
    arr = PoolArray(4096)
    drv().htod(arr.ptr, pattern(4096, 7))
    alive = weakref.ref(arr)
    c.send(arr)
    del arr  # only what gpuipc keeps holds it now
    # And an object of the application's, kept for the peer's lifetime.
    mine = Mine()
    mine_alive = weakref.ref(mine)
    c.keep_until_peer_exits(mine)
    del mine
    msg = c.recv_msg(timeout=30)
    c.close()
    gpuipc.collect()
    gc.collect()
    say(peer_pid=peer_pid, msg=msg.decode(), alive_after_close=alive() is not None,
        mine_after_close=mine_alive() is not None,
        kept=gpuipc._gpuipc.counters().get("kept"))
    assert hear() == {"dead": True}
    end = time.monotonic() + 30
    while (alive() is not None or mine_alive() is not None) and time.monotonic() < end:
        gpuipc.collect()
        time.sleep(0.01)
    say(alive_after_death=alive() is not None, mine_after_death=mine_alive() is not None,
        kept=gpuipc._gpuipc.counters().get("kept"))


def importer(runtime_dir):
    c = gpuipc.connect("ns", runtime_dir=runtime_dir, timeout=30)
    r = c.recv(timeout=30)
    ok = drv().dtoh(r.ptr, 4096) == pattern(4096, 7)
    c.send_msg(b"held" if ok else b"bad data")
    say(held=ok)
    time.sleep(3600)  # holds it until killed


if __name__ == "__main__":
    {"exporter": exporter, "importer": importer}[sys.argv[1]](sys.argv[2])
