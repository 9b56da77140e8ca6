/*
 * vmm.c: owns the VMM buffer kind: physical allocations made with
 * cuMemCreate (POSIX fd export), mapped into a reserved range with the
 * pool's access list, shared by their own fd (one per allocation, made on
 * first export); wrapping foreign VMM mappings (a caching allocator's
 * expandable segments); and importing such an fd into a mapping here.
 */
#include "handle_int.h"

#include <string.h>
#include <unistd.h>

static gpuipc_status vmm_pool_create(gpuipc_pool *p,
                                     const gpuipc_pool_options *opts) {
  (void)opts;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = p->cudev;
  size_t gran = 0;
  CUresult r = GPUIPC__CU(cuMemGetAllocationGranularity, &gran, &prop,
                          CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemGetAllocationGranularity", "device %d",
                             p->ordinal);
  if (gran == 0 || (gran & (gran - 1)) != 0)
    return gpuipc__fail(GPUIPC_E_INTERNAL, "VMM granularity %zu", gran);
  p->granularity = gran;
  return GPUIPC_OK;
}

static gpuipc_status vmm_alloc(gpuipc_pool *p, gpuipc_buffer *b, size_t size,
                               CUstream stream) {
  (void)stream;
  size_t n = gpuipc__round_up(size, p->granularity);
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

static gpuipc_status vmm_free(gpuipc_buffer *b, CUstream stream) {
  (void)stream;
  gpuipc_status s = GPUIPC_OK;
  CUresult r = GPUIPC__CU(cuMemUnmap, b->base, b->alloc_size);
  if (r != CUDA_SUCCESS && s == GPUIPC_OK)
    s = gpuipc__fail_cuda(r, "cuMemUnmap", NULL);
  r = GPUIPC__CU(cuMemAddressFree, b->base, b->alloc_size);
  if (r != CUDA_SUCCESS && s == GPUIPC_OK)
    s = gpuipc__fail_cuda(r, "cuMemAddressFree", NULL);
  r = GPUIPC__CU(cuMemRelease, b->vmm);
  if (r != CUDA_SUCCESS && s == GPUIPC_OK)
    s = gpuipc__fail_cuda(r, "cuMemRelease", NULL);
  return s;
}

/* Shares the physical allocation behind a VMM mapping, if it was created
 * exportable as a POSIX fd; holds one reference on its handle
 * (cuMemRetainAllocationHandle) until unwrap. */
static gpuipc_status vmm_wrap(gpuipc_buffer *b, CUdeviceptr ptr, int ordinal) {
  (void)ordinal;
  CUmemGenericAllocationHandle h = 0;
  CUresult r = GPUIPC__CU(cuMemRetainAllocationHandle, &h,
                          (void *)(uintptr_t)ptr);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_buffer_wrap: 0x%llx is neither cuMemAlloc "
                        "memory, nor memory of a pool, nor a VMM mapping "
                        "(cuMemRetainAllocationHandle: %s)",
                        (unsigned long long)ptr, gpuipc__cuda_error_name(r));
  gpuipc_status s = GPUIPC_OK;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  unsigned long long mbase = 0, msize = 0;
  r = GPUIPC__CU(cuMemGetAllocationPropertiesFromHandle, &prop, h);
  if (r != CUDA_SUCCESS)
    s = gpuipc__fail_cuda(r, "cuMemGetAllocationPropertiesFromHandle", NULL);
  else if (!(prop.requestedHandleTypes &
             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                     "gpuipc_buffer_wrap: the VMM allocation behind 0x%llx "
                     "was not created with CU_MEM_HANDLE_TYPE_POSIX_FILE_"
                     "DESCRIPTOR, so it cannot be shared",
                     (unsigned long long)ptr);
  else if ((r = GPUIPC__CU(cuPointerGetAttribute, &mbase,
                           CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, ptr)) !=
               CUDA_SUCCESS ||
           (r = GPUIPC__CU(cuPointerGetAttribute, &msize,
                           CU_POINTER_ATTRIBUTE_MAPPING_SIZE, ptr)) !=
               CUDA_SUCCESS)
    s = gpuipc__fail_cuda(r, "cuPointerGetAttribute",
                          "mapping base and size of 0x%llx",
                          (unsigned long long)ptr);
  if (s != GPUIPC_OK) {
    (void)GPUIPC__CU(cuMemRelease, h);
    return s;
  }
  b->vmm = h;
  b->base = (CUdeviceptr)mbase;
  b->alloc_size = (size_t)msize;
  unsigned long long id = 0;
  if (GPUIPC__CU(cuPointerGetAttribute, &id, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                 b->base) == CUDA_SUCCESS)
    b->buffer_id = id;
  return GPUIPC_OK;
}

static gpuipc_status vmm_unwrap(gpuipc_buffer *b) {
  CUresult r = GPUIPC__CU(cuMemRelease, b->vmm);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemRelease", "wrapped VMM allocation");
  return GPUIPC_OK;
}

static gpuipc_status vmm_make_handle(gpuipc_buffer *b) {
  int fd = -1;
  CUresult r = GPUIPC__CU(cuMemExportToShareableHandle, &fd, b->vmm,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemExportToShareableHandle", NULL);
  b->fd = fd;
  return GPUIPC_OK;
}

static void vmm_describe(const gpuipc_buffer *b, gpuipc__desc *d, int *fd) {
  *fd = b->fd;
  d->exporter_fd = b->fd;
}

static gpuipc_status vmm_open(const gpuipc__desc *d, int map_ordinal,
                              const int *fds, int nfds, unsigned flags,
                              gpuipc__opened *o) {
  int fd = -1, fetched = -1;
  GPUIPC__CHECK(gpuipc__import_fd(d, fds, nfds, flags, &fd, &fetched));
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0;
  size_t n = (size_t)d->alloc_size;
  bool mapped = false;
  CUresult r = CUDA_SUCCESS;
  gpuipc_status s = gpuipc__import_check_driver_fd(fd, "VMM");
  if (s != GPUIPC_OK)
    goto fail;
  r = GPUIPC__CU(cuMemImportFromShareableHandle, &h,
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
    /* A physical allocation is never larger than its device's memory: a
     * claim beyond it, whose address range cannot even be reserved, is
     * forged (and not this process out of device memory). */
    size_t total = 0;
    if (r == CUDA_ERROR_OUT_OF_MEMORY &&
        GPUIPC__CU(cuDeviceTotalMem, &total, (CUdevice)prop.location.id) ==
            CUDA_SUCCESS &&
        n > total) {
      gpuipc__fail_cuda(r, "cuMemAddressReserve", "%zu bytes", n);
      s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                       "VMM descriptor of pid %d claims an allocation of %zu "
                       "bytes, more than its device holds (%zu): forged or "
                       "corrupted",
                       (int)d->exporter.pid, n, total);
    } else {
      s = gpuipc__fail_cuda(r, "cuMemAddressReserve", "%zu bytes", n);
    }
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
  o->local_id = gpuipc__local_buffer_id(va);
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

static gpuipc_status vmm_close(int map_ordinal, gpuipc__opened *o) {
  (void)map_ordinal;
  const char *call = "cuMemUnmap";
  CUresult r = GPUIPC__CU(cuMemUnmap, o->base, o->mapped_size);
  if (r == CUDA_SUCCESS) {
    call = "cuMemAddressFree";
    r = GPUIPC__CU(cuMemAddressFree, o->base, o->mapped_size);
  }
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, call, "closing an imported vmm mapping 0x%llx",
                             (unsigned long long)o->base);
  return GPUIPC_OK;
}

const gpuipc__kind_ops gpuipc__vmm_ops = {
    .kind = GPUIPC_POOL_VMM,
    .named_by_handle = false,
    .stream_ordered = false,
    .driver_capacity = false,
    .host_memory = false,
    .pool_create = vmm_pool_create,
    .pool_destroy = NULL,
    .pool_export = NULL,
    .alloc = vmm_alloc,
    .free = vmm_free,
    .wrap = vmm_wrap,
    .unwrap = vmm_unwrap,
    .make_handle = vmm_make_handle,
    .describe = vmm_describe,
    .open = vmm_open,
    .close = vmm_close,
    .forget = NULL,
};
