/*
 * handle.h: the handle layer, as the layers above see it (the connection
 * layer's arenas and per-buffer fast path, the transfer layer's shared
 * pinned host memory): descriptors (the wire format and exporter
 * identity), the liveness tables connections carry, buffer information,
 * chunk allocation, and the references that keep a handed-over buffer
 * until its leases are released. The objects
 * themselves, the import cache and the pools live in handle_int.h, which
 * only this folder's files include.
 *
 * Building an arena (connection layer), the intended sequence:
 *   exporter                                  importer
 *   gpuipc_pool_create(MEMPOOL)               .
 *   gpuipc__pool_chunk_alloc(pool, bytes, &buf) .
 *   gpuipc_pool_export(pool, d1, .., &fd)  -> gpuipc_pool_import(d1, fd, ..)
 *     (once per connection; the fd by SCM_RIGHTS)   (cached per exporter pool)
 *   gpuipc_buffer_export(buf, d2, .., 0 fds) -> gpuipc_buffer_import(d2, ..)
 *     (once)                                   gpuipc__buffer_info_get(buf,
 *                                              &i): i.ptr, i.buffer_id,
 *                                              i.generation
 *   then sub-allocate [off, off+len) of the arena and send only (arena id,
 *   off, len, sequence numbers): no driver call per buffer.
 * gpuipc__buffer_info_get() on the exporter side gives the same buffer id
 * and generation, so both ends can tag their messages with them and refuse
 * a message naming an arena generation they do not hold. VMM and
 * PINNED_HOST arenas work the same without the pool step: the buffer's own
 * fd travels with its descriptor (gpuipc_buffer_export with room for 1 fd).
 * Descriptors can be inspected without the driver (gpuipc_desc_get_info,
 * or gpuipc__desc_decode for every field).
 *
 * Every function here follows the public conventions: returns a status,
 * reports failures through gpuipc__fail*, restores the caller's context.
 */
#ifndef GPUIPC_HANDLE_LAYER_H
#define GPUIPC_HANDLE_LAYER_H

#include "core/core.h"
/* ---- descriptors (descriptor.c) ---------------------------------------------
 * The descriptor wire format (docs/descriptor.md), its
 * decoded form, the exporter identity that every descriptor carries, and
 * CRC32C. Pure byte handling: nothing here touches the driver.
 */


/* "GIPC" in the first four bytes (little-endian 0x43504947). */
#define GPUIPC__DESC_MAGIC 0x43504947u
/* The format version this library writes and reads. */
#define GPUIPC__DESC_VERSION 1u
/* The shortest version 1 descriptor (the fields up to `handle`). */
#define GPUIPC__DESC_V1_LEN 192u
/* The length this library writes: version 1 with `live_key` appended. */
#define GPUIPC__DESC_LEN 200u
/* Bytes of handle data carried (a CUipcMemHandle, CUipcEventHandle or
 * CUmemPoolPtrExportData: 64 bytes each). */
#define GPUIPC__DESC_HANDLE_BYTES 64u

/* Handle kinds on the wire: the pool kinds 1..4 (gpuipc_pool_kind) for
 * buffers and pools, and this one for events. */
#define GPUIPC__KIND_IPC_EVENT 16u

/* Flags byte. */
#define GPUIPC__DESC_F_WRAPPED 0x1u /* a wrapped (foreign) allocation */
#define GPUIPC__DESC_F_ALL 0x1u

/* Who exported: names a process on a machine even across pid reuse. */
typedef struct gpuipc__identity {
  uint8_t boot_id[16];
  uint64_t pidns;      /* inode of the pid namespace */
  int32_t pid;         /* in that namespace */
  uint64_t start_time; /* clock ticks since boot */
} gpuipc__identity;

/* A decoded descriptor. Field meanings: docs/descriptor.md. */
typedef struct gpuipc__desc {
  uint16_t version;
  uint8_t type;  /* gpuipc_desc_type */
  uint8_t kind;  /* gpuipc_pool_kind or GPUIPC__KIND_IPC_EVENT */
  uint32_t length;
  uint8_t nfds;
  uint8_t flags;
  uint16_t handle_len;
  int32_t exporter_fd; /* the fd number in the exporter (pidfd route), -1 */
  uint8_t device[16];
  gpuipc__identity exporter;
  uint64_t pool_id;
  uint64_t buffer_id;
  uint64_t generation;
  uint64_t offset;
  uint64_t size;
  uint64_t alloc_size;
  uint8_t handle[GPUIPC__DESC_HANDLE_BYTES];
  /* Names the exporter's liveness table (random, 0: it has none; in
   * descriptors of GPUIPC__DESC_LEN bytes or more). Shorter ones come from
   * an older library, whose table has the name without it. */
  uint64_t live_key;
} gpuipc__desc;

/* CRC32C (Castagnoli), the checksum of the format. */
uint32_t gpuipc__crc32c(uint32_t crc, const void *data, size_t len);

/* Encodes d (version and length are filled in) into out[0..cap).
 * GPUIPC_E_LIMIT when cap is too small. */
gpuipc_status gpuipc__desc_encode(const gpuipc__desc *d, uint8_t *out,
                                  size_t cap, size_t *len);

/* Decodes and validates the structure: length, magic, version, checksum,
 * type and kind, reserved fields, offset + size <= alloc_size. Does not
 * check origin (gpuipc__desc_open does). Never reads beyond len. */
gpuipc_status gpuipc__desc_decode(const uint8_t *in, size_t len,
                                  gpuipc__desc *d);

/* A connection's peer, for imports of what arrived over that connection
 * (the layer above fills it at the handshake): the peer's identity as its
 * HELLO names it (pid namespace, pid in it, start time; the kernel vouched
 * for the connection, and for the pid where it can see it), and the
 * liveness table the peer passed by fd (NULL: none). A descriptor whose
 * exporter is that peer is checked against that table, and may come from
 * another pid namespace when its kind travels by fd (mempool, VMM, pinned
 * host); legacy handles never may. */
typedef struct gpuipc__live_peer gpuipc__live_peer;
typedef struct gpuipc__via {
  gpuipc__identity peer;
  const gpuipc__live_peer *table;
} gpuipc__via;

/* The common start of gpuipc_buffer_import, gpuipc_pool_import and
 * gpuipc_event_import (`fn`): reads the caller's options into *opts
 * (opts_in may be NULL), decodes the descriptor into *d, and checks that it
 * is of `type` (E_BAD_KIND naming `what`: "a buffer", ...) and comes from
 * another process of this machine and pid namespace, or (via not NULL)
 * from the connection's peer in another pid namespace, of a kind that
 * travels by fd (E_FOREIGN_NAMESPACE with the reason otherwise). */
gpuipc_status gpuipc__desc_open(const char *fn, const uint8_t *desc,
                                size_t len,
                                const gpuipc_import_options *opts_in,
                                unsigned type, const char *what,
                                const gpuipc__via *via,
                                gpuipc_import_options *opts, gpuipc__desc *d);

/* gpuipc_buffer_import for what arrived over a connection (via: its peer;
 * NULL: the same as gpuipc_buffer_import). */
gpuipc_status gpuipc__buffer_import_via(const gpuipc__via *via,
                                        const uint8_t *desc, size_t len,
                                        const int *fds, int nfds,
                                        const gpuipc_import_options *opts_in,
                                        gpuipc_buffer **out);

/* ---- liveness tables that travel with connections (live.c) -----------------
 * The exporter side: a new read-only fd of this process's liveness table
 * (the table is made now if it was not yet), and its key; the caller sends
 * it and closes it. -1 (and the reason through gpuipc__fail) when this
 * process has no table. */
int gpuipc__live_table_fd(uint64_t *key);
/* The importer side: validates an fd a peer passed as its liveness table
 * (a regular file of tmpfs or a memfd, of exactly a table's size, with a
 * table's header) and keeps a dup of it, named by the peer's identity and
 * key. Hostile input: anything else is GPUIPC_E_PROTOCOL with the reason,
 * and the table is only ever read with pread, never mapped, so a peer that
 * truncates it later cannot fault this process. */
gpuipc_status gpuipc__live_peer_open(int fd, const gpuipc__identity *peer,
                                     uint64_t key, gpuipc__live_peer **out);
void gpuipc__live_peer_close(gpuipc__live_peer *t);
/* The size in bytes of a liveness table (what a peer's must have). */
size_t gpuipc__live_table_bytes(void);
/* Remembers a pidfd (duplicated) of a process of another pid namespace,
 * the peer of a connection, so that "is the exporter gone" can be
 * answered for its identity (whose pid means nothing here). */
void gpuipc__live_watch_identity(const gpuipc__identity *id, int pidfd);

/* This process's identity (computed once per process; recomputed after a
 * fork). */
gpuipc_status gpuipc__self_identity(gpuipc__identity *id);
/* Fills d->exporter with this process's identity. */
gpuipc_status gpuipc__desc_set_exporter(gpuipc__desc *d);

/* True when both name the same process. */
bool gpuipc__identity_eq(const gpuipc__identity *a, const gpuipc__identity *b);

/* Fetches fd number remote_fd of the exporter through pidfd_getfd(2),
 * checking that the pid still names the exporter (start time). Returns the
 * new fd (close-on-exec) in *out. Errors: E_PERMISSION (naming the ptrace
 * permission), E_PEER_GONE, E_STALE (the exporter no longer has that fd),
 * E_NOT_SUPPORTED (kernel without pidfd_getfd). */
gpuipc_status gpuipc__pidfd_getfd(const gpuipc__identity *exporter,
                                  int remote_fd, int *out);


/* Where a buffer came from. */
typedef enum gpuipc__origin {
  GPUIPC__ALLOCATED = 1,
  GPUIPC__WRAPPED = 2,
  GPUIPC__IMPORTED = 3
} gpuipc__origin;

/* ---- for the connection and transfer layers ---------------------------------------- */

/* Allocates one buffer meant to be carved up (an arena): the same as
 * gpuipc_buffer_alloc() on the default stream, followed by a stream
 * synchronize for MEMPOOL so the memory is usable from any stream and any
 * process at once. */
gpuipc_status gpuipc__pool_chunk_alloc(gpuipc_pool *pool, size_t size,
                                       gpuipc_buffer **buf);

/* The liveness table (its layout is read by the tests that forge one): slots per process, and the bit a freed slot has. */
#define GPUIPC__LIVE_SLOTS (1u << 18)
#define GPUIPC__LIVE_FREED_BIT (1ull << 63)
/* Export records after the slots (version 2), one per fd number. */
#define GPUIPC__LIVE_EXPORTS (1u << 16)

/* The local ordinal of the device a pool allocates on. */
int gpuipc__pool_ordinal(const gpuipc_pool *pool);

/* Everything the fast path needs to know about a buffer, either side. */
typedef struct gpuipc__buffer_info {
  gpuipc_pool_kind kind;
  gpuipc__origin origin;
  CUdeviceptr ptr;      /* first byte here */
  void *host;           /* PINNED_HOST: host address, else NULL */
  size_t size;
  int ordinal;          /* the memory's device here */
  int map_ordinal;      /* where it is mapped here */
  uint64_t buffer_id;   /* the exporter's buffer id */
  uint64_t generation;  /* the exporter's generation */
  uint64_t pool_id;     /* MEMPOOL: exporter pool id */
  gpuipc__identity exporter; /* who allocated it (this process unless
                                imported) */
  gpuipc_pool *pool;    /* ALLOCATED: the pool it came from; else NULL */
  CUdeviceptr base;     /* the allocation's (mapping's) base here */
  size_t alloc_size;    /* the allocation's mapped size */
  uint64_t vmm;         /* VMM, allocated here: the driver's allocation
                           handle (benchmarks export it raw); else 0 */
  int fd;               /* VMM / PINNED_HOST: the buffer's own shareable
                           fd once made (borrowed); else -1 */
} gpuipc__buffer_info;

gpuipc_status gpuipc__buffer_info_get(const gpuipc_buffer *buf,
                                      gpuipc__buffer_info *info);

/* Keep until released (gpuipc_buffer_release_when_done): a connection
 * takes a reference per lease it holds on a buffer (lease_begin, at the
 * send) and drops it when the lease ends (released, abandoned, or the
 * peer gone); the last reference of a handed-over buffer closes it and
 * calls its done callback, in the thread that dropped it, with no lock of
 * the caller's held (see gpuipc__buffer_done_flush). handed: whether it
 * was handed over (and the stream the owner reuses the memory on), for the
 * holder of a reference. */
void gpuipc__buffer_lease_begin(gpuipc_buffer *buf);
void gpuipc__buffer_lease_end(gpuipc_buffer *buf);
/* Closes the buffers whose last reference this thread dropped, and calls
 * their done callbacks (no lock held, no context of the library's
 * current): every caller of lease_end calls it before it returns. */
void gpuipc__buffer_done_flush(void);
bool gpuipc__buffer_handed(const gpuipc_buffer *buf,
                           struct CUstream_st **stream);

/* The driver's buffer id of the allocation holding ptr (0 when the driver
 * has none for it). Makes no context current: the pointer's own context is
 * implied by unified addressing. */
gpuipc_status gpuipc__pointer_buffer_id(CUdeviceptr ptr, uint64_t *id);

/* How many imported exporter pools this process holds (releasing first
 * those that can go: their exporter is gone and nothing imported here
 * holds them). For tests and diagnostics. */
size_t gpuipc__cache_pools_held(void);

/* ---- the import cache's linger (cache.c), for tests --------------------------- */

/* Linger settings (ms and count; 0 turns it off), as the environment
 * variables GPUIPC_IMPORT_LINGER_MS and _MAX set them; applied at once (what
 * the new settings let go is closed). For tests. */
void gpuipc__cache_linger_set(long ms, long max);
/* Moves the cache's clock forward by ms and closes what is then due (and
 * what the exporter's liveness table or death lets go), waiting for closes
 * in flight: tests of the linger, without sleeping. Returns the number
 * closed by this call. */
size_t gpuipc__cache_test_advance(uint64_t ms);

#endif /* GPUIPC_HANDLE_LAYER_H */
