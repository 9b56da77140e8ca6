/*
 * test-conn-handoff.c: the per-buffer fast path across processes: arenas,
 * send / recv / release, GPU-side ordering in both directions, leases and
 * deferred frees, 64 consumers, consumers killed at random points, an
 * exporter killed while consumers hold its buffers.
 *
 * The ordering tests need the emulator's GPUIPC_EMU_COPY_DELAY_US (slow
 * copies make a missing wait visible); on a real GPU they run with large
 * copies instead, which the consumer would otherwise overtake.
 */
#include "harness.h"

#include <execinfo.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tree.h"

/* ---- small tools ------------------------------------------------------------------- */

static void ctx_current(void) {
  CUcontext c;
  ASSERT_OK(gpuipc__primary_ctx(0, &c));
  ASSERT_CU(gpuipc__cu.cuCtxSetCurrent(c));
}

/* GPUIPC_TEST_STREAM=legacy runs a test (and its helpers) on the legacy
 * default stream (NULL) instead of a stream of its own. */
static bool test_legacy(void) {
  const char *e = getenv("GPUIPC_TEST_STREAM");
  return e && strcmp(e, "legacy") == 0;
}

static CUstream mkstream(void) {
  ctx_current();
  if (test_legacy())
    return NULL;
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  return s;
}

static void pattern(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = (uint8_t)x;
  }
}

static void check_pattern(const uint8_t *p, size_t n, uint32_t seed) {
  uint8_t *want = malloc(n);
  ASSERT_NOT_NULL(want);
  pattern(want, n, seed);
  ASSERT_MEM_EQ(p, want, n);
  free(want);
}

static const char *rt_dir(void) {
  static char dir[300];
  snprintf(dir, sizeof dir, "%s/rt", harness_tmpdir());
  return dir;
}

static gpuipc_arena *mkarena(size_t chunk) {
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = chunk;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  return a;
}

/* GPUIPC_TEST_ORDER=event runs a test (and its helpers) in event mode. */
static gpuipc_order_mode test_order(void) {
  const char *e = getenv("GPUIPC_TEST_ORDER");
  return e && strcmp(e, "event") == 0 ? GPUIPC_ORDER_EVENT : GPUIPC_ORDER_MEMOP;
}

static gpuipc_conn *pair_conn(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.order = test_order();
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  return c;
}

/* Waits until no peer holds the block (making progress on c). */
static void wait_unheld(gpuipc_conn *c, gpuipc_block *b) {
  for (int i = 0; i < 30000 && gpuipc_block_get_holders(b) > 0; i++)
    ASSERT_OK(gpuipc_conn_progress(c, 1));
  ASSERT_EQ(gpuipc_block_get_holders(b), 0);
}

/* Copies n bytes of device memory at p to the host (synchronous). */
static void d2h(void *dst, const void *p, size_t n) {
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)p, n));
}

/* ---- consumer helper ---------------------------------------------------------------- */

/* A consumer: receives `count` buffers, checks each against the pattern
 * whose seed is in its metadata, releases it, and reports "ok". Then (if
 * argv[1] is "swap") it becomes the producer and sends one buffer back.
 * argv[0]: "pair" or a name to connect to in the runtime dir argv[2]. */
HELPER_IMPL(ho_consumer) {
  ASSERT(argc >= 2);
  int count = atoi(argv[1]);
  gpuipc_conn *c = NULL;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  if (strcmp(argv[0], "pair") == 0) {
    c = pair_conn(dup(harness_helper_fd()));
  } else {
    ASSERT(argc >= 3);
    o.runtime_dir = argv[2];
    ASSERT_OK(gpuipc_connect(argv[0], &o, &c));
  }
  CUstream s = mkstream();
  for (int i = 0; i < count; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    ASSERT_EQ(r.meta_len, sizeof(uint32_t));
    uint32_t seed;
    memcpy(&seed, r.meta, sizeof seed);
    uint8_t *host = malloc(r.length);
    ASSERT_NOT_NULL(host);
    /* Ordered on s after the wait recv queued. */
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, (CUdeviceptr)(uintptr_t)r.ptr,
                                          r.length, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    check_pattern(host, r.length, seed);
    free(host);
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  if (argc >= 2 && argc >= 4 && strcmp(argv[3], "swap") == 0) {
    gpuipc_arena *a = mkarena((size_t)1 << 20);
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 8192, (struct CUstream_st *)s, &b));
    uint8_t host[8192];
    pattern(host, sizeof host, 4242);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                          host, sizeof host, s));
    uint32_t seed = 4242;
    ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    ASSERT_EQ(out, 0);
    gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
    ASSERT_OK(gpuipc_arena_get_stats(a, &st));
    ASSERT_EQ(st.blocks_allocated, 0);
    gpuipc_conn_close(c);
    ASSERT_OK(gpuipc_arena_destroy(a));
    return 0;
  }
  char buf[4];
  size_t len;
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  return 0;
}

static void send_pattern(gpuipc_conn *c, gpuipc_arena *a, CUstream s,
                         size_t n, uint32_t seed, gpuipc_block **keep) {
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  uint8_t *host = malloc(n);
  ASSERT_NOT_NULL(host);
  pattern(host, n, seed);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                        host, n, s));
  free(host);
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
  if (keep)
    *keep = b;
  else
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
}

TEST_IMPL(handoff_basic_and_swap) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_consumer", NULL, &fd, "pair", "5", "-", "swap",
                           NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena((size_t)8 << 20);
  CUstream s = mkstream();
  size_t sizes[5] = {1, 4096, 100000, (size_t)1 << 20, 3 << 20};
  gpuipc_block *held = NULL;
  for (int i = 0; i < 5; i++)
    send_pattern(c, a, s, sizes[i], (uint32_t)i + 1, i == 1 ? &held : NULL);
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  /* All five were released; the one we kept is ours again. */
  size_t out = 99;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  ASSERT_EQ(gpuipc_block_get_holders(held), 0);
  ASSERT_OK(gpuipc_block_free(held, (struct CUstream_st *)s));
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_EQ(st.leases, 0);
  ASSERT_EQ(st.chunks, 1);
  /* Now the other way round: the helper produces, we consume. */
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  ASSERT_EQ(r.length, 8192);
  uint8_t host[8192];
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, (CUdeviceptr)(uintptr_t)r.ptr,
                                        sizeof host, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  check_pattern(host, sizeof host, 4242);
  size_t here = 0;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 1);
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  ASSERT_STATUS(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s),
                GPUIPC_E_NOT_FOUND);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

TEST_IMPL(handoff_api_checks) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_consumer", NULL, &fd, "pair", "0", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_STATUS(gpuipc_arena_alloc(a, 0, NULL, &b), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_arena_alloc(a, 100, (struct CUstream_st *)s, &b));
  ASSERT_EQ(gpuipc_block_get_size(b), 100);
  uint8_t meta[GPUIPC_META_MAX + 1] = {0};
  ASSERT_STATUS(gpuipc_conn_send(c, b, NULL, meta, sizeof meta),
                GPUIPC_E_INVALID_ARG);
  /* Destroying an arena with blocks out is refused. */
  ASSERT_STATUS(gpuipc_arena_destroy(a), GPUIPC_E_BUSY);
  /* A release of something never received. */
  ASSERT_STATUS(gpuipc_conn_release(c, 12345, NULL), GPUIPC_E_NOT_FOUND);
  /* recv with nothing coming times out, or would block. */
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_set_timeout(c, 100));
  ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r), GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r), GPUIPC_E_WOULD_BLOCK);
  gpuipc_received small = GPUIPC_RECEIVED_INIT;
  small.size = 8;
  ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &small), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 0));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 30000));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  ASSERT_OK(gpuipc_arena_destroy(NULL));
  return 0;
}

/* gpuipc_arena_options names its device by UUID: NULL is local device 0,
 * a UUID of no visible device is refused. */
TEST_IMPL(handoff_arena_device_by_uuid) {
  REQUIRE_DEVICES(1);
  gpuipc_uuid u0;
  ASSERT_OK(gpuipc_device_uuid(0, &u0));
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ASSERT_NULL(ao.device);
  ao.chunk_bytes = (size_t)1 << 20;
  ao.device = &u0;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
  CUdevice dev = -1;
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
      &dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b)));
  ASSERT_EQ(dev, 0);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  ASSERT_OK(gpuipc_arena_destroy(a));
  gpuipc_uuid bad = u0;
  bad.bytes[0] ^= 0xff;
  bad.bytes[15] ^= 0xff;
  ao.device = &bad;
  a = NULL;
  gpuipc_status s = gpuipc_arena_create(&ao, &a);
  ASSERT(s != GPUIPC_OK);
  ASSERT_NULL(a);
  return 0;
}

/* Waits for a helper's "up" (its CUDA is started), however long CUDA
 * takes to start on a loaded machine, then restores the timeout. */
static void wait_up(gpuipc_conn *c, int timeout_ms) {
  char buf[4];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_set_timeout(c, 180000));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_MEM_EQ(buf, "up", 2);
  ASSERT_OK(gpuipc_conn_set_timeout(c, timeout_ms));
}

/* ---- leases: deferred free, slots running out ------------------------------------------- */

/* Receives buffers and holds them until told (a message), then releases
 * them all and reports. argv[0]: how many. */
/* A stall report for the lease tests below. Two real-GPU runs saw these
 * tests stop for 30 s while the whole suite ran at -j24: once inside the
 * helper's first receive, which was also its first CUDA call (under that
 * load even a test that only probes the driver took 19 s), and once inside
 * the producer's first send, which makes the connection's flag words and
 * exports the arena (driver calls the kernel driver serializes between
 * processes). So the helper starts CUDA before it says "up", the protocol
 * runs under a 120 s timeout, and either side that is still in one step
 * after 20 s says which, with a backtrace, without failing for it. */
static const char *volatile stall_who;
static const char *volatile stall_step;

static void stall_alarm(int sig) {
  (void)sig;
  const char *parts[] = {stall_who, ": still in ", stall_step,
                         " after 20 s (a loaded machine, or a hang):\n"};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(parts); i++) {
    ssize_t w = write(2, parts[i], strlen(parts[i]));
    (void)w;
  }
  void *frames[48];
  backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
}

/* Names the step now running and gives it 20 s before the report. */
static void stall_watch(const char *who, const char *step) {
  if (stall_who == NULL) {
    void *warm[1];
    (void)backtrace(warm, 1); /* loads what backtrace needs, outside the handler */
    signal(SIGALRM, stall_alarm);
  }
  stall_who = who;
  stall_step = step;
  alarm(20);
}

static void stall_done(void) { alarm(0); }

HELPER_IMPL(ho_holder) {
  int n = atoi(argv[0]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_received r[64];
  {
    gpuipc__ctx_guard g;
    ASSERT_OK(gpuipc__driver());
    ASSERT_OK(gpuipc__ctx_enter(&g, 0));
    gpuipc__ctx_leave(&g);
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "up", 2, NULL, 0));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  for (int i = 0; i < n; i++) {
    stall_watch("ho_holder", i == 0 ? "recv of the first buffer"
                                    : "recv of a later buffer");
    r[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, NULL, &r[i]));
  }
  stall_done();
  ASSERT_OK(gpuipc_conn_send_msg(c, "held", 4, NULL, 0));
  char buf[8];
  size_t len;
  gpuipc_status gs = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  if (gs == GPUIPC_E_PEER_GONE && argc >= 2 && strcmp(argv[1], "linger") == 0)
    for (;;)
      pause(); /* alive, holding both, until killed */
  ASSERT_OK(gs);
  for (int i = 0; i < n; i++)
    ASSERT_OK(gpuipc_conn_release(c, r[i].id, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "done", 4, NULL, 0));
  gpuipc_status s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(s == GPUIPC_E_PEER_GONE || s == GPUIPC_OK);
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(handoff_deferred_free_and_slots) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_holder", NULL, &fd, "2", NULL);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  o.max_outstanding = 2;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  wait_up(c, 120000);
  stall_watch("producer", "arena creation");
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b1, *b2, *b3;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b1));
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b2));
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b3));
  stall_watch("producer", "the first send");
  ASSERT_OK(gpuipc_conn_send(c, b1, NULL, NULL, 0));
  stall_watch("producer", "the second send");
  ASSERT_OK(gpuipc_conn_send(c, b2, NULL, NULL, 0));
  char buf[8];
  size_t len;
  stall_watch("producer", "the wait for \"held\"");
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  stall_done();
  ASSERT_EQ(gpuipc_block_get_holders(b1), 1);
  /* Both slots are out: a third send waits, then times out. */
  ASSERT_OK(gpuipc_conn_set_timeout(c, 100));
  ASSERT_STATUS(gpuipc_conn_send(c, b3, NULL, NULL, 0), GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  /* Freeing held blocks defers the free. */
  ASSERT_OK(gpuipc_block_free(b1, NULL));
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_deferred, 1);
  ASSERT_EQ(st.leases, 2);
  ASSERT_EQ(st.blocks_allocated, 3);
  size_t out = 0;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 2);
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_deferred, 0);
  ASSERT_EQ(st.leases, 0);
  ASSERT_EQ(st.blocks_allocated, 2);
  ASSERT_OK(gpuipc_block_free(b2, NULL));
  ASSERT_OK(gpuipc_block_free(b3, NULL));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- ordering ------------------------------------------------------------------------- */

/* Consumer for the ordering tests. Mode "read": receive one buffer, copy
 * it to the host on the stream recv ordered, check the pattern (seed in
 * metadata). Mode "reuse": receive, copy it (slowly) to private device
 * memory, release at once on the same stream, tell the producer, wait for
 * the producer to say it overwrote the memory, then check the private copy
 * has the original data. */
HELPER_IMPL(ho_order) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  /* First a warm-up buffer (the connection's one-time setup, which may
   * itself wait for the device, is over before the real one comes). */
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  r = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  uint32_t seed;
  memcpy(&seed, r.meta, sizeof seed);
  uint8_t *host = malloc(r.length);
  ASSERT_NOT_NULL(host);
  if (strcmp(argv[0], "read") == 0) {
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, (CUdeviceptr)(uintptr_t)r.ptr,
                                          r.length, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    check_pattern(host, r.length, seed);
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  } else {
    CUdeviceptr priv;
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, r.length));
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r.ptr,
                                          r.length, s));
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
    ASSERT_OK(gpuipc_conn_send_msg(c, "released", 8, NULL, 0));
    char buf[16];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    d2h(host, (void *)(uintptr_t)priv, r.length);
    check_pattern(host, r.length, seed);
    ASSERT_CU(gpuipc__cu.cuMemFree(priv));
  }
  free(host);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  char buf[4];
  size_t len;
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  return 0;
}

/* Sends a small block and waits for its release: the connection's setup
 * is done afterwards. The block is freed (its memory may be reused only
 * after the consumer's release, which the tests below rely on too). */
static void warm_up(gpuipc_conn *c, gpuipc_arena *a, CUstream s) {
  gpuipc_block *w = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 256, (struct CUstream_st *)s, &w));
  ASSERT_OK(gpuipc_conn_send(c, w, (struct CUstream_st *)s, NULL, 0));
  wait_unheld(c, w);
  ASSERT_OK(gpuipc_block_free(w, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
}

static char *delay_env[] = {"GPUIPC_EMU_COPY_DELAY_US=200000", NULL};

TEST_IMPL(handoff_order_slow_producer) {
  /* The producer's copy is slow (emulator) or large (GPU); the consumer's
   * read is queued right after recv and must not overtake it. The
   * emulator reads its settings at the first driver call: set first. */
  if (harness_on_emulator())
    setenv("GPUIPC_EMU_COPY_DELAY_US", "200000", 1);
  REQUIRE_DEVICES(1);
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)256 << 20;
  int fd;
  /* Only the producer is slow: the consumer's own copy runs at once. */
  static char *no_delay[] = {"GPUIPC_EMU_COPY_DELAY_US=", NULL};
  pid_t pid = spawn_helper("ho_order", no_delay, &fd, "read", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena(n + ((size_t)1 << 20));
  CUstream s = mkstream();
  warm_up(c, a, s);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  /* Poison first (and wait for it), then the slow write of the pattern. */
  ASSERT_CU(gpuipc__cu.cuMemsetD8((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                  0xEE, n));
  /* Pinned host memory: a copy from pageable memory would return only
   * once done, and the consumer could not overtake it. */
  uint8_t *host = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&host, n, 0));
  pattern(host, n, 77);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                        host, n, s));
  uint32_t seed = 77;
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(host));
  wait_unheld(c, b);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

TEST_IMPL(handoff_order_reuse_after_release) {
  REQUIRE_DEVICES(1);
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)256 << 20;
  int fd;
  /* The consumer's copy out of the buffer is slow; the producer overwrites
   * the memory as soon as the release arrives. */
  pid_t pid = spawn_helper("ho_order", harness_on_emulator() ? delay_env : NULL,
                           &fd, "reuse", NULL);
  gpuipc_conn *c = pair_conn(fd);
  /* Room for the connection's flag words (4 KiB) and one block: the reuse
   * below must get the same memory back. */
  gpuipc_arena *a = mkarena(n + 8192);
  CUstream s = mkstream();
  warm_up(c, a, s);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  void *first = gpuipc_block_get_ptr(b);
  uint8_t *host = malloc(n);
  pattern(host, n, 99);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)first, host, n, s));
  uint32_t seed = 99;
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 8);
  /* The release has arrived (it came before the message). Reuse: the same
   * memory comes back, ordered on s after the consumer's queued copy. */
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  gpuipc_block *b2 = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b2));
  ASSERT_PTR_EQ(gpuipc_block_get_ptr(b2), first);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)first, 0x55, n, s));
  /* Not synchronized: the overwrite may still be queued behind the wait. */
  ASSERT_OK(gpuipc_conn_send_msg(c, "overwritten", 11, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t probe[16];
  d2h(probe, first, sizeof probe);
  ASSERT_EQ(probe[0], 0x55);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  free(host);
  ASSERT_OK(gpuipc_block_free(b2, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- 64 consumers ------------------------------------------------------------------------ */

TEST_IMPL(handoff_64_consumers) {
  REQUIRE_DEVICES(1);
  enum { N = 64, ROUNDS = 3 };
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 60000;
  o.runtime_dir = rt_dir();
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("fanout", &o, &l));
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  pid_t pids[N];
  gpuipc_conn *cs[N];
  char rounds[8];
  snprintf(rounds, sizeof rounds, "%d", ROUNDS);
  for (int i = 0; i < N; i++)
    pids[i] = spawn_helper("ho_consumer", NULL, NULL, "fanout", rounds,
                           (char *)rt_dir(), NULL);
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_accept(l, &cs[i]));
  for (int r = 0; r < ROUNDS; r++) {
    /* One block, broadcast to every consumer. */
    gpuipc_block *b = NULL;
    size_t n = 65536;
    ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
    uint8_t *host = malloc(n);
    uint32_t seed = 1000u + (uint32_t)r;
    pattern(host, n, seed);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                          host, n, s));
    free(host);
    for (int i = 0; i < N; i++)
      ASSERT_OK(gpuipc_conn_send(cs[i], b, (struct CUstream_st *)s, &seed,
                                 sizeof seed));
    ASSERT_EQ(gpuipc_block_get_holders(b), N);
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  }
  for (int i = 0; i < N; i++) {
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(cs[i], &out, NULL));
    ASSERT_EQ(out, 0);
  }
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_EQ(st.leases, 0);
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  gpuipc_listener_close(l);
  return 0;
}

/* ---- consumers killed ------------------------------------------------------------------------ */

/* Receives forever, releasing every other buffer at once and keeping the
 * rest; it is killed at some point. */
HELPER_IMPL(ho_victim) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  for (int i = 0;; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status st = gpuipc_conn_recv(c, (struct CUstream_st *)s, &r);
    if (st != GPUIPC_OK)
      break;
    uint8_t b;
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(&b, (CUdeviceptr)(uintptr_t)r.ptr, 1, s));
    if (i % 2 == 0)
      ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  }
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(handoff_consumer_killed_100) {
  REQUIRE_DEVICES(1);
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  /* Warm up: the first connection makes the process's flag-word arena,
   * which lives on; every later connection is alike. */
  {
    int fd;
    pid_t pid = spawn_helper("ho_victim", NULL, &fd, NULL);
    gpuipc_conn *c = pair_conn(fd);
    gpuipc_block *b;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
    ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, NULL, 0));
    kill(pid, SIGKILL);
    wait_helper(pid, 60);
    while (gpuipc_conn_progress(c, 10) == GPUIPC_OK)
      ;
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
    gpuipc_conn_close(c);
  }
  /* cuMemGetInfo is device-wide on a real GPU (other processes allocate
   * meanwhile): strict only on the emulator, which counts this process.
   * Everywhere: the arenas' own count of device allocations. */
  size_t free0 = 0, total = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetInfo(&free0, &total));
  size_t chunks0 = gpuipc__arena_chunks_live();
  int fds0 = harness_count_fds();
  unsigned seed = getenv("GPUIPC_TEST_SEED")
                      ? (unsigned)strtoul(getenv("GPUIPC_TEST_SEED"), NULL, 0)
                      : (unsigned)time(NULL);
  printf("seed %u (GPUIPC_TEST_SEED repeats it)\n", seed);
  srand(seed);
  for (int round = 0; round < 100; round++) {
    int fd;
    pid_t pid = spawn_helper("ho_victim", NULL, &fd, NULL);
    gpuipc_conn *c = pair_conn(fd);
    int sends = rand() % 8;
    gpuipc_block *bs[8];
    for (int i = 0; i < sends; i++) {
      ASSERT_OK(gpuipc_arena_alloc(a, 4096 * (size_t)(1 + rand() % 16),
                                   (struct CUstream_st *)s, &bs[i]));
      ASSERT_OK(gpuipc_conn_send(c, bs[i], (struct CUstream_st *)s, NULL, 0));
      if (rand() % 2)
        ASSERT_OK(gpuipc_conn_progress(c, 0));
    }
    /* Free some now (deferred while held), the rest after the death. */
    int freed_early = sends ? rand() % (sends + 1) : 0;
    for (int i = 0; i < freed_early; i++)
      ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
    usleep((useconds_t)(rand() % 3000));
    kill(pid, SIGKILL);
    int st = wait_helper(pid, 60);
    ASSERT(st == 128 + SIGKILL || st == 0);
    gpuipc_status ps = GPUIPC_OK;
    for (int k = 0; k < 1000 && ps == GPUIPC_OK; k++)
      ps = gpuipc_conn_progress(c, 10);
    ASSERT_STATUS(ps, GPUIPC_E_PEER_GONE);
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    ASSERT_EQ(out, 0);
    for (int i = freed_early; i < sends; i++) {
      ASSERT_EQ(gpuipc_block_get_holders(bs[i]), 0);
      ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
    }
    gpuipc_conn_close(c);
    gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
    ASSERT_OK(gpuipc_arena_get_stats(a, &as));
    ASSERT_EQ(as.blocks_allocated, 0);
    ASSERT_EQ(as.leases, 0);
    ASSERT_EQ(as.blocks_deferred, 0);
    ASSERT_EQ(as.chunks, 1);
  }
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  size_t free1 = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetInfo(&free1, &total));
  if (harness_on_emulator())
    ASSERT_EQ(free1, free0);
  ASSERT_EQ(gpuipc__arena_chunks_live(), chunks0);
  ASSERT_EQ(harness_count_fds(), fds0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* A consumer that closes its connection while holding buffers, and stays
 * alive: its blocks come back only when it exits. */
TEST_IMPL(handoff_consumer_closes_holding) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_holder", NULL, &fd, "2", "linger", NULL);
  gpuipc_conn *c = pair_conn(fd);
  wait_up(c, 120000);
  stall_watch("producer", "arena creation");
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b1, *b2;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b1));
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b2));
  stall_watch("producer", "the first send");
  ASSERT_OK(gpuipc_conn_send(c, b1, NULL, NULL, 0));
  stall_watch("producer", "the second send");
  ASSERT_OK(gpuipc_conn_send(c, b2, NULL, NULL, 0));
  char buf[8];
  size_t len;
  stall_watch("producer", "the wait for \"held\"");
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  stall_done();
  /* We close our end while the helper holds both: they stay leased. */
  ASSERT_OK(gpuipc_block_free(b1, NULL));
  ASSERT_OK(gpuipc_block_free(b2, NULL));
  gpuipc_conn_close(c);
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  usleep(20000); /* past the orphan check interval: it must stay held */
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_deferred, 2);
  ASSERT_EQ(st.leases, 2);
  /* The helper lives on, holding them; once it is gone they come back. */
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  /* Orphans are checked every few milliseconds, in arena calls. */
  for (int i = 0; i < 5000; i++) {
    ASSERT_OK(gpuipc_arena_get_stats(a, &st));
    if (st.blocks_deferred == 0)
      break;
    usleep(1000);
  }
  ASSERT_EQ(st.blocks_deferred, 0);
  ASSERT_EQ(st.leases, 0);
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- a ready write that cannot be enqueued ------------------------------------------ */

/* A producer whose every cuStreamWriteValue64 fails (GPUIPC_EMU_FAIL): the
 * frame of its first buffer has left when the ready write fails, so send
 * must report the failure and end the connection (the consumer would
 * otherwise wait on the GPU for a word nobody writes). */
HELPER_IMPL(ho_write_fails) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  /* Work still queued (slow sets, longer than the connection's setup,
   * which waits for a slow set of its own): the send must write the ready
   * word (an idle stream would need none). */
  for (int i = 0; i < 4; i++)
    ASSERT_CU(gpuipc__cu.cuMemsetD8Async(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), 1, 4096, s));
  gpuipc_status st = gpuipc_conn_send(c, b, (struct CUstream_st *)s, NULL, 0);
  ASSERT_STATUS(st, GPUIPC_E_DRIVER);
  ASSERT_NOT_NULL(strstr(gpuipc_last_error(), "cuStreamWriteValue64"));
  /* The connection is over; the block is still ours to free. */
  ASSERT(gpuipc_conn_send(c, b, (struct CUstream_st *)s, NULL, 0) != GPUIPC_OK);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

TEST_IMPL(handoff_ready_write_fails) {
  REQUIRE_EMULATOR("fault injection (GPUIPC_EMU_FAIL)");
  char *env[] = {"GPUIPC_EMU_FAIL=cuStreamWriteValue64:*",
                 "GPUIPC_EMU_COPY_DELAY_US=200000", NULL};
  int fd;
  pid_t pid = spawn_helper("ho_write_fails", env, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  gpuipc_status st = gpuipc_conn_recv(c, (struct CUstream_st *)s, &r);
  /* Either the buffer came (and then the end), or the end came first: the
   * peer gone, or, when the producer had already destroyed its arena by
   * the time its first frame was read here, the import of the arena
   * refused as stale (which ends the connection as a protocol error). */
  if (st == GPUIPC_OK) {
    gpuipc_received r2 = GPUIPC_RECEIVED_INIT;
    st = gpuipc_conn_recv(c, (struct CUstream_st *)s, &r2);
  }
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED ||
         st == GPUIPC_E_PROTOCOL);
  /* Whatever our stream waits for was unblocked: it drains. */
  CUresult q = CUDA_ERROR_NOT_READY;
  for (int i = 0; i < 10000 && q == CUDA_ERROR_NOT_READY; i++) {
    q = gpuipc__cu.cuStreamQuery(s);
    if (q == CUDA_ERROR_NOT_READY)
      usleep(1000);
  }
  ASSERT_CU(q);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}

/* ---- exporter killed ---------------------------------------------------------------------- */

/* A producer that sends three buffers: the first ready at once, the next
 * two behind GPU work that never completes (its stream waits on a word
 * nobody writes), then sleeps until killed. */
HELPER_IMPL(ho_doomed_producer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  uint8_t host[4096];
  pattern(host, sizeof host, 5);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                    host, sizeof host));
  uint32_t seed = 5;
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
  /* Stream memory operations need cuMemAlloc (or VMM) memory. */
  CUdeviceptr never;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&never, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(never, 0, 256));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, never, 1, CU_STREAM_WAIT_VALUE_GEQ));
  for (int i = 0; i < 2; i++) {
    gpuipc_block *x;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &x));
    ASSERT_OK(gpuipc_conn_send(c, x, (struct CUstream_st *)s, &seed, sizeof seed));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "sent", 4, NULL, 0));
  for (;;)
    pause();
  return 0;
}

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "handoff_exporter_killed: a stream hung\n";
  ssize_t w = write(2, msg, sizeof msg - 1);
  (void)w;
  _exit(1);
}

TEST_IMPL(handoff_exporter_killed) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_doomed_producer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_received r[3];
  for (int i = 0; i < 3; i++) {
    r[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r[i]));
  }
  /* s now waits for buffers 2 and 3, which the producer's GPU work will
   * never make ready. */
  uint8_t host[4096];
  CUdeviceptr priv;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, 4096));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r[2].ptr,
                                        4096, s));
  ASSERT_EQ(gpuipc__cu.cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  gpuipc_received r4 = GPUIPC_RECEIVED_INIT;
  ASSERT_STATUS(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r4),
                GPUIPC_E_PEER_GONE);
  ASSERT_STATUS(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r4),
                GPUIPC_E_PEER_GONE);
  ASSERT_STATUS(gpuipc_conn_progress(c, 0), GPUIPC_E_PEER_GONE);
  /* In event mode on a real driver, a stream waiting on a dead producer's
   * event record stays blocked (documented in conn.h: nothing releases
   * such a wait); gpuipc itself must still not hang. The emulator, which
   * lets a later record release the wait, checks the stream too. */
  bool stream_released = test_order() != GPUIPC_ORDER_EVENT ||
                         harness_on_emulator();
  signal(SIGALRM, on_alarm);
  alarm(30);
  if (stream_released)
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  /* What was received stays readable until released (s is non-blocking:
   * this synchronous copy does not wait for it). */
  d2h(host, r[0].ptr, sizeof host);
  check_pattern(host, sizeof host, 5);
  for (int i = 0; i < 3; i++)
    ASSERT_OK(gpuipc_conn_release(c, r[i].id, (struct CUstream_st *)s));
  size_t here = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 0);
  gpuipc_conn_close(c);
  alarm(0);
  /* cuMemFree may wait for the device: only when s got through. */
  if (stream_released)
    ASSERT_CU(gpuipc__cu.cuMemFree(priv));
  return 0;
}

/* The same as handoff_order_reuse_after_release, for a block the producer
 * keeps and writes again (a ring of buffers): gpuipc_block_wait orders the
 * rewrite after the consumer's queued read. */
TEST_IMPL(handoff_order_block_wait) {
  REQUIRE_DEVICES(1);
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)256 << 20;
  int fd;
  pid_t pid = spawn_helper("ho_order", harness_on_emulator() ? delay_env : NULL,
                           &fd, "reuse", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena(n + 8192);
  CUstream s = mkstream();
  warm_up(c, a, s);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  void *p = gpuipc_block_get_ptr(b);
  uint8_t *host = malloc(n);
  pattern(host, n, 31);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)p, host, n, s));
  uint32_t seed = 31;
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(gpuipc_block_get_holders(b), 0);
  ASSERT_OK(gpuipc_block_wait(b, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)p, 0x66, n, s));
  ASSERT_OK(gpuipc_conn_send_msg(c, "overwritten", 11, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t probe[16];
  d2h(probe, p, sizeof probe);
  ASSERT_EQ(probe[0], 0x66);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  free(host);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* Buffers outside arenas travel by descriptor: a MEMPOOL pool buffer and a
 * wrapped cuMemAlloc allocation (legacy IPC), each sent twice (the second
 * time the consumer's import cache serves it), rewritten in between after
 * gpuipc_conn_buffer_wait. */
TEST_IMPL(handoff_send_buffer) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_consumer", NULL, &fd, "pair", "4", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_MEMPOOL;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *bufs[2] = {NULL, NULL};
  size_t n = 65536;
  ASSERT_OK(gpuipc_buffer_alloc(pool, n, (struct CUstream_st *)s, &bufs[0]));
  CUdeviceptr raw;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&raw, n + 4096));
  /* An interior range of a legacy allocation. */
  ASSERT_OK(gpuipc_buffer_wrap((void *)(uintptr_t)(raw + 4096), n, &bufs[1]));
  uint8_t *host = malloc(n);
  uint32_t seed = 500;
  for (int k = 0; k < 2; k++) {
    for (int round = 0; round < 2; round++, seed++) {
      if (round == 1) {
        ASSERT_OK(gpuipc_conn_buffer_wait(c, bufs[k], (struct CUstream_st *)s));
      }
      pattern(host, n, seed);
      ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(
          (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(bufs[k]), host, n, s));
      ASSERT_OK(gpuipc_conn_send_buffer(c, bufs[k], (struct CUstream_st *)s,
                                        &seed, sizeof seed));
      ASSERT_EQ(gpuipc_conn_get_buffer_holders(c, bufs[k]) <= 1, 1);
      for (int i = 0; i < 30000 && gpuipc_conn_get_buffer_holders(c, bufs[k]) > 0;
           i++)
        ASSERT_OK(gpuipc_conn_progress(c, 1));
      ASSERT_EQ(gpuipc_conn_get_buffer_holders(c, bufs[k]), 0);
    }
  }
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_buffer_free(bufs[0], (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_buffer_free(bufs[1], NULL));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  ASSERT_CU(gpuipc__cu.cuMemFree(raw));
  free(host);
  return 0;
}

/* ---- hostile fast-path frames ----------------------------------------------------------- */

static void raw_frame(int fd, int type, const void *p, size_t n) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, 0, (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  unsigned char buf[1024];
  ASSERT_LE(sizeof h + n, sizeof buf);
  memcpy(buf, &h, sizeof h);
  if (n)
    memcpy(buf + sizeof h, p, n);
  ASSERT_EQ(write(fd, buf, sizeof h + n), (ssize_t)(sizeof h + n));
}

/* Completes the handshake, optionally sends one real block (so the chunk
 * and the flag words are known), then forges a frame: argv[0] names it. */
HELPER_IMPL(ho_forger) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  const char *what = argv[0];
  gpuipc__w_buf w = {1, 1, 0, 256, 0, 0, GPUIPC__BUF_ORDERED, 0};
  if ((strncmp(what, "buf_", 4) == 0 && strcmp(what, "buf_before_ctl") != 0) ||
      strncmp(what, "bufs_", 5) == 0 || strncmp(what, "bufw_", 5) == 0) {
    /* Kept until exit (the victim hangs up holding the block). */
    static gpuipc_arena *a;
    static gpuipc_block *b;
    a = mkarena((size_t)1 << 20);
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
    ASSERT_OK(gpuipc_conn_send(c, b, NULL, NULL, 0));
    ASSERT_OK(gpuipc_conn_progress(c, 0));
    /* Arena ids count from 1 in each process: 1 is the helper's arena, 2
     * the flag-word arena made by the first send. The consumer imported
     * chunk 0 of both; the forged frames name the second (1 MiB). */
    w.arena_id = 2;
    w.seq = 100;
    w.slot = 1;
  }
  int fd = gpuipc_conn_get_fd(c);
  if (strcmp(what, "buf_before_ctl") == 0) {
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "rel_unheld") == 0) {
    gpuipc__w_rel r = {7, 3, 0};
    raw_frame(fd, GPUIPC__F_REL, &r, sizeof r);
  } else if (strcmp(what, "chunk_garbage") == 0) {
    unsigned char p[24 + 64];
    gpuipc__w_chunk ch = {9, 4096, 0, 64};
    memcpy(p, &ch, sizeof ch);
    memset(p + sizeof ch, 0xAB, 64);
    raw_frame(fd, GPUIPC__F_CHUNK, p, sizeof p);
  } else if (strcmp(what, "buf_out_of_range") == 0) {
    w.off = (uint64_t)64 << 20; /* the chunk has 2 MiB */
    w.len = 4096;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_slot") == 0) {
    w.slot = 1u << 20;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_meta_len") == 0) {
    w.meta_len = 200;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_done_unordered") == 0) {
    w.flags = GPUIPC__BUF_DONE;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_unknown_chunk") == 0) {
    w.chunk = 5;
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strcmp(what, "buf_seq_past_limit") == 0) {
    /* More than 2^63 past the first buffer's sequence number: the GPU's
     * cyclic comparison would order the two backwards, and the write that
     * unblocks our streams at close (the newest value) would never satisfy
     * the first buffer's wait. */
    w.seq = GPUIPC__SEQ_LIMIT + ((uint64_t)1 << 63);
    raw_frame(fd, GPUIPC__F_BUF, &w, sizeof w);
  } else if (strncmp(what, "bufw_", 5) == 0) {
    /* A buffer ordered by a "broadcast word" in the flag-word chunk. */
    struct {
      gpuipc__w_buf b;
      gpuipc__w_word w;
    } f;
    f.b = w;
    f.w = (gpuipc__w_word){2, 4096, 0, 0, 5};
    int frames = 1;
    if (strcmp(what, "bufw_word_outside") == 0)
      f.w.off = (uint64_t)64 << 20;
    else if (strcmp(what, "bufw_misaligned") == 0)
      f.w.off = 4100;
    else if (strcmp(what, "bufw_value_zero") == 0)
      f.w.value = 0;
    else if (strcmp(what, "bufw_value_past_limit") == 0)
      f.w.value = GPUIPC__SEQ_LIMIT;
    else if (strcmp(what, "bufw_event_flag") == 0)
      f.b.flags |= GPUIPC__BUF_EVENT;
    else if (strcmp(what, "bufw_unknown_chunk") == 0)
      f.w.chunk = 7;
    else if (strcmp(what, "bufw_word_is_a_flag_word") == 0)
      f.w.off = 8; /* slot 1's ready word: close writes it itself */
    else if (strcmp(what, "bufw_too_many_words") == 0)
      frames = GPUIPC__BWORDS_MAX + 1;
    for (int i = 0; i < frames; i++) {
      f.b.slot = 1 + (uint32_t)i;
      f.b.seq = 100 + (uint64_t)i;
      f.w.off = frames > 1 ? 4096 + 8 * (uint64_t)i : f.w.off;
      raw_frame(fd, GPUIPC__F_BUFW, &f, sizeof f);
    }
  } else if (strncmp(what, "bufs_", 5) == 0) {
    /* A batch of three (each valid on its own unless the case breaks
     * one): none of it may be delivered. */
    struct {
      gpuipc__w_bufs h;
      gpuipc__w_buf e[3];
      uint32_t meta[3];
    } f;
    memset(&f, 0, sizeof f);
    f.h = (gpuipc__w_bufs){3, 2, 0, 0};
    for (int i = 0; i < 3; i++) {
      f.e[i] = w;
      f.e[i].slot = 1 + (uint32_t)i;
      f.e[i].seq = 100 + (uint64_t)i;
      f.e[i].meta_len = 4;
    }
    size_t n = sizeof f;
    /* The real block first comes back (so the victim received it). */
    size_t out = 1;
    for (int i = 0; i < 3000 && out > 0; i++) {
      ASSERT_OK(gpuipc_conn_progress(c, 10));
      ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    }
    ASSERT_EQ(out, 0);
    if (strcmp(what, "bufs_dup_slot") == 0)
      f.e[2].slot = 1;
    else if (strcmp(what, "bufs_bad_entry") == 0)
      f.e[1].off = (uint64_t)64 << 20;
    else if (strcmp(what, "bufs_count") == 0)
      f.h.count = 0;
    else if (strcmp(what, "bufs_too_many") == 0)
      f.h.count = 4;
    else if (strcmp(what, "bufs_ready") == 0)
      f.h.ready = 0;
    else if (strcmp(what, "bufs_meta_total") == 0)
      n -= 2;
    else if (strcmp(what, "bufs_desc") == 0)
      f.e[1].flags |= GPUIPC__BUF_DESC;
    else if (strcmp(what, "bufs_seq_order") == 0)
      f.e[2].seq = 100;
    else if (strcmp(what, "bufs_seq_past_limit") == 0)
      f.e[2].seq = GPUIPC__SEQ_LIMIT;
    raw_frame(fd, GPUIPC__F_BUFS, &f, n);
  }
  /* Wait until the victim hangs up on us. Buffers it took from frames it
   * accepted before the one it refused come back as releases this side's
   * lease table never gave out (they were forged): that ends the
   * connection here first, as a protocol error. */
  char b;
  size_t len;
  /* A broadcast forger leaves soon: the victim's close waits for its
   * broadcast words, which it writes itself only once the forger is gone
   * (they are the forger's to write while it lives). */
  if (strncmp(what, "bufw_", 5) == 0)
    ASSERT_OK(gpuipc_conn_set_timeout(c, 500));
  gpuipc_status s = gpuipc_conn_recv_msg(c, &b, 1, &len, NULL, NULL);
  if (s != GPUIPC_E_PEER_GONE && s != GPUIPC_E_TIMEOUT &&
      s != GPUIPC_E_PROTOCOL)
    harness_fail(__FILE__, __LINE__, "forger %s: the connection ended with %s (%s)",
                 what, gpuipc_status_name(s), gpuipc_last_error());
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(handoff_rejects_forged_frames) {
  REQUIRE_DEVICES(1);
  static const struct {
    const char *what, *text;
  } cases[] = {
      {"buf_before_ctl", "before CTL"},
      {"rel_unheld", "REL"},
      {"chunk_garbage", "peer pid"},
      {"buf_out_of_range", "outside the chunk"},
      {"buf_slot", "slot"},
      {"buf_meta_len", "metadata"},
      {"buf_unknown_chunk", "never sent"},
      {"buf_done_unordered", "DONE only with ORDERED"},
      {"buf_seq_past_limit", "past the limit"},
      {"bufs_dup_slot", "busy"},
      {"bufs_bad_entry", "outside the chunk"},
      {"bufs_count", "entries"},
      {"bufs_too_many", "entries"},
      {"bufs_ready", "ready entry"},
      {"bufs_meta_total", "metadata"},
      {"bufs_desc", "refused"},
      {"bufs_seq_order", "refused"},
      {"bufs_seq_past_limit", "past the limit"},
      {"bufw_word_outside", "outside the peer's imported memory"},
      {"bufw_misaligned", "misaligned"},
      {"bufw_value_zero", "past the limit"},
      {"bufw_value_past_limit", "past the limit"},
      {"bufw_event_flag", "ORDERED only"},
      {"bufw_unknown_chunk", "imported memory"},
      {"bufw_word_is_a_flag_word", "one of the connection's flag words"},
      {"bufw_too_many_words", "broadcast words"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    /* A stream per case: buffers of forged broadcast frames accepted
     * before the refused one wait on words the forger never writes, so
     * their stream may stay blocked for good. */
    CUstream s = mkstream();
    bool bufw = strncmp(cases[i].what, "bufw_", 5) == 0;
    int fd;
    pid_t pid = spawn_helper("ho_forger", NULL, &fd, (char *)cases[i].what, NULL);
    gpuipc_conn *c = pair_conn(fd);
    gpuipc_status st = GPUIPC_OK;
    int oks = 0;
    for (int k = 0; k < 3 + GPUIPC__BWORDS_MAX && st == GPUIPC_OK; k++) {
      gpuipc_received r = GPUIPC_RECEIVED_INIT;
      st = gpuipc_conn_recv(c, (struct CUstream_st *)s, &r);
      if (st == GPUIPC_OK) {
        oks++;
        ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
      }
    }
    /* A forged batch is refused whole: only the real block came. */
    if (strncmp(cases[i].what, "bufs_", 5) == 0 && oks != 1)
      harness_fail(__FILE__, __LINE__, "case %s: %d buffers delivered",
                   cases[i].what, oks);
    if (st != GPUIPC_E_PROTOCOL)
      harness_fail(__FILE__, __LINE__, "case %s: %s (%s)", cases[i].what,
                   gpuipc_status_name(st), gpuipc_last_error());
    ASSERT_STR_CONTAINS(gpuipc_last_error(), cases[i].text);
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_STATUS(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r),
                  GPUIPC_E_CLOSED);
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid, 60), 0);
    if (!bufw)
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    if (s)
      ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  }
  return 0;
}

/* ---- the same in event mode ---------------------------------------------------------------- */

TEST_IMPL(handoff_event_basic_and_swap) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_basic_and_swap();
}

TEST_IMPL(handoff_event_order_slow_producer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_order_slow_producer();
}

TEST_IMPL(handoff_event_order_reuse_after_release) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_order_reuse_after_release();
}

TEST_IMPL(handoff_event_send_buffer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_send_buffer();
}

TEST_IMPL(handoff_event_exporter_killed) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_exporter_killed();
}

/* ---- the same on the legacy default stream ------------------------------------------- */

TEST_IMPL(handoff_legacy_basic_and_swap) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_basic_and_swap();
}

TEST_IMPL(handoff_legacy_order_slow_producer) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_order_slow_producer();
}

TEST_IMPL(handoff_legacy_order_reuse_after_release) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_order_reuse_after_release();
}

/* ---- one peer's missing release holds back only what it holds ------------------------- */

/* A step that must end within `secs` seconds: otherwise the test fails
 * with `what` instead of hanging. */
static const char *volatile bounded_what;
static void bounded_alarm(int sig) {
  (void)sig;
  const char *parts[] = {"assertion failed: still in ", bounded_what,
                         " after the bound (a hang)\n"};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(parts); i++) {
    ssize_t w = write(2, parts[i], strlen(parts[i]));
    (void)w;
  }
  _exit(1);
}
static void bounded(const char *what, unsigned secs) {
  bounded_what = what;
  signal(SIGALRM, bounded_alarm);
  alarm(secs);
}
static void bounded_done(void) { alarm(0); }

/* True when the work queued on s so far completes within ms. */
static bool stream_drains(CUstream s, int ms) {
  for (int i = 0; i < ms; i++) {
    CUresult r = gpuipc__cu.cuStreamQuery(s);
    if (r == CUDA_SUCCESS)
      return true;
    ASSERT_EQ(r, CUDA_ERROR_NOT_READY);
    usleep(1000);
  }
  return false;
}

/* Receives one buffer, then forges its release: a REL frame without the
 * GPU-side write of the release word. Stays alive until killed. */
HELPER_IMPL(ho_liar) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
  gpuipc__w_rel rel = {r.id & (((uint64_t)1 << 44) - 1),
                       (uint32_t)(r.id >> 44), 0};
  raw_frame(gpuipc_conn_get_fd(c), GPUIPC__F_REL, &rel, sizeof rel);
  ASSERT_OK(gpuipc_conn_send_msg(c, "lied", 4, NULL, 0));
  for (;;)
    pause();
}

/* Arena memory laid out so that every allocation below must reuse memory:
 * one chunk, no growth, its rest taken by a filler block. */
static gpuipc_arena *full_arena(size_t small, int n, gpuipc_block **blocks,
                                gpuipc_block **filler) {
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)1 << 20;
  ao.max_bytes = ao.chunk_bytes;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  for (int i = 0; i < n; i++)
    ASSERT_OK(gpuipc_arena_alloc(a, small, NULL, &blocks[i]));
  ASSERT_OK(gpuipc_arena_alloc(a, ao.chunk_bytes - (size_t)n * small, NULL,
                               filler));
  return a;
}

/* A consumer that announces a release its GPU never writes (a forged REL)
 * holds back the block it held, and nothing else: a block never shared
 * with it and a block an honest consumer released are reused at once, and
 * gpuipc_arena_destroy ends within its bound (GPUIPC_E_BUSY while the liar
 * lives; OK once it is gone). */
TEST_IMPL(handoff_forged_release_holds_back_only_its_block) {
  REQUIRE_DEVICES(1);
  CUstream s = mkstream();
  gpuipc_block *blk[3], *filler;
  gpuipc_arena *a = full_arena(4096, 3, blk, &filler);
  int fd_l, fd_h;
  pid_t liar = spawn_helper("ho_liar", NULL, &fd_l, NULL);
  pid_t honest = spawn_helper("ho_holder", NULL, &fd_h, "1", NULL);
  gpuipc_conn *cl = pair_conn(fd_l);
  gpuipc_conn *ch = pair_conn(fd_h);
  wait_up(ch, 60000);
  /* blk[0] to the liar, blk[2] to the honest consumer, blk[1] nowhere. */
  ASSERT_OK(gpuipc_conn_send(cl, blk[0], (struct CUstream_st *)s, NULL, 0));
  ASSERT_OK(gpuipc_conn_send(ch, blk[2], (struct CUstream_st *)s, NULL, 0));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(cl, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_MEM_EQ(buf, "lied", 4);
  ASSERT_OK(gpuipc_conn_recv_msg(ch, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_MEM_EQ(buf, "held", 4);
  void *p1 = gpuipc_block_get_ptr(blk[1]), *p2 = gpuipc_block_get_ptr(blk[2]);
  for (int i = 0; i < 3; i++)
    ASSERT_OK(gpuipc_block_free(blk[i], (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_send_msg(ch, "go", 2, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(ch, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_MEM_EQ(buf, "done", 4);
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(ch, &out, NULL));
  ASSERT_EQ(out, 0);
  ASSERT_OK(gpuipc_conn_get_outstanding(cl, &out, NULL));
  ASSERT_EQ(out, 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  /* Reuse of the two blocks the liar never held, on a fresh stream each:
   * the streams must not wait for the liar's release word. */
  gpuipc_block *again[2], *liars = NULL;
  CUstream t[2], liars_stream = NULL;
  for (int i = 0; i < 2; i++) {
    t[i] = mkstream();
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)t[i], &b));
    if (gpuipc_block_get_ptr(b) != p1 && gpuipc_block_get_ptr(b) != p2) {
      /* The liar's block, handed out (stream-ordered after its release)
       * while the others' markers did not look complete yet: keep it, and
       * take the next on a fresh stream. */
      ASSERT_NULL(liars);
      liars = b;
      liars_stream = t[i];
      t[i] = mkstream();
      ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)t[i], &b));
    }
    ASSERT(gpuipc_block_get_ptr(b) == p1 || gpuipc_block_get_ptr(b) == p2);
    again[i] = b;
    if (t[i] && !stream_drains(t[i], 5000))
      harness_fail(__FILE__, __LINE__,
                   "reuse of a block the liar never held waits for the "
                   "liar's release");
  }
  if (liars)
    ASSERT_OK(gpuipc_block_free(liars, (struct CUstream_st *)liars_stream));
  for (int i = 0; i < 2; i++)
    ASSERT_OK(gpuipc_block_free(again[i], NULL));
  ASSERT_OK(gpuipc_block_free(filler, NULL));
  gpuipc_conn_close(ch);
  ASSERT_EQ(wait_helper(honest, 60), 0);
  gpuipc_conn_close(cl);
  /* The liar lives: its block's memory is still held back, and destroy
   * says so within its bound instead of waiting for ever. */
  bounded("gpuipc_arena_destroy while the liar lives", 30);
  ASSERT_STATUS(gpuipc_arena_destroy(a), GPUIPC_E_BUSY);
  bounded_done();
  kill(liar, SIGKILL);
  ASSERT_EQ(wait_helper(liar, 60), 128 + SIGKILL);
  bounded("gpuipc_arena_destroy after the liar died", 30);
  gpuipc_status ds = GPUIPC_E_BUSY;
  for (int i = 0; i < 100 && ds == GPUIPC_E_BUSY; i++) {
    ds = gpuipc_arena_destroy(a);
    if (ds == GPUIPC_E_BUSY)
      usleep(10000);
  }
  ASSERT_OK(ds);
  bounded_done();
  return 0;
}

/* Connects, says "up", then closes the connection while the buffers the
 * producer sent still sit in its queue (never received), and lives on. */
HELPER_IMPL(ho_quick_closer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  {
    gpuipc__ctx_guard g;
    ASSERT_OK(gpuipc__driver());
    ASSERT_OK(gpuipc__ctx_enter(&g, 0));
    gpuipc__ctx_leave(&g);
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "up", 2, NULL, 0));
  char buf[8];
  size_t len;
  /* The buffers arrive before this message: they are queued. */
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_conn_close(c);
  close(harness_helper_fd()); /* the producer sees the end of the stream */
  for (;;)
    pause();
}

/* Sends one block and lives until the peer hangs up. */
HELPER_IMPL(ho_send_one) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, NULL, 0));
  char x;
  size_t len;
  gpuipc_status st = gpuipc_conn_recv_msg(c, &x, 1, &len, NULL, NULL);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_arena_destroy(a));
  if (s)
    ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}

static CUdeviceptr gate_word;
static void *open_gate_later(void *arg) {
  (void)arg;
  ctx_current();
  usleep(100000);
  /* A stream memory operation (as the wait it releases): a plain memset
   * is no atomic store on the emulator (a data race for TSan). */
  CUstream w;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&w, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(w, gate_word, 1, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(w));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(w));
  return NULL;
}

/* A consumer closes the connection while it holds a buffer whose wait on
 * the producer's ready word still sits, on the consumer's stream, behind
 * earlier work of its own: close must not unmap the producer's flag words
 * before that wait has run (the device would read unmapped memory once
 * the stream moves on; on the emulator, a crash). */
TEST_IMPL(handoff_close_waits_for_the_recv_stream) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_send_one", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate_word, 4));
  ASSERT_CU(gpuipc__cu.cuMemsetD32(gate_word, 0, 1));
  /* The caller's own earlier work on s, not done yet. */
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(s, gate_word, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, open_gate_later, NULL), 0);
  gpuipc_conn_close(c); /* still holding r */
  ASSERT_EQ(pthread_join(t, NULL), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuMemFree(gate_word));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}

/* gpuipc_conn_close by a consumer with buffers queued (not received):
 * their releases must come with their words written, so the producer
 * reuses the memory at once, though the consumer lives on. */
TEST_IMPL(handoff_close_with_queued_buffers_releases_them) {
  REQUIRE_DEVICES(1);
  gpuipc_block *blk[2], *filler;
  gpuipc_arena *a = full_arena(4096, 2, blk, &filler);
  int fd;
  pid_t pid = spawn_helper("ho_quick_closer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  wait_up(c, 60000);
  CUstream s = mkstream();
  for (int i = 0; i < 2; i++)
    ASSERT_OK(gpuipc_conn_send(c, blk[i], (struct CUstream_st *)s, NULL, 0));
  ASSERT_OK(gpuipc_conn_send_msg(c, "close", 5, NULL, 0));
  void *p[2] = {gpuipc_block_get_ptr(blk[0]), gpuipc_block_get_ptr(blk[1])};
  for (int i = 0; i < 2; i++)
    ASSERT_OK(gpuipc_block_free(blk[i], (struct CUstream_st *)s));
  gpuipc_status ps = GPUIPC_OK;
  for (int k = 0; k < 3000 && ps == GPUIPC_OK; k++)
    ps = gpuipc_conn_progress(c, 10);
  ASSERT_STATUS(ps, GPUIPC_E_PEER_GONE);
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < 2; i++) {
    CUstream t = mkstream();
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)t, &b));
    ASSERT(gpuipc_block_get_ptr(b) == p[0] || gpuipc_block_get_ptr(b) == p[1]);
    if (t && !stream_drains(t, 5000))
      harness_fail(__FILE__, __LINE__,
                   "reuse after the consumer's close waits for a release "
                   "word nobody writes");
    ASSERT_OK(gpuipc_block_free(b, NULL));
  }
  ASSERT_OK(gpuipc_block_free(filler, NULL));
  gpuipc_conn_close(c);
  bounded("gpuipc_arena_destroy after the consumer's close", 30);
  ASSERT_OK(gpuipc_arena_destroy(a));
  bounded_done();
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  return 0;
}

/* ---- a consumer whose main thread exited ------------------------------------------------ */

static gpuipc_received lone_rx = GPUIPC_RECEIVED_INIT;

static void *lone_reader(void *arg) {
  (void)arg;
  /* Reads the buffer for 1.5 s after the main thread is gone: the data
   * must stay the producer's (the memory is not handed out again). */
  uint8_t first[64], now[64];
  ctx_current();
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(first, (CUdeviceptr)(uintptr_t)lone_rx.ptr,
                                    sizeof first));
  for (int i = 0; i < 15; i++) {
    usleep(100000);
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(now, (CUdeviceptr)(uintptr_t)lone_rx.ptr,
                                      sizeof now));
    if (memcmp(first, now, sizeof now) != 0) {
      fprintf(stderr, "lone reader: the buffer changed under it\n");
      _exit(3);
    }
  }
  _exit(0);
}

/* Receives a buffer, hangs up without releasing it, starts a thread that
 * keeps reading it, and ends its main thread (pthread_exit). */
HELPER_IMPL(ho_lone_thread) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  ASSERT_OK(gpuipc_conn_recv(c, NULL, &lone_rx));
  ctx_current();
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, lone_reader, NULL), 0);
  close(gpuipc_conn_get_fd(c)); /* hang up, holding the buffer */
  close(harness_helper_fd());
  pthread_exit(NULL);
}

/* The consumer's main thread has exited, another reads the buffer: the
 * process is not gone, so its lease stays (and the memory is not reused)
 * until the whole process exits. */
TEST_IMPL(handoff_consumer_main_thread_exit_keeps_lease) {
  REQUIRE_DEVICES(1);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
  uint8_t pat[4096];
  pattern(pat, sizeof pat, 7);
  ctx_current();
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                    pat, sizeof pat));
  int fd;
  pid_t pid = spawn_helper("ho_lone_thread", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  ASSERT_OK(gpuipc_conn_send(c, b, NULL, NULL, 0));
  gpuipc_status ps = GPUIPC_OK;
  for (int k = 0; k < 3000 && ps == GPUIPC_OK; k++)
    ps = gpuipc_conn_progress(c, 10);
  ASSERT_STATUS(ps, GPUIPC_E_PEER_GONE);
  /* The helper's reader runs for 1.5 s: for most of it, its lease must
   * hold (an exited main thread is not an exited process). */
  for (int i = 0; i < 80; i++) {
    (void)gpuipc_conn_progress(c, 0);
    gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
    ASSERT_OK(gpuipc_arena_get_stats(a, &st));
    if (waitpid(pid, NULL, WNOHANG) != 0)
      harness_fail(__FILE__, __LINE__, "the helper ended early");
    if (gpuipc_block_get_holders(b) != 1 || st.leases != 1)
      harness_fail(__FILE__, __LINE__,
                   "the lease of a consumer whose main thread exited was "
                   "reclaimed while its other thread runs");
    usleep(10000);
  }
  /* Once the whole process is gone, the lease comes back. */
  ASSERT_EQ(wait_helper(pid, 60), 0);
  for (int i = 0; i < 1000 && gpuipc_block_get_holders(b) > 0; i++) {
    (void)gpuipc_conn_progress(c, 0);
    usleep(1000);
  }
  ASSERT_EQ(gpuipc_block_get_holders(b), 0);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- a consumer's close is bounded ------------------------------------------------------ */

/* A producer whose work before its send never completes (its stream waits
 * for a word nobody writes); it lives on until killed. */
HELPER_IMPL(ho_stuck_producer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  /* The never-written word: cuMemAlloc memory (stream memory operations
   * are refused on pool memory). */
  uint64_t *word = NULL;
  ASSERT_CU(gpuipc__cu.cuMemAlloc((CUdeviceptr *)&word, 8));
  ASSERT_CU(gpuipc__cu.cuMemsetD32((CUdeviceptr)(uintptr_t)word, 0, 2));
  CUstream q = s ? s : NULL;
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(q, (CUdeviceptr)(uintptr_t)word, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, NULL, 0));
  ASSERT_OK(gpuipc_conn_send_msg(c, "sent", 4, NULL, 0));
  for (;;)
    pause();
}

/* gpuipc_conn_close on the consumer side ends within the connection's
 * timeout, although the producer is alive and its work before the send
 * never completes (a stream of ours waits for its ready word). */
TEST_IMPL(handoff_consumer_close_bounded) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_stuck_producer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 2000));
  bounded("gpuipc_conn_close of a consumer", 30);
  uint64_t t0 = gpuipc__now_ns();
  gpuipc_conn_close(c);
  uint64_t ms = (gpuipc__now_ns() - t0) / 1000000;
  bounded_done();
  ASSERT_LE(ms, 5000);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  bounded("the consumer's stream after the close", 30);
  if (s)
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  bounded_done();
  return 0;
}

/* ---- every driver call of the handoff failing in turn ------------------------------------ */

/* Both sides of a short handoff that tolerate any failure: each call may
 * fail, and then that side closes. What must hold is that both sides end
 * (bounded by the caller) and nothing crashes. */
static void tolerant_producer(gpuipc_conn *c) {
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)1 << 20;
  gpuipc_arena *a = NULL;
  if (gpuipc_arena_create(&ao, &a) != GPUIPC_OK) {
    gpuipc_conn_close(c);
    return;
  }
  ctx_current();
  CUstream s = NULL;
  if (gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
    s = NULL;
  gpuipc_block *b[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i++) {
    if (gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b[i]) != GPUIPC_OK)
      break;
    if (gpuipc_conn_send(c, b[i], (struct CUstream_st *)s, NULL, 0) != GPUIPC_OK)
      break;
  }
  for (int k = 0; k < 300; k++) {
    unsigned held = 0;
    for (int i = 0; i < 3; i++)
      held += b[i] ? gpuipc_block_get_holders(b[i]) : 0;
    if (held == 0)
      break;
    if (gpuipc_conn_progress(c, 10) != GPUIPC_OK)
      usleep(10000);
  }
  for (int i = 0; i < 3; i++)
    (void)gpuipc_block_free(b[i], (struct CUstream_st *)s);
  gpuipc_conn_close(c);
  (void)gpuipc_arena_destroy(a);
}

static void tolerant_consumer(gpuipc_conn *c) {
  ctx_current();
  CUstream s = NULL;
  if (gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
    s = NULL;
  for (int i = 0; i < 3; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    if (gpuipc_conn_recv(c, (struct CUstream_st *)s, &r) != GPUIPC_OK)
      break;
    if (gpuipc_conn_release(c, r.id, (struct CUstream_st *)s) != GPUIPC_OK)
      break;
  }
  gpuipc_conn_close(c);
  if (s)
    (void)gpuipc__cu.cuStreamSynchronize(s);
}

static gpuipc_conn *fault_conn(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 2000;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  return c;
}

HELPER_IMPL(ho_fault_side) {
  gpuipc_conn *c = fault_conn(dup(harness_helper_fd()));
  if (strcmp(argv[0], "producer") == 0)
    tolerant_producer(c);
  else
    tolerant_consumer(c);
  return 0;
}

/* Each driver call the handoff makes fails in turn (the first, second,
 * third call of it, and every call), on the producer's side and on the
 * consumer's: both sides must end, each within the bound, without a
 * crash. */
TEST_IMPL(handoff_driver_faults_end_cleanly) {
  REQUIRE_EMULATOR("fault injection (GPUIPC_EMU_FAIL)");
  static const char *calls[] = {
      "cuStreamWriteValue64", "cuStreamWaitValue64", "cuStreamSynchronize",
      "cuEventRecord",        "cuStreamWaitEvent",   "cuEventCreate",
      "cuStreamCreate",       "cuMemsetD32Async",    "cuMemcpyDtoHAsync",
      "cuEventQuery",
  };
  static const char *nth[] = {"1", "2", "3", "*"};
  int runs = 0;
  for (int side = 0; side < 2; side++)
    for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(calls); i++)
      for (size_t k = 0; k < GPUIPC__ARRAY_SIZE(nth); k++) {
        char var[128];
        snprintf(var, sizeof var, "GPUIPC_EMU_FAIL=%s:%s", calls[i], nth[k]);
        /* With every call of a kind failing, memory whose release cannot
         * be ordered stays allocated until exit (by design): not a leak
         * for the leak checker of sanitizer builds. */
        char *env[] = {var, "ASAN_OPTIONS=detect_leaks=0", NULL};
        /* GPUIPC_TEST_FAULT=NAME:N:SIDE repeats one run. */
        const char *only = getenv("GPUIPC_TEST_FAULT");
        char key[128];
        snprintf(key, sizeof key, "%s:%s:%s", calls[i], nth[k],
                 side == 0 ? "producer" : "consumer");
        if (only && strcmp(only, key) != 0)
          continue;
        char what[200];
        snprintf(what, sizeof what, "the run with %s in the %s", var,
                 side == 0 ? "producer" : "consumer");
        bounded(what, 40);
        int fd;
        pid_t pid = spawn_helper("ho_fault_side", env, &fd,
                                 side == 0 ? "producer" : "consumer", NULL);
        gpuipc_conn *c = fault_conn(fd);
        if (side == 0)
          tolerant_consumer(c);
        else
          tolerant_producer(c);
        int st = wait_helper(pid, 30);
        if (st != 0)
          harness_fail(__FILE__, __LINE__, "%s: helper ended with %d", what,
                       st);
        bounded_done();
        runs++;
      }
  printf("%d fault runs\n", runs);
  return 0;
}

/* ---- a consumer that gives up on its own error ------------------------------------------- */

/* Receives one buffer and keeps it, then runs out of file descriptors (its
 * limit lowered to its lowest free fd), so the next arena chunk cannot
 * arrive and it breaks the connection itself. Lives on until killed. */
HELPER_IMPL(ho_fd_starved) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
  /* A new fd takes the lowest free number: none is left below it. */
  int lowest = 0;
  while (fcntl(lowest, F_GETFD) >= 0)
    lowest++;
  struct rlimit rl;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  rl.rlim_cur = (rlim_t)lowest;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "starved", 7, NULL, 0));
  gpuipc_status s = GPUIPC_OK;
  for (int i = 0; i < 100 && s == GPUIPC_OK; i++) {
    gpuipc_received r2 = GPUIPC_RECEIVED_INIT;
    s = gpuipc_conn_recv(c, NULL, &r2);
  }
  ASSERT(s != GPUIPC_OK);
  for (;;)
    pause();
}

/* A consumer that ends its connection on its own error, and lives on,
 * tells the producer what it still holds: everything else comes back at
 * once (here the block of a chunk it could never map), not when its
 * process exits. */
TEST_IMPL(handoff_consumer_gives_up_tells_what_it_held) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_fd_starved", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a1 = mkarena((size_t)1 << 20);
  gpuipc_block *b1 = NULL, *b2 = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a1, 4096, NULL, &b1));
  ASSERT_OK(gpuipc_conn_send(c, b1, NULL, NULL, 0));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_MEM_EQ(buf, "starved", 7);
  gpuipc_arena *a2 = mkarena((size_t)1 << 20);
  ASSERT_OK(gpuipc_arena_alloc(a2, 4096, NULL, &b2));
  ASSERT_OK(gpuipc_conn_send(c, b2, NULL, NULL, 0));
  for (int i = 0; i < 500 && gpuipc_block_get_holders(b2) > 0; i++)
    if (gpuipc_conn_progress(c, 10) != GPUIPC_OK)
      usleep(10000);
  ASSERT_EQ(waitpid(pid, NULL, WNOHANG), 0); /* it lives */
  if (gpuipc_block_get_holders(b2) != 0)
    harness_fail(__FILE__, __LINE__,
                 "the lease of a block the consumer never mapped stays "
                 "while the consumer lives");
  ASSERT_EQ(gpuipc_block_get_holders(b1), 1); /* that one it holds */
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  for (int i = 0; i < 1000 && gpuipc_block_get_holders(b1) > 0; i++) {
    (void)gpuipc_conn_progress(c, 0);
    usleep(1000);
  }
  ASSERT_EQ(gpuipc_block_get_holders(b1), 0);
  ASSERT_OK(gpuipc_block_free(b1, NULL));
  ASSERT_OK(gpuipc_block_free(b2, NULL));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a1));
  ASSERT_OK(gpuipc_arena_destroy(a2));
  return 0;
}

/* ---- the opt-in peer watcher ------------------------------------------------------------ */

/* With watch_peer, a consumer whose stream waits for a buffer of an
 * exporter that then dies gets its stream unblocked without any gpuipc
 * call: cuStreamSynchronize returns. (Without the watcher it would block
 * until some call on the connection: GPUIPC_TEST_NO_WATCH=1 shows it.) */
static int watcher_unblocks(char *helper) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper(helper, NULL, &fd, NULL);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.watch_peer = getenv("GPUIPC_TEST_NO_WATCH") == NULL;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  /* The producer's work before the send never completes: s waits. */
  usleep(50000);
  ASSERT_EQ(gpuipc__cu.cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  bounded("cuStreamSynchronize after the exporter died, with no gpuipc call",
          20);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  bounded_done();
  ASSERT_STATUS(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s),
                GPUIPC_OK);
  gpuipc_conn_close(c);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}

TEST_IMPL(handoff_watcher_unblocks_without_calls) {
  return watcher_unblocks("ho_stuck_producer");
}

/* The same for a buffer of a broadcast (the shared ready word). */
TEST_IMPL(handoff_watcher_unblocks_broadcast_without_calls) {
  return watcher_unblocks("ho_doomed_broadcaster");
}

/* ---- batches ------------------------------------------------------------------------------ */

/* A batch consumer: receives argv[1] buffers, argv[2] = "batch" (up to 7
 * at a time with gpuipc_conn_recv_batch, released together with
 * gpuipc_conn_release_batch) or "single" (one by one), checks each
 * against the pattern whose seed is in its metadata, reports "ok".
 * argv[0]: "pair" or a name to connect to in the runtime dir argv[3]. */
HELPER_IMPL(ho_batch_consumer) {
  ASSERT(argc >= 3);
  int count = atoi(argv[1]);
  bool batch = strcmp(argv[2], "batch") == 0;
  gpuipc_conn *c = NULL;
  if (strcmp(argv[0], "pair") == 0) {
    c = pair_conn(dup(harness_helper_fd()));
  } else {
    ASSERT(argc >= 4);
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.timeout_ms = 30000;
    o.runtime_dir = argv[3];
    ASSERT_OK(gpuipc_connect(argv[0], &o, &c));
  }
  CUstream s = mkstream();
  enum { MAXB = 7 };
  gpuipc_received rs[MAXB];
  for (int got = 0; got < count;) {
    size_t n = 0;
    for (int i = 0; i < MAXB; i++)
      rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    if (batch) {
      size_t max = (size_t)(count - got) < MAXB ? (size_t)(count - got) : MAXB;
      ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs, max, &n));
      ASSERT(n >= 1 && n <= max);
    } else {
      ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &rs[0]));
      n = 1;
    }
    uint8_t *host[MAXB];
    /* Every copy is queued right after the receive, ordered only by the
     * waits it queued. */
    for (size_t i = 0; i < n; i++) {
      host[i] = malloc(rs[i].length);
      ASSERT_NOT_NULL(host[i]);
      ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(
          host[i], (CUdeviceptr)(uintptr_t)rs[i].ptr, rs[i].length, s));
    }
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    uint64_t ids[MAXB];
    for (size_t i = 0; i < n; i++) {
      ASSERT_EQ(rs[i].meta_len, sizeof(uint32_t));
      uint32_t seed;
      memcpy(&seed, rs[i].meta, sizeof seed);
      check_pattern(host[i], rs[i].length, seed);
      free(host[i]);
      ids[i] = rs[i].id;
    }
    if (batch)
      ASSERT_OK(gpuipc_conn_release_batch(c, ids, n, (struct CUstream_st *)s));
    else
      ASSERT_OK(gpuipc_conn_release(c, ids[0], (struct CUstream_st *)s));
    got += (int)n;
  }
  size_t here = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  char buf[4];
  size_t len;
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  return 0;
}

/* Allocates a block of n bytes of a, fills it with the pattern of seed on
 * s (asynchronously, from pinned memory the caller frees after a sync). */
static gpuipc_block *filled_block(gpuipc_arena *a, CUstream s, size_t n,
                                  uint32_t seed, uint8_t **pinned) {
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)pinned, n, 0));
  pattern(*pinned, n, seed);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(
      (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), *pinned, n, s));
  return b;
}

/* Sends batches of nb blocks alternating between two arenas, of sizes
 * from sizes[], every block freed after its send (the memory returns when
 * the consumer released it). */
/* send_batches waits for its copies before each send (an idle stream). */
static bool sync_before_send;

static void send_batches(gpuipc_conn *c, gpuipc_arena *a1, gpuipc_arena *a2,
                         CUstream s, int nb, int rounds, const size_t *sizes,
                         int nsizes, uint32_t seed0) {
  gpuipc_block **bs = calloc((size_t)nb, sizeof *bs);
  uint8_t **pin = calloc((size_t)nb, sizeof *pin);
  uint32_t *seeds = calloc((size_t)nb, sizeof *seeds);
  const void **metas = calloc((size_t)nb, sizeof *metas);
  size_t *lens = calloc((size_t)nb, sizeof *lens);
  ASSERT(bs && pin && seeds && metas && lens);
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < nb; i++) {
      seeds[i] = seed0 + (uint32_t)(r * nb + i);
      bs[i] = filled_block(i % 2 ? a2 : a1, s, sizes[(r + i) % nsizes],
                           seeds[i], &pin[i]);
      metas[i] = &seeds[i];
      lens[i] = sizeof seeds[i];
    }
    if (sync_before_send)
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    ASSERT_OK(gpuipc_conn_send_batch(c, bs, (size_t)nb,
                                     (struct CUstream_st *)s, metas, lens));
    for (int i = 0; i < nb; i++) {
      ASSERT_GE(gpuipc_block_get_holders(bs[i]), 1);
      ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
    }
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    for (int i = 0; i < nb; i++)
      ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin[i]));
  }
  free(bs);
  free(pin);
  free(seeds);
  free(metas);
  free(lens);
}

static void expect_ok_and_settled(gpuipc_conn *c, gpuipc_arena *a1,
                                  gpuipc_arena *a2, pid_t pid) {
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  gpuipc_arena *as[2] = {a1, a2};
  for (int i = 0; i < 2; i++) {
    gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
    ASSERT_OK(gpuipc_arena_get_stats(as[i], &st));
    ASSERT_EQ(st.blocks_allocated, 0);
    ASSERT_EQ(st.leases, 0);
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
}

/* Batches of 1, 16 and 256 blocks mixing two arenas and many sizes, to a
 * consumer that receives them in pieces of up to 7 (batch mode) or one by
 * one (single mode), with single sends in between. */
TEST_IMPL(handoff_batch_mixed_arenas_and_sizes) {
  REQUIRE_DEVICES(1);
  static const size_t sizes[] = {1, 100, 4096, 5000, 65536, 300000, 512};
  const char *modes[2] = {"batch", "single"};
  for (int m = 0; m < 2; m++) {
    int fd;
    /* 1 + 3*16 + 256 + 2 single + 2*1 */
    pid_t pid = spawn_helper("ho_batch_consumer", NULL, &fd, "pair", "309",
                             (char *)modes[m], NULL);
    gpuipc_conn *c = pair_conn(fd);
    gpuipc_arena *a1 = mkarena((size_t)1 << 20);
    gpuipc_arena *a2 = mkarena((size_t)4 << 20);
    CUstream s = mkstream();
    send_batches(c, a1, a2, s, 1, 1, sizes, 7, 10);
    send_batches(c, a1, a2, s, 16, 3, sizes, 7, 100);
    send_pattern(c, a1, s, 777, 5000, NULL);
    static const size_t small[] = {512, 64, 1024};
    send_batches(c, a1, a2, s, 256, 1, small, 3, 1000);
    send_pattern(c, a2, s, 3000, 5001, NULL);
    send_batches(c, a1, a2, s, 1, 2, sizes, 7, 20000);
    expect_ok_and_settled(c, a1, a2, pid);
    gpuipc_conn_close(c);
    ASSERT_OK(gpuipc_arena_destroy(a1));
    ASSERT_OK(gpuipc_arena_destroy(a2));
  }
  return 0;
}

/* The producer's copies into every block of a batch are slow: the
 * consumer's reads, queued right after its receive, must not overtake any
 * of them (the batch's one ready write follows them all). */
TEST_IMPL(handoff_batch_order_slow_producer) {
  if (harness_on_emulator())
    setenv("GPUIPC_EMU_COPY_DELAY_US", "30000", 1);
  REQUIRE_DEVICES(1);
  static const size_t sizes[] = {65536, 4096, 100000};
  static char *no_delay[] = {"GPUIPC_EMU_COPY_DELAY_US=", NULL};
  const char *modes[2] = {"batch", "single"};
  for (int m = 0; m < 2; m++) {
    int fd;
    pid_t pid = spawn_helper("ho_batch_consumer", no_delay, &fd, "pair", "8",
                             (char *)modes[m], NULL);
    gpuipc_conn *c = pair_conn(fd);
    gpuipc_arena *a1 = mkarena((size_t)2 << 20);
    gpuipc_arena *a2 = mkarena((size_t)2 << 20);
    CUstream s = mkstream();
    send_batches(c, a1, a2, s, 8, 1, sizes, 3, 4242);
    expect_ok_and_settled(c, a1, a2, pid);
    gpuipc_conn_close(c);
    ASSERT_OK(gpuipc_arena_destroy(a1));
    ASSERT_OK(gpuipc_arena_destroy(a2));
  }
  return 0;
}

/* A bad argument anywhere in a batch fails the whole batch: nothing of it
 * was sent, the peer holds nothing, the slots stay free. */
TEST_IMPL(handoff_batch_send_all_or_nothing) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_batch_consumer", NULL, &fd, "pair", "16",
                           "batch", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  enum { N = 300 };
  gpuipc_block *bs[N];
  gpuipc_block *good = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &good));
  for (int i = 0; i < N; i++)
    bs[i] = good;
  static uint8_t big[GPUIPC_META_MAX + 1];
  const void *metas[N];
  size_t lens[N];
  for (int i = 0; i < N; i++) {
    metas[i] = big;
    lens[i] = 4;
  }
  /* A NULL block in the middle. */
  bs[5] = NULL;
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, 8, (struct CUstream_st *)s,
                                       metas, lens),
                GPUIPC_E_INVALID_ARG);
  bs[5] = good;
  /* Metadata too long in the middle. */
  lens[3] = GPUIPC_META_MAX + 1;
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, 8, (struct CUstream_st *)s,
                                       metas, lens),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "block 3");
  lens[3] = 4;
  /* Metadata without data. */
  metas[2] = NULL;
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, 8, (struct CUstream_st *)s,
                                       metas, lens),
                GPUIPC_E_INVALID_ARG);
  metas[2] = big;
  /* More bytes than one frame. */
  for (int i = 0; i < N; i++)
    lens[i] = GPUIPC_META_MAX;
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, N, (struct CUstream_st *)s,
                                       metas, lens),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "bytes");
  /* More blocks than slots (max_outstanding 256). */
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, N, (struct CUstream_st *)s,
                                       NULL, NULL),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "slots");
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, 0, (struct CUstream_st *)s,
                                       NULL, NULL),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_conn_send_batch(c, bs, GPUIPC_BATCH_MAX + 1,
                                       (struct CUstream_st *)s, NULL, NULL),
                GPUIPC_E_INVALID_ARG);
  /* Nothing of it went out. */
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  ASSERT_EQ(gpuipc_block_get_holders(good), 0);
  ASSERT_OK(gpuipc_block_free(good, (struct CUstream_st *)s));
  /* The connection still works: the consumer gets exactly its 16. */
  static const size_t sizes[] = {4096, 1, 70000};
  send_batches(c, a, a, s, 16, 1, sizes, 3, 55);
  expect_ok_and_settled(c, a, a, pid);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* A producer of batches: sends argv[0] batches of 8 blocks, then waits
 * for "k" and checks that everything came back. */
HELPER_IMPL(ho_batch_producer) {
  int rounds = atoi(argv[0]);
  sync_before_send = argc >= 2 && strcmp(argv[1], "idle") == 0;
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a1 = mkarena((size_t)1 << 20);
  gpuipc_arena *a2 = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  static const size_t sizes[] = {4096, 256, 9000};
  send_batches(c, a1, a2, s, 8, rounds, sizes, 3, 300);
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  size_t out = 1;
  for (int i = 0; i < 1000 && out > 0; i++) {
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    if (out)
      ASSERT_OK(gpuipc_conn_progress(c, 10));
  }
  ASSERT_EQ(out, 0);
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a1, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a1));
  ASSERT_OK(gpuipc_arena_destroy(a2));
  return 0;
}

/* Releasing a batch with a bad id (unknown, or named twice) releases
 * none of it; partial receives of a batch work; every buffer's release is
 * its own. */
TEST_IMPL(handoff_batch_release_all_or_nothing) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_batch_producer", NULL, &fd, "2", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_received rs[8];
  for (int i = 0; i < 8; i++)
    rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  size_t n = 0;
  /* Up to 3 of the first batch of 8 (one frame: all 8 are queued). */
  ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs, 3, &n));
  ASSERT_EQ(n, 3);
  size_t got = n;
  while (got < 8) {
    ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs + got,
                                     8 - got, &n));
    got += n;
  }
  ASSERT_EQ(got, 8);
  for (int i = 0; i < 8; i++) {
    uint32_t seed;
    ASSERT_EQ(rs[i].meta_len, sizeof seed);
    memcpy(&seed, rs[i].meta, sizeof seed);
    ASSERT_EQ(seed, 300u + (uint32_t)i); /* in order */
  }
  uint64_t ids[8];
  for (int i = 0; i < 8; i++)
    ids[i] = rs[i].id;
  size_t here = 0;
  uint64_t bad[3] = {ids[0], ids[1] ^ ((uint64_t)1 << 40), ids[2]};
  ASSERT_STATUS(gpuipc_conn_release_batch(c, bad, 3, (struct CUstream_st *)s),
                GPUIPC_E_NOT_FOUND);
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 8);
  uint64_t twice[3] = {ids[3], ids[4], ids[3]};
  ASSERT_STATUS(gpuipc_conn_release_batch(c, twice, 3, (struct CUstream_st *)s),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "twice");
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 8);
  ASSERT_STATUS(gpuipc_conn_release_batch(c, ids, 0, (struct CUstream_st *)s),
                GPUIPC_E_INVALID_ARG);
  /* One on its own, the rest together. */
  ASSERT_OK(gpuipc_conn_release(c, ids[7], (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_release_batch(c, ids, 7, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 0);
  ASSERT_STATUS(gpuipc_conn_release_batch(c, ids, 1, (struct CUstream_st *)s),
                GPUIPC_E_NOT_FOUND);
  /* The second batch, one by one. */
  for (int i = 0; i < 8; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    uint32_t seed;
    memcpy(&seed, r.meta, sizeof seed);
    ASSERT_EQ(seed, 308u + (uint32_t)i);
    ASSERT_OK(gpuipc_conn_release_batch(c, &r.id, 1, (struct CUstream_st *)s));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_conn_close(c);
  return 0;
}

/* ---- broadcast ---------------------------------------------------------------------------- */

/* The producer's copy is slow; 8 consumers read right after their
 * receive: none may read before the producer's work. */
TEST_IMPL(handoff_broadcast_order_slow_producer) {
  if (harness_on_emulator())
    setenv("GPUIPC_EMU_COPY_DELAY_US", "200000", 1);
  REQUIRE_DEVICES(1);
  enum { N = 8 };
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)64 << 20;
  static char *no_delay[] = {"GPUIPC_EMU_COPY_DELAY_US=", NULL};
  pid_t pids[N];
  gpuipc_conn *cs[N];
  for (int i = 0; i < N; i++) {
    int fd;
    pids[i] = spawn_helper("ho_order", no_delay, &fd, "read", NULL);
    cs[i] = pair_conn(fd);
  }
  gpuipc_arena *a = mkarena(n + ((size_t)1 << 20));
  CUstream s = mkstream();
  for (int i = 0; i < N; i++)
    warm_up(cs[i], a, s);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  ASSERT_CU(gpuipc__cu.cuMemsetD8((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                  0xEE, n));
  uint8_t *host = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&host, n, 0));
  pattern(host, n, 77);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                        host, n, s));
  uint32_t seed = 77;
  gpuipc_status st[N];
  ASSERT_OK(gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s, &seed,
                                  sizeof seed, st));
  for (int i = 0; i < N; i++)
    ASSERT_OK(st[i]);
  ASSERT_EQ(gpuipc_block_get_holders(b), N);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  for (int i = 0; i < N; i++) {
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    ASSERT_OK(gpuipc_conn_send_msg(cs[i], "k", 1, NULL, 0));
  }
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(host));
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &as));
  ASSERT_EQ(as.blocks_allocated, 0);
  ASSERT_EQ(as.leases, 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* 8 consumers copy the broadcast block out slowly and release it at once:
 * the memory comes back only after all released, and its reuse waits on
 * the GPU for every consumer's queued copy. */
TEST_IMPL(handoff_broadcast_reuse_waits_for_all) {
  REQUIRE_DEVICES(1);
  enum { N = 8 };
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)64 << 20;
  pid_t pids[N];
  gpuipc_conn *cs[N];
  for (int i = 0; i < N; i++) {
    int fd;
    pids[i] = spawn_helper("ho_order", harness_on_emulator() ? delay_env : NULL,
                           &fd, "reuse", NULL);
    cs[i] = pair_conn(fd);
  }
  gpuipc_arena *a = mkarena(n + 8192);
  CUstream s = mkstream();
  for (int i = 0; i < N; i++)
    warm_up(cs[i], a, s);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  void *first = gpuipc_block_get_ptr(b);
  uint8_t *host = malloc(n);
  pattern(host, n, 99);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)first, host, n, s));
  uint32_t seed = 99;
  ASSERT_OK(gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s, &seed,
                                  sizeof seed, NULL));
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  char buf[16];
  size_t len;
  for (int i = 0; i < N; i++) {
    /* While some still hold it, the memory is not handed out again. */
    if (i < N - 1) {
      gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
      ASSERT_OK(gpuipc_arena_get_stats(a, &as));
      ASSERT_EQ(as.blocks_deferred, 1);
    }
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    ASSERT_EQ(len, 8);
  }
  for (int i = 0; i < N; i++) {
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(cs[i], &out, NULL));
    ASSERT_EQ(out, 0);
  }
  gpuipc_block *b2 = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b2));
  ASSERT_PTR_EQ(gpuipc_block_get_ptr(b2), first);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)first, 0x55, n, s));
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_conn_send_msg(cs[i], "overwritten", 11, NULL, 0));
  for (int i = 0; i < N; i++) {
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    ASSERT_EQ(len, 2);
    ASSERT_OK(gpuipc_conn_send_msg(cs[i], "k", 1, NULL, 0));
  }
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  free(host);
  ASSERT_OK(gpuipc_block_free(b2, (struct CUstream_st *)s));
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* One consumer of a broadcast is killed midway: the others get every
 * buffer, the broadcast reports the dead one only, its leases come back. */
TEST_IMPL(handoff_broadcast_consumer_killed) {
  REQUIRE_DEVICES(1);
  enum { N = 5, ROUNDS = 20, VICTIM = 2 };
  pid_t pids[N];
  gpuipc_conn *cs[N];
  char rounds[8];
  snprintf(rounds, sizeof rounds, "%d", ROUNDS);
  for (int i = 0; i < N; i++) {
    int fd;
    if (i == VICTIM)
      pids[i] = spawn_helper("ho_victim", NULL, &fd, NULL);
    else
      pids[i] = spawn_helper("ho_consumer", NULL, &fd, "pair", rounds, NULL);
    cs[i] = pair_conn(fd);
  }
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  bool victim_failed = false;
  for (int r = 0; r < ROUNDS; r++) {
    if (r == ROUNDS / 2) {
      kill(pids[VICTIM], SIGKILL);
      wait_helper(pids[VICTIM], 60);
    }
    gpuipc_block *b = NULL;
    size_t n = 4096 * (size_t)(1 + r % 5);
    ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
    uint8_t *host = malloc(n);
    uint32_t seed = 500u + (uint32_t)r;
    pattern(host, n, seed);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                          host, n, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    free(host);
    gpuipc_status st[N];
    gpuipc_status all = gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s,
                                              &seed, sizeof seed, st);
    for (int i = 0; i < N; i++) {
      if (i != VICTIM) {
        ASSERT_OK(st[i]);
      } else if (st[i] != GPUIPC_OK) {
        ASSERT(r >= ROUNDS / 2);
        ASSERT(st[i] == GPUIPC_E_PEER_GONE || st[i] == GPUIPC_E_CLOSED);
        ASSERT_STATUS(all, st[i]);
        victim_failed = true;
      }
    }
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  }
  ASSERT(victim_failed);
  for (int i = 0; i < N; i++) {
    if (i == VICTIM)
      continue;
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(cs[i], &out, NULL));
    ASSERT_EQ(out, 0);
  }
  /* The victim's leases came back. */
  size_t out = 1;
  for (int k = 0; k < 1000 && out > 0; k++) {
    (void)gpuipc_conn_progress(cs[VICTIM], 10);
    ASSERT_OK(gpuipc_conn_get_outstanding(cs[VICTIM], &out, NULL));
  }
  ASSERT_EQ(out, 0);
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &as));
  ASSERT_EQ(as.blocks_allocated, 0);
  ASSERT_EQ(as.leases, 0);
  for (int i = 0; i < N; i++)
    if (i != VICTIM)
      ASSERT_OK(gpuipc_conn_send_msg(cs[i], "k", 1, NULL, 0));
  for (int i = 0; i < N; i++)
    if (i != VICTIM)
      ASSERT_EQ(wait_helper(pids[i], 60), 0);
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* 64 consumers of one broadcast, a few rounds; argument checks. */
TEST_IMPL(handoff_broadcast_64_consumers) {
  REQUIRE_DEVICES(1);
  enum { N = 64, ROUNDS = 3 };
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 60000;
  o.runtime_dir = rt_dir();
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("bcast", &o, &l));
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  pid_t pids[N];
  gpuipc_conn *cs[N];
  char rounds[8];
  snprintf(rounds, sizeof rounds, "%d", ROUNDS);
  for (int i = 0; i < N; i++)
    pids[i] = spawn_helper("ho_consumer", NULL, NULL, "bcast", rounds,
                           (char *)rt_dir(), NULL);
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_accept(l, &cs[i]));
  {
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 256, (struct CUstream_st *)s, &b));
    gpuipc_conn *dup2[2] = {cs[0], cs[0]};
    ASSERT_STATUS(gpuipc_conn_broadcast(dup2, 2, b, (struct CUstream_st *)s,
                                        NULL, 0, NULL),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "same");
    gpuipc_conn *withnull[2] = {cs[0], NULL};
    ASSERT_STATUS(gpuipc_conn_broadcast(withnull, 2, b, (struct CUstream_st *)s,
                                        NULL, 0, NULL),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_STATUS(gpuipc_conn_broadcast(cs, 0, b, (struct CUstream_st *)s,
                                        NULL, 0, NULL),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_STATUS(gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s,
                                        NULL, GPUIPC_META_MAX + 1, NULL),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_EQ(gpuipc_block_get_holders(b), 0);
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  }
  for (int r = 0; r < ROUNDS; r++) {
    gpuipc_block *b = NULL;
    size_t n = 65536;
    ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
    uint8_t *host = malloc(n);
    uint32_t seed = 2000u + (uint32_t)r;
    pattern(host, n, seed);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                          host, n, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    free(host);
    ASSERT_OK(gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s, &seed,
                                    sizeof seed, NULL));
    ASSERT_EQ(gpuipc_block_get_holders(b), N);
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  }
  for (int i = 0; i < N; i++) {
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(cs[i], &out, NULL));
    ASSERT_EQ(out, 0);
  }
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_EQ(st.leases, 0);
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  gpuipc_listener_close(l);
  return 0;
}

/* ---- batches: driver calls and ordering of coalesced releases ------------------------------ */

static atomic_int n_write_value, n_wait_value;
static CUresult (*real_write_value)(CUstream, CUdeviceptr, cuuint64_t,
                                    unsigned int);
static CUresult (*real_wait_value)(CUstream, CUdeviceptr, cuuint64_t,
                                   unsigned int);
static CUresult counting_write(CUstream s, CUdeviceptr a, cuuint64_t v,
                               unsigned int f) {
  atomic_fetch_add(&n_write_value, 1);
  return real_write_value(s, a, v, f);
}
static CUresult counting_wait(CUstream s, CUdeviceptr a, cuuint64_t v,
                              unsigned int f) {
  atomic_fetch_add(&n_wait_value, 1);
  return real_wait_value(s, a, v, f);
}
/* Counts this process's stream memory operations from now on. */
static void count_memops(void) {
  if (real_write_value == NULL) {
    real_write_value = gpuipc__cu.cuStreamWriteValue64;
    real_wait_value = gpuipc__cu.cuStreamWaitValue64;
    gpuipc__cu.cuStreamWriteValue64 = counting_write;
    gpuipc__cu.cuStreamWaitValue64 = counting_wait;
  }
  atomic_store(&n_write_value, 0);
  atomic_store(&n_wait_value, 0);
}
static void uncount_memops(void) {
  if (real_write_value) {
    gpuipc__cu.cuStreamWriteValue64 = real_write_value;
    gpuipc__cu.cuStreamWaitValue64 = real_wait_value;
    real_write_value = NULL;
  }
}

/* A batch costs one ready write (producer), one wait (consumer, for the
 * whole batch received at once), one release write (consumer), and a
 * few reclaim waits (producer, one per release frame), not one of each
 * per buffer. Memop mode only (event mode orders each buffer by its own
 * events). */
TEST_IMPL(handoff_batch_driver_calls) {
  REQUIRE_DEVICES(1);
  if (test_order() != GPUIPC_ORDER_MEMOP)
    SKIP("stream memory operations only");
  /* Consumer side: the helper sends two batches of 8 from a stream whose
   * work is done (so no wait at all), then two more from a stream that
   * may still copy (at most one wait per batch). */
  CUstream s = mkstream();
  for (int idle = 1; idle >= 0; idle--) {
  int fd;
  pid_t pid = spawn_helper("ho_batch_producer", NULL, &fd, "2",
                           idle ? "idle" : "busy", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_received rs[8];
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < 8; i++)
      rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    /* The batch's frame comes whole: its 8 buffers are queued together
     * (one frame is read whole before recv returns). */
    count_memops();
    size_t n = 0;
    ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs, 8, &n));
    ASSERT_EQ(n, 8);
    if (idle)
      ASSERT_EQ(atomic_load(&n_wait_value), 0);
    else
      ASSERT_LE(atomic_load(&n_wait_value), 1);
    uint64_t ids[8];
    for (int i = 0; i < 8; i++)
      ids[i] = rs[i].id;
    count_memops();
    ASSERT_OK(gpuipc_conn_release_batch(c, ids, 8, (struct CUstream_st *)s));
    ASSERT_EQ(atomic_load(&n_write_value), 1);
    uncount_memops();
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  char buf[4];
  size_t len;
  /* The producer saw every lease come back (it checks, then says ok). */
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_conn_close(c);
  }

  /* Producer side: a batch of 16 to a consumer that releases in batches
   * of up to 7, sent while the stream is held back (one ready write). */
  int fd;
  pid_t pid = spawn_helper("ho_batch_consumer", NULL, &fd, "pair", "19",
                           "batch", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  static const size_t sizes[] = {4096, 256};
  /* Setup (flag words, chunks), from an idle stream: no busy answer
   * before the one below. */
  sync_before_send = true;
  send_batches(c, a, a, s, 1, 1, sizes, 2, 1);
  sync_before_send = false;
  gpuipc_block *bs[16];
  uint8_t *pin[16];
  uint32_t seeds[16];
  const void *metas[16];
  size_t lens[16];
  for (int i = 0; i < 16; i++) {
    seeds[i] = 60 + (uint32_t)i;
    bs[i] = filled_block(a, s, 4096, seeds[i], &pin[i]);
    metas[i] = &seeds[i];
    lens[i] = sizeof seeds[i];
  }
  CUdeviceptr gate;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(gate, 0, 256));
  if (s != NULL)
    ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ));
  count_memops();
  ASSERT_OK(gpuipc_conn_send_batch(c, bs, 16, (struct CUstream_st *)s, metas,
                                   lens));
  ASSERT_EQ(atomic_load(&n_write_value), 1);
  CUstream o;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&o, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(real_write_value(o, gate, 1, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(o));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(o));
  count_memops();
  for (int i = 0; i < 16; i++)
    wait_unheld(c, bs[i]);
  /* 16 buffers released in at least 3 calls of at most 7: a reclaim wait
   * per release frame at most. */
  int waits = atomic_load(&n_wait_value);
  uncount_memops();
  if (waits < 1 || waits > 16 / 7 + 2)
    harness_fail(__FILE__, __LINE__, "%d reclaim waits for 16 releases",
                 waits);
  for (int i = 0; i < 16; i++)
    ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < 16; i++)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin[i]));
  /* From an idle stream: no ready write at all, once the send after the
   * busy one above did not ask (the backoff). */
  for (int k = 0; k < 2; k++) {
    uint8_t *p1 = NULL;
    gpuipc_block *b1 = filled_block(a, s, 4096, 77, &p1);
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    uint32_t seed = 77;
    const void *m1 = &seed;
    size_t l1 = sizeof seed;
    count_memops();
    ASSERT_OK(gpuipc_conn_send_batch(c, &b1, 1, (struct CUstream_st *)s, &m1,
                                     &l1));
    int writes = atomic_load(&n_write_value);
    uncount_memops();
    if (s != NULL) /* the legacy stream is never asked */
      ASSERT_EQ(writes, k == 0 ? 1 : 0);
    wait_unheld(c, b1);
    ASSERT_OK(gpuipc_block_free(b1, (struct CUstream_st *)s));
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(p1));
  }
  ASSERT_CU(gpuipc__cu.cuMemFree(gate));
  expect_ok_and_settled(c, a, a, pid);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* Receives a batch of argv[0] buffers, copies each (slowly: the emulator's
 * delay) into memory of its own, releases them all in one call, says
 * "released", and once the producer has overwritten the memory, checks
 * its copies. */
HELPER_IMPL(ho_batch_reuse) {
  int count = atoi(argv[0]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received *rs = calloc((size_t)count, sizeof *rs);
  CUdeviceptr *priv = calloc((size_t)count, sizeof *priv);
  ASSERT(rs && priv);
  for (int i = 0; i < count; i++)
    rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  for (int got = 0; got < count;) {
    size_t n = 0;
    ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs + got,
                                     (size_t)(count - got), &n));
    got += (int)n;
  }
  uint64_t *ids = calloc((size_t)count, sizeof *ids);
  for (int i = 0; i < count; i++) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv[i], rs[i].length));
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv[i], (CUdeviceptr)(uintptr_t)rs[i].ptr,
                                          rs[i].length, s));
    ids[i] = rs[i].id;
  }
  ASSERT_OK(gpuipc_conn_release_batch(c, ids, (size_t)count,
                                      (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_send_msg(c, "released", 8, NULL, 0));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < count; i++) {
    uint8_t *host = malloc(rs[i].length);
    ASSERT_NOT_NULL(host);
    d2h(host, (void *)(uintptr_t)priv[i], rs[i].length);
    uint32_t seed;
    memcpy(&seed, rs[i].meta, sizeof seed);
    check_pattern(host, rs[i].length, seed);
    free(host);
    ASSERT_CU(gpuipc__cu.cuMemFree(priv[i]));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  free(rs);
  free(priv);
  free(ids);
  gpuipc_conn_close(c);
  return 0;
}

/* The consumer releases a batch of 8 with one flag word while its copies
 * out of every buffer are still queued (slow): the producer's reuse of
 * each buffer's memory, the first ones too, waits for them. */
TEST_IMPL(handoff_batch_release_orders_reuse) {
  REQUIRE_DEVICES(1);
  enum { N = 8 };
  size_t n = harness_on_emulator() ? (size_t)1 << 16 : (size_t)64 << 20;
  int fd;
  pid_t pid = spawn_helper("ho_batch_reuse", harness_on_emulator() ? delay_env : NULL,
                           &fd, "8", NULL);
  gpuipc_conn *c = pair_conn(fd);
  /* Room for the flag words and exactly N blocks: the reuse below gets
   * the same memory back. */
  gpuipc_arena *a = mkarena(N * n + 8192);
  CUstream s = mkstream();
  gpuipc_block *bs[N];
  uint8_t *pin[N];
  uint32_t seeds[N];
  const void *metas[N];
  size_t lens[N];
  void *ptrs[N];
  for (int i = 0; i < N; i++) {
    seeds[i] = 900 + (uint32_t)i;
    bs[i] = filled_block(a, s, n, seeds[i], &pin[i]);
    metas[i] = &seeds[i];
    lens[i] = sizeof seeds[i];
    ptrs[i] = gpuipc_block_get_ptr(bs[i]);
  }
  ASSERT_OK(gpuipc_conn_send_batch(c, bs, N, (struct CUstream_st *)s, metas,
                                   lens));
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 8);
  size_t out = 1;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  ASSERT_EQ(out, 0);
  /* Every block's memory back, overwritten at once on s (not synced). */
  for (int i = 0; i < N; i++) {
    gpuipc_block *b2 = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b2));
    bool known = false;
    for (int k = 0; k < N; k++)
      known |= gpuipc_block_get_ptr(b2) == ptrs[k];
    ASSERT(known);
    ASSERT_CU(gpuipc__cu.cuMemsetD8Async(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b2), 0x55, n, s));
    bs[i] = b2;
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "overwritten", 11, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < N; i++) {
    uint8_t probe[4];
    d2h(probe, gpuipc_block_get_ptr(bs[i]), sizeof probe);
    ASSERT_EQ(probe[0], 0x55);
    ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin[i]));
  }
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* Receives two buffers and gives them back with a forged REL frame
 * (argv[0]: "last" flags the frame's last entry BY_NEXT, "unknown" sets a
 * flag that does not exist); then waits to be hung up on. */
HELPER_IMPL(ho_rel_forger) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received r[2] = {GPUIPC_RECEIVED_INIT, GPUIPC_RECEIVED_INIT};
  for (int i = 0; i < 2; i++)
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r[i]));
  gpuipc__w_rel rel[2];
  for (int i = 0; i < 2; i++) {
    uint32_t slot = (uint32_t)(r[i].id >> 44);
    /* The low 44 bits of the id are the sequence number (small here). */
    rel[i] = (gpuipc__w_rel){r[i].id & (((uint64_t)1 << 44) - 1), slot, 0};
  }
  if (strcmp(argv[0], "last") == 0) {
    rel[0].flags = GPUIPC__REL_BY_NEXT;
    rel[1].flags = GPUIPC__REL_BY_NEXT;
  } else {
    rel[0].flags = 0x8;
  }
  raw_frame(gpuipc_conn_get_fd(c), GPUIPC__F_REL, rel, sizeof rel);
  char b;
  size_t len;
  gpuipc_status st = gpuipc_conn_recv_msg(c, &b, 1, &len, NULL, NULL);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_TIMEOUT);
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(handoff_rejects_forged_release_flags) {
  REQUIRE_DEVICES(1);
  if (test_order() != GPUIPC_ORDER_MEMOP)
    SKIP("BY_NEXT is for stream memory operations");
  const char *cases[2] = {"last", "unknown"};
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  for (int i = 0; i < 2; i++) {
    int fd;
    pid_t pid = spawn_helper("ho_rel_forger", NULL, &fd, (char *)cases[i], NULL);
    gpuipc_conn *c = pair_conn(fd);
    gpuipc_block *b[2];
    for (int k = 0; k < 2; k++) {
      ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b[k]));
      ASSERT_OK(gpuipc_conn_send(c, b[k], (struct CUstream_st *)s, NULL, 0));
    }
    gpuipc_status st = GPUIPC_OK;
    for (int k = 0; k < 3000 && st == GPUIPC_OK; k++)
      st = gpuipc_conn_progress(c, 10);
    if (st != GPUIPC_E_PROTOCOL)
      harness_fail(__FILE__, __LINE__, "case %s: %s (%s)", cases[i],
                   gpuipc_status_name(st), gpuipc_last_error());
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "flags");
    /* Nothing of the frame was applied: both leases stay until the
     * forger is gone, then come back. */
    ASSERT_EQ(gpuipc_block_get_holders(b[0]), 1);
    ASSERT_EQ(gpuipc_block_get_holders(b[1]), 1);
    ASSERT_EQ(wait_helper(pid, 60), 0);
    size_t out = 1;
    for (int k = 0; k < 1000 && out > 0; k++) {
      (void)gpuipc_conn_progress(c, 10);
      ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    }
    ASSERT_EQ(out, 0);
    for (int k = 0; k < 2; k++)
      ASSERT_OK(gpuipc_block_free(b[k], (struct CUstream_st *)s));
    gpuipc_conn_close(c);
  }
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &as));
  ASSERT_EQ(as.blocks_allocated, 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- batches and broadcast in event mode and on the legacy stream -------------------------- */

TEST_IMPL(handoff_event_batch_mixed_arenas_and_sizes) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_batch_mixed_arenas_and_sizes();
}

TEST_IMPL(handoff_event_batch_order_slow_producer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_batch_order_slow_producer();
}

TEST_IMPL(handoff_event_batch_release_orders_reuse) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_batch_release_orders_reuse();
}

TEST_IMPL(handoff_event_broadcast_reuse_waits_for_all) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_broadcast_reuse_waits_for_all();
}

TEST_IMPL(handoff_legacy_batch_order_slow_producer) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_batch_order_slow_producer();
}

TEST_IMPL(handoff_legacy_batch_release_orders_reuse) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_batch_release_orders_reuse();
}

TEST_IMPL(handoff_legacy_broadcast_order_slow_producer) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_broadcast_order_slow_producer();
}

/* ---- broadcast: the shared ready word --------------------------------------------------------- */

/* A producer whose stream never gets past a wait broadcasts a block, then
 * is killed: the consumer's stream, waiting on the broadcast word, is
 * unblocked. */
HELPER_IMPL(ho_doomed_broadcaster) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  uint8_t host[4096];
  pattern(host, sizeof host, 6);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                    host, sizeof host));
  CUdeviceptr never;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&never, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(never, 0, 256));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, never, 1, CU_STREAM_WAIT_VALUE_GEQ));
  uint32_t seed = 6;
  ASSERT_OK(gpuipc_conn_broadcast(&c, 1, b, (struct CUstream_st *)s, &seed,
                                  sizeof seed, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "sent", 4, NULL, 0));
  for (;;)
    pause();
  return 0;
}

TEST_IMPL(handoff_broadcast_exporter_killed) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_doomed_broadcaster", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  CUdeviceptr priv;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, 4096));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r.ptr,
                                        4096, s));
  bool event = test_order() == GPUIPC_ORDER_EVENT;
  if (!test_legacy())
    ASSERT_EQ(gpuipc__cu.cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  ASSERT_STATUS(gpuipc_conn_progress(c, 0), GPUIPC_E_PEER_GONE);
  bool stream_released = !event || harness_on_emulator();
  signal(SIGALRM, on_alarm);
  alarm(30);
  if (stream_released)
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t host[4096];
  d2h(host, r.ptr, sizeof host);
  check_pattern(host, sizeof host, 6);
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  alarm(0);
  if (stream_released)
    ASSERT_CU(gpuipc__cu.cuMemFree(priv));
  return 0;
}

/* Receives one broadcast buffer, queues a copy out of it (its stream waits
 * for the producer, which is held back), and closes its connection at
 * once (a short timeout): the close must not write the shared ready word,
 * which another consumer waits on too. */
HELPER_IMPL(ho_bc_closer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  CUdeviceptr priv;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, r.length));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r.ptr,
                                        r.length, s));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 200));
  gpuipc_conn_close(c);
  _exit(0); /* its stream still waits: no teardown that would wait too */
}

/* Receives one broadcast buffer and queues a copy out of it; says
 * "waiting"; on "check" says whether its stream is still blocked; on
 * "go" synchronizes and checks the data. */
HELPER_IMPL(ho_bc_waiter) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  CUdeviceptr priv;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, r.length));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r.ptr,
                                        r.length, s));
  ASSERT_OK(gpuipc_conn_send_msg(c, "waiting", 7, NULL, 0));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  bool blocked = gpuipc__cu.cuStreamQuery(s) == CUDA_ERROR_NOT_READY;
  ASSERT_OK(gpuipc_conn_send_msg(c, blocked ? "blocked" : "early", blocked ? 7 : 5,
                                 NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t *host = malloc(r.length);
  ASSERT_NOT_NULL(host);
  d2h(host, (void *)(uintptr_t)priv, r.length);
  uint32_t seed;
  memcpy(&seed, r.meta, sizeof seed);
  check_pattern(host, r.length, seed);
  free(host);
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  return 0;
}

/* One consumer of a broadcast closes while the producer's work is still
 * held back: the other consumer's stream stays blocked until the
 * producer's work is done, then reads the producer's data. */
TEST_IMPL(handoff_broadcast_consumer_close_keeps_others_ordered) {
  REQUIRE_DEVICES(1);
  if (test_order() != GPUIPC_ORDER_MEMOP)
    SKIP("the shared ready word is for stream memory operations");
  int fa, fb;
  pid_t pa = spawn_helper("ho_bc_closer", NULL, &fa, NULL);
  pid_t pb = spawn_helper("ho_bc_waiter", NULL, &fb, NULL);
  gpuipc_conn *cs[2] = {pair_conn(fa), pair_conn(fb)};
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  if (s == NULL)
    SKIP("holds its own stream back");
  size_t n = 4096;
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  ASSERT_CU(gpuipc__cu.cuMemsetD8((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                  0xEE, n));
  /* The producer's stream: held back, then the data. */
  CUdeviceptr gate;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(gate, 0, 256));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ));
  uint8_t *host = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&host, n, 0));
  pattern(host, n, 31);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                        host, n, s));
  uint32_t seed = 31;
  ASSERT_OK(gpuipc_conn_broadcast(cs, 2, b, (struct CUstream_st *)s, &seed,
                                  sizeof seed, NULL));
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  char buf[16];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(cs[1], buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(wait_helper(pa, 60), 0); /* the closer is gone */
  ASSERT_OK(gpuipc_conn_send_msg(cs[1], "check", 5, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(cs[1], buf, sizeof buf, &len, NULL, NULL));
  buf[len < sizeof buf ? len : sizeof buf - 1] = '\0';
  ASSERT_STR_EQ(buf, "blocked");
  /* Open the gate (from another stream). */
  CUstream o;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&o, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue64(o, gate, 1, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(o));
  ASSERT_OK(gpuipc_conn_send_msg(cs[1], "go", 2, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(cs[1], buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_OK(gpuipc_conn_send_msg(cs[1], "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pb, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(host));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(o));
  /* Both leases came back (the closer's when its process was gone). */
  for (int k = 0; k < 2; k++) {
    size_t out = 1;
    for (int i = 0; i < 1000 && out > 0; i++) {
      (void)gpuipc_conn_progress(cs[k], 10);
      ASSERT_OK(gpuipc_conn_get_outstanding(cs[k], &out, NULL));
    }
    ASSERT_EQ(out, 0);
    gpuipc_conn_close(cs[k]);
  }
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_CU(gpuipc__cu.cuMemFree(gate));
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

TEST_IMPL(handoff_event_broadcast_exporter_killed) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_broadcast_exporter_killed();
}

/* ---- a close that cannot unmap yet ---------------------------------------------------------- */

/* The producer of handoff_close_kept_imports_*: broadcasts one block from
 * a stream held back for good (its ready word is never written), then
 * waits to be killed. */
HELPER_IMPL(ho_bc_stuck_producer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr gate;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(gate, 0, 256));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ));
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  gpuipc_conn *cs[1] = {c};
  ASSERT_OK(gpuipc_conn_broadcast(cs, 1, b, (struct CUstream_st *)s, NULL, 0,
                                  NULL));
  /* Alive, doing nothing, until killed (or its test is gone). */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1)
    _exit(1);
  for (;;)
    pause();
}

/* A consumer closes while its stream waits on a live producer's broadcast
 * word (which close may not write: other consumers wait on it too). The
 * imports stay mapped, kept, not lost: once the producer is gone its words
 * are ours to write, and the next progress call finishes the close (the
 * stream completes, the imports are unmapped). Before, they stayed mapped
 * for the life of the process. */
TEST_IMPL(handoff_close_kept_imports_released_when_the_producer_dies) {
  REQUIRE_DEVICES(1);
  if (test_order() != GPUIPC_ORDER_MEMOP)
    SKIP("the shared ready word is for stream memory operations");
  ctx_current();
  ASSERT_EQ(gpuipc__handoff_held_poll(), 0);
  int fd;
  pid_t pid = spawn_helper("ho_bc_stuck_producer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  CUdeviceptr priv;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, r.length));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r.ptr,
                                        r.length, s));
  size_t pools0 = gpuipc__cache_pools_held();
  ASSERT_GT(pools0, 0);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 200));
  gpuipc_conn_close(c);
  ASSERT_EQ(gpuipc__handoff_held_poll(), 1); /* kept: the stream still waits */
  ASSERT_EQ(gpuipc__cache_pools_held(), pools0);
  ASSERT_CU_EQ(gpuipc__cu.cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  size_t kept = 1;
  for (int i = 0; i < 10000 && kept > 0; i++) {
    kept = gpuipc__handoff_held_poll();
    if (kept)
      usleep(1000);
  }
  ASSERT_EQ(kept, 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_LT(gpuipc__cache_pools_held(), pools0);
  ASSERT_CU(gpuipc__cu.cuMemFree(priv));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}
