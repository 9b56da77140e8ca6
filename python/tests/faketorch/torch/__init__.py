"""A stand-in for torch, for the tests of recv(as_torch=True) on the CUDA
driver emulator (where the real torch cannot run: it loads libcuda.so.1
itself). It has only what gpuipc's C glue looks up when the DLPack C
exchange API is absent: torch._C._from_dlpack (a Tensor that keeps the
capsule, so the DLPack tensor, and the lease behind it, lives exactly as
long as the Tensor), torch._C._cuda_getCurrentRawStream and
torch._C._cuda_getDevice. The tests put this directory first on sys.path
only where the real torch is not importable."""
import collections
import ctypes

FAKE = True
calls = collections.deque(maxlen=64)  # the last calls: ("from_dlpack",), ("stream", dev), ("device",)
current_stream = [0]  # what _cuda_getCurrentRawStream returns (0: the legacy stream)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_get = ctypes.pythonapi.PyCapsule_GetPointer
_get.restype = ctypes.c_void_p
_get.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Tensor:
    """What _from_dlpack made: the capsule (kept), and what it said."""

    def __init__(self, cap):
        t = _DLTensor.from_address(_get(cap, b"dltensor"))
        self._cap = cap
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else None
        self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
        self.device = (t.device.device_type, t.device.device_id)
        self._ptr = t.data + t.byte_offset

    def data_ptr(self):
        return self._ptr


class _C:
    @staticmethod
    def _from_dlpack(cap):
        calls.append(("from_dlpack",))
        return Tensor(cap)

    @staticmethod
    def _cuda_getCurrentRawStream(dev):
        calls.append(("stream", dev))
        return current_stream[0]

    @staticmethod
    def _cuda_getDevice():
        calls.append(("device",))
        return 0


# --- the DLPack C exchange API (DLPack 1.3), when FAKETORCH_EXCHANGE=1 ---------
# A table of C function pointers made with ctypes, as a capsule named
# "dlpack_exchange_api" on Tensor, the way torch 2.10+ offers it:
# managed_tensor_to_py_object_no_sync makes a VTensor that owns the
# DLManagedTensorVersioned (its deleter runs when the VTensor dies), and
# current_work_stream answers current_stream[0].

class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class VTensor:
    """What managed_tensor_to_py_object_no_sync made."""

    def __init__(self, addr):
        m = _DLManagedTensorVersioned.from_address(addr)
        t = m.dl_tensor
        self._addr, self._deleter = addr, m.deleter
        self.version = (m.major, m.minor)
        self.shape = tuple(t.shape[i] for i in range(t.ndim))
        self.dtype = (t.dtype.code, t.dtype.bits, t.dtype.lanes)
        self.device = (t.device.device_type, t.device.device_id)
        self._ptr = t.data + t.byte_offset

    def data_ptr(self):
        return self._ptr

    def __del__(self):
        if self._deleter:
            _DELETER(self._deleter)(self._addr)


_TO_PY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32,
                           ctypes.POINTER(ctypes.c_void_p))


@_TO_PY
def _to_py(addr, out):
    calls.append(("exchange_to_py",))
    obj = VTensor(addr)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    out[0] = id(obj)
    return 0


@_STREAM
def _work_stream(dev_type, dev, out):
    calls.append(("exchange_stream", dev))
    out[0] = current_stream[0] or None
    return 0


class _Api(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("prev_api", ctypes.c_void_p), ("allocator", ctypes.c_void_p),
                ("from_py", ctypes.c_void_p), ("to_py", _TO_PY), ("dltensor_from_py", ctypes.c_void_p),
                ("current_work_stream", _STREAM)]


if __import__("os").environ.get("FAKETORCH_EXCHANGE") == "1":
    _api = _Api(1, 3, None, None, None, _to_py, None, _work_stream)
    _new = ctypes.pythonapi.PyCapsule_New
    _new.restype = ctypes.py_object
    _new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    # A capsule keeps the pointer to its name: the name lives as long as it.
    _api_name = ctypes.create_string_buffer(b"dlpack_exchange_api")
    Tensor.__dlpack_c_exchange_api__ = _new(ctypes.addressof(_api), ctypes.addressof(_api_name),
                                            None)
