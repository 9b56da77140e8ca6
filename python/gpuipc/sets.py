"""Tensor sets: many named tensors handed between processes as one
versioned object (weight sync, KV-cache handoff). The Python face of
include/gpuipc/sets.h; docs/sets.md has the model.

Producer::

    ts = gpuipc.TensorSet.empty({"w": ((4096, 4096), "bfloat16")}, copies=2)
    ts.subscribe(conn)                      # table and memory, once per peer
    ts.update(model.state_dict(), stream=s) # begin, copy_from, publish

or, sharing the producer's own tensors where they are (one copy)::

    ts = gpuipc.TensorSet.from_dict(model.state_dict())
    ts.subscribe(conn)
    ts.begin(stream=s); ...write in place...; ts.publish(stream=s)

Consumer::

    sub = gpuipc.TensorSet.subscribe(conn)  # a Subscriber
    with sub.recv() as v:                   # a mapping name -> TensorView
        w = torch.from_dlpack(v["w"])       # zero copy, valid until release
    with sub.recv() as v:
        v.copy_into(model.state_dict(), stream=s)  # one stream, no host wait

``TensorSet.subscribe`` is both: on the class it opens a consumer's
Subscriber on a connection; on a set it subscribes a connection to it.
Calls that wait release the GIL and take ``timeout=`` in seconds (None:
forever; left out: the set's or the connection's timeout); errors are
gpuipc.Error subclasses.

At C speed: torch tensors are read in C (DLPack's C exchange API where
torch has it), checked against the layout (dtype, shape, strides) and
copied on one stream with torch's current stream ordered before it once
per call; ``plan = version.plan_into(mine)`` (``ts.plan_from(mine)``)
resolves and checks them once, and ``copy_into(plan)`` then costs one
library call. ``version.as_torch()`` builds every torch tensor of a
version in one call.
"""
from collections.abc import Mapping

from . import _gpuipc

__all__ = ["CopyPlan", "Subscriber", "TensorSet", "Version"]

CopyPlan = _gpuipc.CopyPlan


class _Default:
    """The default of a timeout= argument: the set's or the connection's
    own timeout (None: forever)."""

    def __repr__(self):
        return "<default>"


_DEFAULT = _Default()


def _tmo(timeout):
    return {} if timeout is _DEFAULT else {"timeout": timeout}


class _Both:
    """A method that is a classmethod on the class and a method on an
    instance (TensorSet.subscribe)."""

    def __init__(self, on_class, on_instance):
        self.on_class, self.on_instance = on_class, on_instance
        self.__doc__ = on_instance.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self.on_class.__get__(cls, type(cls))
        return self.on_instance.__get__(obj, cls)


def _names_of(mapping):
    if not isinstance(mapping, Mapping):
        raise TypeError("a mapping of names to tensors")
    for k in mapping:
        if not isinstance(k, str):
            raise TypeError(f"tensor names must be str, not {type(k).__name__}")
    return list(mapping)


def _positional(names, index_of, tensors, what):
    """A list in the set's order from a mapping (missing names: skipped)
    or a sequence (one per tensor, None: skipped); a CopyPlan as it is."""
    if type(tensors) is CopyPlan:
        return tensors
    if isinstance(tensors, Mapping):
        out = [None] * len(names)
        for k, t in tensors.items():
            try:
                out[index_of(k)] = t
            except KeyError:
                raise KeyError(f"{what}: no tensor named {k!r} in the set") from None
        return out
    return list(tensors)


class TensorSet:
    """The producer's side: a set of named tensors, published as versions
    to subscribed connections. Make one with from_dict (share the arrays
    where they are) or empty (the set allocates, copies=2 for double
    buffering)."""

    def __init__(self, entries, *, copies=1, align=256, device=None, timeout=10.0,
                 hold=10.0, retired_max=2):
        self._c = _gpuipc.TensorSetC(entries, copies=copies, align=align, device=device,
                                     timeout=timeout, hold=hold, retired_max=retired_max)
        self._names = self._c.names()
        self._index = {n: i for i, n in enumerate(self._names)}
        self._copy = None  # the copy begun, until publish

    @classmethod
    def from_dict(cls, tensors, *, device=None, timeout=10.0, hold=10.0):
        """A wrapped set over ``tensors`` ({name: array}; arrays exposing
        __cuda_array_interface__ or __dlpack__: torch, CuPy, gpuipc's own
        buffers and blocks): consumers read the producer's memory itself.
        The set keeps the arrays alive. A consumer still holding a version
        ``hold`` seconds after its publish is dropped from the set and the
        memory written all the same (None: no limit)."""
        names = _names_of(tensors)
        return cls([(n, tensors[n]) for n in names], device=device, timeout=timeout,
                   hold=hold)

    @classmethod
    def empty(cls, spec, *, copies=1, align=256, device=None, timeout=10.0, hold=10.0,
              retired_max=2):
        """An owned set of ``spec`` ({name: (shape, dtype)}): the set
        allocates ``copies`` copies (2: double buffering) in shared
        memory; contents undefined until written. A copy a consumer still
        holds ``hold`` seconds after its publish (None: no limit) does not
        hold up begin: that consumer is dropped from the set and begin
        writes a fresh copy, the held one kept for it until it releases it
        or dies (at most ``retired_max`` such copies at once)."""
        names = _names_of(spec)
        entries = []
        for n in names:
            try:
                shape, dtype = spec[n]
            except (TypeError, ValueError):
                raise TypeError(f"{n!r}: give (shape, dtype)") from None
            entries.append((n, tuple(shape), dtype))
        return cls(entries, copies=copies, align=align, device=device, timeout=timeout,
                   hold=hold, retired_max=retired_max)

    # --- what it is
    names = property(lambda self: list(self._names), doc="the names, in order")
    count = property(lambda self: self._c.count)
    copies = property(lambda self: self._c.copies)
    layout = property(lambda self: self._c.layout)
    version = property(lambda self: self._c.version, doc="latest published (0: none)")
    subscribers = property(lambda self: self._c.subscribers)
    wrapped = property(lambda self: self._c.wrapped)
    destroyed = property(lambda self: self._c.destroyed)

    def __len__(self):
        return len(self._names)

    def __contains__(self, name):
        return name in self._index

    def index(self, name):
        return self._index[name]

    def tensors(self, copy=None):
        """{name: TensorView} of copy ``copy`` (default: the one begun, else
        0): where the producer writes that copy."""
        if copy is None:
            copy = self._copy if self._copy is not None else 0
        return {n: self._c.tensor(copy, i) for i, n in enumerate(self._names)}

    # --- subscribers
    def _subscribe(self, conn, *, stream=None):
        """set.subscribe(conn, *, stream=None): sends the table and the
        memory to the peer (setup cost, once per connection), and the
        latest version if there is one. The connection then carries only
        this set until unsubscribe."""
        self._c.subscribe(conn, stream=stream)

    @classmethod
    def _open_subscriber(cls, conn, *, device=0):
        return Subscriber(conn, device=device)

    subscribe = _Both(_open_subscriber, _subscribe)

    def unsubscribe(self, conn, *, timeout=_DEFAULT):
        """Ends conn's subscription and waits until the consumer released
        everything of the set (the consumer sees the end in its recv), up
        to ``timeout`` s (default: the set's; None: forever)."""
        self._c.unsubscribe(conn, **_tmo(timeout))

    # --- versions
    def begin(self, *, stream=None, timeout=_DEFAULT):
        """Picks the copy to write (one no consumer holds; waits for their
        releases, up to ``timeout`` s: default the set's, None forever) and
        orders ``stream`` after their reads. Returns its index."""
        self._copy = self._c.begin(stream=stream, **_tmo(timeout))
        return self._copy

    def plan_from(self, tensors):
        """A CopyPlan of ``tensors`` (as copy_from takes them) for every
        later copy_from: resolved and checked against the layout (dtype,
        shape, strides) once; it keeps the arrays alive and copies from the
        addresses they had when it was made (make a new plan after
        replacing a tensor's storage)."""
        return self._c.plan(_positional(self._names, self._index.__getitem__, tensors,
                                        "plan_from"))

    def copy_from(self, tensors, *, copy=None, stream=None):
        """Copies ``tensors`` (a mapping by name, names left out skipped; a
        sequence in the set's order, None skipped; or a CopyPlan from
        plan_from) into copy ``copy`` (default: the one begun) on
        ``stream``; no host wait. Each array must have its tensor's dtype,
        shape and strides (ValueError naming the tensor otherwise)."""
        if copy is None:
            if self._copy is None:
                raise _gpuipc.InvalidArgError("copy_from: begin() first (or give copy=)")
            copy = self._copy
        srcs = _positional(self._names, self._index.__getitem__, tensors, "copy_from")
        self._c.copy_from(copy, srcs, stream=stream)

    def publish(self, *, stream=None):
        """Publishes the copy begun as the next version to every subscriber,
        ordered after the work queued on ``stream``. Returns its number."""
        v = self._c.publish(stream=stream)
        self._copy = None
        return v

    def update(self, tensors=None, *, stream=None, timeout=_DEFAULT):
        """begin, copy_from(tensors) (when given), publish: one version."""
        self.begin(stream=stream, timeout=timeout)
        if tensors is not None:
            self.copy_from(tensors, stream=stream)
        return self.publish(stream=stream)

    def destroy(self, *, timeout=_DEFAULT):
        """Ends every subscription and frees the set's memory (a wrapped
        set's arrays stay the caller's). BusyError when a consumer still
        holds something after the timeout (default: the set's; None:
        forever); the set stays usable."""
        self._c.destroy(**_tmo(timeout))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __repr__(self):
        if self.destroyed:
            return "<gpuipc.TensorSet destroyed>"
        kind = "wrapped" if self.wrapped else f"owned, {self.copies} copies"
        return (f"<gpuipc.TensorSet {self.count} tensors ({kind}) layout={self.layout:#x} "
                f"version={self.version} subscribers={self.subscribers}>")


class Version(Mapping):
    """One version of a set, as a consumer received it: a read-only mapping
    of names to zero-copy TensorViews (valid until release: a context
    manager releases), as_torch() for all of them as torch tensors at
    once, and copy_into for the consumer's own tensors."""

    def __init__(self, c, sub=None):
        self._c = c
        self._sub = sub
        self._names = None
        self._index = None

    def _load(self):
        if self._names is None:
            if self._sub is not None:
                self._names, self._index = self._sub._layout_names(self._c)
            else:
                self._names = self._c.names()
                self._index = {n: i for i, n in enumerate(self._names)}

    def __getitem__(self, name):
        return self._c.tensor(name)

    def __iter__(self):
        self._load()
        return iter(self._names)

    def __len__(self):
        return self._c.count

    def __contains__(self, name):
        self._load()
        return name in self._index

    number = property(lambda self: self._c.number)
    layout = property(lambda self: self._c.layout)
    copy = property(lambda self: self._c.copy)
    released = property(lambda self: self._c.released)
    stream = property(lambda self: self._c.stream)

    def tensor(self, i):
        """Tensor i (int: in the producer's order) or by name."""
        return self._c.tensor(i)

    def as_torch(self):
        """{name: torch.Tensor} of every tensor, zero copy, built in one
        call (torch's current stream is ordered after recv's stream). The
        tensors are valid until this version is released (release(), the
        end of its ``with``, its garbage collection or the subscriber's
        close); they do not keep the version held. A later version of the
        same layout in the same copy gives back the same tensor objects
        (the same memory, rewritten by the producer in between); do not
        change them in place (resize_, set_, as_strided_): a changed one is
        built again."""
        self._load()
        return dict(zip(self._names, self._c.torch_views()))

    def plan_into(self, tensors):
        """A CopyPlan of ``tensors`` (as copy_into takes them), good for
        copy_into of this and every later version of the same layout:
        resolved and checked (dtype, shape, strides) once; it keeps the
        arrays alive and copies into the addresses they had when it was
        made (make a new plan after replacing a tensor's storage, or when
        the layout changes: copy_into then refuses the plan)."""
        self._load()
        return self._c.plan(_positional(self._names, self._index.__getitem__, tensors,
                                        "plan_into"))

    def copy_into(self, tensors, *, stream=None):
        """Copies the version into the consumer's tensors (a mapping by
        name, names left out skipped; a sequence in the producer's order;
        or a CopyPlan from plan_into), each of the same dtype, shape and
        strides (ValueError naming the tensor otherwise), on ``stream``
        (default: recv's; torch's current stream is ordered before it) with
        adjacent ranges coalesced. Does not wait on the host; release on
        the same stream afterwards."""
        if type(tensors) is CopyPlan:
            dsts = tensors
        else:
            self._load()
            dsts = _positional(self._names, self._index.__getitem__, tensors, "copy_into")
        if stream is None:
            self._c.copy_into(dsts)
        else:
            self._c.copy_into(dsts, stream=stream)

    def release(self, *, stream=None):
        """Hands the version back (its copy may be rewritten once the work
        queued on ``stream`` before this call completed). Its views stop
        exporting; arrays made from them must not be used after."""
        if stream is None:
            self._c.release()
        else:
            self._c.release(stream=stream)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        if self.released:
            return "<gpuipc.TensorSet version (released)>"
        return (f"<gpuipc.TensorSet version {self.number} of layout {self.layout:#x}: "
                f"{len(self)} tensors, copy {self.copy}>")


class Subscriber:
    """A consumer's end of a tensor set on a connection (the peer
    subscribes it). recv() gives versions in order; closing releases what
    is still held, except versions whose views (TensorView objects, and
    the tensors made from them) are alive: those stay held and mapped,
    with the connection open underneath, until their last view dies."""

    def __init__(self, conn, *, device=0):
        self._c = _gpuipc.TensorSetSub(conn, device=device)
        self._layout = None  # the names of the last layout seen, and their index
        self._names = None
        self._index = None

    def _layout_names(self, vc):
        """(names, index) of a version's layout, built once per layout."""
        lay = vc.layout
        if lay != self._layout:
            names = vc.names()
            self._names, self._index = names, {n: i for i, n in enumerate(names)}
            self._layout = lay
        return self._names, self._index

    def recv(self, *, stream=None, timeout=_DEFAULT):
        """The next version (waits up to ``timeout`` s: default the
        connection's, None forever). Work queued on ``stream`` afterwards
        runs after the producer's writes. CanceledError once when the
        producer ended the subscription; PeerGoneError when it is gone;
        ProtocolError (or a decoder error) for a table that was refused."""
        return Version(self._c.recv(stream=stream, **_tmo(timeout)), self)

    def __iter__(self):
        """Versions until the producer ends the subscription."""
        while True:
            try:
                v = self.recv()
            except _gpuipc.CanceledError:
                return
            yield v

    conn = property(lambda self: self._c.conn)
    closed = property(lambda self: self._c.closed)

    def close(self):
        self._c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<gpuipc.TensorSet subscriber{' (closed)' if self.closed else ''}>"
