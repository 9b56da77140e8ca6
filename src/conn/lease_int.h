/*
 * lease_int.h: the sender's lease table of a connection (src/conn/ only):
 * its flag words, which of our blocks and buffers the peer holds in each
 * slot, the releases a buffer's owner has yet to wait for, and what an
 * orphan keeps after its connection closed. lease.c owns every field
 * but stats_slot, which tx.c sets once, right after gpuipc__lease_open;
 * the fast path (tx.c, rx.c, depart.c) reads the fields marked immutable
 * and changes the rest through the functions below.
 */
#ifndef GPUIPC_LEASE_INT_H
#define GPUIPC_LEASE_INT_H

#include "arena_int.h"
#include "conn_int.h"

#include <stdatomic.h>

/* The flag words of a side that sends: ready[slot] then released[slot],
 * 64 bits each, from `base` (a device address). */
static inline uint64_t gpuipc__ready_word(uint64_t base, uint32_t slot) {
  return base + 8u * (uint64_t)slot;
}
static inline uint64_t gpuipc__released_word(uint64_t base, uint32_t nslots,
                                             uint32_t slot) {
  return base + 8u * ((uint64_t)nslots + slot);
}

/* The peer process (see conn_int.h). */
typedef struct gpuipc__peer {
  atomic_int refs;
  int pid;
  uint64_t start_time;
  int pidfd;     /* -1: none (old kernel, or the pid named another process) */
  bool mismatch; /* at open, the pid already named another process */
} gpuipc__peer;

gpuipc__peer *gpuipc__peer_ref(gpuipc__peer *p);
/* True once the whole peer process has exited (its pidfd is readable);
 * a process whose main thread exited while others run is not gone. */
bool gpuipc__peer_gone(const gpuipc__peer *p);

/* A watched peer (every connection's unless gpuipc_conn_options.watch_peer
 * is 0; see lease.c): where the flag words are that our streams may wait
 * for, published by the connection's thread (the fast path) through the
 * atomics. */
struct gpuipc__watch {
  struct gpuipc__watch *next;
  gpuipc__peer *peer; /* a reference: its pidfd is what the thread polls */
  int pid;
  pthread_mutex_t mu; /* held while the words are written */
  bool fired;         /* under mu */
  bool orphan;        /* watches the peer of an orphan table (no words):
                         its exit makes the thread reap the orphans */
  /* Not NULL: an application's exit call (gpuipc_conn_call_when_peer_exits;
   * no words): the thread calls it once, then drops the watch. */
  void (*on_exit)(void *ctx);
  void *on_exit_ctx;
  _Atomic uint64_t rx_base, tx_base; /* 0: not known yet */
  _Atomic int rx_ordinal, tx_ordinal;
  _Atomic uint32_t rx_nslots, tx_nslots;
  _Atomic uint64_t rx_max, tx_seq;
  /* The peer's broadcast words (see tx.c) and their newest values. */
  _Atomic uint64_t bw_addr[GPUIPC__BWORDS_MAX], bw_max[GPUIPC__BWORDS_MAX];
};

/* One slot (a flag-word pair). */
typedef struct gpuipc__txs {
  gpuipc_block *block; /* the block the peer holds in this slot, or */
  gpuipc_buffer *buf;  /* the (non-arena) buffer; both NULL: free */
  uint64_t seq;        /* its lease's sequence number */
  uint64_t last_seq;   /* last value written to the ready word */
  struct CUstream_st *last_stream; /* the stream that wrote it */
  /* The word that signals the newest release of this slot's current or
   * last lease: released[rel_slot] >= rel_seq (its own, or, for a release
   * of a batch, that of a later slot of the batch); rel_seq 0: not known
   * (then released[slot] >= last_seq). */
  uint32_t rel_slot;
  uint64_t rel_seq;
  /* The current lease's send wrote no ready word (the work before it had
   * completed, or a broadcast word stood for it): its record above only
   * stands in for a write, and the record it replaced (the last write,
   * and the word that signals the release of that write's lease) is kept
   * here. A release that wrote no word either (GPUIPC__REL_COMPLETE)
   * puts it back, so that nothing ever waits for a word nobody writes. */
  bool stand_in;
  uint64_t prev_seq;
  struct CUstream_st *prev_stream;
  uint32_t prev_rel_slot;
  uint64_t prev_rel_seq;
  bool ordered;
  bool by_event;          /* event mode */
  gpuipc_event *ready_ev; /* event mode: ours, recorded at send */
  gpuipc_event *rel_ev;   /* event mode: the peer's, recorded at release */
} gpuipc__txs;

/* A released non-arena buffer, for gpuipc_conn_buffer_wait. */
typedef struct gpuipc__relrec {
  const gpuipc_buffer *buf;
  uint32_t slot;
  uint64_t seq;
  struct CUevent_st *local; /* event mode: completes after the release */
} gpuipc__relrec;

typedef struct gpuipc__lease_table {
  /* Immutable after gpuipc__lease_open. */
  int peer_pid;
  gpuipc__peer *peer; /* a reference */
  gpuipc_arena *ctl_arena; /* where the flag words live */
  gpuipc_block *ctl;       /* the flag words (2 * nslots) */
  int ordinal;             /* the device of the flag words */
  uint32_t nslots;
  gpuipc__reclaimer rc;    /* orders reuse after this peer's releases */
  /* Everything below: lease.c only. */
  struct gpuipc__lease_table *next_orphan;
  struct gpuipc__watch *owatch; /* an orphan's watch (NULL: none) */
  bool dead_handled; /* the peer's death was handled (words forced) */
  gpuipc__txs *tx;
  uint32_t *tx_free;
  uint32_t tx_nfree;
  uint64_t tx_seq;
  size_t tx_out;
  gpuipc__relrec *rel;
  size_t nrel, caprel;
  struct CUstream_st *evq; /* event mode: where releases are awaited */
  int stats_slot; /* the connection's stats slot (0: none, or closed) */
} gpuipc__lease_table;

/* Makes the lease table of a connection to the peer (pid, start time as
 * the kernel vouched for them; a reference is taken): nslots slots, their flag words (zeroed) in
 * the process's flag-word arena on device `ordinal`. */
gpuipc_status gpuipc__lease_open(int ordinal, uint32_t nslots,
                                 gpuipc__peer *peer,
                                 gpuipc__lease_table **out /* OUT */);
/* Our side closes the connection: frees the table now if that is safe,
 * else keeps it as an orphan until the peer released everything or its
 * process is gone. Takes ownership of lt. */
void gpuipc__lease_close(gpuipc__lease_table *lt);
/* The connection ended (the peer left): once the peer process is gone,
 * everything it held comes back. Called again and again (cheap). */
void gpuipc__lease_poll(gpuipc__lease_table *lt);

/* Frees the orphans whose peers released everything or are gone (their
 * leases reclaimed first). Cheap when there are none; checks at most every
 * few milliseconds. */
void gpuipc__lease_reap_orphans(bool now);
/* The same at once (no rate limit); returns how many orphans are left. */
size_t gpuipc__lease_reap_orphans_now(void);

/* n distinct free slots (not taken), or false when fewer are free. */
bool gpuipc__lease_free_slots(const gpuipc__lease_table *lt, uint32_t n,
                              uint32_t *slots /* OUT: n */);
/* The next sequence number (used up by the call), or 0 when the
 * connection reached GPUIPC__SEQ_LIMIT. */
uint64_t gpuipc__lease_new_seq(gpuipc__lease_table *lt);
/* The frame of `slot` left: the slot is taken. Until gpuipc__lease_add,
 * it holds nothing (a slot whose send failed halfway stays taken). */
void gpuipc__lease_take_slot(gpuipc__lease_table *lt, uint32_t slot);
/* The peer holds block (or buf) in slot, lease seq. */
void gpuipc__lease_add(gpuipc__lease_table *lt, uint32_t slot,
                       gpuipc_block *block, gpuipc_buffer *buf, uint64_t seq,
                       bool ordered, bool by_event);
/* The last write of slot's ready word: value and stream (0/NULL: none). */
void gpuipc__lease_last_write(const gpuipc__lease_table *lt, uint32_t slot,
                              uint64_t *seq /* OUT */,
                              struct CUstream_st **stream /* OUT */);
/* The word and value that signal the release of slot's last lease (what a
 * write of its ready word from another stream waits for first). */
void gpuipc__lease_last_release(const gpuipc__lease_table *lt, uint32_t slot,
                                uint32_t *word_slot /* OUT */,
                                uint64_t *value /* OUT */);
/* The ready word of slot was written with seq on stream. */
void gpuipc__lease_written(gpuipc__lease_table *lt, uint32_t slot,
                           uint64_t seq, struct CUstream_st *stream);
/* The lease seq sent in slot needed no ready write: recorded as the
 * slot's last write all the same, by no stream (the next write, from any
 * stream, then waits for this lease's release; a dead peer's release word
 * is forced), the record it replaces kept (see stand_in). */
void gpuipc__lease_written_stand_in(gpuipc__lease_table *lt, uint32_t slot,
                                    uint64_t seq);
/* Event mode: the slot's ready event (ours; NULL until made). */
gpuipc_event *gpuipc__lease_ready_event(const gpuipc__lease_table *lt,
                                        uint32_t slot);
void gpuipc__lease_set_ready_event(gpuipc__lease_table *lt, uint32_t slot,
                                   gpuipc_event *ev);
/* Event mode: the peer's release event of slot. wants: true when slot is
 * valid and has none yet; set takes ownership of ev. */
bool gpuipc__lease_wants_release_event(const gpuipc__lease_table *lt,
                                       uint32_t slot);
void gpuipc__lease_set_release_event(gpuipc__lease_table *lt, uint32_t slot,
                                     gpuipc_event *ev);
/* A REL frame: the peer gave these back. A non-OK status is a protocol
 * violation (unknown slot or sequence number, a bad flag); nothing is
 * applied then. An entry flagged GPUIPC__REL_BY_NEXT is awaited on the
 * word of the first later entry without the flag. */
gpuipc_status gpuipc__lease_released(gpuipc__lease_table *lt,
                                     const gpuipc__w_rel *rel, size_t n);
/* An ABANDON frame: the peer ends the connection and still holds only the
 * n leases named (the others it never used, and will not release): those
 * come back now, without waiting for release words. A non-OK status is a
 * protocol violation (a lease it does not hold); nothing is applied then. */
gpuipc_status gpuipc__lease_abandoned(gpuipc__lease_table *lt,
                                      const gpuipc__w_rel *held, size_t n);
/* Moves up to cap release records of buf into out (the caller now owns
 * their events); returns how many. */
size_t gpuipc__lease_take_releases(gpuipc__lease_table *lt,
                                   const gpuipc_buffer *buf,
                                   gpuipc__relrec *out /* OUT */, size_t cap);
/* Leases the peer holds on buf; leases it holds in all. */
unsigned gpuipc__lease_buffer_holders(const gpuipc__lease_table *lt,
                                      const gpuipc_buffer *buf);
/* Leases the peer holds on an arena block. */
unsigned gpuipc__lease_block_holders(const gpuipc__lease_table *lt,
                                     const gpuipc_block *block);
size_t gpuipc__lease_outstanding(const gpuipc__lease_table *lt);

#endif /* GPUIPC_LEASE_INT_H */
