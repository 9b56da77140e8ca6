/*
 * handoff.c: `gpuipc bench handoff`: what handing a GPU buffer to another
 * process costs over a gpuipc connection, next to the raw driver paths
 * measured in the same run.
 *
 *   handoff latency   from the producer's gpuipc_conn_send to the consumer
 *                     holding a usable, stream-ordered buffer (its
 *                     gpuipc_conn_recv returned; the consumer polls in
 *                     non-blocking mode), one buffer in flight;
 *   throughput        buffers per second through the whole cycle (send,
 *                     recv, release, the release back at the producer),
 *                     a ring of blocks in flight;
 *   both for 4 KiB .. 256 MiB and for 1 and 8 consumers (with 8, each
 *   buffer goes to every consumer for latency, round-robin for throughput);
 *   fan-out          one 4 KiB buffer to 8, 16 and 64 consumers, sent to
 *                     each in turn and by gpuipc_conn_broadcast: latency to
 *                     the last consumer (per buffer, the latest arrival);
 *   batches          throughput of gpuipc_conn_send_batch / recv_batch /
 *                     release_batch cycles in batches of 1, 16 and 256;
 *   flatness         throughput of single handoffs while 10 .. 100,000
 *                     other buffers stay leased (held by two consumers);
 *   raw driver paths  legacy cuIpcGetMemHandle / Open / Close; pool pointer
 *                     cuMemPoolExportPointer / ImportPointer / free (and the
 *                     one-time pool import); the GPU round trip of the
 *                     ordering mechanism itself (stream write/wait value on
 *                     shared memory, ping-pong between two processes' streams,
 *                     no host in the loop).
 *
 * The raw paths run and print first. --quick: 200 iterations, 4 KiB and
 * 1 MiB only (well under 30 s on a GPU; the full run takes minutes).
 *
 * Consumers are this program re-executed (/proc/self/exe) with a hidden
 * argument, started before the producer initializes CUDA. Times are
 * CLOCK_MONOTONIC, which all processes of the machine share.
 */
#include "cli.h"
#include "tree.h"

#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MAXC 8   /* consumers of the handoff table */
#define NCONS 64 /* consumers started (the fan-out rows use up to all) */
#define BATCH_MAX 256

enum {
  OP_LAT = 1,
  OP_TPUT,
  OP_LEGACY,
  OP_POOL,
  OP_MEMOP,
  OP_ECHO,
  OP_QUIT,
  OP_LATV,  /* OP_LAT, then every latency sent back (messages of doubles) */
  OP_TPUTB, /* receive and release in batches */
  OP_HOLD,  /* receive n buffers and keep them */
  OP_UNHOLD /* release every buffer kept */
};

typedef struct cmd {
  uint32_t op;
  uint32_t n;
} cmd;

typedef struct reply {
  double a, b, c, d; /* op-specific, microseconds */
} reply;

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return a < b ? -1 : a > b;
}
static double pct(double *v, int n, double p) {
  if (n <= 0)
    return 0;
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  int i = (int)(p * (n - 1) + 0.5);
  return v[i];
}
static double now_us(void) { return (double)gpuipc__now_ns() / 1000.0; }

#define DIE(...)                                                               \
  do {                                                                         \
    fprintf(stderr, "gpuipc bench handoff: " __VA_ARGS__);                     \
    fprintf(stderr, " (%s)\n", gpuipc_last_error());                           \
    exit(1);                                                                   \
  } while (0)
#define OK(expr)                                                               \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK)                                                       \
      DIE("%s: %s", #expr, gpuipc_strerror(s_));                               \
  } while (0)
#define CU(expr)                                                               \
  do {                                                                         \
    CUresult r_ = (expr);                                                      \
    if (r_ != CUDA_SUCCESS)                                                    \
      DIE("%s: %s", #expr, gpuipc__cuda_error_name(r_));                       \
  } while (0)

static void current(void) {
  CUcontext c;
  OK(gpuipc__primary_ctx(0, &c));
  CU(gpuipc__cu.cuCtxSetCurrent(c));
}

static void send_cmd(gpuipc_conn *c, uint32_t op, uint32_t n) {
  cmd m = {op, n};
  OK(gpuipc_conn_send_msg(c, &m, sizeof m, NULL, 0));
}
static void send_reply(gpuipc_conn *c, reply r) {
  OK(gpuipc_conn_send_msg(c, &r, sizeof r, NULL, 0));
}
static reply get_reply(gpuipc_conn *c) {
  reply r;
  size_t len = 0;
  OK(gpuipc_conn_recv_msg(c, &r, sizeof r, &len, NULL, NULL));
  return r;
}

/* Receives, polling (non-blocking) for up to 200 us, then blocking: the
 * latency a polling consumer sees, without starving the producer of CPU
 * when consumers outnumber cores. */
static double last_call_start; /* start of the recv call that succeeded */

static void spin_recv(gpuipc_conn *c, CUstream s, gpuipc_received *r) {
  uint64_t until = gpuipc__now_ns() + 200000;
  for (;;) {
    last_call_start = now_us();
    gpuipc_status st = gpuipc_conn_recv(c, (struct CUstream_st *)s, r);
    if (st == GPUIPC_OK)
      return;
    if (st != GPUIPC_E_WOULD_BLOCK)
      DIE("gpuipc_conn_recv: %s", gpuipc_strerror(st));
    if (gpuipc__now_ns() > until) {
      OK(gpuipc_conn_set_nonblocking(c, 0));
      st = gpuipc_conn_recv(c, (struct CUstream_st *)s, r);
      OK(gpuipc_conn_set_nonblocking(c, 1));
      if (st == GPUIPC_OK)
        return;
      DIE("gpuipc_conn_recv: %s", gpuipc_strerror(st));
    }
  }
}

/* ---- consumer ----------------------------------------------------------------- */

static uint64_t *held; /* OP_HOLD: the buffers kept */
static size_t nheld;

static int consumer(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  gpuipc_conn *c = NULL;
  OK(gpuipc_conn_from_fd(fd, &o, &c));
  OK(gpuipc_init());
  current();
  CUstream s;
  CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdevice dev;
  CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  for (;;) {
    cmd m;
    size_t len = 0;
    OK(gpuipc_conn_set_nonblocking(c, 0));
    gpuipc_status st = gpuipc_conn_recv_msg(c, &m, sizeof m, &len, NULL, NULL);
    if (st == GPUIPC_E_PEER_GONE || (st == GPUIPC_OK && m.op == OP_QUIT))
      break;
    OK(st);
    int n = (int)m.n;
    double *v = calloc((size_t)n + 1, sizeof *v);
    double *w = calloc((size_t)n + 1, sizeof *w);
    double *x = calloc((size_t)n + 1, sizeof *x);
    if (!v || !w || !x)
      DIE("out of memory");
    reply r = {0, 0, 0, 0};
    if (m.op == OP_LAT || m.op == OP_TPUT || m.op == OP_LATV) {
      OK(gpuipc_conn_set_nonblocking(c, 1));
      double t0 = 0;
      for (int i = 0; i < n; i++) {
        gpuipc_received in = GPUIPC_RECEIVED_INIT;
        spin_recv(c, s, &in);
        double t = now_us();
        x[i] = t - last_call_start;
        if (i == 0)
          t0 = t;
        double sent;
        memcpy(&sent, in.meta, sizeof sent);
        v[i] = t - sent;
        OK(gpuipc_conn_release(c, in.id, (struct CUstream_st *)s));
      }
      OK(gpuipc_conn_set_nonblocking(c, 0));
      /* Before the percentiles sort them. */
      if (m.op == OP_LATV)
        for (int i = 0; i < n; i += 8000) {
          int k = n - i < 8000 ? n - i : 8000;
          OK(gpuipc_conn_send_msg(c, v + i, (size_t)k * sizeof *v, NULL, 0));
        }
      r.a = pct(v, n, 0.5);
      r.b = pct(v, n, 0.9);
      r.c = now_us() - t0;
      r.d = pct(x, n, 0.5);
    } else if (m.op == OP_TPUTB) {
      /* Batches: receive whatever arrived (up to BATCH_MAX), release it
       * all in one call. */
      gpuipc_received *in = calloc(BATCH_MAX, sizeof *in);
      uint64_t *ids = calloc(BATCH_MAX, sizeof *ids);
      if (!in || !ids)
        DIE("out of memory");
      OK(gpuipc_conn_set_nonblocking(c, 1));
      double t0 = 0;
      for (int got = 0; got < n;) {
        for (int i = 0; i < BATCH_MAX; i++)
          in[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
        size_t k = 0;
        gpuipc_status rs =
            gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, in, BATCH_MAX, &k);
        if (rs == GPUIPC_E_WOULD_BLOCK)
          continue;
        OK(rs);
        if (got == 0)
          t0 = now_us();
        for (size_t i = 0; i < k; i++)
          ids[i] = in[i].id;
        OK(gpuipc_conn_release_batch(c, ids, k, (struct CUstream_st *)s));
        got += (int)k;
      }
      OK(gpuipc_conn_set_nonblocking(c, 0));
      r.c = now_us() - t0;
      free(in);
      free(ids);
    } else if (m.op == OP_HOLD) {
      uint64_t *nh = realloc(held, (nheld + (size_t)n) * sizeof *held);
      if (nh == NULL)
        DIE("out of memory");
      held = nh;
      gpuipc_received *in = calloc(BATCH_MAX, sizeof *in);
      if (!in)
        DIE("out of memory");
      for (int got = 0; got < n;) {
        for (int i = 0; i < BATCH_MAX; i++)
          in[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
        size_t k = 0;
        size_t want = (size_t)(n - got) < BATCH_MAX ? (size_t)(n - got) : BATCH_MAX;
        OK(gpuipc_conn_recv_batch(c, (struct CUstream_st *)s, in, want, &k));
        for (size_t i = 0; i < k; i++)
          held[nheld++] = in[i].id;
        got += (int)k;
      }
      free(in);
    } else if (m.op == OP_UNHOLD) {
      for (size_t i = 0; i < nheld; i += GPUIPC_BATCH_MAX) {
        size_t k = nheld - i < GPUIPC_BATCH_MAX ? nheld - i : GPUIPC_BATCH_MAX;
        OK(gpuipc_conn_release_batch(c, held + i, k, (struct CUstream_st *)s));
      }
      nheld = 0;
    } else if (m.op == OP_ECHO) {
      /* Echoes n small messages, polling for each like a consumer that
       * polls for buffers. */
      OK(gpuipc_conn_set_nonblocking(c, 1));
      for (int i = 0; i < n; i++) {
        char e[16];
        for (;;) {
          gpuipc_status es =
              gpuipc_conn_recv_msg(c, e, sizeof e, &len, NULL, NULL);
          if (es == GPUIPC_OK)
            break;
          if (es != GPUIPC_E_WOULD_BLOCK)
            DIE("echo: %s", gpuipc_strerror(es));
        }
        OK(gpuipc_conn_send_msg(c, e, len, NULL, 0));
      }
      OK(gpuipc_conn_set_nonblocking(c, 0));
    } else if (m.op == OP_LEGACY) {
      for (int i = 0; i < n; i++) {
        CUipcMemHandle h;
        OK(gpuipc_conn_recv_msg(c, &h, sizeof h, &len, NULL, NULL));
        CUdeviceptr p;
        double t0 = now_us();
        CU(gpuipc__cu.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        double t1 = now_us();
        CU(gpuipc__cu.cuIpcCloseMemHandle(p));
        double t2 = now_us();
        v[i] = t1 - t0;
        w[i] = t2 - t1;
        OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
      }
      r.a = pct(v, n, 0.5);
      r.b = pct(w, n, 0.5);
    } else if (m.op == OP_POOL) {
      int pfd = -1, nf = 1;
      char b;
      OK(gpuipc_conn_recv_msg(c, &b, 1, &len, &pfd, &nf));
      if (nf != 1)
        DIE("pool fd missing");
      CUmemoryPool pool;
      double t0 = now_us();
      CU(gpuipc__cu.cuMemPoolImportFromShareableHandle(
          &pool, (void *)(uintptr_t)pfd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
      CUmemAccessDesc ad = {{CU_MEM_LOCATION_TYPE_DEVICE, (int)dev},
                            CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
      CU(gpuipc__cu.cuMemPoolSetAccess(pool, &ad, 1));
      r.c = now_us() - t0;
      close(pfd);
      OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
      for (int i = 0; i < n; i++) {
        CUmemPoolPtrExportData d;
        OK(gpuipc_conn_recv_msg(c, &d, sizeof d, &len, NULL, NULL));
        CUdeviceptr p;
        double t1 = now_us();
        CU(gpuipc__cu.cuMemPoolImportPointer(&p, pool, &d));
        double t2 = now_us();
        CU(gpuipc__cu.cuMemFree(p));
        double t3 = now_us();
        v[i] = t2 - t1;
        w[i] = t3 - t2;
        OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
      }
      r.a = pct(v, n, 0.5);
      r.b = pct(w, n, 0.5);
    } else if (m.op == OP_MEMOP) {
      /* The flag words (cuMemAlloc memory: stream memory operations
       * refuse pool memory) arrive as a legacy handle: A (producer writes)
       * at 0, B (we write) at 256. Enqueue the whole ping-pong, then say
       * so. */
      CUipcMemHandle hd;
      OK(gpuipc_conn_recv_msg(c, &hd, sizeof hd, &len, NULL, NULL));
      CUdeviceptr A;
      CU(gpuipc__cu.cuIpcOpenMemHandle(&A, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
      CUdeviceptr B = A + 256;
      for (int i = 1; i <= n; i++) {
        CU(gpuipc__cu.cuStreamWaitValue64(s, A, (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ));
        CU(gpuipc__cu.cuStreamWriteValue64(s, B, (cuuint64_t)i, 0));
      }
      OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
      CU(gpuipc__cu.cuStreamSynchronize(s));
      CU(gpuipc__cu.cuIpcCloseMemHandle(A));
    }
    free(v);
    free(w);
    free(x);
    send_reply(c, r);
  }
  CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_conn_close(c);
  return 0;
}

/* ---- producer ----------------------------------------------------------------- */

typedef struct ctx {
  gpuipc_conn *c[NCONS];
  int nc;
  CUstream s;
  int iters;
  int ncons; /* consumers started: NCONS, 16 with --quick */
} bctx;

static void wait_free(bctx *b, gpuipc_block *blk) {
  while (gpuipc_block_get_holders(blk) > 0)
    for (int k = 0; k < b->nc; k++)
      OK(gpuipc_conn_progress(b->c[k], 0));
}

static double send_t(gpuipc_conn *c, gpuipc_block *blk, CUstream s) {
  double t = now_us();
  OK(gpuipc_conn_send(c, blk, (struct CUstream_st *)s, &t, sizeof t));
  return now_us() - t;
}

/* Latency: one buffer in flight, to each of nc consumers. */
static void run_lat(bctx *b, gpuipc_arena *a, size_t size, int nc,
                    double *med, double *p90, double *send_call,
                    double *recv_call) {
  gpuipc_block *blk;
  OK(gpuipc_arena_alloc(a, size, (struct CUstream_st *)b->s, &blk));
  int n = b->iters;
  double *sc = calloc((size_t)n * (size_t)nc, sizeof *sc);
  if (sc == NULL)
    DIE("out of memory");
  for (int k = 0; k < nc; k++)
    send_cmd(b->c[k], OP_LAT, (uint32_t)n);
  for (int i = 0; i < n; i++) {
    for (int k = 0; k < nc; k++)
      sc[i * nc + k] = send_t(b->c[k], blk, b->s);
    wait_free(b, blk);
  }
  *send_call = pct(sc, n * nc, 0.5);
  free(sc);
  *med = 0;
  *p90 = 0;
  *recv_call = 0;
  for (int k = 0; k < nc; k++) {
    reply r = get_reply(b->c[k]);
    *med += r.a / nc;
    *recv_call += r.d / nc;
    if (r.b > *p90)
      *p90 = r.b;
  }
  OK(gpuipc_block_free(blk, (struct CUstream_st *)b->s));
}

/* Throughput: a ring of blocks in flight, round-robin over nc consumers. */
static double run_tput(bctx *b, gpuipc_arena *a, size_t size, int nc,
                       int ring) {
  gpuipc_block *blk[64];
  for (int j = 0; j < ring; j++)
    OK(gpuipc_arena_alloc(a, size, (struct CUstream_st *)b->s, &blk[j]));
  int n = b->iters * 4;
  n -= n % nc;
  for (int k = 0; k < nc; k++)
    send_cmd(b->c[k], OP_TPUT, (uint32_t)(n / nc));
  double t0 = now_us();
  for (int i = 0; i < n; i++) {
    gpuipc_block *x = blk[i % ring];
    gpuipc_conn *c = b->c[i % nc];
    while (gpuipc_block_get_holders(x) > 0)
      OK(gpuipc_conn_progress(b->c[(i - ring) % nc >= 0 ? (i - ring) % nc : 0], 0));
    send_t(c, x, b->s);
  }
  for (int j = 0; j < ring; j++)
    wait_free(b, blk[j]);
  double dt = now_us() - t0;
  for (int k = 0; k < nc; k++)
    (void)get_reply(b->c[k]);
  for (int j = 0; j < ring; j++)
    OK(gpuipc_block_free(blk[j], (struct CUstream_st *)b->s));
  return n / (dt / 1e6);
}

/* Fan-out: one buffer in flight to consumers 0..nc-1, by one
 * gpuipc_conn_broadcast or by gpuipc_conn_send to each in turn, every
 * consumer stamped with the same start time. *med_last / *p90_last: over
 * the buffers, the latency of the consumer that got it last; *med_each:
 * the consumers' medians, averaged; *call: median time of the send
 * call(s) of one buffer. */
static void run_fan(bctx *b, gpuipc_arena *a, size_t size, int nc, bool bcast,
                    double *med_last, double *p90_last, double *med_each,
                    double *call) {
  gpuipc_block *blk;
  OK(gpuipc_arena_alloc(a, size, (struct CUstream_st *)b->s, &blk));
  int n = b->iters;
  double *sc = calloc((size_t)n, sizeof *sc);
  double *last = calloc((size_t)n, sizeof *last);
  double *lat = calloc((size_t)n, sizeof *lat);
  if (sc == NULL || last == NULL || lat == NULL)
    DIE("out of memory");
  for (int k = 0; k < nc; k++)
    send_cmd(b->c[k], OP_LATV, (uint32_t)n);
  for (int i = 0; i < n; i++) {
    double t = now_us();
    if (bcast) {
      OK(gpuipc_conn_broadcast(b->c, (size_t)nc, blk, (struct CUstream_st *)b->s,
                               &t, sizeof t, NULL));
    } else {
      for (int k = 0; k < nc; k++)
        OK(gpuipc_conn_send(b->c[k], blk, (struct CUstream_st *)b->s, &t,
                            sizeof t));
    }
    sc[i] = now_us() - t;
    while (gpuipc_block_get_holders(blk) > 0)
      for (int k = 0; k < nc; k++)
        OK(gpuipc_conn_progress(b->c[k], 0));
  }
  *call = pct(sc, n, 0.5);
  *med_each = 0;
  for (int k = 0; k < nc; k++) {
    for (int i = 0; i < n; i += 8000) {
      size_t len = 0;
      int want = n - i < 8000 ? n - i : 8000;
      OK(gpuipc_conn_recv_msg(b->c[k], lat + i, (size_t)want * sizeof *lat,
                              &len, NULL, NULL));
      if (len != (size_t)want * sizeof *lat)
        DIE("consumer %d sent %zu bytes of latencies", k, len);
    }
    for (int i = 0; i < n; i++)
      if (k == 0 || lat[i] > last[i])
        last[i] = lat[i];
    reply r = get_reply(b->c[k]);
    *med_each += r.a / nc;
  }
  *med_last = pct(last, n, 0.5);
  *p90_last = pct(last, n, 0.9);
  free(sc);
  free(last);
  free(lat);
  OK(gpuipc_block_free(blk, (struct CUstream_st *)b->s));
}

/* Batches of nb blocks to consumer 0 (two batches in flight), received
 * and released in batches: buffers per second over the whole cycle;
 * *call: median time inside gpuipc_conn_send_batch. */
static double run_batch(bctx *b, gpuipc_arena *a, size_t size, int nb,
                        double *call) {
  gpuipc_block *blk[2 * BATCH_MAX];
  const void *metas[BATCH_MAX];
  size_t lens[BATCH_MAX];
  double stamp = 0;
  for (int j = 0; j < 2 * nb; j++)
    OK(gpuipc_arena_alloc(a, size, (struct CUstream_st *)b->s, &blk[j]));
  for (int j = 0; j < nb; j++) {
    metas[j] = &stamp;
    lens[j] = sizeof stamp;
  }
  int batches = (b->iters * 4 + nb - 1) / nb;
  if (batches < 4)
    batches = 4;
  double *sc = calloc((size_t)batches, sizeof *sc);
  if (sc == NULL)
    DIE("out of memory");
  gpuipc_conn *c = b->c[0];
  send_cmd(c, OP_TPUTB, (uint32_t)(batches * nb));
  double t0 = now_us();
  for (int i = 0; i < batches; i++) {
    gpuipc_block **g = blk + (i % 2) * nb;
    for (int j = 0; j < nb; j++)
      while (gpuipc_block_get_holders(g[j]) > 0)
        OK(gpuipc_conn_progress(c, 0));
    double t = now_us();
    stamp = t;
    OK(gpuipc_conn_send_batch(c, g, (size_t)nb, (struct CUstream_st *)b->s,
                              metas, lens));
    sc[i] = now_us() - t;
  }
  for (int j = 0; j < 2 * nb; j++)
    while (gpuipc_block_get_holders(blk[j]) > 0)
      OK(gpuipc_conn_progress(c, 0));
  double dt = now_us() - t0;
  (void)get_reply(c);
  *call = pct(sc, batches, 0.5);
  free(sc);
  for (int j = 0; j < 2 * nb; j++)
    OK(gpuipc_block_free(blk[j], (struct CUstream_st *)b->s));
  return (double)batches * nb / (dt / 1e6);
}

/* Flatness: `live` buffers stay leased (held by the last two consumers,
 * sent in batches), while single handoffs cycle to the last consumer:
 * its buffers per second. */
static double run_flat(bctx *b, gpuipc_arena *a, long live) {
  gpuipc_conn *x = b->c[b->ncons - 2], *y = b->c[b->ncons - 1];
  long h1 = live / 2, h2 = live - h1;
  gpuipc_block **blk = calloc((size_t)live, sizeof *blk);
  if (blk == NULL)
    DIE("out of memory");
  for (long j = 0; j < live; j++)
    OK(gpuipc_arena_alloc(a, 256, (struct CUstream_st *)b->s, &blk[j]));
  send_cmd(x, OP_HOLD, (uint32_t)h1);
  send_cmd(y, OP_HOLD, (uint32_t)h2);
  for (int side = 0; side < 2; side++) {
    long from = side ? h1 : 0, to = side ? live : h1;
    for (long j = from; j < to; j += BATCH_MAX) {
      long k = to - j < BATCH_MAX ? to - j : BATCH_MAX;
      OK(gpuipc_conn_send_batch(side ? y : x, blk + j, (size_t)k,
                                (struct CUstream_st *)b->s, NULL, NULL));
    }
  }
  (void)get_reply(x);
  (void)get_reply(y);
  /* Single handoffs meanwhile, a ring of 32 blocks. */
  gpuipc_block *ring[32];
  for (int j = 0; j < 32; j++)
    OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)b->s, &ring[j]));
  int n = b->iters * 4;
  send_cmd(y, OP_TPUT, (uint32_t)n);
  double t0 = now_us();
  for (int i = 0; i < n; i++) {
    while (gpuipc_block_get_holders(ring[i % 32]) > 0)
      OK(gpuipc_conn_progress(y, 0));
    send_t(y, ring[i % 32], b->s);
  }
  for (int j = 0; j < 32; j++)
    while (gpuipc_block_get_holders(ring[j]) > 0)
      OK(gpuipc_conn_progress(y, 0));
  double dt = now_us() - t0;
  (void)get_reply(y);
  send_cmd(x, OP_UNHOLD, 0);
  send_cmd(y, OP_UNHOLD, 0);
  (void)get_reply(x);
  (void)get_reply(y);
  for (long j = 0; j < live; j++) {
    gpuipc_conn *c = j < h1 ? x : y;
    while (gpuipc_block_get_holders(blk[j]) > 0)
      OK(gpuipc_conn_progress(c, 0));
    OK(gpuipc_block_free(blk[j], (struct CUstream_st *)b->s));
  }
  for (int j = 0; j < 32; j++)
    OK(gpuipc_block_free(ring[j], (struct CUstream_st *)b->s));
  free(blk);
  return n / (dt / 1e6);
}

static void raw_legacy(bctx *b, double out[3]) {
  gpuipc_conn *c = b->c[0];
  int n = b->iters < 200 ? b->iters : 200;
  CUdeviceptr p;
  CU(gpuipc__cu.cuMemAlloc(&p, (size_t)1 << 20));
  double *v = calloc((size_t)n, sizeof *v);
  send_cmd(c, OP_LEGACY, (uint32_t)n);
  for (int i = 0; i < n; i++) {
    CUipcMemHandle h;
    double t0 = now_us();
    CU(gpuipc__cu.cuIpcGetMemHandle(&h, p));
    v[i] = now_us() - t0;
    OK(gpuipc_conn_send_msg(c, &h, sizeof h, NULL, 0));
    char k;
    size_t len;
    OK(gpuipc_conn_recv_msg(c, &k, 1, &len, NULL, NULL));
  }
  reply r = get_reply(c);
  out[0] = pct(v, n, 0.5);
  out[1] = r.a;
  out[2] = r.b;
  free(v);
  CU(gpuipc__cu.cuMemFree(p));
}

static void raw_pool(bctx *b, double out[4]) {
  gpuipc_conn *c = b->c[0];
  int n = b->iters < 200 ? b->iters : 200;
  CUdevice dev;
  CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  CUmemPoolProps pp;
  memset(&pp, 0, sizeof pp);
  pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  pp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  pp.location.id = (int)dev;
  CUmemoryPool pool;
  CU(gpuipc__cu.cuMemPoolCreate(&pool, &pp));
  int pfd = -1;
  CU(gpuipc__cu.cuMemPoolExportToShareableHandle(
      &pfd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  send_cmd(c, OP_POOL, (uint32_t)n);
  OK(gpuipc_conn_send_msg(c, "p", 1, &pfd, 1));
  close(pfd);
  char k;
  size_t len;
  OK(gpuipc_conn_recv_msg(c, &k, 1, &len, NULL, NULL));
  double *v = calloc((size_t)n, sizeof *v);
  for (int i = 0; i < n; i++) {
    CUdeviceptr p;
    CU(gpuipc__cu.cuMemAllocFromPoolAsync(&p, (size_t)1 << 20, pool, b->s));
    CU(gpuipc__cu.cuStreamSynchronize(b->s));
    CUmemPoolPtrExportData d;
    double t0 = now_us();
    CU(gpuipc__cu.cuMemPoolExportPointer(&d, p));
    v[i] = now_us() - t0;
    OK(gpuipc_conn_send_msg(c, &d, sizeof d, NULL, 0));
    OK(gpuipc_conn_recv_msg(c, &k, 1, &len, NULL, NULL));
    CU(gpuipc__cu.cuMemFreeAsync(p, b->s));
  }
  reply r = get_reply(c);
  out[0] = pct(v, n, 0.5);
  out[1] = r.a;
  out[2] = r.b;
  out[3] = r.c;
  free(v);
  CU(gpuipc__cu.cuStreamSynchronize(b->s));
  CU(gpuipc__cu.cuMemPoolDestroy(pool));
}

/* The ordering mechanism alone: a ping-pong of stream write/wait value
 * between the two processes' streams, timed by events on the producer's
 * stream after a gate the host opens once everything is queued. */
static double raw_memop(bctx *b) {
  gpuipc_conn *c = b->c[0];
  /* Both sides enqueue the whole ping-pong before anything runs: a stream
   * holds only so many pending operations (2000 pairs behind a blocked
   * wait filled it on an H200, and the enqueue then waited for room that
   * never came), so at most 200 rounds. */
  int n = b->iters < 200 ? b->iters : 200;
  CUdeviceptr A;
  CU(gpuipc__cu.cuMemAlloc(&A, 4096));
  CUdeviceptr B = A + 256, G = A + 512;
  CU(gpuipc__cu.cuMemsetD8(A, 0, 1024));
  CUipcMemHandle hd;
  CU(gpuipc__cu.cuIpcGetMemHandle(&hd, A));
  send_cmd(c, OP_MEMOP, (uint32_t)n);
  OK(gpuipc_conn_send_msg(c, &hd, sizeof hd, NULL, 0));
  char k;
  size_t len;
  OK(gpuipc_conn_recv_msg(c, &k, 1, &len, NULL, NULL));
  CUevent e0, e1;
  CU(gpuipc__cu.cuEventCreate(&e0, 0));
  CU(gpuipc__cu.cuEventCreate(&e1, 0));
  CU(gpuipc__cu.cuStreamWaitValue64(b->s, G, 1, CU_STREAM_WAIT_VALUE_GEQ));
  CU(gpuipc__cu.cuEventRecord(e0, b->s));
  for (int i = 1; i <= n; i++) {
    CU(gpuipc__cu.cuStreamWriteValue64(b->s, A, (cuuint64_t)i, 0));
    CU(gpuipc__cu.cuStreamWaitValue64(b->s, B, (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ));
  }
  CU(gpuipc__cu.cuEventRecord(e1, b->s));
  CUstream gate;
  CU(gpuipc__cu.cuStreamCreate(&gate, CU_STREAM_NON_BLOCKING));
  CU(gpuipc__cu.cuStreamWriteValue64(gate, G, 1, 0));
  CU(gpuipc__cu.cuStreamSynchronize(b->s));
  float ms = 0;
  CU(gpuipc__cu.cuEventElapsedTime(&ms, e0, e1));
  (void)get_reply(c);
  CU(gpuipc__cu.cuMemFree(A));
  CU(gpuipc__cu.cuStreamDestroy(gate));
  CU(gpuipc__cu.cuEventDestroy(e0));
  CU(gpuipc__cu.cuEventDestroy(e1));
  return (double)ms * 1000.0 / n;
}

/* The parts a handoff is made of with this design: one small message
 * between the processes, and the enqueue of the ready write (producer) and
 * of the wait (consumer). out: message one way (half a polled ping-pong),
 * cuStreamWriteValue64 and cuStreamWaitValue64 (satisfied) enqueue times,
 * medians in us. */
static void raw_floor(bctx *b, double out[3]) {
  gpuipc_conn *c = b->c[0];
  int n = b->iters;
  double *v = calloc((size_t)n, sizeof *v);
  if (v == NULL)
    DIE("out of memory");
  send_cmd(c, OP_ECHO, (uint32_t)n);
  OK(gpuipc_conn_set_nonblocking(c, 1));
  for (int i = 0; i < n; i++) {
    char e[16] = "ping", r[16];
    size_t len = 0;
    double t0 = now_us();
    OK(gpuipc_conn_send_msg(c, e, sizeof e, NULL, 0));
    for (;;) {
      gpuipc_status st = gpuipc_conn_recv_msg(c, r, sizeof r, &len, NULL, NULL);
      if (st == GPUIPC_OK)
        break;
      if (st != GPUIPC_E_WOULD_BLOCK)
        DIE("echo: %s", gpuipc_strerror(st));
    }
    v[i] = (now_us() - t0) / 2;
  }
  OK(gpuipc_conn_set_nonblocking(c, 0));
  /* The consumer answers every command, this one too: take its reply, or
   * every later reply read from this consumer is the one before. */
  (void)get_reply(c);
  out[0] = pct(v, n, 0.5);
  CUdeviceptr w;
  CU(gpuipc__cu.cuMemAlloc(&w, 4096));
  CU(gpuipc__cu.cuMemsetD8(w, 0, 4096));
  for (int i = 0; i < n; i++) {
    double t0 = now_us();
    CU(gpuipc__cu.cuStreamWriteValue64(b->s, w, (cuuint64_t)i + 1, 0));
    v[i] = now_us() - t0;
  }
  out[1] = pct(v, n, 0.5);
  for (int i = 0; i < n; i++) {
    double t0 = now_us();
    CU(gpuipc__cu.cuStreamWaitValue64(b->s, w, 1, CU_STREAM_WAIT_VALUE_GEQ));
    v[i] = now_us() - t0;
  }
  out[2] = pct(v, n, 0.5);
  CU(gpuipc__cu.cuStreamSynchronize(b->s));
  CU(gpuipc__cu.cuMemFree(w));
  free(v);
}

static const char *size_name(size_t s, char *buf) {
  if (s >= ((size_t)1 << 20))
    sprintf(buf, "%zu MiB", s >> 20);
  else
    sprintf(buf, "%zu KiB", s >> 10);
  return buf;
}

static void usage(FILE *f) {
  fprintf(f, "usage: gpuipc bench handoff [--quick] [--iters N] [--json FILE] "
             "[--emulator PATH]\n"
             "  handoff latency and throughput over a connection, 1 and %d "
             "consumers,\n"
             "  fan-out to 8, 16 and %d consumers (each in turn and by "
             "broadcast),\n"
             "  batches of 1, 16 and 256, and throughput with 10 to 100000 "
             "buffers leased,\n"
             "  next to the raw driver paths measured in the same run\n"
             "  --quick    %d iterations, 4 KiB and 1 MiB only, 16 consumers "
             "(fan-out to 8 and 16,\n"
             "             flatness to 10000 leases)\n"
             "  --iters N  iterations per figure (default 2000)\n",
          MAXC, NCONS, 200);
}

int gpuipc_bench_handoff(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    }
  int emu = gpuipc_cli_pick_driver(&argc, argv, "bench handoff");
  if (emu < 0)
    return 1;
  bool quick = false;
  int iters = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--child") == 0 && i + 1 < argc)
      return consumer(atoi(argv[i + 1]));
    else if (strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "all") != 0 &&
               strcmp(argv[i], "handoff") != 0) {
      fprintf(stderr, "gpuipc bench handoff: unknown option '%s'\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (iters <= 0)
    iters = quick ? 200 : 2000;

  /* The consumers start before this process touches CUDA. */
  /* --quick starts 16 consumers (fan-out rows to 8 and 16, flatness to
   * 10,000 leases): a smoke run that a slow build (sanitizers) finishes. */
  bctx b = {{0}, MAXC, NULL, iters, quick ? 16 : NCONS};
  pid_t pids[NCONS];
  for (int k = 0; k < b.ncons; k++) {
    int fds[2];
    OK(gpuipc_conn_pair(fds));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 3);
    char *args[] = {"gpuipc", "bench", "handoff", "--child", "3", NULL};
    int err = posix_spawn(&pids[k], "/proc/self/exe", &fa, NULL, args, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (err != 0) {
      fprintf(stderr, "gpuipc bench handoff: spawn: %s\n", strerror(err));
      return 1;
    }
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.timeout_ms = 120000;
    /* Room for two batches of 256 in flight; the last two consumers hold
     * up to 50,000 buffers each in the flatness rows. */
    o.max_outstanding = k >= b.ncons - 2 ? 65536 : 1024;
    OK(gpuipc_conn_from_fd(fds[0], &o, &b.c[k]));
  }
  OK(gpuipc_init());
  current();
  CU(gpuipc__cu.cuStreamCreate(&b.s, CU_STREAM_NON_BLOCKING));
  char name[128] = "?";
  CUdevice dev;
  CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  CU(gpuipc__cu.cuDeviceGetName(name, (int)sizeof name, dev));
  printf("gpuipc bench handoff: %s%s, %d iterations%s\n", name,
         emu ? " (emulated: times are the emulator's, not a GPU's)" : "",
         iters, quick ? " (--quick)" : "");
  gpuipc_bench_json_str("device", name);
  gpuipc_bench_json_num("iterations", iters);
  gpuipc_bench_json_num("quick", quick);
  gpuipc_bench_json_num("consumers_max", MAXC);

  size_t sizes_full[] = {(size_t)4 << 10, (size_t)64 << 10, (size_t)1 << 20,
                         (size_t)16 << 20, (size_t)256 << 20};
  /* --quick: a GPU run well under 30 s (the full run takes minutes). */
  size_t sizes_quick[] = {(size_t)4 << 10, (size_t)1 << 20};
  size_t *sizes = quick ? sizes_quick : sizes_full;
  int nsizes = quick ? 2 : 5;
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = quick ? (size_t)128 << 20 : (size_t)1100 << 20;
  gpuipc_arena *a = NULL;
  OK(gpuipc_arena_create(&ao, &a));

  {
    /* The raw driver paths first: short, and the comparison the handoff
     * numbers are read against (a long run cut off still shows them). */
    double leg[3], pool[4];
    raw_legacy(&b, leg);
    raw_pool(&b, pool);
    double rt = raw_memop(&b);
    double fl[3];
    raw_floor(&b, fl);
    printf("\nraw driver paths, same run (medians, us; 1 MiB allocations):\n");
    printf("  legacy   cuIpcGetMemHandle %.2f | cuIpcOpenMemHandle %.2f | "
           "cuIpcCloseMemHandle %.2f | per buffer %.2f\n",
           leg[0], leg[1], leg[2], leg[0] + leg[1] + leg[2]);
    printf("  mempool  cuMemPoolExportPointer %.2f | cuMemPoolImportPointer "
           "%.2f | free %.2f | per buffer %.2f (pool import + access, once: "
           "%.1f)\n",
           pool[0], pool[1], pool[2], pool[0] + pool[1] + pool[2], pool[3]);
    printf("  ordering GPU round trip, stream write+wait value across two "
           "processes: %.2f us\n",
           rt);
    printf("  parts    one small message between the processes %.2f | "
           "cuStreamWriteValue64 enqueue %.2f | cuStreamWaitValue64 enqueue "
           "%.2f (a handoff is a message, then the consumer's wait enqueue; "
           "a full cycle also costs each side a write enqueue and a message "
           "back)\n",
           fl[0], fl[1], fl[2]);
    fflush(stdout);
    /* The same figures, one row per path; per_buffer_us is what one
     * buffer handed over that way costs (the line the charts draw). */
    gpuipc_bench_json_row_begin("raw");
    gpuipc_bench_json_str("path", "legacy");
    gpuipc_bench_json_num("get_us", leg[0]);
    gpuipc_bench_json_num("open_us", leg[1]);
    gpuipc_bench_json_num("close_us", leg[2]);
    gpuipc_bench_json_num("per_buffer_us", leg[0] + leg[1] + leg[2]);
    gpuipc_bench_json_row_end();
    gpuipc_bench_json_row_begin("raw");
    gpuipc_bench_json_str("path", "mempool");
    gpuipc_bench_json_num("export_us", pool[0]);
    gpuipc_bench_json_num("import_us", pool[1]);
    gpuipc_bench_json_num("free_us", pool[2]);
    gpuipc_bench_json_num("per_buffer_us", pool[0] + pool[1] + pool[2]);
    gpuipc_bench_json_num("pool_import_once_us", pool[3]);
    gpuipc_bench_json_row_end();
    gpuipc_bench_json_row_begin("raw");
    gpuipc_bench_json_str("path", "memop_round_trip");
    gpuipc_bench_json_num("per_buffer_us", rt);
    gpuipc_bench_json_row_end();
    gpuipc_bench_json_row_begin("raw");
    gpuipc_bench_json_str("path", "message");
    gpuipc_bench_json_num("per_buffer_us", fl[0]);
    gpuipc_bench_json_num("write_value_enqueue_us", fl[1]);
    gpuipc_bench_json_num("wait_value_enqueue_us", fl[2]);
    gpuipc_bench_json_row_end();
  }

  printf("\nhandoff: send -> consumer holds an ordered, usable buffer (consumer "
         "polls); throughput: full cycle incl. release;\nsend()/recv(): "
         "median time inside gpuipc_conn_send / the gpuipc_conn_recv call that "
         "returned the buffer\n");
  printf("%-9s %9s %11s %10s %14s %10s %10s\n", "size", "consumers",
         "median us", "p90 us", "buffers/s", "send() us", "recv() us");
  double pair_med = 0, pair_tput = 0;
  {
    /* Warm-up: every consumer imports the arena and the flag words. */
    int keep = b.iters;
    b.iters = 20;
    double m, p, sc, rc;
    run_lat(&b, a, 4096, MAXC, &m, &p, &sc, &rc);
    b.iters = keep;
  }
  for (int si = 0; si < nsizes; si++) {
    size_t sz = sizes[si];
    int ring = sz >= ((size_t)64 << 20) ? 4 : 32;
    int ncs[2] = {1, MAXC};
    for (int ci = 0; ci < 2; ci++) {
      double med, p90, sc, rc;
      run_lat(&b, a, sz, ncs[ci], &med, &p90, &sc, &rc);
      double tput = run_tput(&b, a, sz, ncs[ci], ring);
      char sn[32];
      printf("%-9s %9d %11.2f %10.2f %14.0f %10.2f %10.2f\n", size_name(sz, sn),
             ncs[ci], med, p90, tput, sc, rc);
      fflush(stdout);
      gpuipc_bench_json_row_begin("handoff");
      gpuipc_bench_json_num("size_bytes", (double)sz);
      gpuipc_bench_json_num("consumers", ncs[ci]);
      gpuipc_bench_json_num("median_us", med);
      gpuipc_bench_json_num("p90_us", p90);
      gpuipc_bench_json_num("buffers_per_s", tput);
      gpuipc_bench_json_num("send_us", sc);
      gpuipc_bench_json_num("recv_us", rc);
      gpuipc_bench_json_row_end();
      if (ncs[ci] == 1 && si == 0) {
        pair_med = med;
        pair_tput = tput;
      }
    }
  }

  printf("\none pair, 4 KiB: median %.2f us (target <= 2), %.0f buffers/s "
         "(target >= 400000)%s\n",
         pair_med, pair_tput,
         emu ? "; on the emulator these say little about a GPU" : "");
  gpuipc_bench_json_num("pair_4k_median_us", pair_med);
  gpuipc_bench_json_num("pair_4k_buffers_per_s", pair_tput);

  /* Fan-out: one 4 KiB buffer to nc consumers. */
  printf("\nfan-out, 4 KiB: send -> the LAST consumer holds the buffer "
         "(per buffer, the latest of the consumers); each: the consumers' "
         "medians, averaged;\ncall: median time inside the send call(s) of "
         "one buffer\n");
  printf("%-10s %9s %16s %13s %10s %10s\n", "mode", "consumers",
         "median last us", "p90 last us", "each us", "call us");
  {
    int keep = b.iters;
    b.iters = 20;
    double m, p, e, cl;
    run_fan(&b, a, 4096, b.ncons, true, &m, &p, &e, &cl);
    b.iters = keep;
  }
  double bc8_med = 0, bc8_p90 = 0;
  static const int fan_n[3] = {8, 16, NCONS};
  int nfan = b.ncons == NCONS ? 3 : 2;
  for (int fi = 0; fi < nfan; fi++) {
    for (int mode = 0; mode < 2; mode++) {
      double ml, pl, me, cl;
      run_fan(&b, a, 4096, fan_n[fi], mode == 1, &ml, &pl, &me, &cl);
      const char *mn = mode ? "broadcast" : "each";
      printf("%-10s %9d %16.2f %13.2f %10.2f %10.2f\n", mn, fan_n[fi], ml, pl,
             me, cl);
      fflush(stdout);
      gpuipc_bench_json_row_begin("fanout");
      gpuipc_bench_json_str("mode", mn);
      gpuipc_bench_json_num("size_bytes", 4096);
      gpuipc_bench_json_num("consumers", fan_n[fi]);
      gpuipc_bench_json_num("median_last_us", ml);
      gpuipc_bench_json_num("p90_last_us", pl);
      gpuipc_bench_json_num("median_each_us", me);
      gpuipc_bench_json_num("call_us", cl);
      gpuipc_bench_json_row_end();
      if (mode == 1 && fan_n[fi] == 8) {
        bc8_med = ml;
        bc8_p90 = pl;
      }
    }
  }

  /* Batches: send_batch / recv_batch / release_batch cycles. */
  printf("\nbatches, 4 KiB blocks, one consumer, two batches in flight: full "
         "cycle (send_batch, recv_batch, release_batch, the releases back);\n"
         "call: median time inside gpuipc_conn_send_batch\n");
  printf("%-6s %14s %16s %10s\n", "batch", "buffers/s", "per buffer us",
         "call us");
  double b16 = 0;
  static const int batch_n[3] = {1, 16, BATCH_MAX};
  for (int bi = 0; bi < 3; bi++) {
    double cl = 0;
    double rate = run_batch(&b, a, 4096, batch_n[bi], &cl);
    printf("%-6d %14.0f %16.3f %10.2f\n", batch_n[bi], rate, 1e6 / rate, cl);
    fflush(stdout);
    gpuipc_bench_json_row_begin("batch");
    gpuipc_bench_json_num("batch", batch_n[bi]);
    gpuipc_bench_json_num("size_bytes", 4096);
    gpuipc_bench_json_num("buffers_per_s", rate);
    gpuipc_bench_json_num("per_buffer_us", 1e6 / rate);
    gpuipc_bench_json_num("call_us", cl);
    gpuipc_bench_json_row_end();
    if (batch_n[bi] == 16)
      b16 = rate;
  }

  /* Flatness: the cost of one handoff with many buffers leased. */
  printf("\nflatness: single 4 KiB handoffs (full cycle) while other "
         "buffers stay leased (held by two consumers)\n");
  printf("%12s %14s %16s\n", "live leases", "buffers/s", "per buffer us");
  {
    gpuipc_arena_options fo = GPUIPC_ARENA_OPTIONS_INIT;
    fo.chunk_bytes = (size_t)32 << 20;
    gpuipc_arena *fa = NULL;
    OK(gpuipc_arena_create(&fo, &fa));
    static const long live_n[5] = {10, 100, 1000, 10000, 100000};
    for (int li = 0; li < (quick ? 4 : 5); li++) {
      double rate = run_flat(&b, fa, live_n[li]);
      printf("%12ld %14.0f %16.3f\n", live_n[li], rate, 1e6 / rate);
      fflush(stdout);
      gpuipc_bench_json_row_begin("flatness");
      gpuipc_bench_json_num("live_leases", (double)live_n[li]);
      gpuipc_bench_json_num("size_bytes", 4096);
      gpuipc_bench_json_num("buffers_per_s", rate);
      gpuipc_bench_json_num("per_buffer_us", 1e6 / rate);
      gpuipc_bench_json_row_end();
    }
    CU(gpuipc__cu.cuStreamSynchronize(b.s));
    OK(gpuipc_arena_destroy(fa));
  }

  printf("\nbroadcast to 8, 4 KiB, last consumer: median %.2f us (target <= "
         "6), p90 %.2f us (target <= 15); batches of 16: %.0f buffers/s "
         "(target >= 2000000)%s\n",
         bc8_med, bc8_p90, b16,
         emu ? "; on the emulator these say little about a GPU" : "");
  gpuipc_bench_json_num("broadcast_8_median_last_us", bc8_med);
  gpuipc_bench_json_num("broadcast_8_p90_last_us", bc8_p90);
  gpuipc_bench_json_num("batch_16_buffers_per_s", b16);

  for (int k = 0; k < b.ncons; k++) {
    send_cmd(b.c[k], OP_QUIT, 0);
    gpuipc_conn_close(b.c[k]);
  }
  int rc = 0;
  for (int k = 0; k < b.ncons; k++) {
    int st = 0;
    waitpid(pids[k], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
      rc = 1;
  }
  CU(gpuipc__cu.cuStreamSynchronize(b.s));
  OK(gpuipc_arena_destroy(a));
  return rc;
}
