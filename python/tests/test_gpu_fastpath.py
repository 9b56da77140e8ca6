"""On a GPU (make gpu-test), with the real torch: recv(as_torch=True) and
recv_batch(as_torch=True) give torch tensors of the producer's data, on
torch's current stream, whose deaths give the leases back (one release per
batch). Skipped, with the reason, without a GPU or without torch."""
import gc
import json
import time

import gpuipc
from gpu_common import need, torch_cuda


def _producer(conn, n, k):
    """n blocks of 1024 int32, block i filled with i on the producer's
    stream; sent one by one (k 1) or in batches of k; on "count N" waits
    until N leases are left and reports them; "bye" ends it."""
    import torch
    s = torch.cuda.Stream()
    a = gpuipc.Arena(chunk_bytes=16 << 20)
    blocks = [a.alloc(4096, shape=(1024,), dtype="int32", stream=s) for _ in range(n)]
    with torch.cuda.stream(s):
        for i, b in enumerate(blocks):
            torch.from_dlpack(b).fill_(i)
    if k > 1:
        for i in range(0, n, k):
            conn.send_batch(blocks[i:i + k], stream=s)
    else:
        for b in blocks:
            conn.send(b, stream=s)
    while True:
        m = conn.recv_msg(timeout=120)
        if m == b"bye":
            return
        want = int(m.split()[1])
        end = time.monotonic() + 30
        while a.stats()["leases"] != want and time.monotonic() < end:
            conn.progress(0.02)
        conn.send_msg(json.dumps({"leases": a.stats()["leases"]}).encode())


def _leases(p, want):
    p.conn.send_msg(b"count %d" % want)
    return json.loads(p.conn.recv_msg(timeout=60))["leases"]


def test_as_torch_on_the_gpu():
    torch = need("torch", torch_cuda)
    cs = torch.cuda.Stream()
    with torch.cuda.stream(cs), gpuipc.spawn(_producer, 3, 1, timeout=120) as p:
        ts = [p.conn.recv(as_torch=True, timeout=60) for _ in range(3)]
        for i, t in enumerate(ts):
            assert isinstance(t, torch.Tensor) and t.is_cuda
            assert t.shape == (1024,) and t.dtype == torch.int32
            assert int(t.sum().item()) == 1024 * i  # ordered after the producer's fill
        assert _leases(p, 3) == 3
        del t
        ts.pop(0)
        gc.collect()
        assert _leases(p, 2) == 2
        del ts
        gc.collect()
        assert _leases(p, 0) == 0
        p.conn.send_msg(b"bye")
        assert p.join(60) == 0


def test_recv_batch_as_torch_on_the_gpu():
    torch = need("torch", torch_cuda)
    with gpuipc.spawn(_producer, 8, 8, timeout=120) as p:
        ts = []
        while len(ts) < 8:
            ts += p.conn.recv_batch(8, as_torch=True, timeout=60)
        assert [int(t[0].item()) for t in ts] == list(range(8))
        last = ts.pop()
        del ts
        gc.collect()
        assert _leases(p, 8) == 8  # the batch goes back with its last tensor
        del last
        gc.collect()
        assert _leases(p, 0) == 0
        p.conn.send_msg(b"bye")
        assert p.join(60) == 0
