/*
 * frames.c: owns the frames of a connection over its carrier (carrier.h):
 * the connection object, framing (length, type, version, header check),
 * the transmit queue (partial writes, frames with descriptors sent with
 * their first byte), parsing what arrives (partial reads, descriptors
 * claimed by their frame), dispatching the fast-path frames to the hooks
 * the fast path installed, timeouts and non-blocking mode, the end of a
 * connection (the peer left, or we broke it), and user messages (a bounded
 * queue with backpressure). It needs no CUDA, and knows no socket call:
 * the carrier moves the bytes. Names, listening and connecting are
 * listen.c's; the handshake is handshake.c's.
 *
 * Carriers never block: a "blocking" call is a wait on the carrier bounded
 * by the connection's timeout, so no call can wait forever on a peer that
 * stopped reading or writing, and EINTR only shortens one round. What a
 * peer can make this side hold is bounded (see the rule at the top of
 * gpuipc/conn.h).
 */
#include "conn_int.h"
#include "core/stats.h"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define RX_CHUNK 65536
#define TX_QUEUE_MAX ((size_t)8 << 20)

/* ---- connection objects ---------------------------------------------------------- */

gpuipc_conn *gpuipc__conn_new(int fd, const gpuipc_conn_options *o) {
  gpuipc_conn *c = calloc(1, sizeof *c);
  if (c == NULL) {
    close(fd);
    return NULL;
  }
  gpuipc__carrier_sock_init(&c->k, fd);
  c->timeout_ms = o->timeout_ms;
  c->nonblocking = o->nonblocking != 0;
  c->max_outstanding = o->max_outstanding;
  c->order = o->order;
  c->q_max_msgs = o->queue_msgs;
  c->q_max_bytes = o->queue_bytes;
  c->q_max_fds = o->queue_fds;
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

uint64_t gpuipc__conn_socket_reads(const gpuipc_conn *c) {
  return c->rx_sock_reads;
}

const char *gpuipc__conn_carrier_name(const gpuipc_conn *c) {
  return c->k.ops->name;
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

void gpuipc__conn_free(gpuipc_conn *c) {
  if (c->stats_open)
    gpuipc__stats_conn_close(c->stats_slot);
  c->k.ops->release(&c->k);
  free(c->rec);
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

static gpuipc_status timed_out(const gpuipc_conn *c, uint64_t deadline,
                               const char *what) {
  if (deadline == 0) /* a polling miss: nothing formatted (what: a literal) */
    return gpuipc__fail_static(GPUIPC_E_WOULD_BLOCK, what, " would block");
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
  c->k.ops->hangup(&c->k);
  close_rx_fds(c);
  c->rx_len = 0;
  c->rx_paused = false;
  c->tx_len = c->tx_off = 0;
}

static gpuipc_status pump_once(gpuipc_conn *c);

static void peer_gone(gpuipc_conn *c) {
  if (c->state != GPUIPC__CONN_OPEN)
    return;
  if (c->parsing == 0 && !c->draining && !c->closing) {
    /* Seen from a write (EPIPE, a hang-up): what the peer sent before it
     * left is read first, an ABANDON or releases above all, which would
     * otherwise be lost with the socket. Not from inside a parse: the
     * parse in progress reads on to the end itself. */
    c->draining = true;
    (void)pump_once(c);
    c->draining = false;
    if (c->state != GPUIPC__CONN_OPEN)
      return;
  }
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
    /* Installed or in use: a peer whose frames we never used still hears
     * that we hold nothing of it. */
    const gpuipc__conn_hooks *f = c->hooks ? c->hooks : c->fast;
    if (f)
      f->breaking(c);
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

/* n more socket frames are out whole: counted for the barrier, and
 * published for the peer where the carrier does (GPUIPC__HELLO_F_SFC). */
static void tx_whole(gpuipc_conn *c, uint64_t n) {
  c->tx_frames += n;
  if (c->k.ops->sent)
    c->k.ops->sent(&c->k, c->tx_frames);
}

/* Writes queued bytes; returns OK (maybe with bytes left), or an error
 * status when the peer is gone. */
static gpuipc_status flush_tx(gpuipc_conn *c) {
  while (c->tx_off < c->tx_len) {
    struct iovec iov = {c->tx + c->tx_off, c->tx_len - c->tx_off};
    size_t w = 0;
    gpuipc_status s =
        c->k.ops->write(&c->k, &iov, 1, NULL, 0, &w);
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
  /* Every queued frame is out whole now (see tx_frames). */
  tx_whole(c, c->tx_qframes);
  c->tx_qframes = 0;
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
  unsigned char *n =
      gpuipc__grow(c->tx, &c->tx_cap, c->tx_len + total, 1, 4096);
  if (n == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "transmit queue of %zu bytes",
                        c->tx_len + total);
  c->tx = n;
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

/* The peer sent BYE or ABANDON: it reads nothing more, and what we would
 * send now (a buffer above all) would be leased to nobody. */
static gpuipc_status peer_reads_no_more(const gpuipc_conn *c) {
  return gpuipc__fail(GPUIPC_E_PEER_GONE,
                      "the peer (pid %d) ended the connection: it reads "
                      "nothing more",
                      c->peer_pid);
}

/* The frames a carrier of records takes: the fast path's, which carry no
 * descriptors and need nothing of the socket's order beyond the barrier. */
static bool ring_type(int type) {
  return type == GPUIPC__F_BUF || type == GPUIPC__F_BUFS ||
         type == GPUIPC__F_BUFW || type == GPUIPC__F_REL;
}

/* How often a record's sender looks for the peer's hang-up. */
#define HUP_LOOK_NS 1000000u

void gpuipc__conn_hup_look(gpuipc_conn *const *conns, size_t n,
                           struct pollfd *pf) {
  uint64_t now = gpuipc__now_ns();
  size_t np = 0;
  for (size_t i = 0; i < n; i++) {
    gpuipc_conn *c = conns[i];
    if (c->state == GPUIPC__CONN_OPEN && c->k.ops->put != NULL &&
        !c->closing && c->k.fd >= 0 && now - c->hup_checked > HUP_LOOK_NS)
      pf[np++] = (struct pollfd){c->k.fd, 0, 0};
  }
  if (np < 2 || poll(pf, (nfds_t)np, 0) < 0)
    return; /* one look is what the put makes anyway */
  size_t k = 0;
  for (size_t i = 0; i < n && k < np; i++) {
    gpuipc_conn *c = conns[i];
    if (c->k.fd != pf[k].fd)
      continue;
    if (!(pf[k].revents & (POLLHUP | POLLERR | POLLNVAL)))
      c->hup_checked = now;
    k++;
  }
}

/* Puts the frame (iov, total bytes) into the carrier's records when it can
 * go there now: GPUIPC_OK when it went (and the peer was woken if it
 * sleeps), GPUIPC_E_WOULD_BLOCK when it must go on the socket. */
static gpuipc_status put_record(gpuipc_conn *c, int type,
                                const struct iovec *iov, int niov,
                                size_t total) {
  /* Only behind a socket whose frames all went out whole: the barrier
   * counts them, and a frame still queued would be overtaken. */
  if (c->k.ops->put == NULL || !ring_type(type) || c->tx_len != c->tx_off ||
      total > GPUIPC__RING_FRAME_MAX)
    return GPUIPC_E_WOULD_BLOCK;
  /* A record reaches a dead peer as well as a live one: look at the
   * socket for its hang-up now and then (at most once a millisecond), as
   * a write to it would have told. */
  uint64_t now = gpuipc__now_ns();
  if (now - c->hup_checked > HUP_LOOK_NS && !c->closing) {
    c->hup_checked = now;
    struct pollfd p = {c->k.fd, 0, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR))) {
      /* What it sent before it left, then its end: a pass that brought
       * records does not read the socket, so read on to the end (a dead
       * peer's ring holds a bounded number of records). */
      for (int pass = 0; pass < 64 && c->state == GPUIPC__CONN_OPEN &&
                         !c->peer_ended;
           pass++)
        if (pump_once(c) != GPUIPC_OK)
          break;
      if (c->state != GPUIPC__CONN_OPEN)
        return gpuipc__conn_ended(c);
      if (c->peer_ended)
        return peer_reads_no_more(c);
    }
  }
  gpuipc_status s = c->k.ops->put(&c->k, iov, niov, total, c->tx_frames);
  if (s == GPUIPC_E_PROTOCOL) {
    char why[sizeof c->broken_why];
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
    return gpuipc__conn_break(c, "%s", why);
  }
  if (s != GPUIPC_OK)
    return s == GPUIPC_E_PEER_GONE ? GPUIPC_E_WOULD_BLOCK : s;
  if (c->k.ops->wake(&c->k))
    /* Never waits: a full socket queues it, and is readable anyway. */
    GPUIPC__CHECK(gpuipc__conn_send_frame(c, GPUIPC__F_WAKE, NULL, 0, NULL, 0,
                                          NULL, 0, 0));
  return GPUIPC_OK;
}

gpuipc_status gpuipc__conn_send_frame(gpuipc_conn *c, int type, const void *p1,
                                      size_t n1, const void *p2, size_t n2,
                                      const int *fds, int nfds,
                                      uint64_t deadline) {
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  if (c->peer_ended) {
    /* Its end of the socket follows; read on to it when we can. */
    if (c->parsing == 0 && !c->closing)
      (void)pump_once(c);
    if (c->state != GPUIPC__CONN_OPEN)
      return gpuipc__conn_ended(c);
    return peer_reads_no_more(c);
  }
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
  gpuipc_status rs = put_record(c, type, iov, niov, sizeof h + len);
  if (rs != GPUIPC_E_WOULD_BLOCK)
    return rs;

  for (;;) {
    /* Older frames first: the stream's order is the send order. */
    if (c->tx_len > c->tx_off)
      GPUIPC__CHECK(flush_tx(c));
    if (c->tx_len == c->tx_off) {
      /* Room for the whole frame first: once its first byte is out, the
       * rest must be queued, or the stream would be torn. */
      GPUIPC__CHECK(tx_reserve(c, sizeof h + len));
      size_t w = 0;
      gpuipc_status s = c->k.ops->write(&c->k, iov, niov, fds, nfds, &w);
      if (s == GPUIPC_OK) {
        if (w < sizeof h + len) {
          /* The descriptors went with the first byte; the rest is plain
           * bytes, flushed by later calls. */
          tx_append(c, iov, niov, w);
          c->tx_qframes++;
        } else {
          tx_whole(c, 1);
        }
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
      c->tx_qframes++;
      return GPUIPC_OK;
    }
    if (deadline == 0)
      return timed_out(c, deadline, "send");
    /* While reading is paused (the application holds too many of the
     * peer's messages), wait for room only. */
    int ev = c->k.ops->wait(&c->k, c->rx_paused ? POLLOUT : POLLOUT | POLLIN,
                            deadline, -1);
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

/* Hands a fast-path frame to the hooks the fast path installed; its
 * failure breaks the connection (with the reason it gave). */
static gpuipc_status fast_frame(gpuipc_conn *c, int type,
                                const unsigned char *p, size_t len, int *fds,
                                int nfds) {
  const gpuipc__conn_hooks *fast = gpuipc__conn_fast(c);
  if (fast == NULL) {
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
    return gpuipc__conn_break(c, "fast-path frame type %d on a connection "
                                 "without a fast path",
                              type);
  }
  gpuipc_status s = fast->frame(c, type, p, len, fds, nfds);
  if (s != GPUIPC_OK && c->state == GPUIPC__CONN_OPEN) {
    char why[sizeof c->broken_why];
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
    gpuipc_status s2 = gpuipc__conn_break(c, "%s", why);
    if (s == GPUIPC_E_NO_MEMORY)
      return s;
    return s2;
  }
  return s;
}

/* One record of the carrier, decoded as a frame from the socket is (the
 * same checks), of the types a record may carry only. */
static gpuipc_status record_frame(gpuipc_conn *c, const unsigned char *b,
                                  size_t len) {
  gpuipc__frame_hdr h;
  if (len < sizeof h)
    return gpuipc__conn_break(c, "ring record of %zu bytes", len);
  memcpy(&h, b, sizeof h);
  if (h.magic != GPUIPC__FRAME_MAGIC || h.version != GPUIPC__FRAME_VERSION ||
      h.check != gpuipc__frame_check(&h) || h.len != len - sizeof h ||
      h.nfds != 0 || !ring_type(h.type))
    return gpuipc__conn_break(c, "ring record of %zu bytes is not a "
                                 "fast-path frame (type %u, %u bytes, %u "
                                 "fds)",
                              len, h.type, h.len, h.nfds);
  return fast_frame(c, h.type, b + sizeof h, h.len, NULL, 0);
}

/* The carrier's records whose barrier the socket frames dispatched so far
 * meet, in order. A record whose barrier is not met yet waits in c->rec
 * until enough socket frames were dispatched. At most as many per call as
 * an honest peer can have in flight (a buffer per slot it may fill, a
 * release per buffer we sent, and a few more): so an honest peer's records
 * are all taken before the call returns (leaving some would leave them
 * without a wake), and a peer that floods its ring holds the caller no
 * longer than that (the rest waits for the next call; it delays only its
 * own connection). */
static gpuipc_status drain_records(gpuipc_conn *c) {
  if (c->k.ops->get == NULL)
    return GPUIPC_OK;
  size_t most = (size_t)c->peer_max_outstanding + c->max_outstanding + 64;
  for (size_t n = 0; n < most && c->state == GPUIPC__CONN_OPEN; n++) {
    if (!c->rec_have) {
      if (c->rec == NULL) {
        c->rec = malloc(GPUIPC__RING_FRAME_MAX);
        if (c->rec == NULL)
          return gpuipc__fail(GPUIPC_E_NO_MEMORY, "ring record buffer");
      }
      gpuipc_status s = c->k.ops->get(&c->k, c->rec, GPUIPC__RING_FRAME_MAX,
                                      &c->rec_len, &c->rec_barrier);
      if (s == GPUIPC_E_WOULD_BLOCK)
        return GPUIPC_OK;
      if (s != GPUIPC_OK) {
        char why[sizeof c->broken_why];
        snprintf(why, sizeof why, "%s", gpuipc_last_error());
        return gpuipc__conn_break(c, "%s", why);
      }
      c->rec_have = true;
    }
    if (c->rec_barrier > c->rx_frames)
      return GPUIPC_OK; /* socket frames it follows are still to come */
    c->rec_have = false;
    c->rx_records++;
    GPUIPC__CHECK(record_frame(c, c->rec, c->rec_len));
  }
  return GPUIPC_OK;
}

/* Parses and dispatches every complete frame in rx, and before each the
 * carrier's records that precede it. */
static gpuipc_status parse_rx_frames(gpuipc_conn *c) {
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
    if ((h.type < GPUIPC__F_MSG || h.type > GPUIPC__F_TYPE_MAX) &&
        !(h.type == GPUIPC__F_WAKE && c->k.ops->get != NULL && h.len == 0))
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
    /* Records published before this frame was sent come first. */
    s = drain_records(c);
    if (s != GPUIPC_OK) {
      free(m);
      if (c->state != GPUIPC__CONN_OPEN)
        return s;
      break;
    }
    int fds[GPUIPC__FRAME_FDS_MAX];
    int nfds = h.nfds;
    memcpy(fds, c->rx_fds, sizeof(int) * (size_t)nfds);
    memmove(c->rx_fds, c->rx_fds + nfds,
            sizeof(int) * (size_t)(c->rx_nfds - nfds));
    c->rx_nfds -= nfds;
    const unsigned char *p = c->rx + off + sizeof h;
    off += sizeof h + h.len;
    c->rx_frames++;
    if (h.type == GPUIPC__F_WAKE) {
      /* It only made our fd readable. */
    } else if (h.type == GPUIPC__F_MSG) {
      if (h.len > GPUIPC_CONN_MSG_MAX) {
        for (int i = 0; i < nfds; i++)
          close(fds[i]);
        return gpuipc__conn_break(c, "message of %u bytes exceeds %d", h.len,
                                  GPUIPC_CONN_MSG_MAX);
      }
      queue_msg(c, m, p, h.len, fds, nfds);
    } else {
      s = fast_frame(c, h.type, p, h.len, fds, nfds);
    }
    if (s != GPUIPC_OK)
      return s;
  }
  if (s == GPUIPC_OK && !c->rx_paused)
    s = drain_records(c);
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

static gpuipc_status parse_rx(gpuipc_conn *c) {
  c->parsing++;
  gpuipc_status s = parse_rx_frames(c);
  c->parsing--;
  return s;
}

/* One read of what is available (no waiting), then parsing. Returns OK
 * also when nothing was there; the end of the connection as a status. */
/* A record waits for socket frames that have not been dispatched. */
static bool record_waits(const gpuipc_conn *c) {
  return c->rec_have && c->rec_barrier > c->rx_frames;
}

/* Whether a pass reads the socket. Always, but in a receive's passes
 * (rx_hot) beside the ring of a peer that counts its socket frames in its
 * ring page (GPUIPC__HELLO_F_SFC): then only when that count is past the
 * frames dispatched here, a frame is partly read, a record waits for
 * socket frames, or a wait saw the fd ready; else at most once per
 * GPUIPC__SOCK_LOOK_NS, for the peer's hang-up (a count that lies, or a
 * peer gone without a word). So a polling receiver's call that finds
 * nothing makes no system call. Every other call (progress, messages,
 * the counts) reads the socket as before, so what they report of the
 * peer is as fresh as ever. */
static bool sock_worth_reading(gpuipc_conn *c) {
  if (atomic_exchange_explicit(&c->sock_ready, false, memory_order_relaxed))
    return true;
  if (!c->rx_hot || !c->peer_sfc || c->k.ops->peer_sent == NULL ||
      c->rx_len != 0 || record_waits(c))
    return true;
  if (c->k.ops->peer_sent(&c->k) > c->rx_frames)
    return true;
  /* The clock only every 16th pass that found nothing: a spinning
   * receiver's passes come far closer together than the look's period. */
  if ((++c->sock_skipped & 15) != 0)
    return false;
  uint64_t now = gpuipc__now_ns();
  if (now - c->sock_looked < GPUIPC__SOCK_LOOK_NS)
    return false;
  c->sock_looked = now;
  return true;
}

static gpuipc_status pump_once(gpuipc_conn *c) {
  if (c->state != GPUIPC__CONN_OPEN)
    return gpuipc__conn_ended(c);
  if (c->k.ops->get != NULL && !c->rx_paused &&
      c->rx_len < sizeof(gpuipc__frame_hdr)) {
    /* The records first: when they brought something and wait for no
     * socket frame, the socket is not read this pass (no system call on
     * the fast path); it is on the next. Unless our word slept since the
     * socket was last read: then the WAKE frame a sender owed it is read
     * now too, not left to make the fd readable after the call. */
    uint64_t before = c->rx_records;
    GPUIPC__CHECK(drain_records(c));
    if (c->rx_records != before && !record_waits(c) &&
        !(c->k.ops->slept && c->k.ops->slept(&c->k)))
      return GPUIPC_OK;
  }
  if (c->rx_paused || c->rx_len >= sizeof(gpuipc__frame_hdr)) {
    /* Complete frames may wait in rx: a message for room in the queue
     * (then nothing more is read while it still does not fit), or a frame
     * that an earlier pass had no memory for. */
    GPUIPC__CHECK(parse_rx(c));
    if (c->rx_paused)
      return GPUIPC_OK;
  }
  if (!sock_worth_reading(c))
    return GPUIPC_OK;
  for (int rounds = 0; rounds < 64; rounds++) {
    if (c->rx_cap - c->rx_len < RX_CHUNK / 2) {
      size_t need = c->rx_len + RX_CHUNK;
      if (need < sizeof(gpuipc__frame_hdr) + GPUIPC__FRAME_MAX)
        need = sizeof(gpuipc__frame_hdr) + GPUIPC__FRAME_MAX;
      if (need > c->rx_cap) {
        /* Sized to what one read may bring, not doubled (gpuipc__grow). */
        unsigned char *n = realloc(c->rx, need);
        if (n == NULL)
          return gpuipc__fail(GPUIPC_E_NO_MEMORY, "receive buffer");
        c->rx = n;
        c->rx_cap = need;
      }
    }
    size_t room = c->rx_cap - c->rx_len, r = 0;
    int tmp[GPUIPC__FRAME_FDS_MAX], k = 0;
    c->rx_sock_reads++;
    gpuipc_status s = c->k.ops->read(&c->k, c->rx + c->rx_len, room, tmp,
                                     GPUIPC__FRAME_FDS_MAX, &k, &r);
    if (s == GPUIPC_E_WOULD_BLOCK) {
      /* The socket frames a record names were written whole before the
       * record was published, and it was taken before this read: they
       * would be here. */
      if (record_waits(c) && !c->rx_paused)
        return gpuipc__conn_break(
            c, "a ring record follows %llu socket frames, and %llu came",
            (unsigned long long)c->rec_barrier,
            (unsigned long long)c->rx_frames);
      return GPUIPC_OK;
    }
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
    if (r < room && k == 0 && !record_waits(c))
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
    int r = c->k.ops->wait(&c->k, ev, deadline, -1);
    if (r < 0)
      return gpuipc__fail_errno(errno, "poll", "connection to pid %d",
                                c->peer_pid);
    if (r & (POLLIN | POLLHUP | POLLERR))
      atomic_store_explicit(&c->sock_ready, true, memory_order_relaxed);
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

/* ---- public: connection calls ---------------------------------------------------- */

void gpuipc_conn_close(gpuipc_conn *conn) {
  if (conn == NULL)
    return;
  conn->closing = true; /* the fast path takes its state down: no drain */
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
        conn->k.ops->wait(&conn->k, POLLOUT, deadline, -1);
    }
  }
  gpuipc__conn_free(conn);
}

gpuipc_status gpuipc_conn_wait(gpuipc_conn *conn, short events,
                               int timeout_ms, int spin_us) {
  if (conn == NULL || (events & ~(POLLIN | POLLOUT)) != 0 || timeout_ms < -1 ||
      spin_us < -1)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_wait(conn %p, events %#x, timeout %d ms, "
                        "spin %d us)",
                        (void *)conn, (unsigned)events, timeout_ms, spin_us);
  if (events == 0)
    events = POLLIN;
  uint64_t deadline = timeout_ms < 0 ? UINT64_MAX
                                     : gpuipc__now_ns() +
                                           (uint64_t)timeout_ms * 1000000ull;
  int r = conn->k.ops->wait(&conn->k, events, deadline, spin_us);
  if (r < 0)
    return gpuipc__fail_errno(errno, "poll", "gpuipc_conn_wait");
  /* The next call reads the socket: what made the fd ready may be on it
   * (this may be another thread than the one making calls). */
  if (r & (POLLIN | POLLHUP | POLLERR))
    atomic_store_explicit(&conn->sock_ready, true, memory_order_relaxed);
  return r == 0 ? GPUIPC_E_TIMEOUT : GPUIPC_OK;
}

int gpuipc_conn_get_fd(const gpuipc_conn *conn) {
  return conn ? conn->k.ops->fd(&conn->k) : -1;
}

gpuipc_status gpuipc_conn_set_timeout(gpuipc_conn *conn, int timeout_ms) {
  if (conn == NULL || timeout_ms < -1)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_conn_set_timeout: bad argument");
  conn->timeout_ms = timeout_ms;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_conn_set_polling(gpuipc_conn *conn, int polling) {
  if (conn == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_conn_set_polling: NULL");
  conn->polling = polling != 0;
  if (conn->k.ops->set_polling)
    conn->k.ops->set_polling(&conn->k, conn->polling);
  return GPUIPC_OK;
}

int gpuipc__conn_timeout(const gpuipc_conn *conn) {
  return conn ? conn->timeout_ms : 0;
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
  return gpuipc__conn_pump(conn, gpuipc__deadline_ms(timeout_ms), NULL, NULL);
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

