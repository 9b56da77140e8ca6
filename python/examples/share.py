#!/usr/bin/env python3
"""share.py: the README's Python example. A parent hands GPU memory to a
child process it starts; the child sees it in place, with its shape,
dtype and the parent's meta bytes.

    PYTHONPATH=python python3 python/examples/share.py

Needs no framework; with torch or CuPy, the child's torch.from_dlpack(rx)
or cupy.from_dlpack(rx) is a view of the parent's memory.
"""
import gpuipc


def child(conn):                           # runs in a new process
    with conn.recv(timeout=10) as rx:      # the parent's GPU memory, mapped here
        print("child got", rx.shape, rx.dtype, rx.meta)
        # torch.from_dlpack(rx), cupy.from_dlpack(rx): views of it, no copy


if __name__ == "__main__":
    block = gpuipc.Arena().alloc(shape=(3, 4), dtype="float32")  # or a torch / CuPy array
    with gpuipc.spawn(child) as p:
        p.conn.send(block, meta=b"hello")
        p.join()
