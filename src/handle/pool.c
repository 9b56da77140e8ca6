/*
 * pool.c: owns pools: creating them per kind (mempool | vmm | legacy |
 * pinned host, and auto), exporting and importing a mempool once, the
 * process-wide counters behind pool ids and generations, and the registry
 * of exportable driver pools (ours, and foreign IPC-capable ones whose
 * memory was wrapped).
 */
#include "handle_int.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static atomic_uint_fast64_t pool_ids;
static atomic_uint_fast64_t generations;

uint64_t gpuipc__next_pool_id(void) { return atomic_fetch_add(&pool_ids, 1) + 1; }

/* ---- the liveness table -----------------------------------------------------------
 *
 * Why: the CUDA driver does not show an importer the exporter's buffer id
 * (driver 580: legacy and pool imports get importer-local ids), and it maps
 * freed memory without complaint, so an importer cannot tell from the
 * driver whether the allocation a descriptor names still exists. The
 * exporter tells it instead: each process that allocates keeps a table of
 * generation words in a named shared-memory object,
 *   /dev/shm/gpuipc-<uid>-<pid namespace>-<pid>-<start time>
 * (mode 0600, O_EXCL; the namespace is in the name because one /dev/shm
 * may be shared by containers whose pids mean different processes),
 * slot (generation % GPUIPC__LIVE_SLOTS) holding the generation while the
 * allocation lives and generation | GPUIPC__LIVE_FREED_BIT once freed. An
 * importer of the same uid maps it read-only (once per exporter) and
 * refuses a descriptor whose slot says "freed" (GPUIPC_E_STALE). A slot
 * holding anything else (reused by a later allocation, never written, or no
 * table at all) means "cannot tell": the import proceeds, so the table
 * never refuses live memory. Legacy descriptors travel without fds, which
 * is why the table is found by name rather than passed as an fd.
 * The exporter unlinks its table when the library is unloaded (normal
 * exit); tables of processes that died without it are removed by the next
 * process of that uid that creates its own. */

#define LIVE_MAGIC 0x4556494c43504947ull /* "GIPCLIVE" */
#define LIVE_PROBES 64

typedef struct live_header {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint64_t reserved[6];
} live_header;
#define LIVE_BYTES (sizeof(live_header) + GPUIPC__LIVE_SLOTS * sizeof(uint64_t))

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t *live_slots;  /* this process's table (NULL: none) */
static pid_t live_pid;        /* the process that made live_slots */
static bool live_tried;
static char live_path[128];

static void live_name(char *out, size_t cap, uid_t uid, uint64_t pidns,
                      int pid, uint64_t start_time) {
  snprintf(out, cap, "/dev/shm/gpuipc-%u-%llu-%d-%llu", (unsigned)uid,
           (unsigned long long)pidns, pid, (unsigned long long)start_time);
}

/* True when the process (pid, start time) is certainly gone: its pid is
 * free, or names a process with another start time. A /proc read that
 * fails for another reason (out of fds) says nothing. */
static bool process_gone(int pid, uint64_t start_time) {
  uint64_t now = gpuipc__process_start_time(pid);
  if (now != 0)
    return now != start_time;
  return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* Removes tables of this uid and pid namespace whose process is gone (pid
 * free, or reused by a process with another start time). */
static void live_sweep(uint64_t pidns) {
  DIR *dir = opendir("/dev/shm");
  if (dir == NULL)
    return;
  char prefix[64];
  snprintf(prefix, sizeof prefix, "gpuipc-%u-%llu-", (unsigned)geteuid(),
           (unsigned long long)pidns);
  size_t pl = strlen(prefix);
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    if (strncmp(e->d_name, prefix, pl) != 0)
      continue;
    int pid = 0;
    unsigned long long st = 0;
    if (sscanf(e->d_name + pl, "%d-%llu", &pid, &st) != 2 || pid <= 0)
      continue;
    if (!process_gone(pid, st))
      continue;
    if (unlinkat(dirfd(dir), e->d_name, 0) == 0)
      GPUIPC__DEBUG("handle", "removed the liveness table of gone process %d",
                    pid);
  }
  closedir(dir);
}

__attribute__((destructor)) static void live_unlink_at_exit(void) {
  if (live_slots != NULL && live_pid == getpid())
    unlink(live_path);
}

/* This process's table, made on first use (live_lock held). */
static uint64_t *live_self(void) {
  pid_t me = getpid();
  if (live_slots != NULL && live_pid != me) {
    /* A forked child inherited its parent's (shared) mapping: never write
     * the parent's table. */
    munmap((void *)((uint8_t *)live_slots - sizeof(live_header)), LIVE_BYTES);
    live_slots = NULL;
    live_tried = false;
  }
  if (live_slots != NULL || (live_tried && live_pid == me))
    return live_slots;
  live_tried = true;
  live_pid = me;
  uint64_t pidns = gpuipc__pid_namespace();
  live_sweep(pidns);
  live_name(live_path, sizeof live_path, geteuid(), pidns, (int)me,
            gpuipc__process_start_time((int)me));
  int fd = open(live_path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                0600);
  if (fd < 0) {
    GPUIPC__INFO("handle",
                 "no liveness table (%s: %s): importers of this process's "
                 "buffers cannot detect freed buffers",
                 live_path, strerror(errno));
    return NULL;
  }
  void *m = MAP_FAILED;
  if (ftruncate(fd, (off_t)LIVE_BYTES) == 0)
    m = mmap(NULL, LIVE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (m == MAP_FAILED) {
    GPUIPC__INFO("handle", "no liveness table (%s: %s)", live_path,
                 strerror(err));
    unlink(live_path);
    return NULL;
  }
  live_header *h = m;
  h->version = 1;
  h->slots = GPUIPC__LIVE_SLOTS;
  __atomic_store_n(&h->magic, LIVE_MAGIC, __ATOMIC_RELEASE);
  live_slots = (uint64_t *)(h + 1);
  return live_slots;
}

uint64_t gpuipc__next_generation(void) {
  uint64_t g = atomic_fetch_add(&generations, 1) + 1;
  pthread_mutex_lock(&live_lock);
  uint64_t *t = live_self();
  if (t != NULL) {
    /* A slot still holding a live allocation is not taken over (that would
     * turn the live one's checks into "cannot tell"): skip to the next
     * generation, a bounded number of times. */
    for (int i = 0; i < LIVE_PROBES; i++) {
      uint64_t cur = __atomic_load_n(&t[g % GPUIPC__LIVE_SLOTS], __ATOMIC_RELAXED);
      if (cur == 0 || (cur & GPUIPC__LIVE_FREED_BIT))
        break;
      g = atomic_fetch_add(&generations, 1) + 1;
    }
    __atomic_store_n(&t[g % GPUIPC__LIVE_SLOTS], g, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&live_lock);
  return g;
}

void gpuipc__generation_freed(uint64_t g) {
  if (g == 0)
    return;
  pthread_mutex_lock(&live_lock);
  uint64_t *t = live_slots != NULL && live_pid == getpid() ? live_slots : NULL;
  if (t != NULL) {
    uint64_t want = g;
    /* Only if the slot is still this generation's. */
    __atomic_compare_exchange_n(&t[g % GPUIPC__LIVE_SLOTS], &want,
                                g | GPUIPC__LIVE_FREED_BIT, false,
                                __ATOMIC_RELEASE, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&live_lock);
}

/* Exporters' tables mapped here, read-only, once per live exporter. An
 * entry goes (unmapped) once its process is gone, checked whenever a new
 * exporter is looked up: a long-running importer of many short-lived
 * exporters must not keep their (unlinked) tables' pages mapped forever,
 * and made-up identities in hostile descriptors must not grow the list. */
typedef struct peer_table {
  int32_t pid;
  uint64_t start_time;
  const uint64_t *slots; /* NULL: unreachable (logged once) */
  struct peer_table *next;
} peer_table;
static peer_table *peers;

static void peer_unmap(const uint64_t *slots) {
  if (slots != NULL)
    munmap((void *)((const uint8_t *)slots - sizeof(live_header)), LIVE_BYTES);
}

static const uint64_t *peer_open(const gpuipc__identity *ex) {
  char path[128];
  live_name(path, sizeof path, geteuid(), ex->pidns, ex->pid,
            ex->start_time);
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    GPUIPC__INFO("handle",
                 "cannot check whether buffers of pid %d are freed: its "
                 "liveness table %s: %s (another uid or /dev/shm, or an "
                 "older library); imports proceed unchecked",
                 (int)ex->pid, path, strerror(errno));
    return NULL;
  }
  struct stat st;
  const uint64_t *slots = NULL;
  /* Only a table of this very uid, closed to others, is trusted: anyone
   * could create a file with that name. */
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
      (st.st_mode & 0077) == 0 && (size_t)st.st_size == LIVE_BYTES) {
    void *m = mmap(NULL, LIVE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    if (m != MAP_FAILED) {
      const live_header *h = m;
      if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == LIVE_MAGIC &&
          h->version == 1 && h->slots == GPUIPC__LIVE_SLOTS)
        slots = (const uint64_t *)(h + 1);
      else
        munmap(m, LIVE_BYTES);
    }
  }
  close(fd);
  if (slots == NULL)
    GPUIPC__INFO("handle",
                 "liveness table %s of pid %d is not usable (owner, mode, "
                 "size or format): imports from it proceed unchecked",
                 path, (int)ex->pid);
  return slots;
}

gpuipc__live_state gpuipc__generation_state(const gpuipc__identity *ex,
                                            uint64_t g) {
  if (g == 0 || (g & GPUIPC__LIVE_FREED_BIT))
    return GPUIPC__LIVE_UNKNOWN;
  gpuipc__live_state st = GPUIPC__LIVE_UNKNOWN;
  pthread_mutex_lock(&live_lock);
  peer_table *p;
  for (p = peers; p; p = p->next)
    if (p->pid == ex->pid && p->start_time == ex->start_time)
      break;
  if (p == NULL) {
    /* Forget exporters that are gone. */
    for (peer_table **pp = &peers; *pp;) {
      peer_table *q = *pp;
      if (process_gone(q->pid, q->start_time)) {
        *pp = q->next;
        peer_unmap(q->slots);
        free(q);
      } else {
        pp = &q->next;
      }
    }
    if (process_gone(ex->pid, ex->start_time)) {
      /* The exporter is gone (or never was): nothing to keep. Its table,
       * if still there, is read once for this import. */
      const uint64_t *t = peer_open(ex);
      if (t != NULL) {
        uint64_t v = __atomic_load_n(&t[g % GPUIPC__LIVE_SLOTS],
                                     __ATOMIC_ACQUIRE);
        st = v == g ? GPUIPC__LIVE_YES
             : v == (g | GPUIPC__LIVE_FREED_BIT) ? GPUIPC__LIVE_FREED
                                                 : GPUIPC__LIVE_UNKNOWN;
        peer_unmap(t);
      }
      pthread_mutex_unlock(&live_lock);
      return st;
    }
    p = calloc(1, sizeof *p);
    if (p == NULL) {
      pthread_mutex_unlock(&live_lock);
      return GPUIPC__LIVE_UNKNOWN;
    }
    p->pid = ex->pid;
    p->start_time = ex->start_time;
    p->slots = peer_open(ex);
    p->next = peers;
    peers = p;
  }
  /* Read under the lock: a concurrent lookup may unmap a gone exporter's
   * table. */
  if (p->slots != NULL) {
    uint64_t v = __atomic_load_n(&p->slots[g % GPUIPC__LIVE_SLOTS],
                                 __ATOMIC_ACQUIRE);
    if (v == g)
      st = GPUIPC__LIVE_YES;
    else if (v == (g | GPUIPC__LIVE_FREED_BIT))
      st = GPUIPC__LIVE_FREED;
  }
  pthread_mutex_unlock(&live_lock);
  return st;
}

const char *gpuipc_pool_kind_name(gpuipc_pool_kind kind) {
  switch (kind) {
  case GPUIPC_POOL_AUTO:
    return "auto";
  case GPUIPC_POOL_MEMPOOL:
    return "mempool";
  case GPUIPC_POOL_VMM:
    return "vmm";
  case GPUIPC_POOL_LEGACY:
    return "legacy";
  case GPUIPC_POOL_PINNED_HOST:
    return "pinned-host";
  }
  return "unknown";
}

gpuipc_status gpuipc__resolve_device(const gpuipc_uuid *uuid, int ordinal,
                                     int *out) {
  if (uuid)
    return gpuipc__device_ordinal(uuid, out);
  int n = 0;
  GPUIPC__CHECK(gpuipc_device_count(&n));
  if (ordinal < 0 || ordinal >= n)
    return gpuipc__fail(GPUIPC_E_NO_DEVICE,
                        "device ordinal %d: %d device(s) visible", ordinal, n);
  *out = ordinal;
  return GPUIPC_OK;
}

/* Kept for the handle layer's callers; the device layer caches the table. */
gpuipc_status gpuipc__device_ordinal(const gpuipc_uuid *uuid, int *ordinal) {
  return gpuipc_device_from_uuid(uuid, ordinal);
}

/* ---- registry of exportable driver pools ----------------------------------------- */

typedef struct reg_pool {
  CUmemoryPool mp;
  uint64_t id;
  int fd;       /* owned by the gpuipc_pool, or by the registry if foreign */
  bool foreign;
  struct reg_pool *next;
} reg_pool;

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static reg_pool *registry;

static gpuipc_status reg_add(CUmemoryPool mp, uint64_t id, int fd,
                             bool foreign) {
  reg_pool *r = calloc(1, sizeof *r);
  if (r == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool registry");
  r->mp = mp;
  r->id = id;
  r->fd = fd;
  r->foreign = foreign;
  pthread_mutex_lock(&reg_lock);
  r->next = registry;
  registry = r;
  pthread_mutex_unlock(&reg_lock);
  return GPUIPC_OK;
}

static void reg_remove(CUmemoryPool mp) {
  pthread_mutex_lock(&reg_lock);
  for (reg_pool **pp = &registry; *pp; pp = &(*pp)->next)
    if ((*pp)->mp == mp) {
      reg_pool *r = *pp;
      *pp = r->next;
      free(r);
      break;
    }
  pthread_mutex_unlock(&reg_lock);
}

gpuipc_status gpuipc__pool_lookup_foreign(CUmemoryPool mp, int ordinal,
                                          uint64_t *id, int *fd) {
  pthread_mutex_lock(&reg_lock);
  for (reg_pool *r = registry; r; r = r->next)
    if (r->mp == mp) {
      *id = r->id;
      *fd = r->fd;
      pthread_mutex_unlock(&reg_lock);
      return GPUIPC_OK;
    }
  pthread_mutex_unlock(&reg_lock);
  /* A pool gpuipc did not create: it can be shared only if it was created
   * with POSIX fd export. Its fd is made once and kept for the life of the
   * process (gpuipc cannot know when the owner destroys the pool). */
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, ordinal));
  int newfd = -1;
  CUresult r = GPUIPC__CU(cuMemPoolExportToShareableHandle, &newfd, mp,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemPoolExportToShareableHandle",
                             "the wrapped memory's pool was not created with "
                             "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, so it "
                             "cannot be shared");
  uint64_t nid = gpuipc__next_pool_id();
  gpuipc_status s = reg_add(mp, nid, newfd, true);
  if (s != GPUIPC_OK) {
    close(newfd);
    return s;
  }
  *id = nid;
  *fd = newfd;
  return GPUIPC_OK;
}

/* ---- create / destroy ------------------------------------------------------------- */

static gpuipc_status dev_attr(CUdevice dev, CUdevice_attribute a, int *v) {
  *v = 0;
  CUresult r = GPUIPC__CU(cuDeviceGetAttribute, v, a, dev);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuDeviceGetAttribute", "attribute %d",
                             (int)a);
  return GPUIPC_OK;
}

static gpuipc_status pick_kind(CUdevice dev, int ordinal,
                               gpuipc_pool_kind *kind) {
  int pools = 0, types = 0, vmm = 0, fd = 0;
  GPUIPC__CHECK(dev_attr(dev, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, &pools));
  GPUIPC__CHECK(dev_attr(dev, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES,
                         &types));
  if (pools && (types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    GPUIPC__INFO("handle", "pool kind auto on device %d: mempool", ordinal);
    *kind = GPUIPC_POOL_MEMPOOL;
    return GPUIPC_OK;
  }
  GPUIPC__CHECK(dev_attr(dev, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                         &vmm));
  GPUIPC__CHECK(dev_attr(
      dev, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, &fd));
  if (vmm && fd) {
    GPUIPC__INFO("handle",
                 "pool kind auto on device %d: vmm (no IPC-capable memory "
                 "pools)",
                 ordinal);
    *kind = GPUIPC_POOL_VMM;
    return GPUIPC_OK;
  }
  GPUIPC__INFO("handle",
               "pool kind auto on device %d: legacy (neither IPC memory pools "
               "nor VMM fd export)",
               ordinal);
  *kind = GPUIPC_POOL_LEGACY;
  return GPUIPC_OK;
}

static gpuipc_status make_mempool(gpuipc_pool *p, uint64_t threshold) {
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = p->cudev;
  props.maxSize = p->capacity;
  gpuipc_status s = GPUIPC_OK;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, p->ordinal));
  CUresult r = GPUIPC__CU(cuMemPoolCreate, &p->mp, &props);
  if (r != CUDA_SUCCESS) {
    p->mp = NULL;
    s = gpuipc__fail_cuda(r, "cuMemPoolCreate", "device %d, fd export",
                          p->ordinal);
    goto out;
  }
  if (threshold) {
    cuuint64_t t = threshold;
    r = GPUIPC__CU(cuMemPoolSetAttribute, p->mp,
                   CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &t);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemPoolSetAttribute",
                            "release threshold %llu",
                            (unsigned long long)threshold);
      goto out;
    }
  }
  for (int i = 0; i < p->n_access; i++) {
    CUmemAccessDesc ad;
    memset(&ad, 0, sizeof ad);
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = p->access[i];
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = GPUIPC__CU(cuMemPoolSetAccess, p->mp, &ad, 1);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemPoolSetAccess", "device %d for pool on %d",
                            p->access[i], p->ordinal);
      goto out;
    }
  }
  /* The pool's shareable handle, made once: every export dup()s it, and the
   * pidfd route fetches this very fd number. */
  r = GPUIPC__CU(cuMemPoolExportToShareableHandle, &p->export_fd, p->mp,
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) {
    p->export_fd = -1;
    s = gpuipc__fail_cuda(r, "cuMemPoolExportToShareableHandle", "device %d",
                          p->ordinal);
    goto out;
  }
  s = reg_add(p->mp, p->id, p->export_fd, false);
out:
  if (s != GPUIPC_OK) {
    if (p->export_fd >= 0)
      close(p->export_fd);
    p->export_fd = -1;
    if (p->mp) {
      CUresult r2 = GPUIPC__CU(cuMemPoolDestroy, p->mp);
      if (r2 != CUDA_SUCCESS)
        GPUIPC__WARN("handle", "cuMemPoolDestroy after a failed create: %s",
                     gpuipc__cuda_error_name(r2));
      p->mp = NULL;
    }
  }
  gpuipc__ctx_leave(&g);
  return s;
}

static gpuipc_status vmm_granularity(gpuipc_pool *p) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = p->cudev;
  size_t gran = 0;
  CUresult r = GPUIPC__CU(cuMemGetAllocationGranularity, &gran, &prop,
                          CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuMemGetAllocationGranularity", "device %d",
                             p->ordinal);
  if (gran == 0 || (gran & (gran - 1)) != 0)
    return gpuipc__fail(GPUIPC_E_INTERNAL, "VMM granularity %zu", gran);
  p->granularity = gran;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_pool_create(const gpuipc_pool_options *opts_in,
                                 gpuipc_pool **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_create: pool NULL");
  *out = NULL;
  gpuipc_pool_options opts = GPUIPC_POOL_OPTIONS_INIT;
  GPUIPC__CHECK(gpuipc__options_copy(&opts, sizeof opts, opts_in, 0,
                                     "gpuipc_pool_options",
                                     "GPUIPC_POOL_OPTIONS_INIT"));
  if ((unsigned)opts.kind > GPUIPC_POOL_PINNED_HOST)
    return gpuipc__fail(GPUIPC_E_BAD_KIND, "gpuipc_pool_create: kind %d",
                        (int)opts.kind);
  if (opts.n_access_devices < 0 || opts.n_access_devices > GPUIPC__MAX_ACCESS ||
      (opts.n_access_devices > 0 && opts.access_devices == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_pool_create: %d access devices (at most %d)",
                        opts.n_access_devices, GPUIPC__MAX_ACCESS);
  GPUIPC__CHECK(gpuipc__driver());

  gpuipc_pool *p = calloc(1, sizeof *p);
  if (p == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool");
  p->export_fd = -1;
  pthread_mutex_init(&p->lock, NULL);
  gpuipc_status s = gpuipc__resolve_device(opts.device_uuid, opts.device,
                                           &p->ordinal);
  if (s != GPUIPC_OK)
    goto fail;
  CUresult r = GPUIPC__CU(cuDeviceGet, &p->cudev, p->ordinal);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuDeviceGet", "ordinal %d", p->ordinal);
    goto fail;
  }
  GPUIPC__CHECK_GOTO(gpuipc_device_uuid(p->ordinal, &p->uuid), s, fail);
  for (int i = 0; i < opts.n_access_devices; i++) {
    int o = -1;
    GPUIPC__CHECK_GOTO(gpuipc__device_ordinal(&opts.access_devices[i], &o), s,
                       fail);
    if (o == p->ordinal)
      continue;
    CUdevice other;
    int can = 0;
    r = GPUIPC__CU(cuDeviceGet, &other, o);
    if (r == CUDA_SUCCESS)
      r = GPUIPC__CU(cuDeviceCanAccessPeer, &can, other, p->cudev);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuDeviceCanAccessPeer", "%d -> %d", o,
                            p->ordinal);
      goto fail;
    }
    if (!can) {
      s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                       "device %d cannot access device %d's memory (no peer "
                       "access between them)",
                       o, p->ordinal);
      goto fail;
    }
    p->access[p->n_access++] = o;
  }
  p->kind = opts.kind;
  if (p->kind == GPUIPC_POOL_AUTO)
    GPUIPC__CHECK_GOTO(pick_kind(p->cudev, p->ordinal, &p->kind), s, fail);
  p->capacity = opts.capacity;
  p->id = gpuipc__next_pool_id();
  GPUIPC__CHECK_GOTO(gpuipc__self_identity(&p->exporter), s, fail);
  switch (p->kind) {
  case GPUIPC_POOL_MEMPOOL:
    s = make_mempool(p, opts.release_threshold);
    break;
  case GPUIPC_POOL_VMM:
    s = vmm_granularity(p);
    break;
  case GPUIPC_POOL_LEGACY:
  case GPUIPC_POOL_PINNED_HOST:
  default:
    /* Nothing to create up front: each buffer is its own allocation. The
     * primary context is retained here so that allocation does not pay it. */
    {
      CUcontext c;
      s = gpuipc__primary_ctx(p->ordinal, &c);
    }
    break;
  }
  if (s != GPUIPC_OK)
    goto fail;
  GPUIPC__DEBUG("handle", "pool %llu created: %s on device %d",
                (unsigned long long)p->id, gpuipc_pool_kind_name(p->kind),
                p->ordinal);
  *out = p;
  return GPUIPC_OK;
fail:
  pthread_mutex_destroy(&p->lock);
  free(p);
  return s;
}

gpuipc_status gpuipc_pool_destroy(gpuipc_pool *p) {
  if (p == NULL)
    return GPUIPC_OK;
  if (p->imported) {
    gpuipc__pool_import_release(p->pimp);
    pthread_mutex_destroy(&p->lock);
    free(p);
    return GPUIPC_OK;
  }
  long live = atomic_load(&p->live);
  if (live > 0)
    return gpuipc__fail(GPUIPC_E_BUSY,
                        "gpuipc_pool_destroy: pool %llu still has %ld live "
                        "buffer(s)",
                        (unsigned long long)p->id, live);
  gpuipc_status s = GPUIPC_OK;
  if (p->kind == GPUIPC_POOL_MEMPOOL && p->mp) {
    reg_remove(p->mp);
    if (p->export_fd >= 0)
      close(p->export_fd);
    gpuipc__ctx_guard g;
    s = gpuipc__ctx_enter(&g, p->ordinal);
    if (s == GPUIPC_OK) {
      CUresult r = GPUIPC__CU(cuMemPoolDestroy, p->mp);
      if (r != CUDA_SUCCESS)
        s = gpuipc__fail_cuda(r, "cuMemPoolDestroy", "pool %llu",
                              (unsigned long long)p->id);
      gpuipc__ctx_leave(&g);
    }
  }
  pthread_mutex_destroy(&p->lock);
  free(p);
  return s;
}

gpuipc_pool_kind gpuipc_pool_get_kind(const gpuipc_pool *p) {
  return p ? p->kind : GPUIPC_POOL_AUTO;
}

gpuipc_status gpuipc_pool_get_device(const gpuipc_pool *p, gpuipc_uuid *uuid) {
  if (p == NULL || uuid == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_get_device: NULL");
  *uuid = p->uuid;
  return GPUIPC_OK;
}

gpuipc_status gpuipc__pool_fd(gpuipc_pool *p, int *fd) {
  if (p == NULL || fd == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc__pool_fd: NULL");
  if (p->kind != GPUIPC_POOL_MEMPOOL || p->imported || p->export_fd < 0)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "only a mempool created here has a pool fd");
  *fd = p->export_fd;
  return GPUIPC_OK;
}

gpuipc_status gpuipc__pool_identity(const gpuipc_pool *p,
                                    gpuipc__identity *exporter,
                                    uint64_t *pool_id) {
  if (p == NULL || exporter == NULL || pool_id == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc__pool_identity: NULL");
  *exporter = p->exporter;
  *pool_id = p->id;
  return GPUIPC_OK;
}

/* ---- export / import -------------------------------------------------------------- */

gpuipc_status gpuipc_pool_export(gpuipc_pool *p, uint8_t *desc, size_t cap,
                                 size_t *len, int *fd) {
  if (p == NULL || desc == NULL || len == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_export: NULL");
  if (fd)
    *fd = -1;
  if (p->imported)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_pool_export: an imported pool cannot be "
                        "re-exported");
  if (p->kind != GPUIPC_POOL_MEMPOOL)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_pool_export: %s pools have no pool-level "
                        "export; export their buffers one by one",
                        gpuipc_pool_kind_name(p->kind));
  gpuipc__desc d;
  memset(&d, 0, sizeof d);
  d.type = GPUIPC_DESC_POOL;
  d.kind = GPUIPC_POOL_MEMPOOL;
  d.exporter_fd = p->export_fd;
  memcpy(d.device, p->uuid.bytes, 16);
  d.pool_id = p->id;
  GPUIPC__CHECK(gpuipc__desc_set_exporter(&d));
  int newfd = -1;
  if (fd) {
    newfd = fcntl(p->export_fd, F_DUPFD_CLOEXEC, 0);
    if (newfd < 0)
      return gpuipc__fail_errno(errno, "dup", "pool fd");
    d.nfds = 1;
  }
  gpuipc_status s = gpuipc__desc_encode(&d, desc, cap, len);
  if (s != GPUIPC_OK) {
    if (newfd >= 0)
      close(newfd);
    return s;
  }
  if (fd)
    *fd = newfd;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_pool_import(const uint8_t *desc, size_t len, int fd,
                                 const gpuipc_import_options *opts_in,
                                 gpuipc_pool **out) {
  if (desc == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_pool_import: NULL");
  *out = NULL;
  gpuipc_import_options opts;
  gpuipc__desc d;
  GPUIPC__CHECK(gpuipc__desc_open("gpuipc_pool_import", desc, len, opts_in,
                                  GPUIPC_DESC_POOL, "a pool", &opts, &d));
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid dev;
  memcpy(dev.bytes, d.device, 16);
  int home = -1, map = -1;
  GPUIPC__CHECK(gpuipc__device_ordinal(&dev, &home));
  map = home;
  if (opts.device)
    GPUIPC__CHECK(gpuipc__device_ordinal(opts.device, &map));

  gpuipc_pool *p = calloc(1, sizeof *p);
  if (p == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "pool");
  gpuipc_status s =
      gpuipc__pool_import_acquire(&d, map, fd, opts.flags, &p->pimp);
  if (s != GPUIPC_OK) {
    free(p);
    return s;
  }
  pthread_mutex_init(&p->lock, NULL);
  p->kind = GPUIPC_POOL_MEMPOOL;
  p->imported = true;
  p->ordinal = home;
  p->uuid = dev;
  p->id = d.pool_id;
  p->exporter = d.exporter;
  p->export_fd = -1;
  p->mp = gpuipc__pool_import_handle(p->pimp);
  *out = p;
  return GPUIPC_OK;
}

int gpuipc__pool_ordinal(const gpuipc_pool *pool) { return pool->ordinal; }
