/*
 * copy.c: `gpuipc bench copy`: host<->device copies, plain driver calls
 * against gpuipc's copy engine, for pinned and pageable host memory and for
 * copy-in -> stage -> copy-out, with the bounds measured in the same run:
 *   - one-way bound: a raw pinned cuMemcpy{HtoD,DtoH}Async of the same size;
 *   - both-ways bound: a pinned HtoD and a pinned DtoH of the same size at
 *     once on two streams (bytes moved both ways / time).
 * Every figure is the median of several repetitions, in GB/s (1e9 bytes/s).
 * The stage of the pipeline is a device-to-device copy of the chunk
 * (gpuipc launches no kernels).
 */
#define BENCH_NAME "copy"
#include "bench.h"
#include "bench_int.h"
#include "tree.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MIB ((size_t)1 << 20)

typedef struct bench {
  int device;
  int reps;
  CUstream s1, s2;
  gpuipc_xfer *x;
  /* buffers of the largest size */
  size_t cap;
  CUdeviceptr dev_a, dev_b, dev_c;
  char *pin_a, *pin_b;
  char *page_a, *page_b;
  gpuipc_xfer_shared *sh; /* one slot of the largest size, pinned */
  uint64_t seq;
} bench;

enum which {
  RAW_H2D_PINNED,
  RAW_D2H_PINNED,
  RAW_BOTH_PINNED,
  RAW_H2D_PAGEABLE,
  RAW_D2H_PAGEABLE,
  RAW_SERIAL_PIPE, /* H2D, D2D, D2H of the whole buffer on one stream */
  X_H2D_PINNED,
  X_D2H_PINNED,
  X_H2D_PAGEABLE,
  X_D2H_PAGEABLE,
  X_PIPE_PINNED,
  X_PIPE_PAGEABLE,
  X_PIPE_PAGEABLE_SERIAL, /* pageable pipeline done plainly: cuMemcpy + D2D */
  X_SHARED_H2D /* publish + gpuipc_xfer_shared_to_device from the segment */
};

static gpuipc_status d2d_stage(void *user, struct CUstream_st *stream,
                               void *din, void *dout, size_t off, size_t len) {
  (void)user;
  (void)off;
  CUresult r = gpuipc__cu.cuMemcpyDtoDAsync(
      (CUdeviceptr)(uintptr_t)dout, (CUdeviceptr)(uintptr_t)din, len, stream);
  return r == CUDA_SUCCESS ? GPUIPC_OK : GPUIPC_E_DRIVER;
}

/* One run of a case; returns seconds, or < 0 on failure. */
static double run_once(bench *b, int which, size_t n) {
  gpuipc_xfer_stage st = GPUIPC_XFER_STAGE_INIT;
  st.fn = d2d_stage;
  uint64_t t0 = gpuipc__now_ns();
  switch (which) {
  case RAW_H2D_PINNED:
    CU_OR(gpuipc__cu.cuMemcpyHtoDAsync(b->dev_a, b->pin_a, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case RAW_D2H_PINNED:
    CU_OR(gpuipc__cu.cuMemcpyDtoHAsync(b->pin_b, b->dev_b, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case RAW_BOTH_PINNED:
    CU_OR(gpuipc__cu.cuMemcpyHtoDAsync(b->dev_a, b->pin_a, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuMemcpyDtoHAsync(b->pin_b, b->dev_b, n, b->s2), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s2), return -1);
    break;
  case RAW_H2D_PAGEABLE:
    /* cuMemcpyHtoD from pageable memory may return once the source is in
     * the driver's staging, its DMA still running on the legacy stream:
     * the window ends, as gpuipc's does, with the data on the device. */
    CU_OR(gpuipc__cu.cuMemcpyHtoD(b->dev_a, b->page_a, n), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(NULL), return -1);
    break;
  case RAW_D2H_PAGEABLE:
    CU_OR(gpuipc__cu.cuMemcpyDtoH(b->page_b, b->dev_b, n), return -1);
    break;
  case RAW_SERIAL_PIPE:
    CU_OR(gpuipc__cu.cuMemcpyHtoDAsync(b->dev_a, b->pin_a, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuMemcpyDtoDAsync(b->dev_c, b->dev_a, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuMemcpyDtoHAsync(b->pin_b, b->dev_c, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_PIPE_PAGEABLE_SERIAL:
    /* s1 does not wait for the legacy stream, where the H2D's DMA may
     * still run. */
    CU_OR(gpuipc__cu.cuMemcpyHtoD(b->dev_a, b->page_a, n), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(NULL), return -1);
    CU_OR(gpuipc__cu.cuMemcpyDtoDAsync(b->dev_c, b->dev_a, n, b->s1), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    CU_OR(gpuipc__cu.cuMemcpyDtoH(b->page_b, b->dev_c, n), return -1);
    break;
  case X_H2D_PINNED:
    OK_OR(gpuipc_xfer_to_device(b->x, (void *)(uintptr_t)b->dev_a, b->pin_a, n,
                                b->s1, 0), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_D2H_PINNED:
    OK_OR(gpuipc_xfer_to_host(b->x, b->pin_b, (void *)(uintptr_t)b->dev_b, n,
                              b->s1, 0), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_H2D_PAGEABLE:
    OK_OR(gpuipc_xfer_to_device(b->x, (void *)(uintptr_t)b->dev_a, b->page_a, n,
                                b->s1, 0), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_D2H_PAGEABLE:
    OK_OR(gpuipc_xfer_to_host(b->x, b->page_b, (void *)(uintptr_t)b->dev_b, n,
                              b->s1, 0), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_PIPE_PINNED:
    OK_OR(gpuipc_xfer_pipeline(b->x, b->pin_b, b->pin_a, n, &st, b->s1, 0), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_PIPE_PAGEABLE:
    OK_OR(gpuipc_xfer_pipeline(b->x, b->page_b, b->page_a, n, &st, b->s1, 0), return -1);
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  case X_SHARED_H2D: {
    /* The filler's side is in this process too: its acquire and publish
     * are two word operations, then the stream waits, copies, marks. */
    void *p;
    size_t cap;
    OK_OR(gpuipc_xfer_shared_acquire(b->sh, b->seq, 10000, &p, &cap), return -1);
    OK_OR(gpuipc_xfer_shared_publish(b->sh, b->seq, n), return -1);
    OK_OR(gpuipc_xfer_shared_to_device(
        b->sh, b->seq, (void *)(uintptr_t)b->dev_a, n, b->s1, 0), return -1);
    b->seq++;
    CU_OR(gpuipc__cu.cuStreamSynchronize(b->s1), return -1);
    break;
  }
  }
  return (double)(gpuipc__now_ns() - t0) / 1e9;
}

#define NCASES (X_SHARED_H2D + 1)

/* Median rates in GB/s of every case at size n: one warm-up each, then the
 * repetitions interleaved (case after case, round after round), so that a
 * drift of the machine during the run hits every case alike. A pipeline
 * moves 2n bytes (both ways), the others n. Returns -1 on failure. */
static int rates(bench *b, size_t n, double out[NCASES]) {
  static double t[NCASES][64];
  for (int c = 0; c < NCASES; c++)
    if (run_once(b, c, n) < 0)
      return -1;
  for (int i = 0; i < b->reps; i++)
    for (int c = 0; c < NCASES; c++)
      if ((t[c][i] = run_once(b, c, n)) < 0)
        return -1;
  for (int c = 0; c < NCASES; c++) {
    double moved = (double)n;
    if (c == RAW_BOTH_PINNED || c == RAW_SERIAL_PIPE || c == X_PIPE_PINNED ||
        c == X_PIPE_PAGEABLE || c == X_PIPE_PAGEABLE_SERIAL)
      moved *= 2;
    double m = bench_median(t[c], b->reps);
    out[c] = m > 0 ? moved / m / 1e9 : 0;
  }
  return 0;
}

static int parse_size(const char *s, size_t *out) {
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || v <= 0)
    return -1;
  size_t mul = 1;
  if (*end == 'k' || *end == 'K')
    mul = (size_t)1 << 10;
  else if (*end == 'm' || *end == 'M')
    mul = MIB;
  else if (*end == 'g' || *end == 'G')
    mul = (size_t)1 << 30;
  else if (*end != '\0')
    return -1;
  *out = (size_t)(v * (double)mul);
  return 0;
}

static void size_text(size_t n, char *buf, size_t cap) {
  if (n >= ((size_t)1 << 30) && n % ((size_t)1 << 30) == 0)
    snprintf(buf, cap, "%zu GiB", n >> 30);
  else if (n >= MIB && n % MIB == 0)
    snprintf(buf, cap, "%zu MiB", n >> 20);
  else if (n >= 1024 && n % 1024 == 0)
    snprintf(buf, cap, "%zu KiB", n >> 10);
  else
    snprintf(buf, cap, "%zu B", n);
}

/* ---- the peers, through Python, in the same run ------------------------------------- */

/* What a data loader does with a pageable array, timed the way the rows
 * above are (a warm-up, then the median of the repetitions; each ends
 * with the device synchronized, so the bytes have arrived): torch's
 * tensor.to("cuda") of a pageable tensor, tensor.pin_memory().to("cuda",
 * non_blocking=True) (the pinning copy included), tensor.cpu() into
 * pageable memory; CuPy's cupy.asarray of a numpy array and
 * cupy.asnumpy. argv: sizes (comma-separated bytes), repetitions, device.
 * Prints "peer SIZE CASE GBPS" lines, and "skip WHAT: REASON" for a peer
 * that cannot run here. */
static const char peers_py[] =
    "import sys, time, statistics\n"
    "sizes = [int(x) for x in sys.argv[1].split(',')]\n"
    "reps, dev = int(sys.argv[2]), int(sys.argv[3])\n"
    "def rate(n, f):\n"
    "    f()\n"
    "    ts = []\n"
    "    for _ in range(reps):\n"
    "        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)\n"
    "    return n / statistics.median(ts) / 1e9\n"
    "def say(n, case, f):\n"
    "    try:\n"
    "        print('peer %d %s %.4f' % (n, case, rate(n, f)), flush=True)\n"
    "    except Exception as e:\n"
    "        print('skip %s: %s: %s' % (case, type(e).__name__, str(e).splitlines()[0] if str(e) else ''), flush=True)\n"
    "try:\n"
    "    import numpy as np\n"
    "except Exception as e:\n"
    "    print('skip numpy: %s' % e, flush=True); sys.exit(0)\n"
    "torch = cp = None\n"
    "try:\n"
    "    import torch\n"
    "    if not torch.cuda.is_available(): raise RuntimeError('torch.cuda.is_available() is False')\n"
    "    torch.cuda.set_device(dev)\n"
    "except Exception as e:\n"
    "    torch = None; print('skip torch: %s: %s' % (type(e).__name__, e), flush=True)\n"
    "try:\n"
    "    import cupy as cp\n"
    "    cp.cuda.Device(dev).use()\n"
    "except Exception as e:\n"
    "    cp = None; print('skip cupy: %s: %s' % (type(e).__name__, e), flush=True)\n"
    "for n in sizes:\n"
    "    a = np.ones(n, dtype=np.uint8)\n"
    "    if torch is not None:\n"
    "        t = torch.from_numpy(a)\n"
    "        d = torch.ones(n, dtype=torch.uint8, device='cuda')\n"
    "        def to_cuda(): t.to('cuda'); torch.cuda.synchronize()\n"
    "        def pin_to_cuda(): t.pin_memory().to('cuda', non_blocking=True); torch.cuda.synchronize()\n"
    "        def to_cpu(): d.cpu(); torch.cuda.synchronize()\n"
    "        say(n, 'torch_to_cuda', to_cuda)\n"
    "        say(n, 'torch_pin_to_cuda', pin_to_cuda)\n"
    "        say(n, 'torch_cpu', to_cpu)\n"
    "        del t, d\n"
    "        torch.cuda.empty_cache()\n"
    "    if cp is not None:\n"
    "        dc = cp.ones(n, dtype=cp.uint8)\n"
    "        def asarray(): cp.asarray(a); cp.cuda.Device(dev).synchronize()\n"
    "        def asnumpy(): cp.asnumpy(dc); cp.cuda.Device(dev).synchronize()\n"
    "        say(n, 'cupy_asarray', asarray)\n"
    "        say(n, 'cupy_asnumpy', asnumpy)\n"
    "        del dc\n"
    "        cp.get_default_memory_pool().free_all_blocks()\n";

enum { PEER_CASES = 5, PEER_SIZES = 24 };

static const struct {
  const char *key;   /* the script's name of the case */
  const char *label; /* the table's */
  bool to_device;    /* compared with gpuipc's H2D pageable, else D2H */
} peer_case[PEER_CASES] = {
    {"torch_to_cuda", "torch .to(\"cuda\")", true},
    {"torch_pin_to_cuda", "torch pin_memory().to()", true},
    {"cupy_asarray", "cupy.asarray", true},
    {"torch_cpu", "torch .cpu()", false},
    {"cupy_asnumpy", "cupy.asnumpy", false},
};

typedef struct peers {
  size_t n;                /* sizes */
  size_t size[PEER_SIZES];
  double gpuipc_h2d[PEER_SIZES], gpuipc_d2h[PEER_SIZES]; /* pageable, GB/s */
  double rate[PEER_SIZES][PEER_CASES];                   /* 0: not measured */
  char skipped[512];                                     /* "; "-separated */
} peers;

/* One line of peers_py's output into p. */
static void peers_line(peers *p, const char *line) {
  size_t n;
  char key[64];
  double gbps;
  if (sscanf(line, "peer %zu %63s %lf", &n, key, &gbps) == 3) {
    for (size_t i = 0; i < p->n; i++)
      for (int c = 0; c < PEER_CASES; c++)
        if (p->size[i] == n && strcmp(peer_case[c].key, key) == 0)
          p->rate[i][c] = gbps;
  } else if (strncmp(line, "skip ", 5) == 0) {
    if (strstr(p->skipped, line + 5) == NULL)
      gpuipc__appendf(p->skipped, sizeof p->skipped, "%s%s",
                      *p->skipped ? "; " : "", line + 5);
  }
}

/* Runs peers_py with python (through PATH when it has no '/'), reading
 * its lines into p; at most limit_s seconds. Returns 0, or -1 with why. */
static int peers_run(peers *p, const char *python, int reps, int device,
                     int limit_s, char *why, size_t why_cap) {
  char sizes[PEER_SIZES * 24] = "", rs[16], ds[16];
  for (size_t i = 0; i < p->n; i++)
    gpuipc__appendf(sizes, sizeof sizes, "%s%zu", i ? "," : "", p->size[i]);
  snprintf(rs, sizeof rs, "%d", reps);
  snprintf(ds, sizeof ds, "%d", device);
  int fds[2];
  if (pipe(fds) != 0) {
    snprintf(why, why_cap, "pipe: %s", strerror(errno));
    return -1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  posix_spawn_file_actions_addclose(&fa, fds[1]);
  char *args[] = {(char *)python, "-c", (char *)peers_py, sizes, rs, ds, NULL};
  /* A process group of its own, so that a deadline stops what it started
   * too. */
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&at, 0);
  pid_t pid;
  int err = posix_spawnp(&pid, python, &fa, &at, args, environ);
  posix_spawnattr_destroy(&at);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (err != 0) {
    close(fds[0]);
    snprintf(why, why_cap, "cannot start %s: %s", python, strerror(err));
    return -1;
  }
  /* Lines read with read(), not stdio: a FILE's buffer would hide lines
   * from poll, and a line cut short would block fgets past the deadline. */
  uint64_t until = gpuipc__now_ns() + (uint64_t)limit_s * 1000000000ull;
  char acc[4096];
  size_t have = 0;
  bool late = false, eof = false;
  while (!eof) {
    uint64_t now = gpuipc__now_ns();
    if (now >= until) {
      late = true;
      break;
    }
    struct pollfd pf = {fds[0], POLLIN, 0};
    int r = poll(&pf, 1, (int)((until - now) / 1000000 + 1));
    if (r < 0 && errno != EINTR) {
      late = true; /* cannot wait for it: stopped as at the deadline */
      break;
    }
    if (r <= 0)
      continue; /* EINTR or no line yet: the deadline is checked above */
    ssize_t got = read(fds[0], acc + have, sizeof acc - 1 - have);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0) {
      eof = true;
      got = 0;
    }
    have += (size_t)got;
    acc[have] = '\0';
    char *line = acc, *nl;
    while ((nl = strchr(line, '\n')) != NULL || (eof && *line) ||
           (have == sizeof acc - 1 && line == acc)) {
      if (nl != NULL)
        *nl = '\0';
      peers_line(p, line);
      line = nl != NULL ? nl + 1 : acc + have;
    }
    have -= (size_t)(line - acc);
    memmove(acc, line, have);
  }
  close(fds[0]);
  if (late)
    kill(-pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
    ;
  if (late) {
    snprintf(why, why_cap, "%s ran past %d s (or could not be waited for) and "
             "was stopped; what it measured before is below", python, limit_s);
    return -1;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    snprintf(why, why_cap, "%s ended with status %d%s", python,
             WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
             WIFEXITED(status) && WEXITSTATUS(status) == 127
                 ? " (not found?)" : "");
    return -1;
  }
  return 0;
}

/* The peers' table: each peer's rate beside gpuipc's pageable copy of the
 * same direction and size; the target (gpuipc ahead of torch's .to("cuda")
 * from 1 MiB) counted into the misses. */
static int peers_print(const peers *p, const char *python) {
  int misses = 0;
  printf("\npeers through Python (%s, in this run; median of the same "
         "repetitions, each ending with the device synchronized; gpuipc: "
         "its pageable rows above)\n", python);
  if (*p->skipped)
    printf("not measured: %s\n", p->skipped);
  printf("%-8s  %-26s %9s  %9s  %11s  %s\n", "size", "peer", "peer GB/s",
         "gpuipc", "gpuipc/peer", "target");
  for (size_t i = 0; i < p->n; i++) {
    char sz[32];
    size_text(p->size[i], sz, sizeof sz);
    for (int c = 0; c < PEER_CASES; c++) {
      double r = p->rate[i][c];
      if (!(r > 0)) /* not measured (0), or not a number */
        continue;
      double g = peer_case[c].to_device ? p->gpuipc_h2d[i] : p->gpuipc_d2h[i];
      bool judged = c == 0 && p->size[i] >= MIB;
      bool ok = g > r;
      misses += judged && !ok;
      printf("%-8s  %-26s %9.2f  %9.2f  %10.2fx  %s%s\n", sz,
             peer_case[c].label, r, g, g / r, judged ? "ahead from 1 MiB" : "",
             judged ? (ok ? " ok" : " MISS") : "");
      gpuipc_bench_json_row_begin("copy_peers");
      gpuipc_bench_json_num("size_bytes", (double)p->size[i]);
      gpuipc_bench_json_str("peer", peer_case[c].key);
      gpuipc_bench_json_num("peer_gbps", r);
      gpuipc_bench_json_num("gpuipc_gbps", g);
      if (judged)
        gpuipc_bench_json_num("target_met", ok);
      gpuipc_bench_json_row_end();
    }
  }
  return misses;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: gpuipc bench copy [--max SIZE] [--min SIZE] [--reps N] "
          "[--quick] [--device N] [--threads N] [--chunk SIZE] [--streams N]\n"
          "       [--part SIZE] [--staged-min SIZE] [--direct-min SIZE] "
          "[--direct-max SIZE] [--direct-out-max SIZE]\n"
          "       [--python PATH] [--emulator PATH]\n"
          "  sizes go from --min (default 4K) to --max (default 4G on a GPU,\n"
          "  16M on the emulator) by factors of 4; SIZE takes K/M/G.\n"
          "  --python: the interpreter that measures the peers (torch, CuPy)\n"
          "  in the same run (default python3; none: no peers; not on the\n"
          "  emulator).\n"
          "  --quick: 3 repetitions and at most 64M (4M on the emulator).\n"
          "  --threads: host threads of the engine's staged memcpy (default:\n"
          "  the engine's choice), to compare settings on one machine.\n"
          "  --chunk, --streams: the engine's chunk size and stream count\n"
          "  (default: its heuristic), likewise.\n"
          "  --part SIZE: the smallest part of a staged memcpy given to one\n"
          "  host thread; --staged-min SIZE: the smallest staged chunk;\n"
          "  --direct-min, --direct-max SIZE: a pageable source of MIN to\n"
          "  MAX (excluded) into an idle stream takes the driver's pageable\n"
          "  copy; --direct-out-max SIZE: a pageable destination below it\n"
          "  does (0: never); likewise.\n"
          "  --json FILE: also write every figure to FILE (gpuipc bench "
          "--help).\n");
}

static void row(const char *size, size_t size_bytes, const char *name,
                double plain, double x, double bound, const char *target,
                int ok) {
  char pf[32], bf[32], fr[32], sp[32];
  if (plain > 0)
    snprintf(pf, sizeof pf, "%8.2f", plain);
  else
    snprintf(pf, sizeof pf, "%8s", "-");
  snprintf(bf, sizeof bf, "%8.2f", bound);
  snprintf(fr, sizeof fr, "%6.1f%%", bound > 0 ? 100 * x / bound : 0);
  if (plain > 0)
    snprintf(sp, sizeof sp, "%6.2fx", x / plain);
  else
    snprintf(sp, sizeof sp, "%7s", "-");
  printf("%-8s  %-26s %s  %8.2f  %s  %s  %s  %s%s\n", size, name, pf, x, bf, fr,
         sp, target, *target ? (ok ? " ok" : " MISS") : "");
  gpuipc_bench_json_row_begin("copy");
  gpuipc_bench_json_num("size_bytes", (double)size_bytes);
  gpuipc_bench_json_str("case", name);
  gpuipc_bench_json_num("plain_gbps", plain > 0 ? plain : 0.0 / 0.0);
  gpuipc_bench_json_num("gpuipc_gbps", x);
  gpuipc_bench_json_num("bound_gbps", bound);
  gpuipc_bench_json_str("target", target);
  if (*target)
    gpuipc_bench_json_num("target_met", ok);
  gpuipc_bench_json_row_end();
}

int gpuipc_bench_copy(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    }
  int emulated = gpuipc_bench_pick_driver(&argc, argv, "bench copy");
  if (emulated < 0)
    return 2;
  size_t max = 0, min = 4096;
  const char *python = "python3";
  int reps = 0, quick = 0, device = 0, threads = 0, streams = 0;
  size_t chunk = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "--quick") == 0) {
      quick = 1;
    } else if (strcmp(argv[i], "--max") == 0 && i + 1 < argc) {
      if (parse_size(argv[++i], &max) != 0) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--min") == 0 && i + 1 < argc) {
      if (parse_size(argv[++i], &min) != 0) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--python") == 0 && i + 1 < argc) {
      python = argv[++i];
    } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = atoi(argv[++i]);
      if (reps < 1 || reps > 63) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
      device = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--chunk") == 0 && i + 1 < argc) {
      if (parse_size(argv[++i], &chunk) != 0 || chunk == 0) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--streams") == 0 && i + 1 < argc) {
      streams = atoi(argv[++i]);
      if (streams < 1 || streams > GPUIPC_XFER_MAX_STREAMS) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--part") == 0 && i + 1 < argc) {
      if (parse_size(argv[++i], &gpuipc__hcopy_min_part) != 0) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--staged-min") == 0 && i + 1 < argc) {
      if (parse_size(argv[++i], &gpuipc__xfer_staged_min_chunk) != 0) {
        usage(stderr);
        return 2;
      }
    } else if ((strcmp(argv[i], "--direct-min") == 0 ||
                strcmp(argv[i], "--direct-max") == 0 ||
                strcmp(argv[i], "--direct-out-max") == 0) &&
               i + 1 < argc) {
      size_t *v = strcmp(argv[i], "--direct-min") == 0
                      ? &gpuipc__xfer_driver_pageable_min
                  : strcmp(argv[i], "--direct-max") == 0
                      ? &gpuipc__xfer_driver_pageable_max
                      : &gpuipc__xfer_driver_pageable_out_max;
      if (strcmp(argv[i + 1], "0") == 0) {
        *v = 0;
        i++;
      } else if (parse_size(argv[++i], v) != 0) {
        usage(stderr);
        return 2;
      }
    } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = atoi(argv[++i]);
      if (threads < 1 || threads > 16) {
        usage(stderr);
        return 2;
      }
    } else {
      usage(stderr);
      return 2;
    }
  }
  if (max == 0)
    max = emulated ? (quick ? 4 * MIB : 16 * MIB)
                   : (quick ? 64 * MIB : (size_t)4 << 30);
  if (reps == 0)
    reps = quick || emulated ? 3 : 7;
  if (min > max)
    min = max;

  if (gpuipc_init() != GPUIPC_OK) {
    fprintf(stderr, "gpuipc bench copy: %s\n", gpuipc_last_error());
    return 1;
  }
  /* --device names a local ordinal; the library names devices by UUID. */
  gpuipc_uuid uuid;
  gpuipc__ctx_guard g;
  if (gpuipc_device_uuid(device, &uuid) != GPUIPC_OK ||
      gpuipc__ctx_enter(&g, device) != GPUIPC_OK) {
    fprintf(stderr, "gpuipc bench copy: %s\n", gpuipc_last_error());
    return 1;
  }
  /* Fit in memory: three device buffers, two pinned and two pageable host
   * buffers of the largest size, plus the engine's scratch and staging. */
  size_t free_b = 0, total_b = 0;
  if (gpuipc__cu.cuMemGetInfo(&free_b, &total_b) == CUDA_SUCCESS) {
    while (max > min && 3 * max + ((size_t)256 << 20) > free_b)
      max /= 4;
  }
  long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages > 0 && psz > 0) {
    size_t host = (size_t)pages * (size_t)psz;
    while (max > min && 6 * max > host)
      max /= 4;
  }

  bench b;
  memset(&b, 0, sizeof b);
  b.device = device;
  b.reps = reps;
  b.cap = max;
  int rc = 1;
  char name[256] = "?";
  CUdevice dev;
  if (gpuipc__cu.cuDeviceGet(&dev, device) == CUDA_SUCCESS)
    gpuipc__cu.cuDeviceGetName(name, sizeof name, dev);
  if (gpuipc__cu.cuStreamCreate(&b.s1, CU_STREAM_NON_BLOCKING) ||
      gpuipc__cu.cuStreamCreate(&b.s2, CU_STREAM_NON_BLOCKING) ||
      gpuipc__cu.cuMemAlloc(&b.dev_a, max) ||
      gpuipc__cu.cuMemAlloc(&b.dev_b, max) ||
      gpuipc__cu.cuMemAlloc(&b.dev_c, max) ||
      gpuipc__cu.cuMemHostAlloc((void **)&b.pin_a, max, 0) ||
      gpuipc__cu.cuMemHostAlloc((void **)&b.pin_b, max, 0)) {
    fprintf(stderr, "gpuipc bench copy: cannot allocate buffers of %zu bytes\n",
            max);
    goto out;
  }
  b.page_a = malloc(max);
  b.page_b = malloc(max);
  if (!b.page_a || !b.page_b) {
    fprintf(stderr, "gpuipc bench copy: out of host memory\n");
    goto out;
  }
  /* Touch every page first: first-touch faults are not copy time. */
  memset(b.page_a, 1, max);
  memset(b.page_b, 2, max);
  memset(b.pin_a, 3, max);
  memset(b.pin_b, 4, max);
  gpuipc__cu.cuMemsetD8(b.dev_a, 5, max);
  gpuipc__cu.cuMemsetD8(b.dev_b, 6, max);
  if (gpuipc_xfer_shared_create(max, 1, &b.sh) != GPUIPC_OK ||
      gpuipc_xfer_shared_pin(b.sh, &uuid) != GPUIPC_OK) {
    fprintf(stderr, "gpuipc bench copy: %s\n", gpuipc_last_error());
    goto out;
  }
  memset(gpuipc_xfer_shared_get_slot(b.sh, 0), 7, max);
  gpuipc_xfer_options xo = GPUIPC_XFER_OPTIONS_INIT;
  xo.host_threads = threads;
  xo.chunk_bytes = chunk;
  xo.streams = streams;
  if (gpuipc_xfer_create(&uuid, &xo, &b.x) != GPUIPC_OK) {
    fprintf(stderr, "gpuipc bench copy: %s\n", gpuipc_last_error());
    goto out;
  }
  gpuipc_xfer_info in;
  memset(&in, 0, sizeof in);
  in.size = sizeof in;
  gpuipc_xfer_get_info(b.x, &in);

  printf("gpuipc bench copy: device %d (%s)%s, %d copy engine(s); engine: %d "
         "streams, chunks up to %zu MiB, staging %d x %zu MiB, %d host "
         "thread(s) of %ld CPUs; median of %d, interleaved\n",
         device, name, emulated ? " [CUDA driver emulator]" : "",
         in.copy_engines, in.streams, in.max_chunk_bytes >> 20,
         in.staging_slots, in.staging_slot_bytes >> 20, in.host_threads,
         sysconf(_SC_NPROCESSORS_ONLN), reps);
  printf("plain: the raw driver call (pinned one-way: cuMemcpy*Async = the "
         "bound; pageable: cuMemcpyHtoD then the legacy stream synchronized, "
         "or cuMemcpyDtoH: the data arrived, as in gpuipc's rows; pipeline: "
         "H2D, D2D, D2H in sequence on one stream)\n"
         "bound: pinned one-way of the same direction; pipeline: H2D and D2H "
         "at once on two streams. Pipeline rates count bytes moved both "
         "ways (2 x size / time).\n"
         "targets (H200): pinned one-way >= 95%% of the bound; pipeline >= "
         "90%% of the both-ways bound (judged from 64 MiB); pageable staged "
         ">= 3x plain.\n"
         "pageable: through the engine's staging, or the driver's pageable "
         "copy where that is as quick (the line below).\n"
         "shared segment: a pinned memfd segment (gpuipc_xfer_shared): "
         "publish, then the stream waits on its word and copies from it.\n");
  printf("staged: chunks of n/8, at least %zu KiB; parts of at least %zu "
         "KiB per host thread; the driver's pageable copy for a source of "
         "%zu KiB to %zu KiB (excluded) into an idle stream and for a "
         "destination below %zu KiB\n",
         gpuipc__xfer_staged_min_chunk >> 10, gpuipc__hcopy_min_part >> 10,
         gpuipc__xfer_driver_pageable_min >> 10,
         gpuipc__xfer_driver_pageable_max >> 10,
         gpuipc__xfer_driver_pageable_out_max >> 10);
  gpuipc_bench_json_num("staged_min_chunk", (double)gpuipc__xfer_staged_min_chunk);
  gpuipc_bench_json_num("host_min_part", (double)gpuipc__hcopy_min_part);
  gpuipc_bench_json_num("driver_pageable_min",
                        (double)gpuipc__xfer_driver_pageable_min);
  gpuipc_bench_json_num("driver_pageable_max",
                        (double)gpuipc__xfer_driver_pageable_max);
  gpuipc_bench_json_num("driver_pageable_out_max",
                        (double)gpuipc__xfer_driver_pageable_out_max);
  gpuipc_bench_json_num("device", device);
  gpuipc_bench_json_str("device_name", name);
  gpuipc_bench_json_num("copy_engines", in.copy_engines);
  gpuipc_bench_json_num("streams", in.streams);
  gpuipc_bench_json_num("max_chunk_bytes", (double)in.max_chunk_bytes);
  gpuipc_bench_json_num("staging_slots", in.staging_slots);
  gpuipc_bench_json_num("staging_slot_bytes", (double)in.staging_slot_bytes);
  gpuipc_bench_json_num("host_threads", in.host_threads);
  gpuipc_bench_json_num("repetitions", reps);
  gpuipc_bench_json_str("unit", "GB/s");
  if (emulated)
    printf("(emulator: rates are memcpy speeds of this machine, not a GPU's; "
           "the targets apply to a real GPU)\n");
  printf("\n%-8s  %-26s %8s  %8s  %8s  %7s  %7s  %s\n", "size", "case", "plain",
         "gpuipc", "bound", "x/bound", "x/plain", "target");

  int misses = 0;
  static peers pe;
  memset(&pe, 0, sizeof pe);
  for (size_t n = min; n <= max; n *= 4) {
    char sz[32];
    size_text(n, sz, sizeof sz);
    double r[NCASES];
    if (rates(&b, n, r) != 0)
      goto out;
    double h2d = r[RAW_H2D_PINNED], d2h = r[RAW_D2H_PINNED],
           both = r[RAW_BOTH_PINNED], h2d_pg = r[RAW_H2D_PAGEABLE],
           d2h_pg = r[RAW_D2H_PAGEABLE], serial = r[RAW_SERIAL_PIPE],
           serial_pg = r[X_PIPE_PAGEABLE_SERIAL], xh2d = r[X_H2D_PINNED],
           xd2h = r[X_D2H_PINNED], xh2d_pg = r[X_H2D_PAGEABLE],
           xd2h_pg = r[X_D2H_PAGEABLE], xpipe = r[X_PIPE_PINNED],
           xpipe_pg = r[X_PIPE_PAGEABLE], xshared = r[X_SHARED_H2D];
    int ok;
    ok = xh2d >= 0.95 * h2d;
    misses += !ok;
    row(sz, n, "H2D pinned", h2d, xh2d, h2d, ">=95% bound", ok);
    ok = xd2h >= 0.95 * d2h;
    misses += !ok;
    row(sz, n, "D2H pinned", d2h, xd2h, d2h, ">=95% bound", ok);
    ok = xh2d_pg >= 3 * h2d_pg;
    misses += !ok;
    row(sz, n, "H2D pageable", h2d_pg, xh2d_pg, h2d, ">=3x plain", ok);
    ok = xd2h_pg >= 3 * d2h_pg;
    misses += !ok;
    row(sz, n, "D2H pageable", d2h_pg, xd2h_pg, d2h, ">=3x plain", ok);
    if (pe.n < PEER_SIZES) {
      pe.size[pe.n] = n;
      pe.gpuipc_h2d[pe.n] = xh2d_pg;
      pe.gpuipc_d2h[pe.n] = xd2h_pg;
      pe.n++;
    }
    /* Below 64 MiB the pipeline has too few chunks to hide its fill and
     * drain (at least 1 MiB each): the target is judged on large copies. */
    if (n >= 64 * MIB) {
      ok = xpipe >= 0.90 * both;
      misses += !ok;
      row(sz, n, "in->stage->out pinned", serial, xpipe, both, ">=90% bound", ok);
    } else {
      row(sz, n, "in->stage->out pinned", serial, xpipe, both, "", 1);
    }
    row(sz, n, "in->stage->out pageable", serial_pg, xpipe_pg, both, "", 1);
    row(sz, n, "H2D from shared segment", h2d, xshared, h2d, "", 1);
  }
  if (emulated) {
    printf("\npeers (torch, CuPy): not measured on the emulator\n");
  } else if (strcmp(python, "none") == 0) {
    printf("\npeers (torch, CuPy): not measured (--python none)\n");
  } else {
    char why[256];
    if (peers_run(&pe, python, reps, device, 600, why, sizeof why) != 0)
      printf("\npeers (torch, CuPy): %s\n", why);
    bool any = false;
    for (size_t i = 0; i < pe.n; i++)
      for (int c = 0; c < PEER_CASES; c++)
        any = any || pe.rate[i][c] > 0;
    if (any || *pe.skipped)
      misses += peers_print(&pe, python);
  }
  gpuipc_bench_json_num("targets_missed", misses);
  printf("\n%d target(s) missed%s\n", misses,
         emulated ? " (emulator: not meaningful)" : "");
  rc = 0;
out:
  gpuipc_xfer_destroy(b.x);
  gpuipc_xfer_shared_close(b.sh);
  if (b.pin_a)
    gpuipc__cu.cuMemFreeHost(b.pin_a);
  if (b.pin_b)
    gpuipc__cu.cuMemFreeHost(b.pin_b);
  if (b.dev_a)
    gpuipc__cu.cuMemFree(b.dev_a);
  if (b.dev_b)
    gpuipc__cu.cuMemFree(b.dev_b);
  if (b.dev_c)
    gpuipc__cu.cuMemFree(b.dev_c);
  if (b.s1)
    gpuipc__cu.cuStreamDestroy(b.s1);
  if (b.s2)
    gpuipc__cu.cuStreamDestroy(b.s2);
  free(b.page_a);
  free(b.page_b);
  gpuipc__ctx_leave(&g);
  return rc;
}
