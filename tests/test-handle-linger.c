/*
 * test-handle-linger.c: the import cache's linger: a mapping whose last
 * close went stays idle, and the next import of the same allocation is a
 * hit with no driver call; it closes when its time is up (the cache's clock
 * moved by the test, no sleeping), when more than the count are idle, when
 * the exporter frees the allocation (kinds with a generation) or exits, on
 * gpuipc_cache_trim(), and never serves another allocation at the same
 * address. The suite runs with GPUIPC_IMPORT_LINGER_MS=0; these tests set
 * the linger themselves.
 */
#include "test-handle.h"

#include <unistd.h>

static gpuipc_cache_stats stats(void) {
  gpuipc_cache_stats s = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&s));
  return s;
}

#define HOUR_MS 3600000L

static uint64_t opens(const gpuipc_cache_stats *s) {
  return s->driver_opens - s->pool_imports;
}

/* Import, close, import again within the window: one driver open, no
 * close; then the window passes and the mapping closes. */
static int hit_within_window(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  gpuipc__cache_linger_set(HOUR_MS, 8);
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t slot = th_peer_export(sock, kind, 65536, 3, d, &len, fds, &nfds);
  gpuipc_cache_stats a = stats();
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  ASSERT(th_check(b, 0, 65536, 3));
  void *ptr = gpuipc_buffer_get_ptr(b);
  ASSERT_OK(gpuipc_buffer_close(b));
  gpuipc_cache_stats c = stats();
  ASSERT_EQ(c.driver_closes, a.driver_closes); /* kept */
  ASSERT_EQ(c.idle_mappings, 1);
  ASSERT_EQ(c.linger_kept, a.linger_kept + 1);
  ASSERT_EQ(c.live_mappings, a.live_mappings + 1);

  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  gpuipc_cache_stats h = stats();
  ASSERT_EQ(h.hits, c.hits + 1);
  ASSERT_EQ(h.linger_hits, c.linger_hits + 1);
  ASSERT_EQ(opens(&h), opens(&a) + 1); /* still the one open */
  ASSERT_EQ(h.idle_mappings, 0);
  ASSERT_PTR_EQ(gpuipc_buffer_get_ptr(b), ptr);
  ASSERT(th_check(b, 0, 65536, 3));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_EQ(stats().idle_mappings, 1);

  /* Not yet: half the window. */
  ASSERT_EQ(gpuipc__cache_test_advance(HOUR_MS / 2), 0);
  ASSERT_EQ(stats().driver_closes, a.driver_closes);
  ASSERT_EQ(stats().idle_mappings, 1);
  /* Now. */
  ASSERT_EQ(gpuipc__cache_test_advance(HOUR_MS / 2), 1);
  gpuipc_cache_stats z = stats();
  ASSERT_EQ(z.driver_closes, a.driver_closes + 1);
  ASSERT_EQ(z.idle_mappings, 0);
  ASSERT_EQ(z.live_mappings, a.live_mappings);
  ASSERT_EQ(z.linger_drops, a.linger_drops + 1);

  /* And the next import opens anew. */
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT_EQ(stats().misses, z.misses + 1);
  ASSERT(th_check(b, 0, 65536, 3));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_cache_trim());
  ASSERT_EQ(stats().idle_mappings, 0);
  ASSERT_EQ(stats().live_mappings, a.live_mappings);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_linger_hit_within_window_legacy) {
  return hit_within_window(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_linger_hit_within_window_vmm) {
  return hit_within_window(GPUIPC_POOL_VMM);
}
TEST_IMPL(handle_linger_hit_within_window_mempool) {
  return hit_within_window(GPUIPC_POOL_MEMPOOL);
}

/* More idle mappings than the count: the oldest closes at once. */
TEST_IMPL(handle_linger_count_bound) {
  ASSERT_OK(gpuipc_init());
  gpuipc__cache_linger_set(HOUR_MS, 2);
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  enum { N = 3 };
  uint8_t d[N][GPUIPC_DESC_MAX];
  size_t len[N];
  uint64_t slot[N];
  gpuipc_buffer *b[N];
  for (int i = 0; i < N; i++) {
    int fds[1] = {-1}, nfds = 1;
    slot[i] = th_peer_export(sock, GPUIPC_POOL_LEGACY, 65536, 40u + (unsigned)i,
                             d[i], &len[i], fds, &nfds);
    ASSERT_OK(gpuipc_buffer_import(d[i], len[i], fds, nfds, NULL, &b[i]));
    th_close_fds(fds, nfds);
  }
  gpuipc_cache_stats a = stats();
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_buffer_close(b[i]));
  gpuipc_cache_stats c = stats();
  ASSERT_EQ(c.idle_mappings, 2);
  ASSERT_EQ(c.driver_closes, a.driver_closes + 1);
  ASSERT_EQ(c.linger_drops, a.linger_drops + 1);
  /* The first closed (the oldest): importing it again is a miss, the
   * last two are hits. */
  int fds0[1] = {-1};
  ASSERT_OK(gpuipc_buffer_import(d[N - 1], len[N - 1], fds0, 0, NULL, &b[0]));
  ASSERT(th_check(b[0], 0, 65536, 40u + N - 1));
  ASSERT_EQ(stats().linger_hits, c.linger_hits + 1);
  ASSERT_OK(gpuipc_buffer_close(b[0]));
  ASSERT_OK(gpuipc_buffer_import(d[0], len[0], fds0, 0, NULL, &b[0]));
  ASSERT(th_check(b[0], 0, 65536, 40));
  ASSERT_EQ(stats().misses, c.misses + 1);
  ASSERT_OK(gpuipc_buffer_close(b[0]));
  /* A lower count applies at once. */
  gpuipc__cache_linger_set(HOUR_MS, 1);
  ASSERT_EQ(stats().idle_mappings, 1);
  ASSERT_OK(gpuipc_cache_trim());
  gpuipc_cache_stats z = stats();
  ASSERT_EQ(z.idle_mappings, 0);
  ASSERT_EQ(z.driver_opens - z.pool_imports, z.driver_closes);
  for (int i = 0; i < N; i++)
    th_peer_free(sock, slot[i]);
  th_peer_stop(pid, sock);
  return 0;
}

/* The exporter frees the allocation (a kind with a generation): the idle
 * mapping goes without waiting for its time; and one whose exporter exits
 * goes too. */
static int freed_early(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  gpuipc__cache_linger_set(HOUR_MS, 8);
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t slot = th_peer_export(sock, kind, 65536, 5, d, &len, fds, &nfds);
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT_OK(gpuipc_buffer_close(b));
  gpuipc_cache_stats a = stats();
  ASSERT_EQ(a.idle_mappings, 1);
  ASSERT_EQ(gpuipc__cache_test_advance(0), 0); /* alive, not freed: stays */
  th_peer_free(sock, slot);
  /* Closed by this call, or by the cache's thread already. */
  (void)gpuipc__cache_test_advance(0);
  gpuipc_cache_stats c = stats();
  ASSERT_EQ(c.idle_mappings, 0);
  ASSERT_EQ(c.driver_closes, a.driver_closes + 1);
  /* The descriptor is stale now, and no hit hides it. */
  ASSERT_STATUS(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b), GPUIPC_E_STALE);

  /* An idle mapping of an exporter that exits. */
  nfds = 1;
  slot = th_peer_export(sock, kind, 65536, 6, d, &len, fds, &nfds);
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_EQ(stats().idle_mappings, 1);
  th_peer_stop(pid, sock);
  (void)gpuipc__cache_test_advance(0);
  gpuipc_cache_stats z = stats();
  ASSERT_EQ(z.idle_mappings, 0);
  ASSERT_EQ(z.live_mappings, 0);
  ASSERT_EQ(z.driver_opens - z.pool_imports, z.driver_closes);
  return 0;
}

TEST_IMPL(handle_linger_freed_early_vmm) {
  return freed_early(GPUIPC_POOL_VMM);
}
TEST_IMPL(handle_linger_freed_early_pinned_host) {
  return freed_early(GPUIPC_POOL_PINNED_HOST);
}

/* The exporter frees a buffer whose mapping is idle here and allocates
 * another at its address: the new one's import gives the new memory, never
 * the idle mapping (legacy memory has no generation: the buffer id tells). */
static int realloc_under_idle(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  gpuipc__cache_linger_set(HOUR_MS, 8);
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  const size_t n = 1u << 20;
  uint64_t slot = th_peer_export(sock, kind, n, 10, d, &len, fds, &nfds);
  gpuipc_buffer *a = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &a));
  th_close_fds(fds, nfds);
  ASSERT(th_check(a, 0, n, 10));
  ASSERT_OK(gpuipc_buffer_close(a));
  ASSERT_EQ(stats().idle_mappings, 1);

  harness_send_u64(sock, TH_OP_REALLOC);
  harness_send_u64(sock, slot);
  harness_send_u64(sock, 20);
  nfds = 1;
  ssize_t l2 = harness_recv(sock, d, sizeof d, fds, &nfds);
  ASSERT_GT(l2, 0);
  uint64_t same = harness_recv_u64(sock);
  printf("exporter reallocated at the same address: %s\n", same ? "yes" : "no");
  gpuipc_cache_stats s0 = stats();
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, (size_t)l2, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  gpuipc_cache_stats s1 = stats();
  ASSERT_EQ(s1.hits, s0.hits); /* never the idle entry */
  ASSERT(th_check(b, 0, n, 20));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_cache_trim());
  gpuipc_cache_stats s2 = stats();
  ASSERT_EQ(s2.live_mappings, 0);
  ASSERT_EQ(s2.driver_opens - s2.pool_imports, s2.driver_closes);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_linger_realloc_under_idle_legacy) {
  return realloc_under_idle(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_linger_realloc_under_idle_mempool) {
  return realloc_under_idle(GPUIPC_POOL_MEMPOOL);
}

/* With the linger off (0), the last close closes at once. */
TEST_IMPL(handle_linger_off) {
  ASSERT_OK(gpuipc_init());
  gpuipc__cache_linger_set(0, 8);
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t slot =
      th_peer_export(sock, GPUIPC_POOL_LEGACY, 65536, 7, d, &len, fds, &nfds);
  gpuipc_cache_stats a = stats();
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  ASSERT_OK(gpuipc_buffer_close(b));
  gpuipc_cache_stats c = stats();
  ASSERT_EQ(c.driver_closes, a.driver_closes + 1);
  ASSERT_EQ(c.idle_mappings, 0);
  ASSERT_EQ(c.linger_kept, a.linger_kept);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}
