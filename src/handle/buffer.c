/*
 * buffer.c: owns buffers: allocating them from a pool of each kind,
 * wrapping foreign allocations (base + range + offset), exporting them as
 * descriptors (+ fds), importing descriptors (the driver side of opening
 * each kind, with the checks the driver does not make: whether the exporter
 * freed the allocation (its liveness table, pool.c), whether the driver
 * handed back an earlier import of other memory at that address, and the
 * real mapped range), and closing/freeing.
 *
 * Buffer ids: CU_POINTER_ATTRIBUTE_BUFFER_ID is read at the exporter and
 * travels in the descriptor as part of the allocation's identity (cache
 * keys). It is never compared with the id the importer's driver reports:
 * on driver 580 every import (legacy or pool) gets importer-local ids.
 */
#include "handle_int.h"

#include <fcntl.h>
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
  pthread_mutex_init(&b->lock, NULL);
  return b;
}

static void buffer_delete(gpuipc_buffer *b) {
  pthread_mutex_destroy(&b->lock);
  free(b);
}

static size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }

gpuipc_status gpuipc__pointer_buffer_id(CUdeviceptr ptr, uint64_t *id) {
  unsigned long long v = 0;
  CUresult r =
      GPUIPC__CU(cuPointerGetAttribute, &v, CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuPointerGetAttribute",
                             "CU_POINTER_ATTRIBUTE_BUFFER_ID of 0x%llx",
                             (unsigned long long)ptr);
  *id = v;
  return GPUIPC_OK;
}

/* ---- allocation per kind (context of the pool's device is current) --------- */

static gpuipc_status alloc_vmm(gpuipc_pool *p, gpuipc_buffer *b, size_t size) {
  size_t n = round_up(size, p->granularity);
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = p->cudev;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  bool mapped = false;
  gpuipc_status s = GPUIPC_OK;
  CUresult r = GPUIPC__CU(cuMemCreate, &h, n, &prop, 0);
  if (r != CUDA_SUCCESS) {
    h = 0;
    s = gpuipc__fail_cuda(r, "cuMemCreate", "%zu bytes on device %d", n,
                          p->ordinal);
    goto fail;
  }
  r = GPUIPC__CU(cuMemAddressReserve, &va, n, p->granularity, 0, 0);
  if (r != CUDA_SUCCESS) {
    va = 0;
    s = gpuipc__fail_cuda(r, "cuMemAddressReserve", "%zu bytes", n);
    goto fail;
  }
  r = GPUIPC__CU(cuMemMap, va, n, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemMap", "%zu bytes", n);
    goto fail;
  }
  mapped = true;
  CUmemAccessDesc ad[GPUIPC__MAX_ACCESS + 1];
  memset(ad, 0, sizeof ad);
  int nad = 0;
  ad[nad].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  ad[nad].location.id = p->ordinal;
  ad[nad++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (int i = 0; i < p->n_access; i++) {
    ad[nad].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad[nad].location.id = p->access[i];
    ad[nad++].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  r = GPUIPC__CU(cuMemSetAccess, va, n, ad, (size_t)nad);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemSetAccess", "%zu bytes", n);
    goto fail;
  }
  b->vmm = h;
  b->ptr = b->base = va;
  b->alloc_size = n;
  return GPUIPC_OK;
fail:
  if (mapped)
    (void)GPUIPC__CU(cuMemUnmap, va, n);
  if (va)
    (void)GPUIPC__CU(cuMemAddressFree, va, n);
  if (h)
    (void)GPUIPC__CU(cuMemRelease, h);
  return s;
}

static void free_vmm(gpuipc_buffer *b, gpuipc_status *s) {
  CUresult r = GPUIPC__CU(cuMemUnmap, b->base, b->alloc_size);
  if (r != CUDA_SUCCESS && *s == GPUIPC_OK)
    *s = gpuipc__fail_cuda(r, "cuMemUnmap", NULL);
  r = GPUIPC__CU(cuMemAddressFree, b->base, b->alloc_size);
  if (r != CUDA_SUCCESS && *s == GPUIPC_OK)
    *s = gpuipc__fail_cuda(r, "cuMemAddressFree", NULL);
  r = GPUIPC__CU(cuMemRelease, b->vmm);
  if (r != CUDA_SUCCESS && *s == GPUIPC_OK)
    *s = gpuipc__fail_cuda(r, "cuMemRelease", NULL);
}

/* Maps a pinned-host fd (size bytes) and registers it with the driver. */
static gpuipc_status map_pinned(int fd, size_t size, void **host_out,
                                CUdeviceptr *dev_out) {
  void *host = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (host == MAP_FAILED)
    return gpuipc__fail_errno(errno, "mmap", "%zu bytes of pinned host memory",
                              size);
  /* PORTABLE: pinned for every context, so copies on any device's streams
   * are asynchronous; DEVICEMAP: reachable from kernels. */
  CUresult r = GPUIPC__CU(cuMemHostRegister, host, size,
                          CU_MEMHOSTREGISTER_PORTABLE |
                              CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS) {
    munmap(host, size);
    return gpuipc__fail_cuda(r, "cuMemHostRegister", "%zu bytes", size);
  }
  CUdeviceptr d = 0;
  r = GPUIPC__CU(cuMemHostGetDevicePointer, &d, host, 0);
  if (r != CUDA_SUCCESS) {
    (void)GPUIPC__CU(cuMemHostUnregister, host);
    munmap(host, size);
    return gpuipc__fail_cuda(r, "cuMemHostGetDevicePointer", NULL);
  }
  *host_out = host;
  *dev_out = d;
  return GPUIPC_OK;
}

static void unmap_pinned(void *host, size_t size, gpuipc_status *s) {
  CUresult r = GPUIPC__CU(cuMemHostUnregister, host);
  if (r != CUDA_SUCCESS && *s == GPUIPC_OK)
    *s = gpuipc__fail_cuda(r, "cuMemHostUnregister", NULL);
  munmap(host, size);
}

static gpuipc_status alloc_pinned(gpuipc_buffer *b, size_t size) {
  long page = sysconf(_SC_PAGESIZE);
  size_t n = round_up(size, page > 0 ? (size_t)page : 4096);
  int fd = memfd_create("gpuipc-pinned-host", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return gpuipc__fail_errno(errno, "memfd_create", "pinned host buffer");
  gpuipc_status s = GPUIPC_OK;
  if (ftruncate(fd, (off_t)n) != 0) {
    s = gpuipc__fail_errno(errno, "ftruncate", "%zu bytes", n);
    goto fail;
  }
  /* Sealed size: an importer's mapping can never be cut short under it
   * (which would turn its accesses into SIGBUS). */
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    s = gpuipc__fail_errno(errno, "fcntl", "F_ADD_SEALS");
    goto fail;
  }
  void *host = NULL;
  CUdeviceptr d = 0;
  GPUIPC__CHECK_GOTO(map_pinned(fd, n, &host, &d), s, fail);
  b->fd = fd;
  b->host = host;
  b->ptr = b->base = d;
  b->alloc_size = n;
  return GPUIPC_OK;
fail:
  close(fd);
  return s;
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
  if (pool->capacity && pool->kind != GPUIPC_POOL_MEMPOOL) {
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
  b->ordinal = b->map_ordinal = pool->ordinal;
  b->uuid = pool->uuid;
  b->size = size;
  b->pool = pool;
  b->pool_id = pool->id;
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, pool->ordinal), s, fail);
  entered = true;
  CUresult r;
  switch (pool->kind) {
  case GPUIPC_POOL_MEMPOOL:
    r = GPUIPC__CU(cuMemAllocFromPoolAsync, &b->ptr, size, pool->mp,
                   (CUstream)stream);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemAllocFromPoolAsync", "%zu bytes from pool %llu",
                            size, (unsigned long long)pool->id);
      goto fail;
    }
    b->base = b->ptr;
    b->alloc_size = size;
    break;
  case GPUIPC_POOL_LEGACY: {
    r = GPUIPC__CU(cuMemAlloc, &b->ptr, size);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemAlloc", "%zu bytes on device %d", size,
                            pool->ordinal);
      goto fail;
    }
    CUdeviceptr base = 0;
    size_t n = 0;
    r = GPUIPC__CU(cuMemGetAddressRange, &base, &n, b->ptr);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemGetAddressRange", NULL);
      (void)GPUIPC__CU(cuMemFree, b->ptr);
      goto fail;
    }
    b->base = base;
    b->offset = (size_t)(b->ptr - base);
    b->alloc_size = n;
    break;
  }
  case GPUIPC_POOL_VMM:
    GPUIPC__CHECK_GOTO(alloc_vmm(pool, b, size), s, fail);
    break;
  case GPUIPC_POOL_PINNED_HOST:
    GPUIPC__CHECK_GOTO(alloc_pinned(b, size), s, fail);
    break;
  default:
    s = gpuipc__fail(GPUIPC_E_INTERNAL, "pool kind %d", (int)pool->kind);
    goto fail;
  }
  /* The exporter's buffer id is part of the allocation's identity in
   * descriptors (importers' cache keys). Legacy and pool memory must have
   * one; VMM and pinned host memory are named by their fd and generation,
   * so a missing id is not an error there. */
  if (pool->kind == GPUIPC_POOL_LEGACY || pool->kind == GPUIPC_POOL_MEMPOOL) {
    s = gpuipc__pointer_buffer_id(b->base, &b->buffer_id);
    if (s != GPUIPC_OK) {
      if (pool->kind == GPUIPC_POOL_MEMPOOL)
        (void)GPUIPC__CU(cuMemFreeAsync, b->ptr, (CUstream)stream);
      else
        (void)GPUIPC__CU(cuMemFree, b->ptr);
      goto fail;
    }
  } else {
    uint64_t id = 0;
    unsigned long long v = 0;
    if (GPUIPC__CU(cuPointerGetAttribute, &v, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                   b->base) == CUDA_SUCCESS)
      id = v;
    b->buffer_id = id;
  }
  b->generation = gpuipc__next_generation();
  gpuipc__ctx_leave(&g);
  atomic_fetch_add(&pool->live, 1);
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

gpuipc_status gpuipc__arena_alloc(gpuipc_pool *pool, size_t size,
                                  gpuipc_buffer **buf) {
  if (pool == NULL || buf == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc__arena_alloc: NULL");
  if (pool->kind != GPUIPC_POOL_MEMPOOL)
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
   * memory is legacy-IPC capable; VMM memory has an allocation handle. */
  CUdeviceptr base = 0;
  size_t n = 0;
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
  if (mp != NULL || capable) {
    r = GPUIPC__CU(cuMemGetAddressRange, &base, &n, p);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemGetAddressRange", "%p", ptr);
      goto fail;
    }
    if (mp != NULL) {
      b->kind = GPUIPC_POOL_MEMPOOL;
      GPUIPC__CHECK_GOTO(
          gpuipc__pool_lookup_foreign(mp, ordinal, &b->pool_id, &b->pool_fd),
          s, fail);
    } else {
      b->kind = GPUIPC_POOL_LEGACY;
    }
    GPUIPC__CHECK_GOTO(gpuipc__pointer_buffer_id(base, &b->buffer_id), s,
                       fail);
    /* Generation 0: one allocation wrapped several times (interior views)
     * must stay one mapping in every importer (the driver maps a legacy
     * handle or pool pointer once per process), and the driver's buffer id
     * alone names the allocation. */
    b->generation = 0;
  } else {
    /* VMM memory (e.g. a caching allocator's expandable segments): share
     * the physical allocation behind the mapping, if it was created
     * exportable as a POSIX fd. */
    CUmemGenericAllocationHandle h = 0;
    r = GPUIPC__CU(cuMemRetainAllocationHandle, &h, ptr);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                       "gpuipc_buffer_wrap: %p is neither cuMemAlloc memory, "
                       "nor memory of a pool, nor a VMM mapping "
                       "(cuMemRetainAllocationHandle: %s)",
                       ptr, gpuipc__cuda_error_name(r));
      goto fail;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    unsigned long long mbase = 0, msize = 0;
    r = GPUIPC__CU(cuMemGetAllocationPropertiesFromHandle, &prop, h);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuMemGetAllocationPropertiesFromHandle", NULL);
    else if (!(prop.requestedHandleTypes &
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
      s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                       "gpuipc_buffer_wrap: the VMM allocation behind %p was "
                       "not created with CU_MEM_HANDLE_TYPE_POSIX_FILE_"
                       "DESCRIPTOR, so it cannot be shared",
                       ptr);
    else if ((r = GPUIPC__CU(cuPointerGetAttribute, &mbase,
                             CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, p)) !=
                 CUDA_SUCCESS ||
             (r = GPUIPC__CU(cuPointerGetAttribute, &msize,
                             CU_POINTER_ATTRIBUTE_MAPPING_SIZE, p)) !=
                 CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuPointerGetAttribute",
                            "mapping base and size of %p", ptr);
    if (s != GPUIPC_OK) {
      (void)GPUIPC__CU(cuMemRelease, h);
      goto fail;
    }
    b->kind = GPUIPC_POOL_VMM;
    b->vmm = h;
    base = (CUdeviceptr)mbase;
    n = (size_t)msize;
    unsigned long long id = 0;
    if (GPUIPC__CU(cuPointerGetAttribute, &id, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                   base) == CUDA_SUCCESS)
      b->buffer_id = id;
  }
  size_t off = (size_t)(p - base);
  if (p < base || off > n || size > n - off) {
    s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                     "gpuipc_buffer_wrap: [%p, +%zu) leaves its allocation "
                     "[0x%llx, +%zu)",
                     ptr, size, (unsigned long long)base, n);
    if (b->kind == GPUIPC_POOL_VMM)
      (void)GPUIPC__CU(cuMemRelease, b->vmm);
    goto fail;
  }
  s = gpuipc_device_uuid(ordinal, &b->uuid);
  if (s != GPUIPC_OK) {
    if (b->kind == GPUIPC_POOL_VMM)
      (void)GPUIPC__CU(cuMemRelease, b->vmm);
    goto fail;
  }
  gpuipc__ctx_leave(&g);
  /* Each VMM import is its own mapping: a new generation per wrap keeps two
   * wrapped allocations of one exporter apart in the import cache (and
   * marks the wrapper live in the liveness table until it is freed). */
  if (b->kind == GPUIPC_POOL_VMM)
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
  i->host = b->kind == GPUIPC_POOL_PINNED_HOST ? (void *)(uintptr_t)b->ptr
                                               : NULL;
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
  if (b->have_handle)
    return GPUIPC_OK;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, b->ordinal));
  gpuipc_status s = GPUIPC_OK;
  CUresult r = CUDA_SUCCESS;
  switch (b->kind) {
  case GPUIPC_POOL_LEGACY: {
    /* The handle of an interior pointer is the handle of the base: the
     * offset travels beside it. */
    CUipcMemHandle h;
    r = GPUIPC__CU(cuIpcGetMemHandle, &h, b->base);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuIpcGetMemHandle", "0x%llx",
                            (unsigned long long)b->base);
    else
      memcpy(b->handle, &h, 64);
    break;
  }
  case GPUIPC_POOL_MEMPOOL: {
    /* cuMemPoolExportPointer refuses interior pointers: export the base.
     * It writes only the first 48 of the struct's 64 bytes (driver 580):
     * zeroed first, the descriptor's handle bytes are the same on every
     * export and its unused bytes are 0 as the format demands. */
    CUmemPoolPtrExportData e;
    memset(&e, 0, sizeof e);
    r = GPUIPC__CU(cuMemPoolExportPointer, &e, b->base);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuMemPoolExportPointer", "0x%llx",
                            (unsigned long long)b->base);
    else
      memcpy(b->handle, &e, 64);
    break;
  }
  case GPUIPC_POOL_VMM: {
    int fd = -1;
    r = GPUIPC__CU(cuMemExportToShareableHandle, &fd, b->vmm,
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuMemExportToShareableHandle", NULL);
    else
      b->fd = fd;
    break;
  }
  default:
    break;
  }
  gpuipc__ctx_leave(&g);
  if (s == GPUIPC_OK)
    b->have_handle = true;
  return s;
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
  pthread_mutex_unlock(&b->lock);
  if (s != GPUIPC_OK)
    return s;

  gpuipc__desc d;
  memset(&d, 0, sizeof d);
  d.type = GPUIPC_DESC_BUFFER;
  d.kind = (uint8_t)b->kind;
  d.flags = b->origin == GPUIPC__WRAPPED ? GPUIPC__DESC_F_WRAPPED : 0;
  memcpy(d.device, b->uuid.bytes, 16);
  GPUIPC__CHECK(gpuipc__desc_set_exporter(&d));
  d.buffer_id = b->buffer_id;
  d.generation = b->generation;
  d.offset = b->offset;
  d.size = b->size;
  d.alloc_size = b->alloc_size;
  int fd = -1;
  switch (b->kind) {
  case GPUIPC_POOL_LEGACY:
    d.handle_len = 64;
    memcpy(d.handle, b->handle, 64);
    d.exporter_fd = -1;
    break;
  case GPUIPC_POOL_MEMPOOL:
    d.handle_len = 64;
    memcpy(d.handle, b->handle, 64);
    d.pool_id = b->pool_id;
    fd = b->origin == GPUIPC__WRAPPED ? b->pool_fd : b->pool->export_fd;
    d.exporter_fd = fd;
    break;
  default:
    fd = b->fd;
    d.exporter_fd = fd;
    break;
  }
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

/* ---- import: opening each kind (called by the cache, without its lock) ------- */

gpuipc_status gpuipc__import_check_range(const gpuipc__desc *d,
                                        CUdeviceptr base, size_t *mapped) {
  CUdeviceptr rb = 0;
  size_t rn = 0;
  CUresult r = GPUIPC__CU(cuMemGetAddressRange, &rb, &rn, base);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemGetAddressRange", "imported mapping");
  /* The offset and size are claims; the driver's range of the mapping is
   * the truth. */
  size_t avail = (size_t)(rn - (size_t)(base - rb));
  if (d->offset > avail || d->size > avail - d->offset)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "offset %llu + size %llu go beyond the %zu-byte "
                        "mapping: forged or corrupted",
                        (unsigned long long)d->offset,
                        (unsigned long long)d->size, avail);
  *mapped = avail;
  return GPUIPC_OK;
}

/* The driver hands back an existing import when this process still holds
 * a mapping at the address it opens (a legacy handle, or a pool pointer, of
 * a new allocation at a freed one's address): refuse it unless that mapping
 * is of the very allocation the descriptor names. *existing tells whether
 * the address was held already. */
static gpuipc_status check_not_shadowed(const gpuipc__desc *d, int map_ordinal,
                                        CUdeviceptr base, bool *existing) {
  int owner = gpuipc__cache_base_owner(d->kind, map_ordinal, base, d);
  *existing = owner != 0;
  if (owner == 2)
    return gpuipc__fail(GPUIPC_E_STALE,
                        "this %s descriptor (pid %d, buffer id %llu, "
                        "generation %llu) opened at 0x%llx, where this "
                        "process still holds an import of another allocation "
                        "of that exporter: the exporter freed that one and "
                        "reused its address, and the driver hands back the "
                        "old mapping; close the old import first",
                        gpuipc_pool_kind_name((gpuipc_pool_kind)d->kind),
                        (int)d->exporter.pid, (unsigned long long)d->buffer_id,
                        (unsigned long long)d->generation,
                        (unsigned long long)base);
  return GPUIPC_OK;
}

/* The mapping's own buffer id here (0 when the driver has none). */
static uint64_t local_buffer_id(CUdeviceptr base) {
  unsigned long long v = 0;
  if (GPUIPC__CU(cuPointerGetAttribute, &v, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                 base) != CUDA_SUCCESS)
    return 0;
  return v;
}

/* The fd for an fd-carrying kind: the caller's, or one fetched by pidfd. */
static gpuipc_status get_fd(const gpuipc__desc *d, const int *fds, int nfds,
                            unsigned flags, int *fd, int *fetched) {
  *fetched = -1;
  if (nfds > 0) {
    *fd = fds[0];
    return GPUIPC_OK;
  }
  if (flags & GPUIPC_IMPORT_PIDFD_GETFD) {
    GPUIPC__CHECK(gpuipc__pidfd_getfd(&d->exporter, d->exporter_fd, fetched));
    *fd = *fetched;
    return GPUIPC_OK;
  }
  return gpuipc__fail(GPUIPC_E_NEED_FD,
                      "%s buffer of pid %d: its file descriptor must come "
                      "with the descriptor (SCM_RIGHTS), or allow "
                      "GPUIPC_IMPORT_PIDFD_GETFD",
                      gpuipc_pool_kind_name((gpuipc_pool_kind)d->kind),
                      (int)d->exporter.pid);
}

static gpuipc_status open_legacy(const gpuipc__desc *d, int map_ordinal,
                                 gpuipc__opened *o) {
  CUipcMemHandle h;
  memcpy(&h, d->handle, 64);
  CUdeviceptr p = 0;
  /* Lazy peer access: the mapping may be on another device than the
   * memory's. */
  CUresult r = GPUIPC__CU(cuIpcOpenMemHandle, &p, h,
                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS) {
    gpuipc_status s = gpuipc__fail_cuda(
        r, "cuIpcOpenMemHandle",
        "legacy handle of pid %d%s", (int)d->exporter.pid,
        r == CUDA_ERROR_INVALID_VALUE
            ? ": the exporter freed this memory, exited, or the handle is "
              "forged"
            : "");
    return r == CUDA_ERROR_INVALID_VALUE ? GPUIPC_E_STALE : s;
  }
  gpuipc__cache_count_open();
  /* A freed allocation's handle bytes can come back for a new allocation
   * at the same address, and the driver then returns the mapping this
   * process still holds of the freed one. */
  bool existing = false;
  gpuipc_status s = check_not_shadowed(d, map_ordinal, p, &existing);
  if (s == GPUIPC_OK)
    s = gpuipc__import_check_range(d, p, &o->mapped_size);
  if (s != GPUIPC_OK) {
    /* One close per open: the driver counts them. */
    (void)GPUIPC__CU(cuIpcCloseMemHandle, p);
    gpuipc__cache_count_close();
    return s;
  }
  o->base = p;
  o->local_id = local_buffer_id(p);
  return GPUIPC_OK;
}

static gpuipc_status open_mempool(const gpuipc__desc *d, int map_ordinal,
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
    return gpuipc__fail_cuda(r, "cuMemPoolImportPointer",
                             "pool %llu of pid %d",
                             (unsigned long long)d->pool_id,
                             (int)d->exporter.pid);
  }
  /* The driver hands back an existing import of the same pointer rather
   * than a new one (when the exporter reused the address of a buffer still
   * imported here): that is no new mapping, and it must not be freed while
   * its holders use it. */
  bool existing = false;
  gpuipc_status s = check_not_shadowed(d, map_ordinal, p, &existing);
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
  o->local_id = local_buffer_id(p);
  return GPUIPC_OK;
}

static gpuipc_status open_vmm(const gpuipc__desc *d, int map_ordinal,
                              const int *fds, int nfds, unsigned flags,
                              gpuipc__opened *o) {
  int fd = -1, fetched = -1;
  GPUIPC__CHECK(get_fd(d, fds, nfds, flags, &fd, &fetched));
  gpuipc_status s = GPUIPC_OK;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  size_t n = (size_t)d->alloc_size;
  bool mapped = false;
  CUresult r = GPUIPC__CU(cuMemImportFromShareableHandle, &h,
                          (void *)(uintptr_t)fd,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    h = 0;
    s = gpuipc__fail_cuda(r, "cuMemImportFromShareableHandle",
                          "VMM buffer of pid %d", (int)d->exporter.pid);
    goto fail;
  }
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  r = GPUIPC__CU(cuMemGetAllocationPropertiesFromHandle, &prop, h);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemGetAllocationPropertiesFromHandle", NULL);
    goto fail;
  }
  size_t gran = 0;
  r = GPUIPC__CU(cuMemGetAllocationGranularity, &gran, &prop,
                 CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemGetAllocationGranularity", NULL);
    goto fail;
  }
  if (gran == 0 || n % gran != 0) {
    s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                     "VMM descriptor: allocation size %zu is not a multiple "
                     "of the granularity %zu",
                     n, gran);
    goto fail;
  }
  r = GPUIPC__CU(cuMemAddressReserve, &va, n, gran, 0, 0);
  if (r != CUDA_SUCCESS) {
    va = 0;
    s = gpuipc__fail_cuda(r, "cuMemAddressReserve", "%zu bytes", n);
    goto fail;
  }
  /* The importer cannot learn the allocation's size before mapping
   * (cuMemGetAllocationPropertiesFromHandle has none), so the descriptor's
   * granularity-rounded size is mapped, and mapping more than the
   * allocation holds fails: that is the real range check for a forged
   * size. The real driver (580) says CUDA_ERROR_NOT_SUPPORTED for it,
   * others CUDA_ERROR_INVALID_VALUE. */
  r = GPUIPC__CU(cuMemMap, va, n, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_SUPPORTED) {
      gpuipc__fail_cuda(r, "cuMemMap", "%zu bytes", n);
      s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                       "VMM descriptor of pid %d claims an allocation of %zu "
                       "bytes, but the driver cannot map that many of the "
                       "allocation its fd names (cuMemMap: %s): forged or "
                       "corrupted",
                       (int)d->exporter.pid, n, gpuipc__cuda_error_name(r));
    } else {
      s = gpuipc__fail_cuda(r, "cuMemMap",
                            "%zu bytes (the size the descriptor claims)", n);
    }
    goto fail;
  }
  mapped = true;
  CUmemAccessDesc ad;
  memset(&ad, 0, sizeof ad);
  ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  ad.location.id = map_ordinal;
  ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = GPUIPC__CU(cuMemSetAccess, va, n, &ad, 1);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemSetAccess", "device %d", map_ordinal);
    goto fail;
  }
  /* The mapping holds the allocation; the handle is no longer needed. */
  r = GPUIPC__CU(cuMemRelease, h);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemRelease", "imported VMM handle");
    goto fail;
  }
  h = 0;
  gpuipc__cache_count_open();
  o->base = va;
  o->mapped_size = n;
  o->local_id = local_buffer_id(va);
  if (fetched >= 0)
    close(fetched);
  return GPUIPC_OK;
fail:
  if (mapped)
    (void)GPUIPC__CU(cuMemUnmap, va, n);
  if (va)
    (void)GPUIPC__CU(cuMemAddressFree, va, n);
  if (h)
    (void)GPUIPC__CU(cuMemRelease, h);
  if (fetched >= 0)
    close(fetched);
  return s;
}

static gpuipc_status open_pinned(const gpuipc__desc *d, const int *fds,
                                 int nfds, unsigned flags, gpuipc__opened *o) {
  int fd = -1, fetched = -1;
  GPUIPC__CHECK(get_fd(d, fds, nfds, flags, &fd, &fetched));
  gpuipc_status s = GPUIPC_OK;
  struct stat st;
  size_t n = (size_t)d->alloc_size;
  if (fstat(fd, &st) != 0) {
    s = gpuipc__fail_errno(errno, "fstat", "pinned host buffer fd %d", fd);
    goto out;
  }
  if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < d->alloc_size) {
    s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                     "pinned host descriptor claims %zu bytes; its fd holds "
                     "%lld: forged or corrupted",
                     n, (long long)st.st_size);
    goto out;
  }
  void *host = NULL;
  CUdeviceptr dp = 0;
  GPUIPC__CHECK_GOTO(map_pinned(fd, n, &host, &dp), s, out);
  gpuipc__cache_count_open();
  o->host = host;
  o->base = dp;
  o->mapped_size = n;
out:
  if (fetched >= 0)
    close(fetched);
  return s;
}

static gpuipc_status open_desc(const gpuipc__desc *d, int map_ordinal,
                               const int *fds, int nfds, unsigned flags,
                               gpuipc__opened *o) {
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, map_ordinal));
  gpuipc_status s;
  switch (d->kind) {
  case GPUIPC_POOL_LEGACY:
    s = open_legacy(d, map_ordinal, o);
    break;
  case GPUIPC_POOL_MEMPOOL:
    s = open_mempool(d, map_ordinal, fds, nfds, flags, o);
    break;
  case GPUIPC_POOL_VMM:
    s = open_vmm(d, map_ordinal, fds, nfds, flags, o);
    break;
  case GPUIPC_POOL_PINNED_HOST:
    s = open_pinned(d, fds, nfds, flags, o);
    break;
  default:
    s = gpuipc__fail(GPUIPC_E_BAD_KIND, "kind %u", d->kind);
    break;
  }
  gpuipc__ctx_leave(&g);
  return s;
}

gpuipc_status gpuipc__close_opened(uint8_t kind, int map_ordinal,
                                   gpuipc__opened *o) {
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, map_ordinal);
  if (s != GPUIPC_OK) {
    /* Without a context nothing can be closed; the mapping stays. */
    gpuipc__pool_import_release(o->pimp);
    o->pimp = NULL;
    return s;
  }
  CUresult r = CUDA_SUCCESS;
  const char *call = NULL;
  switch (kind) {
  case GPUIPC_POOL_LEGACY:
    call = "cuIpcCloseMemHandle";
    r = GPUIPC__CU(cuIpcCloseMemHandle, o->base);
    break;
  case GPUIPC_POOL_MEMPOOL:
    call = "cuMemFree";
    r = GPUIPC__CU(cuMemFree, o->base);
    break;
  case GPUIPC_POOL_VMM:
    call = "cuMemUnmap";
    r = GPUIPC__CU(cuMemUnmap, o->base, o->mapped_size);
    if (r == CUDA_SUCCESS) {
      call = "cuMemAddressFree";
      r = GPUIPC__CU(cuMemAddressFree, o->base, o->mapped_size);
    }
    break;
  case GPUIPC_POOL_PINNED_HOST:
    unmap_pinned(o->host, o->mapped_size, &s);
    break;
  default:
    break;
  }
  gpuipc__ctx_leave(&g);
  gpuipc__cache_count_close();
  if (r != CUDA_SUCCESS)
    s = gpuipc__fail_cuda(r, call, "closing an imported %s mapping 0x%llx",
                          gpuipc_pool_kind_name((gpuipc_pool_kind)kind),
                          (unsigned long long)o->base);
  gpuipc__pool_import_release(o->pimp);
  o->pimp = NULL;
  return s;
}

gpuipc_status gpuipc_buffer_import(const uint8_t *desc, size_t len,
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
                                  GPUIPC_DESC_BUFFER, "a buffer", &opts, &d));
  /* Did the exporter free it? Its liveness table knows (the driver would
   * map freed memory, or another allocation at its address, silently). */
  if (gpuipc__generation_state(&d.exporter, d.generation) == GPUIPC__LIVE_FREED)
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
  int home = -1, map = -1;
  if (d.kind == GPUIPC_POOL_PINNED_HOST) {
    /* Host memory does not live on the exporter's device, which may be
     * hidden here: it is registered in the context of opts->device, or of
     * the exporter's device when visible, else of device 0. */
    if (opts.device)
      GPUIPC__CHECK(gpuipc__device_ordinal(opts.device, &map));
    else if (gpuipc__device_ordinal(&dev, &map) != GPUIPC_OK)
      map = 0;
    home = map;
  } else {
    GPUIPC__CHECK(gpuipc__device_ordinal(&dev, &home));
    map = home;
    if (opts.device)
      GPUIPC__CHECK(gpuipc__device_ordinal(opts.device, &map));
  }

  gpuipc_buffer *b = buffer_new();
  if (b == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "buffer");
  struct gpuipc__mapping *m = NULL;
  gpuipc_status s =
      gpuipc__cache_acquire(&d, map, fds, nfds, opts.flags, open_desc, &m);
  if (s != GPUIPC_OK) {
    buffer_delete(b);
    return s;
  }
  /* A cache hit may come from a descriptor with another offset and size:
   * check them against this mapping too. */
  size_t mapped = gpuipc__mapping_size(m);
  if (d.offset > mapped || d.size > mapped - d.offset) {
    gpuipc__cache_release(m);
    buffer_delete(b);
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "descriptor claims offset %llu + size %llu, but the "
                        "mapping is %zu bytes: forged or corrupted",
                        (unsigned long long)d.offset,
                        (unsigned long long)d.size, mapped);
  }
  b->origin = GPUIPC__IMPORTED;
  b->kind = (gpuipc_pool_kind)d.kind;
  b->ordinal = home;
  b->map_ordinal = map;
  b->uuid = dev;
  b->base = gpuipc__mapping_base(m);
  b->ptr = b->base + d.offset;
  if (d.kind == GPUIPC_POOL_PINNED_HOST)
    b->ptr = (CUdeviceptr)(uintptr_t)gpuipc__mapping_host(m) + d.offset;
  b->size = (size_t)d.size;
  b->offset = (size_t)d.offset;
  b->alloc_size = mapped;
  b->buffer_id = d.buffer_id;
  b->generation = d.generation;
  b->pool_id = d.pool_id;
  b->exporter = d.exporter;
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
    if (b->kind == GPUIPC_POOL_VMM) {
      CUresult r = GPUIPC__CU(cuMemRelease, b->vmm);
      if (r != CUDA_SUCCESS)
        s = gpuipc__fail_cuda(r, "cuMemRelease", "wrapped VMM allocation");
    }
    if (b->fd >= 0)
      close(b->fd);
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
    CUresult r = CUDA_SUCCESS;
    switch (b->kind) {
    case GPUIPC_POOL_MEMPOOL:
      r = GPUIPC__CU(cuMemFreeAsync, b->ptr, (CUstream)stream);
      if (r != CUDA_SUCCESS)
        s = gpuipc__fail_cuda(r, "cuMemFreeAsync", NULL);
      break;
    case GPUIPC_POOL_LEGACY:
      r = GPUIPC__CU(cuMemFree, b->base);
      if (r != CUDA_SUCCESS)
        s = gpuipc__fail_cuda(r, "cuMemFree", NULL);
      break;
    case GPUIPC_POOL_VMM:
      free_vmm(b, &s);
      break;
    case GPUIPC_POOL_PINNED_HOST:
      unmap_pinned(b->host, b->alloc_size, &s);
      break;
    default:
      break;
    }
    gpuipc__ctx_leave(&g);
  }
  /* The buffer is gone even when the driver reported an error: there is
   * nothing a caller could retry. */
  if (b->fd >= 0)
    close(b->fd);
  if (pool) {
    if (pool->capacity && pool->kind != GPUIPC_POOL_MEMPOOL)
      atomic_fetch_sub(&pool->in_use, b->size);
    atomic_fetch_sub(&pool->live, 1);
  }
  buffer_delete(b);
  return s;
}
