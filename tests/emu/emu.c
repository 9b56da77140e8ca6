/*
 * emu.c: libcuda-emu.so, a CUDA driver emulator for machines without a GPU.
 *
 * It implements the part of the CUDA driver API that gpuipc uses, with the
 * real driver's semantics (those measured and listed in the design brief),
 * across real processes: device memory is shared memory (memfd) mapped into
 * the process, so copies and sets act on it directly; handles exported to
 * other processes name the exporter's memfd, which an importer of the same
 * user opens through /proc/<pid>/fd/<n>; streams are worker threads that run
 * their queues asynchronously and in order.
 *
 * Nothing is kept in a shared registry: each memfd starts with a header page
 * that describes the allocation (kind, id, buffer id, size, the creator's
 * address, a "live" flag). A handle names (pid, fd number, inode, id), and an
 * importer validates the inode and the id before using it, so a crashed or
 * exited exporter leaves nothing behind (its memfds die with it) and nothing
 * can be left locked. No file is ever created in /dev/shm.
 *
 * Environment (read once, at the first call):
 *   GPUIPC_EMU_DEVICES=N     number of emulated devices, 1..8 (default 1).
 *   GPUIPC_EMU_MEMORY=SIZE   memory per device, bytes or with K/M/G suffix
 *                            (default 8G). cuMemGetInfo's "free" is this minus
 *                            what *this process* holds on the device.
 *   GPUIPC_EMU_DISABLE=LIST  comma list of capabilities to turn off; their
 *                            device attributes report 0 and the calls fail as
 *                            the real driver does without them:
 *                              vmm         cuMemCreate/Map/... (NOT_SUPPORTED)
 *                              posix_fd    POSIX-fd handle types for VMM and
 *                                          pools (NOT_SUPPORTED)
 *                              mempool     cuMemPool*, cuMemAllocFromPoolAsync
 *                              mempool_ipc pools work, but not with a
 *                                          shareable handle type
 *                              ipc_event   CU_EVENT_INTERPROCESS, event handles
 *                              legacy_ipc  cuIpcGet/Open/CloseMemHandle
 *                              memops      cuStreamWrite/WaitValue32/64
 *                              memops64    only the 64-bit stream memops
 *                              peer        peer access between devices
 *                              host_register cuMemHostRegister
 *                              batch_copy  cuMemcpyBatchAsync (not found)
 *                              kernels     cuModuleLoadData
 *                                          (NO_BINARY_FOR_GPU)
 *   CUDA_VISIBLE_DEVICES     honoured as the real driver does: ordinals or
 *                            UUIDs ("GPU-" and a unique prefix), reordering
 *                            and hiding; an invalid entry ends the list there;
 *                            an empty list means cuInit fails with
 *                            CUDA_ERROR_NO_DEVICE.
 *   GPUIPC_EMU_FAIL=LIST     fault injection, comma list of NAME:N[:ERROR]:
 *                            the Nth call (from 1) of driver function NAME in
 *                            this process fails, or every call with N = '*'.
 *                            NAME is the base name (cuMemAlloc, not
 *                            cuMemAlloc_v2). ERROR is a CUresult name
 *                            (CUDA_ERROR_OUT_OF_MEMORY) or number; the
 *                            default is CUDA_ERROR_UNKNOWN, which no real
 *                            path of the emulator returns, so an injected
 *                            failure is recognizable. Counting is atomic.
 *   GPUIPC_EMU_COPY_DELAY_US=N  every asynchronous copy and set executed by
 *                            a stream worker first sleeps N microseconds, so
 *                            tests of stream ordering catch a missing wait
 *                            (the data would otherwise usually win the race).
 *   GPUIPC_EMU_STREAM_ROOM=N streams a context has room for before its room
 *                            grows (default 32, as measured on the H200;
 *                            0: never wait). Growing the room waits until
 *                            every stream of the context has drained, as
 *                            the real driver's cuStreamCreate does behind a
 *                            stream held by a wait (docs/driver-behaviour.md).
 *   GPUIPC_EMU_COMPUTE_MODE=M  what CU_DEVICE_ATTRIBUTE_COMPUTE_MODE says
 *                            (default, exclusive-process, prohibited;
 *                            contexts are made all the same)
 *   GPUIPC_EMU_FABRIC=MODE   fabric handles (CU_MEM_HANDLE_TYPE_FABRIC):
 *                              (unset, no) the device reports them
 *                                          unsupported; every FABRIC request
 *                                          fails with NOT_SUPPORTED
 *                              no-channel  supported, but this process has
 *                                          no IMEX channel: cuMemCreate,
 *                                          cuMemPoolCreate and the imports
 *                                          with FABRIC fail with
 *                                          NOT_PERMITTED (what an H200
 *                                          without one is expected to say)
 *                              yes         they work: a fabric handle names
 *                                          the exporter's memfd, opened
 *                                          through /proc as legacy handles
 *                                          are (same user, same pid
 *                                          namespace)
 *   GPUIPC_EMU_LOG=1         print every call and its result to stderr.
 *                            Otherwise the emulator prints only when a
 *                            function it does not implement is called.
 */
#include <cuda.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EMU_MAX_DEV 8
#define EMU_PAGE ((size_t)4096)
#define EMU_GRAN ((size_t)2 << 20) /* VMM granularity, as on an H200 */
#define EMU_HDR_MAGIC 0x554d4543u  /* "CEMU" */
#define EMU_WIRE_MAGIC 0x48554d45u /* "EMUH" */

/* ======================================================================== */
/* small utilities                                                           */
/* ======================================================================== */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static void emu_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emu_msg(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = snprintf(buf, sizeof buf, "[cuda-emu %d] ", (int)getpid());
  if (n < 0)
    n = 0;
  vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  va_end(ap);
  size_t len = strlen(buf);
  if (len < sizeof buf - 1) {
    buf[len++] = '\n';
  }
  /* One write so that lines of concurrent processes do not interleave. */
  ssize_t w = write(2, buf, len);
  (void)w;
}

static long futex_op(void *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

/* Waits while *word == val, at most ns nanoseconds. Not FUTEX_PRIVATE: the
 * word may be in memory shared with another process (IPC events, flags). */
static void futex_wait_ns(_Atomic uint32_t *word, uint32_t val, long ns) {
  struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
  futex_op((void *)word, FUTEX_WAIT, val, &ts);
}

static void futex_wake_all(void *word) { futex_op(word, FUTEX_WAKE, INT_MAX, NULL); }

/* Start time of a process (clock ticks since boot), 0 if unknown. */
static uint64_t proc_start_time(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0)
    return 0;
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  if (!p)
    return 0;
  /* Field 3 (state) follows ") "; starttime is field 22. */
  p += 2;
  for (int field = 3; field < 22 && p; field++) {
    p = strchr(p, ' ');
    if (p)
      p++;
  }
  return p ? strtoull(p, NULL, 10) : 0;
}

static uint64_t id_salt(uint64_t start_time) {
  struct stat st;
  uint64_t ns = stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
  return (start_time * 7919u + ns * 2654435761u) & 0xffffffffffull;
}

/* ======================================================================== */
/* global state and configuration                                            */
/* ======================================================================== */

enum {
  DIS_VMM = 1u << 0,
  DIS_IPC_EVENT = 1u << 1,
  DIS_MEMPOOL = 1u << 2,
  DIS_MEMOPS = 1u << 3,
  DIS_PEER = 1u << 4,
  DIS_LEGACY_IPC = 1u << 5,
  DIS_POSIX_FD = 1u << 6,
  DIS_MEMPOOL_IPC = 1u << 7,
  DIS_MEMOPS64 = 1u << 8,
  DIS_HOST_REGISTER = 1u << 9,
  DIS_BATCH_COPY = 1u << 10, /* no cuMemcpyBatchAsync: a driver before 12.8 */
  DIS_KERNELS = 1u << 11,    /* cuModuleLoadData: CUDA_ERROR_NO_BINARY_FOR_GPU */
};

/* GPUIPC_EMU_FABRIC */
enum { FABRIC_OFF, FABRIC_NO_CHANNEL, FABRIC_ON };

typedef struct emu_stream emu_stream;

typedef struct emu_ctx {
  uint32_t magic;
  int ordinal;         /* visible ordinal */
  int phys;            /* physical device index */
  atomic_int retained; /* primary context reference count */
  pthread_mutex_t mu;  /* streams list */
  emu_stream *streams; /* every live stream of the context */
  emu_stream *legacy;  /* the legacy NULL stream, created on first use */
  unsigned peer_enabled;
  /* The driver's stream resources (see stream_room): streams alive and the
   * most the context has room for; growing the room waits for the device. */
  int nlive, room;
  pthread_mutex_t grow_mu; /* one growth at a time */
} emu_ctx;
#define CTX_MAGIC 0x43545845u

typedef struct fault {
  char name[64];
  long nth; /* 0: every call */
  CUresult err;
  atomic_long count;
} fault;

static struct {
  pthread_once_t once;
  int phys_count;
  int count;
  int vis[EMU_MAX_DEV];  /* visible ordinal -> physical index */
  int ord[EMU_MAX_DEV];  /* physical index -> visible ordinal or -1 */
  bool no_devices;       /* CUDA_VISIBLE_DEVICES hid them all */
  unsigned disable;
  int fabric; /* FABRIC_OFF, FABRIC_NO_CHANNEL, FABRIC_ON */
  int compute_mode; /* GPUIPC_EMU_COMPUTE_MODE: what the attribute says */
  size_t total_mem;
  unsigned copy_delay_us;
  int stream_room;
  int log;
  fault faults[32];
  int nfaults;
  pid_t pid;
  uint64_t start_time;
  uint64_t id_salt;
  atomic_int inited;
  atomic_int forked;
  emu_ctx ctx[EMU_MAX_DEV];
  _Atomic int64_t used[EMU_MAX_DEV]; /* bytes this process holds */
  pthread_mutex_t mu;                /* allocation tables */
} E = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};

static const char *err_name(CUresult r) {
  switch ((int)r) {
#define EMU_ERR(n)                                                             \
  case n:                                                                      \
    return #n;
#include "emu_errors.h"
#undef EMU_ERR
  default:
    return NULL;
  }
}

static bool parse_err(const char *s, CUresult *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*s && *end == 0) {
    *out = (CUresult)v;
    return true;
  }
#define EMU_ERR(n)                                                             \
  if (strcmp(s, #n) == 0) {                                                    \
    *out = n;                                                                  \
    return true;                                                               \
  }
#include "emu_errors.h"
#undef EMU_ERR
  return false;
}

/* "cuMemAlloc_v2" and "cuMemAlloc" name the same function for injection. */
static size_t base_len(const char *name) {
  size_t n = strlen(name);
  const char *v = strstr(name, "_v");
  if (v && v[2] >= '0' && v[2] <= '9')
    n = (size_t)(v - name);
  return n;
}

static void parse_faults(const char *spec) {
  char buf[2048];
  snprintf(buf, sizeof buf, "%s", spec);
  char *save = NULL;
  for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    while (*tok == ' ')
      tok++;
    if (!*tok || E.nfaults >= (int)(sizeof E.faults / sizeof E.faults[0]))
      continue;
    fault *f = &E.faults[E.nfaults];
    char *c1 = strchr(tok, ':');
    if (!c1) {
      emu_msg("GPUIPC_EMU_FAIL: ignoring '%s' (want NAME:N[:ERROR])", tok);
      continue;
    }
    *c1 = 0;
    char *c2 = strchr(c1 + 1, ':');
    if (c2)
      *c2 = 0;
    size_t bl = base_len(tok);
    if (bl >= sizeof f->name)
      continue;
    memcpy(f->name, tok, bl);
    f->name[bl] = 0;
    if (strcmp(c1 + 1, "*") == 0) {
      f->nth = 0;
    } else {
      char *end;
      f->nth = strtol(c1 + 1, &end, 10);
      if (*end || f->nth <= 0) {
        emu_msg("GPUIPC_EMU_FAIL: ignoring '%s': bad count '%s'", tok, c1 + 1);
        continue;
      }
    }
    f->err = CUDA_ERROR_UNKNOWN;
    if (c2 && !parse_err(c2 + 1, &f->err)) {
      emu_msg("GPUIPC_EMU_FAIL: ignoring '%s': unknown error '%s'", tok, c2 + 1);
      continue;
    }
    atomic_init(&f->count, 0);
    E.nfaults++;
  }
}

static size_t parse_size(const char *s, size_t dflt) {
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (end == s)
    return dflt;
  switch (*end) {
  case 'k': case 'K': v <<= 10; break;
  case 'm': case 'M': v <<= 20; break;
  case 'g': case 'G': v <<= 30; break;
  case 't': case 'T': v <<= 40; break;
  default: break;
  }
  return v ? (size_t)v : dflt;
}

static void uuid_of(int phys, unsigned char out[16]) {
  /* Stable per physical index, shaped like a version-4 UUID. */
  static const unsigned char base[16] = {0x5e, 0x3a, 0x91, 0x00, 0xc2, 0x7d,
                                         0x4b, 0x1e, 0x8f, 0x26, 0x0d, 0x55,
                                         0xa7, 0x30, 0x6b, 0x00};
  memcpy(out, base, 16);
  out[3] = (unsigned char)(0x10 + phys);
  out[15] = (unsigned char)(0xe0 + phys);
}

static void uuid_str(int phys, char out[64]) {
  unsigned char u[16];
  uuid_of(phys, u);
  snprintf(out, 64,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10],
           u[11], u[12], u[13], u[14], u[15]);
}

/* CUDA_VISIBLE_DEVICES as the real driver reads it: entries are ordinals or
 * GPU UUIDs (a unique prefix is enough); the first invalid entry (unknown,
 * ambiguous, duplicate) ends the list. */
static void parse_visible(const char *spec) {
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", spec);
  E.count = 0;
  char *save = NULL;
  if (strchr(buf, ',') == NULL && buf[0] == 0) {
    E.no_devices = true;
    return;
  }
  for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    while (*tok == ' ' || *tok == '\t')
      tok++;
    size_t l = strlen(tok);
    while (l && (tok[l - 1] == ' ' || tok[l - 1] == '\t'))
      tok[--l] = 0;
    int phys = -1;
    if (l > 0 && tok[0] >= '0' && tok[0] <= '9') {
      char *end;
      long v = strtol(tok, &end, 10);
      if (*end == 0 && v >= 0 && v < E.phys_count)
        phys = (int)v;
    } else if (strncmp(tok, "GPU-", 4) == 0 && l > 4) {
      for (int i = 0; i < E.phys_count; i++) {
        char u[64];
        uuid_str(i, u);
        if (strncasecmp(u, tok, l) == 0) {
          if (phys >= 0) { /* ambiguous prefix */
            phys = -2;
            break;
          }
          phys = i;
        }
      }
    }
    if (phys < 0)
      break;
    bool dup = false;
    for (int i = 0; i < E.count; i++)
      dup |= E.vis[i] == phys;
    if (dup)
      break;
    E.vis[E.count++] = phys;
  }
  if (E.count == 0)
    E.no_devices = true;
}

static void atfork_child(void) {
  if (atomic_load(&E.inited))
    atomic_store(&E.forked, 1);
}

static void configure(void) {
  const char *s;
  E.pid = getpid();
  E.start_time = proc_start_time(E.pid);
  E.id_salt = id_salt(E.start_time);
  s = getenv("GPUIPC_EMU_LOG");
  E.log = s && *s && strcmp(s, "0") != 0;
  s = getenv("GPUIPC_EMU_DEVICES");
  E.phys_count = s && *s ? atoi(s) : 1;
  if (E.phys_count < 1)
    E.phys_count = 1;
  if (E.phys_count > EMU_MAX_DEV)
    E.phys_count = EMU_MAX_DEV;
  s = getenv("GPUIPC_EMU_MEMORY");
  E.total_mem = s && *s ? parse_size(s, (size_t)8 << 30) : (size_t)8 << 30;
  E.total_mem = round_up(E.total_mem, EMU_GRAN);
  s = getenv("GPUIPC_EMU_COPY_DELAY_US");
  E.copy_delay_us = s && *s ? (unsigned)strtoul(s, NULL, 10) : 0;
  s = getenv("GPUIPC_EMU_STREAM_ROOM");
  E.stream_room = s && *s ? atoi(s) : 32;
  s = getenv("GPUIPC_EMU_DISABLE");
  if (s && *s) {
    static const struct { const char *n; unsigned bit; } caps[] = {
        {"vmm", DIS_VMM},           {"ipc_event", DIS_IPC_EVENT},
        {"mempool", DIS_MEMPOOL},   {"memops", DIS_MEMOPS},
        {"peer", DIS_PEER},         {"legacy_ipc", DIS_LEGACY_IPC},
        {"posix_fd", DIS_POSIX_FD}, {"mempool_ipc", DIS_MEMPOOL_IPC},
        {"memops64", DIS_MEMOPS64}, {"host_register", DIS_HOST_REGISTER},
        {"batch_copy", DIS_BATCH_COPY}, {"kernels", DIS_KERNELS},
    };
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *t = strtok_r(buf, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
      bool found = false;
      for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++)
        if (strcmp(t, caps[i].n) == 0) {
          E.disable |= caps[i].bit;
          found = true;
        }
      if (!found)
        emu_msg("GPUIPC_EMU_DISABLE: unknown capability '%s'", t);
    }
  }
  if (E.disable & DIS_MEMOPS)
    E.disable |= DIS_MEMOPS64;
  s = getenv("GPUIPC_EMU_FABRIC");
  if (s && *s && strcmp(s, "no") != 0 && strcmp(s, "0") != 0) {
    if (strcmp(s, "no-channel") == 0)
      E.fabric = FABRIC_NO_CHANNEL;
    else if (strcmp(s, "yes") == 0 || strcmp(s, "1") == 0)
      E.fabric = FABRIC_ON;
    else
      emu_msg("GPUIPC_EMU_FABRIC: unknown mode '%s' (no, no-channel, yes)", s);
  }
  s = getenv("GPUIPC_EMU_COMPUTE_MODE");
  if (s && *s) {
    if (strcmp(s, "exclusive-process") == 0)
      E.compute_mode = CU_COMPUTEMODE_EXCLUSIVE_PROCESS;
    else if (strcmp(s, "prohibited") == 0)
      E.compute_mode = CU_COMPUTEMODE_PROHIBITED;
    else if (strcmp(s, "default") != 0)
      emu_msg("GPUIPC_EMU_COMPUTE_MODE: unknown mode '%s' (default, "
              "exclusive-process, prohibited)", s);
  }
  s = getenv("GPUIPC_EMU_FAIL");
  if (s && *s)
    parse_faults(s);
  s = getenv("CUDA_VISIBLE_DEVICES");
  if (s) {
    parse_visible(s);
  } else {
    E.count = E.phys_count;
    for (int i = 0; i < E.count; i++)
      E.vis[i] = i;
  }
  for (int i = 0; i < EMU_MAX_DEV; i++)
    E.ord[i] = -1;
  for (int i = 0; i < E.count; i++) {
    E.ord[E.vis[i]] = i;
    emu_ctx *c = &E.ctx[i];
    c->magic = CTX_MAGIC;
    c->ordinal = i;
    c->phys = E.vis[i];
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->grow_mu, NULL);
    c->room = E.stream_room;
  }
  pthread_atfork(NULL, NULL, atfork_child);
}

static void config(void) { pthread_once(&E.once, configure); }

/* Unique across the processes alive at one time (pid bits) and across pid
 * reuse (salted with the process start time and the pid namespace: pid 1 of
 * two containers started in one clock tick are two processes): buffer ids,
 * allocation ids. */
static uint64_t next_id(void) {
  static _Atomic uint64_t ctr;
  uint64_t n = atomic_fetch_add(&ctr, 1) + 1;
  return ((uint64_t)(E.pid & 0x3fffff) << 40) | ((E.id_salt + n) & 0xffffffffffull);
}

/* ---- call entry: logging, fault injection, init checks ------------------- */

static CUresult fault_check(const char *name) {
  for (int i = 0; i < E.nfaults; i++) {
    fault *f = &E.faults[i];
    if (strcmp(f->name, name) != 0)
      continue;
    long n = atomic_fetch_add(&f->count, 1) + 1;
    if (f->nth == 0 || f->nth == n) {
      if (E.log)
        emu_msg("%s: injected failure %s (call %ld)", name,
                err_name(f->err) ? err_name(f->err) : "?", n);
      return f->err;
    }
  }
  return CUDA_SUCCESS;
}

static CUresult emu_ret(const char *name, CUresult r) {
  if (E.log) {
    const char *n = err_name(r);
    emu_msg("%s -> %s", name, n ? n : "?");
  }
  return r;
}

/* Every entry point starts with ENTER (no init needed) or ENTER_INIT
 * (cuInit must have succeeded) and returns through RET. */
#define ENTER(name)                                                            \
  static const char emu__fn[] = name;                                          \
  config();                                                                    \
  do {                                                                         \
    if (E.nfaults) {                                                           \
      CUresult emu__f = fault_check(emu__fn);                                  \
      if (emu__f != CUDA_SUCCESS)                                              \
        return emu__f;                                                         \
    }                                                                          \
  } while (0)
#define RET(r) return emu_ret(emu__fn, (r))
#define ENTER_INIT(name)                                                       \
  ENTER(name);                                                                 \
  do {                                                                         \
    if (atomic_load_explicit(&E.forked, memory_order_relaxed))                 \
      RET(CUDA_ERROR_NOT_INITIALIZED);                                    \
    if (!atomic_load_explicit(&E.inited, memory_order_acquire))                \
      RET(CUDA_ERROR_NOT_INITIALIZED);                                         \
  } while (0)

static bool disabled(unsigned bit) { return (E.disable & bit) != 0; }

/* Fabric handles are a kind of VMM and pool handle: they exist only where
 * VMM (for cuMemCreate) and pools with handles (for cuMemPoolCreate) do. */
static bool fabric_supported(void) { return E.fabric != FABRIC_OFF && !disabled(DIS_VMM); }
static bool fabric_pools(void) {
  return E.fabric != FABRIC_OFF && !disabled(DIS_MEMPOOL) && !disabled(DIS_MEMPOOL_IPC);
}

/* The answer to a request for a fabric handle that is refused: the device
 * does not support them at all, or this process has no IMEX channel (cuda.h:
 * "the importer process has not been granted access to the same IMEX
 * channel ... CUDA_ERROR_NOT_PERMITTED"; the same is expected of
 * cuMemCreate and cuMemPoolCreate, not yet seen on a real driver).
 * CUDA_SUCCESS: fabric handles work. */
static CUresult fabric_refusal(bool supported) {
  if (!supported)
    return CUDA_ERROR_NOT_SUPPORTED;
  return E.fabric == FABRIC_NO_CHANNEL ? CUDA_ERROR_NOT_PERMITTED : CUDA_SUCCESS;
}

/* ======================================================================== */
/* initialization, errors, version                                           */
/* ======================================================================== */

CUresult cuInit(unsigned int flags) {
  ENTER("cuInit");
  if (atomic_load(&E.forked))
    RET(CUDA_ERROR_NOT_INITIALIZED);
  if (flags != 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (E.no_devices || E.count == 0)
    RET(CUDA_ERROR_NO_DEVICE);
  if (!atomic_load(&E.inited)) {
    /* A child forked before cuInit (after the library was configured) must
     * not reuse its parent's identity in handles and ids. */
    if (getpid() != E.pid) {
      E.pid = getpid();
      E.start_time = proc_start_time(E.pid);
      E.id_salt = id_salt(E.start_time);
    }
    atomic_store_explicit(&E.inited, 1, memory_order_release);
  }
  RET(CUDA_SUCCESS);
}

CUresult cuDriverGetVersion(int *version) {
  ENTER("cuDriverGetVersion");
  if (!version)
    RET(CUDA_ERROR_INVALID_VALUE);
  *version = CUDA_VERSION;
  RET(CUDA_SUCCESS);
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
  ENTER("cuGetErrorName");
  if (!pStr)
    RET(CUDA_ERROR_INVALID_VALUE);
  const char *n = err_name(error);
  *pStr = n;
  RET(n ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
  ENTER("cuGetErrorString");
  if (!pStr)
    RET(CUDA_ERROR_INVALID_VALUE);
  static const struct { CUresult r; const char *s; } known[] = {
      {CUDA_SUCCESS, "no error"},
      {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
      {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
      {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
      {CUDA_ERROR_DEINITIALIZED, "driver shutting down"},
      {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
      {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
      {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
      {CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"},
      {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
      {CUDA_ERROR_NOT_FOUND, "named symbol not found"},
      {CUDA_ERROR_NOT_READY, "device not ready"},
      {CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"},
      {CUDA_ERROR_NOT_SUPPORTED, "operation not supported"},
      {CUDA_ERROR_NOT_PERMITTED, "operation not permitted"},
      {CUDA_ERROR_UNKNOWN, "unknown error"},
      {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
      {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"},
      {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"},
      {CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"},
      {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped"},
      {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region"},
      {CUDA_ERROR_ALREADY_MAPPED, "resource already mapped"},
      {CUDA_ERROR_INVALID_PC, "invalid program counter"},
      {CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"},
  };
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    if (known[i].r == error) {
      *pStr = known[i].s;
      RET(CUDA_SUCCESS);
    }
  /* Other codes: a lower-case rendering of the name, stored once per code. */
  const char *n = err_name(error);
  if (!n) {
    *pStr = NULL;
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  static char strings[64][96];
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  static int codes[64], nstrings;
  pthread_mutex_lock(&mu);
  const char *out = "unknown error";
  int i;
  for (i = 0; i < nstrings; i++)
    if (codes[i] == (int)error)
      break;
  if (i < nstrings) {
    out = strings[i];
  } else if (nstrings < 64) {
    const char *p = strncmp(n, "CUDA_ERROR_", 11) == 0 ? n + 11 : n;
    size_t j = 0;
    for (; p[j] && j < sizeof strings[0] - 1; j++)
      strings[nstrings][j] = p[j] == '_' ? ' ' : (char)(p[j] >= 'A' && p[j] <= 'Z' ? p[j] + 32 : p[j]);
    strings[nstrings][j] = 0;
    codes[nstrings] = (int)error;
    out = strings[nstrings++];
  }
  pthread_mutex_unlock(&mu);
  *pStr = out;
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* devices                                                                   */
/* ======================================================================== */

static bool dev_ok(CUdevice d) { return d >= 0 && d < E.count; }

CUresult cuDeviceGetCount(int *count) {
  ENTER_INIT("cuDeviceGetCount");
  if (!count)
    RET(CUDA_ERROR_INVALID_VALUE);
  *count = E.count;
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  ENTER_INIT("cuDeviceGet");
  if (!device)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(ordinal))
    RET(CUDA_ERROR_INVALID_DEVICE);
  *device = ordinal;
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
  ENTER_INIT("cuDeviceGetName");
  if (!name || len <= 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  snprintf(name, (size_t)len, "%s", "Emulated NVIDIA H200");
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
  ENTER_INIT("cuDeviceGetUuid");
  if (!uuid)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  uuid_of(E.vis[dev], (unsigned char *)uuid->bytes);
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceTotalMem(size_t *bytes, CUdevice dev) {
  ENTER_INIT("cuDeviceTotalMem");
  if (!bytes)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  *bytes = E.total_mem;
  RET(CUDA_SUCCESS);
}

/* PCI bus numbers without hex letters, so case never matters. */
static int pci_bus(int phys) { return 0x19 + 0x10 * phys; }

CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  ENTER_INIT("cuDeviceGetPCIBusId");
  if (!pciBusId || len <= 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", pci_bus(E.vis[dev]));
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
  ENTER_INIT("cuDeviceGetByPCIBusId");
  if (!dev || !pciBusId)
    RET(CUDA_ERROR_INVALID_VALUE);
  unsigned domain = 0, bus = 0, device = 0, fn = 0;
  if (sscanf(pciBusId, "%x:%x:%x.%x", &domain, &bus, &device, &fn) != 4) {
    domain = 0;
    if (sscanf(pciBusId, "%x:%x.%x", &bus, &device, &fn) != 3)
      RET(CUDA_ERROR_INVALID_VALUE);
  }
  for (int i = 0; i < E.count; i++)
    if (domain == 0 && device == 0 && fn == 0 && (int)bus == pci_bus(E.vis[i])) {
      *dev = i;
      RET(CUDA_SUCCESS);
    }
  RET(CUDA_ERROR_INVALID_DEVICE);
}

static int attr_value(int a, int dev) {
  int phys = E.vis[dev];
  switch (a) {
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
  case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
  case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
  case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return 49152;
  case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 65536;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
  case CU_DEVICE_ATTRIBUTE_MAX_PITCH: return 2147483647;
  case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
  case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return 1980000;
  case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: return 512;
  case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: return 1;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
  case CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT: return 0;
  case CU_DEVICE_ATTRIBUTE_INTEGRATED: return 0;
  case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: return 1;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: return E.compute_mode;
  case CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT: return 512;
  case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: return 1;
  case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: return 1;
  case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: return pci_bus(phys);
  case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: return 0;
  case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: return 0;
  case CU_DEVICE_ATTRIBUTE_TCC_DRIVER: return 0;
  case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return 3201000;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return 6144;
  case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 52428800;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 2048;
  case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 3;
  case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
  case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: return 32;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
  case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 233472;
  case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: return 65536;
  case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: return 1;
  case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD: return 0;
  case CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD_GROUP_ID: return phys;
  case CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO: return 2;
  case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS: return 0;
  case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: return 1;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: return 1;
  case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1: return 0; /* v1 API removed */
  case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1: return 0;
  case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1: return 0;
  case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: return 1;
  case CU_DEVICE_ATTRIBUTE_COOPERATIVE_MULTI_DEVICE_LAUNCH: return 0;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return 232448;
  case CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: return 0;
  case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: return !disabled(DIS_HOST_REGISTER);
  case CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES: return 0;
  case CU_DEVICE_ATTRIBUTE_DIRECT_MANAGED_MEM_ACCESS_FROM_HOST: return 0;
  case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: return !disabled(DIS_VMM);
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    return !disabled(DIS_VMM) && !disabled(DIS_POSIX_FD);
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_HANDLE_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_KMT_HANDLE_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: return 32;
  case CU_DEVICE_ATTRIBUTE_GENERIC_COMPRESSION_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE: return 82575360;
  case CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE: return 134213632;
  case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: return 1024;
  case CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_TIMELINE_SEMAPHORE_INTEROP_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: return !disabled(DIS_MEMPOOL);
  case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS: return 0;
  case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: return 0;
  case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES:
    return (disabled(DIS_MEMPOOL) || disabled(DIS_MEMPOOL_IPC) || disabled(DIS_POSIX_FD)
                ? 0
                : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) |
           (fabric_pools() ? CU_MEM_HANDLE_TYPE_FABRIC : 0);
  case CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH: return 1;
  case CU_DEVICE_ATTRIBUTE_DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS: return !disabled(DIS_MEMOPS64);
  case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR: return !disabled(DIS_MEMOPS);
  case CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED: return !disabled(DIS_IPC_EVENT);
  case CU_DEVICE_ATTRIBUTE_MEM_SYNC_DOMAIN_COUNT: return 4;
  case CU_DEVICE_ATTRIBUTE_TENSOR_MAP_ACCESS_SUPPORTED: return 1;
  case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: return fabric_supported();
  case CU_DEVICE_ATTRIBUTE_UNIFIED_FUNCTION_POINTERS: return 1;
  case CU_DEVICE_ATTRIBUTE_NUMA_CONFIG: return 0;
  case CU_DEVICE_ATTRIBUTE_NUMA_ID: return -1;
  case CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED: return 0;
  case CU_DEVICE_ATTRIBUTE_MPS_ENABLED: return 0;
  case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: return 0;
  case CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID: return 0x233510de;
  case CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID: return 0x18c210de;
  default: return 0;
  }
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  ENTER_INIT("cuDeviceGetAttribute");
  if (!pi)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  if ((int)attrib <= 0 || (int)attrib >= (int)CU_DEVICE_ATTRIBUTE_MAX)
    RET(CUDA_ERROR_INVALID_VALUE);
  *pi = attr_value((int)attrib, dev);
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
  ENTER_INIT("cuDeviceCanAccessPeer");
  if (!canAccessPeer)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev) || !dev_ok(peerDev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  *canAccessPeer = dev != peerDev && !disabled(DIS_PEER);
  RET(CUDA_SUCCESS);
}

CUresult cuDeviceGetP2PAttribute(int *value, CUdevice_P2PAttribute attrib,
                                 CUdevice srcDevice, CUdevice dstDevice) {
  ENTER_INIT("cuDeviceGetP2PAttribute");
  if (!value)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(srcDevice) || !dev_ok(dstDevice) || srcDevice == dstDevice)
    RET(CUDA_ERROR_INVALID_DEVICE);
  bool p = !disabled(DIS_PEER);
  switch (attrib) {
  case CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK: *value = 0; break;
  case CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED: *value = p; break;
  case CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED: *value = p; break;
  case CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED: *value = p; break;
  default: RET(CUDA_ERROR_INVALID_VALUE);
  }
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* contexts                                                                  */
/* ======================================================================== */

/* Only primary contexts exist; CUcontext is a pointer into E.ctx. */
#define CTX_STACK_MAX 64
static __thread emu_ctx *tls_stack[CTX_STACK_MAX];
static __thread int tls_depth;

static emu_ctx *ctx_from(CUcontext c) {
  emu_ctx *x = (emu_ctx *)c;
  for (int i = 0; i < E.count; i++)
    if (x == &E.ctx[i])
      return x;
  return NULL;
}

/* The current context, or the error the real driver gives without one. */
static CUresult cur_ctx(emu_ctx **out) {
  emu_ctx *c = tls_depth ? tls_stack[tls_depth - 1] : NULL;
  if (!c)
    return CUDA_ERROR_INVALID_CONTEXT;
  if (atomic_load(&c->retained) <= 0)
    return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  *out = c;
  return CUDA_SUCCESS;
}

#define NEED_CTX(var)                                                          \
  emu_ctx *var = NULL;                                                         \
  do {                                                                         \
    CUresult emu__c = cur_ctx(&var);                                           \
    if (emu__c != CUDA_SUCCESS)                                                \
      RET(emu__c);                                                             \
  } while (0)

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  ENTER_INIT("cuDevicePrimaryCtxRetain");
  if (!pctx)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  atomic_fetch_add(&E.ctx[dev].retained, 1);
  *pctx = (CUcontext)&E.ctx[dev];
  RET(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  ENTER_INIT("cuDevicePrimaryCtxRelease");
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  int v = atomic_load(&E.ctx[dev].retained);
  do {
    if (v <= 0)
      RET(CUDA_ERROR_INVALID_CONTEXT);
  } while (!atomic_compare_exchange_weak(&E.ctx[dev].retained, &v, v - 1));
  RET(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
  ENTER_INIT("cuDevicePrimaryCtxGetState");
  if (!flags || !active)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  *flags = 0;
  *active = atomic_load(&E.ctx[dev].retained) > 0;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
  ENTER_INIT("cuCtxGetCurrent");
  if (!pctx)
    RET(CUDA_ERROR_INVALID_VALUE);
  *pctx = tls_depth ? (CUcontext)tls_stack[tls_depth - 1] : NULL;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  ENTER_INIT("cuCtxSetCurrent");
  emu_ctx *c = NULL;
  if (ctx && !(c = ctx_from(ctx)))
    RET(CUDA_ERROR_INVALID_CONTEXT);
  if (!c) { /* NULL pops the top, if any */
    if (tls_depth)
      tls_depth--;
    RET(CUDA_SUCCESS);
  }
  if (tls_depth == 0)
    tls_depth = 1;
  tls_stack[tls_depth - 1] = c;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
  ENTER_INIT("cuCtxPushCurrent");
  emu_ctx *c = ctx_from(ctx);
  if (!c)
    RET(CUDA_ERROR_INVALID_CONTEXT);
  if (tls_depth >= CTX_STACK_MAX)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  tls_stack[tls_depth++] = c;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxPopCurrent(CUcontext *pctx) {
  ENTER_INIT("cuCtxPopCurrent");
  if (tls_depth == 0)
    RET(CUDA_ERROR_INVALID_CONTEXT);
  emu_ctx *c = tls_stack[--tls_depth];
  if (pctx)
    *pctx = (CUcontext)c;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxGetDevice(CUdevice *device) {
  ENTER_INIT("cuCtxGetDevice");
  if (!device)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  *device = c->ordinal;
  RET(CUDA_SUCCESS);
}

/* The CUDA 13.0 variant: the context is an argument (NULL: the current). */
CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) {
  ENTER_INIT("cuCtxGetDevice");
  if (!device)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_ctx *c = NULL;
  if (ctx) {
    c = ctx_from(ctx);
    if (!c)
      RET(CUDA_ERROR_INVALID_CONTEXT);
  } else {
    CUresult r = cur_ctx(&c);
    if (r != CUDA_SUCCESS)
      RET(r);
  }
  *device = c->ordinal;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxGetFlags(unsigned int *flags) {
  ENTER_INIT("cuCtxGetFlags");
  if (!flags)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  (void)c;
  *flags = 0;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
  ENTER_INIT("cuCtxGetApiVersion");
  if (!version)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (ctx && !ctx_from(ctx))
    RET(CUDA_ERROR_INVALID_CONTEXT);
  if (!ctx) {
    NEED_CTX(c);
    (void)c;
  }
  *version = 3020;
  RET(CUDA_SUCCESS);
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
  ENTER_INIT("cuDevicePrimaryCtxSetFlags");
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  if (flags & ~(unsigned)(CU_CTX_SCHED_MASK | CU_CTX_LMEM_RESIZE_TO_MAX | CU_CTX_MAP_HOST))
    RET(CUDA_ERROR_INVALID_VALUE);
  RET(CUDA_SUCCESS); /* flags are accepted and have no effect here */
}

CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags) {
  ENTER_INIT("cuCtxEnablePeerAccess");
  if (Flags != 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  emu_ctx *p = ctx_from(peerContext);
  if (!p || atomic_load(&p->retained) <= 0)
    RET(CUDA_ERROR_INVALID_CONTEXT);
  if (p == c || disabled(DIS_PEER))
    RET(p == c ? CUDA_ERROR_INVALID_DEVICE : CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
  pthread_mutex_lock(&c->mu);
  bool already = (c->peer_enabled >> p->ordinal) & 1;
  c->peer_enabled |= 1u << p->ordinal;
  pthread_mutex_unlock(&c->mu);
  RET(already ? CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED : CUDA_SUCCESS);
}

CUresult cuCtxDisablePeerAccess(CUcontext peerContext) {
  ENTER_INIT("cuCtxDisablePeerAccess");
  NEED_CTX(c);
  emu_ctx *p = ctx_from(peerContext);
  if (!p)
    RET(CUDA_ERROR_INVALID_CONTEXT);
  pthread_mutex_lock(&c->mu);
  bool was = (c->peer_enabled >> p->ordinal) & 1;
  c->peer_enabled &= ~(1u << p->ordinal);
  pthread_mutex_unlock(&c->mu);
  RET(was ? CUDA_SUCCESS : CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
}

/* Page 0 of every memfd the emulator creates: what an importer needs to
 * validate a handle and to describe the mapping. Data starts at page 1. */
enum { HK_DEV = 1, HK_POOL, HK_VMM, HK_EVENT };
typedef struct shm_hdr {
  uint32_t magic, kind;
  int32_t owner_pid;
  uint32_t phys;         /* physical device index */
  uint64_t size;         /* bytes of data */
  uint64_t id;           /* allocation / pool / event id: the generation */
  uint64_t buffer_id;    /* CU_POINTER_ATTRIBUTE_BUFFER_ID */
  uint64_t owner_addr;   /* where the creator mapped the data */
  uint64_t handle_types; /* requested shareable handle types */
  uint32_t live;         /* cleared when the creator frees it */
  uint32_t pad;
  uint64_t user_size;    /* the size the creator asked for */
} shm_hdr;

/* Live stream and event handles. A handle is checked against its set
 * before it is dereferenced, so a destroyed or made-up handle gives
 * CUDA_ERROR_INVALID_HANDLE instead of a crash. Sorted arrays: few handles. */
typedef struct handle_set {
  pthread_mutex_t mu;
  uintptr_t *v;
  size_t n, cap;
} handle_set;
static handle_set live_streams = {.mu = PTHREAD_MUTEX_INITIALIZER};
static handle_set live_events = {.mu = PTHREAD_MUTEX_INITIALIZER};
static handle_set live_modules = {.mu = PTHREAD_MUTEX_INITIALIZER};
static handle_set live_functions = {.mu = PTHREAD_MUTEX_INITIALIZER};

static size_t hs_lower(const handle_set *h, uintptr_t x) {
  size_t lo = 0, hi = h->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (h->v[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static bool hs_add(handle_set *h, const void *p) {
  uintptr_t x = (uintptr_t)p;
  pthread_mutex_lock(&h->mu);
  if (h->n == h->cap) {
    size_t cap = h->cap ? h->cap * 2 : 64;
    uintptr_t *v = realloc(h->v, cap * sizeof *v);
    if (!v) {
      pthread_mutex_unlock(&h->mu);
      return false;
    }
    h->v = v;
    h->cap = cap;
  }
  size_t i = hs_lower(h, x);
  memmove(&h->v[i + 1], &h->v[i], (h->n - i) * sizeof *h->v);
  h->v[i] = x;
  h->n++;
  pthread_mutex_unlock(&h->mu);
  return true;
}

static bool hs_has(handle_set *h, const void *p) {
  uintptr_t x = (uintptr_t)p;
  pthread_mutex_lock(&h->mu);
  size_t i = hs_lower(h, x);
  bool found = i < h->n && h->v[i] == x;
  pthread_mutex_unlock(&h->mu);
  return found;
}

static bool hs_del(handle_set *h, const void *p) {
  uintptr_t x = (uintptr_t)p;
  pthread_mutex_lock(&h->mu);
  size_t i = hs_lower(h, x);
  bool found = i < h->n && h->v[i] == x;
  if (found) {
    memmove(&h->v[i], &h->v[i + 1], (h->n - i - 1) * sizeof *h->v);
    h->n--;
  }
  pthread_mutex_unlock(&h->mu);
  return found;
}

/* ======================================================================== */
/* the registry of mapped ranges (this process)                              */
/* ======================================================================== */

/* Every address range the driver would know in this process: device
 * allocations, imports, pool blocks, VMM mappings, pinned host memory. It
 * answers cuPointerGetAttribute(s) and cuMemGetAddressRange, and lets copies
 * reject pointers the real driver would reject. Sorted by base; ranges may
 * overlap only for pool imports (a stale block and its successor). */
enum { RK_DEV = 1, RK_IPC, RK_POOL, RK_POOL_IMPORT, RK_VMM, RK_HOST_ALLOC, RK_HOST_REG };

typedef struct range {
  uintptr_t base;
  size_t size;
  int kind;
  int ordinal;
  uint64_t buffer_id;
  int prot; /* PROT_READ|PROT_WRITE the device has (VMM may have less) */
  void *obj;
  void *pool; /* pool blocks and imported pool pointers */
  uint64_t handle_types;
  unsigned host_flags;
} range;

static struct {
  pthread_rwlock_t lock;
  range *v;
  size_t n, cap;
} R = {.lock = PTHREAD_RWLOCK_INITIALIZER};

/* Index of the first range with base > addr. */
static size_t reg_upper(uintptr_t addr) {
  size_t lo = 0, hi = R.n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (R.v[mid].base <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static bool reg_add(const range *r) {
  pthread_rwlock_wrlock(&R.lock);
  if (R.n == R.cap) {
    size_t cap = R.cap ? R.cap * 2 : 256;
    range *v = realloc(R.v, cap * sizeof *v);
    if (!v) {
      pthread_rwlock_unlock(&R.lock);
      return false;
    }
    R.v = v;
    R.cap = cap;
  }
  size_t i = reg_upper(r->base);
  memmove(&R.v[i + 1], &R.v[i], (R.n - i) * sizeof *R.v);
  R.v[i] = *r;
  R.n++;
  pthread_rwlock_unlock(&R.lock);
  return true;
}

/* Removes the range with this base and owner object. */
static bool reg_del(uintptr_t base, void *obj) {
  pthread_rwlock_wrlock(&R.lock);
  size_t i = reg_upper(base);
  bool found = false;
  while (i > 0 && R.v[i - 1].base == base) {
    if (R.v[i - 1].obj == obj) {
      memmove(&R.v[i - 1], &R.v[i], (R.n - i) * sizeof *R.v);
      R.n--;
      found = true;
      break;
    }
    i--;
  }
  pthread_rwlock_unlock(&R.lock);
  return found;
}

/* The (most recently added) range containing addr. */
static bool reg_find(uintptr_t addr, range *out) {
  pthread_rwlock_rdlock(&R.lock);
  size_t i = reg_upper(addr);
  bool found = false;
  for (size_t k = 0; i > 0 && k < 256; k++, i--) {
    const range *r = &R.v[i - 1];
    if (addr >= r->base && addr - r->base < r->size) {
      *out = *r;
      found = true;
      break;
    }
  }
  pthread_rwlock_unlock(&R.lock);
  return found;
}

static bool reg_overlaps(uintptr_t base, size_t size) {
  pthread_rwlock_rdlock(&R.lock);
  bool hit = false;
  size_t i = reg_upper(base + size - 1);
  for (size_t k = 0; i > 0 && k < 256; k++, i--) {
    const range *r = &R.v[i - 1];
    if (r->base < base + size && base < r->base + r->size) {
      hit = true;
      break;
    }
  }
  pthread_rwlock_unlock(&R.lock);
  return hit;
}

static void reg_set_prot(uintptr_t base, size_t size, int prot) {
  pthread_rwlock_wrlock(&R.lock);
  for (size_t i = 0; i < R.n; i++)
    if (R.v[i].kind == RK_VMM && R.v[i].base >= base && R.v[i].base - base < size)
      R.v[i].prot = prot;
  pthread_rwlock_unlock(&R.lock);
}

static bool is_host_kind(int k) { return k == RK_HOST_ALLOC || k == RK_HOST_REG; }

/* A pointer the device can access for n bytes (device memory, or pinned host
 * memory, which is mapped for the device under unified addressing). */
static CUresult check_dev(CUdeviceptr p, size_t n, int need_prot, range *out) {
  range r;
  if (!reg_find((uintptr_t)p, &r))
    return CUDA_ERROR_INVALID_VALUE;
  if (n > r.size - ((uintptr_t)p - r.base))
    return CUDA_ERROR_INVALID_VALUE;
  if ((r.prot & need_prot) != need_prot)
    return CUDA_ERROR_INVALID_VALUE;
  if (out)
    *out = r;
  return CUDA_SUCCESS;
}

/* Either side of a unified-addressing copy: a known range must hold the
 * whole extent; an unknown pointer is pageable host memory. */
static CUresult check_any(uintptr_t p, size_t n, int need_prot, bool *pageable) {
  range r;
  if (!reg_find(p, &r)) {
    if (pageable)
      *pageable = true;
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  }
  if (pageable)
    *pageable = false;
  if (n > r.size - (p - r.base) || (r.prot & need_prot) != need_prot)
    return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

/* ======================================================================== */
/* events (state) and streams                                                */
/* ======================================================================== */

/* An event's state. For an interprocess event it lives in a memfd page
 * mapped by the exporter and every importer, so a record in one process and
 * a wait or query in another see the same counters. A record takes the next
 * sequence number ("issued") when it is enqueued; the stream completes it by
 * raising "completed". A wait captures "issued" when it is enqueued: it
 * waits for the most recent record at the time of the call, as in CUDA. */
typedef struct ev_state {
  uint32_t magic;
  uint32_t flags;
  _Atomic uint64_t issued;
  _Atomic uint64_t completed;
  _Atomic uint32_t futex; /* bumped on every completion */
  uint32_t pad;
  _Atomic uint64_t ts_ns; /* completion time of the latest record */
  uint64_t id;
  _Atomic int32_t recorder; /* pid of the process of the latest record */
} ev_state;
#define EV_STATE_MAGIC 0x45564e54u

typedef struct emu_event {
  uint32_t magic;
  unsigned flags;
  atomic_int refs;
  ev_state *st;
  ev_state local;
  void *map; /* the shared page of an interprocess event */
  int fd;    /* exporter: the memfd behind it */
  bool imported;
  emu_ctx *ctx;
  uint64_t ino, dev, id;
} emu_event;
#define EVENT_MAGIC 0x45564531u

static void ev_unref(emu_event *e) {
  if (atomic_fetch_sub(&e->refs, 1) != 1)
    return;
  e->magic = 0;
  if (e->map && !e->imported)
    ((volatile shm_hdr *)e->map)->live = 0; /* later opens fail */
  if (e->map)
    munmap(e->map, EMU_PAGE);
  if (e->fd >= 0)
    close(e->fd);
  free(e);
}

static void ev_complete(ev_state *st, uint64_t seq) {
  atomic_store(&st->ts_ns, now_ns());
  uint64_t c = atomic_load(&st->completed);
  while (c < seq && !atomic_compare_exchange_weak(&st->completed, &c, seq))
    ;
  atomic_fetch_add(&st->futex, 1);
  futex_wake_all(&st->futex);
}

/* A record made by a process that has died since will never complete: its
 * work is gone with it. Treat it as complete rather than hang a waiter. */
static bool ev_recorder_dead(ev_state *st) {
  int32_t pid = atomic_load(&st->recorder);
  return pid > 0 && pid != E.pid && kill(pid, 0) != 0 && errno == ESRCH;
}

static bool ev_done(ev_state *st, uint64_t seq) {
  return atomic_load(&st->completed) >= seq || ev_recorder_dead(st);
}

static void ev_wait(ev_state *st, uint64_t seq) {
  for (;;) {
    uint32_t f = atomic_load(&st->futex);
    if (atomic_load(&st->completed) >= seq)
      return;
    /* The timeout bounds a lost wake-up across processes, and notices a
     * recording process that died. */
    futex_wait_ns(&st->futex, f, 50 * 1000 * 1000);
    if (ev_recorder_dead(st))
      return;
  }
}

enum {
  OP_COPY = 1,
  OP_SET,
  OP_HOST,
  OP_EV_RECORD,
  OP_EV_WAIT,
  OP_WAIT_STREAM,
  OP_WRITE_VALUE,
  OP_WAIT_VALUE,
  OP_POOL_FREE,
  OP_MARKER,
};

typedef struct op {
  struct op *next;
  int kind;
  union {
    struct { void *dst; const void *src; size_t n; } cpy;
    struct { void *dst; uint32_t val; size_t n; int width; } set;
    struct { CUhostFn fn; void *ud; } host;
    struct { emu_event *ev; uint64_t seq; } ev;
    struct { emu_stream *s; uint64_t seq; } ws;
    struct { void *addr; uint64_t val; unsigned flags; bool is64; } mem;
    struct { void *pool; void *blk; } fr;
  } u;
} op;

enum { SK_USER = 0, SK_LEGACY, SK_PER_THREAD };

struct emu_stream {
  uint32_t magic;
  emu_ctx *ctx;
  unsigned flags;
  int kind;
  int priority;
  pthread_mutex_t mu;
  pthread_cond_t cv_work, cv_done;
  op *head, *tail;
  uint64_t enq, done;
  bool closing;
  atomic_int refs;
  emu_stream *next; /* in ctx->streams */
};
#define STREAM_MAGIC 0x5354524du

static void pool_free_op(void *pool, void *blk); /* pools, below */
static void pools_sync_trim(void);

static void stream_unref(emu_stream *s) {
  if (atomic_fetch_sub(&s->refs, 1) != 1)
    return;
  s->magic = 0;
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv_work);
  pthread_cond_destroy(&s->cv_done);
  free(s);
}

static void stream_wait_seq(emu_stream *s, uint64_t seq) {
  pthread_mutex_lock(&s->mu);
  while (s->done < seq)
    pthread_cond_wait(&s->cv_done, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

static bool memop_ready(void *addr, uint64_t v, unsigned flags, bool is64) {
  uint64_t cur = is64 ? atomic_load((_Atomic uint64_t *)addr)
                      : atomic_load((_Atomic uint32_t *)addr);
  switch (flags & 0xf) {
  case CU_STREAM_WAIT_VALUE_GEQ:
    return is64 ? (int64_t)(cur - v) >= 0 : (int32_t)((uint32_t)cur - (uint32_t)v) >= 0;
  case CU_STREAM_WAIT_VALUE_EQ: return cur == v;
  case CU_STREAM_WAIT_VALUE_AND: return (cur & v) != 0;
  case CU_STREAM_WAIT_VALUE_NOR:
    return is64 ? ~(cur | v) != 0 : (uint32_t)~(cur | v) != 0;
  default: return true;
  }
}

/* Waits for a flag word that anyone may write, including another process
 * through a plain copy: spin briefly, then sleep on the word's futex with a
 * growing timeout (cuStreamWriteValue wakes it; other writers are noticed
 * at the next timeout), so a long wait does not burn a core. */
static void wait_value(void *addr, uint64_t v, unsigned flags, bool is64) {
  for (int i = 0; i < 200; i++) {
    if (memop_ready(addr, v, flags, is64))
      return;
    sched_yield();
  }
  long ns = 20000;
  _Atomic uint32_t *word = (_Atomic uint32_t *)addr;
  for (;;) {
    uint32_t w = atomic_load(word);
    if (memop_ready(addr, v, flags, is64))
      return;
    futex_wait_ns(word, w, ns);
    if (ns < 2000000)
      ns *= 2;
  }
}

static void op_run(op *o) {
  switch (o->kind) {
  case OP_COPY:
    if (E.copy_delay_us)
      usleep(E.copy_delay_us);
    memmove(o->u.cpy.dst, o->u.cpy.src, o->u.cpy.n);
    break;
  case OP_SET: {
    if (E.copy_delay_us)
      usleep(E.copy_delay_us);
    size_t n = o->u.set.n;
    if (o->u.set.width == 1) {
      memset(o->u.set.dst, (int)(o->u.set.val & 0xff), n);
    } else if (o->u.set.width == 2) {
      uint16_t *d = o->u.set.dst;
      for (size_t i = 0; i < n; i++)
        d[i] = (uint16_t)o->u.set.val;
    } else {
      uint32_t *d = o->u.set.dst;
      for (size_t i = 0; i < n; i++)
        d[i] = o->u.set.val;
    }
    break;
  }
  case OP_HOST:
    o->u.host.fn(o->u.host.ud);
    break;
  case OP_EV_RECORD:
    ev_complete(o->u.ev.ev->st, o->u.ev.seq);
    ev_unref(o->u.ev.ev);
    break;
  case OP_EV_WAIT:
    ev_wait(o->u.ev.ev->st, o->u.ev.seq);
    ev_unref(o->u.ev.ev);
    break;
  case OP_WAIT_STREAM:
    stream_wait_seq(o->u.ws.s, o->u.ws.seq);
    stream_unref(o->u.ws.s);
    break;
  case OP_WRITE_VALUE:
    if (o->u.mem.is64)
      atomic_store((_Atomic uint64_t *)o->u.mem.addr, o->u.mem.val);
    else
      atomic_store((_Atomic uint32_t *)o->u.mem.addr, (uint32_t)o->u.mem.val);
    futex_wake_all(o->u.mem.addr);
    break;
  case OP_WAIT_VALUE:
    wait_value(o->u.mem.addr, o->u.mem.val, o->u.mem.flags, o->u.mem.is64);
    break;
  case OP_POOL_FREE:
    pool_free_op(o->u.fr.pool, o->u.fr.blk);
    break;
  default:
    break;
  }
}

static void *stream_worker(void *arg) {
  emu_stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->closing)
      pthread_cond_wait(&s->cv_work, &s->mu);
    op *o = s->head;
    if (!o)
      break;
    s->head = o->next;
    if (!s->head)
      s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    op_run(o);
    free(o);
    pthread_mutex_lock(&s->mu);
    s->done++;
    pthread_cond_broadcast(&s->cv_done);
  }
  pthread_mutex_unlock(&s->mu);
  /* Drained after cuStreamDestroy: only now does the context stop waiting
   * for this stream (cuCtxSynchronize covers work a destroyed stream still
   * had queued). */
  emu_ctx *c = s->ctx;
  pthread_mutex_lock(&c->mu);
  for (emu_stream **pp = &c->streams; *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      c->nlive--;
      break;
    }
  pthread_mutex_unlock(&c->mu);
  stream_unref(s);
  return NULL;
}

static emu_stream *stream_new(emu_ctx *c, unsigned flags, int kind) {
  emu_stream *s = calloc(1, sizeof *s);
  if (!s)
    return NULL;
  s->magic = STREAM_MAGIC;
  s->ctx = c;
  s->flags = flags;
  s->kind = kind;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv_work, NULL);
  pthread_cond_init(&s->cv_done, NULL);
  atomic_init(&s->refs, 2); /* the handle and the worker */
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 1024 * 1024); /* host functions run here */
  /* Workers take no signals: those belong to the application's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_t thr;
  int rc = pthread_create(&thr, &attr, stream_worker, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
    free(s);
    return NULL;
  }
  pthread_mutex_lock(&c->mu);
  s->next = c->streams;
  c->streams = s;
  c->nlive++;
  pthread_mutex_unlock(&c->mu);
  return s;
}

/* Ends a stream: its worker finishes the queued work, then goes away, as
 * cuStreamDestroy does. */
static void stream_close(emu_stream *s) {
  pthread_mutex_lock(&s->mu);
  s->closing = true;
  pthread_cond_signal(&s->cv_work);
  pthread_mutex_unlock(&s->mu);
  stream_unref(s);
}

/* Per-thread default streams (CU_STREAM_PER_THREAD): one per thread and
 * context, a blocking stream, ended when the thread exits. */
static pthread_key_t pts_key;
static pthread_once_t pts_once = PTHREAD_ONCE_INIT;
static __thread emu_stream *tls_pts[EMU_MAX_DEV];

static void pts_destroy(void *unused) {
  (void)unused;
  for (int i = 0; i < EMU_MAX_DEV; i++)
    if (tls_pts[i]) {
      stream_close(tls_pts[i]);
      tls_pts[i] = NULL;
    }
}
static void pts_init(void) { pthread_key_create(&pts_key, pts_destroy); }

static emu_stream *ctx_legacy(emu_ctx *c) {
  pthread_mutex_lock(&c->mu);
  emu_stream *s = c->legacy;
  pthread_mutex_unlock(&c->mu);
  if (s)
    return s;
  s = stream_new(c, 0, SK_LEGACY);
  if (!s)
    return NULL;
  pthread_mutex_lock(&c->mu);
  if (c->legacy) { /* lost a race: keep the first */
    pthread_mutex_unlock(&c->mu);
    stream_close(s);
    pthread_mutex_lock(&c->mu);
  } else {
    c->legacy = s;
  }
  s = c->legacy;
  pthread_mutex_unlock(&c->mu);
  return s;
}

/* Resolves a stream argument: NULL and CU_STREAM_LEGACY name the current
 * context's legacy stream, CU_STREAM_PER_THREAD this thread's stream. */
static CUresult get_stream(CUstream h, emu_stream **out) {
  if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
    emu_ctx *c;
    CUresult r = cur_ctx(&c);
    if (r != CUDA_SUCCESS)
      return r;
    emu_stream *s;
    if (h == CU_STREAM_PER_THREAD) {
      s = tls_pts[c->ordinal];
      if (!s) {
        pthread_once(&pts_once, pts_init);
        s = stream_new(c, 0, SK_PER_THREAD);
        if (!s)
          return CUDA_ERROR_OUT_OF_MEMORY;
        tls_pts[c->ordinal] = s;
        pthread_setspecific(pts_key, (void *)1);
      }
    } else {
      s = ctx_legacy(c);
      if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = s;
    return CUDA_SUCCESS;
  }
  emu_stream *s = (emu_stream *)h;
  if (!hs_has(&live_streams, s))
    return CUDA_ERROR_INVALID_HANDLE;
  *out = s;
  return CUDA_SUCCESS;
}

static void push_locked(emu_stream *s, op *o) {
  o->next = NULL;
  if (s->tail)
    s->tail->next = o;
  else
    s->head = o;
  s->tail = o;
  s->enq++;
  pthread_cond_signal(&s->cv_work);
}

/* Makes s wait for everything enqueued so far on t, if t is busy. */
static void add_stream_wait(emu_stream *s, emu_stream *t) {
  pthread_mutex_lock(&t->mu);
  uint64_t e = t->enq, d = t->done;
  pthread_mutex_unlock(&t->mu);
  if (e <= d)
    return;
  op *w = calloc(1, sizeof *w);
  if (!w) { /* cannot express the dependency: wait here instead */
    stream_wait_seq(t, e);
    return;
  }
  w->kind = OP_WAIT_STREAM;
  atomic_fetch_add(&t->refs, 1);
  w->u.ws.s = t;
  w->u.ws.seq = e;
  pthread_mutex_lock(&s->mu);
  push_locked(s, w);
  pthread_mutex_unlock(&s->mu);
}

/* Enqueues o on s with the legacy default stream's implicit
 * synchronization: work on the legacy stream waits for all work enqueued
 * before it on the context's blocking streams, and work on a blocking
 * stream waits for all work enqueued before it on the legacy stream.
 * Non-blocking streams take no part. Returns o's sequence number. */
static uint64_t enqueue(emu_stream *s, op *o) {
  emu_ctx *c = s->ctx;
  pthread_mutex_lock(&c->mu);
  if (s->kind == SK_LEGACY) {
    for (emu_stream *t = c->streams; t; t = t->next)
      if (t != s && !(t->flags & CU_STREAM_NON_BLOCKING))
        add_stream_wait(s, t);
  } else if (!(s->flags & CU_STREAM_NON_BLOCKING) && c->legacy) {
    add_stream_wait(s, c->legacy);
  }
  pthread_mutex_lock(&s->mu);
  push_locked(s, o);
  uint64_t seq = s->enq;
  pthread_mutex_unlock(&s->mu);
  pthread_mutex_unlock(&c->mu);
  return seq;
}

static op *op_new(int kind) {
  op *o = calloc(1, sizeof *o);
  if (o)
    o->kind = kind;
  return o;
}

/* Waits for every stream of the context (cuCtxSynchronize). */
static void ctx_sync(emu_ctx *c) {
  emu_stream *list[256];
  uint64_t seqs[256];
  int n = 0;
  bool more = false;
  pthread_mutex_lock(&c->mu);
  for (emu_stream *t = c->streams; t; t = t->next) {
    if (n == 256) {
      more = true;
      break;
    }
    atomic_fetch_add(&t->refs, 1);
    pthread_mutex_lock(&t->mu);
    seqs[n] = t->enq;
    pthread_mutex_unlock(&t->mu);
    list[n++] = t;
  }
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; i < n; i++) {
    stream_wait_seq(list[i], seqs[i]);
    stream_unref(list[i]);
  }
  if (more)
    ctx_sync(c);
}

/* Enqueues a copy on a stream (async) or on the legacy stream and waits
 * (the synchronous cuMemcpy* family). */
static CUresult do_copy(emu_stream *s, void *dst, const void *src, size_t n,
                        bool src_pageable, bool dst_pageable, bool sync) {
  if (n == 0)
    return CUDA_SUCCESS;
  if (!sync && src_pageable && !dst_pageable) {
    /* cuda.h, "API synchronization behavior": for an async copy from
     * pageable memory "a stream sync is performed before the copy is
     * initiated", and the call returns once the source has been consumed.
     * So: wait for the stream (a marker carries the legacy stream's implicit
     * dependencies), then copy here. */
    op *m = op_new(OP_MARKER);
    if (!m)
      return CUDA_ERROR_OUT_OF_MEMORY;
    stream_wait_seq(s, enqueue(s, m));
    memmove(dst, src, n);
    return CUDA_SUCCESS;
  }
  op *o = op_new(OP_COPY);
  if (!o)
    return CUDA_ERROR_OUT_OF_MEMORY;
  o->u.cpy.dst = dst;
  o->u.cpy.src = src;
  o->u.cpy.n = n;
  /* An async copy to pageable memory returns only once it is done. */
  if (!sync && dst_pageable)
    sync = true;
  uint64_t seq = enqueue(s, o);
  if (sync)
    stream_wait_seq(s, seq);
  return CUDA_SUCCESS;
}

static CUresult do_set(emu_stream *s, CUdeviceptr dst, uint32_t val, size_t n,
                       int width, bool sync) {
  if ((uintptr_t)dst % (size_t)width)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_dev(dst, n * (size_t)width, PROT_WRITE, NULL);
  if (r != CUDA_SUCCESS)
    return n == 0 && dst ? CUDA_SUCCESS : r;
  if (n == 0)
    return CUDA_SUCCESS;
  op *o = op_new(OP_SET);
  if (!o)
    return CUDA_ERROR_OUT_OF_MEMORY;
  o->u.set.dst = (void *)(uintptr_t)dst;
  o->u.set.val = val;
  o->u.set.n = n;
  o->u.set.width = width;
  uint64_t seq = enqueue(s, o);
  if (sync)
    stream_wait_seq(s, seq);
  return CUDA_SUCCESS;
}

/* ======================================================================== */
/* stream and event API                                                      */
/* ======================================================================== */

CUresult cuCtxSynchronize(void) {
  ENTER_INIT("cuCtxSynchronize");
  NEED_CTX(c);
  ctx_sync(c);
  pools_sync_trim();
  RET(CUDA_SUCCESS);
}

/* The CUDA 13.0 variant: the context is an argument (NULL: the current). */
CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  ENTER_INIT("cuCtxSynchronize");
  emu_ctx *c = NULL;
  if (ctx) {
    c = ctx_from(ctx);
    if (!c)
      RET(CUDA_ERROR_INVALID_CONTEXT);
  } else {
    CUresult r = cur_ctx(&c);
    if (r != CUDA_SUCCESS)
      RET(r);
  }
  ctx_sync(c);
  pools_sync_trim();
  RET(CUDA_SUCCESS);
}

/* Makes room for one more stream of c, as the real driver does: its
 * contexts keep stream resources in a pool that grows in steps (the H200's
 * driver 580 gives the 34th stream of a fresh context a new step), and a
 * cuStreamCreate that needs a step waits until every stream of the context
 * has drained: behind a stream held by a cuStreamWaitValue it waits as
 * long as the stream is held. Streams destroyed leave their room behind,
 * so a context that once had N streams creates up to N again at once.
 * Called with c->grow_mu held. */
static void stream_room(emu_ctx *c) {
  if (E.stream_room <= 0)
    return;
  pthread_mutex_lock(&c->mu);
  bool full = c->nlive >= c->room;
  pthread_mutex_unlock(&c->mu);
  if (!full)
    return;
  ctx_sync(c);
  pthread_mutex_lock(&c->mu);
  while (c->room <= c->nlive)
    c->room += E.stream_room;
  pthread_mutex_unlock(&c->mu);
}

static emu_stream *user_stream_new(emu_ctx *c, unsigned flags) {
  pthread_mutex_lock(&c->grow_mu);
  stream_room(c);
  emu_stream *s = stream_new(c, flags, SK_USER);
  pthread_mutex_unlock(&c->grow_mu);
  return s;
}

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  ENTER_INIT("cuStreamCreate");
  if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  emu_stream *s = user_stream_new(c, Flags);
  if (!s)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  if (!hs_add(&live_streams, s)) {
    stream_close(s);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *phStream = (CUstream)s;
  RET(CUDA_SUCCESS);
}

CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority) {
  ENTER_INIT("cuStreamCreateWithPriority");
  if (!phStream || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  emu_stream *s = user_stream_new(c, flags);
  if (!s)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  /* Clamped to the range, as CUDA does (-5 greatest, 0 least). */
  s->priority = priority > 0 ? 0 : priority < -5 ? -5 : priority;
  if (!hs_add(&live_streams, s)) {
    stream_close(s);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *phStream = (CUstream)s;
  RET(CUDA_SUCCESS);
}

CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags) {
  ENTER_INIT("cuStreamGetFlags");
  if (!flags)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  *flags = s->flags;
  RET(CUDA_SUCCESS);
}

CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
  ENTER_INIT("cuStreamGetCtx");
  if (!pctx)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  *pctx = (CUcontext)s->ctx;
  RET(CUDA_SUCCESS);
}

/* The CUDA 12.5 variant, with green contexts (none here). */
CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext *pCtx, CUgreenCtx *pGreenCtx) {
  ENTER_INIT("cuStreamGetCtx");
  if (!pCtx || !pGreenCtx)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  *pCtx = (CUcontext)s->ctx;
  *pGreenCtx = NULL;
  RET(CUDA_SUCCESS);
}

CUresult cuStreamGetPriority(CUstream hStream, int *priority) {
  ENTER_INIT("cuStreamGetPriority");
  if (!priority)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  *priority = s->priority;
  RET(CUDA_SUCCESS);
}

CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
  ENTER_INIT("cuCtxGetStreamPriorityRange");
  NEED_CTX(c);
  (void)c;
  if (leastPriority)
    *leastPriority = 0;
  if (greatestPriority)
    *greatestPriority = -5; /* as on Hopper */
  RET(CUDA_SUCCESS);
}

CUresult cuStreamDestroy(CUstream hStream) {
  ENTER_INIT("cuStreamDestroy");
  emu_stream *s = (emu_stream *)hStream;
  /* Only user streams are in the set: not NULL, legacy or per-thread. */
  if (!s || !hs_del(&live_streams, s))
    RET(CUDA_ERROR_INVALID_HANDLE);
  stream_close(s);
  RET(CUDA_SUCCESS);
}

CUresult cuStreamSynchronize(CUstream hStream) {
  ENTER_INIT("cuStreamSynchronize");
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  uint64_t seq;
  if (s->kind == SK_LEGACY) {
    /* A marker carries the implicit waits on the blocking streams. */
    op *o = op_new(OP_MARKER);
    if (!o)
      RET(CUDA_ERROR_OUT_OF_MEMORY);
    seq = enqueue(s, o);
  } else {
    pthread_mutex_lock(&s->mu);
    seq = s->enq;
    pthread_mutex_unlock(&s->mu);
  }
  stream_wait_seq(s, seq);
  pools_sync_trim();
  RET(CUDA_SUCCESS);
}

static bool stream_idle(emu_stream *s) {
  pthread_mutex_lock(&s->mu);
  bool idle = s->enq == s->done;
  pthread_mutex_unlock(&s->mu);
  return idle;
}

CUresult cuStreamQuery(CUstream hStream) {
  ENTER_INIT("cuStreamQuery");
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  bool idle = stream_idle(s);
  if (idle && s->kind == SK_LEGACY) {
    emu_ctx *c = s->ctx;
    pthread_mutex_lock(&c->mu);
    for (emu_stream *t = c->streams; t && idle; t = t->next)
      if (!(t->flags & CU_STREAM_NON_BLOCKING))
        idle = stream_idle(t);
    pthread_mutex_unlock(&c->mu);
  }
  RET(idle ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

static emu_event *event_from(CUevent h) {
  emu_event *e = (emu_event *)h;
  return e && hs_has(&live_events, e) ? e : NULL;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
  ENTER_INIT("cuStreamWaitEvent");
  emu_event *e = event_from(hEvent);
  if (!e)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  uint64_t seq = atomic_load(&e->st->issued);
  if (seq == 0 || ev_done(e->st, seq))
    RET(CUDA_SUCCESS); /* nothing outstanding to wait for */
  op *o = op_new(OP_EV_WAIT);
  if (!o)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  atomic_fetch_add(&e->refs, 1);
  o->u.ev.ev = e;
  o->u.ev.seq = seq;
  enqueue(s, o);
  RET(CUDA_SUCCESS);
}

CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
  ENTER_INIT("cuLaunchHostFunc");
  if (!fn)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  op *o = op_new(OP_HOST);
  if (!o)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  o->u.host.fn = fn;
  o->u.host.ud = userData;
  enqueue(s, o);
  RET(CUDA_SUCCESS);
}

static void *range_pool(const range *r);

static CUresult memop(CUstream hStream, CUdeviceptr addr, uint64_t value,
                      unsigned flags, bool is64, bool wait) {
  if (disabled(is64 ? DIS_MEMOPS64 : DIS_MEMOPS))
    return CUDA_ERROR_NOT_SUPPORTED;
  unsigned allowed = wait ? 0x3u | (unsigned)CU_STREAM_WAIT_VALUE_FLUSH
                          : (unsigned)CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER;
  if (flags & ~allowed)
    return CUDA_ERROR_INVALID_VALUE;
  if (wait && (flags & CU_STREAM_WAIT_VALUE_FLUSH))
    return CUDA_ERROR_NOT_SUPPORTED; /* CAN_FLUSH_REMOTE_WRITES is 0 */
  size_t w = is64 ? 8 : 4;
  if ((uintptr_t)addr % w)
    return CUDA_ERROR_INVALID_VALUE;
  range rg;
  CUresult r = check_dev(addr, w, wait ? PROT_READ : PROT_WRITE, &rg);
  if (r != CUDA_SUCCESS)
    return r;
  /* The real driver (580, H200) refuses stream memory operations on memory
   * from a memory pool (cuMemAllocFromPoolAsync, cuMemAllocAsync, and
   * pointers imported from a pool) with CUDA_ERROR_INVALID_VALUE, while it
   * accepts cuMemAlloc, VMM and registered host memory. Flag words must not
   * live in pool memory; say so once, since the error alone is puzzling. */
  if (range_pool(&rg) != NULL) {
    static atomic_int told;
    if (atomic_exchange(&told, 1) == 0)
      fprintf(stderr, "libcuda-emu: %s on memory-pool memory: "
                      "CUDA_ERROR_INVALID_VALUE, as the real driver does (use "
                      "cuMemAlloc, VMM or registered host memory for flag "
                      "words)\n",
              wait ? "cuStreamWaitValue" : "cuStreamWriteValue");
    return CUDA_ERROR_INVALID_VALUE;
  }
  emu_stream *s;
  r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    return r;
  op *o = op_new(wait ? OP_WAIT_VALUE : OP_WRITE_VALUE);
  if (!o)
    return CUDA_ERROR_OUT_OF_MEMORY;
  o->u.mem.addr = (void *)(uintptr_t)addr;
  o->u.mem.val = value;
  o->u.mem.flags = flags;
  o->u.mem.is64 = is64;
  enqueue(s, o);
  return CUDA_SUCCESS;
}

CUresult cuStreamWriteValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  ENTER_INIT("cuStreamWriteValue32");
  RET(memop(stream, addr, value, flags, false, false));
}
CUresult cuStreamWriteValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
  ENTER_INIT("cuStreamWriteValue64");
  RET(memop(stream, addr, value, flags, true, false));
}
CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  ENTER_INIT("cuStreamWaitValue32");
  RET(memop(stream, addr, value, flags, false, true));
}
CUresult cuStreamWaitValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
  ENTER_INIT("cuStreamWaitValue64");
  RET(memop(stream, addr, value, flags, true, true));
}

/* ---- events --------------------------------------------------------------- */

static emu_event *event_alloc(emu_ctx *c, unsigned flags) {
  emu_event *e = calloc(1, sizeof *e);
  if (!e)
    return NULL;
  e->magic = EVENT_MAGIC;
  e->flags = flags;
  e->ctx = c;
  e->fd = -1;
  atomic_init(&e->refs, 1);
  e->st = &e->local;
  e->local.magic = EV_STATE_MAGIC;
  e->id = next_id();
  return e;
}

/* An interprocess event keeps its state in a one-page memfd. */
static CUresult event_make_shared(emu_event *e);

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  ENTER_INIT("cuEventCreate");
  unsigned ok = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (!phEvent || (Flags & ~ok))
    RET(CUDA_ERROR_INVALID_VALUE);
  /* As in CUDA: an interprocess event must not record timing. */
  if ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING))
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  if ((Flags & CU_EVENT_INTERPROCESS) && disabled(DIS_IPC_EVENT))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  emu_event *e = event_alloc(c, Flags);
  if (!e)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  if (Flags & CU_EVENT_INTERPROCESS) {
    CUresult r = event_make_shared(e);
    if (r != CUDA_SUCCESS) {
      ev_unref(e);
      RET(r);
    }
  }
  if (!hs_add(&live_events, e)) {
    ev_unref(e);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *phEvent = (CUevent)e;
  RET(CUDA_SUCCESS);
}

CUresult cuEventDestroy(CUevent hEvent) {
  ENTER_INIT("cuEventDestroy");
  emu_event *e = event_from(hEvent);
  if (!e)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (!hs_del(&live_events, e))
    RET(CUDA_ERROR_INVALID_HANDLE);
  ev_unref(e); /* queued records and waits hold their own references */
  RET(CUDA_SUCCESS);
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  ENTER_INIT("cuEventRecord");
  emu_event *e = event_from(hEvent);
  if (!e)
    RET(CUDA_ERROR_INVALID_HANDLE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  op *o = op_new(OP_EV_RECORD);
  if (!o)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  atomic_fetch_add(&e->refs, 1);
  o->u.ev.ev = e;
  atomic_store(&e->st->recorder, (int32_t)E.pid);
  o->u.ev.seq = atomic_fetch_add(&e->st->issued, 1) + 1;
  enqueue(s, o);
  RET(CUDA_SUCCESS);
}

CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags) {
  ENTER_INIT("cuEventRecordWithFlags");
  if (flags & ~(unsigned)CU_EVENT_RECORD_EXTERNAL)
    RET(CUDA_ERROR_INVALID_VALUE);
  RET(cuEventRecord(hEvent, hStream));
}

CUresult cuEventQuery(CUevent hEvent) {
  ENTER_INIT("cuEventQuery");
  emu_event *e = event_from(hEvent);
  if (!e)
    RET(CUDA_ERROR_INVALID_HANDLE);
  RET(ev_done(e->st, atomic_load(&e->st->issued)) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

CUresult cuEventSynchronize(CUevent hEvent) {
  ENTER_INIT("cuEventSynchronize");
  emu_event *e = event_from(hEvent);
  if (!e)
    RET(CUDA_ERROR_INVALID_HANDLE);
  ev_wait(e->st, atomic_load(&e->st->issued));
  pools_sync_trim();
  RET(CUDA_SUCCESS);
}

CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
  ENTER_INIT("cuEventElapsedTime");
  if (!pMilliseconds)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_event *a = event_from(hStart), *b = event_from(hEnd);
  if (!a || !b)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (atomic_load(&a->st->issued) == 0 || atomic_load(&b->st->issued) == 0)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (atomic_load(&a->st->completed) < atomic_load(&a->st->issued) ||
      atomic_load(&b->st->completed) < atomic_load(&b->st->issued))
    RET(CUDA_ERROR_NOT_READY);
  int64_t d = (int64_t)(atomic_load(&b->st->ts_ns) - atomic_load(&a->st->ts_ns));
  *pMilliseconds = (float)((double)d / 1e6);
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* copies and sets                                                           */
/* ======================================================================== */

/* True for pageable memory and for pinned (allocated or registered) host
 * memory. */
static bool host_memory(uintptr_t p, bool pageable) {
  range r;
  if (pageable || !reg_find(p, &r))
    return true;
  return r.kind == RK_HOST_ALLOC || r.kind == RK_HOST_REG;
}

static CUresult copy_common(CUstream h, uintptr_t dst, uintptr_t src, size_t n,
                            int dst_rule, int src_rule, bool sync) {
  /* rule 0: any pointer (unified addressing), 1: must be device-accessible. */
  if (!dst || !src)
    return CUDA_ERROR_INVALID_VALUE;
  bool dpage = false, spage = false;
  CUresult r;
  r = dst_rule == 1 ? check_dev(dst, n, PROT_WRITE, NULL) : check_any(dst, n, PROT_WRITE, &dpage);
  if (r != CUDA_SUCCESS)
    return r;
  r = src_rule == 1 ? check_dev(src, n, PROT_READ, NULL) : check_any(src, n, PROT_READ, &spage);
  if (r != CUDA_SUCCESS)
    return r;
  emu_stream *s;
  r = get_stream(sync ? NULL : h, &s);
  if (r != CUDA_SUCCESS)
    return r;
  /* cuda.h, "API synchronization behavior": an async copy between two host
   * buffers (pageable or pinned) is fully synchronous with respect to the
   * host: it returns after the stream's earlier work and the copy are done.
   * A test that holds a stream and then copies host to host deadlocks on a
   * real GPU; so it does here. */
  if (!sync && n && host_memory(dst, dpage) && host_memory(src, spage)) {
    op *m = op_new(OP_MARKER);
    if (!m)
      return CUDA_ERROR_OUT_OF_MEMORY;
    stream_wait_seq(s, enqueue(s, m));
    memmove((void *)dst, (const void *)src, n);
    return CUDA_SUCCESS;
  }
  return do_copy(s, (void *)dst, (const void *)src, n, spage, dpage, sync);
}

CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
  ENTER_INIT("cuMemcpy");
  RET(copy_common(NULL, dst, src, ByteCount, 0, 0, true));
}
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream) {
  ENTER_INIT("cuMemcpyAsync");
  RET(copy_common(hStream, dst, src, ByteCount, 0, 0, false));
}
CUresult cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
  ENTER_INIT("cuMemcpyHtoD");
  RET(copy_common(NULL, dstDevice, (uintptr_t)srcHost, ByteCount, 1, 0, true));
}
CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  ENTER_INIT("cuMemcpyDtoH");
  RET(copy_common(NULL, (uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, true));
}
CUresult cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
  ENTER_INIT("cuMemcpyDtoD");
  RET(copy_common(NULL, dstDevice, srcDevice, ByteCount, 1, 1, true));
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream) {
  ENTER_INIT("cuMemcpyHtoDAsync");
  RET(copy_common(hStream, dstDevice, (uintptr_t)srcHost, ByteCount, 1, 0, false));
}
CUresult cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  ENTER_INIT("cuMemcpyDtoHAsync");
  RET(copy_common(hStream, (uintptr_t)dstHost, srcDevice, ByteCount, 0, 1, false));
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  ENTER_INIT("cuMemcpyDtoDAsync");
  RET(copy_common(hStream, dstDevice, srcDevice, ByteCount, 1, 1, false));
}
/* cuda.h (CUDA 13.0 variant, without failIdx): count copies as one batch
 * in stream order, the copies within it in no given order; each entry's
 * attributes are those of the last attrsIdxs entry at or before it
 * (attrsIdxs[0] must be 0, the indices increasing, below count). Not on the
 * legacy NULL stream. Every copy is checked before any is enqueued: a bad
 * one fails the call and enqueues nothing. */
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                            size_t count, CUmemcpyAttributes *attrs,
                            size_t *attrsIdxs, size_t numAttrs, CUstream hStream) {
  ENTER_INIT("cuMemcpyBatchAsync");
  if (!dsts || !srcs || !sizes || count == 0 || !attrs || !attrsIdxs ||
      numAttrs == 0 || numAttrs > count || attrsIdxs[0] != 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < numAttrs; i++) {
    if ((i && attrsIdxs[i] <= attrsIdxs[i - 1]) || attrsIdxs[i] >= count)
      RET(CUDA_ERROR_INVALID_VALUE);
    CUmemcpySrcAccessOrder o = attrs[i].srcAccessOrder;
    if (o != CU_MEMCPY_SRC_ACCESS_ORDER_STREAM &&
        o != CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL &&
        o != CU_MEMCPY_SRC_ACCESS_ORDER_ANY)
      RET(CUDA_ERROR_INVALID_VALUE);
    if (attrs[i].flags & ~(unsigned)CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
      RET(CUDA_ERROR_INVALID_VALUE);
  }
  if (hStream == NULL || hStream == CU_STREAM_LEGACY)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  for (size_t i = 0; i < count; i++) {
    bool page = false;
    if (!dsts[i] || !srcs[i])
      RET(CUDA_ERROR_INVALID_VALUE);
    if ((r = check_any(dsts[i], sizes[i], PROT_WRITE, &page)) != CUDA_SUCCESS ||
        (r = check_any(srcs[i], sizes[i], PROT_READ, &page)) != CUDA_SUCCESS)
      RET(r);
  }
  for (size_t i = 0; i < count; i++)
    if ((r = copy_common(hStream, dsts[i], srcs[i], sizes[i], 0, 0, false)) !=
        CUDA_SUCCESS)
      RET(r);
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* modules and kernels                                                       */
/* ======================================================================== */

/* The one kernel the emulator runs: gpuipc's gather copy (src/sets/
 * gather.cu), performed on the host. Its parameter, as src/sets/gather.h
 * lays it out (mirrored here: the emulator includes nothing of the
 * library): a count, then that many {src, dst, len} entries; block x of
 * the grid copies entry x. */
enum { EMU_GATHER_N = 1360, EMU_GATHER_THREADS = 256 };
typedef struct emu_gather_args {
  uint64_t n;
  struct { uint64_t src, dst, len; } e[EMU_GATHER_N];
} emu_gather_args;

typedef struct emu_module emu_module;
typedef struct emu_function {
  emu_module *mod;
} emu_function;
struct emu_module {
  emu_ctx *ctx;
  emu_function gather;
};

/* A CUDA fatbin starts with this magic (little-endian); the emulator takes
 * any fatbin as an image that holds the gather kernel, and nothing else
 * (no PTX text, no bare cubin). */
#define EMU_FATBIN_MAGIC 0xBA55ED50u

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  ENTER_INIT("cuModuleLoadData");
  NEED_CTX(c);
  if (!module || !image)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_KERNELS))
    RET(CUDA_ERROR_NO_BINARY_FOR_GPU);
  uint32_t magic;
  memcpy(&magic, image, sizeof magic);
  if (magic != EMU_FATBIN_MAGIC)
    RET(CUDA_ERROR_INVALID_IMAGE);
  emu_module *m = calloc(1, sizeof *m);
  if (!m)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  m->ctx = c;
  m->gather.mod = m;
  if (!hs_add(&live_modules, m)) {
    free(m);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  if (!hs_add(&live_functions, &m->gather)) {
    hs_del(&live_modules, m);
    free(m);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *module = (CUmodule)m;
  RET(CUDA_SUCCESS);
}

CUresult cuModuleUnload(CUmodule hmod) {
  ENTER_INIT("cuModuleUnload");
  emu_module *m = (emu_module *)hmod;
  if (!m || !hs_del(&live_modules, m))
    RET(CUDA_ERROR_INVALID_HANDLE);
  hs_del(&live_functions, &m->gather);
  free(m);
  RET(CUDA_SUCCESS);
}

CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  ENTER_INIT("cuModuleGetFunction");
  if (!hfunc || !name)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_module *m = (emu_module *)hmod;
  if (!m || !hs_has(&live_modules, m))
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (strcmp(name, "gpuipc_gather") != 0)
    RET(CUDA_ERROR_NOT_FOUND);
  *hfunc = (CUfunction)&m->gather;
  RET(CUDA_SUCCESS);
}

/* The gather kernel, in stream order: each entry becomes one of the
 * stream's copies, as cuMemcpyDtoDAsync enqueues it (the entries may not
 * overlap, so their order does not matter). Checked as the real kernel
 * cannot check: the parameter only through kernelParams (not extra), a
 * grid of exactly n blocks across (grid.y splits them), at most 256
 * threads across, every entry inside device memory (a real kernel would
 * fault later, as CUDA_ERROR_ILLEGAL_ADDRESS; here the launch fails with
 * it and enqueues nothing). */
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX,
                        unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra) {
  ENTER_INIT("cuLaunchKernel");
  emu_function *fn = (emu_function *)f;
  if (!fn || !hs_has(&live_functions, fn))
    RET(CUDA_ERROR_INVALID_HANDLE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  if (s->ctx != fn->mod->ctx)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (extra || !kernelParams || !kernelParams[0]) {
    emu_msg("cuLaunchKernel(gpuipc_gather): the parameter must come through "
            "kernelParams");
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  if (gridDimX == 0 || gridDimY == 0 || gridDimY > 65535 || gridDimZ != 1 ||
      blockDimX == 0 || blockDimX > EMU_GATHER_THREADS || blockDimY != 1 ||
      blockDimZ != 1 || sharedMemBytes > 48 * 1024)
    RET(CUDA_ERROR_INVALID_VALUE);
  const emu_gather_args *a = kernelParams[0];
  if (a->n == 0 || a->n > EMU_GATHER_N || a->n != gridDimX) {
    emu_msg("cuLaunchKernel(gpuipc_gather): %llu entries (1..%d), grid.x %u",
            (unsigned long long)a->n, EMU_GATHER_N, gridDimX);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  for (uint64_t i = 0; i < a->n; i++) {
    size_t len = (size_t)a->e[i].len;
    if (len == 0)
      continue;
    if (check_dev(a->e[i].src, len, PROT_READ, NULL) != CUDA_SUCCESS ||
        check_dev(a->e[i].dst, len, PROT_WRITE, NULL) != CUDA_SUCCESS) {
      emu_msg("cuLaunchKernel(gpuipc_gather): entry %llu (%#llx -> %#llx, %zu "
              "bytes) is not inside device memory", (unsigned long long)i,
              (unsigned long long)a->e[i].src, (unsigned long long)a->e[i].dst,
              len);
      RET(CUDA_ERROR_ILLEGAL_ADDRESS);
    }
  }
  for (uint64_t i = 0; i < a->n; i++)
    if (a->e[i].len &&
        (r = do_copy(s, (void *)(uintptr_t)a->e[i].dst,
                     (const void *)(uintptr_t)a->e[i].src, (size_t)a->e[i].len,
                     false, false, false)) != CUDA_SUCCESS)
      RET(r);
  RET(CUDA_SUCCESS);
}

CUresult cuMemcpyPeer(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                      CUcontext srcContext, size_t ByteCount) {
  ENTER_INIT("cuMemcpyPeer");
  if (!ctx_from(dstContext) || !ctx_from(srcContext))
    RET(CUDA_ERROR_INVALID_CONTEXT);
  RET(copy_common(NULL, dstDevice, srcDevice, ByteCount, 1, 1, true));
}
CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                           CUcontext srcContext, size_t ByteCount, CUstream hStream) {
  ENTER_INIT("cuMemcpyPeerAsync");
  if (!ctx_from(dstContext) || !ctx_from(srcContext))
    RET(CUDA_ERROR_INVALID_CONTEXT);
  RET(copy_common(hStream, dstDevice, srcDevice, ByteCount, 1, 1, false));
}

static CUresult set_common(CUstream h, CUdeviceptr dst, uint32_t v, size_t n, int width, bool sync) {
  emu_stream *s;
  CUresult r = get_stream(sync ? NULL : h, &s);
  if (r != CUDA_SUCCESS)
    return r;
  return do_set(s, dst, v, n, width, sync);
}

CUresult cuMemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
  ENTER_INIT("cuMemsetD8");
  RET(set_common(NULL, dstDevice, uc, N, 1, true));
}
CUresult cuMemsetD16(CUdeviceptr dstDevice, unsigned short us, size_t N) {
  ENTER_INIT("cuMemsetD16");
  RET(set_common(NULL, dstDevice, us, N, 2, true));
}
CUresult cuMemsetD32(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
  ENTER_INIT("cuMemsetD32");
  RET(set_common(NULL, dstDevice, ui, N, 4, true));
}
CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
  ENTER_INIT("cuMemsetD8Async");
  RET(set_common(hStream, dstDevice, uc, N, 1, false));
}
CUresult cuMemsetD16Async(CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream) {
  ENTER_INIT("cuMemsetD16Async");
  RET(set_common(hStream, dstDevice, us, N, 2, false));
}
CUresult cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream) {
  ENTER_INIT("cuMemsetD32Async");
  RET(set_common(hStream, dstDevice, ui, N, 4, false));
}

/* ======================================================================== */
/* shared memory objects                                                     */
/* ======================================================================== */


/* The 64 bytes of a legacy memory or event handle. */
typedef struct ipc_wire {
  uint32_t magic, kind;
  int32_t pid, fd;
  uint64_t ino, dev, id, start_time;
  uint8_t pad[16];
} ipc_wire;
_Static_assert(sizeof(ipc_wire) == CU_IPC_HANDLE_SIZE, "ipc handle size");

/* Every legacy allocation keeps its memfd open (importers reach it through
 * /proc/<pid>/fd), so a process with many allocations may need more
 * descriptors than the usual soft limit of 1024: raised (to the hard limit,
 * at most 65536) only when that happens, since the real driver leaves the
 * limit alone. */
static bool raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= rl.rlim_max || rl.rlim_cur >= 65536)
    return false;
  rl.rlim_cur = rl.rlim_max < 65536 ? rl.rlim_max : 65536;
  return setrlimit(RLIMIT_NOFILE, &rl) == 0;
}

static int shm_create(size_t data_size, const shm_hdr *h, uint64_t *ino, uint64_t *dev) {
  int fd = memfd_create("cuda-emu", MFD_CLOEXEC);
  if (fd < 0 && errno == EMFILE && raise_nofile())
    fd = memfd_create("cuda-emu", MFD_CLOEXEC);
  if (fd < 0)
    return -1;
  struct stat st;
  if (ftruncate(fd, (off_t)(EMU_PAGE + data_size)) != 0 ||
      pwrite(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h || fstat(fd, &st) != 0) {
    close(fd);
    return -1;
  }
  *ino = (uint64_t)st.st_ino;
  *dev = (uint64_t)st.st_dev;
  return fd;
}

static void shm_set_field(int fd, size_t off, const void *v, size_t n) {
  ssize_t w = pwrite(fd, v, n, (off_t)off);
  (void)w;
}

/* Opens another process's memfd by its /proc entry (same user) and checks
 * that it is the very object the handle names (inode, kind). A dead
 * exporter or a closed descriptor simply fails here. */
static int shm_open_peer(int pid, int fd, uint64_t ino, uint64_t dev, uint32_t kind, shm_hdr *h) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
  int f = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (f < 0) {
    if (errno == EACCES || errno == EPERM)
      emu_msg("cannot open %s (%s): importing needs the exporter to run as "
              "the same user and /proc access to it",
              path, strerror(errno));
    return -1;
  }
  struct stat st;
  if (fstat(f, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_ino != ino ||
      (uint64_t)st.st_dev != dev ||
      pread(f, h, sizeof *h, 0) != (ssize_t)sizeof *h || h->magic != EMU_HDR_MAGIC ||
      h->kind != kind || (uint64_t)st.st_size < EMU_PAGE + h->size) {
    close(f);
    return -1;
  }
  return f;
}

/* Maps an imported object's data anywhere except at the address its creator
 * uses: two processes never see one allocation at the same address, so code
 * that wrongly assumes equal addresses fails on the emulator too. */
static void *map_import(int fd, size_t len, uint64_t avoid) {
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)EMU_PAGE);
  if (p == MAP_FAILED)
    return NULL;
  if ((uint64_t)(uintptr_t)p == avoid) {
    void *q = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)EMU_PAGE);
    munmap(p, len);
    p = q == MAP_FAILED ? NULL : q;
  }
  return p;
}

static int phys_to_ordinal(uint32_t phys, int dflt) {
  return phys < EMU_MAX_DEV && E.ord[phys] >= 0 ? E.ord[phys] : dflt;
}

/* ---- accounting ------------------------------------------------------------ */

/* cuMemGetInfo reports, per device, total minus what *this process* holds
 * (allocations, pools' reserved memory, VMM physical allocations): a test
 * can check its own leaks while other tests run in parallel. */
static bool mem_charge(int ord, size_t n) {
  int64_t cur = atomic_load(&E.used[ord]);
  do {
    if (cur + (int64_t)n > (int64_t)E.total_mem)
      return false;
  } while (!atomic_compare_exchange_weak(&E.used[ord], &cur, cur + (int64_t)n));
  return true;
}
static void mem_uncharge(int ord, size_t n) { atomic_fetch_sub(&E.used[ord], (int64_t)n); }

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total) {
  ENTER_INIT("cuMemGetInfo");
  if (!free_bytes || !total)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  int64_t used = atomic_load(&E.used[c->ordinal]);
  *total = E.total_mem;
  *free_bytes = used >= (int64_t)E.total_mem ? 0 : E.total_mem - (size_t)used;
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* device memory (cuMemAlloc) and legacy IPC                                 */
/* ======================================================================== */

typedef struct dev_alloc {
  uintptr_t base;
  size_t size, map_size;
  int fd;
  uint64_t ino, dev, id;
  int ordinal;
} dev_alloc;

/* Freed address ranges, still reserved, handed back for an allocation of the
 * same size as the real driver does (same address, new buffer id). */
#define ADDR_CACHE_MAX 64
#define ADDR_CACHE_BYTES ((size_t)1 << 30)
static struct { uintptr_t base; size_t size; } addr_cache[ADDR_CACHE_MAX];
static int addr_n;
static size_t addr_bytes;

static void addr_cache_put(uintptr_t base, size_t size) { /* E.mu held */
  while (addr_n > 0 && (addr_n == ADDR_CACHE_MAX || addr_bytes + size > ADDR_CACHE_BYTES)) {
    munmap((void *)addr_cache[0].base, addr_cache[0].size);
    addr_bytes -= addr_cache[0].size;
    memmove(&addr_cache[0], &addr_cache[1], (size_t)(--addr_n) * sizeof addr_cache[0]);
  }
  if (size > ADDR_CACHE_BYTES) {
    munmap((void *)base, size);
    return;
  }
  addr_cache[addr_n].base = base;
  addr_cache[addr_n].size = size;
  addr_n++;
  addr_bytes += size;
}

static uintptr_t addr_cache_get(size_t size) { /* E.mu held */
  for (int i = addr_n - 1; i >= 0; i--)
    if (addr_cache[i].size == size) {
      uintptr_t b = addr_cache[i].base;
      addr_bytes -= size;
      memmove(&addr_cache[i], &addr_cache[i + 1], (size_t)(addr_n - i - 1) * sizeof addr_cache[0]);
      addr_n--;
      return b;
    }
  return 0;
}

CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
  ENTER_INIT("cuMemAlloc");
  if (!dptr || bytesize == 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  size_t map = round_up(bytesize, EMU_PAGE);
  if (map < bytesize || !mem_charge(c->ordinal, map))
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  dev_alloc *a = calloc(1, sizeof *a);
  if (!a) {
    mem_uncharge(c->ordinal, map);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  shm_hdr h = {.magic = EMU_HDR_MAGIC, .kind = HK_DEV, .owner_pid = E.pid,
               .phys = (uint32_t)c->phys, .size = map, .id = next_id(), .live = 1,
               .user_size = bytesize};
  h.buffer_id = h.id;
  a->fd = shm_create(map, &h, &a->ino, &a->dev);
  if (a->fd < 0) {
    free(a);
    mem_uncharge(c->ordinal, map);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  pthread_mutex_lock(&E.mu);
  uintptr_t want = addr_cache_get(map);
  void *p = mmap((void *)want, map, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (want ? MAP_FIXED : 0), a->fd, (off_t)EMU_PAGE);
  pthread_mutex_unlock(&E.mu);
  if (p == MAP_FAILED) {
    if (want)
      munmap((void *)want, map);
    close(a->fd);
    free(a);
    mem_uncharge(c->ordinal, map);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  a->base = (uintptr_t)p;
  a->size = bytesize;
  a->map_size = map;
  a->id = h.id;
  a->ordinal = c->ordinal;
  h.owner_addr = a->base;
  shm_set_field(a->fd, offsetof(shm_hdr, owner_addr), &h.owner_addr, sizeof h.owner_addr);
  range r = {.base = a->base, .size = bytesize, .kind = RK_DEV, .ordinal = c->ordinal,
             .buffer_id = h.buffer_id, .prot = PROT_READ | PROT_WRITE, .obj = a};
  if (!reg_add(&r)) {
    munmap(p, map);
    close(a->fd);
    free(a);
    mem_uncharge(c->ordinal, map);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *dptr = (CUdeviceptr)a->base;
  RET(CUDA_SUCCESS);
}

static void dev_free(dev_alloc *a) { /* already out of the registry */
  uint32_t dead = 0;
  /* A handle opened from now on fails with CUDA_ERROR_INVALID_VALUE; those
   * already opened keep their mapping (the memfd lives while mapped). */
  shm_set_field(a->fd, offsetof(shm_hdr, live), &dead, sizeof dead);
  close(a->fd);
  /* Keep the address reserved for reuse, but let go of the pages (importers
   * keep theirs): anonymous memory, so work still in flight on the freed
   * range touches junk instead of faulting. */
  mmap((void *)a->base, a->map_size, PROT_READ | PROT_WRITE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  pthread_mutex_lock(&E.mu);
  addr_cache_put(a->base, a->map_size);
  pthread_mutex_unlock(&E.mu);
  mem_uncharge(a->ordinal, a->map_size);
  free(a);
}

static CUresult pool_free_now(uintptr_t ptr, const range *r); /* pools */

CUresult cuMemFree(CUdeviceptr dptr) {
  ENTER_INIT("cuMemFree");
  if (dptr == 0)
    RET(CUDA_SUCCESS);
  NEED_CTX(c);
  (void)c;
  range r;
  if (!reg_find(dptr, &r) || r.base != dptr)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (r.kind == RK_DEV) {
    /* Claim it: a concurrent free of the same pointer finds nothing. */
    if (!reg_del(r.base, r.obj))
      RET(CUDA_ERROR_INVALID_VALUE);
    dev_free(r.obj);
    RET(CUDA_SUCCESS);
  }
  if (r.kind == RK_POOL || r.kind == RK_POOL_IMPORT)
    RET(pool_free_now(dptr, &r));
  RET(CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
  ENTER_INIT("cuMemGetAddressRange");
  range r;
  if (!reg_find(dptr, &r) || is_host_kind(r.kind))
    RET(CUDA_ERROR_NOT_FOUND);
  if (pbase)
    *pbase = (CUdeviceptr)r.base;
  if (psize)
    *psize = r.size;
  RET(CUDA_SUCCESS);
}

/* ---- legacy IPC ------------------------------------------------------------ */

typedef struct ipc_import {
  int32_t pid;
  uint64_t id;
  uintptr_t base;
  size_t map_size;
  int refs;
  struct ipc_import *next;
} ipc_import;
static ipc_import *imports; /* E.mu */

CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
  ENTER_INIT("cuIpcGetMemHandle");
  if (!pHandle)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  (void)c;
  if (disabled(DIS_LEGACY_IPC))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  range r;
  /* An interior pointer gives its allocation's handle (same bytes). Pool,
   * VMM, imported and host memory have no legacy handle. */
  if (!reg_find(dptr, &r) || r.kind != RK_DEV)
    RET(CUDA_ERROR_INVALID_VALUE);
  dev_alloc *a = r.obj;
  ipc_wire w;
  memset(&w, 0, sizeof w);
  w.magic = EMU_WIRE_MAGIC;
  w.kind = HK_DEV;
  w.pid = E.pid;
  w.fd = a->fd;
  w.ino = a->ino;
  w.dev = a->dev;
  w.id = a->id;
  w.start_time = E.start_time;
  memcpy(pHandle->reserved, &w, sizeof w);
  RET(CUDA_SUCCESS);
}

CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
  ENTER_INIT("cuIpcOpenMemHandle");
  if (!pdptr || (Flags & ~(unsigned)CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  if (disabled(DIS_LEGACY_IPC))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  ipc_wire w;
  memcpy(&w, handle.reserved, sizeof w);
  if (w.magic != EMU_WIRE_MAGIC || w.kind != HK_DEV || w.pid <= 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  /* The real driver refuses a process's own handle with this error. */
  if (w.pid == E.pid && w.start_time == E.start_time)
    RET(CUDA_ERROR_INVALID_CONTEXT);
  pthread_mutex_lock(&E.mu);
  for (ipc_import *im = imports; im; im = im->next)
    if (im->pid == w.pid && im->id == w.id) {
      im->refs++;
      *pdptr = (CUdeviceptr)im->base;
      pthread_mutex_unlock(&E.mu);
      RET(CUDA_SUCCESS);
    }
  pthread_mutex_unlock(&E.mu);
  shm_hdr h;
  int fd = shm_open_peer(w.pid, w.fd, w.ino, w.dev, HK_DEV, &h);
  if (fd < 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (h.id != w.id || !h.live) {
    close(fd);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  void *p = map_import(fd, h.size, h.owner_addr);
  close(fd);
  if (!p)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  ipc_import *im = calloc(1, sizeof *im);
  if (!im) {
    munmap(p, h.size);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  im->pid = w.pid;
  im->id = w.id;
  im->base = (uintptr_t)p;
  im->map_size = h.size;
  im->refs = 1;
  range r = {.base = im->base,
             .size = h.user_size && h.user_size <= h.size ? h.user_size : h.size,
             .kind = RK_IPC,
             .ordinal = phys_to_ordinal(h.phys, c->ordinal),
             /* The real driver gives an imported mapping a buffer id of the
              * importer's own, not the exporter's (seen on driver 580). */
             .buffer_id = next_id(),
             .prot = PROT_READ | PROT_WRITE, .obj = im};
  pthread_mutex_lock(&E.mu);
  /* Another thread may have opened it meanwhile: keep one mapping. */
  for (ipc_import *o = imports; o; o = o->next)
    if (o->pid == w.pid && o->id == w.id) {
      o->refs++;
      *pdptr = (CUdeviceptr)o->base;
      pthread_mutex_unlock(&E.mu);
      munmap(p, h.size);
      free(im);
      RET(CUDA_SUCCESS);
    }
  if (!reg_add(&r)) {
    pthread_mutex_unlock(&E.mu);
    munmap(p, h.size);
    free(im);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  im->next = imports;
  imports = im;
  pthread_mutex_unlock(&E.mu);
  *pdptr = (CUdeviceptr)im->base;
  RET(CUDA_SUCCESS);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  ENTER_INIT("cuIpcCloseMemHandle");
  NEED_CTX(c);
  (void)c;
  pthread_mutex_lock(&E.mu);
  for (ipc_import **pp = &imports; *pp; pp = &(*pp)->next) {
    ipc_import *im = *pp;
    if (im->base != (uintptr_t)dptr)
      continue;
    if (--im->refs == 0) {
      *pp = im->next;
      reg_del(im->base, im);
      /* Like a freed allocation: the pages go, the address range stays
       * reserved for reuse, and stray work still in flight on it touches
       * junk rather than faulting the process. */
      mmap((void *)im->base, im->map_size, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
      addr_cache_put(im->base, im->map_size);
      free(im);
    }
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_SUCCESS);
  }
  pthread_mutex_unlock(&E.mu);
  RET(CUDA_ERROR_INVALID_VALUE);
}

/* ---- IPC events -------------------------------------------------------------- */

static CUresult event_make_shared(emu_event *e) {
  shm_hdr h = {.magic = EMU_HDR_MAGIC, .kind = HK_EVENT, .owner_pid = E.pid,
               .size = 0, .id = e->id, .live = 1};
  int fd = shm_create(0, &h, &e->ino, &e->dev);
  if (fd < 0)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void *m = mmap(NULL, EMU_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  e->fd = fd;
  e->map = m;
  e->st = (ev_state *)((char *)m + 256);
  e->st->magic = EV_STATE_MAGIC;
  e->st->id = e->id;
  return CUDA_SUCCESS;
}

CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event) {
  ENTER_INIT("cuIpcGetEventHandle");
  if (!pHandle)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_event *e = event_from(event);
  if (!e)
    RET(CUDA_ERROR_INVALID_HANDLE);
  if (disabled(DIS_IPC_EVENT))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (!(e->flags & CU_EVENT_INTERPROCESS) || e->imported)
    RET(CUDA_ERROR_INVALID_VALUE);
  ipc_wire w;
  memset(&w, 0, sizeof w);
  w.magic = EMU_WIRE_MAGIC;
  w.kind = HK_EVENT;
  w.pid = E.pid;
  w.fd = e->fd;
  w.ino = e->ino;
  w.dev = e->dev;
  w.id = e->id;
  w.start_time = E.start_time;
  memcpy(pHandle->reserved, &w, sizeof w);
  RET(CUDA_SUCCESS);
}

CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
  ENTER_INIT("cuIpcOpenEventHandle");
  if (!phEvent)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  if (disabled(DIS_IPC_EVENT))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  ipc_wire w;
  memcpy(&w, handle.reserved, sizeof w);
  if (w.magic != EMU_WIRE_MAGIC || w.kind != HK_EVENT || w.pid <= 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (w.pid == E.pid && w.start_time == E.start_time)
    RET(CUDA_ERROR_INVALID_CONTEXT);
  shm_hdr h;
  int fd = shm_open_peer(w.pid, w.fd, w.ino, w.dev, HK_EVENT, &h);
  if (fd < 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (h.id != w.id || !h.live) {
    close(fd);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  void *m = mmap(NULL, EMU_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  emu_event *e = event_alloc(c, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
  if (!e) {
    munmap(m, EMU_PAGE);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  e->imported = true;
  e->map = m;
  e->st = (ev_state *)((char *)m + 256);
  e->id = w.id;
  if (!hs_add(&live_events, e)) {
    ev_unref(e);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *phEvent = (CUevent)e;
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* pointer attributes                                                        */
/* ======================================================================== */

static size_t attr_size(int a) {
  switch (a) {
  case CU_POINTER_ATTRIBUTE_CONTEXT:
  case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
  case CU_POINTER_ATTRIBUTE_HOST_POINTER:
  case CU_POINTER_ATTRIBUTE_BUFFER_ID:
  case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
  case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
  case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
  case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE:
  case CU_POINTER_ATTRIBUTE_MAPPING_SIZE:
  case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
  case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
    return 8;
  case CU_POINTER_ATTRIBUTE_P2P_TOKENS:
    return sizeof(CUDA_POINTER_ATTRIBUTE_P2P_TOKENS);
  default:
    return 4; /* unsigned int, int, and the booleans (written as int) */
  }
}

static void *range_pool(const range *r); /* pools, below */

/* One attribute of a known range. Booleans are written as int, as NCCL and
 * the CUDA samples read them. */
static CUresult attr_get(void *data, int a, uintptr_t p, const range *r) {
  bool host = is_host_kind(r->kind);
  uint64_t u64 = 0;
  int i32 = 0;
  bool is64 = attr_size(a) == 8;
  switch (a) {
  case CU_POINTER_ATTRIBUTE_CONTEXT: u64 = (uintptr_t)&E.ctx[r->ordinal]; break;
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: i32 = host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE; break;
  case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: u64 = p; break;
  case CU_POINTER_ATTRIBUTE_HOST_POINTER:
    if (!host)
      return CUDA_ERROR_INVALID_VALUE;
    u64 = p;
    break;
  case CU_POINTER_ATTRIBUTE_P2P_TOKENS: return CUDA_ERROR_NOT_SUPPORTED;
  case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: i32 = 0; break;
  case CU_POINTER_ATTRIBUTE_BUFFER_ID: u64 = r->buffer_id; break;
  case CU_POINTER_ATTRIBUTE_IS_MANAGED: i32 = 0; break;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: i32 = r->ordinal; break;
  case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: i32 = r->kind == RK_DEV; break;
  case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: u64 = r->base; break;
  case CU_POINTER_ATTRIBUTE_RANGE_SIZE: u64 = r->size; break;
  case CU_POINTER_ATTRIBUTE_MAPPED: i32 = 1; break;
  case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: u64 = r->handle_types; break;
  case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: i32 = 0; break;
  case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS:
    i32 = (r->prot & PROT_WRITE) ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE
          : (r->prot & PROT_READ) ? CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ
                                  : CU_POINTER_ATTRIBUTE_ACCESS_FLAG_NONE;
    break;
  case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: u64 = (uintptr_t)range_pool(r); break;
  case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: u64 = r->size; break;
  case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: u64 = r->base; break;
  case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID: u64 = r->buffer_id; break;
  case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE: i32 = 0; break;
  default: return CUDA_ERROR_INVALID_VALUE;
  }
  if (is64)
    memcpy(data, &u64, 8);
  else
    memcpy(data, &i32, 4);
  return CUDA_SUCCESS;
}

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  ENTER_INIT("cuPointerGetAttribute");
  if (!data)
    RET(CUDA_ERROR_INVALID_VALUE);
  range r;
  if (!reg_find(ptr, &r))
    RET(CUDA_ERROR_INVALID_VALUE);
  RET(attr_get(data, (int)attribute, ptr, &r));
}

CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes,
                                void **data, CUdeviceptr ptr) {
  ENTER_INIT("cuPointerGetAttributes");
  if (numAttributes == 0 || !attributes || !data)
    RET(CUDA_ERROR_INVALID_VALUE);
  range r;
  bool known = reg_find(ptr, &r);
  for (unsigned i = 0; i < numAttributes; i++) {
    int a = (int)attributes[i];
    if (a <= 0 || a > CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE)
      RET(CUDA_ERROR_INVALID_VALUE);
    if (!data[i])
      continue;
    /* Unlike the singular call, an unknown pointer is not an error: every
     * attribute takes its null value (the device ordinal -2, as the runtime
     * reports for unregistered memory). */
    if (!known || attr_get(data[i], a, ptr, &r) != CUDA_SUCCESS) {
      memset(data[i], 0, attr_size(a));
      if (a == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL && !known) {
        int m2 = -2;
        memcpy(data[i], &m2, 4);
      }
    }
  }
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* memory pools                                                              */
/* ======================================================================== */

/* A pool is one memfd (sparse, as large as its maximum size) mapped at one
 * address; its blocks are sub-allocated first-fit. Exporting the pool hands
 * out a dup of the memfd; an importer maps all of it (at another address)
 * and finds an exported block by its offset. As with the real driver, a
 * freed block stays readable through an import (stale data), and an
 * importer's mapping outlives the exporter's pool. */
#define POOL_ALIGN ((size_t)512)

typedef struct pool_block {
  uintptr_t off;
  size_t size; /* rounded to POOL_ALIGN */
  size_t req;  /* the size asked for: the pointer's range */
  uint64_t id;
  int refs; /* imported pointers: one per import of the same block */
  bool pending_free;
  struct pool_block *next;
} pool_block;

typedef struct emu_pool {
  uint32_t magic;
  bool imported, destroyed, is_default;
  bool exported; /* cuMemPoolExportToShareableHandle succeeded once */
  int ordinal, phys;
  int fd;
  uint64_t ino, dev, id;
  uintptr_t base;
  size_t cap;
  CUmemPoolProps props;
  uint64_t threshold;
  int reuse[3];
  uint64_t reserved, reserved_high, used, used_high;
  int access[EMU_MAX_DEV];
  pool_block *blocks;  /* own pool: live blocks, sorted by offset */
  pool_block *iptrs;   /* imported pool: imported pointers */
  struct emu_pool *next;
} emu_pool;
#define POOL_MAGIC 0x504f4f4cu

static emu_pool *pools; /* E.mu */

/* What cuMemPoolExportPointer writes: 48 bytes, like the real driver (580),
 * which fills only the first 48 of CUmemPoolPtrExportData's 64 bytes and
 * leaves the rest as the caller had them. */
typedef struct pool_wire {
  uint32_t magic, dev; /* dev: the memfd's st_dev, truncated */
  uint64_t ino, pool_id, off, size, id;
} pool_wire;
_Static_assert(sizeof(pool_wire) == 48, "pool export data: 48 bytes");

static void *range_pool(const range *r) {
  return r->kind == RK_POOL || r->kind == RK_POOL_IMPORT ? r->pool : NULL;
}

static emu_pool *pool_from(CUmemoryPool h) { /* E.mu held */
  for (emu_pool *p = pools; p; p = p->next)
    if (p == (emu_pool *)h && p->magic == POOL_MAGIC && !p->destroyed)
      return p;
  return NULL;
}

static void pool_release(emu_pool *p) { /* E.mu held; unlinks and frees */
  for (emu_pool **pp = &pools; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  if (!p->imported)
    mem_uncharge(p->ordinal, p->reserved);
  munmap((void *)p->base, p->cap);
  if (p->fd >= 0)
    close(p->fd);
  p->magic = 0;
  free(p);
}

/* Reserved memory is counted in 2 MiB chunks up to the end of the highest
 * block; trimming gives back what lies beyond both that and `keep`. */
static void pool_trim(emu_pool *p, uint64_t keep) { /* E.mu held */
  uintptr_t end = 0;
  for (pool_block *b = p->blocks; b; b = b->next)
    if (b->off + b->size > end)
      end = b->off + b->size;
  uint64_t need = round_up(end, EMU_GRAN);
  uint64_t k = round_up(keep, EMU_GRAN);
  uint64_t target = p->reserved < k ? p->reserved : k;
  if (target < need)
    target = need;
  if (target < p->reserved) {
    mem_uncharge(p->ordinal, p->reserved - target);
    p->reserved = target;
  }
}

/* At synchronization points the driver releases pool memory above each
 * pool's release threshold. */
static void pools_sync_trim(void) {
  pthread_mutex_lock(&E.mu);
  for (emu_pool *p = pools; p; p = p->next)
    if (!p->imported && p->reserved > p->threshold)
      pool_trim(p, p->threshold);
  pthread_mutex_unlock(&E.mu);
}

static void pool_block_remove(emu_pool *p, pool_block *blk) { /* E.mu held */
  for (pool_block **pp = &p->blocks; *pp; pp = &(*pp)->next)
    if (*pp == blk) {
      *pp = blk->next;
      break;
    }
  p->used -= blk->size;
  free(blk);
  if (p->destroyed && !p->blocks)
    pool_release(p);
}

static void pool_iptr_remove(emu_pool *p, pool_block *ip) { /* E.mu held */
  if (--ip->refs > 0)
    return;
  reg_del(p->base + ip->off, ip);
  for (pool_block **pp = &p->iptrs; *pp; pp = &(*pp)->next)
    if (*pp == ip) {
      *pp = ip->next;
      break;
    }
  free(ip);
}

/* A stream reached a cuMemFreeAsync. */
static void pool_free_op(void *pool, void *blk) {
  emu_pool *p = pool;
  pthread_mutex_lock(&E.mu);
  if (p->imported)
    pool_iptr_remove(p, blk);
  else
    pool_block_remove(p, blk);
  pthread_mutex_unlock(&E.mu);
}

static CUresult pool_free_now(uintptr_t ptr, const range *r) {
  pthread_mutex_lock(&E.mu);
  emu_pool *p = r->pool;
  if (r->kind == RK_POOL_IMPORT) {
    pool_iptr_remove(p, r->obj);
  } else {
    if (!reg_del(ptr, r->obj)) {
      pthread_mutex_unlock(&E.mu);
      return CUDA_ERROR_INVALID_VALUE;
    }
    pool_block_remove(p, r->obj);
  }
  pthread_mutex_unlock(&E.mu);
  return CUDA_SUCCESS;
}

static CUresult check_location(const CUmemLocation *loc) {
  if (loc->type == CU_MEM_LOCATION_TYPE_HOST || loc->type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
      loc->type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)
    return CUDA_ERROR_NOT_SUPPORTED;
  if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE)
    return CUDA_ERROR_INVALID_VALUE;
  if (!dev_ok(loc->id))
    return CUDA_ERROR_INVALID_DEVICE;
  return CUDA_SUCCESS;
}

static CUresult pool_new(const CUmemPoolProps *poolProps, emu_pool **out);

CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
  ENTER_INIT("cuMemPoolCreate");
  if (!pool || !poolProps)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_MEMPOOL))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED)
    RET(CUDA_ERROR_INVALID_VALUE);
  CUresult r = check_location(&poolProps->location);
  if (r != CUDA_SUCCESS)
    RET(r == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_VALUE : r);
  unsigned ht = (unsigned)poolProps->handleTypes;
  if (ht & ~(unsigned)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC))
    RET(ht & (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT)
            ? CUDA_ERROR_NOT_SUPPORTED
            : CUDA_ERROR_INVALID_VALUE);
  if (ht & CU_MEM_HANDLE_TYPE_FABRIC) {
    r = fabric_refusal(fabric_pools());
    if (r != CUDA_SUCCESS)
      RET(r);
  }
  if ((ht & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) &&
      (disabled(DIS_MEMPOOL_IPC) || disabled(DIS_POSIX_FD)))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (poolProps->win32SecurityAttributes)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_pool *p = NULL;
  r = pool_new(poolProps, &p);
  if (r == CUDA_SUCCESS)
    *pool = (CUmemoryPool)p;
  RET(r);
}

static CUresult pool_new(const CUmemPoolProps *poolProps, emu_pool **out) {
  unsigned ht = (unsigned)poolProps->handleTypes;
  emu_pool *p = calloc(1, sizeof *p);
  if (!p)
    return CUDA_ERROR_OUT_OF_MEMORY;
  p->magic = POOL_MAGIC;
  p->ordinal = poolProps->location.id;
  p->phys = E.vis[p->ordinal];
  p->props = *poolProps;
  p->cap = poolProps->maxSize ? round_up(poolProps->maxSize, EMU_GRAN) : E.total_mem;
  if (p->cap > E.total_mem)
    p->cap = E.total_mem;
  p->id = next_id();
  p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
  shm_hdr h = {.magic = EMU_HDR_MAGIC, .kind = HK_POOL, .owner_pid = E.pid,
               .phys = (uint32_t)p->phys, .size = p->cap, .id = p->id,
               .handle_types = ht, .live = 1};
  p->fd = shm_create(p->cap, &h, &p->ino, &p->dev);
  if (p->fd < 0) {
    free(p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  void *m = mmap(NULL, p->cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, p->fd,
                 (off_t)EMU_PAGE);
  if (m == MAP_FAILED) {
    close(p->fd);
    free(p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  p->base = (uintptr_t)m;
  h.owner_addr = p->base;
  shm_set_field(p->fd, offsetof(shm_hdr, owner_addr), &h.owner_addr, sizeof h.owner_addr);
  pthread_mutex_lock(&E.mu);
  p->next = pools;
  pools = p;
  pthread_mutex_unlock(&E.mu);
  *out = p;
  return CUDA_SUCCESS;
}

/* Each device's default pool (no shareable handle type), made on first use;
 * it cannot be destroyed. cuDeviceSetMemPool is not emulated: the current
 * pool is the default pool. */
static emu_pool *default_pool[EMU_MAX_DEV];
static pthread_mutex_t default_pool_mu = PTHREAD_MUTEX_INITIALIZER;

static CUresult get_default_pool(int ord, emu_pool **out) {
  pthread_mutex_lock(&default_pool_mu);
  CUresult r = CUDA_SUCCESS;
  if (!default_pool[ord]) {
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ord;
    r = pool_new(&props, &default_pool[ord]);
    if (r == CUDA_SUCCESS)
      default_pool[ord]->is_default = true;
  }
  *out = default_pool[ord];
  pthread_mutex_unlock(&default_pool_mu);
  return r;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
  ENTER_INIT("cuDeviceGetDefaultMemPool");
  if (!pool_out)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  if (disabled(DIS_MEMPOOL))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  emu_pool *p;
  CUresult r = get_default_pool(dev, &p);
  if (r == CUDA_SUCCESS)
    *pool_out = (CUmemoryPool)p;
  RET(r);
}

CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
  ENTER_INIT("cuDeviceGetMemPool");
  if (!pool)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (!dev_ok(dev))
    RET(CUDA_ERROR_INVALID_DEVICE);
  if (disabled(DIS_MEMPOOL))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  emu_pool *p;
  CUresult r = get_default_pool(dev, &p);
  if (r == CUDA_SUCCESS)
    *pool = (CUmemoryPool)p;
  RET(r);
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
  ENTER_INIT("cuMemPoolDestroy");
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  if (!p || p->is_default) {
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  if (p->imported) {
    /* The real driver (580, H200) refuses to destroy an imported pool with
     * CUDA_ERROR_INVALID_VALUE while pointers imported from it are live, and
     * accepts it once none are. The emulator keeps the import itself, so a
     * later import of the same pool finds it again. */
    bool live = p->iptrs != NULL;
    pthread_mutex_unlock(&E.mu);
    RET(live ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS);
  }
  /* As in CUDA, outstanding allocations keep the memory until freed. */
  p->destroyed = true;
  if (!p->blocks)
    pool_release(p);
  pthread_mutex_unlock(&E.mu);
  RET(CUDA_SUCCESS);
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
  ENTER_INIT("cuMemPoolSetAttribute");
  if (!value)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  CUresult r = CUDA_SUCCESS;
  if (!p) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    uint64_t v64;
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES] = *(int *)value != 0;
      break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
      memcpy(&p->threshold, value, 8);
      break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH:
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
      /* Only a reset to 0 (which sets the high mark to the current value). */
      memcpy(&v64, value, 8);
      if (v64 != 0)
        r = CUDA_ERROR_INVALID_VALUE;
      else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
        p->reserved_high = p->reserved;
      else
        p->used_high = p->used;
      break;
    default:
      r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
  ENTER_INIT("cuMemPoolGetAttribute");
  if (!value)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  CUresult r = CUDA_SUCCESS;
  if (!p) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    uint64_t v = 0;
    switch (attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
      *(int *)value = p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
      break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: v = p->threshold; memcpy(value, &v, 8); break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: v = p->reserved; memcpy(value, &v, 8); break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: v = p->reserved_high; memcpy(value, &v, 8); break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: v = p->used; memcpy(value, &v, 8); break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH: v = p->used_high; memcpy(value, &v, 8); break;
    default: r = CUDA_ERROR_INVALID_VALUE;
    }
  }
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count) {
  ENTER_INIT("cuMemPoolSetAccess");
  if (!map && count)
    RET(CUDA_ERROR_INVALID_VALUE);
  for (size_t i = 0; i < count; i++) {
    CUresult r = check_location(&map[i].location);
    if (r != CUDA_SUCCESS)
      RET(r == CUDA_ERROR_NOT_SUPPORTED ? CUDA_ERROR_INVALID_VALUE : r);
    if (map[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
        map[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      RET(CUDA_ERROR_INVALID_VALUE);
  }
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  CUresult r = CUDA_SUCCESS;
  if (!p) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++) {
      int d = map[i].location.id;
      if (d != p->ordinal && disabled(DIS_PEER))
        r = CUDA_ERROR_INVALID_DEVICE;
      else if (d == p->ordinal && !p->imported && map[i].flags == CU_MEM_ACCESS_FLAGS_PROT_NONE)
        r = CUDA_ERROR_INVALID_VALUE; /* the owner's access cannot be revoked */
    }
    for (size_t i = 0; i < count && r == CUDA_SUCCESS; i++)
      p->access[map[i].location.id] = map[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

CUresult cuMemPoolGetAccess(CUmemAccess_flags *flags, CUmemoryPool memPool, CUmemLocation *location) {
  ENTER_INIT("cuMemPoolGetAccess");
  if (!flags || !location)
    RET(CUDA_ERROR_INVALID_VALUE);
  CUresult r = check_location(location);
  if (r != CUDA_SUCCESS)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(memPool);
  if (!p) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    bool rw = (location->id == p->ordinal && !p->imported) || p->access[location->id];
    *flags = rw ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  }
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
  ENTER_INIT("cuMemPoolTrimTo");
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  if (p && !p->imported)
    pool_trim(p, minBytesToKeep);
  pthread_mutex_unlock(&E.mu);
  RET(p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemPoolExportToShareableHandle(void *handle_out, CUmemoryPool pool,
                                          CUmemAllocationHandleType handleType,
                                          unsigned long long flags) {
  ENTER_INIT("cuMemPoolExportToShareableHandle");
  if (!handle_out || flags)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (handleType == CU_MEM_HANDLE_TYPE_FABRIC && !fabric_pools())
    RET(CUDA_ERROR_NOT_SUPPORTED);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  CUresult r = CUDA_SUCCESS;
  if (p && !p->imported && handleType == CU_MEM_HANDLE_TYPE_FABRIC &&
      (p->props.handleTypes & CU_MEM_HANDLE_TYPE_FABRIC)) {
    /* The pool's memfd stays open while the pool lives: the handle names
     * it, as a legacy handle names an allocation's. */
    ipc_wire w;
    memset(&w, 0, sizeof w);
    w.magic = EMU_WIRE_MAGIC;
    w.kind = HK_POOL;
    w.pid = E.pid;
    w.fd = p->fd;
    w.ino = p->ino;
    w.dev = p->dev;
    w.id = p->id;
    w.start_time = E.start_time;
    memcpy(handle_out, &w, sizeof w);
    p->exported = true;
  } else if (!p || p->imported || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
             !(p->props.handleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      *(int *)handle_out = fd;
      p->exported = true;
    }
  }
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

/* Imports the pool whose memfd fd is (a descriptor received, or one opened
 * through the exporter's /proc entry for a fabric handle). */
static CUresult pool_import_fd(int fd, CUmemoryPool *pool_out) {
  struct stat st;
  shm_hdr h;
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || h.magic != EMU_HDR_MAGIC ||
      h.kind != HK_POOL || (uint64_t)st.st_size < EMU_PAGE + h.size)
    return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&E.mu);
  /* The same pool, through whatever descriptor, is imported once. */
  for (emu_pool *p = pools; p; p = p->next)
    if (p->imported && p->ino == (uint64_t)st.st_ino && p->dev == (uint64_t)st.st_dev) {
      *pool_out = (CUmemoryPool)p;
      pthread_mutex_unlock(&E.mu);
      return CUDA_SUCCESS;
    }
  pthread_mutex_unlock(&E.mu);
  emu_pool *p = calloc(1, sizeof *p);
  if (!p)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void *m = map_import(fd, h.size, h.owner_addr);
  if (!m) {
    free(p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  p->magic = POOL_MAGIC;
  p->imported = true;
  p->fd = -1;
  p->ino = (uint64_t)st.st_ino;
  p->dev = (uint64_t)st.st_dev;
  p->id = h.id;
  p->base = (uintptr_t)m;
  p->cap = h.size;
  p->phys = (int)h.phys;
  p->ordinal = phys_to_ordinal(h.phys, 0);
  p->props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->props.handleTypes = (CUmemAllocationHandleType)h.handle_types;
  p->props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p->props.location.id = p->ordinal;
  p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
  pthread_mutex_lock(&E.mu);
  for (emu_pool *o = pools; o; o = o->next)
    if (o->imported && o->ino == p->ino && o->dev == p->dev) { /* lost a race */
      *pool_out = (CUmemoryPool)o;
      pthread_mutex_unlock(&E.mu);
      munmap(m, p->cap);
      free(p);
      return CUDA_SUCCESS;
    }
  p->next = pools;
  pools = p;
  pthread_mutex_unlock(&E.mu);
  *pool_out = (CUmemoryPool)p;
  return CUDA_SUCCESS;
}

CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *pool_out, void *handle,
                                            CUmemAllocationHandleType handleType,
                                            unsigned long long flags) {
  ENTER_INIT("cuMemPoolImportFromShareableHandle");
  if (!pool_out || flags)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_MEMPOOL))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (handleType == CU_MEM_HANDLE_TYPE_FABRIC) {
    CUresult r = fabric_refusal(fabric_pools());
    if (r != CUDA_SUCCESS)
      RET(r);
    if (!handle)
      RET(CUDA_ERROR_INVALID_VALUE);
    ipc_wire w;
    memcpy(&w, handle, sizeof w);
    shm_hdr h;
    int fd = w.magic == EMU_WIRE_MAGIC && w.kind == HK_POOL && w.pid > 0
                 ? shm_open_peer(w.pid, w.fd, w.ino, w.dev, HK_POOL, &h)
                 : -1;
    if (fd < 0)
      RET(CUDA_ERROR_INVALID_VALUE);
    r = h.id == w.id && h.live ? pool_import_fd(fd, pool_out) : CUDA_ERROR_INVALID_VALUE;
    close(fd);
    RET(r);
  }
  if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    RET(CUDA_ERROR_INVALID_VALUE);
  RET(pool_import_fd((int)(intptr_t)handle, pool_out));
}

CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *shareData_out, CUdeviceptr ptr) {
  ENTER_INIT("cuMemPoolExportPointer");
  if (!shareData_out)
    RET(CUDA_ERROR_INVALID_VALUE);
  range r;
  /* Only the start of a block of an exportable pool: an interior pointer
   * fails, as on the real driver. */
  if (!reg_find(ptr, &r) || r.kind != RK_POOL || r.base != ptr)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = r.pool;
  pool_block *b = r.obj;
  CUresult res = CUDA_SUCCESS;
  /* The real driver (580) refuses to export a pointer of a pool that was
   * never exported itself (cuMemPoolExportToShareableHandle first). */
  if (!(p->props.handleTypes &
        (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC)) ||
      !p->exported) {
    res = CUDA_ERROR_INVALID_VALUE;
  } else {
    pool_wire w;
    memset(&w, 0, sizeof w);
    w.magic = EMU_WIRE_MAGIC ^ HK_POOL;
    w.dev = (uint32_t)p->dev;
    w.ino = p->ino;
    w.pool_id = p->id;
    w.off = b->off;
    w.size = b->req;
    w.id = b->id;
    memcpy(shareData_out->reserved, &w, sizeof w); /* bytes 48..63 untouched */
  }
  pthread_mutex_unlock(&E.mu);
  RET(res);
}

CUresult cuMemPoolImportPointer(CUdeviceptr *ptr_out, CUmemoryPool pool,
                                CUmemPoolPtrExportData *shareData) {
  ENTER_INIT("cuMemPoolImportPointer");
  if (!ptr_out || !shareData)
    RET(CUDA_ERROR_INVALID_VALUE);
  pool_wire w;
  memcpy(&w, shareData->reserved, sizeof w);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  CUresult r = CUDA_SUCCESS;
  if (!p || !p->imported || w.magic != (EMU_WIRE_MAGIC ^ HK_POOL) ||
      w.ino != p->ino || w.dev != (uint32_t)p->dev || w.pool_id != p->id || w.size == 0 ||
      w.off > p->cap || w.size > p->cap - w.off) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  /* No liveness check: like the real driver, a block its exporter already
   * freed imports fine and reads stale data. */
  for (pool_block *ip = p->iptrs; ip; ip = ip->next)
    if (ip->off == w.off && ip->id == w.id) {
      ip->refs++;
      *ptr_out = (CUdeviceptr)(p->base + ip->off);
      goto out;
    }
  pool_block *ip = calloc(1, sizeof *ip);
  if (!ip) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  ip->off = w.off;
  ip->size = w.size;
  ip->id = w.id;
  ip->refs = 1;
  range rg = {.base = p->base + w.off, .size = w.size, .kind = RK_POOL_IMPORT,
              .ordinal = p->ordinal, .buffer_id = next_id(), /* importer's own */
              .prot = PROT_READ | PROT_WRITE, .obj = ip, .pool = p,
              .handle_types = (uint64_t)p->props.handleTypes};
  if (!reg_add(&rg)) {
    free(ip);
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  ip->next = p->iptrs;
  p->iptrs = ip;
  *ptr_out = (CUdeviceptr)rg.base;
out:
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                 CUstream hStream) {
  ENTER_INIT("cuMemAllocFromPoolAsync");
  if (!dptr || bytesize == 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  size_t size = round_up(bytesize, POOL_ALIGN);
  pthread_mutex_lock(&E.mu);
  emu_pool *p = pool_from(pool);
  if (!p || p->imported) {
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  /* First fit; a freed block's address comes back for the next allocation
   * that fits there, as in the real pool. */
  uintptr_t off = 0;
  pool_block **pp = &p->blocks;
  for (; *pp; pp = &(*pp)->next) {
    if ((*pp)->off >= off && (*pp)->off - off >= size)
      break;
    off = round_up((*pp)->off + (*pp)->size, POOL_ALIGN);
  }
  uint64_t need = round_up(off + size, EMU_GRAN);
  pool_block *b = calloc(1, sizeof *b);
  if (!b || size < bytesize || off + size > p->cap ||
      (need > p->reserved && !mem_charge(p->ordinal, need - p->reserved))) {
    pthread_mutex_unlock(&E.mu);
    free(b);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  if (need > p->reserved)
    p->reserved = need;
  if (p->reserved > p->reserved_high)
    p->reserved_high = p->reserved;
  b->off = off;
  b->size = size;
  b->req = bytesize;
  b->id = next_id();
  b->next = *pp;
  *pp = b;
  p->used += size;
  if (p->used > p->used_high)
    p->used_high = p->used;
  range rg = {.base = p->base + off, .size = bytesize, .kind = RK_POOL, .ordinal = p->ordinal,
              .buffer_id = b->id, .prot = PROT_READ | PROT_WRITE, .obj = b, .pool = p,
              .handle_types = (uint64_t)p->props.handleTypes};
  if (!reg_add(&rg)) {
    pool_block_remove(p, b);
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  pthread_mutex_unlock(&E.mu);
  *dptr = (CUdeviceptr)rg.base;
  RET(CUDA_SUCCESS);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
  ENTER_INIT("cuMemAllocAsync");
  if (!dptr)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_MEMPOOL))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  emu_pool *p;
  r = get_default_pool(s->ctx->ordinal, &p);
  if (r != CUDA_SUCCESS)
    RET(r);
  RET(cuMemAllocFromPoolAsync(dptr, bytesize, (CUmemoryPool)p, hStream));
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
  ENTER_INIT("cuMemFreeAsync");
  emu_stream *s;
  CUresult r = get_stream(hStream, &s);
  if (r != CUDA_SUCCESS)
    RET(r);
  range rg;
  if (!reg_find(dptr, &rg) || rg.base != dptr)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (rg.kind == RK_DEV) { /* allowed for cuMemAlloc memory: frees it now */
    if (!reg_del(rg.base, rg.obj))
      RET(CUDA_ERROR_INVALID_VALUE);
    pthread_mutex_lock(&s->mu);
    uint64_t seq = s->enq;
    pthread_mutex_unlock(&s->mu);
    stream_wait_seq(s, seq);
    dev_free(rg.obj);
    RET(CUDA_SUCCESS);
  }
  if (rg.kind != RK_POOL && rg.kind != RK_POOL_IMPORT)
    RET(CUDA_ERROR_INVALID_VALUE);
  op *o = op_new(OP_POOL_FREE);
  if (!o)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  pthread_mutex_lock(&E.mu);
  if (rg.kind == RK_POOL) {
    /* The pointer is invalid from now on; the block is reused only once the
     * stream has reached the free. */
    if (!reg_del(rg.base, rg.obj)) {
      pthread_mutex_unlock(&E.mu);
      free(o);
      RET(CUDA_ERROR_INVALID_VALUE);
    }
    ((pool_block *)rg.obj)->pending_free = true;
  }
  pthread_mutex_unlock(&E.mu);
  o->u.fr.pool = rg.pool;
  o->u.fr.blk = rg.obj;
  enqueue(s, o);
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* virtual memory management                                                 */
/* ======================================================================== */

/* A physical allocation is a memfd; CUmemGenericAllocationHandle points to
 * its descriptor. It lives while its handle references (cuMemCreate,
 * import, cuMemRetainAllocationHandle) or mappings remain. */
typedef struct emu_phys {
  uint32_t magic;
  int refs; /* E.mu */
  int fd;
  size_t size;
  int ordinal;
  bool imported;
  CUmemAllocationProp prop;
  uint64_t id, buffer_id;
  struct emu_phys *next;
} emu_phys;
#define PHYS_MAGIC 0x50485953u

typedef struct vmm_resv {
  uintptr_t base;
  size_t size;
  struct vmm_resv *next;
} vmm_resv;

typedef struct vmm_map {
  uintptr_t base;
  size_t size;
  emu_phys *phys;
  struct vmm_map *next;
} vmm_map;

static emu_phys *phys_list; /* E.mu */
static vmm_resv *resv_list;
static vmm_map *map_list;

static emu_phys *phys_from(CUmemGenericAllocationHandle h) { /* E.mu held */
  for (emu_phys *p = phys_list; p; p = p->next)
    if ((uintptr_t)p == (uintptr_t)h)
      return p;
  return NULL;
}

static void phys_unref(emu_phys *p) { /* E.mu held */
  if (--p->refs > 0)
    return;
  for (emu_phys **pp = &phys_list; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  if (!p->imported)
    mem_uncharge(p->ordinal, p->size);
  close(p->fd);
  p->magic = 0;
  free(p);
}

static CUresult check_prop(const CUmemAllocationProp *prop) {
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
    return CUDA_ERROR_INVALID_VALUE;
  CUresult r = check_location(&prop->location);
  if (r != CUDA_SUCCESS)
    return r == CUDA_ERROR_INVALID_DEVICE ? CUDA_ERROR_INVALID_DEVICE : r;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option) {
  ENTER_INIT("cuMemGetAllocationGranularity");
  if (!granularity)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_VMM))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  CUresult r = check_prop(prop);
  if (r != CUDA_SUCCESS)
    RET(r);
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    RET(CUDA_ERROR_INVALID_VALUE);
  *granularity = EMU_GRAN;
  RET(CUDA_SUCCESS);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags) {
  ENTER_INIT("cuMemCreate");
  if (!handle || flags)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_VMM))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  CUresult r = check_prop(prop);
  if (r != CUDA_SUCCESS)
    RET(r);
  unsigned ht = (unsigned)prop->requestedHandleTypes;
  if (ht & ~(unsigned)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC))
    RET(ht & (CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT)
            ? CUDA_ERROR_NOT_SUPPORTED
            : CUDA_ERROR_INVALID_VALUE);
  if (ht & CU_MEM_HANDLE_TYPE_FABRIC) {
    r = fabric_refusal(fabric_supported());
    if (r != CUDA_SUCCESS)
      RET(r);
  }
  if ((ht & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) && disabled(DIS_POSIX_FD))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (size == 0 || size % EMU_GRAN)
    RET(CUDA_ERROR_INVALID_VALUE);
  int ord = prop->location.id;
  if (!mem_charge(ord, size))
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  emu_phys *p = calloc(1, sizeof *p);
  if (!p) {
    mem_uncharge(ord, size);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  p->magic = PHYS_MAGIC;
  p->refs = 1;
  p->size = size;
  p->ordinal = ord;
  p->prop = *prop;
  p->id = p->buffer_id = next_id();
  shm_hdr h = {.magic = EMU_HDR_MAGIC, .kind = HK_VMM, .owner_pid = E.pid,
               .phys = (uint32_t)E.vis[ord], .size = size, .id = p->id,
               .buffer_id = p->buffer_id, .handle_types = ht, .live = 1};
  uint64_t ino, dev;
  p->fd = shm_create(size, &h, &ino, &dev);
  if (p->fd < 0) {
    free(p);
    mem_uncharge(ord, size);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  pthread_mutex_lock(&E.mu);
  p->next = phys_list;
  phys_list = p;
  pthread_mutex_unlock(&E.mu);
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
  RET(CUDA_SUCCESS);
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  ENTER_INIT("cuMemRelease");
  pthread_mutex_lock(&E.mu);
  emu_phys *p = phys_from(handle);
  if (p)
    phys_unref(p);
  pthread_mutex_unlock(&E.mu);
  RET(p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType,
                                      unsigned long long flags) {
  ENTER_INIT("cuMemExportToShareableHandle");
  if (!shareableHandle || flags)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (handleType == CU_MEM_HANDLE_TYPE_FABRIC && !fabric_supported())
    RET(CUDA_ERROR_NOT_SUPPORTED);
  pthread_mutex_lock(&E.mu);
  emu_phys *p = phys_from(handle);
  CUresult r = CUDA_SUCCESS;
  if (p && handleType == CU_MEM_HANDLE_TYPE_FABRIC &&
      (p->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC)) {
    /* A fabric handle names the allocation's memfd, which stays open while
     * a handle of this process holds the allocation. An imported
     * allocation's memfd is this process's own descriptor too, so it can
     * be exported onwards. */
    ipc_wire w;
    memset(&w, 0, sizeof w);
    w.magic = EMU_WIRE_MAGIC;
    w.kind = HK_VMM;
    w.pid = E.pid;
    w.fd = p->fd;
    struct stat st;
    if (fstat(p->fd, &st) != 0) {
      r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
      w.ino = (uint64_t)st.st_ino;
      w.dev = (uint64_t)st.st_dev;
      w.id = p->id;
      w.start_time = E.start_time;
      memcpy(shareableHandle, &w, sizeof w);
    }
  } else if (!p || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      !(p->prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
    r = CUDA_ERROR_INVALID_VALUE;
  } else {
    int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 3);
    if (fd < 0)
      r = CUDA_ERROR_OUT_OF_MEMORY;
    else
      *(int *)shareableHandle = fd;
  }
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

/* Imports the VMM allocation whose memfd fd is (a descriptor received, or
 * one opened through the exporter's /proc entry for a fabric handle). */
static CUresult phys_import_fd(int fd, CUmemGenericAllocationHandle *handle) {
  struct stat st;
  shm_hdr h;
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || h.magic != EMU_HDR_MAGIC ||
      h.kind != HK_VMM || (uint64_t)st.st_size < EMU_PAGE + h.size)
    return CUDA_ERROR_INVALID_VALUE;
  emu_phys *p = calloc(1, sizeof *p);
  if (!p)
    return CUDA_ERROR_OUT_OF_MEMORY;
  p->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (p->fd < 0) {
    free(p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  p->magic = PHYS_MAGIC;
  p->refs = 1;
  p->size = h.size;
  p->imported = true;
  p->ordinal = phys_to_ordinal(h.phys, 0);
  p->id = h.id;
  p->buffer_id = h.buffer_id;
  p->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->prop.requestedHandleTypes = (CUmemAllocationHandleType)h.handle_types;
  p->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p->prop.location.id = p->ordinal;
  pthread_mutex_lock(&E.mu);
  p->next = phys_list;
  phys_list = p;
  pthread_mutex_unlock(&E.mu);
  *handle = (CUmemGenericAllocationHandle)(uintptr_t)p;
  return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType) {
  ENTER_INIT("cuMemImportFromShareableHandle");
  if (!handle)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_VMM))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) {
    CUresult r = fabric_refusal(fabric_supported());
    if (r != CUDA_SUCCESS)
      RET(r);
    if (!osHandle)
      RET(CUDA_ERROR_INVALID_VALUE);
    ipc_wire w;
    memcpy(&w, osHandle, sizeof w); /* a CUmemFabricHandle */
    shm_hdr h;
    int fd = w.magic == EMU_WIRE_MAGIC && w.kind == HK_VMM && w.pid > 0
                 ? shm_open_peer(w.pid, w.fd, w.ino, w.dev, HK_VMM, &h)
                 : -1;
    if (fd < 0)
      RET(CUDA_ERROR_INVALID_VALUE);
    r = h.id == w.id ? phys_import_fd(fd, handle) : CUDA_ERROR_INVALID_VALUE;
    close(fd);
    RET(r);
  }
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    RET(CUDA_ERROR_INVALID_VALUE);
  RET(phys_import_fd((int)(intptr_t)osHandle, handle));
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                CUmemGenericAllocationHandle handle) {
  ENTER_INIT("cuMemGetAllocationPropertiesFromHandle");
  if (!prop)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  emu_phys *p = phys_from(handle);
  if (p)
    *prop = p->prop;
  pthread_mutex_unlock(&E.mu);
  RET(p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  ENTER_INIT("cuMemAddressReserve");
  if (!ptr || size == 0 || size % EMU_GRAN || flags ||
      (alignment & (alignment - 1)) != 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  if (disabled(DIS_VMM))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  if (alignment < EMU_GRAN)
    alignment = EMU_GRAN;
  void *m = MAP_FAILED;
  int mf = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  if (addr && addr % alignment == 0) { /* a hint, honoured when free */
    m = mmap((void *)(uintptr_t)addr, size, PROT_NONE, mf | MAP_FIXED_NOREPLACE, -1, 0);
    if (m != MAP_FAILED && (uintptr_t)m != addr) {
      munmap(m, size);
      m = MAP_FAILED;
    }
  }
  if (m == MAP_FAILED) {
    /* The kernel picks the region (sanitizers need that), and each process
     * skips a different number of granules (by its pid) at its start: two
     * processes following the same steps (an exporter and its importer) do
     * not end up with the same addresses even without address-space
     * randomization. The real driver's addresses often coincide between
     * processes; code must depend on neither. */
    size_t pad = (size_t)(((uint32_t)E.pid * 2654435761u) >> 24) * EMU_GRAN;
    if (size > SIZE_MAX - alignment - pad)
      RET(CUDA_ERROR_OUT_OF_MEMORY);
    size_t span = size + alignment + pad;
    char *raw = mmap(NULL, span, PROT_NONE, mf, -1, 0);
    if (raw == MAP_FAILED)
      RET(CUDA_ERROR_OUT_OF_MEMORY);
    uintptr_t b = round_up((uintptr_t)raw + pad, alignment);
    if (b > (uintptr_t)raw)
      munmap(raw, b - (uintptr_t)raw);
    uintptr_t tail = (uintptr_t)raw + span - (b + size);
    if (tail)
      munmap((void *)(b + size), tail);
    m = (void *)b;
  }
  vmm_resv *v = calloc(1, sizeof *v);
  if (!v) {
    munmap(m, size);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  v->base = (uintptr_t)m;
  v->size = size;
  pthread_mutex_lock(&E.mu);
  v->next = resv_list;
  resv_list = v;
  pthread_mutex_unlock(&E.mu);
  *ptr = (CUdeviceptr)v->base;
  RET(CUDA_SUCCESS);
}

static void vmm_unmap_one(vmm_map *m) { /* E.mu held; unlinked by caller */
  reg_del(m->base, m);
  mmap((void *)m->base, m->size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  phys_unref(m->phys);
  free(m);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  ENTER_INIT("cuMemAddressFree");
  pthread_mutex_lock(&E.mu);
  for (vmm_resv **pp = &resv_list; *pp; pp = &(*pp)->next) {
    vmm_resv *v = *pp;
    if (v->base != ptr || v->size != size)
      continue;
    *pp = v->next;
    for (vmm_map **mp = &map_list; *mp;) { /* mappings left behind */
      vmm_map *m = *mp;
      if (m->base >= v->base && m->base < v->base + v->size) {
        *mp = m->next;
        vmm_unmap_one(m);
      } else {
        mp = &m->next;
      }
    }
    munmap((void *)v->base, v->size);
    free(v);
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_SUCCESS);
  }
  pthread_mutex_unlock(&E.mu);
  RET(CUDA_ERROR_INVALID_VALUE);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  ENTER_INIT("cuMemMap");
  if (flags || size == 0 || size % EMU_GRAN || offset % EMU_GRAN || ptr % EMU_GRAN)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  CUresult r = CUDA_SUCCESS;
  emu_phys *p = phys_from(handle);
  vmm_resv *v = resv_list;
  for (; v; v = v->next)
    if (ptr >= v->base && ptr - v->base < v->size)
      break;
  if (!p || offset > p->size || size > p->size - offset || !v ||
      size > v->size - (ptr - v->base)) {
    r = CUDA_ERROR_INVALID_VALUE;
    goto out;
  }
  for (vmm_map *m = map_list; m; m = m->next)
    if (m->base < ptr + size && ptr < m->base + m->size) {
      r = CUDA_ERROR_INVALID_VALUE; /* already mapped */
      goto out;
    }
  vmm_map *m = calloc(1, sizeof *m);
  if (!m) {
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  /* Mapped without access: cuMemSetAccess grants it, as on the device. */
  void *q = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, p->fd,
                 (off_t)(EMU_PAGE + offset));
  if (q == MAP_FAILED) {
    free(m);
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  m->base = ptr;
  m->size = size;
  m->phys = p;
  range rg = {.base = ptr, .size = size, .kind = RK_VMM, .ordinal = p->ordinal,
              .buffer_id = p->buffer_id, .prot = 0, .obj = m,
              .handle_types = (uint64_t)p->prop.requestedHandleTypes};
  if (!reg_add(&rg)) {
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    free(m);
    r = CUDA_ERROR_OUT_OF_MEMORY;
    goto out;
  }
  p->refs++;
  m->next = map_list;
  map_list = m;
out:
  pthread_mutex_unlock(&E.mu);
  RET(r);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  ENTER_INIT("cuMemUnmap");
  if (size == 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  /* The range must consist of whole mappings. */
  size_t covered = 0;
  bool partial = false;
  for (vmm_map *m = map_list; m; m = m->next) {
    if (!(m->base < ptr + size && ptr < m->base + m->size))
      continue;
    if (m->base < ptr || m->base + m->size > ptr + size)
      partial = true;
    covered += m->size;
  }
  if (partial || covered == 0) {
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  for (vmm_map **mp = &map_list; *mp;) {
    vmm_map *m = *mp;
    if (m->base >= ptr && m->base < ptr + size) {
      *mp = m->next;
      vmm_unmap_one(m);
    } else {
      mp = &m->next;
    }
  }
  pthread_mutex_unlock(&E.mu);
  RET(CUDA_SUCCESS);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
  ENTER_INIT("cuMemSetAccess");
  if (!desc || count == 0 || size == 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  int prot = 0;
  for (size_t i = 0; i < count; i++) {
    CUresult r = check_location(&desc[i].location);
    if (r != CUDA_SUCCESS)
      RET(r == CUDA_ERROR_NOT_SUPPORTED ? CUDA_ERROR_INVALID_VALUE : r);
    switch (desc[i].flags) {
    case CU_MEM_ACCESS_FLAGS_PROT_NONE: break;
    case CU_MEM_ACCESS_FLAGS_PROT_READ: prot |= PROT_READ; break;
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: prot |= PROT_READ | PROT_WRITE; break;
    default: RET(CUDA_ERROR_INVALID_VALUE);
    }
  }
  pthread_mutex_lock(&E.mu);
  size_t covered = 0;
  for (vmm_map *m = map_list; m; m = m->next)
    if (m->base >= ptr && m->base + m->size <= ptr + size)
      covered += m->size;
  if (covered != size) {
    pthread_mutex_unlock(&E.mu);
    RET(CUDA_ERROR_INVALID_VALUE);
  }
  for (vmm_map *m = map_list; m; m = m->next)
    if (m->base >= ptr && m->base + m->size <= ptr + size)
      mprotect((void *)m->base, m->size, prot);
  reg_set_prot(ptr, size, prot);
  pthread_mutex_unlock(&E.mu);
  RET(CUDA_SUCCESS);
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
  ENTER_INIT("cuMemRetainAllocationHandle");
  if (!handle)
    RET(CUDA_ERROR_INVALID_VALUE);
  pthread_mutex_lock(&E.mu);
  for (vmm_map *m = map_list; m; m = m->next)
    if ((uintptr_t)addr >= m->base && (uintptr_t)addr - m->base < m->size) {
      m->phys->refs++;
      *handle = (CUmemGenericAllocationHandle)(uintptr_t)m->phys;
      pthread_mutex_unlock(&E.mu);
      RET(CUDA_SUCCESS);
    }
  pthread_mutex_unlock(&E.mu);
  RET(CUDA_ERROR_INVALID_VALUE);
}

/* ======================================================================== */
/* pinned host memory                                                        */
/* ======================================================================== */

typedef struct host_mem {
  uintptr_t base;
  size_t size, map_size;
  unsigned flags;
} host_mem;

static CUresult host_alloc(void **pp, size_t bytesize, unsigned flags, emu_ctx *c) {
  size_t map = round_up(bytesize, EMU_PAGE);
  host_mem *h = calloc(1, sizeof *h);
  if (!h)
    return CUDA_ERROR_OUT_OF_MEMORY;
  void *m = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    free(h);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  h->base = (uintptr_t)m;
  h->size = bytesize;
  h->map_size = map;
  h->flags = flags;
  range r = {.base = h->base, .size = bytesize, .kind = RK_HOST_ALLOC, .ordinal = c->ordinal,
             .buffer_id = next_id(), .prot = PROT_READ | PROT_WRITE, .obj = h,
             .host_flags = flags};
  if (!reg_add(&r)) {
    munmap(m, map);
    free(h);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *pp = m;
  return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
  ENTER_INIT("cuMemHostAlloc");
  if (!pp || bytesize == 0 ||
      (Flags & ~(unsigned)(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP |
                           CU_MEMHOSTALLOC_WRITECOMBINED)))
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  RET(host_alloc(pp, bytesize, Flags, c));
}

CUresult cuMemAllocHost(void **pp, size_t bytesize) {
  ENTER_INIT("cuMemAllocHost");
  if (!pp || bytesize == 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  RET(host_alloc(pp, bytesize, 0, c));
}

CUresult cuMemFreeHost(void *p) {
  ENTER_INIT("cuMemFreeHost");
  range r;
  if (!p || !reg_find((uintptr_t)p, &r) || r.kind != RK_HOST_ALLOC || r.base != (uintptr_t)p ||
      !reg_del(r.base, r.obj))
    RET(CUDA_ERROR_INVALID_VALUE);
  host_mem *h = r.obj;
  munmap((void *)h->base, h->map_size);
  free(h);
  RET(CUDA_SUCCESS);
}

CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
  ENTER_INIT("cuMemHostRegister");
  unsigned ok = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP |
                CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;
  if (!p || bytesize == 0 || (Flags & ~ok))
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  if (disabled(DIS_HOST_REGISTER))
    RET(CUDA_ERROR_NOT_SUPPORTED);
  uintptr_t b = (uintptr_t)p;
  if (b + bytesize < b)
    RET(CUDA_ERROR_INVALID_VALUE);
  range r;
  if (reg_find(b, &r) || reg_find(b + bytesize - 1, &r) || reg_overlaps(b, bytesize)) {
    if (reg_find(b, &r) && !is_host_kind(r.kind))
      RET(CUDA_ERROR_INVALID_VALUE);
    RET(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  }
  /* The whole range must be mapped memory (msync fails with ENOMEM on a
   * hole), as the driver has to pin it. */
  uintptr_t pb = b & ~(uintptr_t)(EMU_PAGE - 1);
  if (msync((void *)pb, round_up(b + bytesize - pb, EMU_PAGE), MS_ASYNC) != 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  host_mem *h = calloc(1, sizeof *h);
  if (!h)
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  h->base = b;
  h->size = bytesize;
  h->flags = Flags;
  range nr = {.base = b, .size = bytesize, .kind = RK_HOST_REG, .ordinal = c->ordinal,
              .buffer_id = next_id(),
              .prot = (Flags & CU_MEMHOSTREGISTER_READ_ONLY) ? PROT_READ : PROT_READ | PROT_WRITE,
              .obj = h, .host_flags = Flags};
  if (!reg_add(&nr)) {
    free(h);
    RET(CUDA_ERROR_OUT_OF_MEMORY);
  }
  RET(CUDA_SUCCESS);
}

CUresult cuMemHostUnregister(void *p) {
  ENTER_INIT("cuMemHostUnregister");
  if (!p)
    RET(CUDA_ERROR_INVALID_VALUE);
  range r;
  if (!reg_find((uintptr_t)p, &r) || r.kind != RK_HOST_REG || r.base != (uintptr_t)p ||
      !reg_del(r.base, r.obj))
    RET(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  free(r.obj);
  RET(CUDA_SUCCESS);
}

CUresult cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
  ENTER_INIT("cuMemHostGetDevicePointer");
  if (!pdptr || !p || Flags != 0)
    RET(CUDA_ERROR_INVALID_VALUE);
  NEED_CTX(c);
  (void)c;
  range r;
  if (!reg_find((uintptr_t)p, &r) || !is_host_kind(r.kind))
    RET(CUDA_ERROR_INVALID_VALUE);
  /* Unified addressing: the device sees pinned memory at its host address. */
  *pdptr = (CUdeviceptr)(uintptr_t)p;
  RET(CUDA_SUCCESS);
}

CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p) {
  ENTER_INIT("cuMemHostGetFlags");
  if (!pFlags)
    RET(CUDA_ERROR_INVALID_VALUE);
  range r;
  if (!reg_find((uintptr_t)p, &r) || r.kind != RK_HOST_ALLOC)
    RET(CUDA_ERROR_INVALID_VALUE);
  *pFlags = r.host_flags;
  RET(CUDA_SUCCESS);
}

/* ======================================================================== */
/* entry points by name                                                      */
/* ======================================================================== */

/* A name the emulator does not implement resolves to a stub that reports
 * CUDA_ERROR_NOT_SUPPORTED and names itself on stderr once: nothing
 * silently pretends to work. */
#define STUB_MAX 100
static const char *stub_names[STUB_MAX];
static atomic_int stub_logged[STUB_MAX];
static int stub_count; /* stub_mu */
static pthread_mutex_t stub_mu = PTHREAD_MUTEX_INITIALIZER;

static CUresult stub_call(int i) {
  if (!atomic_exchange(&stub_logged[i], 1))
    emu_msg("%s is not implemented by the emulator: returning CUDA_ERROR_NOT_SUPPORTED",
            stub_names[i]);
  return CUDA_ERROR_NOT_SUPPORTED;
}

#define STUB1(i)                                                               \
  static CUresult stub_##i(void) { return stub_call(i); }
#define STUB10(a)                                                              \
  STUB1(a##0) STUB1(a##1) STUB1(a##2) STUB1(a##3) STUB1(a##4) STUB1(a##5)      \
  STUB1(a##6) STUB1(a##7) STUB1(a##8) STUB1(a##9)
STUB10() STUB10(1) STUB10(2) STUB10(3) STUB10(4) STUB10(5) STUB10(6) STUB10(7)
STUB10(8) STUB10(9)
#define STUBP(i) (void *)stub_##i,
#define STUBP10(a)                                                             \
  STUBP(a##0) STUBP(a##1) STUBP(a##2) STUBP(a##3) STUBP(a##4) STUBP(a##5)      \
  STUBP(a##6) STUBP(a##7) STUBP(a##8) STUBP(a##9)
static void *const stub_fns[STUB_MAX] = {STUBP10() STUBP10(1) STUBP10(2) STUBP10(3)
                                             STUBP10(4) STUBP10(5) STUBP10(6)
                                                 STUBP10(7) STUBP10(8) STUBP10(9)};

static const char *const cuda_names[] = {
#define EMU_NAME(n) n,
#include "emu_names.h"
#undef EMU_NAME
};

static void *stub_named(const char *name) {
  pthread_mutex_lock(&stub_mu);
  void *fn = NULL;
  for (int i = 0; i < stub_count; i++)
    if (strcmp(stub_names[i], name) == 0)
      fn = stub_fns[i];
  if (!fn && stub_count < STUB_MAX) {
    char *copy = strdup(name);
    if (copy) {
      stub_names[stub_count] = copy;
      fn = stub_fns[stub_count++];
    }
  }
  pthread_mutex_unlock(&stub_mu);
  return fn;
}

static bool is_cuda_name(const char *name) {
  for (size_t i = 0; i < sizeof cuda_names / sizeof cuda_names[0]; i++)
    if (strcmp(cuda_names[i], name) == 0)
      return true;
  return false;
}

/* ---- variants by CUDA version ------------------------------------------- */

/* Every variant of every entry point, with the CUDA version that introduced
 * it (cudaTypedefs.h), and which variant each plain name means in cuda.h. */
static const struct { const char *name; int version; } pfn_versions[] = {
#define EMU_PFN(n, v) {n, v},
#include "emu_pfn.h"
#undef EMU_PFN
    {NULL, 0}};
static const struct { const char *name; int k; } cuda_h_variant[] = {
#define EMU_VARIANT(n, k) {n, k},
#include "emu_variants.h"
#undef EMU_VARIANT
    {NULL, 0}};

/* The sorted, distinct versions of name's variants; returns how many. */
static int variant_versions(const char *name, int *out, int cap) {
  int n = 0;
  for (size_t i = 0; pfn_versions[i].name; i++) {
    if (strcmp(pfn_versions[i].name, name) != 0)
      continue;
    int v = pfn_versions[i].version, j = 0;
    while (j < n && out[j] < v)
      j++;
    if ((j < n && out[j] == v) || n == cap)
      continue;
    memmove(&out[j + 1], &out[j], (size_t)(n - j) * sizeof *out);
    out[j] = v;
    n++;
  }
  return n;
}

/* The version of the variant that the plain name means in cuda.h: the one
 * the emulator's function of that name implements. */
static int header_variant_version(const char *name, const int *vers, int n) {
  int k = 1;
  for (size_t i = 0; cuda_h_variant[i].name; i++)
    if (strcmp(cuda_h_variant[i].name, name) == 0 && cuda_h_variant[i].k > k)
      k = cuda_h_variant[i].k;
  return n == 0 ? 0 : vers[(k <= n ? k : n) - 1];
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                          CUdriverProcAddressQueryResult *symbolStatus);

/* Each name maps to the variant cuda.h selects at this CUDA_VERSION (the
 * macro expands &cuMemAlloc to &cuMemAlloc_v2), which is the one a caller
 * built against the same header asks for. */
#define EMU_FN(name) {#name, (void *)&name},
static const struct { const char *name; void *fn; } emu_fns[] = {
    EMU_FN(cuInit) EMU_FN(cuDriverGetVersion) EMU_FN(cuGetErrorName)
    EMU_FN(cuGetErrorString) EMU_FN(cuGetProcAddress)
    EMU_FN(cuDeviceGet) EMU_FN(cuDeviceGetCount) EMU_FN(cuDeviceGetName)
    EMU_FN(cuDeviceGetUuid) EMU_FN(cuDeviceGetAttribute) EMU_FN(cuDeviceTotalMem)
    EMU_FN(cuDeviceGetPCIBusId) EMU_FN(cuDeviceGetByPCIBusId)
    EMU_FN(cuDeviceCanAccessPeer) EMU_FN(cuDeviceGetP2PAttribute)
    EMU_FN(cuDevicePrimaryCtxRetain) EMU_FN(cuDevicePrimaryCtxRelease)
    EMU_FN(cuDevicePrimaryCtxGetState)
    EMU_FN(cuCtxGetCurrent) EMU_FN(cuCtxSetCurrent) EMU_FN(cuCtxPushCurrent)
    EMU_FN(cuCtxPopCurrent) EMU_FN(cuCtxGetDevice) EMU_FN(cuCtxSynchronize)
    EMU_FN(cuCtxEnablePeerAccess) EMU_FN(cuCtxDisablePeerAccess)
    EMU_FN(cuCtxGetFlags) EMU_FN(cuCtxGetApiVersion) EMU_FN(cuDevicePrimaryCtxSetFlags)
    EMU_FN(cuCtxGetStreamPriorityRange) EMU_FN(cuStreamGetCtx) EMU_FN(cuStreamGetPriority)
    EMU_FN(cuDeviceGetDefaultMemPool) EMU_FN(cuDeviceGetMemPool) EMU_FN(cuMemAllocAsync)
    EMU_FN(cuMemAlloc) EMU_FN(cuMemFree) EMU_FN(cuMemGetInfo)
    EMU_FN(cuMemGetAddressRange) EMU_FN(cuPointerGetAttribute)
    EMU_FN(cuPointerGetAttributes)
    EMU_FN(cuMemcpy) EMU_FN(cuMemcpyAsync) EMU_FN(cuMemcpyHtoD) EMU_FN(cuMemcpyDtoH)
    EMU_FN(cuMemcpyDtoD) EMU_FN(cuMemcpyHtoDAsync) EMU_FN(cuMemcpyDtoHAsync)
    EMU_FN(cuMemcpyDtoDAsync) EMU_FN(cuMemcpyPeer) EMU_FN(cuMemcpyPeerAsync)
    EMU_FN(cuMemcpyBatchAsync)
    EMU_FN(cuModuleLoadData) EMU_FN(cuModuleUnload) EMU_FN(cuModuleGetFunction)
    EMU_FN(cuLaunchKernel)
    EMU_FN(cuMemsetD8) EMU_FN(cuMemsetD16) EMU_FN(cuMemsetD32)
    EMU_FN(cuMemsetD8Async) EMU_FN(cuMemsetD16Async) EMU_FN(cuMemsetD32Async)
    EMU_FN(cuIpcGetMemHandle) EMU_FN(cuIpcOpenMemHandle) EMU_FN(cuIpcCloseMemHandle)
    EMU_FN(cuIpcGetEventHandle) EMU_FN(cuIpcOpenEventHandle)
    EMU_FN(cuMemPoolCreate) EMU_FN(cuMemPoolDestroy) EMU_FN(cuMemPoolSetAttribute)
    EMU_FN(cuMemPoolGetAttribute) EMU_FN(cuMemPoolSetAccess) EMU_FN(cuMemPoolGetAccess)
    EMU_FN(cuMemPoolTrimTo) EMU_FN(cuMemPoolExportToShareableHandle)
    EMU_FN(cuMemPoolImportFromShareableHandle) EMU_FN(cuMemPoolExportPointer)
    EMU_FN(cuMemPoolImportPointer) EMU_FN(cuMemAllocFromPoolAsync) EMU_FN(cuMemFreeAsync)
    EMU_FN(cuMemCreate) EMU_FN(cuMemRelease) EMU_FN(cuMemExportToShareableHandle)
    EMU_FN(cuMemImportFromShareableHandle) EMU_FN(cuMemAddressReserve)
    EMU_FN(cuMemAddressFree) EMU_FN(cuMemMap) EMU_FN(cuMemUnmap) EMU_FN(cuMemSetAccess)
    EMU_FN(cuMemGetAllocationGranularity) EMU_FN(cuMemGetAllocationPropertiesFromHandle)
    EMU_FN(cuMemRetainAllocationHandle)
    EMU_FN(cuMemHostAlloc) EMU_FN(cuMemAllocHost) EMU_FN(cuMemFreeHost)
    EMU_FN(cuMemHostRegister) EMU_FN(cuMemHostUnregister)
    EMU_FN(cuMemHostGetDevicePointer) EMU_FN(cuMemHostGetFlags)
    EMU_FN(cuStreamCreate) EMU_FN(cuStreamCreateWithPriority) EMU_FN(cuStreamGetFlags)
    EMU_FN(cuStreamDestroy) EMU_FN(cuStreamSynchronize) EMU_FN(cuStreamQuery)
    EMU_FN(cuStreamWaitEvent) EMU_FN(cuLaunchHostFunc)
    EMU_FN(cuStreamWriteValue32) EMU_FN(cuStreamWriteValue64)
    EMU_FN(cuStreamWaitValue32) EMU_FN(cuStreamWaitValue64)
    EMU_FN(cuEventCreate) EMU_FN(cuEventDestroy) EMU_FN(cuEventRecord)
    EMU_FN(cuEventRecordWithFlags) EMU_FN(cuEventQuery) EMU_FN(cuEventSynchronize)
    EMU_FN(cuEventElapsedTime)
};

/* Variants other than the one cuda.h means by the plain name. */
static CUresult gpa_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
static const struct { const char *name; int version; void *fn; } emu_other_variants[] = {
    {"cuCtxSynchronize", 13000, (void *)&cuCtxSynchronize_v2},
    {"cuCtxGetDevice", 13000, (void *)&cuCtxGetDevice_v2},
    {"cuStreamGetCtx", 12050, (void *)&cuStreamGetCtx_v2},
    {"cuEventElapsedTime", 2000, (void *)&cuEventElapsedTime}, /* same contract */
    {"cuGetProcAddress", 11030, (void *)&gpa_v1},
};

/* As the real driver does, cuGetProcAddress returns the variant of a name
 * that was current at the CUDA version asked for: asked at 13000,
 * "cuCtxSynchronize" is cuCtxSynchronize_v2(CUcontext), not the
 * cuCtxSynchronize(void) that cuda.h declares. A caller that asks at the
 * wrong version gets the wrong signature here as on a GPU. */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                          CUdriverProcAddressQueryResult *symbolStatus) {
  ENTER("cuGetProcAddress");
  (void)flags; /* per-thread default stream variants: same functions here */
  if (!symbol || !pfn)
    RET(CUDA_ERROR_INVALID_VALUE);
  *pfn = NULL;
  CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  int vers[32];
  int nv = variant_versions(symbol, vers, 32);
  int mine = header_variant_version(symbol, vers, nv);
  int chosen = mine;
  if (nv > 0) {
    chosen = -1;
    for (int i = 0; i < nv; i++)
      if (vers[i] <= cudaVersion)
        chosen = vers[i];
  }
  if (chosen < 0) {
    st = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
  } else if (disabled(DIS_BATCH_COPY) && strcmp(symbol, "cuMemcpyBatchAsync") == 0) {
    /* A driver older than 12.8 has no such symbol. */
  } else if (chosen == mine) {
    for (size_t i = 0; i < sizeof emu_fns / sizeof emu_fns[0]; i++)
      if (strcmp(emu_fns[i].name, symbol) == 0) {
        *pfn = emu_fns[i].fn;
        break;
      }
    if (!*pfn && is_cuda_name(symbol))
      *pfn = stub_named(symbol);
  } else {
    for (size_t i = 0; i < sizeof emu_other_variants / sizeof emu_other_variants[0]; i++)
      if (strcmp(emu_other_variants[i].name, symbol) == 0 &&
          emu_other_variants[i].version == chosen)
        *pfn = emu_other_variants[i].fn;
    if (!*pfn) {
      char what[128];
      snprintf(what, sizeof what, "%s (its CUDA %d.%d variant)", symbol, chosen / 1000,
               chosen % 1000 / 10);
      *pfn = stub_named(what);
    }
  }
  if (*pfn)
    st = CU_GET_PROC_ADDRESS_SUCCESS;
  if (symbolStatus)
    *symbolStatus = st;
  RET(*pfn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND);
}

/* The CUDA 11 form, without the status argument, under its plain name. */
#undef cuGetProcAddress
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  return gpa_v1(symbol, pfn, cudaVersion, flags);
}

static CUresult gpa_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
