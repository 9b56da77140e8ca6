/*
 * producer.c: the producer's side of a tensor set: making the table and
 * the memory (owned copies in arena blocks, or the caller's allocations
 * wrapped), subscribing connections, and versions.
 *
 * Why a version costs one message and one signal: the table and the
 * pieces go to a connection once, at subscribe; a version is then one
 * send of a small arena block (the copy's token) whose meta names the
 * layout, the version and the copy. The connection layer orders it on the
 * producer's stream (a flag-word write the consumer's stream waits for)
 * and gives the consumer a lease on the token. The lease is the
 * version's: the consumer releases it, on its stream, when it is done with
 * the version, and gpuipc_tset_begin hands a copy out again only when its
 * token has no holder left (every consumer released every version in that
 * copy) and those releases completed on the GPU (the token's reuse
 * markers, queried without waiting). So no copy is written while a
 * consumer may still read it, whatever the number of tensors. begin waits
 * for a release's GPU work on the host instead of ordering its stream
 * behind it: a release that never completes (a consumer's hung kernel, a
 * REL without its GPU write) would stall that stream for good.
 *
 * Consumers that die are reclaimed by the connection layer (their leases
 * go once the process is gone); each call that waits makes progress on
 * every subscribed connection and drops those whose peer is gone.
 *
 * Why a consumer that never releases cannot stall the producer: a copy
 * still held hold_ms after its version was published (or, for a late
 * joiner, handed to it: once per version) is retired (owned
 * sets): its piece and token are set aside (kept, so no one else gets the
 * memory, until no holder is left; then freed, the arena deferring the
 * reuse until the holders' GPU work is done) and begin writes a fresh
 * piece and token instead, announced to every subscriber (REPLACE) before
 * the version in it. A wrapped set's memory cannot be set aside: its
 * token is replaced. Either way the holders are dropped from the set
 * (END, why: held): a stuck consumer gets no more versions, so it holds
 * at most one copy per copy of the set. A release whose GPU work has not
 * completed hold_ms after the publish counts as a hold. At most
 * retired_max owned copies are set aside at once; beyond that the copy is
 * written in place, as a wrapped set's. Unsubscribe and destroy
 * of an owned set wait for a consumer's releases at most hold_ms, then let
 * go of its connection (what it holds stays leased in the connection
 * layer and comes back when it releases or dies). Consumers that release
 * promptly see none of this: the fast path reads a clock at publish and
 * scans an empty list in each progress call.
 */
#include "sets_int.h"

#include "conn/conn.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MOD "sets"

static uint64_t new_layout_id(void) {
  static _Atomic uint32_t counter;
  uint32_t n = atomic_fetch_add(&counter, 1) + 1;
  return (uint64_t)(uint32_t)getpid() << 32 | n;
}

/* ---- arenas of destroyed sets ------------------------------------------------------- */

/* A set's own arena whose blocks consumers still held when the set was
 * destroyed waits here, and goes in a later create or destroy once they
 * are all back. */
static pthread_mutex_t grave_lock = PTHREAD_MUTEX_INITIALIZER;
static gpuipc_arena **grave;
static size_t ngrave, grave_cap;

static void grave_reap(void) {
  pthread_mutex_lock(&grave_lock);
  for (size_t i = 0; i < ngrave;) {
    gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
    if (gpuipc_arena_get_stats(grave[i], &st) == GPUIPC_OK &&
        st.blocks_allocated == 0 && gpuipc_arena_destroy(grave[i]) == GPUIPC_OK) {
      grave[i] = grave[--ngrave];
      continue;
    }
    i++;
  }
  pthread_mutex_unlock(&grave_lock);
}

/* Keeps an arena for grave_reap; false when there is no room. */
static bool grave_add(gpuipc_arena *a) {
  pthread_mutex_lock(&grave_lock);
  gpuipc_arena **g =
      gpuipc__grow(grave, &grave_cap, ngrave + 1, sizeof *g, 8);
  if (g) {
    grave = g;
    grave[ngrave++] = a;
  }
  pthread_mutex_unlock(&grave_lock);
  return g != NULL;
}

/* ---- peers -------------------------------------------------------------------- */

static long peer_find(const gpuipc_tset *set, const gpuipc_conn *conn) {
  for (size_t i = 0; i < set->npeers; i++)
    if (set->peers[i].conn == conn)
      return (long)i;
  return -1;
}

static void peer_drop(gpuipc_tset *set, size_t i) {
  set->peers[i] = set->peers[--set->npeers];
}

/* Whether a block is still held, or a release of it has not completed on
 * the GPU (the holder's work before it still runs): either way, writing it
 * would wait for a consumer. */
static bool block_busy(gpuipc_block *b) {
  return b != NULL &&
         (gpuipc_block_get_holders(b) > 0 || gpuipc__block_pending(b, 0));
}

/* Frees the retired copies no one holds any more and whose releases
 * completed (so that the arena never hands their memory out ordered
 * behind a release that may never complete). */
static void retired_reap(gpuipc_tset *set) {
  for (size_t i = 0; i < set->nretired;) {
    gpuipc__tset_retired *r = &set->retired[i];
    if (!block_busy(r->token) && !block_busy(r->piece)) {
      GPUIPC__DEBUG(MOD, "set %llx: a retired copy is free again",
                    (unsigned long long)set->tab.layout_id);
      gpuipc_block_free(r->piece, NULL);
      gpuipc_block_free(r->token, NULL);
      set->retired[i] = set->retired[--set->nretired];
      continue;
    }
    i++;
  }
}

/* Retired copies of an owned set (pieces set aside), held still. */
static size_t retired_owned(const gpuipc_tset *set) {
  size_t n = 0;
  for (size_t i = 0; i < set->nretired; i++)
    n += set->retired[i].piece != NULL;
  return n;
}

/* Makes progress on every peer without waiting; drops the gone and the
 * ended ones that hold nothing of ours any more; frees retired copies no
 * one holds. */
static void peers_progress(gpuipc_tset *set) {
  for (size_t i = 0; i < set->npeers;) {
    gpuipc_conn *c = set->peers[i].conn;
    gpuipc_status s = gpuipc_conn_progress(c, 0);
    if (s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED ||
        s == GPUIPC_E_PROTOCOL) {
      GPUIPC__DEBUG(MOD, "set %llx: subscriber gone (%s)",
                    (unsigned long long)set->tab.layout_id,
                    gpuipc_status_name(s));
      peer_drop(set, i);
      continue;
    }
    if (set->peers[i].ended) {
      size_t held = 1;
      if (gpuipc_conn_get_outstanding(c, &held, NULL) == GPUIPC_OK && held == 0) {
        peer_drop(set, i);
        continue;
      }
    }
    i++;
  }
  if (set->nretired)
    retired_reap(set);
}

/* Waits up to ms for any peer's socket to become readable (or sleeps that
 * long when there are none). */
static void peers_wait(gpuipc_tset *set, int ms) {
  int fds[64];
  size_t n = gpuipc_tset_get_wait_fds(set, fds, 64);
  if (n == 0) {
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
    return;
  }
  struct pollfd pf[64];
  if (n > 64)
    n = 64;
  for (size_t i = 0; i < n; i++)
    pf[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
  (void)poll(pf, (nfds_t)n, ms);
}

static bool past(uint64_t deadline) {
  return deadline != UINT64_MAX && gpuipc__now_ns() >= deadline;
}

static uint64_t deadline_of(int timeout_ms) {
  return timeout_ms < 0 ? UINT64_MAX
                        : gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

/* Whether `since` (ns) is hold_ms ago or more; never without a limit. */
static bool held_too_long(const gpuipc_tset *set, uint64_t since) {
  return set->hold_ms >= 0 &&
         gpuipc__now_ns() - since >= (uint64_t)set->hold_ms * 1000000ull;
}

/* ---- creating ------------------------------------------------------------------- */

static gpuipc_status bad_entry(size_t i, const char *name, const char *why) {
  return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: tensor %zu "
                      "(%.64s): %s", i, name ? name : "(no name)", why);
}

/* Fills the table's entries from the caller's tensors (pieces and offsets
 * are set later). */
static gpuipc_status fill_entries(gpuipc_tset *set, const gpuipc_tensor *ts,
                                  size_t n) {
  gpuipc__tset_table *t = &set->tab;
  size_t names = 0;
  for (size_t i = 0; i < n; i++) {
    if (ts[i].name == NULL)
      return bad_entry(i, NULL, "no name");
    size_t l = strnlen(ts[i].name, GPUIPC_TSET_NAME_MAX + 1);
    if (l == 0 || l > GPUIPC_TSET_NAME_MAX)
      return bad_entry(i, ts[i].name, "name of 0 or more than "
                       "GPUIPC_TSET_NAME_MAX bytes");
    names += l + 1;
  }
  t->n_entries = (uint32_t)n;
  t->e = calloc(n, sizeof *t->e);
  t->names = malloc(names);
  if (t->e == NULL || t->names == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create: %zu tensors", n);
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    const gpuipc_tensor *x = &ts[i];
    gpuipc__tset_entry *e = &t->e[i];
    size_t l = strlen(x->name);
    memcpy(t->names + off, x->name, l + 1);
    e->name_off = (uint32_t)off;
    e->name_len = (uint16_t)l;
    off += l + 1;
    if (gpuipc_dtype_get_size(x->dtype) == 0)
      return bad_entry(i, x->name, "unknown dtype");
    if (x->ndim < 0 || x->ndim > GPUIPC_TSET_NDIM_MAX)
      return bad_entry(i, x->name, "ndim not in 0..GPUIPC_TSET_NDIM_MAX");
    if (x->ndim > 0 && x->shape == NULL)
      return bad_entry(i, x->name, "no shape");
    e->dtype = (uint8_t)x->dtype;
    e->ndim = (uint8_t)x->ndim;
    int64_t stride = 1;
    bool big = false;
    for (int d = x->ndim - 1; d >= 0; d--) {
      if (x->shape[d] < 0)
        return bad_entry(i, x->name, "negative size");
      e->shape[d] = x->shape[d];
      if (x->strides) {
        if (x->strides[d] < 0)
          return bad_entry(i, x->name, "negative stride");
        e->strides[d] = x->strides[d];
      } else {
        e->strides[d] = stride;
        if (x->shape[d] > 1 && stride > ((int64_t)1 << 62) / x->shape[d])
          big = true;
        else if (x->shape[d] > 1)
          stride *= x->shape[d];
      }
    }
    if (big)
      return bad_entry(i, x->name, "larger than 2^62 bytes");
    if (gpuipc__tset_extent(e->dtype, e->ndim, e->shape, e->strides,
                            &e->nbytes) != GPUIPC_OK)
      return bad_entry(i, x->name, gpuipc_last_error());
  }
  t->names_len = off;
  return GPUIPC_OK;
}

/* Owned: the tensors in order, each aligned, in one piece per copy. */
static gpuipc_status place_owned(gpuipc_tset *set, size_t align) {
  gpuipc__tset_table *t = &set->tab;
  uint64_t pos = 0;
  for (uint32_t i = 0; i < t->n_entries; i++) {
    pos = (pos + align - 1) & ~(uint64_t)(align - 1);
    t->e[i].piece = 0;
    t->e[i].offset = pos;
    pos += t->e[i].nbytes;
  }
  t->n_pieces = 1;
  t->piece_len = malloc(sizeof *t->piece_len);
  if (t->piece_len == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create");
  t->piece_len[0] = pos ? (pos + 255) & ~(uint64_t)255 : 256;
  return GPUIPC_OK;
}

/* Wrapped: each tensor's allocation is found (gpuipc_buffer_wrap), and
 * each distinct allocation becomes a piece wrapped whole. */
static gpuipc_status place_wrapped(gpuipc_tset *set, const gpuipc_tensor *ts) {
  gpuipc__tset_table *t = &set->tab;
  size_t cap = 8;
  CUdeviceptr *bases = malloc(cap * sizeof *bases);
  t->piece_len = malloc(cap * sizeof *t->piece_len);
  set->piece_buf = calloc(cap, sizeof *set->piece_buf);
  if (!bases || !t->piece_len || !set->piece_buf) {
    free(bases);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create");
  }
  gpuipc_status s = GPUIPC_OK;
  uint32_t np = 0;
  set->ordinal = -1;
  for (uint32_t i = 0; i < t->n_entries && s == GPUIPC_OK; i++) {
    gpuipc__tset_entry *e = &t->e[i];
    if (e->nbytes == 0)
      continue; /* placed below, at offset 0 of piece 0 */
    gpuipc_buffer *w = NULL;
    s = gpuipc_buffer_wrap(ts[i].ptr, (size_t)e->nbytes, &w);
    if (s != GPUIPC_OK) {
      s = bad_entry(i, ts[i].name, gpuipc_last_error());
      break;
    }
    gpuipc__buffer_info info;
    s = gpuipc__buffer_info_get(w, &info);
    gpuipc_buffer_free(w, NULL);
    if (s != GPUIPC_OK)
      break;
    if (set->ordinal >= 0 && info.ordinal != set->ordinal) {
      s = bad_entry(i, ts[i].name, "on another device than the first tensor");
      break;
    }
    set->ordinal = info.ordinal;
    uint32_t p = 0;
    while (p < np && bases[p] != info.base)
      p++;
    if (p == np) {
      if (np == GPUIPC_TSET_PIECES_MAX) {
        s = bad_entry(i, ts[i].name, "more than GPUIPC_TSET_PIECES_MAX "
                      "allocations");
        break;
      }
      if (np == cap) {
        /* Three arrays under one capacity (not gpuipc__grow's one). */
        cap *= 2;
        CUdeviceptr *nb = realloc(bases, cap * sizeof *bases);
        if (nb)
          bases = nb;
        uint64_t *nl = realloc(t->piece_len, cap * sizeof *nl);
        if (nl)
          t->piece_len = nl;
        gpuipc_buffer **nw = realloc(set->piece_buf, cap * sizeof *nw);
        if (nw)
          set->piece_buf = nw;
        if (!nb || !nl || !nw) {
          s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create");
          break;
        }
      }
      s = gpuipc_buffer_wrap((void *)(uintptr_t)info.base, info.alloc_size,
                             &set->piece_buf[np]);
      if (s != GPUIPC_OK)
        break;
      bases[np] = info.base;
      t->piece_len[np] = info.alloc_size;
      np++;
    }
    e->piece = p;
    e->offset = (uint64_t)((CUdeviceptr)(uintptr_t)ts[i].ptr - bases[p]);
  }
  t->n_pieces = np;
  if (s == GPUIPC_OK && np == 0)
    s = gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: a wrapped set "
                     "of empty tensors only (make it owned)");
  if (s == GPUIPC_OK) {
    set->piece_ptr = malloc(np * sizeof *set->piece_ptr);
    if (set->piece_ptr == NULL)
      s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create");
    else
      memcpy(set->piece_ptr, bases, np * sizeof *bases);
  }
  free(bases);
  return s;
}

gpuipc_status gpuipc_tset_create(const gpuipc_tensor *tensors, size_t n,
                                 const gpuipc_tset_options *opts,
                                 gpuipc_tset **out) {
  if (out == NULL || (tensors == NULL && n))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: NULL");
  *out = NULL;
  if (n == 0 || n > GPUIPC_TSET_ENTRIES_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: %zu tensors "
                        "(1 to %u)", n, GPUIPC_TSET_ENTRIES_MAX);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  GPUIPC__CHECK(gpuipc__options_copy(&o, sizeof o, opts,
                                     offsetof(gpuipc_tset_options, copies) +
                                         sizeof o.copies,
                                     "gpuipc_tset_options",
                                     "GPUIPC_TSET_OPTIONS_INIT"));
  bool wrapped = tensors[0].ptr != NULL;
  for (size_t i = 1; i < n; i++)
    if ((tensors[i].ptr != NULL) != wrapped)
      return bad_entry(i, tensors[i].name, "owned and wrapped tensors mixed "
                       "(every ptr NULL, or none)");
  if (o.copies < 1 || o.copies > 2 || (wrapped && o.copies != 1))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: %d copies "
                        "(1 or 2; a wrapped set has 1)", o.copies);
  if (o.hold_ms < -1 || o.retired_max < 0 || o.retired_max > 64)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: hold_ms %d "
                        "(-1 or more), retired_max %d (0 to 64)", o.hold_ms,
                        o.retired_max);
  if (o.align < 16 || (o.align & (o.align - 1)) || o.align > ((size_t)1 << 20))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: align %zu "
                        "(a power of two, 16 to 1 MiB)", o.align);
  GPUIPC__CHECK(gpuipc__driver());
  grave_reap();
  gpuipc_tset *set = calloc(1, sizeof *set);
  if (set == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create");
  set->wrapped = wrapped;
  set->copies = o.copies;
  set->latest = -1;
  set->writing = -1;
  set->timeout_ms = o.timeout_ms;
  set->hold_ms = o.hold_ms;
  set->retired_max = o.retired_max;
  set->tab.copies = (uint32_t)o.copies;
  set->tab.layout_id = new_layout_id();
  gpuipc_status s = fill_entries(set, tensors, n);
  if (s != GPUIPC_OK)
    goto fail;
  if (wrapped) {
    s = place_wrapped(set, tensors);
  } else {
    s = gpuipc__resolve_device(o.device, 0, &set->ordinal);
    if (s == GPUIPC_OK)
      s = place_owned(set, o.align);
  }
  if (s != GPUIPC_OK)
    goto fail;
  s = gpuipc__tset_table_encode(&set->tab, &set->table, &set->table_len);
  if (s != GPUIPC_OK) {
    s = gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_create: %s",
                     gpuipc_last_error());
    goto fail;
  }
  /* The memory: the caller's arena, or one of our own sized to fit. */
  set->arena = o.arena;
  if (set->arena == NULL) {
    gpuipc_uuid dev;
    s = gpuipc_device_uuid(set->ordinal, &dev);
    if (s != GPUIPC_OK)
      goto fail;
    gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
    ao.device = &dev;
    ao.chunk_bytes = wrapped ? (size_t)1 << 20
                             : (size_t)set->tab.piece_len[0] + ((size_t)1 << 20);
    /* (a piece above 4 GiB: a VMM chunk, see gpuipc__arena_mempool_max) */
    s = gpuipc_arena_create(&ao, &set->own_arena);
    if (s != GPUIPC_OK)
      goto fail;
    set->arena = set->own_arena;
  }
  if (!wrapped) {
    set->piece_ptr = malloc((size_t)set->copies * sizeof *set->piece_ptr);
    if (set->piece_ptr == NULL) {
      s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_create");
      goto fail;
    }
    for (int c = 0; c < set->copies; c++) {
      s = gpuipc_arena_alloc(set->arena, (size_t)set->tab.piece_len[0], NULL,
                             &set->piece_blk[c]);
      if (s != GPUIPC_OK)
        goto fail;
      set->piece_ptr[c] =
          (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(set->piece_blk[c]);
    }
  }
  for (int c = 0; c < set->copies; c++) {
    s = gpuipc_arena_alloc(set->arena, 256, NULL, &set->token[c]);
    if (s != GPUIPC_OK)
      goto fail;
  }
  s = gpuipc_arena_alloc(set->arena, 256, NULL, &set->ctl);
  if (s != GPUIPC_OK)
    goto fail;
  *out = set;
  return GPUIPC_OK;
fail:
  set->npeers = 0;
  set->timeout_ms = 0;
  (void)gpuipc_tset_destroy(set);
  return s;
}

/* ---- destroying ---------------------------------------------------------------------- */

static void send_end(gpuipc_tset *set, gpuipc__tset_peer *p, uint32_t why) {
  gpuipc__tset_meta m = {GPUIPC__TSET_END, set->tab.layout_id, 0, why, 0};
  uint8_t meta[GPUIPC__TSET_META_LEN];
  gpuipc__tset_meta_encode(&m, meta);
  p->ended = true;
  p->ended_ns = gpuipc__now_ns();
  gpuipc_status s = gpuipc_conn_send(p->conn, set->ctl, NULL, meta, sizeof meta);
  if (s != GPUIPC_OK && s != GPUIPC_E_PEER_GONE && s != GPUIPC_E_CLOSED)
    GPUIPC__WARN(MOD, "set %llx: telling a subscriber it ended: %s",
                 (unsigned long long)set->tab.layout_id, gpuipc_last_error());
}

gpuipc_status gpuipc_tset_destroy(gpuipc_tset *set) {
  if (set == NULL)
    return GPUIPC_OK;
  for (size_t i = 0; i < set->npeers; i++)
    if (!set->peers[i].ended)
      send_end(set, &set->peers[i], GPUIPC__TSET_END_UNSUBSCRIBED);
  uint64_t deadline = deadline_of(set->timeout_ms);
  for (;;) {
    peers_progress(set);
    if (set->npeers == 0)
      break;
    /* An owned set lets go of consumers that held on past the hold limit:
     * what they hold stays leased (the frees below are deferred). */
    bool all_late = !set->wrapped;
    for (size_t i = 0; i < set->npeers && all_late; i++)
      all_late = held_too_long(set, set->peers[i].ended_ns);
    if (all_late) {
      GPUIPC__DEBUG(MOD, "set %llx: destroyed while %zu consumer(s) still "
                    "hold parts of it (freed when they release or die)",
                    (unsigned long long)set->tab.layout_id, set->npeers);
      set->npeers = 0;
      break;
    }
    if (past(deadline))
      return gpuipc__fail(GPUIPC_E_BUSY, "gpuipc_tset_destroy: %zu "
                          "subscriber(s) still hold versions or pieces of the "
                          "set", set->npeers);
    peers_wait(set, 1);
  }
  for (int c = 0; c < 2; c++) {
    gpuipc_block_free(set->piece_blk[c], NULL);
    gpuipc_block_free(set->token[c], NULL);
  }
  gpuipc_block_free(set->ctl, NULL);
  for (size_t i = 0; i < set->nretired; i++) {
    gpuipc_block_free(set->retired[i].piece, NULL);
    gpuipc_block_free(set->retired[i].token, NULL);
  }
  free(set->retired);
  if (set->piece_buf)
    for (uint32_t p = 0; p < set->tab.n_pieces; p++)
      gpuipc_buffer_free(set->piece_buf[p], NULL);
  gpuipc_status s = gpuipc_arena_destroy(set->own_arena);
  if (s != GPUIPC_OK) {
    /* Consumers still hold some of it (or their GPUs have not written
     * their releases yet): it goes later. */
    if (grave_add(set->own_arena))
      GPUIPC__DEBUG(MOD, "set %llx: its arena goes later: %s",
                    (unsigned long long)set->tab.layout_id,
                    gpuipc_last_error());
    else
      GPUIPC__WARN(MOD, "set %llx: its arena: %s",
                   (unsigned long long)set->tab.layout_id, gpuipc_last_error());
  }
  grave_reap();
  free(set->piece_buf);
  free(set->piece_ptr);
  free(set->peers);
  free(set->table);
  gpuipc__tset_table_free(&set->tab);
  free(set);
  return GPUIPC_OK;
}

/* ---- accessors --------------------------------------------------------------------- */

size_t gpuipc_tset_get_count(const gpuipc_tset *set) {
  return set ? set->tab.n_entries : 0;
}
int gpuipc_tset_get_copies(const gpuipc_tset *set) {
  return set ? set->copies : 0;
}
uint64_t gpuipc_tset_get_layout(const gpuipc_tset *set) {
  return set ? set->tab.layout_id : 0;
}
uint64_t gpuipc_tset_get_version(const gpuipc_tset *set) {
  return set ? set->version : 0;
}
size_t gpuipc_tset_get_subscribers(const gpuipc_tset *set) {
  return set ? set->npeers : 0;
}

size_t gpuipc_tset_get_wait_fds(const gpuipc_tset *set, int *fds, size_t max) {
  size_t n = 0;
  for (size_t i = 0; set != NULL && i < set->npeers; i++) {
    int fd = gpuipc_conn_get_fd(set->peers[i].conn);
    if (fd < 0)
      continue;
    if (fds != NULL && n < max)
      fds[n] = fd;
    n++;
  }
  return n;
}

gpuipc_status gpuipc_tset_get_tensor(const gpuipc_tset *set, int copy, size_t i,
                                     gpuipc_tensor *out) {
  if (set == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_get_tensor: NULL");
  if (copy < 0 || copy >= set->copies || i >= set->tab.n_entries)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_get_tensor: copy %d "
                        "of %d, tensor %zu of %u", copy, set->copies, i,
                        set->tab.n_entries);
  const gpuipc__tset_entry *e = &set->tab.e[i];
  out->name = set->tab.names + e->name_off;
  out->dtype = e->dtype;
  out->ndim = e->ndim;
  out->shape = e->shape;
  out->strides = e->strides;
  out->ptr = (void *)(uintptr_t)(
      set->piece_ptr[(size_t)copy * set->tab.n_pieces + e->piece] + e->offset);
  out->nbytes = (size_t)e->nbytes;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_tset_find(const gpuipc_tset *set, const char *name,
                               size_t *index) {
  if (set == NULL || name == NULL || index == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_find: NULL");
  long i = gpuipc__tset_table_find(&set->tab, name, strlen(name));
  if (i < 0)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND, "no tensor named \"%.64s\"", name);
  *index = (size_t)i;
  return GPUIPC_OK;
}

/* ---- subscribers ------------------------------------------------------------------------ */

static gpuipc_status send_version(gpuipc_tset *set, gpuipc_conn *conn,
                                  CUstream stream) {
  gpuipc__tset_meta m = {GPUIPC__TSET_VERSION_TOKEN, set->tab.layout_id,
                         set->version, (uint32_t)set->latest, 0};
  uint8_t meta[GPUIPC__TSET_META_LEN];
  gpuipc__tset_meta_encode(&m, meta);
  return gpuipc_conn_send(conn, set->token[set->latest],
                          (struct CUstream_st *)stream, meta, sizeof meta);
}

/* GPUIPC_OK while some of subscribe's deadline is left. */
static gpuipc_status sub_wait_next(gpuipc__tset_wait *w) {
  if (gpuipc__tset_wait_next(w))
    return GPUIPC_OK;
  return gpuipc__fail(GPUIPC_E_TIMEOUT, "gpuipc_tset_subscribe: the consumer "
                      "took less than the table and pieces within the "
                      "connection's timeout (%d ms)", w->timeout_ms);
}

gpuipc_status gpuipc_tset_subscribe(gpuipc_tset *set, gpuipc_conn *conn,
                                    struct CUstream_st *stream) {
  if (set == NULL || conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_subscribe: NULL");
  if (peer_find(set, conn) >= 0)
    return gpuipc__fail(GPUIPC_E_EXISTS, "gpuipc_tset_subscribe: connection "
                        "subscribed already");
  gpuipc__tset_peer *p = gpuipc__grow(set->peers, &set->peers_cap,
                                      set->npeers + 1, sizeof *p, 4);
  if (p == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_subscribe");
  set->peers = p;
  gpuipc_status s = GPUIPC_OK;
  /* The table, in chunk messages. */
  uint8_t *msg = malloc(GPUIPC_CONN_MSG_MAX);
  if (msg == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_subscribe");
  /* Every send below waits for the consumer at most what is left of one
   * deadline, the connection's timeout from now. */
  gpuipc__tset_wait w;
  gpuipc__tset_wait_begin(&w, conn);
  size_t pos = 0;
  for (uint32_t k = 0; pos < set->table_len && s == GPUIPC_OK &&
                       (s = sub_wait_next(&w)) == GPUIPC_OK;
       k++) {
    size_t n = set->table_len - pos;
    if (n > GPUIPC__TSET_CHUNK_DATA)
      n = GPUIPC__TSET_CHUNK_DATA;
    uint32_t hdr[2] = {GPUIPC__TSET_CHUNK_MAGIC, k};
    uint64_t lid = set->tab.layout_id;
    for (int i = 0; i < 4; i++) {
      msg[i] = (uint8_t)(hdr[0] >> (8 * i));
      msg[4 + i] = (uint8_t)(hdr[1] >> (8 * i));
    }
    for (int i = 0; i < 8; i++)
      msg[8 + i] = (uint8_t)(lid >> (8 * i));
    memcpy(msg + GPUIPC__TSET_CHUNK_HDR, set->table + pos, n);
    s = gpuipc_conn_send_msg(conn, msg, GPUIPC__TSET_CHUNK_HDR + n, NULL, 0);
    pos += n;
  }
  free(msg);
  /* The pieces of every copy. */
  uint32_t np = set->tab.n_pieces, total = np * (uint32_t)set->copies;
  for (uint32_t i = 0; i < total && s == GPUIPC_OK &&
                       (s = sub_wait_next(&w)) == GPUIPC_OK;
       i++) {
    gpuipc__tset_meta m = {GPUIPC__TSET_PIECE, set->tab.layout_id, i, total,
                           (uint32_t)set->table_len};
    uint8_t meta[GPUIPC__TSET_META_LEN];
    gpuipc__tset_meta_encode(&m, meta);
    if (set->wrapped)
      s = gpuipc_conn_send_buffer(conn, set->piece_buf[i], stream, meta,
                                  sizeof meta);
    else
      s = gpuipc_conn_send(conn, set->piece_blk[i / np], stream, meta,
                           sizeof meta);
  }
  /* A late joiner starts at the latest version (not one being rewritten). */
  if (s == GPUIPC_OK && set->latest >= 0 && set->writing != set->latest &&
      (s = sub_wait_next(&w)) == GPUIPC_OK &&
      (s = send_version(set, conn, (CUstream)stream)) == GPUIPC_OK &&
      !set->rejoined[set->latest]) {
    /* Its hold limit counts from now, not from a publish that may lie
     * longer ago than the limit (a subscriber that took a second to start
     * would find its first version written over while it reads it). Once
     * per version: joiners that keep coming cannot hold a copy longer
     * than twice the limit. */
    set->pub_ns[set->latest] = gpuipc__now_ns();
    set->rejoined[set->latest] = true;
  }
  gpuipc__tset_wait_end(&w);
  if (s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED)
    return s;
  /* Whatever was sent must drain before the set lets go of conn. */
  set->peers[set->npeers++] =
      (gpuipc__tset_peer){conn, s != GPUIPC_OK, gpuipc__now_ns()};
  return s;
}

gpuipc_status gpuipc_tset_unsubscribe(gpuipc_tset *set, gpuipc_conn *conn) {
  if (set == NULL || conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_unsubscribe: NULL");
  long i = peer_find(set, conn);
  if (i < 0)
    return gpuipc__fail(GPUIPC_E_NOT_FOUND, "gpuipc_tset_unsubscribe: "
                        "connection not subscribed");
  if (!set->peers[i].ended)
    send_end(set, &set->peers[i], GPUIPC__TSET_END_UNSUBSCRIBED);
  uint64_t deadline = deadline_of(set->timeout_ms);
  for (;;) {
    peers_progress(set);
    i = peer_find(set, conn);
    if (i < 0)
      return GPUIPC_OK;
    if (!set->wrapped && held_too_long(set, set->peers[i].ended_ns)) {
      /* Past the hold limit: the set lets go of conn. What the consumer
       * holds stays leased on conn (and on its orphaned table once conn
       * closes) until it releases or dies; a copy it holds is retired by
       * the next begin that needs it. */
      GPUIPC__DEBUG(MOD, "set %llx: a consumer unsubscribed while it still "
                    "holds parts of the set", (unsigned long long)
                    set->tab.layout_id);
      peer_drop(set, (size_t)i);
      return GPUIPC_OK;
    }
    if (past(deadline))
      return gpuipc__fail(GPUIPC_E_TIMEOUT, "gpuipc_tset_unsubscribe: the "
                          "consumer still holds versions or pieces of the set");
    peers_wait(set, 1);
  }
}

/* ---- versions ------------------------------------------------------------------------------- */

/* Ends the subscriptions (END, why: held) of every subscriber holding any
 * of the n blocks, or whose release of one has not completed on the GPU;
 * returns how many. */
static size_t drop_holders(gpuipc_tset *set, gpuipc_block *const *blks,
                           size_t n) {
  size_t dropped = 0;
  for (size_t i = 0; i < set->npeers; i++) {
    gpuipc__tset_peer *p = &set->peers[i];
    if (p->ended)
      continue;
    for (size_t k = 0; k < n; k++)
      if (gpuipc__conn_block_holders(p->conn, blks[k]) > 0 ||
          gpuipc__conn_block_releasing(p->conn, blks[k])) {
        GPUIPC__DEBUG(MOD, "set %llx: a subscriber held a copy past the hold "
                      "limit (%d ms): dropped",
                      (unsigned long long)set->tab.layout_id, set->hold_ms);
        send_end(set, p, GPUIPC__TSET_END_HELD);
        dropped++;
        break;
      }
  }
  return dropped;
}

/* Copy c is held past the hold limit (or a release of it has not
 * completed by then): puts a fresh token in its place, and, for an owned
 * set with room under retired_max, a fresh piece too, announced to the
 * subscribers on stream (the held one is set aside). Otherwise (a wrapped
 * set, or the cap full) the copy is written in place once its holders
 * are dropped: nothing waits for them. */
static gpuipc_status retire(gpuipc_tset *set, int c, CUstream stream) {
  unsigned holders = gpuipc_block_get_holders(set->token[c]);
  bool in_place =
      set->wrapped || retired_owned(set) >= (size_t)set->retired_max;
  gpuipc__tset_retired *r = gpuipc__grow(set->retired, &set->retired_cap,
                                         set->nretired + 1, sizeof *r, 4);
  if (r == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_begin");
  set->retired = r;
  gpuipc_block *piece = NULL, *token = NULL;
  gpuipc_status s = gpuipc_arena_alloc(set->arena, 256,
                                       (struct CUstream_st *)stream, &token);
  if (s == GPUIPC_OK && !in_place)
    s = gpuipc_arena_alloc(set->arena, (size_t)set->tab.piece_len[0],
                           (struct CUstream_st *)stream, &piece);
  if (s != GPUIPC_OK) {
    gpuipc_block_free(token, NULL);
    return gpuipc__fail(s, "gpuipc_tset_begin: copy %d is held by %u "
                        "consumer(s) past the hold limit (%d ms), and a fresh "
                        "copy could not be made: %s", c, holders, set->hold_ms,
                        gpuipc_last_error());
  }
  GPUIPC__DEBUG(MOD, "set %llx: copy %d held by %u consumer(s) past the hold "
                "limit (or its release not complete): %s",
                (unsigned long long)set->tab.layout_id, c, holders,
                in_place ? "written in place" : "retired");
  gpuipc_block *old_token = set->token[c];
  set->retired[set->nretired++] =
      (gpuipc__tset_retired){in_place ? NULL : set->piece_blk[c], old_token};
  set->token[c] = token;
  set->gen[c]++;
  /* Its holders get nothing more (so hold nothing more than what they
   * have: at most one version per copy). Written in place, their views of
   * it are not protected any more: the releases that completed need no
   * wait, and those that did not count as held past the limit (waiting
   * behind them is what a consumer whose GPU work never ends would stall
   * the producer with). */
  (void)drop_holders(set, &old_token, 1);
  if (in_place)
    return GPUIPC_OK;
  set->piece_blk[c] = piece;
  set->piece_ptr[c] = (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(piece);
  uint32_t total = (uint32_t)set->copies;
  gpuipc__tset_meta m = {GPUIPC__TSET_REPLACE, set->tab.layout_id,
                         (uint64_t)c, total, set->gen[c]};
  uint8_t meta[GPUIPC__TSET_META_LEN];
  gpuipc__tset_meta_encode(&m, meta);
  for (size_t i = 0; i < set->npeers;) {
    gpuipc__tset_peer *p = &set->peers[i];
    if (p->ended) {
      i++;
      continue;
    }
    s = gpuipc_conn_send(p->conn, piece, (struct CUstream_st *)stream, meta,
                         sizeof meta);
    if (s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED) {
      peer_drop(set, i);
      continue;
    }
    if (s != GPUIPC_OK) {
      /* It would read later versions of copy c in the old piece. */
      GPUIPC__WARN(MOD, "set %llx: announcing copy %d's new piece: %s (the "
                   "subscriber is dropped)", (unsigned long long)
                   set->tab.layout_id, c, gpuipc_last_error());
      send_end(set, p, GPUIPC__TSET_END_HELD);
    }
    i++;
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc_tset_begin(gpuipc_tset *set, struct CUstream_st *stream,
                                int *copy) {
  if (set == NULL || copy == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_begin: NULL");
  if (set->writing >= 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_begin: copy %d is "
                        "begun already (publish it first)", set->writing);
  int c = set->copies == 1 ? 0 : (set->latest + 1) % set->copies;
  uint64_t deadline = deadline_of(set->timeout_ms);
  for (;;) {
    peers_progress(set);
    /* Free when no one holds it and every release of it completed on the
     * GPU: then nothing is left to order the stream after. A release
     * still running is waited for here, on the host, not queued behind
     * on the stream: one that never completes (a consumer's hung kernel,
     * or a release it announced without its GPU write) must not hold the
     * producer past the hold limit. */
    if (!block_busy(set->token[c]))
      break;
    if (held_too_long(set, set->pub_ns[c])) {
      GPUIPC__CHECK(retire(set, c, (CUstream)stream));
      *copy = c;
      set->writing = c;
      return GPUIPC_OK; /* a fresh copy, or this one: nothing to wait for */
    }
    if (past(deadline)) {
      unsigned h = gpuipc_block_get_holders(set->token[c]);
      if (h == 0)
        return gpuipc__fail(GPUIPC_E_TIMEOUT, "gpuipc_tset_begin: copy %d "
                            "was released, but the consumers' GPU work "
                            "before the release has not completed", c);
      return gpuipc__fail(GPUIPC_E_TIMEOUT, "gpuipc_tset_begin: copy %d is "
                          "still held by %u consumer(s)", c, h);
    }
    peers_wait(set, 1);
  }
  set->writing = c;
  *copy = c;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_tset_copy_from(gpuipc_tset *set, int copy,
                                    void *const *srcs,
                                    struct CUstream_st *stream) {
  if (set == NULL || srcs == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_copy_from: NULL");
  if (set->wrapped || copy < 0 || copy >= set->copies)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_copy_from: copy %d "
                        "of %s set of %d", copy,
                        set->wrapped ? "a wrapped" : "an owned", set->copies);
  size_t n = set->tab.n_entries;
  CUdeviceptr *s = malloc(n * sizeof *s), *d = malloc(n * sizeof *d);
  uint64_t *l = malloc(n * sizeof *l);
  gpuipc_status st = GPUIPC_OK;
  if (!s || !d || !l) {
    st = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_tset_copy_from");
  } else {
    CUdeviceptr base = set->piece_ptr[copy];
    for (size_t i = 0; i < n; i++) {
      s[i] = (CUdeviceptr)(uintptr_t)srcs[i];
      d[i] = base + set->tab.e[i].offset;
      l[i] = set->tab.e[i].nbytes;
    }
    st = gpuipc__tset_copy(set->ordinal, s, d, l, n, (CUstream)stream);
  }
  free(s);
  free(d);
  free(l);
  return st;
}

gpuipc_status gpuipc_tset_publish(gpuipc_tset *set, struct CUstream_st *stream) {
  if (set == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_publish: NULL");
  if (set->writing < 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_tset_publish: no copy "
                        "begun (gpuipc_tset_begin first)");
  set->version++;
  set->latest = set->writing;
  set->writing = -1;
  set->pub_ns[set->latest] = gpuipc__now_ns();
  set->rejoined[set->latest] = false;
  gpuipc_status first = GPUIPC_OK;
  char why[256] = "";
  for (size_t i = 0; i < set->npeers;) {
    if (set->peers[i].ended) {
      i++;
      continue;
    }
    gpuipc_status s = send_version(set, set->peers[i].conn, (CUstream)stream);
    if (s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED) {
      peer_drop(set, i);
      continue;
    }
    if (s != GPUIPC_OK && first == GPUIPC_OK) {
      first = s;
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
    }
    i++;
  }
  if (first != GPUIPC_OK)
    return gpuipc__fail(first, "gpuipc_tset_publish: version %llu: %s",
                        (unsigned long long)set->version, why);
  return GPUIPC_OK;
}
