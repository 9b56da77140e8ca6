"""Shared pieces of the interop scripts: the gpuipc peer process, the
pattern, timing summaries, and a minimal ctypes binding of the CUDA driver.

The peer is the gpuipc test binary run as `gpuipc-tests --helper
interop_py_peer`; it reads one text command per SOCK_SEQPACKET message
(tests/test-interop-python.c documents the commands) and answers one.
"""

import array
import ctypes
import os
import socket
import statistics
import subprocess
import sys
import time

SKIP = 77


def skip(why):
    print(f"SKIP: {why}", flush=True)
    sys.exit(SKIP)


def fail(why):
    print(f"FAIL: {why}", flush=True)
    sys.exit(1)


def pattern(n, seed):
    """byte i = (seed + 7 i) mod 256, as the peer writes and checks it."""
    return bytes((seed + 7 * i) & 0xFF for i in range(256)) * (n // 256) + bytes(
        (seed + 7 * i) & 0xFF for i in range(n % 256)
    )


class Peer:
    """The gpuipc side: a child process and a SOCK_SEQPACKET socket to it."""

    def __init__(self, exe):
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["GPUIPC_TEST_HELPER_FD"] = str(theirs.fileno())
        self.proc = subprocess.Popen(
            [exe, "--helper", "interop_py_peer"],
            env=env,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.sock.settimeout(15)

    def call(self, text, fd=None):
        """Sends a command (with an fd), returns (reply words, fd or None)."""
        data = text.encode()
        if fd is None:
            self.sock.sendmsg([data])
        else:
            self.sock.sendmsg(
                [data],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
            )
        msg, anc, _flags, _addr = self.sock.recvmsg(
            4096, socket.CMSG_SPACE(array.array("i").itemsize)
        )
        got = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                got = fds[0] if len(fds) else None
        if not msg:
            fail(f"peer closed the connection after: {text[:60]}")
        words = msg.decode().split()
        if words[0] == "err":
            fail(f"peer: {msg.decode()} (after: {text[:60]}...)")
        return words, got

    def close(self):
        try:
            self.call("quit")
        except OSError:
            pass
        self.sock.close()
        try:
            rc = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("the peer did not exit")
        if rc != 0:
            fail(f"the peer exited with {rc}")


class Costs:
    """Per-buffer costs of one direction, printed as medians."""

    def __init__(self, direction):
        self.direction = direction
        self.cols = {}

    def add(self, name, seconds):
        self.cols.setdefault(name, []).append(seconds)

    def report(self):
        parts = []
        n = 0
        for name, xs in self.cols.items():
            n = max(n, len(xs))
            parts.append(f"{name} {statistics.median(xs) * 1e6:.1f} us")
        print(f"COST {self.direction}: {n} buffers, median per buffer: " + ", ".join(parts),
              flush=True)


def now():
    return time.perf_counter()


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle / CUipcEventHandle: 64 opaque bytes, passed by value."""
    _fields_ = [("reserved", ctypes.c_char * 64)]


class Driver:
    """A few CUDA driver calls through ctypes (libcuda.so.1, or the library
    GPUIPC_CUDA_DRIVER names), for what neither CuPy nor cuda.core offer in
    public: cuMemGetAddressRange, and plain copies for checks."""

    def __init__(self):
        name = os.environ.get("GPUIPC_CUDA_DRIVER") or "libcuda.so.1"
        self.lib = ctypes.CDLL(name)
        self._check(self.lib.cuInit(0), "cuInit")

    def _check(self, r, what):
        if r != 0:
            fail(f"{what}: CUresult {r}")

    def make_current(self, ordinal=0):
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def uuid_hex(self, ordinal=0):
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        buf = (ctypes.c_ubyte * 16)()
        fn = getattr(self.lib, "cuDeviceGetUuid_v2", None) or self.lib.cuDeviceGetUuid
        self._check(fn(buf, dev), "cuDeviceGetUuid")
        return bytes(buf).hex()

    def address_range(self, ptr):
        base = ctypes.c_uint64()
        size = ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
            "cuMemGetAddressRange")
        return base.value, size.value

    def htod(self, ptr, data):
        self._check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(ptr), data,
                                             ctypes.c_size_t(len(data))),
                    "cuMemcpyHtoD")
        self._check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def dtoh(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        self._check(self.lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(ptr),
                                             ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return buf.raw

    def alloc(self, n):
        p = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)),
                    "cuMemAlloc")
        return p.value

    def free(self, p):
        self._check(self.lib.cuMemFree_v2(ctypes.c_uint64(p)), "cuMemFree")

    def ipc_get(self, ptr):
        h = IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(ptr)),
                    "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), 64)

    def ipc_open(self, handle):
        p = ctypes.c_uint64()
        h = IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, 64)
        fn = getattr(self.lib, "cuIpcOpenMemHandle_v2", None) or self.lib.cuIpcOpenMemHandle
        # The handle is a struct passed by value; flags 1 is
        # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle, ctypes.c_uint]
        self._check(fn(ctypes.byref(p), h, 1), "cuIpcOpenMemHandle")
        return p.value

    # ---- stream-ordered memory pools with POSIX fd export -------------------

    def pool_create(self, ordinal=0):
        # CUmemPoolProps: allocType PINNED (1), handleTypes POSIX_FD (1),
        # location {DEVICE (1), ordinal}; the rest zero.
        props = (ctypes.c_ubyte * 256)()
        ints = (ctypes.c_int * 4).from_buffer(props)
        ints[0], ints[1], ints[2], ints[3] = 1, 1, 1, ordinal
        pool = ctypes.c_void_p()
        self._check(self.lib.cuMemPoolCreate(ctypes.byref(pool), props), "cuMemPoolCreate")
        return pool

    def pool_alloc(self, pool, n):
        p = ctypes.c_uint64()
        self._check(self.lib.cuMemAllocFromPoolAsync(ctypes.byref(p), ctypes.c_size_t(n),
                                                     pool, None), "cuMemAllocFromPoolAsync")
        self._check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")
        return p.value

    def pool_free(self, p):
        self._check(self.lib.cuMemFreeAsync(ctypes.c_uint64(p), None), "cuMemFreeAsync")
        self._check(self.lib.cuStreamSynchronize(None), "cuStreamSynchronize")

    def pool_export_fd(self, pool):
        fd = ctypes.c_int(-1)
        self._check(self.lib.cuMemPoolExportToShareableHandle(ctypes.byref(fd), pool, 1, 0),
                    "cuMemPoolExportToShareableHandle")
        return fd.value

    def pool_export_pointer(self, p):
        data = (ctypes.c_ubyte * 64)()
        self._check(self.lib.cuMemPoolExportPointer(data, ctypes.c_uint64(p)),
                    "cuMemPoolExportPointer")
        return bytes(data)

    def pool_import(self, fd, ordinal=0):
        pool = ctypes.c_void_p()
        self._check(self.lib.cuMemPoolImportFromShareableHandle(
            ctypes.byref(pool), ctypes.c_void_p(fd), 1, 0),
            "cuMemPoolImportFromShareableHandle")
        # CUmemAccessDesc: location {DEVICE (1), ordinal}, flags READWRITE (3).
        desc = (ctypes.c_int * 3)(1, ordinal, 3)
        self._check(self.lib.cuMemPoolSetAccess(pool, desc, ctypes.c_size_t(1)),
                    "cuMemPoolSetAccess")
        return pool

    def pool_import_pointer(self, pool, data):
        p = ctypes.c_uint64()
        d = (ctypes.c_ubyte * 64).from_buffer_copy(data)
        self._check(self.lib.cuMemPoolImportPointer(ctypes.byref(p), pool, d),
                    "cuMemPoolImportPointer")
        return p.value

    def ipc_close(self, ptr):
        self._check(self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")
