/*
 * conn_int.h: the connection object and the frame layer's entry points
 * (frames.c), as the handshake, the listener and the fast path use them;
 * the handshake's entry points for the listener (handshake.c); and the
 * hooks through which the frame layer calls the fast path, which the fast
 * path installs (src/conn/ only). The carrier under the frames has its own
 * header (carrier.h), as have arenas, leases and the fast path's own state
 * (arena_int.h, lease_int.h, handoff_int.h).
 */
#ifndef GPUIPC_CONN_INT_H
#define GPUIPC_CONN_INT_H

#include "carrier.h"
#include "conn.h"
#include "wire.h"

#include <stdatomic.h>

#include <pthread.h>
#include <sys/types.h>

/* A queued user message. */
typedef struct gpuipc__msg {
  struct gpuipc__msg *next;
  size_t len;
  int nfds;
  int fds[GPUIPC__FRAME_FDS_MAX];
  unsigned char data[]; /* len bytes */
} gpuipc__msg;

typedef enum gpuipc__conn_state {
  GPUIPC__CONN_OPEN = 0,
  GPUIPC__CONN_PEER_GONE, /* EOF / reset / BYE: the peer left */
  GPUIPC__CONN_BROKEN     /* we disconnected it (protocol error) */
} gpuipc__conn_state;

struct gpuipc__ho;         /* the fast path's state, handoff_int.h */
struct gpuipc__peer;       /* the peer process, lease.c */
struct gpuipc__watch;      /* the peer watcher's record, lease.c */
struct gpuipc__conn_hooks; /* below */
struct pollfd;             /* <poll.h> */

/* Who writes what: frames.c the transport's fields (carrier, state, rx,
 * tx, the message queue); handshake.c the peer's identity and the limits it
 * announced (peer_*, via, stats_*, hs_fd); lease.c `watch`; the fast path
 * `ho`, `peer_said_bye` and, through gpuipc__conn_fast, `hooks`. */
struct gpuipc_conn {
  /* The carrier of the frames (carrier.h); k.fd is the socket. */
  gpuipc__carrier k;
  gpuipc__conn_state state;
  gpuipc_status broken_status; /* why it broke (E_PROTOCOL ...) */
  char broken_why[200];
  int timeout_ms;
  int nonblocking;
  uint32_t max_outstanding;
  gpuipc_order_mode order;
  /* Peer, as the kernel vouched for it (SCM_CREDENTIALS at handshake):
   * its pid as this process sees it, 0 when it lives in a pid namespace
   * this process cannot see (a sibling container). */
  int peer_pid;
  /* The peer for the handle layer's imports of what arrives here: its
   * identity (its own pid namespace, pid and start time) and the liveness
   * table it passed at the handshake (NULL: none, or an older peer). */
  gpuipc__via via;
  gpuipc__live_peer *peer_table;
  bool peer_foreign_ns; /* its pid namespace is not ours */
  int hs_fd;            /* handshake: an fd that came with a frame, -1 */
  uint32_t peer_uid, peer_gid;
  uint64_t peer_start_time;
  uint32_t peer_max_outstanding;
  /* The peer process, watched for its exit (NULL until the handshake). */
  struct gpuipc__peer *peer;
  /* The peer watcher's record (NULL: watch_peer was 0, or no pidfd). */
  struct gpuipc__watch *watch;
  int peer_said_bye;
  /* Its HELLO has GPUIPC__HELLO_F_RELC: it takes complete releases. */
  bool peer_relc;
  /* Its HELLO has GPUIPC__HELLO_F_SFC: its ring page counts its socket
   * frames, and the socket is read when that count says a frame is there
   * (or a wait saw the fd ready: sock_ready), and else at most once per
   * GPUIPC__SOCK_LOOK_NS (sock_looked), for its hang-up. */
  bool peer_sfc;
#define GPUIPC__SOCK_LOOK_NS 1000000u
  atomic_bool sock_ready;
  uint64_t sock_looked;
  unsigned sock_skipped;
  bool rx_hot; /* a receive's passes: the only ones that may skip it */
  uint64_t rx_sock_reads; /* reads of the socket by the passes */
  /* The peer sent BYE or ABANDON: it reads nothing more (set by the fast
   * path; records are no longer put for it). */
  bool peer_ended;
  /* Receive side: bytes read and not yet parsed; descriptors received and
   * not yet claimed by a frame. */
  unsigned char *rx;
  size_t rx_len, rx_cap;
  int rx_fds[64];
  int rx_nfds;
  /* Transmit side: bytes of frames not yet written (the first bytes of the
   * oldest frame already went out, with its descriptors). */
  unsigned char *tx;
  size_t tx_off, tx_len, tx_cap;
  /* The order of the socket and a carrier's records: socket frames written
   * whole (each record names this many as its barrier; records are put
   * only while nothing is queued, so the count is exact then), frames in
   * the transmit queue (whole once it drains), socket frames dispatched,
   * records dispatched, and a record taken that waits for socket frames
   * (rec_have; its barrier and bytes). */
  uint64_t tx_frames, tx_qframes, rx_frames, rx_records;
  bool rec_have;
  uint64_t rec_barrier;
  size_t rec_len;
  unsigned char *rec; /* GPUIPC__RING_FRAME_MAX bytes, made on first use */
  bool polling;       /* gpuipc_conn_set_polling */
  uint64_t hup_checked; /* when a record's sender last looked for hang-up */
  int parsing;   /* frames are being dispatched (depth) */
  bool draining; /* reading what a departed peer sent before it left */
  bool closing;  /* gpuipc_conn_close is taking it down */
  /* User messages received, oldest first, and what they hold together
   * (bounded by q_max_*: a message that does not fit waits in rx, and
   * rx_paused stops reading the socket until the application takes
   * messages). */
  gpuipc__msg *msg_head, *msg_tail;
  size_t msg_count;
  size_t msg_bytes;
  size_t msg_fds;
  size_t q_max_msgs, q_max_bytes, q_max_fds;
  bool rx_paused;
  /* The fast path: the hooks it installed when the connection was made
   * (gpuipc__handoff_install), those in use (NULL until the fast path is
   * first used: then `fast`), and its state (owned by the fast path). */
  const struct gpuipc__conn_hooks *fast;
  const struct gpuipc__conn_hooks *hooks;
  struct gpuipc__ho *ho;
  int stats_slot; /* this connection in the stats segment (0: none) */
  bool stats_open; /* counted in the stats segment (closed in conn_free) */
};

/* ---- the frame layer (frames.c) ---------------------------------------------- */

/* A connection on the connected, non-blocking Unix stream socket fd (owned
 * from now on: closed also when this returns NULL), carried by the socket,
 * with the options' limits; no handshake yet. NULL without memory. */
gpuipc_conn *gpuipc__conn_new(int fd, const gpuipc_conn_options *o);
/* Frees a connection that the caller never got (a failed or dropped
 * handshake) or that gpuipc_conn_close finished with. */
void gpuipc__conn_free(gpuipc_conn *c);

/* A deadline for the calls of one API call: from the connection's timeout
 * (UINT64_MAX: none; 0: do not wait). */
uint64_t gpuipc__conn_deadline(const gpuipc_conn *c);

/* Queues one frame and writes as much as the socket takes. The payload is
 * given as up to 3 pieces (NULL/0 for unused). fds are sent with the
 * frame's first byte (the caller keeps its copies). When the socket is full:
 * waits (until deadline, reading incoming frames meanwhile) for frames with
 * fds; frames without fds are queued and flushed later. Returns E_TIMEOUT /
 * E_WOULD_BLOCK when nothing of the frame was sent, E_PEER_GONE, E_CLOSED. */
gpuipc_status gpuipc__conn_send_frame(gpuipc_conn *c, int type,
                                      const void *p1, size_t n1,
                                      const void *p2, size_t n2,
                                      const int *fds, int nfds,
                                      uint64_t deadline);

/* Reads what is available and dispatches complete frames; then, if
 * `wait_for` returns false and the deadline allows, waits for more. Returns
 * GPUIPC_OK when wait_for(c, arg) became true (or wait_for is NULL and the
 * pass is done), E_TIMEOUT / E_WOULD_BLOCK when the deadline passed first,
 * E_PEER_GONE / E_CLOSED / E_PROTOCOL when the connection ended (after
 * dispatching what came before). */
gpuipc_status gpuipc__conn_pump(gpuipc_conn *c, uint64_t deadline,
                                bool (*wait_for)(gpuipc_conn *, void *),
                                void *arg);

/* Status for a call on a connection that is no longer open. */
gpuipc_status gpuipc__conn_ended(gpuipc_conn *c);

/* The look for a hang-up that a record's put makes now and then (at most
 * once a millisecond per connection), made for n connections in one poll
 * (pf: room for n entries): those found alive count as looked at now, so
 * their next puts make no system call for it; one that hung up is left to
 * its own put, which reads what the peer sent before it left. For a
 * broadcast. */
void gpuipc__conn_hup_look(gpuipc_conn *const *conns, size_t n,
                           struct pollfd *pf);

/* Marks the connection broken by a protocol violation: logs, closes the
 * socket, runs the peer-gone cleanup; returns E_PROTOCOL. */
gpuipc_status gpuipc__conn_break(gpuipc_conn *c, const char *fmt, ...)
    GPUIPC__PRINTF(2, 3);

/* ---- the peer process (lease.c) ------------------------------------------------ */

/* A handle on the peer process (pid and start time as the kernel vouched
 * for them at the handshake): a pidfd, which becomes readable only when
 * the whole process has exited. Refcounted (connection, lease table).
 * Never NULL for a pid > 0 (without pidfds the /proc entry decides). */
struct gpuipc__peer *gpuipc__peer_open(int pid, uint64_t start_time);
/* The same for a peer this process cannot name by pid (another pid
 * namespace it cannot see): the pidfd the kernel gave of it, owned from
 * now on (closed also when this returns NULL). */
struct gpuipc__peer *gpuipc__peer_from_pidfd(int pidfd);
/* The peer's pidfd (borrowed; -1: none). */
int gpuipc__peer_pidfd(const struct gpuipc__peer *p);
void gpuipc__peer_unref(struct gpuipc__peer *p);

/* ---- the peer watcher (lease.c) ------------------------------------------------ */

/* Starts watching the peer of c (after the handshake, unless the options
 * said watch_peer = 0): when its process exits, a thread of gpuipc (one
 * per process, started by the first watch) unblocks the flag words our
 * streams wait for, without any call on c. Without a pidfd of the peer it
 * watches nothing and returns GPUIPC_OK; without the thread (it could not
 * start: logged) the watch waits for the next connection's try. Fails only
 * without memory. */
gpuipc_status gpuipc__watch_add(gpuipc_conn *c);
/* Stops it (idempotent; waits for writes in progress). */
void gpuipc__watch_remove(gpuipc_conn *c);
/* Calls fn(ctx) once, when peer's process is gone: here, at once, when it
 * is gone already, else in the watcher thread (which holds its own
 * reference to peer, so the connection may close meanwhile).
 * GPUIPC_E_NOT_SUPPORTED without a pidfd of the peer, GPUIPC_E_NO_MEMORY:
 * nothing registered. */
gpuipc_status gpuipc__watch_exit(struct gpuipc__peer *peer, int pid,
                                 void (*fn)(void *), void *ctx);
/* Runs the exit calls whose peers are gone, here (gpuipc_conn_collect: for
 * a process whose watcher thread could not start). */
void gpuipc__watch_run_due_exits(void);

/* ---- the fast path's hooks ---------------------------------------------------- */

/* What the frame layer calls in the fast path (depart.c's table), as
 * libuv's loop calls into its streams: installed when the connection is
 * made, in use from the first use of the fast path (a buffer sent, or a
 * fast-path frame arrived). This is the one place where the frame layer
 * calls up into the code that calls it, through a pointer it was given.
 * c->ho may be NULL in every hook. */
typedef struct gpuipc__conn_hooks {
  /* A fast-path frame (CHUNK, CTL, BUF, BUFD, EVD, REL, BYE). The fds
   * belong to the callee (it closes what it does not keep). A non-OK
   * return breaks the connection with that status (the message says
   * why). */
  gpuipc_status (*frame)(gpuipc_conn *c, int type, const unsigned char *p,
                         size_t len, int *fds, int nfds);
  /* The peer is gone (EOF, reset, protocol break): unblock our streams
   * that wait on its flag words; reclaim its leases once it is gone. */
  void (*peer_gone)(gpuipc_conn *c);
  /* Periodic, after each pass over the socket: reclaim what a departed
   * peer held once its process is gone. */
  void (*poll)(gpuipc_conn *c);
  /* This side breaks the connection on its own error (called before the
   * socket closes, the connection still open): tell the peer what we
   * still hold, so that it gets everything else back at once. */
  void (*breaking)(gpuipc_conn *c);
  /* gpuipc_conn_close: release what we hold, tell the peer, free the
   * fast path's state (c->ho is NULL on return). */
  void (*close)(gpuipc_conn *c);
} gpuipc__conn_hooks;

/* Installs the fast path's hooks into a new connection (c->fast), before
 * its handshake: the code that makes connections calls it, so that the
 * frame layer never names the code above it. */
void gpuipc__handoff_install(gpuipc_conn *c);

/* The hooks in use from now on (the fast path is used: a buffer sent, or a
 * fast-path frame arrived); NULL when none were installed. */
static inline const gpuipc__conn_hooks *gpuipc__conn_fast(gpuipc_conn *c) {
  if (c->hooks == NULL)
    c->hooks = c->fast;
  return c->hooks;
}

/* ---- the handshake (handshake.c), for the listener (listen.c) ---------------- */

struct ucred;
typedef struct gpuipc__hs gpuipc__hs;

/* True when a peer of this uid and gid may connect under these options
 * (our own uid, or an entry of an allow-list). */
bool gpuipc__peer_allowed(const gpuipc_conn_options *o, uint32_t uid,
                          uint32_t gid);
/* The check both ends make of a socket made by connect/accept before its
 * handshake: the kernel's record of the peer at connect time (SO_PEERCRED)
 * into *pre, and whether its uid and gid are allowed (above). GPUIPC_OK;
 * GPUIPC_E_PEER_REFUSED with *pre filled and nothing recorded (the caller,
 * which knows which end it is, says why); or the getsockopt failure,
 * recorded. Closes nothing. */
gpuipc_status gpuipc__peer_cred_check(int fd, const gpuipc_conn_options *o,
                                      struct ucred *pre);
/* Writes one handshake frame whole on the socket fd (REFUSE with its
 * reason, to a peer refused before its handshake began). */
gpuipc_status gpuipc__hs_write(int fd, int type, const void *p, size_t n,
                               uint64_t deadline);
/* A handshake of the accepting side on the accepted socket fd (owned from
 * now on), whose peer the kernel recorded as *pre: makes the connection
 * and sends our HELLO (its writes bounded by wdeadline). GPUIPC_OK with
 * *out, or why it could not start (fd closed; E_PEER_GONE: the peer left
 * already). */
gpuipc_status gpuipc__hs_accepted(int fd, const gpuipc_conn_options *o,
                                  const struct ucred *pre, uint64_t wdeadline,
                                  gpuipc__hs **out);
/* Moves the handshake on with what has arrived, never waiting for the
 * peer. GPUIPC_OK when complete, GPUIPC_E_WOULD_BLOCK while it waits for
 * the peer, else why it failed. */
gpuipc_status gpuipc__hs_step(gpuipc__hs *x, uint64_t wdeadline);
/* How far the handshake has come (it changes when the peer answered). */
int gpuipc__hs_stage(const gpuipc__hs *x);
/* The connection of a handshake (its socket: c->k.fd). */
gpuipc_conn *gpuipc__hs_conn(const gpuipc__hs *x);
/* Ends the handshake's record and returns its connection (the caller
 * frees it or hands it out). */
gpuipc_conn *gpuipc__hs_end(gpuipc__hs *x);
/* The connecting side's handshake (connect, from_fd) on fd (owned from now
 * on), waited for up to the options' timeout; *pre: the listener as the
 * kernel recorded it, or NULL. */
gpuipc_status gpuipc__hs_connect(int fd, const gpuipc_conn_options *o,
                                 const struct ucred *pre, gpuipc_conn **out);

#endif /* GPUIPC_CONN_INT_H */
