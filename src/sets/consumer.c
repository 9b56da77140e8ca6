/*
 * consumer.c: the consumer's side of a tensor set: subscribers, receiving
 * tables and pieces, versions as zero-copy views, copy_into.
 *
 * What arrives on a subscribed connection (docs/sets.md): a layout's table
 * as chunk messages, then its pieces as buffers (meta PIECE, in order),
 * then versions (a token buffer, meta VERSION), and END when the producer
 * ends the subscription. The table is taken from the message queue when
 * its first piece arrives (the chunks were sent before it, so the
 * connection has them already), or earlier when the queue fills. Nothing
 * of a layout becomes visible before its table decoded and validated and
 * all of its pieces arrived with at least the lengths the table says: a
 * consumer never builds a view of a refused table, and a version is only
 * ever one of a complete layout. A view costs no driver call and no work
 * per tensor (get_tensor computes the address on demand).
 *
 * A REPLACE (a producer set aside a copy some consumer held too long)
 * brings a new piece for one copy of the current layout: versions already
 * held keep the old piece (each version holds its copy's pieces), later
 * ones use the new piece, and the old piece's lease is released with the
 * last version in it. It is validated like everything else.
 *
 * A layout left half sent (table chunks or pieces) is abandoned when the
 * next table's first chunk or layout's first piece comes, so that it
 * cannot take that layout down with it; version numbers must grow within a
 * layout (one that does not is refused and changes nothing). Each call
 * keeps one deadline however much it skips (gpuipc__tset_wait).
 */
#include "sets_int.h"

#include "conn/conn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOD "sets"

gpuipc_status gpuipc_tset_sub_open(gpuipc_conn *conn, gpuipc_tset_sub **out) {
  if (conn == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_sub_open: NULL");
  gpuipc_tset_sub *sub = calloc(1, sizeof *sub);
  if (sub == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_sub_open");
  sub->conn = conn;
  *out = sub;
  return GPUIPC_OK;
}

/* ---- layouts ------------------------------------------------------------------------- */

static gpuipc__tset_held *copy_new(uint32_t n) {
  gpuipc__tset_held *cp = calloc(1, sizeof *cp);
  if (cp == NULL)
    return NULL;
  cp->refs = 1;
  cp->piece_id = calloc(n ? n : 1, sizeof *cp->piece_id);
  cp->piece_ptr = calloc(n ? n : 1, sizeof *cp->piece_ptr);
  if (!cp->piece_id || !cp->piece_ptr) {
    free(cp->piece_id);
    free(cp->piece_ptr);
    free(cp);
    return NULL;
  }
  return cp;
}

/* Drops a reference to a copy's pieces: the last one releases them. */
static void copy_unref(gpuipc_tset_sub *sub, gpuipc__tset_held *cp,
                       CUstream stream) {
  if (cp == NULL || --cp->refs > 0)
    return;
  for (uint32_t i = 0; i < cp->n; i++)
    (void)gpuipc_conn_release(sub->conn, cp->piece_id[i],
                              (struct CUstream_st *)stream);
  free(cp->piece_id);
  free(cp->piece_ptr);
  free(cp);
}

static void layout_free(gpuipc_tset_sub *sub, gpuipc__tset_layout *lay,
                        CUstream stream) {
  if (lay == NULL)
    return;
  if (lay->copy)
    for (uint32_t c = 0; c < lay->tab.copies; c++)
      copy_unref(sub, lay->copy[c], stream);
  for (gpuipc__tset_layout **p = &sub->retired; *p; p = &(*p)->next)
    if (*p == lay) {
      *p = lay->next;
      break;
    }
  gpuipc__tset_table_free(&lay->tab);
  free(lay->copy);
  free(lay);
}

/* A layout no version will come of any more: goes now, or with its last
 * version. */
static void layout_retire(gpuipc_tset_sub *sub, gpuipc__tset_layout *lay,
                          CUstream stream) {
  if (lay == NULL)
    return;
  if (lay->refs == 0) {
    layout_free(sub, lay, stream);
    return;
  }
  lay->retired = true;
  lay->next = sub->retired;
  sub->retired = lay;
}

/* Remembers a refused layout: its later buffers are released unseen and
 * its versions fail with the same status. Returns the status. */
static gpuipc_status refuse(gpuipc_tset_sub *sub, uint64_t layout,
                            gpuipc_status s) {
  sub->has_refused = true;
  sub->refused = layout;
  sub->refused_status = s;
  snprintf(sub->refused_why, sizeof sub->refused_why, "%s", gpuipc_last_error());
  /* A layout being received is the refused one (or one a producer left
   * half sent): none of it stays. */
  layout_free(sub, sub->pending, NULL);
  sub->pending = NULL;
  GPUIPC__WARN(MOD, "tensor-set layout %llx refused: %s",
               (unsigned long long)layout, sub->refused_why);
  return gpuipc__fail(s, "tensor-set layout %llx refused: %s",
                      (unsigned long long)layout, sub->refused_why);
}

/* ---- the table, from chunk messages ------------------------------------------------- */

static void table_reset(gpuipc_tset_sub *sub) {
  free(sub->tbuf);
  sub->tbuf = NULL;
  sub->thave = sub->tneed = sub->tcap = 0;
  sub->tchunks = 0;
}

static uint32_t rd32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

/* Takes one chunk message into the table being collected. */
static gpuipc_status take_chunk(gpuipc_tset_sub *sub) {
  uint8_t *msg = malloc(GPUIPC_CONN_MSG_MAX);
  if (msg == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set table chunk");
  size_t len = 0;
  gpuipc_status s = gpuipc_conn_recv_msg(sub->conn, msg, GPUIPC_CONN_MSG_MAX,
                                         &len, NULL, NULL);
  if (s != GPUIPC_OK) {
    free(msg);
    return s == GPUIPC_E_TRUNCATED
               ? gpuipc__fail(GPUIPC_E_PROTOCOL, "a message of %zu bytes on a "
                              "subscribed connection", len)
               : s;
  }
  uint64_t lid = (uint64_t)rd32(msg + 8) | (uint64_t)rd32(msg + 12) << 32;
  if (len < GPUIPC__TSET_CHUNK_HDR || rd32(msg) != GPUIPC__TSET_CHUNK_MAGIC) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "a message that is not a tensor-set "
                     "table chunk (%zu bytes) on a subscribed connection", len);
    goto out;
  }
  if (rd32(msg + 4) == 0 && sub->tchunks > 0) {
    /* A new table's first chunk: the one left half sent is abandoned. */
    GPUIPC__WARN(MOD, "tensor-set table of layout %llx left half sent "
                 "(%zu of %zu bytes) for layout %llx",
                 (unsigned long long)sub->tlayout, sub->thave, sub->tneed,
                 (unsigned long long)lid);
    table_reset(sub);
  }
  if (rd32(msg + 4) != sub->tchunks ||
      (sub->tchunks > 0 && lid != sub->tlayout) ||
      (sub->tchunks > 0 && sub->thave == sub->tneed)) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table chunk %u of layout "
                     "%llx out of order", rd32(msg + 4), (unsigned long long)lid);
    goto out;
  }
  const uint8_t *data = msg + GPUIPC__TSET_CHUNK_HDR;
  size_t n = len - GPUIPC__TSET_CHUNK_HDR;
  if (sub->tchunks == 0) {
    /* The first chunk holds the header: its length says what to expect. */
    if (n < GPUIPC__TSET_HDR_LEN) {
      s = gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor-set table: a first chunk "
                       "of %zu bytes", n);
      goto out;
    }
    size_t total = rd32(data + 8);
    if (total < GPUIPC__TSET_HDR_LEN || total > GPUIPC_TSET_TABLE_MAX) {
      s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table of %zu bytes "
                       "announced (at most %zu)", total, GPUIPC_TSET_TABLE_MAX);
      goto out;
    }
    sub->tbuf = malloc(total);
    if (sub->tbuf == NULL) {
      s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set table of %zu bytes",
                       total);
      goto out;
    }
    sub->tneed = sub->tcap = total;
    sub->thave = 0;
    sub->tlayout = lid;
  }
  if (n > sub->tneed - sub->thave) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "tensor-set table: chunks beyond its "
                     "%zu bytes", sub->tneed);
    goto out;
  }
  memcpy(sub->tbuf + sub->thave, data, n);
  sub->thave += n;
  sub->tchunks++;
out:
  if (s != GPUIPC_OK && s != GPUIPC_E_NO_MEMORY)
    table_reset(sub);
  free(msg);
  return s;
}

/* The first piece of layout `lid` arrived: decode its table (collecting
 * what chunks remain) and start the layout. */
static gpuipc_status start_layout(gpuipc_tset_sub *sub,
                                  const gpuipc__tset_meta *m,
                                  const gpuipc_received *r) {
  /* The piece says how many table bytes were sent before it: take chunks
   * up to that (or the table's own length, if less). A table of another
   * layout collected so far was left half sent: the chunks after it start
   * this one's (take_chunk). */
  while (sub->tchunks == 0 || sub->tlayout != m->layout_id ||
         sub->thave < (sub->tneed < m->c ? sub->tneed : m->c)) {
    /* The chunks were sent before this piece, so they are all queued
     * here by now (the connection read them before the piece's frame):
     * none queued means none more will come. */
    size_t queued = 0;
    gpuipc__conn_queued(sub->conn, &queued, NULL, NULL, NULL);
    if (queued == 0) {
      size_t have = sub->thave, need = sub->tneed;
      table_reset(sub);
      return refuse(sub, m->layout_id,
                    gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor-set table: %zu "
                                 "of its %zu bytes came before its first "
                                 "piece", have, need));
    }
    gpuipc_status s = take_chunk(sub);
    if (s != GPUIPC_OK)
      return refuse(sub, m->layout_id, s == GPUIPC_E_TIMEOUT ||
                                               s == GPUIPC_E_WOULD_BLOCK
                                           ? GPUIPC_E_PROTOCOL
                                           : s);
  }
  if (sub->thave < sub->tneed) {
    size_t have = sub->thave, need = sub->tneed;
    table_reset(sub);
    return refuse(sub, m->layout_id,
                  gpuipc__fail(GPUIPC_E_TRUNCATED, "tensor-set table: %zu of "
                               "its %zu bytes came before its first piece",
                               have, need));
  }
  if (sub->tlayout != m->layout_id || sub->tneed != m->c) {
    table_reset(sub);
    return refuse(sub, m->layout_id,
                  gpuipc__fail(GPUIPC_E_PROTOCOL, "the table before the first "
                               "piece is of layout %llx, %zu bytes (the piece "
                               "says %u)", (unsigned long long)sub->tlayout,
                               sub->tneed, m->c));
  }
  gpuipc__tset_layout *lay = calloc(1, sizeof *lay);
  if (lay == NULL) {
    table_reset(sub);
    return refuse(sub, m->layout_id,
                  gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set layout"));
  }
  gpuipc_status s = gpuipc__tset_table_decode(sub->tbuf, sub->thave, &lay->tab);
  table_reset(sub);
  if (s == GPUIPC_OK && lay->tab.layout_id != m->layout_id)
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "table of layout %llx announced as "
                     "%llx", (unsigned long long)lay->tab.layout_id,
                     (unsigned long long)m->layout_id);
  if (s == GPUIPC_OK && lay->tab.n_pieces * lay->tab.copies != m->b)
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "the table has %u pieces in %u "
                     "copies, the piece says %u in all", lay->tab.n_pieces,
                     lay->tab.copies, m->b);
  if (s == GPUIPC_OK) {
    lay->npieces = lay->tab.n_pieces * lay->tab.copies;
    lay->copy = calloc(lay->tab.copies, sizeof *lay->copy);
    for (uint32_t c = 0; lay->copy && c < lay->tab.copies; c++)
      if ((lay->copy[c] = copy_new(lay->tab.n_pieces)) == NULL)
        break;
    if (!lay->copy || !lay->copy[lay->tab.copies - 1])
      s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set layout of %u pieces",
                       lay->npieces);
  }
  if (s != GPUIPC_OK) {
    sub->pending = lay; /* freed by refuse */
    return refuse(sub, m->layout_id, s);
  }
  (void)r;
  sub->pending = lay;
  return GPUIPC_OK;
}

/* ---- receiving ------------------------------------------------------------------------ */

static gpuipc_status on_piece(gpuipc_tset_sub *sub, const gpuipc__tset_meta *m,
                              const gpuipc_received *r, CUstream stream,
                              bool *keep) {
  gpuipc__tset_layout *lay = sub->pending;
  if (lay == NULL || lay->tab.layout_id != m->layout_id) {
    if (lay != NULL && m->a == 0) {
      /* A new layout's first piece: the one left half sent is abandoned
       * (its pieces released, its later buffers skipped), and this one
       * starts. */
      (void)refuse(sub, lay->tab.layout_id,
                   gpuipc__fail(GPUIPC_E_PROTOCOL, "layout %llx left half "
                                "sent for layout %llx",
                                (unsigned long long)lay->tab.layout_id,
                                (unsigned long long)m->layout_id));
      lay = NULL;
    }
    if (lay != NULL)
      return refuse(sub, lay->tab.layout_id,
                    gpuipc__fail(GPUIPC_E_PROTOCOL, "layout %llx left half "
                                 "sent for piece %llu of layout %llx",
                                 (unsigned long long)lay->tab.layout_id,
                                 (unsigned long long)m->a,
                                 (unsigned long long)m->layout_id));
    if (m->a != 0)
      return refuse(sub, m->layout_id,
                    gpuipc__fail(GPUIPC_E_PROTOCOL, "layout %llx starts at "
                                 "piece %llu", (unsigned long long)m->layout_id,
                                 (unsigned long long)m->a));
    GPUIPC__CHECK(start_layout(sub, m, r));
    lay = sub->pending;
  }
  if (m->a != lay->got || m->b != lay->npieces)
    return refuse(sub, m->layout_id,
                  gpuipc__fail(GPUIPC_E_PROTOCOL, "piece %llu of %u where %u "
                               "of %u was due", (unsigned long long)m->a, m->b,
                               lay->got, lay->npieces));
  uint64_t need = lay->tab.piece_len[lay->got % lay->tab.n_pieces];
  if (r->length < need)
    return refuse(sub, m->layout_id,
                  gpuipc__fail(GPUIPC_E_OUT_OF_RANGE, "piece %u: %zu bytes, "
                               "the table says %llu", lay->got, r->length,
                               (unsigned long long)need));
  gpuipc__tset_held *cp = lay->copy[lay->got / lay->tab.n_pieces];
  cp->piece_id[cp->n] = r->id;
  cp->piece_ptr[cp->n] = (CUdeviceptr)(uintptr_t)r->ptr;
  cp->n++;
  lay->got++;
  *keep = true;
  if (lay->got == lay->npieces) {
    layout_retire(sub, sub->cur, stream);
    sub->cur = lay;
    sub->pending = NULL;
  }
  return GPUIPC_OK;
}

/* A new piece for one copy of the current layout. */
static gpuipc_status on_replace(gpuipc_tset_sub *sub, const gpuipc__tset_meta *m,
                                const gpuipc_received *r, CUstream stream,
                                bool *keep) {
  gpuipc__tset_layout *lay = sub->cur;
  if (lay == NULL || lay->tab.layout_id != m->layout_id)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "a new piece for layout %llx: no "
                        "such layout received", (unsigned long long)m->layout_id);
  if (lay->tab.n_pieces != 1)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "a new piece for layout %llx, whose "
                        "copies have %u pieces (only copies of one piece are "
                        "replaced)", (unsigned long long)m->layout_id,
                        lay->tab.n_pieces);
  if (m->a >= lay->tab.copies || m->b != lay->npieces)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "a new piece for copy %llu of %u "
                        "(%u pieces in all, the layout has %u)",
                        (unsigned long long)m->a, lay->tab.copies, m->b,
                        lay->npieces);
  uint32_t c = (uint32_t)m->a;
  if (m->c <= lay->gen[c])
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "a new piece for copy %u of "
                        "generation %u, not after %u", c, m->c, lay->gen[c]);
  if (r->length < lay->tab.piece_len[0])
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "a new piece for copy %u of %zu "
                        "bytes, the table says %llu", c, r->length,
                        (unsigned long long)lay->tab.piece_len[0]);
  gpuipc__tset_held *cp = copy_new(1);
  if (cp == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "a new piece of a tensor set");
  cp->piece_id[0] = r->id;
  cp->piece_ptr[0] = (CUdeviceptr)(uintptr_t)r->ptr;
  cp->n = 1;
  gpuipc__tset_held *old = lay->copy[c];
  lay->copy[c] = cp;
  lay->gen[c] = m->c;
  *keep = true;
  copy_unref(sub, old, stream); /* goes now, or with its last version */
  return GPUIPC_OK;
}

/* gpuipc_tset_recv's loop: every pass takes one buffer (or chunk); the
 * passes share the call's one deadline (w), so that a producer that keeps
 * sending what this call skips (pieces of a refused layout, ENDs of
 * layouts never sent) cannot hold it past the connection's timeout. */
static gpuipc_status recv_loop(gpuipc_tset_sub *sub, struct CUstream_st *stream,
                               gpuipc_tset_version **out,
                               gpuipc__tset_wait *w) {
  for (;;) {
    if (!gpuipc__tset_wait_next(w))
      return GPUIPC_E_TIMEOUT;
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status s = gpuipc_conn_recv(sub->conn, stream, &r);
    if (s == GPUIPC_E_BUSY) {
      /* The message queue is full: of table chunks, if the producer
       * follows the protocol. Take one and go on. */
      s = take_chunk(sub);
      if (s != GPUIPC_OK)
        return s;
      continue;
    }
    if (s != GPUIPC_OK)
      return s;
    gpuipc__tset_meta m;
    s = gpuipc__tset_meta_decode(r.meta, r.meta_len, &m);
    if (s != GPUIPC_OK) {
      (void)gpuipc_conn_release(sub->conn, r.id, stream);
      return s;
    }
    if (sub->has_refused && m.layout_id == sub->refused) {
      (void)gpuipc_conn_release(sub->conn, r.id, stream);
      if (m.kind == GPUIPC__TSET_VERSION_TOKEN)
        return gpuipc__fail(sub->refused_status, "version %llu of layout %llx: "
                            "its table was refused (%s)",
                            (unsigned long long)m.a,
                            (unsigned long long)m.layout_id, sub->refused_why);
      continue;
    }
    bool keep = false;
    if (m.kind == GPUIPC__TSET_PIECE) {
      s = on_piece(sub, &m, &r, (CUstream)stream, &keep);
      if (!keep)
        (void)gpuipc_conn_release(sub->conn, r.id, stream);
      if (s != GPUIPC_OK)
        return s;
      continue;
    }
    if (m.kind == GPUIPC__TSET_REPLACE) {
      s = on_replace(sub, &m, &r, (CUstream)stream, &keep);
      if (!keep)
        (void)gpuipc_conn_release(sub->conn, r.id, stream);
      if (s != GPUIPC_OK)
        return s;
      continue;
    }
    if (m.kind == GPUIPC__TSET_END) {
      (void)gpuipc_conn_release(sub->conn, r.id, stream);
      if (sub->cur && sub->cur->tab.layout_id == m.layout_id) {
        layout_retire(sub, sub->cur, (CUstream)stream);
        sub->cur = NULL;
        if (m.b == GPUIPC__TSET_END_HELD)
          return gpuipc__fail(GPUIPC_E_CANCELED, "the producer dropped this "
                              "subscriber from layout %llx: it held a version "
                              "past the producer's hold limit",
                              (unsigned long long)m.layout_id);
        return gpuipc__fail(GPUIPC_E_CANCELED, "the producer ended the "
                            "subscription to layout %llx",
                            (unsigned long long)m.layout_id);
      }
      continue;
    }
    /* A version. */
    gpuipc__tset_layout *lay = sub->cur;
    if (lay == NULL || lay->tab.layout_id != m.layout_id || m.b >= lay->tab.copies) {
      (void)gpuipc_conn_release(sub->conn, r.id, stream);
      return gpuipc__fail(GPUIPC_E_PROTOCOL, "version %llu of layout %llx, "
                          "copy %u: no such layout (or copy) received",
                          (unsigned long long)m.a,
                          (unsigned long long)m.layout_id, m.b);
    }
    if (m.a <= lay->last) {
      /* Refused, and nothing changes: the layout still expects a number
       * above the last one accepted. */
      (void)gpuipc_conn_release(sub->conn, r.id, stream);
      return gpuipc__fail(GPUIPC_E_PROTOCOL, "version %llu of layout %llx "
                          "after version %llu: version numbers must grow",
                          (unsigned long long)m.a,
                          (unsigned long long)m.layout_id,
                          (unsigned long long)lay->last);
    }
    gpuipc_tset_version *v = calloc(1, sizeof *v);
    if (v == NULL) {
      (void)gpuipc_conn_release(sub->conn, r.id, stream);
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_recv");
    }
    lay->last = m.a;
    v->sub = sub;
    v->lay = lay;
    v->cp = lay->copy[m.b];
    v->cp->refs++;
    v->token_id = r.id;
    v->number = m.a;
    v->copy = (int)m.b;
    v->ordinal = r.device;
    lay->refs++;
    v->next = sub->held;
    if (sub->held)
      sub->held->prev = v;
    sub->held = v;
    *out = v;
    return GPUIPC_OK;
  }
}

gpuipc_status gpuipc_tset_recv(gpuipc_tset_sub *sub, struct CUstream_st *stream,
                               gpuipc_tset_version **out) {
  if (sub == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_recv: NULL");
  *out = NULL;
  gpuipc__tset_wait w;
  gpuipc__tset_wait_begin(&w, sub->conn);
  gpuipc_status s = recv_loop(sub, stream, out, &w);
  gpuipc__tset_wait_end(&w);
  if (s == GPUIPC_E_TIMEOUT)
    return gpuipc__fail(s, "gpuipc_tset_recv: no version within the "
                        "connection's timeout (%d ms)", w.timeout_ms);
  return s;
}

gpuipc_status gpuipc_tset_version_release(gpuipc_tset_version *v,
                                          struct CUstream_st *stream) {
  if (v == NULL)
    return GPUIPC_OK;
  gpuipc_tset_sub *sub = v->sub;
  gpuipc_status s = gpuipc_conn_release(sub->conn, v->token_id, stream);
  if (v->prev)
    v->prev->next = v->next;
  else
    sub->held = v->next;
  if (v->next)
    v->next->prev = v->prev;
  copy_unref(sub, v->cp, (CUstream)stream);
  gpuipc__tset_layout *lay = v->lay;
  if (--lay->refs == 0 && lay->retired)
    layout_free(sub, lay, (CUstream)stream);
  free(v);
  return s;
}

void gpuipc_tset_sub_close(gpuipc_tset_sub *sub) {
  if (sub == NULL)
    return;
  while (sub->held)
    (void)gpuipc_tset_version_release(sub->held, NULL);
  layout_free(sub, sub->cur, NULL);
  layout_free(sub, sub->pending, NULL);
  while (sub->retired)
    layout_free(sub, sub->retired, NULL);
  table_reset(sub);
  free(sub);
}

/* ---- views ------------------------------------------------------------------------------ */

uint64_t gpuipc_tset_version_get_number(const gpuipc_tset_version *v) {
  return v ? v->number : 0;
}
uint64_t gpuipc_tset_version_get_layout(const gpuipc_tset_version *v) {
  return v ? v->lay->tab.layout_id : 0;
}
int gpuipc_tset_version_get_copy(const gpuipc_tset_version *v) {
  return v ? v->copy : -1;
}
size_t gpuipc_tset_version_get_count(const gpuipc_tset_version *v) {
  return v ? v->lay->tab.n_entries : 0;
}

static CUdeviceptr addr_of(const gpuipc_tset_version *v,
                           const gpuipc__tset_entry *e) {
  return v->cp->piece_ptr[e->piece] + e->offset;
}

gpuipc_status gpuipc_tset_version_get_tensor(const gpuipc_tset_version *v,
                                             size_t i, gpuipc_tensor *out) {
  if (v == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_version_get_tensor: "
                        "NULL");
  const gpuipc__tset_table *t = &v->lay->tab;
  if (i >= t->n_entries)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_version_get_tensor: "
                        "tensor %zu of %u", i, t->n_entries);
  const gpuipc__tset_entry *e = &t->e[i];
  out->name = t->names + e->name_off;
  out->dtype = e->dtype;
  out->ndim = e->ndim;
  out->shape = e->shape;
  out->strides = e->strides;
  out->ptr = (void *)(uintptr_t)addr_of(v, e);
  out->nbytes = (size_t)e->nbytes;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_tset_version_find(const gpuipc_tset_version *v,
                                       const char *name, size_t *index) {
  if (v == NULL || name == NULL || index == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_version_find: NULL");
  long i = gpuipc__tset_table_find(&v->lay->tab, name, strlen(name));
  if (i < 0)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND, "no tensor named \"%.64s\"", name);
  *index = (size_t)i;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_tset_version_copy_into(const gpuipc_tset_version *v,
                                            void *const *dsts,
                                            struct CUstream_st *stream) {
  if (v == NULL || dsts == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_version_copy_into: "
                        "NULL");
  const gpuipc__tset_table *t = &v->lay->tab;
  size_t n = t->n_entries;
  CUdeviceptr *s = malloc(n * sizeof *s), *d = malloc(n * sizeof *d);
  uint64_t *l = malloc(n * sizeof *l);
  gpuipc_status st = GPUIPC_OK;
  if (!s || !d || !l) {
    st = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_version_copy_into");
  } else {
    for (size_t i = 0; i < n; i++) {
      s[i] = addr_of(v, &t->e[i]);
      d[i] = (CUdeviceptr)(uintptr_t)dsts[i];
      l[i] = t->e[i].nbytes;
    }
    st = gpuipc__tset_copy(v->ordinal, s, d, l, n, (CUstream)stream);
  }
  free(s);
  free(d);
  free(l);
  return st;
}
