/*
 * test-conn-tx.c: the sender's side of the per-buffer fast path across
 * processes (src/conn/tx.c): gpuipc_conn_send, send_batch, send_buffer
 * and broadcast, gpuipc_conn_buffer_wait and get_buffer_holders, the
 * chunks' export, the ready words and the idle-stream DONE path; a send
 * to 64 consumers, the GPU-side order of a consumer's reads after the
 * producer's work, and a broadcast past a consumer that stalls it.
 *
 * The ordering tests need the emulator's GPUIPC_EMU_COPY_DELAY_US (slow
 * copies make a missing wait visible); on a real GPU they run with large
 * copies instead, which the consumer would otherwise overtake.
 */
#include "test-conn-handoff.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

/* ---- small tools --------------------------------------------------------------------- */

/* The env of the consumers of a test that makes stream room for itself
 * (GPUIPC_STREAM_ROOM, set before its first use of the device): they
 * inherit it, and need none (one connection each; 128 streams of room
 * are 70 MiB of device memory per process). */
static char *const no_stream_room[] = {"GPUIPC_STREAM_ROOM=0", NULL};

static const char *rt_dir(void) {
  static char dir[300];
  snprintf(dir, sizeof dir, "%s/rt", harness_tmpdir());
  return dir;
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

/* ---- send and receive, both ways ----------------------------------------------------- */

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

/* ---- ordering: a consumer's reads wait for the producer's work ----------------------- */

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

/* ---- 64 consumers -------------------------------------------------------------------- */

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

/* ---- a ready write that cannot be enqueued ------------------------------------------- */

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

/* ---- buffers outside arenas ---------------------------------------------------------- */

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

/* ---- the same in event mode ---------------------------------------------------------- */

TEST_IMPL(handoff_event_basic_and_swap) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_basic_and_swap();
}

TEST_IMPL(handoff_event_order_slow_producer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_order_slow_producer();
}

TEST_IMPL(handoff_event_send_buffer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_send_buffer();
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

/* ---- batches ------------------------------------------------------------------------- */

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
  await_test_then_close(c);
  return 0;
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

/* ---- broadcast ----------------------------------------------------------------------- */

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
    /* The first repeat in the list's order is named, whatever comes
     * after it. */
    gpuipc_conn *dup5[5] = {cs[2], cs[1], cs[0], cs[1], cs[2]};
    ASSERT_STATUS(gpuipc_conn_broadcast(dup5, 5, b, (struct CUstream_st *)s,
                                        NULL, 0, NULL),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "connections 1 and 3 are the same");
    ASSERT_EQ(gpuipc_block_get_holders(b), 0);
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

/* A broadcast from a stream the host holds back (a wait on a host word it
 * writes only after the call returned: the ordered path of `gpuipc bench
 * handoff`) to 48 connections never used before, each with 65,536 slots
 * (1 MiB of flag words each, so the control arena grows during the call):
 * the call must neither wait for that stream nor for anything queued
 * behind it, and must return within the connections' timeout. On the H200
 * the bench's first such broadcast to 64 consumers never returned: each
 * fresh connection makes its reclaim stream, and the driver's 34th stream
 * of a context waits for the held one (the emulator models that; the
 * stream room GPUIPC_STREAM_ROOM makes at gpuipc's first use of the device
 * is the fix).
 * 48 connections: past the driver's first step of 32. */
TEST_IMPL(handoff_broadcast_held_stream_fresh_connections) {
  setenv("GPUIPC_STREAM_ROOM", "128", 1); /* read at the device's first use */
  REQUIRE_DEVICES(1);
  enum { N = 48 };
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.max_outstanding = 65536;
  o.runtime_dir = rt_dir();
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("bcheld", &o, &l));
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  pid_t pids[N];
  gpuipc_conn *cs[N];
  for (int i = 0; i < N; i++)
    pids[i] = spawn_helper("ho_consumer", no_stream_room, NULL, "bcheld", "1",
                           (char *)rt_dir(), NULL);
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_accept(l, &cs[i]));
  gpuipc_block *b = NULL;
  size_t n = 65536;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  uint8_t *host = malloc(n);
  ASSERT_NOT_NULL(host);
  uint32_t seed = 3000u;
  pattern(host, n, seed);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(
      (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), host, n, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  free(host);
  void *gate_h = NULL;
  CUdeviceptr gate_d = 0;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc(&gate_h, 4096,
                                      CU_MEMHOSTALLOC_DEVICEMAP |
                                          CU_MEMHOSTALLOC_PORTABLE));
  memset(gate_h, 0, 4096);
  ASSERT_CU(gpuipc__cu.cuMemHostGetDevicePointer(&gate_d, gate_h, 0));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(s, gate_d, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  uint64_t t0 = gpuipc__now_ns();
  gpuipc_status st = gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s,
                                           &seed, sizeof seed, NULL);
  long long ms = (long long)((gpuipc__now_ns() - t0) / 1000000u);
  __atomic_store_n((uint32_t *)gate_h, 1u, __ATOMIC_RELEASE);
  if (st != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "gpuipc_conn_broadcast from a held "
                 "stream to %d fresh connections: %s after %lld ms (%s)", N,
                 gpuipc_status_name(st), ms, gpuipc_last_error());
  printf("broadcast from a held stream to %d fresh connections: %lld ms\n",
         N, ms);
  ASSERT_EQ(gpuipc_block_get_holders(b), N);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  for (int i = 0; i < N; i++) {
    char buf[4];
    size_t len;
    /* Each consumer answers after its CUDA start and its import: 48 of
     * them at once on a GPU machine that runs other tests take long. */
    ASSERT_OK(gpuipc_conn_set_timeout(cs[i], 120000));
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
  }
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(gate_h));
  gpuipc_listener_close(l);
  return 0;
}

/* ---- batches: driver calls ----------------------------------------------------------- */

/* A batch costs one ready write (producer), one wait (consumer, for the
 * whole batch received at once), one release write (consumer), and a
 * few reclaim waits (producer, one per release frame), not one of each
 * per buffer. Memop mode only (event mode orders each buffer by its own
 * events). */
TEST_IMPL(handoff_batch_driver_calls) {
  /* Counting swaps entries of the driver table: no watcher thread (here
   * and in the helpers, which inherit it) reads them meanwhile. */
  setenv("GPUIPC_TEST_NO_WATCH", "1", 1);
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
  /* Its first batch follows its CUDA start, seconds on a loaded GPU
   * machine. */
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  gpuipc_received rs[8];
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < 8; i++)
      rs[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    /* The batch's frame comes whole: its 8 buffers are queued together
     * (one frame is read whole before recv returns). */
    count_calls();
    size_t n = 0;
    ASSERT_OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, rs, 8, &n));
    ASSERT_EQ(n, 8);
    if (idle)
      ASSERT_EQ(counted(DC_WAIT), 0);
    else
      ASSERT_LE(counted(DC_WAIT), 1);
    uint64_t ids[8];
    for (int i = 0; i < 8; i++)
      ids[i] = rs[i].id;
    count_calls();
    ASSERT_OK(gpuipc_conn_release_batch(c, ids, 8, (struct CUstream_st *)s));
    ASSERT_EQ(counted(DC_WRITE), 1);
    uncount_calls();
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
  count_calls();
  ASSERT_OK(gpuipc_conn_send_batch(c, bs, 16, (struct CUstream_st *)s, metas,
                                   lens));
  ASSERT_EQ(counted(DC_WRITE), 1);
  open_gate(gate);
  count_calls();
  for (int i = 0; i < 16; i++)
    wait_unheld(c, bs[i]);
  /* 16 buffers released in at least 3 calls of at most 7: a reclaim wait
   * per release frame at most. */
  int waits = counted(DC_WAIT);
  uncount_calls();
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
    count_calls();
    ASSERT_OK(gpuipc_conn_send_batch(c, &b1, 1, (struct CUstream_st *)s, &m1,
                                     &l1));
    int writes = counted(DC_WRITE);
    uncount_calls();
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

/* ---- data the caller asserts complete (GPUIPC_SEND_COMPLETE) ------------------------- */

/* A send whose caller asserts the data complete asks the driver nothing
 * (no query, no ready write, no event record; the stream, NULL or busy,
 * is not touched), the consumer enqueues no wait (memop mode) and sees
 * the data; unknown flag bits are refused and send nothing. */
TEST_IMPL(handoff_send_complete) {
  /* Counting swaps entries of the driver table: no watcher thread (here
   * and in the helpers, which inherit it) reads them meanwhile. */
  setenv("GPUIPC_TEST_NO_WATCH", "1", 1);
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid =
      spawn_helper("ho_consumer", NULL, &fd, "pair", "4", "-", "count", NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  static const unsigned bad[] = {0x2u, 0x80000000u, GPUIPC_SEND_COMPLETE | 0x4u};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(bad); i++) {
    ASSERT_STATUS(gpuipc_conn_send_ex(c, b, NULL, NULL, 0, bad[i]),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "unknown flags");
    ASSERT_EQ(gpuipc_block_get_holders(b), 0);
  }
  /* A stream held back by a gate: a send that touched it (a query, a
   * write, a record) would be seen by the counts. */
  CUdeviceptr gate;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(gate, 0, 256));
  if (s != NULL)
    ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, gate, 1,
                                             CU_STREAM_WAIT_VALUE_GEQ));
  for (uint32_t i = 0; i < 4; i++) {
    uint32_t seed = 500 + i;
    uint8_t host[4096];
    pattern(host, sizeof host, seed);
    /* Written by the host, and complete before the send: a copy from
     * pageable memory returns once the bytes are staged (the real driver's
     * DMA may still run), so the legacy stream it ran on is synchronized
     * (the gated stream is non-blocking: not waited for). */
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), host, sizeof host));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
    count_calls();
    ASSERT_OK(gpuipc_conn_send_ex(c, b, i % 2 ? (struct CUstream_st *)s : NULL,
                                  &seed, sizeof seed, GPUIPC_SEND_COMPLETE));
    int calls = counted_all();
    uncount_calls();
    ASSERT_EQ(calls, 0);
    wait_unheld(c, b);
  }
  char msg[16] = "";
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, msg, sizeof msg - 1, &len, NULL, NULL));
  ASSERT_EQ(len, 2); /* "ok": every buffer had the data sent */
  ASSERT_OK(gpuipc_conn_recv_msg(c, msg, sizeof msg - 1, &len, NULL, NULL));
  msg[len] = '\0';
  if (test_order() == GPUIPC_ORDER_MEMOP)
    ASSERT_EQ(atoi(msg), 0); /* DONE: no wait at the consumer */
  open_gate(gate);
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFree(gate));
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

TEST_IMPL(handoff_event_send_complete) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_send_complete();
}

/* ---- a use the consumer asserts complete (GPUIPC_RELEASE_COMPLETE) ------------------- */

/* Receives argv[0] buffers, copies each to the host and checks its
 * pattern (seed in the meta), then gives it back with
 * gpuipc_conn_release_ex(GPUIPC_RELEASE_COMPLETE), counting the driver
 * calls of that release; reports them as one message, a digit per buffer
 * (its release writes and records: 0, or how many). */
HELPER_IMPL(ho_rel_complete) {
  int n = atoi(argv[0]);
  ASSERT(n > 0 && n < 32);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  CUstream s = mkstream();
  char calls[32];
  for (int i = 0; i < n; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    check_received(&r, s);
    count_calls();
    ASSERT_OK(gpuipc_conn_release_ex(c, r.id, (struct CUstream_st *)s,
                                     GPUIPC_RELEASE_COMPLETE));
    int k = counted(DC_WRITE) + counted(DC_RECORD) + counted(DC_WAIT) +
            counted(DC_WAIT_EVENT) + counted(DC_QUERY);
    uncount_calls();
    calls[i] = (char)('0' + (k > 9 ? 9 : k));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, calls, (size_t)n, NULL, 0));
  await_test_then_close(c);
  return 0;
}

/* A consumer that says its use of a buffer completed: for buffers that
 * came without a GPU wait (GPUIPC_SEND_COMPLETE) its release asks the
 * driver nothing, and the producer takes the release without a reclaim
 * wait or marker; a buffer whose receive queued a wait (sent from a busy
 * stream) is released the ordinary way (a release write, a reclaim wait).
 * The order of the kinds matters: the ordered send after the complete
 * ones comes from another stream than the slot's last write, so it first
 * waits for that lease's release word; a complete release wrote none, so
 * the slot's record must have gone back to the ordered lease before them
 * (else that wait, and the consumer's recv behind it, never end). The data
 * of every buffer is as sent; bad flags are refused. */
enum { RC_N = 5 };
TEST_IMPL(handoff_release_complete) {
  /* Counting swaps entries of the driver table: no watcher thread (here
   * and in the helper, which inherits it) reads them meanwhile. */
  setenv("GPUIPC_TEST_NO_WATCH", "1", 1);
  REQUIRE_DEVICES(1);
  if (test_order() != GPUIPC_ORDER_MEMOP)
    SKIP("event mode records its release event in every case");
  int fd;
  char ns[8];
  snprintf(ns, sizeof ns, "%d", RC_N);
  pid_t pid = spawn_helper("ho_rel_complete", NULL, &fd, ns, NULL);
  gpuipc_conn *c = pair_conn(fd);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  static const unsigned bad[] = {0x2u, 0x80000000u,
                                 GPUIPC_RELEASE_COMPLETE | 0x4u};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(bad); i++) {
    ASSERT_STATUS(gpuipc_conn_release_ex(c, 1, NULL, bad[i]),
                  GPUIPC_E_INVALID_ARG);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "GPUIPC_RELEASE_COMPLETE");
  }
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream s[2] = {mkstream(), mkstream()};
  CUdeviceptr gate;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate, 256));
  /* Sent from a held stream (ordered: a ready write, the consumer's
   * wait), or asserted complete. */
  static const int ordered_on[RC_N] = {1, -1, -1, -1, 0};
  int reclaim[RC_N];
  for (int i = 0; i < RC_N; i++) {
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
    uint32_t seed = 700 + (uint32_t)i;
    uint8_t host[4096];
    pattern(host, sizeof host, seed);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), host, sizeof host));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
    if (ordered_on[i] < 0) {
      ASSERT_OK(gpuipc_conn_send_ex(c, b, NULL, &seed, sizeof seed,
                                    GPUIPC_SEND_COMPLETE));
    } else {
      CUstream o = s[ordered_on[i]];
      ASSERT_CU(gpuipc__cu.cuMemsetD8(gate, 0, 8));
      ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(o, gate, 1,
                                               CU_STREAM_WAIT_VALUE_GEQ));
      ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)o, &seed,
                                 sizeof seed));
      open_gate(gate);
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(o));
    }
    /* What taking its release in costs here. */
    count_calls();
    wait_unheld(c, b);
    reclaim[i] = counted(DC_WAIT) + counted(DC_WAIT_EVENT) + counted(DC_RECORD);
    uncount_calls();
    ASSERT_OK(gpuipc_block_free(b, NULL));
  }
  char calls[RC_N + 1] = "";
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, calls, sizeof calls - 1, &len, NULL, NULL));
  calls[len] = '\0';
  printf("release calls per buffer (consumer): %s; reclaim calls (producer):",
         calls);
  for (int i = 0; i < RC_N; i++)
    printf(" %d", reclaim[i]);
  printf("\n");
  ASSERT_EQ(len, RC_N);
  for (int i = 0; i < RC_N; i++) {
    if (ordered_on[i] < 0) {
      ASSERT_EQ(calls[i], '0');
      ASSERT_EQ(reclaim[i], 0);
    } else {
      /* An ordinary release (its write), an ordinary reclaim (a wait for
       * that write, a marker). */
      ASSERT(calls[i] != '0');
      ASSERT(reclaim[i] > 0);
    }
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  ASSERT_CU(gpuipc__cu.cuMemFree(gate));
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &as));
  ASSERT_EQ(as.blocks_allocated, 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* The consumer of handoff_done_send_keeps_ready_words_in_order: receives
 * P and D, releases them, receives and releases L, all on one stream z;
 * after the test's "1" says whether z finished within 0.5 s (it must not:
 * z waits for P, whose producer stream the test holds until this answer),
 * after "2" receives N, and says whether z then finishes (it must). */
HELPER_IMPL(ho_ready_order) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  CUstream z = mkstream();
  gpuipc_received p = GPUIPC_RECEIVED_INIT, d = GPUIPC_RECEIVED_INIT,
                   l = GPUIPC_RECEIVED_INIT, n = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)z, &p));
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)z, &d));
  ASSERT_OK(gpuipc_conn_release(c, d.id, (struct CUstream_st *)z));
  ASSERT_OK(gpuipc_conn_release(c, p.id, (struct CUstream_st *)z));
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)z, &l));
  ASSERT_OK(gpuipc_conn_release(c, l.id, (struct CUstream_st *)z));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  /* E: our wait for P passed while P's producer stream was still held. */
  char early = stream_drains(z, 500) ? 'E' : 'w';
  ASSERT_OK(gpuipc_conn_send_msg(c, &early, 1, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)z, &n));
  /* H: our wait for N never ends (the word went back to P's value). */
  char done = stream_drains(z, 60000) ? 'o' : 'H';
  ASSERT_OK(gpuipc_conn_send_msg(c, &done, 1, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_conn_close(c);
  return 0;
}

/* A send from an idle stream (DONE: no ready write) is recorded as the
 * slot's last write by no stream. It named its stream Y before: P's
 * ready write was queued on a held stream X; P released; L sent from
 * idle Y in P's slot; then N, from Y busy, in the same slot: N's write
 * skipped the wait for the slot's last release (the record said Y wrote
 * last), so Y wrote n first and X then p < n: the consumer's wait for P
 * passed on n before P's work ran, and its wait for N never ended. */
TEST_IMPL(handoff_done_send_keeps_ready_words_in_order) {
  REQUIRE_DEVICES(1);
  if (test_order() != GPUIPC_ORDER_MEMOP)
    SKIP("ready words are stream memory operations");
  int fd;
  pid_t pid = spawn_helper("ho_ready_order", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUstream x = mkstream(), y = mkstream();
  CUdeviceptr gx, gy;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gx, 256));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gy, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(gx, 0, 8));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(gy, 0, 8));
  gpuipc_block *b[4];
  for (int i = 0; i < 4; i++)
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b[i]));
  /* P from X, held by a gate: its ready write stays queued. */
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(x, gx, 1, CU_STREAM_WAIT_VALUE_GEQ));
  ASSERT_OK(gpuipc_conn_send(c, b[0], (struct CUstream_st *)x, NULL, 0));
  /* D from Y (takes up the query skip after X's busy answer). */
  ASSERT_OK(gpuipc_conn_send(c, b[1], (struct CUstream_st *)y, NULL, 0));
  wait_unheld(c, b[1]);
  wait_unheld(c, b[0]);
  /* L from idle Y: DONE, in P's slot. */
  ASSERT_OK(gpuipc_conn_send(c, b[2], (struct CUstream_st *)y, NULL, 0));
  wait_unheld(c, b[2]);
  /* N from Y with work queued: a ready write on Y. */
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(y, gy, 1, CU_STREAM_WAIT_VALUE_GEQ));
  ASSERT_OK(gpuipc_conn_send(c, b[3], (struct CUstream_st *)y, NULL, 0));
  /* Y may run now, before X (N's ready write must still wait for L's
   * release, which is behind the consumer's wait for P: so Y is not
   * synchronized here). */
  open_gate(gy);
  ASSERT_OK(gpuipc_conn_send_msg(c, "1", 1, NULL, 0));
  char rep[2];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, &rep[0], 1, &len, NULL, NULL));
  open_gate(gx); /* only after the consumer looked */
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(x));
  ASSERT_OK(gpuipc_conn_send_msg(c, "2", 1, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, &rep[1], 1, &len, NULL, NULL));
  if (rep[0] != 'w' || rep[1] != 'o')
    harness_fail(__FILE__, __LINE__,
                 "the consumer saw %.2s (E: its wait for P passed before P's "
                 "stream ran; H: its wait for N never ended)",
                 rep);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(y));
  /* The consumer closed holding N: released there, or reclaimed now that
   * it is gone. */
  for (int i = 0; i < 30000 && gpuipc_block_get_holders(b[3]) > 0; i++)
    if (gpuipc_conn_progress(c, 1) != GPUIPC_OK)
      break;
  gpuipc_conn_close(c);
  for (int i = 0; i < 4; i++)
    ASSERT_OK(gpuipc_block_free(b[i], NULL));
  ASSERT_CU(gpuipc__cu.cuMemFree(gx));
  ASSERT_CU(gpuipc__cu.cuMemFree(gy));
  gpuipc_status ds = GPUIPC_E_BUSY;
  for (int i = 0; i < 3000 && ds == GPUIPC_E_BUSY; i++) {
    ds = gpuipc_arena_destroy(a);
    if (ds == GPUIPC_E_BUSY)
      usleep(10000);
  }
  ASSERT_OK(ds);
  return 0;
}

/* ---- batches and broadcast in event mode and on the legacy stream -------------------- */

TEST_IMPL(handoff_event_batch_mixed_arenas_and_sizes) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_batch_mixed_arenas_and_sizes();
}

TEST_IMPL(handoff_event_batch_order_slow_producer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_batch_order_slow_producer();
}

TEST_IMPL(handoff_event_broadcast_reuse_waits_for_all) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_broadcast_reuse_waits_for_all();
}

TEST_IMPL(handoff_legacy_batch_order_slow_producer) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_batch_order_slow_producer();
}

TEST_IMPL(handoff_legacy_broadcast_order_slow_producer) {
  setenv("GPUIPC_TEST_STREAM", "legacy", 1);
  return test_handoff_broadcast_order_slow_producer();
}

/* ---- broadcast: a stalled consumer delays nobody else ------------------------------- */

/* An honest consumer of handoff_broadcast_stalled_consumer: receives
 * argv[2] buffers (seeds 1, 2, ...), checks each, releases it at once and
 * writes a byte on the pipe argv[1] for it (argv[0]: the pipe's other
 * end, closed); then says "ok" and waits for "k". */
HELPER_IMPL(ho_bc_honest) {
  ASSERT(argc >= 3);
  close(atoi(argv[0]));
  int pfd = atoi(argv[1]);
  int count = atoi(argv[2]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  for (int i = 0; i < count; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    ASSERT_UEQ(check_received(&r, s), (uint32_t)i + 1);
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
    ASSERT_EQ(write(pfd, "x", 1), 1);
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_conn_close(c);
  return 0;
}

/* The stalled consumer: receives argv[3] buffers and releases none, so
 * that its producer's connection (max_outstanding argv[3]) has no slot
 * left; it frees one only once argv[2] bytes came on the pipe argv[0]
 * (the honest consumers received the next buffer, which they can only if
 * the producer did not wait for this one first; argv[1]: the pipe's
 * other end, closed, so that it reads the end of the pipe if they die).
 * Then it receives that next buffer (sent late, once its slot was free)
 * and checks its data, says "ok", and holds the rest until "k". */
HELPER_IMPL(ho_bc_stalled) {
  ASSERT(argc >= 4);
  int pfd = atoi(argv[0]);
  close(atoi(argv[1]));
  int signals = atoi(argv[2]);
  int held = atoi(argv[3]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received first = GPUIPC_RECEIVED_INIT;
  for (int i = 0; i < held; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    ASSERT_UEQ(check_received(&r, s), (uint32_t)i + 1);
    if (i == 0)
      first = r;
  }
  for (int got = 0; got < signals;) {
    char b[64];
    size_t want = (size_t)(signals - got) < sizeof b ? (size_t)(signals - got)
                                                     : sizeof b;
    ssize_t n = read(pfd, b, want);
    if (n < 0 && errno == EINTR)
      continue;
    ASSERT_GT(n, 0);
    got += (int)n;
  }
  ASSERT_OK(gpuipc_conn_release(c, first.id, (struct CUstream_st *)s));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  ASSERT_UEQ(check_received(&r, s), (uint32_t)held + 1);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_conn_close(c);
  return 0;
}

/* handoff_broadcast_stalled_polling_consumer: the stalled consumer's
 * connection is in polling mode and waits forever. */
static bool stalled_polls;
/* handoff_broadcast_stalled_consumer_mixed_orders: the stalled consumer's
 * connection alone is in memop mode (the others in event mode), so the
 * broadcast word of round SLOTS is written only once it is ready. */
static bool stalled_alone_memop;

/* A broadcast to 4 consumers, one of which (STALLED) holds every slot of
 * its connection (max_outstanding 4) and releases nothing: the others get
 * every buffer of each broadcast without waiting for it. Round SLOTS: the
 * stalled consumer frees a slot only after the honest ones received that
 * round's buffer, so the broadcast succeeds for all four only if it sent
 * to the ready connections before it waited for the stalled one (a
 * broadcast that waited first runs into the stalled connection's timeout:
 * E_TIMEOUT). Later rounds: it never frees one, and only its own entry
 * says so, E_TIMEOUT (its timeout then short) and E_WOULD_BLOCK
 * (non-blocking); the others are OK and get their buffers. The
 * producer's copies are slow (emulator), so that each broadcast finds its
 * stream busy and writes the broadcast word: round SLOTS's late frame
 * names a word that may hold its value already (the copy done while the
 * stalled consumer waited), and its consumer still reads the data. */
TEST_IMPL(handoff_broadcast_stalled_consumer) {
  if (harness_on_emulator())
    setenv("GPUIPC_EMU_COPY_DELAY_US", "100000", 1);
  REQUIRE_DEVICES(1);
  static char *no_delay[] = {"GPUIPC_EMU_COPY_DELAY_US=", NULL};
  enum { N = 4, STALLED = 1, SLOTS = 4, ROUNDS = SLOTS + 3 };
  /* A pipe the helpers inherit, above the descriptor spawn_helper gives
   * them (3). */
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  for (int k = 0; k < 2; k++) {
    int high = fcntl(p[k], F_DUPFD, 64);
    ASSERT_GE(high, 64);
    close(p[k]);
    p[k] = high;
  }
  char rfd[16], wfd[16], rounds[16], signals[16], slots[16];
  snprintf(rfd, sizeof rfd, "%d", p[0]);
  snprintf(wfd, sizeof wfd, "%d", p[1]);
  snprintf(rounds, sizeof rounds, "%d", ROUNDS);
  snprintf(signals, sizeof signals, "%d", (N - 1) * (SLOTS + 1));
  snprintf(slots, sizeof slots, "%d", SLOTS);
  pid_t pids[N];
  gpuipc_conn *cs[N];
  for (int i = 0; i < N; i++) {
    int fd;
    if (i == STALLED)
      pids[i] = spawn_helper("ho_bc_stalled", no_delay, &fd, rfd, wfd, signals,
                             slots, NULL);
    else
      pids[i] = spawn_helper("ho_bc_honest", no_delay, &fd, rfd, wfd, rounds,
                             NULL);
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    /* The first broadcast waits for every helper's CUDA start (seconds on
     * a GPU machine running many such tests); a broadcast that waited for
     * the stalled connection before sending to the others would run into
     * this timeout, or into the hang guard below, all the same. */
    o.timeout_ms = 120000;
    o.order = stalled_alone_memop ? (i == STALLED ? GPUIPC_ORDER_MEMOP
                                                  : GPUIPC_ORDER_EVENT)
                                  : test_order();
    if (i == STALLED)
      o.max_outstanding = SLOTS;
    ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &cs[i]));
  }
  close(p[0]);
  close(p[1]);
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  CUstream s = mkstream();
  if (stalled_polls) {
    /* A ring whose application polls: its peer's releases do not make
     * its fd readable unless the broadcast switches it to sleeping while
     * it waits (else the wait, without a deadline, would never end). */
    ASSERT_OK(gpuipc_conn_set_polling(cs[STALLED], 1));
    ASSERT_OK(gpuipc_conn_set_timeout(cs[STALLED], -1));
  }
  /* A hang guard only (the stalled connection's timeout is 120 s). */
  bounded("broadcasts past a stalled consumer", 240);
  uint8_t *host[ROUNDS];
  for (int r = 0; r < ROUNDS; r++) {
    if (r == SLOTS + 1)
      ASSERT_OK(gpuipc_conn_set_timeout(cs[STALLED], 200));
    if (r == SLOTS + 2)
      ASSERT_OK(gpuipc_conn_set_nonblocking(cs[STALLED], 1));
    uint32_t seed = (uint32_t)r + 1;
    size_t n = 4096 * (size_t)(1 + r % 3);
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
    /* Pinned: the copy is still running when the broadcast comes. */
    ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&host[r], n, 0));
    pattern(host[r], n, seed);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), host[r], n, s));
    gpuipc_status st[N];
    gpuipc_status all = gpuipc_conn_broadcast(cs, N, b, (struct CUstream_st *)s,
                                              &seed, sizeof seed, st);
    gpuipc_status want = r <= SLOTS       ? GPUIPC_OK
                         : r == SLOTS + 1 ? GPUIPC_E_TIMEOUT
                                          : GPUIPC_E_WOULD_BLOCK;
    for (int i = 0; i < N; i++)
      ASSERT_STATUS(st[i], i == STALLED ? want : GPUIPC_OK);
    ASSERT_STATUS(all, want);
    if (want != GPUIPC_OK)
      ASSERT_STR_CONTAINS(gpuipc_last_error(), "connection 1");
    ASSERT_EQ(gpuipc_block_get_holders(b), want == GPUIPC_OK ? N : N - 1);
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
    if (r == SLOTS) {
      /* The late buffer's data reached the stalled consumer too. */
      char buf[4];
      size_t len;
      ASSERT_OK(gpuipc_conn_recv_msg(cs[STALLED], buf, sizeof buf, &len, NULL,
                                     NULL));
      ASSERT_EQ(len, 2);
    }
  }
  bounded_done();
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int r = 0; r < ROUNDS; r++)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(host[r]));
  ASSERT_OK(gpuipc_conn_set_nonblocking(cs[STALLED], 0));
  ASSERT_OK(gpuipc_conn_set_timeout(cs[STALLED], 20000));
  for (int i = 0; i < N; i++) {
    if (i == STALLED)
      continue;
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(cs[i], buf, sizeof buf, &len, NULL, NULL));
    ASSERT_EQ(len, 2); /* "ok": it got all ROUNDS buffers, in order */
  }
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_conn_send_msg(cs[i], "k", 1, NULL, 0));
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  /* Every lease came back (the stalled consumer's at its close). */
  for (int i = 0; i < N; i++) {
    size_t out = 1;
    for (int k = 0; k < 1000 && out > 0; k++) {
      (void)gpuipc_conn_progress(cs[i], 10);
      ASSERT_OK(gpuipc_conn_get_outstanding(cs[i], &out, NULL));
    }
    ASSERT_EQ(out, 0);
  }
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &as));
  ASSERT_EQ(as.blocks_allocated, 0);
  ASSERT_EQ(as.leases, 0);
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

TEST_IMPL(handoff_event_broadcast_stalled_consumer) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_broadcast_stalled_consumer();
}

TEST_IMPL(handoff_broadcast_stalled_polling_consumer) {
  stalled_polls = true;
  return test_handoff_broadcast_stalled_consumer();
}

TEST_IMPL(handoff_broadcast_stalled_consumer_mixed_orders) {
  stalled_alone_memop = true;
  return test_handoff_broadcast_stalled_consumer();
}
