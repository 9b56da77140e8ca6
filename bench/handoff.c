/*
 * handoff.c: `gpuipc bench handoff`: what handing a GPU buffer to another
 * process costs over a gpuipc connection, next to the raw parts measured in
 * the same run. Every row says which path of the library it measured, and
 * every row times the same work in each of its iterations:
 *
 *   raw parts        legacy cuIpcGetMemHandle / Open / Close; pool pointer
 *                    cuMemPoolExportPointer / ImportPointer / free (and the
 *                    one-time pool import); the GPU round trip of the
 *                    ordering mechanism (stream write/wait value between
 *                    two processes' streams, no host in the loop); one
 *                    small message one way; the cuStreamWriteValue64 and
 *                    cuStreamWaitValue64 enqueues a handoff is made of;
 *   one pair         4 KiB, from the producer's gpuipc_conn_send to the
 *                    consumer holding a usable buffer (its gpuipc_conn_recv
 *                    returned, its stream wait enqueued; the consumer
 *                    polls), one buffer in flight, and the full cycle's
 *                    buffers per second, once per path:
 *                      ordered   the producer's stream is busy at the send
 *                                (a cuStreamWaitValue32 on a word in pinned
 *                                host memory, queued before the send, which
 *                                the producer's host writes right after the
 *                                send returns): the ready write and the
 *                                consumer's wait, the stream-ordered path;
 *                      idle      nothing queued on the producer's stream:
 *                                the library's query finds it idle and
 *                                sends a DONE frame (no write, no wait);
 *                      complete  nothing queued, and the send says so
 *                                (gpuipc_conn_send_ex with
 *                                GPUIPC_SEND_COMPLETE): no query either;
 *                    and once per carrier asked for (GPUIPC_CARRIER=socket
 *                    and =ring in both processes' environments), each row
 *                    naming the carrier that carried it. A probe before
 *                    each row checks the path: with the producer's stream
 *                    held, the consumer's stream must be waiting after its
 *                    recv on the ordered path, and idle on the others;
 *   sizes            the ordered path for 4 KiB .. 256 MiB, 1 and 8
 *                    consumers (with 8, each buffer goes to every consumer
 *                    for latency, round-robin for throughput);
 *   fan-out          one 4 KiB buffer (ordered path) to 8, 16 and 64
 *                    consumers, to each in turn and by gpuipc_conn_broadcast:
 *                    the latency to the last consumer. Sleeping: consumers
 *                    wait in poll() on gpuipc_conn_get_fd between receives
 *                    and the producer waits for the releases in poll();
 *                    spinning: both poll the library without sleeping,
 *                    labelled with the processes and CPUs it ran on;
 *   batches          the full cycle of gpuipc_conn_send_batch / recv_batch /
 *                    release_batch in batches of 1, 16 and 256 (ordered);
 *   flatness         the full cycle of single handoffs (ordered) while 10 ..
 *                    100,000 other buffers stay leased, held by two
 *                    consumers over two connections (a connection allows at
 *                    most 65536 outstanding).
 *
 * --quick: 200 iterations, 4 KiB and 1 MiB only, 16 consumers (fan-out to
 * 8 and 16, flatness to 10,000 leases): seconds on the emulator.
 *
 * Consumers are this program re-executed (/proc/self/exe) with a hidden
 * argument, started before the producer initializes CUDA. Times are
 * CLOCK_MONOTONIC, which all processes of the machine share.
 */
#define BENCH_NAME "handoff"
#include "bench.h"
#include "bench_int.h"
#include "tree.h"

#include <errno.h>
#include <stdarg.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MAXC 8   /* consumers of the sizes table */
#define NCONS 64 /* consumers started (the fan-out rows use up to all) */
#define BATCH_MAX 256
#define NCARRIER 2 /* the carriers asked for in the one-pair rows */
#define VEC_CHUNK 8000 /* latencies per message sent back */

enum {
  OP_LAT = 1, /* receive n buffers, release each; latencies in the reply */
  OP_TPUT,    /* the same, timed as a whole */
  OP_LEGACY,
  OP_POOL,
  OP_MEMOP,
  OP_ECHO,
  OP_QUIT,
  OP_TPUTB,  /* receive and release in batches */
  OP_HOLD,   /* receive n buffers and keep them */
  OP_UNHOLD, /* release every buffer kept */
  OP_PROBE,  /* receive one buffer: is our stream waiting for the producer? */
  OP_CARRIER /* send back the name of our end's carrier */
};
enum {
  FL_SLEEP = 1,    /* wait in poll() between receives (else poll the library) */
  FL_SENDBACK = 2, /* send every latency back (messages of doubles) */
  FL_RELC = 4      /* release with GPUIPC_RELEASE_COMPLETE (no GPU work here) */
};

typedef struct cmd {
  uint32_t op;
  uint32_t n;
  uint32_t flags;
} cmd;

typedef struct reply {
  double a, b, c, d; /* op-specific, microseconds */
} reply;

static double now_us(void) { return (double)gpuipc__now_ns() / 1000.0; }

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (p == NULL)
    DIE("out of memory");
  return p;
}

static void current(void) {
  CUcontext c;
  OK(gpuipc__primary_ctx(0, &c));
  CU(gpuipc__cu.cuCtxSetCurrent(c));
}

static void send_cmd_fl(gpuipc_conn *c, uint32_t op, uint32_t n,
                        uint32_t flags) {
  cmd m = {op, n, flags};
  OK(gpuipc_conn_send_msg(c, &m, sizeof m, NULL, 0));
}
static void send_cmd(gpuipc_conn *c, uint32_t op, uint32_t n) {
  send_cmd_fl(c, op, n, 0);
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

/* ---- consumer ----------------------------------------------------------------- */

typedef struct cons {
  gpuipc_conn *c;
  CUstream s;
  CUdevice dev;
  uint64_t *held; /* OP_HOLD: the buffers kept */
  size_t nheld;
} cons;

static double last_call_start; /* start of the recv call that succeeded */

/* Receives, polling (non-blocking) for up to 200 us, then blocking: the
 * latency a polling consumer sees, without starving the producer of CPU
 * when consumers outnumber cores. */
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

/* Receives, sleeping in poll() on the connection's fd whenever nothing is
 * there: a consumer that never spins. */
static void sleep_recv(gpuipc_conn *c, CUstream s, gpuipc_received *r) {
  for (;;) {
    last_call_start = now_us();
    gpuipc_status st = gpuipc_conn_recv(c, (struct CUstream_st *)s, r);
    if (st == GPUIPC_OK)
      return;
    if (st != GPUIPC_E_WOULD_BLOCK)
      DIE("gpuipc_conn_recv: %s", gpuipc_strerror(st));
    struct pollfd p = {gpuipc_conn_get_fd(c), POLLIN, 0};
    if (poll(&p, 1, 120000) <= 0)
      DIE("sleeping consumer: no buffer within 120 s");
  }
}

/* OP_LAT / OP_TPUT: n buffers, each released at once. Reply: median and
 * p90 latency (send to recv returned), the whole run, the median time
 * inside the recv call that returned. */
static reply op_lat(cons *k, const cmd *m) {
  int n = (int)m->n;
  double *v = xcalloc((size_t)n, sizeof *v);
  double *x = xcalloc((size_t)n, sizeof *x);
  OK(gpuipc_conn_set_nonblocking(k->c, 1));
  double t0 = 0;
  for (int i = 0; i < n; i++) {
    gpuipc_received in = GPUIPC_RECEIVED_INIT;
    if (m->flags & FL_SLEEP)
      sleep_recv(k->c, k->s, &in);
    else
      spin_recv(k->c, k->s, &in);
    double t = now_us();
    x[i] = t - last_call_start;
    if (i == 0)
      t0 = t;
    double sent;
    memcpy(&sent, in.meta, sizeof sent);
    v[i] = t - sent;
    OK(gpuipc_conn_release_ex(k->c, in.id, (struct CUstream_st *)k->s,
                              (m->flags & FL_RELC) ? GPUIPC_RELEASE_COMPLETE
                                                   : 0));
  }
  OK(gpuipc_conn_set_nonblocking(k->c, 0));
  /* Before the percentiles sort them. */
  if (m->flags & FL_SENDBACK)
    for (int i = 0; i < n; i += VEC_CHUNK) {
      int c = n - i < VEC_CHUNK ? n - i : VEC_CHUNK;
      OK(gpuipc_conn_send_msg(k->c, v + i, (size_t)c * sizeof *v, NULL, 0));
    }
  reply r = {bench_pct(v, n, 0.5), bench_pct(v, n, 0.9), now_us() - t0, bench_pct(x, n, 0.5)};
  free(v);
  free(x);
  return r;
}

/* OP_TPUTB: receive whatever arrived (up to BATCH_MAX), release it all in
 * one call. */
static reply op_tputb(cons *k, const cmd *m) {
  gpuipc_received *in = xcalloc(BATCH_MAX, sizeof *in);
  uint64_t *ids = xcalloc(BATCH_MAX, sizeof *ids);
  OK(gpuipc_conn_set_nonblocking(k->c, 1));
  double t0 = 0;
  for (int got = 0; got < (int)m->n;) {
    for (int i = 0; i < BATCH_MAX; i++)
      in[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    size_t n = 0;
    gpuipc_status rs = gpuipc_conn_recv_batch(k->c, (struct CUstream_st *)k->s,
                                              in, BATCH_MAX, &n);
    if (rs == GPUIPC_E_WOULD_BLOCK)
      continue;
    OK(rs);
    if (got == 0)
      t0 = now_us();
    for (size_t i = 0; i < n; i++)
      ids[i] = in[i].id;
    OK(gpuipc_conn_release_batch(k->c, ids, n, (struct CUstream_st *)k->s));
    got += (int)n;
  }
  OK(gpuipc_conn_set_nonblocking(k->c, 0));
  reply r = {0, 0, now_us() - t0, 0};
  free(in);
  free(ids);
  return r;
}

/* OP_HOLD: receive n buffers and keep them (the flatness rows). */
static void op_hold(cons *k, int n) {
  uint64_t *nh = realloc(k->held, (k->nheld + (size_t)n) * sizeof *nh);
  if (nh == NULL)
    DIE("out of memory");
  k->held = nh;
  gpuipc_received *in = xcalloc(BATCH_MAX, sizeof *in);
  for (int got = 0; got < n;) {
    for (int i = 0; i < BATCH_MAX; i++)
      in[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    size_t g = 0;
    size_t want = (size_t)(n - got) < BATCH_MAX ? (size_t)(n - got) : BATCH_MAX;
    OK(gpuipc_conn_recv_batch(k->c, (struct CUstream_st *)k->s, in, want, &g));
    for (size_t i = 0; i < g; i++)
      k->held[k->nheld++] = in[i].id;
    got += (int)g;
  }
  free(in);
}

static void op_unhold(cons *k) {
  for (size_t i = 0; i < k->nheld; i += GPUIPC_BATCH_MAX) {
    size_t n = k->nheld - i < GPUIPC_BATCH_MAX ? k->nheld - i : GPUIPC_BATCH_MAX;
    OK(gpuipc_conn_release_batch(k->c, k->held + i, n,
                                 (struct CUstream_st *)k->s));
  }
  k->nheld = 0;
}

/* OP_ECHO: echoes n small messages, polling for each like a consumer that
 * polls for buffers. */
static void op_echo(cons *k, int n) {
  OK(gpuipc_conn_set_nonblocking(k->c, 1));
  for (int i = 0; i < n; i++) {
    char e[16];
    size_t len = 0;
    for (;;) {
      gpuipc_status es =
          gpuipc_conn_recv_msg(k->c, e, sizeof e, &len, NULL, NULL);
      if (es == GPUIPC_OK)
        break;
      if (es != GPUIPC_E_WOULD_BLOCK)
        DIE("echo: %s", gpuipc_strerror(es));
    }
    OK(gpuipc_conn_send_msg(k->c, e, len, NULL, 0));
  }
  OK(gpuipc_conn_set_nonblocking(k->c, 0));
}

static reply op_legacy(cons *k, int n) {
  double *v = xcalloc((size_t)n, sizeof *v), *w = xcalloc((size_t)n, sizeof *w);
  for (int i = 0; i < n; i++) {
    CUipcMemHandle h;
    size_t len = 0;
    OK(gpuipc_conn_recv_msg(k->c, &h, sizeof h, &len, NULL, NULL));
    CUdeviceptr p;
    double t0 = now_us();
    CU(gpuipc__cu.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    double t1 = now_us();
    CU(gpuipc__cu.cuIpcCloseMemHandle(p));
    double t2 = now_us();
    v[i] = t1 - t0;
    w[i] = t2 - t1;
    OK(gpuipc_conn_send_msg(k->c, "k", 1, NULL, 0));
  }
  reply r = {bench_pct(v, n, 0.5), bench_pct(w, n, 0.5), 0, 0};
  free(v);
  free(w);
  return r;
}

static reply op_pool(cons *k, int n) {
  int pfd = -1, nf = 1;
  char b;
  size_t len = 0;
  OK(gpuipc_conn_recv_msg(k->c, &b, 1, &len, &pfd, &nf));
  if (nf != 1)
    DIE("pool fd missing");
  CUmemoryPool pool;
  double t0 = now_us();
  CU(gpuipc__cu.cuMemPoolImportFromShareableHandle(
      &pool, (void *)(uintptr_t)pfd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CUmemAccessDesc ad = {{CU_MEM_LOCATION_TYPE_DEVICE, (int)k->dev},
                        CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CU(gpuipc__cu.cuMemPoolSetAccess(pool, &ad, 1));
  reply r = {0, 0, now_us() - t0, 0};
  close(pfd);
  OK(gpuipc_conn_send_msg(k->c, "k", 1, NULL, 0));
  double *v = xcalloc((size_t)n, sizeof *v), *w = xcalloc((size_t)n, sizeof *w);
  for (int i = 0; i < n; i++) {
    CUmemPoolPtrExportData d;
    OK(gpuipc_conn_recv_msg(k->c, &d, sizeof d, &len, NULL, NULL));
    CUdeviceptr p;
    double t1 = now_us();
    CU(gpuipc__cu.cuMemPoolImportPointer(&p, pool, &d));
    double t2 = now_us();
    CU(gpuipc__cu.cuMemFree(p));
    double t3 = now_us();
    v[i] = t2 - t1;
    w[i] = t3 - t2;
    OK(gpuipc_conn_send_msg(k->c, "k", 1, NULL, 0));
  }
  r.a = bench_pct(v, n, 0.5);
  r.b = bench_pct(w, n, 0.5);
  free(v);
  free(w);
  return r;
}

/* The flag words (cuMemAlloc memory: stream memory operations refuse pool
 * memory) arrive as a legacy handle: A (producer writes) at 0, B (we
 * write) at 256. Enqueue the whole ping-pong, then say so. */
static void op_memop(cons *k, int n) {
  CUipcMemHandle hd;
  size_t len = 0;
  OK(gpuipc_conn_recv_msg(k->c, &hd, sizeof hd, &len, NULL, NULL));
  CUdeviceptr A;
  CU(gpuipc__cu.cuIpcOpenMemHandle(&A, hd, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CUdeviceptr B = A + 256;
  for (int i = 1; i <= n; i++) {
    CU(gpuipc__cu.cuStreamWaitValue64(k->s, A, (cuuint64_t)i, CU_STREAM_WAIT_VALUE_GEQ));
    CU(gpuipc__cu.cuStreamWriteValue64(k->s, B, (cuuint64_t)i, 0));
  }
  OK(gpuipc_conn_send_msg(k->c, "k", 1, NULL, 0));
  CU(gpuipc__cu.cuStreamSynchronize(k->s));
  CU(gpuipc__cu.cuIpcCloseMemHandle(A));
}

/* OP_PROBE: one buffer on an idle stream of ours; r.a = 1 when, after the
 * recv, our stream waits for the producer (the producer holds its stream
 * until it has this reply), 0 when our stream has nothing pending. */
static reply op_probe(cons *k) {
  CU(gpuipc__cu.cuStreamSynchronize(k->s));
  gpuipc_received in = GPUIPC_RECEIVED_INIT;
  OK(gpuipc_conn_recv(k->c, (struct CUstream_st *)k->s, &in));
  CUresult q = gpuipc__cu.cuStreamQuery(k->s);
  if (q != CUDA_SUCCESS && q != CUDA_ERROR_NOT_READY)
    DIE("cuStreamQuery: %s", gpuipc__cuda_error_name(q));
  OK(gpuipc_conn_release(k->c, in.id, (struct CUstream_st *)k->s));
  reply r = {q == CUDA_ERROR_NOT_READY, 0, 0, 0};
  return r;
}

static void consumer_op(cons *k, const cmd *m) {
  reply r = {0, 0, 0, 0};
  int n = (int)m->n;
  /* A consumer that polls the library says so (the ring carrier then
   * needs no wake message per buffer); one that sleeps on the fd does
   * not. Between commands it waits inside gpuipc, which sleeps safely. */
  OK(gpuipc_conn_set_polling(k->c, !(m->flags & FL_SLEEP)));
  switch (m->op) {
  case OP_LAT:
  case OP_TPUT:
    r = op_lat(k, m);
    break;
  case OP_TPUTB:
    r = op_tputb(k, m);
    break;
  case OP_HOLD:
    op_hold(k, n);
    break;
  case OP_UNHOLD:
    op_unhold(k);
    break;
  case OP_ECHO:
    op_echo(k, n);
    break;
  case OP_LEGACY:
    r = op_legacy(k, n);
    break;
  case OP_POOL:
    r = op_pool(k, n);
    break;
  case OP_MEMOP:
    op_memop(k, n);
    break;
  case OP_PROBE:
    r = op_probe(k);
    break;
  case OP_CARRIER: {
    const char *name = gpuipc__conn_carrier_name(k->c);
    OK(gpuipc_conn_send_msg(k->c, name, strlen(name) + 1, NULL, 0));
    return; /* the name is the reply */
  }
  default:
    DIE("unknown command %u", m->op);
  }
  OK(gpuipc_conn_set_polling(k->c, 0));
  send_reply(k->c, r);
}

static int consumer(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  cons k = {0};
  OK(gpuipc_conn_from_fd(fd, &o, &k.c));
  OK(gpuipc_init());
  current();
  CU(gpuipc__cu.cuStreamCreate(&k.s, CU_STREAM_NON_BLOCKING));
  CU(gpuipc__cu.cuDeviceGet(&k.dev, 0));
  for (;;) {
    cmd m;
    size_t len = 0;
    OK(gpuipc_conn_set_nonblocking(k.c, 0));
    /* Idle consumers wait for their next command as long as the producer
     * lives: the rows before the fan-out (its first use of consumers 8 and
     * up) take minutes on a GPU, longer than any per-call limit. */
    OK(gpuipc_conn_set_timeout(k.c, -1));
    gpuipc_status st = gpuipc_conn_recv_msg(k.c, &m, sizeof m, &len, NULL, NULL);
    if (st == GPUIPC_E_PEER_GONE || (st == GPUIPC_OK && m.op == OP_QUIT))
      break;
    OK(st);
    OK(gpuipc_conn_set_timeout(k.c, o.timeout_ms));
    consumer_op(&k, &m);
  }
  CU(gpuipc__cu.cuStreamSynchronize(k.s));
  gpuipc_conn_close(k.c);
  free(k.held);
  return 0;
}

/* ---- producer: the watchdog ----------------------------------------------------- */

/* Where the producer is: a figure that stalls (no buffer done within
 * watch_s seconds, --watch) ends the run with its stage named, rather than leave
 * the consumers to time out one by one with nothing said. */
enum { WATCH_S_DEFAULT = 60 };
static int watch_s = WATCH_S_DEFAULT;
static char watch_what[96];
static const char *volatile watch_step = "start";
static volatile int watch_i, watch_k;

static void watch_put(const char *s) {
  ssize_t w = write(2, s, strlen(s));
  (void)w;
}

static void watch_int(int v) {
  char buf[16];
  int n = sizeof buf;
  unsigned u = v < 0 ? 0u - (unsigned)v : (unsigned)v;
  buf[--n] = 0;
  do
    buf[--n] = (char)('0' + u % 10);
  while ((u /= 10) && n > 1);
  if (v < 0)
    buf[--n] = '-';
  watch_put(buf + n);
}

static void watch_fire(int sig) {
  (void)sig;
  watch_put("gpuipc bench handoff: stalled ");
  watch_int(watch_s);
  watch_put(" s in ");
  watch_put(watch_what);
  watch_put(", buffer ");
  watch_int(watch_i);
  watch_put(", step ");
  watch_put(watch_step);
  watch_put(", connection ");
  watch_int(watch_k);
  watch_put("\n");
  _exit(3);
}

/* A new figure (printf-style name): the watch restarts. */
static void watch_figure(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void watch_figure(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(watch_what, sizeof watch_what, fmt, ap);
  va_end(ap);
  watch_i = 0;
  watch_k = -1;
  watch_step = "start";
  signal(SIGALRM, watch_fire);
  alarm((unsigned)watch_s);
}

/* Buffer i of the figure is under way. */
static void watch_buffer(int i) {
  watch_i = i;
  alarm((unsigned)watch_s);
}

/* ---- producer: paths, the gate, sending --------------------------------------- */

typedef enum { P_ORDERED, P_IDLE, P_COMPLETE, P_BOTH, P_N } path_id;
static const struct {
  const char *key, *text;
} PATHS[] = {
    {"ordered", "stream-ordered: the producer's stream is busy at the send "
                "(ready write after the frame, the consumer's wait in its "
                "recv)"},
    {"idle", "idle producer stream: the library's query finds it idle and "
             "sends a DONE frame (no ready write, no consumer wait)"},
    {"complete", "asserted complete: gpuipc_conn_send_ex with "
                 "GPUIPC_SEND_COMPLETE (no query, no ready write, no "
                 "consumer wait)"},
    {"complete2", "both asserted complete: that send, and the consumer's "
                  "gpuipc_conn_release_ex with GPUIPC_RELEASE_COMPLETE (no "
                  "release write, no reclaim wait)"},
};

/* The consumer's command flags of a path. */
static uint32_t path_flags(path_id p) { return p == P_BOTH ? FL_RELC : 0; }

static const char *const carrier_ask[NCARRIER] = {"socket", "ring"};

typedef struct bctx {
  gpuipc_conn *c[NCONS]; /* consumers for the sizes, fan-out, batch and
                            flatness rows (the environment's carrier) */
  pid_t pid[NCONS];
  int ncons; /* consumers started: NCONS, 16 with --quick */
  gpuipc_conn *pair[NCARRIER]; /* the one-pair rows, one per carrier asked */
  pid_t pair_pid[NCARRIER];
  CUstream s;
  int iters;
  bool quick;
  int emu;
  int cpus; /* CPUs this process may run on */
  /* The gate that keeps the producer's stream busy on the ordered path: a
   * word in pinned host memory that the stream waits for. */
  uint32_t *gate_h;
  CUdeviceptr gate_d;
  uint32_t gate_seq;
  const char *only; /* --only: the tables to run (comma list); NULL: all */
} bctx;

static const char *const TABLES[] = {"raw", "pair", "sizes", "fanout",
                                     "batches", "flatness"};

/* Whether the comma list names `name` (len bytes). */
static bool listed(const char *list, const char *name, size_t n) {
  for (const char *p = list; *p;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == n && strncmp(p, name, n) == 0)
      return true;
    p += len + (e != NULL);
  }
  return false;
}

/* Whether table `name` runs (--only). */
static bool table_on(const bctx *b, const char *name) {
  return b->only == NULL || listed(b->only, name, strlen(name));
}

/* What the summary lines and the record's info report. */
typedef struct summary {
  /* one pair, per carrier asked (carrier_ask) and path: 0 = not measured */
  double med[NCARRIER][P_N], tput[NCARRIER][P_N];
  const char *carrier[NCARRIER]; /* what carried each pair's frames */
  double spin8_med, spin8_p90;   /* broadcast to 8 polling consumers */
  double sleep_med[3];           /* broadcast to 8, 16, 64 sleeping ones */
  double b16;
  double flat_min, flat_max; /* per buffer us over the flatness rows */
  double msg, write_enq, wait_enq; /* the raw parts, same run */
  double shm;                      /* shared-memory record one way, spinning */
} summary;

static void gate_make(bctx *b) {
  void *h = NULL;
  CU(gpuipc__cu.cuMemHostAlloc(&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP |
                                              CU_MEMHOSTALLOC_PORTABLE));
  memset(h, 0, 4096);
  b->gate_h = h;
  CU(gpuipc__cu.cuMemHostGetDevicePointer(&b->gate_d, h, 0));
}

/* Before the send of the ordered path: the stream waits for the gate, so
 * the send finds it busy (outside the timed window). */
static void gate_close(bctx *b, path_id p) {
  if (p != P_ORDERED)
    return;
  b->gate_seq++;
  CU(gpuipc__cu.cuStreamWaitValue32(b->s, b->gate_d, b->gate_seq,
                                    CU_STREAM_WAIT_VALUE_GEQ));
}
/* Right after the send returns: the host lets the stream run on. */
static void gate_open(bctx *b, path_id p) {
  if (p == P_ORDERED)
    __atomic_store_n(b->gate_h, b->gate_seq, __ATOMIC_RELEASE);
}

static void send_path(bctx *b, gpuipc_conn *c, gpuipc_block *blk, path_id p,
                      const double *t) {
  OK(gpuipc_conn_send_ex(c, blk, (struct CUstream_st *)b->s, t, sizeof *t,
                         p == P_COMPLETE || p == P_BOTH ? GPUIPC_SEND_COMPLETE
                                                        : 0));
}

/* One send stamped with its start; returns the time inside the call. */
static double send_t(bctx *b, gpuipc_conn *c, gpuipc_block *blk, path_id p) {
  double t = now_us();
  send_path(b, c, blk, p, &t);
  return now_us() - t;
}

/* Waits for blk's leases to come back, polling the connections. */
static void wait_free(gpuipc_conn *const *cs, int nc, gpuipc_block *blk) {
  watch_step = "waiting for the releases (polling)";
  while (gpuipc_block_get_holders(blk) > 0)
    for (int k = 0; k < nc; k++) {
      watch_k = k;
      OK(gpuipc_conn_progress(cs[k], 0));
    }
}

/* The same, sleeping in poll() on the connections' fds in between. */
static void wait_free_sleep(gpuipc_conn *const *cs, int nc,
                            gpuipc_block *blk) {
  struct pollfd p[NCONS];
  watch_step = "waiting for the releases (sleeping)";
  while (gpuipc_block_get_holders(blk) > 0) {
    for (int k = 0; k < nc; k++)
      p[k] = (struct pollfd){gpuipc_conn_get_fd(cs[k]), POLLIN, 0};
    int r = poll(p, (nfds_t)nc, 1000);
    if (r < 0)
      DIE("poll: %s", strerror(errno));
    for (int k = 0; k < nc; k++)
      if (r == 0 || p[k].revents)
        OK(gpuipc_conn_progress(cs[k], 0));
  }
}

/* ---- producer: the measurements ----------------------------------------------- */

typedef struct lat_fig {
  double med, p90, send, recv;
} lat_fig;

/* Latency: one buffer in flight, to each of nc consumers in turn. */
static void run_lat(bctx *b, gpuipc_conn *const *cs, int nc, gpuipc_arena *a,
                    size_t size, path_id p, lat_fig *f) {
  gpuipc_block *blk;
  OK(gpuipc_arena_alloc(a, size, (struct CUstream_st *)b->s, &blk));
  int n = b->iters;
  double *sc = xcalloc((size_t)n * (size_t)nc, sizeof *sc);
  for (int k = 0; k < nc; k++)
    send_cmd_fl(cs[k], OP_LAT, (uint32_t)n, path_flags(p));
  for (int i = 0; i < n; i++) {
    gate_close(b, p);
    for (int k = 0; k < nc; k++)
      sc[i * nc + k] = send_t(b, cs[k], blk, p);
    gate_open(b, p);
    wait_free(cs, nc, blk);
  }
  f->send = bench_pct(sc, n * nc, 0.5);
  free(sc);
  f->med = f->p90 = f->recv = 0;
  for (int k = 0; k < nc; k++) {
    reply r = get_reply(cs[k]);
    f->med += r.a / nc;
    f->recv += r.d / nc;
    if (r.b > f->p90)
      f->p90 = r.b;
  }
  OK(gpuipc_block_free(blk, (struct CUstream_st *)b->s));
}

/* Throughput: a ring of blocks in flight, round-robin over nc consumers. */
static double run_tput(bctx *b, gpuipc_conn *const *cs, int nc,
                       gpuipc_arena *a, size_t size, int ring, path_id p) {
  gpuipc_block *blk[64];
  for (int j = 0; j < ring; j++)
    OK(gpuipc_arena_alloc(a, size, (struct CUstream_st *)b->s, &blk[j]));
  int n = b->iters * 4;
  n -= n % nc;
  for (int k = 0; k < nc; k++)
    send_cmd_fl(cs[k], OP_TPUT, (uint32_t)(n / nc), path_flags(p));
  double t0 = now_us();
  for (int i = 0; i < n; i++) {
    gpuipc_block *x = blk[i % ring];
    /* x went last to the consumer of send i - ring. */
    gpuipc_conn *prev = cs[i >= ring ? (i - ring) % nc : 0];
    while (gpuipc_block_get_holders(x) > 0)
      OK(gpuipc_conn_progress(prev, 0));
    gate_close(b, p);
    send_t(b, cs[i % nc], x, p);
    gate_open(b, p);
  }
  for (int j = 0; j < ring; j++)
    wait_free(cs, nc, blk[j]);
  double dt = now_us() - t0;
  for (int k = 0; k < nc; k++)
    (void)get_reply(cs[k]);
  for (int j = 0; j < ring; j++)
    OK(gpuipc_block_free(blk[j], (struct CUstream_st *)b->s));
  return n / (dt / 1e6);
}

/* Which path a send on c took, seen from the consumer: one buffer, the
 * gate (on the ordered path) held until the consumer has answered. 1: the
 * consumer's stream waited for ours after its recv; 0: it had nothing
 * pending. */
static int probe(bctx *b, gpuipc_conn *c, gpuipc_arena *a, path_id p) {
  gpuipc_block *blk;
  OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)b->s, &blk));
  CU(gpuipc__cu.cuStreamSynchronize(b->s));
  send_cmd(c, OP_PROBE, 1);
  gate_close(b, p);
  double t = now_us();
  send_path(b, c, blk, p, &t);
  reply r = get_reply(c);
  gate_open(b, p);
  wait_free(&c, 1, blk);
  OK(gpuipc_block_free(blk, (struct CUstream_st *)b->s));
  return r.a != 0;
}

typedef struct fan_fig {
  double med_last, p90_last, med_each, call;
} fan_fig;

/* Fan-out: one buffer in flight to consumers 0..nc-1 (ordered path), by one
 * gpuipc_conn_broadcast or by gpuipc_conn_send to each in turn, every
 * consumer stamped with the same start time. Sleeping: the consumers wait
 * in poll() between receives and the producer in poll() for the releases;
 * else both poll the library. med_last / p90_last: over the buffers, the
 * latency of the consumer that got it last; med_each: the consumers'
 * medians, averaged; call: median time of the send call(s) of one
 * buffer. */
static void run_fan(bctx *b, gpuipc_arena *a, int nc, bool bcast, bool sleep,
                    fan_fig *f) {
  gpuipc_block *blk;
  OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)b->s, &blk));
  int n = b->iters;
  double *sc = xcalloc((size_t)n, sizeof *sc);
  double *last = xcalloc((size_t)n, sizeof *last);
  double *lat = xcalloc((size_t)n, sizeof *lat);
  for (int k = 0; k < nc; k++) {
    send_cmd_fl(b->c[k], OP_LAT, (uint32_t)n,
                FL_SENDBACK | (sleep ? FL_SLEEP : 0));
    /* The producer polls the library, or sleeps in poll() on the fds. */
    OK(gpuipc_conn_set_polling(b->c[k], !sleep));
  }
  watch_figure("fan-out to %d consumers (%s, %s)", nc,
               bcast ? "broadcast" : "each", sleep ? "sleeping" : "spinning");
  for (int i = 0; i < n; i++) {
    watch_buffer(i);
    gate_close(b, P_ORDERED);
    double t = now_us();
    watch_step = bcast ? "gpuipc_conn_broadcast" : "gpuipc_conn_send";
    if (bcast)
      OK(gpuipc_conn_broadcast(b->c, (size_t)nc, blk, (struct CUstream_st *)b->s,
                               &t, sizeof t, NULL));
    else
      for (int k = 0; k < nc; k++)
        send_path(b, b->c[k], blk, P_ORDERED, &t);
    sc[i] = now_us() - t;
    gate_open(b, P_ORDERED);
    if (sleep)
      wait_free_sleep(b->c, nc, blk);
    else
      wait_free(b->c, nc, blk);
  }
  f->call = bench_pct(sc, n, 0.5);
  f->med_each = 0;
  watch_step = "the consumers' latencies";
  for (int k = 0; k < nc; k++) {
    watch_k = k;
    for (int i = 0; i < n; i += VEC_CHUNK) {
      size_t len = 0;
      int want = n - i < VEC_CHUNK ? n - i : VEC_CHUNK;
      OK(gpuipc_conn_recv_msg(b->c[k], lat + i, (size_t)want * sizeof *lat,
                              &len, NULL, NULL));
      if (len != (size_t)want * sizeof *lat)
        DIE("consumer %d sent %zu bytes of latencies", k, len);
    }
    for (int i = 0; i < n; i++)
      if (k == 0 || lat[i] > last[i])
        last[i] = lat[i];
    f->med_each += get_reply(b->c[k]).a / nc;
  }
  for (int k = 0; k < nc; k++)
    OK(gpuipc_conn_set_polling(b->c[k], 1));
  f->med_last = bench_pct(last, n, 0.5);
  f->p90_last = bench_pct(last, n, 0.9);
  free(sc);
  free(last);
  free(lat);
  OK(gpuipc_block_free(blk, (struct CUstream_st *)b->s));
}

/* Batches of nb blocks to consumer 0 (ordered, two batches in flight),
 * received and released in batches: buffers per second over the whole
 * cycle; *call: median time inside gpuipc_conn_send_batch. */
static double run_batch(bctx *b, gpuipc_arena *a, int nb, double *call) {
  gpuipc_block *blk[2 * BATCH_MAX];
  const void *metas[BATCH_MAX];
  size_t lens[BATCH_MAX];
  double stamp = 0;
  for (int j = 0; j < 2 * nb; j++)
    OK(gpuipc_arena_alloc(a, 4096, (struct CUstream_st *)b->s, &blk[j]));
  for (int j = 0; j < nb; j++) {
    metas[j] = &stamp;
    lens[j] = sizeof stamp;
  }
  int batches = (b->iters * 4 + nb - 1) / nb;
  if (batches < 4)
    batches = 4;
  double *sc = xcalloc((size_t)batches, sizeof *sc);
  gpuipc_conn *c = b->c[0];
  send_cmd(c, OP_TPUTB, (uint32_t)(batches * nb));
  double t0 = now_us();
  watch_figure("batches of %d", nb);
  for (int i = 0; i < batches; i++) {
    watch_buffer(i);
    watch_step = "waiting for the releases (polling)";
    gpuipc_block **g = blk + (i % 2) * nb;
    for (int j = 0; j < nb; j++)
      wait_free(&c, 1, g[j]);
    gate_close(b, P_ORDERED);
    double t = now_us();
    stamp = t;
    watch_step = "gpuipc_conn_send_batch";
    OK(gpuipc_conn_send_batch(c, g, (size_t)nb, (struct CUstream_st *)b->s,
                              metas, lens));
    sc[i] = now_us() - t;
    gate_open(b, P_ORDERED);
  }
  for (int j = 0; j < 2 * nb; j++)
    wait_free(&c, 1, blk[j]);
  double dt = now_us() - t0;
  (void)get_reply(c);
  alarm(0);
  *call = bench_pct(sc, batches, 0.5);
  free(sc);
  for (int j = 0; j < 2 * nb; j++)
    OK(gpuipc_block_free(blk[j], (struct CUstream_st *)b->s));
  return (double)batches * nb / (dt / 1e6);
}

/* Flatness: `live` buffers stay leased, half held by each of the last two
 * consumers (a connection allows at most 65536 outstanding), sent in
 * batches, while single handoffs (ordered) cycle to the last one: its
 * buffers per second. */
static double run_flat(bctx *b, gpuipc_arena *a, long live) {
  gpuipc_conn *x = b->c[b->ncons - 2], *y = b->c[b->ncons - 1];
  long h1 = live / 2;
  gpuipc_block **blk = xcalloc((size_t)live, sizeof *blk);
  for (long j = 0; j < live; j++)
    OK(gpuipc_arena_alloc(a, 256, (struct CUstream_st *)b->s, &blk[j]));
  send_cmd(x, OP_HOLD, (uint32_t)h1);
  send_cmd(y, OP_HOLD, (uint32_t)(live - h1));
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
    wait_free(&y, 1, ring[i % 32]);
    gate_close(b, P_ORDERED);
    send_t(b, y, ring[i % 32], P_ORDERED);
    gate_open(b, P_ORDERED);
  }
  for (int j = 0; j < 32; j++)
    wait_free(&y, 1, ring[j]);
  double dt = now_us() - t0;
  (void)get_reply(y);
  send_cmd(x, OP_UNHOLD, 0);
  send_cmd(y, OP_UNHOLD, 0);
  (void)get_reply(x);
  (void)get_reply(y);
  for (long j = 0; j < live; j++) {
    gpuipc_conn *c = j < h1 ? x : y;
    wait_free(&c, 1, blk[j]);
    OK(gpuipc_block_free(blk[j], (struct CUstream_st *)b->s));
  }
  for (int j = 0; j < 32; j++)
    OK(gpuipc_block_free(ring[j], (struct CUstream_st *)b->s));
  free(blk);
  return n / (dt / 1e6);
}

/* ---- the raw parts ------------------------------------------------------------ */

static void raw_legacy(bctx *b, double out[3]) {
  gpuipc_conn *c = b->c[0];
  int n = b->iters < 200 ? b->iters : 200;
  CUdeviceptr p;
  CU(gpuipc__cu.cuMemAlloc(&p, (size_t)1 << 20));
  double *v = xcalloc((size_t)n, sizeof *v);
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
  out[0] = bench_pct(v, n, 0.5);
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
  double *v = xcalloc((size_t)n, sizeof *v);
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
  out[0] = bench_pct(v, n, 0.5);
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
static void raw_floor(bctx *b, gpuipc_conn *c, double out[3]) {
  int n = b->iters;
  double *v = xcalloc((size_t)n, sizeof *v);
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
  out[0] = bench_pct(v, n, 0.5);
  CUdeviceptr w;
  CU(gpuipc__cu.cuMemAlloc(&w, 4096));
  CU(gpuipc__cu.cuMemsetD8(w, 0, 4096));
  for (int i = 0; i < n; i++) {
    double t0 = now_us();
    CU(gpuipc__cu.cuStreamWriteValue64(b->s, w, (cuuint64_t)i + 1, 0));
    v[i] = now_us() - t0;
  }
  out[1] = bench_pct(v, n, 0.5);
  for (int i = 0; i < n; i++) {
    double t0 = now_us();
    CU(gpuipc__cu.cuStreamWaitValue64(b->s, w, 1, CU_STREAM_WAIT_VALUE_GEQ));
    v[i] = now_us() - t0;
  }
  out[2] = bench_pct(v, n, 0.5);
  CU(gpuipc__cu.cuStreamSynchronize(b->s));
  CU(gpuipc__cu.cuMemFree(w));
  free(v);
}

/* The floor of a ring record: one 64-bit word written by one process and
 * seen by another spinning on it, half the median of a ping-pong over
 * two words of a shared mapping (no library, no driver). A child of its
 * own (fork: it touches no CUDA and only spins), pinned nowhere. */
static double raw_shm(bctx *b) {
  int n = b->iters;
  _Atomic uint64_t *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                             MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (w == MAP_FAILED)
    DIE("mmap: %s", strerror(errno));
  _Atomic uint64_t *ping = &w[0], *pong = &w[16]; /* 128 bytes apart */
  atomic_store(ping, 0);
  atomic_store(pong, 0);
  pid_t pid = fork();
  if (pid < 0)
    DIE("fork: %s", strerror(errno));
  if (pid == 0) {
    /* the parent's last ping is n + 64 (the warm-up's included) */
    for (uint64_t i = 1; i <= (uint64_t)n + 64; i++) {
      while (atomic_load_explicit(ping, memory_order_acquire) != i)
        ;
      atomic_store_explicit(pong, i, memory_order_release);
    }
    _exit(0);
  }
  double *v = xcalloc((size_t)n, sizeof *v);
  for (uint64_t i = 1; i <= (uint64_t)n + 64; i++) {
    double t0 = now_us();
    atomic_store_explicit(ping, i, memory_order_release);
    while (atomic_load_explicit(pong, memory_order_acquire) != i)
      ;
    if (i > 64)
      v[i - 65] = (now_us() - t0) / 2;
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
    ;
  double med = bench_pct(v, n, 0.5);
  free(v);
  munmap((void *)w, 4096);
  return med;
}

/* ---- the rows, as printed and recorded ---------------------------------------- */

static const char *size_name(size_t s, char *buf) {
  if (s >= ((size_t)1 << 20))
    sprintf(buf, "%zu MiB", s >> 20);
  else
    sprintf(buf, "%zu KiB", s >> 10);
  return buf;
}

/* The carrier c's frames go by, as this end and the consumer's end name it:
 * "socket", or "socket here, ring at the consumer" when they differ. */
static void carrier_of(gpuipc_conn *c, char *out, size_t cap) {
  char peer[64] = "";
  size_t len = 0;
  send_cmd(c, OP_CARRIER, 0);
  OK(gpuipc_conn_recv_msg(c, peer, sizeof peer - 1, &len, NULL, NULL));
  peer[sizeof peer - 1] = '\0';
  const char *here = gpuipc__conn_carrier_name(c);
  if (strcmp(here, peer) == 0)
    snprintf(out, cap, "%s", here);
  else
    snprintf(out, cap, "%s here, %s at the consumer", here, peer);
}

static void raw_rows(bctx *b, summary *sum) {
  /* The raw driver paths first: short, and the comparison the handoff
   * numbers are read against (a long run cut off still shows them). */
  double leg[3], pool[4], fl[3];
  raw_legacy(b, leg);
  raw_pool(b, pool);
  double rt = raw_memop(b);
  /* The message one way goes over the pair whose socket was asked for. */
  char carrier[160];
  carrier_of(b->pair[0], carrier, sizeof carrier);
  raw_floor(b, b->pair[0], fl);
  sum->msg = fl[0];
  sum->write_enq = fl[1];
  sum->wait_enq = fl[2];
  sum->shm = raw_shm(b);
  printf("\nraw parts, same run (medians, us; 1 MiB allocations):\n");
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
  printf("  parts    one small message one way (carrier: %s) %.2f | "
         "cuStreamWriteValue64 enqueue %.2f | cuStreamWaitValue64 enqueue "
         "%.2f\n           (the ordered path is a message, then the "
         "consumer's wait enqueue, with the producer's write after the "
         "message;\n           a full cycle also costs each side a write "
         "enqueue and a message back)\n"
         "  ring     one 64-bit word one way between two processes spinning "
         "on a shared mapping (a ring record's floor): %.2f\n",
         carrier, fl[0], fl[1], fl[2], sum->shm);
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
  gpuipc_bench_json_str("carrier", carrier);
  gpuipc_bench_json_row_end();
  gpuipc_bench_json_row_begin("raw");
  gpuipc_bench_json_str("path", "shared_word_one_way");
  gpuipc_bench_json_num("per_buffer_us", sum->shm);
  gpuipc_bench_json_row_end();
}

/* One row of the one-pair table: probe the path, then its latency and
 * throughput on the pair of carrier ci. */
static void pair_row(bctx *b, gpuipc_arena *a, int ci, const char *carrier,
                     path_id p, summary *sum) {
  gpuipc_conn *c = b->pair[ci];
  int waited = probe(b, c, a, p);
  bool confirmed = waited == (p == P_ORDERED);
  lat_fig f;
  run_lat(b, &c, 1, a, 4096, p, &f);
  double tput = run_tput(b, &c, 1, a, 4096, 32, p);
  bool asked = strcmp(carrier, carrier_ask[ci]) == 0;
  printf("%-9s %-7s %-8s %10.2f %9.2f %12.0f %10.2f %10.2f  %s%s\n",
         PATHS[p].key, carrier_ask[ci], carrier, f.med, f.p90, tput, f.send,
         f.recv, waited ? "waited" : "idle",
         confirmed ? "" : " (NOT the path named: read this row as the other)");
  if (!asked)
    printf("%-17s ^ %s was asked for and %s carried it: a %s figure, not a "
           "%s one\n",
           "", carrier_ask[ci], carrier, carrier, carrier_ask[ci]);
  fflush(stdout);
  gpuipc_bench_json_row_begin("pair");
  gpuipc_bench_json_str("path", PATHS[p].key);
  gpuipc_bench_json_str("carrier_asked", carrier_ask[ci]);
  gpuipc_bench_json_str("carrier", carrier);
  gpuipc_bench_json_num("size_bytes", 4096);
  gpuipc_bench_json_num("median_us", f.med);
  gpuipc_bench_json_num("p90_us", f.p90);
  gpuipc_bench_json_num("buffers_per_s", tput);
  gpuipc_bench_json_num("send_us", f.send);
  gpuipc_bench_json_num("recv_us", f.recv);
  gpuipc_bench_json_num("probe_consumer_waited", waited);
  gpuipc_bench_json_num("path_confirmed", confirmed);
  gpuipc_bench_json_row_end();
  sum->med[ci][p] = f.med;
  sum->tput[ci][p] = tput;
}

static void pair_rows(bctx *b, gpuipc_arena *a, summary *sum) {
  printf("\none pair, 4 KiB, consumer polls (gpuipc_conn_set_polling): send -> the consumer holds a "
         "usable buffer (its recv returned, its stream wait enqueued);\n"
         "buffers/s: full cycle (send, recv, release, the release back), 32 "
         "blocks in flight; send()/recv(): median time inside\n"
         "gpuipc_conn_send / the gpuipc_conn_recv call that returned the "
         "buffer. Paths:\n");
  for (int p = 0; p < P_N; p++)
    printf("  %-9s %s\n", PATHS[p].key, PATHS[p].text);
  printf("asked: GPUIPC_CARRIER in both processes; carrier: what carried the "
         "frames (gpuipc__conn_carrier_name); probe: before the row, one\n"
         "buffer with the producer's stream held: the consumer's stream "
         "waited (the ordered path) or was idle (the others)\n");
  printf("%-9s %-7s %-8s %10s %9s %12s %10s %10s  %s\n", "path", "asked",
         "carrier", "median us", "p90 us", "buffers/s", "send() us",
         "recv() us", "probe");
  static const path_id order[] = {P_IDLE, P_COMPLETE, P_BOTH, P_ORDERED};
  for (int ci = 0; ci < NCARRIER; ci++) {
    char carrier[160];
    carrier_of(b->pair[ci], carrier, sizeof carrier);
    sum->carrier[ci] = strdup(carrier);
    /* Warm-up: the consumer imports the arena and the flag words. */
    int keep = b->iters;
    b->iters = 70;
    lat_fig w;
    run_lat(b, &b->pair[ci], 1, a, 4096, P_IDLE, &w);
    b->iters = keep;
    for (int i = 0; i < P_N; i++)
      pair_row(b, a, ci, carrier, order[i], sum);
  }
  printf("raw parts beside them (same run): one small message one way %.2f "
         "| consumer's cuStreamWaitValue64 enqueue %.2f | producer's "
         "cuStreamWriteValue64 enqueue %.2f\n(ordered: about message + wait "
         "enqueue = %.2f, the write after the message; idle and complete: "
         "about the message)\n",
         sum->msg, sum->wait_enq, sum->write_enq, sum->msg + sum->wait_enq);
}

static void size_rows(bctx *b, gpuipc_arena *a) {
  static const size_t sizes_full[] = {(size_t)4 << 10, (size_t)64 << 10,
                                      (size_t)1 << 20, (size_t)16 << 20,
                                      (size_t)256 << 20};
  /* --quick: a GPU run well under 30 s (the full run takes minutes). */
  static const size_t sizes_quick[] = {(size_t)4 << 10, (size_t)1 << 20};
  const size_t *sizes = b->quick ? sizes_quick : sizes_full;
  int nsizes = b->quick ? 2 : 5;
  char carrier[160];
  carrier_of(b->c[0], carrier, sizeof carrier);
  printf("\nsizes, path ordered (the producer's stream busy at each send), "
         "carrier %s, consumers poll; with %d consumers each buffer goes\n"
         "to every consumer in turn (latency: the consumers' medians "
         "averaged) or round-robin (throughput)\n",
         carrier, MAXC);
  printf("%-9s %9s %11s %10s %14s %10s %10s\n", "size", "consumers",
         "median us", "p90 us", "buffers/s", "send() us", "recv() us");
  {
    int keep = b->iters;
    b->iters = 20;
    lat_fig w;
    run_lat(b, b->c, MAXC, a, 4096, P_ORDERED, &w);
    b->iters = keep;
  }
  for (int si = 0; si < nsizes; si++) {
    size_t sz = sizes[si];
    int ring = sz >= ((size_t)64 << 20) ? 4 : 32;
    static const int ncs[2] = {1, MAXC};
    for (int ci = 0; ci < 2; ci++) {
      lat_fig f;
      run_lat(b, b->c, ncs[ci], a, sz, P_ORDERED, &f);
      double tput = run_tput(b, b->c, ncs[ci], a, sz, ring, P_ORDERED);
      char sn[32];
      printf("%-9s %9d %11.2f %10.2f %14.0f %10.2f %10.2f\n", size_name(sz, sn),
             ncs[ci], f.med, f.p90, tput, f.send, f.recv);
      fflush(stdout);
      gpuipc_bench_json_row_begin("handoff");
      gpuipc_bench_json_num("size_bytes", (double)sz);
      gpuipc_bench_json_num("consumers", ncs[ci]);
      gpuipc_bench_json_num("median_us", f.med);
      gpuipc_bench_json_num("p90_us", f.p90);
      gpuipc_bench_json_num("buffers_per_s", tput);
      gpuipc_bench_json_num("send_us", f.send);
      gpuipc_bench_json_num("recv_us", f.recv);
      gpuipc_bench_json_str("path", PATHS[P_ORDERED].key);
      gpuipc_bench_json_str("carrier", carrier);
      gpuipc_bench_json_row_end();
    }
  }
}

static void fan_rows(bctx *b, gpuipc_arena *a, summary *sum) {
  static const int fan_n[3] = {8, 16, NCONS};
  int nfan = b->ncons == NCONS ? 3 : 2;
  printf("\nfan-out, 4 KiB, path ordered: send -> the LAST consumer holds the "
         "buffer (per buffer, the latest of the consumers); each: the\n"
         "consumers' medians, averaged; call: median time inside the send "
         "call(s) of one buffer. sleeping: consumers wait in poll() on\n"
         "gpuipc_conn_get_fd between receives, the producer in poll() for "
         "the releases; spinning: both poll the library%s\n",
         nfan < 3 ? "\n(--quick: fan-out to 8 and 16 consumers only)" : "");
  printf("%-10s %9s %16s %13s %10s %10s  %s\n", "mode", "consumers",
         "median last us", "p90 last us", "each us", "call us", "wait");
  {
    int keep = b->iters;
    b->iters = 20;
    fan_fig w;
    run_fan(b, a, b->ncons, true, false, &w);
    b->iters = keep;
  }
  for (int sleep = 1; sleep >= 0; sleep--)
    for (int fi = 0; fi < nfan; fi++)
      for (int mode = 0; mode < 2; mode++) {
        int nc = fan_n[fi];
        fan_fig f;
        run_fan(b, a, nc, mode == 1, sleep, &f);
        const char *mn = mode ? "broadcast" : "each";
        char how[128];
        snprintf(how, sizeof how, "%s (%d processes on %d CPUs%s)",
                 sleep ? "sleeping" : "spinning", nc + 1, b->cpus,
                 !sleep && nc + 1 > b->cpus ? ": oversubscribed" : "");
        printf("%-10s %9d %16.2f %13.2f %10.2f %10.2f  %s\n", mn, nc,
               f.med_last, f.p90_last, f.med_each, f.call, how);
        fflush(stdout);
        gpuipc_bench_json_row_begin("fanout");
        gpuipc_bench_json_str("mode", mn);
        gpuipc_bench_json_num("size_bytes", 4096);
        gpuipc_bench_json_num("consumers", nc);
        gpuipc_bench_json_num("median_last_us", f.med_last);
        gpuipc_bench_json_num("p90_last_us", f.p90_last);
        gpuipc_bench_json_num("median_each_us", f.med_each);
        gpuipc_bench_json_num("call_us", f.call);
        gpuipc_bench_json_str("wait", sleep ? "sleep" : "spin");
        gpuipc_bench_json_num("processes", nc + 1);
        gpuipc_bench_json_num("cpus", b->cpus);
        gpuipc_bench_json_num("oversubscribed", !sleep && nc + 1 > b->cpus);
        gpuipc_bench_json_str("path", PATHS[P_ORDERED].key);
        gpuipc_bench_json_row_end();
        if (sleep && mode == 1)
          sum->sleep_med[fi] = f.med_last;
        if (!sleep && mode == 1 && nc == 8) {
          sum->spin8_med = f.med_last;
          sum->spin8_p90 = f.p90_last;
        }
      }
  alarm(0);
}

static void batch_rows(bctx *b, gpuipc_arena *a, summary *sum) {
  printf("\nbatches, 4 KiB blocks, path ordered (one busy-stream gate per "
         "batch), one consumer, two batches in flight: full cycle\n"
         "(send_batch, recv_batch, release_batch, the releases back); call: "
         "median time inside gpuipc_conn_send_batch\n");
  printf("%-6s %14s %16s %10s\n", "batch", "buffers/s", "per buffer us",
         "call us");
  static const int batch_n[3] = {1, 16, BATCH_MAX};
  for (int bi = 0; bi < 3; bi++) {
    double cl = 0;
    double rate = run_batch(b, a, batch_n[bi], &cl);
    printf("%-6d %14.0f %16.3f %10.2f\n", batch_n[bi], rate, 1e6 / rate, cl);
    fflush(stdout);
    gpuipc_bench_json_row_begin("batch");
    gpuipc_bench_json_num("batch", batch_n[bi]);
    gpuipc_bench_json_num("size_bytes", 4096);
    gpuipc_bench_json_num("buffers_per_s", rate);
    gpuipc_bench_json_num("per_buffer_us", 1e6 / rate);
    gpuipc_bench_json_num("call_us", cl);
    gpuipc_bench_json_str("path", PATHS[P_ORDERED].key);
    gpuipc_bench_json_row_end();
    if (batch_n[bi] == 16)
      sum->b16 = rate;
  }
}

static void flat_rows(bctx *b, summary *sum) {
  printf("\nflatness: single 4 KiB handoffs (full cycle, path ordered) while "
         "other buffers stay leased: half held by each of two consumers,\n"
         "one connection each (a connection allows at most 65536 "
         "outstanding); the handoffs go to the second, which holds the "
         "other half%s\n",
         b->quick ? "\n(--quick: up to 10000 leases)" : "");
  printf("%12s %14s %16s %14s\n", "live leases", "buffers/s", "per buffer us",
         "on that conn");
  gpuipc_arena_options fo = GPUIPC_ARENA_OPTIONS_INIT;
  fo.chunk_bytes = (size_t)32 << 20;
  gpuipc_arena *fa = NULL;
  OK(gpuipc_arena_create(&fo, &fa));
  static const long live_n[4] = {10, 1000, 10000, 100000};
  for (int li = 0; li < (b->quick ? 3 : 4); li++) {
    long live = live_n[li];
    double rate = run_flat(b, fa, live);
    double per = 1e6 / rate;
    if (li == 0 || per < sum->flat_min)
      sum->flat_min = per;
    if (li == 0 || per > sum->flat_max)
      sum->flat_max = per;
    printf("%12ld %14.0f %16.3f %14ld\n", live, rate, 1e6 / rate,
           live - live / 2);
    fflush(stdout);
    gpuipc_bench_json_row_begin("flatness");
    gpuipc_bench_json_num("live_leases", (double)live);
    gpuipc_bench_json_num("size_bytes", 4096);
    gpuipc_bench_json_num("buffers_per_s", rate);
    gpuipc_bench_json_num("per_buffer_us", 1e6 / rate);
    gpuipc_bench_json_num("connections", 2);
    gpuipc_bench_json_num("leases_on_measured_conn", (double)(live - live / 2));
    gpuipc_bench_json_str("path", PATHS[P_ORDERED].key);
    gpuipc_bench_json_row_end();
  }
  CU(gpuipc__cu.cuStreamSynchronize(b->s));
  OK(gpuipc_arena_destroy(fa));
}

/* One line of the summary: the figure, the target, met or missed. */
static int target_line(const char *what, double v, const char *unit,
                       bool higher, double target, const char *target_text) {
  if (!(v > 0) || !(target > 0)) /* its table did not run (--only) */
    return 0;
  bool ok = higher ? v >= target : v <= target;
  printf("  %-58s %12.*f %-10s %s %-30s %s\n", what,
         strcmp(unit, "us") == 0 ? 2 : 0, v, unit, higher ? ">=" : "<=",
         target_text, ok ? "met" : "MISSED");
  gpuipc_bench_json_row_begin("target");
  gpuipc_bench_json_str("what", what);
  gpuipc_bench_json_num("value", v);
  gpuipc_bench_json_str("unit", unit);
  gpuipc_bench_json_num("target", target);
  gpuipc_bench_json_str("target_text", target_text);
  gpuipc_bench_json_num("met", ok);
  gpuipc_bench_json_row_end();
  return !ok;
}

/* The targets, judged on the ring (the default carrier) against the raw
 * parts of this run. */
static void summary_rows(const bctx *b, const summary *s) {
  const int R = 1; /* carrier_ask[1]: the ring */
  printf("\nsummary (4 KiB; one pair over the %s carrier, the consumer "
         "polling; targets against the raw parts above%s):\n",
         s->carrier[R] ? s->carrier[R] : "ring",
         b->emu ? "; on the emulator these say little about a GPU" : "");
  char t[96];
  int miss = 0;
  double floor = s->wait_enq + s->shm;
  snprintf(t, sizeof t, "1.3 x (wait %.2f + word %.2f) = %.2f", s->wait_enq,
           s->shm, 1.3 * floor);
  miss += target_line("stream-ordered handoff, busy producer stream",
                      s->med[R][P_ORDERED], "us", false, 1.3 * floor, t);
  miss += target_line("asserted-complete handoff (GPUIPC_SEND_COMPLETE)",
                      s->med[R][P_COMPLETE], "us", false, 0.8, "0.8");
  snprintf(t, sizeof t, "the ordered one, %.2f", s->med[R][P_ORDERED]);
  miss += target_line("idle-stream handoff (the query path)", s->med[R][P_IDLE],
                      "us", false, s->med[R][P_ORDERED], t);
  miss += target_line("full cycle, single sends, ordered",
                      s->tput[R][P_ORDERED], "buffers/s", true, 400000,
                      "400000");
  miss += target_line("full cycle, single sends, both asserted complete",
                      s->tput[R][P_BOTH], "buffers/s", true, 400000, "400000");
  if (s->b16 > 0)
    miss += target_line("full cycle, batches of 16, ordered", s->b16,
                        "buffers/s", true, 2500000, "2500000");
  if (s->spin8_med > 0) {
    miss += target_line("broadcast to 8 polling consumers, last, median",
                        s->spin8_med, "us", false, 3, "3");
    miss += target_line("broadcast to 8 polling consumers, last, p90",
                        s->spin8_p90, "us", false, 6, "6");
  }
  if (s->sleep_med[2] > 0) {
    miss += target_line("broadcast to 64 sleeping consumers, last, median",
                        s->sleep_med[2], "us", false, 60, "60");
    /* linear from 8: 8 times the figure for 8 consumers */
    snprintf(t, sizeof t, "8 x the 8-consumer %.2f", s->sleep_med[0]);
    miss += target_line("  the same, no step beyond linear from 8",
                        s->sleep_med[2], "us", false, 8 * s->sleep_med[0], t);
  }
  if (s->flat_min > 0) {
    snprintf(t, sizeof t, "1.10 x the least, %.3f", s->flat_min);
    miss += target_line("per buffer, 10 to 100000 live leases, the most",
                        s->flat_max, "us", false, 1.10 * s->flat_min, t);
  }
  printf("%d target(s) missed%s\n", miss,
         b->only ? " (of those whose tables ran: --only)" : "");
  gpuipc_bench_json_num("targets_missed", miss);
  gpuipc_bench_json_num("pair_4k_ordered_median_us", s->med[R][P_ORDERED]);
  gpuipc_bench_json_num("pair_4k_idle_median_us", s->med[R][P_IDLE]);
  gpuipc_bench_json_num("pair_4k_complete_median_us", s->med[R][P_COMPLETE]);
  gpuipc_bench_json_num("pair_4k_complete2_buffers_per_s", s->tput[R][P_BOTH]);
  gpuipc_bench_json_str("pair_4k_carrier", s->carrier[R] ? s->carrier[R] : "");
  gpuipc_bench_json_num("broadcast_8_polling_median_last_us", s->spin8_med);
  gpuipc_bench_json_num("broadcast_64_sleeping_median_last_us", s->sleep_med[2]);
  gpuipc_bench_json_num("batch_16_buffers_per_s", s->b16);
}

/* ---- starting and stopping the consumers -------------------------------------- */

/* environ with GPUIPC_CARRIER set to carrier (environ itself for NULL). */
static char **env_with(const char *carrier, char *entry, size_t cap) {
  if (carrier == NULL)
    return environ;
  size_t n = 0;
  while (environ[n])
    n++;
  char **e = xcalloc(n + 2, sizeof *e);
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "GPUIPC_CARRIER=", 15) != 0)
      e[k++] = environ[i];
  snprintf(entry, cap, "GPUIPC_CARRIER=%s", carrier);
  e[k] = entry;
  return e;
}

/* Starts one consumer, with GPUIPC_CARRIER=carrier in both processes'
 * environments while they connect (carrier NULL: the environment as it
 * is). */
static void spawn_consumer(const char *carrier, uint32_t max_outstanding,
                           pid_t *pid, gpuipc_conn **out) {
  int fds[2];
  OK(gpuipc_conn_pair(fds));
  char entry[64];
  char **env = env_with(carrier, entry, sizeof entry);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 3);
  char *args[] = {"gpuipc", "bench", "handoff", "--child", "3", NULL};
  int err = posix_spawn(pid, "/proc/self/exe", &fa, NULL, args, env);
  posix_spawn_file_actions_destroy(&fa);
  if (env != environ)
    free(env);
  close(fds[1]);
  if (err != 0)
    DIE("spawn: %s", strerror(err));
  char *old = getenv("GPUIPC_CARRIER") ? strdup(getenv("GPUIPC_CARRIER")) : NULL;
  if (carrier)
    setenv("GPUIPC_CARRIER", carrier, 1);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  o.max_outstanding = max_outstanding;
  /* The producer polls the library on its connections (the sleeping fan-out
   * rows switch it off while they sleep in poll()). */
  o.polling = 1;
  OK(gpuipc_conn_from_fd(fds[0], &o, out));
  if (old)
    setenv("GPUIPC_CARRIER", old, 1);
  else
    unsetenv("GPUIPC_CARRIER");
  free(old);
}

/* The consumers start before this process touches CUDA. */
static void start_consumers(bctx *b) {
  for (int ci = 0; ci < NCARRIER; ci++)
    spawn_consumer(carrier_ask[ci], 1024, &b->pair_pid[ci], &b->pair[ci]);
  for (int k = 0; k < b->ncons; k++)
    /* Room for two batches of 256 in flight; the last two consumers hold
     * up to 50,000 buffers each in the flatness rows. */
    spawn_consumer(NULL, k >= b->ncons - 2 ? 65536 : 1024, &b->pid[k],
                   &b->c[k]);
}

static int stop_one(gpuipc_conn *c, pid_t pid) {
  send_cmd(c, OP_QUIT, 0);
  gpuipc_conn_close(c);
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}

static int stop_consumers(bctx *b) {
  int rc = 0;
  for (int ci = 0; ci < NCARRIER; ci++)
    rc |= stop_one(b->pair[ci], b->pair_pid[ci]);
  for (int k = 0; k < b->ncons; k++)
    rc |= stop_one(b->c[k], b->pid[k]);
  return rc;
}

static void usage(FILE *f) {
  fprintf(f, "usage: gpuipc bench handoff [--quick] [--iters N] [--only T,...] "
             "[--watch S] [--json FILE] [--emulator PATH]\n"
             "  one pair, 4 KiB: the stream-ordered path (a busy producer "
             "stream), the idle-stream path\n"
             "    and the asserted-complete send (GPUIPC_SEND_COMPLETE),\n"
             "    each with GPUIPC_CARRIER=socket and =ring, labelled with "
             "the carrier that carried it;\n"
             "  handoff latency and throughput for 4 KiB to 256 MiB, 1 and "
             "%d consumers;\n"
             "  fan-out to 8, 16 and %d consumers (each in turn and by "
             "broadcast), sleeping and spinning;\n"
             "  batches of 1, 16 and 256, and throughput with 10 to 100000 "
             "buffers leased,\n"
             "  next to the raw parts measured in the same run\n"
             "  --quick    %d iterations, 4 KiB and 1 MiB only, 16 consumers "
             "(fan-out to 8 and 16,\n"
             "             flatness to 10000 leases)\n"
             "  --iters N  iterations per figure (default 2000)\n"
             "  --only T,..  only these tables: raw, pair, sizes, fanout, "
             "batches, flatness\n"
             "             (the summary judges what ran)\n"
             "  --watch S  end the run, naming where, when one figure makes "
             "no progress for S s\n"
             "             (default %d)\n",
          MAXC, NCONS, 200, WATCH_S_DEFAULT);
}

/* -1: go on (the producer); else the exit status. */
static int parse_args(int argc, char **argv, bctx *b) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--child") == 0 && i + 1 < argc)
      return consumer(atoi(argv[i + 1]));
    else if (strcmp(argv[i], "--quick") == 0)
      b->quick = true;
    else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
      b->iters = atoi(argv[++i]);
    else if (strcmp(argv[i], "--watch") == 0 && i + 1 < argc)
      watch_s = atoi(argv[++i]) > 0 ? atoi(argv[i]) : WATCH_S_DEFAULT;
    else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      b->only = argv[++i];
      for (const char *p = b->only; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        bool known = false;
        for (size_t t = 0; t < sizeof TABLES / sizeof *TABLES; t++)
          known |= listed(TABLES[t], p, len);
        if (!known) {
          fprintf(stderr, "gpuipc bench handoff: --only: unknown table "
                          "'%.*s'\n", (int)len, p);
          usage(stderr);
          return 2;
        }
        p += len + (e != NULL);
      }
    }
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
  if (b->iters <= 0)
    b->iters = b->quick ? 200 : 2000;
  return -1;
}

static int cpus_here(void) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    return CPU_COUNT(&set);
  return (int)sysconf(_SC_NPROCESSORS_ONLN);
}

int gpuipc_bench_handoff(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    }
  /* The fan-out rows make 64 connections while the producer's stream is
   * held: without room made first, the driver's 34th stream would wait
   * for that stream (docs/driver-behaviour.md). The consumers inherit it. */
  setenv("GPUIPC_STREAM_ROOM", "128", 0);
  static bctx b;
  b.emu = gpuipc_bench_pick_driver(&argc, argv, "bench handoff");
  if (b.emu < 0)
    return 1;
  int rc = parse_args(argc, argv, &b);
  if (rc >= 0)
    return rc;
  /* --quick starts 16 consumers (fan-out rows to 8 and 16, flatness to
   * 10,000 leases): a smoke run that a slow build (sanitizers) finishes. */
  b.ncons = b.quick ? 16 : NCONS;
  b.cpus = cpus_here();
  start_consumers(&b);
  OK(gpuipc_init());
  current();
  CU(gpuipc__cu.cuStreamCreate(&b.s, CU_STREAM_NON_BLOCKING));
  gate_make(&b);
  char name[128] = "?";
  CUdevice dev;
  CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  CU(gpuipc__cu.cuDeviceGetName(name, (int)sizeof name, dev));
  printf("gpuipc bench handoff: %s%s, %d iterations, %d CPUs%s\n", name,
         b.emu ? " (emulated: times are the emulator's, not a GPU's)" : "",
         b.iters, b.cpus, b.quick ? " (--quick)" : "");
  gpuipc_bench_json_str("device", name);
  gpuipc_bench_json_num("iterations", b.iters);
  gpuipc_bench_json_num("quick", b.quick);
  gpuipc_bench_json_num("consumers_max", MAXC);
  gpuipc_bench_json_num("fanout_consumers_max", b.ncons);
  gpuipc_bench_json_num("cpus", b.cpus);

  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = b.quick ? (size_t)128 << 20 : (size_t)1100 << 20;
  gpuipc_arena *a = NULL;
  OK(gpuipc_arena_create(&ao, &a));
  summary sum = {0};
  if (table_on(&b, "raw"))
    raw_rows(&b, &sum);
  if (table_on(&b, "pair"))
    pair_rows(&b, a, &sum);
  if (table_on(&b, "sizes"))
    size_rows(&b, a);
  if (table_on(&b, "fanout"))
    fan_rows(&b, a, &sum);
  if (table_on(&b, "batches"))
    batch_rows(&b, a, &sum);
  if (table_on(&b, "flatness"))
    flat_rows(&b, &sum);
  summary_rows(&b, &sum);

  rc = stop_consumers(&b);
  CU(gpuipc__cu.cuStreamSynchronize(b.s));
  OK(gpuipc_arena_destroy(a));
  CU(gpuipc__cu.cuMemFreeHost(b.gate_h));
  for (int ci = 0; ci < NCARRIER; ci++)
    free((void *)sum.carrier[ci]);
  return rc;
}
