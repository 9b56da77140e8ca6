"""gpuipc.torch's parts without torch (on the emulator too): the hold table
(gpuipc.HoldLog) as its producer reads it, hostile tables refused; exports
per allocation (Buffer.share_view); the import cache's linger seen from
Python; a consumer killed while holding descriptor-route tensors gives them
back."""
import mmap
import os
import struct
import time

import pytest

import gpuipc
import gpuipc.torch as gt
from cudrv import DeviceArray, drv, pattern

HOLD, RELEASE = 1, 2
HDR = 192  # header bytes; head at 64, tail at 128
EVENT_SLOT = 256
EVENTS = 16


def tok(i):
    return i.to_bytes(8, "little") + b"\xab" * 8


def entry_offset(i, n):
    return HDR + EVENTS * EVENT_SLOT + (i % n) * 32


def writable_map(log):
    return mmap.mmap(log.fd, 0)


def test_attach_and_release_are_read_by_the_producer():
    arr = DeviceArray((256,), "|u1")
    buf = gpuipc.Buffer.wrap(arr)
    log = gpuipc.HoldLog(8)
    peer = gpuipc.HoldLog.open(log.fd)
    assert peer.drain() == []
    assert log.attach(buf, tok(1), 0, 0) == 1
    with pytest.raises(ValueError):
        log.attach(buf, tok(2), 0, 0)  # one hold per buffer
    assert peer.drain() == [(HOLD, tok(1), -1)]
    assert log.pending == 0  # the producer's tail moved
    del buf  # the Buffer goes: RELEASE, after an event on stream 0
    got = peer.drain()
    assert len(got) == 1 and got[0][:2] == (RELEASE, tok(1)) and got[0][2] == 0
    info = gpuipc.desc_info(peer.event_desc(0))  # this process's event (opened by peers)
    assert info["exporter_pid"] == os.getpid()
    assert peer.drain() == []
    assert log.counts["holds"] == 1 and log.counts["releases"] == 1


def test_a_full_ring_overflows_privately_and_catches_up():
    arrs = [DeviceArray((64,), "|u1") for _ in range(5)]
    bufs = [gpuipc.Buffer.wrap(a) for a in arrs]
    log = gpuipc.HoldLog(2)
    peer = gpuipc.HoldLog.open(log.fd)
    for i in range(5):
        log.attach(bufs[i], tok(i), 0, 0)
    assert log.pending == 5 and log.counts["overflow"] == 3
    assert [e[1] for e in peer.drain()] == [tok(0), tok(1)]
    del bufs[0]  # its RELEASE writes out what waited first, in order
    assert [e[1] for e in peer.drain()] == [tok(2), tok(3)]
    bufs.clear()
    got = []
    want = {tok(i) for i in range(5)}
    for _ in range(20):
        got += peer.drain()
        if want <= {t for op, t, _ in got if op == RELEASE}:
            break
        # a later entry writes out what waited (its own buffer goes at once)
        log.attach(gpuipc.Buffer.wrap(arrs[0]), tok(99), 0, 0)
    ops = [(op, t) for op, t, _ in got]
    assert ops[:2] == [(HOLD, tok(4)), (RELEASE, tok(0))]
    assert want <= {t for op, t in ops if op == RELEASE}
    assert log.counts["lost"] == 0


def test_hostile_entries_are_refused_and_the_table_is_read_no_more():
    for bad in ("op", "slot", "hold_with_event", "head_ahead", "head_behind"):
        log = gpuipc.HoldLog(4)
        peer = gpuipc.HoldLog.open(log.fd)
        m = writable_map(log)
        if bad == "head_behind":
            buf = gpuipc.Buffer.wrap(DeviceArray((64,), "|u1"))
            log.attach(buf, tok(1), 0, 0)
            assert len(peer.drain()) == 1
            struct.pack_into("<Q", m, 64, 0)  # head behind what was read
        elif bad == "head_ahead":
            struct.pack_into("<Q", m, 64, 5)  # more than a ring ahead
        else:
            op, slot = {"op": (7, 0xFFFFFFFF), "slot": (RELEASE, EVENTS),
                        "hold_with_event": (HOLD, 0)}[bad]
            struct.pack_into("<16sII", m, entry_offset(0, 4), tok(1), op, slot)
            struct.pack_into("<Q", m, 64, 1)
        with pytest.raises(gpuipc.ProtocolError):
            peer.drain()
        with pytest.raises(gpuipc.ProtocolError):
            peer.drain()  # broken for good
        m.close()


def test_event_slots_are_checked():
    log = gpuipc.HoldLog(4)
    peer = gpuipc.HoldLog.open(log.fd)
    with pytest.raises(gpuipc.ProtocolError):
        peer.event_desc(0)  # empty
    with pytest.raises(gpuipc.ProtocolError):
        peer.event_desc(EVENTS)  # out of range
    m = writable_map(log)
    struct.pack_into("<I", m, HDR, EVENT_SLOT)  # longer than its slot
    with pytest.raises(gpuipc.ProtocolError):
        peer.event_desc(0)
    struct.pack_into("<I", m, HDR, 8)
    m[HDR + 4:HDR + 12] = b"garbage!"
    with pytest.raises(gpuipc.Error):
        gpuipc.Event.open(peer.event_desc(0))  # validated as any descriptor
    m.close()


def test_open_refuses_what_is_not_a_hold_table():
    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 16)
        with pytest.raises(gpuipc.BadKindError):
            gpuipc.HoldLog.open(fd)  # not sealed: its owner could shrink it
        import fcntl
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(gpuipc.ProtocolError):
            gpuipc.HoldLog.open(fd)  # no magic
    finally:
        os.close(fd)
    log = gpuipc.HoldLog(4)
    m = writable_map(log)
    struct.pack_into("<I", m, 12, 1 << 20)  # more entries than the file holds
    with pytest.raises(gpuipc.ProtocolError):
        gpuipc.HoldLog.open(log.fd)
    m.close()
    with pytest.raises(ValueError):
        gpuipc.HoldLog(3)  # not a power of two


def test_share_view_exports_inside_the_wrapped_allocation():
    arr = DeviceArray((1 << 16,), "|u1")
    drv().htod(arr.ptr, pattern(1 << 16, 9))
    whole = gpuipc.Buffer.wrap(arr.ptr, 1 << 16)

    class View:  # 1 KiB at +4 KiB, as int32
        __cuda_array_interface__ = {"shape": (256,), "typestr": "<i4",
                                    "data": (arr.ptr + 4096, False), "version": 3}

    desc = whole.share_view(View())
    info = gpuipc.desc_info(desc)
    assert info["offset"] == 4096 and info["bytes"] == 1024
    assert info["alloc_bytes"] >= 1 << 16
    assert gpuipc.share(View()).desc[:6 + desc[5]] == desc[:6 + desc[5]]  # the same meta
    # The same array named by its numbers (what gpuipc.torch passes): the same bytes
    assert whole.share_view((arr.ptr + 4096, (256,), (1,), "int32")) == desc
    strided = whole.share_view((arr.ptr, (4, 8), (1, 4), "bfloat16"))
    assert gpuipc.desc_info(strided)["bytes"] == 2 * (3 * 1 + 7 * 4 + 1)
    with pytest.raises(ValueError):
        whole.share_view((arr.ptr, (4, 8), (1,), "int32"))  # strides do not match
    with pytest.raises(ValueError):
        whole.share_view((arr.ptr, (4,), (-1,), "int32"))

    class Outside:
        __cuda_array_interface__ = {"shape": (64,), "typestr": "|u1",
                                    "data": (arr.ptr + info["alloc_bytes"] - 32, False),
                                    "version": 3}

    with pytest.raises(gpuipc.OutOfRangeError):
        whole.share_view(Outside())
    # The allocation freed (and maybe another at its address): never described
    ptr = arr.ptr
    drv().free(ptr)
    arr.ptr = drv().alloc(1 << 16)  # freed again by DeviceArray.__del__
    with pytest.raises(gpuipc.Error) as e:
        whole.share_view(View())
    if arr.ptr == ptr:
        assert isinstance(e.value, gpuipc.StaleError)


def test_the_export_cache_keeps_no_array_alive():
    import weakref

    srv = gt._get_server()
    arr = DeviceArray((4096,), "|u1")
    key = (0, arr.ptr, arr.nbytes)
    d1 = srv._export(arr, key)
    n = gpuipc._gpuipc.counters()["buffers"]
    d2 = srv._export(arr, key)  # served by the cached wrap: no new Buffer
    assert gpuipc._gpuipc.counters()["buffers"] == n
    assert d1 == d2 and key in srv.exports
    gone = weakref.ref(arr)
    del arr
    assert gone() is None


def read_view(conn, desc):
    b = gpuipc.open(desc)
    conn.send_msg(drv().dtoh(b.ptr, 1024))
    conn.recv_msg(timeout=30)


def test_a_shared_view_opens_in_another_process():
    arr = DeviceArray((1 << 16,), "|u1")
    drv().htod(arr.ptr, pattern(1 << 16, 9))
    whole = gpuipc.Buffer.wrap(arr.ptr, 1 << 16)

    class View:
        __cuda_array_interface__ = {"shape": (1024,), "typestr": "|u1",
                                    "data": (arr.ptr + 8192, False), "version": 3}

    with gpuipc.spawn(read_view, whole.share_view(View())) as p:
        assert p.conn.recv_msg(timeout=30) == pattern(1 << 16, 9)[8192:8192 + 1024]
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def reopen_and_count(conn, desc):
    def cs():
        return gpuipc.cache_stats()
    a = cs()
    for _ in range(5):
        b = gpuipc.open(desc)
        del b
    z = cs()
    conn.send_msg(repr({k: z[k] - a[k] for k in ("hits", "misses", "driver_closes")}).encode())
    gpuipc.cache_trim()
    conn.send_msg(repr(cs()["idle_mappings"]).encode())
    conn.recv_msg(timeout=30)


@pytest.mark.parametrize("linger", ["100", "0"])
def test_reopening_after_the_last_close_hits_the_lingering_mapping(linger):
    arr = DeviceArray((4096,), "|u1")
    shared = gpuipc.share(arr)
    old = os.environ.get("GPUIPC_IMPORT_LINGER_MS")
    os.environ["GPUIPC_IMPORT_LINGER_MS"] = linger
    try:
        p = gpuipc.spawn(reopen_and_count, shared.desc)
    finally:
        if old is None:
            del os.environ["GPUIPC_IMPORT_LINGER_MS"]
        else:
            os.environ["GPUIPC_IMPORT_LINGER_MS"] = old
    with p:
        d = eval(p.conn.recv_msg(timeout=30))
        if linger == "0":
            assert d == {"hits": 0, "misses": 5, "driver_closes": 5}
        else:
            # one open; later ones hit the idle mapping (a slow machine may
            # let it expire in between: then another open, never a stale one)
            assert d["misses"] >= 1 and d["hits"] + d["misses"] == 5
            assert d["driver_closes"] <= d["misses"] - 1 or d["misses"] == 5
        assert p.conn.recv_msg(timeout=30) == b"0"
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def hold_shared(conn, name, token, pid, desc, ev_desc):
    buf = gt._open_shared(name, token, pid, desc, ev_desc, lambda dev: 0)
    conn.send_msg(b"holding")
    time.sleep(600)
    del buf


def wait_for(cond, limit=15.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_sigkilled_consumer_of_many_tensors_gives_them_back():
    import weakref

    srv = gt._get_server()
    arrs = [DeviceArray((1024,), "|u1") for _ in range(3)]
    gone = [weakref.ref(a) for a in arrs]
    offers = [srv.offer_shared(a, 0, 0) for a in arrs]
    del arrs
    procs = []
    for token, desc, ev_desc in offers:
        procs.append(gpuipc.spawn(hold_shared, srv.name, token, srv.pid, desc, ev_desc))
    try:
        for p in procs:
            assert p.conn.recv_msg(timeout=30) == b"holding"
        assert wait_for(lambda: gt.stats()["held"] >= 3), gt.stats()
        assert all(g() is not None for g in gone)
        for p in procs:
            p.kill()  # SIGKILL
            p.join(30)
        assert wait_for(lambda: all(g() is None for g in gone)), "memory kept"
        assert wait_for(lambda: gt.stats() == {"pending": 0, "held": 0}), gt.stats()
    finally:
        for p in procs:
            p.close()
