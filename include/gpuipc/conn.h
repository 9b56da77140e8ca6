/*
 * gpuipc/conn.h: connections between processes, and the per-buffer fast
 * path that hands GPU buffers over them.
 *
 * Included from gpuipc.h; do not include it on its own.
 *
 * Overview
 * --------
 * A connection (gpuipc_conn) is a Unix-domain stream socket between two
 * processes of one machine. It is made by name (gpuipc_listen + gpuipc_accept
 * on one side, gpuipc_connect on the other) or as a connected pair for a
 * parent and the child it starts (gpuipc_conn_pair + gpuipc_conn_from_fd).
 * When it is made, each side checks the other's credentials (SO_PEERCRED and
 * kernel-verified SCM_CREDENTIALS): by default the peer must run under the
 * same uid; an allow-list of uids and gids widens that.
 *
 * A connection carries:
 *  - small user messages with file descriptors (gpuipc_conn_send_msg /
 *    gpuipc_conn_recv_msg), for an application's own protocol;
 *  - GPU buffers, the reason the library exists (gpuipc_conn_send /
 *    gpuipc_conn_recv / gpuipc_conn_release).
 *
 * The rule: a peer, however hostile, can neither crash this process, make
 * it read or map memory that was not exported to it, stall work that does
 * not involve that peer, exhaust its memory or file descriptors, nor make
 * any call wait past its timeout. What makes it so on the transport:
 *  - Everything a peer sends is validated before use (frame header with
 *    check, length <= GPUIPC_CONN_MSG_MAX + 1024, known type, descriptors
 *    that match the header); anything else disconnects that peer only
 *    (GPUIPC_E_PROTOCOL), and nothing of it is kept.
 *  - What one connection holds for its peer is bounded: the receive
 *    buffer (one frame plus one read, about 130 KiB), descriptors that
 *    came ahead of their frame (64), user messages not yet taken
 *    (GPUIPC_CONN_QUEUE_MSGS / _BYTES / _FDS, then backpressure: the
 *    socket is not read further), frames queued for a peer that does not
 *    read (8 MiB, then sends time out; frames with descriptors are never
 *    queued), and buffers outstanding (max_outstanding).
 *  - A listener holds at most GPUIPC_CONN_HANDSHAKES_MAX peers in their
 *    handshake, each for at most handshake_timeout_ms, run concurrently:
 *    silent or slow peers delay no other.
 *  - Every call that waits on a peer is bounded by the connection's
 *    timeout (or, in gpuipc_accept, the handshake's own deadline); none
 *    waits on another connection.
 *  - Running out of a resource of our own (file descriptors, memory) ends
 *    only the connection that needed it, with a status that says so
 *    (GPUIPC_E_LIMIT, GPUIPC_E_NO_MEMORY), never a torn stream.
 *  - Received file descriptors are close-on-exec and never leak: those
 *    beyond what a frame declares are closed; buffers that arrive by
 *    descriptor are opened by the handle layer, which treats every
 *    descriptor as hostile input (docs/descriptor.md).
 * The number of connections is the application's to bound (it decides
 * whom it accepts); each costs at most the bounds above.
 *
 * The fast path. Importing GPU memory into another process costs tens to
 * hundreds of microseconds per driver call (pool import ~170 us, pointer
 * export ~50 us, legacy open ~47 us). gpuipc pays those once: an exporter
 * owns an arena (gpuipc_arena, one IPC-capable allocation, or a few as it
 * grows), exported to each connection once, the first time a block of it is
 * sent there; the consumer imports it once. Buffers are blocks
 * (gpuipc_block) sub-allocated from the arena; sending one costs one small
 * message (arena id, offset, length, sequence number, user metadata) and no
 * driver export/import call.
 *
 * Buffers outside arenas (any gpuipc_buffer: pool, VMM, legacy, wrapped)
 * travel too, by descriptor (gpuipc_conn_send_buffer), at the cost of the
 * handle layer's export and import cache.
 *
 * Stream ordering. gpuipc_conn_send(conn, block, stream) enqueues, on the
 * producer's stream, a write of a sequence number into a flag word in device
 * memory both processes map (cuStreamWriteValue64; the words live in a small
 * per-device VMM arena of gpuipc's, because the driver refuses stream memory
 * operations on pool memory); gpuipc_conn_recv(conn,
 * stream) enqueues on the consumer's stream a wait for that value
 * (cuStreamWaitValue64). So the consumer's later work on its stream runs
 * after the producer's work queued before the send, and neither host blocks.
 * gpuipc_conn_release(conn, id, stream) does the reverse with a second flag
 * word: the memory of a block the producer freed is handed out again (by
 * gpuipc_arena_alloc) only after every consumer released it AND the GPU work
 * each consumer queued before its release has completed.
 * Passing the legacy default stream (NULL) works the same; gpuipc then puts
 * its flag-word operations on a private non-blocking stream joined to the
 * legacy stream by events, because a flag-word wait on the legacy stream
 * itself would also stall every blocking stream of the context (and the
 * synchronous driver calls that run on it) until the peer acts.
 *
 * Leases. The exporter tracks, per connection, which blocks the peer holds
 * (gpuipc_conn_get_outstanding, gpuipc_arena_stats). gpuipc_block_free of a
 * block that peers hold defers the real free until their releases.
 *
 * Peer death. If a consumer dies (crash, kill -9), the exporter sees its
 * connection close (in any call that makes progress on it) and reclaims
 * everything the consumer held once the process is gone (the whole
 * process: gpuipc watches a pidfd of the peer taken at the handshake; a
 * process whose main thread exited while other threads run still counts): a dead process's
 * GPU work is torn down with its context, so nothing can still read the
 * memory. If the exporter dies, the consumer's next call on the connection
 * returns GPUIPC_E_PEER_GONE; the buffers it holds stay mapped and readable
 * (with whatever data they last had) until released; and any of the
 * consumer's streams that wait on a flag word the dead exporter will never
 * write are unblocked (gpuipc writes the awaited values into its own mapping
 * of the flag words), so nothing hangs: the data such a stream then reads is
 * undefined, which the GPUIPC_E_PEER_GONE status tells the application.
 * (In GPUIPC_ORDER_EVENT mode this unblocking is not possible on a real
 * driver: see the limit documented there.)
 *
 * Progress. Incoming frames (buffers, releases, arena exports, user
 * messages) are read, and a dead peer is noticed, inside every call on
 * the connection and in gpuipc_conn_progress; besides, by default, one
 * watcher thread of gpuipc per process sleeps on the peers' pidfds and,
 * when a peer's process exits, unblocks our streams that wait for its
 * flag words without any call (gpuipc_conn_options.watch_peer). With
 * watch_peer = 0 there is no thread: after an exporter died, a consumer
 * that synchronizes a stream waiting for one of its buffers before making
 * any gpuipc call blocks until some thread makes one (that call unblocks
 * the stream). An event loop polls gpuipc_conn_get_fd() for POLLIN and
 * calls gpuipc_conn_progress (or recv) when it is readable. An exporter that only sends must still make progress now
 * and then (send does, too), or releases pile up in the socket.
 *
 * Carriers. By default (GPUIPC_CARRIER_AUTO), where both sides offer it,
 * a connection carries its buffers and releases through a shared-memory
 * ring per direction beside the socket (a sealed memfd each side makes at
 * the handshake and the other maps read-only, checked as hostile input
 * like everything a peer sends); everything else, and whatever does not
 * fit the ring at the moment, goes on the socket, in one order. Choose
 * with gpuipc_conn_options.carrier (GPUIPC_CARRIER_SOCKET: the socket
 * only; GPUIPC_CARRIER_RING: refuse a peer without the ring), or for AUTO
 * the environment variable GPUIPC_CARRIER (auto, socket, ring). Either
 * way gpuipc_conn_get_fd stays the one fd to poll: a buffer sent over the
 * ring to a peer that may be asleep on that fd comes with a small wake-up
 * frame on the socket, so an event loop works unchanged. A consumer that
 * calls recv (or progress) often and never sleeps on the fd may say so
 * with gpuipc_conn_set_polling: its peer then sends no wake-up, and a
 * buffer reaches it in about the ring's latency. It must switch polling
 * off before it sleeps on the fd again. spin_us makes a call that waits
 * look at the ring for a while before it sleeps. docs/ring.md says how.
 *
 * Backpressure. A connection holds at most GPUIPC_CONN_QUEUE_MSGS /
 * _BYTES / _FDS of user messages received and not yet taken (settable in
 * gpuipc_conn_options). When the next message does not fit, the connection
 * stops reading its socket until the application takes messages with
 * gpuipc_conn_recv_msg: everything behind that message (buffers, releases,
 * the peer's departure) waits in the kernel's socket buffer, and the
 * peer's sends wait, time out or return GPUIPC_E_WOULD_BLOCK. Meanwhile a
 * call that needs something from behind the held messages
 * (gpuipc_conn_recv, a send waiting for a free slot) returns GPUIPC_E_BUSY
 * at once rather than wait out its timeout, gpuipc_conn_progress returns
 * GPUIPC_OK having read nothing, and the socket stays readable for poll:
 * an application that accepts user messages must take them.
 *
 * Timeouts. Every call that can wait takes its limit from the connection's
 * timeout (gpuipc_conn_options.timeout_ms, gpuipc_conn_set_timeout): -1
 * waits forever, 0 never waits. A connection in non-blocking mode never
 * waits: a call that would returns GPUIPC_E_WOULD_BLOCK and has done
 * nothing.
 *
 * Threads. A gpuipc_conn, gpuipc_listener, gpuipc_arena and its blocks may
 * be used from any thread, but only from one at a time per object (no
 * internal locking on the fast path); a connection and the arena it sends
 * from must be used under the same lock when threads share them.
 * Different connections are independent. One exception: gpuipc_conn_wait
 * may run in a second thread beside the calls of the first, which is how
 * a binding waits without holding its own lock.
 *
 * Security. Who may connect is decided by the credential check (and, for
 * socket files, by the 0700 runtime directory). What a peer may touch: a
 * consumer maps whole arena chunks (that is what makes a buffer cost one
 * message), so it can read and write every block of the chunks it was
 * sent, not only the blocks it holds; and it can stall the reuse of the
 * blocks it holds by never releasing them, or by announcing releases its
 * GPU never writes (until it exits). Only those: each connection orders
 * reuse after its peer's releases on a stream of its own, so one peer's
 * missing release never holds back memory that other peers, or nobody,
 * held. (Memory a peer holds back this way is handed out again, ordered
 * after that peer's release on the caller's stream, only when nothing
 * else fits and the arena cannot grow.) Feed one arena only to
 * peers that may see each other's data; use separate arenas otherwise.
 *
 * Limits of this version: one device per connection (blocks sent on a
 * connection must all live on the device of the first).
 *
 * Errors on a connection. A peer that sends something that is not a valid
 * frame (bad magic or version, a length over the maximum, an unknown type, a
 * truncated frame, file descriptors that do not match the header) is
 * disconnected: the call returns GPUIPC_E_PROTOCOL with the reason, the
 * socket is closed, and later calls return GPUIPC_E_CLOSED. Nothing else in
 * the process is disturbed.
 */
#ifndef GPUIPC_CONN_H
#define GPUIPC_CONN_H

#include <poll.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* CUstream / cudaStream_t; NULL = legacy default stream */

typedef struct gpuipc_listener gpuipc_listener;
typedef struct gpuipc_conn gpuipc_conn;
typedef struct gpuipc_arena gpuipc_arena;
typedef struct gpuipc_block gpuipc_block;

/* Largest user message (gpuipc_conn_send_msg), in bytes. */
#define GPUIPC_CONN_MSG_MAX 65536
/* Most file descriptors in one user message. */
#define GPUIPC_CONN_FDS_MAX 16
/* Largest user metadata that travels with one buffer (shape, dtype, a
 * request id...), in bytes. */
#define GPUIPC_META_MAX 256
/* Most buffers in one batch (gpuipc_conn_send_batch,
 * gpuipc_conn_release_batch). */
#define GPUIPC_BATCH_MAX 1024
/* A batch travels as one frame: 48 bytes per buffer plus all their
 * metadata must stay within this many bytes. */
#define GPUIPC_BATCH_BYTES_MAX 65536
/* Most connections one gpuipc_conn_broadcast sends to. */
#define GPUIPC_BROADCAST_MAX 1024
/* Longest connection name (without the runtime directory). */
#define GPUIPC_CONN_NAME_MAX 80

/* What one connection holds of user messages received and not yet taken
 * (gpuipc_conn_recv_msg), by default: messages, payload bytes, and file
 * descriptors that came with them. When the next message would pass a
 * bound, the connection stops reading its socket (backpressure): frames
 * stay in the kernel's socket buffer, and the sender's calls wait, time
 * out or return GPUIPC_E_WOULD_BLOCK as for any peer that does not read.
 * A message is always taken into an empty queue. Settable per connection
 * (gpuipc_conn_options.queue_*, up to the _CAP values). */
#define GPUIPC_CONN_QUEUE_MSGS 1024
#define GPUIPC_CONN_QUEUE_BYTES ((size_t)4 << 20)
#define GPUIPC_CONN_QUEUE_FDS 128
#define GPUIPC_CONN_QUEUE_MSGS_CAP (1u << 20)
#define GPUIPC_CONN_QUEUE_BYTES_CAP ((size_t)1 << 30)
#define GPUIPC_CONN_QUEUE_FDS_CAP 65536u

/* A listener runs the handshakes of the peers it accepted concurrently,
 * each bounded by its own deadline (gpuipc_conn_options.
 * handshake_timeout_ms, default below: how long a peer may take to send
 * its HELLO once taken off the listening socket, and its ACCEPT once sent
 * ours), whatever the timeout of gpuipc_accept itself. At most GPUIPC_CONN_HANDSHAKES_MAX handshakes are pending at once;
 * a new peer beyond that makes the oldest pending one be dropped, so that
 * peers that connect and stay silent can neither hold descriptors without
 * bound nor keep an honest peer out. */
#define GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS 5000
#define GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS_CAP 600000
#define GPUIPC_CONN_HANDSHAKES_MAX 64

/* How the consumer's GPU work is ordered after the producer's. */
typedef enum gpuipc_order_mode {
  /* Stream memory operations on flag words in shared device memory
   * (cuStreamWriteValue64 / cuStreamWaitValue64): about a microsecond per
   * buffer on each side; no host synchronization. The default. */
  GPUIPC_ORDER_MEMOP = 0,
  /* No GPU ordering: the producer promises its work on the buffer is
   * complete before send (e.g. it synchronized), and the consumer that its
   * work is complete before release. For host-side pipelines and tests. */
  GPUIPC_ORDER_NONE = 1,
  /* Interprocess CUDA events (cuIpcGetEventHandle): one event per slot and
   * direction, exported once (the first time the slot is used), then per
   * buffer a cuEventRecord on the sending side and a cuStreamWaitEvent on
   * the receiving side. For interop with code that speaks only events;
   * slower than MEMOP (an interprocess event wait costs more on the GPU).
   * Limit: if the producer dies before the GPU work ahead of its record
   * ran, a consumer stream that already waits on that record (every
   * stream passed to gpuipc_conn_recv for such a buffer) stays blocked for
   * the life of the process: a stream wait captures the record current
   * when it was enqueued, and no later record (gpuipc records the event
   * itself, which helps only on drivers that track an event as one
   * completion state) releases it. gpuipc still never hangs: calls on
   * the connection return GPUIPC_E_PEER_GONE, release works, and
   * gpuipc_conn_close then neither synchronizes the device nor unmaps the
   * peer's memory (it stays mapped, leaked). Do not synchronize such
   * streams (or the context); use MEMOP where producers may die. */
  GPUIPC_ORDER_EVENT = 2
} gpuipc_order_mode;

/* Options of a connection (and of a listener: connections it accepts take
 * them). Read only `size` bytes. */
typedef struct gpuipc_conn_options {
  size_t size;
  /* Limit for every call that waits, in milliseconds; -1: forever. Default
   * 10000. */
  int timeout_ms;
  /* Nonzero: calls never wait (GPUIPC_E_WOULD_BLOCK instead). Default 0. */
  int nonblocking;
  /* Nonzero: the name is an abstract socket name (Linux; no file, no
   * directory; access is governed by the credential check alone). Default
   * 0: a socket file in the runtime directory. */
  int abstract_name;
  /* Directory for socket files. NULL: $XDG_RUNTIME_DIR/gpuipc when
   * XDG_RUNTIME_DIR is set, else /tmp/gpuipc-UID. gpuipc creates it with
   * mode 0700 and refuses it (GPUIPC_E_PERMISSION) if it exists but is not a
   * directory owned by this uid with mode 0700. */
  const char *runtime_dir;
  /* Who may be on the other end. The peer is accepted when its uid equals
   * ours, or is listed in allow_uids, or its primary gid is listed in
   * allow_gids. The arrays are copied. */
  const uint32_t *allow_uids;
  size_t n_allow_uids;
  const uint32_t *allow_gids;
  size_t n_allow_gids;
  /* Buffers one side may have outstanding (sent, not yet released) on this
   * connection. Default 256; at most 65536. Each costs 16 bytes of device
   * memory (flag words, in a small per-device arena gpuipc keeps for the
   * life of the process). */
  uint32_t max_outstanding;
  /* GPU ordering of handed-over buffers. Default GPUIPC_ORDER_MEMOP. */
  gpuipc_order_mode order;
  /* Bounds of the queue of received user messages not yet taken (see
   * GPUIPC_CONN_QUEUE_MSGS): messages, file descriptors, payload bytes.
   * 0: the default; at most the _CAP values. */
  uint32_t queue_msgs;
  uint32_t queue_fds;
  size_t queue_bytes;
  /* Listener: how long each accepted peer has to complete its handshake
   * (ms, 1 to GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS_CAP). 0: the default,
   * GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS. */
  int handshake_timeout_ms;
  /* Ignored: where watch_peer was while the watcher had to be asked for
   * (nonzero). A caller built against that header (its `size` ends here)
   * gets the default of the field below, whatever it wrote here: its 0
   * meant "the default", not "no thread". */
  int watch_peer_v0;
  /* Whether a thread of gpuipc watches the peer process. Default 1
   * (GPUIPC_CONN_OPTIONS_INIT, and for every caller whose `size` ends
   * before this field): one thread for the whole process, started by the
   * first connection and ended when none is left, sleeps in poll on the
   * pidfds of the connections' peers (it holds no descriptor of its own;
   * it looks at the list again every 100 ms). When a peer's process exits
   * it writes the flag words our streams may wait for (as the next call on
   * the connection would), so a stream that waits for a dead exporter's
   * buffer runs on, and a cuStreamSynchronize returns, within a moment of
   * the exit and without any gpuipc call. Calls on the connection stay
   * the application's (the watcher changes nothing else). Costs: per
   * connection, a list entry (added at the handshake, removed at the
   * close); per buffer, nothing but one atomic store on each side (where
   * the fast path publishes its newest sequence number).
   * Where the peer has no pidfd (Linux older than 5.3; a peer of a pid
   * namespace this process cannot see, on a kernel without SO_PEERPIDFD)
   * nothing is watched and the connection works as with 0. If the thread
   * cannot be started (logged), the next connection tries again.
   * 0: no thread (for processes that must not have one): no background
   * progress (see "Progress"). */
  int watch_peer;
  /* What carries the frames (see "Carriers"): GPUIPC_CARRIER_AUTO (the
   * default: a shared-memory ring beside the socket where the peer
   * supports it, else the socket alone), GPUIPC_CARRIER_SOCKET, or
   * GPUIPC_CARRIER_RING (a peer without the ring is refused). AUTO defers
   * to the environment variable GPUIPC_CARRIER (auto, socket, ring). */
  int carrier;
  /* Ring carrier: a call that waits looks at the ring for up to this many
   * microseconds (the peer then needs to send no wake-up) before it sleeps
   * in poll(). Default 0: sleeps at once. At most 1000000. */
  int spin_us;
  /* Ring carrier: as gpuipc_conn_set_polling. Default 0. */
  int polling;
} gpuipc_conn_options;

/* gpuipc_conn_options.carrier */
#define GPUIPC_CARRIER_AUTO 0
#define GPUIPC_CARRIER_SOCKET 1
#define GPUIPC_CARRIER_RING 2

#define GPUIPC_CONN_OPTIONS_INIT                                               \
  {sizeof(gpuipc_conn_options), 10000, 0, 0, NULL, NULL, 0, NULL, 0, 256,      \
   GPUIPC_ORDER_MEMOP, GPUIPC_CONN_QUEUE_MSGS, GPUIPC_CONN_QUEUE_FDS,          \
   GPUIPC_CONN_QUEUE_BYTES, GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS, 0, 1,           \
   GPUIPC_CARRIER_AUTO, 0, 0}

/* ------------------------------------------------------------------------ */
/* Making connections                                                        */
/* ------------------------------------------------------------------------ */

/* Listens on `name` (letters, digits, '.', '_', '-'; at most
 * GPUIPC_CONN_NAME_MAX bytes). Creates the runtime directory when needed. A
 * stale socket file of a dead listener is replaced; a live one makes this
 * fail with GPUIPC_E_EXISTS. For a socket file, the listener holds a lock
 * (flock on "<name>.lock" beside it) for its life, and only the lock's
 * holder replaces a stale socket file: of processes listening on one name
 * at once, exactly one succeeds, the others get GPUIPC_E_EXISTS. opts may
 * be NULL. On success *out owns the
 * socket; close it with gpuipc_listener_close. Needs no CUDA. */
GPUIPC_API gpuipc_status gpuipc_listen(const char *name,
                                       const gpuipc_conn_options *opts,
                                       gpuipc_listener **out /* OUT */);

/* Accepts one connection: waits (up to the listener's timeout; never in
 * non-blocking mode: GPUIPC_E_WOULD_BLOCK) until a peer has completed its
 * handshake, and returns it. The handshakes of all peers that connected
 * proceed concurrently, each bounded by handshake_timeout_ms (see
 * GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS): a peer that stays silent is dropped
 * when its own deadline passes and delays no other, and one that has
 * completed is returned whatever the others do (pending handshakes carry
 * over to the next call). A refused peer is logged, told why and
 * disconnected, and this returns GPUIPC_E_PEER_REFUSED (the listener stays
 * usable). Other failures of one peer (garbage) return GPUIPC_E_PROTOCOL
 * and leave the listener usable; a peer that left during its handshake is
 * skipped. Connections accepted in non-blocking mode are non-blocking. */
GPUIPC_API gpuipc_status gpuipc_accept(gpuipc_listener *l,
                                       gpuipc_conn **out /* OUT */);

/* A descriptor for poll/epoll (an epoll set of the listening socket and of
 * the pending handshakes): POLLIN means gpuipc_accept has something to do
 * (a new peer, or a handshake that can move on). Do not read it yourself. */
GPUIPC_API int gpuipc_listener_get_fd(const gpuipc_listener *l);
/* The socket's path ("@name" for an abstract name). Owned by l. */
GPUIPC_API const char *gpuipc_listener_get_path(const gpuipc_listener *l);
/* Stops listening, removes the socket file. Connections already accepted
 * stay open. NULL is a no-op. */
GPUIPC_API void gpuipc_listener_close(gpuipc_listener *l);

/* Connects to the listener named `name` (resolved as gpuipc_listen does,
 * with the same opts->runtime_dir / abstract_name). Checks the listener's
 * credentials too. Returns GPUIPC_E_NOT_FOUND when nobody listens there,
 * GPUIPC_E_PEER_REFUSED when either side refused the other, GPUIPC_E_TIMEOUT.
 * Needs no CUDA. */
GPUIPC_API gpuipc_status gpuipc_connect(const char *name,
                                        const gpuipc_conn_options *opts,
                                        gpuipc_conn **out /* OUT */);

/* A connected pair of sockets for a parent and the child it starts: give
 * fds[1] to the child (it must survive exec: the pair is created
 * close-on-exec, so clear FD_CLOEXEC on it, or dup2 it in posix_spawn file
 * actions) and close it in the parent; each side then calls
 * gpuipc_conn_from_fd on its end. */
GPUIPC_API gpuipc_status gpuipc_conn_pair(int fds[2] /* OUT */);

/* Makes a connection of a connected Unix stream socket (one end of
 * gpuipc_conn_pair, or any connected AF_UNIX SOCK_STREAM socket): performs
 * the handshake and credential check. Takes ownership of fd, also on
 * failure. */
GPUIPC_API gpuipc_status gpuipc_conn_from_fd(int fd,
                                             const gpuipc_conn_options *opts,
                                             gpuipc_conn **out /* OUT */);

/* Closes a connection. Buffers this side still holds are released as
 * gpuipc_conn_release(conn, id, NULL) would (ordered after work on the
 * legacy default stream and streams that synchronize with it; release
 * explicitly on your own streams before closing to be exact), the peer is
 * told, and the memory imported through the connection is unmapped.
 * First, streams of ours that wait for the peer's ready words are
 * unblocked (gpuipc writes the awaited values itself; work queued after a
 * recv whose producer had not finished then reads undefined data). Before
 * unmapping, close waits for the GPU work gpuipc queued (on the streams
 * releases were written on, and its own), up to the connection's timeout
 * (1 s when it is 0); work that does not complete by then leaves the
 * imported memory mapped (with a warning) rather than unmapped under it,
 * until a later close or progress call of any connection finds that work
 * completed, or the peer's process gone (a peer whose broadcast word never
 * comes holds its own memory mapped here only while it lives). In GPUIPC_ORDER_EVENT mode, when the exporter died with an
 * event record pending, close does not wait and leaves the imported memory
 * mapped. Buffers the peer holds from us stay leased; they are reclaimed
 * when the peer process is gone (we can no longer hear its releases).
 * NULL is a no-op. */
GPUIPC_API void gpuipc_conn_close(gpuipc_conn *conn);

/* Finishes now what connections closed here still keep, without waiting:
 * the lease tables of peers whose processes are gone (their leases come
 * back, and the done callbacks of buffers handed over with
 * gpuipc_buffer_release_when_done run here, in this thread) or that
 * released everything, and the imports a close left mapped whose GPU work
 * completed. The peer watcher does the same on its own when such a peer's
 * process exits, and connection and arena calls now and then; this call is
 * for an application without the watcher (watch_peer = 0, or a kernel
 * without pidfds) or one that wants it done at a given point. Returns how
 * many closed connections still keep something (their peers live and
 * still hold leases, or their work is still queued). Thread-safe. */
GPUIPC_EXPERIMENTAL GPUIPC_API size_t gpuipc_conn_collect(void);

/* Calls done(ctx) exactly once, when the process of conn's peer is gone:
 * inside this call when it is gone already, else in the peer watcher
 * thread ("gpuipc-watch") once the kernel says it exited. The peer is the
 * process the handshake vouched for (its pidfd, taken then), also one in
 * a pid namespace this process cannot see, whose pid reads 0 here; a
 * process that merely closed the connection, or whose main thread ended
 * while others run, is not gone. It holds after gpuipc_conn_close: the
 * call needs conn only while it runs. For what an application keeps on a
 * peer's behalf outside the connection's leases (memory whose descriptor
 * the peer opened on its own, say), so that no binding decides a peer's
 * death itself. A process that cannot start the watcher thread (logged)
 * has them run by gpuipc_conn_collect. A child forked after the call
 * runs none of them (they are the parent's). done runs as
 * gpuipc_buffer_release_when_done's does: no
 * lock or CUDA context of gpuipc's held, and it must not call gpuipc,
 * block on anything a thread calling gpuipc may hold (an interpreter
 * lock) or take long. Calls whose peer never exits never run (nor at this
 * process's exit). GPUIPC_E_NOT_SUPPORTED when the peer's exit cannot be
 * told here (no pidfd of it: a kernel without pidfds); GPUIPC_E_INVALID_ARG
 * for NULL conn or done, or a connection without a peer: nothing is
 * registered then. Thread-safe. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_conn_call_when_peer_exits(
    gpuipc_conn *conn, void (*done)(void *ctx), void *ctx);

/* The socket, for poll/epoll: POLLIN means a call to gpuipc_conn_progress or
 * recv will find something (or learn the peer is gone). Do not read or write
 * it yourself. Valid until gpuipc_conn_close (-1 after a disconnect). */
GPUIPC_API int gpuipc_conn_get_fd(const gpuipc_conn *conn);

/* The wait rule: one loop for every binding and event loop that makes its
 * calls non-blocking (gpuipc_conn_set_nonblocking) and waits between them.
 *
 *   for (;;) {
 *     st = <the call>;                           // e.g. gpuipc_conn_recv
 *     if (st != GPUIPC_E_WOULD_BLOCK) break;
 *     st = gpuipc_conn_wait(conn, POLLIN, <time left>, -1);
 *     if (st != GPUIPC_OK) break;                // GPUIPC_E_TIMEOUT
 *   }
 *
 * Waits until a call on the connection may make progress: for POLLIN
 * (also when events is 0), a frame arrived on the ring or the socket, or
 * the peer hung up; for POLLOUT, the socket has room (ask for it when a
 * send returned GPUIPC_E_WOULD_BLOCK for want of room; a send waiting for
 * a release wants POLLIN). It reads nothing, so the next call does the
 * work and says what came (GPUIPC_OK here only means "call again"). On
 * the ring carrier it first looks at the ring without sleeping for
 * spin_us microseconds (-1: the connection's option spin_us; 0: no
 * spin), awake (the peer need not wake it), then sleeps on the socket
 * with its sleep word set, so a record published meanwhile brings a
 * wake-up frame; on the socket carrier a spin polls the socket without a
 * timeout. timeout_ms: -1 forever, 0 look once. Returns GPUIPC_OK,
 * GPUIPC_E_TIMEOUT, or GPUIPC_E_INVALID_ARG for events other than
 * POLLIN|POLLOUT or a timeout or spin below -1. A signal does not end
 * the wait: a binding that must handle signals waits in slices.
 *
 * Thread: the one call that may run beside the calls of another thread
 * on the same connection (e.g. waiters without the binding's lock while
 * another thread sends), in any number of threads at once: a record or
 * frame that arrives wakes at least one of them (each then calls again,
 * and the calls, one thread at a time, say who got it). But a call reads
 * whatever has arrived, so what a call of the other thread took in first
 * (a send also reads the peer's frames) is in the connection, where no
 * waiter sees it: a waiter then sleeps on until the next arrival or its
 * timeout. Threads that wait while others make calls wait in slices (the
 * Python package: 50 ms) or are woken by the application. Not beside
 * gpuipc_conn_close. An event loop that
 * waits in its own poll uses gpuipc_conn_get_fd (POLLIN, plus POLLOUT
 * after a send said it would block) instead. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_conn_wait(gpuipc_conn *conn, short events,
                                          int timeout_ms, int spin_us);

/* Sets the timeout of later calls (ms; -1 forever, 0 never wait). */
GPUIPC_API gpuipc_status gpuipc_conn_set_timeout(gpuipc_conn *conn,
                                                 int timeout_ms);
/* Switches non-blocking mode on (nonzero) or off. */
GPUIPC_API gpuipc_status gpuipc_conn_set_nonblocking(gpuipc_conn *conn,
                                                     int nonblocking);
/* Ring carrier: nonzero says the application calls into this connection
 * (recv, progress, a send) often and does not sleep on gpuipc_conn_get_fd
 * while polling is on; then the peer sends no wake-up message with its
 * buffers, and a buffer reaches a polling consumer in about the ring's
 * one-way latency. Switch it off before sleeping on the fd: while it is on,
 * a buffer the peer sends makes the fd readable only at the next call.
 * Calls that wait inside gpuipc sleep safely either way. Default off. No
 * effect on the socket carrier. */
GPUIPC_API gpuipc_status gpuipc_conn_set_polling(gpuipc_conn *conn,
                                                 int polling);

/* Who is on the other end, as the kernel vouched for it at handshake. pid
 * is the peer's pid as this process sees it: 0 when the peer lives in a
 * pid namespace this one cannot see (another container); the connection
 * then follows the peer by the pidfd the kernel gave of it. */
typedef struct gpuipc_peer_info {
  int pid;
  uint32_t uid;
  uint32_t gid;
} gpuipc_peer_info;
GPUIPC_API gpuipc_status gpuipc_conn_get_peer(const gpuipc_conn *conn,
                                          gpuipc_peer_info *info /* OUT */);

/* Makes progress without waiting longer than timeout_ms (-1: until
 * something arrives; 0: only what is there): sends what is queued, reads and
 * handles incoming frames (releases, arena exports, peer departure), and
 * reclaims what a dead peer held. Returns GPUIPC_OK (also when nothing
 * arrived), GPUIPC_E_PEER_GONE once the peer is gone (after the cleanup),
 * GPUIPC_E_CLOSED on a connection that was disconnected earlier,
 * GPUIPC_E_PROTOCOL when the peer sent garbage (now disconnected). */
GPUIPC_API gpuipc_status gpuipc_conn_progress(gpuipc_conn *conn,
                                              int timeout_ms);

/* ------------------------------------------------------------------------ */
/* User messages                                                             */
/* ------------------------------------------------------------------------ */

/* Sends a message of len bytes (<= GPUIPC_CONN_MSG_MAX) with nfds file
 * descriptors (<= GPUIPC_CONN_FDS_MAX; the caller keeps its own copies).
 * Messages arrive whole and in order, interleaved with buffers in send
 * order. GPUIPC_E_TIMEOUT / GPUIPC_E_WOULD_BLOCK when the socket stays full
 * (then nothing was sent), GPUIPC_E_PEER_GONE. */
GPUIPC_API gpuipc_status gpuipc_conn_send_msg(gpuipc_conn *conn,
                                              const void *data, size_t len,
                                              const int *fds, int nfds);

/* Receives the next user message into buf (cap bytes); *len gets its size.
 * Received descriptors (close-on-exec) go to fds (capacity *nfds on entry,
 * the number received on return); fds and nfds may be NULL when none are
 * expected: surplus descriptors are closed. A message longer than cap is
 * consumed and GPUIPC_E_TRUNCATED returned with *len the full size.
 * Buffers that arrive meanwhile are queued for gpuipc_conn_recv. Waits up
 * to the timeout: GPUIPC_E_TIMEOUT, GPUIPC_E_WOULD_BLOCK, GPUIPC_E_PEER_GONE.
 * Taking a message makes room in the bounded queue (see Backpressure). */
GPUIPC_API gpuipc_status gpuipc_conn_recv_msg(gpuipc_conn *conn, void *buf,
                                              size_t cap, size_t *len /* OUT */,
                                              int *fds /* OUT */,
                                              int *nfds /* IN/OUT */);

/* Imports a buffer descriptor that came over this connection from its
 * peer (in a user message, with its fds): the same as
 * gpuipc_buffer_import(), except that a descriptor the peer exported is
 * checked against the liveness table the peer passed at the handshake
 * (so a freed buffer is GPUIPC_E_STALE even where the two processes share
 * no /dev/shm), and is accepted from another pid namespace (another
 * container) when its kind travels by fd (MEMPOOL, VMM, PINNED_HOST).
 * Legacy handles from another pid namespace are refused
 * (GPUIPC_E_FOREIGN_NAMESPACE, saying why: the driver opens them by the
 * exporter's pid). Descriptors of third processes are checked as
 * gpuipc_buffer_import() checks them. */
GPUIPC_API gpuipc_status gpuipc_conn_import_buffer(
    gpuipc_conn *conn, const uint8_t *desc, size_t len, const int *fds,
    int nfds, const gpuipc_import_options *opts, gpuipc_buffer **out /* OUT */);

/* ------------------------------------------------------------------------ */
/* Arenas and blocks (the exporter's side)                                   */
/* ------------------------------------------------------------------------ */

typedef struct gpuipc_arena_options {
  size_t size;
  /* The device, by UUID (gpuipc_device_uuid gives a local device's);
   * NULL: local device 0. Default NULL. Only read during
   * gpuipc_arena_create. */
  const gpuipc_uuid *device;
  /* Bytes of the first chunk; the arena grows by chunks of this size (or
   * the size of a larger request) up to max_bytes. Default 64 MiB. */
  size_t chunk_bytes;
  /* Upper bound of all chunks together; 0: no bound but device memory.
   * Default 0. */
  size_t max_bytes;
} gpuipc_arena_options;

#define GPUIPC_ARENA_OPTIONS_INIT                                              \
  {sizeof(gpuipc_arena_options), NULL, (size_t)64 << 20, 0}

/* Creates an arena and allocates its first chunk of IPC-capable device
 * memory (a stream-ordered memory pool with POSIX file-descriptor export;
 * a chunk above 4 GiB is VMM memory instead, where the device has VMM:
 * another process could not import a pool allocation of 6 GiB on an H200,
 * docs/driver-behaviour.md).
 * Needs CUDA. The arena may feed any number of connections. */
GPUIPC_API gpuipc_status gpuipc_arena_create(const gpuipc_arena_options *opts,
                                             gpuipc_arena **out /* OUT */);

/* Destroys an arena. Fails with GPUIPC_E_BUSY (and does nothing) while
 * blocks are allocated or held by peers (free them, and let peers release
 * them, first). Memory that peers released is freed only once their GPUs
 * wrote the releases (and the owner's work queued before its frees
 * completed): destroy waits for that up to 2 seconds, never longer, then
 * fails with GPUIPC_E_BUSY (a peer that announced a release its GPU never
 * writes; try again later: once that peer's process is gone it no longer
 * counts). Connections that carried its blocks may stay open. NULL is a
 * no-op. */
GPUIPC_API gpuipc_status gpuipc_arena_destroy(gpuipc_arena *arena);

/* Destroy when drained: gives the arena up. It is destroyed now when
 * gpuipc_arena_destroy would succeed without waiting; otherwise gpuipc
 * keeps it and destroys it once it has drained: every block allocated
 * from it freed (the caller may still free the blocks it has, with
 * gpuipc_block_free; nothing else of the arena may be called) and given
 * back by the peers that held it (released, or their processes gone, also
 * after their connections closed), and the GPU work its reuse waits for
 * completed. The check runs where blocks come back, without waiting: in
 * calls on connections and arenas, gpuipc_block_free, gpuipc_conn_collect,
 * and the peer watcher when a peer holding blocks exits. From the call
 * on, the arena is gpuipc's (do not allocate from it, read its statistics
 * or destroy it). GPUIPC_OK when it was destroyed or kept; another status
 * (a driver error; nothing changed, the arena is still the caller's)
 * otherwise. NULL is a no-op. Thread-safe. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_arena_release(gpuipc_arena *arena);

/* Allocates a block of `bytes` (rounded up to 256) from the arena. Memory
 * that was held by consumers is handed out again only once their releases
 * arrived; if their GPU work may still be running, the allocation is
 * ordered after it on `stream` (stream-ordered, like cuMemAllocFromPoolAsync:
 * use the block on that stream, or order other streams after it). Grows the
 * arena by a chunk when nothing fits (new chunks are exported to each
 * connection the next time a block of them is sent there). Returns
 * GPUIPC_E_OUT_OF_DEVICE_MEMORY when max_bytes or the device is
 * exhausted. The block is owned by the caller until gpuipc_block_free. */
GPUIPC_API gpuipc_status gpuipc_arena_alloc(gpuipc_arena *arena, size_t bytes,
                                            struct CUstream_st *stream,
                                            gpuipc_block **out /* OUT */);

/* The block's device pointer (a CUdeviceptr cast to void*) and size. */
GPUIPC_API void *gpuipc_block_get_ptr(const gpuipc_block *block);
GPUIPC_API size_t gpuipc_block_get_size(const gpuipc_block *block);
/* Number of peers that hold the block now. */
GPUIPC_API unsigned gpuipc_block_get_holders(const gpuipc_block *block);

/* Orders `stream` after the GPU work that peers queued before they released
 * this block: call it before writing a block again that you keep (rather
 * than free and allocate anew) once gpuipc_block_get_holders says no peer holds
 * it. Does not wait on the host. Releases that arrive later are not
 * covered. */
GPUIPC_API gpuipc_status gpuipc_block_wait(gpuipc_block *block,
                                           struct CUstream_st *stream);

/* Frees a block: the caller's work on it must have been queued on `stream`
 * (or be complete). The memory returns to the arena when every peer that
 * holds it has released it (or died) and their GPU work is done, and the
 * work queued on `stream` before this call is done. The block object itself
 * is gone on return. NULL is a no-op. */
GPUIPC_API gpuipc_status gpuipc_block_free(gpuipc_block *block,
                                           struct CUstream_st *stream);

/* What an arena has out: blocks allocated and not freed, blocks freed but
 * still held by peers (deferred frees), and leases (block x peer) out. */
typedef struct gpuipc_arena_stats {
  size_t size;
  size_t chunks;
  size_t bytes_total;     /* all chunks */
  size_t bytes_allocated; /* allocated blocks, including deferred frees */
  size_t blocks_allocated;
  size_t blocks_deferred; /* freed by the owner, still held by a peer */
  size_t leases;          /* (block, connection) pairs outstanding */
} gpuipc_arena_stats;
#define GPUIPC_ARENA_STATS_INIT {sizeof(gpuipc_arena_stats), 0, 0, 0, 0, 0, 0}
GPUIPC_API gpuipc_status gpuipc_arena_get_stats(gpuipc_arena *arena,
                                                gpuipc_arena_stats *st /* IN/OUT: size */);

/* ------------------------------------------------------------------------ */
/* Handing buffers over                                                      */
/* ------------------------------------------------------------------------ */

/* Sends a block to the peer, ordered after the work queued on `stream`
 * before this call: the consumer's work after its recv waits for it on the
 * GPU. The peer holds a lease on the block until it releases it; the block
 * may be sent to many connections (each holds its own lease) and to the
 * same one more than once. meta (meta_len <= GPUIPC_META_MAX bytes, may be
 * NULL/0) travels with it. The first send of a block of a given chunk on a
 * connection exports that chunk there (setup cost, once); after that a
 * send costs one stream memory operation and one small message (none of
 * the first, and no wait at the consumer, when `stream` is idle at the
 * call: its work is then already complete; a stream found busy is not
 * asked again for the next few sends).
 * Waits (up to the timeout) when max_outstanding buffers are out on this
 * connection, making progress meanwhile. GPUIPC_E_PEER_GONE once the peer
 * is gone. */
GPUIPC_API gpuipc_status gpuipc_conn_send(gpuipc_conn *conn,
                                          gpuipc_block *block,
                                          struct CUstream_st *stream,
                                          const void *meta, size_t meta_len);

/* Flags of gpuipc_conn_send_ex. */
/* The caller asserts that every write to the block that it wants the
 * consumer to see has completed before this call (it synchronized the
 * stream or an event after that work, or the data was written by the
 * host). The send then asks the driver nothing: no stream query, no ready
 * signal (in the default memop mode the frame says so, and the consumer
 * enqueues no wait; in GPUIPC_ORDER_EVENT mode no event is recorded; in
 * GPUIPC_ORDER_NONE nothing changes), and `stream` is not used (it may be
 * NULL). If the assertion is false, the consumer may read stale or
 * partly written data: the library cannot check it. The release, and the
 * reuse of the block's memory only after the consumer's work before its
 * release, are as for any send. */
#define GPUIPC_SEND_COMPLETE 0x1u

/* gpuipc_conn_send with flags (0 or GPUIPC_SEND_COMPLETE; any other bit:
 * GPUIPC_E_INVALID_ARG, nothing sent). gpuipc_conn_send is
 * gpuipc_conn_send_ex with flags 0. */
GPUIPC_API gpuipc_status gpuipc_conn_send_ex(gpuipc_conn *conn,
                                             gpuipc_block *block,
                                             struct CUstream_st *stream,
                                             const void *meta,
                                             size_t meta_len, unsigned flags);

/* Sends a buffer that is not an arena block (from a gpuipc pool of any
 * kind, or wrapped with gpuipc_buffer_wrap), through its descriptor: the
 * first send of a buffer costs the handle layer's export (then cached), the
 * peer's first receipt the driver import (then served by its import cache),
 * and each send one message with the descriptor (and, for pool and VMM
 * memory, a file descriptor). Ordering as gpuipc_conn_send; the peer
 * receives it with gpuipc_conn_recv like any other. The caller keeps
 * ownership: it must not free the buffer while the peer holds it
 * (gpuipc_conn_get_buffer_holders), and must call gpuipc_conn_buffer_wait
 * before writing it again. */
GPUIPC_API gpuipc_status gpuipc_conn_send_buffer(gpuipc_conn *conn,
                                                 gpuipc_buffer *buf,
                                                 struct CUstream_st *stream,
                                                 const void *meta,
                                                 size_t meta_len);
/* How many leases the peer holds on buf (sent with gpuipc_conn_send_buffer
 * and not released). Makes progress (no waiting) first. */
GPUIPC_API unsigned gpuipc_conn_get_buffer_holders(gpuipc_conn *conn,
                                               const gpuipc_buffer *buf);
/* Orders `stream` after the GPU work the peer queued before releasing buf
 * (every release of it that arrived since the last call). Does not wait
 * on the host. */
GPUIPC_API gpuipc_status gpuipc_conn_buffer_wait(gpuipc_conn *conn,
                                                 const gpuipc_buffer *buf,
                                                 struct CUstream_st *stream);

/* What gpuipc_conn_recv hands over. */
typedef struct gpuipc_received {
  size_t size;      /* set to sizeof(gpuipc_received) before the call */
  uint64_t id;      /* names this lease in gpuipc_conn_release */
  void *ptr;        /* device pointer in this process */
  size_t length;    /* bytes */
  int device;       /* local ordinal of the device holding the memory */
  uint32_t meta_len;
  uint8_t meta[GPUIPC_META_MAX];
} gpuipc_received;
#define GPUIPC_RECEIVED_INIT {sizeof(gpuipc_received), 0, NULL, 0, 0, 0, {0}}

/* Receives the next buffer (waiting up to the timeout). On return, the work
 * the caller queues on `stream` after this call runs after the producer's
 * work queued before its send; the memory is readable (and writable) at
 * out->ptr until gpuipc_conn_release(conn, out->id, ...). User messages
 * that arrive meanwhile are queued for gpuipc_conn_recv_msg.
 * GPUIPC_E_TIMEOUT / GPUIPC_E_WOULD_BLOCK when nothing came;
 * GPUIPC_E_PEER_GONE when the exporter is gone (buffers already received
 * stay readable until released); GPUIPC_E_BUSY when the queue of user
 * messages not yet taken is full, so that nothing behind them is read
 * (see Backpressure). `stream` must stay a valid stream until the buffer
 * is released: a buffer released on another stream is released after the
 * work queued on `stream` before this call (its wait for the producer),
 * and one still held at gpuipc_conn_close is released there, on `stream`,
 * so that close unmaps nothing that work may still read. Needs CUDA. */
GPUIPC_API gpuipc_status gpuipc_conn_recv(gpuipc_conn *conn,
                                          struct CUstream_st *stream,
                                          gpuipc_received *out /* OUT */);

/* Gives a received buffer back: the exporter may reuse its memory once the
 * work queued on `stream` before this call has completed (ordered on the
 * GPU; this call does not wait). After it, out->ptr must no longer be used.
 * Never blocks. GPUIPC_E_NOT_FOUND for an id not held. If the exporter is
 * gone, the lease is dropped locally and GPUIPC_OK returned. */
GPUIPC_API gpuipc_status gpuipc_conn_release(gpuipc_conn *conn, uint64_t id,
                                             struct CUstream_st *stream);

/* Flags of gpuipc_conn_release_ex. */
/* The caller asserts that its use of the buffer has completed: every GPU
 * work of this process that reads or writes it finished before this call
 * (it synchronized the stream or an event after that work, or used the
 * memory from the host only). When the buffer came without a GPU wait
 * (sent with GPUIPC_SEND_COMPLETE, or from a producer stream that was
 * idle), the release then asks the driver nothing (no release write, no
 * event) and the producer may hand the memory out again as soon as it
 * reads the release, without a GPU wait. Otherwise (the receive queued a
 * wait on the stream it was received on, GPUIPC_ORDER_EVENT, or a peer of
 * an older library) it is an ordinary release on `stream`. If the
 * assertion is false, the producer may overwrite the memory while this
 * process still uses it: the library cannot check it. */
#define GPUIPC_RELEASE_COMPLETE 0x1u

/* gpuipc_conn_release with flags (0 or GPUIPC_RELEASE_COMPLETE; any other
 * bit: GPUIPC_E_INVALID_ARG, nothing released). gpuipc_conn_release is
 * gpuipc_conn_release_ex with flags 0. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status
gpuipc_conn_release_ex(gpuipc_conn *conn, uint64_t id,
                       struct CUstream_st *stream, unsigned flags);

/* ---- batches and broadcast ----------------------------------------------- */

/* Sends n blocks (1 <= n <= GPUIPC_BATCH_MAX) as one operation: one frame
 * and, in the default memop mode, one ready signal (a single
 * cuStreamWriteValue64 after the work queued on `stream` before this call)
 * for the whole batch. Each block is its own lease, with its own metadata
 * (metas[i], meta_lens[i] bytes <= GPUIPC_META_MAX; both arrays may be
 * NULL for none, metas[i] may be NULL when meta_lens[i] is 0) and its own
 * release; the peer receives them in order with gpuipc_conn_recv or
 * gpuipc_conn_recv_batch. Blocks may come from different arenas (of the
 * connection's one device), have any sizes, and repeat.
 * All or nothing: every argument is checked first (a freed block, a block
 * on another device, metadata too long, 48 * n + the metadata's bytes
 * over GPUIPC_BATCH_BYTES_MAX, n over the connection's max_outstanding:
 * GPUIPC_E_INVALID_ARG), and the call waits (up to the timeout, making
 * progress) until n slots are free; if anything fails, no block of the
 * batch was sent and the peer holds none of them. GPUIPC_E_PEER_GONE once
 * the peer is gone. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_conn_send_batch(gpuipc_conn *conn,
                                                gpuipc_block *const *blocks,
                                                size_t n,
                                                struct CUstream_st *stream,
                                                const void *const *metas,
                                                const size_t *meta_lens);

/* Receives up to max buffers (max >= 1; out[i].size set for each, as
 * GPUIPC_RECEIVED_INIT does): waits (up to the timeout) for the first,
 * then takes every buffer already arrived, up to max, without waiting
 * more; *n says how many. Ordering as gpuipc_conn_recv for each of them,
 * at the cost of one stream wait per batch the producer sent among those
 * taken (the buffers of one batch, or of one broadcast, share one wait;
 * none for buffers sent from an idle stream). gpuipc_conn_recv of the
 * buffers of a batch one by one waits once per buffer. Each is
 * released on its own (gpuipc_conn_release) or together
 * (gpuipc_conn_release_batch). Errors as gpuipc_conn_recv; on an error
 * nothing was received (*n is 0). */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_conn_recv_batch(gpuipc_conn *conn,
                                                struct CUstream_st *stream,
                                                gpuipc_received *out /* OUT */,
                                                size_t max,
                                                size_t *n /* OUT */);

/* Releases n received buffers (1 <= n <= GPUIPC_BATCH_MAX) as
 * gpuipc_conn_release would each, ordered after the work queued on
 * `stream` before this call, with the release frames of 64 buffers each
 * and the flag-word writes enqueued together. All or nothing: an id not
 * held, not yet received, or named twice fails the whole call
 * (GPUIPC_E_NOT_FOUND, GPUIPC_E_INVALID_ARG) and releases none. Never
 * blocks. If the exporter is gone, the leases are dropped locally and
 * GPUIPC_OK returned. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_conn_release_batch(gpuipc_conn *conn,
                                                   const uint64_t *ids,
                                                   size_t n,
                                                   struct CUstream_st *stream);

/* Sends one block to n connections (1 <= n <= GPUIPC_BROADCAST_MAX, no
 * connection twice) as one operation, ordered after the work queued on
 * `stream` before this call, with the same metadata: each connection's
 * peer holds its own lease and releases it on its own (as after n
 * gpuipc_conn_send), and a block freed meanwhile returns to its arena
 * only when every peer released it and the work each queued before its
 * release completed. Every connection is first made ready without
 * waiting (its slot, the block's chunk exported); then ONE ready signal
 * is enqueued on `stream` for all of them (in the default memop mode: a
 * single cuStreamWriteValue64 of a per-device broadcast word in gpuipc's
 * flag-word memory, which every consumer's stream waits on; none at all
 * when `stream` is idle, as in gpuipc_conn_send), then the frames of the
 * ready ones are written back to back, so the last consumer is behind
 * neither the others' sends nor their signals. Only then does the call
 * wait, for the connections that were not ready (every slot out: their
 * peer has not released; or no room: their peer does not read), all
 * together, each up to its own timeout counted from the call's start,
 * sending to each as soon as it is ready (its frame names the same
 * signal, so its consumer is ordered as the others). So one stalled
 * consumer delays neither the others' buffers nor, beyond its own
 * timeout once, the call. (A connection in GPUIPC_ORDER_EVENT mode is
 * ordered by its own slot's event as in gpuipc_conn_send.) Broadcasts of one device from
 * different streams are ordered among themselves: one whose stream is
 * not the previous broadcast's first waits, on the GPU, for that
 * broadcast's signal. If the producer dies, a consumer writes the word
 * (as it writes a dead producer's slot words) only once the producer's
 * process is gone (other consumers wait on it too), in its next call on
 * the connection or by its watcher; a consumer that closes while the
 * producer lives leaves the word alone (its close waits, up to its
 * timeout, for the producer's signal before it unmaps the memory; if the
 * signal does not come in time, the producer's memory stays mapped, as
 * when work queued before releases does not complete).
 * A connection that fails (its peer gone, its timeout: GPUIPC_E_TIMEOUT,
 * or GPUIPC_E_WOULD_BLOCK for one that does not wait, a bad connection)
 * is left out and the others are not affected: statuses[i] (may be NULL)
 * is connection i's status; the call returns GPUIPC_OK when all of them
 * are, else the status of the first that failed. Bad arguments
 * (GPUIPC_E_INVALID_ARG) send nothing. */
GPUIPC_EXPERIMENTAL GPUIPC_API gpuipc_status gpuipc_conn_broadcast(gpuipc_conn *const *conns,
                                               size_t n, gpuipc_block *block,
                                               struct CUstream_st *stream,
                                               const void *meta,
                                               size_t meta_len,
                                               gpuipc_status *statuses /* OUT: n */);

/* Buffers outstanding on this connection: *held_by_peer: our blocks the
 * peer holds now (sent, not released); *held_here: the peer's buffers we
 * hold (received, not released). Either pointer may be NULL. Makes progress
 * (no waiting) first, so releases already sent are counted. */
GPUIPC_API gpuipc_status gpuipc_conn_get_outstanding(gpuipc_conn *conn,
                                                 size_t *held_by_peer /* OUT */,
                                                 size_t *held_here /* OUT */);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_CONN_H */
