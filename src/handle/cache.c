/*
 * cache.c: owns the per-process import cache: imported mappings, keyed by
 * exporter + allocation and reference counted, and imported exporter pools,
 * keyed by exporter + pool id and kept while their exporter lives (one
 * whose exporter is gone is destroyed once nothing imported here holds it).
 *
 * Why it exists and why it validates every hit:
 * - The driver maps a legacy handle once per process however often it is
 *   opened (it counts the opens: one cuIpcCloseMemHandle per open), and
 *   imports a pool pointer once; gpuipc must hand back the same mapping and
 *   close it once, when its last user closes.
 * - Pool imports are expensive (~170 us, ~13 ms across GPUs): once per
 *   exporter pool, cuMemPoolSetAccess once per (pool, device).
 * - The driver returns stale memory for freed pointers, and a legacy handle
 *   of a new allocation at a freed one's address can have the very same
 *   bytes. So a cached entry is only reused when the descriptor's buffer id
 *   (the driver's CU_POINTER_ATTRIBUTE_BUFFER_ID at the exporter: identity
 *   only, the importer's mapping shows its own ids on driver 580) and
 *   generation (gpuipc's per-allocation counter at the exporter) both match;
 *   otherwise the entry is retired (its holders keep it; nobody new gets it)
 *   and the descriptor is opened anew. Whether the exporter freed the
 *   allocation is asked of its liveness table before the cache is consulted
 *   (gpuipc_buffer_import); a hit also re-reads the mapping's local buffer
 *   id, recorded when it was opened, so a mapping replaced under the cache
 *   is never handed out.
 * Linger: a mapping whose last reference goes is kept, idle, for a bounded
 * time and count (GPUIPC_IMPORT_LINGER_MS, default 100; _MAX, default 64;
 * 0 turns it off), so that the next import of the same allocation (a
 * producer that sends from the same memory again and again) costs no
 * driver open and close. An idle mapping is never handed out unchecked: a
 * hit on it is the same validated hit as on a held one. It is closed when
 * its time is up (by a reaper thread, or by the next cache call), when
 * more than the count are idle (oldest first), as soon as the exporter's
 * liveness table says the allocation was freed (kinds with a generation)
 * or the exporter is gone, when a descriptor with the same key names
 * another allocation, and before a miss opens memory of the same exporter
 * on the same device for the kinds whose driver hands back an existing
 * mapping of the same address (they have a forget).
 * Concurrency: one mutex guards the tables; driver calls happen outside it.
 * An entry being opened is in state OPENING, and threads that want the same
 * key wait for it, so the same memory is never mapped twice; an entry being
 * closed is in state CLOSING until its close has finished, and a new import
 * of the same memory waits for that too (and, for pool memory, whose
 * second import the driver answers with the first one's mapping, no open
 * overlaps a close on the same device), so no import is ever handed a
 * mapping a close in flight is about to free. Imported pools follow the
 * same states.
 */
#include "handle_int.h"
#include "core/stats.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* OPENING: the kind's open runs (without the lock); LIVE: usable;
 * CLOSING: its last reference went and the kind's close runs (without the
 * lock). An entry stays in the list, findable by its key, until its close
 * has finished, so that a new import of the same memory waits for it
 * instead of being handed, by the driver, the very mapping that close is
 * about to free. */
enum { ST_OPENING = 1, ST_LIVE = 2, ST_CLOSING = 3 };

/* What identifies one mapping: the exporter, the handle kind, the local
 * device it is mapped on, and the allocation (handle bytes for the kinds
 * named by their handle, which the driver maps once however often it is
 * opened; the generation for the kinds named by their fd, whose fds are
 * per allocation). */
typedef struct map_key {
  gpuipc__identity exporter;
  uint8_t kind;
  int map_ordinal;
  uint64_t pool_id;
  uint8_t bytes[64];
} map_key;

struct gpuipc__mapping {
  map_key key;
  const gpuipc__kind_ops *ops; /* opened and closed with these */
  uint64_t buffer_id;
  uint64_t generation;
  int state;
  bool linked; /* findable by key (false once retired) */
  long refs;
  bool idle;            /* refs 0, kept for a later import (linger) */
  bool no_linger;       /* opened with GPUIPC_IMPORT_NO_CACHE */
  uint64_t idle_since;  /* cache clock (ms) when it became idle */
  uint64_t idle_seq;    /* order of becoming idle (oldest first) */
  gpuipc__desc d;       /* what it was opened from: the liveness checks */
  gpuipc__opened o;
  struct gpuipc__mapping *next; /* all entries: live, opening and retired */
};

struct gpuipc__pool_import {
  gpuipc__identity exporter;
  uint64_t pool_id;
  int home_ordinal;
  CUmemoryPool mp;
  int state;
  long refs;
  bool keep; /* never released: raw imports (interop.c names such a pool by
                its handle's value), or the driver refused to destroy it */
  uint64_t access_mask; /* devices granted access (cuMemPoolSetAccess) */
  pthread_mutex_t access_lock;
  struct gpuipc__pool_import *next;
};

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cache_cond = PTHREAD_COND_INITIALIZER;
static struct gpuipc__mapping *maps;
static struct gpuipc__pool_import *pools;
static gpuipc_cache_stats stats;

/* ---- linger settings, clock and reaper ---------------------------------------- */

static long linger_ms = -1, linger_max = -1; /* -1: not read yet */
static size_t n_idle;
static size_t n_idle_closing; /* idle mappings whose close is under way */
static uint64_t idle_seq_next;
static uint64_t clock_offset; /* tests move the clock (gpuipc__cache_test_advance) */
static bool reaper_started;
static pthread_cond_t reaper_cond;
static pthread_once_t reaper_once = PTHREAD_ONCE_INIT;

GPUIPC__PARAM(linger_ms, "GPUIPC_IMPORT_LINGER_MS", GPUIPC__PARAM_ONCE, "100",
              "milliseconds the import cache keeps a mapping after its last "
              "close (0: close at the last close)")
GPUIPC__PARAM(linger_max, "GPUIPC_IMPORT_LINGER_MAX", GPUIPC__PARAM_ONCE, "64",
              "at most this many idle mappings are kept (0: no linger)")

static long env_long(gpuipc__param *p, long dflt) {
  const char *e = gpuipc__param_get(p);
  if (e == NULL || *e == 0)
    return dflt;
  char *end = NULL;
  long v = strtol(e, &end, 10);
  if (*end != 0 || v < 0 || v > 86400000L) {
    GPUIPC__WARN("handle", "%s=%s: not a count from 0 to 86400000; using %ld",
                 p->name, e, dflt);
    return dflt;
  }
  return v;
}

/* Caller holds cache_lock. */
static void linger_read_locked(void) {
  if (linger_ms < 0)
    linger_ms = env_long(&gpuipc__param_linger_ms, 100);
  if (linger_max < 0)
    linger_max = env_long(&gpuipc__param_linger_max, 64);
}

static uint64_t cache_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u +
         clock_offset;
}

/* A fork while the reaper holds the lock would leave the child's lock
 * held for good: the lock is taken around fork, and the child, which has
 * no reaper, starts one with its next idle mapping. */
static void cache_before_fork(void) { pthread_mutex_lock(&cache_lock); }
static void cache_after_fork_parent(void) { pthread_mutex_unlock(&cache_lock); }
static void cache_after_fork_child(void) {
  reaper_started = false;
  n_idle_closing = 0; /* the thread closing them is not in the child */
  pthread_mutex_unlock(&cache_lock);
}

static void reaper_init(void) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(&reaper_cond, &a);
  pthread_condattr_destroy(&a);
  pthread_atfork(cache_before_fork, cache_after_fork_parent,
                 cache_after_fork_child);
}

void gpuipc__cache_count_open(void) {
  pthread_mutex_lock(&cache_lock);
  stats.driver_opens++;
  pthread_mutex_unlock(&cache_lock);
}
void gpuipc__cache_count_close(void) {
  pthread_mutex_lock(&cache_lock);
  stats.driver_closes++;
  pthread_mutex_unlock(&cache_lock);
}

static void unlink_entry(struct gpuipc__mapping *m);
static bool any_in_state(uint8_t kind, int map_ordinal, int state);
static bool base_shared(const struct gpuipc__mapping *m);
static gpuipc_status close_mapping(struct gpuipc__mapping *m);
static void *reaper_main(void *unused);

/* Closes m, whose last reference went (or an idle one), and frees it.
 * Caller holds cache_lock, which is dropped meanwhile and held again on
 * return. */
static gpuipc_status close_entry_locked(struct gpuipc__mapping *m) {
  bool was_idle = m->idle;
  if (m->idle) {
    m->idle = false;
    n_idle--;
    n_idle_closing++;
  }
  m->state = ST_CLOSING;
  stats.live_mappings--;
  gpuipc__stats_add(GPUIPC__ST_CACHE_LIVE, -1);
  /* A pool pointer imported twice is one mapping in the driver (it can
   * happen when an exporter reallocated at the address of a buffer still
   * held here, or when an open ran while this close): free it once, with
   * the last holder. So no open of such a kind runs on this device while
   * the decision is made and the close runs: the opens in flight finish
   * first (their mapping is then LIVE and shares this base), and new ones
   * wait for the close (see gpuipc__cache_acquire). The kinds whose
   * mappings can be shared so have a forget; legacy opens are counted by
   * the driver, so each entry closes its own. */
  while (m->ops->forget != NULL &&
         any_in_state(m->key.kind, m->key.map_ordinal, ST_OPENING))
    pthread_cond_wait(&cache_cond, &cache_lock);
  bool skip = m->ops->forget != NULL && base_shared(m);
  pthread_mutex_unlock(&cache_lock);
  gpuipc_status s = GPUIPC_OK;
  if (skip)
    m->ops->forget(&m->o);
  else
    s = close_mapping(m);
  pthread_mutex_lock(&cache_lock);
  unlink_entry(m);
  if (was_idle)
    n_idle_closing--;
  pthread_cond_broadcast(&cache_cond);
  free(m);
  return s;
}

/* Why an idle mapping must go now (NULL: it may stay). The cheap reasons
 * (all, off, time, count) on every cache call; deep ones (the exporter's
 * liveness table and death: /proc or a pidfd, shared memory) only in the
 * reaper, gone_cache remembering the last exporter asked. Caller holds
 * cache_lock. */
typedef struct {
  const gpuipc__identity *id;
  bool gone;
} gone_memo;

static const char *idle_verdict(const struct gpuipc__mapping *m, uint64_t now,
                                bool all, gone_memo *deep) {
  if (all)
    return "trimmed";
  if (linger_ms <= 0 || linger_max <= 0)
    return "linger off";
  if (now - m->idle_since >= (uint64_t)linger_ms)
    return "its time is up";
  if (deep == NULL)
    return NULL;
  if (deep->id == NULL || !gpuipc__identity_eq(deep->id, &m->key.exporter)) {
    deep->id = &m->key.exporter;
    deep->gone = gpuipc__exporter_gone(&m->key.exporter);
  }
  if (deep->gone)
    return "its exporter is gone";
  if (m->generation != 0 &&
      gpuipc__generation_state(&m->d, NULL) == GPUIPC__LIVE_FREED)
    return "its exporter freed the allocation";
  return NULL;
}

/* Closes the idle mappings that must go: all of them, or those idle_verdict
 * names, then the oldest while more than the count are idle. Returns the
 * number closed. Caller holds cache_lock (dropped meanwhile). */
static size_t sweep_idle_locked(bool all, bool deep) {
  size_t closed = 0;
  for (;;) {
    if (n_idle == 0)
      return closed;
    uint64_t now = cache_now();
    struct gpuipc__mapping *victim = NULL, *oldest = NULL;
    const char *why = NULL;
    gone_memo memo = {NULL, false};
    for (struct gpuipc__mapping *e = maps; e; e = e->next) {
      if (!e->idle)
        continue;
      if (oldest == NULL || e->idle_seq < oldest->idle_seq)
        oldest = e;
      if ((why = idle_verdict(e, now, all, deep ? &memo : NULL)) != NULL) {
        victim = e;
        break;
      }
    }
    if (victim == NULL && oldest != NULL && linger_max > 0 &&
        n_idle > (size_t)linger_max) {
      victim = oldest;
      why = "more than GPUIPC_IMPORT_LINGER_MAX are idle";
    }
    if (victim == NULL)
      return closed;
    GPUIPC__TRACE("handle", "import cache: closing idle mapping 0x%llx: %s",
                  (unsigned long long)victim->o.base, why);
    stats.linger_drops++;
    (void)close_entry_locked(victim);
    closed++;
  }
}

/* The reaper: closes idle mappings when their time is up (and those the
 * liveness table or the exporter's death lets go), sleeping while none is
 * idle. Started with the first idle mapping. */
static void *reaper_main(void *unused) {
  (void)unused;
  pthread_mutex_lock(&cache_lock);
  for (;;) {
    sweep_idle_locked(false, true);
    if (n_idle == 0) {
      pthread_cond_wait(&reaper_cond, &cache_lock);
      continue;
    }
    uint64_t first = UINT64_MAX;
    for (struct gpuipc__mapping *e = maps; e; e = e->next)
      if (e->idle && e->idle_since < first)
        first = e->idle_since;
    /* Wakes when the oldest is due, and at least every 20 ms to let go
     * early of what the liveness table says freed. */
    uint64_t now = cache_now();
    uint64_t due = first + (uint64_t)(linger_ms > 0 ? linger_ms : 0);
    uint64_t wait = due > now ? due - now : 0;
    if (wait > 20)
      wait = 20;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_nsec += (long)(wait % 1000) * 1000000L;
    t.tv_sec += (time_t)(wait / 1000) + t.tv_nsec / 1000000000L;
    t.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&reaper_cond, &cache_lock, &t);
  }
  return NULL;
}

/* Makes sure a reaper runs (caller holds cache_lock). Without one (the
 * thread could not start) idle mappings go at the next cache call. */
static void reaper_kick_locked(void) {
  pthread_once(&reaper_once, reaper_init);
  if (!reaper_started) {
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &a, reaper_main, NULL) == 0)
      reaper_started = true;
    else
      GPUIPC__INFO("handle", "import cache: no reaper thread: idle mappings "
                             "close at the next cache call");
    pthread_attr_destroy(&a);
  }
  pthread_cond_signal(&reaper_cond);
}

/* The next cache call's share of the reaper's work: only when something is
 * idle and the oldest may be due (or the reaper could not start). */
static void sweep_due_locked(void) {
  if (n_idle == 0)
    return;
  linger_read_locked();
  (void)sweep_idle_locked(false, !reaper_started);
}

static void map_key_of(const gpuipc__desc *d, const gpuipc__kind_ops *ops,
                       int map_ordinal, map_key *k) {
  memset(k, 0, sizeof *k);
  k->exporter = d->exporter;
  k->kind = d->kind;
  k->map_ordinal = map_ordinal;
  if (ops->named_by_handle) {
    k->pool_id = d->pool_id;
    memcpy(k->bytes, d->handle, 64);
  } else {
    /* One fd per allocation: the generation names it. */
    memcpy(k->bytes, &d->generation, sizeof d->generation);
  }
}

static bool key_eq(const map_key *a, const map_key *b) {
  return gpuipc__identity_eq(&a->exporter, &b->exporter) &&
         a->kind == b->kind && a->map_ordinal == b->map_ordinal &&
         a->pool_id == b->pool_id && memcmp(a->bytes, b->bytes, 64) == 0;
}

static void unlink_entry(struct gpuipc__mapping *m) {
  for (struct gpuipc__mapping **pp = &maps; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      return;
    }
}

/* True when an entry of that kind on that device is in `state`. Caller
 * holds cache_lock. */
static bool any_in_state(uint8_t kind, int map_ordinal, int state) {
  for (struct gpuipc__mapping *e = maps; e; e = e->next)
    if (e->state == state && e->key.kind == kind &&
        e->key.map_ordinal == map_ordinal)
      return true;
  return false;
}

/* True when another entry (live or retired) holds a mapping at the same
 * base on the same device. Caller holds cache_lock. */
static bool base_shared(const struct gpuipc__mapping *m) {
  for (struct gpuipc__mapping *e = maps; e; e = e->next)
    if (e != m && e->state == ST_LIVE && e->key.kind == m->key.kind &&
        e->key.map_ordinal == m->key.map_ordinal && e->o.base == m->o.base)
      return true;
  return false;
}

int gpuipc__cache_base_owner(uint8_t kind, int map_ordinal, CUdeviceptr base,
                             const gpuipc__desc *d) {
  int owner = 0;
  pthread_mutex_lock(&cache_lock);
  for (struct gpuipc__mapping *e = maps; e; e = e->next)
    if (e->state == ST_LIVE && e->key.kind == kind &&
        e->key.map_ordinal == map_ordinal && e->o.base == base) {
      bool same = gpuipc__identity_eq(&e->key.exporter, &d->exporter) &&
                  e->buffer_id == d->buffer_id &&
                  e->generation == d->generation;
      owner = same ? 1 : 2;
      if (!same)
        break;
    }
  pthread_mutex_unlock(&cache_lock);
  return owner;
}

/* Opens with the kind's opener in the context of map_ordinal. */
static gpuipc_status open_mapping(const gpuipc__kind_ops *ops,
                                  const gpuipc__desc *d, int map_ordinal,
                                  const int *fds, int nfds, unsigned flags,
                                  gpuipc__opened *o) {
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, map_ordinal));
  gpuipc_status s = ops->open(d, map_ordinal, fds, nfds, flags, o);
  gpuipc__ctx_leave(&g);
  return s;
}

/* Undoes an open with the kind's closer; reports the driver's failure. */
static gpuipc_status close_mapping(struct gpuipc__mapping *m) {
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, m->key.map_ordinal);
  if (s != GPUIPC_OK) {
    /* Without a context nothing can be closed; the mapping stays. */
    if (m->ops->forget)
      m->ops->forget(&m->o);
    return s;
  }
  s = m->ops->close(m->key.map_ordinal, &m->o);
  gpuipc__ctx_leave(&g);
  gpuipc__cache_count_close();
  return s;
}

gpuipc_status gpuipc__cache_acquire(const gpuipc__desc *d, int map_ordinal,
                                    const int *fds, int nfds, unsigned flags,
                                    const gpuipc__kind_ops *ops,
                                    struct gpuipc__mapping **out) {
  map_key key;
  map_key_of(d, ops, map_ordinal, &key);
  bool cacheable = !(flags & GPUIPC_IMPORT_NO_CACHE) || ops->named_by_handle;

  struct gpuipc__mapping *n = NULL;
  pthread_mutex_lock(&cache_lock);
  sweep_due_locked();
  for (;;) {
    struct gpuipc__mapping *e = NULL;
    if (cacheable)
      for (e = maps; e; e = e->next)
        if (e->linked && key_eq(&e->key, &key))
          break;
    /* The kinds whose driver hands back an existing import of the same
     * pointer (they have a forget) open only while no mapping of theirs on
     * this device is being closed: the driver could hand this open the
     * very mapping that close frees. */
    if (e == NULL && ops->forget != NULL &&
        any_in_state(key.kind, map_ordinal, ST_CLOSING)) {
      pthread_cond_wait(&cache_cond, &cache_lock);
      continue;
    }
    /* Nor while an idle mapping of that exporter on this device could be
     * the one the driver hands back (it would be another allocation at its
     * address): close those first. */
    if (e == NULL && ops->forget != NULL) {
      struct gpuipc__mapping *idle = NULL;
      for (idle = maps; idle; idle = idle->next)
        if (idle->idle && idle->key.kind == key.kind &&
            idle->key.map_ordinal == map_ordinal &&
            gpuipc__identity_eq(&idle->key.exporter, &key.exporter))
          break;
      if (idle != NULL) {
        stats.linger_drops++;
        (void)close_entry_locked(idle);
        continue;
      }
    }
    if (e == NULL)
      break;
    if (e->state == ST_OPENING || e->state == ST_CLOSING) {
      pthread_cond_wait(&cache_cond, &cache_lock);
      continue;
    }
    if (e->buffer_id == d->buffer_id && e->generation == d->generation) {
      bool was_idle = e->idle;
      if (was_idle) {
        e->idle = false;
        n_idle--;
      }
      e->refs++;
      pthread_mutex_unlock(&cache_lock);
      /* The mapping must still be the one opened: its local buffer id
       * (read without the lock: a driver call) is unchanged. */
      uint64_t now = 0;
      bool same = e->o.local_id == 0 ||
                  (gpuipc__pointer_buffer_id(e->o.base, &now) == GPUIPC_OK &&
                   now == e->o.local_id);
      pthread_mutex_lock(&cache_lock);
      if (same) {
        stats.hits++;
        if (was_idle)
          stats.linger_hits++;
        gpuipc__stats_add(GPUIPC__ST_CACHE_HITS, 1);
        pthread_mutex_unlock(&cache_lock);
        *out = e;
        GPUIPC__TRACE("handle", "import cache hit: base 0x%llx, %ld refs",
                      (unsigned long long)e->o.base, e->refs);
        return GPUIPC_OK;
      }
      GPUIPC__DEBUG("handle",
                    "import cache: retiring mapping 0x%llx: its local buffer "
                    "id changed from %llu to %llu (replaced under the cache)",
                    (unsigned long long)e->o.base,
                    (unsigned long long)e->o.local_id,
                    (unsigned long long)now);
      if (e->linked) {
        e->linked = false;
        stats.stale++;
        gpuipc__stats_add(GPUIPC__ST_CACHE_STALE, 1);
      }
      pthread_mutex_unlock(&cache_lock);
      (void)gpuipc__cache_release(e);
      pthread_mutex_lock(&cache_lock);
      continue;
    }
    /* Same exporter and handle bytes, another allocation: the exporter
     * freed the buffer we hold and reused its address. Retire the entry:
     * its holders keep their (stale) mapping, nobody new gets it; an idle
     * one, which nobody holds, is closed before the new one opens. */
    GPUIPC__DEBUG("handle",
                  "import cache: retiring stale mapping 0x%llx (buffer id "
                  "%llu gen %llu; descriptor has %llu gen %llu)",
                  (unsigned long long)e->o.base,
                  (unsigned long long)e->buffer_id,
                  (unsigned long long)e->generation,
                  (unsigned long long)d->buffer_id,
                  (unsigned long long)d->generation);
    e->linked = false;
    stats.stale++;
    gpuipc__stats_add(GPUIPC__ST_CACHE_STALE, 1);
    if (e->idle) {
      stats.linger_drops++;
      (void)close_entry_locked(e);
    }
  }
  n = calloc(1, sizeof *n);
  if (n == NULL) {
    pthread_mutex_unlock(&cache_lock);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "import cache entry");
  }
  n->key = key;
  n->ops = ops;
  n->buffer_id = d->buffer_id;
  n->generation = d->generation;
  n->state = ST_OPENING;
  n->linked = cacheable;
  n->refs = 1;
  n->d = *d;
  n->no_linger = (flags & GPUIPC_IMPORT_NO_CACHE) != 0;
  n->next = maps;
  maps = n;
  stats.misses++;
  gpuipc__stats_add(GPUIPC__ST_CACHE_MISSES, 1);
  pthread_mutex_unlock(&cache_lock);

  gpuipc_status s = open_mapping(ops, d, map_ordinal, fds, nfds, flags, &n->o);

  pthread_mutex_lock(&cache_lock);
  if (s == GPUIPC_OK) {
    n->state = ST_LIVE;
    stats.live_mappings++;
    gpuipc__stats_add(GPUIPC__ST_CACHE_LIVE, 1);
  } else {
    unlink_entry(n);
  }
  pthread_cond_broadcast(&cache_cond);
  pthread_mutex_unlock(&cache_lock);
  if (s != GPUIPC_OK) {
    free(n);
    return s;
  }
  *out = n;
  return GPUIPC_OK;
}

gpuipc_status gpuipc__cache_release(struct gpuipc__mapping *m) {
  if (m == NULL)
    return GPUIPC_OK;
  pthread_mutex_lock(&cache_lock);
  if (--m->refs > 0) {
    pthread_mutex_unlock(&cache_lock);
    return GPUIPC_OK;
  }
  linger_read_locked();
  if (m->linked && !m->no_linger && m->state == ST_LIVE && linger_ms > 0 &&
      linger_max > 0) {
    /* Kept, idle, for the next import of the same allocation. */
    m->idle = true;
    m->idle_since = cache_now();
    m->idle_seq = ++idle_seq_next;
    n_idle++;
    stats.linger_kept++;
    (void)sweep_idle_locked(false, false); /* the count bound, at once */
    reaper_kick_locked();
    pthread_mutex_unlock(&cache_lock);
    return GPUIPC_OK;
  }
  gpuipc_status s = close_entry_locked(m);
  pthread_mutex_unlock(&cache_lock);
  return s;
}

gpuipc_status gpuipc_cache_trim(void) {
  pthread_mutex_lock(&cache_lock);
  (void)sweep_idle_locked(true, false);
  /* Also those another thread (the reaper) is closing right now: on
   * return no idle mapping is open. */
  while (n_idle_closing > 0)
    pthread_cond_wait(&cache_cond, &cache_lock);
  pthread_mutex_unlock(&cache_lock);
  return GPUIPC_OK;
}

void gpuipc__cache_linger_set(long ms, long max) {
  pthread_mutex_lock(&cache_lock);
  linger_ms = ms;
  linger_max = max;
  (void)sweep_idle_locked(false, false);
  pthread_mutex_unlock(&cache_lock);
}

size_t gpuipc__cache_test_advance(uint64_t ms) {
  pthread_mutex_lock(&cache_lock);
  clock_offset += ms;
  size_t n = sweep_idle_locked(false, true);
  /* What the reaper was closing meanwhile has finished too. */
  for (;;) {
    bool closing = false;
    for (struct gpuipc__mapping *e = maps; e && !closing; e = e->next)
      closing = e->state == ST_CLOSING;
    if (!closing)
      break;
    pthread_cond_wait(&cache_cond, &cache_lock);
  }
  pthread_mutex_unlock(&cache_lock);
  return n;
}

CUdeviceptr gpuipc__mapping_base(const struct gpuipc__mapping *m) {
  return m->o.base;
}
size_t gpuipc__mapping_size(const struct gpuipc__mapping *m) {
  return m->o.mapped_size;
}
void *gpuipc__mapping_host(const struct gpuipc__mapping *m) {
  return m->o.host;
}

/* ---- imported pools ------------------------------------------------------------ */

CUmemoryPool gpuipc__pool_import_handle(const struct gpuipc__pool_import *p) {
  return p->mp;
}

static void unlink_pool(struct gpuipc__pool_import *p) {
  for (struct gpuipc__pool_import **pp = &pools; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      return;
    }
}

/* Whether an imported pool can go: nothing imported here holds it, and its
 * exporter is gone (while the exporter lives, the pool stays cached: its
 * next buffer imports without the fd and without the ~170 us pool
 * import). Caller holds cache_lock. */
static bool pool_releasable(const struct gpuipc__pool_import *p) {
  return p->state == ST_LIVE && p->refs == 0 && !p->keep &&
         gpuipc__exporter_gone(&p->exporter);
}

/* Destroys the imported pool p (CLOSING, so nobody finds it) with the lock
 * dropped; the driver allows it once no pointer imported from it is live,
 * which no reference left means. Caller holds cache_lock. */
static void pool_destroy_imported(struct gpuipc__pool_import *p) {
  p->state = ST_CLOSING;
  pthread_mutex_unlock(&cache_lock);
  gpuipc__ctx_guard g;
  CUresult r = CUDA_ERROR_INVALID_CONTEXT;
  if (gpuipc__ctx_enter(&g, p->home_ordinal) == GPUIPC_OK) {
    r = GPUIPC__CU(cuMemPoolDestroy, p->mp);
    gpuipc__ctx_leave(&g);
  }
  pthread_mutex_lock(&cache_lock);
  if (r == CUDA_SUCCESS) {
    GPUIPC__DEBUG("handle",
                  "released the imported pool %llu of gone exporter pid %d",
                  (unsigned long long)p->pool_id, (int)p->exporter.pid);
    unlink_pool(p);
    stats.driver_closes++;
    pthread_mutex_destroy(&p->access_lock);
    free(p);
  } else {
    GPUIPC__INFO("handle",
                 "cannot release the imported pool %llu of gone exporter "
                 "pid %d (cuMemPoolDestroy: %s): it stays",
                 (unsigned long long)p->pool_id, (int)p->exporter.pid,
                 gpuipc__cuda_error_name(r));
    p->state = ST_LIVE;
    p->keep = true;
  }
  pthread_cond_broadcast(&cache_cond);
}

/* Releases every imported pool that can go. Caller holds cache_lock. */
static void pool_sweep(void) {
  for (;;) {
    struct gpuipc__pool_import *p;
    for (p = pools; p; p = p->next)
      if (pool_releasable(p))
        break;
    if (p == NULL)
      return;
    pool_destroy_imported(p);
  }
}

void gpuipc__pool_import_release(struct gpuipc__pool_import *p) {
  if (p == NULL)
    return;
  pthread_mutex_lock(&cache_lock);
  p->refs--;
  if (pool_releasable(p))
    pool_destroy_imported(p);
  pthread_mutex_unlock(&cache_lock);
}

size_t gpuipc__cache_pools_held(void) {
  size_t n = 0;
  pthread_mutex_lock(&cache_lock);
  /* Idle mappings of gone exporters hold their pools: they go first. */
  (void)sweep_idle_locked(false, true);
  pool_sweep();
  for (struct gpuipc__pool_import *p = pools; p; p = p->next)
    n++;
  pthread_mutex_unlock(&cache_lock);
  return n;
}

/* Grants map_ordinal access to an imported pool, once per (pool, device). */
static gpuipc_status grant_access(struct gpuipc__pool_import *p,
                                  int map_ordinal) {
  if (map_ordinal < 0 || map_ordinal >= 64)
    return gpuipc__fail(GPUIPC_E_NO_DEVICE, "device ordinal %d", map_ordinal);
  uint64_t bit = 1ull << map_ordinal;
  gpuipc_status s = GPUIPC_OK;
  pthread_mutex_lock(&p->access_lock);
  if (!(p->access_mask & bit)) {
    gpuipc__ctx_guard g;
    s = gpuipc__ctx_enter(&g, map_ordinal);
    if (s == GPUIPC_OK) {
      CUmemAccessDesc ad;
      memset(&ad, 0, sizeof ad);
      ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      ad.location.id = map_ordinal;
      ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      CUresult r = GPUIPC__CU(cuMemPoolSetAccess, p->mp, &ad, 1);
      if (r != CUDA_SUCCESS)
        s = gpuipc__fail_cuda(r, "cuMemPoolSetAccess",
                              "imported pool %llu of pid %d for device %d",
                              (unsigned long long)p->pool_id,
                              (int)p->exporter.pid, map_ordinal);
      else
        p->access_mask |= bit;
      gpuipc__ctx_leave(&g);
    }
  }
  pthread_mutex_unlock(&p->access_lock);
  return s;
}

gpuipc_status gpuipc__pool_import_acquire(const gpuipc__desc *d,
                                          int map_ordinal, int fd,
                                          unsigned flags,
                                          struct gpuipc__pool_import **out) {
  int home = -1;
  gpuipc_uuid dev;
  memcpy(dev.bytes, d->device, 16);
  GPUIPC__CHECK(gpuipc_device_from_uuid(&dev, &home));

  struct gpuipc__pool_import *p = NULL;
  pthread_mutex_lock(&cache_lock);
  for (;;) {
    for (p = pools; p; p = p->next)
      if (p->pool_id == d->pool_id &&
          gpuipc__identity_eq(&p->exporter, &d->exporter))
        break;
    if (p == NULL || p->state == ST_LIVE)
      break;
    pthread_cond_wait(&cache_cond, &cache_lock);
  }
  if (p != NULL) {
    p->refs++;
    stats.pool_hits++;
    pthread_mutex_unlock(&cache_lock);
  } else {
    p = calloc(1, sizeof *p);
    if (p == NULL) {
      pthread_mutex_unlock(&cache_lock);
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool import entry");
    }
    /* A new pool import is the time to let go of those of gone
     * exporters (an importer of many short-lived exporters would otherwise
     * keep every one of their pools mapped). */
    pool_sweep();
    p->exporter = d->exporter;
    p->pool_id = d->pool_id;
    p->home_ordinal = home;
    p->state = ST_OPENING;
    p->refs = 1;
    p->keep = (flags & GPUIPC__IMPORT_RAW) != 0;
    pthread_mutex_init(&p->access_lock, NULL);
    p->next = pools;
    pools = p;
    pthread_mutex_unlock(&cache_lock);

    gpuipc_status s = GPUIPC_OK;
    int fetched = -1;
    if (fd < 0 && (flags & GPUIPC_IMPORT_PIDFD_GETFD)) {
      s = gpuipc__live_fetch_fd(d, d->pool_id, &fetched);
      fd = fetched;
    } else if (fd < 0) {
      s = gpuipc__fail(GPUIPC_E_NEED_FD,
                       "buffer of memory pool %llu of pid %d: this process "
                       "has not imported that pool, and no fd came with the "
                       "descriptor: pass the fd the export produced, import "
                       "the pool first (gpuipc_pool_import), or allow "
                       "GPUIPC_IMPORT_PIDFD_GETFD",
                       (unsigned long long)d->pool_id, (int)d->exporter.pid);
    }
    if (s == GPUIPC_OK)
      s = gpuipc__import_check_driver_fd(fd, "memory pool");
    if (s == GPUIPC_OK) {
      gpuipc__ctx_guard g;
      s = gpuipc__ctx_enter(&g, home);
      if (s == GPUIPC_OK) {
        CUresult r = GPUIPC__CU(cuMemPoolImportFromShareableHandle, &p->mp,
                                (void *)(uintptr_t)fd,
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (r != CUDA_SUCCESS)
          s = gpuipc__fail_cuda(r, "cuMemPoolImportFromShareableHandle",
                                "pool %llu of pid %d, fd %d",
                                (unsigned long long)d->pool_id,
                                (int)d->exporter.pid, fd);
        gpuipc__ctx_leave(&g);
      }
    }
    if (fetched >= 0)
      close(fetched);
    pthread_mutex_lock(&cache_lock);
    if (s == GPUIPC_OK) {
      p->state = ST_LIVE;
      stats.pool_imports++;
      stats.driver_opens++;
    } else {
      unlink_pool(p);
    }
    pthread_cond_broadcast(&cache_cond);
    pthread_mutex_unlock(&cache_lock);
    if (s != GPUIPC_OK) {
      pthread_mutex_destroy(&p->access_lock);
      free(p);
      return s;
    }
  }
  /* "Imported memory pools are initially only accessible from their
   * resident device" (CUDA programming guide): other devices need
   * cuMemPoolSetAccess, the resident one has access already (and the driver
   * rejects some access changes for a pool's own device). */
  gpuipc_status s =
      map_ordinal == p->home_ordinal ? GPUIPC_OK : grant_access(p, map_ordinal);
  if (s != GPUIPC_OK) {
    gpuipc__pool_import_release(p);
    return s;
  }
  *out = p;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_cache_get_stats(gpuipc_cache_stats *st) {
  if (st == NULL || st->size < sizeof(size_t))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_cache_get_stats: NULL or size unset");
  pthread_mutex_lock(&cache_lock);
  gpuipc_cache_stats x = stats;
  x.idle_mappings = n_idle;
  pthread_mutex_unlock(&cache_lock);
  x.size = st->size;
  memcpy(st, &x, st->size < sizeof x ? st->size : sizeof x);
  return GPUIPC_OK;
}
