"""Descriptors without a connection: pools, share/open, raw descriptors,
and hostile bytes."""
import json
import os

import pytest

import gpuipc
import peers
from cudrv import DeviceArray, drv, pattern


def report(conn):
    return json.loads(conn.recv_msg(timeout=30))


@pytest.mark.parametrize("kind", ["mempool", "vmm", "legacy", "pinned-host"])
def test_pool_buffer_shared_and_opened(kind):
    pool = gpuipc.Pool(kind=kind)
    assert pool.kind == kind
    buf = pool.alloc(shape=(16, 16), dtype="uint8")
    data = pattern(256, 4)
    drv().htod(buf.ptr, data)
    with gpuipc.spawn(peers.open_consumer) as p:
        s = gpuipc.share(buf)
        assert isinstance(s.desc, bytes) and s.desc[:4] == b"GPYS"
        p.conn.send_msg(s.desc, s.fds)
        r = report(p.conn)
        assert r["shape"] == [16, 16] and r["dtype"] == "uint8" and r["imported"] is True
        assert bytes.fromhex(r["data"])[:256] == data
        p.conn.send_msg(b"go")
        assert p.join(30) == 0
        s.close()
    buf.close()


def test_share_foreign_memory():
    arr = DeviceArray((64,), "<f8")
    drv().htod(arr.ptr, pattern(512, 8))
    with gpuipc.spawn(peers.open_consumer) as p:
        with gpuipc.share(arr) as s:
            assert s.buffer.kind == "legacy"
            p.conn.send_msg(s.desc, s.fds)
            r = report(p.conn)
            assert r["shape"] == [64] and r["dtype"] == "float64"
            assert bytes.fromhex(r["data"]) == pattern(512, 8)
            p.conn.send_msg(b"go")
            p.join(30)


def test_raw_buffer_descriptor():
    pool = gpuipc.Pool(kind="mempool")
    buf = pool.alloc(4096)
    drv().htod(buf.ptr, pattern(4096, 2))
    desc, fds = buf.export()
    info = gpuipc.desc_info(desc)
    assert info["kind"] == "mempool" and info["bytes"] == 4096 and info["same_machine"]
    assert info["exporter_pid"] == os.getpid()
    with gpuipc.spawn(peers.open_consumer) as p:
        p.conn.send_msg(desc, fds)
        for fd in fds:
            os.close(fd)
        r = report(p.conn)
        assert r["shape"] == [4096] and r["kind"] == "mempool"
        assert bytes.fromhex(r["data"]) == pattern(4096, 2)
        p.conn.send_msg(b"go")
        p.join(30)
    buf.close()


def test_hostile_descriptors_raise_their_own_errors():
    pool = gpuipc.Pool(kind="legacy")
    buf = pool.alloc(4096)
    desc, fds = buf.export()
    assert fds == []
    with pytest.raises(gpuipc.TruncatedError):
        gpuipc.open(desc[:-3])
    with pytest.raises(gpuipc.BadMagicError):
        gpuipc.open(b"\0" * len(desc))
    bad = bytearray(desc)
    bad[-1] ^= 0xFF
    with pytest.raises((gpuipc.BadChecksumError, gpuipc.ProtocolError)):
        gpuipc.open(bytes(bad))
    with pytest.raises(gpuipc.InvalidArgError):  # our own export
        gpuipc.open(desc)
    with pytest.raises(gpuipc.BadVersionError):
        gpuipc.open(b"GPYS\x07\x00" + desc)
    with pytest.raises(gpuipc.TruncatedError):
        gpuipc.open(b"GPYS\x01\xff" + desc[:10])
    buf.close()


def _forged_share(desc, shape, strides=None):
    """A shared descriptor whose array metadata says `shape` (uint8) over
    the buffer of `desc` (a shared descriptor of our own)."""
    assert desc[:4] == b"GPYS"
    raw = desc[6 + desc[5]:]
    nd = len(shape)
    hdr = bytes([ord("G"), ord("P"), 1, nd, 1, 8, 1, 0, 1 if strides else 0, 0, 0, 0])
    meta = hdr + (0).to_bytes(8, "little")
    meta += b"".join(int(x).to_bytes(8, "little") for x in shape)
    if strides:
        meta += b"".join(int(x).to_bytes(8, "little") for x in strides)
    return b"GPYS" + bytes([1, len(meta)]) + meta + raw


@pytest.mark.parametrize("shape,strides", [
    ((1 << 62, 4), None),             # 2^64 bytes: wraps to 0
    ((1 << 32, (1 << 32) + 1), None),  # wraps to 2^32
    ((3, 2), ((1 << 63) - 1, 1)),      # (3-1) * stride wraps
])
def test_shape_whose_size_wraps_around_is_refused(shape, strides):
    """A peer's metadata whose byte count overflows 64 bits must not pass
    for a small array (the view would reach far past the buffer)."""
    pool = gpuipc.Pool(kind="mempool")
    buf = pool.alloc(4096)
    with gpuipc.spawn(peers.open_consumer) as p:
        s = gpuipc.share(buf)
        p.conn.send_msg(_forged_share(s.desc, shape, strides), s.fds)
        r = report(p.conn)
        assert r.get("error") == "OutOfRangeError", r
        assert p.join(30) == 0
        s.close()
    buf.close()


def test_stale_descriptor_is_refused_in_the_peer():
    pool = gpuipc.Pool(kind="mempool")
    buf = pool.alloc(4096)
    s = gpuipc.share(buf)
    desc, fds = s.desc, [os.dup(fd) for fd in s.fds]
    s.close()
    buf.close()
    with gpuipc.spawn(peers.open_consumer) as p:
        p.conn.send_msg(desc, fds)
        for fd in fds:
            os.close(fd)
        r = report(p.conn)
        assert r["error"] == "StaleError", r
        p.join(30)


@pytest.mark.parametrize("kind", ["mempool", "vmm", "pinned-host", "legacy"])
def test_descriptor_opened_through_the_connection(kind):
    """conn.open: a descriptor that came over the connection from its
    peer is opened (and its data is there); once freed, it is stale."""
    pool = gpuipc.Pool(kind=kind)
    buf = pool.alloc(4096)
    drv().htod(buf.ptr, pattern(4096, 9))
    with gpuipc.spawn(peers.open_consumer, True) as p:
        s = gpuipc.share(buf)
        p.conn.send_msg(s.desc, s.fds)
        r = report(p.conn)
        assert r.get("imported") is True, r
        assert bytes.fromhex(r["data"])[:4096] == pattern(4096, 9)
        p.conn.send_msg(b"go")
        assert p.join(30) == 0
        s.close()
    s = gpuipc.share(buf)
    desc, fds = s.desc, [os.dup(fd) for fd in s.fds]
    s.close()
    buf.close()
    with gpuipc.spawn(peers.open_consumer, True) as p:
        p.conn.send_msg(desc, fds)
        for fd in fds:
            os.close(fd)
        r = report(p.conn)
        assert r["error"] == "StaleError", r
        p.join(30)


def test_blocks_are_not_shared_by_descriptor():
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(256)
    with pytest.raises(gpuipc.NotSupportedError, match="conn.send"):
        gpuipc.share(b)
    b.free()
    a.close()


def test_events_export_and_open():
    ev = gpuipc.Event()
    ev.record()
    ev.synchronize()
    assert ev.query() is True
    d = ev.export()
    assert isinstance(d, bytes) and gpuipc.desc_info(d)["type"] >= 0
    assert ev.handle != 0
    ev.close()
    with pytest.raises(ValueError):
        ev.record()
