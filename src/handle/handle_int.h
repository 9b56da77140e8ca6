/*
 * handle_int.h: the handle layer's own internals, for the files of
 * src/handle/ only: the buffer, pool and event objects, the table of
 * operations each buffer kind implements (one file per kind), the helpers
 * the kinds share (kind.c, import.c), the end every import shares
 * (buffer.c), the import cache, and the liveness tables.
 */
#ifndef GPUIPC_HANDLE_INT_H
#define GPUIPC_HANDLE_INT_H

#include "handle.h"

#include <pthread.h>
#include <stdatomic.h>

/* ---- objects --------------------------------------------------------------- */

struct gpuipc__pool_import; /* cache.c: one imported exporter pool */
struct gpuipc__mapping;     /* cache.c: one imported mapping */
struct gpuipc__kind_ops;    /* below: what differs between the kinds */

/* The most devices a pool can be made accessible to. */
#define GPUIPC__MAX_ACCESS 16

struct gpuipc_pool {
  gpuipc_pool_kind kind;
  const struct gpuipc__kind_ops *ops; /* the kind's operations */
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
  const struct gpuipc__kind_ops *ops; /* the kind's operations */
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
  bool recorded;        /* fd recorded as an export (liveness table) */
  uint8_t handle[64];   /* CUipcMemHandle or CUmemPoolPtrExportData */
  CUmemGenericAllocationHandle vmm;
  int fd;               /* VMM / PINNED_HOST: shareable fd; -1 */
  void *host;           /* PINNED_HOST: the host mapping */
  struct gpuipc__mapping *map; /* IMPORTED: the cache entry */
  gpuipc__identity exporter;   /* IMPORTED: who exported it */
  /* Keep until released: one reference of the caller's until
   * gpuipc_buffer_release_when_done, plus one per lease a connection of
   * this process holds on it; the last closes it and calls done. */
  atomic_uint refs;
  atomic_bool handed;
  void (*done)(void *ctx);
  void *done_ctx;
  struct CUstream_st *done_stream;
  struct gpuipc_buffer *next_done; /* buffer.c: this thread's finished */
};

struct gpuipc_event {
  CUevent ev;
  int ordinal;
  gpuipc_uuid uuid;
  bool imported;
  uint8_t handle[64];
};

/* ---- buffer kinds (legacy.c, mempool.c, vmm.c, pinned.c) --------------------
 *
 * What differs between the pool kinds sits behind one table of operations
 * per kind, as curl's connection filters and NCCL's transports do: buffer.c,
 * pool.c and the import cache call through the table and never ask which
 * kind they hold. Unless an entry says otherwise, it is called with the
 * context of the device it acts on current (the pool's or buffer's device;
 * for open and close the device of the mapping) and reports its failures
 * through gpuipc__fail*. */

/* The result of opening a descriptor: filled by the kind's open. */
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

/* Internal import flag beside the public GPUIPC_IMPORT_*: the descriptor
 * was made from raw handle bytes (interop.c), which name no exporter
 * allocation, so an existing mapping at the address the driver hands back
 * cannot be told apart from the one asked for and is taken as it is. */
#define GPUIPC__IMPORT_RAW 0x80000000u

typedef struct gpuipc__kind_ops {
  gpuipc_pool_kind kind;
  /* How the kind's allocations are named. True (LEGACY, MEMPOOL): by the
   * handle bytes and the driver's buffer id; the driver maps one handle
   * once per process however often it is opened, so the import cache keys
   * these mappings by handle bytes and shares them even under
   * GPUIPC_IMPORT_NO_CACHE, and a wrapped allocation keeps generation 0
   * (every view of it is one mapping). False (VMM, PINNED_HOST): by the
   * allocation's own fd and gpuipc's generation. */
  bool named_by_handle;
  /* The driver enforces a pool's capacity itself (MEMPOOL: maxSize); for
   * the other kinds gpuipc counts the bytes in use. */
  bool driver_capacity;
  /* Allocation and free are ordered on a stream (MEMPOOL). */
  bool stream_ordered;
  /* Host memory (PINNED_HOST): registered with the driver in the context of
   * any device, not bound to the exporter's device. */
  bool host_memory;

  /* Pools. Called without a context current. create sets up what the
   * kind needs before the first allocation; destroy (NULL: nothing to
   * undo) releases it; export (NULL: the kind has no pool-level export)
   * fills the pool descriptor's kind-specific fields and gives the fd that
   * travels with it (borrowed). */
  gpuipc_status (*pool_create)(gpuipc_pool *p,
                               const gpuipc_pool_options *opts);
  gpuipc_status (*pool_destroy)(gpuipc_pool *p);
  gpuipc_status (*pool_export)(gpuipc_pool *p, gpuipc__desc *d,
                               int *fd /* OUT, borrowed */);

  /* Buffers. alloc makes b's memory (ptr, base, offset, alloc_size and the
   * kind's own fields) of size bytes from p, ordered on stream where the
   * kind is stream-ordered; free releases it. wrap fills b (kind, base,
   * alloc_size, buffer id and the kind's own fields) for foreign memory at
   * ptr, and unwrap (NULL: nothing held) drops what wrap took. */
  gpuipc_status (*alloc)(gpuipc_pool *p, gpuipc_buffer *b, size_t size,
                         CUstream stream);
  gpuipc_status (*free)(gpuipc_buffer *b, CUstream stream);
  gpuipc_status (*wrap)(gpuipc_buffer *b, CUdeviceptr ptr, int ordinal);
  gpuipc_status (*unwrap)(gpuipc_buffer *b);

  /* Export. make_handle (NULL: none needed) makes the buffer's shareable
   * handle, once, with b->lock held; describe fills the descriptor's
   * kind-specific fields (handle bytes, pool id, exporter fd) and names the
   * fd that travels with it (borrowed; -1: none). describe needs no
   * context. */
  gpuipc_status (*make_handle)(gpuipc_buffer *b);
  void (*describe)(const gpuipc_buffer *b, gpuipc__desc *d,
                   int *fd /* OUT, borrowed */);

  /* Import (called by the cache, without its lock). open maps what a
   * decoded descriptor names on map_ordinal (fds: what travelled with it;
   * flags: GPUIPC_IMPORT_* and GPUIPC__IMPORT_RAW); close undoes an open;
   * forget (NULL: nothing held) drops what an opened mapping holds without
   * unmapping it (the driver's one mapping is shared, or no context can be
   * made current). */
  gpuipc_status (*open)(const gpuipc__desc *d, int map_ordinal,
                        const int *fds, int nfds, unsigned flags,
                        gpuipc__opened *o);
  gpuipc_status (*close)(int map_ordinal, gpuipc__opened *o);
  void (*forget)(gpuipc__opened *o);
} gpuipc__kind_ops;

extern const gpuipc__kind_ops gpuipc__legacy_ops;  /* legacy.c */
extern const gpuipc__kind_ops gpuipc__mempool_ops; /* mempool.c */
extern const gpuipc__kind_ops gpuipc__vmm_ops;     /* vmm.c */
extern const gpuipc__kind_ops gpuipc__pinned_ops;  /* pinned.c */

/* The table of a kind (1..4); NULL for any other value. */
const gpuipc__kind_ops *gpuipc__kind_ops_get(unsigned kind);

static inline size_t gpuipc__round_up(size_t n, size_t g) {
  return (n + g - 1) / g * g;
}

/* ---- helpers the kinds share (kind.c; import.c for the two steps that
 * need the import cache or the liveness table) ----------------------------- */

/* Checks a descriptor's offset + size against the real range of the mapping
 * at base (cuMemGetAddressRange): E_OUT_OF_RANGE when they go beyond it.
 * On success *mapped is the mapping's size from base. */
gpuipc_status gpuipc__import_check_range(const gpuipc__desc *d,
                                        CUdeviceptr base, size_t *mapped);
/* The driver hands back an existing import when this process still holds
 * a mapping at the address it opens (a legacy handle, or a pool pointer, of
 * a new allocation at a freed one's address): refuses it (E_STALE) unless
 * that mapping is of the very allocation the descriptor names, or flags has
 * GPUIPC__IMPORT_RAW. *existing tells whether the address was held. */
gpuipc_status gpuipc__import_check_shadow(const gpuipc__desc *d,
                                          int map_ordinal, CUdeviceptr base,
                                          unsigned flags, bool *existing);
/* The fd for an fd-carrying kind: the caller's, or one fetched by pidfd
 * (then *fetched is that fd, for the caller to close; else -1). */
gpuipc_status gpuipc__import_fd(const gpuipc__desc *d, const int *fds,
                                int nfds, unsigned flags, int *fd,
                                int *fetched);
/* The mapping's own buffer id here (0 when the driver has none). */
uint64_t gpuipc__local_buffer_id(CUdeviceptr base);
/* Checks, before it is mapped, that an fd is what a descriptor says it is.
 * Host memory (PINNED_HOST): a memfd sealed against shrinking (gpuipc's
 * own carry F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), so that nobody can
 * cut the mapping short (SIGBUS), holding at least size bytes. A driver's
 * shareable handle (VMM allocation, memory pool; `what` names it): as far
 * as the kernel can tell, not a directory, pipe, socket or block device,
 * not a file of a file system, and not host memory sealed against
 * resizing; a device file, an anonymous inode or an unsealed memfd (the
 * emulator's) passes, and the driver's import judges the rest. E_BAD_KIND
 * otherwise (E_OUT_OF_RANGE for a short memfd). */
gpuipc_status gpuipc__import_check_host_fd(int fd, size_t size);
gpuipc_status gpuipc__import_check_driver_fd(int fd, const char *what);

/* ---- the import cache (cache.c) ------------------------------------------------ */

/* Looks the descriptor up in the cache; on a valid hit takes a reference,
 * else (miss, or a stale entry which is retired) opens it with ops->open
 * (in the context of map_ordinal), exactly once even when many threads ask
 * at once. The entry keeps ops and closes with ops->close. *map receives
 * the entry (one reference). */
gpuipc_status gpuipc__cache_acquire(const gpuipc__desc *d, int map_ordinal,
                                    const int *fds, int nfds, unsigned flags,
                                    const gpuipc__kind_ops *ops,
                                    struct gpuipc__mapping **map);
/* Tells whose mapping sits at base on that device, among the live cached
 * mappings of this kind: 0 none, 1 a mapping of the same exporter
 * allocation (same exporter buffer id and generation), 2 a mapping of
 * another allocation (the driver handed back an earlier import, of memory
 * the exporter freed, at that address). */
int gpuipc__cache_base_owner(uint8_t kind, int map_ordinal, CUdeviceptr base,
                             const gpuipc__desc *d);
/* Drops one reference; the last one unmaps. */
gpuipc_status gpuipc__cache_release(struct gpuipc__mapping *map);
/* The mapping's base address and mapped size; host address for PINNED_HOST. */
CUdeviceptr gpuipc__mapping_base(const struct gpuipc__mapping *m);
size_t gpuipc__mapping_size(const struct gpuipc__mapping *m);
void *gpuipc__mapping_host(const struct gpuipc__mapping *m);

/* Imported exporter pools, cached per (exporter, pool id) while their
 * exporter lives; one whose exporter is gone is destroyed when its last
 * reference goes (or, if that came first, at the next pool import), which
 * the driver allows once no pointer imported from it is live. Raw imports
 * (flags with GPUIPC__IMPORT_RAW) are kept for the life of the process. Returns the
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

/* Counters of driver opens and closes (cache.c). */
void gpuipc__cache_count_open(void);
void gpuipc__cache_count_close(void);

/* ---- buffers (buffer.c) --------------------------------------------------- */

/* The end every import shares (gpuipc_buffer_import, and interop.c's raw
 * imports of a descriptor they made up): d's mapping through the import
 * cache (opened with ops, in the context of device map, with flags), its
 * range checked against the mapping (a cache hit may come from a
 * descriptor with another offset and size), as an imported buffer of
 * device home, closed by gpuipc_buffer_close. */
gpuipc_status gpuipc__buffer_open(const gpuipc__desc *d,
                                  const gpuipc__kind_ops *ops, int home,
                                  int map, const int *fds, int nfds,
                                  unsigned flags, gpuipc_buffer **out);

/* ---- pools (pool.c; the id counter in kind.c) ----------------------------- */

/* A new exporter-local id for a pool (a process-wide counter, never 0). */
uint64_t gpuipc__next_pool_id(void);

/* ---- the liveness table (live.c) ---------------------------------------------- */

/* A new generation for an allocation (a process-wide counter, never 0),
 * marked live in this process's liveness table (live.c explains it). */
uint64_t gpuipc__next_generation(void);

/* Marks generation g freed in this process's table (0: no-op). Call when
 * the allocation (or wrapper) that got g is freed. */
void gpuipc__generation_freed(uint64_t g);

typedef enum gpuipc__live_state {
  GPUIPC__LIVE_UNKNOWN = 0, /* no table, another uid, slot reused */
  GPUIPC__LIVE_YES = 1,
  GPUIPC__LIVE_FREED = 2
} gpuipc__live_state;

/* True when the process an identity names is certainly gone (its pid is
 * free, or names a process with another start time). For an identity of
 * another pid namespace, whose pid means nothing here: what the pidfd the
 * connection layer registered for it says (gpuipc__live_watch_identity);
 * without one, true (nothing can tell it lives: nothing is kept for it). */
bool gpuipc__exporter_gone(const gpuipc__identity *exporter);

/* What the table of the descriptor's exporter says of its generation:
 * the table its connection passed (via, when the descriptor's exporter is
 * that connection's peer and names that table's key), else the table found
 * by name in /dev/shm (mapped read-only on first use; logs at info once
 * when it cannot). */
gpuipc__live_state gpuipc__generation_state(const gpuipc__desc *d,
                                            const gpuipc__via *via);

/* This process's table's key (made with the table on first use; 0 when
 * it has none): every buffer and pool descriptor carries it. */
uint64_t gpuipc__live_key(void);

/* Records in this process's table that fd is an export of kind with tag
 * (VMM and pinned host buffers: their generation; memory pools: their pool
 * id), with the file's device and inode; clear it before closing the fd. */
void gpuipc__live_export_add(int fd, unsigned kind, uint64_t tag);
void gpuipc__live_export_clear(int fd);

/* The pidfd route: fetches fd number d->exporter_fd of the exporter and
 * proves it is the export the descriptor names: the exporter's table
 * records an export of d->kind with tag at that fd number, of the very file
 * fetched (device and inode). GPUIPC_E_PERMISSION otherwise (a forged
 * descriptor naming a bystander, a process that exported nothing). */
gpuipc_status gpuipc__live_fetch_fd(const gpuipc__desc *d, uint64_t tag,
                                    int *out);

#endif /* GPUIPC_HANDLE_INT_H */
