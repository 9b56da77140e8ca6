/*
 * live.c: owns the liveness tables: this process's table of generation
 * words (made on first allocation, marked when an allocation is freed,
 * unlinked at exit; tables of gone processes swept), the process-wide
 * counter behind generations, and the exporters' tables an importer reads
 * to refuse descriptors of freed buffers (GPUIPC_E_STALE).
 */
#include "handle_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static atomic_uint_fast64_t generations;

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

bool gpuipc__exporter_gone(const gpuipc__identity *ex) {
  return process_gone(ex->pid, ex->start_time);
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
