/*
 * test-conn-ns.c: connections between processes in different pid, IPC and
 * mount namespaces (as two containers are), sharing only the directory
 * that holds the socket: each helper is started in namespaces of its own
 * (unshare(2) in a forked child, a fresh /proc and a private /dev/shm), and
 * the handoff (mempool arena blocks, mempool, VMM and pinned host buffers,
 * GPU-side ordering and release), the stale-descriptor checks (the
 * liveness table travels with the connection) and peer-death cleanup run
 * between them; also with one pid namespace and separate IPC and mount
 * namespaces, with the importer in a pid namespace below the exporter's,
 * and with two exporters that are both pid 1. Where the kernel refuses the
 * namespaces (no root, a seccomp profile) the tests skip and say why. Also
 * here: a peer that passes a wrong liveness table fd at the handshake, and
 * one that truncates its table afterwards.
 */
#include "harness.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tree.h"

/* ---- helpers in namespaces of their own ---------------------------------------- */

/* Why the last spawn_ns could not make the namespaces (for SKIP). */
static char ns_why[256];

/* What the grandchild reports through the status pipe when a step fails
 * (the pipe is close-on-exec: nothing arrives once exec succeeded). */
typedef struct ns_report {
  int step; /* 1 unshare, 2 fork, 3 mounts, 4 exec */
  int err;
} ns_report;

static const char *step_name(int step) {
  switch (step) {
  case 1: return "unshare(CLONE_NEWNS | CLONE_NEWIPC [| CLONE_NEWPID])";
  case 2: return "fork into the new pid namespace";
  case 3: return "mounting a private /dev/shm, /tmp and /proc";
  default: return "exec of the helper";
  }
}

static void report(int fd, int step, int err) {
  ns_report r = {step, err};
  ssize_t w = write(fd, &r, sizeof r);
  (void)w;
  _exit(77);
}

/* Whether path lies under /tmp (which a helper's private /tmp hides). */
static bool under_tmp(const char *path) {
  return path && strncmp(path, "/tmp/", 5) == 0;
}

/* Whether a namespaced helper gets a /tmp of its own: not when this binary
 * or the driver library lies under /tmp (the fresh one would hide them). */
static bool private_tmp(void) {
  char exe[512];
  ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
  exe[el > 0 ? el : 0] = '\0';
  return !under_tmp(exe) && !under_tmp(getenv("GPUIPC_CUDA_DRIVER"));
}

/* mkdir -p of an absolute path (in the helper's fresh /tmp). */
static int mkdirs(const char *path) {
  char p[512];
  snprintf(p, sizeof p, "%s", path);
  for (char *q = p + 1; *q; q++)
    if (*q == '/') {
      *q = '\0';
      if (mkdir(p, 0700) != 0 && errno != EEXIST)
        return -1;
      *q = '/';
    }
  return mkdir(p, 0700) != 0 && errno != EEXIST ? -1 : 0;
}

/* Starts this binary as helper `name` in new pid, IPC and mount namespaces
 * (pid 1 there, with its own /proc, an empty /dev/shm and an empty /tmp,
 * as a container has: a1, the directory of the sockets, is the one thing
 * shared, bind-mounted at its path as a volume would be; when this binary
 * or the driver library lies under /tmp, /tmp stays the test's); with a3 "ipc",
 * in new IPC and mount namespaces only (one pid namespace, as with docker
 * --pid=host or a pod's shareProcessNamespace, but no shared /dev/shm). Returns the pid
 * of the process that waits for it (its exit status is the helper's; when
 * it dies, the helper is killed), or -1 with ns_why set when the kernel
 * refused the namespaces (EPERM, EINVAL, ENOSPC, ENOSYS). *fd: the test's
 * end of a socketpair whose other end is the helper's fd 3. */
static pid_t spawn_ns(const char *name, int *fd, const char *a1,
                      const char *a2, const char *a3) {
  int sv[2], st[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ASSERT_EQ(pipe2(st, O_CLOEXEC), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(sv[0]);
    close(st[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int flags = CLONE_NEWNS | CLONE_NEWIPC;
    if (a3 == NULL || strcmp(a3, "ipc") != 0)
      flags |= CLONE_NEWPID;
    if (unshare(flags) != 0)
      report(st[1], 1, errno);
    pid_t inner = fork();
    if (inner < 0)
      report(st[1], 2, errno);
    if (inner == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      bool own_tmp = private_tmp();
      int shared = a1 && a1[0] == '/' ? open(a1, O_PATH | O_DIRECTORY | O_CLOEXEC) : -1;
      /* A container's view: its own /proc, an empty /dev/shm and /tmp, the
       * socket directory shared. */
      if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
          mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV,
                "mode=1777") != 0 ||
          mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                NULL) != 0)
        report(st[1], 3, errno);
      if (own_tmp && shared >= 0) {
        char fdp[64];
        snprintf(fdp, sizeof fdp, "/proc/self/fd/%d", shared);
        if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                  "mode=1777") != 0 ||
            (under_tmp(a1) && mkdirs(a1) != 0) ||
            (under_tmp(a1) && mount(fdp, a1, NULL, MS_BIND, NULL) != 0))
          report(st[1], 3, errno);
      }
      if (shared >= 0)
        close(shared);
      if (sv[1] == 3 ? fcntl(3, F_SETFD, 0) != 0 : dup2(sv[1], 3) < 0)
        report(st[1], 4, errno);
      setenv("GPUIPC_TEST_HELPER_FD", "3", 1);
      char *argv[] = {"/proc/self/exe", "--helper", (char *)name, (char *)a1,
                      (char *)a2,       (char *)a3,  NULL};
      execv("/proc/self/exe", argv);
      report(st[1], 4, errno);
    }
    close(sv[1]);
    close(st[1]);
    int ws = 0;
    while (waitpid(inner, &ws, 0) < 0 && errno == EINTR)
      ;
    _exit(WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws));
  }
  close(sv[1]);
  close(st[1]);
  ns_report r;
  ssize_t n;
  do
    n = read(st[0], &r, sizeof r);
  while (n < 0 && errno == EINTR);
  close(st[0]);
  if (n == (ssize_t)sizeof r) {
    int ws;
    waitpid(pid, &ws, 0);
    close(sv[0]);
    snprintf(ns_why, sizeof ns_why, "%s: %s", step_name(r.step),
             strerror(r.err));
    if (r.step <= 3 && (r.err == EPERM || r.err == EINVAL ||
                        r.err == ENOSPC || r.err == ENOSYS ||
                        r.err == EACCES || r.err == EUSERS))
      return -1;
    harness_fail(__FILE__, __LINE__, "namespaced helper %s: %s", name,
                 ns_why);
  }
  *fd = sv[0];
  return pid;
}

/* ---- small tools --------------------------------------------------------------- */

static void ctx_current(void) {
  CUcontext c;
  ASSERT_OK(gpuipc__primary_ctx(0, &c));
  ASSERT_CU(gpuipc__cu.cuCtxSetCurrent(c));
}

static CUstream mkstream(void) {
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  return s;
}

static gpuipc_conn_options ns_opts(const char *dir) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.runtime_dir = dir;
  return o;
}

/* The exporter listens on "ns" in dir and accepts one peer. */
static gpuipc_conn *ns_accept(const char *dir) {
  gpuipc_conn_options o = ns_opts(dir);
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("ns", &o, &l));
  harness_send_u64(harness_helper_fd(), 1); /* listening */
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_accept(l, &c));
  gpuipc_listener_close(l);
  return c;
}

static gpuipc_conn *ns_connect(const char *dir) {
  gpuipc_conn_options o = ns_opts(dir);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_connect("ns", &o, &c));
  return c;
}

/* Both helpers in namespaces of their own, the exporter listening before
 * the importer connects; *ex / *im: the test's ends of their sockets. */
static int start_pair(const char *exporter, const char *importer,
                      const char *mode, pid_t *pe, pid_t *pi, int *ex,
                      int *im) {
  char ns[32];
  snprintf(ns, sizeof ns, "%llu", (unsigned long long)gpuipc__pid_namespace());
  *pe = spawn_ns(exporter, ex, harness_tmpdir(), ns, mode);
  if (*pe < 0)
    return -1;
  ASSERT_UEQ(harness_recv_u64(*ex), 1);
  *pi = spawn_ns(importer, im, harness_tmpdir(), ns, mode);
  if (*pi < 0) {
    kill(*pe, SIGKILL);
    wait_helper(*pe, 30);
    return -1;
  }
  return 0;
}


static void fill(gpuipc_conn *c, void *ptr, size_t n, uint8_t v,
                 CUstream s) {
  (void)c;
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)ptr, v, n, s));
}

static void expect_bytes(const void *ptr, size_t n, uint8_t v, CUstream s) {
  uint8_t *h = malloc(n);
  ASSERT_NOT_NULL(h);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(h, (CUdeviceptr)(uintptr_t)ptr, n, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  for (size_t i = 0; i < n; i++)
    if (h[i] != v)
      harness_fail(__FILE__, __LINE__, "byte %zu is 0x%02x, want 0x%02x", i,
                   h[i], v);
  free(h);
}

/* ---- the helpers' own checks ---------------------------------------------------- */

/* Both helpers check where they are: pid 1 of a pid namespace that is not
 * the test's (mode "ipc": the test's pid namespace), and a /dev/shm of
 * their own (the test's marker file is not there). */
static bool ipc_only(char **argv) { return strcmp(argv[2], "ipc") == 0; }

static void check_contained(char **argv) {
  uint64_t test_pidns = strtoull(argv[1], NULL, 10);
  if (ipc_only(argv)) {
    ASSERT_NE(getpid(), 1);
    ASSERT_UEQ(gpuipc__pid_namespace(), test_pidns);
  } else {
    ASSERT_EQ(getpid(), 1);
    ASSERT_NE(gpuipc__pid_namespace(), test_pidns);
  }
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/gpuipc-test-ns-%llu",
           (unsigned long long)test_pidns);
  ASSERT_NE(access(path, F_OK), 0);
  /* A /tmp of its own too, unless this binary or the driver lies there. */
  snprintf(path, sizeof path, "/tmp/gpuipc-test-ns-%llu",
           (unsigned long long)test_pidns);
  if (private_tmp())
    ASSERT_NE(access(path, F_OK), 0);
}

/* The test's marker in its /dev/shm, which the helpers must not see. */
static void shm_marker(bool make) {
  static const char *const dirs[] = {"/dev/shm", "/tmp"};
  for (int d = 0; d < 2; d++) {
    char path[128];
    snprintf(path, sizeof path, "%s/gpuipc-test-ns-%llu", dirs[d],
             (unsigned long long)gpuipc__pid_namespace());
    if (make) {
      int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
      ASSERT_GE(fd, 0);
      close(fd);
    } else {
      unlink(path);
    }
  }
}

/* ---- handoff across namespaces -------------------------------------------------- */

enum { NBUF = 24, BYTES = 65536 };

/* Sends NBUF arena blocks (mempool), then a mempool, a VMM and a pinned
 * host buffer by descriptor, each filled on our stream
 * just before the send (the importer's reads are ordered after it), and
 * checks that every lease comes back. */
/* One pass of progress: true once the peer is gone (its releases read). */
static bool progress_or_gone(gpuipc_conn *c) {
  gpuipc_status st = gpuipc_conn_progress(c, 1);
  if (st == GPUIPC_E_PEER_GONE)
    return true;
  ASSERT_OK(st);
  return false;
}

static void ho_export(gpuipc_conn *c) {
  CUstream s = mkstream();
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)4 << 20;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  gpuipc_block *b[NBUF];
  for (int i = 0; i < NBUF; i++) {
    ASSERT_OK(gpuipc_arena_alloc(a, BYTES, (struct CUstream_st *)s, &b[i]));
    fill(c, gpuipc_block_get_ptr(b[i]), BYTES, (uint8_t)(0x10 + i), s);
    uint32_t meta = (uint32_t)i;
    ASSERT_OK(gpuipc_conn_send(c, b[i], (struct CUstream_st *)s, &meta,
                               sizeof meta));
  }
  gpuipc_pool_kind kinds[3] = {GPUIPC_POOL_MEMPOOL, GPUIPC_POOL_VMM,
                               GPUIPC_POOL_PINNED_HOST};
  gpuipc_pool *pools[3];
  gpuipc_buffer *bufs[3];
  for (int k = 0; k < 3; k++) {
    gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
    po.kind = kinds[k];
    ASSERT_OK(gpuipc_pool_create(&po, &pools[k]));
    ASSERT_OK(gpuipc_buffer_alloc(pools[k], BYTES, (struct CUstream_st *)s,
                                  &bufs[k]));
    fill(c, gpuipc_buffer_get_ptr(bufs[k]), BYTES, (uint8_t)(0xa0 + k), s);
    uint32_t meta = 100u + (uint32_t)k;
    ASSERT_OK(gpuipc_conn_send_buffer(c, bufs[k], (struct CUstream_st *)s,
                                      &meta, sizeof meta));
  }
  /* Every lease comes back (released on the importer's GPU stream). */
  /* The importer may be gone by the last releases' pass (it closes when
   * it released everything): PEER_GONE then, with the releases taken. */
  bool gone = false;
  for (int i = 0; i < NBUF; i++)
    for (int t = 0; t < 30000 && !gone && gpuipc_block_get_holders(b[i]) > 0;
         t++)
      gone = progress_or_gone(c);
  for (int i = 0; i < NBUF; i++)
    ASSERT_EQ(gpuipc_block_get_holders(b[i]), 0);
  for (int k = 0; k < 3; k++) {
    for (int t = 0;
         t < 30000 && !gone && gpuipc_conn_get_buffer_holders(c, bufs[k]); t++)
      gone = progress_or_gone(c);
    ASSERT_EQ(gpuipc_conn_get_buffer_holders(c, bufs[k]), 0);
  }
  /* The importer says goodbye after its checks. */
  gpuipc_status st;
  do
    st = gpuipc_conn_progress(c, 100);
  while (st == GPUIPC_OK);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_conn_close(c);
  for (int i = 0; i < NBUF; i++)
    ASSERT_OK(gpuipc_block_free(b[i], (struct CUstream_st *)s));
  for (int k = 0; k < 3; k++) {
    ASSERT_OK(gpuipc_buffer_free(bufs[k], (struct CUstream_st *)s));
    ASSERT_OK(gpuipc_pool_destroy(pools[k]));
  }
  ASSERT_OK(gpuipc_arena_destroy(a));
}

HELPER_IMPL(ns_ho_exporter) {
  (void)argc;
  check_contained(argv);
  gpuipc_conn *c = ns_accept(argv[0]);
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  /* The importer is pid 1 of a sibling namespace: not visible here (in
   * mode "ipc", one pid namespace: visible). */
  if (ipc_only(argv))
    ASSERT_GT(pi.pid, 1);
  else
    ASSERT_EQ(pi.pid, 0);
  ho_export(c);
  return 0;
}

HELPER_IMPL(ns_ho_importer) {
  (void)argc;
  check_contained(argv);
  gpuipc_conn *c = ns_connect(argv[0]);
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  if (ipc_only(argv))
    ASSERT_GT(pi.pid, 1);
  else
    ASSERT_EQ(pi.pid, 0); /* the peer is not in our namespace, nor below */
  CUstream s = mkstream();
  for (int i = 0; i < NBUF + 3; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    ASSERT_EQ(r.meta_len, 4);
    uint32_t meta;
    memcpy(&meta, r.meta, 4);
    ASSERT_EQ(r.length, BYTES);
    uint8_t want = meta < 100 ? (uint8_t)(0x10 + meta)
                              : (uint8_t)(0xa0 + meta - 100);
    ASSERT_EQ(meta, i < NBUF ? (uint32_t)i : 100u + (uint32_t)(i - NBUF));
    expect_bytes(r.ptr, BYTES, want, s);
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  }
  gpuipc_conn_close(c);
  return 0;
}

/* Runs an exporter and an importer helper in namespaces of their own;
 * false (ns_why says why) when the kernel refused the namespaces, else
 * their exit statuses. */
static bool run_pair(const char *e, const char *i, const char *mode,
                     int *se, int *si) {
  pid_t pe, pi;
  int ex, im;
  shm_marker(true);
  if (start_pair(e, i, mode, &pe, &pi, &ex, &im) != 0) {
    shm_marker(false);
    return false;
  }
  *si = wait_helper(pi, 90);
  *se = wait_helper(pe, 90);
  close(ex);
  close(im);
  shm_marker(false);
  return true;
}

/* Runs the pair and checks their exit statuses, or skips saying why. */
#define RUN_PAIR(e, i, mode, want_e, want_i)                                   \
  do {                                                                         \
    int se_ = -1, si_ = -1;                                                    \
    if (!run_pair((e), (i), (mode), &se_, &si_))                               \
      SKIP("the kernel refused new namespaces here (%s); these tests need "   \
           "root or CAP_SYS_ADMIN",                                            \
           ns_why);                                                            \
    ASSERT_EQ(si_, (want_i));                                                  \
    ASSERT_EQ(se_, (want_e));                                                  \
  } while (0)

TEST_IMPL(ns_handoff_arena_pool_vmm_pinned) {
  RUN_PAIR("ns_ho_exporter", "ns_ho_importer", "-", 0, 0);
  return 0;
}

/* One pid namespace, separate IPC and mount namespaces: the by-name
 * liveness tables are out of reach, the connection's are not. */
TEST_IMPL(ns_handoff_ipc_only) {
  RUN_PAIR("ns_ho_exporter", "ns_ho_importer", "ipc", 0, 0);
  return 0;
}

/* The exporter is this process; the importer is in a pid namespace below
 * ours: we see its pid (the kernel's translation), it does not see ours. */
TEST_IMPL(ns_handoff_to_child_namespace) {
  gpuipc_conn_options o = ns_opts(harness_tmpdir());
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("ns", &o, &l));
  char ns[32];
  snprintf(ns, sizeof ns, "%llu", (unsigned long long)gpuipc__pid_namespace());
  shm_marker(true);
  int im = -1;
  pid_t pi = spawn_ns("ns_ho_importer", &im, harness_tmpdir(), ns, "-");
  if (pi < 0) {
    gpuipc_listener_close(l);
    shm_marker(false);
    SKIP("the kernel refused new namespaces here (%s); these tests need "
         "root or CAP_SYS_ADMIN",
         ns_why);
  }
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_accept(l, &c));
  gpuipc_listener_close(l);
  gpuipc_peer_info info;
  ASSERT_OK(gpuipc_conn_get_peer(c, &info));
  /* Its pid here: neither 0 nor the pid 1 it has there. */
  ASSERT_GT(info.pid, 1);
  ASSERT_NE(info.pid, pi);
  ho_export(c);
  ASSERT_EQ(wait_helper(pi, 90), 0);
  close(im);
  shm_marker(false);
  return 0;
}

/* ---- stale descriptors across namespaces ---------------------------------------- */

/* Sends (user messages) descriptors with their fds: a live VMM buffer, a
 * freed one, a live pinned host buffer, a freed one, and a legacy one. */
HELPER_IMPL(ns_stale_exporter) {
  (void)argc;
  check_contained(argv);
  gpuipc_conn *c = ns_accept(argv[0]);
  CUstream s = mkstream();
  gpuipc_pool_kind kinds[3] = {GPUIPC_POOL_VMM, GPUIPC_POOL_PINNED_HOST,
                               GPUIPC_POOL_LEGACY};
  for (int k = 0; k < 3; k++) {
    gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
    po.kind = kinds[k];
    gpuipc_pool *pool = NULL;
    ASSERT_OK(gpuipc_pool_create(&po, &pool));
    for (int freed = 0; freed < (k < 2 ? 2 : 1); freed++) {
      gpuipc_buffer *b = NULL;
      ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, (struct CUstream_st *)s, &b));
      fill(c, gpuipc_buffer_get_ptr(b), 4096, (uint8_t)(0x40 + k), s);
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len = 0;
      int fds[GPUIPC_DESC_MAX_FDS], nfds = GPUIPC_DESC_MAX_FDS;
      ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds));
      if (freed)
        ASSERT_OK(gpuipc_buffer_free(b, (struct CUstream_st *)s));
      ASSERT_OK(gpuipc_conn_send_msg(c, d, len, fds, nfds));
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      /* The importer's verdict, before the buffer may go. */
      uint8_t ack[8];
      size_t al = 0;
      ASSERT_OK(gpuipc_conn_recv_msg(c, ack, sizeof ack, &al, NULL, NULL));
      if (!freed)
        ASSERT_OK(gpuipc_buffer_free(b, (struct CUstream_st *)s));
    }
    ASSERT_OK(gpuipc_pool_destroy(pool));
  }
  gpuipc_status st;
  do
    st = gpuipc_conn_progress(c, 100);
  while (st == GPUIPC_OK);
  gpuipc_conn_close(c);
  return 0;
}

static void ack(gpuipc_conn *c) {
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
}

HELPER_IMPL(ns_stale_importer) {
  (void)argc;
  check_contained(argv);
  gpuipc_conn *c = ns_connect(argv[0]);
  CUstream s = mkstream();
  for (int k = 0; k < 3; k++) {
    for (int freed = 0; freed < (k < 2 ? 2 : 1); freed++) {
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len = 0;
      int fds[GPUIPC_DESC_MAX_FDS], nfds = GPUIPC_DESC_MAX_FDS;
      ASSERT_OK(gpuipc_conn_recv_msg(c, d, sizeof d, &len, fds, &nfds));
      gpuipc_buffer *b = NULL;
      /* Outside the connection, a descriptor of another pid namespace is
       * refused whatever its kind. */
      if (!ipc_only(argv))
        ASSERT_STATUS(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b),
                      GPUIPC_E_FOREIGN_NAMESPACE);
      gpuipc_status st = gpuipc_conn_import_buffer(c, d, len, fds, nfds,
                                                   NULL, &b);
      if (k == 2 && !ipc_only(argv)) {
        /* Legacy: refused, saying that it needs one pid namespace. */
        ASSERT_EQ(st, GPUIPC_E_FOREIGN_NAMESPACE);
        ASSERT_STR_CONTAINS(gpuipc_last_error(), "one pid namespace");
      } else if (freed) {
        /* This /dev/shm has no table of the exporter: only the table the
         * connection carried can say the buffer was freed. */
        ASSERT_EQ(st, GPUIPC_E_STALE);
      } else {
        ASSERT_OK(st);
        expect_bytes(gpuipc_buffer_get_ptr(b), 4096, (uint8_t)(0x40 + k), s);
        ASSERT_OK(gpuipc_buffer_close(b));
      }
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      ack(c);
    }
  }
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(ns_stale_descriptor) {
  RUN_PAIR("ns_stale_exporter", "ns_stale_importer", "-", 0, 0);
  return 0;
}

TEST_IMPL(ns_stale_descriptor_ipc_only) {
  RUN_PAIR("ns_stale_exporter", "ns_stale_importer", "ipc", 0, 0);
  return 0;
}

/* ---- peer death across namespaces ----------------------------------------------- */

/* mode "consumer": the importer dies (SIGKILL) holding every block; the
 * exporter gets them all back once its process is gone (told by the
 * pidfd the kernel gave of a peer it cannot see). mode "exporter": the
 * exporter dies while the importer holds its buffers; the importer sees
 * GPUIPC_E_PEER_GONE and its streams never block on the dead peer. */
/* Ends this process at once, without closing anything (no BYE, no
 * release, no destructor). As pid 1 of its namespace it cannot send itself
 * SIGKILL (the kernel ignores signals a namespace's init does not handle,
 * from inside), so it exits the way a killed process looks to its peer. */
static void die(void) { _exit(128 + SIGKILL); }

HELPER_IMPL(ns_death_exporter) {
  (void)argc;
  check_contained(argv);
  bool consumer_dies = strcmp(argv[2], "consumer") == 0;
  gpuipc_conn *c = ns_accept(argv[0]);
  CUstream s = mkstream();
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)1 << 20;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  gpuipc_block *b[8];
  for (int i = 0; i < 8; i++) {
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)s, &b[i]));
    fill(c, gpuipc_block_get_ptr(b[i]), 4096, (uint8_t)i, s);
    ASSERT_OK(gpuipc_conn_send(c, b[i], (struct CUstream_st *)s, NULL, 0));
  }
  if (!consumer_dies) {
    /* Wait until the importer has them all, then die without a word. */
    uint8_t m[8];
    size_t ml = 0;
    ASSERT_OK(gpuipc_conn_recv_msg(c, m, sizeof m, &ml, NULL, NULL));
    die();
  }
  gpuipc_status st = GPUIPC_OK;
  for (int t = 0; t < 3000 && st == GPUIPC_OK; t++)
    st = gpuipc_conn_progress(c, 10);
  ASSERT_EQ(st, GPUIPC_E_PEER_GONE);
  /* The socket closes while the process is still exiting; its leases go
   * once the process is gone (its pidfd says so), which progress checks. */
  gpuipc_arena_stats as = GPUIPC_ARENA_STATS_INIT;
  for (int t = 0; t < 1000; t++) {
    (void)gpuipc_conn_progress(c, 0);
    ASSERT_OK(gpuipc_arena_get_stats(a, &as));
    if (as.leases == 0)
      break;
    usleep(10000);
  }
  ASSERT_EQ(as.leases, 0);
  for (int i = 0; i < 8; i++)
    ASSERT_EQ(gpuipc_block_get_holders(b[i]), 0);
  gpuipc_conn_close(c);
  for (int i = 0; i < 8; i++)
    ASSERT_OK(gpuipc_block_free(b[i], (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

HELPER_IMPL(ns_death_importer) {
  (void)argc;
  check_contained(argv);
  bool consumer_dies = strcmp(argv[2], "consumer") == 0;
  gpuipc_conn *c = ns_connect(argv[0]);
  CUstream s = mkstream();
  gpuipc_received r[8];
  for (int i = 0; i < 8; i++) {
    r[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r[i]));
    expect_bytes(r[i].ptr, 4096, (uint8_t)i, s);
  }
  if (consumer_dies)
    die();
  ASSERT_OK(gpuipc_conn_send_msg(c, "all", 3, NULL, 0));
  gpuipc_status st = GPUIPC_OK;
  for (int t = 0; t < 3000 && st == GPUIPC_OK; t++)
    st = gpuipc_conn_progress(c, 10);
  ASSERT_EQ(st, GPUIPC_E_PEER_GONE);
  /* The held buffers stay readable, and a stream that orders after the
   * gone sender does not wait for ever. */
  for (int i = 0; i < 8; i++) {
    expect_bytes(r[i].ptr, 4096, (uint8_t)i, s);
    ASSERT_OK(gpuipc_conn_release(c, r[i].id, (struct CUstream_st *)s));
  }
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(ns_peer_death_consumer) {
  /* The importer kills itself (status 128 + SIGKILL); the exporter's
   * checks passed (0). */
  RUN_PAIR("ns_death_exporter", "ns_death_importer", "consumer", 0,
           128 + SIGKILL);
  return 0;
}

TEST_IMPL(ns_peer_death_exporter) {
  RUN_PAIR("ns_death_exporter", "ns_death_importer", "exporter",
           128 + SIGKILL, 0);
  return 0;
}

/* ---- a peer that passes a wrong liveness table ---------------------------------- */

static void raw_frame(int sock, int type, const void *p, size_t n,
                      const int *fds, int nfds) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, (uint16_t)nfds, (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  unsigned char buf[256];
  memcpy(buf, &h, sizeof h);
  ASSERT_LE(n, sizeof buf - sizeof h);
  if (n)
    memcpy(buf + sizeof h, p, n);
  struct iovec iov = {buf, sizeof h + n};
  size_t w = 0;
  ASSERT_OK(gpuipc__sock_send(sock, &iov, 1, fds, nfds, true, 0, &w));
  ASSERT_EQ(w, sizeof h + n);
}

/* Reads one frame; false when the other side closed (it refused us). */
static bool raw_read_frame(int sock) {
  gpuipc__frame_hdr h;
  if (recv(sock, &h, sizeof h, MSG_WAITALL) != (ssize_t)sizeof h)
    return false;
  unsigned char buf[512];
  ASSERT_LE(h.len, sizeof buf);
  return h.len == 0 ||
         recv(sock, buf, h.len, MSG_WAITALL) == (ssize_t)h.len;
}

enum {
  BAD_PIPE,
  BAD_DISK_FILE,
  BAD_SIZE,
  BAD_HEADER,
  BAD_KEY0_WITH_FD,
  BAD_KEY_WITHOUT_FD,
  BAD_TWO_FDS,
  BAD_FD_WITH_HELLO,
  BAD_N
};

/* The child's side: a handshake by hand, with the case's LIVE frame. */
static void raw_bad_live_peer(int sock, int which) {
  int one = 1;
  ASSERT_EQ(setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof one), 0);
  gpuipc__hello me;
  memset(&me, 0, sizeof me);
  me.proto = GPUIPC__PROTO_VERSION;
  me.flags = GPUIPC__HELLO_F_NS;
  me.pid = getpid();
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = 16;
  me.start_time = gpuipc__process_start_time(getpid());
  ASSERT_OK(gpuipc__boot_id(me.boot_id));
  me.pidns = gpuipc__pid_namespace();
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  int bad[2] = {-1, -1};
  int nbad = 1;
  uint64_t key = 0x1234;
  switch (which) {
  case BAD_PIPE:
    bad[0] = p[0];
    break;
  case BAD_DISK_FILE:
    bad[0] = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    break;
  case BAD_SIZE:
  case BAD_HEADER:
  case BAD_KEY0_WITH_FD:
  case BAD_TWO_FDS:
    bad[0] = memfd_create("bad-live", MFD_CLOEXEC);
    ASSERT_GE(bad[0], 0);
    /* The size of a real table for all but BAD_SIZE; all zero. */
    ASSERT_EQ(ftruncate(bad[0], which == BAD_SIZE ? 4096
                                                  : (off_t)(64 +
                                                            GPUIPC__LIVE_SLOTS * 8 +
                                                            GPUIPC__LIVE_EXPORTS * 32)),
              0);
    if (which == BAD_KEY0_WITH_FD)
      key = 0;
    if (which == BAD_TWO_FDS) {
      bad[1] = p[1];
      nbad = 2;
    }
    break;
  case BAD_KEY_WITHOUT_FD:
    nbad = 0;
    break;
  case BAD_FD_WITH_HELLO:
    break;
  }
  if (which == BAD_FD_WITH_HELLO)
    raw_frame(sock, GPUIPC__F_HELLO, &me, sizeof me, p, 1);
  else
    raw_frame(sock, GPUIPC__F_HELLO, &me, sizeof me, NULL, 0);
  if (!raw_read_frame(sock)) /* its HELLO */
    return;
  if (which == BAD_FD_WITH_HELLO) {
    /* Refused at our HELLO already: drained below. */
    char sink[256];
    while (recv(sock, sink, sizeof sink, 0) > 0)
      ;
    return;
  }
  raw_frame(sock, GPUIPC__F_ACCEPT, NULL, 0, NULL, 0);
  gpuipc__w_live w = {key};
  raw_frame(sock, GPUIPC__F_LIVE, &w, sizeof w, bad, nbad);
  char sink[256];
  while (recv(sock, sink, sizeof sink, 0) > 0)
    ;
}

TEST_IMPL(ns_hostile_live_table) {
  static const char *want[BAD_N] = {
      "not a regular file",
      "not on tmpfs",
      "size is not a liveness table's",
      "header is not a liveness table's",
      "key 0 and an fd",
      "key set and no fd",
      "unexpected file descriptors",
      "fds",
  };
  int base = harness_count_fds();
  for (int which = 0; which < BAD_N; which++) {
    if (which == BAD_DISK_FILE) {
      /* Only meaningful where the test binary is not itself on tmpfs. */
      struct statfs fs;
      int f = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
      ASSERT_GE(f, 0);
      ASSERT_EQ(fstatfs(f, &fs), 0);
      close(f);
      if (fs.f_type == 0x01021994) {
        printf("case %d skipped: the test binary is on tmpfs\n", which);
        continue;
      }
    }
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(sv[0]);
      raw_bad_live_peer(sv[1], which);
      _exit(0);
    }
    close(sv[1]);
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.timeout_ms = 10000;
    gpuipc_conn *c = NULL;
    gpuipc_status st = gpuipc_conn_from_fd(sv[0], &o, &c);
    printf("case %d: %s: %s\n", which, gpuipc_status_name(st),
           gpuipc_last_error());
    ASSERT_EQ(st, GPUIPC_E_PROTOCOL);
    ASSERT_NULL(c);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), want[which]);
    ASSERT_EQ(wait_helper(pid, 30), 0);
    /* Whatever the peer passed was closed. */
    ASSERT_EQ(harness_count_fds(), base);
  }
  return 0;
}

/* ---- two exporters with one pid ------------------------------------------------- */

/* Mode "twin-live" / "twin-freed": connects to the test's listener, sends a
 * VMM buffer's descriptor and fd in a message (freed first in twin-freed),
 * and waits for the test's word. */
HELPER_IMPL(ns_twin) {
  (void)argc;
  check_contained(argv);
  bool freed = strcmp(argv[2], "twin-freed") == 0;
  gpuipc_conn *c = ns_connect(argv[0]);
  CUstream s = mkstream();
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_VMM;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, (struct CUstream_st *)s, &b));
  fill(c, gpuipc_buffer_get_ptr(b), 4096, freed ? 0x22 : 0x11, s);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[GPUIPC_DESC_MAX_FDS], nfds = GPUIPC_DESC_MAX_FDS;
  ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds));
  if (freed)
    ASSERT_OK(gpuipc_buffer_free(b, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_conn_send_msg(c, d, len, fds, nfds));
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  uint8_t w[8];
  size_t wl = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, w, sizeof w, &wl, NULL, NULL));
  if (!freed)
    ASSERT_OK(gpuipc_buffer_free(b, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  gpuipc_conn_close(c);
  return 0;
}

/* Two exporters, each pid 1 of a pid namespace of its own, probably with
 * the same start time and the same first generation: this importer tells
 * them apart (the pid namespace is part of every identity), checks each
 * one's descriptor against that one's table (one live, one freed), and
 * refuses a descriptor of one that arrives over the other's connection. */
TEST_IMPL(ns_two_exporters_one_pid) {
  gpuipc_conn_options o = ns_opts(harness_tmpdir());
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("ns", &o, &l));
  char ns[32];
  snprintf(ns, sizeof ns, "%llu", (unsigned long long)gpuipc__pid_namespace());
  static const char *const modes[2] = {"twin-live", "twin-freed"};
  pid_t pid[2];
  int hfd[2];
  gpuipc_conn *c[2];
  for (int k = 0; k < 2; k++) {
    pid[k] = spawn_ns("ns_twin", &hfd[k], harness_tmpdir(), ns, modes[k]);
    if (pid[k] < 0) {
      if (k == 1) {
        kill(pid[0], SIGKILL);
        wait_helper(pid[0], 30);
      }
      gpuipc_listener_close(l);
      SKIP("the kernel refused new namespaces here (%s); these tests need "
           "root or CAP_SYS_ADMIN",
           ns_why);
    }
    ASSERT_OK(gpuipc_accept(l, &c[k]));
  }
  gpuipc_listener_close(l);
  uint8_t d[2][GPUIPC_DESC_MAX];
  size_t len[2];
  int fds[2][GPUIPC_DESC_MAX_FDS], nfds[2];
  for (int k = 0; k < 2; k++) {
    nfds[k] = GPUIPC_DESC_MAX_FDS;
    ASSERT_OK(gpuipc_conn_recv_msg(c[k], d[k], sizeof d[k], &len[k], fds[k],
                                   &nfds[k]));
    gpuipc_desc_info di = GPUIPC_DESC_INFO_INIT;
    ASSERT_OK(gpuipc_desc_get_info(d[k], len[k], &di));
    ASSERT_EQ(di.exporter_pid, 1);
    ASSERT(!di.same_namespace);
  }
  CUstream s = mkstream();
  /* Each over its own connection: the live one imports with its data, the
   * freed one is stale. */
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_conn_import_buffer(c[0], d[0], len[0], fds[0], nfds[0],
                                      NULL, &b));
  expect_bytes(gpuipc_buffer_get_ptr(b), 4096, 0x11, s);
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_STATUS(gpuipc_conn_import_buffer(c[1], d[1], len[1], fds[1],
                                          nfds[1], NULL, &b),
                GPUIPC_E_STALE);
  /* Over the other's connection: not that peer's, refused. */
  ASSERT_STATUS(gpuipc_conn_import_buffer(c[1], d[0], len[0], fds[0],
                                          nfds[0], NULL, &b),
                GPUIPC_E_FOREIGN_NAMESPACE);
  ASSERT_STATUS(gpuipc_conn_import_buffer(c[0], d[1], len[1], fds[1],
                                          nfds[1], NULL, &b),
                GPUIPC_E_FOREIGN_NAMESPACE);
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < nfds[k]; i++)
      close(fds[k][i]);
    ASSERT_OK(gpuipc_conn_send_msg(c[k], "ok", 2, NULL, 0));
  }
  for (int k = 0; k < 2; k++) {
    ASSERT_EQ(wait_helper(pid[k], 60), 0);
    gpuipc_conn_close(c[k]);
    close(hfd[k]);
  }
  return 0;
}

/* ---- a peer that truncates its table after the handshake ------------------------ */

/* The child's side: a real pinned host buffer, and a table of its own
 * making (a plain memfd with a real header) that says the buffer is freed;
 * after the test's word it truncates the table to nothing. */
static void raw_truncating_peer(int sock, int go) {
  ctx_current();
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_PINNED_HOST;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &b));
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[GPUIPC_DESC_MAX_FDS], nfds = GPUIPC_DESC_MAX_FDS;
  ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds));
  ASSERT_EQ(nfds, 1);
  gpuipc__desc dd;
  ASSERT_OK(gpuipc__desc_decode(d, len, &dd));
  uint64_t key = 0;
  int real = gpuipc__live_table_fd(&key);
  ASSERT_GE(real, 0);
  uint8_t hdr[64];
  ASSERT_EQ(pread(real, hdr, sizeof hdr, 0), (ssize_t)sizeof hdr);
  close(real);
  int fake = memfd_create("fake-live", MFD_CLOEXEC);
  ASSERT_GE(fake, 0);
  ASSERT_EQ(ftruncate(fake, (off_t)(64 + GPUIPC__LIVE_SLOTS * 8ull +
                                    GPUIPC__LIVE_EXPORTS * 32ull)),
            0);
  ASSERT_EQ(pwrite(fake, hdr, sizeof hdr, 0), (ssize_t)sizeof hdr);
  uint64_t freed = dd.generation | GPUIPC__LIVE_FREED_BIT;
  ASSERT_EQ(pwrite(fake, &freed, 8,
                   (off_t)(64 + (dd.generation % GPUIPC__LIVE_SLOTS) * 8)),
            8);

  int one = 1;
  ASSERT_EQ(setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof one), 0);
  gpuipc__hello me;
  memset(&me, 0, sizeof me);
  me.proto = GPUIPC__PROTO_VERSION;
  me.flags = GPUIPC__HELLO_F_NS;
  me.pid = getpid();
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = 16;
  me.start_time = gpuipc__process_start_time(getpid());
  ASSERT_OK(gpuipc__boot_id(me.boot_id));
  me.pidns = gpuipc__pid_namespace();
  raw_frame(sock, GPUIPC__F_HELLO, &me, sizeof me, NULL, 0);
  ASSERT(raw_read_frame(sock));
  raw_frame(sock, GPUIPC__F_ACCEPT, NULL, 0, NULL, 0);
  gpuipc__w_live w = {key};
  raw_frame(sock, GPUIPC__F_LIVE, &w, sizeof w, &fake, 1);
  /* The same descriptor twice: before and after the truncation. */
  raw_frame(sock, GPUIPC__F_MSG, d, len, fds, 1);
  char c;
  ASSERT_EQ(read(go, &c, 1), 1);
  ASSERT_EQ(ftruncate(fake, 0), 0);
  raw_frame(sock, GPUIPC__F_MSG, d, len, fds, 1);
  char sink[256];
  while (recv(sock, sink, sizeof sink, 0) > 0)
    ;
  ASSERT_OK(gpuipc_buffer_free(b, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));
}

/* The table a connection carried is what decides (it says "freed" of a
 * live buffer, so the import is refused), and once the peer truncates it
 * the import proceeds as "cannot tell": no fault, no crash (it is read
 * with pread, never mapped). */
TEST_IMPL(ns_hostile_table_truncated) {
  REQUIRE_EMULATOR("the forked peer uses the emulator");
  int sv[2], go[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ASSERT_EQ(pipe2(go, O_CLOEXEC), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(sv[0]);
    close(go[1]);
    raw_truncating_peer(sv[1], go[0]);
    _exit(0);
  }
  close(sv[1]);
  close(go[0]);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(sv[0], &o, &c));
  for (int round = 0; round < 2; round++) {
    uint8_t d[GPUIPC_DESC_MAX];
    size_t len = 0;
    int fds[GPUIPC_DESC_MAX_FDS], nfds = GPUIPC_DESC_MAX_FDS;
    ASSERT_OK(gpuipc_conn_recv_msg(c, d, sizeof d, &len, fds, &nfds));
    ASSERT_EQ(nfds, 1);
    gpuipc_buffer *b = NULL;
    gpuipc_status st = gpuipc_conn_import_buffer(c, d, len, fds, nfds, NULL, &b);
    if (round == 0) {
      ASSERT_EQ(st, GPUIPC_E_STALE);
      ASSERT_EQ(write(go[1], "t", 1), 1);
    } else {
      ASSERT_OK(st);
      ASSERT_OK(gpuipc_buffer_close(b));
    }
    close(fds[0]);
  }
  gpuipc_conn_close(c);
  close(go[1]);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* A peer of another protocol version is refused (GPUIPC_E_BAD_VERSION)
 * with both numbers, not
 * misread (a version-1 peer would take a buffer sent without signals for
 * an ordered one and wait for ever). Needs no namespace. */
TEST_IMPL(conn_refuses_another_protocol_version) {
  static const uint32_t versions[] = {1, GPUIPC__PROTO_VERSION + 1};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(versions); i++) {
    int sv[2];
    ASSERT_OK(gpuipc_conn_pair(sv));
    gpuipc__hello me;
    memset(&me, 0, sizeof me);
    me.proto = versions[i];
    me.pid = getpid();
    me.uid = geteuid();
    me.gid = getegid();
    me.max_outstanding = 16;
    me.start_time = gpuipc__process_start_time(getpid());
    ASSERT_OK(gpuipc__boot_id(me.boot_id));
    raw_frame(sv[1], GPUIPC__F_HELLO, &me, sizeof me, NULL, 0);
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.timeout_ms = 5000;
    gpuipc_conn *c = NULL;
    ASSERT_STATUS(gpuipc_conn_from_fd(sv[0], &o, &c), GPUIPC_E_BAD_VERSION);
    ASSERT_NULL(c);
    char want[64];
    snprintf(want, sizeof want, "protocol version %u", versions[i]);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), want);
    close(sv[1]);
  }
  return 0;
}

/* A peer in our pid namespace that says it is of another one is refused
 * (/proc shows its namespace): it could otherwise pose as a process of
 * another container. Needs no namespace. */
TEST_IMPL(conn_refuses_a_false_pid_namespace) {
  int sv[2];
  ASSERT_OK(gpuipc_conn_pair(sv));
  gpuipc__hello me;
  memset(&me, 0, sizeof me);
  me.proto = GPUIPC__PROTO_VERSION;
  me.flags = GPUIPC__HELLO_F_NS;
  me.pid = getpid();
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = 16;
  me.start_time = gpuipc__process_start_time(getpid());
  ASSERT_OK(gpuipc__boot_id(me.boot_id));
  me.pidns = gpuipc__pid_namespace() + 1;
  raw_frame(sv[1], GPUIPC__F_HELLO, &me, sizeof me, NULL, 0);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 5000;
  gpuipc_conn *c = NULL;
  ASSERT_STATUS(gpuipc_conn_from_fd(sv[0], &o, &c), GPUIPC_E_PEER_REFUSED);
  ASSERT_NULL(c);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "which /proc does not show");
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "pid namespace");
  close(sv[1]);
  return 0;
}

/* ---- keep until released across namespaces --------------------------------------- */

/* A buffer handed over (gpuipc_buffer_release_when_done) and sent
 * to a peer whose pid reads 0 here (a sibling pid namespace), then the
 * connection closed here while the peer holds it: the buffer is kept (its
 * done callback not called) while the peer lives, and is done once its
 * process is gone, told by the pidfd the kernel gave of the socket's
 * peer, with no call of ours (the peer watcher). */
static atomic_int ns_keep_calls;
static void ns_keep_done(void *ctx) {
  (void)ctx;
  atomic_fetch_add(&ns_keep_calls, 1);
}

HELPER_IMPL(ns_keep_exporter) {
  (void)argc;
  check_contained(argv);
  gpuipc_conn *c = ns_accept(argv[0]);
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.pid, 0); /* the peer is not in our namespace, nor below */
  CUstream s = mkstream();
  /* Pool memory (a legacy handle does not open across pid namespaces). */
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_MEMPOOL;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 65536, (struct CUstream_st *)s, &b));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(
      (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b), 0x5a, 65536, s));
  ASSERT_OK(gpuipc_conn_send_buffer(c, b, (struct CUstream_st *)s, NULL, 0));
  ASSERT_OK(gpuipc_buffer_release_when_done(b, (struct CUstream_st *)s,
                                            ns_keep_done, NULL));
  uint8_t m[8];
  size_t ml = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, m, sizeof m, &ml, NULL, NULL));
  ASSERT_EQ(ml, 4); /* "held" */
  gpuipc_conn_close(c);
  ASSERT(gpuipc_conn_collect() >= 1);
  ASSERT_EQ(atomic_load(&ns_keep_calls), 0);
  harness_send_u64(harness_helper_fd(), 2); /* closed, still kept */
  ASSERT_UEQ(harness_recv_u64(harness_helper_fd()), 3); /* the peer died */
  for (int i = 0; i < 3000 && atomic_load(&ns_keep_calls) == 0; i++)
    usleep(10000);
  ASSERT_EQ(atomic_load(&ns_keep_calls), 1);
  (void)gpuipc_conn_collect();
  ASSERT_EQ(atomic_load(&ns_keep_calls), 1);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  /* The buffer was freed when it was done: the pool is not busy. */
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

HELPER_IMPL(ns_keep_importer) {
  (void)argc;
  check_contained(argv);
  gpuipc_conn *c = ns_connect(argv[0]);
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  expect_bytes(r.ptr, 65536, 0x5a, s);
  ASSERT_OK(gpuipc_conn_send_msg(c, "held", 4, NULL, 0));
  /* Holds it, whatever the exporter does, until told to die. */
  ASSERT_UEQ(harness_recv_u64(harness_helper_fd()), 9);
  die();
  return 0;
}

TEST_IMPL(ns_keep_until_peer_gone) {
  pid_t pe, pi;
  int ex, im;
  shm_marker(true);
  if (start_pair("ns_keep_exporter", "ns_keep_importer", "-", &pe, &pi, &ex,
                 &im) != 0) {
    shm_marker(false);
    SKIP("the kernel refused new namespaces here (%s); this test needs "
         "root or CAP_SYS_ADMIN",
         ns_why);
  }
  ASSERT_UEQ(harness_recv_u64(ex), 2); /* closed there, the buffer kept */
  harness_send_u64(im, 9);
  ASSERT_EQ(wait_helper(pi, 90), 128 + SIGKILL);
  harness_send_u64(ex, 3);
  ASSERT_EQ(wait_helper(pe, 90), 0);
  close(ex);
  close(im);
  shm_marker(false);
  return 0;
}

/* ---- what the driver itself answers across pid namespaces ------------------------ */

/* The raw handles this test sends a namespaced helper, and its answers. */
typedef struct raw_handles {
  CUipcMemHandle mem;
  CUipcEventHandle ev;
  uint8_t byte; /* what the memory holds */
} raw_handles;

typedef struct raw_answers {
  int32_t open_mem;  /* cuIpcOpenMemHandle */
  int32_t data_ok;   /* 1: the byte read matched (when it opened) */
  int32_t open_ev;   /* cuIpcOpenEventHandle */
  int32_t sync_ev;   /* cuEventSynchronize of the opened event */
} raw_answers;

static int read_all(int fd, void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)p + got, n - got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    got += (size_t)r;
  }
  return 0;
}

/* Opens a legacy memory handle and an interprocess event handle of the
 * test (which is not in its pid namespace, or is, in mode "ipc") with the
 * driver directly, and says what the driver answered. */
HELPER_IMPL(ns_raw_opener) {
  (void)argc;
  check_contained(argv);
  int fd = harness_helper_fd();
  raw_handles h;
  ASSERT_EQ(read_all(fd, &h, sizeof h), 0);
  ctx_current();
  raw_answers a = {0, 0, 0, 0};
  CUdeviceptr p = 0;
  a.open_mem = (int32_t)gpuipc__cu.cuIpcOpenMemHandle(
      &p, h.mem, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (a.open_mem == CUDA_SUCCESS) {
    uint8_t b = 0;
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(&b, p, 1));
    a.data_ok = b == h.byte;
    ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(p));
  }
  CUevent e = NULL;
  a.open_ev = (int32_t)gpuipc__cu.cuIpcOpenEventHandle(&e, h.ev);
  if (a.open_ev == CUDA_SUCCESS) {
    a.sync_ev = (int32_t)gpuipc__cu.cuEventSynchronize(e);
    ASSERT_CU(gpuipc__cu.cuEventDestroy(e));
  }
  ASSERT_EQ(write(fd, &a, sizeof a), (ssize_t)sizeof a);
  return 0;
}

static int raw_answers_in(const char *mode) {
  REQUIRE_DEVICES(1);
  ctx_current();
  CUdeviceptr d;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, 65536));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(d, 0x5C, 65536));
  raw_handles h;
  memset(&h, 0, sizeof h);
  h.byte = 0x5C;
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&h.mem, d));
  CUevent e;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&e, CU_EVENT_INTERPROCESS |
                                             CU_EVENT_DISABLE_TIMING));
  ASSERT_CU(gpuipc__cu.cuEventRecord(e, NULL));
  ASSERT_CU(gpuipc__cu.cuIpcGetEventHandle(&h.ev, e));
  char ns[32];
  snprintf(ns, sizeof ns, "%llu", (unsigned long long)gpuipc__pid_namespace());
  shm_marker(true);
  int fd = -1;
  pid_t pid = spawn_ns("ns_raw_opener", &fd, harness_tmpdir(), ns, mode);
  if (pid < 0) {
    shm_marker(false);
    SKIP("the kernel refused new namespaces here (%s); these tests need "
         "root or CAP_SYS_ADMIN",
         ns_why);
  }
  ASSERT_EQ(write(fd, &h, sizeof h), (ssize_t)sizeof h);
  raw_answers a;
  ASSERT_EQ(read_all(fd, &a, sizeof a), 0);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(fd);
  shm_marker(false);
  printf("driver: %s, importer in %s\n",
         harness_on_emulator() ? "the emulator" : "a real driver",
         strcmp(mode, "ipc") == 0 ? "the same pid namespace, other IPC and "
                                    "mount namespaces"
                                  : "another pid namespace (pid 1 there)");
  printf("  cuIpcOpenMemHandle: %s%s\n", gpuipc__cuda_error_name(a.open_mem),
         a.open_mem == CUDA_SUCCESS ? (a.data_ok ? " (the data read back)"
                                                 : " (the data DIFFERS)")
                                    : "");
  printf("  cuIpcOpenEventHandle: %s", gpuipc__cuda_error_name(a.open_ev));
  if (a.open_ev == CUDA_SUCCESS)
    printf(" (cuEventSynchronize: %s)", gpuipc__cuda_error_name(a.sync_ev));
  printf("\n");
  /* What the driver answers is recorded, not prescribed; memory it lets
   * open must be the memory. */
  if (a.open_mem == CUDA_SUCCESS)
    ASSERT_EQ(a.data_ok, 1);
  ASSERT_CU(gpuipc__cu.cuEventDestroy(e));
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  return 0;
}

/* The driver's own answers (docs/driver-behaviour.md records them) for a
 * legacy memory handle and an interprocess event handle opened in another
 * pid namespace, and in the same pid namespace with other IPC and mount
 * namespaces. */
TEST_IMPL(ns_driver_legacy_and_event_other_pid_namespace) {
  return raw_answers_in("-");
}

TEST_IMPL(ns_driver_legacy_and_event_other_ipc_namespace) {
  return raw_answers_in("ipc");
}
