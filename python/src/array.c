/*
 * array.c: arrays: the metadata (shape, dtype, strides, offset: the C
 * library's tensor meta, whose wire form in a buffer's meta bytes is the
 * library's too) and the Python names of its dtypes; exporting views of gpuipc's memory
 * (CUDA Array Interface v3, DLPack capsules with their naming and deleter
 * rules, versioned and not, with the protocol's stream ordering); reading
 * the arrays of other libraries to send or share them.
 */
#include "ext.h"

/* ------------------------------------------------------------------------ */
/* Array metadata                                                           */
/* ------------------------------------------------------------------------ */

/* ArrMeta is the C library's gpuipc_tensor_meta (ext.h): its format, its
 * extent and its checks are the library's (include/gpuipc/tensor.h), and
 * dtypes are gpuipc_dtype codes. The fields user and user_len stay zero
 * here except inside meta_encode and meta_decode. */

void meta_bytes1d(ArrMeta *m, size_t n) {
  memset(m, 0, sizeof *m);
  m->ndim = 1;
  m->dtype = GPUIPC_DTYPE_U8;
  m->shape[0] = (int64_t)n;
  m->strides[0] = 1;
}

size_t itemsize(int dtype) { return gpuipc_dtype_get_size(dtype); }

int meta_contiguous(const ArrMeta *m) { return gpuipc_tensor_meta_is_contiguous(m); }

/* The bytes an array spans from its first element, or SIZE_MAX when the
 * library refuses it (a size or stride that is negative, an extent beyond
 * 2^62 bytes: shapes and strides can come from a peer, and a product that
 * wrapped around would make a huge view look small). */
size_t meta_extent(const ArrMeta *m) {
  uint64_t n;
  if (gpuipc_tensor_meta_get_extent(m, &n) != GPUIPC_OK || n > SIZE_MAX) return SIZE_MAX;
  return (size_t)n;
}

void meta_fill_strides(const ArrMeta *m, int64_t *out) {
  if (m->has_strides) {
    memcpy(out, m->strides, sizeof(int64_t) * m->ndim);
    return;
  }
  ArrMeta c = *m;
  gpuipc_tensor_meta_set_contiguous(&c);
  memcpy(out, c.strides, sizeof(int64_t) * m->ndim);
}

/* The wire form in a buffer's meta bytes is the library's tensor meta
 * (docs/tensor-meta.md), with the caller's meta= bytes as its user bytes. */
int meta_encode(const ArrMeta *m, const uint8_t *user, size_t ulen, uint8_t *out,
                size_t *len) {
  gpuipc_tensor_meta t = *m;
  t.user = user;
  t.user_len = ulen;
  gpuipc_status st = gpuipc_tensor_meta_encode(&t, out, GPUIPC_META_MAX, len);
  if (st == GPUIPC_E_LIMIT) {
    PyErr_Format(PyExc_ValueError, "metadata too large: %zu bytes (shape, strides and "
                 "meta together must fit %d)", *len, GPUIPC_META_MAX);
    return -1;
  }
  if (st != GPUIPC_OK) {
    PyErr_Format(PyExc_ValueError, "metadata: %s", gpuipc_last_error());
    return -1;
  }
  return 0;
}

/* Decodes; anything that is not a tensor meta, or one that does not fit
 * the buffer's `length` bytes, is a 1-D uint8 array of `length` bytes with
 * all of meta as the user's bytes. Sets *user and *ulen. */
void meta_decode(const uint8_t *in, size_t len, size_t length, ArrMeta *m,
                 const uint8_t **user, size_t *ulen) {
  meta_bytes1d(m, length);
  *user = in;
  *ulen = len;
  gpuipc_tensor_meta t;
  if (gpuipc_tensor_meta_decode(in, len, &t) != GPUIPC_OK ||
      gpuipc_tensor_meta_check(&t, length) != GPUIPC_OK)
    return;
  *user = t.user ? t.user : in + len;
  *ulen = t.user_len;
  t.user = NULL;
  t.user_len = 0;
  *m = t;
}

/* typestr ("<f4") <-> gpuipc_dtype, through the DLPack type each stands for */
static int typestr_parse(const char *s, int *d) {
  if (!s[0] || !s[1]) goto bad;
  if (s[0] != '<' && s[0] != '|' && s[0] != '=') goto bad;
  char k = s[1];
  long n = strtol(s + 2, NULL, 10);
  if (n <= 0 || n > 16) goto bad;
  uint8_t code;
  switch (k) {
  case 'i': code = kDLInt; break;
  case 'u': code = kDLUInt; break;
  case 'f': code = kDLFloat; break;
  case 'c': code = kDLComplex; break;
  case 'b': code = kDLBool; break;
  default: goto bad;
  }
  *d = gpuipc_dtype_from_dlpack(code, (uint8_t)(8 * n), 1);
  if (*d) return 0;
bad:
  PyErr_Format(PyExc_TypeError, "unsupported typestr %s", s);
  return -1;
}

static int typestr_make(int dtype, char *out) {
  uint8_t code, bits;
  uint16_t lanes;
  if (gpuipc_dtype_to_dlpack(dtype, &code, &bits, &lanes) != GPUIPC_OK) return -1;
  char k;
  switch (code) {
  case kDLInt: k = 'i'; break;
  case kDLUInt: k = 'u'; break;
  case kDLFloat: k = 'f'; break;
  case kDLComplex: k = 'c'; break;
  case kDLBool: k = 'b'; break;
  default: return -1; /* bfloat16, the float8 kinds: no typestr names them */
  }
  int n = bits / 8;
  snprintf(out, 8, "%c%c%d", n == 1 ? '|' : '<', k, n);
  return 0;
}

/* The Python names of gpuipc_dtype (torch's, NumPy's and CuPy's names
 * without their module): the first of each code is the name dtype reports;
 * aliases follow. */
static const struct { const char *name; int d; } dtype_names[] = {
    {"bool", GPUIPC_DTYPE_BOOL},       {"int8", GPUIPC_DTYPE_I8},
    {"int16", GPUIPC_DTYPE_I16},       {"int32", GPUIPC_DTYPE_I32},
    {"int64", GPUIPC_DTYPE_I64},       {"uint8", GPUIPC_DTYPE_U8},
    {"uint16", GPUIPC_DTYPE_U16},      {"uint32", GPUIPC_DTYPE_U32},
    {"uint64", GPUIPC_DTYPE_U64},      {"float16", GPUIPC_DTYPE_F16},
    {"float32", GPUIPC_DTYPE_F32},     {"float64", GPUIPC_DTYPE_F64},
    {"bfloat16", GPUIPC_DTYPE_BF16},   {"complex64", GPUIPC_DTYPE_C64},
    {"complex128", GPUIPC_DTYPE_C128},
    {"float8_e4m3fn", GPUIPC_DTYPE_F8_E4M3FN},
    {"float8_e5m2", GPUIPC_DTYPE_F8_E5M2},
    {"float8_e4m3fnuz", GPUIPC_DTYPE_F8_E4M3FNUZ},
    {"float8_e5m2fnuz", GPUIPC_DTYPE_F8_E5M2FNUZ},
    {"float8_e8m0fnu", GPUIPC_DTYPE_F8_E8M0FNU},
    /* aliases */
    {"half", GPUIPC_DTYPE_F16},        {"float", GPUIPC_DTYPE_F32},
    {"double", GPUIPC_DTYPE_F64},      {"int", GPUIPC_DTYPE_I32},
    {"long", GPUIPC_DTYPE_I64},        {"bool_", GPUIPC_DTYPE_BOOL},
    {"cfloat", GPUIPC_DTYPE_C64},      {"cdouble", GPUIPC_DTYPE_C128},
};

const char *dtype_name(int dtype) {
  for (size_t i = 0; i < sizeof dtype_names / sizeof dtype_names[0]; i++)
    if (dtype_names[i].d == dtype) return dtype_names[i].name;
  return NULL;
}

static int dtype_lookup(const char *t) {
  if (!strncmp(t, "torch.", 6)) t += 6;
  for (size_t i = 0; i < sizeof dtype_names / sizeof dtype_names[0]; i++)
    if (!strcmp(t, dtype_names[i].name)) return dtype_names[i].d;
  return 0;
}

/* A dtype: None (uint8), a name ("float32", "torch.float32",
 * "float8_e4m3fn"), a typestr, or an object with .name and .str (a NumPy
 * or CuPy dtype: its name first, so that ml_dtypes' float8 kinds, whose
 * typestr is an opaque "<V1", are found) or whose str() is one of those. */
int parse_dtype(PyObject *o, int *d) {
  *d = GPUIPC_DTYPE_U8;
  if (o == NULL || o == Py_None) return 0;
  PyObject *s;
  if (PyUnicode_Check(o)) {
    s = o;
    Py_INCREF(s);
  } else if (PyObject_HasAttrString(o, "str") && PyObject_HasAttrString(o, "itemsize")) {
    PyObject *nm = PyObject_GetAttrString(o, "name"); /* numpy dtype */
    const char *t = nm && PyUnicode_Check(nm) ? PyUnicode_AsUTF8(nm) : NULL;
    int found = t ? dtype_lookup(t) : 0;
    Py_XDECREF(nm);
    PyErr_Clear();
    if (found) {
      *d = found;
      return 0;
    }
    s = PyObject_GetAttrString(o, "str");
  } else {
    s = PyObject_Str(o);
  }
  if (!s) return -1;
  const char *t = PyUnicode_AsUTF8(s);
  if (!t) { Py_DECREF(s); return -1; }
  int found = dtype_lookup(t);
  if (found) {
    *d = found;
    Py_DECREF(s);
    return 0;
  }
  int rc = typestr_parse(t, d);
  Py_DECREF(s);
  return rc;
}

/* shape (int or sequence) + dtype -> meta (contiguous) */
int meta_from_shape(PyObject *shape, PyObject *dtype, size_t *nbytes, ArrMeta *m) {
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
  if (*nbytes == SIZE_MAX) {
    PyErr_SetString(PyExc_ValueError, "shape too large: its size does not fit in 64 bits");
    return -1;
  }
  return 0;
}

PyObject *shape_tuple(const int64_t *v, int n) {
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

PyObject *cai_dict(const View *v) {
  char ts[8];
  if (typestr_make(v->meta->dtype, ts) < 0) {
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
    size_t isz = itemsize(v->meta->dtype);
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
PyObject *dlpack_export(PyObject *owner, const View *v, PyObject *args, PyObject *kw) {
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
    /* PyArg_ParseTuple takes a tuple only (anything else: SystemError). */
    if (!PyTuple_Check(dldev) || PyTuple_GET_SIZE(dldev) != 2) {
      PyErr_SetString(PyExc_TypeError, "dl_device must be a (device_type, device_id) tuple");
      return NULL;
    }
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
  gpuipc_dtype_to_dlpack(v->meta->dtype, &t->dtype.code, &t->dtype.bits, &t->dtype.lanes);
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

PyObject *dlpack_device(const View *v) { return Py_BuildValue("(ii)", v->dev_type, v->dev_id); }

/* ------------------------------------------------------------------------ */
/* Importing foreign arrays (to send or share them)                         */
/* ------------------------------------------------------------------------ */

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
    size_t isz = itemsize(f->meta.dtype);
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
  f->meta.dtype = gpuipc_dtype_from_dlpack(t->dtype.code, t->dtype.bits, t->dtype.lanes);
  if (!f->meta.dtype) {
    DLDataType dt = t->dtype;
    Py_DECREF(cap);
    PyErr_Format(PyExc_TypeError, "DLPack dtype (code %d, bits %d, lanes %d) has no gpuipc "
                 "dtype (docs/tensor-meta.md lists them)", dt.code, dt.bits, dt.lanes);
    return -1;
  }
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

/* Whether a CAI's typestr is an opaque one ("<V2": raw bytes, which torch
 * gives for bfloat16), which says nothing of the dtype: DLPack does. */
static int cai_opaque(PyObject *d) {
  PyObject *ts = PyDict_Check(d) ? PyDict_GetItemString(d, "typestr") : NULL;
  const char *t = ts && PyUnicode_Check(ts) ? PyUnicode_AsUTF8(ts) : NULL;
  if (!t) {
    PyErr_Clear();
    return 0;
  }
  return t[0] && t[1] == 'V';
}

/* Reads an object's array protocol. stream: where the caller will use it
 * (passed to __dlpack__, whose exporter orders it after its work); for CAI
 * the caller orders it after f->stream when has_stream is set, once it
 * knows the device. */
int foreign_get(PyObject *obj, uintptr_t stream, Foreign *f) {
  memset(f, 0, sizeof *f);
  PyObject *d = PyObject_GetAttrString(obj, "__cuda_array_interface__");
  if (d && !cai_opaque(d)) {
    int rc = foreign_from_cai(obj, d, f);
    Py_DECREF(d);
    return rc; /* the caller orders `stream` after f->stream (has_stream) */
  }
  if (d) { /* a typestr that names no dtype (torch: bfloat16 as "<V2") */
    int rc = PyObject_HasAttrString(obj, "__dlpack__")
                 ? foreign_from_dlpack(obj, stream, f)
                 : foreign_from_cai(obj, d, f); /* says which typestr it cannot take */
    Py_DECREF(d);
    return rc;
  }
  /* No CAI, or one that refuses this array (older torch: bfloat16): DLPack. */
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

/* "shape=(3, 4) dtype=float32" for the objects' reprs. */
PyObject *meta_repr_part(const ArrMeta *m) {
  PyObject *shape = shape_tuple(m->shape, m->ndim);
  if (!shape) return NULL;
  const char *n = dtype_name(m->dtype);
  PyObject *r = PyUnicode_FromFormat("shape=%R dtype=%s", shape,
                                     n ? n : gpuipc_dtype_name(m->dtype));
  Py_DECREF(shape);
  return r;
}
