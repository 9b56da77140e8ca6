/*
 * xfer.c: owns the copy engine (gpuipc_xfer): its streams and events, the
 * ring of pinned staging buffers for pageable host memory (filled and
 * drained by the host copy threads of xfer_host.c), the device scratch of
 * the copy-in -> stage -> copy-out pipeline, the chunking heuristic, and
 * the three transfer operations. A small pageable source copied to the
 * device on an idle stream skips the ring for the driver's own pageable
 * copy (run()). The shared pinned host segment lives in xfer_shared.c.
 *
 * The one rule everything here serves: a staging slot is written again only
 * after the event recorded behind the last DMA that used it has completed
 * (cuEventSynchronize on the host, since the host is what writes it), and
 * device scratch is reused only in stream order.
 */
#include "xfer_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define XFER_DEFAULT_MAX_CHUNK ((size_t)8 << 20)
#define XFER_MIN_AUTO_CHUNK ((size_t)1 << 20)
#define XFER_CHUNK_ALIGN ((size_t)64 << 10)
#define XFER_TARGET_CHUNKS 16
#define XFER_STAGED_TARGET_CHUNKS 8
#define XFER_AUTO_HOST_THREADS 16

size_t gpuipc__xfer_driver_pageable_min = GPUIPC__XFER_DRIVER_PAGEABLE_MIN;
size_t gpuipc__xfer_driver_pageable_max = GPUIPC__XFER_DRIVER_PAGEABLE_MAX;
size_t gpuipc__xfer_driver_pageable_out_max =
    GPUIPC__XFER_DRIVER_PAGEABLE_OUT_MAX;
size_t gpuipc__xfer_staged_min_chunk = GPUIPC__XFER_STAGED_MIN_CHUNK;
#define XFER_MAX_SLOTS 64
#define XFER_MIN_SLOT ((size_t)64 << 10)

/* MEM_PAGEABLE_DRIVER: a pageable source or destination the driver's own
 * pageable copy takes (see run()). */
enum mem_kind { MEM_PAGEABLE, MEM_PINNED, MEM_DEVICE, MEM_PAGEABLE_DRIVER };
enum slot_state {
  SLOT_FREE,
  SLOT_READ, /* a DMA reads the slot (host -> device): wait its event */
  SLOT_DRAIN /* a DMA fills the slot (device -> host): wait, then copy out */
};

struct slot {
  char *host; /* pinned */
  CUevent ev; /* recorded after the DMA that uses the slot */
  int state;
  char *drain_dst; /* SLOT_DRAIN: where the host copies the data */
  size_t drain_len;
};

struct gpuipc_xfer {
  /* error-checking: a stage that re-enters gets EDEADLK */
  pthread_mutex_t lock;
  int device;       /* local ordinal, for the context */
  gpuipc_uuid uuid; /* the same device, as the API names it */
  int nstreams;
  int copy_engines;
  size_t user_chunk; /* 0: automatic */
  size_t max_chunk;
  CUstream streams[GPUIPC_XFER_MAX_STREAMS];
  CUevent ev_done[GPUIPC_XFER_MAX_STREAMS];
  CUevent ev_start;
  CUstream start_stream; /* where ev_start was last recorded */
  bool start_recorded;
  CUevent ev_sync;

  /* staging ring (allocated on first need) */
  size_t slot_bytes;      /* the largest slot (configured) */
  size_t ring_slot_bytes; /* slots of the ring allocated now */
  int nslots;
  char *staging; /* one cuMemHostAlloc of nslots * ring_slot_bytes */
  struct slot slots[XFER_MAX_SLOTS];
  int next_slot;
  int drain_q[XFER_MAX_SLOTS]; /* slots in SLOT_DRAIN, in the order filled */
  int drain_head, drain_count;

  int host_threads;     /* chosen */
  gpuipc__hcopy *hcopy; /* started with the staging ring */

  /* device scratch for the pipeline: per stream an input and an output chunk */
  CUdeviceptr scratch;

  uint64_t transfers, chunks, staged_bytes, direct_bytes;
};

/* Live pinned allocations and device scratch of all engines: leak checks in
 * tests (cuMemGetInfo is device-wide on a real GPU, so other processes'
 * allocations move it). */
static atomic_uint_fast64_t pinned_live, pinned_live_bytes;
static atomic_uint_fast64_t scratch_live, scratch_live_bytes;

uint64_t gpuipc__xfer_scratch_live(uint64_t *bytes) {
  if (bytes)
    *bytes = atomic_load(&scratch_live_bytes);
  return atomic_load(&scratch_live);
}

uint64_t gpuipc__xfer_pinned_live(uint64_t *bytes) {
  if (bytes)
    *bytes = atomic_load(&pinned_live_bytes);
  return atomic_load(&pinned_live);
}

void *gpuipc__xfer_staging_base(const gpuipc_xfer *x) {
  return x ? x->staging : NULL;
}

static inline CUdeviceptr dptr(const void *p) {
  return (CUdeviceptr)(uintptr_t)p;
}
static inline void *hptr(CUdeviceptr d) { return (void *)(uintptr_t)d; }

/* ---- creation ------------------------------------------------------------ */

static gpuipc_status read_options(const gpuipc_xfer_options *in,
                                  gpuipc_xfer_options *o) {
  gpuipc_xfer_options def = GPUIPC_XFER_OPTIONS_INIT;
  *o = def;
  if (in == NULL)
    return GPUIPC_OK;
  GPUIPC__CHECK(gpuipc__options_copy(o, sizeof *o, in, 0,
                                     "gpuipc_xfer_options",
                                     "GPUIPC_XFER_OPTIONS_INIT"));
  if (o->streams < 0 || o->streams > GPUIPC_XFER_MAX_STREAMS)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_options.streams = %d: want 0 (automatic) "
                        "to %d",
                        o->streams, GPUIPC_XFER_MAX_STREAMS);
  if (o->host_threads < 0 || o->host_threads > GPUIPC__HCOPY_MAX_THREADS)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_options.host_threads = %d: want 0 "
                        "(automatic) to %d",
                        o->host_threads, GPUIPC__HCOPY_MAX_THREADS);
  if (o->staging_bytes != 0 && o->staging_bytes < 2)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_options.staging_bytes = %zu: the ring "
                        "needs at least two slots",
                        o->staging_bytes);
  return GPUIPC_OK;
}

static gpuipc_status engine_release(gpuipc_xfer *x);
static gpuipc_status staging_free(gpuipc_xfer *x);

/* Device scratch of the pipeline: an input and an output chunk per stream. */
static size_t scratch_bytes(const gpuipc_xfer *x) {
  return 2 * (size_t)x->nstreams * x->max_chunk;
}

gpuipc_status gpuipc_xfer_create(const gpuipc_uuid *uuid,
                                 const gpuipc_xfer_options *opts,
                                 gpuipc_xfer **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_create: out is NULL");
  gpuipc_xfer_options o;
  GPUIPC__CHECK(read_options(opts, &o));
  GPUIPC__CHECK(gpuipc__driver());

  int device = 0;
  if (uuid != NULL) {
    GPUIPC__CHECK(gpuipc_device_from_uuid(uuid, &device));
  } else {
    int count = 0;
    GPUIPC__CU_CHECK(cuDeviceGetCount, &count);
    if (count < 1)
      return gpuipc__fail(GPUIPC_E_NO_DEVICE,
                          "gpuipc_xfer_create: no device visible");
  }
  gpuipc_uuid named;
  GPUIPC__CHECK(gpuipc_device_uuid(device, &named));

  gpuipc_xfer *x = calloc(1, sizeof *x);
  if (x == NULL)
    return gpuipc__fail_errno(ENOMEM, "calloc", "copy engine");
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ERRORCHECK);
  pthread_mutex_init(&x->lock, &ma);
  pthread_mutexattr_destroy(&ma);
  x->device = device;
  x->uuid = named;

  gpuipc_status s = GPUIPC_OK;
  gpuipc__ctx_guard g;
  s = gpuipc__ctx_enter(&g, device);
  if (s != GPUIPC_OK) {
    pthread_mutex_destroy(&x->lock);
    free(x);
    return s;
  }

  CUdevice dev;
  GPUIPC__CU_CHECK_GOTO(s, fail, cuDeviceGet, &dev, device);
  int engines = 1;
  CUresult r = GPUIPC__CU(cuDeviceGetAttribute, &engines,
                          CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, dev);
  if (r != CUDA_SUCCESS) {
    /* Not fatal: the count only tunes the stream count. */
    GPUIPC__DEBUG("xfer", "ASYNC_ENGINE_COUNT unknown (%s); assuming 1",
                  gpuipc__cuda_error_name(r));
    engines = 1;
  }
  x->copy_engines = engines;
  /* With two copy engines the copy-in of one chunk and the copy-out of
   * another run at once; four streams keep both engines and the stage busy
   * (measured: 64 chunks over 4 streams reach 94% of the bound). With one
   * engine, two streams still overlap copies with the stage. */
  x->nstreams = o.streams ? o.streams : (engines >= 2 ? 4 : 2);
  x->user_chunk = o.chunk_bytes;
  x->max_chunk = o.chunk_bytes ? o.chunk_bytes : XFER_DEFAULT_MAX_CHUNK;

  if (o.host_threads) {
    x->host_threads = o.host_threads;
  } else {
    /* Half the CPUs, at most 16: a staged copy is bound by memcpy (a core
     * moves roughly 5-10 GB/s between pageable and pinned memory, one PCIe 5
     * direction carries 55 GB/s). Measured on an H200 host (32 CPUs): 4
     * threads gave 15-25 GB/s; from 256 MiB, 16 threads gave 38-51 GB/s
     * where 8 gave 33-45. The other half stays with the application. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    long t = cpus / 2;
    x->host_threads = t < 1                        ? 1
                      : t > XFER_AUTO_HOST_THREADS ? XFER_AUTO_HOST_THREADS
                                                   : (int)t;
  }

  size_t staging = o.staging_bytes ? o.staging_bytes
                                   : 2 * (size_t)x->nstreams * x->max_chunk;
  x->slot_bytes = x->max_chunk < staging / 2 ? x->max_chunk : staging / 2;
  size_t nslots = staging / x->slot_bytes;
  x->nslots = (int)(nslots > XFER_MAX_SLOTS ? XFER_MAX_SLOTS : nslots);

  for (int i = 0; i < x->nstreams; i++) {
    /* Non-blocking: the engine's streams must not serialize with the legacy
     * default stream, or every copy would wait for unrelated work. The
     * caller's stream is joined explicitly with events instead. */
    GPUIPC__CU_CHECK_GOTO(s, fail, cuStreamCreate, &x->streams[i],
                          CU_STREAM_NON_BLOCKING);
    GPUIPC__CU_CHECK_GOTO(s, fail, cuEventCreate, &x->ev_done[i],
                          CU_EVENT_DISABLE_TIMING);
  }
  GPUIPC__CU_CHECK_GOTO(s, fail, cuEventCreate, &x->ev_start,
                        CU_EVENT_DISABLE_TIMING);
  GPUIPC__CU_CHECK_GOTO(s, fail, cuEventCreate, &x->ev_sync,
                        CU_EVENT_DISABLE_TIMING);
  gpuipc__ctx_leave(&g);
  GPUIPC__DEBUG("xfer",
                "engine on device %d: %d streams, %d copy engines, max chunk "
                "%zu, staging %d x %zu",
                device, x->nstreams, engines, x->max_chunk, x->nslots,
                x->slot_bytes);
  *out = x;
  return GPUIPC_OK;

fail:
  engine_release(x);
  gpuipc__ctx_leave(&g);
  pthread_mutex_destroy(&x->lock);
  free(x);
  return s;
}

/* Frees everything the engine holds; its context must be current. Keeps the
 * first failure. */
static gpuipc_status engine_release(gpuipc_xfer *x) {
  gpuipc_status s = GPUIPC_OK;
  CUresult r;
#define XFER_KEEP(call, what)                                                  \
  do {                                                                         \
    r = (call);                                                                \
    if (r != CUDA_SUCCESS && s == GPUIPC_OK)                                   \
      s = gpuipc__fail_cuda(r, what, "destroying a copy engine");              \
  } while (0)
  for (int i = 0; i < GPUIPC_XFER_MAX_STREAMS; i++)
    if (x->streams[i])
      XFER_KEEP(GPUIPC__CU(cuStreamSynchronize, x->streams[i]),
                "cuStreamSynchronize");
  for (int i = 0; i < GPUIPC_XFER_MAX_STREAMS; i++) {
    if (x->streams[i])
      XFER_KEEP(GPUIPC__CU(cuStreamDestroy, x->streams[i]), "cuStreamDestroy");
    if (x->ev_done[i])
      XFER_KEEP(GPUIPC__CU(cuEventDestroy, x->ev_done[i]), "cuEventDestroy");
    x->streams[i] = NULL;
    x->ev_done[i] = NULL;
  }
  if (x->ev_start)
    XFER_KEEP(GPUIPC__CU(cuEventDestroy, x->ev_start), "cuEventDestroy");
  if (x->ev_sync)
    XFER_KEEP(GPUIPC__CU(cuEventDestroy, x->ev_sync), "cuEventDestroy");
  x->ev_start = x->ev_sync = NULL;
  for (int i = 0; i < XFER_MAX_SLOTS; i++) {
    if (x->slots[i].ev)
      XFER_KEEP(GPUIPC__CU(cuEventDestroy, x->slots[i].ev), "cuEventDestroy");
    x->slots[i].ev = NULL;
  }
  if (x->staging) {
    gpuipc_status fs = staging_free(x);
    if (fs != GPUIPC_OK && s == GPUIPC_OK)
      s = fs;
  }
  x->staging = NULL;
  gpuipc__hcopy_destroy(x->hcopy);
  x->hcopy = NULL;
  if (x->scratch) {
    r = GPUIPC__CU(cuMemFree, x->scratch);
    if (r == CUDA_SUCCESS) {
      atomic_fetch_sub(&scratch_live, 1);
      atomic_fetch_sub(&scratch_live_bytes, (uint64_t)scratch_bytes(x));
    } else if (s == GPUIPC_OK) {
      s = gpuipc__fail_cuda(r, "cuMemFree", "destroying a copy engine");
    }
  }
  x->scratch = 0;
#undef XFER_KEEP
  return s;
}

gpuipc_status gpuipc_xfer_destroy(gpuipc_xfer *x) {
  if (x == NULL)
    return GPUIPC_OK;
  gpuipc_status s = gpuipc__driver();
  if (s == GPUIPC_OK) {
    gpuipc__ctx_guard g;
    s = gpuipc__ctx_enter(&g, x->device);
    if (s == GPUIPC_OK) {
      s = engine_release(x);
      gpuipc__ctx_leave(&g);
    }
  }
  pthread_mutex_destroy(&x->lock);
  free(x);
  return s;
}

/* ---- staging ring and scratch -------------------------------------------- */

/* Frees the ring (not its events); every slot must be idle. */
static gpuipc_status staging_free(gpuipc_xfer *x) {
  if (x->staging == NULL)
    return GPUIPC_OK;
  CUresult r = GPUIPC__CU(cuMemFreeHost, x->staging);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemFreeHost", "staging ring");
  atomic_fetch_sub(&pinned_live, 1);
  atomic_fetch_sub(&pinned_live_bytes,
                   (uint64_t)x->ring_slot_bytes * (uint64_t)x->nslots);
  x->staging = NULL;
  x->ring_slot_bytes = 0;
  return GPUIPC_OK;
}

/* Makes sure the ring has slots of at least `need` bytes (need <=
 * slot_bytes). The ring grows with the transfers: slots start at the
 * smallest power of two >= 64 KiB that holds a chunk, so an engine that
 * only ever moves small pageable buffers pins little, and are reallocated
 * (at most a few times) when a larger chunk comes, once every slot is idle.
 * Allocation is the expensive part (cuMemHostAlloc pins pages: far more
 * than a copy of the same size), hence never shrinking. */
static gpuipc_status staging_alloc(gpuipc_xfer *x, size_t need) {
  size_t want = XFER_MIN_SLOT;
  while (want < need && want < x->slot_bytes)
    want *= 2;
  if (want > x->slot_bytes)
    want = x->slot_bytes;
  if (x->staging && x->ring_slot_bytes >= want)
    return GPUIPC_OK;
  CUresult r;
  if (x->slots[0].ev == NULL) {
    for (int i = 0; i < x->nslots; i++) {
      r = GPUIPC__CU(cuEventCreate, &x->slots[i].ev, CU_EVENT_DISABLE_TIMING);
      if (r != CUDA_SUCCESS) {
        gpuipc_status s = gpuipc__fail_cuda(r, "cuEventCreate", "staging slot");
        for (int j = 0; j < i; j++) {
          GPUIPC__CU(cuEventDestroy, x->slots[j].ev);
          x->slots[j].ev = NULL;
        }
        return s;
      }
      x->slots[i].state = SLOT_FREE;
    }
  }
  if (x->host_threads > 1 && x->hcopy == NULL)
    GPUIPC__CHECK(gpuipc__hcopy_create(x->host_threads, &x->hcopy));
  if (x->staging) {
    /* Growing: the DMAs of the last transfer may still read the old ring. */
    for (int i = 0; i < x->nslots; i++) {
      struct slot *sl = &x->slots[i];
      if (sl->state == SLOT_FREE)
        continue;
      r = GPUIPC__CU(cuEventSynchronize, sl->ev);
      if (r != CUDA_SUCCESS)
        return gpuipc__fail_cuda(r, "cuEventSynchronize", "staging slot %d", i);
      sl->state = SLOT_FREE;
    }
    GPUIPC__CHECK(staging_free(x));
  }
  size_t total = want * (size_t)x->nslots;
  void *p = NULL;
  r = GPUIPC__CU(cuMemHostAlloc, &p, total, 0);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemHostAlloc",
                             "staging ring of %d x %zu bytes", x->nslots, want);
  for (int i = 0; i < x->nslots; i++) {
    x->slots[i].host = (char *)p + (size_t)i * want;
    x->slots[i].state = SLOT_FREE;
  }
  x->staging = p;
  x->ring_slot_bytes = want;
  atomic_fetch_add(&pinned_live, 1);
  atomic_fetch_add(&pinned_live_bytes, (uint64_t)total);
  x->next_slot = 0;
  x->drain_head = x->drain_count = 0;
  return GPUIPC_OK;
}

static gpuipc_status scratch_alloc(gpuipc_xfer *x) {
  if (x->scratch)
    return GPUIPC_OK;
  size_t total = scratch_bytes(x);
  CUresult r = GPUIPC__CU(cuMemAlloc, &x->scratch, total);
  if (r != CUDA_SUCCESS) {
    x->scratch = 0;
    return gpuipc__fail_cuda(r, "cuMemAlloc", "pipeline scratch of %zu bytes",
                             total);
  }
  atomic_fetch_add(&scratch_live, 1);
  atomic_fetch_add(&scratch_live_bytes, (uint64_t)total);
  return GPUIPC_OK;
}

static CUdeviceptr scratch_in(const gpuipc_xfer *x, int s) {
  return x->scratch + (CUdeviceptr)(2 * (size_t)s) * x->max_chunk;
}
static CUdeviceptr scratch_out(const gpuipc_xfer *x, int s) {
  return x->scratch + (CUdeviceptr)(2 * (size_t)s + 1) * x->max_chunk;
}

/* Copies the oldest filled device -> host slot to its destination. */
static gpuipc_status drain_one(gpuipc_xfer *x) {
  int i = x->drain_q[x->drain_head];
  struct slot *sl = &x->slots[i];
  CUresult r = GPUIPC__CU(cuEventSynchronize, sl->ev);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventSynchronize", "staging slot %d", i);
  gpuipc__hcopy_run(x->hcopy, sl->drain_dst, sl->host, sl->drain_len, true);
  sl->state = SLOT_FREE;
  x->drain_head = (x->drain_head + 1) % XFER_MAX_SLOTS;
  x->drain_count--;
  return GPUIPC_OK;
}

/* The next slot of the ring, once nothing in flight uses it any more. */
static gpuipc_status slot_acquire(gpuipc_xfer *x, struct slot **out) {
  int i = x->next_slot;
  struct slot *sl = &x->slots[i];
  /* Drains complete in the order they were queued, so draining up to this
   * slot keeps the destination writes in order. */
  while (sl->state == SLOT_DRAIN)
    GPUIPC__CHECK(drain_one(x));
  if (sl->state == SLOT_READ) {
    CUresult r = GPUIPC__CU(cuEventSynchronize, sl->ev);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuEventSynchronize", "staging slot %d", i);
    sl->state = SLOT_FREE;
  }
  x->next_slot = (i + 1) % x->nslots;
  *out = sl;
  return GPUIPC_OK;
}

/* After a failure: wait for whatever the engine enqueued, so that no DMA
 * touches staging or the caller's memory after we return, and free the
 * ring. A slot whose event cannot be waited for stays marked in use (the
 * next acquire waits for it again rather than overwrite it in flight). */
static void engine_quiesce(gpuipc_xfer *x) {
  for (int i = 0; i < x->nstreams; i++)
    (void)GPUIPC__CU(cuStreamSynchronize, x->streams[i]);
  if (x->staging == NULL)
    return;
  for (int i = 0; i < x->nslots; i++) {
    struct slot *sl = &x->slots[i];
    if (sl->state == SLOT_FREE)
      continue;
    if (GPUIPC__CU(cuEventSynchronize, sl->ev) == CUDA_SUCCESS)
      sl->state = SLOT_FREE;
    else
      sl->state = SLOT_READ; /* a drain is abandoned either way */
  }
  x->drain_head = x->drain_count = 0;
}

/* ---- memory kinds and chunking ------------------------------------------- */

static int mem_kind(const void *p, size_t n) {
  unsigned int type = 0;
  /* The driver knows pinned host memory (allocated or registered) and device
   * memory; for anything else (pageable memory) it answers
   * CUDA_ERROR_INVALID_VALUE. Any failure means "pageable": staging is
   * correct for every kind of host memory, only slower than a direct DMA. */
  CUresult r = GPUIPC__CU(cuPointerGetAttribute, &type,
                          CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dptr(p));
  if (r != CUDA_SUCCESS)
    return MEM_PAGEABLE;
  if (type == CU_MEMORYTYPE_DEVICE)
    return MEM_DEVICE;
  if (type != CU_MEMORYTYPE_HOST)
    return MEM_PAGEABLE;
  /* The whole range must be pinned for a direct DMA: check its last byte
   * too (a buffer that runs past its registration is treated as pageable,
   * which is always correct, only slower). */
  if (n > 1) {
    type = 0;
    r = GPUIPC__CU(cuPointerGetAttribute, &type,
                   CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                   dptr((const char *)p + n - 1));
    if (r != CUDA_SUCCESS || type != CU_MEMORYTYPE_HOST)
      return MEM_PAGEABLE;
  }
  return MEM_PINNED;
}

static size_t auto_chunk(const gpuipc_xfer *x, size_t bytes) {
  if (x->user_chunk)
    return x->user_chunk;
  size_t c = bytes / XFER_TARGET_CHUNKS + (bytes % XFER_TARGET_CHUNKS != 0);
  c = (c + XFER_CHUNK_ALIGN - 1) / XFER_CHUNK_ALIGN * XFER_CHUNK_ALIGN;
  if (c < XFER_MIN_AUTO_CHUNK)
    c = XFER_MIN_AUTO_CHUNK;
  if (c > x->max_chunk)
    c = x->max_chunk;
  return c;
}

/* The chunk of a transfer with a pageable side. Such a transfer is bound by
 * the host's memcpy, not by the link: the DMA of one chunk (what filling or
 * draining the pipeline costs) is quicker than its memcpy, so there is
 * little to gain from small chunks, while every chunk costs driver calls, an
 * event wait and a hand-over to the host threads (tens of microseconds,
 * against ~100 us for the memcpy of 2 MiB with several threads). Hence
 * fewer, larger chunks: n/8, at least 1 MiB, at most a staging slot (the
 * caller caps it), so that the memcpy of chunk i+1 still overlaps the DMA of
 * chunk i. */
static size_t staged_chunk(const gpuipc_xfer *x, size_t bytes) {
  if (x->user_chunk)
    return x->user_chunk;
  size_t c = bytes / XFER_STAGED_TARGET_CHUNKS +
             (bytes % XFER_STAGED_TARGET_CHUNKS != 0);
  c = (c + XFER_CHUNK_ALIGN - 1) / XFER_CHUNK_ALIGN * XFER_CHUNK_ALIGN;
  if (c < gpuipc__xfer_staged_min_chunk)
    c = gpuipc__xfer_staged_min_chunk;
  if (c > x->max_chunk)
    c = x->max_chunk;
  return c;
}

/* Records the fork event on the caller's stream (the engine's streams then
 * wait for it). A wait enqueued by an earlier call captured that call's
 * record; recording the same event again on ANOTHER stream must not release
 * it early. CUDA keeps each record apart (cuStreamWaitEvent captures the
 * record current at the call), but an implementation that tracks an event's
 * completion as one counter (the test emulator does) lets a later record on
 * an idle stream complete the earlier, still pending one. So when the
 * caller's stream changes while the last record is still pending, a fresh
 * event takes over: cuEventDestroy on a pending event returns at once and
 * frees it once its record completes (cuda.h), so the earlier waits stay
 * intact. A single caller stream (the usual case) never pays for this. */
static gpuipc_status record_start(gpuipc_xfer *x, CUstream caller,
                                  const char *fn) {
  CUresult r;
  if (x->start_recorded && x->start_stream != caller &&
      GPUIPC__CU(cuEventQuery, x->ev_start) != CUDA_SUCCESS) {
    CUevent fresh = NULL;
    r = GPUIPC__CU(cuEventCreate, &fresh, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuEventCreate", "%s: fork event", fn);
    r = GPUIPC__CU(cuEventDestroy, x->ev_start);
    if (r != CUDA_SUCCESS) /* only a leak of one event */
      GPUIPC__DEBUG("xfer", "cuEventDestroy of a pending fork event: %s",
                    gpuipc__cuda_error_name(r));
    x->ev_start = fresh;
  }
  r = GPUIPC__CU(cuEventRecord, x->ev_start, caller);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventRecord", "%s: the caller's stream",
                             fn);
  x->start_recorded = true;
  x->start_stream = caller;
  return GPUIPC_OK;
}

/* ---- one transfer -------------------------------------------------------- */

enum op_kind { OP_TO_DEVICE, OP_TO_HOST, OP_PIPELINE };

struct op {
  int kind;
  char *dst;
  const char *src;
  size_t bytes;
  int src_kind, dst_kind; /* host sides; the device sides are MEM_DEVICE */
  gpuipc_xfer_stage stage;
  CUstream caller;
  unsigned flags;
};

static const char *op_name(int kind) {
  return kind == OP_TO_DEVICE ? "gpuipc_xfer_to_device"
         : kind == OP_TO_HOST ? "gpuipc_xfer_to_host"
                              : "gpuipc_xfer_pipeline";
}

/* Moves len bytes from `src` (of kind k) to device memory d, on stream st. */
static gpuipc_status copy_in(gpuipc_xfer *x, CUstream st, CUdeviceptr d,
                             const char *src, size_t len, int k) {
  CUresult r;
  if (k == MEM_PAGEABLE) {
    struct slot *sl;
    GPUIPC__CHECK(slot_acquire(x, &sl));
    gpuipc__hcopy_run(x->hcopy, sl->host, src, len, false);
    r = GPUIPC__CU(cuMemcpyHtoDAsync, d, sl->host, len, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuMemcpyHtoDAsync", "%zu bytes, staged",
                               len);
    /* The slot is "in use" from here on even if the record fails: only a
     * successful wait frees it. */
    sl->state = SLOT_READ;
    r = GPUIPC__CU(cuEventRecord, sl->ev, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuEventRecord", "staging slot");
    x->staged_bytes += len;
    return GPUIPC_OK;
  }
  if (k == MEM_PINNED || k == MEM_PAGEABLE_DRIVER) {
    r = GPUIPC__CU(cuMemcpyHtoDAsync, d, src, len, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuMemcpyHtoDAsync", "%zu bytes%s", len,
                               k == MEM_PINNED ? "" : " (pageable)");
  } else {
    r = GPUIPC__CU(cuMemcpyDtoDAsync, d, dptr(src), len, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuMemcpyDtoDAsync", "%zu bytes", len);
  }
  x->direct_bytes += len;
  return GPUIPC_OK;
}

/* Moves len bytes from device memory d to `dst` (of kind k), on stream st.
 * For pageable dst the host copy happens later, in drain_one. */
static gpuipc_status copy_out(gpuipc_xfer *x, CUstream st, char *dst,
                              CUdeviceptr d, size_t len, int k) {
  CUresult r;
  if (k == MEM_PAGEABLE) {
    struct slot *sl;
    GPUIPC__CHECK(slot_acquire(x, &sl));
    r = GPUIPC__CU(cuMemcpyDtoHAsync, sl->host, d, len, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuMemcpyDtoHAsync", "%zu bytes, staged",
                               len);
    sl->state = SLOT_READ; /* in flight; a drain only once recorded */
    r = GPUIPC__CU(cuEventRecord, sl->ev, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuEventRecord", "staging slot");
    sl->state = SLOT_DRAIN;
    sl->drain_dst = dst;
    sl->drain_len = len;
    x->drain_q[(x->drain_head + x->drain_count) % XFER_MAX_SLOTS] =
        (int)(sl - x->slots);
    x->drain_count++;
    x->staged_bytes += len;
    return GPUIPC_OK;
  }
  if (k == MEM_PINNED || k == MEM_PAGEABLE_DRIVER) {
    /* pageable: complete when the call returns */
    r = GPUIPC__CU(cuMemcpyDtoHAsync, dst, d, len, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuMemcpyDtoHAsync", "%zu bytes%s", len,
                               k == MEM_PINNED ? "" : " (pageable)");
  } else {
    r = GPUIPC__CU(cuMemcpyDtoDAsync, dptr(dst), d, len, st);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuMemcpyDtoDAsync", "%zu bytes", len);
  }
  x->direct_bytes += len;
  return GPUIPC_OK;
}

/* GPUIPC_XFER_SYNC for work on the caller's stream: an event of our own
 * rather than cuStreamSynchronize, as the caller's stream may carry later
 * work of other threads. */
static gpuipc_status sync_caller(gpuipc_xfer *x, const struct op *op) {
  const char *call = "cuEventRecord";
  CUresult r = GPUIPC__CU(cuEventRecord, x->ev_sync, op->caller);
  if (r == CUDA_SUCCESS) {
    call = "cuEventSynchronize";
    r = GPUIPC__CU(cuEventSynchronize, x->ev_sync);
  }
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, call, "%s", op_name(op->kind));
  return GPUIPC_OK;
}

/* A one-way copy with nothing to stage and nothing to cut: one DMA on the
 * caller's stream, which gives exactly the ordering promised. */
static gpuipc_status run_direct(gpuipc_xfer *x, const struct op *op) {
  if (op->kind == OP_TO_DEVICE) {
    gpuipc_status s =
        copy_in(x, op->caller, dptr(op->dst), op->src, op->bytes, op->src_kind);
    if (s != GPUIPC_OK)
      return s;
  } else {
    gpuipc_status s = copy_out(x, op->caller, op->dst, dptr(op->src), op->bytes,
                               op->dst_kind);
    if (s != GPUIPC_OK)
      return s;
  }
  x->chunks++;
  if (op->flags & GPUIPC_XFER_SYNC) {
    gpuipc_status s = sync_caller(x, op);
    if (s != GPUIPC_OK) {
      /* The copy is enqueued: it must not outlive a failed call. */
      (void)GPUIPC__CU(cuStreamSynchronize, op->caller);
      return s;
    }
  }
  return GPUIPC_OK;
}

static gpuipc_status run_chunked(gpuipc_xfer *x, const struct op *op) {
  gpuipc_status s = GPUIPC_OK;
  bool staged = op->src_kind == MEM_PAGEABLE || op->dst_kind == MEM_PAGEABLE;
  bool scratch = op->kind == OP_PIPELINE &&
                 (op->stage.dev_in == NULL || op->stage.dev_out == NULL);
  size_t chunk =
      staged ? staged_chunk(x, op->bytes) : auto_chunk(x, op->bytes);
  if (staged && chunk > x->slot_bytes)
    chunk = x->slot_bytes;
  if (chunk > op->bytes)
    chunk = op->bytes;
  size_t nchunks = op->bytes / chunk + (op->bytes % chunk != 0);
  int nuse = nchunks < (size_t)x->nstreams ? (int)nchunks : x->nstreams;
  /* A one-way copy through staging runs its DMAs on one stream, the
   * caller's own. It is bound by the host's memcpy, so parallel DMAs gain
   * nothing, and DMAs of one direction on several streams share the link:
   * the first chunk would land only when several have (device -> host: its
   * memcpy out starts late). In order, each chunk arrives as early as
   * possible and its memcpy overlaps the DMAs of the next ones. On the
   * caller's stream itself, the DMAs follow its earlier work and precede
   * its later work with no fork and join (four driver calls a copy fewer:
   * a tenth of a 256 KiB copy's time). */
  bool own = staged && op->kind != OP_PIPELINE;
  if (own)
    nuse = 1;

  if (staged)
    GPUIPC__CHECK(staging_alloc(x, chunk));
  if (scratch)
    GPUIPC__CHECK(scratch_alloc(x));

  /* Fork: the engine's streams start after the caller's earlier work. */
  if (!own) {
    GPUIPC__CHECK(record_start(x, op->caller, op_name(op->kind)));
    for (int i = 0; i < nuse; i++)
      GPUIPC__CU_CHECK_GOTO(s, fail, cuStreamWaitEvent, x->streams[i],
                            x->ev_start, 0);
  }

  for (size_t c = 0; c < nchunks; c++) {
    size_t off = c * chunk;
    size_t len = op->bytes - off < chunk ? op->bytes - off : chunk;
    int si = (int)(c % (size_t)nuse);
    CUstream st = own ? op->caller : x->streams[si];
    switch (op->kind) {
    case OP_TO_DEVICE:
      GPUIPC__CHECK_GOTO(
          copy_in(x, st, dptr(op->dst + off), op->src + off, len, op->src_kind),
          s, fail);
      break;
    case OP_TO_HOST:
      GPUIPC__CHECK_GOTO(copy_out(x, st, op->dst + off, dptr(op->src + off),
                                  len, op->dst_kind),
                         s, fail);
      break;
    default: {
      CUdeviceptr din = op->stage.dev_in ? dptr((char *)op->stage.dev_in + off)
                                         : scratch_in(x, si);
      CUdeviceptr dout = op->stage.dev_out
                             ? dptr((char *)op->stage.dev_out + off)
                             : scratch_out(x, si);
      GPUIPC__CHECK_GOTO(copy_in(x, st, din, op->src + off, len, op->src_kind),
                         s, fail);
      if (op->stage.fn) {
        gpuipc_status us =
            op->stage.fn(op->stage.user, st, hptr(din), hptr(dout), off, len);
        if (us != GPUIPC_OK) {
          s = gpuipc__fail(us,
                           "gpuipc_xfer_pipeline: the stage callback returned "
                           "%s for the chunk at offset %zu (%zu bytes)",
                           gpuipc_status_name(us), off, len);
          goto fail;
        }
      } else {
        dout = din;
      }
      GPUIPC__CHECK_GOTO(
          copy_out(x, st, op->dst + off, dout, len, op->dst_kind), s, fail);
      break;
    }
    }
    x->chunks++;
  }
  while (x->drain_count > 0)
    GPUIPC__CHECK_GOTO(drain_one(x), s, fail);

  if (own) {
    /* Device -> host: the drains waited for every DMA. Host -> device:
     * SYNC waits for the last one on the caller's stream. */
    if (op->kind == OP_TO_DEVICE && (op->flags & GPUIPC_XFER_SYNC))
      GPUIPC__CHECK_GOTO(sync_caller(x, op), s, fail);
    return GPUIPC_OK;
  }

  /* Join: the caller's later work waits for every stream used. */
  for (int i = 0; i < nuse; i++) {
    GPUIPC__CU_CHECK_GOTO(s, fail, cuEventRecord, x->ev_done[i], x->streams[i]);
    GPUIPC__CU_CHECK_GOTO(s, fail, cuStreamWaitEvent, op->caller, x->ev_done[i],
                          0);
  }
  if (op->flags & GPUIPC_XFER_SYNC)
    for (int i = 0; i < nuse; i++)
      GPUIPC__CU_CHECK_GOTO(s, fail, cuEventSynchronize, x->ev_done[i]);
  return GPUIPC_OK;

fail:
  engine_quiesce(x);
  if (own) /* its DMAs are on the caller's stream */
    (void)GPUIPC__CU(cuStreamSynchronize, op->caller);
  return s;
}

static gpuipc_status run(gpuipc_xfer *x, struct op *op) {
  gpuipc_status s;
  int e = pthread_mutex_lock(&x->lock);
  if (e == EDEADLK)
    return gpuipc__fail(GPUIPC_E_BUSY,
                        "%s: called from a stage callback of the same engine",
                        op_name(op->kind));
  if (e != 0)
    return gpuipc__fail_errno(e, "pthread_mutex_lock", "copy engine");
  gpuipc__ctx_guard g;
  s = gpuipc__ctx_enter(&g, x->device);
  if (s != GPUIPC_OK)
    goto out;
  if (op->kind != OP_TO_HOST)
    op->src_kind = mem_kind(op->src, op->bytes);
  if (op->kind != OP_TO_DEVICE)
    op->dst_kind = mem_kind(op->dst, op->bytes);
  if (op->kind == OP_TO_DEVICE)
    op->dst_kind = MEM_DEVICE;
  if (op->kind == OP_TO_HOST)
    op->src_kind = MEM_DEVICE;

  /* Where the driver's own pageable copy is as quick as staging or
   * quicker (measured on an H200, 2026-12-04, `gpuipc bench copy
   * --direct-max 0` against the default, median of 9): a source of 256 KiB
   * to 4 MiB into the device (the driver pipelines small pieces inside:
   * staged 0.95x of it at 256 KiB, 0.72-0.96x at 1 MiB, 1.10-1.15x at 4
   * MiB, 1.4x at 16 MiB; below 256 KiB staging is as quick, 1.5x at
   * 64 KiB), and a destination below 256 KiB out of it (staged 0.79-0.89x
   * of the driver's copy there, 1.08x at 256 KiB). A source only when the
   * caller's stream is idle: the driver's pageable copy first waits, on
   * the host, for the stream's earlier work, which the engine's promise
   * (a pageable source is consumed without waiting for that work) rules
   * out otherwise. A destination at any time: the engine's own copy out
   * waits for that work as the driver's does (cuda.h: a copy to pageable
   * memory returns once it is complete). */
  if (op->kind == OP_TO_DEVICE && op->src_kind == MEM_PAGEABLE &&
      x->user_chunk == 0 && op->bytes >= gpuipc__xfer_driver_pageable_min &&
      op->bytes < gpuipc__xfer_driver_pageable_max &&
      GPUIPC__CU(cuStreamQuery, op->caller) == CUDA_SUCCESS)
    op->src_kind = MEM_PAGEABLE_DRIVER;
  if (op->kind == OP_TO_HOST && op->dst_kind == MEM_PAGEABLE &&
      x->user_chunk == 0 && op->bytes < gpuipc__xfer_driver_pageable_out_max)
    op->dst_kind = MEM_PAGEABLE_DRIVER;
  bool direct = op->kind != OP_PIPELINE && op->src_kind != MEM_PAGEABLE &&
                op->dst_kind != MEM_PAGEABLE &&
                (x->user_chunk == 0 || op->bytes <= x->user_chunk);
  s = direct ? run_direct(x, op) : run_chunked(x, op);
  if (s == GPUIPC_OK)
    x->transfers++;
  gpuipc__ctx_leave(&g);
out:
  pthread_mutex_unlock(&x->lock);
  return s;
}

static gpuipc_status check_common(const char *fn, gpuipc_xfer *x, void *dst,
                                  const void *src, size_t bytes,
                                  unsigned flags) {
  if (x == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: engine is NULL", fn);
  if (bytes > 0 && (dst == NULL || src == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: %s is NULL", fn,
                        dst == NULL ? "dst" : "src");
  if (flags & ~GPUIPC_XFER_SYNC)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: unknown flags 0x%x", fn,
                        flags & ~GPUIPC_XFER_SYNC);
  if (bytes > 0 && (uintptr_t)dst + bytes < (uintptr_t)dst)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: range wraps", fn);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_to_device(gpuipc_xfer *x, void *dst, const void *src,
                                    size_t bytes, struct CUstream_st *stream,
                                    unsigned flags) {
  GPUIPC__CHECK(
      check_common("gpuipc_xfer_to_device", x, dst, src, bytes, flags));
  if (bytes == 0)
    return GPUIPC_OK;
  GPUIPC__CHECK(gpuipc__driver());
  struct op op = {.kind = OP_TO_DEVICE,
                  .dst = dst,
                  .src = src,
                  .bytes = bytes,
                  .caller = stream,
                  .flags = flags};
  return run(x, &op);
}

gpuipc_status gpuipc_xfer_to_host(gpuipc_xfer *x, void *dst, const void *src,
                                  size_t bytes, struct CUstream_st *stream,
                                  unsigned flags) {
  GPUIPC__CHECK(check_common("gpuipc_xfer_to_host", x, dst, src, bytes, flags));
  if (bytes == 0)
    return GPUIPC_OK;
  GPUIPC__CHECK(gpuipc__driver());
  struct op op = {.kind = OP_TO_HOST,
                  .dst = dst,
                  .src = src,
                  .bytes = bytes,
                  .caller = stream,
                  .flags = flags};
  return run(x, &op);
}

gpuipc_status gpuipc_xfer_pipeline(gpuipc_xfer *x, void *dst, const void *src,
                                   size_t bytes, const gpuipc_xfer_stage *stage,
                                   struct CUstream_st *stream, unsigned flags) {
  GPUIPC__CHECK(
      check_common("gpuipc_xfer_pipeline", x, dst, src, bytes, flags));
  struct op op = {.kind = OP_PIPELINE,
                  .dst = dst,
                  .src = src,
                  .bytes = bytes,
                  .caller = stream,
                  .flags = flags};
  gpuipc_xfer_stage def = GPUIPC_XFER_STAGE_INIT;
  op.stage = def;
  if (stage != NULL) {
    if (stage->size < sizeof(size_t))
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_xfer_pipeline: stage->size is %zu: set it "
                          "with GPUIPC_XFER_STAGE_INIT",
                          stage->size);
    memcpy(&op.stage, stage,
           stage->size < sizeof op.stage ? stage->size : sizeof op.stage);
  }
  if (bytes > 0 && (char *)dst < (const char *)src + bytes &&
      (const char *)src < (char *)dst + bytes)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_pipeline: dst and src overlap");
  if (bytes == 0)
    return GPUIPC_OK;
  GPUIPC__CHECK(gpuipc__driver());
  return run(x, &op);
}

/* ---- introspection ------------------------------------------------------- */

gpuipc_status gpuipc_xfer_get_info(gpuipc_xfer *x, gpuipc_xfer_info *info) {
  if (x == NULL || info == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_xfer_get_info: NULL");
  if (info->size < sizeof(size_t))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_get_info: set info->size = sizeof *info");
  gpuipc_xfer_info v;
  memset(&v, 0, sizeof v);
  int e = pthread_mutex_lock(&x->lock);
  if (e != 0)
    return gpuipc__fail_errno(e, "pthread_mutex_lock", "copy engine");
  v.size = info->size < sizeof v ? info->size : sizeof v;
  v.device = x->uuid;
  v.streams = x->nstreams;
  v.copy_engines = x->copy_engines;
  v.max_chunk_bytes = x->max_chunk;
  v.staging_slot_bytes = x->slot_bytes;
  v.staging_slots = x->nslots;
  v.staging_allocated = x->staging != NULL;
  v.staging_bytes = x->staging ? x->ring_slot_bytes * (size_t)x->nslots : 0;
  v.host_threads = x->hcopy ? gpuipc__hcopy_threads(x->hcopy) : x->host_threads;
  v.transfers = x->transfers;
  v.chunks = x->chunks;
  v.staged_bytes = x->staged_bytes;
  v.direct_bytes = x->direct_bytes;
  pthread_mutex_unlock(&x->lock);
  memcpy(info, &v, v.size);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_get_chunk_size(gpuipc_xfer *x, size_t bytes,
                                     size_t *chunk) {
  if (x == NULL || chunk == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_xfer_get_chunk_size: NULL");
  size_t c = auto_chunk(x, bytes);
  if (c > bytes)
    c = bytes;
  *chunk = c;
  return GPUIPC_OK;
}
