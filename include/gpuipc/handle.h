/*
 * gpuipc/handle.h: the handle layer: pools, buffers, interprocess events,
 * descriptors and the import cache. Included by gpuipc.h; do not include it
 * directly.
 *
 * The model
 * - A *pool* lives on one device and hands out *buffers*. Its kind decides
 *   how buffers travel between processes (see gpuipc_pool_kind).
 * - A buffer can also *wrap* memory gpuipc did not allocate (a cuMemAlloc
 *   allocation, an allocation of a caching allocator, an interior pointer):
 *   gpuipc finds the allocation's base and range and shares it with the right
 *   offset.
 * - *Exporting* a buffer, pool or event produces a *descriptor*: a small byte
 *   string (at most GPUIPC_DESC_MAX bytes) that can travel over any channel
 *   (a socket, MPI, a pipe, a file), plus, for some kinds, file descriptors
 *   that must travel beside it (SCM_RIGHTS, see gpuipc_desc_send()), or that
 *   the importer may fetch itself with pidfd_getfd (opt-in, see
 *   GPUIPC_IMPORT_PIDFD_GETFD).
 * - *Importing* a descriptor in another process opens the same memory there.
 *   Descriptors are hostile input: every field is validated, and each kind
 *   of failure has its own status (see gpuipc_buffer_import()).
 * - Imports go through a per-process *import cache*: importing the same
 *   buffer twice returns the same mapping with a reference count. Cache
 *   entries are keyed by the exporter's identity of the allocation (its
 *   buffer id and gpuipc's per-allocation generation, both read at the
 *   exporter), so memory the exporter freed and reallocated at the same
 *   address is never mistaken for the old buffer.
 * - Stale descriptors. The CUDA driver maps freed memory without complaint,
 *   and it never shows an importer the exporter's buffer id (driver 580:
 *   legacy and pool imports get importer-local ids), so gpuipc asks the
 *   exporter instead: every process that allocates keeps a *liveness table*
 *   of generation words in shared memory (a file in /dev/shm named after
 *   its uid, pid namespace, pid, start time and a random key that every
 *   descriptor carries, so that nobody can claim the name first; mode
 *   0600), marked when a buffer is freed.
 *   Every import (cache hits included) reads the exporter's table first and
 *   refuses a freed buffer with GPUIPC_E_STALE. Limits: the table is
 *   readable only by the same uid, and within one /dev/shm; an importer
 *   that cannot read it (another uid, another mount namespace, an exporter
 *   of an older gpuipc, an exporter that exited) imports without this check
 *   and logs that (once) at level info; then only the driver's
 *   own refusals remain (a legacy handle of freed memory fails to open; VMM
 *   and pinned host fds keep the memory alive, so those imports are of real,
 *   though abandoned, memory). Wrapped legacy and mempool memory (generation
 *   0) is never checked: it belongs to the caller. Freeing a buffer while an
 *   importer already uses it is not detected by this (see
 *   gpuipc_buffer_free()); a cache hit additionally re-checks that its
 *   mapping is still the one opened (the mapping's own buffer id here).
 *
 * Devices are named by UUID across processes; an importer may map a buffer
 * on a different local device than the exporter's (peer access). gpuipc
 * works in each device's primary context and restores whatever context the
 * calling thread had current.
 *
 * Security. File descriptors are capabilities: as private as the channel
 * that carries them. LEGACY descriptors are BEARER TOKENS: the 64-byte
 * legacy CUDA IPC handle inside lets ANY process on the machine that reads
 * the descriptor open the memory, read it and write it. Send legacy
 * descriptors only over private channels.
 *
 * Thread safety. Unless a function says otherwise, functions may be called
 * from any thread at the same time, on different objects. One object (pool,
 * buffer, event) must not be destroyed/freed/closed while another thread
 * still uses it. Exports of one object from several threads at once are
 * safe. Imports and closes from many threads at once are safe and never map
 * the same memory twice.
 */
#ifndef GPUIPC_HANDLE_H
#define GPUIPC_HANDLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The CUDA driver's stream and event types (CUstream == cudaStream_t,
 * CUevent == cudaEvent_t): callers pass their own directly. NULL means the
 * legacy default stream. */
struct CUstream_st;
struct CUevent_st;

/* ------------------------------------------------------------------------ */
/* Descriptors                                                              */
/* ------------------------------------------------------------------------ */

/* The largest descriptor any export produces (version 1 descriptors are 192
 * bytes; later versions may grow up to this). Size export buffers with it. */
#define GPUIPC_DESC_MAX 256
/* The most file descriptors that travel beside one descriptor. */
#define GPUIPC_DESC_MAX_FDS 1

/* What a descriptor describes. */
typedef enum gpuipc_desc_type {
  GPUIPC_DESC_BUFFER = 1,
  GPUIPC_DESC_POOL = 2,
  GPUIPC_DESC_EVENT = 3
} gpuipc_desc_type;

/* ------------------------------------------------------------------------ */
/* Pools                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct gpuipc_pool gpuipc_pool;

typedef enum gpuipc_pool_kind {
  /* Picks the best kind the device supports (MEMPOOL, else VMM, else
   * LEGACY) and logs the choice at level info. */
  GPUIPC_POOL_AUTO = 0,
  /* A stream-ordered memory pool (cuMemPoolCreate) exported once as a POSIX
   * file descriptor. Allocation costs about a microsecond; an importer
   * imports the pool once (expensive: ~170 us, ~13 ms across GPUs; cached
   * per exporter pool) and then each buffer cheaply. Buffer descriptors
   * carry the pool's fd (or the importer already has the pool: see
   * gpuipc_pool_import()). */
  GPUIPC_POOL_MEMPOOL = 1,
  /* cuMemCreate allocations (sizes rounded up to the allocation
   * granularity), each exported as its own POSIX file descriptor. */
  GPUIPC_POOL_VMM = 2,
  /* Ordinary cuMemAlloc allocations shared by legacy CUDA IPC handles, for
   * peers that only speak those (CuPy, Triton-style clients). Needs no fd;
   * BEARER TOKENS (see the top of this header). */
  GPUIPC_POOL_LEGACY = 3,
  /* Host memory (a sealed-size memfd, one per buffer) shared between
   * processes and pinned (page-locked, cuMemHostRegister, portable to every
   * context) in every process that maps it, so asynchronous copies to and
   * from it work everywhere. gpuipc_buffer_get_ptr() returns the host address,
   * which is also the device address (unified addressing). A copy between
   * such a buffer and other host memory (pinned or not) is host to host,
   * which the CUDA driver API ("API synchronization behavior") makes fully
   * synchronous with respect to the host even as cuMemcpyAsync: the call
   * returns only once the copy is done, so after the stream's earlier
   * work. Copies with device memory at the other end are asynchronous. */
  GPUIPC_POOL_PINNED_HOST = 4
} gpuipc_pool_kind;

/* "auto", "mempool", "vmm", "legacy", "pinned-host"; "unknown" otherwise. */
GPUIPC_API const char *gpuipc_pool_kind_name(gpuipc_pool_kind kind);

typedef struct gpuipc_pool_options {
  size_t size; /* sizeof(gpuipc_pool_options): set by the initializer */
  gpuipc_pool_kind kind;
  /* The device, by UUID (gpuipc_device_uuid gives a local ordinal's); NULL
   * (the default) is local device 0. Ignored for PINNED_HOST except to pick
   * the context used to register the memory. */
  const gpuipc_uuid *device;
  /* MEMPOOL: the pool's maximum size in bytes (CU_MEMPOOL maxSize), 0 for
   * no limit. Other kinds: an upper bound on the sum of live buffer sizes
   * gpuipc enforces (GPUIPC_E_LIMIT), 0 for none. */
  size_t capacity;
  /* MEMPOOL: CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes the pool keeps
   * reserved after frees (default 0; UINT64_MAX keeps everything). */
  uint64_t release_threshold;
  /* Other local devices (by UUID) that may access this pool's memory in
   * this process, besides its own device (peer access is enabled for
   * them). NULL/0 for none. The array is read during gpuipc_pool_create
   * only. */
  const gpuipc_uuid *access_devices;
  int n_access_devices;
} gpuipc_pool_options;

#define GPUIPC_POOL_OPTIONS_INIT                                               \
  { sizeof(gpuipc_pool_options), GPUIPC_POOL_AUTO, NULL, 0, 0, NULL, 0 }

/*
 * Creates a pool. opts NULL means all defaults (AUTO on device 0).
 * Returns GPUIPC_E_NOT_SUPPORTED when the device cannot share memory of the
 * requested kind (the message says which attribute is missing),
 * GPUIPC_E_DEVICE_NOT_VISIBLE / GPUIPC_E_NO_DEVICE for a bad device, driver
 * errors otherwise. On success *pool is owned by the caller: release it with
 * gpuipc_pool_destroy(). Thread-safe.
 */
GPUIPC_API gpuipc_status gpuipc_pool_create(const gpuipc_pool_options *opts,
                                            gpuipc_pool **pool /* OUT */);

/*
 * Destroys a pool created by gpuipc_pool_create(), or releases a pool
 * obtained by gpuipc_pool_import(). NULL is a no-op. A created pool must
 * have no live buffers (GPUIPC_E_BUSY otherwise, and the pool stays valid).
 * Imported pools stay in gpuipc's cache while their exporter lives, so the
 * next import from the same exporter pool is free; once the exporter is
 * gone and nothing imported here holds the pool, it is destroyed.
 */
GPUIPC_API gpuipc_status gpuipc_pool_destroy(gpuipc_pool *pool);

/* The pool's kind (never AUTO: the kind AUTO chose). */
GPUIPC_API gpuipc_pool_kind gpuipc_pool_get_kind(const gpuipc_pool *pool);
/* The pool's device. */
GPUIPC_API gpuipc_status gpuipc_pool_get_device(const gpuipc_pool *pool,
                                            gpuipc_uuid *uuid /* OUT */);

/*
 * Exports a MEMPOOL pool: writes its descriptor (at most GPUIPC_DESC_MAX
 * bytes) to desc[0..cap) and its length to *len, and, if fd is non-NULL, a
 * new file descriptor for the pool to *fd, owned by the caller (close it
 * once sent). Exporting is cheap after the first time (the pool's
 * shareable handle is made once and dup()ed). Other kinds have no
 * pool-level export (GPUIPC_E_NOT_SUPPORTED): their buffers travel one by
 * one. GPUIPC_E_LIMIT when cap is too small.
 */
GPUIPC_API gpuipc_status gpuipc_pool_export(gpuipc_pool *pool, uint8_t *desc,
                                            size_t cap, size_t *len /* OUT */,
                                            int *fd /* OUT, may be NULL */);

/* Options of every import (buffer, pool, event). */
typedef struct gpuipc_import_options {
  size_t size; /* sizeof(gpuipc_import_options) */
  /* The local device to map on, by UUID; NULL: the exporter's device. The
   * exporter's device must be visible in this process either way (its
   * memory is reached through it); a different device maps the memory with
   * peer access (NVLink/PCIe). PINNED_HOST buffers are host memory: they
   * import even when the exporter's device is hidden here, registered in
   * the context of this device (NULL: the exporter's device if visible,
   * else device 0); the registration is portable to every context. */
  const gpuipc_uuid *device;
  unsigned flags; /* GPUIPC_IMPORT_* */
} gpuipc_import_options;

/* When a descriptor needs an fd that was not passed, fetch it from the
 * exporter with pidfd_getfd(2). Needs Linux >= 5.6 and permission to ptrace
 * the exporter (same uid and ptrace_scope allowing it, or CAP_SYS_PTRACE);
 * when refused, the import fails with GPUIPC_E_PERMISSION and a message
 * naming the missing permission. Off by default. */
#define GPUIPC_IMPORT_PIDFD_GETFD 0x1u
/* Do not use or fill the import cache: a private mapping per import. Only
 * for kinds whose driver calls give a new mapping each time (VMM, PINNED
 * HOST); ignored for others. */
#define GPUIPC_IMPORT_NO_CACHE 0x2u

#define GPUIPC_IMPORT_OPTIONS_INIT { sizeof(gpuipc_import_options), NULL, 0u }

/*
 * Imports a pool descriptor (from gpuipc_pool_export) with its fd (pass -1
 * with GPUIPC_IMPORT_PIDFD_GETFD to fetch it). The fd stays owned by the
 * caller (gpuipc dup()s what it keeps). The pool import is cached per
 * exporter pool, so importing it again is free; while an imported pool
 * exists, buffer descriptors of that exporter pool import without an fd.
 * The cached pool import lives while its exporter does: once the exporter
 * is gone and nothing imported here holds the pool (no gpuipc_pool of it,
 * no buffer of it open), the driver's pool is destroyed.
 * Cannot allocate (GPUIPC_E_NOT_SUPPORTED from gpuipc_buffer_alloc).
 * Release with gpuipc_pool_destroy(). Errors as gpuipc_buffer_import().
 */
GPUIPC_API gpuipc_status gpuipc_pool_import(const uint8_t *desc, size_t len,
                                            int fd,
                                            const gpuipc_import_options *opts,
                                            gpuipc_pool **pool /* OUT */);

/* ------------------------------------------------------------------------ */
/* Buffers                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct gpuipc_buffer gpuipc_buffer;

/*
 * Allocates size bytes (> 0) from a pool created by this process. For
 * MEMPOOL the allocation is stream-ordered on stream (cuMemAllocFromPoolAsync:
 * the memory is usable by work on that stream at once, by other streams
 * after synchronizing with it); other kinds ignore stream and return memory
 * usable at once. Returns GPUIPC_E_OUT_OF_DEVICE_MEMORY, GPUIPC_E_LIMIT
 * (capacity), GPUIPC_E_NOT_SUPPORTED for an imported pool. Owned by the
 * caller: gpuipc_buffer_free(). Thread-safe.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_alloc(gpuipc_pool *pool, size_t size,
                                             struct CUstream_st *stream,
                                             gpuipc_buffer **buf /* OUT */);

/*
 * Wraps device memory gpuipc did not allocate: [ptr, ptr+size) must lie
 * inside one allocation, possibly in its interior: gpuipc finds the
 * allocation's base and range and exports the base with the offset.
 * The kind is LEGACY for cuMemAlloc memory (cudaMalloc, CuPy's and
 * PyTorch's default allocators), MEMPOOL for memory of a pool created with
 * POSIX fd export (the pool's fd is made once and kept for the life of the
 * process), VMM for a cuMemMap'ed allocation created with POSIX fd export
 * (expandable segments; the wrapper holds a reference on the allocation
 * handle until freed). The memory stays owned by the caller:
 * gpuipc_buffer_free() of a wrapped buffer frees only the wrapper, and the
 * caller must keep the memory alive as long as importers use it. Do not
 * wrap memory of a gpuipc buffer: export the buffer itself.
 * GPUIPC_E_OUT_OF_RANGE when the range leaves the allocation,
 * GPUIPC_E_NOT_SUPPORTED for memory that cannot be shared.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_wrap(void *ptr, size_t size,
                                            gpuipc_buffer **buf /* OUT */);

/* Accessors: valid on allocated, wrapped and imported buffers; constant
 * over the buffer's life; thread-safe. NULL buf gives NULL / 0 /
 * GPUIPC_POOL_AUTO. */
/* The address of the buffer's first byte in this process (device address;
 * for PINNED_HOST also the host address). */
GPUIPC_API void *gpuipc_buffer_get_ptr(const gpuipc_buffer *buf);
GPUIPC_API size_t gpuipc_buffer_get_size(const gpuipc_buffer *buf);
/* The device the memory lives on (for PINNED_HOST: the device whose context
 * registered it). For an imported buffer mapped on another device this is
 * still the exporter's device; see gpuipc_buffer_get_mapped_device(). */
GPUIPC_API gpuipc_status gpuipc_buffer_get_device(const gpuipc_buffer *buf,
                                              gpuipc_uuid *uuid /* OUT */);
/* The local device an imported buffer was mapped on (the device itself for
 * allocated and wrapped buffers). */
GPUIPC_API gpuipc_status gpuipc_buffer_get_mapped_device(const gpuipc_buffer *buf,
                                                     gpuipc_uuid *uuid /* OUT */);
GPUIPC_API gpuipc_pool_kind gpuipc_buffer_get_kind(const gpuipc_buffer *buf);
/* 1 when the buffer came from gpuipc_buffer_import(), else 0. */
GPUIPC_API int gpuipc_buffer_is_imported(const gpuipc_buffer *buf);

/*
 * Frees a buffer. Allocated buffers: MEMPOOL memory is freed stream-ordered
 * on stream (cuMemFreeAsync: the memory is reused after work already queued
 * on stream), other kinds at once (the caller must have finished its GPU work
 * on it). Wrapped buffers: frees only the wrapper. Imported buffers: the same
 * as gpuipc_buffer_close(). NULL is a no-op. Calling it twice on one buffer
 * is a use after free. From the call on, imports of the buffer's
 * descriptors are refused as GPUIPC_E_STALE where the importer can read this
 * process's liveness table (see the top of this header). Note that the
 * driver does not stop importers that already mapped the buffer from
 * reading memory an exporter freed: freeing while peers use a buffer is the
 * caller's (or gpuipc's connection layer's) responsibility.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_free(gpuipc_buffer *buf,
                                            struct CUstream_st *stream);

/* How many leases connections of this process hold on buf (sent with
 * gpuipc_conn_send_buffer on any of them, not back yet: not released, or
 * released in frames no call has read yet). 0 for NULL or an imported
 * buffer. Thread-safe. */
GPUIPC_EXPERIMENTAL GPUIPC_API unsigned gpuipc_buffer_get_holders(const gpuipc_buffer *buf);

/*
 * Keep until released: hands an allocated or wrapped buffer (not an
 * imported one) over to gpuipc, which keeps it, and so the memory behind
 * it, until every lease that connections of this process took on it
 * (gpuipc_conn_send_buffer, on any number of connections) has come back,
 * then closes it (gpuipc_buffer_free(buf, stream)) and calls done(ctx),
 * exactly once. A lease comes back when the peer released it, when the
 * peer's process is gone (told by the pidfd taken at the handshake, also
 * for a peer in a pid namespace this process cannot see, whose pid reads
 * 0 here), or when the peer said it never used it. A connection closed
 * here while its peer still holds the buffer does not end the lease: the
 * buffer stays until that peer released it before the close or its
 * process is gone.
 *
 * Ordering: for each release that arrives from the call on, `stream` (the
 * stream the owner reuses the memory on; NULL or CU_STREAM_LEGACY: the
 * legacy stream) is made to wait, on the GPU, for the GPU work the peer
 * queued before releasing (as gpuipc_conn_buffer_wait does), so the owner
 * may reuse the memory on `stream` as soon as done runs; a lease whose
 * peer is gone needs no wait (its GPU work was torn down). Releases that
 * arrived before the call are ordered only for a connection on which a
 * later release of the buffer arrives: hand a buffer over right after its
 * sends, before any call on those connections (or order them yourself
 * with gpuipc_conn_buffer_wait first). A buffer with no lease out (never
 * sent, or every lease back) is done at once, inside this call.
 *
 * Ownership: from the call on, buf is gpuipc's: the caller must not send,
 * export, free or otherwise use it again (gpuipc_buffer_get_ptr and the
 * other accessors stay valid until done runs). ctx is the caller's;
 * gpuipc only passes it to done. done may be NULL (then nothing is
 * called).
 *
 * Threads: done runs in whichever thread gives the last lease back: in a
 * gpuipc call of the application's (one that reads the peer's releases
 * or notices its death: a call on a connection that sent it, including
 * gpuipc_conn_close; an arena call; gpuipc_conn_collect; this call
 * itself), or in the peer watcher thread ("gpuipc-watch") when the
 * process of a peer of a connection closed here exits. No lock of
 * gpuipc's is held and no CUDA context of gpuipc's is current while it
 * runs, but it may run in the middle of a call on a connection or arena:
 * done must not call gpuipc functions, must not block on anything a
 * thread calling gpuipc may hold (a binding's interpreter lock, say), and
 * should return quickly (queue the real work elsewhere).
 *
 * GPUIPC_E_INVALID_ARG for NULL, an imported buffer, or one handed over
 * already (nothing changes then). Thread-safe.
 */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_buffer_release_when_done(
    gpuipc_buffer *buf, struct CUstream_st *stream, void (*done)(void *ctx),
    void *ctx);

/*
 * Exports a buffer (allocated, wrapped or imported: re-exporting an
 * imported buffer is not supported, GPUIPC_E_NOT_SUPPORTED).
 * desc/cap: where the descriptor goes (GPUIPC_DESC_MAX bytes always
 * suffice; GPUIPC_E_LIMIT when cap is too small); *len: its length.
 * fds/nfds: on input *nfds is the capacity of fds (0, or fds NULL, for
 * none); on output the number of file descriptors written, each a new fd
 * owned by the caller (close them once sent). MEMPOOL buffers give the
 * pool's fd (an importer that already imported the pool does not need it),
 * VMM and PINNED_HOST buffers their own fd, LEGACY none. An export without
 * fds is still valid: the importer then needs the pool already, or
 * GPUIPC_IMPORT_PIDFD_GETFD. The first export of a MEMPOOL buffer costs a
 * cuMemPoolExportPointer (~50 us); later exports of the same buffer reuse it.
 * A MEMPOOL allocation is stream-ordered: let its stream reach it (or
 * synchronize) before an importer's GPU work uses the memory; likewise the
 * data the importer should see must have been written. Thread-safe.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_export(gpuipc_buffer *buf, uint8_t *desc,
                                              size_t cap, size_t *len /* OUT */,
                                              int *fds /* OUT */,
                                              int *nfds /* IN/OUT */);

/*
 * Exports a descriptor of [ptr, ptr + size), a range inside the allocation
 * buf was allocated or wrapped from (not only buf's own range): the cheap
 * way to send many views of one allocation (a framework's caching
 * allocator hands out tensors inside few large allocations), with the
 * handle made once for all of them. Costs one driver call
 * (CU_POINTER_ATTRIBUTE_BUFFER_ID of ptr), which checks that ptr still lies
 * in the allocation buf names. Writes no fds. Returns
 *   GPUIPC_E_OUT_OF_RANGE   the range leaves the allocation
 *   GPUIPC_E_STALE          ptr is in another allocation now (the one buf
 *                           wrapped was freed): wrap the new one
 *   GPUIPC_E_NOT_SUPPORTED  an imported buffer, memory that travels with an
 *                           fd (use gpuipc_buffer_export), or memory the
 *                           driver gives no buffer id
 * desc/cap/len as gpuipc_buffer_export. Thread-safe.
 */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_buffer_export_range(gpuipc_buffer *buf,
                                                    const void *ptr, size_t size,
                                                    uint8_t *desc, size_t cap,
                                                    size_t *len /* OUT */);

/*
 * Imports a buffer descriptor: opens the exporter's memory in this process,
 * on opts->device (NULL opts: the exporter's device). fds/nfds: the file
 * descriptors that travelled with it; they stay owned by the caller (gpuipc
 * dup()s what it keeps), so close them after this returns, whatever it
 * returns. First asks the exporter's liveness table whether the buffer was
 * freed (see the top of this header). Then goes through the import cache:
 * importing a buffer this process already imported returns a new reference
 * to the same mapping (same exporter buffer id and generation, and the
 * mapping still the one opened).
 *
 * Each failure has its own status:
 *   GPUIPC_E_TRUNCATED        fewer bytes than the descriptor declares
 *   GPUIPC_E_BAD_MAGIC        not a gpuipc descriptor
 *   GPUIPC_E_BAD_VERSION      a format version this library does not read
 *   GPUIPC_E_BAD_CHECKSUM     corrupted in transit
 *   GPUIPC_E_BAD_KIND         unknown type or handle kind, or not a buffer;
 *                             or its fd is not what the kind needs, checked
 *                             before anything is mapped (pinned host: a
 *                             memfd sealed against shrinking, as gpuipc's
 *                             own are; VMM and pool fds: not a file of a
 *                             file system, pipe, socket or sealed host
 *                             memfd)
 *   GPUIPC_E_PROTOCOL         inconsistent fields (trailing bytes, reserved
 *                             fields not zero, handle length)
 *   GPUIPC_E_OUT_OF_RANGE     offset + size beyond the allocation, checked
 *                             against the declared size and again against
 *                             the real mapped range after mapping (VMM:
 *                             a claimed size beyond the device's memory
 *                             that cannot be reserved, or one the driver
 *                             refuses to map)
 *   GPUIPC_E_FOREIGN_MACHINE  exported on another machine (boot id)
 *   GPUIPC_E_FOREIGN_NAMESPACE  exported in another pid namespace (over a
 *                             connection from its exporter, fd-based kinds
 *                             are accepted: gpuipc_conn_import_buffer;
 *                             legacy handles never are)
 *   GPUIPC_E_DEVICE_NOT_VISIBLE the exporter's device (or opts->device) is
 *                             not visible in this process
 *   GPUIPC_E_NEED_FD          an fd is needed and was not passed (and the
 *                             pool is not imported, and pidfd_getfd was not
 *                             asked for)
 *   GPUIPC_E_PERMISSION       pidfd_getfd refused (ptrace permission), or
 *                             the fd fetched is not proven to be the
 *                             export the descriptor names (the exporter's
 *                             liveness table records no such export: a
 *                             forged descriptor, a process that exported
 *                             nothing)
 *   GPUIPC_E_PEER_GONE        pidfd route: the exporter exited
 *   GPUIPC_E_STALE            the exporter freed the buffer (its liveness
 *                             table says so), or the driver refused a
 *                             legacy handle or mempool export data (of
 *                             freed memory, or forged), or the driver
 *                             handed back an import of another (freed)
 *                             allocation this process still holds at that
 *                             address (close that import first)
 *   GPUIPC_E_INVALID_ARG      a descriptor exported by this very process
 *                             (use the buffer itself)
 * Owned by the caller: gpuipc_buffer_close(). Thread-safe.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_import(const uint8_t *desc, size_t len,
                                              const int *fds, int nfds,
                                              const gpuipc_import_options *opts,
                                              gpuipc_buffer **buf /* OUT */);

/*
 * Releases an imported buffer: drops its reference on the cached mapping;
 * when that was the last, the mapping stays idle for a bounded time and
 * count (see "Linger" at the import cache below) and is then unmapped (one
 * driver close per driver open).
 * For an allocated or wrapped buffer it is gpuipc_buffer_free(buf, NULL).
 * NULL is a no-op. The caller must have finished its GPU work on the
 * buffer. Thread-safe.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_close(gpuipc_buffer *buf);

/* ------------------------------------------------------------------------ */
/* Interprocess events                                                      */
/* ------------------------------------------------------------------------ */

typedef struct gpuipc_event gpuipc_event;

/*
 * Creates an interprocess event on a device (NULL device: ordinal 0), with
 * timing disabled as CUDA requires of interprocess events. Owned by the
 * caller: gpuipc_event_destroy().
 */
GPUIPC_API gpuipc_status gpuipc_event_create(const gpuipc_uuid *device,
                                             gpuipc_event **ev /* OUT */);
/* Writes the event's descriptor (no fds needed). A legacy CUDA IPC event
 * handle is inside: like legacy memory descriptors it is a bearer token. */
GPUIPC_API gpuipc_status gpuipc_event_export(gpuipc_event *ev, uint8_t *desc,
                                             size_t cap,
                                             size_t *len /* OUT */);
/* Opens an exported event in this process (validation and errors as
 * gpuipc_buffer_import). Each import opens the event anew (the driver
 * gives a distinct CUevent each time); release with gpuipc_event_destroy(). */
GPUIPC_API gpuipc_status gpuipc_event_import(const uint8_t *desc, size_t len,
                                             const gpuipc_import_options *opts,
                                             gpuipc_event **ev /* OUT */);
/* Destroys a created or imported event. NULL is a no-op. */
GPUIPC_API gpuipc_status gpuipc_event_destroy(gpuipc_event *ev);
/* Records the event on stream (cuEventRecord). */
GPUIPC_API gpuipc_status gpuipc_event_record(gpuipc_event *ev,
                                             struct CUstream_st *stream);
/* Makes stream wait for the event's last record (cuStreamWaitEvent); the
 * host does not block. */
GPUIPC_API gpuipc_status gpuipc_event_wait(gpuipc_event *ev,
                                           struct CUstream_st *stream);
/* Blocks the host until the event's last record has completed. */
GPUIPC_API gpuipc_status gpuipc_event_synchronize(gpuipc_event *ev);
/* GPUIPC_OK when completed, GPUIPC_E_WOULD_BLOCK when not yet. */
GPUIPC_API gpuipc_status gpuipc_event_query(gpuipc_event *ev);
/* The CUevent itself, for the caller's own driver or runtime calls. Owned
 * by the gpuipc_event. */
GPUIPC_API struct CUevent_st *gpuipc_event_get_handle(const gpuipc_event *ev);

/* ------------------------------------------------------------------------ */
/* Descriptors without opening them; carrying them over sockets             */
/* ------------------------------------------------------------------------ */

/* What a descriptor says, decoded and validated (magic, version, length,
 * checksum, type, kind, range) without touching the driver. */
typedef struct gpuipc_desc_info {
  size_t size;            /* sizeof(gpuipc_desc_info): set by the caller */
  gpuipc_desc_type type;
  gpuipc_pool_kind kind;  /* for buffers and pools */
  unsigned version;       /* format version */
  int nfds;               /* file descriptors the exporter attached */
  gpuipc_uuid device;     /* the exporter's device */
  int exporter_pid;       /* in the exporter's pid namespace */
  uint64_t pool_id;       /* exporter-local id of the pool (MEMPOOL) */
  uint64_t buffer_id;     /* CU_POINTER_ATTRIBUTE_BUFFER_ID at the exporter
                             (identity only: an importer's mapping shows
                             the importer's own ids) */
  uint64_t generation;    /* exporter-local, new for every allocation */
  uint64_t offset;        /* of the buffer inside the allocation */
  uint64_t bytes;         /* the buffer's size */
  uint64_t alloc_bytes;   /* the whole allocation's mapped size */
  int same_machine;       /* boot id matches this machine's */
  int same_namespace;     /* pid namespace matches this process's */
} gpuipc_desc_info;

#define GPUIPC_DESC_INFO_INIT { .size = sizeof(gpuipc_desc_info) }

/* Decodes and validates a descriptor; fills info (up to info->size bytes).
 * Errors: TRUNCATED, BAD_MAGIC, BAD_VERSION, BAD_CHECKSUM, BAD_KIND,
 * PROTOCOL, OUT_OF_RANGE, as for gpuipc_buffer_import(). Does not check
 * boot id or namespace (see same_machine / same_namespace). Needs no
 * driver; thread-safe. */
GPUIPC_API gpuipc_status gpuipc_desc_get_info(const uint8_t *desc, size_t len,
                                              gpuipc_desc_info *info /* IN/OUT */);

/*
 * Sends one descriptor and its fds as one message on a connected
 * SOCK_STREAM or SOCK_SEQPACKET Unix socket (a 4-byte little-endian length,
 * then the bytes; the fds by SCM_RIGHTS with the first byte). Blocking;
 * retries on EINTR; no SIGPIPE. The fds stay owned by the caller.
 * GPUIPC_E_CLOSED when the peer closed, GPUIPC_E_SYSTEM otherwise.
 */
GPUIPC_API gpuipc_status gpuipc_desc_send(int sock, const uint8_t *desc,
                                          size_t len, const int *fds,
                                          int nfds);
/* Receives one message sent by gpuipc_desc_send: the descriptor into
 * desc[0..cap) (*len its length; GPUIPC_E_LIMIT if cap is too small), and
 * up to *nfds fds (in: capacity, out: received; each owned by the caller,
 * close-on-exec). GPUIPC_E_CLOSED at end of stream. */
GPUIPC_API gpuipc_status gpuipc_desc_recv(int sock, uint8_t *desc, size_t cap,
                                          size_t *len /* OUT */,
                                          int *fds /* OUT */,
                                          int *nfds /* IN/OUT */);

/* ------------------------------------------------------------------------ */
/* The import cache                                                         */
/* ------------------------------------------------------------------------ */

/*
 * Linger. The last gpuipc_buffer_close() of a mapping does not close it at
 * once: the mapping is kept, idle, for a bounded time and count, so that
 * importing the same allocation again soon (a producer sending from the
 * same memory over and over) costs no driver open and close (a legacy open
 * and close cost ~38 + ~28 us). A later import gets it only through the
 * usual validated hit (same exporter, handle, buffer id, generation; the
 * exporter's liveness table asked first). An idle mapping is closed
 *   - when it has been idle GPUIPC_IMPORT_LINGER_MS milliseconds (default
 *     100), by a thread of the cache (started with the first idle mapping)
 *     or by the next cache call;
 *   - oldest first, when more than GPUIPC_IMPORT_LINGER_MAX (default 64) are
 *     idle;
 *   - as soon as the exporter's liveness table says the allocation was
 *     freed (kinds with a generation: vmm, pinned host, memory pools'
 *     pointers), or the exporter is gone (checked every ~20 ms);
 *   - when a descriptor of another allocation with the same handle bytes
 *     arrives, before that one is opened;
 *   - by gpuipc_cache_trim().
 * 0 in either variable turns the linger off (the mapping closes with its
 * last close, as GPUIPC_IMPORT_NO_CACHE imports always do). Meanwhile the
 * exporter's memory stays mapped here: legacy memory freed by its exporter
 * is released by the driver only when this process closes it too.
 */

/* Closes every idle mapping now (see Linger above), and waits for the
 * closes of idle mappings another thread started: on return none is open.
 * Mappings still held are untouched. Returns GPUIPC_OK; thread-safe. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_cache_trim(void);

/* Counters of this process's import cache since start. */
typedef struct gpuipc_cache_stats {
  size_t size;             /* sizeof(gpuipc_cache_stats): set by the caller */
  uint64_t hits;           /* imports served from a live mapping */
  uint64_t misses;         /* imports that opened a mapping */
  uint64_t stale;          /* cached mappings retired: another allocation
                              with the same handle bytes (exporter buffer
                              id or generation differed), or a mapping no
                              longer the one opened */
  uint64_t driver_opens;   /* driver open/import/map calls that succeeded */
  uint64_t driver_closes;  /* driver close/free/unmap calls made */
  uint64_t live_mappings;  /* mappings open now */
  uint64_t pool_imports;   /* exporter pools imported (each once while
                              held; see gpuipc_pool_import) */
  uint64_t pool_hits;      /* pool imports served from the cache */
  uint64_t linger_kept;    /* mappings kept idle after their last close */
  uint64_t linger_hits;    /* hits (counted in hits too) on an idle mapping */
  uint64_t linger_drops;   /* idle mappings closed: time up, count bound,
                              exporter freed it or is gone, trimmed */
  uint64_t idle_mappings;  /* mappings idle now (counted in live_mappings) */
} gpuipc_cache_stats;

#define GPUIPC_CACHE_STATS_INIT { .size = sizeof(gpuipc_cache_stats) }

/* Reads the counters (up to stats->size bytes). Thread-safe. */
GPUIPC_API gpuipc_status gpuipc_cache_get_stats(gpuipc_cache_stats *stats /* IN/OUT */);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_HANDLE_H */
