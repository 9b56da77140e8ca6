/*
 * gpuipc.h: share CUDA device memory, pinned host memory and GPU-side
 * synchronization between processes on one machine.
 *
 * This header is the specification of the public API. Every function says
 * what it does, what it returns, who owns what, and which threads may call it.
 *
 * Conventions
 * - Every function that can fail returns a gpuipc_status. GPUIPC_OK is 0;
 *   every other value is an error. On error, gpuipc_last_error() returns a
 *   message, private to the calling thread, that names what failed (for
 *   driver failures: the driver call and the CUDA error's name).
 * - Objects are opaque. Each has a create/destroy (or open/close) pair, and
 *   every destroy/close accepts NULL and does nothing with it.
 * - The library never prints except through its logger (GPUIPC_LOG), never
 *   exits and never aborts on bad input.
 * - The CUDA driver (libcuda.so.1) is loaded at run time on first use; the
 *   library links against neither libcuda nor libcudart.
 *
 * Versioning: same major version = ABI compatible. A program built against
 * an older header of the same major version keeps working with a newer
 * library. Status codes are only ever appended; option structs start with
 * their size so that new fields can be added at the end.
 */
#ifndef GPUIPC_H
#define GPUIPC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(GPUIPC_BUILDING) && defined(__GNUC__)
#define GPUIPC_API __attribute__((visibility("default")))
#else
#define GPUIPC_API
#endif

/* GPUIPC_EXPERIMENTAL marks a function of the experimental tier: tensor
 * sets (gpuipc/sets.h), the tensor vocabulary and meta (gpuipc/tensor.h),
 * batches and broadcast, and the calls added last (gpuipc_conn_wait,
 * gpuipc_conn_collect, gpuipc_arena_release, gpuipc_buffer_get_holders,
 * gpuipc_buffer_release_when_done, gpuipc_buffer_export_range,
 * gpuipc_cache_trim). Such a function works and is tested like any other,
 * but its signature or behaviour may still change in a minor release;
 * the rest of the API changes only with the major version. Experimental
 * functions are exported in their own version node of the library
 * (GPUIPC_EXPERIMENTAL_0.1, src/gpuipc.map), so that a program can see
 * which of them it links (objdump -T) and one built against a changed
 * function fails to load instead of calling it wrongly. docs/api.md says
 * what the tier promises. The macro expands to nothing; a program that
 * wants to hear of every experimental call it makes defines
 * GPUIPC_WARN_EXPERIMENTAL before including gpuipc.h (gcc, clang: a
 * deprecation warning at each use). */
#if defined(GPUIPC_WARN_EXPERIMENTAL) && defined(__GNUC__)
#define GPUIPC_EXPERIMENTAL                                                    \
  __attribute__((deprecated("experimental: may change in a minor release")))
#else
#define GPUIPC_EXPERIMENTAL
#endif

#define GPUIPC_VERSION_MAJOR 0
#define GPUIPC_VERSION_MINOR 1
#define GPUIPC_VERSION_PATCH 0
/* 0xMMmmpp: compare with gpuipc_version() at run time. */
#define GPUIPC_VERSION_HEX                                                     \
  ((GPUIPC_VERSION_MAJOR << 16) | (GPUIPC_VERSION_MINOR << 8) |                \
   GPUIPC_VERSION_PATCH)
#define GPUIPC_VERSION_STRING "0.1.0"

/* Returns GPUIPC_VERSION_HEX of the library actually loaded.
 * A program may check (gpuipc_version() >> 16) == GPUIPC_VERSION_MAJOR.
 * Thread-safe; needs no driver. */
GPUIPC_API unsigned gpuipc_version(void);
/* The same as a string, "MAJOR.MINOR.PATCH". Static storage. */
GPUIPC_API const char *gpuipc_version_string(void);

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

/*
 * One list builds both the enum and gpuipc_strerror(). New codes are only
 * ever appended at the end; none is ever removed or renumbered.
 */
#define GPUIPC_STATUS_MAP(X)                                                   \
  X(OK, 0, "success")                                                          \
  X(E_INVALID_ARG, 1, "invalid argument")                                      \
  X(E_NO_MEMORY, 2, "out of host memory")                                      \
  X(E_NO_DRIVER, 3, "no usable CUDA driver")                                   \
  X(E_DRIVER, 4, "CUDA driver call failed")                                    \
  X(E_FORKED, 5, "CUDA used in a process forked after CUDA was initialized")  \
  X(E_NOT_SUPPORTED, 6, "not supported on this device or driver")             \
  X(E_NO_DEVICE, 7, "no such device")                                          \
  X(E_DEVICE_NOT_VISIBLE, 8, "device not visible in this process")             \
  X(E_OUT_OF_DEVICE_MEMORY, 9, "out of device memory")                         \
  X(E_TRUNCATED, 10, "descriptor or message truncated")                        \
  X(E_BAD_MAGIC, 11, "bad magic number")                                       \
  X(E_BAD_VERSION, 12, "unsupported format or protocol version")               \
  X(E_BAD_CHECKSUM, 13, "checksum mismatch")                                   \
  X(E_BAD_KIND, 14, "unknown kind")                                            \
  X(E_OUT_OF_RANGE, 15, "offset or size outside the mapped range")             \
  X(E_FOREIGN_MACHINE, 16, "descriptor comes from another machine")            \
  X(E_FOREIGN_NAMESPACE, 17, "descriptor comes from another pid namespace")    \
  X(E_NEED_FD, 18, "a file descriptor is needed to open this")                 \
  X(E_PERMISSION, 19, "permission denied")                                     \
  X(E_PEER_REFUSED, 20, "peer refused by credential check")                    \
  X(E_PEER_GONE, 21, "peer process is gone")                                   \
  X(E_TIMEOUT, 22, "timed out")                                                \
  X(E_WOULD_BLOCK, 23, "operation would block")                                \
  X(E_PROTOCOL, 24, "protocol error")                                          \
  X(E_CLOSED, 25, "connection closed")                                         \
  X(E_STALE, 26, "stale: the exporter freed or reallocated this memory")       \
  X(E_BUSY, 27, "resource busy")                                               \
  X(E_NOT_FOUND, 28, "not found")                                              \
  X(E_EXISTS, 29, "already exists")                                            \
  X(E_SYSTEM, 30, "system call failed")                                        \
  X(E_LIMIT, 31, "limit exceeded")                                             \
  X(E_INTERNAL, 32, "internal error")                                          \
  X(E_CANCELED, 33, "canceled")                                                \
  X(E_USER, 34, "user callback reported an error")

typedef enum gpuipc_status {
#define GPUIPC__STATUS_ENUM(name, value, text) GPUIPC_##name = value,
  GPUIPC_STATUS_MAP(GPUIPC__STATUS_ENUM)
#undef GPUIPC__STATUS_ENUM
  GPUIPC__STATUS_END
} gpuipc_status;

/* Short static description of a status code; "unknown status" for values not
 * in the list. Thread-safe; needs no driver. */
GPUIPC_API const char *gpuipc_strerror(gpuipc_status status);
/* The status's name, e.g. "GPUIPC_E_NO_DRIVER". Static storage. */
GPUIPC_API const char *gpuipc_status_name(gpuipc_status status);

/* The detail message of the last failure on the calling thread: the call that
 * failed and why, e.g.
 *   "cuMemPoolImportPointer: CUDA_ERROR_INVALID_VALUE (buffer 7 of peer 4121)".
 * Valid until the thread's next gpuipc call; never NULL ("" before any
 * failure). Successful calls do not clear it. */
GPUIPC_API const char *gpuipc_last_error(void);

/* For driver failures: the CUresult of the last failing driver call on this
 * thread (0 if the last failure was not a driver failure). */
GPUIPC_API int gpuipc_last_cuda_error(void);

/* For system failures: the errno of the last failing system call on this
 * thread (0 if the last failure was not a system failure). */
GPUIPC_API int gpuipc_last_errno(void);

/* ------------------------------------------------------------------------ */
/* Logging                                                                  */
/* ------------------------------------------------------------------------ */

/*
 * Set by the environment: GPUIPC_LOG=error|warn|info|debug|trace (default
 * warn), GPUIPC_LOG_FILE=path (a "%p" in it is replaced by the pid; default
 * stderr). Each line starts "host:pid:tid gpuipc LEVEL [module] ".
 */
typedef enum gpuipc_log_level {
  GPUIPC_LOG_OFF = 0,
  GPUIPC_LOG_ERROR = 1,
  GPUIPC_LOG_WARN = 2,
  GPUIPC_LOG_INFO = 3,
  GPUIPC_LOG_DEBUG = 4,
  GPUIPC_LOG_TRACE = 5
} gpuipc_log_level;

/* Override the level from GPUIPC_LOG at run time. Thread-safe. */
GPUIPC_API void gpuipc_log_set_level(gpuipc_log_level level);
GPUIPC_API gpuipc_log_level gpuipc_log_get_level(void);

/* ------------------------------------------------------------------------ */
/* Driver                                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Load the CUDA driver and initialize it (cuInit). Called implicitly by every
 * function that needs the driver; calling it explicitly lets a program learn
 * early whether CUDA is usable. Idempotent and thread-safe.
 *
 * The driver is libcuda.so.1, or the library named by GPUIPC_CUDA_DRIVER.
 * Returns GPUIPC_E_NO_DRIVER when it cannot be loaded or is not a CUDA
 * driver, GPUIPC_E_FORKED in a child forked after the parent initialized
 * CUDA (exec a new program, or start children with gpuipc's spawn helper),
 * GPUIPC_E_DRIVER when cuInit fails.
 */
GPUIPC_API gpuipc_status gpuipc_init(void);

/* The driver's version as CUDA encodes it (1000*major + 10*minor), from
 * cuDriverGetVersion. */
GPUIPC_API gpuipc_status gpuipc_driver_version(int *version /* OUT */);

/* The path or name of the driver library in use ("libcuda.so.1" unless
 * GPUIPC_CUDA_DRIVER says otherwise). Static storage; needs no driver. */
GPUIPC_API const char *gpuipc_driver_path(void);

/* ------------------------------------------------------------------------ */
/* Devices                                                                  */
/* ------------------------------------------------------------------------ */

/* A device is named across processes by its 16-byte UUID, never by ordinal:
 * CUDA_VISIBLE_DEVICES may differ between processes. */
typedef struct gpuipc_uuid {
  uint8_t bytes[16];
} gpuipc_uuid;

/* Number of devices visible to this process. */
GPUIPC_API gpuipc_status gpuipc_device_count(int *count /* OUT */);
/* UUID of the visible device with this ordinal. */
GPUIPC_API gpuipc_status gpuipc_device_uuid(int ordinal, gpuipc_uuid *uuid /* OUT */);
/* Local ordinal of the device with this UUID; GPUIPC_E_DEVICE_NOT_VISIBLE if
 * the device exists but is hidden from this process (or does not exist). */
GPUIPC_API gpuipc_status gpuipc_device_from_uuid(const gpuipc_uuid *uuid,
                                                 int *ordinal /* OUT */);
/* Formats a UUID as "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's
 * form) into buf, which must hold at least GPUIPC_UUID_STRLEN bytes. */
#define GPUIPC_UUID_STRLEN 41
GPUIPC_API void gpuipc_uuid_format(const gpuipc_uuid *uuid, char *buf);
/* Parses that form (the "GPU-" prefix is optional). */
GPUIPC_API gpuipc_status gpuipc_uuid_parse(const char *text, gpuipc_uuid *uuid /* OUT */);

#ifdef __cplusplus
}
#endif

/* The layers above the core, each in its own header. The optional MPI
 * helper (gpuipc/mpi.h, library gpuipc_mpi) is included on its own. */
#include "gpuipc/handle.h"
#include "gpuipc/conn.h"
#include "gpuipc/tensor.h"
#include "gpuipc/sets.h"
#include "gpuipc/proc.h"
#include "gpuipc/interop.h"
#include "gpuipc/xfer.h"

#endif /* GPUIPC_H */
