/*
 * buffer.c: Pool and Buffer (memory shared by descriptor), gpuipc.share and
 * gpuipc.open (descriptors as plain bytes with the array's metadata in
 * front), and interprocess Events.
 */
#include "ext.h"

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
      /* An ordinal of this process, named by its UUID as the C API wants. */
      gpuipc_status ds = gpuipc_device_uuid((int)PyLong_AsLong(dev_o), &u);
      if (ds) return raise_st(ds, "Pool");
      o.device = &u;
    } else {
      int have;
      if (parse_uuid(dev_o, &u, &have) < 0) return NULL;
      o.device = &u;
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
  BufferObject *o = PyObject_GC_New(BufferObject, &BufferType);
  if (!o) { gpuipc_buffer_free(b, NULL); return NULL; }
  o->b = b;
  o->weak = NULL;
  o->hold = NULL;
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
  PyObject_GC_Track(o);
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
     "alloc($self, /, nbytes=None, *, stream=None, shape=None, dtype=None)\n--\n\n"
     "alloc(nbytes=None, *, stream=None, shape=None, dtype=None) -> Buffer"},
    {"export", (PyCFunction)Pool_export, METH_NOARGS,
     "export($self, /)\n--\n\nexport() -> (desc bytes, fd) (MEMPOOL)"},
    {"open", (PyCFunction)Pool_open, METH_VARARGS | METH_CLASS,
     "open($type, desc, fd=-1, /)\n--\n\nPool.open(desc, fd) -> Pool"},
    {NULL}};
static PyGetSetDef Pool_getset[] = {
    {"kind", (getter)Pool_get, NULL, NULL, (void *)0},
    {"device", (getter)Pool_get, NULL, "device UUID", (void *)1},
    {NULL}};
PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(kind='auto', device=None, capacity=0)\n--\n\n"
              "Pool(kind='auto', device=None, capacity=0): buffers shared by descriptor.",
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
    .tp_new = Pool_new,
};

static int buf_alive(BufferObject *b) {
  if (!b->b) { PyErr_SetString(PyExc_ValueError, "buffer was freed"); return 0; }
  return 1;
}

View buf_view(BufferObject *b) {
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
  if (b->b && gpuipc_buffer_get_holders(b->b) > 0)
    return raise_msg(GPUIPC_E_BUSY, "close", "a peer still holds this buffer (sent with "
                     "conn.send and not released)");
  gpuipc_buffer *gb = b->b;
  if (b->hold) {
    struct HoldRef *r = b->hold;
    b->hold = NULL;
    hold_release(r);
  }
  if (gb) {
    /* Taken and cleared before the GIL is released: a close in another
     * thread meanwhile finds it closed, and frees nothing twice. */
    b->b = NULL;
    gpuipc_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gpuipc_buffer_free(gb, S(b->stream));
    Py_END_ALLOW_THREADS
    g_count.live_buffers--;
    Py_CLEAR(b->owner);
    if (st) return raise_st(st, "close");
  }
  Py_RETURN_NONE;
}

/* The gpuipc buffer goes: freed now, or, while peers hold it (sent with
 * conn.send), handed to the library, which frees it once they released
 * it or are gone, and then lets its pool and owner go (kept_done). */
static void buf_drop(BufferObject *b) {
  if (b->hold) {
    struct HoldRef *r = b->hold;
    b->hold = NULL;
    hold_release(r);
  }
  gpuipc_buffer *gb = b->b;
  if (!gb) return;
  b->b = NULL;
  Kept *k = NULL;
  if (!b->imported && gpuipc_buffer_get_holders(gb) > 0 &&
      (k = kept_new(b->pool, b->owner, NULL, 0)) != NULL) {
    LOCK();
    (void)gpuipc_buffer_release_when_done(gb, S(b->stream), kept_done, k);
    UNLOCK();
  } else {
    PyErr_Clear(); /* no memory for the node: freed now, as before */
    gpuipc_buffer_free(gb, S(b->stream));
  }
  g_count.live_buffers--;
}

/* The owner is shown to the collector only while no peer holds the
 * buffer: a cycle through it must not be finalized (the owner's
 * finalizer may free the memory) while a peer maps the memory. Holders
 * only decrease while the collector runs (a send needs the GIL), so a
 * pass sees the owner at most more reachable than it is. */
static int Buffer_traverse(BufferObject *b, visitproc visit, void *arg) {
  Py_VISIT(b->pool);
  if (!b->b || gpuipc_buffer_get_holders(b->b) == 0) Py_VISIT(b->owner);
  return 0;
}

/* A cycle through the memory's owner (an object that keeps its Buffer):
 * the buffer goes first (handed over while held), then the references. */
static int Buffer_clear(BufferObject *b) {
  buf_drop(b);
  Py_CLEAR(b->pool);
  Py_CLEAR(b->owner);
  return 0;
}

static void Buffer_dealloc(BufferObject *b) {
  PyObject_GC_UnTrack(b);
  if (b->weak) PyObject_ClearWeakRefs((PyObject *)b);
  buf_drop(b);
  Py_XDECREF(b->pool);
  Py_XDECREF(b->owner);
  PyObject_GC_Del(b);
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

/* "GPYS" 1 <meta len> <meta> <desc>: what gpuipc.share gives as .desc. */
static PyObject *gpys_bytes(const ArrMeta *m, const uint8_t *desc, size_t len) {
  uint8_t meta[GPUIPC_META_MAX];
  size_t mlen;
  if (meta_encode(m, NULL, 0, meta, &mlen) < 0) return NULL;
  uint8_t d[6 + GPUIPC_META_MAX + GPUIPC_DESC_MAX];
  memcpy(d, "GPYS", 4);
  d[4] = 1;
  d[5] = (uint8_t)mlen;
  memcpy(d + 6, meta, mlen);
  memcpy(d + 6 + mlen, desc, len);
  return PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)(6 + mlen + len));
}

/* (ptr, shape, strides in elements, dtype) -> a Foreign with no owner: an
 * array named by its numbers, read without any attribute of the array's
 * (a torch tensor's __cuda_array_interface__ is a Python property). */
static int foreign_from_tuple(PyObject *t, Foreign *f) {
  memset(f, 0, sizeof *f);
  PyObject *shape = PyTuple_GET_ITEM(t, 1), *strides = PyTuple_GET_ITEM(t, 2);
  size_t nbytes;
  if (meta_from_shape(shape, PyTuple_GET_ITEM(t, 3), &nbytes, &f->meta) < 0) return -1;
  PyObject *seq = PySequence_Fast(strides, "strides must be a sequence of ints");
  if (!seq) return -1;
  if (PySequence_Fast_GET_SIZE(seq) != f->meta.ndim) {
    Py_DECREF(seq);
    PyErr_SetString(PyExc_ValueError, "share_view: as many strides as dimensions");
    return -1;
  }
  for (int i = 0; i < f->meta.ndim; i++) {
    f->meta.strides[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (f->meta.strides[i] < 0 && !PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "share_view: negative stride");
  }
  Py_DECREF(seq);
  if (PyErr_Occurred()) return -1;
  f->meta.has_strides = 1;
  f->ptr = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
  if (PyErr_Occurred()) return -1;
  f->nbytes = meta_extent(&f->meta);
  if (f->nbytes == SIZE_MAX) {
    PyErr_SetString(PyExc_ValueError, "share_view: the array's extent overflows");
    return -1;
  }
  return 0;
}

static PyObject *Buffer_share_view(BufferObject *b, PyObject *obj) {
  if (!buf_alive(b)) return NULL;
  Foreign f;
  if (PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) == 4) {
    if (foreign_from_tuple(obj, &f) < 0) return NULL;
  } else {
    if (foreign_get(obj, 0, &f) < 0) return NULL;
    Py_XDECREF(f.owner); /* the caller keeps obj alive while peers use it */
  }
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  gpuipc_status st = gpuipc_buffer_export_range(b->b, f.ptr, f.nbytes ? f.nbytes : 1, d,
                                                sizeof d, &len);
  if (st) return raise_st(st, "share_view");
  return gpys_bytes(&f.meta, d, len);
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

static PyObject *Buffer_repr(BufferObject *b) {
  PyObject *m = meta_repr_part(&b->meta);
  if (!m) return NULL;
  PyObject *o = b->b ? PyUnicode_FromFormat("<gpuipc.Buffer %U kind=%s%s>", m,
                                            gpuipc_pool_kind_name(gpuipc_buffer_get_kind(b->b)),
                                            gpuipc_buffer_is_imported(b->b) ? " imported" : "")
                     : PyUnicode_FromFormat("<gpuipc.Buffer %U closed>", m);
  Py_DECREF(m);
  return o;
}

static PyMethodDef Buffer_methods[] = {
    {"export", (PyCFunction)Buffer_export, METH_NOARGS,
     "export($self, /)\n--\n\n"
     "export() -> (desc bytes, [fd]): the fds are the caller's to close"},
    {"close", (PyCFunction)Buffer_close, METH_NOARGS,
     "close($self, /)\n--\n\nfree / close the buffer"},
    {"share_view", (PyCFunction)Buffer_share_view, METH_O,
     "share_view($self, array, /)\n--\n\n"
     "share_view(array) or share_view((ptr, shape, strides, dtype)) -> desc bytes (as "
     "gpuipc.share(array).desc, for gpuipc.open): an array (or one named by its address, "
     "shape, strides in elements and dtype) inside the allocation this allocated or "
     "wrapped buffer names, exported "
     "without wrapping it (one driver call checks the allocation is still there: "
     "StaleError when it was freed); no fds (NotSupportedError for memory that needs one)"},
    {"free", (PyCFunction)Buffer_close, METH_NOARGS,
     "free($self, /)\n--\n\nfree / close the buffer"},
    {"wrap", (PyCFunction)(void (*)(void))Buffer_wrap, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "wrap($type, /, obj, nbytes=None)\n--\n\n"
     "Buffer.wrap(obj) or Buffer.wrap(ptr, nbytes): memory gpuipc did not allocate"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, /, stream=None, *, max_version=None, dl_device=None, copy=None)\n--\n\nA DLPack capsule of the data (the stream protocol of DLPack: the consumer's stream is ordered after the data's)"},
    {"__dlpack_device__", (PyCFunction)Buffer_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(device_type, device_id) of the data"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Buffer_exit, METH_VARARGS, "__exit__($self, /, *exc)\n--\n\ncloses it"},
    {NULL}};
static PyObject *Buffer_holders(BufferObject *b, void *u) {
  return PyLong_FromUnsignedLong(b->b ? gpuipc_buffer_get_holders(b->b) : 0);
}

static PyGetSetDef Buffer_getset[] = {
    {"ptr", (getter)Buffer_get, NULL, "address of element 0", (void *)0},
    {"holders", (getter)Buffer_holders, NULL,
     "leases peers hold on it (sent with conn.send, not released yet)", NULL},
    {"size", (getter)Buffer_get, NULL, "bytes of the buffer", (void *)1},
    {"kind", (getter)Buffer_get, NULL, NULL, (void *)2},
    {"imported", (getter)Buffer_get, NULL, NULL, (void *)3},
    {"device", (getter)Buffer_get, NULL, "device UUID", (void *)4},
    {"shape", (getter)Buffer_shape, NULL, NULL, NULL},
    {"strides", (getter)Buffer_strides, NULL, NULL, NULL},
    {"dtype", (getter)Buffer_dtype, NULL, NULL, NULL},
    {"__cuda_array_interface__", (getter)Buffer_cai, NULL, NULL, NULL},
    {NULL}};
PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_repr = (reprfunc)Buffer_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Buffer_traverse,
    .tp_clear = (inquiry)Buffer_clear,
    .tp_doc = "A gpuipc buffer: allocated from a Pool, wrapped, or opened from a "
              "descriptor (gpuipc.open).",
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
    .tp_weaklistoffset = offsetof(BufferObject, weak),
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
static int Shared_traverse(SharedObject *s, visitproc visit, void *arg) {
  Py_VISIT(s->desc);
  Py_VISIT(s->fds);
  Py_VISIT(s->buffer);
  return 0;
}
static int Shared_clear(SharedObject *s) {
  Py_CLEAR(s->buffer); /* what can lead back here; the fds stay to close */
  return 0;
}
static void Shared_dealloc(SharedObject *s) {
  PyObject_GC_UnTrack(s);
  PyObject *r = Shared_close(s, NULL);
  Py_XDECREF(r);
  Py_XDECREF(s->fds);
  Py_XDECREF(s->desc);
  PyObject_GC_Del(s);
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
     "close($self, /)\n--\n\n"
     "close the fds and drop the exported buffer (peers that opened it must be done)"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Shared_exit, METH_VARARGS, "__exit__($self, /, *exc)\n--\n\ncloses it"},
    {NULL}};
PyTypeObject SharedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Shared",
    .tp_basicsize = sizeof(SharedObject),
    .tp_dealloc = (destructor)Shared_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Shared_traverse,
    .tp_clear = (inquiry)Shared_clear,
    .tp_doc = "What gpuipc.share() gives: desc (bytes) and fds to carry over any channel; "
              "keep it while peers use the memory.",
    .tp_methods = Shared_methods,
    .tp_members = Shared_members,
};

PyObject *mod_share(PyObject *m, PyObject *args, PyObject *kw) {
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
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[8], nfds = 8;
  gpuipc_status st = gpuipc_buffer_export(b->b, d, sizeof d, &len, fds, &nfds);
  if (st) { Py_DECREF(bufo); return raise_st(st, "share"); }
  SharedObject *s = PyObject_GC_New(SharedObject, &SharedType);
  if (!s) {
    for (int i = 0; i < nfds; i++) close(fds[i]);
    Py_DECREF(bufo);
    return NULL;
  }
  s->desc = gpys_bytes(&b->meta, d, len);
  s->fds = PyTuple_New(nfds);
  for (int i = 0; s->fds && i < nfds; i++) PyTuple_SET_ITEM(s->fds, i, PyLong_FromLong(fds[i]));
  s->buffer = bufo;
  PyObject_GC_Track(s);
  if (!s->desc || !s->fds) { Py_DECREF(s); return NULL; }
  return (PyObject *)s;
}

/* gpuipc.open(), and Connection.open() when conn is not NULL (a
 * descriptor that came over that connection from its peer: checked against
 * the peer's liveness table, accepted from another container when its
 * kind travels by fd). */
PyObject *open_desc(ConnObject *conn, PyObject *args, PyObject *kw) {
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
  if (conn) {
    /* Under g_lock: the connection must not close meanwhile. */
    LOCK();
    st = conn->c ? gpuipc_conn_import_buffer(conn->c, p, len, fds, nfds, &io, &b)
                 : GPUIPC_E_CLOSED;
    UNLOCK();
  } else {
    Py_BEGIN_ALLOW_THREADS
    st = gpuipc_buffer_import(p, len, fds, nfds, &io, &b);
    Py_END_ALLOW_THREADS
  }
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

PyObject *mod_open(PyObject *m, PyObject *args, PyObject *kw) {
  (void)m;
  return open_desc(NULL, args, kw);
}

PyObject *mod_desc_info(PyObject *m, PyObject *args) {
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
  /* synchronize calls in progress without the GIL, and the event a close
   * took from them meanwhile (destroyed when the last one returns). */
  int busy;
  gpuipc_event *closed;
} EventObject;

static PyObject *event_wrap(gpuipc_event *e) {
  EventObject *o = PyObject_New(EventObject, &EventType);
  if (!o) { gpuipc_event_destroy(e); return NULL; }
  o->e = e;
  o->busy = 0;
  o->closed = NULL;
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
  gpuipc_event_destroy(e->closed);
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
  gpuipc_event *ev = e->e;
  gpuipc_status st;
  e->busy++;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_event_synchronize(ev);
  Py_END_ALLOW_THREADS
  if (--e->busy == 0 && e->closed) {
    gpuipc_event_destroy(e->closed);
    e->closed = NULL;
  }
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
  gpuipc_event *ev = e->e;
  e->e = NULL;
  if (ev && e->busy > 0 && !e->closed)
    e->closed = ev; /* a synchronize still uses it: the last one destroys it */
  else
    gpuipc_event_destroy(ev);
  Py_RETURN_NONE;
}
static PyObject *Event_handle(EventObject *e, void *u) {
  if (!ev_alive(e)) return NULL;
  return PyLong_FromUnsignedLongLong((uintptr_t)gpuipc_event_get_handle(e->e));
}
static PyMethodDef Event_methods[] = {
    {"record", (PyCFunction)(void (*)(void))Event_record, METH_VARARGS | METH_KEYWORDS,
     "record($self, /, stream=None)\n--\n\nrecord the event on stream"},
    {"wait", (PyCFunction)(void (*)(void))Event_wait, METH_VARARGS | METH_KEYWORDS,
     "wait($self, /, stream=None)\n--\n\n"
     "wait(stream=None): the stream waits for the last record (no host wait)"},
    {"synchronize", (PyCFunction)Event_synchronize, METH_NOARGS,
     "synchronize($self, /)\n--\n\nblock until complete"},
    {"query", (PyCFunction)Event_query, METH_NOARGS,
     "query($self, /)\n--\n\nTrue when complete"},
    {"export", (PyCFunction)Event_export, METH_NOARGS,
     "export($self, /)\n--\n\ndescriptor bytes (a bearer token)"},
    {"open", (PyCFunction)Event_open, METH_VARARGS | METH_CLASS,
     "open($type, desc, /)\n--\n\nEvent.open(desc) -> Event"},
    {"close", (PyCFunction)Event_close, METH_NOARGS,
     "close($self, /)\n--\n\ndestroy the event"},
    {NULL}};
static PyGetSetDef Event_getset[] = {{"handle", (getter)Event_handle, NULL, "the CUevent", NULL}, {NULL}};
PyTypeObject EventType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Event",
    .tp_basicsize = sizeof(EventObject),
    .tp_dealloc = (destructor)Event_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Event(device=None)\n--\n\nEvent(device=None): an interprocess CUDA event.",
    .tp_methods = Event_methods,
    .tp_getset = Event_getset,
    .tp_new = Event_new,
};

