/*
 * handoff_int.h: the fast path's state per connection (handoff.c, tx.c,
 * rx.c and depart.c only, with the calls between those files):
 * what this side sends (its lease table, owned by lease.c, and the arena
 * chunks exported so far) and what it receives (the peer's chunks and flag
 * words, the buffers held and queued, imports waiting to be closed).
 */
#ifndef GPUIPC_HANDOFF_INT_H
#define GPUIPC_HANDOFF_INT_H

#include "conn_int.h"
#include "lease_int.h"

/* Receiver side, per slot of the peer. */
typedef struct gpuipc__rxs {
  uint64_t held;      /* sequence number held now (or queued); 0: none */
  uint64_t last_recv; /* newest sequence number waited for */
  uint64_t last_rel;  /* newest released */
  struct CUstream_st *last_rel_stream;
  /* The word that signals the newest release: released[rel_wslot] >=
   * rel_wval (this slot's own, or a later slot's of the same batch of
   * releases); rel_wval 0: none yet. */
  uint32_t rel_wslot;
  uint64_t rel_wval;
  uint64_t ptr;
  size_t len;
  bool ordered;
  bool by_event;
  gpuipc_event *ready_ev; /* event mode: the peer's */
  gpuipc_event *rel_ev;   /* event mode: ours */
  struct CUevent_st *rel_done; /* recorded after each release write */
  /* Ordered mode: the held buffer's wait on its ready word was enqueued on
   * recv_stream (the caller's stream; NULL: the legacy stream). Until that
   * wait has run, the GPU still reads the peer's flag words: a release is
   * ordered after it (join_ev when released on another stream), so that
   * rel_done covers it too. */
  bool waited;
  struct CUstream_st *recv_stream;
  struct CUevent_st *join_ev;
  gpuipc_buffer *imp;     /* BUFD: the import (a reference in the cache) */
} gpuipc__rxs;

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

/* A buffer that arrived and was not yet received by the caller. */
typedef struct gpuipc__qbuf {
  gpuipc__w_buf w;
  /* The ready word that orders it (memop mode), at device address raddr,
   * awaited for value rseq: its own slot's with its sequence number; for
   * an entry of a batch (BUFS), that of the batch's one ready entry; for a
   * broadcast (BUFW), the producer's broadcast word (rslot UINT32_MAX). */
  uint32_t rslot;
  uint64_t raddr;
  uint64_t rseq;
  bool nowait; /* GPUIPC__BUF_DONE: the producer's work had completed */
  uint8_t meta[GPUIPC_META_MAX];
} gpuipc__qbuf;

struct gpuipc__ho {
  int peer_pid;
  /* Sender: the lease table (NULL until the first send) and the chunks of
   * our arenas exported on this connection. */
  gpuipc__lease_table *lt;
  struct {
    uint64_t arena_id;
    uint64_t mask;
  } exp[8];
  int nexp;
  unsigned char *txbuf; /* a batch's frame is built here (grown once) */
  size_t txcap;
  /* Idle streams (GPUIPC__BUF_DONE): after a query found the stream busy,
   * the next idle_skip sends do not ask (the gap doubles, up to 64). */
  uint32_t idle_skip, idle_backoff;
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
  /* The peer's broadcast words named so far (BUFW) and the newest value
   * named for each: written by us only once the peer is dead (other
   * consumers wait on them too). */
  struct {
    uint64_t addr, max;
    uint64_t waited; /* the newest value a stream of ours waits for */
  } bw[GPUIPC__BWORDS_MAX];
  int nbw;
  bool bw_forced; /* the peer died: we wrote them */
  bool rx_unblocked;
  /* Event mode: the peer died while our streams waited on records of its
   * events that will never complete (a real driver does not let a later
   * record release them): those streams stay blocked, so close must not
   * synchronize the context, and leaves the imports mapped. */
  bool rx_stuck;
  /* A release write whose completion could not be recorded: close cannot
   * tell when the imported memory is unused, and leaves it mapped. */
  bool rx_unknown;
  struct CUstream_st *unblock; /* receiver: writes that unblock our streams */
  /* Stream memory operations for a caller that passes the legacy default
   * stream go on these private non-blocking streams instead, joined to the
   * legacy stream by an event ([0] sender side, the lease table's device;
   * [1] receiver side, device `peer_ordinal`). */
  struct CUstream_st *lq[2];
  struct CUevent_st *lev[2];
  gpuipc__closing *closing;
  size_t nclosing, capclosing;
};

/* True for the legacy default stream (NULL or CU_STREAM_LEGACY). */
static inline bool gpuipc__is_legacy_stream(const struct CUstream_st *s) {
  return s == NULL || (uintptr_t)s == 0x1;
}

/* ---- the base both directions share (handoff.c) -------------------------------- */

/* c's fast-path state, made at first use (the transport's hooks set). */
gpuipc_status gpuipc__ho_get(gpuipc_conn *c, struct gpuipc__ho **out);
/* The stream for a write ordered after the work queued on `user` (side i:
 * 0 sender, 1 receiver; the legacy stream goes through the relay). */
gpuipc_status gpuipc__ho_write_stream(struct gpuipc__ho *h, int i,
                                      struct CUstream_st *user, CUstream *out);
/* The stream for a wait that `user` must be ordered after (then call
 * gpuipc__ho_wait_done). */
gpuipc_status gpuipc__ho_wait_stream(struct gpuipc__ho *h, int i,
                                     struct CUstream_st *user, CUstream *out);
/* Orders `user` after the wait enqueued on gpuipc__ho_wait_stream's. */
CUresult gpuipc__ho_wait_done(struct gpuipc__ho *h, int i,
                              struct CUstream_st *user);
/* Destroys side i's relay stream and event (context of device `ordinal`). */
void gpuipc__ho_free_lq(struct gpuipc__ho *h, int i, int ordinal);
/* Event mode: a new interprocess event on device `ordinal`, its descriptor
 * sent to the peer for `slot` (which: 0 ready, 1 release). */
gpuipc_status gpuipc__ho_make_event(gpuipc_conn *conn, int ordinal,
                                    uint32_t slot, uint32_t which,
                                    uint64_t deadline, gpuipc_event **out);

/* ---- the receiver, as departure uses it (rx.c) ----------------------------------- */

/* The hook for a fast-path frame (gpuipc__conn_hooks.frame). */
gpuipc_status gpuipc__ho_frame(gpuipc_conn *c, int type,
                               const unsigned char *p, size_t len, int *fds,
                               int nfds);
/* Releases held slot `slot` on stream (the flag written when write_flag)
 * and forgets it locally; an import is closed once its GPU work is done. */
gpuipc_status gpuipc__ho_release_slot(gpuipc_conn *conn, struct gpuipc__ho *h,
                                      uint32_t slot, struct CUstream_st *stream,
                                      bool write_flag);
/* Closes the imports whose release's GPU work completed (all when `all`). */
void gpuipc__ho_poll_closing(struct gpuipc__ho *h, bool all);

#endif /* GPUIPC_HANDOFF_INT_H */
