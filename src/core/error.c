/*
 * error.c: owns status codes and their strings (generated from
 * GPUIPC_STATUS_MAP), the translation of errno values into statuses, and
 * the per-thread record of the last failure (a formatted message, or two
 * constant strings joined only when gpuipc_last_error() asks, for failures
 * a polling loop meets at every turn; with the CUresult and errno behind
 * it).
 */
#include "core_int.h"

#include <stdio.h>
#include <string.h>

static _Thread_local char last_msg[1024];
static _Thread_local int last_cuda;
static _Thread_local int last_errno;
/* A message not formatted yet (gpuipc__fail_static): last_msg is stale
 * while lazy_what is set. */
static _Thread_local const char *lazy_what, *lazy_text;

const char *gpuipc_strerror(gpuipc_status status) {
  switch (status) {
#define GPUIPC__STATUS_TEXT(name, value, text)                                 \
  case GPUIPC_##name:                                                          \
    return text;
    GPUIPC_STATUS_MAP(GPUIPC__STATUS_TEXT)
#undef GPUIPC__STATUS_TEXT
  default:
    return "unknown status";
  }
}

const char *gpuipc_status_name(gpuipc_status status) {
  switch (status) {
#define GPUIPC__STATUS_NAME(name, value, text)                                 \
  case GPUIPC_##name:                                                          \
    return "GPUIPC_" #name;
    GPUIPC_STATUS_MAP(GPUIPC__STATUS_NAME)
#undef GPUIPC__STATUS_NAME
  default:
    return "GPUIPC_(unknown)";
  }
}

const char *gpuipc_last_error(void) {
  if (lazy_what) {
    snprintf(last_msg, sizeof last_msg, "%s%s", lazy_what, lazy_text);
    lazy_what = NULL;
  }
  return last_msg;
}
int gpuipc_last_cuda_error(void) { return last_cuda; }
int gpuipc_last_errno(void) { return last_errno; }

void gpuipc__set_cuda_error(int curesult) { last_cuda = curesult; }

static void record(const char *fmt, va_list ap) {
  /* Format into a scratch buffer first: fmt's arguments may point into
   * last_msg itself (re-raising an earlier message with a prefix). */
  char tmp[sizeof last_msg];
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  size_t len = n < 0 ? 0 : (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1;
  tmp[len] = '\0';
  memcpy(last_msg, tmp, len + 1);
  lazy_what = NULL;
}

gpuipc_status gpuipc__fail(gpuipc_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  record(fmt, ap);
  va_end(ap);
  last_cuda = 0;
  last_errno = 0;
  GPUIPC__DEBUG("error", "%s: %s", gpuipc_status_name(status), last_msg);
  return status;
}

gpuipc_status gpuipc__fail_static(gpuipc_status status, const char *what,
                                  const char *text) {
  lazy_what = what;
  lazy_text = text;
  last_cuda = 0;
  last_errno = 0;
  GPUIPC__DEBUG("error", "%s: %s%s", gpuipc_status_name(status), what, text);
  return status;
}

gpuipc_status gpuipc__status_from_errno(int err) {
  switch (err) {
  case 0:
    return GPUIPC_OK;
  case ENOMEM:
    return GPUIPC_E_NO_MEMORY;
  case EACCES:
  case EPERM:
    return GPUIPC_E_PERMISSION;
  case ETIMEDOUT:
    return GPUIPC_E_TIMEOUT;
  case EAGAIN:
    return GPUIPC_E_WOULD_BLOCK;
  case EINVAL:
    return GPUIPC_E_INVALID_ARG;
  case ENOENT:
  case ECONNREFUSED:
    return GPUIPC_E_NOT_FOUND;
  case EEXIST:
  case EADDRINUSE:
    return GPUIPC_E_EXISTS;
  case EPIPE:
  case ECONNRESET:
    return GPUIPC_E_PEER_GONE;
  case EMFILE:
  case ENFILE:
    return GPUIPC_E_LIMIT;
  case ENOSYS:
  case EOPNOTSUPP:
    return GPUIPC_E_NOT_SUPPORTED;
  case ECANCELED:
    return GPUIPC_E_CANCELED;
  case ESRCH:
    return GPUIPC_E_PEER_GONE;
  default:
    return GPUIPC_E_SYSTEM;
  }
}

gpuipc_status gpuipc__fail_errno(int err, const char *call, const char *fmt,
                                 ...) {
  char detail[512] = "";
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
  }
  char ebuf[128];
  const char *etext = strerror_r(err, ebuf, sizeof ebuf);
  gpuipc_status s = gpuipc__fail(gpuipc__status_from_errno(err), "%s: %s%s%s%s",
                                 call, etext, detail[0] ? " (" : "", detail,
                                 detail[0] ? ")" : "");
  last_errno = err;
  return s;
}
