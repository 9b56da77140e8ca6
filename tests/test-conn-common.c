/*
 * test-conn-common.c: the code the fast path's test files share (declared
 * in test-conn-handoff.h): small tools, bounded steps, raw frames, batches
 * of filled blocks, and the helper processes that tests of several files
 * start. It has no test of its own.
 */
#include "test-conn-handoff.h"

#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>

/* ---- small tools --------------------------------------------------------------------- */

void ctx_current(void) {
  CUcontext c;
  ASSERT_OK(gpuipc__primary_ctx(0, &c));
  ASSERT_CU(gpuipc__cu.cuCtxSetCurrent(c));
}

/* GPUIPC_TEST_STREAM=legacy runs a test (and its helpers) on the legacy
 * default stream (NULL) instead of a stream of its own. */
bool test_legacy(void) {
  const char *e = getenv("GPUIPC_TEST_STREAM");
  return e && strcmp(e, "legacy") == 0;
}

CUstream mkstream(void) {
  ctx_current();
  if (test_legacy())
    return NULL;
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  return s;
}

void pattern(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = (uint8_t)x;
  }
}

void check_pattern(const uint8_t *p, size_t n, uint32_t seed) {
  uint8_t *want = malloc(n);
  ASSERT_NOT_NULL(want);
  pattern(want, n, seed);
  ASSERT_MEM_EQ(p, want, n);
  free(want);
}

gpuipc_arena *mkarena(size_t chunk) {
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = chunk;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  return a;
}

/* GPUIPC_TEST_ORDER=event runs a test (and its helpers) in event mode. */
gpuipc_order_mode test_order(void) {
  const char *e = getenv("GPUIPC_TEST_ORDER");
  return e && strcmp(e, "event") == 0 ? GPUIPC_ORDER_EVENT : GPUIPC_ORDER_MEMOP;
}

gpuipc_conn *pair_conn(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  o.order = test_order();
  /* The tests that count driver calls swap entries of the driver table,
   * which the watcher thread reads: they run without it. */
  o.watch_peer = getenv("GPUIPC_TEST_NO_WATCH") == NULL;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  return c;
}

/* Waits until no peer holds the block (making progress on c). */
void wait_unheld(gpuipc_conn *c, gpuipc_block *b) {
  for (int i = 0; i < 30000 && gpuipc_block_get_holders(b) > 0; i++)
    ASSERT_OK(gpuipc_conn_progress(c, 1));
  ASSERT_EQ(gpuipc_block_get_holders(b), 0);
}

/* Copies n bytes of device memory at p to the host (synchronous). */
uint32_t check_received(const gpuipc_received *r, CUstream s) {
  uint32_t seed;
  ASSERT_EQ(r->meta_len, sizeof seed);
  memcpy(&seed, r->meta, sizeof seed);
  uint8_t *host = malloc(r->length);
  ASSERT_NOT_NULL(host);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, (CUdeviceptr)(uintptr_t)r->ptr,
                                        r->length, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  check_pattern(host, r->length, seed);
  free(host);
  return seed;
}

void d2h(void *dst, const void *p, size_t n) {
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)p, n));
}

/* Waits for a helper's "up" (its CUDA is started), however long CUDA
 * takes to start on a loaded machine, then restores the timeout. */
void wait_up(gpuipc_conn *c, int timeout_ms) {
  char buf[4];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_set_timeout(c, 180000));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  ASSERT_MEM_EQ(buf, "up", 2);
  ASSERT_OK(gpuipc_conn_set_timeout(c, timeout_ms));
}

/* ---- ordering ------------------------------------------------------------------------ */

/* Sends a small block and waits for its release: the connection's setup
 * is done afterwards. The block is freed (its memory may be reused only
 * after the consumer's release, which the tests below rely on too). */
void warm_up(gpuipc_conn *c, gpuipc_arena *a, CUstream s) {
  gpuipc_block *w = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 256, (struct CUstream_st *)s, &w));
  ASSERT_OK(gpuipc_conn_send(c, w, (struct CUstream_st *)s, NULL, 0));
  wait_unheld(c, w);
  ASSERT_OK(gpuipc_block_free(w, (struct CUstream_st *)s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
}

char *delay_env[] = {"GPUIPC_EMU_COPY_DELAY_US=200000", NULL};

/* ---- hostile frames ------------------------------------------------------------------ */

void raw_frame(int fd, int type, const void *p, size_t n) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, 0, (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  unsigned char buf[1024];
  ASSERT_LE(sizeof h + n, sizeof buf);
  memcpy(buf, &h, sizeof h);
  if (n)
    memcpy(buf + sizeof h, p, n);
  ASSERT_EQ(write(fd, buf, sizeof h + n), (ssize_t)(sizeof h + n));
}

/* ---- bounded steps, streams that drain, full arenas ---------------------------------- */

/* A step that must end within `secs` seconds: otherwise the test fails
 * with `what` instead of hanging. */
static const char *volatile bounded_what;

static void bounded_alarm(int sig) {
  (void)sig;
  const char *parts[] = {"assertion failed: still in ", bounded_what,
                         " after the bound (a hang)\n"};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(parts); i++) {
    ssize_t w = write(2, parts[i], strlen(parts[i]));
    (void)w;
  }
  _exit(1);
}

void bounded(const char *what, unsigned secs) {
  bounded_what = what;
  signal(SIGALRM, bounded_alarm);
  alarm(secs);
}

void bounded_done(void) { alarm(0); }

/* True when the work queued on s so far completes within ms. */
bool stream_drains(CUstream s, int ms) {
  for (int i = 0; i < ms; i++) {
    CUresult r = gpuipc__cu.cuStreamQuery(s);
    if (r == CUDA_SUCCESS)
      return true;
    ASSERT_EQ(r, CUDA_ERROR_NOT_READY);
    usleep(1000);
  }
  return false;
}

/* Arena memory laid out so that every allocation below must reuse memory:
 * one chunk, no growth, its rest taken by a filler block. */
gpuipc_arena *full_arena(size_t small, int n, gpuipc_block **blocks,
                         gpuipc_block **filler) {
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)1 << 20;
  ao.max_bytes = ao.chunk_bytes;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  for (int i = 0; i < n; i++)
    ASSERT_OK(gpuipc_arena_alloc(a, small, NULL, &blocks[i]));
  ASSERT_OK(gpuipc_arena_alloc(a, ao.chunk_bytes - (size_t)n * small, NULL,
                               filler));
  return a;
}

/* ---- batches ------------------------------------------------------------------------- */

/* Allocates a block of n bytes of a, fills it with the pattern of seed on
 * s (asynchronously, from pinned memory the caller frees after a sync). */
gpuipc_block *filled_block(gpuipc_arena *a, CUstream s, size_t n,
                           uint32_t seed, uint8_t **pinned) {
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, n, (struct CUstream_st *)s, &b));
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)pinned, n, 0));
  pattern(*pinned, n, seed);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(
      (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b), *pinned, n, s));
  return b;
}

/* Sends batches of nb blocks alternating between two arenas, of sizes
 * from sizes[], every block freed after its send (the memory returns when
 * the consumer released it). */
/* send_batches waits for its copies before each send (an idle stream). */
bool sync_before_send;

void send_batches(gpuipc_conn *c, gpuipc_arena *a1, gpuipc_arena *a2,
                  CUstream s, int nb, int rounds, const size_t *sizes,
                  int nsizes, uint32_t seed0) {
  gpuipc_block **bs = calloc((size_t)nb, sizeof *bs);
  uint8_t **pin = calloc((size_t)nb, sizeof *pin);
  uint32_t *seeds = calloc((size_t)nb, sizeof *seeds);
  const void **metas = calloc((size_t)nb, sizeof *metas);
  size_t *lens = calloc((size_t)nb, sizeof *lens);
  ASSERT(bs && pin && seeds && metas && lens);
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < nb; i++) {
      seeds[i] = seed0 + (uint32_t)(r * nb + i);
      bs[i] = filled_block(i % 2 ? a2 : a1, s, sizes[(r + i) % nsizes],
                           seeds[i], &pin[i]);
      metas[i] = &seeds[i];
      lens[i] = sizeof seeds[i];
    }
    if (sync_before_send)
      ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    ASSERT_OK(gpuipc_conn_send_batch(c, bs, (size_t)nb,
                                     (struct CUstream_st *)s, metas, lens));
    for (int i = 0; i < nb; i++) {
      ASSERT_GE(gpuipc_block_get_holders(bs[i]), 1);
      ASSERT_OK(gpuipc_block_free(bs[i], (struct CUstream_st *)s));
    }
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    for (int i = 0; i < nb; i++)
      ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin[i]));
  }
  free(bs);
  free(pin);
  free(seeds);
  free(metas);
  free(lens);
}

/* ---- driver calls, counted ----------------------------------------------------------- */

static atomic_int n_calls[DC_N];
static bool counting;
static CUresult (*real_write)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
static CUresult (*real_wait)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
static CUresult (*real_query)(CUstream);
static CUresult (*real_record)(CUevent, CUstream);
static CUresult (*real_wait_event)(CUstream, CUevent, unsigned int);

static CUresult counting_write(CUstream s, CUdeviceptr a, cuuint64_t v,
                               unsigned int f) {
  atomic_fetch_add(&n_calls[DC_WRITE], 1);
  return real_write(s, a, v, f);
}

static CUresult counting_wait(CUstream s, CUdeviceptr a, cuuint64_t v,
                              unsigned int f) {
  atomic_fetch_add(&n_calls[DC_WAIT], 1);
  return real_wait(s, a, v, f);
}

static CUresult counting_query(CUstream s) {
  atomic_fetch_add(&n_calls[DC_QUERY], 1);
  return real_query(s);
}

static CUresult counting_record(CUevent e, CUstream s) {
  atomic_fetch_add(&n_calls[DC_RECORD], 1);
  return real_record(e, s);
}

static CUresult counting_wait_event(CUstream s, CUevent e, unsigned int f) {
  atomic_fetch_add(&n_calls[DC_WAIT_EVENT], 1);
  return real_wait_event(s, e, f);
}

void count_calls(void) {
  if (!counting) {
    real_write = gpuipc__cu.cuStreamWriteValue64;
    real_wait = gpuipc__cu.cuStreamWaitValue64;
    real_query = gpuipc__cu.cuStreamQuery;
    real_record = gpuipc__cu.cuEventRecord;
    real_wait_event = gpuipc__cu.cuStreamWaitEvent;
    gpuipc__cu.cuStreamWriteValue64 = counting_write;
    gpuipc__cu.cuStreamWaitValue64 = counting_wait;
    gpuipc__cu.cuStreamQuery = counting_query;
    gpuipc__cu.cuEventRecord = counting_record;
    gpuipc__cu.cuStreamWaitEvent = counting_wait_event;
    counting = true;
  }
  for (int i = 0; i < DC_N; i++)
    atomic_store(&n_calls[i], 0);
}

int counted(int which) { return atomic_load(&n_calls[which]); }

int counted_all(void) {
  int n = 0;
  for (int i = 0; i < DC_N; i++)
    n += counted(i);
  return n;
}

void uncount_calls(void) {
  if (!counting)
    return;
  gpuipc__cu.cuStreamWriteValue64 = real_write;
  gpuipc__cu.cuStreamWaitValue64 = real_wait;
  gpuipc__cu.cuStreamQuery = real_query;
  gpuipc__cu.cuEventRecord = real_record;
  gpuipc__cu.cuStreamWaitEvent = real_wait_event;
  counting = false;
}

void open_gate(CUdeviceptr gate) {
  CUstream o;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&o, CU_STREAM_NON_BLOCKING));
  ASSERT_CU((counting ? real_write : gpuipc__cu.cuStreamWriteValue64)(o, gate,
                                                                     1, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(o));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(o));
}

/* ---- helper processes that tests of several files start ------------------------------ */

/* A consumer: receives `count` buffers, checks each against the pattern
 * whose seed is in its metadata, releases it, and reports "ok". Then (if
 * argv[3] is "swap") it becomes the producer and sends one buffer back;
 * (if argv[3] is "count") it reports, in a second message, how many stream
 * waits its receives enqueued. argv[0]: "pair" or a name to connect to in
 * the runtime dir argv[2]. */
HELPER_IMPL(ho_consumer) {
  ASSERT(argc >= 2);
  int count = atoi(argv[1]);
  gpuipc_conn *c = NULL;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 30000;
  if (strcmp(argv[0], "pair") == 0) {
    c = pair_conn(dup(harness_helper_fd()));
  } else {
    ASSERT(argc >= 3);
    o.runtime_dir = argv[2];
    ASSERT_OK(gpuipc_connect(argv[0], &o, &c));
  }
  CUstream s = mkstream();
  bool count_waits = argc >= 4 && strcmp(argv[3], "count") == 0;
  int waits = 0;
  for (int i = 0; i < count; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    if (count_waits)
      count_calls();
    ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
    if (count_waits) {
      waits += counted(DC_WAIT) + counted(DC_WAIT_EVENT);
      uncount_calls();
    }
    check_received(&r, s); /* ordered on s after the wait recv queued */
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  if (count_waits) {
    char msg[16];
    int n = snprintf(msg, sizeof msg, "%d", waits);
    ASSERT_OK(gpuipc_conn_send_msg(c, msg, (size_t)n, NULL, 0));
  }
  if (argc >= 2 && argc >= 4 && strcmp(argv[3], "swap") == 0) {
    gpuipc_arena *a = mkarena((size_t)1 << 20);
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 8192, (struct CUstream_st *)s, &b));
    uint8_t host[8192];
    pattern(host, sizeof host, 4242);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                                          host, sizeof host, s));
    uint32_t seed = 4242;
    ASSERT_OK(gpuipc_conn_send(c, b, (struct CUstream_st *)s, &seed, sizeof seed));
    ASSERT_OK(gpuipc_block_free(b, (struct CUstream_st *)s));
    char buf[4];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
    size_t out = 1;
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    ASSERT_EQ(out, 0);
    gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
    ASSERT_OK(gpuipc_arena_get_stats(a, &st));
    ASSERT_EQ(st.blocks_allocated, 0);
    gpuipc_conn_close(c);
    ASSERT_OK(gpuipc_arena_destroy(a));
    return 0;
  }
  await_test_then_close(c);
  return 0;
}

/* Consumer for the ordering tests. Mode "read": receive one buffer, copy
 * it to the host on the stream recv ordered, check the pattern (seed in
 * metadata). Mode "reuse": receive, copy it (slowly) to private device
 * memory, release at once on the same stream, tell the producer, wait for
 * the producer to say it overwrote the memory, then check the private copy
 * has the original data. */
HELPER_IMPL(ho_order) {
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  CUstream s = mkstream();
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  /* First a warm-up buffer (the connection's one-time setup, which may
   * itself wait for the device, is over before the real one comes). */
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  r = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  ASSERT_OK(gpuipc_conn_recv(c, (struct CUstream_st *)s, &r));
  uint32_t seed;
  memcpy(&seed, r.meta, sizeof seed);
  uint8_t *host = malloc(r.length);
  ASSERT_NOT_NULL(host);
  if (strcmp(argv[0], "read") == 0) {
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(host, (CUdeviceptr)(uintptr_t)r.ptr,
                                          r.length, s));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    check_pattern(host, r.length, seed);
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
  } else {
    CUdeviceptr priv;
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&priv, r.length));
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(priv, (CUdeviceptr)(uintptr_t)r.ptr,
                                          r.length, s));
    ASSERT_OK(gpuipc_conn_release(c, r.id, (struct CUstream_st *)s));
    ASSERT_OK(gpuipc_conn_send_msg(c, "released", 8, NULL, 0));
    char buf[16];
    size_t len;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
    d2h(host, (void *)(uintptr_t)priv, r.length);
    check_pattern(host, r.length, seed);
    ASSERT_CU(gpuipc__cu.cuMemFree(priv));
  }
  free(host);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  await_test_then_close(c);
  return 0;
}

/* A producer of batches: sends argv[0] batches of 8 blocks, then waits
 * for "k" and checks that everything came back. */
HELPER_IMPL(ho_batch_producer) {
  int rounds = atoi(argv[0]);
  sync_before_send = argc >= 2 && strcmp(argv[1], "idle") == 0;
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a1 = mkarena((size_t)1 << 20);
  gpuipc_arena *a2 = mkarena((size_t)1 << 20);
  CUstream s = mkstream();
  static const size_t sizes[] = {4096, 256, 9000};
  send_batches(c, a1, a2, s, 8, rounds, sizes, 3, 300);
  char buf[4];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  size_t out = 1;
  for (int i = 0; i < 1000 && out > 0; i++) {
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
    if (out)
      ASSERT_OK(gpuipc_conn_progress(c, 10));
  }
  ASSERT_EQ(out, 0);
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a1, &st));
  ASSERT_EQ(st.blocks_allocated, 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a1));
  ASSERT_OK(gpuipc_arena_destroy(a2));
  return 0;
}

void await_test_then_close(gpuipc_conn *c) {
  char buf[4];
  size_t len;
  gpuipc_status st = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(st == GPUIPC_OK || st == GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
}
