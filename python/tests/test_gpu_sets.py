"""On a GPU (make gpu-test): tensor sets from a torch producer (this
process) to a torch consumer (a child): owned double-buffered sets written
with copy_from, and wrapped sets over the producer's own tensors; the
consumer reads zero-copy views (torch.from_dlpack) or copies into its own
tensors (copy_into), and checks every value on its GPU. Skipped, with the
reason, without torch or a GPU."""
import json
import os

import pytest

import gpuipc
import gpu_sets_peers
from gpu_common import need, torch_cuda

_n = [0]


def run(kind, mode, versions=4):
    torch = need("torch", torch_cuda)
    _n[0] += 1
    name = f"pyt-gpuset-{os.getpid()}-{_n[0]}"
    s = torch.cuda.Stream()
    first = gpu_sets_peers.expected(torch, 1, contiguous=kind == "owned")
    if kind == "owned":
        # an owned set's tensors are contiguous (the consumer compares values)
        spec = {k: (tuple(t.shape), str(t.dtype).split(".")[1]) for k, t in first.items()}
        ts = gpuipc.TensorSet.empty(spec, copies=2)
        mine = {k: t.contiguous() for k, t in first.items()}
    else:
        mine = {k: t.clone() if t.is_contiguous() else t.t().contiguous().t()
                for k, t in first.items()}
        ts = gpuipc.TensorSet.from_dict(mine)
    torch.cuda.synchronize()
    with gpuipc.listen(name, timeout=60) as lst:
        with gpuipc.spawn(gpu_sets_peers.consume, name, versions, mode, kind,
                          timeout=120) as cons:
            sc = lst.accept(timeout=60)
            ts.subscribe(sc, stream=s)
            for n in range(1, versions + 1):
                with torch.cuda.stream(s):
                    c = ts.begin(stream=s, timeout=60)
                    want = gpu_sets_peers.expected(torch, n, contiguous=kind == "owned")
                    if kind == "owned":
                        src = {k: t.contiguous() for k, t in want.items()}
                        ts.copy_from(src, stream=s)
                        mine = src  # kept until the copy ran (published on s)
                    else:
                        for k, t in mine.items():
                            t.copy_(want[k])
                    assert ts.publish(stream=s) == n
                if kind == "owned":
                    assert c == (n - 1) % 2
                r = json.loads(cons.conn.recv_msg(timeout=120))
                assert "error" not in r, r
                assert r["number"] == n and r["bad"] == [], f"{kind}/{mode} version {n}: {r}"
            ts.unsubscribe(sc, timeout=60)
            r = json.loads(cons.conn.recv_msg(timeout=120))
            assert r.get("end") == "canceled", r
            cons.conn.send_msg(b"go")
            assert cons.join(60) == 0
            ts.destroy(timeout=60)
            sc.close()


@pytest.mark.parametrize("mode", ["view", "copy_into"])
@pytest.mark.parametrize("kind", ["owned", "wrapped"])
def test_torch_producer_to_torch_consumer(kind, mode):
    run(kind, mode)
