"""gpuipc.torch: CUDA tensors through torch.multiprocessing, by gpuipc.

    import gpuipc.torch
    gpuipc.torch.install()      # in every process that puts CUDA tensors
    q = torch.multiprocessing.get_context("spawn").Queue()
    q.put(cuda_tensor)          # the consumer's q.get() gives a view of it

install() registers reducers with multiprocessing.reduction.ForkingPickler
for CUDA tensors (torch.Tensor; Parameters and tensors that require grad
keep PyTorch's own path), so that the user's code stays unchanged;
uninstall() puts PyTorch's reducers back. Nothing is patched at import.

How a tensor travels. Pickling it (q.put) registers the tensor with a
small server of this process (a gpuipc listener and one thread) and puts
only its name and a token in the pickle. Unpickling (q.get, in the
consumer) connects to that server once per producer, asks for the token,
and receives the tensor as a gpuipc buffer (stream-ordered: the consumer's
current stream waits for the producer's work on the stream current at
put time), viewed with torch.from_dlpack. The consumer's view holds a lease:
when it is freed the producer's memory is released to it (the producer keeps
the tensor alive until then), and when the consumer dies the lease ends
with it, so the producer's memory comes back (PyTorch's own path leaks it).

Streams: the send is ordered after the work queued on the stream that is
current when the tensor is pickled, in the thread that pickles it (a
multiprocessing Queue pickles in its feeder thread, where the current
stream is the default one): work on other streams must be synchronized
first, as with PyTorch's own path.

Pickled tensors are one-shot, as PyTorch's CUDA tensors in a Queue are:
each pickle is unpickled once. A token never fetched keeps its tensor
alive in the producer until the producer exits.
"""
import itertools
import os
import secrets
import selectors
import threading

import gpuipc

_saved = None  # type -> PyTorch's reducer, while installed
_server = None
_server_lock = threading.Lock()
_clients = {}
_clients_lock = threading.Lock()

# How long a consumer waits for its producer to answer (seconds).
FETCH_TIMEOUT = 60.0


def installed():
    return _saved is not None


def install():
    """Sends CUDA tensors put on torch.multiprocessing queues (and anything
    pickled with ForkingPickler) through gpuipc. Idempotent."""
    global _saved
    import multiprocessing.reduction as mpr

    import torch
    import torch.multiprocessing  # noqa: F401  registers PyTorch's reducers first

    if _saved is not None:
        return
    types = {torch.Tensor}
    types.update(getattr(torch, "_tensor_classes", ()))
    saved = {}
    for t in types:
        saved[t] = mpr.ForkingPickler._extra_reducers.get(t)
        mpr.ForkingPickler.register(t, _reduce_tensor)
    _saved = saved


def uninstall():
    """Puts PyTorch's reducers back. Tensors already pickled still arrive."""
    global _saved
    import multiprocessing.reduction as mpr

    if _saved is None:
        return
    for t, r in _saved.items():
        if r is None:
            mpr.ForkingPickler._extra_reducers.pop(t, None)
        else:
            mpr.ForkingPickler.register(t, r)
    _saved = None


def _torch_reduce(tensor):
    from torch.multiprocessing import reductions

    r = (_saved or {}).get(type(tensor)) or reductions.reduce_tensor
    return r(tensor)


def _reduce_tensor(tensor):
    import torch

    if (not tensor.is_cuda or tensor.requires_grad or type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided or tensor.numel() == 0):
        return _torch_reduce(tensor)
    srv = _get_server()
    stream = torch.cuda.current_stream(tensor.device).cuda_stream
    token = srv.offer(tensor, stream)
    return (_rebuild, (srv.name, token, os.getpid()))


def _fetch(name, token, producer_pid, stream):
    """Asks the producer's server for a token's tensor: a Received ordered
    on stream."""
    cl = _client(name)
    with cl.lock:
        conn = cl.conn
        conn.send_msg(b"G" + token, timeout=FETCH_TIMEOUT)
        reply = conn.recv_msg(timeout=FETCH_TIMEOUT)
        if reply != b"OK":
            raise RuntimeError(f"gpuipc.torch: producer pid {producer_pid} could not hand "
                               f"over the tensor: {reply.decode(errors='replace')}")
        return conn.recv(stream=stream, timeout=FETCH_TIMEOUT)


def _rebuild(name, token, producer_pid):
    import torch

    # recv on the current stream of the current device: the view's users
    # on that stream run after the producer's work.
    dev = torch.cuda.current_device()
    rx = _fetch(name, token, producer_pid, torch.cuda.current_stream(dev).cuda_stream)
    if rx.device != dev:
        with torch.cuda.device(rx.device):
            return torch.from_dlpack(rx)
    return torch.from_dlpack(rx)


class _Client:
    def __init__(self, name):
        self.conn = gpuipc.connect(name, timeout=FETCH_TIMEOUT)
        self.lock = threading.Lock()


def _client(name):
    with _clients_lock:
        cl = _clients.get(name)
        if cl is None or cl.conn.closed:
            cl = _clients[name] = _Client(name)
        return cl


class _Server:
    """This process's side of the tensors it pickled: a listener, and a
    thread that answers fetches and processes releases."""

    def __init__(self):
        self.name = f"torch-{os.getpid()}-{secrets.token_hex(4)}"
        self.listener = gpuipc.listen(self.name, timeout=10)
        self.pending = {}
        self.lock = threading.Lock()
        self.counter = itertools.count(1)
        self.conns = {}
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="gpuipc.torch", daemon=True)
        self.thread.start()

    def offer(self, tensor, stream):
        token = next(self.counter).to_bytes(8, "little") + secrets.token_bytes(8)
        with self.lock:
            self.pending[token] = (tensor, stream)
        return token

    def pending_count(self):
        with self.lock:
            return len(self.pending)

    def held_count(self):
        return sum(c.wrapped_pending for c in list(self.conns.values()))

    def _run(self):
        sel = selectors.DefaultSelector()
        sel.register(self.listener.fileno(), selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select(timeout=0.5):
                if key.data is None:
                    try:
                        c = self.listener.accept(timeout=5)
                    except gpuipc.Error:
                        continue
                    self.conns[c.fileno()] = c
                    sel.register(c.fileno(), selectors.EVENT_READ, c)
                else:
                    if not self._serve(key.data):
                        fd = key.fd
                        sel.unregister(fd)
                        self.conns.pop(fd, None)
                        key.data.close()
            gpuipc.collect()  # leases of connections closed before their peer exited
            # releases of consumers that went quiet
            for fd, c in list(self.conns.items()):
                if c.wrapped_pending:
                    try:
                        c.progress(0)
                    except gpuipc.Error:
                        pass

    def _serve(self, c):
        """Answers every fetch waiting on c; False once c is finished."""
        try:
            c.progress(0)
            while True:
                try:
                    m = c.recv_msg(timeout=0)
                except gpuipc.TimeoutError:
                    return True
                if m[:1] != b"G":
                    c.send_msg(b"ERR unknown request")
                    continue
                with self.lock:
                    item = self.pending.pop(m[1:], None)
                if item is None:
                    c.send_msg(b"ERR unknown tensor (fetched already, or not from this "
                               b"process)")
                    continue
                tensor, stream = item
                c.send_msg(b"OK")
                c.send(tensor, stream=stream)
                del tensor, item
        except (gpuipc.PeerGoneError, gpuipc.ClosedError, gpuipc.ProtocolError):
            return False


def _get_server():
    global _server
    with _server_lock:
        if _server is None or _server.pid != os.getpid():
            _server = _Server()
        return _server


def stats():
    """What this process's server holds: tensors pickled and not fetched
    yet ('pending'), tensors consumers hold now ('held')."""
    s = _server
    if s is None or s.pid != os.getpid():
        return {"pending": 0, "held": 0}
    return {"pending": s.pending_count(), "held": s.held_count()}
