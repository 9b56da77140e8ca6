#!/usr/bin/env python3
"""cuda.core <-> gpuipc through an IPC-enabled memory pool (pool fd +
64-byte pointer export data), both directions; prints what each direction
costs per buffer.

cuda.core side: its public API (Device, DeviceMemoryResource with
DeviceMemoryResourceOptions(ipc_enabled=True), get_allocation_handle,
Buffer.get_ipc_descriptor, DeviceMemoryResource.from_allocation_handle,
Buffer.from_ipc_descriptor), except where it has no public route for raw
bytes; the script says which route it took:

- Reading the 64 bytes out of an IPCBufferDescriptor: cuda.core 1.2.0 has
  no public accessor (the descriptor exposes only .size); the bytes are
  reachable through the descriptor's pickle reduction (__reduce__), which
  is how multiprocessing moves it.
- Building an IPCBufferDescriptor from raw bytes (gpuipc -> cuda.core):
  IPCBufferDescriptor() refuses direct construction, and cuda.core 1.2.0
  offers no public constructor from (bytes, size); the script rebuilds one
  through the same reduction protocol, i.e. the callable __reduce__ names
  (the private IPCBufferDescriptor._init), with the payload and size
  swapped in. That is the missing public piece:
  IPCBufferDescriptor.from_bytes(payload, size) (or similar) would close it.
- The pool's fd goes both ways publicly: mr.get_allocation_handle().handle,
  and DeviceMemoryResource.from_allocation_handle(device, fd) accepts an int.

Usage: cuda_core_interop.py --peer PATH_TO_gpuipc-tests [--n N] [--size BYTES]
       [--backend cuda.core|ctypes]   (ctypes: the same protocol with the
       driver's pool API through ctypes, no cuda.core: a check of the peer
       on any driver, the emulator included)
Exit 0: passed; 77: skipped (says why); 1: failed (says why).
"""

import argparse
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpuipc_peer as gp  # noqa: E402


def descriptor_payload(desc):
    """(64 payload bytes, route) of an IPCBufferDescriptor."""
    for attr in ("payload", "reserved", "data"):  # public names, if any
        v = getattr(desc, attr, None)
        if isinstance(v, (bytes, bytearray)) and len(v) == 64:
            return bytes(v), f"public attribute .{attr}"
    fn, args = desc.__reduce__()[:2]
    for a in args:
        if isinstance(a, (bytes, bytearray)) and len(a) == 64:
            return bytes(a), "pickle reduction (__reduce__): no public accessor"
    gp.fail(f"cannot find the 64 export bytes in {type(desc).__name__}: "
            f"reduce gives {fn!r} with {len(args)} args")


def descriptor_factory(template):
    """A function (payload, size) -> IPCBufferDescriptor, and its route,
    built from a local descriptor's reduction."""
    cls = type(template)
    for name in ("from_bytes", "from_payload", "from_reserved"):
        f = getattr(cls, name, None)
        if f is not None and not name.startswith("_"):
            return (lambda p, n, f=f: f(p, n)), f"public {cls.__name__}.{name}"
    fn, args = template.__reduce__()[:2]
    size = template.size
    idx_payload = [i for i, a in enumerate(args)
                   if isinstance(a, (bytes, bytearray)) and len(a) == 64]
    idx_size = [i for i, a in enumerate(args)
                if isinstance(a, int) and not isinstance(a, bool) and a == size]
    if len(idx_payload) != 1 or len(idx_size) != 1:
        gp.fail(f"cannot rebuild {cls.__name__} from bytes: reduce gives "
                f"{fn!r} with args of types {[type(a).__name__ for a in args]}")

    def make(payload, n):
        a = list(args)
        a[idx_payload[0]] = payload
        a[idx_size[0]] = n
        return fn(*a)

    return make, (f"{getattr(fn, '__qualname__', fn)!s} via the pickle "
                  "reduction: no public constructor from bytes")


def ctypes_run(peer, drv, uuid, n, size):
    """The same two directions with the driver API (ctypes) in place of
    cuda.core: a check of the peer and the protocol on any driver."""
    a = gp.Costs("driver pool->gpuipc (pool fd + export data; gpuipc imports)")
    b = gp.Costs("gpuipc->driver pool (gpuipc exports; the driver imports)")
    pool = drv.pool_create(0)
    fd = drv.pool_export_fd(pool)
    ptrs = [drv.pool_alloc(pool, size) for _ in range(n)]
    for k, p in enumerate(ptrs):
        seed = (k * 17 + 5) & 0xFF
        drv.htod(p, gp.pattern(size, seed))
        t0 = gp.now()
        data = drv.pool_export_pointer(p)
        t1 = gp.now()
        words, _ = peer.call(f"mempool_import {data.hex()} 0 {size} {uuid} {seed}", fd=fd)
        a.add("driver cuMemPoolExportPointer", t1 - t0)
        a.add("gpuipc import", int(words[1]) / 1e9)
        a.add("gpuipc close", int(words[2]) / 1e9)
    for p in ptrs:
        drv.pool_free(p)
    os.close(fd)
    print(f"driver pool->gpuipc: {n} buffers imported and checked by gpuipc", flush=True)
    ipool = None
    for k in range(n):
        seed = (k * 31 + 9) & 0xFF
        seed2 = (seed + 77) & 0xFF
        words, pfd = peer.call(f"mempool_export {size} {seed}")
        if pfd is None:
            gp.fail("the peer sent no pool fd")
        data, off, nbytes = bytes.fromhex(words[1]), int(words[2]), int(words[3])
        b.add("gpuipc export", int(words[5]) / 1e9)
        if ipool is None:
            ipool = drv.pool_import(pfd, 0)
        os.close(pfd)
        t0 = gp.now()
        p = drv.pool_import_pointer(ipool, data)
        t1 = gp.now()
        if drv.dtoh(p + off, nbytes) != gp.pattern(nbytes, seed):
            gp.fail(f"buffer {k}: wrong data in gpuipc's export")
        drv.htod(p + off, gp.pattern(nbytes, seed2))
        t2 = gp.now()
        drv.free(p)
        t3 = gp.now()
        peer.call(f"check {seed2}")
        b.add("driver cuMemPoolImportPointer", t1 - t0)
        b.add("driver cuMemFree (imported)", t3 - t2)
    print(f"gpuipc->driver pool: {n} buffers imported, checked and written", flush=True)
    return a, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--backend", choices=["cuda.core", "ctypes"], default="cuda.core")
    args = ap.parse_args()
    if args.backend == "ctypes":
        drv = gp.Driver()
        drv.make_current(0)
        peer = gp.Peer(args.peer)
        a, b = ctypes_run(peer, drv, drv.uuid_hex(0), args.n, args.size)
        peer.close()
        a.report()
        b.report()
        print("PASS", flush=True)
        return 0

    try:
        import cuda.core as cc
        from cuda.core import Buffer, Device, DeviceMemoryResource, \
            DeviceMemoryResourceOptions
    except Exception as e:
        gp.skip(f"cuda.core (with Buffer, Device, DeviceMemoryResource, "
                f"DeviceMemoryResourceOptions) is not importable: {e!r}")
    try:
        dev = Device(0)
        dev.set_current()
    except Exception as e:
        gp.skip(f"cuda.core cannot use CUDA here: {e!r}")
    print(f"cuda.core {getattr(cc, '__version__', '?')}", flush=True)
    drv = gp.Driver()
    drv.make_current(0)
    uuid = drv.uuid_hex(0)
    n, size = args.n, args.size

    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(
        ipc_enabled=True, max_size=max(size * (n + 2), 64 << 20)))
    alloc_handle = mr.get_allocation_handle()  # keep: it owns the fd
    pool_fd = int(alloc_handle.handle)

    peer = gp.Peer(args.peer)
    a = gp.Costs("cuda.core->gpuipc (pool fd + export data; gpuipc imports)")
    b = gp.Costs("gpuipc->cuda.core (gpuipc exports pool fd + export data; "
                 "cuda.core imports)")

    # 1. cuda.core exports, gpuipc imports.
    bufs = [mr.allocate(size) for _ in range(n)]
    dev.sync()
    route_out = None
    for k, buf in enumerate(bufs):
        seed = (k * 17 + 5) & 0xFF
        drv.htod(int(buf.handle), gp.pattern(size, seed))
        t0 = gp.now()
        desc = buf.get_ipc_descriptor()
        t1 = gp.now()
        payload, route_out = descriptor_payload(desc)
        t2 = gp.now()
        words, _ = peer.call(
            f"mempool_import {payload.hex()} 0 {desc.size} {uuid} {seed}",
            fd=pool_fd)
        t3 = gp.now()
        a.add("cuda.core get_ipc_descriptor", t1 - t0)
        a.add("gpuipc import", int(words[1]) / 1e9)
        a.add("gpuipc close", int(words[2]) / 1e9)
        a.add("round trip incl. check", t3 - t2)
    for buf in bufs:
        buf.close()
    dev.sync()
    print(f"cuda.core->gpuipc: {n} buffers imported and checked by gpuipc; "
          f"export bytes read through: {route_out}", flush=True)

    # 2. gpuipc exports, cuda.core imports.
    template = mr.allocate(256).get_ipc_descriptor()
    make_desc, route_in = descriptor_factory(template)
    imr = None
    for k in range(n):
        seed = (k * 31 + 9) & 0xFF
        seed2 = (seed + 77) & 0xFF
        words, fd = peer.call(f"mempool_export {size} {seed}")
        if fd is None:
            gp.fail("the peer sent no pool fd")
        payload, off, nbytes = bytes.fromhex(words[1]), int(words[2]), int(words[3])
        b.add("gpuipc export", int(words[5]) / 1e9)
        t0 = gp.now()
        if imr is None:
            # The pool is imported once; later buffers reuse it.
            imr = DeviceMemoryResource.from_allocation_handle(dev, fd)
            b.add("cuda.core from_allocation_handle (first buffer only)", gp.now() - t0)
        os.close(fd)
        t1 = gp.now()
        ib = Buffer.from_ipc_descriptor(imr, make_desc(payload, off + nbytes))
        t2 = gp.now()
        ptr = int(ib.handle) + off
        if drv.dtoh(ptr, nbytes) != gp.pattern(nbytes, seed):
            gp.fail(f"buffer {k}: cuda.core read the wrong data from gpuipc's export")
        drv.htod(ptr, gp.pattern(nbytes, seed2))
        t3 = gp.now()
        ib.close()
        dev.sync()
        t4 = gp.now()
        peer.call(f"check {seed2}")
        b.add("cuda.core Buffer.from_ipc_descriptor", t2 - t1)
        b.add("cuda.core Buffer.close", t4 - t3)
    print(f"gpuipc->cuda.core: {n} buffers opened, checked and written by "
          f"cuda.core; descriptor built through: {route_in}", flush=True)
    peer.close()
    a.report()
    b.report()
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
