/*
 * core.h: the core layer, as the layers above see it (handle, conn, proc,
 * xfer, mpi): error reporting, logging, check macros, option structs,
 * clock, boot id and process identity, the CUDA driver loaded at run time,
 * contexts, devices by UUID, and the socket helpers. Nothing here knows of
 * buffers or connections. The stats segment's counters, which name the
 * nouns of every layer, are in stats.h, included only where they are kept
 * or read. Internal non-static names start with gpuipc__.
 */
#ifndef GPUIPC_CORE_LAYER_H
#define GPUIPC_CORE_LAYER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "gpuipc.h"

#include <errno.h>
#include <stdatomic.h>
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
/* gpuipc__fail for a hot path's expected miss (a non-blocking call that
 * would block): records the message `what` followed by `text` without
 * formatting anything now; gpuipc_last_error() joins them when asked.
 * Both strings must live for the whole program (string literals). */
gpuipc_status gpuipc__fail_static(gpuipc_status status, const char *what,
                                  const char *text);
/* A failed system call: maps err (an errno value) to a status (ENOMEM ->
 * E_NO_MEMORY, EACCES/EPERM -> E_PERMISSION, ETIMEDOUT -> E_TIMEOUT, ...)
 * and records "call: strerror(err) (detail)". */
gpuipc_status gpuipc__fail_errno(int err, const char *call, const char *fmt,
                                 ...) GPUIPC__PRINTF(3, 4);
/* A failed driver call: maps the CUresult to a status and records
 * "call: CUDA_ERROR_NAME (detail)". Defined in driver.c. */
gpuipc_status gpuipc__fail_cuda(int curesult, const char *call, const char *fmt,
                                ...) GPUIPC__PRINTF(3, 4);
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

/* ---- little-endian fields of wire formats (descriptors, set tables) ---- */

static inline void gpuipc__put_le16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void gpuipc__put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline void gpuipc__put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t gpuipc__get_le16(const uint8_t *p) {
  return (uint16_t)(p[0] | (uint16_t)p[1] << 8);
}
static inline uint32_t gpuipc__get_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}
static inline uint64_t gpuipc__get_le64(const uint8_t *p) {
  return (uint64_t)gpuipc__get_le32(p) | (uint64_t)gpuipc__get_le32(p + 4) << 32;
}

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

/* ---- environment (env.c) ------------------------------------------------ */

/* Every environment variable gpuipc reads is a parameter declared with
 * GPUIPC__PARAM beside its use (param.h); nothing else calls getenv(). */
#include "param.h"

/* ---- sockets (sock.c) ------------------------------------------------------ */

struct iovec;
struct ucred;

/* The most descriptors one message carries (frames, descriptors). */
#define GPUIPC__SOCK_FDS_MAX 16

/* One sendmsg(2): the iovecs, fds (SCM_RIGHTS, 0..GPUIPC__SOCK_FDS_MAX) and,
 * when with_cred, this process's credentials (SCM_CREDENTIALS), with
 * MSG_NOSIGNAL | flags; EINTR retried. GPUIPC_OK with *sent bytes (the fds
 * went with the first byte), GPUIPC_E_WOULD_BLOCK (nothing sent, nothing
 * recorded), GPUIPC_E_PEER_GONE, or the errno's status. */
gpuipc_status gpuipc__sock_send(int fd, const struct iovec *iov, int niov,
                                const int *fds, int nfds, bool with_cred,
                                int flags, size_t *sent /* OUT */);

/* One recvmsg(2) into buf[0..cap) with MSG_CMSG_CLOEXEC | flags; EINTR
 * retried. Up to fds_cap received descriptors go to fds (*nfds; fds may be
 * NULL with fds_cap 0), credentials to *cred when have_cred is not NULL.
 * GPUIPC_OK with *got bytes (0: end of stream); GPUIPC_E_WOULD_BLOCK
 * (nothing recorded); GPUIPC_E_PEER_GONE (reset). With *got bytes
 * consumed all the same: GPUIPC_E_PROTOCOL when descriptors came beyond
 * fds_cap (closed) or beyond what a message may carry, GPUIPC_E_LIMIT when
 * the kernel dropped them because this process has no descriptor left; in
 * both cases no descriptor of the message is kept. */
gpuipc_status gpuipc__sock_recv(int fd, void *buf, size_t cap, int flags,
                                int *fds, int fds_cap, int *nfds /* OUT */,
                                struct ucred *cred, bool *have_cred,
                                size_t *got /* OUT */);

/* A deadline timeout_ms from now (gpuipc__now_ns; -1: UINT64_MAX, none;
 * 0: 0, do not wait). */
uint64_t gpuipc__deadline_ms(int timeout_ms);
/* Milliseconds poll() may wait until the deadline (-1: forever). */
int gpuipc__poll_ms(uint64_t deadline);
/* Waits for events on fd until the deadline; returns revents (0 on
 * timeout), -1 with errno on failure. EINTR restarts with the time left. */
int gpuipc__wait_fd(int fd, short events, uint64_t deadline);

/* ---- small utilities (util.c) ------------------------------------------- */

uint64_t gpuipc__now_ns(void); /* CLOCK_MONOTONIC */
/* Appends printf-formatted text to the NUL-terminated buf of cap bytes,
 * cut at its end (a full buf is left as it is). */
void gpuipc__appendf(char *buf, size_t cap, const char *fmt, ...)
    GPUIPC__PRINTF(3, 4);
/* Reads /proc/sys/kernel/random/boot_id into out (16 bytes). */
gpuipc_status gpuipc__boot_id(uint8_t out[16]);
/* Inode of /proc/self/ns/pid (0 when unavailable). */
uint64_t gpuipc__pid_namespace(void);
/* The inode of the pid namespace of process `pid` (a pid of ours), or 0
 * when /proc does not say (no such process, or not ours to look at). */
uint64_t gpuipc__proc_pid_namespace(int pid);
/* Start time of process pid in clock ticks since boot (field 22 of
 * /proc/pid/stat); 0 when unavailable. Together with pid it names a process
 * even after pid reuse. */
uint64_t gpuipc__process_start_time(int pid);
/* The one parser of /proc/<pid>/stat: the state letter (field 3) and the
 * start time (field 22) of process pid (either may be NULL).
 * GPUIPC_E_NOT_FOUND (nothing recorded) when there is no such process. A
 * state letter says nothing of whether the whole process exited (a main
 * thread that called pthread_exit shows 'Z' while other threads run): do
 * not take it for death (a pidfd says that). */
gpuipc_status gpuipc__proc_stat(int pid, char *state, uint64_t *start_time);
/* The one reader of /proc's "Key:<tab>numbers" files (/proc/<pid>/status,
 * /proc/self/fdinfo/<fd>): the first and the last number on the line named
 * key ("NSpid", "Threads", "Pid") of the file at path, each untouched when
 * the line has none (either may be NULL). GPUIPC_E_NOT_FOUND when the file
 * is not there (no such process) or reads as nothing; GPUIPC_E_NOT_SUPPORTED
 * when it has no such line (an older kernel); GPUIPC_E_SYSTEM when it could
 * not be opened otherwise (errno says why). Records nothing: what a missing
 * file means is the caller's to say. */
gpuipc_status gpuipc__proc_field(const char *path, const char *key,
                                 long *first, long *last);
/* The one growable array: p (an array of *cap elements of elem bytes,
 * or NULL) made to hold at least need elements, its capacity doubled from
 * *cap, or from first when it has none, so that a long run of appends
 * reallocates a logarithmic number of times. Returns the array (p itself
 * when it is large enough), or NULL, with p and *cap unchanged and still
 * the caller's, when the memory is not there or the size overflows;
 * records nothing (the caller says what it was growing). */
void *gpuipc__grow(void *p, size_t *cap, size_t need, size_t elem,
                   size_t first);


/* ---- the runtime directory (util.c) ---------------------------------------- */

/* The directory sockets and stats segments live in when the caller names
 * none: $XDG_RUNTIME_DIR/gpuipc when XDG_RUNTIME_DIR is an absolute path to
 * a directory of ours we can write to, else /tmp/gpuipc-<uid>. why (may be
 * NULL) receives the reason XDG_RUNTIME_DIR was not used; *from_xdg (may be
 * NULL) says which was chosen. Shared with `gpuipc doctor` and `gpuipc ls`. */
/* Makes sure dir exists, is a directory (not a link), belongs to us and has
 * mode 0700 (made so when it is missing): anything else could let another
 * user connect to, or replace, what lives there. GPUIPC_OK, or the status
 * with the reason in why (may be NULL); records nothing. */
gpuipc_status gpuipc__private_dir(const char *dir, char *why, size_t why_cap);
void gpuipc__default_runtime_dir(char *dir, size_t cap, char *why,
                                 size_t why_cap, bool *from_xdg);

/* ---- the CUDA driver, loaded at run time (driver.c) ---------------------
 *
 * gpuipc links against neither libcuda nor libcudart. On first use it
 * dlopens libcuda.so.1 (or GPUIPC_CUDA_DRIVER), finds cuGetProcAddress, and
 * resolves every entry point below through it, asking for the variant that
 * matches the prototypes of cuda.h: cuda.h maps e.g. cuMemAlloc to
 * cuMemAlloc_v2, the table's member types are taken from those very
 * prototypes, and driver.c asks for each name at the CUDA version where that
 * variant was current (12.0, or the exceptions listed in driver.c).
 *
 * Use: GPUIPC__CHECK(gpuipc__driver()) at the entry of every function that
 * needs CUDA, then call through gpuipc__cu, e.g.
 *   CUresult r = gpuipc__cu.cuMemAlloc(&p, n);
 *   if (r != CUDA_SUCCESS) return gpuipc__fail_cuda(r, "cuMemAlloc", "%zu bytes", n);
 * An entry point the driver lacks is NULL; GPUIPC__CU() below turns that
 * into CUDA_ERROR_NOT_FOUND instead of a crash.
 */


#include <cuda.h>

/* Every driver entry point gpuipc (and its tests and tools) uses. Add new
 * ones here; the emulator must implement each of them. If cuda.h maps the
 * name to a variant newer than CUDA 12.0, add it to api_version() in
 * driver.c. */
#define GPUIPC__CU_FUNCS(X)                                                    \
  X(cuInit)                                                                    \
  X(cuDriverGetVersion)                                                        \
  X(cuGetErrorName)                                                            \
  X(cuGetErrorString)                                                          \
  X(cuDeviceGet)                                                               \
  X(cuDeviceGetCount)                                                          \
  X(cuDeviceGetName)                                                           \
  X(cuDeviceGetUuid)                                                           \
  X(cuDeviceGetAttribute)                                                      \
  X(cuDeviceTotalMem)                                                          \
  X(cuDeviceGetPCIBusId)                                                       \
  X(cuDeviceGetByPCIBusId)                                                     \
  X(cuDeviceCanAccessPeer)                                                     \
  X(cuDeviceGetP2PAttribute)                                                   \
  X(cuDevicePrimaryCtxRetain)                                                  \
  X(cuDevicePrimaryCtxRelease)                                                 \
  X(cuDevicePrimaryCtxGetState)                                                \
  X(cuCtxGetCurrent)                                                           \
  X(cuCtxSetCurrent)                                                           \
  X(cuCtxPushCurrent)                                                          \
  X(cuCtxPopCurrent)                                                           \
  X(cuCtxGetDevice)                                                            \
  X(cuCtxSynchronize)                                                          \
  X(cuCtxEnablePeerAccess)                                                     \
  X(cuMemAlloc)                                                                \
  X(cuMemFree)                                                                 \
  X(cuMemGetInfo)                                                              \
  X(cuMemGetAddressRange)                                                      \
  X(cuPointerGetAttribute)                                                     \
  X(cuPointerGetAttributes)                                                    \
  X(cuMemcpy)                                                                  \
  X(cuMemcpyAsync)                                                             \
  X(cuMemcpyHtoD)                                                              \
  X(cuMemcpyDtoH)                                                              \
  X(cuMemcpyDtoD)                                                              \
  X(cuMemcpyHtoDAsync)                                                         \
  X(cuMemcpyDtoHAsync)                                                         \
  X(cuMemcpyDtoDAsync)                                                         \
  X(cuMemcpyBatchAsync)                                                        \
  X(cuMemcpyPeer)                                                              \
  X(cuMemcpyPeerAsync)                                                         \
  X(cuMemsetD8)                                                                \
  X(cuMemsetD32)                                                               \
  X(cuMemsetD8Async)                                                           \
  X(cuMemsetD32Async)                                                          \
  X(cuIpcGetMemHandle)                                                         \
  X(cuIpcOpenMemHandle)                                                        \
  X(cuIpcCloseMemHandle)                                                       \
  X(cuIpcGetEventHandle)                                                       \
  X(cuIpcOpenEventHandle)                                                      \
  X(cuMemPoolCreate)                                                           \
  X(cuMemPoolDestroy)                                                          \
  X(cuMemPoolSetAttribute)                                                     \
  X(cuMemPoolGetAttribute)                                                     \
  X(cuMemPoolSetAccess)                                                        \
  X(cuMemPoolGetAccess)                                                        \
  X(cuMemPoolTrimTo)                                                           \
  X(cuMemPoolExportToShareableHandle)                                          \
  X(cuMemPoolImportFromShareableHandle)                                        \
  X(cuMemPoolExportPointer)                                                    \
  X(cuMemPoolImportPointer)                                                    \
  X(cuMemAllocFromPoolAsync)                                                   \
  X(cuMemFreeAsync)                                                            \
  X(cuMemCreate)                                                               \
  X(cuMemRelease)                                                              \
  X(cuMemExportToShareableHandle)                                              \
  X(cuMemImportFromShareableHandle)                                            \
  X(cuMemAddressReserve)                                                       \
  X(cuMemAddressFree)                                                          \
  X(cuMemMap)                                                                  \
  X(cuMemUnmap)                                                                \
  X(cuMemSetAccess)                                                            \
  X(cuMemGetAllocationGranularity)                                             \
  X(cuMemGetAllocationPropertiesFromHandle)                                    \
  X(cuMemRetainAllocationHandle)                                               \
  X(cuMemHostAlloc)                                                            \
  X(cuMemFreeHost)                                                             \
  X(cuMemHostRegister)                                                         \
  X(cuMemHostUnregister)                                                       \
  X(cuModuleLoadData)                                                          \
  X(cuModuleUnload)                                                            \
  X(cuModuleGetFunction)                                                       \
  X(cuLaunchKernel)                                                            \
  X(cuMemHostGetDevicePointer)                                                 \
  X(cuStreamCreate)                                                            \
  X(cuStreamDestroy)                                                           \
  X(cuStreamSynchronize)                                                       \
  X(cuStreamQuery)                                                             \
  X(cuStreamWaitEvent)                                                         \
  X(cuLaunchHostFunc)                                                          \
  X(cuStreamWriteValue32)                                                      \
  X(cuStreamWriteValue64)                                                      \
  X(cuStreamWaitValue32)                                                       \
  X(cuStreamWaitValue64)                                                       \
  X(cuEventCreate)                                                             \
  X(cuEventDestroy)                                                            \
  X(cuEventRecord)                                                             \
  X(cuEventQuery)                                                              \
  X(cuEventSynchronize)                                                        \
  X(cuEventElapsedTime)

/* The table. Each member has the type of the cuda.h prototype (so
 * gpuipc__cu.cuMemAlloc has cuMemAlloc_v2's type, as cuda.h's macro
 * expands the member name too). */
typedef struct gpuipc__cu_table {
#define GPUIPC__CU_MEMBER(name) __typeof__(&name) name;
  GPUIPC__CU_FUNCS(GPUIPC__CU_MEMBER)
#undef GPUIPC__CU_MEMBER
} gpuipc__cu_table;

extern gpuipc__cu_table gpuipc__cu;

/* Loads and initializes the driver once (thread-safe), then on every call
 * checks the fork guard. Returns GPUIPC_OK, GPUIPC_E_NO_DRIVER,
 * GPUIPC_E_FORKED or GPUIPC_E_DRIVER, with the detail recorded. Cheap after
 * the first call: one atomic load and one flag test. */
gpuipc_status gpuipc__driver(void);

/* Loads the library and resolves the table without calling cuInit. Used by
 * tests that check loading. */
gpuipc_status gpuipc__driver_load(void);

/* Call a table entry, turning a missing entry point into
 * CUDA_ERROR_NOT_FOUND: CUresult r = GPUIPC__CU(cuMemAlloc, &p, n); */
#define GPUIPC__CU(fn, ...)                                                    \
  (GPUIPC__LIKELY(gpuipc__cu.fn != NULL) ? gpuipc__cu.fn(__VA_ARGS__)          \
                                         : CUDA_ERROR_NOT_FOUND)

/* Call and, on failure, record the error and return from the enclosing
 * function with the mapped status. The detail names the call. */
#define GPUIPC__CU_CHECK(fn, ...)                                              \
  do {                                                                         \
    CUresult gpuipc__r = GPUIPC__CU(fn, __VA_ARGS__);                          \
    if (GPUIPC__UNLIKELY(gpuipc__r != CUDA_SUCCESS))                           \
      return gpuipc__fail_cuda(gpuipc__r, #fn, NULL);                          \
  } while (0)
#define GPUIPC__CU_CHECK_GOTO(res, label, fn, ...)                             \
  do {                                                                         \
    CUresult gpuipc__r = GPUIPC__CU(fn, __VA_ARGS__);                          \
    if (GPUIPC__UNLIKELY(gpuipc__r != CUDA_SUCCESS)) {                         \
      (res) = gpuipc__fail_cuda(gpuipc__r, #fn, NULL);                         \
      goto label;                                                              \
    }                                                                          \
  } while (0)

/* The name of a CUresult ("CUDA_ERROR_INVALID_VALUE"); works without a
 * driver for the codes cuda.h defines. */
const char *gpuipc__cuda_error_name(int curesult);
/* Maps a CUresult to the closest gpuipc status. */
gpuipc_status gpuipc__status_from_cuda(int curesult);

/* ---- devices (device.c) -------------------------------------------------- */

/* Resolves a device named by uuid (when not NULL) or else by ordinal to a
 * local ordinal: GPUIPC_E_DEVICE_NOT_VISIBLE for a uuid not visible here,
 * GPUIPC_E_NO_DEVICE for an ordinal out of range. By uuid it is
 * gpuipc_device_from_uuid (the table of UUIDs is read once per process). */
gpuipc_status gpuipc__resolve_device(const gpuipc_uuid *uuid, int ordinal,
                                     int *out /* OUT */);

/* The IMEX channels that fabric handles (CU_MEM_HANDLE_TYPE_FABRIC) need.
 * cuda.h (cuMemCreate, cuMemPoolCreate) asks for two things: the driver's
 * character device nvidia-caps-imex-channels listed in /proc/devices, and
 * a channel file /dev/nvidia-caps-imex-channels/channel<N> that the user
 * can open; a process without one is refused (CUDA_ERROR_NOT_PERMITTED, as
 * documented for the imports). gpuipc shares no memory by fabric handles
 * yet: `gpuipc doctor` and the fabric conformance test report this state
 * beside the driver's answers, so that a refusal names what is missing. */
#define GPUIPC__IMEX_DIR "/dev/nvidia-caps-imex-channels"
#define GPUIPC__IMEX_MAX 16
typedef struct gpuipc__imex {
  int dir_errno; /* 0: the directory was listed; else why not (ENOENT: missing) */
  int major;     /* nvidia-caps-imex-channels in /proc/devices; -1: not listed */
  int count;     /* entries of the directory (the first GPUIPC__IMEX_MAX below) */
  struct {
    char name[256]; /* "channel0" */
    int open_errno; /* 0: this process can open it (read-only) */
  } channel[GPUIPC__IMEX_MAX];
} gpuipc__imex;

/* Fills *x: lists the directory (names sorted), tries to open each entry
 * read-only (and closes it again), finds the device's major number. Needs
 * no driver; creates nothing. */
void gpuipc__imex_probe(gpuipc__imex *x /* OUT */);
/* The state in one line, e.g. "/dev/nvidia-caps-imex-channels is missing
 * (nvidia-caps-imex-channels is not in /proc/devices)" or
 * "/dev/nvidia-caps-imex-channels: channel0 (opens)". */
void gpuipc__imex_describe(const gpuipc__imex *x, char *buf, size_t cap);

/* ---- contexts ------------------------------------------------------------ */

/* gpuipc works in each device's primary context and restores whatever
 * context the caller had current (DESIGN rule 5). Usage:
 *   gpuipc__ctx_guard g;
 *   GPUIPC__CHECK(gpuipc__ctx_enter(&g, ordinal));
 *   ... driver calls ...
 *   gpuipc__ctx_leave(&g);
 * The primary context is retained once per device for the life of the
 * process (cached), so enter/leave cost one push and one pop, or nothing when
 * the primary context is already current. */
typedef struct gpuipc__ctx_guard {
  CUcontext pushed; /* NULL when nothing was pushed */
} gpuipc__ctx_guard;

gpuipc_status gpuipc__ctx_enter(gpuipc__ctx_guard *g, int ordinal);
void gpuipc__ctx_leave(gpuipc__ctx_guard *g);
/* The retained primary context of a device (retains it on first use). */
gpuipc_status gpuipc__primary_ctx(int ordinal, CUcontext *ctx /* OUT */);

#endif /* GPUIPC_CORE_LAYER_H */
