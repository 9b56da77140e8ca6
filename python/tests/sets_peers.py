"""Consumers of tensor sets, run in child processes (gpuipc.spawn) by
test_sets.py. Each gets the spawn connection (for its reports, as JSON
messages) and the name of a listener to connect to: the set travels on that
second connection, which carries nothing else while subscribed."""
import hashlib
import json
import time

import gpuipc
from cudrv import DeviceArray, drv

TYPESTR = {"bool": "|b1", "uint8": "|u1", "int8": "|i1", "uint16": "<u2", "int16": "<i2",
           "uint32": "<u4", "int32": "<i4", "uint64": "<u8", "int64": "<i8",
           "float16": "<f2", "float32": "<f4", "float64": "<f8", "complex64": "<c8",
           "complex128": "<c16"}


def _report(conn, **kw):
    conn.send_msg(json.dumps(kw).encode())


def _digest(chunks):
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def describe(v, data=True):
    """What a version says: numbers, names, shapes, dtypes, strides and a
    digest of every tensor's bytes read in place (zero copy)."""
    names = list(v)
    views = [v[n] for n in names]
    d = {"number": v.number, "copy": v.copy, "layout": v.layout, "names": names,
         "shapes": [list(t.shape) for t in views], "dtypes": [t.dtype for t in views],
         "strides": [list(t.strides) for t in views],
         "nbytes": [t.nbytes for t in views]}
    if data:
        d["digest"] = _digest(drv().dtoh(t.ptr, t.nbytes) for t in views)
    cai = views[0].__cuda_array_interface__ if views[0].dtype in TYPESTR else None
    if cai is not None:
        d["cai"] = {"shape": list(cai["shape"]), "typestr": cai["typestr"],
                    "ptr_matches": cai["data"][0] == views[0].ptr, "version": cai["version"]}
    d["dlpack_device"] = list(views[0].__dlpack_device__())
    return d


def consume(conn, name, n, mode="view"):
    """Receives n versions, reports each (mode 'view': read in place;
    'copy_into': copied into its own arrays first), releases each; then
    reports the end the producer's unsubscribe gives (CanceledError)."""
    sc = gpuipc.connect(name, timeout=30)
    sub = gpuipc.TensorSet.subscribe(sc)
    dst = None
    for _ in range(n):
        with sub.recv(timeout=30) as v:
            if mode == "view":
                _report(conn, **describe(v))
            else:
                if dst is None:
                    dst = {k: DeviceArray(v[k].shape, TYPESTR.get(v[k].dtype, "<u2"))
                           for k in v}
                v.copy_into(dst)
                drv().sync(0)
                d = describe(v, data=False)
                d["digest"] = _digest(drv().dtoh(dst[k].ptr, dst[k].nbytes) for k in v)
                _report(conn, **d)
    try:
        sub.recv(timeout=30)
        _report(conn, end="version")
    except gpuipc.CanceledError:
        _report(conn, end="canceled")
    except gpuipc.Error as e:
        _report(conn, end=type(e).__name__)
    sub.close()
    conn.recv_msg(timeout=30)  # the parent says when to go
    sc.close()


def hold_then_release(conn, name):
    """Receives version 1 and holds it; says so; reads it again when told
    (after the producer wrote version 2 into the other copy), then
    releases it and receives the next one."""
    sc = gpuipc.connect(name, timeout=30)
    sub = gpuipc.TensorSet.subscribe(sc)
    v1 = sub.recv(timeout=30)
    _report(conn, **describe(v1))
    v2 = sub.recv(timeout=30)
    _report(conn, **describe(v2))
    conn.recv_msg(timeout=30)   # "reread": the producer is blocked on v1's copy
    _report(conn, **describe(v1))
    view = v1["x"]
    v1.release()
    try:
        view.__cuda_array_interface__
        after = "exported"
    except gpuipc.InvalidArgError:
        after = "refused"
    v2.release()
    _report(conn, valid=view.valid, after=after, released=v1.released)
    with sub.recv(timeout=30) as v3:
        _report(conn, **describe(v3))
    conn.recv_msg(timeout=30)
    sub.close()
    sc.close()


def hold_forever(conn, name):
    """Receives a version, reads it, says so, and waits to be killed."""
    sc = gpuipc.connect(name, timeout=30)
    sub = gpuipc.TensorSet.subscribe(sc)
    v = sub.recv(timeout=30)
    _report(conn, **describe(v))
    time.sleep(600)


def expect_refusal(conn, name):
    """Subscribes on a connection whose peer sends no tensor set; reports
    the error recv raises, and that the subscriber still closes cleanly."""
    sc = gpuipc.connect(name, timeout=30)
    sub = gpuipc.TensorSet.subscribe(sc)
    try:
        sub.recv(timeout=10)
        _report(conn, error=None)
    except gpuipc.Error as e:
        _report(conn, error=type(e).__name__, status=e.status_name, msg=str(e))
    sub.close()
    conn.recv_msg(timeout=30)
    sc.close()


def produce(conn, name, delay):
    """A producer in the child: subscribes its connection to an owned set,
    publishes one version after `delay` seconds (None: when the parent
    says so), and ends the subscription when the parent says so."""
    sc = gpuipc.connect(name, timeout=30)
    ts = gpuipc.TensorSet.empty({"x": ((64,), "uint8")})
    ts.subscribe(sc)
    if delay is None:
        conn.recv_msg(timeout=60)
    else:
        time.sleep(delay)
    drv().htod(ts.tensors(0)["x"].ptr, bytes(range(64)))
    ts.update()
    conn.recv_msg(timeout=30)
    ts.unsubscribe(sc, timeout=30)
    ts.destroy()
    sc.close()
