/*
 * test-core.c: the foundation: status codes and their strings, the
 * per-thread error detail, logging, driver loading (none, missing, not a
 * driver), the fork guard, versions and UUID text.
 */
#include "harness.h"
#include "tree.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

TEST_IMPL(core_version) {
  ASSERT_EQ(gpuipc_version(), GPUIPC_VERSION_HEX);
  ASSERT_EQ(gpuipc_version() >> 16, GPUIPC_VERSION_MAJOR);
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", GPUIPC_VERSION_MAJOR,
           GPUIPC_VERSION_MINOR, GPUIPC_VERSION_PATCH);
  ASSERT_STR_EQ(gpuipc_version_string(), want);
  return 0;
}

TEST_IMPL(core_status_strings) {
  /* Every code has its own text and name; codes are dense from 0. */
  ASSERT_EQ(GPUIPC_OK, 0);
  for (int s = 0; s < GPUIPC__STATUS_END; s++) {
    const char *text = gpuipc_strerror((gpuipc_status)s);
    const char *name = gpuipc_status_name((gpuipc_status)s);
    ASSERT(strcmp(text, "unknown status") != 0);
    ASSERT(strncmp(name, "GPUIPC_", 7) == 0);
    for (int t = 0; t < s; t++) {
      ASSERT(strcmp(text, gpuipc_strerror((gpuipc_status)t)) != 0);
      ASSERT(strcmp(name, gpuipc_status_name((gpuipc_status)t)) != 0);
    }
  }
  ASSERT_STR_EQ(gpuipc_status_name(GPUIPC_E_NO_DRIVER), "GPUIPC_E_NO_DRIVER");
  ASSERT_STR_EQ(gpuipc_strerror((gpuipc_status)GPUIPC__STATUS_END),
                "unknown status");
  ASSERT_STR_EQ(gpuipc_strerror((gpuipc_status)-1), "unknown status");
  /* Codes are only ever appended: the first ones keep their numbers. */
  ASSERT_EQ(GPUIPC_E_INVALID_ARG, 1);
  ASSERT_EQ(GPUIPC_E_NO_DRIVER, 3);
  ASSERT_EQ(GPUIPC_E_FORKED, 5);
  ASSERT_EQ(GPUIPC_E_PEER_GONE, 21);
  return 0;
}

static void *other_thread_error(void *arg) {
  (void)arg;
  /* A fresh thread starts with an empty message. */
  if (gpuipc_last_error()[0] != '\0')
    return (void *)1;
  gpuipc_uuid u;
  if (gpuipc_uuid_parse("not-a-uuid-in-thread", &u) != GPUIPC_E_INVALID_ARG)
    return (void *)2;
  return NULL;
}

TEST_IMPL(core_last_error_is_per_thread) {
  ASSERT_STR_EQ(gpuipc_last_error(), "");
  gpuipc_uuid u;
  ASSERT_STATUS(gpuipc_uuid_parse("bogus", &u), GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "'bogus' is not a device UUID");
  pthread_t t;
  void *ret = (void *)99;
  ASSERT_EQ(pthread_create(&t, NULL, other_thread_error, NULL), 0);
  ASSERT_EQ(pthread_join(t, &ret), 0);
  ASSERT_PTR_EQ(ret, NULL);
  /* The other thread's failure did not touch ours. */
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "'bogus'");
  ASSERT(strstr(gpuipc_last_error(), "in-thread") == NULL);
  return 0;
}

TEST_IMPL(core_uuid_text) {
  gpuipc_uuid u, v;
  for (int i = 0; i < 16; i++)
    u.bytes[i] = (uint8_t)(i * 17 + 3);
  char text[GPUIPC_UUID_STRLEN];
  gpuipc_uuid_format(&u, text);
  ASSERT_EQ(strlen(text), GPUIPC_UUID_STRLEN - 1);
  ASSERT_STR_EQ(text, "GPU-03142536-4758-697a-8b9c-adbecfe0f102");
  ASSERT_OK(gpuipc_uuid_parse(text, &v));
  ASSERT_MEM_EQ(u.bytes, v.bytes, 16);
  ASSERT_OK(gpuipc_uuid_parse(text + 4, &v)); /* prefix optional */
  ASSERT_MEM_EQ(u.bytes, v.bytes, 16);
  ASSERT_STATUS(gpuipc_uuid_parse("GPU-0314", &v), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_uuid_parse("GPU-03142536-4758-697a-8b9c-adbecfe0f102ff", &v),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_uuid_parse("GPU-0314253x-4758-697a-8b9c-adbecfe0f102", &v),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_uuid_parse(NULL, &v), GPUIPC_E_INVALID_ARG);
  return 0;
}

static size_t read_file(const char *path, char *buf, size_t cap) {
  int fd = open(path, O_RDONLY);
  if (fd < 0)
    return 0;
  ssize_t n = read(fd, buf, cap - 1);
  close(fd);
  if (n < 0)
    n = 0;
  buf[n] = '\0';
  return (size_t)n;
}

TEST_IMPL(core_log_file_and_levels) {
  char tmpl[512], path[512];
  snprintf(tmpl, sizeof tmpl, "%s/log-%%p.txt", harness_tmpdir());
  snprintf(path, sizeof path, "%s/log-%d.txt", harness_tmpdir(), (int)getpid());
  ASSERT_EQ(setenv("GPUIPC_LOG_FILE", tmpl, 1), 0);
  ASSERT_EQ(setenv("GPUIPC_LOG", "debug", 1), 0);
  ASSERT_EQ(gpuipc_log_get_level(), GPUIPC_LOG_DEBUG);

  /* A failure is logged at debug level with the standard prefix. */
  gpuipc_uuid u;
  ASSERT_STATUS(gpuipc_uuid_parse("first-message", &u), GPUIPC_E_INVALID_ARG);
  char buf[8192];
  ASSERT_GT(read_file(path, buf, sizeof buf), 0);
  char host[64] = "";
  gethostname(host, sizeof host - 1);
  char *dot = strchr(host, '.');
  if (dot)
    *dot = '\0';
  char prefix[160];
  snprintf(prefix, sizeof prefix, "%s:%d:", host, (int)getpid());
  ASSERT(strncmp(buf, prefix, strlen(prefix)) == 0);
  ASSERT_STR_CONTAINS(buf, " gpuipc DEBUG [error] ");
  ASSERT_STR_CONTAINS(buf, "first-message");
  ASSERT_EQ(buf[strlen(buf) - 1], '\n');

  /* Below the threshold nothing is written. */
  gpuipc_log_set_level(GPUIPC_LOG_ERROR);
  ASSERT_EQ(gpuipc_log_get_level(), GPUIPC_LOG_ERROR);
  ASSERT_STATUS(gpuipc_uuid_parse("second-message", &u), GPUIPC_E_INVALID_ARG);
  read_file(path, buf, sizeof buf);
  ASSERT(strstr(buf, "second-message") == NULL);

  gpuipc_log_set_level(GPUIPC_LOG_TRACE);
  ASSERT_STATUS(gpuipc_uuid_parse("third-message", &u), GPUIPC_E_INVALID_ARG);
  read_file(path, buf, sizeof buf);
  ASSERT_STR_CONTAINS(buf, "third-message");
  return 0;
}

HELPER_IMPL(log_level_from_env) {
  (void)argc;
  (void)argv;
  printf("%d\n", (int)gpuipc_log_get_level());
  return 0;
}

TEST_IMPL(core_log_level_env) {
  static const struct {
    const char *value;
    int want;
  } cases[] = {{"error", GPUIPC_LOG_ERROR}, {"warn", GPUIPC_LOG_WARN},
               {"info", GPUIPC_LOG_INFO},   {"debug", GPUIPC_LOG_DEBUG},
               {"TRACE", GPUIPC_LOG_TRACE}, {"nonsense", GPUIPC_LOG_WARN},
               {"", GPUIPC_LOG_WARN}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char var[64], out[64];
    snprintf(var, sizeof var, "GPUIPC_LOG=%s", cases[i].value);
    char *env[] = {var, NULL};
    char *args[] = {"/proc/self/exe", "--helper", "log_level_from_env", NULL};
    ASSERT_EQ(harness_run(args, env, out, sizeof out), 0);
    ASSERT_EQ(atoi(out), cases[i].want);
  }
  return 0;
}

TEST_IMPL(core_no_driver_missing_file) {
  ASSERT_EQ(setenv("GPUIPC_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1), 0);
  ASSERT_STATUS(gpuipc_init(), GPUIPC_E_NO_DRIVER);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "no CUDA driver");
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "/nonexistent/libcuda.so.1");
  /* Every call that needs the driver says so, again and again. */
  int n = -1;
  ASSERT_STATUS(gpuipc_device_count(&n), GPUIPC_E_NO_DRIVER);
  ASSERT_EQ(n, -1);
  ASSERT_STATUS(gpuipc_driver_version(&n), GPUIPC_E_NO_DRIVER);
  gpuipc_uuid u;
  memset(&u, 0, sizeof u);
  ASSERT_STATUS(gpuipc_device_uuid(0, &u), GPUIPC_E_NO_DRIVER);
  ASSERT_STATUS(gpuipc_device_from_uuid(&u, &n), GPUIPC_E_NO_DRIVER);
  ASSERT_STATUS(gpuipc_init(), GPUIPC_E_NO_DRIVER);
  /* Calls that need no driver keep working. */
  ASSERT_STR_EQ(gpuipc_driver_path(), "/nonexistent/libcuda.so.1");
  ASSERT_OK(gpuipc_uuid_parse("GPU-03142536-4758-697a-8b9c-adbecfe0f102", &u));
  ASSERT_EQ(gpuipc_version(), GPUIPC_VERSION_HEX);
  return 0;
}

TEST_IMPL(core_no_driver_not_a_driver) {
  /* A real shared library that is not a CUDA driver. */
  ASSERT_EQ(setenv("GPUIPC_CUDA_DRIVER", "libm.so.6", 1), 0);
  ASSERT_STATUS(gpuipc_init(), GPUIPC_E_NO_DRIVER);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "libm.so.6");
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "not a CUDA driver");
  int n;
  ASSERT_STATUS(gpuipc_device_count(&n), GPUIPC_E_NO_DRIVER);
  return 0;
}

TEST_IMPL(core_no_driver_default_name) {
  /* With the variable unset, the default is libcuda.so.1. */
  ASSERT_EQ(unsetenv("GPUIPC_CUDA_DRIVER"), 0);
  ASSERT_STR_EQ(gpuipc_driver_path(), "libcuda.so.1");
  gpuipc_status s = gpuipc_init();
  if (s == GPUIPC_OK)
    SKIP("libcuda.so.1 is installed here: the no-driver message cannot be seen");
  ASSERT_STATUS(s, GPUIPC_E_NO_DRIVER);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "libcuda.so.1");
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "NVIDIA driver");
  return 0;
}

TEST_IMPL(core_driver_loads) {
  ASSERT_OK(gpuipc_init());
  int v = 0, n = 0;
  ASSERT_OK(gpuipc_driver_version(&v));
  ASSERT_GE(v, 12000);
  ASSERT_OK(gpuipc_device_count(&n));
  ASSERT_GE(n, 1);
  gpuipc_uuid u;
  int back = -1;
  for (int i = 0; i < n; i++) {
    ASSERT_OK(gpuipc_device_uuid(i, &u));
    ASSERT_OK(gpuipc_device_from_uuid(&u, &back));
    ASSERT_EQ(back, i);
  }
  memset(&u, 0xee, sizeof u);
  ASSERT_STATUS(gpuipc_device_from_uuid(&u, &back), GPUIPC_E_DEVICE_NOT_VISIBLE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "GPU-eeeeeeee");
  ASSERT_STATUS(gpuipc_device_uuid(n, &u), GPUIPC_E_NO_DEVICE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "cuDeviceGet: CUDA_ERROR_INVALID_DEVICE");
  ASSERT_STATUS(gpuipc_device_count(NULL), GPUIPC_E_INVALID_ARG);
  return 0;
}

/* Waits for a forked child and returns its exit code. */
static int wait_child(pid_t pid) {
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT(WIFEXITED(st));
  return WEXITSTATUS(st);
}

TEST_IMPL(core_fork_after_init_is_refused) {
  ASSERT_OK(gpuipc_init());
  int n = 0;
  ASSERT_OK(gpuipc_device_count(&n));
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int m = 0;
    gpuipc_status s1 = gpuipc_init();
    gpuipc_status s2 = gpuipc_device_count(&m);
    int ok = s1 == GPUIPC_E_FORKED && s2 == GPUIPC_E_FORKED &&
             strstr(gpuipc_last_error(), "gpuipc_spawn") != NULL &&
             strstr(gpuipc_last_error(), "exec") != NULL;
    _exit(ok ? 0 : 1);
  }
  ASSERT_EQ(wait_child(pid), 0);
  /* The parent is unaffected. */
  ASSERT_OK(gpuipc_device_count(&n));
  ASSERT_GE(n, 1);
  return 0;
}

TEST_IMPL(core_fork_before_init_works) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int m = 0;
    _exit(gpuipc_init() == GPUIPC_OK && gpuipc_device_count(&m) == GPUIPC_OK &&
                  m >= 1
              ? 0
              : 1);
  }
  ASSERT_EQ(wait_child(pid), 0);
  ASSERT_OK(gpuipc_init());
  return 0;
}

/* gpuipc_desc_recv in a process that has no descriptor left: the kernel
 * drops the descriptors that came with the message (MSG_CTRUNC), and the
 * call must say so, naming this process's limit, rather than return a
 * descriptor without its fd. */
TEST_IMPL(core_desc_recv_out_of_fds_says_so) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  int fd = memfd_create("gpuipc-test", MFD_CLOEXEC);
  ASSERT(fd >= 0);
  uint8_t d[32];
  memset(d, 0x5a, sizeof d);
  ASSERT_OK(gpuipc_desc_send(sv[0], d, sizeof d, &fd, 1));

  struct rlimit old, low;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  low = old;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  int fill[256], nfill = 0;
  while (nfill < 256) {
    int f = fcntl(sv[1], F_DUPFD_CLOEXEC, 0);
    if (f < 0)
      break;
    fill[nfill++] = f;
  }
  ASSERT_EQ(errno, EMFILE);

  uint8_t got[64];
  size_t len = 0;
  int fds[1] = {-1}, nfds = 1;
  gpuipc_status s = gpuipc_desc_recv(sv[1], got, sizeof got, &len, fds, &nfds);
  for (int i = 0; i < nfill; i++)
    close(fill[i]);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_STATUS(s, GPUIPC_E_LIMIT);
  ASSERT(strstr(gpuipc_last_error(), "no file descriptor left") != NULL);

  /* With room again, the next message comes whole. */
  ASSERT_OK(gpuipc_desc_send(sv[0], d, sizeof d, &fd, 1));
  nfds = 1;
  ASSERT_OK(gpuipc_desc_recv(sv[1], got, sizeof got, &len, fds, &nfds));
  ASSERT_EQ(nfds, 1);
  ASSERT_EQ(len, sizeof d);
  close(fds[0]);
  close(fd);
  close(sv[0]);
  close(sv[1]);
  return 0;
}

/* More descriptors than the caller has room for: none is kept, none
 * leaks, and the status says so. */
TEST_IMPL(core_desc_recv_too_many_fds) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  int fd = memfd_create("gpuipc-test", MFD_CLOEXEC);
  ASSERT(fd >= 0);
  uint8_t d[32];
  memset(d, 0x5a, sizeof d);
  ASSERT_OK(gpuipc_desc_send(sv[0], d, sizeof d, &fd, 1));
  uint8_t got[64];
  size_t len = 0;
  int nfds = 0;
  int before = fcntl(sv[1], F_DUPFD_CLOEXEC, 0);
  close(before);
  ASSERT_STATUS(gpuipc_desc_recv(sv[1], got, sizeof got, &len, NULL, &nfds),
                GPUIPC_E_LIMIT);
  int after = fcntl(sv[1], F_DUPFD_CLOEXEC, 0);
  ASSERT_EQ(after, before); /* the received fd was closed */
  close(after);
  close(fd);
  close(sv[0]);
  close(sv[1]);
  return 0;
}

/* The one growable array: doubling from `first`, the array kept whole, and
 * an overflowing size refused with the array and its capacity untouched. */
TEST_IMPL(core_grow) {
  size_t cap = 0;
  int *a = gpuipc__grow(NULL, &cap, 1, sizeof *a, 4);
  ASSERT_NOT_NULL(a);
  ASSERT_UEQ(cap, 4);
  for (int i = 0; i < 4; i++)
    a[i] = i;
  int *same = gpuipc__grow(a, &cap, 3, sizeof *a, 4);
  ASSERT(same == a);
  ASSERT_UEQ(cap, 4);
  a = gpuipc__grow(a, &cap, 5, sizeof *a, 4);
  ASSERT_NOT_NULL(a);
  ASSERT_UEQ(cap, 8);
  a = gpuipc__grow(a, &cap, 100, sizeof *a, 4);
  ASSERT_NOT_NULL(a);
  ASSERT(cap >= 100);
  for (int i = 0; i < 4; i++)
    ASSERT_EQ(a[i], i);
  size_t before = cap;
  ASSERT_NULL(gpuipc__grow(a, &cap, SIZE_MAX / 2, sizeof *a, 4));
  ASSERT_UEQ(cap, before);
  ASSERT_EQ(a[3], 3); /* still ours */
  free(a);
  return 0;
}

/* The one reader of /proc's "Key: numbers" lines, on files written here:
 * the first and last number, a missing line, a missing file, a line that
 * ends without a number. */
TEST_IMPL(core_proc_field) {
  char path[512];
  snprintf(path, sizeof path, "%s/status", harness_tmpdir());
  FILE *f = fopen(path, "w");
  ASSERT_NOT_NULL(f);
  fprintf(f, "Name:\ttest\nNSpid:\t4242\t17\t1\nThreads:\t9\nPid:\n"
             "Tgid:\t77\n");
  fclose(f);
  long first = -1, last = -1;
  ASSERT_OK(gpuipc__proc_field(path, "NSpid", &first, &last));
  ASSERT_EQ(first, 4242);
  ASSERT_EQ(last, 1);
  first = last = -1;
  ASSERT_OK(gpuipc__proc_field(path, "Threads", &first, NULL));
  ASSERT_EQ(first, 9);
  /* A line with no number leaves both untouched, and does not read on
   * into the next line. */
  first = last = -1;
  (void)gpuipc__proc_field(path, "Pid", &first, &last);
  ASSERT_EQ(first, -1);
  ASSERT_EQ(last, -1);
  ASSERT_STATUS(gpuipc__proc_field(path, "VmRSS", &first, &last),
                GPUIPC_E_NOT_SUPPORTED);
  ASSERT_STATUS(gpuipc__proc_field("/proc/0/status-none", "Pid", &first, NULL),
                GPUIPC_E_NOT_FOUND);
  /* This process's own status: its pid. */
  ASSERT_OK(gpuipc__proc_field("/proc/self/status", "Pid", &first, NULL));
  ASSERT_EQ(first, getpid());
  return 0;
}
