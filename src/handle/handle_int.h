/*
 * handle_int.h: the handle layer's own internals, for the files of
 * src/handle/ only: the buffer, pool and event objects, the import cache,
 * the pools' identity and liveness tables.
 */
#ifndef GPUIPC_HANDLE_INT_H
#define GPUIPC_HANDLE_INT_H

#include "handle.h"

#include <pthread.h>
#include <stdatomic.h>

/* ---- objects --------------------------------------------------------------- */

struct gpuipc__pool_import; /* cache.c: one imported exporter pool */
struct gpuipc__mapping;     /* cache.c: one imported mapping */

/* The most devices a pool can be made accessible to. */
#define GPUIPC__MAX_ACCESS 16

struct gpuipc_pool {
  gpuipc_pool_kind kind;
  int ordinal;      /* local device */
  CUdevice cudev;
  gpuipc_uuid uuid;
  bool imported;
  uint64_t id;      /* exporter-local pool id (descriptors carry it) */
  gpuipc__identity exporter; /* this process, or the exporter if imported */
  size_t capacity;  /* 0: none */
  atomic_size_t in_use;
  atomic_long live; /* live buffers */
  int access[GPUIPC__MAX_ACCESS]; /* ordinals besides `ordinal` */
  int n_access;
  /* MEMPOOL */
  CUmemoryPool mp;
  int export_fd;    /* the pool's shareable handle, made once; -1 */
  pthread_mutex_t lock;
  /* VMM */
  size_t granularity;
  /* imported pools */
  struct gpuipc__pool_import *pimp;
};

struct gpuipc_buffer {
  gpuipc__origin origin;
  gpuipc_pool_kind kind;
  int ordinal;          /* the memory's device, local ordinal */
  int map_ordinal;      /* the device it is mapped on here */
  gpuipc_uuid uuid;     /* the memory's device */
  CUdeviceptr ptr;      /* first byte of the buffer here */
  CUdeviceptr base;     /* the allocation's (mapping's) base here */
  size_t size;          /* the buffer's bytes */
  size_t offset;        /* ptr - base */
  size_t alloc_size;    /* the allocation's mapped size */
  uint64_t buffer_id;   /* CU_POINTER_ATTRIBUTE_BUFFER_ID at the exporter
                           (identity only: importers never see it on their
                           mapping) */
  uint64_t generation;  /* exporter-local, per allocation (liveness table) */
  gpuipc_pool *pool;    /* ALLOCATED: its pool */
  uint64_t pool_id;     /* MEMPOOL: the exporter pool's id */
  int pool_fd;          /* MEMPOOL wrapped: the foreign pool's fd (borrowed) */
  /* Export state, made on first export (lock). */
  pthread_mutex_t lock;
  bool have_handle;
  uint8_t handle[64];   /* CUipcMemHandle or CUmemPoolPtrExportData */
  CUmemGenericAllocationHandle vmm;
  int fd;               /* VMM / PINNED_HOST: shareable fd; -1 */
  void *host;           /* PINNED_HOST: the host mapping */
  struct gpuipc__mapping *map; /* IMPORTED: the cache entry */
  gpuipc__identity exporter;   /* IMPORTED: who exported it */
};

struct gpuipc_event {
  CUevent ev;
  int ordinal;
  gpuipc_uuid uuid;
  bool imported;
  uint8_t handle[64];
};

/* ---- the import cache (cache.c) ------------------------------------------------ */

/* What identifies one mapping: the exporter, the handle kind, the local
 * device it is mapped on, and the allocation (handle bytes for LEGACY and
 * MEMPOOL, which the driver maps once however often it is opened; the
 * generation for VMM and PINNED_HOST, whose fds are per allocation). */
typedef struct gpuipc__map_key {
  gpuipc__identity exporter;
  uint8_t kind;
  int map_ordinal;
  uint64_t pool_id;
  uint8_t bytes[64];
} gpuipc__map_key;

/* Builds the key of a decoded buffer descriptor mapped on map_ordinal. */
void gpuipc__map_key_of(const gpuipc__desc *d, int map_ordinal,
                        gpuipc__map_key *k);

/* The result of opening: filled by the opener (buffer.c). */
typedef struct gpuipc__opened {
  CUdeviceptr base;
  size_t mapped_size;
  void *host;                          /* PINNED_HOST */
  struct gpuipc__pool_import *pimp;    /* MEMPOOL: holds a reference */
  /* The driver's buffer id of the mapping HERE (importer-local on driver
   * 580, unrelated to the descriptor's), 0 if none: a cache hit re-reads
   * it to catch a mapping replaced under the cache. */
  uint64_t local_id;
} gpuipc__opened;

/* Opens the memory a descriptor names (buffer.c); called by the cache
 * without its lock held. */
typedef gpuipc_status (*gpuipc__open_fn)(const gpuipc__desc *d,
                                         int map_ordinal, const int *fds,
                                         int nfds, unsigned flags,
                                         gpuipc__opened *out);
/* Undoes an open (buffer.c); reports the driver's failure. */
gpuipc_status gpuipc__close_opened(uint8_t kind, int map_ordinal, gpuipc__opened *o);
/* Checks a descriptor's offset + size against the real range of the mapping
 * at base (cuMemGetAddressRange): E_OUT_OF_RANGE when they go beyond it.
 * On success *mapped is the mapping's size from base. */
gpuipc_status gpuipc__import_check_range(const gpuipc__desc *d,
                                        CUdeviceptr base, size_t *mapped);

/* Looks the descriptor up in the cache; on a valid hit takes a reference,
 * else (miss, or a stale entry which is retired) opens it with `open`,
 * exactly once even when many threads ask at once. *map receives the entry
 * (one reference). */
gpuipc_status gpuipc__cache_acquire(const gpuipc__desc *d, int map_ordinal,
                                    const int *fds, int nfds, unsigned flags,
                                    gpuipc__open_fn open,
                                    struct gpuipc__mapping **map);
/* True when a live cached mapping of this kind sits at base on that device
 * (the driver hands back an existing import instead of a new one). */
bool gpuipc__cache_base_held(uint8_t kind, int map_ordinal, CUdeviceptr base);
/* Like gpuipc__cache_base_held, telling whose mapping it is: 0 none, 1 a
 * mapping of the same exporter allocation (same exporter buffer id and
 * generation), 2 a mapping of another allocation (the driver handed back
 * an earlier import, of memory the exporter freed, at that address). */
int gpuipc__cache_base_owner(uint8_t kind, int map_ordinal, CUdeviceptr base,
                             const gpuipc__desc *d);
/* Drops one reference; the last one unmaps. */
gpuipc_status gpuipc__cache_release(struct gpuipc__mapping *map);
/* The mapping's base address and mapped size; host address for PINNED_HOST. */
CUdeviceptr gpuipc__mapping_base(const struct gpuipc__mapping *m);
size_t gpuipc__mapping_size(const struct gpuipc__mapping *m);
void *gpuipc__mapping_host(const struct gpuipc__mapping *m);

/* Imported exporter pools, cached per (exporter, pool id) for the life of
 * the process (the driver cannot destroy an imported pool). Returns the
 * pool with access granted to map_ordinal (cuMemPoolSetAccess once per
 * (pool, device)). fd may be -1 when the pool is cached already, or when
 * flags has GPUIPC_IMPORT_PIDFD_GETFD. Holds one reference until
 * gpuipc__pool_import_release. */
gpuipc_status gpuipc__pool_import_acquire(const gpuipc__desc *d,
                                          int map_ordinal, int fd,
                                          unsigned flags,
                                          struct gpuipc__pool_import **out);
void gpuipc__pool_import_release(struct gpuipc__pool_import *p);
CUmemoryPool gpuipc__pool_import_handle(const struct gpuipc__pool_import *p);

/* Counters (cache.c). */
void gpuipc__cache_count_open(void);
void gpuipc__cache_count_close(void);

/* ---- pools (pool.c) --------------------------------------------------------------- */

/* A new exporter-local id for a pool, and a new generation for an
 * allocation (both process-wide counters, never 0). A new generation is
 * marked live in this process's liveness table (pool.c explains it). */
uint64_t gpuipc__next_pool_id(void);
uint64_t gpuipc__next_generation(void);


/* Marks generation g freed in this process's table (0: no-op). Call when
 * the allocation (or wrapper) that got g is freed. */
void gpuipc__generation_freed(uint64_t g);

typedef enum gpuipc__live_state {
  GPUIPC__LIVE_UNKNOWN = 0, /* no table, another uid, slot reused */
  GPUIPC__LIVE_YES = 1,
  GPUIPC__LIVE_FREED = 2
} gpuipc__live_state;

/* What the exporter's table says of generation g (maps the exporter's table
 * read-only on first use; logs at info once when it cannot). */
gpuipc__live_state gpuipc__generation_state(const gpuipc__identity *exporter,
                                            uint64_t g);

/* The pool's shareable fd, made once and owned by the pool (-1 for kinds
 * without one). Borrowed: dup() it to send it. MEMPOOL only. */
gpuipc_status gpuipc__pool_fd(gpuipc_pool *pool, int *fd /* OUT, borrowed */);

/* Finds (or, for a foreign IPC-capable pool, registers for good) the
 * exporter-side identity of a driver pool, so wrapped pool memory can be
 * exported: its pool id and fd (borrowed). */
gpuipc_status gpuipc__pool_lookup_foreign(CUmemoryPool mp, int ordinal,
                                          uint64_t *id, int *fd);

/* The local ordinal of a visible device (UUIDs read once per process);
 * GPUIPC_E_DEVICE_NOT_VISIBLE otherwise. */
gpuipc_status gpuipc__device_ordinal(const gpuipc_uuid *uuid, int *ordinal);

/* Resolves pool options' device to a local ordinal. */
gpuipc_status gpuipc__resolve_device(const gpuipc_uuid *uuid, int ordinal,
                                     int *out);

#endif /* GPUIPC_HANDLE_INT_H */
