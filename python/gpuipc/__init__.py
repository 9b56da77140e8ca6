"""gpuipc: share CUDA device memory between processes on one machine.

Zero-copy views both ways (``__cuda_array_interface__`` v3 and DLPack),
leases that keep memory alive while a peer holds it and bring it back when
the peer dies, and stream-ordered handoff that never blocks either host.

    producer                                  consumer
    l = gpuipc.listen("demo")                 c = gpuipc.connect("demo")
    c = l.accept()                            rx = c.recv()
    c.send(tensor)                            t = torch.from_dlpack(rx)

The objects mirror the C API (include/gpuipc.h): Listener, Connection,
Arena, Block, Pool, Buffer, Event, Received; tensor sets (many named
tensors as one versioned object) are TensorSet and its Subscriber. Errors are gpuipc.Error
subclasses named after the status codes (TimeoutError, PeerGoneError, ...).
Many buffers go as one operation with Connection.send_batch, recv_batch
and gpuipc.release_batch (all or nothing), and one block to many
connections with gpuipc.broadcast (a result per connection). Every call
that may wait releases the GIL and takes ``timeout=`` in seconds (None:
forever).
"""
from . import _gpuipc
from ._gpuipc import *  # noqa: F401,F403  the objects, functions and errors
from ._gpuipc import Arena, Error, Received, errors_by_status  # noqa: F401
from ._spawn import Process, spawn, spawn_workers  # noqa: F401
from .sets import CopyPlan, Subscriber, TensorSet, Version  # noqa: F401

__version__ = _gpuipc.__version__


def error_class(status):
    """The gpuipc.Error subclass raised for a status code (int)."""
    return errors_by_status.get(int(status), Error)


def empty(arena, shape, dtype="float32", *, stream=None):
    """A block of ``arena`` viewed as an array of ``shape`` and ``dtype``:
    ``torch.from_dlpack(gpuipc.empty(arena, (4, 4)))`` is a tensor whose
    sends take the fast path."""
    return arena.alloc(shape=shape, dtype=dtype, stream=stream)


__all__ = [
    "Arena", "Block", "Buffer", "Child", "Connection", "Error", "Event", "Listener",
    "Pool", "Process", "Received", "Shared", "connect", "conn_pair", "device_count",
    "device_uuid", "empty", "from_fd", "init", "listen", "open", "share", "spawn",
    "broadcast", "release_batch", "BATCH_MAX", "BATCH_BYTES_MAX", "BROADCAST_MAX",
    "spawn_workers", "version", "TensorSet", "Subscriber", "Version", "CopyPlan",
]
