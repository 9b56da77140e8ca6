/*
 * arena.c: owns arenas: IPC-capable device memory in chunks (each one
 * allocation of a handle-layer pool: a memory pool with file-descriptor
 * export for the arenas of gpuipc_arena_create, VMM or legacy memory for
 * the process's flag-word arenas) carved into blocks with a first-fit
 * allocator, and the stream-ordered reuse of memory that consumers held.
 * The arena's lock is taken only here. The public gpuipc_arena_alloc,
 * _get_stats and _destroy first reclaim what orphaned leases of departed
 * peers held, through the reaper lease.c sets (gpuipc__arena_set_reaper),
 * so that this file never calls the lease tables above it.
 *
 * Reuse. A block a consumer held may be handed out again only after the
 * consumer's GPU work on it is done. The consumer says so on the GPU: its
 * release writes a sequence number into a flag word. When the release
 * message arrives (lease.c), the arena enqueues, on that connection's own
 * non-blocking reclaim stream, a wait for that word, then records an event
 * (a marker) and tags the block with it. The memory of a freed block goes
 * back to the free list with its tags; gpuipc_arena_alloc hands such
 * memory out at once when the markers completed, and otherwise orders the
 * caller's stream after them (cuStreamWaitEvent): reuse never waits on the
 * host. Each connection's stream, and the arena's own (which orders reuse
 * after the owner's frees), waits for nothing else, so a release word one
 * peer never writes holds back only memory that peer held: markers of
 * other streams complete, free ranges merge only when neither waits, and
 * memory whose markers are overdue is handed out only when nothing else
 * fits and the arena cannot grow.
 */
#include "arena_int.h"
#include "core/stats.h"

#include <stdatomic.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static atomic_uint_fast64_t arena_ids;
/* Device allocations (chunks) the arenas of this process hold, flag-word
 * arenas included: a leak check that, unlike cuMemGetInfo, does not see
 * other processes sharing the device. */
static atomic_size_t chunks_live;

size_t gpuipc__arena_chunks_live(void) { return atomic_load(&chunks_live); }

/* A marker that has not completed this long after it was recorded is
 * overdue: its memory is handed out only when nothing else fits. */
#define MARK_OVERDUE_NS (1000ull * 1000000ull)

static atomic_uint_fast64_t reclaimer_ids, mark_orders;

gpuipc_status gpuipc__reclaimer_open(gpuipc__reclaimer *r) {
  CUstream st;
  CUresult cr = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  if (cr != CUDA_SUCCESS)
    return gpuipc__fail_cuda(cr, "cuStreamCreate", "reclaim stream");
  r->stream = (struct CUstream_st *)st;
  r->id = atomic_fetch_add(&reclaimer_ids, 1) + 1;
  return GPUIPC_OK;
}

void gpuipc__reclaimer_close(gpuipc__reclaimer *r) {
  if (r->stream)
    GPUIPC__CU(cuStreamDestroy, (CUstream)r->stream);
  r->stream = NULL;
}

/* ---- markers ------------------------------------------------------------------ */

static bool mark_done(gpuipc__mark *m);

/* Drops a reference. A marker nobody refers to is reused only once its
 * event completed: a stream may still wait for its pending record (a
 * reuse handed out ordered after it), and recording the event again must
 * not disturb that wait. Until then it waits on the retired list. */
static void mark_unref(gpuipc_arena *a, gpuipc__mark *m) {
  if (m == NULL || --m->refs > 0)
    return;
  if (!mark_done(m)) {
    m->next_free = a->mark_retired;
    a->mark_retired = m;
    return;
  }
  m->next_free = a->mark_free;
  a->mark_free = m;
}

/* Moves the retired markers that completed to the free list. */
static void marks_recycle(gpuipc_arena *a) {
  for (gpuipc__mark **pp = &a->mark_retired; *pp;) {
    gpuipc__mark *m = *pp;
    if (mark_done(m)) {
      *pp = m->next_free;
      m->next_free = a->mark_free;
      a->mark_free = m;
    } else {
      pp = &m->next_free;
    }
  }
}

static gpuipc__mark *mark_ref(gpuipc__mark *m) {
  if (m)
    m->refs++;
  return m;
}

/* True when the marker's event completed (no waiting). Context current. */
static bool mark_done(gpuipc__mark *m) {
  if (m == NULL || m->done)
    return true;
  CUresult r = GPUIPC__CU(cuEventQuery, (CUevent)m->ev);
  if (r == CUDA_SUCCESS)
    m->done = true;
  return m->done;
}

/* Records a new marker on rc's stream, after everything queued there so
 * far. Lock held, context current. */
static gpuipc_status mark_record(gpuipc_arena *a, const gpuipc__reclaimer *rc,
                                 gpuipc__mark **out) {
  if (a->mark_free == NULL)
    marks_recycle(a);
  gpuipc__mark *m = a->mark_free;
  if (m) {
    a->mark_free = m->next_free;
  } else {
    m = calloc(1, sizeof *m);
    if (m == NULL)
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "arena marker");
    CUevent ev;
    CUresult r = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) {
      free(m);
      return gpuipc__fail_cuda(r, "cuEventCreate", "arena marker");
    }
    m->ev = (struct CUevent_st *)ev;
  }
  m->refs = 1;
  m->done = false;
  m->src = rc->id;
  m->order = atomic_fetch_add(&mark_orders, 1) + 1;
  m->t_ns = gpuipc__now_ns();
  m->next_free = NULL;
  CUresult r = GPUIPC__CU(cuEventRecord, (CUevent)m->ev, (CUstream)rc->stream);
  if (r != CUDA_SUCCESS) {
    mark_unref(a, m);
    return gpuipc__fail_cuda(r, "cuEventRecord", "reclaim marker");
  }
  *out = m;
  return GPUIPC_OK;
}

/* ---- tags ------------------------------------------------------------------------ */

static void tags_clear(gpuipc_arena *a, gpuipc__tags *t) {
  for (uint32_t i = 0; i < t->n; i++)
    mark_unref(a, t->m[i]);
  free(t->m);
  *t = (gpuipc__tags){NULL, 0, 0};
}

/* Drops the markers that completed. */
static void tags_prune(gpuipc_arena *a, gpuipc__tags *t) {
  uint32_t k = 0;
  for (uint32_t i = 0; i < t->n; i++) {
    if (mark_done(t->m[i]))
      mark_unref(a, t->m[i]);
    else
      t->m[k++] = t->m[i];
  }
  t->n = k;
  if (k == 0)
    tags_clear(a, t);
}

/* Adds a reference to m (replacing an older marker of its stream). False
 * when memory for it ran out (the ordering is lost). */
static bool tags_add(gpuipc_arena *a, gpuipc__tags *t, gpuipc__mark *m) {
  if (mark_done(m))
    return true;
  for (uint32_t i = 0; i < t->n; i++)
    if (t->m[i]->src == m->src) {
      if (m->order > t->m[i]->order) {
        mark_unref(a, t->m[i]);
        t->m[i] = mark_ref(m);
      }
      return true;
    }
  if (t->n == t->cap) {
    size_t cap = t->cap;
    gpuipc__mark **n = gpuipc__grow(t->m, &cap, cap + 1, sizeof *n, 2);
    if (n == NULL)
      return false;
    t->m = n;
    t->cap = (uint32_t)cap;
  }
  t->m[t->n++] = mark_ref(m);
  return true;
}

/* True when some marker is overdue (see MARK_OVERDUE_NS). */
static bool tags_overdue(const gpuipc__tags *t, uint64_t now) {
  for (uint32_t i = 0; i < t->n; i++)
    if (!t->m[i]->done && now - t->m[i]->t_ns > MARK_OVERDUE_NS)
      return true;
  return false;
}

/* Orders `stream` after every marker not known complete. */
static CUresult tags_wait(const gpuipc__tags *t, struct CUstream_st *stream) {
  for (uint32_t i = 0; i < t->n; i++) {
    if (mark_done(t->m[i]))
      continue;
    CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream,
                            (CUevent)t->m[i]->ev, 0);
    if (r != CUDA_SUCCESS)
      return r;
  }
  return CUDA_SUCCESS;
}

/* ---- free list ------------------------------------------------------------------ */

/* Returns [off, off+len) of chunk to the free list; takes over *tags
 * (NULL: free at once). It merges with a neighbour only when neither waits
 * for anything. */
static gpuipc_status range_put(gpuipc_arena *a, uint32_t chunk, size_t off,
                               size_t len, gpuipc__tags *tags) {
  gpuipc__tags t = {NULL, 0, 0};
  if (tags) {
    t = *tags;
    *tags = (gpuipc__tags){NULL, 0, 0};
    tags_prune(a, &t);
  }
  gpuipc__range **pp = &a->free_list, *prev = NULL;
  while (*pp && ((*pp)->chunk < chunk ||
                 ((*pp)->chunk == chunk && (*pp)->off < off))) {
    prev = *pp;
    pp = &(*pp)->next;
  }
  gpuipc__range *next = *pp;
  if (t.n == 0) {
    if (prev && prev->chunk == chunk && prev->off + prev->len == off) {
      tags_prune(a, &prev->tags);
      if (prev->tags.n == 0) {
        prev->len += len;
        if (next && next->chunk == chunk && prev->off + prev->len == next->off) {
          tags_prune(a, &next->tags);
          if (next->tags.n == 0) {
            prev->len += next->len;
            prev->next = next->next;
            free(next);
          }
        }
        return GPUIPC_OK;
      }
    }
    if (next && next->chunk == chunk && off + len == next->off) {
      tags_prune(a, &next->tags);
      if (next->tags.n == 0) {
        next->off = off;
        next->len += len;
        return GPUIPC_OK;
      }
    }
  }
  gpuipc__range *r = malloc(sizeof *r);
  if (r == NULL) {
    tags_clear(a, &t);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "arena free range");
  }
  r->chunk = chunk;
  r->off = off;
  r->len = len;
  r->tags = t;
  r->next = next;
  *pp = r;
  return GPUIPC_OK;
}

/* Merges neighbours whose markers completed since they were freed. */
static void coalesce(gpuipc_arena *a) {
  for (gpuipc__range *r = a->free_list; r; r = r->next) {
    tags_prune(a, &r->tags);
    while (r->tags.n == 0 && r->next && r->next->chunk == r->chunk &&
           r->off + r->len == r->next->off) {
      gpuipc__range *n = r->next;
      tags_prune(a, &n->tags);
      if (n->tags.n != 0)
        break;
      r->len += n->len;
      r->next = n->next;
      free(n);
    }
  }
}

size_t gpuipc__arena_mempool_max = (size_t)4 << 30;

/* A chunk of a mempool arena above gpuipc__arena_mempool_max is VMM
 * memory: on an H200 (driver 580) another process's cuMemPoolImportPointer
 * of a 6 GiB pool allocation did not return (4.5 GiB imported), see
 * docs/driver-behaviour.md. Makes the VMM pool at the first such chunk;
 * without VMM, such chunks stay mempool memory. */
static gpuipc_status big_pool(gpuipc_arena *a, size_t bytes) {
  if (a->kind != GPUIPC_POOL_MEMPOOL || bytes <= gpuipc__arena_mempool_max ||
      a->big_pool != NULL)
    return GPUIPC_OK;
  gpuipc_uuid u;
  GPUIPC__CHECK(gpuipc_device_uuid(a->ordinal, &u));
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_VMM;
  po.device = &u;
  gpuipc_status s = gpuipc_pool_create(&po, &a->big_pool);
  if (s == GPUIPC_E_NOT_SUPPORTED) {
    GPUIPC__WARN("arena", "arena %llu: a chunk of %zu bytes stays mempool "
                          "memory (no VMM: %s); another process may fail to "
                          "import it",
                 (unsigned long long)a->id, bytes, gpuipc_last_error());
    a->big_pool = NULL;
    return GPUIPC_OK;
  }
  return s;
}

static gpuipc_status add_chunk(gpuipc_arena *a, size_t bytes) {
  if (a->nchunks >= GPUIPC__ARENA_MAX_CHUNKS)
    return gpuipc__fail(GPUIPC_E_OUT_OF_DEVICE_MEMORY,
                        "arena %llu has its maximum of %d chunks",
                        (unsigned long long)a->id, GPUIPC__ARENA_MAX_CHUNKS);
  if (a->max_bytes && a->total_bytes + bytes > a->max_bytes)
    return gpuipc__fail(GPUIPC_E_OUT_OF_DEVICE_MEMORY,
                        "arena %llu: %zu more bytes would exceed max_bytes %zu",
                        (unsigned long long)a->id, bytes, a->max_bytes);
  GPUIPC__CHECK(big_pool(a, bytes));
  gpuipc_buffer *buf = NULL;
  GPUIPC__CHECK(gpuipc__pool_chunk_alloc(
      a->big_pool && bytes > gpuipc__arena_mempool_max ? a->big_pool : a->pool,
      bytes, &buf));
  uint32_t i = a->nchunks;
  a->chunks[i].buf = buf;
  a->chunks[i].base = (uint64_t)(uintptr_t)gpuipc_buffer_get_ptr(buf);
  a->chunks[i].size = bytes;
  gpuipc_status s = range_put(a, i, 0, bytes, NULL);
  if (s != GPUIPC_OK) {
    gpuipc_buffer_free(buf, NULL);
    return s;
  }
  a->nchunks++;
  a->total_bytes += bytes;
  atomic_fetch_add(&chunks_live, 1);
  gpuipc__stats_add(GPUIPC__ST_ARENA_CHUNKS, 1);
  gpuipc__stats_add(GPUIPC__ST_ARENA_BYTES, (int64_t)bytes);
  GPUIPC__DEBUG("arena", "arena %llu: chunk %u of %zu bytes",
                (unsigned long long)a->id, i, bytes);
  return GPUIPC_OK;
}

/* ---- public ------------------------------------------------------------------------- */

static gpuipc_status arena_create(const gpuipc_arena_options *opts,
                                  gpuipc_pool_kind kind, gpuipc_arena **out);

gpuipc_status gpuipc_arena_create(const gpuipc_arena_options *opts,
                                  gpuipc_arena **out) {
  return arena_create(opts, GPUIPC_POOL_MEMPOOL, out);
}

static gpuipc_status arena_create(const gpuipc_arena_options *opts,
                                  gpuipc_pool_kind kind, gpuipc_arena **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_arena_create: out NULL");
  *out = NULL;
  gpuipc_arena_options o = GPUIPC_ARENA_OPTIONS_INIT;
  GPUIPC__CHECK(gpuipc__options_copy(
      &o, sizeof o, opts,
      offsetof(gpuipc_arena_options, device) + sizeof(o.device),
      "gpuipc_arena_options", "GPUIPC_ARENA_OPTIONS_INIT"));
  if (o.chunk_bytes == 0)
    o.chunk_bytes = (size_t)64 << 20;
  o.chunk_bytes = (o.chunk_bytes + GPUIPC__ARENA_ALIGN - 1) &
                  ~(size_t)(GPUIPC__ARENA_ALIGN - 1);
  if (o.max_bytes && o.max_bytes < o.chunk_bytes)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "arena max_bytes %zu < chunk_bytes %zu", o.max_bytes,
                        o.chunk_bytes);
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_arena *a = calloc(1, sizeof *a);
  if (a == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "arena");
  pthread_mutex_init(&a->lock, NULL);
  a->id = atomic_fetch_add(&arena_ids, 1) + 1;
  a->chunk_bytes = o.chunk_bytes;
  a->max_bytes = o.max_bytes;
  gpuipc_status s;
  gpuipc__ctx_guard g = {NULL};
  bool entered = false;
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = kind;
  po.device = o.device; /* NULL: local device 0 */
  GPUIPC__CHECK_GOTO(gpuipc_pool_create(&po, &a->pool), s, fail);
  a->kind = kind;
  a->ordinal = gpuipc__pool_ordinal(a->pool);
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, a->ordinal), s, fail);
  entered = true;
  GPUIPC__CHECK_GOTO(gpuipc__reclaimer_open(&a->own), s, fail);
  CUstream st;
  GPUIPC__CU_CHECK_GOTO(s, fail, cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  a->side = (struct CUstream_st *)st;
  GPUIPC__CHECK_GOTO(add_chunk(a, o.chunk_bytes), s, fail);
  gpuipc__ctx_leave(&g);
  gpuipc__stats_add(GPUIPC__ST_ARENAS, 1);
  *out = a;
  return GPUIPC_OK;
fail:
  gpuipc__reclaimer_close(&a->own);
  if (a->side)
    GPUIPC__CU(cuStreamDestroy, (CUstream)a->side);
  if (entered)
    gpuipc__ctx_leave(&g);
  gpuipc_pool_destroy(a->pool);
  if (a->big_pool)
    gpuipc_pool_destroy(a->big_pool);
  pthread_mutex_destroy(&a->lock);
  free(a);
  return s;
}

/* quiet: a busy arena returns GPUIPC_E_BUSY without recording an error
 * (the retries of arenas given up run inside other calls, whose own
 * error message must stay). */
static gpuipc_status arena_destroy(gpuipc_arena *a, bool *pending,
                                   bool *freed, bool quiet) {
  if (pending)
    *pending = false;
  if (freed)
    *freed = false;
  if (a == NULL)
    return GPUIPC_OK;
  pthread_mutex_lock(&a->lock);
  if (a->blocks_allocated || a->users) {
    size_t n = a->blocks_allocated;
    int u = a->users;
    pthread_mutex_unlock(&a->lock);
    if (quiet)
      return GPUIPC_E_BUSY;
    return gpuipc__fail(GPUIPC_E_BUSY,
                        "gpuipc_arena_destroy: %zu block(s) still allocated "
                        "or held, %d connection(s) still use it",
                        n, u);
  }
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, a->ordinal);
  if (s != GPUIPC_OK) {
    pthread_mutex_unlock(&a->lock);
    return s;
  }
  /* The memory goes only once every GPU-side wait its reuse depends on has
   * passed (releases of peers, the owner's frees): never waiting for them
   * here keeps destroy bounded whatever a peer does. */
  bool busy = GPUIPC__CU(cuStreamQuery, (CUstream)a->own.stream) ==
                  CUDA_ERROR_NOT_READY ||
              GPUIPC__CU(cuStreamQuery, (CUstream)a->side) ==
                  CUDA_ERROR_NOT_READY;
  for (gpuipc__range *r = a->free_list; r && !busy; r = r->next) {
    tags_prune(a, &r->tags);
    busy = r->tags.n > 0;
  }
  if (busy) {
    gpuipc__ctx_leave(&g);
    pthread_mutex_unlock(&a->lock);
    if (pending)
      *pending = true;
    if (quiet)
      return GPUIPC_E_BUSY;
    return gpuipc__fail(GPUIPC_E_BUSY,
                        "gpuipc_arena_destroy: GPU work that the reuse of "
                        "the arena's memory waits for has not completed (a "
                        "peer's release not yet written on its GPU, or "
                        "work the owner queued before a free)");
  }
  gpuipc__range *r = a->free_list;
  while (r) {
    gpuipc__range *n = r->next;
    tags_clear(a, &r->tags);
    free(r);
    r = n;
  }
  for (int l = 0; l < 2; l++) {
    gpuipc__mark *m = l ? a->mark_retired : a->mark_free;
    while (m) {
      gpuipc__mark *n = m->next_free;
      GPUIPC__CU(cuEventDestroy, (CUevent)m->ev);
      free(m);
      m = n;
    }
  }
  gpuipc__reclaimer_close(&a->own);
  GPUIPC__CU(cuStreamDestroy, (CUstream)a->side);
  for (uint32_t i = 0; i < a->nchunks; i++) {
    gpuipc_buffer_free(a->chunks[i].buf, NULL);
    atomic_fetch_sub(&chunks_live, 1);
    gpuipc__stats_add(GPUIPC__ST_ARENA_CHUNKS, -1);
    gpuipc__stats_add(GPUIPC__ST_ARENA_BYTES, -(int64_t)a->chunks[i].size);
  }
  gpuipc__ctx_leave(&g);
  s = gpuipc_pool_destroy(a->pool);
  if (a->big_pool) {
    gpuipc_status sb = gpuipc_pool_destroy(a->big_pool);
    if (s == GPUIPC_OK)
      s = sb;
  }
  pthread_mutex_unlock(&a->lock);
  pthread_mutex_destroy(&a->lock);
  gpuipc__stats_add(GPUIPC__ST_ARENAS, -1);
  free(a);
  if (freed)
    *freed = true;
  return s;
}

gpuipc_status gpuipc__arena_take(gpuipc_arena *a, size_t bytes,
                                 struct CUstream_st *stream, bool internal,
                                 gpuipc_block **out) {
  size_t need = (bytes + GPUIPC__ARENA_ALIGN - 1) &
                ~(size_t)(GPUIPC__ARENA_ALIGN - 1);
  gpuipc_block *b = malloc(sizeof *b);
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "block");
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, a->ordinal);
  if (s != GPUIPC_OK) {
    free(b);
    return s;
  }
  pthread_mutex_lock(&a->lock);
  coalesce(a);
  gpuipc__range **pick = NULL;
  uint64_t now = gpuipc__now_ns();
  /* Pass 0: memory free at once; 1: memory whose reuse waits on the GPU
   * for markers not overdue; then a new chunk; 2: any memory that fits
   * (a stream ordered after an overdue marker may wait long). */
  for (int pass = 0; pass < 3 && pick == NULL; pass++) {
    if (pass == 2) {
      size_t grow = need > a->chunk_bytes ? need : a->chunk_bytes;
      s = add_chunk(a, grow);
      if (s == GPUIPC_OK) {
        for (gpuipc__range **pp = &a->free_list; *pp; pp = &(*pp)->next)
          if ((*pp)->len >= need && (*pp)->chunk == a->nchunks - 1) {
            pick = pp;
            break;
          }
        break;
      }
    }
    for (gpuipc__range **pp = &a->free_list; *pp; pp = &(*pp)->next) {
      if ((*pp)->len < need)
        continue;
      if (pass == 0 && (*pp)->tags.n > 0)
        continue;
      if (pass == 1 && tags_overdue(&(*pp)->tags, now))
        continue;
      pick = pp;
      break;
    }
  }
  if (pick == NULL) {
    if (s == GPUIPC_OK)
      s = gpuipc__fail(GPUIPC_E_INTERNAL, "arena free list inconsistent");
    goto out;
  }
  s = GPUIPC_OK;
  gpuipc__range *r = *pick;
  if (r->tags.n > 0) {
    /* Stream-ordered reuse: the caller's stream waits for the releases of
     * the consumers that held this memory. */
    CUresult cr = tags_wait(&r->tags, stream);
    if (cr != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(cr, "cuStreamWaitEvent",
                            "ordering reuse of arena memory");
      goto out;
    }
  }
  b->arena = a;
  b->chunk = r->chunk;
  b->off = r->off;
  b->len = need;
  b->bytes = bytes;
  b->ptr = a->chunks[r->chunk].base + r->off;
  b->holders = 0;
  b->freed = false;
  b->internal = internal;
  b->lost = false;
  b->tags = (gpuipc__tags){NULL, 0, 0};
  if (r->len == need) {
    *pick = r->next;
    tags_clear(a, &r->tags);
    free(r);
  } else {
    r->off += need;
    r->len -= need;
  }
  a->blocks_allocated++;
  gpuipc__stats_add(GPUIPC__ST_ARENA_BLOCKS, 1);
  a->bytes_allocated += need;
  if (internal) {
    a->internal_blocks++;
    a->internal_bytes += need;
  }
  *out = b;
  b = NULL;
out:
  pthread_mutex_unlock(&a->lock);
  gpuipc__ctx_leave(&g);
  free(b);
  return s;
}

static gpuipc_status arena_alloc_block(gpuipc_arena *arena, size_t bytes,
                                       struct CUstream_st *stream,
                                       gpuipc_block **out) {
  if (arena == NULL || out == NULL || bytes == 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_arena_alloc: NULL arena/out or 0 bytes");
  *out = NULL;
  if (bytes > ((size_t)1 << 46))
    return gpuipc__fail(GPUIPC_E_OUT_OF_DEVICE_MEMORY,
                        "gpuipc_arena_alloc: %zu bytes", bytes);
  GPUIPC__CHECK(gpuipc__driver());
  return gpuipc__arena_take(arena, bytes, stream, false, out);
}

void *gpuipc_block_get_ptr(const gpuipc_block *b) {
  return b ? (void *)(uintptr_t)b->ptr : NULL;
}
size_t gpuipc_block_get_size(const gpuipc_block *b) { return b ? b->bytes : 0; }
unsigned gpuipc_block_get_holders(const gpuipc_block *b) {
  if (b == NULL)
    return 0;
  pthread_mutex_lock(&b->arena->lock);
  unsigned h = b->holders;
  pthread_mutex_unlock(&b->arena->lock);
  return h;
}

/* The memory of a block nobody holds goes back to the free list. */
static void block_release_memory(gpuipc_block *b) {
  gpuipc_arena *a = b->arena;
  a->blocks_allocated--;
  gpuipc__stats_add(GPUIPC__ST_ARENA_BLOCKS, -1);
  a->bytes_allocated -= b->len;
  if (b->internal) {
    a->internal_blocks--;
    a->internal_bytes -= b->len;
  }
  gpuipc_status s =
      b->lost ? gpuipc__fail(GPUIPC_E_NO_MEMORY, "ordering of its reuse lost")
              : range_put(a, b->chunk, b->off, b->len, &b->tags);
  if (s != GPUIPC_OK)
    GPUIPC__WARN("arena", "lost %zu bytes of arena %llu: %s", b->len,
                 (unsigned long long)a->id, gpuipc_last_error());
  tags_clear(a, &b->tags);
  free(b);
}

/* One holder of a block gave it back (released or died). Lock held. */
static void block_unhold(gpuipc_block *b) {
  gpuipc_arena *a = b->arena;
  if (b->holders > 0) {
    b->holders--;
    a->leases--;
  }
  if (b->holders == 0 && b->freed) {
    a->blocks_deferred--;
    gpuipc__stats_add(GPUIPC__ST_ARENA_DEFERRED, -1);
    block_release_memory(b);
  }
}

/* gpuipc_block_free, and when rc is set, its reuse also after everything
 * queued on rc so far. */
static gpuipc_status block_free(gpuipc_block *b, struct CUstream_st *stream,
                                const gpuipc__reclaimer *rc) {
  if (b == NULL)
    return GPUIPC_OK;
  gpuipc_arena *a = b->arena;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, a->ordinal));
  pthread_mutex_lock(&a->lock);
  gpuipc_status s = GPUIPC_OK;
  if (b->freed) {
    s = gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_block_free: freed twice");
    goto out;
  }
  /* The owner's own work queued on `stream` must be done before reuse: the
   * arena's reclaim stream waits for it, and the block's marker comes
   * after. */
  gpuipc__mark *m = NULL;
  s = mark_record(a, &(gpuipc__reclaimer){(struct CUstream_st *)stream, 0}, &m);
  if (s != GPUIPC_OK)
    goto out;
  CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)a->own.stream,
                          (CUevent)m->ev, 0);
  mark_unref(a, m);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuStreamWaitEvent",
                          "ordering the free of a block after its stream");
    goto out;
  }
  s = mark_record(a, &a->own, &m);
  if (s != GPUIPC_OK)
    goto out;
  if (!tags_add(a, &b->tags, m))
    b->lost = true;
  mark_unref(a, m);
  if (rc) {
    s = mark_record(a, rc, &m);
    if (s != GPUIPC_OK)
      goto out;
    if (!tags_add(a, &b->tags, m))
      b->lost = true;
    mark_unref(a, m);
  }
  b->freed = true;
  if (b->holders == 0)
    block_release_memory(b);
  else {
    a->blocks_deferred++;
    gpuipc__stats_add(GPUIPC__ST_ARENA_DEFERRED, 1);
  }
out:
  pthread_mutex_unlock(&a->lock);
  gpuipc__ctx_leave(&g);
  return s;
}

gpuipc_status gpuipc_block_free(gpuipc_block *b, struct CUstream_st *stream) {
  gpuipc_status s = block_free(b, stream, NULL);
  (void)gpuipc__arena_given_retry(); /* it may have been the last block */
  return s;
}

gpuipc_status gpuipc__block_free_after(gpuipc_block *b,
                                       const gpuipc__reclaimer *rc) {
  return block_free(b, NULL, rc);
}

/* The arena holding connections' flag words on each device: created on
 * first use and kept for the life of the process, so that a user's arena
 * can be destroyed while connections that carried its blocks stay open.
 * Its memory is VMM (cuMemCreate, shared by file descriptor), or, where
 * the device lacks VMM, cuMemAlloc memory shared by legacy IPC handle:
 * the driver refuses stream memory operations (cuStreamWriteValue /
 * WaitValue) on memory-pool memory, so the flag words cannot live in a
 * MEMPOOL arena like the data. */
static pthread_mutex_t ctl_lock = PTHREAD_MUTEX_INITIALIZER;
static gpuipc_arena *ctl_arenas[64];

gpuipc_status gpuipc__ctl_arena(int ordinal, gpuipc_arena **out) {
  if (ordinal < 0 || ordinal >= (int)GPUIPC__ARRAY_SIZE(ctl_arenas))
    return gpuipc__fail(GPUIPC_E_NO_DEVICE, "device %d", ordinal);
  gpuipc_status s = GPUIPC_OK;
  pthread_mutex_lock(&ctl_lock);
  if (ctl_arenas[ordinal] == NULL) {
    gpuipc_uuid u;
    gpuipc_arena_options o = GPUIPC_ARENA_OPTIONS_INIT;
    s = gpuipc_device_uuid(ordinal, &u);
    o.device = &u;
    o.chunk_bytes = (size_t)2 << 20; /* 512 connections of 256 slots */
    if (s == GPUIPC_OK)
      s = arena_create(&o, GPUIPC_POOL_VMM, &ctl_arenas[ordinal]);
    if (s == GPUIPC_E_NOT_SUPPORTED) {
      GPUIPC__INFO("arena", "device %d: no VMM for connection flag words "
                            "(%s); using cuMemAlloc memory with legacy IPC",
                   ordinal, gpuipc_last_error());
      s = arena_create(&o, GPUIPC_POOL_LEGACY, &ctl_arenas[ordinal]);
    }
  }
  *out = ctl_arenas[ordinal];
  pthread_mutex_unlock(&ctl_lock);
  return s;
}

gpuipc_status gpuipc_block_wait(gpuipc_block *b, struct CUstream_st *stream) {
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_block_wait: NULL");
  gpuipc_arena *a = b->arena;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, a->ordinal));
  pthread_mutex_lock(&a->lock);
  gpuipc_status s = GPUIPC_OK;
  tags_prune(a, &b->tags);
  if (b->tags.n > 0) {
    CUresult r = tags_wait(&b->tags, stream);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuStreamWaitEvent",
                            "ordering reuse of a released block");
  }
  pthread_mutex_unlock(&a->lock);
  gpuipc__ctx_leave(&g);
  return s;
}

bool gpuipc__block_pending(gpuipc_block *b, uint64_t src) {
  gpuipc_arena *a = b->arena;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, a->ordinal) != GPUIPC_OK)
    return true; /* not known complete */
  pthread_mutex_lock(&a->lock);
  tags_prune(a, &b->tags);
  bool pending = false;
  for (uint32_t i = 0; i < b->tags.n && !pending; i++)
    pending = src == 0 || b->tags.m[i]->src == src;
  pthread_mutex_unlock(&a->lock);
  gpuipc__ctx_leave(&g);
  return pending;
}

gpuipc_status gpuipc__arena_release(gpuipc_arena *a,
                                    const gpuipc__reclaimer *rc,
                                    const gpuipc__release *rel, int n,
                                    bool dead) {
  gpuipc_status s = GPUIPC_OK;
  pthread_mutex_lock(&a->lock);
  bool any_ordered = false;
  uint64_t prev_word = 0, prev_value = 0;
  for (int i = 0; i < n; i++) {
    any_ordered |= rel[i].ordered;
    if (dead)
      continue;
    CUresult r = CUDA_SUCCESS;
    if (rel[i].word && rel[i].word == prev_word && rel[i].value == prev_value)
      continue; /* the same wait as the one just queued (a batch's) */
    prev_word = rel[i].word;
    prev_value = rel[i].value;
    if (rel[i].word)
      /* Reuse waits, on the GPU, for the consumer's release write. */
      r = GPUIPC__CU(cuStreamWaitValue64, (CUstream)rc->stream,
                     (CUdeviceptr)rel[i].word, (cuuint64_t)rel[i].value,
                     CU_STREAM_WAIT_VALUE_GEQ);
    else if (rel[i].event)
      r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)rc->stream,
                     (CUevent)rel[i].event, 0);
    if (r != CUDA_SUCCESS && s == GPUIPC_OK)
      s = gpuipc__fail_cuda(r, rel[i].word ? "cuStreamWaitValue64"
                                           : "cuStreamWaitEvent",
                            "reclaim wait for release %llu",
                            (unsigned long long)rel[i].value);
  }
  if (any_ordered) {
    /* One marker after this frame's waits (and every earlier wait of this
     * peer) tags each ordered block; a dead peer's marker still covers the
     * waits queued before its death (their words were written for it). */
    gpuipc__mark *m = NULL;
    gpuipc_status ms = s == GPUIPC_OK ? mark_record(a, rc, &m) : s;
    if (ms != GPUIPC_OK && s == GPUIPC_OK)
      s = ms;
    for (int i = 0; i < n; i++)
      if (rel[i].ordered && (m == NULL || !tags_add(a, &rel[i].block->tags, m)))
        rel[i].block->lost = true;
    mark_unref(a, m);
  }
  for (int i = 0; i < n; i++)
    block_unhold(rel[i].block);
  pthread_mutex_unlock(&a->lock);
  return s;
}

void gpuipc__arena_user_add(gpuipc_arena *a) {
  pthread_mutex_lock(&a->lock);
  a->users++;
  pthread_mutex_unlock(&a->lock);
}

void gpuipc__arena_user_remove(gpuipc_arena *a) {
  pthread_mutex_lock(&a->lock);
  a->users--;
  pthread_mutex_unlock(&a->lock);
}

void gpuipc__arena_chunk(gpuipc_arena *a, uint32_t ci, gpuipc_buffer **buf,
                         size_t *size) {
  pthread_mutex_lock(&a->lock);
  *buf = ci < a->nchunks ? a->chunks[ci].buf : NULL;
  *size = ci < a->nchunks ? a->chunks[ci].size : 0;
  pthread_mutex_unlock(&a->lock);
}

bool gpuipc__block_sendable(gpuipc_block *b) {
  pthread_mutex_lock(&b->arena->lock);
  bool ok = !b->freed && !b->internal;
  pthread_mutex_unlock(&b->arena->lock);
  return ok;
}

void gpuipc__block_hold(gpuipc_block *b) {
  gpuipc_arena *a = b->arena;
  pthread_mutex_lock(&a->lock);
  b->holders++;
  a->leases++;
  pthread_mutex_unlock(&a->lock);
}

gpuipc_status gpuipc__arena_read_words(gpuipc_arena *a, uint64_t words,
                                       uint32_t n, uint64_t *out) {
  CUresult r = GPUIPC__CU(cuMemcpyDtoHAsync, out, (CUdeviceptr)words,
                          sizeof *out * n, (CUstream)a->side);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamSynchronize, (CUstream)a->side);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemcpyDtoHAsync", "reading flag words");
  return GPUIPC_OK;
}

/* No lock: the side stream is the arena's for its life, and enqueueing on
 * a stream is thread-safe. */
gpuipc_status gpuipc__arena_force_words(gpuipc_arena *a, const uint64_t *words,
                                        int n, uint64_t value) {
  for (int i = 0; i < n; i++) {
    CUresult r = GPUIPC__CU(cuStreamWriteValue64, (CUstream)a->side,
                            (CUdeviceptr)words[i], (cuuint64_t)value, 0);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuStreamWriteValue64",
                               "unblocking flag words of a dead peer");
  }
  CUresult r = GPUIPC__CU(cuStreamSynchronize, (CUstream)a->side);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuStreamSynchronize", "side stream");
  return GPUIPC_OK;
}

static gpuipc_status arena_get_stats(gpuipc_arena *a, gpuipc_arena_stats *st) {
  if (a == NULL || st == NULL ||
      st->size < offsetof(gpuipc_arena_stats, leases) + sizeof(size_t))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_arena_get_stats: NULL or size too small (use "
                        "GPUIPC_ARENA_STATS_INIT)");
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, a->ordinal));
  pthread_mutex_lock(&a->lock);
  gpuipc_arena_stats s = {sizeof s,
                          a->nchunks,
                          a->total_bytes,
                          a->bytes_allocated - a->internal_bytes,
                          a->blocks_allocated - a->internal_blocks,
                          a->blocks_deferred,
                          a->leases};
  pthread_mutex_unlock(&a->lock);
  gpuipc__ctx_leave(&g);
  size_t n = st->size < sizeof s ? st->size : sizeof s;
  memcpy(st, &s, n);
  st->size = n;
  return GPUIPC_OK;
}

gpuipc_pool_kind gpuipc__arena_chunk_kind(gpuipc_arena *a, uint32_t i) {
  pthread_mutex_lock(&a->lock);
  gpuipc_pool_kind k = i < a->nchunks ? gpuipc_buffer_get_kind(a->chunks[i].buf)
                                      : GPUIPC_POOL_AUTO;
  pthread_mutex_unlock(&a->lock);
  return k;
}

/* ---- the public calls whose answer depends on orphans -------------------------- */

static void (*_Atomic reaper)(bool now);

void gpuipc__arena_set_reaper(void (*reap)(bool now)) {
  atomic_store_explicit(&reaper, reap, memory_order_release);
}

/* now: look at every orphan's peer (statistics and destroy must see what
 * a peer gone a moment ago held); else at most every few ms (alloc). */
static void reap_orphans(bool now) {
  void (*reap)(bool) = atomic_load_explicit(&reaper, memory_order_acquire);
  if (reap)
    reap(now);
}

gpuipc_status gpuipc_arena_alloc(gpuipc_arena *arena, size_t bytes,
                                 struct CUstream_st *stream,
                                 gpuipc_block **out) {
  reap_orphans(false);
  (void)gpuipc__arena_given_retry();
  return arena_alloc_block(arena, bytes, stream, out);
}

gpuipc_status gpuipc_arena_get_stats(gpuipc_arena *arena,
                                     gpuipc_arena_stats *st) {
  reap_orphans(true);
  return arena_get_stats(arena, st);
}

/* Destroy waits up to this long for GPU-side releases that the reuse of
 * the arena's memory still waits for (see gpuipc_arena_destroy). */
#define DESTROY_WAIT_MS 2000

gpuipc_status gpuipc_arena_destroy(gpuipc_arena *arena) {
  if (arena == NULL)
    return GPUIPC_OK;
  uint64_t deadline = gpuipc__now_ns() + DESTROY_WAIT_MS * 1000000ull;
  for (;;) {
    reap_orphans(true);
    bool pending = false;
    gpuipc_status s = arena_destroy(arena, &pending, NULL, false);
    if (!pending || gpuipc__now_ns() >= deadline)
      return s;
    usleep(1000);
  }
}

/* ---- destroy when drained ---------------------------------------------------------- */

/* Arenas the application gave up, destroyed by the first retry that finds
 * them drained. The lock guards the list only: the destroys run on arenas
 * taken off it. */
static pthread_mutex_t given_lock = PTHREAD_MUTEX_INITIALIZER;
static gpuipc_arena *given;
static atomic_int n_given;

static void given_add(gpuipc_arena *a) {
  pthread_mutex_lock(&given_lock);
  a->next_given = given;
  given = a;
  atomic_fetch_add(&n_given, 1);
  pthread_mutex_unlock(&given_lock);
}

size_t gpuipc__arena_given_retry(void) {
  if (GPUIPC__LIKELY(atomic_load_explicit(&n_given, memory_order_relaxed) ==
                     0))
    return 0;
  pthread_mutex_lock(&given_lock);
  gpuipc_arena *list = given;
  given = NULL;
  pthread_mutex_unlock(&given_lock);
  while (list) {
    gpuipc_arena *a = list;
    list = a->next_given;
    a->next_given = NULL;
    bool freed = false;
    gpuipc_status s = arena_destroy(a, NULL, &freed, true);
    if (freed) {
      if (s != GPUIPC_OK)
        GPUIPC__WARN("arena", "destroying a drained arena: %s",
                     gpuipc_last_error());
      atomic_fetch_sub(&n_given, 1);
      continue;
    }
    pthread_mutex_lock(&given_lock);
    a->next_given = given;
    given = a;
    pthread_mutex_unlock(&given_lock);
  }
  return (size_t)atomic_load(&n_given);
}

gpuipc_status gpuipc_arena_release(gpuipc_arena *arena) {
  if (arena == NULL)
    return GPUIPC_OK;
  reap_orphans(true);
  bool freed = false;
  gpuipc_status s = arena_destroy(arena, NULL, &freed, true);
  if (freed || s != GPUIPC_E_BUSY)
    return s;
  /* Blocks still out, or GPU work its reuse waits for: kept. */
  GPUIPC__DEBUG("arena", "arena %llu given up while busy: destroyed once "
                         "drained",
                (unsigned long long)arena->id);
  given_add(arena);
  return GPUIPC_OK;
}
