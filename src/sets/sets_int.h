/*
 * sets/sets_int.h: the tensor-set layer's own structures (producer sets,
 * subscribers, versions) and the helpers its files share. Private to
 * src/sets/.
 */
#ifndef GPUIPC_SETS_INT_H
#define GPUIPC_SETS_INT_H

#include "sets.h"

#include "conn/conn.h"
#include "core/core.h"
#include "handle/handle.h"

/* The bytes a tensor spans from element 0 (tensor.c; the one extent
 * computation): 0 when a size is 0, else elem * (1 + sum (shape[i]-1) *
 * strides[i]), strides NULL meaning row-major. ndim is the caller's to
 * bound. GPUIPC_E_BAD_KIND (dtype), GPUIPC_E_OUT_OF_RANGE (negative sizes
 * or strides, beyond 2^62). */
gpuipc_status gpuipc__tensor_extent(int dtype, int ndim, const int64_t *shape,
                                    const int64_t *strides, uint64_t *out);

/* One connection a producer set feeds. */
typedef struct gpuipc__tset_peer {
  gpuipc_conn *conn;
  bool ended;        /* END sent; kept until it released everything */
  uint64_t ended_ns; /* when */
} gpuipc__tset_peer;

/* An owned copy set aside because consumers held it past the hold limit:
 * kept until no one holds it, then freed (the arena defers the reuse
 * until the holders' GPU work is done). */
typedef struct gpuipc__tset_retired {
  gpuipc_block *piece; /* NULL for a wrapped set (its token only) */
  gpuipc_block *token;
} gpuipc__tset_retired;

struct gpuipc_tset {
  gpuipc__tset_table tab;
  uint8_t *table;      /* encoded, sent to every subscriber */
  size_t table_len;
  bool wrapped;
  int copies;
  int ordinal;         /* the device of the memory */
  gpuipc_arena *own_arena;
  gpuipc_arena *arena;
  gpuipc_block *piece_blk[2]; /* owned: one block per copy */
  gpuipc_buffer **piece_buf;  /* wrapped: n_pieces wrappers */
  CUdeviceptr *piece_ptr;     /* copies * n_pieces base addresses */
  gpuipc_block *token[2];     /* the versions' leases, one per copy */
  gpuipc_block *ctl;          /* END markers */
  gpuipc__tset_peer *peers;
  size_t npeers, peers_cap;
  uint64_t version;           /* latest published; 0: none */
  int latest;                 /* its copy; -1: none */
  int writing;                /* copy between begin and publish; -1 */
  int timeout_ms;
  int hold_ms;                /* -1: none */
  int retired_max;
  uint64_t pub_ns[2];         /* when copy c's hold clock started: its
                               * publish, or a late joiner's hand-out */
  bool rejoined[2];           /* copy c's clock was restarted for a late
                               * joiner since its publish (once only) */
  uint32_t gen[2];            /* copy c's generation: retirements so far */
  gpuipc__tset_retired *retired;
  size_t nretired, retired_cap;
};

/* The pieces of one copy of a layout as a subscriber holds them: the
 * layout's current ones, and the versions received in that copy, share
 * it; a REPLACE puts a new one in the layout, the old one goes with the
 * last version in it. */
typedef struct gpuipc__tset_held {
  size_t refs;           /* the layout's (while current) + versions' */
  uint32_t n;            /* pieces received (of the layout's n_pieces) */
  uint64_t *piece_id;    /* the leases, for gpuipc_conn_release */
  CUdeviceptr *piece_ptr;
} gpuipc__tset_held;

/* A layout a subscriber knows: the table and the pieces it holds. */
typedef struct gpuipc__tset_layout {
  gpuipc__tset_table tab;
  uint32_t npieces;      /* copies * n_pieces */
  uint32_t got;          /* pieces received so far */
  gpuipc__tset_held **copy; /* tab.copies */
  uint32_t gen[2];       /* the last REPLACE's generation, per copy */
  uint64_t last;         /* the number of the last version accepted */
  size_t refs;           /* versions held */
  bool retired;          /* superseded or ended: goes with its last version */
  struct gpuipc__tset_layout *next; /* retired ones still referenced */
} gpuipc__tset_layout;

struct gpuipc_tset_sub {
  gpuipc_conn *conn;
  gpuipc__tset_layout *cur;     /* complete, versions come of it */
  gpuipc__tset_layout *pending; /* being received */
  gpuipc__tset_layout *retired; /* list */
  /* The table being collected from chunk messages. */
  uint8_t *tbuf;
  size_t thave, tneed, tcap;
  uint64_t tlayout;
  uint32_t tchunks;
  /* A layout refused: its later buffers are released and skipped. */
  uint64_t refused;
  bool has_refused;
  gpuipc_status refused_status;
  char refused_why[256];
  gpuipc_tset_version *held;    /* list of versions not released */
};

struct gpuipc_tset_version {
  gpuipc_tset_sub *sub;
  gpuipc__tset_layout *lay;
  gpuipc__tset_held *cp; /* the pieces of its copy */
  uint64_t token_id;
  uint64_t number;
  int copy;
  int ordinal; /* the local device its memory is mapped on */
  gpuipc_tset_version *prev, *next;
};

/* One deadline for the several waits of one call on a connection (a
 * layout's pieces skipped, a subscription's sends): taken from the
 * connection's timeout at entry (gpuipc__tset_wait_begin); before each
 * wait, gpuipc__tset_wait_next lowers the connection's timeout to what is
 * left, and says false once nothing is (a timeout of 0 or -1 is left as it
 * is: 0 never waits, -1 has no deadline); gpuipc__tset_wait_end gives the
 * connection its own timeout back. The connection is this thread's for the
 * call (see the threads rule of gpuipc/sets.h). */
typedef struct gpuipc__tset_wait {
  gpuipc_conn *conn;
  int timeout_ms;
  uint64_t deadline;
} gpuipc__tset_wait;

static inline void gpuipc__tset_wait_begin(gpuipc__tset_wait *w,
                                           gpuipc_conn *conn) {
  w->conn = conn;
  w->timeout_ms = gpuipc__conn_timeout(conn);
  w->deadline = gpuipc__now_ns() +
                (uint64_t)(w->timeout_ms > 0 ? w->timeout_ms : 0) * 1000000ull;
}

static inline bool gpuipc__tset_wait_next(gpuipc__tset_wait *w) {
  if (w->timeout_ms <= 0)
    return true;
  uint64_t now = gpuipc__now_ns();
  if (now >= w->deadline)
    return false;
  uint64_t left = (w->deadline - now + 999999u) / 1000000u;
  (void)gpuipc_conn_set_timeout(w->conn, (int)left);
  return true;
}

static inline void gpuipc__tset_wait_end(gpuipc__tset_wait *w) {
  if (w->timeout_ms > 0)
    (void)gpuipc_conn_set_timeout(w->conn, w->timeout_ms);
}

#endif /* GPUIPC_SETS_INT_H */
