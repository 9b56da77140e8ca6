"""Producers and consumers of the GPU framework tests (test_gpu.py), each
run in its own process by gpuipc.spawn. The tensor of every test: float32,
ROWS x COLS, element i (row-major) = i % 97; producers that can also send
a transposed view of it (torch, CuPy) do, so strides are checked too."""
import json
import os
import time

import gpuipc

ROWS, COLS = 64, 96


def expected_host(transposed):
    import array
    vals = [float(i % 97) for i in range(ROWS * COLS)]
    if transposed:
        vals = [vals[r * COLS + c] for c in range(COLS) for r in range(ROWS)]
    return array.array("f", vals).tobytes()


def _report(conn, **kw):
    conn.send_msg(json.dumps(kw).encode())


# ---- producers: return (object to send, transposed?) -----------------------

def make_torch(transposed):
    import torch
    t = (torch.arange(ROWS * COLS, device="cuda", dtype=torch.float32) % 97).reshape(ROWS, COLS)
    return (t.t() if transposed else t), transposed


def make_cupy(transposed):
    import cupy
    a = (cupy.arange(ROWS * COLS, dtype=cupy.float32) % 97).reshape(ROWS, COLS)
    return (a.T if transposed else a), transposed


def _cuda_core():
    try:
        import cuda.core as cc
        cc.Device
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc
    return cc


def make_cuda_core(transposed):
    """A Buffer of an IPC-enabled cuda.core memory resource, filled by a copy
    from the host (through the driver: cuda.core has no fill of floats)."""
    from cudrv import drv
    cc = _cuda_core()
    dev = cc.Device(0)
    dev.set_current()
    stream = dev.default_stream
    if callable(stream):
        stream = stream()
    mr = cc.DeviceMemoryResource(dev, cc.DeviceMemoryResourceOptions(
        ipc_enabled=True, max_size=64 << 20))
    n = ROWS * COLS * 4
    try:
        buf = mr.allocate(n, stream=stream)
    except TypeError:
        buf = mr.allocate(n)
    dev.sync()
    drv().htod(int(buf.handle), expected_host(False))
    class View:  # for a cuda.core whose Buffer has no (usable) DLPack
        __cuda_array_interface__ = {"shape": (ROWS, COLS), "typestr": "<f4",
                                    "data": (int(buf.handle), False), "version": 3}
    make_cuda_core.keep = (mr, buf)
    make_cuda_core.fallback = View()
    return buf, False  # its DLPack view is 1-D bytes: the consumer reshapes


def make_arena(transposed):
    """A block of a gpuipc arena, filled through a torch view (or the
    driver): the fast path."""
    a = gpuipc.Arena(chunk_bytes=16 << 20)
    b = a.alloc(shape=(ROWS, COLS), dtype="float32")
    try:
        import torch
        t = torch.from_dlpack(b)
        t.copy_((torch.arange(ROWS * COLS, device="cuda", dtype=torch.float32) % 97)
                .reshape(ROWS, COLS))
        torch.cuda.synchronize()
        make_arena.keep = (a, b, t)
        return (t.t() if transposed else t), transposed
    except ImportError:
        from cudrv import drv
        drv().htod(b.ptr, expected_host(False))
        make_arena.keep = (a,)
        return b, False


PRODUCERS = {"torch": make_torch, "torch-expandable": make_torch, "cupy": make_cupy,
             "cuda.core": make_cuda_core, "arena": make_arena}


def producer(conn, kind, name, transposed):
    """Listens on name, sends the tensor to the one consumer that connects,
    waits until it is released, reports to the parent."""
    if kind == "torch-expandable":
        import torch
        assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        torch.empty(1, device="cuda")  # the allocator starts with the setting
    try:
        with gpuipc.listen(name, timeout=60) as lst:
            _report(conn, ready=True)
            peer = lst.accept(timeout=60)
            obj, tr = PRODUCERS[kind](transposed)
            if kind in ("torch", "torch-expandable", "arena"):
                import torch
                torch.cuda.synchronize()
            meta = json.dumps({"transposed": tr}).encode()
            try:
                peer.send(obj, meta=meta)
            except (TypeError, BufferError) as e:
                if kind != "cuda.core":
                    raise
                print(f"cuda.core Buffer refused DLPack ({e}); sending a CAI view of it",
                      flush=True)
                peer.send(make_cuda_core.fallback, meta=meta)
            t0 = time.monotonic()
            while ((peer.outstanding()[0] or peer.wrapped_pending)
                   and time.monotonic() - t0 < 60):
                peer.progress(0.05)
            left = peer.outstanding()[0]
            _report(conn, sent=True, left=left, wrapped=peer.wrapped_pending)
            peer.recv_msg(timeout=60)  # the consumer's goodbye
            peer.close()
    except Exception as e:
        _report(conn, error=f"{type(e).__name__}: {e}")
        raise


# ---- consumers: check the data on the GPU -----------------------------------

def check_torch(rx, transposed):
    import torch
    t = torch.from_dlpack(rx)
    if t.dtype in (torch.int8, torch.uint8):
        t = t.view(torch.float32).reshape(ROWS, COLS)
    want = (torch.arange(ROWS * COLS, device=t.device, dtype=torch.float32) % 97).reshape(ROWS, COLS)
    if transposed:
        want = want.t()
    assert t.is_cuda and t.shape == want.shape, (t.shape, want.shape)
    assert t.stride() == want.stride(), (t.stride(), want.stride())
    assert t.data_ptr() == rx.ptr  # a view, not a copy
    ok = bool(torch.equal(t, want))
    del t
    return ok


def check_cupy(rx, transposed):
    import cupy
    results = []
    for how in ("from_dlpack", "asarray"):
        a = cupy.from_dlpack(rx) if how == "from_dlpack" else cupy.asarray(rx)
        if a.dtype in (cupy.int8, cupy.uint8):
            a = a.view(cupy.float32).reshape(ROWS, COLS)
        want = (cupy.arange(ROWS * COLS, dtype=cupy.float32) % 97).reshape(ROWS, COLS)
        if transposed:
            want = want.T
        assert a.shape == want.shape and a.strides == want.strides, (how, a.strides)
        assert a.data.ptr == rx.ptr, how
        results.append(bool(cupy.array_equal(a, want)))
        del a
    return all(results)


def check_cuda_core(rx, transposed):
    from cudrv import drv
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError:
        from cuda.core.experimental.utils import StridedMemoryView
    v = StridedMemoryView(rx, stream_ptr=-1)
    assert v.ptr == rx.ptr
    n = ROWS * COLS * 4
    data = drv().dtoh(rx.ptr, n if not transposed else n)
    # element order in memory is the producer's (row-major base); a
    # transposed view has the same bytes with swapped strides
    assert tuple(v.shape) == tuple(rx.shape)
    return data == expected_host(False)


CONSUMERS = {"torch": check_torch, "cupy": check_cupy, "cuda.core": check_cuda_core}


def consumer(conn, kind, name):
    try:
        gpuipc.init()
        peer = None
        for _ in range(100):
            try:
                peer = gpuipc.connect(name, timeout=60)
                break
            except gpuipc.NotFoundError:
                time.sleep(0.05)
        if kind == "cuda.core":
            cc = _cuda_core()
            cc.Device(0).set_current()
        rx = peer.recv(timeout=60)
        tr = json.loads(rx.meta or b"{}").get("transposed", False)
        ok = CONSUMERS[kind](rx, tr)
        shape, dtype = list(rx.shape), rx.dtype
        rx.release()
        del rx
        import gc
        gc.collect()
        _report(conn, ok=ok, shape=shape, dtype=dtype)
        peer.send_msg(b"bye")
        peer.close()
    except Exception as e:
        import traceback
        traceback.print_exc()
        _report(conn, ok=False, error=f"{type(e).__name__}: {e}")
