/*
 * driver.c: owns the CUDA driver library: loading it at run time (dlopen +
 * cuGetProcAddress; which library, GPUIPC_CUDA_DRIVER), the entry-point
 * table, cuInit, the fork guard, the translation of CUresult into gpuipc
 * statuses, the cache of retained primary contexts (with the stream room
 * reserved in each), and the context guard that makes one current and
 * restores the caller's.
 */
#include "core_int.h"
#include "stats.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

gpuipc__cu_table gpuipc__cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static gpuipc_status load_status = GPUIPC_E_NO_DRIVER;
static char load_error[512];
static void *lib_handle;

/* 0: not initialized; 1: cuInit succeeded in this process. */
static atomic_int initialized;
/* Set in a child forked after initialization. A CUDA context does not
 * survive fork: every driver call in such a child fails or hangs, so gpuipc
 * refuses before making one. */
static atomic_int forked_after_init;
static CUresult init_result = CUDA_SUCCESS;
static bool init_done;

static void atfork_child(void) {
  if (atomic_load(&initialized))
    atomic_store(&forked_after_init, 1);
}

GPUIPC__PARAM(cuda_driver, "GPUIPC_CUDA_DRIVER", GPUIPC__PARAM_EACH_USE,
              "libcuda.so.1",
              "the CUDA driver library to load instead (the tests' emulator, a "
              "forward-compatibility driver); read when the driver is loaded")

const char *gpuipc_driver_path(void) {
  const char *p = param_cuda_driver();
  return (p && *p) ? p : "libcuda.so.1";
}

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t,
                                CUdriverProcAddressQueryResult *);

/* cuGetProcAddress returns the variant of an entry point that was current at
 * the CUDA version it is asked for. gpuipc's table has the prototypes that
 * cuda.h maps each plain name to, and those are the variants current at
 * CUDA 12.0 -- except the few listed here, whose default variant is newer.
 * Asking at the header's own CUDA_VERSION would be wrong: CUDA 13.0 added
 * cuCtxSynchronize_v2(CUcontext) and cuCtxGetDevice_v2(CUdevice *,
 * CUcontext), yet cuda.h still maps the plain names to the old signatures;
 * on a 13.0 driver the call would land in a function with other arguments
 * (seen as CUDA_ERROR_CONTEXT_IS_DESTROYED from cuCtxSynchronize). An entry
 * appended to GPUIPC__CU_FUNCS whose cuda.h default is newer than 12.0 (see
 * the PFN_<name>_v<version> typedefs in cudaTypedefs.h) goes here. */
#define GPUIPC__CU_API_VERSION 12000
static int api_version(const char *name) {
  static const struct {
    const char *name;
    int version;
  } newer[] = {
      {"cuEventElapsedTime", 12080}, /* cuEventElapsedTime_v2 */
      {"cuMemcpyBatchAsync", 13000}, /* _v2, without failIdx (used only
                                       * from a 13.0 driver on) */
  };
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(newer); i++)
    if (strcmp(name, newer[i].name) == 0)
      return newer[i].version;
  return GPUIPC__CU_API_VERSION;
}

static void load_driver(void) {
  const char *path = gpuipc_driver_path();
  pthread_atfork(NULL, NULL, atfork_child);

  lib_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib_handle == NULL) {
    const char *why = dlerror();
    snprintf(load_error, sizeof load_error,
             "no CUDA driver: cannot load %s (%s)%s", path,
             why ? why : "unknown error",
             strcmp(path, "libcuda.so.1") == 0
                 ? "; is the NVIDIA driver installed? GPUIPC_CUDA_DRIVER "
                   "names another driver library"
                 : "");
    load_status = GPUIPC_E_NO_DRIVER;
    return;
  }

  /* cuGetProcAddress_v2 (CUDA 12.0+) is the only symbol taken by name; every
   * other entry point comes through it, at our header's API version. */
  get_proc_fn get_proc = (get_proc_fn)dlsym(lib_handle, "cuGetProcAddress_v2");
  if (get_proc == NULL) {
    snprintf(load_error, sizeof load_error,
             "no CUDA driver: %s has no cuGetProcAddress_v2: it is not a CUDA "
             "driver, or one older than CUDA 12.0",
             path);
    dlclose(lib_handle);
    lib_handle = NULL;
    load_status = GPUIPC_E_NO_DRIVER;
    return;
  }

  int missing = 0;
  const char *first_missing = NULL;
#define GPUIPC__CU_RESOLVE(name)                                               \
  do {                                                                         \
    void *pfn = NULL;                                                          \
    CUdriverProcAddressQueryResult qr = CU_GET_PROC_ADDRESS_SUCCESS;           \
    CUresult r = get_proc(#name, &pfn, api_version(#name),                     \
                          CU_GET_PROC_ADDRESS_DEFAULT, &qr);                   \
    if (r != CUDA_SUCCESS || qr != CU_GET_PROC_ADDRESS_SUCCESS) {              \
      pfn = NULL;                                                              \
      missing++;                                                               \
      if (!first_missing)                                                      \
        first_missing = #name;                                                 \
      GPUIPC__DEBUG("driver", "entry point %s not found in %s", #name, path);  \
    }                                                                          \
    memcpy(&gpuipc__cu.name, &pfn, sizeof pfn);                                \
  } while (0);
  GPUIPC__CU_FUNCS(GPUIPC__CU_RESOLVE)
#undef GPUIPC__CU_RESOLVE

  if (gpuipc__cu.cuInit == NULL || gpuipc__cu.cuGetErrorName == NULL) {
    snprintf(load_error, sizeof load_error,
             "no CUDA driver: %s does not provide cuInit through "
             "cuGetProcAddress; it is not a CUDA driver",
             path);
    memset(&gpuipc__cu, 0, sizeof gpuipc__cu);
    dlclose(lib_handle);
    lib_handle = NULL;
    load_status = GPUIPC_E_NO_DRIVER;
    return;
  }
  if (missing)
    GPUIPC__INFO("driver",
                 "%s lacks %d entry point(s) gpuipc can use (first: %s); "
                 "features that need them report CUDA_ERROR_NOT_FOUND",
                 path, missing, first_missing);
  GPUIPC__DEBUG("driver", "loaded %s", path);
  load_status = GPUIPC_OK;
}

gpuipc_status gpuipc__driver_load(void) {
  pthread_once(&load_once, load_driver);
  if (load_status != GPUIPC_OK)
    return gpuipc__fail(load_status, "%s", load_error);
  return GPUIPC_OK;
}


static gpuipc_status forked_error(void) {
  return gpuipc__fail(
      GPUIPC_E_FORKED,
      "this process was forked after its parent initialized CUDA, and CUDA "
      "cannot be used in such a child: exec a new program after fork, or "
      "start children with gpuipc_spawn()");
}

gpuipc_status gpuipc__driver(void) {
  if (GPUIPC__LIKELY(atomic_load_explicit(&initialized, memory_order_acquire))) {
    if (GPUIPC__UNLIKELY(atomic_load_explicit(&forked_after_init,
                                              memory_order_relaxed)))
      return forked_error();
    return GPUIPC_OK;
  }
  GPUIPC__CHECK(gpuipc__driver_load());
  if (atomic_load(&forked_after_init))
    return forked_error();

  pthread_mutex_lock(&init_lock);
  if (!init_done) {
    init_result = gpuipc__cu.cuInit(0);
    init_done = true;
    if (init_result == CUDA_SUCCESS) {
      atomic_store_explicit(&initialized, 1, memory_order_release);
      GPUIPC__DEBUG("driver", "cuInit succeeded");
    }
  }
  CUresult r = init_result;
  pthread_mutex_unlock(&init_lock);
  if (r != CUDA_SUCCESS) {
    if (r == CUDA_ERROR_NO_DEVICE)
      return gpuipc__fail(GPUIPC_E_NO_DEVICE,
                          "cuInit: CUDA_ERROR_NO_DEVICE (the driver %s is "
                          "loaded but sees no GPU; check CUDA_VISIBLE_DEVICES)",
                          gpuipc_driver_path());
    return gpuipc__fail_cuda(r, "cuInit", "driver %s", gpuipc_driver_path());
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc_init(void) { return gpuipc__driver(); }

gpuipc_status gpuipc_driver_version(int *version) {
  if (version == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_driver_version: NULL");
  GPUIPC__CHECK(gpuipc__driver());
  GPUIPC__CU_CHECK(cuDriverGetVersion, version);
  return GPUIPC_OK;
}

/* ---- error translation ---------------------------------------------------- */

#define GPUIPC__CUDA_ERRORS(X)                                                 \
  X(CUDA_SUCCESS)                                                              \
  X(CUDA_ERROR_INVALID_VALUE)                                                  \
  X(CUDA_ERROR_OUT_OF_MEMORY)                                                  \
  X(CUDA_ERROR_NOT_INITIALIZED)                                                \
  X(CUDA_ERROR_DEINITIALIZED)                                                  \
  X(CUDA_ERROR_NO_DEVICE)                                                      \
  X(CUDA_ERROR_INVALID_DEVICE)                                                 \
  X(CUDA_ERROR_INVALID_CONTEXT)                                                \
  X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT)                                        \
  X(CUDA_ERROR_MAP_FAILED)                                                     \
  X(CUDA_ERROR_ALREADY_MAPPED)                                                 \
  X(CUDA_ERROR_INVALID_HANDLE)                                                 \
  X(CUDA_ERROR_NOT_FOUND)                                                      \
  X(CUDA_ERROR_NOT_READY)                                                      \
  X(CUDA_ERROR_ILLEGAL_ADDRESS)                                                \
  X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)                                    \
  X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED)                                        \
  X(CUDA_ERROR_CONTEXT_IS_DESTROYED)                                           \
  X(CUDA_ERROR_NOT_PERMITTED)                                                  \
  X(CUDA_ERROR_NOT_SUPPORTED)                                                  \
  X(CUDA_ERROR_SYSTEM_NOT_READY)                                               \
  X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)                                         \
  X(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE)                                 \
  X(CUDA_ERROR_OPERATING_SYSTEM)                                               \
  X(CUDA_ERROR_ILLEGAL_STATE)                                                  \
  X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)                                     \
  X(CUDA_ERROR_LAUNCH_FAILED)                                                  \
  X(CUDA_ERROR_UNKNOWN)

const char *gpuipc__cuda_error_name(int curesult) {
  if (gpuipc__cu.cuGetErrorName) {
    const char *name = NULL;
    if (gpuipc__cu.cuGetErrorName((CUresult)curesult, &name) == CUDA_SUCCESS &&
        name)
      return name;
  }
  switch (curesult) {
#define GPUIPC__CUDA_ERROR_CASE(e)                                             \
  case e:                                                                      \
    return #e;
    GPUIPC__CUDA_ERRORS(GPUIPC__CUDA_ERROR_CASE)
#undef GPUIPC__CUDA_ERROR_CASE
  default:
    return "CUDA_ERROR_(unknown code)";
  }
}

gpuipc_status gpuipc__status_from_cuda(int curesult) {
  switch (curesult) {
  case CUDA_SUCCESS:
    return GPUIPC_OK;
  case CUDA_ERROR_OUT_OF_MEMORY:
    return GPUIPC_E_OUT_OF_DEVICE_MEMORY;
  case CUDA_ERROR_NO_DEVICE:
  case CUDA_ERROR_INVALID_DEVICE:
    return GPUIPC_E_NO_DEVICE;
  case CUDA_ERROR_NOT_SUPPORTED:
    return GPUIPC_E_NOT_SUPPORTED;
  case CUDA_ERROR_NOT_PERMITTED:
    return GPUIPC_E_PERMISSION;
  case CUDA_ERROR_NOT_READY:
    return GPUIPC_E_WOULD_BLOCK;
  default:
    return GPUIPC_E_DRIVER;
  }
}

gpuipc_status gpuipc__fail_cuda(int curesult, const char *call,
                                const char *fmt, ...) {
  char detail[384] = "";
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
  }
  gpuipc_status s = gpuipc__fail(gpuipc__status_from_cuda(curesult),
                                 "%s: %s%s%s%s", call,
                                 gpuipc__cuda_error_name(curesult),
                                 detail[0] ? " (" : "", detail,
                                 detail[0] ? ")" : "");
  gpuipc__set_cuda_error(curesult);
  return s;
}

/* ---- primary contexts ------------------------------------------------------ */

#define GPUIPC__MAX_DEVICES 64
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(CUcontext) primary[GPUIPC__MAX_DEVICES];

GPUIPC__PARAM(stream_room, "GPUIPC_STREAM_ROOM", GPUIPC__PARAM_ONCE, "0",
              "streams each device's context is given room for when gpuipc "
              "first uses it (0: none)");

/* The stream room. The driver keeps a context's stream resources in a
 * pool that grows in steps, and a cuStreamCreate that needs a new step
 * waits until the context's streams have drained: behind a stream held on
 * a cuStreamWaitValue (a producer's stream waiting for a word the host
 * writes later) it waits as long as the stream is held (measured on an
 * H200, driver 580: the 34th stream of a context waits; a context that
 * once had 256 streams, destroyed since, creates 128 at once behind the
 * same held stream; docs/driver-behaviour.md). gpuipc makes a stream per
 * connection (its reclaim stream), often while the application holds its
 * own, so it grows the pool once, when it first uses a device, by creating
 * and destroying this many streams, when told to. Each stream of room
 * costs about 0.55 MiB of device memory and 30 us (the H200): 128 are
 * 70 MiB. Not by default: with every process of the GPU suite making room
 * for 128 (or 256), hundreds of processes at once, the suite ran at half
 * its speed and connections timed out, the cause not established. Growing
 * it later, ahead of need, cannot be made safe: a thread that makes room
 * fills it as it goes, so the caller's next stream needs the growth that
 * thread waits for. */
static int stream_room(void) {
  const char *e = param_stream_room();
  if (e == NULL || *e == '\0')
    return 0;
  char *end;
  long n = strtol(e, &end, 10);
  if (*end != '\0' || n < 0 || n > 65536) {
    GPUIPC__WARN("driver", "GPUIPC_STREAM_ROOM=%s: not a number from 0 to "
                 "65536; using none", e);
    return 0;
  }
  return (int)n;
}

static void stream_room_make(CUcontext c, int n) {
  if (GPUIPC__CU(cuCtxPushCurrent, c) != CUDA_SUCCESS)
    return;
  CUstream *st = calloc((size_t)n, sizeof *st);
  int made = 0;
  uint64_t t0 = gpuipc__now_ns();
  while (st && made < n &&
         GPUIPC__CU(cuStreamCreate, &st[made], CU_STREAM_NON_BLOCKING) ==
             CUDA_SUCCESS)
    made++;
  for (int i = 0; i < made; i++)
    GPUIPC__CU(cuStreamDestroy, st[i]);
  free(st);
  CUcontext popped;
  GPUIPC__CU(cuCtxPopCurrent, &popped);
  GPUIPC__DEBUG("driver", "stream room for %d streams made in %.2f ms", made,
                (double)(gpuipc__now_ns() - t0) / 1e6);
}

struct room_job {
  CUcontext c;
  int n;
};

static void *stream_room_thread(void *arg) {
  struct room_job j = *(struct room_job *)arg;
  free(arg);
  stream_room_make(j.c, j.n);
  return NULL;
}

/* A context that was not active before gpuipc retained it has no stream
 * of the application's yet, so nothing can hold the growth: it is made
 * here. In a context the application already uses, one of its streams may
 * be held right now, and the growth would wait for it: a thread of its own
 * makes it (and waits, if it must, alone). */
static void stream_room_reserve(CUcontext c, int n, bool was_active) {
  if (!was_active) {
    stream_room_make(c, n);
    return;
  }
  struct room_job *j = malloc(sizeof *j);
  if (j == NULL)
    return;
  *j = (struct room_job){c, n};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old); /* its signals are the app's */
  pthread_t t;
  if (pthread_create(&t, &attr, stream_room_thread, j) != 0)
    free(j);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
}

gpuipc_status gpuipc__primary_ctx(int ordinal, CUcontext *ctx) {
  GPUIPC__CHECK(gpuipc__driver());
  if (ordinal < 0 || ordinal >= GPUIPC__MAX_DEVICES)
    return gpuipc__fail(GPUIPC_E_NO_DEVICE, "device ordinal %d out of range",
                        ordinal);
  CUcontext c = atomic_load_explicit(&primary[ordinal], memory_order_acquire);
  if (GPUIPC__LIKELY(c != NULL)) {
    *ctx = c;
    return GPUIPC_OK;
  }
  gpuipc_status s = GPUIPC_OK;
  pthread_mutex_lock(&ctx_lock);
  c = atomic_load(&primary[ordinal]);
  if (c == NULL) {
    CUdevice dev;
    CUresult r = GPUIPC__CU(cuDeviceGet, &dev, ordinal);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuDeviceGet", "ordinal %d", ordinal);
      goto out;
    }
    int room = stream_room();
    unsigned flags = 0;
    int active = 1;
    if (room > 0 && GPUIPC__CU(cuDevicePrimaryCtxGetState, dev, &flags,
                               &active) != CUDA_SUCCESS)
      active = 1;
    /* Retained for the life of the process: releasing the primary context
     * would destroy every allocation and import made in it. */
    r = GPUIPC__CU(cuDevicePrimaryCtxRetain, &c, dev);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuDevicePrimaryCtxRetain", "device %d",
                            ordinal);
      goto out;
    }
    if (room > 0)
      stream_room_reserve(c, room, active != 0);
    atomic_store_explicit(&primary[ordinal], c, memory_order_release);
    CUuuid u;
    if (GPUIPC__CU(cuDeviceGetUuid, &u, dev) != CUDA_SUCCESS)
      memset(&u, 0, sizeof u);
    gpuipc__stats_device(ordinal, (const uint8_t *)u.bytes);
  }
  *ctx = c;
out:
  pthread_mutex_unlock(&ctx_lock);
  return s;
}

gpuipc_status gpuipc__ctx_enter(gpuipc__ctx_guard *g, int ordinal) {
  g->pushed = NULL;
  CUcontext want;
  GPUIPC__CHECK(gpuipc__primary_ctx(ordinal, &want));
  CUcontext cur = NULL;
  CUresult r = GPUIPC__CU(cuCtxGetCurrent, &cur);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuCtxGetCurrent", NULL);
  if (cur == want)
    return GPUIPC_OK;
  r = GPUIPC__CU(cuCtxPushCurrent, want);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuCtxPushCurrent", "device %d", ordinal);
  g->pushed = want;
  return GPUIPC_OK;
}

void gpuipc__ctx_leave(gpuipc__ctx_guard *g) {
  if (g->pushed) {
    CUcontext popped = NULL;
    CUresult r = GPUIPC__CU(cuCtxPopCurrent, &popped);
    if (r != CUDA_SUCCESS || popped != g->pushed)
      GPUIPC__WARN("driver", "context stack changed under gpuipc (pop: %s)",
                   gpuipc__cuda_error_name(r));
    g->pushed = NULL;
  }
}
