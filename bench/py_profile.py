"""Raw parts of a Python tensor handoff, measured one by one.

    python3 bench/py_profile.py [--iters N] [--json FILE]

What each row times, per call (median of N, in microseconds):
  torch.from_dlpack(capsule)        the public path, from a fresh capsule
  torch._C._from_dlpack(capsule)    the C entry torch's Python wrapper calls
  exchange API                      whether torch.Tensor has the DLPack C
                                    exchange attribute (no timing: a flag)
  current_stream().cuda_stream      the Python Stream object path
  _cuda_getCurrentRawStream         torch's raw stream call
  mp.Queue round trip               a small pickled object there and back
                                    between two processes (no CUDA): the
                                    Queue's own floor, half of it one way
  mp.Pipe round trip                the same over a bare Pipe
  tensor.data_ptr() / nbytes        what a resolver of torch tensors reads
  __cuda_array_interface__          torch's property, for comparison

The library is not needed here: these are the floors the rows of
python -m gpuipc.bench are read against.
"""
import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time


def _med(f, iters):
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        f()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000.0


def _echo(q_in, q_out):
    while True:
        x = q_in.get()
        if x is None:
            return
        q_out.put(x)


def _pipe_echo(c):
    while True:
        x = c.recv()
        if x is None:
            return
        c.send(x)


def queue_floor(iters):
    ctx = mp.get_context("spawn")
    a, b = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo, args=(a, b))
    p.start()
    msg = ("name", b"x" * 64, 12345, 4096)
    for _ in range(200):
        a.put(msg)
        b.get()
    r = _med(lambda: (a.put(msg), b.get()), iters)
    a.put(None)
    p.join()
    return r


def pipe_floor(iters):
    ctx = mp.get_context("spawn")
    x, y = ctx.Pipe()
    p = ctx.Process(target=_pipe_echo, args=(y,))
    p.start()
    msg = ("name", b"x" * 64, 12345, 4096)
    for _ in range(200):
        x.send(msg)
        x.recv()
    r = _med(lambda: (x.send(msg), x.recv()), iters)
    x.send(None)
    p.join()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {"python": sys.version.split()[0]}
    rows = []
    try:
        import torch
        out["torch"] = torch.__version__
        out["exchange_api"] = any(hasattr(torch.Tensor, a) for a in ("__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"))
        out["c_from_dlpack"] = hasattr(torch._C, "_from_dlpack")
        if torch.cuda.is_available():
            t = torch.empty(1024, device="cuda", dtype=torch.float32)
            torch.cuda.synchronize()
            rows.append(("torch.from_dlpack(capsule)",
                         _med(lambda: torch.from_dlpack(t.__dlpack__()), a.iters)))
            rows.append(("t.__dlpack__() alone", _med(lambda: t.__dlpack__(), a.iters)))
            if hasattr(torch._C, "_from_dlpack"):
                rows.append(("torch._C._from_dlpack(capsule) incl. __dlpack__",
                             _med(lambda: torch._C._from_dlpack(t.__dlpack__()), a.iters)))
            rows.append(("torch.from_dlpack(tensor) (protocol)",
                         _med(lambda: torch.from_dlpack(t), a.iters)))
            rows.append(("torch.cuda.current_stream().cuda_stream",
                         _med(lambda: torch.cuda.current_stream(0).cuda_stream, a.iters)))
            if hasattr(torch._C, "_cuda_getCurrentRawStream"):
                rows.append(("torch._C._cuda_getCurrentRawStream(0)",
                             _med(lambda: torch._C._cuda_getCurrentRawStream(0), a.iters)))
            rows.append(("t.data_ptr(); t.nbytes", _med(lambda: (t.data_ptr(), t.nbytes), a.iters)))
            rows.append(("t.__cuda_array_interface__",
                         _med(lambda: t.__cuda_array_interface__, a.iters)))
    except ImportError as e:
        out["torch"] = f"not importable: {e}"
    rows.append(("mp.Queue round trip (no CUDA)", queue_floor(a.iters)))
    rows.append(("mp.Pipe round trip (no CUDA)", pipe_floor(a.iters)))
    for k in ("python", "torch", "exchange_api", "c_from_dlpack"):
        if k in out:
            print(f"{k}: {out[k]}")
    for name, us in rows:
        print(f"{name:50s} {us:9.2f} us")
    out["rows"] = [{"name": n, "median_us": u} for n, u in rows]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
