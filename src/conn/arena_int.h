/*
 * arena_int.h: arenas and blocks as the other files of the connection layer
 * see them (src/conn/ only). arena.c owns every field: the others read the
 * fields marked immutable and change the rest only through the functions
 * below, which take the arena's lock themselves (it is never taken outside
 * arena.c).
 */
#ifndef GPUIPC_ARENA_INT_H
#define GPUIPC_ARENA_INT_H

#include "conn.h"

#include <pthread.h>
#include <stdbool.h>

#define GPUIPC__ARENA_MAX_CHUNKS 64
#define GPUIPC__ARENA_ALIGN 256

struct CUevent_st;
struct CUstream_st;

/* A reclaim stream: a non-blocking stream on which waits for releases are
 * queued. Each arena has one for its owner's frees; each lease table (one
 * per connection that sends) has its own for its peer's releases, so that
 * a release word one peer never writes stalls that stream only. The id is
 * process-unique (never reused). */
typedef struct gpuipc__reclaimer {
  struct CUstream_st *stream;
  uint64_t id;
} gpuipc__reclaimer;

/* Makes / ends a reclaim stream (context of its device current). Work
 * still queued on it runs to completion after the close. */
gpuipc_status gpuipc__reclaimer_open(gpuipc__reclaimer *r /* OUT */);
void gpuipc__reclaimer_close(gpuipc__reclaimer *r);

/* A marker on a reclaim stream: memory tagged with it may be reused once
 * the marker's event completed (or by work ordered after it). Of two
 * markers of one reclaim stream the later covers the earlier. Guarded by
 * the arena's lock. */
typedef struct gpuipc__mark {
  struct CUevent_st *ev;
  uint64_t src;   /* the reclaimer it was recorded on */
  uint64_t order; /* record order (process-wide) */
  uint64_t t_ns;  /* when recorded */
  int refs;
  bool done;      /* known complete */
  struct gpuipc__mark *next_free;
} gpuipc__mark;

/* The markers memory waits for before reuse: at most one per reclaim
 * stream (the newest). Empty: free at once. */
typedef struct gpuipc__tags {
  gpuipc__mark **m;
  uint32_t n, cap;
} gpuipc__tags;

/* One free range of an arena chunk. Guarded by the arena's lock. Adjacent
 * ranges merge only when neither waits for anything, so memory one peer
 * holds back never taints its neighbours. */
typedef struct gpuipc__range {
  struct gpuipc__range *next;
  uint32_t chunk;
  size_t off, len;
  gpuipc__tags tags; /* reuse waits for them */
} gpuipc__range;

typedef struct gpuipc__chunk {
  gpuipc_buffer *buf;
  uint64_t base; /* CUdeviceptr */
  size_t size;
} gpuipc__chunk;

struct gpuipc_arena {
  /* Immutable after creation. */
  int ordinal;
  uint64_t id;                 /* process-unique, travels in frames */
  gpuipc_pool *pool;
  gpuipc_pool_kind kind;
  /* VMM, for the chunks of a mempool arena above gpuipc__arena_mempool_max;
   * made at the first such chunk (under lock). */
  gpuipc_pool *big_pool;
  size_t chunk_bytes, max_bytes;
  gpuipc__reclaimer own;    /* orders reuse after the owner's frees */
  struct CUstream_st *side; /* non-blocking: writes that unblock */
  /* Given up (gpuipc_arena_release): in the list of arenas destroyed once
   * drained (under that list's lock, arena.c). */
  struct gpuipc_arena *next_given;
  /* Everything below: under `lock`, in arena.c only. */
  pthread_mutex_t lock;
  size_t total_bytes;
  gpuipc__chunk chunks[GPUIPC__ARENA_MAX_CHUNKS];
  uint32_t nchunks;
  gpuipc__range *free_list; /* sorted by (chunk, off) */
  gpuipc__mark *mark_free;    /* complete, ready for reuse */
  gpuipc__mark *mark_retired; /* unreferenced, record still pending */
  size_t blocks_allocated, blocks_deferred, leases, bytes_allocated;
  size_t internal_blocks, internal_bytes; /* flag words of connections */
  int users; /* connections with flag words here */
};

struct gpuipc_block {
  /* Immutable after allocation. */
  gpuipc_arena *arena;
  uint32_t chunk;
  size_t off, len; /* len: rounded up to the arena's alignment */
  size_t bytes;    /* as asked for */
  uint64_t ptr;    /* CUdeviceptr */
  bool internal;   /* flag words of a connection */
  /* Under the arena's lock. */
  unsigned holders;
  bool freed;        /* the owner freed it; the memory waits for holders */
  bool lost;         /* an ordering could not be recorded: never reused */
  gpuipc__tags tags; /* what its reuse waits for (releases, the free) */
};

/* The function the public gpuipc_arena_alloc, _get_stats and _destroy call
 * first, to reclaim what orphaned leases of departed peers held: set by
 * lease.c once it keeps an orphan (until then there is nothing to
 * reclaim); setting it again changes nothing. */
/* gpuipc__arena_given_retry: in conn.h (the tests count with it). */
void gpuipc__arena_set_reaper(void (*reap)(bool now));
/* The process's arena for connection flag words on a device. */
gpuipc_status gpuipc__ctl_arena(int ordinal, gpuipc_arena **out);
/* Allocates a block (internal: connection flag words, not counted in the
 * public statistics). */
gpuipc_status gpuipc__arena_take(gpuipc_arena *a, size_t bytes,
                                 struct CUstream_st *stream, bool internal,
                                 gpuipc_block **out);
/* A connection keeps flag words in the arena (add) or no longer (remove). */
void gpuipc__arena_user_add(gpuipc_arena *a);
void gpuipc__arena_user_remove(gpuipc_arena *a);
/* Chunk ci's buffer and size (NULL/0 when there is no such chunk). */
void gpuipc__arena_chunk(gpuipc_arena *a, uint32_t ci,
                         gpuipc_buffer **buf /* OUT */, size_t *size /* OUT */);
/* True when the block may be sent (allocated by a user, not yet freed). */
bool gpuipc__block_sendable(gpuipc_block *b);
/* A peer holds the block from now on (a lease). */
void gpuipc__block_hold(gpuipc_block *b);

/* One lease that ended: its holder gave the block back (or died). */
typedef struct gpuipc__release {
  gpuipc_block *block;
  /* Reuse waits, on the GPU, until the 64-bit word at device address
   * `word` reaches `value` (wrap-around GEQ); 0: no such wait. */
  uint64_t word, value;
  /* Or until this event (the holder's release record) completed. */
  struct CUevent_st *event;
  /* The holder was given the block with GPU ordering (a wait was queued
   * for it now or earlier): its reuse must follow the newest marker. */
  bool ordered;
} gpuipc__release;

/* Ends n leases of blocks of arena a (every rel[i].block is of a), all
 * held by one peer whose releases `rc` orders: queues their waits on rc's
 * stream, then one marker there that tags every ordered block, and drops
 * the holds. `dead`: the holder is gone (no new waits; the marker still
 * covers the waits queued before). Context of the arena's device current.
 * Returns the first failure of a driver call (the holds are dropped all
 * the same; a block whose ordering failed is never reused). */
gpuipc_status gpuipc__arena_release(gpuipc_arena *a,
                                    const gpuipc__reclaimer *rc,
                                    const gpuipc__release *rel, int n,
                                    bool dead);
/* gpuipc_block_free(b, NULL), with the reuse of b's memory also ordered
 * after everything queued on rc so far (flag words that rc's waits read). */
gpuipc_status gpuipc__block_free_after(gpuipc_block *b,
                                       const gpuipc__reclaimer *rc);
/* Writes value into each word (device addresses in arena a), on the side
 * stream (for flag words a dead peer will never write), then waits for it
 * to complete. Context current. */
gpuipc_status gpuipc__arena_force_words(gpuipc_arena *a, const uint64_t *words,
                                        int n, uint64_t value);
/* Reads n 64-bit words at device address `words` of arena a, on the side
 * stream (which nothing else blocks). Context current. */
gpuipc_status gpuipc__arena_read_words(gpuipc_arena *a, uint64_t words,
                                       uint32_t n, uint64_t *out /* OUT */);

#endif /* GPUIPC_ARENA_INT_H */
