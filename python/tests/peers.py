"""Functions run in child processes (gpuipc.spawn) by the tests. Each gets
the connection to the parent first; results go back as JSON messages."""
import json
import os
import time

import gpuipc
from cudrv import drv


def _report(conn, **kw):
    conn.send_msg(json.dumps(kw).encode())


def describe(rx, data=True):
    d = {"shape": list(rx.shape), "dtype": rx.dtype, "strides": list(rx.strides),
         "meta": rx.meta.hex(), "nbytes": rx.nbytes, "length": rx.length}
    if data:
        d["data"] = drv().dtoh(rx.ptr, min(rx.nbytes, 16384)).hex()  # fits one message
    cai = rx.__cuda_array_interface__
    d["cai"] = {"version": cai["version"], "typestr": cai["typestr"],
                "shape": list(cai["shape"]), "stream": cai["stream"],
                "strides": None if cai["strides"] is None else list(cai["strides"]),
                "ptr_matches": cai["data"][0] == rx.ptr}
    return d


def check_consumer(conn, n=1):
    """Receives n buffers, reports each (shape, dtype, data), releases."""
    for _ in range(n):
        rx = conn.recv(timeout=30)
        _report(conn, **describe(rx))
        rx.release()
    conn.recv_msg(timeout=30)  # the parent says when to go


def complete_consumer(conn, n):
    """Receives n buffers, reports each (its data read to the host: the use
    is complete), and releases it with complete=True (a bad value for it is
    refused first, the lease kept)."""
    for _ in range(n):
        rx = conn.recv(timeout=30)
        d = describe(rx)
        try:
            rx.release(complete=1)
            d["bad_refused"] = False
        except TypeError:
            d["bad_refused"] = True
        rx.release(complete=True)
        _report(conn, **d)
    conn.recv_msg(timeout=30)  # the parent says when to go


def echo_consumer(conn, n):
    """Receives n buffers and releases each at once; reports the count and
    its import cache."""
    got = 0
    for _ in range(n):
        with conn.recv(timeout=60):
            got += 1
    _report(conn, got=got, cache=gpuipc.cache_stats(), counters=gpuipc._gpuipc.counters())
    conn.recv_msg(timeout=30)


def holder(conn, n):
    """Receives n buffers, keeps them, says so, then waits to be killed."""
    held = [conn.recv(timeout=30) for _ in range(n)]
    _report(conn, holding=len(held))
    time.sleep(600)


def open_consumer(conn, via_conn=False):
    """Receives a shared descriptor with its fds by message, opens it
    (gpuipc.open, or conn.open with via_conn), reports it."""
    desc, fds = conn.recv_msg(timeout=30, with_fds=True)
    try:
        buf = conn.open(desc, fds) if via_conn else gpuipc.open(desc, fds)
    except gpuipc.Error as e:
        _report(conn, error=type(e).__name__, message=str(e))
        return
    finally:
        for fd in fds:
            os.close(fd)
    _report(conn, shape=list(buf.shape), dtype=buf.dtype, kind=buf.kind,
            imported=buf.imported, size=buf.size,
            data=drv().dtoh(buf.ptr, min(buf.size, 8192)).hex())  # fits one message
    conn.recv_msg(timeout=30)
    buf.close()


def worker(conn):
    i, n = gpuipc.worker_index()
    _report(conn, index=i, count=n, pid=os.getpid())
    return 3 if i == 0 else 0


def exits(conn, code):
    return code


def cai_stream_producer(conn, announce):
    """Writes an arena block on a stream of its own (asynchronously, from
    pinned memory) and at once sends a CAI view of it, whose "stream" names
    that stream when announce is set. (Arena blocks: the fast path makes no
    driver call that could wait for the copy.)"""
    import ctypes

    from cudrv import pattern
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    warm = a.alloc(256)
    conn.send(warm)  # the chunk's export, out of the way
    conn.recv_msg(timeout=30)
    b = a.alloc(4096)
    s = drv().stream()

    class View:
        __cuda_array_interface__ = {"shape": (4096,), "typestr": "|u1",
                                    "data": (b.ptr, False), "version": 3,
                                    "stream": s if announce else None}
    data = pattern(4096, 21)
    host = drv().host_alloc(len(data))
    ctypes.memmove(host, data, len(data))
    drv().htod_async(b.ptr, ctypes.c_void_p(host), len(data), s)
    conn.send(View())
    conn.recv_msg(timeout=30)
    drv().sync(s)  # the copy lands before the block is freed at exit


def batch_consumer(conn, n, max=64):
    """Receives n buffers with recv_batch (max at a time), reports each
    (shape, dtype, meta, data) and how many each call took, releases them
    with release_batch."""
    got, calls = [], []
    while len(got) < n:
        rxs = conn.recv_batch(max, timeout=30)
        calls.append(len(rxs))
        got += [describe(rx) for rx in rxs]
        conn.release_batch(rxs)
        assert all(not rx.held for rx in rxs)
    _report(conn, calls=calls, n=len(got))
    for d in got:
        _report(conn, **d)
    conn.recv_msg(timeout=30)


def batch_echo(conn, n, max=64):
    """Receives n buffers with recv_batch and releases each batch at once
    (release_batch); reports the count and its counters."""
    got = 0
    while got < n:
        rxs = conn.recv_batch(max, timeout=60)
        got += len(rxs)
        gpuipc.release_batch(rxs)
        del rxs  # released, and gone
    _report(conn, got=got, counters=gpuipc._gpuipc.counters())
    conn.recv_msg(timeout=30)


def batch_producer(conn, plan):
    """For each entry of plan, waits for a message from the parent, then
    sends: an int k, one batch of k blocks; "one", a single send. Block i
    holds pattern(64, i) and meta b"%d" % i (numbered across the plan).
    After the plan, a message "done" makes it wait for every release and
    report its arena's leases."""
    from cudrv import pattern
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    blocks, i = [], 0
    for step in plan:
        conn.recv_msg(timeout=30)
        k = 1 if step == "one" else step
        bs = [a.alloc(64) for _ in range(k)]
        for j, b in enumerate(bs):
            drv().htod(b.ptr, pattern(64, i + j))
        metas = [b"%d" % (i + j) for j in range(k)]
        if step == "one":
            conn.send(bs[0], meta=metas[0])
        else:
            conn.send_batch(bs, metas=metas)
        blocks += bs
        i += k
    conn.recv_msg(timeout=30)
    for b in blocks:
        b.free()
    end = time.monotonic() + 20
    while a.stats()["leases"] and time.monotonic() < end:
        conn.progress(0.05)
    _report(conn, leases=a.stats()["leases"], blocks=a.stats()["blocks_allocated"])
    conn.recv_msg(timeout=30)


def sender_batches(conn, n, k):
    """Sends n blocks in batches of k, block i with meta b"%d" % i."""
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    blocks = [a.alloc(256) for _ in range(2 * k)]
    for i in range(0, n, k):
        m = min(k, n - i)
        half = (i // k) % 2 * k
        conn.send_batch(blocks[half:half + m], metas=[b"%d" % (i + j) for j in range(m)])
    conn.recv_msg(timeout=60)


def release_one_later(conn, n, delay):
    """Receives n buffers and keeps them (its connection then has no free
    slot at the producer), says so, releases one after delay seconds (or,
    delay a path, once that file exists: the parent says when, without a
    message on a connection one of its threads may be waiting on), then
    receives one more and reports its meta."""
    held = [conn.recv(timeout=30) for _ in range(n)]
    _report(conn, holding=len(held))
    if isinstance(delay, str):
        end = time.monotonic() + 60
        while not os.path.exists(delay) and time.monotonic() < end:
            time.sleep(0.01)
    else:
        time.sleep(delay)
    held.pop(0).release()
    rx = conn.recv(timeout=30)
    _report(conn, meta=rx.meta.hex())
    rx.release()
    gpuipc.release_batch(held)
    conn.recv_msg(timeout=30)


def closed_by_parent(conn):
    """Receives a buffer and keeps it, says so, then waits for the parent's
    close: exits 5 when recv says the parent is gone, 6 on a timeout, 7
    when a message still went out after the close."""
    held = conn.recv(timeout=30)
    _report(conn, holding=1)
    try:
        conn.recv_msg(timeout=20)
    except gpuipc.PeerGoneError:
        try:
            conn.send_msg(b"after the close")
        except gpuipc.PeerGoneError:
            del held
            os._exit(5)
        os._exit(7)
    except gpuipc.TimeoutError:
        os._exit(6)
    os._exit(8)


def lives_on_after_close(conn):
    """Waits for the parent's close, then lives on (until it is killed)."""
    try:
        conn.recv_msg(timeout=60)
    except gpuipc.PeerGoneError:
        time.sleep(600)
    os._exit(3)


def exits_at_once(conn):
    os._exit(0)
