/*
 * handle.c: `gpuipc bench handle`: export and import time per buffer for
 * each pool kind, next to the raw driver calls doing the same job, measured
 * in the same run: medians and ratios.
 *
 * Two processes: the exporter (this process) and the importer, a child
 * forked before either initializes CUDA (a process forked after CUDA
 * initialization cannot use CUDA), connected by a socketpair. Per kind, the
 * exporter allocates 2 x iters buffers; half travel as gpuipc descriptors
 * (gpuipc_buffer_export / gpuipc_buffer_import / gpuipc_buffer_close), the
 * other half as raw driver handles (cuIpcGetMemHandle / cuIpcOpenMemHandle,
 * cuMemPoolExportPointer / cuMemPoolImportPointer, cuMemExportToShareable-
 * Handle / cuMemImportFromShareableHandle + map, memfd + cuMemHostRegister),
 * so that neither path finds the other's mapping in the driver. For
 * mempools each path also has its own pool (imported once per process: one
 * sample each, after an untimed import of a third pool warms the driver's
 * import path).
 */
#define BENCH_NAME "handle"
#include "bench.h"
#include "bench_int.h"
#include "tree.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const gpuipc_pool_kind kinds[] = {GPUIPC_POOL_LEGACY,
                                         GPUIPC_POOL_MEMPOOL, GPUIPC_POOL_VMM,
                                         GPUIPC_POOL_PINNED_HOST};
#define NKINDS 4

/* Medians the importer sends back, per kind. */
typedef struct import_row {
  double import_g, close_g, hit_g, first_g; /* gpuipc */
  double import_r, close_r, pool_r;         /* raw driver */
  int ok;
} import_row;

static double us_since(uint64_t t0) {
  return (double)(gpuipc__now_ns() - t0) / 1000.0;
}

/* The failures here unwind to the function's out: label. */
#define BAIL(...)                                                              \
  do {                                                                         \
    BENCH_SAY(__VA_ARGS__);                                                    \
    goto out;                                                                  \
  } while (0)

static int send_u64(int sock, uint64_t v) {
  return gpuipc_desc_send(sock, (const uint8_t *)&v, sizeof v, NULL, 0) ==
                 GPUIPC_OK
             ? 0
             : -1;
}
static int recv_u64(int sock, uint64_t *v) {
  size_t len = 0;
  int nfds = 0;
  if (gpuipc_desc_recv(sock, (uint8_t *)v, sizeof *v, &len, NULL, &nfds) !=
          GPUIPC_OK ||
      len != sizeof *v)
    return -1;
  return 0;
}

/* ---- the importer (child) ------------------------------------------------------ */

static int importer(int sock, int iters) {
  int rc = 1;
  double *tg = calloc((size_t)iters, sizeof(double));
  double *tc = calloc((size_t)iters, sizeof(double));
  double *th = calloc((size_t)iters, sizeof(double));
  double *tr = calloc((size_t)iters, sizeof(double));
  double *trc = calloc((size_t)iters, sizeof(double));
  CUcontext ctx = NULL;
  if (!tg || !tc || !th || !tr || !trc)
    BAIL("out of memory");
  OK_OR(gpuipc_init(), goto out);
  OK_OR(gpuipc__primary_ctx(0, &ctx), goto out);
  CU_OR(gpuipc__cu.cuCtxSetCurrent(ctx), goto out);
  {
    /* One-time costs of the process (device table, identity, CRC table)
     * are paid here, not in the first timed import. */
    gpuipc_uuid u0;
    int o0;
    gpuipc__identity me;
    OK_OR(gpuipc_device_uuid(0, &u0), goto out);
    OK_OR(gpuipc_device_from_uuid(&u0, &o0), goto out);
    OK_OR(gpuipc__self_identity(&me), goto out);
    (void)gpuipc__crc32c(0, &u0, sizeof u0);
  }
  for (int k = 0; k < NKINDS; k++) {
    gpuipc_pool_kind kind = kinds[k];
    import_row row;
    memset(&row, 0, sizeof row);
    uint64_t ok = 0;
    if (recv_u64(sock, &ok) != 0)
      BAIL("exporter went away");
    if (!ok) { /* the exporter could not make this kind */
      if (gpuipc_desc_send(sock, (uint8_t *)&row, sizeof row, NULL, 0))
        BAIL("send");
      continue;
    }
    CUmemoryPool rawpool = NULL;
    gpuipc_pool *ipool = NULL;
    if (kind == GPUIPC_POOL_MEMPOOL) {
      /* The pools, once: gpuipc's (its descriptor and fd) and the raw
       * path's (a second pool, its fd), both imported for the first time. */
      uint8_t d[GPUIPC_DESC_MAX], d2[GPUIPC_DESC_MAX];
      size_t len = 0, len2 = 0;
      int fd = -1, fd2 = -1, nfds = 1;
      /* A throwaway pool first, imported untimed, so that neither timed
       * import pays the first-call costs of the driver's import path. */
      if (gpuipc_desc_recv(sock, d2, sizeof d2, &len2, &fd2, &nfds) !=
              GPUIPC_OK ||
          nfds != 1)
        BAIL("recv warm-up pool: %s", gpuipc_last_error());
      CUmemoryPool warm = NULL;
      CU_OR(gpuipc__cu.cuMemPoolImportFromShareableHandle(
          &warm, (void *)(uintptr_t)fd2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
          0), goto out);
      close(fd2);
      fd2 = -1;
      nfds = 1;
      if (gpuipc_desc_recv(sock, d, sizeof d, &len, &fd, &nfds) != GPUIPC_OK ||
          nfds != 1)
        BAIL("recv pool: %s", gpuipc_last_error());
      nfds = 1;
      if (gpuipc_desc_recv(sock, d2, sizeof d2, &len2, &fd2, &nfds) !=
              GPUIPC_OK ||
          nfds != 1)
        BAIL("recv raw pool: %s", gpuipc_last_error());
      uint64_t t0 = gpuipc__now_ns();
      CU_OR(gpuipc__cu.cuMemPoolImportFromShareableHandle(
          &rawpool, (void *)(uintptr_t)fd2,
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), goto out);
      row.pool_r = us_since(t0);
      t0 = gpuipc__now_ns();
      OK_OR(gpuipc_pool_import(d, len, fd, NULL, &ipool), goto out);
      row.first_g = us_since(t0);
      close(fd);
      close(fd2);
    }
    for (int i = 0; i < iters; i++) {
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len = 0;
      int fds[1] = {-1}, nfds = 1;
      if (gpuipc_desc_recv(sock, d, sizeof d, &len, fds, &nfds) != GPUIPC_OK)
        BAIL("recv: %s", gpuipc_last_error());
      gpuipc_buffer *b1 = NULL, *b2 = NULL;
      uint64_t t0 = gpuipc__now_ns();
      OK_OR(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b1), goto out);
      tg[i] = us_since(t0);
      t0 = gpuipc__now_ns();
      OK_OR(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b2), goto out);
      th[i] = us_since(t0);
      for (int j = 0; j < nfds; j++)
        close(fds[j]);
      OK_OR(gpuipc_buffer_close(b2), goto out);
      t0 = gpuipc__now_ns();
      OK_OR(gpuipc_buffer_close(b1), goto out);
      tc[i] = us_since(t0);

      /* The raw twin. */
      uint8_t raw[64 + 16];
      nfds = 1;
      fds[0] = -1;
      if (gpuipc_desc_recv(sock, raw, sizeof raw, &len, fds, &nfds) !=
          GPUIPC_OK)
        BAIL("recv raw: %s", gpuipc_last_error());
      uint64_t alloc_size;
      memcpy(&alloc_size, raw + 64, 8);
      CUdeviceptr p = 0;
      void *host = NULL;
      if (kind == GPUIPC_POOL_LEGACY) {
        CUipcMemHandle h;
        memcpy(&h, raw, 64);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuIpcOpenMemHandle(&p, h,
                                         CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), goto out);
        tr[i] = us_since(t0);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuIpcCloseMemHandle(p), goto out);
        trc[i] = us_since(t0);
      } else if (kind == GPUIPC_POOL_MEMPOOL) {
        CUmemPoolPtrExportData e;
        memcpy(&e, raw, 64);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemPoolImportPointer(&p, rawpool, &e), goto out);
        tr[i] = us_since(t0);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemFree(p), goto out);
        trc[i] = us_since(t0);
      } else if (kind == GPUIPC_POOL_VMM) {
        if (nfds < 1)
          BAIL("no VMM fd");
        CUmemGenericAllocationHandle h;
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemImportFromShareableHandle(
            &h, (void *)(uintptr_t)fds[0],
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), goto out);
        CU_OR(gpuipc__cu.cuMemAddressReserve(&p, alloc_size, 0, 0, 0), goto out);
        CU_OR(gpuipc__cu.cuMemMap(p, alloc_size, 0, h, 0), goto out);
        CUmemAccessDesc ad;
        memset(&ad, 0, sizeof ad);
        ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        ad.location.id = 0;
        ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        CU_OR(gpuipc__cu.cuMemSetAccess(p, alloc_size, &ad, 1), goto out);
        CU_OR(gpuipc__cu.cuMemRelease(h), goto out);
        tr[i] = us_since(t0);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemUnmap(p, alloc_size), goto out);
        CU_OR(gpuipc__cu.cuMemAddressFree(p, alloc_size), goto out);
        trc[i] = us_since(t0);
      } else {
        if (nfds < 1)
          BAIL("no memfd");
        t0 = gpuipc__now_ns();
        host = mmap(NULL, alloc_size, PROT_READ | PROT_WRITE, MAP_SHARED,
                    fds[0], 0);
        if (host == MAP_FAILED)
          BAIL("mmap failed");
        CU_OR(gpuipc__cu.cuMemHostRegister(host, alloc_size,
                                        CU_MEMHOSTREGISTER_PORTABLE |
                                            CU_MEMHOSTREGISTER_DEVICEMAP), goto out);
        tr[i] = us_since(t0);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemHostUnregister(host), goto out);
        munmap(host, alloc_size);
        trc[i] = us_since(t0);
      }
      for (int j = 0; j < nfds; j++)
        close(fds[j]);
    }
    if (ipool)
      OK_OR(gpuipc_pool_destroy(ipool), goto out);
    row.import_g = bench_median(tg, iters);
    row.close_g = bench_median(tc, iters);
    row.hit_g = bench_median(th, iters);
    row.import_r = bench_median(tr, iters);
    row.close_r = bench_median(trc, iters);
    row.ok = 1;
    if (gpuipc_desc_send(sock, (uint8_t *)&row, sizeof row, NULL, 0))
      BAIL("send");
  }
  rc = 0;
out:
  free(tg);
  free(tc);
  free(th);
  free(tr);
  free(trc);
  return rc;
}

/* ---- the exporter (this process) ---------------------------------------------------- */

static void print_row(const char *kind, const char *what, double g, double r,
                      const char *raw) {
  char rs[32] = "-", ratio[32] = "-";
  if (r > 0) {
    snprintf(rs, sizeof rs, "%.1f", r);
    snprintf(ratio, sizeof ratio, "%.2fx", g / r);
  }
  printf("%-12s %-26s %12.1f %12s %8s   %s\n", kind, what, g, rs, ratio, raw);
  gpuipc_bench_json_row_begin("handle");
  gpuipc_bench_json_str("kind", kind);
  gpuipc_bench_json_str("operation", what);
  gpuipc_bench_json_num("gpuipc_us", g);
  gpuipc_bench_json_num("raw_us", r > 0 ? r : 0.0 / 0.0);
  gpuipc_bench_json_str("raw_calls", raw);
  gpuipc_bench_json_row_end();
}

static void usage(FILE *f) {
  fprintf(f, "usage: gpuipc bench handle [--iters N] [--size BYTES] "
             "[--json FILE] [--emulator PATH]\n"
             "  export/import per buffer for each pool kind, next to the raw "
             "driver calls\n"
             "  --iters N     buffers per kind (default 100)\n"
             "  --size BYTES  buffer size (default 1 MiB)\n");
}

int gpuipc_bench_handle(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    }
  int picked = gpuipc_bench_pick_driver(&argc, argv, "bench handle");
  if (picked < 0)
    return 2;
  int iters = 100;
  size_t size = 1u << 20;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
      size = (size_t)strtoull(argv[++i], NULL, 0);
    else if (strcmp(argv[i], "all") != 0 && strcmp(argv[i], "handle") != 0) {
      fprintf(stderr, "gpuipc bench handle: unknown option '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (iters < 1 || size == 0) {
    fprintf(stderr, "gpuipc bench handle: bad --iters or --size\n");
    return 2;
  }

  /* The importer is forked before this process touches CUDA. */
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    perror("gpuipc bench handle: socketpair");
    return 1;
  }
  fflush(stdout);
  pid_t child = fork();
  if (child < 0) {
    perror("gpuipc bench handle: fork");
    return 1;
  }
  if (child == 0) {
    close(sv[0]);
    _exit(importer(sv[1], iters));
  }
  close(sv[1]);
  int sock = sv[0];
  int rc = 1;
  double *te = calloc((size_t)iters, sizeof(double));
  double *tr = calloc((size_t)iters, sizeof(double));
  gpuipc_buffer **bufs = calloc((size_t)iters * 2, sizeof *bufs);
  gpuipc_pool *pool = NULL, *pool2 = NULL, *warm = NULL;
  CUcontext ctx = NULL;
  struct {
    double export_g, export_r;
    import_row imp;
    const char *raw_export;
    const char *raw_import;
  } rows[NKINDS];
  memset(rows, 0, sizeof rows);
  if (!te || !tr || !bufs)
    BAIL("out of memory");
  OK_OR(gpuipc_init(), goto out);
  OK_OR(gpuipc__primary_ctx(0, &ctx), goto out);
  /* The primary context stays current, so gpuipc's calls need no push or
   * pop and both paths run in the same context. */
  CU_OR(gpuipc__cu.cuCtxSetCurrent(ctx), goto out);
  char devname[256] = "";
  CUdevice dev;
  if (gpuipc__cu.cuDeviceGet(&dev, 0) == CUDA_SUCCESS)
    gpuipc__cu.cuDeviceGetName(devname, sizeof devname, dev);
  int drv = 0;
  gpuipc_driver_version(&drv);

  for (int k = 0; k < NKINDS; k++) {
    gpuipc_pool_kind kind = kinds[k];
    gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
    o.kind = kind;
    if (gpuipc_pool_create(&o, &pool) != GPUIPC_OK) {
      fprintf(stderr, "gpuipc bench handle: %s: %s (skipped)\n",
              gpuipc_pool_kind_name(kind), gpuipc_last_error());
      if (send_u64(sock, 0))
        BAIL("importer went away");
      size_t len;
      int nfds = 0;
      import_row r;
      if (gpuipc_desc_recv(sock, (uint8_t *)&r, sizeof r, &len, NULL,
                           &nfds) != GPUIPC_OK)
        BAIL("importer: %s", gpuipc_last_error());
      pool = NULL;
      continue;
    }
    /* The raw path's buffers come from a second pool, so that each path
     * imports its own pool for the first time. */
    OK_OR(gpuipc_pool_create(&o, &pool2), goto out);
    if (send_u64(sock, 1))
      BAIL("importer went away");
    for (int i = 0; i < 2 * iters; i++)
      OK_OR(gpuipc_buffer_alloc(i % 2 ? pool2 : pool, size, NULL, &bufs[i]), goto out);
    CU_OR(gpuipc__cu.cuCtxSynchronize(), goto out);
    if (kind == GPUIPC_POOL_MEMPOOL) {
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len = 0;
      int fd = -1;
      OK_OR(gpuipc_pool_create(&o, &warm), goto out);
      OK_OR(gpuipc_pool_export(warm, d, sizeof d, &len, &fd), goto out);
      OK_OR(gpuipc_desc_send(sock, d, len, &fd, 1), goto out);
      close(fd);
      OK_OR(gpuipc_pool_export(pool, d, sizeof d, &len, &fd), goto out);
      OK_OR(gpuipc_desc_send(sock, d, len, &fd, 1), goto out);
      close(fd);
      OK_OR(gpuipc_pool_export(pool2, d, sizeof d, &len, &fd), goto out);
      OK_OR(gpuipc_desc_send(sock, d, len, &fd, 1), goto out);
      close(fd);
    }
    for (int i = 0; i < iters; i++) {
      gpuipc_buffer *b = bufs[2 * i], *rb = bufs[2 * i + 1];
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len = 0;
      int fds[1] = {-1}, nfds = 1;
      uint64_t t0 = gpuipc__now_ns();
      OK_OR(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds), goto out);
      te[i] = us_since(t0);
      OK_OR(gpuipc_desc_send(sock, d, len, fds, nfds), goto out);
      for (int j = 0; j < nfds; j++)
        close(fds[j]);

      uint8_t raw[64 + 16];
      memset(raw, 0, sizeof raw);
      gpuipc__buffer_info ri;
      OK_OR(gpuipc__buffer_info_get(rb, &ri), goto out);
      uint64_t alloc_size = ri.alloc_size;
      memcpy(raw + 64, &alloc_size, 8);
      int rfd = -1;
      if (kind == GPUIPC_POOL_LEGACY) {
        CUipcMemHandle h;
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuIpcGetMemHandle(&h, ri.base), goto out);
        tr[i] = us_since(t0);
        memcpy(raw, &h, 64);
        rows[k].raw_export = "cuIpcGetMemHandle";
        rows[k].raw_import = "cuIpcOpenMemHandle / cuIpcCloseMemHandle";
      } else if (kind == GPUIPC_POOL_MEMPOOL) {
        /* The driver writes only the first 48 of the 64 bytes. */
        CUmemPoolPtrExportData e;
        memset(&e, 0, sizeof e);
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemPoolExportPointer(&e, ri.base), goto out);
        tr[i] = us_since(t0);
        memcpy(raw, &e, 64);
        rows[k].raw_export = "cuMemPoolExportPointer";
        rows[k].raw_import = "cuMemPoolImportPointer / cuMemFree";
      } else if (kind == GPUIPC_POOL_VMM) {
        t0 = gpuipc__now_ns();
        CU_OR(gpuipc__cu.cuMemExportToShareableHandle(
            &rfd, (CUmemGenericAllocationHandle)ri.vmm, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), goto out);
        tr[i] = us_since(t0);
        rows[k].raw_export = "cuMemExportToShareableHandle";
        rows[k].raw_import = "cuMemImportFromShareableHandle+Reserve+Map+"
                             "SetAccess / Unmap+AddressFree";
      } else {
        t0 = gpuipc__now_ns();
        rfd = fcntl(ri.fd, F_DUPFD_CLOEXEC, 0);
        tr[i] = us_since(t0);
        rows[k].raw_export = "dup of the memfd (no driver call)";
        rows[k].raw_import = "mmap+cuMemHostRegister / Unregister+munmap";
      }
      OK_OR(gpuipc_desc_send(sock, raw, sizeof raw, &rfd, rfd >= 0 ? 1 : 0), goto out);
      if (rfd >= 0)
        close(rfd);
    }
    rows[k].export_g = bench_median(te, iters);
    rows[k].export_r = bench_median(tr, iters);
    size_t len;
    int nfds = 0;
    if (gpuipc_desc_recv(sock, (uint8_t *)&rows[k].imp, sizeof rows[k].imp,
                         &len, NULL, &nfds) != GPUIPC_OK)
      BAIL("importer: %s", gpuipc_last_error());
    for (int i = 0; i < 2 * iters; i++) {
      OK_OR(gpuipc_buffer_free(bufs[i], NULL), goto out);
      bufs[i] = NULL;
    }
    CU_OR(gpuipc__cu.cuCtxSynchronize(), goto out);
    OK_OR(gpuipc_pool_destroy(pool), goto out);
    OK_OR(gpuipc_pool_destroy(pool2), goto out);
    OK_OR(gpuipc_pool_destroy(warm), goto out);
    pool = pool2 = warm = NULL;
  }

  printf("gpuipc bench handle: %d buffers of %zu bytes per kind, two "
         "processes, medians in microseconds\n",
         iters, size);
  printf("device 0: %s, driver %d.%d (%s)\n", devname[0] ? devname : "?",
         drv / 1000, (drv % 1000) / 10, gpuipc_driver_path());
  gpuipc_bench_json_num("buffers_per_kind", iters);
  gpuipc_bench_json_num("size_bytes", (double)size);
  gpuipc_bench_json_str("device_name", devname[0] ? devname : "?");
  printf("%-12s %-26s %12s %12s %8s   %s\n", "kind", "operation", "gpuipc us",
         "raw us", "ratio", "raw driver calls");
  for (int k = 0; k < NKINDS; k++) {
    const char *kn = gpuipc_pool_kind_name(kinds[k]);
    if (!rows[k].imp.ok) {
      printf("%-12s (not available on this device)\n", kn);
      gpuipc_bench_json_row_begin("unavailable");
      gpuipc_bench_json_str("kind", kn);
      gpuipc_bench_json_row_end();
      continue;
    }
    print_row(kn, "export", rows[k].export_g, rows[k].export_r,
              rows[k].raw_export);
    print_row(kn, "import (first open)", rows[k].imp.import_g,
              rows[k].imp.import_r, rows[k].raw_import);
    print_row(kn, "close (last reference)", rows[k].imp.close_g,
              rows[k].imp.close_r, "");
    print_row(kn, "import (cache hit)", rows[k].imp.hit_g, 0,
              "no driver call");
    if (kinds[k] == GPUIPC_POOL_MEMPOOL)
      print_row(kn, "pool import (once)", rows[k].imp.first_g,
                rows[k].imp.pool_r,
                "cuMemPoolImportFromShareableHandle (one sample each)");
  }
  rc = 0;
out:
  if (bufs) {
    for (int i = 0; i < 2 * iters; i++)
      gpuipc_buffer_free(bufs[i], NULL);
  }
  gpuipc_pool_destroy(pool);
  gpuipc_pool_destroy(pool2);
  gpuipc_pool_destroy(warm);
  close(sock);
  int st = 0;
  waitpid(child, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "gpuipc bench handle: the importer failed\n");
    rc = 1;
  }
  free(te);
  free(tr);
  free(bufs);
  return rc;
}
