/*
 * ring.c: `gpuipc bench ring`: whether a shared-memory ring between two
 * processes would carry a handoff's small message faster than the Unix
 * socket the transport uses today (docs/ring.md). No GPU is involved.
 *
 * Two processes (this one and a forked child) exchange 64-byte messages:
 *
 *   socket   a socketpair of the kind gpuipc_conn_pair makes (AF_UNIX,
 *            SOCK_STREAM), non-blocking as the transport keeps it, through
 *            the transport's own sendmsg/recvmsg (gpuipc__sock_send/recv,
 *            MSG_DONTWAIT); the receiver polls recvmsg, sleeps in poll()
 *            as a blocking gpuipc call does, or blocks in recvmsg (the
 *            socket in blocking mode for that case, SO_RCVTIMEO bounding
 *            each call);
 *   ring     one single-producer single-consumer ring per direction in a
 *            sealed memfd both map (sent over the socket with the wake
 *            eventfds, as two unrelated processes would get it): C11
 *            acquire/release on the indexes, head and tail on their own
 *            cache lines; the receiver spins, or spins for --spin-us and
 *            then sleeps until the peer wakes it: by a futex on a word of
 *            the shared mapping, by an eventfd (poll-able), or by one byte
 *            on the socket (the socket stays the one poll-able fd).
 *
 * For each case, in one run: latency as a ping-pong with one message in
 * flight (one way: the receiver's clock at receipt minus the sender's at
 * the send, both CLOCK_MONOTONIC; round trip at the sender), medians and
 * p90; then throughput, a burst of --burst messages one way that the
 * receiver acknowledges once at the end. "Sleeps at once" cases spin not at
 * all, so every wait that finds nothing sleeps: what a peer that sleeps
 * pays for its wake.
 *
 * What a real ring would have to keep is kept here too, so the figures
 * include its cost: the peer's indexes are read only as bounds and checked
 * (a garbage index is a protocol error, never an address), slots are
 * addressed by this side's own private counter, an entry is copied out
 * before it is checked, the memfd is checked (size, seals) before it is
 * mapped, every wait has a deadline, and a dead peer is seen through the
 * socket (hang-up) while spinning, while asleep, and between cases.
 *
 * --test-fault KIND:CASE:N makes the child misbehave at its Nth message of
 * case CASE (KIND exit: it exits; garbage: it publishes a head index far
 * outside the ring): the suite checks that the run then fails cleanly.
 */
#define BENCH_NAME "ring"
#include "bench.h"
#include "bench_int.h"
#include "tree.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MSG_BYTES 64
#define SLOTS 1024u /* entries per ring; a power of two */
#define LINE 64
#define TIMEOUT_MS 10000 /* the longest any one wait in a case may take */
#define CTL_TIMEOUT_MS 60000 /* between cases */

/* ---- the shared mapping ------------------------------------------------- */

typedef struct entry {
  uint64_t seq;     /* the message's number within its case */
  uint64_t sent_ns; /* the sender's clock when it sent it */
  uint8_t pad[MSG_BYTES - 16];
} entry;
_Static_assert(sizeof(entry) == MSG_BYTES, "one entry is one message");

typedef struct ring {
  _Alignas(LINE) _Atomic uint64_t head; /* written by the producer only */
  _Alignas(LINE) _Atomic uint64_t tail; /* written by the consumer only */
  _Alignas(LINE) entry slot[SLOTS];
} ring;

/* What a process that sleeps waits for, in its word of the mapping; the
 * waker takes the word back to AWAKE (compare-exchange) before it wakes,
 * so every wake is for one sleep and is consumed by it. */
enum { AWAKE = 0, WANTS_DATA = 1, WANTS_ROOM = 2 };

typedef struct shm {
  ring r[2]; /* r[0]: parent -> child, r[1]: child -> parent */
  struct {
    _Alignas(LINE) _Atomic uint32_t word; /* also the futex word */
  } sleep[2]; /* [0] the parent's, [1] the child's */
} shm;

/* ---- cases --------------------------------------------------------------- */

typedef enum { T_SOCKET, T_RING } transport;
/* W_BLOCK: the socket transport only, a receiver blocked in recvmsg. */
typedef enum { W_SPIN, W_FUTEX, W_EVENTFD, W_SOCKET, W_BLOCK } wake_kind;
static const char *const wake_names[] = {"none", "futex", "eventfd", "socket",
                                         "blocking"};

typedef struct bcase {
  const char *key;  /* the JSON row's `case` */
  const char *text; /* as printed */
  transport t;
  wake_kind w; /* socket transport: W_SPIN polls recvmsg, W_SOCKET sleeps
                * in poll(), W_BLOCK blocks in recvmsg */
  bool spin_first; /* spin --spin-us before sleeping (else sleep at once) */
} bcase;

static const bcase cases[] = {
    {"socket_polled", "socket, receiver polls recvmsg", T_SOCKET, W_SPIN,
     false},
    {"socket_poll", "socket, receiver sleeps in poll()", T_SOCKET, W_SOCKET,
     false},
    {"socket_blocking", "socket, receiver blocks in recvmsg", T_SOCKET,
     W_BLOCK, false},
    {"ring_spin", "ring, receiver spins", T_RING, W_SPIN, false},
    {"ring_futex_spin", "ring, spin, then futex", T_RING, W_FUTEX, true},
    {"ring_futex", "ring, futex (sleeps at once)", T_RING, W_FUTEX, false},
    {"ring_eventfd_spin", "ring, spin, then eventfd", T_RING, W_EVENTFD, true},
    {"ring_eventfd", "ring, eventfd (sleeps at once)", T_RING, W_EVENTFD,
     false},
    {"ring_sockwake_spin", "ring, spin, then socket wake", T_RING, W_SOCKET,
     true},
    {"ring_sockwake", "ring, socket wake (sleeps at once)", T_RING, W_SOCKET,
     false},
};
#define NCASES (int)(sizeof cases / sizeof cases[0])

static int case_index(const char *key) {
  for (int i = 0; i < NCASES; i++)
    if (strcmp(cases[i].key, key) == 0)
      return i;
  return -1;
}

/* The `wake` column: how the receiver is woken, or how it waits for a
 * socket. */
static const char *wake_name(const bcase *c) {
  if (c->t == T_SOCKET)
    return c->w == W_SPIN ? "none" : c->w == W_BLOCK ? "blocking" : "poll";
  return wake_names[c->w];
}

/* ---- control messages over the socket ------------------------------------ */

enum { OP_RUN = 1, OP_QUIT };

typedef struct ctl {
  uint32_t op, kase;
  uint64_t iters, burst, spin_ns;
  uint8_t pad[MSG_BYTES - 32];
} ctl;

typedef struct result {
  double one_way_med_us, one_way_p90_us;
  uint64_t lat_sleeps, burst_sleeps, burst_got;
  uint8_t pad[MSG_BYTES - 40];
} result;
_Static_assert(sizeof(ctl) == MSG_BYTES && sizeof(result) == MSG_BYTES,
               "control messages are one message");

/* ---- one side's private state -------------------------------------------- */

typedef struct side {
  int who;         /* 0 parent, 1 child */
  pid_t peer_pid;
  int sock;        /* this side's end of the socketpair */
  int efd_mine;    /* the eventfd this side sleeps on */
  int efd_peer;    /* the one that wakes the peer */
  shm *m;
  ring *tx, *rx;
  _Atomic uint32_t *mine, *peer; /* sleep words */
  /* Private counters: slots are addressed only by these. The peer's index
   * as last read is kept only to bound how far this side may go. */
  uint64_t tx_head, tx_tail_seen;
  uint64_t rx_tail, rx_head_seen;
  wake_kind w;
  bool spin_first;
  uint64_t spin_ns;
  uint64_t sleeps;
  const char *what; /* the case, for messages */
  /* --test-fault, child only */
  int fault_kind; /* 0 none, 1 exit, 2 garbage */
  int fault_case;
  uint64_t fault_after, fault_count;
} side;

static char why[512]; /* this process's last failure */

static int fail(const char *fmt, ...) GPUIPC__PRINTF(1, 2);
static int fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  return -1;
}

static const char *who_peer(const side *s) {
  return s->who == 0 ? "the child" : "the parent";
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* Milliseconds until the deadline for poll(), at least 0. */
static int ms_left(uint64_t deadline) {
  uint64_t now = gpuipc__now_ns();
  return now >= deadline ? 0 : (int)((deadline - now + 999999) / 1000000);
}

static int timed_out(const side *s) {
  return fail("%s: no word from %s (pid %d) for %d ms", s->what, who_peer(s),
              (int)s->peer_pid, TIMEOUT_MS);
}

static int gone(const side *s) {
  return fail("%s: %s (pid %d) is gone (the socket hung up)", s->what,
              who_peer(s), (int)s->peer_pid);
}

/* The peer is alive as far as its socket says (no hang-up). */
static int peer_check(const side *s) {
  struct pollfd p = {s->sock, 0, 0};
  int r = poll(&p, 1, 0);
  if (r < 0 && errno != EINTR)
    return fail("%s: poll: %s", s->what, strerror(errno));
  if (r > 0 && (p.revents & (POLLHUP | POLLERR | POLLNVAL)))
    return gone(s);
  return 0;
}

/* ---- the socket: whole messages over a stream ---------------------------- */

/* Sends len bytes, waiting in poll() for room as the transport does. */
static int sock_send_all(const side *s, const void *buf, size_t len,
                         const int *fds, int nfds) {
  size_t off = 0;
  uint64_t deadline = 0;
  while (off < len) {
    struct iovec iov = {(char *)buf + off, len - off};
    size_t w = 0;
    gpuipc_status st = gpuipc__sock_send(s->sock, &iov, 1, off ? NULL : fds,
                                         off ? 0 : nfds, false, MSG_DONTWAIT,
                                         &w);
    if (st == GPUIPC_OK) {
      off += w;
      continue;
    }
    if (st == GPUIPC_E_PEER_GONE)
      return gone(s);
    if (st != GPUIPC_E_WOULD_BLOCK)
      return fail("%s: %s", s->what, gpuipc_last_error());
    if (deadline == 0)
      deadline = gpuipc__now_ns() + (uint64_t)TIMEOUT_MS * 1000000u;
    struct pollfd p = {s->sock, POLLOUT, 0};
    int r = poll(&p, 1, ms_left(deadline));
    if (r < 0 && errno != EINTR)
      return fail("%s: poll: %s", s->what, strerror(errno));
    if (r == 0)
      return timed_out(s);
    if (p.revents & (POLLHUP | POLLERR))
      return gone(s);
  }
  return 0;
}

/* How a socket receiver waits for bytes. */
typedef enum {
  RX_POLL,  /* non-blocking recvmsg, poll() between tries (gpuipc's way) */
  RX_SPIN,  /* non-blocking recvmsg, again and again */
  RX_BLOCK, /* one blocking recvmsg, bounded by SO_RCVTIMEO */
} rx_how;

static rx_how rx_how_of(wake_kind w) {
  return w == W_SPIN ? RX_SPIN : w == W_BLOCK ? RX_BLOCK : RX_POLL;
}

/* Receives up to cap bytes (at least one). *sleeps counts the polls that
 * waited. fds: up to 3 descriptors that came with the bytes. */
static int sock_recv_some(const side *s, void *buf, size_t cap, rx_how how,
                          int timeout_ms, size_t *got, uint64_t *sleeps,
                          int *fds, int *nfds) {
  uint64_t deadline = 0;
  unsigned k = 0;
  bool polled = how == RX_SPIN;
  for (;;) {
    /* Blocking: the socket is in blocking mode for the case, and its
     * SO_RCVTIMEO (TIMEOUT_MS) bounds the call (then EAGAIN). */
    gpuipc_status st = gpuipc__sock_recv(
        s->sock, buf, cap, how == RX_BLOCK ? 0 : MSG_DONTWAIT, fds,
        fds ? 3 : 0, nfds, NULL, NULL, got);
    if (st == GPUIPC_OK) {
      if (*got == 0)
        return gone(s);
      return 0;
    }
    if (st == GPUIPC_E_PEER_GONE)
      return gone(s);
    if (st != GPUIPC_E_WOULD_BLOCK)
      return fail("%s: %s", s->what, gpuipc_last_error());
    if (how == RX_BLOCK)
      return timed_out(s);
    if (polled) {
      cpu_relax();
      if ((++k & 63) != 0)
        continue;
    }
    uint64_t now = gpuipc__now_ns();
    if (deadline == 0)
      deadline = now + (uint64_t)timeout_ms * 1000000u;
    else if (now >= deadline)
      return timed_out(s);
    if (polled)
      continue;
    struct pollfd p = {s->sock, POLLIN, 0};
    if (sleeps)
      (*sleeps)++;
    int r = poll(&p, 1, ms_left(deadline));
    if (r < 0 && errno != EINTR)
      return fail("%s: poll: %s", s->what, strerror(errno));
    if (r == 0)
      return timed_out(s);
  }
}

static int sock_recv_exact(const side *s, void *buf, size_t len, rx_how how,
                           int timeout_ms, uint64_t *sleeps) {
  size_t off = 0;
  while (off < len) {
    size_t got = 0;
    if (sock_recv_some(s, (char *)buf + off, len - off, how, timeout_ms,
                       &got, sleeps, NULL, NULL) < 0)
      return -1;
    off += got;
  }
  return 0;
}

/* ---- the ring: waits, wakes, bounds -------------------------------------- */

/* 1 when an entry is there to read, 0 when not, -1 when the peer's head
 * index cannot be: it may run at most SLOTS ahead of our tail and never
 * behind it (unsigned distance). Never an address: only a bound. */
static int rx_ready(side *s) {
  if (s->rx_head_seen != s->rx_tail)
    return 1;
  uint64_t h = atomic_load_explicit(&s->rx->head, memory_order_acquire);
  if (h - s->rx_tail > SLOTS)
    return fail("%s: %s published head index %llu, outside the ring (tail "
                "%llu, %u slots): refused as a broken or hostile peer",
                s->what, who_peer(s), (unsigned long long)h,
                (unsigned long long)s->rx_tail, SLOTS);
  s->rx_head_seen = h;
  return h != s->rx_tail;
}

/* 1 when a slot is free to write, 0 when not, -1 when the peer's tail is
 * not in [head - SLOTS, head]. */
static int tx_room(side *s) {
  if (s->tx_head - s->tx_tail_seen < SLOTS)
    return 1;
  uint64_t t = atomic_load_explicit(&s->tx->tail, memory_order_acquire);
  if (s->tx_head - t > SLOTS)
    return fail("%s: %s published tail index %llu, outside the ring (head "
                "%llu, %u slots): refused as a broken or hostile peer",
                s->what, who_peer(s), (unsigned long long)t,
                (unsigned long long)s->tx_head, SLOTS);
  s->tx_tail_seen = t;
  return s->tx_head - t < SLOTS;
}

static long futex(_Atomic uint32_t *w, int op, uint32_t val,
                  const struct timespec *ts) {
  /* Not FUTEX_PRIVATE_FLAG: the word is in a mapping shared between
   * processes, which the kernel keys by the mapped file and offset. */
  return syscall(SYS_futex, (void *)w, op, val, ts, NULL, 0);
}

/* Waits until the peer has taken this side's sleep word back to AWAKE and
 * its wake has come (eventfd: readable; socket: one byte), and consumes the
 * wake. Bounded by the deadline; a dead peer is seen on the socket. */
static int await_wake(side *s, uint32_t wanted, uint64_t deadline) {
  for (;;) {
    int r;
    if (s->w == W_FUTEX) {
      if (atomic_load(s->mine) != wanted)
        return 0;
      /* Slices of 10 ms: a futex sleeper cannot see its peer die, so it
       * looks at the socket between slices. */
      struct timespec ts = {0, 10 * 1000 * 1000};
      if (futex(s->mine, FUTEX_WAIT, wanted, &ts) != 0 && errno != EAGAIN &&
          errno != EINTR && errno != ETIMEDOUT)
        return fail("%s: futex wait: %s", s->what, strerror(errno));
      if (atomic_load(s->mine) != wanted)
        return 0;
      if (peer_check(s) < 0)
        return -1;
    } else if (s->w == W_EVENTFD) {
      struct pollfd p[2] = {{s->efd_mine, POLLIN, 0}, {s->sock, 0, 0}};
      r = poll(p, 2, ms_left(deadline));
      if (r < 0 && errno != EINTR)
        return fail("%s: poll: %s", s->what, strerror(errno));
      if (p[0].revents & POLLIN) {
        uint64_t v;
        ssize_t n;
        GPUIPC__EINTR_RETRY(n, read(s->efd_mine, &v, sizeof v));
        if (n == (ssize_t)sizeof v)
          return 0;
        if (n < 0 && errno != EAGAIN)
          return fail("%s: eventfd read: %s", s->what, strerror(errno));
      }
      if (p[1].revents & (POLLHUP | POLLERR | POLLNVAL))
        return gone(s);
    } else { /* W_SOCKET */
      struct pollfd p = {s->sock, POLLIN, 0};
      r = poll(&p, 1, ms_left(deadline));
      if (r < 0 && errno != EINTR)
        return fail("%s: poll: %s", s->what, strerror(errno));
      if (r > 0) {
        char b;
        size_t got = 0;
        gpuipc_status st = gpuipc__sock_recv(s->sock, &b, 1, MSG_DONTWAIT,
                                             NULL, 0, NULL, NULL, NULL, &got);
        if (st == GPUIPC_OK && got == 1)
          return 0;
        if ((st == GPUIPC_OK && got == 0) || st == GPUIPC_E_PEER_GONE)
          return gone(s);
        if (st != GPUIPC_E_WOULD_BLOCK)
          return fail("%s: %s", s->what, gpuipc_last_error());
      }
    }
    if (gpuipc__now_ns() >= deadline)
      return timed_out(s);
  }
}

/* Waits until ready(s) is not 0: spins (the whole time for W_SPIN, else
 * for spin_ns), then sleeps, saying in its word what it waits for so the
 * peer wakes it when that changes. */
static int wait_for(side *s, int (*ready)(side *), uint32_t wanted) {
  int r = ready(s);
  if (r != 0)
    return r < 0 ? -1 : 0;
  uint64_t start = gpuipc__now_ns();
  uint64_t deadline = start + (uint64_t)TIMEOUT_MS * 1000000u;
  if (s->w == W_SPIN || s->spin_first) {
    uint64_t spin_end = s->w == W_SPIN ? deadline : start + s->spin_ns;
    for (unsigned k = 1;; k++) {
      r = ready(s);
      if (r != 0)
        return r < 0 ? -1 : 0;
      cpu_relax();
      if ((k & 63) != 0)
        continue;
      uint64_t now = gpuipc__now_ns();
      if (now >= deadline)
        return timed_out(s);
      if ((k & 4095) == 0 && peer_check(s) < 0)
        return -1;
      if (now >= spin_end)
        break;
    }
  }
  for (;;) {
    /* Say what we wait for, then look again: the peer publishes, then
     * looks at our word (both with a full fence between), so either we
     * see its entry or it sees our word. */
    atomic_store(s->mine, wanted);
    atomic_thread_fence(memory_order_seq_cst);
    r = ready(s);
    if (r != 0) {
      uint32_t w = wanted;
      if (!atomic_compare_exchange_strong(s->mine, &w, AWAKE) &&
          await_wake(s, wanted, deadline) < 0) /* its wake is on the way */
        return -1;
      return r < 0 ? -1 : 0;
    }
    s->sleeps++;
    if (await_wake(s, wanted, deadline) < 0)
      return -1;
  }
}

/* After publishing: wakes the peer if it sleeps waiting for what we just
 * made (data or room). */
static int wake_peer(side *s, uint32_t made) {
  if (s->w == W_SPIN)
    return 0;
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(s->peer, memory_order_relaxed) != made)
    return 0;
  uint32_t w = made;
  if (!atomic_compare_exchange_strong(s->peer, &w, AWAKE))
    return 0;
  if (s->w == W_FUTEX) {
    if (futex(s->peer, FUTEX_WAKE, 1, NULL) < 0)
      return fail("%s: futex wake: %s", s->what, strerror(errno));
  } else if (s->w == W_EVENTFD) {
    uint64_t one = 1;
    ssize_t n;
    GPUIPC__EINTR_RETRY(n, write(s->efd_peer, &one, sizeof one));
    /* EAGAIN: the counter is full, so a wake is pending all the same. */
    if (n < 0 && errno != EAGAIN)
      return fail("%s: eventfd write: %s", s->what, strerror(errno));
  } else {
    struct iovec iov = {"w", 1};
    size_t sent = 0;
    gpuipc_status st = gpuipc__sock_send(s->sock, &iov, 1, NULL, 0, false,
                                         MSG_DONTWAIT, &sent);
    /* WOULD_BLOCK: the peer has unread bytes, so a wake is pending. */
    if (st == GPUIPC_E_PEER_GONE)
      return gone(s);
    if (st != GPUIPC_OK && st != GPUIPC_E_WOULD_BLOCK)
      return fail("%s: %s", s->what, gpuipc_last_error());
  }
  return 0;
}

static int ring_put(side *s, uint64_t seq) {
  if (wait_for(s, tx_room, WANTS_ROOM) < 0)
    return -1;
  entry *e = &s->tx->slot[s->tx_head & (SLOTS - 1)];
  e->seq = seq;
  e->sent_ns = gpuipc__now_ns();
  atomic_store_explicit(&s->tx->head, ++s->tx_head, memory_order_release);
  return wake_peer(s, WANTS_DATA);
}

/* Takes the next entry: copied out first (the peer can still write the
 * slot), then checked. */
static int ring_get(side *s, uint64_t want_seq, entry *out) {
  if (wait_for(s, rx_ready, WANTS_DATA) < 0)
    return -1;
  memcpy(out, &s->rx->slot[s->rx_tail & (SLOTS - 1)], sizeof *out);
  atomic_store_explicit(&s->rx->tail, ++s->rx_tail, memory_order_release);
  if (out->seq != want_seq)
    return fail("%s: entry %llu from %s says it is %llu", s->what,
                (unsigned long long)want_seq, who_peer(s),
                (unsigned long long)out->seq);
  return wake_peer(s, WANTS_ROOM);
}

/* ---- one case, each side's part ------------------------------------------ */

/* This side's socket end: blocking for a case whose receiver blocks in
 * recvmsg (each call still bounded by SO_RCVTIMEO), else non-blocking as
 * the transport keeps it. Sends always say MSG_DONTWAIT. */
static int sock_blocking(const side *s, bool blocking) {
  int fl = fcntl(s->sock, F_GETFL);
  if (fl < 0 ||
      fcntl(s->sock, F_SETFL, blocking ? fl & ~O_NONBLOCK : fl | O_NONBLOCK))
    return fail("%s: fcntl: %s", s->what, strerror(errno));
  return 0;
}

static int setup_case(side *s, const bcase *c, uint64_t spin_ns) {
  s->what = c->text;
  s->w = c->w;
  s->spin_first = c->spin_first;
  s->spin_ns = spin_ns;
  s->sleeps = 0;
  return sock_blocking(s, c->w == W_BLOCK);
}

/* The child's fault, when asked for: after fault_after messages of its
 * case. */
static void child_fault(side *s, int kase) {
  if (s->fault_kind == 0 || kase != s->fault_case ||
      ++s->fault_count < s->fault_after)
    return;
  if (s->fault_kind == 1)
    _exit(3);
  /* garbage: a head far past anything the parent may read, published and
   * woken for as an entry would be, and nothing more (the parent must
   * refuse it and end the run, killing us). */
  atomic_store(&s->tx->head, s->tx_head + 5u * SLOTS);
  (void)wake_peer(s, WANTS_DATA);
  sleep(30);
  _exit(4);
}

static int sock_msg_send(side *s, uint64_t seq) {
  entry e;
  memset(&e, 0, sizeof e);
  e.seq = seq;
  e.sent_ns = gpuipc__now_ns();
  return sock_send_all(s, &e, sizeof e, NULL, 0);
}

static int sock_msg_recv(side *s, uint64_t seq, entry *e) {
  if (sock_recv_exact(s, e, sizeof *e, rx_how_of(s->w), TIMEOUT_MS,
                      &s->sleeps) < 0)
    return -1;
  if (e->seq != seq)
    return fail("%s: message %llu from %s says it is %llu", s->what,
                (unsigned long long)seq, who_peer(s),
                (unsigned long long)e->seq);
  return 0;
}

static int msg_send(side *s, const bcase *c, uint64_t seq) {
  return c->t == T_RING ? ring_put(s, seq) : sock_msg_send(s, seq);
}
static int msg_recv(side *s, const bcase *c, uint64_t seq, entry *e) {
  return c->t == T_RING ? ring_get(s, seq, e) : sock_msg_recv(s, seq, e);
}

/* Parent: ping n times (the round trip of each into rtt), then send the
 * burst and wait for its acknowledgement. */
static int parent_case(side *s, const bcase *c, uint64_t n, uint64_t warm,
                       uint64_t burst, double *rtt, double *burst_s,
                       uint64_t *lat_sleeps, uint64_t *burst_sleeps) {
  entry e;
  for (uint64_t i = 0; i < n + warm; i++) {
    uint64_t t0 = gpuipc__now_ns();
    if (msg_send(s, c, i) < 0 || msg_recv(s, c, i, &e) < 0)
      return -1;
    if (i >= warm)
      rtt[i - warm] = (double)(gpuipc__now_ns() - t0) / 1000.0;
  }
  *lat_sleeps = s->sleeps;
  s->sleeps = 0;
  uint64_t t0 = gpuipc__now_ns();
  for (uint64_t i = 0; i < burst; i++)
    if (msg_send(s, c, i) < 0)
      return -1;
  if (msg_recv(s, c, burst, &e) < 0)
    return -1;
  *burst_s = (double)(gpuipc__now_ns() - t0) / 1e9;
  *burst_sleeps = s->sleeps;
  return 0;
}

/* The receiver of a socket burst reads what is there at once, as the
 * transport reads into its buffer, and checks every message. */
static int sock_burst_recv(side *s, uint64_t burst) {
  static char buf[64 * 1024];
  size_t have = 0;
  uint64_t next = 0;
  while (next < burst) {
    size_t got = 0;
    if (sock_recv_some(s, buf + have, sizeof buf - have, rx_how_of(s->w),
                       TIMEOUT_MS, &got, &s->sleeps, NULL, NULL) < 0)
      return -1;
    have += got;
    size_t off = 0;
    for (; off + MSG_BYTES <= have && next < burst; off += MSG_BYTES, next++) {
      entry e;
      memcpy(&e, buf + off, sizeof e);
      if (e.seq != next)
        return fail("%s: message %llu from %s says it is %llu", s->what,
                    (unsigned long long)next, who_peer(s),
                    (unsigned long long)e.seq);
    }
    if (off < have)
      memmove(buf, buf + off, have - off);
    have -= off;
    if (next == burst && have != 0)
      return fail("%s: %zu bytes past the burst", s->what, have);
  }
  return 0;
}

/* Child: answer n pings (one way = now minus the entry's send time), then
 * take the burst and acknowledge it. */
static int child_case(side *s, int kase, uint64_t n, uint64_t warm,
                      uint64_t burst, result *out) {
  const bcase *c = &cases[kase];
  double *ow = calloc((size_t)n + 1, sizeof *ow);
  if (ow == NULL)
    return fail("out of memory");
  entry e;
  for (uint64_t i = 0; i < n + warm; i++) {
    if (msg_recv(s, c, i, &e) < 0)
      goto fail;
    uint64_t t = gpuipc__now_ns();
    child_fault(s, kase);
    if (i >= warm)
      ow[i - warm] = (double)(t - e.sent_ns) / 1000.0;
    if (msg_send(s, c, i) < 0)
      goto fail;
  }
  out->one_way_med_us = bench_pct(ow, n, 0.5);
  out->one_way_p90_us = bench_pct(ow, n, 0.9);
  out->lat_sleeps = s->sleeps;
  s->sleeps = 0;
  if (c->t == T_RING) {
    for (uint64_t i = 0; i < burst; i++)
      if (ring_get(s, i, &e) < 0)
        goto fail;
  } else if (sock_burst_recv(s, burst) < 0) {
    goto fail;
  }
  if (msg_send(s, c, burst) < 0)
    goto fail;
  out->burst_sleeps = s->sleeps;
  out->burst_got = burst;
  free(ow);
  return 0;
fail:
  free(ow);
  return -1;
}

/* ---- set-up: the mapping and the wake fds, over the socket --------------- */

static void side_map(side *s, shm *m) {
  s->m = m;
  s->tx = &m->r[s->who];
  s->rx = &m->r[1 - s->who];
  s->mine = &m->sleep[s->who].word;
  s->peer = &m->sleep[1 - s->who].word;
}

/* Parent: a sealed memfd of the shared mapping and one eventfd per side,
 * sent to the child over the socket. */
static int parent_setup(side *s) {
  int mfd = memfd_create("gpuipc-bench-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (mfd < 0)
    return fail("memfd_create: %s", strerror(errno));
  int efd[2] = {eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK),
                eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)};
  void *p = MAP_FAILED;
  int rc = -1;
  if (efd[0] < 0 || efd[1] < 0) {
    fail("eventfd: %s", strerror(errno));
    goto out;
  }
  if (ftruncate(mfd, (off_t)sizeof(shm)) != 0 ||
      fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    fail("memfd size and seals: %s", strerror(errno));
    goto out;
  }
  p = mmap(NULL, sizeof(shm), PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
  if (p == MAP_FAILED) {
    fail("mmap: %s", strerror(errno));
    goto out;
  }
  side_map(s, p);
  s->efd_mine = efd[0];
  s->efd_peer = efd[1];
  efd[0] = efd[1] = -1;
  int fds[3] = {mfd, s->efd_peer, s->efd_mine}; /* the child's, then ours */
  char hello[MSG_BYTES] = "gpuipc bench ring";
  s->what = "set-up";
  rc = sock_send_all(s, hello, sizeof hello, fds, 3);
out:
  if (rc < 0 && p != MAP_FAILED)
    munmap(p, sizeof(shm));
  close(mfd);
  if (efd[0] >= 0)
    close(efd[0]);
  if (efd[1] >= 0)
    close(efd[1]);
  return rc;
}

static bool is_eventfd(int fd) {
  char path[64], link[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n < 0)
    return false;
  link[n] = '\0';
  return strcmp(link, "anon_inode:[eventfd]") == 0;
}

/* Child: takes the mapping only if it is a memfd of the right size that
 * cannot shrink under it (no SIGBUS), and the wake fds only if they are
 * eventfds. */
static int child_setup(side *s) {
  char hello[MSG_BYTES];
  int fds[3] = {-1, -1, -1}, nfds = 0;
  size_t got = 0;
  s->what = "set-up";
  if (sock_recv_some(s, hello, sizeof hello, RX_POLL, CTL_TIMEOUT_MS, &got,
                     NULL, fds, &nfds) < 0)
    return -1;
  int rc = -1;
  struct stat st;
  int seals = nfds == 3 ? fcntl(fds[0], F_GET_SEALS) : -1;
  if (nfds != 3)
    fail("set-up: %d descriptors (want 3)", nfds);
  else if (fstat(fds[0], &st) != 0 || st.st_size != (off_t)sizeof(shm) ||
           seals < 0 || !(seals & F_SEAL_SHRINK))
    fail("set-up: the mapping's fd is not a memfd of %zu bytes sealed against "
         "shrinking",
         sizeof(shm));
  else if (!is_eventfd(fds[1]) || !is_eventfd(fds[2]))
    fail("set-up: the wake descriptors are not eventfds");
  else {
    void *p =
        mmap(NULL, sizeof(shm), PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    if (p == MAP_FAILED)
      fail("mmap: %s", strerror(errno));
    else {
      side_map(s, p);
      s->efd_mine = fds[1];
      s->efd_peer = fds[2];
      fds[1] = fds[2] = -1;
      rc = 0;
    }
  }
  for (int i = 0; i < nfds; i++)
    if (fds[i] >= 0)
      close(fds[i]);
  return rc;
}

static void child_main(side *s) {
  if (child_setup(s) < 0)
    goto fail;
  for (;;) {
    ctl m;
    s->what = "waiting for the next case";
    if (sock_recv_exact(s, &m, sizeof m, RX_POLL, CTL_TIMEOUT_MS, NULL) < 0)
      goto fail;
    if (m.op == OP_QUIT)
      _exit(0);
    if (m.op != OP_RUN || m.kase >= (uint32_t)NCASES || m.iters == 0 ||
        m.iters > ((uint64_t)1 << 26)) {
      fail("bad command %u (case %u, %llu iterations)", m.op, m.kase,
           (unsigned long long)m.iters);
      goto fail;
    }
    if (setup_case(s, &cases[m.kase], m.spin_ns) < 0)
      goto fail;
    result r;
    memset(&r, 0, sizeof r);
    if (child_case(s, (int)m.kase, m.iters, m.iters / 10, m.burst, &r) < 0)
      goto fail;
    s->what = "reporting";
    if (sock_send_all(s, &r, sizeof r, NULL, 0) < 0)
      goto fail;
  }
fail:
  fprintf(stderr, "gpuipc bench ring (child): %s\n", why);
  _exit(1);
}

/* ---- the command --------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: gpuipc bench ring [--quick] [--iters N] [--burst N] "
          "[--spin-us N] [--json FILE]\n"
          "  %d-byte messages between two processes: the Unix socket the "
          "transport uses\n"
          "  against a shared-memory ring (spinning, futex, eventfd or socket "
          "wake);\n"
          "  latency (median, p90) and throughput; no GPU needed\n"
          "  --quick      1000 iterations, bursts of 20000\n"
          "  --iters N    ping-pongs per case (default 20000)\n"
          "  --burst N    messages per throughput burst (default 500000)\n"
          "  --spin-us N  how long a receiver spins before it sleeps "
          "(default 50)\n",
          MSG_BYTES);
}

static int parse_fault(const char *arg, side *s) {
  char kind[16], name[32];
  unsigned long long n = 0;
  if (sscanf(arg, "%15[^:]:%31[^:]:%llu", kind, name, &n) != 3 || n == 0)
    return -1;
  s->fault_kind = strcmp(kind, "exit") == 0      ? 1
                  : strcmp(kind, "garbage") == 0 ? 2
                                                 : 0;
  s->fault_case = case_index(name);
  s->fault_after = n;
  /* garbage is a ring index: ring cases only */
  if (s->fault_kind == 0 || s->fault_case < 0 ||
      (s->fault_kind == 2 && cases[s->fault_case].t != T_RING))
    return -1;
  return 0;
}

static bool number(const char *a, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(a, &end, 10);
  if (errno || end == a || *end || a[0] == '-' || v < lo || v > hi)
    return false;
  *out = v;
  return true;
}

/* Ends the child (it may be gone already) and says how it ended. */
static void reap(pid_t pid, bool failed) {
  int st = 0;
  if (failed)
    kill(pid, SIGKILL);
  if (waitpid(pid, &st, 0) != pid)
    return;
  if (WIFEXITED(st) && WEXITSTATUS(st) != 0)
    fprintf(stderr, "gpuipc bench ring: the child exited with status %d\n",
            WEXITSTATUS(st));
  else if (WIFSIGNALED(st) && !(failed && WTERMSIG(st) == SIGKILL))
    fprintf(stderr, "gpuipc bench ring: the child was killed by signal %d\n",
            WTERMSIG(st));
}

int gpuipc_bench_ring(int argc, char **argv) {
  bool quick = false;
  uint64_t iters = 0, burst = 0, spin_us = 50;
  side s;
  memset(&s, 0, sizeof s);
  s.efd_mine = s.efd_peer = -1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    bool more = i + 1 < argc;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--quick") == 0) {
      quick = true;
    } else if (strcmp(a, "--iters") == 0 && more &&
               number(argv[i + 1], 1, (uint64_t)1 << 26, &iters)) {
      i++;
    } else if (strcmp(a, "--burst") == 0 && more &&
               number(argv[i + 1], 1, (uint64_t)1 << 40, &burst)) {
      i++;
    } else if (strcmp(a, "--spin-us") == 0 && more &&
               number(argv[i + 1], 0, 1000000, &spin_us)) {
      i++;
    } else if (strcmp(a, "--test-fault") == 0 && more &&
               parse_fault(argv[i + 1], &s) == 0) {
      i++;
    } else if (strcmp(a, "all") != 0 && strcmp(a, "ring") != 0) {
      bool valued = strcmp(a, "--iters") == 0 || strcmp(a, "--burst") == 0 ||
                    strcmp(a, "--spin-us") == 0 ||
                    strcmp(a, "--test-fault") == 0;
      if (valued && more)
        fprintf(stderr, "gpuipc bench ring: bad value '%s' for %s\n",
                argv[i + 1], a);
      else if (valued)
        fprintf(stderr, "gpuipc bench ring: %s needs a value\n", a);
      else
        fprintf(stderr, "gpuipc bench ring: unknown option '%s'\n", a);
      usage(stderr);
      return 2;
    }
  }
  if (iters == 0)
    iters = quick ? 1000 : 20000;
  if (burst == 0)
    burst = quick ? 20000 : 500000;
  uint64_t warm = iters / 10;

  double *rtt = calloc((size_t)iters, sizeof *rtt);
  if (rtt == NULL) {
    fprintf(stderr, "gpuipc bench ring: out of memory\n");
    return 1;
  }
  int fds[2];
  if (gpuipc_conn_pair(fds) != GPUIPC_OK ||
      fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK) != 0 ||
      fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK) != 0) {
    fprintf(stderr, "gpuipc bench ring: socketpair: %s\n", strerror(errno));
    free(rtt);
    return 1;
  }
  /* Bounds a blocking recvmsg (the socket_blocking case) as a deadline
   * bounds every other wait. */
  struct timeval rcvtimeo = {TIMEOUT_MS / 1000, (TIMEOUT_MS % 1000) * 1000};
  pid_t parent = getpid();
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "gpuipc bench ring: fork: %s\n", strerror(errno));
    close(fds[0]);
    close(fds[1]);
    free(rtt);
    return 1;
  }
  if (pid == 0) {
    /* The child never returns into the command: it ends with _exit. */
    close(fds[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(1);
    s.who = 1;
    s.sock = fds[1];
    s.peer_pid = parent;
    if (setsockopt(s.sock, SOL_SOCKET, SO_RCVTIMEO, &rcvtimeo,
                   sizeof rcvtimeo) != 0) {
      fprintf(stderr, "gpuipc bench ring (child): SO_RCVTIMEO: %s\n",
              strerror(errno));
      _exit(1);
    }
    child_main(&s);
  }
  close(fds[1]);
  s.who = 0;
  s.sock = fds[0];
  s.peer_pid = pid;
  s.fault_kind = 0;

  int rc = 1;
  if (setsockopt(s.sock, SOL_SOCKET, SO_RCVTIMEO, &rcvtimeo,
                 sizeof rcvtimeo) != 0) {
    fail("SO_RCVTIMEO: %s", strerror(errno));
    goto out;
  }
  if (parent_setup(&s) < 0)
    goto out;
  printf("gpuipc bench ring: %d-byte messages between two processes, %llu "
         "iterations, bursts of %llu, %u-slot rings, spin %llu us before a "
         "sleep%s\n",
         MSG_BYTES, (unsigned long long)iters, (unsigned long long)burst,
         SLOTS, (unsigned long long)spin_us, quick ? " (--quick)" : "");
  printf("one way: the receiver's clock at receipt minus the sender's at the "
         "send (ping-pong, one message in flight);\nround trip: at the "
         "sender; msgs/s: a burst one way, acknowledged once at the end; "
         "sleeps/msg: waits that slept (latency | burst)\n");
  printf("%-36s %-7s %9s %8s %9s %8s %12s %13s\n", "case", "wake",
         "1-way us", "p90 us", "rtt us", "p90 us", "msgs/s", "sleeps/msg");
  fflush(stdout);
  gpuipc_bench_json_num("iterations", (double)iters);
  gpuipc_bench_json_num("burst", (double)burst);
  gpuipc_bench_json_num("quick", quick);
  gpuipc_bench_json_num("message_bytes", MSG_BYTES);
  gpuipc_bench_json_num("ring_slots", SLOTS);
  gpuipc_bench_json_num("spin_us", (double)spin_us);
  gpuipc_bench_json_num("timeout_ms", TIMEOUT_MS);

  double ow_med[NCASES], rate[NCASES];
  for (int k = 0; k < NCASES; k++) {
    const bcase *c = &cases[k];
    if (setup_case(&s, c, spin_us * 1000u) < 0)
      goto out;
    ctl m;
    memset(&m, 0, sizeof m);
    m.op = OP_RUN;
    m.kase = (uint32_t)k;
    m.iters = iters;
    m.burst = burst;
    m.spin_ns = spin_us * 1000u;
    double secs = 0;
    uint64_t lat_sleeps = 0, burst_sleeps = 0;
    result r;
    if (sock_send_all(&s, &m, sizeof m, NULL, 0) < 0 ||
        parent_case(&s, c, iters, warm, burst, rtt, &secs, &lat_sleeps,
                    &burst_sleeps) < 0)
      goto out;
    s.what = c->text;
    if (sock_recv_exact(&s, &r, sizeof r, RX_POLL, TIMEOUT_MS, NULL) < 0)
      goto out;
    if (r.burst_got != burst) {
      fail("%s: the child counted %llu of %llu messages", c->text,
           (unsigned long long)r.burst_got, (unsigned long long)burst);
      goto out;
    }
    double rtt_med = bench_pct(rtt, iters, 0.5), rtt_p90 = bench_pct(rtt, iters, 0.9);
    double per_s = secs > 0 ? (double)burst / secs : 0;
    /* Sleeps of both receivers per message: 2 per ping-pong, 1 per burst
     * message (the ack is one more, not counted). */
    double lat_spm =
        (double)(lat_sleeps + r.lat_sleeps) / (2.0 * (double)(iters + warm));
    double burst_spm = (double)(burst_sleeps + r.burst_sleeps) / (double)burst;
    if (c->w == W_BLOCK) /* whether a blocking recvmsg slept is not seen */
      lat_spm = burst_spm = NAN;
    ow_med[k] = r.one_way_med_us;
    rate[k] = per_s;
    char sl[32];
    if (c->w == W_BLOCK)
      snprintf(sl, sizeof sl, "-");
    else
      snprintf(sl, sizeof sl, "%.2f | %.3f", lat_spm, burst_spm);
    printf("%-36s %-7s %9.2f %8.2f %9.2f %8.2f %12.0f %13s\n", c->text,
           wake_name(c),
           r.one_way_med_us, r.one_way_p90_us, rtt_med, rtt_p90, per_s, sl);
    fflush(stdout);
    gpuipc_bench_json_row_begin("ring");
    gpuipc_bench_json_str("case", c->key);
    gpuipc_bench_json_str("transport", c->t == T_SOCKET ? "socket" : "ring");
    gpuipc_bench_json_str("wake", wake_name(c));
    /* The spin before a sleep; null where the receiver never sleeps. */
    gpuipc_bench_json_num("spin_us", c->spin_first ? (double)spin_us
                                     : c->w == W_SPIN ? NAN
                                                      : 0);
    gpuipc_bench_json_num("one_way_median_us", r.one_way_med_us);
    gpuipc_bench_json_num("one_way_p90_us", r.one_way_p90_us);
    gpuipc_bench_json_num("round_trip_median_us", rtt_med);
    gpuipc_bench_json_num("round_trip_p90_us", rtt_p90);
    gpuipc_bench_json_num("msgs_per_s", per_s);
    gpuipc_bench_json_num("latency_sleeps_per_msg", lat_spm);
    gpuipc_bench_json_num("burst_sleeps_per_msg", burst_spm);
    gpuipc_bench_json_row_end();
  }
  printf("\nmedian one way, receiver awake: socket %.2f us, ring %.2f us; "
         "receiver asleep: socket %.2f (poll) %.2f (blocking), futex %.2f, "
         "eventfd %.2f, socket wake %.2f us\nthroughput: socket %.0f, ring "
         "(spinning) %.0f, ring (eventfd after a spin) %.0f msgs/s\n",
         ow_med[case_index("socket_polled")], ow_med[case_index("ring_spin")],
         ow_med[case_index("socket_poll")],
         ow_med[case_index("socket_blocking")],
         ow_med[case_index("ring_futex")], ow_med[case_index("ring_eventfd")],
         ow_med[case_index("ring_sockwake")],
         rate[case_index("socket_polled")], rate[case_index("ring_spin")],
         rate[case_index("ring_eventfd_spin")]);
  gpuipc_bench_json_num("socket_polled_one_way_us",
                        ow_med[case_index("socket_polled")]);
  gpuipc_bench_json_num("ring_spin_one_way_us",
                        ow_med[case_index("ring_spin")]);
  gpuipc_bench_json_num("socket_polled_msgs_per_s",
                        rate[case_index("socket_polled")]);
  gpuipc_bench_json_num("ring_spin_msgs_per_s", rate[case_index("ring_spin")]);
  {
    ctl q;
    memset(&q, 0, sizeof q);
    q.op = OP_QUIT;
    s.what = "quitting";
    if (sock_send_all(&s, &q, sizeof q, NULL, 0) < 0)
      goto out;
  }
  rc = 0;
out:
  if (rc != 0)
    fprintf(stderr, "gpuipc bench ring: %s\n", why);
  close(s.sock);
  reap(pid, rc != 0);
  if (s.m)
    munmap(s.m, sizeof(shm));
  if (s.efd_mine >= 0)
    close(s.efd_mine);
  if (s.efd_peer >= 0)
    close(s.efd_peer);
  free(rtt);
  return rc;
}
