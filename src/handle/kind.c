/*
 * kind.c: owns what the buffer kinds' operations share, below all of them
 * and below the import cache, so that no call between the handle layer's
 * files goes back up (the kinds are reached from above only through their
 * ops tables, registered in pool.c): the kinds' names, pool ids, the
 * driver's buffer id of a pointer, and the checks every opener makes of
 * what a descriptor brought (its fd is what it claims to be; its range
 * lies inside the mapping).
 */
#include "handle_int.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

const char *gpuipc_pool_kind_name(gpuipc_pool_kind kind) {
  switch (kind) {
  case GPUIPC_POOL_AUTO: return "auto";
  case GPUIPC_POOL_MEMPOOL: return "mempool";
  case GPUIPC_POOL_VMM: return "vmm";
  case GPUIPC_POOL_LEGACY: return "legacy";
  case GPUIPC_POOL_PINNED_HOST: return "pinned-host";
  }
  return "unknown";
}

static atomic_uint_fast64_t pool_ids;

uint64_t gpuipc__next_pool_id(void) { return atomic_fetch_add(&pool_ids, 1) + 1; }

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

/* ---- import: what the kinds' openers share ----------------------------------- */

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


uint64_t gpuipc__local_buffer_id(CUdeviceptr base) {
  unsigned long long v = 0;
  if (GPUIPC__CU(cuPointerGetAttribute, &v, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                 base) != CUDA_SUCCESS)
    return 0;
  return v;
}


/* What the kernel says an fd is, for messages: its /proc/self/fd link. */
static void fd_name(int fd, char *out, size_t cap) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, out, cap - 1);
  if (n < 0)
    n = 0;
  out[n] = '\0';
}

gpuipc_status gpuipc__import_check_host_fd(int fd, size_t size) {
  char name[256];
  struct stat st;
  if (fstat(fd, &st) != 0)
    return gpuipc__fail_errno(errno, "fstat", "pinned host buffer fd %d", fd);
  int seals = S_ISREG(st.st_mode) ? fcntl(fd, F_GET_SEALS) : -1;
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    fd_name(fd, name, sizeof name);
    return gpuipc__fail(GPUIPC_E_BAD_KIND,
                        "pinned host descriptor: its fd %d (%s) is not a "
                        "memfd sealed against shrinking (%s): its owner "
                        "could cut the mapping short under this process",
                        fd, name,
                        seals < 0 ? "no seals" : "F_SEAL_SHRINK missing");
  }
  if ((uint64_t)st.st_size < (uint64_t)size)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "pinned host descriptor claims %zu bytes; its fd holds "
                        "%lld: forged or corrupted",
                        size, (long long)st.st_size);
  return GPUIPC_OK;
}

gpuipc_status gpuipc__import_check_driver_fd(int fd, const char *what) {
  char name[256];
  struct stat st;
  if (fstat(fd, &st) != 0)
    return gpuipc__fail_errno(errno, "fstat", "%s fd %d", what, fd);
  const char *why = NULL;
  if (S_ISDIR(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
      S_ISBLK(st.st_mode) || S_ISLNK(st.st_mode)) {
    why = "a directory, pipe, socket or block device";
  } else if (S_ISREG(st.st_mode)) {
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals >= 0 && (seals & (F_SEAL_SHRINK | F_SEAL_GROW))) {
      why = "host memory sealed against resizing (a pinned host buffer's "
            "memfd)";
    } else {
      /* A memfd's link is "/memfd:NAME (deleted)", an anonymous inode's
       * "anon_inode:...": only a path names a file of a file system. */
      fd_name(fd, name, sizeof name);
      if (name[0] == '/' && strncmp(name, "/memfd:", 7) != 0)
        why = "a file of a file system";
    }
  }
  if (why != NULL) {
    fd_name(fd, name, sizeof name);
    return gpuipc__fail(GPUIPC_E_BAD_KIND,
                        "%s descriptor: its fd %d (%s) is %s, not a shareable "
                        "handle of the driver",
                        what, fd, name, why);
  }
  return GPUIPC_OK;
}
