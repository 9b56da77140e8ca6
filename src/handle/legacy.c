/*
 * legacy.c: owns the LEGACY buffer kind: cuMemAlloc allocations shared by
 * legacy CUDA IPC handles (cuIpcGetMemHandle / cuIpcOpenMemHandle), and
 * wrapping foreign cuMemAlloc memory. A legacy handle is a bearer token
 * and carries no fd; the driver maps it once per process however often it
 * is opened, and counts the opens (one close per open).
 */
#include "handle_int.h"

#include <string.h>

/* Nothing to create up front: each buffer is its own allocation. The
 * primary context is retained here so that allocation does not pay it. */
static gpuipc_status legacy_pool_create(gpuipc_pool *p,
                                        const gpuipc_pool_options *opts) {
  (void)opts;
  CUcontext c;
  return gpuipc__primary_ctx(p->ordinal, &c);
}

static gpuipc_status legacy_alloc(gpuipc_pool *p, gpuipc_buffer *b,
                                  size_t size, CUstream stream) {
  (void)stream;
  CUresult r = GPUIPC__CU(cuMemAlloc, &b->ptr, size);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemAlloc", "%zu bytes on device %d", size,
                             p->ordinal);
  CUdeviceptr base = 0;
  size_t n = 0;
  r = GPUIPC__CU(cuMemGetAddressRange, &base, &n, b->ptr);
  if (r != CUDA_SUCCESS) {
    gpuipc_status s = gpuipc__fail_cuda(r, "cuMemGetAddressRange", NULL);
    (void)GPUIPC__CU(cuMemFree, b->ptr);
    return s;
  }
  b->base = base;
  b->offset = (size_t)(b->ptr - base);
  b->alloc_size = n;
  return GPUIPC_OK;
}

static gpuipc_status legacy_free(gpuipc_buffer *b, CUstream stream) {
  (void)stream;
  CUresult r = GPUIPC__CU(cuMemFree, b->base);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemFree", NULL);
  return GPUIPC_OK;
}

static gpuipc_status legacy_wrap(gpuipc_buffer *b, CUdeviceptr ptr,
                                 int ordinal) {
  (void)ordinal;
  CUresult r = GPUIPC__CU(cuMemGetAddressRange, &b->base, &b->alloc_size, ptr);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemGetAddressRange", "0x%llx",
                             (unsigned long long)ptr);
  return gpuipc__pointer_buffer_id(b->base, &b->buffer_id);
}

/* The handle of an interior pointer is the handle of the base: the offset
 * travels beside it. */
static gpuipc_status legacy_make_handle(gpuipc_buffer *b) {
  CUipcMemHandle h;
  CUresult r = GPUIPC__CU(cuIpcGetMemHandle, &h, b->base);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuIpcGetMemHandle", "0x%llx",
                             (unsigned long long)b->base);
  memcpy(b->handle, &h, 64);
  return GPUIPC_OK;
}

static void legacy_describe(const gpuipc_buffer *b, gpuipc__desc *d, int *fd) {
  d->handle_len = 64;
  memcpy(d->handle, b->handle, 64);
  d->exporter_fd = -1;
  *fd = -1;
}

static gpuipc_status legacy_open(const gpuipc__desc *d, int map_ordinal,
                                 const int *fds, int nfds, unsigned flags,
                                 gpuipc__opened *o) {
  (void)fds;
  (void)nfds;
  CUipcMemHandle h;
  memcpy(&h, d->handle, 64);
  CUdeviceptr p = 0;
  /* Lazy peer access: the mapping may be on another device than the
   * memory's. */
  CUresult r = GPUIPC__CU(cuIpcOpenMemHandle, &p, h,
                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r != CUDA_SUCCESS) {
    /* The driver says INVALID_CONTEXT for a handle of this very process
     * (only raw handle bytes can name one: descriptors of this process are
     * refused before) and INVALID_VALUE for memory that is gone, or bytes
     * that were never a handle. */
    if (r == CUDA_ERROR_INVALID_CONTEXT)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "cuIpcOpenMemHandle: CUDA_ERROR_INVALID_CONTEXT: "
                          "the handle was exported by this process (use the "
                          "pointer itself)");
    gpuipc_status s = gpuipc__fail_cuda(
        r, "cuIpcOpenMemHandle", "legacy handle of pid %d%s",
        (int)d->exporter.pid,
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
  gpuipc_status s =
      gpuipc__import_check_shadow(d, map_ordinal, p, flags, &existing);
  if (s == GPUIPC_OK)
    s = gpuipc__import_check_range(d, p, &o->mapped_size);
  if (s != GPUIPC_OK) {
    /* One close per open: the driver counts them. */
    (void)GPUIPC__CU(cuIpcCloseMemHandle, p);
    gpuipc__cache_count_close();
    return s;
  }
  o->base = p;
  o->local_id = gpuipc__local_buffer_id(p);
  return GPUIPC_OK;
}

static gpuipc_status legacy_close(int map_ordinal, gpuipc__opened *o) {
  (void)map_ordinal;
  CUresult r = GPUIPC__CU(cuIpcCloseMemHandle, o->base);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuIpcCloseMemHandle",
                             "closing an imported legacy mapping 0x%llx",
                             (unsigned long long)o->base);
  return GPUIPC_OK;
}

const gpuipc__kind_ops gpuipc__legacy_ops = {
    .kind = GPUIPC_POOL_LEGACY,
    .named_by_handle = true,
    .stream_ordered = false,
    .driver_capacity = false,
    .host_memory = false,
    .pool_create = legacy_pool_create,
    .pool_destroy = NULL,
    .pool_export = NULL,
    .alloc = legacy_alloc,
    .free = legacy_free,
    .wrap = legacy_wrap,
    .unwrap = NULL,
    .make_handle = legacy_make_handle,
    .describe = legacy_describe,
    .open = legacy_open,
    .close = legacy_close,
    .forget = NULL,
};
