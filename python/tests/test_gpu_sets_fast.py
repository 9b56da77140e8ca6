"""On a GPU (make gpu-test): tensor sets with torch at C speed: torch
tensors read in C (DLPack's C exchange API where torch has it), checked
against the layout (dtype, shape, strides), copy plans on both sides, and a
version's torch tensors built in one call (as_torch), the same objects
again for a later version in the same copy. Skipped, with the reason,
without torch or a GPU."""
import json
import os

import pytest

import gpuipc
import gpu_sets_peers
import sets_fast_peers
from gpu_common import need, torch_cuda


def test_torch_plans_checks_and_as_torch():
    torch = need("torch", torch_cuda)
    name = f"pyt-gpusetf-{os.getpid()}"
    first = gpu_sets_peers.expected(torch, 1, contiguous=True)
    spec = {k: (tuple(t.shape), str(t.dtype).split(".")[1]) for k, t in first.items()}
    ts = gpuipc.TensorSet.empty(spec, copies=2)
    src = {k: t.clone() for k, t in first.items()}
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        plan = ts.plan_from(src)
        ts.begin(stream=s)
        wrong = dict(src)
        wrong["embed.weight"] = src["embed.weight"].to(torch.float16)  # same bytes
        with pytest.raises(ValueError, match=r"'embed.weight'\) is bfloat16, the array given "
                           r"for it float16"):
            ts.copy_from(wrong, stream=s)
        t = src["layers.0.mlp.up"]
        with pytest.raises(ValueError, match="strides"):
            ts.copy_from({"layers.0.mlp.up": t.t().contiguous().t()}, stream=s)
        with pytest.raises(ValueError, match="not in CUDA device memory"):
            ts.copy_from({"quant": src["quant"].cpu()}, stream=s)
        ts.copy_from(plan, stream=s)
        ts.publish(stream=s)  # version 1, before any consumer (a late joiner gets it)
    versions = 4
    with gpuipc.listen(name, timeout=60) as lst:
        with gpuipc.spawn(sets_fast_peers.torch_consume, name, versions, timeout=120) as cons:
            sc = lst.accept(timeout=60)
            with torch.cuda.stream(s):
                ts.subscribe(sc, stream=s)
                for n in range(1, versions + 1):
                    if n > 1:
                        want = gpu_sets_peers.expected(torch, n, contiguous=True)
                        for k in src:
                            src[k].copy_(want[k])  # the plan's tensors, written in place
                        ts.begin(stream=s, timeout=60)
                        ts.copy_from(plan, stream=s)
                        assert ts.publish(stream=s) == n
                    r = json.loads(cons.conn.recv_msg(timeout=120))
                    assert r["number"] == n, r
                    assert r["views_ok"] and r["copy_into_ok"] and r["plan_ok"], r
                    assert r["refused"] and "float16" in r["refused"], r
                    assert r["same_objects"] in ((None,) if n <= 2 else (True,)), r
            ts.unsubscribe(sc, timeout=60)
            cons.conn.send_msg(b"go")
            assert cons.join(60) == 0
            sc.close()
    ts.destroy()
