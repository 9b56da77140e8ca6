/*
 * handoff.c: owns the base of the per-buffer fast path that both
 * directions stand on: a connection's fast-path state (made at first use),
 * the private streams that stand in for the legacy default stream, and
 * the interprocess events of event mode. The fast path is exporting arena
 * chunks and the flag words to a connection once, sending a block as one
 * small frame (tx.c), receiving it and releasing it (rx.c), and the stream
 * ordering of both directions with stream memory operations on the flag
 * words; a connection's end is depart.c's. The sender and the receiver
 * never call each other, so what they share lives here, below both.
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

#include <stdlib.h>

gpuipc_status gpuipc__ho_get(gpuipc_conn *c, struct gpuipc__ho **out) {
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
gpuipc_status gpuipc__ho_write_stream(struct gpuipc__ho *h, int i,
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
 * gpuipc__ho_wait_done once the wait is enqueued on it). */
gpuipc_status gpuipc__ho_wait_stream(struct gpuipc__ho *h, int i,
                                     struct CUstream_st *user, CUstream *out) {
  if (!gpuipc__is_legacy_stream(user)) {
    *out = (CUstream)user;
    return GPUIPC_OK;
  }
  return lq_get(h, i, out);
}

CUresult gpuipc__ho_wait_done(struct gpuipc__ho *h, int i,
                              struct CUstream_st *user) {
  if (!gpuipc__is_legacy_stream(user))
    return CUDA_SUCCESS;
  CUresult r = GPUIPC__CU(cuEventRecord, (CUevent)h->lev[i], (CUstream)h->lq[i]);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)user, (CUevent)h->lev[i], 0);
  return r;
}

/* Destroys h->lq[i] / h->lev[i] (context of device `ordinal`). */
void gpuipc__ho_free_lq(struct gpuipc__ho *h, int i, int ordinal) {
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

/* ---- event mode ---------------------------------------------------------------------- */

/* Event mode: makes an interprocess event on device `ordinal` and sends its
 * descriptor for `slot` (which: 0 ready, 1 release). */
gpuipc_status gpuipc__ho_make_event(gpuipc_conn *conn, int ordinal,
                                    uint32_t slot, uint32_t which,
                                    uint64_t deadline, gpuipc_event **out) {
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
