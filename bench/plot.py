#!/usr/bin/env python3
"""plot.py: charts from `gpuipc bench ... --json FILE` records.

    bench/plot.py [--out DIR] [--check] FILE.json [FILE.json ...]

Draws, for each benchmark found in the files:
  handoff  handoff-latency.png: median and p90 handoff latency against the
           buffer size (1 and 8 consumers), with the raw driver paths
           measured in the same run (legacy IPC open/close per buffer,
           mempool export/import per buffer, the GPU round trip of the
           ordering mechanism, one message between the processes) as
           horizontal lines; handoff-throughput.png: buffers per second.
  copy     copy-throughput.png: GB/s against the size, one panel per case
           (H2D/D2H pinned and pageable, the staged pipeline, the shared
           segment), gpuipc next to the plain driver call and the bound.
  handle   handle-ops.png: export/import/close per pool kind, gpuipc next
           to the raw driver calls.
Each chart says under its title the GPU, driver and command that made it.

--check reads and checks the files and lists the charts it would draw; it
needs no matplotlib. Exit status: 0 done; 1 a file is not a gpuipc-bench
record or has no figures; 2 usage; 3 matplotlib is not installed (nothing
drawn; the message says how to install it).
"""
import argparse
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"plot.py: {path}: {e}") from None
    if d.get("format") != "gpuipc-bench":
        print(f"plot.py: {path}: not a gpuipc-bench record "
              "(made by gpuipc bench ... --json FILE)", file=sys.stderr)
        sys.exit(1)
    return d


def subtitle(d):
    gpus = d.get("gpus") or []
    gpu = gpus[0]["name"] if gpus else "no GPU"
    drv = d.get("driver", {})
    cuda = drv.get("cuda_version_text") or "?"
    emu = " (emulator: not a GPU's figures)" if drv.get("emulated") else ""
    return f"{gpu}, CUDA {cuda}{emu}\n{d.get('command', '')}"


def num(v):
    """A figure for matplotlib: null (not measured) becomes NaN, a gap."""
    return float("nan") if v is None else float(v)


def size_label(b):
    b = int(b)
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def charts_of(records):
    """(name, benchmark, record) for every chart the records make."""
    out = []
    for d in records:
        for b in d.get("benchmarks", []):
            t = b.get("tables", {})
            if b["name"] == "handoff" and t.get("handoff"):
                out.append(("handoff-latency", b, d))
                out.append(("handoff-throughput", b, d))
            elif b["name"] == "copy" and t.get("copy"):
                out.append(("copy-throughput", b, d))
            elif b["name"] == "handle" and t.get("handle"):
                out.append(("handle-ops", b, d))
            elif b["name"] == "sets" and t.get("model"):
                out.append(("sets-sync", b, d))
    # The torch peers (bench/torch_weight_sync.py --json) are drawn beside
    # the tensor sets: attach them to that chart.
    torch_rows = [r for d in records for b in d.get("benchmarks", [])
                  if b["name"] == "sets-torch" for r in b.get("tables", {}).get("torch", [])]
    for _, b, _ in out:
        if b["name"] == "sets":
            b["_torch"] = torch_rows
    return out


def draw_handoff_latency(plt, b, d, path):
    rows = b["tables"]["handoff"]
    raw = {r["path"]: r for r in b["tables"].get("raw", [])}
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, style in ((1, "o-"), (max(r["consumers"] for r in rows), "s-")):
        rs = sorted((r for r in rows if r["consumers"] == n),
                    key=lambda r: r["size_bytes"])
        if not rs:
            continue
        x = [r["size_bytes"] for r in rs]
        ax.plot(x, [num(r["median_us"]) for r in rs], style,
                label=f"gpuipc handoff, {n} consumer(s), median")
        ax.plot(x, [num(r["p90_us"]) for r in rs], style, alpha=0.35,
                label=f"gpuipc handoff, {n} consumer(s), p90")
    names = {"legacy": "legacy IPC: get + open + close per buffer",
             "mempool": "mempool: export + import + free per buffer",
             "memop_round_trip": "GPU round trip (stream write/wait value)",
             "message": "one message between the processes"}
    for i, (k, label) in enumerate(names.items()):
        if k in raw and raw[k].get("per_buffer_us") is not None:
            ax.axhline(raw[k]["per_buffer_us"], linestyle="--",
                       color=f"C{i + 2}", label=f"{label} (same run)")
    sizes = sorted({r["size_bytes"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(s) for s in sizes])
    ax.set_xlabel("buffer size")
    ax.set_ylabel("microseconds (log)")
    ax.set_title("Handoff latency: send until the consumer holds the buffer\n"
                 + subtitle(d), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_handoff_throughput(plt, b, d, path):
    rows = b["tables"]["handoff"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for n in sorted({r["consumers"] for r in rows}):
        rs = sorted((r for r in rows if r["consumers"] == n),
                    key=lambda r: r["size_bytes"])
        ax.plot([r["size_bytes"] for r in rs],
                [num(r["buffers_per_s"]) for r in rs], "o-",
                label=f"{n} consumer(s)")
    sizes = sorted({r["size_bytes"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(s) for s in sizes])
    ax.set_xlabel("buffer size")
    ax.set_ylabel("buffers per second (full cycle, log)")
    ax.set_title("Handoff throughput: send, receive, release, release seen\n"
                 + subtitle(d), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_copy(plt, b, d, path):
    rows = b["tables"]["copy"]
    cases = []
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
    cols = 2
    nrows = (len(cases) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 3 * nrows),
                             squeeze=False)
    unit = b.get("info", {}).get("unit", "GB/s")
    for ax, case in zip(axes.flat, cases):
        rs = sorted((r for r in rows if r["case"] == case),
                    key=lambda r: r["size_bytes"])
        x = [r["size_bytes"] for r in rs]
        ax.plot(x, [num(r["gpuipc_gbps"]) for r in rs], "o-", label="gpuipc")
        if any(r.get("plain_gbps") is not None for r in rs):
            ax.plot(x, [num(r.get("plain_gbps")) for r in rs], "s--",
                    label="plain driver call")
        ax.plot(x, [num(r["bound_gbps"]) for r in rs], ":", color="black",
                label="bound")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([size_label(s) for s in x], fontsize=7)
        ax.set_title(case, fontsize=9)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(cases):]:
        ax.set_visible(False)
    fig.suptitle("Copy throughput against size, with the bounds\n"
                 + subtitle(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_handle(plt, b, d, path):
    rows = b["tables"]["handle"]
    labels = [f"{r['kind']}\n{r['operation']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [num(r["gpuipc_us"]) for r in rows], 0.4,
           label="gpuipc")
    ax.bar([i + 0.2 for i in x], [num(r.get("raw_us")) for r in rows], 0.4,
           label="raw driver calls")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds per buffer (median, log)")
    ax.set_title("Export and import per buffer, by pool kind\n" + subtitle(d),
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_sets(plt, b, d, path):
    m = b["tables"]["model"][0]
    bars = [("in-process copy\n(floor, gpuipc run)", num(m.get("floor_ms"))),
            ("gpuipc sets\ncopy_into", num(m.get("copy_into_ms"))),
            ("gpuipc sets\nzero-copy views", num(m.get("zero_copy_median_us")) / 1000.0)]
    names = {"floor": "in-process copy\n(floor, torch run)",
             "per-tensor": "torch.mp\nreduce_tensor\nper tensor",
             "buckets": "torch.mp\n512 MiB\nbuckets"}
    for r in b.get("_torch", []):
        bars.append((names.get(r["method"], r["method"]), num(r["ms"])))
    fig, ax = plt.subplots(figsize=(max(7, len(bars) * 1.6), 5))
    x = range(len(bars))
    colors = ["#888888", "#1f77b4", "#1f77b4"] + [
        "#888888" if r["method"] == "floor" else "#d62728" for r in b.get("_torch", [])]
    ax.bar(list(x), [v for _, v in bars], 0.6, color=colors)
    for i, (_, v) in enumerate(bars):
        if v == v:
            ax.text(i, v, f"{v:.3g} ms", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([n for n, _ in bars], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("milliseconds per sync (median, log)")
    ax.set_title(f"Weight sync, {m['set']}: {int(m['tensors'])} tensors, "
                 f"{m['bytes'] / 1e9:.2f} GB, producer -> consumer process\n"
                 + subtitle(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


DRAW = {"handoff-latency": draw_handoff_latency,
        "handoff-throughput": draw_handoff_throughput,
        "copy-throughput": draw_copy,
        "handle-ops": draw_handle,
        "sets-sync": draw_sets}


def main():
    ap = argparse.ArgumentParser(
        description="charts from gpuipc bench --json records")
    ap.add_argument("files", nargs="+", metavar="FILE.json")
    ap.add_argument("--out", default=".", help="directory for the PNGs")
    ap.add_argument("--check", action="store_true",
                    help="check the files and list the charts; draw nothing")
    a = ap.parse_args()
    records = [load(p) for p in a.files]
    charts = charts_of(records)
    if not charts:
        print("plot.py: no figures to draw in " + ", ".join(a.files),
              file=sys.stderr)
        return 1
    paths = [os.path.join(a.out, name + ".png") for name, _, _ in charts]
    if a.check:
        for p in paths:
            print(f"would draw {p}")
        return 0
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed, so no chart was drawn "
              "(install it: python3 -m pip install matplotlib, or "
              "apt-get install python3-matplotlib; --check needs none)",
              file=sys.stderr)
        return 3
    os.makedirs(a.out, exist_ok=True)
    for (name, b, d), p in zip(charts, paths):
        DRAW[name](plt, b, d, p)
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
