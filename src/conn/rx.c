/*
 * rx.c: owns the receiver of the per-buffer fast path: the frames the peer
 * sends (checked as hostile input before anything is kept), the queue of
 * buffers that arrived, recv with its stream waits on the peer's flag
 * words, and releases (one by one or a batch signalled by one word). It
 * never calls the sender (tx.c); the REL and ABANDON frames it dispatches
 * go to the lease table (lease.c), which the sender owns. What departure
 * and close need of it (a slot released, closing imports polled) is
 * declared in handoff_int.h.
 */
#include "handoff_int.h"
#include "core/stats.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    size_t cap = (size_t)h->cimp;
    gpuipc__imp *n = gpuipc__grow(h->imp, &cap, cap + 1, sizeof *n, 4);
    if (n == NULL) {
      s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "imports");
      goto out;
    }
    h->imp = n;
    h->cimp = (int)cap;
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
void gpuipc__ho_poll_closing(struct gpuipc__ho *h, bool all) {
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

gpuipc_status gpuipc__ho_frame(gpuipc_conn *c, int type,
                               const unsigned char *p, size_t len, int *fds,
                               int nfds) {
  struct gpuipc__ho *h = NULL;
  gpuipc_status s = gpuipc__ho_get(c, &h);
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
    c->peer_ended = true;
    return GPUIPC_OK;
  case GPUIPC__F_ABANDON:
    c->peer_ended = true; /* it reads nothing more */
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
  gpuipc_status ss = gpuipc__ho_wait_stream(h, 1, stream, &wst);
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
    cr = gpuipc__ho_wait_done(h, 1, stream);
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

/* What a receive waits for a buffer with. Its passes are the ones that
 * may leave the socket unread while the peer's count says nothing came
 * there (frames.c, sock_worth_reading): a polling receiver's calls that
 * find nothing then make no system call. */
static gpuipc_status recv_pump(gpuipc_conn *conn) {
  conn->rx_hot = true;
  gpuipc_status s =
      gpuipc__conn_pump(conn, gpuipc__conn_deadline(conn), have_buf, NULL);
  conn->rx_hot = false;
  return s;
}

gpuipc_status gpuipc_conn_recv(gpuipc_conn *conn, struct CUstream_st *stream,
                               gpuipc_received *out) {
  if (conn == NULL || out == NULL || out->size < sizeof *out)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_recv: NULL argument, or out->size not set "
                        "(use GPUIPC_RECEIVED_INIT)");
  if (conn->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(conn);
  if (!have_buf(conn, NULL))
    GPUIPC__CHECK(recv_pump(conn));
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
  if (!have_buf(conn, NULL))
    GPUIPC__CHECK(recv_pump(conn));
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

/* The held lease of r is no longer ours (its import, if any, dealt with). */
static void lease_forgotten(gpuipc_conn *conn, struct gpuipc__ho *h,
                            gpuipc__rxs *r) {
  r->last_rel = r->held;
  r->held = 0;
  h->rx_held--;
  gpuipc__stats_conn_held_here(conn->stats_slot, -1);
}

/* Writes the release flag of a held slot on stream (ordered mode) and
 * forgets the lease locally. */
gpuipc_status gpuipc__ho_release_slot(gpuipc_conn *conn, struct gpuipc__ho *h,
                                      uint32_t slot, struct CUstream_st *stream,
                                      bool write_flag) {
  gpuipc__rxs *r = &h->rx[slot];
  if (write_flag && r->by_event) {
    if (r->rel_ev == NULL)
      GPUIPC__CHECK(gpuipc__ho_make_event(conn, h->peer_ordinal, slot, 1,
                                          gpuipc__conn_deadline(conn),
                                          &r->rel_ev));
    GPUIPC__CHECK(gpuipc_event_record(r->rel_ev, stream));
  }
  if (r->ordered && (write_flag || r->waited)) {
    gpuipc__ctx_guard g;
    GPUIPC__CHECK(gpuipc__ctx_enter(&g, h->peer_ordinal));
    CUdeviceptr word = (CUdeviceptr)gpuipc__released_word(
        h->peer_ctl, h->peer_nslots, slot);
    CUstream ws = NULL;
    gpuipc_status ss = gpuipc__ho_write_stream(h, 1, stream, &ws);
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
    gpuipc__closing *n = gpuipc__grow(h->closing, &h->capclosing,
                                      h->nclosing + 1, sizeof *n, 8);
    if (n == NULL)
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "closing list");
    h->closing = n;
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
    gpuipc__ho_poll_closing(h, false);
  }
  lease_forgotten(conn, h, r);
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

/* A complete release (GPUIPC_RELEASE_COMPLETE) of a held slot: nothing
 * asked of the driver, nothing written for the peer. Only for a lease
 * whose receive queued no wait (it came complete, or from an idle stream):
 * no GPU work of ours can still read the peer's words for it, its own
 * ready word was never written (so no later write of the producer's must
 * wait for this release's word), and an earlier release's rel_done still
 * covers what that one queued. Not in event mode (its release event is
 * recorded in every case). */
static bool complete_release_applies(const gpuipc_conn *conn,
                                     const gpuipc__rxs *r) {
  return conn->peer_relc && !r->by_event && !r->waited;
}

static void release_complete(gpuipc_conn *conn, struct gpuipc__ho *h,
                             gpuipc__rxs *r) {
  if (r->imp) {
    /* The caller's use of the import is done: closed now. */
    gpuipc_buffer_close(r->imp);
    r->imp = NULL;
  }
  lease_forgotten(conn, h, r);
}

gpuipc_status gpuipc_conn_release(gpuipc_conn *conn, uint64_t id,
                                  struct CUstream_st *stream) {
  return gpuipc_conn_release_ex(conn, id, stream, 0);
}

gpuipc_status gpuipc_conn_release_ex(gpuipc_conn *conn, uint64_t id,
                                     struct CUstream_st *stream,
                                     unsigned flags) {
  if (conn == NULL || (flags & ~GPUIPC_RELEASE_COMPLETE))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_release: NULL connection or flags 0x%x "
                        "(only GPUIPC_RELEASE_COMPLETE)",
                        flags);
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
    return gpuipc__ho_release_slot(conn, h, slot, stream, false);
  }
  gpuipc__w_rel rel = {h->rx[slot].held, slot, 0};
  if ((flags & GPUIPC_RELEASE_COMPLETE) &&
      complete_release_applies(conn, &h->rx[slot])) {
    rel.flags = GPUIPC__REL_COMPLETE;
    release_complete(conn, h, &h->rx[slot]);
  } else {
    GPUIPC__CHECK(gpuipc__ho_release_slot(conn, h, slot, stream, true));
  }
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
  gpuipc_status ss = gpuipc__ho_write_stream(h, 1, stream, &ws);
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
        gpuipc_status rs =
            gpuipc__ho_release_slot(conn, h, slot, stream, open && !run);
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
