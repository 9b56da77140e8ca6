/*
 * test-interop.c: the raw interop API against "another program" that uses
 * nothing but the CUDA driver API (as CuPy and cuda.core do underneath): a
 * helper process exports legacy handles, pool fds + pointer export data and
 * IPC event handles with the driver directly, and imports what gpuipc
 * exports in raw form the same way.
 */
#include "harness.h"

#include "tree.h"

#include <unistd.h>

#define ALLOC_BYTES ((size_t)1 << 20)

typedef struct raw_msg {
  uint8_t handle[64];
  uint64_t offset;
  uint64_t size;
  gpuipc_uuid device;
  uint32_t seed;  /* the pattern the exporter wrote */
  uint32_t seed2; /* the pattern the importer writes back */
} raw_msg;

static uint32_t word(uint32_t seed, size_t i) {
  return seed * 2654435761u + (uint32_t)i * 40503u + 1u;
}

/* Needs a current context. */
static void put(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = malloc(n);
  ASSERT_NOT_NULL(h);
  for (size_t i = 0; i < n / 4; i++)
    h[i] = word(seed, i);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(p, h, n));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  free(h);
}

static void expect(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = calloc(1, n);
  ASSERT_NOT_NULL(h);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, n));
  for (size_t i = 0; i < n / 4; i++)
    if (h[i] != word(seed, i))
      harness_fail(__FILE__, __LINE__,
                   "pattern %u: word %zu reads 0x%08x, want 0x%08x", seed, i,
                   h[i], word(seed, i));
  free(h);
}

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

static void recv_msg(int sock, raw_msg *m, int *fd) {
  int fds[1] = {-1};
  int nfds = fd ? 1 : 0;
  ssize_t n = harness_recv(sock, m, sizeof *m, fd ? fds : NULL, &nfds);
  ASSERT_EQ(n, (ssize_t)sizeof *m);
  if (fd) {
    ASSERT_EQ(nfds, 1);
    *fd = fds[0];
  }
}

static void make_pool(CUmemoryPool *pool) {
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  ASSERT_CU(gpuipc__cu.cuMemPoolCreate(pool, &props));
}

/* ---- the other program -------------------------------------------------------- */

HELPER_IMPL(interop_raw_peer) {
  ASSERT_EQ(argc, 1);
  const char *mode = argv[0];
  int sock = harness_helper_fd();
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_uuid dev;
  ASSERT_OK(gpuipc_device_uuid(0, &dev));

  if (strcmp(mode, "legacy-export") == 0) {
    /* A caching allocator's view: one big allocation, the "array" inside. */
    CUdeviceptr base = 0;
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&base, ALLOC_BYTES));
    raw_msg m;
    memset(&m, 0, sizeof m);
    m.offset = 256 * 1024;
    m.size = 64 * 1024;
    m.device = dev;
    m.seed = 7;
    put(base + m.offset, (size_t)m.size, m.seed);
    CUipcMemHandle h;
    /* The handle of the interior pointer is the base's: send the offset. */
    ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&h, base + m.offset));
    memcpy(m.handle, &h, 64);
    harness_send(sock, &m, sizeof m, NULL, 0);
    ASSERT_EQ(harness_recv_u64(sock), 1); /* imported and closed */
    expect(base + m.offset, (size_t)m.size, 8); /* the importer's write */
    ASSERT_CU(gpuipc__cu.cuMemFree(base));
    harness_send_u64(sock, 2); /* freed */
    ASSERT_EQ(harness_recv_u64(sock), 3);
  } else if (strcmp(mode, "legacy-import") == 0) {
    raw_msg m;
    recv_msg(sock, &m, NULL);
    CUipcMemHandle h;
    memcpy(&h, m.handle, 64);
    CUdeviceptr base = 0;
    ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&base, h,
                                            CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    expect(base + m.offset, (size_t)m.size, m.seed);
    put(base + m.offset, (size_t)m.size, m.seed2);
    ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(base));
    harness_send_u64(sock, 1);
  } else if (strcmp(mode, "mempool-export") == 0) {
    /* Three buffers: two of pool A (its fd sent twice), one of pool B. */
    CUmemoryPool pool[2];
    int fd[2] = {-1, -1};
    for (int k = 0; k < 2; k++) {
      make_pool(&pool[k]);
      ASSERT_CU(gpuipc__cu.cuMemPoolExportToShareableHandle(
          &fd[k], pool[k], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    }
    CUdeviceptr p[3] = {0, 0, 0};
    for (int i = 0; i < 3; i++) {
      ASSERT_CU(gpuipc__cu.cuMemAllocFromPoolAsync(&p[i], ALLOC_BYTES,
                                                   pool[i / 2], NULL));
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
      raw_msg m;
      memset(&m, 0, sizeof m);
      m.offset = (uint64_t)i * 4096;
      m.size = ALLOC_BYTES / 2;
      m.device = dev;
      m.seed = 20 + (uint32_t)i;
      put(p[i] + m.offset, (size_t)m.size, m.seed);
      CUmemPoolPtrExportData e;
      ASSERT_CU(gpuipc__cu.cuMemPoolExportPointer(&e, p[i]));
      memcpy(m.handle, &e, 64);
      harness_send(sock, &m, sizeof m, &fd[i / 2], 1);
    }
    close(fd[0]);
    close(fd[1]);
    ASSERT_EQ(harness_recv_u64(sock), 1);
    for (int i = 0; i < 3; i++) {
      expect(p[i] + (uint64_t)i * 4096, ALLOC_BYTES / 2, 40 + (uint32_t)i);
      ASSERT_CU(gpuipc__cu.cuMemFreeAsync(p[i], NULL));
    }
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
    for (int k = 0; k < 2; k++)
      ASSERT_CU(gpuipc__cu.cuMemPoolDestroy(pool[k]));
    harness_send_u64(sock, 2);
  } else if (strcmp(mode, "mempool-import") == 0) {
    raw_msg m;
    int fd = -1;
    recv_msg(sock, &m, &fd);
    CUmemoryPool pool;
    ASSERT_CU(gpuipc__cu.cuMemPoolImportFromShareableHandle(
        &pool, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        0));
    close(fd);
    CUmemAccessDesc ad;
    memset(&ad, 0, sizeof ad);
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = 0;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_CU(gpuipc__cu.cuMemPoolSetAccess(pool, &ad, 1));
    CUmemPoolPtrExportData e;
    memcpy(&e, m.handle, 64);
    CUdeviceptr p = 0;
    ASSERT_CU(gpuipc__cu.cuMemPoolImportPointer(&p, pool, &e));
    expect(p + m.offset, (size_t)m.size, m.seed);
    put(p + m.offset, (size_t)m.size, m.seed2);
    ASSERT_CU(gpuipc__cu.cuMemFree(p));
    harness_send_u64(sock, 1);
  } else if (strcmp(mode, "event-export") == 0) {
    CUevent ev;
    ASSERT_CU(gpuipc__cu.cuEventCreate(
        &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
    ASSERT_CU(gpuipc__cu.cuEventRecord(ev, NULL));
    CUipcEventHandle h;
    ASSERT_CU(gpuipc__cu.cuIpcGetEventHandle(&h, ev));
    raw_msg m;
    memset(&m, 0, sizeof m);
    memcpy(m.handle, &h, 64);
    m.device = dev;
    harness_send(sock, &m, sizeof m, NULL, 0);
    ASSERT_EQ(harness_recv_u64(sock), 1);
    ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  } else if (strcmp(mode, "event-import") == 0) {
    raw_msg m;
    recv_msg(sock, &m, NULL);
    CUipcEventHandle h;
    memcpy(&h, m.handle, 64);
    CUevent ev;
    ASSERT_CU(gpuipc__cu.cuIpcOpenEventHandle(&ev, h));
    ASSERT_CU(gpuipc__cu.cuStreamWaitEvent(NULL, ev, 0));
    ASSERT_CU(gpuipc__cu.cuEventSynchronize(ev));
    ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
    harness_send_u64(sock, 1);
  } else {
    harness_fail(__FILE__, __LINE__, "unknown mode %s", mode);
  }
  gpuipc__ctx_leave(&g);
  close(sock);
  return 0;
}

/* ---- gpuipc imports what the other program exported --------------------------- */

static void expect_buf(gpuipc_buffer *b, uint32_t seed) {
  gpuipc__ctx_guard g;
  enter0(&g);
  expect((CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b), gpuipc_buffer_get_size(b),
         seed);
  gpuipc__ctx_leave(&g);
}

static void put_buf(gpuipc_buffer *b, size_t off, size_t n, uint32_t seed) {
  gpuipc__ctx_guard g;
  enter0(&g);
  put((CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b) + off, n, seed);
  gpuipc__ctx_leave(&g);
}

TEST_IMPL(interop_legacy_import_raw) {
  REQUIRE_DEVICES(1);
  int sock = -1;
  pid_t pid = spawn_helper("interop_raw_peer", NULL, &sock, "legacy-export", NULL);
  raw_msg m;
  recv_msg(sock, &m, NULL);
  ASSERT_EQ(m.offset, 256 * 1024);

  gpuipc_cache_stats before = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&before));
  gpuipc_buffer *a = NULL, *b = NULL, *bad = NULL;
  ASSERT_OK(gpuipc_buffer_import_legacy_raw(m.handle, (size_t)m.offset,
                                            (size_t)m.size, &m.device, NULL, &a));
  ASSERT_EQ(gpuipc_buffer_is_imported(a), 1);
  ASSERT_EQ(gpuipc_buffer_get_kind(a), GPUIPC_POOL_LEGACY);
  ASSERT_EQ(gpuipc_buffer_get_size(a), m.size);
  gpuipc_uuid u;
  ASSERT_OK(gpuipc_buffer_get_device(a, &u));
  ASSERT_MEM_EQ(u.bytes, m.device.bytes, 16);
  expect_buf(a, m.seed);
  /* The same handle again: the same mapping, one driver open. A view at
   * another offset shares it too. */
  ASSERT_OK(gpuipc_buffer_import_legacy_raw(m.handle, 0, ALLOC_BYTES, NULL,
                                            NULL, &b));
  ASSERT_PTR_EQ((char *)gpuipc_buffer_get_ptr(b) + m.offset, gpuipc_buffer_get_ptr(a));
  gpuipc_cache_stats after = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&after));
  ASSERT_EQ(after.driver_opens - before.driver_opens, 1);
  ASSERT_EQ(after.hits - before.hits, 1);
  /* Offset + size beyond the allocation: refused, nothing leaks. */
  ASSERT_STATUS(gpuipc_buffer_import_legacy_raw(m.handle, 64 * ALLOC_BYTES, 32,
                                                &m.device, NULL, &bad),
                GPUIPC_E_OUT_OF_RANGE);
  ASSERT_NULL(bad);
  ASSERT_STATUS(gpuipc_buffer_import_legacy_raw(m.handle, 0, 0, NULL, NULL, &bad),
                GPUIPC_E_INVALID_ARG);
  /* Raw imports cannot be re-exported (the raw bytes travel instead). */
  uint8_t h2[64];
  ASSERT_STATUS(gpuipc_buffer_export_legacy_raw(a, h2, NULL, NULL, NULL),
                GPUIPC_E_NOT_SUPPORTED);
  /* Writes are seen by the exporter. */
  put_buf(a, 0, (size_t)m.size, 8);
  ASSERT_OK(gpuipc_buffer_close(a));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_cache_get_stats(&after));
  ASSERT_EQ(after.live_mappings, before.live_mappings);
  ASSERT_EQ(after.driver_closes - before.driver_closes, 1);
  harness_send_u64(sock, 1);
  /* Once the exporter freed it, the handle opens nothing. */
  ASSERT_EQ(harness_recv_u64(sock), 2);
  ASSERT_STATUS(gpuipc_buffer_import_legacy_raw(m.handle, (size_t)m.offset,
                                                (size_t)m.size, &m.device, NULL,
                                                &bad),
                GPUIPC_E_STALE);
  harness_send_u64(sock, 3);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  return 0;
}

TEST_IMPL(interop_legacy_import_raw_own_handle) {
  REQUIRE_DEVICES(1);
  /* A handle of this very process: the driver refuses it, gpuipc says why. */
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_LEGACY;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *buf = NULL, *bad = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &buf));
  uint8_t h[64];
  size_t off = 99, size = 0;
  gpuipc_uuid dev;
  ASSERT_OK(gpuipc_buffer_export_legacy_raw(buf, h, &off, &size, &dev));
  ASSERT_EQ(off, 0);
  ASSERT_EQ(size, 4096);
  ASSERT_STATUS(gpuipc_buffer_import_legacy_raw(h, 0, 4096, &dev, NULL, &bad),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "this process");
  ASSERT_NULL(bad);
  ASSERT_OK(gpuipc_buffer_free(buf, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

TEST_IMPL(interop_mempool_import_raw) {
  REQUIRE_DEVICES(1);
  int sock = -1;
  pid_t pid = spawn_helper("interop_raw_peer", NULL, &sock, "mempool-export", NULL);
  gpuipc_cache_stats before = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&before));
  gpuipc_buffer *b[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i++) {
    raw_msg m;
    int fd = -1;
    recv_msg(sock, &m, &fd);
    ASSERT_OK(gpuipc_buffer_import_mempool_raw(fd, m.handle, (size_t)m.offset,
                                               (size_t)m.size, &m.device, NULL,
                                               &b[i]));
    close(fd); /* stays owned by the caller */
    ASSERT_EQ(gpuipc_buffer_get_kind(b[i]), GPUIPC_POOL_MEMPOOL);
    ASSERT_EQ(gpuipc_buffer_get_size(b[i]), m.size);
    expect_buf(b[i], m.seed);
    put_buf(b[i], 0, (size_t)m.size, 40 + (uint32_t)i);
  }
  gpuipc_cache_stats after = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&after));
  /* Two pools: the two buffers of pool A came through one pool import
   * (its fd arrived twice, as two SCM_RIGHTS copies), pool B through its
   * own; no buffer was opened in the wrong pool (the data checks). */
  ASSERT_EQ(after.pool_imports - before.pool_imports, 2);
  /* Bad arguments. */
  gpuipc_buffer *bad = NULL;
  uint8_t zero[64] = {0};
  ASSERT_STATUS(gpuipc_buffer_import_mempool_raw(-1, zero, 0, 16, NULL, NULL,
                                                 &bad),
                GPUIPC_E_INVALID_ARG);
  ASSERT_NULL(bad);
  for (int i = 0; i < 3; i++)
    ASSERT_OK(gpuipc_buffer_close(b[i]));
  harness_send_u64(sock, 1);
  ASSERT_EQ(harness_recv_u64(sock), 2);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  return 0;
}

/* ---- the other program imports what gpuipc exported in raw form ---------------- */

TEST_IMPL(interop_legacy_export_raw) {
  REQUIRE_DEVICES(1);
  gpuipc__ctx_guard g;
  enter0(&g);
  /* A foreign allocation wrapped at an interior offset (a caching
   * allocator's array): the raw export names the base and the offset. */
  CUdeviceptr base = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&base, ALLOC_BYTES));
  gpuipc__ctx_leave(&g);
  gpuipc_buffer *w = NULL;
  ASSERT_OK(gpuipc_buffer_wrap((void *)(uintptr_t)(base + 8192), 16384, &w));
  put_buf(w, 0, 16384, 11);
  raw_msg m;
  memset(&m, 0, sizeof m);
  size_t off = 0, size = 0;
  ASSERT_OK(gpuipc_buffer_export_legacy_raw(w, m.handle, &off, &size, &m.device));
  ASSERT_EQ(off, 8192);
  ASSERT_EQ(size, 16384);
  m.offset = off;
  m.size = size;
  m.seed = 11;
  m.seed2 = 12;
  int sock = -1;
  pid_t pid = spawn_helper("interop_raw_peer", NULL, &sock, "legacy-import", NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_EQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  expect_buf(w, 12);
  ASSERT_OK(gpuipc_buffer_free(w, NULL));
  enter0(&g);
  ASSERT_CU(gpuipc__cu.cuMemFree(base));
  gpuipc__ctx_leave(&g);

  /* Only LEGACY buffers have the legacy form. */
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_MEMPOOL;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *mp = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &mp));
  ASSERT_STATUS(gpuipc_buffer_export_legacy_raw(mp, m.handle, NULL, NULL, NULL),
                GPUIPC_E_NOT_SUPPORTED);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "mempool");
  ASSERT_OK(gpuipc_buffer_free(mp, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

TEST_IMPL(interop_mempool_export_raw) {
  REQUIRE_DEVICES(1);
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_MEMPOOL;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *buf = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, ALLOC_BYTES, NULL, &buf));
  gpuipc__ctx_guard g;
  enter0(&g);
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize()); /* the stream-ordered allocation */
  gpuipc__ctx_leave(&g);
  put_buf(buf, 0, ALLOC_BYTES, 31);
  raw_msg m;
  memset(&m, 0, sizeof m);
  int fd = -1;
  size_t off = 99, size = 0;
  int fds_before = harness_count_fds();
  ASSERT_OK(gpuipc_buffer_export_mempool_raw(buf, &fd, m.handle, &off, &size,
                                             &m.device));
  ASSERT_GE(fd, 0);
  ASSERT_EQ(harness_count_fds(), fds_before + 1);
  ASSERT_EQ(off, 0);
  ASSERT_EQ(size, ALLOC_BYTES);
  m.offset = off;
  m.size = size;
  m.seed = 31;
  m.seed2 = 32;
  int sock = -1;
  pid_t pid = spawn_helper("interop_raw_peer", NULL, &sock, "mempool-import", NULL);
  harness_send(sock, &m, sizeof m, &fd, 1);
  close(fd);
  ASSERT_EQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  expect_buf(buf, 32);
  /* Without an fd out: the export data alone. */
  ASSERT_OK(gpuipc_buffer_export_mempool_raw(buf, NULL, m.handle, NULL, NULL,
                                             NULL));
  ASSERT_EQ(harness_count_fds(), fds_before);
  ASSERT_OK(gpuipc_buffer_free(buf, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));

  /* Only MEMPOOL buffers have that form. */
  po.kind = GPUIPC_POOL_LEGACY;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &buf));
  fd = 5;
  ASSERT_STATUS(gpuipc_buffer_export_mempool_raw(buf, &fd, m.handle, NULL, NULL,
                                                 NULL),
                GPUIPC_E_NOT_SUPPORTED);
  ASSERT_EQ(fd, -1);
  ASSERT_OK(gpuipc_buffer_free(buf, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

/* ---- events both ways ----------------------------------------------------------- */

TEST_IMPL(interop_events_raw) {
  REQUIRE_DEVICES(1);
  /* The other program's event, opened by gpuipc. */
  int sock = -1;
  pid_t pid = spawn_helper("interop_raw_peer", NULL, &sock, "event-export", NULL);
  raw_msg m;
  recv_msg(sock, &m, NULL);
  gpuipc_event *ev = NULL;
  ASSERT_OK(gpuipc_event_import_raw(m.handle, &m.device, &ev));
  ASSERT_NOT_NULL(gpuipc_event_get_handle(ev));
  ASSERT_OK(gpuipc_event_wait(ev, NULL));
  ASSERT_OK(gpuipc_event_synchronize(ev));
  ASSERT_OK(gpuipc_event_query(ev));
  uint8_t h[64];
  ASSERT_STATUS(gpuipc_event_export_raw(ev, h, NULL), GPUIPC_E_NOT_SUPPORTED);
  ASSERT_OK(gpuipc_event_destroy(ev));
  harness_send_u64(sock, 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);

  /* gpuipc's event, opened by the other program. */
  ASSERT_OK(gpuipc_event_create(NULL, &ev));
  ASSERT_OK(gpuipc_event_record(ev, NULL));
  memset(&m, 0, sizeof m);
  ASSERT_OK(gpuipc_event_export_raw(ev, m.handle, &m.device));
  gpuipc_uuid d0;
  ASSERT_OK(gpuipc_device_uuid(0, &d0));
  ASSERT_MEM_EQ(m.device.bytes, d0.bytes, 16);
  pid = spawn_helper("interop_raw_peer", NULL, &sock, "event-import", NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_EQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_OK(gpuipc_event_destroy(ev));

  gpuipc_event *bad = NULL;
  ASSERT_STATUS(gpuipc_event_import_raw(NULL, NULL, &bad), GPUIPC_E_INVALID_ARG);
  return 0;
}
