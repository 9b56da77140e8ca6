/*
 * conn.c: Listener, Connection and Received. Calls that may wait run the
 * library call without waiting under g_lock and wait in the package's one
 * loop (gpy_wait_loop: gpuipc_conn_wait per slice) with the GIL and the
 * lock released; recv(as_torch=True) and recv_batch(as_torch=True) return
 * torch tensors made in C (torchc.c) whose deaths release the leases. Memory sent that gpuipc did not allocate (a torch
 * tensor, a CuPy array) is wrapped (gpuipc_buffer_wrap) per send; the
 * wrapper and the Python object owning the memory are kept until the peer
 * released it, or, after the connection closed, until the peer process is
 * gone. Batches (send_batch, recv_batch, release_batch) and broadcast
 * carry arena blocks only, so that each stays one library call: all or
 * nothing for a batch, one ready signal for the connections of a
 * broadcast that are ready (one that is not gets its own when it is).
 * A Received is a view of memory the connection imported (its DLPack
 * capsules and CUDA Array Interface consumers keep it): a close while
 * some are held hides the connection from Python but keeps it open until
 * the last is released or dies (conn_take, conn_held_drop), so that
 * closing never unmaps memory a live view points at.
 */
#include "ext.h"

/* ------------------------------------------------------------------------ */
/* Connection                                                               */
/* ------------------------------------------------------------------------ */

/* Lock held. Hides the connection from Python (c->c NULL: "closed here")
 * and returns what to close now: nothing when it is borrowed, or when
 * something received over it may still be read (c->held): its imports
 * must stay mapped, so it stays open, as c->linger, until the last of
 * those goes (conn_held_drop). The peer learns of the close then. */
static gpuipc_conn *conn_take(ConnObject *c) {
  gpuipc_conn *gc = c->borrowed ? NULL : c->c;
  c->c = NULL;
  if (gc && c->held > 0) {
    c->linger = gc;
    gc = NULL;
  }
  return gc;
}

gpuipc_conn *conn_rx(ConnObject *c) { return c->c ? c->c : c->linger; }

void conn_held_drop(ConnObject *c) {
  if (--c->held > 0 || !c->linger) return;
  gpuipc_conn *gc = c->linger;
  c->linger = NULL;
  /* close may wait for the device (cuCtxSynchronize): no GIL */
  Py_BEGIN_ALLOW_THREADS
  LOCK();
  gpuipc_conn_close(gc);
  UNLOCK();
  Py_END_ALLOW_THREADS
}

void conn_detach(ConnObject *c) {
  /* lock held, GIL held. What the peer holds stays with the library (it
   * keeps wrapped memory handed to it until the peer released it or its
   * process is gone, pidfd-told). */
  gpuipc_conn_close(conn_take(c));
}

PyObject *conn_new(gpuipc_conn *gc, int timeout_ms, unsigned maxo, int borrowed) {
  ConnObject *c = PyObject_New(ConnObject, &ConnType);
  if (!c) {
    if (!borrowed) gpuipc_conn_close(gc);
    return NULL;
  }
  c->c = gc;
  c->timeout_ms = timeout_ms;
  c->max_outstanding = maxo ? maxo : 256;
  c->borrowed = borrowed;
  c->tally = tally_new();
  if (!c->tally) {
    c->c = NULL;
    Py_DECREF(c);
    if (!borrowed) gpuipc_conn_close(gc);
    PyErr_NoMemory();
    return NULL;
  }
  c->tset_refs = 0;
  c->held = 0;
  c->linger = NULL;
  c->weak = NULL;
  c->spin_us = -1;
  c->torch_dev = -1;
  gpuipc_peer_info pi = {0};
  c->peer_pid = gpuipc_conn_get_peer(gc, &pi) == GPUIPC_OK ? pi.pid : -1;
  gpuipc_conn_set_nonblocking(gc, 1);
  return (PyObject *)c;
}

static int conn_ok(ConnObject *c) {
  if (!c->c) {
    raise_msg(GPUIPC_E_CLOSED, "connection", "closed here");
    return 0;
  }
  return 1;
}

/* The spin of a call that may wait: spin_us= of the call, else the
 * connection's spin_us option, else GPY_DEFAULT_SPIN_US. -1 with an
 * exception for a bad value. */
static int parse_spin(PyObject *o, ConnObject *c, int *out) {
  if (!o || o == Py_None) {
    *out = c->spin_us >= 0 ? c->spin_us : GPY_DEFAULT_SPIN_US;
    return 0;
  }
  gpuipc_conn_options t = GPUIPC_CONN_OPTIONS_INIT;
  if (parse_carrier_opts(NULL, o, NULL, &t) < 0) return -1;
  *out = t.spin_us;
  return 0;
}

typedef struct {
  ConnObject *c;
  conn_op op;
  void *ctx;
} ConnRun;

static gpuipc_status cr_try(void *v) {
  ConnRun *r = v;
  if (!conn_ok(r->c)) return GPY_RAISED;
  LOCK();
  gpuipc_status st = r->op(r->c, r->ctx);
  UNLOCK();
  flush_decrefs();
  return st;
}

/* Waits on the connection without the GIL or the lock. The wait counts as
 * something that still uses the connection (c->held): a close from
 * another thread meanwhile hides it at once but closes it only when this
 * wait is back (within a slice); the next attempt then says closed. */
static gpuipc_status cr_sleep(void *v, short events, int timeout_ms, int spin_us) {
  ConnObject *c = ((ConnRun *)v)->c;
  gpuipc_conn *gc = c->c;
  if (!gc) return GPUIPC_OK; /* the attempt says closed */
  c->held++;
  gpuipc_status w;
  /* Any number of threads may wait at once (gpuipc_conn_wait). */
  Py_BEGIN_ALLOW_THREADS
  w = gpuipc_conn_wait(gc, events, timeout_ms, spin_us);
  Py_END_ALLOW_THREADS
  conn_held_drop(c);
  return w;
}

int conn_run_spin(ConnObject *c, int timeout_ms, int spin_us, int want_out, conn_op op,
                  void *ctx, gpuipc_status *st) {
  ConnRun r = {c, op, ctx};
  return gpy_wait_loop(timeout_ms, (short)(POLLIN | (want_out ? POLLOUT : 0)), spin_us,
                       cr_try, cr_sleep, &r, st);
}

int conn_run(ConnObject *c, int timeout_ms, int want_out, conn_op op, void *ctx,
             gpuipc_status *st) {
  return conn_run_spin(c, timeout_ms, c->spin_us >= 0 ? c->spin_us : GPY_DEFAULT_SPIN_US,
                       want_out, op, ctx, st);
}

static PyObject *conn_status(gpuipc_status st, const char *what, int timeout_ms) {
  if (st == GPUIPC_E_TIMEOUT) {
    if (timeout_ms == 0) return raise_miss(what);
    char d[80];
    snprintf(d, sizeof d, "nothing within %d ms", timeout_ms);
    return raise_msg(st, what, d);
  }
  return raise_st(st, what);
}

/* --- send ---------------------------------------------------------------- */

typedef struct {
  gpuipc_block *block;
  gpuipc_buffer *buf;
  uintptr_t stream;
  const uint8_t *meta;
  size_t meta_len;
  unsigned flags; /* blocks: GPUIPC_SEND_COMPLETE or 0 */
  Kept *kept;     /* wrapped memory: handed to the library once sent */
} SendCtx;

static gpuipc_status op_send(ConnObject *c, void *v) {
  SendCtx *x = v;
  if (x->block)
    return gpuipc_conn_send_ex(c->c, x->block, S(x->stream), x->meta, x->meta_len, x->flags);
  gpuipc_status st = gpuipc_conn_send_buffer(c->c, x->buf, S(x->stream), x->meta, x->meta_len);
  if (st == GPUIPC_OK && x->kept) {
    /* Under the same lock as the send, so that no release of it is read
     * before: the library keeps the wrapper (and the owner, through
     * kept) until the peer released it or is gone, and orders the send
     * stream after the peer's work before calling back. Cannot fail for
     * a wrapped buffer not handed over yet. */
    (void)gpuipc_buffer_release_when_done(x->buf, S(x->stream), kept_done, x->kept);
    x->kept = NULL;
    x->buf = NULL;
  }
  return st;
}

static int get_user_meta(PyObject *o, Py_buffer *view) {
  if (o == NULL || o == Py_None) {
    view->buf = NULL;
    view->len = 0;
    view->obj = NULL;
    return 0;
  }
  return PyObject_GetBuffer(o, view, PyBUF_SIMPLE);
}

static PyObject *Conn_send(ConnObject *c, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
  static const char *const names[] = {"obj", "stream", "meta", "timeout", "complete"};
  PyObject *a[5];
  if (gpy_args("send", args, nargs, kwnames, 1, 1, names, 5, a) < 0) return NULL;
  PyObject *obj = a[0], *stream_o = a[1], *meta_o = a[2], *tmo_o = a[3], *complete_o = a[4];
  if (complete_o && !PyBool_Check(complete_o)) {
    PyErr_Format(PyExc_TypeError, "send: complete must be True or False, not %.80s",
                 Py_TYPE(complete_o)->tp_name);
    return NULL;
  }
  /* The caller asserts the data complete: no stream is ordered, queried or
   * signalled (GPUIPC_SEND_COMPLETE), so neither is one ordered here. */
  int complete = complete_o == Py_True;
  if (!conn_ok(c)) return NULL;
  uintptr_t stream;
  int tmo;
  if (parse_stream(stream_o, &stream) < 0 || parse_timeout(tmo_o, c->timeout_ms, &tmo) < 0)
    return NULL;
  Py_buffer um;
  if (get_user_meta(meta_o, &um) < 0) return NULL;
  uint8_t wire[GPUIPC_META_MAX];
  size_t wlen = 0;
  SendCtx x = {0};
  x.stream = stream;
  Foreign f = {0};
  gpuipc_buffer *wrapped = NULL;
  PyObject *ret = NULL;

  if (Py_TYPE(obj) == &BlockType) {
    BlockObject *b = (BlockObject *)obj;
    if (!b->b) { raise_msg(GPUIPC_E_INVALID_ARG, "send", "block was freed"); goto out; }
    if (meta_encode(&b->meta, um.buf, um.len, wire, &wlen) < 0) goto out;
    x.block = b->b;
    if (!complete && stream != b->stream && order_streams(b->device, b->stream, stream) < 0)
      goto out;
  } else if (complete && Py_TYPE(obj) == &BufferType) {
    PyErr_SetString(PyExc_ValueError, "send: complete=True is for arena blocks (a Block, or "
                    "an array inside one); a Buffer goes by descriptor, ordered on its stream");
    goto out;
  } else if (Py_TYPE(obj) == &BufferType) {
    BufferObject *b = (BufferObject *)obj;
    if (!b->b) { raise_msg(GPUIPC_E_INVALID_ARG, "send", "buffer was freed"); goto out; }
    if (meta_encode(&b->meta, um.buf, um.len, wire, &wlen) < 0) goto out;
    x.buf = b->b;
    if (b->has_stream && stream != b->stream) {
      View v = buf_view(b);
      if (order_streams(v.dev_id, b->stream, stream) < 0) goto out;
    }
  } else {
    if (foreign_get(obj, stream, &f) < 0) goto out;
    if (f.nbytes == 0) {
      PyErr_SetString(PyExc_ValueError, "send: an empty array has no memory to send");
      goto out;
    }
    BlockObject *b = block_find(f.ptr, f.nbytes);
    int dev = 0;
    if (b) { /* memory of one of our arena blocks: the fast path */
      f.meta.offset = (uint64_t)((char *)f.ptr - (char *)b->ptr);
      if (meta_encode(&f.meta, um.buf, um.len, wire, &wlen) < 0) goto out;
      x.block = b->b;
      dev = b->device;
    } else if (complete) {
      PyErr_SetString(PyExc_ValueError, "send: complete=True is for arena blocks (a Block, or "
                      "an array inside one); this memory is not in one (it would be wrapped "
                      "and sent by descriptor)");
      goto out;
    } else {
      if (meta_encode(&f.meta, um.buf, um.len, wire, &wlen) < 0) goto out;
      gpuipc_status st = gpuipc_buffer_wrap(f.ptr, f.nbytes, &wrapped);
      if (st) { raise_st(st, "send: wrapping the memory (gpuipc_buffer_wrap)"); goto out; }
      g_count.wraps_live++;
      g_count.wraps_total++;
      x.kept = kept_new(f.owner, NULL, c->tally, 1);
      if (!x.kept) goto out;
      x.buf = wrapped;
      gpuipc_uuid u;
      if (gpuipc_buffer_get_device(wrapped, &u) == GPUIPC_OK) dev = ordinal_of(&u);
    }
    /* CAI v3: the producer's work is on f.stream; the send goes on ours */
    if (!complete && f.has_stream && f.stream != stream && order_streams(dev, f.stream, stream) < 0)
      goto out;
  }
  x.meta = wire;
  x.meta_len = wlen;
  x.flags = complete ? GPUIPC_SEND_COMPLETE : 0;
  gpuipc_status st;
  if (conn_run(c, tmo, 1, op_send, &x, &st) < 0) goto out;
  if (st != GPUIPC_OK) { conn_status(st, "send", tmo); goto out; }
  /* Wrapped memory was handed to the library with the send (op_send); a
   * Buffer object sent is the caller's still: it is handed over when it
   * is closed or goes while held (buffer.c). */
  if (wrapped && !x.kept) wrapped = NULL;
  ret = Py_None;
  Py_INCREF(ret);
out:
  if (x.kept) { /* not sent: nothing handed over (the wrapper goes below) */
    x.kept->wrapped = 0;
    kept_undo(x.kept);
    x.kept = NULL;
  }
  if (wrapped) {
    gpuipc_buffer_free(wrapped, NULL);
    g_count.wraps_live--;
  }
  Py_XDECREF(f.owner);
  if (um.obj) PyBuffer_Release(&um);
  return ret;
}

/* --- recv ---------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  ConnObject *conn;
  uint64_t id;
  void *ptr;
  size_t length;
  int device;
  uintptr_t stream;
  int held;
  int mark; /* release_batch: named in the list being checked */
  ArrMeta meta;
  PyObject *user; /* bytes, made from umeta when first asked for */
  DLBox box;      /* the first DLPack export or torch tensor of it */
  uint16_t ulen;
  uint8_t umeta[GPUIPC_META_MAX];
} ReceivedObject;


/* A Received for what gpuipc_conn_recv(_batch) handed over on stream.
 * On failure (out of memory) the lease is released here when
 * release_on_fail is set, else left to the caller. */
static PyObject *rx_new(ConnObject *c, const gpuipc_received *rx, uintptr_t stream,
                        int release_on_fail) {
  ReceivedObject *r = PyObject_New(ReceivedObject, &ReceivedType);
  if (!r) {
    if (release_on_fail) {
      LOCK();
      if (c->c) gpuipc_conn_release(c->c, rx->id, S(stream));
      UNLOCK();
    }
    return NULL;
  }
  Py_INCREF(c);
  r->conn = c;
  r->id = rx->id;
  r->ptr = rx->ptr;
  r->length = rx->length;
  r->device = rx->device;
  r->stream = stream;
  r->held = 1;
  c->held++;
  r->mark = 0;
  r->user = NULL;
  r->box.embedded = 1;
  r->box.in_use = 0;
  const uint8_t *u;
  size_t ul;
  meta_decode(rx->meta, rx->meta_len, rx->length, &r->meta, &u, &ul);
  if (ul > GPUIPC_META_MAX) ul = GPUIPC_META_MAX;
  memcpy(r->umeta, u, ul);
  r->ulen = (uint16_t)ul;
  g_count.live_received++;
  return (PyObject *)r;
}

static PyObject *rx_user(ReceivedObject *r) {
  if (!r->user) {
    r->user = PyBytes_FromStringAndSize((const char *)r->umeta, (Py_ssize_t)r->ulen);
    if (!r->user) return NULL;
  }
  Py_INCREF(r->user);
  return r->user;
}

static View rx_view(ReceivedObject *r) {
  return (View){r->ptr, &r->meta, kDLCUDA, r->device, r->stream, 1};
}

typedef struct {
  uintptr_t stream;
  gpuipc_received rx;
} RecvCtx;

static gpuipc_status op_recv(ConnObject *c, void *v) {
  RecvCtx *x = v;
  x->rx.size = sizeof x->rx;
  return gpuipc_conn_recv(c->c, S(x->stream), &x->rx);
}

/* bool keyword: NULL/None -> dflt. -1 with a TypeError. */
static int kw_bool(PyObject *o, const char *fn, const char *name, int dflt, int *out) {
  if (!o || o == Py_None) {
    *out = dflt;
    return 0;
  }
  if (!PyBool_Check(o)) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be True or False, not %.80s", fn, name,
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  *out = o == Py_True;
  return 0;
}

/* The stream a receive that returns torch tensors waits on: stream= when
 * given, else torch's current stream on the device the connection's last
 * buffer was on (at first: torch's current device). */
static int torch_recv_stream(ConnObject *c, PyObject *stream_o, int *dev, uintptr_t *stream) {
  if (torch_ready() < 0) return -1;
  *dev = c->torch_dev;
  if (*dev < 0 && torch_current_device(dev) < 0) return -1;
  if (stream_o && stream_o != Py_None) return parse_stream(stream_o, stream);
  return torch_current_stream(*dev, stream);
}

/* After a receive on `stream` (device guessed `dev`; given: stream= was
 * the caller's) of a buffer on device `bdev`: the stream torch's work on
 * the tensor runs on (torch's current stream of bdev: `stream` itself when
 * the guess was right and none was given), ordered after `stream` when it
 * is another one. That stream is what the lease is released on. */
static int torch_use_stream(ConnObject *c, int dev, int bdev, int given, uintptr_t stream,
                            uintptr_t *use) {
  c->torch_dev = bdev;
  *use = stream;
  if (bdev == dev && !given) return 0; /* the guess was right: that stream is torch's */
  if (torch_current_stream(bdev, use) < 0) return -1;
  if (*use != stream && order_streams(bdev, stream, *use) < 0) return -1;
  return 0;
}

/* Received -> torch tensor (with its meta when with_meta). Takes r. */
static PyObject *rx_to_torch(ReceivedObject *r, int with_meta) {
  View v = rx_view(r);
  v.has_stream = 0; /* ordered already */
  PyObject *t = torch_tensor((PyObject *)r, &v, &r->box);
  PyObject *ret = t;
  if (t && with_meta) {
    PyObject *m = rx_user(r);
    ret = m ? PyTuple_Pack(2, t, m) : NULL;
    Py_XDECREF(m);
    Py_DECREF(t);
  }
  Py_DECREF(r); /* the tensor holds it now */
  return ret;
}

/* What recv and recv_batch take alike, from a[0..4] = stream, timeout,
 * spin_us, as_torch, with_meta: the stream is torch's current one (on
 * *dev) for as_torch when none is given. -1 with an exception. */
typedef struct {
  int tmo, spin, as_torch, with_meta, dev;
  uintptr_t stream;
} RecvOpts;

static int recv_opts(ConnObject *c, const char *what, PyObject *const *a, RecvOpts *o) {
  o->dev = 0;
  o->stream = 0;
  if (kw_bool(a[3], what, "as_torch", 0, &o->as_torch) < 0 ||
      kw_bool(a[4], what, "with_meta", 0, &o->with_meta) < 0 ||
      parse_timeout(a[1], c->timeout_ms, &o->tmo) < 0 || parse_spin(a[2], c, &o->spin) < 0)
    return -1;
  if (o->with_meta && !o->as_torch) {
    PyErr_Format(PyExc_ValueError, "%s: with_meta=True goes with as_torch=True (a "
                 "Received has its .meta)", what);
    return -1;
  }
  return o->as_torch ? torch_recv_stream(c, a[0], &o->dev, &o->stream)
                     : parse_stream(a[0], &o->stream);
}

static PyObject *Conn_recv(ConnObject *c, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
  static const char *const names[] = {"stream", "timeout", "spin_us", "as_torch", "with_meta"};
  PyObject *a[5];
  if (gpy_args("recv", args, nargs, kwnames, 0, 0, names, 5, a) < 0) return NULL;
  RecvOpts o;
  if (recv_opts(c, "recv", a, &o) < 0) return NULL;
  RecvCtx x;
  x.stream = o.stream;
  int tmo = o.tmo, spin = o.spin, as_torch = o.as_torch, with_meta = o.with_meta,
      dev = o.dev;
  gpuipc_status st;
  if (conn_run_spin(c, tmo, spin, 0, op_recv, &x, &st) < 0) return NULL;
  if (st != GPUIPC_OK) return conn_status(st, "recv", tmo);
  uintptr_t use = x.stream;
  if (as_torch &&
      torch_use_stream(c, dev, x.rx.device, a[0] && a[0] != Py_None, x.stream, &use) < 0) {
    LOCK(); /* the buffer goes back at once */
    if (c->c) gpuipc_conn_release(c->c, x.rx.id, S(x.stream));
    UNLOCK();
    return NULL;
  }
  PyObject *r = rx_new(c, &x.rx, use, 1);
  if (!r || !as_torch) return r;
  return rx_to_torch((ReceivedObject *)r, with_meta);
}

/* --- batches and broadcast ------------------------------------------------ */

/* One buffer of a batch or a broadcast: an arena Block, or an array whose
 * memory lies in a live Block of this process (found as conn.send finds
 * it). Other memory has no place in them: a wrapped buffer goes by
 * descriptor, one frame and one signal of its own, which would break the
 * batch's all-or-nothing promise. */
typedef struct {
  BlockObject *blk; /* strong reference */
  ArrMeta meta;     /* the array, offset from the block's start */
  uintptr_t from;   /* the stream its data is ordered on */
  int has_from;
} ArenaItem;

/* The pending TypeError/ValueError again, with "where: " in front (other
 * exceptions, gpuipc's own with their status, pass unchanged). */
static void item_error(const char *where) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *exc = PyErr_GetRaisedException();
#else
  PyObject *t, *exc, *tb;
  PyErr_Fetch(&t, &exc, &tb);
  PyErr_NormalizeException(&t, &exc, &tb);
#endif
  PyObject *et = exc ? (PyObject *)Py_TYPE(exc) : NULL;
  PyObject *m = NULL;
  if (et && !PyObject_IsSubclass(et, ErrorBase) &&
      (PyErr_GivenExceptionMatches(et, PyExc_TypeError) ||
       PyErr_GivenExceptionMatches(et, PyExc_ValueError)))
    m = PyObject_Str(exc);
  if (m) {
    PyErr_Format(et, "%s: %U", where, m);
    Py_DECREF(m);
#if PY_VERSION_HEX >= 0x030C0000
    Py_DECREF(exc);
#else
    Py_XDECREF(t);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
#endif
    return;
  }
  PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(exc);
#else
  PyErr_Restore(t, exc, tb);
#endif
}

/* Finds the arena block under obj (where: "send_batch: item 3" for the
 * messages). 0, or -1 with an exception. */
static int arena_item(PyObject *obj, uintptr_t stream, const char *where, ArenaItem *it) {
  memset(it, 0, sizeof *it);
  if (Py_TYPE(obj) == &BlockType) {
    BlockObject *b = (BlockObject *)obj;
    if (!b->b) {
      raise_msg(GPUIPC_E_INVALID_ARG, where, "block was freed");
      return -1;
    }
    Py_INCREF(b);
    it->blk = b;
    it->meta = b->meta;
    it->from = b->stream;
    it->has_from = 1;
    return 0;
  }
  if (Py_TYPE(obj) == &BufferType) {
    PyErr_Format(PyExc_TypeError, "%s is a Buffer, not arena memory: batches and "
                 "broadcasts carry arena blocks only (send it with conn.send)", where);
    return -1;
  }
  Foreign f;
  if (foreign_get(obj, stream, &f) < 0) {
    item_error(where);
    return -1;
  }
  int rc = -1;
  BlockObject *b = f.nbytes ? block_find(f.ptr, f.nbytes) : NULL;
  if (f.nbytes == 0) {
    PyErr_Format(PyExc_ValueError, "%s: an empty array has no memory to send", where);
  } else if (!b) {
    PyErr_Format(PyExc_TypeError, "%s (%.80s) is not arena memory (a Block, or an array "
                 "inside one): batches and broadcasts carry arena blocks only (send it "
                 "with conn.send)", where, Py_TYPE(obj)->tp_name);
  } else {
    Py_INCREF(b);
    it->blk = b;
    it->meta = f.meta;
    it->meta.offset = (uint64_t)((char *)f.ptr - (char *)b->ptr);
    it->from = f.stream;
    it->has_from = f.has_stream;
    rc = 0;
  }
  Py_XDECREF(f.owner);
  return rc;
}

/* Orders `stream` after the stream of each item (each distinct one once). */
static int order_items(const ArenaItem *it, size_t n, uintptr_t stream) {
  for (size_t i = 0; i < n; i++) {
    if (!it[i].has_from || it[i].from == stream) continue;
    size_t k = 0;
    while (k < i && !(it[k].has_from && it[k].from == it[i].from &&
                      it[k].blk->device == it[i].blk->device))
      k++;
    if (k == i && order_streams(it[i].blk->device, it[i].from, stream) < 0) return -1;
  }
  return 0;
}

/* The exception raise_msg raises, as an object (a result in a list). */
static PyObject *exc_obj(gpuipc_status st, const char *what, const char *detail) {
  raise_msg(st, what, detail);
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  PyErr_NormalizeException(&t, &v, &tb);
  if (v && tb) PyException_SetTraceback(v, tb);
  Py_XDECREF(t);
  Py_XDECREF(tb);
  return v;
#endif
}

typedef struct {
  ArenaItem *it;
  gpuipc_block **blocks;
  const void **metas;
  size_t *lens;
  size_t n;
  uintptr_t stream;
  Py_ssize_t freed; /* an item whose block was freed while the call waited */
} BatchCtx;

static gpuipc_status op_send_batch(ConnObject *c, void *v) {
  BatchCtx *x = v;
  /* Another thread may free a block while this call waits (with neither
   * the GIL nor the lock): looked at again before each try. */
  for (size_t i = 0; i < x->n; i++) {
    if (!x->it[i].blk->b) {
      x->freed = (Py_ssize_t)i;
      return GPUIPC_E_INVALID_ARG;
    }
    x->blocks[i] = x->it[i].blk->b;
  }
  return gpuipc_conn_send_batch(c->c, x->blocks, x->n, S(x->stream), x->metas, x->lens);
}

static PyObject *Conn_send_batch(ConnObject *c, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
  static const char *const names[] = {"objs", "stream", "metas", "timeout"};
  PyObject *a[4];
  if (gpy_args("send_batch", args, nargs, kwnames, 1, 1, names, 4, a) < 0) return NULL;
  PyObject *objs = a[0], *stream_o = a[1], *metas_o = a[2] ? a[2] : Py_None, *tmo_o = a[3];
  if (!conn_ok(c)) return NULL;
  uintptr_t stream;
  int tmo;
  if (parse_stream(stream_o, &stream) < 0 || parse_timeout(tmo_o, c->timeout_ms, &tmo) < 0)
    return NULL;
  PyObject *seq = PySequence_Fast(objs, "send_batch: objs must be a sequence of arena "
                                  "blocks (or arrays inside them)");
  if (!seq) return NULL;
  PyObject *mseq = NULL, *ret = NULL;
  BatchCtx x = {0};
  x.freed = -1;
  x.stream = stream;
  uint8_t *wire = NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), done = 0;
  if (n == 0) { /* nothing to send */
    ret = Py_None;
    Py_INCREF(ret);
    goto out;
  }
  if (n > GPUIPC_BATCH_MAX) {
    PyErr_Format(PyExc_ValueError, "send_batch: %zd buffers, at most %d in one batch", n,
                 GPUIPC_BATCH_MAX);
    goto out;
  }
  if (metas_o != Py_None) {
    mseq = PySequence_Fast(metas_o, "send_batch: metas must be a sequence (one bytes "
                           "object or None per buffer)");
    if (!mseq) goto out;
    if (PySequence_Fast_GET_SIZE(mseq) != n) {
      PyErr_Format(PyExc_ValueError, "send_batch: %zd metas for %zd buffers",
                   PySequence_Fast_GET_SIZE(mseq), n);
      goto out;
    }
  }
  x.n = (size_t)n;
  x.it = PyMem_Calloc(x.n, sizeof *x.it);
  x.blocks = PyMem_Calloc(x.n, sizeof *x.blocks);
  x.metas = PyMem_Calloc(x.n, sizeof *x.metas);
  x.lens = PyMem_Calloc(x.n, sizeof *x.lens);
  wire = PyMem_Malloc(x.n * GPUIPC_META_MAX);
  if (!x.it || !x.blocks || !x.metas || !x.lens || !wire) {
    PyErr_NoMemory();
    goto out;
  }
  for (; done < n; done++) {
    char where[64];
    snprintf(where, sizeof where, "send_batch: item %zd", done);
    if (arena_item(PySequence_Fast_GET_ITEM(seq, done), stream, where, &x.it[done]) < 0)
      goto out;
    Py_buffer um;
    if (get_user_meta(mseq ? PySequence_Fast_GET_ITEM(mseq, done) : NULL, &um) < 0) {
      item_error(where);
      goto out;
    }
    uint8_t *w = wire + (size_t)done * GPUIPC_META_MAX;
    int rc = meta_encode(&x.it[done].meta, um.buf, um.len, w, &x.lens[done]);
    if (um.obj) PyBuffer_Release(&um);
    if (rc < 0) {
      item_error(where);
      goto out;
    }
    x.metas[done] = w;
  }
  if (order_items(x.it, x.n, stream) < 0) goto out;
  gpuipc_status st;
  if (conn_run(c, tmo, 1, op_send_batch, &x, &st) < 0) goto out;
  if (x.freed >= 0) {
    char d[80];
    snprintf(d, sizeof d, "item %zd: its block was freed meanwhile", x.freed);
    raise_msg(GPUIPC_E_INVALID_ARG, "send_batch", d);
    goto out;
  }
  if (st != GPUIPC_OK) { conn_status(st, "send_batch", tmo); goto out; }
  ret = Py_None;
  Py_INCREF(ret);
out:
  for (size_t i = 0; x.it && i < x.n; i++) Py_XDECREF(x.it[i].blk);
  PyMem_Free(x.it);
  PyMem_Free(x.blocks);
  PyMem_Free(x.metas);
  PyMem_Free(x.lens);
  PyMem_Free(wire);
  Py_XDECREF(mseq);
  Py_DECREF(seq);
  return ret;
}

typedef struct {
  uintptr_t stream;
  gpuipc_received *rx;
  size_t max, n;
} RecvBatchCtx;

static gpuipc_status op_recv_batch(ConnObject *c, void *v) {
  RecvBatchCtx *x = v;
  return gpuipc_conn_recv_batch(c->c, S(x->stream), x->rx, x->max, &x->n);
}

/* The leases of one recv_batch(as_torch=True): each tensor's DLPack
 * tensor holds a reference to it, so it dies with the last of them, and
 * then gives the whole batch back in one gpuipc_conn_release_batch per
 * GPUIPC_BATCH_MAX (one release signal), on the stream the tensors were
 * ordered on. Internal: never seen from Python. */
typedef struct {
  PyObject_HEAD
  ConnObject *conn;
  uintptr_t stream;
  size_t n;
  uint64_t *ids;
  DLBox *boxes; /* embedded boxes, one per tensor */
} HoldObject;

static void Hold_dealloc(HoldObject *h) {
  uint64_t *ids = h->ids;
  for (size_t i = 0; i < h->n;) {
    size_t k = h->n - i < GPUIPC_BATCH_MAX ? h->n - i : GPUIPC_BATCH_MAX;
    LOCK();
    gpuipc_conn *gc = conn_rx(h->conn); /* a close here keeps them open */
    if (gc) gpuipc_conn_release_batch(gc, ids + i, k, S(h->stream));
    UNLOCK();
    i += k;
  }
  g_count.live_received -= (long long)h->n;
  if (h->n) conn_held_drop(h->conn); /* the last after a close closes it */
  Py_DECREF(h->conn);
  PyMem_Free(h->ids);
  PyMem_Free(h->boxes);
  PyObject_Free(h);
}

static PyTypeObject HoldType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc._BatchHold",
    .tp_basicsize = sizeof(HoldObject),
    .tp_dealloc = (destructor)Hold_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "the leases of one recv_batch(as_torch=True), given back with its last tensor",
};

/* The tensors (or (tensor, meta) pairs) of a batch received on stream.
 * On failure everything received goes back. */
static PyObject *batch_to_torch(ConnObject *c, const gpuipc_received *rx, size_t n,
                                uintptr_t stream, int with_meta) {
  if (PyType_Ready(&HoldType) < 0) return NULL;
  HoldObject *h = PyObject_New(HoldObject, &HoldType);
  uint64_t *ids = PyMem_Malloc(n * sizeof *ids);
  DLBox *boxes = PyMem_Calloc(n, sizeof *boxes);
  PyObject *list = PyList_New((Py_ssize_t)n);
  if (!h || !ids || !boxes || !list) {
    Py_XDECREF(list);
    PyMem_Free(ids);
    PyMem_Free(boxes);
    uint64_t tmp[GPUIPC_BATCH_MAX];
    for (size_t i = 0; i < n;) {
      size_t k = 0;
      for (; k < GPUIPC_BATCH_MAX && i < n; k++, i++) tmp[k] = rx[i].id;
      LOCK();
      if (c->c) gpuipc_conn_release_batch(c->c, tmp, k, S(stream));
      UNLOCK();
    }
    if (h) PyObject_Free(h);
    return PyErr_NoMemory();
  }
  Py_INCREF(c);
  h->conn = c;
  h->stream = stream;
  h->n = n;
  h->ids = ids;
  h->boxes = boxes;
  c->held++;
  g_count.live_received += (long long)n;
  for (size_t i = 0; i < n; i++) ids[i] = rx[i].id;
  /* from here on h gives everything back when it dies */
  for (size_t i = 0; i < n; i++) {
    ArrMeta m;
    const uint8_t *u;
    size_t ul;
    meta_decode(rx[i].meta, rx[i].meta_len, rx[i].length, &m, &u, &ul);
    View v = {rx[i].ptr, &m, kDLCUDA, rx[i].device, stream, 0};
    boxes[i].embedded = 1;
    PyObject *t = torch_tensor((PyObject *)h, &v, &boxes[i]);
    if (t && with_meta) {
      PyObject *mb = PyBytes_FromStringAndSize((const char *)u, (Py_ssize_t)ul);
      PyObject *pair = mb ? PyTuple_Pack(2, t, mb) : NULL;
      Py_XDECREF(mb);
      Py_DECREF(t);
      t = pair;
    }
    if (!t) {
      Py_DECREF(list);
      Py_DECREF(h);
      return NULL;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, t);
  }
  Py_DECREF(h); /* the tensors hold it */
  return list;
}

static PyObject *Conn_recv_batch(ConnObject *c, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
  static const char *const names[] = {"max",     "stream",   "timeout",
                                      "spin_us", "as_torch", "with_meta"};
  PyObject *a[6];
  if (gpy_args("recv_batch", args, nargs, kwnames, 1, 1, names, 6, a) < 0) return NULL;
  Py_ssize_t max = PyNumber_AsSsize_t(a[0], PyExc_OverflowError);
  if (max == -1 && PyErr_Occurred()) return NULL;
  if (max < 1) {
    PyErr_Format(PyExc_ValueError, "recv_batch: max must be >= 1, not %zd", max);
    return NULL;
  }
  RecvOpts o;
  if (recv_opts(c, "recv_batch", a + 1, &o) < 0) return NULL;
  RecvBatchCtx x = {0};
  x.stream = o.stream;
  int tmo = o.tmo, spin = o.spin, as_torch = o.as_torch, with_meta = o.with_meta,
      dev = o.dev;
  if (!conn_ok(c)) return NULL;
  /* No more can be queued than a peer may have outstanding (at most 65536). */
  x.max = max > 65536 ? 65536 : (size_t)max;
  x.rx = PyMem_Malloc(x.max * sizeof *x.rx);
  if (!x.rx) return PyErr_NoMemory();
  for (size_t i = 0; i < x.max; i++) x.rx[i].size = sizeof x.rx[i];
  PyObject *list = NULL;
  gpuipc_status st;
  if (conn_run_spin(c, tmo, spin, 0, op_recv_batch, &x, &st) < 0) goto out;
  if (st != GPUIPC_OK) { conn_status(st, "recv_batch", tmo); goto out; }
  if (as_torch) {
    /* one device per batch: torch's stream of the first buffer's */
    uintptr_t use = x.stream;
    if (torch_use_stream(c, dev, x.rx[0].device, a[1] && a[1] != Py_None, x.stream, &use) < 0)
      use = x.stream;
    for (size_t i = 1; !PyErr_Occurred() && i < x.n; i++)
      if (x.rx[i].device != x.rx[0].device) {
        uintptr_t o;
        if (torch_current_stream(x.rx[i].device, &o) == 0 && o != x.stream)
          order_streams(x.rx[i].device, x.stream, o);
        break;
      }
    if (PyErr_Occurred()) {
      uint64_t ids[GPUIPC_BATCH_MAX];
      for (size_t i = 0; i < x.n;) {
        size_t k = 0;
        for (; k < GPUIPC_BATCH_MAX && i < x.n; k++, i++) ids[k] = x.rx[i].id;
        LOCK();
        if (c->c) gpuipc_conn_release_batch(c->c, ids, k, S(x.stream));
        UNLOCK();
      }
      goto out;
    }
    list = batch_to_torch(c, x.rx, x.n, use, with_meta);
    goto out;
  }
  list = PyList_New((Py_ssize_t)x.n);
  size_t i = 0;
  for (; list && i < x.n; i++) {
    PyObject *r = rx_new(c, &x.rx[i], x.stream, 0);
    if (!r) break;
    PyList_SET_ITEM(list, (Py_ssize_t)i, r);
  }
  if (i < x.n) {
    /* Out of memory: what has no Received yet goes back here, those made
     * go with the list. */
    uint64_t ids[GPUIPC_BATCH_MAX];
    LOCK();
    while (c->c && i < x.n) {
      size_t k = 0;
      for (; k < GPUIPC_BATCH_MAX && i < x.n; k++, i++) ids[k] = x.rx[i].id;
      gpuipc_conn_release_batch(c->c, ids, k, S(x.stream));
    }
    UNLOCK();
    Py_CLEAR(list);
  }
out:
  PyMem_Free(x.rx);
  return list;
}

/* release_batch of a sequence of Received (only: those of this connection
 * alone, or NULL for any). Everything is checked before anything is
 * released; then each connection's buffers go in one
 * gpuipc_conn_release_batch per GPUIPC_BATCH_MAX of them. stream_o NULL:
 * each buffer's own receive stream, as Received.release(). */
static PyObject *release_list(PyObject *items, PyObject *stream_o, ConnObject *only,
                              const char *what) {
  uintptr_t stream = 0;
  if (stream_o && parse_stream(stream_o, &stream) < 0) return NULL;
  PyObject *seq = PySequence_Fast(items, "release_batch: give a sequence of Received");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), marked = 0;
  PyObject **v = PySequence_Fast_ITEMS(seq);
  PyObject *ret = NULL;
  Py_ssize_t *ord = NULL;
  char *taken = NULL;
  /* 1: every item checked (marks find one named twice) */
  for (; marked < n; marked++) {
    if (Py_TYPE(v[marked]) != &ReceivedType) {
      PyErr_Format(PyExc_TypeError, "%s: item %zd is not a Received (%.80s); nothing "
                   "was released", what, marked, Py_TYPE(v[marked])->tp_name);
      goto out;
    }
    ReceivedObject *r = (ReceivedObject *)v[marked];
    if (!r->held) {
      PyErr_Format(PyExc_ValueError, "%s: item %zd was released already; nothing was "
                   "released", what, marked);
      goto out;
    }
    if (only && r->conn != only) {
      PyErr_Format(PyExc_ValueError, "%s: item %zd came over another connection; "
                   "nothing was released", what, marked);
      goto out;
    }
    if (r->mark) {
      PyErr_Format(PyExc_ValueError, "%s: item %zd is item %d again; nothing was "
                   "released", what, marked, r->mark - 1);
      goto out;
    }
    r->mark = (int)marked + 1;
  }
  if (n == 0) {
    ret = Py_None;
    Py_INCREF(ret);
    goto out;
  }
  /* 2: the items of each connection together, in the order of the list */
  ord = PyMem_Malloc((size_t)n * sizeof *ord);
  taken = PyMem_Calloc((size_t)n, 1);
  if (!ord || !taken) { PyErr_NoMemory(); goto out; }
  Py_ssize_t k = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    if (taken[i]) continue;
    ConnObject *c = ((ReceivedObject *)v[i])->conn;
    for (Py_ssize_t j = i; j < n; j++)
      if (!taken[j] && ((ReceivedObject *)v[j])->conn == c) {
        taken[j] = 1;
        ord[k++] = j;
      }
  }
  /* 3: by default each group goes on its first buffer's stream, after the
   * work queued on the others' (what each Received.release() would wait
   * for) */
  if (!stream_o) {
    for (Py_ssize_t g = 0; g < n;) {
      ReceivedObject *r0 = (ReceivedObject *)v[ord[g]];
      Py_ssize_t e = g + 1;
      while (e < n && ((ReceivedObject *)v[ord[e]])->conn == r0->conn) e++;
      for (Py_ssize_t i = g + 1; i < e; i++) {
        ReceivedObject *r = (ReceivedObject *)v[ord[i]];
        Py_ssize_t j = g;
        while (j < i && ((ReceivedObject *)v[ord[j]])->stream != r->stream) j++;
        if (j == i && order_streams(r->device, r->stream, r0->stream) < 0) goto out;
      }
      g = e;
    }
  }
  /* 4: the releases */
  uint64_t ids[GPUIPC_BATCH_MAX];
  for (Py_ssize_t g = 0; g < n;) {
    ReceivedObject *r0 = (ReceivedObject *)v[ord[g]];
    uintptr_t s = stream_o ? stream : r0->stream;
    Py_ssize_t e = g;
    size_t m = 0;
    while (e < n && m < GPUIPC_BATCH_MAX && ((ReceivedObject *)v[ord[e]])->conn == r0->conn)
      ids[m++] = ((ReceivedObject *)v[ord[e++]])->id;
    gpuipc_status st = GPUIPC_OK;
    LOCK();
    /* A connection closed here keeps what is held open (c->linger). */
    gpuipc_conn *gc = conn_rx(r0->conn);
    if (gc) st = gpuipc_conn_release_batch(gc, ids, m, S(s));
    UNLOCK();
    if (st != GPUIPC_OK) { raise_st(st, what); goto out; }
    for (Py_ssize_t i = g; i < e; i++) ((ReceivedObject *)v[ord[i]])->held = 0;
    for (Py_ssize_t i = g; i < e; i++) conn_held_drop(r0->conn); /* the last closes it */
    g = e;
  }
  ret = Py_None;
  Py_INCREF(ret);
out:
  for (Py_ssize_t i = 0; i < marked; i++) ((ReceivedObject *)v[i])->mark = 0;
  PyMem_Free(ord);
  PyMem_Free(taken);
  Py_DECREF(seq);
  return ret;
}

static PyObject *Conn_release_batch(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"received", "stream", NULL};
  PyObject *items, *stream_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwl, &items, &stream_o)) return NULL;
  return release_list(items, stream_o, c, "release_batch");
}

PyObject *mod_release_batch(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"received", "stream", NULL};
  PyObject *items, *stream_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwl, &items, &stream_o)) return NULL;
  return release_list(items, stream_o, NULL, "release_batch");
}

/* broadcast(conns, block, ...): the connections are non-blocking, so
 * gpuipc_conn_broadcast says WOULD_BLOCK for one that is not ready (no
 * free slot, no room in its socket, its setup waiting for the peer): those
 * are tried again, in a broadcast of their own, once their sockets say
 * something changed, until each one's timeout. The others are not held
 * back: a connection's failure is its entry in the list. The waits are the
 * package's one loop (gpy_wait_loop): an attempt is one pass over the
 * connections still pending, a wait a poll of their sockets (no call of
 * gpuipc_conn_wait: it watches one connection), bounded by the soonest of
 * their deadlines. */
typedef struct {
  ConnObject **cs;
  Py_ssize_t n;
  PyObject *list;
  ArenaItem *it;
  uintptr_t stream;
  const uint8_t *wire;
  size_t wlen;
  int have_tmo, tmo;
  gpuipc_conn **gc;
  Py_ssize_t *pend, *idx;
  gpuipc_status *sts;
  int64_t *deadline; /* ms, -1 none */
  struct pollfd *pfd;
  Py_ssize_t np;
  int64_t soonest; /* ms, -1 none */
  int pass;
} BcastRun;

static gpuipc_status bc_try(void *v) {
  BcastRun *r = v;
  ConnObject **cs = r->cs;
  if (r->np == 0) return GPUIPC_OK;
  /* 1: one broadcast to every connection still pending */
  Py_ssize_t k = 0, closed_here = 0;
  gpuipc_status whole = GPUIPC_OK;
  char why[512] = "";
  int freed = 0;
  LOCK();
  for (Py_ssize_t j = 0; j < r->np; j++) {
    ConnObject *c = cs[r->pend[j]];
    if (!c->c) {
      r->pend[closed_here++] = r->pend[j]; /* answered below, after the lock */
      continue;
    }
    r->idx[k] = r->pend[j];
    r->gc[k++] = c->c;
  }
  if (k > 0 && !r->it->blk->b) {
    freed = 1;
  } else if (k > 0) {
    for (Py_ssize_t j = 0; j < k; j++) r->sts[j] = GPUIPC__STATUS_END; /* not set */
    whole = gpuipc_conn_broadcast(r->gc, (size_t)k, r->it->blk->b, S(r->stream), r->wire,
                                  r->wlen, r->sts);
    if (whole != GPUIPC_OK) snprintf(why, sizeof why, "%s", gpuipc_last_error());
  }
  for (Py_ssize_t j = 0; j < k; j++) r->pfd[j].fd = gpuipc_conn_get_fd(r->gc[j]);
  UNLOCK();
  flush_decrefs();
  for (Py_ssize_t j = 0; j < closed_here; j++) {
    PyObject *e = exc_obj(GPUIPC_E_CLOSED, "broadcast", "connection closed here");
    if (!e) return GPY_RAISED;
    PyList_SET_ITEM(r->list, r->pend[j], e);
  }
  r->np = 0;
  if (freed || (whole != GPUIPC_OK && k > 0 && r->sts[0] == GPUIPC__STATUS_END)) {
    /* The call failed as a whole: nothing was sent in this pass. */
    gpuipc_status st = freed ? GPUIPC_E_INVALID_ARG : whole;
    const char *d = freed ? "the block was freed meanwhile" : why;
    if (r->pass == 0) {
      raise_msg(st, "broadcast", d);
      return GPY_RAISED;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
      PyObject *e = exc_obj(st, "broadcast", d);
      if (!e) return GPY_RAISED;
      PyList_SET_ITEM(r->list, r->idx[j], e);
    }
    return GPUIPC_OK;
  }
  r->pass++;
  /* 2: the answers. The library's message tells of the first connection
   * that failed (after "(the first that failed): "). */
  Py_ssize_t fj = 0;
  while (fj < k && r->sts[fj] == GPUIPC_OK) fj++;
  const char *first = strstr(why, "(the first that failed): ");
  first = first ? first + strlen("(the first that failed): ") : why;
  int64_t now = now_ms();
  r->soonest = -1;
  for (Py_ssize_t j = 0; j < k; j++) {
    Py_ssize_t i = r->idx[j];
    gpuipc_status st = r->sts[j];
    if (st == GPUIPC_E_WOULD_BLOCK && !(r->deadline[i] >= 0 && now >= r->deadline[i])) {
      r->pfd[r->np].fd = r->pfd[j].fd;
      r->pend[r->np++] = i;
      if (r->deadline[i] >= 0 && (r->soonest < 0 || r->deadline[i] < r->soonest))
        r->soonest = r->deadline[i];
      continue;
    }
    PyObject *e;
    if (st == GPUIPC_OK) {
      e = Py_None;
      Py_INCREF(e);
    } else {
      char d[640];
      if (st == GPUIPC_E_WOULD_BLOCK) {
        snprintf(d, sizeof d, "conns[%zd] not ready within %d ms: no free slot, or no "
                 "room in its socket", i, r->have_tmo ? r->tmo : cs[i]->timeout_ms);
        st = GPUIPC_E_TIMEOUT;
      } else if (j == fj) {
        snprintf(d, sizeof d, "conns[%zd]: %s", i, first);
      } else {
        snprintf(d, sizeof d, "conns[%zd], peer pid %d", i, cs[i]->peer_pid);
      }
      e = exc_obj(st, "broadcast", d);
      if (!e) return GPY_RAISED;
    }
    PyList_SET_ITEM(r->list, i, e);
  }
  return r->np ? GPUIPC_E_WOULD_BLOCK : GPUIPC_OK;
}

/* 3: until a pending connection's socket has news, a slice, or the
 * soonest deadline */
static gpuipc_status bc_sleep(void *v, short events, int timeout_ms, int spin_us) {
  BcastRun *r = v;
  int left = timeout_ms;
  if (r->soonest >= 0) {
    int64_t l = r->soonest - now_ms();
    if (l < left) left = l > 0 ? (int)l : 0;
  }
  for (Py_ssize_t j = 0; j < r->np; j++) {
    r->pfd[j].events = events;
    r->pfd[j].revents = 0;
  }
  gpuipc_status w = gpy_poll_fds(r->pfd, (nfds_t)r->np, left, 0);
  if (w == GPUIPC_E_SYSTEM) {
    PyErr_SetFromErrno(PyExc_OSError);
    return GPY_RAISED;
  }
  return w;
}

PyObject *mod_broadcast(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"conns", "block", "stream", "meta", "timeout", NULL};
  PyObject *conns_o, *block_o, *stream_o = Py_None, *meta_o = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$OOO", kwl, &conns_o, &block_o, &stream_o,
                                   &meta_o, &tmo_o))
    return NULL;
  uintptr_t stream;
  int tmo = 0, have_tmo = tmo_o != NULL;
  if (parse_stream(stream_o, &stream) < 0 || (have_tmo && parse_timeout(tmo_o, 0, &tmo) < 0))
    return NULL;
  /* A tuple of them: the caller's list may change while this call waits
   * without the GIL. */
  PyObject *seq = PySequence_Tuple(conns_o);
  if (!seq) {
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError, "broadcast: conns must be a sequence of Connections");
    }
    return NULL;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  ConnObject **cs = (ConnObject **)PySequence_Fast_ITEMS(seq);
  PyObject *list = NULL, *ret = NULL;
  ArenaItem it = {0};
  Py_buffer um = {0};
  BcastRun r = {0};
  if (n > GPUIPC_BROADCAST_MAX) {
    PyErr_Format(PyExc_ValueError, "broadcast: %zd connections, at most %d", n,
                 GPUIPC_BROADCAST_MAX);
    goto out;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    if (Py_TYPE(cs[i]) != &ConnType) {
      PyErr_Format(PyExc_TypeError, "broadcast: conns[%zd] is not a Connection (%.80s)", i,
                   Py_TYPE(cs[i])->tp_name);
      goto out;
    }
    for (Py_ssize_t k = 0; k < i; k++)
      if (cs[k] == cs[i]) {
        PyErr_Format(PyExc_ValueError, "broadcast: conns[%zd] and conns[%zd] are the same "
                     "connection", k, i);
        goto out;
      }
  }
  if (arena_item(block_o, stream, "broadcast: the block", &it) < 0) goto out;
  if (get_user_meta(meta_o, &um) < 0) goto out;
  uint8_t wire[GPUIPC_META_MAX];
  size_t wlen = 0;
  if (meta_encode(&it.meta, um.buf, um.len, wire, &wlen) < 0) goto out;
  list = PyList_New(n);
  if (!list) goto out;
  if (n == 0) goto done;
  if (order_items(&it, 1, stream) < 0) goto out;
  size_t un = (size_t)n;
  r.cs = cs;
  r.n = n;
  r.list = list;
  r.it = &it;
  r.stream = stream;
  r.wire = wire;
  r.wlen = wlen;
  r.have_tmo = have_tmo;
  r.tmo = tmo;
  r.soonest = -1;
  r.gc = PyMem_Malloc(un * sizeof *r.gc);
  r.pend = PyMem_Malloc(un * sizeof *r.pend);
  r.idx = PyMem_Malloc(un * sizeof *r.idx);
  r.sts = PyMem_Malloc(un * sizeof *r.sts);
  r.deadline = PyMem_Malloc(un * sizeof *r.deadline);
  r.pfd = PyMem_Malloc(un * sizeof *r.pfd);
  if (!r.gc || !r.pend || !r.idx || !r.sts || !r.deadline || !r.pfd) {
    PyErr_NoMemory();
    goto out;
  }
  int64_t t0 = now_ms();
  for (Py_ssize_t i = 0; i < n; i++) {
    int t = have_tmo ? tmo : cs[i]->timeout_ms;
    r.deadline[i] = t < 0 ? -1 : t0 + t;
    r.pend[r.np++] = i;
  }
  /* each connection's deadline ends its part (bc_try): no overall one */
  gpuipc_status st;
  if (gpy_wait_loop(-1, POLLIN | POLLOUT, 0, bc_try, bc_sleep, &r, &st) < 0) goto out;
done:
  ret = list;
  list = NULL;
out:
  Py_XDECREF(list);
  Py_XDECREF(it.blk);
  if (um.obj) PyBuffer_Release(&um);
  PyMem_Free(r.gc);
  PyMem_Free(r.pend);
  PyMem_Free(r.idx);
  PyMem_Free(r.sts);
  PyMem_Free(r.deadline);
  PyMem_Free(r.pfd);
  Py_DECREF(seq);
  return ret;
}

/* --- messages -------------------------------------------------------------- */

typedef struct {
  const void *data;
  size_t len;
  int fds[GPUIPC_CONN_FDS_MAX];
  int nfds;
} MsgOut;

static gpuipc_status op_send_msg(ConnObject *c, void *v) {
  MsgOut *m = v;
  return gpuipc_conn_send_msg(c->c, m->data, m->len, m->fds, m->nfds);
}

/* A subscribed connection carries its tensor set's frames and nothing else
 * (include/gpuipc/sets.h): a message of the application's would break it. */
static int conn_msg_free(ConnObject *c, const char *what) {
  if (c->tset_refs <= 0) return 1;
  raise_msg(GPUIPC_E_BUSY, what, "a tensor set or subscriber uses this connection, which "
            "then carries the set's traffic only (use another connection for messages)");
  return 0;
}

static PyObject *Conn_send_msg(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"data", "fds", "timeout", NULL};
  Py_buffer data;
  PyObject *fds_o = NULL, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|O$O", kwl, &data, &fds_o, &tmo_o)) return NULL;
  MsgOut m = {data.buf, (size_t)data.len, {0}, 0};
  int tmo;
  PyObject *ret = NULL;
  if (!conn_msg_free(c, "send_msg")) goto out;
  if (parse_timeout(tmo_o, c->timeout_ms, &tmo) < 0) goto out;
  if (fds_o && fds_o != Py_None) {
    PyObject *seq = PySequence_Fast(fds_o, "fds must be a sequence of ints");
    if (!seq) goto out;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > GPUIPC_CONN_FDS_MAX) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_ValueError, "at most %d fds", GPUIPC_CONN_FDS_MAX);
      goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      int fd = PyObject_AsFileDescriptor(PySequence_Fast_GET_ITEM(seq, i));
      if (fd < 0) { Py_DECREF(seq); goto out; }
      m.fds[m.nfds++] = fd;
    }
    Py_DECREF(seq);
  }
  gpuipc_status st;
  if (conn_run(c, tmo, 1, op_send_msg, &m, &st) < 0) goto out;
  if (st != GPUIPC_OK) { conn_status(st, "send_msg", tmo); goto out; }
  ret = Py_None;
  Py_INCREF(ret);
out:
  PyBuffer_Release(&data);
  return ret;
}

typedef struct {
  char *buf;
  size_t cap, len;
  int fds[GPUIPC_CONN_FDS_MAX];
  int nfds;
} MsgIn;

static gpuipc_status op_recv_msg(ConnObject *c, void *v) {
  MsgIn *m = v;
  m->nfds = GPUIPC_CONN_FDS_MAX;
  return gpuipc_conn_recv_msg(c->c, m->buf, m->cap, &m->len, m->fds, &m->nfds);
}

static PyObject *Conn_recv_msg(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", "with_fds", NULL};
  PyObject *tmo_o = NULL;
  int with_fds = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$Op", kwl, &tmo_o, &with_fds)) return NULL;
  if (!conn_msg_free(c, "recv_msg")) return NULL;
  int tmo;
  if (parse_timeout(tmo_o, c->timeout_ms, &tmo) < 0) return NULL;
  MsgIn m;
  memset(&m, 0, sizeof m);
  m.cap = GPUIPC_CONN_MSG_MAX;
  m.buf = PyMem_Malloc(m.cap);
  if (!m.buf) return PyErr_NoMemory();
  gpuipc_status st;
  PyObject *ret = NULL;
  if (conn_run(c, tmo, 0, op_recv_msg, &m, &st) < 0) goto out;
  if (st != GPUIPC_OK) { conn_status(st, "recv_msg", tmo); goto out; }
  PyObject *b = PyBytes_FromStringAndSize(m.buf, (Py_ssize_t)m.len);
  if (!with_fds) {
    for (int i = 0; i < m.nfds; i++) close(m.fds[i]);
    ret = b;
  } else if (b) {
    PyObject *l = PyList_New(m.nfds);
    for (int i = 0; l && i < m.nfds; i++) PyList_SET_ITEM(l, i, PyLong_FromLong(m.fds[i]));
    ret = l ? PyTuple_Pack(2, b, l) : NULL;
    Py_DECREF(b);
    Py_XDECREF(l);
  }
out:
  PyMem_Free(m.buf);
  return ret;
}

/* --- the rest -------------------------------------------------------------- */

static gpuipc_status op_progress(ConnObject *c, void *v) {
  (void)v;
  return gpuipc_conn_progress(c->c, 0);
}

/* progress(timeout): the wait for something to arrive is the one loop's,
 * with an attempt that only says whether a wake-up came. */
typedef struct {
  ConnRun r;
  int woke;
} ProgWait;

static gpuipc_status pw_try(void *v) {
  ProgWait *p = v;
  if (!conn_ok(p->r.c)) return GPY_RAISED;
  return p->woke ? GPUIPC_OK : GPUIPC_E_WOULD_BLOCK;
}

static gpuipc_status pw_sleep(void *v, short events, int timeout_ms, int spin_us) {
  ProgWait *p = v;
  gpuipc_status w = cr_sleep(&p->r, events, timeout_ms, spin_us);
  if (w != GPUIPC_E_TIMEOUT) p->woke = 1; /* ready, or an error the call says */
  return w == GPUIPC_E_TIMEOUT ? w : GPUIPC_OK;
}

static PyObject *Conn_progress(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &tmo_o)) return NULL;
  int tmo = 0;
  if (tmo_o && parse_timeout(tmo_o, 0, &tmo) < 0) return NULL;
  if (!conn_ok(c)) return NULL;
  if (tmo != 0) {
    ProgWait p = {{c, NULL, NULL}, 0};
    gpuipc_status ws;
    if (gpy_wait_loop(tmo, POLLIN, 0, pw_try, pw_sleep, &p, &ws) < 0) return NULL;
  }
  if (!conn_ok(c)) return NULL;
  LOCK();
  gpuipc_status st = op_progress(c, NULL);
  UNLOCK();
  flush_decrefs();
  if (st != GPUIPC_OK) return raise_st(st, "progress");
  Py_RETURN_NONE;
}

static PyObject *Conn_outstanding(ConnObject *c, PyObject *unused) {
  if (!conn_ok(c)) return NULL;
  size_t a = 0, b = 0;
  LOCK();
  gpuipc_status st = gpuipc_conn_get_outstanding(c->c, &a, &b);
  UNLOCK();
  flush_decrefs();
  if (st != GPUIPC_OK) return raise_st(st, "outstanding");
  return Py_BuildValue("(nn)", (Py_ssize_t)a, (Py_ssize_t)b);
}

/* obj is kept (a reference) until the peer's process is gone, by the
 * library's exit call: its watcher, not a pid check here. */
static PyObject *Conn_keep_until_peer_exits(ConnObject *c, PyObject *obj) {
  if (!conn_ok(c)) return NULL;
  Kept *k = kept_new(obj, NULL, NULL, 0);
  if (!k) return NULL;
  LOCK();
  gpuipc_status st = gpuipc_conn_call_when_peer_exits(c->c, kept_done, k);
  UNLOCK();
  if (st != GPUIPC_OK) {
    kept_undo(k);
    return raise_st(st, "keep_until_peer_exits");
  }
  flush_decrefs(); /* a peer gone already: dropped here */
  Py_RETURN_NONE;
}

static PyObject *Conn_open(ConnObject *c, PyObject *args, PyObject *kw) {
  if (!conn_ok(c)) return NULL;
  return open_desc(c, args, kw);
}

static PyObject *Conn_close(ConnObject *c, PyObject *unused) {
  if (c->c && c->tset_refs > 0)
    return raise_msg(GPUIPC_E_BUSY, "close", "a tensor set or subscriber still uses the "
                     "connection (unsubscribe, destroy the set or close the subscriber "
                     "first)");
  if (c->c) {
    /* close may wait for the device (cuCtxSynchronize): no GIL */
    LOCK();
    gpuipc_conn *gc = conn_take(c);
    conn_detach(c);
    Py_BEGIN_ALLOW_THREADS
    gpuipc_conn_close(gc);
    UNLOCK();
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static void Conn_dealloc(ConnObject *c) {
  if (c->weak) PyObject_ClearWeakRefs((PyObject *)c);
  /* Whatever kept it lingering holds a reference to it: none is left. */
  if (c->c || c->linger) {
    LOCK();
    conn_detach(c);
    gpuipc_conn_close(c->linger);
    c->linger = NULL;
    UNLOCK();
  }
  tally_unref(c->tally); /* what is still kept holds its own references */
  PyObject_Free(c);
}

static PyObject *Conn_set_polling(ConnObject *c, PyObject *on) {
  if (!PyBool_Check(on)) {
    PyErr_Format(PyExc_TypeError, "set_polling: give True or False, not %.80s",
                 Py_TYPE(on)->tp_name);
    return NULL;
  }
  if (!conn_ok(c)) return NULL;
  LOCK();
  gpuipc_status st = gpuipc_conn_set_polling(c->c, on == Py_True);
  UNLOCK();
  if (st != GPUIPC_OK) return raise_st(st, "set_polling");
  Py_RETURN_NONE;
}

static PyObject *Conn_fileno(ConnObject *c, PyObject *unused) {
  if (!conn_ok(c)) return NULL;
  return PyLong_FromLong(gpuipc_conn_get_fd(c->c));
}

/* The context manager lets go of what still uses the connection (its
 * tensor-set subscribers closed, sets' subscriptions ended) and closes it;
 * with an exception on its way out, a failure here never replaces it. */
static PyObject *Conn_exit(ConnObject *c, PyObject *args) {
  int raising = PyTuple_Check(args) && PyTuple_GET_SIZE(args) > 0 &&
                PyTuple_GET_ITEM(args, 0) != Py_None;
  PyObject *r = NULL;
  if (!(c->c && c->tset_refs > 0 && sets_let_go(c) < 0)) r = Conn_close(c, NULL);
  if (!r && raising) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return r;
}

static PyObject *Conn_get_peer(ConnObject *c, void *unused) {
  if (!conn_ok(c)) return NULL;
  gpuipc_peer_info pi;
  gpuipc_status st = gpuipc_conn_get_peer(c->c, &pi);
  if (st) return raise_st(st, "peer");
  return Py_BuildValue("(iII)", pi.pid, pi.uid, pi.gid);
}
static PyObject *Conn_get_closed(ConnObject *c, void *unused) { return PyBool_FromLong(c->c == NULL); }
static PyObject *Conn_get_timeout(ConnObject *c, void *unused) {
  if (c->timeout_ms < 0) Py_RETURN_NONE;
  return PyFloat_FromDouble(c->timeout_ms / 1000.0);
}
static int Conn_set_timeout(ConnObject *c, PyObject *v, void *unused) {
  if (!v) { PyErr_SetString(PyExc_AttributeError, "cannot delete timeout"); return -1; }
  return parse_timeout(v, -1, &c->timeout_ms);
}
static PyObject *Conn_get_npending(ConnObject *c, void *unused) {
  flush_decrefs(); /* what the library finished meanwhile */
  return PyLong_FromLong(c->tally ? atomic_load(&c->tally->pending) : 0);
}

/* Docstrings open with their signature ("name($self, /, ...)\n--\n\n", which
 * inspect.signature reads). A timeout left out is the connection's own
 * timeout (Connection.timeout) and None waits forever, so its signature's default is
 * `...` (left out); release_batch's stream left out is each one's receive
 * stream (None: the legacy stream): `...` there too. */
static PyMethodDef Conn_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Conn_send, METH_FASTCALL | METH_KEYWORDS,
     "send($self, /, obj, *, stream=None, meta=None, timeout=..., complete=False)\n--\n\n"
     "send(obj, *, stream=None, meta=None, timeout=..., complete=False): hand a buffer "
     "to the peer. complete=True (arena blocks only): the caller asserts the data is "
     "complete already (it synchronized, or the host wrote it): no stream is queried, "
     "ordered or signalled, and the consumer waits for nothing; if that is not true it "
     "may read stale data"},
    {"recv", (PyCFunction)(void (*)(void))Conn_recv, METH_FASTCALL | METH_KEYWORDS,
     "recv($self, /, *, stream=None, timeout=..., spin_us=None, as_torch=False, "
     "with_meta=False)\n--\n\n"
     "recv(*, stream=None, timeout=..., spin_us=None, as_torch=False, with_meta=False) -> "
     "Received, or a torch.Tensor with as_torch=True ((tensor, meta) with with_meta=True). "
     "Waits up to timeout (None: forever; 0: not at all), looking for spin_us "
     "microseconds without sleeping first (default: the connection's spin_us, else 50). "
     "as_torch=True: the tensor is made in C (torch's DLPack C exchange API where torch "
     "has it, else torch._C._from_dlpack); its data is ordered on torch's current stream "
     "of its device (stream= given: the receive waits on that stream and torch's current "
     "stream is ordered after it), and the lease goes back when the tensor is gone, "
     "ordered after the work queued on that stream by then"},
    {"send_batch", (PyCFunction)(void (*)(void))Conn_send_batch, METH_FASTCALL | METH_KEYWORDS,
     "send_batch($self, /, objs, *, stream=None, metas=None, timeout=...)\n--\n\n"
     "send_batch(objs, *, stream=None, metas=None, timeout=...): hand many arena buffers "
     "to the peer as one operation (one frame, one signal). objs: Blocks, or arrays "
     "inside arena blocks, each with its array metadata as send() encodes it; metas: "
     "None or one bytes object (or None) per buffer. All or nothing: an item that is "
     "not arena memory (TypeError naming its index: send it with send()), a freed "
     "block, metadata too long, more than BATCH_MAX buffers or BATCH_BYTES_MAX bytes "
     "of frame (48 per buffer plus its encoded metadata), more than max_outstanding, "
     "a timeout while waiting for free slots: nothing was sent. An empty sequence "
     "sends nothing."},
    {"recv_batch", (PyCFunction)(void (*)(void))Conn_recv_batch, METH_FASTCALL | METH_KEYWORDS,
     "recv_batch($self, /, max, *, stream=None, timeout=..., spin_us=None, as_torch=False, "
     "with_meta=False)\n--\n\n"
     "recv_batch(max, *, stream=None, timeout=..., spin_us=None, as_torch=False, "
     "with_meta=False) -> [Received], or [torch.Tensor] with as_torch=True ([(tensor, "
     "meta)] with with_meta=True): waits for the first buffer, then takes every one "
     "already arrived, up to max (one stream wait per batch the producer sent among "
     "them). as_torch=True: as recv(as_torch=True), and the batch's leases go back "
     "together, in one release signal, when the last of its tensors is gone"},
    {"release_batch", (PyCFunction)(void (*)(void))Conn_release_batch,
     METH_VARARGS | METH_KEYWORDS,
     "release_batch($self, /, received, stream=...)\n--\n\n"
     "release_batch(received, stream=<each one's receive stream>): give back many "
     "buffers of this connection at once, as gpuipc.release_batch"},
    {"send_msg", (PyCFunction)(void (*)(void))Conn_send_msg, METH_VARARGS | METH_KEYWORDS,
     "send_msg($self, /, data, fds=(), *, timeout=...)\n--\n\nsend_msg(data, fds=(), *, timeout=...)"},
    {"recv_msg", (PyCFunction)(void (*)(void))Conn_recv_msg, METH_VARARGS | METH_KEYWORDS,
     "recv_msg($self, /, *, timeout=..., with_fds=False)\n--\n\n"
     "recv_msg(*, timeout=..., with_fds=False) -> bytes, or (bytes, [fd]) with with_fds"},
    {"progress", (PyCFunction)(void (*)(void))Conn_progress, METH_VARARGS | METH_KEYWORDS,
     "progress($self, /, timeout=0)\n--\n\n"
     "progress(timeout=0): handle incoming releases and departures"},
    {"keep_until_peer_exits", (PyCFunction)Conn_keep_until_peer_exits, METH_O,
     "keep_until_peer_exits($self, obj, /)\n--\n\n"
     "keep_until_peer_exits(obj): keep a reference to obj until the peer's process is "
     "gone (told by the library's peer watcher from the pidfd of the handshake, also "
     "for a peer in another pid namespace; a peer that only closed the connection is "
     "not gone), also after this connection is closed; dropped at once when it is gone "
     "already, else in a later gpuipc call of this process once it exited. For what a "
     "peer may still use that the connection's leases do not cover (memory it opened "
     "from a descriptor). NotSupportedError when its exit cannot be told here (a "
     "kernel without pidfds): nothing is kept then"},
    {"outstanding", (PyCFunction)Conn_outstanding, METH_NOARGS,
     "outstanding($self, /)\n--\n\noutstanding() -> (held_by_peer, held_here)"},
    {"open", (PyCFunction)(void (*)(void))Conn_open, METH_VARARGS | METH_KEYWORDS,
     "open($self, /, desc, fds=(), *, device=None, pidfd_getfd=False)\n--\n\n"
     "open(desc, fds=(), *, device=None) -> Buffer: a descriptor that came over "
     "this connection from its peer (checked against the peer's liveness table; "
     "fd-based kinds also from another container)"},
    {"close", (PyCFunction)Conn_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
     "close the connection: later calls raise ClosedError. Buffers received and not "
     "released (a Received alive, or a tensor made from it) stay mapped and held, and "
     "the connection open underneath, until the last of them is released or dies; the "
     "peer learns of the close then"},
    {"fileno", (PyCFunction)Conn_fileno, METH_NOARGS,
     "fileno($self, /)\n--\n\nthe socket, for selectors/poll"},
    {"set_polling", (PyCFunction)Conn_set_polling, METH_O,
     "set_polling($self, on, /)\n--\n\n"
     "set_polling(on): ring carrier: True says this process calls into the connection "
     "often (recv, progress, a send) and does not sleep on fileno() meanwhile, so the "
     "peer sends no wake-up with its buffers; switch it off before sleeping on fileno() "
     "(while on, a buffer makes it readable only at the next call). Calls that wait in "
     "gpuipc sleep safely either way. No effect on the socket carrier"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Conn_exit, METH_VARARGS,
     "__exit__($self, /, *exc)\n--\n\ncloses it"},
    {NULL}};

static PyGetSetDef Conn_getset[] = {
    {"peer", (getter)Conn_get_peer, NULL, "(pid, uid, gid) of the peer", NULL},
    {"closed", (getter)Conn_get_closed, NULL, NULL, NULL},
    {"timeout", (getter)Conn_get_timeout, (setter)Conn_set_timeout,
     "default limit of waiting calls, seconds (None: forever)", NULL},
    {"wrapped_pending", (getter)Conn_get_npending, NULL,
     "buffers sent outside arenas (wrapped memory, Buffer objects) the peer may still hold", NULL},
    {NULL}};

PyTypeObject ConnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Connection",
    .tp_basicsize = sizeof(ConnObject),
    .tp_dealloc = (destructor)Conn_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A connection to one peer process (gpuipc.connect, Listener.accept).",
    .tp_methods = Conn_methods,
    .tp_getset = Conn_getset,
    .tp_weaklistoffset = offsetof(ConnObject, weak),
};

/* ------------------------------------------------------------------------ */
/* Received                                                                 */
/* ------------------------------------------------------------------------ */

static int rx_alive(ReceivedObject *r) {
  if (!r->held) {
    PyErr_SetString(PyExc_ValueError, "buffer already released");
    return 0;
  }
  return 1;
}

static void rx_release(ReceivedObject *r, uintptr_t stream, unsigned flags,
                       gpuipc_status *st) {
  *st = GPUIPC_OK;
  if (!r->held) return;
  r->held = 0;
  LOCK();
  gpuipc_conn *gc = conn_rx(r->conn);
  if (gc) *st = gpuipc_conn_release_ex(gc, r->id, S(stream), flags);
  UNLOCK();
  conn_held_drop(r->conn); /* the last after a close closes it */
}

static PyObject *Rx_release(ReceivedObject *r, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
  static const char *const names[] = {"stream", "complete"};
  PyObject *a[2];
  if (gpy_args("release", args, nargs, kwnames, 0, 1, names, 2, a) < 0) return NULL;
  PyObject *stream_o = a[0], *complete_o = a[1];
  if (complete_o && !PyBool_Check(complete_o)) {
    PyErr_Format(PyExc_TypeError, "release: complete must be True or False, not %.80s",
                 Py_TYPE(complete_o)->tp_name);
    return NULL;
  }
  uintptr_t s = r->stream;
  if (stream_o && parse_stream(stream_o, &s) < 0) return NULL;
  gpuipc_status st;
  rx_release(r, s, complete_o == Py_True ? GPUIPC_RELEASE_COMPLETE : 0, &st);
  if (st != GPUIPC_OK) return raise_st(st, "release");
  Py_RETURN_NONE;
}

static void Rx_dealloc(ReceivedObject *r) {
  gpuipc_status st;
  rx_release(r, r->stream, 0, &st);
  g_count.live_received--;
  Py_XDECREF(r->user);
  Py_DECREF(r->conn);
  PyObject_Free(r);
}

static PyObject *Rx_cai(ReceivedObject *r, void *u) {
  if (!rx_alive(r)) return NULL;
  View v = rx_view(r);
  return cai_dict(&v);
}
static PyObject *Rx_dlpack(ReceivedObject *r, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
  if (!rx_alive(r)) return NULL;
  View v = rx_view(r);
  return dlpack_export_fast((PyObject *)r, &v, &r->box, args, nargs, kwnames);
}
static PyObject *Rx_dlpack_device(ReceivedObject *r, PyObject *u) {
  View v = rx_view(r);
  return dlpack_device(&v);
}
static PyObject *Rx_exit(ReceivedObject *r, PyObject *a) {
  gpuipc_status st;
  rx_release(r, r->stream, 0, &st);
  if (st != GPUIPC_OK) return raise_st(st, "release");
  Py_RETURN_NONE;
}

ARRAY_GETTERS(Rx, &((ReceivedObject *)o)->meta)

static PyObject *Rx_get(ReceivedObject *r, void *which) {
  switch ((intptr_t)which) {
  case 0: return PyLong_FromUnsignedLongLong(r->id);
  case 1: return PyLong_FromUnsignedLongLong((uintptr_t)r->ptr + r->meta.offset);
  case 2: return PyLong_FromSize_t(meta_extent(&r->meta));
  case 3: return PyLong_FromLong(r->device);
  case 4: return rx_user(r);
  case 5: return PyBool_FromLong(r->held);
  case 6: return PyLong_FromLongLong(stream_report(r->stream));
  case 7: return PyLong_FromSize_t(r->length);
  case 8: Py_INCREF(r->conn); return (PyObject *)r->conn;
  }
  Py_RETURN_NONE;
}

static PyObject *Rx_repr(ReceivedObject *r) {
  PyObject *m = meta_repr_part(&r->meta);
  if (!m) return NULL;
  PyObject *o = PyUnicode_FromFormat("<gpuipc.Received %U device=%d id=%llu%s>", m, r->device,
                                     (unsigned long long)r->id, r->held ? "" : " released");
  Py_DECREF(m);
  return o;
}

/* release's stream left out is the receive stream (None: the legacy
 * stream): its signature's default is `...` (left out). */
static PyMethodDef Rx_methods[] = {
    {"release", (PyCFunction)(void (*)(void))Rx_release, METH_FASTCALL | METH_KEYWORDS,
     "release($self, /, stream=..., *, complete=False)\n--\n\n"
     "release(stream=<the receive stream>, *, complete=False): give the buffer back (after "
     "the work queued on stream). complete=True: the caller asserts its use of the buffer "
     "completed (it synchronized): for a buffer that came without a GPU wait (sent with "
     "complete=True, or from an idle stream) no release write and no reclaim wait; "
     "otherwise an ordinary release"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Rx_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__($self, /, stream=None, *, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "A DLPack capsule of the data"},
    {"__dlpack_device__", (PyCFunction)Rx_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(device_type, device_id) of the data"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Rx_exit, METH_VARARGS,
     "__exit__($self, /, *exc)\n--\n\nreleases it"},
    {NULL}};

static PyGetSetDef Rx_getset[] = {
    {"id", (getter)Rx_get, NULL, "lease id", (void *)0},
    {"ptr", (getter)Rx_get, NULL, "device address of element 0", (void *)1},
    {"nbytes", (getter)Rx_get, NULL, "bytes the array spans", (void *)2},
    {"device", (getter)Rx_get, NULL, "local device ordinal", (void *)3},
    {"meta", (getter)Rx_get, NULL, "the sender's user meta bytes", (void *)4},
    {"held", (getter)Rx_get, NULL, "not released yet", (void *)5},
    {"stream", (getter)Rx_get, NULL, "stream the data is ordered on (1: legacy)", (void *)6},
    {"length", (getter)Rx_get, NULL, "bytes of the whole buffer sent", (void *)7},
    {"connection", (getter)Rx_get, NULL, NULL, (void *)8},
    {"shape", (getter)Rx_shape, NULL, NULL, NULL},
    {"strides", (getter)Rx_strides, NULL, "in elements", NULL},
    {"dtype", (getter)Rx_dtype, NULL, NULL, NULL},
    {"__cuda_array_interface__", (getter)Rx_cai, NULL, NULL, NULL},
    {NULL}};

PyTypeObject ReceivedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Received",
    .tp_basicsize = sizeof(ReceivedObject),
    .tp_dealloc = (destructor)Rx_dealloc,
    .tp_repr = (reprfunc)Rx_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A buffer received from a peer; released when released explicitly "
              "(release(), gpuipc.release_batch), when its context ends, or when the last "
              "view of it is gone, also after its connection was closed (which keeps it "
              "mapped until then).",
    .tp_methods = Rx_methods,
    .tp_getset = Rx_getset,
};

/* ------------------------------------------------------------------------ */
/* Listener, connect, pairs                                                 */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_listener *l;
  int timeout_ms;
  unsigned maxo;
  int spin_us; /* given to listen(), for the connections it accepts; else -1 */
} ListenerObject;

typedef struct {
  gpuipc_conn_options o;
  uint32_t uids[64], gids[64];
  PyObject *rdir; /* bytes, kept while o is used */
} ConnOpts;

static int parse_ids(PyObject *seq_o, uint32_t *out, size_t *n) {
  *n = 0;
  if (!seq_o || seq_o == Py_None) return 0;
  PyObject *seq = PySequence_Fast(seq_o, "ids must be a sequence of ints");
  if (!seq) return -1;
  Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
  if (k > 64) { Py_DECREF(seq); PyErr_SetString(PyExc_ValueError, "at most 64 ids"); return -1; }
  for (Py_ssize_t i = 0; i < k; i++) out[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
  Py_DECREF(seq);
  if (PyErr_Occurred()) return -1;
  *n = (size_t)k;
  return 0;
}

/* The carrier's options (gpuipc_conn_options.carrier, spin_us, polling):
 * carrier "auto", "socket" or "ring"; spin_us an int from 0 to 1000000;
 * polling a bool. NULL or None leaves the default. */
int parse_carrier_opts(PyObject *carrier, PyObject *spin_us, PyObject *polling,
                       gpuipc_conn_options *o) {
  if (carrier && carrier != Py_None) {
    if (!PyUnicode_Check(carrier)) {
      PyErr_Format(PyExc_TypeError, "carrier must be 'auto', 'socket' or 'ring', not %.80s",
                   Py_TYPE(carrier)->tp_name);
      return -1;
    }
    const char *n = PyUnicode_AsUTF8(carrier);
    if (!n) return -1;
    if (!strcmp(n, "auto")) o->carrier = GPUIPC_CARRIER_AUTO;
    else if (!strcmp(n, "socket")) o->carrier = GPUIPC_CARRIER_SOCKET;
    else if (!strcmp(n, "ring")) o->carrier = GPUIPC_CARRIER_RING;
    else {
      PyErr_Format(PyExc_ValueError, "carrier must be 'auto', 'socket' or 'ring', not %R",
                   carrier);
      return -1;
    }
  }
  if (spin_us && spin_us != Py_None) {
    if (!PyLong_Check(spin_us) || PyBool_Check(spin_us)) {
      PyErr_Format(PyExc_TypeError, "spin_us must be an int (microseconds), not %.80s",
                   Py_TYPE(spin_us)->tp_name);
      return -1;
    }
    int ovf;
    long long v = PyLong_AsLongLongAndOverflow(spin_us, &ovf);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (ovf || v < 0 || v > 1000000) {
      PyErr_Format(PyExc_ValueError, "spin_us must be from 0 to 1000000 microseconds, not %R",
                   spin_us);
      return -1;
    }
    o->spin_us = (int)v;
  }
  if (polling && polling != Py_None) {
    if (!PyBool_Check(polling)) {
      PyErr_Format(PyExc_TypeError, "polling must be True or False, not %.80s",
                   Py_TYPE(polling)->tp_name);
      return -1;
    }
    o->polling = polling == Py_True;
  }
  return 0;
}

/* Common keyword options of listen/connect/from_fd/spawn. */
static int parse_conn_opts(PyObject *kw_t, PyObject *kw_a, PyObject *kw_r, PyObject *kw_u,
                           PyObject *kw_g, unsigned maxo, const char *order, PyObject *kw_c,
                           PyObject *kw_s, PyObject *kw_p, ConnOpts *co, int *tmo) {
  gpuipc_conn_options d = GPUIPC_CONN_OPTIONS_INIT;
  co->o = d;
  co->rdir = NULL;
  if (parse_timeout(kw_t, 10000, tmo) < 0) return -1;
  co->o.timeout_ms = *tmo;
  if (parse_carrier_opts(kw_c, kw_s, kw_p, &co->o) < 0) return -1;
  if (kw_a) co->o.abstract_name = PyObject_IsTrue(kw_a);
  if (kw_r && kw_r != Py_None) {
    if (!PyUnicode_FSConverter(kw_r, &co->rdir)) return -1;
    co->o.runtime_dir = PyBytes_AS_STRING(co->rdir);
  }
  if (parse_ids(kw_u, co->uids, &co->o.n_allow_uids) < 0 ||
      parse_ids(kw_g, co->gids, &co->o.n_allow_gids) < 0)
    return -1;
  co->o.allow_uids = co->uids;
  co->o.allow_gids = co->gids;
  if (maxo) co->o.max_outstanding = maxo;
  if (order) {
    if (!strcmp(order, "memop")) co->o.order = GPUIPC_ORDER_MEMOP;
    else if (!strcmp(order, "none")) co->o.order = GPUIPC_ORDER_NONE;
    else if (!strcmp(order, "event")) co->o.order = GPUIPC_ORDER_EVENT;
    else {
      PyErr_Format(PyExc_ValueError, "order must be 'memop', 'none' or 'event', not '%s'", order);
      return -1;
    }
  }
  return 0;
}

#define CONN_KW_DECL                                                           \
  PyObject *kt = NULL, *ka = NULL, *kr = NULL, *ku = NULL, *kg = NULL;         \
  unsigned maxo = 0;                                                           \
  const char *order = NULL;                                                    \
  PyObject *kc = NULL, *ks = NULL, *kp = NULL;
#define CONN_KW_FMT "OOOOOIzOOO"
#define CONN_KW_ARGS &kt, &ka, &kr, &ku, &kg, &maxo, &order, &kc, &ks, &kp
#define CONN_KW_VALS kt, ka, kr, ku, kg, maxo, order, kc, ks, kp

PyObject *mod_listen(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"name", "timeout", "abstract", "runtime_dir", "allow_uids",
                        "allow_gids", "max_outstanding", "order", "carrier", "spin_us",
                        "polling", NULL};
  const char *name;
  CONN_KW_DECL
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$" CONN_KW_FMT, kwl, &name, CONN_KW_ARGS))
    return NULL;
  ConnOpts co;
  int tmo;
  if (parse_conn_opts(CONN_KW_VALS, &co, &tmo) < 0) {
    Py_XDECREF(co.rdir);
    return NULL;
  }
  gpuipc_listener *l = NULL;
  gpuipc_status st;
  co.o.timeout_ms = tmo < 0 ? -1 : tmo; /* bounds each handshake */
  /* accept() waits here, on the listener's fd, for a handshake that
   * completed: gpuipc_accept itself never waits, so a peer that connects
   * and stays silent holds no call longer than its own timeout asks. */
  co.o.nonblocking = 1;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_listen(name, &co.o, &l);
  Py_END_ALLOW_THREADS
  Py_XDECREF(co.rdir);
  if (st) return raise_st(st, "listen");
  ListenerObject *o = PyObject_New(ListenerObject, &ListenerType);
  if (!o) { gpuipc_listener_close(l); return NULL; }
  o->l = l;
  o->timeout_ms = tmo;
  o->maxo = co.o.max_outstanding;
  o->spin_us = ks && ks != Py_None ? co.o.spin_us : -1;
  return (PyObject *)o;
}

typedef struct {
  ListenerObject *o;
  gpuipc_conn *c;
} AcceptRun;

static gpuipc_status ar_try(void *v) {
  AcceptRun *a = v;
  if (!a->o->l) {
    raise_msg(GPUIPC_E_CLOSED, "accept", "listener closed");
    return GPY_RAISED;
  }
  gpuipc_status st;
  gpuipc_listener *l = a->o->l;
  /* gpuipc_accept never waits here (non-blocking listener), but it may
   * read and answer handshakes */
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_accept(l, &a->c);
  Py_END_ALLOW_THREADS
  /* a handshake that timed out is some other peer's end, not ours */
  return st == GPUIPC_E_TIMEOUT ? GPUIPC_E_WOULD_BLOCK : st;
}

static gpuipc_status ar_sleep(void *v, short events, int timeout_ms, int spin_us) {
  AcceptRun *a = v;
  if (!a->o->l) return GPUIPC_OK; /* the attempt says closed */
  return gpy_poll_fd(gpuipc_listener_get_fd(a->o->l), events, timeout_ms, spin_us);
}

static PyObject *Listener_accept(ListenerObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &tmo_o)) return NULL;
  if (!o->l) return raise_msg(GPUIPC_E_CLOSED, "accept", "listener closed");
  int tmo;
  if (parse_timeout(tmo_o, o->timeout_ms, &tmo) < 0) return NULL;
  AcceptRun a = {o, NULL};
  gpuipc_status st;
  Py_INCREF(o); /* the waits run without the GIL */
  int rc = gpy_wait_loop(tmo, POLLIN, 0, ar_try, ar_sleep, &a, &st);
  Py_DECREF(o);
  if (rc < 0) return NULL;
  if (st == GPUIPC_E_TIMEOUT) return raise_msg(GPUIPC_E_TIMEOUT, "accept", "no peer came");
  if (st) return raise_st(st, "accept");
  PyObject *c = conn_new(a.c, o->timeout_ms, o->maxo, 0);
  if (c) ((ConnObject *)c)->spin_us = o->spin_us;
  return c;
}

static PyObject *Listener_close(ListenerObject *o, PyObject *u) {
  gpuipc_listener_close(o->l);
  o->l = NULL;
  Py_RETURN_NONE;
}
static void Listener_dealloc(ListenerObject *o) {
  gpuipc_listener_close(o->l);
  PyObject_Free(o);
}
static PyObject *Listener_fileno(ListenerObject *o, PyObject *u) {
  if (!o->l) return raise_msg(GPUIPC_E_CLOSED, "fileno", "listener closed");
  return PyLong_FromLong(gpuipc_listener_get_fd(o->l));
}
static PyObject *Listener_path(ListenerObject *o, void *u) {
  if (!o->l) Py_RETURN_NONE;
  return PyUnicode_DecodeFSDefault(gpuipc_listener_get_path(o->l));
}
static PyObject *Listener_exit(ListenerObject *o, PyObject *a) { return Listener_close(o, NULL); }

/* accept's timeout left out is the listener's (listen(timeout=)), None
 * waits forever: its signature's default is `...` (left out). */
static PyMethodDef Listener_methods[] = {
    {"accept", (PyCFunction)(void (*)(void))Listener_accept, METH_VARARGS | METH_KEYWORDS,
     "accept($self, /, timeout=...)\n--\n\naccept(timeout=...) -> Connection"},
    {"close", (PyCFunction)Listener_close, METH_NOARGS, "close($self, /)\n--\n\n"},
    {"fileno", (PyCFunction)Listener_fileno, METH_NOARGS,
     "fileno($self, /)\n--\n\nthe listening socket, for selectors/poll"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Listener_exit, METH_VARARGS,
     "__exit__($self, /, *exc)\n--\n\ncloses it"},
    {NULL}};
static PyGetSetDef Listener_getset[] = {{"path", (getter)Listener_path, NULL, NULL, NULL}, {NULL}};

PyTypeObject ListenerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Listener",
    .tp_basicsize = sizeof(ListenerObject),
    .tp_dealloc = (destructor)Listener_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A named listening socket (gpuipc.listen).",
    .tp_methods = Listener_methods,
    .tp_getset = Listener_getset,
};

/* connect(timeout=): nobody listening yet is waited for, within the
 * timeout (None: forever), trying again after a pause that grows from 1
 * to 50 ms; anything else ends the call. */
typedef struct {
  const char *name;
  ConnOpts *co;
  gpuipc_conn *c;
  int pause_ms;
  int missed; /* the last attempt found nobody listening */
  char why[256];
} ConnectRun;

static gpuipc_status cn_try(void *v) {
  ConnectRun *r = v;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_connect(r->name, &r->co->o, &r->c);
  Py_END_ALLOW_THREADS
  r->missed = st == GPUIPC_E_NOT_FOUND;
  if (st == GPUIPC_E_NOT_FOUND) {
    snprintf(r->why, sizeof r->why, "%s", gpuipc_last_error());
    return GPUIPC_E_WOULD_BLOCK;
  }
  return st;
}

static gpuipc_status cn_sleep(void *v, short events, int timeout_ms, int spin_us) {
  ConnectRun *r = v;
  int t = timeout_ms < 0 || timeout_ms > r->pause_ms ? r->pause_ms : timeout_ms;
  r->pause_ms = r->pause_ms >= 25 ? 50 : 2 * r->pause_ms;
  (void)gpy_poll_fds(NULL, 0, t, 0);
  return GPUIPC_E_TIMEOUT;
}

PyObject *mod_connect(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"name", "timeout", "abstract", "runtime_dir", "allow_uids",
                        "allow_gids", "max_outstanding", "order", "carrier", "spin_us",
                        "polling", NULL};
  const char *name;
  CONN_KW_DECL
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$" CONN_KW_FMT, kwl, &name, CONN_KW_ARGS))
    return NULL;
  ConnOpts co;
  int tmo;
  if (parse_conn_opts(CONN_KW_VALS, &co, &tmo) < 0) {
    Py_XDECREF(co.rdir);
    return NULL;
  }
  ConnectRun r = {name, &co, NULL, 1, 0, ""};
  gpuipc_status st;
  int rc = gpy_wait_loop(tmo, 0, 0, cn_try, cn_sleep, &r, &st);
  Py_XDECREF(co.rdir);
  if (rc < 0) return NULL;
  if (st == GPUIPC_E_TIMEOUT && r.missed) {
    char d[400];
    if (tmo > 0)
      snprintf(d, sizeof d, "%s; nobody came within %d ms", r.why, tmo);
    else
      snprintf(d, sizeof d, "%s", r.why);
    return raise_msg(GPUIPC_E_NOT_FOUND, "connect", d);
  }
  if (st) return raise_st(st, "connect");
  PyObject *c = conn_new(r.c, tmo, co.o.max_outstanding, 0);
  if (c && ks && ks != Py_None) ((ConnObject *)c)->spin_us = co.o.spin_us;
  return c;
}

PyObject *mod_from_fd(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"fd", "timeout", "abstract", "runtime_dir", "allow_uids",
                        "allow_gids", "max_outstanding", "order", "carrier", "spin_us",
                        "polling", NULL};
  int fd;
  CONN_KW_DECL
  if (!PyArg_ParseTupleAndKeywords(args, kw, "i|$" CONN_KW_FMT, kwl, &fd, CONN_KW_ARGS))
    return NULL;
  ConnOpts co;
  int tmo;
  if (parse_conn_opts(CONN_KW_VALS, &co, &tmo) < 0) {
    Py_XDECREF(co.rdir);
    return NULL;
  }
  gpuipc_conn *c = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_conn_from_fd(fd, &co.o, &c);
  Py_END_ALLOW_THREADS
  Py_XDECREF(co.rdir);
  if (st) return raise_st(st, "from_fd");
  PyObject *r = conn_new(c, tmo, co.o.max_outstanding, 0);
  if (r && ks && ks != Py_None) ((ConnObject *)r)->spin_us = co.o.spin_us;
  return r;
}

PyObject *mod_conn_pair(PyObject *m, PyObject *u) {
  int fds[2];
  gpuipc_status st = gpuipc_conn_pair(fds);
  if (st) return raise_st(st, "conn_pair");
  return Py_BuildValue("(ii)", fds[0], fds[1]);
}

PyObject *mod_spawn_connection(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *kt = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O", kwl, &kt)) return NULL;
  int tmo;
  if (parse_timeout(kt, 10000, &tmo) < 0) return NULL;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = tmo;
  gpuipc_conn *c = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_spawn_connection(&o, &c);
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "spawn_connection");
  return conn_new(c, tmo, o.max_outstanding, 0);
}

