/*
 * tx.c: owns the sender of the per-buffer fast path: setting up, once per
 * connection, its lease table (lease.c's) and the arena chunks exported
 * to it, the one
 * preparation every send shares (a connection made ready, free slots,
 * event mode's records, sequence numbers, and after the frame the ready
 * signal and the leases recorded), the sends of one block, one buffer by
 * descriptor, a batch and a broadcast (sent at once to the connections
 * that are ready, then to the others as each gets ready, waited for
 * together), the devices' broadcast words, and the questions about what
 * the peer still holds. It never calls the receiver (rx.c): what both
 * directions need is in handoff.c.
 */
#include "handoff_int.h"

#include <errno.h>
#include <poll.h>
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

/* Gets c ready to send from device `ordinal`: its fast-path state, and at
 * its first send the lease table (flag words on that device) with the
 * peer told where they are (its frames wait up to deadline for room). */
static gpuipc_status tx_setup(gpuipc_conn *c, int ordinal, uint64_t deadline,
                              struct gpuipc__ho **h_out) {
  struct gpuipc__ho *h = NULL;
  GPUIPC__CHECK(gpuipc__ho_get(c, &h));
  if (h->lt == NULL)
    GPUIPC__CHECK(setup_tx(c, h, ordinal, deadline));
  *h_out = h;
  return GPUIPC_OK;
}

/* tx_setup with the deadline of this call, taken now: what every send to
 * one connection starts with. */
static gpuipc_status tx_open(gpuipc_conn *c, int ordinal,
                             struct gpuipc__ho **h_out, uint64_t *deadline) {
  *deadline = gpuipc__conn_deadline(c);
  return tx_setup(c, ordinal, *deadline, h_out);
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
    /* No write: recorded as each slot's last one all the same, by no
     * stream, so that the next write (from any stream: the slot's last
     * real write may still be queued on another) first waits for this
     * lease's release, and a dead peer's release word is forced. */
    for (uint32_t i = 0; i < n; i++)
      gpuipc__lease_written_stand_in(lt, slots[i], seqs[i]);
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
    /* Once, to the largest frame (not grown: gpuipc__grow). */
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

/* A broadcast does not let one connection hold back the others: every
 * connection is first made ready without waiting, the ready ones get
 * their frames at once (back to back, after the one ready signal), and
 * only then does the call wait, for all the others together (their fds
 * in one poll), each up to its own deadline taken at entry, sending to
 * each as soon as it is ready. So a consumer that never releases (every
 * slot of its connection out) or never reads (its socket full) costs the
 * others nothing, and the call at most the longest timeout of the
 * connections it waits for, once. */

/* One connection of a broadcast. */
typedef struct bc_conn {
  gpuipc__w_buf w;   /* its frame, once it is ready */
  uint64_t deadline; /* taken at entry */
  short need;        /* what it waits for: POLLIN a release, POLLOUT room */
  bool pending;      /* neither sent nor failed yet */
  bool ready;        /* prepared, its frame not yet sent */
  bool due;          /* to be tried again now */
  bool unpolled;     /* its polling mode is off while the call waits */
  int pi;            /* its entry in the poll set, or -1 */
} bc_conn;

/* One call of gpuipc_conn_broadcast. */
typedef struct bc_call {
  gpuipc_conn *const *conns;
  size_t n;
  gpuipc_block *block;
  gpuipc_block *bword; /* the device's broadcast word (memop connections) */
  struct CUstream_st *stream;
  const void *meta;
  size_t meta_len;
  int ordinal;
  bc_conn *bc;
  gpuipc_status *st;
  /* The one ready signal of the memop connections, made when the first
   * of them is ready: none when the stream was idle (DONE), else the
   * broadcast word's next value, written on wst. */
  bool decided, done;
  gpuipc__w_word word;
  struct CUstream_st *wst;
  /* The first connection that failed (n: none), and why. */
  size_t bad;
  char why[256];
} bc_call;

/* Connection i failed with s (the message recorded for the first). */
static void bc_fail(bc_call *x, size_t i, gpuipc_status s) {
  x->st[i] = s;
  x->bc[i].pending = false;
  x->bc[i].ready = false;
  if (i < x->bad) {
    x->bad = i;
    snprintf(x->why, sizeof x->why, "%s", gpuipc_last_error());
  }
}

/* Gets connection `c` ready to take a lease of `block` (flag words, the
 * chunk exported, a free slot, event mode's record) without waiting;
 * *w is its frame. GPUIPC_E_WOULD_BLOCK: not yet, *need says for what
 * (POLLIN: a release, every slot being out; POLLOUT: room on the
 * connection for its setup). */
static gpuipc_status bc_prepare(gpuipc_conn *c, gpuipc_block *block,
                                gpuipc_block *bword,
                                struct CUstream_st *stream, size_t meta_len,
                                gpuipc__w_buf *w, short *need) {
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  *need = POLLIN | POLLOUT;
  struct gpuipc__ho *h = NULL;
  gpuipc_arena *a = block->arena;
  GPUIPC__CHECK(tx_setup(c, a->ordinal, 0, &h));
  gpuipc__lease_table *lt = h->lt;
  if (a->ordinal != lt->ordinal)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_broadcast: the block is on device %d, a "
                        "connection's flag words on device %d (one device per "
                        "connection)",
                        a->ordinal, lt->ordinal);
  GPUIPC__CHECK(export_chunk(c, h, a, block->chunk, 0));
  bool ordered = c->order == GPUIPC_ORDER_MEMOP;
  if (ordered) /* the broadcast word's chunk */
    GPUIPC__CHECK(export_chunk(c, h, bword->arena, bword->chunk, 0));
  uint32_t slot;
  uint64_t seq;
  gpuipc_status s =
      take_leases(c, h, stream, 0, 1, false, false, &slot, &seq);
  if (s != GPUIPC_OK) {
    uint32_t one = 1;
    if (s == GPUIPC_E_WOULD_BLOCK && c->ho == h && !have_free_slots(c, &one))
      *need = POLLIN;
    return s;
  }
  *w = (gpuipc__w_buf){seq,         a->id, block->off, block->bytes, slot,
                       block->chunk, 0,    (uint32_t)meta_len};
  w->flags |= buf_flags(c, false);
  return GPUIPC_OK;
}

/* The one ready signal of the memop connections, made when the first of
 * them is ready (h: its state, for a legacy stream's relay): the
 * broadcast word's next value after the work queued on the stream (before
 * any frame: its value travels in them), or none when that work is done
 * (DONE). A word that cannot be written fails every memop connection not
 * served yet (nothing was sent to them: their slots stay free). */
static void bc_signal(bc_call *x, struct gpuipc__ho *h) {
  x->decided = true;
  x->done = stream_idle(h, x->ordinal, x->stream);
  if (x->done)
    return;
  gpuipc_status bs =
      bword_write(h, x->ordinal, x->stream, &x->word.value, &x->wst);
  if (bs != GPUIPC_OK) {
    for (size_t i = 0; i < x->n; i++)
      if (x->bc[i].pending && x->conns[i]->order == GPUIPC_ORDER_MEMOP)
        bc_fail(x, i, bs);
    return;
  }
  x->word.arena_id = x->bword->arena->id;
  x->word.off = x->bword->off;
  x->word.chunk = x->bword->chunk;
}

/* Sends ready connection i its frame (never waiting: a frame that finds
 * the connection full is queued) and records its lease. */
static gpuipc_status bc_send(bc_call *x, size_t i) {
  gpuipc_conn *c = x->conns[i];
  gpuipc__w_buf *w = &x->bc[i].w;
  x->bc[i].ready = false;
  if (c->watch)
    atomic_store(&c->watch->tx_seq, w->seq);
  gpuipc_status s;
  if (c->order == GPUIPC_ORDER_MEMOP && !x->done) {
    /* A connection ready only after the word was written (or even after
     * the GPU wrote it) names the same word and value all the same, and
     * that is still exactly the order asked for: its consumer waits until
     * the word holds this value or more, which it first does after the
     * work queued before this call (the write follows that work on the
     * stream), and the word never goes backwards (later broadcasts write
     * greater values, after this one). A wait enqueued when the value is
     * there already passes at once, as it should: the work it orders is
     * done. */
    unsigned char p[sizeof *w + sizeof x->word];
    memcpy(p, w, sizeof *w);
    memcpy(p + sizeof *w, &x->word, sizeof x->word);
    s = gpuipc__conn_send_frame(c, GPUIPC__F_BUFW, p, sizeof p, x->meta,
                                x->meta_len, NULL, 0, 0);
  } else {
    if (c->order == GPUIPC_ORDER_MEMOP) /* the work was done at the call */
      w->flags |= GPUIPC__BUF_DONE;
    s = gpuipc__conn_send_frame(c, GPUIPC__F_BUF, w, sizeof *w, x->meta,
                                x->meta_len, NULL, 0, 0);
  }
  if (s != GPUIPC_OK) {
    x->bc[i].need = POLLIN | POLLOUT;
    return s; /* nothing was enqueued: the slot stays free */
  }
  /* The slot's own ready word is not written: the broadcast word's write
   * stands for it (a later write of the slot from another stream waits
   * for this lease's release first; a dead peer's release words are
   * forced for the slot). No ready write is made here, so this cannot
   * fail. */
  (void)tx_commit(c, c->ho, 1, &w->slot, &w->seq, &x->block, NULL, x->wst,
                  c->order == GPUIPC_ORDER_MEMOP, false);
  return GPUIPC_OK;
}

/* What became of a try of pending connection i: s is GPUIPC_OK (sent),
 * GPUIPC_E_WOULD_BLOCK (not ready yet: it waits on, unless its deadline
 * passed, and then it failed: GPUIPC_E_TIMEOUT, or GPUIPC_E_WOULD_BLOCK
 * for a connection that does not wait), or why it failed. */
static void bc_settle(bc_call *x, size_t i, gpuipc_status s) {
  bc_conn *b = &x->bc[i];
  if (s == GPUIPC_OK) {
    b->pending = false;
    x->st[i] = GPUIPC_OK;
    return;
  }
  if (s != GPUIPC_E_WOULD_BLOCK) {
    bc_fail(x, i, s);
    return;
  }
  if (b->deadline == UINT64_MAX || gpuipc__now_ns() < b->deadline)
    return;
  gpuipc_conn *c = x->conns[i];
  const char *what = b->need == POLLIN
                         ? "a release (every slot of the connection is out)"
                         : "room on the connection (the peer reads nothing)";
  if (b->deadline == 0)
    s = gpuipc__fail(GPUIPC_E_WOULD_BLOCK,
                     "gpuipc_conn_broadcast: would block: the peer (pid %d) "
                     "owes %s",
                     c->peer_pid, what);
  else
    s = gpuipc__fail(GPUIPC_E_TIMEOUT,
                     "gpuipc_conn_broadcast: timed out after %d ms waiting "
                     "for %s from the peer (pid %d)",
                     c->timeout_ms, what, c->peer_pid);
  bc_fail(x, i, s);
}

/* Tries pending connection i again: ready now, it gets its frame (after
 * the ready signal, made now when it is the first memop connection
 * ready). */
static void bc_try(bc_call *x, size_t i) {
  gpuipc_conn *c = x->conns[i];
  bc_conn *b = &x->bc[i];
  gpuipc_status s = bc_prepare(c, x->block, x->bword, x->stream, x->meta_len,
                               &b->w, &b->need);
  if (s == GPUIPC_OK && c->order == GPUIPC_ORDER_MEMOP && !x->decided) {
    bc_signal(x, c->ho);
    if (!b->pending)
      return; /* the word could not be written */
  }
  if (s == GPUIPC_OK)
    s = bc_send(x, i);
  bc_settle(x, i, s);
}

/* Waits for the connections not ready yet, all together: one poll of
 * their fds (POLLIN for a release or their peer's end, POLLOUT for room)
 * until the nearest of their deadlines, then a try of each that saw
 * something, or whose deadline came (pf: room for n entries). A ring
 * connection whose application polls is switched to sleeping for the
 * wait, so that its peer's records make its fd readable (its mode is
 * restored by the caller). */
static void bc_wait(bc_call *x, struct pollfd *pf) {
  for (;;) {
    for (size_t i = 0; i < x->n; i++)
      if (x->bc[i].pending && x->bc[i].due) {
        x->bc[i].due = false;
        bc_try(x, i);
      }
    size_t np = 0;
    uint64_t until = UINT64_MAX;
    bool again = false;
    for (size_t i = 0; i < x->n; i++) {
      bc_conn *b = &x->bc[i];
      b->pi = -1;
      if (!b->pending)
        continue;
      gpuipc_conn *c = x->conns[i];
      if (c->polling && !b->unpolled) {
        /* Sleeping from now on: what its peer publishes from here wakes
         * the fd; what it published before, the next try reads. */
        (void)gpuipc_conn_set_polling(c, 0);
        b->unpolled = true;
        b->due = true;
      }
      int fd = gpuipc_conn_get_fd(c);
      if (fd < 0 || gpuipc__now_ns() >= b->deadline)
        b->due = true; /* ended (the try says so), or its last try */
      if (b->due) {
        again = true;
        continue;
      }
      short ev = b->need;
      if (c->tx_len > c->tx_off) /* queued frames: flushed by the try */
        ev |= POLLOUT;
      pf[np] = (struct pollfd){fd, ev, 0};
      b->pi = (int)np++;
      if (b->deadline < until)
        until = b->deadline;
    }
    if (again)
      continue;
    if (np == 0)
      return;
    int r = poll(pf, (nfds_t)np, gpuipc__poll_ms(until));
    if (r < 0 && errno != EINTR) {
      gpuipc_status s = gpuipc__fail_errno(errno, "poll",
                                           "gpuipc_conn_broadcast: %zu "
                                           "connections",
                                           np);
      for (size_t i = 0; i < x->n; i++)
        if (x->bc[i].pending)
          bc_fail(x, i, s);
      return;
    }
    for (size_t i = 0; i < x->n; i++)
      if (x->bc[i].pending && x->bc[i].pi >= 0 && pf[x->bc[i].pi].revents)
        x->bc[i].due = true;
  }
}

typedef struct bc_pos {
  uintptr_t conn;
  size_t i;
} bc_pos;

static int bc_pos_cmp(const void *a, const void *b) {
  const bc_pos *x = a, *y = b;
  if (x->conn != y->conn)
    return x->conn < y->conn ? -1 : 1;
  return x->i < y->i ? -1 : x->i > y->i;
}

/* GPUIPC_E_INVALID_ARG when a connection is named twice, naming the first
 * such pair in the order of the list (the lowest second index, with the
 * first index of that connection): sorted by connection, then index, so
 * the pair with the lowest second index is adjacent. O(n log n). */
static gpuipc_status bc_distinct(gpuipc_conn *const *conns, size_t n) {
  if (n < 2)
    return GPUIPC_OK;
  bc_pos *v = malloc(n * sizeof *v);
  if (v == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_conn_broadcast");
  for (size_t i = 0; i < n; i++)
    v[i] = (bc_pos){(uintptr_t)conns[i], i};
  qsort(v, n, sizeof *v, bc_pos_cmp);
  size_t first = 0, second = SIZE_MAX;
  for (size_t j = 1; j < n; j++)
    if (v[j].conn == v[j - 1].conn && v[j].i < second) {
      first = v[j - 1].i;
      second = v[j].i;
    }
  free(v);
  if (second == SIZE_MAX)
    return GPUIPC_OK;
  return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                      "gpuipc_conn_broadcast: connections %zu and %zu are "
                      "the same",
                      first, second);
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
  for (size_t i = 0; i < n; i++)
    if (conns[i] == NULL)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_broadcast: connection %zu is NULL", i);
  GPUIPC__CHECK(bc_distinct(conns, n));
  GPUIPC__CHECK(gpuipc__driver());
  bc_call x = {.conns = conns,
               .n = n,
               .block = block,
               .stream = stream,
               .meta = meta,
               .meta_len = meta_len,
               .ordinal = block->arena->ordinal,
               .wst = stream,
               .bad = n};
  bool any_memop = false;
  for (size_t i = 0; i < n && !any_memop; i++)
    any_memop = conns[i]->order == GPUIPC_ORDER_MEMOP;
  if (any_memop)
    GPUIPC__CHECK(bword_get(x.ordinal, &x.bword));
  x.bc = calloc(n, sizeof *x.bc);
  struct pollfd *pf = malloc(n * sizeof *pf);
  x.st = statuses ? statuses : malloc(n * sizeof *x.st);
  if (x.bc == NULL || pf == NULL || x.st == NULL) {
    free(x.bc);
    free(pf);
    if (x.st != statuses)
      free(x.st);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_conn_broadcast");
  }
  /* Each connection's deadline, taken once, before anything else. */
  for (size_t i = 0; i < n; i++) {
    x.bc[i].deadline = gpuipc__conn_deadline(conns[i]);
    x.bc[i].pending = true;
    x.bc[i].pi = -1;
  }
  /* 1: every connection made ready without waiting (a slot free, the
   * chunks exported, event mode's record); one that fails is left out,
   * one that is not ready yet is waited for in 4. */
  struct gpuipc__ho *h0 = NULL; /* a memop connection that is ready */
  for (size_t i = 0; i < n; i++) {
    gpuipc_status s = bc_prepare(conns[i], block, x.bword, stream, meta_len,
                                 &x.bc[i].w, &x.bc[i].need);
    if (s != GPUIPC_OK) {
      bc_settle(&x, i, s);
      continue;
    }
    x.bc[i].ready = true;
    if (conns[i]->order == GPUIPC_ORDER_MEMOP && h0 == NULL)
      h0 = conns[i]->ho;
  }
  /* 2: the one ready signal of the memop connections. */
  if (h0 != NULL)
    bc_signal(&x, h0);
  /* 3: the frames of the ready ones, back to back, so that the last of
   * them is behind neither the others' sends nor their signals; the looks
   * for a hang-up their records' puts would make one by one, in one poll
   * first. */
  gpuipc__conn_hup_look(conns, n, pf);
  for (size_t i = 0; i < n; i++)
    if (x.bc[i].ready)
      bc_settle(&x, i, bc_send(&x, i));
  /* 4: the others, each sent to as soon as it is ready. */
  bc_wait(&x, pf);
  for (size_t i = 0; i < n; i++)
    if (x.bc[i].unpolled)
      (void)gpuipc_conn_set_polling(conns[i], 1);
  gpuipc_status first = x.bad < n ? x.st[x.bad] : GPUIPC_OK;
  free(x.bc);
  free(pf);
  if (x.st != statuses)
    free(x.st);
  if (first != GPUIPC_OK)
    return gpuipc__fail(first,
                        "gpuipc_conn_broadcast: connection %zu (the first "
                        "that failed): %s",
                        x.bad, x.why);
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
