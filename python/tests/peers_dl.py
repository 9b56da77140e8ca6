"""Child sides of test_dlpack's received-buffer tests."""
import gpuipc
from cudrv import drv, pattern


def send_one(conn):
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(shape=(8, 8), dtype="int64")
    drv().htod(b.ptr, pattern(512, 6))
    conn.send(b, meta=b"dl")
    conn.recv_msg(timeout=30)


def send_one_until_end(conn):
    """Sends one block, then waits for the parent's end of the connection;
    the exit code says whether the block came back with it (0), or the end
    came while the parent still held it (4)."""
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(shape=(8, 8), dtype="int64")
    drv().htod(b.ptr, pattern(512, 6))
    conn.send(b, meta=b"dl")
    try:
        conn.recv_msg(timeout=30)
    except (gpuipc.ClosedError, gpuipc.PeerGoneError):
        pass
    try:
        conn.progress()  # a release that came before the end
    except (gpuipc.ClosedError, gpuipc.PeerGoneError):
        pass
    return 0 if b.holders == 0 else 4


def view_past_close(conn, name):
    """Connects to the parent, receives one block, makes a DLPack view of
    it, closes the connection and exits with the view alive: exit code 0
    when the view still read the data after the close, 5 when it read
    other bytes (a crash is a signal)."""
    sc = gpuipc.connect(name, timeout=30)
    rx = sc.recv(timeout=30)
    cap = rx.__dlpack__(stream=-1)
    ptr, n = rx.ptr, rx.nbytes
    del rx
    sc.close()
    ok = drv().dtoh(ptr, n) == pattern(n, 6)
    _keep.append(cap)  # alive until the interpreter ends
    return 0 if ok else 5


_keep = []
