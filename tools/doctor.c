/*
 * doctor.c: `gpuipc doctor`: can this machine share GPU memory between
 * processes, and by which mechanisms?
 *
 * It gathers everything first (system, driver, each device's attributes, the
 * peer matrix, the process side, the environment parameters) into one
 * report, then decides a verdict for each sharing mechanism, then walks the
 * report once (report()), writing it as aligned text or as one JSON object
 * (the keys are documented in docs/doctor.md and only ever added to). For
 * its verdicts it asks the driver only for attributes. One probe goes
 * further: fabric handles (CU_MEM_HANDLE_TYPE_FABRIC) are refused by the
 * driver for reasons no attribute tells (an IMEX channel this process can
 * open), so the doctor tries them on each device (gather_fabric: the
 * device's primary context, one VMM allocation and one pool, all given
 * back) and reports the call that refused and the IMEX channels. gpuipc
 * does not share memory by fabric handles yet, so the probe counts in no
 * verdict and is skipped under --quiet.
 *
 * It also says whether this process runs in a container (its pid or IPC
 * namespace is not the machine's first, its namespaces differ from those of
 * its pid 1, its cgroup names a container runtime) and which mechanisms
 * work with a peer in another container, and why (docs/doctor.md).
 *
 * Exit status: 0 when at least one mechanism is usable on at least one
 * device; 1 when the driver works but none is (including "no device");
 * 2 when there is no usable CUDA driver; 64 for a usage error.
 */
#include "cli.h"
#include "tree.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>

#define DOC_MAX_DEVICES 64
#define DOC_WIDTH 100   /* no human line is longer than this */
#define DOC_KEY_WIDTH 24 /* "  key...  " then the value at column 27 */
#define DOC_EXIT_USAGE 64

/* ---- what is gathered ------------------------------------------------------ */

/* Device attributes, in the order the human report lists them. */
enum doc_attr {
  A_CC_MAJOR,
  A_CC_MINOR,
  A_OVERLAP,
  A_ASYNC_ENGINES,
  A_UNIFIED,
  A_MEMPOOLS,
  A_MEMPOOL_TYPES,
  A_POSIX_FD,
  A_VMM,
  A_IPC_EVENT,
  A_FABRIC,
  A_MEMOPS64,
  A_WAIT_NOR,
  A_COUNT
};

static const struct {
  const char *key;   /* JSON key */
  const char *label; /* human label; NULL: printed specially */
  CUdevice_attribute attr;
  bool boolean;
} attr_info[A_COUNT] = {
    [A_CC_MAJOR] = {"cc_major", NULL, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    false},
    [A_CC_MINOR] = {"cc_minor", NULL, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    false},
    [A_OVERLAP] = {"device_overlap", "deviceOverlap", CU_DEVICE_ATTRIBUTE_GPU_OVERLAP,
                   true},
    [A_ASYNC_ENGINES] = {"async_engine_count", "async engines",
                         CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, false},
    [A_UNIFIED] = {"unified_addressing", "unified addressing",
                   CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, true},
    [A_MEMPOOLS] = {"memory_pools", "memory pools",
                    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, true},
    [A_MEMPOOL_TYPES] = {"mempool_handle_types_mask", NULL,
                         CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, false},
    [A_POSIX_FD] = {"posix_fd_handles", "POSIX-fd handles",
                    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    true},
    [A_VMM] = {"vmm", "VMM", CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
               true},
    [A_IPC_EVENT] = {"ipc_events", "IPC events", CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED,
                     true},
    [A_FABRIC] = {"fabric_handles", "fabric handles",
                  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, true},
    [A_MEMOPS64] = {"stream_memops_64bit", "stream memops 64-bit",
                    CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, true},
    [A_WAIT_NOR] = {"stream_wait_value_nor", "stream wait-value NOR",
                    CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, true},
};

/* The bits of CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES. */
static const struct {
  int bit;
  const char *name;
} handle_types[] = {
    {CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "posix_fd"},
    {CU_MEM_HANDLE_TYPE_WIN32, "win32"},
    {CU_MEM_HANDLE_TYPE_WIN32_KMT, "win32_kmt"},
    {CU_MEM_HANDLE_TYPE_FABRIC, "fabric"},
};

typedef struct doc_device {
  bool ok; /* cuDeviceGet succeeded */
  CUdevice dev;
  char name[256];
  bool have_name;
  char uuid[GPUIPC_UUID_STRLEN];
  bool have_uuid;
  char pci[64];
  bool have_pci;
  size_t total_mem;
  bool have_mem;
  int attr[A_COUNT];
  bool have_attr[A_COUNT];
  char errors[512]; /* queries that failed, "; "-separated */
} doc_device;

/* One ordered pair (row: the accessing device, column: the owner). */
typedef struct doc_peer {
  int can_access, access_supported, perf_rank, native_atomic;
  bool have_can_access, have_access_supported, have_perf_rank,
      have_native_atomic;
} doc_peer;

enum doc_mech { M_LEGACY, M_POOL_FD, M_VMM_FD, M_IPC_EVENT, M_MEMOPS, M_PEER, M_COUNT };

static const struct {
  const char *key;
  const char *label;
} mech_info[M_COUNT] = {
    [M_LEGACY] = {"legacy_handles", "legacy handles"},
    [M_POOL_FD] = {"pool_fds", "pool fds"},
    [M_VMM_FD] = {"vmm_fds", "VMM fds"},
    [M_IPC_EVENT] = {"ipc_events", "IPC events"},
    [M_MEMOPS] = {"stream_memops", "stream-memop ordering"},
    [M_PEER] = {"peer_access", "peer access"},
};

/* The namespaces a container gets, with the inode each has in the
 * machine's first (initial) namespace set where the kernel fixes it (pid,
 * IPC, UTS, user, cgroup; 0: mount and network have none). */
enum { NS_PID, NS_IPC, NS_MNT, NS_NET, NS_UTS, NS_USER, NS_CGROUP, NS_COUNT };
static const struct {
  const char *name;
  unsigned long long init_ino;
} ns_info[NS_COUNT] = {
    [NS_PID] = {"pid", 0xEFFFFFFCull},   [NS_IPC] = {"ipc", 0xEFFFFFFFull},
    [NS_MNT] = {"mnt", 0},               [NS_NET] = {"net", 0},
    [NS_UTS] = {"uts", 0xEFFFFFFEull},   [NS_USER] = {"user", 0xEFFFFFFDull},
    [NS_CGROUP] = {"cgroup", 0xEFFFFFFBull},
};

typedef struct doc_ns {
  unsigned long long self, pid1; /* inodes; 0: unknown */
  bool have_self, have_pid1;
  bool own; /* not the initial namespace (where that is known), or not pid
               1's */
} doc_ns;

/* With a peer in another container (its own pid, IPC and mount
 * namespaces, only the socket directory shared): what works. */
enum { XC_POOL_FD, XC_VMM_FD, XC_PINNED, XC_MEMOPS, XC_LIVENESS, XC_PEER_DEATH,
       XC_LEGACY, XC_IPC_EVENT, XC_PIDFD_GETFD, XC_COUNT };
static const struct {
  const char *key;
  const char *label;
} xc_info[XC_COUNT] = {
    [XC_POOL_FD] = {"pool_fds", "pool fds"},
    [XC_VMM_FD] = {"vmm_fds", "VMM fds"},
    [XC_PINNED] = {"pinned_host", "pinned host memfds"},
    [XC_MEMOPS] = {"stream_memops", "stream-memop ordering"},
    [XC_LIVENESS] = {"stale_checks", "stale-descriptor checks"},
    [XC_PEER_DEATH] = {"peer_death", "peer-death cleanup"},
    [XC_LEGACY] = {"legacy_handles", "legacy handles"},
    [XC_IPC_EVENT] = {"ipc_events", "IPC events"},
    [XC_PIDFD_GETFD] = {"pidfd_getfd", "pidfd_getfd route"},
};

typedef struct xc_verdict {
  bool works;
  char why[320];
} xc_verdict;

/* One path of the fabric export probe on a device: a VMM allocation
 * (cuMemCreate, cuMemExportToShareableHandle, cuMemImportFromShareableHandle)
 * or a memory pool (cuMemPoolCreate, cuMemAllocFromPoolAsync,
 * cuMemPoolExportToShareableHandle, cuMemPoolExportPointer, then
 * cuMemPoolImportFromShareableHandle and cuMemPoolImportPointer). */
typedef struct doc_fabric_path {
  bool exported;           /* every call up to the export succeeded */
  const char *failed_call; /* else the first that failed */
  CUresult error;          /* and its answer */
  bool import_tried;       /* exported: imported again in this process */
  const char *import_failed_call; /* NULL: the import succeeded */
  CUresult import_error;
  bool import_same; /* the import gave back the exporter's own handle or pool */
  const char *skipped; /* not tried, and why (then nothing above is set) */
} doc_fabric_path;

typedef struct doc_fabric {
  bool probed;           /* the device was examined */
  int skipped_mode;      /* not examined: its compute mode (0: examined) */
  doc_fabric_path vmm, pool;
  char cleanup[256];     /* calls that failed while giving back, "; "-separated */
} doc_fabric;

typedef struct doc_verdict {
  bool usable;
  bool on_device[DOC_MAX_DEVICES]; /* not used by M_PEER */
  char reason[256];                /* why not, when !usable */
} doc_verdict;

typedef struct doc_report {
  /* system */
  char os[65], machine[65], kernel[65];
  bool is_linux, is_64bit, kernel_ok, have_uname;
  int kmajor, kminor, kpatch;

  /* driver */
  bool loaded, initialized;
  char driver_error[512];
  const char *library;          /* what was asked for */
  char driver_path[PATH_MAX];   /* the file actually loaded */
  bool have_driver_path;
  int version;
  bool have_version;
  char kmod_version[64];
  bool have_kmod_version;
  const char *visible_devices;  /* CUDA_VISIBLE_DEVICES, or NULL */
  int device_count;             /* devices examined (capped) */
  int device_count_reported;    /* what the driver says */
  char devices_error[512];      /* why there are no devices, if so */

  doc_device dev[DOC_MAX_DEVICES];
  doc_peer peer[DOC_MAX_DEVICES][DOC_MAX_DEVICES];

  /* process side */
  uid_t euid;
  bool pidfd_available;
  int pidfd_errno;
  const char *pidfd_call; /* the call that failed */
  bool yama;
  int ptrace_scope;
  char rt_path[PATH_MAX];
  const char *rt_source; /* "XDG_RUNTIME_DIR" or "fallback" */
  char rt_xdg_problem[PATH_MAX + 96];
  bool rt_exists, rt_safe, rt_have_stat;
  uid_t rt_owner;
  unsigned rt_mode;
  char rt_detail[PATH_MAX + 96];
  bool have_nofile;
  long long nofile_soft, nofile_hard; /* -1: unlimited */

  /* containers */
  doc_ns ns[NS_COUNT];
  char cgroup[512];           /* this process's cgroup (v2 line, or the first) */
  char runtime[32];           /* a container runtime named by its cgroup/files */
  bool in_container;
  char container_why[256];    /* the signals, or why it looks like none */
  bool peer_pidfd;            /* SO_PEERPIDFD works (Linux 6.5) */
  int peer_pidfd_errno;
  xc_verdict xc[XC_COUNT];

  /* environment: every parameter of the library and this command
   * (src/core/param.h), sorted by name */
  gpuipc__param *env[64];
  size_t env_count;

  /* the fabric export probe (gather_fabric), per device, and the IMEX
   * channels it needs */
  bool fabric_probed;
  doc_fabric fabric[DOC_MAX_DEVICES];
  gpuipc__imex imex;
  doc_verdict fabric_verdict; /* counted in no result */

  doc_verdict verdict[M_COUNT];
  int usable_count;
  int exit_status;
} doc_report;

/* ---- small helpers --------------------------------------------------------- */

/* The symbolic name of an errno value (strerrorname_np is too recent to rely
 * on); the few that the probes below can see. */
static const char *errno_name(int e) {
  switch (e) {
  case 0: return "0";
  case EPERM: return "EPERM";
  case ENOENT: return "ENOENT";
  case ESRCH: return "ESRCH";
  case EBADF: return "EBADF";
  case ENOMEM: return "ENOMEM";
  case EACCES: return "EACCES";
  case EFAULT: return "EFAULT";
  case EINVAL: return "EINVAL";
  case EMFILE: return "EMFILE";
  case ENFILE: return "ENFILE";
  case ENOSYS: return "ENOSYS";
  case ENOTDIR: return "ENOTDIR";
  case ELOOP: return "ELOOP";
  case ENAMETOOLONG: return "ENAMETOOLONG";
  case ENXIO: return "ENXIO";
  case ENODEV: return "ENODEV";
  default: return "errno";
  }
}

static bool attr_yes(const doc_device *d, enum doc_attr a) {
  return d->ok && d->have_attr[a] && d->attr[a] != 0;
}

/* ---- gathering: system ----------------------------------------------------- */

static void gather_system(doc_report *r) {
  struct utsname u;
  r->is_64bit = sizeof(void *) == 8;
  if (uname(&u) == 0) {
    r->have_uname = true;
    snprintf(r->os, sizeof r->os, "%s", u.sysname);
    snprintf(r->machine, sizeof r->machine, "%s", u.machine);
    snprintf(r->kernel, sizeof r->kernel, "%s", u.release);
  } else {
    snprintf(r->os, sizeof r->os, "unknown");
  }
#if defined(__linux__)
  r->is_linux = strcmp(r->os, "Linux") == 0;
#else
  r->is_linux = false;
#endif
  r->kmajor = r->kminor = r->kpatch = 0;
  if (r->have_uname)
    (void)sscanf(r->kernel, "%d.%d.%d", &r->kmajor, &r->kminor, &r->kpatch);
  /* CUDA IPC has always required Linux 2.6.18 or later. */
  long long kv = (long long)r->kmajor * 1000000 + r->kminor * 1000 + r->kpatch;
  r->kernel_ok = r->is_linux && kv >= 2006018LL;
}

/* ---- gathering: driver and devices ----------------------------------------- */

/* The version of the NVIDIA kernel module, from the first line of
 * /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX ... 580.65.06 ...".
 * The first token that starts "digits.digits" is the version. */
static void gather_kernel_module(doc_report *r) {
  FILE *f = fopen("/proc/driver/nvidia/version", "re");
  if (f == NULL)
    return;
  char line[512];
  if (fgets(line, sizeof line, f) != NULL) {
    char *save = NULL;
    for (char *tok = strtok_r(line, " \t\n", &save); tok;
         tok = strtok_r(NULL, " \t\n", &save)) {
      int a, b;
      char dot;
      if (sscanf(tok, "%d%c%d", &a, &dot, &b) == 3 && dot == '.' &&
          tok[0] >= '0' && tok[0] <= '9') {
        snprintf(r->kmod_version, sizeof r->kmod_version, "%s", tok);
        r->have_kmod_version = true;
        break;
      }
    }
  }
  fclose(f);
}

/* The file the entry points actually come from: cuGetProcAddress hands out
 * pointers into the driver library, so dladdr on one names the real file
 * (libcuda.so.1 is a symbolic link to a versioned file). */
static void gather_driver_path(doc_report *r) {
  Dl_info info;
  void *sym = NULL;
  memcpy(&sym, &gpuipc__cu.cuInit, sizeof sym);
  if (sym == NULL || dladdr(sym, &info) == 0 || info.dli_fname == NULL)
    return;
  char *real = realpath(info.dli_fname, NULL);
  snprintf(r->driver_path, sizeof r->driver_path, "%s",
           real ? real : info.dli_fname);
  free(real);
  r->have_driver_path = true;
}

static void dev_error(doc_device *d, const char *call, CUresult cr) {
  gpuipc__appendf(d->errors, sizeof d->errors, "%s%s: %s", d->errors[0] ? "; " : "",
         call, gpuipc__cuda_error_name(cr));
}

static void gather_device(doc_report *r, int i) {
  doc_device *d = &r->dev[i];
  CUresult cr = GPUIPC__CU(cuDeviceGet, &d->dev, i);
  if (cr != CUDA_SUCCESS) {
    dev_error(d, "cuDeviceGet", cr);
    return;
  }
  d->ok = true;
  cr = GPUIPC__CU(cuDeviceGetName, d->name, (int)sizeof d->name, d->dev);
  if (cr == CUDA_SUCCESS)
    d->have_name = true;
  else
    dev_error(d, "cuDeviceGetName", cr);
  gpuipc_uuid u;
  if (gpuipc_device_uuid(i, &u) == GPUIPC_OK) {
    gpuipc_uuid_format(&u, d->uuid);
    d->have_uuid = true;
  } else {
    gpuipc__appendf(d->errors, sizeof d->errors, "%s%s", d->errors[0] ? "; " : "",
           gpuipc_last_error());
  }
  cr = GPUIPC__CU(cuDeviceGetPCIBusId, d->pci, (int)sizeof d->pci, d->dev);
  if (cr == CUDA_SUCCESS)
    d->have_pci = true;
  else
    dev_error(d, "cuDeviceGetPCIBusId", cr);
  cr = GPUIPC__CU(cuDeviceTotalMem, &d->total_mem, d->dev);
  if (cr == CUDA_SUCCESS)
    d->have_mem = true;
  else
    dev_error(d, "cuDeviceTotalMem", cr);
  for (int a = 0; a < A_COUNT; a++) {
    int v = 0;
    cr = GPUIPC__CU(cuDeviceGetAttribute, &v, attr_info[a].attr, d->dev);
    if (cr == CUDA_SUCCESS) {
      d->attr[a] = v;
      d->have_attr[a] = true;
    } else {
      char call[96];
      snprintf(call, sizeof call, "cuDeviceGetAttribute(%s)", attr_info[a].key);
      dev_error(d, call, cr);
    }
  }
}

static void gather_peers(doc_report *r) {
  for (int i = 0; i < r->device_count; i++) {
    for (int j = 0; j < r->device_count; j++) {
      doc_peer *p = &r->peer[i][j];
      if (i == j || !r->dev[i].ok || !r->dev[j].ok)
        continue;
      CUdevice a = r->dev[i].dev, b = r->dev[j].dev;
      p->have_can_access =
          GPUIPC__CU(cuDeviceCanAccessPeer, &p->can_access, a, b) == CUDA_SUCCESS;
      p->have_access_supported =
          GPUIPC__CU(cuDeviceGetP2PAttribute, &p->access_supported,
                     CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, a,
                     b) == CUDA_SUCCESS;
      p->have_perf_rank =
          GPUIPC__CU(cuDeviceGetP2PAttribute, &p->perf_rank,
                     CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, a,
                     b) == CUDA_SUCCESS;
      p->have_native_atomic =
          GPUIPC__CU(cuDeviceGetP2PAttribute, &p->native_atomic,
                     CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, a,
                     b) == CUDA_SUCCESS;
    }
  }
}

GPUIPC__PARAM(cuda_visible_devices, "CUDA_VISIBLE_DEVICES",
              GPUIPC__PARAM_EACH_USE, "all",
              "the devices CUDA shows this process (the driver reads it; "
              "gpuipc names devices by UUID across processes)")

static int param_cmp(const void *a, const void *b) {
  const gpuipc__param *x = *(gpuipc__param *const *)a;
  const gpuipc__param *y = *(gpuipc__param *const *)b;
  return strcmp(x->name, y->name);
}

static void gather_environment(doc_report *r) {
  size_t n = 0;
  gpuipc__param *const *all = gpuipc__params(&n);
  if (n > GPUIPC__ARRAY_SIZE(r->env))
    n = GPUIPC__ARRAY_SIZE(r->env);
  for (size_t i = 0; i < n; i++)
    r->env[i] = all[i];
  r->env_count = n;
  qsort(r->env, n, sizeof r->env[0], param_cmp);
}

static const char *param_when(const gpuipc__param *p) {
  return p->when == GPUIPC__PARAM_ONCE       ? "once"
         : p->when == GPUIPC__PARAM_EACH_USE ? "each use"
                                             : "for the child";
}

static void gather_driver(doc_report *r) {
  r->library = gpuipc_driver_path();
  r->visible_devices = param_cuda_visible_devices();
  gather_kernel_module(r);

  if (gpuipc__driver_load() != GPUIPC_OK) {
    snprintf(r->driver_error, sizeof r->driver_error, "%s", gpuipc_last_error());
    return;
  }
  r->loaded = true;
  gather_driver_path(r);
  /* cuDriverGetVersion needs no cuInit: ask before, so that a driver whose
   * cuInit fails still reports which CUDA it supports. */
  if (GPUIPC__CU(cuDriverGetVersion, &r->version) == CUDA_SUCCESS)
    r->have_version = true;

  gpuipc_status s = gpuipc__driver();
  if (s == GPUIPC_E_NO_DEVICE) {
    /* The driver works but sees no GPU: the driver is there, devices are
     * not (exit 1, not 2). */
    r->initialized = false;
    snprintf(r->devices_error, sizeof r->devices_error, "%s", gpuipc_last_error());
    return;
  }
  if (s != GPUIPC_OK) {
    snprintf(r->driver_error, sizeof r->driver_error, "%s", gpuipc_last_error());
    return;
  }
  r->initialized = true;

  int n = 0;
  CUresult cr = GPUIPC__CU(cuDeviceGetCount, &n);
  if (cr != CUDA_SUCCESS) {
    snprintf(r->devices_error, sizeof r->devices_error, "cuDeviceGetCount: %s",
             gpuipc__cuda_error_name(cr));
    return;
  }
  r->device_count_reported = n;
  r->device_count = n > DOC_MAX_DEVICES ? DOC_MAX_DEVICES : n;
  if (n == 0)
    snprintf(r->devices_error, sizeof r->devices_error,
             "the driver reports no device (check CUDA_VISIBLE_DEVICES)");
  for (int i = 0; i < r->device_count; i++)
    gather_device(r, i);
  gather_peers(r);
}

/* ---- gathering: the fabric export probe ------------------------------------ */

/* Records the first failure of a path: the call and its answer. */
static bool fab_fail(doc_fabric_path *p, const char *call, CUresult cr) {
  if (cr == CUDA_SUCCESS)
    return false;
  p->failed_call = call;
  p->error = cr;
  return true;
}

static void fab_cleanup(doc_fabric *f, const char *call, CUresult cr) {
  if (cr != CUDA_SUCCESS)
    gpuipc__appendf(f->cleanup, sizeof f->cleanup, "%s%s: %s", f->cleanup[0] ? "; " : "", call,
           gpuipc__cuda_error_name(cr));
}

/* A VMM allocation of one granule with a fabric handle: exported into a
 * CUmemFabricHandle, then those bytes imported in this very process (the
 * driver's answer is recorded, whatever it is). */
static void fabric_vmm(doc_fabric *f, CUdevice dev, size_t *gran_out) {
  doc_fabric_path *p = &f->vmm;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = (int)dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  size_t gran = 0;
  if (fab_fail(p, "cuMemGetAllocationGranularity",
               GPUIPC__CU(cuMemGetAllocationGranularity, &gran, &prop,
                          CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    return;
  if (gran == 0) {
    fab_fail(p, "cuMemGetAllocationGranularity", CUDA_ERROR_INVALID_VALUE);
    return;
  }
  *gran_out = gran;
  CUmemGenericAllocationHandle h = 0;
  if (fab_fail(p, "cuMemCreate", GPUIPC__CU(cuMemCreate, &h, gran, &prop, 0)))
    return;
  CUmemFabricHandle fh;
  memset(&fh, 0, sizeof fh);
  if (!fab_fail(p, "cuMemExportToShareableHandle",
                GPUIPC__CU(cuMemExportToShareableHandle, &fh, h,
                           CU_MEM_HANDLE_TYPE_FABRIC, 0))) {
    p->exported = true;
    p->import_tried = true;
    CUmemGenericAllocationHandle h2 = 0;
    p->import_error = GPUIPC__CU(cuMemImportFromShareableHandle, &h2, &fh,
                                 CU_MEM_HANDLE_TYPE_FABRIC);
    if (p->import_error != CUDA_SUCCESS) {
      p->import_failed_call = "cuMemImportFromShareableHandle";
    } else {
      /* Each import is a handle of its own to release (cuda.h), even if the
       * driver hands back the value it already gave. */
      p->import_same = h2 == h;
      fab_cleanup(f, "cuMemRelease", GPUIPC__CU(cuMemRelease, h2));
    }
  }
  fab_cleanup(f, "cuMemRelease", GPUIPC__CU(cuMemRelease, h));
}

/* A pool with a fabric handle type and one allocation from it: the pool and
 * the pointer exported, then imported in this very process. */
static void fabric_pool(doc_fabric *f, CUdevice dev, size_t bytes) {
  doc_fabric_path *p = &f->pool;
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = (int)dev;
  CUmemoryPool pool = NULL;
  if (fab_fail(p, "cuMemPoolCreate", GPUIPC__CU(cuMemPoolCreate, &pool, &props)))
    return;
  CUdeviceptr ptr = 0;
  if (fab_fail(p, "cuMemAllocFromPoolAsync",
               GPUIPC__CU(cuMemAllocFromPoolAsync, &ptr, bytes, pool, (CUstream)0)))
    goto destroy;
  if (fab_fail(p, "cuStreamSynchronize", GPUIPC__CU(cuStreamSynchronize, (CUstream)0)))
    goto free_ptr;
  CUmemFabricHandle fh;
  memset(&fh, 0, sizeof fh);
  if (fab_fail(p, "cuMemPoolExportToShareableHandle",
               GPUIPC__CU(cuMemPoolExportToShareableHandle, &fh, pool,
                          CU_MEM_HANDLE_TYPE_FABRIC, 0)))
    goto free_ptr;
  CUmemPoolPtrExportData data;
  memset(&data, 0, sizeof data);
  if (fab_fail(p, "cuMemPoolExportPointer", GPUIPC__CU(cuMemPoolExportPointer, &data, ptr)))
    goto free_ptr;
  p->exported = true;
  p->import_tried = true;
  CUmemoryPool pool2 = NULL;
  p->import_error = GPUIPC__CU(cuMemPoolImportFromShareableHandle, &pool2, &fh,
                               CU_MEM_HANDLE_TYPE_FABRIC, 0);
  if (p->import_error != CUDA_SUCCESS) {
    p->import_failed_call = "cuMemPoolImportFromShareableHandle";
  } else if (pool2 == pool) {
    /* The driver gave back the pool itself: nothing of its own to import
     * into or destroy. */
    p->import_same = true;
  } else {
    CUdeviceptr ptr2 = 0;
    p->import_error = GPUIPC__CU(cuMemPoolImportPointer, &ptr2, pool2, &data);
    if (p->import_error != CUDA_SUCCESS) {
      p->import_failed_call = "cuMemPoolImportPointer";
    } else {
      fab_cleanup(f, "cuMemFreeAsync", GPUIPC__CU(cuMemFreeAsync, ptr2, (CUstream)0));
      fab_cleanup(f, "cuStreamSynchronize", GPUIPC__CU(cuStreamSynchronize, (CUstream)0));
    }
    /* An imported pool is destroyed only once no pointer of it is open
     * (docs/driver-behaviour.md). */
    fab_cleanup(f, "cuMemPoolDestroy", GPUIPC__CU(cuMemPoolDestroy, pool2));
  }
free_ptr:
  fab_cleanup(f, "cuMemFreeAsync", GPUIPC__CU(cuMemFreeAsync, ptr, (CUstream)0));
  fab_cleanup(f, "cuStreamSynchronize", GPUIPC__CU(cuStreamSynchronize, (CUstream)0));
destroy:
  fab_cleanup(f, "cuMemPoolDestroy", GPUIPC__CU(cuMemPoolDestroy, pool));
}

/* The fabric export probe on every device, each in its primary context
 * (retained, made current, then popped and released: the doctor leaves no
 * context behind it), and the IMEX channels (needed whatever the driver
 * says, so that a refusal comes with what is missing). */
static const char *compute_mode_name(int mode) {
  return mode == CU_COMPUTEMODE_EXCLUSIVE_PROCESS ? "exclusive-process"
         : mode == CU_COMPUTEMODE_PROHIBITED      ? "prohibited"
                                                  : "another";
}

/* Whether an IMEX channel here opens (what the driver needs for fabric
 * handles). */
static bool imex_channel_opens(const gpuipc__imex *x) {
  for (int k = 0; k < x->count && k < GPUIPC__IMEX_MAX; k++)
    if (x->channel[k].open_errno == 0)
      return true;
  return false;
}

/* Why the pool path is not tried after a VMM refusal for want of a
 * channel: on the H200's driver (580.159.04) a pool made with the fabric
 * handle type, whose export was then refused the same way, crashed the
 * process (SIGSEGV) when its memory was given back
 * (docs/driver-behaviour.md). */
static const char fabric_pool_skip[] =
    "not tried: the VMM export was refused (CUDA_ERROR_NOT_PERMITTED) and no IMEX channel "
    "opens here; without one a fabric pool's clean-up crashed a process on a real driver";

static void gather_fabric(doc_report *r) {
  gpuipc__imex_probe(&r->imex);
  if (!r->initialized)
    return;
  r->fabric_probed = true;
  for (int i = 0; i < r->device_count; i++) {
    doc_fabric *f = &r->fabric[i];
    if (!r->dev[i].ok)
      continue;
    CUdevice dev = r->dev[i].dev;
    /* A context made here on a device that takes one process only would
     * keep out a job starting meanwhile: not probed there. */
    int mode = CU_COMPUTEMODE_DEFAULT;
    if (GPUIPC__CU(cuDeviceGetAttribute, &mode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev) ==
            CUDA_SUCCESS &&
        mode != CU_COMPUTEMODE_DEFAULT) {
      f->skipped_mode = mode;
      continue;
    }
    f->probed = true;
    CUcontext ctx = NULL;
    CUresult cr = GPUIPC__CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    if (cr != CUDA_SUCCESS) {
      fab_fail(&f->vmm, "cuDevicePrimaryCtxRetain", cr);
      fab_fail(&f->pool, "cuDevicePrimaryCtxRetain", cr);
      continue;
    }
    cr = GPUIPC__CU(cuCtxPushCurrent, ctx);
    if (cr != CUDA_SUCCESS) {
      fab_fail(&f->vmm, "cuCtxPushCurrent", cr);
      fab_fail(&f->pool, "cuCtxPushCurrent", cr);
    } else {
      size_t gran = (size_t)2 << 20;
      fabric_vmm(f, dev, &gran);
      if (!f->vmm.exported && f->vmm.error == CUDA_ERROR_NOT_PERMITTED &&
          !imex_channel_opens(&r->imex))
        f->pool.skipped = fabric_pool_skip;
      else
        fabric_pool(f, dev, gran);
      CUcontext popped = NULL;
      fab_cleanup(f, "cuCtxPopCurrent", GPUIPC__CU(cuCtxPopCurrent, &popped));
    }
    fab_cleanup(f, "cuDevicePrimaryCtxRelease", GPUIPC__CU(cuDevicePrimaryCtxRelease, dev));
  }
}

/* ---- gathering: the process side ------------------------------------------ */

/* pidfd_getfd (Linux 5.6) lets a process take a file descriptor out of
 * another one it may ptrace. Probe it on ourselves: pidfd_open(self), then
 * pidfd_getfd of that very pidfd. ENOSYS means the kernel (or a seccomp
 * filter) lacks the call; EPERM usually means a seccomp filter refuses it. */
static void gather_pidfd(doc_report *r) {
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  long pidfd = syscall(SYS_pidfd_open, (long)getpid(), 0L);
  if (pidfd < 0) {
    r->pidfd_errno = errno;
    r->pidfd_call = "pidfd_open";
    return;
  }
  long fd = syscall(SYS_pidfd_getfd, pidfd, pidfd, 0L);
  if (fd < 0) {
    r->pidfd_errno = errno;
    r->pidfd_call = "pidfd_getfd";
  } else {
    r->pidfd_available = true;
    close((int)fd);
  }
  close((int)pidfd);
#else
  r->pidfd_errno = ENOSYS;
  r->pidfd_call = "pidfd_open";
#endif
}

static void gather_ptrace(doc_report *r) {
  r->ptrace_scope = -1;
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "re");
  if (f == NULL)
    return;
  r->yama = true;
  if (fscanf(f, "%d", &r->ptrace_scope) != 1)
    r->ptrace_scope = -1;
  fclose(f);
}

static const char *ptrace_meaning(const doc_report *r) {
  if (!r->yama)
    return "no Yama: a process may ptrace (and pidfd_getfd) others of the same user";
  switch (r->ptrace_scope) {
  case 0:
    return "classic: a process may ptrace others of the same user";
  case 1:
    return "restricted: only descendants, or a process that declared the "
           "caller with PR_SET_PTRACER";
  case 2:
    return "admin-only: CAP_SYS_PTRACE is needed";
  case 3:
    return "no attach: ptrace is disabled";
  default:
    return "unknown value";
  }
}

/* The directory gpuipc's sockets live in, chosen by the connection layer's
 * own rule (gpuipc__default_runtime_dir). Inspected with lstat, never
 * created: a symbolic link,
 * another owner or a mode other than 0700 would let someone else see or
 * replace the sockets. */
static void gather_runtime_dir(doc_report *r) {
  struct stat st;
  bool from_xdg = false;
  gpuipc__default_runtime_dir(r->rt_path, sizeof r->rt_path, r->rt_xdg_problem,
                              sizeof r->rt_xdg_problem, &from_xdg);
  r->rt_source = from_xdg ? "XDG_RUNTIME_DIR" : "fallback";

  if (lstat(r->rt_path, &st) != 0) {
    int e = errno;
    if (e == ENOENT) {
      r->rt_safe = true;
      snprintf(r->rt_detail, sizeof r->rt_detail,
               "does not exist yet: gpuipc creates it with mode 0700 on first use");
    } else {
      snprintf(r->rt_detail, sizeof r->rt_detail, "cannot inspect it: %s",
               strerror(e));
    }
    return;
  }
  r->rt_exists = true;
  r->rt_have_stat = true;
  r->rt_owner = st.st_uid;
  r->rt_mode = (unsigned)(st.st_mode & 07777);
  if (S_ISLNK(st.st_mode))
    snprintf(r->rt_detail, sizeof r->rt_detail,
             "unsafe: it is a symbolic link; remove it");
  else if (!S_ISDIR(st.st_mode))
    snprintf(r->rt_detail, sizeof r->rt_detail,
             "unsafe: it is not a directory; remove it");
  else if (st.st_uid != r->euid)
    snprintf(r->rt_detail, sizeof r->rt_detail,
             "unsafe: owned by uid %u, not by us (uid %u)", (unsigned)st.st_uid,
             (unsigned)r->euid);
  else if ((st.st_mode & 0777) != 0700)
    snprintf(r->rt_detail, sizeof r->rt_detail,
             "unsafe: mode %04o, should be 0700 (chmod 700 %s)",
             (unsigned)(st.st_mode & 07777), r->rt_path);
  else {
    r->rt_safe = true;
    snprintf(r->rt_detail, sizeof r->rt_detail, "safe: ours, mode 0700");
  }
}

/* ---- containers ---------------------------------------------------------------- */

static bool ns_inode(const char *pid, const char *name,
                     unsigned long long *ino) {
  char path[64], link[128];
  snprintf(path, sizeof path, "/proc/%s/ns/%s", pid, name);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n <= 0)
    return false;
  link[n] = '\0';
  const char *b = strchr(link, '[');
  if (b == NULL)
    return false;
  *ino = strtoull(b + 1, NULL, 10);
  return *ino != 0;
}

static void read_cgroup(doc_report *r) {
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (f == NULL)
    return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    /* The v2 line ("0::/path") wins; else the first. */
    if (r->cgroup[0] == '\0' || strncmp(line, "0::", 3) == 0)
      snprintf(r->cgroup, sizeof r->cgroup, "%s", line);
    if (strncmp(line, "0::", 3) == 0)
      break;
  }
  fclose(f);
  static const struct {
    const char *needle, *name;
  } runtimes[] = {{"kubepods", "kubernetes"}, {"docker", "docker"},
                  {"containerd", "containerd"}, {"cri-o", "cri-o"},
                  {"crio-", "cri-o"}, {"libpod", "podman"}, {"lxc", "lxc"}};
  for (size_t i = 0; i < sizeof runtimes / sizeof runtimes[0]; i++)
    if (strstr(r->cgroup, runtimes[i].needle)) {
      snprintf(r->runtime, sizeof r->runtime, "%s", runtimes[i].name);
      return;
    }
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

/* SO_PEERPIDFD (Linux 6.5) on a socketpair of our own: how a connection
 * follows a peer whose pid namespace this process cannot see. */
static void probe_peer_pidfd(doc_report *r) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    r->peer_pidfd_errno = errno;
    return;
  }
  int pidfd = -1;
  socklen_t len = sizeof pidfd;
  if (getsockopt(sv[0], SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0) {
    r->peer_pidfd = true;
    close(pidfd);
  } else {
    r->peer_pidfd_errno = errno;
  }
  close(sv[0]);
  close(sv[1]);
}

static void gather_container(doc_report *r) {
  char why[256] = "";
  for (int i = 0; i < NS_COUNT; i++) {
    doc_ns *n = &r->ns[i];
    n->have_self = ns_inode("self", ns_info[i].name, &n->self);
    n->have_pid1 = ns_inode("1", ns_info[i].name, &n->pid1);
    bool not_initial = n->have_self && ns_info[i].init_ino != 0 &&
                       n->self != ns_info[i].init_ino;
    bool not_pid1s = n->have_self && n->have_pid1 && n->self != n->pid1;
    n->own = not_initial || not_pid1s;
    if (n->own && (i == NS_PID || i == NS_IPC || i == NS_MNT))
      gpuipc__appendf(why, sizeof why, "%s%s namespace %s", why[0] ? ", " : "",
             ns_info[i].name,
             not_initial ? "of its own" : "differs from pid 1's");
  }
  read_cgroup(r);
  if (r->runtime[0] == '\0') {
    struct stat st;
    if (stat("/.dockerenv", &st) == 0)
      snprintf(r->runtime, sizeof r->runtime, "docker");
    else if (stat("/run/.containerenv", &st) == 0)
      snprintf(r->runtime, sizeof r->runtime, "podman");
  }
  if (r->runtime[0])
    gpuipc__appendf(why, sizeof why, "%s%s (cgroup or marker file)", why[0] ? ", " : "",
           r->runtime);
  r->in_container = why[0] != '\0';
  snprintf(r->container_why, sizeof r->container_why, "%s",
           why[0] ? why
                  : "no: the machine's pid and IPC namespaces, those of pid "
                    "1, and no container cgroup");
  probe_peer_pidfd(r);
}

/* What works with a peer in another container; run after decide() (it
 * uses the device verdicts). */
static void decide_cross_container(doc_report *r) {
  const char *fdpath = "its fd travels over the connection (SCM_RIGHTS): "
                       "needs only the shared socket directory and the GPU "
                       "visible in both";
  struct {
    int mech;
    const char *what;
  } fdk[3] = {{M_POOL_FD, NULL}, {M_VMM_FD, NULL}, {-1, NULL}};
  for (int k = 0; k < 3; k++) {
    xc_verdict *v = &r->xc[k == 0 ? XC_POOL_FD : k == 1 ? XC_VMM_FD : XC_PINNED];
    /* Pinned host memory needs a driver and a device, as legacy handles
     * do (their verdict says which is missing). */
    const doc_verdict *here = &r->verdict[fdk[k].mech >= 0 ? fdk[k].mech : M_LEGACY];
    bool usable = fdk[k].mech >= 0 ? here->usable
                                   : r->loaded && r->device_count > 0;
    if (!usable) {
      char reason[sizeof here->reason];
      snprintf(reason, sizeof reason, "%s", here->reason);
      snprintf(v->why, sizeof v->why, "not usable here at all: %s", reason);
      continue;
    }
    v->works = true;
    snprintf(v->why, sizeof v->why, "%s%s", fdpath,
             k == 2 ? " (a sealed memfd; host memory, any device)" : "");
  }
  xc_verdict *v = &r->xc[XC_MEMOPS];
  v->works = r->verdict[M_MEMOPS].usable &&
             (r->verdict[M_POOL_FD].usable || r->verdict[M_VMM_FD].usable);
  snprintf(v->why, sizeof v->why, "%s",
           v->works ? "flag words in memory shared by fd; no host in the loop"
                    : "needs stream memops and pool or VMM fds");
  v = &r->xc[XC_LIVENESS];
  v->works = true;
  snprintf(v->why, sizeof v->why,
           "the exporter's liveness table travels with the connection (a "
           "read-only fd at the handshake); by name in /dev/shm only where "
           "/dev/shm is shared");
  v = &r->xc[XC_PEER_DEATH];
  v->works = r->peer_pidfd;
  if (r->peer_pidfd)
    snprintf(v->why, sizeof v->why,
             "a peer whose pid namespace is not visible here is followed "
             "by its pidfd from the socket (SO_PEERPIDFD)");
  else
    snprintf(v->why, sizeof v->why,
             "SO_PEERPIDFD: %s (needs Linux 6.5): a connection to a peer in "
             "a pid namespace this process cannot see is refused",
             strerror(r->peer_pidfd_errno));
  v = &r->xc[XC_LEGACY];
  snprintf(v->why, sizeof v->why,
           "needs one pid namespace: the driver opens a legacy handle by its "
           "exporter's pid (docker --pid=container:<id>, Kubernetes "
           "shareProcessNamespace); refused otherwise");
  v = &r->xc[XC_IPC_EVENT];
  snprintf(v->why, sizeof v->why,
           "needs one pid namespace, as legacy handles do; order with "
           "stream memops instead (the default)");
  v = &r->xc[XC_PIDFD_GETFD];
  snprintf(v->why, sizeof v->why,
           "needs one pid namespace and ptrace rights over the exporter "
           "(CAP_SYS_PTRACE across containers); pass fds with descriptors "
           "instead");
}

static void gather_process(doc_report *r) {
  r->euid = geteuid();
  gather_pidfd(r);
  gather_ptrace(r);
  gather_runtime_dir(r);
  gather_container(r);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    r->have_nofile = true;
    r->nofile_soft = rl.rlim_cur == RLIM_INFINITY ? -1 : (long long)rl.rlim_cur;
    r->nofile_hard = rl.rlim_max == RLIM_INFINITY ? -1 : (long long)rl.rlim_max;
  }
}

/* ---- verdicts ---------------------------------------------------------------- */

/* A mechanism that rests on one device at a time: usable on each device where
 * `need` holds. If it holds nowhere, the reason is the first condition, in
 * the order given, that no device meets. */
static void per_device(doc_report *r, enum doc_mech m, const enum doc_attr *need,
                       const char *const *why, int nneed) {
  doc_verdict *v = &r->verdict[m];
  for (int i = 0; i < r->device_count; i++) {
    bool all = r->dev[i].ok;
    for (int k = 0; k < nneed && all; k++)
      all = attr_yes(&r->dev[i], need[k]);
    v->on_device[i] = all;
    if (all)
      v->usable = true;
  }
  if (v->usable)
    return;
  /* Find the first requirement that fails on every device that met the
   * requirements before it. */
  bool alive[DOC_MAX_DEVICES];
  for (int i = 0; i < r->device_count; i++)
    alive[i] = r->dev[i].ok;
  for (int k = 0; k < nneed; k++) {
    bool any = false;
    for (int i = 0; i < r->device_count; i++) {
      alive[i] = alive[i] && attr_yes(&r->dev[i], need[k]);
      any = any || alive[i];
    }
    if (!any) {
      snprintf(v->reason, sizeof v->reason, "%s", why[k]);
      return;
    }
  }
  snprintf(v->reason, sizeof v->reason, "no device could be examined");
}

static void decide(doc_report *r) {
  const char *common = NULL;
  char buf[256];
  if (!r->loaded || (!r->initialized && r->driver_error[0])) {
    common = "no CUDA driver";
  } else if (r->device_count == 0) {
    common = "no device";
  } else if (!r->is_linux) {
    common = "CUDA IPC needs Linux";
  } else if (!r->is_64bit) {
    common = "CUDA IPC needs a 64-bit process";
  } else if (!r->kernel_ok) {
    snprintf(buf, sizeof buf, "CUDA IPC needs Linux 2.6.18 or later (this is %s)",
             r->kernel);
    common = buf;
  }
  if (common) {
    for (int m = 0; m < M_COUNT; m++)
      snprintf(r->verdict[m].reason, sizeof r->verdict[m].reason, "%s", common);
  } else {
    /* Legacy cuIpc handles: unified addressing on 64-bit Linux and compute
     * capability 2.0 or later (every device a current driver supports). */
    {
      doc_verdict *v = &r->verdict[M_LEGACY];
      bool any_uva = false;
      for (int i = 0; i < r->device_count; i++) {
        const doc_device *d = &r->dev[i];
        bool uva = attr_yes(d, A_UNIFIED);
        any_uva = any_uva || uva;
        v->on_device[i] = uva && d->have_attr[A_CC_MAJOR] && d->attr[A_CC_MAJOR] >= 2;
        v->usable = v->usable || v->on_device[i];
      }
      if (!v->usable)
        snprintf(v->reason, sizeof v->reason, "%s",
                 any_uva ? "no device of compute capability 2.0 or later"
                         : "no device supports unified addressing");
    }
    /* Pool fds: stream-ordered pools whose handle types include POSIX fds. */
    {
      doc_verdict *v = &r->verdict[M_POOL_FD];
      bool any_pools = false;
      for (int i = 0; i < r->device_count; i++) {
        const doc_device *d = &r->dev[i];
        bool pools = attr_yes(d, A_MEMPOOLS);
        any_pools = any_pools || pools;
        v->on_device[i] = pools && d->have_attr[A_MEMPOOL_TYPES] &&
                          (d->attr[A_MEMPOOL_TYPES] &
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
        v->usable = v->usable || v->on_device[i];
      }
      if (!v->usable)
        snprintf(v->reason, sizeof v->reason, "%s",
                 any_pools ? "no device supports memory pools with POSIX fds"
                           : "no device supports memory pools");
    }
    /* VMM fds: cuMemCreate with a POSIX-fd handle type. */
    {
      const enum doc_attr need[] = {A_VMM, A_POSIX_FD};
      const char *const why[] = {
          "no device supports virtual memory management (VMM)",
          "no device supports VMM allocations with POSIX-fd handles"};
      per_device(r, M_VMM_FD, need, why, 2);
    }
    /* IPC events. */
    {
      const enum doc_attr need[] = {A_IPC_EVENT};
      const char *const why[] = {"no device supports IPC events"};
      per_device(r, M_IPC_EVENT, need, why, 1);
    }
    /* Stream-memop ordering: 32-bit cuStreamWriteValue32/WaitValue32 are
     * always available from CUDA 12.0 on; the flag words must live in
     * memory both processes map, so some memory-sharing mechanism must be
     * usable on the device too. */
    {
      doc_verdict *v = &r->verdict[M_MEMOPS];
      if (!r->have_version || r->version < 12000) {
        snprintf(v->reason, sizeof v->reason,
                 "needs a driver for CUDA 12.0 or later (this one supports %d.%d)",
                 r->version / 1000, (r->version % 1000) / 10);
      } else {
        for (int i = 0; i < r->device_count; i++) {
          v->on_device[i] = r->verdict[M_LEGACY].on_device[i] ||
                            r->verdict[M_POOL_FD].on_device[i] ||
                            r->verdict[M_VMM_FD].on_device[i];
          v->usable = v->usable || v->on_device[i];
        }
        if (!v->usable)
          snprintf(v->reason, sizeof v->reason,
                   "its flag words need shared device memory, and no "
                   "memory-sharing mechanism is usable");
      }
    }
    /* Peer access: some pair of devices can each reach the other. */
    {
      doc_verdict *v = &r->verdict[M_PEER];
      for (int i = 0; i < r->device_count; i++)
        for (int j = 0; j < r->device_count; j++)
          if (i != j && r->peer[i][j].have_can_access && r->peer[i][j].can_access &&
              r->peer[j][i].have_can_access && r->peer[j][i].can_access)
            v->usable = true;
      if (!v->usable)
        snprintf(v->reason, sizeof v->reason, "%s",
                 r->device_count == 1
                     ? "not applicable: one device"
                     : "no pair of devices can access each other's memory");
    }
  }

  r->usable_count = 0;
  for (int m = 0; m < M_COUNT; m++) {
    if (r->verdict[m].usable)
      r->usable_count++;
    else if (r->verdict[m].reason[0] == '\0')
      snprintf(r->verdict[m].reason, sizeof r->verdict[m].reason, "unknown");
  }
  if (!r->loaded || (!r->initialized && r->driver_error[0]))
    r->exit_status = 2;
  else
    r->exit_status = r->usable_count > 0 ? 0 : 1;
}

/* The fabric export probe's verdict: usable on a device where a VMM
 * allocation or a pool exported a fabric handle; else the first refusal.
 * Counted in no result (gpuipc does not share by fabric handles yet). */
static void decide_fabric(doc_report *r) {
  doc_verdict *v = &r->fabric_verdict;
  if (!r->loaded || (!r->initialized && r->driver_error[0])) {
    snprintf(v->reason, sizeof v->reason, "no CUDA driver");
    return;
  }
  if (r->device_count == 0 || !r->fabric_probed) {
    snprintf(v->reason, sizeof v->reason, "%s",
             r->device_count == 0 ? "no device" : "not probed");
    return;
  }
  for (int i = 0; i < r->device_count; i++) {
    const doc_fabric *f = &r->fabric[i];
    v->on_device[i] = f->probed && (f->vmm.exported || f->pool.exported);
    v->usable = v->usable || v->on_device[i];
  }
  if (v->usable)
    return;
  for (int i = 0; i < r->device_count; i++) {
    const doc_fabric *f = &r->fabric[i];
    if (f->probed) {
      snprintf(v->reason, sizeof v->reason, "%s returned %s (device %d)",
               f->vmm.failed_call, gpuipc__cuda_error_name(f->vmm.error), i);
      return;
    }
  }
  for (int i = 0; i < r->device_count; i++)
    if (r->fabric[i].skipped_mode) {
      snprintf(v->reason, sizeof v->reason, "not probed: device %d is in %s compute mode",
               i, compute_mode_name(r->fabric[i].skipped_mode));
      return;
    }
  snprintf(v->reason, sizeof v->reason, "no device could be examined");
}

/* ---- human output ------------------------------------------------------------ */

static void sanitize(char *s);
static void h_vsection(FILE *out, const char *fmt, va_list ap) GPUIPC__PRINTF(2, 0);
static void h_vsection(FILE *out, const char *fmt, va_list ap) {
  char line[DOC_WIDTH + 1];
  vsnprintf(line, sizeof line, fmt, ap);
  sanitize(line);
  fprintf(out, "\n%s\n", line);
}

/* Device names and error messages come from the driver: control characters
 * in them would garble the terminal, so they become spaces. */
static void sanitize(char *s) {
  for (; *s; s++)
    if ((unsigned char)*s < 0x20 || *s == 0x7f)
      *s = ' ';
}

/* "  key                      value", the value wrapped at DOC_WIDTH with a
 * hanging indent, so long error messages stay readable. */
static void h_vkv(FILE *out, const char *key, const char *fmt, va_list ap)
    GPUIPC__PRINTF(3, 0);
static void h_vkv(FILE *out, const char *key, const char *fmt, va_list ap) {
  char val[2048];
  vsnprintf(val, sizeof val, fmt, ap);
  sanitize(val);
  const int indent = 2 + DOC_KEY_WIDTH + 1;
  const size_t room = DOC_WIDTH - indent;
  fprintf(out, "  %-*s ", DOC_KEY_WIDTH, key);
  const char *p = val;
  for (;;) {
    size_t len = strlen(p);
    if (len <= room) {
      fprintf(out, "%s\n", p);
      return;
    }
    size_t cut = room;
    while (cut > 0 && p[cut] != ' ')
      cut--;
    if (cut == 0)
      cut = room; /* one long word: break it */
    fprintf(out, "%.*s\n%*s", (int)cut, p, indent, "");
    p += cut;
    while (*p == ' ')
      p++;
  }
}

static const char *yn(bool b) { return b ? "yes" : "no"; }

static const char *attr_text(const doc_device *d, enum doc_attr a, char *buf,
                             size_t cap) {
  if (!d->have_attr[a])
    return "unknown (query failed)";
  if (attr_info[a].boolean)
    return yn(d->attr[a] != 0);
  snprintf(buf, cap, "%d", d->attr[a]);
  return buf;
}

static void handle_types_text(int mask, char *buf, size_t cap) {
  buf[0] = '\0';
  for (size_t k = 0; k < GPUIPC__ARRAY_SIZE(handle_types); k++)
    if (mask & handle_types[k].bit)
      gpuipc__appendf(buf, cap, "%s%s", buf[0] ? ", " : "", handle_types[k].name);
  if (buf[0] == '\0')
    snprintf(buf, cap, "none");
}

/* ---- JSON output -------------------------------------------------------------- */

/* A small JSON writer: containers are either "block" (one member a line) or
 * "inline" (all on one line); keys are NULL inside arrays. */
typedef struct jw {
  FILE *f;
  int depth;
  bool first[32];
  bool inl[32];
} jw;

static void jw_string(jw *w, const char *s);

static void jw_prefix(jw *w, const char *key) {
  if (w->depth > 0) {
    bool first = w->first[w->depth];
    w->first[w->depth] = false;
    if (w->inl[w->depth]) {
      if (!first)
        fputs(", ", w->f);
    } else {
      if (!first)
        fputc(',', w->f);
      fprintf(w->f, "\n%*s", 2 * w->depth, "");
    }
  }
  if (key) {
    jw_string(w, key);
    fputs(": ", w->f);
  }
}

/* Strings are escaped per RFC 8259, and bytes that are not valid UTF-8
 * (a dlerror message may carry any bytes of a path) become U+FFFD, so that
 * the output always parses. */
static void jw_string(jw *w, const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  fputc('"', w->f);
  while (*p) {
    unsigned c = *p;
    if (c == '"' || c == '\\') {
      fputc('\\', w->f);
      fputc((int)c, w->f);
      p++;
    } else if (c < 0x20) {
      switch (c) {
      case '\n': fputs("\\n", w->f); break;
      case '\t': fputs("\\t", w->f); break;
      case '\r': fputs("\\r", w->f); break;
      case '\b': fputs("\\b", w->f); break;
      case '\f': fputs("\\f", w->f); break;
      default: fprintf(w->f, "\\u%04x", c); break;
      }
      p++;
    } else if (c < 0x80) {
      fputc((int)c, w->f);
      p++;
    } else {
      /* Length and validity of a UTF-8 sequence (no overlongs, no
       * surrogates, nothing above U+10FFFF). */
      int n = (c >= 0xc2 && c <= 0xdf) ? 2 : (c >= 0xe0 && c <= 0xef) ? 3
              : (c >= 0xf0 && c <= 0xf4) ? 4 : 0;
      bool ok = n > 0;
      for (int k = 1; ok && k < n; k++)
        ok = (p[k] & 0xc0) == 0x80;
      if (ok && n == 3)
        ok = !(c == 0xe0 && p[1] < 0xa0) && !(c == 0xed && p[1] >= 0xa0);
      if (ok && n == 4)
        ok = !(c == 0xf0 && p[1] < 0x90) && !(c == 0xf4 && p[1] >= 0x90);
      if (ok) {
        fwrite(p, 1, (size_t)n, w->f);
        p += n;
      } else {
        fputs("\\ufffd", w->f);
        p++;
      }
    }
  }
  fputc('"', w->f);
}

static void jw_open(jw *w, const char *key, char bracket, bool inl) {
  jw_prefix(w, key);
  fputc(bracket, w->f);
  w->depth++;
  w->first[w->depth] = true;
  w->inl[w->depth] = inl || (w->depth > 1 && w->inl[w->depth - 1]);
}

static void jw_close(jw *w, char bracket) {
  bool empty = w->first[w->depth], inl = w->inl[w->depth];
  w->depth--;
  if (!empty && !inl)
    fprintf(w->f, "\n%*s", 2 * w->depth, "");
  fputc(bracket, w->f);
}

#define jw_obj(w, key) jw_open((w), (key), '{', false)
#define jw_obj_end(w) jw_close((w), '}')
#define jw_arr(w, key) jw_open((w), (key), '[', false)
#define jw_arr_inline(w, key) jw_open((w), (key), '[', true)
#define jw_arr_end(w) jw_close((w), ']')

static void jw_str(jw *w, const char *key, const char *s) {
  jw_prefix(w, key);
  if (s)
    jw_string(w, s);
  else
    fputs("null", w->f);
}
static void jw_int(jw *w, const char *key, long long v) {
  jw_prefix(w, key);
  fprintf(w->f, "%lld", v);
}
static void jw_bool(jw *w, const char *key, bool b) {
  jw_prefix(w, key);
  fputs(b ? "true" : "false", w->f);
}
static void jw_null(jw *w, const char *key) {
  jw_prefix(w, key);
  fputs("null", w->f);
}
static void jw_opt_int(jw *w, const char *key, bool have, long long v) {
  if (have)
    jw_int(w, key, v);
  else
    jw_null(w, key);
}
static void jw_opt_bool(jw *w, const char *key, bool have, bool v) {
  if (have)
    jw_bool(w, key, v);
  else
    jw_null(w, key);
}

/* ---- one walk, two outputs ------------------------------------------------------ */

/* The report is walked once, by report() below; each fact is stated there
 * once, with its JSON key and value and its human label and text side by
 * side, and the emitter writes the half of its output mode: e_*() calls
 * are the JSON half, h_*() calls the human half, b_*() both. The two
 * outputs do not list the facts in quite the same order (the JSON groups
 * the driver's error with its state, the text puts it after the version),
 * so a fact one of them shows elsewhere is stated twice, each time for one
 * side only. */
typedef struct emit {
  FILE *f;
  bool json;
  jw w;
} emit;

static void h_title(emit *e, const char *fmt, ...) GPUIPC__PRINTF(2, 3);
static void h_title(emit *e, const char *fmt, ...) {
  if (e->json)
    return;
  va_list ap;
  va_start(ap, fmt);
  h_vsection(e->f, fmt, ap);
  va_end(ap);
}

static void h_line(emit *e, const char *key, const char *fmt, ...) GPUIPC__PRINTF(3, 4);
static void h_line(emit *e, const char *key, const char *fmt, ...) {
  if (e->json)
    return;
  va_list ap;
  va_start(ap, fmt);
  h_vkv(e->f, key, fmt, ap);
  va_end(ap);
}

static void e_obj(emit *e, const char *key) {
  if (e->json)
    jw_obj(&e->w, key);
}
static void e_obj_end(emit *e) {
  if (e->json)
    jw_obj_end(&e->w);
}
static void e_arr(emit *e, const char *key, bool inl) {
  if (e->json)
    jw_open(&e->w, key, '[', inl);
}
static void e_arr_end(emit *e) {
  if (e->json)
    jw_arr_end(&e->w);
}
static void e_str(emit *e, const char *key, const char *s) {
  if (e->json)
    jw_str(&e->w, key, s);
}
static void e_int(emit *e, const char *key, long long v) {
  if (e->json)
    jw_int(&e->w, key, v);
}
static void e_bool(emit *e, const char *key, bool b) {
  if (e->json)
    jw_bool(&e->w, key, b);
}
static void e_opt_int(emit *e, const char *key, bool have, long long v) {
  if (e->json)
    jw_opt_int(&e->w, key, have, v);
}
static void e_opt_bool(emit *e, const char *key, bool have, bool v) {
  if (e->json)
    jw_opt_bool(&e->w, key, have, v);
}

/* A section: a JSON object under key and a human title. */
static void b_section(emit *e, const char *key, const char *title) {
  e_obj(e, key);
  h_title(e, "%s", title);
}

/* A string both show: JSON s (null when NULL), human s or `missing`. */
static void b_str(emit *e, const char *key, const char *label, const char *s,
                  const char *missing) {
  e_str(e, key, s);
  h_line(e, label, "%s", s ? s : missing);
}

/* A driver attribute both show: number or boolean, null or "unknown"
 * when its query failed. */
static void b_attr(emit *e, const doc_device *d, enum doc_attr a) {
  char buf[32];
  if (attr_info[a].boolean)
    e_opt_bool(e, attr_info[a].key, d->have_attr[a], d->attr[a] != 0);
  else
    e_opt_int(e, attr_info[a].key, d->have_attr[a], d->attr[a]);
  if (attr_info[a].label)
    h_line(e, attr_info[a].label, "%s", attr_text(d, a, buf, sizeof buf));
}

static void report_system(emit *e, const doc_report *r) {
  b_section(e, "system", "System");
  e_str(e, "os", r->os);
  h_line(e, "OS", "%s %s%s", r->os, r->machine,
         r->is_linux ? "" : " (CUDA IPC needs Linux)");
  e_str(e, "machine", r->have_uname ? r->machine : NULL);
  e_bool(e, "linux", r->is_linux);
  e_bool(e, "process_64bit", r->is_64bit);
  h_line(e, "64-bit process", "%s", yn(r->is_64bit));
  e_str(e, "kernel", r->have_uname ? r->kernel : NULL);
  e_bool(e, "kernel_ok", r->kernel_ok);
  h_line(e, "kernel", "%s (2.6.18 or later: %s)",
         r->have_uname ? r->kernel : "unknown", yn(r->kernel_ok));
  e_obj_end(e);
}

static void report_driver(emit *e, const doc_report *r) {
  b_section(e, "driver", "Driver");
  e_bool(e, "loaded", r->loaded);
  e_bool(e, "initialized", r->initialized);
  e_str(e, "error", r->driver_error[0] ? r->driver_error : NULL);
  b_str(e, "library", "library", r->library, "");
  e_str(e, "path", r->have_driver_path ? r->driver_path : NULL);
  if (r->have_driver_path && strcmp(r->driver_path, r->library) != 0)
    h_line(e, "loaded from", "%s", r->driver_path);
  if (!r->loaded)
    h_line(e, "status", "not loaded: %s", r->driver_error);
  e_opt_int(e, "version", r->have_version, r->version);
  char cv[32];
  snprintf(cv, sizeof cv, "%d.%d", r->version / 1000, (r->version % 1000) / 10);
  e_str(e, "cuda_version", r->have_version ? cv : NULL);
  if (r->loaded) {
    if (r->have_version)
      h_line(e, "version", "%d (supports CUDA %s)", r->version, cv);
    else
      h_line(e, "version", "unknown (cuDriverGetVersion failed)");
    if (r->driver_error[0])
      h_line(e, "status", "unusable: %s", r->driver_error);
  }
  e_str(e, "kernel_module_version", r->have_kmod_version ? r->kmod_version : NULL);
  if (r->have_kmod_version)
    h_line(e, "NVIDIA kernel module", "%s", r->kmod_version);
  b_str(e, "cuda_visible_devices", "CUDA_VISIBLE_DEVICES", r->visible_devices,
        "(unset)");
  e_int(e, "device_count", r->device_count);
  if (r->loaded && !r->driver_error[0])
    h_line(e, "devices", "%d%s", r->device_count_reported,
           r->device_count_reported > r->device_count ? " (only the first 64 examined)"
                                                      : "");
  e_str(e, "devices_error", r->devices_error[0] ? r->devices_error : NULL);
  e_obj_end(e);
  if (r->device_count == 0) {
    h_title(e, "Devices");
    h_line(e, "none", "%s", r->devices_error[0] ? r->devices_error
                            : r->loaded        ? "the driver is not usable"
                                               : "no CUDA driver");
  }
}

static void report_device(emit *e, const doc_report *r, int i) {
  const doc_device *d = &r->dev[i];
  e_obj(e, NULL);
  e_int(e, "ordinal", i);
  e_str(e, "name", d->have_name ? d->name : NULL);
  h_title(e, "Device %d: %s", i, d->have_name ? d->name : "(name unknown)");
  if (!d->ok && !e->json) {
    h_line(e, "error", "%s", d->errors);
    return;
  }
  b_str(e, "uuid", "UUID", d->have_uuid ? d->uuid : NULL, "unknown");
  b_str(e, "pci_bus_id", "PCI bus id", d->have_pci ? d->pci : NULL, "unknown");
  char cc[32];
  bool have_cc = d->have_attr[A_CC_MAJOR] && d->have_attr[A_CC_MINOR];
  snprintf(cc, sizeof cc, "%d.%d", d->attr[A_CC_MAJOR], d->attr[A_CC_MINOR]);
  b_str(e, "compute_capability", "compute capability", have_cc ? cc : NULL, "unknown");
  e_opt_int(e, "total_memory", d->have_mem, (long long)d->total_mem);
  if (d->have_mem)
    h_line(e, "total memory", "%.1f GiB (%zu bytes)",
           (double)d->total_mem / (1024.0 * 1024.0 * 1024.0), d->total_mem);
  else
    h_line(e, "total memory", "unknown");
  for (int a = 0; a < A_COUNT; a++) {
    if (a == A_MEMOPS64) {
      bool memops32 = r->have_version && r->version >= 12000;
      e_bool(e, "stream_memops_32bit", memops32);
      h_line(e, "stream memops 32-bit", "%s", yn(memops32));
    }
    b_attr(e, d, (enum doc_attr)a);
    if (a == A_MEMPOOL_TYPES) {
      char buf[256];
      if (d->have_attr[a]) {
        e_arr(e, "mempool_handle_types", true);
        for (size_t k = 0; k < GPUIPC__ARRAY_SIZE(handle_types); k++)
          if (d->attr[a] & handle_types[k].bit)
            e_str(e, NULL, handle_types[k].name);
        e_arr_end(e);
        handle_types_text(d->attr[a], buf, sizeof buf);
        h_line(e, "pool handle types", "%s", buf);
      } else {
        e_str(e, "mempool_handle_types", NULL);
        h_line(e, "pool handle types", "unknown (query failed)");
      }
    }
  }
  e_str(e, "errors", d->errors[0] ? d->errors : NULL);
  if (d->errors[0])
    h_line(e, "failed queries", "%s", d->errors);
  e_obj_end(e);
}

/* The JSON's matrix of one peer attribute (which: 0 can access, 1 access
 * supported, 2 performance rank, 3 native atomics), null on the diagonal
 * and where the query failed. */
static void json_peer_matrix(emit *e, const doc_report *r, const char *key, int which) {
  e_arr(e, key, false);
  for (int i = 0; i < r->device_count; i++) {
    e_arr(e, NULL, true);
    for (int j = 0; j < r->device_count; j++) {
      const doc_peer *p = &r->peer[i][j];
      if (i == j)
        e_str(e, NULL, NULL);
      else if (which == 0)
        e_opt_bool(e, NULL, p->have_can_access, p->can_access != 0);
      else if (which == 1)
        e_opt_bool(e, NULL, p->have_access_supported, p->access_supported != 0);
      else if (which == 2)
        e_opt_int(e, NULL, p->have_perf_rank, p->perf_rank);
      else
        e_opt_bool(e, NULL, p->have_native_atomic, p->native_atomic != 0);
    }
    e_arr_end(e);
  }
  e_arr_end(e);
}

static void report_peers(emit *e, const doc_report *r) {
  e_obj(e, "peers");
  json_peer_matrix(e, r, "can_access_peer", 0);
  json_peer_matrix(e, r, "access_supported", 1);
  json_peer_matrix(e, r, "performance_rank", 2);
  json_peer_matrix(e, r, "native_atomic", 3);
  e_obj_end(e);
  if (e->json || r->device_count == 0)
    return;
  h_title(e, "Peers (from -> to: can the first device access the second's memory)");
  if (r->device_count == 1) {
    fprintf(e->f, "  one device: no pairs\n");
    return;
  }
  fprintf(e->f, "  %-8s %-16s %-16s %-17s %s\n", "pair", "can access peer",
          "P2P supported", "performance rank", "native atomics");
  for (int i = 0; i < r->device_count; i++)
    for (int j = 0; j < r->device_count; j++) {
      if (i == j)
        continue;
      const doc_peer *p = &r->peer[i][j];
      char pair[32], rank[16];
      snprintf(pair, sizeof pair, "%d -> %d", i, j);
      if (p->have_perf_rank)
        snprintf(rank, sizeof rank, "%d", p->perf_rank);
      else
        snprintf(rank, sizeof rank, "?");
      fprintf(e->f, "  %-8s %-16s %-16s %-17s %s\n", pair,
              p->have_can_access ? yn(p->can_access) : "?",
              p->have_access_supported ? yn(p->access_supported) : "?", rank,
              p->have_native_atomic ? yn(p->native_atomic) : "?");
    }
}

static void limit_text(long long v, char *buf, size_t cap) {
  if (v < 0)
    snprintf(buf, cap, "unlimited");
  else
    snprintf(buf, cap, "%lld", v);
}

static void report_process(emit *e, const doc_report *r) {
  b_section(e, "process", "Process");
  e_int(e, "uid", (long long)r->euid);
  e_obj(e, "pidfd_getfd");
  e_bool(e, "available", r->pidfd_available);
  e_str(e, "failed_call", r->pidfd_available ? NULL : r->pidfd_call);
  e_int(e, "errno", r->pidfd_available ? 0 : r->pidfd_errno);
  e_str(e, "errno_name", r->pidfd_available ? NULL : errno_name(r->pidfd_errno));
  e_obj_end(e);
  if (r->pidfd_available)
    h_line(e, "pidfd_getfd", "yes");
  else
    h_line(e, "pidfd_getfd", "no (%s: %s, %s)", r->pidfd_call,
           errno_name(r->pidfd_errno), strerror(r->pidfd_errno));
  e_obj(e, "ptrace");
  e_bool(e, "yama", r->yama);
  e_opt_int(e, "scope", r->yama && r->ptrace_scope >= 0, r->ptrace_scope);
  e_str(e, "meaning", ptrace_meaning(r));
  e_obj_end(e);
  if (r->yama)
    h_line(e, "ptrace policy", "Yama ptrace_scope %d (%s)", r->ptrace_scope,
           ptrace_meaning(r));
  else
    h_line(e, "ptrace policy", "%s", ptrace_meaning(r));
  e_obj(e, "runtime_dir");
  e_str(e, "path", r->rt_path);
  e_str(e, "source", r->rt_source);
  e_str(e, "xdg_problem", r->rt_xdg_problem[0] ? r->rt_xdg_problem : NULL);
  e_bool(e, "exists", r->rt_exists);
  e_opt_int(e, "owner_uid", r->rt_have_stat, (long long)r->rt_owner);
  char mode[16];
  snprintf(mode, sizeof mode, "%04o", r->rt_mode);
  e_str(e, "mode", r->rt_have_stat ? mode : NULL);
  e_bool(e, "safe", r->rt_safe);
  e_str(e, "detail", r->rt_detail);
  e_obj_end(e);
  h_line(e, "runtime directory", "%s (%s)", r->rt_path,
         strcmp(r->rt_source, "fallback") == 0 ? r->rt_xdg_problem
                                               : "from XDG_RUNTIME_DIR");
  if (r->rt_have_stat)
    h_line(e, "", "owner uid %u, mode %s", (unsigned)r->rt_owner, mode);
  h_line(e, "", "%s", r->rt_detail);
  e_obj(e, "nofile");
  e_opt_int(e, "soft", r->have_nofile, r->nofile_soft);
  e_opt_int(e, "hard", r->have_nofile, r->nofile_hard);
  e_obj_end(e);
  if (r->have_nofile) {
    char soft[32], hard[32];
    limit_text(r->nofile_soft, soft, sizeof soft);
    limit_text(r->nofile_hard, hard, sizeof hard);
    h_line(e, "open-file limit", "%s soft, %s hard", soft, hard);
  } else {
    h_line(e, "open-file limit", "unknown");
  }
  e_obj_end(e);
}

static void report_containers(emit *e, const doc_report *r) {
  b_section(e, "container", "Containers");
  e_bool(e, "in_container", r->in_container);
  e_str(e, "why", r->container_why);
  h_line(e, "in a container", "%s%s", r->in_container ? "yes: " : "", r->container_why);
  e_str(e, "runtime", r->runtime[0] ? r->runtime : NULL);
  e_str(e, "cgroup", r->cgroup[0] ? r->cgroup : NULL);
  e_obj(e, "namespaces");
  for (int i = 0; i < NS_COUNT; i++) {
    const doc_ns *n = &r->ns[i];
    bool known = ns_info[i].init_ino != 0 && n->have_self;
    e_obj(e, ns_info[i].name);
    e_opt_int(e, "inode", n->have_self, (long long)n->self);
    e_opt_int(e, "pid1_inode", n->have_pid1, (long long)n->pid1);
    e_opt_bool(e, "initial", known, n->self == ns_info[i].init_ino);
    e_bool(e, "own", n->own);
    e_obj_end(e);
    char label[32], pid1[64];
    snprintf(label, sizeof label, "%s namespace", ns_info[i].name);
    if (!n->have_self) {
      h_line(e, label, "unknown (/proc/self/ns/%s unreadable)", ns_info[i].name);
      continue;
    }
    if (n->have_pid1)
      snprintf(pid1, sizeof pid1, "pid 1's %s", n->pid1 == n->self ? "the same" : "differs");
    else
      snprintf(pid1, sizeof pid1, "pid 1's unreadable");
    h_line(e, label, "%llu (%s%s)", n->self,
           !known ? "" : n->self == ns_info[i].init_ino ? "the machine's, " : "its own, ",
           pid1);
  }
  e_obj_end(e);
  h_line(e, "cgroup", "%s", r->cgroup[0] ? r->cgroup : "unknown");
  e_bool(e, "peer_pidfd", r->peer_pidfd);
  h_line(e, "peer pidfd", "%s",
         r->peer_pidfd ? "yes (SO_PEERPIDFD)" : "no (SO_PEERPIDFD needs Linux 6.5)");
  e_obj(e, "with_peer_in_another_container");
  h_line(e, "another container", "with a peer there (its own pid, IPC and mount "
         "namespaces, only the socket directory shared):");
  for (int k = 0; k < XC_COUNT; k++) {
    e_obj(e, xc_info[k].key);
    e_bool(e, "works", r->xc[k].works);
    e_str(e, "why", r->xc[k].why);
    e_obj_end(e);
    h_line(e, xc_info[k].label, "%s: %s", r->xc[k].works ? "works" : "no", r->xc[k].why);
  }
  e_obj_end(e);
  e_obj_end(e);
}

static void report_environment(emit *e, const doc_report *r) {
  e_arr(e, "environment", false);
  h_title(e, "Environment (docs/environment.md)");
  for (size_t i = 0; i < r->env_count; i++) {
    gpuipc__param *p = r->env[i];
    const char *v = gpuipc__param_get(p);
    e_obj(e, NULL);
    e_str(e, "name", p->name);
    e_str(e, "value", v);
    e_str(e, "default", p->dflt);
    e_str(e, "read", param_when(p));
    e_str(e, "what", p->what);
    e_obj_end(e);
    if (v)
      h_line(e, p->name, "%s", v);
    else if (p->dflt)
      h_line(e, p->name, "unset (%s)", p->dflt);
    else
      h_line(e, p->name, "unset");
  }
  e_arr_end(e);
}

static void report_mechanisms(emit *e, const doc_report *r) {
  b_section(e, "mechanisms", "Mechanisms");
  for (int m = 0; m < M_COUNT; m++) {
    const doc_verdict *v = &r->verdict[m];
    e_obj(e, mech_info[m].key);
    e_bool(e, "usable", v->usable);
    e_str(e, "reason", v->usable ? NULL : v->reason);
    if (!v->usable)
      h_line(e, mech_info[m].label, "%s%s",
             strncmp(v->reason, "not applicable", 14) == 0 ? "" : "not usable: ",
             v->reason);
    char where[256] = "";
    int k = 0;
    if (m == M_PEER) {
      e_arr(e, "pairs", true);
      for (int i = 0; i < r->device_count; i++)
        for (int j = 0; j < r->device_count; j++)
          if (i != j && r->peer[i][j].can_access && r->peer[j][i].can_access) {
            e_arr(e, NULL, true);
            e_int(e, NULL, i);
            e_int(e, NULL, j);
            e_arr_end(e);
            if (i < j)
              gpuipc__appendf(where, sizeof where, "%s%d<->%d", where[0] ? ", " : "", i, j);
          }
      e_arr_end(e);
      if (v->usable)
        h_line(e, mech_info[m].label, "usable (pairs %s)", where);
    } else {
      e_arr(e, "devices", true);
      for (int i = 0; i < r->device_count; i++)
        if (v->on_device[i]) {
          e_int(e, NULL, i);
          gpuipc__appendf(where, sizeof where, "%s%d", where[0] ? ", " : "", i);
          k++;
        }
      e_arr_end(e);
      if (v->usable)
        h_line(e, mech_info[m].label, "usable (device%s %s)", k == 1 ? "" : "s", where);
    }
    e_obj_end(e);
  }
  e_obj_end(e);
}

/* One path of the fabric probe in words: "yes", with what the import in
 * this process answered, or "no: <call> returned <error>". */
static void fabric_path_text(const doc_fabric_path *p, bool pool, char *buf, size_t cap) {
  if (p->skipped)
    snprintf(buf, cap, "%s", p->skipped);
  else if (!p->exported)
    snprintf(buf, cap, "no: %s returned %s", p->failed_call,
             gpuipc__cuda_error_name(p->error));
  else if (p->import_failed_call)
    snprintf(buf, cap, "yes; import in this process: %s returned %s", p->import_failed_call,
             gpuipc__cuda_error_name(p->import_error));
  else if (p->import_same)
    snprintf(buf, cap, "yes; imported in this process (%s)",
             pool ? "as the same pool" : "as the same handle");
  else
    snprintf(buf, cap, "yes; imported in this process");
}

static void json_fabric_path(emit *e, const char *key, const doc_fabric_path *p) {
  e_obj(e, key);
  e_bool(e, "exported", p->exported);
  e_str(e, "skipped", p->skipped);
  e_str(e, "failed_call", p->exported || p->skipped ? NULL : p->failed_call);
  e_str(e, "error", p->exported || p->skipped ? NULL : gpuipc__cuda_error_name(p->error));
  e_opt_bool(e, "imported", p->import_tried, p->import_failed_call == NULL);
  e_str(e, "import_failed_call", p->import_failed_call);
  e_str(e, "import_error",
        p->import_failed_call ? gpuipc__cuda_error_name(p->import_error) : NULL);
  e_opt_bool(e, "import_same", p->import_tried && p->import_failed_call == NULL,
             p->import_same);
  e_obj_end(e);
}

static const char *imex_state(const gpuipc__imex *x) {
  return x->dir_errno == ENOENT ? "missing"
         : x->dir_errno != 0    ? "unreadable"
         : x->count == 0        ? "empty"
                                : "present";
}

/* The fabric export probe: in the JSON an object of its own beside
 * "mechanisms" (it counts in no result), in the text the last lines of the
 * Mechanisms section. */
static void report_fabric(emit *e, const doc_report *r) {
  const doc_verdict *v = &r->fabric_verdict;
  e_obj(e, "fabric_export");
  e_bool(e, "probed", r->fabric_probed);
  e_bool(e, "usable", v->usable);
  e_str(e, "reason", v->usable ? NULL : v->reason);
  e_arr(e, "devices", true);
  for (int i = 0; i < r->device_count; i++)
    if (v->on_device[i])
      e_int(e, NULL, i);
  e_arr_end(e);
  bool refused = false, first = true;
  e_arr(e, "probes", false);
  for (int i = 0; i < r->device_count; i++) {
    const doc_fabric *f = &r->fabric[i];
    if (f->skipped_mode) {
      e_obj(e, NULL);
      e_int(e, "ordinal", i);
      e_opt_bool(e, "attribute", r->dev[i].have_attr[A_FABRIC], r->dev[i].attr[A_FABRIC] != 0);
      e_str(e, "skipped", compute_mode_name(f->skipped_mode));
      e_obj_end(e);
      h_line(e, first ? "fabric export" : "",
             "device %d: not probed: %s compute mode (a context made here could keep a "
             "job out)", i, compute_mode_name(f->skipped_mode));
      first = false;
      continue;
    }
    if (!f->probed)
      continue;
    e_obj(e, NULL);
    e_int(e, "ordinal", i);
    e_opt_bool(e, "attribute", r->dev[i].have_attr[A_FABRIC], r->dev[i].attr[A_FABRIC] != 0);
    e_str(e, "skipped", NULL);
    json_fabric_path(e, "vmm", &f->vmm);
    json_fabric_path(e, "pool", &f->pool);
    e_str(e, "cleanup_errors", f->cleanup[0] ? f->cleanup : NULL);
    e_obj_end(e);
    char text[256];
    fabric_path_text(&f->vmm, false, text, sizeof text);
    h_line(e, first ? "fabric export" : "", "device %d VMM: %s", i, text);
    first = false;
    fabric_path_text(&f->pool, true, text, sizeof text);
    h_line(e, "", "device %d pool: %s", i, text);
    if (f->cleanup[0])
      h_line(e, "", "device %d, giving back: %s", i, f->cleanup);
    refused = refused || !f->vmm.exported || !f->pool.exported ||
              f->vmm.import_failed_call || f->pool.import_failed_call;
  }
  e_arr_end(e);
  if (!r->fabric_probed)
    h_line(e, "fabric export", "not usable: %s", v->reason);

  const gpuipc__imex *x = &r->imex;
  char detail[1024];
  gpuipc__imex_describe(x, detail, sizeof detail);
  e_obj(e, "imex_channels");
  e_str(e, "path", GPUIPC__IMEX_DIR);
  e_str(e, "state", imex_state(x));
  e_str(e, "errno_name", x->dir_errno && x->dir_errno != ENOENT ? errno_name(x->dir_errno)
                                                                : NULL);
  e_opt_int(e, "device_major", x->major >= 0, x->major);
  e_int(e, "count", x->count);
  e_arr(e, "channels", false);
  for (int k = 0; k < x->count && k < GPUIPC__IMEX_MAX; k++) {
    e_obj(e, NULL);
    e_str(e, "name", x->channel[k].name);
    e_bool(e, "opens", x->channel[k].open_errno == 0);
    e_str(e, "errno_name",
          x->channel[k].open_errno ? errno_name(x->channel[k].open_errno) : NULL);
    e_obj_end(e);
  }
  e_arr_end(e);
  e_str(e, "detail", detail);
  e_obj_end(e);
  if (refused)
    h_line(e, "", "IMEX channels: %s", detail);
  e_obj_end(e);
}

/* The whole report, as text (json false) or as one JSON object. */
static void report(FILE *out, const doc_report *r, bool json) {
  emit e = {.f = out, .json = json, .w = {.f = out}};
  e_obj(&e, NULL);
  e_str(&e, "gpuipc_version", gpuipc_version_string());
  if (!json)
    fprintf(out, "gpuipc doctor %s: can this machine share GPU memory between "
                 "processes?\n",
            gpuipc_version_string());
  report_system(&e, r);
  report_driver(&e, r);
  e_arr(&e, "devices", false);
  for (int i = 0; i < r->device_count; i++)
    report_device(&e, r, i);
  e_arr_end(&e);
  report_peers(&e, r);
  report_process(&e, r);
  report_containers(&e, r);
  report_environment(&e, r);
  report_mechanisms(&e, r);
  report_fabric(&e, r);
  e_int(&e, "usable_mechanisms", r->usable_count);
  e_int(&e, "exit_status", r->exit_status);
  e_obj_end(&e);
  if (json) {
    fputc('\n', out);
    return;
  }
  fputc('\n', out);
  if (r->exit_status == 2)
    fprintf(out, "Result: no usable CUDA driver (exit 2)\n");
  else if (r->exit_status == 1)
    fprintf(out, "Result: no sharing mechanism is usable (exit 1)\n");
  else
    fprintf(out, "Result: %d of %d mechanisms usable (exit 0)\n", r->usable_count, M_COUNT);
}

/* ---- the command ---------------------------------------------------------------- */

static void usage(FILE *f) {
  gpuipc_cli_usage_line(f, "doctor");
  fprintf(f, "  Reports whether this machine can share GPU memory between processes,\n"
             "  and by which mechanisms.\n"
             "  --json    one JSON object (keys documented in docs/doctor.md)\n"
             "  --quiet   print nothing; only the exit status\n"
             "exit status: 0 some mechanism is usable, 1 none is, 2 no CUDA driver,\n"
             "             64 usage error\n");
}

int gpuipc_cmd_doctor(int argc, char **argv) {
  bool json = false, quiet = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (strcmp(argv[i], "--quiet") == 0 || strcmp(argv[i], "-q") == 0) {
      quiet = true;
    } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "gpuipc doctor: unknown option '%s'\n", argv[i]);
      usage(stderr);
      return DOC_EXIT_USAGE;
    }
  }

  /* The report holds a 64x64 peer matrix: too big for the stack. */
  doc_report *r = calloc(1, sizeof *r);
  if (r == NULL) {
    fprintf(stderr, "gpuipc doctor: out of memory\n");
    return 2;
  }
  gather_system(r);
  gather_process(r);
  gather_driver(r);
  gather_environment(r);
  /* The fabric probe counts in no verdict: --quiet, which prints only the
   * exit status, does not make it. */
  if (!quiet)
    gather_fabric(r);
  decide(r);
  decide_cross_container(r);
  decide_fabric(r);
  if (!quiet) {
    report(stdout, r, json);
    fflush(stdout);
  }
  int status = r->exit_status;
  free(r);
  return status;
}
