/*
 * test-faultsim.c: host allocation failure injection, after SQLite's
 * faultsim. The test binary is linked with -Wl,--wrap=malloc,calloc,
 * realloc,strdup (cmake/tests.cmake), so every allocation the library's
 * objects (and this file) make goes through the harness's wrappers
 * (runner.c); armed
 * with N, the N-th allocation of the arming thread fails (and, in
 * persistent mode, every one after it). Each test runs one operation with
 * N = 1, 2, ... until it succeeds with nothing injected, and checks every
 * time: a clean status (never a crash or a hang), no descriptor or arena
 * chunk left behind, and that the objects the operation used still work
 * afterwards. Memory leaks are LeakSanitizer's part (make asan); the
 * wrappers call the sanitizer's allocator through __real_*.
 * Multi-process parts arm in one process only.
 */
#include "harness.h"

#include "tree.h"

#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#define fs_left (harness_alloc()->left)
#define fs_persist (harness_alloc()->persist)
#define fs_failing (harness_alloc()->failing)
#define fs_hits (harness_alloc()->hits)

static void fs_arm(long n, int persist) { harness_alloc_arm(n, persist); }
/* Disarms; returns how many allocations were failed. */
static long fs_disarm(void) { return harness_alloc_disarm(); }

/* The wrappers are in place: an armed allocation of this file fails. */
static int fs_works(void) {
  void *(*volatile m)(size_t) = malloc; /* a call the compiler keeps */
  fs_arm(1, 0);
  void *p = m(16);
  long hits = fs_disarm();
  free(p);
  return p == NULL && hits == 1;
}
#define REQUIRE_FAULTSIM()                                                     \
  do {                                                                         \
    if (!fs_works())                                                           \
      SKIP("allocation wrappers not linked in (-Wl,--wrap=malloc)");           \
  } while (0)

/* One operation under injection. op returns a status and leaves nothing
 * behind on failure; undo releases what a success made; check (may be
 * NULL) uses the long-lived objects afterwards and returns 0 when they
 * work. Returns the number of allocation points found. */
typedef struct fs_case {
  const char *what;
  gpuipc_status (*op)(void *ctx);
  void (*undo)(void *ctx);
  int (*check)(void *ctx);
  void *ctx;
} fs_case;

static long fs_run(const fs_case *k) {
  long points = 0;
  /* A real driver opens descriptors of its own the first time a kind of
   * operation runs (device nodes, its IPC machinery) and keeps them for the
   * process's life: run the operation once with nothing injected, so that
   * what is counted below is only what a failure leaves behind. */
  gpuipc_status warm = k->op(k->ctx);
  if (warm != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "%s: fails with nothing injected: %s (%s)",
                 k->what, gpuipc_status_name(warm), gpuipc_last_error());
  k->undo(k->ctx);
  for (int persist = 0; persist < 2; persist++) {
    int counts[GPUIPC__STATUS_END] = {0};
    long n;
    for (n = 1; n < 100000; n++) {
      int fds0 = harness_count_fds();
      size_t chunks0 = gpuipc__arena_chunks_live();
      fs_arm(n, persist);
      gpuipc_status s = k->op(k->ctx);
      long hits = fs_disarm();
      if (s < 0 || s >= GPUIPC__STATUS_END)
        harness_fail(__FILE__, __LINE__, "%s, allocation %ld failed: status %d",
                     k->what, n, (int)s);
      if (hits == 0) {
        if (s != GPUIPC_OK)
          harness_fail(__FILE__, __LINE__, "%s: fails with nothing injected: %s (%s)",
                       k->what, gpuipc_status_name(s), gpuipc_last_error());
        k->undo(k->ctx);
        break;
      }
      counts[s]++;
      if (s == GPUIPC_OK)
        k->undo(k->ctx); /* an allocation it can do without */
      /* Frees the driver finishes on its own threads (stream-ordered) may
       * close descriptors a moment later: give them up to 10 s (a second
       * was short for those threads under a sanitizer on a loaded
       * machine; a leak stays open however long we wait). */
      for (int w = 0; w < 1000 && harness_count_fds() > fds0; w++)
        usleep(10000);
      if (harness_count_fds() > fds0)
        harness_fail(__FILE__, __LINE__,
                     "%s, allocation %ld failed (%s): %d descriptors open, %d "
                     "before",
                     k->what, n, gpuipc_status_name(s), harness_count_fds(), fds0);
      if (gpuipc__arena_chunks_live() != chunks0)
        harness_fail(__FILE__, __LINE__, "%s, allocation %ld failed: arena chunks %zu, %zu before",
                     k->what, n, gpuipc__arena_chunks_live(), chunks0);
      if (k->check && k->check(k->ctx) != 0)
        harness_fail(__FILE__, __LINE__,
                     "%s, allocation %ld failed (%s): the objects it used no "
                     "longer work",
                     k->what, n, gpuipc_status_name(s));
    }
    printf("%s (%s): %ld allocation(s);", k->what,
           persist ? "persistent" : "one", n - 1);
    for (int i = 0; i < GPUIPC__STATUS_END; i++)
      if (counts[i])
        printf(" %s x%d", gpuipc_status_name((gpuipc_status)i), counts[i]);
    printf("\n");
    fflush(stdout);
    if (n - 1 > points)
      points = n - 1;
  }
  return points;
}

/* ---- the handle layer ------------------------------------------------------ */

typedef struct hctx {
  gpuipc_pool_kind kind;
  gpuipc_pool *pool, *made;
  gpuipc_buffer *buf;
  gpuipc_event *ev;
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len;
  int fds[4];
  int nfds;
  int sv[2];
} hctx;

static gpuipc_status op_pool(void *p) {
  hctx *h = p;
  gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
  o.kind = h->kind;
  return gpuipc_pool_create(&o, &h->made);
}
static void undo_pool(void *p) {
  hctx *h = p;
  ASSERT_OK(gpuipc_pool_destroy(h->made));
  h->made = NULL;
}

/* The pool still allocates, exports and frees. */
static int check_pool(void *p) {
  hctx *h = p;
  gpuipc_buffer *b = NULL;
  if (gpuipc_buffer_alloc(h->pool, 4096, NULL, &b) != GPUIPC_OK)
    return -1;
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[4], nfds = 4;
  gpuipc_status s = gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds);
  if (s == GPUIPC_OK)
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
  if (gpuipc_buffer_free(b, NULL) != GPUIPC_OK || s != GPUIPC_OK)
    return -1;
  return 0;
}

static gpuipc_status op_alloc_export(void *p) {
  hctx *h = p;
  gpuipc_status s = gpuipc_buffer_alloc(h->pool, 8192, NULL, &h->buf);
  if (s != GPUIPC_OK)
    return s;
  h->nfds = 4;
  s = gpuipc_buffer_export(h->buf, h->desc, sizeof h->desc, &h->len, h->fds,
                           &h->nfds);
  if (s != GPUIPC_OK) {
    ASSERT_OK(gpuipc_buffer_free(h->buf, NULL));
    h->buf = NULL;
  }
  return s;
}
static void undo_alloc_export(void *p) {
  hctx *h = p;
  for (int i = 0; i < h->nfds; i++)
    close(h->fds[i]);
  h->nfds = 0;
  ASSERT_OK(gpuipc_buffer_free(h->buf, NULL));
  h->buf = NULL;
}

static gpuipc_status op_event(void *p) {
  hctx *h = p;
  gpuipc_status s = gpuipc_event_create(NULL, &h->ev);
  if (s != GPUIPC_OK)
    return s;
  s = gpuipc_event_export(h->ev, h->desc, sizeof h->desc, &h->len);
  if (s != GPUIPC_OK) {
    ASSERT_OK(gpuipc_event_destroy(h->ev));
    h->ev = NULL;
  }
  return s;
}
static void undo_event(void *p) {
  hctx *h = p;
  ASSERT_OK(gpuipc_event_destroy(h->ev));
  h->ev = NULL;
}

/* A descriptor and its fds over a socket pair, both ways in this thread. */
static gpuipc_status op_desc_sendrecv(void *p) {
  hctx *h = p;
  gpuipc_status s = gpuipc_desc_send(h->sv[0], h->desc, h->len, h->fds, h->nfds);
  if (s != GPUIPC_OK)
    return s;
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[4], nfds = 4;
  s = gpuipc_desc_recv(h->sv[1], d, sizeof d, &len, fds, &nfds);
  if (s != GPUIPC_OK)
    return s;
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  if (len != h->len || memcmp(d, h->desc, len) != 0 || nfds != h->nfds)
    harness_fail(__FILE__, __LINE__, "descriptor changed in transit");
  return GPUIPC_OK;
}
static void undo_nothing(void *p) { (void)p; }

TEST_IMPL(faultsim_handle_pool_buffer_event_desc) {
  REQUIRE_FAULTSIM();
  ASSERT_OK(gpuipc_init());
  gpuipc_pool_kind kinds[] = {GPUIPC_POOL_MEMPOOL, GPUIPC_POOL_VMM,
                              GPUIPC_POOL_PINNED_HOST, GPUIPC_POOL_LEGACY};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(kinds); i++) {
    hctx h;
    memset(&h, 0, sizeof h);
    h.kind = kinds[i];
    gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
    o.kind = kinds[i];
    ASSERT_OK(gpuipc_pool_create(&o, &h.pool));
    printf("-- pool kind %d\n", (int)kinds[i]);
    fs_case c1 = {"pool create", op_pool, undo_pool, check_pool, &h};
    ASSERT_GT(fs_run(&c1), 0);
    fs_case c2 = {"buffer alloc + export", op_alloc_export, undo_alloc_export,
                  check_pool, &h};
    ASSERT_GT(fs_run(&c2), 0);
    /* A real descriptor and its fds for the transport. */
    ASSERT_OK(op_alloc_export(&h));
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, h.sv), 0);
    fs_case c3 = {"descriptor send + recv", op_desc_sendrecv, undo_nothing,
                  check_pool, &h};
    fs_run(&c3);
    close(h.sv[0]);
    close(h.sv[1]);
    undo_alloc_export(&h);
    ASSERT_OK(gpuipc_pool_destroy(h.pool));
  }
  hctx h;
  memset(&h, 0, sizeof h);
  fs_case c4 = {"event create + export", op_event, undo_event, NULL, &h};
  fs_run(&c4);
  return 0;
}

/* Import under injection, in a helper (the driver refuses a process's own
 * handles): the test exports, the helper imports with each allocation
 * failing in turn. */
typedef struct ictx {
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len;
  int fds[4];
  int nfds;
  gpuipc_buffer *imp;
} ictx;

static gpuipc_status op_import(void *p) {
  ictx *x = p;
  gpuipc_status s = gpuipc_buffer_import(x->desc, x->len, x->fds, x->nfds,
                                         NULL, &x->imp);
  if (s == GPUIPC_OK) {
    /* Readable: one byte through the driver. */
    uint8_t b = 0;
    gpuipc__ctx_guard g;
    ASSERT_OK(gpuipc__ctx_enter(&g, 0));
    CUresult r = GPUIPC__CU(cuMemcpyDtoH, &b,
                            (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(x->imp), 1);
    gpuipc__ctx_leave(&g);
    ASSERT_EQ(r, CUDA_SUCCESS);
  }
  return s;
}
static void undo_import(void *p) {
  ictx *x = p;
  ASSERT_OK(gpuipc_buffer_close(x->imp));
  x->imp = NULL;
}

HELPER_IMPL(faultsim_import_peer) {
  int sock = harness_helper_fd();
  ASSERT_OK(gpuipc_init());
  ictx x;
  memset(&x, 0, sizeof x);
  x.nfds = 4;
  ssize_t n = harness_recv(sock, x.desc, sizeof x.desc, x.fds, &x.nfds);
  ASSERT_GT(n, 0);
  x.len = (size_t)n;
  if (!fs_works())
    return 77;
  fs_case c = {"buffer import", op_import, undo_import, NULL, &x};
  long points = fs_run(&c);
  for (int i = 0; i < x.nfds; i++)
    close(x.fds[i]);
  harness_send_u64(sock, (uint64_t)points);
  return 0;
}

TEST_IMPL(faultsim_handle_import) {
  REQUIRE_FAULTSIM();
  ASSERT_OK(gpuipc_init());
  gpuipc_pool_kind kinds[] = {GPUIPC_POOL_MEMPOOL, GPUIPC_POOL_VMM,
                              GPUIPC_POOL_LEGACY};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(kinds); i++) {
    hctx h;
    memset(&h, 0, sizeof h);
    gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
    o.kind = kinds[i];
    ASSERT_OK(gpuipc_pool_create(&o, &h.pool));
    ASSERT_OK(op_alloc_export(&h));
    int sock = -1;
    pid_t pid = spawn_helper("faultsim_import_peer", NULL, &sock, NULL);
    harness_send(sock, h.desc, h.len, h.fds, h.nfds);
    uint64_t points = harness_recv_u64(sock);
    printf("kind %d: import has %llu allocation point(s)\n", (int)kinds[i],
           (unsigned long long)points);
    ASSERT_EQ(wait_helper(pid, 120), 0);
    close(sock);
    ASSERT_GT(points, 0);
    undo_alloc_export(&h);
    ASSERT_OK(gpuipc_pool_destroy(h.pool));
  }
  return 0;
}

/* ---- the connection layer -------------------------------------------------- */

typedef struct peer_arg {
  int fd;
  gpuipc_conn *conn;
  gpuipc_status s;
} peer_arg;

static void *peer_from_fd(void *p) {
  peer_arg *a = p;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 5000;
  a->s = gpuipc_conn_from_fd(a->fd, &o, &a->conn);
  return NULL;
}

typedef struct cctx {
  gpuipc_conn *a, *b; /* a: this thread's (armed) side */
} cctx;

/* A connected pair; the handshake of side a runs armed, b's in a thread. */
static gpuipc_status op_handshake(void *p) {
  cctx *c = p;
  int sv[2];
  gpuipc_status s = gpuipc_conn_pair(sv);
  if (s != GPUIPC_OK)
    return s;
  peer_arg pa = {sv[1], NULL, GPUIPC_OK};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, peer_from_fd, &pa), 0);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 5000;
  s = gpuipc_conn_from_fd(sv[0], &o, &c->a);
  long hits = fs_hits;
  fs_left = 0; /* the join below is not under test */
  ASSERT_EQ(pthread_join(t, NULL), 0);
  fs_hits = hits;
  if (s != GPUIPC_OK) {
    gpuipc_conn_close(pa.conn);
    return s;
  }
  if (pa.s != GPUIPC_OK) {
    gpuipc_conn_close(c->a);
    c->a = NULL;
    return pa.s;
  }
  c->b = pa.conn;
  return GPUIPC_OK;
}
static void undo_handshake(void *p) {
  cctx *c = p;
  gpuipc_conn_close(c->a);
  gpuipc_conn_close(c->b);
  c->a = c->b = NULL;
}

static void make_pair(cctx *c) {
  ASSERT_OK(op_handshake(c));
  ASSERT_OK(gpuipc_conn_set_timeout(c->a, 200));
  ASSERT_OK(gpuipc_conn_set_timeout(c->b, 200));
}

/* Receives on `on` until nothing comes for 200 ms: how many messages, and
 * whether they were want[0..] in order. Returns the last status. */
static gpuipc_status drain(gpuipc_conn *on, const char *const *want, int nwant,
                           int *got, int *in_order) {
  *got = 0;
  *in_order = 1;
  for (;;) {
    char buf[256];
    size_t len = 0;
    int fds[4], nfds = 4;
    gpuipc_status s = gpuipc_conn_recv_msg(on, buf, sizeof buf - 1, &len, fds, &nfds);
    if (s != GPUIPC_OK)
      return s;
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    buf[len] = '\0';
    if (*got >= nwant || strcmp(buf, want[*got]) != 0)
      *in_order = 0;
    (*got)++;
  }
}

TEST_IMPL(faultsim_conn_handshake) {
  REQUIRE_FAULTSIM();
  cctx c = {NULL, NULL};
  fs_case k = {"conn handshake", op_handshake, undo_handshake, NULL, &c};
  ASSERT_GT(fs_run(&k), 0);
  return 0;
}

/* Sending with descriptors, armed on the sender; then the receiver (not
 * armed) must see the message whole or not at all, and the connection go
 * on (or be closed, cleanly). */
/* Each of these ops makes its own pair (not armed), arms for its one step,
 * checks, and closes the pair. */
typedef struct armed {
  long n;
  int persist;
} armed;
static armed pause_arming(void) {
  armed a = {fs_left, fs_persist};
  fs_left = 0;
  return a;
}
static void resume_arming(armed a) {
  fs_left = a.n;
  fs_persist = a.persist;
  fs_failing = 0;
  fs_hits = 0;
}

static gpuipc_status op_send_fds(void *p) {
  cctx *c = p;
  armed at = pause_arming();
  make_pair(c);
  resume_arming(at);
  int fds[2] = {STDIN_FILENO, STDERR_FILENO};
  gpuipc_status s = gpuipc_conn_send_msg(c->a, "one", 3, fds, 2);
  long hits = fs_disarm();
  if (s == GPUIPC_OK)
    ASSERT_OK(gpuipc_conn_send_msg(c->a, "two", 3, NULL, 0));
  int got, in_order;
  static const char *const both[] = {"one", "two"};
  gpuipc_status d = drain(c->b, s == GPUIPC_OK ? both : both + 1,
                          s == GPUIPC_OK ? 2 : 1, &got, &in_order);
  if (s == GPUIPC_OK && (got != 2 || !in_order))
    harness_fail(__FILE__, __LINE__, "send_msg said OK but %d message(s)%s arrived (%s)",
                 got, in_order ? "" : " out of order", gpuipc_status_name(d));
  if (s != GPUIPC_OK && got != 0)
    harness_fail(__FILE__, __LINE__, "send_msg failed (%s) but %d message(s) arrived",
                 gpuipc_status_name(s), got);
  undo_handshake(c);
  fs_hits = hits;
  return s;
}

/* Receiving, armed on the receiver: two messages (the second with
 * descriptors) are in the socket; after a failed receive, the disarmed
 * receiver must get each message exactly once, in order, or see the
 * connection closed. */
static gpuipc_status op_recv_two(void *p) {
  cctx *c = p;
  armed at = pause_arming();
  make_pair(c);
  int fds[2] = {STDIN_FILENO, STDERR_FILENO};
  ASSERT_OK(gpuipc_conn_send_msg(c->b, "one", 3, NULL, 0));
  ASSERT_OK(gpuipc_conn_send_msg(c->b, "two", 3, fds, 2));
  resume_arming(at);
  long hits;
  char buf[16];
  size_t len = 0;
  int rfds[4], nfds = 4;
  gpuipc_status s = gpuipc_conn_recv_msg(c->a, buf, sizeof buf, &len, rfds, &nfds);
  hits = fs_disarm();
  static const char *const both[] = {"one", "two"};
  int got, in_order;
  gpuipc_status d;
  if (s == GPUIPC_OK) {
    for (int i = 0; i < nfds; i++)
      close(rfds[i]);
    ASSERT(len == 3 && memcmp(buf, "one", 3) == 0);
    d = drain(c->a, both + 1, 1, &got, &in_order);
    got++;
  } else {
    d = drain(c->a, both, 2, &got, &in_order);
  }
  if (got != 2 || !in_order) {
    if (d == GPUIPC_E_CLOSED || d == GPUIPC_E_PEER_GONE)
      ; /* closed after the failure: clean, if not kind */
    else
      harness_fail(__FILE__, __LINE__,
                   "after a failed receive (%s: %s), %d message(s)%s arrived "
                   "instead of 2, then %s (%s)",
                   gpuipc_status_name(s), gpuipc_last_error(), got,
                   in_order ? "" : " out of order or twice",
                   gpuipc_status_name(d), gpuipc_last_error());
  }
  undo_handshake(c);
  fs_hits = hits;
  return s;
}

static void undo_closed(void *p) { (void)p; }

TEST_IMPL(faultsim_conn_send_msg_fds) {
  REQUIRE_FAULTSIM();
  cctx c = {NULL, NULL};
  fs_case k = {"conn send_msg with fds", op_send_fds, undo_closed, NULL, &c};
  fs_run(&k);
  return 0;
}

TEST_IMPL(faultsim_conn_recv_msg_fds) {
  REQUIRE_FAULTSIM();
  cctx c = {NULL, NULL};
  fs_case k = {"conn recv_msg (two queued, fds)", op_recv_two, undo_closed,
               NULL, &c};
  ASSERT_GT(fs_run(&k), 0);
  return 0;
}

/* A frame half sent: the socket takes part of a large message, and the
 * transmit queue that must hold the rest cannot grow. The connection must
 * not be left open with a torn stream: either the message (and the next)
 * arrive whole, or the failed send leaves the connection closed, so that
 * the peer sees the end rather than garbage. */
static gpuipc_status op_partial_send(void *p) {
  cctx *c = p;
  armed at = pause_arming();
  make_pair(c);
  ASSERT_OK(gpuipc_conn_set_timeout(c->b, 50));
  int small = 4096;
  ASSERT_EQ(setsockopt(gpuipc_conn_get_fd(c->a), SOL_SOCKET, SO_SNDBUF, &small,
                       sizeof small), 0);
  static char big[60000];
  memset(big, 'x', sizeof big);
  resume_arming(at);
  gpuipc_status s = gpuipc_conn_send_msg(c->a, big, sizeof big, NULL, 0);
  long hits = fs_disarm();
  gpuipc_status s2 = gpuipc_conn_send_msg(c->a, "after", 5, NULL, 0);
  static char buf[65536];
  int got_big = 0, got_after = 0, other = 0, quiet = 0;
  gpuipc_status d = GPUIPC_OK;
  while (quiet < 10) {
    (void)gpuipc_conn_progress(c->a, 0);
    size_t len = 0;
    d = gpuipc_conn_recv_msg(c->b, buf, sizeof buf, &len, NULL, NULL);
    if (d == GPUIPC_E_TIMEOUT) {
      quiet++;
      continue;
    }
    if (d != GPUIPC_OK)
      break;
    quiet = 0;
    if (len == sizeof big && !got_after)
      got_big++;
    else if (len == 5 && memcmp(buf, "after", 5) == 0)
      got_after++;
    else
      other++;
  }
  int whole = got_big == (s == GPUIPC_OK) && got_after == (s2 == GPUIPC_OK) &&
              other == 0 && (d == GPUIPC_E_TIMEOUT);
  int closed = s != GPUIPC_OK &&
               (s2 == GPUIPC_E_CLOSED || s2 == GPUIPC_E_PEER_GONE) &&
               got_big == 0 && other == 0 &&
               (d == GPUIPC_E_PEER_GONE || d == GPUIPC_E_CLOSED);
  if (!whole && !closed)
    harness_fail(__FILE__, __LINE__,
                 "torn stream: the large send returned %s, the next %s; the "
                 "peer got %d large, %d 'after', %d other message(s), then %s "
                 "(%s)",
                 gpuipc_status_name(s), gpuipc_status_name(s2), got_big,
                 got_after, other, gpuipc_status_name(d), gpuipc_last_error());
  undo_handshake(c);
  fs_hits = hits;
  return s;
}

TEST_IMPL(faultsim_conn_partial_send_not_torn) {
  REQUIRE_FAULTSIM();
  cctx c = {NULL, NULL};
  fs_case k = {"conn send_msg, half sent", op_partial_send, undo_closed, NULL,
               &c};
  ASSERT_GT(fs_run(&k), 0);
  return 0;
}

/* An arena: create (first chunk), allocate two blocks, free them, destroy.
 * (Sending its blocks needs a consumer process; the connection cases above
 * cover the transport's allocations.) */
static gpuipc_status op_arena(void *p) {
  (void)p;
  gpuipc_arena_options o = GPUIPC_ARENA_OPTIONS_INIT;
  o.chunk_bytes = 1 << 20;
  gpuipc_arena *a = NULL;
  gpuipc_status s = gpuipc_arena_create(&o, &a);
  if (s != GPUIPC_OK)
    return s;
  gpuipc_block *b[2] = {NULL, NULL};
  for (int i = 0; i < 2 && s == GPUIPC_OK; i++)
    s = gpuipc_arena_alloc(a, 4096 << i, NULL, &b[i]);
  long hits = fs_disarm(); /* the teardown is not under test */
  for (int i = 0; i < 2; i++)
    if (b[i])
      ASSERT_OK(gpuipc_block_free(b[i], NULL));
  ASSERT_OK(gpuipc_arena_destroy(a));
  fs_hits = hits;
  return s;
}

TEST_IMPL(faultsim_conn_arena) {
  REQUIRE_FAULTSIM();
  ASSERT_OK(gpuipc_init());
  fs_case k = {"arena create + alloc", op_arena, undo_nothing, NULL, NULL};
  ASSERT_GT(fs_run(&k), 0);
  return 0;
}
