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
  atomic_int failures;
} shared;

typedef struct worker {
  shared *sh;
  int id;
} worker;

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
      fprintf(stderr, "thread %d import %d: %s: %s\n", w->id, i,
              gpuipc_status_name(s), gpuipc_last_error());
      atomic_fetch_add(&sh->failures, 1);
      continue;
    }
    if (sh->anchor[i] && gpuipc_buffer_get_ptr(b) != sh->anchor[i]) {
      fprintf(stderr, "thread %d: buffer %d mapped twice (%p, %p)\n", w->id,
              i, gpuipc_buffer_get_ptr(b), sh->anchor[i]);
      atomic_fetch_add(&sh->failures, 1);
    }
    if (it % 37 == 0) {
      /* Read the first words through the mapping. */
      uint32_t got[4], *want = th_pattern(16, sh->seed[i]);
      gpuipc__ctx_guard g;
      if (gpuipc__ctx_enter(&g, 0) == GPUIPC_OK) {
        if (gpuipc__cu.cuMemcpyDtoH(got, (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b),
                                    16) != CUDA_SUCCESS ||
            memcmp(got, want, 16) != 0)
          atomic_fetch_add(&sh->failures, 1);
        gpuipc__ctx_leave(&g);
      }
      free(want);
    }
    /* Keep a few imports open for a while, so closes interleave. */
    int k = it % 4;
    if (held[k] && gpuipc_buffer_close(held[k]) != GPUIPC_OK)
      atomic_fetch_add(&sh->failures, 1);
    held[k] = b;
  }
  for (int k = 0; k < 4; k++)
    if (gpuipc_buffer_close(held[k]) != GPUIPC_OK)
      atomic_fetch_add(&sh->failures, 1);
  return NULL;
}

static void run_threads(shared *sh) {
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
