"""python -m gpuipc.bench_sets: weight sync through a tensor set, from Python.

The Python twin of `gpuipc bench sets`: the shapes of Llama-2-7B in bf16
(291 tensors, 13.48 GB) from a producer process (a trainer: a wrapped set
over its own weights, one version per sync) into a consumer process's own
tensors on the same GPU (an engine: recv, copy_into on one stream, release),
next to the floors, in one run:

  floor (one copy)   in-process: one device-to-device copy of the same bytes
                     (one flat buffer into another)
  floor (per tensor) in-process: dst.copy_(src) per tensor
  C set copy_into    the C set's copy_into through the extension, on the same
                     tensors given as raw addresses (a plan of ints: no
                     resolution, no stream work: the binding's floor)
  copy_into          the same with the torch tensors (a dict by name),
                     resolved in C each sync
  copy_into (plan)   the same with a CopyPlan made once (Version.plan_into)
  zero-copy          consumer holding a torch tensor of every entry
                     (Version.as_torch: one call; built again only when the
                     copy's addresses change)
  zero-copy (old)    the same through torch.from_dlpack of each TensorView

Each copy row: producer's begin -> consumer's copies done (stream synced);
zero-copy rows: producer's begin -> consumer holding the tensors; "build"
columns: the consumer's own part after recv. Medians after warm-up; one
clock for both processes (CLOCK_MONOTONIC). Ratios against the C set's row
and the floors of the same run. Needs PyTorch with CUDA for the floors and
the torch rows. --quick: a small model (4 layers of width 512).
--emulator (or no torch): an owned set of the quick shapes into gpuipc
arena blocks, no floor, no torch rows (a smoke run of the path, not a
measurement).

Then KV-cache blocks as one set (1,000, 10,000 and 100,000 blocks of
4 KiB; 1,000 and 10,000 of 256 KiB; --quick: the first two), an owned set
in the producer, copied into the consumer's paged cache (one allocation,
block i at a shuffled slot) with a plan of the slots' addresses; beside
it, in-process in the same run, torch's own way: index_copy_ of all the
blocks into their slots (one kernel) and a copy_ per block (up to 10,000
blocks).

  python -m gpuipc.bench_sets [--quick] [--iters N] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import gpuipc


def llama_shapes(layers, hidden, mlp, vocab):
    """(name, shape) of a Llama-2 model's weights, in its state_dict order."""
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((p + f"self_attn.{n}.weight", (hidden, hidden)))
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


def _nbytes(shapes):
    total = 0
    for _, s in shapes:
        n = 2
        for d in s:
            n *= d
        total += n
    return total


def _torch_why():
    if "emu" in os.path.basename(os.environ.get("GPUIPC_CUDA_DRIVER", "")):
        return "on the CUDA driver emulator"
    try:
        import torch
    except Exception as e:
        return f"torch not importable: {type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def _producer(conn, name, quick, use_torch):
    """The trainer: one version per command ('zero' / 'copy'), reporting
    the time it began."""
    shapes = model_shapes(quick)
    if use_torch:
        import torch
        torch.cuda.set_device(0)
        weights = {n: torch.full(s, 1.0, dtype=torch.bfloat16, device="cuda:0")
                   for n, s in shapes}
        torch.cuda.synchronize()
        ts = gpuipc.TensorSet.from_dict(weights)
        stream = torch.cuda.current_stream()
    else:
        ts = gpuipc.TensorSet.empty({n: (s, "bfloat16") for n, s in shapes})
        stream = None
    with gpuipc.listen(name, timeout=60) as lst:
        conn.send_msg(b"ready")
        sc = lst.accept(timeout=60)
        ts.subscribe(sc, stream=stream)
        while True:
            cmd = conn.recv_msg(timeout=600)
            if cmd == b"quit":
                break
            t0 = time.monotonic_ns()
            ts.begin(stream=stream, timeout=60)  # waits for the consumer's release
            ts.publish(stream=stream)            # the weights are already in place
            conn.send_msg(str(t0).encode())
        ts.unsubscribe(sc, timeout=60)
        ts.destroy(timeout=60)
        sc.close()


KV_SETS = [(1000, 4 << 10), (10000, 4 << 10), (100000, 4 << 10),
           (1000, 256 << 10), (10000, 256 << 10)]
KV_QUICK = [(1000, 4 << 10), (10000, 4 << 10)]


def _kv_producer(conn, name, sets):
    """The KV side's producer: an owned set per (blocks, bytes), one
    version per command, reporting the time it began."""
    with gpuipc.listen(name, timeout=60) as lst:
        conn.send_msg(b"ready")
        sc = lst.accept(timeout=60)
        for n, bsz in sets:
            ts = gpuipc.TensorSet.empty({f"kv.{i}": ((bsz,), "uint8") for i in range(n)},
                                        timeout=120)
            ts.subscribe(sc)
            while True:
                cmd = conn.recv_msg(timeout=600)
                if cmd == b"next":
                    break
                t0 = time.monotonic_ns()
                ts.begin(timeout=120)
                ts.publish()
                conn.send_msg(str(t0).encode())
            ts.unsubscribe(sc, timeout=120)
            ts.destroy(timeout=120)
        sc.close()


def _slots(n, seed=27):
    """A fixed shuffle of range(n): block i goes to slot slots[i]."""
    import random
    r = random.Random(seed)
    s = list(range(n))
    r.shuffle(s)
    return s


def run_kv(quick, iters, use_torch, out):
    """The KV-cache rows (see the module's doc); returns one dict per set."""
    sets = KV_QUICK if quick else KV_SETS
    name = f"bench-kv-{os.getpid()}"
    results = []
    warm = 2
    print(f"KV cache blocks as one set into the consumer's paged cache (blocks at "
          f"shuffled slots), {'torch' if use_torch else 'gpuipc arena blocks (no torch)'}; "
          f"median of {iters} after {warm} warm-up", file=out)
    print(f"  {'blocks':>7} {'KiB':>4} {'copy_into':>12} {'index_copy_':>12} "
          f"{'per-block':>12}  ratios", file=out)
    with gpuipc.spawn(_kv_producer, name, sets, timeout=120) as p:
        assert p.conn.recv_msg(timeout=120) == b"ready"
        sc = gpuipc.connect(name, timeout=60)
        sub = gpuipc.TensorSet.subscribe(sc)
        for n, bsz in sets:
            slots = _slots(n)
            rows = {}
            if use_torch:
                import torch
                cache = torch.zeros((n, bsz), dtype=torch.uint8, device="cuda:0")
                base = cache.data_ptr()
                sync = torch.cuda.synchronize
                stream = torch.cuda.current_stream()
                src = torch.ones((n, bsz), dtype=torch.uint8, device="cuda:0")
                idx = torch.tensor(slots, dtype=torch.long, device="cuda:0")
                t_ic, t_pb = [], []
                for i in range(iters + warm):
                    sync()
                    t0 = time.monotonic_ns()
                    cache.index_copy_(0, idx, src)
                    sync()
                    t1 = time.monotonic_ns()
                    if n <= 10000:
                        for b in range(n):
                            cache[slots[b]].copy_(src[b])
                        sync()
                    t2 = time.monotonic_ns()
                    if i >= warm:
                        t_ic.append((t1 - t0) / 1e6)
                        if n <= 10000:
                            t_pb.append((t2 - t1) / 1e6)
                del src, idx
                rows["torch index_copy_"] = _median(t_ic)
                rows["torch copy_ per block"] = _median(t_pb)
            else:
                arena = gpuipc.Arena(chunk_bytes=max(64 << 20, 2 * n * bsz))
                cache = arena.alloc(shape=(n * bsz,), dtype="uint8")
                base = cache.ptr
                stream = None
                ev = gpuipc.Event()

                def sync():
                    ev.record(stream=None)
                    ev.synchronize()
            plan, times = None, []
            for i in range(iters + warm):
                p.conn.send_msg(b"go")
                v = sub.recv(stream=stream, timeout=120)
                if plan is None:
                    plan = v.plan_into([base + slots[b] * bsz for b in range(n)])
                v.copy_into(plan, stream=stream)
                sync()
                t1 = time.monotonic_ns()
                v.release(stream=stream)
                t0 = int(p.conn.recv_msg(timeout=120))
                if i >= warm:
                    times.append((t1 - t0) / 1e6)
            rows["copy_into"] = _median(times)
            p.conn.send_msg(b"next")
            try:
                while True:
                    sub.recv(timeout=120)
            except gpuipc.CanceledError:
                pass
            del plan, cache
            ratios = {}
            for k in ("torch index_copy_", "torch copy_ per block"):
                if rows.get(k):
                    ratios[f"copy_into / {k}"] = rows["copy_into"] / rows[k]

            def fmt(m):
                return "-" if m is None else f"{m:9.3f} ms"
            extra = "  ".join(f"{v_:.3f}x {k.split(' / ')[1]}" for k, v_ in ratios.items())
            print(f"  {n:>7} {bsz >> 10:>4} {fmt(rows['copy_into']):>12} "
                  f"{fmt(rows.get('torch index_copy_')):>12} "
                  f"{fmt(rows.get('torch copy_ per block')):>12}  {extra}", file=out)
            results.append({"blocks": n, "block_bytes": bsz, "ms": rows, "ratios": ratios})
        sub.close()
        assert p.join(120) == 0
        sc.close()
    return results


def _median(xs):
    return statistics.median(xs) if xs else None


def run(quick, iters, use_torch, out):
    shapes = model_shapes(quick)
    total = _nbytes(shapes)
    name = f"bench-sets-{os.getpid()}"
    rows, build = {}, {}
    warm = 3
    if use_torch:
        import torch
        torch.cuda.set_device(0)
        mine = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda:0") for n, s in shapes}
        src = {n: torch.full(s, 1.0, dtype=torch.bfloat16, device="cuda:0") for n, s in shapes}
        stream = torch.cuda.current_stream()
        sync = torch.cuda.synchronize
        addrs = [t.data_ptr() for t in mine.values()]
        floor, floor1 = [], []
        flat_a = torch.empty(total, dtype=torch.uint8, device="cuda:0")
        flat_b = torch.empty(total, dtype=torch.uint8, device="cuda:0")
        for i in range(iters + warm):
            sync()
            t0 = time.monotonic_ns()
            for n, t in mine.items():
                t.copy_(src[n])
            sync()
            t1 = time.monotonic_ns()
            flat_b.copy_(flat_a)
            sync()
            t2 = time.monotonic_ns()
            if i >= warm:
                floor.append((t1 - t0) / 1e6)
                floor1.append((t2 - t1) / 1e6)
        del src, flat_a, flat_b
        rows["floor (per tensor)"] = _median(floor)
        rows["floor (one copy)"] = _median(floor1)
    else:
        arena = gpuipc.Arena(chunk_bytes=max(64 << 20, 2 * total))
        mine = {n: arena.alloc(shape=s, dtype="bfloat16") for n, s in shapes}
        addrs = [b.ptr for b in mine.values()]
        stream = None
        ev = gpuipc.Event()

        def sync():
            ev.record(stream=None)
            ev.synchronize()

    modes = ["C set copy_into", "copy_into", "copy_into (plan)", "zero-copy"]
    if use_torch:
        modes.append("zero-copy (old)")
    with gpuipc.spawn(_producer, name, quick, use_torch, timeout=120) as p:
        assert p.conn.recv_msg(timeout=120) == b"ready"
        sc = gpuipc.connect(name, timeout=60)
        sub = gpuipc.TensorSet.subscribe(sc)
        raw = plan = None
        for mode in modes:
            times, own = [], []
            for i in range(iters + warm):
                p.conn.send_msg(b"go")
                v = sub.recv(stream=stream, timeout=60)
                tr = time.monotonic_ns()
                held = None
                if mode == "C set copy_into":
                    if raw is None:
                        raw = v.plan_into(addrs)
                    v.copy_into(raw, stream=stream)
                    sync()
                elif mode == "copy_into":
                    v.copy_into(mine, stream=stream)
                    sync()
                elif mode == "copy_into (plan)":
                    if plan is None:
                        plan = v.plan_into(mine)
                    v.copy_into(plan, stream=stream)
                    sync()
                elif mode == "zero-copy":
                    held = v.as_torch() if use_torch else [v[n] for n in v]
                else:
                    held = [torch.from_dlpack(v[n]) for n in v]
                t1 = time.monotonic_ns()
                del held
                v.release(stream=stream)
                t0 = int(p.conn.recv_msg(timeout=60))
                if i >= warm:
                    times.append((t1 - t0) / 1e6)
                    own.append((t1 - tr) / 1e6)
            rows[mode] = _median(times)
            build[mode] = _median(own)
        p.conn.send_msg(b"quit")
        try:
            sub.recv(timeout=60)
        except gpuipc.CanceledError:
            pass
        sub.close()
        assert p.join(120) == 0
        sc.close()
    c = rows.get("C set copy_into")
    f1, ft = rows.get("floor (one copy)"), rows.get("floor (per tensor)")
    ratios = {}
    for k in ("copy_into", "copy_into (plan)"):
        if c:
            ratios[f"{k} / C set"] = rows[k] / c
        if f1:
            ratios[f"{k} / floor (one copy)"] = rows[k] / f1
    if c and f1:
        ratios["C set / floor (one copy)"] = c / f1
    print(f"weight sync, {len(shapes)} tensors of bf16, {total / 1e9:.2f} GB, "
          f"{'torch' if use_torch else 'gpuipc arena blocks (no torch)'}; "
          f"median of {iters} after {warm} warm-up", file=out)

    def fmt(m):
        if m is None:
            return "        -"
        return f"{m * 1e3:9.1f} us" if m < 1 else f"{m:9.2f} ms"

    print(f"  {'row':<22} {'begin -> done':>14} {'consumer part':>14}  ratios", file=out)
    for k in ("floor (one copy)", "floor (per tensor)", *modes):
        if k not in rows:
            print(f"  {k:<22} (not measured: no torch)", file=out)
            continue
        extra = ""
        if k.startswith("copy_into") and c:
            extra = f"  {rows[k] / c:.3f}x the C set"
        if f1 and (k.startswith("copy_into") or k.startswith("C set")):
            extra += f"  {rows[k] / f1:.3f}x one copy"
        if k == "floor (one copy)":
            extra = f"  {2 * total / (rows[k] / 1e3) / 1e12:.2f} TB/s read+write"
        if k == "floor (per tensor)" and f1:
            extra = f"  {rows[k] / f1:.3f}x one copy"
        print(f"  {k:<22} {fmt(rows[k]):>14} {fmt(build.get(k)):>14}{extra}", file=out)
    return {"tensors": len(shapes), "bytes": total, "iters": iters, "torch": use_torch,
            "ms": rows, "consumer_ms": build, "ratios": ratios}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gpuipc.bench_sets",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model (a smoke run)")
    ap.add_argument("--iters", type=int, default=0, help="measured syncs per row")
    ap.add_argument("--emulator", action="store_true",
                    help="no torch: an owned set into arena blocks (quick shapes)")
    ap.add_argument("--json", action="store_true", help="also print the result as JSON")
    a = ap.parse_args(argv)
    why = "--emulator" if a.emulator else _torch_why()
    use_torch = why is None
    quick = a.quick or not use_torch
    iters = a.iters or (5 if quick else 20)
    if not use_torch:
        print(f"python -m gpuipc.bench_sets: without torch ({why}): the path only, no floor",
              file=sys.stderr)
    r = run(quick, iters, use_torch, sys.stdout)
    r["kv"] = run_kv(quick, iters, use_torch, sys.stdout)
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
