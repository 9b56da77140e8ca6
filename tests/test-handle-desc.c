/*
 * test-handle-desc.c: descriptors are hostile input. Corrupted, truncated,
 * forged (a size beyond the real mapping), foreign-machine and
 * foreign-namespace descriptors are each refused with their own status;
 * missing fds, the opt-in pidfd_getfd route and its permission error; the
 * socket helpers that carry descriptors and fds.
 */
#include "test-handle.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* Recomputes the checksum after a test changed a field. */
static void reseal(uint8_t *d, size_t len) {
  memset(d + 12, 0, 4);
  uint32_t c = gpuipc__crc32c(0, d, len);
  for (int i = 0; i < 4; i++)
    d[12 + i] = (uint8_t)(c >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

/* A well-formed legacy buffer descriptor from a made-up process on this
 * machine (no driver involved). */
static size_t fake_desc(uint8_t *out) {
  gpuipc__desc d;
  memset(&d, 0, sizeof d);
  d.type = GPUIPC_DESC_BUFFER;
  d.kind = GPUIPC_POOL_LEGACY;
  d.handle_len = 64;
  for (int i = 0; i < 64; i++)
    d.handle[i] = (uint8_t)(i * 3 + 1);
  d.exporter_fd = -1;
  ASSERT_OK(gpuipc__desc_set_exporter(&d));
  d.exporter.pid = getpid() + 100000; /* someone else */
  d.buffer_id = 9;
  d.generation = 4;
  d.offset = 512;
  d.size = 1024;
  d.alloc_size = 4096;
  size_t len = 0;
  ASSERT_OK(gpuipc__desc_encode(&d, out, GPUIPC_DESC_MAX, &len));
  ASSERT_EQ(len, GPUIPC__DESC_LEN);
  return len;
}

static gpuipc_status import_raw(const uint8_t *d, size_t len) {
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_import(d, len, NULL, 0, NULL, &b);
  if (s == GPUIPC_OK)
    gpuipc_buffer_close(b);
  return s;
}

/* CRC32C's check value, and every length through the 8-byte fast path. */
TEST_IMPL(handle_desc_crc32c) {
  ASSERT_UEQ(gpuipc__crc32c(0, "123456789", 9), 0xE3069283u);
  uint8_t buf[64];
  for (int i = 0; i < 64; i++)
    buf[i] = (uint8_t)(i * 37 + 11);
  for (size_t n = 0; n <= 64; n++) {
    /* Bit-by-bit reference. */
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
      c ^= buf[i];
      for (int k = 0; k < 8; k++)
        c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    ASSERT_UEQ(gpuipc__crc32c(0, buf, n), ~c);
    /* Chained in two pieces. */
    ASSERT_UEQ(gpuipc__crc32c(gpuipc__crc32c(0, buf, n / 3), buf + n / 3,
                              n - n / 3),
               ~c);
  }
  return 0;
}

TEST_IMPL(handle_desc_info_roundtrip) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, len, &info));
  ASSERT_EQ(info.type, GPUIPC_DESC_BUFFER);
  ASSERT_EQ(info.kind, GPUIPC_POOL_LEGACY);
  ASSERT_EQ(info.version, 1);
  ASSERT_EQ(info.nfds, 0);
  ASSERT_EQ(info.buffer_id, 9);
  ASSERT_EQ(info.generation, 4);
  ASSERT_EQ(info.offset, 512);
  ASSERT_EQ(info.bytes, 1024);
  ASSERT_EQ(info.alloc_bytes, 4096);
  ASSERT_EQ(info.same_machine, 1);
  ASSERT_EQ(info.same_namespace, 1);
  /* An older caller's smaller struct is filled only up to its size. */
  struct {
    gpuipc_desc_info i;
    uint64_t guard;
  } small;
  memset(&small, 0xAB, sizeof small);
  small.i.size = offsetof(gpuipc_desc_info, nfds);
  ASSERT_OK(gpuipc_desc_get_info(d, len, &small.i));
  ASSERT_EQ(small.i.type, GPUIPC_DESC_BUFFER);
  ASSERT_EQ(((uint8_t *)&small.i)[offsetof(gpuipc_desc_info, nfds)], 0xAB);
  info.size = 0;
  ASSERT_STATUS(gpuipc_desc_get_info(d, len, &info), GPUIPC_E_INVALID_ARG);
  return 0;
}

TEST_IMPL(handle_desc_truncated) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  size_t cuts[] = {0, 1, 3, 4, 11, 15, 16, 100, 191};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(cuts); i++) {
    /* Exact-size copies: a sanitizer build catches any read past them. */
    uint8_t *c = malloc(cuts[i] + 1);
    memcpy(c, d, cuts[i]);
    ASSERT_STATUS(import_raw(c, cuts[i]), GPUIPC_E_TRUNCATED);
    free(c);
  }
  /* One byte too many is not a truncation but trailing garbage. */
  ASSERT_STATUS(import_raw(d, len + 1), GPUIPC_E_PROTOCOL);
  return 0;
}

TEST_IMPL(handle_desc_corrupted) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  /* Every single-bit flip outside the magic, version and length fields is
   * caught by the checksum. */
  for (size_t i = 0; i < len; i++) {
    if (i < 12)
      continue;
    for (int bit = 0; bit < 8; bit += 3) {
      d[i] ^= (uint8_t)(1u << bit);
      ASSERT_STATUS(import_raw(d, len), GPUIPC_E_BAD_CHECKSUM);
      d[i] ^= (uint8_t)(1u << bit);
    }
  }
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "checksum");
  /* Magic, version, length: their own errors. */
  d[0] ^= 1;
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_BAD_MAGIC);
  d[0] ^= 1;
  d[4] = 2;
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_BAD_VERSION);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "version 2");
  d[4] = 1;
  d[9] = 1; /* length 200 + 256 */
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_PROTOCOL);
  d[9] = 0;
  reseal(d, len);
  ASSERT_OK(gpuipc_desc_get_info(d, len, &(gpuipc_desc_info)GPUIPC_DESC_INFO_INIT));
  return 0;
}

TEST_IMPL(handle_desc_bad_kind) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  d[7] = 9; /* kind */
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_BAD_KIND);
  len = fake_desc(d);
  d[6] = 3; /* an event: handle 64 bytes like legacy, but kind 3 */
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_BAD_KIND);
  d[7] = GPUIPC__KIND_IPC_EVENT;
  reseal(d, len);
  /* A well-formed event descriptor is not a buffer. */
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_BAD_KIND);
  gpuipc_pool *p = NULL;
  ASSERT_STATUS(gpuipc_pool_import(d, len, -1, NULL, &p), GPUIPC_E_BAD_KIND);
  return 0;
}

TEST_IMPL(handle_desc_forged_range_static) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  put64(d + 112, 4096); /* size 4096 at offset 512 of 4096 */
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_OUT_OF_RANGE);
  put64(d + 104, UINT64_MAX - 8); /* offset + size wraps around */
  put64(d + 112, 16);
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_OUT_OF_RANGE);
  return 0;
}

TEST_IMPL(handle_desc_foreign_machine_and_namespace) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  d[40] ^= 0xFF; /* boot id */
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_FOREIGN_MACHINE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "another machine");
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, len, &info));
  ASSERT_EQ(info.same_machine, 0);
  len = fake_desc(d);
  d[56] ^= 0x01; /* pid namespace inode */
  reseal(d, len);
  ASSERT_STATUS(import_raw(d, len), GPUIPC_E_FOREIGN_NAMESPACE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "pid namespace");
  gpuipc_event *e = NULL;
  ASSERT_STATUS(gpuipc_event_import(d, len, NULL, &e), GPUIPC_E_BAD_KIND);
  return 0;
}

/* Genuine descriptors of a peer, forged: a size beyond the real mapping
 * (both the size and the allocation size the descriptor claims), a device
 * this process cannot see, missing fds. */
static int forged_against_driver(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], f[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  const size_t size = 4u << 20;
  uint64_t slot = th_peer_export(sock, kind, size, 1, d, &len, fds, &nfds);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, len, &info));

  /* Claims 16x the allocation. */
  memcpy(f, d, len);
  put64(f + 112, info.alloc_bytes * 16);
  put64(f + 120, info.alloc_bytes * 16);
  reseal(f, len);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(f, len, fds, nfds, NULL, &b),
                GPUIPC_E_OUT_OF_RANGE);
  ASSERT_NULL(b);
  /* Also when the genuine buffer is already mapped here (a cache hit). */
  gpuipc_buffer *g = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &g));
  ASSERT(th_check(g, 0, size, 1));
  if (kind == GPUIPC_POOL_LEGACY || kind == GPUIPC_POOL_MEMPOOL)
    ASSERT_STATUS(gpuipc_buffer_import(f, len, fds, nfds, NULL, &b),
                  GPUIPC_E_OUT_OF_RANGE);
  /* An interior window that does fit is fine. */
  memcpy(f, d, len);
  put64(f + 104, 4096);
  put64(f + 112, 8192);
  reseal(f, len);
  ASSERT_OK(gpuipc_buffer_import(f, len, fds, nfds, NULL, &b));
  ASSERT_EQ((char *)gpuipc_buffer_get_ptr(b) - (char *)gpuipc_buffer_get_ptr(g), 4096);
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_buffer_close(g));

  /* A device nobody here can see (pinned host memory does not need it). */
  memcpy(f, d, len);
  memset(f + 24, 0xEE, 16);
  reseal(f, len);
  if (kind == GPUIPC_POOL_PINNED_HOST) {
    ASSERT_OK(gpuipc_buffer_import(f, len, fds, nfds, NULL, &b));
    ASSERT(th_check(b, 0, size, 1));
    ASSERT_OK(gpuipc_buffer_close(b));
  } else {
    ASSERT_STATUS(gpuipc_buffer_import(f, len, fds, nfds, NULL, &b),
                  GPUIPC_E_DEVICE_NOT_VISIBLE);
  }
  gpuipc_uuid ghost;
  memset(ghost.bytes, 0xEE, 16);
  gpuipc_import_options o = GPUIPC_IMPORT_OPTIONS_INIT;
  o.device = &ghost;
  ASSERT_STATUS(gpuipc_buffer_import(d, len, fds, nfds, &o, &b),
                GPUIPC_E_DEVICE_NOT_VISIBLE);

  /* Without its fd. */
  if (kind == GPUIPC_POOL_VMM || kind == GPUIPC_POOL_PINNED_HOST) {
    ASSERT_STATUS(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b),
                  GPUIPC_E_NEED_FD);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "GPUIPC_IMPORT_PIDFD_GETFD");
  }
  th_close_fds(fds, nfds);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_desc_forged_legacy) {
  return forged_against_driver(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_desc_forged_mempool) {
  return forged_against_driver(GPUIPC_POOL_MEMPOOL);
}
TEST_IMPL(handle_desc_forged_vmm) {
  return forged_against_driver(GPUIPC_POOL_VMM);
}
TEST_IMPL(handle_desc_forged_pinned_host) {
  return forged_against_driver(GPUIPC_POOL_PINNED_HOST);
}

/* A descriptor of an allocation the exporter freed: the exporter's
 * liveness table says so before the driver is asked. Without the table
 * (here: the descriptor names a process that has none), the legacy open
 * itself fails, as the driver refuses handles of freed memory. */
TEST_IMPL(handle_desc_freed_legacy_is_stale) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int nfds = 0;
  uint64_t slot =
      th_peer_export(sock, GPUIPC_POOL_LEGACY, 65536, 3, d, &len, NULL, &nfds);
  th_peer_free(sock, slot);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b),
                GPUIPC_E_STALE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "freed");
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "generation");
  /* No table to ask: another (made-up) exporter start time. */
  uint8_t f[GPUIPC_DESC_MAX];
  memcpy(f, d, len);
  put64(f + 72, 12345);
  reseal(f, len);
  ASSERT_STATUS(gpuipc_buffer_import(f, len, NULL, 0, NULL, &b),
                GPUIPC_E_STALE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "cuIpcOpenMemHandle");
  ASSERT_EQ(gpuipc_last_cuda_error(), CUDA_ERROR_INVALID_VALUE);
  th_peer_stop(pid, sock);
  return 0;
}

/* Every kind: a buffer imported here, then freed by its exporter. A second
 * import of its descriptor is refused (not a cache hit on the mapping still
 * held), the holder keeps its mapping, and a new buffer of the exporter
 * imports fine. For VMM and pinned host memory the driver would happily
 * map the freed allocation (the fd keeps it alive): only the table knows. */
static int freed_is_stale(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], d2[GPUIPC_DESC_MAX];
  size_t len, len2;
  int fds[1] = {-1}, nfds = 1;
  int fds2[1] = {-1}, nfds2 = 1;
  const size_t n = 65536;
  uint64_t slot = th_peer_export(sock, kind, n, 5, d, &len, fds, &nfds);
  gpuipc_buffer *a = NULL, *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &a));
  ASSERT(th_check(a, 0, n, 5));
  /* Still live: importing again is fine (a cache hit for legacy and
   * mempool). */
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  ASSERT_OK(gpuipc_buffer_close(b));
  b = NULL;
  uint64_t slot2 = th_peer_export(sock, kind, n, 6, d2, &len2, fds2, &nfds2);
  th_peer_free(sock, slot);
  ASSERT_STATUS(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b),
                GPUIPC_E_STALE);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "freed");
  ASSERT_NULL(b);
  th_close_fds(fds, nfds);
  ASSERT_OK(gpuipc_buffer_import(d2, len2, fds2, nfds2, NULL, &b));
  th_close_fds(fds2, nfds2);
  ASSERT(th_check(b, 0, n, 6));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_buffer_close(a));
  th_peer_free(sock, slot2);
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_desc_freed_is_stale_legacy) {
  return freed_is_stale(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_desc_freed_is_stale_mempool) {
  return freed_is_stale(GPUIPC_POOL_MEMPOOL);
}
TEST_IMPL(handle_desc_freed_is_stale_vmm) {
  return freed_is_stale(GPUIPC_POOL_VMM);
}
TEST_IMPL(handle_desc_freed_is_stale_pinned_host) {
  return freed_is_stale(GPUIPC_POOL_PINNED_HOST);
}

/* ---- the exporter's liveness table ------------------------------------------------------- */

/* The table's file for a descriptor's exporter (docs/descriptor.md). */
static void table_path(char *out, size_t cap, const gpuipc__desc *d) {
  snprintf(out, cap, "/dev/shm/gpuipc-%u-%llu-%d-%llu-%016llx",
           (unsigned)geteuid(), (unsigned long long)d->exporter.pidns,
           (int)d->exporter.pid, (unsigned long long)d->exporter.start_time,
           (unsigned long long)d->live_key);
}

/* Writes a table by hand: the format of docs/descriptor.md, one slot set. */
static void write_table(const char *path, mode_t mode, uint64_t slot,
                        uint64_t value) {
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, mode), 0); /* whatever the umask */
  ASSERT_EQ(ftruncate(fd, 64 + (off_t)GPUIPC__LIVE_SLOTS * 8), 0);
  uint8_t h[64];
  memset(h, 0, sizeof h);
  put64(h, 0x4556494c43504947ull); /* "GIPCLIVE" */
  h[8] = 1;                        /* version */
  uint32_t n = GPUIPC__LIVE_SLOTS;
  for (int i = 0; i < 4; i++)
    h[12 + i] = (uint8_t)(n >> (8 * i));
  ASSERT_EQ(pwrite(fd, h, sizeof h, 0), (ssize_t)sizeof h);
  uint8_t v[8];
  put64(v, value);
  ASSERT_EQ(pwrite(fd, v, 8, 64 + (off_t)(slot % GPUIPC__LIVE_SLOTS) * 8), 8);
  close(fd);
}

/* A legacy descriptor of a made-up exporter (start time st) with
 * generation 4, and its table's path. */
static size_t fake_exporter_desc(uint8_t *out, uint64_t st, char *path,
                                 size_t cap) {
  uint8_t raw[GPUIPC_DESC_MAX];
  size_t len = fake_desc(raw);
  gpuipc__desc d;
  ASSERT_OK(gpuipc__desc_decode(raw, len, &d));
  d.exporter.start_time = st;
  d.live_key = 0x5eed0000ull + st;
  ASSERT_OK(gpuipc__desc_encode(&d, out, GPUIPC_DESC_MAX, &len));
  table_path(path, cap, &d);
  unlink(path);
  return len;
}

/* What the importer trusts in a table: a freed slot of a table of this uid,
 * mode 0600 and the right format refuses the import before the driver is
 * asked; a table others may write, a live slot, or a slot another
 * generation took never refuses (the import goes on, and fails later on
 * the made-up descriptor's device or handle bytes). */
TEST_IMPL(handle_desc_liveness_table_trust) {
  ASSERT_OK(gpuipc_init());
  char path[160];
  uint8_t d[GPUIPC_DESC_MAX];
  const uint64_t freed = 4 | GPUIPC__LIVE_FREED_BIT;
  struct {
    mode_t mode;
    uint64_t value;
    bool refused_by_table;
  } cases[] = {
      {0600, freed, true},
      {0644, freed, false},                        /* others may read */
      {0600, 4, false},                            /* live */
      {0600, (4 + GPUIPC__LIVE_SLOTS) | GPUIPC__LIVE_FREED_BIT, false},
      {0600, 4 + GPUIPC__LIVE_SLOTS, false},       /* slot taken over */
  };
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(cases); i++) {
    /* A new made-up exporter each time: tables are read once per exporter. */
    /* The start time carries our pid, so that suites running at once on
     * one machine do not share the made-up tables in /dev/shm. */
    size_t len = fake_exporter_desc(
        d, ((uint64_t)getpid() << 16) + 9000000 + (uint64_t)i, path,
        sizeof path);
    write_table(path, cases[i].mode, 4, cases[i].value);
    gpuipc_status s = import_raw(d, len);
    unlink(path);
    ASSERT_NE(s, GPUIPC_OK);
    bool by_table =
        strstr(gpuipc_last_error(), "descriptor names (generation 4)") != NULL;
    printf("case %zu: %s: %s\n", i, gpuipc_status_name(s),
           gpuipc_last_error());
    ASSERT_EQ(by_table, cases[i].refused_by_table);
    if (by_table)
      ASSERT_STATUS(s, GPUIPC_E_STALE);
  }
  return 0;
}

/* An importer that cannot read the exporter's table (another uid, another
 * /dev/shm; simulated by removing it) imports as before: a freed VMM
 * buffer's fd still holds the allocation, so the import works and shows the
 * data. That is the documented limit of the check. */
TEST_IMPL(handle_desc_liveness_table_unreachable) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  const size_t n = 65536;
  uint64_t slot =
      th_peer_export(sock, GPUIPC_POOL_VMM, n, 12, d, &len, fds, &nfds);
  gpuipc__desc x;
  ASSERT_OK(gpuipc__desc_decode(d, len, &x));
  char path[160];
  table_path(path, sizeof path, &x);
  ASSERT_EQ(access(path, R_OK), 0); /* the peer made one */
  ASSERT_EQ(unlink(path), 0);
  th_peer_free(sock, slot);
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT(th_check(b, 0, n, 12));
  ASSERT_OK(gpuipc_buffer_close(b));
  th_peer_stop(pid, sock);
  return 0;
}

/* ---- the pidfd_getfd route --------------------------------------------------------------- */

static int pidfd_route(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int nfds = 0; /* the export attaches no fd */
  uint64_t slot = th_peer_export(sock, kind, 65536, 8, d, &len, NULL, &nfds);
  ASSERT_EQ(nfds, 0);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b),
                GPUIPC_E_NEED_FD);
  gpuipc_import_options o = GPUIPC_IMPORT_OPTIONS_INIT;
  o.flags = GPUIPC_IMPORT_PIDFD_GETFD;
  /* The fetched fd is closed: the same import twice, the fd count compared
   * after the second (the real driver opens fds lazily on a first import;
   * the emulator does not, so there it is also back at the start). */
  int fds_start = harness_count_fds(), fds_warm = -1;
  int rc = 0;
  for (int round = 0; round < 2 && rc == 0; round++) {
    gpuipc_status s = gpuipc_buffer_import(d, len, NULL, 0, &o, &b);
    if (s == GPUIPC_E_NOT_SUPPORTED) {
      printf("SKIP: %s\n", gpuipc_last_error());
      rc = TEST_SKIP;
    } else if (s == GPUIPC_E_PERMISSION) {
      /* Refused (no ptrace permission here): the error must say why. */
      ASSERT_STR_CONTAINS(gpuipc_last_error(), "ptrace");
      ASSERT_STR_CONTAINS(gpuipc_last_error(), "pidfd_getfd");
    } else {
      ASSERT_OK(s);
      ASSERT(th_check(b, 0, 65536, 8 + (uint32_t)round));
      th_fill(b, 0, 65536, 9 + (uint32_t)round);
      ASSERT(th_peer_check(sock, slot, 0, 65536, 9 + (uint32_t)round));
      ASSERT_OK(gpuipc_buffer_close(b));
    }
    if (round == 0)
      fds_warm = harness_count_fds();
  }
  if (rc == 0)
    ASSERT_EQ(harness_count_fds(), fds_warm);
  if (harness_on_emulator())
    ASSERT_EQ(harness_count_fds(), fds_start);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return rc;
}

TEST_IMPL(handle_pidfd_getfd_vmm) { return pidfd_route(GPUIPC_POOL_VMM); }
TEST_IMPL(handle_pidfd_getfd_mempool) {
  return pidfd_route(GPUIPC_POOL_MEMPOOL);
}
TEST_IMPL(handle_pidfd_getfd_pinned_host) {
  return pidfd_route(GPUIPC_POOL_PINNED_HOST);
}

static bool have_cap_sys_ptrace(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (f == NULL)
    return false;
  char line[256];
  unsigned long long cap = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "CapEff: %llx", &cap) == 1)
      break;
  fclose(f);
  return (cap >> 19) & 1; /* CAP_SYS_PTRACE */
}

/* An exporter that made itself non-dumpable cannot be reached by
 * pidfd_getfd without CAP_SYS_PTRACE: the error names the permission. */
HELPER_IMPL(handle_undumpable_exporter) {
  int sock = harness_helper_fd();
  ASSERT_EQ(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), 0);
  ASSERT_OK(gpuipc_init());
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_VMM;
  gpuipc_pool *pool;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *b;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &b));
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int nfds = 0;
  ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, NULL, &nfds));
  harness_send(sock, d, len, NULL, 0);
  harness_recv_u64(sock);
  ASSERT_OK(gpuipc_buffer_free(b, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

TEST_IMPL(handle_pidfd_getfd_permission_error) {
  if (have_cap_sys_ptrace())
    SKIP("this process has CAP_SYS_PTRACE: pidfd_getfd cannot be refused");
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = spawn_helper("handle_undumpable_exporter", NULL, &sock, NULL);
  uint8_t d[GPUIPC_DESC_MAX];
  ssize_t len = harness_recv(sock, d, sizeof d, NULL, NULL);
  gpuipc_import_options o = GPUIPC_IMPORT_OPTIONS_INIT;
  o.flags = GPUIPC_IMPORT_PIDFD_GETFD;
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_import(d, (size_t)len, NULL, 0, &o, &b);
  harness_send_u64(sock, 0);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  close(sock);
  if (s == GPUIPC_E_NOT_SUPPORTED)
    SKIP("%s", gpuipc_last_error());
  ASSERT_STATUS(s, GPUIPC_E_PERMISSION);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "ptrace");
  return 0;
}

/* ---- carrying descriptors and fds over a socket ------------------------------------------ */

TEST_IMPL(handle_desc_send_recv) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  int fds_before = harness_count_fds();
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = fake_desc(d);
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  ASSERT_OK(gpuipc_desc_send(sv[0], d, len, &p[1], 1));
  ASSERT_OK(gpuipc_desc_send(sv[0], d, len, NULL, 0));
  ASSERT_OK(gpuipc_desc_send(sv[0], d, len, &p[1], 1));
  close(p[1]);
  uint8_t r[GPUIPC_DESC_MAX];
  size_t rl = 0;
  int fds[1] = {-1}, nfds = 1;
  ASSERT_OK(gpuipc_desc_recv(sv[1], r, sizeof r, &rl, fds, &nfds));
  ASSERT_EQ(rl, len);
  ASSERT_MEM_EQ(r, d, len);
  ASSERT_EQ(nfds, 1);
  ASSERT_EQ(write(fds[0], "x", 1), 1); /* it is the pipe's write end */
  char c = 0;
  ASSERT_EQ(read(p[0], &c, 1), 1);
  ASSERT_EQ(c, 'x');
  close(fds[0]);
  nfds = 1;
  ASSERT_OK(gpuipc_desc_recv(sv[1], r, sizeof r, &rl, fds, &nfds));
  ASSERT_EQ(nfds, 0);
  /* No room for the fd: refused, and the fd is not leaked. */
  nfds = 0;
  ASSERT_STATUS(gpuipc_desc_recv(sv[1], r, sizeof r, &rl, NULL, &nfds),
                GPUIPC_E_LIMIT);
  close(p[0]);
  ASSERT_EQ(harness_count_fds(), fds_before);
  close(sv[0]);
  nfds = 1;
  ASSERT_STATUS(gpuipc_desc_recv(sv[1], r, sizeof r, &rl, fds, &nfds),
                GPUIPC_E_CLOSED);
  close(sv[1]);
  ASSERT_STATUS(gpuipc_desc_send(-1, d, len, NULL, 0), GPUIPC_E_INVALID_ARG);
  return 0;
}
