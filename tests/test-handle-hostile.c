/*
 * test-handle-hostile.c: imports from a hostile exporter. Every fd that
 * travels with a descriptor is checked to be what the descriptor says
 * before anything is mapped: a pinned host buffer's fd must be a memfd
 * sealed against shrinking (else its owner truncates it under the mapping
 * and the importer's next access raises SIGBUS), never a regular file or
 * a driver's fd; a driver's fd (VMM, memory pool) is never a file of a
 * file system or a sealed host memfd.
 */
#include "test-handle.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* A peer's buffer of kind (one fd), its descriptor decoded into *dd. */
static uint64_t export_one(int sock, gpuipc_pool_kind kind, size_t size,
                           uint8_t *d, size_t *len, int *fd,
                           gpuipc__desc *dd) {
  int nfds = 1;
  *fd = -1;
  uint64_t slot = th_peer_export(sock, kind, size, 5, d, len, fd, &nfds);
  ASSERT_EQ(nfds, 1);
  ASSERT_OK(gpuipc__desc_decode(d, *len, dd));
  return slot;
}

/* An unsealed memfd of n bytes. */
static int unsealed_memfd(size_t n) {
  int fd = memfd_create("hostile", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, (off_t)n), 0);
  return fd;
}

/* A regular file of n bytes in the temporary directory (unlinked). */
static int regular_file(size_t n) {
  char path[] = "/tmp/gpuipc-hostile-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  unlink(path);
  ASSERT_EQ(ftruncate(fd, (off_t)n), 0);
  return fd;
}

/* The hostile exporter's trick: an unsealed memfd as a pinned host
 * buffer's fd, truncated once the importer mapped it. The import must be
 * refused before anything is mapped. */
TEST_IMPL(handle_hostile_pinned_unsealed_memfd) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fd;
  gpuipc__desc dd;
  uint64_t slot =
      export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d, &len, &fd, &dd);
  int evil = unsealed_memfd((size_t)dd.alloc_size);
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_import(d, len, &evil, 1, NULL, &b);
  if (s == GPUIPC_OK) {
    /* What the hostile exporter does next: the importer's next read of
     * the mapping would raise SIGBUS. */
    ASSERT_EQ(ftruncate(evil, 0), 0);
    harness_fail(__FILE__, __LINE__,
                 "an unsealed memfd was imported as pinned host memory: its "
                 "owner can truncate it under the mapping");
  }
  ASSERT_EQ(s, GPUIPC_E_BAD_KIND);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "F_SEAL_SHRINK");
  close(evil);
  /* The genuine fd (sealed by the exporter) imports. */
  ASSERT_OK(gpuipc_buffer_import(d, len, &fd, 1, NULL, &b));
  ASSERT(th_check(b, 0, 65536, 5));
  ASSERT_OK(gpuipc_buffer_close(b));
  close(fd);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

/* A regular file, and a driver's fd (the peer's VMM allocation, and its
 * memory pool), given as a pinned host buffer's fd. */
TEST_IMPL(handle_hostile_pinned_wrong_fds) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], dv[GPUIPC_DESC_MAX], dp[GPUIPC_DESC_MAX];
  size_t len, lv;
  int fd, vfd;
  gpuipc__desc dd, dvd;
  uint64_t slot =
      export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d, &len, &fd, &dd);
  uint64_t vslot = export_one(sock, GPUIPC_POOL_VMM, 65536, dv, &lv, &vfd, &dvd);
  harness_send_u64(sock, TH_OP_POOL_EXPORT);
  harness_send_u64(sock, GPUIPC_POOL_MEMPOOL);
  int pfd[1] = {-1}, npfd = 1;
  ASSERT_GT(harness_recv(sock, dp, sizeof dp, pfd, &npfd), 0);
  ASSERT_EQ(npfd, 1);

  int file = regular_file((size_t)dd.alloc_size);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(d, len, &file, 1, NULL, &b),
                GPUIPC_E_BAD_KIND);
  ASSERT_STATUS(gpuipc_buffer_import(d, len, &vfd, 1, NULL, &b),
                GPUIPC_E_BAD_KIND);
  ASSERT_STATUS(gpuipc_buffer_import(d, len, &pfd[0], 1, NULL, &b),
                GPUIPC_E_BAD_KIND);
  ASSERT_NULL(b);
  close(file);
  close(pfd[0]);
  close(vfd);
  close(fd);
  th_peer_free(sock, vslot);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

/* A pinned host buffer's sealed memfd, and a regular file, given as a VMM
 * allocation's fd and as a memory pool's fd: refused as the wrong kind of
 * fd before the driver is asked to import them. */
TEST_IMPL(handle_hostile_driver_wrong_fds) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], dv[GPUIPC_DESC_MAX], dp[GPUIPC_DESC_MAX];
  size_t len, lv;
  int fd, vfd;
  gpuipc__desc dd, dvd;
  uint64_t slot =
      export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d, &len, &fd, &dd);
  uint64_t vslot = export_one(sock, GPUIPC_POOL_VMM, 65536, dv, &lv, &vfd, &dvd);
  harness_send_u64(sock, TH_OP_POOL_EXPORT);
  harness_send_u64(sock, GPUIPC_POOL_MEMPOOL);
  int pfd[1] = {-1}, npfd = 1;
  ssize_t lp = harness_recv(sock, dp, sizeof dp, pfd, &npfd);
  ASSERT_GT(lp, 0);
  ASSERT_EQ(npfd, 1);

  int file = regular_file((size_t)dvd.alloc_size);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(dv, lv, &fd, 1, NULL, &b),
                GPUIPC_E_BAD_KIND);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "sealed");
  ASSERT_STATUS(gpuipc_buffer_import(dv, lv, &file, 1, NULL, &b),
                GPUIPC_E_BAD_KIND);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "file system");
  gpuipc_pool *p = NULL;
  ASSERT_STATUS(gpuipc_pool_import(dp, (size_t)lp, fd, NULL, &p),
                GPUIPC_E_BAD_KIND);
  ASSERT_STATUS(gpuipc_pool_import(dp, (size_t)lp, file, NULL, &p),
                GPUIPC_E_BAD_KIND);
  ASSERT_NULL(p);
  /* The genuine fds import. */
  ASSERT_OK(gpuipc_buffer_import(dv, lv, &vfd, 1, NULL, &b));
  ASSERT(th_check(b, 0, 65536, 5));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_pool_import(dp, (size_t)lp, pfd[0], NULL, &p));
  ASSERT_OK(gpuipc_pool_destroy(p));
  close(file);
  close(pfd[0]);
  close(vfd);
  close(fd);
  th_peer_free(sock, vslot);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

/* A descriptor re-encoded with one field changed (a forger's, who can
 * compute the checksum as well as anyone). */
static size_t forge(const gpuipc__desc *dd, uint8_t *out) {
  size_t len = 0;
  ASSERT_OK(gpuipc__desc_encode(dd, out, GPUIPC_DESC_MAX, &len));
  return len;
}

/* A VMM descriptor claiming a far larger allocation than its fd holds:
 * GPUIPC_E_OUT_OF_RANGE, as handle.h documents, whatever the driver says
 * of reserving or mapping that much. */
TEST_IMPL(handle_hostile_vmm_forged_size) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], f[GPUIPC_DESC_MAX];
  size_t len;
  int fd;
  gpuipc__desc dd;
  uint64_t slot = export_one(sock, GPUIPC_POOL_VMM, 65536, d, &len, &fd, &dd);
  uint64_t sizes[] = {dd.alloc_size * 2, 1ull << 40, 1ull << 50,
                      (1ull << 62) - dd.alloc_size};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(sizes); i++) {
    gpuipc__desc x = dd;
    x.alloc_size = sizes[i] / dd.alloc_size * dd.alloc_size;
    size_t fl = forge(&x, f);
    gpuipc_buffer *b = NULL;
    gpuipc_status s = gpuipc_buffer_import(f, fl, &fd, 1, NULL, &b);
    if (s != GPUIPC_E_OUT_OF_RANGE)
      fprintf(stderr, "claimed %llu bytes: %s: %s\n",
              (unsigned long long)x.alloc_size, gpuipc_status_name(s),
              gpuipc_last_error());
    ASSERT_EQ(s, GPUIPC_E_OUT_OF_RANGE);
    ASSERT_NULL(b);
  }
  close(fd);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

/* A mempool buffer descriptor whose export data was forged: a descriptor
 * error (GPUIPC_E_STALE: the driver cannot tell forged bytes from those of
 * a freed allocation), never GPUIPC_E_DRIVER. */
TEST_IMPL(handle_hostile_mempool_forged_export) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], f[GPUIPC_DESC_MAX];
  size_t len;
  int fd;
  gpuipc__desc dd;
  uint64_t slot =
      export_one(sock, GPUIPC_POOL_MEMPOOL, 65536, d, &len, &fd, &dd);
  for (int i = 0; i < 48; i += 7) {
    gpuipc__desc x = dd;
    x.handle[i] ^= 0x5a;
    size_t fl = forge(&x, f);
    gpuipc_buffer *b = NULL;
    gpuipc_status s = gpuipc_buffer_import(f, fl, &fd, 1, NULL, &b);
    if (s == GPUIPC_OK) {
      /* Some bytes the driver does not read; the import is then genuine. */
      ASSERT_OK(gpuipc_buffer_close(b));
      continue;
    }
    if (s != GPUIPC_E_STALE)
      fprintf(stderr, "export data byte %d forged: %s: %s\n", i,
              gpuipc_status_name(s), gpuipc_last_error());
    ASSERT_EQ(s, GPUIPC_E_STALE);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "cuMemPoolImportPointer");
  }
  /* The genuine one still imports (the pool import was not spoiled). */
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, &fd, 1, NULL, &b));
  ASSERT(th_check(b, 0, 65536, 5));
  ASSERT_OK(gpuipc_buffer_close(b));
  close(fd);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  return 0;
}

/* Exporters killed one after another, each after this process imported a
 * buffer of its memory pool: no imported pool of a dead exporter stays
 * once its buffers are closed (closed before the kill: released at the
 * next pool import or count; closed after it: released by that close). */
TEST_IMPL(handle_hostile_dead_exporter_pools_released) {
  ASSERT_OK(gpuipc_init());
  size_t before = gpuipc__cache_pools_held();
  for (int round = 0; round < 8; round++) {
    int sock;
    pid_t pid = th_peer_start(NULL, &sock);
    uint8_t d[GPUIPC_DESC_MAX];
    size_t len;
    int fd;
    gpuipc__desc dd;
    (void)export_one(sock, GPUIPC_POOL_MEMPOOL, 65536, d, &len, &fd, &dd);
    gpuipc_buffer *b = NULL;
    ASSERT_OK(gpuipc_buffer_import(d, len, &fd, 1, NULL, &b));
    ASSERT(th_check(b, 0, 65536, 5));
    close(fd);
    ASSERT_EQ(gpuipc__cache_pools_held(), before + 1);
    bool close_first = round % 2 == 0;
    if (close_first)
      ASSERT_OK(gpuipc_buffer_close(b));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int st = 0;
    ASSERT_EQ(waitpid(pid, &st, 0), pid);
    close(sock);
    if (!close_first) {
      /* Still held by the open buffer: it stays until that closes. */
      ASSERT_EQ(gpuipc__cache_pools_held(), before + 1);
      ASSERT_OK(gpuipc_buffer_close(b));
    }
    size_t now = gpuipc__cache_pools_held();
    if (now != before)
      fprintf(stderr, "round %d (%s): %zu imported pools held, %zu before\n",
              round, close_first ? "closed, then killed" : "killed, then closed",
              now, before);
    ASSERT_EQ(now, before);
  }
  return 0;
}

/* ---- the liveness table's name, and the pidfd route --------------------------------- */

/* The name older libraries gave a process's liveness table: every part of
 * it public, so anyone could create it first. */
static void predictable_table_name(char *out, size_t cap, pid_t pid) {
  snprintf(out, cap, "/dev/shm/gpuipc-%u-%llu-%d-%llu", (unsigned)geteuid(),
           (unsigned long long)gpuipc__pid_namespace(), (int)pid,
           (unsigned long long)gpuipc__process_start_time((int)pid));
}

/* Another process creates the liveness table's predictable name before
 * the exporter's first allocation (here of the same uid; another uid's
 * file could not even be removed). The exporter still gets a table (under
 * a name nobody could predict, carried in its descriptors), so a freed
 * buffer's descriptor is still refused as stale. */
TEST_IMPL(handle_hostile_liveness_name_squatted) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  char path[160];
  predictable_table_name(path, sizeof path, pid);
  int squat = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ASSERT_GE(squat, 0);
  ASSERT_EQ(ftruncate(squat, 4096), 0);
  close(squat);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fd;
  gpuipc__desc dd;
  uint64_t slot =
      export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d, &len, &fd, &dd);
  ASSERT_NE(dd.live_key, 0);
  th_peer_free(sock, slot);
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_import(d, len, &fd, 1, NULL, &b);
  if (s == GPUIPC_OK)
    ASSERT_OK(gpuipc_buffer_close(b));
  unlink(path);
  close(fd);
  if (s != GPUIPC_E_STALE)
    fprintf(stderr, "import of a freed buffer: %s: %s\n",
            gpuipc_status_name(s), gpuipc_last_error());
  ASSERT_EQ(s, GPUIPC_E_STALE);
  th_peer_stop(pid, sock);
  return 0;
}

/* The key of a process's liveness table, as anyone may read it from the
 * names in /dev/shm; 0 when it has none. */
static uint64_t table_key_of(pid_t pid) {
  char prefix[160];
  predictable_table_name(prefix, sizeof prefix, pid);
  const char *base = prefix + strlen("/dev/shm/");
  size_t pl = strlen(base);
  uint64_t key = 0;
  DIR *dir = opendir("/dev/shm");
  ASSERT_NOT_NULL(dir);
  struct dirent *e;
  while ((e = readdir(dir)) != NULL)
    if (strncmp(e->d_name, base, pl) == 0 && e->d_name[pl] == '-')
      key = strtoull(e->d_name + pl + 1, NULL, 16);
  closedir(dir);
  return key;
}

static int pidfd_import(const uint8_t *d, size_t len, gpuipc_buffer **b) {
  gpuipc_import_options o = GPUIPC_IMPORT_OPTIONS_INIT;
  o.flags = GPUIPC_IMPORT_PIDFD_GETFD;
  return gpuipc_buffer_import(d, len, NULL, 0, &o, b);
}

/* A forged pinned host descriptor naming a bystander process of the same
 * user and the number of an fd it never exported (here: its own pinned
 * buffer's memfd, sealed like any of gpuipc's): with
 * GPUIPC_IMPORT_PIDFD_GETFD the importer must not map it, since the
 * bystander's table records no such export. A process that never exported
 * anything is refused as well. The honest export imports. */
TEST_IMPL(handle_hostile_pidfd_bystander) {
  ASSERT_OK(gpuipc_init());
  int sa, sb, sc;
  pid_t a = th_peer_start(NULL, &sa);
  pid_t by = th_peer_start(NULL, &sb);
  pid_t fresh = th_peer_start(NULL, &sc);
  uint8_t d[GPUIPC_DESC_MAX], f[GPUIPC_DESC_MAX];
  size_t len;
  int nfds = 0;
  uint64_t slot =
      th_peer_export(sa, GPUIPC_POOL_PINNED_HOST, 65536, 5, d, &len, NULL, &nfds);
  ASSERT_EQ(nfds, 0);
  gpuipc_buffer *b = NULL;
  gpuipc_status s = pidfd_import(d, len, &b);
  if (s == GPUIPC_E_PERMISSION || s == GPUIPC_E_NOT_SUPPORTED) {
    th_peer_stop(a, sa);
    th_peer_stop(by, sb);
    th_peer_stop(fresh, sc);
    SKIP("pidfd_getfd refused here: %s", gpuipc_last_error());
  }
  ASSERT_OK(s);
  ASSERT(th_check(b, 0, 65536, 5));
  ASSERT_OK(gpuipc_buffer_close(b));

  /* The bystander's private buffer, never exported. */
  harness_send_u64(sb, TH_OP_ALLOC_PRIVATE);
  harness_send_u64(sb, GPUIPC_POOL_PINNED_HOST);
  harness_send_u64(sb, 65536);
  harness_send_u64(sb, 77);
  uint64_t bslot = harness_recv_u64(sb);
  int bfd = (int)(int64_t)harness_recv_u64(sb);
  uint64_t bgen = harness_recv_u64(sb);
  ASSERT_GE(bfd, 0);
  gpuipc__desc dd;
  ASSERT_OK(gpuipc__desc_decode(d, len, &dd));
  gpuipc__desc x = dd;
  x.exporter.pid = by;
  x.exporter.start_time = gpuipc__process_start_time(by);
  x.exporter_fd = bfd;
  x.generation = bgen;
  x.live_key = table_key_of(by);
  ASSERT_NE(x.live_key, 0); /* it allocated: it has a table */
  size_t fl = forge(&x, f);
  b = NULL;
  s = pidfd_import(f, fl, &b);
  if (s == GPUIPC_OK) {
    bool theirs = th_check(b, 0, 65536, 77);
    ASSERT_OK(gpuipc_buffer_close(b));
    harness_fail(__FILE__, __LINE__,
                 "a forged descriptor mapped the bystander's private memfd "
                 "(its data %s)",
                 theirs ? "read back" : "not recognized");
  }
  ASSERT_EQ(s, GPUIPC_E_PERMISSION);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "has not exported that fd");

  /* A process that never exported (nor allocated) anything: no table. */
  x.exporter.pid = fresh;
  x.exporter.start_time = gpuipc__process_start_time(fresh);
  x.exporter_fd = 0;
  x.live_key = table_key_of(fresh);
  ASSERT_EQ(x.live_key, 0);
  fl = forge(&x, f);
  ASSERT_STATUS(pidfd_import(f, fl, &b), GPUIPC_E_PERMISSION);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "no liveness table");

  th_peer_free(sb, bslot);
  th_peer_free(sa, slot);
  th_peer_stop(a, sa);
  th_peer_stop(by, sb);
  th_peer_stop(fresh, sc);
  return 0;
}

/* A descriptor names its exporter's liveness table (pid, start time, key),
 * and anyone can create a file in /dev/shm: a FIFO under the name a forged
 * descriptor gives. Opening it to read would wait for a writer (with the
 * table lock held, so every import of the process would wait). The import
 * must go on at once, without the table. A watchdog thread opens the FIFO
 * for writing if the import is still waiting after a while, so that a
 * failure ends rather than hangs. */
struct fifo_watch {
  const char *path;
  _Atomic int done;
  _Atomic int rescued;
};

static void *fifo_watchdog(void *arg) {
  struct fifo_watch *w = arg;
  /* 30 s: an import that waits on the FIFO waits for ever, while an
   * honest one (its driver calls) may take seconds under a sanitizer on a
   * loaded machine; 3 s could "rescue" an import that was only slow, and
   * fail the test. */
  for (int i = 0; i < 3000 && !atomic_load(&w->done); i++)
    usleep(10000);
  while (!atomic_load(&w->done)) {
    int fd = open(w->path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      atomic_store(&w->rescued, 1);
      close(fd);
    }
    usleep(10000);
  }
  return NULL;
}

TEST_IMPL(handle_hostile_liveness_table_fifo) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fd;
  gpuipc__desc dd;
  uint64_t slot =
      export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d, &len, &fd, &dd);
  dd.live_key = 0x5eedf1f0deadbeefull; /* names no real table */
  ASSERT_OK(gpuipc__desc_encode(&dd, d, sizeof d, &len));
  char path[200];
  snprintf(path, sizeof path, "/dev/shm/gpuipc-%u-%llu-%d-%llu-%016llx",
           (unsigned)geteuid(), (unsigned long long)dd.exporter.pidns,
           (int)dd.exporter.pid, (unsigned long long)dd.exporter.start_time,
           (unsigned long long)dd.live_key);
  unlink(path);
  ASSERT_EQ(mkfifo(path, 0600), 0);
  struct fifo_watch w = {path, 0, 0};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, fifo_watchdog, &w), 0);
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_import(d, len, &fd, 1, NULL, &b);
  atomic_store(&w.done, 1);
  ASSERT_EQ(pthread_join(t, NULL), 0);
  unlink(path);
  if (s == GPUIPC_OK)
    ASSERT_OK(gpuipc_buffer_close(b));
  else
    fprintf(stderr, "import: %s: %s\n", gpuipc_status_name(s),
            gpuipc_last_error());
  close(fd);
  th_peer_free(sock, slot);
  th_peer_stop(pid, sock);
  if (atomic_load(&w.rescued))
    harness_fail(__FILE__, __LINE__, "the import waited on the FIFO %s", path);
  ASSERT_OK(s); /* the table is not usable: the import proceeds unchecked */
  return 0;
}

/* The exporter owns its liveness table and can truncate it once an
 * importer has looked into it: a mapping of it would raise SIGBUS in the
 * importer at its next import from that exporter. The importer reads the
 * table (rather than maps it): a table cut short is only a table it cannot
 * use. (The test truncates the peer's table itself, as the peer could.) */
TEST_IMPL(handle_hostile_liveness_table_truncated) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX], d2[GPUIPC_DESC_MAX];
  size_t len, len2;
  int fd, fd2;
  gpuipc__desc dd;
  export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d, &len, &fd, &dd);
  export_one(sock, GPUIPC_POOL_PINNED_HOST, 65536, d2, &len2, &fd2, &dd);
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, &fd, 1, NULL, &b)); /* looked into */
  ASSERT_OK(gpuipc_buffer_close(b));
  close(fd);
  char path[200];
  predictable_table_name(path, sizeof path, pid);
  uint64_t key = table_key_of(pid);
  ASSERT_NE(key, 0);
  snprintf(path + strlen(path), sizeof path - strlen(path), "-%016llx",
           (unsigned long long)key);
  int t = open(path, O_RDWR | O_CLOEXEC);
  ASSERT_GE(t, 0);
  ASSERT_EQ(ftruncate(t, 0), 0);
  close(t);
  /* The next import from it: the stale check reads the table. */
  gpuipc_status s = gpuipc_buffer_import(d2, len2, &fd2, 1, NULL, &b);
  if (s != GPUIPC_OK)
    fprintf(stderr, "import: %s: %s\n", gpuipc_status_name(s),
            gpuipc_last_error());
  ASSERT_OK(s); /* the table is not usable: the import proceeds unchecked */
  ASSERT_OK(gpuipc_buffer_close(b));
  close(fd2);
  /* The peer's own table is cut short too: it would die of its next
   * write there, so it is not asked for anything more. */
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  close(sock);
  return 0;
}
