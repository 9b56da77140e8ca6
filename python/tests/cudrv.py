"""A few CUDA driver calls through ctypes, on the driver gpuipc uses (the
emulator or the real one), to write and read device memory in tests."""
import ctypes

import gpuipc


class Driver:
    def __init__(self):
        gpuipc.init()
        self.lib = ctypes.CDLL(gpuipc.driver_path())
        self._check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev),
                    "cuDevicePrimaryCtxRetain")

    def _check(self, r, what):
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    def _current(self):
        self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def htod(self, ptr, data):
        self._current()
        self._check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data,
                                             ctypes.c_size_t(len(data))), "cuMemcpyHtoD")
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def dtoh(self, ptr, n):
        self._current()
        buf = ctypes.create_string_buffer(n)
        self._check(self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr), ctypes.c_size_t(n)),
                    "cuMemcpyDtoH")
        return buf.raw

    def alloc(self, n):
        self._current()
        p = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
        return p.value

    def stream(self):
        self._current()
        h = ctypes.c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.byref(h), 1), "cuStreamCreate")
        return h.value

    def htod_async(self, ptr, data, n, stream):
        self._current()
        self._check(self.lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(ptr), data,
                                                  ctypes.c_size_t(n),
                                                  ctypes.c_void_p(stream)), "cuMemcpyHtoDAsync")

    def sync(self, stream):
        self._current()
        self._check(self.lib.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")

    def host_alloc(self, n):
        """Pinned host memory (asynchronous copies from pageable memory are
        synchronous for the host)."""
        self._current()
        p = ctypes.c_void_p()
        self._check(self.lib.cuMemAllocHost_v2(ctypes.byref(p), ctypes.c_size_t(n)),
                    "cuMemAllocHost")
        return p.value

    def free(self, p):
        self._current()
        self._check(self.lib.cuMemFree_v2(ctypes.c_uint64(p)), "cuMemFree")


_drv = None


def drv():
    global _drv
    if _drv is None:
        _drv = Driver()
    return _drv


def pattern(n, seed):
    return bytes((seed + 7 * i) & 0xFF for i in range(256)) * (n // 256) + bytes(
        (seed + 7 * i) & 0xFF for i in range(n % 256))


class DeviceArray:
    """Device memory gpuipc did not allocate (cuMemAlloc), exposing
    __cuda_array_interface__ v3 like a framework's array."""

    def __init__(self, shape, typestr="|u1", strides=None, stream=None):
        self.shape = tuple(shape)
        self.typestr = typestr
        self.itemsize = int(typestr[2:])
        n = self.itemsize
        for s in self.shape:
            n *= s
        self.nbytes = n
        self.ptr = drv().alloc(max(n, 1))
        self.strides = strides
        self.stream = stream

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.typestr, "data": (self.ptr, False),
                "version": 3, "strides": self.strides, "stream": self.stream}

    def __del__(self):
        try:
            drv().free(self.ptr)
        except Exception:
            pass
