"""Children of test_gpu_torch_mp.py (torch.multiprocessing, spawn context)."""
import time


def consume(q, results, n):
    """Gets n CUDA tensors, checks each on the GPU against the value its
    producer computed, lets each go."""
    import torch
    for _ in range(n):
        t, want_sum, shape, dtype, stride = q.get(timeout=120)
        ok = (t.is_cuda and list(t.shape) == shape and str(t.dtype) == dtype
              and list(t.stride()) == stride
              and abs(float(t.double().sum()) - want_sum) < 1e-3 * max(1.0, abs(want_sum)))
        results.put((ok, list(t.shape), str(t.dtype)))
        del t
    results.put("done")


def hold(q, ready, n):
    """Gets n tensors and keeps them until killed."""
    held = [q.get(timeout=120) for _ in range(n)]
    import torch
    torch.cuda.synchronize()
    ready.put(sum(int(t.numel()) for t in held))
    time.sleep(600)


def echo_ptrs(q, out, n):
    for _ in range(n):
        t = q.get(timeout=120)
        out.put(float(t[0]))
        del t


def produce(q, done, n):
    """Puts n CUDA tensors (with gpuipc's reducers), each with its sum;
    keeps running until told, so that its memory stays valid."""
    import os

    import torch

    import gpuipc.torch
    gpuipc.torch.install()
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for i in range(n):
        t = torch.full((1000 + i,), float(i + 1), device="cuda")
        q.put((t, float(t.double().sum())))
        del t
    done.get(timeout=300)
