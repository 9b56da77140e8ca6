/*
 * test-sets.c: tensor sets: the table codec (every dtype and shape, hostile
 * tables), sets handed to another process (every dtype and shape, 10,000
 * entries, wrapped allocations, late joiners, a layout change), ordering
 * in both directions (the producer's writes before publish; a consumer's
 * reads before the producer overwrites a double-buffered copy), a consumer
 * killed mid-read, a producer killed mid-publish, a hostile producer, and
 * consumers that stop releasing (the producer and the other consumers go
 * on; the held memory is kept for them, and capped).
 *
 * The producer and consumer agree on a set through a spec name: both build
 * the same tensor list (spec()), and the data of tensor i in version v is
 * the pattern fill(i, v).
 */
#include "harness.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tree.h"

/* ---- small tools ----------------------------------------------------------------- */

static void ctx_current(void) {
  CUcontext c;
  ASSERT_OK(gpuipc__primary_ctx(0, &c));
  ASSERT_CU(gpuipc__cu.cuCtxSetCurrent(c));
}

static CUstream mkstream(void) {
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  return s;
}

static gpuipc_conn *pair_conn(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  return c;
}

static void say(gpuipc_conn *c, const char *what) {
  ASSERT_OK(gpuipc_conn_send_msg(c, what, strlen(what), NULL, 0));
}

static void hear(gpuipc_conn *c, const char *what) {
  char buf[64];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf - 1, &len, NULL, NULL));
  buf[len] = '\0';
  ASSERT_STR_EQ(buf, what);
}

/* Byte k of tensor i in version v. */
static uint8_t fill(size_t i, uint64_t v, size_t k) {
  return (uint8_t)(i * 31u + v * 7u + k * 13u + (k >> 8));
}

/* ---- specs: the tensor lists both sides build ---------------------------------------- */

enum { GATHER_T = 3000, GATHER_LONG_EVERY = 500 };

/* Tensor i of spec "gather": odd sizes from 1 byte to 5,000, and every
 * GATHER_LONG_EVERY-th one past 1 MiB (the gather kernel leaves those to
 * the driver's copies). */
static size_t gather_size(size_t i) {
  if (i % GATHER_LONG_EVERY == 7)
    return ((size_t)1 << 20) + 3 + i;
  return 1 + (i * 7919) % 5000;
}

typedef struct spec_t {
  size_t n;
  gpuipc_tensor *t;
  int64_t (*shape)[GPUIPC_TSET_NDIM_MAX];
  int64_t (*strides)[GPUIPC_TSET_NDIM_MAX];
  char (*names)[64];
} spec_t;

static void spec_alloc(spec_t *s, size_t n) {
  s->n = n;
  s->t = calloc(n, sizeof *s->t);
  s->shape = calloc(n, sizeof *s->shape);
  s->strides = calloc(n, sizeof *s->strides);
  s->names = calloc(n, sizeof *s->names);
  ASSERT(s->t && s->shape && s->strides && s->names);
}

static void spec_free(spec_t *s) {
  free(s->t);
  free(s->shape);
  free(s->strides);
  free(s->names);
}

/* "dtypes": every dtype in seven shapes (scalar, 1-D, 2-D, transposed,
 * broadcast stride 0, 8-D, empty), and one name that is not ASCII.
 * "10k": 10,000 small f32 tensors. "small": three. "big": two of 1 MiB. */
static void spec(const char *name, spec_t *s) {
  if (strcmp(name, "dtypes") == 0) {
    spec_alloc(s, 17 * 7 + 1);
    size_t i = 0;
    for (int dt = 1; dt <= 17; dt++) {
      for (int k = 0; k < 7; k++, i++) {
        gpuipc_tensor *t = &s->t[i];
        snprintf(s->names[i], 64, "%s.%d", gpuipc_dtype_name(dt), k);
        t->name = s->names[i];
        t->dtype = dt;
        int64_t *sh = s->shape[i], *st = s->strides[i];
        t->shape = sh;
        switch (k) {
        case 0: t->ndim = 0; t->shape = NULL; break;
        case 1: t->ndim = 1; sh[0] = 7 + dt; break;
        case 2: t->ndim = 2; sh[0] = 3; sh[1] = 5; break;
        case 3: /* a transposed 4x6 */
          t->ndim = 2; sh[0] = 4; sh[1] = 6; st[0] = 1; st[1] = 4;
          t->strides = st; break;
        case 4: /* a row broadcast: stride 0 */
          t->ndim = 2; sh[0] = 5; sh[1] = 3; st[0] = 0; st[1] = 1;
          t->strides = st; break;
        case 5:
          t->ndim = 8;
          for (int d = 0; d < 8; d++)
            sh[d] = 1 + (d % 3);
          break;
        default: t->ndim = 2; sh[0] = 0; sh[1] = 4; break;
        }
      }
    }
    snprintf(s->names[i], 64, "caf\xc3\xa9.\xe2\x9c\x93.\xe5\x90\x8d");
    s->t[i].name = s->names[i];
    s->t[i].dtype = GPUIPC_DTYPE_BF16;
    s->t[i].ndim = 1;
    s->shape[i][0] = 33;
    s->t[i].shape = s->shape[i];
  } else if (strcmp(name, "gather") == 0) {
    spec_alloc(s, GATHER_T);
    for (size_t i = 0; i < s->n; i++) {
      snprintf(s->names[i], 64, "kv.%zu", i);
      s->t[i].name = s->names[i];
      s->t[i].dtype = GPUIPC_DTYPE_U8;
      s->t[i].ndim = 1;
      s->shape[i][0] = (int64_t)gather_size(i);
      s->t[i].shape = s->shape[i];
    }
  } else if (strcmp(name, "10k") == 0) {
    spec_alloc(s, 10000);
    for (size_t i = 0; i < s->n; i++) {
      snprintf(s->names[i], 64, "layers.%zu.w", i);
      s->t[i].name = s->names[i];
      s->t[i].dtype = GPUIPC_DTYPE_F32;
      s->t[i].ndim = 1;
      s->shape[i][0] = (int64_t)(i % 7) + 1;
      s->t[i].shape = s->shape[i];
    }
  } else {
    bool big = strcmp(name, "big") == 0;
    spec_alloc(s, big ? 2 : 3);
    for (size_t i = 0; i < s->n; i++) {
      snprintf(s->names[i], 64, "w%zu", i);
      s->t[i].name = s->names[i];
      s->t[i].dtype = GPUIPC_DTYPE_U8;
      s->t[i].ndim = 1;
      s->shape[i][0] = big ? (1 << 20) : 1000 + 24 * (int64_t)i;
      s->t[i].shape = s->shape[i];
    }
  }
}

/* Writes version v's data into copy `copy` of an owned set (the whole
 * extent of each tensor), on stream from `host` (piece-sized; pinned when
 * the copy must be asynchronous). */
static void write_version(gpuipc_tset *set, int copy, uint64_t v, uint8_t *host,
                          CUstream s) {
  size_t n = gpuipc_tset_get_count(set);
  gpuipc_tensor t0, t;
  ASSERT_OK(gpuipc_tset_get_tensor(set, copy, 0, &t0));
  CUdeviceptr base = (CUdeviceptr)(uintptr_t)t0.ptr;
  size_t end = 0;
  for (size_t i = 0; i < n; i++) {
    ASSERT_OK(gpuipc_tset_get_tensor(set, copy, i, &t));
    size_t off = (size_t)((CUdeviceptr)(uintptr_t)t.ptr - base);
    for (size_t k = 0; k < t.nbytes; k++)
      host[off + k] = fill(i, v, k);
    if (off + t.nbytes > end)
      end = off + t.nbytes;
  }
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(base, host, end, s));
}

static size_t owned_bytes(gpuipc_tset *set) {
  size_t n = gpuipc_tset_get_count(set), end = 0;
  gpuipc_tensor t0, t;
  ASSERT_OK(gpuipc_tset_get_tensor(set, 0, 0, &t0));
  for (size_t i = 0; i < n; i++) {
    ASSERT_OK(gpuipc_tset_get_tensor(set, 0, i, &t));
    size_t e = (size_t)((char *)t.ptr - (char *)t0.ptr) + t.nbytes;
    if (e > end)
      end = e;
  }
  return end;
}

/* Checks a received version against the spec and the pattern, through the
 * views and through copy_into (into one allocation, tensors packed in
 * order, so that copies coalesce). */
static void check_version(gpuipc_tset_version *v, const spec_t *sp,
                          CUstream s) {
  uint64_t num = gpuipc_tset_version_get_number(v);
  ASSERT_EQ(gpuipc_tset_version_get_count(v), sp->n);
  size_t total = 0;
  for (size_t i = 0; i < sp->n; i++) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_version_get_tensor(v, i, &t));
    ASSERT_STR_EQ(t.name, sp->t[i].name);
    ASSERT_EQ(t.dtype, sp->t[i].dtype);
    ASSERT_EQ(t.ndim, sp->t[i].ndim);
    for (int d = 0; d < t.ndim; d++) {
      ASSERT_EQ(t.shape[d], sp->t[i].shape[d]);
      if (sp->t[i].strides)
        ASSERT_EQ(t.strides[d], sp->t[i].strides[d]);
    }
    size_t idx = 99999;
    ASSERT_OK(gpuipc_tset_version_find(v, sp->t[i].name, &idx));
    ASSERT_EQ(idx, i);
    total += t.nbytes;
  }
  ASSERT_STATUS(gpuipc_tset_version_find(v, "no such tensor", &total),
                GPUIPC_E_NOT_FOUND);
  total = 0;
  for (size_t i = 0; i < sp->n; i++) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_version_get_tensor(v, i, &t));
    total += t.nbytes;
  }
  uint8_t *host = malloc(total + 1), *want = malloc(total + 1);
  ASSERT(host && want);
  void **dsts = calloc(sp->n, sizeof *dsts);
  CUdeviceptr mine = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&mine, total + 1));
  size_t off = 0;
  for (size_t i = 0; i < sp->n; i++) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_version_get_tensor(v, i, &t));
    dsts[i] = (void *)(uintptr_t)(mine + off);
    for (size_t k = 0; k < t.nbytes; k++)
      want[off + k] = fill(i, num, k);
    off += t.nbytes;
  }
  /* Views: a sample of tensors read in place (all of them when few). */
  size_t step = sp->n > 200 ? sp->n / 97 : 1;
  for (size_t i = 0; i < sp->n; i += step) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_version_get_tensor(v, i, &t));
    if (t.nbytes == 0)
      continue;
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, (CUdeviceptr)(uintptr_t)t.ptr,
                                           t.nbytes, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    for (size_t k = 0; k < t.nbytes; k++)
      if (host[k] != fill(i, num, k))
        harness_fail(__FILE__, __LINE__, "version %llu, tensor %zu (%s), "
                     "byte %zu: %u, want %u", (unsigned long long)num, i,
                     t.name, k, host[k], fill(i, num, k));
  }
  /* copy_into: the whole set. */
  ASSERT_OK(gpuipc_tset_version_copy_into(v, dsts, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, mine, total, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_MEM_EQ(host, want, total);
  ASSERT_CU(gpuipc__cu.cuMemFree(mine));
  free(dsts);
  free(host);
  free(want);
}

/* ---- the codec ---------------------------------------------------------------------- */

/* A table of a spec as the producer would build it (owned, packed). */
static void table_of(const char *name, gpuipc__tset_table *t) {
  spec_t sp;
  spec(name, &sp);
  memset(t, 0, sizeof *t);
  t->layout_id = 0x1234;
  t->n_entries = (uint32_t)sp.n;
  t->n_pieces = 1;
  t->copies = 1;
  t->e = calloc(sp.n, sizeof *t->e);
  t->names = malloc(sp.n * 64);
  t->piece_len = malloc(8);
  uint64_t pos = 0;
  size_t noff = 0;
  for (size_t i = 0; i < sp.n; i++) {
    gpuipc__tset_entry *e = &t->e[i];
    size_t l = strlen(sp.t[i].name);
    memcpy(t->names + noff, sp.t[i].name, l + 1);
    e->name_off = (uint32_t)noff;
    e->name_len = (uint16_t)l;
    noff += l + 1;
    e->dtype = (uint8_t)sp.t[i].dtype;
    e->ndim = (uint8_t)sp.t[i].ndim;
    int64_t stride = 1;
    for (int d = e->ndim - 1; d >= 0; d--) {
      e->shape[d] = sp.t[i].shape[d];
      e->strides[d] = sp.t[i].strides ? sp.t[i].strides[d] : stride;
      stride *= e->shape[d] ? e->shape[d] : 1;
    }
    ASSERT_OK(gpuipc__tset_extent(e->dtype, e->ndim, e->shape, e->strides,
                                  &e->nbytes));
    e->offset = pos;
    pos += (e->nbytes + 15) & ~(uint64_t)15;
  }
  t->names_len = noff;
  t->piece_len[0] = pos ? pos : 16;
  spec_free(&sp);
}

TEST_IMPL(sets_table_roundtrip) {
  const char *specs[] = {"dtypes", "10k", "small"};
  for (int k = 0; k < 3; k++) {
    gpuipc__tset_table t, d;
    table_of(specs[k], &t);
    uint8_t *bytes = NULL;
    size_t len = 0;
    ASSERT_OK(gpuipc__tset_table_encode(&t, &bytes, &len));
    ASSERT_OK(gpuipc__tset_table_decode(bytes, len, &d));
    ASSERT_EQ(d.n_entries, t.n_entries);
    ASSERT_EQ(d.layout_id, t.layout_id);
    for (uint32_t i = 0; i < t.n_entries; i++) {
      const gpuipc__tset_entry *a = &t.e[i], *b = &d.e[i];
      ASSERT_STR_EQ(d.names + b->name_off, t.names + a->name_off);
      ASSERT_EQ(a->dtype, b->dtype);
      ASSERT_EQ(a->ndim, b->ndim);
      ASSERT_UEQ(a->offset, b->offset);
      ASSERT_UEQ(a->nbytes, b->nbytes);
      for (int x = 0; x < a->ndim; x++) {
        ASSERT_EQ(a->shape[x], b->shape[x]);
        ASSERT_EQ(a->strides[x], b->strides[x]);
      }
      ASSERT_EQ(gpuipc__tset_table_find(&d, t.names + a->name_off, a->name_len),
                (long)i);
    }
    /* One encoding per meaning: re-encoding gives the same bytes. */
    uint8_t *again = NULL;
    size_t len2 = 0;
    ASSERT_OK(gpuipc__tset_table_encode(&d, &again, &len2));
    ASSERT_EQ(len2, len);
    ASSERT_MEM_EQ(again, bytes, len);
    free(again);
    free(bytes);
    gpuipc__tset_table_free(&t);
    gpuipc__tset_table_free(&d);
  }
  ASSERT_EQ(gpuipc_dtype_get_size(GPUIPC_DTYPE_BF16), 2);
  ASSERT_EQ(gpuipc_dtype_get_size(GPUIPC_DTYPE_C128), 16);
  ASSERT_EQ(gpuipc_dtype_get_size(0), 0);
  ASSERT_EQ(gpuipc_dtype_get_size(GPUIPC_DTYPE_F8_E8M0FNU + 1), 0);
  ASSERT_STR_EQ(gpuipc_dtype_name(GPUIPC_DTYPE_F8_E4M3FN), "f8_e4m3fn");
  return 0;
}

static void le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static void fix_crc(uint8_t *b, size_t len) {
  memset(b + 12, 0, 4);
  uint32_t c = gpuipc__crc32c(0, b, len);
  for (int i = 0; i < 4; i++)
    b[12 + i] = (uint8_t)(c >> (8 * i));
}

/* The ways a table is hostile, each a patch of a valid "small" table
 * (entry 0 at byte 56: 48 of header, 8 of the one piece length; entries
 * of 1 dimension are 48 bytes with their 2-byte names and padding). */
enum { H_OVERLAP, H_OUTSIDE, H_LONGNAME, H_COUNT, H_CHECKSUM, H_MAGIC,
       H_VERSION, H_TRUNC, H_EXTENT, H_DTYPE, H_DUPNAME, H_UTF8, H_PAD,
       H_NDIM, H_TRAILING, H_N };
static const gpuipc_status h_want[H_N] = {
    GPUIPC_E_OUT_OF_RANGE, GPUIPC_E_OUT_OF_RANGE, GPUIPC_E_PROTOCOL,
    GPUIPC_E_PROTOCOL,     GPUIPC_E_BAD_CHECKSUM, GPUIPC_E_BAD_MAGIC,
    GPUIPC_E_BAD_VERSION,  GPUIPC_E_TRUNCATED,    GPUIPC_E_OUT_OF_RANGE,
    GPUIPC_E_BAD_KIND,     GPUIPC_E_PROTOCOL,     GPUIPC_E_PROTOCOL,
    GPUIPC_E_PROTOCOL,     GPUIPC_E_PROTOCOL,     GPUIPC_E_PROTOCOL};
static const char *h_name[H_N] = {"overlap", "outside", "longname", "count",
                                  "checksum", "magic", "version", "trunc",
                                  "extent", "dtype", "dupname", "utf8", "pad",
                                  "ndim", "trailing"};

/* A hostile table: *len bytes (malloc'ed). */
static uint8_t *hostile_table(int h, uint64_t layout, size_t *len) {
  gpuipc__tset_table t;
  table_of("small", &t);
  t.layout_id = layout;
  uint8_t *b = NULL;
  ASSERT_OK(gpuipc__tset_table_encode(&t, &b, len));
  gpuipc__tset_table_free(&t);
  uint8_t *e0 = b + 56, *e1 = b + 56 + 48;
  switch (h) {
  case H_OVERLAP: le64(e1 + 8, 8); break;            /* entry 1 at byte 8 */
  case H_OUTSIDE: le64(e1 + 8, 1u << 30); break;     /* beyond the piece */
  case H_LONGNAME: e0[0] = 0x2c; e0[1] = 0x01; break; /* 300 bytes */
  case H_COUNT: b[24] = 4; break;                    /* 4 entries, 3 sent */
  case H_CHECKSUM: e0[40] ^= 1; return b;            /* no fix */
  case H_MAGIC: b[0] = 'X'; break;
  case H_VERSION: b[4] = 2; break;
  case H_TRUNC: *len -= 8; return b;                 /* length says more */
  case H_EXTENT: le64(e0 + 16, 999); break;          /* nbytes != shape */
  case H_DTYPE: e0[2] = 200; break;
  case H_DUPNAME: e1[41] = '0'; break;               /* "w1" -> "w0" */
  case H_UTF8: e0[40] = 0xC0; break;                 /* overlong lead */
  case H_PAD: e0[47] = 1; break;
  case H_NDIM: e0[3] = 9; break;
  case H_TRAILING: {
    uint8_t *nb = realloc(b, *len + 8);
    ASSERT_NOT_NULL(nb);
    b = nb;
    memset(b + *len, 0, 8);
    *len += 8;
    b[8] = (uint8_t)*len;
    b[9] = (uint8_t)(*len >> 8);
    fix_crc(b, *len - 8); /* checksum over the declared bytes... */
    b[8] = (uint8_t)(*len - 8);
    b[9] = (uint8_t)((*len - 8) >> 8);
    fix_crc(b, *len - 8); /* ...which are 8 fewer than given */
    return b;
  }
  }
  fix_crc(b, *len);
  return b;
}

TEST_IMPL(sets_table_hostile) {
  for (int h = 0; h < H_N; h++) {
    size_t len = 0;
    uint8_t *b = hostile_table(h, 77, &len);
    gpuipc__tset_table t;
    gpuipc_status s = gpuipc__tset_table_decode(b, len, &t);
    if (s != h_want[h])
      harness_fail(__FILE__, __LINE__, "hostile table '%s': %s, want %s (%s)",
                   h_name[h], gpuipc_status_name(s),
                   gpuipc_status_name(h_want[h]), gpuipc_last_error());
    ASSERT_NULL(t.e); /* nothing kept */
    free(b);
  }
  /* Too many entries for the bytes: refused before allocating for them. */
  uint8_t hdr[48] = {0};
  le64(hdr, GPUIPC__TSET_MAGIC | (uint64_t)1 << 32 | (uint64_t)48 << 48);
  hdr[8] = 48;
  le64(hdr + 24, (uint64_t)1000000 | (uint64_t)1 << 32);
  hdr[32] = 1;
  fix_crc(hdr, 48);
  gpuipc__tset_table t;
  ASSERT_STATUS(gpuipc__tset_table_decode(hdr, 48, &t), GPUIPC_E_PROTOCOL);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "cannot fit");
  ASSERT_STATUS(gpuipc__tset_table_decode(hdr, 10, &t), GPUIPC_E_TRUNCATED);
  return 0;
}

/* ---- the consumer helper -------------------------------------------------------------- */

/* argv: spec, versions to check, then a mode:
 *   "check"   check each version and release it; "ok" after the last;
 *             with argv[3] "ready", say "ready" once CUDA is up (as for
 *             "late");
 *   "late"    as check, but the first version must be argv[3]'s number;
 *             with argv[4] "ready", say "ready" once CUDA is up (so the
 *             producer's hold clock, which starts at the hand-out, does
 *             not also time this process's start); with argv[5] "acks"
 *             also "rel" after each release;
 *   "hold"    check the first version, start a (slow) read of it, say
 *             "got" and wait to be killed;
 *   "change"  check the versions of spec, then of spec argv[3] (a new
 *             layout on the same connection), say "ok". */
HELPER_IMPL(ts_consumer) {
  ASSERT(argc >= 3);
  spec_t sp;
  spec(argv[0], &sp);
  int count = atoi(argv[1]);
  const char *mode = argv[2];
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  if ((strcmp(mode, "late") == 0 && argc > 4 && strcmp(argv[4], "ready") == 0) ||
      (strcmp(mode, "check") == 0 && argc > 3 && strcmp(argv[3], "ready") == 0))
    say(c, "ready");
  bool acks = strcmp(mode, "late") == 0 && argc > 5 && strcmp(argv[5], "acks") == 0;
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  uint64_t layout = 0, last = 0;
  for (int k = 0; k < count; k++) {
    gpuipc_tset_version *v = NULL;
    ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
    uint64_t num = gpuipc_tset_version_get_number(v);
    if (k == 0 && strcmp(mode, "late") == 0)
      ASSERT_EQ(num, (uint64_t)atoll(argv[3]));
    if (k > 0)
      ASSERT_GT(num, last); /* in order */
    if (k == 0)
      layout = gpuipc_tset_version_get_layout(v);
    ASSERT_EQ(gpuipc_tset_version_get_layout(v), layout);
    last = num;
    check_version(v, &sp, s);
    if (strcmp(mode, "hold") == 0) {
      /* A read in flight (slow on the emulator), then death. */
      gpuipc_tensor t;
      ASSERT_OK(gpuipc_tset_version_get_tensor(v, 0, &t));
      CUdeviceptr mine;
      ASSERT_CU(gpuipc__cu.cuMemAlloc(&mine, t.nbytes));
      ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(mine, (CUdeviceptr)(uintptr_t)t.ptr,
                                             t.nbytes, s));
      say(c, "got");
      for (;;)
        pause();
    }
    ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
    if (acks)
      say(c, "rel");
  }
  if (strcmp(mode, "change") == 0) {
    gpuipc_tset_version *none = NULL;
    ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &none),
                  GPUIPC_E_CANCELED);
    ASSERT_NULL(none);
    spec_t sp2;
    spec(argv[3], &sp2);
    gpuipc_tset_version *v = NULL;
    ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
    ASSERT_NE(gpuipc_tset_version_get_layout(v), layout);
    check_version(v, &sp2, s);
    ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
    spec_free(&sp2);
  }
  say(c, "ok");
  /* The producer ends the subscription (END) and closes. */
  gpuipc_tset_version *v = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_CANCELED);
  gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  spec_free(&sp);
  return 0;
}

/* The producer's side of most tests: an owned set of a spec published
 * `versions` times to one helper consumer. */
static void produce(gpuipc_tset *set, gpuipc_conn *c, int versions, CUstream s) {
  uint8_t *host = malloc(owned_bytes(set) + 1);
  ASSERT_NOT_NULL(host);
  uint64_t first = gpuipc_tset_get_version(set);
  for (int k = 0; k < versions; k++) {
    int copy = -1;
    ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
    write_version(set, copy, gpuipc_tset_get_version(set) + 1, host, s);
    ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
    ASSERT_UEQ(gpuipc_tset_get_version(set), first + (uint64_t)k + 1);
  }
  free(host);
}

/* An honest set of "small" subscribed on c: its version 1, then, once the
 * consumer says `word`, its END (destroy). */
static void honest_version(gpuipc_conn *c, CUstream s, const char *word) {
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, NULL, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, c, 1, s);
  hear(c, word);
  ASSERT_OK(gpuipc_tset_destroy(set));
  spec_free(&sp);
}

static gpuipc_arena *mkarena(size_t chunk) {
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = chunk;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  return a;
}

static void arena_empty(gpuipc_arena *a) {
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_EQ(st.leases, 0);
}

/* Waits (making progress on c) until the peer released blocks x and y
 * (y may be NULL), then frees them. */
static void blocks_back(gpuipc_conn *c, gpuipc_block *x, gpuipc_block *y) {
  for (int i = 0; i < 1000 && (gpuipc_block_get_holders(x) ||
                               gpuipc_block_get_holders(y)); i++)
    ASSERT_OK(gpuipc_conn_progress(c, 1));
  ASSERT_EQ(gpuipc_block_get_holders(x), 0);
  ASSERT_EQ(gpuipc_block_get_holders(y), 0);
  ASSERT_OK(gpuipc_block_free(x, NULL));
  ASSERT_OK(gpuipc_block_free(y, NULL));
}

static int run_spec(const char *name, int copies, int versions) {
  REQUIRE_DEVICES(1);
  char nv[16];
  snprintf(nv, sizeof nv, "%d", versions);
  int fd;
  pid_t pid = spawn_helper("ts_consumer", NULL, &fd, name, nv, "check", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec(name, &sp);
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = copies;
  o.arena = a;
  o.align = 16;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_EQ(gpuipc_tset_get_count(set), sp.n);
  ASSERT_EQ(gpuipc_tset_get_copies(set), copies);
  size_t idx = 0;
  ASSERT_OK(gpuipc_tset_find(set, sp.t[sp.n - 1].name, &idx));
  ASSERT_EQ(idx, sp.n - 1);
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  ASSERT_STATUS(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s),
                GPUIPC_E_EXISTS);
  produce(set, c, versions, s);
  hear(c, "ok");
  ASSERT_OK(gpuipc_tset_unsubscribe(set, c));
  ASSERT_EQ(gpuipc_tset_get_subscribers(set), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  arena_empty(a);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

TEST_IMPL(sets_every_dtype_and_shape) {
  return run_spec("dtypes", 1, 3);
}

TEST_IMPL(sets_double_buffered_versions) {
  return run_spec("small", 2, 8);
}

TEST_IMPL(sets_10000_entries) {
  return run_spec("10k", 2, 2);
}

/* A wrapped set: the producer's own allocations (two tensors in one, one
 * in another: two pieces), updated in place between versions. */
TEST_IMPL(sets_wrapped_allocations) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_consumer", NULL, &fd, "small", "3", "check", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  CUdeviceptr a1, a2;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&a1, 8192));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&a2, 4096));
  sp.t[0].ptr = (void *)(uintptr_t)(a1 + 256);
  sp.t[1].ptr = (void *)(uintptr_t)(a2);
  sp.t[2].ptr = (void *)(uintptr_t)(a1 + 4096);
  gpuipc_tset *set = NULL;
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = 2;
  ASSERT_STATUS(gpuipc_tset_create(sp.t, sp.n, &o, &set), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, NULL, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  uint8_t host[2048];
  for (uint64_t v = 1; v <= 3; v++) {
    int copy = -1;
    ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
    ASSERT_EQ(copy, 0);
    for (size_t i = 0; i < sp.n; i++) {
      gpuipc_tensor t;
      ASSERT_OK(gpuipc_tset_get_tensor(set, 0, i, &t));
      ASSERT_PTR_EQ(t.ptr, sp.t[i].ptr);
      for (size_t k = 0; k < t.nbytes; k++)
        host[k] = fill(i, v, k);
      ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)t.ptr, host,
                                        t.nbytes));
    }
    ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  }
  hear(c, "ok");
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  ASSERT_CU(gpuipc__cu.cuMemFree(a1));
  ASSERT_CU(gpuipc__cu.cuMemFree(a2));
  spec_free(&sp);
  return 0;
}

TEST_IMPL(sets_create_refuses_bad_tensors) {
  REQUIRE_DEVICES(1);
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset *set = NULL;
  sp.names[1][0] = 'w';
  sp.names[1][1] = '0'; /* a duplicate of "w0" */
  ASSERT_STATUS(gpuipc_tset_create(sp.t, sp.n, NULL, &set), GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "both named");
  sp.names[1][1] = '1';
  sp.t[2].dtype = 99;
  ASSERT_STATUS(gpuipc_tset_create(sp.t, sp.n, NULL, &set), GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "tensor 2");
  sp.t[2].dtype = GPUIPC_DTYPE_U8;
  char longname[300];
  memset(longname, 'x', 299);
  longname[299] = '\0';
  sp.t[0].name = longname;
  ASSERT_STATUS(gpuipc_tset_create(sp.t, sp.n, NULL, &set), GPUIPC_E_INVALID_ARG);
  sp.t[0].name = sp.names[0];
  sp.t[1].ptr = (void *)(uintptr_t)4096;
  ASSERT_STATUS(gpuipc_tset_create(sp.t, sp.n, NULL, &set), GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "mixed");
  sp.t[1].ptr = NULL;
  ASSERT_STATUS(gpuipc_tset_create(sp.t, 0, NULL, &set), GPUIPC_E_INVALID_ARG);
  ASSERT_NULL(set);
  /* Begin twice, publish without begin. */
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, NULL, &set));
  ASSERT_STATUS(gpuipc_tset_publish(set, NULL), GPUIPC_E_INVALID_ARG);
  int copy;
  ASSERT_OK(gpuipc_tset_begin(set, NULL, &copy));
  ASSERT_STATUS(gpuipc_tset_begin(set, NULL, &copy), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_tset_publish(set, NULL));
  ASSERT_OK(gpuipc_tset_destroy(set));
  ASSERT_OK(gpuipc_tset_destroy(NULL));
  spec_free(&sp);
  return 0;
}

/* A late joiner starts at the latest version; a consumer subscribed
 * before sees them all. */
TEST_IMPL(sets_late_joiner_gets_latest) {
  REQUIRE_DEVICES(1);
  int fd1, fd2;
  pid_t p1 = spawn_helper("ts_consumer", NULL, &fd1, "small", "4", "check", NULL);
  pid_t p2 = spawn_helper("ts_consumer", NULL, &fd2, "small", "2", "late", "3",
                          NULL);
  gpuipc_conn *c1 = pair_conn(fd1), *c2 = pair_conn(fd2);
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = 2;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c1, (struct CUstream_st *)s));
  produce(set, c1, 3, s);
  ASSERT_OK(gpuipc_tset_subscribe(set, c2, (struct CUstream_st *)s));
  ASSERT_EQ(gpuipc_tset_get_subscribers(set), 2);
  produce(set, c1, 1, s);
  hear(c1, "ok");
  hear(c2, "ok");
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c1);
  gpuipc_conn_close(c2);
  ASSERT_EQ(wait_helper(p1, 120), 0);
  ASSERT_EQ(wait_helper(p2, 120), 0);
  spec_free(&sp);
  return 0;
}

/* begin, unsubscribe and destroy of a set made with a timeout of 0 say
 * what would wait, and a caller waiting itself on gpuipc_tset_get_wait_fds
 * between calls gets there: the descriptors are the subscribed
 * connections' sockets, and a short poll on them (a release's GPU work
 * wakes no descriptor) until the call succeeds. */
static gpuipc_status polled(gpuipc_tset *set, int what, int *copy,
                            gpuipc_conn *c, gpuipc_status again) {
  uint64_t end = gpuipc__now_ns() + 60ull * 1000000000ull;
  for (;;) {
    gpuipc_status st = what == 0   ? gpuipc_tset_begin(set, NULL, copy)
                       : what == 1 ? gpuipc_tset_unsubscribe(set, c)
                                   : gpuipc_tset_destroy(set);
    if (st != again || gpuipc__now_ns() > end)
      return st;
    int fds[4];
    size_t n = gpuipc_tset_get_wait_fds(set, fds, 4);
    ASSERT_LE(n, 1);
    struct pollfd p = {.fd = n ? fds[0] : -1, .events = POLLIN};
    (void)poll(&p, 1, 5);
  }
}

TEST_IMPL(sets_wait_fds_for_a_caller_that_waits_itself) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_consumer", NULL, &fd, "small", "2", "check",
                           NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.timeout_ms = 0;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  int fds[2] = {-1, -1};
  ASSERT_EQ(gpuipc_tset_get_wait_fds(set, fds, 2), 0);
  ASSERT_EQ(gpuipc_tset_get_wait_fds(NULL, fds, 2), 0);
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  ASSERT_EQ(gpuipc_tset_get_wait_fds(set, NULL, 0), 1);
  ASSERT_EQ(gpuipc_tset_get_wait_fds(set, fds, 2), 1);
  ASSERT_EQ(fds[0], gpuipc_conn_get_fd(c));
  ASSERT_EQ(fds[1], -1);
  uint8_t *host = malloc(owned_bytes(set) + 1);
  ASSERT_NOT_NULL(host);
  for (uint64_t v = 1; v <= 2; v++) {
    /* one copy: the second begin waits for the consumer's release of
     * the first version */
    int copy = -1;
    ASSERT_OK(polled(set, 0, &copy, NULL, GPUIPC_E_TIMEOUT));
    write_version(set, copy, v, host, s);
    ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  }
  free(host);
  hear(c, "ok");
  ASSERT_OK(polled(set, 1, NULL, c, GPUIPC_E_TIMEOUT));
  ASSERT_EQ(gpuipc_tset_get_wait_fds(set, fds, 2), 0);
  ASSERT_OK(polled(set, 2, NULL, NULL, GPUIPC_E_BUSY));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&sp);
  return 0;
}

/* A layout change: the producer moves the connection to a new set. */
TEST_IMPL(sets_layout_change) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_consumer", NULL, &fd, "small", "2", "change",
                           "dtypes", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t a, b;
  spec("small", &a);
  spec("dtypes", &b);
  gpuipc_tset *sa = NULL, *sb = NULL;
  ASSERT_OK(gpuipc_tset_create(a.t, a.n, NULL, &sa));
  ASSERT_OK(gpuipc_tset_create(b.t, b.n, NULL, &sb));
  ASSERT_NE(gpuipc_tset_get_layout(sa), gpuipc_tset_get_layout(sb));
  ASSERT_OK(gpuipc_tset_subscribe(sa, c, (struct CUstream_st *)s));
  produce(sa, c, 2, s);
  ASSERT_OK(gpuipc_tset_unsubscribe(sa, c));
  ASSERT_OK(gpuipc_tset_subscribe(sb, c, (struct CUstream_st *)s));
  produce(sb, c, 1, s);
  hear(c, "ok");
  ASSERT_OK(gpuipc_tset_unsubscribe(sb, c));
  ASSERT_STATUS(gpuipc_tset_unsubscribe(sb, c), GPUIPC_E_NOT_FOUND);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(sa));
  ASSERT_OK(gpuipc_tset_destroy(sb));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&a);
  spec_free(&b);
  return 0;
}

/* ---- ordering ---------------------------------------------------------------------------- */

static char *delay_env[] = {"GPUIPC_EMU_COPY_DELAY_US=200000", NULL};
static char *no_delay[] = {"GPUIPC_EMU_COPY_DELAY_US=", NULL};

/* The producer's slow write before publish is what the consumer reads. */
TEST_IMPL(sets_order_writes_before_publish) {
  if (harness_on_emulator())
    setenv("GPUIPC_EMU_COPY_DELAY_US", "200000", 1);
  REQUIRE_DEVICES(1);
  int fd;
  const char *name = harness_on_emulator() ? "small" : "big";
  pid_t pid = spawn_helper("ts_consumer", no_delay, &fd, name, "2", "check",
                           NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec(name, &sp);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = 2;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  /* Pinned host memory: the write is asynchronous (and slow), and the
   * consumer's reads are queued as soon as it received the version. */
  size_t bytes = owned_bytes(set);
  uint8_t *host[2];
  for (int k = 0; k < 2; k++) {
    ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&host[k], bytes, 0));
    int copy;
    ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
    ASSERT_EQ(copy, k);
    write_version(set, copy, (uint64_t)k + 1, host[k], s);
    ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  }
  hear(c, "ok");
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  for (int k = 0; k < 2; k++)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(host[k]));
  spec_free(&sp);
  return 0;
}

/* A consumer's slow read of version 1 (copy 0) is queued, then released;
 * the producer's version 3 reuses copy 0 at once: its overwrite must wait
 * for the read. */
HELPER_IMPL(ts_slow_reader) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  gpuipc_tset_version *v1 = NULL, *v = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v1));
  ASSERT_EQ(gpuipc_tset_version_get_copy(v1), 0);
  gpuipc_tensor t;
  ASSERT_OK(gpuipc_tset_version_get_tensor(v1, 0, &t));
  size_t n = t.nbytes;
  CUdeviceptr mine;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&mine, n));
  void *dst = (void *)(uintptr_t)mine;
  void *dsts[3] = {dst, NULL, NULL};
  ASSERT_OK(gpuipc_tset_version_copy_into(v1, dsts, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_tset_version_release(v1, (struct CUstream_st *)s));
  /* Versions 2 and 3 (3 in copy 0, overwritten while our copy may still
   * be queued). */
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  ASSERT_EQ(gpuipc_tset_version_get_number(v), 2);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  ASSERT_EQ(gpuipc_tset_version_get_number(v), 3);
  ASSERT_EQ(gpuipc_tset_version_get_copy(v), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint8_t *host = malloc(n);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(host, mine, n));
  for (size_t k = 0; k < n; k++)
    ASSERT_EQ(host[k], fill(0, 1, k)); /* version 1's, not the overwrite */
  ASSERT_OK(gpuipc_tset_version_get_tensor(v, 0, &t));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(host, (CUdeviceptr)(uintptr_t)t.ptr, n));
  for (size_t k = 0; k < n; k++)
    ASSERT_EQ(host[k], 0x55); /* version 3 */
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  free(host);
  say(c, "ok");
  gpuipc_tset_version *none = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &none),
                GPUIPC_E_CANCELED);
  gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &none);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(sets_order_reads_before_reuse) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_slow_reader",
                           harness_on_emulator() ? delay_env : NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec(harness_on_emulator() ? "small" : "big", &sp);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = 2;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, c, 2, s); /* versions 1 (copy 0) and 2 (copy 1) */
  int copy;
  /* Copy 0 comes back as soon as the release of version 1 arrived. */
  ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
  ASSERT_EQ(copy, 0);
  gpuipc_tensor t;
  ASSERT_OK(gpuipc_tset_get_tensor(set, 0, 0, &t));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)t.ptr, 0x55,
                                       t.nbytes, s));
  ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  hear(c, "ok");
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&sp);
  return 0;
}

/* ---- death -------------------------------------------------------------------------------- */

/* A consumer killed while it holds a version and reads it: the producer's
 * next begin gets the copy back (no hang), and nothing stays leased. */
TEST_IMPL(sets_consumer_killed_mid_read) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_consumer", harness_on_emulator() ? delay_env : NULL,
                           &fd, "small", "1", "hold", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.arena = a;
  o.timeout_ms = 30000;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, c, 1, s);
  hear(c, "got");
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  int copy;
  ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
  ASSERT_EQ(gpuipc_tset_get_subscribers(set), 0);
  ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  arena_empty(a);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

/* A producer publishing double-buffered versions as fast as it can, until
 * it is killed. */
HELPER_IMPL(ts_producer_loop) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = 2;
  o.timeout_ms = -1;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  uint8_t *host = malloc(owned_bytes(set) + 1);
  for (;;) {
    int copy;
    ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
    write_version(set, copy, gpuipc_tset_get_version(set) + 1, host, s);
    ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  }
}

/* Sends the first chunk of table t (all of it when it fits one). */
static void send_chunk0(gpuipc_conn *c, gpuipc__tset_table *t, size_t *len) {
  uint8_t *b = NULL;
  ASSERT_OK(gpuipc__tset_table_encode(t, &b, len));
  static uint8_t msg[GPUIPC_CONN_MSG_MAX];
  memset(msg, 0, GPUIPC__TSET_CHUNK_HDR);
  le64(msg, GPUIPC__TSET_CHUNK_MAGIC);
  le64(msg + 8, t->layout_id);
  size_t n = *len < GPUIPC__TSET_CHUNK_DATA ? *len : GPUIPC__TSET_CHUNK_DATA;
  memcpy(msg + GPUIPC__TSET_CHUNK_HDR, b, n);
  ASSERT_OK(gpuipc_conn_send_msg(c, msg, GPUIPC__TSET_CHUNK_HDR + n, NULL, 0));
  free(b);
}

/* Sends the table of a layout of "small" in two copies and its first
 * piece of two (a block of a, returned), nothing more: a layout left half
 * sent. */
static gpuipc_block *send_half_layout(gpuipc_conn *c, gpuipc_arena *a,
                                      uint64_t layout) {
  CUstream s = mkstream();
  gpuipc__tset_table t;
  table_of("small", &t);
  t.layout_id = layout;
  t.copies = 2;
  size_t len = 0;
  send_chunk0(c, &t, &len);
  gpuipc_block *blk = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, (size_t)t.piece_len[0], NULL, &blk));
  gpuipc__tset_meta m = {GPUIPC__TSET_PIECE, t.layout_id, 0, 2, (uint32_t)len};
  uint8_t meta[GPUIPC__TSET_META_LEN];
  gpuipc__tset_meta_encode(&m, meta);
  ASSERT_OK(gpuipc_conn_send(c, blk, (struct CUstream_st *)s, meta, sizeof meta));
  gpuipc__tset_table_free(&t);
  return blk;
}

/* A producer that dies in the middle of sending a layout (table and one
 * piece of two sent, no version). */
HELPER_IMPL(ts_producer_half) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  (void)send_half_layout(c, a, 0x1234);
  ASSERT_OK(gpuipc_conn_progress(c, 100));
  _exit(0);
}

TEST_IMPL(sets_producer_killed_mid_publish) {
  REQUIRE_DEVICES(1);
  /* A real driver opens descriptors of its own at the first import and
   * keeps them: the first round runs before the count that the end is
   * checked against. */
  int fds0 = -1;
  spec_t sp;
  spec("small", &sp);
  CUstream s = mkstream();
  int fd;
  pid_t pid;
  gpuipc_conn *c;
  gpuipc_tset_sub *sub = NULL;
  for (int round = 0; round < 2; round++) {
    /* Killed at some point of its loop: every version received is whole. */
    pid = spawn_helper("ts_producer_loop", NULL, &fd, NULL);
    c = pair_conn(fd);
    sub = NULL;
    ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
    uint64_t last = 0;
    int got = 0;
    unsigned seed = (unsigned)time(NULL);
    int kill_at = 3 + (int)(rand_r(&seed) % 8);
    gpuipc_status st = GPUIPC_OK;
    for (;;) {
      gpuipc_tset_version *v = NULL;
      st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
      if (st != GPUIPC_OK)
        break;
      ASSERT_GT(gpuipc_tset_version_get_number(v), last);
      last = gpuipc_tset_version_get_number(v);
      check_version(v, &sp, s);
      if (++got == kill_at)
        kill(pid, SIGKILL);
      ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
    }
    ASSERT_STATUS(st, GPUIPC_E_PEER_GONE);
    ASSERT_GE(got, kill_at);
    ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    gpuipc_tset_sub_close(sub);
    gpuipc_conn_close(c);
    if (round == 0)
      fds0 = harness_count_fds();
  }
  /* Dead in the middle of a layout: no version, no hang. */
  pid = spawn_helper("ts_producer_half", NULL, &fd, NULL);
  c = pair_conn(fd);
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  gpuipc_tset_version *v = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_PEER_GONE);
  ASSERT_NULL(v);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  size_t here = 99;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 1); /* the one piece, held by the half layout */
  gpuipc_tset_sub_close(sub);
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 0);
  gpuipc_conn_close(c);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  ASSERT_EQ(harness_count_fds(), fds0);
  spec_free(&sp);
  return 0;
}

/* ---- consumers that stop releasing ------------------------------------------------------- */

/* A consumer that stops releasing: it takes version 1, checks it, says
 * "got" and holds it; on "check" it checks version 1's data again (no one
 * may have written there meanwhile) and says "same". Mode "release": it
 * then releases it, takes what else was sent to it (whole versions) until
 * the producer's END, which must say it was dropped for holding, and says
 * "released". Mode "die": it waits to be killed. Mode "wrapped": as
 * "release", without the second check (a wrapped set's memory is written
 * in place once its holder is dropped). argv[1], when given: the number
 * of the first version (a late joiner's), 1 otherwise; argv[2] "ready":
 * say "ready" once CUDA is up, before taking anything. */
HELPER_IMPL(ts_stuck) {
  ASSERT(argc >= 1);
  const char *mode = argv[0];
  spec_t sp;
  spec("small", &sp);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  if (argc > 2 && strcmp(argv[2], "ready") == 0)
    say(c, "ready"); /* CUDA is up: what follows is timed by the producer */
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  gpuipc_tset_version *v1 = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v1));
  ASSERT_UEQ(gpuipc_tset_version_get_number(v1),
             argc > 1 ? (uint64_t)atoll(argv[1]) : 1);
  check_version(v1, &sp, s);
  say(c, "got");
  hear(c, "check");
  if (strcmp(mode, "wrapped") != 0)
    check_version(v1, &sp, s);
  say(c, "same");
  if (strcmp(mode, "die") == 0)
    for (;;)
      pause();
  ASSERT_OK(gpuipc_tset_version_release(v1, (struct CUstream_st *)s));
  gpuipc_status st;
  uint64_t last = 1;
  for (;;) {
    gpuipc_tset_version *v = NULL;
    st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
    if (st != GPUIPC_OK)
      break;
    ASSERT_GT(gpuipc_tset_version_get_number(v), last);
    last = gpuipc_tset_version_get_number(v);
    check_version(v, &sp, s);
    ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  }
  ASSERT_STATUS(st, GPUIPC_E_CANCELED);
  if (strstr(gpuipc_last_error(), "hold limit") == NULL)
    harness_fail(__FILE__, __LINE__, "the END does not say why: %s",
                 gpuipc_last_error());
  say(c, "released");
  gpuipc_tset_version *none = NULL;
  st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &none);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  spec_free(&sp);
  return 0;
}

static size_t arena_blocks(gpuipc_arena *a, size_t *deferred) {
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  if (deferred)
    *deferred = st.blocks_deferred;
  return st.blocks_allocated;
}

/* An honest consumer and one that stops releasing after version 1: the
 * producer publishes 6 versions without stalling; the honest one gets
 * every version, in order, data checked; the stuck one is dropped and
 * its copies retired (one per copy of the set: 2 blocks each), its
 * version 1 left as it was; its memory returns once it releases. */
static int run_stuck(int copies) {
  REQUIRE_DEVICES(1);
  int fdh, fds;
  pid_t ph = spawn_helper("ts_consumer", NULL, &fdh, "small", "6", "check",
                          "ready", NULL);
  pid_t ps = spawn_helper("ts_stuck", NULL, &fds, "release", NULL);
  gpuipc_conn *ch = pair_conn(fdh), *cs = pair_conn(fds);
  /* The honest consumer's CUDA start (seconds under a sanitizer on a
   * loaded machine) must not count against the hold limit of version 1:
   * it could still be starting when the limit passed, and be dropped. */
  hear(ch, "ready");
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.copies = copies;
  o.arena = a;
  o.timeout_ms = 30000;
  o.hold_ms = 3000; /* an honest consumer on a loaded machine releases well within it */
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  size_t base = arena_blocks(a, NULL); /* pieces, tokens, the END block */
  ASSERT_EQ(base, 2 * (size_t)copies + 1);
  ASSERT_OK(gpuipc_tset_subscribe(set, ch, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_tset_subscribe(set, cs, (struct CUstream_st *)s));
  produce(set, NULL, 1, s);
  hear(cs, "got");
  uint64_t t0 = gpuipc__now_ns();
  produce(set, NULL, 5, s); /* would time out after 30 s if it stalled */
  uint64_t ms = (gpuipc__now_ns() - t0) / 1000000u;
  if (ms > 10000)
    harness_fail(__FILE__, __LINE__, "5 versions took %llu ms",
                 (unsigned long long)ms);
  hear(ch, "ok");
  ASSERT_EQ(arena_blocks(a, NULL), base + 2 * (size_t)copies);
  ASSERT_OK(gpuipc_tset_unsubscribe(set, ch));
  say(cs, "check");
  hear(cs, "same");
  hear(cs, "released");
  /* Its releases come in with the set's next calls; the retired copies
   * go back. */
  for (int i = 0; i < 500 && arena_blocks(a, NULL) != base; i++) {
    produce(set, NULL, 1, s);
    usleep(10000);
  }
  ASSERT_EQ(arena_blocks(a, NULL), base);
  gpuipc_status st = gpuipc_tset_unsubscribe(set, cs);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_NOT_FOUND);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  arena_empty(a);
  gpuipc_conn_close(ch);
  gpuipc_conn_close(cs);
  ASSERT_EQ(wait_helper(ph, 120), 0);
  ASSERT_EQ(wait_helper(ps, 120), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

TEST_IMPL(sets_stuck_consumer_does_not_stall) {
  return run_stuck(1);
}

TEST_IMPL(sets_stuck_consumer_double_buffered) {
  return run_stuck(2);
}

/* An owned set of the spec "small" in arena a, with these limits. */
static gpuipc_tset *small_set(gpuipc_arena *a, int timeout_ms, int hold_ms,
                              int retired_max, spec_t *sp) {
  spec("small", sp);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.arena = a;
  o.timeout_ms = timeout_ms;
  o.hold_ms = hold_ms;
  o.retired_max = retired_max;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp->t, sp->n, &o, &set));
  return set;
}

/* The cap: with retired_max 0 a copy held past the hold limit cannot be
 * set aside: begin drops the holder and writes the copy in place (a fresh
 * token only: nothing waits for the holder), rather than fail. Then
 * unsubscribe completes (within the hold limit, the END being sent
 * already) though the consumer still holds version 1, later versions go
 * on, and the memory comes back when the consumer dies. */
TEST_IMPL(sets_stuck_consumer_cap_and_unsubscribe) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_stuck", NULL, &fd, "die", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_tset *set = small_set(a, 1000, 200, 0, &sp);
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, NULL, 1, s);
  hear(c, "got");
  produce(set, NULL, 1, s); /* in place: no piece set aside */
  ASSERT_EQ(arena_blocks(a, NULL), 4); /* piece, END block, token, old token */
  uint64_t t0 = gpuipc__now_ns();
  ASSERT_OK(gpuipc_tset_unsubscribe(set, c));
  ASSERT_LT((long long)((gpuipc__now_ns() - t0) / 1000000u), 900);
  ASSERT_EQ(gpuipc_tset_get_subscribers(set), 0);
  produce(set, NULL, 2, s);
  ASSERT_OK(gpuipc_tset_destroy(set));
  size_t deferred = 0;
  ASSERT_GT(arena_blocks(a, &deferred), 0);
  ASSERT_GT(deferred, 0);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  for (int i = 0; i < 1000 && arena_blocks(a, NULL) != 0; i++)
    (void)gpuipc_conn_progress(c, 10);
  arena_empty(a);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

/* Three consumers (one peer could connect three times) that each take the
 * latest version and hold it fill retired_max (2): the first two copies
 * are set aside, untouched; the third is written in place once its holder
 * is dropped, rather than every later begin failing with GPUIPC_E_BUSY.
 * An honest consumer that joins then gets every version, data checked. */
TEST_IMPL(sets_stuck_consumers_past_the_cap_written_in_place) {
  REQUIRE_DEVICES(1);
  CUstream s = mkstream();
  spec_t sp;
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  /* The honest consumer must read each version within the hold limit
   * (past it, its copy may be written in place, as the contract says):
   * 200 ms was too short for its checks on a GPU machine under a full
   * parallel suite. */
  gpuipc_tset *set = small_set(a, 6000, 1500, 2, &sp);
  size_t base = arena_blocks(a, NULL);
  int fd[3];
  pid_t pid[3];
  gpuipc_conn *c[3];
  for (int k = 0; k < 3; k++) {
    char first[8];
    snprintf(first, sizeof first, "%d", k + 1);
    pid[k] = spawn_helper("ts_stuck", NULL, &fd[k], "die", first, NULL);
    c[k] = pair_conn(fd[k]);
    /* A late joiner gets the latest version: k + 1 (none for the first). */
    ASSERT_OK(gpuipc_tset_subscribe(set, c[k], (struct CUstream_st *)s));
    if (k == 0)
      produce(set, NULL, 1, s);
    hear(c[k], "got");
    produce(set, NULL, 1, s); /* past the hold limit: its holder dropped */
  }
  /* Two copies set aside (piece and token each), the third's token. */
  ASSERT_EQ(arena_blocks(a, NULL), base + 5);
  produce(set, NULL, 2, s);
  int fdh;
  pid_t ph = spawn_helper("ts_consumer", NULL, &fdh, "small", "3", "late", "6",
                          "ready", "acks", NULL);
  gpuipc_conn *ch = pair_conn(fdh);
  /* Its CUDA start (seconds on a loaded GPU machine) must not count
   * against the hold limit of the copy it is about to be handed. */
  hear(ch, "ready");
  ASSERT_OK(gpuipc_tset_subscribe(set, ch, (struct CUstream_st *)s));
  /* Each next version only once it released the one before (its "rel"):
   * its first import and checks (seconds under a sanitizer on a loaded
   * machine) never meet the 1.5 s hold limit in a begin, which would
   * drop it. */
  for (int k = 0; k < 2; k++) {
    hear(ch, "rel");
    produce(set, NULL, 1, s);
  }
  hear(ch, "rel");
  hear(ch, "ok");
  /* The copies set aside were not written. */
  for (int k = 0; k < 2; k++) {
    say(c[k], "check");
    hear(c[k], "same");
  }
  ASSERT_OK(gpuipc_tset_unsubscribe(set, ch));
  for (int k = 0; k < 3; k++) {
    kill(pid[k], SIGKILL);
    ASSERT_EQ(wait_helper(pid[k], 60), 128 + SIGKILL);
  }
  for (int i = 0; i < 1000 && arena_blocks(a, NULL) != base; i++) {
    for (int k = 0; k < 3; k++)
      (void)gpuipc_conn_progress(c[k], 1);
    produce(set, NULL, 1, s);
  }
  ASSERT_EQ(arena_blocks(a, NULL), base);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  arena_empty(a);
  for (int k = 0; k < 3; k++)
    gpuipc_conn_close(c[k]);
  gpuipc_conn_close(ch);
  ASSERT_EQ(wait_helper(ph, 120), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

/* A late joiner's hold limit counts from when subscribe hands it the
 * latest version, not from that version's publish: joining 3.1 s after
 * the publish, with a 3 s limit, it still holds its copy, so the begin
 * that needs the copy waits (here: times out, 0.5 s) rather than write
 * over it at once; past the limit from its hand-out the copy is retired
 * (set aside, untouched) as for any holder. */
TEST_IMPL(sets_late_joiner_holds_from_its_hand_out) {
  REQUIRE_DEVICES(1);
  CUstream s = mkstream();
  spec_t sp;
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_tset *set = small_set(a, 500, 3000, 2, &sp);
  produce(set, NULL, 1, s); /* version 1 (one copy) */
  usleep(3100 * 1000);
  int fd;
  pid_t pid = spawn_helper("ts_stuck", NULL, &fd, "die", "1", "ready", NULL);
  gpuipc_conn *c = pair_conn(fd);
  /* Its CUDA start (seconds on a loaded GPU machine) is not its hold. */
  hear(c, "ready");
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  /* Its hold starts at the hand-out, in subscribe: begin at once, before
   * its "got" (which it says once it took and checked the version). Had
   * the begin waited for the "got", the consumer's import and checks
   * (seconds under a sanitizer on a loaded machine) would also have had
   * to fit in the 2.5 s left of the limit. It holds the copy from here
   * whether or not it has taken it yet ("die" mode never releases). */
  int copy = -1;
  gpuipc_status st = gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy);
  if (st != GPUIPC_E_TIMEOUT)
    harness_fail(__FILE__, __LINE__, "begin on the late joiner's copy: %s "
                 "(copy %d), want GPUIPC_E_TIMEOUT: the copy it was just "
                 "handed counted as held past the limit", gpuipc_status_name(st),
                 copy);
  ASSERT_NOT_NULL(strstr(gpuipc_last_error(), "still held"));
  hear(c, "got");
  for (int i = 0; i < 40 && st == GPUIPC_E_TIMEOUT; i++)
    st = gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy);
  ASSERT_OK(st);
  ASSERT_EQ(copy, 0);
  ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  say(c, "check"); /* set aside: what it holds was not written */
  hear(c, "same");
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  for (int i = 0; i < 1000 && arena_blocks(a, NULL) != 0; i++)
    (void)gpuipc_conn_progress(c, 10);
  arena_empty(a);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

/* destroy with a subscriber that holds version 1: it completes after the
 * hold limit; the memory is not reused while held (a block allocated
 * after it and written does not show in the consumer's version 1); it
 * comes back when the consumer dies. */
TEST_IMPL(sets_stuck_consumer_destroy) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_stuck", NULL, &fd, "die", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.arena = a;
  o.timeout_ms = 30000;
  o.hold_ms = 300;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  size_t piece = owned_bytes(set);
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, NULL, 1, s);
  hear(c, "got");
  uint64_t t0 = gpuipc__now_ns();
  ASSERT_OK(gpuipc_tset_destroy(set));
  ASSERT_LT((long long)((gpuipc__now_ns() - t0) / 1000000u), 10000);
  size_t deferred = 0;
  ASSERT_GT(arena_blocks(a, &deferred), 0);
  ASSERT_GT(deferred, 0);
  gpuipc_block *b[4];
  for (int i = 0; i < 4; i++) {
    ASSERT_OK(gpuipc_arena_alloc(a, piece, (struct CUstream_st *)s, &b[i]));
    ASSERT_CU(gpuipc__cu.cuMemsetD8Async(
        (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b[i]), 0xEE, piece, s));
  }
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  say(c, "check");
  hear(c, "same");
  for (int i = 0; i < 4; i++)
    ASSERT_OK(gpuipc_block_free(b[i], NULL));
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  for (int i = 0; i < 1000 && arena_blocks(a, NULL) != 0; i++)
    (void)gpuipc_conn_progress(c, 10);
  arena_empty(a);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

/* A wrapped set (each tensor its own allocation) with an honest consumer
 * and one that stops releasing: begin does not wait past the hold limit,
 * the stuck one is dropped (told why), the honest one gets both versions;
 * once the stuck one released, unsubscribe and destroy complete. */
TEST_IMPL(sets_stuck_consumer_wrapped) {
  REQUIRE_DEVICES(1);
  int fdh, fds;
  pid_t ph = spawn_helper("ts_consumer", NULL, &fdh, "small", "2", "check",
                          "ready", NULL);
  pid_t ps = spawn_helper("ts_stuck", NULL, &fds, "wrapped", NULL);
  gpuipc_conn *ch = pair_conn(fdh), *cs = pair_conn(fds);
  /* Its CUDA start is not the honest consumer's hold (see run_stuck). */
  hear(ch, "ready");
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  CUdeviceptr mem[3];
  uint8_t *host = malloc(4096);
  ASSERT_NOT_NULL(host);
  for (size_t i = 0; i < sp.n; i++) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&mem[i], 4096));
    sp.t[i].ptr = (void *)(uintptr_t)mem[i];
  }
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.hold_ms = 3000; /* an honest consumer on a loaded machine releases well within it */
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, ch, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_tset_subscribe(set, cs, (struct CUstream_st *)s));
  for (uint64_t v = 1; v <= 2; v++) {
    int copy = -1;
    uint64_t t0 = gpuipc__now_ns();
    ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
    ASSERT_LT((long long)((gpuipc__now_ns() - t0) / 1000000u), 10000);
    for (size_t i = 0; i < sp.n; i++) {
      gpuipc_tensor t;
      ASSERT_OK(gpuipc_tset_get_tensor(set, 0, i, &t));
      for (size_t k = 0; k < t.nbytes; k++)
        host[k] = fill(i, v, k);
      ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(mem[i], host, t.nbytes, s));
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    }
    ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
    if (v == 1)
      hear(cs, "got");
  }
  hear(ch, "ok");
  ASSERT_OK(gpuipc_tset_unsubscribe(set, ch));
  say(cs, "check");
  hear(cs, "same");
  hear(cs, "released");
  ASSERT_OK(gpuipc_tset_unsubscribe(set, cs));
  ASSERT_EQ(gpuipc_tset_get_subscribers(set), 0);
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(ch);
  gpuipc_conn_close(cs);
  ASSERT_EQ(wait_helper(ph, 120), 0);
  ASSERT_EQ(wait_helper(ps, 120), 0);
  for (size_t i = 0; i < sp.n; i++)
    ASSERT_CU(gpuipc__cu.cuMemFree(mem[i]));
  free(host);
  spec_free(&sp);
  return 0;
}

/* A consumer whose release never completes on its GPU: it takes version
 * 1, checks it and releases it on a stream whose earlier work never ends
 * (a wait for a word nobody writes), says "released", then takes what
 * comes until the producer's END, which must say it was dropped for
 * holding, says "dropped" and waits to be killed. */
HELPER_IMPL(ts_hung_release) {
  spec_t sp;
  spec("small", &sp);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream(), hung = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  gpuipc_tset_version *v = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  check_version(v, &sp, s);
  /* Stream memory operations need cuMemAlloc (or VMM) memory. */
  CUdeviceptr never;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&never, 256));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(never, 0, 256));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(hung, never, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)hung));
  say(c, "released");
  gpuipc_status st;
  for (;;) {
    v = NULL;
    st = gpuipc_tset_recv(sub, (struct CUstream_st *)hung, &v);
    if (st != GPUIPC_OK)
      break;
    ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)hung));
  }
  ASSERT_STATUS(st, GPUIPC_E_CANCELED);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "hold limit");
  say(c, "dropped");
  for (;;)
    pause();
}

/* An honest consumer and one whose release of version 1 never completes
 * on its GPU: the producer's begin does not order its stream behind that
 * release (which would stall the producer and, through it, the honest
 * consumer until the other one dies); past the hold limit the copy counts
 * as held: it is retired (kept, untouched, while the release may still
 * run) and the stuck consumer is dropped. The honest one gets every
 * version, data checked; the retired copy comes back once the stuck one
 * is gone. */
TEST_IMPL(sets_hung_release_does_not_stall) {
  REQUIRE_DEVICES(1);
  int fdh, fds;
  pid_t ph = spawn_helper("ts_consumer", NULL, &fdh, "small", "6", "check",
                          "ready", NULL);
  pid_t ps = spawn_helper("ts_hung_release", NULL, &fds, NULL);
  gpuipc_conn *ch = pair_conn(fdh), *cs = pair_conn(fds);
  /* Its CUDA start is not the honest consumer's hold (see run_stuck). */
  hear(ch, "ready");
  CUstream s = mkstream();
  spec_t sp;
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  /* An honest consumer on a loaded machine releases well within 3 s. */
  gpuipc_tset *set = small_set(a, 30000, 3000, 2, &sp);
  size_t base = arena_blocks(a, NULL);
  ASSERT_OK(gpuipc_tset_subscribe(set, ch, (struct CUstream_st *)s));
  ASSERT_OK(gpuipc_tset_subscribe(set, cs, (struct CUstream_st *)s));
  produce(set, NULL, 1, s);
  hear(cs, "released");
  produce(set, NULL, 5, s);
  /* Stalled behind the stuck release, the honest consumer would not get
   * its versions before this connection's timeout. */
  ASSERT_OK(gpuipc_conn_set_timeout(ch, 20000));
  hear(ch, "ok");
  hear(cs, "dropped");
  ASSERT_EQ(arena_blocks(a, NULL), base + 2); /* the retired copy, kept */
  ASSERT_OK(gpuipc_tset_unsubscribe(set, ch));
  kill(ps, SIGKILL);
  ASSERT_EQ(wait_helper(ps, 60), 128 + SIGKILL);
  /* Its death unblocks the release; the set's next calls free the copy. */
  for (int i = 0; i < 1000 && arena_blocks(a, NULL) != base; i++) {
    (void)gpuipc_conn_progress(cs, 10);
    produce(set, NULL, 1, s);
  }
  ASSERT_EQ(arena_blocks(a, NULL), base);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  arena_empty(a);
  gpuipc_conn_close(ch);
  gpuipc_conn_close(cs);
  ASSERT_EQ(wait_helper(ph, 120), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

/* A producer whose "new piece" messages (REPLACE) lie, after an honest
 * set's version 1: each is refused, then an honest version 2 comes. */
HELPER_IMPL(ts_replace_producer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.arena = a;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, NULL, 1, s);
  hear(c, "v1");
  uint64_t lid = gpuipc_tset_get_layout(set);
  gpuipc_block *big = NULL, *small = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, owned_bytes(set) + 4096, NULL, &big));
  ASSERT_OK(gpuipc_arena_alloc(a, 256, NULL, &small));
  struct { uint16_t kind; uint64_t lid, a; uint32_t b, c; bool short_piece; } bad[] = {
      {GPUIPC__TSET_REPLACE, 0, 0, 1, 1, false},   /* another layout */
      {GPUIPC__TSET_REPLACE, 1, 1, 1, 1, false},   /* copy 1 of 1 */
      {GPUIPC__TSET_REPLACE, 1, 0, 2, 1, false},   /* 2 pieces in all */
      {GPUIPC__TSET_REPLACE, 1, 0, 1, 0, false},   /* generation 0 */
      {GPUIPC__TSET_REPLACE, 1, 0, 1, 1, true},    /* shorter than the piece */
      {GPUIPC__TSET_REPLACE + 1, 1, 0, 1, 1, false}, /* an unknown kind */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint8_t meta[GPUIPC__TSET_META_LEN];
    gpuipc__tset_meta m = {bad[i].kind, bad[i].lid ? lid : lid + 1, bad[i].a,
                           bad[i].b, bad[i].c};
    gpuipc__tset_meta_encode(&m, meta);
    ASSERT_OK(gpuipc_conn_send(c, bad[i].short_piece ? small : big,
                               (struct CUstream_st *)s, meta, sizeof meta));
  }
  produce(set, NULL, 1, s);
  hear(c, "ok");
  blocks_back(c, big, small);
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  return 0;
}

TEST_IMPL(sets_hostile_replace_refused) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_replace_producer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset_version *v = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  check_version(v, &sp, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "v1");
  for (int i = 0; i < 6; i++) {
    v = NULL;
    gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
    if (st != GPUIPC_E_PROTOCOL)
      harness_fail(__FILE__, __LINE__, "hostile REPLACE %d: %s (%s), want "
                   "GPUIPC_E_PROTOCOL", i, gpuipc_status_name(st),
                   gpuipc_last_error());
    ASSERT_NULL(v);
    size_t here = 99;
    ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
    ASSERT_EQ(here, 1); /* the layout's piece only: nothing of it kept */
  }
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  ASSERT_UEQ(gpuipc_tset_version_get_number(v), 2);
  check_version(v, &sp, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "ok");
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_CANCELED);
  gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&sp);
  return 0;
}

/* ---- a hostile producer ----------------------------------------------------------------- */

/* Sends, for each hostile table, the table, its pieces and a version;
 * then a valid set's version. Pieces are 64 KiB blocks except for "short"
 * (index H_N), whose table wants more than its piece has. */
HELPER_IMPL(ts_hostile_producer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)4 << 20);
  gpuipc_block *blk = NULL, *tok = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 65536, NULL, &blk));
  ASSERT_OK(gpuipc_arena_alloc(a, 256, NULL, &tok));
  for (int h = 0; h <= H_N; h++) {
    uint64_t layout = 1000 + (uint64_t)h;
    size_t len = 0;
    uint8_t *b;
    if (h < H_N) {
      b = hostile_table(h, layout, &len);
    } else {
      gpuipc__tset_table t;
      table_of("small", &t);
      t.layout_id = layout;
      t.piece_len[0] = 1 << 20; /* the block has 64 KiB */
      ASSERT_OK(gpuipc__tset_table_encode(&t, &b, &len));
      gpuipc__tset_table_free(&t);
    }
    static uint8_t msg[GPUIPC_CONN_MSG_MAX];
    memset(msg, 0, GPUIPC__TSET_CHUNK_HDR);
    le64(msg, GPUIPC__TSET_CHUNK_MAGIC);
    le64(msg + 8, layout);
    memcpy(msg + GPUIPC__TSET_CHUNK_HDR, b, len);
    ASSERT_OK(gpuipc_conn_send_msg(c, msg, GPUIPC__TSET_CHUNK_HDR + len, NULL, 0));
    uint8_t meta[GPUIPC__TSET_META_LEN];
    gpuipc__tset_meta m = {GPUIPC__TSET_PIECE, layout, 0, 1, (uint32_t)len};
    gpuipc__tset_meta_encode(&m, meta);
    ASSERT_OK(gpuipc_conn_send(c, blk, (struct CUstream_st *)s, meta, sizeof meta));
    m = (gpuipc__tset_meta){GPUIPC__TSET_VERSION_TOKEN, layout, 1, 0, 0};
    gpuipc__tset_meta_encode(&m, meta);
    ASSERT_OK(gpuipc_conn_send(c, tok, (struct CUstream_st *)s, meta, sizeof meta));
    free(b);
  }
  /* Then an honest set. */
  honest_version(c, s, "ok");
  /* Everything of the hostile layouts was released. */
  blocks_back(c, blk, tok);
  ASSERT_OK(gpuipc_arena_destroy(a));
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(sets_hostile_tables_refused) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_hostile_producer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  for (int h = 0; h <= H_N; h++) {
    gpuipc_status want = h < H_N ? h_want[h] : GPUIPC_E_OUT_OF_RANGE;
    const char *what = h < H_N ? h_name[h] : "short piece";
    gpuipc_tset_version *v = NULL;
    /* Once for the table (at its first piece), once for its version. */
    for (int k = 0; k < 2; k++) {
      gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
      if (st != want)
        harness_fail(__FILE__, __LINE__, "hostile table '%s' (%s): %s, want %s "
                     "(%s)", what, k ? "its version" : "its table",
                     gpuipc_status_name(st), gpuipc_status_name(want),
                     gpuipc_last_error());
      ASSERT_NULL(v);
    }
    size_t here = 99;
    ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
    ASSERT_EQ(here, 0); /* nothing of it kept */
  }
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset_version *v = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  check_version(v, &sp, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "ok");
  /* END of the honest set, then the producer is gone. */
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_CANCELED);
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_PEER_GONE);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&sp);
  return 0;
}

/* ---- the sequence: half-sent layouts, version numbers ------------------------------------ */

/* A producer that leaves a table half sent (the first chunk of many),
 * then sends an honest set A's version 1; then versions of A forged with
 * numbers 5, 3 and 6; then, after A's END, a layout half sent (its table
 * and one piece of two), then an honest set B's version 1. */
HELPER_IMPL(ts_sequence_producer) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc__tset_table t;
  table_of("10k", &t);
  size_t len = 0;
  send_chunk0(c, &t, &len);
  ASSERT_GT(len, GPUIPC__TSET_CHUNK_DATA); /* more chunks were due */
  gpuipc__tset_table_free(&t);
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, NULL, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, c, 1, s);
  hear(c, "a1");
  gpuipc_block *tok = NULL, *blk = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 256, NULL, &tok));
  uint64_t forged[] = {5, 3, 6};
  for (int i = 0; i < 3; i++) {
    uint8_t meta[GPUIPC__TSET_META_LEN];
    gpuipc__tset_meta m = {GPUIPC__TSET_VERSION_TOKEN,
                           gpuipc_tset_get_layout(set), forged[i], 0, 0};
    gpuipc__tset_meta_encode(&m, meta);
    ASSERT_OK(gpuipc_conn_send(c, tok, (struct CUstream_st *)s, meta, sizeof meta));
  }
  hear(c, "forged");
  ASSERT_OK(gpuipc_tset_destroy(set));
  blk = send_half_layout(c, a, 0x777);
  honest_version(c, s, "b1");
  blocks_back(c, blk, tok);
  ASSERT_OK(gpuipc_arena_destroy(a));
  gpuipc_conn_close(c);
  spec_free(&sp);
  return 0;
}

static gpuipc_tset_version *recv_checked(gpuipc_tset_sub *sub, const spec_t *sp,
                                         uint64_t number, CUstream s) {
  gpuipc_tset_version *v = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  ASSERT_UEQ(gpuipc_tset_version_get_number(v), number);
  if (sp)
    check_version(v, sp, s);
  return v;
}

/* A new layout's first piece (or a new table's first chunk) starts a new
 * layout, abandoning one left half sent (whose piece is released), where
 * the whole next layout used to be refused; a version whose number does
 * not grow is refused with GPUIPC_E_PROTOCOL, saying so, and the layout
 * goes on (a later, larger number is accepted). */
TEST_IMPL(sets_sequence_half_sent_and_versions_that_do_not_grow) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_sequence_producer", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  spec_t sp;
  spec("small", &sp);
  gpuipc_tset_version *v = recv_checked(sub, &sp, 1, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "a1");
  v = recv_checked(sub, NULL, 5, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  v = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_PROTOCOL);
  ASSERT_NULL(v);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "must grow");
  v = recv_checked(sub, NULL, 6, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "forged");
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_CANCELED);
  v = recv_checked(sub, &sp, 1, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  size_t here = 99;
  ASSERT_OK(gpuipc_conn_get_outstanding(c, NULL, &here));
  ASSERT_EQ(here, 1); /* B's piece: the half layout's was released */
  say(c, "b1");
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_CANCELED);
  gpuipc_status st = gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v);
  ASSERT(st == GPUIPC_E_PEER_GONE || st == GPUIPC_E_CLOSED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&sp);
  return 0;
}

/* ---- one deadline per call ------------------------------------------------------------- */

/* A producer that keeps sending what a consumer skips (END of a layout it
 * never sent), every few ms, until it hears "stop" (or 20 s passed); then
 * an honest set's version 1. */
HELPER_IMPL(ts_end_flood) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *blk = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 256, NULL, &blk));
  uint8_t meta[GPUIPC__TSET_META_LEN];
  gpuipc__tset_meta m = {GPUIPC__TSET_END, 0x5eed, 0, 0, 0};
  gpuipc__tset_meta_encode(&m, meta);
  uint64_t until = gpuipc__now_ns() + 20000ull * 1000000u;
  size_t msgs = 0;
  while (msgs == 0 && gpuipc__now_ns() < until) {
    ASSERT_OK(gpuipc_conn_send(c, blk, (struct CUstream_st *)s, meta, sizeof meta));
    ASSERT_OK(gpuipc_conn_progress(c, 20));
    gpuipc__conn_queued(c, &msgs, NULL, NULL, NULL);
  }
  if (msgs)
    hear(c, "stop");
  honest_version(c, s, "ok");
  blocks_back(c, blk, NULL);
  ASSERT_OK(gpuipc_arena_destroy(a));
  gpuipc_conn_close(c);
  return 0;
}

/* gpuipc_tset_recv keeps one deadline for the call: while the producer
 * keeps sending what it skips, it returns GPUIPC_E_TIMEOUT after the
 * connection's timeout (500 ms) instead of taking a fresh one per skipped
 * buffer (which would skip the flood's 20 s and return its version). The
 * connection's timeout is its own again after the call; the next call
 * gets the honest version. */
TEST_IMPL(sets_recv_one_deadline_while_skipping) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_end_flood", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 500));
  gpuipc_tset_version *v = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_TIMEOUT);
  ASSERT_NULL(v);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "500 ms");
  say(c, "stop");
  /* The connection's own timeout was given back: a wait of the honest
   * set's version (behind what the flood left) succeeds. */
  ASSERT_OK(gpuipc_conn_set_timeout(c, 30000));
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  spec_t sp;
  spec("small", &sp);
  check_version(v, &sp, s);
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "ok");
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v),
                GPUIPC_E_CANCELED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  spec_free(&sp);
  return 0;
}

/* ---- the benchmark runs ---------------------------------------------------------------- */

TEST_IMPL(sets_bench_quick_runs) {
  REQUIRE_EMULATOR("a GPU run of the benchmark belongs to make gpu-bench");
  char *argv[] = {GPUIPC_CLI_PATH, "bench", "sets", "--quick", "--emulator",
                  (char *)harness_emulator_path(), NULL};
  static char out[16384];
  ASSERT_EQ(harness_run(argv, NULL, out, sizeof out), 0);
  ASSERT_STR_CONTAINS(out, "copy_into the consumer's own tensors");
  ASSERT_STR_CONTAINS(out, "zero-copy: publish to usable views");
  ASSERT_STR_CONTAINS(out, "KV cache blocks as one set");
  ASSERT_STR_CONTAINS(out, "in-process batched copy, cuMemcpyBatchAsync");
  /* The rows of 1,000 and 10,000 blocks of 4 KiB. */
  ASSERT_STR_CONTAINS(out, "\n      1000        4 ");
  ASSERT_STR_CONTAINS(out, "\n     10000        4 ");
  return 0;
}

/* examples/weight_sync.c, run as built beside the CLI. */
TEST_IMPL(sets_example_weight_sync) {
  REQUIRE_DEVICES(1);
  char path[4096];
  snprintf(path, sizeof path, "%s", GPUIPC_CLI_PATH);
  char *slash = strrchr(path, '/');
  ASSERT_NOT_NULL(slash);
  snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path),
           "examples/weight_sync");
  if (access(path, X_OK) != 0)
    SKIP("%s not built", path);
  static char out[16384];
  char *argv[] = {path, "6", NULL};
  ASSERT_EQ(harness_run(argv, NULL, out, sizeof out), 0);
  ASSERT_STR_CONTAINS(out, "engine: version 6, last tensor[0] = 608 (want 608)");
  ASSERT_STR_CONTAINS(out, "trainer: step 6 published in copy 1");
  ASSERT_STR_CONTAINS(out, "trainer: engine exit code 0");
  return 0;
}

/* copy_from / copy_into issue one copy per run of ranges contiguous on
 * both sides inside one allocation each: the emulator fails the second
 * cuMemcpyDtoDAsync of the process, so the packed copy (one call) passes
 * and the copy from three separate allocations (three calls) fails. The
 * per-range way is forced (the batched copy would take the three in one
 * call: sets_copy_batched). */
TEST_IMPL(sets_copy_coalesces) {
  REQUIRE_EMULATOR("counts driver calls with GPUIPC_EMU_FAIL");
  setenv("GPUIPC_EMU_FAIL", "cuMemcpyDtoDAsync:2", 1);
  REQUIRE_DEVICES(1);
  gpuipc__tset_copy_kernel = 0;
  gpuipc__tset_copy_batch = 0;
  CUstream s = mkstream();
  spec_t sp;
  spec("small", &sp);
  for (size_t i = 0; i < sp.n; i++)
    sp.shape[i][0] = 1024; /* multiples of the alignment: packed */
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.align = 16;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  CUdeviceptr one, sep[3];
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&one, 3 * 1024));
  uint8_t host[3 * 1024], back[3 * 1024];
  for (size_t k = 0; k < sizeof host; k++)
    host[k] = (uint8_t)(k * 7 + 1);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(one, host, sizeof host));
  void *srcs[3];
  for (int i = 0; i < 3; i++)
    srcs[i] = (void *)(uintptr_t)(one + 1024 * (CUdeviceptr)i);
  ASSERT_OK(gpuipc_tset_copy_from(set, 0, srcs, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_tensor t;
  ASSERT_OK(gpuipc_tset_get_tensor(set, 0, 0, &t));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, (CUdeviceptr)(uintptr_t)t.ptr,
                                    sizeof back));
  ASSERT_MEM_EQ(back, host, sizeof host);
  for (int i = 0; i < 3; i++) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&sep[i], 1024));
    srcs[i] = (void *)(uintptr_t)sep[i];
  }
  ASSERT_STATUS(gpuipc_tset_copy_from(set, 0, srcs, (struct CUstream_st *)s),
                GPUIPC_E_DRIVER);
  /* The process's second call: the first range of three. */
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "range 0 of 3");
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  for (int i = 0; i < 3; i++)
    ASSERT_CU(gpuipc__cu.cuMemFree(sep[i]));
  ASSERT_CU(gpuipc__cu.cuMemFree(one));
  spec_free(&sp);
  return 0;
}

/* ---- a piece above 4 GiB ------------------------------------------------------------- */

/* The consumer of sets_owned_piece_above_4gib: the small tensor after the
 * big one whole, and the big one's first and last bytes. */
HELPER_IMPL(ts_huge) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  gpuipc_tset_version *v = NULL;
  ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_tensor big, tail;
  ASSERT_OK(gpuipc_tset_version_get_tensor(v, 0, &big));
  ASSERT_OK(gpuipc_tset_version_get_tensor(v, 1, &tail));
  uint8_t ends[2], t[4096];
  ASSERT_EQ(tail.nbytes, sizeof t);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(&ends[0], (CUdeviceptr)(uintptr_t)big.ptr, 1));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(
      &ends[1], (CUdeviceptr)(uintptr_t)big.ptr + big.nbytes - 1, 1));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(t, (CUdeviceptr)(uintptr_t)tail.ptr, sizeof t));
  ASSERT_EQ(ends[0], 0x5A);
  ASSERT_EQ(ends[1], 0xA5);
  for (size_t k = 0; k < sizeof t; k++)
    if (t[k] != fill(1, 1, k))
      harness_fail(__FILE__, __LINE__, "tail byte %zu: %u, want %u", k, t[k],
                   fill(1, 1, k));
  ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
  say(c, "ok");
  gpuipc_tset_version *end = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &end),
                GPUIPC_E_CANCELED);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  return 0;
}

/* An owned set of 5 GiB (its own arena, one piece) reaches a consumer
 * process whole. A mempool allocation that large did not import in
 * another process on an H200 (the driver call did not return): an arena
 * keeps such a chunk in VMM memory. GPU only: on the emulator device
 * memory is this machine's host memory. */
TEST_IMPL(sets_owned_piece_above_4gib) {
  REQUIRE_DEVICES(1);
  if (harness_on_emulator())
    SKIP("5 GiB of device memory: on the emulator that is host memory; "
         "runs under make gpu-test");
  int fd;
  pid_t pid = spawn_helper("ts_huge", NULL, &fd, NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  int64_t big_n = (int64_t)5 << 30, tail_n = 4096;
  gpuipc_tensor ts[2] = {
      {"big", GPUIPC_DTYPE_U8, 1, &big_n, NULL, NULL, 0},
      {"tail", GPUIPC_DTYPE_U8, 1, &tail_n, NULL, NULL, 0},
  };
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.timeout_ms = 60000;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(ts, 2, &o, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  int copy = -1;
  ASSERT_OK(gpuipc_tset_begin(set, (struct CUstream_st *)s, &copy));
  gpuipc_tensor big, tail;
  ASSERT_OK(gpuipc_tset_get_tensor(set, copy, 0, &big));
  ASSERT_OK(gpuipc_tset_get_tensor(set, copy, 1, &tail));
  ASSERT_EQ(big.nbytes, (size_t)big_n);
  uint8_t t[4096];
  for (size_t k = 0; k < sizeof t; k++)
    t[k] = fill(1, 1, k);
  CUdeviceptr b = (CUdeviceptr)(uintptr_t)big.ptr;
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(b, 0x5A, 1, s));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(b + big.nbytes - 1, 0xA5, 1, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)tail.ptr, t, sizeof t));
  ASSERT_OK(gpuipc_tset_publish(set, (struct CUstream_st *)s));
  hear(c, "ok");
  ASSERT_OK(gpuipc_tset_unsubscribe(set, c));
  ASSERT_EQ(wait_helper(pid, 120), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c);
  return 0;
}

/* The mechanism behind it, at a limit lowered to 1 MiB (so that it runs on
 * the emulator too): an arena's chunk within the limit is mempool memory,
 * the chunk a 2 MiB piece needs is VMM memory, and the set's versions reach
 * a consumer process whole, data checked. */
TEST_IMPL(sets_piece_above_the_mempool_limit_is_vmm) {
  REQUIRE_DEVICES(1);
  size_t saved = gpuipc__arena_mempool_max;
  gpuipc__arena_mempool_max = (size_t)1 << 20;
  int fd;
  pid_t pid = spawn_helper("ts_consumer", NULL, &fd, "big", "2", "check", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec("big", &sp);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.arena = a;
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, &o, &set));
  ASSERT_EQ(gpuipc__arena_chunk_kind(a, 0), GPUIPC_POOL_MEMPOOL);
  ASSERT_EQ(gpuipc__arena_chunk_kind(a, 1), GPUIPC_POOL_VMM);
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, c, 2, s);
  hear(c, "ok");
  ASSERT_OK(gpuipc_tset_unsubscribe(set, c));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  arena_empty(a);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  spec_free(&sp);
  gpuipc__arena_mempool_max = saved;
  return 0;
}

/* ---- whole-set copies as one batch ---------------------------------------------------- */

/* copy_from of the 10,000 tensors of "10k" from sources 64 bytes apart in
 * one allocation, shuffled (no two ranges merge): fills the sources with
 * pattern `seed`, copies on s, reads the set's copy 0 back whole and checks
 * every tensor; checks the calls the copy made. */
static void copy_round(gpuipc_tset *set, CUdeviceptr base, const size_t *perm,
                       uint32_t seed, CUstream s, uint64_t want_batches,
                       uint64_t want_singles) {
  size_t n = gpuipc_tset_get_count(set);
  size_t span = n * 64;
  uint8_t *host = malloc(span);
  ASSERT_NOT_NULL(host);
  for (size_t k = 0; k < span; k++)
    host[k] = (uint8_t)(k * 29 + seed + (k >> 9));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(base, host, span));
  void **srcs = malloc(n * sizeof *srcs);
  ASSERT_NOT_NULL(srcs);
  for (size_t i = 0; i < n; i++)
    srcs[i] = (void *)(uintptr_t)(base + (CUdeviceptr)perm[i] * 64);
  uint64_t b0 = atomic_load(&gpuipc__tset_copy_batches);
  uint64_t s0 = atomic_load(&gpuipc__tset_copy_singles);
  ASSERT_OK(gpuipc_tset_copy_from(set, 0, srcs, (struct CUstream_st *)s));
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_batches) - b0, want_batches);
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_singles) - s0, want_singles);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s ? s : NULL));
  gpuipc_tensor first, last;
  ASSERT_OK(gpuipc_tset_get_tensor(set, 0, 0, &first));
  ASSERT_OK(gpuipc_tset_get_tensor(set, 0, n - 1, &last));
  size_t piece = (size_t)((uintptr_t)last.ptr + last.nbytes - (uintptr_t)first.ptr);
  uint8_t *back = malloc(piece);
  ASSERT_NOT_NULL(back);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, (CUdeviceptr)(uintptr_t)first.ptr, piece));
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_get_tensor(set, 0, i, &t));
    size_t off = (size_t)((uintptr_t)t.ptr - (uintptr_t)first.ptr);
    if (memcmp(back + off, host + perm[i] * 64, t.nbytes) != 0)
      harness_fail(__FILE__, __LINE__, "tensor %zu of %zu (%zu bytes) differs "
                   "from its source", i, n, t.nbytes);
  }
  free(back);
  free(srcs);
  free(host);
}

/* Whether this driver takes the batched copy (CUDA 13.0's form). */
static bool driver_batches(void) {
  int v = 0;
  ASSERT_CU(gpuipc__cu.cuDriverGetVersion(&v));
  bool have = v >= 13000 && gpuipc__cu.cuMemcpyBatchAsync != NULL;
  printf("driver %d: %s\n", v, have ? "batched copies" : "no batched copy");
  return have;
}

static int copies_of_10k(bool want_batch) {
  REQUIRE_DEVICES(1);
  ASSERT_OK(gpuipc__driver());
  gpuipc__tset_copy_kernel = 0; /* the kernel would take these ranges */
  bool have = driver_batches();
  if (want_batch)
    ASSERT(have);
  CUstream s = mkstream();
  spec_t sp;
  spec("10k", &sp);
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, NULL, &set));
  size_t n = sp.n;
  size_t *perm = malloc(n * sizeof *perm);
  ASSERT_NOT_NULL(perm);
  for (size_t i = 0; i < n; i++)
    perm[i] = i;
  srand(27);
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = (size_t)rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  CUdeviceptr base;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&base, n * 64));
  /* 10,000 ranges: two batches (8,192 at most each), or one call each. */
  if (have)
    copy_round(set, base, perm, 1, s, 2, 0);
  else
    copy_round(set, base, perm, 1, s, 0, n);
  /* The per-range way forced: the same bytes. */
  gpuipc__tset_copy_batch = 0;
  copy_round(set, base, perm, 2, s, 0, n);
  gpuipc__tset_copy_batch = 1;
  /* The legacy NULL stream: the batch refuses it, so per range. */
  copy_round(set, base, perm, 3, NULL, 0, n);
  /* Sources that are the set's own tensors, one along: a destination meets
   * a source, and a batch's copies run in no given order, so per range. */
  void **own = malloc(n * sizeof *own);
  ASSERT_NOT_NULL(own);
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_get_tensor(set, 0, (i + 1) % n, &t));
    own[i] = t.ptr;
  }
  uint64_t b0 = atomic_load(&gpuipc__tset_copy_batches);
  ASSERT_OK(gpuipc_tset_copy_from(set, 0, own, (struct CUstream_st *)s));
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_batches) - b0, 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  free(own);
  ASSERT_OK(gpuipc_tset_destroy(set));
  ASSERT_CU(gpuipc__cu.cuMemFree(base));
  free(perm);
  spec_free(&sp);
  return 0;
}

/* A set's non-adjacent ranges (the gather kernel kept off) go to the
 * driver as batched copies where it has them (both drivers here: the H200's is 13.0), and per range where it
 * does not, where forced, on the legacy NULL stream and where ranges
 * overlap; the data is checked end to end each time. */
TEST_IMPL(sets_copy_batched) {
  return copies_of_10k(harness_on_emulator());
}

/* A driver without cuMemcpyBatchAsync (the emulator told to lack it, as a
 * driver before 12.8 does): every copy per range, the same bytes. */
TEST_IMPL(sets_copy_without_the_batched_call) {
  REQUIRE_EMULATOR("makes the emulator lack cuMemcpyBatchAsync");
  setenv("GPUIPC_EMU_DISABLE", "batch_copy", 1);
  ASSERT_OK(gpuipc__driver());
  ASSERT(gpuipc__cu.cuMemcpyBatchAsync == NULL);
  return copies_of_10k(false);
}

/* ---- whole-set copies through the gather kernel ---------------------------------------- */


typedef struct gather_fix {
  spec_t sp;
  gpuipc_tset *set;
  CUdeviceptr src;    /* the sources: one allocation, shuffled slots */
  size_t span;        /* its size */
  size_t *off;        /* tensor i's source offset */
  size_t shorts;      /* tensors below 1 MiB */
} gather_fix;

/* n indices 0..n-1 in an order of seed's. */
static size_t *shuffled(size_t n, unsigned seed) {
  size_t *p = malloc(n * sizeof *p);
  ASSERT_NOT_NULL(p);
  for (size_t i = 0; i < n; i++)
    p[i] = i;
  srand(seed);
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = (size_t)rand() % (i + 1), t = p[i];
    p[i] = p[j];
    p[j] = t;
  }
  return p;
}

/* Places GATHER_T tensors of spec "gather" in one allocation of *span
 * bytes: in a shuffled order with gaps between them, every third at a
 * 16-byte boundary and the others at odd offsets, so that no two ranges
 * merge and the kernel meets every alignment. off[i]: tensor i's offset. */
static void gather_slots(size_t *off, size_t *span, unsigned seed) {
  size_t *perm = shuffled(GATHER_T, seed);
  size_t at = 0;
  for (size_t k = 0; k < GATHER_T; k++) {
    size_t i = perm[k];
    at += 1 + (k % 5); /* a gap: never adjacent */
    if (k % 3 == 0)
      at = (at + 15) & ~(size_t)15;
    else if (at % 2 == 0)
      at++;
    off[i] = at;
    at += gather_size(i);
  }
  *span = at + 16;
  free(perm);
}

static size_t gather_shorts(void) {
  size_t n = 0;
  for (size_t i = 0; i < GATHER_T; i++)
    n += gather_size(i) < GPUIPC__GATHER_LEN_MAX;
  return n;
}

/* A set of spec "gather" (packed at 16 bytes) and its sources in one
 * allocation at gather_slots. */
static void gather_setup(gather_fix *f) {
  memset(f, 0, sizeof *f);
  spec("gather", &f->sp);
  f->shorts = gather_shorts();
  gpuipc_tset_options o = GPUIPC_TSET_OPTIONS_INIT;
  o.align = 16;
  ASSERT_OK(gpuipc_tset_create(f->sp.t, f->sp.n, &o, &f->set));
  f->off = malloc(GATHER_T * sizeof *f->off);
  ASSERT_NOT_NULL(f->off);
  gather_slots(f->off, &f->span, 25);
  ctx_current();
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&f->src, f->span));
}

static void gather_teardown(gather_fix *f) {
  ASSERT_OK(gpuipc_tset_destroy(f->set));
  ASSERT_CU(gpuipc__cu.cuMemFree(f->src));
  free(f->off);
  spec_free(&f->sp);
}

/* One whole-set copy of the fixture's sources (pattern `seed`) into the
 * set's copy 0 on s, its launches and calls counted: want_kernels launches
 * of the gather kernel, and at least the long tensors by the driver's
 * copies (all of them where want_kernels is 0). The set is read back and
 * every tensor compared byte for byte. */
static void gather_round(gather_fix *f, uint32_t seed, CUstream s,
                         uint64_t want_kernels) {
  uint8_t *host = malloc(f->span);
  ASSERT_NOT_NULL(host);
  for (size_t k = 0; k < f->span; k++)
    host[k] = (uint8_t)(k * 31 + seed + (k >> 11));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(f->src, host, f->span));
  void *srcs[GATHER_T];
  for (size_t i = 0; i < GATHER_T; i++)
    srcs[i] = (void *)(uintptr_t)(f->src + f->off[i]);
  uint64_t k0 = atomic_load(&gpuipc__tset_copy_kernels);
  uint64_t b0 = atomic_load(&gpuipc__tset_copy_batches);
  uint64_t s0 = atomic_load(&gpuipc__tset_copy_singles);
  ASSERT_OK(gpuipc_tset_copy_from(f->set, 0, srcs, (struct CUstream_st *)s));
  uint64_t kernels = atomic_load(&gpuipc__tset_copy_kernels) - k0;
  uint64_t batches = atomic_load(&gpuipc__tset_copy_batches) - b0;
  uint64_t singles = atomic_load(&gpuipc__tset_copy_singles) - s0;
  printf("seed %u: %llu kernel launches, %llu batches, %llu single copies\n",
         seed, (unsigned long long)kernels, (unsigned long long)batches,
         (unsigned long long)singles);
  ASSERT_UEQ(kernels, want_kernels);
  size_t longs = GATHER_T - f->shorts;
  if (want_kernels > 0)
    ASSERT(batches > 0 || singles == longs);
  else
    ASSERT(batches > 0 || singles == GATHER_T);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc_tensor first, last;
  ASSERT_OK(gpuipc_tset_get_tensor(f->set, 0, 0, &first));
  ASSERT_OK(gpuipc_tset_get_tensor(f->set, 0, GATHER_T - 1, &last));
  size_t piece = (size_t)((uintptr_t)last.ptr + last.nbytes - (uintptr_t)first.ptr);
  uint8_t *back = malloc(piece);
  ASSERT_NOT_NULL(back);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, (CUdeviceptr)(uintptr_t)first.ptr, piece));
  for (size_t i = 0; i < GATHER_T; i++) {
    gpuipc_tensor t;
    ASSERT_OK(gpuipc_tset_get_tensor(f->set, 0, i, &t));
    size_t off = (size_t)((uintptr_t)t.ptr - (uintptr_t)first.ptr);
    for (size_t k = 0; k < t.nbytes; k++)
      if (back[off + k] != host[f->off[i] + k]) {
        harness_fail(__FILE__, __LINE__, "seed %u: tensor %zu of %d (%zu "
                     "bytes, source offset %zu), byte %zu: %u, want %u", seed,
                     i, GATHER_T, t.nbytes, f->off[i], k, back[off + k],
                     host[f->off[i] + k]);
        break;
      }
  }
  free(back);
  free(host);
}

static uint64_t gather_chunks(const gather_fix *f) {
  return (f->shorts + GPUIPC__GATHER_N - 1) / GPUIPC__GATHER_N;
}

/* The consumer of sets_copy_into_gathered: each of argv[0] versions of
 * spec "gather" copied with copy_into into its own paged cache (one
 * allocation, the tensors at gather_slots: shuffled, odd offsets, gaps),
 * in ceil(n / 1360) launches of the gather kernel, the data checked byte
 * for byte against the producer's pattern. */
HELPER_IMPL(ts_gather_into) {
  ASSERT(argc >= 1);
  int count = atoi(argv[0]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_tset_sub *sub = NULL;
  ASSERT_OK(gpuipc_tset_sub_open(c, &sub));
  size_t *off = malloc(GATHER_T * sizeof *off), span = 0;
  void **dsts = malloc(GATHER_T * sizeof *dsts);
  ASSERT(off && dsts);
  uint64_t want = (gather_shorts() + GPUIPC__GATHER_N - 1) / GPUIPC__GATHER_N;
  for (int r = 0; r < count; r++) {
    gpuipc_tset_version *v = NULL;
    ASSERT_OK(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &v));
    uint64_t num = gpuipc_tset_version_get_number(v);
    ASSERT_EQ(gpuipc_tset_version_get_count(v), GATHER_T);
    gather_slots(off, &span, 40 + (unsigned)r);
    CUdeviceptr mine;
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&mine, span));
    ASSERT_CU(gpuipc__cu.cuMemsetD8(mine, 0, span));
    for (size_t i = 0; i < GATHER_T; i++)
      dsts[i] = (void *)(uintptr_t)(mine + off[i]);
    uint64_t k0 = atomic_load(&gpuipc__tset_copy_kernels);
    ASSERT_OK(gpuipc_tset_version_copy_into(v, dsts, (struct CUstream_st *)s));
    uint64_t kernels = atomic_load(&gpuipc__tset_copy_kernels) - k0;
    printf("version %llu: %llu kernel launches\n", (unsigned long long)num,
           (unsigned long long)kernels);
    ASSERT_UEQ(kernels, want);
    uint8_t *back = malloc(span);
    ASSERT_NOT_NULL(back);
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(back, mine, span, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    for (size_t i = 0; i < GATHER_T; i++)
      for (size_t k = 0; k < gather_size(i); k++)
        if (back[off[i] + k] != fill(i, num, k)) {
          harness_fail(__FILE__, __LINE__, "version %llu, tensor %zu (%zu "
                       "bytes at offset %zu), byte %zu: %u, want %u",
                       (unsigned long long)num, i, gather_size(i), off[i], k,
                       back[off[i] + k], fill(i, num, k));
          break;
        }
    free(back);
    ASSERT_OK(gpuipc_tset_version_release(v, (struct CUstream_st *)s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    ASSERT_CU(gpuipc__cu.cuMemFree(mine));
  }
  say(c, "ok");
  gpuipc_tset_version *end = NULL;
  ASSERT_STATUS(gpuipc_tset_recv(sub, (struct CUstream_st *)s, &end),
                GPUIPC_E_CANCELED);
  free(off);
  free(dsts);
  gpuipc_tset_sub_close(sub);
  gpuipc_conn_close(c);
  return 0;
}

/* copy_into of a set of 3,000 tensors of odd sizes (six past 1 MiB) into
 * a consumer process's paged cache (shuffled slots, odd alignments): the
 * gather kernel, the long ones by the driver's copies, two versions, data
 * checked byte for byte (ts_gather_into). */
TEST_IMPL(sets_copy_into_gathered) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ts_gather_into", NULL, &fd, "2", NULL);
  gpuipc_conn *c = pair_conn(fd);
  CUstream s = mkstream();
  spec_t sp;
  spec("gather", &sp);
  gpuipc_tset *set = NULL;
  ASSERT_OK(gpuipc_tset_create(sp.t, sp.n, NULL, &set));
  ASSERT_OK(gpuipc_tset_subscribe(set, c, (struct CUstream_st *)s));
  produce(set, c, 2, s);
  hear(c, "ok");
  ASSERT_OK(gpuipc_tset_unsubscribe(set, c));
  ASSERT_EQ(wait_helper(pid, 120), 0);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_OK(gpuipc_tset_destroy(set));
  gpuipc_conn_close(c);
  spec_free(&sp);
  return 0;
}

/* 3,000 non-adjacent tensors of odd sizes and alignments, shuffled: the
 * ones below 1 MiB in ceil(n / 1360) launches of the gather kernel, the
 * long ones by the driver's copies; on a stream, on the legacy NULL stream
 * (the kernel takes it, the batch does not), and with the kernel forced
 * off (the batched or per-range way, the same bytes). */
TEST_IMPL(sets_copy_gathered) {
  REQUIRE_DEVICES(1);
  ASSERT_OK(gpuipc__driver());
  gather_fix f;
  gather_setup(&f);
  CUstream s = mkstream();
  gather_round(&f, 1, s, gather_chunks(&f));
  gather_round(&f, 2, NULL, gather_chunks(&f));
  gpuipc__tset_copy_kernel = 0;
  gather_round(&f, 3, s, 0);
  gpuipc__tset_copy_kernel = 1;
  gather_round(&f, 4, s, gather_chunks(&f));
  gather_teardown(&f);
  return 0;
}

/* The kernel reads and writes only device memory of the copy's device:
 * short ranges into pinned host memory mapped for the device, and (with
 * two devices) into the other device's memory, go by the driver's copies
 * (no launch), the bytes right; the same ranges into device memory of the
 * copy's device take the kernel. */
static void gather_dst_check(CUdeviceptr dst, const uint8_t *host_dst,
                             CUdeviceptr src, const uint8_t *want, int n,
                             size_t len, CUstream s, uint64_t want_kernels,
                             const char *what) {
  CUdeviceptr srcs[64], dsts[64];
  uint64_t lens[64];
  for (int i = 0; i < n; i++) {
    srcs[i] = src + (CUdeviceptr)(2 * i) * len; /* every other slot */
    dsts[i] = dst + (CUdeviceptr)(n - 1 - i) * len; /* reversed */
    lens[i] = len;
  }
  uint64_t k0 = atomic_load(&gpuipc__tset_copy_kernels);
  ASSERT_OK(gpuipc__tset_copy(0, srcs, dsts, lens, (size_t)n, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint64_t kernels = atomic_load(&gpuipc__tset_copy_kernels) - k0;
  if (kernels != want_kernels)
    harness_fail(__FILE__, __LINE__, "%s: %llu kernel launches, want %llu",
                 what, (unsigned long long)kernels,
                 (unsigned long long)want_kernels);
  uint8_t *back = malloc((size_t)n * len);
  ASSERT_NOT_NULL(back);
  if (host_dst)
    memcpy(back, host_dst, (size_t)n * len);
  else
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, dst, (size_t)n * len));
  for (int i = 0; i < n; i++)
    for (size_t b = 0; b < len; b++)
      if (back[(size_t)(n - 1 - i) * len + b] != want[(size_t)(2 * i) * len + b])
        harness_fail(__FILE__, __LINE__, "%s: range %d, byte %zu: %u, want "
                     "%u", what, i, b, back[(size_t)(n - 1 - i) * len + b],
                     want[(size_t)(2 * i) * len + b]);
  free(back);
}

TEST_IMPL(sets_copy_gather_only_into_its_device) {
  REQUIRE_DEVICES(1);
  ASSERT_OK(gpuipc__driver());
  enum { N = 64 };
  size_t len = 4096;
  CUstream s = mkstream();
  CUdeviceptr src;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&src, 2 * N * len));
  uint8_t *want = malloc(2 * N * len);
  ASSERT_NOT_NULL(want);
  for (size_t i = 0; i < 2 * N * len; i++)
    want[i] = (uint8_t)(i * 7 + i / 4096);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(src, want, 2 * N * len));
  /* Device memory of device 0: the kernel. */
  CUdeviceptr mine;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&mine, N * len));
  gather_dst_check(mine, NULL, src, want, N, len, s, 1, "device memory");
  /* Pinned host memory mapped for the device: the driver's copies. */
  void *h = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc(&h, N * len, CU_MEMHOSTALLOC_DEVICEMAP |
                                                       CU_MEMHOSTALLOC_PORTABLE));
  CUdeviceptr hd = 0;
  ASSERT_CU(gpuipc__cu.cuMemHostGetDevicePointer(&hd, h, 0));
  memset(h, 0, N * len);
  gather_dst_check(hd, h, src, want, N, len, s, 0, "mapped pinned host memory");
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(h));
  ASSERT_CU(gpuipc__cu.cuMemFree(mine));
  int ndev = 0;
  ASSERT_CU(gpuipc__cu.cuDeviceGetCount(&ndev));
  if (ndev >= 2) {
    /* Another device's memory: the driver's copies (peer or staged). */
    CUdevice d1;
    CUcontext c1;
    ASSERT_CU(gpuipc__cu.cuDeviceGet(&d1, 1));
    ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxRetain(&c1, d1));
    ASSERT_CU(gpuipc__cu.cuCtxPushCurrent(c1));
    CUdeviceptr other;
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&other, N * len));
    CUcontext popped;
    ASSERT_CU(gpuipc__cu.cuCtxPopCurrent(&popped));
    gather_dst_check(other, NULL, src, want, N, len, s, 0,
                     "another device's memory");
    ASSERT_CU(gpuipc__cu.cuCtxPushCurrent(c1));
    ASSERT_CU(gpuipc__cu.cuMemFree(other));
    ASSERT_CU(gpuipc__cu.cuCtxPopCurrent(&popped));
    ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxRelease(d1));
  } else {
    printf("one device: the other device's memory is not tried\n");
  }
  ASSERT_CU(gpuipc__cu.cuMemFree(src));
  free(want);
  return 0;
}

/* A whole-set copy sorts its ranges by source and checks its destinations
 * sorted (a radix sort past 64 ranges): 5,000 ranges, sources and
 * destinations both at shuffled slots, each byte lands where its range
 * says and nothing else is written; then one destination moved to meet
 * another, which only the sorted order shows, and every range goes by its
 * own copy (neither the kernel nor a batch, whose copies run in no given
 * order). */
TEST_IMPL(sets_copy_sorts_many_ranges) {
  REQUIRE_DEVICES(1);
  enum { N = 5000, SLOT = 512, LEN = 256 };
  const size_t span = (size_t)N * SLOT;
  ctx_current();
  CUdeviceptr src, dst;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&src, span));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dst, span));
  uint8_t *h = malloc(span), *got = malloc(span);
  ASSERT_NOT_NULL(h);
  ASSERT_NOT_NULL(got);
  for (size_t i = 0; i < span; i++)
    h[i] = (uint8_t)(i * 131 + i / 251 + 7);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(src, h, span));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(dst, 0, span));
  size_t *ps = shuffled(N, 11), *pd = shuffled(N, 12);
  CUdeviceptr *s = malloc(N * sizeof *s), *d = malloc(N * sizeof *d);
  uint64_t *l = malloc(N * sizeof *l);
  ASSERT(s && d && l);
  for (size_t i = 0; i < N; i++) {
    s[i] = src + ps[i] * SLOT;
    d[i] = dst + pd[i] * SLOT;
    l[i] = LEN + i % 7; /* never adjacent: nothing merges */
  }
  CUstream st;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  uint64_t s0 = atomic_load(&gpuipc__tset_copy_singles);
  ASSERT_OK(gpuipc__tset_copy(0, s, d, l, N, st));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  /* Found free of overlaps (so sorted right): by the kernel or batches. */
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_singles) - s0, 0);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(got, dst, span));
  size_t wrong = 0;
  for (size_t i = 0; i < N; i++) {
    const uint8_t *slot = got + pd[i] * SLOT;
    if (memcmp(slot, h + ps[i] * SLOT, l[i]) != 0)
      wrong++;
    for (size_t b = l[i]; b < SLOT; b++)
      if (slot[b] != 0) {
        wrong++;
        break;
      }
  }
  if (wrong)
    printf("%zu of %d slots hold other bytes than their range's\n", wrong, N);
  ASSERT_UEQ(wrong, 0);
  /* Range N/2's destination now starts 8 bytes into range N/3's. */
  d[N / 2] = d[N / 3] + 8;
  uint64_t k0 = atomic_load(&gpuipc__tset_copy_kernels),
           b0 = atomic_load(&gpuipc__tset_copy_batches);
  s0 = atomic_load(&gpuipc__tset_copy_singles);
  ASSERT_OK(gpuipc__tset_copy(0, s, d, l, N, st));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_kernels) - k0, 0);
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_batches) - b0, 0);
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_singles) - s0, N);
  /* Back, and now the last range's destination is 8 bytes into the first
   * range's source, far apart in the input: only the sweep over both
   * sorted lists finds it. */
  d[N / 2] = dst + pd[N / 2] * SLOT;
  d[N - 1] = s[0] + 8;
  k0 = atomic_load(&gpuipc__tset_copy_kernels);
  b0 = atomic_load(&gpuipc__tset_copy_batches);
  s0 = atomic_load(&gpuipc__tset_copy_singles);
  ASSERT_OK(gpuipc__tset_copy(0, s, d, l, N, st));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_kernels) - k0, 0);
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_batches) - b0, 0);
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_singles) - s0, N);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  ASSERT_CU(gpuipc__cu.cuMemFree(src));
  ASSERT_CU(gpuipc__cu.cuMemFree(dst));
  free(s);
  free(d);
  free(l);
  free(ps);
  free(pd);
  free(h);
  free(got);
  return 0;
}

/* A device that cannot load the kernel (the emulator's cuModuleLoadData
 * answers CUDA_ERROR_NO_BINARY_FOR_GPU): every copy by the driver's
 * copies, the same bytes, and no launch. */
TEST_IMPL(sets_copy_gathered_without_kernels) {
  REQUIRE_EMULATOR("makes the emulator refuse to load modules");
  setenv("GPUIPC_EMU_DISABLE", "kernels", 1);
  REQUIRE_DEVICES(1);
  ASSERT_OK(gpuipc__driver());
  gather_fix f;
  gather_setup(&f);
  CUstream s = mkstream();
  gather_round(&f, 1, s, 0);
  gather_round(&f, 2, s, 0);
  gather_teardown(&f);
  return 0;
}

/* Launches the driver refuses: the first as an invalid handle (a reset
 * primary context), which loads the module again and launches once more;
 * then one refused otherwise, whose chunk and the rest go by the driver's
 * copies, after which the device copies without the kernel. */
TEST_IMPL(sets_copy_gather_launch_refused) {
  REQUIRE_EMULATOR("fails launches with GPUIPC_EMU_FAIL");
  setenv("GPUIPC_EMU_FAIL",
         "cuLaunchKernel:1:CUDA_ERROR_INVALID_HANDLE,"
         "cuLaunchKernel:2:CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 1);
  REQUIRE_DEVICES(1);
  ASSERT_OK(gpuipc__driver());
  gather_fix f;
  gather_setup(&f);
  ASSERT(gather_chunks(&f) >= 2);
  CUstream s = mkstream();
  /* Launch 1 refused, 2 (again, the module reloaded) done, 3 refused (the
   * second fault counts the calls the first lets through). */
  gather_round(&f, 1, s, 1);
  gather_round(&f, 2, s, 0);
  gather_teardown(&f);
  return 0;
}

/* The kernel alone (as the benchmark runs it): ranges from every other
 * slot into reversed slots, after a memset on the same stream that the
 * copies must see, with no host wait between; as the ordering conformance
 * check of the batched call (conformance_batch_copy_arrives_in_stream_order)
 * does. */
TEST_IMPL(sets_gather_arrives_in_stream_order) {
  REQUIRE_DEVICES(1);
  ASSERT_OK(gpuipc__driver());
  enum { N = 64, LEN = 4096 };
  ctx_current();
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr src, dst;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&src, 2 * N * LEN));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dst, N * LEN));
  static uint8_t host[2 * N * LEN], back[N * LEN];
  for (size_t k = 0; k < sizeof host; k++)
    host[k] = (uint8_t)(k * 13 + (k >> 12));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(src, host, sizeof host));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(dst, 0, N * LEN));
  /* The first slot is overwritten on the stream before the kernel. */
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(src, 0x5A, LEN, s));
  memset(host, 0x5A, LEN);
  CUdeviceptr dsts[N], srcs[N];
  uint64_t lens[N];
  for (int i = 0; i < N; i++) {
    srcs[i] = src + (CUdeviceptr)(2 * i) * LEN;
    dsts[i] = dst + (CUdeviceptr)(N - 1 - i) * LEN;
    lens[i] = LEN;
  }
  uint64_t k0 = atomic_load(&gpuipc__tset_copy_kernels);
  ASSERT_OK(gpuipc__tset_gather(0, srcs, dsts, lens, N, s));
  ASSERT_UEQ(atomic_load(&gpuipc__tset_copy_kernels) - k0, 1);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, dst, sizeof back));
  for (int i = 0; i < N; i++)
    ASSERT_MEM_EQ(back + (size_t)(N - 1 - i) * LEN, host + (size_t)(2 * i) * LEN,
                  LEN);
  ASSERT_CU(gpuipc__cu.cuMemFree(src));
  ASSERT_CU(gpuipc__cu.cuMemFree(dst));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  return 0;
}
