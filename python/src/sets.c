/*
 * sets.c: tensor sets (include/gpuipc/sets.h) for Python: TensorSetC (the
 * producer's set: owned or wrapping the caller's arrays), TensorSetSub (a
 * consumer's subscriber), TensorSetVersion (one received version) and
 * TensorView (one tensor of a set or version, exported through the CUDA
 * Array Interface and DLPack). The mapping-style classes users see are in
 * gpuipc/sets.py.
 *
 * Waiting. Connections are non-blocking here (ext.h). The producer's set is
 * created with a timeout of 0, so begin, unsubscribe and destroy make
 * progress once and return; the waits happen here, in poll(2) on the
 * subscribed connections' sockets with neither the GIL nor the module lock
 * held. subscribe and publish send several frames that must all go out, so
 * they run with the connections switched to blocking mode (GIL released,
 * module lock held). recv uses the connection's own wait loop (conn_run).
 *
 * Lifetimes. A set keeps the connections it is subscribed to (and they
 * refuse to close while it does); a wrapped set keeps the arrays it wraps;
 * a view keeps its version or set, and refuses to export once the version
 * was released; closing a subscriber releases its versions and marks them
 * released, except those with views alive (TensorView objects: a DLPack
 * capsule or a CUDA Array Interface consumer holds one): those stay held,
 * with the library's subscriber kept open (linger) and the connection
 * with it (ConnObject.held), until the last view of each dies, which
 * releases it; the last released closes the subscriber.
 */
#include "ext.h"

/* ------------------------------------------------------------------------ */
/* dtypes                                                                   */
/* ------------------------------------------------------------------------ */

/* A set's dtypes are gpuipc_dtype codes, as ArrMeta's are (ext.h): one
 * vocabulary (gpuipc/tensor.h), nothing to map. */

/* An ArrMeta (offset 0) of a tensor the library gave back. */
static void meta_of(const gpuipc_tensor *t, ArrMeta *m) {
  memset(m, 0, sizeof *m);
  m->ndim = t->ndim;
  m->dtype = t->dtype;
  for (int i = 0; i < t->ndim && i < MAXD; i++) {
    m->shape[i] = t->shape[i];
    m->strides[i] = t->strides ? t->strides[i] : 0;
  }
  m->has_strides = t->strides != NULL;
  if (m->has_strides && meta_contiguous(m)) m->has_strides = 0;
}

/* ------------------------------------------------------------------------ */
/* Objects                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct TSubObject TSubObject;
typedef struct TVerObject TVerObject;

typedef struct {
  PyObject_HEAD
  gpuipc_tset *s;
  int device;      /* ordinal of the set's memory */
  int wrapped;
  int timeout_ms;  /* limit of begin, unsubscribe, destroy */
  PyObject *conns; /* list of the ConnObjects subscribed */
  PyObject *keep;  /* wrapped: the arrays' owners */
} TSetObject;

struct TSubObject {
  PyObject_HEAD
  gpuipc_tset_sub *s;
  ConnObject *conn;
  int device;
  TVerObject *held; /* versions not released yet */
  gpuipc_tset_sub *linger; /* closed here, kept open for held (views alive) */
};

struct TVerObject {
  PyObject_HEAD
  gpuipc_tset_version *v;
  TSubObject *sub;
  uintptr_t stream; /* the stream given to recv */
  TVerObject *next, *prev;
  Py_ssize_t views; /* TensorView objects of it alive */
};

typedef struct {
  PyObject_HEAD
  PyObject *owner; /* a TVerObject or a TSetObject */
  void *ptr;
  size_t nbytes;
  ArrMeta meta;
  int device;
  uintptr_t stream;
  PyObject *name;
} TViewObject;

PyTypeObject TSetType, TSubType, TVerType, TViewType;

static int set_ok(TSetObject *o) {
  if (o->s) return 1;
  raise_msg(GPUIPC_E_INVALID_ARG, "tensor set", "destroyed");
  return 0;
}
static int sub_ok(TSubObject *o) {
  if (o->s) return 1;
  raise_msg(GPUIPC_E_INVALID_ARG, "tensor-set subscriber", "closed");
  return 0;
}
static int ver_ok(TVerObject *o) {
  if (o->v) return 1;
  raise_msg(GPUIPC_E_INVALID_ARG, "tensor-set version", "released");
  return 0;
}

static PyObject *view_new(PyObject *owner, const gpuipc_tensor *t, int device,
                          uintptr_t stream) {
  TViewObject *w = PyObject_New(TViewObject, &TViewType);
  if (!w) return NULL;
  Py_INCREF(owner);
  w->owner = owner;
  if (Py_TYPE(owner) == &TVerType) ((TVerObject *)owner)->views++;
  w->ptr = t->ptr;
  w->nbytes = t->nbytes;
  meta_of(t, &w->meta);
  w->device = device;
  w->stream = stream;
  w->name = PyUnicode_DecodeUTF8(t->name, (Py_ssize_t)strlen(t->name), "strict");
  if (!w->name) { Py_DECREF(w); return NULL; }
  return (PyObject *)w;
}

/* Device pointers of a list: None -> NULL (skip), int -> that address, an
 * array (CAI / DLPack) -> its data, checked to span `want[i]` bytes. */
static void **ptr_list(PyObject *seq, size_t n, const size_t *want, uintptr_t stream,
                       const char *what) {
  PyObject *f = PySequence_Fast(seq, "a sequence of device arrays, addresses or None");
  if (!f) return NULL;
  if ((size_t)PySequence_Fast_GET_SIZE(f) != n) {
    PyErr_Format(PyExc_ValueError, "%s: %zu arrays for a set of %zu tensors", what,
                 (size_t)PySequence_Fast_GET_SIZE(f), n);
    Py_DECREF(f);
    return NULL;
  }
  void **p = PyMem_Calloc(n ? n : 1, sizeof *p);
  if (!p) { Py_DECREF(f); PyErr_NoMemory(); return NULL; }
  for (size_t i = 0; i < n; i++) {
    PyObject *o = PySequence_Fast_GET_ITEM(f, (Py_ssize_t)i);
    if (o == Py_None) continue;
    if (PyLong_Check(o)) {
      p[i] = PyLong_AsVoidPtr(o);
      if (PyErr_Occurred()) goto fail;
      continue;
    }
    Foreign fo;
    if (foreign_get(o, stream, &fo) < 0) goto fail;
    size_t nb = fo.nbytes;
    void *ptr = fo.ptr;
    Py_XDECREF(fo.owner);
    if (fo.has_stream && fo.stream != stream) {
      /* the array's pending work comes first */
      if (order_streams(0, fo.stream, stream) < 0) goto fail;
    }
    if (want && nb != want[i]) {
      PyErr_Format(PyExc_ValueError, "%s: tensor %zu spans %zu bytes, its array %zu", what,
                   i, want[i], nb);
      goto fail;
    }
    p[i] = ptr;
  }
  Py_DECREF(f);
  return p;
fail:
  Py_DECREF(f);
  PyMem_Free(p);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Producer: TensorSetC                                                     */
/* ------------------------------------------------------------------------ */

/* TensorSetC(entries, *, copies=1, align=256, device=None, timeout=10,
 *            hold=10, retired_max=2)
 * hold: the hold limit in seconds (None: none); entries: a sequence of (name, array) (wrapped: the set shares the
 * arrays' memory) or of (name, shape, dtype) (owned: the set allocates). */
static PyObject *TSet_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"entries", "copies", "align", "device", "timeout", "hold",
                        "retired_max", NULL};
  PyObject *entries, *dev_o = Py_None, *tmo_o = NULL, *hold_o = NULL;
  int copies = 1, retired_max = 2;
  Py_ssize_t align = 256;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$inOOOi", kwl, &entries, &copies, &align,
                                   &dev_o, &tmo_o, &hold_o, &retired_max))
    return NULL;
  int tmo, hold;
  if (parse_timeout(tmo_o, 10000, &tmo) < 0) return NULL;
  if (parse_timeout(hold_o, 10000, &hold) < 0) return NULL;
  gpuipc_uuid uuid;
  int have_uuid = 0;
  if (parse_uuid(dev_o, &uuid, &have_uuid) < 0) return NULL;
  PyObject *f = PySequence_Fast(entries, "entries must be a sequence");
  if (!f) return NULL;
  size_t n = (size_t)PySequence_Fast_GET_SIZE(f);
  if (n == 0) {
    Py_DECREF(f);
    return raise_msg(GPUIPC_E_INVALID_ARG, "TensorSet", "a set needs at least one tensor");
  }
  gpuipc_tensor *ts = PyMem_Calloc(n, sizeof *ts);
  ArrMeta *ms = PyMem_Calloc(n, sizeof *ms);
  int64_t (*st)[MAXD] = PyMem_Calloc(n, sizeof *st);
  PyObject *keep = PyList_New(0);
  TSetObject *o = NULL;
  int kind = -1; /* 0 owned, 1 wrapped */
  int dev = 0;
  if (!ts || !ms || !st || !keep) { PyErr_NoMemory(); goto out; }
  for (size_t i = 0; i < n; i++) {
    PyObject *e = PySequence_Fast_GET_ITEM(f, (Py_ssize_t)i);
    if (!PyTuple_Check(e) || (PyTuple_GET_SIZE(e) != 2 && PyTuple_GET_SIZE(e) != 3)) {
      PyErr_Format(PyExc_TypeError, "entry %zd: (name, array) or (name, shape, dtype)",
                   (Py_ssize_t)i);
      goto out;
    }
    int k = PyTuple_GET_SIZE(e) == 2;
    if (kind >= 0 && k != kind) {
      raise_msg(GPUIPC_E_INVALID_ARG, "TensorSet", "entries mix arrays and (shape, dtype)");
      goto out;
    }
    kind = k;
    PyObject *nm = PyTuple_GET_ITEM(e, 0);
    if (!PyUnicode_Check(nm)) {
      PyErr_Format(PyExc_TypeError, "entry %zd: the name must be a str", (Py_ssize_t)i);
      goto out;
    }
    Py_ssize_t nl;
    const char *name = PyUnicode_AsUTF8AndSize(nm, &nl);
    if (!name) goto out;
    if ((Py_ssize_t)strlen(name) != nl) {
      raise_msg(GPUIPC_E_INVALID_ARG, "TensorSet", "a name holds a NUL character");
      goto out;
    }
    ts[i].name = name;
    if (k) {
      Foreign fo;
      if (foreign_get(PyTuple_GET_ITEM(e, 1), 0, &fo) < 0) goto out;
      if (PyList_Append(keep, fo.owner ? fo.owner : PyTuple_GET_ITEM(e, 1)) < 0) {
        Py_XDECREF(fo.owner);
        goto out;
      }
      Py_XDECREF(fo.owner);
      ms[i] = fo.meta;
      ts[i].ptr = fo.ptr;
      if (fo.nbytes == 0) {
        PyErr_Format(PyExc_ValueError, "entry %zd (%s): an empty array has no memory to "
                     "share", (Py_ssize_t)i, name);
        goto out;
      }
    } else {
      size_t nb;
      if (meta_from_shape(PyTuple_GET_ITEM(e, 1), PyTuple_GET_ITEM(e, 2), &nb, &ms[i]) < 0)
        goto out;
    }
    ts[i].dtype = ms[i].dtype;
    if (!ts[i].dtype) {
      PyErr_Format(PyExc_ValueError, "entry %zd (%s): a dtype tensor sets cannot carry",
                   (Py_ssize_t)i, name);
      goto out;
    }
    ts[i].ndim = ms[i].ndim;
    ts[i].shape = ms[i].shape;
    if (ms[i].has_strides) {
      meta_fill_strides(&ms[i], st[i]);
      ts[i].strides = st[i];
    }
  }
  gpuipc_tset_options opts = GPUIPC_TSET_OPTIONS_INIT;
  opts.copies = copies;
  opts.align = (size_t)align;
  opts.device = have_uuid ? &uuid : NULL;
  opts.timeout_ms = 0; /* waits happen in this file */
  opts.hold_ms = hold;
  opts.retired_max = retired_max;
  if (have_uuid) dev = ordinal_of(&uuid);
  gpuipc_tset *s = NULL;
  gpuipc_status rc;
  Py_BEGIN_ALLOW_THREADS
  rc = gpuipc_tset_create(ts, n, &opts, &s);
  Py_END_ALLOW_THREADS
  if (rc != GPUIPC_OK) { raise_st(rc, "TensorSet"); goto out; }
  if (kind == 1) {
    /* the device of a wrapped set: where its first tensor lives */
    gpuipc_tensor t0;
    if (gpuipc_tset_get_tensor(s, 0, 0, &t0) == GPUIPC_OK) {
      PyObject *a = PyList_GET_ITEM(keep, 0);
      PyObject *d = PyObject_HasAttrString(a, "__dlpack_device__")
                        ? PyObject_CallMethod(a, "__dlpack_device__", NULL)
                        : NULL;
      if (d && PyTuple_Check(d) && PyTuple_GET_SIZE(d) == 2)
        dev = (int)PyLong_AsLong(PyTuple_GET_ITEM(d, 1));
      Py_XDECREF(d);
      PyErr_Clear();
    }
  }
  o = (TSetObject *)tp->tp_alloc(tp, 0);
  if (!o) {
    Py_BEGIN_ALLOW_THREADS
    gpuipc_tset_destroy(s);
    Py_END_ALLOW_THREADS
    goto out;
  }
  o->s = s;
  o->device = dev;
  o->wrapped = kind == 1;
  o->timeout_ms = tmo;
  o->conns = PyList_New(0);
  o->keep = keep;
  keep = NULL;
  if (!o->conns) Py_CLEAR(o);
out:
  Py_DECREF(f);
  Py_XDECREF(keep);
  PyMem_Free(ts);
  PyMem_Free(ms);
  PyMem_Free(st);
  return (PyObject *)o;
}

typedef gpuipc_status (*tset_op)(TSetObject *o, void *ctx);

/* Runs op under the lock until it stops returning `again` or the time is
 * up, polling the subscribed connections in between without the GIL or
 * the lock (a release arrives there; a peer's death hangs them up). */
static int tset_wait(TSetObject *o, int timeout_ms, tset_op op, void *ctx,
                     gpuipc_status again, gpuipc_status *st) {
  int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
  for (;;) {
    struct pollfd fds[64];
    nfds_t nf = 0;
    LOCK();
    *st = op(o, ctx);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o->conns) && nf < 64; i++) {
      ConnObject *c = (ConnObject *)PyList_GET_ITEM(o->conns, i);
      if (c->c) fds[nf++] = (struct pollfd){.fd = gpuipc_conn_get_fd(c->c), .events = POLLIN};
    }
    UNLOCK();
    flush_decrefs();
    if (*st != again) return 0;
    int left = 5; /* GPU completion wakes no socket: look again soon */
    if (deadline >= 0) {
      int64_t l = deadline - now_ms();
      if (l <= 0) return 0;
      if (l < left) left = (int)l;
    }
    int n, err;
    Py_BEGIN_ALLOW_THREADS
    n = nf ? poll(fds, nf, left) : poll(NULL, 0, left);
    err = errno;
    Py_END_ALLOW_THREADS
    if (n < 0 && err != EINTR) {
      errno = err;
      PyErr_SetFromErrno(PyExc_OSError);
      return -1;
    }
    if (PyErr_CheckSignals() < 0) return -1;
    if (n > 0) {
      /* a hung-up socket stays readable: do not spin on it */
      int hup = 0;
      for (nfds_t i = 0; i < nf; i++) hup |= fds[i].revents & (POLLHUP | POLLERR);
      if (hup) {
        Py_BEGIN_ALLOW_THREADS
        poll(NULL, 0, 1);
        Py_END_ALLOW_THREADS
      }
    }
  }
}

/* Runs f with every subscribed connection (and `extra`) in blocking mode:
 * its frames must all go out. GIL released, lock held. */
typedef struct { uintptr_t stream; ConnObject *conn; int copy; void **ptrs; } SetCtx;

static gpuipc_status blocking_call(TSetObject *o, ConnObject *extra, tset_op op, SetCtx *x) {
  gpuipc_conn *cs[257];
  size_t nc = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o->conns) && nc < 256; i++) {
    ConnObject *c = (ConnObject *)PyList_GET_ITEM(o->conns, i);
    if (c->c) cs[nc++] = c->c;
  }
  if (extra && extra->c) cs[nc++] = extra->c;
  gpuipc_status st;
  LOCK();
  Py_BEGIN_ALLOW_THREADS
  for (size_t i = 0; i < nc; i++) gpuipc_conn_set_nonblocking(cs[i], 0);
  st = op(o, x);
  for (size_t i = 0; i < nc; i++) gpuipc_conn_set_nonblocking(cs[i], 1);
  UNLOCK();
  Py_END_ALLOW_THREADS
  flush_decrefs();
  return st;
}

static gpuipc_status op_subscribe(TSetObject *o, void *v) {
  SetCtx *x = v;
  return gpuipc_tset_subscribe(o->s, x->conn->c, S(x->stream));
}
static gpuipc_status op_publish(TSetObject *o, void *v) {
  SetCtx *x = v;
  return gpuipc_tset_publish(o->s, S(x->stream));
}
static gpuipc_status op_begin(TSetObject *o, void *v) {
  SetCtx *x = v;
  return gpuipc_tset_begin(o->s, S(x->stream), &x->copy);
}
static gpuipc_status op_unsub(TSetObject *o, void *v) {
  SetCtx *x = v;
  return gpuipc_tset_unsubscribe(o->s, x->conn->c);
}
static gpuipc_status op_destroy(TSetObject *o, void *v) {
  gpuipc_status st = gpuipc_tset_destroy(o->s);
  if (st == GPUIPC_OK) o->s = NULL;
  return st;
}

/* Forgets the connections the set no longer uses. */
static void conns_prune(TSetObject *o, ConnObject *only) {
  for (Py_ssize_t i = PyList_GET_SIZE(o->conns) - 1; i >= 0; i--) {
    ConnObject *c = (ConnObject *)PyList_GET_ITEM(o->conns, i);
    if (only && c != only) continue;
    c->tset_refs--;
    PySequence_DelItem(o->conns, i);
  }
}

static PyObject *TSet_subscribe(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"conn", "stream", NULL};
  PyObject *co, *so = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|$O", kwl, &ConnType, &co, &so)) return NULL;
  if (!set_ok(o)) return NULL;
  ConnObject *c = (ConnObject *)co;
  if (!c->c) return raise_msg(GPUIPC_E_CLOSED, "subscribe", "connection closed here");
  SetCtx x = {0};
  if (parse_stream(so, &x.stream) < 0) return NULL;
  x.conn = c;
  gpuipc_status st = blocking_call(o, c, op_subscribe, &x);
  /* the set keeps conn unless it refused it outright */
  if (st == GPUIPC_OK || (st != GPUIPC_E_EXISTS && st != GPUIPC_E_INVALID_ARG &&
                          st != GPUIPC_E_NO_MEMORY && st != GPUIPC_E_PEER_GONE &&
                          st != GPUIPC_E_CLOSED)) {
    if (PyList_Append(o->conns, co) < 0) return NULL;
    c->tset_refs++;
  }
  if (st != GPUIPC_OK) return raise_st(st, "subscribe");
  Py_RETURN_NONE;
}

static PyObject *TSet_unsubscribe(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"conn", "timeout", NULL};
  PyObject *co, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|$O", kwl, &ConnType, &co, &tmo_o))
    return NULL;
  if (!set_ok(o)) return NULL;
  int tmo;
  if (parse_timeout(tmo_o, o->timeout_ms, &tmo) < 0) return NULL;
  ConnObject *c = (ConnObject *)co;
  if (!c->c) return raise_msg(GPUIPC_E_CLOSED, "unsubscribe", "connection closed here");
  SetCtx x = {0};
  x.conn = c;
  gpuipc_status st;
  if (tset_wait(o, tmo, op_unsub, &x, GPUIPC_E_TIMEOUT, &st) < 0) return NULL;
  if (st == GPUIPC_OK) conns_prune(o, c);
  if (st != GPUIPC_OK) return raise_st(st, "unsubscribe");
  Py_RETURN_NONE;
}

static PyObject *TSet_begin(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", "timeout", NULL};
  PyObject *so = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OO", kwl, &so, &tmo_o)) return NULL;
  if (!set_ok(o)) return NULL;
  int tmo;
  SetCtx x = {0};
  if (parse_stream(so, &x.stream) < 0 || parse_timeout(tmo_o, o->timeout_ms, &tmo) < 0)
    return NULL;
  gpuipc_status st;
  if (tset_wait(o, tmo, op_begin, &x, GPUIPC_E_TIMEOUT, &st) < 0) return NULL;
  if (st != GPUIPC_OK) return raise_st(st, "begin");
  return PyLong_FromLong(x.copy);
}

static size_t *set_extents(TSetObject *o, int copy, size_t n) {
  size_t *w = PyMem_Calloc(n ? n : 1, sizeof *w);
  if (!w) { PyErr_NoMemory(); return NULL; }
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    if (gpuipc_tset_get_tensor(o->s, copy, i, &t) != GPUIPC_OK) {
      PyMem_Free(w);
      raise_st(GPUIPC_E_INVALID_ARG, "tensor");
      return NULL;
    }
    w[i] = t.nbytes;
  }
  return w;
}

static PyObject *TSet_copy_from(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"copy", "srcs", "stream", NULL};
  int copy;
  PyObject *srcs, *so = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|$O", kwl, &copy, &srcs, &so)) return NULL;
  if (!set_ok(o)) return NULL;
  uintptr_t stream;
  if (parse_stream(so, &stream) < 0) return NULL;
  size_t n = gpuipc_tset_get_count(o->s);
  if (copy < 0 || copy >= gpuipc_tset_get_copies(o->s))
    return raise_msg(GPUIPC_E_INVALID_ARG, "copy_from", "no such copy");
  size_t *w = set_extents(o, copy, n);
  if (!w) return NULL;
  void **p = ptr_list(srcs, n, w, stream, "copy_from");
  PyMem_Free(w);
  if (!p) return NULL;
  gpuipc_status st;
  LOCK();
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_tset_copy_from(o->s, copy, p, S(stream));
  UNLOCK();
  Py_END_ALLOW_THREADS
  PyMem_Free(p);
  if (st != GPUIPC_OK) return raise_st(st, "copy_from");
  Py_RETURN_NONE;
}

static PyObject *TSet_publish(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", NULL};
  PyObject *so = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O", kwl, &so)) return NULL;
  if (!set_ok(o)) return NULL;
  SetCtx x = {0};
  if (parse_stream(so, &x.stream) < 0) return NULL;
  gpuipc_status st = blocking_call(o, NULL, op_publish, &x);
  if (st != GPUIPC_OK) return raise_st(st, "publish");
  return PyLong_FromUnsignedLongLong(gpuipc_tset_get_version(o->s));
}

static PyObject *TSet_tensor(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"copy", "index", NULL};
  int copy;
  Py_ssize_t i;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "in", kwl, &copy, &i)) return NULL;
  if (!set_ok(o)) return NULL;
  gpuipc_tensor t;
  if (i < 0) return raise_msg(GPUIPC_E_INVALID_ARG, "tensor", "negative index");
  gpuipc_status st = gpuipc_tset_get_tensor(o->s, copy, (size_t)i, &t);
  if (st != GPUIPC_OK) return raise_st(st, "tensor");
  return view_new((PyObject *)o, &t, o->device, 0);
}

static PyObject *TSet_find(TSetObject *o, PyObject *args) {
  const char *name;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  if (!set_ok(o)) return NULL;
  size_t i;
  gpuipc_status st = gpuipc_tset_find(o->s, name, &i);
  if (st == GPUIPC_E_NOT_FOUND) { PyErr_SetString(PyExc_KeyError, name); return NULL; }
  if (st != GPUIPC_OK) return raise_st(st, "find");
  return PyLong_FromSize_t(i);
}

static PyObject *TSet_names(TSetObject *o, PyObject *u) {
  if (!set_ok(o)) return NULL;
  size_t n = gpuipc_tset_get_count(o->s);
  PyObject *l = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; l && i < n; i++) {
    gpuipc_tensor t;
    gpuipc_tset_get_tensor(o->s, 0, i, &t);
    PyObject *s = PyUnicode_FromString(t.name);
    if (!s) { Py_CLEAR(l); break; }
    PyList_SET_ITEM(l, (Py_ssize_t)i, s);
  }
  return l;
}

static PyObject *TSet_destroy(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O", kwl, &tmo_o)) return NULL;
  if (!o->s) Py_RETURN_NONE;
  int tmo;
  if (parse_timeout(tmo_o, o->timeout_ms, &tmo) < 0) return NULL;
  gpuipc_status st;
  if (tset_wait(o, tmo, op_destroy, NULL, GPUIPC_E_BUSY, &st) < 0) return NULL;
  if (st != GPUIPC_OK) return raise_st(st, "destroy");
  conns_prune(o, NULL);
  Py_CLEAR(o->keep);
  Py_RETURN_NONE;
}

static void TSet_dealloc(TSetObject *o) {
  if (o->s) {
    gpuipc_status st;
    LOCK();
    Py_BEGIN_ALLOW_THREADS
    st = gpuipc_tset_destroy(o->s);
    UNLOCK();
    Py_END_ALLOW_THREADS
    if (st != GPUIPC_OK) {
      /* consumers still hold it: its memory stays until this process ends
       * (better than freeing memory a peer reads) */
      Py_XINCREF(o->keep);
    }
    o->s = NULL;
  }
  if (o->conns) conns_prune(o, NULL);
  Py_XDECREF(o->conns);
  Py_XDECREF(o->keep);
  Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *TSet_get(TSetObject *o, void *which) {
  if (!set_ok(o)) return NULL;
  switch ((int)(intptr_t)which) {
  case 0: return PyLong_FromSize_t(gpuipc_tset_get_count(o->s));
  case 1: return PyLong_FromLong(gpuipc_tset_get_copies(o->s));
  case 2: return PyLong_FromUnsignedLongLong(gpuipc_tset_get_layout(o->s));
  case 3: return PyLong_FromUnsignedLongLong(gpuipc_tset_get_version(o->s));
  case 4: return PyLong_FromSize_t(gpuipc_tset_get_subscribers(o->s));
  case 5: return PyBool_FromLong(o->wrapped);
  default: return PyLong_FromLong(o->device);
  }
}
static PyObject *TSet_get_destroyed(TSetObject *o, void *u) { return PyBool_FromLong(o->s == NULL); }

static PyMethodDef TSet_methods[] = {
    {"subscribe", (PyCFunction)(void (*)(void))TSet_subscribe, METH_VARARGS | METH_KEYWORDS,
     "subscribe(conn, *, stream=None): send the table and pieces (and the latest version)"},
    {"unsubscribe", (PyCFunction)(void (*)(void))TSet_unsubscribe, METH_VARARGS | METH_KEYWORDS,
     "unsubscribe(conn, *, timeout=): end it and wait for the consumer's releases"},
    {"begin", (PyCFunction)(void (*)(void))TSet_begin, METH_VARARGS | METH_KEYWORDS,
     "begin(*, stream=None, timeout=) -> copy to write"},
    {"copy_from", (PyCFunction)(void (*)(void))TSet_copy_from, METH_VARARGS | METH_KEYWORDS,
     "copy_from(copy, srcs, *, stream=None): copy arrays (or addresses, None: skip) in"},
    {"publish", (PyCFunction)(void (*)(void))TSet_publish, METH_VARARGS | METH_KEYWORDS,
     "publish(*, stream=None) -> version number"},
    {"tensor", (PyCFunction)(void (*)(void))TSet_tensor, METH_VARARGS | METH_KEYWORDS,
     "tensor(copy, index) -> TensorView of that copy"},
    {"find", (PyCFunction)TSet_find, METH_VARARGS, "find(name) -> index (KeyError)"},
    {"names", (PyCFunction)TSet_names, METH_NOARGS, "the names, in order"},
    {"destroy", (PyCFunction)(void (*)(void))TSet_destroy, METH_VARARGS | METH_KEYWORDS,
     "destroy(*, timeout=): end every subscription and free the memory"},
    {NULL}};
static PyGetSetDef TSet_getset[] = {
    {"count", (getter)TSet_get, NULL, NULL, (void *)0},
    {"copies", (getter)TSet_get, NULL, NULL, (void *)1},
    {"layout", (getter)TSet_get, NULL, NULL, (void *)2},
    {"version", (getter)TSet_get, NULL, "latest published version (0: none)", (void *)3},
    {"subscribers", (getter)TSet_get, NULL, NULL, (void *)4},
    {"wrapped", (getter)TSet_get, NULL, NULL, (void *)5},
    {"device", (getter)TSet_get, NULL, NULL, (void *)6},
    {"destroyed", (getter)TSet_get_destroyed, NULL, NULL, NULL},
    {NULL}};
PyTypeObject TSetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc._gpuipc.TensorSetC",
    .tp_basicsize = sizeof(TSetObject),
    .tp_dealloc = (destructor)TSet_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "TensorSetC(entries, *, copies=1, align=256, device=None, timeout=10, hold=10, retired_max=2): the "
              "producer's tensor set (gpuipc_tset)",
    .tp_methods = TSet_methods,
    .tp_getset = TSet_getset,
    .tp_new = TSet_new,
};

/* ------------------------------------------------------------------------ */
/* Consumer: TensorSetSub, TensorSetVersion                                 */
/* ------------------------------------------------------------------------ */

static void ver_unlink(TVerObject *v) {
  if (!v->sub) return;
  if (v->prev) v->prev->next = v->next;
  else if (v->sub->held == v) v->sub->held = v->next;
  if (v->next) v->next->prev = v->prev;
  v->next = v->prev = NULL;
}

/* TensorSetSub(conn, *, device=0) */
static PyObject *TSub_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"conn", "device", NULL};
  PyObject *co;
  int device = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|$i", kwl, &ConnType, &co, &device))
    return NULL;
  ConnObject *c = (ConnObject *)co;
  if (!c->c) return raise_msg(GPUIPC_E_CLOSED, "subscribe", "connection closed here");
  gpuipc_tset_sub *s = NULL;
  LOCK();
  gpuipc_status st = gpuipc_tset_sub_open(c->c, &s);
  UNLOCK();
  if (st != GPUIPC_OK) return raise_st(st, "TensorSetSub");
  TSubObject *o = (TSubObject *)tp->tp_alloc(tp, 0);
  if (!o) {
    LOCK();
    gpuipc_tset_sub_close(s);
    UNLOCK();
    return NULL;
  }
  o->s = s;
  Py_INCREF(co);
  o->conn = c;
  c->tset_refs++;
  o->device = device;
  o->linger = NULL;
  return (PyObject *)o;
}

static void tsub_close_now(gpuipc_tset_sub *s) {
  LOCK();
  Py_BEGIN_ALLOW_THREADS
  gpuipc_tset_sub_close(s);
  UNLOCK();
  Py_END_ALLOW_THREADS
}

static void sub_close(TSubObject *o) {
  /* Taken and cleared under the GIL before it is released: a recv in
   * another thread sees a closed subscriber, never a freed one. */
  gpuipc_tset_sub *s = o->s;
  if (!s) return;
  o->s = NULL;
  o->conn->tset_refs--;
  int viewed = 0;
  for (TVerObject *v = o->held; v; v = v->next) viewed |= v->views > 0;
  if (!viewed) {
    tsub_close_now(s);
    for (TVerObject *v = o->held; v;) {
      TVerObject *n = v->next;
      v->v = NULL; /* released by the close */
      v->next = v->prev = NULL;
      v = n;
    }
    o->held = NULL;
    return;
  }
  /* Views alive: those versions stay held, and the subscriber (and the
   * connection: the memory is its imports) open, until their views die;
   * the others are released now, as the close would (legacy stream). */
  o->linger = s;
  o->conn->held++;
  LOCK();
  for (TVerObject *v = o->held; v;) {
    TVerObject *n = v->next;
    if (v->views == 0) {
      gpuipc_tset_version_release(v->v, NULL);
      v->v = NULL;
      ver_unlink(v);
    }
    v = n;
  }
  UNLOCK();
}

/* A subscriber closed here whose last held version is gone: closes it,
 * then lets its connection go. */
static void sub_linger_end(TSubObject *o) {
  if (!o->linger || o->held) return;
  gpuipc_tset_sub *s = o->linger;
  o->linger = NULL;
  tsub_close_now(s);
  conn_held_drop(o->conn);
}

static PyObject *TSub_close(TSubObject *o, PyObject *u) {
  sub_close(o);
  Py_RETURN_NONE;
}

typedef struct { TSubObject *sub; uintptr_t stream; gpuipc_tset_version *v; } RecvCtx;
static gpuipc_status op_tset_recv(ConnObject *c, void *ctx) {
  RecvCtx *x = ctx;
  if (!x->sub->s) return GPUIPC_E_CLOSED; /* closed by another thread */
  return gpuipc_tset_recv(x->sub->s, S(x->stream), &x->v);
}

static PyObject *TSub_recv(TSubObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", "timeout", NULL};
  PyObject *so = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OO", kwl, &so, &tmo_o)) return NULL;
  if (!sub_ok(o)) return NULL;
  RecvCtx x = {o, 0, NULL};
  int tmo;
  if (parse_stream(so, &x.stream) < 0 || parse_timeout(tmo_o, o->conn->timeout_ms, &tmo) < 0)
    return NULL;
  gpuipc_status st;
  if (conn_run(o->conn, tmo, 0, op_tset_recv, &x, &st) < 0) return NULL;
  if (st == GPUIPC_E_TIMEOUT) {
    char d[80];
    snprintf(d, sizeof d, "no version within %d ms", tmo);
    return raise_msg(st, "recv", d);
  }
  if (st != GPUIPC_OK) return raise_st(st, "recv");
  TVerObject *v = PyObject_New(TVerObject, &TVerType);
  if (!v) {
    LOCK();
    gpuipc_tset_version_release(x.v, S(x.stream));
    UNLOCK();
    return NULL;
  }
  v->v = x.v;
  Py_INCREF(o);
  v->sub = o;
  v->stream = x.stream;
  v->views = 0;
  v->prev = NULL;
  v->next = o->held;
  if (o->held) o->held->prev = v;
  o->held = v;
  return (PyObject *)v;
}

static void TSub_dealloc(TSubObject *o) {
  /* No version is left (each keeps its subscriber): nothing lingers. */
  sub_close(o);
  Py_XDECREF(o->conn);
  Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *TSub_get_closed(TSubObject *o, void *u) { return PyBool_FromLong(o->s == NULL); }
static PyObject *TSub_get_conn(TSubObject *o, void *u) {
  Py_INCREF(o->conn);
  return (PyObject *)o->conn;
}

static PyMethodDef TSub_methods[] = {
    {"recv", (PyCFunction)(void (*)(void))TSub_recv, METH_VARARGS | METH_KEYWORDS,
     "recv(*, stream=None, timeout=) -> TensorSetVersion"},
    {"close", (PyCFunction)TSub_close, METH_NOARGS,
     "release every version still held and the pieces; a version with views alive "
     "(TensorView objects, and what was made from them) stays held, and mapped, until "
     "its last view dies"},
    {NULL}};
static PyGetSetDef TSub_getset[] = {
    {"closed", (getter)TSub_get_closed, NULL, NULL, NULL},
    {"conn", (getter)TSub_get_conn, NULL, NULL, NULL},
    {NULL}};
PyTypeObject TSubType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc._gpuipc.TensorSetSub",
    .tp_basicsize = sizeof(TSubObject),
    .tp_dealloc = (destructor)TSub_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "TensorSetSub(conn, *, device=0): a consumer's subscriber (gpuipc_tset_sub)",
    .tp_methods = TSub_methods,
    .tp_getset = TSub_getset,
    .tp_new = TSub_new,
};

static void ver_release(TVerObject *v, uintptr_t stream) {
  if (!v->v) return;
  LOCK();
  gpuipc_tset_version_release(v->v, S(stream));
  UNLOCK();
  v->v = NULL;
  ver_unlink(v);
  sub_linger_end(v->sub); /* after a close: the last held closes it */
}

static PyObject *Ver_release(TVerObject *v, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", NULL};
  PyObject *so = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O", kwl, &so)) return NULL;
  uintptr_t s = v->stream;
  if (so && parse_stream(so, &s) < 0) return NULL;
  ver_release(v, s);
  Py_RETURN_NONE;
}
static PyObject *Ver_exit(TVerObject *v, PyObject *args) {
  ver_release(v, v->stream);
  Py_RETURN_NONE;
}

static PyObject *Ver_tensor(TVerObject *v, PyObject *arg) {
  if (!ver_ok(v)) return NULL;
  size_t i;
  if (PyUnicode_Check(arg)) {
    const char *n = PyUnicode_AsUTF8(arg);
    if (!n) return NULL;
    gpuipc_status st = gpuipc_tset_version_find(v->v, n, &i);
    if (st == GPUIPC_E_NOT_FOUND) { PyErr_SetObject(PyExc_KeyError, arg); return NULL; }
    if (st != GPUIPC_OK) return raise_st(st, "tensor");
  } else {
    Py_ssize_t k = PyNumber_AsSsize_t(arg, PyExc_IndexError);
    if (k == -1 && PyErr_Occurred()) return NULL;
    if (k < 0 || (size_t)k >= gpuipc_tset_version_get_count(v->v)) {
      PyErr_SetString(PyExc_IndexError, "tensor index out of range");
      return NULL;
    }
    i = (size_t)k;
  }
  gpuipc_tensor t;
  gpuipc_status st = gpuipc_tset_version_get_tensor(v->v, i, &t);
  if (st != GPUIPC_OK) return raise_st(st, "tensor");
  return view_new((PyObject *)v, &t, v->sub->device, v->stream);
}

static PyObject *Ver_find(TVerObject *v, PyObject *args) {
  const char *name;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  if (!ver_ok(v)) return NULL;
  size_t i;
  gpuipc_status st = gpuipc_tset_version_find(v->v, name, &i);
  if (st == GPUIPC_E_NOT_FOUND) { PyErr_SetString(PyExc_KeyError, name); return NULL; }
  if (st != GPUIPC_OK) return raise_st(st, "find");
  return PyLong_FromSize_t(i);
}

static PyObject *Ver_names(TVerObject *v, PyObject *u) {
  if (!ver_ok(v)) return NULL;
  size_t n = gpuipc_tset_version_get_count(v->v);
  PyObject *l = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; l && i < n; i++) {
    gpuipc_tensor t;
    gpuipc_tset_version_get_tensor(v->v, i, &t);
    PyObject *s = PyUnicode_DecodeUTF8(t.name, (Py_ssize_t)strlen(t.name), "strict");
    if (!s) { Py_CLEAR(l); break; }
    PyList_SET_ITEM(l, (Py_ssize_t)i, s);
  }
  return l;
}

static PyObject *Ver_copy_into(TVerObject *v, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"dsts", "stream", NULL};
  PyObject *dsts, *so = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O", kwl, &dsts, &so)) return NULL;
  if (!ver_ok(v)) return NULL;
  uintptr_t stream = v->stream;
  if (so && parse_stream(so, &stream) < 0) return NULL;
  size_t n = gpuipc_tset_version_get_count(v->v);
  size_t *w = PyMem_Calloc(n ? n : 1, sizeof *w);
  if (!w) return PyErr_NoMemory();
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    gpuipc_tset_version_get_tensor(v->v, i, &t);
    w[i] = t.nbytes;
  }
  void **p = ptr_list(dsts, n, w, stream, "copy_into");
  PyMem_Free(w);
  if (!p) return NULL;
  if (stream != v->stream && order_streams(v->sub->device, v->stream, stream) < 0) {
    PyMem_Free(p);
    return NULL;
  }
  gpuipc_status st;
  LOCK();
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_tset_version_copy_into(v->v, p, S(stream));
  UNLOCK();
  Py_END_ALLOW_THREADS
  PyMem_Free(p);
  if (st != GPUIPC_OK) return raise_st(st, "copy_into");
  Py_RETURN_NONE;
}

static void Ver_dealloc(TVerObject *v) {
  ver_release(v, v->stream);
  Py_XDECREF(v->sub);
  PyObject_Free(v);
}

static PyObject *Ver_get(TVerObject *v, void *which) {
  if (!ver_ok(v)) return NULL;
  switch ((int)(intptr_t)which) {
  case 0: return PyLong_FromUnsignedLongLong(gpuipc_tset_version_get_number(v->v));
  case 1: return PyLong_FromUnsignedLongLong(gpuipc_tset_version_get_layout(v->v));
  case 2: return PyLong_FromLong(gpuipc_tset_version_get_copy(v->v));
  default: return PyLong_FromSize_t(gpuipc_tset_version_get_count(v->v));
  }
}
static PyObject *Ver_get_released(TVerObject *v, void *u) { return PyBool_FromLong(v->v == NULL); }
static PyObject *Ver_get_stream(TVerObject *v, void *u) { return PyLong_FromLongLong(stream_report(v->stream)); }

static PyMethodDef Ver_methods[] = {
    {"tensor", (PyCFunction)Ver_tensor, METH_O, "tensor(index or name) -> TensorView"},
    {"find", (PyCFunction)Ver_find, METH_VARARGS, "find(name) -> index (KeyError)"},
    {"names", (PyCFunction)Ver_names, METH_NOARGS, "the names, in the producer's order"},
    {"copy_into", (PyCFunction)(void (*)(void))Ver_copy_into, METH_VARARGS | METH_KEYWORDS,
     "copy_into(dsts, *, stream=recv's): copy into arrays (or addresses; None: skip)"},
    {"release", (PyCFunction)(void (*)(void))Ver_release, METH_VARARGS | METH_KEYWORDS,
     "release(*, stream=recv's): hand the version back (ordered on stream)"},
    {"__enter__", gpy_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Ver_exit, METH_VARARGS, NULL},
    {NULL}};
static PyGetSetDef Ver_getset[] = {
    {"number", (getter)Ver_get, NULL, NULL, (void *)0},
    {"layout", (getter)Ver_get, NULL, NULL, (void *)1},
    {"copy", (getter)Ver_get, NULL, NULL, (void *)2},
    {"count", (getter)Ver_get, NULL, NULL, (void *)3},
    {"released", (getter)Ver_get_released, NULL, NULL, NULL},
    {"stream", (getter)Ver_get_stream, NULL, NULL, NULL},
    {NULL}};
PyTypeObject TVerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc._gpuipc.TensorSetVersion",
    .tp_basicsize = sizeof(TVerObject),
    .tp_dealloc = (destructor)Ver_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "one received version of a tensor set (gpuipc_tset_version)",
    .tp_methods = Ver_methods,
    .tp_getset = Ver_getset,
};

/* ------------------------------------------------------------------------ */
/* TensorView                                                               */
/* ------------------------------------------------------------------------ */

static int view_alive(TViewObject *w) {
  if (Py_TYPE(w->owner) == &TVerType) return ver_ok((TVerObject *)w->owner);
  return set_ok((TSetObject *)w->owner);
}
static View view_view(TViewObject *w) {
  return (View){w->ptr, &w->meta, kDLCUDA, w->device, w->stream, 1};
}
static PyObject *TView_cai(TViewObject *w, void *u) {
  if (!view_alive(w)) return NULL;
  View v = view_view(w);
  return cai_dict(&v);
}
static PyObject *TView_dlpack(TViewObject *w, PyObject *a, PyObject *k) {
  if (!view_alive(w)) return NULL;
  View v = view_view(w);
  return dlpack_export((PyObject *)w, &v, a, k);
}
static PyObject *TView_dlpack_device(TViewObject *w, PyObject *u) {
  View v = view_view(w);
  return dlpack_device(&v);
}
ARRAY_GETTERS(TView, &((TViewObject *)o)->meta)
static PyObject *TView_ptr(TViewObject *w, void *u) { return PyLong_FromVoidPtr(w->ptr); }
static PyObject *TView_nbytes(TViewObject *w, void *u) { return PyLong_FromSize_t(w->nbytes); }
static PyObject *TView_name(TViewObject *w, void *u) {
  Py_INCREF(w->name);
  return w->name;
}
static PyObject *TView_valid(TViewObject *w, void *u) {
  if (Py_TYPE(w->owner) == &TVerType) return PyBool_FromLong(((TVerObject *)w->owner)->v != NULL);
  return PyBool_FromLong(((TSetObject *)w->owner)->s != NULL);
}
static PyObject *TView_repr(TViewObject *w) {
  PyObject *m = meta_repr_part(&w->meta);
  if (!m) return NULL;
  PyObject *r = PyUnicode_FromFormat("<gpuipc.TensorView %R %U at %p>", w->name, m, w->ptr);
  Py_DECREF(m);
  return r;
}
static void TView_dealloc(TViewObject *w) {
  if (Py_TYPE(w->owner) == &TVerType) {
    TVerObject *v = (TVerObject *)w->owner;
    /* The last view of a version its closed subscriber kept: released
     * now, as that close would have (legacy stream). */
    if (--v->views == 0 && v->v && !v->sub->s) ver_release(v, 0);
  }
  Py_XDECREF(w->owner);
  Py_XDECREF(w->name);
  PyObject_Free(w);
}
static PyMethodDef TView_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))TView_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)TView_dlpack_device, METH_NOARGS, NULL},
    {NULL}};
static PyGetSetDef TView_getset[] = {
    {"__cuda_array_interface__", (getter)TView_cai, NULL, NULL, NULL},
    {"shape", (getter)TView_shape, NULL, NULL, NULL},
    {"strides", (getter)TView_strides, NULL, "in elements", NULL},
    {"dtype", (getter)TView_dtype, NULL, NULL, NULL},
    {"ptr", (getter)TView_ptr, NULL, NULL, NULL},
    {"nbytes", (getter)TView_nbytes, NULL, NULL, NULL},
    {"name", (getter)TView_name, NULL, NULL, NULL},
    {"valid", (getter)TView_valid, NULL, "False once its version was released", NULL},
    {NULL}};
PyTypeObject TViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.TensorView",
    .tp_basicsize = sizeof(TViewObject),
    .tp_dealloc = (destructor)TView_dealloc,
    .tp_repr = (reprfunc)TView_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "one tensor of a set or version: a zero-copy view (CUDA Array Interface, "
              "DLPack), valid until its version is released",
    .tp_methods = TView_methods,
    .tp_getset = TView_getset,
};
