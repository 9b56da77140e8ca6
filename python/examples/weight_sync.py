#!/usr/bin/env python3
"""weight_sync.py: a trainer pushes its new weights into an inference
engine's process after every step, as one tensor set.

The trainer shares its weights where PyTorch put them (a wrapped set: no
bucket to flatten, no handle per tensor); the engine copies each version
into its own weights on one stream (copy_into) and releases it. Per step
that is one small message and one stream-ordered signal, whatever the
number of tensors; the memory was imported once, at subscribe.

    python3 python/examples/weight_sync.py [--steps 5] [--layers 4]

Needs PyTorch with CUDA. The two processes share one GPU.
"""
import argparse
import json
import os
import time

import gpuipc


def shapes(layers, hidden=1024, mlp=2816, vocab=8000):
    out = [("embed.weight", (vocab, hidden))]
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            out.append((f"layers.{i}.attn.{n}.weight", (hidden, hidden)))
        out.append((f"layers.{i}.mlp.up.weight", (mlp, hidden)))
        out.append((f"layers.{i}.mlp.down.weight", (hidden, mlp)))
        out.append((f"layers.{i}.norm.weight", (hidden,)))
    out.append(("lm_head.weight", (vocab, hidden)))
    return out


def engine(conn, name, layers):
    """The inference engine: its own weights, refreshed from each version."""
    import torch

    model = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes(layers)}
    stream = torch.cuda.current_stream()
    sc = gpuipc.connect(name, timeout=60)
    with gpuipc.TensorSet.subscribe(sc) as sub:
        for version in sub:  # until the trainer ends the subscription
            with version:    # releases it (ordered on the stream) at the end
                t0 = time.perf_counter()
                version.copy_into(model, stream=stream)  # no host wait
                stream.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
            # ... serve requests with `model` here ...
            ok = all(bool((t == float(version.number)).all()) for t in model.values())
            conn.send_msg(json.dumps({"version": version.number, "copy_ms": ms,
                                      "ok": ok}).encode())
    sc.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    import torch

    weights = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda")
               for n, s in shapes(a.layers)}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    ts = gpuipc.TensorSet.from_dict(weights)  # the weights stay where they are
    print(f"trainer: {ts.count} tensors, {nbytes / 1e6:.0f} MB, layout {ts.layout:#x}")
    name = f"weight-sync-{os.getpid()}"
    stream = torch.cuda.current_stream()
    with gpuipc.listen(name, timeout=60) as lst, \
            gpuipc.spawn(engine, name, a.layers, timeout=120) as eng:
        sc = lst.accept(timeout=60)
        ts.subscribe(sc, stream=stream)  # table + memory, once
        for step in range(1, a.steps + 1):
            # One copy: begin waits until the engine released the last
            # version, so the optimizer never writes what the engine reads.
            ts.begin(stream=stream, timeout=60)
            for t in weights.values():  # "the optimizer step"
                t.fill_(float(step))
            ts.publish(stream=stream)   # ordered after the writes on stream
            r = json.loads(eng.conn.recv_msg(timeout=60))
            print(f"step {step}: engine has version {r['version']} "
                  f"(copy_into {r['copy_ms']:.2f} ms, values {'ok' if r['ok'] else 'WRONG'})")
            if not r["ok"]:
                raise SystemExit("weight_sync: the engine's weights differ")
        ts.unsubscribe(sc, timeout=60)  # the engine's loop ends
        ts.destroy()
        assert eng.join(60) == 0
        sc.close()
    print("done")


if __name__ == "__main__":
    main()
