/*
 * bench-mpi.c: gpuipc-bench-mpi, the benchmark of gpuipc_mpi_send / recv
 * (run by `gpuipc bench mpi` under mpirun, or directly:
 * mpirun -n 2 gpuipc-bench-mpi [--quick] [--iters N] [--max-mib N]).
 *
 * An MPI program of its own: every rank must call MPI_Init, and gpuipc's
 * library and CLI never link MPI. Two ranks (others idle); in one run:
 *   local:  gpuipc_mpi_send -> gpuipc_mpi_recv between two ranks of one
 *           machine (the node-local path: GPU to GPU) against MPI_Send /
 *           MPI_Recv of the same bytes in host memory between the same
 *           ranks;
 *   staged: the same calls with the ranks taken as two machines
 *           (GPUIPC_MPI_SIMULATE_MACHINES=2, CUDA-awareness off, set for a
 *           second gpuipc_mpi_init only), so the bytes go device -> pinned
 *           host -> MPI -> pinned host -> device in chunks, against the sum
 *           of a plain copy (the slower of the sender's device -> pinned
 *           host and the receiver's pinned host -> device copy, one DMA
 *           each) and a plain MPI transfer of pinned host memory; and
 *           `bound`, the staged rate over min(copy rate, MPI rate) (the
 *           target: >= 80% from 64 MiB).
 * Times are medians over the iterations, taken by the receiver from a
 * barrier until its stream has the data. On the emulator the figures mean
 * nothing (--quick keeps it short for CI).
 */
#include <mpi.h>

#include <gpuipc.h>
#include <gpuipc/mpi.h>

#include "../bench_int.h"
#include "tree.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank_;

#define CHECK(what, expr)                                                      \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK) {                                                     \
      fprintf(stderr, "rank %d: %s: %s: %s\n", rank_, what,                    \
              gpuipc_status_name(s_), gpuipc_last_error());                    \
      MPI_Abort(MPI_COMM_WORLD, 1);                                            \
    }                                                                          \
  } while (0)

typedef struct ctx {
  gpuipc_xfer *x;
  gpuipc_event *ev;
  void *dev;          /* device buffer of max bytes */
  void *dev2;         /* another: the device-to-device floor's destination */
  int ordinal;        /* the device's ordinal here */
  unsigned char *pin; /* pinned host buffer of max bytes */
  unsigned char *host;/* pageable host buffer of max bytes */
  int iters;
} ctx;

enum op { OP_GPUIPC, OP_MPI_HOST, OP_D2H, OP_H2D, OP_D2D };

/* Median seconds of one op of n bytes from rank 0 to rank 1, timed on
 * rank 1 (the result is broadcast). */
static double run(ctx *c, gpuipc_mpi *g, enum op op, size_t n,
                  gpuipc_mpi_path *path) {
  double *t = calloc((size_t)c->iters + 1, sizeof *t);
  for (int it = -1; it < c->iters; it++) { /* one warm-up */
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    gpuipc_mpi_transfer_info info = GPUIPC_MPI_TRANSFER_INFO_INIT;
    switch (op) {
    case OP_GPUIPC:
      if (rank_ == 0)
        CHECK("gpuipc_mpi_send", gpuipc_mpi_send(g, c->dev, n, 1, 1, NULL, &info));
      else if (rank_ == 1)
        CHECK("gpuipc_mpi_recv", gpuipc_mpi_recv(g, c->dev, n, 0, 1, NULL, &info));
      if (path && rank_ == 1)
        *path = info.path;
      break;
    case OP_MPI_HOST:
      if (rank_ == 0)
        MPI_Send(c->pin, (int)n, MPI_BYTE, 1, 2, MPI_COMM_WORLD);
      else if (rank_ == 1)
        MPI_Recv(c->pin, (int)n, MPI_BYTE, 0, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      break;
    case OP_D2H:
      CHECK("gpuipc_xfer_to_host",
            gpuipc_xfer_to_host(c->x, c->pin, c->dev, n, NULL, 0));
      break;
    case OP_H2D:
      CHECK("gpuipc_xfer_to_device",
            gpuipc_xfer_to_device(c->x, c->dev, c->pin, n, NULL, 0));
      break;
    case OP_D2D: /* the node-local floor: one copy on the receiver's device */
      if (rank_ == 1) {
        gpuipc__ctx_guard cg;
        CHECK("primary context", gpuipc__ctx_enter(&cg, c->ordinal));
        CUresult cr = gpuipc__cu.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)c->dev2,
                                                   (CUdeviceptr)(uintptr_t)c->dev, n,
                                                   (CUstream)0);
        gpuipc__ctx_leave(&cg);
        if (cr != CUDA_SUCCESS) {
          fprintf(stderr, "rank 1: cuMemcpyDtoDAsync: %s\n", gpuipc__cuda_error_name(cr));
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
      }
      break;
    }
    CHECK("gpuipc_event_record", gpuipc_event_record(c->ev, NULL));
    CHECK("gpuipc_event_synchronize", gpuipc_event_synchronize(c->ev));
    double dt = MPI_Wtime() - t0;
    /* A copy is timed on the rank that does it (D2H: the sender, H2D: the
     * receiver); transfers on the receiver. */
    int timer = op == OP_D2H ? 0 : 1;
    MPI_Bcast(&dt, 1, MPI_DOUBLE, timer, MPI_COMM_WORLD);
    if (it >= 0)
      t[it] = dt;
  }
  if (path) {
    int p = (int)*path;
    MPI_Bcast(&p, 1, MPI_INT, 1, MPI_COMM_WORLD);
    *path = (gpuipc_mpi_path)p;
  }
  double m = bench_median(t, c->iters);
  free(t);
  return m;
}

static double gbs(size_t n, double s) { return s > 0 ? (double)n / s / 1e9 : 0; }

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int quick = 0, iters = 0;
  size_t max_mib = 256;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0)
      quick = 1;
    else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (strcmp(argv[i], "--max-mib") == 0 && i + 1 < argc)
      max_mib = (size_t)atol(argv[++i]);
    else {
      int help = strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0;
      if (rank_ == 0)
        fprintf(help ? stdout : stderr,
                "usage: mpirun -n 2 gpuipc-bench-mpi [--quick] "
                "[--iters N] [--max-mib N]\n");
      MPI_Finalize();
      return help ? 0 : 2;
    }
  }
  if (size < 2) {
    if (rank_ == 0)
      fprintf(stderr, "gpuipc-bench-mpi: needs 2 ranks (mpirun -n 2)\n");
    MPI_Finalize();
    return 2;
  }
  if (quick) {
    max_mib = 4;
    if (iters == 0)
      iters = 3;
  }
  if (iters <= 0)
    iters = 10;

  /* The real topology, and the same ranks taken as two machines with
   * staging forced (the environment is read by gpuipc_mpi_init only). */
  gpuipc_mpi *gl = NULL, *gr = NULL;
  CHECK("gpuipc_mpi_init", gpuipc_mpi_init(MPI_COMM_WORLD, NULL, &gl));
  char *sim = getenv("GPUIPC_MPI_SIMULATE_MACHINES");
  char *aware = getenv("GPUIPC_MPI_CUDA_AWARE");
  sim = sim ? strdup(sim) : NULL;
  aware = aware ? strdup(aware) : NULL;
  setenv("GPUIPC_MPI_SIMULATE_MACHINES", "2", 1);
  setenv("GPUIPC_MPI_CUDA_AWARE", "0", 1);
  CHECK("gpuipc_mpi_init (two machines)",
        gpuipc_mpi_init(MPI_COMM_WORLD, NULL, &gr));
  if (sim) setenv("GPUIPC_MPI_SIMULATE_MACHINES", sim, 1);
  else unsetenv("GPUIPC_MPI_SIMULATE_MACHINES");
  if (aware) setenv("GPUIPC_MPI_CUDA_AWARE", aware, 1);
  else unsetenv("GPUIPC_MPI_CUDA_AWARE");
  free(sim);
  free(aware);

  ctx c = {0};
  c.iters = iters;
  size_t max = max_mib << 20;
  gpuipc_pool *dpool = NULL, *hpool = NULL;
  gpuipc_buffer *db = NULL, *hb = NULL, *db2 = NULL;
  int count = 0;
  CHECK("gpuipc_device_count", gpuipc_device_count(&count));
  gpuipc_uuid dev;
  CHECK("gpuipc_device_uuid",
        gpuipc_device_uuid(gpuipc_mpi_get_local_rank(gl) % (count ? count : 1), &dev));
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_LEGACY; /* cudaMalloc memory, as applications have */
  po.device = &dev;
  CHECK("gpuipc_pool_create", gpuipc_pool_create(&po, &dpool));
  CHECK("gpuipc_buffer_alloc", gpuipc_buffer_alloc(dpool, max, NULL, &db));
  CHECK("gpuipc_buffer_alloc", gpuipc_buffer_alloc(dpool, max, NULL, &db2));
  c.ordinal = gpuipc_mpi_get_local_rank(gl) % (count ? count : 1);
  po.kind = GPUIPC_POOL_PINNED_HOST;
  CHECK("gpuipc_pool_create", gpuipc_pool_create(&po, &hpool));
  CHECK("gpuipc_buffer_alloc", gpuipc_buffer_alloc(hpool, max, NULL, &hb));
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(&dev, NULL, &c.x));
  CHECK("gpuipc_event_create", gpuipc_event_create(&dev, &c.ev));
  c.dev = gpuipc_buffer_get_ptr(db);
  c.dev2 = gpuipc_buffer_get_ptr(db2);
  c.pin = gpuipc_buffer_get_ptr(hb);
  memset(c.pin, 0x5a, max);

  int local = gpuipc_mpi_get_conn(gl, rank_ == 0 ? 1 : 0) != NULL;
  /* `gpuipc bench mpi --json` asks for the figures as records in a file
   * (tools/bench.c turns them into the JSON report's rows). */
  FILE *rows = NULL;
  const char *rows_path = getenv("GPUIPC_BENCH_ROWS");
  if (rank_ == 0 && rows_path && *rows_path) {
    rows = fopen(rows_path, "w");
    if (rows == NULL)
      fprintf(stderr, "gpuipc-bench-mpi: %s: %s (no JSON rows)\n", rows_path,
              strerror(errno));
  }
  if (rows) {
    fprintf(rows, "info\tnum\titerations\t%d\ninfo\tnum\tquick\t%d\n", iters,
            quick);
    fprintf(rows, "info\tnum\tone_machine\t%d\ninfo\tnum\tcuda_aware\t%d\n",
            local, gpuipc_mpi_is_cuda_aware(gl));
  }
  if (rank_ == 0) {
    printf("gpuipc bench mpi: 2 of %d ranks, %s, MPI %sCUDA-aware, %d "
           "iterations (medians)%s\n",
           size, local ? "one machine" : "two machines",
           gpuipc_mpi_is_cuda_aware(gl) ? "" : "not ", iters,
           quick ? ", --quick" : "");
    if (!local)
      printf("  (ranks 0 and 1 run on different machines: no node-local part)\n");
    printf("%10s | %-46s | %-56s\n", "", "node-local path",
           "staged path (two machines)");
    printf("%10s | %9s %9s %8s %9s %6s | %9s %9s %9s %9s %7s %6s\n", "bytes",
           "gpuipc", "MPI host", "ratio", "d2d copy", "of it", "staged", "copy",
           "MPI", "sum", "vs sum", "bound");
  }
  for (size_t n = (size_t)1 << 20; n <= max; n *= 4) {
    double tl = 0, th = 0, tdd = 0;
    gpuipc_mpi_path pl = GPUIPC_MPI_PATH_NONE, pr = GPUIPC_MPI_PATH_NONE;
    if (local) {
      tl = run(&c, gl, OP_GPUIPC, n, &pl);
      th = run(&c, gl, OP_MPI_HOST, n, NULL);
      tdd = run(&c, gl, OP_D2D, n, NULL);
    }
    double ts = run(&c, gr, OP_GPUIPC, n, &pr);
    double td = run(&c, gr, OP_D2H, n, NULL);
    double tu = run(&c, gr, OP_H2D, n, NULL);
    double tm = run(&c, gr, OP_MPI_HOST, n, NULL);
    double tc = td > tu ? td : tu;
    double bound = (tc > tm ? tc : tm) / ts; /* staged / min(copy, MPI) rate */
    if (rank_ == 0) {
      char l1[16] = "-", l2[16] = "-", l3[16] = "-", l4[16] = "-", l5[16] = "-";
      if (local) {
        snprintf(l1, sizeof l1, "%.2f", gbs(n, tl));
        snprintf(l2, sizeof l2, "%.2f", gbs(n, th));
        snprintf(l3, sizeof l3, "%.2fx", th / tl);
        snprintf(l4, sizeof l4, "%.2f", gbs(n, tdd));
        snprintf(l5, sizeof l5, "%.0f%%", 100 * tdd / tl);
      }
      printf("%7zu MiB | %9s %9s %8s %9s %6s | %9.2f %9.2f %9.2f %9.2f %6.0f%% %5.0f%%%s\n",
             n >> 20, l1, l2, l3, l4, l5, gbs(n, ts), gbs(n, tc), gbs(n, tm),
             gbs(n, tc + tm), 100 * (tc + tm) / ts, 100 * bound,
             n >= ((size_t)64 << 20) ? (bound >= 0.8 ? "  (>= 80%: met)"
                                                     : "  (>= 80%: NOT met)")
                                     : "");
      if (rows) {
        double nan = 0.0 / 0.0;
        fprintf(rows, "row\tmpi\nnum\tsize_bytes\t%zu\n", n);
        fprintf(rows, "num\tlocal_gbps\t%.6g\nnum\tmpi_host_gbps\t%.6g\n",
                local ? gbs(n, tl) : nan, local ? gbs(n, th) : nan);
        fprintf(rows, "num\td2d_gbps\t%.6g\nnum\tlocal_fraction\t%.6g\n",
                local ? gbs(n, tdd) : nan, local ? tdd / tl : nan);
        fprintf(rows, "num\tstaged_gbps\t%.6g\nnum\tcopy_gbps\t%.6g\n",
                gbs(n, ts), gbs(n, tc));
        fprintf(rows, "num\tmpi_gbps\t%.6g\nnum\tsum_gbps\t%.6g\n",
                gbs(n, tm), gbs(n, tc + tm));
        fprintf(rows, "num\tbound_fraction\t%.6g\n", bound);
        fprintf(rows, "str\tlocal_path\t%s\nstr\tremote_path\t%s\nend\n",
                gpuipc_mpi_path_name(pl), gpuipc_mpi_path_name(pr));
      }
      if ((local && pl != GPUIPC_MPI_PATH_LOCAL) || pr != GPUIPC_MPI_PATH_STAGED)
        printf("  note: paths taken: %s, %s\n", gpuipc_mpi_path_name(pl),
               gpuipc_mpi_path_name(pr));
    }
  }
  if (rows)
    fclose(rows);
  if (rank_ == 0)
    printf("GB/s (1e9 bytes/s). ratio: MPI host time / gpuipc time. d2d copy: "
           "one cuMemcpyDtoDAsync of the same bytes on the receiver's device, timed "
           "the same way (the node-local floor); of it: gpuipc's rate / that "
           "(target >= 90%% from 64 MiB). vs sum: (copy + MPI time) / staged time. "
           "bound: staged rate / min(copy, MPI rate).\n");
  gpuipc_event_destroy(c.ev);
  gpuipc_xfer_destroy(c.x);
  gpuipc_buffer_free(db, NULL);
  gpuipc_buffer_free(db2, NULL);
  gpuipc_buffer_free(hb, NULL);
  gpuipc_pool_destroy(dpool);
  gpuipc_pool_destroy(hpool);
  gpuipc_mpi_finalize(gr);
  gpuipc_mpi_finalize(gl);
  MPI_Finalize();
  return 0;
}
