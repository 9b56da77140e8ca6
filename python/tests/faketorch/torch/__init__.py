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
