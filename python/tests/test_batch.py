"""Batches and broadcast: many arena buffers in one send, receive and
release (all or nothing), one block to many connections (a failing one
does not stop the others), reference counting over many batches."""
import gc
import json
import signal
import time
import tracemalloc

import pytest

import gpuipc
import peers
from cudrv import DeviceArray, drv, pattern


def report(conn):
    return json.loads(conn.recv_msg(timeout=30))


def settle(conn, until, limit=10.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            conn.progress(0.05)
        except (gpuipc.PeerGoneError, gpuipc.ClosedError):
            pass
        if until():
            return True
    return until()


@pytest.fixture
def arena():
    a = gpuipc.Arena(chunk_bytes=4 << 20)
    yield a
    gc.collect()
    gpuipc.collect()


def test_batch_round_trip_checked_by_the_child(arena):
    """Blocks of several shapes and dtypes, a strided view and an interior
    view of blocks, each with its own meta, go as one batch: the child
    takes them in one recv_batch and reads what was written."""
    with gpuipc.spawn(peers.batch_consumer, 5) as p:
        b0 = arena.alloc(shape=(3, 5), dtype="float32")
        b1 = arena.alloc(1000)
        b2 = arena.alloc(shape=(4, 6), dtype="int16")
        b3 = arena.alloc(4096)
        b4 = arena.alloc(shape=(16,), dtype="int64")
        for i, b in enumerate((b0, b1, b2, b3, b4)):
            drv().htod(b.ptr, pattern(b.nbytes, 30 + i))

        class T:  # transposed view of b2
            __cuda_array_interface__ = {"shape": (6, 4), "typestr": "<i2",
                                        "data": (b2.ptr, False), "version": 3,
                                        "strides": (2, 12)}

        class Inner:  # bytes 1000..1099 of b3
            __cuda_array_interface__ = {"shape": (100,), "typestr": "|u1",
                                        "data": (b3.ptr + 1000, False), "version": 3}
        before = gpuipc._gpuipc.counters()["wraps_total"]
        p.conn.send_batch([b0, b1, T(), Inner(), b4],
                          metas=[b"zero", None, b"two", b"", b"four"])
        assert gpuipc._gpuipc.counters()["wraps_total"] == before  # all by the fast path
        assert arena.stats()["leases"] >= 1
        r = report(p.conn)
        assert r == {"calls": [5], "n": 5}  # one batch, taken by one recv_batch
        d = [report(p.conn) for _ in range(5)]
        assert d[0]["shape"] == [3, 5] and d[0]["dtype"] == "float32"
        assert d[0]["meta"] == b"zero".hex()
        assert bytes.fromhex(d[0]["data"]) == pattern(b0.nbytes, 30)[:60]
        assert d[1]["shape"] == [1000] and d[1]["dtype"] == "uint8" and d[1]["meta"] == ""
        assert bytes.fromhex(d[1]["data"]) == pattern(b1.nbytes, 31)[:1000]
        assert d[2]["shape"] == [6, 4] and d[2]["strides"] == [1, 6]
        assert d[2]["cai"]["strides"] == [2, 12] and d[2]["meta"] == b"two".hex()
        assert bytes.fromhex(d[2]["data"]) == pattern(b2.nbytes, 32)[:48]
        assert bytes.fromhex(d[3]["data"]) == pattern(4096, 33)[1000:1100]
        assert d[4]["dtype"] == "int64" and d[4]["meta"] == b"four".hex()
        assert bytes.fromhex(d[4]["data"]) == pattern(b4.nbytes, 34)[:128]
        # the child's release_batch gave every lease back
        assert settle(p.conn, lambda: arena.stats()["leases"] == 0)
        assert p.conn.outstanding() == (0, 0)
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def test_send_batch_is_all_or_nothing(arena):
    """A bad item anywhere fails the whole batch, naming its index, and
    nothing of it reaches the peer: the next good batch is the first
    thing the child receives."""
    pool = gpuipc.Pool(kind="mempool")
    with gpuipc.spawn(peers.batch_consumer, 2) as p:
        good = [arena.alloc(64) for _ in range(3)]
        freed = arena.alloc(64)
        freed.free()
        foreign = DeviceArray((64,), "|u1")
        buf = pool.alloc(64)
        with pytest.raises(TypeError, match=r"send_batch: item 2 .*not arena memory"):
            p.conn.send_batch(good[:2] + [foreign])
        with pytest.raises(TypeError, match=r"send_batch: item 1 is a Buffer"):
            p.conn.send_batch([good[0], buf, good[1]])
        with pytest.raises(gpuipc.InvalidArgError, match=r"item 1.*freed"):
            p.conn.send_batch([good[0], freed])
        with pytest.raises(TypeError, match=r"send_batch: item 1: .*neither"):
            p.conn.send_batch([good[0], 42])
        with pytest.raises(ValueError, match=r"send_batch: item 2: metadata too large"):
            p.conn.send_batch(good, metas=[b"", b"", b"x" * 300])
        with pytest.raises(ValueError, match=r"2 metas for 3 buffers"):
            p.conn.send_batch(good, metas=[b"", b""])
        with pytest.raises(ValueError, match=r"at most %d" % gpuipc.BATCH_MAX):
            p.conn.send_batch([good[0]] * (gpuipc.BATCH_MAX + 1))
        # over the frame's bytes (48 per buffer plus the encoded metadata):
        # the library says so, and nothing went
        with pytest.raises(gpuipc.InvalidArgError, match="bytes"):
            p.conn.send_batch([good[0]] * 256, metas=[b"m" * 200] * 256)
        # more than the connection's slots (max_outstanding 256) at once
        many = [arena.alloc(64) for _ in range(300)]
        with pytest.raises(gpuipc.InvalidArgError, match="slots"):
            p.conn.send_batch(many)
        del many
        p.conn.send_batch([], metas=[])  # nothing to send
        assert p.conn.outstanding() == (0, 0) and arena.stats()["leases"] == 0
        assert all(b.holders == 0 for b in good)
        p.conn.send_batch(good[1:], metas=[b"first", b"second"])
        r = report(p.conn)
        assert r["n"] == 2 and r["calls"] == [2]
        assert [report(p.conn)["meta"] for _ in range(2)] == [b"first".hex(), b"second".hex()]
        p.conn.send_msg(b"go")
        assert p.join(30) == 0
    buf.close()


def test_recv_batch_takes_up_to_max(arena):
    """recv_batch waits for the first buffer, then takes what is queued,
    up to max: a batch of 5 is taken as 3 then 2, and the next call waits
    for the next send."""
    with gpuipc.spawn(peers.batch_producer, [5, "one"]) as p:
        with pytest.raises(ValueError, match="max"):
            p.conn.recv_batch(0)
        t0 = time.monotonic()
        with pytest.raises(gpuipc.TimeoutError):
            p.conn.recv_batch(4, timeout=0.2)
        assert time.monotonic() - t0 >= 0.15
        p.conn.send_msg(b"next")
        a = p.conn.recv_batch(3, timeout=30)
        assert [rx.meta for rx in a] == [b"0", b"1", b"2"]
        b = p.conn.recv_batch(10, timeout=30)
        assert [rx.meta for rx in b] == [b"3", b"4"]
        for i, rx in enumerate(a + b):
            assert rx.held and rx.nbytes == 64 and rx.connection is p.conn
            assert drv().dtoh(rx.ptr, 64) == pattern(64, i)
        assert p.conn.outstanding()[1] == 5
        p.conn.send_msg(b"next")
        c = p.conn.recv_batch(10, timeout=30)  # waits for the single send
        assert [rx.meta for rx in c] == [b"5"]
        p.conn.release_batch(a + b + c)
        assert p.conn.outstanding()[1] == 0
        p.conn.send_msg(b"done")
        assert report(p.conn) == {"leases": 0, "blocks": 0}
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def test_release_batch_all_or_nothing_mixed_list():
    """Buffers of two connections, from recv and recv_batch, go back in one
    gpuipc.release_batch; a duplicated, released or foreign item fails the
    whole call first and releases nothing."""
    c0 = gpuipc._gpuipc.counters()["received"]
    p1 = gpuipc.spawn(peers.batch_producer, ["one", 3])
    p2 = gpuipc.spawn(peers.batch_producer, [2])
    try:
        for p in (p1, p2):
            p.conn.send_msg(b"next")
        single = p1.conn.recv(timeout=30)
        p1.conn.send_msg(b"next")
        batch1 = p1.conn.recv_batch(8, timeout=30)
        while len(batch1) < 3:
            batch1 += p1.conn.recv_batch(8, timeout=30)
        batch2 = p2.conn.recv_batch(8, timeout=30)
        while len(batch2) < 2:
            batch2 += p2.conn.recv_batch(8, timeout=30)
        mixed = [batch2[0], single] + batch1 + [batch2[1]]
        assert gpuipc._gpuipc.counters()["received"] == c0 + 6

        def all_held():
            return (all(rx.held for rx in mixed) and p1.conn.outstanding()[1] == 4
                    and p2.conn.outstanding()[1] == 2)
        with pytest.raises(ValueError, match=r"item 6 is item 1 again"):
            gpuipc.release_batch(mixed + [single])
        assert all_held()
        with pytest.raises(TypeError, match=r"item 1 is not a Received"):
            gpuipc.release_batch([single, "rx"])
        assert all_held()
        with pytest.raises(ValueError, match=r"item 0 came over another connection"):
            p1.conn.release_batch([batch2[0], single])
        assert all_held()
        # a buffer released already is unknown to the library: the whole
        # call fails before any other is released
        single.release()
        with pytest.raises(ValueError, match=r"item 1 was released already"):
            gpuipc.release_batch([batch1[0], single, batch1[1]])
        assert all(rx.held for rx in batch1 + batch2)
        assert p1.conn.outstanding()[1] == 3
        mixed.remove(single)
        gpuipc.release_batch(mixed)
        assert not any(rx.held for rx in mixed)
        assert p1.conn.outstanding()[1] == 0 and p2.conn.outstanding()[1] == 0
        with pytest.raises(ValueError, match="already released"):
            mixed[0].__cuda_array_interface__  # its views are gone, as after release()
        mixed[0].release()  # released already: nothing happens
        for p in (p1, p2):
            p.conn.send_msg(b"done")
            assert report(p.conn) == {"leases": 0, "blocks": 0}
            p.conn.send_msg(b"go")
            assert p.join(30) == 0
        del single, batch1, batch2, mixed
        gc.collect()
        assert gpuipc._gpuipc.counters()["received"] == c0
    finally:
        p1.close()
        p2.close()


def test_broadcast_to_three_one_killed_beforehand(arena):
    """One block to three consumers, one of which was killed before: the
    other two read it, the dead one's entry says its peer is gone, and
    every lease comes back."""
    procs = [gpuipc.spawn(peers.check_consumer, 1) for _ in range(3)]
    try:
        procs[1].kill(signal.SIGKILL)
        assert procs[1].join(30) == -signal.SIGKILL
        b = arena.alloc(shape=(8, 8), dtype="float32")
        drv().htod(b.ptr, pattern(256, 44))
        res = gpuipc.broadcast([p.conn for p in procs], b, meta=b"to-all", timeout=10)
        assert len(res) == 3
        assert res[0] is None and res[2] is None, res
        assert isinstance(res[1], gpuipc.PeerGoneError), res
        assert isinstance(res[1], gpuipc.Error) and res[1].status_name == "GPUIPC_E_PEER_GONE"
        assert "conns[1]" in str(res[1])
        b.free()  # back to the arena once both peers released it
        for i in (0, 2):
            r = report(procs[i].conn)
            assert r["shape"] == [8, 8] and r["dtype"] == "float32"
            assert r["meta"] == b"to-all".hex()
            assert bytes.fromhex(r["data"]) == pattern(256, 44)
        def back():
            procs[2].conn.progress(0)
            return arena.stats()["leases"] == 0
        assert settle(procs[0].conn, back)
        assert arena.stats()["blocks_allocated"] == 0
        for i in (0, 2):
            procs[i].conn.send_msg(b"go")
            assert procs[i].join(30) == 0
    finally:
        for p in procs:
            p.close()


def test_broadcast_bad_arguments_send_nothing(arena):
    with gpuipc.spawn(peers.check_consumer, 1) as p:
        b = arena.alloc(64)
        with pytest.raises(TypeError, match=r"conns\[1\] is not a Connection"):
            gpuipc.broadcast([p.conn, "c"], b)
        with pytest.raises(ValueError, match=r"conns\[0\] and conns\[1\] are the same"):
            gpuipc.broadcast([p.conn, p.conn], b)
        with pytest.raises(TypeError, match=r"broadcast: the block .*not arena memory"):
            gpuipc.broadcast([p.conn], DeviceArray((64,), "|u1"))
        with pytest.raises(ValueError, match="metadata too large"):
            gpuipc.broadcast([p.conn], b, meta=b"x" * 300)
        freed = arena.alloc(64)
        freed.free()
        with pytest.raises(gpuipc.InvalidArgError, match="freed"):
            gpuipc.broadcast([p.conn], freed)
        assert gpuipc.broadcast([], b) == []
        assert p.conn.outstanding() == (0, 0) and b.holders == 0
        # a connection closed here is its own entry; the others still get it
        other = gpuipc.spawn(peers.check_consumer, 1)
        other.conn.close()
        res = gpuipc.broadcast([other.conn, p.conn], b, meta=b"ok")
        assert isinstance(res[0], gpuipc.ClosedError) and res[1] is None
        assert report(p.conn)["meta"] == b"ok".hex()
        other.close()
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def test_broadcast_waits_for_a_slot_up_to_the_timeout(arena):
    """A consumer that holds every slot of its connection is not ready: the
    broadcast waits for it up to the timeout and reports TimeoutError for
    it alone; another consumer got the block at once."""
    n = 256  # the connection's max_outstanding
    holder = gpuipc.spawn(peers.holder, n)
    other = gpuipc.spawn(peers.check_consumer, 1)
    try:
        blocks = [arena.alloc(64) for _ in range(64)]
        for i in range(n):
            holder.conn.send(blocks[i % 64])
        assert report(holder.conn) == {"holding": n}
        b = arena.alloc(64)
        t0 = time.monotonic()
        res = gpuipc.broadcast([holder.conn, other.conn], b, timeout=0.3)
        assert time.monotonic() - t0 >= 0.25
        assert isinstance(res[0], gpuipc.TimeoutError) and res[1] is None, res
        assert "conns[0] not ready" in str(res[0])
        assert report(other.conn)["nbytes"] == 64
        assert holder.conn.outstanding()[0] == n  # nothing more went to the holder
        # a batch waits for free slots up to its timeout, then sends nothing
        with pytest.raises(gpuipc.TimeoutError):
            holder.conn.send_batch([b, blocks[0]], timeout=0.2)
        assert holder.conn.outstanding()[0] == n
        other.conn.send_msg(b"go")
        assert other.join(30) == 0
    finally:
        holder.kill()
        holder.close()
        other.close()


def test_no_leak_over_many_batches(arena):
    """300 batches of 32 through recv_batch/release_batch in the child (the
    sender waits for free slots as they come back): no memory grows, the
    counters return, every lease comes back."""
    nb, k = 300, 32
    with gpuipc.spawn(peers.batch_echo, nb * k) as p:
        blocks = [arena.alloc(4096, shape=(1024,), dtype="float32") for _ in range(64)]
        metas = [b"%d" % i for i in range(k)]
        for i in range(20):  # warm up: chunk export, caches, free lists
            p.conn.send_batch(blocks[(i % 2) * k:(i % 2) * k + k], metas=metas)
        gc.collect()
        tracemalloc.start()
        snap0 = tracemalloc.take_snapshot()
        c0 = gpuipc._gpuipc.counters()
        for i in range(20, nb):
            p.conn.send_batch(blocks[(i % 2) * k:(i % 2) * k + k], metas=metas)
        r = report(p.conn)
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        assert grown < 64 * 1024, f"{grown} bytes more after {nb} batches"
        assert r["got"] == nb * k
        assert r["counters"]["received"] == 0  # the child holds none
        c1 = gpuipc._gpuipc.counters()
        assert c1["blocks"] == c0["blocks"] and c1["wraps"] == c0["wraps"]
        assert settle(p.conn, lambda: arena.stats()["leases"] == 0)
        assert p.conn.outstanding() == (0, 0)
        p.conn.send_msg(b"go")
        assert p.join(60) == 0
        del blocks
        gc.collect()
        assert arena.stats()["blocks_allocated"] == 0


def test_no_leak_receiving_batches():
    """The receiving side: thousands of Received from recv_batch go back
    with release_batch, and with the list (no release_batch) half the
    time: counters and memory return."""
    n = 6000
    with gpuipc.spawn(peers.sender_batches, n, 40) as p:
        c0 = gpuipc._gpuipc.counters()["received"]
        got, calls = 0, 0
        tracemalloc.start()
        snap0 = None
        while got < n:
            rxs = p.conn.recv_batch(64, timeout=30)
            assert rxs[0].meta == b"%d" % got
            got += len(rxs)
            calls += 1
            if calls % 2:
                p.conn.release_batch(rxs)
            del rxs  # the others go with their list
            if snap0 is None and got >= 400:
                gc.collect()
                snap0 = tracemalloc.take_snapshot()
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        assert grown < 64 * 1024, f"{grown} bytes more after {n} buffers"
        assert gpuipc._gpuipc.counters()["received"] == c0
        assert p.conn.outstanding()[1] == 0
        assert calls < n  # batches were taken together
        p.conn.send_msg(b"go")
        assert p.join(60) == 0


def counting_while(fn, seconds=0.3):
    """Runs fn in a thread; counts in this one meanwhile. -> (result, count
    over `seconds`, whether fn was still running then)."""
    import threading

    out = {}

    def run():
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 reported to the caller
            out["e"] = e
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.05)
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        count += 1
    running = t.is_alive()
    return t, out, count, running


def test_recv_batch_waits_without_the_gil():
    with gpuipc.spawn(peers.batch_producer, [3]) as p:
        t, out, count, running = counting_while(lambda: p.conn.recv_batch(8, timeout=20))
        assert running, out
        # Holding the GIL the whole wait would leave the loop nearly frozen.
        assert count > 10000, count
        p.conn.send_msg(b"next")
        t.join(20)
        rxs = out["r"]
        while len(rxs) < 3:
            rxs += p.conn.recv_batch(8, timeout=20)
        assert [rx.meta for rx in rxs] == [b"0", b"1", b"2"]
        gpuipc.release_batch(rxs)
        p.conn.send_msg(b"done")
        assert report(p.conn) == {"leases": 0, "blocks": 0}
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def test_broadcast_waits_for_a_slot_without_the_gil(arena, tmp_path):
    """A full connection gets the broadcast once its peer releases a
    buffer; meanwhile other threads run."""
    n = 256
    # The peer releases only once this file exists, made after the check
    # that the broadcast still waits: a release due 1 s after the peer's
    # report could come before that check on a loaded machine.
    go = tmp_path / "release"
    with gpuipc.spawn(peers.release_one_later, n, str(go)) as p:
        blocks = [arena.alloc(64) for _ in range(64)]
        for i in range(n):
            p.conn.send(blocks[i % 64])
        assert report(p.conn) == {"holding": n}
        b = arena.alloc(64)
        t, out, count, running = counting_while(
            lambda: gpuipc.broadcast([p.conn], b, meta=b"late", timeout=20))
        assert running, out  # it waits for the release, not yet possible
        assert count > 10000, count
        go.touch()
        t.join(20)
        assert out.get("r") == [None], out
        assert report(p.conn) == {"meta": b"late".hex()}
        assert settle(p.conn, lambda: arena.stats()["leases"] == 0)
        p.conn.send_msg(b"go")
        assert p.join(30) == 0
