/*
 * descriptor.c: owns the descriptor wire format: encoding, decoding and
 * validating descriptors (hostile input: every field is checked and each
 * failure has its own status), CRC32C, the exporter identity, the check
 * of where a descriptor comes from (another machine, this process, another
 * pid namespace), made with the decode as the first step of every import
 * (gpuipc__desc_open), the opt-in pidfd_getfd route for fetching an
 * exporter's fd, and carrying a descriptor plus its fds over a Unix
 * socket. The format is documented in docs/descriptor.md; keep the two in
 * step.
 */
#include "handle_int.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- CRC32C ----------------------------------------------------------------- */

static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    crc_table[i] = c;
  }
}

static uint32_t crc_soft(uint32_t crc, const uint8_t *p, size_t len) {
  for (size_t i = 0; i < len; i++)
    crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The SSE4.2 crc32 instruction computes CRC32C, 8 bytes at a time: every
 * export and import checksums a descriptor, so this is on the fast path. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc,
                                                         const uint8_t *p,
                                                         size_t len) {
  uint64_t c = crc;
  while (len >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    len -= 8;
  }
  uint32_t c32 = (uint32_t)c;
  while (len--)
    c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
static bool have_hw;
#endif

static void crc_setup(void) {
  crc_init();
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  have_hw = __builtin_cpu_supports("sse4.2");
#endif
}

uint32_t gpuipc__crc32c(uint32_t crc, const void *data, size_t len) {
  pthread_once(&crc_once, crc_setup);
  const uint8_t *p = data;
  crc = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
  if (have_hw)
    return ~crc_hw(crc, p, len);
#endif
  return ~crc_soft(crc, p, len);
}

/* Offsets of version 1 (docs/descriptor.md has the same table). */
enum {
  OFF_MAGIC = 0,
  OFF_VERSION = 4,
  OFF_TYPE = 6,
  OFF_KIND = 7,
  OFF_LENGTH = 8,
  OFF_CRC = 12,
  OFF_NFDS = 16,
  OFF_FLAGS = 17,
  OFF_HANDLE_LEN = 18,
  OFF_EXPORTER_FD = 20,
  OFF_DEVICE = 24,
  OFF_BOOT_ID = 40,
  OFF_PIDNS = 56,
  OFF_PID = 64,
  OFF_RESERVED = 68,
  OFF_START_TIME = 72,
  OFF_POOL_ID = 80,
  OFF_BUFFER_ID = 88,
  OFF_GENERATION = 96,
  OFF_OFFSET = 104,
  OFF_SIZE = 112,
  OFF_ALLOC_SIZE = 120,
  OFF_HANDLE = 128,
  OFF_END = 192,
  /* Appended fields (version 1 keeps them: readers ignore what follows
   * the fields they know). */
  OFF_LIVE_KEY = 192,
  OFF_END_LIVE_KEY = 200
};
_Static_assert(OFF_END == GPUIPC__DESC_V1_LEN, "v1 layout");
_Static_assert(OFF_END_LIVE_KEY == GPUIPC__DESC_LEN, "v1 + live_key");
_Static_assert(GPUIPC__DESC_V1_LEN <= GPUIPC_DESC_MAX, "GPUIPC_DESC_MAX");

gpuipc_status gpuipc__desc_encode(const gpuipc__desc *d, uint8_t *out,
                                  size_t cap, size_t *len) {
  if (cap < GPUIPC__DESC_LEN)
    return gpuipc__fail(GPUIPC_E_LIMIT,
                        "descriptor needs %u bytes, the buffer holds %zu",
                        GPUIPC__DESC_LEN, cap);
  uint8_t *p = out;
  memset(p, 0, GPUIPC__DESC_LEN);
  gpuipc__put_le32(p + OFF_MAGIC, GPUIPC__DESC_MAGIC);
  gpuipc__put_le16(p + OFF_VERSION, GPUIPC__DESC_VERSION);
  p[OFF_TYPE] = d->type;
  p[OFF_KIND] = d->kind;
  gpuipc__put_le32(p + OFF_LENGTH, GPUIPC__DESC_LEN);
  p[OFF_NFDS] = d->nfds;
  p[OFF_FLAGS] = d->flags;
  gpuipc__put_le16(p + OFF_HANDLE_LEN, d->handle_len);
  gpuipc__put_le32(p + OFF_EXPORTER_FD, (uint32_t)d->exporter_fd);
  memcpy(p + OFF_DEVICE, d->device, 16);
  memcpy(p + OFF_BOOT_ID, d->exporter.boot_id, 16);
  gpuipc__put_le64(p + OFF_PIDNS, d->exporter.pidns);
  gpuipc__put_le32(p + OFF_PID, (uint32_t)d->exporter.pid);
  gpuipc__put_le64(p + OFF_START_TIME, d->exporter.start_time);
  gpuipc__put_le64(p + OFF_POOL_ID, d->pool_id);
  gpuipc__put_le64(p + OFF_BUFFER_ID, d->buffer_id);
  gpuipc__put_le64(p + OFF_GENERATION, d->generation);
  gpuipc__put_le64(p + OFF_OFFSET, d->offset);
  gpuipc__put_le64(p + OFF_SIZE, d->size);
  gpuipc__put_le64(p + OFF_ALLOC_SIZE, d->alloc_size);
  if (d->handle_len)
    memcpy(p + OFF_HANDLE, d->handle,
           d->handle_len <= GPUIPC__DESC_HANDLE_BYTES
               ? d->handle_len
               : GPUIPC__DESC_HANDLE_BYTES);
  gpuipc__put_le64(p + OFF_LIVE_KEY, d->live_key);
  gpuipc__put_le32(p + OFF_CRC, gpuipc__crc32c(0, p, GPUIPC__DESC_LEN));
  *len = GPUIPC__DESC_LEN;
  return GPUIPC_OK;
}

static bool kind_ok_for(unsigned type, unsigned kind) {
  switch (type) {
  case GPUIPC_DESC_BUFFER:
    return kind >= GPUIPC_POOL_MEMPOOL && kind <= GPUIPC_POOL_PINNED_HOST;
  case GPUIPC_DESC_POOL:
    return kind == GPUIPC_POOL_MEMPOOL;
  case GPUIPC_DESC_EVENT:
    return kind == GPUIPC__KIND_IPC_EVENT;
  default:
    return false;
  }
}

/* The handle bytes each kind carries, and the fds it may carry. */
static unsigned handle_len_for(unsigned type, unsigned kind) {
  if (type == GPUIPC_DESC_EVENT)
    return 64;
  if (type == GPUIPC_DESC_POOL)
    return 0;
  return (kind == GPUIPC_POOL_LEGACY || kind == GPUIPC_POOL_MEMPOOL) ? 64 : 0;
}
static unsigned max_fds_for(unsigned type, unsigned kind) {
  if (type == GPUIPC_DESC_EVENT || kind == GPUIPC_POOL_LEGACY)
    return 0;
  return 1;
}

gpuipc_status gpuipc__desc_decode(const uint8_t *in, size_t len,
                                  gpuipc__desc *d) {
  if (in == NULL && len > 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "descriptor: NULL bytes");
  /* The order of the checks is part of the format's contract (see
   * docs/descriptor.md): each failure gets its own status. */
  if (len < 4)
    return gpuipc__fail(GPUIPC_E_TRUNCATED,
                        "descriptor truncated: %zu byte(s), not even a magic",
                        len);
  uint32_t magic = gpuipc__get_le32(in + OFF_MAGIC);
  if (magic != GPUIPC__DESC_MAGIC)
    return gpuipc__fail(GPUIPC_E_BAD_MAGIC,
                        "not a gpuipc descriptor (magic 0x%08x, want 0x%08x)",
                        magic, GPUIPC__DESC_MAGIC);
  if (len < OFF_CRC + 4)
    return gpuipc__fail(GPUIPC_E_TRUNCATED,
                        "descriptor truncated: %zu byte(s), header is %d", len,
                        OFF_CRC + 4);
  unsigned version = gpuipc__get_le16(in + OFF_VERSION);
  if (version != GPUIPC__DESC_VERSION)
    return gpuipc__fail(GPUIPC_E_BAD_VERSION,
                        "descriptor format version %u; this library (%s) "
                        "reads version %u",
                        version, GPUIPC_VERSION_STRING, GPUIPC__DESC_VERSION);
  uint32_t declared = gpuipc__get_le32(in + OFF_LENGTH);
  if (declared < GPUIPC__DESC_V1_LEN || declared > GPUIPC_DESC_MAX)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "descriptor declares %u bytes; version %u descriptors "
                        "are %u to %d bytes",
                        declared, version, GPUIPC__DESC_V1_LEN,
                        GPUIPC_DESC_MAX);
  if (declared > len)
    return gpuipc__fail(GPUIPC_E_TRUNCATED,
                        "descriptor truncated: %zu of %u bytes", len,
                        declared);
  if (len != declared)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "%zu bytes given for a descriptor of %u bytes "
                        "(trailing garbage)",
                        len, declared);
  /* The checksum covers the whole descriptor with its own field zeroed. */
  uint32_t want = gpuipc__get_le32(in + OFF_CRC);
  static const uint8_t zero4[4];
  uint32_t crc = gpuipc__crc32c(0, in, OFF_CRC);
  crc = gpuipc__crc32c(crc, zero4, 4);
  crc = gpuipc__crc32c(crc, in + OFF_CRC + 4, declared - (OFF_CRC + 4));
  if (crc != want)
    return gpuipc__fail(GPUIPC_E_BAD_CHECKSUM,
                        "descriptor checksum mismatch (CRC32C 0x%08x, "
                        "carried 0x%08x): corrupted in transit",
                        crc, want);
  gpuipc__desc x;
  memset(&x, 0, sizeof x);
  x.version = (uint16_t)version;
  x.type = in[OFF_TYPE];
  x.kind = in[OFF_KIND];
  x.length = declared;
  if (!kind_ok_for(x.type, x.kind))
    return gpuipc__fail(GPUIPC_E_BAD_KIND,
                        "descriptor of unknown type %u / handle kind %u",
                        x.type, x.kind);
  x.nfds = in[OFF_NFDS];
  x.flags = in[OFF_FLAGS];
  x.handle_len = gpuipc__get_le16(in + OFF_HANDLE_LEN);
  x.exporter_fd = (int32_t)gpuipc__get_le32(in + OFF_EXPORTER_FD);
  memcpy(x.device, in + OFF_DEVICE, 16);
  memcpy(x.exporter.boot_id, in + OFF_BOOT_ID, 16);
  x.exporter.pidns = gpuipc__get_le64(in + OFF_PIDNS);
  x.exporter.pid = (int32_t)gpuipc__get_le32(in + OFF_PID);
  x.exporter.start_time = gpuipc__get_le64(in + OFF_START_TIME);
  x.pool_id = gpuipc__get_le64(in + OFF_POOL_ID);
  x.buffer_id = gpuipc__get_le64(in + OFF_BUFFER_ID);
  x.generation = gpuipc__get_le64(in + OFF_GENERATION);
  x.offset = gpuipc__get_le64(in + OFF_OFFSET);
  x.size = gpuipc__get_le64(in + OFF_SIZE);
  x.alloc_size = gpuipc__get_le64(in + OFF_ALLOC_SIZE);
  memcpy(x.handle, in + OFF_HANDLE, GPUIPC__DESC_HANDLE_BYTES);
  if (declared >= OFF_END_LIVE_KEY)
    x.live_key = gpuipc__get_le64(in + OFF_LIVE_KEY);

  if (x.handle_len != handle_len_for(x.type, x.kind))
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "descriptor carries %u handle bytes; kind %u has %u",
                        x.handle_len, x.kind, handle_len_for(x.type, x.kind));
  for (unsigned i = x.handle_len; i < GPUIPC__DESC_HANDLE_BYTES; i++)
    if (x.handle[i] != 0)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "descriptor: unused handle bytes are not zero");
  if (x.nfds > max_fds_for(x.type, x.kind))
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "descriptor says %u fd(s) travel with it; kind %u "
                        "takes at most %u",
                        x.nfds, x.kind, max_fds_for(x.type, x.kind));
  if (x.flags & ~GPUIPC__DESC_F_ALL)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "descriptor: unknown flags 0x%02x",
                        x.flags);
  if (gpuipc__get_le32(in + OFF_RESERVED) != 0)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "descriptor: reserved field is not zero");
  if (x.exporter.pid <= 0)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "descriptor: exporter pid %d",
                        (int)x.exporter.pid);
  if (x.exporter_fd < -1)
    return gpuipc__fail(GPUIPC_E_PROTOCOL, "descriptor: exporter fd %d",
                        (int)x.exporter_fd);
  if (x.type == GPUIPC_DESC_BUFFER) {
    if (x.size == 0)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE, "descriptor: empty buffer");
    /* Written so that it cannot overflow. */
    if (x.offset > x.alloc_size || x.size > x.alloc_size - x.offset)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "descriptor: offset %llu + size %llu beyond the "
                          "allocation's %llu bytes",
                          (unsigned long long)x.offset,
                          (unsigned long long)x.size,
                          (unsigned long long)x.alloc_size);
    if (x.alloc_size > (uint64_t)SIZE_MAX / 2)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "descriptor: allocation of %llu bytes",
                          (unsigned long long)x.alloc_size);
  }
  *d = x;
  return GPUIPC_OK;
}

/* ---- identity ---------------------------------------------------------------- */

static pthread_mutex_t id_lock = PTHREAD_MUTEX_INITIALIZER;
static gpuipc__identity self_id;
static pid_t self_id_pid; /* the pid self_id was computed for (0: never) */
static pthread_once_t id_once = PTHREAD_ONCE_INIT;

/* A forked child is another process: its identity is computed anew. The
 * lock is held across fork so that the child's copy is never locked. */
static void id_atfork_prepare(void) { pthread_mutex_lock(&id_lock); }
static void id_atfork_parent(void) { pthread_mutex_unlock(&id_lock); }
static void id_atfork_child(void) {
  self_id_pid = 0;
  pthread_mutex_unlock(&id_lock);
}
static void id_register(void) {
  pthread_atfork(id_atfork_prepare, id_atfork_parent, id_atfork_child);
}

gpuipc_status gpuipc__self_identity(gpuipc__identity *id) {
  gpuipc_status s = GPUIPC_OK;
  pthread_once(&id_once, id_register);
  pthread_mutex_lock(&id_lock);
  if (self_id_pid == 0) {
    pid_t me = getpid();
    gpuipc__identity x;
    memset(&x, 0, sizeof x);
    s = gpuipc__boot_id(x.boot_id);
    if (s == GPUIPC_OK) {
      x.pidns = gpuipc__pid_namespace();
      x.pid = (int32_t)me;
      x.start_time = gpuipc__process_start_time((int)me);
      self_id = x;
      self_id_pid = me;
    }
  }
  if (s == GPUIPC_OK)
    *id = self_id;
  pthread_mutex_unlock(&id_lock);
  return s;
}

gpuipc_status gpuipc__desc_set_exporter(gpuipc__desc *d) {
  return gpuipc__self_identity(&d->exporter);
}

bool gpuipc__identity_eq(const gpuipc__identity *a, const gpuipc__identity *b) {
  return memcmp(a->boot_id, b->boot_id, 16) == 0 && a->pidns == b->pidns &&
         a->pid == b->pid && a->start_time == b->start_time;
}

/* Refuses descriptors of another machine (E_FOREIGN_MACHINE), of this very
 * process (E_INVALID_ARG), and of another pid namespace
 * (E_FOREIGN_NAMESPACE), except, over a connection (via), those of the
 * connection's peer whose kind travels by fd: a memory pool's, a VMM
 * allocation's or pinned host memory's file descriptor means the same in
 * every namespace, while the driver opens a legacy memory or event handle
 * by the exporter's pid, which needs one pid namespace. */
static gpuipc_status check_origin(const gpuipc__desc *d,
                                  const gpuipc__via *via) {
  gpuipc__identity me;
  GPUIPC__CHECK(gpuipc__self_identity(&me));
  if (memcmp(me.boot_id, d->exporter.boot_id, 16) != 0)
    return gpuipc__fail(GPUIPC_E_FOREIGN_MACHINE,
                        "descriptor was exported on another machine (or "
                        "before a reboot): its boot id differs from this "
                        "machine's; CUDA IPC works only within one machine");
  /* The namespace is part of the identity: pid 1 of two containers are
   * two processes. */
  if (gpuipc__identity_eq(&me, &d->exporter))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "descriptor was exported by this very process: use "
                        "the exported object itself (the driver refuses to "
                        "open a process's own IPC handles)");
  if (me.pidns == d->exporter.pidns)
    return GPUIPC_OK;
  bool by_fd = d->type != GPUIPC_DESC_EVENT &&
               (d->kind == GPUIPC_POOL_MEMPOOL || d->kind == GPUIPC_POOL_VMM ||
                d->kind == GPUIPC_POOL_PINNED_HOST);
  if (!by_fd)
    return gpuipc__fail(
        GPUIPC_E_FOREIGN_NAMESPACE,
        "%s descriptor was exported in another pid namespace (%llu, this "
        "process is in %llu): the driver opens a legacy CUDA IPC handle by "
        "its exporter's pid, which needs both processes in one pid "
        "namespace (docker --pid=container:<id>, Kubernetes "
        "shareProcessNamespace); share it as a MEMPOOL, VMM or PINNED_HOST "
        "buffer instead, whose fd travels over a connection",
        d->type == GPUIPC_DESC_EVENT ? "an interprocess event's" : "a legacy",
        (unsigned long long)d->exporter.pidns, (unsigned long long)me.pidns);
  if (via != NULL && gpuipc__identity_eq(&via->peer, &d->exporter))
    return GPUIPC_OK;
  return gpuipc__fail(GPUIPC_E_FOREIGN_NAMESPACE,
                      "descriptor was exported in another pid namespace "
                      "(%llu, this process is in %llu) by pid %d there, "
                      "which means nothing here: a %s descriptor is accepted "
                      "from another pid namespace only over a connection to "
                      "its exporter (gpuipc_conn_import_buffer, or the "
                      "connection's own handoff), whose peer the kernel "
                      "vouched for and whose liveness table came with it",
                      (unsigned long long)d->exporter.pidns,
                      (unsigned long long)me.pidns, (int)d->exporter.pid,
                      gpuipc_pool_kind_name((gpuipc_pool_kind)d->kind));
}

/* ---- the pidfd_getfd route ---------------------------------------------------- */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

gpuipc_status gpuipc__pidfd_getfd(const gpuipc__identity *exporter,
                                  int remote_fd, int *out) {
  if (remote_fd < 0)
    return gpuipc__fail(GPUIPC_E_NEED_FD,
                        "the descriptor names no exporter fd to fetch");
  int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)exporter->pid, 0);
  if (pidfd < 0) {
    int err = errno;
    if (err == ESRCH)
      return gpuipc__fail(GPUIPC_E_PEER_GONE,
                          "pidfd_open: exporter process %d is gone",
                          (int)exporter->pid);
    if (err == ENOSYS)
      return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                          "pidfd_open: not supported by this kernel (needs "
                          "Linux 5.3; pidfd_getfd needs 5.6): pass the fds "
                          "with the descriptor instead");
    return gpuipc__fail_errno(err, "pidfd_open", "exporter pid %d",
                              (int)exporter->pid);
  }
  gpuipc_status s = GPUIPC_OK;
  /* The pidfd now pins the process the pid named when it was opened;
   * checking the start time afterwards makes sure that is the exporter and
   * not a later process that reused its pid. */
  if (gpuipc__process_start_time(exporter->pid) != exporter->start_time) {
    s = gpuipc__fail(GPUIPC_E_PEER_GONE,
                     "exporter process %d is gone (its pid now names another "
                     "process)",
                     (int)exporter->pid);
    goto out;
  }
  int fd = (int)syscall(SYS_pidfd_getfd, pidfd, remote_fd, 0);
  if (fd < 0) {
    int err = errno;
    if (err == EPERM || err == EACCES)
      s = gpuipc__fail(
          GPUIPC_E_PERMISSION,
          "pidfd_getfd: %s: this process may not ptrace the exporter (pid "
          "%d): pidfd_getfd needs PTRACE_MODE_ATTACH_REALCREDS permission "
          "(same uid and kernel.yama.ptrace_scope 0, a ptracer relationship, "
          "or CAP_SYS_PTRACE); pass the fds with the descriptor instead",
          err == EPERM ? "EPERM" : "EACCES", (int)exporter->pid);
    else if (err == ESRCH)
      s = gpuipc__fail(GPUIPC_E_PEER_GONE, "pidfd_getfd: exporter %d exited",
                       (int)exporter->pid);
    else if (err == EBADF)
      s = gpuipc__fail(GPUIPC_E_STALE,
                       "pidfd_getfd: the exporter (pid %d) no longer has fd "
                       "%d open: the object was freed",
                       (int)exporter->pid, remote_fd);
    else if (err == ENOSYS)
      s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                       "pidfd_getfd: not supported by this kernel (needs "
                       "Linux 5.6): pass the fds with the descriptor instead");
    else
      s = gpuipc__fail_errno(err, "pidfd_getfd", "exporter pid %d fd %d",
                             (int)exporter->pid, remote_fd);
    goto out;
  }
  *out = fd;
out:
  close(pidfd);
  return s;
}

/* ---- public: decode without opening ------------------------------------------- */

gpuipc_status gpuipc_desc_get_info(const uint8_t *desc, size_t len,
                                   gpuipc_desc_info *info) {
  if (info == NULL || info->size < sizeof(size_t))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_desc_get_info: info NULL or its size unset");
  if (desc == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_desc_get_info: NULL");
  gpuipc__desc d;
  GPUIPC__CHECK(gpuipc__desc_decode(desc, len, &d));
  gpuipc_desc_info x;
  memset(&x, 0, sizeof x);
  x.size = info->size;
  x.type = (gpuipc_desc_type)d.type;
  x.kind = d.type == GPUIPC_DESC_EVENT ? GPUIPC_POOL_AUTO
                                       : (gpuipc_pool_kind)d.kind;
  x.version = d.version;
  x.nfds = d.nfds;
  memcpy(x.device.bytes, d.device, 16);
  x.exporter_pid = d.exporter.pid;
  x.pool_id = d.pool_id;
  x.buffer_id = d.buffer_id;
  x.generation = d.generation;
  x.offset = d.offset;
  x.bytes = d.size;
  x.alloc_bytes = d.alloc_size;
  gpuipc__identity me;
  if (gpuipc__self_identity(&me) == GPUIPC_OK) {
    x.same_machine = memcmp(me.boot_id, d.exporter.boot_id, 16) == 0;
    x.same_namespace = x.same_machine && me.pidns == d.exporter.pidns;
  }
  size_t n = info->size < sizeof x ? info->size : sizeof x;
  memcpy(info, &x, n);
  return GPUIPC_OK;
}

/* ---- public: carrying descriptors over a socket ------------------------------- */

static gpuipc_status send_all(int sock, const uint8_t *p, size_t n,
                              const int *fds, int nfds) {
  bool first = true;
  while (n > 0) {
    struct iovec iov = {(void *)p, n};
    size_t w;
    gpuipc_status s = gpuipc__sock_send(sock, &iov, 1, first ? fds : NULL,
                                        first ? nfds : 0, false, 0, &w);
    if (s == GPUIPC_E_PEER_GONE)
      return gpuipc__fail(GPUIPC_E_CLOSED, "gpuipc_desc_send: peer closed");
    if (s == GPUIPC_E_WOULD_BLOCK)
      return gpuipc__fail(GPUIPC_E_WOULD_BLOCK,
                          "gpuipc_desc_send: the socket is non-blocking and "
                          "full");
    if (s != GPUIPC_OK)
      return gpuipc__fail(s, "gpuipc_desc_send: %s", gpuipc_last_error());
    first = false;
    p += w;
    n -= w;
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc_desc_send(int sock, const uint8_t *desc, size_t len,
                               const int *fds, int nfds) {
  if (sock < 0 || desc == NULL || len == 0 || len > GPUIPC_DESC_MAX ||
      nfds < 0 || nfds > GPUIPC_DESC_MAX_FDS || (nfds > 0 && fds == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_desc_send: bad arguments (len %zu, nfds %d)",
                        len, nfds);
  uint8_t msg[4 + GPUIPC_DESC_MAX];
  gpuipc__put_le32(msg, (uint32_t)len);
  memcpy(msg + 4, desc, len);
  return send_all(sock, msg, 4 + len, fds, nfds);
}

static void close_fds(int *fds, int n) {
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0)
      close(fds[i]);
}

/* Reads exactly n bytes, collecting fds that arrive with any of them (at
 * most cap). Descriptors the kernel dropped, or more than cap, do not stop
 * the read (the stream stays in step, the next message comes whole): the
 * first such failure is kept in *fd_err (none of the message's fds is
 * kept then) and reported by the caller once the message is read. */
static gpuipc_status recv_all(int sock, uint8_t *p, size_t n, int *fds,
                              int *got, int cap, gpuipc_status *fd_err) {
  while (n > 0) {
    size_t r;
    int k = 0;
    gpuipc_status s = gpuipc__sock_recv(sock, p, n, 0, fds + *got, cap - *got,
                                        &k, NULL, NULL, &r);
    *got += k;
    if (s == GPUIPC_E_PROTOCOL || s == GPUIPC_E_LIMIT) {
      if (*fd_err == GPUIPC_OK)
        *fd_err = s == GPUIPC_E_LIMIT
                      ? gpuipc__fail(GPUIPC_E_LIMIT, "gpuipc_desc_recv: %s",
                                     gpuipc_last_error())
                      : gpuipc__fail(GPUIPC_E_LIMIT,
                                     "gpuipc_desc_recv: more file descriptors "
                                     "arrived than the caller has room for "
                                     "(closed)");
      s = GPUIPC_OK;
    }
    if (s == GPUIPC_E_WOULD_BLOCK)
      return gpuipc__fail(GPUIPC_E_WOULD_BLOCK,
                          "gpuipc_desc_recv: the socket is non-blocking and "
                          "empty");
    if (s == GPUIPC_E_PEER_GONE)
      return gpuipc__fail(GPUIPC_E_CLOSED, "gpuipc_desc_recv: peer reset");
    if (s != GPUIPC_OK)
      return gpuipc__fail(s, "gpuipc_desc_recv: %s", gpuipc_last_error());
    if (r == 0)
      return gpuipc__fail(GPUIPC_E_CLOSED, "gpuipc_desc_recv: end of stream");
    p += r;
    n -= r;
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc_desc_recv(int sock, uint8_t *desc, size_t cap,
                               size_t *len, int *fds, int *nfds) {
  if (sock < 0 || desc == NULL || len == NULL ||
      (nfds != NULL && *nfds > 0 && fds == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_desc_recv: NULL");
  int cap_fds = nfds ? *nfds : 0;
  if (cap_fds > 8)
    cap_fds = 8;
  int tmp[8];
  int got = 0;
  uint8_t hdr[4];
  gpuipc_status fd_err = GPUIPC_OK;
  gpuipc_status s = recv_all(sock, hdr, 4, tmp, &got, 8, &fd_err);
  if (s != GPUIPC_OK)
    goto fail;
  uint32_t n = gpuipc__get_le32(hdr);
  if (n == 0 || n > GPUIPC_DESC_MAX) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL,
                     "gpuipc_desc_recv: message of %u bytes is no descriptor",
                     n);
    goto fail;
  }
  uint8_t body[GPUIPC_DESC_MAX];
  s = recv_all(sock, body, n, tmp, &got, 8, &fd_err);
  if (s != GPUIPC_OK)
    goto fail;
  if (fd_err != GPUIPC_OK) {
    s = fd_err; /* recorded when it happened */
    goto fail;
  }
  if (n > cap) {
    s = gpuipc__fail(GPUIPC_E_LIMIT,
                     "gpuipc_desc_recv: descriptor of %u bytes, buffer %zu", n,
                     cap);
    goto fail;
  }
  if (got > cap_fds) {
    s = gpuipc__fail(GPUIPC_E_LIMIT,
                     "gpuipc_desc_recv: %d fd(s) arrived, room for %d", got,
                     cap_fds);
    goto fail;
  }
  memcpy(desc, body, n);
  *len = n;
  for (int i = 0; i < got; i++)
    fds[i] = tmp[i];
  if (nfds)
    *nfds = got;
  return GPUIPC_OK;
fail:
  close_fds(tmp, got);
  if (nfds)
    *nfds = 0;
  return s;
}

gpuipc_status gpuipc__desc_open(const char *fn, const uint8_t *desc,
                                size_t len,
                                const gpuipc_import_options *opts_in,
                                unsigned type, const char *what,
                                const gpuipc__via *via,
                                gpuipc_import_options *opts, gpuipc__desc *d) {
  *opts = (gpuipc_import_options)GPUIPC_IMPORT_OPTIONS_INIT;
  GPUIPC__CHECK(gpuipc__options_copy(opts, sizeof *opts, opts_in, 0,
                                     "gpuipc_import_options",
                                     "GPUIPC_IMPORT_OPTIONS_INIT"));
  GPUIPC__CHECK(gpuipc__desc_decode(desc, len, d));
  if (d->type != type)
    return gpuipc__fail(GPUIPC_E_BAD_KIND,
                        "%s: descriptor of type %u is not %s", fn,
                        (unsigned)d->type, what);
  return check_origin(d, via);
}
