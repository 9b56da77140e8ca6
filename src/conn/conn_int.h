/*
 * conn_int.h: what the connection layer's files share (src/conn/ only): the
 * connection object, and the entry points between the transport (conn.c),
 * the handoff fast path (handoff.c), arenas (arena.c) and leases (lease.c).
 */
#ifndef GPUIPC_CONN_INT_H
#define GPUIPC_CONN_INT_H

#include "conn.h"

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

struct gpuipc__ho; /* handoff state, handoff.c */

struct gpuipc_conn {
  int fd;
  gpuipc__conn_state state;
  gpuipc_status broken_status; /* why it broke (E_PROTOCOL ...) */
  char broken_why[200];
  int timeout_ms;
  int nonblocking;
  uint32_t max_outstanding;
  gpuipc_order_mode order;
  /* Peer, as the kernel vouched for it (SCM_CREDENTIALS at handshake). */
  int peer_pid;
  uint32_t peer_uid, peer_gid;
  uint64_t peer_start_time;
  uint32_t peer_max_outstanding;
  int peer_said_bye;
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
  /* The fast path (NULL until first used). */
  struct gpuipc__ho *ho;
};

/* ---- transport (conn.c) --------------------------------------------------- */

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

/* Marks the connection broken by a protocol violation: logs, closes the
 * socket, runs the peer-gone cleanup; returns E_PROTOCOL. */
gpuipc_status gpuipc__conn_break(gpuipc_conn *c, const char *fmt, ...)
    GPUIPC__PRINTF(2, 3);

/* ---- arenas (arena.c) --------------------------------------------------------- */

#define GPUIPC__ARENA_MAX_CHUNKS 64
#define GPUIPC__ARENA_ALIGN 256

struct CUevent_st;
struct CUstream_st;

/* A marker on an arena's reclaim stream: memory tagged with it may be
 * reused once the marker's event completed (or by work ordered after it).
 * Markers of one arena complete in record order (one stream). */
typedef struct gpuipc__mark {
  struct CUevent_st *ev;
  uint64_t order; /* record order on the reclaim stream */
  int refs;
  bool done;      /* known complete */
  struct gpuipc__mark *next_free;
} gpuipc__mark;

/* One free range of an arena chunk. */
typedef struct gpuipc__range {
  struct gpuipc__range *next;
  uint32_t chunk;
  size_t off, len;
  gpuipc__mark *tag; /* reuse waits for it; NULL: free at once */
} gpuipc__range;

typedef struct gpuipc__chunk {
  gpuipc_buffer *buf;
  uint64_t base; /* CUdeviceptr */
  size_t size;
} gpuipc__chunk;

struct gpuipc__ho;

struct gpuipc_arena {
  pthread_mutex_t lock;
  int ordinal;
  uint64_t id; /* process-unique, travels in frames */
  gpuipc_pool *pool;
  size_t chunk_bytes, max_bytes, total_bytes;
  gpuipc__chunk chunks[GPUIPC__ARENA_MAX_CHUNKS];
  uint32_t nchunks;
  gpuipc__range *free_list; /* sorted by (chunk, off) */
  struct CUstream_st *reclaim; /* non-blocking: waits for releases */
  struct CUstream_st *side;    /* non-blocking: writes that unblock */
  gpuipc__mark *mark_free;
  uint64_t mark_order;
  gpuipc__mark *last_mark; /* the newest marker recorded (a reference) */
  size_t blocks_allocated, blocks_deferred, leases, bytes_allocated;
  size_t internal_blocks, internal_bytes; /* flag words of connections */
  int users; /* connections with flag words here */
};

struct gpuipc_block {
  gpuipc_arena *arena;
  uint32_t chunk;
  size_t off, len; /* len: rounded up to the arena's alignment */
  size_t bytes;     /* as asked for */
  uint64_t ptr;     /* CUdeviceptr */
  unsigned holders;
  bool freed;        /* the owner freed it; the memory waits for holders */
  bool internal;     /* flag words of a connection */
  bool unmarked;     /* reclaim waits were queued after its tag */
  gpuipc__mark *tag; /* newest reclaim marker covering its releases */
};

/* The process's arena for connection flag words on a device. */
gpuipc_status gpuipc__ctl_arena(int ordinal, gpuipc_arena **out);
/* Internal allocation (the arena's lock is taken inside). */
gpuipc_status gpuipc__arena_take(gpuipc_arena *a, size_t bytes,
                                 struct CUstream_st *stream, bool internal,
                                 gpuipc_block **out);
/* Enqueues, on the reclaim stream, a wait until the 64-bit word at `word`
 * (a device address in the arena) reaches value (wrap-around GEQ). Lock
 * held. */
gpuipc_status gpuipc__arena_wait_word(gpuipc_arena *a, uint64_t word,
                                      uint64_t value);
/* Records a new marker on the reclaim stream, after every wait enqueued so
 * far; tags each block with it. Lock held. */
gpuipc_status gpuipc__arena_mark(gpuipc_arena *a, gpuipc_block **blocks,
                                 int n);
/* One holder of a block gave it back (released or died). Lock held. */
void gpuipc__block_unhold(gpuipc_block *b);
/* Writes value into each word, on the side stream (for flag words a dead
 * peer will never write), then waits for it to complete. Lock held. */
gpuipc_status gpuipc__arena_force_words(gpuipc_arena *a, const uint64_t *words,
                                        int n, uint64_t value);
/* Reclaims what peers of closed connections held, for the peers that are
 * gone now (lease.c). Called without any arena lock held. */
void gpuipc__orphans_poll(void);

/* ---- the fast path's state per connection ----------------------------------------- */

/* Sender side, per slot (a flag-word pair). */
typedef struct gpuipc__txs {
  gpuipc_block *block; /* the block the peer holds in this slot, or */
  gpuipc_buffer *buf;  /* the (non-arena) buffer; both NULL: free */
  uint64_t seq;        /* its lease's sequence number */
  uint64_t last_seq;   /* last value written to the ready word */
  struct CUstream_st *last_stream;
  bool ordered;
  bool by_event;       /* event mode */
  bool retired;        /* unusable (a send failed halfway) */
  gpuipc_event *ready_ev; /* event mode: ours, recorded at send */
  gpuipc_event *rel_ev;   /* event mode: the peer's, recorded at release */
} gpuipc__txs;

/* Receiver side, per slot of the peer. */
typedef struct gpuipc__rxs {
  uint64_t held;       /* sequence number held now; 0: none */
  uint64_t last_recv;  /* newest sequence number waited for */
  uint64_t last_rel;   /* newest released */
  struct CUstream_st *last_rel_stream;
  uint64_t ptr;
  size_t len;
  bool ordered;
  bool by_event;
  gpuipc_event *ready_ev; /* event mode: the peer's */
  gpuipc_event *rel_ev;   /* event mode: ours */
  gpuipc_buffer *imp; /* BUFD: the import (a reference in the cache) */
} gpuipc__rxs;

/* A released non-arena buffer, for gpuipc_conn_buffer_wait. */
typedef struct gpuipc__relrec {
  const gpuipc_buffer *buf;
  uint32_t slot;
  uint64_t seq;
  struct CUevent_st *local; /* event mode: completes after the release */
} gpuipc__relrec;

/* An import to close once the GPU work queued before its release is done. */
typedef struct gpuipc__closing {
  gpuipc_buffer *imp;
  struct CUevent_st *ev;
} gpuipc__closing;

/* An imported chunk of the peer's arena. */
typedef struct gpuipc__imp {
  uint64_t arena_id;
  uint32_t chunk;
  gpuipc_buffer *buf;
  uint64_t base;
  size_t size;
  int ordinal;
} gpuipc__imp;

typedef struct gpuipc__qbuf {
  gpuipc__w_buf w;
  uint8_t meta[GPUIPC_META_MAX];
} gpuipc__qbuf;

struct gpuipc__ho {
  struct gpuipc__ho *next_orphan;
  int peer_pid;
  uint64_t peer_start;
  bool dead_handled; /* the peer's death was handled (words forced) */
  /* Sender. */
  gpuipc_arena *ctl_arena; /* where our flag words live */
  gpuipc_block *ctl;
  int ordinal;
  uint32_t nslots;
  gpuipc__txs *tx;
  uint32_t *tx_free;
  uint32_t tx_nfree;
  uint64_t tx_seq;
  size_t tx_out;
  gpuipc__relrec *rel;
  size_t nrel, caprel;
  struct CUstream_st *evq; /* event mode: where releases are awaited */
  struct {
    uint64_t arena_id;
    uint64_t mask;
  } exp[8];
  int nexp;
  /* Receiver. */
  gpuipc__imp *imp;
  int nimp, cimp;
  bool have_peer_ctl;
  uint64_t peer_ctl; /* device address of the peer's flag words here */
  uint32_t peer_nslots;
  int peer_ordinal;
  gpuipc__rxs *rx;
  gpuipc__qbuf *q;
  uint32_t qhead, qlen;
  size_t rx_held;
  uint64_t rx_max_seq;
  bool rx_unblocked;
  /* Event mode: the peer died while our streams waited on records of its
   * events that will never complete (a real driver does not let a later
   * record release them): those streams stay blocked, so close must not
   * synchronize the context, and leaves the imports mapped. */
  bool rx_stuck;
  struct CUstream_st *unblock; /* receiver: writes that unblock our streams */
  /* Stream memory operations for a caller that passes the legacy default
   * stream go on these private non-blocking streams instead, joined to the
   * legacy stream by an event ([0] sender side, device `ordinal`; [1]
   * receiver side, device `peer_ordinal`). */
  struct CUstream_st *lq[2];
  struct CUevent_st *lev[2];
  gpuipc__closing *closing;
  size_t nclosing, capclosing;
};

static inline uint64_t gpuipc__ready_word(uint64_t base, uint32_t slot) {
  return base + 8u * (uint64_t)slot;
}
static inline uint64_t gpuipc__released_word(uint64_t base, uint32_t nslots,
                                             uint32_t slot) {
  return base + 8u * ((uint64_t)nslots + slot);
}

/* ---- leases (lease.c) --------------------------------------------------------------- */

/* The peer holds block in slot (sender side). */
void gpuipc__lease_add(struct gpuipc__ho *h, uint32_t slot, gpuipc_block *b,
                       uint64_t seq, bool ordered);
/* A REL frame: the peer gave these back. A non-OK status is a protocol
 * violation (unknown slot or sequence number). */
gpuipc_status gpuipc__lease_released(struct gpuipc__ho *h,
                                     const gpuipc__w_rel *rel, size_t n);
/* The peer is gone and its process too: everything it held comes back. */
void gpuipc__lease_reclaim_dead(struct gpuipc__ho *h);
/* True while a process with this pid and start time exists and is not a
 * zombie. */
bool gpuipc__peer_alive(int pid, uint64_t start_time);
/* Our side closes while the peer still holds blocks: keep the state until
 * the peer process is gone, then reclaim. Takes ownership of h. */
void gpuipc__orphan_add(struct gpuipc__ho *h);
/* True for the legacy default stream (NULL or CU_STREAM_LEGACY). */
static inline bool gpuipc__is_legacy_stream(const struct CUstream_st *s) {
  return s == NULL || (uintptr_t)s == 0x1;
}
/* Destroys h->lq[i] / h->lev[i] (context of device `ordinal`). */
void gpuipc__ho_free_lq(struct gpuipc__ho *h, int i, int ordinal);
/* Frees the sender-side state (flag words back to the arena). */
void gpuipc__ho_free_tx(struct gpuipc__ho *h);
/* True when every "released" word already holds the newest release the
 * peer sent (so no wait on them can still be pending). Reads the words
 * from the device (a small copy). */
bool gpuipc__lease_words_settled(struct gpuipc__ho *h);
/* Our side closes the connection: frees the sender-side state now if that
 * is safe, else keeps it as an orphan. Takes ownership of h. */
void gpuipc__lease_close(struct gpuipc__ho *h, bool peer_open);

/* ---- handoff (handoff.c) ---------------------------------------------------- */

/* Handles a fast-path frame (CHUNK, CTL, BUF, REL, BYE). The fds belong to
 * the callee (close what you do not keep). A non-OK return breaks the
 * connection with that status (the message says why). */
gpuipc_status gpuipc__ho_frame(gpuipc_conn *c, int type, const unsigned char *p,
                               size_t len, int *fds, int nfds);
/* The peer is gone (EOF, reset, protocol break): unblock our streams that
 * wait on its flag words; hand its leases to the reclaim logic. */
void gpuipc__ho_peer_gone(gpuipc_conn *c);
/* Periodic: reclaim what a dead peer held once its process is gone. */
void gpuipc__ho_poll(gpuipc_conn *c);
/* On close: release what we hold, tell the peer, free the state. */
void gpuipc__ho_close(gpuipc_conn *c);

#endif /* GPUIPC_CONN_INT_H */
