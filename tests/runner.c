/*
 * runner.c: the harness's main and its process helpers. See harness.h.
 *
 *   gpuipc-tests               runs every test in this process, one by one
 *                              (each in a child, so one crash cannot hide
 *                              the others)
 *   gpuipc-tests NAME          runs one test
 *   gpuipc-tests --list        prints the test names
 *   gpuipc-tests --helper NAME [ARGS...]   (used by spawn_helper)
 */
#include "harness.h"

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;
const char *gpuipc__cuda_error_name(int curesult);

#define MAX_ENTRIES 1024
struct entry {
  const char *name;
  harness_test_fn test;
  harness_helper_fn helper;
};
static struct entry tests[MAX_ENTRIES], helpers[MAX_ENTRIES];
static int ntests, nhelpers;
static int helper_fd = -1;
static char tmpdir[256];

void harness_register_test(const char *name, harness_test_fn fn) {
  if (ntests < MAX_ENTRIES)
    tests[ntests++] = (struct entry){name, fn, NULL};
}
void harness_register_helper(const char *name, harness_helper_fn fn) {
  if (nhelpers < MAX_ENTRIES)
    helpers[nhelpers++] = (struct entry){name, NULL, fn};
}

void harness_fail(const char *file, int line, const char *fmt, ...) {
  fflush(stdout);
  fprintf(stderr, "%s:%d: [pid %d] ", file, line, (int)getpid());
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n");
  fflush(stderr);
  exit(1);
}

const char *harness_cuda_error_name(int r) { return gpuipc__cuda_error_name(r); }

bool harness_on_emulator(void) {
  const char *d = getenv("GPUIPC_CUDA_DRIVER");
  return d != NULL && strstr(d, "cuda-emu") != NULL;
}

const char *harness_emulator_path(void) {
#ifdef GPUIPC_EMU_PATH
  return GPUIPC_EMU_PATH;
#else
  return "";
#endif
}

int harness_helper_fd(void) { return helper_fd; }

static char **build_env(char *const extra[]) {
  size_t n = 0, m = 0;
  while (environ[n])
    n++;
  if (extra)
    while (extra[m])
      m++;
  char **env = calloc(n + m + 2, sizeof *env);
  ASSERT_NOT_NULL(env);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    bool overridden = false;
    for (size_t j = 0; j < m; j++) {
      const char *eq = strchr(extra[j], '=');
      size_t len = eq ? (size_t)(eq - extra[j]) : strlen(extra[j]);
      if (strncmp(environ[i], extra[j], len) == 0 && environ[i][len] == '=')
        overridden = true;
    }
    if (!overridden && strncmp(environ[i], "GPUIPC_TEST_HELPER_FD=", 22) != 0)
      env[k++] = environ[i];
  }
  for (size_t j = 0; j < m; j++) {
    const char *eq = strchr(extra[j], '=');
    if (eq && eq[1] != '\0')
      env[k++] = extra[j];
  }
  env[k] = NULL;
  return env;
}

/* The path of this binary, for argv[0] of the processes it re-executes
 * (set once, by main): their command lines, and so their stats segments,
 * name the build they belong to, which runtime_dir_untouched
 * (harness-runtime.c) relies on. */
static char self_path[4096] = "/proc/self/exe";

static void self_path_init(void) {
  char path[sizeof self_path];
  ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n > 0) {
    path[n] = '\0';
    memcpy(self_path, path, (size_t)n + 1);
  }
}

pid_t spawn_helper(const char *name, char *const env[], int *fd, ...) {
  char *argv[64];
  int argc = 0;
  argv[argc++] = self_path;
  argv[argc++] = "--helper";
  argv[argc++] = (char *)name;
  va_list ap;
  va_start(ap, fd);
  char *a;
  while ((a = va_arg(ap, char *)) != NULL && argc < 62)
    argv[argc++] = a;
  va_end(ap);
  argv[argc] = NULL;

  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  char *extra[66];
  int ne = 0;
  static char fdvar[] = "GPUIPC_TEST_HELPER_FD=3";
  extra[ne++] = fdvar;
  if (env)
    for (int i = 0; env[i] && ne < 64; i++)
      extra[ne++] = env[i];
  extra[ne] = NULL;
  char **envp = build_env(extra);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, sv[1], 3);
  pid_t pid;
  int rc = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  free(envp);
  close(sv[1]);
  if (rc != 0)
    harness_fail(__FILE__, __LINE__, "posix_spawn helper %s: %s", name,
                 strerror(rc));
  if (fd)
    *fd = sv[0];
  else
    close(sv[0]);
  return pid;
}

int wait_helper(pid_t pid, int timeout_s) {
  uint64_t deadline = (uint64_t)time(NULL) + (uint64_t)timeout_s;
  for (;;) {
    int st = 0;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(st))
        return WEXITSTATUS(st);
      if (WIFSIGNALED(st))
        return 128 + WTERMSIG(st);
      continue;
    }
    if (r < 0 && errno != EINTR)
      harness_fail(__FILE__, __LINE__, "waitpid(%d): %s", (int)pid,
                   strerror(errno));
    if ((uint64_t)time(NULL) > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      harness_fail(__FILE__, __LINE__, "helper %d did not exit within %d s",
                   (int)pid, timeout_s);
    }
    usleep(2000);
  }
}

static void write_all(int sock, const void *buf, size_t len, const int *fds,
                      int nfds) {
  const char *p = buf;
  bool first = true;
  while (len > 0 || first) {
    struct iovec iov = {(void *)p, len};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    char cbuf[CMSG_SPACE(sizeof(int) * 16)];
    if (first && nfds > 0) {
      ASSERT_LE(nfds, 16);
      memset(cbuf, 0, sizeof cbuf);
      mh.msg_control = cbuf;
      mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
      struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
      memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t w = sendmsg(sock, &mh, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0)
      harness_fail(__FILE__, __LINE__, "sendmsg: %s", strerror(errno));
    first = false;
    p += w;
    len -= (size_t)w;
  }
}

void harness_send(int sock, const void *buf, size_t len, const int *fds,
                  int nfds) {
  uint64_t n = len;
  write_all(sock, &n, sizeof n, fds, nfds);
  if (len)
    write_all(sock, buf, len, NULL, 0);
}

static ssize_t read_full(int sock, void *buf, size_t len, int *fds, int *nfds) {
  char *p = buf;
  size_t got = 0;
  int cap = nfds ? *nfds : 0;
  if (nfds)
    *nfds = 0;
  while (got < len) {
    struct iovec iov = {p + got, len - got};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    char cbuf[CMSG_SPACE(sizeof(int) * 16)];
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t r = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      harness_fail(__FILE__, __LINE__, "recvmsg: %s", strerror(errno));
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        int tmp[16];
        memcpy(tmp, CMSG_DATA(c), sizeof(int) * (size_t)k);
        for (int i = 0; i < k; i++) {
          if (nfds && *nfds < cap)
            fds[(*nfds)++] = tmp[i];
          else
            close(tmp[i]);
        }
      }
    }
    if (r == 0) {
      if (got == 0)
        return -1;
      harness_fail(__FILE__, __LINE__, "peer closed mid-message");
    }
    got += (size_t)r;
  }
  return (ssize_t)got;
}

ssize_t harness_recv(int sock, void *buf, size_t cap, int *fds, int *nfds) {
  uint64_t n = 0;
  if (read_full(sock, &n, sizeof n, fds, nfds) < 0)
    return -1;
  if (n > cap)
    harness_fail(__FILE__, __LINE__, "message of %llu bytes > %zu",
                 (unsigned long long)n, cap);
  if (n)
    read_full(sock, buf, (size_t)n, NULL, NULL);
  return (ssize_t)n;
}

void harness_send_u64(int sock, uint64_t v) { harness_send(sock, &v, sizeof v, NULL, 0); }
uint64_t harness_recv_u64(int sock) {
  uint64_t v = 0;
  ssize_t n = harness_recv(sock, &v, sizeof v, NULL, NULL);
  if (n != (ssize_t)sizeof v)
    harness_fail(__FILE__, __LINE__, "expected a u64 message, got %zd bytes", n);
  return v;
}

int harness_count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  ASSERT_NOT_NULL(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

static __thread size_t fail_min, fail_max;
static __thread int fail_count, fail_done;

int harness_fail_allocs(size_t min, size_t max, int count) {
  int done = fail_done;
  fail_min = min;
  fail_max = max;
  fail_count = count;
  fail_done = 0;
  return done;
}

/* Failure by call count (faultsim): the nth allocation of this thread
 * after arming fails, and with persist every one after it. */
static __thread harness_alloc_state nth;

harness_alloc_state *harness_alloc(void) { return &nth; }

void harness_alloc_arm(long n, int persist) {
  nth.left = n;
  nth.persist = persist;
  nth.failing = 0;
  nth.hits = 0;
}

long harness_alloc_disarm(void) {
  nth.left = 0;
  nth.failing = 0;
  return nth.hits;
}

static bool alloc_fails(size_t n) {
  if (nth.failing || (nth.left > 0 && --nth.left == 0)) {
    nth.hits++;
    nth.failing = nth.persist;
    errno = ENOMEM;
    return true;
  }
  if (fail_count > 0 && n >= fail_min && n <= fail_max) {
    fail_count--;
    fail_done++;
    errno = ENOMEM;
    return true;
  }
  return false;
}

/* The test binary is linked with --wrap for these (cmake/tests.cmake): the
 * library's objects and the tests allocate through them. */
void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
char *__wrap_strdup(const char *s);
void *__wrap_malloc(size_t n) { return alloc_fails(n) ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t k, size_t n) {
  return alloc_fails(k * n) ? NULL : __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n) {
  return alloc_fails(n) ? NULL : __real_realloc(p, n);
}
char *__wrap_strdup(const char *s) {
  return alloc_fails(strlen(s) + 1) ? NULL : __real_strdup(s);
}

static int rm_cb(const char *p, const struct stat *s, int f, struct FTW *w) {
  (void)s;
  (void)f;
  (void)w;
  return remove(p);
}
static pid_t tmpdir_owner;
static void rm_tmpdir(void) {
  if (tmpdir[0] && getpid() == tmpdir_owner)
    nftw(tmpdir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

const char *harness_tmpdir(void) {
  if (tmpdir[0] == '\0') {
    const char *base = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/gpuipc-test-XXXXXX",
             base && *base ? base : "/tmp");
    ASSERT_NOT_NULL(mkdtemp(tmpdir));
    tmpdir_owner = getpid();
    atexit(rm_tmpdir);
  }
  return tmpdir;
}

int harness_run(char *const argv[], char *const env[], char *out, size_t cap) {
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  char **envp = build_env(env);
  pid_t pid;
  int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  free(envp);
  close(p[1]);
  if (rc != 0)
    harness_fail(__FILE__, __LINE__, "spawn %s: %s", argv[0], strerror(rc));
  size_t got = 0;
  for (;;) {
    char tmp[4096];
    ssize_t r = read(p[0], tmp, sizeof tmp);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    size_t k = (size_t)r;
    if (out && got + 1 < cap) {
      if (k > cap - 1 - got)
        k = cap - 1 - got;
      memcpy(out + got, tmp, k);
      got += k;
    }
  }
  if (out && cap)
    out[got] = '\0';
  close(p[0]);
  return wait_helper(pid, 120);
}

/* A test and the helpers and programs it starts keep their stats segments
 * and sockets in a runtime directory of its own, inside its temporary
 * directory and removed with it: never in the user's
 * ($XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-<uid>), where `gpuipc ls`
 * would list what a killed helper left. The tests of the runtime
 * directory itself set XDG_RUNTIME_DIR again. The CTest case
 * runtime_dir_untouched (harness-runtime.c) checks that a run left
 * nothing in the user's. */
static void private_runtime_dir(void) {
  char dir[sizeof tmpdir + 16];
  snprintf(dir, sizeof dir, "%s/runtime", harness_tmpdir());
  ASSERT_EQ(mkdir(dir, 0700), 0);
  ASSERT_EQ(setenv("XDG_RUNTIME_DIR", dir, 1), 0);
}

static int run_one(const struct entry *t) {
  private_runtime_dir();
  int r = t->test();
  fflush(stdout);
  return r;
}

/* A crash of a test or helper says where: the signal, the thread and a
 * backtrace (module+offset; addr2line -e MODULE OFFSET names the line).
 * Sanitizer builds keep their own, better reports. */
static void crash_report(int sig) {
  char head[96];
  int n = snprintf(head, sizeof head, "crash: signal %d in pid %d, thread %ld\n",
                   sig, (int)getpid(), (long)gettid());
  if (n > 0 && write(2, head, (size_t)n) < 0)
    _exit(128 + sig);
  void *frames[48];
  int nf = backtrace(frames, 48);
  backtrace_symbols_fd(frames, nf, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

static void crash_reporter_install(void) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
  return;
#endif
#endif
  void *warm[1];
  (void)backtrace(warm, 1); /* loads libgcc before any crash */
  static const int sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
    signal(sigs[i], crash_report);
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  crash_reporter_install();
  self_path_init();
  const char *hfd = getenv("GPUIPC_TEST_HELPER_FD");
  if (hfd)
    helper_fd = atoi(hfd);

  if (argc >= 2 && strcmp(argv[1], "--list") == 0) {
    for (int i = 0; i < ntests; i++)
      printf("%s\n", tests[i].name);
    return 0;
  }
  if (argc >= 3 && strcmp(argv[1], "--helper") == 0) {
    for (int i = 0; i < nhelpers; i++)
      if (strcmp(helpers[i].name, argv[2]) == 0) {
        int r = helpers[i].helper(argc - 3, argv + 3);
        fflush(stdout);
        return r;
      }
    fprintf(stderr, "no helper named %s\n", argv[2]);
    return 2;
  }
  if (argc >= 2) {
    for (int i = 0; i < ntests; i++)
      if (strcmp(tests[i].name, argv[1]) == 0)
        return run_one(&tests[i]);
    fprintf(stderr, "no test named %s\n", argv[1]);
    return 2;
  }
  /* No argument: run all, each in its own process. */
  int failed = 0, skipped = 0;
  for (int i = 0; i < ntests; i++) {
    char *args[] = {self_path, (char *)tests[i].name, NULL};
    pid_t pid;
    if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ) != 0)
      return 1;
    int st = wait_helper(pid, 600);
    const char *verdict = st == 0 ? "ok" : st == TEST_SKIP ? "skipped" : "FAILED";
    if (st == TEST_SKIP)
      skipped++;
    else if (st != 0)
      failed++;
    printf("%-4d %-50s %s\n", i + 1, tests[i].name, verdict);
  }
  printf("%d tests, %d failed, %d skipped\n", ntests, failed, skipped);
  return failed ? 1 : 0;
}
