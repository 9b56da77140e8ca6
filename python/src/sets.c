/*
 * sets.c: tensor sets (include/gpuipc/sets.h) for Python: TensorSetC (the
 * producer's set: owned or wrapping the caller's arrays), TensorSetSub (a
 * consumer's subscriber), TensorSetVersion (one received version) and
 * TensorView (one tensor of a set or version, exported through the CUDA
 * Array Interface and DLPack) and CopyPlan (the caller's arrays for
 * copy_into / copy_from, resolved once). The mapping-style classes users
 * see are in gpuipc/sets.py.
 *
 * Speed (docs/python.md). The caller's arrays are read in C: torch
 * tensors through DLPack's C exchange API (or their own attributes on a
 * torch without it), each type looked up once; others through the array
 * protocols. Each is checked against the layout (dtype, shape, strides);
 * streams are ordered once per call; arrays read through the protocols are
 * copied in chunks as they are resolved. A version's torch tensors are
 * built in one call (Version.torch_views) and kept per (layout, copy) on
 * the subscriber, valid until their version's release.
 *
 * Waiting. Connections are non-blocking here (ext.h). The producer's set is
 * created with a timeout of 0, so begin, unsubscribe and destroy make
 * progress once and return; the waits happen in the package's one loop
 * (gpy_wait_loop, tset_wait below), on the descriptors the library names
 * (gpuipc_tset_get_wait_fds) with neither the GIL nor the module lock
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
 * releases it; the last released closes the subscriber. The torch tensors
 * of torch_views hold no version: they are valid until its release (the
 * cache is dropped at the subscriber's close). A connection's context
 * manager lets go of the sets and subscribers using it (sets_let_go).
 */
#include "ext.h"

#include <stdatomic.h>

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

typedef struct TSetObject TSetObject;
struct TSetObject {
  PyObject_HEAD
  gpuipc_tset *s;
  int device;      /* ordinal of the set's memory */
  int wrapped;
  int timeout_ms;  /* limit of begin, unsubscribe, destroy */
  PyObject *conns; /* list of the ConnObjects subscribed */
  PyObject *keep;  /* wrapped: the arrays' owners */
  TSetObject *reg_next, *reg_prev; /* live sets (sets_let_go) */
};

/* torch views of a version, kept for the next version of the same layout
 * and copy (Version.as_torch): valid while their addresses are the same. */
#define SETS_VCACHE 4
typedef struct {
  uint64_t layout;
  int copy;
  size_t n;
  void **ptrs;       /* the tensors' addresses when built */
  PyObject *tensors; /* tuple of torch tensors */
} VCache;

struct TSubObject {
  PyObject_HEAD
  gpuipc_tset_sub *s;
  ConnObject *conn;
  int device;
  TVerObject *held; /* versions not released yet */
  gpuipc_tset_sub *linger; /* closed here, kept open for held (views alive) */
  VCache vc[SETS_VCACHE];
  TSubObject *reg_next, *reg_prev; /* open subscribers (sets_let_go) */
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

/* Live sets and open subscribers, for a connection's context manager
 * (sets_let_go). Guarded by the GIL. */
static TSetObject *g_sets;
static TSubObject *g_subs;
#define REG_ADD(head, o)                                                       \
  do {                                                                         \
    (o)->reg_prev = NULL;                                                      \
    (o)->reg_next = (head);                                                    \
    if (head) (head)->reg_prev = (o);                                          \
    (head) = (o);                                                              \
  } while (0)
#define REG_DEL(head, o)                                                       \
  do {                                                                         \
    if ((o)->reg_prev) (o)->reg_prev->reg_next = (o)->reg_next;                \
    else if ((head) == (o)) (head) = (o)->reg_next;                            \
    if ((o)->reg_next) (o)->reg_next->reg_prev = (o)->reg_prev;                \
    (o)->reg_next = (o)->reg_prev = NULL;                                      \
  } while (0)

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

/* ------------------------------------------------------------------------ */
/* torch at C speed: DLPack's C exchange API (DLXApi, torchc.c)             */
/* ------------------------------------------------------------------------ */

/* torch itself: the tensor type (its tensors are read without the array
 * protocols), its exchange API where it has one, else the calls read in
 * its place. Looked up once torch is imported; gpuipc never imports it,
 * except for Version.as_torch. */
static const struct { const char *name; int d; } g_torch_dt[] = {
    {"bool", GPUIPC_DTYPE_BOOL},       {"uint8", GPUIPC_DTYPE_U8},
    {"int8", GPUIPC_DTYPE_I8},         {"uint16", GPUIPC_DTYPE_U16},
    {"int16", GPUIPC_DTYPE_I16},       {"uint32", GPUIPC_DTYPE_U32},
    {"int32", GPUIPC_DTYPE_I32},       {"uint64", GPUIPC_DTYPE_U64},
    {"int64", GPUIPC_DTYPE_I64},       {"float16", GPUIPC_DTYPE_F16},
    {"bfloat16", GPUIPC_DTYPE_BF16},   {"float32", GPUIPC_DTYPE_F32},
    {"float64", GPUIPC_DTYPE_F64},     {"complex64", GPUIPC_DTYPE_C64},
    {"complex128", GPUIPC_DTYPE_C128}, {"float8_e4m3fn", GPUIPC_DTYPE_F8_E4M3FN},
    {"float8_e5m2", GPUIPC_DTYPE_F8_E5M2},
};
#define TORCH_NDT (sizeof g_torch_dt / sizeof g_torch_dt[0])

static struct {
  int state;               /* 0 not looked up, 1 ready */
  PyObject *dtypes[TORCH_NDT]; /* torch.bool, ... (NULL: not in this torch) */
  PyObject *s_data_ptr, *s_dtype, *s_shape, *s_stride, *s_is_cuda, *s_get_device;
} g_torch;

/* 1: torch ready (torchc.c's lookup, and what is read here: its dtypes
 * and attribute names); 0: torch not imported (import 0); -1: error set. */
static int sets_torch_ready(int import) {
  if (g_torch.state == 1) return 1;
  int r = torch_lookup(import);
  if (r != 1) return r;
  PyObject *t = PyImport_ImportModule("torch"); /* imported: a lookup */
  if (!t) return -1;
  for (size_t k = 0; k < TORCH_NDT; k++) {
    g_torch.dtypes[k] = PyObject_GetAttrString(t, g_torch_dt[k].name);
    if (!g_torch.dtypes[k]) PyErr_Clear(); /* an older torch: not there */
  }
  Py_DECREF(t);
  g_torch.s_data_ptr = PyUnicode_InternFromString("data_ptr");
  g_torch.s_dtype = PyUnicode_InternFromString("dtype");
  g_torch.s_shape = PyUnicode_InternFromString("shape");
  g_torch.s_stride = PyUnicode_InternFromString("stride");
  g_torch.s_is_cuda = PyUnicode_InternFromString("is_cuda");
  g_torch.s_get_device = PyUnicode_InternFromString("get_device");
  if (!(g_torch.s_data_ptr && g_torch.s_dtype && g_torch.s_shape && g_torch.s_stride &&
        g_torch.s_is_cuda && g_torch.s_get_device))
    return -1;
  g_torch.state = 1;
  return 1;
}

/* How an array is read, per type (cached: a type is looked up once; when
 * full, later types are looked up each time). */
enum { XK_PROTOCOL = 0, XK_EXCHANGE = 1, XK_TORCH = 2 };
#define SETS_XTYPES 8
static struct { PyTypeObject *tp; int kind; const DLXApi *api; } g_xtypes[SETS_XTYPES];
static int g_nxtypes;

static int xkind_of(PyObject *o, const DLXApi **api) {
  PyTypeObject *tp = Py_TYPE(o);
  for (int i = 0; i < g_nxtypes; i++)
    if (g_xtypes[i].tp == tp) {
      *api = g_xtypes[i].api;
      return g_xtypes[i].kind;
    }
  *api = dlx_api_of((PyObject *)tp);
  if (*api && !(*api)->dltensor_from_py_object_no_sync) *api = NULL; /* it cannot be read so */
  int kind = *api ? XK_EXCHANGE : XK_PROTOCOL;
  if (!*api) {
    int r = sets_torch_ready(0);
    if (r < 0) PyErr_Clear();
    if (r == 1 && PyType_IsSubtype(tp, torch_tensor_type())) kind = XK_TORCH;
  }
  if (g_nxtypes < SETS_XTYPES) {
    Py_INCREF(tp);
    g_xtypes[g_nxtypes].tp = tp;
    g_xtypes[g_nxtypes].kind = kind;
    g_xtypes[g_nxtypes].api = *api;
    g_nxtypes++;
  }
  return kind;
}

/* A torch tensor read through its own attributes (a torch without the
 * exchange API): data_ptr(), dtype, shape, stride(), is_cuda,
 * get_device(): about a microsecond, against tens for the protocols. The
 * DLTensor's shape and strides point into the caller's arrays. */
static int torch_read(PyObject *o, DLTensor *dl, int64_t *shape, int64_t *strides) {
  memset(dl, 0, sizeof *dl);
  PyObject *cu = PyObject_GetAttr(o, g_torch.s_is_cuda);
  if (!cu) return -1;
  int is_cuda = PyObject_IsTrue(cu);
  Py_DECREF(cu);
  if (is_cuda < 0) return -1;
  dl->device.device_type = is_cuda ? kDLCUDA : kDLCPU;
  if (is_cuda) {
    PyObject *d = PyObject_CallMethodNoArgs(o, g_torch.s_get_device);
    if (!d) return -1;
    dl->device.device_id = (int32_t)PyLong_AsLong(d);
    Py_DECREF(d);
  }
  PyObject *dt = PyObject_GetAttr(o, g_torch.s_dtype);
  if (!dt) return -1;
  dl->dtype = (DLDataType){0, 0, 0}; /* lanes 0: no dtype of ours */
  for (size_t k = 0; k < TORCH_NDT; k++)
    if (g_torch.dtypes[k] == dt)
      gpuipc_dtype_to_dlpack(g_torch_dt[k].d, &dl->dtype.code, &dl->dtype.bits,
                             &dl->dtype.lanes);
  Py_DECREF(dt);
  PyObject *sh = PyObject_GetAttr(o, g_torch.s_shape);
  PyObject *st = sh ? PyObject_CallMethodNoArgs(o, g_torch.s_stride) : NULL;
  PyObject *p = st ? PyObject_CallMethodNoArgs(o, g_torch.s_data_ptr) : NULL;
  int rc = -1;
  if (p && PyTuple_Check(sh) && PyTuple_Check(st) && PyTuple_GET_SIZE(sh) <= MAXD &&
      PyTuple_GET_SIZE(st) == PyTuple_GET_SIZE(sh)) {
    dl->ndim = (int32_t)PyTuple_GET_SIZE(sh);
    for (int k = 0; k < dl->ndim; k++) {
      shape[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(sh, k));
      strides[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(st, k));
    }
    dl->shape = shape;
    dl->strides = strides;
    dl->data = PyLong_AsVoidPtr(p);
    rc = PyErr_Occurred() ? -1 : 0;
  } else if (p) {
    PyErr_SetString(PyExc_TypeError, "a torch tensor whose shape or strides could not be read");
  }
  Py_XDECREF(sh);
  Py_XDECREF(st);
  Py_XDECREF(p);
  return rc;
}


/* ------------------------------------------------------------------------ */
/* Resolving the caller's arrays against a set's layout                     */
/* ------------------------------------------------------------------------ */

/* "(3, 4)" into b. */
static const char *dims_str(char *b, size_t cap, const int64_t *d, int n) {
  size_t k = 0;
  k += (size_t)snprintf(b + k, cap - k, "(");
  for (int i = 0; i < n && k < cap; i++)
    k += (size_t)snprintf(b + k, cap - k, i ? ", %lld" : "%lld", (long long)d[i]);
  if (k < cap) snprintf(b + k, cap - k, n == 1 ? ",)" : ")");
  return b;
}

/* Row-major strides (elements) of a shape into out; strides given: those. */
static void strides_eff(const int64_t *shape, const int64_t *strides, int n, int64_t *out) {
  int64_t s = 1;
  for (int i = n - 1; i >= 0; i--) {
    out[i] = strides ? strides[i] : s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
}

/* A dtype's name for messages: "float32"; a DLPack type with no dtype of
 * ours as "dlpack(code,bits,lanes)". */
static const char *dt_str(char *b, size_t cap, int dtype, const DLDataType *raw) {
  const char *n = dtype ? dtype_name(dtype) : NULL;
  if (n) return n;
  if (dtype) return gpuipc_dtype_name(dtype);
  if (raw) snprintf(b, cap, "dlpack(%d,%d,%d)", raw->code, raw->bits, raw->lanes);
  else snprintf(b, cap, "unknown");
  return b;
}

/* Whether an array (its gpuipc_dtype, 0: none, with the DLPack type it
 * came as when known; ndim, shape, strides in elements or NULL: row-major)
 * is laid out as tensor i of the set: same dtype, same shape, same strides
 * (of the dimensions longer than 1). ValueError naming the tensor
 * otherwise. */
static int layout_check(const char *what, size_t i, const gpuipc_tensor *t, int dtype,
                        const DLDataType *raw, int ndim, const int64_t *shape,
                        const int64_t *strides) {
  char a[160], b[160], c[32], d[32];
  if (dtype != t->dtype) {
    PyErr_Format(PyExc_ValueError, "%s: tensor %zu ('%s') is %s, the array given for it %s",
                 what, i, t->name, dt_str(c, sizeof c, t->dtype, NULL),
                 dt_str(d, sizeof d, dtype, raw));
    return -1;
  }
  int same = ndim == t->ndim;
  for (int k = 0; same && k < ndim; k++) same = shape[k] == t->shape[k];
  if (!same) {
    PyErr_Format(PyExc_ValueError, "%s: tensor %zu ('%s') has shape %s, the array given for "
                 "it %s", what, i, t->name, dims_str(a, sizeof a, t->shape, t->ndim),
                 dims_str(b, sizeof b, shape, ndim));
    return -1;
  }
  int64_t x[GPUIPC_TSET_NDIM_MAX], y[GPUIPC_TSET_NDIM_MAX];
  strides_eff(t->shape, t->strides, ndim, x);
  strides_eff(shape, strides, ndim, y);
  int empty = 0;
  for (int k = 0; k < ndim; k++) empty |= shape[k] == 0;
  for (int k = 0; !empty && k < ndim; k++) {
    if (shape[k] > 1 && x[k] != y[k]) {
      PyErr_Format(PyExc_ValueError, "%s: tensor %zu ('%s') has strides %s (in elements), the "
                   "array given for it %s", what, i, t->name, dims_str(a, sizeof a, x, ndim),
                   dims_str(b, sizeof b, y, ndim));
      return -1;
    }
  }
  return 0;
}

/* What one resolution (a copy call, or a plan) found out on the way. */
typedef struct {
  const char *what;     /* "copy_into" / "copy_from", for errors */
  uintptr_t stream;     /* where the copies run */
  int xdev;             /* device of the first array read through the exchange
                           API (-1: none): torch's current stream on it is
                           ordered before `stream`, once per call */
  const DLXApi *xapi;
  int xordered;         /* done for this call */
  uintptr_t cai[8];     /* streams of CUDA-Array-Interface arrays */
  int ncai;
  int cai_over;         /* more than 8 of them: each ordered when met */
  int slow;             /* arrays read through the protocols since the last flush */
} Resolve;

static int resolve_cai_stream(Resolve *r, uintptr_t s, int now) {
  if (s == r->stream) return 0;
  for (int k = 0; k < r->ncai; k++)
    if (r->cai[k] == s) return 0;
  if (r->ncai < 8) r->cai[r->ncai++] = s;
  else r->cai_over = 1;
  return now ? order_streams(0, s, r->stream) : 0;
}

/* Orders `stream` after torch's current stream (once per call). */
static int resolve_order(Resolve *r) {
  if (r->xdev < 0 || r->xordered) return 0;
  uintptr_t cur;
  if (dlx_current_stream(r->xapi, r->xdev, &cur) < 0) return -1;
  r->xordered = 1;
  return cur == r->stream ? 0 : order_streams(r->xdev, cur, r->stream);
}

/* The device address of the array o given for tensor i (t), its layout
 * checked: None -> NULL (skip), int -> that address as it is, a tensor of
 * a type with the exchange API (torch) -> read in C, anything else through
 * __cuda_array_interface__ / __dlpack__ (the array's stream ordered before
 * the copies as it is met: `now`). */
static int resolve_one(Resolve *r, PyObject *o, size_t i, const gpuipc_tensor *t, int now,
                       void **out) {
  *out = NULL;
  if (o == Py_None) return 0;
  if (PyLong_Check(o)) {
    *out = PyLong_AsVoidPtr(o);
    return PyErr_Occurred() ? -1 : 0;
  }
  const DLXApi *x;
  int kind = xkind_of(o, &x);
  if (kind != XK_PROTOCOL) {
    DLTensor dl;
    int64_t sh[MAXD], st[MAXD];
    int rr = kind == XK_EXCHANGE ? x->dltensor_from_py_object_no_sync(o, &dl)
                                 : torch_read(o, &dl, sh, st);
    if (rr != 0) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "%s: tensor %zu ('%s'): its %.80s could not be read",
                     r->what, i, t->name, Py_TYPE(o)->tp_name);
      return -1;
    }
    if (dl.device.device_type != kDLCUDA) {
      PyErr_Format(PyExc_ValueError, "%s: tensor %zu ('%s'): the array given for it is not in "
                   "CUDA device memory (DLPack device type %d)", r->what, i, t->name,
                   (int)dl.device.device_type);
      return -1;
    }
    if (dl.ndim < 0 || dl.ndim > MAXD) {
      PyErr_Format(PyExc_ValueError, "%s: tensor %zu ('%s'): the array given for it has %d "
                   "dimensions", r->what, i, t->name, (int)dl.ndim);
      return -1;
    }
    int dtype = gpuipc_dtype_from_dlpack(dl.dtype.code, dl.dtype.bits, dl.dtype.lanes);
    if (layout_check(r->what, i, t, dtype, &dl.dtype, dl.ndim, dl.shape, dl.strides) < 0)
      return -1;
    if (r->xdev < 0) {
      r->xdev = dl.device.device_id;
      /* the stream by the type's own API; a torch tensor read through its
       * attributes: torch's (its API, else torch._C's raw stream) */
      r->xapi = kind == XK_EXCHANGE ? x : torch_api();
    }
    *out = (char *)dl.data + dl.byte_offset;
    return 0;
  }
  Foreign fo;
  if (foreign_get(o, r->stream, &fo) < 0) return -1;
  Py_XDECREF(fo.owner); /* the caller's sequence keeps o */
  r->slow++;
  if (fo.has_stream && resolve_cai_stream(r, fo.stream, now) < 0) return -1;
  if (layout_check(r->what, i, t, fo.meta.dtype, NULL, fo.meta.ndim, fo.meta.shape,
                   fo.meta.has_strides ? fo.meta.strides : NULL) < 0)
    return -1;
  if (fo.nbytes != t->nbytes) {
    PyErr_Format(PyExc_ValueError, "%s: tensor %zu ('%s') spans %zu bytes, its array %zu",
                 r->what, i, t->name, t->nbytes, fo.nbytes);
    return -1;
  }
  *out = fo.ptr;
  return 0;
}

/* What a copy call works on: the set's or the version's tensors, and the
 * library call that copies (dsts or srcs; NULL entries skipped). */
typedef struct {
  const char *what;
  size_t n;
  uint64_t layout;
  gpuipc_status (*tensor)(void *obj, size_t i, gpuipc_tensor *t);
  gpuipc_status (*copy)(void *obj, void *const *ptrs, uintptr_t stream);
  void *obj;
} CopyJob;

static int job_run(const CopyJob *j, void *const *ptrs, uintptr_t stream) {
  gpuipc_status st;
  LOCK();
  Py_BEGIN_ALLOW_THREADS
  st = j->copy(j->obj, ptrs, stream);
  UNLOCK();
  Py_END_ALLOW_THREADS
  if (st != GPUIPC_OK) {
    raise_st(st, j->what);
    return -1;
  }
  return 0;
}

static PyObject *seq_of(PyObject *seq, const CopyJob *j) {
  PyObject *f = PySequence_Fast(seq, "a sequence of device arrays, addresses or None");
  if (!f) return NULL;
  if ((size_t)PySequence_Fast_GET_SIZE(f) != j->n) {
    PyErr_Format(PyExc_ValueError, "%s: %zu arrays for a set of %zu tensors", j->what,
                 (size_t)PySequence_Fast_GET_SIZE(f), j->n);
    Py_DECREF(f);
    return NULL;
  }
  return f;
}

/* Resolves seq and copies as it goes: arrays read in C (torch, addresses)
 * cost tens of nanoseconds and are copied with one call; arrays read
 * through the Python protocols go in chunks of 16, each copied as soon as
 * it is resolved, so the GPU copies while the rest is resolved. Streams
 * are ordered once per call (torch's current stream, each distinct stream
 * a CUDA-Array-Interface array names) before the first copy that needs it. */
#define SETS_CHUNK 16
static int copy_resolving(const CopyJob *j, PyObject *seq, uintptr_t stream) {
  PyObject *f = seq_of(seq, j);
  if (!f) return -1;
  void **p = PyMem_Calloc(j->n ? j->n : 1, sizeof *p);
  if (!p) {
    Py_DECREF(f);
    PyErr_NoMemory();
    return -1;
  }
  Resolve r = {j->what, stream, -1, NULL, 0, {0}, 0, 0, 0};
  int rc = 0, pending = 0;
  size_t lo = 0;
  for (size_t i = 0; i < j->n; i++) {
    gpuipc_tensor t;
    if (j->tensor(j->obj, i, &t) != GPUIPC_OK) {
      raise_st(GPUIPC_E_INVALID_ARG, j->what);
      rc = -1;
      break;
    }
    if (resolve_one(&r, PySequence_Fast_GET_ITEM(f, (Py_ssize_t)i), i, &t, 1, &p[i]) < 0) {
      rc = -1;
      break;
    }
    pending |= p[i] != NULL;
    if (r.slow >= SETS_CHUNK && pending) {
      if (resolve_order(&r) < 0 || job_run(j, p, stream) < 0) {
        rc = -1;
        break;
      }
      memset(p + lo, 0, (i + 1 - lo) * sizeof *p);
      lo = i + 1;
      r.slow = 0;
      pending = 0;
    }
  }
  if (rc == 0 && pending && (resolve_order(&r) < 0 || job_run(j, p, stream) < 0)) rc = -1;
  PyMem_Free(p);
  Py_DECREF(f);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* CopyPlan: arrays resolved and checked once, copied per version           */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  uint64_t layout;
  int side;         /* 0: a consumer's (copy_into), 1: a producer's (copy_from) */
  size_t n;
  void **ptrs;
  PyObject *refs;   /* the arrays, kept alive */
  int xdev;         /* torch's device (-1: no torch tensor) */
  const DLXApi *xapi;
  uintptr_t cai[8]; /* CUDA-Array-Interface arrays' streams */
  int ncai, cai_over;
} TPlanObject;

static PyTypeObject TPlanType;

static PyObject *plan_make(const CopyJob *j0, PyObject *seq, uintptr_t stream, int side) {
  CopyJob jw = *j0;
  jw.what = side ? "plan_from" : "plan_into";
  const CopyJob *j = &jw;
  PyObject *f = seq_of(seq, j);
  if (!f) return NULL;
  TPlanObject *pl = PyObject_GC_New(TPlanObject, &TPlanType);
  if (!pl) {
    Py_DECREF(f);
    return NULL;
  }
  pl->layout = j->layout;
  pl->side = side;
  pl->n = j->n;
  pl->refs = PySequence_List(f); /* its own list: the caller's may change */
  Py_DECREF(f);
  f = pl->refs;
  pl->ptrs = PyMem_Calloc(j->n ? j->n : 1, sizeof *pl->ptrs);
  pl->xdev = -1;
  pl->xapi = NULL;
  pl->ncai = pl->cai_over = 0;
  if (!pl->refs || !pl->ptrs) {
    Py_DECREF(pl);
    return PyErr_NoMemory();
  }
  const char *what = side ? "plan_from" : "plan_into";
  Resolve r = {what, stream, -1, NULL, 0, {0}, 0, 0, 0};
  for (size_t i = 0; i < j->n; i++) {
    gpuipc_tensor t;
    if (j->tensor(j->obj, i, &t) != GPUIPC_OK) {
      Py_DECREF(pl);
      return raise_st(GPUIPC_E_INVALID_ARG, j->what);
    }
    if (resolve_one(&r, PySequence_Fast_GET_ITEM(f, (Py_ssize_t)i), i, &t, 0, &pl->ptrs[i]) < 0) {
      Py_DECREF(pl);
      return NULL;
    }
  }
  if (r.cai_over) {
    Py_DECREF(pl);
    return raise_msg(GPUIPC_E_INVALID_ARG, what, "a plan takes arrays of at most 8 "
                     "different streams (copy without a plan)");
  }
  pl->xdev = r.xdev;
  pl->xapi = r.xapi;
  pl->ncai = r.ncai;
  memcpy(pl->cai, r.cai, sizeof pl->cai);
  PyObject_GC_Track(pl);
  return (PyObject *)pl;
}

/* Copies with a plan: its layout checked, its streams ordered once. */
static int plan_run(const CopyJob *j, TPlanObject *pl, uintptr_t stream, int side) {
  if (pl->side != side) {
    raise_msg(GPUIPC_E_INVALID_ARG, j->what, side ? "a plan of copy_into (Version.plan_into) "
              "given to copy_from" : "a plan of copy_from (TensorSet.plan_from) given to "
              "copy_into");
    return -1;
  }
  if (!pl->refs) {
    raise_msg(GPUIPC_E_INVALID_ARG, j->what, "the plan was cleared (garbage collection)");
    return -1;
  }
  if (pl->layout != j->layout || pl->n != j->n) {
    char d[160];
    snprintf(d, sizeof d, "the plan was made for layout %#llx, this is layout %#llx: make a "
             "new plan", (unsigned long long)pl->layout, (unsigned long long)j->layout);
    raise_msg(GPUIPC_E_INVALID_ARG, j->what, d);
    return -1;
  }
  for (int k = 0; k < pl->ncai; k++)
    if (pl->cai[k] != stream && order_streams(0, pl->cai[k], stream) < 0) return -1;
  if (pl->xdev >= 0) {
    uintptr_t cur;
    if (dlx_current_stream(pl->xapi, pl->xdev, &cur) < 0) return -1;
    if (cur != stream && order_streams(pl->xdev, cur, stream) < 0) return -1;
  }
  return job_run(j, pl->ptrs, stream);
}

/* A plan holds the caller's arrays: the garbage collector sees them (an
 * array that refers back to its plan makes a cycle it can collect). A
 * plan is tracked once it is whole. */
static int TPlan_traverse(TPlanObject *pl, visitproc visit, void *arg) {
  Py_VISIT(pl->refs);
  return 0;
}
static int TPlan_clear(TPlanObject *pl) {
  Py_CLEAR(pl->refs);
  pl->n = 0; /* its addresses are no longer kept alive: never used again */
  return 0;
}
static void TPlan_dealloc(TPlanObject *pl) {
  if (PyObject_GC_IsTracked((PyObject *)pl)) PyObject_GC_UnTrack(pl);
  PyMem_Free(pl->ptrs);
  Py_XDECREF(pl->refs);
  PyObject_GC_Del(pl);
}
static PyObject *TPlan_get(TPlanObject *pl, void *which) {
  switch ((int)(intptr_t)which) {
  case 0: return PyLong_FromUnsignedLongLong(pl->layout);
  case 1: return PyLong_FromSize_t(pl->n);
  case 2: return PyUnicode_FromString(pl->side ? "copy_from" : "copy_into");
  default:
    if (!pl->refs) Py_RETURN_NONE;
    Py_INCREF(pl->refs);
    return pl->refs;
  }
}
static PyObject *TPlan_repr(TPlanObject *pl) {
  return PyUnicode_FromFormat("<gpuipc.CopyPlan for %s of %zu tensors, layout %llx>",
                              pl->side ? "copy_from" : "copy_into", pl->n,
                              (unsigned long long)pl->layout);
}
static PyGetSetDef TPlan_getset[] = {
    {"layout", (getter)TPlan_get, NULL, "the layout it was made for", (void *)0},
    {"count", (getter)TPlan_get, NULL, "tensors", (void *)1},
    {"kind", (getter)TPlan_get, NULL, "'copy_into' or 'copy_from'", (void *)2},
    {"arrays", (getter)TPlan_get, NULL, "the arrays, in the set's order (kept alive)", (void *)3},
    {NULL}};
static PyTypeObject TPlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.CopyPlan",
    .tp_basicsize = sizeof(TPlanObject),
    .tp_dealloc = (destructor)TPlan_dealloc,
    .tp_repr = (reprfunc)TPlan_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)TPlan_traverse,
    .tp_clear = (inquiry)TPlan_clear,
    .tp_doc = "the caller's arrays for one layout, resolved and checked once "
              "(Version.plan_into, TensorSet.plan_from); it keeps them alive, and a copy "
              "with it reads their addresses as they were then",
    .tp_getset = TPlan_getset,
};

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
  REG_ADD(g_sets, o);
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

/* What gpy_wait_loop needs for a call of the producer's set (begin,
 * unsubscribe, destroy; made with a timeout of 0): the call, the status
 * that says it would wait, and the descriptors to wait on, taken with the
 * attempt (gpuipc_tset_get_wait_fds: the subscribed connections' sockets,
 * where a release or a hang-up arrives). */
#define TSET_WAIT_FDS 64
typedef struct {
  TSetObject *o;
  tset_op op;
  void *ctx;
  gpuipc_status again;
  struct pollfd fds[TSET_WAIT_FDS];
  nfds_t nf;
} TSetRun;

static gpuipc_status ts_try(void *v) {
  TSetRun *r = v;
  int fds[TSET_WAIT_FDS];
  LOCK();
  gpuipc_status st = r->op(r->o, r->ctx);
  size_t n = r->o->s ? gpuipc_tset_get_wait_fds(r->o->s, fds, TSET_WAIT_FDS) : 0;
  UNLOCK();
  flush_decrefs();
  r->nf = (nfds_t)(n < TSET_WAIT_FDS ? n : TSET_WAIT_FDS);
  for (nfds_t i = 0; i < r->nf; i++) r->fds[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
  return st == r->again ? GPUIPC_E_WOULD_BLOCK : st;
}

/* At most 5 ms at a time: GPU completion and the hold limit wake no
 * socket. A hung-up socket stays readable: a wait that ends on one sleeps
 * a millisecond more rather than spin on it. */
static gpuipc_status ts_sleep(void *v, short events, int timeout_ms, int spin_us) {
  TSetRun *r = v;
  gpuipc_status w = gpy_poll_fds(r->fds, r->nf, timeout_ms < 5 ? timeout_ms : 5, 0);
  if (w == GPUIPC_E_SYSTEM) {
    PyErr_SetFromErrno(PyExc_OSError);
    return GPY_RAISED;
  }
  int hup = 0;
  for (nfds_t i = 0; w == GPUIPC_OK && i < r->nf; i++)
    hup |= r->fds[i].revents & (POLLHUP | POLLERR);
  if (hup) (void)gpy_poll_fds(NULL, 0, 1, 0);
  return w;
}

/* Runs op under the lock until it stops returning `again` or the time is
 * up (*st: `again` then), waiting in between in the package's one loop
 * (gpy_wait_loop) without the GIL or the lock. -1 with an exception set
 * (a signal, poll failing). */
static int tset_wait(TSetObject *o, int timeout_ms, tset_op op, void *ctx,
                     gpuipc_status again, gpuipc_status *st) {
  TSetRun r = {.o = o, .op = op, .ctx = ctx, .again = again};
  if (gpy_wait_loop(timeout_ms, POLLIN, 0, ts_try, ts_sleep, &r, st) < 0) return -1;
  if (*st == GPUIPC_E_TIMEOUT) *st = again;
  return 0;
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

typedef struct { TSetObject *o; int copy; } SetJob;
static gpuipc_status setjob_tensor(void *obj, size_t i, gpuipc_tensor *t) {
  SetJob *x = obj;
  return gpuipc_tset_get_tensor(x->o->s, x->copy, i, t);
}
static gpuipc_status setjob_copy(void *obj, void *const *ptrs, uintptr_t stream) {
  SetJob *x = obj;
  return gpuipc_tset_copy_from(x->o->s, x->copy, ptrs, S(stream));
}
static CopyJob set_job(TSetObject *o, SetJob *x, int copy) {
  x->o = o;
  x->copy = copy;
  return (CopyJob){"copy_from", gpuipc_tset_get_count(o->s), gpuipc_tset_get_layout(o->s),
                   setjob_tensor, setjob_copy, x};
}

static PyObject *TSet_copy_from(TSetObject *o, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"copy", "srcs", "stream", NULL};
  int copy;
  PyObject *srcs, *so = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|$O", kwl, &copy, &srcs, &so)) return NULL;
  if (!set_ok(o)) return NULL;
  uintptr_t stream;
  if (parse_stream(so, &stream) < 0) return NULL;
  if (copy < 0 || copy >= gpuipc_tset_get_copies(o->s))
    return raise_msg(GPUIPC_E_INVALID_ARG, "copy_from", "no such copy");
  SetJob x;
  CopyJob j = set_job(o, &x, copy);
  int rc = Py_TYPE(srcs) == &TPlanType ? plan_run(&j, (TPlanObject *)srcs, stream, 1)
                                       : copy_resolving(&j, srcs, stream);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

/* plan(srcs) -> CopyPlan for copy_from (the layout of every copy) */
static PyObject *TSet_plan(TSetObject *o, PyObject *srcs) {
  if (!set_ok(o)) return NULL;
  SetJob x;
  CopyJob j = set_job(o, &x, 0);
  return plan_make(&j, srcs, 0, 1);
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
  REG_DEL(g_sets, o);
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

/* Docstrings open with their signature ("name($self, /, ...)\n--\n\n", which
 * inspect.signature reads). A timeout left out is the set's own (its
 * constructor's timeout=), None waits forever: its default is `...` (left out). */
static PyMethodDef TSet_methods[] = {
    {"subscribe", (PyCFunction)(void (*)(void))TSet_subscribe, METH_VARARGS | METH_KEYWORDS,
     "subscribe($self, /, conn, *, stream=None)\n--\n\n"
     "subscribe(conn, *, stream=None): send the table and pieces (and the latest version)"},
    {"unsubscribe", (PyCFunction)(void (*)(void))TSet_unsubscribe, METH_VARARGS | METH_KEYWORDS,
     "unsubscribe($self, /, conn, *, timeout=...)\n--\n\n"
     "unsubscribe(conn, *, timeout=): end it and wait for the consumer's releases"},
    {"begin", (PyCFunction)(void (*)(void))TSet_begin, METH_VARARGS | METH_KEYWORDS,
     "begin($self, /, *, stream=None, timeout=...)\n--\n\n"
     "begin(*, stream=None, timeout=) -> copy to write"},
    {"copy_from", (PyCFunction)(void (*)(void))TSet_copy_from, METH_VARARGS | METH_KEYWORDS,
     "copy_from($self, /, copy, srcs, *, stream=None)\n--\n\n"
     "copy_from(copy, srcs, *, stream=None): copy arrays (or addresses, None: skip; or a "
     "CopyPlan) in"},
    {"plan", (PyCFunction)TSet_plan, METH_O,
     "plan($self, srcs, /)\n--\n\n"
     "plan(srcs) -> CopyPlan: srcs resolved and checked once, for copy_from"},
    {"publish", (PyCFunction)(void (*)(void))TSet_publish, METH_VARARGS | METH_KEYWORDS,
     "publish($self, /, *, stream=None)\n--\n\npublish(*, stream=None) -> version number"},
    {"tensor", (PyCFunction)(void (*)(void))TSet_tensor, METH_VARARGS | METH_KEYWORDS,
     "tensor($self, /, copy, index)\n--\n\ntensor(copy, index) -> TensorView of that copy"},
    {"find", (PyCFunction)TSet_find, METH_VARARGS,
     "find($self, name, /)\n--\n\nfind(name) -> index (KeyError)"},
    {"names", (PyCFunction)TSet_names, METH_NOARGS, "names($self, /)\n--\n\nthe names, in order"},
    {"destroy", (PyCFunction)(void (*)(void))TSet_destroy, METH_VARARGS | METH_KEYWORDS,
     "destroy($self, /, *, timeout=...)\n--\n\n"
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
    .tp_doc = "TensorSetC(entries, *, copies=1, align=256, device=None, timeout=10, hold=10, "
              "retired_max=2)\n--\n\n"
              "TensorSetC(entries, *, copies=1, align=256, device=None, timeout=10, hold=10, retired_max=2): the "
              "producer's tensor set (gpuipc_tset)",
    .tp_methods = TSet_methods,
    .tp_getset = TSet_getset,
    .tp_new = TSet_new,
};

/* ------------------------------------------------------------------------ */
/* Consumer: TensorSetSub, TensorSetVersion                                 */
/* ------------------------------------------------------------------------ */

static void vcache_clear(TSubObject *o);

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
  REG_ADD(g_subs, o);
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
  vcache_clear(o); /* its torch tensors are valid until this close */
  REG_DEL(g_subs, o);
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
  vcache_clear(o);
  Py_XDECREF(o->conn);
  Py_TYPE(o)->tp_free((PyObject *)o);
}

static PyObject *TSub_get_closed(TSubObject *o, void *u) { return PyBool_FromLong(o->s == NULL); }
static PyObject *TSub_get_conn(TSubObject *o, void *u) {
  Py_INCREF(o->conn);
  return (PyObject *)o->conn;
}

/* recv's timeout left out is the connection's (Connection.timeout), None
 * waits forever: its signature's default is `...` (left out). */
static PyMethodDef TSub_methods[] = {
    {"recv", (PyCFunction)(void (*)(void))TSub_recv, METH_VARARGS | METH_KEYWORDS,
     "recv($self, /, *, stream=None, timeout=...)\n--\n\n"
     "recv(*, stream=None, timeout=) -> TensorSetVersion"},
    {"close", (PyCFunction)TSub_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
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
    .tp_doc = "TensorSetSub(conn, *, device=0)\n--\n\n"
              "TensorSetSub(conn, *, device=0): a consumer's subscriber (gpuipc_tset_sub)",
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

/* A version's torch tensors, built in one call: one allocation holds
 * every tensor's DLPack struct, freed when the last tensor is gone (any
 * thread: torch may drop a tensor without the GIL). */
typedef struct {
  union {
    DLManagedTensorVersioned v;
    DLManagedTensor m;
  } u;
  int64_t dims[2 * GPUIPC_TSET_NDIM_MAX];
} BatchItem;
typedef struct {
  atomic_long refs; /* tensors not deleted yet */
  size_t n;
  BatchItem it[];
} Batch;

static void batch_unref(Batch *b) {
  if (atomic_fetch_sub(&b->refs, 1) == 1) PyMem_RawFree(b);
}
static void batch_del_v(DLManagedTensorVersioned *m) { batch_unref(m->manager_ctx); }
static void batch_del_m(DLManagedTensor *m) { batch_unref(m->manager_ctx); }
static void batch_capsule_dtor(PyObject *cap) {
  /* unconsumed (torch refused it): still ours */
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m) m->deleter(m);
  }
  PyErr_Clear();
}

static void vcache_drop(VCache *e) {
  Py_CLEAR(e->tensors);
  PyMem_Free(e->ptrs);
  e->ptrs = NULL;
  e->n = 0;
}
static void vcache_clear(TSubObject *o) {
  for (int k = 0; k < SETS_VCACHE; k++) vcache_drop(&o->vc[k]);
}

/* Whether the cached tensors are still what was built (a tensor changed
 * in place, t.resize_() say, is not handed out again). */
static int vcache_intact(const VCache *e) {
  if (!torch_api() || !torch_api()->dltensor_from_py_object_no_sync) return 1;
  for (size_t i = 0; i < e->n; i++) {
    DLTensor dl;
    if (torch_api()->dltensor_from_py_object_no_sync(PyTuple_GET_ITEM(e->tensors, (Py_ssize_t)i),
                                                     &dl) != 0) {
      PyErr_Clear();
      return 0;
    }
    if ((char *)dl.data + dl.byte_offset != (char *)e->ptrs[i]) return 0;
  }
  return 1;
}

/* The torch tensors of v's n tensors (a new tuple). */
static PyObject *torch_build(TVerObject *v, size_t n) {
  Batch *b = PyMem_RawCalloc(1, sizeof *b + (n ? n : 1) * sizeof(BatchItem));
  if (!b) return PyErr_NoMemory();
  b->n = n;
  atomic_init(&b->refs, (long)n);
  PyObject *tup = PyTuple_New((Py_ssize_t)n);
  size_t i = 0;
  if (!tup) goto fail;
  for (; i < n; i++) {
    gpuipc_tensor t;
    if (gpuipc_tset_version_get_tensor(v->v, i, &t) != GPUIPC_OK) {
      raise_st(GPUIPC_E_INVALID_ARG, "as_torch");
      goto fail;
    }
    BatchItem *it = &b->it[i];
    DLTensor *d = torch_api() ? &it->u.v.dl_tensor : &it->u.m.dl_tensor;
    d->data = t.ptr;
    d->device = (DLDevice){kDLCUDA, v->sub->device};
    d->ndim = t.ndim;
    gpuipc_dtype_to_dlpack(t.dtype, &d->dtype.code, &d->dtype.bits, &d->dtype.lanes);
    for (int k = 0; k < t.ndim; k++) it->dims[k] = t.shape[k];
    strides_eff(t.shape, t.strides, t.ndim, it->dims + GPUIPC_TSET_NDIM_MAX);
    d->shape = it->dims;
    d->strides = it->dims + GPUIPC_TSET_NDIM_MAX;
    d->byte_offset = 0;
    PyObject *x = NULL;
    if (torch_api()) {
      it->u.v.version = (DLPackVersion){1, 0};
      it->u.v.manager_ctx = b;
      it->u.v.deleter = batch_del_v;
      if (torch_api()->managed_tensor_to_py_object_no_sync(&it->u.v, (void **)&x) != 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "as_torch: torch refused");
        goto fail;
      }
    } else {
      it->u.m.manager_ctx = b;
      it->u.m.deleter = batch_del_m;
      PyObject *cap = PyCapsule_New(&it->u.m, "dltensor", batch_capsule_dtor);
      if (!cap) goto fail;
      x = torch_from_capsule(cap);
      Py_DECREF(cap); /* consumed: renamed; else its destructor gave it back */
      if (!x) {
        i++;
        goto fail;
      }
    }
    PyTuple_SET_ITEM(tup, (Py_ssize_t)i, x);
  }
  return tup;
fail:
  /* items from i on were never handed to torch */
  for (size_t k = i; k < n; k++) batch_unref(b);
  Py_XDECREF(tup);
  return NULL;
}

/* torch_views(): every tensor of the version as a torch tensor, zero
 * copy, built in one call; torch's current stream ordered after recv's
 * stream once. The same tensor objects come back for a later version of
 * the same layout and copy while their addresses are the same (a copy is
 * rewritten only once its version was released). */
static PyObject *Ver_torch_views(TVerObject *v, PyObject *u) {
  if (!ver_ok(v)) return NULL;
  if (sets_torch_ready(1) < 0) return NULL;
  TSubObject *sub = v->sub;
  size_t n = gpuipc_tset_version_get_count(v->v);
  uint64_t layout = gpuipc_tset_version_get_layout(v->v);
  int copy = gpuipc_tset_version_get_copy(v->v);
  uintptr_t cur;
  if (dlx_current_stream(torch_api(), sub->device, &cur) < 0) return NULL;
  if (cur != v->stream && order_streams(sub->device, v->stream, cur) < 0) return NULL;
  void **ptrs = PyMem_Malloc((n ? n : 1) * sizeof *ptrs);
  if (!ptrs) return PyErr_NoMemory();
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    gpuipc_tset_version_get_tensor(v->v, i, &t);
    ptrs[i] = t.ptr;
  }
  if (!sub->s) { /* closed here, the version kept by its views: not kept again */
    PyMem_Free(ptrs);
    return torch_build(v, n);
  }
  VCache *slot = NULL;
  for (int k = 0; k < SETS_VCACHE; k++) {
    VCache *e = &sub->vc[k];
    if (e->tensors && e->layout != layout) vcache_drop(e); /* an older layout's */
    if (e->tensors && e->copy == copy) slot = e;
  }
  if (slot && slot->n == n && !memcmp(slot->ptrs, ptrs, n * sizeof *ptrs) &&
      vcache_intact(slot)) {
    PyMem_Free(ptrs);
    Py_INCREF(slot->tensors);
    return slot->tensors;
  }
  PyObject *tup = torch_build(v, n);
  if (!tup) {
    PyMem_Free(ptrs);
    return NULL;
  }
  if (!slot)
    for (int k = 0; k < SETS_VCACHE && !slot; k++)
      if (!sub->vc[k].tensors) slot = &sub->vc[k];
  if (!slot) slot = &sub->vc[0];
  vcache_drop(slot);
  slot->layout = layout;
  slot->copy = copy;
  slot->n = n;
  slot->ptrs = ptrs;
  Py_INCREF(tup);
  slot->tensors = tup;
  return tup;
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

typedef struct { TVerObject *v; } VerJob;
static gpuipc_status verjob_tensor(void *obj, size_t i, gpuipc_tensor *t) {
  return gpuipc_tset_version_get_tensor(((VerJob *)obj)->v->v, i, t);
}
static gpuipc_status verjob_copy(void *obj, void *const *ptrs, uintptr_t stream) {
  return gpuipc_tset_version_copy_into(((VerJob *)obj)->v->v, ptrs, S(stream));
}
static CopyJob ver_job(TVerObject *v, VerJob *x) {
  x->v = v;
  return (CopyJob){"copy_into", gpuipc_tset_version_get_count(v->v),
                   gpuipc_tset_version_get_layout(v->v), verjob_tensor, verjob_copy, x};
}

static PyObject *Ver_copy_into(TVerObject *v, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"dsts", "stream", NULL};
  PyObject *dsts, *so = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$O", kwl, &dsts, &so)) return NULL;
  if (!ver_ok(v)) return NULL;
  uintptr_t stream = v->stream;
  if (so && parse_stream(so, &stream) < 0) return NULL;
  if (stream != v->stream && order_streams(v->sub->device, v->stream, stream) < 0) return NULL;
  VerJob x;
  CopyJob j = ver_job(v, &x);
  int rc = Py_TYPE(dsts) == &TPlanType ? plan_run(&j, (TPlanObject *)dsts, stream, 0)
                                       : copy_resolving(&j, dsts, stream);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

/* plan(dsts) -> CopyPlan for copy_into, good for every version of this
 * version's layout */
static PyObject *Ver_plan(TVerObject *v, PyObject *dsts) {
  if (!ver_ok(v)) return NULL;
  VerJob x;
  CopyJob j = ver_job(v, &x);
  return plan_make(&j, dsts, v->stream, 0);
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

/* copy_into's and release's stream left out is the version's receive
 * stream (None: the legacy stream): their signatures' default is `...` (left out). */
static PyMethodDef Ver_methods[] = {
    {"tensor", (PyCFunction)Ver_tensor, METH_O,
     "tensor($self, key, /)\n--\n\ntensor(index or name) -> TensorView"},
    {"find", (PyCFunction)Ver_find, METH_VARARGS,
     "find($self, name, /)\n--\n\nfind(name) -> index (KeyError)"},
    {"names", (PyCFunction)Ver_names, METH_NOARGS,
     "names($self, /)\n--\n\nthe names, in the producer's order"},
    {"copy_into", (PyCFunction)(void (*)(void))Ver_copy_into, METH_VARARGS | METH_KEYWORDS,
     "copy_into($self, /, dsts, *, stream=...)\n--\n\n"
     "copy_into(dsts, *, stream=recv's): copy into arrays (or addresses; None: skip; or a "
     "CopyPlan)"},
    {"plan", (PyCFunction)Ver_plan, METH_O,
     "plan($self, dsts, /)\n--\n\n"
     "plan(dsts) -> CopyPlan: dsts resolved and checked once, for copy_into of every "
     "version of this layout"},
    {"torch_views", (PyCFunction)Ver_torch_views, METH_NOARGS,
     "torch_views($self, /)\n--\n\n"
     "torch_views() -> tuple of torch tensors, zero-copy, in the producer's order"},
    {"release", (PyCFunction)(void (*)(void))Ver_release, METH_VARARGS | METH_KEYWORDS,
     "release($self, /, *, stream=...)\n--\n\n"
     "release(*, stream=recv's): hand the version back (ordered on stream)"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Ver_exit, METH_VARARGS,
     "__exit__($self, /, *exc)\n--\n\nreleases it"},
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
    {"__dlpack__", (PyCFunction)(void (*)(void))TView_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, /, stream=None, *, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "A DLPack capsule of the tensor"},
    {"__dlpack_device__", (PyCFunction)TView_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(device_type, device_id) of the tensor"},
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

/* ------------------------------------------------------------------------ */
/* A connection's context manager; module hook                              */
/* ------------------------------------------------------------------------ */

int sets_let_go(ConnObject *c) {
  for (TSubObject *o = g_subs; o;) {
    TSubObject *n = o->reg_next;
    if (o->conn == c) sub_close(o); /* unlinks o */
    o = n;
  }
  int rc = 0;
  for (TSetObject *o = g_sets; o && c->tset_refs > 0;) {
    TSetObject *n = o->reg_next;
    int uses = 0;
    for (Py_ssize_t i = 0; o->conns && i < PyList_GET_SIZE(o->conns); i++)
      uses |= PyList_GET_ITEM(o->conns, i) == (PyObject *)c;
    if (uses && o->s) {
      Py_INCREF(o);
      SetCtx x = {0};
      x.conn = c;
      gpuipc_status st;
      if (tset_wait(o, o->timeout_ms, op_unsub, &x, GPUIPC_E_TIMEOUT, &st) < 0) rc = -1;
      else if (st == GPUIPC_OK || st == GPUIPC_E_NOT_FOUND) conns_prune(o, c);
      n = o->reg_next;
      Py_DECREF(o);
      if (rc < 0) break;
    }
    o = n;
  }
  return rc;
}

int sets_init(PyObject *m) {
  if (PyType_Ready(&TPlanType) < 0) return -1;
  Py_INCREF(&TPlanType);
  return PyModule_AddObject(m, "CopyPlan", (PyObject *)&TPlanType);
}
