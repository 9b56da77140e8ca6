"""Peers of test_sets_fast.py, run in child processes (gpuipc.spawn): each
gets the spawn connection (reports as JSON messages, and the parent's
word) and the name of a listener whose connection carries the set."""
import json

import gpuipc
from cudrv import drv


def _report(conn, **kw):
    conn.send_msg(json.dumps(kw).encode())


def produce_when_told(conn, name):
    """An owned set of one tensor (x: 64 uint8, bytes 0..63): subscribes,
    publishes version 1 when the parent says 'publish', ends the
    subscription when it says 'unsubscribe'."""
    sc = gpuipc.connect(name, timeout=30)
    ts = gpuipc.TensorSet.empty({"x": ((64,), "uint8")})
    ts.subscribe(sc)
    while True:
        cmd = conn.recv_msg(timeout=60)
        if cmd == b"publish":
            ts.begin(timeout=30)
            drv().htod(ts.tensors()["x"].ptr, bytes(range(64)))
            ts.publish()
        elif cmd == b"unsubscribe":
            ts.unsubscribe(sc, timeout=30)
            _report(conn, unsubscribed=True)
        else:
            break
    ts.destroy(timeout=30)
    sc.close()


def hold_until_told(conn, name):
    """Receives version 1, says so, holds it until the parent says
    'release', then reads versions until the subscription ends."""
    sc = gpuipc.connect(name, timeout=30)
    sub = gpuipc.TensorSet.subscribe(sc)
    v = sub.recv(timeout=30)
    _report(conn, number=v.number)
    conn.recv_msg(timeout=60)
    v.release()
    n = []
    try:
        while True:
            with sub.recv(timeout=30) as v:
                n.append(v.number)
    except gpuipc.CanceledError:
        pass
    _report(conn, later=n)
    sub.close()
    conn.recv_msg(timeout=60)
    sc.close()


def refuse_messages(conn, name):
    """A subscriber whose application tries the connection's own messages:
    reports what recv_msg and send_msg raised, then that the set still
    works (version 1 read in place)."""
    sc = gpuipc.connect(name, timeout=30)
    sub = gpuipc.TensorSet.subscribe(sc)
    out = {}
    for what, call in (("recv_msg", lambda: sc.recv_msg(timeout=0)),
                       ("send_msg", lambda: sc.send_msg(b"hello"))):
        try:
            call()
            out[what] = None
        except gpuipc.Error as e:
            out[what] = [type(e).__name__, str(e)]
    with sub.recv(timeout=30) as v:
        out["data"] = list(drv().dtoh(v["x"].ptr, 64))
    _report(conn, **out)
    try:
        sub.recv(timeout=30)
    except gpuipc.CanceledError:
        pass
    sub.close()
    conn.recv_msg(timeout=60)
    sc.close()


def torch_consume(conn, name, versions):
    """A torch consumer (test_gpu_sets_fast.py): each version through
    as_torch (checked against the values, and the same tensor objects for
    a copy seen before), copy_into with a dict and with a plan (checked),
    a refused wrong dtype; reports one dict per version."""
    import torch

    import gpu_sets_peers

    torch.cuda.set_device(0)
    sc = gpuipc.connect(name, timeout=60)
    sub = gpuipc.TensorSet.subscribe(sc)
    seen, plan, mine = {}, None, None
    for _ in range(versions):
        with sub.recv(timeout=60, stream=torch.cuda.current_stream()) as v:
            want = gpu_sets_peers.expected(torch, v.number, contiguous=True)
            views = v.as_torch()
            r = {"number": v.number, "copy": v.copy}
            r["views_ok"] = all(torch.equal(views[k], want[k]) for k in want)
            ids = [id(views[k]) for k in want]
            r["same_objects"] = seen.get(v.copy) == ids if v.copy in seen else None
            seen[v.copy] = ids
            if mine is None:
                mine = {k: torch.empty_like(t) for k, t in want.items()}
                plan = v.plan_into(mine)
            for k in mine:
                mine[k].zero_()
            v.copy_into(mine)
            r["copy_into_ok"] = all(torch.equal(mine[k], want[k]) for k in want)
            for k in mine:
                mine[k].zero_()
            v.copy_into(plan)
            r["plan_ok"] = all(torch.equal(mine[k], want[k]) for k in want)
            bad = dict(mine)
            bad["embed.weight"] = torch.empty_like(mine["embed.weight"], dtype=torch.float16)
            try:
                v.copy_into(bad)
                r["refused"] = None
            except ValueError as e:
                r["refused"] = str(e)
            torch.cuda.synchronize()
            del views
        _report(conn, **r)
    try:
        sub.recv(timeout=60)
    except gpuipc.CanceledError:
        pass
    sub.close()
    conn.recv_msg(timeout=60)
    sc.close()


def fake_torch():
    """A stand-in 'torch' module (this process only): a Tensor type over
    device memory with torch's attributes (data_ptr, dtype, shape, stride,
    is_cuda, get_device) and no array protocol at all, torch._C's raw
    stream call, counting the calls gpuipc makes."""
    import sys
    import types

    from cudrv import DeviceArray

    t = types.ModuleType("torch")
    calls = {"data_ptr": 0, "raw_stream": 0}

    class dtype:
        def __init__(self, name, typestr):
            self.name, self.typestr = name, typestr

    for name, ts in (("float32", "<f4"), ("int32", "<i4"), ("uint8", "|u1"),
                     ("bfloat16", "<V2")):
        setattr(t, name, dtype(name, ts))

    class Tensor:
        is_cuda = True

        def __init__(self, shape, dt, strides=None):
            self.arr = DeviceArray(shape, dt.typestr if dt.typestr[1] != "V" else "<u2")
            self.dtype, self.shape = dt, tuple(shape)
            s, acc = [], 1
            for d in reversed(self.shape):
                s.insert(0, acc)
                acc *= d
            self._strides = tuple(strides) if strides else tuple(s)

        def get_device(self):
            return 0

        def data_ptr(self):
            calls["data_ptr"] += 1
            return self.arr.ptr

        def stride(self):
            return self._strides

    def raw_stream(dev):
        calls["raw_stream"] += 1
        return 0

    t.Tensor = Tensor
    c = types.ModuleType("torch._C")
    c._from_dlpack = lambda cap: None
    c._cuda_getCurrentRawStream = raw_stream
    t._C = c
    sys.modules["torch"] = t
    return t, calls


def fake_torch_copy(conn):
    """copy_from of 20 stand-in torch tensors (no exchange API, no array
    protocol): read through their attributes, torch's stream asked once per
    call, layouts checked; reports what it saw."""
    from cudrv import pattern

    torch, calls = fake_torch()
    n = 20
    ts = gpuipc.TensorSet.empty({f"t{i}": ((4, 2 + i), "float32") for i in range(n)})
    srcs = {f"t{i}": torch.Tensor((4, 2 + i), torch.float32) for i in range(n)}
    for i, x in enumerate(srcs.values()):
        drv().htod(x.arr.ptr, pattern(x.arr.nbytes, i))
    out = {}
    ts.begin()
    ts.copy_from(srcs)
    out["calls"] = dict(calls)
    try:
        ts.copy_from({"t3": torch.Tensor((4, 5), torch.int32)})
        out["dtype"] = None
    except ValueError as e:
        out["dtype"] = str(e)
    try:
        ts.copy_from({"t3": torch.Tensor((4, 5), torch.float32, strides=(1, 4))})
        out["strides"] = None
    except ValueError as e:
        out["strides"] = str(e)
    plan = ts.plan_from(srcs)
    before = dict(calls)
    ts.copy_from(plan)
    out["plan_calls"] = {k: calls[k] - before[k] for k in calls}
    ts.publish()
    drv().sync(0)
    views = ts.tensors(0)
    out["data_ok"] = all(drv().dtoh(views[f"t{i}"].ptr, 16 * (2 + i)) ==
                         pattern(16 * (2 + i), i) for i in range(n))
    ts.destroy()
    _report(conn, **out)
