"""gpuipc.torch: CUDA tensors through torch.multiprocessing, by gpuipc.

    import gpuipc.torch
    gpuipc.torch.install()      # in every process that puts CUDA tensors
    q = torch.multiprocessing.get_context("spawn").Queue()
    q.put(cuda_tensor)          # the consumer's q.get() gives a view of it

install() registers reducers with multiprocessing.reduction.ForkingPickler
for CUDA tensors (torch.Tensor; Parameters and tensors that require grad
keep PyTorch's own path), so that the user's code stays unchanged;
uninstall() puts PyTorch's reducers back. Nothing is patched at import.

How a tensor travels. Pickling it (q.put) puts in the pickle the tensor's
gpuipc descriptor (plain bytes: shape, dtype, strides, the memory's handle
and offset; exported per allocation once, each later tensor of the same
allocation re-described with one driver call: Buffer.share_view), a token,
and an interprocess event recorded on the producer's stream. Unpickling
(q.get) opens the descriptor (the import cache keeps a mapping a while
after its last view went, so the next tensor of the same allocation opens
without a driver call), makes the consumer's current stream wait for the
event, and writes "held" into its hold table: shared memory that it gave
the producer once when it first connected (gpuipc.HoldLog). When the last
view is freed, the DLPack deleter (C) records an event of the consumer on
its current stream and writes "released" there. The producer reads the
table when it pickles its next tensor (and now and then in between), makes
the tensor's stream wait for the consumer's event and lets the tensor go.
No message and no thread wake-up per tensor on either side. A consumer
that dies: the producer sees its connection end, reads its table a last
time, and hands what it held to the library, which lets go of it once the
kernel says the process is gone (its peer watcher, from the pidfd taken at
the handshake); PyTorch's own path leaks it. Memory that needs a file
descriptor (expandable segments) goes the other way: the pickle carries a
token, the consumer asks the producer's server for it and receives the
tensor over a gpuipc connection as a leased buffer.

Streams: the send is ordered after the work queued on the stream that is
current when the tensor is pickled, in the thread that pickles it (a
multiprocessing Queue pickles in its feeder thread, where the current
stream is the default one): work on other streams must be synchronized
first, as with PyTorch's own path. The consumer's release is ordered after
the work on its current stream when the last view goes.

Pickled tensors are one-shot, as PyTorch's CUDA tensors in a Queue are:
each pickle is unpickled once. A token never fetched keeps its tensor
alive in the producer until the producer exits.
"""
import itertools
import os
import secrets
import selectors
import threading
import time
import weakref

import gpuipc
from gpuipc import _gpuipc

_saved = None  # type -> PyTorch's reducer, while installed
_server = None
_server_lock = threading.Lock()
_clients = {}
_clients_lock = threading.Lock()

# How long a consumer waits for its producer to answer (seconds).
FETCH_TIMEOUT = 60.0
# Entries of a consumer's hold table (a ring the producer reads).
HOLD_ENTRIES = 4096
# Wrapped allocations a producer keeps for Buffer.share_view.
EXPORTS_MAX = 256
# How often the producer's server reads the hold tables while no tensor is
# pickled (seconds): how late released memory comes back at the latest.
POLL_INTERVAL = 0.05

_raw_stream_fn = None


def _raw_stream(dev):
    """torch's current raw stream of device dev (an int; 0: the legacy
    default stream), without building a torch.cuda.Stream."""
    global _raw_stream_fn
    f = _raw_stream_fn
    if f is None:
        import torch
        f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if f is None:
            def f(d):
                return torch.cuda.current_stream(d).cuda_stream
        _raw_stream_fn = f
    return f(dev)


_from_dlpack_fn = None


def _from_dlpack(buf):
    """A torch tensor viewing buf (already ordered on the current stream)."""
    global _from_dlpack_fn
    f = _from_dlpack_fn
    if f is None:
        import torch
        c = getattr(torch._C, "_from_dlpack", None)
        f = torch.from_dlpack
        if c is not None:
            try:  # the C entry (no Python-level stream handshake) if it takes a capsule
                t = c(buf.__dlpack__())
            except TypeError:
                t = None
            if t is not None:
                _from_dlpack_fn = lambda b: c(b.__dlpack__())  # noqa: E731
                return t
        _from_dlpack_fn = f
    return f(buf)


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


# The dtypes gpuipc's array metadata names (the rest travel viewed as the
# unsigned integer of their size and are viewed back by the consumer).
_NAMED = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "bfloat16", "complex64", "complex128"}
_dtype_specs = {}  # torch dtype -> (gpuipc name, carrier dtype or None, name to restore)


def _dtype_spec(dtype):
    spec = _dtype_specs.get(dtype)
    if spec is None:
        import torch

        name = str(dtype).rsplit(".", 1)[-1]
        if name in _NAMED:
            spec = (name, None, None)
        else:
            size = torch.empty((), dtype=dtype).element_size()
            carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
            spec = (str(carrier).rsplit(".", 1)[-1], carrier, name)
        _dtype_specs[dtype] = spec
    return spec


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
    dev = tensor.get_device()
    stream = _raw_stream(dev)
    name, carrier, real = _dtype_spec(tensor.dtype)
    sent = tensor if carrier is None else tensor.view(carrier)
    st = tensor.untyped_storage()
    # The tensor by its numbers (no __cuda_array_interface__ property call).
    view = (sent.data_ptr(), sent.shape, sent.stride(), name)
    shared = srv.offer_shared(sent, stream, dev, (dev, st.data_ptr(), st.nbytes()), view)
    if shared is not None:
        token, desc, ev_desc = shared
        return (_rebuild_shared, (srv.name, token, srv.pid, desc, ev_desc, real))
    token = srv.offer(sent, stream)
    return (_rebuild, (srv.name, token, srv.pid, real))


# ---- the consumer's side --------------------------------------------------

_peer_events = {}  # event descriptor -> opened gpuipc.Event
_events_lock = threading.Lock()


def _peer_event(desc):
    ev = _peer_events.get(desc)
    if ev is None:
        with _events_lock:
            ev = _peer_events.get(desc)
            if ev is None:
                ev = _peer_events[desc] = gpuipc.Event.open(desc)
    return ev


def _open_shared(name, token, producer_pid, desc, ev_desc, stream_of):
    """Opens a tensor pickled by descriptor: the Buffer, ordered on
    stream_of(device) after the producer's work, entered as held in this
    process's hold table for that producer (released there, after an
    event on stream_of(device), when the Buffer goes)."""
    cl = _client(name, stream_of)
    buf = gpuipc.open(desc)
    dev = buf.__dlpack_device__()[1]
    stream = stream_of(dev)
    _peer_event(ev_desc).wait(stream=stream)
    if cl.log.attach(buf, token, dev, stream) > cl.half:
        cl.nudge()
    return buf


def _rebuild_shared(name, token, producer_pid, desc, ev_desc, real=None):
    buf = _open_shared(name, token, producer_pid, desc, ev_desc, _raw_stream)
    return _restore(_from_dlpack(buf), real)


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
    rx = _fetch(name, token, producer_pid, _raw_stream(dev))
    if rx.device != dev:
        with torch.cuda.device(rx.device):
            return _restore(torch.from_dlpack(rx), real)
    return _restore(torch.from_dlpack(rx), real)


class _Client:
    """This process's connection to one producer's server, and the hold
    table it gave that producer."""

    def __init__(self, name, stream_of):
        self.conn = gpuipc.connect(name, timeout=FETCH_TIMEOUT)
        self.lock = threading.Lock()
        self.log = _gpuipc.HoldLog(HOLD_ENTRIES, stream_of=stream_of)
        self.half = HOLD_ENTRIES // 2
        self.nudged = False
        self.conn.send_msg(b"P", fds=[self.log.fd], timeout=FETCH_TIMEOUT)

    def nudge(self):
        """The table is half full: asks the producer to read it (once until
        it has read)."""
        if self.nudged and self.log.pending > self.half:
            return
        self.nudged = True
        try:
            with self.lock:
                self.conn.send_msg(b"W", timeout=FETCH_TIMEOUT)
        except gpuipc.Error:
            pass


def _client(name, stream_of=None):
    cl = _clients.get(name)
    if cl is not None and not cl.conn.closed:
        if cl.log.pending <= cl.half:
            cl.nudged = False
        return cl
    with _clients_lock:
        cl = _clients.get(name)
        if cl is None or cl.conn.closed:
            cl = _clients[name] = _Client(name, stream_of or _raw_stream)
        return cl


class _Peer:
    """A consumer connected to this process's server: its connection, its
    hold table (what it holds, read here), the events it releases after."""

    def __init__(self, conn):
        self.conn = conn
        self.log = None
        self.held = {}  # token -> (obj, stream, desc)
        self.events = {}  # slot -> opened gpuipc.Event of the consumer
        self.stuck = []  # released with no ordering possible: kept until it exits
        try:
            self.pid = conn.peer[0]
        except gpuipc.Error:
            self.pid = 0


class _Server:
    """This process's side of the tensors it pickled: a listener, the hold
    tables of its consumers, and a thread that accepts consumers, answers
    fetches of the fd route and reads the tables now and then."""

    def __init__(self):
        self.name = f"torch-{os.getpid()}-{secrets.token_hex(4)}"
        self.listener = gpuipc.listen(self.name, timeout=10)
        self.pending = {}
        self.lock = threading.RLock()
        self.counter = itertools.count(1)
        self.conns = {}  # fd -> Connection (every consumer connected)
        self.peers = {}  # Connection -> _Peer
        self.gone = weakref.WeakSet()  # _Held of ended connections, kept by the library
        self.forever = []  # items of a gone peer whose death cannot be seen
        self.events = {}  # (device, stream) -> (gpuipc.Event, descriptor)
        self.exports = {}  # (device, storage ptr, bytes) -> gpuipc.Buffer (no owner)
        self.pid = os.getpid()
        self.sel = selectors.DefaultSelector()
        self.thread = threading.Thread(target=self._run, name="gpuipc.torch", daemon=True)
        self.thread.start()

    def offer(self, tensor, stream):
        token = next(self.counter).to_bytes(8, "little") + secrets.token_bytes(8)
        with self.lock:
            self.pending[token] = (tensor, stream)
        return token

    def _export(self, obj, key, view=None):
        """obj's descriptor for gpuipc.open, exported from the wrapped
        allocation cached under key (wrapped on first use, or when the
        allocation there changed); view: obj as (address, shape, strides,
        dtype), read instead of obj's array interface. None when its memory
        needs an fd."""
        what = obj if view is None else view
        if key is None:
            shared = gpuipc.share(obj)
            if shared.fds:
                shared.close()
                return None
            return shared.desc
        buf = self.exports.get(key)
        if buf is not None:
            try:
                return buf.share_view(what)
            except gpuipc.NotSupportedError:
                return None
            except gpuipc.Error:  # another allocation there now: wrapped anew
                del self.exports[key]
        # Wrapped by address (key: device, storage address, bytes), so
        # that the cache keeps no tensor alive.
        buf = gpuipc.Buffer.wrap(key[1], key[2])
        try:
            desc = buf.share_view(what)
        except gpuipc.NotSupportedError:
            return None
        if len(self.exports) >= EXPORTS_MAX:
            self.exports.pop(next(iter(self.exports)))
        self.exports[key] = buf
        return desc

    def offer_shared(self, obj, stream, dev, key=None, view=None):
        """Registers obj for the descriptor route: (token, descriptor,
        event descriptor), the event recorded on stream now; None when its
        memory needs a file descriptor (then use offer). Reads the hold
        tables first (what consumers let go of comes back here)."""
        with self.lock:
            self._poll()
            desc = self._export(obj, key, view)
            if desc is None:
                return None
            e = self.events.get((dev, stream))
            if e is None:
                ev = gpuipc.Event(device=dev)
                e = self.events[(dev, stream)] = (ev, ev.export())
            e[0].record(stream=stream)
            token = next(self.counter).to_bytes(8, "little") + os.urandom(8)
            self.pending[token] = (obj, stream, desc)
        return token, desc, e[1]

    def pending_count(self):
        with self.lock:
            return len(self.pending)

    def held_count(self):
        _gpuipc.counters()  # takes what the library let go of meanwhile
        with self.lock:
            self._poll()
            n = sum(len(p.held) + len(p.stuck) for p in self.peers.values())
            n += sum(len(h.items) for h in list(self.gone)) + len(self.forever)
        return n + sum(c.wrapped_pending for c in list(self.conns.values()))

    # -- the hold tables

    def _poll(self):
        """Reads every consumer's hold table. Caller holds self.lock."""
        for p in self.peers.values():
            if p.log is not None:
                self._read(p)

    def _read(self, p):
        try:
            entries = p.log.drain()
        except gpuipc.Error:
            # A table that broke its rules is read no more: what its
            # consumer holds stays held until its process is gone.
            p.log = None
            return
        for op, token, slot in entries:
            if op == 1:  # held
                item = self.pending.pop(token, None)
                if item is not None:
                    p.held[token] = item
                continue
            item = p.held.pop(token, None)  # released
            if item is None:
                continue  # not one this consumer holds: ignored
            if slot >= 0:
                try:
                    ev = p.events.get(slot)
                    if ev is None:
                        ev = p.events[slot] = gpuipc.Event.open(p.log.event_desc(slot))
                    ev.wait(stream=item[1])  # reuse after the consumer's work on it
                except gpuipc.Error:
                    p.stuck.append(item)  # no ordering possible: kept until it exits
                    continue
            del item

    # -- the server thread

    def _run(self):
        sel = self.sel
        sel.register(self.listener.fileno(), selectors.EVENT_READ, None)
        last_collect = 0.0
        while True:
            timeout = POLL_INTERVAL if self.peers else 0.5
            for key, _ in sel.select(timeout=timeout):
                if key.data is None:
                    try:
                        # Never waits: a client that connects and stays
                        # silent must not hold up the others' requests.
                        c = self.listener.accept(timeout=0)
                    except gpuipc.Error:
                        continue
                    self.conns[c.fileno()] = c
                    with self.lock:
                        self.peers[c] = _Peer(c)
                    sel.register(c.fileno(), selectors.EVENT_READ, c)
                elif not self._serve(key.data):
                    fd = key.fd
                    sel.unregister(fd)
                    self.conns.pop(fd, None)
                    self._peer_left(key.data)
                    key.data.close()
            with self.lock:
                self._poll()
            now = time.monotonic()
            if now - last_collect >= 0.5:
                last_collect = now
                gpuipc.collect()  # leases of connections closed before their peer exited
            # releases of consumers that went quiet (the fd route)
            for fd, c in list(self.conns.items()):
                if c.wrapped_pending:
                    try:
                        c.progress(0)
                    except gpuipc.Error:
                        pass

    def _serve(self, c):
        """Answers every request waiting on c; False once c is finished."""
        try:
            c.progress(0)
            while True:
                try:
                    m, fds = c.recv_msg(timeout=0, with_fds=True)
                except gpuipc.TimeoutError:
                    return True
                if m == b"P" and len(fds) == 1:  # the consumer's hold table
                    try:
                        log = _gpuipc.HoldLog.open(fds[0])
                    except gpuipc.Error:
                        log = None
                    finally:
                        os.close(fds[0])
                    with self.lock:
                        p = self.peers.get(c)
                        if p is not None and p.log is None and log is not None:
                            p.log = log
                            self._read(p)
                    continue
                for fd in fds:
                    os.close(fd)
                if m == b"W":  # its table is filling: read it now
                    with self.lock:
                        p = self.peers.get(c)
                        if p is not None and p.log is not None:
                            self._read(p)
                    continue
                if m[:1] != b"G":
                    c.send_msg(b"ERR unknown request")
                    continue
                with self.lock:
                    item = self.pending.pop(m[1:], None)
                if item is None or len(item) != 2:
                    if item is not None:  # a descriptor-route token: not fetched so
                        with self.lock:
                            self.pending[m[1:]] = item
                    c.send_msg(b"ERR unknown tensor (fetched already, or not from this "
                               b"process)")
                    continue
                tensor, stream = item
                c.send_msg(b"OK")
                c.send(tensor, stream=stream)
                del tensor, item
        except (gpuipc.PeerGoneError, gpuipc.ClosedError, gpuipc.ProtocolError):
            return False

    def _peer_left(self, c):
        """c's connection ended: its table is read a last time, and what its
        consumer still holds is kept by the library until the kernel says
        its process is gone (the library's peer watcher)."""
        with self.lock:
            p = self.peers.pop(c, None)
            if p is None:
                return
            if p.log is not None:
                self._read(p)
                p.log = None
            items = list(p.held.values()) + p.stuck
            if not items:
                return
            held = _Held(items)
            try:
                c.keep_until_peer_exits(held)
                self.gone.add(held)
            except (gpuipc.Error, MemoryError):
                # Its exit cannot be told here (no pidfd of it), or no
                # memory to say so: kept until this process exits.
                self.forever.extend(items)
            del items, held


class _Held:
    """What a consumer whose connection ended still held: kept by the
    library until its process is gone."""

    __slots__ = ("items", "__weakref__")

    def __init__(self, items):
        self.items = items


def _get_server():
    global _server
    s = _server
    if s is not None and s.pid == os.getpid():
        return s
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
