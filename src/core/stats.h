/*
 * stats.h: the per-process stats segment, for the files that keep its
 * counters (pools, buffers and the import cache in handle/, arenas,
 * connections and leases in conn/, devices in core/driver.c) and for its
 * reader, `gpuipc ls` (tools/ls.c). Kept out of core.h so that the lowest
 * layer's header, which every file includes, does not spell out every
 * layer's counters. Internal names start with gpuipc__.
 */
#ifndef GPUIPC_CORE_STATS_H
#define GPUIPC_CORE_STATS_H

#include "core.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* ---- the per-process stats segment (stats.c) --------------------------------
 *
 * What `gpuipc ls` shows of this process: counters in a small file mapped
 * MAP_SHARED in the runtime directory, proc-<pid>-<start time>.stats (mode
 * 0600), made on first use. Writers do relaxed atomic adds where the state
 * already changes; nothing is locked and nothing waits. When the segment
 * cannot be made (or GPUIPC_STATS=0) the counters go to private memory. The
 * layout is read by tools/ls.c; a change of it bumps GPUIPC__STATS_VERSION.
 */

typedef enum gpuipc__stat {
  GPUIPC__ST_POOLS = 0,     /* pools created here, not yet destroyed */
  GPUIPC__ST_POOL_BUFFERS,  /* live buffers allocated from them */
  GPUIPC__ST_POOL_BYTES,    /* their bytes */
  GPUIPC__ST_ARENAS,        /* arenas (the flag-word arenas included) */
  GPUIPC__ST_ARENA_CHUNKS,  /* device allocations held by arenas */
  GPUIPC__ST_ARENA_BYTES,   /* their bytes */
  GPUIPC__ST_ARENA_BLOCKS,  /* blocks allocated and not yet freed back */
  GPUIPC__ST_ARENA_DEFERRED, /* blocks freed by us, waiting on peers */
  GPUIPC__ST_CACHE_LIVE,    /* import cache: live mappings */
  GPUIPC__ST_CACHE_HITS,
  GPUIPC__ST_CACHE_MISSES,
  GPUIPC__ST_CACHE_STALE,
  GPUIPC__ST_CONNS,         /* connections past the handshake, not freed */
  GPUIPC__ST_KEPT_BUFFERS,  /* buffers handed over, kept until released */
  GPUIPC__ST_COUNT
} gpuipc__stat;

#define GPUIPC__STATS_MAGIC 0x3174617473697067ull /* "gpistat1" */
#define GPUIPC__STATS_VERSION 2 /* 2: pid_ns */
#define GPUIPC__STATS_CTRS 32     /* room for counters (>= ST_COUNT) */
#define GPUIPC__STATS_DEVICES 16
#define GPUIPC__STATS_CONNS 32    /* connection slots; more are counted */
#define GPUIPC__STATS_LEASES 256  /* lease slots timed per connection */

typedef struct gpuipc__stats_conn {
  _Atomic uint32_t used;  /* 1 while the connection exists */
  _Atomic int32_t peer_pid;
  _Atomic uint64_t peer_start;
  _Atomic uint32_t state; /* 0 open, 1 peer gone, 2 broken */
  _Atomic uint32_t order; /* gpuipc_order_mode */
  _Atomic int64_t held_by_peer; /* our blocks/buffers the peer holds */
  _Atomic int64_t held_here;    /* the peer's buffers we hold */
  _Atomic uint64_t opened_ns;   /* gpuipc__stats_now() */
  /* When each lease of lease slot i began (gpuipc__stats_now(); 0: none).
   * Leases in slots beyond the table are counted in held_by_peer only. */
  _Atomic uint64_t lease_ns[GPUIPC__STATS_LEASES];
} gpuipc__stats_conn;

typedef struct gpuipc__stats_seg {
  _Atomic uint64_t magic; /* written last: a reader skips a segment without */
  uint32_t version, size; /* size: bytes of the segment */
  int32_t pid;
  uint32_t uid;
  uint64_t start_time;    /* clock ticks since boot, /proc/pid/stat */
  /* The writer's pid namespace (inode of /proc/self/ns/pid; 0: unknown):
   * pid and start_time mean something only to a reader of the same one,
   * which alone may judge the writer gone. */
  uint64_t pid_ns;
  uint64_t created_ns;    /* gpuipc__stats_now() */
  char command[128];      /* the command line, arguments joined by spaces */
  _Atomic int64_t ctr[GPUIPC__STATS_CTRS];
  struct {
    _Atomic uint32_t used;
    int32_t ordinal;
    uint8_t uuid[16];
  } dev[GPUIPC__STATS_DEVICES];
  _Atomic uint64_t conn_overflow; /* connections that found no free slot */
  gpuipc__stats_conn conn[GPUIPC__STATS_CONNS];
} gpuipc__stats_seg;

/* The clock of the segment's times (ns, CLOCK_MONOTONIC_COARSE). */
uint64_t gpuipc__stats_now(void);
/* This process's segment (made on first use; never NULL). */
extern _Atomic(gpuipc__stats_seg *) gpuipc__stats_seg_now;
gpuipc__stats_seg *gpuipc__stats_make(void);
static inline gpuipc__stats_seg *gpuipc__stats_self(void) {
  gpuipc__stats_seg *s =
      atomic_load_explicit(&gpuipc__stats_seg_now, memory_order_acquire);
  return GPUIPC__LIKELY(s != NULL) ? s : gpuipc__stats_make();
}
/* Adds n (may be negative) to a counter of the process. */
static inline void gpuipc__stats_add(gpuipc__stat which, int64_t n) {
  atomic_fetch_add_explicit(&gpuipc__stats_self()->ctr[which], n,
                            memory_order_relaxed);
}
/* Connection slots, named by slot+1 (0: none, every call accepts it). */
int gpuipc__stats_conn_open(int peer_pid, uint64_t peer_start, int order);
void gpuipc__stats_conn_close(int slot);
void gpuipc__stats_conn_state(int slot, int state);
static inline gpuipc__stats_conn *gpuipc__stats_conn_at(int slot) {
  if ((unsigned)slot - 1u >= (unsigned)GPUIPC__STATS_CONNS)
    return NULL;
  return &gpuipc__stats_self()->conn[slot - 1];
}
/* The updates of a connection's slot are made by calls on the connection,
 * which its contract serializes (one thread at a time): a relaxed load and
 * store each, no locked instruction, on the handoff path. */
static inline void gpuipc__stats_conn_bump(_Atomic int64_t *v, int64_t n) {
  atomic_store_explicit(v, atomic_load_explicit(v, memory_order_relaxed) + n,
                        memory_order_relaxed);
}
/* The peer's buffers we hold: n more (or fewer). */
static inline void gpuipc__stats_conn_held_here(int slot, int64_t n) {
  gpuipc__stats_conn *c = gpuipc__stats_conn_at(slot);
  if (c)
    gpuipc__stats_conn_bump(&c->held_here, n);
}
/* A lease of lease slot ls began / ended (held_by_peer and its age). */
static inline void gpuipc__stats_lease_begin(int slot, uint32_t ls) {
  gpuipc__stats_conn *c = gpuipc__stats_conn_at(slot);
  if (c == NULL)
    return;
  gpuipc__stats_conn_bump(&c->held_by_peer, 1);
  if (ls < GPUIPC__STATS_LEASES)
    atomic_store_explicit(&c->lease_ns[ls], gpuipc__stats_now(),
                          memory_order_relaxed);
}
static inline void gpuipc__stats_lease_end(int slot, uint32_t ls) {
  gpuipc__stats_conn *c = gpuipc__stats_conn_at(slot);
  if (c == NULL)
    return;
  /* A slot freed without a lease in it (its send failed) held nothing. */
  if (ls < GPUIPC__STATS_LEASES) {
    if (atomic_load_explicit(&c->lease_ns[ls], memory_order_relaxed) == 0)
      return;
    atomic_store_explicit(&c->lease_ns[ls], 0, memory_order_relaxed);
  }
  gpuipc__stats_conn_bump(&c->held_by_peer, -1);
}
/* Device ordinal, of this UUID, is in use here (driver.c says so when it
 * retains the device's primary context). */
void gpuipc__stats_device(int ordinal, const uint8_t uuid[16]);
/* The segment's file name for pid/start time, in dir. */
int gpuipc__stats_path(char *out, size_t cap, const char *dir, int pid,
                       uint64_t start_time);

#endif /* GPUIPC_CORE_STATS_H */
