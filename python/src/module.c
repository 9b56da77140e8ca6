/*
 * module.c: the module gpuipc._gpuipc itself: errors raised as gpuipc.Error
 * subclasses named after the status codes, with the library's message; the
 * helpers every object uses (timeouts, streams, devices, waiting on a
 * socket without the GIL); the module's functions and its initialization.
 */
#include "ext.h"

/* ------------------------------------------------------------------------ */
/* Module state                                                             */
/* ------------------------------------------------------------------------ */

PyThread_type_lock g_lock;
PyObject *ErrorBase;
PyObject *ErrorClass[GPUIPC__STATUS_END];
struct gpy_counters g_count;

/* Events used to order one stream after another (per device ordinal). */
static gpuipc_event *g_sync_event[MAX_DEV];

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

/* Raises the class of status st with the library's message. Call right
 * after the failing call, on the same thread. */
PyObject *raise_msg(gpuipc_status st, const char *what, const char *detail) {
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

PyObject *raise_st(gpuipc_status st, const char *what) {
  return raise_msg(st, what, gpuipc_last_error());
}

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* timeout object: NULL -> dflt, None -> -1 (forever), seconds -> ms. */
int parse_timeout(PyObject *o, int dflt, int *out) {
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
 * __cuda_stream__() (cuda.core), .cuda_stream (torch), .ptr (CuPy) or
 * .handle. Which of those a type has is looked up once per type (a torch
 * Stream then costs one attribute read, not four probes). */
enum { SK_NONE, SK_PROTO, SK_CUDA_STREAM, SK_PTR, SK_HANDLE };
#define STREAM_TYPES 8
static struct { PyTypeObject *t; int kind; } g_stream_types[STREAM_TYPES];
static int g_nstream_types;

static int stream_kind(PyObject *o) {
  PyTypeObject *t = Py_TYPE(o);
  for (int i = 0; i < g_nstream_types; i++)
    if (g_stream_types[i].t == t) return g_stream_types[i].kind;
  int k = SK_NONE;
  if (PyObject_HasAttrString(o, "__cuda_stream__")) k = SK_PROTO;
  else if (PyObject_HasAttrString(o, "cuda_stream")) k = SK_CUDA_STREAM;
  else if (PyObject_HasAttrString(o, "ptr")) k = SK_PTR;
  else if (PyObject_HasAttrString(o, "handle")) k = SK_HANDLE;
  /* Only heap types go away; keep them alive while cached. */
  if (k != SK_NONE && g_nstream_types < STREAM_TYPES) {
    Py_INCREF(t);
    g_stream_types[g_nstream_types].t = t;
    g_stream_types[g_nstream_types++].kind = k;
  }
  return k;
}

int parse_stream(PyObject *o, uintptr_t *out) {
  *out = 0;
  if (o == NULL || o == Py_None) return 0;
  PyObject *v = NULL;
  if (PyLong_CheckExact(o)) {
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (u == 1) ? 0 : (uintptr_t)u;
    return 0;
  }
  if (PyLong_Check(o)) {
    v = o;
    Py_INCREF(v);
  } else {
    switch (stream_kind(o)) {
    case SK_PROTO: {
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
      break;
    }
    case SK_CUDA_STREAM: v = PyObject_GetAttrString(o, "cuda_stream"); break;
    case SK_PTR: v = PyObject_GetAttrString(o, "ptr"); break;
    case SK_HANDLE: v = PyObject_GetAttrString(o, "handle"); break;
    default:
      if (PyErr_Occurred()) return -1;
      PyErr_Format(PyExc_TypeError, "not a stream: %R (give an int CUstream, a "
                   "torch/CuPy/cuda.core stream, or None)", o);
      return -1;
    }
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

/* Orders stream `to` after the work queued on `from` (device ordinal dev). */
int order_streams(int dev, uintptr_t from, uintptr_t to) {
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

PyObject *uuid_str(const gpuipc_uuid *u) {
  char buf[GPUIPC_UUID_STRLEN];
  gpuipc_uuid_format(u, buf);
  return PyUnicode_FromString(buf);
}

int parse_uuid(PyObject *o, gpuipc_uuid *u, int *have) {
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

int ordinal_of(const gpuipc_uuid *u) {
  int ord = 0;
  if (gpuipc_device_from_uuid(u, &ord) != GPUIPC_OK) return 0;
  return ord;
}

int64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* ------------------------------------------------------------------------ */
/* The one wait loop                                                        */
/* ------------------------------------------------------------------------ */

/* Every call of the package that may wait runs here (see ext.h): one
 * deadline taken at entry; the attempt with the GIL (it takes g_lock for
 * its library call, which never waits); on WOULD_BLOCK one wait of at
 * most GPY_SLICE_MS, which releases the GIL itself (the connection's
 * gpuipc_conn_wait: spin, then sleep on the socket), and the signal
 * handlers between slices, so that Ctrl-C interrupts a wait of any
 * length. The spin is spent only on a wait that follows an attempt right
 * after something happened (the call's first, or one after a wake-up), not
 * after a slice that timed out. A wait that says "ready" for POLLOUT alone
 * while the attempt still cannot proceed (a send that waits for a free
 * slot, not for room in the socket) is followed by one wait for POLLIN of
 * at most 1 ms, so that such a send looks again now and then without
 * spinning on a socket that is always writable. */
int gpy_wait_loop(int timeout_ms, short events, int spin_us, gpy_try try_, gpy_sleep sleep,
                  void *ctx, gpuipc_status *st) {
  int64_t deadline = timeout_ms < 0 ? -1 : now_us() + (int64_t)timeout_ms * 1000;
  int spin = spin_us, backoff = 0;
  gpuipc_status werr = GPUIPC_OK;
  for (;;) {
    *st = try_(ctx);
    if (*st == GPY_RAISED) return -1;
    if (*st != GPUIPC_E_WOULD_BLOCK) return 0;
    if (werr != GPUIPC_OK) { /* the wait failed and the call still cannot proceed */
      *st = werr;
      return 0;
    }
    int slice = GPY_SLICE_MS;
    if (deadline >= 0) {
      int64_t left = deadline - now_us();
      if (left <= 0) {
        *st = GPUIPC_E_TIMEOUT;
        return 0;
      }
      if (left < (int64_t)slice * 1000) {
        slice = (int)((left + 999) / 1000);
        if (spin > left) spin = (int)left;
      }
    }
    short ev = events;
    if (backoff) {
      ev = (short)(events & ~POLLOUT);
      if (slice > 1) slice = 1;
    }
    gpuipc_status w = sleep(ctx, ev, slice, spin);
    if (w == GPY_RAISED) return -1;
    if (PyErr_CheckSignals() < 0) return -1;
    if (w == GPUIPC_OK) {
      spin = spin_us;
      backoff = (events & POLLOUT) && !backoff;
    } else if (w == GPUIPC_E_TIMEOUT) {
      spin = 0;
      backoff = 0;
    } else {
      werr = w;
    }
  }
}

/* Waits without the GIL until one of the n descriptors of p is ready for
 * its events or timeout_ms passed, looking for spin_us first without
 * sleeping: GPUIPC_OK (ready, or a signal came: look again),
 * GPUIPC_E_TIMEOUT, GPUIPC_E_SYSTEM when poll fails (errno kept). With
 * n 0 it sleeps timeout_ms. For what has no gpuipc_conn_wait (a listener,
 * a tensor set's connections). */
gpuipc_status gpy_poll_fds(struct pollfd *p, nfds_t n, int timeout_ms, int spin_us) {
  int r, err = 0;
  Py_BEGIN_ALLOW_THREADS
  r = 0;
  if (spin_us > 0 && n > 0) {
    int64_t end = now_us() + spin_us;
    do {
      r = poll(p, n, 0);
    } while (r == 0 && now_us() < end);
  }
  if (r == 0) r = poll(n ? p : NULL, n, timeout_ms);
  err = errno;
  Py_END_ALLOW_THREADS
  if (r > 0 || (r < 0 && err == EINTR)) return GPUIPC_OK;
  if (r == 0) return GPUIPC_E_TIMEOUT;
  errno = err;
  return GPUIPC_E_SYSTEM;
}

/* gpy_poll_fds on one descriptor; GPUIPC_E_CLOSED for no fd. */
gpuipc_status gpy_poll_fd(int fd, short events, int timeout_ms, int spin_us) {
  if (fd < 0) return GPUIPC_E_CLOSED;
  struct pollfd p = {.fd = fd, .events = events};
  return gpy_poll_fds(&p, 1, timeout_ms, spin_us);
}

/* ------------------------------------------------------------------------ */
/* Vectorcall arguments                                                     */
/* ------------------------------------------------------------------------ */

int gpy_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
             Py_ssize_t npos_min, Py_ssize_t npos_max, const char *const *names, Py_ssize_t nnames,
             PyObject **out) {
  for (Py_ssize_t i = 0; i < nnames; i++) out[i] = NULL;
  if (nargs < npos_min || nargs > npos_max) {
    if (npos_max == 0)
      PyErr_Format(PyExc_TypeError, "%s() takes no positional arguments (%zd given)", fn, nargs);
    else if (nargs < npos_min)
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn,
                   names[nargs]);
    else
      PyErr_Format(PyExc_TypeError, "%s() takes at most %zd positional argument%s (%zd "
                   "given)", fn, npos_max, npos_max == 1 ? "" : "s", nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
  Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nk; k++) {
    PyObject *key = PyTuple_GET_ITEM(kwnames, k);
    Py_ssize_t i = 0;
    for (; i < nnames; i++)
      if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) break;
    if (i == nnames) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
      return -1;
    }
    if (out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn,
                   names[i]);
      return -1;
    }
    out[i] = args[nargs + k];
  }
  for (Py_ssize_t i = nargs; i < npos_min; i++)
    if (!out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
      return -1;
    }
  return 0;
}

/* A TimeoutError for a call that found nothing ready and was not to wait
 * (timeout=0): the same class and attributes as raise_msg gives, from
 * objects made once per message, so that a polling loop pays for no
 * formatting. what: a string literal (the cache is keyed by its address). */
PyObject *raise_miss(const char *what) {
  static struct { const char *what; PyObject *msg; } cache[8];
  static PyObject *code, *name, *det;
  PyObject *msg = NULL;
  int i = 0;
  for (; i < 8 && cache[i].what; i++)
    if (cache[i].what == what) { msg = cache[i].msg; break; }
  if (!msg) {
    msg = PyUnicode_FromFormat("%s: %s (nothing ready, and timeout=0)", what,
                               gpuipc_strerror(GPUIPC_E_TIMEOUT));
    if (!msg) return NULL;
    if (i < 8) { /* the cache keeps one reference */
      cache[i].what = what;
      cache[i].msg = msg;
      Py_INCREF(msg);
    }
  } else {
    Py_INCREF(msg);
  }
  if (!code) code = PyLong_FromLong(GPUIPC_E_TIMEOUT);
  if (!name) name = PyUnicode_FromString(gpuipc_status_name(GPUIPC_E_TIMEOUT));
  if (!det) det = PyUnicode_FromString("nothing ready, and timeout=0");
  PyObject *exc = PyObject_CallOneArg(ErrorClass[GPUIPC_E_TIMEOUT], msg);
  Py_DECREF(msg);
  if (!exc) return NULL;
  if (code && name && det) {
    PyObject_SetAttrString(exc, "status", code);
    PyObject_SetAttrString(exc, "status_name", name);
    PyObject_SetAttrString(exc, "detail", det);
  }
  PyErr_SetObject(ErrorClass[GPUIPC_E_TIMEOUT], exc);
  Py_DECREF(exc);
  return NULL;
}

/* References dropped under g_lock, released after it (GIL-guarded). */
static PyObject **g_drops;
static size_t g_ndrops, g_capdrops;

void defer_decref(PyObject *o) {
  if (!o) return;
  if (g_ndrops == g_capdrops) {
    size_t c = g_capdrops ? 2 * g_capdrops : 64;
    PyObject **n = PyMem_Realloc(g_drops, c * sizeof *n);
    if (!n) {
      /* Out of memory: keep the reference (a leak) rather than risk
       * running Python code under the lock. */
      return;
    }
    g_drops = n;
    g_capdrops = c;
  }
  g_drops[g_ndrops++] = o;
}

/* What the library is done with (gpuipc_buffer_release_when_done's
 * callback, on any thread, without the GIL): a lock-free stack, taken
 * whole by the next flush_decrefs. */
static _Atomic(Kept *) g_kept_done;

Tally *tally_new(void) {
  Tally *t = PyMem_RawMalloc(sizeof *t);
  if (!t) return NULL;
  atomic_init(&t->pending, 0);
  atomic_init(&t->refs, 1);
  return t;
}

void tally_unref(Tally *t) {
  if (t && atomic_fetch_sub(&t->refs, 1) == 1) PyMem_RawFree(t);
}

Kept *kept_new(PyObject *ref0, PyObject *ref1, Tally *tally, int wrapped) {
  Kept *k = PyMem_RawMalloc(sizeof *k);
  if (!k) { PyErr_NoMemory(); return NULL; }
  k->next = NULL;
  k->ref[0] = ref0;
  k->ref[1] = ref1;
  Py_XINCREF(ref0);
  Py_XINCREF(ref1);
  k->tally = tally;
  if (tally) {
    atomic_fetch_add(&tally->refs, 1);
    atomic_fetch_add(&tally->pending, 1);
  }
  k->wrapped = wrapped;
  g_count.kept++;
  return k;
}

/* No GIL, maybe no Python thread state, maybe the library's watcher
 * thread: atomics only. */
void kept_done(void *ctx) {
  Kept *k = ctx;
  if (k->tally) atomic_fetch_sub(&k->tally->pending, 1);
  Kept *head = atomic_load(&g_kept_done);
  do k->next = head;
  while (!atomic_compare_exchange_weak(&g_kept_done, &head, k));
}

static void kept_drop(Kept *k) {
  Py_XDECREF(k->ref[0]);
  Py_XDECREF(k->ref[1]);
  tally_unref(k->tally);
  if (k->wrapped) g_count.wraps_live--;
  g_count.kept--;
  PyMem_RawFree(k);
}

void kept_undo(Kept *k) {
  if (k->tally) atomic_fetch_sub(&k->tally->pending, 1);
  kept_drop(k);
}

void flush_decrefs(void) {
  for (;;) {
    while (g_ndrops) {
      PyObject *o = g_drops[--g_ndrops];
      Py_DECREF(o); /* may defer more: the loop takes them too */
    }
    Kept *k = atomic_exchange(&g_kept_done, NULL);
    if (!k) break;
    while (k) { /* each drop may run any Python code */
      Kept *n = k->next;
      kept_drop(k);
      k = n;
    }
  }
}

/* __enter__ of every object here: the object itself. */
PyObject *gpy_enter(PyObject *s, PyObject *unused) {
  Py_INCREF(s);
  return s;
}

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
  PyObject *d = Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "hits", (unsigned long long)s.hits,
                       "misses", (unsigned long long)s.misses, "stale",
                       (unsigned long long)s.stale, "driver_opens",
                       (unsigned long long)s.driver_opens, "driver_closes",
                       (unsigned long long)s.driver_closes, "live_mappings",
                       (unsigned long long)s.live_mappings, "pool_imports",
                       (unsigned long long)s.pool_imports, "pool_hits",
                       (unsigned long long)s.pool_hits);
  PyObject *l = d ? Py_BuildValue("{s:K,s:K,s:K,s:K}", "linger_kept",
                                  (unsigned long long)s.linger_kept, "linger_hits",
                                  (unsigned long long)s.linger_hits, "linger_drops",
                                  (unsigned long long)s.linger_drops, "idle_mappings",
                                  (unsigned long long)s.idle_mappings)
                  : NULL;
  if (!l || PyDict_Update(d, l) < 0) {
    Py_XDECREF(l);
    Py_XDECREF(d);
    return NULL;
  }
  Py_DECREF(l);
  return d;
}
static PyObject *mod_cache_trim(PyObject *m, PyObject *u) {
  gpuipc_status st;
  Py_BEGIN_ALLOW_THREADS
  st = gpuipc_cache_trim();
  Py_END_ALLOW_THREADS
  if (st) return raise_st(st, "cache_trim");
  Py_RETURN_NONE;
}
static PyObject *mod_counters(PyObject *m, PyObject *u) {
  flush_decrefs(); /* what the library finished meanwhile (its watcher) */
  return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:L,s:L}", "received", g_count.live_received,
                       "blocks", g_count.live_blocks, "buffers", g_count.live_buffers,
                       "capsule_refs", g_count.live_capsule_ctx, "wraps", g_count.wraps_live,
                       "wraps_total", g_count.wraps_total, "kept", g_count.kept);
}
static PyObject *mod_collect(PyObject *m, PyObject *u) {
  /* The library's: leases of closed connections whose peers are gone,
   * arenas given up that drained (their callbacks queue, flushed here). */
  Py_BEGIN_ALLOW_THREADS
  LOCK();
  (void)gpuipc_conn_collect();
  UNLOCK();
  Py_END_ALLOW_THREADS
  flush_decrefs();
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
    /* Docstrings open with their signature ("name(...)\n--\n\n": CPython's
     * __text_signature__ convention, which inspect.signature reads). */
    {"init", mod_init, METH_NOARGS, "init()\n--\n\nload and initialize the CUDA driver (cuInit)"},
    {"version", mod_version, METH_NOARGS, "version()\n--\n\nthe C library's version"},
    {"driver_path", mod_driver_path, METH_NOARGS,
     "driver_path()\n--\n\nthe path of the CUDA driver library loaded"},
    {"driver_version", mod_driver_version, METH_NOARGS,
     "driver_version()\n--\n\nthe CUDA driver's version (cuDriverGetVersion)"},
    {"device_count", mod_device_count, METH_NOARGS,
     "device_count()\n--\n\nthe number of devices visible in this process"},
    {"device_uuid", mod_device_uuid, METH_VARARGS,
     "device_uuid(ordinal=0, /)\n--\n\ndevice_uuid(ordinal=0) -> 'GPU-...'"},
    {"device_from_uuid", mod_device_from_uuid, METH_VARARGS,
     "device_from_uuid(uuid, /)\n--\n\nthe local ordinal of the device named by uuid"},
    {"listen", (PyCFunction)(void (*)(void))mod_listen, METH_VARARGS | METH_KEYWORDS,
     "listen(name, *, timeout=10, abstract=False, runtime_dir=None, allow_uids=(), "
     "allow_gids=(), max_outstanding=256, order='memop', carrier='auto', spin_us=0, "
     "polling=False)\n--\n\n"
     "listen(name, *, timeout=10, abstract=False, runtime_dir=None, allow_uids=(), "
     "allow_gids=(), max_outstanding=256, order='memop', carrier='auto', spin_us=0, "
     "polling=False) -> Listener (connections it accepts take its options). carrier: "
     "'auto' (a shared-memory ring beside the socket where the peer has it, else the "
     "socket; the environment's GPUIPC_CARRIER decides), 'socket', or 'ring' (a peer "
     "without it is refused); spin_us: ring carrier, how long a waiting call looks at "
     "the ring before it sleeps (0 to 1000000); polling: as Connection.set_polling"},
    {"connect", (PyCFunction)(void (*)(void))mod_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(name, *, timeout=10, abstract=False, runtime_dir=None, allow_uids=(), "
     "allow_gids=(), max_outstanding=256, order='memop', carrier='auto', spin_us=0, "
     "polling=False)\n--\n\nconnect(name, *, timeout=10, ...) -> Connection"},
    {"from_fd", (PyCFunction)(void (*)(void))mod_from_fd, METH_VARARGS | METH_KEYWORDS,
     "from_fd(fd, *, timeout=10, abstract=False, runtime_dir=None, allow_uids=(), "
     "allow_gids=(), max_outstanding=256, order='memop', carrier='auto', spin_us=0, "
     "polling=False)\n--\n\nfrom_fd(fd, *, timeout=10, ...) -> Connection (takes the fd)"},
    {"conn_pair", mod_conn_pair, METH_NOARGS,
     "conn_pair()\n--\n\nconn_pair() -> (fd, fd), close-on-exec"},
    {"spawn_connection", (PyCFunction)(void (*)(void))mod_spawn_connection,
     METH_VARARGS | METH_KEYWORDS, "spawn_connection(*, timeout=10)\n--\n\n"
     "in a spawned child: -> (Connection, n_pools, n_buffers)"},
    {"spawn_child", (PyCFunction)(void (*)(void))mod_spawn, METH_VARARGS | METH_KEYWORDS,
     "spawn_child(path, argv, *, env_add=None, timeout=30, search_path=False, "
     "carrier=None, spin_us=None, polling=None)\n--\n\n"
     "spawn_child(path, argv, *, env_add=None, timeout=30, search_path=False, "
     "carrier=None, spin_us=None, polling=None) -> Child"},
    {"release_batch", (PyCFunction)(void (*)(void))mod_release_batch,
     METH_VARARGS | METH_KEYWORDS,
     /* stream left out: each one's receive stream (None: the legacy stream), so
      * the signature's default is `...` (left out) */
     "release_batch(received, stream=...)\n--\n\n"
     "release_batch(received, stream=<each one's receive stream>): give back many "
     "Received at once (gpuipc_conn_release_batch per connection, BATCH_MAX at a "
     "time), after the work queued on stream, by default on each connection's first "
     "buffer's receive stream ordered after the others' (what each .release() waits "
     "for). All or nothing: an item that is not a Received, was released already, "
     "is named twice (TypeError/ValueError naming its index) releases nothing; on "
     "success each one is released (held False, its views invalid). A library error "
     "(rare: the driver) stops at that connection: what was released before is "
     "released, the rest still held (see .held)."},
    {"broadcast", (PyCFunction)(void (*)(void))mod_broadcast, METH_VARARGS | METH_KEYWORDS,
     "broadcast(conns, block, *, stream=None, meta=None, timeout=None)\n--\n\n"
     "broadcast(conns, block, *, stream=None, meta=None, timeout=...) -> list: send one "
     "arena block (a Block, or an array inside one) to every connection as one "
     "operation (one ready signal for those ready), each peer holding its own lease. "
     "Returns, "
     "per connection, None (sent) or the gpuipc.Error it failed with (PeerGoneError, "
     "TimeoutError, ClosedError...): a failing connection does not stop the others. A "
     "connection not ready (no free slot) is waited for, up to timeout (default: its "
     "own timeout), and sent to when ready. Raises only when nothing can be sent to "
     "any (bad arguments: not Connections, one twice, a block that is not arena "
     "memory or was freed)."},
    {"share", (PyCFunction)(void (*)(void))mod_share, METH_VARARGS | METH_KEYWORDS,
     "share(obj)\n--\n\nshare(obj) -> Shared (desc bytes + fds)"},
    {"open", (PyCFunction)(void (*)(void))mod_open, METH_VARARGS | METH_KEYWORDS,
     "open(desc, fds=(), *, device=None, pidfd_getfd=False)\n--\n\n"
     "open(desc, fds=(), *, device=None, pidfd_getfd=False) -> Buffer"},
    {"desc_info", mod_desc_info, METH_VARARGS,
     "desc_info(desc, /)\n--\n\nwhat a descriptor says, as a dict"},
    {"cache_stats", mod_cache_stats, METH_NOARGS,
     "cache_stats()\n--\n\nthe import cache's counters"},
    {"cache_trim", mod_cache_trim, METH_NOARGS,
     "cache_trim()\n--\n\ncloses the mappings the import cache keeps idle after their "
     "last close (GPUIPC_IMPORT_LINGER_MS)"},
    {"counters", mod_counters, METH_NOARGS,
     "counters()\n--\n\nthis module's live-object counters"},
    {"collect", mod_collect, METH_NOARGS,
     "collect()\n--\n\nfinish now what the library keeps for connections closed here "
     "(leases of peers that are gone, arenas that drained) and drop what it is done with"},
    {"worker_index", mod_worker_index, METH_NOARGS,
     "worker_index()\n--\n\n(index, count) in a worker"},
    {"status_name", mod_status_name, METH_VARARGS,
     "status_name(status, /)\n--\n\nthe name of a status code, e.g. 'GPUIPC_E_TIMEOUT'"},
    {"log_level", mod_log_level, METH_VARARGS,
     "log_level(level=-1, /)\n--\n\nlog_level(level=-1) -> level"},
    {"_raise_status", mod_raise_status, METH_VARARGS,
     "_raise_status(status, detail='', /)\n--\n\nraises the gpuipc.Error of a status "
     "(for tests)"},
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
                           &BufferType, &EventType, &ReceivedType, &SharedType, &ChildType,
                           &TSetType, &TSubType, &TVerType, &TViewType, &HoldLogType};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
    if (PyType_Ready(types[i]) < 0) return NULL;
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  const char *names[] = {"Listener", "Connection", "Arena", "Block", "Pool",
                         "Buffer", "Event", "Received", "Shared", "Child",
                         "TensorSetC", "TensorSetSub", "TensorSetVersion", "TensorView",
                         "HoldLog"};
  for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
    Py_INCREF(types[i]);
    PyModule_AddObject(m, names[i], (PyObject *)types[i]);
  }
  if (sets_init(m) < 0) return NULL;
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
  PyModule_AddIntConstant(m, "BATCH_MAX", GPUIPC_BATCH_MAX);
  PyModule_AddIntConstant(m, "BATCH_BYTES_MAX", GPUIPC_BATCH_BYTES_MAX);
  PyModule_AddIntConstant(m, "BROADCAST_MAX", GPUIPC_BROADCAST_MAX);
  PyModule_AddIntConstant(m, "TSET_NAME_MAX", GPUIPC_TSET_NAME_MAX);
  PyModule_AddIntConstant(m, "TSET_NDIM_MAX", GPUIPC_TSET_NDIM_MAX);
  PyModule_AddIntConstant(m, "TSET_ENTRIES_MAX", GPUIPC_TSET_ENTRIES_MAX);
  PyModule_AddStringConstant(m, "__version__", GPUIPC_VERSION_STRING);
  return m;
}
