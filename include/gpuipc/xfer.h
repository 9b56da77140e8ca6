/*
 * gpuipc/xfer.h: pipelined host<->device transfers, and pinned host memory
 * shared between processes.
 *
 * Included by gpuipc.h; may also be included on its own.
 *
 * A copy engine (gpuipc_xfer) belongs to one device. It moves data
 *   - host -> device          gpuipc_xfer_to_device()
 *   - device -> host          gpuipc_xfer_to_host()
 *   - host -> device -> (the caller's work on each chunk) -> host
 *                             gpuipc_xfer_pipeline()
 * cutting the work into chunks spread over a few non-blocking streams that
 * the engine creates once, so that copy-in, the caller's work and copy-out of
 * different chunks overlap. Host memory that is not pinned ("pageable") goes
 * through a ring of pinned staging buffers that the engine keeps (allocated
 * on first need, never per copy);
 * pinned host memory (cuMemHostAlloc, cuMemHostRegister, cudaMallocHost, ...)
 * and device memory are copied directly, with no extra copy.
 *
 * Ordering with the caller's stream. Every operation takes the caller's
 * stream (a CUstream / cudaStream_t; NULL is the legacy default stream). The
 * copy starts after the work the caller enqueued on that stream before the
 * call, and work the caller enqueues on that stream after the call runs
 * after the copy. The stream must belong to the device's primary context
 * (the context the CUDA runtime uses), because the engine records its
 * events on it.
 *
 * Completion. By default an operation returns as soon as everything is
 * enqueued: the caller learns of completion through its stream
 * (cuStreamSynchronize, an event recorded on it, or later work on it).
 * With GPUIPC_XFER_SYNC the call returns only once the copy has completed.
 * Pageable host memory cannot be copied asynchronously without a host thread
 * doing the memcpy, and the engine does that memcpy inside the call (its
 * helper threads only share the work of the call in progress); so,
 * honestly:
 *   - a pageable SOURCE is consumed during the call: when the call returns,
 *     every byte of it has been copied into staging and the caller may reuse
 *     it at once; the last chunks' DMA may still be in flight (ordered on the
 *     stream as above). A source larger than the staging ring reuses slots
 *     during the call, so the call then waits for DMAs, which wait for the
 *     work enqueued on the stream before the call;
 *   - a pageable DESTINATION is filled during the call: the call returns only
 *     once the data is in it (as if GPUIPC_XFER_SYNC were given), which
 *     includes waiting for the work enqueued on the stream before the call
 *     (so that work must not wait for something this thread does later);
 *   - pinned and device memory are copied fully asynchronously: keep them
 *     alive and unmodified until the stream has passed the copy.
 *
 * Errors. When an operation fails part way (a driver call fails, or the
 * caller's stage returns an error) it stops enqueueing, waits until the work
 * it already enqueued has finished (so that nothing it started touches the
 * caller's memory or its staging buffers after it returns), and returns the
 * first error; the engine remains usable and its staging buffers are free
 * again. The destination then holds partial data.
 *
 * Stream capture (CUDA graphs) of these operations is not supported: they
 * may wait on the host for staging slots, which capture forbids.
 *
 * Threads. An engine may be shared between threads: its operations take a
 * lock, so they run one at a time (use one engine per thread for parallel
 * pipelines; engines are independent of each other). A stage callback must
 * not call back into its own engine (that returns GPUIPC_E_BUSY).
 *
 * The heuristic (each part can be overridden in gpuipc_xfer_options):
 *   - streams: 4 when the device has at least two copy engines
 *     (CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT >= 2, so that copy-in and
 *     copy-out really run at the same time), else 2 (the copies still
 *     overlap the caller's stage).
 *   - maximum chunk: 8 MiB. The chunk of an n-byte transfer is n/16 rounded
 *     up to 64 KiB, at least 1 MiB and at most the maximum: filling and
 *     draining the pipeline (about one chunk at each end) costs a few
 *     percent, and so does each chunk's own cost (driver calls, events). On
 *     an H200, a 64 MiB copy-in -> stage -> copy-out reached 85% of the
 *     both-ways bound with 2 MiB chunks (n/32), 91% with 4 MiB (n/16) and
 *     89% with 8 MiB. A transfer no larger than one chunk is one chunk.
 *     Exception: a one-way copy between pinned host and device memory is
 *     not cut at all: one DMA per direction already saturates the link, and
 *     chunks would only add per-chunk cost. It is issued directly on the
 *     caller's stream. (An explicit chunk_bytes cuts it anyway.)
 *     A transfer with a pageable side is bound by the host's memcpy rather
 *     than by the link, so it takes fewer, larger chunks: n/8 rounded up to
 *     64 KiB, at least 1 MiB, at most the maximum (and a staging slot): the
 *     memcpy of one chunk still overlaps the DMA of the previous one, and
 *     the per-chunk costs stay small. A one-way transfer through staging
 *     issues its DMAs on the caller's stream, in order, so that each chunk
 *     lands as early as possible (parallel DMAs of one direction share the
 *     link and would delay the first), with no fork and join.
 *     Exceptions, where the driver's own pageable copy is as quick as
 *     staging or quicker (measured on an H200): a pageable source of 256
 *     KiB up to 4 MiB (excluded) copied to the device while the caller's
 *     stream is idle goes to cuMemcpyHtoDAsync (staging reached 0.72-0.96x
 *     of it at 1 MiB, 1.10-1.15x at 4 MiB, 1.4x at 16 MiB; below 256 KiB
 *     staging is as quick, 1.5x at 64 KiB). With work pending on the
 *     stream it is staged: the driver's copy would first wait on the host
 *     for that work. A pageable destination below 256 KiB goes to
 *     cuMemcpyDtoHAsync at any time (complete when it returns, after the
 *     stream's earlier work, as the engine's own copy out would be).
 *     (An explicit chunk_bytes always stages.)
 *   - staging ring: 2 slots per stream, each slot at most one maximum chunk
 *     (64 MiB of pinned memory with the defaults), allocated on the first
 *     copy that needs it and kept until the engine is destroyed. Its slots
 *     start at the smallest power of two >= 64 KiB that holds that copy's
 *     chunk and grow (reallocated once idle) when a larger chunk comes, so
 *     an engine used only for small pageable copies pins little.
 *   - host threads: one core copies memory at about 10 GB/s, less than one
 *     direction of a PCIe 5 link, so the memcpy of a large staged chunk is
 *     split between the calling thread and helper threads of the engine
 *     (started on its first staged copy; they run memcpy only, with all
 *     signals blocked): half the online CPUs, at most 16, at least 1 (no
 *     helper). Pieces are at least 256 KiB.
 *   - device scratch (gpuipc_xfer_pipeline without caller buffers): one
 *     input and one output chunk per stream, allocated on first use.
 */
#ifndef GPUIPC_XFER_H
#define GPUIPC_XFER_H

#include "../gpuipc.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;
struct CUevent_st;

/* A copy engine for one device. Opaque. */
typedef struct gpuipc_xfer gpuipc_xfer;

typedef struct gpuipc_xfer_options {
  size_t size;          /* sizeof(gpuipc_xfer_options): set by the INIT macro */
  int streams;          /* non-blocking streams of the engine; 0: automatic.
                           At most GPUIPC_XFER_MAX_STREAMS. */
  size_t chunk_bytes;   /* 0: automatic (see the heuristic above). Otherwise
                           every transfer is cut into chunks of exactly this
                           size (the last one shorter), one-way pinned copies
                           included. */
  size_t staging_bytes; /* pinned staging ring in bytes; 0: automatic. At
                           least 2 slots; a ring smaller than two chunks
                           makes staged chunks smaller. */
  int host_threads;     /* threads that copy pageable memory to and from
                           staging, the calling thread included; 0:
                           automatic; 1: the calling thread alone. */
} gpuipc_xfer_options;

#define GPUIPC_XFER_OPTIONS_INIT                                               \
  { sizeof(gpuipc_xfer_options), 0, 0, 0, 0 }
#define GPUIPC_XFER_MAX_STREAMS 16

/* Flags of the transfer operations. GPUIPC_XFER_SYNC: return only once the
 * transfer has completed. */
#define GPUIPC_XFER_SYNC 0x1u

/*
 * Creates a copy engine for the local device with this UUID (NULL: local
 * device 0), as every gpuipc function names a device. Creates its streams
 * and events in the device's primary context; staging and scratch memory
 * come later, on first need. opts may be NULL (all automatic).
 * Returns GPUIPC_E_INVALID_ARG for bad options, GPUIPC_E_DEVICE_NOT_VISIBLE
 * for a UUID not visible in this process, GPUIPC_E_NO_DEVICE when there is
 * no device at all, driver errors as usual. *out is set only on success.
 */
GPUIPC_API gpuipc_status gpuipc_xfer_create(const gpuipc_uuid *device,
                                            const gpuipc_xfer_options *opts,
                                            gpuipc_xfer **out /* OUT */);

/*
 * Waits for everything the engine enqueued to finish, then frees its
 * streams, events, staging and scratch memory. NULL: nothing to do, returns
 * GPUIPC_OK. The engine is freed even when a driver call fails on the way
 * (the first failure is returned). No operation on the engine may be in
 * progress on another thread.
 */
GPUIPC_API gpuipc_status gpuipc_xfer_destroy(gpuipc_xfer *x);

/*
 * Copies `bytes` bytes from host memory `src` (pageable or pinned; device
 * memory is accepted too and copied device to device) to device memory
 * `dst`, ordered on `stream` as described above. bytes == 0 does nothing
 * (the pointers may then be NULL).
 */
GPUIPC_API gpuipc_status gpuipc_xfer_to_device(gpuipc_xfer *x, void *dst,
                                               const void *src, size_t bytes,
                                               struct CUstream_st *stream,
                                               unsigned flags);

/*
 * Copies `bytes` bytes from device memory `src` to host memory `dst`
 * (pageable or pinned; a pageable dst makes the call blocking).
 */
GPUIPC_API gpuipc_status gpuipc_xfer_to_host(gpuipc_xfer *x, void *dst,
                                             const void *src, size_t bytes,
                                             struct CUstream_st *stream,
                                             unsigned flags);

/*
 * The caller's work on one chunk. Called on the calling thread, once per
 * chunk, in increasing offset order, with the device's primary context
 * current. It must ENQUEUE work on `stream` (a kernel launch, a library
 * call, cuMemcpyDtoDAsync, ...) that reads `len` bytes at dev_in and writes
 * `len` bytes at dev_out; work it enqueues elsewhere must be made to finish
 * before later work on `stream` (cuStreamWaitEvent). The input has arrived
 * before the work enqueued on `stream` starts; the engine copies dev_out
 * out after it. `offset` is the chunk's position in the whole transfer.
 * dev_in and dev_out are valid for this chunk only (with engine scratch they
 * are reused by later chunks on the same stream, in stream order).
 * Returning anything but GPUIPC_OK stops the transfer, which returns that
 * status (GPUIPC_E_USER is meant for this).
 */
typedef gpuipc_status (*gpuipc_xfer_stage_fn)(void *user,
                                              struct CUstream_st *stream,
                                              void *dev_in, void *dev_out,
                                              size_t offset, size_t len);

typedef struct gpuipc_xfer_stage {
  /* sizeof(gpuipc_xfer_stage): set by the INIT macro */
  size_t size;
  gpuipc_xfer_stage_fn fn; /* NULL: no stage; dev_in is copied out as is */
  void *user;              /* passed to fn */
  void *dev_in;  /* device buffer of the whole transfer's size that receives
                    the input (chunk i at dev_in + offset), left holding it;
                    NULL: engine scratch, one chunk per stream */
  void *dev_out; /* same for the output; may equal dev_in (in place) */
} gpuipc_xfer_stage;

#define GPUIPC_XFER_STAGE_INIT                                                 \
  { sizeof(gpuipc_xfer_stage), NULL, NULL, NULL, NULL }

/*
 * copy-in -> stage -> copy-out: for each chunk, copies it from host memory
 * `src` to the device, runs stage->fn on it, and copies the stage's output to
 * host memory `dst` at the same offset. dst and src may be pageable or
 * pinned (a pageable dst makes the call blocking) and must not overlap.
 * Chunk i runs on engine stream i % streams, so the copy-in of one chunk,
 * the stage of another and the copy-out of a third proceed at once.
 */
GPUIPC_API gpuipc_status gpuipc_xfer_pipeline(gpuipc_xfer *x, void *dst,
                                              const void *src, size_t bytes,
                                              const gpuipc_xfer_stage *stage,
                                              struct CUstream_st *stream,
                                              unsigned flags);

/* What an engine chose, and what it has done (for tests and benchmarks). */
typedef struct gpuipc_xfer_info {
  size_t size;               /* sizeof(gpuipc_xfer_info): set by the caller */
  gpuipc_uuid device;        /* the engine's device */
  int streams;               /* engine streams */
  int copy_engines;          /* CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT */
  size_t max_chunk_bytes;    /* largest chunk */
  size_t staging_slot_bytes; /* largest staging slot (the ring grows to it) */
  int staging_slots;         /* slots in the ring */
  int staging_allocated;     /* 1 once the ring has been allocated */
  int host_threads;          /* threads sharing a staged memcpy (chosen;
                                started with the ring) */
  uint64_t transfers;        /* operations completed or enqueued */
  uint64_t chunks;           /* chunks enqueued */
  uint64_t staged_bytes;     /* bytes that went through the staging ring */
  uint64_t direct_bytes;     /* bytes copied directly (pinned or device) */
  size_t staging_bytes;      /* pinned staging memory held now */
} gpuipc_xfer_info;

/* Fills *info (only the first info->size bytes; set info->size =
 * sizeof *info first). Takes the engine's lock. */
GPUIPC_API gpuipc_status
gpuipc_xfer_get_info(gpuipc_xfer *x, gpuipc_xfer_info *info /* IN/OUT */);

/* The chunk size the engine uses for a transfer of `bytes` bytes that it
 * cuts without staging (the pipeline between pinned or device memory, or
 * any transfer when chunk_bytes was given: then it is chunk_bytes). A
 * transfer with a pageable side uses the larger chunks described in the
 * heuristic above, and at most staging_slot_bytes (gpuipc_xfer_info). */
GPUIPC_API gpuipc_status gpuipc_xfer_get_chunk_size(gpuipc_xfer *x, size_t bytes,
                                                size_t *chunk /* OUT */);

/* ------------------------------------------------------------------------ */
/* Shared pinned host memory                                                */
/* ------------------------------------------------------------------------ */

/*
 * A host memory segment shared by several processes, cut into `slots` slots
 * of `slot_bytes` bytes, with the ordering between a filler and a copier
 * kept in the segment itself. A loader process (which needs no GPU) fills a
 * slot and publishes it; a GPU process's stream waits for the publication
 * (cuStreamWaitValue32 on the host-mapped word: no host thread waits), copies
 * the slot straight to the device with one DMA (the segment is pinned in the
 * copier's process: no staging copy), and then writes "consumed"
 * (cuStreamWriteValue32, after the copy in stream order), which is what the
 * filler waits for before it refills the slot.
 *
 * Messages are numbered by a 64-bit sequence number seq = 0, 1, 2, ...;
 * message seq lives in slot seq % slots. Each side keeps its own count; the
 * words in the segment say how far the other side has come. The filler:
 *     gpuipc_xfer_shared_acquire(sh, seq, timeout_ms, &ptr, &cap);  // waits
 *     ... write up to cap bytes at ptr ...
 *     gpuipc_xfer_shared_publish(sh, seq, len);
 * The copier (after gpuipc_xfer_shared_pin once):
 *     gpuipc_xfer_shared_to_device(sh, seq, dev_dst, len, stream, 0);
 * or, on the host, gpuipc_xfer_shared_wait_filled + read +
 * gpuipc_xfer_shared_release.
 *
 * A GPU-side wait never times out: if the filler may die before publishing,
 * the copier should first wait on the host with a timeout
 * (gpuipc_xfer_shared_wait_filled), after which the GPU-side wait passes at
 * once. Only one filler and one copier per segment; each side calls from
 * one thread at a time (the functions take no lock: the words are the
 * synchronization).
 *
 * Two ways to share the memory:
 *   - gpuipc_xfer_shared_create / _open: a sealed memfd (size fixed) made
 *     here, mapped into each process and passed as a file descriptor (send
 *     it over a Unix socket with SCM_RIGHTS, e.g. a gpuipc connection). The
 *     filler then needs no CUDA at all; the copier pins it with
 *     gpuipc_xfer_shared_pin.
 *   - gpuipc_xfer_shared_format / _attach over a buffer of the handle
 *     layer's GPUIPC_POOL_PINNED_HOST pool, which travels as a buffer
 *     descriptor (gpuipc_buffer_export / gpuipc_buffer_import) and is
 *     pinned in every process that maps it (so every side needs the
 *     driver).
 * Either way the first page holds a validated header and the control words
 * (each on its own cache line); slots follow, page aligned.
 */
typedef struct gpuipc_xfer_shared gpuipc_xfer_shared;

/* Creates a segment of `slots` slots (1..GPUIPC_XFER_SHARED_MAX_SLOTS) of
 * slot_bytes bytes each (rounded up to the page size). Needs no driver. */
#define GPUIPC_XFER_SHARED_MAX_SLOTS 1024
GPUIPC_API gpuipc_status gpuipc_xfer_shared_create(
    size_t slot_bytes, int slots, gpuipc_xfer_shared **out /* OUT */);

/* Opens a segment from a file descriptor received from its creator. The fd
 * is not taken over (the caller still closes it). Validates the header, the
 * seals and the size: GPUIPC_E_BAD_MAGIC / E_BAD_VERSION / E_TRUNCATED /
 * E_OUT_OF_RANGE for anything that is not a segment made by
 * gpuipc_xfer_shared_create. Needs no driver. */
GPUIPC_API gpuipc_status
gpuipc_xfer_shared_open(int fd, gpuipc_xfer_shared **out /* OUT */);

/* Lays a segment over a pinned-host buffer (gpuipc_buffer_get_kind ==
 * GPUIPC_POOL_PINNED_HOST, allocated here or imported): writes the header
 * and clears the control words, so do it once, before the buffer is shared
 * (or while no other side uses it). slot_bytes 0: as large as fits; it is
 * rounded up to the page size. The buffer stays owned by the caller and must
 * outlive the segment; the segment is "pinned" at once (on the device the
 * buffer is mapped on). GPUIPC_E_BAD_KIND for another kind of buffer,
 * GPUIPC_E_OUT_OF_RANGE when the slots do not fit. */
GPUIPC_API gpuipc_status
gpuipc_xfer_shared_format(gpuipc_buffer *buf, size_t slot_bytes, int slots,
                          gpuipc_xfer_shared **out /* OUT */);

/* The other side: a segment over a pinned-host buffer that another process
 * formatted (typically just imported with gpuipc_buffer_import). Validates
 * the header against the buffer's size (errors as gpuipc_xfer_shared_open).
 * The buffer stays owned by the caller and must outlive the segment. */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_attach(
    gpuipc_buffer *buf, gpuipc_xfer_shared **out /* OUT */);

/* Unpins (if pinned) and unmaps (a segment over a buffer: only forgets it;
 * the buffer is the caller's). The memory lives on while another process
 * has it open. NULL: nothing. The caller must make sure no GPU work that it
 * enqueued on this segment is still pending (synchronize its streams). */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_close(gpuipc_xfer_shared *sh);

/* The segment's file descriptor, to send to another process (owned by sh:
 * do not close it; valid until gpuipc_xfer_shared_close). -1 for a segment
 * over a buffer (the buffer's descriptor is what travels). */
GPUIPC_API int gpuipc_xfer_shared_get_fd(const gpuipc_xfer_shared *sh);
GPUIPC_API int gpuipc_xfer_shared_get_slots(const gpuipc_xfer_shared *sh);
GPUIPC_API size_t gpuipc_xfer_shared_get_slot_bytes(const gpuipc_xfer_shared *sh);
/* Address of the slot that holds message seq, in this process. */
GPUIPC_API void *gpuipc_xfer_shared_get_slot(const gpuipc_xfer_shared *sh,
                                         uint64_t seq);

/* Pins the segment for DMA in this process (cuMemHostRegister with
 * PORTABLE | DEVICEMAP, done in the primary context of the device with this
 * UUID; NULL: local device 0) and maps its control words for the GPU.
 * Needed before the _device functions; idempotent (GPUIPC_E_EXISTS when
 * pinned for another device already). Pinning costs time proportional to
 * the size: do it once. A segment over a buffer is pinned already (nothing
 * to do, whatever device is named). */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_pin(gpuipc_xfer_shared *sh,
                                                const gpuipc_uuid *device);

/* Filler: waits until the slot of message seq is free (the message that
 * used it before, seq - slots, has been consumed), then returns the slot's
 * address and capacity. timeout_ms < 0: wait forever; 0: do not wait.
 * GPUIPC_E_TIMEOUT when the time runs out. */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_acquire(gpuipc_xfer_shared *sh,
                                                    uint64_t seq,
                                                    int timeout_ms,
                                                    void **ptr /* OUT */,
                                                    size_t *cap /* OUT */);

/* Filler: publishes message seq of len bytes (len <= slot_bytes): stores the
 * length, then the sequence word with release semantics, so that whoever
 * sees the word sees the data. */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_publish(gpuipc_xfer_shared *sh,
                                                    uint64_t seq, size_t len);

/* Copier on the host: waits until message seq has been published; returns its
 * length. Then read the slot, and call gpuipc_xfer_shared_release. */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_wait_filled(gpuipc_xfer_shared *sh,
                                                        uint64_t seq,
                                                        int timeout_ms,
                                                        size_t *len /* OUT */);
/* Copier on the host: message seq has been consumed; its slot may be
 * refilled. */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_release(gpuipc_xfer_shared *sh,
                                                    uint64_t seq);

/*
 * Copier on the GPU: enqueues on `stream`: wait until message seq is
 * published (cuStreamWaitValue32 on the mapped word), copy `len` bytes of its
 * slot to device memory `dst` (one DMA, straight from the shared pages), then
 * mark the message consumed (cuStreamWriteValue32, which the filler's
 * acquire waits for). The host does not wait unless flags has
 * GPUIPC_XFER_SYNC. len <= slot_bytes; the copier must know it (it is part
 * of the two sides' agreement, or read with wait_filled first). Needs
 * gpuipc_xfer_shared_pin first; stream belongs to the pinned device's
 * primary context. On a driver failure the steps before the failing one
 * stay enqueued (so the stream may still wait for the publication); the
 * message is not marked consumed, and the call may be repeated.
 */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_to_device(
    gpuipc_xfer_shared *sh, uint64_t seq, void *dst, size_t len,
    struct CUstream_st *stream, unsigned flags);

/*
 * The reverse direction, a GPU process filling the segment for a host
 * reader: enqueues on `stream`: wait until the slot of message seq is free,
 * copy `len` bytes from device memory `src` into it, write the length and
 * publish message seq. The reader uses gpuipc_xfer_shared_wait_filled /
 * gpuipc_xfer_shared_release.
 */
GPUIPC_API gpuipc_status gpuipc_xfer_shared_from_device(
    gpuipc_xfer_shared *sh, uint64_t seq, const void *src, size_t len,
    struct CUstream_st *stream, unsigned flags);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_XFER_H */
