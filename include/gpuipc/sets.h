/*
 * gpuipc/sets.h: tensor sets: many named tensors handed between processes
 * as one versioned object (weight sync, KV-cache handoff).
 *
 * Included from gpuipc.h; do not include it on its own.
 *
 * Experimental: every function here is GPUIPC_EXPERIMENTAL (gpuipc.h) and
 * may still change in a minor release; the table format (docs/sets.md)
 * carries its own version, so peers of two releases refuse each other
 * rather than misread.
 *
 * The model
 * ---------
 * A tensor set (gpuipc_tset) is a table of entries (name, dtype, shape,
 * strides, and where its bytes are) over a few pieces of shared device
 * memory. Its layout is fixed when it is created; a layout change (a tensor
 * added, one resized) is a new set.
 *
 * Where the memory is, chosen at creation:
 *  - owned: every entry's ptr is NULL; the set places the tensors (aligned)
 *    in one arena block per copy, and the producer writes them there
 *    (gpuipc_tset_get_tensor gives their addresses, gpuipc_tset_copy_from
 *    copies the producer's own tensors in). opts.copies = 2 keeps two copies
 *    (double buffering): the producer writes version N+1 into one while
 *    consumers still read version N in the other.
 *  - wrapped: every entry's ptr is the producer's own device memory (a
 *    framework's allocations: a trainer's weights stay where they are). The
 *    allocations holding them are the pieces (wrapped with
 *    gpuipc_buffer_wrap; tensors of one allocation share one piece), sent
 *    to each consumer once by descriptor. One copy only.
 *
 * The producer subscribes connections (gpuipc_tset_subscribe): each gets
 * the set's table (docs/sets.md) and its pieces once, and the latest
 * version if there is one (a late joiner starts there). Then, per version:
 *
 *   gpuipc_tset_begin(set, stream, &copy)   the copy to write: one that no
 *                                           consumer holds, stream ordered
 *                                           after their last reads of it
 *   ... write the tensors of that copy on stream ...
 *   gpuipc_tset_publish(set, stream)        to every subscriber: one small
 *                                           message and one stream-ordered
 *                                           signal each, whatever the
 *                                           number of tensors
 *
 * A consumer opens a subscriber on its end of the connection
 * (gpuipc_tset_sub_open) and receives versions in order
 * (gpuipc_tset_recv). The first version of a layout imports its pieces
 * (once; the import cache and the connection's arena imports make later
 * versions free of driver calls). A version is either read in place
 * (zero-copy: gpuipc_tset_version_get_tensor gives each tensor's device
 * address in this process, valid until gpuipc_tset_version_release) or
 * copied into the consumer's own tensors (gpuipc_tset_version_copy_into:
 * the device-to-device copies of the whole set on one stream, adjacent
 * ranges coalesced, without waiting on the host). Releasing a version
 * hands its copy back to the producer once the GPU work the consumer
 * queued before the release has completed.
 *
 * Consistency. A consumer never sees a torn version: the producer writes
 * a copy only after every consumer released the version it held in it and
 * their GPU work on it finished (the version's lease is an arena block's
 * lease, with the connection's stream-ordered release), and a consumer's
 * work after recv runs after the producer's writes queued before publish.
 * With one copy, the producer's begin waits for every consumer to release
 * the latest version; with two, only for the one before it.
 *
 * Consumers that stop releasing. No consumer can stall the producer, and
 * through it the others, for longer than the hold limit
 * (gpuipc_tset_options.hold_ms, default 10 s after the version was
 * published): begin then drops the consumers that still hold the copy it
 * needs (their recv returns GPUIPC_E_CANCELED, saying so, once the
 * versions sent before are taken) and writes a fresh copy instead. An
 * owned set's held copy is set aside, not written, until its holders
 * released it or died (their views stay whole), at most retired_max
 * copies at a time; the other consumers get the fresh copy's piece before
 * the version in it (no driver call on their fast path: only when it
 * happens). A wrapped set's memory is the producer's own: it is written
 * in place, and a dropped consumer's views of it are not protected any
 * more; so is an owned set's once retired_max copies are set aside. A
 * release whose GPU work has not completed by the hold limit (a hung
 * kernel before it, or a release announced without its GPU write) counts
 * as a hold: the producer's stream is never queued behind it. Consumers
 * that release within the limit see no change.
 *
 * Connections. A connection subscribed to a set carries that set's traffic
 * and nothing else (no other buffers or user messages) while subscribed,
 * one set at a time: to change the layout, unsubscribe the old set and
 * subscribe the new one on the same connection; the consumer sees the new
 * layout with its first version (gpuipc_tset_version_get_layout changes)
 * and drops the old pieces once it released the old versions. Close a
 * connection only after gpuipc_tset_unsubscribe returned GPUIPC_OK (or the
 * set was destroyed).
 *
 * Hostile input. The consumer validates everything the producer sends
 * before building a view: the table's checksum and version, entry and
 * piece counts, names (UTF-8, 1..GPUIPC_TSET_NAME_MAX bytes, unique),
 * dtypes, ndim <= GPUIPC_TSET_NDIM_MAX, shapes and strides (each entry's
 * byte extent must match its declared length and lie inside its piece),
 * entries that overlap, pieces smaller than the table says. A refused
 * table is an error (GPUIPC_E_PROTOCOL, or the decoder's status) and no
 * version of that layout is ever returned; its pieces are released.
 *
 * Peer death. A consumer that dies releases everything it held (the
 * connection layer reclaims its leases once the process is gone); the
 * producer's calls drop it from the set's subscribers. If the producer
 * dies, gpuipc_tset_recv returns GPUIPC_E_PEER_GONE; versions already
 * received stay readable until released; a layout half received is
 * discarded.
 *
 * Threads. A set, a subscriber and their versions may be used from any
 * thread, one thread at a time per set (and its connections), per
 * subscriber (and its versions and connection).
 *
 * For bindings: a set is made from an array of (name, dtype, shape,
 * strides, device pointer) entries (gpuipc_tensor), the same struct the
 * consumer gets back per tensor; dtype codes are gpuipc_dtype's
 * (gpuipc/tensor.h), each one DLPack data type (gpuipc_dtype_to_dlpack).
 */
#ifndef GPUIPC_SETS_H
#define GPUIPC_SETS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpuipc_tset gpuipc_tset;
typedef struct gpuipc_tset_sub gpuipc_tset_sub;
typedef struct gpuipc_tset_version gpuipc_tset_version;

/* Longest tensor name, in bytes of UTF-8 (no NUL inside). */
#define GPUIPC_TSET_NAME_MAX 255
/* Most dimensions of one tensor. */
#define GPUIPC_TSET_NDIM_MAX 8
/* Most entries of one set. */
#define GPUIPC_TSET_ENTRIES_MAX (1u << 20)
/* Most pieces (distinct allocations) of one set, all copies together. */
#define GPUIPC_TSET_PIECES_MAX 1024u
/* Largest encoded table (docs/sets.md). */
#define GPUIPC_TSET_TABLE_MAX ((size_t)64 << 20)

/* Element types: gpuipc_dtype, gpuipc_dtype_get_size and gpuipc_dtype_name
 * are in gpuipc/tensor.h (one vocabulary for sets and the tensor meta). */

/* One tensor of a set. On input (gpuipc_tset_create) the caller's arrays
 * are read during the call only; nbytes is ignored. On output (the
 * get_tensor accessors) the pointers are owned by the set or version and
 * valid as long as it is. */
typedef struct gpuipc_tensor {
  const char *name;       /* UTF-8, NUL-terminated, unique in the set */
  int dtype;              /* a gpuipc_dtype */
  int ndim;               /* 0 .. GPUIPC_TSET_NDIM_MAX */
  const int64_t *shape;   /* ndim sizes, each >= 0 (NULL when ndim is 0) */
  const int64_t *strides; /* ndim strides in elements, each >= 0; NULL on
                             input: contiguous (row-major) */
  void *ptr;              /* device address of element 0: input NULL for an
                             owned set, the tensor's memory for a wrapped
                             one; output: where it is in this process */
  size_t nbytes;          /* output: bytes the tensor spans (its extent) */
} gpuipc_tensor;

/* Options of gpuipc_tset_create. Read only `size` bytes. */
typedef struct gpuipc_tset_options {
  size_t size;
  /* Copies of the memory: 1, or 2 for double buffering (owned sets only).
   * Default 1. */
  int copies;
  /* Owned sets: the arena the copies are allocated from (it must outlive
   * the set); NULL: the set makes its own on `device`. Wrapped sets: the
   * arena of the set's small version blocks; NULL: its own. */
  gpuipc_arena *arena;
  /* The device of the set's own arena, by UUID; NULL: device 0 (wrapped
   * sets: the device of the first tensor's memory). */
  const gpuipc_uuid *device;
  /* Owned sets: alignment of each tensor in its copy (a power of two,
   * >= 16). Default 256. */
  size_t align;
  /* Longest wait of begin, unsubscribe and destroy for consumers' releases
   * (ms; -1: forever). Default 10000. */
  int timeout_ms;
  /* Hold limit (ms; -1: none). A copy that consumers still hold this long
   * after the version they got in it was published no longer holds up the
   * producer: begin drops its holders from the set (the producer ends their
   * subscriptions: their gpuipc_tset_recv returns GPUIPC_E_CANCELED, saying
   * why, after the versions already sent; they are sent nothing more) and
   * writes a fresh copy instead. Owned sets: the held copy is retired (its
   * memory stays the holders' until they release it or die, then returns
   * to the arena; nothing else is written there meanwhile) and a new piece
   * is announced to the other consumers (docs/sets.md, REPLACE). Wrapped
   * sets (the memory is the producer's own and cannot be set aside): the
   * copy is written in place, and the dropped consumers' views of it are
   * no longer protected. A copy released, but whose release's GPU work
   * (what the consumer queued before it) has not completed by then, counts
   * as held. Also the longest unsubscribe and destroy of an
   * owned set wait for a consumer's releases before they let go of it.
   * Default 10000. */
  int hold_ms;
  /* Most retired copies an owned set keeps at once for consumers that
   * still hold them (0 to 64): memory beyond the set's copies is at most
   * this many copies. When a copy must be retired and the cap is full of
   * copies still held, begin drops the holders and writes the copy in
   * place, as for a wrapped set (their views of it are no longer
   * protected): a peer that connects many times cannot stop the producer.
   * 0: never set aside. Default 2 (a consumer that stops releasing holds
   * at most one version per copy). */
  int retired_max;
} gpuipc_tset_options;

#define GPUIPC_TSET_OPTIONS_INIT                                               \
  {sizeof(gpuipc_tset_options), 1, NULL, NULL, 256, 10000, 10000, 2}

/* ---- the producer's side ------------------------------------------------ */

/* Makes a set of n tensors (1 .. GPUIPC_TSET_ENTRIES_MAX): owned when
 * every tensors[i].ptr is NULL (the copies are allocated now, contents
 * undefined), wrapped when none is (each range is checked to lie in one
 * allocation, GPUIPC_E_OUT_OF_RANGE otherwise; ranges of different tensors
 * must not overlap). GPUIPC_E_INVALID_ARG for a bad entry (the message
 * names it: index, name, what is wrong), a duplicate name, mixed owned
 * and wrapped entries, copies > 1 for a wrapped set. Needs CUDA. Owned
 * by the caller: gpuipc_tset_destroy. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_create(const gpuipc_tensor *tensors,
                                            size_t n,
                                            const gpuipc_tset_options *opts,
                                            gpuipc_tset **out /* OUT */);

/* Ends every subscription (as gpuipc_tset_unsubscribe) and frees the
 * set's memory. An owned set lets go of consumers that still hold
 * versions or pieces once the hold limit has passed since their END: what
 * they hold is freed when they release it or die (the arena defers it:
 * the caller's arena must outlive that; the set's own arena goes then, in
 * a later gpuipc_tset_create or gpuipc_tset_destroy of this process).
 * GPUIPC_E_BUSY when a consumer still holds something after the set's
 * timeout, before the hold limit, or for a wrapped set (whose memory
 * stays the caller's, and must stay allocated while consumers map it:
 * until they released it or died); the set stays valid: try again. NULL
 * is a no-op. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_destroy(gpuipc_tset *set);

/* Number of tensors; copies; the id of the set's layout (what consumers
 * see as gpuipc_tset_version_get_layout); the number of the latest
 * published version (0 before the first). */
GPUIPC_EXPERIMENTAL GPUIPC_API size_t gpuipc_tset_get_count(const gpuipc_tset *set);
GPUIPC_EXPERIMENTAL GPUIPC_API int gpuipc_tset_get_copies(const gpuipc_tset *set);
GPUIPC_EXPERIMENTAL GPUIPC_API uint64_t gpuipc_tset_get_layout(const gpuipc_tset *set);
GPUIPC_EXPERIMENTAL GPUIPC_API uint64_t gpuipc_tset_get_version(const gpuipc_tset *set);

/* Tensor i (in creation order) of copy `copy` (0 .. copies-1), with its
 * address in this process. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_get_tensor(const gpuipc_tset *set,
                                                int copy, size_t i,
                                                gpuipc_tensor *out /* OUT */);
/* The index of the tensor named `name`; GPUIPC_E_NOT_FOUND. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_find(const gpuipc_tset *set,
                                          const char *name,
                                          size_t *index /* OUT */);

/* Starts a version: picks the copy to write (with two copies, the one not
 * holding the latest version) and waits (up to the timeout, making
 * progress on the subscribed connections) until no consumer holds it and
 * the GPU work consumers queued before their releases of it completed
 * (waited for on the host, not queued on `stream`: a release that never
 * completes cannot stall the producer's stream). *copy gets its index.
 * Write the tensors of that copy on `stream` (or streams ordered before
 * it), then gpuipc_tset_publish.
 * Consumers found gone are dropped from the set. A copy held for the hold
 * limit since its version's publish (or whose release has not completed
 * by then) is not waited for: its holders are dropped from the set, and
 * an owned set writes a fresh copy (the held one is retired) while fewer
 * than retired_max are retired, else the copy in place (see
 * gpuipc_tset_options). GPUIPC_E_TIMEOUT when a consumer still holds it,
 * or its release has not completed, after the timeout (no hold limit, or
 * a longer one); the status of the allocation when a fresh copy could not
 * be made; GPUIPC_E_INVALID_ARG inside a begin already. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_begin(gpuipc_tset *set,
                                           struct CUstream_st *stream,
                                           int *copy /* OUT */);

/* Copies the producer's own tensors into copy `copy` of an owned set:
 * srcs[i] is the device address of tensor i's source (same dtype, shape and
 * strides; NULL: skip it), copied on `stream` with adjacent ranges
 * coalesced and the rest as one batched copy where the driver has one
 * (docs/sets.md, "Whole-set copies"). Does not wait on the host. Call
 * between begin and publish. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_copy_from(gpuipc_tset *set, int copy,
                                               void *const *srcs,
                                               struct CUstream_st *stream);

/* Publishes the copy begun as the next version to every subscriber,
 * ordered after the work queued on `stream` before this call: one message
 * and one stream memory operation per subscriber. Subscribers found gone
 * are dropped (not an error). Other send failures are returned after the
 * version went to the rest. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_publish(gpuipc_tset *set,
                                             struct CUstream_st *stream);

/* Subscribes a connection: sends the table and the pieces (setup cost,
 * once per connection), and the latest version when there is one (a
 * version being written between begin and publish is not sent: the
 * subscriber gets it at publish). Ordered on `stream`. Its sends wait at
 * most the connection's timeout in all (GPUIPC_E_TIMEOUT: the consumer
 * did not take them; the set lets go of conn once what was sent drained).
 * GPUIPC_E_EXISTS when conn is subscribed already. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_subscribe(gpuipc_tset *set,
                                               gpuipc_conn *conn,
                                               struct CUstream_st *stream);

/* Ends a subscription: tells the consumer, then waits (up to the timeout,
 * making progress) until it released everything of the set. GPUIPC_OK:
 * the set no longer uses conn. An owned set lets go of a consumer that
 * still holds something once the hold limit has passed since its END
 * (GPUIPC_OK): what it holds comes back when it releases it (on conn, while
 * conn is open and makes progress) or dies, and a copy it holds is retired
 * by the next begin that needs it. GPUIPC_E_TIMEOUT: the consumer still
 * holds something after the timeout (before the hold limit, or for a
 * wrapped set); the set keeps making progress on conn in its later calls
 * (call again, or destroy the set, before closing conn). A consumer that is
 * gone counts as released. GPUIPC_E_NOT_FOUND when not subscribed. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_unsubscribe(gpuipc_tset *set,
                                                 gpuipc_conn *conn);

/* Each piece a subscriber holds (one per copy for an owned set, one per
 * allocation for a wrapped one) and each version it holds takes one of the
 * connection's max_outstanding slots (gpuipc_conn_options, default 256):
 * give a connection that carries a wrapped set of many allocations room
 * for them. */

/* Number of connections subscribed now (ended ones still draining
 * included). */
GPUIPC_EXPERIMENTAL GPUIPC_API size_t gpuipc_tset_get_subscribers(const gpuipc_tset *set);

/* For a caller that waits itself (an event loop; a binding that must not
 * block while it holds its own lock): create the set with a timeout of 0,
 * so that begin, unsubscribe and destroy make progress once and return
 * GPUIPC_E_TIMEOUT (destroy: GPUIPC_E_BUSY) where they would wait, and
 * wait between calls for these descriptors to become readable (POLLIN): the
 * sockets of the subscribed connections, where a consumer's release or
 * hang-up arrives. Some of what those calls wait for wakes no descriptor
 * (a release's GPU work completing, the hold limit passing): wait at most
 * a few milliseconds at a time. Writes up to max descriptors into fds
 * (NULL when max is 0) and returns how many there are, which may be more
 * than max. The descriptors belong to the connections: do not close them;
 * the list changes with each call that subscribes or drops a subscriber.
 * Not thread-safe against other calls on the set. */
GPUIPC_EXPERIMENTAL GPUIPC_API size_t gpuipc_tset_get_wait_fds(const gpuipc_tset *set, int *fds,
                                           size_t max);

/* ---- the consumer's side ------------------------------------------------- */

/* Opens a subscriber on a connection whose peer subscribes it to a set.
 * The connection stays the caller's; close the subscriber first. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_sub_open(gpuipc_conn *conn,
                                              gpuipc_tset_sub **out /* OUT */);

/* Releases every version still held (as gpuipc_tset_version_release on
 * the legacy default stream: their handles become invalid) and the
 * pieces, and frees the subscriber. NULL is a no-op. */
GPUIPC_EXPERIMENTAL GPUIPC_API void gpuipc_tset_sub_close(gpuipc_tset_sub *sub);

/* Receives the next version (waiting up to the connection's timeout, one
 * deadline for the whole call however much it skips on the way: pieces of
 * a refused layout, ENDs of layouts it never got; GPUIPC_E_TIMEOUT then;
 * GPUIPC_E_WOULD_BLOCK on a non-blocking connection when none is there
 * yet, with what arrived so far kept for the next call). A new layout's
 * table and pieces are received and validated on the way. On return the
 * work queued on `stream` after this call runs after the producer's
 * writes queued before its publish; the version's tensors are readable
 * until gpuipc_tset_version_release. GPUIPC_E_CANCELED once when the
 * producer ended the subscription (gpuipc_tset_unsubscribe, or it
 * destroyed the set, or it dropped this consumer for holding a version
 * past its hold limit: the message says which): the layout's pieces are released as soon as no
 * version held uses them, and the versions of a set the producer
 * subscribes this connection to next come with later calls (a layout
 * change). The consumer sees the end, and so releases what the producer
 * waits for, only in a call to gpuipc_tset_recv: a producer's unsubscribe
 * or destroy waits for the consumer to make that call. GPUIPC_E_PEER_GONE
 * when the producer is gone; GPUIPC_E_PROTOCOL (and the decoder's statuses: TRUNCATED,
 * BAD_MAGIC, BAD_VERSION, BAD_CHECKSUM, BAD_KIND, OUT_OF_RANGE) for a
 * refused table or a producer that does not follow docs/sets.md: nothing
 * of that layout is returned, ever; a version whose number is not above
 * the last one returned of its layout is refused (GPUIPC_E_PROTOCOL) and
 * changes nothing. A layout left half sent is abandoned when the next
 * layout's first piece comes. Needs CUDA. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_recv(gpuipc_tset_sub *sub,
                                          struct CUstream_st *stream,
                                          gpuipc_tset_version **out /* OUT */);

/* The version's number (1, 2, ... as the producer published them), its
 * layout id (changes when the producer changed sets), which copy, and its
 * number of tensors. */
GPUIPC_EXPERIMENTAL GPUIPC_API uint64_t gpuipc_tset_version_get_number(const gpuipc_tset_version *v);
GPUIPC_EXPERIMENTAL GPUIPC_API uint64_t gpuipc_tset_version_get_layout(const gpuipc_tset_version *v);
GPUIPC_EXPERIMENTAL GPUIPC_API int gpuipc_tset_version_get_copy(const gpuipc_tset_version *v);
GPUIPC_EXPERIMENTAL GPUIPC_API size_t gpuipc_tset_version_get_count(const gpuipc_tset_version *v);
/* Tensor i (in the producer's order) with its device address here
 * (zero-copy view, valid until release). Costs no driver call. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_version_get_tensor(
    const gpuipc_tset_version *v, size_t i, gpuipc_tensor *out /* OUT */);
/* The index of the tensor named `name` (a hash lookup);
 * GPUIPC_E_NOT_FOUND. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_version_find(const gpuipc_tset_version *v,
                                                  const char *name,
                                                  size_t *index /* OUT */);
/* Copies the version into the consumer's own tensors: dsts[i] is the
 * device address of tensor i's destination (same dtype, shape and strides:
 * its nbytes bytes are copied as they lie; NULL: skip it), on `stream`
 * (the stream given to recv, or one ordered after it), with adjacent
 * ranges coalesced into one copy each and the copies issued as one batch
 * where the driver has one (docs/sets.md, "Whole-set copies"). Does not
 * wait on the host: release the version on the same stream afterwards. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_version_copy_into(
    const gpuipc_tset_version *v, void *const *dsts, struct CUstream_st *stream);
/* Gives the version back: its copy may be written again by the producer
 * once the work queued on `stream` before this call completed (ordered on
 * the GPU, not waited for here). v is freed. NULL is a no-op. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_tset_version_release(gpuipc_tset_version *v,
                                                     struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_SETS_H */
