/*
 * pinned.c: owns the PINNED_HOST buffer kind: host memory in a sealed
 * memfd (its size can never change under a mapping), mapped and registered
 * with the driver (portable, device-mapped) on both sides; the memfd is the
 * buffer's shareable fd. Host memory belongs to no device: an importer
 * registers it in the context of any device it likes.
 */
#include "handle_int.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

/* Nothing to create up front: each buffer is its own memfd. The primary
 * context is retained here so that allocation does not pay it. */
static gpuipc_status pinned_pool_create(gpuipc_pool *p,
                                        const gpuipc_pool_options *opts) {
  (void)opts;
  CUcontext c;
  return gpuipc__primary_ctx(p->ordinal, &c);
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

static gpuipc_status unmap_pinned(void *host, size_t size) {
  gpuipc_status s = GPUIPC_OK;
  CUresult r = GPUIPC__CU(cuMemHostUnregister, host);
  if (r != CUDA_SUCCESS)
    s = gpuipc__fail_cuda(r, "cuMemHostUnregister", NULL);
  munmap(host, size);
  return s;
}

static gpuipc_status pinned_alloc(gpuipc_pool *p, gpuipc_buffer *b,
                                  size_t size, CUstream stream) {
  (void)p;
  (void)stream;
  long page = sysconf(_SC_PAGESIZE);
  size_t n = gpuipc__round_up(size, page > 0 ? (size_t)page : 4096);
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

static gpuipc_status pinned_free(gpuipc_buffer *b, CUstream stream) {
  (void)stream;
  return unmap_pinned(b->host, b->alloc_size);
}

static void pinned_describe(const gpuipc_buffer *b, gpuipc__desc *d, int *fd) {
  *fd = b->fd;
  d->exporter_fd = b->fd;
}

static gpuipc_status pinned_open(const gpuipc__desc *d, int map_ordinal,
                                 const int *fds, int nfds, unsigned flags,
                                 gpuipc__opened *o) {
  (void)map_ordinal;
  int fd = -1, fetched = -1;
  GPUIPC__CHECK(gpuipc__import_fd(d, fds, nfds, flags, &fd, &fetched));
  size_t n = (size_t)d->alloc_size;
  /* Checked before it is mapped: a hostile exporter could otherwise send
   * an fd it can shrink (SIGBUS here), or an fd of other memory. */
  gpuipc_status s = gpuipc__import_check_host_fd(fd, n);
  if (s != GPUIPC_OK)
    goto out;
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

static gpuipc_status pinned_close(int map_ordinal, gpuipc__opened *o) {
  (void)map_ordinal;
  return unmap_pinned(o->host, o->mapped_size);
}

const gpuipc__kind_ops gpuipc__pinned_ops = {
    .kind = GPUIPC_POOL_PINNED_HOST,
    .named_by_handle = false,
    .stream_ordered = false,
    .driver_capacity = false,
    .host_memory = true,
    .pool_create = pinned_pool_create,
    .pool_destroy = NULL,
    .pool_export = NULL,
    .alloc = pinned_alloc,
    .free = pinned_free,
    .wrap = NULL,
    .unwrap = NULL,
    .make_handle = NULL,
    .describe = pinned_describe,
    .open = pinned_open,
    .close = pinned_close,
    .forget = NULL,
};
