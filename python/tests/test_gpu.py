"""On a GPU (make gpu-test): torch (default allocator and
expandable_segments:True), CuPy (default memory pool), cuda.core (IPC memory
resource) and gpuipc arena producers, to torch, CuPy (from_dlpack and
asarray) and cuda.core consumers, every combination, each side its own
process; the data is checked on the GPU by the consumer's framework.
Skipped, with the reason, without a GPU or without the framework."""
import json
import os

import pytest

import gpuipc
import gpu_peers
from gpu_common import need_framework

PRODUCERS = ["torch", "torch-expandable", "cupy", "cuda.core", "arena"]
CONSUMERS = ["torch", "cupy", "cuda.core"]

_n = [0]


def run_pair(producer, consumer, transposed):
    need_framework(producer)
    need_framework(consumer)
    _n[0] += 1
    name = f"pyt-gpu-{os.getpid()}-{_n[0]}"
    env = {}
    if producer == "torch-expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    with gpuipc.spawn(gpu_peers.producer, producer, name, transposed, env=env,
                      timeout=120) as prod:
        r = json.loads(prod.conn.recv_msg(timeout=120))
        assert r.get("ready"), r
        with gpuipc.spawn(gpu_peers.consumer, consumer, name, timeout=120) as cons:
            res = json.loads(cons.conn.recv_msg(timeout=180))
            done = json.loads(prod.conn.recv_msg(timeout=180))
            assert "error" not in done, f"producer {producer}: {done}"
            assert "error" not in res, f"consumer {consumer}: {res}"
            assert res["ok"], f"{producer} -> {consumer}: data differ: {res}"
            assert done["left"] == 0 and done["wrapped"] == 0, done
            assert cons.join(60) == 0
        assert prod.join(60) == 0


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("producer", PRODUCERS)
def test_producer_to_consumer(producer, consumer):
    run_pair(producer, consumer, transposed=False)


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("producer", ["torch", "cupy", "arena"])
def test_strided_view(producer, consumer):
    run_pair(producer, consumer, transposed=True)
