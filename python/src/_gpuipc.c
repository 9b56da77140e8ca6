/*
 * _gpuipc.c: the CPython extension gpuipc._gpuipc, over gpuipc's public C
 * API only (gpuipc.h). It owns the Python objects (Listener, Connection,
 * Arena, Block, Pool, Buffer, Event, Received, Shared, Child), the error
 * classes named after the status codes, the array metadata that travels in
 * a buffer's meta bytes, and the two array protocols (CUDA Array Interface
 * v3, DLPack with its capsule rules, versioned and not).
 *
 * Threads. Connections and arenas must be used by one thread at a time,
 * and a connection together with the arenas it sends from (progress on a
 * connection processes releases of arena blocks). So every call on a
 * connection, arena or block runs under one module lock, g_lock, held only
 * for calls that do not wait: connections are switched to non-blocking mode
 * and waits happen here, in poll(2) on the connection's socket, with the
 * GIL and the lock released. A thread holding g_lock never needs the GIL,
 * so taking g_lock with the GIL held cannot deadlock.
 *
 * Memory sent that gpuipc did not allocate (a torch tensor, a CuPy array)
 * is wrapped (gpuipc_buffer_wrap) per send; the wrapper and the Python
 * object owning the memory are kept until the peer released it (or, after
 * the connection closed, until the peer process is gone).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>

#include <errno.h>
#include <stdio.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <gpuipc.h>

/* ------------------------------------------------------------------------ */
/* DLPack (dlpack.h, v1.0 layout)                                           */
/* ------------------------------------------------------------------------ */

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6 };

typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* ------------------------------------------------------------------------ */
/* Module state                                                             */
/* ------------------------------------------------------------------------ */

static PyThread_type_lock g_lock;
#define LOCK() PyThread_acquire_lock(g_lock, WAIT_LOCK)
#define UNLOCK() PyThread_release_lock(g_lock)

static PyObject *ErrorBase;
static PyObject *ErrorClass[GPUIPC__STATUS_END];

/* Counters the tests read (gpuipc._gpuipc.counters()). */
static struct {
  long long live_received, live_blocks, live_buffers, live_capsule_ctx;
  long long wraps_live, wraps_total, graveyard;
} g_count;

/* Events used to order one stream after another (per device ordinal). */
#define MAX_DEV 64
static gpuipc_event *g_sync_event[MAX_DEV];

static PyTypeObject ListenerType, ConnType, ArenaType, BlockType, PoolType,
    BufferType, EventType, ReceivedType, SharedType, ChildType;

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

/* Raises the class of status st with the library's message. Call right
 * after the failing call, on the same thread. */
static PyObject *raise_msg(gpuipc_status st, const char *what, const char *detail) {
  if (st <= 0 || st >= GPUIPC__STATUS_END) st = GPUIPC_E_INTERNAL;
  const char *hint = "";
  if (st == GPUIPC_E_FORKED)
    hint = " (this process was forked after CUDA was initialized: start "
           "children with gpuipc.spawn() or multiprocessing's 'spawn' start "
           "method)";
  PyObject *msg = PyUnicode_FromFormat("%s: %s%s%s%s", what, gpuipc_strerror(st),
                                       detail && *detail ? " (" : "",
                                       detail && *detail ? detail : "",
                                       detail && *detail ? ")" : "");
  if (!msg) return NULL;
  if (*hint) {
    PyObject *m2 = PyUnicode_FromFormat("%U%s", msg, hint);
    Py_DECREF(msg);
    if (!m2) return NULL;
    msg = m2;
  }
  PyObject *exc = PyObject_CallOneArg(ErrorClass[st], msg);
  Py_DECREF(msg);
  if (!exc) return NULL;
  PyObject *code = PyLong_FromLong(st);
  PyObject *name = PyUnicode_FromString(gpuipc_status_name(st));
  PyObject *det = PyUnicode_FromString(detail ? detail : "");
  if (code && name && det) {
    PyObject_SetAttrString(exc, "status", code);
    PyObject_SetAttrString(exc, "status_name", name);
    PyObject_SetAttrString(exc, "detail", det);
  }
  Py_XDECREF(code);
  Py_XDECREF(name);
  Py_XDECREF(det);
  PyErr_SetObject(ErrorClass[st], exc);
  Py_DECREF(exc);
  return NULL;
}

static PyObject *raise_st(gpuipc_status st, const char *what) {
  return raise_msg(st, what, gpuipc_last_error());
}

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* timeout object: NULL -> dflt, None -> -1 (forever), seconds -> ms. */
static int parse_timeout(PyObject *o, int dflt, int *out) {
  if (o == NULL) { *out = dflt; return 0; }
  if (o == Py_None) { *out = -1; return 0; }
  double s = PyFloat_AsDouble(o);
  if (s == -1.0 && PyErr_Occurred()) return -1;
  if (s < 0) { PyErr_SetString(PyExc_ValueError, "timeout must be >= 0 or None"); return -1; }
  double ms = s * 1000.0;
  if (ms > 2e9) ms = 2e9;
  *out = (int)(ms + 0.999);
  return 0;
}

/* A stream argument: None/0/1 -> legacy default stream (handle 0 here),
 * 2 -> per-thread default, an int -> that CUstream, or an object with
 * .cuda_stream (torch), .ptr (CuPy), __cuda_stream__() (cuda.core) or
 * .handle. */
static int parse_stream(PyObject *o, uintptr_t *out) {
  *out = 0;
  if (o == NULL || o == Py_None) return 0;
  PyObject *v = NULL;
  if (PyLong_Check(o)) {
    v = o;
    Py_INCREF(v);
  } else if (PyObject_HasAttrString(o, "__cuda_stream__")) {
    PyObject *t = PyObject_CallMethod(o, "__cuda_stream__", NULL);
    if (!t) return -1;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 2) {
      Py_DECREF(t);
      PyErr_SetString(PyExc_TypeError, "__cuda_stream__() must return (version, handle)");
      return -1;
    }
    v = PyTuple_GET_ITEM(t, 1);
    Py_INCREF(v);
    Py_DECREF(t);
  } else if (PyObject_HasAttrString(o, "cuda_stream")) {
    v = PyObject_GetAttrString(o, "cuda_stream");
  } else if (PyObject_HasAttrString(o, "ptr")) {
    v = PyObject_GetAttrString(o, "ptr");
  } else if (PyObject_HasAttrString(o, "handle")) {
    v = PyObject_GetAttrString(o, "handle");
  } else {
    PyErr_Format(PyExc_TypeError, "not a stream: %R (give an int CUstream, a "
                 "torch/CuPy/cuda.core stream, or None)", o);
    return -1;
  }
  if (!v) return -1;
  PyObject *iv = PyNumber_Index(v);
  Py_DECREF(v);
  if (!iv) return -1;
  unsigned long long u = PyLong_AsUnsignedLongLong(iv);
  Py_DECREF(iv);
  if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = (u == 1) ? 0 : (uintptr_t)u;
  return 0;
}

static struct CUstream_st *S(uintptr_t s) { return (struct CUstream_st *)s; }

/* The stream a protocol reports for a handle: legacy -> 1. */
static long long stream_report(uintptr_t s) { return s == 0 ? 1 : (long long)s; }

/* Orders stream `to` after the work queued on `from` (device ordinal dev). */
static int order_streams(int dev, uintptr_t from, uintptr_t to) {
  if (from == to) return 0;
  if (dev < 0 || dev >= MAX_DEV) dev = 0;
  gpuipc_status st = GPUIPC_OK;
  LOCK();
  if (!g_sync_event[dev]) {
    gpuipc_uuid u;
    st = gpuipc_device_uuid(dev, &u);
    if (st == GPUIPC_OK) st = gpuipc_event_create(&u, &g_sync_event[dev]);
  }
  if (st == GPUIPC_OK) st = gpuipc_event_record(g_sync_event[dev], S(from));
  if (st == GPUIPC_OK) st = gpuipc_event_wait(g_sync_event[dev], S(to));
  UNLOCK();
  if (st != GPUIPC_OK) { raise_st(st, "ordering streams"); return -1; }
  return 0;
}

static PyObject *uuid_str(const gpuipc_uuid *u) {
  char buf[GPUIPC_UUID_STRLEN];
  gpuipc_uuid_format(u, buf);
  return PyUnicode_FromString(buf);
}

static int parse_uuid(PyObject *o, gpuipc_uuid *u, int *have) {
  *have = 0;
  if (o == NULL || o == Py_None) return 0;
  if (PyLong_Check(o)) {
    int ord = (int)PyLong_AsLong(o);
    if (ord == -1 && PyErr_Occurred()) return -1;
    gpuipc_status st = gpuipc_device_uuid(ord, u);
    if (st) { raise_st(st, "device"); return -1; }
    *have = 1;
    return 0;
  }
  const char *s = PyUnicode_AsUTF8(o);
  if (!s) return -1;
  gpuipc_status st = gpuipc_uuid_parse(s, u);
  if (st) { raise_st(st, "device uuid"); return -1; }
  *have = 1;
  return 0;
}

static int ordinal_of(const gpuipc_uuid *u) {
  int ord = 0;
  if (gpuipc_device_from_uuid(u, &ord) != GPUIPC_OK) return 0;
  return ord;
}

/* Waits for fd to become ready (events), up to timeout_ms (-1 forever),
 * with the GIL released. Returns 1 ready, 0 timed out, -1 with an exception
 * (a signal handler raised). */
static int wait_fd(int fd, short events, int timeout_ms) {
  for (;;) {
    struct pollfd p = {.fd = fd, .events = events};
    int n, err;
    Py_BEGIN_ALLOW_THREADS
    n = poll(&p, 1, timeout_ms);
    err = errno;
    Py_END_ALLOW_THREADS
    if (n > 0) return 1;
    if (n == 0) return 0;
    if (err != EINTR) {
      errno = err;
      PyErr_SetFromErrno(PyExc_OSError);
      return -1;
    }
    if (PyErr_CheckSignals() < 0) return -1;
    return 1; /* retry the operation, which recomputes the remaining time */
  }
}

/* ------------------------------------------------------------------------ */
/* Array metadata                                                           */
/* ------------------------------------------------------------------------ */

#define MAXD 16
typedef struct {
  int ndim;
  DLDataType dtype;
  int64_t shape[MAXD];
  int64_t strides[MAXD]; /* in elements, valid when has_strides */
  int has_strides;
  uint64_t offset; /* bytes from the buffer's start to element 0 */
} ArrMeta;

static void meta_bytes1d(ArrMeta *m, size_t n) {
  memset(m, 0, sizeof *m);
  m->ndim = 1;
  m->dtype = (DLDataType){kDLUInt, 8, 1};
  m->shape[0] = (int64_t)n;
}

static size_t itemsize(const DLDataType *d) { return ((size_t)d->bits * d->lanes + 7) / 8; }

static int meta_contiguous(const ArrMeta *m) {
  if (!m->has_strides) return 1;
  int64_t want = 1;
  for (int i = m->ndim - 1; i >= 0; i--) {
    if (m->shape[i] != 1 && m->strides[i] != want) return 0;
    want *= m->shape[i];
  }
  return 1;
}

/* Bytes spanned from element 0 (strides must be >= 0). */
static size_t meta_extent(const ArrMeta *m) {
  size_t isz = itemsize(&m->dtype);
  for (int i = 0; i < m->ndim; i++)
    if (m->shape[i] == 0) return 0;
  if (!m->has_strides) {
    size_t n = isz;
    for (int i = 0; i < m->ndim; i++) n *= (size_t)m->shape[i];
    return n;
  }
  size_t last = 0;
  for (int i = 0; i < m->ndim; i++) last += (size_t)(m->shape[i] - 1) * (size_t)m->strides[i];
  return (last + 1) * isz;
}

static void meta_fill_strides(const ArrMeta *m, int64_t *out) {
  if (m->has_strides) {
    memcpy(out, m->strides, sizeof(int64_t) * m->ndim);
    return;
  }
  int64_t s = 1;
  for (int i = m->ndim - 1; i >= 0; i--) {
    out[i] = s;
    s *= m->shape[i];
  }
}

/* Wire form in a buffer's meta bytes (little-endian):
 *   0 'G' 'P'  2 version (1)  3 ndim  4 dtype code  5 bits  6..7 lanes
 *   8 flags (1: strides follow)  9..10 user bytes  11 zero
 *   12..19 offset  20.. shape[ndim] (int64), strides[ndim] if flagged, user. */
#define WIRE_HDR 20

static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static int meta_encode(const ArrMeta *m, const uint8_t *user, size_t ulen, uint8_t *out,
                       size_t *len) {
  int strided = !meta_contiguous(m);
  size_t need = WIRE_HDR + 8 * (size_t)m->ndim * (strided ? 2 : 1) + ulen;
  if (need > GPUIPC_META_MAX) {
    PyErr_Format(PyExc_ValueError, "metadata too large: %zu bytes (shape, strides and "
                 "meta together must fit %d)", need, GPUIPC_META_MAX);
    return -1;
  }
  out[0] = 'G'; out[1] = 'P'; out[2] = 1; out[3] = (uint8_t)m->ndim;
  out[4] = m->dtype.code; out[5] = m->dtype.bits;
  out[6] = (uint8_t)m->dtype.lanes; out[7] = (uint8_t)(m->dtype.lanes >> 8);
  out[8] = (uint8_t)strided; out[9] = (uint8_t)ulen; out[10] = (uint8_t)(ulen >> 8); out[11] = 0;
  put64(out + 12, m->offset);
  uint8_t *p = out + WIRE_HDR;
  for (int i = 0; i < m->ndim; i++, p += 8) put64(p, (uint64_t)m->shape[i]);
  if (strided)
    for (int i = 0; i < m->ndim; i++, p += 8) put64(p, (uint64_t)m->strides[i]);
  if (ulen) memcpy(p, user, ulen);
  *len = need;
  return 0;
}

/* Decodes; anything that is not our form is a 1-D uint8 array of `length`
 * bytes with all of meta as the user's bytes. Sets *user and *ulen. */
static void meta_decode(const uint8_t *in, size_t len, size_t length, ArrMeta *m,
                        const uint8_t **user, size_t *ulen) {
  meta_bytes1d(m, length);
  *user = in;
  *ulen = len;
  if (len < WIRE_HDR || in[0] != 'G' || in[1] != 'P' || in[2] != 1) return;
  int nd = in[3], strided = in[8] & 1;
  size_t ul = in[9] | ((size_t)in[10] << 8);
  if (nd > MAXD || WIRE_HDR + 8 * (size_t)nd * (strided ? 2 : 1) + ul != len) return;
  ArrMeta t;
  memset(&t, 0, sizeof t);
  t.ndim = nd;
  t.dtype.code = in[4]; t.dtype.bits = in[5]; t.dtype.lanes = (uint16_t)(in[6] | (in[7] << 8));
  t.offset = get64(in + 12);
  const uint8_t *p = in + WIRE_HDR;
  for (int i = 0; i < nd; i++, p += 8) {
    t.shape[i] = (int64_t)get64(p);
    if (t.shape[i] < 0) return;
  }
  if (strided) {
    t.has_strides = 1;
    for (int i = 0; i < nd; i++, p += 8) {
      t.strides[i] = (int64_t)get64(p);
      if (t.strides[i] < 0) return;
    }
  }
  if (t.dtype.lanes == 0 || t.dtype.bits == 0) return;
  if (t.offset > length || meta_extent(&t) > length - t.offset) return;
  *m = t;
  *user = p;
  *ulen = ul;
}

/* typestr ("<f4") <-> DLPack dtype */
static int typestr_parse(const char *s, DLDataType *d) {
  if (!s[0] || !s[1]) goto bad;
  if (s[0] != '<' && s[0] != '|' && s[0] != '=') goto bad;
  char k = s[1];
  long n = strtol(s + 2, NULL, 10);
  if (n <= 0 || n > 32) goto bad;
  uint8_t code;
  switch (k) {
  case 'i': code = kDLInt; break;
  case 'u': code = kDLUInt; break;
  case 'f': code = kDLFloat; break;
  case 'c': code = kDLComplex; break;
  case 'b': code = kDLBool; break;
  default: goto bad;
  }
  d->code = code;
  d->bits = (uint8_t)(8 * n);
  d->lanes = 1;
  return 0;
bad:
  PyErr_Format(PyExc_TypeError, "unsupported typestr %s", s);
  return -1;
}

static int typestr_make(const DLDataType *d, char *out) {
  char k;
  switch (d->code) {
  case kDLInt: k = 'i'; break;
  case kDLUInt: k = 'u'; break;
  case kDLFloat: k = 'f'; break;
  case kDLComplex: k = 'c'; break;
  case kDLBool: k = 'b'; break;
  default: return -1;
  }
  if (d->lanes != 1 || d->bits % 8) return -1;
  int n = d->bits / 8;
  snprintf(out, 8, "%c%c%d", n == 1 ? '|' : '<', k, n);
  return 0;
}

static const struct { const char *name; DLDataType d; } dtype_names[] = {
    {"bool", {kDLBool, 8, 1}},      {"int8", {kDLInt, 8, 1}},
    {"int16", {kDLInt, 16, 1}},     {"int32", {kDLInt, 32, 1}},
    {"int64", {kDLInt, 64, 1}},     {"uint8", {kDLUInt, 8, 1}},
    {"uint16", {kDLUInt, 16, 1}},   {"uint32", {kDLUInt, 32, 1}},
    {"uint64", {kDLUInt, 64, 1}},   {"float16", {kDLFloat, 16, 1}},
    {"float32", {kDLFloat, 32, 1}}, {"float64", {kDLFloat, 64, 1}},
    {"bfloat16", {kDLBfloat, 16, 1}}, {"complex64", {kDLComplex, 64, 1}},
    {"complex128", {kDLComplex, 128, 1}}, {"half", {kDLFloat, 16, 1}},
    {"float", {kDLFloat, 32, 1}},   {"double", {kDLFloat, 64, 1}},
    {"int", {kDLInt, 32, 1}},       {"long", {kDLInt, 64, 1}},
};

static const char *dtype_name(const DLDataType *d) {
  for (size_t i = 0; i < 15; i++)
    if (dtype_names[i].d.code == d->code && dtype_names[i].d.bits == d->bits &&
        d->lanes == 1)
      return dtype_names[i].name;
  return NULL;
}

/* A dtype: None (uint8), a name ("float32", "torch.float32"), a typestr, or
 * an object with .str (numpy dtype) or whose str() is one of those. */
static int parse_dtype(PyObject *o, DLDataType *d) {
  *d = (DLDataType){kDLUInt, 8, 1};
  if (o == NULL || o == Py_None) return 0;
  PyObject *s;
  if (PyUnicode_Check(o)) {
    s = o;
    Py_INCREF(s);
  } else if (PyObject_HasAttrString(o, "str") && PyObject_HasAttrString(o, "itemsize")) {
    s = PyObject_GetAttrString(o, "str"); /* numpy dtype */
  } else {
    s = PyObject_Str(o);
  }
  if (!s) return -1;
  const char *t = PyUnicode_AsUTF8(s);
  if (!t) { Py_DECREF(s); return -1; }
  if (!strncmp(t, "torch.", 6)) t += 6;
  for (size_t i = 0; i < sizeof dtype_names / sizeof dtype_names[0]; i++)
    if (!strcmp(t, dtype_names[i].name)) {
      *d = dtype_names[i].d;
      Py_DECREF(s);
      return 0;
    }
  int rc = typestr_parse(t, d);
  Py_DECREF(s);
  return rc;
}

/* shape (int or sequence) + dtype -> meta (contiguous) */
static int meta_from_shape(PyObject *shape, PyObject *dtype, size_t *nbytes, ArrMeta *m) {
  memset(m, 0, sizeof *m);
  if (parse_dtype(dtype, &m->dtype) < 0) return -1;
  if (PyLong_Check(shape)) {
    m->ndim = 1;
    m->shape[0] = PyLong_AsLongLong(shape);
  } else {
    PyObject *seq = PySequence_Fast(shape, "shape must be an int or a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAXD) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_ValueError, "at most %d dimensions", MAXD);
      return -1;
    }
    m->ndim = (int)n;
    for (Py_ssize_t i = 0; i < n; i++)
      m->shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
  }
  if (PyErr_Occurred()) return -1;
  for (int i = 0; i < m->ndim; i++)
    if (m->shape[i] < 0) { PyErr_SetString(PyExc_ValueError, "negative dimension"); return -1; }
  *nbytes = meta_extent(m);
  return 0;
}

static PyObject *shape_tuple(const int64_t *v, int n) {
  PyObject *t = PyTuple_New(n);
  if (!t) return NULL;
  for (int i = 0; i < n; i++) {
    PyObject *x = PyLong_FromLongLong(v[i]);
    if (!x) { Py_DECREF(t); return NULL; }
    PyTuple_SET_ITEM(t, i, x);
  }
  return t;
}

/* ------------------------------------------------------------------------ */
/* Exporting views: CUDA Array Interface v3 and DLPack                      */
/* ------------------------------------------------------------------------ */

/* What an exporting object tells the two protocols. */
typedef struct {
  void *base;         /* buffer start; element 0 is base + meta.offset */
  const ArrMeta *meta;
  int dev_type, dev_id;
  uintptr_t stream;   /* the stream its data is ordered on */
  int has_stream;     /* 0: nothing to order (complete data) */
} View;

static PyObject *cai_dict(const View *v) {
  char ts[8];
  if (typestr_make(&v->meta->dtype, ts) < 0) {
    PyErr_SetString(PyExc_AttributeError, "__cuda_array_interface__: this dtype has no "
                    "typestr (use __dlpack__)");
    return NULL;
  }
  PyObject *shape = shape_tuple(v->meta->shape, v->meta->ndim);
  PyObject *strides;
  if (meta_contiguous(v->meta)) {
    strides = Py_None;
    Py_INCREF(strides);
  } else {
    int64_t b[MAXD];
    size_t isz = itemsize(&v->meta->dtype);
    for (int i = 0; i < v->meta->ndim; i++) b[i] = v->meta->strides[i] * (int64_t)isz;
    strides = shape_tuple(b, v->meta->ndim);
  }
  uintptr_t p = (uintptr_t)v->base + v->meta->offset;
  PyObject *stream = v->has_stream ? PyLong_FromLongLong(stream_report(v->stream)) : Py_None;
  if (!v->has_stream) Py_INCREF(Py_None);
  PyObject *d = NULL;
  if (shape && strides && stream)
    d = Py_BuildValue("{s:N,s:s,s:(KO),s:i,s:N,s:N}", "shape", shape, "typestr", ts,
                      "data", (unsigned long long)(size_t)p, Py_False, "version", 3,
                      "strides", strides, "stream", stream);
  else {
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(stream);
  }
  return d;
}

typedef struct {
  union {
    DLManagedTensor m;
    DLManagedTensorVersioned v;
  } u;
  int64_t shape[MAXD];
  int64_t strides[MAXD];
} DLBox;

static void ctx_release(void *ctx) {
  if (!ctx) return;
  if (!Py_IsInitialized()) return;
  PyGILState_STATE g = PyGILState_Ensure();
  g_count.live_capsule_ctx--;
  Py_DECREF((PyObject *)ctx);
  PyGILState_Release(g);
}
static void dl_deleter(DLManagedTensor *self) {
  void *ctx = self->manager_ctx;
  PyMem_RawFree(self);
  ctx_release(ctx);
}
static void dl_deleter_v(DLManagedTensorVersioned *self) {
  void *ctx = self->manager_ctx;
  PyMem_RawFree(self);
  ctx_release(ctx);
}

/* A capsule nobody consumed (still named "dltensor[_versioned]") deletes
 * its tensor; a consumed one ("used_dltensor...") is the consumer's. */
static void capsule_dtor(PyObject *cap) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *saved = PyErr_GetRaisedException();
#else
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
#endif
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m && m->deleter) m->deleter(m);
  } else if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m && m->deleter) m->deleter(m);
  }
  PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(saved);
#else
  PyErr_Restore(t, v, tb);
#endif
}

/* __dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None) */
static PyObject *dlpack_export(PyObject *owner, const View *v, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", "max_version", "dl_device", "copy", NULL};
  PyObject *stream = Py_None, *maxv = Py_None, *dldev = Py_None, *copy = Py_None;
  /* stream may come positionally (older consumers call __dlpack__(s)) */
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$OOO", kwl, &stream, &maxv, &dldev, &copy))
    return NULL;
  if (copy != Py_None && PyObject_IsTrue(copy)) {
    PyErr_SetString(PyExc_BufferError, "__dlpack__: copy=True is not supported (gpuipc "
                    "exports views of shared memory)");
    return NULL;
  }
  int dev_type = v->dev_type;
  if (dldev != Py_None) {
    int dt, di;
    if (!PyArg_ParseTuple(dldev, "ii", &dt, &di)) return NULL;
    if (dev_type == kDLCUDAHost && dt == kDLCPU) {
      dev_type = kDLCPU; /* pinned host memory is host memory */
    } else if (dt != v->dev_type || di != v->dev_id) {
      PyErr_Format(PyExc_BufferError, "__dlpack__: the data lives on device (%d, %d), "
                   "not (%d, %d)", v->dev_type, v->dev_id, dt, di);
      return NULL;
    }
  }
  int versioned = 0;
  if (maxv != Py_None) {
    long major;
    if (!PyTuple_Check(maxv) || PyTuple_GET_SIZE(maxv) < 1) {
      PyErr_SetString(PyExc_TypeError, "max_version must be a (major, minor) tuple");
      return NULL;
    }
    major = PyLong_AsLong(PyTuple_GET_ITEM(maxv, 0));
    if (major == -1 && PyErr_Occurred()) return NULL;
    versioned = major >= 1;
  }
  /* Stream semantics: order the consumer's stream after ours. */
  if (v->dev_type == kDLCUDA && stream != Py_None) {
    long long s = PyLong_AsLongLong(stream);
    if (s == -1 && PyErr_Occurred()) return NULL;
    /* 0 is not a valid CUDA value in the protocol; taken as the legacy
     * default stream, as 1 is. */
    if (s < -1) {
      PyErr_SetString(PyExc_ValueError, "__dlpack__: stream must be -1, 1, 2 or a CUstream");
      return NULL;
    }
    if (s != -1 && v->has_stream &&
        order_streams(v->dev_id, v->stream, (s == 1 || s == 0) ? 0 : (uintptr_t)s) < 0)
      return NULL;
  } else if (v->dev_type == kDLCUDA && v->has_stream) {
    if (order_streams(v->dev_id, v->stream, 0) < 0) return NULL;
  }
  DLBox *b = PyMem_RawCalloc(1, sizeof *b);
  if (!b) return PyErr_NoMemory();
  DLTensor *t = versioned ? &b->u.v.dl_tensor : &b->u.m.dl_tensor;
  t->data = (char *)v->base + v->meta->offset;
  t->device = (DLDevice){dev_type, dev_type == kDLCPU ? 0 : v->dev_id};
  t->ndim = v->meta->ndim;
  t->dtype = v->meta->dtype;
  memcpy(b->shape, v->meta->shape, sizeof(int64_t) * v->meta->ndim);
  meta_fill_strides(v->meta, b->strides);
  t->shape = b->shape;
  t->strides = b->strides;
  t->byte_offset = 0;
  Py_INCREF(owner);
  g_count.live_capsule_ctx++;
  PyObject *cap;
  if (versioned) {
    b->u.v.version = (DLPackVersion){1, 0};
    b->u.v.manager_ctx = owner;
    b->u.v.deleter = dl_deleter_v;
    b->u.v.flags = 0;
    cap = PyCapsule_New(&b->u.v, "dltensor_versioned", capsule_dtor);
  } else {
    b->u.m.manager_ctx = owner;
    b->u.m.deleter = dl_deleter;
    cap = PyCapsule_New(&b->u.m, "dltensor", capsule_dtor);
  }
  if (!cap) {
    g_count.live_capsule_ctx--;
    Py_DECREF(owner);
    PyMem_RawFree(b);
  }
  return cap;
}

static PyObject *dlpack_device(const View *v) { return Py_BuildValue("(ii)", v->dev_type, v->dev_id); }

/* ------------------------------------------------------------------------ */
/* Importing foreign arrays (to send or share them)                         */
/* ------------------------------------------------------------------------ */

typedef struct {
  void *ptr;       /* element 0 */
  size_t nbytes;   /* extent from element 0 */
  ArrMeta meta;    /* offset 0 */
  uintptr_t stream;
  int has_stream;
  PyObject *owner; /* keeps the memory alive: the object or its capsule */
} Foreign;

static int foreign_from_cai(PyObject *obj, PyObject *d, Foreign *f) {
  if (!PyDict_Check(d)) { PyErr_SetString(PyExc_TypeError, "__cuda_array_interface__ is not a dict"); return -1; }
  PyObject *shape = PyDict_GetItemString(d, "shape");
  PyObject *ts = PyDict_GetItemString(d, "typestr");
  PyObject *data = PyDict_GetItemString(d, "data");
  PyObject *strides = PyDict_GetItemString(d, "strides");
  PyObject *mask = PyDict_GetItemString(d, "mask");
  PyObject *stream = PyDict_GetItemString(d, "stream");
  if (!shape || !ts || !data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) < 1) {
    PyErr_SetString(PyExc_TypeError, "__cuda_array_interface__ lacks shape, typestr or data");
    return -1;
  }
  if (mask && mask != Py_None) { PyErr_SetString(PyExc_TypeError, "masked arrays are not supported"); return -1; }
  size_t nb;
  if (meta_from_shape(shape, ts, &nb, &f->meta) < 0) return -1;
  if (strides && strides != Py_None) {
    PyObject *seq = PySequence_Fast(strides, "strides must be a sequence");
    if (!seq) return -1;
    size_t isz = itemsize(&f->meta.dtype);
    if (PySequence_Fast_GET_SIZE(seq) != f->meta.ndim) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "strides and shape differ in length");
      return -1;
    }
    for (int i = 0; i < f->meta.ndim; i++) {
      long long s = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
      if (s < 0 || (size_t)s % isz) {
        Py_DECREF(seq);
        if (!PyErr_Occurred())
          PyErr_SetString(PyExc_ValueError, "negative strides or strides that are not a "
                          "multiple of the item size are not supported");
        return -1;
      }
      f->meta.strides[i] = s / (long long)isz;
    }
    Py_DECREF(seq);
    f->meta.has_strides = 1;
    if (meta_contiguous(&f->meta)) f->meta.has_strides = 0;
  }
  f->ptr = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(data, 0));
  if (PyErr_Occurred()) return -1;
  f->nbytes = meta_extent(&f->meta);
  if (stream && stream != Py_None) {
    if (parse_stream(stream, &f->stream) < 0) return -1;
    f->has_stream = 1;
  }
  f->owner = obj;
  Py_INCREF(obj);
  return 0;
}

static int foreign_from_dlpack(PyObject *obj, uintptr_t stream, Foreign *f) {
  PyObject *cap = NULL;
  PyObject *kw = Py_BuildValue("{s:K,s:(ii)}", "stream",
                               (unsigned long long)stream_report(stream), "max_version", 1, 0);
  PyObject *meth = kw ? PyObject_GetAttrString(obj, "__dlpack__") : NULL;
  if (meth) {
    PyObject *empty = PyTuple_New(0);
    cap = PyObject_Call(meth, empty, kw);
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear(); /* an exporter older than DLPack 1.0 */
      PyDict_DelItemString(kw, "max_version");
      cap = PyObject_Call(meth, empty, kw);
    }
    Py_DECREF(empty);
    Py_DECREF(meth);
  }
  Py_XDECREF(kw);
  if (!cap) return -1;
  DLTensor *t = NULL;
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (m->version.major > 1) {
      Py_DECREF(cap);
      PyErr_SetString(PyExc_BufferError, "DLPack major version above 1");
      return -1;
    }
    t = &m->dl_tensor;
  } else if (PyCapsule_IsValid(cap, "dltensor")) {
    t = &((DLManagedTensor *)PyCapsule_GetPointer(cap, "dltensor"))->dl_tensor;
  } else {
    Py_DECREF(cap);
    PyErr_SetString(PyExc_TypeError, "__dlpack__ returned no DLPack capsule");
    return -1;
  }
  if (t->device.device_type != kDLCUDA || t->ndim > MAXD || t->ndim < 0) {
    int dt = t->device.device_type;
    Py_DECREF(cap);
    PyErr_Format(PyExc_TypeError, "only CUDA device memory can be sent (DLPack device "
                 "type %d)", dt);
    return -1;
  }
  memset(&f->meta, 0, sizeof f->meta);
  f->meta.ndim = t->ndim;
  f->meta.dtype = t->dtype;
  for (int i = 0; i < t->ndim; i++) f->meta.shape[i] = t->shape[i];
  if (t->strides) {
    f->meta.has_strides = 1;
    for (int i = 0; i < t->ndim; i++) {
      if (t->strides[i] < 0) {
        Py_DECREF(cap);
        PyErr_SetString(PyExc_ValueError, "negative strides are not supported");
        return -1;
      }
      f->meta.strides[i] = t->strides[i];
    }
    if (meta_contiguous(&f->meta)) f->meta.has_strides = 0;
  }
  f->ptr = (char *)t->data + t->byte_offset;
  f->nbytes = meta_extent(&f->meta);
  f->has_stream = 0; /* the exporter ordered `stream` after its work */
  f->stream = stream;
  f->owner = cap; /* unconsumed: its destructor calls the deleter */
  return 0;
}

/* Reads an object's array protocol. stream: where the caller will use it
 * (passed to __dlpack__, whose exporter orders it after its work); for CAI
 * the caller orders it after f->stream when has_stream is set, once it
 * knows the device. */
static int foreign_get(PyObject *obj, uintptr_t stream, Foreign *f) {
  memset(f, 0, sizeof *f);
  PyObject *d = PyObject_GetAttrString(obj, "__cuda_array_interface__");
  if (d) {
    int rc = foreign_from_cai(obj, d, f);
    Py_DECREF(d);
    return rc; /* the caller orders `stream` after f->stream (has_stream) */
  }
  /* No CAI, or one that refuses this array (torch: bfloat16): DLPack. */
  int no_cai = PyErr_ExceptionMatches(PyExc_AttributeError);
#if PY_VERSION_HEX >= 0x030C0000
  PyObject *exc = PyErr_GetRaisedException();
#else
  PyObject *et, *ev, *etb;
  PyErr_Fetch(&et, &ev, &etb);
#endif
  int has_dl = PyObject_HasAttrString(obj, "__dlpack__");
  if (has_dl || no_cai) {
#if PY_VERSION_HEX >= 0x030C0000
    Py_XDECREF(exc);
#else
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(etb);
#endif
    if (has_dl) return foreign_from_dlpack(obj, stream, f);
  } else {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(et, ev, etb);
#endif
    return -1;
  }
  PyErr_Format(PyExc_TypeError, "%.100s exposes neither __cuda_array_interface__ nor "
               "__dlpack__", Py_TYPE(obj)->tp_name);
  return -1;
}

/* ------------------------------------------------------------------------ */
/* Wrapped buffers kept until the peer released them                        */
/* ------------------------------------------------------------------------ */

typedef struct {
  gpuipc_buffer *buf;
  PyObject *owner;
  uintptr_t stream;
  int *sent; /* a Buffer object's count of leases out (its buf is not ours) */
} Lease;

typedef struct {
  Lease *v;
  size_t n, cap;
} LeaseList;

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
  Py_XDECREF(x->owner);
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
static void graves_reap(void) {
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
}

/* ------------------------------------------------------------------------ */
/* Connection                                                               */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_conn *c;
  int timeout_ms;      /* default limit of waiting calls (-1 forever) */
  unsigned max_outstanding;
  int borrowed;        /* owned by a Child: never closed here */
  int peer_pid;
  LeaseList leases;    /* wrapped buffers the peer may still hold */
  PyObject *weak;
} ConnObject;

/* GIL held, lock held: the buffers freed above lose their owners. */
static void conn_reap(ConnObject *c, int full) {
  if (c->leases.n == 0) return;
  size_t n = c->leases.n;
  Lease *copy = PyMem_Malloc(n * sizeof *copy);
  if (!copy) return;
  memcpy(copy, c->leases.v, n * sizeof *copy);
  size_t w = 0;
  int stop = 0;
  for (size_t i = 0; i < n; i++) {
    Lease *x = &copy[i];
    if (!stop && gpuipc_conn_get_buffer_holders(c->c, x->buf) == 0) {
      gpuipc_conn_buffer_wait(c->c, x->buf, S(x->stream));
      lease_drop(x);
      continue;
    }
    if (!full) stop = 1;
    c->leases.v[w++] = *x;
  }
  c->leases.n = w;
  PyMem_Free(copy);
}

static void conn_detach(ConnObject *c) {
  /* lock held, GIL held */
  if (c->c && !c->borrowed) gpuipc_conn_close(c->c);
  c->c = NULL;
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

static PyObject *conn_new(gpuipc_conn *gc, int timeout_ms, unsigned maxo, int borrowed) {
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

/* Runs op (under the lock) until it does not say WOULD_BLOCK, waiting on
 * the socket in between; returns its status (E_TIMEOUT when the limit
 * passed; *timed_out then set). */
typedef gpuipc_status (*conn_op)(ConnObject *c, void *ctx);

static int conn_run(ConnObject *c, int timeout_ms, int want_out, conn_op op, void *ctx,
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
    if (!out && (left < 0 || left > 1)) left = 1; /* after a false POLLOUT */
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

typedef struct BlockObject BlockObject;
typedef struct BufferObject BufferObject;

struct BlockObject {
  PyObject_HEAD
  gpuipc_block *b;
  PyObject *arena;
  void *ptr;
  size_t size;
  int device;
  uintptr_t stream;
  ArrMeta meta;
  BlockObject *reg_next, *reg_prev; /* live blocks of this process */
};

static BlockObject *g_blocks; /* registry: which blocks hold an address */

static BlockObject *block_find(void *p, size_t n) {
  for (BlockObject *b = g_blocks; b; b = b->reg_next)
    if (b->b && (char *)p >= (char *)b->ptr && (char *)p + n <= (char *)b->ptr + b->size)
      return b;
  return NULL;
}

struct BufferObject {
  PyObject_HEAD
  gpuipc_buffer *b;
  int sent; /* leases peers hold on it (conn.send), not released yet */
  PyObject *pool;  /* allocated from it */
  PyObject *owner; /* wrapped: the object owning the memory */
  int imported;
  uintptr_t stream;
  int has_stream;
  ArrMeta meta;
};

static View buf_view(BufferObject *b);

typedef struct {
  gpuipc_block *block;
  gpuipc_buffer *buf;
  uintptr_t stream;
  const uint8_t *meta;
  size_t meta_len;
} SendCtx;

static gpuipc_status op_send(ConnObject *c, void *v) {
  SendCtx *x = v;
  if (x->block) return gpuipc_conn_send(c->c, x->block, S(x->stream), x->meta, x->meta_len);
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
  static char *kwl[] = {"obj", "stream", "meta", "timeout", NULL};
  PyObject *obj, *stream_o = Py_None, *meta_o = Py_None, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$OOO", kwl, &obj, &stream_o, &meta_o, &tmo_o))
    return NULL;
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
    if (stream != b->stream && order_streams(b->device, b->stream, stream) < 0) goto out;
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
    if (f.has_stream && f.stream != stream && order_streams(dev, f.stream, stream) < 0)
      goto out;
  }
  x.meta = wire;
  x.meta_len = wlen;
  gpuipc_status st;
  if (conn_run(c, tmo, 1, op_send, &x, &st) < 0) goto out;
  if (st != GPUIPC_OK) { conn_status(st, "send", tmo); goto out; }
  if (wrapped) {
    Lease l = {wrapped, f.owner, stream, NULL};
    if (leases_push(&c->leases, l) < 0) goto out; /* lease kept by gpuipc anyway */
    wrapped = NULL;
    f.owner = NULL;
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
  ArrMeta meta;
  PyObject *user; /* bytes */
} ReceivedObject;

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
  ReceivedObject *r = PyObject_New(ReceivedObject, &ReceivedType);
  if (!r) {
    LOCK();
    if (c->c) gpuipc_conn_release(c->c, x.rx.id, S(x.stream));
    UNLOCK();
    return NULL;
  }
  Py_INCREF(c);
  r->conn = c;
  r->id = x.rx.id;
  r->ptr = x.rx.ptr;
  r->length = x.rx.length;
  r->device = x.rx.device;
  r->stream = x.stream;
  r->held = 1;
  const uint8_t *u;
  size_t ul;
  meta_decode(x.rx.meta, x.rx.meta_len, x.rx.length, &r->meta, &u, &ul);
  r->user = PyBytes_FromStringAndSize((const char *)u, (Py_ssize_t)ul);
  g_count.live_received++;
  if (!r->user) { Py_DECREF(r); return NULL; }
  return (PyObject *)r;
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

static PyObject *Conn_send_msg(ConnObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"data", "fds", "timeout", NULL};
  Py_buffer data;
  PyObject *fds_o = NULL, *tmo_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|O$O", kwl, &data, &fds_o, &tmo_o)) return NULL;
  MsgOut m = {data.buf, (size_t)data.len, {0}, 0};
  int tmo;
  PyObject *ret = NULL;
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
  if (st != GPUIPC_OK) return raise_st(st, "outstanding");
  return Py_BuildValue("(nn)", (Py_ssize_t)a, (Py_ssize_t)b);
}

static PyObject *Conn_close(ConnObject *c, PyObject *unused) {
  if (c->c) {
    gpuipc_conn *gc = c->borrowed ? NULL : c->c;
    /* close may wait for the device (cuCtxSynchronize): no GIL */
    LOCK();
    c->c = NULL;
    conn_detach(c);
    Py_BEGIN_ALLOW_THREADS
    gpuipc_conn_close(gc);
    Py_END_ALLOW_THREADS
    UNLOCK();
  }
  Py_RETURN_NONE;
}

static void Conn_dealloc(ConnObject *c) {
  if (c->weak) PyObject_ClearWeakRefs((PyObject *)c);
  if (c->c) {
    LOCK();
    conn_detach(c);
    UNLOCK();
  }
  PyMem_Free(c->leases.v);
  PyObject_Free(c);
}

static PyObject *Conn_fileno(ConnObject *c, PyObject *unused) {
  if (!conn_ok(c)) return NULL;
  return PyLong_FromLong(gpuipc_conn_get_fd(c->c));
}

static PyObject *Conn_enter(PyObject *s, PyObject *unused) {
  Py_INCREF(s);
  return s;
}
static PyObject *Conn_exit(ConnObject *c, PyObject *args) { return Conn_close(c, NULL); }

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
     "send(obj, *, stream=None, meta=None, timeout=...): hand a buffer to the peer"},
    {"recv", (PyCFunction)(void (*)(void))Conn_recv, METH_VARARGS | METH_KEYWORDS,
     "recv(*, stream=None, timeout=...) -> Received"},
    {"send_msg", (PyCFunction)(void (*)(void))Conn_send_msg, METH_VARARGS | METH_KEYWORDS,
     "send_msg(data, fds=(), *, timeout=...)"},
    {"recv_msg", (PyCFunction)(void (*)(void))Conn_recv_msg, METH_VARARGS | METH_KEYWORDS,
     "recv_msg(*, timeout=..., with_fds=False) -> bytes, or (bytes, [fd]) with with_fds"},
    {"progress", (PyCFunction)(void (*)(void))Conn_progress, METH_VARARGS | METH_KEYWORDS,
     "progress(timeout=0): handle incoming releases and departures"},
    {"outstanding", (PyCFunction)Conn_outstanding, METH_NOARGS,
     "outstanding() -> (held_by_peer, held_here)"},
    {"close", (PyCFunction)Conn_close, METH_NOARGS, "close the connection"},
    {"fileno", (PyCFunction)Conn_fileno, METH_NOARGS, "the socket, for selectors/poll"},
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
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

static PyTypeObject ConnType = {
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
  if (r->conn->c) *st = gpuipc_conn_release(r->conn->c, r->id, S(stream));
  UNLOCK();
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

#define ARRAY_GETTERS(T, M)                                                    \
  static PyObject *T##_shape(PyObject *o, void *u) {                           \
    return shape_tuple((M)->shape, (M)->ndim);                                 \
  }                                                                            \
  static PyObject *T##_strides(PyObject *o, void *u) {                         \
    int64_t s[MAXD];                                                           \
    meta_fill_strides(M, s);                                                   \
    return shape_tuple(s, (M)->ndim);                                          \
  }                                                                            \
  static PyObject *T##_dtype(PyObject *o, void *u) {                           \
    const char *n = dtype_name(&(M)->dtype);                                   \
    if (n) return PyUnicode_FromString(n);                                     \
    return PyUnicode_FromFormat("dlpack(%d,%d,%d)", (M)->dtype.code,           \
                                (M)->dtype.bits, (M)->dtype.lanes);            \
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

static PyMethodDef Rx_methods[] = {
    {"release", (PyCFunction)(void (*)(void))Rx_release, METH_VARARGS | METH_KEYWORDS,
     "release(stream=None): give the buffer back (after the work queued on stream)"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Rx_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)Rx_dlpack_device, METH_NOARGS, NULL},
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
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

static PyTypeObject ReceivedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Received",
    .tp_basicsize = sizeof(ReceivedObject),
    .tp_dealloc = (destructor)Rx_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A buffer received from a peer; released when released explicitly, when "
              "its context ends, or when the last view of it is gone.",
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

/* Common keyword options of listen/connect/from_fd/spawn. */
static int parse_conn_opts(PyObject *kw_t, PyObject *kw_a, PyObject *kw_r, PyObject *kw_u,
                           PyObject *kw_g, unsigned maxo, const char *order, ConnOpts *co,
                           int *tmo) {
  gpuipc_conn_options d = GPUIPC_CONN_OPTIONS_INIT;
  co->o = d;
  co->rdir = NULL;
  if (parse_timeout(kw_t, 10000, tmo) < 0) return -1;
  co->o.timeout_ms = *tmo;
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
  const char *order = NULL;
#define CONN_KW_FMT "OOOOOIz"
#define CONN_KW_ARGS &kt, &ka, &kr, &ku, &kg, &maxo, &order

static PyObject *mod_listen(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"name", "timeout", "abstract", "runtime_dir", "allow_uids",
                        "allow_gids", "max_outstanding", "order", NULL};
  const char *name;
  CONN_KW_DECL
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$" CONN_KW_FMT, kwl, &name, CONN_KW_ARGS))
    return NULL;
  ConnOpts co;
  int tmo;
  if (parse_conn_opts(kt, ka, kr, ku, kg, maxo, order, &co, &tmo) < 0) {
    Py_XDECREF(co.rdir);
    return NULL;
  }
  gpuipc_listener *l = NULL;
  gpuipc_status st;
  co.o.timeout_ms = tmo < 0 ? -1 : tmo; /* bounds each handshake */
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
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Listener_exit, METH_VARARGS, NULL},
    {NULL}};
static PyGetSetDef Listener_getset[] = {{"path", (getter)Listener_path, NULL, NULL, NULL}, {NULL}};

static PyTypeObject ListenerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Listener",
    .tp_basicsize = sizeof(ListenerObject),
    .tp_dealloc = (destructor)Listener_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A named listening socket (gpuipc.listen).",
    .tp_methods = Listener_methods,
    .tp_getset = Listener_getset,
};

static PyObject *mod_connect(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"name", "timeout", "abstract", "runtime_dir", "allow_uids",
                        "allow_gids", "max_outstanding", "order", NULL};
  const char *name;
  CONN_KW_DECL
  if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$" CONN_KW_FMT, kwl, &name, CONN_KW_ARGS))
    return NULL;
  ConnOpts co;
  int tmo;
  if (parse_conn_opts(kt, ka, kr, ku, kg, maxo, order, &co, &tmo) < 0) {
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

static PyObject *mod_from_fd(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"fd", "timeout", "abstract", "runtime_dir", "allow_uids",
                        "allow_gids", "max_outstanding", "order", NULL};
  int fd;
  CONN_KW_DECL
  if (!PyArg_ParseTupleAndKeywords(args, kw, "i|$" CONN_KW_FMT, kwl, &fd, CONN_KW_ARGS))
    return NULL;
  ConnOpts co;
  int tmo;
  if (parse_conn_opts(kt, ka, kr, ku, kg, maxo, order, &co, &tmo) < 0) {
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

static PyObject *mod_conn_pair(PyObject *m, PyObject *u) {
  int fds[2];
  gpuipc_status st = gpuipc_conn_pair(fds);
  if (st) return raise_st(st, "conn_pair");
  return Py_BuildValue("(ii)", fds[0], fds[1]);
}

static PyObject *mod_spawn_connection(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *kt = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O", kwl, &kt)) return NULL;
  int tmo;
  if (parse_timeout(kt, 10000, &tmo) < 0) return NULL;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = tmo;
  gpuipc_conn *c = NULL;
  int np = 0, nb = 0;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_spawn_connection(&o, &c, &np, &nb);
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "spawn_connection");
  PyObject *co = conn_new(c, tmo, o.max_outstanding, 0);
  if (!co) return NULL;
  return Py_BuildValue("(Nii)", co, np, nb);
}

/* ------------------------------------------------------------------------ */
/* Child (gpuipc_spawn)                                                     */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_child *ch;
  ConnObject *conn;
  int pid;
  int ended;
  gpuipc_child_status status;
} ChildObject;

static PyObject *child_status_obj(const gpuipc_child_status *s) {
  char buf[96];
  gpuipc_child_status_str(s, buf, sizeof buf);
  int code = s->state == GPUIPC_CHILD_EXITED ? s->code
             : s->state == GPUIPC_CHILD_SIGNALED ? -s->signal : 0;
  return Py_BuildValue("(is)", code, buf);
}

static char **str_list(PyObject *seq_o, PyObject **keep) {
  *keep = PySequence_Fast(seq_o, "expected a sequence of str");
  if (!*keep) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(*keep);
  char **v = PyMem_Calloc((size_t)n + 1, sizeof *v);
  if (!v) { PyErr_NoMemory(); return NULL; }
  for (Py_ssize_t i = 0; i < n; i++) {
    v[i] = (char *)PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(*keep, i));
    if (!v[i]) { PyMem_Free(v); return NULL; }
  }
  return v;
}

static PyObject *mod_spawn(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"path", "argv", "env_add", "timeout", "search_path", NULL};
  PyObject *path_o, *argv_o, *env_o = Py_None, *kt = NULL;
  int search = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O&O|$OOp", kwl, PyUnicode_FSConverter, &path_o,
                                   &argv_o, &env_o, &kt, &search))
    return NULL;
  PyObject *keep_a = NULL, *keep_e = NULL, *ret = NULL;
  char **argv = NULL, **env = NULL;
  int tmo;
  if (parse_timeout(kt, 30000, &tmo) < 0) goto out;
  if (!(argv = str_list(argv_o, &keep_a))) goto out;
  if (env_o != Py_None && !(env = str_list(env_o, &keep_e))) goto out;
  gpuipc_conn_options co = GPUIPC_CONN_OPTIONS_INIT;
  co.timeout_ms = tmo;
  gpuipc_spawn_options so = GPUIPC_SPAWN_OPTIONS_INIT;
  so.env_add = env;
  so.search_path = search;
  so.conn = &co;
  gpuipc_child *ch = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_spawn(PyBytes_AS_STRING(path_o), argv, &so, &ch);
  Py_END_ALLOW_THREADS
  if (st) { raise_st(st, "spawn"); goto out; }
  ChildObject *c = PyObject_New(ChildObject, &ChildType);
  if (!c) { gpuipc_child_destroy(ch, 0, NULL); goto out; }
  c->ch = ch;
  c->pid = gpuipc_child_get_pid(ch);
  c->ended = 0;
  c->conn = (ConnObject *)conn_new(gpuipc_child_get_conn(ch), tmo, co.max_outstanding, 1);
  if (!c->conn) { c->conn = NULL; Py_DECREF(c); goto out; }
  ret = (PyObject *)c;
out:
  Py_DECREF(path_o);
  Py_XDECREF(keep_a);
  Py_XDECREF(keep_e);
  PyMem_Free(argv);
  PyMem_Free(env);
  return ret;
}

static PyObject *Child_wait(ChildObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *kt = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &kt)) return NULL;
  if (c->ended) return child_status_obj(&c->status);
  if (!c->ch) Py_RETURN_NONE;
  int tmo;
  if (parse_timeout(kt, -1, &tmo) < 0) return NULL;
  int64_t deadline = tmo < 0 ? -1 : now_ms() + tmo;
  for (;;) {
    /* wait in slices so that signals (Ctrl-C) are seen */
    int slice = 100;
    if (deadline >= 0) {
      int64_t l = deadline - now_ms();
      if (l < slice) slice = l < 0 ? 0 : (int)l;
    }
    gpuipc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gpuipc_child_wait(c->ch, slice, &c->status);
    Py_END_ALLOW_THREADS
    if (st == GPUIPC_OK) {
      c->ended = 1;
      return child_status_obj(&c->status);
    }
    if (st != GPUIPC_E_TIMEOUT) return raise_st(st, "wait");
    if (PyErr_CheckSignals() < 0) return NULL;
    if (deadline >= 0 && now_ms() >= deadline) Py_RETURN_NONE;
  }
}

static PyObject *Child_kill(ChildObject *c, PyObject *args) {
  int sig = SIGKILL;
  if (!PyArg_ParseTuple(args, "|i", &sig)) return NULL;
  if (!c->ch) Py_RETURN_NONE;
  gpuipc_status st = gpuipc_child_kill(c->ch, sig);
  if (st) return raise_st(st, "kill");
  Py_RETURN_NONE;
}

static void child_detach_conn(ChildObject *c) {
  if (c->conn) {
    LOCK();
    conn_detach(c->conn); /* borrowed: not closed here */
    UNLOCK();
  }
}

static PyObject *Child_destroy(ChildObject *c, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"timeout", NULL};
  PyObject *kt = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &kt)) return NULL;
  int tmo;
  if (parse_timeout(kt, 5000, &tmo) < 0) return NULL;
  if (!c->ch) {
    if (c->ended) return child_status_obj(&c->status);
    Py_RETURN_NONE;
  }
  child_detach_conn(c);
  gpuipc_child *ch = c->ch;
  c->ch = NULL;
  Py_BEGIN_ALLOW_THREADS
  LOCK();
  gpuipc_child_destroy(ch, tmo, &c->status);
  UNLOCK();
  Py_END_ALLOW_THREADS
  c->ended = 1;
  graves_reap();
  return child_status_obj(&c->status);
}

static void Child_dealloc(ChildObject *c) {
  if (c->ch) {
    child_detach_conn(c);
    LOCK();
    gpuipc_child_destroy(c->ch, 0, NULL);
    UNLOCK();
  }
  Py_XDECREF(c->conn);
  PyObject_Free(c);
}

static PyObject *Child_get(ChildObject *c, void *w) {
  if (w == NULL) return PyLong_FromLong(c->pid);
  if (!c->conn) Py_RETURN_NONE;
  Py_INCREF(c->conn);
  return (PyObject *)c->conn;
}

static PyMethodDef Child_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Child_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(timeout=None) -> (code, text) once ended (code < 0: killed by -code), None "
     "while running"},
    {"kill", (PyCFunction)Child_kill, METH_VARARGS, "kill(sig=SIGKILL)"},
    {"destroy", (PyCFunction)(void (*)(void))Child_destroy, METH_VARARGS | METH_KEYWORDS,
     "destroy(timeout=5): close the connection, wait, then kill; -> (code, text)"},
    {NULL}};
static PyGetSetDef Child_getset[] = {
    {"pid", (getter)Child_get, NULL, NULL, NULL},
    {"conn", (getter)Child_get, NULL, "the connection to the child", (void *)1},
    {NULL}};
static PyTypeObject ChildType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Child",
    .tp_basicsize = sizeof(ChildObject),
    .tp_dealloc = (destructor)Child_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A child process started by gpuipc's spawn helper, with its connection.",
    .tp_methods = Child_methods,
    .tp_getset = Child_getset,
};

/* ------------------------------------------------------------------------ */
/* Arena and Block                                                          */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_arena *a;
  int device;
} ArenaObject;

/* Arenas whose Python object died while peers held blocks. */
typedef struct DeadArena { struct DeadArena *next; gpuipc_arena *a; } DeadArena;
static DeadArena *g_dead_arenas;

static void dead_arenas_retry_locked(void) {
  DeadArena **pp = &g_dead_arenas;
  while (*pp) {
    if (gpuipc_arena_destroy((*pp)->a) == GPUIPC_OK) {
      DeadArena *d = *pp;
      *pp = d->next;
      PyMem_RawFree(d);
    } else {
      pp = &(*pp)->next;
    }
  }
}

static PyObject *Arena_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"device", "chunk_bytes", "max_bytes", NULL};
  int device = 0;
  Py_ssize_t chunk = (Py_ssize_t)64 << 20, maxb = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|inn", kwl, &device, &chunk, &maxb)) return NULL;
  gpuipc_arena_options o = GPUIPC_ARENA_OPTIONS_INIT;
  o.chunk_bytes = (size_t)chunk;
  o.max_bytes = (size_t)maxb;
  if (device != 0) {
    PyErr_SetString(PyExc_ValueError, "Arena: only device 0 in this version (use "
                    "CUDA_VISIBLE_DEVICES to pick the GPU)");
    return NULL;
  }
  gpuipc_arena *a = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  LOCK();
  st = gpuipc_arena_create(&o, &a);
  UNLOCK();
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "Arena");
  ArenaObject *ao = (ArenaObject *)t->tp_alloc(t, 0);
  if (!ao) { gpuipc_arena_destroy(a); return NULL; }
  ao->a = a;
  ao->device = device;
  return (PyObject *)ao;
}

static PyObject *Arena_close(ArenaObject *a, PyObject *u) {
  if (!a->a) Py_RETURN_NONE;
  LOCK();
  gpuipc_status st = gpuipc_arena_destroy(a->a);
  UNLOCK();
  if (st) return raise_st(st, "Arena.close");
  a->a = NULL;
  Py_RETURN_NONE;
}

static void Arena_dealloc(ArenaObject *a) {
  if (a->a) {
    LOCK();
    if (gpuipc_arena_destroy(a->a) != GPUIPC_OK) {
      DeadArena *d = PyMem_RawMalloc(sizeof *d);
      if (d) {
        d->a = a->a;
        d->next = g_dead_arenas;
        g_dead_arenas = d;
      }
    }
    UNLOCK();
  }
  Py_TYPE(a)->tp_free(a);
}

static PyObject *Arena_alloc(ArenaObject *a, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"nbytes", "stream", "shape", "dtype", NULL};
  PyObject *nb_o = Py_None, *stream_o = Py_None, *shape = Py_None, *dtype = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$OOO", kwl, &nb_o, &stream_o, &shape, &dtype))
    return NULL;
  if (!a->a) return raise_msg(GPUIPC_E_CLOSED, "alloc", "arena closed");
  uintptr_t stream;
  if (parse_stream(stream_o, &stream) < 0) return NULL;
  ArrMeta m;
  size_t nbytes;
  if (shape != Py_None) {
    if (meta_from_shape(shape, dtype, &nbytes, &m) < 0) return NULL;
    if (nb_o != Py_None) {
      size_t want = PyLong_AsSize_t(nb_o);
      if (PyErr_Occurred()) return NULL;
      if (want < nbytes) { PyErr_SetString(PyExc_ValueError, "nbytes smaller than shape"); return NULL; }
      nbytes = want;
    }
  } else {
    if (nb_o == Py_None) { PyErr_SetString(PyExc_TypeError, "alloc: give nbytes or shape"); return NULL; }
    nbytes = PyLong_AsSize_t(nb_o);
    if (PyErr_Occurred()) return NULL;
    if (dtype != Py_None) {
      DLDataType d;
      if (parse_dtype(dtype, &d) < 0) return NULL;
      meta_bytes1d(&m, nbytes / itemsize(&d));
      m.dtype = d;
    } else {
      meta_bytes1d(&m, nbytes);
    }
  }
  gpuipc_block *b = NULL;
  gpuipc_status st;
  LOCK();
  dead_arenas_retry_locked();
  st = gpuipc_arena_alloc(a->a, nbytes ? nbytes : 1, S(stream), &b);
  UNLOCK();
  if (st) return raise_st(st, "alloc");
  BlockObject *bo = PyObject_New(BlockObject, &BlockType);
  if (!bo) {
    LOCK();
    gpuipc_block_free(b, S(stream));
    UNLOCK();
    return NULL;
  }
  bo->b = b;
  Py_INCREF(a);
  bo->arena = (PyObject *)a;
  bo->ptr = gpuipc_block_get_ptr(b);
  bo->size = gpuipc_block_get_size(b);
  bo->device = a->device;
  bo->stream = stream;
  bo->meta = m;
  bo->reg_prev = NULL;
  bo->reg_next = g_blocks;
  if (g_blocks) g_blocks->reg_prev = bo;
  g_blocks = bo;
  g_count.live_blocks++;
  return (PyObject *)bo;
}

static PyObject *Arena_stats(ArenaObject *a, PyObject *u) {
  if (!a->a) return raise_msg(GPUIPC_E_CLOSED, "stats", "arena closed");
  gpuipc_arena_stats s = GPUIPC_ARENA_STATS_INIT;
  LOCK();
  gpuipc_status st = gpuipc_arena_get_stats(a->a, &s);
  UNLOCK();
  if (st) return raise_st(st, "stats");
  return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n}", "chunks", (Py_ssize_t)s.chunks,
                       "bytes_total", (Py_ssize_t)s.bytes_total, "bytes_allocated",
                       (Py_ssize_t)s.bytes_allocated, "blocks_allocated",
                       (Py_ssize_t)s.blocks_allocated, "blocks_deferred",
                       (Py_ssize_t)s.blocks_deferred, "leases", (Py_ssize_t)s.leases);
}

static PyObject *Arena_exit(ArenaObject *a, PyObject *args) { return Arena_close(a, NULL); }

static PyMethodDef Arena_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))Arena_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc(nbytes=None, *, stream=None, shape=None, dtype=None) -> Block"},
    {"stats", (PyCFunction)Arena_stats, METH_NOARGS, "counters as a dict"},
    {"close", (PyCFunction)Arena_close, METH_NOARGS,
     "destroy the arena (BusyError while blocks are allocated or held)"},
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Arena_exit, METH_VARARGS, NULL},
    {NULL}};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Arena",
    .tp_basicsize = sizeof(ArenaObject),
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Arena(device=0, chunk_bytes=64 MiB, max_bytes=0): IPC-capable device "
              "memory whose blocks go by the fast path.",
    .tp_methods = Arena_methods,
    .tp_new = Arena_new,
};

static void block_unregister(BlockObject *b) {
  if (b->reg_prev) b->reg_prev->reg_next = b->reg_next;
  else if (g_blocks == b) g_blocks = b->reg_next;
  if (b->reg_next) b->reg_next->reg_prev = b->reg_prev;
  b->reg_next = b->reg_prev = NULL;
}

static PyObject *Block_free(BlockObject *b, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", NULL};
  PyObject *so = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &so)) return NULL;
  uintptr_t s = b->stream;
  if (so && parse_stream(so, &s) < 0) return NULL;
  if (b->b) {
    LOCK();
    gpuipc_status st = gpuipc_block_free(b->b, S(s));
    UNLOCK();
    b->b = NULL;
    block_unregister(b);
    g_count.live_blocks--;
    if (st) return raise_st(st, "free");
  }
  Py_RETURN_NONE;
}

static void Block_dealloc(BlockObject *b) {
  if (b->b) {
    LOCK();
    gpuipc_block_free(b->b, S(b->stream));
    UNLOCK();
    block_unregister(b);
    g_count.live_blocks--;
  }
  Py_DECREF(b->arena);
  PyObject_Free(b);
}

static int block_alive(BlockObject *b) {
  if (!b->b) {
    PyErr_SetString(PyExc_ValueError, "block was freed");
    return 0;
  }
  return 1;
}
static View block_view(BlockObject *b) {
  return (View){b->ptr, &b->meta, kDLCUDA, b->device, b->stream, 1};
}
static PyObject *Block_cai(BlockObject *b, void *u) {
  if (!block_alive(b)) return NULL;
  View v = block_view(b);
  return cai_dict(&v);
}
static PyObject *Block_dlpack(BlockObject *b, PyObject *a, PyObject *k) {
  if (!block_alive(b)) return NULL;
  View v = block_view(b);
  return dlpack_export((PyObject *)b, &v, a, k);
}
static PyObject *Block_dlpack_device(BlockObject *b, PyObject *u) {
  View v = block_view(b);
  return dlpack_device(&v);
}
static PyObject *Block_wait(BlockObject *b, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"stream", NULL};
  PyObject *so = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &so)) return NULL;
  uintptr_t s = b->stream;
  if (so && parse_stream(so, &s) < 0) return NULL;
  if (!block_alive(b)) return NULL;
  LOCK();
  gpuipc_status st = gpuipc_block_wait(b->b, S(s));
  UNLOCK();
  if (st) return raise_st(st, "wait");
  Py_RETURN_NONE;
}
static PyObject *Block_exit(BlockObject *b, PyObject *a) {
  PyObject *empty = PyTuple_New(0);
  if (!empty) return NULL;
  PyObject *r = Block_free(b, empty, NULL);
  Py_DECREF(empty);
  return r;
}
ARRAY_GETTERS(Block, &((BlockObject *)o)->meta)

static PyObject *Block_get(BlockObject *b, void *w) {
  switch ((intptr_t)w) {
  case 0: return PyLong_FromUnsignedLongLong((uintptr_t)b->ptr);
  case 1: return PyLong_FromSize_t(b->size);
  case 2: {
    if (!block_alive(b)) return NULL;
    LOCK();
    unsigned h = gpuipc_block_get_holders(b->b);
    UNLOCK();
    return PyLong_FromUnsignedLong(h);
  }
  case 3: return PyLong_FromLong(b->device);
  case 4: Py_INCREF(b->arena); return b->arena;
  case 5: return PyLong_FromLongLong(stream_report(b->stream));
  }
  Py_RETURN_NONE;
}

static PyMethodDef Block_methods[] = {
    {"free", (PyCFunction)(void (*)(void))Block_free, METH_VARARGS | METH_KEYWORDS,
     "free(stream=None): give the block back (deferred while peers hold it)"},
    {"wait", (PyCFunction)(void (*)(void))Block_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(stream=None): order stream after the peers' work before their releases"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Block_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)Block_dlpack_device, METH_NOARGS, NULL},
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Block_exit, METH_VARARGS, NULL},
    {NULL}};
static PyGetSetDef Block_getset[] = {
    {"ptr", (getter)Block_get, NULL, NULL, (void *)0},
    {"nbytes", (getter)Block_get, NULL, "bytes of the block", (void *)1},
    {"holders", (getter)Block_get, NULL, "peers holding it now", (void *)2},
    {"device", (getter)Block_get, NULL, NULL, (void *)3},
    {"arena", (getter)Block_get, NULL, NULL, (void *)4},
    {"stream", (getter)Block_get, NULL, NULL, (void *)5},
    {"shape", (getter)Block_shape, NULL, NULL, NULL},
    {"strides", (getter)Block_strides, NULL, NULL, NULL},
    {"dtype", (getter)Block_dtype, NULL, NULL, NULL},
    {"__cuda_array_interface__", (getter)Block_cai, NULL, NULL, NULL},
    {NULL}};
static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block of an Arena (Arena.alloc); freed with free(), its context, or "
              "when the last view of it is gone.",
    .tp_methods = Block_methods,
    .tp_getset = Block_getset,
};

/* ------------------------------------------------------------------------ */
/* Pool and Buffer                                                          */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_pool *p;
  int imported;
} PoolObject;

static int parse_kind(PyObject *o, gpuipc_pool_kind *k) {
  *k = GPUIPC_POOL_AUTO;
  if (!o || o == Py_None) return 0;
  if (PyLong_Check(o)) { *k = (gpuipc_pool_kind)PyLong_AsLong(o); return PyErr_Occurred() ? -1 : 0; }
  const char *s = PyUnicode_AsUTF8(o);
  if (!s) return -1;
  for (int i = 0; i <= GPUIPC_POOL_PINNED_HOST; i++)
    if (!strcmp(s, gpuipc_pool_kind_name((gpuipc_pool_kind)i)) ||
        (i == GPUIPC_POOL_PINNED_HOST && !strcmp(s, "pinned_host"))) {
      *k = (gpuipc_pool_kind)i;
      return 0;
    }
  PyErr_Format(PyExc_ValueError, "unknown pool kind '%s' (auto, mempool, vmm, legacy, "
               "pinned-host)", s);
  return -1;
}

static PyObject *Pool_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"kind", "device", "capacity", NULL};
  PyObject *kind_o = Py_None, *dev_o = Py_None;
  Py_ssize_t cap = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|OOn", kwl, &kind_o, &dev_o, &cap)) return NULL;
  gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
  if (parse_kind(kind_o, &o.kind) < 0) return NULL;
  gpuipc_uuid u;
  if (dev_o != Py_None) {
    if (PyLong_Check(dev_o)) {
      o.device = (int)PyLong_AsLong(dev_o);
    } else {
      int have;
      if (parse_uuid(dev_o, &u, &have) < 0) return NULL;
      o.device_uuid = &u;
    }
  }
  o.capacity = (size_t)cap;
  gpuipc_pool *p = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_pool_create(&o, &p);
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "Pool");
  PoolObject *po = (PoolObject *)t->tp_alloc(t, 0);
  if (!po) { gpuipc_pool_destroy(p); return NULL; }
  po->p = p;
  po->imported = 0;
  return (PyObject *)po;
}

static void Pool_dealloc(PoolObject *p) {
  gpuipc_pool_destroy(p->p);
  Py_TYPE(p)->tp_free(p);
}

static PyObject *buffer_new(gpuipc_buffer *b, PyObject *pool, PyObject *owner, int imported,
                            uintptr_t stream, int has_stream, const ArrMeta *m) {
  BufferObject *o = PyObject_New(BufferObject, &BufferType);
  if (!o) { gpuipc_buffer_free(b, NULL); return NULL; }
  o->b = b;
  o->sent = 0;
  Py_XINCREF(pool);
  o->pool = pool;
  Py_XINCREF(owner);
  o->owner = owner;
  o->imported = imported;
  o->stream = stream;
  o->has_stream = has_stream;
  if (m) o->meta = *m;
  else meta_bytes1d(&o->meta, gpuipc_buffer_get_size(b));
  g_count.live_buffers++;
  return (PyObject *)o;
}

static PyObject *Pool_alloc(PoolObject *p, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"nbytes", "stream", "shape", "dtype", NULL};
  PyObject *nb_o = Py_None, *stream_o = Py_None, *shape = Py_None, *dtype = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$OOO", kwl, &nb_o, &stream_o, &shape, &dtype))
    return NULL;
  uintptr_t stream;
  if (parse_stream(stream_o, &stream) < 0) return NULL;
  ArrMeta m;
  size_t nbytes;
  if (shape != Py_None) {
    if (meta_from_shape(shape, dtype, &nbytes, &m) < 0) return NULL;
  } else {
    if (nb_o == Py_None) { PyErr_SetString(PyExc_TypeError, "alloc: give nbytes or shape"); return NULL; }
    nbytes = PyLong_AsSize_t(nb_o);
    if (PyErr_Occurred()) return NULL;
    meta_bytes1d(&m, nbytes);
  }
  gpuipc_buffer *b = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_buffer_alloc(p->p, nbytes, S(stream), &b);
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "alloc");
  return buffer_new(b, (PyObject *)p, NULL, 0, stream, 1, &m);
}

static PyObject *Pool_export(PoolObject *p, PyObject *u) {
  uint8_t d[1024];
  size_t len = 0;
  int fd = -1;
  gpuipc_status st = gpuipc_pool_export(p->p, d, sizeof d, &len, &fd);
  if (st) return raise_st(st, "Pool.export");
  return Py_BuildValue("(y#i)", (const char *)d, (Py_ssize_t)len, fd);
}

static PyObject *Pool_open(PyTypeObject *t, PyObject *args) {
  Py_buffer d;
  int fd = -1;
  if (!PyArg_ParseTuple(args, "y*|i", &d, &fd)) return NULL;
  gpuipc_pool *p = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_pool_import(d.buf, (size_t)d.len, fd, NULL, &p);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&d);
  if (st) return raise_st(st, "Pool.open");
  PoolObject *po = (PoolObject *)PoolType.tp_alloc(&PoolType, 0);
  if (!po) { gpuipc_pool_destroy(p); return NULL; }
  po->p = p;
  po->imported = 1;
  return (PyObject *)po;
}

static PyObject *Pool_get(PoolObject *p, void *w) {
  if ((intptr_t)w == 0) return PyUnicode_FromString(gpuipc_pool_kind_name(gpuipc_pool_get_kind(p->p)));
  gpuipc_uuid u;
  gpuipc_status st = gpuipc_pool_get_device(p->p, &u);
  if (st) return raise_st(st, "device");
  return uuid_str(&u);
}

static PyMethodDef Pool_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))Pool_alloc, METH_VARARGS | METH_KEYWORDS,
     "alloc(nbytes=None, *, stream=None, shape=None, dtype=None) -> Buffer"},
    {"export", (PyCFunction)Pool_export, METH_NOARGS, "export() -> (desc bytes, fd) (MEMPOOL)"},
    {"open", (PyCFunction)Pool_open, METH_VARARGS | METH_CLASS, "Pool.open(desc, fd) -> Pool"},
    {NULL}};
static PyGetSetDef Pool_getset[] = {
    {"kind", (getter)Pool_get, NULL, NULL, (void *)0},
    {"device", (getter)Pool_get, NULL, "device UUID", (void *)1},
    {NULL}};
static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(kind='auto', device=None, capacity=0): buffers shared by descriptor.",
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
    .tp_new = Pool_new,
};

static int buf_alive(BufferObject *b) {
  if (!b->b) { PyErr_SetString(PyExc_ValueError, "buffer was freed"); return 0; }
  return 1;
}

static View buf_view(BufferObject *b) {
  View v = {gpuipc_buffer_get_ptr(b->b), &b->meta, kDLCUDA, 0, b->stream, b->has_stream};
  if (gpuipc_buffer_get_kind(b->b) == GPUIPC_POOL_PINNED_HOST) {
    v.dev_type = kDLCUDAHost;
    v.dev_id = 0;
    v.has_stream = 0;
  } else {
    gpuipc_uuid u;
    if (gpuipc_buffer_get_mapped_device(b->b, &u) == GPUIPC_OK) v.dev_id = ordinal_of(&u);
  }
  return v;
}

static PyObject *Buffer_close(BufferObject *b, PyObject *u) {
  if (b->b && b->sent > 0)
    return raise_msg(GPUIPC_E_BUSY, "close", "a peer still holds this buffer (sent with "
                     "conn.send and not released)");
  if (b->b) {
    gpuipc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gpuipc_buffer_free(b->b, S(b->stream));
    Py_END_ALLOW_THREADS
    b->b = NULL;
    g_count.live_buffers--;
    Py_CLEAR(b->owner);
    if (st) return raise_st(st, "close");
  }
  Py_RETURN_NONE;
}

static void Buffer_dealloc(BufferObject *b) {
  if (b->b) {
    gpuipc_buffer_free(b->b, S(b->stream));
    g_count.live_buffers--;
  }
  Py_XDECREF(b->pool);
  Py_XDECREF(b->owner);
  PyObject_Free(b);
}

static PyObject *Buffer_export(BufferObject *b, PyObject *u) {
  if (!buf_alive(b)) return NULL;
  uint8_t d[1024];
  size_t len = 0;
  int fds[8];
  int nfds = 8;
  gpuipc_status st = gpuipc_buffer_export(b->b, d, sizeof d, &len, fds, &nfds);
  if (st) return raise_st(st, "export");
  PyObject *l = PyList_New(nfds);
  for (int i = 0; l && i < nfds; i++) PyList_SET_ITEM(l, i, PyLong_FromLong(fds[i]));
  if (!l) {
    for (int i = 0; i < nfds; i++) close(fds[i]);
    return NULL;
  }
  return Py_BuildValue("(y#N)", (const char *)d, (Py_ssize_t)len, l);
}

static PyObject *Buffer_wrap(PyTypeObject *t, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"obj", "nbytes", NULL};
  PyObject *obj;
  PyObject *nb_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", kwl, &obj, &nb_o)) return NULL;
  gpuipc_buffer *b = NULL;
  gpuipc_status st;
  if (PyLong_Check(obj)) {
    size_t n = PyLong_AsSize_t(nb_o);
    if (PyErr_Occurred()) return NULL;
    void *p = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(obj);
    if (PyErr_Occurred()) return NULL;
    st = gpuipc_buffer_wrap(p, n, &b);
    if (st) return raise_st(st, "wrap");
    return buffer_new(b, NULL, NULL, 0, 0, 0, NULL);
  }
  Foreign f;
  if (foreign_get(obj, 0, &f) < 0) return NULL;
  st = gpuipc_buffer_wrap(f.ptr, f.nbytes, &b);
  if (st) { Py_XDECREF(f.owner); return raise_st(st, "wrap"); }
  PyObject *r = buffer_new(b, NULL, f.owner, 0, 0, 0, &f.meta);
  Py_XDECREF(f.owner);
  return r;
}

static PyObject *Buffer_cai(BufferObject *b, void *u) {
  if (!buf_alive(b)) return NULL;
  View v = buf_view(b);
  return cai_dict(&v);
}
static PyObject *Buffer_dlpack(BufferObject *b, PyObject *a, PyObject *k) {
  if (!buf_alive(b)) return NULL;
  View v = buf_view(b);
  return dlpack_export((PyObject *)b, &v, a, k);
}
static PyObject *Buffer_dlpack_device(BufferObject *b, PyObject *u) {
  if (!buf_alive(b)) return NULL;
  View v = buf_view(b);
  return dlpack_device(&v);
}
static PyObject *Buffer_exit(BufferObject *b, PyObject *a) { return Buffer_close(b, NULL); }
ARRAY_GETTERS(Buffer, &((BufferObject *)o)->meta)

static PyObject *Buffer_get(BufferObject *b, void *w) {
  if (!buf_alive(b)) return NULL;
  switch ((intptr_t)w) {
  case 0: return PyLong_FromUnsignedLongLong((uintptr_t)gpuipc_buffer_get_ptr(b->b) + b->meta.offset);
  case 1: return PyLong_FromSize_t(gpuipc_buffer_get_size(b->b));
  case 2: return PyUnicode_FromString(gpuipc_pool_kind_name(gpuipc_buffer_get_kind(b->b)));
  case 3: return PyBool_FromLong(gpuipc_buffer_is_imported(b->b));
  case 4: {
    gpuipc_uuid u;
    gpuipc_status st = gpuipc_buffer_get_device(b->b, &u);
    if (st) return raise_st(st, "device");
    return uuid_str(&u);
  }
  }
  Py_RETURN_NONE;
}

static PyMethodDef Buffer_methods[] = {
    {"export", (PyCFunction)Buffer_export, METH_NOARGS,
     "export() -> (desc bytes, [fd]): the fds are the caller's to close"},
    {"close", (PyCFunction)Buffer_close, METH_NOARGS, "free / close the buffer"},
    {"free", (PyCFunction)Buffer_close, METH_NOARGS, "free / close the buffer"},
    {"wrap", (PyCFunction)(void (*)(void))Buffer_wrap, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Buffer.wrap(obj) or Buffer.wrap(ptr, nbytes): memory gpuipc did not allocate"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Buffer_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)Buffer_dlpack_device, METH_NOARGS, NULL},
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Buffer_exit, METH_VARARGS, NULL},
    {NULL}};
static PyGetSetDef Buffer_getset[] = {
    {"ptr", (getter)Buffer_get, NULL, "address of element 0", (void *)0},
    {"size", (getter)Buffer_get, NULL, "bytes of the buffer", (void *)1},
    {"kind", (getter)Buffer_get, NULL, NULL, (void *)2},
    {"imported", (getter)Buffer_get, NULL, NULL, (void *)3},
    {"device", (getter)Buffer_get, NULL, "device UUID", (void *)4},
    {"shape", (getter)Buffer_shape, NULL, NULL, NULL},
    {"strides", (getter)Buffer_strides, NULL, NULL, NULL},
    {"dtype", (getter)Buffer_dtype, NULL, NULL, NULL},
    {"__cuda_array_interface__", (getter)Buffer_cai, NULL, NULL, NULL},
    {NULL}};
static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A gpuipc buffer: allocated from a Pool, wrapped, or opened from a "
              "descriptor (gpuipc.open).",
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
};

/* ------------------------------------------------------------------------ */
/* share / open                                                             */
/* ------------------------------------------------------------------------ */

/* A shared descriptor: "GPYS" 1 <meta len u8> <meta> <gpuipc descriptor>. */
typedef struct {
  PyObject_HEAD
  PyObject *desc;   /* bytes */
  PyObject *fds;    /* tuple of ints, ours to close */
  PyObject *buffer; /* the Buffer exported */
} SharedObject;

static PyObject *Shared_close(SharedObject *s, PyObject *u) {
  if (s->fds) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(s->fds); i++)
      close((int)PyLong_AsLong(PyTuple_GET_ITEM(s->fds, i)));
    Py_CLEAR(s->fds);
    s->fds = PyTuple_New(0);
  }
  Py_CLEAR(s->buffer);
  Py_RETURN_NONE;
}
static void Shared_dealloc(SharedObject *s) {
  PyObject *r = Shared_close(s, NULL);
  Py_XDECREF(r);
  Py_XDECREF(s->fds);
  Py_XDECREF(s->desc);
  PyObject_Free(s);
}
static PyObject *Shared_exit(SharedObject *s, PyObject *a) { return Shared_close(s, NULL); }
static PyMemberDef Shared_members[] = {
    {"desc", T_OBJECT, offsetof(SharedObject, desc), READONLY, "the descriptor bytes"},
    {"fds", T_OBJECT, offsetof(SharedObject, fds), READONLY,
     "file descriptors to pass beside it (closed by close())"},
    {"buffer", T_OBJECT, offsetof(SharedObject, buffer), READONLY, NULL},
    {NULL}};
static PyMethodDef Shared_methods[] = {
    {"close", (PyCFunction)Shared_close, METH_NOARGS,
     "close the fds and drop the exported buffer (peers that opened it must be done)"},
    {"__enter__", Conn_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Shared_exit, METH_VARARGS, NULL},
    {NULL}};
static PyTypeObject SharedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Shared",
    .tp_basicsize = sizeof(SharedObject),
    .tp_dealloc = (destructor)Shared_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What gpuipc.share() gives: desc (bytes) and fds to carry over any channel; "
              "keep it while peers use the memory.",
    .tp_methods = Shared_methods,
    .tp_members = Shared_members,
};

static PyObject *mod_share(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"obj", NULL};
  PyObject *obj;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O", kwl, &obj)) return NULL;
  PyObject *bufo;
  if (Py_TYPE(obj) == &BlockType) {
    return raise_msg(GPUIPC_E_NOT_SUPPORTED, "share",
                     "arena blocks travel over connections: use conn.send(block)");
  } else if (Py_TYPE(obj) == &BufferType) {
    bufo = obj;
    Py_INCREF(bufo);
  } else {
    PyObject *a = PyTuple_Pack(1, obj);
    if (!a) return NULL;
    bufo = Buffer_wrap(&BufferType, a, NULL);
    Py_DECREF(a);
    if (!bufo) return NULL;
  }
  BufferObject *b = (BufferObject *)bufo;
  if (!buf_alive(b)) { Py_DECREF(bufo); return NULL; }
  uint8_t meta[GPUIPC_META_MAX];
  size_t mlen;
  if (meta_encode(&b->meta, NULL, 0, meta, &mlen) < 0) { Py_DECREF(bufo); return NULL; }
  uint8_t d[6 + GPUIPC_META_MAX + 1024];
  memcpy(d, "GPYS", 4);
  d[4] = 1;
  d[5] = (uint8_t)mlen;
  memcpy(d + 6, meta, mlen);
  size_t len = 0;
  int fds[8], nfds = 8;
  gpuipc_status st = gpuipc_buffer_export(b->b, d + 6 + mlen, 1024, &len, fds, &nfds);
  if (st) { Py_DECREF(bufo); return raise_st(st, "share"); }
  SharedObject *s = PyObject_New(SharedObject, &SharedType);
  if (!s) {
    for (int i = 0; i < nfds; i++) close(fds[i]);
    Py_DECREF(bufo);
    return NULL;
  }
  s->desc = PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)(6 + mlen + len));
  s->fds = PyTuple_New(nfds);
  for (int i = 0; s->fds && i < nfds; i++) PyTuple_SET_ITEM(s->fds, i, PyLong_FromLong(fds[i]));
  s->buffer = bufo;
  if (!s->desc || !s->fds) { Py_DECREF(s); return NULL; }
  return (PyObject *)s;
}

static PyObject *mod_open(PyObject *m, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"desc", "fds", "device", "pidfd_getfd", NULL};
  Py_buffer d;
  PyObject *fds_o = Py_None, *dev_o = Py_None;
  int pidfd = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|O$Op", kwl, &d, &fds_o, &dev_o, &pidfd))
    return NULL;
  PyObject *ret = NULL;
  int fds[16], nfds = 0;
  gpuipc_import_options io = GPUIPC_IMPORT_OPTIONS_INIT;
  gpuipc_uuid u;
  int have = 0;
  if (parse_uuid(dev_o, &u, &have) < 0) goto out;
  if (have) io.device = &u;
  if (pidfd) io.flags |= GPUIPC_IMPORT_PIDFD_GETFD;
  if (fds_o != Py_None) {
    PyObject *seq = PySequence_Fast(fds_o, "fds must be a sequence of ints");
    if (!seq) goto out;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 16) { Py_DECREF(seq); PyErr_SetString(PyExc_ValueError, "too many fds"); goto out; }
    for (Py_ssize_t i = 0; i < n; i++) {
      fds[nfds] = PyObject_AsFileDescriptor(PySequence_Fast_GET_ITEM(seq, i));
      if (fds[nfds] < 0) { Py_DECREF(seq); goto out; }
      nfds++;
    }
    Py_DECREF(seq);
  }
  const uint8_t *p = d.buf;
  size_t len = (size_t)d.len;
  ArrMeta meta;
  int have_meta = 0;
  if (len >= 6 && !memcmp(p, "GPYS", 4)) {
    if (p[4] != 1) { raise_msg(GPUIPC_E_BAD_VERSION, "open", "shared descriptor version"); goto out; }
    size_t ml = p[5];
    if (len < 6 + ml) { raise_msg(GPUIPC_E_TRUNCATED, "open", "shared descriptor"); goto out; }
    const uint8_t *um;
    size_t ul;
    meta_decode(p + 6, ml, (size_t)-1 / 2, &meta, &um, &ul);
    have_meta = 1;
    p += 6 + ml;
    len -= 6 + ml;
  }
  gpuipc_buffer *b = NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_buffer_import(p, len, fds, nfds, &io, &b);
  Py_END_ALLOW_THREADS
  if (st) { raise_st(st, "open"); goto out; }
  size_t size = gpuipc_buffer_get_size(b);
  if (have_meta && (meta.offset > size || meta_extent(&meta) > size - meta.offset)) {
    gpuipc_buffer_close(b);
    raise_msg(GPUIPC_E_OUT_OF_RANGE, "open", "the array's shape leaves the buffer");
    goto out;
  }
  ret = buffer_new(b, NULL, NULL, 1, 0, 0, have_meta ? &meta : NULL);
out:
  PyBuffer_Release(&d);
  return ret;
}

static PyObject *mod_desc_info(PyObject *m, PyObject *args) {
  Py_buffer d;
  if (!PyArg_ParseTuple(args, "y*", &d)) return NULL;
  const uint8_t *p = d.buf;
  size_t len = (size_t)d.len;
  if (len >= 6 && !memcmp(p, "GPYS", 4) && len >= 6u + p[5]) {
    len -= 6u + p[5];
    p += 6u + p[5];
  }
  gpuipc_desc_info i = GPUIPC_DESC_INFO_INIT;
  gpuipc_status st = gpuipc_desc_get_info(p, len, &i);
  PyBuffer_Release(&d);
  if (st) return raise_st(st, "desc_info");
  return Py_BuildValue("{s:i,s:s,s:I,s:i,s:N,s:i,s:K,s:K,s:K,s:K,s:K,s:O,s:O}", "type",
                       (int)i.type, "kind", gpuipc_pool_kind_name(i.kind), "version", i.version,
                       "nfds", i.nfds, "device", uuid_str(&i.device), "exporter_pid",
                       i.exporter_pid, "buffer_id", (unsigned long long)i.buffer_id,
                       "generation", (unsigned long long)i.generation, "offset",
                       (unsigned long long)i.offset, "bytes", (unsigned long long)i.bytes,
                       "alloc_bytes", (unsigned long long)i.alloc_bytes, "same_machine",
                       i.same_machine ? Py_True : Py_False, "same_namespace",
                       i.same_namespace ? Py_True : Py_False);
}

/* ------------------------------------------------------------------------ */
/* Event                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD
  gpuipc_event *e;
} EventObject;

static PyObject *event_wrap(gpuipc_event *e) {
  EventObject *o = PyObject_New(EventObject, &EventType);
  if (!o) { gpuipc_event_destroy(e); return NULL; }
  o->e = e;
  return (PyObject *)o;
}

static PyObject *Event_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"device", NULL};
  PyObject *dev_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &dev_o)) return NULL;
  gpuipc_uuid u;
  int have;
  if (parse_uuid(dev_o, &u, &have) < 0) return NULL;
  gpuipc_event *e = NULL;
  gpuipc_status st = gpuipc_event_create(have ? &u : NULL, &e);
  if (st) return raise_st(st, "Event");
  return event_wrap(e);
}
static void Event_dealloc(EventObject *e) {
  gpuipc_event_destroy(e->e);
  PyObject_Free(e);
}
static int ev_alive(EventObject *e) {
  if (!e->e) { PyErr_SetString(PyExc_ValueError, "event closed"); return 0; }
  return 1;
}
static PyObject *Event_sw(EventObject *e, PyObject *args, PyObject *kw, int wait) {
  static char *kwl[] = {"stream", NULL};
  PyObject *so = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwl, &so)) return NULL;
  uintptr_t s;
  if (!ev_alive(e) || parse_stream(so, &s) < 0) return NULL;
  gpuipc_status st = wait ? gpuipc_event_wait(e->e, S(s)) : gpuipc_event_record(e->e, S(s));
  if (st) return raise_st(st, wait ? "Event.wait" : "Event.record");
  Py_RETURN_NONE;
}
static PyObject *Event_record(EventObject *e, PyObject *a, PyObject *k) { return Event_sw(e, a, k, 0); }
static PyObject *Event_wait(EventObject *e, PyObject *a, PyObject *k) { return Event_sw(e, a, k, 1); }
static PyObject *Event_synchronize(EventObject *e, PyObject *u) {
  if (!ev_alive(e)) return NULL;
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_event_synchronize(e->e);
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "Event.synchronize");
  Py_RETURN_NONE;
}
static PyObject *Event_query(EventObject *e, PyObject *u) {
  if (!ev_alive(e)) return NULL;
  gpuipc_status st = gpuipc_event_query(e->e);
  if (st == GPUIPC_OK) Py_RETURN_TRUE;
  if (st == GPUIPC_E_WOULD_BLOCK) Py_RETURN_FALSE;
  return raise_st(st, "Event.query");
}
static PyObject *Event_export(EventObject *e, PyObject *u) {
  if (!ev_alive(e)) return NULL;
  uint8_t d[1024];
  size_t len;
  gpuipc_status st = gpuipc_event_export(e->e, d, sizeof d, &len);
  if (st) return raise_st(st, "Event.export");
  return PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)len);
}
static PyObject *Event_open(PyTypeObject *t, PyObject *args) {
  Py_buffer d;
  if (!PyArg_ParseTuple(args, "y*", &d)) return NULL;
  gpuipc_event *e = NULL;
  gpuipc_status st = gpuipc_event_import(d.buf, (size_t)d.len, NULL, &e);
  PyBuffer_Release(&d);
  if (st) return raise_st(st, "Event.open");
  return event_wrap(e);
}
static PyObject *Event_close(EventObject *e, PyObject *u) {
  gpuipc_event_destroy(e->e);
  e->e = NULL;
  Py_RETURN_NONE;
}
static PyObject *Event_handle(EventObject *e, void *u) {
  if (!ev_alive(e)) return NULL;
  return PyLong_FromUnsignedLongLong((uintptr_t)gpuipc_event_get_handle(e->e));
}
static PyMethodDef Event_methods[] = {
    {"record", (PyCFunction)(void (*)(void))Event_record, METH_VARARGS | METH_KEYWORDS, NULL},
    {"wait", (PyCFunction)(void (*)(void))Event_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(stream=None): the stream waits for the last record (no host wait)"},
    {"synchronize", (PyCFunction)Event_synchronize, METH_NOARGS, "block until complete"},
    {"query", (PyCFunction)Event_query, METH_NOARGS, "True when complete"},
    {"export", (PyCFunction)Event_export, METH_NOARGS, "descriptor bytes (a bearer token)"},
    {"open", (PyCFunction)Event_open, METH_VARARGS | METH_CLASS, "Event.open(desc) -> Event"},
    {"close", (PyCFunction)Event_close, METH_NOARGS, NULL},
    {NULL}};
static PyGetSetDef Event_getset[] = {{"handle", (getter)Event_handle, NULL, "the CUevent", NULL}, {NULL}};
static PyTypeObject EventType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Event",
    .tp_basicsize = sizeof(EventObject),
    .tp_dealloc = (destructor)Event_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Event(device=None): an interprocess CUDA event.",
    .tp_methods = Event_methods,
    .tp_getset = Event_getset,
    .tp_new = Event_new,
};

/* ------------------------------------------------------------------------ */
/* Module functions                                                         */
/* ------------------------------------------------------------------------ */

static PyObject *mod_init(PyObject *m, PyObject *u) {
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_init();
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "init");
  Py_RETURN_NONE;
}
static PyObject *mod_version(PyObject *m, PyObject *u) { return PyUnicode_FromString(gpuipc_version_string()); }
static PyObject *mod_driver_path(PyObject *m, PyObject *u) { return PyUnicode_FromString(gpuipc_driver_path()); }
static PyObject *mod_driver_version(PyObject *m, PyObject *u) {
  int v = 0;
  gpuipc_status st = gpuipc_driver_version(&v);
  if (st) return raise_st(st, "driver_version");
  return PyLong_FromLong(v);
}
static PyObject *mod_device_count(PyObject *m, PyObject *u) {
  int n = 0;
  gpuipc_status st = gpuipc_device_count(&n);
  if (st) return raise_st(st, "device_count");
  return PyLong_FromLong(n);
}
static PyObject *mod_device_uuid(PyObject *m, PyObject *args) {
  int ord = 0;
  if (!PyArg_ParseTuple(args, "|i", &ord)) return NULL;
  gpuipc_uuid u;
  gpuipc_status st = gpuipc_device_uuid(ord, &u);
  if (st) return raise_st(st, "device_uuid");
  return uuid_str(&u);
}
static PyObject *mod_device_from_uuid(PyObject *m, PyObject *args) {
  PyObject *o;
  if (!PyArg_ParseTuple(args, "O", &o)) return NULL;
  gpuipc_uuid u;
  int have, ord;
  if (parse_uuid(o, &u, &have) < 0) return NULL;
  gpuipc_status st = gpuipc_device_from_uuid(&u, &ord);
  if (st) return raise_st(st, "device_from_uuid");
  return PyLong_FromLong(ord);
}
static PyObject *mod_cache_stats(PyObject *m, PyObject *u) {
  gpuipc_cache_stats s = GPUIPC_CACHE_STATS_INIT;
  gpuipc_status st = gpuipc_cache_get_stats(&s);
  if (st) return raise_st(st, "cache_stats");
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "hits", (unsigned long long)s.hits,
                       "misses", (unsigned long long)s.misses, "stale",
                       (unsigned long long)s.stale, "driver_opens",
                       (unsigned long long)s.driver_opens, "driver_closes",
                       (unsigned long long)s.driver_closes, "live_mappings",
                       (unsigned long long)s.live_mappings, "pool_imports",
                       (unsigned long long)s.pool_imports, "pool_hits",
                       (unsigned long long)s.pool_hits);
}
static PyObject *mod_counters(PyObject *m, PyObject *u) {
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "received", g_count.live_received,
                       "blocks", g_count.live_blocks, "buffers", g_count.live_buffers,
                       "capsule_refs", g_count.live_capsule_ctx, "wraps", g_count.wraps_live,
                       "wraps_total", g_count.wraps_total, "graveyard", g_count.graveyard);
}
static PyObject *mod_collect(PyObject *m, PyObject *u) {
  LOCK();
  dead_arenas_retry_locked();
  UNLOCK();
  graves_reap();
  Py_RETURN_NONE;
}
static PyObject *mod_worker_index(PyObject *m, PyObject *u) {
  int i, n;
  gpuipc_status st = gpuipc_worker_index(&i, &n);
  if (st) return raise_st(st, "worker_index");
  return Py_BuildValue("(ii)", i, n);
}
static PyObject *mod_status_name(PyObject *m, PyObject *args) {
  int s;
  if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
  return PyUnicode_FromString(gpuipc_status_name((gpuipc_status)s));
}
static PyObject *mod_log_level(PyObject *m, PyObject *args) {
  int l = -1;
  if (!PyArg_ParseTuple(args, "|i", &l)) return NULL;
  if (l >= 0) gpuipc_log_set_level((gpuipc_log_level)l);
  return PyLong_FromLong(gpuipc_log_get_level());
}
/* Test hook: makes an error of status s with detail, as the library would. */
static PyObject *mod_raise_status(PyObject *m, PyObject *args) {
  int s;
  const char *d = "";
  if (!PyArg_ParseTuple(args, "i|s", &s, &d)) return NULL;
  return raise_msg((gpuipc_status)s, "raise_status", d);
}

static PyMethodDef mod_methods[] = {
    {"init", mod_init, METH_NOARGS, "load and initialize the CUDA driver (cuInit)"},
    {"version", mod_version, METH_NOARGS, "the C library's version"},
    {"driver_path", mod_driver_path, METH_NOARGS, NULL},
    {"driver_version", mod_driver_version, METH_NOARGS, NULL},
    {"device_count", mod_device_count, METH_NOARGS, NULL},
    {"device_uuid", mod_device_uuid, METH_VARARGS, "device_uuid(ordinal=0) -> 'GPU-...'"},
    {"device_from_uuid", mod_device_from_uuid, METH_VARARGS, NULL},
    {"listen", (PyCFunction)(void (*)(void))mod_listen, METH_VARARGS | METH_KEYWORDS,
     "listen(name, *, timeout=10, abstract=False, runtime_dir=None, allow_uids=(), "
     "allow_gids=(), max_outstanding=256, order='memop') -> Listener"},
    {"connect", (PyCFunction)(void (*)(void))mod_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(name, *, timeout=10, ...) -> Connection"},
    {"from_fd", (PyCFunction)(void (*)(void))mod_from_fd, METH_VARARGS | METH_KEYWORDS,
     "from_fd(fd, *, timeout=10, ...) -> Connection (takes the fd)"},
    {"conn_pair", mod_conn_pair, METH_NOARGS, "conn_pair() -> (fd, fd), close-on-exec"},
    {"spawn_connection", (PyCFunction)(void (*)(void))mod_spawn_connection,
     METH_VARARGS | METH_KEYWORDS, "in a spawned child: -> (Connection, n_pools, n_buffers)"},
    {"spawn_child", (PyCFunction)(void (*)(void))mod_spawn, METH_VARARGS | METH_KEYWORDS,
     "spawn_child(path, argv, *, env_add=None, timeout=30, search_path=False) -> Child"},
    {"share", (PyCFunction)(void (*)(void))mod_share, METH_VARARGS | METH_KEYWORDS,
     "share(obj) -> Shared (desc bytes + fds)"},
    {"open", (PyCFunction)(void (*)(void))mod_open, METH_VARARGS | METH_KEYWORDS,
     "open(desc, fds=(), *, device=None, pidfd_getfd=False) -> Buffer"},
    {"desc_info", mod_desc_info, METH_VARARGS, "what a descriptor says, as a dict"},
    {"cache_stats", mod_cache_stats, METH_NOARGS, "the import cache's counters"},
    {"counters", mod_counters, METH_NOARGS, "this module's live-object counters"},
    {"collect", mod_collect, METH_NOARGS, "retry deferred arena destroys and dead peers' leases"},
    {"worker_index", mod_worker_index, METH_NOARGS, "(index, count) in a worker"},
    {"status_name", mod_status_name, METH_VARARGS, NULL},
    {"log_level", mod_log_level, METH_VARARGS, "log_level(level=-1) -> level"},
    {"_raise_status", mod_raise_status, METH_VARARGS, NULL},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "gpuipc._gpuipc",
                                    "gpuipc's C extension (see the gpuipc package).", -1,
                                    mod_methods};

/* "GPUIPC_E_OUT_OF_RANGE" -> "OutOfRangeError" */
static void class_name(const char *status, char *out, size_t cap) {
  const char *p = status + strlen("GPUIPC_E_");
  size_t n = 0;
  int up = 1;
  for (; *p && n + 6 < cap; p++) {
    if (*p == '_') { up = 1; continue; }
    out[n++] = up ? *p : (char)(*p - 'A' + 'a');
    up = 0;
  }
  memcpy(out + n, "Error", 6);
}

PyMODINIT_FUNC PyInit__gpuipc(void) {
  g_lock = PyThread_allocate_lock();
  if (!g_lock) return PyErr_NoMemory();
  PyTypeObject *types[] = {&ListenerType, &ConnType, &ArenaType, &BlockType, &PoolType,
                           &BufferType, &EventType, &ReceivedType, &SharedType, &ChildType};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    if (PyType_Ready(types[i]) < 0) return NULL;
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  const char *names[] = {"Listener", "Connection", "Arena", "Block", "Pool",
                         "Buffer", "Event", "Received", "Shared", "Child"};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
    Py_INCREF(types[i]);
    PyModule_AddObject(m, names[i], (PyObject *)types[i]);
  }
  ErrorBase = PyErr_NewExceptionWithDoc(
      "gpuipc.Error", "A gpuipc call failed; .status, .status_name and .detail say how.",
      NULL, NULL);
  if (!ErrorBase) return NULL;
  Py_INCREF(ErrorBase);
  PyModule_AddObject(m, "Error", ErrorBase);
  PyObject *by_status = PyDict_New();
  for (int s = 1; s < GPUIPC__STATUS_END; s++) {
    char cname[64], full[80];
    class_name(gpuipc_status_name((gpuipc_status)s), cname, sizeof cname);
    snprintf(full, sizeof full, "gpuipc.%s", cname);
    PyObject *extra = NULL;
    if (s == GPUIPC_E_TIMEOUT) extra = PyExc_TimeoutError;
    else if (s == GPUIPC_E_PERMISSION) extra = PyExc_PermissionError;
    else if (s == GPUIPC_E_INVALID_ARG) extra = PyExc_ValueError;
    else if (s == GPUIPC_E_NO_MEMORY) extra = PyExc_MemoryError;
    else if (s == GPUIPC_E_CLOSED || s == GPUIPC_E_PEER_GONE) extra = PyExc_ConnectionError;
    PyObject *bases = extra ? PyTuple_Pack(2, ErrorBase, extra) : PyTuple_Pack(1, ErrorBase);
    ErrorClass[s] = PyErr_NewException(full, bases, NULL);
    Py_DECREF(bases);
    if (!ErrorClass[s]) return NULL;
    Py_INCREF(ErrorClass[s]);
    PyModule_AddObject(m, cname, ErrorClass[s]);
    PyObject *k = PyLong_FromLong(s);
    PyDict_SetItem(by_status, k, ErrorClass[s]);
    Py_DECREF(k);
  }
  ErrorClass[0] = ErrorBase;
  PyModule_AddObject(m, "errors_by_status", by_status);
  PyModule_AddIntConstant(m, "META_MAX", GPUIPC_META_MAX);
  PyModule_AddIntConstant(m, "MSG_MAX", GPUIPC_CONN_MSG_MAX);
  PyModule_AddIntConstant(m, "FDS_MAX", GPUIPC_CONN_FDS_MAX);
  PyModule_AddStringConstant(m, "__version__", GPUIPC_VERSION_STRING);
  return m;
}
