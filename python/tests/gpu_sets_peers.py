"""The torch consumer of test_gpu_sets.py, run in a child process: it
subscribes on a second connection (the set's), checks every version it
receives against the values the producer wrote (computed again here, on
this process's GPU), and reports each result as a JSON message on the spawn
connection."""
import json

import gpuipc

SPEC = [  # name, shape, dtype, transposed
    ("embed.weight", (512, 64), "bfloat16", False),
    ("layers.0.attn.qkv", (192, 64), "float16", False),
    ("layers.0.mlp.up", (64, 256), "float32", True),
    ("layers.0.norm", (64,), "float32", False),
    ("positions", (7, 9, 11), "int64", False),
    ("quant", (33,), "int8", False),
    ("mask", (5, 17), "bool", False),
]


def expected(torch, version, device="cuda", contiguous=False):
    """Tensor k of version n: small integers (exact in bf16) shifted by n."""
    out = {}
    for k, (name, shape, dt, tr) in enumerate(SPEC):
        n = 1
        for s in shape:
            n *= s
        v = (torch.arange(n, device=device, dtype=torch.int64) * (k + 3) + version) % 61
        t = v.reshape(shape)
        if dt == "bool":
            t = (t % 2) == 1
        else:
            t = t.to(getattr(torch, dt))
        if tr and not contiguous:  # same values, column-major layout
            t = t.t().contiguous().t()
        out[name] = t
    return out


def consume(conn, name, n, mode, kind):
    import torch

    torch.cuda.init()
    sc = gpuipc.connect(name, timeout=60)
    sub = gpuipc.TensorSet.subscribe(sc, device=torch.cuda.current_device())
    mine = None
    try:
        for _ in range(n):
            s = torch.cuda.current_stream()
            with sub.recv(stream=s, timeout=60) as v:
                want = expected(torch, v.number, contiguous=kind == "owned")
                if mode == "view":
                    got = {k: torch.from_dlpack(v[k]) for k in v}
                else:
                    if mine is None:  # the consumer's own weights
                        mine = {k: torch.empty_strided(w.shape, w.stride(), dtype=w.dtype,
                                                       device="cuda")
                                for k, w in want.items()}
                    v.copy_into(mine, stream=s)
                    got = mine
                bad = [k for k in want
                       if got[k].dtype != want[k].dtype or tuple(got[k].shape) !=
                       tuple(want[k].shape) or tuple(got[k].stride()) !=
                       tuple(want[k].stride()) or not torch.equal(got[k], want[k])]
                torch.cuda.current_stream().synchronize()
                conn.send_msg(json.dumps({"number": v.number, "copy": v.copy,
                                          "bad": bad}).encode())
        try:
            sub.recv(timeout=60)
            conn.send_msg(json.dumps({"end": "version"}).encode())
        except gpuipc.CanceledError:
            conn.send_msg(json.dumps({"end": "canceled"}).encode())
    except Exception as e:  # reported, so that the test says what failed
        conn.send_msg(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
    sub.close()
    conn.recv_msg(timeout=60)
    sc.close()
