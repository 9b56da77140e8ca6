/*
 * sets.c: `gpuipc bench sets`: weight sync and KV-cache handoff with a
 * tensor set, from a producer process into a consumer process on the same
 * GPU, next to the in-process copy floor measured in the same run.
 *
 *   model   the Llama-2-7B shapes in bf16 (291 tensors, 13.48 GB: 32 layers
 *           of q, k, v, o 4096x4096, gate, up 11008x4096, down 4096x11008
 *           and two norms of 4096; the embedding and lm_head 32000x4096 and
 *           the final norm), an owned set in the producer;
 *   kv      KV-cache blocks as one set (1,000, 10,000 and 100,000 blocks of
 *           4 KiB; 1,000 and 10,000 of 256 KiB), copied into the consumer's
 *           paged cache: one allocation, each block at a shuffled slot (as
 *           a paged attention cache holds them), so that no two blocks are
 *           adjacent on both sides.
 *
 * For each: the one-time setup (subscribe: the table and the pieces go to
 * the consumer, which imports them); the zero-copy latency from the
 * producer's gpuipc_tset_publish to the consumer holding usable views (its
 * gpuipc_tset_recv returned and it has the first and last tensor's
 * address; the consumer polls in non-blocking mode); and copy_into: from
 * publish to the consumer's own tensors (one cuMemAlloc each, as a
 * framework allocates them) holding the new version (its stream
 * synchronized). The floors are the consumer copying the same bytes from a
 * local allocation into those same tensors in-process: tensor by tensor
 * (one cuMemcpyDtoDAsync each), and as one batched copy
 * (cuMemcpyBatchAsync, all ranges in one call where the driver takes them,
 * else in calls of 8,192; n/a on a driver without it); for the KV sets
 * also through the library's gather kernel alone (gpuipc__tset_gather: the
 * same ranges, unsorted, 1,360 per launch; n/a where the device cannot
 * load it) and the contiguous bound (one cuMemcpyDtoDAsync of all the
 * bytes into a second allocation). --quick uses a
 * small model (4 layers of width 512), 1,000 and 10,000 KV blocks of
 * 4 KiB, and fewer iterations.
 *
 * The consumer is this program re-executed (/proc/self/exe) with a hidden
 * argument and two connections: one the set is published on (it carries
 * nothing else), one for the benchmark's own commands and results. Times
 * are CLOCK_MONOTONIC, shared by the processes of the machine. The torch
 * peers (one reduce_tensor per tensor, 512 MiB flattened buckets) are
 * bench/torch_weight_sync.py, to run beside this on the same machine.
 */
/* Which process failed: "sets (producer)" or "sets (consumer)". */
#define BENCH_NAME who
/* In the producer, a failure says how the consumer process ended. */
#define BENCH_AT_DIE() child_status()
#include "bench.h"
#include "bench_int.h"
#include "tree.h"

#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static const char *who = "sets (producer)";
static pid_t child_pid;
static void child_status(void) {
  int st = 0;
  for (int i = 0; child_pid > 0 && i < 200; i++) {
    if (waitpid(child_pid, &st, WNOHANG) == child_pid) {
      if (WIFSIGNALED(st))
        fprintf(stderr, "gpuipc bench sets: the consumer process was killed "
                        "by signal %d\n", WTERMSIG(st));
      else
        fprintf(stderr, "gpuipc bench sets: the consumer process exited "
                        "with status %d\n", WEXITSTATUS(st));
      return;
    }
    usleep(10000);
  }
}
enum { OP_LAT = 1, OP_COPY, OP_FLOOR, OP_END, OP_QUIT, OP_PAGED };

typedef struct cmd {
  uint32_t op;
  uint32_t n;
} cmd;

static double now_us(void) { return (double)gpuipc__now_ns() / 1000.0; }


static void current(void) {
  CUcontext c;
  OK(gpuipc__primary_ctx(0, &c));
  CU(gpuipc__cu.cuCtxSetCurrent(c));
}

static void send_cmd(gpuipc_conn *c, uint32_t op, uint32_t n) {
  cmd m = {op, n};
  OK(gpuipc_conn_send_msg(c, &m, sizeof m, NULL, 0));
}
static void send_dbl(gpuipc_conn *c, double v) {
  OK(gpuipc_conn_send_msg(c, &v, sizeof v, NULL, 0));
}
static double get_dbl(gpuipc_conn *c) {
  double v = 0;
  size_t len = 0;
  OK(gpuipc_conn_recv_msg(c, &v, sizeof v, &len, NULL, NULL));
  return v;
}

/* ---- the tensor lists ---------------------------------------------------------- */

typedef struct model {
  size_t n;
  gpuipc_tensor *t;
  int64_t (*shape)[2];
  char (*name)[64];
  double bytes;
} model;

static void add(model *m, const char *name, int64_t a, int64_t b, int dtype) {
  size_t i = m->n++;
  snprintf(m->name[i], sizeof m->name[i], "%s", name);
  m->shape[i][0] = a;
  m->shape[i][1] = b;
  m->t[i] = (gpuipc_tensor){m->name[i], dtype, b ? 2 : 1, m->shape[i], NULL,
                            NULL, 0};
  m->bytes += (double)a * (double)(b ? b : 1) *
              (double)gpuipc_dtype_get_size(dtype);
}

static void alloc_model(model *m, size_t cap) {
  memset(m, 0, sizeof *m);
  m->t = calloc(cap, sizeof *m->t);
  m->shape = calloc(cap, sizeof *m->shape);
  m->name = calloc(cap, sizeof *m->name);
  if (!m->t || !m->shape || !m->name)
    DIE("out of memory");
}

/* A Llama-shaped model: hidden h, MLP width f, vocabulary v, L layers. */
static void llama(model *m, int L, int64_t h, int64_t f, int64_t v) {
  alloc_model(m, (size_t)L * 9 + 3);
  char nm[64];
  add(m, "model.embed_tokens.weight", v, h, GPUIPC_DTYPE_BF16);
  static const char *proj[] = {"self_attn.q_proj", "self_attn.k_proj",
                               "self_attn.v_proj", "self_attn.o_proj"};
  for (int l = 0; l < L; l++) {
    for (int k = 0; k < 4; k++) {
      snprintf(nm, sizeof nm, "model.layers.%d.%s.weight", l, proj[k]);
      add(m, nm, h, h, GPUIPC_DTYPE_BF16);
    }
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.gate_proj.weight", l);
    add(m, nm, f, h, GPUIPC_DTYPE_BF16);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.up_proj.weight", l);
    add(m, nm, f, h, GPUIPC_DTYPE_BF16);
    snprintf(nm, sizeof nm, "model.layers.%d.mlp.down_proj.weight", l);
    add(m, nm, h, f, GPUIPC_DTYPE_BF16);
    snprintf(nm, sizeof nm, "model.layers.%d.input_layernorm.weight", l);
    add(m, nm, h, 0, GPUIPC_DTYPE_BF16);
    snprintf(nm, sizeof nm, "model.layers.%d.post_attention_layernorm.weight", l);
    add(m, nm, h, 0, GPUIPC_DTYPE_BF16);
  }
  add(m, "model.norm.weight", h, 0, GPUIPC_DTYPE_BF16);
  add(m, "lm_head.weight", v, h, GPUIPC_DTYPE_BF16);
}

/* n KV blocks of `bytes` each (u8). */
static void kv(model *m, int n, int64_t bytes) {
  alloc_model(m, (size_t)n);
  char nm[64];
  for (int i = 0; i < n; i++) {
    snprintf(nm, sizeof nm, "kv.%d", i);
    add(m, nm, bytes, 0, GPUIPC_DTYPE_U8);
  }
}

/* ---- consumer --------------------------------------------------------------------- */

typedef struct own {
  size_t n;
  void **dst;
  size_t *len;
  uint64_t layout;
  bool paged;       /* what the next layout gets */
  CUdeviceptr pool; /* the paged cache (0: one allocation per tensor) */
} own;

static void own_free(own *o) {
  if (o->pool)
    CU(gpuipc__cu.cuMemFree(o->pool));
  else
    for (size_t i = 0; i < o->n; i++)
      CU(gpuipc__cu.cuMemFree((CUdeviceptr)(uintptr_t)o->dst[i]));
  free(o->dst);
  free(o->len);
  o->dst = NULL;
  o->len = NULL;
  o->n = 0;
  o->pool = 0;
  o->layout = 0;
}

/* The consumer's own tensors for a version's layout, allocated once per
 * layout: one allocation each, as a framework would; or, paged, one
 * allocation of n slots (the largest tensor, rounded up to 256 bytes)
 * with tensor i in slot perm(i), a fixed shuffle. */
static void own_for(own *o, gpuipc_tset_version *v) {
  if (o->layout == gpuipc_tset_version_get_layout(v))
    return;
  bool paged = o->paged;
  own_free(o);
  o->paged = paged;
  o->n = gpuipc_tset_version_get_count(v);
  o->dst = calloc(o->n, sizeof *o->dst);
  o->len = calloc(o->n, sizeof *o->len);
  if (!o->dst || !o->len)
    DIE("out of memory");
  size_t slot = 256;
  for (size_t i = 0; i < o->n; i++) {
    gpuipc_tensor t;
    OK(gpuipc_tset_version_get_tensor(v, i, &t));
    o->len[i] = t.nbytes;
    if (t.nbytes > slot)
      slot = (t.nbytes + 255) & ~(size_t)255;
  }
  if (paged) {
    size_t *perm = malloc(o->n * sizeof *perm);
    if (!perm)
      DIE("out of memory");
    for (size_t i = 0; i < o->n; i++)
      perm[i] = i;
    uint64_t x = 88172645463325252ull;
    for (size_t i = o->n; i > 1; i--) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      size_t j = (size_t)(x % i), t = perm[i - 1];
      perm[i - 1] = perm[j];
      perm[j] = t;
    }
    CU(gpuipc__cu.cuMemAlloc(&o->pool, o->n * slot));
    for (size_t i = 0; i < o->n; i++)
      o->dst[i] = (void *)(uintptr_t)(o->pool + (CUdeviceptr)(perm[i] * slot));
    free(perm);
  } else {
    for (size_t i = 0; i < o->n; i++) {
      CUdeviceptr p;
      CU(gpuipc__cu.cuMemAlloc(&p, o->len[i] ? o->len[i] : 1));
      o->dst[i] = (void *)(uintptr_t)p;
    }
  }
  o->layout = gpuipc_tset_version_get_layout(v);
}

/* The batched floor: the n ranges in calls of *per ranges (0: all in one),
 * made calls of 8,192 from then on where the driver refuses one call of
 * all; the calls taken in *calls, 0 when the driver has no batched copy
 * (then the time is NaN). */
static double batched_copy(CUdeviceptr *dsts, CUdeviceptr *srcs,
                           size_t *sizes, size_t n, CUstream s, size_t *per,
                           int *calls) {
  int ver = 0;
  CU(gpuipc__cu.cuDriverGetVersion(&ver));
  *calls = 0;
  if (ver < 13000 || gpuipc__cu.cuMemcpyBatchAsync == NULL || n == 0)
    return 0.0 / 0.0;
  CUmemcpyAttributes at;
  memset(&at, 0, sizeof at);
  at.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  at.srcLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
  at.dstLocHint = at.srcLocHint;
  size_t idx = 0, step = *per ? *per : n;
  double t0 = now_us();
  for (size_t from = 0; from < n; from += step, ++*calls) {
    size_t m = n - from < step ? n - from : step;
    CUresult r = gpuipc__cu.cuMemcpyBatchAsync(dsts + from, srcs + from,
                                               sizes + from, m, &at, &idx, 1, s);
    if (r == CUDA_SUCCESS)
      continue;
    if (step == n && n > 8192) { /* one call of all refused: chunks */
      CU(gpuipc__cu.cuStreamSynchronize(s));
      *per = 8192;
      return batched_copy(dsts, srcs, sizes, n, s, per, calls);
    }
    DIE("cuMemcpyBatchAsync of %zu ranges: %s", m, gpuipc__cuda_error_name(r));
  }
  CU(gpuipc__cu.cuStreamSynchronize(s));
  return now_us() - t0;
}

/* Receives the next version, polling (non-blocking). */
static gpuipc_tset_version *spin_recv(gpuipc_tset_sub *sub, CUstream s) {
  uint64_t until = gpuipc__now_ns() + 120ull * 1000000000ull;
  for (;;) {
    gpuipc_tset_version *v = NULL;
    gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
    if (st == GPUIPC_OK)
      return v;
    if (st != GPUIPC_E_WOULD_BLOCK || gpuipc__now_ns() > until)
      DIE("gpuipc_tset_recv: %s", gpuipc_strerror(st));
  }
}

static int consumer(int dfd, int cfd) {
  who = "sets (consumer)";
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  o.max_outstanding = 4096;
  gpuipc_conn *data = NULL, *ctl = NULL;
  OK(gpuipc_conn_from_fd(dfd, &o, &data));
  OK(gpuipc_conn_from_fd(cfd, &o, &ctl));
  OK(gpuipc_init());
  current();
  CUstream s;
  CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  gpuipc_tset_sub *sub = NULL;
  OK(gpuipc_tset_sub_open(data, &sub));
  OK(gpuipc_conn_set_nonblocking(data, 1));
  own mine = {0, NULL, NULL, 0, false, 0};
  for (;;) {
    cmd m;
    size_t len = 0;
    gpuipc_status st = gpuipc_conn_recv_msg(ctl, &m, sizeof m, &len, NULL, NULL);
    if (st == GPUIPC_E_PEER_GONE || (st == GPUIPC_OK && m.op == OP_QUIT))
      break;
    OK(st);
    if (m.op == OP_LAT || m.op == OP_COPY) {
      for (uint32_t i = 0; i < m.n; i++) {
        gpuipc_tset_version *v = spin_recv(sub, s);
        size_t n = gpuipc_tset_version_get_count(v);
        gpuipc_tensor a, b;
        OK(gpuipc_tset_version_get_tensor(v, 0, &a));
        OK(gpuipc_tset_version_get_tensor(v, n - 1, &b));
        if (a.ptr == NULL || b.ptr == NULL)
          DIE("a view without memory");
        if (m.op == OP_COPY) {
          own_for(&mine, v);
          OK(gpuipc_tset_version_copy_into(v, mine.dst, (struct CUstream_st *)s));
          CU(gpuipc__cu.cuStreamSynchronize(s));
        }
        double t = now_us();
        if (m.op == OP_LAT)
          own_for(&mine, v); /* outside the timing: the next copy needs it */
        OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
        send_dbl(ctl, t);
      }
    } else if (m.op == OP_END) {
      /* The producer unsubscribes: see the end, release the pieces. */
      uint64_t until = gpuipc__now_ns() + 120ull * 1000000000ull;
      gpuipc_tset_version *v = NULL;
      for (;;) {
        st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
        if (st == GPUIPC_E_CANCELED)
          break;
        if (st != GPUIPC_E_WOULD_BLOCK || gpuipc__now_ns() > until)
          DIE("gpuipc_tset_recv (waiting for the end): %s", gpuipc_strerror(st));
      }
    } else if (m.op == OP_PAGED) {
      /* The next layout's own tensors: a paged cache (1) or one
       * allocation each (0). */
      own_free(&mine);
      mine.paged = m.n != 0;
    } else if (m.op == OP_FLOOR) {
      /* The same bytes from one local allocation into the same tensors in
       * this process: tensor by tensor, then as one batched copy. */
      size_t total = 0;
      for (size_t i = 0; i < mine.n; i++)
        total += mine.len[i];
      CUdeviceptr src;
      CU(gpuipc__cu.cuMemAlloc(&src, total ? total : 1));
      CU(gpuipc__cu.cuMemsetD8(src, 1, total));
      CUdeviceptr *bd = calloc(mine.n + 1, sizeof *bd);
      CUdeviceptr *bs = calloc(mine.n + 1, sizeof *bs);
      size_t *bn = calloc(mine.n + 1, sizeof *bn);
      double *v = calloc(m.n + 1, sizeof *v), *w = calloc(m.n + 1, sizeof *w);
      if (!bd || !bs || !bn || !v || !w)
        DIE("out of memory");
      size_t nb = 0, off = 0;
      for (size_t i = 0; i < mine.n; i++) {
        if (mine.len[i]) {
          bd[nb] = (CUdeviceptr)(uintptr_t)mine.dst[i];
          bs[nb] = src + off;
          bn[nb++] = mine.len[i];
        }
        off += mine.len[i];
      }
      /* The gather floor where every range is one the kernel takes (the
       * KV sets), and then the contiguous bound: one copy of all the
       * bytes into a second allocation. */
      bool gather = nb > 0;
      for (size_t i = 0; i < nb && gather; i++)
        gather = bn[i] < GPUIPC__GATHER_LEN_MAX;
      CUdeviceptr contig = 0;
      if (gather)
        CU(gpuipc__cu.cuMemAlloc(&contig, total));
      double *x = calloc(m.n + 1, sizeof *x), *y = calloc(m.n + 1, sizeof *y);
      uint64_t *gl = calloc(nb + 1, sizeof *gl);
      if (!x || !y || !gl)
        DIE("out of memory");
      for (size_t i = 0; i < nb; i++)
        gl[i] = bn[i];
      int calls = 0;
      size_t per = 0;
      for (uint32_t k = 0; k <= m.n; k++) { /* the first is a warm-up */
        double t0 = now_us();
        for (size_t i = 0; i < nb; i++)
          CU(gpuipc__cu.cuMemcpyDtoDAsync(bd[i], bs[i], bn[i], s));
        CU(gpuipc__cu.cuStreamSynchronize(s));
        double t1 = now_us();
        double b = batched_copy(bd, bs, bn, nb, s, &per, &calls);
        double g = 0.0 / 0.0, c = 0.0 / 0.0;
        if (gather) {
          double t2 = now_us();
          gpuipc_status gs = gpuipc__tset_gather(0, bs, bd, gl, nb, s);
          if (gs == GPUIPC_E_NOT_SUPPORTED) {
            gather = false; /* the device cannot load it: n/a */
          } else {
            OK(gs);
            CU(gpuipc__cu.cuStreamSynchronize(s));
            g = now_us() - t2;
            double t3 = now_us();
            CU(gpuipc__cu.cuMemcpyDtoDAsync(contig, src, total, s));
            CU(gpuipc__cu.cuStreamSynchronize(s));
            c = now_us() - t3;
          }
        }
        if (k) {
          v[k - 1] = t1 - t0;
          w[k - 1] = b;
          x[k - 1] = g;
          y[k - 1] = c;
        }
      }
      send_dbl(ctl, bench_pct(v, (int)m.n, 0.5));
      send_dbl(ctl, calls ? bench_pct(w, (int)m.n, 0.5) : 0.0 / 0.0);
      send_dbl(ctl, calls);
      send_dbl(ctl, gather ? bench_pct(x, (int)m.n, 0.5) : 0.0 / 0.0);
      send_dbl(ctl, gather ? bench_pct(y, (int)m.n, 0.5) : 0.0 / 0.0);
      if (contig)
        CU(gpuipc__cu.cuMemFree(contig));
      free(gl);
      free(x);
      free(y);
      free(v);
      free(w);
      free(bd);
      free(bs);
      free(bn);
      CU(gpuipc__cu.cuMemFree(src));
    }
  }
  own_free(&mine);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(data);
  gpuipc_conn_close(ctl);
  return 0;
}

static void free_model(model *m) {
  free(m->t);
  free(m->shape);
  free(m->name);
}

/* ---- producer ---------------------------------------------------------------------- */

typedef struct res {
  double setup_ms, lat50, lat99, copy50, floor50;
  double batch50; /* the batched floor (NaN: the driver has none) */
  int batch_calls;
  double gather50; /* the gather kernel's floor (NaN: ranges of 1 MiB or
                    * more, or a device that cannot load it) */
  double contig50; /* one copy of all the bytes (NaN where gather50 is) */
} res;

/* One version: begin (no writes: the data is whatever the copy holds),
 * the GPU idle, then publish; returns the publish time. */
static double publish(gpuipc_tset *set, CUstream s) {
  int copy;
  OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
  CU(gpuipc__cu.cuStreamSynchronize(s));
  double t0 = now_us();
  OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  return t0;
}

static res run(model *m, gpuipc_conn *data, gpuipc_conn *ctl, CUstream s,
               int lat_iters, int copy_iters, bool floor) {
  res r = {0, 0, 0, 0, 0, 0, 0, 0, 0};
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.timeout_ms = 120000;
  gpuipc_tset *set = NULL;
  OK(gpuipc_tset_create(m->t, m->n, &o, &set));
  /* The consumer receives from now on: a large table does not fit in the
   * socket, and subscribe waits for room. The setup ends when the consumer
   * holds the first version. */
  send_cmd(ctl, OP_LAT, 1);
  double t0 = now_us();
  OK(gpuipc_tset_subscribe(set, data, (struct CUstream_st *)s));
  double p = publish(set, s);
  (void)p;
  r.setup_ms = (get_dbl(ctl) - t0) / 1000.0;
  double *v = calloc((size_t)(lat_iters > copy_iters ? lat_iters : copy_iters) + 1,
                     sizeof *v);
  send_cmd(ctl, OP_LAT, (uint32_t)lat_iters);
  for (int i = 0; i < lat_iters; i++) {
    double t = publish(set, s);
    v[i] = get_dbl(ctl) - t;
  }
  r.lat99 = bench_pct(v, lat_iters, 0.99);
  r.lat50 = bench_pct(v, lat_iters, 0.5);
  send_cmd(ctl, OP_COPY, (uint32_t)copy_iters + 1);
  for (int i = 0; i <= copy_iters; i++) { /* the first is a warm-up */
    double t = publish(set, s);
    double d = get_dbl(ctl) - t;
    if (i)
      v[i - 1] = d;
  }
  r.copy50 = bench_pct(v, copy_iters, 0.5) / 1000.0;
  if (floor) {
    send_cmd(ctl, OP_FLOOR, (uint32_t)copy_iters);
    r.floor50 = get_dbl(ctl) / 1000.0;
    r.batch50 = get_dbl(ctl) / 1000.0;
    r.batch_calls = (int)get_dbl(ctl);
    r.gather50 = get_dbl(ctl) / 1000.0;
    r.contig50 = get_dbl(ctl) / 1000.0;
  }
  free(v);
  send_cmd(ctl, OP_END, 0);
  OK(gpuipc_tset_unsubscribe(set, data));
  OK(gpuipc_tset_destroy(set));
  return r;
}

static const char sets_usage[] =
    "usage: gpuipc bench sets [--quick] [--layers N] [--emulator PATH] [--json FILE]\n"
    "  a 7B model's tensors (bf16 shapes) and sets of 1,000 to 100,000 KV\n"
    "  blocks handed from a producer process to a consumer process as tensor\n"
    "  sets: copy_into the consumer's own tensors (for KV blocks, a paged\n"
    "  cache) against the in-process copies of the same layout (the floors:\n"
    "  one copy per tensor, one batched copy), and zero-copy publish to\n"
    "  usable views. --quick: a small model, fewer and smaller KV sets.\n"
    "  --layers N: the model's depth (32; the same width).\n";

/* One row of the JSON report (docs/bench-json.md, "sets"). */
static void set_row(const char *table, const char *what, const model *m,
                    const res *r, bool floor) {
  gpuipc_bench_json_row_begin(table);
  gpuipc_bench_json_str("set", what);
  gpuipc_bench_json_num("tensors", (double)m->n);
  gpuipc_bench_json_num("bytes", (double)m->bytes);
  if (strcmp(table, "kv") == 0) {
    gpuipc_bench_json_num("blocks", (double)m->n);
    gpuipc_bench_json_num("block_bytes", (double)m->bytes / (double)m->n);
  }
  gpuipc_bench_json_num("setup_ms", r->setup_ms);
  gpuipc_bench_json_num("floor_ms", floor ? r->floor50 : 0.0 / 0.0);
  gpuipc_bench_json_num("floor_batched_ms", floor ? r->batch50 : 0.0 / 0.0);
  gpuipc_bench_json_num("floor_batched_calls", floor ? r->batch_calls : 0);
  gpuipc_bench_json_num("copy_into_ms", r->copy50);
  gpuipc_bench_json_num("copy_into_vs_floor",
                        floor ? r->copy50 / r->floor50 : 0.0 / 0.0);
  gpuipc_bench_json_num("copy_into_vs_batched_floor",
                        floor ? r->copy50 / r->batch50 : 0.0 / 0.0);
  if (strcmp(table, "kv") == 0) {
    gpuipc_bench_json_num("floor_gather_ms", floor ? r->gather50 : 0.0 / 0.0);
    gpuipc_bench_json_num("floor_contig_ms", floor ? r->contig50 : 0.0 / 0.0);
    gpuipc_bench_json_num("copy_into_vs_gather_floor",
                          floor ? r->copy50 / r->gather50 : 0.0 / 0.0);
    gpuipc_bench_json_num("copy_into_vs_contig",
                          floor ? r->copy50 / r->contig50 : 0.0 / 0.0);
  }
  gpuipc_bench_json_num("zero_copy_median_us", r->lat50);
  gpuipc_bench_json_num("zero_copy_p99_us", r->lat99);
  gpuipc_bench_json_row_end();
}

int gpuipc_bench_sets(int argc, char **argv) {
  int emu = gpuipc_bench_pick_driver(&argc, argv, "bench sets");
  if (emu < 0)
    return 1;
  bool quick = false;
  int layers = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--child") == 0 && i + 2 < argc)
      return consumer(atoi(argv[i + 1]), atoi(argv[i + 2]));
    else if (strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (strcmp(argv[i], "--layers") == 0 && i + 1 < argc &&
             atoi(argv[i + 1]) > 0 && atoi(argv[i + 1]) <= 1024)
      layers = atoi(argv[++i]);
    else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      printf("%s", sets_usage);
      return 0;
    } else if (strcmp(argv[i], "all") != 0 && strcmp(argv[i], "sets") != 0) {
      fprintf(stderr, "gpuipc bench sets: unknown option %s\n%s", argv[i],
              sets_usage);
      return 2;
    }
  }
  int lat_iters = quick ? 200 : 1000, copy_iters = quick ? 5 : 30;

  /* The consumer starts before this process touches CUDA. */
  int dfds[2], cfds[2];
  OK(gpuipc_conn_pair(dfds));
  OK(gpuipc_conn_pair(cfds));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, dfds[1], 3);
  posix_spawn_file_actions_adddup2(&fa, cfds[1], 4);
  char *args[] = {"gpuipc", "bench", "sets", "--child", "3", "4", NULL};
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, args, environ);
  if (err == 0)
    child_pid = pid;
  posix_spawn_file_actions_destroy(&fa);
  close(dfds[1]);
  close(cfds[1]);
  if (err != 0) {
    fprintf(stderr, "gpuipc bench sets: spawn: %s\n", strerror(err));
    return 1;
  }
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  o.max_outstanding = 4096;
  gpuipc_conn *data = NULL, *ctl = NULL;
  OK(gpuipc_conn_from_fd(dfds[0], &o, &data));
  OK(gpuipc_conn_from_fd(cfds[0], &o, &ctl));
  OK(gpuipc_init());
  current();
  CUstream s;
  CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  char name[128] = "?";
  CUdevice dev;
  CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  CU(gpuipc__cu.cuDeviceGetName(name, (int)sizeof name, dev));
  printf("gpuipc bench sets: %s%s%s\n", name,
         emu ? " (emulated: times are the emulator's, not a GPU's)" : "",
         quick ? " (--quick)" : "");

  model m;
  if (quick)
    llama(&m, layers ? layers : 4, 512, 1376, 4000);
  else
    llama(&m, layers ? layers : 32, 4096, 11008, 32000);
  char model_name[64];
  if (layers && layers != (quick ? 4 : 32))
    snprintf(model_name, sizeof model_name, "Llama (%d layers, width %d)",
             layers, quick ? 512 : 4096);
  else
    snprintf(model_name, sizeof model_name, "%s",
             quick ? "small Llama (4 layers, width 512)" : "Llama-2-7B");
  res a = run(&m, data, ctl, s, lat_iters, copy_iters, true);
  printf("\n%s bf16 shapes: %zu tensors, %.2f GB, producer process -> "
         "consumer process, same GPU (medians)\n",
         model_name, m.n,
         m.bytes / 1e9);
  printf("  %-58s %10.2f ms\n", "setup, once (subscribe: table, pieces, first "
         "version)", a.setup_ms);
  printf("  %-58s %10.2f ms  (%.2f TB/s read+write)\n",
         "in-process device-to-device copy, tensor by tensor (floor)",
         a.floor50, 2 * m.bytes / (a.floor50 / 1000.0) / 1e12);
  if (a.batch_calls)
    printf("  %-58s %10.2f ms  (%d call%s)\n",
           "in-process batched copy, cuMemcpyBatchAsync (floor)", a.batch50,
           a.batch_calls, a.batch_calls == 1 ? "" : "s");
  else
    printf("  %-58s %10s     (the driver has no cuMemcpyBatchAsync)\n",
           "in-process batched copy (floor)", "n/a");
  printf("  %-58s %10.2f ms  (%.3fx the per-tensor floor, %.3fx the "
         "batched)\n",
         "copy_into the consumer's own tensors, publish to done", a.copy50,
         a.copy50 / a.floor50, a.copy50 / a.batch50);
  printf("  %-58s %10.2f us  (p99 %.2f us)\n",
         "zero-copy: publish to usable views", a.lat50, a.lat99);
  gpuipc_bench_json_num("quick", quick);
  gpuipc_bench_json_str("device_name", name);
  gpuipc_bench_json_num("latency_iterations", lat_iters);
  gpuipc_bench_json_num("copy_iterations", copy_iters);
  set_row("model", model_name, &m, &a, true);
  /* KV-cache sets into the consumer's paged cache. */
  static const struct {
    int blocks;
    int64_t bytes;
  } kvs[] = {{1000, 4 << 10},  {10000, 4 << 10},  {100000, 4 << 10},
             {1000, 256 << 10}, {10000, 256 << 10}};
  printf("\nKV cache blocks as one set, copy_into the consumer's paged cache "
         "(one allocation, blocks at shuffled slots), producer process -> "
         "consumer process, same GPU, idle stream (medians; floors: the same "
         "layout in-process)\n");
  printf("  %8s %8s %9s %10s %12s %12s %10s %10s %12s %9s %9s %9s %9s "
         "%11s\n", "blocks", "KiB each", "MiB", "setup ms", "per-block ms",
         "batched ms", "gather ms", "contig ms", "copy_into ms", "x batched",
         "x per-blk", "x gather", "x contig", "zero-copy us");
  send_cmd(ctl, OP_PAGED, 1);
  for (size_t q = 0; q < sizeof kvs / sizeof kvs[0]; q++) {
    if (quick && (kvs[q].blocks > 10000 || kvs[q].bytes > (4 << 10)))
      continue;
    int it = kvs[q].blocks >= 100000 ? (quick ? 2 : 5) : (quick ? 3 : 10);
    model k;
    kv(&k, kvs[q].blocks, kvs[q].bytes);
    res b = run(&k, data, ctl, s, quick ? 20 : 100, it, true);
    char what[64];
    snprintf(what, sizeof what, "KV cache, %d blocks of %lld KiB", kvs[q].blocks,
             (long long)(kvs[q].bytes >> 10));
    set_row("kv", what, &k, &b, true);
    printf("  %8d %8lld %9.1f %10.2f %12.3f %12.3f %10.3f %10.3f %12.3f %9.3f "
           "%9.3f %9.3f %9.3f %11.2f\n",
           kvs[q].blocks, (long long)(kvs[q].bytes >> 10), k.bytes / 1048576.0,
           b.setup_ms, b.floor50, b.batch50, b.gather50, b.contig50, b.copy50,
           b.copy50 / b.batch50, b.copy50 / b.floor50, b.copy50 / b.gather50,
           b.copy50 / b.contig50, b.lat50);
    free_model(&k);
  }
  send_cmd(ctl, OP_PAGED, 0);
  if (quick)
    printf("  (--quick: 1,000 and 10,000 blocks of 4 KiB only)\n");
  else
    printf("  (100,000 blocks of 256 KiB, 25 GiB, left out: with the "
           "producer's set, the paged cache and the floor's source it would "
           "need 75 GiB)\n");
  printf("\ntorch peers of the same sync: python3 bench/torch_weight_sync.py\n");
  fflush(stdout);
  send_cmd(ctl, OP_QUIT, 0);
  int wst = 0;
  waitpid(pid, &wst, 0);
  gpuipc_conn_close(data);
  gpuipc_conn_close(ctl);
  free_model(&m);
  return WIFEXITED(wst) && WEXITSTATUS(wst) == 0 ? 0 : 1;
}
