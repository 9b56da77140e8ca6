/*
 * hold.c: HoldLog, the hold table of gpuipc.torch's descriptor route: what
 * a consumer holds of one producer's tensors, written by the consumer into
 * shared memory with plain stores, read by the producer when it likes (at
 * its next send, or now and then), so that holding and releasing a tensor
 * costs neither side a message nor a thread wake-up.
 *
 * The table is a memfd the consumer makes (sealed against resizing) and
 * passes to the producer once, over its connection:
 *
 *   header   192 bytes: magic "GPUIPCHL", version, entry count N (a power of
 *            two), event slots E, bytes per event slot; head (entries the
 *            consumer published) on its own cache line, tail (entries the
 *            producer consumed) on the next
 *   events   E slots: u32 length + the descriptor of an interprocess event
 *            of the consumer (one per (device, stream) it released on);
 *            written once, before the first entry naming it
 *   entries  N x 32 bytes, a ring: 16-byte token, u32 op (1 HOLD, 2
 *            RELEASE), u32 event slot (RELEASE: recorded on the stream the
 *            consumer released on, after its work on the tensor;
 *            0xffffffff: nothing to wait for), 8 reserved
 *
 * HOLD is written when a Buffer is attached (the consumer opened the
 * tensor), RELEASE when that Buffer goes (the DLPack deleter of the last
 * view drops it), from C. The producer copies each entry out once and
 * checks it (rule 14): head never behind tail nor more than N ahead, op and
 * event slot in range, an event descriptor no longer than its slot (and
 * validated as any descriptor when opened). A table that breaks a rule is
 * read no more: what its consumer holds stays held until its process is
 * gone. A lying consumer can only keep its own tensors or let them go
 * early (its own loss): the tokens are the producer's and unguessable.
 *
 * A full ring (a producer that has not read lately) does not block the
 * consumer: entries wait in a private overflow list, written out at the
 * next entry; attach() reports the fill so that the caller can ask the
 * producer to read.
 */
#include "ext.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#define HL_MAGIC "GPUIPCHL"
#define HL_VERSION 1u
#define HL_EVENTS 16u
#define HL_EVDESC 252u /* + the u32 length: 256-byte slots */
#define HL_NO_EVENT 0xffffffffu
#define HL_MAX_ENTRIES 65536u
#define HL_OVERFLOW_MAX (1u << 20)
enum { HL_HOLD = 1, HL_RELEASE = 2 };

typedef struct {
  char magic[8];
  uint32_t version, nentries, nevents, evdesc_max;
  uint8_t pad0[40];
  uint64_t head; /* consumer */
  uint8_t pad1[56];
  uint64_t tail; /* producer */
} hl_hdr;        /* head at byte 64, tail at 128 */
#define HL_HDR_BYTES 192u
typedef struct {
  uint32_t len;
  uint8_t desc[HL_EVDESC];
} hl_event;
typedef struct {
  uint8_t token[16];
  uint32_t op, ev;
  uint64_t reserved;
} hl_entry;

_Static_assert(offsetof(hl_hdr, head) == 64 && offsetof(hl_hdr, tail) == 128 &&
                   sizeof(hl_hdr) <= HL_HDR_BYTES,
               "hold table header layout");
_Static_assert(sizeof(hl_event) == 256 && sizeof(hl_entry) == 32, "hold table slot sizes");

typedef struct HoldLogObject {
  PyObject_HEAD
  int fd;
  uint8_t *map;
  size_t size;
  int producer; /* 1: the peer's table, opened here */
  uint32_t n, nev;
  hl_hdr *h;
  hl_event *evs;
  hl_entry *ents;
  /* consumer */
  uint64_t head;
  struct {
    int dev;
    uintptr_t stream;
    gpuipc_event *ev;
  } own[HL_EVENTS];
  uint32_t nown;
  PyObject *stream_of; /* callable(device) -> raw stream, or NULL */
  hl_entry *ovf;
  size_t novf, capovf;
  long long holds, releases, lost;
  /* producer */
  uint64_t tail;
  int broken;
} HoldLogObject;

struct HoldRef {
  HoldLogObject *log;
  uint8_t token[16];
  int dev;
  uintptr_t stream;
};

static size_t hl_bytes(uint32_t n, uint32_t nev) {
  size_t b = HL_HDR_BYTES + (size_t)nev * sizeof(hl_event) + (size_t)n * sizeof(hl_entry);
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  return (b + pg - 1) / pg * pg;
}

static void hl_layout(HoldLogObject *l) {
  l->h = (hl_hdr *)l->map;
  l->evs = (hl_event *)(l->map + HL_HDR_BYTES);
  l->ents = (hl_entry *)(l->map + HL_HDR_BYTES + (size_t)l->nev * sizeof(hl_event));
}

static PyObject *HoldLog_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
  static char *kwl[] = {"nentries", "stream_of", NULL};
  unsigned n = 4096;
  PyObject *sof = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|I$O", kwl, &n, &sof)) return NULL;
  if (n < 2 || n > HL_MAX_ENTRIES || (n & (n - 1))) {
    PyErr_Format(PyExc_ValueError, "HoldLog: nentries %u: a power of two from 2 to %u", n,
                 HL_MAX_ENTRIES);
    return NULL;
  }
  if (sof != Py_None && !PyCallable_Check(sof)) {
    PyErr_SetString(PyExc_TypeError, "HoldLog: stream_of must be callable or None");
    return NULL;
  }
  size_t size = hl_bytes(n, HL_EVENTS);
  int fd = memfd_create("gpuipc-hold", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
  if (ftruncate(fd, (off_t)size) < 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
    PyErr_SetFromErrno(PyExc_OSError);
    close(fd);
    return NULL;
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    PyErr_SetFromErrno(PyExc_OSError);
    close(fd);
    return NULL;
  }
  HoldLogObject *l = (HoldLogObject *)t->tp_alloc(t, 0);
  if (!l) {
    munmap(p, size);
    close(fd);
    return NULL;
  }
  l->fd = fd;
  l->map = p;
  l->size = size;
  l->n = n;
  l->nev = HL_EVENTS;
  hl_layout(l);
  memcpy(l->h->magic, HL_MAGIC, 8);
  l->h->version = HL_VERSION;
  l->h->nentries = n;
  l->h->nevents = HL_EVENTS;
  l->h->evdesc_max = HL_EVDESC;
  if (sof != Py_None) {
    Py_INCREF(sof);
    l->stream_of = sof;
  }
  return (PyObject *)l;
}

static void HoldLog_dealloc(HoldLogObject *l) {
  for (uint32_t i = 0; i < l->nown; i++) gpuipc_event_destroy(l->own[i].ev);
  if (l->map) munmap(l->map, l->size);
  if (l->fd >= 0) close(l->fd);
  Py_XDECREF(l->stream_of);
  PyMem_RawFree(l->ovf);
  Py_TYPE(l)->tp_free((PyObject *)l);
}

/* ---- the consumer's side ------------------------------------------------- */

/* Entries in the ring not read by the producer yet, as the producer's tail
 * says (a tail out of range counts as a full ring: nothing is overwritten). */
static uint64_t hl_fill(HoldLogObject *l) {
  uint64_t tail = __atomic_load_n(&l->h->tail, __ATOMIC_ACQUIRE);
  uint64_t used = l->head - tail;
  return tail > l->head || used > l->n ? l->n : used;
}

static int hl_put(HoldLogObject *l, const hl_entry *e) {
  if (hl_fill(l) >= l->n) return 0;
  l->ents[l->head & (l->n - 1)] = *e;
  l->head++;
  __atomic_store_n(&l->h->head, l->head, __ATOMIC_RELEASE);
  return 1;
}

static void hl_append(HoldLogObject *l, const hl_entry *e) {
  size_t i = 0;
  while (i < l->novf && hl_put(l, &l->ovf[i])) i++;
  if (i) {
    memmove(l->ovf, l->ovf + i, (l->novf - i) * sizeof *l->ovf);
    l->novf -= i;
  }
  if (l->novf == 0 && hl_put(l, e)) return;
  if (l->novf == l->capovf) {
    size_t cap = l->capovf ? l->capovf * 2 : 64;
    hl_entry *v = cap <= HL_OVERFLOW_MAX ? PyMem_RawRealloc(l->ovf, cap * sizeof *v) : NULL;
    if (!v) { /* the producer keeps that tensor until this process is gone */
      l->lost++;
      return;
    }
    l->ovf = v;
    l->capovf = cap;
  }
  l->ovf[l->novf++] = *e;
}

/* The slot of this process's event for (dev, stream), made and published
 * on first use; HL_NO_EVENT when all slots are taken or the event cannot
 * be made (*ev NULL then). */
static uint32_t hl_own_event(HoldLogObject *l, int dev, uintptr_t stream, gpuipc_event **ev) {
  *ev = NULL;
  for (uint32_t i = 0; i < l->nown; i++)
    if (l->own[i].dev == dev && l->own[i].stream == stream) {
      *ev = l->own[i].ev;
      return i;
    }
  if (l->nown == l->nev) return HL_NO_EVENT;
  gpuipc_uuid u;
  gpuipc_event *e = NULL;
  if (gpuipc_device_uuid(dev, &u) != GPUIPC_OK || gpuipc_event_create(&u, &e) != GPUIPC_OK)
    return HL_NO_EVENT;
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  if (gpuipc_event_export(e, d, sizeof d, &len) != GPUIPC_OK || len > HL_EVDESC) {
    gpuipc_event_destroy(e);
    return HL_NO_EVENT;
  }
  uint32_t k = l->nown++;
  l->own[k].dev = dev;
  l->own[k].stream = stream;
  l->own[k].ev = e;
  memcpy(l->evs[k].desc, d, len);
  __atomic_store_n(&l->evs[k].len, (uint32_t)len, __ATOMIC_RELEASE);
  *ev = e;
  return k;
}

/* The stream the consumer releases on: stream_of(dev) when given (torch's
 * current raw stream), else the one the tensor was opened on. */
static uintptr_t hl_release_stream(HoldLogObject *l, struct HoldRef *r) {
  if (!l->stream_of) return r->stream;
  PyObject *s = PyObject_CallFunction(l->stream_of, "i", r->dev);
  uintptr_t v = r->stream;
  if (s && PyLong_Check(s)) {
    unsigned long long x = PyLong_AsUnsignedLongLong(s);
    if (!PyErr_Occurred()) v = (uintptr_t)x;
  }
  Py_XDECREF(s);
  PyErr_Clear();
  return v;
}

void hold_release(struct HoldRef *r) {
  HoldLogObject *l = r->log;
  PyObject *et, *evv, *etb;
  PyErr_Fetch(&et, &evv, &etb); /* a dealloc may run with an exception set */
  hl_entry e;
  memset(&e, 0, sizeof e);
  memcpy(e.token, r->token, 16);
  e.op = HL_RELEASE;
  uintptr_t stream = hl_release_stream(l, r);
  gpuipc_event *ev = NULL;
  e.ev = hl_own_event(l, r->dev, stream, &ev);
  gpuipc_status st;
  if (ev) {
    st = gpuipc_event_record(ev, S(stream)); /* ~1 us: the GIL stays */
  } else {
    /* No slot left: wait here for the work on that stream instead. */
    gpuipc_uuid u;
    gpuipc_event *tmp = NULL;
    st = gpuipc_device_uuid(r->dev, &u);
    if (st == GPUIPC_OK) st = gpuipc_event_create(&u, &tmp);
    if (st == GPUIPC_OK) {
      Py_BEGIN_ALLOW_THREADS
      st = gpuipc_event_record(tmp, S(stream));
      if (st == GPUIPC_OK) st = gpuipc_event_synchronize(tmp);
      Py_END_ALLOW_THREADS
    }
    gpuipc_event_destroy(tmp);
    e.ev = HL_NO_EVENT;
  }
  if (st == GPUIPC_OK) {
    hl_append(l, &e);
    l->releases++;
  } else {
    l->lost++; /* no ordering possible: held until this process is gone */
  }
  PyErr_Restore(et, evv, etb);
  Py_DECREF(l);
  PyMem_RawFree(r);
}

static PyObject *HoldLog_attach(HoldLogObject *l, PyObject *const *a, Py_ssize_t na) {
  if (l->producer) {
    PyErr_SetString(PyExc_ValueError, "HoldLog.attach: a table opened from a peer");
    return NULL;
  }
  if (na != 4 || Py_TYPE(a[0]) != &BufferType) {
    PyErr_SetString(PyExc_TypeError, "HoldLog.attach(buffer, token: 16 bytes, device, stream)");
    return NULL;
  }
  BufferObject *b = (BufferObject *)a[0];
  char *tok;
  Py_ssize_t tl;
  if (PyBytes_AsStringAndSize(a[1], &tok, &tl) < 0) return NULL;
  int dev = (int)PyLong_AsLong(a[2]);
  unsigned long long stream = PyLong_AsUnsignedLongLong(a[3]);
  if (PyErr_Occurred()) return NULL;
  if (tl != 16) {
    PyErr_SetString(PyExc_ValueError, "HoldLog.attach: the token is 16 bytes");
    return NULL;
  }
  if (!b->b || b->hold) {
    PyErr_SetString(PyExc_ValueError, "HoldLog.attach: an open buffer with no hold yet");
    return NULL;
  }
  struct HoldRef *r = PyMem_RawMalloc(sizeof *r);
  if (!r) return PyErr_NoMemory();
  Py_INCREF(l);
  r->log = l;
  memcpy(r->token, tok, 16);
  r->dev = dev;
  r->stream = (uintptr_t)stream;
  hl_entry e;
  memset(&e, 0, sizeof e);
  memcpy(e.token, tok, 16);
  e.op = HL_HOLD;
  e.ev = HL_NO_EVENT;
  hl_append(l, &e);
  l->holds++;
  b->hold = r;
  return PyLong_FromUnsignedLongLong(hl_fill(l) + l->novf);
}

/* ---- the producer's side ------------------------------------------------- */

static PyObject *hl_protocol(HoldLogObject *l, const char *what) {
  l->broken = 1;
  return raise_msg(GPUIPC_E_PROTOCOL, "HoldLog", what);
}

static PyObject *HoldLog_open(PyTypeObject *t, PyObject *arg) {
  int fd = PyObject_AsFileDescriptor(arg);
  if (fd < 0) return NULL;
  struct stat sb;
  int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode) || seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW) ||
      sb.st_size < (off_t)HL_HDR_BYTES || sb.st_size > (off_t)(64u << 20))
    return raise_msg(GPUIPC_E_BAD_KIND, "HoldLog.open",
                     "not a memfd sealed against resizing, of a hold table's size");
  size_t size = (size_t)sb.st_size;
  uint8_t *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
  hl_hdr h;
  memcpy(&h, p, sizeof h); /* read once */
  if (memcmp(h.magic, HL_MAGIC, 8) || h.version != HL_VERSION || h.nentries < 2 ||
      h.nentries > HL_MAX_ENTRIES || (h.nentries & (h.nentries - 1)) ||
      h.nevents > HL_EVENTS || h.evdesc_max != HL_EVDESC ||
      hl_bytes(h.nentries, h.nevents) != size) {
    munmap(p, size);
    return raise_msg(GPUIPC_E_PROTOCOL, "HoldLog.open", "not a hold table of this version");
  }
  HoldLogObject *l = (HoldLogObject *)t->tp_alloc(t, 0);
  if (!l) {
    munmap(p, size);
    return NULL;
  }
  l->fd = -1;
  l->map = p;
  l->size = size;
  l->producer = 1;
  l->n = h.nentries;
  l->nev = h.nevents;
  hl_layout(l);
  return (PyObject *)l;
}

/* [(op, token, event slot)] published since the last call, oldest first;
 * at most max_n of them. */
static PyObject *HoldLog_drain(HoldLogObject *l, PyObject *const *a, Py_ssize_t na) {
  if (!l->producer) {
    PyErr_SetString(PyExc_ValueError, "HoldLog.drain: the producer's side only");
    return NULL;
  }
  Py_ssize_t max_n = na > 0 ? PyLong_AsSsize_t(a[0]) : 4096;
  if (max_n == -1 && PyErr_Occurred()) return NULL;
  if (l->broken) return raise_msg(GPUIPC_E_PROTOCOL, "HoldLog", "a table that broke its rules");
  uint64_t head = __atomic_load_n(&l->h->head, __ATOMIC_ACQUIRE);
  if (head < l->tail || head - l->tail > l->n)
    return hl_protocol(l, "its head is behind what was read, or more than a ring ahead");
  uint64_t avail = head - l->tail;
  if ((uint64_t)max_n < avail) avail = (uint64_t)max_n;
  PyObject *out = PyList_New((Py_ssize_t)avail);
  if (!out) return NULL;
  for (uint64_t i = 0; i < avail; i++) {
    hl_entry e;
    memcpy(&e, &l->ents[(l->tail + i) & (l->n - 1)], sizeof e); /* read once */
    if ((e.op != HL_HOLD && e.op != HL_RELEASE) ||
        (e.ev != HL_NO_EVENT && e.ev >= l->nev) || (e.op == HL_HOLD && e.ev != HL_NO_EVENT)) {
      Py_DECREF(out);
      return hl_protocol(l, "an entry with an unknown op or event slot");
    }
    PyObject *t = Py_BuildValue("(iy#l)", (int)e.op, (const char *)e.token, (Py_ssize_t)16,
                                e.ev == HL_NO_EVENT ? -1L : (long)e.ev);
    if (!t) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, (Py_ssize_t)i, t);
  }
  l->tail += avail;
  __atomic_store_n(&l->h->tail, l->tail, __ATOMIC_RELEASE);
  return out;
}

static PyObject *HoldLog_event_desc(HoldLogObject *l, PyObject *arg) {
  long k = PyLong_AsLong(arg);
  if (k == -1 && PyErr_Occurred()) return NULL;
  if (k < 0 || (unsigned long)k >= l->nev)
    return raise_msg(GPUIPC_E_PROTOCOL, "HoldLog.event_desc", "event slot out of range");
  uint8_t d[HL_EVDESC];
  uint32_t len = __atomic_load_n(&l->evs[k].len, __ATOMIC_ACQUIRE);
  if (len == 0 || len > HL_EVDESC)
    return raise_msg(GPUIPC_E_PROTOCOL, "HoldLog.event_desc",
                     "an event slot that is empty or longer than its slot");
  memcpy(d, l->evs[k].desc, len); /* read once */
  return PyBytes_FromStringAndSize((const char *)d, len);
}

static PyObject *HoldLog_get(HoldLogObject *l, void *w) {
  switch ((intptr_t)w) {
  case 0: return PyLong_FromLong(l->fd);
  case 1: return PyLong_FromUnsignedLongLong(l->producer ? 0 : hl_fill(l) + l->novf);
  case 2: return Py_BuildValue("{s:L,s:L,s:L,s:n}", "holds", l->holds, "releases", l->releases,
                               "lost", l->lost, "overflow", (Py_ssize_t)l->novf);
  case 3: return PyLong_FromUnsignedLong(l->n);
  }
  Py_RETURN_NONE;
}

static PyMethodDef HoldLog_methods[] = {
    {"attach", (PyCFunction)(void (*)(void))HoldLog_attach, METH_FASTCALL,
     "attach($self, buffer, token, device, stream=..., /)\n--\n\n"
     "attach(buffer, token, device, stream) -> entries not read yet: writes HOLD now and "
     "RELEASE (after an event recorded on the release stream) when the buffer goes"},
    {"open", (PyCFunction)HoldLog_open, METH_O | METH_CLASS,
     "open($type, fd, /)\n--\n\n"
     "HoldLog.open(fd): the producer's view of a consumer's table (fd stays the caller's)"},
    {"drain", (PyCFunction)(void (*)(void))HoldLog_drain, METH_FASTCALL,
     "drain($self, max_n=4096, /)\n--\n\n"
     "drain(max_n=4096) -> [(op, token, event slot or -1)]: 1 HOLD, 2 RELEASE; "
     "ProtocolError when the table breaks its rules (then always)"},
    {"event_desc", (PyCFunction)HoldLog_event_desc, METH_O,
     "event_desc($self, slot, /)\n--\n\n"
     "event_desc(slot) -> bytes: the consumer's event descriptor in that slot"},
    {NULL}};
static PyGetSetDef HoldLog_getset[] = {
    {"fd", (getter)HoldLog_get, NULL, "the memfd to pass to the producer (-1 there)", (void *)0},
    {"pending", (getter)HoldLog_get, NULL, "entries the producer has not read yet", (void *)1},
    {"counts", (getter)HoldLog_get, NULL, "holds, releases, lost, overflow", (void *)2},
    {"nentries", (getter)HoldLog_get, NULL, NULL, (void *)3},
    {NULL}};
PyTypeObject HoldLogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpuipc.HoldLog",
    .tp_basicsize = sizeof(HoldLogObject),
    .tp_dealloc = (destructor)HoldLog_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HoldLog(nentries=4096, *, stream_of=None)\n--\n\n"
              "HoldLog(nentries=4096, *, stream_of=None): a consumer's hold table in shared "
              "memory (gpuipc.torch); HoldLog.open(fd): the producer's view of one.",
    .tp_methods = HoldLog_methods,
    .tp_getset = HoldLog_getset,
    .tp_new = HoldLog_new,
};
