/*
 * test-conn-handoff.h: what the tests of the per-buffer fast path share
 * (test-conn-tx.c, test-conn-rx.c, test-conn-depart.c, test-conn-arena.c).
 * The definitions are in test-conn-common.c, with their comments: small
 * tools (streams, patterns, arenas, connections over the helper's
 * socketpair), bounded steps, raw frames, batches of filled blocks, and
 * the helper processes that tests of several of these files start
 * ("ho_consumer", "ho_order", "ho_batch_producer"; spawn_helper finds a
 * helper by its name).
 *
 * GPUIPC_TEST_ORDER=event runs a test (and its helpers) in event mode,
 * GPUIPC_TEST_STREAM=legacy on the legacy default stream.
 */
#ifndef GPUIPC_TEST_CONN_HANDOFF_H
#define GPUIPC_TEST_CONN_HANDOFF_H

#include "harness.h"

#include "tree.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Small tools. */
void ctx_current(void);
bool test_legacy(void);
CUstream mkstream(void);
void pattern(uint8_t *p, size_t n, uint32_t seed);
void check_pattern(const uint8_t *p, size_t n, uint32_t seed);
/* Copies a received buffer to the host on s (ordered after the wait its
 * receive enqueued), synchronizes s and checks the pattern whose seed (a
 * u32) is its metadata; returns the seed. */
uint32_t check_received(const gpuipc_received *r, CUstream s);
gpuipc_arena *mkarena(size_t chunk);
gpuipc_order_mode test_order(void);
gpuipc_conn *pair_conn(int fd);
/* A helper's end: waits for the test's word (or its hang-up), then closes c. */
void await_test_then_close(gpuipc_conn *c);
void wait_unheld(gpuipc_conn *c, gpuipc_block *b);
void d2h(void *dst, const void *p, size_t n);
void wait_up(gpuipc_conn *c, int timeout_ms);

/* Ordering: the connection's setup done first; the emulator's slow copies
 * for a helper's environment. */
void warm_up(gpuipc_conn *c, gpuipc_arena *a, CUstream s);
extern char *delay_env[];

/* A frame written as is on the connection's socket. */
void raw_frame(int fd, int type, const void *p, size_t n);

/* Bounded steps, streams that drain, arenas with no room to spare. */
void bounded(const char *what, unsigned secs);
void bounded_done(void);
bool stream_drains(CUstream s, int ms);
gpuipc_arena *full_arena(size_t small, int n, gpuipc_block **blocks,
                         gpuipc_block **filler);

/* Batches. */
gpuipc_block *filled_block(gpuipc_arena *a, CUstream s, size_t n,
                           uint32_t seed, uint8_t **pinned);
extern bool sync_before_send;
void send_batches(gpuipc_conn *c, gpuipc_arena *a1, gpuipc_arena *a2,
                  CUstream s, int nb, int rounds, const size_t *sizes,
                  int nsizes, uint32_t seed0);

/* Driver calls of this process, counted from count_calls() on (through
 * the library's entry-point table, so the test's own calls made through
 * gpuipc__cu count too: count around library calls only). */
enum {
  DC_WRITE,      /* cuStreamWriteValue64 */
  DC_WAIT,       /* cuStreamWaitValue64 */
  DC_QUERY,      /* cuStreamQuery */
  DC_RECORD,     /* cuEventRecord */
  DC_WAIT_EVENT, /* cuStreamWaitEvent */
  DC_N
};
void count_calls(void);
int counted(int which);
/* All of them (those above). */
int counted_all(void);
void uncount_calls(void);
/* Writes 1 into the word at gate (device memory) from a stream of its
 * own, and waits for it: streams waiting for it go on (not counted). */
void open_gate(CUdeviceptr gate);

#endif
