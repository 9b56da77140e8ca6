/*
 * mempool.c: owns the MEMPOOL buffer kind: stream-ordered allocations from
 * a driver memory pool made with POSIX fd export. The pool is exported once
 * (its fd travels once per importer), each buffer as 64 bytes of pointer
 * export data without an fd. Also owns the registry of exportable driver
 * pools: ours, and foreign IPC-capable ones whose memory was wrapped.
 * Imported pools themselves are cached in cache.c.
 */
#include "handle_int.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- registry of exportable driver pools ----------------------------------------- */

typedef struct reg_pool {
  CUmemoryPool mp;
  uint64_t id;
  int fd;       /* owned by the gpuipc_pool, or by the registry if foreign */
  bool foreign;
  struct reg_pool *next;
} reg_pool;

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static reg_pool *registry;

static gpuipc_status reg_add(CUmemoryPool mp, uint64_t id, int fd,
                             bool foreign) {
  reg_pool *r = calloc(1, sizeof *r);
  if (r == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool registry");
  r->mp = mp;
  r->id = id;
  r->fd = fd;
  r->foreign = foreign;
  pthread_mutex_lock(&reg_lock);
  r->next = registry;
  registry = r;
  pthread_mutex_unlock(&reg_lock);
  return GPUIPC_OK;
}

static void reg_remove(CUmemoryPool mp) {
  pthread_mutex_lock(&reg_lock);
  for (reg_pool **pp = &registry; *pp; pp = &(*pp)->next)
    if ((*pp)->mp == mp) {
      reg_pool *r = *pp;
      *pp = r->next;
      free(r);
      break;
    }
  pthread_mutex_unlock(&reg_lock);
}

/* Finds (or, for a foreign IPC-capable pool, registers for good) the
 * exporter-side identity of a driver pool, so wrapped pool memory can be
 * exported: its pool id and fd (borrowed). */
static gpuipc_status lookup_foreign(CUmemoryPool mp, int ordinal,
                                    uint64_t *id, int *fd) {
  pthread_mutex_lock(&reg_lock);
  for (reg_pool *r = registry; r; r = r->next)
    if (r->mp == mp) {
      *id = r->id;
      *fd = r->fd;
      pthread_mutex_unlock(&reg_lock);
      return GPUIPC_OK;
    }
  pthread_mutex_unlock(&reg_lock);
  /* A pool gpuipc did not create: it can be shared only if it was created
   * with POSIX fd export. Its fd is made once and kept for the life of the
   * process (gpuipc cannot know when the owner destroys the pool). */
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, ordinal));
  int newfd = -1;
  CUresult r = GPUIPC__CU(cuMemPoolExportToShareableHandle, &newfd, mp,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemPoolExportToShareableHandle",
                             "the wrapped memory's pool was not created with "
                             "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, so it "
                             "cannot be shared");
  uint64_t nid = gpuipc__next_pool_id();
  gpuipc_status s = reg_add(mp, nid, newfd, true);
  if (s != GPUIPC_OK) {
    close(newfd);
    return s;
  }
  gpuipc__live_export_add(newfd, GPUIPC_POOL_MEMPOOL, nid);
  *id = nid;
  *fd = newfd;
  return GPUIPC_OK;
}

/* ---- pools ------------------------------------------------------------------------ */

static gpuipc_status mempool_pool_create(gpuipc_pool *p,
                                         const gpuipc_pool_options *opts) {
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = p->cudev;
  props.maxSize = p->capacity;
  gpuipc_status s = GPUIPC_OK;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, p->ordinal));
  CUresult r = GPUIPC__CU(cuMemPoolCreate, &p->mp, &props);
  if (r != CUDA_SUCCESS) {
    p->mp = NULL;
    s = gpuipc__fail_cuda(r, "cuMemPoolCreate", "device %d, fd export",
                          p->ordinal);
    goto out;
  }
  if (opts->release_threshold) {
    cuuint64_t t = opts->release_threshold;
    r = GPUIPC__CU(cuMemPoolSetAttribute, p->mp,
                   CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemPoolSetAttribute",
                            "release threshold %llu",
                            (unsigned long long)opts->release_threshold);
      goto out;
    }
  }
  for (int i = 0; i < p->n_access; i++) {
    CUmemAccessDesc ad;
    memset(&ad, 0, sizeof ad);
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = p->access[i];
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = GPUIPC__CU(cuMemPoolSetAccess, p->mp, &ad, 1);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemPoolSetAccess", "device %d for pool on %d",
                            p->access[i], p->ordinal);
      goto out;
    }
  }
  /* The pool's shareable handle, made once: every export dup()s it, and the
   * pidfd route fetches this very fd number. */
  r = GPUIPC__CU(cuMemPoolExportToShareableHandle, &p->export_fd, p->mp,
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    p->export_fd = -1;
    s = gpuipc__fail_cuda(r, "cuMemPoolExportToShareableHandle", "device %d",
                          p->ordinal);
    goto out;
  }
  s = reg_add(p->mp, p->id, p->export_fd, false);
  if (s == GPUIPC_OK)
    gpuipc__live_export_add(p->export_fd, GPUIPC_POOL_MEMPOOL, p->id);
out:
  if (s != GPUIPC_OK) {
    if (p->export_fd >= 0)
      close(p->export_fd);
    p->export_fd = -1;
    if (p->mp) {
      CUresult r2 = GPUIPC__CU(cuMemPoolDestroy, p->mp);
      if (r2 != CUDA_SUCCESS)
        GPUIPC__WARN("handle", "cuMemPoolDestroy after a failed create: %s",
                     gpuipc__cuda_error_name(r2));
      p->mp = NULL;
    }
  }
  gpuipc__ctx_leave(&g);
  return s;
}

static gpuipc_status mempool_pool_destroy(gpuipc_pool *p) {
  if (p->mp == NULL)
    return GPUIPC_OK;
  reg_remove(p->mp);
  if (p->export_fd >= 0) {
    gpuipc__live_export_clear(p->export_fd);
    close(p->export_fd);
  }
  p->export_fd = -1;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, p->ordinal));
  gpuipc_status s = GPUIPC_OK;
  CUresult r = GPUIPC__CU(cuMemPoolDestroy, p->mp);
  if (r != CUDA_SUCCESS)
    s = gpuipc__fail_cuda(r, "cuMemPoolDestroy", "pool %llu",
                          (unsigned long long)p->id);
  gpuipc__ctx_leave(&g);
  return s;
}

static gpuipc_status mempool_pool_export(gpuipc_pool *p, gpuipc__desc *d,
                                         int *fd) {
  d->exporter_fd = p->export_fd;
  *fd = p->export_fd;
  return GPUIPC_OK;
}

/* ---- buffers ---------------------------------------------------------------------- */

static gpuipc_status mempool_alloc(gpuipc_pool *p, gpuipc_buffer *b,
                                   size_t size, CUstream stream) {
  CUresult r = GPUIPC__CU(cuMemAllocFromPoolAsync, &b->ptr, size, p->mp,
                          stream);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemAllocFromPoolAsync",
                             "%zu bytes from pool %llu", size,
                             (unsigned long long)p->id);
  b->base = b->ptr;
  b->alloc_size = size;
  return GPUIPC_OK;
}

static gpuipc_status mempool_free(gpuipc_buffer *b, CUstream stream) {
  CUresult r = GPUIPC__CU(cuMemFreeAsync, b->ptr, stream);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemFreeAsync", NULL);
  return GPUIPC_OK;
}

static gpuipc_status mempool_wrap(gpuipc_buffer *b, CUdeviceptr ptr,
                                  int ordinal) {
  CUmemoryPool mp = NULL;
  CUresult r = GPUIPC__CU(cuPointerGetAttribute, &mp,
                          CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuPointerGetAttribute",
                             "CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE of 0x%llx",
                             (unsigned long long)ptr);
  r = GPUIPC__CU(cuMemGetAddressRange, &b->base, &b->alloc_size, ptr);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemGetAddressRange", "0x%llx",
                             (unsigned long long)ptr);
  GPUIPC__CHECK(lookup_foreign(mp, ordinal, &b->pool_id, &b->pool_fd));
  return gpuipc__pointer_buffer_id(b->base, &b->buffer_id);
}

/* cuMemPoolExportPointer refuses interior pointers: export the base. It
 * writes only the first 48 of the struct's 64 bytes (driver 580): zeroed
 * first, the descriptor's handle bytes are the same on every export and its
 * unused bytes are 0 as the format demands. */
static gpuipc_status mempool_make_handle(gpuipc_buffer *b) {
  CUmemPoolPtrExportData e;
  memset(&e, 0, sizeof e);
  CUresult r = GPUIPC__CU(cuMemPoolExportPointer, &e, b->base);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemPoolExportPointer", "0x%llx",
                             (unsigned long long)b->base);
  memcpy(b->handle, &e, 64);
  return GPUIPC_OK;
}

static void mempool_describe(const gpuipc_buffer *b, gpuipc__desc *d,
                             int *fd) {
  d->handle_len = 64;
  memcpy(d->handle, b->handle, 64);
  d->pool_id = b->pool_id;
  *fd = b->origin == GPUIPC__WRAPPED ? b->pool_fd : b->pool->export_fd;
  d->exporter_fd = *fd;
}

/* ---- imports ---------------------------------------------------------------------- */

static gpuipc_status mempool_open(const gpuipc__desc *d, int map_ordinal,
                                  const int *fds, int nfds, unsigned flags,
                                  gpuipc__opened *o) {
  struct gpuipc__pool_import *pimp = NULL;
  GPUIPC__CHECK(gpuipc__pool_import_acquire(d, map_ordinal,
                                            nfds > 0 ? fds[0] : -1, flags,
                                            &pimp));
  CUmemPoolPtrExportData e;
  memcpy(&e, d->handle, 64);
  CUdeviceptr p = 0;
  CUresult r = GPUIPC__CU(cuMemPoolImportPointer, &p,
                          gpuipc__pool_import_handle(pimp), &e);
  if (r != CUDA_SUCCESS) {
    gpuipc__pool_import_release(pimp);
    gpuipc_status s = gpuipc__fail_cuda(
        r, "cuMemPoolImportPointer", "pool %llu of pid %d%s",
        (unsigned long long)d->pool_id, (int)d->exporter.pid,
        r == CUDA_ERROR_INVALID_VALUE
            ? ": the export data names no allocation of that pool (freed, "
              "or forged)"
            : "");
    /* As for a legacy handle: the driver refuses export data of no live
     * allocation of the pool, which is what a descriptor of freed memory
     * (or a forged one) carries. */
    return r == CUDA_ERROR_INVALID_VALUE ? GPUIPC_E_STALE : s;
  }
  /* The driver hands back an existing import of the same pointer rather
   * than a new one (when the exporter reused the address of a buffer still
   * imported here): that is no new mapping, and it must not be freed while
   * its holders use it. */
  bool existing = false;
  gpuipc_status s =
      gpuipc__import_check_shadow(d, map_ordinal, p, flags, &existing);
  if (!existing)
    gpuipc__cache_count_open();
  if (s == GPUIPC_OK)
    s = gpuipc__import_check_range(d, p, &o->mapped_size);
  if (s != GPUIPC_OK) {
    if (!existing) {
      (void)GPUIPC__CU(cuMemFree, p);
      gpuipc__cache_count_close();
    }
    gpuipc__pool_import_release(pimp);
    return s;
  }
  o->base = p;
  o->pimp = pimp;
  o->local_id = gpuipc__local_buffer_id(p);
  return GPUIPC_OK;
}

static void mempool_forget(gpuipc__opened *o) {
  gpuipc__pool_import_release(o->pimp);
  o->pimp = NULL;
}

static gpuipc_status mempool_close(int map_ordinal, gpuipc__opened *o) {
  (void)map_ordinal;
  CUresult r = GPUIPC__CU(cuMemFree, o->base);
  mempool_forget(o);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemFree",
                             "closing an imported mempool mapping 0x%llx",
                             (unsigned long long)o->base);
  return GPUIPC_OK;
}

const gpuipc__kind_ops gpuipc__mempool_ops = {
    .kind = GPUIPC_POOL_MEMPOOL,
    .named_by_handle = true,
    .stream_ordered = true,
    .driver_capacity = true,
    .host_memory = false,
    .pool_create = mempool_pool_create,
    .pool_destroy = mempool_pool_destroy,
    .pool_export = mempool_pool_export,
    .alloc = mempool_alloc,
    .free = mempool_free,
    .wrap = mempool_wrap,
    .unwrap = NULL,
    .make_handle = mempool_make_handle,
    .describe = mempool_describe,
    .open = mempool_open,
    .close = mempool_close,
    .forget = mempool_forget,
};
