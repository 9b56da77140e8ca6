/*
 * test-conn-depart.c: a peer's departure from the per-buffer fast path
 * (src/conn/depart.c): consumers and exporters killed, one consumer of a
 * broadcast killed or closing, a consumer's close (bounded, after its
 * stream, releasing what it had queued), a consumer that gives up on its
 * own error (ABANDON), a process whose main thread exited (not gone), the
 * peer watcher (opt-in, then the default), every driver call failing in turn, and a close
 * that keeps its imports until the producer is gone.
 */
#include "test-conn-handoff.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- consumers killed ---------------------------------------------------------------- */

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

/* ---- exporter killed ----------------------------------------------------------------- */

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

/* ---- the same in event mode ---------------------------------------------------------- */

TEST_IMPL(handoff_event_exporter_killed) {
  setenv("GPUIPC_TEST_ORDER", "event", 1);
  return test_handoff_exporter_killed();
}

/* ---- a consumer's close: its stream, its queue --------------------------------------- */

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

/* ---- a consumer whose main thread exited --------------------------------------------- */

static gpuipc_received lone_rx = GPUIPC_RECEIVED_INIT;
static atomic_int lone_stop;

static void on_lone_stop(int sig) {
  (void)sig;
  atomic_store(&lone_stop, 1);
}

static void *lone_reader(void *arg) {
  (void)arg;
  /* Reads the buffer after the main thread is gone until the test says
   * it is done (SIGUSR1; at most 120 s): the data must stay the
   * producer's (the memory is not handed out again). */
  uint8_t first[64], now[64];
  ctx_current();
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  ASSERT_EQ(pthread_sigmask(SIG_UNBLOCK, &usr1, NULL), 0); /* this thread only */
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(first, (CUdeviceptr)(uintptr_t)lone_rx.ptr,
                                    sizeof first));
  for (int i = 0; !atomic_load(&lone_stop); i++) {
    if (i == 1200) {
      fprintf(stderr, "lone reader: the test never said it was done\n");
      _exit(4);
    }
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
 * keeps reading it until SIGUSR1, and ends its main thread
 * (pthread_exit). */
HELPER_IMPL(ho_lone_thread) {
  /* SIGUSR1 goes to the reader alone: blocked here before any thread
   * (the library's, the emulator's) starts, unblocked by the reader. */
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &usr1, NULL), 0);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  ASSERT_OK(gpuipc_conn_recv(c, NULL, &lone_rx));
  ctx_current();
  /* Before the hang-up: the test signals only after it saw it. */
  struct sigaction sa = {0};
  sa.sa_handler = on_lone_stop;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &sa, NULL), 0);
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
  /* The helper's reader runs until told to stop (SIGUSR1, below): all
   * the while, its lease must hold (an exited main thread is not an
   * exited process). It used to stop on its own after 1.5 s, which a
   * loaded machine could take for these 80 checks ("ended early"); now it
   * cannot end before them, however slow either side is. */
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
  /* Done: the reader ends, and with it the process. Once the whole
   * process is gone, the lease comes back. */
  ASSERT_EQ(kill(pid, SIGUSR1), 0);
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

/* ---- a consumer's close is bounded --------------------------------------------------- */

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
  /* Lives on until the test kills it, or ends with the test. */
  while (getppid() != 1 && kill(getppid(), 0) == 0)
    usleep(100000);
  return 0;
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

/* ---- every driver call of the handoff failing in turn -------------------------------- */

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

/* The handshake waits for the other process to start (seconds under a
 * sanitizer on a loaded machine: with 2 s it could time out, failing the
 * test before any fault); only what follows gets the short timeout. */
static gpuipc_conn *fault_conn(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 2000));
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

/* ---- a consumer that gives up on its own error --------------------------------------- */

/* Receives one buffer and keeps it, then runs out of file descriptors (its
 * limit lowered to its lowest free fd), so the next arena chunk cannot
 * arrive and it breaks the connection itself. Lives on until killed. */
HELPER_IMPL(ho_fd_starved) {
  /* argv[0] "first": starved before its first buffer (its fast path has
   * seen no frame when it gives up). */
  bool first = argc >= 1 && strcmp(argv[0], "first") == 0;
  /* The socket itself, not a copy: when the connection gives up, its
   * socket is closed, and the producer's writes fail. */
  gpuipc_conn *c = pair_conn(harness_helper_fd());
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  if (!first)
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
  /* Lives on until the test kills it, or ends with the test. */
  while (getppid() != 1 && kill(getppid(), 0) == 0)
    usleep(100000);
  return 0;
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
  /* The consumer gives up on this one's chunk: its ABANDON may be read
   * while the send is still in progress, and then the buffer is not sent
   * (the consumer reads nothing more). */
  gpuipc_status st = gpuipc_conn_send(c, b2, NULL, NULL, 0);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  /* Up to 30 s (as below): the consumer's ABANDON needs it to run. */
  for (int i = 0; i < 3000 && gpuipc_block_get_holders(b2) > 0; i++)
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

/* The same, the consumer giving up on the first frame of its fast path
 * (it holds nothing): its ABANDON names nothing, and the lease comes back
 * while it lives. Before, it sent no ABANDON when its fast path had seen
 * no frame. */
TEST_IMPL(handoff_consumer_gives_up_before_any_frame) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_fd_starved", NULL, &fd, "first", NULL);
  gpuipc_conn *c = pair_conn(fd);
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_MEM_EQ(buf, "starved", 7);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
  /* Its ABANDON may already be read within this send: then the buffer is
   * not sent at all. */
  gpuipc_status st = gpuipc_conn_send(c, b, NULL, NULL, 0);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  for (int i = 0; i < 3000 && gpuipc_block_get_holders(b) > 0; i++)
    if (gpuipc_conn_progress(c, 10) != GPUIPC_OK)
      usleep(10000);
  ASSERT_EQ(waitpid(pid, NULL, WNOHANG), 0); /* it lives */
  if (gpuipc_block_get_holders(b) != 0)
    harness_fail(__FILE__, __LINE__,
                 "the lease of a consumer that gave up holding nothing "
                 "stays while it lives");
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* The producer's next call after the consumer gave up is a send: the
 * write finds the socket closed, and the ABANDON that came before is read,
 * not lost with the socket (the lease of what the consumer never mapped
 * comes back at once). Before, the send's EPIPE closed the socket with
 * the ABANDON unread. */
TEST_IMPL(handoff_consumer_gives_up_then_producer_sends) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_fd_starved", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  gpuipc_arena *a1 = mkarena((size_t)1 << 20);
  gpuipc_block *b1 = NULL, *b2 = NULL, *b3 = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a1, 4096, NULL, &b1));
  ASSERT_OK(gpuipc_arena_alloc(a1, 4096, NULL, &b3));
  ASSERT_OK(gpuipc_conn_send(c, b1, NULL, NULL, 0));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_arena *a2 = mkarena((size_t)1 << 20);
  ASSERT_OK(gpuipc_arena_alloc(a2, 4096, NULL, &b2));
  /* Only sends from here on, no progress call. The consumer gives up on
   * this one's chunk: it may already have said so while the send is in
   * progress. */
  gpuipc_status st = gpuipc_conn_send(c, b2, NULL, NULL, 0);
  for (int i = 0; i < 3000 && st == GPUIPC_OK; i++) {
    usleep(10000);
    st = gpuipc_conn_send(c, b3, NULL, NULL, 0);
  }
  if (st != GPUIPC_E_PEER_GONE && st != GPUIPC_E_CLOSED)
    harness_fail(__FILE__, __LINE__, "send: %s (%s)", gpuipc_status_name(st),
                 gpuipc_last_error());
  ASSERT_EQ(waitpid(pid, NULL, WNOHANG), 0); /* it lives */
  if (gpuipc_block_get_holders(b2) != 0 || gpuipc_block_get_holders(b3) != 0)
    harness_fail(__FILE__, __LINE__,
                 "the ABANDON was lost: blocks the consumer never mapped "
                 "stay leased while it lives (%u, %u)",
                 gpuipc_block_get_holders(b2), gpuipc_block_get_holders(b3));
  ASSERT_EQ(gpuipc_block_get_holders(b1), 1);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  for (int i = 0; i < 1000 && gpuipc_block_get_holders(b1) > 0; i++) {
    (void)gpuipc_conn_progress(c, 0);
    usleep(1000);
  }
  ASSERT_OK(gpuipc_block_free(b1, NULL));
  ASSERT_OK(gpuipc_block_free(b2, NULL));
  ASSERT_OK(gpuipc_block_free(b3, NULL));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a1));
  ASSERT_OK(gpuipc_arena_destroy(a2));
  return 0;
}

/* ---- the opt-in peer watcher --------------------------------------------------------- */

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

/* ---- broadcast: a consumer killed ---------------------------------------------------- */

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
      /* Over the ring a record reaches a dead peer as well as a live one;
       * a sender looks at the socket's hang-up at most once a millisecond
       * (docs/ring.md): the rounds that follow may take less than that. */
      usleep(2000);
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

/* ---- broadcast: the shared ready word ------------------------------------------------ */

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
  await_test_then_close(c);
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

/* ---- a close that cannot unmap yet --------------------------------------------------- */

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

/* ---- the peer watcher by default ------------------------------------------------------ */

/* The consumer of an exporter that dies after its send, with the options
 * o (timeout aside), synchronizes its stream before any gpuipc call: the
 * synchronize returns (the watcher wrote the dead exporter's word). */
static int default_watcher_unblocks(gpuipc_conn_options *o) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ho_stuck_producer", NULL, &fd, NULL);
  o->timeout_ms = 30000;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, o, &c));
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(gpuipc__cu.cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  bounded("cuStreamSynchronize after the exporter died, default options", 20);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  bounded_done();
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  gpuipc_conn_close(c);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}

/* GPUIPC_CONN_OPTIONS_INIT, untouched: the watcher is on. */
TEST_IMPL(handoff_watcher_by_default) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  return default_watcher_unblocks(&o);
}

/* A caller built against the header where watch_peer was opt-in: its
 * options end before the field, and the old field says 0 ("the
 * default"): it gets the watcher too. */
TEST_IMPL(handoff_watcher_old_caller_gets_default) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.size = offsetof(gpuipc_conn_options, watch_peer);
  o.watch_peer_v0 = 0;
  o.watch_peer = 0; /* beyond its size: not read */
  return default_watcher_unblocks(&o);
}

/* Threads of this process now. */
/* The watcher threads of this process (named "gpuipc-watch"; a
 * sanitizer's own threads come and go on their own). */
static int thread_count(void) {
  DIR *d = opendir("/proc/self/task");
  ASSERT(d != NULL);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    char path[300], name[32] = {0};
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (f == NULL)
      continue; /* it ended meanwhile */
    if (fgets(name, sizeof name, f) && strncmp(name, "gpuipc-watch", 12) == 0)
      n++;
    fclose(f);
  }
  closedir(d);
  return n;
}

/* watch_peer = 0 starts no thread; the first connection with the default
 * starts one, and later ones no other. */
TEST_IMPL(handoff_watcher_opt_out_no_thread) {
  REQUIRE_DEVICES(1);
  int n0 = thread_count();
  int fd1, fd2, fd3;
  pid_t p1 = spawn_helper("ho_stuck_producer", NULL, &fd1, NULL);
  pid_t p2 = spawn_helper("ho_stuck_producer", NULL, &fd2, NULL);
  gpuipc_conn_options off = GPUIPC_CONN_OPTIONS_INIT;
  off.watch_peer = 0;
  gpuipc_conn *c1 = NULL, *c2 = NULL, *c3 = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd1, &off, &c1));
  ASSERT_EQ(thread_count(), n0);
  ASSERT_OK(gpuipc_conn_from_fd(fd2, NULL, &c2));
  ASSERT_EQ(thread_count(), n0 + 1);
  pid_t p3 = spawn_helper("ho_stuck_producer", NULL, &fd3, NULL);
  ASSERT_OK(gpuipc_conn_from_fd(fd3, NULL, &c3));
  ASSERT_EQ(thread_count(), n0 + 1);
  pid_t ps[3] = {p1, p2, p3};
  for (int i = 0; i < 3; i++) {
    kill(ps[i], SIGKILL);
    ASSERT_EQ(wait_helper(ps[i], 60), 128 + SIGKILL);
  }
  gpuipc_conn_close(c1);
  gpuipc_conn_close(c2);
  gpuipc_conn_close(c3);
  return 0;
}
