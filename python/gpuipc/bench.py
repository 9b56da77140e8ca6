"""python -m gpuipc.bench: handing tensors to another process, from Python.

Per size (4 KiB to 256 MiB) and method: the median and 90th percentile
latency of one tensor, and the throughput, tensors per second, with sends
back to back. Every row times the same work (like for like): from just
before the producer's send (or its export) to the consumer holding a usable
torch tensor ordered on its current stream (without torch: the buffer's
CUDA Array Interface); each row says which consumer (sleeping: waits in
poll at once; polling: spins in C without the GIL until the tensor is
there) and how the tensor is made. The producer's stream is idle at each
send (a private stream: the library's query finds it idle and sends a DONE
frame, so the consumer has nothing to wait for). Rows, each skipped with
the reason when its package is absent:

  gpuipc arena ...     arena blocks (the fast path), conn.send -> conn.recv,
                       then torch.from_dlpack, or recv(as_torch=True), or
                       the Received alone (a part: no torch view)
  gpuipc wrapped       torch tensors of PyTorch's allocator, wrapped per
                       send (measured after each tensor's first send)
  gpuipc batch of 16   send_batch -> recv_batch(as_torch=True), per tensor
  torch.mp Queue floor the same torch.multiprocessing Queue round trip with a
                       few hundred bytes instead of a CUDA tensor: the
                       Queue's own cost (runs on the emulator too)
  torch.mp             torch.multiprocessing Queue (PyTorch's CUDA IPC)
  torch.mp + gpuipc    the same Queue with gpuipc.torch.install()
  cupy legacy IPC      ipcGetMemHandle / ipcOpenMemHandle + close per tensor
  cuda.core IPC        IPC-enabled DeviceMemoryResource, Buffer.ipc_descriptor
                       / Buffer.from_ipc_descriptor per tensor: with the
                       producer's sync and export inside the window and a
                       torch view on the consumer, and the old row without

Beside them, the raw parts of the same run: the C handoff (gpuipc bench
handoff --quick, its one-pair rows), one small message one way from
Python, torch.from_dlpack alone; the targets are printed as ratios against
them, and --json carries them under "_parts".

Clocks: CLOCK_MONOTONIC (time.monotonic_ns), one clock for all processes.
"""
import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
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

BATCH = 16  # the batch rows: tensors per send_batch / recv_batch
WARM = 8    # latency samples dropped first (chunk export, caches; a wrapped tensor's first send)


def _producer_stream(torch):
    """The producer's stream: a private one, idle at each send (the
    library's query finds it idle: the DONE path, nothing for the consumer
    to wait for); without torch the legacy stream."""
    if torch is None:
        return None
    return torch.cuda.Stream()


def _gpuipc_producer(conn, wrapped):
    """Serves commands: 'lat SIZE N' (one at a time, waits for an ack each),
    'tput SIZE N' (back to back), 'blat SIZE N K' / 'btput SIZE N K' (the
    same with send_batch of K), 'quit'. Each send carries its timestamp
    (taken just before the send) in meta; tput and btput carry the first."""
    torch = None
    try:
        import torch
        torch.empty(1, device="cuda")
    except Exception:
        if wrapped:
            raise
        torch = None
    ps = _producer_stream(torch)
    if torch is not None:
        # ps is torch's current stream here: what a torch tensor's CUDA Array
        # Interface reports, so a wrapped tensor's send orders nothing more
        torch.cuda.set_stream(ps)
    arena = gpuipc.Arena(chunk_bytes=64 * MiB)
    while True:
        cmd = conn.recv_msg(timeout=None).decode().split()
        if cmd[0] == "quit":
            return 0
        size, n = int(cmd[1]), int(cmd[2])
        k = int(cmd[3]) if len(cmd) > 3 else 1
        nring = 2 * k if k > 1 else min(8, max(1, (512 * MiB) // size))
        if wrapped:
            ring = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(8)]
            torch.cuda.synchronize()
        else:
            ring = [arena.alloc(size, stream=ps) for _ in range(nring)]
        if cmd[0] == "lat":
            for i in range(n):
                conn.send(ring[i % len(ring)], stream=ps,
                          meta=time.monotonic_ns().to_bytes(8, "little"))
                conn.recv_msg(timeout=60)
        elif cmd[0] == "tput":
            t0 = time.monotonic_ns()
            for i in range(n):
                conn.send(ring[i % len(ring)], stream=ps, meta=t0.to_bytes(8, "little"))
            conn.recv_msg(timeout=120)
        elif cmd[0] == "blat":
            for i in range(n):
                half = (i % 2) * k
                m = time.monotonic_ns().to_bytes(8, "little")
                conn.send_batch(ring[half:half + k], stream=ps, metas=[m] * k)
                conn.recv_msg(timeout=60)
        else:  # btput
            t0 = time.monotonic_ns().to_bytes(8, "little")
            for i in range(n):
                half = (i % 2) * k
                conn.send_batch(ring[half:half + k], stream=ps, metas=[t0] * k)
            conn.recv_msg(timeout=120)
        del ring
        gpuipc.collect()


# What the consumer of a gpuipc row does with each buffer, inside the window:
#   from_dlpack  recv() then torch.from_dlpack(rx)         (a usable torch tensor)
#   as_torch     recv(as_torch=True)                       (a torch tensor made in C)
#   received     recv() only                               (no torch view: a part)
#   cai          recv() then rx.__cuda_array_interface__   (no torch here)
# spin: 0 sleeps in poll at once (sleeping consumer); SPIN spins in C, without
# the GIL, until the buffer is there (polling consumer).
SPIN = 1000000


def _take(c, view, spin, torch):
    if view == "as_torch":
        t, meta = c.recv(as_torch=True, with_meta=True, spin_us=spin)
        return t, meta, None
    rx = c.recv(spin_us=spin)
    if view == "from_dlpack":
        return torch.from_dlpack(rx), rx.meta, rx
    if view == "cai":
        return rx.__cuda_array_interface__, rx.meta, rx
    return None, rx.meta, rx


def _take_batch(c, view, spin, k):
    """k tensors of one batch (as_torch) or Received (otherwise)."""
    got = []
    while len(got) < k:
        if view == "as_torch":
            got += c.recv_batch(k - len(got), as_torch=True, with_meta=True, spin_us=spin)
        else:
            got += [(rx, rx.meta) for rx in c.recv_batch(k - len(got), spin_us=spin)]
    return got


def _consumer_torch():
    """torch, or None."""
    try:
        import torch
        torch.empty(1, device="cuda")
    except Exception:
        return None
    return torch


def bench_gpuipc(sizes, n_lat, n_tput, wrapped=False, view="from_dlpack", spin=0, batch=1):
    """A row; with torch, the consumer runs on a private current stream (so
    that as_torch and from_dlpack order on it rather than through the
    legacy stream's relay), torch's current stream again after it."""
    torch = _consumer_torch()
    if torch is None:
        return _bench_gpuipc(sizes, n_lat, n_tput, wrapped, "cai" if view in (
            "from_dlpack", "as_torch") else view, spin, batch, None)
    with torch.cuda.stream(torch.cuda.Stream()):
        return _bench_gpuipc(sizes, n_lat, n_tput, wrapped, view, spin, batch, torch)


def _bench_gpuipc(sizes, n_lat, n_tput, wrapped, view, spin, batch, torch):
    rows = {}
    with gpuipc.spawn(_gpuipc_producer, wrapped, timeout=120) as p:
        c = p.conn
        c.timeout = 120
        for size in sizes:
            lat = []
            if batch > 1:
                nb = max(WARM, n_lat // 2)
                c.send_msg(f"blat {size} {nb} {batch}".encode())
                for _ in range(nb):
                    got = _take_batch(c, view, spin, batch)
                    t1 = time.monotonic_ns()
                    lat.append((t1 - int.from_bytes(got[0][1], "little")) / batch)
                    del got
                    c.send_msg(b"a")
                ntb = max(1, n_tput // batch)
                c.send_msg(f"btput {size} {ntb} {batch}".encode())
                t0 = None
                for _ in range(ntb):
                    got = _take_batch(c, view, spin, batch)
                    if t0 is None:
                        t0 = int.from_bytes(got[0][1], "little")
                    del got
                t1 = time.monotonic_ns()
                c.send_msg(b"done")
                rows[size] = _summary(lat[WARM // 2:], ntb * batch, (t1 - t0) / 1e9)
                continue
            c.send_msg(f"lat {size} {n_lat + WARM}".encode())
            for _ in range(n_lat + WARM):
                v, meta, rx = _take(c, view, spin, torch)
                t1 = time.monotonic_ns()
                lat.append(t1 - int.from_bytes(meta, "little"))
                del v
                if rx is not None:
                    rx.release()
                del rx
                c.send_msg(b"a")
            c.send_msg(f"tput {size} {n_tput}".encode())
            t0 = None
            for _ in range(n_tput):
                v, meta, rx = _take(c, view, spin, torch)
                if t0 is None:
                    t0 = int.from_bytes(meta, "little")
                del v
                if rx is not None:
                    rx.release()
                del rx
            t1 = time.monotonic_ns()
            c.send_msg(b"done")
            rows[size] = _summary(lat[WARM:], n_tput, (t1 - t0) / 1e9)
        c.send_msg(b"quit")
        p.join(60)
    return rows


# ---------------------------------------------------------------------------
# The raw parts, measured in the same run
# ---------------------------------------------------------------------------

def _echo_msgs(conn):
    while True:
        m = conn.recv_msg(timeout=None)
        if m == b"quit":
            return 0
        conn.send_msg(m)


def part_socket_one_way(iters):
    """Half of a send_msg/recv_msg round trip between two processes, from
    Python (the receiver spins first): the message floor as Python sees it."""
    with gpuipc.spawn(_echo_msgs, timeout=120) as p:
        c = p.conn
        for _ in range(50):
            c.send_msg(b"x")
            c.recv_msg(timeout=30)
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            c.send_msg(b"x")
            c.recv_msg(timeout=30)
            ts.append(time.perf_counter_ns() - t0)
        c.send_msg(b"quit")
        p.join(60)
    return statistics.median(ts) / 2000.0


def _hold_one(conn):
    a = gpuipc.Arena(chunk_bytes=MiB)
    b = a.alloc(4 * KiB)
    conn.send(b)
    conn.recv_msg(timeout=None)
    return 0


def part_from_dlpack(iters, torch):
    """torch.from_dlpack(received) alone, and the tensor made in C the way
    recv(as_torch=True) makes it (through the Received's DLPack export), per
    call: the view's share of a row."""
    with gpuipc.spawn(_hold_one, timeout=120) as p:
        rx = p.conn.recv(timeout=60)
        fd = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            t = torch.from_dlpack(rx)
            fd.append(time.perf_counter_ns() - t0)
            del t
        cfd = []
        f = torch._C._from_dlpack
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            t = f(rx.__dlpack__())
            cfd.append(time.perf_counter_ns() - t0)
            del t
        rx.release()
        p.conn.send_msg(b"quit")
        p.join(60)
    return statistics.median(fd) / 1000.0, statistics.median(cfd) / 1000.0


def _c_bench_binary():
    env = os.environ.get("GPUIPC_BENCH_BIN")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    # build-gpu/ is what `make gpu-test` builds, build/ what `make test` does.
    dirs = [os.path.join(root, b) for root in (os.path.join(here, "..", ".."), os.getcwd())
            for b in ("build-gpu", "build")]
    for d in dirs:
        cand = os.path.normpath(os.path.join(d, "gpuipc"))
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return shutil.which("gpuipc")


def part_c_handoff(quick):
    """The C handoff of the same run: `gpuipc bench handoff --quick` (its
    one-pair rows: 4 KiB, polling consumer, per path and carrier), or None
    with the reason."""
    exe = _c_bench_binary()
    if not exe:
        return None, "no gpuipc binary (set GPUIPC_BENCH_BIN, or build the repository)"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "handoff.json")
        cmd = [exe, "bench", "handoff", "--quick", "--json", out]
        if quick:
            cmd[3:3] = ["--iters", "200"]
        drv = os.environ.get("GPUIPC_CUDA_DRIVER")
        if drv and _on_emulator():
            cmd += ["--emulator", drv]
        try:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=900, check=True)
            with open(out) as f:
                doc = json.load(f)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            return None, f"{exe} bench handoff: {type(e).__name__}: {e}"
    pairs = {}
    for b in doc.get("benchmarks", []):
        for r in b.get("tables", {}).get("pair", []):
            pairs[(r["path"], r["carrier"])] = r
    return pairs, None


# ---------------------------------------------------------------------------
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


def _cuda_core_producer(conn, full=False):
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
            if full:  # the window opens here: ordering (a host sync) and export inside it
                ts = time.monotonic_ns() if mode == "lat" else t0
            stream.sync()
            desc = _prop(buf, ("ipc_descriptor", "get_ipc_descriptor"))
            if not full:
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


class _CAIView:
    """A CUDA Array Interface of n bytes at ptr (what torch.as_tensor takes
    when a cuda.core Buffer has no DLPack export of its own)."""

    def __init__(self, ptr, n, stream):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": stream}


def _cc_torch_view(torch, buf, size, stream_handle):
    try:
        return torch.from_dlpack(buf)
    except Exception:
        ptr = int(_prop(buf, ("handle", "ptr")))
        return torch.as_tensor(_CAIView(ptr, size, stream_handle), device="cuda")


def bench_cuda_core(sizes, n_lat, n_tput, full=False):
    """full: like for like with the gpuipc rows: the producer's ordering
    (its stream.sync()) and export inside the window, and the consumer
    ends with a torch tensor on its current stream, ordered after the
    import's stream. Otherwise the old row: export and sync before the
    window, no ordering and no torch view."""
    cc = _cc()
    dev = cc.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    torch = None
    if full:
        import torch
        torch.empty(1, device="cuda")
        sh = int(_prop(stream, ("handle", "cuda_stream")))
        with torch.cuda.stream(torch.cuda.Stream()):  # the consumer's own current stream
            return _bench_cuda_core(cc, dev, stream, sizes, n_lat, n_tput, full, torch, sh)
    return _bench_cuda_core(cc, dev, stream, sizes, n_lat, n_tput, full, None, None)


def _bench_cuda_core(cc, dev, stream, sizes, n_lat, n_tput, full, torch, sh):
    rows = {}
    with gpuipc.spawn(_cuda_core_producer, full, timeout=120) as p:
        c = p.conn
        c.timeout = 120
        _, fds = c.recv_msg(with_fds=True)
        mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fds[0])

        def one():
            desc, ts = pickle.loads(c.recv_msg())
            buf = _with_stream(cc.Buffer.from_ipc_descriptor, mr, desc, stream=stream)
            if full:
                t = _cc_torch_view(torch, buf, int(_prop(buf, ("size",))), sh)
                torch.cuda.current_stream().wait_stream(
                    torch.cuda.ExternalStream(sh))  # ordered after the import's stream
                t1 = time.monotonic_ns()
                del t
            else:
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

def _need_torch_view():
    why = _torch_cuda()
    return f"needs torch for the torch view ({why})" if why else None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gpuipc.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, few tensors (a smoke run)")
    ap.add_argument("--n", type=int, default=0, help="tensors per latency measurement")
    ap.add_argument("--only", default="", help="comma list of methods to run")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    ap.add_argument("--no-c", action="store_true",
                    help="do not run the C handoff (gpuipc bench handoff) for the floor")
    a = ap.parse_args(argv)
    sizes = QUICK_SIZES if a.quick else SIZES
    n_lat = a.n or (20 if a.quick else 200)
    n_tput = 4 * n_lat if a.quick else 2000
    gpuipc.init()
    emu = _on_emulator()
    carrier = os.environ.get("GPUIPC_CARRIER", "auto")
    print(f"gpuipc {gpuipc.version()} on {gpuipc.driver_path()}"
          + (" (the emulator: figures mean nothing)" if emu else ""), flush=True)
    print("window of every row: from just before the producer's send (or export) to the "
          "consumer holding a usable tensor ordered on its current stream; producer stream "
          f"idle at the send (the DONE path: nothing to wait for); carrier {carrier}; "
          f"the first {WARM} latency samples dropped", flush=True)

    def scale(size):  # fewer tensors where they fill memory
        return 40 if size >= 64 * MiB else 10 if size >= 16 * MiB else 1

    def gp(**kw):
        return lambda s, nl, nt: bench_gpuipc(s, nl, nt, **kw)

    # without torch the view is the buffer's CUDA Array Interface, and a
    # batch is a list of Received: the rows say so
    tv = "torch.from_dlpack" if not _torch_cuda() else "CUDA Array Interface (no torch)"
    bv = "as_torch" if not _torch_cuda() else "Received (no torch)"
    methods = [
        (f"gpuipc arena, sleeping consumer, {tv}", None, gp(view="from_dlpack", spin=0)),
        (f"gpuipc arena, polling consumer, {tv}", None, gp(view="from_dlpack", spin=SPIN)),
        ("gpuipc arena, polling consumer, as_torch", _need_torch_view,
         gp(view="as_torch", spin=SPIN)),
        ("gpuipc arena, sleeping consumer, as_torch", _need_torch_view,
         gp(view="as_torch", spin=0)),
        ("gpuipc arena, polling consumer, Received only (no torch view)", None,
         gp(view="received", spin=SPIN)),
        ("gpuipc wrapped torch tensor (after its first send), polling, as_torch", _torch_cuda,
         gp(view="as_torch", spin=SPIN, wrapped=True)),
        (f"gpuipc arena, batch of {BATCH}, polling, {bv} (per tensor)", None,
         gp(view="as_torch", spin=SPIN, batch=BATCH)),
        ("cupy legacy IPC (a CuPy array, not a torch tensor)", lambda: _have("cupy"), bench_cupy),
        ("cuda.core IPC, export + ordering + torch view in the window",
         lambda: _have("cuda.core") or _need_torch_view(),
         lambda s, nl, nt: bench_cuda_core(s, nl, nt, full=True)),
        ("cuda.core IPC (old row: export and sync outside the window, no torch view)",
         lambda: _have("cuda.core"), bench_cuda_core),
    ]
    on_emu = {"gpuipc"}
    for name, need, fn, emu_ok in torch_mp_methods():
        methods.append((name, need, fn))
        if emu_ok:
            on_emu.add(name)
    only = {m.strip() for m in a.only.split(",") if m.strip()}
    results = {}
    for name, need, fn in methods:
        if only and not any(o in name for o in only):
            continue
        why = need() if need else None
        if not why and emu and not (name.startswith("gpuipc arena") or name in on_emu):
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
            print(f"{name:72s} {_fmt_size(size):>8s}  median {r['median_us']:8.1f} us  "
                  f"p90 {r['p90_us']:8.1f} us  "
                  f"{r['per_s']:11,.0f} tensors/s", flush=True)

    # the raw parts of the same run
    parts = {}
    try:
        parts["socket_one_way_python_us"] = part_socket_one_way(200 if a.quick else 2000)
    except Exception as e:
        print(f"part socket one way: FAILED: {type(e).__name__}: {e}", flush=True)
    if not _torch_cuda() and not emu:
        try:
            import torch
            f1, f2 = part_from_dlpack(200 if a.quick else 2000, torch)
            parts["torch_from_dlpack_us"], parts["torch_C_from_dlpack_us"] = f1, f2
        except Exception as e:
            print(f"part torch.from_dlpack: FAILED: {type(e).__name__}: {e}", flush=True)
    c_pairs, why = (None, "--no-c") if a.no_c else part_c_handoff(a.quick)
    if c_pairs:
        for (path, car), r in sorted(c_pairs.items()):
            parts[f"c_handoff_{path}_{car}_us"] = r["median_us"]
            parts[f"c_handoff_{path}_{car}_per_s"] = r["buffers_per_s"]

    print("\n| method | size | median µs | p90 µs | tensors/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        for size, r in rows.items():
            print(f"| {name} | {_fmt_size(size)} | {r['median_us']:.1f} | {r['p90_us']:.1f} | "
                  f"{r['per_s']:,.0f} |")
    print("\nraw parts, same run:")
    if c_pairs:
        print("  C handoff, 4 KiB, polling consumer (gpuipc bench handoff --quick, one pair): "
              + "; ".join(f"{path}/{car} {r['median_us']:.2f} us, {r['buffers_per_s']:,.0f}/s"
                          for (path, car), r in sorted(c_pairs.items())))
    else:
        print(f"  C handoff: not measured ({why})")
    if "socket_one_way_python_us" in parts:
        print(f"  one small message one way, Python send_msg -> recv_msg (half a round trip): "
              f"{parts['socket_one_way_python_us']:.2f} us")
    if "torch_from_dlpack_us" in parts:
        print(f"  torch.from_dlpack(received): {parts['torch_from_dlpack_us']:.2f} us; "
              f"torch._C._from_dlpack(received.__dlpack__()): "
              f"{parts['torch_C_from_dlpack_us']:.2f} us")
    else:
        print("  torch.from_dlpack: not measured (no torch with CUDA here)")

    # the targets, as ratios against the floors of this run
    def row(prefix, size=4 * KiB):
        for name, rows in results.items():
            if name.startswith(prefix) and size in rows:
                return name, rows[size]
        return None, None

    car = "socket" if carrier == "socket" else "ring"
    floor = c_pairs.get(("idle", car)) if c_pairs else None
    print("\ntargets (4 KiB):")
    n1, r1 = row("gpuipc arena, polling consumer, as_torch")
    if r1 is None:
        n1, r1 = row(f"gpuipc arena, polling consumer, {tv}")
    if r1:
        if floor:
            print(f"  {n1}: {r1['median_us']:.1f} us = {r1['median_us'] / floor['median_us']:.2f}x "
                  f"the C handoff (idle path, {car}: {floor['median_us']:.2f} us; target <= 2x)")
        print(f"  {n1}: {r1['per_s']:,.0f} tensors/s (target >= 150,000)")
        nc, rc = row("cuda.core IPC, export")
        if rc:
            print(f"  against {nc}: {rc['median_us'] / r1['median_us']:.2f}x faster (target >= 2x)")
    nw, rw = row("gpuipc wrapped torch tensor")
    if rw:
        print(f"  {nw}: {rw['median_us']:.1f} us (target <= 15 us)")
    nb, rb = row("gpuipc arena, batch of")
    if rb:
        print(f"  {nb}: {rb['median_us']:.2f} us per tensor, {rb['per_s']:,.0f} tensors/s")
    tmp_lines = torch_mp_summary(results)
    if tmp_lines:
        print()
        for line in tmp_lines:
            print(line)
    if a.json:
        doc = {k: {str(sz): r for sz, r in v.items()} for k, v in results.items()}
        doc["_parts"] = parts
        print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
