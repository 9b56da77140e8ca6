"""The tensor meta of the C library (include/gpuipc/tensor.h,
docs/tensor-meta.md) as the package speaks it: one dtype vocabulary
(float8 kinds included, by name and by DLPack code), and a tensor sent
from Python read by a C consumer and the reverse.

The C side is the test binary's helper tensor_meta_peer (tests/test-tensor.c):
`gpuipc-tests --helper tensor_meta_peer consume|produce NAME RUNTIME_DIR ...`,
started here as the peer over gpuipc.listen. Without torch, float8 arrays
are made with DLPack capsules built through ctypes."""
import ctypes
import os
import shutil
import subprocess
import tempfile
import threading

import pytest

import gpuipc
from cudrv import drv, pattern
from test_dlpack import DLDataType, DLDevice, DLManagedTensor, consume

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PyCapsule_New = ctypes.pythonapi.PyCapsule_New
PyCapsule_New.restype = ctypes.py_object
PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"  # the capsule keeps a pointer to the name: keep it alive

FLOAT8 = [("float8_e4m3fn", 10), ("float8_e5m2", 12), ("float8_e4m3fnuz", 11),
          ("float8_e5m2fnuz", 13), ("float8_e8m0fnu", 14)]


class DLView:
    """An array of device memory exposing only __dlpack__ (DLPack 0.x: no
    versioned capsule), of any DLPack dtype: what torch gives for a float8
    tensor, without torch."""

    def __init__(self, ptr, shape, strides, code, bits, lanes=1):
        n = len(shape)
        self._shape = (ctypes.c_int64 * max(n, 1))(*shape)
        self._strides = (ctypes.c_int64 * max(n, 1))(*strides)
        self._m = DLManagedTensor()
        t = self._m.dl_tensor
        t.data = ptr
        t.device = DLDevice(2, 0)
        t.ndim = n
        t.dtype = DLDataType(code, bits, lanes)
        t.shape = self._shape
        t.strides = self._strides
        t.byte_offset = 0

    def __dlpack__(self, stream=None, max_version=None, **kw):
        if max_version is not None:
            raise TypeError("an exporter older than DLPack 1.0")
        return PyCapsule_New(ctypes.addressof(self._m), _DLTENSOR, None)

    def __dlpack_device__(self):
        return (2, 0)


class CAIView:
    """A strided view through the CUDA Array Interface (strides in bytes)."""

    def __init__(self, ptr, shape, typestr, strides):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, False), "version": 3,
                                         "strides": strides, "stream": None}


def elements(data, offset, shape, strides, esz):
    """The bytes of each element in row-major index order, as hex: what the
    C peer prints."""
    out = []
    idx = [0] * len(shape)
    if any(s == 0 for s in shape):
        return ""
    while True:
        o = offset + esz * sum(i * s for i, s in zip(idx, strides))
        out.append(data[o:o + esz].hex())
        d = len(shape) - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < shape[d]:
                break
            idx[d] = 0
            d -= 1
        if d < 0:
            return "".join(out)


def _peer_binary():
    build = os.environ.get("GPUIPC_BUILD_DIR")
    if not build and os.environ.get("GPUIPC_PKG_DIR"):
        build = os.path.dirname(os.path.dirname(os.path.abspath(os.environ["GPUIPC_PKG_DIR"])))
    exe = os.path.join(build or os.path.join(ROOT, "build"), "gpuipc-tests")
    if not os.access(exe, os.X_OK):
        pytest.skip(f"no C test binary at {exe} (build the C suite first)")
    return exe


@pytest.fixture
def peer():
    """(start(role, *args) -> Popen, listener): the C peer connects to the
    listener in a private runtime directory."""
    exe = _peer_binary()
    d = tempfile.mkdtemp(prefix="gpuipc-tm-")
    name = "tensor-meta"
    lst = gpuipc.listen(name, runtime_dir=d)
    procs = []

    def start(role, *args):
        p = subprocess.Popen([exe, "--helper", "tensor_meta_peer", role, name, d, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    yield start, lst
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    lst.close()
    shutil.rmtree(d, ignore_errors=True)


def _parse(line):
    return dict(kv.split("=", 1) for kv in line.split())


# ---- one vocabulary ---------------------------------------------------------------

@pytest.mark.parametrize("name,code", FLOAT8)
def test_float8_dtypes_by_name_and_dlpack_code(name, code):
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(shape=(2, 3), dtype=name)
    assert b.dtype == name and b.shape == (2, 3) and b.nbytes == 6
    assert a.alloc(shape=(4,), dtype="torch." + name).dtype == name
    f, delete = consume(b.__dlpack__(stream=-1), False)
    assert f["dtype"] == (code, 8, 1) and f["strides"] == [3, 1]
    delete()
    with pytest.raises(AttributeError, match="typestr"):
        b.__cuda_array_interface__  # no typestr names a float8 kind
    del b


def test_dtype_objects_are_read_by_name():
    class FakeNumpyDtype:  # what ml_dtypes gives: an opaque typestr, a name
        str = "<V1"
        itemsize = 1
        name = "float8_e4m3fn"

    a = gpuipc.Arena(chunk_bytes=1 << 20)
    assert a.alloc(shape=(4,), dtype=FakeNumpyDtype()).dtype == "float8_e4m3fn"
    assert a.alloc(shape=(4,), dtype="<c8").dtype == "complex64"
    with pytest.raises(TypeError, match="typestr"):
        a.alloc(shape=(4,), dtype="<f1")  # no 8-bit IEEE float


def _pair():
    fa, fb = gpuipc.conn_pair()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", gpuipc.from_fd(fb)))
    t.start()
    a = gpuipc.from_fd(fa)
    t.join(10)
    return a, out["b"]


def test_dlpack_dtype_without_a_gpuipc_dtype_is_refused():
    a, b = _pair()
    ar = gpuipc.Arena(chunk_bytes=1 << 20)
    blk = ar.alloc(256)
    for code, bits, lanes in [(2, 32, 4), (17, 4, 1), (3, 64, 1)]:
        with pytest.raises(TypeError, match=f"code {code}, bits {bits}, lanes {lanes}"):
            a.send(DLView(blk.ptr, (4,), (1,), code, bits, lanes))
    a.close()
    b.close()


# ---- across languages ----------------------------------------------------------

def test_c_consumer_reads_what_python_sent(peer):
    start, lst = peer
    p = start("consume", "3")
    conn = lst.accept(timeout=30)
    ar = gpuipc.Arena(chunk_bytes=1 << 20)
    blk = ar.alloc(256)
    data = pattern(256, 3)
    drv().htod(blk.ptr, data)
    # 1: float8_e4m3fn, a strided (column-major) view at offset 8
    conn.send(DLView(blk.ptr + 8, (3, 4), (1, 5), 10, 8), meta=b"from-python")
    # 2: bfloat16, a whole contiguous block of its own
    b2 = ar.alloc(shape=(2, 3, 4), dtype="bfloat16")
    drv().htod(b2.ptr, pattern(48, 3))
    conn.send(b2)
    # 3: int16 through the CUDA Array Interface, strides in bytes (2, 8)
    conn.send(CAIView(blk.ptr + 32, (4, 3), "<i2", (2, 8)), meta=b"\x00\xff")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 3, out
    got = [_parse(x) for x in lines]
    assert got[0] == {"dtype": "f8_e4m3fn", "ndim": "2", "offset": "8", "has_strides": "1",
                      "shape": "3,4", "strides": "1,5", "user": b"from-python".hex(),
                      "data": elements(data, 8, (3, 4), (1, 5), 1)}
    assert got[1] == {"dtype": "bf16", "ndim": "3", "offset": "0", "has_strides": "0",
                      "shape": "2,3,4", "strides": "12,4,1", "user": "",
                      "data": pattern(48, 3).hex()}
    assert got[2] == {"dtype": "i16", "ndim": "2", "offset": "32", "has_strides": "1",
                      "shape": "4,3", "strides": "1,4", "user": "00ff",
                      "data": elements(data, 32, (4, 3), (1, 4), 2)}
    conn.close()


def test_python_consumer_reads_what_c_sent(peer):
    start, lst = peer
    p = start("produce")
    conn = lst.accept(timeout=30)
    data = pattern(256, 3)
    rx = conn.recv(timeout=30)
    assert (rx.dtype, rx.shape, rx.strides, rx.meta) == ("float8_e4m3fn", (3, 4), (1, 5),
                                                          b"from-c")
    assert rx.length == 256 and rx.nbytes == 1 + 2 * 1 + 3 * 5
    # element 0 is 8 bytes into the block: its bytes are the pattern's from 8 on
    got = drv().dtoh(rx.ptr, rx.nbytes)
    assert elements(got, 0, (3, 4), (1, 5), 1) == elements(data, 8, (3, 4), (1, 5), 1)
    f, delete = consume(rx.__dlpack__(stream=-1), False)
    assert f["dtype"] == (10, 8, 1) and f["strides"] == [1, 5] and f["data"] == rx.ptr
    delete()
    rx2 = conn.recv(timeout=30)
    assert (rx2.dtype, rx2.shape, rx2.strides, rx2.meta) == ("bfloat16", (2, 3, 4),
                                                             (12, 4, 1), b"")
    assert drv().dtoh(rx2.ptr, 48) == data[32:80]
    rx3 = conn.recv(timeout=30)  # a meta of the producer's own: bytes, as sent
    assert (rx3.dtype, rx3.shape, rx3.meta) == ("uint8", (256,), b"plain bytes")
    for r in (rx, rx2, rx3):
        r.release()
    conn.close()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.strip() == "produced"


def test_tensor_set_carries_float8():
    """A set's dtypes are the same vocabulary: float8 entries go through a
    set and its consumer sees them by name, bytes intact."""
    import sets_peers
    from test_sets import Peer, fill, report

    spec = {n: ((3, 4), n) for n, _ in FLOAT8}
    spec["bf16"] = ((2, 5), "bfloat16")
    ts = gpuipc.TensorSet.empty(spec)
    peer = Peer(sets_peers.consume, 1, "view")
    try:
        ts.subscribe(peer.sc)
        c = ts.begin()
        digest = fill(ts, c, 1)
        ts.publish()
        r = report(peer.p.conn)
        assert r["dtypes"] == [d for _, d in spec.values()]
        assert r["shapes"] == [[3, 4]] * len(FLOAT8) + [[2, 5]]
        assert r["digest"] == digest
        ts.unsubscribe(peer.sc, timeout=30)
        assert report(peer.p.conn)["end"] == "canceled"
    finally:
        assert peer.close() == 0
    ts.destroy()


# ---- with torch (GPU: make gpu-test) ---------------------------------------------------

def test_torch_float8_views_between_python_and_c(peer):
    """torch's float8 tensors (DLPack codes 10 and 12) sent as strided
    views to the C consumer, and the C producer's float8 view received as
    a torch tensor of that dtype and strides."""
    from gpu_common import need, torch_cuda

    torch = need("torch", torch_cuda)
    kinds = [k for k in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, k)]
    if not kinds:
        pytest.skip("this torch has no float8 dtypes")
    start, lst = peer
    p = start("consume", str(len(kinds)))
    conn = lst.accept(timeout=30)
    ar = gpuipc.Arena(chunk_bytes=1 << 20)
    blocks, want = [], []
    for k in kinds:
        b = ar.alloc(shape=(4, 8), dtype=k)
        blocks.append(b)
        t = torch.from_dlpack(b)
        assert t.dtype == getattr(torch, k)
        t.view(torch.uint8).copy_(torch.arange(32, dtype=torch.uint8,
                                               device=t.device).view(4, 8))
        v = t[1:, ::2]  # offset 8, strides (8, 2)
        torch.cuda.synchronize()
        conn.send(v)
        want.append((k, elements(bytes(range(32)), 8, (3, 4), (8, 2), 1)))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    got = [_parse(x) for x in out.splitlines()]
    for g, (k, data) in zip(got, want):
        assert g["dtype"] == {"float8_e4m3fn": "f8_e4m3fn", "float8_e5m2": "f8_e5m2"}[k]
        assert (g["shape"], g["strides"], g["offset"]) == ("3,4", "8,2", "8")
        assert g["data"] == data
    conn.close()
    if not hasattr(torch, "float8_e4m3fn"):
        return
    p = start("produce")
    conn = lst.accept(timeout=30)
    rx = conn.recv(timeout=30)
    t = torch.from_dlpack(rx)
    assert t.dtype == torch.float8_e4m3fn and t.shape == (3, 4) and t.stride() == (1, 5)
    got = t.view(torch.uint8).cpu().tolist()
    data = pattern(256, 3)
    assert got == [[data[8 + i + 5 * j] for j in range(4)] for i in range(3)]
    del t
    rx.release()
    for _ in range(2):
        conn.recv(timeout=30).release()
    conn.close()
    p.communicate(timeout=60)
    assert p.returncode == 0
