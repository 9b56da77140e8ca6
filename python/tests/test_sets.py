"""Tensor sets (gpuipc.TensorSet): round trips of many dtypes and shapes,
owned and wrapped sets, 1,000+ entries, copy_into, versions in order,
double buffering (a held copy is never overwritten), a consumer killed
while it holds a version, one that never releases (the hold limit), and
input the library refuses."""
import gc
import hashlib
import json
import os
import time

import pytest

import gpuipc
import sets_peers
from cudrv import DeviceArray, drv, pattern

_n = 0


def lname():
    global _n
    _n += 1
    return f"pyt-set-{os.getpid()}-{_n}"


def report(conn):
    return json.loads(conn.recv_msg(timeout=60))


class Peer:
    """A consumer child and the connection its set travels on."""

    def __init__(self, fn, *args):
        self.name = lname()
        self.lst = gpuipc.listen(self.name, timeout=30)
        self.p = gpuipc.spawn(fn, self.name, *args, timeout=60)
        self.sc = self.lst.accept(timeout=30)

    def close(self):
        try:
            self.p.conn.send_msg(b"go")
        except gpuipc.Error:
            pass
        rc = self.p.join(30)
        self.p.close()
        self.lst.close()
        return rc


def fill(ts, copy, seed):
    """Writes a pattern into every tensor of copy `copy`; its digest."""
    h = hashlib.sha256()
    for i, (n, v) in enumerate(ts.tensors(copy).items()):
        data = pattern(v.nbytes, (seed * 31 + i) & 0xFF)
        drv().htod(v.ptr, data)
        h.update(data)
    return h.hexdigest()


SPEC = {
    "embed.weight": ((32, 16), "bfloat16"),
    "layers.0.attn.q": ((16, 16), "float16"),
    "layers.0.norm": ((16,), "float32"),
    "layers.0.ids": ((3, 5, 7), "int64"),
    "mask": ((5, 9), "bool"),
    "scale": ((), "float64"),
    "bytes": ((17,), "uint8"),
    "i8": ((2, 3), "int8"),
    "u16": ((9,), "uint16"),
    "i32": ((1, 1, 1, 1, 1, 1, 1, 4), "int32"),
    "c64": ((3,), "complex64"),
    "c128": ((2, 2), "complex128"),
    "ünïcode/名前": ((4,), "float32"),
}


def test_owned_round_trip_of_dtypes_and_shapes_in_order():
    ts = gpuipc.TensorSet.empty(SPEC, copies=2)
    assert ts.count == len(SPEC) and ts.copies == 2 and not ts.wrapped
    assert ts.names == list(SPEC) and "mask" in ts and ts.index("mask") == 4
    peer = Peer(sets_peers.consume, 3, "view")
    try:
        ts.subscribe(peer.sc)
        assert ts.subscribers == 1
        digests = []
        for k in range(3):
            c = ts.begin()
            assert c == k % 2  # double buffered: the copies alternate
            digests.append(fill(ts, c, k + 1))
            assert ts.publish() == k + 1
        for k in range(3):
            r = report(peer.p.conn)
            assert r["number"] == k + 1 and r["copy"] == k % 2 and r["layout"] == ts.layout
            assert r["names"] == list(SPEC)
            assert r["shapes"] == [list(s) for s, _ in SPEC.values()]
            assert r["dtypes"] == [d for _, d in SPEC.values()]
            assert r["digest"] == digests[k], f"version {k + 1}: bytes differ"
            assert r["dlpack_device"][0] == 2
        ts.unsubscribe(peer.sc, timeout=30)
        assert report(peer.p.conn)["end"] == "canceled"
        assert ts.subscribers == 0
    finally:
        assert peer.close() == 0
    ts.destroy()
    assert ts.destroyed


def test_wrapped_set_of_foreign_arrays_and_late_joiner():
    arrs = {"a": DeviceArray((64,), "<f4"), "b": DeviceArray((8, 8), "<i2"),
            "c": DeviceArray((3, 4), "<f8", strides=(8, 24))}  # column-major
    for i, a in enumerate(arrs.values()):
        drv().htod(a.ptr, pattern(a.nbytes, 40 + i))
    ts = gpuipc.TensorSet.from_dict(arrs)
    assert ts.wrapped and ts.copies == 1
    views = ts.tensors()
    assert views["a"].ptr == arrs["a"].ptr  # the producer's memory itself
    assert views["c"].strides == (1, 3)
    # published before anyone subscribed: a late joiner gets the latest
    ts.begin()
    assert ts.publish() == 1
    peer = Peer(sets_peers.consume, 1, "view")
    try:
        ts.subscribe(peer.sc)
        r = report(peer.p.conn)
        want = hashlib.sha256(b"".join(pattern(a.nbytes, 40 + i)
                                       for i, a in enumerate(arrs.values()))).hexdigest()
        assert r["number"] == 1 and r["digest"] == want
        assert r["strides"][2] == [1, 3] and r["cai"]["ptr_matches"]
        ts.unsubscribe(peer.sc, timeout=30)
        assert report(peer.p.conn)["end"] == "canceled"
    finally:
        assert peer.close() == 0
    ts.destroy()


def test_thousands_of_entries_copy_from_and_copy_into():
    n = 1200
    spec = {f"layer.{i}.w": (((i % 7) + 1, (i % 5) + 3), ["float32", "int16", "uint8"][i % 3])
            for i in range(n)}
    ts = gpuipc.TensorSet.empty(spec, copies=1, align=64)
    assert ts.count == n
    srcs, h = {}, hashlib.sha256()
    for i, (k, (shape, dt)) in enumerate(spec.items()):
        a = DeviceArray(shape, sets_peers.TYPESTR[dt])
        data = pattern(a.nbytes, i & 0xFF)
        drv().htod(a.ptr, data)
        h.update(data)
        srcs[k] = a
    peer = Peer(sets_peers.consume, 2, "copy_into")
    try:
        ts.subscribe(peer.sc)
        ts.update(srcs)  # begin, copy_from, publish
        r = report(peer.p.conn)
        assert r["number"] == 1 and len(r["names"]) == n
        assert r["digest"] == h.hexdigest(), "copy_from -> copy_into changed bytes"
        # the second version: only some tensors change (a mapping skips the rest)
        first = next(iter(spec))
        drv().htod(srcs[first].ptr, b"\xAB" * srcs[first].nbytes)
        ts.update({first: srcs[first]}, timeout=30)
        r = report(peer.p.conn)
        h2 = hashlib.sha256()
        for k, a in srcs.items():
            h2.update(drv().dtoh(a.ptr, a.nbytes))
        assert r["number"] == 2 and r["digest"] == h2.hexdigest()
        ts.unsubscribe(peer.sc, timeout=30)
        assert report(peer.p.conn)["end"] == "canceled"
    finally:
        assert peer.close() == 0
    ts.destroy()


def test_double_buffering_never_overwrites_a_held_copy():
    ts = gpuipc.TensorSet.empty({"x": ((1024,), "uint8"), "y": ((33,), "float32")}, copies=2)
    peer = Peer(sets_peers.hold_then_release)
    try:
        ts.subscribe(peer.sc)
        d1 = (ts.begin(), fill(ts, 0, 1))[1]
        ts.publish()
        r1 = report(peer.p.conn)
        assert r1["number"] == 1 and r1["digest"] == d1
        assert ts.begin() == 1  # the other copy: v1's is held
        d2 = fill(ts, 1, 2)
        ts.publish()
        assert report(peer.p.conn)["digest"] == d2
        # copy 0 holds v1, still held: begin waits, then times out
        t0 = time.monotonic()
        with pytest.raises(gpuipc.TimeoutError):
            ts.begin(timeout=0.3)
        assert time.monotonic() - t0 >= 0.25
        peer.p.conn.send_msg(b"reread")
        assert report(peer.p.conn)["digest"] == d1, "version 1 was torn"
        # a view of a released version refuses to export
        assert report(peer.p.conn) == {"valid": False, "after": "refused", "released": True}
        assert ts.begin(timeout=30) == 0  # released: copy 0 again
        d3 = fill(ts, 0, 3)
        ts.publish()
        r3 = report(peer.p.conn)
        assert r3["number"] == 3 and r3["digest"] == d3
    finally:
        rc = peer.close()
    ts.destroy(timeout=30)
    assert rc == 0


def test_consumer_killed_while_holding_gives_the_copy_back():
    ts = gpuipc.TensorSet.empty({"w": ((4096,), "float32")}, copies=1)
    peer = Peer(sets_peers.hold_forever)
    try:
        ts.subscribe(peer.sc)
        ts.begin()
        d = fill(ts, 0, 5)
        ts.publish()
        assert report(peer.p.conn)["digest"] == d
        with pytest.raises(gpuipc.TimeoutError):
            ts.begin(timeout=0.2)  # one copy, held
        peer.p.kill()
        peer.p.join(30)
        assert ts.begin(timeout=30) == 0  # the dead consumer's hold is gone
        assert ts.subscribers == 0
        ts.publish()
        ts.destroy(timeout=30)
    finally:
        peer.p.close()
        peer.lst.close()
    # the connection is the caller's again
    peer.sc.close()


def test_hold_limit_lets_the_producer_past_a_consumer_that_never_releases():
    ts = gpuipc.TensorSet.empty({"w": ((4096,), "float32")}, copies=1, hold=0.2)
    peer = Peer(sets_peers.hold_forever)
    try:
        ts.subscribe(peer.sc)
        ts.begin()
        d = fill(ts, 0, 5)
        ts.publish()
        assert report(peer.p.conn)["digest"] == d
        t0 = time.monotonic()
        assert ts.begin(timeout=30) == 0  # a fresh copy: the held one is set aside
        assert time.monotonic() - t0 < 10
        fill(ts, 0, 6)
        ts.publish()
        ts.unsubscribe(peer.sc, timeout=30)  # completes: it still holds version 1
        assert ts.subscribers == 0
        ts.destroy(timeout=30)
    finally:
        peer.p.kill()
        peer.p.join(30)
        peer.p.close()
        peer.lst.close()
    peer.sc.close()


def test_hold_arguments_are_checked():
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc.TensorSet.empty({"a": ((4,), "float32")}, retired_max=65)
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc.TensorSet.empty({"a": ((4,), "float32")}, retired_max=-1)
    with pytest.raises(ValueError):
        gpuipc.TensorSet.empty({"a": ((4,), "float32")}, hold=-1)
    ts = gpuipc.TensorSet.empty({"a": ((4,), "float32")}, hold=None, retired_max=0)
    ts.destroy()


def test_connection_stays_open_while_a_set_uses_it():
    ts = gpuipc.TensorSet.empty({"w": ((16,), "float32")})
    peer = Peer(sets_peers.consume, 0, "view")
    try:
        ts.subscribe(peer.sc)
        with pytest.raises(gpuipc.BusyError):
            peer.sc.close()
        with pytest.raises(gpuipc.ExistsError):
            ts.subscribe(peer.sc)
        ts.unsubscribe(peer.sc, timeout=30)
        assert report(peer.p.conn)["end"] == "canceled"
        with pytest.raises(gpuipc.NotFoundError):
            ts.unsubscribe(peer.sc)
    finally:
        assert peer.close() == 0
    ts.destroy()
    peer.sc.close()


DECODER = ("GPUIPC_E_PROTOCOL", "GPUIPC_E_TRUNCATED", "GPUIPC_E_BAD_MAGIC",
           "GPUIPC_E_BAD_VERSION", "GPUIPC_E_BAD_CHECKSUM", "GPUIPC_E_BAD_KIND",
           "GPUIPC_E_OUT_OF_RANGE")


@pytest.mark.parametrize("meta", [b"", b"\x00" * 40, b"GPTS" + b"\xff" * 60])
def test_a_producer_that_sends_no_set_is_refused(meta):
    arena = gpuipc.Arena(chunk_bytes=1 << 20)
    peer = Peer(sets_peers.expect_refusal)
    try:
        # a plain block, whatever its metadata, is not a tensor-set frame
        peer.sc.send(arena.alloc(256), meta=meta)
        r = report(peer.p.conn)
        assert r["error"] is not None and r["status"] in DECODER, r
    finally:
        assert peer.close() == 0
        gc.collect()
        gpuipc.collect()


@pytest.mark.parametrize("spec,why", [
    ({}, "at least one"),
    ({"x" * 256: ((1,), "float32")}, "name"),
    ({"": ((1,), "float32")}, "name"),
    ({"a\x00b": ((1,), "float32")}, "NUL"),
    ({"a": ((1,) * 9, "float32")}, ""),
    ({"a": ((-1,), "float32")}, ""),
])
def test_bad_tables_are_refused(spec, why):
    with pytest.raises((gpuipc.Error, ValueError, TypeError)) as e:
        gpuipc.TensorSet.empty(spec)
    assert why in str(e.value)


def test_bad_arguments_are_refused():
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc.TensorSet.empty({"a": ((4,), "float32")}, copies=3)
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc.TensorSet.empty({"a": ((4,), "float32")}, align=3)
    a, b = DeviceArray((8,), "<f4"), DeviceArray((8,), "<f4")
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc._gpuipc.TensorSetC([("a", a), ("b", (4,), "float32")])  # mixed
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc._gpuipc.TensorSetC([("a", a), ("a", b)])  # duplicate name
    with pytest.raises(gpuipc.InvalidArgError):
        gpuipc._gpuipc.TensorSetC([("a", a)], copies=2)  # wrapped, two copies
    ts = gpuipc.TensorSet.empty({"a": ((4,), "float32"), "b": ((2,), "int8")})
    with pytest.raises(gpuipc.InvalidArgError):
        ts.copy_from({"a": a})  # not begun
    ts.begin()
    with pytest.raises(gpuipc.InvalidArgError):
        ts.begin()  # inside a begin already
    with pytest.raises(ValueError, match=r"tensor 0 \('a'\) has shape \(4,\), the array "
                       r"given for it \(8,\)"):
        ts.copy_from({"a": a})  # 32 bytes into 16
    with pytest.raises(KeyError):
        ts.copy_from({"nope": a})
    with pytest.raises(ValueError, match="2 tensors"):
        ts.copy_from([a])
    ts.copy_from([DeviceArray((4,), "<f4"), None])
    ts.publish()
    ts.destroy()
    with pytest.raises(gpuipc.InvalidArgError):
        ts.begin()
    gc.collect()


def test_bench_sets_runs_on_the_emulator(capsys):
    from gpuipc import bench_sets

    assert bench_sets.main(["--emulator", "--iters", "2", "--json"]) == 0
    out = capsys.readouterr().out
    r = json.loads(out.strip().splitlines()[-1])
    assert r["tensors"] == 39, out
    assert set(r["ms"]) == {"C set copy_into", "copy_into", "copy_into (plan)", "zero-copy"}, out
    assert all(m > 0 for m in r["ms"].values()) and set(r["ratios"]) == {
        "copy_into / C set", "copy_into (plan) / C set"}, out
    kv = r["kv"]
    assert [(k["blocks"], k["block_bytes"]) for k in kv] == bench_sets.KV_QUICK, out
    assert all(k["ms"]["copy_into"] > 0 for k in kv), out
    assert "KV cache blocks as one set" in out
    assert len(bench_sets.model_shapes(False)) == 291
    assert bench_sets._nbytes(bench_sets.model_shapes(False)) == 13_476_831_232  # 13.48 GB


def test_recv_releases_the_gil_and_times_out():
    import threading

    # The child publishes only when told, by this test's other thread once
    # it ticked 100 times from just before the long recv: the short recv cannot
    # see a publish, and the long one waits however loaded the machine is
    # (a publish 0.5 s after the child's start could come before either).
    # A recv that held the GIL would stop the ticks, never tell, and time out.
    peer = Peer(sets_peers.produce, None)
    ticks, stop, waiting = [0], threading.Event(), threading.Event()

    def spin():
        waiting.wait(60)
        while not stop.is_set():
            ticks[0] += 1
            if ticks[0] == 100:
                peer.p.conn.send_msg(b"publish")
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    try:
        sub = gpuipc.TensorSet.subscribe(peer.sc)
        with pytest.raises(gpuipc.TimeoutError):
            sub.recv(timeout=0.05)  # nothing published yet
        t.start()
        waiting.set()
        with sub.recv(timeout=30) as v:  # waits for the child's publish
            n = ticks[0]
            assert v.number == 1 and drv().dtoh(v["x"].ptr, 64) == bytes(range(64))
        stop.set()
        t.join()
        assert n > 50, f"the waiting recv held the GIL ({n} ticks)"
        peer.p.conn.send_msg(b"unsubscribe")
        with pytest.raises(gpuipc.CanceledError):
            sub.recv(timeout=30)
        sub.close()
        assert sub.closed
    finally:
        stop.set()
        waiting.set()
        rc = peer.close()
    assert rc == 0
    peer.sc.close()


def test_views_outlive_the_subscriber_close():
    """Closing a subscriber releases its versions, except those whose views
    live (a DLPack capsule, a CUDA Array Interface consumer holding the
    TensorView): they stay held, and their memory mapped, until the last
    view dies, even when the connection is closed too."""
    from test_dlpack import consume

    peer = Peer(sets_peers.produce, 0)
    try:
        sub = gpuipc.TensorSet.subscribe(peer.sc)
        v = sub.recv(timeout=30)
        w = v["x"]
        f, delete = consume(w.__dlpack__(stream=-1), False)
        cai_view = v["x"]
        ptr = cai_view.__cuda_array_interface__["data"][0]
        del w, v
        gc.collect()
        sub.close()
        assert sub.closed
        assert cai_view.valid, "the close released a version whose views live"
        peer.sc.close()  # the connection too: the views keep what they need
        assert peer.sc.closed
        assert drv().dtoh(f["data"], 64) == bytes(range(64)), "the DLPack view's memory changed"
        delete()
        assert drv().dtoh(ptr, 64) == bytes(range(64)), "the CAI view's memory changed"
        assert cai_view.valid and cai_view.__cuda_array_interface__["data"][0] == ptr
        del cai_view  # the last view: the version's release, the subscriber's and
        gc.collect()  # the connection's close
        peer.p.conn.send_msg(b"unsubscribe")
    finally:
        rc = peer.close()
    assert rc == 0
