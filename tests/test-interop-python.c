/*
 * test-interop-python.c: interop with CuPy and cuda.core, driven by the
 * Python scripts in tests/python/. Each test runs one script, which starts
 * this binary as the peer `interop_py_peer` (a gpuipc program) and talks to
 * it over a SOCK_SEQPACKET socket: one text command per message, file
 * descriptors beside it by SCM_RIGHTS.
 *
 * The scripts need python3 with CuPy (cupy_interop.py) or cuda.core
 * (cuda_core_interop.py) and the real driver: CuPy and cuda.core load
 * libcuda.so.1 themselves, so on the emulator the tests are skipped, as
 * they are where python3 or the package is missing (the script exits 77
 * and says why). Their "--backend ctypes" mode speaks the same protocol
 * with the driver API through ctypes (the driver GPUIPC_CUDA_DRIVER names),
 * which runs everywhere python3 does: interop_python_driver_* check the
 * peer that way, on the emulator too.
 *
 * The peer prints what each buffer costs on its side (import + close, or
 * export), the scripts what it costs on theirs; both go to the test's
 * output.
 *
 * Peer commands (arguments separated by spaces, handles in hex):
 *   legacy_import HANDLE OFFSET SIZE UUID SEED [EVENT]
 *       imports the range with gpuipc_buffer_import_legacy_raw (and, when
 *       given, the IPC event with gpuipc_event_import_raw, waited on before
 *       reading), checks the pattern, closes; replies
 *       "ok IMPORT_NS CLOSE_NS".
 *   legacy_export SIZE SEED
 *       allocates a LEGACY buffer at an interior offset of a larger
 *       allocation, fills it, exports it raw and records an IPC event after
 *       the fill; replies "buf HANDLE OFFSET SIZE UUID EVENT EXPORT_NS";
 *       then waits for "check SEED2" (the peer wrote SEED2), replies "ok".
 *   mempool_import EXPORT_DATA OFFSET SIZE UUID SEED   (+ the pool fd)
 *       gpuipc_buffer_import_mempool_raw; replies "ok IMPORT_NS CLOSE_NS".
 *   mempool_export SIZE SEED
 *       allocates from a MEMPOOL pool, fills, exports raw; replies
 *       "buf EXPORT_DATA OFFSET SIZE UUID EXPORT_NS" (+ the pool fd); then
 *       "check SEED2" as above.
 *   quit
 * Failures reply "err MESSAGE". The pattern: byte i = (seed + 7 i) mod 256.
 */
#include "harness.h"

#include "tree.h"

#include <errno.h>
#include <limits.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- the peer ------------------------------------------------------------------ */

static int peer_recv(int sock, char *buf, size_t cap, int *fd) {
  char cbuf[CMSG_SPACE(sizeof(int))];
  struct iovec iov = {buf, cap - 1};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cbuf;
  mh.msg_controllen = sizeof cbuf;
  ssize_t n;
  do
    n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n <= 0)
    return -1;
  buf[n] = '\0';
  if (fd)
    *fd = -1;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int got = -1;
      memcpy(&got, CMSG_DATA(c), sizeof got);
      if (fd)
        *fd = got;
      else
        close(got);
    }
  return (int)n;
}

static void peer_send(int sock, const char *text, int fd) {
  char cbuf[CMSG_SPACE(sizeof(int))];
  struct iovec iov = {(void *)text, strlen(text)};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (fd >= 0) {
    memset(cbuf, 0, sizeof cbuf);
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ssize_t n;
  do
    n = sendmsg(sock, &mh, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  ASSERT_EQ(n, (ssize_t)strlen(text));
}

static void to_hex(const uint8_t *b, size_t n, char *out) {
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", b[i]);
}

static bool from_hex(const char *s, uint8_t *b, size_t n) {
  if (strlen(s) != 2 * n)
    return false;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1)
      return false;
    b[i] = (uint8_t)v;
  }
  return true;
}

/* "-" means: local device 0. */
static bool parse_uuid(const char *s, gpuipc_uuid *u, const gpuipc_uuid **p) {
  if (strcmp(s, "-") == 0) {
    *p = NULL;
    return true;
  }
  *p = u;
  return from_hex(s, u->bytes, 16) || gpuipc_uuid_parse(s, u) == GPUIPC_OK;
}

static void fill_host(uint8_t *h, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    h[i] = (uint8_t)(seed + 7u * (unsigned)i);
}

/* Checks the pattern of a device range, reading after `ev` (may be NULL)
 * on a stream of the range's device. Returns the first bad byte or -1. */
static long check_device(gpuipc_buffer *b, unsigned seed, gpuipc_event *ev) {
  gpuipc_uuid u;
  int ord = 0;
  ASSERT_OK(gpuipc_buffer_get_mapped_device(b, &u));
  ASSERT_OK(gpuipc_device_from_uuid(&u, &ord));
  size_t n = gpuipc_buffer_get_size(b);
  uint8_t *h = malloc(n);
  ASSERT_NOT_NULL(h);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ord));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  if (ev)
    ASSERT_OK(gpuipc_event_wait(ev, s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(
      h, (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b), n, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  long bad = -1;
  for (size_t i = 0; i < n && bad < 0; i++)
    if (h[i] != (uint8_t)(seed + 7u * (unsigned)i))
      bad = (long)i;
  free(h);
  return bad;
}

static void fill_device(gpuipc_buffer *b, unsigned seed, gpuipc_event *ev) {
  size_t n = gpuipc_buffer_get_size(b);
  uint8_t *h = malloc(n);
  ASSERT_NOT_NULL(h);
  fill_host(h, n, seed);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b),
                                    h, n));
  if (ev)
    ASSERT_OK(gpuipc_event_record(ev, NULL));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  gpuipc__ctx_leave(&g);
  free(h);
}

static void reply_err(int sock, const char *what, gpuipc_status s) {
  char msg[1024];
  snprintf(msg, sizeof msg, "err %s: %s: %s", what, gpuipc_status_name(s),
           gpuipc_last_error());
  peer_send(sock, msg, -1);
}

/* Waits for "check SEED2" and checks the buffer holds that pattern. */
static void await_check(int sock, gpuipc_buffer *b) {
  char cmd[256];
  ASSERT_GT(peer_recv(sock, cmd, sizeof cmd, NULL), 0);
  unsigned seed2 = 0;
  if (sscanf(cmd, "check %u", &seed2) != 1) {
    peer_send(sock, "err expected check", -1);
    return;
  }
  long bad = check_device(b, seed2, NULL);
  char msg[128];
  if (bad < 0)
    snprintf(msg, sizeof msg, "ok");
  else
    snprintf(msg, sizeof msg, "err byte %ld does not hold pattern %u", bad,
             seed2);
  peer_send(sock, msg, -1);
}

HELPER_IMPL(interop_py_peer) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  ASSERT_OK(gpuipc_init());
  gpuipc_pool *legacy = NULL, *mempool = NULL;
  for (;;) {
    char cmd[4096];
    int fd = -1;
    if (peer_recv(sock, cmd, sizeof cmd, &fd) <= 0)
      break;
    char a[5][160];
    memset(a, 0, sizeof a);
    char verb[32] = "";
    int na = sscanf(cmd, "%31s %159s %159s %159s %159s %159s", verb, a[0], a[1],
                    a[2], a[3], a[4]) - 1;
    char a5[160] = "";
    if (strcmp(verb, "legacy_import") == 0)
      sscanf(cmd, "%*s %*s %*s %*s %*s %*s %159s", a5);
    if (strcmp(verb, "quit") == 0) {
      peer_send(sock, "bye", -1);
      break;
    } else if (strcmp(verb, "legacy_import") == 0 ||
               strcmp(verb, "mempool_import") == 0) {
      bool is_legacy = verb[0] == 'l';
      uint8_t h[64], eh[64];
      gpuipc_uuid u;
      const gpuipc_uuid *up = NULL;
      unsigned long long off = 0, size = 0;
      unsigned seed = 0;
      if (na < 5 || !from_hex(a[0], h, 64) || sscanf(a[1], "%llu", &off) != 1 ||
          sscanf(a[2], "%llu", &size) != 1 || !parse_uuid(a[3], &u, &up) ||
          sscanf(a[4], "%u", &seed) != 1 || (!is_legacy && fd < 0) ||
          (a5[0] && !from_hex(a5, eh, 64))) {
        peer_send(sock, "err bad arguments", -1);
        if (fd >= 0)
          close(fd);
        continue;
      }
      gpuipc_event *ev = NULL;
      gpuipc_buffer *b = NULL;
      uint64_t t0 = gpuipc__now_ns();
      gpuipc_status s =
          is_legacy ? gpuipc_buffer_import_legacy_raw(h, (size_t)off,
                                                      (size_t)size, up, NULL, &b)
                    : gpuipc_buffer_import_mempool_raw(fd, h, (size_t)off,
                                                       (size_t)size, up, NULL,
                                                       &b);
      uint64_t t1 = gpuipc__now_ns();
      if (fd >= 0)
        close(fd);
      if (s == GPUIPC_OK && a5[0])
        s = gpuipc_event_import_raw(eh, up, &ev);
      if (s != GPUIPC_OK) {
        reply_err(sock, is_legacy ? "legacy import" : "mempool import", s);
        gpuipc_buffer_close(b);
        continue;
      }
      long bad = check_device(b, seed, ev);
      uint64_t t2 = gpuipc__now_ns();
      gpuipc_buffer_close(b);
      uint64_t t3 = gpuipc__now_ns();
      gpuipc_event_destroy(ev);
      char msg[256];
      if (bad >= 0)
        snprintf(msg, sizeof msg, "err byte %ld does not hold pattern %u", bad,
                 seed);
      else
        snprintf(msg, sizeof msg, "ok %llu %llu",
                 (unsigned long long)(t1 - t0), (unsigned long long)(t3 - t2));
      peer_send(sock, msg, -1);
    } else if (strcmp(verb, "legacy_export") == 0 ||
               strcmp(verb, "mempool_export") == 0) {
      bool is_legacy = verb[0] == 'l';
      unsigned long long size = 0;
      unsigned seed = 0;
      if (na < 2 || sscanf(a[0], "%llu", &size) != 1 || size == 0 ||
          sscanf(a[1], "%u", &seed) != 1) {
        peer_send(sock, "err bad arguments", -1);
        continue;
      }
      gpuipc_pool **pp = is_legacy ? &legacy : &mempool;
      gpuipc_status s = GPUIPC_OK;
      if (*pp == NULL) {
        gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
        po.kind = is_legacy ? GPUIPC_POOL_LEGACY : GPUIPC_POOL_MEMPOOL;
        s = gpuipc_pool_create(&po, pp);
      }
      /* LEGACY: a view at an interior offset of a larger buffer, as a
       * caching allocator hands out. */
      gpuipc_buffer *whole = NULL, *b = NULL;
      size_t lead = is_legacy ? 4096 : 0;
      if (s == GPUIPC_OK)
        s = gpuipc_buffer_alloc(*pp, (size_t)size + lead, NULL, &whole);
      if (s == GPUIPC_OK && is_legacy)
        s = gpuipc_buffer_wrap((char *)gpuipc_buffer_get_ptr(whole) + lead,
                               (size_t)size, &b);
      else if (s == GPUIPC_OK)
        b = whole;
      gpuipc_event *ev = NULL;
      if (s == GPUIPC_OK && is_legacy)
        s = gpuipc_event_create(NULL, &ev);
      if (s != GPUIPC_OK) {
        reply_err(sock, "allocating", s);
        if (b != whole)
          gpuipc_buffer_free(b, NULL);
        gpuipc_buffer_free(whole, NULL);
        continue;
      }
      fill_device(b, seed, ev);
      uint8_t h[64], eh[64];
      size_t off = 0, n = 0;
      gpuipc_uuid u;
      int pfd = -1;
      uint64_t t0 = gpuipc__now_ns();
      s = is_legacy ? gpuipc_buffer_export_legacy_raw(b, h, &off, &n, &u)
                    : gpuipc_buffer_export_mempool_raw(b, &pfd, h, &off, &n, &u);
      uint64_t t1 = gpuipc__now_ns();
      if (s == GPUIPC_OK && ev)
        s = gpuipc_event_export_raw(ev, eh, NULL);
      if (s != GPUIPC_OK) {
        reply_err(sock, "exporting", s);
      } else {
        char hh[129], ehx[129] = "-", uh[33];
        to_hex(h, 64, hh);
        if (ev)
          to_hex(eh, 64, ehx);
        to_hex(u.bytes, 16, uh);
        char msg[512];
        if (is_legacy)
          snprintf(msg, sizeof msg, "buf %s %zu %zu %s %s %llu", hh, off, n, uh,
                   ehx, (unsigned long long)(t1 - t0));
        else
          snprintf(msg, sizeof msg, "buf %s %zu %zu %s %llu", hh, off, n, uh,
                   (unsigned long long)(t1 - t0));
        peer_send(sock, msg, pfd);
        if (pfd >= 0)
          close(pfd);
        await_check(sock, b);
      }
      gpuipc_event_destroy(ev);
      if (b != whole)
        gpuipc_buffer_free(b, NULL);
      gpuipc_buffer_free(whole, NULL);
    } else {
      peer_send(sock, "err unknown command", -1);
      if (fd >= 0)
        close(fd);
    }
  }
  gpuipc_pool_destroy(legacy);
  gpuipc_pool_destroy(mempool);
  close(sock);
  return 0;
}

/* ---- the tests: run a script --------------------------------------------------- */

/* The first python3 on PATH, or NULL. */
static const char *find_python(char *out, size_t cap) {
  const char *path = getenv("PATH");
  if (path == NULL)
    return NULL;
  while (*path) {
    size_t n = strcspn(path, ":");
    if (n > 0 && n + 10 < cap) {
      snprintf(out, cap, "%.*s/python3", (int)n, path);
      if (access(out, X_OK) == 0)
        return out;
    }
    path += n;
    if (*path == ':')
      path++;
  }
  return NULL;
}

/* Sanitizer builds build the emulator with the sanitizer too, and a
 * sanitized library cannot be loaded into an unsanitized python3. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SANITIZED_BUILD 1
#endif
#endif
#ifndef SANITIZED_BUILD
#define SANITIZED_BUILD 0
#endif

/* Runs a script against this binary as its peer. backend NULL: the
 * script's package (real driver only); "ctypes": the driver API through
 * ctypes, on whichever driver the suite runs. */
static int run_script(const char *script, const char *backend) {
  if (backend == NULL && harness_on_emulator())
    SKIP("Python interop runs on the real driver only: CuPy and cuda.core "
         "load libcuda.so.1 themselves, not the emulator");
  if (SANITIZED_BUILD && harness_on_emulator())
    SKIP("sanitizer build: its emulator cannot be loaded into python3");
  char py[PATH_MAX];
  if (find_python(py, sizeof py) == NULL)
    SKIP("python3 not found on PATH");
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(n, 0);
  self[n] = '\0';
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/tests/python/%s", GPUIPC_SOURCE_DIR, script);
  char *argv[] = {py, path, "--peer", self, NULL, NULL, NULL};
  if (backend) {
    argv[4] = "--backend";
    argv[5] = (char *)backend;
  }
  static char out[1 << 16];
  int rc = harness_run(argv, NULL, out, sizeof out);
  fputs(out, stdout);
  fflush(stdout);
  if (rc == TEST_SKIP)
    return TEST_SKIP; /* the script printed "SKIP: why" */
  ASSERT_EQ(rc, 0);
  ASSERT_STR_CONTAINS(out, "PASS");
  return 0;
}

TEST_IMPL(interop_python_cupy) { return run_script("cupy_interop.py", NULL); }

TEST_IMPL(interop_python_cuda_core) {
  return run_script("cuda_core_interop.py", NULL);
}

/* The same protocols with the driver API in place of CuPy / cuda.core:
 * they check the peer on every driver, the emulator included. */
TEST_IMPL(interop_python_driver_legacy) {
  return run_script("cupy_interop.py", "ctypes");
}

TEST_IMPL(interop_python_driver_mempool) {
  return run_script("cuda_core_interop.py", "ctypes");
}
