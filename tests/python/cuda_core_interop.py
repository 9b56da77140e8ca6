#!/usr/bin/env python3
"""cuda.core <-> gpuipc through an IPC-enabled memory pool (pool fd +
64-byte pointer export data), both directions; prints what each direction
costs per buffer.

cuda.core side: its public API, written for cuda.core 1.x and falling back
to the 0.x spellings where they differ (the script prints which route each
step took):

  step                         cuda.core >= 1.0                  0.x
  pool fd of an IPC MR         mr.allocation_handle (property)   mr.get_allocation_handle()
  buffer export                buf.ipc_descriptor (property)     buf.get_ipc_descriptor()
  allocate / import a buffer   stream= keyword, required         stream optional
  import the pool              DeviceMemoryResource.from_allocation_handle(dev, fd)
  import a buffer              Buffer.from_ipc_descriptor(mr, desc, stream=...)

(1.0 turned the no-argument getters into properties and made stream a
required keyword of allocate/from_ipc_descriptor; 1.1 added a check that
an imported descriptor's size fits the mapped allocation.) The allocation
handle stays owned by the memory resource; its .handle is the fd (an int).
from_allocation_handle duplicates an int fd, so the caller closes its own.

Where cuda.core has no public route for raw bytes:

- Reading the 64 bytes out of an IPCBufferDescriptor: no public accessor
  (the descriptor exposes only .size); the bytes are reachable through the
  descriptor's pickle reduction (__reduce__), which is how multiprocessing
  moves it.
- Building an IPCBufferDescriptor from raw bytes (gpuipc -> cuda.core):
  IPCBufferDescriptor() refuses direct construction and there is no public
  constructor from (bytes, size); the script rebuilds one through the same
  reduction protocol, i.e. the callable __reduce__ names (the private
  IPCBufferDescriptor._init), with the payload and size swapped in, and
  checks the rebuilt descriptor round-trips before using it. That is the
  missing public piece: IPCBufferDescriptor.from_bytes(payload, size) (or
  similar) would close it.

Usage: cuda_core_interop.py --peer PATH_TO_gpuipc-tests [--n N] [--size BYTES]
       [--backend cuda.core|ctypes]   (ctypes: the same protocol with the
       driver's pool API through ctypes, no cuda.core: a check of the peer
       on any driver, the emulator included)
Exit 0: passed; 77: skipped (says why); 1: failed (says why: the step, the
exception, the cuda.core version, and what the object offers instead).
"""

import argparse
import contextlib
import os
import sys
import traceback

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpuipc_peer as gp  # noqa: E402

CC_VERSION = "?"  # cuda.core's version, for diagnostics
ROUTES = {}  # step -> the API route taken, printed once


def route(step, how):
    if step not in ROUTES:
        ROUTES[step] = how
        print(f"route: {step}: {how}", flush=True)


def public_names(obj):
    """The public attribute names of obj (its type's too), for a diagnostic."""
    names = set()
    for o in ((obj,) if isinstance(obj, type) else (obj, type(obj))):
        try:
            names.update(n for n in dir(o) if not n.startswith("_"))
        except Exception:
            pass
    return ", ".join(sorted(names)) or "(none)"


@contextlib.contextmanager
def step(what, obj=None):
    """Runs a block; any exception becomes one FAIL naming the step, the
    exception, the cuda.core version and (for a missing attribute) what the
    object offers instead."""
    try:
        yield
    except Exception as e:  # SystemExit from gp.fail/skip passes through
        traceback.print_exc(file=sys.stdout)
        extra = ""
        if obj is not None and isinstance(e, (AttributeError, TypeError)):
            extra = f"; {type(obj).__name__} offers: {public_names(obj)}"
        gp.fail(f"cuda.core {CC_VERSION}: {what}: {type(e).__name__}: {e}{extra}")


def get_attr_or_method(obj, names):
    """(value, route): the first of names obj has; a property gives its
    value, a method (the 0.x get_* spelling, or a property that became a
    method again) is called without arguments. AttributeError (listing what
    was tried) when none exists."""
    for name in names:
        try:
            v = getattr(obj, name)
        except AttributeError:
            continue
        if callable(v):  # handles and descriptors are not callable
            return v(), f"method {type(obj).__name__}.{name}()"
        return v, f"property {type(obj).__name__}.{name}"
    raise AttributeError(f"{type(obj).__name__} has none of {', '.join(names)}")


def pool_fd(mr):
    """(fd, owner object, route): the POSIX fd of an IPC-enabled memory
    resource's pool. The fd stays owned by the memory resource (cached
    there): the caller must not close it and keeps the owner alive."""
    h, how = get_attr_or_method(mr, ("allocation_handle", "get_allocation_handle"))
    if isinstance(h, int) and not isinstance(h, bool):
        return h, h, how + " (an int fd)"
    fd = getattr(h, "handle", None)
    if isinstance(fd, int) and not isinstance(fd, bool):
        return fd, h, how + f" -> {type(h).__name__}.handle"
    return int(h), h, how + f" -> int({type(h).__name__})"


def export_descriptor(buf):
    """(IPCBufferDescriptor, route) of a buffer from an IPC-enabled pool."""
    return get_attr_or_method(buf, ("ipc_descriptor", "get_ipc_descriptor"))


def call_with_stream(fn, args, stream, what):
    """fn(*args, stream=stream) (cuda.core >= 1.0 requires the keyword);
    fn(*args) where an older version takes no stream keyword."""
    try:
        return fn(*args, stream=stream), f"{what}(..., stream=...)"
    except TypeError as e:
        if "stream" not in str(e):
            raise
        first = e
    try:
        return fn(*args), f"{what}(...) without stream (refused it: {first})"
    except TypeError as e:
        raise TypeError(f"{what}: with stream=: {first}; without: {e}") from e


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
    """A function (payload, size) -> IPCBufferDescriptor, and its route:
    the first candidate (a public constructor from bytes if the version has
    one, else the callable the pickle reduction names) whose descriptor
    round-trips the template's bytes and size with the template's type."""
    cls = type(template)
    tpayload, _ = descriptor_payload(template)
    tsize = int(template.size)
    candidates = []
    for name in ("from_bytes", "from_payload", "from_reserved"):
        f = getattr(cls, name, None)
        if f is not None:
            candidates.append(((lambda p, n, f=f: f(p, n)), f"public {cls.__name__}.{name}"))
    fn, args = template.__reduce__()[:2]
    idx_payload = [i for i, a in enumerate(args)
                   if isinstance(a, (bytes, bytearray)) and len(a) == 64]
    idx_size = [i for i, a in enumerate(args)
                if isinstance(a, int) and not isinstance(a, bool) and a == tsize]
    if len(idx_payload) == 1 and len(idx_size) == 1:
        def make(payload, n):
            a = list(args)
            a[idx_payload[0]] = payload
            a[idx_size[0]] = n
            return fn(*a)
        candidates.append((make, f"{getattr(fn, '__qualname__', fn)!s} via the pickle "
                                 "reduction: no public constructor from bytes"))
    tried = []
    for make, how in candidates:
        try:
            d = make(tpayload, tsize)
            ok = (type(d) is cls and int(d.size) == tsize and
                  descriptor_payload(d)[0] == tpayload)
        except Exception as e:
            tried.append(f"{how}: {type(e).__name__}: {e}")
            continue
        if ok:
            return make, how
        tried.append(f"{how}: the rebuilt descriptor does not round-trip")
    gp.fail(f"cuda.core {CC_VERSION}: cannot rebuild {cls.__name__} from bytes: "
            f"reduce gives {fn!r} with args of types "
            f"{[type(a).__name__ for a in args]}; tried: {tried or 'nothing'}")


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


def cuda_core_run(peer, drv, uuid, n, size):
    from cuda.core import Buffer, Device, DeviceMemoryResource, \
        DeviceMemoryResourceOptions
    with step("Device(0).set_current()"):
        dev = Device(0)
        dev.set_current()
    with step("Device.default_stream", Device(0)):
        stream = dev.default_stream
        if callable(stream):
            stream = stream()
    with step("DeviceMemoryResource(dev, DeviceMemoryResourceOptions("
              "ipc_enabled=True, max_size=...))"):
        mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(
            ipc_enabled=True, max_size=max(size * (n + 2), 64 << 20)))
    with step("the pool's allocation handle (fd)", mr):
        pool_fd_int, alloc_handle, how = pool_fd(mr)  # alloc_handle: keep alive
        route("pool fd", how)
        if pool_fd_int < 0:
            gp.fail(f"cuda.core {CC_VERSION}: the allocation handle gives fd "
                    f"{pool_fd_int} (closed?)")

    a = gp.Costs("cuda.core->gpuipc (pool fd + export data; gpuipc imports)")
    b = gp.Costs("gpuipc->cuda.core (gpuipc exports pool fd + export data; "
                 "cuda.core imports)")

    # 1. cuda.core exports, gpuipc imports.
    with step("DeviceMemoryResource.allocate", mr):
        bufs = []
        for _ in range(n):
            buf, how = call_with_stream(mr.allocate, (size,), stream,
                                        "DeviceMemoryResource.allocate")
            bufs.append(buf)
        route("allocate", how)
        dev.sync()
    route_out = None
    for k, buf in enumerate(bufs):
        seed = (k * 17 + 5) & 0xFF
        with step("int(Buffer.handle)", buf):
            ptr = int(buf.handle)
        drv.htod(ptr, gp.pattern(size, seed))
        t0 = gp.now()
        with step("exporting a buffer (Buffer.ipc_descriptor)", buf):
            desc, how = export_descriptor(buf)
        t1 = gp.now()
        route("buffer export", how)
        with step("reading the export bytes and size of the descriptor", desc):
            payload, route_out = descriptor_payload(desc)
            dsize = int(desc.size)
        t2 = gp.now()
        words, _ = peer.call(
            f"mempool_import {payload.hex()} 0 {dsize} {uuid} {seed}",
            fd=pool_fd_int)
        t3 = gp.now()
        a.add("cuda.core ipc_descriptor", t1 - t0)
        a.add("gpuipc import", int(words[1]) / 1e9)
        a.add("gpuipc close", int(words[2]) / 1e9)
        a.add("round trip incl. check", t3 - t2)
    with step("Buffer.close"):
        for buf in bufs:
            buf.close()
        dev.sync()
    print(f"cuda.core->gpuipc: {n} buffers imported and checked by gpuipc; "
          f"export bytes read through: {route_out}", flush=True)

    # 2. gpuipc exports, cuda.core imports.
    with step("a template descriptor for rebuilding descriptors from bytes", mr):
        tbuf, _ = call_with_stream(mr.allocate, (256,), stream,
                                   "DeviceMemoryResource.allocate")
        template, _ = export_descriptor(tbuf)
        make_desc, route_in = descriptor_factory(template)
        tbuf.close()
        dev.sync()
    route("descriptor from bytes", route_in)
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
            # The pool is imported once; later buffers reuse it. An int fd
            # is duplicated by cuda.core; this one is ours to close.
            with step("DeviceMemoryResource.from_allocation_handle(dev, fd)",
                      DeviceMemoryResource):
                imr = DeviceMemoryResource.from_allocation_handle(dev, fd)
            route("pool import", "DeviceMemoryResource.from_allocation_handle(dev, int fd)")
            b.add("cuda.core from_allocation_handle (first buffer only)", gp.now() - t0)
        os.close(fd)
        t1 = gp.now()
        with step("Buffer.from_ipc_descriptor(imported pool, descriptor)", Buffer):
            ib, how = call_with_stream(
                Buffer.from_ipc_descriptor, (imr, make_desc(payload, off + nbytes)),
                stream, "Buffer.from_ipc_descriptor")
        t2 = gp.now()
        route("buffer import", how)
        with step("int(Buffer.handle) of an imported buffer", ib):
            ptr = int(ib.handle) + off
        if drv.dtoh(ptr, nbytes) != gp.pattern(nbytes, seed):
            gp.fail(f"buffer {k}: cuda.core read the wrong data from gpuipc's export")
        drv.htod(ptr, gp.pattern(nbytes, seed2))
        t3 = gp.now()
        with step("Buffer.close of an imported buffer", ib):
            ib.close()
            dev.sync()
        t4 = gp.now()
        peer.call(f"check {seed2}")
        b.add("cuda.core Buffer.from_ipc_descriptor", t2 - t1)
        b.add("cuda.core Buffer.close", t4 - t3)
    print(f"gpuipc->cuda.core: {n} buffers opened, checked and written by "
          f"cuda.core; descriptor built through: {route_in}", flush=True)
    print("cuda.core routes: " + "; ".join(f"{k}: {v}" for k, v in ROUTES.items()),
          flush=True)
    del alloc_handle
    return a, b


def main():
    global CC_VERSION
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
            DeviceMemoryResourceOptions  # noqa: F401
    except Exception as e:
        gp.skip(f"cuda.core (with Buffer, Device, DeviceMemoryResource, "
                f"DeviceMemoryResourceOptions) is not importable: {e!r}")
    CC_VERSION = getattr(cc, "__version__", "?")
    try:
        Device(0).set_current()
    except Exception as e:
        gp.skip(f"cuda.core {CC_VERSION} cannot use CUDA here: {e!r}")
    print(f"cuda.core {CC_VERSION}", flush=True)
    drv = gp.Driver()
    drv.make_current(0)
    uuid = drv.uuid_hex(0)
    peer = gp.Peer(args.peer)
    a, b = cuda_core_run(peer, drv, uuid, args.n, args.size)
    peer.close()
    a.report()
    b.report()
    print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
