"""python -m gpuipc.bench: handing tensors to another process, from Python.

Per size (4 KiB to 256 MiB) and method: the median and 90th percentile
latency of one tensor, from the producer's send to the consumer holding a
usable view (torch.from_dlpack when torch is here, else the buffer's CUDA
Array Interface), one tensor at a time; and the throughput, tensors per
second, with sends back to back. Measured in the same run, each skipped with
the reason when its package is absent:

  gpuipc               arena blocks (the fast path), conn.send -> conn.recv
  gpuipc (wrapped)     torch tensors of PyTorch's allocator, wrapped per send
  torch.mp             torch.multiprocessing Queue (PyTorch's CUDA IPC)
  torch.mp + gpuipc    the same Queue with gpuipc.torch.install()
  cupy legacy IPC      ipcGetMemHandle / ipcOpenMemHandle + close per tensor
  cuda.core IPC        IPC-enabled DeviceMemoryResource, Buffer.ipc_descriptor
                       / Buffer.from_ipc_descriptor per tensor

Clocks: CLOCK_MONOTONIC (time.monotonic_ns), one clock for all processes.
"""
import argparse
import json
import os
import pickle
import statistics
import sys
import time

import gpuipc

KiB, MiB = 1024, 1024 * 1024
WINDOW = 16  # cuda.core throughput: buffers in flight before the producer frees them
SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB]
QUICK_SIZES = [4 * KiB, MiB]


def _fmt_size(n):
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _have(module):
    try:
        __import__(module)
        return None
    except Exception as e:
        return f"{module} not importable: {type(e).__name__}: {e}"


def _torch_cuda():
    why = _have("torch")
    if why:
        return why
    import torch
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def _on_emulator():
    return "emu" in os.path.basename(os.environ.get("GPUIPC_CUDA_DRIVER", ""))


def _summary(lat_ns, n_tput, tput_s):
    lat = sorted(x / 1000.0 for x in lat_ns)
    p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
    return {"median_us": statistics.median(lat), "p90_us": p90,
            "per_s": n_tput / tput_s if tput_s > 0 else 0.0}


# ---------------------------------------------------------------------------
# gpuipc: a producer child, the parent consumes
# ---------------------------------------------------------------------------

def _gpuipc_producer(conn, wrapped):
    """Serves commands: 'lat SIZE N' (one at a time, waits for an ack each),
    'tput SIZE N' (back to back), 'quit'."""
    torch = None
    if wrapped:
        import torch
        torch.empty(1, device="cuda")
    arena = gpuipc.Arena(chunk_bytes=64 * MiB)
    while True:
        cmd = conn.recv_msg(timeout=None).decode().split()
        if cmd[0] == "quit":
            return 0
        size, n = int(cmd[1]), int(cmd[2])
        if wrapped:
            ring = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(8)]
            torch.cuda.synchronize()
        else:
            ring = [arena.alloc(size) for _ in range(min(8, max(1, (512 * MiB) // size)))]
        if cmd[0] == "lat":
            for i in range(n):
                conn.send(ring[i % len(ring)], meta=time.monotonic_ns().to_bytes(8, "little"))
                conn.recv_msg(timeout=60)
        else:
            t0 = time.monotonic_ns()
            for i in range(n):
                conn.send(ring[i % len(ring)], meta=t0.to_bytes(8, "little"))
            conn.recv_msg(timeout=120)
        del ring
        gpuipc.collect()


def _view(rx, torch):
    if torch is not None:
        return torch.from_dlpack(rx)
    return rx.__cuda_array_interface__


def bench_gpuipc(sizes, n_lat, n_tput, wrapped=False):
    torch = None
    if wrapped or not _torch_cuda():
        try:
            import torch
            torch.empty(1, device="cuda")
        except Exception:
            torch = None
    rows = {}
    with gpuipc.spawn(_gpuipc_producer, wrapped, timeout=120) as p:
        c = p.conn
        c.timeout = 120
        for size in sizes:
            c.send_msg(f"lat {size} {n_lat}".encode())
            lat = []
            for _ in range(n_lat):
                rx = c.recv()
                v = _view(rx, torch)
                t1 = time.monotonic_ns()
                lat.append(t1 - int.from_bytes(rx.meta, "little"))
                del v
                rx.release()
                del rx
                c.send_msg(b"a")
            c.send_msg(f"tput {size} {n_tput}".encode())
            t0 = None
            for _ in range(n_tput):
                rx = c.recv()
                if t0 is None:
                    t0 = int.from_bytes(rx.meta, "little")
                v = _view(rx, torch)
                del v
                rx.release()
                del rx
            t1 = time.monotonic_ns()
            c.send_msg(b"done")
            rows[size] = _summary(lat, n_tput, (t1 - t0) / 1e9)
        c.send_msg(b"quit")
        p.join(60)
    return rows


# ---------------------------------------------------------------------------
# torch.multiprocessing, with and without gpuipc's reducers
# ---------------------------------------------------------------------------

def _tmp_producer(q, acks, sizes, n_lat, n_tput, use_gpuipc):
    import torch
    if use_gpuipc:
        import gpuipc.torch
        gpuipc.torch.install()
    torch.empty(1, device="cuda")
    for size in sizes:
        for _ in range(n_lat):
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            q.put((t, time.monotonic_ns()))
            del t
            acks.get()
        t0 = time.monotonic_ns()
        for _ in range(n_tput):
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            q.put((t, t0))
            del t
        acks.get()
    acks.get()  # the consumer is done with everything


def bench_torch_mp(sizes, n_lat, n_tput, use_gpuipc):
    import torch
    import torch.multiprocessing as tmp
    if use_gpuipc:
        import gpuipc.torch  # noqa: F401  the consumer side needs only the import
    ctx = tmp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tmp_producer, args=(q, acks, sizes, n_lat, n_tput, use_gpuipc))
    p.start()
    torch.empty(1, device="cuda")
    rows = {}
    try:
        for size in sizes:
            lat = []
            for _ in range(n_lat):
                t, t0 = q.get(timeout=300)
                lat.append(time.monotonic_ns() - t0)
                del t
                acks.put(1)
            t0 = None
            for _ in range(n_tput):
                t, ts = q.get(timeout=300)
                t0 = ts if t0 is None else t0
                del t
            t1 = time.monotonic_ns()
            acks.put(1)
            rows[size] = _summary(lat, n_tput, (t1 - t0) / 1e9)
        acks.put(1)
        p.join(120)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    return rows


# ---------------------------------------------------------------------------
# CuPy's legacy IPC and cuda.core's IPC memory resource
# ---------------------------------------------------------------------------

def _cupy_producer(conn):
    import cupy
    rt = cupy.cuda.runtime
    while True:
        cmd = conn.recv_msg(timeout=None).decode().split()
        if cmd[0] == "quit":
            return 0
        size, n, mode = int(cmd[1]), int(cmd[2]), cmd[0]
        ring = [cupy.empty(size, dtype=cupy.uint8) for _ in range(8)]
        cupy.cuda.Device().synchronize()
        t0 = time.monotonic_ns()
        for i in range(n):
            a = ring[i % 8]
            h = rt.ipcGetMemHandle(a.data.ptr)
            ts = time.monotonic_ns() if mode == "lat" else t0
            conn.send_msg(pickle.dumps((bytes(h), size, ts)))
            if mode == "lat":
                conn.recv_msg(timeout=60)
        conn.recv_msg(timeout=120)
        del ring


def bench_cupy(sizes, n_lat, n_tput):
    import cupy
    rt = cupy.cuda.runtime
    cupy.cuda.Device(0).use()
    rows = {}

    def one():
        h, size, ts = pickle.loads(c.recv_msg())
        ptr = rt.ipcOpenMemHandle(h)
        mem = cupy.cuda.UnownedMemory(ptr, size, None)
        arr = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        t1 = time.monotonic_ns()
        del arr, mem
        rt.ipcCloseMemHandle(ptr)
        return t1, ts

    with gpuipc.spawn(_cupy_producer, timeout=120) as p:
        c = p.conn
        c.timeout = 120
        for size in sizes:
            c.send_msg(f"lat {size} {n_lat}".encode())
            lat = []
            for _ in range(n_lat):
                t1, ts = one()
                lat.append(t1 - ts)
                c.send_msg(b"a")
            c.send_msg(b"a")
            c.send_msg(f"tput {size} {n_tput}".encode())
            t0 = None
            for _ in range(n_tput):
                t1, ts = one()
                t0 = ts if t0 is None else t0
            c.send_msg(b"a")
            rows[size] = _summary(lat, n_tput, (t1 - t0) / 1e9)
        c.send_msg(b"quit")
        p.join(60)
    return rows


def _cc():
    try:
        import cuda.core as cc
        cc.Device
    except (ImportError, AttributeError):
        import cuda.core.experimental as cc
    return cc


def _with_stream(fn, *args, stream):
    try:
        return fn(*args, stream=stream)
    except TypeError as e:
        if "stream" not in str(e):
            raise
        return fn(*args)


def _prop(obj, names):
    for n in names:
        if hasattr(obj, n):
            v = getattr(obj, n)
            return v() if callable(v) else v
    raise AttributeError(f"none of {names} on {type(obj).__name__}")


def _cuda_core_producer(conn):
    cc = _cc()
    dev = cc.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    mr = cc.DeviceMemoryResource(dev, cc.DeviceMemoryResourceOptions(
        ipc_enabled=True, max_size=2048 * MiB))
    ah = _prop(mr, ("allocation_handle", "get_allocation_handle"))
    fd = ah.handle if hasattr(ah, "handle") else int(ah)
    conn.send_msg(b"pool", [int(fd)])
    while True:
        cmd = conn.recv_msg(timeout=None).decode().split()
        if cmd[0] == "quit":
            return 0
        size, n, mode = int(cmd[1]), int(cmd[2]), cmd[0]
        t0 = time.monotonic_ns()
        live = []
        for i in range(n):
            buf = _with_stream(mr.allocate, size, stream=stream)
            stream.sync()
            desc = _prop(buf, ("ipc_descriptor", "get_ipc_descriptor"))
            ts = time.monotonic_ns() if mode == "lat" else t0
            conn.send_msg(pickle.dumps((desc, ts)))
            live.append(buf)
            if mode == "lat":
                conn.recv_msg(timeout=60)
                live.pop().close()
            elif (i + 1) % WINDOW == 0:
                conn.recv_msg(timeout=60)  # the consumer is past these: free them
                for b in live:
                    b.close()
                live = []
        conn.recv_msg(timeout=120)
        for b in live:
            b.close()


def bench_cuda_core(sizes, n_lat, n_tput):
    cc = _cc()
    dev = cc.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    rows = {}
    with gpuipc.spawn(_cuda_core_producer, timeout=120) as p:
        c = p.conn
        c.timeout = 120
        _, fds = c.recv_msg(with_fds=True)
        mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fds[0])

        def one():
            desc, ts = pickle.loads(c.recv_msg())
            buf = _with_stream(cc.Buffer.from_ipc_descriptor, mr, desc, stream=stream)
            t1 = time.monotonic_ns()
            buf.close()
            return t1, ts

        for size in sizes:
            c.send_msg(f"lat {size} {n_lat}".encode())
            lat = []
            for _ in range(n_lat):
                t1, ts = one()
                lat.append(t1 - ts)
                c.send_msg(b"a")
            c.send_msg(b"a")
            c.send_msg(f"tput {size} {n_tput}".encode())
            t0 = None
            for i in range(n_tput):
                t1, ts = one()
                t0 = ts if t0 is None else t0
                if (i + 1) % WINDOW == 0:
                    c.send_msg(b"w")
            c.send_msg(b"a")
            rows[size] = _summary(lat, n_tput, (t1 - t0) / 1e9)
        c.send_msg(b"quit")
        p.join(60)
    return rows


# ---------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gpuipc.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, few tensors (a smoke run)")
    ap.add_argument("--n", type=int, default=0, help="tensors per latency measurement")
    ap.add_argument("--only", default="", help="comma list of methods to run")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    a = ap.parse_args(argv)
    sizes = QUICK_SIZES if a.quick else SIZES
    n_lat = a.n or (20 if a.quick else 200)
    n_tput = 4 * n_lat if a.quick else 2000
    gpuipc.init()
    emu = _on_emulator()
    print(f"gpuipc {gpuipc.version()} on {gpuipc.driver_path()}"
          + (" (the emulator: figures mean nothing)" if emu else ""), flush=True)

    def scale(size):  # fewer tensors where they fill memory
        return 40 if size >= 64 * MiB else 10 if size >= 16 * MiB else 1

    methods = [
        ("gpuipc", None, lambda s, nl, nt: bench_gpuipc(s, nl, nt)),
        ("gpuipc (wrapped torch tensor)", _torch_cuda,
         lambda s, nl, nt: bench_gpuipc(s, nl, nt, wrapped=True)),
        ("torch.mp", _torch_cuda, lambda s, nl, nt: bench_torch_mp(s, nl, nt, False)),
        ("torch.mp + gpuipc", _torch_cuda, lambda s, nl, nt: bench_torch_mp(s, nl, nt, True)),
        ("cupy legacy IPC", lambda: _have("cupy"), bench_cupy),
        ("cuda.core IPC", lambda: _have("cuda.core"), bench_cuda_core),
    ]
    only = {m.strip() for m in a.only.split(",") if m.strip()}
    results = {}
    for name, need, fn in methods:
        if only and name not in only:
            continue
        why = need() if need else None
        if not why and emu and name != "gpuipc":
            why = "on the CUDA driver emulator (the frameworks load libcuda.so.1 themselves)"
        if why:
            print(f"{name}: SKIPPED ({why})", flush=True)
            continue
        rows = {}
        try:
            for size in sizes:
                k = scale(size)
                nl = max(5, n_lat // min(k, 10))
                nt = max(WINDOW, (n_tput // k) // WINDOW * WINDOW)
                rows.update(fn([size], nl, nt))
        except Exception as e:
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            if rows:
                results[name] = rows
            continue
        results[name] = rows
        for size, r in rows.items():
            print(f"{name:32s} {_fmt_size(size):>8s}  median {r['median_us']:9.1f} us  "
                  f"p90 {r['p90_us']:9.1f} us  {r['per_s']:11,.0f} tensors/s", flush=True)

    print("\n| method | size | median µs | p90 µs | tensors/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        for size, r in rows.items():
            print(f"| {name} | {_fmt_size(size)} | {r['median_us']:.1f} | {r['p90_us']:.1f} | "
                  f"{r['per_s']:,.0f} |")
    a1, b1 = results.get("torch.mp", {}).get(MiB), results.get("torch.mp + gpuipc", {}).get(MiB)
    if a1 and b1:
        print(f"\ntorch.mp at 1 MiB: {a1['median_us']:.1f} us without gpuipc, "
              f"{b1['median_us']:.1f} us with gpuipc.torch.install() "
              f"({a1['median_us'] / b1['median_us']:.1f}x)")
    g1 = results.get("gpuipc", {}).get(MiB)
    if g1:
        print(f"gpuipc at 1 MiB: {g1['median_us']:.1f} us median send -> usable view "
              f"(target <= 10 us), {g1['per_s']:,.0f} tensors/s (target >= 100,000)")
    if a.json:
        print(json.dumps({k: {str(s): r for s, r in v.items()} for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
