/*
 * test-conn-arena.c: arenas and the sender's lease tables
 * (src/conn/arena.c, src/conn/lease.c): an arena's device, deferred frees
 * and slots running out, the leases of a consumer that closed while
 * holding (orphans, back once its process is gone), gpuipc_block_wait for
 * a block written again, a forged release that holds back only its own
 * block, and forged release flags refused.
 *
 * The test of gpuipc_block_wait needs the emulator's
 * GPUIPC_EMU_COPY_DELAY_US (slow copies make a missing wait visible); on
 * a real GPU it runs with large copies instead.
 */
#include "test-conn-handoff.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

/* ---- arenas -------------------------------------------------------------------------- */

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

/* ---- leases: deferred free, slots running out ---------------------------------------- */

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

/* ---- orphans: a consumer that closes while holding ----------------------------------- */

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

/* ---- a kept block written again ------------------------------------------------------ */

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

/* ---- one peer's missing release holds back only what it holds ------------------------ */

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

/* ---- forged release flags ------------------------------------------------------------ */

/* Receives two buffers and gives them back with a forged REL frame
 * (argv[0]: "last" flags the frame's last entry BY_NEXT, "unknown" sets a
 * flag that does not exist, "complete_by_next" flags the first COMPLETE
 * and BY_NEXT, "complete_next" the first BY_NEXT and the second COMPLETE,
 * "complete_written" both COMPLETE where their ready words were written);
 * then waits to be hung up on. */
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
  } else if (strcmp(argv[0], "complete_by_next") == 0) {
    rel[0].flags = GPUIPC__REL_COMPLETE | GPUIPC__REL_BY_NEXT;
  } else if (strcmp(argv[0], "complete_next") == 0) {
    rel[0].flags = GPUIPC__REL_BY_NEXT;
    rel[1].flags = GPUIPC__REL_COMPLETE;
  } else if (strcmp(argv[0], "complete_written") == 0) {
    rel[0].flags = GPUIPC__REL_COMPLETE;
    rel[1].flags = GPUIPC__REL_COMPLETE;
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
  const char *cases[] = {"last", "unknown", "complete_by_next",
                         "complete_next", "complete_written"};
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  CUdeviceptr gate;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&gate, 256));
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(cases); i++) {
    int fd;
    pid_t pid = spawn_helper("ho_rel_forger", NULL, &fd, (char *)cases[i], NULL);
    gpuipc_conn *c = pair_conn(fd);
    /* Written ready words: sent while the stream is held back. */
    bool held = strcmp(cases[i], "complete_written") == 0;
    if (held) {
      ASSERT_CU(gpuipc__cu.cuMemsetD8(gate, 0, 8));
      ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, gate, 1,
                                               CU_STREAM_WAIT_VALUE_GEQ));
    }
    gpuipc_block *b[2];
    for (int k = 0; k < 2; k++) {
      ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b[k]));
      ASSERT_OK(gpuipc_conn_send(c, b[k], (struct CUstream_st *)s, NULL, 0));
    }
    if (held)
      open_gate(gate);
    gpuipc_status st = GPUIPC_OK;
    for (int k = 0; k < 3000 && st == GPUIPC_OK; k++)
      st = gpuipc_conn_progress(c, 10);
    if (st != GPUIPC_E_PROTOCOL)
      harness_fail(__FILE__, __LINE__, "case %s: %s (%s)", cases[i],
                   gpuipc_status_name(st), gpuipc_last_error());
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "flags");
    if (held)
      ASSERT_STR_CONTAINS(gpuipc_last_error(), "ready word was written");
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
  ASSERT_CU(gpuipc__cu.cuMemFree(gate));
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &as));
  ASSERT_EQ(as.blocks_allocated, 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}
