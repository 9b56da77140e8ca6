/*
 * internal.h: what every module of the library shares: error reporting,
 * logging, check macros. Internal non-static names start with gpuipc__.
 */
#ifndef GPUIPC_INTERNAL_H
#define GPUIPC_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "gpuipc.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define GPUIPC__PRINTF(a, b) __attribute__((format(printf, a, b)))
#define GPUIPC__LIKELY(x) __builtin_expect(!!(x), 1)
#define GPUIPC__UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define GPUIPC__PRINTF(a, b)
#define GPUIPC__LIKELY(x) (x)
#define GPUIPC__UNLIKELY(x) (x)
#endif

#define GPUIPC__ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

/* ---- errors (error.c) ---------------------------------------------------- */

/* Records a failure for gpuipc_last_error() and returns status, so that a
 * function can end with `return gpuipc__fail(GPUIPC_E_..., "...")`. */
gpuipc_status gpuipc__fail(gpuipc_status status, const char *fmt, ...)
    GPUIPC__PRINTF(2, 3);
/* A failed system call: maps err (an errno value) to a status (ENOMEM ->
 * E_NO_MEMORY, EACCES/EPERM -> E_PERMISSION, ETIMEDOUT -> E_TIMEOUT, ...)
 * and records "call: strerror(err) (detail)". */
gpuipc_status gpuipc__fail_errno(int err, const char *call, const char *fmt,
                                 ...) GPUIPC__PRINTF(3, 4);
/* A failed driver call: maps the CUresult to a status and records
 * "call: CUDA_ERROR_NAME (detail)". Defined in driver.c. */
gpuipc_status gpuipc__fail_cuda(int curesult, const char *call, const char *fmt,
                                ...) GPUIPC__PRINTF(3, 4);
/* Stores the CUresult reported by gpuipc_last_cuda_error() (driver.c calls
 * it after gpuipc__fail). */
void gpuipc__set_cuda_error(int curesult);
/* Maps an errno value to a status without recording anything. */
gpuipc_status gpuipc__status_from_errno(int err);

/* ---- logging (log.c) ----------------------------------------------------- */

int gpuipc__log_level_get(void);
void gpuipc__log_write(int level, const char *module, const char *fmt, ...)
    GPUIPC__PRINTF(3, 4);

/* The level is checked before the arguments are evaluated. */
#define GPUIPC__LOG(level, module, ...)                                        \
  do {                                                                         \
    if (GPUIPC__UNLIKELY(gpuipc__log_level_get() >= (level)))                  \
      gpuipc__log_write((level), (module), __VA_ARGS__);                       \
  } while (0)
#define GPUIPC__ERROR(mod, ...) GPUIPC__LOG(GPUIPC_LOG_ERROR, mod, __VA_ARGS__)
#define GPUIPC__WARN(mod, ...) GPUIPC__LOG(GPUIPC_LOG_WARN, mod, __VA_ARGS__)
#define GPUIPC__INFO(mod, ...) GPUIPC__LOG(GPUIPC_LOG_INFO, mod, __VA_ARGS__)
#define GPUIPC__DEBUG(mod, ...) GPUIPC__LOG(GPUIPC_LOG_DEBUG, mod, __VA_ARGS__)
#define GPUIPC__TRACE(mod, ...) GPUIPC__LOG(GPUIPC_LOG_TRACE, mod, __VA_ARGS__)

/* ---- check macros (NCCL style) ------------------------------------------- */

/* Evaluate a gpuipc_status expression; return it on failure. */
#define GPUIPC__CHECK(expr)                                                    \
  do {                                                                         \
    gpuipc_status gpuipc__s = (expr);                                          \
    if (GPUIPC__UNLIKELY(gpuipc__s != GPUIPC_OK))                              \
      return gpuipc__s;                                                        \
  } while (0)
/* Same, but store it in res and jump to label (the function's one exit). */
#define GPUIPC__CHECK_GOTO(expr, res, label)                                   \
  do {                                                                         \
    (res) = (expr);                                                            \
    if (GPUIPC__UNLIKELY((res) != GPUIPC_OK))                                  \
      goto label;                                                              \
  } while (0)

/* Retry a system call while it fails with EINTR. */
#define GPUIPC__EINTR_RETRY(ret, call)                                         \
  do {                                                                         \
    (ret) = (call);                                                            \
  } while ((ret) == -1 && errno == EINTR)

/* ---- extensible option structs (util.c) -------------------------------- */

/* Every public option struct starts with `size_t size` (set by its
 * GPUIPC_X_OPTIONS_INIT). Copies a caller's struct over the defaults already
 * in dst (dst_size bytes): only min(caller's size, ours) bytes are read, so
 * a caller built against an older (smaller) or newer header works. NULL src
 * keeps the defaults. A size below min_size (the fields every version has)
 * or beyond 64 KiB is refused with a message naming `what` and its
 * initializer. dst's size field is set to dst_size. */
gpuipc_status gpuipc__options_copy(void *dst, size_t dst_size, const void *src,
                                   size_t min_size, const char *what,
                                   const char *init_name);

/* ---- environment (env.c) ------------------------------------------------- */

/* One cached getter per variable lives beside its user; these read once. */
const char *gpuipc__getenv(const char *name);
/* Parses a non-negative integer variable; returns def when unset or bad
 * (and logs a warning when bad). */
long long gpuipc__getenv_int(const char *name, long long def);

/* ---- small utilities (util.c) ------------------------------------------- */

uint64_t gpuipc__now_ns(void); /* CLOCK_MONOTONIC */
/* Reads /proc/sys/kernel/random/boot_id into out (16 bytes). */
gpuipc_status gpuipc__boot_id(uint8_t out[16]);
/* Inode of /proc/self/ns/pid (0 when unavailable). */
uint64_t gpuipc__pid_namespace(void);
/* Start time of process pid in clock ticks since boot (field 22 of
 * /proc/pid/stat); 0 when unavailable. Together with pid it names a process
 * even after pid reuse. */
uint64_t gpuipc__process_start_time(int pid);

#endif /* GPUIPC_INTERNAL_H */
