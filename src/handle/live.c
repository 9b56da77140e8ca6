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
#include <linux/magic.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

static atomic_uint_fast64_t generations;

/* ---- the liveness table -----------------------------------------------------------
 *
 * Why: the CUDA driver does not show an importer the exporter's buffer id
 * (driver 580: legacy and pool imports get importer-local ids), and it maps
 * freed memory without complaint, so an importer cannot tell from the
 * driver whether the allocation a descriptor names still exists. The
 * exporter tells it instead: each process that allocates or exports keeps
 * a table of generation words in a named shared-memory object,
 *   /dev/shm/gpuipc-<uid>-<pid namespace>-<pid>-<start time>-<key>
 * (mode 0600, O_EXCL; the namespace is in the name because one /dev/shm
 * may be shared by containers whose pids mean different processes; <key>
 * is 64 random bits, made anew while the name exists, and travels in every
 * descriptor, so nobody can claim the name before the exporter creates it),
 * slot (generation % GPUIPC__LIVE_SLOTS) holding the generation while the
 * allocation lives and generation | GPUIPC__LIVE_FREED_BIT once freed. An
 * importer of the same uid reads it (opened for each lookup) and
 * refuses a descriptor whose slot says "freed" (GPUIPC_E_STALE). A slot
 * holding anything else (reused by a later allocation, never written)
 * means "cannot tell": the import proceeds, so the table never refuses
 * live memory. Legacy descriptors travel without fds, which is why the
 * table can be found by name.
 *
 * A name in /dev/shm reaches only processes that share that /dev/shm (one
 * IPC and mount namespace, as containers do not): a connection therefore
 * carries the table itself, a read-only fd of it passed once at the
 * handshake (gpuipc__live_table_fd on one side, gpuipc__live_peer_open on
 * the other), and descriptors of the connection's peer that arrive over it
 * are checked against that table (the gpuipc__via of the import); the
 * by-name lookup stays for descriptors that travel any other way. A table
 * from a peer is hostile input: checked to be a tmpfs file (or memfd) of a
 * table's size and header, and read with pread only, so a peer that
 * truncates it cannot fault this process. When /dev/shm cannot hold a
 * table at all (absent, read-only), the table is a sealed memfd that only
 * connections carry.
 *
 * Pids of another pid namespace mean nothing here: whether such an
 * exporter is gone is what a pidfd of it says (the connection layer
 * registers its peer's, gpuipc__live_watch_identity), never /proc.
 *
 * The table also records what the exporter exported by fd, indexed by fd
 * number: the kind, the export's tag (the generation of a VMM or pinned
 * host buffer, the pool id of a memory pool) and the file's device and
 * inode. Only the exporter writes it, so an importer that fetched an fd by
 * pidfd_getfd can prove that the file it got is the export the descriptor
 * names, and not some other file a forged descriptor pointed it at. (A
 * driver's handles may be anonymous files sharing one inode, so for them
 * the proof rests on the record itself: written at export, cleared before
 * the fd is closed, naming the allocation's generation or the pool's id.)
 *
 * The exporter unlinks its table when the library is unloaded (normal
 * exit); tables of processes that died without it are removed by the next
 * process of that uid that creates its own. */

#define LIVE_MAGIC 0x4556494c43504947ull /* "GIPCLIVE" */
#define LIVE_VERSION 2u
#define LIVE_PROBES 64
#define LIVE_NAME_TRIES 16

typedef struct live_header {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t exports; /* version 2: records after the slots */
  uint32_t pad;
  uint64_t reserved[5];
} live_header;
_Static_assert(sizeof(live_header) == 64, "liveness table header");

/* One export record (version 2). seq is odd while the exporter writes it;
 * kind 0: no export at that fd number. */
typedef struct live_export {
  uint32_t seq;
  uint32_t kind;
  uint64_t tag;
  uint64_t dev;
  uint64_t ino;
} live_export;

#define LIVE_V1_BYTES                                                          \
  (sizeof(live_header) + GPUIPC__LIVE_SLOTS * sizeof(uint64_t))
#define LIVE_BYTES                                                             \
  (LIVE_V1_BYTES + GPUIPC__LIVE_EXPORTS * sizeof(live_export))

/* A table mapped here. */
typedef struct live_map {
  void *base;           /* NULL: none */
  size_t bytes;
  uint64_t *slots;
  live_export *exports; /* NULL: a version 1 table, without records */
} live_map;

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static live_map self;         /* this process's table */
static pid_t live_pid;        /* the process that made it */
static bool live_tried;
static uint64_t live_key_self; /* its key */
static char live_path[160];   /* "": a memfd (live_memfd), no name */
static int live_memfd = -1;   /* the table when /dev/shm cannot hold it */
static uint64_t live_dev, live_ino; /* the table's file */

/* The table's name; key 0: the name of older libraries, without one. */
static void live_name(char *out, size_t cap, uid_t uid, uint64_t pidns,
                      int pid, uint64_t start_time, uint64_t key) {
  if (key == 0)
    snprintf(out, cap, "/dev/shm/gpuipc-%u-%llu-%d-%llu", (unsigned)uid,
             (unsigned long long)pidns, pid, (unsigned long long)start_time);
  else
    snprintf(out, cap, "/dev/shm/gpuipc-%u-%llu-%d-%llu-%016llx",
             (unsigned)uid, (unsigned long long)pidns, pid,
             (unsigned long long)start_time, (unsigned long long)key);
}

static void live_unmap(live_map *m) {
  if (m->base != NULL)
    munmap(m->base, m->bytes);
  memset(m, 0, sizeof *m);
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

/* Pidfds of processes of other pid namespaces (connections' peers), by
 * identity. An entry goes once its process is gone; at most WATCH_MAX. */
#define WATCH_MAX 1024
typedef struct watched {
  gpuipc__identity id;
  int pidfd;
  struct watched *next;
} watched;
static watched *watches;
static int nwatches;
static pthread_mutex_t watch_lock = PTHREAD_MUTEX_INITIALIZER;

static bool pidfd_exited(int pidfd) {
  struct pollfd pf = {pidfd, POLLIN, 0};
  int r;
  GPUIPC__EINTR_RETRY(r, poll(&pf, 1, 0));
  return r > 0;
}

/* Drops the entries of gone processes (watch_lock held). */
static void watch_sweep(void) {
  for (watched **pp = &watches; *pp;) {
    watched *w = *pp;
    if (pidfd_exited(w->pidfd)) {
      *pp = w->next;
      close(w->pidfd);
      free(w);
      nwatches--;
    } else {
      pp = &w->next;
    }
  }
}

void gpuipc__live_watch_identity(const gpuipc__identity *id, int pidfd) {
  if (pidfd < 0)
    return;
  pthread_mutex_lock(&watch_lock);
  watch_sweep();
  bool have = false;
  for (watched *w = watches; w && !have; w = w->next)
    have = gpuipc__identity_eq(&w->id, id);
  watched *w = NULL;
  if (!have && nwatches < WATCH_MAX && (w = calloc(1, sizeof *w)) != NULL) {
    w->pidfd = fcntl(pidfd, F_DUPFD_CLOEXEC, 0);
    if (w->pidfd < 0) {
      free(w);
    } else {
      w->id = *id;
      w->next = watches;
      watches = w;
      nwatches++;
    }
  }
  pthread_mutex_unlock(&watch_lock);
}

/* Whether the process an identity names is gone, in whichever pid
 * namespace it lives. */
static bool identity_gone(const gpuipc__identity *ex) {
  if (ex->pidns == gpuipc__pid_namespace())
    return process_gone(ex->pid, ex->start_time);
  bool gone = true;
  pthread_mutex_lock(&watch_lock);
  watch_sweep(); /* a gone peer's pidfd is not kept */
  for (watched *w = watches; w; w = w->next)
    if (gpuipc__identity_eq(&w->id, ex)) {
      gone = pidfd_exited(w->pidfd);
      break;
    }
  pthread_mutex_unlock(&watch_lock);
  return gone;
}

bool gpuipc__exporter_gone(const gpuipc__identity *ex) {
  return identity_gone(ex);
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
  if (self.base != NULL && live_pid == getpid() && live_path[0] != '\0')
    unlink(live_path);
}

static uint64_t random_key(void) {
  uint64_t k = 0;
  while (k == 0) {
    if (getrandom(&k, sizeof k, 0) != (ssize_t)sizeof k) {
      /* No entropy source: still unpredictable enough to an outsider
       * that cannot watch this process, and EEXIST makes another. */
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      k = ((uint64_t)ts.tv_nsec << 32) ^ (uint64_t)ts.tv_sec ^
          ((uint64_t)getpid() << 16) ^ (uint64_t)(uintptr_t)&k;
    }
  }
  return k;
}

/* This process's table, made on first use (live_lock held). Its name
 * carries a random key, made anew while the name exists: whoever created a
 * file of a name this process would have chosen, nobody can make it run
 * without its table. Any other failure is reported loudly, once. */
static live_map *live_self(void) {
  pid_t me = getpid();
  if (self.base != NULL && live_pid != me) {
    /* A forked child inherited its parent's (shared) mapping: never write
     * the parent's table. */
    live_unmap(&self);
    live_tried = false;
  }
  if (live_memfd >= 0 && live_pid != me) {
    close(live_memfd); /* the parent's */
    live_memfd = -1;
  }
  if (self.base != NULL)
    return &self;
  if (live_tried && live_pid == me)
    return NULL;
  live_tried = true;
  live_pid = me;
  uint64_t pidns = gpuipc__pid_namespace();
  uint64_t start = gpuipc__process_start_time((int)me);
  live_sweep(pidns);
  int fd = -1, err = 0;
  uint64_t key = 0;
  for (int i = 0; i < LIVE_NAME_TRIES && fd < 0; i++) {
    key = random_key();
    live_name(live_path, sizeof live_path, geteuid(), pidns, (int)me, start,
              key);
    fd = open(live_path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
              0600);
    err = errno;
    if (fd < 0 && err != EEXIST)
      break;
  }
  bool named = fd >= 0;
  if (!named) {
    /* No /dev/shm for it (a container without one, read-only, full):
     * a sealed memfd, which only connections carry. */
    char why[200];
    snprintf(why, sizeof why, "%s: %s", live_path, strerror(err));
    live_path[0] = '\0';
    fd = memfd_create("gpuipc-live", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
      GPUIPC__WARN("handle",
                   "no liveness table (%s; memfd_create: %s): importers of "
                   "this process's buffers cannot detect freed buffers, and "
                   "cannot fetch its fds by pidfd_getfd",
                   why, strerror(errno));
      return NULL;
    }
    GPUIPC__INFO("handle",
                 "liveness table in a memfd (%s): it reaches importers over "
                 "connections only",
                 why);
  }
  void *m = MAP_FAILED;
  if (ftruncate(fd, (off_t)LIVE_BYTES) == 0)
    m = mmap(NULL, LIVE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  err = errno;
  /* A memfd table is sealed: its size is fixed, and nobody given its fd
   * can write it or map it writable (this mapping stays writable). */
  if (m != MAP_FAILED && !named &&
      fcntl(fd, F_ADD_SEALS,
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) !=
          0) {
    err = errno;
    munmap(m, LIVE_BYTES);
    m = MAP_FAILED;
  }
  struct stat st;
  if (m != MAP_FAILED && fstat(fd, &st) == 0) {
    live_dev = (uint64_t)st.st_dev;
    live_ino = (uint64_t)st.st_ino;
  }
  if (named)
    close(fd);
  if (m == MAP_FAILED) {
    GPUIPC__WARN("handle",
                 "no liveness table (%s: %s): importers of this process's "
                 "buffers cannot detect freed buffers",
                 named ? live_path : "memfd", strerror(err));
    if (named)
      unlink(live_path);
    else
      close(fd);
    return NULL;
  }
  if (!named)
    live_memfd = fd;
  live_header *h = m;
  h->version = LIVE_VERSION;
  h->slots = GPUIPC__LIVE_SLOTS;
  h->exports = GPUIPC__LIVE_EXPORTS;
  __atomic_store_n(&h->magic, LIVE_MAGIC, __ATOMIC_RELEASE);
  self.base = m;
  self.bytes = LIVE_BYTES;
  self.slots = (uint64_t *)(h + 1);
  self.exports = (live_export *)(self.slots + GPUIPC__LIVE_SLOTS);
  live_key_self = key;
  return &self;
}

int gpuipc__live_table_fd(uint64_t *key) {
  pthread_mutex_lock(&live_lock);
  live_map *t = live_self();
  int fd = -1;
  const char *why = "this process has no liveness table (see the log)";
  if (t != NULL && live_memfd >= 0) {
    fd = fcntl(live_memfd, F_DUPFD_CLOEXEC, 0);
    why = "dup of the table's memfd failed";
  } else if (t != NULL) {
    /* Read-only: the peer may read the table, never write it. */
    fd = open(live_path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    why = "the table's file could not be opened again";
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || (uint64_t)st.st_dev != live_dev ||
                    (uint64_t)st.st_ino != live_ino)) {
      close(fd);
      fd = -1;
      errno = ESTALE;
      why = "the table's name names another file now";
    }
  }
  int err = errno;
  *key = fd >= 0 ? live_key_self : 0;
  pthread_mutex_unlock(&live_lock);
  if (fd < 0)
    gpuipc__fail(GPUIPC_E_NOT_SUPPORTED, "liveness table fd: %s (%s)", why,
                 strerror(err));
  return fd;
}

/* ---- tables that came with connections ------------------------------------------ */

struct gpuipc__live_peer {
  int fd;
  uint64_t key;
  gpuipc__identity id;
};

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

gpuipc_status gpuipc__live_peer_open(int fd, const gpuipc__identity *peer,
                                     uint64_t key, gpuipc__live_peer **out) {
  *out = NULL;
  struct stat st;
  struct statfs fs;
  live_header h;
  const char *why = NULL;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    why = "it is not a regular file";
  else if (fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC)
    why = "it is not on tmpfs or a memfd (reading it could block)";
  else if ((size_t)st.st_size != LIVE_BYTES)
    why = "its size is not a liveness table's";
  else if (pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h ||
           h.magic != LIVE_MAGIC || h.version != LIVE_VERSION ||
           h.slots != GPUIPC__LIVE_SLOTS || h.exports != GPUIPC__LIVE_EXPORTS)
    why = "its header is not a liveness table's";
  else if (key == 0)
    why = "it came without a key";
  if (why != NULL)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: the peer's liveness table fd is refused: "
                        "%s",
                        why);
  gpuipc__live_peer *t = calloc(1, sizeof *t);
  if (t == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "liveness table of a peer");
  t->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (t->fd < 0) {
    gpuipc_status s = gpuipc__fail_errno(errno, "fcntl", "dup of a table fd");
    free(t);
    return s;
  }
  t->key = key;
  t->id = *peer;
  *out = t;
  return GPUIPC_OK;
}

size_t gpuipc__live_table_bytes(void) { return LIVE_BYTES; }

void gpuipc__live_peer_close(gpuipc__live_peer *t) {
  if (t == NULL)
    return;
  close(t->fd);
  free(t);
}

/* A slot of a connection's table, read with pread (the peer may truncate
 * the file: a short read says "cannot tell"). */
static gpuipc__live_state via_state(const gpuipc__live_peer *t, uint64_t g) {
  uint64_t v = 0;
  off_t off = (off_t)(sizeof(live_header) +
                      (g % GPUIPC__LIVE_SLOTS) * sizeof(uint64_t));
  ssize_t n;
  GPUIPC__EINTR_RETRY(n, pread(t->fd, &v, sizeof v, off));
  if (n != (ssize_t)sizeof v)
    return GPUIPC__LIVE_UNKNOWN;
  if (v == g)
    return GPUIPC__LIVE_YES;
  if (v == (g | GPUIPC__LIVE_FREED_BIT))
    return GPUIPC__LIVE_FREED;
  return GPUIPC__LIVE_UNKNOWN;
}

uint64_t gpuipc__live_key(void) {
  pthread_mutex_lock(&live_lock);
  live_map *t = live_self();
  uint64_t k = t != NULL ? live_key_self : 0;
  pthread_mutex_unlock(&live_lock);
  return k;
}

/* ---- export records (this process writes its own) ------------------------------ */

static void record_write(live_export *r, uint32_t kind, uint64_t tag,
                         uint64_t dev, uint64_t ino) {
  uint32_t seq = __atomic_load_n(&r->seq, __ATOMIC_RELAXED);
  __atomic_store_n(&r->seq, seq | 1u, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  __atomic_store_n(&r->kind, kind, __ATOMIC_RELAXED);
  __atomic_store_n(&r->tag, tag, __ATOMIC_RELAXED);
  __atomic_store_n(&r->dev, dev, __ATOMIC_RELAXED);
  __atomic_store_n(&r->ino, ino, __ATOMIC_RELAXED);
  __atomic_store_n(&r->seq, (seq | 1u) + 1u, __ATOMIC_RELEASE);
}

void gpuipc__live_export_add(int fd, unsigned kind, uint64_t tag) {
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0)
    return;
  pthread_mutex_lock(&live_lock);
  live_map *t = live_self();
  if (t != NULL && fd < (int)GPUIPC__LIVE_EXPORTS)
    record_write(&t->exports[fd], kind, tag, (uint64_t)st.st_dev,
                 (uint64_t)st.st_ino);
  else if (t != NULL)
    GPUIPC__INFO("handle",
                 "export fd %d is beyond the liveness table's %u records: "
                 "importers cannot fetch it by pidfd_getfd",
                 fd, GPUIPC__LIVE_EXPORTS);
  pthread_mutex_unlock(&live_lock);
}

void gpuipc__live_export_clear(int fd) {
  pthread_mutex_lock(&live_lock);
  if (self.base != NULL && live_pid == getpid() && fd >= 0 &&
      fd < (int)GPUIPC__LIVE_EXPORTS &&
      __atomic_load_n(&self.exports[fd].kind, __ATOMIC_RELAXED) != 0)
    record_write(&self.exports[fd], 0, 0, 0, 0);
  pthread_mutex_unlock(&live_lock);
}

uint64_t gpuipc__next_generation(void) {
  uint64_t g = atomic_fetch_add(&generations, 1) + 1;
  pthread_mutex_lock(&live_lock);
  live_map *m = live_self();
  if (m != NULL) {
    uint64_t *t = m->slots;
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
  uint64_t *t = self.base != NULL && live_pid == getpid() ? self.slots : NULL;
  if (t != NULL) {
    uint64_t want = g;
    /* Only if the slot is still this generation's. */
    __atomic_compare_exchange_n(&t[g % GPUIPC__LIVE_SLOTS], &want,
                                g | GPUIPC__LIVE_FREED_BIT, false,
                                __ATOMIC_RELEASE, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&live_lock);
}

/* ---- exporters' tables, read here ----------------------------------------------- */

/* Exporters' tables, read here with pread and never mapped: the exporter
 * owns its table and can truncate it, which would turn an importer's next
 * access to a mapping into SIGBUS; a read past the end is only a table
 * this process cannot use. A table is opened for each lookup and closed
 * after it (a few microseconds, on the descriptor path only; the handoff
 * path reads no table): nothing of an exporter is kept here, however many
 * exporters, made-up identities or keys descriptors name, and no fd stays
 * open behind the caller's back. */
typedef struct peer_map {
  int fd;  /* -1: none */
  bool v2; /* has export records */
} peer_map;

static bool peer_logged;

static void peer_close(peer_map *m) {
  if (m->fd >= 0)
    close(m->fd);
  m->fd = -1;
}

/* Reads n bytes at off of a peer's table; false when they are not all
 * there (a table cut short). */
static bool peer_read(const peer_map *m, size_t off, void *out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(m->fd, (char *)out + got, n - got, (off_t)(off + got));
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return false;
    got += (size_t)r;
  }
  return true;
}

/* Slot i of a peer's table, read until two reads agree (a read is not one
 * atomic load: a value being rewritten could come back torn). */
static bool peer_slot(const peer_map *m, uint64_t i, uint64_t *out) {
  size_t off = sizeof(live_header) + (size_t)i * sizeof(uint64_t);
  uint64_t a, b;
  if (!peer_read(m, off, &a, sizeof a))
    return false;
  for (int k = 0; k < 8; k++) {
    if (!peer_read(m, off, &b, sizeof b))
      return false;
    if (a == b) {
      *out = a;
      return true;
    }
    a = b;
  }
  return false;
}

/* The key naming the table of a descriptor's exporter: false when the
 * exporter has none (a descriptor of this library with key 0); 0 for
 * descriptors of older libraries, whose tables have no key in their name. */
static bool desc_table_key(const gpuipc__desc *d, uint64_t *key) {
  if (d->length >= GPUIPC__DESC_LEN) {
    *key = d->live_key;
    return d->live_key != 0;
  }
  *key = 0;
  return true;
}

static bool peer_open(const gpuipc__identity *ex, uint64_t key, peer_map *out) {
  char path[160];
  live_name(path, sizeof path, geteuid(), ex->pidns, ex->pid, ex->start_time,
            key);
  out->fd = -1;
  out->v2 = false;
  /* O_NONBLOCK: the name comes from a descriptor and anyone may create a
   * file in /dev/shm; a FIFO there would make open wait for a writer (with
   * live_lock held: every import of this process with it). */
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (!peer_logged)
      GPUIPC__INFO("handle",
                   "cannot read the liveness table %s of pid %d: %s (another "
                   "uid or /dev/shm, an exporter that exited, or a forged "
                   "descriptor); imports from it proceed unchecked (logged "
                   "once)",
                   path, (int)ex->pid, strerror(errno));
    peer_logged = true;
    return false;
  }
  struct stat st;
  /* Only a table of this very uid, closed to others, is trusted: anyone
   * could create a file with that name. */
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
      (st.st_mode & 0077) == 0 &&
      ((size_t)st.st_size == LIVE_BYTES ||
       (size_t)st.st_size == LIVE_V1_BYTES)) {
    bool v2 = (size_t)st.st_size == LIVE_BYTES;
    peer_map m = {fd, v2};
    live_header h;
    if (peer_read(&m, 0, &h, sizeof h) && h.magic == LIVE_MAGIC &&
        h.slots == GPUIPC__LIVE_SLOTS &&
        (v2 ? h.version == 2 && h.exports == GPUIPC__LIVE_EXPORTS
            : h.version == 1)) {
      *out = m;
      fd = -1;
    }
  }
  if (fd >= 0)
    close(fd);
  if (out->fd < 0)
    GPUIPC__INFO("handle",
                 "liveness table %s of pid %d is not usable (owner, mode, "
                 "size or format): imports from it proceed unchecked",
                 path, (int)ex->pid);
  return out->fd >= 0;
}

/* Opens the table of a descriptor's exporter (live_lock held: the log
 * flag); the caller closes it (peer_close). */
static bool peer_get(const gpuipc__desc *d, peer_map *out) {
  uint64_t key;
  out->fd = -1;
  if (!desc_table_key(d, &key))
    return false;
  return peer_open(&d->exporter, key, out);
}

gpuipc__live_state gpuipc__generation_state(const gpuipc__desc *d,
                                            const gpuipc__via *via) {
  uint64_t g = d->generation;
  if (g == 0 || (g & GPUIPC__LIVE_FREED_BIT))
    return GPUIPC__LIVE_UNKNOWN;
  /* The table the connection carried, when the descriptor is of that
   * connection's peer and names that table. */
  if (via != NULL && via->table != NULL &&
      gpuipc__identity_eq(&d->exporter, &via->table->id) &&
      d->length >= GPUIPC__DESC_LEN && d->live_key == via->table->key)
    return via_state(via->table, g);
  gpuipc__live_state st = GPUIPC__LIVE_UNKNOWN;
  pthread_mutex_lock(&live_lock);
  peer_map m;
  if (peer_get(d, &m)) {
    uint64_t v = 0;
    if (peer_slot(&m, g % GPUIPC__LIVE_SLOTS, &v)) {
      if (v == g)
        st = GPUIPC__LIVE_YES;
      else if (v == (g | GPUIPC__LIVE_FREED_BIT))
        st = GPUIPC__LIVE_FREED;
    }
    peer_close(&m);
  }
  pthread_mutex_unlock(&live_lock);
  return st;
}

/* Reads export record fd of a peer's table; false while it is being
 * written (or when the table is cut short). The record is a seqlock: read
 * whole, and again, it holds when both reads agree and seq is even. */
static bool record_read(const peer_map *m, int fd, live_export *out) {
  size_t off = LIVE_V1_BYTES + (size_t)fd * sizeof(live_export);
  for (int i = 0; i < 64; i++) {
    live_export a, b;
    if (!peer_read(m, off, &a, sizeof a) || !peer_read(m, off, &b, sizeof b))
      return false;
    if ((a.seq & 1u) == 0 && memcmp(&a, &b, sizeof a) == 0) {
      *out = a;
      return true;
    }
  }
  return false;
}

gpuipc_status gpuipc__live_fetch_fd(const gpuipc__desc *d, uint64_t tag,
                                    int *out) {
  int fd = -1;
  if (d->exporter.pidns != gpuipc__pid_namespace())
    return gpuipc__fail(GPUIPC_E_FOREIGN_NAMESPACE,
                        "pidfd_getfd: the exporter (pid %d) is in another pid "
                        "namespace, where its pid means nothing here: its "
                        "fds must come with the descriptor",
                        (int)d->exporter.pid);
  GPUIPC__CHECK(gpuipc__pidfd_getfd(&d->exporter, d->exporter_fd, &fd));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    gpuipc_status s = gpuipc__fail_errno(errno, "fstat", "fetched fd");
    close(fd);
    return s;
  }
  const char *why = NULL;
  live_export r;
  memset(&r, 0, sizeof r);
  pthread_mutex_lock(&live_lock);
  peer_map m;
  if (!peer_get(d, &m))
    why = "it has no liveness table this process can read (it exported "
          "nothing, or the descriptor is forged)";
  else if (!m.v2)
    why = "its liveness table records no exports (an older library)";
  else if (d->exporter_fd < 0 || d->exporter_fd >= (int)GPUIPC__LIVE_EXPORTS)
    why = "the fd number is beyond its table's export records";
  else if (!record_read(&m, d->exporter_fd, &r))
    why = "its record of that fd is being rewritten (or its table was cut "
          "short)";
  peer_close(&m);
  pthread_mutex_unlock(&live_lock);
  if (why == NULL && (r.kind != d->kind || r.tag != tag))
    why = r.kind == 0 ? "it has not exported that fd"
                      : "it exported that fd as another allocation or pool";
  if (why == NULL &&
      (r.dev != (uint64_t)st.st_dev || r.ino != (uint64_t)st.st_ino))
    why = "the file fetched is not the one it exported at that fd number";
  if (why != NULL) {
    close(fd);
    return gpuipc__fail(GPUIPC_E_PERMISSION,
                        "pidfd_getfd: refusing fd %d of pid %d for this %s "
                        "descriptor (export %llu): %s",
                        (int)d->exporter_fd, (int)d->exporter.pid,
                        gpuipc_pool_kind_name((gpuipc_pool_kind)d->kind),
                        (unsigned long long)tag, why);
  }
  *out = fd;
  return GPUIPC_OK;
}
