/*
 * tx.c: owns the sender of the per-buffer fast path: the lease table and
 * the arena chunks exported to a connection (once each), the one
 * preparation every send shares (a connection made ready, free slots,
 * event mode's records, sequence numbers, and after the frame the ready
 * signal and the leases recorded), the sends of one block, one buffer by
 * descriptor, a batch and a broadcast, the devices' broadcast words, and
 * the questions about what the peer still holds. It never calls the
 * receiver (rx.c): what both directions need is in handoff.c.
 */
#include "handoff_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- sender: setup ---------------------------------------------------------------- */

static int exp_find(struct gpuipc__ho *h, uint64_t arena_id) {
  for (int i = 0; i < h->nexp; i++)
    if (h->exp[i].arena_id == arena_id)
      return i;
  return -1;
}

/* Sends chunk `ci` of arena a to the peer (once per connection). */
static gpuipc_status export_chunk(gpuipc_conn *c, struct gpuipc__ho *h,
                                  gpuipc_arena *a, uint32_t ci,
                                  uint64_t deadline) {
  int e = exp_find(h, a->id);
  if (e >= 0 && (h->exp[e].mask >> ci & 1))
    return GPUIPC_OK;
  if (e < 0) {
    if (h->nexp == (int)GPUIPC__ARRAY_SIZE(h->exp))
      return gpuipc__fail(GPUIPC_E_LIMIT,
                          "a connection carries blocks of at most %d arenas",
                          (int)GPUIPC__ARRAY_SIZE(h->exp));
    e = h->nexp++;
    h->exp[e].arena_id = a->id;
    h->exp[e].mask = 0;
  }
  gpuipc_buffer *buf = NULL;
  size_t size = 0;
  gpuipc__arena_chunk(a, ci, &buf, &size);
  if (buf == NULL)
    return gpuipc__fail(GPUIPC_E_INTERNAL, "arena %llu has no chunk %u",
                        (unsigned long long)a->id, ci);
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t dlen = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = GPUIPC_DESC_MAX_FDS;
  GPUIPC__CHECK(gpuipc_buffer_export(buf, desc, sizeof desc, &dlen, fds, &nfds));
  gpuipc__w_chunk w = {a->id, size, ci, (uint32_t)dlen};
  gpuipc_status s = gpuipc__conn_send_frame(c, GPUIPC__F_CHUNK, &w, sizeof w,
                                            desc, dlen, fds, nfds, deadline);
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  if (s == GPUIPC_OK)
    h->exp[e].mask |= (uint64_t)1 << ci;
  return s;
}

/* Makes our lease table (flag words on device `ordinal`) and tells the
 * peer where its flag words are. */
static gpuipc_status setup_tx(gpuipc_conn *c, struct gpuipc__ho *h,
                              int ordinal, uint64_t deadline) {
  gpuipc__lease_table *lt = NULL;
  GPUIPC__CHECK(gpuipc__lease_open(ordinal, c->max_outstanding, c->peer, &lt));
  lt->stats_slot = c->stats_slot;
  gpuipc_arena *a = lt->ctl_arena;
  gpuipc_status s = export_chunk(c, h, a, lt->ctl->chunk, deadline);
  if (s == GPUIPC_OK) {
    gpuipc__w_ctl w = {a->id, lt->ctl->off, lt->ctl->chunk, lt->nslots};
    s = gpuipc__conn_send_frame(c, GPUIPC__F_CTL, &w, sizeof w, NULL, 0, NULL,
                                0, deadline);
  }
  if (s != GPUIPC_OK) {
    gpuipc__lease_close(lt);
    return s;
  }
  h->lt = lt;
  if (c->watch) {
    struct gpuipc__watch *wt = c->watch;
    atomic_store(&wt->tx_ordinal, lt->ordinal);
    atomic_store(&wt->tx_nslots, lt->nslots);
    atomic_store_explicit(&wt->tx_base, lt->ctl->ptr, memory_order_release);
  }
  return GPUIPC_OK;
}

/* ---- sender: send ------------------------------------------------------------------ */

static bool have_free_slots(gpuipc_conn *c, void *arg) {
  uint32_t n = *(const uint32_t *)arg;
  return c->ho->lt->tx_nfree >= n;
}

/* The stream-ordered ready write of buffer `seq` in `slot` (memop mode),
 * after the work queued on *stream; *stream becomes the stream that wrote
 * the word. */
static gpuipc_status ready_write(struct gpuipc__ho *h, uint32_t slot,
                                 uint64_t seq, struct CUstream_st **stream) {
  gpuipc__lease_table *lt = h->lt;
  uint64_t last_seq;
  struct CUstream_st *last_stream;
  gpuipc__lease_last_write(lt, slot, &last_seq, &last_stream);
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, lt->ordinal));
  CUstream ws = NULL;
  gpuipc_status ss = gpuipc__ho_write_stream(h, 0, *stream, &ws);
  if (ss != GPUIPC_OK) {
    gpuipc__ctx_leave(&g);
    return ss;
  }
  CUresult r = CUDA_SUCCESS;
  if (last_seq != 0 && last_stream != (struct CUstream_st *)ws) {
    /* The release of the slot's last lease (signalled by its own word, or
     * by a later slot's for a release of a batch). */
    uint32_t rs;
    uint64_t rv;
    gpuipc__lease_last_release(lt, slot, &rs, &rv);
    r = GPUIPC__CU(cuStreamWaitValue64, ws,
                   (CUdeviceptr)gpuipc__released_word(lt->ctl->ptr, lt->nslots,
                                                      rs),
                   (cuuint64_t)rv, CU_STREAM_WAIT_VALUE_GEQ);
  }
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamWriteValue64, ws,
                   (CUdeviceptr)gpuipc__ready_word(lt->ctl->ptr, slot),
                   (cuuint64_t)seq, 0);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuStreamWriteValue64",
                             "ready flag of buffer %llu",
                             (unsigned long long)seq);
  *stream = (struct CUstream_st *)ws; /* the stream that wrote the word */
  return GPUIPC_OK;
}

/* True when every piece of work queued on `stream` so far has completed
 * (cuStreamQuery), so that a buffer sent now needs no GPU ordering: the
 * consumer may use it at once (GPUIPC__BUF_DONE). The legacy stream is
 * never asked (its implicit ordering with the other blocking streams is
 * not what a query reports). A busy answer makes the next sends skip the
 * question (1, 3, 7 .. 63 of them), so a producer whose stream is always
 * busy pays for a query rarely. */
static bool stream_idle(struct gpuipc__ho *h, int ordinal,
                        struct CUstream_st *stream) {
  if (gpuipc__is_legacy_stream(stream))
    return false;
  if (h->idle_skip > 0) {
    h->idle_skip--;
    return false;
  }
  gpuipc__ctx_guard g;
  if (gpuipc__ctx_enter(&g, ordinal) != GPUIPC_OK)
    return false;
  CUresult r = GPUIPC__CU(cuStreamQuery, (CUstream)stream);
  gpuipc__ctx_leave(&g);
  if (r == CUDA_SUCCESS) {
    h->idle_backoff = 0;
    return true;
  }
  h->idle_backoff = h->idle_backoff >= 32 ? 63 : 2 * h->idle_backoff + 1;
  h->idle_skip = h->idle_backoff;
  return false;
}

/* Gets c ready to send from device `ordinal`: its fast-path state, the
 * deadline of this call, and at its first send the lease table (flag
 * words on that device) with the peer told where they are. What every
 * send starts with. */
static gpuipc_status tx_open(gpuipc_conn *c, int ordinal,
                             struct gpuipc__ho **h_out, uint64_t *deadline) {
  struct gpuipc__ho *h = NULL;
  GPUIPC__CHECK(gpuipc__ho_get(c, &h));
  *deadline = gpuipc__conn_deadline(c);
  if (h->lt == NULL)
    GPUIPC__CHECK(setup_tx(c, h, ordinal, *deadline));
  *h_out = h;
  return GPUIPC_OK;
}

/* n free slots (waiting up to deadline for releases when fewer are free),
 * event mode's record of each one's ready event on stream, and the next n
 * sequence numbers: what every send of one buffer, a batch or a broadcast
 * takes before its frame (`batch`: say so in a message; `complete`: the
 * caller asserted its data complete, no record is made). Nothing is
 * taken yet: the slots stay free until the frame left. */
static gpuipc_status take_leases(gpuipc_conn *conn, struct gpuipc__ho *h,
                                 struct CUstream_st *stream, uint64_t deadline,
                                 uint32_t n, bool batch, bool complete,
                                 uint32_t *slots, uint64_t *seqs) {
  gpuipc__lease_table *lt = h->lt;
  if (!gpuipc__lease_free_slots(lt, n, slots)) {
    /* Every slot is out (not enough slots free): wait for releases. */
    GPUIPC__CHECK(gpuipc__conn_pump(conn, deadline, have_free_slots, &n));
    if (conn->ho != h || !gpuipc__lease_free_slots(lt, n, slots))
      return gpuipc__fail(GPUIPC_E_INTERNAL,
                          batch ? "no free slots after releases"
                                : "no free slot after a release");
  }
  if (conn->order == GPUIPC_ORDER_EVENT) {
    /* Each buffer has its own ready event (its slot's), as in one send. */
    for (uint32_t i = 0; i < n; i++) {
      gpuipc_event *ev = gpuipc__lease_ready_event(lt, slots[i]);
      if (ev == NULL) {
        GPUIPC__CHECK(gpuipc__ho_make_event(conn, lt->ordinal, slots[i], 0,
                                            deadline, &ev));
        gpuipc__lease_set_ready_event(lt, slots[i], ev);
      }
      /* The consumer's wait (at recv) captures this record; the slot's
       * event is recorded again only after the consumer released this
       * lease. A send the caller asserts complete records nothing: the
       * consumer's wait then captures the slot's previous record (work
       * queued before an earlier send, which its wait for that send
       * covered already), never anything newer. */
      if (!complete)
        GPUIPC__CHECK(gpuipc_event_record(ev, stream));
    }
  }
  for (uint32_t i = 0; i < n; i++) {
    seqs[i] = gpuipc__lease_new_seq(lt);
    if (seqs[i] == 0)
      return gpuipc__fail(GPUIPC_E_LIMIT, "the connection's sequence numbers "
                                          "are used up (2^62 buffers)");
  }
  return GPUIPC_OK;
}

/* The ordering flags of a buffer sent on c (`done`: GPUIPC__BUF_DONE). */
static uint32_t buf_flags(const gpuipc_conn *c, bool done) {
  uint32_t f = 0;
  f |= c->order == GPUIPC_ORDER_MEMOP ? GPUIPC__BUF_ORDERED : 0u;
  f |= c->order == GPUIPC_ORDER_EVENT ? GPUIPC__BUF_EVENT : 0u;
  f |= done ? GPUIPC__BUF_DONE : 0u;
  return f;
}

/* What every send does once its frame of n buffers (slots[i], seqs[i];
 * blocks[i], or the descriptor buffer buf) left: the slots taken, the ready
 * signal, the leases recorded. The ready signal (memop mode) is one write,
 * that of the newest entry (slots[n - 1]), after the work queued on
 * `stream`; `signalled`: none is written here (DONE: the work before the
 * send had completed; a broadcast: the broadcast word's write on `stream`
 * stands for it). `batch`: say so in a message. */
static gpuipc_status tx_commit(gpuipc_conn *conn, struct gpuipc__ho *h,
                               uint32_t n, const uint32_t *slots,
                               const uint64_t *seqs,
                               gpuipc_block *const *blocks, gpuipc_buffer *buf,
                               struct CUstream_st *stream, bool signalled,
                               bool batch) {
  gpuipc__lease_table *lt = h->lt;
  bool ordered = conn->order == GPUIPC_ORDER_MEMOP;
  /* The frame left: the slots are taken (nothing was enqueued before, so a
   * failed frame left them free). */
  for (uint32_t i = 0; i < n; i++)
    gpuipc__lease_take_slot(lt, slots[i]);
  if (signalled) {
    /* No write: recorded as each slot's last one all the same, so that a
     * later write from another stream first waits for this lease's
     * release, and a dead peer's release word is forced. */
    for (uint32_t i = 0; i < n; i++)
      gpuipc__lease_written(lt, slots[i], seqs[i], stream);
  } else if (ordered) {
    /* The ready write is enqueued after the frame left: the consumer's
     * stream waits for it on the GPU anyway, and the consumer holds the
     * buffer sooner by the time of this enqueue (about a microsecond). It
     * still follows exactly the work queued on `stream` before this call.
     * A batch has one ready write, that of its newest entry; the other
     * entries' words are not written (the consumer waits on this one for
     * all of them). Each slot records the batch's write as its own last
     * one: a later write of the slot from another stream then waits for
     * this lease's release (which follows the batch's write), and a dead
     * peer's release words are forced for these slots too. */
    struct CUstream_st *wst = stream;
    gpuipc_status ws_status = ready_write(h, slots[n - 1], seqs[n - 1], &wst);
    if (ws_status != GPUIPC_OK) {
      /* The peer was told of a buffer whose ready word will never be
       * written: end the connection, so that it treats the buffer as from
       * a dead producer (its streams are unblocked, its next call says
       * the peer is gone), and never reuse the slot (it stays taken). */
      gpuipc_status cause = ws_status;
      char why[256];
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
      (void)gpuipc__conn_break(conn,
                               batch ? "the ready flag of batch ending with "
                                       "buffer %llu could not be enqueued"
                                     : "the ready flag of buffer %llu could "
                                       "not be enqueued",
                               (unsigned long long)seqs[n - 1]);
      return gpuipc__fail(cause, "%s", why);
    }
    for (uint32_t i = 0; i < n; i++)
      gpuipc__lease_written(lt, slots[i], seqs[i], wst);
  }
  for (uint32_t i = 0; i < n; i++)
    gpuipc__lease_add(lt, slots[i], blocks[i], buf, seqs[i], ordered,
                      conn->order == GPUIPC_ORDER_EVENT);
  return GPUIPC_OK;
}

/* The common part of both sends of one buffer: a free slot, the frame,
 * then the stream-ordered ready write and the lease. `desc` (with fds) is
 * set for a descriptor buffer (buf), else the frame names the arena block
 * (block) in w. `complete` (GPUIPC_SEND_COMPLETE, arena blocks only): the
 * caller says the block's data is complete; `stream` is not touched (no
 * query, no event record, no ready write) and the frame says DONE. */
static gpuipc_status send_core(gpuipc_conn *conn, struct gpuipc__ho *h,
                               struct CUstream_st *stream, bool complete,
                               gpuipc__w_buf *w, const uint8_t *desc,
                               uint32_t desc_len, const int *fds, int nfds,
                               const void *meta, size_t meta_len,
                               uint64_t deadline, gpuipc_block *block,
                               gpuipc_buffer *buf) {
  gpuipc__lease_table *lt = h->lt;
  uint32_t slot;
  uint64_t seq;
  GPUIPC__CHECK(take_leases(conn, h, stream, deadline, 1, false, complete, &slot,
                            &seq));
  bool ordered = conn->order == GPUIPC_ORDER_MEMOP;
  if (conn->watch)
    atomic_store(&conn->watch->tx_seq, seq);
  /* An arena block whose work is already done (the caller says so, or its
   * stream is idle) needs no ready write, and the consumer no wait. */
  bool done = ordered && desc == NULL &&
              (complete || stream_idle(h, lt->ordinal, stream));
  w->seq = seq;
  w->slot = slot;
  w->flags |= buf_flags(conn, done);
  w->meta_len = (uint32_t)meta_len;
  gpuipc_status s;
  if (desc == NULL) {
    s = gpuipc__conn_send_frame(conn, GPUIPC__F_BUF, w, sizeof *w, meta,
                                meta_len, NULL, 0, deadline);
  } else {
    unsigned char p[sizeof *w + 8 + GPUIPC_DESC_MAX + GPUIPC_META_MAX];
    uint32_t dl[2] = {desc_len, 0};
    memcpy(p, w, sizeof *w);
    memcpy(p + sizeof *w, dl, sizeof dl);
    memcpy(p + sizeof *w + 8, desc, desc_len);
    if (meta_len)
      memcpy(p + sizeof *w + 8 + desc_len, meta, meta_len);
    s = gpuipc__conn_send_frame(conn, GPUIPC__F_BUFD, p,
                                sizeof *w + 8 + desc_len + meta_len, NULL, 0,
                                fds, nfds, deadline);
  }
  if (s != GPUIPC_OK)
    return s; /* nothing was enqueued: the slot stays free */
  /* Asserted complete: no stream wrote the slot's word (NULL: a later
   * write of it, from whatever stream, first waits for this release). */
  return tx_commit(conn, h, 1, &slot, &seq, &block, buf,
                   complete ? NULL : stream, done, false);
}

gpuipc_status gpuipc_conn_send_ex(gpuipc_conn *conn, gpuipc_block *block,
                                  struct CUstream_st *stream, const void *meta,
                                  size_t meta_len, unsigned flags) {
  const char *fn = flags ? "gpuipc_conn_send_ex" : "gpuipc_conn_send";
  if (conn == NULL || block == NULL || meta_len > GPUIPC_META_MAX ||
      (meta_len > 0 && meta == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "%s: NULL connection/block or metadata of %zu bytes "
                        "(max %d)",
                        fn, meta_len, GPUIPC_META_MAX);
  if (flags & ~GPUIPC_SEND_COMPLETE)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: unknown flags 0x%x", fn,
                        flags & ~GPUIPC_SEND_COMPLETE);
  if (!gpuipc__block_sendable(block))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: the block was freed", fn);
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  GPUIPC__CHECK(gpuipc__driver());
  struct gpuipc__ho *h = NULL;
  uint64_t deadline = 0;
  gpuipc_arena *a = block->arena;
  GPUIPC__CHECK(tx_open(conn, a->ordinal, &h, &deadline));
  if (a->ordinal != h->lt->ordinal)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "%s: the block is on device %d, this connection's "
                        "flag words on device %d (one device per connection)",
                        fn, a->ordinal, h->lt->ordinal);
  GPUIPC__CHECK(export_chunk(conn, h, a, block->chunk, deadline));
  gpuipc__w_buf w = {0,          a->id, block->off, block->bytes, 0,
                     block->chunk, 0,     0};
  return send_core(conn, h, stream, (flags & GPUIPC_SEND_COMPLETE) != 0, &w,
                   NULL, 0, NULL, 0, meta, meta_len, deadline, block, NULL);
}

gpuipc_status gpuipc_conn_send(gpuipc_conn *conn, gpuipc_block *block,
                               struct CUstream_st *stream, const void *meta,
                               size_t meta_len) {
  return gpuipc_conn_send_ex(conn, block, stream, meta, meta_len, 0);
}

gpuipc_status gpuipc_conn_send_batch(gpuipc_conn *conn,
                                     gpuipc_block *const *blocks, size_t n,
                                     struct CUstream_st *stream,
                                     const void *const *metas,
                                     const size_t *meta_lens) {
  if (conn == NULL || blocks == NULL || n == 0 || n > GPUIPC_BATCH_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send_batch: NULL connection/blocks or "
                        "%zu blocks (1 to %d)",
                        n, GPUIPC_BATCH_MAX);
  size_t bytes = n * sizeof(gpuipc__w_buf);
  for (size_t i = 0; i < n; i++) {
    size_t ml = meta_lens ? meta_lens[i] : 0;
    if (blocks[i] == NULL || ml > GPUIPC_META_MAX ||
        (ml > 0 && (metas == NULL || metas[i] == NULL)))
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_send_batch: block %zu is NULL or has "
                          "metadata of %zu bytes (max %d) without data",
                          i, ml, GPUIPC_META_MAX);
    if (!gpuipc__block_sendable(blocks[i]))
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_send_batch: block %zu was freed", i);
    bytes += ml;
  }
  if (bytes > GPUIPC_BATCH_BYTES_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send_batch: %zu blocks with their "
                        "metadata take %zu bytes (max %d in one batch)",
                        n, bytes, GPUIPC_BATCH_BYTES_MAX);
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  GPUIPC__CHECK(gpuipc__driver());
  struct gpuipc__ho *h = NULL;
  uint64_t deadline = 0;
  GPUIPC__CHECK(tx_open(conn, blocks[0]->arena->ordinal, &h, &deadline));
  gpuipc__lease_table *lt = h->lt;
  if (n > lt->nslots)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send_batch: %zu blocks, the connection "
                        "has %u slots (max_outstanding)",
                        n, lt->nslots);
  for (size_t i = 0; i < n; i++)
    if (blocks[i]->arena->ordinal != lt->ordinal)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_send_batch: block %zu is on device %d, "
                          "this connection's flag words on device %d (one "
                          "device per connection)",
                          i, blocks[i]->arena->ordinal, lt->ordinal);
  for (size_t i = 0; i < n; i++)
    GPUIPC__CHECK(
        export_chunk(conn, h, blocks[i]->arena, blocks[i]->chunk, deadline));
  /* The frame's buffer (before any slot is waited for: a failure here
   * leaves nothing done). */
  size_t flen = sizeof(gpuipc__w_bufs) + bytes;
  if (h->txcap < flen) {
    unsigned char *nb = realloc(h->txbuf, GPUIPC__FRAME_MAX);
    if (nb == NULL)
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "batch frame");
    h->txbuf = nb;
    h->txcap = GPUIPC__FRAME_MAX;
  }
  uint32_t slots[GPUIPC_BATCH_MAX];
  uint64_t seqs[GPUIPC_BATCH_MAX];
  GPUIPC__CHECK(
      take_leases(conn, h, stream, deadline, (uint32_t)n, true, false, slots,
                  seqs));
  bool ordered = conn->order == GPUIPC_ORDER_MEMOP;
  bool done = ordered && stream_idle(h, lt->ordinal, stream);
  gpuipc__w_bufs hdr = {(uint32_t)n, (uint32_t)n - 1, 0, 0};
  memcpy(h->txbuf, &hdr, sizeof hdr);
  unsigned char *ent = h->txbuf + sizeof hdr;
  unsigned char *meta = ent + n * sizeof(gpuipc__w_buf);
  for (size_t i = 0; i < n; i++) {
    gpuipc_block *b = blocks[i];
    size_t ml = meta_lens ? meta_lens[i] : 0;
    gpuipc__w_buf w = {seqs[i],  b->arena->id, b->off, b->bytes, slots[i],
                       b->chunk, 0,            (uint32_t)ml};
    w.flags |= buf_flags(conn, done);
    memcpy(ent + i * sizeof w, &w, sizeof w);
    if (ml)
      memcpy(meta, metas[i], ml);
    meta += ml;
  }
  if (conn->watch)
    atomic_store(&conn->watch->tx_seq, seqs[n - 1]);
  GPUIPC__CHECK(gpuipc__conn_send_frame(conn, GPUIPC__F_BUFS, h->txbuf, flen,
                                        NULL, 0, NULL, 0, deadline));
  /* One ready write for the batch (none when the work before it had
   * completed). */
  return tx_commit(conn, h, (uint32_t)n, slots, seqs, blocks, NULL, stream,
                   done, true);
}

/* ---- sender: broadcast ------------------------------------------------------------- */

/* The broadcast word of each device: one 64-bit flag word in the
 * process's flag-word arena (never freed: its values only grow, so a late
 * wait of a consumer still passes), written once per broadcast after the
 * producer's work; every consumer of the broadcast (memop mode) waits on
 * it. Writes go in value order (the lock), and one from a stream other
 * than the last writer's first waits for the last value, so the word
 * never goes backwards. */
static pthread_mutex_t bw_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  gpuipc_block *blk;
  uint64_t value;
  struct CUstream_st *last;
} bwords[64];

/* Device `ordinal`'s broadcast word (made at the first call). */
static gpuipc_status bword_get(int ordinal, gpuipc_block **out) {
  if (ordinal < 0 || ordinal >= (int)GPUIPC__ARRAY_SIZE(bwords))
    return gpuipc__fail(GPUIPC_E_NO_DEVICE, "device %d", ordinal);
  pthread_mutex_lock(&bw_lock);
  gpuipc_status s = GPUIPC_OK;
  if (bwords[ordinal].blk == NULL) {
    gpuipc_arena *a = NULL;
    gpuipc_block *b = NULL;
    s = gpuipc__ctl_arena(ordinal, &a);
    if (s == GPUIPC_OK)
      s = gpuipc__arena_take(a, 8, a->side, true, &b);
    if (s == GPUIPC_OK) {
      gpuipc__ctx_guard g;
      s = gpuipc__ctx_enter(&g, ordinal);
      if (s == GPUIPC_OK) {
        CUresult r = GPUIPC__CU(cuMemsetD32Async, (CUdeviceptr)b->ptr, 0, 2,
                                (CUstream)a->side);
        if (r == CUDA_SUCCESS)
          r = GPUIPC__CU(cuStreamSynchronize, (CUstream)a->side);
        gpuipc__ctx_leave(&g);
        if (r != CUDA_SUCCESS)
          s = gpuipc__fail_cuda(r, "cuMemsetD32Async", "broadcast word");
      }
      if (s == GPUIPC_OK)
        bwords[ordinal].blk = b; /* kept for the life of the process */
    }
  }
  *out = bwords[ordinal].blk;
  pthread_mutex_unlock(&bw_lock);
  return s;
}

/* Enqueues the next value of device `ordinal`'s broadcast word after the
 * work queued on `stream` (h: a connection whose legacy-stream relay may
 * be used); *value: the value, *written: the stream that writes it. */
static gpuipc_status bword_write(struct gpuipc__ho *h, int ordinal,
                                 struct CUstream_st *stream, uint64_t *value,
                                 struct CUstream_st **written) {
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, ordinal));
  CUstream ws = NULL;
  gpuipc_status s = gpuipc__ho_write_stream(h, 0, stream, &ws);
  if (s != GPUIPC_OK) {
    gpuipc__ctx_leave(&g);
    return s;
  }
  pthread_mutex_lock(&bw_lock);
  CUdeviceptr word = (CUdeviceptr)bwords[ordinal].blk->ptr;
  uint64_t prev = bwords[ordinal].value;
  CUresult r = CUDA_SUCCESS;
  if (prev + 1 >= GPUIPC__SEQ_LIMIT)
    r = CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS && prev != 0 &&
      bwords[ordinal].last != (struct CUstream_st *)ws)
    r = GPUIPC__CU(cuStreamWaitValue64, ws, word, (cuuint64_t)prev,
                   CU_STREAM_WAIT_VALUE_GEQ);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamWriteValue64, ws, word, (cuuint64_t)(prev + 1), 0);
  if (r == CUDA_SUCCESS) {
    bwords[ordinal].value = prev + 1;
    bwords[ordinal].last = (struct CUstream_st *)ws;
  }
  pthread_mutex_unlock(&bw_lock);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuStreamWriteValue64",
                             "broadcast word of device %d", ordinal);
  *value = prev + 1;
  *written = (struct CUstream_st *)ws;
  return GPUIPC_OK;
}

/* Gets connection `c` ready to take a lease of `block` (flag words, the
 * chunk exported, a free slot, event mode's record); *w is its frame. */
static gpuipc_status bc_prepare(gpuipc_conn *c, gpuipc_block *block,
                                gpuipc_block *bword,
                                struct CUstream_st *stream, size_t meta_len,
                                gpuipc__w_buf *w) {
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  struct gpuipc__ho *h = NULL;
  uint64_t deadline = 0;
  gpuipc_arena *a = block->arena;
  GPUIPC__CHECK(tx_open(c, a->ordinal, &h, &deadline));
  gpuipc__lease_table *lt = h->lt;
  if (a->ordinal != lt->ordinal)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_broadcast: the block is on device %d, a "
                        "connection's flag words on device %d (one device per "
                        "connection)",
                        a->ordinal, lt->ordinal);
  GPUIPC__CHECK(export_chunk(c, h, a, block->chunk, deadline));
  bool ordered = c->order == GPUIPC_ORDER_MEMOP;
  if (ordered) /* the broadcast word's chunk */
    GPUIPC__CHECK(export_chunk(c, h, bword->arena, bword->chunk, deadline));
  uint32_t slot;
  uint64_t seq;
  GPUIPC__CHECK(take_leases(c, h, stream, deadline, 1, false, false, &slot, &seq));
  *w = (gpuipc__w_buf){seq,         a->id, block->off, block->bytes, slot,
                       block->chunk, 0,    (uint32_t)meta_len};
  w->flags |= buf_flags(c, false);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_broadcast(gpuipc_conn *const *conns, size_t n,
                                    gpuipc_block *block,
                                    struct CUstream_st *stream,
                                    const void *meta, size_t meta_len,
                                    gpuipc_status *statuses) {
  if (conns == NULL || n == 0 || n > GPUIPC_BROADCAST_MAX || block == NULL ||
      meta_len > GPUIPC_META_MAX || (meta_len > 0 && meta == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_broadcast: NULL connections/block, %zu "
                        "connections (1 to %d), or metadata of %zu bytes "
                        "(max %d)",
                        n, GPUIPC_BROADCAST_MAX, meta_len, GPUIPC_META_MAX);
  if (!gpuipc__block_sendable(block))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_broadcast: the block was freed");
  for (size_t i = 0; i < n; i++) {
    if (conns[i] == NULL)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_broadcast: connection %zu is NULL", i);
    for (size_t k = 0; k < i; k++)
      if (conns[k] == conns[i])
        return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                            "gpuipc_conn_broadcast: connections %zu and %zu "
                            "are the same",
                            k, i);
  }
  GPUIPC__CHECK(gpuipc__driver());
  int ordinal = block->arena->ordinal;
  gpuipc_block *bword = NULL;
  bool any_memop = false;
  for (size_t i = 0; i < n && !any_memop; i++)
    any_memop = conns[i]->order == GPUIPC_ORDER_MEMOP;
  if (any_memop)
    GPUIPC__CHECK(bword_get(ordinal, &bword));
  gpuipc__w_buf *ws = malloc(n * sizeof *ws);
  gpuipc_status *st = statuses ? statuses : malloc(n * sizeof *st);
  if (ws == NULL || st == NULL) {
    free(ws);
    if (st != statuses)
      free(st);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_conn_broadcast");
  }
  /* 1: every connection made ready (a slot free, the chunks exported,
   * event mode's record); one that fails is left out, the others go on. */
  struct gpuipc__ho *h0 = NULL; /* a memop connection that is ready */
  char why[256] = "";
  size_t bad = n; /* the first connection that failed, and why */
  for (size_t i = 0; i < n; i++) {
    st[i] = bc_prepare(conns[i], block, bword, stream, meta_len, &ws[i]);
    if (st[i] != GPUIPC_OK && bad == n) {
      bad = i;
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
    }
    if (st[i] == GPUIPC_OK && conns[i]->order == GPUIPC_ORDER_MEMOP &&
        h0 == NULL)
      h0 = conns[i]->ho;
  }
  /* 2: the one ready signal of the memop connections: the broadcast
   * word's next value, after the work queued on `stream` (before the
   * frames: its value travels in them). */
  gpuipc__w_word word = {0, 0, 0, 0, 0};
  struct CUstream_st *wst = stream;
  /* An idle stream: its work is done, no signal is needed (DONE). */
  bool done = h0 != NULL && stream_idle(h0, ordinal, stream);
  if (h0 != NULL && !done) {
    gpuipc_status bs = bword_write(h0, ordinal, stream, &word.value, &wst);
    if (bs != GPUIPC_OK) {
      for (size_t i = 0; i < n; i++)
        if (st[i] == GPUIPC_OK && conns[i]->order == GPUIPC_ORDER_MEMOP) {
          st[i] = bs; /* nothing was sent to them: their slots stay free */
          if (i < bad) {
            bad = i;
            snprintf(why, sizeof why, "%s", gpuipc_last_error());
          }
        }
    }
    word.arena_id = bword->arena->id;
    word.off = bword->off;
    word.chunk = bword->chunk;
  }
  /* 3: the frames, back to back. */
  for (size_t i = 0; i < n; i++) {
    if (st[i] != GPUIPC_OK)
      continue;
    gpuipc_conn *c = conns[i];
    if (c->watch)
      atomic_store(&c->watch->tx_seq, ws[i].seq);
    if (c->order == GPUIPC_ORDER_MEMOP && done) {
      ws[i].flags |= GPUIPC__BUF_DONE;
      st[i] = gpuipc__conn_send_frame(c, GPUIPC__F_BUF, &ws[i], sizeof ws[i],
                                      meta, meta_len, NULL, 0,
                                      gpuipc__conn_deadline(c));
    } else if (c->order == GPUIPC_ORDER_MEMOP) {
      unsigned char p[sizeof ws[i] + sizeof word];
      memcpy(p, &ws[i], sizeof ws[i]);
      memcpy(p + sizeof ws[i], &word, sizeof word);
      st[i] = gpuipc__conn_send_frame(c, GPUIPC__F_BUFW, p, sizeof p, meta,
                                      meta_len, NULL, 0,
                                      gpuipc__conn_deadline(c));
    } else {
      st[i] = gpuipc__conn_send_frame(c, GPUIPC__F_BUF, &ws[i], sizeof ws[i],
                                      meta, meta_len, NULL, 0,
                                      gpuipc__conn_deadline(c));
    }
    if (st[i] != GPUIPC_OK) {
      if (i < bad) {
        bad = i;
        snprintf(why, sizeof why, "%s", gpuipc_last_error());
      }
      continue;
    }
    /* The slot's own ready word is not written: the broadcast word's
     * write stands for it (a later write of the slot from another
     * stream waits for this lease's release first; a dead peer's
     * release words are forced for the slot). No ready write is made
     * here, so this cannot fail. */
    (void)tx_commit(c, c->ho, 1, &ws[i].slot, &ws[i].seq, &block, NULL, wst,
                    c->order == GPUIPC_ORDER_MEMOP, false);
  }
  gpuipc_status first = bad < n ? st[bad] : GPUIPC_OK;
  free(ws);
  if (st != statuses)
    free(st);
  if (first != GPUIPC_OK)
    return gpuipc__fail(first,
                        "gpuipc_conn_broadcast: connection %zu (the first "
                        "that failed): %s",
                        bad, why);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_send_buffer(gpuipc_conn *conn, gpuipc_buffer *buf,
                                      struct CUstream_st *stream,
                                      const void *meta, size_t meta_len) {
  if (conn == NULL || buf == NULL || meta_len > GPUIPC_META_MAX ||
      (meta_len > 0 && meta == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send_buffer: NULL connection/buffer or "
                        "metadata of %zu bytes (max %d)",
                        meta_len, GPUIPC_META_MAX);
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc__buffer_info bi;
  GPUIPC__CHECK(gpuipc__buffer_info_get(buf, &bi));
  struct gpuipc__ho *h = NULL;
  uint64_t deadline = 0;
  GPUIPC__CHECK(tx_open(conn, bi.ordinal, &h, &deadline));
  /* The descriptor is made once per buffer by the handle layer (later
   * exports reuse the driver handle); the peer's import cache makes its
   * second and later receipts of this buffer free of driver calls. */
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t dlen = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = GPUIPC_DESC_MAX_FDS;
  GPUIPC__CHECK(gpuipc_buffer_export(buf, desc, sizeof desc, &dlen, fds, &nfds));
  gpuipc__w_buf w = {0, 0, 0, bi.size, 0, UINT32_MAX, GPUIPC__BUF_DESC, 0};
  gpuipc_status s = send_core(conn, h, stream, false, &w, desc, (uint32_t)dlen,
                              fds, nfds, meta, meta_len, deadline, NULL, buf);
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return s;
}

gpuipc_status gpuipc_conn_buffer_wait(gpuipc_conn *conn,
                                      const gpuipc_buffer *buf,
                                      struct CUstream_st *stream) {
  if (conn == NULL || buf == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_buffer_wait: NULL");
  struct gpuipc__ho *h = conn->ho;
  if (h == NULL || h->lt == NULL)
    return GPUIPC_OK;
  gpuipc__lease_table *lt = h->lt;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, lt->ordinal));
  gpuipc_status s = GPUIPC_OK;
  gpuipc__relrec recs[32];
  size_t n;
  while ((n = gpuipc__lease_take_releases(lt, buf, recs,
                                          GPUIPC__ARRAY_SIZE(recs))) > 0) {
    for (size_t i = 0; i < n; i++) {
      if (recs[i].local) {
        if (s == GPUIPC_OK) {
          CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream,
                                  (CUevent)recs[i].local, 0);
          if (r != CUDA_SUCCESS)
            s = gpuipc__fail_cuda(r, "cuStreamWaitEvent",
                                  "ordering reuse of a released buffer");
        }
        GPUIPC__CU(cuEventDestroy, (CUevent)recs[i].local);
        continue;
      }
      if (s != GPUIPC_OK)
        continue;
      CUstream wst = NULL;
      s = gpuipc__ho_wait_stream(h, 0, stream, &wst);
      if (s != GPUIPC_OK)
        continue;
      CUresult r = GPUIPC__CU(
          cuStreamWaitValue64, wst,
          (CUdeviceptr)gpuipc__released_word(lt->ctl->ptr, lt->nslots,
                                             recs[i].slot),
          (cuuint64_t)recs[i].seq, CU_STREAM_WAIT_VALUE_GEQ);
      if (r == CUDA_SUCCESS)
        r = gpuipc__ho_wait_done(h, 0, stream);
      if (r != CUDA_SUCCESS)
        s = gpuipc__fail_cuda(r, "cuStreamWaitValue64",
                              "ordering reuse of a released buffer");
    }
  }
  gpuipc__ctx_leave(&g);
  return s;
}

unsigned gpuipc_conn_get_buffer_holders(gpuipc_conn *conn,
                                    const gpuipc_buffer *buf) {
  if (conn == NULL || buf == NULL || conn->ho == NULL || conn->ho->lt == NULL)
    return 0;
  if (conn->state == GPUIPC__CONN_OPEN)
    (void)gpuipc__conn_pump(conn, 0, NULL, NULL);
  struct gpuipc__ho *h = conn->ho;
  if (h == NULL || h->lt == NULL)
    return 0;
  return gpuipc__lease_buffer_holders(h->lt, buf);
}

unsigned gpuipc__conn_block_holders(gpuipc_conn *conn,
                                    const gpuipc_block *block) {
  if (conn == NULL || block == NULL || conn->ho == NULL || conn->ho->lt == NULL)
    return 0;
  return gpuipc__lease_block_holders(conn->ho->lt, block);
}

bool gpuipc__conn_block_releasing(gpuipc_conn *conn, gpuipc_block *block) {
  if (conn == NULL || block == NULL || conn->ho == NULL || conn->ho->lt == NULL)
    return false;
  return gpuipc__block_pending(block, conn->ho->lt->rc.id);
}
