"""torch.multiprocessing with gpuipc.torch.install(): a Queue of CUDA tensors,
and a consumer killed while holding tensors (the producer's memory comes
back). GPU only; skipped, with the reason, without torch or a GPU."""
import gc
import time

import pytest

from gpu_common import need, torch_cuda


def test_install_and_uninstall_switch_the_reducers():
    torch = need("torch", gpu=False)  # no GPU needed for the registration itself
    import multiprocessing.reduction as mpr

    import gpuipc.torch
    from torch.multiprocessing import reductions

    theirs = mpr.ForkingPickler._extra_reducers[torch.Tensor]
    assert theirs is reductions.reduce_tensor
    gpuipc.torch.install()
    try:
        assert mpr.ForkingPickler._extra_reducers[torch.Tensor] is gpuipc.torch._reduce_tensor
        assert gpuipc.torch.installed()
        # CPU tensors keep PyTorch's own path
        assert gpuipc.torch._reduce_tensor(torch.zeros(3))[0] is not gpuipc.torch._rebuild
    finally:
        gpuipc.torch.uninstall()
    assert mpr.ForkingPickler._extra_reducers[torch.Tensor] is theirs
    assert not gpuipc.torch.installed()


@pytest.fixture
def mp_torch():
    torch = need("torch", torch_cuda)
    import gpuipc.torch
    gpuipc.torch.install()
    yield torch
    gpuipc.torch.uninstall()


def test_queue_of_cuda_tensors(mp_torch):
    torch = mp_torch
    import gpuipc.torch
    import torch_mp_peers
    ctx = torch.multiprocessing.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    tensors = [
        torch.arange(1 << 20, device="cuda", dtype=torch.float32),
        torch.randn(64, 33, device="cuda"),
        torch.randint(0, 1000, (7, 9, 11), device="cuda", dtype=torch.int64),
        torch.randn(128, 64, device="cuda").t(),               # strided view
        torch.randn(256, device="cuda")[16:200],                # interior offset
        torch.randn(4096, device="cuda", dtype=torch.bfloat16),  # DLPack only
        torch.ones(3, device="cuda", dtype=torch.float16),
    ]
    p = ctx.Process(target=torch_mp_peers.consume, args=(q, results, len(tensors)))
    p.start()
    for t in tensors:
        q.put((t, float(t.double().sum()), list(t.shape), str(t.dtype), list(t.stride())))
    got = [results.get(timeout=180) for _ in tensors]
    assert results.get(timeout=60) == "done"
    p.join(60)
    assert p.exitcode == 0
    assert all(ok for ok, _, _ in got), got
    end = time.monotonic() + 20
    while gpuipc.torch.stats()["held"] and time.monotonic() < end:
        time.sleep(0.05)
    assert gpuipc.torch.stats() == {"pending": 0, "held": 0}


def test_killed_consumer_gives_memory_back(mp_torch):
    torch = mp_torch
    import gpuipc.torch
    import torch_mp_peers
    ctx = torch.multiprocessing.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Queue()
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    n = 4
    p = ctx.Process(target=torch_mp_peers.hold, args=(q, ready, n))
    p.start()
    for _ in range(n):
        t = torch.empty(64 << 20, device="cuda", dtype=torch.uint8)  # 64 MiB each
        q.put(t)
        del t
    assert ready.get(timeout=180) == n * (64 << 20)
    gc.collect()
    # the consumer holds them: the producer keeps the memory
    assert torch.cuda.memory_allocated() >= base + n * (64 << 20)
    assert gpuipc.torch.stats()["held"] == n
    p.kill()
    p.join(60)
    end = time.monotonic() + 30
    while time.monotonic() < end and (gpuipc.torch.stats()["held"]
                                      or torch.cuda.memory_allocated() > base):
        time.sleep(0.05)
        gc.collect()
    assert gpuipc.torch.stats()["held"] == 0
    assert torch.cuda.memory_allocated() == base, (
        f"{torch.cuda.memory_allocated() - base} bytes not given back after the consumer "
        "was killed")


def test_uninstalled_queue_still_works(mp_torch):
    """After uninstall() PyTorch's own path carries the tensors again."""
    torch = mp_torch
    import gpuipc.torch
    import torch_mp_peers
    gpuipc.torch.uninstall()
    ctx = torch.multiprocessing.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=torch_mp_peers.echo_ptrs, args=(q, out, 2))
    p.start()
    a = torch.full((10,), 5.0, device="cuda")
    q.put(a)
    b = torch.full((10,), 7.0, device="cuda")
    q.put(b)
    assert [out.get(timeout=120), out.get(timeout=120)] == [5.0, 7.0]
    p.join(60)
    gpuipc.torch.install()  # the fixture uninstalls


def test_queue_from_an_expandable_segments_producer(mp_torch):
    """Memory of expandable segments needs a file descriptor: those tensors
    take the request route (the consumer asks, the producer's server sends
    a leased buffer)."""
    import os

    torch = mp_torch
    import torch_mp_peers
    ctx = torch.multiprocessing.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    old = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        p = ctx.Process(target=torch_mp_peers.produce, args=(q, done, 5))
        p.start()
    finally:
        if old is None:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = old
    try:
        for i in range(5):
            t, want = q.get(timeout=180)
            assert t.is_cuda and t.shape == (1000 + i,)
            assert float(t.double().sum()) == want
            del t
    finally:
        done.put(1)
        p.join(60)
    assert p.exitcode == 0
