"""Child side of test_dlpack's received-buffer test."""
import gpuipc
from cudrv import drv, pattern


def send_one(conn):
    a = gpuipc.Arena(chunk_bytes=1 << 20)
    b = a.alloc(shape=(8, 8), dtype="int64")
    drv().htod(b.ptr, pattern(512, 6))
    conn.send(b, meta=b"dl")
    conn.recv_msg(timeout=30)
