/*
 * buffer.c: owns the buffer object and what every kind shares: allocating
 * a buffer from a pool (capacity, buffer id, generation; an arena's chunk,
 * finished before it is handed out), wrapping foreign allocations (finding
 * the kind, base, range and offset), exporting a buffer as a descriptor
 * (+ fd), importing a descriptor (the liveness table's verdict, devices,
 * then gpuipc__buffer_open: the import cache, the range check of a cache
 * hit, the object; interop.c's raw imports end there too), closing and
 * freeing, and keeping a buffer until its last lease is released
 * (gpuipc_buffer_release_when_done). What differs per kind is called
 * through the kind's table (legacy.c, mempool.c, vmm.c, pinned.c); the
 * helpers the kinds' openers share are below them, in kind.c (names, the
 * checks of an imported fd and of a descriptor's range) and import.c (the
 * fd an import maps, the shadowed-mapping check).
 *
 * Buffer ids: CU_POINTER_ATTRIBUTE_BUFFER_ID is read at the exporter and
 * travels in the descriptor as part of the allocation's identity (cache
 * keys). It is never compared with the id the importer's driver reports:
 * on driver 580 every import (legacy or pool) gets importer-local ids.
 */
#include "handle_int.h"
#include "core/stats.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static gpuipc_buffer *buffer_new(void) {
  gpuipc_buffer *b = calloc(1, sizeof *b);
  if (b == NULL)
    return NULL;
  b->fd = -1;
  b->pool_fd = -1;
  b->ordinal = -1;
  b->map_ordinal = -1;
  atomic_init(&b->refs, 1);
  pthread_mutex_init(&b->lock, NULL);
  return b;
}

static void buffer_delete(gpuipc_buffer *b) {
  pthread_mutex_destroy(&b->lock);
  free(b);
}

gpuipc_status gpuipc_buffer_alloc(gpuipc_pool *pool, size_t size,
                                  struct CUstream_st *stream,
                                  gpuipc_buffer **out) {
  if (out == NULL || pool == NULL || size == 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_alloc: NULL pool/out or size 0");
  *out = NULL;
  if (pool->imported)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_buffer_alloc: cannot allocate from an "
                        "imported pool (the driver refuses)");
  GPUIPC__CHECK(gpuipc__driver());
  bool counted = false;
  if (pool->capacity && !pool->ops->driver_capacity) {
    size_t before = atomic_fetch_add(&pool->in_use, size);
    counted = true;
    if (before + size > pool->capacity || before + size < before) {
      atomic_fetch_sub(&pool->in_use, size);
      return gpuipc__fail(GPUIPC_E_LIMIT,
                          "pool %llu: %zu more bytes would exceed its "
                          "capacity of %zu (%zu in use)",
                          (unsigned long long)pool->id, size, pool->capacity,
                          before);
    }
  }
  gpuipc_buffer *b = buffer_new();
  gpuipc_status s = GPUIPC_OK;
  gpuipc__ctx_guard g = {0};
  bool entered = false;
  if (b == NULL) {
    s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "buffer");
    goto fail;
  }
  b->origin = GPUIPC__ALLOCATED;
  b->kind = pool->kind;
  b->ops = pool->ops;
  b->ordinal = b->map_ordinal = pool->ordinal;
  b->uuid = pool->uuid;
  b->size = size;
  b->pool = pool;
  b->pool_id = pool->id;
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, pool->ordinal), s, fail);
  entered = true;
  GPUIPC__CHECK_GOTO(pool->ops->alloc(pool, b, size, (CUstream)stream), s,
                     fail);
  /* The exporter's buffer id is part of the allocation's identity in
   * descriptors (importers' cache keys). Memory named by its handle must
   * have one; memory named by its fd and generation need not. */
  if (b->ops->named_by_handle) {
    s = gpuipc__pointer_buffer_id(b->base, &b->buffer_id);
    if (s != GPUIPC_OK) {
      (void)b->ops->free(b, (CUstream)stream);
      goto fail;
    }
  } else {
    unsigned long long v = 0;
    if (GPUIPC__CU(cuPointerGetAttribute, &v, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                   b->base) == CUDA_SUCCESS)
      b->buffer_id = v;
  }
  b->generation = gpuipc__next_generation();
  gpuipc__ctx_leave(&g);
  atomic_fetch_add(&pool->live, 1);
  gpuipc__stats_add(GPUIPC__ST_POOL_BUFFERS, 1);
  gpuipc__stats_add(GPUIPC__ST_POOL_BYTES, (int64_t)b->size);
  *out = b;
  return GPUIPC_OK;
fail:
  if (entered)
    gpuipc__ctx_leave(&g);
  if (counted)
    atomic_fetch_sub(&pool->in_use, size);
  if (b)
    buffer_delete(b);
  return s;
}

gpuipc_status gpuipc__pool_chunk_alloc(gpuipc_pool *pool, size_t size,
                                       gpuipc_buffer **buf) {
  if (pool == NULL || buf == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc__pool_chunk_alloc: NULL");
  if (!pool->ops->stream_ordered)
    return gpuipc_buffer_alloc(pool, size, NULL, buf);
  /* A mempool allocation is stream-ordered, and an arena chunk must be
   * usable by any stream at once, so the allocation is finished here. It is
   * made and awaited on a private non-blocking stream: synchronizing the
   * legacy default stream instead would wait for every blocking stream of
   * the context, including a caller's stream that waits (on the GPU) for a
   * consumer that is waiting for this very process. */
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, pool->ordinal));
  CUstream st = NULL;
  gpuipc_status s = GPUIPC_OK;
  CUresult r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuStreamCreate", "arena allocation");
    goto out;
  }
  s = gpuipc_buffer_alloc(pool, size, (struct CUstream_st *)st, buf);
  if (s != GPUIPC_OK)
    goto out;
  r = GPUIPC__CU(cuStreamSynchronize, st);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuStreamSynchronize", "arena allocation");
    gpuipc_buffer_free(*buf, (struct CUstream_st *)st);
    (void)GPUIPC__CU(cuStreamSynchronize, st);
    *buf = NULL;
  }
out:
  if (st != NULL)
    (void)GPUIPC__CU(cuStreamDestroy, st);
  gpuipc__ctx_leave(&g);
  return s;
}

/* ---- wrap ------------------------------------------------------------------------- */

gpuipc_status gpuipc_buffer_wrap(void *ptr, size_t size, gpuipc_buffer **out) {
  if (out == NULL || ptr == NULL || size == 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_wrap: NULL pointer/out or size 0");
  *out = NULL;
  GPUIPC__CHECK(gpuipc__driver());
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
  int ordinal = -1;
  CUresult r = GPUIPC__CU(cuPointerGetAttribute, &ordinal,
                          CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuPointerGetAttribute",
                             "CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL of %p: not "
                             "device memory known to the driver",
                             ptr);
  gpuipc_buffer *b = buffer_new();
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "buffer");
  gpuipc_status s = GPUIPC_OK;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, ordinal), s, fail_noctx);
  /* Which kind of memory is it? Pool memory names its pool; cuMemAlloc
   * memory is legacy-IPC capable; anything else may be a VMM mapping (an
   * allocation handle is behind it). */
  CUmemoryPool mp = NULL;
  r = GPUIPC__CU(cuPointerGetAttribute, &mp,
                 CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, p);
  if (r != CUDA_SUCCESS)
    mp = NULL;
  int capable = 1;
  if (mp == NULL &&
      GPUIPC__CU(cuPointerGetAttribute, &capable,
                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                 p) != CUDA_SUCCESS)
    capable = 1; /* let cuIpcGetMemHandle decide at export */
  b->ops = mp != NULL ? &gpuipc__mempool_ops
           : capable  ? &gpuipc__legacy_ops
                      : &gpuipc__vmm_ops;
  b->kind = b->ops->kind;
  GPUIPC__CHECK_GOTO(b->ops->wrap(b, p, ordinal), s, fail);
  CUdeviceptr base = b->base;
  size_t n = b->alloc_size;
  size_t off = (size_t)(p - base);
  if (p < base || off > n || size > n - off) {
    s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                     "gpuipc_buffer_wrap: [%p, +%zu) leaves its allocation "
                     "[0x%llx, +%zu)",
                     ptr, size, (unsigned long long)base, n);
    goto fail_unwrap;
  }
  s = gpuipc_device_uuid(ordinal, &b->uuid);
  if (s != GPUIPC_OK)
    goto fail_unwrap;
  gpuipc__ctx_leave(&g);
  /* Memory named by its handle keeps generation 0: one allocation wrapped
   * several times (interior views) must stay one mapping in every importer
   * (the driver maps a legacy handle or pool pointer once per process), and
   * the driver's buffer id alone names the allocation. Memory named by its
   * fd is its own mapping per import: a new generation per wrap keeps two
   * wrapped allocations of one exporter apart in the import cache (and
   * marks the wrapper live in the liveness table until it is freed). */
  if (!b->ops->named_by_handle)
    b->generation = gpuipc__next_generation();
  b->origin = GPUIPC__WRAPPED;
  b->ordinal = b->map_ordinal = ordinal;
  b->ptr = p;
  b->base = base;
  b->offset = off;
  b->size = size;
  b->alloc_size = n;
  *out = b;
  return GPUIPC_OK;
fail_unwrap:
  if (b->ops->unwrap)
    (void)b->ops->unwrap(b);
fail:
  gpuipc__ctx_leave(&g);
fail_noctx:
  buffer_delete(b);
  return s;
}

/* ---- accessors -------------------------------------------------------------------- */

void *gpuipc_buffer_get_ptr(const gpuipc_buffer *b) {
  return b ? (void *)(uintptr_t)b->ptr : NULL;
}
size_t gpuipc_buffer_get_size(const gpuipc_buffer *b) { return b ? b->size : 0; }
gpuipc_pool_kind gpuipc_buffer_get_kind(const gpuipc_buffer *b) {
  return b ? b->kind : GPUIPC_POOL_AUTO;
}
int gpuipc_buffer_is_imported(const gpuipc_buffer *b) {
  return b && b->origin == GPUIPC__IMPORTED;
}
gpuipc_status gpuipc_buffer_get_device(const gpuipc_buffer *b, gpuipc_uuid *uuid) {
  if (b == NULL || uuid == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_buffer_get_device: NULL");
  *uuid = b->uuid;
  return GPUIPC_OK;
}
gpuipc_status gpuipc_buffer_get_mapped_device(const gpuipc_buffer *b,
                                          gpuipc_uuid *uuid) {
  if (b == NULL || uuid == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_get_mapped_device: NULL");
  if (b->map_ordinal == b->ordinal) {
    *uuid = b->uuid;
    return GPUIPC_OK;
  }
  return gpuipc_device_uuid(b->map_ordinal, uuid);
}

gpuipc_status gpuipc__buffer_info_get(const gpuipc_buffer *b,
                                      gpuipc__buffer_info *i) {
  if (b == NULL || i == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc__buffer_info_get: NULL");
  memset(i, 0, sizeof *i);
  i->kind = b->kind;
  i->origin = b->origin;
  i->ptr = b->ptr;
  i->host = b->ops->host_memory ? (void *)(uintptr_t)b->ptr : NULL;
  i->size = b->size;
  i->ordinal = b->ordinal;
  i->map_ordinal = b->map_ordinal;
  i->buffer_id = b->buffer_id;
  i->generation = b->generation;
  i->pool_id = b->pool_id;
  i->pool = b->origin == GPUIPC__ALLOCATED ? b->pool : NULL;
  i->base = b->base;
  i->alloc_size = b->alloc_size;
  i->vmm = (uint64_t)b->vmm;
  i->fd = b->fd;
  if (b->origin == GPUIPC__IMPORTED) {
    i->exporter = b->exporter;
    return GPUIPC_OK;
  }
  return gpuipc__self_identity(&i->exporter);
}

/* ---- export ------------------------------------------------------------------------ */

/* Makes the buffer's shareable handle once (b->lock held). */
static gpuipc_status make_handle(gpuipc_buffer *b) {
  if (b->have_handle || b->ops->make_handle == NULL)
    return GPUIPC_OK;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, b->ordinal));
  gpuipc_status s = b->ops->make_handle(b);
  gpuipc__ctx_leave(&g);
  if (s == GPUIPC_OK)
    b->have_handle = true;
  return s;
}

/* The descriptor of [offset, offset + size) of b's allocation (*fd: the
 * kind's fd to pass beside it, -1 if none, still b's). */
static gpuipc_status describe(gpuipc_buffer *b, uint64_t offset, uint64_t size,
                              gpuipc__desc *d, int *fd) {
  memset(d, 0, sizeof *d);
  d->type = GPUIPC_DESC_BUFFER;
  d->kind = (uint8_t)b->kind;
  d->flags = b->origin == GPUIPC__WRAPPED ? GPUIPC__DESC_F_WRAPPED : 0;
  memcpy(d->device, b->uuid.bytes, 16);
  GPUIPC__CHECK(gpuipc__desc_set_exporter(d));
  d->live_key = gpuipc__live_key(); /* names this process's liveness table */
  d->buffer_id = b->buffer_id;
  d->generation = b->generation;
  d->offset = offset;
  d->size = size;
  d->alloc_size = b->alloc_size;
  *fd = -1;
  b->ops->describe(b, d, fd);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_buffer_export_range(gpuipc_buffer *b, const void *ptr,
                                         size_t size, uint8_t *desc, size_t cap,
                                         size_t *len) {
  if (b == NULL || ptr == NULL || size == 0 || desc == NULL || len == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_export_range: NULL, or size 0");
  if (b->origin == GPUIPC__IMPORTED)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_buffer_export_range: an imported buffer: pass "
                        "on its descriptor");
  if (b->buffer_id == 0)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_buffer_export_range: the driver gave this %s "
                        "buffer no buffer id to check the range against",
                        gpuipc_pool_kind_name(b->kind));
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
  CUdeviceptr base = b->alloc_size ? b->base : b->ptr;
  size_t n = b->alloc_size ? b->alloc_size : b->size;
  size_t off = (size_t)(p - base);
  if (p < base || off >= n || size > n - off)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "gpuipc_buffer_export_range: [%p, +%zu) leaves the "
                        "allocation [0x%llx, +%zu)",
                        ptr, size, (unsigned long long)base, n);
  GPUIPC__CHECK(gpuipc__driver());
  /* The memory at ptr must still be the allocation b names (a wrapped
   * allocation its owner freed may have another at its address now). */
  uint64_t now = 0;
  GPUIPC__CHECK(gpuipc__pointer_buffer_id(p, &now));
  if (now != b->buffer_id)
    return gpuipc__fail(GPUIPC_E_STALE,
                        "gpuipc_buffer_export_range: %p is in another "
                        "allocation now (buffer id %llu, this buffer's %llu): "
                        "its memory was freed; wrap the new one",
                        ptr, (unsigned long long)now,
                        (unsigned long long)b->buffer_id);
  pthread_mutex_lock(&b->lock);
  gpuipc_status s = make_handle(b);
  pthread_mutex_unlock(&b->lock);
  if (s != GPUIPC_OK)
    return s;
  gpuipc__desc d;
  int fd = -1;
  GPUIPC__CHECK(describe(b, off, size, &d, &fd));
  if (fd >= 0)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_buffer_export_range: %s memory travels with "
                        "its fd: use gpuipc_buffer_export",
                        gpuipc_pool_kind_name(b->kind));
  return gpuipc__desc_encode(&d, desc, cap, len);
}

gpuipc_status gpuipc_buffer_export(gpuipc_buffer *b, uint8_t *desc, size_t cap,
                                   size_t *len, int *fds, int *nfds) {
  if (b == NULL || desc == NULL || len == NULL ||
      (nfds && *nfds > 0 && fds == NULL) || (nfds && *nfds < 0))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_buffer_export: NULL");
  int cap_fds = nfds ? *nfds : 0;
  if (nfds)
    *nfds = 0;
  if (b->origin == GPUIPC__IMPORTED)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_buffer_export: re-exporting an imported "
                        "buffer is not supported: pass on its descriptor");
  GPUIPC__CHECK(gpuipc__driver());
  pthread_mutex_lock(&b->lock);
  gpuipc_status s = make_handle(b);
  /* A buffer's own fd is recorded as its export in this process's
   * liveness table, once: an importer fetching it by pidfd_getfd checks
   * the record. (A mempool buffer's fd is its pool's, recorded with it.) */
  if (s == GPUIPC_OK && !b->recorded && b->fd >= 0 &&
      !b->ops->named_by_handle) {
    gpuipc__live_export_add(b->fd, (unsigned)b->kind, b->generation);
    b->recorded = true;
  }
  pthread_mutex_unlock(&b->lock);
  if (s != GPUIPC_OK)
    return s;

  gpuipc__desc d;
  int fd = -1;
  GPUIPC__CHECK(describe(b, b->offset, b->size, &d, &fd));
  int newfd = -1;
  if (fd >= 0 && cap_fds > 0) {
    newfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (newfd < 0)
      return gpuipc__fail_errno(errno, "dup", "buffer export fd");
    d.nfds = 1;
  }
  s = gpuipc__desc_encode(&d, desc, cap, len);
  if (s != GPUIPC_OK) {
    if (newfd >= 0)
      close(newfd);
    return s;
  }
  if (newfd >= 0) {
    fds[0] = newfd;
    *nfds = 1;
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc_buffer_import(const uint8_t *desc, size_t len,
                                   const int *fds, int nfds,
                                   const gpuipc_import_options *opts_in,
                                   gpuipc_buffer **out) {
  return gpuipc__buffer_import_via(NULL, desc, len, fds, nfds, opts_in, out);
}

gpuipc_status gpuipc__buffer_import_via(const gpuipc__via *via,
                                        const uint8_t *desc, size_t len,
                                        const int *fds, int nfds,
                                        const gpuipc_import_options *opts_in,
                                        gpuipc_buffer **out) {
  if (desc == NULL || out == NULL || nfds < 0 || nfds > GPUIPC_DESC_MAX_FDS ||
      (nfds > 0 && fds == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_import: NULL, or %d fds (at most %d)",
                        nfds, GPUIPC_DESC_MAX_FDS);
  *out = NULL;
  for (int i = 0; i < nfds; i++)
    if (fds[i] < 0)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_buffer_import: fd %d", fds[i]);
  gpuipc_import_options opts;
  gpuipc__desc d;
  GPUIPC__CHECK(gpuipc__desc_open("gpuipc_buffer_import", desc, len, opts_in,
                                  GPUIPC_DESC_BUFFER, "a buffer", via, &opts,
                                  &d));
  /* Did the exporter free it? Its liveness table knows (the driver would
   * map freed memory, or another allocation at its address, silently). */
  if (gpuipc__generation_state(&d, via) == GPUIPC__LIVE_FREED)
    return gpuipc__fail(GPUIPC_E_STALE,
                        "the exporter (pid %d) freed the %s buffer this "
                        "descriptor names (generation %llu): a stale "
                        "descriptor",
                        (int)d.exporter.pid,
                        gpuipc_pool_kind_name((gpuipc_pool_kind)d.kind),
                        (unsigned long long)d.generation);
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid dev;
  memcpy(dev.bytes, d.device, 16);
  const gpuipc__kind_ops *ops = gpuipc__kind_ops_get(d.kind);
  if (ops == NULL)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "buffer descriptor of kind %u",
                        d.kind);
  int home = -1, map = -1;
  if (ops->host_memory) {
    /* Host memory does not live on the exporter's device, which may be
     * hidden here: it is registered in the context of opts->device, or of
     * the exporter's device when visible, else of device 0. */
    if (opts.device)
      GPUIPC__CHECK(gpuipc_device_from_uuid(opts.device, &map));
    else if (gpuipc_device_from_uuid(&dev, &map) != GPUIPC_OK)
      map = 0;
    home = map;
  } else {
    GPUIPC__CHECK(gpuipc_device_from_uuid(&dev, &home));
    map = home;
    if (opts.device)
      GPUIPC__CHECK(gpuipc_device_from_uuid(opts.device, &map));
  }
  return gpuipc__buffer_open(&d, ops, home, map, fds, nfds, opts.flags, out);
}

gpuipc_status gpuipc__buffer_open(const gpuipc__desc *d,
                                  const gpuipc__kind_ops *ops, int home,
                                  int map, const int *fds, int nfds,
                                  unsigned flags, gpuipc_buffer **out) {
  gpuipc_buffer *b = buffer_new();
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "buffer");
  struct gpuipc__mapping *m = NULL;
  gpuipc_status s = gpuipc__cache_acquire(d, map, fds, nfds, flags, ops, &m);
  if (s != GPUIPC_OK) {
    buffer_delete(b);
    return s;
  }
  /* A cache hit may come from a descriptor with another offset and size:
   * check them against this mapping too. */
  size_t mapped = gpuipc__mapping_size(m);
  if (d->offset > mapped || d->size > mapped - d->offset) {
    gpuipc__cache_release(m);
    buffer_delete(b);
    if (flags & GPUIPC__IMPORT_RAW)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "raw import: offset %llu + size %llu leaves the "
                          "%zu-byte allocation the handle names",
                          (unsigned long long)d->offset,
                          (unsigned long long)d->size, mapped);
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "descriptor claims offset %llu + size %llu, but the "
                        "mapping is %zu bytes: forged or corrupted",
                        (unsigned long long)d->offset,
                        (unsigned long long)d->size, mapped);
  }
  b->origin = GPUIPC__IMPORTED;
  b->kind = (gpuipc_pool_kind)d->kind;
  b->ops = ops;
  b->ordinal = home;
  b->map_ordinal = map;
  memcpy(b->uuid.bytes, d->device, 16);
  b->base = gpuipc__mapping_base(m);
  b->ptr = b->base + d->offset;
  if (ops->host_memory)
    b->ptr = (CUdeviceptr)(uintptr_t)gpuipc__mapping_host(m) + d->offset;
  b->size = (size_t)d->size;
  b->offset = (size_t)d->offset;
  b->alloc_size = mapped;
  b->buffer_id = d->buffer_id;
  b->generation = d->generation;
  b->pool_id = d->pool_id;
  b->exporter = d->exporter;
  b->map = m;
  *out = b;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_buffer_close(gpuipc_buffer *b) {
  if (b == NULL)
    return GPUIPC_OK;
  if (b->origin != GPUIPC__IMPORTED)
    return gpuipc_buffer_free(b, NULL);
  gpuipc_status s = gpuipc__cache_release(b->map);
  buffer_delete(b);
  return s;
}

gpuipc_status gpuipc_buffer_free(gpuipc_buffer *b, struct CUstream_st *stream) {
  if (b == NULL)
    return GPUIPC_OK;
  if (b->origin == GPUIPC__IMPORTED)
    return gpuipc_buffer_close(b);
  if (b->origin == GPUIPC__WRAPPED) {
    /* The memory stays the caller's; a wrapped VMM allocation holds one
     * reference on its handle (cuMemRetainAllocationHandle) and may hold
     * its exported fd. */
    gpuipc_status s = GPUIPC_OK;
    if (b->ops->unwrap)
      s = b->ops->unwrap(b);
    if (b->fd >= 0) {
      if (b->recorded)
        gpuipc__live_export_clear(b->fd);
      close(b->fd);
    }
    gpuipc__generation_freed(b->generation);
    buffer_delete(b);
    return s;
  }
  gpuipc_pool *pool = b->pool;
  /* Importers learn it from the liveness table before the memory goes. */
  gpuipc__generation_freed(b->generation);
  gpuipc_status s = gpuipc__driver();
  gpuipc__ctx_guard g;
  if (s == GPUIPC_OK)
    s = gpuipc__ctx_enter(&g, b->ordinal);
  if (s == GPUIPC_OK) {
    s = b->ops->free(b, (CUstream)stream);
    gpuipc__ctx_leave(&g);
  }
  /* The buffer is gone even when the driver reported an error: there is
   * nothing a caller could retry. */
  if (b->fd >= 0) {
    if (b->recorded)
      gpuipc__live_export_clear(b->fd);
    close(b->fd);
  }
  if (pool) {
    if (pool->capacity && !pool->ops->driver_capacity)
      atomic_fetch_sub(&pool->in_use, b->size);
    atomic_fetch_sub(&pool->live, 1);
    gpuipc__stats_add(GPUIPC__ST_POOL_BUFFERS, -1);
    gpuipc__stats_add(GPUIPC__ST_POOL_BYTES, -(int64_t)b->size);
  }
  buffer_delete(b);
  return s;
}

/* ---- keep until released ------------------------------------------------------------ */

/* The last reference went: the buffer closes, then its owner is told. */
static void keep_finish(gpuipc_buffer *b) {
  void (*done)(void *) = b->done;
  void *ctx = b->done_ctx;
  struct CUstream_st *stream = b->done_stream;
  gpuipc__stats_add(GPUIPC__ST_KEPT_BUFFERS, -1);
  if (gpuipc_buffer_free(b, stream) != GPUIPC_OK)
    GPUIPC__WARN("buffer", "closing a buffer handed over for keeping: %s",
                 gpuipc_last_error());
  if (done)
    done(ctx);
}

void gpuipc__buffer_lease_begin(gpuipc_buffer *b) {
  atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
}

/* Buffers whose last reference went in this thread, finished by the
 * next gpuipc__buffer_done_flush of this thread (outside the dropper's
 * context switch and loops). */
static _Thread_local gpuipc_buffer *done_pending;

void gpuipc__buffer_lease_end(gpuipc_buffer *b) {
  if (atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1)
    return;
  b->next_done = done_pending;
  done_pending = b;
}

void gpuipc__buffer_done_flush(void) {
  while (done_pending) {
    gpuipc_buffer *b = done_pending;
    done_pending = b->next_done;
    keep_finish(b);
  }
}

bool gpuipc__buffer_handed(const gpuipc_buffer *b,
                           struct CUstream_st **stream) {
  /* Read by the thread that holds a lease on it (the reference keeps it
   * alive); set before the caller's reference went. */
  bool handed = atomic_load_explicit(&b->handed, memory_order_acquire);
  if (handed && stream)
    *stream = b->done_stream;
  return handed;
}

unsigned gpuipc_buffer_get_holders(const gpuipc_buffer *b) {
  if (b == NULL || b->origin == GPUIPC__IMPORTED)
    return 0;
  unsigned r = atomic_load(&b->refs);
  unsigned own = atomic_load(&b->handed) ? 0 : 1;
  return r > own ? r - own : 0;
}

gpuipc_status gpuipc_buffer_release_when_done(gpuipc_buffer *b,
                                              struct CUstream_st *stream,
                                              void (*done)(void *ctx),
                                              void *ctx) {
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_release_when_done: NULL buffer");
  if (b->origin == GPUIPC__IMPORTED)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_release_when_done: an imported "
                        "buffer (close it with gpuipc_buffer_close)");
  if (atomic_load(&b->handed))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_release_when_done: the buffer was "
                        "already handed over");
  b->done = done;
  b->done_ctx = ctx;
  b->done_stream = stream;
  atomic_store_explicit(&b->handed, true, memory_order_release);
  gpuipc__stats_add(GPUIPC__ST_KEPT_BUFFERS, 1);
  /* The caller's reference; the leases' keep it from here on. */
  gpuipc__buffer_lease_end(b);
  gpuipc__buffer_done_flush();
  return GPUIPC_OK;
}
