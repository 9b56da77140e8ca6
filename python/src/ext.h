/*
 * ext.h: what the files of the extension gpuipc._gpuipc share: the module
 * lock and counters, the DLPack structs, the array metadata, the objects
 * more than one file touches, and their functions.
 *
 *   module.c  errors, argument helpers (timeouts, streams, devices), the
 *             module's functions and its initialization
 *   array.c   array metadata (the library's tensor meta), exporting
 *             views (CUDA Array Interface v3, DLPack capsules), reading
 *             foreign arrays (torch, CuPy, cuda.core objects)
 *   torchc.c  torch tensors made in C (DLPack C exchange API, or
 *             torch._C._from_dlpack called from C), torch's streams
 *   conn.c    Listener, Connection, Received; wrapped memory handed to
 *             the library to keep while peers hold it; batches and
 *             broadcast
 *   arena.c   Arena, Block, and the registry of live blocks
 *   buffer.c  Pool, Buffer, share/open, Event
 *   proc.c    Child: the spawn helper
 *   hold.c    HoldLog: the hold table of gpuipc.torch (what a consumer
 *             holds, in shared memory the producer reads)
 *   sets.c    TensorSetC, TensorSetSub, TensorSetVersion, TensorView:
 *             tensor sets (include/gpuipc/sets.h)
 *
 * Threads. Connections and arenas must be used by one thread at a time,
 * and a connection together with the arenas it sends from (progress on a
 * connection processes releases of arena blocks). So every call on a
 * connection, arena or block runs under one module lock, g_lock, held only
 * for calls that do not wait: connections are switched to non-blocking mode
 * and waits happen in one loop (gpy_wait_loop, module.c), in
 * gpuipc_conn_wait (spin, then sleep on the socket), with the GIL and the
 * lock released. A thread holding g_lock never needs the GIL,
 * so taking g_lock with the GIL held cannot deadlock; a call made without
 * the GIL under g_lock therefore lets g_lock go before it takes the GIL
 * back (Py_BEGIN_ALLOW_THREADS, LOCK, call, UNLOCK, Py_END_ALLOW_THREADS). The other fields
 * here (counters, registries) are guarded by the GIL.
 */
#ifndef GPUIPC_PY_EXT_H
#define GPUIPC_PY_EXT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>

#include <errno.h>
#include <stdatomic.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <gpuipc.h>

/* ------------------------------------------------------------------------ */
/* DLPack (dlpack.h, v1.0 layout)                                           */
/* ------------------------------------------------------------------------ */

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 };
/* Type codes (DLDataTypeCode) that typestrs name; the rest map through
 * gpuipc_dtype_to_dlpack / gpuipc_dtype_from_dlpack. */
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLComplex = 5, kDLBool = 6 };

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
/* Module state (module.c)                                                  */
/* ------------------------------------------------------------------------ */

extern PyThread_type_lock g_lock;
#define LOCK() PyThread_acquire_lock(g_lock, WAIT_LOCK)
#define UNLOCK() PyThread_release_lock(g_lock)

extern PyObject *ErrorBase;
extern PyObject *ErrorClass[GPUIPC__STATUS_END];

/* Counters the tests read (gpuipc._gpuipc.counters()). */
struct gpy_counters {
  long long live_received, live_blocks, live_buffers, live_capsule_ctx;
  long long wraps_live, wraps_total, kept;
};
extern struct gpy_counters g_count;

#define MAX_DEV 64

extern PyTypeObject ListenerType, ConnType, ArenaType, BlockType, PoolType, BufferType,
    EventType, ReceivedType, SharedType, ChildType, TSetType, TSubType, TVerType, TViewType,
    HoldLogType;

/* ------------------------------------------------------------------------ */
/* Shared types                                                             */
/* ------------------------------------------------------------------------ */

/* An array's metadata: the C library's tensor meta (gpuipc/tensor.h):
 * dtype (a gpuipc_dtype), ndim, shape, strides in elements (valid when
 * has_strides), offset (bytes from the buffer's start to element 0). */
#define MAXD GPUIPC_TENSOR_NDIM_MAX
typedef gpuipc_tensor_meta ArrMeta;

/* What an exporting object tells the two protocols. */
typedef struct {
  void *base;         /* buffer start; element 0 is base + meta.offset */
  const ArrMeta *meta;
  int dev_type, dev_id;
  uintptr_t stream;   /* the stream its data is ordered on */
  int has_stream;     /* 0: nothing to order (complete data) */
} View;

/* The storage of one exported DLPack tensor: the managed tensor and its
 * shape and strides. Allocated per export, or embedded in the object that
 * owns the memory (a Received), which saves the allocation while one
 * tensor made from it is alive (in_use; guarded by the GIL). */
typedef struct DLBox {
  union {
    DLManagedTensor m;
    DLManagedTensorVersioned v;
  } u;
  int64_t shape[MAXD];
  int64_t strides[MAXD];
  int embedded; /* inside its owner: the deleter frees nothing */
  int in_use;
} DLBox;

typedef struct {
  void *ptr;       /* element 0 */
  size_t nbytes;   /* extent from element 0 */
  ArrMeta meta;    /* offset 0 */
  uintptr_t stream;
  int has_stream;
  PyObject *owner; /* keeps the memory alive: the object or its capsule */
} Foreign;

/* Memory handed over to the library (gpuipc_buffer_release_when_done):
 * what it keeps alive on the Python side until the library calls back
 * (any thread, no GIL: kept_done only queues it; flush_decrefs drops the
 * references, with the GIL). */
typedef struct Tally {
  _Atomic long pending; /* wrapped sends of a connection not done yet */
  _Atomic long refs;
} Tally;

typedef struct Kept {
  struct Kept *next;
  PyObject *ref[2]; /* the memory's owner; a Buffer's pool */
  Tally *tally;     /* the connection's count (NULL: none) */
  int wrapped;      /* counted in g_count.wraps_live */
} Kept;

typedef struct {
  PyObject_HEAD
  gpuipc_conn *c;
  int timeout_ms;      /* default limit of waiting calls (-1 forever) */
  unsigned max_outstanding;
  int borrowed;        /* owned by a Child: never closed here */
  int peer_pid;
  Tally *tally;        /* wrapped sends the library still keeps */
  int tset_refs;       /* tensor sets and subscribers using it: no close */
  /* What was received over it and may still be read: Received objects not
   * released, subscribers closed here whose versions still have views.
   * A close while any is left only hides the connection (c NULL) and keeps
   * it open in `linger`, so that its imports stay mapped; the last of them
   * to go closes it (conn_held_drop). */
  Py_ssize_t held;
  gpuipc_conn *linger;
  PyObject *weak;
  int spin_us;   /* spin_us= given where it was made, else -1 (the default) */
  int torch_dev; /* recv(as_torch=True): the device the last buffer was on */
} ConnObject;

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

struct BufferObject {
  PyObject_HEAD
  gpuipc_buffer *b;
  PyObject *pool;  /* allocated from it */
  PyObject *owner; /* wrapped: the object owning the memory */
  int imported;
  uintptr_t stream;
  int has_stream;
  ArrMeta meta;
  PyObject *weak; /* weak references (weakref.finalize of an opened buffer) */
  struct HoldRef *hold; /* hold.c: a hold table's entry, released with it */
};

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
    const char *n = dtype_name((M)->dtype);                                    \
    return PyUnicode_FromString(n ? n : gpuipc_dtype_name((M)->dtype));        \
  }

/* ------------------------------------------------------------------------ */
/* Functions                                                                */
/* ------------------------------------------------------------------------ */

static inline struct CUstream_st *S(uintptr_t s) { return (struct CUstream_st *)s; }
/* The stream a protocol reports for a handle: legacy -> 1. */
static inline long long stream_report(uintptr_t s) { return s == 0 ? 1 : (long long)s; }

/* module.c */
PyObject *raise_msg(gpuipc_status st, const char *what, const char *detail);
PyObject *raise_st(gpuipc_status st, const char *what);
int64_t now_ms(void);
int parse_timeout(PyObject *o, int dflt, int *out);
int parse_stream(PyObject *o, uintptr_t *out);
int order_streams(int dev, uintptr_t from, uintptr_t to);
PyObject *uuid_str(const gpuipc_uuid *u);
int parse_uuid(PyObject *o, gpuipc_uuid *u, int *have);
int ordinal_of(const gpuipc_uuid *u);
int64_t now_us(void);

/* The one wait loop of the package (module.c). A call that may wait runs
 * try_ (GIL held; it takes g_lock around its library call, which never
 * waits) until it says something other than GPUIPC_E_WOULD_BLOCK; in
 * between, sleep (GIL held on entry and exit: it releases the GIL itself,
 * and the lock is not held) waits at most one slice of GPY_SLICE_MS for
 * events, spinning first for spin_us. One deadline, taken at entry
 * (timeout_ms -1: none). Signals are handled between slices. *st: the
 * status of the last attempt, GPUIPC_E_TIMEOUT once the deadline passed,
 * or the error of a wait after which the attempt still could not
 * proceed. Returns 0, or -1 with an exception set (try_ or sleep returned
 * GPY_RAISED, a signal handler raised). */
#define GPY_RAISED ((gpuipc_status)(GPUIPC__STATUS_END + 1))
#define GPY_SLICE_MS 50
/* The binding's default spin before a call that may wait sleeps, for
 * connections whose spin_us was not given (see docs/python.md). */
#define GPY_DEFAULT_SPIN_US 50
typedef gpuipc_status (*gpy_try)(void *ctx);
typedef gpuipc_status (*gpy_sleep)(void *ctx, short events, int timeout_ms, int spin_us);
int gpy_wait_loop(int timeout_ms, short events, int spin_us, gpy_try try_, gpy_sleep sleep,
                  void *ctx, gpuipc_status *st);
/* poll(2) on fd, or on n descriptors (n 0: a sleep), without the GIL,
 * spinning first (what a gpy_sleep for what is no connection calls). */
gpuipc_status gpy_poll_fd(int fd, short events, int timeout_ms, int spin_us);
gpuipc_status gpy_poll_fds(struct pollfd *p, nfds_t n, int timeout_ms, int spin_us);
/* Vectorcall (METH_FASTCALL | METH_KEYWORDS) arguments into out[nnames]:
 * positional ones first (npos_min to npos_max of them), then keywords by
 * name; what is not given stays NULL. -1 with a TypeError naming fn. */
int gpy_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
             Py_ssize_t npos_min, Py_ssize_t npos_max, const char *const *names,
             Py_ssize_t nnames, PyObject **out);
/* TimeoutError for a call told not to wait that found nothing (no
 * formatting per miss). what: a string literal. Returns NULL. */
PyObject *raise_miss(const char *what);
PyObject *gpy_enter(PyObject *s, PyObject *unused);
/* Py_XDECREF later, by flush_decrefs() (GIL held, g_lock not held): for
 * references dropped while g_lock is held. */
void defer_decref(PyObject *o);
/* Also drops what the library is done with (kept_done's queue). */
void flush_decrefs(void);
/* A node for gpuipc_buffer_release_when_done (GIL held): takes the
 * references given (NULLs allowed), counts itself in tally; NULL with
 * MemoryError set. kept_done is the callback (any thread, no GIL). */
Kept *kept_new(PyObject *ref0, PyObject *ref1, Tally *tally, int wrapped);
void kept_done(void *ctx);
/* A node never handed over: undone (GIL held, lock not held). */
void kept_undo(Kept *k);
Tally *tally_new(void);
void tally_unref(Tally *t);

/* array.c */
void meta_bytes1d(ArrMeta *m, size_t n);
size_t itemsize(int dtype);
int meta_contiguous(const ArrMeta *m);
size_t meta_extent(const ArrMeta *m);
void meta_fill_strides(const ArrMeta *m, int64_t *out);
int meta_encode(const ArrMeta *m, const uint8_t *user, size_t ulen, uint8_t *out, size_t *len);
void meta_decode(const uint8_t *in, size_t len, size_t length, ArrMeta *m,
                 const uint8_t **user, size_t *ulen);
const char *dtype_name(int dtype);
int parse_dtype(PyObject *o, int *dtype);
int meta_from_shape(PyObject *shape, PyObject *dtype, size_t *nbytes, ArrMeta *m);
PyObject *shape_tuple(const int64_t *v, int n);
PyObject *cai_dict(const View *v);
PyObject *dlpack_export(PyObject *owner, const View *v, PyObject *args, PyObject *kw);
PyObject *dlpack_device(const View *v);
/* __dlpack__ as METH_FASTCALL | METH_KEYWORDS, exporting into box (an
 * embedded one, used when free) or a new allocation (box NULL or busy). */
PyObject *dlpack_export_fast(PyObject *owner, const View *v, DLBox *box,
                             PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
/* The pieces: a box (embedded when free, else allocated; NULL with
 * MemoryError); filled for v, holding a reference to owner that its
 * deleter drops (the DLPack 1.x versioned layout or the legacy one); a
 * capsule owning it (on failure the tensor is deleted here). No stream is
 * ordered by these. */
DLBox *dlbox_take(DLBox *embedded);
void dl_fill(DLBox *b, PyObject *owner, const View *v, int dev_type, int versioned);
PyObject *dl_capsule(DLBox *b, int versioned);

/* dlpack.h 1.3's DLPackExchangeAPI: a table of C functions a framework
 * puts on its tensor type as a PyCapsule named "dlpack_exchange_api"
 * (attribute __dlpack_c_exchange_api__; torch releases before the name
 * settled used __c_dlpack_exchange_api__, a capsule or an int). Major
 * version 1 only. Used here: dltensor_from_py_object_no_sync (a
 * non-owning DLTensor of a tensor, no Python call, no stream work),
 * managed_tensor_to_py_object_no_sync (a tensor of our DLPack tensor) and
 * current_work_stream (the framework's current stream as a raw handle). */
typedef struct DLXHeader {
  DLPackVersion version;
  struct DLXHeader *prev_api;
} DLXHeader;
typedef struct {
  DLXHeader header;
  void *managed_tensor_allocator;
  int (*managed_tensor_from_py_object_no_sync)(void *py, DLManagedTensorVersioned **out);
  int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *t, void **out);
  int (*dltensor_from_py_object_no_sync)(void *py, DLTensor *out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out);
} DLXApi;

/* torchc.c: torch looked up once, for the package (recv(as_torch=True),
 * the sets' torch views and their reading of torch tensors).
 * dlx_api_of: the exchange API a type (or object) carries, NULL (no
 * exception) when none or not one this code speaks (major version 1, with
 * managed_tensor_to_py_object_no_sync and current_work_stream; its
 * dltensor_from_py_object_no_sync may be NULL). torch_lookup: 1 once
 * torch is ready (what the calls below use is looked up: the tensor type,
 * its exchange API unless GPUIPC_TORCH_EXCHANGE=0, else
 * torch._C._from_dlpack and _cuda_getCurrentRawStream); 0 when torch is
 * not imported and import is 0; -1 with an exception. torch_ready: the
 * same, importing, 0 or -1 with an ImportError saying that as_torch needs
 * torch. The others need it done. */
const DLXApi *dlx_api_of(PyObject *holder);
int torch_lookup(int import);
int torch_ready(void);
/* torch's exchange API (NULL: the _from_dlpack way), its Tensor type, and
 * torch._C._from_dlpack(cap). */
const DLXApi *torch_api(void);
PyTypeObject *torch_tensor_type(void);
PyObject *torch_from_capsule(PyObject *cap);
/* The current stream of device dev, as a raw CUstream (0: the legacy
 * default stream), through api's current_work_stream, or torch's
 * (_cuda_getCurrentRawStream) when api is NULL. */
int dlx_current_stream(const DLXApi *api, int dev, uintptr_t *out);
/* 1 when torch's DLPack C exchange API is used, 0 when torch._C._from_dlpack. */
int torch_uses_exchange(void);
int torch_current_device(int *dev);
/* torch's current stream on device dev, as a raw CUstream (0: the legacy
 * default stream, torch's default). */
int torch_current_stream(int dev, uintptr_t *out);
/* A torch tensor viewing v, owning a reference to owner (its deleter
 * drops it); box as for dlpack_export_fast. No stream is ordered. */
PyObject *torch_tensor(PyObject *owner, const View *v, DLBox *box);
int foreign_get(PyObject *obj, uintptr_t stream, Foreign *f);
PyObject *meta_repr_part(const ArrMeta *m);

/* conn.c */
PyObject *conn_new(gpuipc_conn *gc, int timeout_ms, unsigned maxo, int borrowed);
/* Runs op (under the lock, never waiting) until it does not say
 * WOULD_BLOCK, waiting on the socket in between without the GIL or the
 * lock; *st gets its status (E_TIMEOUT once the limit passed). -1 with an
 * exception set (closed here, a signal), else 0. */
typedef gpuipc_status (*conn_op)(ConnObject *c, void *ctx);
int conn_run(ConnObject *c, int timeout_ms, int want_out, conn_op op, void *ctx,
             gpuipc_status *st);
/* conn_run with the spin given (conn_run: the connection's). */
int conn_run_spin(ConnObject *c, int timeout_ms, int spin_us, int want_out, conn_op op,
                  void *ctx, gpuipc_status *st);
void conn_detach(ConnObject *c);
/* The C connection received buffers are released on: the open one, or the
 * one a close left open for them (NULL when neither). */
gpuipc_conn *conn_rx(ConnObject *c);
/* One of c->held is gone (GIL held, g_lock not): the last closes a
 * connection closed here meanwhile. */
void conn_held_drop(ConnObject *c);
/* carrier=, spin_us=, polling= into o (NULL or None: the default); -1 with
 * a TypeError or ValueError that names the keyword. */
int parse_carrier_opts(PyObject *carrier, PyObject *spin_us, PyObject *polling,
                       gpuipc_conn_options *o);
PyObject *mod_listen(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_connect(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_from_fd(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_conn_pair(PyObject *m, PyObject *u);
PyObject *mod_spawn_connection(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_release_batch(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_broadcast(PyObject *m, PyObject *args, PyObject *kw);

/* arena.c */
BlockObject *block_find(void *p, size_t n);

/* buffer.c */
View buf_view(BufferObject *b);
PyObject *mod_share(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mod_open(PyObject *m, PyObject *args, PyObject *kw);
PyObject *open_desc(ConnObject *conn, PyObject *args, PyObject *kw);
PyObject *mod_desc_info(PyObject *m, PyObject *args);

/* sets.c */
/* Lets go of what uses c (a connection's __exit__): closes the subscribers
 * opened on it, ends the sets' subscriptions of it (each waiting up to its
 * set's timeout). -1 with an exception set (a signal). */
int sets_let_go(ConnObject *c);
/* Adds the types of sets.c the module does not list (CopyPlan). */
int sets_init(PyObject *m);
/* hold.c: writes the RELEASE of a held buffer (its Buffer goes; GIL held)
 * and frees r. */
struct HoldRef;
void hold_release(struct HoldRef *r);

/* proc.c */
PyObject *mod_spawn(PyObject *m, PyObject *args, PyObject *kw);

#endif /* GPUIPC_PY_EXT_H */
