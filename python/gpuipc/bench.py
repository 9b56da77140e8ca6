"""python -m gpuipc.bench: handing tensors to another process, from Python.

Per size (4 KiB to 256 MiB) and method: the median and 90th percentile
latency of one tensor, from the producer's send to the consumer holding a
usable view (torch.from_dlpack when torch is here, else the buffer's CUDA
Array Interface), one tensor at a time; and the throughput, tensors per
second, with sends back to back. Measured in the same run, each skipped with
the reason when its package is absent:

  gpuipc               arena blocks (the fast path), conn.send -> conn.recv
  gpuipc (wrapped)     torch tensors of PyTorch's allocator, wrapped per send
  torch.mp Queue floor the same torch.multiprocessing Queue round trip with a
                       few hundred bytes instead of a CUDA tensor: the
                       Queue's own cost (runs on the emulator too)
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
# torch.multiprocessing: the plain Queue (no CUDA tensor: the floor), with
# PyTorch's own reducers, and with gpuipc's
# ---------------------------------------------------------------------------

TORCH_MP_FLOOR = "torch.mp Queue floor (no CUDA tensor)"
TORCH_MP = "torch.mp"
TORCH_MP_GPUIPC = "torch.mp + gpuipc"
# What the floor row puts in place of the tensor: bytes of about the size of
# gpuipc's pickled tensor (descriptor, event descriptor, token, names).
FLOOR_PAYLOAD = 384


def _tmp_item(mode, size, torch):
    if mode == "plain":
        return b"\0" * FLOOR_PAYLOAD
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def _tmp_producer(q, acks, sizes, n_lat, n_tput, mode):
    """Puts (item, timestamp) on q: one at a time, each after the previous
    was acknowledged (latency), then n_tput back to back (throughput). The
    same in every mode; only the item differs (a CUDA tensor, or bytes)."""
    torch = None
    if mode != "plain":
        import torch
        if mode == "gpuipc":
            import gpuipc.torch
            gpuipc.torch.install()
        torch.empty(1, device="cuda")
    for size in sizes:
        for _ in range(n_lat):
            t = _tmp_item(mode, size, torch)
            q.put((t, time.monotonic_ns()))
            del t
            acks.get()
        t0 = time.monotonic_ns()
        for _ in range(n_tput):
            t = _tmp_item(mode, size, torch)
            q.put((t, t0))
            del t
        acks.get()
    acks.get()  # the consumer is done with everything


def bench_torch_mp(sizes, n_lat, n_tput, mode):
    """One torch.multiprocessing row. mode: "plain" (the Queue with no CUDA
    tensor: its own floor), "torch" (PyTorch's reducers) or "gpuipc"
    (gpuipc.torch.install() in the producer); True / False mean "gpuipc" /
    "torch". The timed window is the same in all three: from the
    producer's timestamp, taken before q.put, to the consumer holding what
    q.get returned (a usable tensor: its stream already ordered after the
    producer's)."""
    if mode is True or mode is False:
        mode = "gpuipc" if mode else "torch"
    import torch.multiprocessing as tmp
    if mode == "gpuipc":
        import gpuipc.torch  # noqa: F401  the consumer side needs only the import
    ctx = tmp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tmp_producer, args=(q, acks, sizes, n_lat, n_tput, mode))
    p.start()
    if mode != "plain":
        import torch
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


def _torch_importable():
    return _have("torch")


def torch_mp_methods():
    """The torch.mp rows: (name, what it needs, run, runs on the emulator)."""
    return [
        (TORCH_MP_FLOOR, _torch_importable,
         lambda s, nl, nt: bench_torch_mp(s, nl, nt, "plain"), True),
        (TORCH_MP, _torch_cuda, lambda s, nl, nt: bench_torch_mp(s, nl, nt, "torch"), False),
        (TORCH_MP_GPUIPC, _torch_cuda,
         lambda s, nl, nt: bench_torch_mp(s, nl, nt, "gpuipc"), False),
    ]


def torch_mp_summary(results):
    """Lines comparing gpuipc's reducers with PyTorch's and with the plain
    Queue's floor of the same run, per size, with the target: >= 3x faster
    than torch.mp, or, where the floor makes that impossible (floor > a
    third of torch.mp), within 1.2x of the floor."""
    floor, own, ours = (results.get(k, {}) for k in (TORCH_MP_FLOOR, TORCH_MP, TORCH_MP_GPUIPC))
    lines = []
    for size in sorted(set(own) | set(ours) | set(floor)):
        f, o, g = floor.get(size), own.get(size), ours.get(size)
        parts = [f"torch.mp at {_fmt_size(size)}:"]
        if f:
            parts.append(f"Queue floor {f['median_us']:.1f} us")
        if o:
            parts.append(f"PyTorch's reducers {o['median_us']:.1f} us")
        if g:
            parts.append(f"gpuipc's {g['median_us']:.1f} us")
        if o and g and g["median_us"] > 0:
            parts.append(f"({o['median_us'] / g['median_us']:.2f}x faster than PyTorch's")
            if f and f["median_us"] > 0:
                parts[-1] += f", {g['median_us'] / f['median_us']:.2f}x the floor"
            parts[-1] += ")"
            target = o["median_us"] / 3
            how = ">= 3x faster than torch.mp"
            if f and f["median_us"] > target:
                target, how = 1.2 * f["median_us"], "<= 1.2x the Queue floor (3x is below it)"
            parts.append(f"target {how}: {'met' if g['median_us'] <= target else 'MISSED'}"
                         f" ({target:.1f} us)")
        if o and g and o["per_s"] > 0:
            parts.append(f"throughput {g['per_s'] / o['per_s']:.2f}x PyTorch's")
        lines.append(parts[0] + " " + ", ".join(parts[1:]))
    return lines


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
        ("cupy legacy IPC", lambda: _have("cupy"), bench_cupy),
        ("cuda.core IPC", lambda: _have("cuda.core"), bench_cuda_core),
    ]
    on_emu = {"gpuipc"}
    for name, need, fn, emu_ok in torch_mp_methods():
        methods.append((name, need, fn))
        if emu_ok:
            on_emu.add(name)
    only = {m.strip() for m in a.only.split(",") if m.strip()}
    results = {}
    for name, need, fn in methods:
        if only and name not in only:
            continue
        why = need() if need else None
        if not why and emu and name not in on_emu:
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
    tmp_lines = torch_mp_summary(results)
    if tmp_lines:
        print()
        for line in tmp_lines:
            print(line)
    g1 = results.get("gpuipc", {}).get(MiB)
    if g1:
        print(f"gpuipc at 1 MiB: {g1['median_us']:.1f} us median send -> usable view "
              f"(target <= 10 us), {g1['per_s']:,.0f} tensors/s (target >= 100,000)")
    if a.json:
        print(json.dumps({k: {str(s): r for s, r in v.items()} for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
