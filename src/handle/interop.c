/*
 * interop.c: raw imports and exports for peers that do not speak gpuipc
 * descriptors: legacy IPC memory and event handles (CuPy, the CUDA
 * runtime), and memory-pool fd + pointer export data (cuda.core).
 *
 * Exports are gpuipc_buffer_export / gpuipc_event_export decoded back into
 * their fields. Imports build the decoded descriptor a gpuipc exporter
 * would have sent, naming a synthetic exporter (see raw_identity), and open
 * it as gpuipc_buffer_import does (gpuipc__buffer_open in buffer.c: the
 * import cache, the kind's own opener, the range check, the buffer object),
 * flagged GPUIPC__IMPORT_RAW: the opener's check of the exporter's buffer
 * id against a mapping the driver hands back needs an id, which raw bytes
 * do not carry (a raw peer sends none), so that check is the one thing
 * skipped; the range check against the real mapping stays.
 */
#include "handle_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The exporter every raw import names: this machine and pid namespace, and
 * a pid no process can have (pid_max is at most 2^22), so that raw imports
 * share the cache among themselves (keyed by the handle bytes, which name
 * the allocation machine-wide) and never collide with descriptors of real
 * gpuipc exporters. */
#define RAW_PID 0x7fffffff

static gpuipc_status raw_identity(gpuipc__identity *id) {
  GPUIPC__CHECK(gpuipc__self_identity(id));
  id->pid = RAW_PID;
  id->start_time = 0;
  return GPUIPC_OK;
}

static gpuipc_status resolve_devices(const gpuipc_uuid *device,
                                     const gpuipc_import_options *opts_in,
                                     gpuipc_uuid *home_uuid, int *home,
                                     int *map) {
  gpuipc_import_options opts = GPUIPC_IMPORT_OPTIONS_INIT;
  GPUIPC__CHECK(gpuipc__options_copy(&opts, sizeof opts, opts_in, 0,
                                     "gpuipc_import_options",
                                     "GPUIPC_IMPORT_OPTIONS_INIT"));
  if (device) {
    *home_uuid = *device;
    GPUIPC__CHECK(gpuipc_device_from_uuid(device, home));
  } else {
    *home = 0;
    GPUIPC__CHECK(gpuipc_device_uuid(0, home_uuid));
  }
  *map = *home;
  if (opts.device)
    GPUIPC__CHECK(gpuipc_device_from_uuid(opts.device, map));
  return GPUIPC_OK;
}

static gpuipc_status raw_desc(gpuipc__desc *d, gpuipc_pool_kind kind,
                              const uint8_t handle[64], size_t offset,
                              size_t size, const gpuipc_uuid *home_uuid) {
  memset(d, 0, sizeof *d);
  d->version = GPUIPC__DESC_VERSION;
  d->type = GPUIPC_DESC_BUFFER;
  d->kind = (uint8_t)kind;
  d->flags = GPUIPC__DESC_F_WRAPPED;
  d->handle_len = 64;
  d->exporter_fd = -1;
  memcpy(d->device, home_uuid->bytes, 16);
  GPUIPC__CHECK(raw_identity(&d->exporter));
  d->offset = offset;
  d->size = size;
  d->alloc_size = offset + size; /* a claim; the mapping is the truth */
  memcpy(d->handle, handle, 64);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_buffer_import_legacy_raw(const uint8_t handle[64],
                                              size_t offset, size_t size,
                                              const gpuipc_uuid *device,
                                              const gpuipc_import_options *opts,
                                              gpuipc_buffer **buf) {
  if (handle == NULL || buf == NULL || size == 0 || offset > SIZE_MAX - size)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_import_legacy_raw: NULL handle/out, "
                        "size 0, or offset + size overflows");
  *buf = NULL;
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid home_uuid;
  int home = -1, map = -1;
  GPUIPC__CHECK(resolve_devices(device, opts, &home_uuid, &home, &map));
  gpuipc__desc d;
  GPUIPC__CHECK(raw_desc(&d, GPUIPC_POOL_LEGACY, handle, offset, size,
                         &home_uuid));
  return gpuipc__buffer_open(&d, gpuipc__kind_ops_get(d.kind), home, map,
                             NULL, 0, GPUIPC__IMPORT_RAW, buf);
}

/* Which exported pool a raw pool fd names. The handle layer imports each
 * (exporter, pool id) once, so every fd of one pool must get the same id,
 * and fds of different pools different ids. The fd's inode cannot tell:
 * shareable handles may be anonymous files that share one inode. Two
 * things can:
 * - the driver: importing a pool it already imported returns the same
 *   CUmemoryPool, so the handle's value names the pool in this process
 *   (raw pool imports are never destroyed, so the value is never reused);
 * - kcmp(KCMP_FILE): an fd received again (another SCM_RIGHTS copy of the
 *   same export) is the same open file as one seen before, so its id is
 *   known without asking the driver again.
 * So: a remembered fd (a dup) per open file seen, compared with kcmp; on a
 * miss (or where kcmp is not allowed), one driver import. */
#define RAW_POOL_FDS 64
typedef struct raw_pool {
  int fd; /* our dup of a pool fd seen before; -1: free slot */
  uint64_t id;
} raw_pool;
static pthread_mutex_t raw_pools_lock = PTHREAD_MUTEX_INITIALIZER;
static raw_pool raw_pools[RAW_POOL_FDS];
static bool raw_pools_init;
static unsigned raw_pools_next; /* slot to replace when full */
static pid_t raw_pools_pid;     /* the fds belong to this process */

#ifndef SYS_kcmp
#define SYS_kcmp 312
#endif
#define GPUIPC__KCMP_FILE 0

/* 0: same open file; 1: different; -1: cannot tell. */
static int same_file(int a, int b) {
  pid_t me = getpid();
  long r = syscall(SYS_kcmp, me, me, GPUIPC__KCMP_FILE, (unsigned long)a,
                   (unsigned long)b);
  return r == 0 ? 0 : r > 0 ? 1 : -1;
}

static gpuipc_status raw_pool_id(int fd, int home, uint64_t *id) {
  gpuipc_status s = GPUIPC_OK;
  pthread_mutex_lock(&raw_pools_lock);
  if (!raw_pools_init || raw_pools_pid != getpid()) {
    /* First use, or a forked child whose table names its parent's fds. */
    for (int i = 0; i < RAW_POOL_FDS; i++)
      raw_pools[i].fd = -1;
    raw_pools_init = true;
    raw_pools_pid = getpid();
  }
  for (int i = 0; i < RAW_POOL_FDS; i++)
    if (raw_pools[i].fd >= 0 && same_file(raw_pools[i].fd, fd) == 0) {
      *id = raw_pools[i].id;
      goto out;
    }
  {
    gpuipc__ctx_guard g;
    GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, home), s, out);
    CUmemoryPool mp = NULL;
    CUresult r = GPUIPC__CU(cuMemPoolImportFromShareableHandle, &mp,
                            (void *)(uintptr_t)fd,
                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    gpuipc__ctx_leave(&g);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemPoolImportFromShareableHandle",
                            "raw pool fd %d", fd);
      goto out;
    }
    *id = (uint64_t)(uintptr_t)mp;
  }
  /* Remember this open file for the next buffer of the pool. */
  int keep = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (keep >= 0) {
    int slot = -1;
    for (int i = 0; i < RAW_POOL_FDS && slot < 0; i++)
      if (raw_pools[i].fd < 0)
        slot = i;
    if (slot < 0) {
      slot = (int)(raw_pools_next++ % RAW_POOL_FDS);
      close(raw_pools[slot].fd);
    }
    raw_pools[slot].fd = keep;
    raw_pools[slot].id = *id;
  }
out:
  pthread_mutex_unlock(&raw_pools_lock);
  return s;
}

gpuipc_status gpuipc_buffer_import_mempool_raw(
    int pool_fd, const uint8_t export_data[64], size_t offset, size_t size,
    const gpuipc_uuid *device, const gpuipc_import_options *opts,
    gpuipc_buffer **buf) {
  if (pool_fd < 0 || export_data == NULL || buf == NULL || size == 0 ||
      offset > SIZE_MAX - size)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_import_mempool_raw: bad fd %d, NULL "
                        "export data/out, size 0, or offset + size overflows",
                        pool_fd);
  *buf = NULL;
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid home_uuid;
  int home = -1, map = -1;
  GPUIPC__CHECK(resolve_devices(device, opts, &home_uuid, &home, &map));
  gpuipc__desc d;
  GPUIPC__CHECK(raw_desc(&d, GPUIPC_POOL_MEMPOOL, export_data, offset, size,
                         &home_uuid));
  GPUIPC__CHECK(raw_pool_id(pool_fd, home, &d.pool_id));
  d.nfds = 1;
  return gpuipc__buffer_open(&d, gpuipc__kind_ops_get(d.kind), home, map,
                             &pool_fd, 1, GPUIPC__IMPORT_RAW, buf);
}

/* ---- exports ----------------------------------------------------------------- */

static gpuipc_status export_fields(gpuipc_buffer *buf, gpuipc_pool_kind want,
                                   int *fd, gpuipc__desc *d) {
  if (buf == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "raw export: NULL buffer");
  gpuipc_pool_kind k = gpuipc_buffer_get_kind(buf);
  if (k != want)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "raw %s export of a %s buffer: only %s buffers have "
                        "that form",
                        gpuipc_pool_kind_name(want), gpuipc_pool_kind_name(k),
                        gpuipc_pool_kind_name(want));
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = fd ? GPUIPC_DESC_MAX_FDS : 0;
  GPUIPC__CHECK(gpuipc_buffer_export(buf, desc, sizeof desc, &len,
                                     fd ? fds : NULL, &nfds));
  gpuipc_status s = gpuipc__desc_decode(desc, len, d);
  if (fd) {
    *fd = -1;
    if (s == GPUIPC_OK && nfds == 1)
      *fd = fds[0];
    else
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
    if (s == GPUIPC_OK && *fd < 0)
      s = gpuipc__fail(GPUIPC_E_INTERNAL, "raw export: the pool gave no fd");
  }
  return s;
}

gpuipc_status gpuipc_buffer_export_legacy_raw(gpuipc_buffer *buf,
                                              uint8_t handle[64],
                                              size_t *offset, size_t *size,
                                              gpuipc_uuid *device) {
  if (handle == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_export_legacy_raw: NULL handle");
  gpuipc__desc d;
  GPUIPC__CHECK(export_fields(buf, GPUIPC_POOL_LEGACY, NULL, &d));
  memcpy(handle, d.handle, 64);
  if (offset)
    *offset = (size_t)d.offset;
  if (size)
    *size = (size_t)d.size;
  if (device)
    memcpy(device->bytes, d.device, 16);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_buffer_export_mempool_raw(gpuipc_buffer *buf,
                                               int *pool_fd,
                                               uint8_t export_data[64],
                                               size_t *offset, size_t *size,
                                               gpuipc_uuid *device) {
  if (export_data == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_buffer_export_mempool_raw: NULL export data");
  if (pool_fd)
    *pool_fd = -1;
  gpuipc__desc d;
  GPUIPC__CHECK(export_fields(buf, GPUIPC_POOL_MEMPOOL, pool_fd, &d));
  memcpy(export_data, d.handle, 64);
  if (offset)
    *offset = (size_t)d.offset;
  if (size)
    *size = (size_t)d.size;
  if (device)
    memcpy(device->bytes, d.device, 16);
  return GPUIPC_OK;
}

/* ---- events ------------------------------------------------------------------ */

gpuipc_status gpuipc_event_import_raw(const uint8_t handle[64],
                                      const gpuipc_uuid *device,
                                      gpuipc_event **ev) {
  if (handle == NULL || ev == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_event_import_raw: NULL handle or out");
  *ev = NULL;
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid home_uuid;
  int home = -1, map = -1;
  GPUIPC__CHECK(resolve_devices(device, NULL, &home_uuid, &home, &map));
  gpuipc__desc d;
  memset(&d, 0, sizeof d);
  d.version = GPUIPC__DESC_VERSION;
  d.type = GPUIPC_DESC_EVENT;
  d.kind = GPUIPC__KIND_IPC_EVENT;
  d.handle_len = 64;
  d.exporter_fd = -1;
  memcpy(d.device, home_uuid.bytes, 16);
  GPUIPC__CHECK(raw_identity(&d.exporter));
  memcpy(d.handle, handle, 64);
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len = 0;
  GPUIPC__CHECK(gpuipc__desc_encode(&d, desc, sizeof desc, &len));
  return gpuipc_event_import(desc, len, NULL, ev);
}

gpuipc_status gpuipc_event_export_raw(gpuipc_event *ev, uint8_t handle[64],
                                      gpuipc_uuid *device) {
  if (ev == NULL || handle == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_event_export_raw: NULL event or handle");
  if (ev->imported)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_event_export_raw: the event was imported: "
                        "pass its raw handle on instead");
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len = 0;
  GPUIPC__CHECK(gpuipc_event_export(ev, desc, sizeof desc, &len));
  gpuipc__desc d;
  GPUIPC__CHECK(gpuipc__desc_decode(desc, len, &d));
  memcpy(handle, d.handle, 64);
  if (device)
    memcpy(device->bytes, d.device, 16);
  return GPUIPC_OK;
}
