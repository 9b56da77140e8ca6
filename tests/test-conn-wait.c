/*
 * test-conn-wait.c: the wait rule (gpuipc_conn_wait): a non-blocking
 * consumer that waits between its calls gets every buffer whether it
 * spins first or sleeps at once, learns that the peer left, times out when
 * nothing comes, and may wait in a second thread beside the calls of the
 * first. Run over both carriers (NAME and NAME_on_socket).
 */
#include "test-conn-handoff.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

/* After the test's "go": argv[0] buffers of 4 KiB, argv[1] microseconds
 * apart (a negative gap: each after the first when the test says "next"),
 * each with its index as meta; then waits for the test to close. With
 * argv[2], a path: after the send of buffer i returned (its WAKE frame,
 * if any, written), the file "<path>.<i>" is made. */
HELPER_IMPL(wait_producer) {
  ASSERT(argc >= 2);
  int n = atoi(argv[0]);
  int gap_us = atoi(argv[1]);
  gpuipc_conn *c = pair_conn(dup(harness_helper_fd()));
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  char go[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_send_msg(c, "ready", 5, NULL, 0));
  ASSERT_OK(gpuipc_conn_recv_msg(c, go, sizeof go, &len, NULL, NULL));
  for (int i = 0; i < n; i++) {
    if (gap_us > 0)
      usleep((useconds_t)gap_us);
    if (gap_us < 0 && i > 0)
      ASSERT_OK(gpuipc_conn_recv_msg(c, go, sizeof go, &len, NULL, NULL));
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
    ASSERT_OK(gpuipc_conn_send(c, b, NULL, &i, sizeof i));
    ASSERT_OK(gpuipc_block_free(b, NULL));
    if (argc >= 3) {
      char path[600];
      snprintf(path, sizeof path, "%s.%d", argv[2], i);
      int f = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
      ASSERT(f >= 0);
      close(f);
    }
  }
  ASSERT_OK(gpuipc_conn_recv_msg(c, go, sizeof go, &len, NULL, NULL));
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* The wait rule's loop around a non-blocking call. */
static gpuipc_status recv_waiting(gpuipc_conn *c, gpuipc_received *r,
                                  int spin_us) {
  for (;;) {
    gpuipc_status s = gpuipc_conn_recv(c, NULL, r);
    if (s != GPUIPC_E_WOULD_BLOCK)
      return s;
    s = gpuipc_conn_wait(c, POLLIN, 30000, spin_us);
    if (s != GPUIPC_OK)
      return s;
  }
}

static gpuipc_conn *ready_producer_marking(int n, int gap_us,
                                          const char *marks, pid_t *pid) {
  int fd;
  char ns[16], gs[16];
  snprintf(ns, sizeof ns, "%d", n);
  snprintf(gs, sizeof gs, "%d", gap_us);
  *pid = spawn_helper("wait_producer", NULL, &fd, ns, gs, (char *)marks,
                      NULL);
  gpuipc_conn *c = pair_conn(fd);
  char buf[8];
  size_t len;
  /* Its CUDA start can take seconds on a loaded GPU machine. */
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 30000));
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  return c;
}

static gpuipc_conn *ready_producer(int n, int gap_us, pid_t *pid) {
  return ready_producer_marking(n, gap_us, NULL, pid);
}

/* Waits (up to 60 s) for the producer's mark of buffer i. */
static void wait_mark(const char *marks, int i) {
  char path[600];
  snprintf(path, sizeof path, "%s.%d", marks, i);
  for (int t = 0; t < 60000 && access(path, F_OK) != 0; t++)
    usleep(1000);
  if (access(path, F_OK) != 0)
    harness_fail(__FILE__, __LINE__, "the producer never sent buffer %d", i);
}

/* Whether the connection's fd is readable right now. */
static bool fd_readable(gpuipc_conn *c) {
  struct pollfd p = {gpuipc_conn_get_fd(c), POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

TEST_IMPL(conn_wait_rule_spinning_and_sleeping) {
  REQUIRE_DEVICES(1);
  const int spins[] = {0, 2000, -1};
  for (int round = 0; round < 3; round++) {
    pid_t pid;
    gpuipc_conn *c = ready_producer(4, 20000, &pid);
    /* Nothing comes before "go": the wait times out (a frame of the
     * setup that still arrives is taken by progress first). */
    int timeouts = 0;
    for (int i = 0; i < 3 && timeouts == 0; i++) {
      gpuipc_status s = gpuipc_conn_wait(c, POLLIN, 50, spins[round]);
      if (s == GPUIPC_E_TIMEOUT)
        timeouts++;
      else
        ASSERT_OK(gpuipc_conn_progress(c, 0));
    }
    ASSERT_EQ(timeouts, 1);
    /* Room to send: POLLOUT at once. */
    ASSERT_OK(gpuipc_conn_wait(c, POLLOUT, 0, 0));
    ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
    for (int i = 0; i < 4; i++) {
      gpuipc_received r = GPUIPC_RECEIVED_INIT;
      ASSERT_OK(recv_waiting(c, &r, spins[round]));
      int seq;
      ASSERT_EQ(r.meta_len, sizeof seq);
      memcpy(&seq, r.meta, sizeof seq);
      ASSERT_EQ(seq, i);
      ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
    }
    /* The peer leaves: the wait ends (not at its limit) and the call
     * says so. */
    ASSERT_OK(gpuipc_conn_send_msg(c, "end", 3, NULL, 0));
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_STATUS(recv_waiting(c, &r, spins[round]), GPUIPC_E_PEER_GONE);
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid, 30), 0);
  }
  return 0;
}

TEST_IMPL(conn_wait_argument_checks) {
  REQUIRE_DEVICES(1);
  pid_t pid;
  gpuipc_conn *c = ready_producer(0, 0, &pid);
  ASSERT_STATUS(gpuipc_conn_wait(NULL, POLLIN, 0, 0), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_conn_wait(c, POLLPRI, 0, 0), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_conn_wait(c, POLLIN, -2, 0), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_conn_wait(c, POLLIN, 0, -2), GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "gpuipc_conn_wait");
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
  ASSERT_OK(gpuipc_conn_send_msg(c, "end", 3, NULL, 0));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

typedef struct {
  gpuipc_conn *c;
  atomic_bool stop;
  atomic_int woke;
} waiter;

static void *wait_beside(void *arg) {
  waiter *w = arg;
  while (!atomic_load(&w->stop))
    if (gpuipc_conn_wait(w->c, POLLIN, 10, 20) == GPUIPC_OK)
      atomic_fetch_add(&w->woke, 1);
  return NULL;
}

/* A thread that waits while the first receives and releases (what a
 * binding does when its waiter holds no lock): every buffer arrives, in
 * order, and the wait changes nothing the calls depend on. */
TEST_IMPL(conn_wait_beside_another_thread) {
  REQUIRE_DEVICES(1);
  const int n = 200;
  pid_t pid;
  gpuipc_conn *c = ready_producer(n, 0, &pid);
  waiter w = {.c = c};
  atomic_init(&w.stop, false);
  atomic_init(&w.woke, 0);
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, wait_beside, &w), 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
  for (int i = 0; i < n; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status s;
    int spins = 0;
    while ((s = gpuipc_conn_recv(c, NULL, &r)) == GPUIPC_E_WOULD_BLOCK) {
      ASSERT(++spins < 2000000);
      usleep(20);
    }
    ASSERT_OK(s);
    int seq;
    memcpy(&seq, r.meta, sizeof seq);
    ASSERT_EQ(seq, i);
    ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
  }
  /* The peer leaves: the waiter, which may have missed every buffer (the
   * first thread took each before it looked), sees the hang-up within
   * one of its slices. */
  int before = atomic_load(&w.woke);
  ASSERT_OK(gpuipc_conn_send_msg(c, "end", 3, NULL, 0));
  for (int i = 0; i < 10000 && atomic_load(&w.woke) == before; i++)
    usleep(1000);
  ASSERT(atomic_load(&w.woke) > before);
  atomic_store(&w.stop, true);
  ASSERT_EQ(pthread_join(t, NULL), 0);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* A binding's threads: each waits without the lock, then calls under it. */
typedef struct {
  gpuipc_conn *c;
  pthread_mutex_t mu;
  int n, next;       /* buffers to come; the next index (under mu) */
  int out_of_order;  /* a buffer came with another index than next */
  atomic_int timeouts, gone;
} pool;

typedef struct {
  pool *p;
  int spin_us;
} pool_thread;

static void *wait_and_take(void *arg) {
  pool_thread *t = arg;
  pool *p = t->p;
  for (;;) {
    pthread_mutex_lock(&p->mu);
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status s = gpuipc_conn_recv(p->c, NULL, &r);
    if (s == GPUIPC_OK) {
      int seq = -1;
      if (r.meta_len == sizeof seq)
        memcpy(&seq, r.meta, sizeof seq);
      if (seq != p->next)
        p->out_of_order++;
      p->next++;
      (void)gpuipc_conn_release(p->c, r.id, NULL);
    }
    pthread_mutex_unlock(&p->mu);
    if (s == GPUIPC_E_PEER_GONE) {
      atomic_fetch_add(&p->gone, 1);
      return NULL;
    }
    if (s != GPUIPC_OK && s != GPUIPC_E_WOULD_BLOCK)
      return NULL; /* the test sees it missing from gone */
    if (s == GPUIPC_E_WOULD_BLOCK &&
        gpuipc_conn_wait(p->c, POLLIN, 10000, t->spin_us) == GPUIPC_E_TIMEOUT)
      atomic_fetch_add(&p->timeouts, 1);
  }
}

/* Three threads wait on one connection at once, one sleeping at once, one
 * spinning briefly, one longer, while the producer sends a buffer every
 * 300 us: every buffer is taken once, in order, no wait sleeps to its
 * 10 s limit while buffers come (a wake-up missed by all three would),
 * and every thread sees the producer leave. */
TEST_IMPL(conn_wait_in_three_threads_at_once) {
  REQUIRE_DEVICES(1);
  const int n = 300;
  pid_t pid;
  pool p = {.n = n};
  p.c = ready_producer(n, 300, &pid);
  pthread_mutex_init(&p.mu, NULL);
  atomic_init(&p.timeouts, 0);
  atomic_init(&p.gone, 0);
  pool_thread ts[3] = {{&p, 0}, {&p, 20}, {&p, 500}};
  pthread_t th[3];
  for (int i = 0; i < 3; i++)
    ASSERT_EQ(pthread_create(&th[i], NULL, wait_and_take, &ts[i]), 0);
  /* The calls of one thread at a time: this one's too. */
  pthread_mutex_lock(&p.mu);
  ASSERT_OK(gpuipc_conn_send_msg(p.c, "go", 2, NULL, 0));
  pthread_mutex_unlock(&p.mu);
  for (int i = 0; i < 30000; i++) {
    pthread_mutex_lock(&p.mu);
    int got = p.next;
    pthread_mutex_unlock(&p.mu);
    if (got >= n)
      break;
    usleep(1000);
  }
  pthread_mutex_lock(&p.mu);
  int got = p.next, wrong = p.out_of_order;
  pthread_mutex_unlock(&p.mu);
  if (got != n || wrong || atomic_load(&p.timeouts))
    printf("%d of %d buffers taken, %d out of order, %d waits timed out\n",
           got, n, wrong, atomic_load(&p.timeouts));
  ASSERT_EQ(got, n);
  ASSERT_EQ(wrong, 0);
  ASSERT_EQ(atomic_load(&p.timeouts), 0);
  pthread_mutex_lock(&p.mu);
  ASSERT_OK(gpuipc_conn_send_msg(p.c, "end", 3, NULL, 0));
  pthread_mutex_unlock(&p.mu);
  for (int i = 0; i < 3; i++)
    ASSERT_EQ(pthread_join(th[i], NULL), 0);
  ASSERT_EQ(atomic_load(&p.gone), 3);
  gpuipc_conn_close(p.c);
  pthread_mutex_destroy(&p.mu);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

typedef struct {
  gpuipc_conn *c;
  atomic_int asleep;
  gpuipc_status st;
} long_wait;

static void *wait_long(void *arg) {
  long_wait *w = arg;
  atomic_store(&w->asleep, 1);
  w->st = gpuipc_conn_wait(w->c, POLLIN, 20000, 0);
  return NULL;
}

/* A connection whose application polls (gpuipc_conn_set_polling), one
 * thread asleep in a long wait, another whose short wait ends first: the
 * next buffer, which travels on the ring alone (its chunk came with the
 * first), still wakes the sleeper (a waiter that left the sleep word
 * "awake" as it returned, as the ring carrier did, left the other asleep
 * without a wake-up, to its 20 s limit). */
TEST_IMPL(conn_wait_polling_second_waiter_returns_first) {
  REQUIRE_DEVICES(1);
  pid_t pid;
  gpuipc_conn *c = ready_producer(2, -1, &pid);
  ASSERT_OK(gpuipc_conn_set_polling(c, 1));
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  ASSERT_OK(recv_waiting(c, &r, 0)); /* the first, at once */
  ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
  long_wait w = {.c = c, .st = GPUIPC_OK};
  atomic_init(&w.asleep, 0);
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, wait_long, &w), 0);
  while (!atomic_load(&w.asleep))
    usleep(1000);
  usleep(100 * 1000); /* in its poll() by now */
  /* The second is sent only after this wait ended: nothing can come
   * during it, however loaded the machine. It ends by its timeout, or at
   * once for a WAKE frame of the first buffer that reached the socket
   * after the recv had read it (a call then takes it in, and the wait is
   * tried again); either way it returns while the other sleeps. */
  gpuipc_status ws = GPUIPC_OK;
  for (int i = 0; i < 3; i++) {
    ws = gpuipc_conn_wait(c, POLLIN, 10, 0);
    if (ws != GPUIPC_OK)
      break;
    ASSERT_OK(gpuipc_conn_progress(c, 0));
  }
  ASSERT_STATUS(ws, GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_conn_send_msg(c, "next", 4, NULL, 0));
  ASSERT_EQ(pthread_join(t, NULL), 0);
  if (w.st != GPUIPC_OK)
    printf("the sleeping waiter: %s\n", gpuipc_status_name(w.st));
  ASSERT_OK(w.st);
  r = (gpuipc_received)GPUIPC_RECEIVED_INIT;
  ASSERT_OK(recv_waiting(c, &r, 0));
  int seq;
  memcpy(&seq, r.meta, sizeof seq);
  ASSERT_EQ(seq, 1);
  ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "end", 3, NULL, 0));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* A receiver that slept between its calls (no polling): the sender puts
 * each record and then, on the ring carrier, a WAKE frame on the socket.
 * The recv that takes the record takes that frame in too, so the fd is
 * not left readable with nothing to read (before, the WAKE stayed in the
 * socket until a later call, and every poll or gpuipc_conn_wait in
 * between returned at once). The producer marks each send once it
 * returned, so the frame is in the socket before the recv. */
TEST_IMPL(conn_recv_takes_in_the_wake_of_its_record) {
  REQUIRE_DEVICES(1);
  char marks[512];
  snprintf(marks, sizeof marks, "%s/sent", harness_tmpdir());
  pid_t pid;
  gpuipc_conn *c = ready_producer_marking(3, -1, marks, &pid);
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
  for (int i = 0; i < 3; i++) {
    wait_mark(marks, i);
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
    int seq;
    memcpy(&seq, r.meta, sizeof seq);
    ASSERT_EQ(seq, i);
    if (fd_readable(c)) {
      /* Still readable: what is there must be nothing but a frame the
       * recv should have taken in (a call finds no buffer). */
      gpuipc_received r2 = GPUIPC_RECEIVED_INIT;
      ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r2), GPUIPC_E_WOULD_BLOCK);
      harness_fail(__FILE__, __LINE__,
                   "buffer %d: the fd stayed readable after the recv that "
                   "took it, with nothing more to receive",
                   i);
    }
    ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
    if (i < 2)
      ASSERT_OK(gpuipc_conn_send_msg(c, "next", 4, NULL, 0));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "end", 3, NULL, 0));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}
