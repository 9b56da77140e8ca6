"""Tensor sets from Python at the C set's speed, and what a new user runs
into: arrays checked against the layout (dtype, shape, strides, not only
the byte count), copy plans, arrays resolved in chunks, a subscribed
connection that refuses the application's messages, timeout=None meaning
forever, a connection's context manager that lets go of the set's users
and never hides the exception that left its block."""
import json
import os
import threading

import pytest

import gpuipc
import sets_fast_peers
import sets_peers
from cudrv import DeviceArray, drv, pattern

_n = [0]


def lname():
    _n[0] += 1
    return f"pyt-setf-{os.getpid()}-{_n[0]}"


def report(conn):
    return json.loads(conn.recv_msg(timeout=60))


class Peer:
    def __init__(self, fn, *args, conn_timeout=30):
        self.name = lname()
        self.lst = gpuipc.listen(self.name, timeout=conn_timeout)
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


def filled(shape, typestr, seed, strides=None):
    a = DeviceArray(shape, typestr, strides=strides)
    drv().htod(a.ptr, pattern(a.nbytes, seed))
    return a


def test_copy_from_refuses_another_dtype_shape_or_strides_of_the_same_bytes():
    ts = gpuipc.TensorSet.empty({"w": ((4, 4), "float32"), "n": ((8,), "int8")})
    ts.begin()
    with pytest.raises(ValueError, match=r"tensor 0 \('w'\) is float32, the array given "
                       r"for it int32"):
        ts.copy_from({"w": DeviceArray((4, 4), "<i4")})
    with pytest.raises(ValueError, match=r"tensor 0 \('w'\) has shape \(4, 4\), the array "
                       r"given for it \(16,\)"):
        ts.copy_from({"w": DeviceArray((16,), "<f4")})
    with pytest.raises(ValueError, match=r"tensor 0 \('w'\) has strides \(4, 1\) \(in "
                       r"elements\), the array given for it \(1, 4\)"):
        ts.copy_from({"w": DeviceArray((4, 4), "<f4", strides=(4, 16))})  # column-major
    with pytest.raises(ValueError, match=r"tensor 1 \('n'\) is int8, the array given for it uint8"):
        ts.copy_from([None, DeviceArray((8,), "|u1")])
    with pytest.raises(ValueError, match=r"plan_from: tensor 0 \('w'\) is float32"):
        ts.plan_from({"w": DeviceArray((2, 8), "<i4")})
    # what was refused wrote nothing, and the right arrays still go in
    w = filled((4, 4), "<f4", 3)
    ts.copy_from({"w": w})
    ts.publish()
    drv().sync(0)
    assert drv().dtoh(ts.tensors(0)["w"].ptr, 64) == pattern(64, 3)
    ts.destroy()


def test_plans_copy_what_they_resolved_and_refuse_another_layout_or_side():
    spec = {"a": ((4,), "float32"), "b": ((2, 3), "int32"), "c": ((5,), "uint8")}
    ts = gpuipc.TensorSet.empty(spec, copies=2)
    srcs = {"a": filled((4,), "<f4", 1), "b": filled((2, 3), "<i4", 2)}  # c: skipped
    plan = ts.plan_from(srcs)
    assert isinstance(plan, gpuipc.CopyPlan)
    assert plan.kind == "copy_from" and plan.count == 3 and plan.layout == ts.layout
    for n in range(1, 4):
        drv().htod(srcs["a"].ptr, pattern(16, 10 + n))
        c = ts.begin()
        ts.copy_from(plan)
        assert ts.publish() == n
        drv().sync(0)
        got = ts.tensors(c)
        assert drv().dtoh(got["a"].ptr, 16) == pattern(16, 10 + n)
        assert drv().dtoh(got["b"].ptr, 24) == pattern(24, 2)
    other = gpuipc.TensorSet.empty({"a": ((4,), "float32")})
    other.begin()
    with pytest.raises(gpuipc.InvalidArgError, match="make a new plan"):
        other.copy_from(plan)
    with pytest.raises(ValueError, match="3 tensors"):
        ts.plan_from([srcs["a"]])
    other.publish()
    other.destroy()
    ts.destroy()


def test_many_arrays_read_through_the_protocols_are_copied_in_chunks():
    """40 arrays read through __cuda_array_interface__ go in chunks of 16
    (copied as they are resolved): every one lands, the skipped ones stay."""
    n = 40
    ts = gpuipc.TensorSet.empty({f"t{i}": ((3 + i,), "uint8") for i in range(n)})
    c = ts.begin()
    drv().htod(ts.tensors(c)["t17"].ptr, b"\xee" * 20)
    srcs = [None if i == 17 else filled((3 + i,), "|u1", i) for i in range(n)]
    ts.copy_from(srcs)
    ts.publish()
    drv().sync(0)
    views = ts.tensors(c)
    for i in range(n):
        want = b"\xee" * 20 if i == 17 else pattern(3 + i, i)
        assert drv().dtoh(views[f"t{i}"].ptr, 3 + i) == want, i
    ts.destroy()


def test_copy_into_checks_the_layout_and_plans_serve_later_versions():
    peer = Peer(sets_fast_peers.produce_when_told)
    try:
        sub = gpuipc.TensorSet.subscribe(peer.sc)
        peer.p.conn.send_msg(b"publish")
        with sub.recv(timeout=30) as v:
            with pytest.raises(ValueError, match=r"copy_into: tensor 0 \('x'\) is uint8, the "
                               r"array given for it int8"):
                v.copy_into({"x": DeviceArray((64,), "|i1")})
            with pytest.raises(ValueError, match=r"has shape \(64,\), the array given for it "
                               r"\(8, 8\)"):
                v.copy_into([DeviceArray((8, 8), "|u1")])
            dst = DeviceArray((64,), "|u1")
            plan = v.plan_into({"x": dst})
            assert plan.kind == "copy_into" and plan.arrays == [dst]
            v.copy_into(plan)
            drv().sync(0)
            assert drv().dtoh(dst.ptr, 64) == bytes(range(64))
        drv().htod(dst.ptr, b"\0" * 64)
        peer.p.conn.send_msg(b"publish")
        with sub.recv(timeout=30) as v2:  # a later version, the same plan
            assert v2.number == 2
            v2.copy_into(plan)
            drv().sync(0)
            assert drv().dtoh(dst.ptr, 64) == bytes(range(64))
            producer_plan = gpuipc.TensorSet.empty({"x": ((64,), "uint8")})
            with pytest.raises(gpuipc.InvalidArgError, match="copy_from"):
                v2.copy_into(producer_plan.plan_from({"x": dst}))
            producer_plan.destroy()
        peer.p.conn.send_msg(b"unsubscribe")
        with pytest.raises(gpuipc.CanceledError):
            sub.recv(timeout=30)
        assert report(peer.p.conn) == {"unsubscribed": True}
        sub.close()
    finally:
        assert peer.close() == 0
    peer.sc.close()


def test_a_subscribed_connection_refuses_the_applications_messages():
    ts = gpuipc.TensorSet.empty({"x": ((64,), "uint8")})
    peer = Peer(sets_fast_peers.refuse_messages)
    try:
        ts.subscribe(peer.sc)
        for call in (lambda: peer.sc.send_msg(b"x"), lambda: peer.sc.recv_msg(timeout=0)):
            with pytest.raises(gpuipc.BusyError, match="tensor set"):
                call()
        ts.begin()
        drv().htod(ts.tensors()["x"].ptr, bytes(range(64)))
        ts.publish()
        r = report(peer.p.conn)
        assert r["recv_msg"][0] == "BusyError" and "tensor set" in r["recv_msg"][1], r
        assert r["send_msg"][0] == "BusyError", r
        assert r["data"] == list(range(64)), "the refused calls broke the set"
        ts.unsubscribe(peer.sc, timeout=30)
        peer.sc.send_msg(b"free again")  # once unsubscribed, messages are the application's
    finally:
        assert peer.close() == 0
    ts.destroy()
    peer.sc.close()


def test_recv_with_timeout_none_waits_past_the_connections_timeout():
    peer = Peer(sets_fast_peers.produce_when_told, conn_timeout=0.05)
    try:
        sub = gpuipc.TensorSet.subscribe(peer.sc)
        got = {}

        def recv():
            try:
                got["v"] = sub.recv(timeout=None)
            except BaseException as e:  # noqa: BLE001 - reported below
                got["e"] = e

        t = threading.Thread(target=recv)
        t.start()
        t.join(0.5)  # the connection's own timeout (50 ms) has long passed
        assert t.is_alive(), f"recv(timeout=None) returned: {got}"
        peer.p.conn.send_msg(b"publish")
        t.join(60)
        assert "e" not in got, got
        assert got["v"].number == 1
        got["v"].release()
        peer.p.conn.send_msg(b"unsubscribe")
        with pytest.raises(gpuipc.CanceledError):
            sub.recv(timeout=30)
        report(peer.p.conn)
        sub.close()
    finally:
        assert peer.close() == 0
    peer.sc.close()


def test_begin_with_timeout_none_waits_past_the_sets_timeout():
    ts = gpuipc.TensorSet.empty({"x": ((64,), "uint8")}, timeout=0.05, hold=None)
    peer = Peer(sets_fast_peers.hold_until_told)
    try:
        ts.subscribe(peer.sc)
        ts.update()
        assert report(peer.p.conn) == {"number": 1}  # held: one copy
        with pytest.raises(gpuipc.TimeoutError):
            ts.begin()  # the set's own timeout: 50 ms
        got = {}

        def begin():
            try:
                got["copy"] = ts.begin(timeout=None)
            except BaseException as e:  # noqa: BLE001 - reported below
                got["e"] = e

        t = threading.Thread(target=begin)
        t.start()
        t.join(0.5)
        assert t.is_alive(), f"begin(timeout=None) returned: {got}"
        peer.p.conn.send_msg(b"release")
        t.join(60)
        assert got == {"copy": 0}, got
        ts.publish()
        ts.unsubscribe(peer.sc, timeout=30)
        assert report(peer.p.conn) == {"later": [2]}
    finally:
        assert peer.close() == 0
    ts.destroy()
    peer.sc.close()


def test_the_connections_context_manager_closes_a_subscriber_and_keeps_the_exception():
    class Boom(Exception):
        pass

    peer = Peer(sets_fast_peers.produce_when_told)
    try:
        with pytest.raises(Boom):
            with peer.sc as c:
                sub = gpuipc.TensorSet.subscribe(c)
                peer.p.conn.send_msg(b"publish")
                v = sub.recv(timeout=30)
                assert v.number == 1
                raise Boom("the application's own error")
        assert sub.closed and v.released and peer.sc.closed
    finally:
        assert peer.close() == 0


def test_the_connections_context_manager_lets_go_of_a_subscriber_without_error():
    peer = Peer(sets_fast_peers.produce_when_told)
    try:
        with peer.sc as c:
            sub = gpuipc.TensorSet.subscribe(c)
            peer.p.conn.send_msg(b"publish")
            v = sub.recv(timeout=30)  # held at the exit
        assert sub.closed and v.released and peer.sc.closed
    finally:
        assert peer.close() == 0


def test_the_connections_context_manager_ends_a_sets_subscription():
    ts = gpuipc.TensorSet.empty({"w": ((16,), "float32")})
    peer = Peer(sets_peers.consume, 0, "view")
    try:
        with peer.sc as c:
            ts.subscribe(c)
            assert ts.subscribers == 1
        assert peer.sc.closed and ts.subscribers == 0
        assert report(peer.p.conn)["end"] == "canceled"
    finally:
        assert peer.close() == 0
    ts.destroy()


def test_as_torch_says_why_without_torch():
    try:
        import torch  # noqa: F401
        pytest.skip("torch is importable here: test_gpu_sets_fast.py covers as_torch")
    except ImportError:
        pass
    peer = Peer(sets_fast_peers.produce_when_told)
    try:
        sub = gpuipc.TensorSet.subscribe(peer.sc)
        peer.p.conn.send_msg(b"publish")
        with sub.recv(timeout=30) as v:
            with pytest.raises(ImportError, match="torch"):
                v.as_torch()
        peer.p.conn.send_msg(b"unsubscribe")
        with pytest.raises(gpuipc.CanceledError):
            sub.recv(timeout=30)
        report(peer.p.conn)
        sub.close()
    finally:
        assert peer.close() == 0
    peer.sc.close()


def test_torch_tensors_without_the_exchange_api_are_read_through_their_attributes():
    """A torch without DLPack's C exchange API (a stand-in module in a
    child: tensors with torch's attributes and no array protocol): each
    tensor read once, torch's current stream asked once per call (not per
    tensor), layouts checked, and a plan reads nothing again."""
    with gpuipc.spawn(sets_fast_peers.fake_torch_copy, timeout=60) as p:
        r = report(p.conn)
        assert p.join(30) == 0
    assert r["calls"] == {"data_ptr": 20, "raw_stream": 1}, r
    assert r["plan_calls"] == {"data_ptr": 0, "raw_stream": 1}, r
    assert "tensor 3 ('t3') is float32, the array given for it int32" in r["dtype"], r
    assert "strides" in r["strides"], r
    assert r["data_ok"], r


def test_a_plan_keeps_its_own_list_and_its_cycles_are_collected():
    import gc
    import weakref

    ts = gpuipc.TensorSet.empty({"a": ((4,), "float32")})
    a = DeviceArray((4,), "<f4")
    arrays = [a]
    plan = ts._c.plan(arrays)
    arrays[0] = None  # the caller's list changes: the plan's does not
    assert plan.arrays == [a] and plan.arrays is not arrays
    a.plan = plan  # a cycle: the array refers to its plan
    w = weakref.ref(a)
    del a, plan, arrays
    gc.collect()
    assert w() is None, "the plan and its array were not collected"
    ts.destroy()
