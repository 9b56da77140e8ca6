"""The array protocols on gpuipc's objects: __cuda_array_interface__ v3,
and DLPack capsules consumed and deleted by the rules (a consumer written
here with ctypes, and numpy for host memory); views of received buffers
that outlive the connection's close."""
import ctypes
import gc
import os
import sys

import pytest

import gpuipc
from cudrv import drv, pattern

PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
PyCapsule_GetPointer.restype = ctypes.c_void_p
PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
PyCapsule_SetName = ctypes.pythonapi.PyCapsule_SetName
PyCapsule_SetName.restype = ctypes.c_int
PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_void_p]
# A capsule keeps the pointer to its name, not a copy: the names a consumer
# renames a capsule to must outlive it (as a C consumer's literals do).
USED_NAMES = {False: ctypes.create_string_buffer(b"used_dltensor"),
              True: ctypes.create_string_buffer(b"used_dltensor_versioned")}
PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
PyCapsule_GetName.restype = ctypes.c_char_p
PyCapsule_GetName.argtypes = [ctypes.py_object]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor)))]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


def consume(cap, versioned):
    """What a consumer does: take the tensor, rename the capsule, later call
    the deleter itself. Returns (tensor fields, deleter caller)."""
    name = b"dltensor_versioned" if versioned else b"dltensor"
    assert PyCapsule_GetName(cap) == name
    ptr = PyCapsule_GetPointer(cap, name)
    T = DLManagedTensorVersioned if versioned else DLManagedTensor
    m = T.from_address(ptr)
    t = m.dl_tensor
    fields = {"data": t.data, "device": (t.device.device_type, t.device.device_id),
              "ndim": t.ndim, "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes),
              "shape": [t.shape[i] for i in range(t.ndim)],
              "strides": [t.strides[i] for i in range(t.ndim)],
              "byte_offset": t.byte_offset}
    if versioned:
        fields["version"] = (m.version.major, m.version.minor)
        fields["flags"] = m.flags
    assert PyCapsule_SetName(cap, ctypes.addressof(USED_NAMES[versioned])) == 0
    deleter = m.deleter

    def delete():
        deleter(ctypes.cast(ptr, ctypes.POINTER(T)))
    return fields, delete


@pytest.fixture
def block():
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(shape=(2, 3, 4), dtype="float32")
    yield b
    del b
    gc.collect()


def refs():
    return gpuipc._gpuipc.counters()["capsule_refs"]


@pytest.mark.parametrize("versioned", [False, True])
def test_capsule_consumed_then_deleted_by_consumer(block, versioned):
    r0, rc0 = refs(), sys.getrefcount(block)
    kw = {"max_version": (1, 0)} if versioned else {}
    cap = block.__dlpack__(stream=-1, **kw)
    assert refs() == r0 + 1 and sys.getrefcount(block) == rc0 + 1
    f, delete = consume(cap, versioned)
    assert f["data"] == block.ptr and f["device"] == (2, 0) and f["ndim"] == 3
    assert f["dtype"] == (2, 32, 1) and f["shape"] == [2, 3, 4]
    assert f["strides"] == [12, 4, 1] and f["byte_offset"] == 0
    if versioned:
        assert f["version"] == (1, 0) and f["flags"] == 0
    del cap  # renamed: the capsule's destructor must not delete it
    gc.collect()
    assert refs() == r0 + 1, "a consumed capsule was deleted by its destructor"
    delete()  # the consumer is done with it
    assert refs() == r0 and sys.getrefcount(block) == rc0


@pytest.mark.parametrize("versioned", [False, True])
def test_unconsumed_capsule_deletes_itself(block, versioned):
    r0, rc0 = refs(), sys.getrefcount(block)
    cap = block.__dlpack__(**({"max_version": (1, 2)} if versioned else {}))
    assert PyCapsule_GetName(cap) == (b"dltensor_versioned" if versioned else b"dltensor")
    del cap
    assert refs() == r0 and sys.getrefcount(block) == rc0


def test_view_keeps_block_alive():
    arena = gpuipc.Arena(chunk_bytes=1 << 20)
    block = arena.alloc(shape=(2, 3, 4), dtype="float32")
    cap = block.__dlpack__(stream=-1)
    f, delete = consume(cap, False)
    arena_stats = block.arena.stats
    ptr = block.ptr
    b = block
    del block
    del b
    gc.collect()
    assert arena_stats()["blocks_allocated"] == 1  # the view holds it
    delete()
    gc.collect()
    assert arena_stats()["blocks_allocated"] == 0
    assert ptr


def test_dlpack_arguments(block):
    assert block.__dlpack_device__() == (2, 0)
    with pytest.raises(BufferError):
        block.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        block.__dlpack__(dl_device=(1, 0))
    with pytest.raises(ValueError):
        block.__dlpack__(stream=-5)
    assert block.__dlpack__(stream=0) is not None  # taken as the legacy stream
    assert block.__dlpack__(1) is not None  # positional stream (older consumers)
    assert block.__dlpack__(copy=False, dl_device=(2, 0), stream=1) is not None
    assert block.__dlpack__(stream=2) is not None  # per-thread default stream
    with pytest.raises(TypeError):
        block.__dlpack__(max_version=3)


def test_reprs(block):
    assert repr(block).startswith("<gpuipc.Block shape=(2, 3, 4) dtype=float32 nbytes=")
    pool = gpuipc.Pool(kind="legacy")
    buf = pool.alloc(shape=(5,), dtype="int8")
    assert repr(buf) == "<gpuipc.Buffer shape=(5,) dtype=int8 kind=legacy>"
    buf.close()
    assert repr(buf).endswith("closed>")


def test_cuda_array_interface(block):
    cai = block.__cuda_array_interface__
    assert cai["version"] == 3 and cai["typestr"] == "<f4" and cai["shape"] == (2, 3, 4)
    assert cai["data"] == (block.ptr, False) and cai["strides"] is None
    assert cai["stream"] == 1
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    bf = a.alloc(shape=(4,), dtype="bfloat16")
    assert not hasattr(bf, "__cuda_array_interface__")  # no typestr: DLPack only
    assert bf.__dlpack__() is not None
    bf.free()
    block.free()
    with pytest.raises(ValueError):
        block.__cuda_array_interface__
    with pytest.raises(ValueError):
        block.__dlpack__()


def test_opaque_cai_typestr_is_read_through_dlpack():
    """torch gives bfloat16 a CAI whose typestr is "<V2" (two raw bytes):
    such an array is read through __dlpack__, which names the dtype; one
    with that typestr and no DLPack is refused with the typestr named."""
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    bf = a.alloc(shape=(4, 2), dtype="bfloat16")
    drv().htod(bf.ptr, pattern(bf.nbytes, 9))

    class Bf16Like:
        dl = True

        @property
        def __cuda_array_interface__(self):
            return {"shape": (4, 2), "typestr": "<V2", "data": (bf.ptr, False),
                    "strides": None, "version": 3}

        def __dlpack__(self, **kw):
            if not self.dl:
                raise AssertionError("unreachable")
            return bf.__dlpack__(**kw)

        def __dlpack_device__(self):
            return bf.__dlpack_device__()

    ts = gpuipc.TensorSet.from_dict({"w": Bf16Like()})
    v = ts.tensors()["w"]
    assert v.dtype == "bfloat16" and v.shape == (4, 2) and v.ptr == bf.ptr
    ts.destroy()

    class OpaqueOnly:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<V2",
                                    "data": (bf.ptr, False), "version": 3}

    with pytest.raises(TypeError, match="typestr <V2"):
        gpuipc.TensorSet.from_dict({"w": OpaqueOnly()})
    bf.free()


def test_numpy_reads_pinned_host_buffer_through_dlpack():
    np = pytest.importorskip("numpy")
    if not hasattr(np, "from_dlpack"):
        pytest.skip("numpy without from_dlpack")
    pool = gpuipc.Pool(kind="pinned-host")
    buf = pool.alloc(shape=(4, 8), dtype="int32")
    assert buf.__dlpack_device__() == (3, 0)  # kDLCUDAHost
    data = np.arange(32, dtype=np.int32).tobytes()
    drv().htod(buf.ptr, data)

    class AsHost:
        """numpy takes kDLCPU only: ask for the host view of pinned memory."""
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, stream=None, **kw):
            return buf.__dlpack__(dl_device=(1, 0))

    r0 = refs()
    arr = np.from_dlpack(AsHost())
    assert arr.shape == (4, 8) and arr.dtype == np.int32
    assert arr.tobytes() == data
    assert refs() == r0 + 1
    del arr
    gc.collect()
    assert refs() == r0, "numpy's deleter call did not drop the reference"
    buf.close()


def test_received_buffer_protocols():
    import peers_dl
    with gpuipc.spawn(peers_dl.send_one) as p:
        rx = p.conn.recv(timeout=30)
        assert rx.shape == (8, 8) and rx.dtype == "int64" and rx.meta == b"dl"
        assert rx.__dlpack_device__() == (2, rx.device)
        assert drv().dtoh(rx.ptr, rx.nbytes) == pattern(512, 6)
        r0 = refs()
        cap = rx.__dlpack__(stream=-1, max_version=(1, 0))
        f, delete = consume(cap, True)
        assert f["shape"] == [8, 8] and f["dtype"] == (0, 64, 1) and f["data"] == rx.ptr
        del cap
        rx_id = rx.id
        del rx
        gc.collect()
        assert p.conn.outstanding()[1] == 1  # the consumer's view keeps the lease
        delete()
        assert refs() == r0
        assert p.conn.outstanding()[1] == 0, "lease not released with the last view"
        assert rx_id >= 0
        p.conn.send_msg(b"go")
        assert p.join(30) == 0


def test_dlpack_device_not_a_tuple_is_a_type_error(block):
    """dl_device must be a (type, id) tuple: anything else is TypeError
    (it was SystemError from the argument parser)."""
    for bad in ([2, 0], "cuda", 2, (2,), (2, 0, 0)):
        with pytest.raises(TypeError):
            block.__dlpack__(dl_device=bad)


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_view_of_received_buffer_outlives_close(versioned):
    """The README's pattern: a tensor made from a Received (DLPack) outlives
    the `with connect()` block. The close must leave its memory mapped until
    the view dies; then the buffer is released and the connection ends."""
    import peers_dl
    with gpuipc.spawn(peers_dl.send_one_until_end) as p:
        rx = p.conn.recv(timeout=30)
        kw = {"max_version": (1, 0)} if versioned else {}
        f, delete = consume(rx.__dlpack__(stream=-1, **kw), versioned)
        del rx
        gc.collect()
        p.conn.close()
        assert p.conn.closed
        with pytest.raises(gpuipc.ClosedError):
            p.conn.recv(timeout=0)
        assert drv().dtoh(f["data"], 512) == pattern(512, 6), "the view's memory changed"
        delete()  # the last view: the release, then the connection's end
        assert p.join(30) == 0, "the producer did not get its block back"


def test_cai_view_of_received_buffer_outlives_close():
    """A CUDA Array Interface consumer keeps the Received itself: the memory
    stays mapped past the close until it is released (or dies)."""
    import peers_dl
    with gpuipc.spawn(peers_dl.send_one_until_end) as p:
        rx = p.conn.recv(timeout=30)
        cai = rx.__cuda_array_interface__
        p.conn.close()
        assert rx.held
        assert drv().dtoh(cai["data"][0], 512) == pattern(512, 6)
        assert rx.__cuda_array_interface__["data"] == cai["data"]
        rx.release()
        assert not rx.held
        assert p.join(30) == 0, "the producer did not get its block back"


def test_view_alive_at_exit_leaks_nothing():
    """A consumer that closes its connection and exits with a view still
    alive reads the data through it after the close, and its exit gives the
    producer's block back."""
    import peers_dl
    name = f"pyt-dl-{os.getpid()}"
    with gpuipc.listen(name, timeout=30) as lst:
        with gpuipc.spawn(peers_dl.view_past_close, name, timeout=60) as p:
            with lst.accept(timeout=30) as c:
                a = gpuipc.Arena(chunk_bytes=1 << 20)
                b = a.alloc(shape=(8, 8), dtype="int64")
                drv().htod(b.ptr, pattern(512, 6))
                c.send(b)
                assert p.join(30) == 0, "the view did not read the data after the close"
                with pytest.raises(gpuipc.Error):
                    c.recv_msg(timeout=10)  # the consumer's end
                with pytest.raises(gpuipc.PeerGoneError):
                    c.progress()  # what the dead peer held comes back here
                assert b.holders == 0, "the exited consumer's lease was not reclaimed"
