/*
 * arena.c: Arena and Block (the fast path's memory), and the registry of
 * live blocks that lets conn.send find the block under any array view.
 */
#include "ext.h"

BlockObject *g_blocks; /* registry: which blocks hold an address */

BlockObject *block_find(void *p, size_t n) {
  for (BlockObject *b = g_blocks; b; b = b->reg_next)
    if (b->b && (char *)p >= (char *)b->ptr && (char *)p + n <= (char *)b->ptr + b->size)
      return b;
  return NULL;
}

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

void dead_arenas_retry_locked(void) {
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
      int d;
      if (parse_dtype(dtype, &d) < 0) return NULL;
      meta_bytes1d(&m, nbytes / itemsize(d));
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
     "alloc($self, /, nbytes=None, *, stream=None, shape=None, dtype=None)\n--\n\n"
     "alloc(nbytes=None, *, stream=None, shape=None, dtype=None) -> Block"},
    {"stats", (PyCFunction)Arena_stats, METH_NOARGS,
     "stats($self, /)\n--\n\ncounters as a dict"},
    {"close", (PyCFunction)Arena_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
     "destroy the arena (BusyError while blocks are allocated or held)"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Arena_exit, METH_VARARGS, "__exit__($self, /, *exc)\n--\n\ncloses it"},
    {NULL}};

PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Arena",
    .tp_basicsize = sizeof(ArenaObject),
    .tp_dealloc = (destructor)Arena_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Arena(device=0, chunk_bytes=67108864, max_bytes=0)\n--\n\n"
              "Arena(device=0, chunk_bytes=64 MiB, max_bytes=0): IPC-capable device "
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

static PyObject *Block_repr(BlockObject *b) {
  PyObject *m = meta_repr_part(&b->meta);
  if (!m) return NULL;
  PyObject *o = PyUnicode_FromFormat("<gpuipc.Block %U nbytes=%zu%s>", m, b->size,
                                     b->b ? "" : " freed");
  Py_DECREF(m);
  return o;
}

static PyMethodDef Block_methods[] = {
    {"free", (PyCFunction)(void (*)(void))Block_free, METH_VARARGS | METH_KEYWORDS,
     "free($self, /, stream=None)\n--\n\n"
     "free(stream=None): give the block back (deferred while peers hold it)"},
    {"wait", (PyCFunction)(void (*)(void))Block_wait, METH_VARARGS | METH_KEYWORDS,
     "wait($self, /, stream=None)\n--\n\n"
     "wait(stream=None): order stream after the peers' work before their releases"},
    {"__dlpack__", (PyCFunction)(void (*)(void))Block_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__($self, /, stream=None, *, max_version=None, dl_device=None, copy=None)\n--\n\nA DLPack capsule of the data (the stream protocol of DLPack: the consumer's stream is ordered after the data's)"},
    {"__dlpack_device__", (PyCFunction)Block_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(device_type, device_id) of the data"},
    {"__enter__", gpy_enter, METH_NOARGS, "__enter__($self, /)\n--\n\n"},
    {"__exit__", (PyCFunction)Block_exit, METH_VARARGS, "__exit__($self, /, *exc)\n--\n\nfrees it"},
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
PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_repr = (reprfunc)Block_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block of an Arena (Arena.alloc); freed with free(), its context, or "
              "when the last view of it is gone.",
    .tp_methods = Block_methods,
    .tp_getset = Block_getset,
};

