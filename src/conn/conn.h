/*
 * conn.h: the connection layer, as the layers above (sets, proc, mpi) and
 * the in-tree tools and tests see it: what a connection holds of received
 * messages, the holders of a block, the arenas' counters and the imports
 * kept past a close. The frame format is in wire.h (docs/protocol.md);
 * the connection object and the transport's entry points are private to
 * src/conn/ (conn_int.h).
 */
#ifndef GPUIPC_CONN_LAYER_H
#define GPUIPC_CONN_LAYER_H

#include "handle/handle.h"

/* What a connection holds of received user messages not yet taken
 * (messages, payload bytes, file descriptors), and whether it stopped
 * reading because a bound was reached. Any pointer may be NULL. */
void gpuipc__conn_queued(const struct gpuipc_conn *c, size_t *msgs,
                         size_t *bytes, size_t *fds, bool *paused);

/* The reads of conn's socket its passes made so far (tests: which calls
 * leave the socket unread). */
uint64_t gpuipc__conn_socket_reads(const struct gpuipc_conn *c);

/* The name of the carrier that carries conn's frames now ("socket";
 * "ring" once a shared-memory ring carries its fast-path frames). */
const char *gpuipc__conn_carrier_name(const struct gpuipc_conn *c);

/* Leases the peer of conn holds on block now (no progress is made: call
 * after a call that made some). A scan of the connection's slots: for
 * decisions off the fast path. */
unsigned gpuipc__conn_block_holders(gpuipc_conn *conn,
                                    const gpuipc_block *block);

/* Whether a reuse marker of block recorded on reclaim stream reclaimer_id
 * (0: any) has not completed: a release whose GPU work (what the holder
 * queued before it) still runs, so that gpuipc_block_wait would order a
 * stream behind it. No waiting. */
bool gpuipc__block_pending(gpuipc_block *block, uint64_t reclaimer_id);
/* gpuipc__block_pending for the releases of block by the peer of conn. */
bool gpuipc__conn_block_releasing(gpuipc_conn *conn, gpuipc_block *block);

/* The connection's timeout (ms; -1: none), for callers above that wait in
 * several calls under one deadline. */
int gpuipc__conn_timeout(const gpuipc_conn *conn);

/* Chunks (device allocations) held by all arenas of this process. */
size_t gpuipc__arena_chunks_live(void);

/* The largest chunk a mempool arena keeps in mempool memory; larger chunks
 * are VMM memory (see arena.c). A variable, so that tests can lower it. */
extern size_t gpuipc__arena_mempool_max;
/* The kind of memory of an arena's chunk i (GPUIPC_POOL_AUTO: no such
 * chunk). */
gpuipc_pool_kind gpuipc__arena_chunk_kind(gpuipc_arena *a, uint32_t i);

/* Finishes the connections closed before GPU work on their imports
 * completed, whose work has completed since (or whose peer is gone);
 * returns how many stay kept. Every close and progress call does this. */
size_t gpuipc__handoff_held_poll(void);

/* Destroys the arenas given up (gpuipc_arena_release) that have drained
 * meanwhile; cheap when there are none. Returns how many are left. Takes
 * no lock of the caller's: called where blocks come back (releases, a
 * dead peer's reclaim, frees) with no arena lock held. */
size_t gpuipc__arena_given_retry(void);

#endif /* GPUIPC_CONN_LAYER_H */
