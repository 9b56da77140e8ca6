/*
 * fuzz_sets_consumer.c: libFuzzer target for the tensor-set consumer's
 * frame sequence (src/sets/consumer.c, docs/sets.md "On a connection"):
 * what a hostile producer sends a consumer that opened a subscriber
 * (gpuipc_tset_sub_open) and calls gpuipc_tset_recv, reads every tensor of
 * every version it gets (get_tensor, find, copy_into its own device
 * memory), releases them and closes. It must end cleanly: no crash, no
 * hang, no leaked memory (LeakSanitizer) or descriptor.
 *
 * The set's buffers must be memory really exported by another process
 * (the driver refuses a process's own handles): at start-up a child
 * process (a real producer on the emulator) sends to a socket of ours,
 * over one connection:
 *   layout A  an owned set of three tensors in two copies: its table
 *             chunk, two pieces, versions 1 and 2, END (unsubscribed);
 *   layout B  a wrapped set of three tensors in two allocations (pieces
 *             sent by descriptor): table chunk, two pieces, version 1,
 *             END;
 *   spares    eight arena blocks (4096 bytes) with a meta of no set: the
 *             input rewrites their meta into the set messages it forges;
 * then a marker message. Its frames are recorded, their descriptors kept
 * open here. An "item" is one set message of the recording (a table chunk
 * message, or a buffer); the arena frames a buffer depends on (CHUNK,
 * CTL) are sent before it, once per input, whenever an item after them
 * goes.
 *
 * Input: byte 0 says how the consumer behaves,
 *   bits 0-1  versions it holds at once (0: releases each at once; 3:
 *             holds them all until gpuipc_tset_sub_close)
 *   bit 2     no copy_into (get_tensor and find only)
 *   bit 3     forged tables keep their checksum as it is (else made right)
 *   bit 4     keep the producer's end open at the end (else it hangs up)
 *   bits 5-6  the connection's order mode (3: MEMOP)
 * then ops, one byte each (op & 7, its argument op >> 3) and the bytes
 * some take:
 *   0 SEND k       item k (mod the items) as recorded
 *   1 NEXT n       the next n+1 items of the recording (a cursor)
 *   2 META k       item k with fields of its set meta replaced: 6 bytes
 *                  kind, layout, a, b, c (u16); layout 0 keeps it, 1 A,
 *                  2 B, 3 zero, else that byte times 0x0101..; a, b 0xff
 *                  keep, 0xfe the largest value; c 0xffff keeps it,
 *                  0xfffe the length of the last forged table
 *   3 RAWMETA k    item k with its meta replaced by the next L bytes (L:
 *                  the next byte, mod 65)
 *   4 TABLE        a forged table chunk: 1 byte source (bits 0-1: table A,
 *                  B, or the input's bytes; bit 2: a bad chunk magic; bits
 *                  3-5: /dev/null descriptors sent with it), chunk index,
 *                  layout (as in META), u16 offset and u16 length of the
 *                  source's bytes (input bytes: one length byte, then the
 *                  bytes), one byte n, then n (u16 position, xor byte)
 *                  mutations
 *   5 RECV n       the consumer takes up to n+1 versions now
 *   6 RELEASE      the consumer releases its oldest version (arg 1: all)
 *   7 HANGUP       the producer's end shuts down; the ops end
 * After the ops the consumer receives until nothing more comes, releases
 * what it holds and closes; the legacy stream it received and copied on
 * must then drain.
 */
#include "fuzz_conn.h"

#define SC_MARKER "fuzz-sets-consumer: recorded"
#define SC_MAXF 96

/* The recorded frames, the producer's handshake left out. */
static struct {
  uint8_t *p;
  size_t len;
  uint8_t type;
  int nfds;
  int fds[GPUIPC__FRAME_FDS_MAX];
  int item; /* its index among the items, or -1 (CHUNK, CTL, ...) */
} sc_fr[SC_MAXF];
static int sc_nfr;
static int sc_item_frame[SC_MAXF];
static int sc_nitems;
static uint64_t sc_layout_a, sc_layout_b;
/* The tables as recorded (their chunk payloads after the chunk header). */
static uint8_t *sc_table_a, *sc_table_b;
static size_t sc_table_a_len, sc_table_b_len;
/* The consumer's own device memory (copy_into). */
#define SC_DST_BYTES ((size_t)1 << 20)
static CUdeviceptr sc_dst_base;
/* FUZZ_SETS_VERBOSE=1: the recording, and what each receive returned. */
static bool sc_verbose;

static uint64_t sc_rd64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* ---- the producer ------------------------------------------------------------- */

static void sc_check(gpuipc_status s, const char *what) {
  if (s != GPUIPC_OK)
    fuzz_die(what, s);
}

static void sc_publish(gpuipc_tset *set) {
  int copy = -1;
  sc_check(gpuipc_tset_begin(set, NULL, &copy), "tset_begin");
  sc_check(gpuipc_tset_publish(set, NULL), "tset_publish");
}

/* The child: the sets and spares above, then the marker; waits for the
 * parent's end of `life` to close, exits. */
static void sc_producer_main(int sv, int life) {
  fuzz_conn_init();
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 5000;
  gpuipc_conn *c = NULL;
  sc_check(gpuipc_conn_from_fd(sv, &o, &c), "producer handshake");
  CUcontext ctx;
  sc_check(gpuipc__primary_ctx(0, &ctx), "primary context (is the emulator the "
        "driver?)");
  if (gpuipc__cu.cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    abort();

  int64_t s0[2] = {4, 4}, s1[1] = {3}, s2[2] = {2, 3}, st2[2] = {4, 1};
  gpuipc_tensor ta[3] = {
      {"weights", GPUIPC_DTYPE_F32, 2, s0, NULL, NULL, 0},
      {"bias", GPUIPC_DTYPE_I64, 1, s1, NULL, NULL, 0},
      {"mask", GPUIPC_DTYPE_U8, 2, s2, st2, NULL, 0},
  };
  gpuipc_tset_options so = GPUIPC_TSET_OPTIONS_INIT;
  so.copies = 2;
  so.timeout_ms = 200;
  so.hold_ms = 50;
  gpuipc_tset *a = NULL;
  sc_check(gpuipc_tset_create(ta, 3, &so, &a), "tset_create (owned)");
  sc_check(gpuipc_tset_subscribe(a, c, NULL), "tset_subscribe (owned)");
  sc_publish(a);
  sc_publish(a);
  sc_check(gpuipc_tset_unsubscribe(a, c), "tset_unsubscribe (owned)");

  CUdeviceptr m1, m2;
  if (gpuipc__cu.cuMemAlloc(&m1, 8192) != CUDA_SUCCESS ||
      gpuipc__cu.cuMemAlloc(&m2, 4096) != CUDA_SUCCESS)
    abort();
  int64_t b0[1] = {16}, b1[3] = {2, 2, 2}, b2[1] = {5};
  gpuipc_tensor tb[3] = {
      {"x", GPUIPC_DTYPE_F64, 1, b0, NULL, (void *)(uintptr_t)(m1 + 256), 0},
      {"y", GPUIPC_DTYPE_I16, 3, b1, NULL, (void *)(uintptr_t)m2, 0},
      {"z", GPUIPC_DTYPE_BF16, 1, b2, NULL, (void *)(uintptr_t)(m1 + 4096), 0},
  };
  gpuipc_tset_options wo = GPUIPC_TSET_OPTIONS_INIT;
  wo.timeout_ms = 200;
  wo.hold_ms = 50;
  gpuipc_tset *b = NULL;
  sc_check(gpuipc_tset_create(tb, 3, &wo, &b), "tset_create (wrapped)");
  sc_check(gpuipc_tset_subscribe(b, c, NULL), "tset_subscribe (wrapped)");
  sc_publish(b);
  /* Its END; the wait for our releases times out (we never send any). */
  (void)gpuipc_tset_unsubscribe(b, c);

  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = 1 << 20;
  gpuipc_arena *spare_arena = NULL;
  sc_check(gpuipc_arena_create(&ao, &spare_arena), "arena_create");
  for (int i = 0; i < 8; i++) {
    gpuipc_block *blk = NULL;
    sc_check(gpuipc_arena_alloc(spare_arena, 4096, NULL, &blk), "arena_alloc");
    sc_check(gpuipc_conn_send(c, blk, NULL, "spare", 5), "conn_send");
  }
  sc_check(gpuipc_conn_send_msg(c, SC_MARKER, sizeof SC_MARKER - 1, NULL, 0),
        "send_msg");
  char ch;
  while (read(life, &ch, 1) > 0 || errno == EINTR)
    ;
  _exit(0);
}

/* ---- recording ---------------------------------------------------------------- */

/* Whether the marker message is among the complete frames of p. */
static bool sc_marker_in(const uint8_t *p, size_t len) {
  size_t off = 0;
  while (len - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, p + off, sizeof h);
    if (h.len > len - off - sizeof h)
      break;
    if (h.type == GPUIPC__F_MSG && h.len == sizeof SC_MARKER - 1 &&
        memcmp(p + off + sizeof h, SC_MARKER, h.len) == 0)
      return true;
    off += sizeof h + h.len;
  }
  return false;
}

static void sc_append(uint8_t **t, size_t *len, const uint8_t *p, size_t n) {
  *t = realloc(*t, *len + n);
  if (*t == NULL)
    abort();
  memcpy(*t + *len, p, n);
  *len += n;
}

/* "slot S, sequence N" of a buffer frame (the verbose listing). */
static const char *sc_buf_slot(int i) {
  static char b[64];
  gpuipc__w_buf w;
  memcpy(&w, sc_fr[i].p + sizeof(gpuipc__frame_hdr), sizeof w);
  snprintf(b, sizeof b, ", slot %u, sequence %llu", w.slot,
           (unsigned long long)w.seq);
  return b;
}

static void sc_record_producer(void) {
  int fd = fuzz_spawn_peer(sc_producer_main);
  static uint8_t all[1 << 20];
  static int fds[256];
  int nfds = 0;
  size_t got = fuzz_record(fd, all, sizeof all, fds, 256, &nfds, sc_marker_in,
                           20000);
  close(fd); /* the producer never reads again: its frames are recorded */
  size_t off = 0;
  int frame = 0, fdi = 0;
  while (got - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, all + off, sizeof h);
    size_t flen = sizeof h + h.len;
    if (flen > got - off)
      break;
    const uint8_t *pl = all + off + sizeof h;
    bool marker = h.type == GPUIPC__F_MSG && h.len == sizeof SC_MARKER - 1 &&
                  memcmp(pl, SC_MARKER, h.len) == 0;
    /* Frames 0 and 1: the producer's HELLO and ACCEPT. */
    if (frame >= 2 && !marker && sc_nfr < SC_MAXF) {
      sc_fr[sc_nfr].p = malloc(flen);
      if (sc_fr[sc_nfr].p == NULL)
        abort();
      memcpy(sc_fr[sc_nfr].p, all + off, flen);
      sc_fr[sc_nfr].len = flen;
      sc_fr[sc_nfr].type = h.type;
      sc_fr[sc_nfr].nfds = h.nfds;
      for (int i = 0; i < h.nfds && fdi < nfds; i++)
        sc_fr[sc_nfr].fds[i] = fds[fdi++];
      sc_fr[sc_nfr].item = -1;
      if (h.type == GPUIPC__F_MSG || h.type == GPUIPC__F_BUF ||
          h.type == GPUIPC__F_BUFD) {
        sc_fr[sc_nfr].item = sc_nitems;
        sc_item_frame[sc_nitems++] = sc_nfr;
      }
      if (h.type == GPUIPC__F_MSG && h.len >= GPUIPC__TSET_CHUNK_HDR) {
        uint64_t lid = sc_rd64(pl + 8);
        if (sc_layout_a == 0)
          sc_layout_a = lid;
        else if (sc_layout_b == 0 && lid != sc_layout_a)
          sc_layout_b = lid;
        if (lid == sc_layout_a)
          sc_append(&sc_table_a, &sc_table_a_len, pl + GPUIPC__TSET_CHUNK_HDR,
                 h.len - GPUIPC__TSET_CHUNK_HDR);
        else
          sc_append(&sc_table_b, &sc_table_b_len, pl + GPUIPC__TSET_CHUNK_HDR,
                 h.len - GPUIPC__TSET_CHUNK_HDR);
      }
      sc_nfr++;
    } else {
      fdi += h.nfds;
    }
    off += flen;
    frame++;
  }
  /* The recording this harness (and its seed corpus) counts on: layout A
   * (chunk, 2 pieces, 2 versions, END), layout B (chunk, 2 pieces, 1
   * version, END), 8 spares. */
  sc_verbose = getenv("FUZZ_SETS_VERBOSE") != NULL;
  if (sc_nitems != 19 || sc_layout_a == 0 || sc_layout_b == 0 || sc_verbose) {
    fprintf(stderr, "recorded %d frames, %d items (layouts %llx, %llx; "
            "tables of %zu and %zu bytes)\n", sc_nfr, sc_nitems,
            (unsigned long long)sc_layout_a, (unsigned long long)sc_layout_b,
            sc_table_a_len, sc_table_b_len);
    for (int i = 0; i < sc_nfr; i++)
      fprintf(stderr, "  frame %d: type %u, %zu bytes, %d fds, item %d%s\n", i,
              sc_fr[i].type, sc_fr[i].len, sc_fr[i].nfds, sc_fr[i].item,
              sc_fr[i].type == GPUIPC__F_BUF || sc_fr[i].type == GPUIPC__F_BUFD
                  ? sc_buf_slot(i) : "");
    if (sc_nitems != 19 || sc_layout_a == 0 || sc_layout_b == 0)
      abort();
  }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  sc_record_producer(); /* first: the child starts the driver itself */
  fuzz_conn_init();
  CUcontext ctx;
  sc_check(gpuipc__primary_ctx(0, &ctx), "primary context");
  if (gpuipc__cu.cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
      gpuipc__cu.cuMemAlloc(&sc_dst_base, SC_DST_BYTES) != CUDA_SUCCESS)
    abort();
  return 0;
}

/* ---- one input ---------------------------------------------------------------- */

typedef struct sc_input {
  const uint8_t *p;
  size_t len, off;
} sc_input;

static bool sc_more(const sc_input *in) { return in->off < in->len; }

static uint8_t sc_u8(sc_input *in) { return sc_more(in) ? in->p[in->off++] : 0; }

static uint16_t sc_u16(sc_input *in) {
  uint16_t lo = sc_u8(in);
  return (uint16_t)(lo | (uint16_t)sc_u8(in) << 8);
}

typedef struct sc_state {
  int fd;            /* the producer's end */
  bool pre_sent[SC_MAXF];
  int cursor;        /* NEXT */
  uint32_t forged_len; /* the last forged table's length */
  bool keep_crc;       /* forged tables keep their checksum */
  gpuipc_tset_sub *sub;
  gpuipc_tset_version *held[8];
  int nheld, hold_max;
  bool copy;
  size_t dst_used;
  bool ended;
} sc_state;

/* Sends the frames before frame f that no item is (CHUNK, CTL, ...) and
 * that did not go yet. */
static void sc_send_prereqs(sc_state *st, int f) {
  for (int i = 0; i < f; i++)
    if (sc_fr[i].item < 0 && !st->pre_sent[i]) {
      st->pre_sent[i] = true;
      (void)fuzz_send_fds(st->fd, sc_fr[i].p, sc_fr[i].len, sc_fr[i].fds, sc_fr[i].nfds);
    }
}

static void sc_send_item(sc_state *st, int k) {
  int f = sc_item_frame[k];
  sc_send_prereqs(st, f);
  (void)fuzz_send_fds(st->fd, sc_fr[f].p, sc_fr[f].len, sc_fr[f].fds, sc_fr[f].nfds);
}

/* Item k (a buffer) with meta `meta` (len bytes) in place of its own. A
 * table chunk item goes as recorded. */
static void sc_send_with_meta(sc_state *st, int k, const uint8_t *meta, size_t len) {
  int f = sc_item_frame[k];
  if (sc_fr[f].type == GPUIPC__F_MSG) {
    sc_send_item(st, k);
    return;
  }
  gpuipc__frame_hdr h;
  memcpy(&h, sc_fr[f].p, sizeof h);
  gpuipc__w_buf w;
  memcpy(&w, sc_fr[f].p + sizeof h, sizeof w);
  size_t keep = h.len - w.meta_len; /* what comes before its meta */
  uint8_t *out = malloc(sizeof h + keep + len + 1);
  if (out == NULL)
    abort();
  w.meta_len = (uint32_t)len;
  h.len = (uint32_t)(keep + len);
  h.check = gpuipc__frame_check(&h);
  memcpy(out, &h, sizeof h);
  memcpy(out + sizeof h, sc_fr[f].p + sizeof h, keep);
  memcpy(out + sizeof h, &w, sizeof w);
  if (len)
    memcpy(out + sizeof h + keep, meta, len);
  sc_send_prereqs(st, f);
  (void)fuzz_send_fds(st->fd, out, sizeof h + keep + len, sc_fr[f].fds,
                      sc_fr[f].nfds);
  free(out);
}

static uint64_t sc_layout_sel(uint8_t b, uint64_t keep) {
  switch (b) {
  case 0:
    return keep;
  case 1:
    return sc_layout_a;
  case 2:
    return sc_layout_b;
  case 3:
    return 0;
  default:
    return 0x0101010101010101ull * b;
  }
}

static void sc_op_meta(sc_state *st, sc_input *in, int k) {
  int f = sc_item_frame[k];
  gpuipc__frame_hdr h;
  memcpy(&h, sc_fr[f].p, sizeof h);
  gpuipc__tset_meta m = {GPUIPC__TSET_PIECE, sc_layout_a, 0, 2, 0};
  if (sc_fr[f].type != GPUIPC__F_MSG) {
    gpuipc__w_buf w;
    memcpy(&w, sc_fr[f].p + sizeof h, sizeof w);
    gpuipc__tset_meta mine;
    if (gpuipc__tset_meta_decode(sc_fr[f].p + sc_fr[f].len - w.meta_len, w.meta_len,
                                 &mine) == GPUIPC_OK)
      m = mine;
  }
  uint8_t kind = sc_u8(in), lay = sc_u8(in), a = sc_u8(in), b = sc_u8(in);
  uint16_t c = sc_u16(in);
  m.kind = kind;
  m.layout_id = sc_layout_sel(lay, m.layout_id);
  if (a != 0xff)
    m.a = a == 0xfe ? UINT64_MAX : a;
  if (b != 0xff)
    m.b = b == 0xfe ? UINT32_MAX : b;
  if (c != 0xffff)
    m.c = c == 0xfffe ? st->forged_len : c;
  uint8_t meta[GPUIPC__TSET_META_LEN];
  gpuipc__tset_meta_encode(&m, meta);
  sc_send_with_meta(st, k, meta, sizeof meta);
}

static void sc_op_rawmeta(sc_state *st, sc_input *in, int k) {
  uint8_t meta[64];
  size_t n = sc_u8(in) % 65;
  for (size_t i = 0; i < n; i++)
    meta[i] = sc_u8(in);
  sc_send_with_meta(st, k, meta, n);
}

static void sc_op_table(sc_state *st, sc_input *in) {
  uint8_t src = sc_u8(in);
  uint32_t index = sc_u8(in);
  uint8_t lay = sc_u8(in);
  static uint8_t msg[GPUIPC__TSET_CHUNK_HDR + 4096];
  uint8_t *data = msg + GPUIPC__TSET_CHUNK_HDR;
  size_t n = 0;
  const uint8_t *t = (src & 3) == 1 ? sc_table_b : sc_table_a;
  size_t tl = (src & 3) == 1 ? sc_table_b_len : sc_table_a_len;
  if ((src & 3) >= 2) {
    n = sc_u8(in);
    for (size_t i = 0; i < n; i++)
      data[i] = sc_u8(in);
  } else {
    size_t o = sc_u16(in), l = sc_u16(in);
    if (o > tl)
      o = tl;
    if (l > tl - o)
      l = tl - o;
    memcpy(data, t + o, l);
    n = l;
  }
  int muts = sc_u8(in) % 16;
  for (int i = 0; i < muts; i++) {
    uint16_t pos = sc_u16(in);
    uint8_t x = sc_u8(in);
    if (n > 0)
      data[pos % n] ^= x;
  }
  if (n >= GPUIPC__TSET_HDR_LEN) {
    uint32_t total;
    memcpy(&total, data + 8, 4);
    st->forged_len = total;
    /* A whole table in this chunk gets a right checksum (unless the
     * input says not), so that mutations reach the checks behind it. */
    if (!st->keep_crc && total == n) {
      memset(data + 12, 0, 4);
      uint32_t crc = gpuipc__crc32c(0, data, n);
      memcpy(data + 12, &crc, 4);
    }
  }
  uint32_t magic = (src & 4) ? 0x43535448u : GPUIPC__TSET_CHUNK_MAGIC;
  uint64_t lid = sc_layout_sel(lay, (src & 3) == 1 ? sc_layout_b : sc_layout_a);
  memcpy(msg, &magic, 4);
  memcpy(msg + 4, &index, 4);
  memcpy(msg + 8, &lid, 8);
  size_t len = GPUIPC__TSET_CHUNK_HDR + n;
  int nfds = (src >> 3) & 7;
  uint8_t frame[sizeof(gpuipc__frame_hdr) + sizeof msg];
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         GPUIPC__F_MSG, (uint16_t)nfds, (uint32_t)len, 0};
  h.check = gpuipc__frame_check(&h);
  memcpy(frame, &h, sizeof h);
  memcpy(frame + sizeof h, msg, len);
  (void)fuzz_send(st->fd, frame, sizeof h + len, nfds);
}

static void sc_release_oldest(sc_state *st) {
  if (st->nheld == 0)
    return;
  (void)gpuipc_tset_version_release(st->held[0], NULL);
  memmove(st->held, st->held + 1, sizeof st->held[0] * (size_t)(st->nheld - 1));
  st->nheld--;
}

/* Reads every tensor of v as a consumer would. */
static void sc_read_version(sc_state *st, gpuipc_tset_version *v) {
  size_t n = gpuipc_tset_version_get_count(v);
  (void)gpuipc_tset_version_get_number(v);
  (void)gpuipc_tset_version_get_layout(v);
  int copy = gpuipc_tset_version_get_copy(v);
  if (copy < 0 || copy > 1)
    fuzz_die("a version of copy out of range", GPUIPC_OK);
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    gpuipc_status s = gpuipc_tset_version_get_tensor(v, i, &t);
    if (s != GPUIPC_OK)
      fuzz_die("get_tensor of a version's tensor", s);
    if (t.name == NULL || t.ndim < 0 || t.ndim > GPUIPC_TSET_NDIM_MAX)
      fuzz_die("get_tensor: a bad tensor", GPUIPC_OK);
    size_t at = (size_t)-1;
    s = gpuipc_tset_version_find(v, t.name, &at);
    /* Names are unique: find gives this index (a name with a NUL
     * inside is refused by the decoder). */
    if (s != GPUIPC_OK || at != i)
      fuzz_die("find of a version's own tensor name", s);
    total += t.nbytes;
  }
  if (!st->copy || n == 0 || total > SC_DST_BYTES - st->dst_used)
    return;
  void **dsts = malloc(n * sizeof *dsts);
  if (dsts == NULL)
    return;
  uint64_t off = st->dst_used;
  for (size_t i = 0; i < n; i++) {
    gpuipc_tensor t;
    (void)gpuipc_tset_version_get_tensor(v, i, &t);
    dsts[i] = (void *)(uintptr_t)(sc_dst_base + off);
    off += t.nbytes;
  }
  (void)gpuipc_tset_version_copy_into(v, dsts, NULL);
  free(dsts);
}

/* Up to n versions, each read and then released or held. */
static void sc_consume(sc_state *st, int n) {
  for (int round = 0; round < n && !st->ended; round++) {
    gpuipc_tset_version *v = NULL;
    gpuipc_status s = gpuipc_tset_recv(st->sub, NULL, &v);
    if (s < 0 || s >= GPUIPC__STATUS_END)
      fuzz_die("tset_recv: status out of range", s);
    if (s != GPUIPC_OK && v != NULL)
      fuzz_die("tset_recv failed with a version", s);
    if (sc_verbose)
      fprintf(stderr, "recv: %s%s%s; version %llu of layout %llx\n",
              gpuipc_status_name(s), s != GPUIPC_OK ? ": " : "",
              s != GPUIPC_OK ? gpuipc_last_error() : "",
              (unsigned long long)gpuipc_tset_version_get_number(v),
              (unsigned long long)gpuipc_tset_version_get_layout(v));
    if (s == GPUIPC_E_CLOSED || s == GPUIPC_E_PEER_GONE) {
      st->ended = true;
      break;
    }
    if (s == GPUIPC_E_TIMEOUT || s == GPUIPC_E_WOULD_BLOCK)
      break;
    if (s != GPUIPC_OK)
      continue; /* refused (or CANCELED): the consumer goes on */
    if (v == NULL)
      fuzz_die("tset_recv: OK without a version", s);
    sc_read_version(st, v);
    if (st->nheld == (int)(sizeof st->held / sizeof st->held[0]))
      sc_release_oldest(st);
    st->held[st->nheld++] = v;
    while (st->nheld > st->hold_max)
      sc_release_oldest(st);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 8192)
    return 0;
  uint8_t ctl = data[0];
  if (sc_verbose)
    fprintf(stderr, "input of %zu bytes\n", size);
  sc_input in = {data, size, 1};
  sc_state *st = calloc(1, sizeof *st);
  if (st == NULL)
    return 0;
  int hold = ctl & 3;
  st->hold_max = hold == 3 ? 8 : hold;
  st->copy = !(ctl & 0x04);
  st->keep_crc = (ctl & 0x08) != 0;

  int sv[2];
  if (gpuipc_conn_pair(sv) != GPUIPC_OK)
    abort();
  int big = 1 << 20;
  (void)setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  (void)setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  st->fd = sv[1];
  fuzz_hello_accept(sv[1]);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.nonblocking = 1;
  o.timeout_ms = 1000;
  int mode = (ctl >> 5) & 3;
  o.order = mode == 3 ? GPUIPC_ORDER_MEMOP : (gpuipc_order_mode)mode;
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_conn_from_fd(sv[0], &o, &c);
  if (s != GPUIPC_OK)
    fuzz_die("the handshake (valid) failed", s);
  /* The consumer's calls never wait: what was sent is all there is. */
  (void)gpuipc_conn_set_timeout(c, 0);
  s = gpuipc_tset_sub_open(c, &st->sub);
  if (s != GPUIPC_OK)
    fuzz_die("tset_sub_open", s);

  bool hung_up = false;
  int ops = 0;
  while (sc_more(&in) && !hung_up && ops++ < 512) {
    uint8_t op = sc_u8(&in);
    int arg = op >> 3;
    switch (op & 7) {
    case 0:
      sc_send_item(st, arg % sc_nitems);
      break;
    case 1:
      for (int i = 0; i <= arg && st->cursor < sc_nitems; i++)
        sc_send_item(st, st->cursor++);
      break;
    case 2:
      sc_op_meta(st, &in, arg % sc_nitems);
      break;
    case 3:
      sc_op_rawmeta(st, &in, arg % sc_nitems);
      break;
    case 4:
      sc_op_table(st, &in);
      break;
    case 5:
      sc_consume(st, arg + 1);
      break;
    case 6:
      if (arg & 1)
        while (st->nheld > 0)
          sc_release_oldest(st);
      else
        sc_release_oldest(st);
      break;
    default:
      shutdown(sv[1], SHUT_WR);
      hung_up = true;
      break;
    }
  }
  if (!hung_up && !(ctl & 0x10))
    shutdown(sv[1], SHUT_WR);
  /* Until nothing more comes (a bounded number of calls). */
  sc_consume(st, 64);
  /* Half of the inputs release what they hold themselves, in the order
   * received; the others leave it to sub_close. */
  if (hold != 3)
    while (st->nheld > 0)
      sc_release_oldest(st);
  gpuipc_tset_sub_close(st->sub);
  gpuipc_conn_close(c);
  if (!fuzz_drain_legacy(2000) && o.order != GPUIPC_ORDER_EVENT)
    fuzz_die("the legacy stream is still blocked 2 s after close", GPUIPC_OK);
  close(sv[1]);
  free(st);
  fuzz_check_fds("fuzz-sets-consumer");
  return 0;
}
