/*
 * test-proc.c: the spawn helper, reaping, buffers handed to a spawned child
 * by the two stories (a connection's gpuipc_conn_send_buffer, and a
 * descriptor in a user message), and worker groups (a worker that dies is
 * reported with its signal, and the blocks it held come back).
 */
#include "harness.h"

#include "tree.h"

#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- helpers (the children) ------------------------------------------------ */

static gpuipc_conn *child_connect(void) {
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_spawn_connection(NULL, &c));
  /* Picked up once: the variable is gone, and a second call says so. */
  ASSERT_NULL(getenv(GPUIPC_ENV_CONN_FD));
  gpuipc_conn *again = NULL;
  ASSERT_STATUS(gpuipc_spawn_connection(NULL, &again), GPUIPC_E_NOT_FOUND);
  ASSERT_NULL(again);
  return c;
}

/* Modes: "echo" echoes one message; "exit:N" exits with N after
 * connecting; "wait-close" waits (forever) for the parent's close; "raw-exit:N" exits with N without connecting; "sleep" never
 * connects. */
HELPER_IMPL(proc_child) {
  ASSERT_GE(argc, 1);
  const char *mode = argv[0];
  if (strncmp(mode, "raw-exit:", 9) == 0)
    return atoi(mode + 9);
  if (strcmp(mode, "sleep") == 0) {
    sleep(60);
    return 0;
  }
  gpuipc_conn *c = child_connect();
  int rc = 0;
  if (strcmp(mode, "echo") == 0) {
    char buf[256];
    size_t len = 0;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
    ASSERT_OK(gpuipc_conn_send_msg(c, buf, len, NULL, 0));
  } else if (strncmp(mode, "exit:", 5) == 0) {
    rc = atoi(mode + 5);
  } else if (strcmp(mode, "wait-close") == 0) {
    /* The parent closes its end: seen at once, and nothing goes out. */
    char buf[16];
    size_t len = 0;
    ASSERT_OK(gpuipc_conn_set_timeout(c, -1));
    ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                  GPUIPC_E_PEER_GONE);
    ASSERT(gpuipc_conn_send_msg(c, "x", 1, NULL, 0) != GPUIPC_OK);
  }
  gpuipc_conn_close(c);
  return rc;
}

static char *self_argv(const char *helper, const char *mode, char *store[5]) {
  store[0] = "gpuipc-tests";
  store[1] = "--helper";
  store[2] = (char *)helper;
  store[3] = (char *)mode;
  store[4] = NULL;
  return store[0];
}

/* ---- spawning and reaping ------------------------------------------------------ */

TEST_IMPL(proc_spawn_echo) {
  char *argv[5];
  self_argv("proc_child", "echo", argv);
  int fds_before = harness_count_fds();
  gpuipc_child *ch = NULL;
  ASSERT_OK(gpuipc_spawn("/proc/self/exe", argv, NULL, &ch));
  ASSERT_GT(gpuipc_child_get_pid(ch), 0);
  gpuipc_conn *c = gpuipc_child_get_conn(ch);
  ASSERT_NOT_NULL(c);
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.pid, gpuipc_child_get_pid(ch));
  ASSERT_OK(gpuipc_conn_send_msg(c, "ping", 4, NULL, 0));
  char buf[16];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 4);
  ASSERT_MEM_EQ(buf, "ping", 4);
  gpuipc_child_status st;
  ASSERT_OK(gpuipc_child_wait(ch, 10000, &st));
  ASSERT_EQ(st.state, GPUIPC_CHILD_EXITED);
  ASSERT_EQ(st.code, 0);
  /* Waiting again gives the kept status. */
  ASSERT_OK(gpuipc_child_wait(ch, 0, &st));
  ASSERT_EQ(st.code, 0);
  ASSERT_OK(gpuipc_child_destroy(ch, 0, NULL));
  ASSERT_EQ(harness_count_fds(), fds_before);
  return 0;
}

TEST_IMPL(proc_spawn_exit_code_and_signal) {
  char *argv[5];
  self_argv("proc_child", "exit:3", argv);
  gpuipc_child *ch = NULL;
  ASSERT_OK(gpuipc_spawn("/proc/self/exe", argv, NULL, &ch));
  gpuipc_child_status st;
  ASSERT_OK(gpuipc_child_destroy(ch, 10000, &st));
  ASSERT_EQ(st.state, GPUIPC_CHILD_EXITED);
  ASSERT_EQ(st.code, 3);
  char text[96];
  ASSERT_STR_EQ(gpuipc_child_status_str(&st, text, sizeof text), "exit code 3");

  self_argv("proc_child", "echo", argv);
  ASSERT_OK(gpuipc_spawn("/proc/self/exe", argv, NULL, &ch));
  ASSERT_STATUS(gpuipc_child_wait(ch, 0, &st), GPUIPC_E_TIMEOUT);
  ASSERT_EQ(st.state, GPUIPC_CHILD_RUNNING);
  ASSERT_OK(gpuipc_child_kill(ch, SIGKILL));
  ASSERT_OK(gpuipc_child_wait(ch, 10000, &st));
  ASSERT_EQ(st.state, GPUIPC_CHILD_SIGNALED);
  ASSERT_EQ(st.signal, SIGKILL);
  ASSERT_STR_CONTAINS(gpuipc_child_status_str(&st, text, sizeof text),
                      "SIGKILL");
  /* The parent learns on the connection too. */
  char buf[8];
  size_t len = 0;
  ASSERT_STATUS(gpuipc_conn_recv_msg(gpuipc_child_get_conn(ch), buf, sizeof buf,
                                     &len, NULL, NULL),
                GPUIPC_E_PEER_GONE);
  ASSERT_OK(gpuipc_child_destroy(ch, 0, NULL));
  return 0;
}

TEST_IMPL(proc_spawn_failures) {
  char *argv[5];
  gpuipc_child *ch = (gpuipc_child *)1;
  self_argv("proc_child", "echo", argv);
  ASSERT_STATUS(gpuipc_spawn("/nonexistent/program", argv, NULL, &ch),
                GPUIPC_E_NOT_FOUND);
  ASSERT_NULL(ch);
  ASSERT_STATUS(gpuipc_spawn(NULL, argv, NULL, &ch), GPUIPC_E_INVALID_ARG);
  gpuipc_spawn_options o = GPUIPC_SPAWN_OPTIONS_INIT;
  o.size = 1; /* not an initialized struct */
  ASSERT_STATUS(gpuipc_spawn("/proc/self/exe", argv, &o, &ch),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "options size");
  o = (gpuipc_spawn_options)GPUIPC_SPAWN_OPTIONS_INIT;

  /* A child that exits before connecting: the status says how. */
  self_argv("proc_child", "raw-exit:5", argv);
  ASSERT_STATUS(gpuipc_spawn("/proc/self/exe", argv, NULL, &ch),
                GPUIPC_E_PEER_GONE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "exit code 5");

  /* A child that never connects: timed out, killed, reaped. */
  gpuipc_conn_options co = GPUIPC_CONN_OPTIONS_INIT;
  co.timeout_ms = 300;
  o.conn = &co;
  self_argv("proc_child", "sleep", argv);
  gpuipc_status s = gpuipc_spawn("/proc/self/exe", argv, &o, &ch);
  ASSERT(s == GPUIPC_E_TIMEOUT || s == GPUIPC_E_PEER_GONE);
  ASSERT_NULL(ch);
  /* No child is left behind. */
  ASSERT_EQ(waitpid(-1, NULL, WNOHANG), -1);
  ASSERT_EQ(errno, ECHILD);

  /* This process was not started by gpuipc_spawn. */
  gpuipc_conn *c = NULL;
  unsetenv(GPUIPC_ENV_CONN_FD);
  ASSERT_STATUS(gpuipc_spawn_connection(NULL, &c), GPUIPC_E_NOT_FOUND);
  setenv(GPUIPC_ENV_CONN_FD, "0", 1); /* stdin: not a socket here */
  s = gpuipc_spawn_connection(NULL, &c);
  ASSERT(s == GPUIPC_E_INVALID_ARG || s == GPUIPC_E_PROTOCOL ||
         s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_TIMEOUT);
  ASSERT_NULL(getenv(GPUIPC_ENV_CONN_FD));
  ASSERT_OK(gpuipc_child_destroy(NULL, 0, NULL));
  return 0;
}

/* Environment handling: env_add overrides, our variables always win. */
HELPER_IMPL(proc_env_child) {
  gpuipc_conn *c = child_connect();
  const char *a = getenv("PROC_TEST_A");
  const char *b = getenv("PROC_TEST_B");
  char reply[128];
  snprintf(reply, sizeof reply, "%s|%s", a ? a : "-", b ? b : "-");
  ASSERT_OK(gpuipc_conn_send_msg(c, reply, strlen(reply), NULL, 0));
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(proc_spawn_environment) {
  char *argv[5];
  self_argv("proc_env_child", "x", argv);
  char *base[] = {"PROC_TEST_A=base", "PROC_TEST_B=base",
                  GPUIPC_ENV_CONN_FD "=999", NULL};
  char *add[] = {"PROC_TEST_B=added", NULL};
  /* The driver choice travels too: base replaces the whole environment. */
  char drv[4096];
  const char *d = getenv("GPUIPC_CUDA_DRIVER");
  snprintf(drv, sizeof drv, "GPUIPC_CUDA_DRIVER=%s", d ? d : "");
  char *add2[] = {"PROC_TEST_B=added", drv, NULL};
  gpuipc_spawn_options o = GPUIPC_SPAWN_OPTIONS_INIT;
  o.envp = base;
  o.env_add = d ? add2 : add;
  gpuipc_child *ch = NULL;
  ASSERT_OK(gpuipc_spawn("/proc/self/exe", argv, &o, &ch));
  char buf[128];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(gpuipc_child_get_conn(ch), buf, sizeof buf - 1,
                                 &len, NULL, NULL));
  buf[len] = '\0';
  ASSERT_STR_EQ(buf, "base|added");
  gpuipc_child_status st;
  ASSERT_OK(gpuipc_child_destroy(ch, 10000, &st));
  ASSERT_EQ(st.code, 0);
  return 0;
}

/* ---- buffers handed to a spawned child (needs CUDA) ------------------------ */

static void fill_at(void *p, size_t n, int ord, unsigned char v) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ord));
  ASSERT_CU(gpuipc__cu.cuMemsetD8((CUdeviceptr)(uintptr_t)p, v, n));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  gpuipc__ctx_leave(&g);
}

static void check_at(const void *p, size_t n, int ord, unsigned char v) {
  unsigned char *h = malloc(n);
  ASSERT_NOT_NULL(h);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ord));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, (CUdeviceptr)(uintptr_t)p, n));
  gpuipc__ctx_leave(&g);
  for (size_t i = 0; i < n; i++)
    if (h[i] != v)
      harness_fail(__FILE__, __LINE__, "byte %zu is 0x%02x, want 0x%02x", i,
                   h[i], v);
  free(h);
}

static int mapped_ordinal(gpuipc_buffer *b) {
  gpuipc_uuid u;
  int ord = 0;
  ASSERT_OK(gpuipc_buffer_get_mapped_device(b, &u));
  ASSERT_OK(gpuipc_device_from_uuid(&u, &ord));
  return ord;
}

static void fill(gpuipc_buffer *b, unsigned char v) {
  fill_at(gpuipc_buffer_get_ptr(b), gpuipc_buffer_get_size(b), mapped_ordinal(b),
          v);
}

static void check(gpuipc_buffer *b, unsigned char v) {
  check_at(gpuipc_buffer_get_ptr(b), gpuipc_buffer_get_size(b),
           mapped_ordinal(b), v);
}

/* Receives buffer 0 by the connection story (gpuipc_conn_recv, a lease)
 * and buffer 1 by the descriptor story (a user message with the
 * descriptor and its fds, gpuipc_buffer_import); checks each and writes
 * 0xB0 + i back. */
HELPER_IMPL(proc_buffers_child) {
  gpuipc_conn *c = child_connect();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
  ASSERT_EQ(r.length, 65536);
  check_at(r.ptr, r.length, r.device, 0xA0);
  fill_at(r.ptr, r.length, r.device, 0xB0);
  ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));

  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = GPUIPC_DESC_MAX_FDS;
  ASSERT_OK(gpuipc_conn_recv_msg(c, desc, sizeof desc, &len, fds, &nfds));
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(desc, len, fds, nfds, NULL, &b));
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  ASSERT_EQ(gpuipc_buffer_is_imported(b), 1);
  ASSERT_EQ(gpuipc_buffer_get_size(b), 2 * 65536);
  check(b, 0xA1);
  fill(b, 0xB1);
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_conn_send_msg(c, "done", 4, NULL, 0));
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(proc_spawn_hands_buffers_over) {
  REQUIRE_DEVICES(1);
  /* CUDA is initialized in this process before the spawn: posix_spawn's
   * child is a new program, so it can use CUDA (a forked one could not). */
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(NULL, &pool));
  gpuipc_buffer *bufs[2] = {NULL, NULL};
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(gpuipc_buffer_alloc(pool, 65536 * (size_t)(i + 1), NULL, &bufs[i]));
    fill(bufs[i], (unsigned char)(0xA0 + i));
  }
  char *argv[5];
  self_argv("proc_buffers_child", "x", argv);
  gpuipc_child *ch = NULL;
  ASSERT_OK(gpuipc_spawn("/proc/self/exe", argv, NULL, &ch));
  gpuipc_conn *c = gpuipc_child_get_conn(ch);
  /* The connection story. */
  ASSERT_OK(gpuipc_conn_send_buffer(c, bufs[0], NULL, NULL, 0));
  /* The descriptor story, carried in a user message. */
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = GPUIPC_DESC_MAX_FDS;
  ASSERT_OK(gpuipc_buffer_export(bufs[1], desc, sizeof desc, &len, fds, &nfds));
  ASSERT_OK(gpuipc_conn_send_msg(c, desc, len, fds, nfds));
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  char buf[8];
  size_t n = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &n, NULL, NULL));
  ASSERT_EQ(n, 4);
  ASSERT_MEM_EQ(buf, "done", 4);
  /* The child released its lease before it said done. */
  ASSERT_EQ(gpuipc_conn_get_buffer_holders(c, bufs[0]), 0);
  gpuipc_child_status st;
  ASSERT_OK(gpuipc_child_wait(ch, 20000, &st));
  ASSERT_EQ(st.state, GPUIPC_CHILD_EXITED);
  ASSERT_EQ(st.code, 0);
  ASSERT_OK(gpuipc_child_destroy(ch, 0, NULL));
  for (int i = 0; i < 2; i++) {
    check(bufs[i], (unsigned char)(0xB0 + i));
    ASSERT_OK(gpuipc_buffer_free(bufs[i], NULL));
  }
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

/* ---- worker groups ------------------------------------------------------------ */

/* A worker: says its index, then obeys: "die" kills itself with SIGKILL,
 * "exit" exits 0; a closed connection makes it exit 0. "hold" receives one
 * block and keeps it (never releases). */
HELPER_IMPL(proc_worker) {
  gpuipc_conn *c = child_connect();
  int idx = -1, n = 0;
  ASSERT_OK(gpuipc_worker_index(&idx, &n));
  int32_t me = idx;
  ASSERT_OK(gpuipc_conn_send_msg(c, &me, sizeof me, NULL, 0));
  for (;;) {
    char cmd[16];
    size_t len = 0;
    gpuipc_conn_set_timeout(c, -1);
    gpuipc_status s = gpuipc_conn_recv_msg(c, cmd, sizeof cmd - 1, &len, NULL,
                                           NULL);
    if (s != GPUIPC_OK) {
      gpuipc_conn_close(c);
      return 0; /* the parent is gone or shut us down */
    }
    cmd[len] = '\0';
    if (strcmp(cmd, "die") == 0)
      raise(SIGKILL);
    if (strcmp(cmd, "exit") == 0)
      break;
    if (strcmp(cmd, "hold") == 0) {
      gpuipc_received r = GPUIPC_RECEIVED_INIT;
      ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
      ASSERT_OK(gpuipc_conn_send_msg(c, "held", 4, NULL, 0));
    }
  }
  gpuipc_conn_close(c);
  return 0;
}

static gpuipc_group *start_group(int n) {
  char *argv[5];
  self_argv("proc_worker", "x", argv);
  gpuipc_group *g = NULL;
  ASSERT_OK(gpuipc_group_start("/proc/self/exe", argv, n, NULL, &g));
  ASSERT_EQ(gpuipc_group_get_size(g), n);
  for (int i = 0; i < n; i++) {
    int32_t who = -1;
    size_t len = 0;
    ASSERT_OK(gpuipc_conn_recv_msg(gpuipc_group_get_conn(g, i), &who, sizeof who,
                                   &len, NULL, NULL));
    ASSERT_EQ(who, i);
  }
  return g;
}

TEST_IMPL(proc_group_reports_dead_worker) {
  gpuipc_group *g = start_group(3);
  ASSERT_NULL(gpuipc_group_get_conn(g, 3));
  int w = 7;
  gpuipc_child_status st;
  ASSERT_OK(gpuipc_group_check(g, 0, &w, &st));
  ASSERT_EQ(w, -1);
  ASSERT_OK(gpuipc_conn_send_msg(gpuipc_group_get_conn(g, 1), "die", 3, NULL, 0));
  ASSERT_STATUS(gpuipc_group_check(g, 20000, &w, &st), GPUIPC_E_PEER_GONE);
  ASSERT_EQ(w, 1);
  ASSERT_EQ(st.state, GPUIPC_CHILD_SIGNALED);
  ASSERT_EQ(st.signal, SIGKILL);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "worker 1");
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "SIGKILL");
  /* Reported once. */
  ASSERT_OK(gpuipc_group_check(g, 0, &w, &st));
  ASSERT_EQ(w, -1);
  ASSERT_OK(gpuipc_conn_send_msg(gpuipc_group_get_conn(g, 2), "exit", 4, NULL, 0));
  ASSERT_STATUS(gpuipc_group_check(g, 20000, &w, &st), GPUIPC_E_PEER_GONE);
  ASSERT_EQ(w, 2);
  ASSERT_EQ(st.state, GPUIPC_CHILD_EXITED);
  ASSERT_EQ(st.code, 0);
  gpuipc_child_status all[3];
  ASSERT_OK(gpuipc_group_stop(g, 20000, all));
  ASSERT_EQ(all[0].state, GPUIPC_CHILD_EXITED);
  ASSERT_EQ(all[0].code, 0);
  ASSERT_EQ(all[1].signal, SIGKILL);
  ASSERT_EQ(all[2].code, 0);
  ASSERT_EQ(waitpid(-1, NULL, WNOHANG), -1);
  return 0;
}

TEST_IMPL(proc_group_dead_worker_blocks_come_back) {
  REQUIRE_DEVICES(1);
  gpuipc_arena *arena = NULL;
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)4 << 20;
  ASSERT_OK(gpuipc_arena_create(&ao, &arena));
  gpuipc_group *g = start_group(2);
  gpuipc_block *blk[2] = {NULL, NULL};
  for (int i = 0; i < 2; i++) {
    gpuipc_conn *c = gpuipc_group_get_conn(g, i);
    ASSERT_OK(gpuipc_arena_alloc(arena, 4096, NULL, &blk[i]));
    ASSERT_OK(gpuipc_conn_send_msg(c, "hold", 4, NULL, 0));
    ASSERT_OK(gpuipc_conn_send(c, blk[i], NULL, NULL, 0));
    char buf[8];
    size_t len = 0;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
    size_t held = 0;
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &held, NULL));
    ASSERT_EQ(held, 1);
  }
  /* Worker 0 dies holding its block. */
  ASSERT_OK(gpuipc_conn_send_msg(gpuipc_group_get_conn(g, 0), "die", 3, NULL, 0));
  int w = -1;
  gpuipc_child_status st;
  ASSERT_STATUS(gpuipc_group_check(g, 20000, &w, &st), GPUIPC_E_PEER_GONE);
  ASSERT_EQ(w, 0);
  ASSERT_EQ(st.signal, SIGKILL);
  /* Its lease is gone; worker 1's is still out. */
  size_t held = 99;
  gpuipc_status s = gpuipc_conn_get_outstanding(gpuipc_group_get_conn(g, 0), &held, NULL);
  ASSERT(s == GPUIPC_OK || s == GPUIPC_E_PEER_GONE || s == GPUIPC_E_CLOSED);
  if (s == GPUIPC_OK)
    ASSERT_EQ(held, 0);
  ASSERT_EQ(gpuipc_block_get_holders(blk[0]), 0);
  ASSERT_EQ(gpuipc_block_get_holders(blk[1]), 1);
  ASSERT_OK(gpuipc_block_free(blk[0], NULL));
  ASSERT_OK(gpuipc_group_stop(g, 20000, NULL));
  ASSERT_OK(gpuipc_block_free(blk[1], NULL));
  /* Worker 1's connection closed: everything came back. */
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(arena, &as));
  ASSERT_EQ(as.leases, 0);
  ASSERT_OK(gpuipc_arena_destroy(arena));
  return 0;
}

TEST_IMPL(proc_worker_index_outside_group) {
  unsetenv(GPUIPC_ENV_WORKER_INDEX);
  int i = -1, n = -1;
  ASSERT_STATUS(gpuipc_worker_index(&i, &n), GPUIPC_E_NOT_FOUND);
  setenv(GPUIPC_ENV_WORKER_INDEX, "2", 1);
  setenv(GPUIPC_ENV_WORKER_COUNT, "2", 1);
  ASSERT_STATUS(gpuipc_worker_index(&i, &n), GPUIPC_E_NOT_FOUND);
  setenv(GPUIPC_ENV_WORKER_INDEX, "1", 1);
  ASSERT_OK(gpuipc_worker_index(&i, &n));
  ASSERT_EQ(i, 1);
  ASSERT_EQ(n, 2);
  gpuipc_group *g = NULL;
  char *argv[5];
  self_argv("proc_worker", "x", argv);
  ASSERT_STATUS(gpuipc_group_start("/proc/self/exe", argv, 0, NULL, &g),
                GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_group_stop(NULL, 0, NULL));
  return 0;
}

/* ---- the example ----------------------------------------------------------------- */

/* The path of example `name` as built beside the CLI (the examples
 * directory of the build tree); false when it is not built there. */
static bool example_path(const char *name, char *path, size_t cap) {
  snprintf(path, cap, "%s", GPUIPC_CLI_PATH);
  char *slash = strrchr(path, '/');
  if (slash == NULL)
    slash = path - 1;
  snprintf(slash + 1, cap - (size_t)(slash + 1 - path), "examples/%s", name);
  return access(path, X_OK) == 0;
}

/* examples/worker_group.c, run as built. */
TEST_IMPL(proc_example_worker_group) {
  REQUIRE_DEVICES(1);
  char path[4096];
  if (!example_path("worker_group", path, sizeof path))
    SKIP("%s not built", path);
  static char out[16384];
  char *plain[] = {path, "3", NULL};
  ASSERT_EQ(harness_run(plain, NULL, out, sizeof out), 0);
  ASSERT_STR_CONTAINS(out, "gathered 12 jobs from 3 workers\n");
  ASSERT_STR_CONTAINS(out, "worker 2: exit code 0");
  ASSERT_STR_CONTAINS(out, "arena: 0 lease(s) out");
  char *killing[] = {path, "3", "--kill", NULL};
  ASSERT_EQ(harness_run(killing, NULL, out, sizeof out), 0);
  ASSERT_STR_CONTAINS(out, "worker 1 (pid ");
  ASSERT_STR_CONTAINS(out, "killed by signal 9 (SIGKILL)");
  ASSERT_STR_CONTAINS(out, "gathered 12 jobs from 3 workers\n");
  ASSERT_STR_CONTAINS(out, "arena: 0 lease(s) out");
  return 0;
}

/* examples/share.c, the README's C example, run the same way. */
TEST_IMPL(proc_example_share) {
  REQUIRE_DEVICES(1);
  char path[4096];
  if (!example_path("share", path, sizeof path))
    SKIP("%s not built", path);
  static char out[4096];
  char *argv[] = {path, NULL};
  ASSERT_EQ(harness_run(argv, NULL, out, sizeof out), 0);
  ASSERT_STR_CONTAINS(out, "child read \"hello from the parent\" from the "
                           "parent's GPU memory\n");
  ASSERT_STR_CONTAINS(out, "child: exit code 0\n");
  return 0;
}

/* ---- the parent's connection taken out of the child ------------------------------- */

/* gpuipc_child_take_conn: the caller owns the connection; its close is
 * seen by the child at once (its recv, waiting forever, returns
 * GPUIPC_E_PEER_GONE), and the child object no longer has it. */
TEST_IMPL(proc_take_conn_close_seen_by_child) {
  char *argv[5];
  self_argv("proc_child", "wait-close", argv);
  int fds_before = harness_count_fds();
  gpuipc_child *ch = NULL;
  ASSERT_OK(gpuipc_spawn("/proc/self/exe", argv, NULL, &ch));
  gpuipc_conn *c = gpuipc_child_take_conn(ch);
  ASSERT_NOT_NULL(c);
  ASSERT_NULL(gpuipc_child_get_conn(ch));
  ASSERT_NULL(gpuipc_child_take_conn(ch));
  ASSERT_NULL(gpuipc_child_take_conn(NULL));
  gpuipc_conn_close(c);
  gpuipc_child_status st;
  ASSERT_OK(gpuipc_child_wait(ch, 30000, &st));
  ASSERT_EQ(st.state, GPUIPC_CHILD_EXITED);
  ASSERT_EQ(st.code, 0);
  ASSERT_OK(gpuipc_child_destroy(ch, 0, NULL));
  ASSERT_EQ(harness_count_fds(), fds_before);
  return 0;
}
