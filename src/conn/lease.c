/*
 * lease.c: owns leases: which of our blocks each peer holds (per connection,
 * per flag-word slot), what happens when a release arrives (the arena's
 * reclaim stream waits for the consumer's GPU-side release), and what
 * happens when a peer dies: everything it held is reclaimed once its
 * process is gone.
 *
 * Why reclaiming after a peer's death is safe: a consumer's GPU work on our
 * memory runs in the consumer's CUDA context. When the process exits or is
 * killed, the driver tears that context down (its work is aborted or has
 * finished) before the process disappears from the process table, so once
 * the pid is gone, or is a zombie, nothing can touch the memory any more.
 * A closed socket alone is not enough (a process may close the socket and
 * keep running GPU work), which is why, without an orderly BYE, gpuipc
 * waits for the process. The pid comes from the kernel (SCM_CREDENTIALS at
 * the handshake) and is paired with the process start time, so a reused
 * pid is not mistaken for the peer.
 *
 * A dead peer never writes its "released" flag words, and the arena's
 * reclaim stream may already wait on some of them; gpuipc writes the words
 * itself (side stream) so that those waits pass.
 */
#include "conn_int.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

bool gpuipc__peer_alive(int pid, uint64_t start_time) {
  if (pid <= 0)
    return false;
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno != ENOENT && errno != ESRCH; /* unknown: assume alive */
  ssize_t n;
  GPUIPC__EINTR_RETRY(n, read(fd, buf, sizeof buf - 1));
  close(fd);
  if (n <= 0)
    return false;
  buf[n] = '\0';
  char *p = strrchr(buf, ')');
  if (p == NULL || p[1] != ' ')
    return true;
  char state = p[2];
  if (state == 'Z' || state == 'X' || state == 'x')
    return false;
  if (start_time != 0) {
    uint64_t st = gpuipc__process_start_time(pid);
    if (st != 0 && st != start_time)
      return false; /* the pid now names another process */
  }
  return true;
}

void gpuipc__lease_add(struct gpuipc__ho *h, uint32_t slot, gpuipc_block *b,
                       uint64_t seq, bool ordered) {
  gpuipc_arena *a = b->arena;
  pthread_mutex_lock(&a->lock);
  b->holders++;
  a->leases++;
  pthread_mutex_unlock(&a->lock);
  h->tx[slot].block = b;
  h->tx[slot].seq = seq;
  h->tx[slot].ordered = ordered;
  h->tx_out++;
}

static void slot_free(struct gpuipc__ho *h, uint32_t slot) {
  h->tx[slot].block = NULL;
  h->tx[slot].buf = NULL;
  h->tx[slot].seq = 0;
  h->tx_free[h->tx_nfree++] = slot;
  h->tx_out--;
}

gpuipc_status gpuipc__lease_released(struct gpuipc__ho *h,
                                     const gpuipc__w_rel *rel, size_t n) {
  /* Validate everything first: a frame is applied whole or not at all. */
  for (size_t i = 0; i < n; i++) {
    if (rel[i].slot >= h->nslots ||
        (h->tx[rel[i].slot].block == NULL && h->tx[rel[i].slot].buf == NULL) ||
        h->tx[rel[i].slot].seq != rel[i].seq)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "release of slot %u sequence %llu, which the peer "
                          "does not hold",
                          rel[i].slot, (unsigned long long)rel[i].seq);
    for (size_t k = 0; k < i; k++)
      if (rel[k].slot == rel[i].slot)
        return gpuipc__fail(GPUIPC_E_PROTOCOL, "slot %u released twice",
                            rel[i].slot);
    if (h->tx[rel[i].slot].by_event && h->tx[rel[i].slot].rel_ev == NULL)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "release of slot %u without its event", rel[i].slot);
  }
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, h->ordinal));
  gpuipc_status s = GPUIPC_OK;
  /* Group by arena: one marker per arena per frame. */
  gpuipc_block *blocks[64];
  uint32_t slots[64];
  size_t i = 0;
  while (i < n) {
    gpuipc__txs *t0 = &h->tx[rel[i].slot];
    if (t0->buf) {
      /* A buffer outside any arena: its owner orders reuse with
       * gpuipc_conn_buffer_wait, which needs this release's word. */
      struct CUevent_st *local = NULL;
      if (t0->by_event) {
        /* The release event is recorded again when the slot comes back;
         * capture this record now on a private stream, and remember a
         * local event that completes after it. */
        CUresult r = CUDA_SUCCESS;
        if (h->evq == NULL) {
          CUstream st;
          r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
          if (r == CUDA_SUCCESS)
            h->evq = (struct CUstream_st *)st;
        }
        CUevent ev = NULL;
        if (r == CUDA_SUCCESS)
          r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)h->evq,
                         (CUevent)gpuipc_event_get_handle(t0->rel_ev), 0);
        if (r == CUDA_SUCCESS)
          r = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
        if (r == CUDA_SUCCESS)
          r = GPUIPC__CU(cuEventRecord, ev, (CUstream)h->evq);
        if (r != CUDA_SUCCESS && s == GPUIPC_OK)
          s = gpuipc__fail_cuda(r, "cuStreamWaitEvent", "release event");
        local = (struct CUevent_st *)ev;
      }
      if (t0->ordered || local) {
        if (h->nrel == h->caprel) {
          size_t cap = h->caprel ? 2 * h->caprel : 16;
          gpuipc__relrec *nr =
              cap > 4096 ? NULL : realloc(h->rel, sizeof *nr * cap);
          if (nr != NULL) {
            h->rel = nr;
            h->caprel = cap;
          } else if (h->nrel > 0) {
            /* Bounded: the oldest record goes (its buffer was never
             * waited for). */
            if (h->rel[0].local)
              GPUIPC__CU(cuEventDestroy, (CUevent)h->rel[0].local);
            memmove(h->rel, h->rel + 1, sizeof *h->rel * (h->nrel - 1));
            h->nrel--;
          }
        }
        if (h->nrel < h->caprel)
          h->rel[h->nrel++] =
              (gpuipc__relrec){t0->buf, rel[i].slot, t0->seq, local};
        else if (local)
          GPUIPC__CU(cuEventDestroy, (CUevent)local);
      }
      slot_free(h, rel[i].slot);
      i++;
      continue;
    }
    gpuipc_arena *a = t0->block->arena;
    int nb = 0;
    pthread_mutex_lock(&a->lock);
    bool any_ordered = false;
    while (i < n && nb < 64 && h->tx[rel[i].slot].block != NULL &&
           h->tx[rel[i].slot].block->arena == a) {
      uint32_t slot = rel[i].slot;
      gpuipc__txs *t = &h->tx[slot];
      if (t->ordered) {
        /* Reuse waits, on the GPU, for the consumer's release write. */
        gpuipc_status ws = gpuipc__arena_wait_word(
            a, gpuipc__released_word(h->ctl->ptr, h->nslots, slot), t->seq);
        if (ws != GPUIPC_OK && s == GPUIPC_OK)
          s = ws;
        any_ordered = true;
      } else if (t->by_event) {
        /* The same with the consumer's release event; the wait captures
         * its record now, before the slot can be used again. */
        CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)a->reclaim,
                                (CUevent)gpuipc_event_get_handle(t->rel_ev), 0);
        if (r != CUDA_SUCCESS && s == GPUIPC_OK)
          s = gpuipc__fail_cuda(r, "cuStreamWaitEvent", "release event");
        any_ordered = true;
      }
      blocks[nb] = t->block;
      slots[nb] = slot;
      nb++;
      i++;
    }
    if (any_ordered) {
      /* A marker (an event record) is needed only where memory goes back
       * to the free list now: blocks freed by their owner whose last
       * holder this was. Others are marked lazily, when freed or waited
       * for (gpuipc_block_wait): the reclaim stream runs in order, so a
       * later marker covers every wait queued before it. */
      gpuipc_block *now[64];
      int nn = 0;
      for (int k = 0; k < nb; k++) {
        if (!h->tx[slots[k]].ordered && !h->tx[slots[k]].by_event)
          continue;
        if (blocks[k]->freed && blocks[k]->holders == 1)
          now[nn++] = blocks[k];
        else
          blocks[k]->unmarked = true;
      }
      if (nn) {
        gpuipc_status ms = gpuipc__arena_mark(a, now, nn);
        if (ms != GPUIPC_OK && s == GPUIPC_OK)
          s = ms;
      }
    }
    for (int k = 0; k < nb; k++)
      gpuipc__block_unhold(blocks[k]);
    pthread_mutex_unlock(&a->lock);
    for (int k = 0; k < nb; k++)
      slot_free(h, slots[k]);
  }
  gpuipc__ctx_leave(&g);
  if (s != GPUIPC_OK)
    GPUIPC__WARN("lease", "ordering reuse after a release failed: %s",
                 gpuipc_last_error());
  return GPUIPC_OK;
}

void gpuipc__lease_reclaim_dead(struct gpuipc__ho *h) {
  if (h->tx == NULL || h->ctl == NULL || h->dead_handled)
    return;
  h->dead_handled = true;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, h->ordinal) != GPUIPC_OK) {
    GPUIPC__WARN("lease", "cannot reclaim blocks of dead peer %d: %s",
                 h->peer_pid, gpuipc_last_error());
    return;
  }
  /* Unblock waits on the dead peer's "released" words: write a value past
   * every sequence number it could have been given. GEQ compares with
   * wrap-around (signed difference), so the value must stay within 2^63
   * of them: tx_seq + 2^40 does. */
  uint64_t value = h->tx_seq + ((uint64_t)1 << 40);
  uint64_t words[256];
  int nw = 0;
  gpuipc_arena *ca = h->ctl_arena;
  pthread_mutex_lock(&ca->lock);
  for (uint32_t s = 0; s < h->nslots; s++) {
    if (h->tx[s].rel_ev)
      /* Event mode: a record of ours completes, which waits for the dead
       * peer's last record accept too. */
      (void)gpuipc_event_record(h->tx[s].rel_ev, ca->side);
    if (h->tx[s].last_seq == 0)
      continue;
    words[nw++] = gpuipc__released_word(h->ctl->ptr, h->nslots, s);
    if (nw == (int)GPUIPC__ARRAY_SIZE(words)) {
      gpuipc__arena_force_words(ca, words, nw, value);
      nw = 0;
    }
  }
  if (nw)
    gpuipc__arena_force_words(ca, words, nw, value);
  pthread_mutex_unlock(&ca->lock);
  size_t n = 0;
  for (uint32_t s = 0; s < h->nslots; s++) {
    gpuipc__txs *t = &h->tx[s];
    if (t->buf) {
      slot_free(h, s); /* the caller's buffer: nothing to give back */
      n++;
      continue;
    }
    if (t->block == NULL)
      continue;
    gpuipc_arena *a = t->block->arena;
    pthread_mutex_lock(&a->lock);
    gpuipc_block *b = t->block;
    /* The block's reuse must still come after any reclaim wait already
     * queued for it: the newest marker covers them. */
    if (t->ordered || t->by_event)
      gpuipc__arena_mark(a, &b, 1);
    gpuipc__block_unhold(b);
    pthread_mutex_unlock(&a->lock);
    slot_free(h, s);
    n++;
  }
  gpuipc__ctx_leave(&g);
  if (n)
    GPUIPC__INFO("lease", "reclaimed %zu block(s) held by dead peer pid %d", n,
                 h->peer_pid);
}

void gpuipc__ho_free_tx(struct gpuipc__ho *h) {
  if (h->ctl) {
    gpuipc_arena *a = h->ctl_arena;
    /* The flag words go back to the arena after every wait on them that
     * the reclaim stream queued (the marker recorded by the free). */
    gpuipc_block_free(h->ctl, (struct CUstream_st *)NULL);
    pthread_mutex_lock(&a->lock);
    a->users--;
    pthread_mutex_unlock(&a->lock);
    h->ctl = NULL;
  }
  if (h->tx)
    for (uint32_t s = 0; s < h->nslots; s++) {
      gpuipc_event_destroy(h->tx[s].ready_ev);
      gpuipc_event_destroy(h->tx[s].rel_ev);
    }
  for (size_t i = 0; i < h->nrel; i++)
    if (h->rel[i].local)
      GPUIPC__CU(cuEventDestroy, (CUevent)h->rel[i].local);
  if (h->evq)
    GPUIPC__CU(cuStreamDestroy, (CUstream)h->evq);
  h->evq = NULL;
  gpuipc__ho_free_lq(h, 0, h->ordinal);
  free(h->tx);
  free(h->tx_free);
  free(h->rel);
  h->tx = NULL;
  h->tx_free = NULL;
  h->rel = NULL;
  h->nrel = h->caprel = 0;
}

bool gpuipc__lease_words_settled(struct gpuipc__ho *h) {
  if (h->ctl == NULL || h->tx_out > 0)
    return h->ctl == NULL;
  uint64_t *w = malloc(sizeof *w * h->nslots);
  if (w == NULL)
    return false;
  gpuipc_arena *a = h->ctl_arena;
  bool settled = false;
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, h->ordinal) == GPUIPC_OK) {
    /* On the arena's side stream, which nothing else blocks. */
    CUresult r = GPUIPC__CU(
        cuMemcpyDtoHAsync, w,
        (CUdeviceptr)gpuipc__released_word(h->ctl->ptr, h->nslots, 0),
        sizeof *w * h->nslots, (CUstream)a->side);
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuStreamSynchronize, (CUstream)a->side);
    if (r == CUDA_SUCCESS) {
      settled = true;
      for (uint32_t s = 0; s < h->nslots && settled; s++)
        if (h->tx[s].last_seq != 0 && (int64_t)(w[s] - h->tx[s].last_seq) < 0)
          settled = false;
    }
    gpuipc__ctx_leave(&g);
  }
  free(w);
  return settled;
}

void gpuipc__lease_close(struct gpuipc__ho *h, bool peer_open) {
  (void)peer_open;
  if (h->ctl != NULL && !h->dead_handled) {
    if (!gpuipc__peer_alive(h->peer_pid, h->peer_start)) {
      gpuipc__lease_reclaim_dead(h);
    } else if (h->tx_out > 0 || !gpuipc__lease_words_settled(h)) {
      /* The peer lives and still holds blocks, or its GPU has not yet
       * written releases it announced: keep the state until it is done or
       * gone. */
      gpuipc__orphan_add(h);
      return;
    }
  }
  gpuipc__ho_free_tx(h);
  free(h);
}

/* ---- orphans ------------------------------------------------------------------------ */

static pthread_mutex_t orphan_lock = PTHREAD_MUTEX_INITIALIZER;
static struct gpuipc__ho *orphans;
static atomic_int n_orphans;

void gpuipc__orphan_add(struct gpuipc__ho *h) {
  pthread_mutex_lock(&orphan_lock);
  h->next_orphan = orphans;
  orphans = h;
  atomic_fetch_add(&n_orphans, 1);
  pthread_mutex_unlock(&orphan_lock);
  GPUIPC__DEBUG("lease",
                "connection to pid %d closed while it holds %zu block(s): "
                "reclaimed when that process is gone",
                h->peer_pid, h->tx_out);
}

void gpuipc__orphans_poll(void) {
  if (GPUIPC__LIKELY(atomic_load_explicit(&n_orphans, memory_order_relaxed) ==
                     0))
    return;
  /* Checking costs a /proc read (and maybe a small device copy) per
   * orphan: at most every few milliseconds. */
  static _Atomic uint64_t last_poll;
  uint64_t now = gpuipc__now_ns();
  uint64_t prev = atomic_load(&last_poll);
  if (now - prev < 5000000ull ||
      !atomic_compare_exchange_strong(&last_poll, &prev, now))
    return;
  pthread_mutex_lock(&orphan_lock);
  struct gpuipc__ho **pp = &orphans, *done = NULL;
  while (*pp) {
    struct gpuipc__ho *h = *pp;
    if (!gpuipc__peer_alive(h->peer_pid, h->peer_start) ||
        (h->tx_out == 0 && gpuipc__lease_words_settled(h))) {
      *pp = h->next_orphan;
      h->next_orphan = done;
      done = h;
      atomic_fetch_sub(&n_orphans, 1);
    } else {
      pp = &h->next_orphan;
    }
  }
  pthread_mutex_unlock(&orphan_lock);
  while (done) {
    struct gpuipc__ho *h = done;
    done = h->next_orphan;
    if (!gpuipc__peer_alive(h->peer_pid, h->peer_start))
      gpuipc__lease_reclaim_dead(h);
    gpuipc__ho_free_tx(h);
    free(h);
  }
}
