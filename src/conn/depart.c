/*
 * depart.c: owns the top of the fast path, where a connection ends: the
 * hook table through which the frame layer (frames.c) reaches the fast
 * path, the peer's departure (our streams unblocked, its broadcast words
 * written once its process is gone), ABANDON when this side breaks, close
 * (what we hold released and the receiver side unmapped once its GPU work
 * is done), and the receiver sides a close had to keep mapped. It sits above tx.c,
 * rx.c and handoff.c and may call all of them; none of them calls it.
 */
#include "handoff_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

/* ---- peer departure ------------------------------------------------------------------ */

static void ho_poll(gpuipc_conn *c);

/* We break the connection on our own error: every buffer the caller holds
 * (received, not released) stays ours until released locally; everything
 * else the peer sent us (queued, or in frames we will not read) we never
 * used. Say so, so that the peer need not wait for our process to exit. */
static void ho_breaking(gpuipc_conn *c) {
  struct gpuipc__ho *h = c->ho;
  gpuipc__w_rel held[4096];
  size_t n = 0;
  /* Before the peer's flag words came (no receiver side yet) we hold
   * nothing: the ABANDON names nothing, and everything comes back. */
  for (uint32_t s = 0; h != NULL && h->rx != NULL && s < h->peer_nslots;
       s++) {
    if (h->rx[s].held == 0)
      continue;
    bool queued = false;
    for (uint32_t i = 0; i < h->qlen && !queued; i++)
      queued = h->q[(h->qhead + i) % h->peer_nslots].w.slot == s;
    if (queued)
      continue;
    if (n == GPUIPC__ARRAY_SIZE(held))
      return; /* too many to name: the peer waits for our exit */
    held[n++] = (gpuipc__w_rel){h->rx[s].held, s, 0};
  }
  (void)gpuipc__conn_send_frame(c, GPUIPC__F_ABANDON, held, n * sizeof *held,
                                NULL, 0, NULL, 0, 0);
}

/* The peer's broadcast words (see on_bufw): other consumers of the
 * producer wait on them too, so they are written here only once its
 * process is gone (no consumer can then be ahead of its work; a producer
 * that lives wrote them before it sent the frames, or will). Called when
 * the connection ended, again from ho_poll and close until done. */
static bool bw_force(const gpuipc__peer *peer, struct gpuipc__ho *h) {
  if (h->bw_forced || h->nbw == 0 || !gpuipc__peer_gone(peer))
    return false;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, h->peer_ordinal) != GPUIPC_OK)
    return false;
  CUresult r = CUDA_SUCCESS;
  if (h->unblock == NULL) {
    CUstream st;
    r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
    if (r == CUDA_SUCCESS)
      h->unblock = (struct CUstream_st *)st;
  }
  for (int k = 0; r == CUDA_SUCCESS && k < h->nbw; k++)
    r = GPUIPC__CU(cuStreamWriteValue64, (CUstream)h->unblock,
                   (CUdeviceptr)h->bw[k].addr, (cuuint64_t)h->bw[k].max, 0);
  gpuipc__ctx_leave(&g);
  if (r == CUDA_SUCCESS)
    h->bw_forced = true;
  else
    GPUIPC__WARN("handoff",
                 "could not unblock streams waiting on dead peer %d's "
                 "broadcast words: %s",
                 h->peer_pid, gpuipc__cuda_error_name(r));
  return true; /* writes were queued on h->unblock (some, at least) */
}

/* Our streams may wait for ready words the producer will never write (it
 * died, or we close while its work before a send has not completed):
 * write them ourselves, into our own mapping of its memory (which stays
 * mapped until we close), so nothing hangs. The data those streams then
 * read is whatever the memory holds: the caller learns from
 * GPUIPC_E_PEER_GONE (or from closing) that it is not to be trusted.
 * `dead`: the producer died (event mode: see rx_stuck). */
static void unblock_ready(gpuipc_conn *c, struct gpuipc__ho *h, bool dead) {
  if (!h->rx_unblocked && h->have_peer_ctl && h->rx_max_seq > 0) {
    h->rx_unblocked = true;
    gpuipc__ctx_guard g;
    if (gpuipc__ctx_enter(&g, h->peer_ordinal) == GPUIPC_OK) {
      CUresult r = CUDA_SUCCESS;
      if (h->unblock == NULL) {
        CUstream st;
        r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
        if (r == CUDA_SUCCESS)
          h->unblock = (struct CUstream_st *)st;
      }
      for (uint32_t s = 0; r == CUDA_SUCCESS && s < h->peer_nslots; s++) {
        if (h->rx[s].last_recv == 0)
          continue;
        if (h->rx[s].ready_ev && dead) {
          /* A wait (cuStreamWaitEvent) captured the producer's record that
           * was current when it was enqueued; if that record is still
           * pending, the dead producer's work before it will never run,
           * and on a real driver nothing releases the wait (a later
           * record, ours included, does not). Remember it: close must not
           * wait for the device then. */
          CUresult q = GPUIPC__CU(
              cuEventQuery, (CUevent)gpuipc_event_get_handle(h->rx[s].ready_ev));
          if (q != CUDA_SUCCESS && !h->rx_stuck) {
            h->rx_stuck = true;
            GPUIPC__WARN("handoff",
                         "peer %d died with an interprocess event pending: "
                         "streams that wait on it may stay blocked "
                         "(GPUIPC_ORDER_EVENT cannot release them)",
                         c->peer_pid);
          }
          /* A record of ours completes, which a wait for the dead
           * producer's earlier record accepts too on drivers that track
           * an event as one completion state. */
          (void)gpuipc_event_record(h->rx[s].ready_ev, h->unblock);
        }
        r = GPUIPC__CU(cuStreamWriteValue64, (CUstream)h->unblock,
                       (CUdeviceptr)gpuipc__ready_word(h->peer_ctl, s),
                       (cuuint64_t)h->rx_max_seq, 0);
      }

      if (r != CUDA_SUCCESS)
        GPUIPC__WARN("handoff",
                     "could not unblock streams waiting on peer %d: %s",
                     c->peer_pid, gpuipc__cuda_error_name(r));
      gpuipc__ctx_leave(&g);
    }
  }
}

static void ho_peer_gone(gpuipc_conn *c) {
  struct gpuipc__ho *h = c->ho;
  if (h == NULL)
    return;
  /* Buffers that arrived but were not received: the producer's work on
   * them may never complete; drop them. */
  for (uint32_t i = 0; i < h->qlen; i++) {
    gpuipc__qbuf *q = &h->q[(h->qhead + i) % h->peer_nslots];
    h->rx[q->w.slot].held = 0;
    if (h->rx[q->w.slot].imp) {
      gpuipc_buffer_close(h->rx[q->w.slot].imp);
      h->rx[q->w.slot].imp = NULL;
    }
  }
  h->qlen = 0;
  if (!c->peer_said_bye)
    unblock_ready(c, h, true);
  ho_poll(c);
}

static void ho_poll(gpuipc_conn *c) {
  struct gpuipc__ho *h = c->ho;
  gpuipc__lease_reap_orphans(false);
  (void)gpuipc__handoff_held_poll();
  (void)gpuipc__arena_given_retry();
  if (h == NULL || c->state == GPUIPC__CONN_OPEN)
    return;
  /* The peer left: once its process is gone, what it held comes back,
   * and its broadcast words are written. */
  gpuipc__lease_poll(h->lt);
  bw_force(c->peer, h);
}

/* How long close waits for GPU work gpuipc queued: the connection's
 * timeout (1 s when that is 0). */
static uint64_t close_deadline(const gpuipc_conn *c) {
  if (c->timeout_ms < 0)
    return UINT64_MAX;
  int ms = c->timeout_ms > 0 ? c->timeout_ms : 1000;
  return gpuipc__now_ns() + (uint64_t)ms * 1000000ull;
}

/* True when each of the peer's broadcast words holds the newest value a
 * stream of ours waits for (read here through our mapping, on our private
 * stream): no wait of ours on them is pending, so their memory may be
 * unmapped. We never write them while the peer lives (its other consumers
 * wait on them too). Context current. */
static bool bw_reached(struct gpuipc__ho *h) {
  if (h->nbw == 0)
    return true;
  bool any = false;
  for (int k = 0; k < h->nbw; k++)
    any |= h->bw[k].waited != 0;
  if (!any)
    return true; /* none was ever waited on */
  if (h->unblock == NULL)
    return false;
  for (int k = 0; k < h->nbw; k++) {
    if (h->bw[k].waited == 0)
      continue;
    uint64_t v = 0;
    CUresult r = GPUIPC__CU(cuMemcpyDtoHAsync, &v, (CUdeviceptr)h->bw[k].addr,
                            sizeof v, (CUstream)h->unblock);
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuStreamSynchronize, (CUstream)h->unblock);
    if (r != CUDA_SUCCESS || (int64_t)(v - h->bw[k].waited) < 0)
      return false;
  }
  return true;
}

/* Waits (polling, until deadline) for every slot's last release write,
 * the work queued so far on our private streams, the closing imports'
 * events, and the peer's broadcast words. True when all of it completed
 * (an event that reports an error counts as not complete). Context
 * current. */
static bool drain(const gpuipc__peer *peer, struct gpuipc__ho *h,
                  uint64_t deadline) {
  if (h->rx_unknown)
    return false;
  CUevent own[2] = {NULL, NULL};
  struct CUstream_st *streams[2] = {h->unblock, h->lq[1]};
  bool ok = true;
  for (int i = 0; i < 2 && ok; i++) {
    if (streams[i] == NULL)
      continue;
    ok = GPUIPC__CU(cuEventCreate, &own[i], CU_EVENT_DISABLE_TIMING) ==
         CUDA_SUCCESS;
    if (ok)
      ok = GPUIPC__CU(cuEventRecord, own[i], (CUstream)streams[i]) ==
           CUDA_SUCCESS;
  }
  bool done = false;
  while (ok) {
    /* A producer that dies while we wait: its broadcast words are ours
     * to write from then on, which lets the waits queued on them (and
     * everything queued after those) complete. Those writes go into the
     * memory unmapped after us: what is waited for covers them too. */
    if (bw_force(peer, h) && h->unblock != NULL) {
      if (own[0] == NULL)
        ok = GPUIPC__CU(cuEventCreate, &own[0], CU_EVENT_DISABLE_TIMING) ==
             CUDA_SUCCESS;
      if (ok)
        ok = GPUIPC__CU(cuEventRecord, own[0], (CUstream)h->unblock) ==
             CUDA_SUCCESS;
      if (!ok)
        break;
    }
    done = true;
    for (int i = 0; i < 2 && done; i++)
      done = own[i] == NULL || GPUIPC__CU(cuEventQuery, own[i]) == CUDA_SUCCESS;
    for (uint32_t s = 0; h->rx && s < h->peer_nslots && done; s++)
      done = h->rx[s].rel_done == NULL ||
             GPUIPC__CU(cuEventQuery, (CUevent)h->rx[s].rel_done) ==
                 CUDA_SUCCESS;
    for (size_t i = 0; i < h->nclosing && done; i++)
      done = GPUIPC__CU(cuEventQuery, (CUevent)h->closing[i].ev) ==
             CUDA_SUCCESS;
    if (done)
      done = bw_reached(h);
    if (done || gpuipc__now_ns() >= deadline)
      break;
    usleep(200);
  }
  for (int i = 0; i < 2; i++)
    if (own[i])
      GPUIPC__CU(cuEventDestroy, own[i]);
  return done;
}

/* The receiver side's own resources: the relay stream, the events, the
 * tables (the imports closed or handed on before). */
static void rx_free(struct gpuipc__ho *h) {
  /* The receiver's relay stream: its queued work finishes on its own
   * (cuStreamDestroy lets it), and its writes target memory of ours or
   * mappings of the peer that stay until the work is done (the device was
   * synchronized above whenever something is unmapped). */
  gpuipc__ho_free_lq(h, 1, h->peer_ordinal);
  free(h->closing);
  h->closing = NULL;
  if (h->rx)
    for (uint32_t s = 0; s < h->peer_nslots; s++) {
      gpuipc_event_destroy(h->rx[s].ready_ev);
      gpuipc_event_destroy(h->rx[s].rel_ev);
      if (h->rx[s].rel_done || h->rx[s].join_ev) {
        gpuipc__ctx_guard g;
        if (gpuipc__ctx_enter(&g, h->peer_ordinal) == GPUIPC_OK) {
          if (h->rx[s].rel_done)
            GPUIPC__CU(cuEventDestroy, (CUevent)h->rx[s].rel_done);
          if (h->rx[s].join_ev)
            GPUIPC__CU(cuEventDestroy, (CUevent)h->rx[s].join_ev);
          gpuipc__ctx_leave(&g);
        }
      }
    }
  free(h->imp);
  free(h->rx);
  free(h->q);
  h->imp = NULL;
  h->rx = NULL;
  h->q = NULL;
}

/* After drain() said so: unmaps what the receiver side imported (its
 * private stream, the closing imports, the chunks). Context current. */
static void unmap_drained(struct gpuipc__ho *h) {
  if (h->unblock)
    GPUIPC__CU(cuStreamDestroy, (CUstream)h->unblock);
  h->unblock = NULL;
  gpuipc__ho_poll_closing(h, true);
  for (int i = 0; i < h->nimp; i++)
    gpuipc_buffer_close(h->imp[i].buf);
  h->nimp = 0;
}

/* ---- imports kept past a close ----------------------------------------------------- */

/* A connection closed before GPU work on its imports completed (the
 * peer's broadcast words not reached, or work of ours still queued, at
 * the close's deadline) keeps its receiver side here, imports mapped: a
 * later close or progress of any connection finishes it once that work
 * completed, or once the peer is gone (its broadcast words are then ours
 * to write). So a peer that never signals keeps its own memory mapped
 * here for as long as it lives, and no longer. */
typedef struct held_ho {
  struct gpuipc__ho *h;
  gpuipc__peer *peer;
  struct held_ho *next;
} held_ho;
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;
static held_ho *held_list;
static atomic_int held_count;

static void held_add(struct gpuipc__ho *h, gpuipc__peer *peer) {
  held_ho *e = malloc(sizeof *e);
  if (e == NULL) {
    rx_free(h); /* the imports stay mapped, for the life of the process */
    free(h);
    return;
  }
  e->h = h;
  e->peer = gpuipc__peer_ref(peer);
  pthread_mutex_lock(&held_lock);
  e->next = held_list;
  held_list = e;
  atomic_fetch_add(&held_count, 1);
  pthread_mutex_unlock(&held_lock);
}

/* Finishes the kept connections whose work completed (none waits). */
size_t gpuipc__handoff_held_poll(void) {
  if (atomic_load(&held_count) == 0)
    return 0;
  held_ho *done = NULL;
  pthread_mutex_lock(&held_lock);
  for (held_ho **pp = &held_list; *pp;) {
    held_ho *e = *pp;
    struct gpuipc__ho *h = e->h;
    gpuipc__ctx_guard g;
    bool ok = false;
    if (gpuipc__ctx_enter(&g, h->peer_ordinal) == GPUIPC_OK) {
      ok = drain(e->peer, h, 0);
      if (ok)
        unmap_drained(h);
      gpuipc__ctx_leave(&g);
    }
    if (ok) {
      *pp = e->next;
      e->next = done;
      done = e;
      atomic_fetch_sub(&held_count, 1);
    } else {
      pp = &e->next;
    }
  }
  size_t left = (size_t)atomic_load(&held_count);
  pthread_mutex_unlock(&held_lock);
  while (done) {
    held_ho *e = done;
    done = e->next;
    GPUIPC__DEBUG("handoff", "unmapped what the connection to peer %d "
                             "kept since its close",
                  e->h->peer_pid);
    rx_free(e->h);
    free(e->h);
    gpuipc__peer_unref(e->peer);
    free(e);
  }
  return left;
}

size_t gpuipc_conn_collect(void) {
  gpuipc__watch_run_due_exits();
  size_t n = gpuipc__lease_reap_orphans_now();
  n += gpuipc__arena_given_retry();
  return n + gpuipc__handoff_held_poll();
}

gpuipc_status gpuipc_conn_call_when_peer_exits(gpuipc_conn *conn,
                                               void (*done)(void *ctx),
                                               void *ctx) {
  if (conn == NULL || done == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "call_when_peer_exits: NULL connection or function");
  if (conn->peer == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "call_when_peer_exits: the connection has no peer "
                        "(its handshake did not complete)");
  return gpuipc__watch_exit(conn->peer, conn->peer_pid, done, ctx);
}

static void ho_close(gpuipc_conn *c) {
  struct gpuipc__ho *h = c->ho;
  c->ho = NULL;
  (void)gpuipc__handoff_held_poll();
  /* The watcher writes into memory unmapped below: it stops first. */
  gpuipc__watch_remove(c);
  /* Receiver side: give back what we hold, ordered after the legacy
   * stream, and say goodbye. */
  int sync_ordinal = -1;
  bool all_released = true;
  if (h->rx)
    unblock_ready(c, h, false);
  if (h->rx) {
    if (c->state == GPUIPC__CONN_OPEN) {
      c->ho = h; /* the transport may dispatch frames while we send */
      (void)gpuipc__conn_pump(c, 0, NULL, NULL);
      c->ho = NULL;
    }
    for (uint32_t s = 0; s < h->peer_nslots; s++) {
      if (h->rx[s].held == 0)
        continue;
      gpuipc__w_rel rel = {h->rx[s].held, s, 0};
      bool open = c->state == GPUIPC__CONN_OPEN;
      /* A buffer still queued (never handed to the caller, so no GPU work
       * of ours uses it) is released like the others: its release word is
       * written too, since the producer's reuse waits for it on the GPU. */
      /* A release that could not be written is not announced: the
       * producer then keeps the lease until our process is gone (and no
       * BYE below says that everything was released). */
      /* On the stream it was received on: the release, and the unmapping
       * below, come after our wait there (see gpuipc__rxs.waited). */
      struct CUstream_st *rs = h->rx[s].waited ? h->rx[s].recv_stream : NULL;
      if (gpuipc__ho_release_slot(c, h, s, rs, open) != GPUIPC_OK) {
        all_released = false;
        if (h->rx[s].waited)
          h->rx_unknown = true; /* our wait there may still read the words */
      }
      else if (open)
        (void)gpuipc__conn_send_frame(c, GPUIPC__F_REL, &rel, sizeof rel, NULL,
                                      0, NULL, 0, 0);
    }
    h->qlen = 0;
    sync_ordinal = h->peer_ordinal;
  }
  if (c->state == GPUIPC__CONN_OPEN && all_released)
    (void)gpuipc__conn_send_frame(c, GPUIPC__F_BYE, NULL, 0, NULL, 0, NULL, 0,
                                  0);
  if (h->rx_stuck && (h->nimp > 0 || h->nclosing > 0)) {
    /* Streams of ours wait on a dead producer's event record that never
     * completes: synchronizing would hang, and unmapping memory that their
     * queued work may still touch is not safe. The mappings stay (leaked
     * for the life of the process). */
    GPUIPC__WARN("handoff",
                 "closing the connection to dead peer %d without waiting for "
                 "the device: %d imported chunk(s) and %zu buffer(s) stay "
                 "mapped (streams wait on its interprocess events)",
                 c->peer_pid, h->nimp, h->nclosing);
    gpuipc__ctx_guard g;
    if (gpuipc__ctx_enter(&g, h->peer_ordinal) == GPUIPC_OK) {
      if (h->unblock)
        GPUIPC__CU(cuStreamDestroy, (CUstream)h->unblock);
      for (size_t i = 0; i < h->nclosing; i++)
        GPUIPC__CU(cuEventDestroy, (CUevent)h->closing[i].ev);
      gpuipc__ctx_leave(&g);
    }
    h->unblock = NULL;
    h->nimp = 0;
    h->nclosing = 0;
  }
  bool keep = false;
  if (h->nimp > 0 || h->nclosing > 0) {
    /* The imported memory is unmapped below; GPU work of ours that may
     * still use it (the release writes just queued, and the work the
     * caller queued before each release) must be done first. Our streams
     * that wait on the peer's ready words were unblocked above; what is
     * waited for is only what gpuipc queued (on the streams releases were
     * written on, its own streams, the closing imports' events), within
     * the connection's timeout. */
    if (sync_ordinal < 0 && h->nimp > 0)
      sync_ordinal = h->imp[0].ordinal;
    if (sync_ordinal < 0)
      sync_ordinal = 0;
    bool drained = false;
    gpuipc__ctx_guard g;
    if (gpuipc__ctx_enter(&g, sync_ordinal) == GPUIPC_OK) {
      drained = drain(c->peer, h, close_deadline(c));
      if (drained)
        unmap_drained(h);
      gpuipc__ctx_leave(&g);
    }
    if (!drained) {
      /* Not unmapped under work that may still read it: kept, and
       * finished by a later call once that work completed, or once the
       * peer is gone (its broadcast words are then ours to write). */
      GPUIPC__WARN("handoff",
                   "closing the connection to peer %d: GPU work queued "
                   "before releases (or the peer's broadcast signals) did "
                   "not complete within the timeout; %d imported chunk(s) "
                   "and %zu buffer(s) stay mapped until it does or the "
                   "peer is gone",
                   c->peer_pid, h->nimp, h->nclosing);
      keep = true;
    }
  }
  if (!keep)
    rx_free(h);
  /* Sender side. */
  if (h->lt && gpuipc__lease_outstanding(h->lt) > 0 &&
      c->state == GPUIPC__CONN_OPEN) {
    /* The peer may have released meanwhile: read what is there. */
    c->ho = h;
    (void)gpuipc__conn_pump(c, 0, NULL, NULL);
    c->ho = NULL;
  }
  /* The sender's relay stream: its queued work finishes on its own. */
  if (h->lt)
    gpuipc__ho_free_lq(h, 0, h->lt->ordinal);
  gpuipc__lease_close(h->lt);
  h->lt = NULL;
  free(h->txbuf);
  h->txbuf = NULL;
  if (keep)
    held_add(h, c->peer);
  else
    free(h);
}

static const gpuipc__conn_hooks handoff_hooks = {
    gpuipc__ho_frame, ho_peer_gone, ho_poll, ho_breaking, ho_close};

void gpuipc__handoff_install(gpuipc_conn *c) { c->fast = &handoff_hooks; }
