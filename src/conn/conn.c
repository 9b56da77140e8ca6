/*
 * conn.c: owns the connection transport: the per-user runtime directory,
 * listening / accepting / connecting by name (file or abstract; a lock file
 * beside a socket file makes replacing a stale one race-free), connected
 * pairs, the handshake with credential checks (a state machine, so that a
 * listener runs the handshakes of all its pending peers at once; peers of
 * another pid namespace are named by their own HELLO and followed by the
 * pidfd the kernel gives, and each side passes its liveness table), framing
 * (length, type, version, header check), file descriptors (SCM_RIGHTS,
 * through the core socket helper), partial reads and writes, timeouts,
 * non-blocking mode, and user messages (a bounded queue with backpressure).
 * It needs no CUDA; the fast-path frames are handed to handoff.c.
 *
 * Sockets are always O_NONBLOCK underneath: a "blocking" call is a poll()
 * loop bounded by the connection's timeout, so no call can wait forever on
 * a peer that stopped reading or writing, and EINTR only shortens one
 * poll() round. What a peer can make this side hold is bounded (see the
 * rule at the top of gpuipc/conn.h).
 */
#include "conn_int.h"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define RX_CHUNK 65536
#define TX_QUEUE_MAX ((size_t)8 << 20)

struct hs;

/* A listener: its socket, and the handshakes of accepted peers that have
 * not completed yet (oldest first), all watched by one epoll set so that
 * every handshake proceeds at once and the caller's poll sees them all. */
struct gpuipc_listener {
  int fd;
  int ep; /* epoll: fd and every pending handshake's socket */
  int abstract_name;
  char path[sizeof(((struct sockaddr_un *)0)->sun_path) + 2];
  /* Socket files: "<name>.lock" beside the socket, locked (flock) for the
   * listener's life; only its holder may replace a stale socket file. */
  int lock_fd;
  char lock_path[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
  gpuipc_conn_options opts;
  uint32_t *allow_uids, *allow_gids;
  struct hs *pending[GPUIPC_CONN_HANDSHAKES_MAX];
  int npending;
  uint64_t dropped; /* pending handshakes dropped for newer peers */
};

/* ---- options ------------------------------------------------------------------ */

typedef struct copts {
  gpuipc_conn_options o;
} copts;

static gpuipc_status read_opts(const gpuipc_conn_options *in, copts *out) {
  gpuipc_conn_options def = GPUIPC_CONN_OPTIONS_INIT;
  out->o = def;
  if (in == NULL)
    return GPUIPC_OK;
  GPUIPC__CHECK(gpuipc__options_copy(
      &out->o, sizeof out->o, in,
      offsetof(gpuipc_conn_options, timeout_ms) + sizeof(int),
      "gpuipc_conn_options", "GPUIPC_CONN_OPTIONS_INIT"));
  if (out->o.timeout_ms < -1)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "timeout_ms %d < -1",
                        out->o.timeout_ms);
  if (out->o.max_outstanding == 0)
    out->o.max_outstanding = 256;
  if (out->o.max_outstanding > 65536)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "max_outstanding %u > 65536",
                        out->o.max_outstanding);
  if ((out->o.n_allow_uids && !out->o.allow_uids) ||
      (out->o.n_allow_gids && !out->o.allow_gids) ||
      out->o.n_allow_uids > 4096 || out->o.n_allow_gids > 4096)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "bad uid/gid allow-list");
  if (out->o.queue_msgs == 0)
    out->o.queue_msgs = GPUIPC_CONN_QUEUE_MSGS;
  if (out->o.queue_fds == 0)
    out->o.queue_fds = GPUIPC_CONN_QUEUE_FDS;
  if (out->o.queue_bytes == 0)
    out->o.queue_bytes = GPUIPC_CONN_QUEUE_BYTES;
  if (out->o.queue_msgs > GPUIPC_CONN_QUEUE_MSGS_CAP ||
      out->o.queue_fds > GPUIPC_CONN_QUEUE_FDS_CAP ||
      out->o.queue_bytes > GPUIPC_CONN_QUEUE_BYTES_CAP)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "message queue bounds %u messages, %u descriptors, "
                        "%zu bytes: at most %u, %u, %zu",
                        out->o.queue_msgs, out->o.queue_fds,
                        out->o.queue_bytes, GPUIPC_CONN_QUEUE_MSGS_CAP,
                        GPUIPC_CONN_QUEUE_FDS_CAP, GPUIPC_CONN_QUEUE_BYTES_CAP);
  if (out->o.handshake_timeout_ms == 0)
    out->o.handshake_timeout_ms = GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS;
  if (out->o.handshake_timeout_ms < 0 ||
      out->o.handshake_timeout_ms > GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS_CAP)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "handshake_timeout_ms %d: 1 to %d (0: the default)",
                        out->o.handshake_timeout_ms,
                        GPUIPC_CONN_HANDSHAKE_TIMEOUT_MS_CAP);
  if (out->o.order != GPUIPC_ORDER_MEMOP && out->o.order != GPUIPC_ORDER_NONE &&
      out->o.order != GPUIPC_ORDER_EVENT)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "unknown order mode %d",
                        (int)out->o.order);
  return GPUIPC_OK;
}

/* ---- names and the runtime directory ------------------------------------------ */

static gpuipc_status check_name(const char *name) {
  if (name == NULL || *name == '\0')
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "connection name is empty");
  size_t n = 0;
  for (const char *p = name; *p; p++, n++) {
    char ch = *p;
    bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    if (!ok || n >= GPUIPC_CONN_NAME_MAX)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "connection name '%.*s...': only letters, digits, "
                          "'.', '_', '-', at most %d bytes",
                          (int)(n < 40 ? n : 40), name, GPUIPC_CONN_NAME_MAX);
  }
  if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "connection name '%s'", name);
  return GPUIPC_OK;
}

/* The runtime directory as core checks it (gpuipc__private_dir), with
 * the reason recorded for gpuipc_last_error(). */
static gpuipc_status ensure_private_dir(const char *dir) {
  char why[512];
  gpuipc_status s = gpuipc__private_dir(dir, why, sizeof why);
  return s == GPUIPC_OK ? GPUIPC_OK : gpuipc__fail(s, "%s", why);
}

static gpuipc_status make_addr(const char *name, const copts *o, bool create,
                               struct sockaddr_un *sa, socklen_t *salen,
                               char *shown, size_t shown_cap) {
  GPUIPC__CHECK(check_name(name));
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  if (o->o.abstract_name) {
    /* Abstract names need no directory; namespaced by a prefix. */
    int n = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "gpuipc/%s",
                     name);
    if (n < 0 || (size_t)n >= sizeof sa->sun_path - 1)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG, "name too long");
    *salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
    snprintf(shown, shown_cap, "@gpuipc/%s", name);
    return GPUIPC_OK;
  }
  char dir[200];
  if (o->o.runtime_dir && *o->o.runtime_dir) {
    if (snprintf(dir, sizeof dir, "%s", o->o.runtime_dir) >= (int)sizeof dir)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG, "runtime_dir too long");
  } else {
    gpuipc__default_runtime_dir(dir, sizeof dir, NULL, 0, NULL);
  }
  if (create)
    GPUIPC__CHECK(ensure_private_dir(dir));
  else {
    /* Connecting: the directory must still pass the same checks, or the
     * socket in it could be an impostor's. */
    struct stat st;
    if (lstat(dir, &st) != 0)
      return gpuipc__fail(GPUIPC_E_NOT_FOUND,
                          "nobody listens on '%s': runtime directory %s does "
                          "not exist",
                          name, dir);
    GPUIPC__CHECK(ensure_private_dir(dir));
  }
  int n = snprintf(sa->sun_path, sizeof sa->sun_path, "%s/%s.sock", dir, name);
  if (n < 0 || (size_t)n >= sizeof sa->sun_path)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "socket path %s/%s.sock is longer than %zu bytes", dir,
                        name, sizeof sa->sun_path - 1);
  *salen = (socklen_t)sizeof *sa;
  snprintf(shown, shown_cap, "%s", sa->sun_path);
  return GPUIPC_OK;
}

/* ---- connection objects ---------------------------------------------------------- */

static gpuipc_conn *conn_new(int fd, const copts *o) {
  gpuipc_conn *c = calloc(1, sizeof *c);
  if (c == NULL)
    return NULL;
  c->fd = fd;
  c->timeout_ms = o->o.timeout_ms;
  c->nonblocking = o->o.nonblocking != 0;
  c->max_outstanding = o->o.max_outstanding;
  c->order = o->o.order;
  c->q_max_msgs = o->o.queue_msgs;
  c->q_max_bytes = o->o.queue_bytes;
  c->q_max_fds = o->o.queue_fds;
  c->hs_fd = -1;
  return c;
}

static void close_rx_fds(gpuipc_conn *c) {
  for (int i = 0; i < c->rx_nfds; i++)
    close(c->rx_fds[i]);
  c->rx_nfds = 0;
}

static void free_msgs(gpuipc_conn *c) {
  gpuipc__msg *m = c->msg_head;
  while (m) {
    gpuipc__msg *n = m->next;
    for (int i = 0; i < m->nfds; i++)
      close(m->fds[i]);
    free(m);
    m = n;
  }
  c->msg_head = c->msg_tail = NULL;
  c->msg_count = c->msg_bytes = c->msg_fds = 0;
}

void gpuipc__conn_queued(const gpuipc_conn *c, size_t *msgs, size_t *bytes,
                         size_t *fds, bool *paused) {
  if (msgs)
    *msgs = c->msg_count;
  if (bytes)
    *bytes = c->msg_bytes;
  if (fds)
    *fds = c->msg_fds;
  if (paused)
    *paused = c->rx_paused;
}

static void conn_free(gpuipc_conn *c) {
  if (c->stats_open)
    gpuipc__stats_conn_close(c->stats_slot);
  if (c->fd >= 0)
    close(c->fd);
  if (c->hs_fd >= 0)
    close(c->hs_fd);
  gpuipc__live_peer_close(c->peer_table);
  close_rx_fds(c);
  free_msgs(c);
  gpuipc__watch_remove(c);
  gpuipc__peer_unref(c->peer);
  free(c->rx);
  free(c->tx);
  free(c);
}

uint64_t gpuipc__conn_deadline(const gpuipc_conn *c) {
  if (c->nonblocking || c->timeout_ms == 0)
    return 0;
  if (c->timeout_ms < 0)
    return UINT64_MAX;
  return gpuipc__now_ns() + (uint64_t)c->timeout_ms * 1000000ull;
}

static uint64_t deadline_ms(int timeout_ms) {
  if (timeout_ms < 0)
    return UINT64_MAX;
  if (timeout_ms == 0)
    return 0;
  return gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

/* Milliseconds poll() may wait until the deadline (-1 forever). */
static int poll_ms(uint64_t deadline) {
  if (deadline == UINT64_MAX)
    return -1;
  uint64_t now = gpuipc__now_ns();
  if (now >= deadline)
    return 0;
  uint64_t ms = (deadline - now + 999999) / 1000000;
  return ms > 1000000 ? 1000000 : (int)ms;
}

/* Waits for events on fd until the deadline; returns revents (0 on
 * timeout), -1 with errno on failure. EINTR restarts with the time left. */
static int wait_fd(int fd, short events, uint64_t deadline) {
  for (;;) {
    struct pollfd p = {fd, events, 0};
    int ms = poll_ms(deadline);
    int r = poll(&p, 1, ms);
    if (r > 0)
      return p.revents;
    if (r == 0)
      return 0;
    if (errno != EINTR)
      return -1;
    if (deadline != UINT64_MAX && gpuipc__now_ns() >= deadline)
      return 0;
  }
}

static gpuipc_status timed_out(const gpuipc_conn *c, uint64_t deadline,
                               const char *what) {
  if (deadline == 0)
    return gpuipc__fail(GPUIPC_E_WOULD_BLOCK, "%s would block", what);
  return gpuipc__fail(GPUIPC_E_TIMEOUT, "%s: timed out after %d ms", what,
                      c->timeout_ms);
}

gpuipc_status gpuipc__conn_ended(gpuipc_conn *c) {
  if (c->state == GPUIPC__CONN_BROKEN)
    return gpuipc__fail(GPUIPC_E_CLOSED,
                        "connection was disconnected earlier: %s",
                        c->broken_why);
  return gpuipc__fail(GPUIPC_E_PEER_GONE,
                      "the peer (pid %d) %s", c->peer_pid,
                      c->peer_said_bye ? "closed the connection"
                                       : "is gone (connection closed)");
}

static void disconnect(gpuipc_conn *c) {
  if (c->fd >= 0) {
    close(c->fd);
    c->fd = -1;
  }
  close_rx_fds(c);
  c->rx_len = 0;
  c->rx_paused = false;
  c->tx_len = c->tx_off = 0;
}

static void peer_gone(gpuipc_conn *c) {
  if (c->state != GPUIPC__CONN_OPEN)
    return;
  c->state = GPUIPC__CONN_PEER_GONE;
  gpuipc__stats_conn_state(c->stats_slot, c->state);
  GPUIPC__DEBUG("conn", "peer pid %d gone", c->peer_pid);
  disconnect(c);
  if (c->hooks)
    c->hooks->peer_gone(c);
}

/* Ends the connection on our side for a reason that is not the peer
 * leaving: logs, closes the socket, runs the peer-gone cleanup, and
 * returns `status` with the reason (later calls: GPUIPC_E_CLOSED). */
static gpuipc_status conn_vfail(gpuipc_conn *c, gpuipc_status status,
                                const char *fmt, va_list ap) {
  char why[sizeof c->broken_why];
  vsnprintf(why, sizeof why, fmt, ap);
  if (c->state == GPUIPC__CONN_OPEN) {
    GPUIPC__WARN("conn",
                 "disconnecting peer pid %d: %s", c->peer_pid, why);
    if (c->hooks)
      c->hooks->breaking(c);
    memcpy(c->broken_why, why, sizeof why);
    c->broken_status = status;
    c->state = GPUIPC__CONN_BROKEN;
    gpuipc__stats_conn_state(c->stats_slot, c->state);
    disconnect(c);
    if (c->hooks)
      c->hooks->peer_gone(c);
  }
  return gpuipc__fail(status, "peer pid %d disconnected: %s", c->peer_pid,
                      why);
}

static gpuipc_status conn_fail(gpuipc_conn *c, gpuipc_status status,
                               const char *fmt, ...) GPUIPC__PRINTF(3, 4);
static gpuipc_status conn_fail(gpuipc_conn *c, gpuipc_status status,
                               const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  gpuipc_status s = conn_vfail(c, status, fmt, ap);
  va_end(ap);
  return s;
}

gpuipc_status gpuipc__conn_break(gpuipc_conn *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  gpuipc_status s = conn_vfail(c, GPUIPC_E_PROTOCOL, fmt, ap);
  va_end(ap);
  return s;
}

/* ---- sending --------------------------------------------------------------------- */

/* Writes queued bytes; returns OK (maybe with bytes left), or an error
 * status when the peer is gone. */
static gpuipc_status flush_tx(gpuipc_conn *c) {
  while (c->tx_off < c->tx_len) {
    struct iovec iov = {c->tx + c->tx_off, c->tx_len - c->tx_off};
    size_t w = 0;
    gpuipc_status s =
        gpuipc__sock_send(c->fd, &iov, 1, NULL, 0, false, MSG_DONTWAIT, &w);
    if (s == GPUIPC_E_WOULD_BLOCK)
      return GPUIPC_OK;
    if (s == GPUIPC_E_PEER_GONE) {
      peer_gone(c);
      return gpuipc__conn_ended(c);
    }
    if (s != GPUIPC_OK)
      return s;
    c->tx_off += w;
  }
  c->tx_off = c->tx_len = 0;
  return GPUIPC_OK;
}

/* Makes room for `total` more bytes in the transmit queue (compacting it,
 * else growing it). Nothing changes when that fails. */
static gpuipc_status tx_reserve(gpuipc_conn *c, size_t total) {
  if (c->tx_off > 0 && c->tx_off == c->tx_len)
    c->tx_off = c->tx_len = 0;
  if (c->tx_len + total <= c->tx_cap)
    return GPUIPC_OK;
  if (c->tx_off > 0) {
    memmove(c->tx, c->tx + c->tx_off, c->tx_len - c->tx_off);
    c->tx_len -= c->tx_off;
    c->tx_off = 0;
  }
  if (c->tx_len + total <= c->tx_cap)
    return GPUIPC_OK;
  size_t cap = c->tx_cap ? c->tx_cap : 4096;
  while (cap < c->tx_len + total)
    cap *= 2;
  unsigned char *n = realloc(c->tx, cap);
  if (n == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "transmit queue of %zu bytes",
                        cap);
  c->tx = n;
  c->tx_cap = cap;
  return GPUIPC_OK;
}

/* Queues the bytes of the iovecs after the first `skip`; the room must
 * have been reserved (tx_reserve), so this cannot fail. */
static void tx_append(gpuipc_conn *c, const struct iovec *iov, int niov,
                      size_t skip) {
  for (int i = 0; i < niov; i++) {
    size_t l = iov[i].iov_len;
    const unsigned char *b = iov[i].iov_base;
    if (skip >= l) {
      skip -= l;
      continue;
    }
    memcpy(c->tx + c->tx_len, b + skip, l - skip);
    c->tx_len += l - skip;
    skip = 0;
  }
}

static gpuipc_status pump_once(gpuipc_conn *c);

gpuipc_status gpuipc__conn_send_frame(gpuipc_conn *c, int type, const void *p1,
                                      size_t n1, const void *p2, size_t n2,
                                      const int *fds, int nfds,
                                      uint64_t deadline) {
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  size_t len = n1 + n2;
  if (len > GPUIPC__FRAME_MAX || nfds < 0 || nfds > GPUIPC__FRAME_FDS_MAX)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "frame of %zu bytes, %d fds",
                        len, nfds);
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, (uint16_t)nfds, (uint32_t)len, 0};
  h.check = gpuipc__frame_check(&h);
  struct iovec iov[3] = {{&h, sizeof h}, {(void *)p1, n1}, {(void *)p2, n2}};
  int niov = 1 + (n1 > 0) + (n2 > 0);
  if (n1 == 0 && n2 > 0)
    iov[1] = iov[2];

  for (;;) {
    /* Older frames first: the stream's order is the send order. */
    if (c->tx_len > c->tx_off)
      GPUIPC__CHECK(flush_tx(c));
    if (c->tx_len == c->tx_off) {
      /* Room for the whole frame first: once its first byte is out, the
       * rest must be queued, or the stream would be torn. */
      GPUIPC__CHECK(tx_reserve(c, sizeof h + len));
      size_t w = 0;
      gpuipc_status s = gpuipc__sock_send(c->fd, iov, niov, fds, nfds, false,
                                          MSG_DONTWAIT, &w);
      if (s == GPUIPC_OK) {
        if (w < sizeof h + len)
          /* The descriptors went with the first byte; the rest is plain
           * bytes, flushed by later calls. */
          tx_append(c, iov, niov, w);
        return GPUIPC_OK;
      }
      if (s == GPUIPC_E_PEER_GONE) {
        peer_gone(c);
        return gpuipc__conn_ended(c);
      }
      if (s != GPUIPC_E_WOULD_BLOCK)
        return s;
    }
    /* The socket is full. Frames without descriptors are queued (the
     * caller need not wait); frames with descriptors wait, since queueing
     * them would mean duplicating the caller's descriptors. */
    if (nfds == 0 && c->tx_len - c->tx_off + sizeof h + len <= TX_QUEUE_MAX) {
      GPUIPC__CHECK(tx_reserve(c, sizeof h + len));
      tx_append(c, iov, niov, 0);
      return GPUIPC_OK;
    }
    if (deadline == 0)
      return timed_out(c, deadline, "send");
    /* While reading is paused (the application holds too many of the
     * peer's messages), wait for room only. */
    int ev = wait_fd(c->fd, c->rx_paused ? POLLOUT : POLLOUT | POLLIN,
                     deadline);
    if (ev < 0)
      return gpuipc__fail_errno(errno, "poll", "connection to pid %d",
                                c->peer_pid);
    if (ev == 0)
      return timed_out(c, deadline, "send");
    if (!c->rx_paused && (ev & (POLLIN | POLLHUP | POLLERR))) {
      /* Keep reading while we wait, so that two peers that both send
       * cannot deadlock on full sockets. */
      gpuipc_status s = pump_once(c);
      if (s != GPUIPC_OK)
        return s;
    }
  }
}

/* ---- receiving -------------------------------------------------------------------- */

/* Fills m (allocated for len bytes) and appends it to the queue. */
static void queue_msg(gpuipc_conn *c, gpuipc__msg *m, const unsigned char *p,
                      size_t len, const int *fds, int nfds) {
  m->next = NULL;
  m->len = len;
  m->nfds = nfds;
  memcpy(m->fds, fds, sizeof(int) * (size_t)nfds);
  if (len)
    memcpy(m->data, p, len);
  if (c->msg_tail)
    c->msg_tail->next = m;
  else
    c->msg_head = m;
  c->msg_tail = m;
  c->msg_count++;
  c->msg_bytes += len;
  c->msg_fds += (size_t)nfds;
}

/* True when a message of len bytes and nfds descriptors fits in the queue
 * of received messages (an empty queue takes any message). */
static bool queue_has_room(const gpuipc_conn *c, size_t len, int nfds) {
  if (c->msg_count == 0)
    return true;
  return c->msg_count < c->q_max_msgs &&
         c->msg_bytes + len <= c->q_max_bytes &&
         c->msg_fds + (size_t)nfds <= c->q_max_fds;
}

/* Parses and dispatches every complete frame in rx. */
static gpuipc_status parse_rx(gpuipc_conn *c) {
  size_t off = 0;
  gpuipc_status s = GPUIPC_OK;
  c->rx_paused = false;
  while (c->state == GPUIPC__CONN_OPEN && c->rx_len - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, c->rx + off, sizeof h);
    if (h.magic != GPUIPC__FRAME_MAGIC)
      return gpuipc__conn_break(c, "garbage on the connection (bad frame "
                                   "magic 0x%08x)",
                                h.magic);
    if (h.version != GPUIPC__FRAME_VERSION)
      return gpuipc__conn_break(c, "frame version %u, this library speaks %u",
                                h.version, GPUIPC__FRAME_VERSION);
    if (h.check != gpuipc__frame_check(&h))
      return gpuipc__conn_break(c, "frame header check mismatch (corrupted "
                                   "or forged header)");
    if (h.len > GPUIPC__FRAME_MAX)
      return gpuipc__conn_break(c, "frame length %u exceeds the maximum %u",
                                h.len, (unsigned)GPUIPC__FRAME_MAX);
    if (h.type < GPUIPC__F_MSG || h.type > GPUIPC__F_TYPE_MAX)
      return gpuipc__conn_break(c, "unexpected frame type %u", h.type);
    if (h.nfds > GPUIPC__FRAME_FDS_MAX || h.nfds > c->rx_nfds)
      return gpuipc__conn_break(c,
                                "frame declares %u file descriptors, %d "
                                "arrived",
                                h.nfds, c->rx_nfds);
    if (c->rx_len - off < sizeof h + h.len)
      break; /* the rest has not arrived yet */
    if (h.type == GPUIPC__F_MSG && !queue_has_room(c, h.len, h.nfds)) {
      /* The application has not taken enough of the messages it holds:
       * this one waits here, with its descriptors, and the socket is not
       * read until there is room (the peer feels the backpressure). */
      c->rx_paused = true;
      break;
    }
    gpuipc__msg *m = NULL;
    if (h.type == GPUIPC__F_MSG && h.len <= GPUIPC_CONN_MSG_MAX) {
      /* Allocated before the frame is consumed: without memory the frame
       * stays where it is, whole, for a later call. */
      m = malloc(sizeof *m + h.len);
      if (m == NULL) {
        s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "message of %u bytes", h.len);
        break;
      }
    }
    int fds[GPUIPC__FRAME_FDS_MAX];
    int nfds = h.nfds;
    memcpy(fds, c->rx_fds, sizeof(int) * (size_t)nfds);
    memmove(c->rx_fds, c->rx_fds + nfds,
            sizeof(int) * (size_t)(c->rx_nfds - nfds));
    c->rx_nfds -= nfds;
    const unsigned char *p = c->rx + off + sizeof h;
    off += sizeof h + h.len;
    if (h.type == GPUIPC__F_MSG) {
      if (h.len > GPUIPC_CONN_MSG_MAX) {
        for (int i = 0; i < nfds; i++)
          close(fds[i]);
        return gpuipc__conn_break(c, "message of %u bytes exceeds %d", h.len,
                                  GPUIPC_CONN_MSG_MAX);
      }
      queue_msg(c, m, p, h.len, fds, nfds);
    } else {
      s = gpuipc__conn_fast(c)->frame(c, h.type, p, h.len, fds, nfds);
      if (s != GPUIPC_OK && c->state == GPUIPC__CONN_OPEN) {
        char why[sizeof c->broken_why];
        snprintf(why, sizeof why, "%s", gpuipc_last_error());
        gpuipc_status s2 = gpuipc__conn_break(c, "%s", why);
        if (s == GPUIPC_E_NO_MEMORY)
          return s;
        return s2;
      }
    }
    if (s != GPUIPC_OK)
      return s;
  }
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  /* What was dispatched leaves rx, also when the loop stopped early. */
  if (off > 0) {
    memmove(c->rx, c->rx + off, c->rx_len - off);
    c->rx_len -= off;
  }
  if (s != GPUIPC_OK)
    return s;
  if (c->rx_len == 0 && c->rx_nfds > 0)
    return gpuipc__conn_break(c, "%d file descriptors arrived without a frame",
                              c->rx_nfds);
  return GPUIPC_OK;
}

/* One read of what is available (no waiting), then parsing. Returns OK
 * also when nothing was there; the end of the connection as a status. */
static gpuipc_status pump_once(gpuipc_conn *c) {
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  if (c->rx_paused || c->rx_len >= sizeof(gpuipc__frame_hdr)) {
    /* Complete frames may wait in rx: a message for room in the queue
     * (then nothing more is read while it still does not fit), or a frame
     * that an earlier pass had no memory for. */
    GPUIPC__CHECK(parse_rx(c));
    if (c->rx_paused)
      return GPUIPC_OK;
  }
  for (int rounds = 0; rounds < 64; rounds++) {
    if (c->rx_cap - c->rx_len < RX_CHUNK / 2) {
      size_t need = c->rx_len + RX_CHUNK;
      if (need < sizeof(gpuipc__frame_hdr) + GPUIPC__FRAME_MAX)
        need = sizeof(gpuipc__frame_hdr) + GPUIPC__FRAME_MAX;
      if (need > c->rx_cap) {
        unsigned char *n = realloc(c->rx, need);
        if (n == NULL)
          return gpuipc__fail(GPUIPC_E_NO_MEMORY, "receive buffer");
        c->rx = n;
        c->rx_cap = need;
      }
    }
    size_t room = c->rx_cap - c->rx_len, r = 0;
    int tmp[GPUIPC__FRAME_FDS_MAX], k = 0;
    gpuipc_status s =
        gpuipc__sock_recv(c->fd, c->rx + c->rx_len, room, MSG_DONTWAIT, tmp,
                          GPUIPC__FRAME_FDS_MAX, &k, NULL, NULL, &r);
    if (s == GPUIPC_E_WOULD_BLOCK)
      return GPUIPC_OK;
    if (s == GPUIPC_E_PEER_GONE) {
      peer_gone(c);
      return gpuipc__conn_ended(c);
    }
    if (s == GPUIPC_E_PROTOCOL)
      return gpuipc__conn_break(c, "peer sent more file descriptors than any "
                                   "frame carries");
    if (s == GPUIPC_E_LIMIT) {
      /* Our limit, not the peer's fault: the kernel could not install the
       * descriptors that came with a frame, so the stream cannot go on. */
      struct rlimit rl = {0, 0};
      (void)getrlimit(RLIMIT_NOFILE, &rl);
      return conn_fail(c, GPUIPC_E_LIMIT,
                       "this process has no file descriptor left (its "
                       "RLIMIT_NOFILE is %llu): the kernel dropped the "
                       "descriptors that came with a frame, so the "
                       "connection cannot go on",
                       (unsigned long long)rl.rlim_cur);
    }
    if (s != GPUIPC_OK)
      return s;
    bool bad_fds = false;
    for (int i = 0; i < k; i++) {
      if (c->rx_nfds < (int)GPUIPC__ARRAY_SIZE(c->rx_fds))
        c->rx_fds[c->rx_nfds++] = tmp[i];
      else {
        close(tmp[i]);
        bad_fds = true;
      }
    }
    if (bad_fds)
      return gpuipc__conn_break(c, "peer sent more file descriptors than any "
                                   "frame carries");
    if (r == 0) {
      /* Orderly end of stream. Whatever came before it is still
       * dispatched; a partial frame at the end is the peer's problem. */
      gpuipc_status ps = parse_rx(c);
      if (ps != GPUIPC_OK && c->state != GPUIPC__CONN_OPEN)
        return ps;
      if (c->rx_len > 0)
        GPUIPC__DEBUG("conn", "peer pid %d left in the middle of a frame "
                              "(%zu bytes)",
                      c->peer_pid, c->rx_len);
      peer_gone(c);
      return gpuipc__conn_ended(c);
    }
    c->rx_len += r;
    GPUIPC__CHECK(parse_rx(c));
    if (c->rx_paused)
      return GPUIPC_OK;
    /* A short read without descriptors drained the socket: skip the read
     * that would only say EAGAIN (a syscall per buffer on the fast path).
     * A read that brought descriptors may have stopped at a message
     * boundary the kernel keeps; read on then. Anything that arrives later
     * makes the socket readable again for the caller's poll. */
    if (r < room && k == 0)
      return GPUIPC_OK;
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc__conn_pump(gpuipc_conn *c, uint64_t deadline,
                                bool (*wait_for)(gpuipc_conn *, void *),
                                void *arg) {
  for (;;) {
    if (c->state == GPUIPC__CONN_OPEN && c->tx_len > c->tx_off) {
      gpuipc_status s = flush_tx(c);
      if (s != GPUIPC_OK && c->state == GPUIPC__CONN_OPEN)
        return s;
    }
    gpuipc_status s = pump_once(c);
    if (c->hooks)
      c->hooks->poll(c);
    if (wait_for && wait_for(c, arg))
      return GPUIPC_OK;
    if (s != GPUIPC_OK)
      return s;
    if (c->rx_paused) {
      /* Nothing more is read until the application takes messages, and
       * only it can (one thread per connection): waiting would only run
       * into the timeout. */
      if (wait_for == NULL)
        return GPUIPC_OK;
      return gpuipc__fail(GPUIPC_E_BUSY,
                          "%zu user messages (%zu bytes, %zu file "
                          "descriptors) from pid %d wait to be taken with "
                          "gpuipc_conn_recv_msg: the connection reads "
                          "nothing further until then",
                          c->msg_count, c->msg_bytes, c->msg_fds, c->peer_pid);
    }
    if (wait_for == NULL && deadline == 0)
      return GPUIPC_OK;
    if (deadline == 0 || (deadline != UINT64_MAX && gpuipc__now_ns() >= deadline))
      return wait_for ? timed_out(c, deadline, "receive") : GPUIPC_OK;
    short ev = POLLIN;
    if (c->tx_len > c->tx_off)
      ev |= POLLOUT;
    int r = wait_fd(c->fd, ev, deadline);
    if (r < 0)
      return gpuipc__fail_errno(errno, "poll", "connection to pid %d",
                                c->peer_pid);
    if (r == 0) {
      if (wait_for == NULL)
        return GPUIPC_OK;
      return timed_out(c, deadline, "receive");
    }
    if (wait_for == NULL && !(r & (POLLIN | POLLHUP | POLLERR)))
      continue;
    if (wait_for == NULL) {
      /* Progress with a timeout: one pass over what arrived is enough. */
      s = pump_once(c);
      if (c->hooks)
        c->hooks->poll(c);
      return s;
    }
  }
}

/* ---- handshake ---------------------------------------------------------------------- */

static bool peer_allowed(const copts *o, uint32_t uid, uint32_t gid) {
  if (uid == (uint32_t)geteuid())
    return true;
  for (size_t i = 0; i < o->o.n_allow_uids; i++)
    if (o->o.allow_uids[i] == uid)
      return true;
  for (size_t i = 0; i < o->o.n_allow_gids; i++)
    if (o->o.allow_gids[i] == gid)
      return true;
  return false;
}

/* One handshake, run by both sides alike as a small state machine, so that
 * a listener can run many at once (gpuipc_accept) and a connecting side
 * simply waits on one (hs_run): send HELLO (with credentials); read the
 * peer's HELLO and check its credentials; send ACCEPT or REFUSE; read the
 * peer's verdict. Frames are read exactly (header, then payload) without
 * the frame machinery, so nothing after the handshake is consumed here.
 * `pre` carries SO_PEERCRED for sockets made by connect/accept (the
 * kernel's record of the peer at connect time). */
enum { HS_HELLO = 0, HS_VERDICT = 1, HS_LIVE = 2 };

#define HS_PAYLOAD_MAX 512

typedef struct hs {
  gpuipc_conn *c;
  copts o;
  struct ucred pre;
  bool have_pre;
  int stage;
  bool hello_failed; /* our HELLO did not leave: the peer closed */
  bool peer_ns;      /* the peer's HELLO has GPUIPC__HELLO_F_NS */
  bool foreign;      /* it is of another pid namespace (watched once done) */
  unsigned char buf[sizeof(gpuipc__frame_hdr) + HS_PAYLOAD_MAX];
  size_t got, want;
  struct ucred cred; /* with the frame's first byte */
  bool have_cred;
  uint64_t deadline; /* listener side: when this peer is dropped */
  bool ready;        /* listener side: epoll said its socket is readable */
} hs;

/* Writes one handshake frame whole (the socket is empty at this point, so
 * it fits; the loop covers EINTR and a peer that is slow to drain), with
 * our credentials attached for the kernel to vouch for. */
static gpuipc_status hs_write_fds(int fd, int type, const void *p, size_t n,
                                  const int *fds, int nfds,
                                  uint64_t deadline) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, (uint16_t)nfds, (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  unsigned char buf[sizeof h + HS_PAYLOAD_MAX];
  if (n > HS_PAYLOAD_MAX)
    return gpuipc__fail(GPUIPC_E_INTERNAL, "handshake frame too long");
  memcpy(buf, &h, sizeof h);
  if (n)
    memcpy(buf + sizeof h, p, n);
  size_t total = sizeof h + n, off = 0;
  while (off < total) {
    struct iovec iov = {buf + off, total - off};
    size_t w = 0;
    gpuipc_status s =
        gpuipc__sock_send(fd, &iov, 1, off == 0 ? fds : NULL,
                          off == 0 ? nfds : 0, off == 0, MSG_DONTWAIT, &w);
    if (s == GPUIPC_E_WOULD_BLOCK) {
      int ev = wait_fd(fd, POLLOUT, deadline);
      if (ev < 0)
        return gpuipc__fail_errno(errno, "poll", "handshake");
      if (ev == 0)
        return gpuipc__fail(GPUIPC_E_TIMEOUT, "handshake: send timed out");
      continue;
    }
    if (s == GPUIPC_E_PEER_GONE)
      return gpuipc__fail(GPUIPC_E_PEER_GONE,
                          "handshake: the peer closed the connection");
    if (s != GPUIPC_OK)
      return s;
    off += w;
  }
  return GPUIPC_OK;
}

static gpuipc_status hs_write(int fd, int type, const void *p, size_t n,
                              uint64_t deadline) {
  return hs_write_fds(fd, type, p, n, NULL, 0, deadline);
}

/* Tells the peer why we refuse it; keeps the caller's message. */
static void refuse(int fd, const char *why, uint64_t deadline) {
  char save[1024];
  snprintf(save, sizeof save, "%s", gpuipc_last_error());
  (void)hs_write(fd, GPUIPC__F_REFUSE, why, strlen(why), deadline);
  gpuipc__fail(GPUIPC_E_PEER_REFUSED, "%s", save);
}

/* Reads what is there of the current frame, without waiting. GPUIPC_OK
 * when the frame is complete (header in *h, payload after it in buf),
 * GPUIPC_E_WOULD_BLOCK when more must come, or why the peer failed. */
static gpuipc_status hs_read_some(hs *x, gpuipc__frame_hdr *h) {
  int fd = x->c->fd;
  while (x->got < x->want) {
    struct ucred uc;
    bool have_uc = false;
    size_t r = 0;
    int rfd = -1, nr = 0;
    gpuipc_status s = gpuipc__sock_recv(
        fd, x->buf + x->got, x->want - x->got, MSG_DONTWAIT,
        x->got == 0 ? &rfd : NULL, x->got == 0 ? 1 : 0, &nr, &uc, &have_uc, &r);
    if (nr > 0) {
      if (x->c->hs_fd >= 0)
        close(x->c->hs_fd);
      x->c->hs_fd = rfd;
    }
    if (s == GPUIPC_E_WOULD_BLOCK)
      return s;
    if (s == GPUIPC_E_PEER_GONE)
      return gpuipc__fail(GPUIPC_E_PEER_GONE,
                          "handshake: the peer reset the connection");
    if (s == GPUIPC_E_PROTOCOL)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "handshake: unexpected file descriptors");
    if (s != GPUIPC_OK)
      return s;
    if (have_uc && x->got == 0) {
      x->cred = uc;
      x->have_cred = true;
    }
    if (r == 0)
      return gpuipc__fail(GPUIPC_E_PEER_GONE,
                          "handshake: the peer closed the connection");
    x->got += r;
    if (x->got == sizeof *h) {
      memcpy(h, x->buf, sizeof *h);
      if (h->magic != GPUIPC__FRAME_MAGIC ||
          h->check != gpuipc__frame_check(h))
        return gpuipc__fail(GPUIPC_E_PROTOCOL,
                            "handshake: the peer does not speak gpuipc (bad "
                            "frame header)");
      if (h->version != GPUIPC__FRAME_VERSION)
        return gpuipc__fail(GPUIPC_E_BAD_VERSION,
                            "handshake: frame version %u, this library "
                            "speaks %u",
                            h->version, GPUIPC__FRAME_VERSION);
      bool with_fd = h->type == GPUIPC__F_LIVE && x->stage == HS_LIVE;
      if (h->len > HS_PAYLOAD_MAX || h->nfds > (with_fd ? 1 : 0) ||
          h->nfds != (x->c->hs_fd >= 0 ? 1 : 0))
        return gpuipc__fail(GPUIPC_E_PROTOCOL,
                            "handshake frame of type %u, %u bytes, %u fds "
                            "(%d came)",
                            h->type, h->len, h->nfds,
                            x->c->hs_fd >= 0 ? 1 : 0);
      x->want = sizeof *h + h->len;
    }
  }
  memcpy(h, x->buf, sizeof *h);
  return GPUIPC_OK;
}

/* Sends our LIVE frame: this process's liveness table, read-only, so that
 * the peer checks our descriptors against it in whatever IPC namespace it
 * lives (key 0 and no fd when we have none). */
static gpuipc_status send_live(int fd, uint64_t wdeadline) {
  gpuipc__w_live w = {0};
  int tfd = gpuipc__live_table_fd(&w.key);
  if (tfd < 0)
    w.key = 0;
  gpuipc_status s = hs_write_fds(fd, GPUIPC__F_LIVE, &w, sizeof w,
                                 tfd >= 0 ? &tfd : NULL, tfd >= 0 ? 1 : 0,
                                 wdeadline);
  if (tfd >= 0)
    close(tfd);
  return s;
}

/* For a peer of another pid namespace that this process sees (ours is an
 * ancestor of its): /proc/<pid> must show the pid the peer claims in its
 * own namespace (the last NSpid entry) and its start time. */
static bool foreign_pid_matches(int pid_here, int pid_there,
                                uint64_t start_here, uint64_t start_there) {
  if (start_here != start_there)
    return false;
  char path[64], buf[4096];
  snprintf(path, sizeof path, "/proc/%d/status", pid_here);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return false;
  ssize_t n;
  GPUIPC__EINTR_RETRY(n, read(fd, buf, sizeof buf - 1));
  close(fd);
  if (n <= 0)
    return false;
  buf[n] = '\0';
  const char *t = strstr(buf, "\nNSpid:");
  if (t == NULL)
    return false;
  t += 8;
  long last = -1;
  for (;;) {
    char *end;
    long v = strtol(t, &end, 10);
    if (end == t)
      break;
    last = v;
    t = end;
  }
  return last == pid_there;
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

/* The pidfd of the socket's peer as the kernel recorded it at connect
 * (SO_PEERPIDFD, Linux 6.5), for a peer whose pid is not visible here. It
 * must name a process invisible here too (its fdinfo shows pid 0): a
 * socketpair made by this very process would give our own. -1 with the
 * reason in why. */
static int invisible_peer_pidfd(int sock, char *why, size_t cap) {
  int pidfd = -1;
  socklen_t len = sizeof pidfd;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) != 0) {
    snprintf(why, cap, "this kernel gives no pidfd of a socket's peer "
                       "(SO_PEERPIDFD: %s; needs Linux 6.5)",
             strerror(errno));
    return -1;
  }
  (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  ssize_t n = -1;
  if (fd >= 0) {
    GPUIPC__EINTR_RETRY(n, read(fd, buf, sizeof buf - 1));
    close(fd);
  }
  const char *t = NULL;
  if (n > 0) {
    buf[n] = '\0';
    t = strstr(buf, "Pid:");
  }
  if (t == NULL || strtol(t + 4, NULL, 10) != 0) {
    snprintf(why, cap, "the socket's peer as the kernel recorded it at "
                       "connect time is %s",
             t == NULL ? "not readable (/proc/self/fdinfo)"
                       : "another process, one visible here");
    close(pidfd);
    return -1;
  }
  return pidfd;
}

/* Starts the handshake on x->c: sends our HELLO. `wdeadline` bounds the
 * writes of this handshake. */
static gpuipc_status hs_start(hs *x, uint64_t wdeadline) {
  gpuipc_conn *c = x->c;
  int one = 1;
  if (setsockopt(c->fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0)
    return gpuipc__fail_errno(errno, "setsockopt", "SO_PASSCRED");
  gpuipc__hello me = {0};
  me.proto = GPUIPC__PROTO_VERSION;
  me.pid = getpid();
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = c->max_outstanding;
  me.start_time = gpuipc__process_start_time(getpid());
  if (gpuipc__boot_id(me.boot_id) != GPUIPC_OK)
    memset(me.boot_id, 0, sizeof me.boot_id);
  me.pidns = gpuipc__pid_namespace();
  me.flags = GPUIPC__HELLO_F_NS;
  x->stage = HS_HELLO;
  x->got = 0;
  x->want = sizeof(gpuipc__frame_hdr);
  x->have_cred = false;
  gpuipc_status ws =
      hs_write(c->fd, GPUIPC__F_HELLO, &me, sizeof me, wdeadline);
  if (ws == GPUIPC_E_PEER_GONE) {
    /* A peer that refused us at once has closed already; its REFUSE frame
     * may still wait in our receive queue and says why: read on. */
    x->hello_failed = true;
    return GPUIPC_OK;
  }
  return ws;
}

/* Moves the handshake on with what has arrived (never waits for the
 * peer; our own small frames go out at once). GPUIPC_OK when it is
 * complete, GPUIPC_E_WOULD_BLOCK while it waits for the peer, else the
 * reason it failed. */
static gpuipc_status hs_step(hs *x, uint64_t wdeadline) {
  gpuipc_conn *c = x->c;
  for (;;) {
    gpuipc__frame_hdr h;
    gpuipc_status s = hs_read_some(x, &h);
    if (s != GPUIPC_OK) {
      if (s == GPUIPC_E_PEER_GONE && x->hello_failed)
        return gpuipc__fail(GPUIPC_E_PEER_GONE,
                            "handshake: the peer closed the connection");
      return s;
    }
    const unsigned char *p = x->buf + sizeof h;
    x->got = 0;
    x->want = sizeof h;
    if (h.type == GPUIPC__F_REFUSE)
      return gpuipc__fail(GPUIPC_E_PEER_REFUSED, "the peer refused us: %.*s",
                          (int)h.len, (const char *)p);
    if (x->hello_failed)
      return gpuipc__fail(GPUIPC_E_PEER_GONE,
                          "handshake: the peer closed the connection");
    if (x->stage == HS_VERDICT && h.type == GPUIPC__F_ACCEPT && x->peer_ns) {
      /* The peer's liveness table comes next. */
      x->stage = HS_LIVE;
      continue;
    }
    if (x->stage == HS_LIVE) {
      gpuipc__w_live w;
      if (h.type != GPUIPC__F_LIVE || h.len != sizeof w)
        return gpuipc__fail(GPUIPC_E_PROTOCOL,
                            "handshake: expected LIVE, got frame type %u of "
                            "%u bytes",
                            h.type, h.len);
      memcpy(&w, p, sizeof w);
      int tfd = c->hs_fd;
      c->hs_fd = -1;
      if ((w.key == 0) != (tfd < 0)) {
        if (tfd >= 0)
          close(tfd);
        return gpuipc__fail(GPUIPC_E_PROTOCOL,
                            "handshake: LIVE frame with key %s and %s fd",
                            w.key ? "set" : "0", tfd >= 0 ? "an" : "no");
      }
      if (tfd >= 0) {
        gpuipc_status ts =
            gpuipc__live_peer_open(tfd, &c->via.peer, w.key, &c->peer_table);
        close(tfd);
        if (ts != GPUIPC_OK)
          return ts;
        c->via.table = c->peer_table;
      }
      x->stage = HS_VERDICT;
      h.type = GPUIPC__F_ACCEPT; /* the verdict, read before */
    }
    if (x->stage == HS_VERDICT) {
      if (h.type != GPUIPC__F_ACCEPT)
        return gpuipc__fail(GPUIPC_E_PROTOCOL,
                            "handshake: expected ACCEPT, got frame type %u",
                            h.type);
      /* Credentials are checked; stop asking the kernel for them on every
       * read (they would also split reads at every sender change). */
      int zero = 0;
      (void)setsockopt(c->fd, SOL_SOCKET, SO_PASSCRED, &zero, sizeof zero);
      /* Only a peer that completed its handshake is watched: one that
       * failed half-way leaves nothing behind (no pidfd kept for it). */
      if (x->foreign)
        gpuipc__live_watch_identity(&c->via.peer,
                                    gpuipc__peer_pidfd(c->peer));
      GPUIPC__DEBUG("conn", "connected to pid %d uid %u", c->peer_pid,
                    c->peer_uid);
      return GPUIPC_OK;
    }
    if (h.type != GPUIPC__F_HELLO || h.len < GPUIPC__HELLO_V1_LEN) {
      refuse(c->fd, "expected a HELLO frame", wdeadline);
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "handshake: expected HELLO, got frame type %u of %u "
                          "bytes",
                          h.type, h.len);
    }
    gpuipc__hello peer;
    memset(&peer, 0, sizeof peer);
    memcpy(&peer, p, h.len < sizeof peer ? h.len : sizeof peer);
    if (h.len < sizeof peer)
      peer.flags = 0; /* an older library: one pid namespace */
    x->peer_ns = (peer.flags & GPUIPC__HELLO_F_NS) != 0;
    uint64_t my_ns = gpuipc__pid_namespace();
    bool foreign = x->peer_ns && peer.pidns != my_ns;
    if (!x->have_cred) {
      refuse(c->fd, "no credentials", wdeadline);
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "handshake: the peer's HELLO came without "
                          "credentials");
    }
    struct ucred cred = x->cred;
    if (peer.proto != GPUIPC__PROTO_VERSION) {
      char why[96];
      snprintf(why, sizeof why, "protocol version %u, this side speaks %u",
               peer.proto, GPUIPC__PROTO_VERSION);
      refuse(c->fd, why, wdeadline);
      return gpuipc__fail(GPUIPC_E_BAD_VERSION, "handshake: peer speaks %s",
                          why);
    }
    /* The kernel vouches for cred (SCM_CREDENTIALS are checked at send
     * time); the HELLO's own fields must agree with it. In one pid
     * namespace the pids are the same number; a peer of another one has
     * the pid the kernel translated into ours (0: it is not visible here,
     * as a sibling container is not), and its HELLO says its own. */
    if ((uint32_t)cred.uid != peer.uid || (uint32_t)cred.gid != peer.gid ||
        (!foreign && cred.pid != peer.pid) ||
        (x->have_pre && (x->pre.uid != cred.uid))) {
      refuse(c->fd, "credentials do not match", wdeadline);
      return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                          "handshake: the peer's claimed identity (pid %d uid "
                          "%u) differs from the kernel's (pid %d uid %u)",
                          peer.pid, peer.uid, (int)cred.pid,
                          (unsigned)cred.uid);
    }
    if (!peer_allowed(&x->o, cred.uid, cred.gid)) {
      char why[160];
      snprintf(why, sizeof why,
               "uid %u gid %u is not allowed (same uid %u required, or an "
               "allow-list entry)",
               (unsigned)cred.uid, (unsigned)cred.gid, (unsigned)geteuid());
      GPUIPC__WARN("conn", "refusing peer pid %d: %s", (int)cred.pid, why);
      gpuipc__fail(GPUIPC_E_PEER_REFUSED, "refused peer pid %d: %s",
                   (int)cred.pid, why);
      refuse(c->fd, why, wdeadline);
      return GPUIPC_E_PEER_REFUSED;
    }
    c->peer_pid = cred.pid;
    c->peer_uid = cred.uid;
    c->peer_gid = cred.gid;
    c->peer_foreign_ns = foreign;
    if (cred.pid > 0) {
      /* The start time, read here for the pid the kernel vouched for,
       * pairs with it to name the process even after the pid is reused. */
      c->peer_start_time = gpuipc__process_start_time(cred.pid);
      if (c->peer_start_time == 0)
        c->peer_start_time = peer.start_time;
      /* A peer we see that says it is of another pid namespace: /proc
       * must show that namespace (else it could pose as a process of
       * another container, whose liveness its own pidfd would then
       * answer for). */
      if (foreign && gpuipc__proc_pid_namespace(cred.pid) != peer.pidns) {
        refuse(c->fd, "pid namespace does not match", wdeadline);
        return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                            "handshake: the peer (pid %d here) claims pid "
                            "namespace %llu, which /proc does not show",
                            (int)cred.pid, (unsigned long long)peer.pidns);
      }
      if (foreign && !foreign_pid_matches(cred.pid, peer.pid,
                                          c->peer_start_time,
                                          peer.start_time)) {
        refuse(c->fd, "credentials do not match", wdeadline);
        return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                            "handshake: the peer (pid %d here) claims pid %d "
                            "in its pid namespace and start time %llu, which "
                            "/proc does not show",
                            (int)cred.pid, peer.pid,
                            (unsigned long long)peer.start_time);
      }
      c->peer = gpuipc__peer_open(c->peer_pid, c->peer_start_time);
    } else {
      /* Not visible here: the pidfd the kernel gives of the socket's peer
       * (Linux 6.5) is the only way to tell when it is gone. */
      char why[200];
      int pidfd = invisible_peer_pidfd(c->fd, why, sizeof why);
      if (pidfd < 0) {
        refuse(c->fd, "no pidfd of this peer", wdeadline);
        return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                            "handshake: the peer (pid %d in pid namespace "
                            "%llu) is not visible in this pid namespace "
                            "(%llu), and %s: its death could not be told, "
                            "so its leases could never be reclaimed",
                            peer.pid, (unsigned long long)peer.pidns,
                            (unsigned long long)my_ns, why);
      }
      c->peer_start_time = peer.start_time;
      c->peer = gpuipc__peer_from_pidfd(pidfd);
    }
    /* Who the peer is for the imports of what it sends: its own pid
     * namespace, pid and start time, as its descriptors name it. */
    memcpy(c->via.peer.boot_id, peer.boot_id, 16);
    c->via.peer.pidns = x->peer_ns ? peer.pidns : my_ns;
    c->via.peer.pid = foreign ? peer.pid : cred.pid;
    c->via.peer.start_time = foreign ? peer.start_time : c->peer_start_time;
    x->foreign = foreign; /* its identity is watched once the handshake is done */
    c->peer_max_outstanding = peer.max_outstanding;
    c->stats_slot = gpuipc__stats_conn_open(c->peer_pid, c->peer_start_time,
                                            (int)c->order);
    c->stats_open = true;
    GPUIPC__CHECK(hs_write(c->fd, GPUIPC__F_ACCEPT, NULL, 0, wdeadline));
    if (x->peer_ns)
      GPUIPC__CHECK(send_live(c->fd, wdeadline));
    x->stage = HS_VERDICT;
  }
}

/* The connecting side's handshake (connect, from_fd): one peer, waited
 * for up to the deadline. Takes ownership of fd. */
static gpuipc_status finish(int fd, const copts *o, const struct ucred *pre,
                            gpuipc_conn **out) {
  gpuipc_conn *c = conn_new(fd, o);
  if (c == NULL) {
    close(fd);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "connection object");
  }
  /* The handshake may wait even on a non-blocking connection: it is part of
   * making the connection, and bounded by the timeout. */
  int t = o->o.timeout_ms;
  uint64_t deadline = deadline_ms(t == 0 ? 10000 : t);
  hs x;
  memset(&x, 0, sizeof x);
  x.c = c;
  x.o = *o;
  if (pre) {
    x.pre = *pre;
    x.have_pre = true;
  }
  gpuipc_status s = hs_start(&x, deadline);
  while (s == GPUIPC_OK) {
    s = hs_step(&x, deadline);
    if (s != GPUIPC_E_WOULD_BLOCK)
      break;
    int ev = wait_fd(c->fd, POLLIN, deadline);
    if (ev < 0)
      s = gpuipc__fail_errno(errno, "poll", "handshake");
    else if (ev == 0)
      s = gpuipc__fail(GPUIPC_E_TIMEOUT,
                       "handshake: the peer did not answer in time");
    else
      s = GPUIPC_OK;
  }
  if (s == GPUIPC_OK && o->o.watch_peer)
    s = gpuipc__watch_add(c);
  if (s != GPUIPC_OK) {
    conn_free(c);
    return s;
  }
  *out = c;
  return GPUIPC_OK;
}

/* ---- public: listen / accept / connect / pair ---------------------------------- */

/* Takes the lock of a socket file's name: an exclusive flock on
 * "<name>.lock" beside it, held while the listener lives, so that of two
 * processes listening on one name over a stale socket file exactly one may
 * replace it (the check "does a listener answer?" and the unlink + bind
 * that follow are not atomic, and two processes doing them at once could
 * both bind, one of them to a file the other then unlinks). The lock file
 * is removed by its holder on close; a process that locked a file that was
 * removed meanwhile sees that the path names another file, and tries
 * again. */
static gpuipc_status take_name_lock(const char *lock_path, const char *name,
                                    int *out) {
  *out = -1;
  for (int tries = 0; tries < 100; tries++) {
    int fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
      return gpuipc__fail_errno(errno, "open", "lock file %s", lock_path);
    int r;
    GPUIPC__EINTR_RETRY(r, flock(fd, LOCK_EX | LOCK_NB));
    if (r != 0) {
      int err = errno;
      close(fd);
      if (err == EWOULDBLOCK)
        return gpuipc__fail(GPUIPC_E_EXISTS,
                            "gpuipc_listen: '%s' is in use by a live "
                            "listener (%s is locked)",
                            name, lock_path);
      return gpuipc__fail_errno(err, "flock", "%s", lock_path);
    }
    struct stat held, named;
    if (fstat(fd, &held) == 0 && stat(lock_path, &named) == 0 &&
        held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      *out = fd;
      return GPUIPC_OK;
    }
    close(fd); /* its holder removed it while we opened it: again */
  }
  return gpuipc__fail(GPUIPC_E_BUSY,
                      "gpuipc_listen: the lock file %s keeps being replaced",
                      lock_path);
}

gpuipc_status gpuipc_listen(const char *name, const gpuipc_conn_options *opts,
                            gpuipc_listener **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_listen: out is NULL");
  *out = NULL;
  copts o;
  GPUIPC__CHECK(read_opts(opts, &o));
  gpuipc_listener *l = calloc(1, sizeof *l);
  if (l == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "listener");
  l->fd = -1;
  l->ep = -1;
  l->lock_fd = -1;
  gpuipc_status s;
  struct sockaddr_un sa;
  socklen_t salen;
  GPUIPC__CHECK_GOTO(make_addr(name, &o, true, &sa, &salen, l->path,
                               sizeof l->path),
                     s, fail);
  l->abstract_name = o.o.abstract_name;
  if (!l->abstract_name) {
    /* An abstract name is bound atomically and vanishes with its socket;
     * a file needs the lock. */
    snprintf(l->lock_path, sizeof l->lock_path, "%.*s.lock",
             (int)(strlen(sa.sun_path) - strlen(".sock")), sa.sun_path);
    GPUIPC__CHECK_GOTO(take_name_lock(l->lock_path, name, &l->lock_fd), s,
                       fail);
  }
  l->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (l->fd < 0) {
    s = gpuipc__fail_errno(errno, "socket", "AF_UNIX");
    goto fail;
  }
  if (bind(l->fd, (struct sockaddr *)&sa, salen) != 0) {
    if (errno != EADDRINUSE || l->abstract_name) {
      s = gpuipc__fail_errno(errno, "bind", "%s", l->path);
      if (errno == EADDRINUSE)
        s = gpuipc__fail(GPUIPC_E_EXISTS, "bind: %s is in use", l->path);
      goto fail;
    }
    /* A socket file is there, and we hold the name's lock. If a listener
     * answers (one that takes no lock: another program, or an older
     * gpuipc), the name is taken; if nobody does, it is the leftover of a
     * dead listener, and only we may replace it. */
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int r = probe >= 0 ? connect(probe, (struct sockaddr *)&sa, salen) : -1;
    int err = errno;
    if (probe >= 0)
      close(probe);
    if (r == 0 || (err != ECONNREFUSED && err != ENOENT)) {
      s = gpuipc__fail(GPUIPC_E_EXISTS,
                       "gpuipc_listen: '%s' is in use by a live listener (%s)",
                       name, l->path);
      goto fail;
    }
    struct stat st;
    if (lstat(sa.sun_path, &st) == 0 && !S_ISSOCK(st.st_mode)) {
      s = gpuipc__fail(GPUIPC_E_EXISTS, "%s exists and is not a socket",
                       l->path);
      goto fail;
    }
    unlink(sa.sun_path);
    if (bind(l->fd, (struct sockaddr *)&sa, salen) != 0) {
      s = gpuipc__fail_errno(errno, "bind", "%s", l->path);
      goto fail;
    }
  }
  /* Accepted sockets inherit SO_PASSCRED, so the peer's first frame already
   * carries credentials even if it arrives before accept() returns. */
  int one = 1;
  (void)setsockopt(l->fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one);
  if (listen(l->fd, 256) != 0) {
    s = gpuipc__fail_errno(errno, "listen", "%s", l->path);
    if (!l->abstract_name)
      unlink(sa.sun_path);
    goto fail;
  }
  l->ep = epoll_create1(EPOLL_CLOEXEC);
  struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
  if (l->ep < 0 || epoll_ctl(l->ep, EPOLL_CTL_ADD, l->fd, &lev) != 0) {
    s = gpuipc__fail_errno(errno, "epoll", "%s", l->path);
    if (!l->abstract_name)
      unlink(sa.sun_path);
    goto fail;
  }
  l->opts = o.o;
  if (o.o.n_allow_uids) {
    l->allow_uids = malloc(sizeof(uint32_t) * o.o.n_allow_uids);
    if (!l->allow_uids)
      goto nomem;
    memcpy(l->allow_uids, o.o.allow_uids, sizeof(uint32_t) * o.o.n_allow_uids);
  }
  if (o.o.n_allow_gids) {
    l->allow_gids = malloc(sizeof(uint32_t) * o.o.n_allow_gids);
    if (!l->allow_gids)
      goto nomem;
    memcpy(l->allow_gids, o.o.allow_gids, sizeof(uint32_t) * o.o.n_allow_gids);
  }
  l->opts.allow_uids = l->allow_uids;
  l->opts.allow_gids = l->allow_gids;
  l->opts.runtime_dir = NULL; /* not needed after bind */
  GPUIPC__DEBUG("conn", "listening on %s", l->path);
  *out = l;
  return GPUIPC_OK;
nomem:
  s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "allow-list");
  if (!l->abstract_name)
    unlink(l->path);
fail:
  if (l->fd >= 0)
    close(l->fd);
  if (l->ep >= 0)
    close(l->ep);
  if (l->lock_fd >= 0) {
    unlink(l->lock_path); /* ours while we hold it */
    close(l->lock_fd);
  }
  free(l->allow_uids);
  free(l->allow_gids);
  free(l);
  return s;
}

int gpuipc_listener_get_fd(const gpuipc_listener *l) { return l ? l->ep : -1; }
const char *gpuipc_listener_get_path(const gpuipc_listener *l) {
  return l ? l->path : "";
}

/* Removes pending handshake i (oldest first) from the table; returns its
 * connection (the caller frees it or hands it out). */
static gpuipc_conn *pending_take(gpuipc_listener *l, int i) {
  hs *x = l->pending[i];
  gpuipc_conn *c = x->c;
  (void)epoll_ctl(l->ep, EPOLL_CTL_DEL, c->fd, NULL);
  free(x);
  memmove(&l->pending[i], &l->pending[i + 1],
          sizeof l->pending[0] * (size_t)(l->npending - i - 1));
  l->npending--;
  return c;
}

static void pending_drop(gpuipc_listener *l, int i) {
  conn_free(pending_take(l, i));
}

void gpuipc_listener_close(gpuipc_listener *l) {
  if (l == NULL)
    return;
  while (l->npending > 0)
    pending_drop(l, l->npending - 1);
  if (!l->abstract_name)
    unlink(l->path);
  close(l->fd);
  if (l->ep >= 0)
    close(l->ep);
  if (l->lock_fd >= 0) {
    /* Removed while still held: a process that opened it meanwhile finds
     * the path gone or naming a new file once it gets the lock. */
    unlink(l->lock_path);
    close(l->lock_fd);
  }
  free(l->allow_uids);
  free(l->allow_gids);
  free(l);
}

/* A peer taken off the listening socket: checks its uid at once (the
 * kernel's record of it), then starts its handshake and adds it to the
 * pending table, dropping the oldest pending peer when the table is full.
 * Takes ownership of fd. */
static gpuipc_status pending_add(gpuipc_listener *l, int fd) {
  copts o = {l->opts};
  struct ucred pre;
  socklen_t pl = sizeof pre;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &pre, &pl) != 0) {
    int err = errno;
    close(fd);
    return gpuipc__fail_errno(err, "getsockopt", "SO_PEERCRED");
  }
  if (!peer_allowed(&o, pre.uid, pre.gid)) {
    char why[160];
    snprintf(why, sizeof why,
             "uid %u gid %u is not allowed (same uid %u required, or an "
             "allow-list entry)",
             (unsigned)pre.uid, (unsigned)pre.gid, (unsigned)geteuid());
    GPUIPC__WARN("conn", "refusing peer pid %d on %s: %s", (int)pre.pid,
                 l->path, why);
    (void)hs_write(fd, GPUIPC__F_REFUSE, why, strlen(why), deadline_ms(100));
    close(fd);
    return gpuipc__fail(GPUIPC_E_PEER_REFUSED, "refused peer pid %d: %s",
                        (int)pre.pid, why);
  }
  gpuipc_conn *c = conn_new(fd, &o);
  hs *x = c ? calloc(1, sizeof *x) : NULL;
  if (x == NULL) {
    if (c)
      conn_free(c);
    else
      close(fd);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "connection object");
  }
  x->c = c;
  x->o = o;
  x->pre = pre;
  x->have_pre = true;
  x->deadline = deadline_ms(o.o.handshake_timeout_ms);
  /* Our frames are small and the socket fresh: they never wait. */
  gpuipc_status s = hs_start(x, deadline_ms(100));
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = x};
  if (s == GPUIPC_OK && epoll_ctl(l->ep, EPOLL_CTL_ADD, fd, &ev) != 0)
    s = gpuipc__fail_errno(errno, "epoll_ctl", "%s", l->path);
  if (s != GPUIPC_OK) {
    free(x);
    conn_free(c);
    return s;
  }
  if (l->npending == GPUIPC_CONN_HANDSHAKES_MAX) {
    /* Said once per thousand, not for each peer of a flood. */
    if (l->dropped++ % 1000 == 0)
      GPUIPC__WARN("conn",
                   "%d handshakes pending on %s: dropping the oldest (pid "
                   "%d; %llu dropped so far)",
                   l->npending, l->path, (int)l->pending[0]->pre.pid,
                   (unsigned long long)l->dropped);
    pending_drop(l, 0);
  }
  x->ready = true; /* its HELLO is usually there already */
  l->pending[l->npending++] = x;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_accept(gpuipc_listener *l, gpuipc_conn **out) {
  if (l == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_accept: NULL argument");
  *out = NULL;
  uint64_t deadline =
      l->opts.nonblocking ? 0 : deadline_ms(l->opts.timeout_ms);
  bool step_all = true; /* data may have come since the last call */
  for (;;) {
    /* New peers. */
    for (int n = 0; n < GPUIPC_CONN_HANDSHAKES_MAX; n++) {
      int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED)
          continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
          break;
        return gpuipc__fail_errno(errno, "accept4", "%s", l->path);
      }
      gpuipc_status s = pending_add(l, fd);
      if (s == GPUIPC_E_PEER_GONE)
        continue;
      if (s != GPUIPC_OK)
        return s;
    }
    /* Handshakes that can move, oldest first. */
    for (int i = 0; i < l->npending;) {
      hs *x = l->pending[i];
      if (!step_all && !x->ready) {
        i++;
        continue;
      }
      x->ready = false;
      int stage = x->stage;
      gpuipc_status s = hs_step(x, deadline_ms(100));
      if (s == GPUIPC_E_WOULD_BLOCK) {
        /* A peer that answered has its time again for the next answer:
         * the deadline bounds how long a peer keeps us waiting, not how
         * long the application took to call accept again. */
        if (x->stage != stage)
          x->deadline = deadline_ms(l->opts.handshake_timeout_ms);
        i++;
        continue;
      }
      int pid = (int)x->pre.pid;
      gpuipc_conn *c = pending_take(l, i);
      if (s == GPUIPC_OK && l->opts.watch_peer)
        s = gpuipc__watch_add(c);
      if (s == GPUIPC_OK) {
        *out = c;
        return GPUIPC_OK;
      }
      conn_free(c);
      if (s != GPUIPC_E_PEER_GONE)
        return s; /* this peer's failure; the listener stays usable */
      /* The peer left before the handshake ended (e.g. a probe that only
       * checks someone listens): nothing to tell the caller about. */
      GPUIPC__DEBUG("conn", "peer pid %d left during the handshake", pid);
    }
    /* Handshakes past their own deadline. */
    uint64_t now = gpuipc__now_ns();
    uint64_t wake = deadline;
    for (int i = 0; i < l->npending;) {
      hs *x = l->pending[i];
      if (x->deadline <= now) {
        GPUIPC__WARN("conn",
                     "dropping peer pid %d on %s: no handshake within %d ms",
                     (int)x->pre.pid, l->path, l->opts.handshake_timeout_ms);
        pending_drop(l, i);
        continue;
      }
      if (x->deadline < wake)
        wake = x->deadline;
      i++;
    }
    if (deadline == 0)
      return gpuipc__fail(GPUIPC_E_WOULD_BLOCK,
                          "gpuipc_accept: no peer has completed its "
                          "handshake on %s (%d pending)",
                          l->path, l->npending);
    if (deadline != UINT64_MAX && now >= deadline)
      return gpuipc__fail(GPUIPC_E_TIMEOUT,
                          "gpuipc_accept: no peer within %d ms on %s (%d "
                          "handshakes pending)",
                          l->opts.timeout_ms, l->path, l->npending);
    struct epoll_event evs[16];
    int n = epoll_wait(l->ep, evs, (int)GPUIPC__ARRAY_SIZE(evs),
                       poll_ms(wake));
    if (n < 0 && errno != EINTR)
      return gpuipc__fail_errno(errno, "epoll_wait", "%s", l->path);
    for (int i = 0; i < n; i++)
      if (evs[i].data.ptr)
        ((hs *)evs[i].data.ptr)->ready = true;
    step_all = false;
  }
}

gpuipc_status gpuipc_connect(const char *name, const gpuipc_conn_options *opts,
                             gpuipc_conn **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_connect: out is NULL");
  *out = NULL;
  copts o;
  GPUIPC__CHECK(read_opts(opts, &o));
  struct sockaddr_un sa;
  socklen_t salen;
  char shown[sizeof sa.sun_path + 2];
  GPUIPC__CHECK(make_addr(name, &o, false, &sa, &salen, shown, sizeof shown));
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return gpuipc__fail_errno(errno, "socket", "AF_UNIX");
  int t = o.o.timeout_ms;
  uint64_t deadline = deadline_ms(t == 0 ? 10000 : t);
  for (;;) {
    if (connect(fd, (struct sockaddr *)&sa, salen) == 0)
      break;
    int err = errno;
    if (err == EINTR)
      continue;
    if (err == EAGAIN || err == EINPROGRESS) {
      /* The listener's backlog is full: try again shortly. */
      if (deadline != UINT64_MAX && gpuipc__now_ns() >= deadline) {
        close(fd);
        return gpuipc__fail(GPUIPC_E_TIMEOUT,
                            "connect %s: the listener's queue stayed full",
                            shown);
      }
      poll(NULL, 0, 2);
      continue;
    }
    close(fd);
    if (err == ENOENT || err == ECONNREFUSED)
      return gpuipc__fail(GPUIPC_E_NOT_FOUND, "connect: nobody listens on %s",
                          shown);
    return gpuipc__fail_errno(err, "connect", "%s", shown);
  }
  struct ucred pre;
  socklen_t pl = sizeof pre;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &pre, &pl) != 0) {
    int err = errno;
    close(fd);
    return gpuipc__fail_errno(err, "getsockopt", "SO_PEERCRED");
  }
  if (!peer_allowed(&o, pre.uid, pre.gid)) {
    close(fd);
    GPUIPC__WARN("conn", "refusing listener %s: uid %u is not allowed", shown,
                 (unsigned)pre.uid);
    return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                        "connect %s: the listener runs as uid %u, which is "
                        "not allowed",
                        shown, (unsigned)pre.uid);
  }
  return finish(fd, &o, &pre, out);
}

gpuipc_status gpuipc_conn_pair(int fds[2]) {
  if (fds == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_pair: NULL");
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0)
    return gpuipc__fail_errno(errno, "socketpair", NULL);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_from_fd(int fd, const gpuipc_conn_options *opts,
                                  gpuipc_conn **out) {
  if (out == NULL || fd < 0) {
    if (fd >= 0)
      close(fd);
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_from_fd: bad fd %d or NULL out", fd);
  }
  *out = NULL;
  copts o;
  gpuipc_status s = read_opts(opts, &o);
  if (s != GPUIPC_OK) {
    close(fd);
    return s;
  }
  int type = 0, dom = 0;
  socklen_t tl = sizeof type, dl = sizeof dom;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 ||
      getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &dl) != 0 ||
      type != SOCK_STREAM || dom != AF_UNIX) {
    close(fd);
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_from_fd: fd %d is not a Unix stream "
                        "socket",
                        fd);
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0 ||
      fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
    int err = errno;
    close(fd);
    return gpuipc__fail_errno(err, "fcntl", "fd %d", fd);
  }
  return finish(fd, &o, NULL, out);
}

/* ---- public: connection calls ---------------------------------------------------- */

void gpuipc_conn_close(gpuipc_conn *conn) {
  if (conn == NULL)
    return;
  if (conn->hooks)
    conn->hooks->close(conn);
  if (conn->state == GPUIPC__CONN_OPEN && conn->tx_len > conn->tx_off) {
    /* Give queued frames (releases above all) a short chance to leave. */
    uint64_t deadline = gpuipc__now_ns() + 100ull * 1000000ull;
    while (conn->state == GPUIPC__CONN_OPEN && conn->tx_len > conn->tx_off &&
           gpuipc__now_ns() < deadline) {
      if (flush_tx(conn) != GPUIPC_OK)
        break;
      if (conn->tx_len > conn->tx_off)
        wait_fd(conn->fd, POLLOUT, deadline);
    }
  }
  conn_free(conn);
}

int gpuipc_conn_get_fd(const gpuipc_conn *conn) { return conn ? conn->fd : -1; }

gpuipc_status gpuipc_conn_set_timeout(gpuipc_conn *conn, int timeout_ms) {
  if (conn == NULL || timeout_ms < -1)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_set_timeout: bad argument");
  conn->timeout_ms = timeout_ms;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_set_nonblocking(gpuipc_conn *conn, int nonblocking) {
  if (conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_set_nonblocking: NULL");
  conn->nonblocking = nonblocking != 0;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_get_peer(const gpuipc_conn *conn, gpuipc_peer_info *info) {
  if (conn == NULL || info == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_get_peer: NULL");
  info->pid = conn->peer_pid;
  info->uid = conn->peer_uid;
  info->gid = conn->peer_gid;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_import_buffer(gpuipc_conn *conn, const uint8_t *desc,
                                        size_t len, const int *fds, int nfds,
                                        const gpuipc_import_options *opts,
                                        gpuipc_buffer **out) {
  if (conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_import_buffer: NULL connection");
  return gpuipc__buffer_import_via(&conn->via, desc, len, fds, nfds, opts,
                                   out);
}

gpuipc_status gpuipc_conn_progress(gpuipc_conn *conn, int timeout_ms) {
  if (conn == NULL || timeout_ms < -1)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_progress: bad "
                                              "argument");
  if (conn->state != GPUIPC__CONN_OPEN) {
    if (conn->hooks)
      conn->hooks->poll(conn);
    return gpuipc__conn_ended(conn);
  }
  return gpuipc__conn_pump(conn, deadline_ms(timeout_ms), NULL, NULL);
}

gpuipc_status gpuipc_conn_send_msg(gpuipc_conn *conn, const void *data,
                                   size_t len, const int *fds, int nfds) {
  if (conn == NULL || (len > 0 && data == NULL) || len > GPUIPC_CONN_MSG_MAX ||
      nfds < 0 || nfds > GPUIPC_CONN_FDS_MAX || (nfds > 0 && fds == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_send_msg: bad argument (len %zu, nfds "
                        "%d)",
                        len, nfds);
  for (int i = 0; i < nfds; i++)
    if (fcntl(fds[i], F_GETFD) < 0)
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "gpuipc_conn_send_msg: fds[%d] = %d is not open", i,
                          fds[i]);
  return gpuipc__conn_send_frame(conn, GPUIPC__F_MSG, data, len, NULL, 0, fds,
                                 nfds, gpuipc__conn_deadline(conn));
}

static bool have_msg(gpuipc_conn *c, void *arg) {
  (void)arg;
  return c->msg_head != NULL;
}

gpuipc_status gpuipc_conn_recv_msg(gpuipc_conn *conn, void *buf, size_t cap,
                                   size_t *len, int *fds, int *nfds) {
  if (conn == NULL || len == NULL || (cap > 0 && buf == NULL) ||
      (nfds && *nfds < 0) || (nfds && *nfds > 0 && fds == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_recv_msg: bad argument");
  int fcap = nfds ? *nfds : 0;
  if (nfds)
    *nfds = 0;
  *len = 0;
  if (conn->msg_head == NULL) {
    gpuipc_status s =
        gpuipc__conn_pump(conn, gpuipc__conn_deadline(conn), have_msg, NULL);
    if (s != GPUIPC_OK)
      return s;
  }
  gpuipc__msg *m = conn->msg_head;
  conn->msg_head = m->next;
  if (conn->msg_head == NULL)
    conn->msg_tail = NULL;
  conn->msg_count--;
  conn->msg_bytes -= m->len;
  conn->msg_fds -= (size_t)m->nfds;
  *len = m->len;
  if (m->len && cap)
    memcpy(buf, m->data, m->len < cap ? m->len : cap);
  for (int i = 0; i < m->nfds; i++) {
    if (i < fcap)
      fds[(*nfds)++] = m->fds[i];
    else
      close(m->fds[i]);
  }
  int extra = m->nfds - fcap;
  size_t full = m->len;
  free(m);
  if (full > cap)
    return gpuipc__fail(GPUIPC_E_TRUNCATED,
                        "message of %zu bytes, buffer of %zu", full, cap);
  if (extra > 0)
    GPUIPC__DEBUG("conn", "closed %d surplus descriptors of a message", extra);
  return GPUIPC_OK;
}
