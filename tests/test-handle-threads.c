/*
 * test-handle-threads.c: imports and closes of the same and of different
 * buffers from 8 threads at once. While one reference is held, every
 * import returns that very mapping (the memory is never mapped twice);
 * without one, imports and closes race freely and end balanced (as many
 * driver closes as opens, nothing left mapped); nothing deadlocks.
 */
#include "test-handle.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define NBUF 6
#define NTHREADS 8
#define ITERS 150

typedef struct shared {
  uint8_t desc[NBUF][GPUIPC_DESC_MAX];
  size_t len[NBUF];
  int fd[NBUF];
  uint32_t seed[NBUF];
  void *anchor[NBUF]; /* the pointer every import must return, or NULL */
  bool read_every;    /* read through every import, not every 37th */
  atomic_int failures;
} shared;

typedef struct worker {
  shared *sh;
  int id;
} worker;

/* Reads the first words of buffer i through the mapping b; a failure says
 * which thread, iteration, buffer and what went wrong. */
static void read_check(worker *w, int i, gpuipc_buffer *b, int it) {
  shared *sh = w->sh;
  uint32_t got[4] = {0}, *want = th_pattern(16, sh->seed[i]);
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, 0);
  if (s != GPUIPC_OK) {
    fprintf(stderr, "thread %d iteration %d buffer %d: ctx_enter: %s: %s\n",
            w->id, it, i, gpuipc_status_name(s), gpuipc_last_error());
    atomic_fetch_add(&sh->failures, 1);
    free(want);
    return;
  }
  CUresult r = gpuipc__cu.cuMemcpyDtoH(
      got, (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b), 16);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr,
            "thread %d iteration %d buffer %d (%s): reading %p: "
            "cuMemcpyDtoH returned %d\n",
            w->id, it, i, gpuipc_pool_kind_name(gpuipc_buffer_get_kind(b)),
            gpuipc_buffer_get_ptr(b), (int)r);
    atomic_fetch_add(&sh->failures, 1);
  } else if (memcmp(got, want, 16) != 0) {
    fprintf(stderr,
            "thread %d iteration %d buffer %d (%s): %p reads %08x %08x, "
            "want %08x %08x\n",
            w->id, it, i, gpuipc_pool_kind_name(gpuipc_buffer_get_kind(b)),
            gpuipc_buffer_get_ptr(b), got[0], got[1], want[0], want[1]);
    atomic_fetch_add(&sh->failures, 1);
  }
  gpuipc__ctx_leave(&g);
  free(want);
}

static void close_check(worker *w, gpuipc_buffer *b, int it) {
  void *p = gpuipc_buffer_get_ptr(b);
  gpuipc_pool_kind k = gpuipc_buffer_get_kind(b);
  gpuipc_status s = gpuipc_buffer_close(b);
  if (s != GPUIPC_OK) {
    fprintf(stderr, "thread %d iteration %d: closing %s import %p: %s: %s\n",
            w->id, it, gpuipc_pool_kind_name(k), p, gpuipc_status_name(s),
            gpuipc_last_error());
    atomic_fetch_add(&w->sh->failures, 1);
  }
}

static void *work(void *arg) {
  worker *w = arg;
  shared *sh = w->sh;
  gpuipc_buffer *held[4] = {NULL};
  for (int it = 0; it < ITERS; it++) {
    int i = (w->id * 7 + it) % NBUF;
    gpuipc_buffer *b = NULL;
    int nfds = sh->fd[i] >= 0 ? 1 : 0;
    gpuipc_status s = gpuipc_buffer_import(sh->desc[i], sh->len[i], &sh->fd[i],
                                           nfds, NULL, &b);
    if (s != GPUIPC_OK) {
      fprintf(stderr, "thread %d iteration %d: import of buffer %d: %s: %s\n",
              w->id, it, i, gpuipc_status_name(s), gpuipc_last_error());
      atomic_fetch_add(&sh->failures, 1);
      continue;
    }
    if (sh->anchor[i] && gpuipc_buffer_get_ptr(b) != sh->anchor[i]) {
      fprintf(stderr, "thread %d iteration %d: buffer %d mapped twice (%p, "
              "%p)\n", w->id, it, i, gpuipc_buffer_get_ptr(b), sh->anchor[i]);
      atomic_fetch_add(&sh->failures, 1);
    }
    if (it % 37 == 0 || sh->read_every)
      read_check(w, i, b, it);
    /* Keep a few imports open for a while, so closes interleave. */
    int k = it % 4;
    if (held[k])
      close_check(w, held[k], it);
    held[k] = b;
  }
  for (int k = 0; k < 4; k++)
    if (held[k])
      close_check(w, held[k], ITERS);
  return NULL;
}

static void run_threads(shared *sh) {
  atomic_store(&sh->failures, 0);
  pthread_t t[NTHREADS];
  worker w[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    w[i].sh = sh;
    w[i].id = i;
    ASSERT_EQ(pthread_create(&t[i], NULL, work, &w[i]), 0);
  }
  for (int i = 0; i < NTHREADS; i++)
    ASSERT_EQ(pthread_join(t[i], NULL), 0);
}

TEST_IMPL(handle_threads_concurrent_imports) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  static shared sh;
  memset(&sh, 0, sizeof sh);
  gpuipc_pool_kind kinds[NBUF] = {GPUIPC_POOL_LEGACY,  GPUIPC_POOL_LEGACY,
                                  GPUIPC_POOL_MEMPOOL, GPUIPC_POOL_MEMPOOL,
                                  GPUIPC_POOL_VMM,     GPUIPC_POOL_PINNED_HOST};
  uint64_t slots[NBUF];
  for (int i = 0; i < NBUF; i++) {
    int nfds = 1;
    sh.fd[i] = -1;
    sh.seed[i] = 1000 + (uint32_t)i;
    slots[i] = th_peer_export(sock, kinds[i], 65536, sh.seed[i], sh.desc[i],
                              &sh.len[i], &sh.fd[i], &nfds);
    if (nfds == 0)
      sh.fd[i] = -1;
  }
  gpuipc_cache_stats a = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&a));

  /* Round 1: an anchor reference on each buffer. */
  gpuipc_buffer *anchor[NBUF];
  for (int i = 0; i < NBUF; i++) {
    int nfds = sh.fd[i] >= 0 ? 1 : 0;
    ASSERT_OK(gpuipc_buffer_import(sh.desc[i], sh.len[i], &sh.fd[i], nfds,
                                   NULL, &anchor[i]));
    sh.anchor[i] = gpuipc_buffer_get_ptr(anchor[i]);
  }
  gpuipc_cache_stats b = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&b));
  run_threads(&sh);
  ASSERT_EQ(atomic_load(&sh.failures), 0);
  gpuipc_cache_stats c = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&c));
  ASSERT_EQ(c.driver_opens, b.driver_opens); /* all hits */
  ASSERT_EQ(c.driver_closes, b.driver_closes);
  ASSERT_EQ(c.hits, b.hits + (uint64_t)NTHREADS * ITERS);
  ASSERT_EQ(c.live_mappings, a.live_mappings + NBUF);
  for (int i = 0; i < NBUF; i++) {
    ASSERT_OK(gpuipc_buffer_close(anchor[i]));
    sh.anchor[i] = NULL;
  }

  /* Round 2: no anchor: opens and closes race. */
  run_threads(&sh);
  ASSERT_EQ(atomic_load(&sh.failures), 0);
  gpuipc_cache_stats d = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&d));
  ASSERT_EQ(d.live_mappings, a.live_mappings);
  ASSERT_EQ(d.driver_opens - d.pool_imports - (a.driver_opens - a.pool_imports),
            d.driver_closes - a.driver_closes);
  ASSERT_LE(d.pool_imports, a.pool_imports + 1); /* one exporter pool */
  printf("round 2: %llu opens, %llu hits\n",
         (unsigned long long)(d.driver_opens - c.driver_opens),
         (unsigned long long)(d.hits - c.hits));

  for (int i = 0; i < NBUF; i++) {
    if (sh.fd[i] >= 0)
      close(sh.fd[i]);
    th_peer_free(sock, slots[i]);
  }
  th_peer_stop(pid, sock);
  return 0;
}

/* Imports and closes of the same mempool and legacy buffers, every import
 * read through at once: a close in flight must never free the mapping a
 * concurrent import of the same buffer was handed (the driver returns the
 * existing import of a pool pointer rather than a new one). */
TEST_IMPL(handle_threads_reopen_while_closing) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  static shared sh;
  memset(&sh, 0, sizeof sh);
  sh.read_every = true;
  uint64_t slots[NBUF];
  for (int i = 0; i < NBUF; i++) {
    int nfds = 1;
    sh.fd[i] = -1;
    sh.seed[i] = 2000 + (uint32_t)i;
    slots[i] = th_peer_export(sock, i % 2 ? GPUIPC_POOL_LEGACY
                                          : GPUIPC_POOL_MEMPOOL,
                              4096, sh.seed[i], sh.desc[i], &sh.len[i],
                              &sh.fd[i], &nfds);
    if (nfds == 0)
      sh.fd[i] = -1;
  }
  gpuipc_cache_stats a = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&a));
  for (int round = 0; round < 4; round++) {
    run_threads(&sh);
    ASSERT_EQ(atomic_load(&sh.failures), 0);
  }
  gpuipc_cache_stats d = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&d));
  ASSERT_EQ(d.live_mappings, a.live_mappings);
  for (int i = 0; i < NBUF; i++) {
    if (sh.fd[i] >= 0)
      close(sh.fd[i]);
    th_peer_free(sock, slots[i]);
  }
  th_peer_stop(pid, sock);
  return 0;
}
