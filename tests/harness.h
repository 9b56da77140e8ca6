/*
 * harness.h: the test harness, in the style of libuv's.
 *
 * - TEST_IMPL(name) defines a test; each is its own CTest case (CMake finds
 *   them by scanning the test sources for TEST_IMPL). `gpuipc-tests name` runs one.
 * - HELPER_IMPL(name) defines a helper: a role another process plays. A test
 *   starts it with spawn_helper(), which re-executes this binary; the helper
 *   gets a socketpair end to its parent (harness_helper_fd()).
 * - ASSERT_* print both values and stay on in release builds.
 * - SKIP("reason") ends a test as skipped (exit code 77, which CTest reports
 *   as skipped); the reason is printed.
 * - Each test runs with XDG_RUNTIME_DIR set to a directory inside its
 *   harness_tmpdir(), so its sockets and stats segments (and its helpers')
 *   never reach the user's runtime directory (harness-runtime.c checks).
 */
#ifndef GPUIPC_TEST_HARNESS_H
#define GPUIPC_TEST_HARNESS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "gpuipc.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#define TEST_PASS 0
#define TEST_SKIP 77

typedef int (*harness_test_fn)(void);
typedef int (*harness_helper_fn)(int argc, char **argv);
void harness_register_test(const char *name, harness_test_fn fn);
void harness_register_helper(const char *name, harness_helper_fn fn);

#define TEST_IMPL(name)                                                        \
  static int test_##name(void);                                                \
  __attribute__((constructor)) static void harness_reg_test_##name(void) {     \
    harness_register_test(#name, test_##name);                                 \
  }                                                                            \
  static int test_##name(void)

#define HELPER_IMPL(name)                                                      \
  static int helper_##name(int argc, char **argv);                             \
  __attribute__((constructor)) static void harness_reg_helper_##name(void) {   \
    harness_register_helper(#name, helper_##name);                             \
  }                                                                            \
  static int helper_##name(int argc, char **argv)

void harness_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

#define ASSERT(expr)                                                           \
  do {                                                                         \
    if (!(expr))                                                               \
      harness_fail(__FILE__, __LINE__, "assertion failed: %s", #expr);         \
  } while (0)

#define ASSERT_BASE(a, op, b, type, fmt)                                       \
  do {                                                                         \
    type harness_a = (type)(a);                                                \
    type harness_b = (type)(b);                                                \
    if (!(harness_a op harness_b))                                             \
      harness_fail(__FILE__, __LINE__,                                         \
                   "assertion failed: %s %s %s\n  left:  " fmt                 \
                   "\n  right: " fmt,                                          \
                   #a, #op, #b, harness_a, harness_b);                         \
  } while (0)

#define ASSERT_EQ(a, b) ASSERT_BASE(a, ==, b, long long, "%lld")
#define ASSERT_NE(a, b) ASSERT_BASE(a, !=, b, long long, "%lld")
#define ASSERT_LT(a, b) ASSERT_BASE(a, <, b, long long, "%lld")
#define ASSERT_LE(a, b) ASSERT_BASE(a, <=, b, long long, "%lld")
#define ASSERT_GT(a, b) ASSERT_BASE(a, >, b, long long, "%lld")
#define ASSERT_GE(a, b) ASSERT_BASE(a, >=, b, long long, "%lld")
#define ASSERT_UEQ(a, b) ASSERT_BASE(a, ==, b, unsigned long long, "%llu")
#define ASSERT_PTR_EQ(a, b) ASSERT_BASE(a, ==, b, const void *, "%p")
#define ASSERT_PTR_NE(a, b) ASSERT_BASE(a, !=, b, const void *, "%p")
#define ASSERT_NULL(a) ASSERT_PTR_EQ(a, NULL)
#define ASSERT_NOT_NULL(a) ASSERT_PTR_NE(a, NULL)

#define ASSERT_STR_EQ(a, b)                                                    \
  do {                                                                         \
    const char *harness_a = (a), *harness_b = (b);                             \
    if (harness_a == NULL || harness_b == NULL ||                              \
        strcmp(harness_a, harness_b) != 0)                                     \
      harness_fail(__FILE__, __LINE__,                                         \
                   "assertion failed: %s == %s\n  left:  \"%s\"\n  right: "    \
                   "\"%s\"",                                                   \
                   #a, #b, harness_a ? harness_a : "(null)",                   \
                   harness_b ? harness_b : "(null)");                          \
  } while (0)

#define ASSERT_STR_CONTAINS(hay, needle)                                       \
  do {                                                                         \
    const char *harness_h = (hay), *harness_n = (needle);                      \
    if (harness_h == NULL || strstr(harness_h, harness_n) == NULL)             \
      harness_fail(__FILE__, __LINE__,                                         \
                   "assertion failed: \"%s\" contains \"%s\"",                 \
                   harness_h ? harness_h : "(null)", harness_n);               \
  } while (0)

#define ASSERT_MEM_EQ(a, b, n)                                                 \
  do {                                                                         \
    const unsigned char *harness_a = (const void *)(a);                        \
    const unsigned char *harness_b = (const void *)(b);                        \
    size_t harness_n = (n);                                                    \
    for (size_t harness_i = 0; harness_i < harness_n; harness_i++)             \
      if (harness_a[harness_i] != harness_b[harness_i])                        \
        harness_fail(__FILE__, __LINE__,                                       \
                     "assertion failed: %s == %s over %zu bytes\n  first "     \
                     "difference at byte %zu: 0x%02x != 0x%02x",               \
                     #a, #b, harness_n, harness_i, harness_a[harness_i],       \
                     harness_b[harness_i]);                                    \
  } while (0)

/* A gpuipc call that must succeed: prints the status and the detail. */
#define ASSERT_OK(expr)                                                        \
  do {                                                                         \
    gpuipc_status harness_s = (expr);                                          \
    if (harness_s != GPUIPC_OK)                                                \
      harness_fail(__FILE__, __LINE__, "%s\n  returned %s: %s", #expr,        \
                   gpuipc_status_name(harness_s), gpuipc_last_error());        \
  } while (0)

/* A gpuipc call that must fail with this status. */
#define ASSERT_STATUS(expr, want)                                              \
  do {                                                                         \
    gpuipc_status harness_s = (expr);                                          \
    if (harness_s != (want))                                                   \
      harness_fail(__FILE__, __LINE__,                                         \
                   "%s\n  returned %s, want %s\n  detail: %s", #expr,          \
                   gpuipc_status_name(harness_s), gpuipc_status_name(want),    \
                   gpuipc_last_error());                                       \
  } while (0)

/* A CUresult (as int) that must be CUDA_SUCCESS (0). */
#define ASSERT_CU(expr)                                                        \
  do {                                                                         \
    int harness_r = (int)(expr);                                               \
    if (harness_r != 0)                                                        \
      harness_fail(__FILE__, __LINE__, "%s\n  returned CUresult %d (%s)",      \
                   #expr, harness_r, harness_cuda_error_name(harness_r));      \
  } while (0)
#define ASSERT_CU_EQ(expr, want)                                               \
  do {                                                                         \
    int harness_r = (int)(expr), harness_w = (int)(want);                      \
    if (harness_r != harness_w)                                                \
      harness_fail(__FILE__, __LINE__,                                         \
                   "%s\n  returned %d (%s), want %d (%s)", #expr, harness_r,   \
                   harness_cuda_error_name(harness_r), harness_w,              \
                   harness_cuda_error_name(harness_w));                        \
  } while (0)

#define SKIP(...)                                                              \
  do {                                                                         \
    printf("SKIP: ");                                                          \
    printf(__VA_ARGS__);                                                       \
    printf("\n");                                                              \
    fflush(stdout);                                                            \
    return TEST_SKIP;                                                          \
  } while (0)

const char *harness_cuda_error_name(int r);

/* ---- the driver under test ----------------------------------------------- */

/* True when GPUIPC_CUDA_DRIVER names the emulator (make test), false on the
 * real driver (make gpu-test). */
bool harness_on_emulator(void);
/* Path of the emulator library (set at build time), for tests that need it
 * explicitly. */
const char *harness_emulator_path(void);

/* Skips unless at least n devices are visible (driver init failures fail the
 * test: a GPU run without a GPU is an error, not a skip). */
#define REQUIRE_DEVICES(n)                                                     \
  do {                                                                         \
    int harness_count = 0;                                                     \
    ASSERT_OK(gpuipc_device_count(&harness_count));                            \
    if (harness_count < (n))                                                   \
      SKIP("needs %d device(s), %d visible", (n), harness_count);              \
  } while (0)

/* Skips on the real driver: for tests of emulator-only features (fault
 * injection, GPUIPC_EMU_* settings). */
#define REQUIRE_EMULATOR(why)                                                  \
  do {                                                                         \
    if (!harness_on_emulator())                                                \
      SKIP("needs the emulator: %s", why);                                     \
  } while (0)

/* ---- helper processes ---------------------------------------------------- */

/* Starts this binary as helper `name` with the given arguments (NULL
 * terminated). env: extra "NAME=value" entries (NULL-terminated list, or
 * NULL); an entry "NAME=" with nothing after '=' removes NAME. The helper's
 * end of a socketpair is returned through *fd (close it when done), or
 * closed when fd is NULL. */
pid_t spawn_helper(const char *name, char *const env[], int *fd, ...);
/* Waits for a helper; returns its exit status, or 128+signal if a signal
 * killed it. Fails the test after timeout_s seconds (killing the helper). */
int wait_helper(pid_t pid, int timeout_s);
/* In a helper: its end of the socketpair to the test (-1 if none). */
int harness_helper_fd(void);

/* Message helpers on a socketpair: a length-prefixed blob, optionally with
 * file descriptors (SCM_RIGHTS). Fail the test on error. */
void harness_send(int sock, const void *buf, size_t len, const int *fds,
                  int nfds);
/* Returns the length received (<= cap); *nfds in: capacity, out: received.
 * Returns -1 on orderly EOF. */
ssize_t harness_recv(int sock, void *buf, size_t cap, int *fds, int *nfds);
void harness_send_u64(int sock, uint64_t v);
uint64_t harness_recv_u64(int sock);

/* Number of open file descriptors of this process (for leak checks). */
int harness_count_fds(void);

/* Host allocation failures (SQLite's faultsim in small): the next `count`
 * malloc/realloc calls made by this thread for between min and max bytes
 * (the library's and the tests' own: the test binary is linked with
 * --wrap=malloc,--wrap=realloc) fail with ENOMEM. Returns how many failed
 * since the previous call. count 0 disarms. */
int harness_fail_allocs(size_t min, size_t max, int count);
/* Fails the nth host allocation of this thread from now on (and, with
 * persist, every one after it) until disarmed; disarming returns how many
 * were failed (SQLite's faultsim). */
void harness_alloc_arm(long nth, int persist);
long harness_alloc_disarm(void);
/* The calling thread's arming, for tests that pause and resume it. */
typedef struct harness_alloc_state {
  long left;   /* > 0: armed; the call that takes it to 0 fails */
  int persist; /* after the first failure, fail every call */
  int failing;
  long hits;   /* allocations failed since arming */
} harness_alloc_state;
harness_alloc_state *harness_alloc(void);

/* A path in a fresh private temporary directory (removed at exit). */
const char *harness_tmpdir(void);

/* Runs a shell-free command (argv, NULL-terminated) and captures its stdout
 * (up to cap-1 bytes, NUL-terminated); returns its exit status. */
int harness_run(char *const argv[], char *const env[], char *out, size_t cap);

#endif /* GPUIPC_TEST_HARNESS_H */
