/*
 * stats.c: owns this process's stats segment, what `gpuipc ls` reads: a
 * file proc-<pid>-<start time>.stats (mode 0600) in the runtime directory,
 * mapped MAP_SHARED and made on first use. Writers only do relaxed atomic
 * stores and adds (no lock, no system call after the first use; the
 * updates of the handoff path are inline in stats.h); the layout is in
 * stats.h. The file is removed at exit; a process that dies
 * leaves it behind, and `gpuipc ls` shows it as gone and removes it. When
 * the segment cannot be made, or GPUIPC_STATS=0, the counters go to a
 * private copy (nobody sees them, nothing fails). A forked child starts a
 * segment of its own on its first update.
 */
#include "core_int.h"
#include "stats.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

_Atomic(gpuipc__stats_seg *) gpuipc__stats_seg_now;

/* Times in the segment: CLOCK_MONOTONIC_COARSE (a few ms of resolution,
 * enough for ages shown in ms, and a plain memory read in the vDSO where
 * the fine clock costs tens of ns on the fast path). */
uint64_t gpuipc__stats_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
static gpuipc__stats_seg seg_private; /* when no file could be made */
static pthread_mutex_t seg_lock = PTHREAD_MUTEX_INITIALIZER;
static char seg_file[300];  /* the file to remove at exit ("": none) */
static pid_t seg_pid;       /* the process that made seg_file */

int gpuipc__stats_path(char *out, size_t cap, const char *dir, int pid,
                       uint64_t start_time) {
  int n = snprintf(out, cap, "%s/proc-%d-%llu.stats", dir, pid,
                   (unsigned long long)start_time);
  return n > 0 && (size_t)n < cap ? 0 : -1;
}

static void read_command(char *out, size_t cap) {
  out[0] = '\0';
  int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return;
  ssize_t n = read(fd, out, cap - 1);
  close(fd);
  if (n <= 0) {
    out[0] = '\0';
    return;
  }
  for (ssize_t i = 0; i < n; i++)
    if (out[i] == '\0')
      out[i] = ' ';
  while (n > 0 && out[n - 1] == ' ')
    n--;
  out[n] = '\0';
}

static void fill_header(gpuipc__stats_seg *s, uint64_t start) {
  s->version = GPUIPC__STATS_VERSION;
  s->size = (uint32_t)sizeof *s;
  s->pid = (int32_t)getpid();
  s->uid = (uint32_t)geteuid();
  s->start_time = start;
  s->pid_ns = gpuipc__pid_namespace();
  s->created_ns = gpuipc__stats_now();
  read_command(s->command, sizeof s->command);
}

GPUIPC__PARAM(stats, "GPUIPC_STATS", GPUIPC__PARAM_ONCE, "1",
              "0: the counters gpuipc ls shows stay in private memory (no file "
              "in the runtime directory)")

static gpuipc__stats_seg *make_segment(void) {
  const char *env = param_stats();
  if (env && strcmp(env, "0") == 0)
    return NULL;
  char dir[200], path[300];
  gpuipc__default_runtime_dir(dir, sizeof dir, NULL, 0, NULL);
  uint64_t start = gpuipc__process_start_time((int)getpid());
  if (gpuipc__private_dir(dir, NULL, 0) != GPUIPC_OK ||
      gpuipc__stats_path(path, sizeof path, dir, (int)getpid(), start) != 0)
    return NULL;
  /* O_EXCL: a file of that name is another process's (pid 1 of a sibling
   * pid namespace started in the same tick has our name): truncating it
   * would kill that process with SIGBUS; we go without one instead. */
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                0600);
  if (fd < 0) {
    GPUIPC__DEBUG("stats", "stats segment %s: %s (counters stay private)",
                  path, strerror(errno));
    return NULL;
  }
  void *p = MAP_FAILED;
  if (ftruncate(fd, (off_t)sizeof(gpuipc__stats_seg)) == 0)
    p = mmap(NULL, sizeof(gpuipc__stats_seg), PROT_READ | PROT_WRITE,
             MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    unlink(path);
    return NULL;
  }
  gpuipc__stats_seg *s = p;
  fill_header(s, start);
  atomic_store_explicit(&s->magic, GPUIPC__STATS_MAGIC, memory_order_release);
  snprintf(seg_file, sizeof seg_file, "%s", path);
  seg_pid = getpid();
  GPUIPC__DEBUG("stats", "stats segment %s", path);
  return s;
}

static void after_fork_child(void) {
  /* The parent's segment stays mapped (and the parent's); the child makes
   * its own on its first update and never removes the parent's file. */
  atomic_store(&gpuipc__stats_seg_now, NULL);
  seg_file[0] = '\0';
}

__attribute__((destructor)) static void remove_segment(void) {
  if (seg_file[0] && seg_pid == getpid())
    unlink(seg_file);
}

gpuipc__stats_seg *gpuipc__stats_make(void) {
  static bool atfork_done;
  pthread_mutex_lock(&seg_lock);
  gpuipc__stats_seg *s = atomic_load(&gpuipc__stats_seg_now);
  if (s == NULL) {
    if (!atfork_done && pthread_atfork(NULL, NULL, after_fork_child) == 0)
      atfork_done = true;
    s = make_segment();
    if (s == NULL) {
      s = &seg_private;
      memset(s, 0, sizeof *s);
      fill_header(s, 0);
    }
    atomic_store_explicit(&gpuipc__stats_seg_now, s, memory_order_release);
  }
  pthread_mutex_unlock(&seg_lock);
  return s;
}

int gpuipc__stats_conn_open(int peer_pid, uint64_t peer_start, int order) {
  gpuipc__stats_seg *s = gpuipc__stats_self();
  for (int i = 0; i < GPUIPC__STATS_CONNS; i++) {
    gpuipc__stats_conn *c = &s->conn[i];
    uint32_t free_ = 0;
    if (atomic_load_explicit(&c->used, memory_order_relaxed) != 0 ||
        !atomic_compare_exchange_strong(&c->used, &free_, 2))
      continue;
    /* 2 while being filled: a reader skips it. */
    atomic_store_explicit(&c->peer_pid, peer_pid, memory_order_relaxed);
    atomic_store_explicit(&c->peer_start, peer_start, memory_order_relaxed);
    atomic_store_explicit(&c->state, 0, memory_order_relaxed);
    atomic_store_explicit(&c->order, (uint32_t)order, memory_order_relaxed);
    atomic_store_explicit(&c->held_by_peer, 0, memory_order_relaxed);
    atomic_store_explicit(&c->held_here, 0, memory_order_relaxed);
    atomic_store_explicit(&c->opened_ns, gpuipc__stats_now(),
                          memory_order_relaxed);
    for (int k = 0; k < GPUIPC__STATS_LEASES; k++)
      atomic_store_explicit(&c->lease_ns[k], 0, memory_order_relaxed);
    atomic_store_explicit(&c->used, 1, memory_order_release);
    gpuipc__stats_add(GPUIPC__ST_CONNS, 1);
    return i + 1;
  }
  atomic_fetch_add_explicit(&s->conn_overflow, 1, memory_order_relaxed);
  gpuipc__stats_add(GPUIPC__ST_CONNS, 1);
  return 0;
}

void gpuipc__stats_conn_close(int slot) {
  gpuipc__stats_conn *c = gpuipc__stats_conn_at(slot);
  gpuipc__stats_add(GPUIPC__ST_CONNS, -1);
  if (c)
    atomic_store_explicit(&c->used, 0, memory_order_release);
  else
    atomic_fetch_sub_explicit(&gpuipc__stats_self()->conn_overflow, 1,
                              memory_order_relaxed);
}

void gpuipc__stats_conn_state(int slot, int state) {
  gpuipc__stats_conn *c = gpuipc__stats_conn_at(slot);
  if (c)
    atomic_store_explicit(&c->state, (uint32_t)state, memory_order_relaxed);
}

void gpuipc__stats_device(int ordinal, const uint8_t uuid[16]) {
  gpuipc__stats_seg *s = gpuipc__stats_self();
  for (int i = 0; i < GPUIPC__STATS_DEVICES; i++) {
    uint32_t free_ = 0;
    if (atomic_load(&s->dev[i].used) == 1 && s->dev[i].ordinal == ordinal)
      return;
    if (atomic_compare_exchange_strong(&s->dev[i].used, &free_, 2)) {
      s->dev[i].ordinal = ordinal;
      memcpy(s->dev[i].uuid, uuid, sizeof s->dev[i].uuid);
      atomic_store_explicit(&s->dev[i].used, 1, memory_order_release);
      return;
    }
  }
}
