/*
 * handoff.c: owns the per-buffer fast path: exporting arena chunks and the
 * flag words to a connection once, sending a block as one small frame,
 * receiving it, releasing it, and the stream ordering of both directions
 * with stream memory operations on the flag words.
 *
 * Flag words. Each side that sends on a connection owns 2 * nslots 64-bit
 * words in its arena: ready[slot], written by the producer's stream after
 * its work (cuStreamWriteValue64) and awaited by the consumer's stream in
 * recv (cuStreamWaitValue64 GEQ); released[slot], written by the consumer's
 * stream in release and awaited by the producer's arena reclaim stream.
 * A slot carries one lease at a time; sequence numbers only grow, so words
 * never need resetting, and a GEQ wait for an old value passes for any
 * newer one.
 *
 * Writes to one word from different streams could land out of order and
 * make a word go backwards (a newer value overwritten by an older, slower
 * one), which would hang a wait. So a writer that changes streams between
 * two writes of the same slot first makes its new stream wait for the
 * previous cycle to be complete: the producer waits for released[slot] >=
 * the slot's previous sequence number (which implies its previous ready
 * write landed and was consumed), the consumer waits for released[slot] >=
 * its previous release. With one stream per side (the common case) this
 * costs nothing.
 *
 * Batches. A batch of blocks (BUFS, gpuipc_conn_send_batch) has one ready
 * write, that of its newest entry, which the consumer awaits for all of
 * them (one wait when it receives them together); a batch of releases
 * (gpuipc_conn_release_batch) writes the released word of the last buffer
 * of each run only, and flags the others GPUIPC__REL_BY_NEXT, so that the
 * producer waits for that word for all of them. Each side remembers, per
 * slot, which word signals its newest release (for the guard above).
 * Broadcast (gpuipc_conn_broadcast) prepares every connection, enqueues
 * ONE write of the device's broadcast word (a word of the flag-word arena
 * shared by all connections, its values growing), then writes the BUFW
 * frames back to back; each consumer waits on that word. A consumer
 * writes a producer's broadcast word only once the producer's process is
 * gone (its other consumers wait on it too).
 */
#include "handoff_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static gpuipc_status ho_get(gpuipc_conn *c, struct gpuipc__ho **out) {
  if (c->ho == NULL) {
    c->ho = calloc(1, sizeof *c->ho);
    if (c->ho == NULL)
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "connection state");
    c->ho->peer_pid = c->peer_pid;
    c->ho->peer_ordinal = -1;
  }
  (void)gpuipc__conn_fast(c); /* the transport dispatches to us from now on */
  *out = c->ho;
  return GPUIPC_OK;
}

/* ---- the legacy default stream ----------------------------------------------------- */

/* Stream memory operations are never enqueued on the legacy default
 * stream. That stream synchronizes with every blocking stream of the
 * context, so a cuStreamWaitValue64 on it (which may wait for the peer for
 * as long as the peer likes) would stall all of them, and the synchronous
 * driver calls that run on it (cuMemcpy, cuMemset, frees that wait for the
 * device) would wait for the peer too. For a caller that passes it, the
 * operation runs on a private non-blocking stream (one per connection and
 * side), joined to the legacy stream by an event: before a write, the
 * private stream waits for the legacy stream's work so far; after a wait,
 * the legacy stream waits for the private stream. Context current. */
static gpuipc_status lq_get(struct gpuipc__ho *h, int i, CUstream *out) {
  if (h->lq[i] == NULL) {
    CUstream st;
    CUevent ev;
    CUresult r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
    if (r != CUDA_SUCCESS)
      return gpuipc__fail_cuda(r, "cuStreamCreate", "legacy-stream relay");
    r = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
    if (r != CUDA_SUCCESS) {
      GPUIPC__CU(cuStreamDestroy, st);
      return gpuipc__fail_cuda(r, "cuEventCreate", "legacy-stream relay");
    }
    h->lq[i] = (struct CUstream_st *)st;
    h->lev[i] = (struct CUevent_st *)ev;
  }
  *out = (CUstream)h->lq[i];
  return GPUIPC_OK;
}

/* The stream for a write ordered after the work queued on `user`. */
static gpuipc_status write_stream(struct gpuipc__ho *h, int i,
                                  struct CUstream_st *user, CUstream *out) {
  if (!gpuipc__is_legacy_stream(user)) {
    *out = (CUstream)user;
    return GPUIPC_OK;
  }
  CUstream q;
  GPUIPC__CHECK(lq_get(h, i, &q));
  CUresult r = GPUIPC__CU(cuEventRecord, (CUevent)h->lev[i], (CUstream)user);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamWaitEvent, q, (CUevent)h->lev[i], 0);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventRecord/cuStreamWaitEvent",
                             "ordering after the legacy stream");
  *out = q;
  return GPUIPC_OK;
}

/* The stream for a wait that `user` must be ordered after (call
 * wait_done once the wait is enqueued on it). */
static gpuipc_status wait_stream(struct gpuipc__ho *h, int i,
                                 struct CUstream_st *user, CUstream *out) {
  if (!gpuipc__is_legacy_stream(user)) {
    *out = (CUstream)user;
    return GPUIPC_OK;
  }
  return lq_get(h, i, out);
}

static CUresult wait_done(struct gpuipc__ho *h, int i,
                          struct CUstream_st *user) {
  if (!gpuipc__is_legacy_stream(user))
    return CUDA_SUCCESS;
  CUresult r = GPUIPC__CU(cuEventRecord, (CUevent)h->lev[i], (CUstream)h->lq[i]);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)user, (CUevent)h->lev[i], 0);
  return r;
}

/* Destroys h->lq[i] / h->lev[i] (context of device `ordinal`). */
static void free_lq(struct gpuipc__ho *h, int i, int ordinal) {
  if (h->lq[i] == NULL)
    return;
  gpuipc__ctx_guard g;
  bool in = ordinal >= 0 && gpuipc__ctx_enter(&g, ordinal) == GPUIPC_OK;
  GPUIPC__CU(cuStreamDestroy, (CUstream)h->lq[i]);
  GPUIPC__CU(cuEventDestroy, (CUevent)h->lev[i]);
  if (in)
    gpuipc__ctx_leave(&g);
  h->lq[i] = NULL;
  h->lev[i] = NULL;
}

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

static bool have_free_slot(gpuipc_conn *c, void *arg) {
  (void)arg;
  uint32_t slot;
  return gpuipc__lease_free_slot(c->ho->lt, &slot);
}

/* Event mode: makes an interprocess event on device `ordinal` and sends its
 * descriptor for `slot` (which: 0 ready, 1 release). */
static gpuipc_status make_event(gpuipc_conn *conn, int ordinal, uint32_t slot,
                                uint32_t which, uint64_t deadline,
                                gpuipc_event **out) {
  gpuipc_uuid u;
  GPUIPC__CHECK(gpuipc_device_uuid(ordinal, &u));
  gpuipc_event *ev = NULL;
  GPUIPC__CHECK(gpuipc_event_create(&u, &ev));
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t dl = 0;
  gpuipc_status s = gpuipc_event_export(ev, desc, sizeof desc, &dl);
  if (s == GPUIPC_OK) {
    gpuipc__w_evd w = {slot, which, (uint32_t)dl, 0};
    s = gpuipc__conn_send_frame(conn, GPUIPC__F_EVD, &w, sizeof w, desc, dl,
                                NULL, 0, deadline);
  }
  if (s != GPUIPC_OK) {
    gpuipc_event_destroy(ev);
    return s;
  }
  *out = ev;
  return GPUIPC_OK;
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
  gpuipc_status ss = write_stream(h, 0, *stream, &ws);
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

/* A free slot (waiting up to deadline for a release when every slot is
 * out), event mode's record of its ready event on stream, and the next
 * sequence number: what every send of one buffer starts with. */
static gpuipc_status take_lease(gpuipc_conn *conn, struct gpuipc__ho *h,
                                struct CUstream_st *stream, uint64_t deadline,
                                uint32_t *slot_out, uint64_t *seq_out) {
  gpuipc__lease_table *lt = h->lt;
  uint32_t slot;
  if (!gpuipc__lease_free_slot(lt, &slot)) {
    /* Every slot is out: wait for a release. */
    GPUIPC__CHECK(gpuipc__conn_pump(conn, deadline, have_free_slot, NULL));
    if (conn->ho != h || !gpuipc__lease_free_slot(lt, &slot))
      return gpuipc__fail(GPUIPC_E_INTERNAL, "no free slot after a release");
  }
  if (conn->order == GPUIPC_ORDER_EVENT) {
    gpuipc_event *ev = gpuipc__lease_ready_event(lt, slot);
    if (ev == NULL) {
      GPUIPC__CHECK(make_event(conn, lt->ordinal, slot, 0, deadline, &ev));
      gpuipc__lease_set_ready_event(lt, slot, ev);
    }
    /* The consumer's wait (at recv) captures this record; the slot's event
     * is recorded again only after the consumer released this lease. */
    GPUIPC__CHECK(gpuipc_event_record(ev, stream));
  }
  uint64_t seq = gpuipc__lease_new_seq(lt);
  if (seq == 0)
    return gpuipc__fail(GPUIPC_E_LIMIT, "the connection's sequence numbers "
                                        "are used up (2^62 buffers)");
  *slot_out = slot;
  *seq_out = seq;
  return GPUIPC_OK;
}

/* The common part of both sends: a free slot, the frame, then the
 * stream-ordered ready write. `desc` (with fds) is set for a descriptor buffer, else
 * the frame names the arena block in w. On success the slot's lease is
 * recorded by the caller through *slot_out / *seq_out. */
static gpuipc_status send_core(gpuipc_conn *conn, struct gpuipc__ho *h,
                               struct CUstream_st *stream, gpuipc__w_buf *w,
                               const uint8_t *desc, uint32_t desc_len,
                               const int *fds, int nfds, const void *meta,
                               size_t meta_len, uint64_t deadline,
                               uint32_t *slot_out, uint64_t *seq_out) {
  gpuipc__lease_table *lt = h->lt;
  uint32_t slot;
  uint64_t seq;
  GPUIPC__CHECK(take_lease(conn, h, stream, deadline, &slot, &seq));
  bool ordered = conn->order == GPUIPC_ORDER_MEMOP;
  bool by_event = conn->order == GPUIPC_ORDER_EVENT;
  if (conn->watch)
    atomic_store(&conn->watch->tx_seq, seq);
  /* An arena block whose work is already done needs no ready write, and
   * the consumer no wait. */
  bool done = ordered && desc == NULL && stream_idle(h, lt->ordinal, stream);
  w->seq = seq;
  w->slot = slot;
  w->flags |= ordered ? GPUIPC__BUF_ORDERED : 0u;
  w->flags |= by_event ? GPUIPC__BUF_EVENT : 0u;
  w->flags |= done ? GPUIPC__BUF_DONE : 0u;
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
  gpuipc__lease_take_slot(lt, slot);
  if (done) {
    /* No write: recorded as the slot's last one all the same, so that a
     * later write from another stream first waits for this lease's
     * release, and a dead peer's release word is forced. */
    gpuipc__lease_written(lt, slot, seq, stream);
  } else if (ordered) {
    /* The ready write is enqueued after the frame left: the consumer's
     * stream waits for it on the GPU anyway, and the consumer holds the
     * buffer sooner by the time of this enqueue (about a microsecond). It
     * still follows exactly the work queued on `stream` before this call. */
    gpuipc_status ws_status = ready_write(h, slot, seq, &stream);
    if (ws_status != GPUIPC_OK) {
      /* The peer was told of a buffer whose ready word will never be
       * written: end the connection, so that it treats the buffer as from
       * a dead producer (its streams are unblocked, its next call says
       * the peer is gone), and never reuse the slot (it stays taken). */
      gpuipc_status cause = ws_status;
      char why[256];
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
      (void)gpuipc__conn_break(conn, "the ready flag of buffer %llu could "
                                     "not be enqueued",
                               (unsigned long long)seq);
      return gpuipc__fail(cause, "%s", why);
    }
    gpuipc__lease_written(lt, slot, seq, stream);
  }
  *slot_out = slot;
  *seq_out = seq;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_send(gpuipc_conn *conn, gpuipc_block *block,
                               struct CUstream_st *stream, const void *meta,
                               size_t meta_len) {
  if (conn == NULL || block == NULL || meta_len > GPUIPC_META_MAX ||
      (meta_len > 0 && meta == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send: NULL connection/block or metadata "
                        "of %zu bytes (max %d)",
                        meta_len, GPUIPC_META_MAX);
  if (!gpuipc__block_sendable(block))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send: the block was freed");
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  GPUIPC__CHECK(gpuipc__driver());
  struct gpuipc__ho *h = NULL;
  GPUIPC__CHECK(ho_get(conn, &h));
  uint64_t deadline = gpuipc__conn_deadline(conn);
  gpuipc_arena *a = block->arena;
  if (h->lt == NULL)
    GPUIPC__CHECK(setup_tx(conn, h, a->ordinal, deadline));
  if (a->ordinal != h->lt->ordinal)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send: the block is on device %d, this "
                        "connection's flag words on device %d (one device per "
                        "connection)",
                        a->ordinal, h->lt->ordinal);
  GPUIPC__CHECK(export_chunk(conn, h, a, block->chunk, deadline));
  gpuipc__w_buf w = {0,          a->id, block->off, block->bytes, 0,
                     block->chunk, 0,     0};
  uint32_t slot;
  uint64_t seq;
  GPUIPC__CHECK(send_core(conn, h, stream, &w, NULL, 0, NULL, 0, meta,
                          meta_len, deadline, &slot, &seq));
  gpuipc__lease_add(h->lt, slot, block, NULL, seq,
                    conn->order == GPUIPC_ORDER_MEMOP,
                    conn->order == GPUIPC_ORDER_EVENT);
  return GPUIPC_OK;
}

static bool have_free_slots(gpuipc_conn *c, void *arg) {
  uint32_t n = *(const uint32_t *)arg;
  return c->ho->lt->tx_nfree >= n;
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
  GPUIPC__CHECK(ho_get(conn, &h));
  uint64_t deadline = gpuipc__conn_deadline(conn);
  if (h->lt == NULL)
    GPUIPC__CHECK(setup_tx(conn, h, blocks[0]->arena->ordinal, deadline));
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
  uint32_t need = (uint32_t)n;
  uint32_t slots[GPUIPC_BATCH_MAX];
  if (!gpuipc__lease_free_slots(lt, need, slots)) {
    /* Not enough slots free: wait for releases. */
    GPUIPC__CHECK(gpuipc__conn_pump(conn, deadline, have_free_slots, &need));
    if (conn->ho != h || !gpuipc__lease_free_slots(lt, need, slots))
      return gpuipc__fail(GPUIPC_E_INTERNAL, "no free slots after releases");
  }
  bool ordered = conn->order == GPUIPC_ORDER_MEMOP;
  bool by_event = conn->order == GPUIPC_ORDER_EVENT;
  size_t flen = sizeof(gpuipc__w_bufs) + bytes;
  if (h->txcap < flen) {
    unsigned char *nb = realloc(h->txbuf, GPUIPC__FRAME_MAX);
    if (nb == NULL)
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "batch frame");
    h->txbuf = nb;
    h->txcap = GPUIPC__FRAME_MAX;
  }
  if (by_event) {
    /* Each buffer has its own ready event (its slot's), as in one send. */
    for (size_t i = 0; i < n; i++) {
      gpuipc_event *ev = gpuipc__lease_ready_event(lt, slots[i]);
      if (ev == NULL) {
        GPUIPC__CHECK(make_event(conn, lt->ordinal, slots[i], 0, deadline, &ev));
        gpuipc__lease_set_ready_event(lt, slots[i], ev);
      }
      GPUIPC__CHECK(gpuipc_event_record(ev, stream));
    }
  }
  bool done = ordered && stream_idle(h, lt->ordinal, stream);
  gpuipc__w_bufs hdr = {(uint32_t)n, (uint32_t)n - 1, 0, 0};
  memcpy(h->txbuf, &hdr, sizeof hdr);
  unsigned char *ent = h->txbuf + sizeof hdr;
  unsigned char *meta = ent + n * sizeof(gpuipc__w_buf);
  uint64_t seqs[GPUIPC_BATCH_MAX];
  for (size_t i = 0; i < n; i++) {
    gpuipc_block *b = blocks[i];
    seqs[i] = gpuipc__lease_new_seq(lt);
    if (seqs[i] == 0)
      return gpuipc__fail(GPUIPC_E_LIMIT, "the connection's sequence numbers "
                                          "are used up (2^62 buffers)");
    size_t ml = meta_lens ? meta_lens[i] : 0;
    gpuipc__w_buf w = {seqs[i],  b->arena->id, b->off, b->bytes, slots[i],
                       b->chunk, 0,            (uint32_t)ml};
    w.flags |= ordered ? GPUIPC__BUF_ORDERED : 0u;
    w.flags |= by_event ? GPUIPC__BUF_EVENT : 0u;
    w.flags |= done ? GPUIPC__BUF_DONE : 0u;
    memcpy(ent + i * sizeof w, &w, sizeof w);
    if (ml)
      memcpy(meta, metas[i], ml);
    meta += ml;
  }
  if (conn->watch)
    atomic_store(&conn->watch->tx_seq, seqs[n - 1]);
  GPUIPC__CHECK(gpuipc__conn_send_frame(conn, GPUIPC__F_BUFS, h->txbuf, flen,
                                        NULL, 0, NULL, 0, deadline));
  /* The frame left: the slots are taken (nothing was enqueued before, so a
   * failed frame left them free). */
  for (size_t i = 0; i < n; i++)
    gpuipc__lease_take_slot(lt, slots[i]);
  if (done) {
    /* The work before the batch had completed: no ready write (each slot
     * records the send as its last write, as below). */
    for (size_t i = 0; i < n; i++)
      gpuipc__lease_written(lt, slots[i], seqs[i], stream);
  } else if (ordered) {
    /* One ready write for the batch, that of its newest entry, after the
     * work queued on `stream`; the other entries' words are not written
     * (the consumer waits on this one for all of them). Each slot records
     * the batch's write as its own last one: a later write of the slot
     * from another stream then waits for this lease's release (which
     * follows the batch's write), and a dead peer's release words are
     * forced for these slots too. */
    struct CUstream_st *wst = stream;
    gpuipc_status ws_status = ready_write(h, slots[n - 1], seqs[n - 1], &wst);
    if (ws_status != GPUIPC_OK) {
      gpuipc_status cause = ws_status;
      char why[256];
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
      (void)gpuipc__conn_break(conn, "the ready flag of batch ending with "
                                     "buffer %llu could not be enqueued",
                               (unsigned long long)seqs[n - 1]);
      return gpuipc__fail(cause, "%s", why);
    }
    for (size_t i = 0; i < n; i++)
      gpuipc__lease_written(lt, slots[i], seqs[i], wst);
  }
  for (size_t i = 0; i < n; i++)
    gpuipc__lease_add(lt, slots[i], blocks[i], NULL, seqs[i], ordered,
                      by_event);
  return GPUIPC_OK;
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
  gpuipc_status s = write_stream(h, 0, stream, &ws);
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
  GPUIPC__CHECK(ho_get(c, &h));
  uint64_t deadline = gpuipc__conn_deadline(c);
  gpuipc_arena *a = block->arena;
  if (h->lt == NULL)
    GPUIPC__CHECK(setup_tx(c, h, a->ordinal, deadline));
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
  GPUIPC__CHECK(take_lease(c, h, stream, deadline, &slot, &seq));
  bool by_event = c->order == GPUIPC_ORDER_EVENT;
  *w = (gpuipc__w_buf){seq,         a->id, block->off, block->bytes, slot,
                       block->chunk, 0,    (uint32_t)meta_len};
  w->flags |= ordered ? GPUIPC__BUF_ORDERED : 0u;
  w->flags |= by_event ? GPUIPC__BUF_EVENT : 0u;
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
    struct gpuipc__ho *h = c->ho;
    bool ordered = c->order == GPUIPC_ORDER_MEMOP;
    gpuipc__lease_take_slot(h->lt, ws[i].slot);
    if (ordered)
      /* The slot's own ready word is not written: the broadcast word's
       * write stands for it (a later write of the slot from another
       * stream waits for this lease's release first; a dead peer's
       * release words are forced for the slot). */
      gpuipc__lease_written(h->lt, ws[i].slot, ws[i].seq, wst);
    gpuipc__lease_add(h->lt, ws[i].slot, block, NULL, ws[i].seq, ordered,
                      c->order == GPUIPC_ORDER_EVENT);
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
  GPUIPC__CHECK(ho_get(conn, &h));
  uint64_t deadline = gpuipc__conn_deadline(conn);
  if (h->lt == NULL)
    GPUIPC__CHECK(setup_tx(conn, h, bi.ordinal, deadline));
  /* The descriptor is made once per buffer by the handle layer (later
   * exports reuse the driver handle); the peer's import cache makes its
   * second and later receipts of this buffer free of driver calls. */
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t dlen = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = GPUIPC_DESC_MAX_FDS;
  GPUIPC__CHECK(gpuipc_buffer_export(buf, desc, sizeof desc, &dlen, fds, &nfds));
  gpuipc__w_buf w = {0, 0, 0, bi.size, 0, UINT32_MAX, GPUIPC__BUF_DESC, 0};
  uint32_t slot;
  uint64_t seq;
  gpuipc_status s = send_core(conn, h, stream, &w, desc, (uint32_t)dlen, fds,
                              nfds, meta, meta_len, deadline, &slot, &seq);
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  if (s != GPUIPC_OK)
    return s;
  gpuipc__lease_add(h->lt, slot, NULL, buf, seq,
                    conn->order == GPUIPC_ORDER_MEMOP,
                    conn->order == GPUIPC_ORDER_EVENT);
  return GPUIPC_OK;
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
      s = wait_stream(h, 0, stream, &wst);
      if (s != GPUIPC_OK)
        continue;
      CUresult r = GPUIPC__CU(
          cuStreamWaitValue64, wst,
          (CUdeviceptr)gpuipc__released_word(lt->ctl->ptr, lt->nslots,
                                             recs[i].slot),
          (cuuint64_t)recs[i].seq, CU_STREAM_WAIT_VALUE_GEQ);
      if (r == CUDA_SUCCESS)
        r = wait_done(h, 0, stream);
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

/* ---- receiver: frames ---------------------------------------------------------------- */

static gpuipc__imp *imp_find(struct gpuipc__ho *h, uint64_t arena_id,
                             uint32_t chunk) {
  for (int i = 0; i < h->nimp; i++)
    if (h->imp[i].arena_id == arena_id && h->imp[i].chunk == chunk)
      return &h->imp[i];
  return NULL;
}

static gpuipc_status on_chunk(gpuipc_conn *c, struct gpuipc__ho *h,
                              const unsigned char *p, size_t len, int *fds,
                              int nfds) {
  gpuipc_status s = GPUIPC_OK;
  gpuipc__w_chunk w;
  if (len < sizeof w) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "CHUNK frame of %zu bytes", len);
    goto out;
  }
  memcpy(&w, p, sizeof w);
  if (w.desc_len != len - sizeof w || w.desc_len > GPUIPC_DESC_MAX ||
      w.chunk >= GPUIPC__ARENA_MAX_CHUNKS) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "bad CHUNK frame");
    goto out;
  }
  if (imp_find(h, w.arena_id, w.chunk)) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "chunk %u of arena %llu sent twice",
                     w.chunk, (unsigned long long)w.arena_id);
    goto out;
  }
  if (h->nimp == h->cimp) {
    int cap = h->cimp ? 2 * h->cimp : 4;
    gpuipc__imp *n = realloc(h->imp, sizeof *n * (size_t)cap);
    if (n == NULL) {
      s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "imports");
      goto out;
    }
    h->imp = n;
    h->cimp = cap;
  }
  /* The one driver import of this memory on this connection (the handle
   * layer's cache makes a second connection to the same exporter free). */
  gpuipc_buffer *buf = NULL;
  s = gpuipc__buffer_import_via(&c->via, p + sizeof w, w.desc_len, fds, nfds,
                                NULL, &buf);
  if (s != GPUIPC_OK)
    goto out;
  gpuipc__buffer_info bi;
  s = gpuipc__buffer_info_get(buf, &bi);
  if (s != GPUIPC_OK || bi.size < w.size) {
    gpuipc_buffer_close(buf);
    if (s == GPUIPC_OK)
      s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                       "chunk declares %llu bytes, the import maps %zu",
                       (unsigned long long)w.size, bi.size);
    goto out;
  }
  gpuipc__imp *im = &h->imp[h->nimp++];
  im->arena_id = w.arena_id;
  im->chunk = w.chunk;
  im->buf = buf;
  im->base = bi.ptr;
  im->size = w.size;
  im->ordinal = bi.map_ordinal;
  GPUIPC__DEBUG("handoff", "imported chunk %u of arena %llu of pid %d (%zu "
                           "bytes)",
                w.chunk, (unsigned long long)w.arena_id, c->peer_pid,
                im->size);
out:
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return s;
}

static gpuipc_status on_ctl(gpuipc_conn *c, struct gpuipc__ho *h,
                            const unsigned char *p, size_t len) {
  gpuipc__w_ctl w;
  if (len != sizeof w || h->have_peer_ctl)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "bad or repeated CTL frame");
  memcpy(&w, p, sizeof w);
  gpuipc__imp *im = imp_find(h, w.arena_id, w.chunk);
  if (im == NULL || w.nslots == 0 || w.nslots > 65536 ||
      w.off > im->size || 16u * (uint64_t)w.nslots > im->size - w.off ||
      w.off % 8)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "CTL frame names flag words outside the peer's "
                        "imported memory");
  h->rx = calloc(w.nslots, sizeof *h->rx);
  h->q = calloc(w.nslots, sizeof *h->q);
  if (h->rx == NULL || h->q == NULL) {
    free(h->rx);
    free(h->q);
    h->rx = NULL;
    h->q = NULL;
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "receive slots");
  }
  h->peer_ctl = im->base + w.off;
  h->peer_nslots = w.nslots;
  h->peer_ordinal = im->ordinal;
  h->have_peer_ctl = true;
  if (c->watch) {
    atomic_store(&c->watch->rx_ordinal, h->peer_ordinal);
    atomic_store(&c->watch->rx_nslots, h->peer_nslots);
    atomic_store_explicit(&c->watch->rx_base, h->peer_ctl, memory_order_release);
  }
  return GPUIPC_OK;
}

/* Checks one arena-block entry of a BUF or BUFS frame against the state
 * (what: the frame's name, for the message); *im_out: its chunk. */
static gpuipc_status buf_check(struct gpuipc__ho *h, const gpuipc__w_buf *w,
                               const char *what, gpuipc__imp **im_out) {
  if (w->slot >= h->peer_nslots || h->rx[w->slot].held ||
      w->seq == 0 || w->seq >= GPUIPC__SEQ_LIMIT ||
      w->seq <= h->rx[w->slot].last_recv || w->seq <= h->rx[w->slot].last_rel)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "%s frame: slot %u (of %u) busy or sequence %llu "
                        "not new or past the limit",
                        what, w->slot, h->peer_nslots,
                        (unsigned long long)w->seq);
  gpuipc__imp *im = imp_find(h, w->arena_id, w->chunk);
  if (im == NULL)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "%s frame names chunk %u of arena %llu, never sent",
                        what, w->chunk, (unsigned long long)w->arena_id);
  if (w->len == 0 || w->off > im->size || w->len > im->size - w->off)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "%s frame: [%llu, +%llu) outside the chunk of %zu "
                        "bytes",
                        what, (unsigned long long)w->off,
                        (unsigned long long)w->len, im->size);
  if ((w->flags & GPUIPC__BUF_DONE) &&
      (w->flags & (GPUIPC__BUF_ORDERED | GPUIPC__BUF_EVENT)) !=
          GPUIPC__BUF_ORDERED)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "%s frame: flags 0x%x refused (DONE only with "
                        "ORDERED)",
                        what, w->flags);
  if ((w->flags & GPUIPC__BUF_EVENT) && h->rx[w->slot].ready_ev == NULL)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "%s frame ordered by an event never sent (slot %u)",
                        what, w->slot);
  *im_out = im;
  return GPUIPC_OK;
}

/* Queues a checked arena-block entry, ordered by the ready word of slot
 * rslot (or, rslot UINT32_MAX, the word at raddr) at value rseq. */
static void buf_queue(gpuipc_conn *c, struct gpuipc__ho *h,
                      const gpuipc__w_buf *w, const gpuipc__imp *im,
                      const unsigned char *meta, uint32_t rslot,
                      uint64_t raddr, uint64_t rseq) {
  /* The slot is taken from now on (queued counts as held). */
  gpuipc__rxs *r = &h->rx[w->slot];
  r->held = w->seq;
  r->ptr = im->base + w->off;
  r->len = (size_t)w->len;
  r->ordered = (w->flags & GPUIPC__BUF_ORDERED) != 0;
  r->by_event = (w->flags & GPUIPC__BUF_EVENT) != 0;
  if (w->seq > h->rx_max_seq)
    h->rx_max_seq = w->seq;
  if (c->watch)
    atomic_store(&c->watch->rx_max, h->rx_max_seq);
  gpuipc__qbuf *q = &h->q[(h->qhead + h->qlen) % h->peer_nslots];
  q->w = *w;
  q->rslot = rslot;
  q->raddr = rslot == UINT32_MAX ? raddr : gpuipc__ready_word(h->peer_ctl, rslot);
  q->rseq = rseq;
  q->nowait = (w->flags & GPUIPC__BUF_DONE) != 0;
  memcpy(q->meta, meta, w->meta_len);
  h->qlen++;
}

static gpuipc_status on_buf(gpuipc_conn *c, struct gpuipc__ho *h,
                            const unsigned char *p, size_t len) {
  gpuipc__w_buf w;
  if (len < sizeof w)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUF frame of %zu bytes", len);
  memcpy(&w, p, sizeof w);
  if (!h->have_peer_ctl)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUF frame before CTL");
  if (w.meta_len > GPUIPC_META_MAX || w.meta_len != len - sizeof w)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUF frame: metadata of %u bytes",
                        w.meta_len);
  gpuipc__imp *im = NULL;
  GPUIPC__CHECK(buf_check(h, &w, "BUF", &im));
  if (h->qlen == h->peer_nslots)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "more buffers than slots");
  buf_queue(c, h, &w, im, p + sizeof w, w.slot, 0, w.seq);
  return GPUIPC_OK;
}

/* BUFW: one arena block ordered by one of the peer's broadcast words. */
static gpuipc_status on_bufw(gpuipc_conn *c, struct gpuipc__ho *h,
                             const unsigned char *p, size_t len) {
  gpuipc__w_buf w;
  gpuipc__w_word ww;
  if (len < sizeof w + sizeof ww)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFW frame of %zu bytes", len);
  memcpy(&w, p, sizeof w);
  memcpy(&ww, p + sizeof w, sizeof ww);
  if (!h->have_peer_ctl)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFW frame before CTL");
  if (w.meta_len > GPUIPC_META_MAX ||
      w.meta_len != len - sizeof w - sizeof ww)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFW frame: metadata of %u bytes",
                        w.meta_len);
  if (w.flags != GPUIPC__BUF_ORDERED)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "BUFW frame: flags 0x%x refused (ORDERED only)",
                        w.flags);
  gpuipc__imp *im = NULL;
  GPUIPC__CHECK(buf_check(h, &w, "BUFW", &im));
  if (h->qlen == h->peer_nslots)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "more buffers than slots");
  gpuipc__imp *wim = imp_find(h, ww.arena_id, ww.chunk);
  if (wim == NULL || ww.pad != 0 || ww.off % 8 || wim->size < 8 ||
      ww.off > wim->size - 8 || ww.value == 0 ||
      ww.value >= GPUIPC__SEQ_LIMIT)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "BUFW frame: ready word at %llu of chunk %u of arena "
                        "%llu (value %llu) outside the peer's imported "
                        "memory, misaligned, or past the limit",
                        (unsigned long long)ww.off, ww.chunk,
                        (unsigned long long)ww.arena_id,
                        (unsigned long long)ww.value);
  uint64_t addr = wim->base + ww.off;
  /* Not one of this connection's flag words: close writes those itself
   * (unblock_ready), and a lower value written there would hold our own
   * waits on the broadcast word. */
  if (addr + 8 > h->peer_ctl &&
      addr < h->peer_ctl + 16u * (uint64_t)h->peer_nslots)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "BUFW frame: its ready word is one of the "
                        "connection's flag words");
  int k = 0;
  while (k < h->nbw && h->bw[k].addr != addr)
    k++;
  if (k == h->nbw) {
    if (h->nbw == GPUIPC__BWORDS_MAX)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "BUFW frame: more than %d broadcast words",
                          GPUIPC__BWORDS_MAX);
    h->bw[h->nbw].addr = addr;
    h->bw[h->nbw].max = 0;
    h->bw[h->nbw].waited = 0;
    h->nbw++;
  }
  if (ww.value > h->bw[k].max)
    h->bw[k].max = ww.value;
  if (c->watch) {
    atomic_store(&c->watch->bw_max[k], h->bw[k].max);
    atomic_store_explicit(&c->watch->bw_addr[k], addr, memory_order_release);
  }
  buf_queue(c, h, &w, im, p + sizeof w + sizeof ww, UINT32_MAX, addr,
            ww.value);
  return GPUIPC_OK;
}

/* BUFS: a batch of arena blocks, applied whole or refused whole. */
static gpuipc_status on_bufs(gpuipc_conn *c, struct gpuipc__ho *h,
                             const unsigned char *p, size_t len) {
  gpuipc__w_bufs b;
  if (len < sizeof b)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFS frame of %zu bytes", len);
  memcpy(&b, p, sizeof b);
  if (!h->have_peer_ctl)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFS frame before CTL");
  if (b.count == 0 || b.count > GPUIPC_BATCH_MAX || b.flags != 0 ||
      b.pad != 0 || b.ready != b.count - 1 ||
      (uint64_t)b.count * sizeof(gpuipc__w_buf) > len - sizeof b)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "BUFS frame: %u entries (ready entry %u) in %zu bytes",
                        b.count, b.ready, len);
  if (b.count > h->peer_nslots - h->qlen)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "BUFS frame: %u buffers, %u slots not queued",
                        b.count, h->peer_nslots - h->qlen);
  const unsigned char *ents = p + sizeof b;
  size_t meta_total = 0;
  gpuipc_status s = GPUIPC_OK;
  uint32_t marked = 0;
  uint64_t prev_seq = 0;
  /* Check every entry before any is queued; a slot named twice is found
   * by marking each slot held while checking (undone below). */
  for (; marked < b.count; marked++) {
    gpuipc__w_buf w;
    memcpy(&w, ents + (size_t)marked * sizeof w, sizeof w);
    gpuipc__imp *im = NULL;
    if (w.meta_len > GPUIPC_META_MAX || (w.flags & GPUIPC__BUF_DESC) ||
        (w.flags &
         ~(GPUIPC__BUF_ORDERED | GPUIPC__BUF_EVENT | GPUIPC__BUF_DONE)) ||
        w.seq <= prev_seq) {
      s = gpuipc__fail(GPUIPC_E_PROTOCOL,
                       "BUFS frame: entry %u (flags 0x%x, metadata of %u "
                       "bytes, sequence %llu) refused",
                       marked, w.flags, w.meta_len, (unsigned long long)w.seq);
      break;
    }
    s = buf_check(h, &w, "BUFS", &im);
    if (s != GPUIPC_OK)
      break;
    prev_seq = w.seq;
    meta_total += w.meta_len;
    h->rx[w.slot].held = w.seq;
  }
  for (uint32_t i = 0; i < marked; i++) {
    gpuipc__w_buf w;
    memcpy(&w, ents + (size_t)i * sizeof w, sizeof w);
    h->rx[w.slot].held = 0;
  }
  if (s != GPUIPC_OK)
    return s;
  size_t fixed = sizeof b + (size_t)b.count * sizeof(gpuipc__w_buf);
  if (meta_total != len - fixed)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "BUFS frame: %zu bytes of metadata declared, %zu sent",
                        meta_total, len - fixed);
  gpuipc__w_buf last;
  memcpy(&last, ents + (size_t)b.ready * sizeof last, sizeof last);
  const unsigned char *meta = p + fixed;
  for (uint32_t i = 0; i < b.count; i++) {
    gpuipc__w_buf w;
    memcpy(&w, ents + (size_t)i * sizeof w, sizeof w);
    gpuipc__imp *im = imp_find(h, w.arena_id, w.chunk);
    buf_queue(c, h, &w, im, meta, last.slot, 0, last.seq);
    meta += w.meta_len;
  }
  return GPUIPC_OK;
}

static gpuipc_status on_bufd(gpuipc_conn *c, struct gpuipc__ho *h,
                             const unsigned char *p, size_t len, int *fds,
                             int nfds) {
  gpuipc_status s = GPUIPC_OK;
  gpuipc_buffer *imp = NULL;
  gpuipc__w_buf w;
  uint32_t dl[2];
  if (len < sizeof w + sizeof dl) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFD frame of %zu bytes", len);
    goto out;
  }
  memcpy(&w, p, sizeof w);
  memcpy(dl, p + sizeof w, sizeof dl);
  if (!h->have_peer_ctl) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFD frame before CTL");
    goto out;
  }
  if (dl[0] > GPUIPC_DESC_MAX || dl[1] != 0 || w.meta_len > GPUIPC_META_MAX ||
      (size_t)dl[0] + w.meta_len != len - sizeof w - sizeof dl ||
      !(w.flags & GPUIPC__BUF_DESC)) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFD frame: inconsistent lengths");
    goto out;
  }
  if (w.slot >= h->peer_nslots || h->rx[w.slot].held ||
      w.seq >= GPUIPC__SEQ_LIMIT || w.seq <= h->rx[w.slot].last_recv ||
      w.seq <= h->rx[w.slot].last_rel || h->qlen == h->peer_nslots) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "BUFD frame: slot %u busy or "
                                        "sequence %llu not new or past "
                                        "the limit",
                     w.slot, (unsigned long long)w.seq);
    goto out;
  }
  /* Descriptors are hostile input: the handle layer validates them (and
   * goes through its import cache: a buffer seen before costs no driver
   * call). A descriptor that does not import is the peer's error. */
  s = gpuipc__buffer_import_via(&c->via, p + sizeof w + sizeof dl, dl[0], fds,
                                nfds, NULL, &imp);
  if (s != GPUIPC_OK)
    goto out;
  if (gpuipc_buffer_get_size(imp) < w.len || w.len == 0) {
    s = gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                     "BUFD frame: %llu bytes of a buffer of %zu",
                     (unsigned long long)w.len, gpuipc_buffer_get_size(imp));
    gpuipc_buffer_close(imp);
    goto out;
  }
  gpuipc__buffer_info bi;
  s = gpuipc__buffer_info_get(imp, &bi);
  if (s != GPUIPC_OK) {
    gpuipc_buffer_close(imp);
    goto out;
  }
  gpuipc__rxs *r = &h->rx[w.slot];
  r->held = w.seq;
  r->ptr = bi.ptr;
  r->len = (size_t)w.len;
  r->ordered = (w.flags & GPUIPC__BUF_ORDERED) != 0;
  r->by_event = (w.flags & GPUIPC__BUF_EVENT) != 0;
  if (r->by_event && r->ready_ev == NULL) {
    r->held = 0;
    gpuipc_buffer_close(imp);
    s = gpuipc__fail(GPUIPC_E_PROTOCOL,
                     "BUFD frame ordered by an event never sent (slot %u)",
                     w.slot);
    goto out;
  }
  r->imp = imp;
  if (w.seq > h->rx_max_seq)
    h->rx_max_seq = w.seq;
  if (c->watch)
    atomic_store(&c->watch->rx_max, h->rx_max_seq);
  gpuipc__qbuf *q = &h->q[(h->qhead + h->qlen) % h->peer_nslots];
  q->w = w;
  q->rslot = w.slot;
  q->raddr = gpuipc__ready_word(h->peer_ctl, w.slot);
  q->rseq = w.seq;
  q->nowait = false;
  memcpy(q->meta, p + sizeof w + sizeof dl + dl[0], w.meta_len);
  h->qlen++;
out:
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  return s;
}

static gpuipc_status on_evd(struct gpuipc__ho *h, const unsigned char *p,
                            size_t len) {
  gpuipc__w_evd w;
  if (len < sizeof w)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "EVD frame of %zu bytes", len);
  memcpy(&w, p, sizeof w);
  if (w.len != len - sizeof w || w.len > GPUIPC_DESC_MAX || w.pad != 0 ||
      w.which > 1)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "bad EVD frame");
  bool ours = w.which == 1;
  bool wanted = ours ? h->lt && gpuipc__lease_wants_release_event(h->lt, w.slot)
                     : h->have_peer_ctl && w.slot < h->peer_nslots &&
                           h->rx[w.slot].ready_ev == NULL;
  if (!wanted)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "EVD frame for slot %u: unknown or sent twice",
                        w.slot);
  gpuipc_event *ev = NULL;
  GPUIPC__CHECK(gpuipc_event_import(p + sizeof w, w.len, NULL, &ev));
  if (ours)
    gpuipc__lease_set_release_event(h->lt, w.slot, ev);
  else
    h->rx[w.slot].ready_ev = ev;
  return GPUIPC_OK;
}

/* Closes imports whose release's GPU work completed (all when `all`, after
 * the caller synchronized). */
static void poll_closing(struct gpuipc__ho *h, bool all) {
  size_t k = 0;
  for (size_t i = 0; i < h->nclosing; i++) {
    gpuipc__closing *x = &h->closing[i];
    if (all || GPUIPC__CU(cuEventQuery, (CUevent)x->ev) == CUDA_SUCCESS) {
      gpuipc_buffer_close(x->imp);
      GPUIPC__CU(cuEventDestroy, (CUevent)x->ev);
    } else {
      h->closing[k++] = *x;
    }
  }
  h->nclosing = k;
}

static gpuipc_status ho_frame(gpuipc_conn *c, int type, const unsigned char *p,
                              size_t len, int *fds, int nfds) {
  struct gpuipc__ho *h = NULL;
  gpuipc_status s = ho_get(c, &h);
  if (s != GPUIPC_OK ||
      (type != GPUIPC__F_CHUNK && type != GPUIPC__F_BUFD && nfds > 0)) {
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    return s != GPUIPC_OK ? s
                          : gpuipc__fail(GPUIPC_E_PROTOCOL,
                                         "frame type %d with descriptors",
                                         type);
  }
  switch (type) {
  case GPUIPC__F_CHUNK:
    return on_chunk(c, h, p, len, fds, nfds);
  case GPUIPC__F_CTL:
    return on_ctl(c, h, p, len);
  case GPUIPC__F_BUF:
    return on_buf(c, h, p, len);
  case GPUIPC__F_BUFD:
    return on_bufd(c, h, p, len, fds, nfds);
  case GPUIPC__F_BUFS:
    return on_bufs(c, h, p, len);
  case GPUIPC__F_BUFW:
    return on_bufw(c, h, p, len);
  case GPUIPC__F_EVD:
    return on_evd(h, p, len);
  case GPUIPC__F_REL:
    if (len == 0 || len % sizeof(gpuipc__w_rel) || h->lt == NULL)
      return gpuipc__fail(GPUIPC_E_PROTOCOL, "bad REL frame of %zu bytes", len);
    {
      gpuipc__w_rel rel[GPUIPC__REL_MAX];
      size_t n = len / sizeof rel[0];
      if (n > GPUIPC__ARRAY_SIZE(rel))
        return gpuipc__fail(GPUIPC_E_PROTOCOL, "REL frame of %zu entries", n);
      memcpy(rel, p, len);
      return gpuipc__lease_released(h->lt, rel, n);
    }
  case GPUIPC__F_BYE:
    c->peer_said_bye = 1;
    return GPUIPC_OK;
  case GPUIPC__F_ABANDON:
    if (len % sizeof(gpuipc__w_rel) || len / sizeof(gpuipc__w_rel) > 4096)
      return gpuipc__fail(GPUIPC_E_PROTOCOL, "bad ABANDON frame of %zu bytes",
                          len);
    if (h->lt == NULL)
      return GPUIPC_OK; /* we never sent anything */
    {
      size_t n = len / sizeof(gpuipc__w_rel);
      gpuipc__w_rel *held = n ? malloc(len) : NULL;
      if (n && held == NULL)
        return gpuipc__fail(GPUIPC_E_NO_MEMORY, "ABANDON frame");
      if (n)
        memcpy(held, p, len);
      gpuipc_status as = gpuipc__lease_abandoned(h->lt, held, n);
      free(held);
      return as;
    }
  default:
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "unexpected frame type %d", type);
  }
}

/* ---- receiver: recv / release ---------------------------------------------------------- */

static bool have_buf(gpuipc_conn *c, void *arg) {
  (void)arg;
  return c->ho && c->ho->qlen > 0 && c->state == GPUIPC__CONN_OPEN;
}

static uint64_t make_id(uint32_t slot, uint64_t seq) {
  return ((uint64_t)slot << 44) | (seq & (((uint64_t)1 << 44) - 1));
}

/* Enqueues on `stream` the wait of the ordered buffers q[0..n) (entries
 * of the receive queue, from its head, in order): one wait per distinct
 * ready word and value (a batch shares one). Context of the peer's device
 * entered here. */
static gpuipc_status ready_waits(gpuipc_conn *conn, struct gpuipc__ho *h,
                                 uint32_t n, struct CUstream_st *stream) {
  bool any = false;
  for (uint32_t i = 0; i < n && !any; i++) {
    const gpuipc__qbuf *q = &h->q[(h->qhead + i) % h->peer_nslots];
    any = h->rx[q->w.slot].ordered && !q->nowait;
  }
  if (!any)
    return GPUIPC_OK;
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, h->peer_ordinal));
  /* The consumer's stream waits, on the GPU, for the producer's work. */
  CUstream wst = NULL;
  gpuipc_status ss = wait_stream(h, 1, stream, &wst);
  if (ss != GPUIPC_OK) {
    gpuipc__ctx_leave(&g);
    return ss;
  }
  CUresult cr = CUDA_SUCCESS;
  uint64_t waddr = 0;
  uint64_t wseq = 0;
  const gpuipc__qbuf *bad = NULL;
  for (uint32_t i = 0; i < n && cr == CUDA_SUCCESS; i++) {
    const gpuipc__qbuf *q = &h->q[(h->qhead + i) % h->peer_nslots];
    if (!h->rx[q->w.slot].ordered || q->nowait ||
        (q->raddr == waddr && q->rseq == wseq))
      continue;
    cr = GPUIPC__CU(cuStreamWaitValue64, wst, (CUdeviceptr)q->raddr,
                    (cuuint64_t)q->rseq, CU_STREAM_WAIT_VALUE_GEQ);
    waddr = q->raddr;
    wseq = q->rseq;
    bad = q;
  }
  if (cr == CUDA_SUCCESS)
    cr = wait_done(h, 1, stream);
  gpuipc__ctx_leave(&g);
  /* What close must see written before it unmaps a broadcast word's
   * memory: the values our streams wait for. */
  for (uint32_t i = 0; i < n && cr == CUDA_SUCCESS; i++) {
    const gpuipc__qbuf *q = &h->q[(h->qhead + i) % h->peer_nslots];
    if (q->rslot != UINT32_MAX || q->nowait || !h->rx[q->w.slot].ordered)
      continue;
    for (int k = 0; k < h->nbw; k++)
      if (h->bw[k].addr == q->raddr && h->bw[k].waited < q->rseq)
        h->bw[k].waited = q->rseq;
  }
  if (cr != CUDA_SUCCESS)
    return gpuipc__fail_cuda(cr, "cuStreamWaitValue64",
                             "ready flag of buffer %llu from pid %d",
                             (unsigned long long)(bad ? bad->w.seq : 0),
                             conn->peer_pid);
  return GPUIPC_OK;
}

/* Receives the n buffers at the head of the queue into out[0..n). */
static gpuipc_status recv_head(gpuipc_conn *conn, struct gpuipc__ho *h,
                               uint32_t n, struct CUstream_st *stream,
                               gpuipc_received *out) {
  for (uint32_t i = 0; i < n; i++) {
    const gpuipc__qbuf *q = &h->q[(h->qhead + i) % h->peer_nslots];
    gpuipc__rxs *r = &h->rx[q->w.slot];
    if (r->by_event) /* captures the producer's record made before its send */
      GPUIPC__CHECK(gpuipc_event_wait(r->ready_ev, stream));
  }
  GPUIPC__CHECK(ready_waits(conn, h, n, stream));
  for (uint32_t i = 0; i < n; i++) {
    gpuipc__qbuf *q = &h->q[h->qhead];
    gpuipc__rxs *r = &h->rx[q->w.slot];
    if (r->by_event || r->ordered)
      r->last_recv = q->w.seq;
    /* A wait that reads the peer's flag words was queued on stream (one
     * per batch: each buffer of it counts as waited there). */
    r->waited = r->ordered && !q->nowait;
    r->recv_stream = stream;
    if (r->ordered && q->rslot != UINT32_MAX &&
        h->rx[q->rslot].last_recv < q->rseq)
      /* The batch's ready word was waited for: unblock_ready writes it
       * should the producer die before writing it. */
      h->rx[q->rslot].last_recv = q->rseq;
    gpuipc_received *o = &out[i];
    o->id = make_id(q->w.slot, q->w.seq);
    o->ptr = (void *)(uintptr_t)r->ptr;
    o->length = r->len;
    o->device = h->peer_ordinal;
    o->meta_len = q->w.meta_len;
    memcpy(o->meta, q->meta, q->w.meta_len);
    h->qhead = (h->qhead + 1) % h->peer_nslots;
    h->qlen--;
    h->rx_held++;
  }
  gpuipc__stats_conn_held_here(conn->stats_slot, (int)n);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_recv(gpuipc_conn *conn, struct CUstream_st *stream,
                               gpuipc_received *out) {
  if (conn == NULL || out == NULL || out->size < sizeof *out)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_recv: NULL argument, or out->size not set "
                        "(use GPUIPC_RECEIVED_INIT)");
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  if (!have_buf(conn, NULL)) {
    GPUIPC__CHECK(
        gpuipc__conn_pump(conn, gpuipc__conn_deadline(conn), have_buf, NULL));
  }
  return recv_head(conn, conn->ho, 1, stream, out);
}

gpuipc_status gpuipc_conn_recv_batch(gpuipc_conn *conn,
                                     struct CUstream_st *stream,
                                     gpuipc_received *out, size_t max,
                                     size_t *n) {
  if (n)
    *n = 0;
  if (conn == NULL || out == NULL || n == NULL || max == 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_recv_batch: NULL argument or max 0");
  for (size_t i = 0; i < max; i++)
    if (out[i].size < sizeof out[i])
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_recv_batch: out[%zu].size not set "
                          "(use GPUIPC_RECEIVED_INIT)",
                          i);
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  if (!have_buf(conn, NULL)) {
    GPUIPC__CHECK(
        gpuipc__conn_pump(conn, gpuipc__conn_deadline(conn), have_buf, NULL));
  }
  struct gpuipc__ho *h = conn->ho;
  uint32_t k = h->qlen < max ? h->qlen : (uint32_t)max;
  GPUIPC__CHECK(recv_head(conn, h, k, stream, out));
  *n = k;
  return GPUIPC_OK;
}

/* Orders ws after the work queued so far on the stream slot r was received
 * on (its wait for the producer reads the peer's flag words). Context
 * current. */
static CUresult join_recv_stream(gpuipc__rxs *r, CUstream ws) {
  CUresult cr = CUDA_SUCCESS;
  if (r->join_ev == NULL) {
    CUevent ev;
    cr = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
    if (cr == CUDA_SUCCESS)
      r->join_ev = (struct CUevent_st *)ev;
  }
  if (cr == CUDA_SUCCESS)
    cr = GPUIPC__CU(cuEventRecord, (CUevent)r->join_ev,
                    (CUstream)r->recv_stream);
  if (cr == CUDA_SUCCESS)
    cr = GPUIPC__CU(cuStreamWaitEvent, ws, (CUevent)r->join_ev, 0);
  return cr;
}

/* Records r->rel_done on ws after a release there: what close waits for
 * before it unmaps (rx_unknown when it cannot be recorded). Context
 * current. */
static void record_rel_done(struct gpuipc__ho *h, gpuipc__rxs *r, CUstream ws) {
  CUresult er = CUDA_SUCCESS;
  if (r->rel_done == NULL) {
    CUevent ev;
    er = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
    if (er == CUDA_SUCCESS)
      r->rel_done = (struct CUevent_st *)ev;
  }
  if (er == CUDA_SUCCESS)
    er = GPUIPC__CU(cuEventRecord, (CUevent)r->rel_done, ws);
  if (er != CUDA_SUCCESS)
    h->rx_unknown = true;
}

/* Writes the release flag of a held slot on stream (ordered mode) and
 * forgets the lease locally. */
static gpuipc_status release_slot(gpuipc_conn *conn, struct gpuipc__ho *h,
                                  uint32_t slot, struct CUstream_st *stream,
                                  bool write_flag) {
  gpuipc__rxs *r = &h->rx[slot];
  if (write_flag && r->by_event) {
    if (r->rel_ev == NULL)
      GPUIPC__CHECK(make_event(conn, h->peer_ordinal, slot, 1,
                               gpuipc__conn_deadline(conn), &r->rel_ev));
    GPUIPC__CHECK(gpuipc_event_record(r->rel_ev, stream));
  }
  if (r->ordered && (write_flag || r->waited)) {
    gpuipc__ctx_guard g;
    GPUIPC__CHECK(gpuipc__ctx_enter(&g, h->peer_ordinal));
    CUdeviceptr word = (CUdeviceptr)gpuipc__released_word(
        h->peer_ctl, h->peer_nslots, slot);
    CUstream ws = NULL;
    gpuipc_status ss = write_stream(h, 1, stream, &ws);
    if (ss != GPUIPC_OK) {
      gpuipc__ctx_leave(&g);
      return ss;
    }
    CUresult cr = CUDA_SUCCESS;
    if (r->waited && stream != r->recv_stream) {
      /* Released on another stream than it was received on: the release
       * (and close's unmapping, which waits for rel_done) comes after our
       * wait on the recv stream, which reads the peer's flag words. */
      cr = join_recv_stream(r, ws);
      if (cr != CUDA_SUCCESS) {
        gpuipc__ctx_leave(&g);
        if (write_flag)
          return gpuipc__fail_cuda(cr, "cuEventRecord/cuStreamWaitEvent",
                                   "ordering the release of buffer %llu "
                                   "after the stream it was received on "
                                   "(destroyed already?)",
                                   (unsigned long long)r->held);
        h->rx_unknown = true; /* close cannot tell when the wait ran */
        goto forget;
      }
    }
    if (write_flag && cr == CUDA_SUCCESS && r->rel_wval != 0 &&
        r->last_rel_stream != (struct CUstream_st *)ws)
      cr = GPUIPC__CU(cuStreamWaitValue64, ws,
                      (CUdeviceptr)gpuipc__released_word(
                          h->peer_ctl, h->peer_nslots, r->rel_wslot),
                      (cuuint64_t)r->rel_wval, CU_STREAM_WAIT_VALUE_GEQ);
    if (write_flag && cr == CUDA_SUCCESS)
      cr = GPUIPC__CU(cuStreamWriteValue64, ws, word,
                      (cuuint64_t)r->held, 0);
    if (write_flag && cr == CUDA_SUCCESS) {
      r->rel_wslot = slot;
      r->rel_wval = r->held;
    }
    if (cr == CUDA_SUCCESS) {
      /* What close waits for before it unmaps: the work queued on ws up
       * to this release, our wait on the recv stream included (a later
       * release of the slot, on any stream, is ordered after this one, so
       * the newest record covers all). */
      record_rel_done(h, r, ws);
    }
    gpuipc__ctx_leave(&g);
    if (cr != CUDA_SUCCESS)
      return gpuipc__fail_cuda(cr, "cuStreamWriteValue64",
                               "release flag of buffer %llu",
                               (unsigned long long)r->held);
    if (write_flag)
      r->last_rel_stream = (struct CUstream_st *)ws;
  }
forget:
  r->waited = false;
  if (r->imp) {
    /* The import is closed once the work queued before this release is
     * done (an event on that stream); closing it now could unmap memory a
     * queued kernel still reads. */
    gpuipc_status cs = GPUIPC_OK;
    gpuipc__ctx_guard g;
    CUevent ev = NULL;
    if (h->nclosing == h->capclosing) {
      size_t cap = h->capclosing ? 2 * h->capclosing : 8;
      gpuipc__closing *n = realloc(h->closing, sizeof *n * cap);
      if (n == NULL)
        return gpuipc__fail(GPUIPC_E_NO_MEMORY, "closing list");
      h->closing = n;
      h->capclosing = cap;
    }
    cs = gpuipc__ctx_enter(&g, h->peer_ordinal);
    if (cs == GPUIPC_OK) {
      CUresult cr = GPUIPC__CU(cuEventCreate, &ev, CU_EVENT_DISABLE_TIMING);
      if (cr == CUDA_SUCCESS)
        cr = GPUIPC__CU(cuEventRecord, ev, (CUstream)stream);
      if (cr != CUDA_SUCCESS) {
        if (ev)
          GPUIPC__CU(cuEventDestroy, ev);
        ev = NULL;
        cs = gpuipc__fail_cuda(cr, "cuEventRecord", "release of an import");
      }
      gpuipc__ctx_leave(&g);
    }
    if (ev == NULL)
      return cs;
    h->closing[h->nclosing++] = (gpuipc__closing){r->imp, (struct CUevent_st *)ev};
    r->imp = NULL;
    poll_closing(h, false);
  }
  r->last_rel = r->held;
  r->held = 0;
  h->rx_held--;
  gpuipc__stats_conn_held_here(conn->stats_slot, -1);
  return GPUIPC_OK;
}

/* The slot of a buffer id the caller holds (received, not released). */
static gpuipc_status held_slot(const struct gpuipc__ho *h, uint64_t id,
                               const char *fn, uint32_t *slot_out) {
  uint32_t slot = (uint32_t)(id >> 44);
  uint64_t seq_lo = id & (((uint64_t)1 << 44) - 1);
  if (h == NULL || h->rx == NULL || slot >= h->peer_nslots ||
      h->rx[slot].held == 0 ||
      (h->rx[slot].held & (((uint64_t)1 << 44) - 1)) != seq_lo)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                        "%s: buffer id 0x%llx is not held on this connection",
                        fn, (unsigned long long)id);
  *slot_out = slot;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_release(gpuipc_conn *conn, uint64_t id,
                                  struct CUstream_st *stream) {
  if (conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_release: NULL");
  struct gpuipc__ho *h = conn->ho;
  uint32_t slot;
  GPUIPC__CHECK(held_slot(h, id, "gpuipc_conn_release", &slot));
  /* Still queued (received by the library, not by the caller)? */
  for (uint32_t i = 0; i < h->qlen; i++)
    if (h->q[(h->qhead + i) % h->peer_nslots].w.slot == slot)
      return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                          "gpuipc_conn_release: buffer id 0x%llx was not "
                          "received yet",
                          (unsigned long long)id);
  if (conn->state != GPUIPC__CONN_OPEN) {
    /* The exporter is gone: nobody waits for the release any more. */
    return release_slot(conn, h, slot, stream, false);
  }
  gpuipc__w_rel rel = {h->rx[slot].held, slot, 0};
  GPUIPC__CHECK(release_slot(conn, h, slot, stream, true));
  gpuipc_status s = gpuipc__conn_send_frame(conn, GPUIPC__F_REL, &rel,
                                            sizeof rel, NULL, 0, NULL, 0, 0);
  if (s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED)
    return GPUIPC_OK; /* the lease ended with the exporter */
  return s;
}

/* The release of the ordered slots[0..n) (held, received) with ONE word
 * write: that of the last of them, on one stream, after the work queued
 * on `stream`; the others are announced as signalled by it
 * (GPUIPC__REL_BY_NEXT). Before it, for a slot whose previous release was
 * written on another stream, a wait for that release's word (so no word
 * goes backwards). One completion record for close, on the last slot (a
 * later release of any of these slots on another stream waits for this
 * write first). Context of the peer's device entered here. */
static gpuipc_status release_words(struct gpuipc__ho *h, const uint32_t *slots,
                                   size_t n, struct CUstream_st *stream) {
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, h->peer_ordinal));
  CUstream ws = NULL;
  gpuipc_status ss = write_stream(h, 1, stream, &ws);
  if (ss != GPUIPC_OK) {
    gpuipc__ctx_leave(&g);
    return ss;
  }
  CUresult cr = CUDA_SUCCESS;
  /* Buffers received on another stream: the word is written after our
   * waits there (see gpuipc__rxs.waited), once per stream. */
  struct CUstream_st *joined = stream;
  for (size_t k = 0; k < n && cr == CUDA_SUCCESS; k++) {
    gpuipc__rxs *r = &h->rx[slots[k]];
    if (!r->waited || r->recv_stream == stream || r->recv_stream == joined)
      continue;
    cr = join_recv_stream(r, ws);
    joined = r->recv_stream;
  }
  if (cr != CUDA_SUCCESS) {
    gpuipc__ctx_leave(&g);
    return gpuipc__fail_cuda(cr, "cuEventRecord/cuStreamWaitEvent",
                             "ordering a batch of releases after the streams "
                             "its buffers were received on (destroyed "
                             "already?)");
  }
  uint32_t pslot = UINT32_MAX;
  uint64_t pval = 0;
  for (size_t k = 0; k < n && cr == CUDA_SUCCESS; k++) {
    gpuipc__rxs *r = &h->rx[slots[k]];
    if (r->rel_wval == 0 || r->last_rel_stream == (struct CUstream_st *)ws ||
        (r->rel_wslot == pslot && r->rel_wval == pval))
      continue;
    cr = GPUIPC__CU(cuStreamWaitValue64, ws,
                    (CUdeviceptr)gpuipc__released_word(h->peer_ctl,
                                                       h->peer_nslots,
                                                       r->rel_wslot),
                    (cuuint64_t)r->rel_wval, CU_STREAM_WAIT_VALUE_GEQ);
    pslot = r->rel_wslot;
    pval = r->rel_wval;
  }
  uint32_t last = slots[n - 1];
  gpuipc__rxs *rl = &h->rx[last];
  if (cr == CUDA_SUCCESS)
    cr = GPUIPC__CU(cuStreamWriteValue64, ws,
                    (CUdeviceptr)gpuipc__released_word(h->peer_ctl,
                                                       h->peer_nslots, last),
                    (cuuint64_t)rl->held, 0);
  if (cr == CUDA_SUCCESS) {
    record_rel_done(h, rl, ws);
    for (size_t k = 0; k < n; k++) {
      gpuipc__rxs *r = &h->rx[slots[k]];
      r->rel_wslot = last;
      r->rel_wval = rl->held;
      r->last_rel_stream = (struct CUstream_st *)ws;
      r->waited = false; /* the last one's rel_done covers the run */
    }
  }
  gpuipc__ctx_leave(&g);
  if (cr != CUDA_SUCCESS)
    return gpuipc__fail_cuda(cr, "cuStreamWriteValue64",
                             "release flag of buffer %llu",
                             (unsigned long long)rl->held);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_release_batch(gpuipc_conn *conn, const uint64_t *ids,
                                        size_t n, struct CUstream_st *stream) {
  if (conn == NULL || ids == NULL || n == 0 || n > GPUIPC_BATCH_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_release_batch: NULL argument or %zu "
                        "buffers (1 to %d)",
                        n, GPUIPC_BATCH_MAX);
  struct gpuipc__ho *h = conn->ho;
  if (h == NULL || h->rx == NULL)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                        "gpuipc_conn_release_batch: buffer id 0x%llx is not "
                        "held on this connection",
                        (unsigned long long)ids[0]);
  /* Check every id before releasing any: slots queued (not received yet)
   * and slots named so far are marked in bitmaps. */
  uint64_t queued[65536 / 64] = {0}, named[65536 / 64] = {0};
  for (uint32_t i = 0; i < h->qlen; i++) {
    uint32_t qs = h->q[(h->qhead + i) % h->peer_nslots].w.slot;
    queued[qs / 64] |= (uint64_t)1 << (qs % 64);
  }
  uint32_t slots[GPUIPC_BATCH_MAX];
  for (size_t i = 0; i < n; i++) {
    uint32_t slot;
    GPUIPC__CHECK(held_slot(h, ids[i], "gpuipc_conn_release_batch", &slot));
    if (queued[slot / 64] >> (slot % 64) & 1)
      return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                          "gpuipc_conn_release_batch: buffer id 0x%llx was "
                          "not received yet",
                          (unsigned long long)ids[i]);
    if (named[slot / 64] >> (slot % 64) & 1)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_release_batch: buffer id 0x%llx named "
                          "twice",
                          (unsigned long long)ids[i]);
    named[slot / 64] |= (uint64_t)1 << (slot % 64);
    slots[i] = slot;
  }
  bool open = conn->state == GPUIPC__CONN_OPEN;
  gpuipc_status s = GPUIPC_OK;
  /* One REL frame per GPUIPC__REL_MAX buffers; within a frame, each run of
   * ordered buffers (memop mode) is released by one word write, the
   * others (event mode, buffers by descriptor, no ordering) one by one. */
  for (size_t f = 0; f < n && s == GPUIPC_OK; f += GPUIPC__REL_MAX) {
    size_t fe = n - f < GPUIPC__REL_MAX ? n : f + GPUIPC__REL_MAX;
    gpuipc__w_rel rel[GPUIPC__REL_MAX];
    size_t nrel = 0;
    for (size_t i = f; i < fe && s == GPUIPC_OK;) {
      size_t j = i + 1;
      bool run = open && h->rx[slots[i]].ordered && h->rx[slots[i]].imp == NULL;
      if (run) {
        while (j < fe && h->rx[slots[j]].ordered && h->rx[slots[j]].imp == NULL)
          j++;
        s = release_words(h, slots + i, j - i, stream);
        if (s != GPUIPC_OK)
          break; /* none of the run released: all still held */
      }
      for (size_t k = i; k < j; k++) {
        uint32_t slot = slots[k];
        gpuipc__w_rel w = {h->rx[slot].held, slot,
                           run && k + 1 < j ? GPUIPC__REL_BY_NEXT : 0u};
        /* A run's word was written above: the rest is bookkeeping. */
        gpuipc_status rs = release_slot(conn, h, slot, stream, open && !run);
        if (rs != GPUIPC_OK) {
          /* Still held, as after a failed gpuipc_conn_release (only a
           * buffer released on its own can fail here: a run's bookkeeping
           * cannot, so no entry announced points past this one). */
          s = rs;
          break;
        }
        rel[nrel++] = w;
      }
      i = j;
    }
    if (open && nrel > 0) {
      gpuipc_status fs =
          gpuipc__conn_send_frame(conn, GPUIPC__F_REL, rel,
                                  nrel * sizeof rel[0], NULL, 0, NULL, 0, 0);
      if (fs == GPUIPC_E_PEER_GONE || fs == GPUIPC_E_CLOSED)
        open = false; /* the leases end with the exporter */
      else if (fs != GPUIPC_OK && s == GPUIPC_OK)
        s = fs;
    }
  }
  return s;
}

gpuipc_status gpuipc_conn_get_outstanding(gpuipc_conn *conn, size_t *held_by_peer,
                                      size_t *held_here) {
  if (conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_get_outstanding: NULL");
  if (conn->state == GPUIPC__CONN_OPEN)
    (void)gpuipc__conn_pump(conn, 0, NULL, NULL);
  else if (conn->hooks)
    conn->hooks->poll(conn);
  struct gpuipc__ho *h = conn->ho;
  if (held_by_peer)
    *held_by_peer = h && h->lt ? gpuipc__lease_outstanding(h->lt) : 0;
  if (held_here)
    *held_here = h ? h->rx_held : 0;
  return GPUIPC_OK;
}

/* ---- peer departure ------------------------------------------------------------------ */

static void ho_poll(gpuipc_conn *c);

/* We break the connection on our own error: every buffer the caller holds
 * (received, not released) stays ours until released locally; everything
 * else the peer sent us (queued, or in frames we will not read) we never
 * used. Say so, so that the peer need not wait for our process to exit. */
static void ho_breaking(gpuipc_conn *c) {
  struct gpuipc__ho *h = c->ho;
  if (h == NULL || h->rx == NULL)
    return;
  gpuipc__w_rel held[4096];
  size_t n = 0;
  for (uint32_t s = 0; s < h->peer_nslots; s++) {
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
  gpuipc__lease_reap_orphans();
  (void)gpuipc__handoff_held_poll();
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
  free_lq(h, 1, h->peer_ordinal);
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
  poll_closing(h, true);
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
      if (release_slot(c, h, s, rs, open) != GPUIPC_OK) {
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
    free_lq(h, 0, h->lt->ordinal);
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
    ho_frame, ho_peer_gone, ho_poll, ho_breaking, ho_close};

void gpuipc__handoff_install(gpuipc_conn *c) { c->fast = &handoff_hooks; }
