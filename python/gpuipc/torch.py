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
small server of this process (a gpuipc listener and one thread) and, for
memory that needs no file descriptor (PyTorch's default allocator), puts in
the pickle the tensor's gpuipc descriptor (plain bytes: shape, dtype,
strides, the memory's handle) and an interprocess event recorded on the
producer's stream. Unpickling (q.get) opens the descriptor (served by the
import cache after the first tensor of an allocation), makes the
consumer's current stream wait for that event, tells the producer's server
that it holds the tensor (one message, no reply awaited) and returns a
torch.from_dlpack view. When the view is freed, the consumer records an
event on its current stream and tells the server, which orders the tensor's
stream after it and lets the tensor go. Memory that needs a file
descriptor (expandable segments) goes the other way: the pickle carries a
token, the consumer asks the server for it and receives the tensor over a
gpuipc connection as a leased buffer. Either way, a consumer that dies
gives the producer's memory back once its process is gone (PyTorch's own
path leaks it).

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
import weakref

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


def _carrier(tensor):
    """(tensor to send, dtype name to restore): the CUDA array interface
    cannot name some dtypes (bfloat16, the float8 kinds: torch writes
    "<V2"), so those travel viewed as the unsigned integer of their size
    (same bytes, shape and strides) and the consumer views them back."""
    import torch

    name = str(tensor.dtype).rsplit(".", 1)[-1]
    if name == "bfloat16" or name.startswith("float8"):
        carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                   8: torch.int64}[tensor.element_size()]
        return tensor.view(carrier), name
    return tensor, None


def _restore(t, real):
    if real is None:
        return t
    import torch

    return t.view(getattr(torch, real))


def _reduce_tensor(tensor):
    import torch

    if (not tensor.is_cuda or tensor.requires_grad or type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided or tensor.numel() == 0):
        return _torch_reduce(tensor)
    srv = _get_server()
    dev = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(dev).cuda_stream
    sent, real = _carrier(tensor)
    shared = srv.offer_shared(sent, stream, dev)
    if shared is not None:
        token, desc, ev_desc = shared
        return (_rebuild_shared, (srv.name, token, os.getpid(), desc, ev_desc, real))
    token = srv.offer(sent, stream)
    return (_rebuild, (srv.name, token, os.getpid(), real))


# ---- the consumer's side --------------------------------------------------

_peer_events = {}  # event descriptor -> opened gpuipc.Event
_own_events = {}  # device ordinal -> (gpuipc.Event, its descriptor)
_events_lock = threading.Lock()


def _peer_event(desc):
    with _events_lock:
        ev = _peer_events.get(desc)
        if ev is None:
            ev = _peer_events[desc] = gpuipc.Event.open(desc)
        return ev


def _own_event(dev):
    with _events_lock:
        e = _own_events.get(dev)
        if e is None:
            ev = gpuipc.Event(device=dev)
            e = _own_events[dev] = (ev, ev.export())
        return e


def _open_shared(name, token, producer_pid, desc, ev_desc, stream_of):
    """Opens a tensor pickled by descriptor: the Buffer, ordered on
    stream_of(device) after the producer's work; the producer hears that
    it is held now, and when the Buffer goes, that it may be reused after
    the work then queued on stream_of(device)."""
    buf = gpuipc.open(desc)
    dev = buf.__dlpack_device__()[1]
    _peer_event(ev_desc).wait(stream=stream_of(dev))
    cl = _client(name)
    with cl.lock:
        cl.conn.send_msg(b"H" + token, timeout=FETCH_TIMEOUT)
    fin = weakref.finalize(buf, _done, name, token, dev, stream_of)
    fin.atexit = False  # at exit the connection's end says it
    return buf


def _done(name, token, dev, stream_of):
    try:
        ev, ev_desc = _own_event(dev)
        ev.record(stream=stream_of(dev))
        cl = _client(name)
        with cl.lock:
            cl.conn.send_msg(b"D" + token + ev_desc, timeout=FETCH_TIMEOUT)
    except Exception:  # the producer is gone: nothing to tell
        pass


def _rebuild_shared(name, token, producer_pid, desc, ev_desc, real=None):
    import torch

    buf = _open_shared(name, token, producer_pid, desc, ev_desc,
                       lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _restore(torch.from_dlpack(buf), real)


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


def _rebuild(name, token, producer_pid, real=None):
    import torch

    # recv on the current stream of the current device: the view's users
    # on that stream run after the producer's work.
    dev = torch.cuda.current_device()
    rx = _fetch(name, token, producer_pid, torch.cuda.current_stream(dev).cuda_stream)
    if rx.device != dev:
        with torch.cuda.device(rx.device):
            return _restore(torch.from_dlpack(rx), real)
    return _restore(torch.from_dlpack(rx), real)


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
        self.held = {}  # Connection -> {token: (obj, stream, shared)}
        self.dead = []  # (pid, items): held by a closed connection's peer
        self.events = {}  # (device, stream) -> (gpuipc.Event, descriptor)
        self.peer_events = {}  # a consumer's event descriptor -> opened Event
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="gpuipc.torch", daemon=True)
        self.thread.start()

    def offer(self, tensor, stream):
        token = next(self.counter).to_bytes(8, "little") + secrets.token_bytes(8)
        with self.lock:
            self.pending[token] = (tensor, stream)
        return token

    def offer_shared(self, obj, stream, dev):
        """Registers obj for the descriptor route: (token, descriptor,
        event descriptor), the event recorded on stream now; None when its
        memory needs a file descriptor (then use offer)."""
        shared = gpuipc.share(obj)
        if shared.fds:
            shared.close()
            return None
        with self.lock:
            e = self.events.get((dev, stream))
            if e is None:
                ev = gpuipc.Event(device=dev)
                e = self.events[(dev, stream)] = (ev, ev.export())
            e[0].record(stream=stream)
            token = next(self.counter).to_bytes(8, "little") + secrets.token_bytes(8)
            self.pending[token] = (obj, stream, shared)
        return token, shared.desc, e[1]

    def pending_count(self):
        with self.lock:
            return len(self.pending)

    def held_count(self):
        with self.lock:
            n = sum(len(h) for h in self.held.values())
            n += sum(len(items) for _, items in self.dead)
        return n + sum(c.wrapped_pending for c in list(self.conns.values()))

    def _run(self):
        sel = selectors.DefaultSelector()
        sel.register(self.listener.fileno(), selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select(timeout=0.5):
                if key.data is None:
                    try:
                        # Never waits: a client that connects and stays
                        # silent must not hold up the others' requests.
                        c = self.listener.accept(timeout=0)
                    except gpuipc.Error:
                        continue
                    self.conns[c.fileno()] = c
                    sel.register(c.fileno(), selectors.EVENT_READ, c)
                else:
                    if not self._serve(key.data):
                        fd = key.fd
                        sel.unregister(fd)
                        self.conns.pop(fd, None)
                        self._peer_left(key.data)
                        key.data.close()
            gpuipc.collect()  # leases of connections closed before their peer exited
            self._reap_dead()
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
                if m[:1] == b"H":  # a consumer opened a tensor: it holds it now
                    with self.lock:
                        item = self.pending.pop(m[1:17], None)
                        if item is not None:
                            self.held.setdefault(c, {})[m[1:17]] = item
                    continue
                if m[:1] == b"D":  # ... and let it go after its event
                    self._release(c, m[1:17], m[17:])
                    continue
                if m[:1] != b"G":
                    c.send_msg(b"ERR unknown request")
                    continue
                with self.lock:
                    item = self.pending.pop(m[1:], None)
                if item is None:
                    c.send_msg(b"ERR unknown tensor (fetched already, or not from this "
                               b"process)")
                    continue
                tensor, stream = item[0], item[1]
                c.send_msg(b"OK")
                c.send(tensor, stream=stream)
                del tensor, item
        except (gpuipc.PeerGoneError, gpuipc.ClosedError, gpuipc.ProtocolError):
            return False

    def _release(self, c, token, ev_desc):
        with self.lock:
            item = self.held.get(c, {}).pop(token, None)
        if item is None:
            return
        obj, stream, shared = item
        try:
            ev = self.peer_events.get(ev_desc)
            if ev is None:
                ev = self.peer_events[ev_desc] = gpuipc.Event.open(ev_desc)
            ev.wait(stream=stream)  # reuse after the consumer's work on it
        except gpuipc.Error:
            # No ordering possible: keep the memory until the peer exits.
            with self.lock:
                self.dead.append((c.peer[0], {token: item}))
            return
        shared.close()
        del obj, item

    def _peer_left(self, c):
        with self.lock:
            items = self.held.pop(c, None)
            if items:
                try:
                    pid = c.peer[0]
                except gpuipc.Error:
                    pid = -1
                self.dead.append((pid, items))

    def _reap_dead(self):
        with self.lock:
            if not self.dead:
                return
            alive = [_pid_running(d[0]) for d in self.dead]
            gone = [d for d, a in zip(self.dead, alive) if not a]
            self.dead = [d for d, a in zip(self.dead, alive) if a]
        for _, items in gone:
            for obj, stream, shared in items.values():
                shared.close()
        del gone


def _pid_running(pid):
    """Whether pid still runs (a zombie does not: its GPU work is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


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
