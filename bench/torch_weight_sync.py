#!/usr/bin/env python3
"""torch_weight_sync.py: the torch peers of `gpuipc bench sets`.

Weight sync of the Llama-2-7B shapes in bf16 (291 tensors, 13.48 GB) from a
producer process into a consumer process's own tensors on the same GPU,
the two ways LLM stacks do it with PyTorch today, next to the in-process
copy floor, all in one run:

  floor     in-process device-to-device copy of the same tensors
            (dst.copy_(src) per tensor), in the consumer;
  per-tensor  torch.multiprocessing's reduce_tensor per tensor (vLLM's IPC
            weight-transfer engine, verl): the producer sends the
            (rebuild function, arguments) of each tensor, the consumer
            rebuilds each one and copies it into its own tensor;
  buckets   hand-rolled 512 MiB flattened buckets (slime, SGLang's
            FlattenedTensorBucket): the producer flattens the tensors into
            new buckets of at most 512 MiB each sync, sends one
            reduce_tensor per bucket with a (name, dtype, shape, offset)
            table, the consumer slices views out and copies them in.

Each sync is timed from the producer's start (CLOCK_MONOTONIC, shared by
the processes of the machine) to the consumer's copies being done
(torch.cuda.synchronize); medians after warm-up.

  python3 bench/torch_weight_sync.py [--quick] [--iters N] [--json FILE]

--quick: a small model (4 layers of width 512). --json FILE: also write the
figures as a gpuipc-bench record (benchmark "sets-torch", docs/bench-json.md)
that bench/plot.py draws beside `gpuipc bench sets --json`. Needs PyTorch
with CUDA.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

BUCKET_BYTES = 512 << 20


def llama_shapes(layers, hidden, mlp, vocab):
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = "model.layers.%d." % i
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((p + "self_attn.%s.weight" % n, (hidden, hidden)))
        shapes.append((p + "mlp.gate_proj.weight", (mlp, hidden)))
        shapes.append((p + "mlp.up_proj.weight", (mlp, hidden)))
        shapes.append((p + "mlp.down_proj.weight", (hidden, mlp)))
        shapes.append((p + "input_layernorm.weight", (hidden,)))
        shapes.append((p + "post_attention_layernorm.weight", (hidden,)))
    shapes.append(("model.norm.weight", (hidden,)))
    shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def model_shapes(quick):
    return llama_shapes(4, 512, 1376, 4000) if quick else llama_shapes(32, 4096, 11008, 32000)


def make(shapes, fill):
    return {n: torch.full(s, fill, dtype=torch.bfloat16, device="cuda:0") for n, s in shapes}


def producer(conn, quick, iters):
    """Runs in the child: answers each command with a sync of its weights."""
    torch.cuda.set_device(0)
    weights = make(model_shapes(quick), 1.0)
    torch.cuda.synchronize()
    while True:
        cmd = conn.recv()
        if cmd == "quit":
            return
        for _ in range(iters):
            t0 = time.monotonic()
            if cmd == "per-tensor":
                conn.send((t0, [(n, reduce_tensor(t)) for n, t in weights.items()]))
            else:
                # New buckets each sync, as the projects that flatten do.
                buckets, table, cur, size = [], [], [], 0
                for n, t in weights.items():
                    nb = t.numel() * t.element_size()
                    if cur and size + nb > BUCKET_BYTES:
                        buckets.append(torch.cat([x.reshape(-1) for x in cur]))
                        cur, size = [], 0
                    table.append((len(buckets), n, t.dtype, tuple(t.shape), size // t.element_size()))
                    cur.append(t)
                    size += nb
                if cur:
                    buckets.append(torch.cat([x.reshape(-1) for x in cur]))
                torch.cuda.synchronize()
                conn.send((t0, [reduce_tensor(b) for b in buckets], table))
            conn.recv()  # the consumer is done: the memory may go
            if cmd != "per-tensor":
                del buckets


def consumer_sync(conn, mine, how):
    msg = conn.recv()
    if how == "per-tensor":
        t0, items = msg
        for n, (fn, args) in items:
            mine[n].copy_(fn(*args))
    else:
        t0, handles, table = msg
        buckets = [fn(*args) for fn, args in handles]
        for b, n, dtype, shape, off in table:
            numel = 1
            for d in shape:
                numel *= d
            mine[n].copy_(buckets[b][off:off + numel].view(shape))
    torch.cuda.synchronize()
    t1 = time.monotonic()
    conn.send("done")
    return (t1 - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", default="")
    a = ap.parse_args()
    iters = a.iters or (5 if a.quick else 20)
    warm = 3
    shapes = model_shapes(a.quick)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=producer, args=(there, a.quick, warm + iters))
    p.start()
    torch.cuda.set_device(0)
    mine = make(shapes, 0.0)
    total = sum(t.numel() * t.element_size() for t in mine.values())
    print("torch %s, %s: %d tensors, %.2f GB, bf16%s" % (
        torch.__version__, torch.cuda.get_device_name(0), len(mine), total / 1e9,
        " (--quick)" if a.quick else ""))

    src = make(shapes, 2.0)
    torch.cuda.synchronize()
    floor = []
    for i in range(warm + iters):
        t0 = time.monotonic()
        for n, t in src.items():
            mine[n].copy_(t)
        torch.cuda.synchronize()
        if i >= warm:
            floor.append((time.monotonic() - t0) * 1e3)
    del src
    torch.cuda.empty_cache()
    f = statistics.median(floor)
    print("  %-52s %9.2f ms  (%.2f TB/s read+write)" % (
        "in-process device-to-device copy (floor)", f, 2 * total / (f / 1e3) / 1e12))

    rows = [{"method": "floor", "label": "in-process device-to-device copy (floor)",
             "ms": f, "vs_floor": 1.0}]
    for how, label in (("per-tensor", "torch.multiprocessing, reduce_tensor per tensor"),
                       ("buckets", "512 MiB flattened buckets")):
        here.send(how)
        times = [consumer_sync(here, mine, how) for _ in range(warm + iters)][warm:]
        m = statistics.median(times)
        print("  %-52s %9.2f ms  (%.2fx the floor)" % (label, m, m / f))
        rows.append({"method": how, "label": label, "ms": m, "vs_floor": m / f})
        # The producer's value, 1.0, arrived.
        assert float(mine["model.norm.weight"][0]) == 1.0
        for t in mine.values():
            t.zero_()
    here.send("quit")
    p.join()
    if a.json:
        write_json(a.json, a, shapes, total, iters, rows)


def write_json(path, a, shapes, total, iters, rows):
    """The figures as a gpuipc-bench record (docs/bench-json.md)."""
    props = torch.cuda.get_device_properties(0)
    rec = {
        "format": "gpuipc-bench", "format_version": 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "exit_status": 0,
        "command": " ".join(["python3"] + sys.argv),
        "argv": ["python3"] + sys.argv,
        "machine": {"hostname": platform.node(), "kernel": platform.release(),
                    "arch": platform.machine(), "cpus": os.cpu_count()},
        "driver": {"library": "torch " + torch.__version__, "emulated": 0,
                   "cuda_version_text": torch.version.cuda},
        "gpus": [{"ordinal": 0, "name": props.name,
                  "memory_bytes": props.total_memory}],
        "benchmarks": [{
            "name": "sets-torch",
            "info": {"quick": int(a.quick), "iterations": iters,
                     "tensors": len(shapes), "bytes": total},
            "tables": {"torch": rows}}],
    }
    with open(path, "w") as fh:
        json.dump(rec, fh, indent=1)


if __name__ == "__main__":
    main()
