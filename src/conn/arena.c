/*
 * arena.c: owns arenas: IPC-capable device memory in chunks (each one
 * allocation of a handle-layer pool: a memory pool with file-descriptor
 * export for the arenas of gpuipc_arena_create, VMM or legacy memory for
 * the process's flag-word arenas) carved into blocks with a first-fit
 * allocator, and the stream-ordered reuse of memory that consumers held.
 * The arena's lock is taken only here. The public gpuipc_arena_alloc,
 * _get_stats and _destroy enter through lease.c (which first reclaims what
 * orphaned leases of departed peers held) and come here.
 *
 * Reuse. A block a consumer held may be handed out again only after the
 * consumer's GPU work on it is done. The consumer says so on the GPU: its
 * release writes a sequence number into a flag word. When the release
 * message arrives (lease.c), the arena enqueues on its own non-blocking
 * "reclaim" stream a wait for that word, then records an event (a marker)
 * and tags the block with it. The memory of a freed block goes back to the
 * free list with its newest marker; gpuipc_arena_alloc hands such memory
 * out at once when the marker's event completed, and otherwise orders the
 * caller's stream after it (cuStreamWaitEvent): reuse never waits on the
 * host. Markers of one arena complete in order (one stream), so of two
 * tags the newer covers the older, which keeps merging free ranges simple.
 */
#include "arena_int.h"

#include <stdatomic.h>

#include <stdlib.h>
#include <string.h>

static atomic_uint_fast64_t arena_ids;
/* Device allocations (chunks) the arenas of this process hold, flag-word
 * arenas included: a leak check that, unlike cuMemGetInfo, does not see
 * other processes sharing the device. */
static atomic_size_t chunks_live;

size_t gpuipc__arena_chunks_live(void) { return atomic_load(&chunks_live); }

static gpuipc_status arena_mark(gpuipc_arena *a, gpuipc_block **blocks,
                                int n);

/* ---- markers ------------------------------------------------------------------ */

static void mark_unref(gpuipc_arena *a, gpuipc__mark *m) {
  if (m == NULL || --m->refs > 0)
    return;
  m->next_free = a->mark_free;
  a->mark_free = m;
}

static gpuipc__mark *mark_ref(gpuipc__mark *m) {
  if (m)
    m->refs++;
  return m;
}

/* The newer of two markers (either may be NULL). */
static gpuipc__mark *mark_newer(gpuipc__mark *x, gpuipc__mark *y) {
  if (x == NULL)
    return y;
  if (y == NULL)
    return x;
  return x->order >= y->order ? x : y;
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

static gpuipc_status mark_new(gpuipc_arena *a, gpuipc__mark **out) {
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
  m->order = ++a->mark_order;
  m->next_free = NULL;
  *out = m;
  return GPUIPC_OK;
}

/* ---- free list ------------------------------------------------------------------ */

/* Returns [off, off+len) of chunk to the free list, merging with
 * neighbours. Takes over the caller's reference to tag. */
static gpuipc_status range_put(gpuipc_arena *a, uint32_t chunk, size_t off,
                               size_t len, gpuipc__mark *tag) {
  if (tag && mark_done(tag)) {
    mark_unref(a, tag);
    tag = NULL;
  }
  gpuipc__range **pp = &a->free_list, *prev = NULL;
  while (*pp && ((*pp)->chunk < chunk ||
                 ((*pp)->chunk == chunk && (*pp)->off < off))) {
    prev = *pp;
    pp = &(*pp)->next;
  }
  gpuipc__range *next = *pp;
  if (prev && prev->chunk == chunk && prev->off + prev->len == off) {
    prev->len += len;
    gpuipc__mark *t = mark_newer(prev->tag, tag);
    if (t != prev->tag) {
      mark_unref(a, prev->tag);
      prev->tag = mark_ref(t);
    }
    mark_unref(a, tag);
    if (next && next->chunk == chunk && prev->off + prev->len == next->off) {
      prev->len += next->len;
      gpuipc__mark *t2 = mark_newer(prev->tag, next->tag);
      if (t2 != prev->tag) {
        mark_unref(a, prev->tag);
        prev->tag = mark_ref(t2);
      }
      mark_unref(a, next->tag);
      prev->next = next->next;
      free(next);
    }
    return GPUIPC_OK;
  }
  if (next && next->chunk == chunk && off + len == next->off) {
    next->off = off;
    next->len += len;
    gpuipc__mark *t = mark_newer(next->tag, tag);
    if (t != next->tag) {
      mark_unref(a, next->tag);
      next->tag = mark_ref(t);
    }
    mark_unref(a, tag);
    return GPUIPC_OK;
  }
  gpuipc__range *r = malloc(sizeof *r);
  if (r == NULL) {
    mark_unref(a, tag);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "arena free range");
  }
  r->chunk = chunk;
  r->off = off;
  r->len = len;
  r->tag = tag;
  r->next = next;
  *pp = r;
  return GPUIPC_OK;
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
  gpuipc_buffer *buf = NULL;
  GPUIPC__CHECK(gpuipc__pool_chunk_alloc(a->pool, bytes, &buf));
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
  po.device_uuid = o.device; /* NULL: local device 0 */
  GPUIPC__CHECK_GOTO(gpuipc_pool_create(&po, &a->pool), s, fail);
  a->ordinal = gpuipc__pool_ordinal(a->pool);
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, a->ordinal), s, fail);
  entered = true;
  CUstream st;
  GPUIPC__CU_CHECK_GOTO(s, fail, cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  a->reclaim = (struct CUstream_st *)st;
  GPUIPC__CU_CHECK_GOTO(s, fail, cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  a->side = (struct CUstream_st *)st;
  GPUIPC__CHECK_GOTO(add_chunk(a, o.chunk_bytes), s, fail);
  gpuipc__ctx_leave(&g);
  gpuipc__stats_add(GPUIPC__ST_ARENAS, 1);
  *out = a;
  return GPUIPC_OK;
fail:
  if (a->reclaim)
    GPUIPC__CU(cuStreamDestroy, (CUstream)a->reclaim);
  if (a->side)
    GPUIPC__CU(cuStreamDestroy, (CUstream)a->side);
  if (entered)
    gpuipc__ctx_leave(&g);
  gpuipc_pool_destroy(a->pool);
  pthread_mutex_destroy(&a->lock);
  free(a);
  return s;
}

gpuipc_status gpuipc__arena_destroy(gpuipc_arena *a) {
  if (a == NULL)
    return GPUIPC_OK;
  pthread_mutex_lock(&a->lock);
  if (a->blocks_allocated || a->users) {
    size_t n = a->blocks_allocated;
    int u = a->users;
    pthread_mutex_unlock(&a->lock);
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
  /* Everything queued on the reclaim stream refers to this memory. */
  GPUIPC__CU(cuStreamSynchronize, (CUstream)a->reclaim);
  GPUIPC__CU(cuStreamSynchronize, (CUstream)a->side);
  gpuipc__range *r = a->free_list;
  while (r) {
    gpuipc__range *n = r->next;
    mark_unref(a, r->tag);
    free(r);
    r = n;
  }
  mark_unref(a, a->last_mark);
  gpuipc__mark *m = a->mark_free;
  while (m) {
    gpuipc__mark *n = m->next_free;
    GPUIPC__CU(cuEventDestroy, (CUevent)m->ev);
    free(m);
    m = n;
  }
  GPUIPC__CU(cuStreamDestroy, (CUstream)a->reclaim);
  GPUIPC__CU(cuStreamDestroy, (CUstream)a->side);
  for (uint32_t i = 0; i < a->nchunks; i++) {
    gpuipc_buffer_free(a->chunks[i].buf, NULL);
    atomic_fetch_sub(&chunks_live, 1);
    gpuipc__stats_add(GPUIPC__ST_ARENA_CHUNKS, -1);
    gpuipc__stats_add(GPUIPC__ST_ARENA_BYTES, -(int64_t)a->chunks[i].size);
  }
  gpuipc__ctx_leave(&g);
  s = gpuipc_pool_destroy(a->pool);
  pthread_mutex_unlock(&a->lock);
  pthread_mutex_destroy(&a->lock);
  gpuipc__stats_add(GPUIPC__ST_ARENAS, -1);
  free(a);
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
  gpuipc__range **pick = NULL;
  for (int pass = 0; pass < 2 && pick == NULL; pass++) {
    /* First pass: memory free at once (no marker, or a completed one);
     * second: memory whose reuse must wait on the GPU. */
    for (gpuipc__range **pp = &a->free_list; *pp; pp = &(*pp)->next) {
      if ((*pp)->len < need)
        continue;
      if (pass == 0 && !mark_done((*pp)->tag))
        continue;
      pick = pp;
      break;
    }
    if (pick == NULL && pass == 1) {
      size_t grow = need > a->chunk_bytes ? need : a->chunk_bytes;
      s = add_chunk(a, grow);
      if (s != GPUIPC_OK)
        goto out;
      for (gpuipc__range **pp = &a->free_list; *pp; pp = &(*pp)->next)
        if ((*pp)->len >= need && (*pp)->chunk == a->nchunks - 1) {
          pick = pp;
          break;
        }
    }
  }
  if (pick == NULL) {
    s = gpuipc__fail(GPUIPC_E_INTERNAL, "arena free list inconsistent");
    goto out;
  }
  gpuipc__range *r = *pick;
  if (r->tag && !mark_done(r->tag)) {
    /* Stream-ordered reuse: the caller's stream waits for the releases of
     * the consumers that held this memory. */
    CUresult cr = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream,
                             (CUevent)r->tag->ev, 0);
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
  b->unmarked = false;
  b->tag = NULL;
  if (r->len == need) {
    *pick = r->next;
    mark_unref(a, r->tag);
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

gpuipc_status gpuipc__arena_alloc_block(gpuipc_arena *arena, size_t bytes,
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
  gpuipc_status s = range_put(a, b->chunk, b->off, b->len, b->tag);
  if (s != GPUIPC_OK)
    GPUIPC__WARN("arena", "lost %zu bytes of arena %llu: %s", b->len,
                 (unsigned long long)a->id, gpuipc_last_error());
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

gpuipc_status gpuipc_block_free(gpuipc_block *b, struct CUstream_st *stream) {
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
   * reclaim stream waits for it, and the block's marker comes after. */
  gpuipc__mark *m = NULL;
  s = mark_new(a, &m);
  if (s != GPUIPC_OK)
    goto out;
  CUresult r = GPUIPC__CU(cuEventRecord, (CUevent)m->ev, (CUstream)stream);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)a->reclaim, (CUevent)m->ev, 0);
  mark_unref(a, m);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuEventRecord/cuStreamWaitEvent",
                          "ordering the free of a block after its stream");
    goto out;
  }
  gpuipc_block *one = b;
  s = arena_mark(a, &one, 1);
  if (s != GPUIPC_OK)
    goto out;
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
  if (b->unmarked)
    s = arena_mark(a, &b, 1);
  if (s == GPUIPC_OK && b->tag && !mark_done(b->tag)) {
    CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream,
                            (CUevent)b->tag->ev, 0);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuStreamWaitEvent",
                            "ordering reuse of a released block");
  }
  pthread_mutex_unlock(&a->lock);
  gpuipc__ctx_leave(&g);
  return s;
}

/* Enqueues, on the reclaim stream, a wait until the 64-bit word at `word`
 * (a device address) reaches value (wrap-around GEQ). Lock held. */
static gpuipc_status wait_word(gpuipc_arena *a, uint64_t word,
                               uint64_t value) {
  CUresult r = GPUIPC__CU(cuStreamWaitValue64, (CUstream)a->reclaim,
                          (CUdeviceptr)word, (cuuint64_t)value,
                          CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuStreamWaitValue64",
                             "reclaim wait for release %llu",
                             (unsigned long long)value);
  return GPUIPC_OK;
}

/* Records a new marker on the reclaim stream, after every wait enqueued so
 * far; tags each block with it. Lock held. */
static gpuipc_status arena_mark(gpuipc_arena *a, gpuipc_block **blocks,
                                int n) {
  gpuipc__mark *m = NULL;
  GPUIPC__CHECK(mark_new(a, &m));
  CUresult r = GPUIPC__CU(cuEventRecord, (CUevent)m->ev, (CUstream)a->reclaim);
  if (r != CUDA_SUCCESS) {
    mark_unref(a, m);
    return gpuipc__fail_cuda(r, "cuEventRecord", "reclaim marker");
  }
  for (int i = 0; i < n; i++) {
    mark_unref(a, blocks[i]->tag);
    blocks[i]->tag = mark_ref(m);
    blocks[i]->unmarked = false;
  }
  mark_unref(a, a->last_mark);
  a->last_mark = m; /* keeps the creation reference */
  return GPUIPC_OK;
}

gpuipc_status gpuipc__arena_release(gpuipc_arena *a, const gpuipc__release *rel,
                                    int n, bool dead) {
  gpuipc_status s = GPUIPC_OK;
  pthread_mutex_lock(&a->lock);
  bool any_ordered = false;
  for (int i = 0; i < n && !dead; i++) {
    gpuipc_status ws = GPUIPC_OK;
    if (rel[i].word) {
      ws = wait_word(a, rel[i].word, rel[i].value);
      any_ordered = true;
    } else if (rel[i].event) {
      CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)a->reclaim,
                              (CUevent)rel[i].event, 0);
      if (r != CUDA_SUCCESS)
        ws = gpuipc__fail_cuda(r, "cuStreamWaitEvent", "release event");
      any_ordered = true;
    }
    if (ws != GPUIPC_OK && s == GPUIPC_OK)
      s = ws;
  }
  if (dead) {
    /* The holder is gone: no new wait, but the block's reuse must still
     * come after any reclaim wait already queued for it, which the newest
     * marker covers. */
    for (int i = 0; i < n; i++) {
      gpuipc_block *b = rel[i].block;
      if (rel[i].ordered) {
        gpuipc_status ms = arena_mark(a, &b, 1);
        if (ms != GPUIPC_OK && s == GPUIPC_OK)
          s = ms;
      }
    }
  } else if (any_ordered) {
    /* A marker (an event record) is needed only where memory goes back to
     * the free list now: blocks freed by their owner whose last holder this
     * was. Others are marked lazily, when freed or waited for
     * (gpuipc_block_wait): the reclaim stream runs in order, so a later
     * marker covers every wait queued before it. */
    gpuipc_block *now[64];
    int nn = 0;
    for (int i = 0; i < n; i++) {
      gpuipc_block *b = rel[i].block;
      if (!rel[i].ordered)
        continue;
      if (b->freed && b->holders == 1 && nn < (int)GPUIPC__ARRAY_SIZE(now))
        now[nn++] = b;
      else
        b->unmarked = true;
    }
    if (nn) {
      gpuipc_status ms = arena_mark(a, now, nn);
      if (ms != GPUIPC_OK && s == GPUIPC_OK)
        s = ms;
    }
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

gpuipc_status gpuipc__arena_get_stats(gpuipc_arena *a, gpuipc_arena_stats *st) {
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
