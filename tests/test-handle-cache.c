/*
 * test-handle-cache.c: the import cache: hits, misses and close counts; a
 * new allocation at a freed buffer's address is never mistaken for the old
 * one; a descriptor whose buffer id does not match the mapping is refused
 * and retires the cached entry without unmapping it under its holders.
 */
#include "test-handle.h"

#include <unistd.h>

static gpuipc_cache_stats stats(void) {
  gpuipc_cache_stats s = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&s));
  return s;
}

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void reseal(uint8_t *d, size_t len) {
  memset(d + 12, 0, 4);
  uint32_t c = gpuipc__crc32c(0, d, len);
  for (int i = 0; i < 4; i++)
    d[12 + i] = (uint8_t)(c >> (8 * i));
}

static int hit_miss_close(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t slot = th_peer_export(sock, kind, 65536, 1, d, &len, fds, &nfds);
  gpuipc_cache_stats a = stats();
  gpuipc_buffer *b1 = NULL, *b2 = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b1));
  gpuipc_cache_stats m = stats();
  ASSERT_EQ(m.misses, a.misses + 1);
  ASSERT_EQ(m.hits, a.hits);
  ASSERT_EQ(m.live_mappings, a.live_mappings + 1);
  ASSERT_EQ(m.driver_opens - m.pool_imports, a.driver_opens - a.pool_imports + 1);
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b2));
  th_close_fds(fds, nfds);
  gpuipc_cache_stats h = stats();
  ASSERT_EQ(h.hits, m.hits + 1);
  ASSERT_EQ(h.misses, m.misses);
  ASSERT_EQ(h.driver_opens, m.driver_opens);
  ASSERT_EQ(h.live_mappings, m.live_mappings);
  ASSERT_PTR_EQ(gpuipc_buffer_get_ptr(b1), gpuipc_buffer_get_ptr(b2));
  ASSERT_PTR_NE(b1, b2);
  ASSERT(th_check(b2, 0, 65536, 1));
  ASSERT_OK(gpuipc_buffer_close(b1));
  gpuipc_cache_stats c1 = stats();
  ASSERT_EQ(c1.driver_closes, h.driver_closes);
  ASSERT_EQ(c1.live_mappings, h.live_mappings);
  ASSERT(th_check(b2, 0, 65536, 1)); /* still mapped */
  ASSERT_OK(gpuipc_buffer_close(b2));
  gpuipc_cache_stats c2 = stats();
  ASSERT_EQ(c2.driver_closes, h.driver_closes + 1);
  ASSERT_EQ(c2.live_mappings, a.live_mappings);
  /* After the last close, an import opens anew (a miss). */
  nfds = 1;
  th_peer_free(sock, slot);
  slot = th_peer_export(sock, kind, 65536, 2, d, &len, fds, &nfds);
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b1));
  th_close_fds(fds, nfds);
  ASSERT(th_check(b1, 0, 65536, 2));
  ASSERT_EQ(stats().misses, c2.misses + 1);
  ASSERT_OK(gpuipc_buffer_close(b1));
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_cache_hit_miss_close_legacy) {
  return hit_miss_close(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_cache_hit_miss_close_mempool) {
  return hit_miss_close(GPUIPC_POOL_MEMPOOL);
}
TEST_IMPL(handle_cache_hit_miss_close_vmm) {
  return hit_miss_close(GPUIPC_POOL_VMM);
}
TEST_IMPL(handle_cache_hit_miss_close_pinned_host) {
  return hit_miss_close(GPUIPC_POOL_PINNED_HOST);
}

/* The exporter frees a buffer this process still holds and allocates a new
 * one at the same address: importing the new one must give the new memory,
 * never the cached old mapping. */
static int realloc_same_address(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  const size_t n = 1u << 20;
  uint64_t slot = th_peer_export(sock, kind, n, 10, d, &len, fds, &nfds);
  gpuipc_desc_info ia = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, len, &ia));
  gpuipc_buffer *a = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &a));
  th_close_fds(fds, nfds);
  ASSERT(th_check(a, 0, n, 10));

  harness_send_u64(sock, TH_OP_REALLOC);
  harness_send_u64(sock, slot);
  harness_send_u64(sock, 20);
  nfds = 1;
  ssize_t l2 = harness_recv(sock, d, sizeof d, fds, &nfds);
  ASSERT_GT(l2, 0);
  uint64_t same = harness_recv_u64(sock);
  printf("exporter reallocated at the same address: %s\n", same ? "yes" : "no");
  gpuipc_desc_info ib = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, (size_t)l2, &ib));
  ASSERT_NE(ib.generation, ia.generation);
  ASSERT_NE(ib.buffer_id, ia.buffer_id);

  gpuipc_cache_stats s0 = stats();
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_import(d, (size_t)l2, fds, nfds, NULL, &b);
  th_close_fds(fds, nfds);
  gpuipc_cache_stats s1 = stats();
  ASSERT_EQ(s1.hits, s0.hits); /* never the old entry */
  if (s == GPUIPC_OK) {
    ASSERT(th_check(b, 0, n, 20));
    ASSERT_OK(gpuipc_buffer_close(b));
  } else {
    /* The driver may hand back the old mapping while this process still
     * holds it: then the import must say so, not return stale memory. */
    ASSERT_STATUS(s, GPUIPC_E_STALE);
  }
  ASSERT_OK(gpuipc_buffer_close(a));
  /* With the old import closed, the new buffer imports and is fresh. */
  nfds = 1;
  th_peer_free(sock, slot);
  slot = th_peer_export(sock, kind, n, 30, d, &len, fds, &nfds);
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT(th_check(b, 0, n, 30));
  ASSERT_OK(gpuipc_buffer_close(b));
  gpuipc_cache_stats s2 = stats();
  ASSERT_EQ(s2.live_mappings, 0);
  ASSERT_EQ(s2.driver_opens - s2.pool_imports, s2.driver_closes);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_cache_realloc_same_address_legacy) {
  return realloc_same_address(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_cache_realloc_same_address_mempool) {
  return realloc_same_address(GPUIPC_POOL_MEMPOOL);
}

/* Same handle bytes, another exporter buffer id: what a new allocation at a
 * freed address looks like on drivers whose handle bytes depend only on the
 * address. The exporter's buffer id is identity only (importers never see it
 * on their own mappings: driver 580 gives imports importer-local ids), so
 * this is not compared with the driver: the cached entry, keyed by the same
 * handle bytes, is retired (not returned, not unmapped under its holder);
 * the open hands back the address this process still holds for another
 * allocation, which is refused as stale; the genuine descriptor still
 * imports. */
static int forged_buffer_id(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], f[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  const size_t n = 65536;
  uint64_t slot = th_peer_export(sock, kind, n, 40, d, &len, fds, &nfds);
  gpuipc_buffer *a = NULL, *b = NULL, *c = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &a));
  gpuipc_cache_stats s0 = stats();
  memcpy(f, d, len);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, len, &info));
  put64(f + 88, info.buffer_id + 1000);
  reseal(f, len);
  ASSERT_STATUS(gpuipc_buffer_import(f, len, fds, nfds, NULL, &b),
                GPUIPC_E_STALE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "still holds an import");
  gpuipc_cache_stats s1 = stats();
  ASSERT_EQ(s1.stale, s0.stale + 1);
  ASSERT_EQ(s1.hits, s0.hits);
  ASSERT_EQ(s1.live_mappings, s0.live_mappings);
  ASSERT(th_check(a, 0, n, 40)); /* the holder keeps its mapping */
  /* The genuine descriptor: the retired entry is not found again, so this
   * opens anew; the driver gives the same mapping. */
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &c));
  th_close_fds(fds, nfds);
  ASSERT_PTR_EQ(gpuipc_buffer_get_ptr(c), gpuipc_buffer_get_ptr(a));
  ASSERT(th_check(c, 0, n, 40));
  ASSERT_OK(gpuipc_buffer_close(c));
  ASSERT(th_check(a, 0, n, 40)); /* closing c did not unmap a */
  th_fill(a, 0, n, 41);
  ASSERT(th_peer_check(sock, slot, 0, n, 41));
  ASSERT_OK(gpuipc_buffer_close(a));
  gpuipc_cache_stats s2 = stats();
  ASSERT_EQ(s2.live_mappings, 0);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_cache_forged_buffer_id_legacy) {
  return forged_buffer_id(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_cache_forged_buffer_id_mempool) {
  return forged_buffer_id(GPUIPC_POOL_MEMPOOL);
}

/* Importing the same exporter pool twice is free the second time. */
TEST_IMPL(handle_cache_pool_import_once) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t s1 = th_peer_export(sock, GPUIPC_POOL_MEMPOOL, 4096, 1, d, &len,
                               fds, &nfds);
  gpuipc_cache_stats a = stats();
  gpuipc_buffer *b[3];
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b[0]));
  th_close_fds(fds, nfds);
  nfds = 1;
  uint64_t s2 = th_peer_export(sock, GPUIPC_POOL_MEMPOOL, 4096, 2, d, &len,
                               fds, &nfds);
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b[1]));
  th_close_fds(fds, nfds);
  nfds = 1;
  uint64_t s3 = th_peer_export(sock, GPUIPC_POOL_MEMPOOL, 4096, 3, d, &len,
                               fds, &nfds);
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b[2]));
  th_close_fds(fds, nfds);
  gpuipc_cache_stats c = stats();
  ASSERT_EQ(c.pool_imports, a.pool_imports + 1);
  ASSERT_EQ(c.pool_hits, a.pool_hits + 2);
  for (int i = 0; i < 3; i++) {
    ASSERT(th_check(b[i], 0, 4096, (uint32_t)i + 1));
    ASSERT_OK(gpuipc_buffer_close(b[i]));
  }
  th_peer_free(sock, s1);
  th_peer_free(sock, s2);
  th_peer_free(sock, s3);
  th_peer_stop(pid, sock);
  return 0;
}

/* GPUIPC_IMPORT_NO_CACHE: a private mapping per import for fd kinds. */
TEST_IMPL(handle_cache_no_cache_flag) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t slot =
      th_peer_export(sock, GPUIPC_POOL_VMM, 65536, 5, d, &len, fds, &nfds);
  gpuipc_import_options o = GPUIPC_IMPORT_OPTIONS_INIT;
  o.flags = GPUIPC_IMPORT_NO_CACHE;
  gpuipc_buffer *a = NULL, *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, &o, &a));
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, &o, &b));
  th_close_fds(fds, nfds);
  ASSERT_PTR_NE(gpuipc_buffer_get_ptr(a), gpuipc_buffer_get_ptr(b));
  ASSERT(th_check(a, 0, 65536, 5));
  th_fill(a, 0, 65536, 6);
  ASSERT(th_check(b, 0, 65536, 6)); /* the same memory, mapped twice */
  ASSERT_OK(gpuipc_buffer_close(a));
  ASSERT(th_check(b, 0, 65536, 6));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_EQ(stats().live_mappings, 0);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

/* A cached mapping closed behind the cache's back (here: the driver call
 * made directly) is no longer handed out: a hit re-reads the mapping's own
 * buffer id, recorded when it was opened, and the entry is retired and the
 * descriptor opened anew. White-box: the emulator only, where closing a
 * mapping twice is reported rather than undefined. */
TEST_IMPL(handle_cache_mapping_replaced_under_it) {
  REQUIRE_EMULATOR("closes a cached mapping behind the cache's back");
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int nfds = 0;
  const size_t n = 65536;
  uint64_t slot =
      th_peer_export(sock, GPUIPC_POOL_LEGACY, n, 50, d, &len, NULL, &nfds);
  gpuipc_buffer *a = NULL, *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, NULL, 0, NULL, &a));
  gpuipc_cache_stats s0 = stats();
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(th_info(a).base));
  gpuipc__ctx_leave(&g);
  ASSERT_OK(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b));
  gpuipc_cache_stats s1 = stats();
  ASSERT_EQ(s1.hits, s0.hits);
  ASSERT_EQ(s1.stale, s0.stale + 1);
  ASSERT(th_check(b, 0, n, 50));
  ASSERT_OK(gpuipc_buffer_close(b));
  /* a's mapping was closed already: its close may be refused. */
  gpuipc_status s = gpuipc_buffer_close(a);
  printf("closing the entry closed behind its back: %s\n",
         gpuipc_status_name(s));
  ASSERT_EQ(stats().live_mappings, 0);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}
