/*
 * conn.c: Listener, Connection and Received. Calls that may wait run the
 * library call without waiting under g_lock and wait in poll(2) with the GIL
 * and the lock released. Memory sent that gpuipc did not allocate (a torch
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
/* Wrapped buffers kept until the peer released them                        */
/* ------------------------------------------------------------------------ */

static int leases_push(LeaseList *l, Lease x) {
  if (l->n == l->cap) {
    size_t c = l->cap ? 2 * l->cap : 16;
    Lease *nv = PyMem_Realloc(l->v, c * sizeof *nv);
    if (!nv) { PyErr_NoMemory(); return -1; }
    l->v = nv;
    l->cap = c;
  }
  l->v[l->n++] = x;
  return 0;
}

/* After the connection closed: leases wait for their peer's exit. */
typedef struct Grave {
  struct Grave *next;
  int pid;
  LeaseList l;
} Grave;
static Grave *g_graves;

static void lease_drop(Lease *x) {
  if (x->sent) {
    (*x->sent)--;
  } else {
    gpuipc_buffer_free(x->buf, NULL);
    g_count.wraps_live--;
  }
  /* Dropping the owner may run any Python code (a __del__, a DLPack
   * deleter that releases a Received): never under g_lock. */
  defer_decref(x->owner);
}

/* Whether pid still runs (a zombie does not: its GPU work is torn down). */
static int pid_running(int pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return 0;
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return 1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *r = strrchr(buf, ')');
  return !(r && r[1] == ' ' && (r[2] == 'Z' || r[2] == 'X'));
}

/* Frees leases of dead peers. GIL held. */
void graves_reap(void) {
  Grave **pp = &g_graves;
  while (*pp) {
    Grave *g = *pp;
    if (pid_running(g->pid)) {
      pp = &g->next;
      continue;
    }
    for (size_t i = 0; i < g->l.n; i++) lease_drop(&g->l.v[i]);
    g_count.graveyard -= (long long)g->l.n;
    PyMem_Free(g->l.v);
    *pp = g->next;
    PyMem_Free(g);
  }
  flush_decrefs(); /* after the walk: it may run code that reaps again */
}

/* ------------------------------------------------------------------------ */
/* Connection                                                               */
/* ------------------------------------------------------------------------ */

/* GIL and lock held. Drops the leases the peer released (wrapped memory,
 * Buffer objects): oldest first, up to the first still held, or all of them
 * when full is set. Their owners go after the lock (defer_decref). */
static void conn_reap(ConnObject *c, int full) {
  size_t w = 0;
  int stop = 0;
  for (size_t i = 0; i < c->leases.n; i++) {
    Lease x = c->leases.v[i];
    if (!stop && gpuipc_conn_get_buffer_holders(c->c, x.buf) == 0) {
      gpuipc_conn_buffer_wait(c->c, x.buf, S(x.stream));
      lease_drop(&x);
      continue;
    }
    if (!full) stop = 1;
    c->leases.v[w++] = x;
  }
  c->leases.n = w;
}

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
  /* lock held, GIL held */
  gpuipc_conn_close(conn_take(c));
  if (c->leases.n) {
    Grave *g = PyMem_Calloc(1, sizeof *g);
    if (g) {
      g->pid = c->peer_pid;
      g->l = c->leases;
      g->next = g_graves;
      g_graves = g;
      g_count.graveyard += (long long)c->leases.n;
      c->leases = (LeaseList){0};
    }
  }
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
  c->leases = (LeaseList){0};
  c->tset_refs = 0;
  c->held = 0;
  c->linger = NULL;
  c->weak = NULL;
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

/* Runs op (under the lock, never waiting) until it does not say
 * WOULD_BLOCK, waiting on the socket in between with neither the GIL nor
 * the lock; *st gets its status (E_TIMEOUT once the limit passed). Returns
 * -1 with an exception set (closed here, a signal), else 0. want_out: the
 * op sends (may wait for room in the socket, or for releases). */
int conn_run(ConnObject *c, int timeout_ms, int want_out, conn_op op, void *ctx,
                    gpuipc_status *st) {
  int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  int out = want_out;
  for (;;) {
    if (!conn_ok(c)) return -1;
    LOCK();
    conn_reap(c, 0);
    *st = op(c, ctx);
    int fd = gpuipc_conn_get_fd(c->c);
    UNLOCK();
    flush_decrefs();
    if (*st != GPUIPC_E_WOULD_BLOCK) return 0;
    int left = -1;
    if (deadline >= 0) {
      int64_t l = deadline - now_ms();
      if (l <= 0) {
        *st = GPUIPC_E_TIMEOUT;
        return 0;
      }
      left = (int)l;
    }
    if (fd < 0) return 0;
    if (want_out && !out && (left < 0 || left > 1))
      left = 1; /* after a POLLOUT that did not help: look again soon */
    int r = wait_fd(fd, (short)(POLLIN | (out ? POLLOUT : 0)), left);
    if (r < 0) return -1;
    if (want_out) {
      struct pollfd p = {.fd = fd, .events = POLLIN};
      out = !(r == 1 && poll(&p, 1, 0) == 0); /* POLLOUT alone: back off once */
    }
  }
}

static PyObject *conn_status(gpuipc_status st, const char *what, int timeout_ms) {
  if (st == GPUIPC_E_TIMEOUT) {
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
} SendCtx;

static gpuipc_status op_send(ConnObject *c, void *v) {
  SendCtx *x = v;
  if (x->block)
    return gpuipc_conn_send_ex(c->c, x->block, S(x->stream), x->meta, x->meta_len, x->flags);
  return gpuipc_conn_send_buffer(c->c, x->buf, S(x->stream), x->meta, x->meta_len);
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

static PyObject *Conn_send(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"obj", "stream", "meta", "timeout", "complete", NULL};
  PyObject *obj, *stream_o = Py_None, *meta_o = Py_None, *tmo_o = NULL, *complete_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOOO", kwl, &obj, &stream_o, &meta_o, &tmo_o,
                                   &complete_o))
    return NULL;
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
  if (wrapped) {
    Lease l = {wrapped, f.owner, stream, NULL};
    int rc = leases_push(&c->leases, l);
    /* Sent: the peer may map it now, so out of memory here leaks the
     * wrapper and the owner rather than free what the peer reads. */
    wrapped = NULL;
    f.owner = NULL;
    if (rc < 0) goto out;
  } else if (x.buf) { /* a Buffer object: kept (and not freed) while held */
    BufferObject *b = (BufferObject *)obj;
    Lease l = {b->b, obj, stream, &b->sent};
    if (leases_push(&c->leases, l) < 0) goto out;
    Py_INCREF(obj);
    b->sent++;
  }
  ret = Py_None;
  Py_INCREF(ret);
out:
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
  PyObject *user; /* bytes */
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
  const uint8_t *u;
  size_t ul;
  meta_decode(rx->meta, rx->meta_len, rx->length, &r->meta, &u, &ul);
  r->user = PyBytes_FromStringAndSize((const char *)u, (Py_ssize_t)ul);
  g_count.live_received++;
  if (!r->user) {
    if (!release_on_fail) { /* the caller's to release */
      r->held = 0;
      conn_held_drop(c);
    }
    Py_DECREF(r); /* else released by its dealloc */
    return NULL;
  }
  return (PyObject *)r;
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

static PyObject *Conn_recv(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", "timeout", NULL};
  PyObject *stream_o = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OO", kwl, &stream_o, &tmo_o)) return NULL;
  RecvCtx x;
  memset(&x, 0, sizeof x);
  int tmo;
  if (parse_stream(stream_o, &x.stream) < 0 || parse_timeout(tmo_o, c->timeout_ms, &tmo) < 0)
    return NULL;
  gpuipc_status st;
  if (conn_run(c, tmo, 0, op_recv, &x, &st) < 0) return NULL;
  if (st != GPUIPC_OK) return conn_status(st, "recv", tmo);
  return rx_new(c, &x.rx, x.stream, 1);
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

static PyObject *Conn_send_batch(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"objs", "stream", "metas", "timeout", NULL};
  PyObject *objs, *stream_o = Py_None, *metas_o = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOO", kwl, &objs, &stream_o, &metas_o, &tmo_o))
    return NULL;
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

static PyObject *Conn_recv_batch(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"max", "stream", "timeout", NULL};
  Py_ssize_t max;
  PyObject *stream_o = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "n|$OO", kwl, &max, &stream_o, &tmo_o))
    return NULL;
  if (max < 1) {
    PyErr_Format(PyExc_ValueError, "recv_batch: max must be >= 1, not %zd", max);
    return NULL;
  }
  RecvBatchCtx x = {0};
  int tmo;
  if (parse_stream(stream_o, &x.stream) < 0 || parse_timeout(tmo_o, c->timeout_ms, &tmo) < 0)
    return NULL;
  if (!conn_ok(c)) return NULL;
  /* No more can be queued than a peer may have outstanding (at most 65536). */
  x.max = max > 65536 ? 65536 : (size_t)max;
  x.rx = PyMem_Malloc(x.max * sizeof *x.rx);
  if (!x.rx) return PyErr_NoMemory();
  for (size_t i = 0; i < x.max; i++) x.rx[i].size = sizeof x.rx[i];
  PyObject *list = NULL;
  gpuipc_status st;
  if (conn_run(c, tmo, 0, op_recv_batch, &x, &st) < 0) goto out;
  if (st != GPUIPC_OK) { conn_status(st, "recv_batch", tmo); goto out; }
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
 * back: a connection's failure is its entry in the list. */
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
  gpuipc_conn **gc = NULL;
  Py_ssize_t *pend = NULL, *idx = NULL;
  gpuipc_status *sts = NULL;
  int64_t *deadline = NULL;
  struct pollfd *pfd = NULL;
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
  gc = PyMem_Malloc(un * sizeof *gc);
  pend = PyMem_Malloc(un * sizeof *pend);
  idx = PyMem_Malloc(un * sizeof *idx);
  sts = PyMem_Malloc(un * sizeof *sts);
  deadline = PyMem_Malloc(un * sizeof *deadline);
  pfd = PyMem_Malloc(un * sizeof *pfd);
  if (!gc || !pend || !idx || !sts || !deadline || !pfd) { PyErr_NoMemory(); goto out; }
  Py_ssize_t np = 0;
  int64_t t0 = now_ms();
  for (Py_ssize_t i = 0; i < n; i++) {
    int t = have_tmo ? tmo : cs[i]->timeout_ms;
    deadline[i] = t < 0 ? -1 : t0 + t;
    pend[np++] = i;
  }
  int want_out = 1, pass = 0;
  while (np > 0) {
    /* 1: one broadcast to every connection still pending */
    Py_ssize_t k = 0, closed_here = 0;
    gpuipc_status whole = GPUIPC_OK;
    char why[512] = "";
    int freed = 0;
    LOCK();
    for (Py_ssize_t j = 0; j < np; j++) {
      ConnObject *c = cs[pend[j]];
      if (!c->c) {
        pend[closed_here++] = pend[j]; /* answered below, after the lock */
        continue;
      }
      conn_reap(c, 0);
      idx[k] = pend[j];
      gc[k++] = c->c;
    }
    if (k > 0 && !it.blk->b) {
      freed = 1;
    } else if (k > 0) {
      for (Py_ssize_t j = 0; j < k; j++) sts[j] = GPUIPC__STATUS_END; /* not set */
      whole = gpuipc_conn_broadcast(gc, (size_t)k, it.blk->b, S(stream), wire, wlen, sts);
      if (whole != GPUIPC_OK) snprintf(why, sizeof why, "%s", gpuipc_last_error());
    }
    for (Py_ssize_t j = 0; j < k; j++) pfd[j].fd = gpuipc_conn_get_fd(gc[j]);
    UNLOCK();
    flush_decrefs();
    for (Py_ssize_t j = 0; j < closed_here; j++) {
      PyObject *e = exc_obj(GPUIPC_E_CLOSED, "broadcast", "connection closed here");
      if (!e) goto out;
      PyList_SET_ITEM(list, pend[j], e);
    }
    if (freed || (whole != GPUIPC_OK && k > 0 && sts[0] == GPUIPC__STATUS_END)) {
      /* The call failed as a whole: nothing was sent in this pass. */
      gpuipc_status st = freed ? GPUIPC_E_INVALID_ARG : whole;
      const char *d = freed ? "the block was freed meanwhile" : why;
      if (pass == 0) { raise_msg(st, "broadcast", d); goto out; }
      for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *e = exc_obj(st, "broadcast", d);
        if (!e) goto out;
        PyList_SET_ITEM(list, idx[j], e);
      }
      break;
    }
    /* 2: the answers. The library's message tells of the first connection
     * that failed (after "(the first that failed): "). */
    Py_ssize_t fj = 0;
    while (fj < k && sts[fj] == GPUIPC_OK) fj++;
    const char *first = strstr(why, "(the first that failed): ");
    first = first ? first + strlen("(the first that failed): ") : why;
    np = 0;
    int64_t now = now_ms(), soonest = -1;
    for (Py_ssize_t j = 0; j < k; j++) {
      Py_ssize_t i = idx[j];
      gpuipc_status s = sts[j];
      if (s == GPUIPC_E_WOULD_BLOCK && !(deadline[i] >= 0 && now >= deadline[i])) {
        pfd[np].fd = pfd[j].fd;
        pend[np++] = i;
        if (deadline[i] >= 0 && (soonest < 0 || deadline[i] < soonest)) soonest = deadline[i];
        continue;
      }
      PyObject *e;
      if (s == GPUIPC_OK) {
        e = Py_None;
        Py_INCREF(e);
      } else {
        char d[640];
        if (s == GPUIPC_E_WOULD_BLOCK) {
          snprintf(d, sizeof d, "conns[%zd] not ready within %d ms: no free slot, or no "
                   "room in its socket", i, have_tmo ? tmo : cs[i]->timeout_ms);
          s = GPUIPC_E_TIMEOUT;
        } else if (j == fj) {
          snprintf(d, sizeof d, "conns[%zd]: %s", i, first);
        } else {
          snprintf(d, sizeof d, "conns[%zd], peer pid %d", i, cs[i]->peer_pid);
        }
        e = exc_obj(s, "broadcast", d);
        if (!e) goto out;
      }
      PyList_SET_ITEM(list, i, e);
    }
    if (np == 0) break;
    /* 3: wait until a pending connection's socket has news, or a timeout */
    int left = -1;
    if (soonest >= 0) left = soonest - now > 0 ? (int)(soonest - now) : 0;
    if (!want_out && (left < 0 || left > 1)) left = 1; /* POLLOUT alone did not help */
    for (Py_ssize_t j = 0; j < np; j++) {
      pfd[j].events = (short)(POLLIN | (want_out ? POLLOUT : 0));
      pfd[j].revents = 0;
    }
    int r, err;
    Py_BEGIN_ALLOW_THREADS
    r = poll(pfd, (nfds_t)np, left);
    err = errno;
    Py_END_ALLOW_THREADS
    if (r < 0 && err != EINTR) {
      errno = err;
      PyErr_SetFromErrno(PyExc_OSError);
      goto out;
    }
    if (r < 0 && PyErr_CheckSignals() < 0) goto out;
    int in = 0;
    for (Py_ssize_t j = 0; r > 0 && j < np; j++)
      in |= (pfd[j].revents & (POLLIN | POLLHUP | POLLERR)) != 0;
    want_out = !(r > 0 && !in);
    pass++;
  }
done:
  ret = list;
  list = NULL;
out:
  Py_XDECREF(list);
  Py_XDECREF(it.blk);
  if (um.obj) PyBuffer_Release(&um);
  PyMem_Free(gc);
  PyMem_Free(pend);
  PyMem_Free(idx);
  PyMem_Free(sts);
  PyMem_Free(deadline);
  PyMem_Free(pfd);
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
  gpuipc_status st = gpuipc_conn_progress(c->c, 0);
  conn_reap(c, 1);
  return st;
}

static PyObject *Conn_progress(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &tmo_o)) return NULL;
  int tmo = 0;
  if (tmo_o && parse_timeout(tmo_o, 0, &tmo) < 0) return NULL;
  if (!conn_ok(c)) return NULL;
  if (tmo != 0) {
    int fd = gpuipc_conn_get_fd(c->c);
    if (fd >= 0 && wait_fd(fd, POLLIN, tmo) < 0) return NULL;
  }
  if (!conn_ok(c)) return NULL;
  LOCK();
  gpuipc_status st = op_progress(c, NULL);
  UNLOCK();
  flush_decrefs();
  graves_reap();
  if (st != GPUIPC_OK) return raise_st(st, "progress");
  Py_RETURN_NONE;
}

static PyObject *Conn_outstanding(ConnObject *c, PyObject *unused) {
  if (!conn_ok(c)) return NULL;
  size_t a = 0, b = 0;
  LOCK();
  gpuipc_status st = gpuipc_conn_get_outstanding(c->c, &a, &b);
  if (st == GPUIPC_OK) conn_reap(c, 1);
  UNLOCK();
  flush_decrefs();
  if (st != GPUIPC_OK) return raise_st(st, "outstanding");
  return Py_BuildValue("(nn)", (Py_ssize_t)a, (Py_ssize_t)b);
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
  PyMem_Free(c->leases.v);
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
  return PyLong_FromSize_t(c->leases.n);
}

static PyMethodDef Conn_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Conn_send, METH_VARARGS | METH_KEYWORDS,
     "send(obj, *, stream=None, meta=None, timeout=..., complete=False): hand a buffer "
     "to the peer. complete=True (arena blocks only): the caller asserts the data is "
     "complete already (it synchronized, or the host wrote it): no stream is queried, "
     "ordered or signalled, and the consumer waits for nothing; if that is not true it "
     "may read stale data"},
    {"recv", (PyCFunction)(void (*)(void))Conn_recv, METH_VARARGS | METH_KEYWORDS,
     "recv(*, stream=None, timeout=...) -> Received"},
    {"send_batch", (PyCFunction)(void (*)(void))Conn_send_batch, METH_VARARGS | METH_KEYWORDS,
     "send_batch(objs, *, stream=None, metas=None, timeout=...): hand many arena buffers "
     "to the peer as one operation (one frame, one signal). objs: Blocks, or arrays "
     "inside arena blocks, each with its array metadata as send() encodes it; metas: "
     "None or one bytes object (or None) per buffer. All or nothing: an item that is "
     "not arena memory (TypeError naming its index: send it with send()), a freed "
     "block, metadata too long, more than BATCH_MAX buffers or BATCH_BYTES_MAX bytes "
     "of frame (48 per buffer plus its encoded metadata), more than max_outstanding, "
     "a timeout while waiting for free slots: nothing was sent. An empty sequence "
     "sends nothing."},
    {"recv_batch", (PyCFunction)(void (*)(void))Conn_recv_batch, METH_VARARGS | METH_KEYWORDS,
     "recv_batch(max, *, stream=None, timeout=...) -> [Received]: waits for the first "
     "buffer, then takes every one already arrived, up to max (one stream wait per "
     "batch the producer sent among them)"},
    {"release_batch", (PyCFunction)(void (*)(void))Conn_release_batch,
     METH_VARARGS | METH_KEYWORDS,
     "release_batch(received, stream=<each one's receive stream>): give back many "
     "buffers of this connection at once, as gpuipc.release_batch"},
    {"send_msg", (PyCFunction)(void (*)(void))Conn_send_msg, METH_VARARGS | METH_KEYWORDS,
     "send_msg(data, fds=(), *, timeout=...)"},
    {"recv_msg", (PyCFunction)(void (*)(void))Conn_recv_msg, METH_VARARGS | METH_KEYWORDS,
     "recv_msg(*, timeout=..., with_fds=False) -> bytes, or (bytes, [fd]) with with_fds"},
    {"progress", (PyCFunction)(void (*)(void))Conn_progress, METH_VARARGS | METH_KEYWORDS,
     "progress(timeout=0): handle incoming releases and departures"},
    {"outstanding", (PyCFunction)Conn_outstanding, METH_NOARGS,
     "outstanding() -> (held_by_peer, held_here)"},
    {"open", (PyCFunction)(void (*)(void))Conn_open, METH_VARARGS | METH_KEYWORDS,
     "open(desc, fds=(), *, device=None) -> Buffer: a descriptor that came over "
     "this connection from its peer (checked against the peer's liveness table; "
     "fd-based kinds also from another container)"},
    {"close", (PyCFunction)Conn_close, METH_NOARGS,
     "close the connection: later calls raise ClosedError. Buffers received and not "
     "released (a Received alive, or a tensor made from it) stay mapped and held, and "
     "the connection open underneath, until the last of them is released or dies; the "
     "peer learns of the close then"},
    {"fileno", (PyCFunction)Conn_fileno, METH_NOARGS, "the socket, for selectors/poll"},
    {"set_polling", (PyCFunction)Conn_set_polling, METH_O,
     "set_polling(on): ring carrier: True says this process calls into the connection "
     "often (recv, progress, a send) and does not sleep on fileno() meanwhile, so the "
     "peer sends no wake-up with its buffers; switch it off before sleeping on fileno() "
     "(while on, a buffer makes it readable only at the next call). Calls that wait in "
     "gpuipc sleep safely either way. No effect on the socket carrier"},
    {"__enter__", gpy_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Conn_exit, METH_VARARGS, NULL},
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

static View rx_view(ReceivedObject *r) {
  return (View){r->ptr, &r->meta, kDLCUDA, r->device, r->stream, 1};
}

static int rx_alive(ReceivedObject *r) {
  if (!r->held) {
    PyErr_SetString(PyExc_ValueError, "buffer already released");
    return 0;
  }
  return 1;
}

static void rx_release(ReceivedObject *r, uintptr_t stream, gpuipc_status *st) {
  *st = GPUIPC_OK;
  if (!r->held) return;
  r->held = 0;
  LOCK();
  gpuipc_conn *gc = conn_rx(r->conn);
  if (gc) *st = gpuipc_conn_release(gc, r->id, S(stream));
  UNLOCK();
  conn_held_drop(r->conn); /* the last after a close closes it */
}

static PyObject *Rx_release(ReceivedObject *r, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", NULL};
  PyObject *stream_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &stream_o)) return NULL;
  uintptr_t s = r->stream;
  if (stream_o && parse_stream(stream_o, &s) < 0) return NULL;
  gpuipc_status st;
  rx_release(r, s, &st);
  if (st != GPUIPC_OK) return raise_st(st, "release");
  Py_RETURN_NONE;
}

static void Rx_dealloc(ReceivedObject *r) {
  gpuipc_status st;
  rx_release(r, r->stream, &st);
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
static PyObject *Rx_dlpack(ReceivedObject *r, PyObject *a, PyObject *k) {
  if (!rx_alive(r)) return NULL;
  View v = rx_view(r);
  return dlpack_export((PyObject *)r, &v, a, k);
}
static PyObject *Rx_dlpack_device(ReceivedObject *r, PyObject *u) {
  View v = rx_view(r);
  return dlpack_device(&v);
}
static PyObject *Rx_exit(ReceivedObject *r, PyObject *a) {
  gpuipc_status st;
  rx_release(r, r->stream, &st);
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
  case 4: Py_INCREF(r->user); return r->user;
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

static PyMethodDef Rx_methods[] = {
    {"release", (PyCFunction)(void (*)(void))Rx_release, METH_VARARGS | METH_KEYWORDS,
     "release(stream=None): give the buffer back (after the work queued on stream)"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Rx_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)Rx_dlpack_device, METH_NOARGS, NULL},
    {"__enter__", gpy_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Rx_exit, METH_VARARGS, NULL},
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
  return (PyObject *)o;
}

static PyObject *Listener_accept(ListenerObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &tmo_o)) return NULL;
  if (!o->l) return raise_msg(GPUIPC_E_CLOSED, "accept", "listener closed");
  int tmo;
  if (parse_timeout(tmo_o, o->timeout_ms, &tmo) < 0) return NULL;
  int64_t deadline = tmo < 0 ? -1 : now_ms() + tmo;
  for (;;) {
    int left = deadline < 0 ? -1 : (int)(deadline - now_ms());
    if (deadline >= 0 && left < 0) left = 0;
    int r = wait_fd(gpuipc_listener_get_fd(o->l), POLLIN, left);
    if (r < 0) return NULL;
    if (r == 0) return raise_msg(GPUIPC_E_TIMEOUT, "accept", "no peer came");
    if (!o->l) return raise_msg(GPUIPC_E_CLOSED, "accept", "listener closed");
    gpuipc_conn *c = NULL;
    gpuipc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gpuipc_accept(o->l, &c);
    Py_END_ALLOW_THREADS
    if (st == GPUIPC_E_WOULD_BLOCK || st == GPUIPC_E_TIMEOUT) {
      if (deadline >= 0 && now_ms() >= deadline) return raise_st(st, "accept");
      continue;
    }
    if (st) return raise_st(st, "accept");
    return conn_new(c, o->timeout_ms, o->maxo, 0);
  }
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

static PyMethodDef Listener_methods[] = {
    {"accept", (PyCFunction)(void (*)(void))Listener_accept, METH_VARARGS | METH_KEYWORDS,
     "accept(timeout=...) -> Connection"},
    {"close", (PyCFunction)Listener_close, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)Listener_fileno, METH_NOARGS, NULL},
    {"__enter__", gpy_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Listener_exit, METH_VARARGS, NULL},
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
  gpuipc_conn *c = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_connect(name, &co.o, &c);
  Py_END_ALLOW_THREADS
  Py_XDECREF(co.rdir);
  if (st) return raise_st(st, "connect");
  return conn_new(c, tmo, co.o.max_outstanding, 0);
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
  return conn_new(c, tmo, co.o.max_outstanding, 0);
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

