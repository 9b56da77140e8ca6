/*
 * pool.c: owns the pool object: options, devices and access lists,
 * choosing a kind for auto, the table of kind operations (each kind's own
 * steps are in its file), destroying, exporting and importing a pool. The
 * process-wide counter behind pool ids is kind.c's (gpuipc__next_pool_id),
 * below the kinds: mempool.c numbers the foreign pools of memory it wraps
 * from it too.
 */
#include "handle_int.h"
#include "core/stats.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>



static const gpuipc__kind_ops *const kinds[] = {
    [GPUIPC_POOL_MEMPOOL] = &gpuipc__mempool_ops,
    [GPUIPC_POOL_VMM] = &gpuipc__vmm_ops,
    [GPUIPC_POOL_LEGACY] = &gpuipc__legacy_ops,
    [GPUIPC_POOL_PINNED_HOST] = &gpuipc__pinned_ops,
};

const gpuipc__kind_ops *gpuipc__kind_ops_get(unsigned kind) {
  return kind < GPUIPC__ARRAY_SIZE(kinds) ? kinds[kind] : NULL;
}


/* ---- create / destroy ------------------------------------------------------------- */

static gpuipc_status dev_attr(CUdevice dev, CUdevice_attribute a, int *v) {
  *v = 0;
  CUresult r = GPUIPC__CU(cuDeviceGetAttribute, v, a, dev);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuDeviceGetAttribute", "attribute %d",
                             (int)a);
  return GPUIPC_OK;
}

static gpuipc_status pick_kind(CUdevice dev, int ordinal,
                               gpuipc_pool_kind *kind) {
  int pools = 0, types = 0, vmm = 0, fd = 0;
  GPUIPC__CHECK(dev_attr(dev, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, &pools));
  GPUIPC__CHECK(dev_attr(dev, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
                         &types));
  if (pools && (types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    GPUIPC__INFO("handle", "pool kind auto on device %d: mempool", ordinal);
    *kind = GPUIPC_POOL_MEMPOOL;
    return GPUIPC_OK;
  }
  GPUIPC__CHECK(dev_attr(dev, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                         &vmm));
  GPUIPC__CHECK(dev_attr(
      dev, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, &fd));
  if (vmm && fd) {
    GPUIPC__INFO("handle",
                 "pool kind auto on device %d: vmm (no IPC-capable memory "
                 "pools)",
                 ordinal);
    *kind = GPUIPC_POOL_VMM;
    return GPUIPC_OK;
  }
  GPUIPC__INFO("handle",
               "pool kind auto on device %d: legacy (neither IPC memory pools "
               "nor VMM fd export)",
               ordinal);
  *kind = GPUIPC_POOL_LEGACY;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_pool_create(const gpuipc_pool_options *opts_in,
                                 gpuipc_pool **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_create: pool NULL");
  *out = NULL;
  gpuipc_pool_options opts = GPUIPC_POOL_OPTIONS_INIT;
  GPUIPC__CHECK(gpuipc__options_copy(&opts, sizeof opts, opts_in, 0,
                                     "gpuipc_pool_options",
                                     "GPUIPC_POOL_OPTIONS_INIT"));
  if ((unsigned)opts.kind > GPUIPC_POOL_PINNED_HOST)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "gpuipc_pool_create: kind %d",
                        (int)opts.kind);
  if (opts.n_access_devices < 0 || opts.n_access_devices > GPUIPC__MAX_ACCESS ||
      (opts.n_access_devices > 0 && opts.access_devices == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_pool_create: %d access devices (at most %d)",
                        opts.n_access_devices, GPUIPC__MAX_ACCESS);
  GPUIPC__CHECK(gpuipc__driver());

  gpuipc_pool *p = calloc(1, sizeof *p);
  if (p == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool");
  p->export_fd = -1;
  pthread_mutex_init(&p->lock, NULL);
  gpuipc_status s = gpuipc__resolve_device(opts.device, 0,
                                           &p->ordinal);
  if (s != GPUIPC_OK)
    goto fail;
  CUresult r = GPUIPC__CU(cuDeviceGet, &p->cudev, p->ordinal);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuDeviceGet", "ordinal %d", p->ordinal);
    goto fail;
  }
  GPUIPC__CHECK_GOTO(gpuipc_device_uuid(p->ordinal, &p->uuid), s, fail);
  for (int i = 0; i < opts.n_access_devices; i++) {
    int o = -1;
    GPUIPC__CHECK_GOTO(gpuipc_device_from_uuid(&opts.access_devices[i], &o),
                       s, fail);
    if (o == p->ordinal)
      continue;
    CUdevice other;
    int can = 0;
    r = GPUIPC__CU(cuDeviceGet, &other, o);
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuDeviceCanAccessPeer, &can, other, p->cudev);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuDeviceCanAccessPeer", "%d -> %d", o,
                            p->ordinal);
      goto fail;
    }
    if (!can) {
      s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                       "device %d cannot access device %d's memory (no peer "
                       "access between them)",
                       o, p->ordinal);
      goto fail;
    }
    p->access[p->n_access++] = o;
  }
  p->kind = opts.kind;
  if (p->kind == GPUIPC_POOL_AUTO)
    GPUIPC__CHECK_GOTO(pick_kind(p->cudev, p->ordinal, &p->kind), s, fail);
  p->capacity = opts.capacity;
  p->id = gpuipc__next_pool_id();
  GPUIPC__CHECK_GOTO(gpuipc__self_identity(&p->exporter), s, fail);
  p->ops = gpuipc__kind_ops_get(p->kind);
  GPUIPC__CHECK_GOTO(p->ops->pool_create(p, &opts), s, fail);
  GPUIPC__DEBUG("handle", "pool %llu created: %s on device %d",
                (unsigned long long)p->id, gpuipc_pool_kind_name(p->kind),
                p->ordinal);
  gpuipc__stats_add(GPUIPC__ST_POOLS, 1);
  *out = p;
  return GPUIPC_OK;
fail:
  pthread_mutex_destroy(&p->lock);
  free(p);
  return s;
}

gpuipc_status gpuipc_pool_destroy(gpuipc_pool *p) {
  if (p == NULL)
    return GPUIPC_OK;
  if (p->imported) {
    gpuipc__pool_import_release(p->pimp);
    pthread_mutex_destroy(&p->lock);
    free(p);
    return GPUIPC_OK;
  }
  long live = atomic_load(&p->live);
  if (live > 0)
    return gpuipc__fail(GPUIPC_E_BUSY,
                        "gpuipc_pool_destroy: pool %llu still has %ld live "
                        "buffer(s)",
                        (unsigned long long)p->id, live);
  gpuipc_status s = GPUIPC_OK;
  if (p->ops->pool_destroy)
    s = p->ops->pool_destroy(p);
  gpuipc__stats_add(GPUIPC__ST_POOLS, -1);
  pthread_mutex_destroy(&p->lock);
  free(p);
  return s;
}

gpuipc_pool_kind gpuipc_pool_get_kind(const gpuipc_pool *p) {
  return p ? p->kind : GPUIPC_POOL_AUTO;
}

gpuipc_status gpuipc_pool_get_device(const gpuipc_pool *p, gpuipc_uuid *uuid) {
  if (p == NULL || uuid == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_get_device: NULL");
  *uuid = p->uuid;
  return GPUIPC_OK;
}

/* ---- export / import -------------------------------------------------------------- */

gpuipc_status gpuipc_pool_export(gpuipc_pool *p, uint8_t *desc, size_t cap,
                                 size_t *len, int *fd) {
  if (p == NULL || desc == NULL || len == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_export: NULL");
  if (fd)
    *fd = -1;
  if (p->imported)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_pool_export: an imported pool cannot be "
                        "re-exported");
  if (p->ops->pool_export == NULL)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_pool_export: %s pools have no pool-level "
                        "export; export their buffers one by one",
                        gpuipc_pool_kind_name(p->kind));
  gpuipc__desc d;
  memset(&d, 0, sizeof d);
  d.type = GPUIPC_DESC_POOL;
  d.kind = (uint8_t)p->kind;
  memcpy(d.device, p->uuid.bytes, 16);
  d.pool_id = p->id;
  int pool_fd = -1;
  GPUIPC__CHECK(p->ops->pool_export(p, &d, &pool_fd));
  GPUIPC__CHECK(gpuipc__desc_set_exporter(&d));
  d.live_key = gpuipc__live_key(); /* names this process's liveness table */
  int newfd = -1;
  if (fd) {
    newfd = fcntl(pool_fd, F_DUPFD_CLOEXEC, 0);
    if (newfd < 0)
      return gpuipc__fail_errno(errno, "dup", "pool fd");
    d.nfds = 1;
  }
  gpuipc_status s = gpuipc__desc_encode(&d, desc, cap, len);
  if (s != GPUIPC_OK) {
    if (newfd >= 0)
      close(newfd);
    return s;
  }
  if (fd)
    *fd = newfd;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_pool_import(const uint8_t *desc, size_t len, int fd,
                                 const gpuipc_import_options *opts_in,
                                 gpuipc_pool **out) {
  if (desc == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_import: NULL");
  *out = NULL;
  gpuipc_import_options opts;
  gpuipc__desc d;
  GPUIPC__CHECK(gpuipc__desc_open("gpuipc_pool_import", desc, len, opts_in,
                                  GPUIPC_DESC_POOL, "a pool", NULL, &opts, &d));
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid dev;
  memcpy(dev.bytes, d.device, 16);
  int home = -1, map = -1;
  GPUIPC__CHECK(gpuipc_device_from_uuid(&dev, &home));
  map = home;
  if (opts.device)
    GPUIPC__CHECK(gpuipc_device_from_uuid(opts.device, &map));

  gpuipc_pool *p = calloc(1, sizeof *p);
  if (p == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool");
  gpuipc_status s =
      gpuipc__pool_import_acquire(&d, map, fd, opts.flags, &p->pimp);
  if (s != GPUIPC_OK) {
    free(p);
    return s;
  }
  pthread_mutex_init(&p->lock, NULL);
  p->kind = (gpuipc_pool_kind)d.kind;
  p->ops = gpuipc__kind_ops_get(d.kind);
  p->imported = true;
  p->ordinal = home;
  p->uuid = dev;
  p->id = d.pool_id;
  p->exporter = d.exporter;
  p->export_fd = -1;
  p->mp = gpuipc__pool_import_handle(p->pimp);
  *out = p;
  return GPUIPC_OK;
}

int gpuipc__pool_ordinal(const gpuipc_pool *pool) { return pool->ordinal; }
