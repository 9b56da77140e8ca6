#!/usr/bin/env python3
"""CuPy <-> gpuipc through raw legacy IPC handles, both directions, with
interprocess events; prints what each direction costs per buffer.

CuPy side: nothing but CuPy's raw runtime API (ipcGetMemHandle /
ipcOpenMemHandle / ipcCloseMemHandle, eventCreateWithFlags /
ipcGetEventHandle / ipcOpenEventHandle). The gpuipc side is the peer
process (gpuipc_buffer_import_legacy_raw / gpuipc_buffer_export_legacy_raw,
gpuipc_event_import_raw / gpuipc_event_export_raw).

1. CuPy exports: arrays that CuPy's memory pool carved out of one larger
   block (so their handles are the block's, and the offset travels beside
   them), filled on a stream with an IPC event recorded after the fill and
   sent WITHOUT synchronizing: the peer orders its read after the event.
2. gpuipc exports: a buffer at an interior offset of a larger allocation,
   with an event recorded after its fill; CuPy opens the handle, waits on
   the event, checks the data on the GPU, writes a new pattern back, which
   the peer checks.

Usage: cupy_interop.py --peer PATH_TO_gpuipc-tests [--n N] [--size BYTES]
       [--backend cupy|ctypes]   (ctypes: the same protocol through the
       driver API with ctypes, no CuPy: a check of the peer on any driver)
Exit 0: passed; 77: skipped (says why); 1: failed (says why).
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpuipc_peer as gp  # noqa: E402

EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess


def device_pattern(cp, n, seed):
    i = cp.arange(n, dtype=cp.uint32)
    return ((i * 7 + seed) & 0xFF).astype(cp.uint8)


def cupy_exports(cp, peer, drv, uuid, n, size, costs):
    rt = cp.cuda.runtime
    # One large block freed into the pool, then arrays carved out of it.
    big = cp.empty(size * (n + 2), dtype=cp.uint8)
    del big
    arrays = [cp.empty(size, dtype=cp.uint8) for _ in range(n)]
    stream = cp.cuda.Stream(non_blocking=True)
    interior = 0
    for k, a in enumerate(arrays):
        seed = (k * 13 + 1) & 0xFF
        ev = rt.eventCreateWithFlags(EVENT_FLAGS)
        with stream:
            a[...] = device_pattern(cp, size, seed)
        rt.eventRecord(ev, stream.ptr)
        t0 = gp.now()
        handle = rt.ipcGetMemHandle(a.data.ptr)
        ev_handle = rt.ipcGetEventHandle(ev)
        t1 = gp.now()
        base, _ = drv.address_range(a.data.ptr)
        offset = a.data.ptr - base
        interior += offset > 0
        t2 = gp.now()
        words, _ = peer.call(
            f"legacy_import {bytes(handle).hex()} {offset} {size} {uuid} {seed} "
            f"{bytes(ev_handle).hex()}")
        t3 = gp.now()
        costs.add("CuPy ipcGetMemHandle+ipcGetEventHandle", t1 - t0)
        costs.add("gpuipc import", int(words[1]) / 1e9)
        costs.add("gpuipc close", int(words[2]) / 1e9)
        costs.add("round trip incl. check", t3 - t2)
        rt.eventDestroy(ev)
    stream.synchronize()
    if interior == 0:
        gp.fail("CuPy's pool gave no interior arrays: the offset path was not "
                "exercised")
    print(f"cupy->gpuipc: {n} arrays ({interior} at interior offsets of a "
          "pooled block) imported and checked by gpuipc", flush=True)


def gpuipc_exports(cp, peer, n, size, costs):
    rt = cp.cuda.runtime
    stream = cp.cuda.Stream(non_blocking=True)
    for k in range(n):
        seed = (k * 29 + 3) & 0xFF
        seed2 = (seed + 101) & 0xFF
        words, _ = peer.call(f"legacy_export {size} {seed}")
        handle, offset, nbytes = bytes.fromhex(words[1]), int(words[2]), int(words[3])
        ev_handle = bytes.fromhex(words[5])
        costs.add("gpuipc export", int(words[6]) / 1e9)
        t0 = gp.now()
        base = rt.ipcOpenMemHandle(handle)
        t1 = gp.now()
        ev = rt.ipcOpenEventHandle(ev_handle)
        rt.streamWaitEvent(stream.ptr, ev, 0)
        mem = cp.cuda.UnownedMemory(base, offset + nbytes, owner=None)
        arr = cp.ndarray((nbytes,), dtype=cp.uint8,
                         memptr=cp.cuda.MemoryPointer(mem, offset))
        with stream:
            good = bool((arr == device_pattern(cp, nbytes, seed)).all())
            arr[...] = device_pattern(cp, nbytes, seed2)
        stream.synchronize()
        if not good:
            gp.fail(f"buffer {k}: CuPy read the wrong data from gpuipc's export")
        del arr, mem
        t2 = gp.now()
        rt.ipcCloseMemHandle(base)
        t3 = gp.now()
        rt.eventDestroy(ev)
        peer.call(f"check {seed2}")
        costs.add("CuPy ipcOpenMemHandle", t1 - t0)
        costs.add("CuPy ipcCloseMemHandle", t3 - t2)
    print(f"gpuipc->cupy: {n} buffers opened, checked and written by CuPy",
          flush=True)


def ctypes_exports(drv, peer, uuid, n, size, costs):
    block = drv.alloc(size * (n + 1))
    for k in range(n):
        seed = (k * 13 + 1) & 0xFF
        ptr = block + 4096 + k * size
        drv.htod(ptr, gp.pattern(size, seed))
        t0 = gp.now()
        handle = drv.ipc_get(ptr)
        t1 = gp.now()
        base, _ = drv.address_range(ptr)
        words, _ = peer.call(
            f"legacy_import {handle.hex()} {ptr - base} {size} {uuid} {seed}")
        costs.add("driver cuIpcGetMemHandle", t1 - t0)
        costs.add("gpuipc import", int(words[1]) / 1e9)
        costs.add("gpuipc close", int(words[2]) / 1e9)
    drv.free(block)
    print(f"driver->gpuipc: {n} interior buffers imported and checked", flush=True)


def ctypes_imports(drv, peer, n, size, costs):
    for k in range(n):
        seed = (k * 29 + 3) & 0xFF
        seed2 = (seed + 101) & 0xFF
        words, _ = peer.call(f"legacy_export {size} {seed}")
        handle, offset, nbytes = bytes.fromhex(words[1]), int(words[2]), int(words[3])
        costs.add("gpuipc export", int(words[6]) / 1e9)
        t0 = gp.now()
        base = drv.ipc_open(handle)
        t1 = gp.now()
        if drv.dtoh(base + offset, nbytes) != gp.pattern(nbytes, seed):
            gp.fail(f"buffer {k}: wrong data in gpuipc's export")
        drv.htod(base + offset, gp.pattern(nbytes, seed2))
        t2 = gp.now()
        drv.ipc_close(base)
        t3 = gp.now()
        peer.call(f"check {seed2}")
        costs.add("driver cuIpcOpenMemHandle", t1 - t0)
        costs.add("driver cuIpcCloseMemHandle", t3 - t2)
    print(f"gpuipc->driver: {n} buffers opened, checked and written", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--backend", choices=["cupy", "ctypes"], default="cupy")
    args = ap.parse_args()

    cp = None
    if args.backend == "cupy":
        try:
            import cupy as cp
        except Exception as e:  # ImportError, or CUDA libraries missing
            gp.skip(f"CuPy is not importable: {e!r}")
        try:
            if cp.cuda.runtime.getDeviceCount() < 1:
                gp.skip("no CUDA device visible to CuPy")
        except Exception as e:
            gp.skip(f"CuPy cannot use CUDA here: {e!r}")
        cp.cuda.Device(0).use()
        print(f"CuPy {cp.__version__}", flush=True)
    drv = gp.Driver()
    drv.make_current(0)
    uuid = drv.uuid_hex(0)

    peer = gp.Peer(args.peer)
    a = gp.Costs("cupy->gpuipc (CuPy exports raw legacy handle + event, gpuipc imports)"
                 if cp else "driver->gpuipc")
    b = gp.Costs("gpuipc->cupy (gpuipc exports raw legacy handle + event, CuPy opens)"
                 if cp else "gpuipc->driver")
    if cp:
        cupy_exports(cp, peer, drv, uuid, args.n, args.size, a)
        gpuipc_exports(cp, peer, args.n, args.size, b)
    else:
        ctypes_exports(drv, peer, uuid, args.n, args.size, a)
        ctypes_imports(drv, peer, args.n, args.size, b)
    peer.close()
    a.report()
    b.report()
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
