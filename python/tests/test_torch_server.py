"""gpuipc.torch's hand-over machinery without torch (on the emulator too):
the per-process server, one-shot tokens, leases kept until the consumer
releases or dies."""
import json
import os
import time

import pytest

import gpuipc
import gpuipc.torch as gt
from cudrv import DeviceArray, drv, pattern


def fetch_and_report(conn, name, token, pid, hold):
    rx = gt._fetch(name, token, pid, 0)
    conn.send_msg(json.dumps({"shape": list(rx.shape), "dtype": rx.dtype,
                              "data": drv().dtoh(rx.ptr, rx.nbytes).hex()}).encode())
    try:
        gt._fetch(name, token, pid, 0)
        again = "no error"
    except RuntimeError as e:
        again = str(e)
    conn.send_msg(again.encode())
    if hold:
        time.sleep(600)
    conn.recv_msg(timeout=30)  # the parent saw the lease
    del rx


def wait_for(cond, limit=15.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("hold", [False, True])
def test_token_fetched_once_and_lease_ends(hold):
    srv = gt._get_server()
    k0 = gpuipc._gpuipc.counters()["kept"]
    arr = DeviceArray((16, 8), "<i4")
    drv().htod(arr.ptr, pattern(arr.nbytes, 12))
    token = srv.offer(arr, 0)
    del arr  # the server keeps it
    assert gt.stats()["pending"] == 1
    with gpuipc.spawn(fetch_and_report, srv.name, token, srv.pid, hold) as p:
        r = json.loads(p.conn.recv_msg(timeout=30))
        assert r["shape"] == [16, 8] and r["dtype"] == "int32"
        assert bytes.fromhex(r["data"]) == pattern(512, 12)
        assert "unknown tensor" in p.conn.recv_msg(timeout=30).decode()
        assert gt.stats()["pending"] == 0
        assert wait_for(lambda: gt.stats()["held"] == 1)
        if hold:
            p.kill()
            p.join(30)
        else:
            p.conn.send_msg(b"go")
            assert p.join(30) == 0
        assert wait_for(lambda: gt.stats()["held"] == 0), gt.stats()
    # what the library kept for the peer (the wrapped memory) came back
    assert wait_for(lambda: (gpuipc.collect(), gpuipc._gpuipc.counters())[1]["kept"] == k0)


def test_install_needs_torch():
    try:
        import torch  # noqa: F401
        pytest.skip("torch is here: test_gpu_torch_mp covers install()")
    except ImportError:
        pass
    with pytest.raises(ImportError):
        gt.install()
    assert not gt.installed()
    gt.uninstall()  # a no-op


def open_shared_and_report(conn, name, token, pid, desc, ev_desc, hold):
    buf = gt._open_shared(name, token, pid, desc, ev_desc, lambda dev: 0)
    conn.send_msg(json.dumps({"shape": list(buf.shape), "dtype": buf.dtype,
                              "data": drv().dtoh(buf.ptr, 512).hex()}).encode())
    if hold == "closed":
        # Its connection to the producer's server ends, its process lives
        # on holding the view: the producer must keep the memory.
        gt._clients[name].conn.close()
        conn.send_msg(b"closed")
        conn.recv_msg(timeout=60)
        os._exit(0)
    if hold:
        time.sleep(600)
    conn.recv_msg(timeout=30)  # the parent saw it held
    del buf  # the producer hears it may reuse the memory
    conn.recv_msg(timeout=30)


@pytest.mark.parametrize("hold", [False, True, "closed"])
def test_descriptor_route_holds_until_done_or_death(hold):
    import weakref

    srv = gt._get_server()
    arr = DeviceArray((16, 8), "<i4")
    drv().htod(arr.ptr, pattern(arr.nbytes, 13))
    gone = weakref.ref(arr)
    token, desc, ev_desc = srv.offer_shared(arr, 0, 0)
    assert isinstance(desc, bytes) and isinstance(ev_desc, bytes)
    del arr
    assert gone() is not None and gt.stats()["pending"] == 1
    with gpuipc.spawn(open_shared_and_report, srv.name, token, srv.pid, desc, ev_desc,
                      hold) as p:
        r = json.loads(p.conn.recv_msg(timeout=30))
        assert r["shape"] == [16, 8] and r["dtype"] == "int32"
        assert bytes.fromhex(r["data"]) == pattern(512, 13)
        assert wait_for(lambda: gt.stats() == {"pending": 0, "held": 1}), gt.stats()
        assert gone() is not None
        if hold == "closed":
            assert p.conn.recv_msg(timeout=30) == b"closed"
            assert wait_for(lambda: not srv.peers), "the server did not see the end"
            for _ in range(4):  # past the server's collects: still kept
                time.sleep(0.2)
                gpuipc.collect()
            assert gt.stats()["held"] == 1 and gone() is not None
            p.conn.send_msg(b"exit")
            assert p.join(30) == 0
        elif hold:
            p.kill()
            p.join(30)
        else:
            p.conn.send_msg(b"saw it")
        assert wait_for(lambda: gt.stats()["held"] == 0), gt.stats()
        assert wait_for(lambda: gone() is None), "the producer kept the memory"
        if not hold:
            p.conn.send_msg(b"go")
            assert p.join(30) == 0
