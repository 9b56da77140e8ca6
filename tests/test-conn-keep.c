/*
 * test-conn-keep.c: keep until released (gpuipc_buffer_release_when_done):
 * a buffer handed over to gpuipc after its sends is kept until every lease
 * came back, then closed, and its done callback runs exactly once: after
 * the peer's release; after the peer was killed holding it; after a close
 * here, only once the peer holding it is gone (the peer watcher sees it
 * exit, with no call of ours); at once for a buffer never sent. A buffer
 * handed over twice, or an imported one, is refused. The same across pid
 * namespaces (the peer's pid reads 0 there) is in test-conn-ns.c. Also
 * destroy when drained (gpuipc_arena_release): an arena given up is
 * destroyed at once when drained, else once its last block came back.
 * And the exit call (gpuipc_conn_call_when_peer_exits): run once the
 * peer's process is gone, not when it merely closed the connection, also
 * after our close; at once for a peer gone already.
 */
#include "test-conn-handoff.h"


#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

/* What the done callback sees. */
typedef struct kept {
  atomic_int calls;
  CUdeviceptr raw; /* the foreign allocation the wrapper names */
} kept;

static void on_done(void *ctx) { atomic_fetch_add(&((kept *)ctx)->calls, 1); }

/* Waits up to 30 s, calling nothing of gpuipc, for done to have run. */
static void wait_called(kept *k) {
  for (int i = 0; i < 3000 && atomic_load(&k->calls) == 0; i++)
    usleep(10000);
}

/* A wrapped cuMemAlloc allocation of n bytes filled with seed's pattern,
 * ready to send. */
static gpuipc_buffer *wrapped(kept *k, size_t n, uint32_t seed) {
  ctx_current();
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&k->raw, n));
  uint8_t *host = malloc(n);
  ASSERT_NOT_NULL(host);
  pattern(host, n, seed);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(k->raw, host, n));
  free(host);
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_wrap((void *)(uintptr_t)k->raw, n, &b));
  return b;
}

/* The consumer: receives `argv[0]` buffers (each checked against the seed
 * in its metadata). Mode argv[1]: "release" releases them all and says
 * "ok"; "hold" releases all but the last, says "held", and keeps the last
 * until it is killed (its connection may end meanwhile). */
HELPER_IMPL(keep_consumer) {
  ASSERT(argc >= 2);
  int n = atoi(argv[0]);
  bool hold = strcmp(argv[1], "hold") == 0;
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  for (int i = 0; i < n; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    check_received(&r, s);
    if (!hold || i + 1 < n)
      ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  }
  if (!hold) {
    ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
    char m[4];
    size_t ml;
    ASSERT_OK(gpuipc_conn_recv_msg(c, m, sizeof m, &ml, NULL, NULL));
    gpuipc_conn_close(c);
    return 0;
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "held", 4, NULL, 0));
  /* Until the test ends the connection (or kills us): then wait to be
   * killed, still holding the last buffer. */
  gpuipc_status st = GPUIPC_OK;
  while (st == GPUIPC_OK || st == GPUIPC_E_TIMEOUT)
    st = gpuipc_conn_progress(c, 1000);
  for (;;)
    pause();
}

static void expect_msg(gpuipc_conn *c, const char *want) {
  char m[8];
  size_t ml = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, m, sizeof m, &ml, NULL, NULL));
  ASSERT_EQ(ml, strlen(want));
  ASSERT_EQ(memcmp(m, want, ml), 0);
}

/* Sends b with seed as its metadata. */
static void send_seeded(gpuipc_conn *c, gpuipc_buffer *b, CUstream s,
                        uint32_t seed) {
  ASSERT_OK(gpuipc_conn_send_buffer(c, b, (struct CUstream_st *)s, &seed,
                                    sizeof seed));
}

/* Released: done runs once, after the release came, and never again. */
TEST_IMPL(keep_released_called_once) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("keep_consumer", NULL, &fd, "2", "release", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  kept k = {0};
  gpuipc_buffer *b = wrapped(&k, 65536, 11);
  /* Sent twice: two leases, both must come back. */
  send_seeded(c, b, s, 11);
  send_seeded(c, b, s, 11);
  ASSERT_EQ(gpuipc_buffer_get_holders(b), 2); /* counted across connections */
  ASSERT_OK(gpuipc_buffer_release_when_done(b, (struct CUstream_st *)s,
                                            on_done, &k));
  ASSERT_EQ(gpuipc_buffer_get_holders(b), 2); /* still valid until done */
  /* No release was read yet: nothing is done. */
  ASSERT_EQ(atomic_load(&k.calls), 0);
  /* Handed over: a second hand-over is refused and changes nothing. */
  ASSERT_STATUS(gpuipc_buffer_release_when_done(b, NULL, on_done, &k),
                GPUIPC_E_INVALID_ARG);
  expect_msg(c, "ok"); /* both releases are read before the message */
  ASSERT_EQ(atomic_load(&k.calls), 1);
  for (int i = 0; i < 5; i++)
    ASSERT_OK(gpuipc_conn_progress(c, 0));
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  gpuipc_conn_close(c);
  (void)gpuipc_conn_collect();
  ASSERT_EQ(atomic_load(&k.calls), 1);
  /* The owner's stream was ordered after the releases: once it drained,
   * the memory is the owner's again. */
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFree(k.raw));
  return 0;
}

/* Never sent: done at once, inside the call. */
TEST_IMPL(keep_never_sent_done_at_once) {
  REQUIRE_DEVICES(1);
  kept k = {0};
  gpuipc_buffer *b = wrapped(&k, 4096, 1);
  ASSERT_EQ(gpuipc_buffer_get_holders(b), 0);
  ASSERT_OK(gpuipc_buffer_release_when_done(b, NULL, on_done, &k));
  ASSERT_EQ(atomic_load(&k.calls), 1);
  ASSERT_STATUS(gpuipc_buffer_release_when_done(NULL, NULL, on_done, &k),
                GPUIPC_E_INVALID_ARG);
  /* An allocated buffer too, with no callback. */
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *ab = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &ab));
  ASSERT_OK(gpuipc_buffer_release_when_done(ab, NULL, NULL, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool)); /* the buffer went: not busy */
  ASSERT_CU(gpuipc__cu.cuMemFree(k.raw));
  ASSERT_EQ(atomic_load(&k.calls), 1);
  return 0;
}

/* Killed holding it: done runs once the peer's process is gone. */
TEST_IMPL(keep_peer_killed) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("keep_consumer", NULL, &fd, "1", "hold", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  kept k = {0};
  gpuipc_buffer *b = wrapped(&k, 65536, 21);
  send_seeded(c, b, s, 21);
  ASSERT_OK(gpuipc_buffer_release_when_done(b, (struct CUstream_st *)s,
                                            on_done, &k));
  expect_msg(c, "held");
  for (int i = 0; i < 5; i++)
    ASSERT_OK(gpuipc_conn_progress(c, 0));
  ASSERT_EQ(atomic_load(&k.calls), 0); /* the peer lives and holds it */
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  gpuipc_status st = GPUIPC_OK;
  for (int i = 0; i < 3000 && atomic_load(&k.calls) == 0; i++) {
    st = gpuipc_conn_progress(c, 10);
    ASSERT(st == GPUIPC_OK || st == GPUIPC_E_TIMEOUT ||
           st == GPUIPC_E_PEER_GONE);
  }
  ASSERT_EQ(atomic_load(&k.calls), 1);
  gpuipc_conn_close(c);
  (void)gpuipc_conn_collect();
  ASSERT_EQ(atomic_load(&k.calls), 1);
  ASSERT_CU(gpuipc__cu.cuMemFree(k.raw));
  return 0;
}

/* Closed here while the peer holds one of two buffers: the one it had
 * released is done before the close returns, the held one is not done
 * while the peer lives (whatever we call), and is done, once, after the
 * peer's process is gone: by the watcher, without any call of ours. */
TEST_IMPL(keep_closed_here_then_peer_dies) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("keep_consumer", NULL, &fd, "2", "hold", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  kept k1 = {0}, k2 = {0};
  gpuipc_buffer *b1 = wrapped(&k1, 65536, 31);
  gpuipc_buffer *b2 = wrapped(&k2, 65536, 32);
  send_seeded(c, b1, s, 31);
  send_seeded(c, b2, s, 32);
  ASSERT_OK(gpuipc_buffer_release_when_done(b1, (struct CUstream_st *)s,
                                            on_done, &k1));
  ASSERT_OK(gpuipc_buffer_release_when_done(b2, (struct CUstream_st *)s,
                                            on_done, &k2));
  expect_msg(c, "held");
  ASSERT_EQ(atomic_load(&k1.calls), 1);
  ASSERT_EQ(atomic_load(&k2.calls), 0);
  gpuipc_conn_close(c);
  /* The peer lives and holds b2: kept, whoever asks. */
  ASSERT(gpuipc_conn_collect() >= 1);
  ASSERT_EQ(atomic_load(&k2.calls), 0);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  /* No call of ours: the watcher sees the process exit. */
  wait_called(&k2);
  ASSERT_EQ(atomic_load(&k2.calls), 1);
  (void)gpuipc_conn_collect();
  ASSERT_EQ(atomic_load(&k1.calls), 1);
  ASSERT_EQ(atomic_load(&k2.calls), 1);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFree(k1.raw));
  ASSERT_CU(gpuipc__cu.cuMemFree(k2.raw));
  return 0;
}

/* ---- the exit call (gpuipc_conn_call_when_peer_exits) ------------------------------- */

/* A peer that connects and closes its connection; argv[0] "live": then
 * lives on until it is killed; "exit": then exits. */
HELPER_IMPL(exit_call_peer) {
  ASSERT(argc >= 1);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_conn_close(c);
  close(harness_helper_fd()); /* the test sees the end of the stream */
  if (strcmp(argv[0], "exit") == 0)
    return 0;
  for (;;)
    pause();
}

TEST_IMPL(conn_exit_call_waits_for_the_process) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("exit_call_peer", NULL, &fd, "live", NULL);
  gpuipc_conn *c = pair_conn(fd);
  kept k = {0};
  ASSERT_STATUS(gpuipc_conn_call_when_peer_exits(NULL, on_done, &k),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_conn_call_when_peer_exits(c, NULL, &k),
                GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_conn_call_when_peer_exits(c, on_done, &k));
  /* Its connection ends, its process lives: not called. */
  gpuipc_status st = GPUIPC_OK;
  for (int i = 0; i < 3000 && st != GPUIPC_E_PEER_GONE; i++) {
    st = gpuipc_conn_progress(c, 10);
    ASSERT(st == GPUIPC_OK || st == GPUIPC_E_TIMEOUT ||
           st == GPUIPC_E_PEER_GONE);
  }
  ASSERT_STATUS(st, GPUIPC_E_PEER_GONE);
  ASSERT_EQ(atomic_load(&k.calls), 0);
  /* Nor after our close, whatever we call, past the watcher's rescan. */
  gpuipc_conn_close(c);
  (void)gpuipc_conn_collect();
  usleep(300 * 1000);
  ASSERT_EQ(atomic_load(&k.calls), 0);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  /* No call of ours: the watcher sees the process exit, and calls once. */
  wait_called(&k);
  ASSERT_EQ(atomic_load(&k.calls), 1);
  usleep(300 * 1000);
  ASSERT_EQ(atomic_load(&k.calls), 1);
  return 0;
}

TEST_IMPL(conn_exit_call_for_a_peer_gone_already) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("exit_call_peer", NULL, &fd, "exit", NULL);
  gpuipc_conn *c = pair_conn(fd);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  kept k = {0};
  /* Gone (and reaped): called inside the call, once. */
  ASSERT_OK(gpuipc_conn_call_when_peer_exits(c, on_done, &k));
  ASSERT_EQ(atomic_load(&k.calls), 1);
  gpuipc_conn_close(c);
  usleep(300 * 1000);
  ASSERT_EQ(atomic_load(&k.calls), 1);
  return 0;
}

/* A child forked after the call runs none of the parent's exit calls,
 * also once a watcher of its own runs there (its own call makes one):
 * each runs once, in the process that made it. */
#if defined(__SANITIZE_THREAD__)
#define KEEP_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KEEP_UNDER_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KEEP_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KEEP_UNDER_ASAN 1
#endif
#endif

TEST_IMPL(conn_exit_call_not_run_in_a_forked_child) {
#ifdef KEEP_UNDER_TSAN
  SKIP("under ThreadSanitizer, whose child of a threaded process dies when "
       "it starts a thread (die_after_fork), as this child's watcher must; "
       "the test runs in the other builds");
#endif
#ifdef KEEP_UNDER_ASAN
  SKIP("under AddressSanitizer, whose allocator a forked child of a "
       "threaded process can find locked by one of the parent's threads "
       "(seen under load: the child's watcher thread stuck for good in "
       "ASan's calloc); the test runs in the gcc and clang builds");
#endif
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("exit_call_peer", NULL, &fd, "live", NULL);
  gpuipc_conn *c = pair_conn(fd);
  kept k = {0};
  ASSERT_OK(gpuipc_conn_call_when_peer_exits(c, on_done, &k));
  pid_t child = fork();
  ASSERT(child >= 0);
  if (child == 0) {
    kept k2 = {0};
    if (gpuipc_conn_call_when_peer_exits(c, on_done, &k2) != GPUIPC_OK)
      _exit(5);
    wait_called(&k2);
    if (atomic_load(&k2.calls) != 1)
      _exit(4); /* its own call did not run */
    usleep(300 * 1000);
    _exit(atomic_load(&k.calls) == 0 ? 0 : 3); /* 3: the parent's ran here */
  }
  usleep(200 * 1000); /* the child's watcher is up before the peer exits */
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  int st = 0;
  ASSERT_EQ(waitpid(child, &st, 0), child);
  ASSERT(WIFEXITED(st));
  ASSERT_EQ(WEXITSTATUS(st), 0);
  wait_called(&k);
  ASSERT_EQ(atomic_load(&k.calls), 1);
  gpuipc_conn_close(c);
  return 0;
}

/* gpuipc_conn_collect runs the exit calls whose peers are gone (for a
 * process whose watcher could not start; here it only finds them first
 * or finds them done), and never twice. */
TEST_IMPL(conn_exit_call_collect_runs_it_once) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("exit_call_peer", NULL, &fd, "live", NULL);
  gpuipc_conn *c = pair_conn(fd);
  kept k = {0};
  ASSERT_OK(gpuipc_conn_call_when_peer_exits(c, on_done, &k));
  (void)gpuipc_conn_collect();
  ASSERT_EQ(atomic_load(&k.calls), 0);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  for (int i = 0; i < 3000 && atomic_load(&k.calls) == 0; i++)
    (void)gpuipc_conn_collect();
  ASSERT_EQ(atomic_load(&k.calls), 1);
  for (int i = 0; i < 50; i++)
    (void)gpuipc_conn_collect();
  usleep(300 * 1000);
  ASSERT_EQ(atomic_load(&k.calls), 1);
  gpuipc_conn_close(c);
  return 0;
}

/* ---- destroy when drained (gpuipc_arena_release) ----------------------------------- */

/* A block of a filled with seed's pattern, sent with the seed. */
static gpuipc_block *send_block(gpuipc_conn *c, gpuipc_arena *a, CUstream s,
                                size_t n, uint32_t seed) {
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  uint8_t *host = malloc(n);
  ASSERT_NOT_NULL(host);
  pattern(host, n, seed);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(
      (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), host, n, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  free(host);
  ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed,
                             sizeof seed));
  return b;
}

/* Nothing out: destroyed at once (or once its queued GPU work is done). */
TEST_IMPL(arena_release_drained_destroys_now) {
  REQUIRE_DEVICES(1);
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b));
  ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_arena_release(a));
  /* Destroyed in the call, or, while the reuse's GPU-side waits (the
   * arena's own stream) are still queued, by the next retry after them. */
  for (int i = 0; i < 3000 && gpuipc__arena_given_retry() > 0; i++)
    usleep(1000);
  ASSERT_EQ(gpuipc__arena_given_retry(), 0);
  ASSERT_OK(gpuipc_arena_release(NULL));
  return 0;
}

/* Given up while the caller still has a block and a peer holds another:
 * kept through the caller's free and while the peer lives; destroyed once
 * the peer is killed (its blocks come back). */
TEST_IMPL(arena_release_when_peer_gone) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("keep_consumer", NULL, &fd, "1", "hold", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *held = send_block(c, a, s, 8192, 41);
  gpuipc_block *mine = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &mine));
  expect_msg(c, "held");
  ASSERT_OK(gpuipc_block_free(held, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_arena_release(a)); /* kept: two blocks out */
  ASSERT_EQ(gpuipc__arena_given_retry(), 1);
  ASSERT_OK(gpuipc_block_free(mine, (struct CUstream_st *)s)); /* still ours */
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (int i = 0; i < 5; i++)
    ASSERT_OK(gpuipc_conn_progress(c, 0));
  ASSERT_EQ(gpuipc__arena_given_retry(), 1); /* the peer holds one */
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  /* (progress returns at once once the peer is gone; the GPU work the
   * reuse waits for completes on its own) */
  for (int i = 0; i < 3000 && gpuipc__arena_given_retry() > 0; i++) {
    (void)gpuipc_conn_progress(c, 10);
    usleep(10000);
  }
  ASSERT_EQ(gpuipc__arena_given_retry(), 0);
  gpuipc_conn_close(c);
  return 0;
}

/* The same with the connection closed here first: the arena stays while
 * the peer lives (gpuipc_conn_collect keeps it), and goes once the
 * peer's process is gone. */
TEST_IMPL(arena_release_after_close_when_peer_gone) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("keep_consumer", NULL, &fd, "1", "hold", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *held = send_block(c, a, s, 8192, 51);
  expect_msg(c, "held");
  ASSERT_OK(gpuipc_block_free(held, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_arena_release(a));
  gpuipc_conn_close(c);
  ASSERT(gpuipc_conn_collect() >= 2); /* the orphan table and the arena */
  ASSERT_EQ(gpuipc__arena_given_retry(), 1);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  size_t left = 1;
  for (int i = 0; i < 3000 && left > 0; i++) {
    left = gpuipc_conn_collect();
    if (left > 0)
      usleep(10000);
  }
  ASSERT_EQ(left, 0);
  ASSERT_EQ(gpuipc__arena_given_retry(), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  return 0;
}
