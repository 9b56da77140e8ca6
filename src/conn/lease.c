/*
 * lease.c: owns the sender's lease tables: per connection, the flag words
 * and which of our blocks and buffers the peer holds in each slot; what a
 * release does (the arena orders reuse after the consumer's GPU-side
 * release); and what happens when a peer dies: everything it held is
 * reclaimed once its process is gone. A table whose connection closed while
 * the peer still held something lives on as an orphan until the peer
 * released everything or its process is gone; orphans are checked in the
 * arena calls that depend on them (allocation, statistics, destroy), which
 * reach here through the reaper this file gives arena.c
 * (gpuipc__arena_set_reaper), so that the arena never calls up. It also
 * owns the peer process handle (a pidfd taken at the handshake; without
 * one, /proc's start time and thread count) that decides when a peer is
 * gone, and the peer watcher thread (on by default).
 *
 * Why reclaiming after a peer's death is safe: a consumer's GPU work on our
 * memory runs in the consumer's CUDA context. When the process exits or is
 * killed, the driver tears that context down (its work is aborted or has
 * finished) before the process is reaped, so once the whole process has
 * exited (its pidfd, taken at the handshake, becomes readable) nothing can
 * touch the memory any more. A process whose main thread exited while
 * other threads run is not gone (its /proc state letter says 'Z', which is
 * why the letter decides nothing).
 * A closed socket alone is not enough (a process may close the socket and
 * keep running GPU work), which is why, without an orderly BYE, gpuipc
 * waits for the process. The pid comes from the kernel (SCM_CREDENTIALS at
 * the handshake) and is paired with the process start time, so a reused
 * pid is not mistaken for the peer. A peer in a pid namespace this process
 * cannot see (a sibling container) has no pid here (the kernel reports 0):
 * its pidfd is the one the kernel gives of the socket's peer
 * (SO_PEERPIDFD), taken at the handshake, and decides alone.
 *
 * A dead peer never writes its "released" flag words, and the arena's
 * reclaim stream may already wait on some of them; gpuipc writes the words
 * itself (side stream) so that those waits pass.
 */
#include "lease_int.h"
#include "core/stats.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void orphan_add(gpuipc__lease_table *lt);
static bool words_settled(gpuipc__lease_table *lt);
static struct gpuipc__watch *watch_new(gpuipc__peer *peer, int pid,
                                       bool orphan, void (*on_exit)(void *),
                                       void *ctx);
static void watch_unlink(struct gpuipc__watch *w);
static void watch_free(struct gpuipc__watch *w);

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* Without a pidfd: true while /proc has a process with this pid and start
 * time that has a thread left. The state letter does not say "gone": a
 * process whose main thread called pthread_exit shows 'Z' while its other
 * threads run; the thread count does. */
static bool proc_alive(int pid, uint64_t start_time) {
  if (pid <= 0)
    return false;
  if (start_time != 0) {
    uint64_t st = gpuipc__process_start_time(pid);
    if (st == 0 && (errno == ENOENT || errno == ESRCH))
      return false;
    if (st != 0 && st != start_time)
      return false; /* the pid now names another process */
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", pid);
  long threads = 0;
  gpuipc_status s = gpuipc__proc_field(path, "Threads", &threads, NULL);
  if (s == GPUIPC_E_SYSTEM)
    return true; /* unknown: assume alive */
  if (s == GPUIPC_E_NOT_FOUND)
    return false;
  return s == GPUIPC_E_NOT_SUPPORTED || threads > 0;
}

gpuipc__peer *gpuipc__peer_open(int pid, uint64_t start_time) {
  gpuipc__peer *p = calloc(1, sizeof *p);
  if (p == NULL)
    return NULL;
  atomic_init(&p->refs, 1);
  p->pid = pid;
  p->start_time = start_time;
  p->pidfd = pid > 0 ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
  if (p->pidfd >= 0) {
    (void)fcntl(p->pidfd, F_SETFD, FD_CLOEXEC);
    /* The pidfd names whatever process has the pid now: it must be the
     * one the handshake saw (same start time), checked after the open. */
    uint64_t st = gpuipc__process_start_time(pid);
    if (start_time != 0 && st != start_time) {
      close(p->pidfd);
      p->pidfd = -1;
      p->mismatch = true;
    }
  }
  return p;
}

gpuipc__peer *gpuipc__peer_from_pidfd(int pidfd) {
  gpuipc__peer *p = calloc(1, sizeof *p);
  if (p == NULL) {
    close(pidfd);
    return NULL;
  }
  atomic_init(&p->refs, 1);
  p->pidfd = pidfd;
  return p;
}

int gpuipc__peer_pidfd(const gpuipc__peer *p) {
  return p != NULL ? p->pidfd : -1;
}

gpuipc__peer *gpuipc__peer_ref(gpuipc__peer *p) {
  if (p)
    atomic_fetch_add(&p->refs, 1);
  return p;
}

void gpuipc__peer_unref(gpuipc__peer *p) {
  if (p == NULL || atomic_fetch_sub(&p->refs, 1) > 1)
    return;
  if (p->pidfd >= 0)
    close(p->pidfd);
  free(p);
}

bool gpuipc__peer_gone(const gpuipc__peer *p) {
  if (p == NULL)
    return false; /* unknown: assume alive */
  if (p->mismatch)
    return true;
  if (p->pidfd < 0)
    return !proc_alive(p->pid, p->start_time);
  /* Readable once every thread of the process has exited. */
  struct pollfd pf = {p->pidfd, POLLIN, 0};
  int r;
  GPUIPC__EINTR_RETRY(r, poll(&pf, 1, 0));
  return r > 0;
}

/* ---- the table ---------------------------------------------------------------------- */

static void lease_free(gpuipc__lease_table *lt) {
  if (lt->owatch) {
    watch_unlink(lt->owatch);
    lt->owatch = NULL;
  }
  if (lt->ctl) {
    /* The flag words go back to the arena after every wait on them that
     * this table's reclaim stream queued (a marker recorded there). */
    gpuipc__block_free_after(lt->ctl, lt->rc.stream ? &lt->rc : NULL);
    gpuipc__arena_user_remove(lt->ctl_arena);
    lt->ctl = NULL;
  }
  gpuipc__ctx_guard g;
  bool in = lt->ordinal >= 0 && gpuipc__ctx_enter(&g, lt->ordinal) == GPUIPC_OK;
  if (in)
    gpuipc__reclaimer_close(&lt->rc);
  if (lt->tx)
    for (uint32_t s = 0; s < lt->nslots; s++) {
      gpuipc_event_destroy(lt->tx[s].ready_ev);
      gpuipc_event_destroy(lt->tx[s].rel_ev);
    }
  for (size_t i = 0; i < lt->nrel; i++)
    if (lt->rel[i].local)
      GPUIPC__CU(cuEventDestroy, (CUevent)lt->rel[i].local);
  if (lt->evq)
    GPUIPC__CU(cuStreamDestroy, (CUstream)lt->evq);
  if (in)
    gpuipc__ctx_leave(&g);
  free(lt->tx);
  free(lt->tx_free);
  free(lt->rel);
  gpuipc__peer_unref(lt->peer);
  free(lt);
}

gpuipc_status gpuipc__lease_open(int ordinal, uint32_t nslots,
                                 gpuipc__peer *peer,
                                 gpuipc__lease_table **out) {
  *out = NULL;
  gpuipc_arena *a = NULL;
  GPUIPC__CHECK(gpuipc__ctl_arena(ordinal, &a));
  gpuipc__lease_table *lt = calloc(1, sizeof *lt);
  if (lt == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "lease table");
  lt->peer = gpuipc__peer_ref(peer);
  lt->peer_pid = peer ? peer->pid : 0;
  lt->ordinal = -1;
  gpuipc_status s;
  lt->tx = calloc(nslots, sizeof *lt->tx);
  lt->tx_free = malloc(sizeof *lt->tx_free * nslots);
  if (lt->tx == NULL || lt->tx_free == NULL) {
    s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "%u slots", nslots);
    goto fail;
  }
  for (uint32_t i = 0; i < nslots; i++)
    lt->tx_free[i] = nslots - 1 - i;
  lt->tx_nfree = nslots;
  lt->nslots = nslots;
  GPUIPC__CHECK_GOTO(gpuipc__arena_take(a, 16u * nslots, a->side, true,
                                        &lt->ctl),
                     s, fail);
  gpuipc__arena_user_add(a);
  lt->ctl_arena = a;
  lt->ordinal = a->ordinal;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, a->ordinal), s, fail);
  /* Fresh words start at 0 (the memory may have held anything). */
  s = gpuipc__reclaimer_open(&lt->rc);
  if (s != GPUIPC_OK) {
    gpuipc__ctx_leave(&g);
    goto fail;
  }
  CUresult r = GPUIPC__CU(cuMemsetD32Async, (CUdeviceptr)lt->ctl->ptr, 0,
                          lt->ctl->len / 4, (CUstream)a->side);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamSynchronize, (CUstream)a->side);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemsetD32Async", "connection flag words");
    goto fail;
  }
  *out = lt;
  return GPUIPC_OK;
fail:
  lease_free(lt);
  return s;
}

bool gpuipc__lease_free_slots(const gpuipc__lease_table *lt, uint32_t n,
                              uint32_t *slots) {
  if (lt->tx_nfree < n)
    return false;
  /* From the top of the stack: gpuipc__lease_take_slot finds each first. */
  for (uint32_t i = 0; i < n; i++)
    slots[i] = lt->tx_free[lt->tx_nfree - 1 - i];
  return true;
}

uint64_t gpuipc__lease_new_seq(gpuipc__lease_table *lt) {
  if (lt->tx_seq + 1 >= GPUIPC__SEQ_LIMIT)
    return 0; /* a receiver would refuse it */
  return ++lt->tx_seq;
}

void gpuipc__lease_take_slot(gpuipc__lease_table *lt, uint32_t slot) {
  for (uint32_t i = lt->tx_nfree; i-- > 0;)
    if (lt->tx_free[i] == slot) {
      lt->tx_free[i] = lt->tx_free[--lt->tx_nfree];
      return;
    }
}

void gpuipc__lease_add(gpuipc__lease_table *lt, uint32_t slot,
                       gpuipc_block *block, gpuipc_buffer *buf, uint64_t seq,
                       bool ordered, bool by_event) {
  gpuipc__txs *t = &lt->tx[slot];
  if (block)
    gpuipc__block_hold(block);
  if (buf)
    gpuipc__buffer_lease_begin(buf); /* kept while the peer holds it */
  t->block = block;
  t->buf = buf;
  t->seq = seq;
  t->ordered = ordered;
  t->by_event = by_event;
  t->rel_seq = 0; /* known at its release */
  lt->tx_out++;
  gpuipc__stats_lease_begin(lt->stats_slot, slot);
}

void gpuipc__lease_last_write(const gpuipc__lease_table *lt, uint32_t slot,
                              uint64_t *seq, struct CUstream_st **stream) {
  *seq = lt->tx[slot].last_seq;
  *stream = lt->tx[slot].last_stream;
}

void gpuipc__lease_last_release(const gpuipc__lease_table *lt, uint32_t slot,
                                uint32_t *word_slot, uint64_t *value) {
  const gpuipc__txs *t = &lt->tx[slot];
  *word_slot = t->rel_seq ? t->rel_slot : slot;
  *value = t->rel_seq ? t->rel_seq : t->last_seq;
}

void gpuipc__lease_written(gpuipc__lease_table *lt, uint32_t slot,
                           uint64_t seq, struct CUstream_st *stream) {
  lt->tx[slot].last_seq = seq;
  lt->tx[slot].last_stream = stream;
  lt->tx[slot].stand_in = false;
}

void gpuipc__lease_written_stand_in(gpuipc__lease_table *lt, uint32_t slot,
                                    uint64_t seq) {
  gpuipc__txs *t = &lt->tx[slot];
  /* The slot's previous lease was released (its slot is free again): its
   * release's word is known now. */
  t->prev_seq = t->last_seq;
  t->prev_stream = t->last_stream;
  gpuipc__lease_last_release(lt, slot, &t->prev_rel_slot, &t->prev_rel_seq);
  t->last_seq = seq;
  /* No stream wrote it: the next write, from whatever stream, first
   * waits for this lease's release. Naming the send's stream here let a
   * write from it skip that wait while the slot's last real write, from
   * another stream, was still queued: the word went back when that one
   * ran (the consumer's wait for the older buffer passed on the newer
   * value, its wait for the newer one never ended). */
  t->last_stream = NULL;
  t->stand_in = true;
}

/* A release that wrote no word (GPUIPC__REL_COMPLETE) of a lease whose
 * send wrote none: the slot's record is again what it was before it. */
static void stand_in_undone(gpuipc__txs *t) {
  t->last_seq = t->prev_seq;
  t->last_stream = t->prev_stream;
  t->rel_slot = t->prev_rel_slot;
  t->rel_seq = t->prev_seq != 0 ? t->prev_rel_seq : 0;
  t->stand_in = false;
}

gpuipc_event *gpuipc__lease_ready_event(const gpuipc__lease_table *lt,
                                        uint32_t slot) {
  return lt->tx[slot].ready_ev;
}

void gpuipc__lease_set_ready_event(gpuipc__lease_table *lt, uint32_t slot,
                                   gpuipc_event *ev) {
  lt->tx[slot].ready_ev = ev;
}

bool gpuipc__lease_wants_release_event(const gpuipc__lease_table *lt,
                                       uint32_t slot) {
  return slot < lt->nslots && lt->tx[slot].rel_ev == NULL;
}

void gpuipc__lease_set_release_event(gpuipc__lease_table *lt, uint32_t slot,
                                     gpuipc_event *ev) {
  lt->tx[slot].rel_ev = ev;
}

/* Drops the release records of buf (a handed-over buffer whose owner is
 * not ordered on them any more: its peer never used it, or is gone).
 * Context current. */
static void drop_releases(gpuipc__lease_table *lt, const gpuipc_buffer *buf) {
  size_t k = 0;
  for (size_t i = 0; i < lt->nrel; i++) {
    if (lt->rel[i].buf != buf) {
      lt->rel[k++] = lt->rel[i];
      continue;
    }
    if (lt->rel[i].local)
      GPUIPC__CU(cuEventDestroy, (CUevent)lt->rel[i].local);
  }
  lt->nrel = k;
}

/* Context current. A buffer's lease reference goes last: for a buffer
 * handed over (gpuipc_buffer_release_when_done) it may be the last one,
 * which closes it and calls its owner back (in this thread). */
static void slot_free(gpuipc__lease_table *lt, uint32_t slot) {
  gpuipc_buffer *buf = lt->tx[slot].buf;
  lt->tx[slot].block = NULL;
  lt->tx[slot].buf = NULL;
  lt->tx[slot].seq = 0;
  lt->tx_free[lt->tx_nfree++] = slot;
  lt->tx_out--;
  gpuipc__stats_lease_end(lt->stats_slot, slot);
  if (buf) {
    if (gpuipc__buffer_handed(buf, NULL))
      drop_releases(lt, buf);
    gpuipc__buffer_lease_end(buf);
  }
}

size_t gpuipc__lease_outstanding(const gpuipc__lease_table *lt) {
  return lt->tx_out;
}

unsigned gpuipc__lease_buffer_holders(const gpuipc__lease_table *lt,
                                      const gpuipc_buffer *buf) {
  unsigned n = 0;
  for (uint32_t i = 0; i < lt->nslots; i++)
    n += lt->tx[i].buf == buf;
  return n;
}

unsigned gpuipc__lease_block_holders(const gpuipc__lease_table *lt,
                                     const gpuipc_block *block) {
  unsigned n = 0;
  for (uint32_t i = 0; i < lt->nslots; i++)
    n += lt->tx[i].block == block;
  return n;
}

size_t gpuipc__lease_take_releases(gpuipc__lease_table *lt,
                                   const gpuipc_buffer *buf,
                                   gpuipc__relrec *out, size_t cap) {
  size_t k = 0, n = 0;
  for (size_t i = 0; i < lt->nrel; i++) {
    if (lt->rel[i].buf == buf && n < cap)
      out[n++] = lt->rel[i];
    else
      lt->rel[k++] = lt->rel[i];
  }
  lt->nrel = k;
  return n;
}

/* ---- releases ---------------------------------------------------------------------- */

/* Orders `stream` (the owner's of a handed-over buffer) after one
 * release record (consumed: its local event destroyed). The legacy stream
 * waits through the table's private stream and an event. Context
 * current. */
static gpuipc_status order_one(gpuipc__lease_table *lt,
                               struct CUstream_st *stream,
                               gpuipc__relrec r) {
  CUresult e = CUDA_SUCCESS;
  if (r.local) {
    e = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream, (CUevent)r.local, 0);
    GPUIPC__CU(cuEventDestroy, (CUevent)r.local);
  } else {
    CUdeviceptr word = (CUdeviceptr)gpuipc__released_word(
        lt->ctl->ptr, lt->nslots, r.slot);
    bool legacy = (stream == NULL || (uintptr_t)stream == 0x1);
    if (legacy && lt->evq == NULL) {
      CUstream st;
      e = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
      if (e == CUDA_SUCCESS)
        lt->evq = (struct CUstream_st *)st;
    }
    CUstream ws = legacy ? (CUstream)lt->evq : (CUstream)stream;
    if (e == CUDA_SUCCESS)
      e = GPUIPC__CU(cuStreamWaitValue64, ws, word, (cuuint64_t)r.seq,
                     CU_STREAM_WAIT_VALUE_GEQ);
    if (e == CUDA_SUCCESS && legacy) {
      CUevent ev = NULL;
      e = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
      if (e == CUDA_SUCCESS)
        e = GPUIPC__CU(cuEventRecord, ev, ws);
      if (e == CUDA_SUCCESS)
        e = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream, ev, 0);
      if (ev)
        GPUIPC__CU(cuEventDestroy, ev);
    }
  }
  if (e != CUDA_SUCCESS)
    return gpuipc__fail_cuda(e, "cuStreamWaitValue64",
                             "ordering the owner's stream after a release "
                             "of a handed-over buffer");
  return GPUIPC_OK;
}

static gpuipc_status order_owner(gpuipc__lease_table *lt,
                                 const gpuipc_buffer *buf,
                                 struct CUstream_st *stream,
                                 gpuipc__relrec now) {
  gpuipc_status s = GPUIPC_OK;
  gpuipc__relrec recs[32];
  size_t n;
  while ((n = gpuipc__lease_take_releases(lt, buf, recs,
                                          GPUIPC__ARRAY_SIZE(recs))) > 0)
    for (size_t i = 0; i < n; i++) {
      gpuipc_status o = order_one(lt, stream, recs[i]);
      if (s == GPUIPC_OK)
        s = o;
    }
  gpuipc_status o = order_one(lt, stream, now);
  return s == GPUIPC_OK ? o : s;
}

/* A released buffer outside any arena: its owner orders reuse with
 * gpuipc_conn_buffer_wait, which needs this release's word (or, in event
 * mode, a local event that completes after the peer's release record).
 * Context current. */
static gpuipc_status release_buffer(gpuipc__lease_table *lt, uint32_t slot,
                                    uint32_t wslot, uint64_t wseq,
                                    bool complete) {
  gpuipc__txs *t = &lt->tx[slot];
  gpuipc_status s = GPUIPC_OK;
  struct CUevent_st *local = NULL;
  if (complete) {
    /* Its holder's use completed: no record for the owner to wait on. */
    slot_free(lt, slot);
    return GPUIPC_OK;
  }
  if (t->by_event) {
    /* The release event is recorded again when the slot comes back;
     * capture this record now on a private stream, and remember a local
     * event that completes after it. */
    CUresult r = CUDA_SUCCESS;
    if (lt->evq == NULL) {
      CUstream st;
      r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
      if (r == CUDA_SUCCESS)
        lt->evq = (struct CUstream_st *)st;
    }
    CUevent ev = NULL;
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)lt->evq,
                     (CUevent)gpuipc_event_get_handle(t->rel_ev), 0);
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuEventRecord, ev, (CUstream)lt->evq);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuStreamWaitEvent", "release event");
    local = (struct CUevent_st *)ev;
  }
  struct CUstream_st *owner_stream = NULL;
  if (gpuipc__buffer_handed(t->buf, &owner_stream) && (t->ordered || local)) {
    /* Handed over: its owner's stream is ordered now, after this release
     * and any earlier one of it recorded here, and no record is kept. */
    gpuipc_status os = order_owner(lt, t->buf, owner_stream,
                                   (gpuipc__relrec){t->buf, wslot, wseq, local});
    if (os != GPUIPC_OK && s == GPUIPC_OK)
      s = os;
  } else if (t->ordered || local) {
    if (lt->nrel == lt->caprel) {
      /* At most 4096 records (16 doubled). */
      gpuipc__relrec *nr =
          lt->caprel >= 4096 ? NULL
                             : gpuipc__grow(lt->rel, &lt->caprel,
                                            lt->nrel + 1, sizeof *nr, 16);
      if (nr != NULL) {
        lt->rel = nr;
      } else if (lt->nrel > 0) {
        /* Bounded: the oldest record goes (its buffer was never waited
         * for). */
        if (lt->rel[0].local)
          GPUIPC__CU(cuEventDestroy, (CUevent)lt->rel[0].local);
        memmove(lt->rel, lt->rel + 1, sizeof *lt->rel * (lt->nrel - 1));
        lt->nrel--;
      }
    }
    if (lt->nrel < lt->caprel)
      lt->rel[lt->nrel++] = (gpuipc__relrec){t->buf, wslot, wseq, local};
    else if (local)
      GPUIPC__CU(cuEventDestroy, (CUevent)local);
  }
  slot_free(lt, slot);
  return s;
}

gpuipc_status gpuipc__lease_released(gpuipc__lease_table *lt,
                                     const gpuipc__w_rel *rel, size_t n) {
  /* Validate everything first: a frame is applied whole or not at all. */
  for (size_t i = 0; i < n; i++) {
    if (rel[i].slot >= lt->nslots ||
        (lt->tx[rel[i].slot].block == NULL &&
         lt->tx[rel[i].slot].buf == NULL) ||
        lt->tx[rel[i].slot].seq != rel[i].seq)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "release of slot %u sequence %llu, which the peer "
                          "does not hold",
                          rel[i].slot, (unsigned long long)rel[i].seq);
    for (size_t k = 0; k < i; k++)
      if (rel[k].slot == rel[i].slot)
        return gpuipc__fail(GPUIPC_E_PROTOCOL, "slot %u released twice",
                            rel[i].slot);
    bool complete = (rel[i].flags & GPUIPC__REL_COMPLETE) != 0;
    if (lt->tx[rel[i].slot].by_event && lt->tx[rel[i].slot].rel_ev == NULL)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "release of slot %u without its event", rel[i].slot);
    /* A complete release only of a lease whose send wrote no ready word
     * (stand_in: set or cleared by every send of an ordered connection
     * before its lease exists): after one that did, the peer's stream
     * waited, and its release must write its word (a later write of ours
     * may wait for it). Not in event mode, whose release is its event. */
    if (complete && (lt->tx[rel[i].slot].by_event ||
                     (lt->tx[rel[i].slot].ordered &&
                      !lt->tx[rel[i].slot].stand_in)))
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "release of slot %u: flags 0x%x refused (COMPLETE "
                          "of a buffer whose ready word was written, or of "
                          "event mode)",
                          rel[i].slot, rel[i].flags);
    if ((rel[i].flags & ~(GPUIPC__REL_BY_NEXT | GPUIPC__REL_COMPLETE)) ||
        (complete && (rel[i].flags & GPUIPC__REL_BY_NEXT)) ||
        ((rel[i].flags & GPUIPC__REL_BY_NEXT) &&
         (i + 1 == n || !lt->tx[rel[i].slot].ordered ||
          rel[i + 1].slot >= lt->nslots || !lt->tx[rel[i + 1].slot].ordered ||
          (rel[i + 1].flags & GPUIPC__REL_COMPLETE))))
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "release of slot %u: flags 0x%x refused (BY_NEXT "
                          "only between two ordered leases whose next wrote "
                          "its word, never last; COMPLETE never with "
                          "BY_NEXT)",
                          rel[i].slot, rel[i].flags);
  }
  /* The word that signals each release: its own, or that of the end of
   * its chain of BY_NEXT entries. */
  uint32_t wslot[GPUIPC__REL_MAX];
  uint64_t wseq[GPUIPC__REL_MAX];
  if (n > GPUIPC__REL_MAX)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "REL frame of %zu entries", n);
  for (size_t i = n; i-- > 0;) {
    bool chained = (rel[i].flags & GPUIPC__REL_BY_NEXT) != 0;
    wslot[i] = chained ? wslot[i + 1] : rel[i].slot;
    wseq[i] = chained ? wseq[i + 1] : rel[i].seq;
    /* A complete release wrote no word, of a lease that wrote no ready
     * word: the slot's record goes back to the write before it, whose
     * release wrote its word (it had a wait). */
    if (rel[i].flags & GPUIPC__REL_COMPLETE) {
      if (lt->tx[rel[i].slot].stand_in)
        stand_in_undone(&lt->tx[rel[i].slot]);
    } else if (lt->tx[rel[i].slot].ordered) {
      lt->tx[rel[i].slot].rel_slot = wslot[i];
      lt->tx[rel[i].slot].rel_seq = wseq[i];
    }
  }
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, lt->ordinal));
  gpuipc_status s = GPUIPC_OK;
  /* Grouped by arena: one marker per arena per frame. */
  gpuipc__release rs[64];
  size_t i = 0;
  while (i < n) {
    gpuipc__txs *t0 = &lt->tx[rel[i].slot];
    bool complete0 = (rel[i].flags & GPUIPC__REL_COMPLETE) != 0;
    if (t0->buf) {
      gpuipc_status bs = release_buffer(lt, rel[i].slot, wslot[i], wseq[i],
                                        complete0);
      if (bs != GPUIPC_OK && s == GPUIPC_OK)
        s = bs;
      i++;
      continue;
    }
    gpuipc_arena *a = t0->block->arena;
    int nb = 0;
    while (i < n && nb < 64 && lt->tx[rel[i].slot].block != NULL &&
           lt->tx[rel[i].slot].block->arena == a) {
      uint32_t slot = rel[i].slot;
      gpuipc__txs *t = &lt->tx[slot];
      gpuipc__release *r = &rs[nb++];
      /* A complete release: its holder's use completed, nothing to wait
       * for (no marker either). */
      bool complete = (rel[i].flags & GPUIPC__REL_COMPLETE) != 0;
      *r = (gpuipc__release){t->block, 0, 0, NULL,
                             !complete && (t->ordered || t->by_event)};
      if (!complete && t->ordered) {
        /* Reuse waits, on the GPU, for the consumer's release write (a
         * chain's entries all for its end's: the arena queues that wait
         * once). */
        r->word = gpuipc__released_word(lt->ctl->ptr, lt->nslots, wslot[i]);
        r->value = wseq[i];
      } else if (!complete && t->by_event) {
        /* The same with the consumer's release event; the wait captures
         * its record now, before the slot can be used again. */
        r->event = (struct CUevent_st *)gpuipc_event_get_handle(t->rel_ev);
      }
      slot_free(lt, slot);
      i++;
    }
    gpuipc_status as = gpuipc__arena_release(a, &lt->rc, rs, nb, false);
    if (as != GPUIPC_OK && s == GPUIPC_OK)
      s = as;
  }
  gpuipc__ctx_leave(&g);
  gpuipc__buffer_done_flush();
  (void)gpuipc__arena_given_retry();
  if (s != GPUIPC_OK)
    GPUIPC__WARN("lease", "ordering reuse after a release failed: %s",
                 gpuipc_last_error());
  return GPUIPC_OK;
}

gpuipc_status gpuipc__lease_abandoned(gpuipc__lease_table *lt,
                                      const gpuipc__w_rel *held, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (held[i].slot >= lt->nslots ||
        (lt->tx[held[i].slot].block == NULL &&
         lt->tx[held[i].slot].buf == NULL) ||
        lt->tx[held[i].slot].seq != held[i].seq)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "ABANDON names slot %u sequence %llu, which the "
                          "peer does not hold",
                          held[i].slot, (unsigned long long)held[i].seq);
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, lt->ordinal));
  size_t back = 0;
  for (uint32_t s = 0; s < lt->nslots; s++) {
    gpuipc__txs *t = &lt->tx[s];
    if (t->block == NULL && t->buf == NULL)
      continue;
    bool kept = false;
    for (size_t i = 0; i < n && !kept; i++)
      kept = held[i].slot == s;
    if (kept)
      continue;
    back++;
    if (t->buf) {
      slot_free(lt, s);
      continue;
    }
    /* Never used by the peer: no release word to wait for; its reuse
     * still follows the waits queued for earlier leases of this peer. */
    gpuipc__release r = {t->block, 0, 0, NULL, t->ordered || t->by_event};
    gpuipc_arena *a = t->block->arena;
    slot_free(lt, s);
    (void)gpuipc__arena_release(a, &lt->rc, &r, 1, true);
  }
  gpuipc__ctx_leave(&g);
  gpuipc__buffer_done_flush();
  (void)gpuipc__arena_given_retry();
  GPUIPC__INFO("lease",
               "peer pid %d ended the connection on its own error: %zu "
               "lease(s) back, %zu still held",
               lt->peer_pid, back, n);
  return GPUIPC_OK;
}

/* ---- a dead peer --------------------------------------------------------------------- */

/* The peer is gone and its process too: everything it held comes back. */
static void reclaim_dead(gpuipc__lease_table *lt) {
  if (lt->dead_handled)
    return;
  lt->dead_handled = true;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, lt->ordinal) != GPUIPC_OK) {
    GPUIPC__WARN("lease", "cannot reclaim blocks of dead peer %d: %s",
                 lt->peer_pid, gpuipc_last_error());
    return;
  }
  /* Unblock waits on the dead peer's "released" words: write a value past
   * every sequence number it could have been given. GEQ compares with
   * wrap-around (signed difference), so the value must stay within 2^63
   * of them: tx_seq + 2^40 does. */
  uint64_t value = lt->tx_seq + ((uint64_t)1 << 40);
  uint64_t words[256];
  int nw = 0;
  gpuipc_arena *ca = lt->ctl_arena;
  for (uint32_t s = 0; s < lt->nslots; s++) {
    if (lt->tx[s].rel_ev)
      /* Event mode: a record of ours completes, which waits for the dead
       * peer's last record accept too. */
      (void)gpuipc_event_record(lt->tx[s].rel_ev, ca->side);
    if (lt->tx[s].last_seq == 0)
      continue;
    words[nw++] = gpuipc__released_word(lt->ctl->ptr, lt->nslots, s);
    if (nw == (int)GPUIPC__ARRAY_SIZE(words)) {
      gpuipc__arena_force_words(ca, words, nw, value);
      nw = 0;
    }
  }
  if (nw)
    gpuipc__arena_force_words(ca, words, nw, value);
  size_t n = 0;
  for (uint32_t s = 0; s < lt->nslots; s++) {
    gpuipc__txs *t = &lt->tx[s];
    if (t->buf) {
      slot_free(lt, s); /* the caller's buffer: nothing to give back */
      n++;
      continue;
    }
    if (t->block == NULL)
      continue;
    /* The block's reuse must still come after any reclaim wait already
     * queued for it: the newest marker covers them. */
    gpuipc__release r = {t->block, 0, 0, NULL, t->ordered || t->by_event};
    gpuipc_arena *a = t->block->arena;
    slot_free(lt, s);
    (void)gpuipc__arena_release(a, &lt->rc, &r, 1, true);
    n++;
  }
  gpuipc__ctx_leave(&g);
  gpuipc__buffer_done_flush();
  (void)gpuipc__arena_given_retry();
  if (n)
    GPUIPC__INFO("lease", "reclaimed %zu block(s) held by dead peer pid %d", n,
                 lt->peer_pid);
}

void gpuipc__lease_poll(gpuipc__lease_table *lt) {
  if (lt == NULL || lt->dead_handled)
    return;
  /* The peer left. Once its process is gone, reclaim what it held and
   * write the release words it can no longer write (see the top of this
   * file for why the closed socket alone is not enough). */
  if (gpuipc__peer_gone(lt->peer))
    reclaim_dead(lt);
}

/* True when every "released" word already holds the newest release the
 * peer sent (so no wait on them can still be pending). Reads the words
 * from the device (a small copy). */
static bool words_settled(gpuipc__lease_table *lt) {
  if (lt->tx_out > 0)
    return false;
  uint64_t *w = malloc(sizeof *w * lt->nslots);
  if (w == NULL)
    return false;
  bool settled = false;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, lt->ordinal) == GPUIPC_OK) {
    if (gpuipc__arena_read_words(
            lt->ctl_arena, gpuipc__released_word(lt->ctl->ptr, lt->nslots, 0),
            lt->nslots, w) == GPUIPC_OK) {
      settled = true;
      for (uint32_t s = 0; s < lt->nslots && settled; s++) {
        uint32_t ws;
        uint64_t v;
        gpuipc__lease_last_release(lt, s, &ws, &v);
        if (lt->tx[s].last_seq != 0 && (int64_t)(w[ws] - v) < 0)
          settled = false;
      }
    }
    gpuipc__ctx_leave(&g);
  }
  free(w);
  return settled;
}

void gpuipc__lease_close(gpuipc__lease_table *lt) {
  if (lt == NULL)
    return;
  lt->stats_slot = 0; /* the connection's slot goes with it */
  if (!lt->dead_handled) {
    if (gpuipc__peer_gone(lt->peer)) {
      reclaim_dead(lt);
    } else if (lt->tx_out > 0 || !words_settled(lt)) {
      /* The peer lives and still holds blocks, or its GPU has not yet
       * written releases it announced: keep the table until it is done or
       * gone. */
      orphan_add(lt);
      return;
    }
  }
  lease_free(lt);
}

/* ---- orphans ------------------------------------------------------------------------ */

/* The lock guards the list only: the checks (a /proc read, a small device
 * copy) and the reclaim run outside it, on tables taken off the list. */
static pthread_mutex_t orphan_lock = PTHREAD_MUTEX_INITIALIZER;
static gpuipc__lease_table *orphans;
static atomic_int n_orphans;

static void orphan_add(gpuipc__lease_table *lt) {
  GPUIPC__DEBUG("lease",
                "connection to pid %d closed while it holds %zu block(s): "
                "reclaimed when that process is gone",
                lt->peer_pid, lt->tx_out);
  /* The watcher reaps it when the peer's process exits, with no call of
   * the application's (what the table keeps, handed-over buffers among
   * them, comes back then); without a pidfd, calls reap it. */
  if (lt->owatch == NULL && gpuipc__peer_pidfd(lt->peer) >= 0)
    lt->owatch = watch_new(lt->peer, lt->peer_pid, true, NULL, NULL);
  pthread_mutex_lock(&orphan_lock);
  lt->next_orphan = orphans;
  orphans = lt;
  atomic_fetch_add(&n_orphans, 1);
  pthread_mutex_unlock(&orphan_lock);
  /* From now on the arenas' public calls reclaim first what orphans of
   * departed peers held, so that an allocation can reuse it and the
   * statistics and destroy see it. */
  gpuipc__arena_set_reaper(gpuipc__lease_reap_orphans);
}

static void reap(void);

/* Reaps in progress (another thread's, the watcher's above all): a caller
 * that must see their result (now) waits for them. in_reap: this thread
 * is inside one (a reclaim that comes back here neither reaps nor waits). */
static pthread_mutex_t reaping_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reaping_done = PTHREAD_COND_INITIALIZER;
static int reaping;
static _Thread_local bool in_reap;

void gpuipc__lease_reap_orphans(bool now) {
  if (now && !in_reap) {
    if (atomic_load(&n_orphans) > 0)
      reap();
    /* Bounded (2 s): a reap is a pass over the orphans, never a wait. */
    pthread_mutex_lock(&reaping_lock);
    for (int i = 0; reaping > 0 && i < 200; i++) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 10000000L;
      if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
      }
      pthread_cond_timedwait(&reaping_done, &reaping_lock, &ts);
    }
    pthread_mutex_unlock(&reaping_lock);
    return;
  }
  if (GPUIPC__LIKELY(atomic_load_explicit(&n_orphans, memory_order_relaxed) ==
                     0))
    return;
  /* Checking costs a /proc read (and maybe a small device copy) per
   * orphan: at most every few milliseconds. */
  static _Atomic uint64_t last_poll;
  uint64_t t = gpuipc__now_ns();
  uint64_t prev = atomic_load(&last_poll);
  if (t - prev < 5000000ull ||
      !atomic_compare_exchange_strong(&last_poll, &prev, t))
    return;
  reap();
}

size_t gpuipc__lease_reap_orphans_now(void) {
  if (atomic_load(&n_orphans) > 0)
    reap();
  return (size_t)atomic_load(&n_orphans);
}

static void reap_pass(void);

static void reap(void) {
  if (in_reap)
    return;
  in_reap = true;
  pthread_mutex_lock(&reaping_lock);
  reaping++;
  pthread_mutex_unlock(&reaping_lock);
  reap_pass();
  pthread_mutex_lock(&reaping_lock);
  reaping--;
  pthread_cond_broadcast(&reaping_done);
  pthread_mutex_unlock(&reaping_lock);
  in_reap = false;
}

static void reap_pass(void) {
  pthread_mutex_lock(&orphan_lock);
  gpuipc__lease_table *list = orphans;
  orphans = NULL;
  pthread_mutex_unlock(&orphan_lock);
  gpuipc__lease_table *keep = NULL, *keep_tail = NULL;
  while (list) {
    gpuipc__lease_table *lt = list;
    list = lt->next_orphan;
    lt->next_orphan = NULL;
    bool gone = gpuipc__peer_gone(lt->peer);
    if (gone || (lt->tx_out == 0 && words_settled(lt))) {
      if (gone)
        reclaim_dead(lt);
      lease_free(lt);
      atomic_fetch_sub(&n_orphans, 1);
      continue;
    }
    if (keep_tail)
      keep_tail->next_orphan = lt;
    else
      keep = lt;
    keep_tail = lt;
  }
  if (keep_tail) {
    pthread_mutex_lock(&orphan_lock);
    keep_tail->next_orphan = orphans;
    orphans = keep;
    pthread_mutex_unlock(&orphan_lock);
  }
}

/* ---- the peer watcher (the default: gpuipc_conn_options.watch_peer) ------------------ */

/* One process-wide thread sleeps in poll on the pidfds of the watched
 * peers (every connection's, unless its options said watch_peer = 0) and,
 * when one's process has exited, writes the flag words our streams may
 * wait for (the ready words of its buffers, the release words of our
 * leases), so those streams run on without any call from the application.
 * It is started by the first watch and ends when the list is empty. It
 * holds no descriptor of its own (a process's descriptor count is the
 * application's to budget): a change of the list is picked up when its
 * poll next times out (WATCH_RESCAN_MS), and a peer that exited meanwhile
 * is found gone then. The connection's thread publishes where the words
 * are and the newest sequence numbers through atomics (the fast path's
 * per-buffer cost: one atomic store); a watch's mutex keeps the words
 * mapped while the thread writes them (the connection's close takes it
 * before unmapping). The list's lock is never held across a driver call.
 *
 * A child forked from a process with the thread has none (threads do not
 * survive fork): the first watch it adds starts its own. */

#define WATCH_RESCAN_MS 100

static pthread_mutex_t watch_lock = PTHREAD_MUTEX_INITIALIZER;
static struct gpuipc__watch *watches;
static size_t nwatches;
static pid_t watcher_pid; /* the process whose thread runs (0: none) */
static pthread_once_t watch_atfork_once = PTHREAD_ONCE_INIT;

/* Writes value into each of n 64-bit words from base, on device ordinal,
 * and waits for the writes (on a stream of the watcher's own). */
static void watch_write(int ordinal, uint64_t base, uint32_t n,
                        uint64_t value) {
  static struct CUstream_st *streams[64];
  if (ordinal < 0 || ordinal >= 64 || base == 0)
    return;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, ordinal) != GPUIPC_OK)
    return;
  CUresult r = CUDA_SUCCESS;
  if (streams[ordinal] == NULL) {
    CUstream st;
    r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
    if (r == CUDA_SUCCESS)
      streams[ordinal] = (struct CUstream_st *)st;
  }
  for (uint32_t s = 0; r == CUDA_SUCCESS && s < n; s++)
    r = GPUIPC__CU(cuStreamWriteValue64, (CUstream)streams[ordinal],
                   (CUdeviceptr)(base + 8u * (uint64_t)s), (cuuint64_t)value,
                   0);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamSynchronize, (CUstream)streams[ordinal]);
  if (r != CUDA_SUCCESS)
    GPUIPC__WARN("lease", "watcher: unblocking flag words failed: %s",
                 gpuipc__cuda_error_name(r));
  gpuipc__ctx_leave(&g);
}

/* The peer's process exited: unblock what may wait for it. mu held. */
static void watch_fire(struct gpuipc__watch *w) {
  w->fired = true;
  GPUIPC__INFO("lease", "watcher: peer pid %d exited; unblocking its flag "
                          "words",
               w->pid);
  uint64_t rb = atomic_load_explicit(&w->rx_base, memory_order_acquire);
  if (rb && atomic_load(&w->rx_max) > 0)
    watch_write(atomic_load(&w->rx_ordinal), rb, atomic_load(&w->rx_nslots),
                atomic_load(&w->rx_max));
  /* The peer's broadcast words (it is dead: no consumer can be ahead of
   * its work any more). */
  for (int k = 0; rb && k < GPUIPC__BWORDS_MAX; k++) {
    uint64_t a = atomic_load_explicit(&w->bw_addr[k], memory_order_acquire);
    if (a)
      watch_write(atomic_load(&w->rx_ordinal), a, 1, atomic_load(&w->bw_max[k]));
  }
  uint64_t tb = atomic_load_explicit(&w->tx_base, memory_order_acquire);
  if (tb) {
    uint32_t n = atomic_load(&w->tx_nslots);
    /* Past every sequence number the peer was given, within 2^63 of them
     * (GEQ compares with wrap-around), as the lease table's reclaim. */
    watch_write(atomic_load(&w->tx_ordinal), gpuipc__released_word(tb, n, 0),
                n, atomic_load(&w->tx_seq) + ((uint64_t)1 << 40));
  }
}

/* Takes the fired exit watches out of the list and calls their
 * application's functions, no lock held. */
static void watch_run_exits(void) {
  struct gpuipc__watch *done = NULL;
  pthread_mutex_lock(&watch_lock);
  for (struct gpuipc__watch **pp = &watches; *pp;) {
    struct gpuipc__watch *w = *pp;
    pthread_mutex_lock(&w->mu);
    bool take = w->on_exit && w->fired;
    pthread_mutex_unlock(&w->mu);
    if (!take) {
      pp = &w->next;
      continue;
    }
    *pp = w->next;
    nwatches--;
    w->next = done;
    done = w;
  }
  pthread_mutex_unlock(&watch_lock);
  while (done) {
    struct gpuipc__watch *w = done;
    done = w->next;
    GPUIPC__DEBUG("lease", "watcher: peer pid %d exited; calling the "
                           "application's exit call",
                  w->pid);
    w->on_exit(w->on_exit_ctx);
    watch_free(w);
  }
}

static void *watcher(void *arg) {
  (void)arg;
  struct pollfd *pf = NULL;
  struct gpuipc__watch **ws = NULL;
  size_t cap = 0;
  for (;;) {
    /* Every peer not fired yet (the arrays grow with the list; without
     * memory, the first cap of them until the next pass). */
    nfds_t n = 0;
    pthread_mutex_lock(&watch_lock);
    if (nwatches == 0) {
      watcher_pid = 0; /* the next watch starts a thread again */
      pthread_mutex_unlock(&watch_lock);
      break;
    }
    if (cap < nwatches) {
      /* Two arrays under one capacity, and a failure tolerated (not
       * gpuipc__grow's one array that fails whole). */
      size_t want = nwatches + 16;
      struct pollfd *npf = realloc(pf, want * sizeof *pf);
      if (npf)
        pf = npf;
      struct gpuipc__watch **nws = npf ? realloc(ws, want * sizeof *ws) : NULL;
      if (nws) {
        ws = nws;
        cap = want;
      }
    }
    for (struct gpuipc__watch *w = watches; w && n < cap; w = w->next) {
      pthread_mutex_lock(&w->mu);
      bool fired = w->fired;
      pthread_mutex_unlock(&w->mu);
      if (fired)
        continue;
      ws[n] = w;
      pf[n++] = (struct pollfd){gpuipc__peer_pidfd(w->peer), POLLIN, 0};
    }
    pthread_mutex_unlock(&watch_lock);
    if (n == 0) {
      (void)poll(NULL, 0, WATCH_RESCAN_MS);
      continue;
    }
    if (poll(pf, n, WATCH_RESCAN_MS) <= 0)
      continue;
    bool reap_now = false, exits_now = false;
    for (nfds_t i = 0; i < n; i++) {
      if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      /* Still watched? Its mutex is taken under the list's lock, so a
       * concurrent removal waits for the writes to be done. */
      pthread_mutex_lock(&watch_lock);
      struct gpuipc__watch *w = watches;
      while (w && w != ws[i])
        w = w->next;
      if (w)
        pthread_mutex_lock(&w->mu);
      pthread_mutex_unlock(&watch_lock);
      if (w == NULL)
        continue;
      /* Asked again: the fd polled may have been closed and its number
       * (or the record's address) reused since the list was read. */
      if (!w->fired && gpuipc__peer_gone(w->peer)) {
        if (w->orphan)
          w->fired = reap_now = true;
        else if (w->on_exit)
          w->fired = exits_now = true;
        else
          watch_fire(w);
      }
      pthread_mutex_unlock(&w->mu);
    }
    /* Orphans of peers that exited: reaped here, no lock held (done
     * callbacks of handed-over buffers may run). */
    if (reap_now)
      (void)gpuipc__lease_reap_orphans_now();
    if (exits_now)
      watch_run_exits();
  }
  free(pf);
  free(ws);
  return NULL;
}

/* fork: the child has a copy of every lock; none may be held by the
 * watcher thread (gone in the child) at that moment. */
static void watch_atfork_prepare(void) {
  pthread_mutex_lock(&watch_lock);
  for (struct gpuipc__watch *w = watches; w; w = w->next)
    pthread_mutex_lock(&w->mu);
}

static void watch_atfork_parent(void) {
  for (struct gpuipc__watch *w = watches; w; w = w->next)
    pthread_mutex_unlock(&w->mu);
  pthread_mutex_unlock(&watch_lock);
}

static void watch_atfork_child(void) {
  watch_atfork_parent();
  watcher_pid = 0; /* the thread is the parent's */
  reaping = 0;     /* and so are the reaps it was making */
  /* The exit calls are the parent's: each runs once, there. The child's
   * copies go without being called (its first watch would start a
   * watcher here that called them again). */
  for (struct gpuipc__watch **pp = &watches; *pp;) {
    struct gpuipc__watch *w = *pp;
    if (w->on_exit == NULL) {
      /* A connection's or an orphan table's: its flag words, streams and
       * leases are the parent's CUDA state, which a forked child must not
       * touch (the driver is not fork-safe: a lock held at the fork by
       * another of the parent's threads stays held here, and the child's
       * watcher hung in it before its own exit calls). Kept in the list,
       * for its connection's close, but never fired here. */
      w->fired = true;
      pp = &w->next;
      continue;
    }
    *pp = w->next;
    nwatches--;
    watch_free(w);
  }
}

static void watch_atfork_register(void) {
  (void)pthread_atfork(watch_atfork_prepare, watch_atfork_parent,
                       watch_atfork_child);
}

/* Starts the thread of this process if none runs (watch_lock held). When
 * it cannot (logged), the watches wait for the next watch's try. */
static void watcher_start(void) {
  if (watcher_pid == getpid())
    return;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  /* The watcher takes no signals: they are the application's. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t t;
  int rc = pthread_create(&t, &attr, watcher, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    GPUIPC__WARN("lease", "peer watcher: pthread_create: %s; a dead peer is "
                          "noticed in the next call on its connection",
                 strerror(rc));
    return;
  }
  /* Named, so that ps, a debugger and the tests tell it from the
   * application's threads. */
  (void)pthread_setname_np(t, "gpuipc-watch");
  watcher_pid = getpid();
}

gpuipc_status gpuipc__watch_add(gpuipc_conn *c) {
  if (gpuipc__peer_pidfd(c->peer) < 0) {
    /* Nothing to sleep on (a kernel without pidfds, or a peer of a pid
     * namespace this process cannot see on one without SO_PEERPIDFD): the
     * connection works as without the watcher. */
    GPUIPC__DEBUG("lease", "peer watcher: no pidfd of peer pid %d; not "
                           "watched",
                  c->peer_pid);
    return GPUIPC_OK;
  }
  struct gpuipc__watch *w = watch_new(c->peer, c->peer_pid, false, NULL, NULL);
  if (w == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "peer watch");
  c->watch = w;
  return GPUIPC_OK;
}

/* A watch of peer (a reference is taken), in the list, the thread
 * started; NULL without memory. */
static struct gpuipc__watch *watch_new(gpuipc__peer *peer, int pid,
                                       bool orphan, void (*on_exit)(void *),
                                       void *ctx) {
  struct gpuipc__watch *w = calloc(1, sizeof *w);
  if (w == NULL)
    return NULL;
  w->peer = gpuipc__peer_ref(peer);
  w->pid = pid;
  w->orphan = orphan;
  w->on_exit = on_exit;
  w->on_exit_ctx = ctx;
  pthread_mutex_init(&w->mu, NULL);
  atomic_init(&w->rx_ordinal, -1);
  atomic_init(&w->tx_ordinal, -1);
  pthread_once(&watch_atfork_once, watch_atfork_register);
  pthread_mutex_lock(&watch_lock);
  w->next = watches;
  watches = w;
  nwatches++;
  watcher_start();
  pthread_mutex_unlock(&watch_lock);
  return w;
}

gpuipc_status gpuipc__watch_exit(gpuipc__peer *peer, int pid,
                                 void (*fn)(void *), void *ctx) {
  if (gpuipc__peer_gone(peer)) {
    fn(ctx);
    return GPUIPC_OK;
  }
  if (gpuipc__peer_pidfd(peer) < 0)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "call_when_peer_exits: the exit of peer pid %d cannot "
                        "be told here (no pidfd of it)",
                        pid);
  /* A peer that exits from here on makes its pidfd readable: the thread
   * finds it at its next poll (at most WATCH_RESCAN_MS after the add). */
  if (watch_new(peer, pid, false, fn, ctx) == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "call_when_peer_exits");
  return GPUIPC_OK;
}

void gpuipc__watch_run_due_exits(void) {
  bool any = false;
  pthread_mutex_lock(&watch_lock);
  for (struct gpuipc__watch *w = watches; w; w = w->next) {
    if (w->on_exit == NULL)
      continue;
    pthread_mutex_lock(&w->mu);
    if (!w->fired && gpuipc__peer_gone(w->peer))
      w->fired = any = true;
    pthread_mutex_unlock(&w->mu);
  }
  pthread_mutex_unlock(&watch_lock);
  if (any)
    watch_run_exits();
}

void gpuipc__watch_remove(gpuipc_conn *c) {
  struct gpuipc__watch *w = c->watch;
  if (w == NULL)
    return;
  c->watch = NULL;
  watch_unlink(w);
}

static void watch_unlink(struct gpuipc__watch *w) {
  pthread_mutex_lock(&watch_lock);
  for (struct gpuipc__watch **pp = &watches; *pp; pp = &(*pp)->next)
    if (*pp == w) {
      *pp = w->next;
      nwatches--;
      break;
    }
  pthread_mutex_unlock(&watch_lock);
  /* Writes in progress end before the words may be unmapped. */
  pthread_mutex_lock(&w->mu);
  pthread_mutex_unlock(&w->mu);
  watch_free(w);
}

/* Frees a watch out of the list (no thread can reach it any more). */
static void watch_free(struct gpuipc__watch *w) {
  pthread_mutex_destroy(&w->mu);
  gpuipc__peer_unref(w->peer);
  free(w);
}
