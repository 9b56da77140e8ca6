/*
 * handshake.c: owns the handshake that makes a connection, above the
 * frames (it runs on the socket before any frame is read, so that nothing
 * after it is consumed here): HELLO with credentials that the kernel
 * vouches for, our verdict (ACCEPT or REFUSE with the reason), and the
 * liveness tables each side passes (LIVE). It names the peer process for
 * the connection's life: by pid and start time when this process sees it,
 * else (a sibling container) by the pidfd the kernel gives of the
 * socket's peer; a peer of another pid namespace is named by its own
 * HELLO, checked against /proc where /proc shows it. It also settles the
 * carrier (the `carrier` option or GPUIPC_CARRIER, HELLO's RING flag, the
 * RING frames that hand the connection to the ring carrier), and holds the
 * check both ends of listen.c make of a socket's peer before a handshake
 * starts (SO_PEERCRED against the allow-lists). Both sides run the
 * same small state machine, so that a listener runs the handshakes of all
 * its pending peers at once (listen.c) and a connecting side waits on one
 * (gpuipc__hs_connect). Every connection made here gets the fast path's
 * hooks installed.
 */
#include "conn_int.h"
#include "core/stats.h"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

bool gpuipc__peer_allowed(const gpuipc_conn_options *o, uint32_t uid,
                          uint32_t gid) {
  if (uid == (uint32_t)geteuid())
    return true;
  for (size_t i = 0; i < o->n_allow_uids; i++)
    if (o->allow_uids[i] == uid)
      return true;
  for (size_t i = 0; i < o->n_allow_gids; i++)
    if (o->allow_gids[i] == gid)
      return true;
  return false;
}

gpuipc_status gpuipc__peer_cred_check(int fd, const gpuipc_conn_options *o,
                                      struct ucred *pre) {
  socklen_t pl = sizeof *pre;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, pre, &pl) != 0)
    return gpuipc__fail_errno(errno, "getsockopt", "SO_PEERCRED");
  return gpuipc__peer_allowed(o, pre->uid, pre->gid) ? GPUIPC_OK
                                                     : GPUIPC_E_PEER_REFUSED;
}

/* One handshake, run by both sides alike as a small state machine, so that
 * a listener can run many at once (gpuipc_accept) and a connecting side
 * simply waits on one (gpuipc__hs_connect): send HELLO (with credentials); read the
 * peer's HELLO and check its credentials; send ACCEPT or REFUSE; read the
 * peer's verdict. Frames are read exactly (header, then payload) without
 * the frame machinery, so nothing after the handshake is consumed here.
 * `pre` carries SO_PEERCRED for sockets made by connect/accept (the
 * kernel's record of the peer at connect time). */
enum { HS_HELLO = 0, HS_VERDICT = 1, HS_LIVE = 2, HS_RING = 3 };

/* What this side says of the ring carrier in its HELLO. */
enum { RING_NO = 0, RING_OFFER = 1, RING_REQUIRE = 2 };

#define HS_PAYLOAD_MAX 512

struct gpuipc__hs {
  gpuipc_conn *c;
  gpuipc_conn_options o;
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
  /* The ring carrier: what we said (RING_*), whether both sides offered
   * it, and our ring (its memfd and mapping, ours until the carrier takes
   * them). */
  int ring_say;
  bool ring;
  int ring_fd;
  void *ring_map;
};
typedef gpuipc__hs hs;

GPUIPC__PARAM(carrier, "GPUIPC_CARRIER", GPUIPC__PARAM_EACH_USE, "auto",
              "what carries the frames of a connection whose carrier option is "
              "AUTO: auto, socket or ring; anything else fails the connection")

/* What this side offers: the options' carrier, or for AUTO the
 * environment's GPUIPC_CARRIER (auto, socket or ring). */
static gpuipc_status ring_wanted(const gpuipc_conn_options *o, int *out) {
  int carrier = o->carrier;
  if (carrier == GPUIPC_CARRIER_AUTO) {
    const char *e = param_carrier();
    if (e == NULL || *e == '\0' || strcmp(e, "auto") == 0)
      carrier = GPUIPC_CARRIER_AUTO;
    else if (strcmp(e, "socket") == 0)
      carrier = GPUIPC_CARRIER_SOCKET;
    else if (strcmp(e, "ring") == 0)
      carrier = GPUIPC_CARRIER_RING;
    else
      return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                          "GPUIPC_CARRIER=%s: auto, socket or ring", e);
  }
  *out = carrier == GPUIPC_CARRIER_SOCKET ? RING_NO
         : carrier == GPUIPC_CARRIER_RING ? RING_REQUIRE
                                          : RING_OFFER;
  return GPUIPC_OK;
}

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
      int ev = gpuipc__wait_fd(fd, POLLOUT, deadline);
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

gpuipc_status gpuipc__hs_write(int fd, int type, const void *p, size_t n,
                               uint64_t deadline) {
  return hs_write_fds(fd, type, p, n, NULL, 0, deadline);
}

/* Tells the peer why we refuse it; keeps the caller's message. */
static void refuse(int fd, const char *why, uint64_t deadline) {
  char save[1024];
  snprintf(save, sizeof save, "%s", gpuipc_last_error());
  (void)gpuipc__hs_write(fd, GPUIPC__F_REFUSE, why, strlen(why), deadline);
  gpuipc__fail(GPUIPC_E_PEER_REFUSED, "%s", save);
}

/* Reads what is there of the current frame, without waiting. GPUIPC_OK
 * when the frame is complete (header in *h, payload after it in buf),
 * GPUIPC_E_WOULD_BLOCK when more must come, or why the peer failed. */
static gpuipc_status hs_read_some(hs *x, gpuipc__frame_hdr *h) {
  int fd = x->c->k.fd;
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
      bool with_fd = (h->type == GPUIPC__F_LIVE && x->stage == HS_LIVE) ||
                     (h->type == GPUIPC__F_RING && x->stage == HS_RING);
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
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/status", pid_here);
  long last = -1;
  return gpuipc__proc_field(path, "NSpid", NULL, &last) == GPUIPC_OK &&
         last == pid_there;
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
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fdinfo/%d", pidfd);
  long pid = 0;
  bool readable = gpuipc__proc_field(path, "Pid", &pid, NULL) == GPUIPC_OK;
  if (!readable || pid != 0) {
    snprintf(why, cap, "the socket's peer as the kernel recorded it at "
                       "connect time is %s",
             !readable ? "not readable (/proc/self/fdinfo)"
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
  if (setsockopt(c->k.fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0)
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
  me.flags = GPUIPC__HELLO_F_NS | GPUIPC__HELLO_F_RELC | GPUIPC__HELLO_F_SFC;
  GPUIPC__CHECK(ring_wanted(&x->o, &x->ring_say));
  if (x->ring_say != RING_NO)
    me.flags |= GPUIPC__HELLO_F_RING;
  x->stage = HS_HELLO;
  x->got = 0;
  x->want = sizeof(gpuipc__frame_hdr);
  x->have_cred = false;
  gpuipc_status ws =
      gpuipc__hs_write(c->k.fd, GPUIPC__F_HELLO, &me, sizeof me, wdeadline);
  if (ws == GPUIPC_E_PEER_GONE) {
    /* A peer that refused us at once has closed already; its REFUSE frame
     * may still wait in our receive queue and says why: read on. */
    x->hello_failed = true;
    return GPUIPC_OK;
  }
  return ws;
}

/* ---- the steps of hs_step ------------------------------------------------------- */

/* LIVE (the peer's liveness table, after its ACCEPT): opened read-only for
 * the checks of what the peer sends, from whatever IPC namespace it is
 * in. */
static gpuipc_status hs_on_live(hs *x, const gpuipc__frame_hdr *h,
                                const unsigned char *p) {
  gpuipc_conn *c = x->c;
  gpuipc__w_live w;
  if (h->type != GPUIPC__F_LIVE || h->len != sizeof w)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: expected LIVE, got frame type %u of "
                        "%u bytes",
                        h->type, h->len);
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
  return GPUIPC_OK;
}

/* RING (the ring the peer writes, after its ACCEPT and LIVE): checked and
 * mapped read-only, and the connection's carrier becomes the ring carrier
 * over it and ours. */
static gpuipc_status hs_on_ring(hs *x, const gpuipc__frame_hdr *h,
                                const unsigned char *p) {
  gpuipc_conn *c = x->c;
  int rfd = c->hs_fd;
  c->hs_fd = -1;
  gpuipc__w_ring w;
  if (h->type != GPUIPC__F_RING || h->len != sizeof w) {
    if (rfd >= 0)
      close(rfd);
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: expected RING, got frame type %u of %u "
                        "bytes",
                        h->type, h->len);
  }
  memcpy(&w, p, sizeof w);
  if (w.size == 0 && rfd < 0 && w.version == 1 && w.pad == 0) {
    /* The peer could not make its ring: the socket carries everything. */
    if (x->ring_say == RING_REQUIRE)
      return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                          "handshake: the ring carrier is required here, and "
                          "the peer could not make its ring");
    GPUIPC__WARN("conn", "the socket carries the frames to pid %d: the peer "
                         "could not make its ring",
                 c->peer_pid);
    return GPUIPC_OK;
  }
  if (w.size != GPUIPC__RING_SIZE || w.version != 1 || w.pad != 0 ||
      rfd < 0) {
    if (rfd >= 0)
      close(rfd);
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: the peer's ring is of %llu bytes, version "
                        "%u (this side: %zu, version 1)",
                        (unsigned long long)w.size, w.version,
                        GPUIPC__RING_SIZE);
  }
  const void *peer = NULL;
  gpuipc_status s = gpuipc__ring_open_peer(rfd, GPUIPC__RING_SIZE, &peer);
  close(rfd);
  if (s != GPUIPC_OK)
    return s;
  if (x->ring_map == NULL) {
    /* We declined ours: the socket it is, on both sides. */
    gpuipc__ring_unmake((void *)peer, GPUIPC__RING_SIZE);
    return GPUIPC_OK;
  }
  s = gpuipc__carrier_ring_init(&c->k, x->ring_map, peer, GPUIPC__RING_SIZE,
                                x->o.polling != 0, x->o.spin_us);
  if (s != GPUIPC_OK) {
    gpuipc__ring_unmake((void *)peer, GPUIPC__RING_SIZE);
    return s;
  }
  x->ring_map = NULL; /* the carrier's now */
  c->polling = x->o.polling != 0;
  c->k.ops->sent(&c->k, c->tx_frames); /* from here on, after each one */
  return GPUIPC_OK;
}

/* The peer's verdict on us (ACCEPT; its LIVE, when it sends one, was
 * taken already): the handshake is complete. */
static gpuipc_status hs_on_verdict(hs *x, const gpuipc__frame_hdr *h) {
  gpuipc_conn *c = x->c;
  if (h->type != GPUIPC__F_ACCEPT)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: expected ACCEPT, got frame type %u",
                        h->type);
  /* Credentials are checked; stop asking the kernel for them on every
   * read (they would also split reads at every sender change). */
  int zero = 0;
  (void)setsockopt(c->k.fd, SOL_SOCKET, SO_PASSCRED, &zero, sizeof zero);
  /* Only a peer that completed its handshake is watched: one that
   * failed half-way leaves nothing behind (no pidfd kept for it). */
  if (x->foreign)
    gpuipc__live_watch_identity(&c->via.peer, gpuipc__peer_pidfd(c->peer));
  GPUIPC__DEBUG("conn", "connected to pid %d uid %u", c->peer_pid,
                c->peer_uid);
  return GPUIPC_OK;
}

/* The peer's HELLO against what the kernel vouches for (cred: SCM_CREDENTIALS
 * are checked at send time) and our options: the version spoken, the
 * claimed identity, the allow-lists. Refuses the peer (telling it why) on
 * any mismatch. */
static gpuipc_status hs_check_hello(hs *x, const gpuipc__hello *peer,
                                    bool foreign, uint64_t wdeadline) {
  gpuipc_conn *c = x->c;
  if (!x->have_cred) {
    refuse(c->k.fd, "no credentials", wdeadline);
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: the peer's HELLO came without "
                        "credentials");
  }
  struct ucred cred = x->cred;
  if (peer->proto != GPUIPC__PROTO_VERSION) {
    char why[96];
    snprintf(why, sizeof why, "protocol version %u, this side speaks %u",
             peer->proto, GPUIPC__PROTO_VERSION);
    refuse(c->k.fd, why, wdeadline);
    return gpuipc__fail(GPUIPC_E_BAD_VERSION, "handshake: peer speaks %s",
                        why);
  }
  /* The HELLO's own fields must agree with the kernel's record. In one pid
   * namespace the pids are the same number; a peer of another one has
   * the pid the kernel translated into ours (0: it is not visible here,
   * as a sibling container is not), and its HELLO says its own. */
  if ((uint32_t)cred.uid != peer->uid || (uint32_t)cred.gid != peer->gid ||
      (!foreign && cred.pid != peer->pid) ||
      (x->have_pre && (x->pre.uid != cred.uid))) {
    refuse(c->k.fd, "credentials do not match", wdeadline);
    return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                        "handshake: the peer's claimed identity (pid %d uid "
                        "%u) differs from the kernel's (pid %d uid %u)",
                        peer->pid, peer->uid, (int)cred.pid,
                        (unsigned)cred.uid);
  }
  if (!gpuipc__peer_allowed(&x->o, cred.uid, cred.gid)) {
    char why[160];
    snprintf(why, sizeof why,
             "uid %u gid %u is not allowed (same uid %u required, or an "
             "allow-list entry)",
             (unsigned)cred.uid, (unsigned)cred.gid, (unsigned)geteuid());
    GPUIPC__WARN("conn", "refusing peer pid %d: %s", (int)cred.pid, why);
    gpuipc__fail(GPUIPC_E_PEER_REFUSED, "refused peer pid %d: %s",
                 (int)cred.pid, why);
    refuse(c->k.fd, why, wdeadline);
    return GPUIPC_E_PEER_REFUSED;
  }
  return GPUIPC_OK;
}

/* Names the peer process for its whole life: by pid and start time when
 * this process sees it (a peer that says it is of another pid namespace
 * must be of the one /proc shows), else by the pidfd the kernel gives of
 * the socket's peer. */
static gpuipc_status hs_identify(hs *x, const gpuipc__hello *peer,
                                 bool foreign, uint64_t my_ns,
                                 uint64_t wdeadline) {
  gpuipc_conn *c = x->c;
  struct ucred cred = x->cred;
  c->peer_pid = cred.pid;
  c->peer_uid = cred.uid;
  c->peer_gid = cred.gid;
  c->peer_foreign_ns = foreign;
  if (cred.pid > 0) {
    /* The start time, read here for the pid the kernel vouched for,
     * pairs with it to name the process even after the pid is reused. */
    c->peer_start_time = gpuipc__process_start_time(cred.pid);
    if (c->peer_start_time == 0)
      c->peer_start_time = peer->start_time;
    /* A peer we see that says it is of another pid namespace: /proc
     * must show that namespace (else it could pose as a process of
     * another container, whose liveness its own pidfd would then
     * answer for). */
    if (foreign && gpuipc__proc_pid_namespace(cred.pid) != peer->pidns) {
      refuse(c->k.fd, "pid namespace does not match", wdeadline);
      return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                          "handshake: the peer (pid %d here) claims pid "
                          "namespace %llu, which /proc does not show",
                          (int)cred.pid, (unsigned long long)peer->pidns);
    }
    if (foreign && !foreign_pid_matches(cred.pid, peer->pid,
                                        c->peer_start_time,
                                        peer->start_time)) {
      refuse(c->k.fd, "credentials do not match", wdeadline);
      return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                          "handshake: the peer (pid %d here) claims pid %d "
                          "in its pid namespace and start time %llu, which "
                          "/proc does not show",
                          (int)cred.pid, peer->pid,
                          (unsigned long long)peer->start_time);
    }
    c->peer = gpuipc__peer_open(c->peer_pid, c->peer_start_time);
  } else {
    /* Not visible here: the pidfd the kernel gives of the socket's peer
     * (Linux 6.5) is the only way to tell when it is gone. */
    char why[200];
    int pidfd = invisible_peer_pidfd(c->k.fd, why, sizeof why);
    if (pidfd < 0) {
      refuse(c->k.fd, "no pidfd of this peer", wdeadline);
      return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                          "handshake: the peer (pid %d in pid namespace "
                          "%llu) is not visible in this pid namespace "
                          "(%llu), and %s: its death could not be told, "
                          "so its leases could never be reclaimed",
                          peer->pid, (unsigned long long)peer->pidns,
                          (unsigned long long)my_ns, why);
    }
    c->peer_start_time = peer->start_time;
    c->peer = gpuipc__peer_from_pidfd(pidfd);
  }
  /* Who the peer is for the imports of what it sends: its own pid
   * namespace, pid and start time, as its descriptors name it. */
  memcpy(c->via.peer.boot_id, peer->boot_id, 16);
  c->via.peer.pidns = x->peer_ns ? peer->pidns : my_ns;
  c->via.peer.pid = foreign ? peer->pid : cred.pid;
  c->via.peer.start_time = foreign ? peer->start_time : c->peer_start_time;
  x->foreign = foreign; /* its identity is watched once the handshake is done */
  return GPUIPC_OK;
}

/* The peer's HELLO: checked, the peer named, and our verdict sent (ACCEPT,
 * then our LIVE when the peer speaks of pid namespaces). */
static gpuipc_status hs_on_hello(hs *x, const gpuipc__frame_hdr *h,
                                 const unsigned char *p, uint64_t wdeadline) {
  gpuipc_conn *c = x->c;
  if (h->type != GPUIPC__F_HELLO || h->len < GPUIPC__HELLO_V1_LEN) {
    refuse(c->k.fd, "expected a HELLO frame", wdeadline);
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "handshake: expected HELLO, got frame type %u of %u "
                        "bytes",
                        h->type, h->len);
  }
  gpuipc__hello peer;
  memset(&peer, 0, sizeof peer);
  memcpy(&peer, p, h->len < sizeof peer ? h->len : sizeof peer);
  if (h->len < sizeof peer)
    peer.flags = 0; /* an older library: one pid namespace */
  x->peer_ns = (peer.flags & GPUIPC__HELLO_F_NS) != 0;
  uint64_t my_ns = gpuipc__pid_namespace();
  bool foreign = x->peer_ns && peer.pidns != my_ns;
  GPUIPC__CHECK(hs_check_hello(x, &peer, foreign, wdeadline));
  bool peer_ring = (peer.flags & GPUIPC__HELLO_F_RING) != 0;
  c->peer_relc = (peer.flags & GPUIPC__HELLO_F_RELC) != 0;
  c->peer_sfc = (peer.flags & GPUIPC__HELLO_F_SFC) != 0;
  if (x->ring_say == RING_REQUIRE && !peer_ring) {
    refuse(c->k.fd, "this side requires the ring carrier", wdeadline);
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "handshake: the ring carrier is required here "
                        "(GPUIPC_CARRIER=ring or the carrier option), and the "
                        "peer does not offer it");
  }
  x->ring = x->ring_say != RING_NO && peer_ring;
  if (x->ring) {
    /* Made only now that both offered it (a pending handshake holds no
     * memfd). One that cannot be made is declined in the RING frame, and
     * both sides stay on the socket. */
    gpuipc_status rs =
        gpuipc__ring_make(GPUIPC__RING_SIZE, &x->ring_fd, &x->ring_map);
    if (rs != GPUIPC_OK && x->ring_say == RING_REQUIRE) {
      refuse(c->k.fd, "this side could not make its ring", wdeadline);
      return rs;
    }
    if (rs != GPUIPC_OK)
      GPUIPC__WARN("conn", "the socket carries the frames to pid %d: %s",
                   (int)x->cred.pid, gpuipc_last_error());
  }
  GPUIPC__CHECK(hs_identify(x, &peer, foreign, my_ns, wdeadline));
  c->peer_max_outstanding = peer.max_outstanding;
  c->stats_slot = gpuipc__stats_conn_open(c->peer_pid, c->peer_start_time,
                                          (int)c->order);
  c->stats_open = true;
  GPUIPC__CHECK(
      gpuipc__hs_write(c->k.fd, GPUIPC__F_ACCEPT, NULL, 0, wdeadline));
  if (x->peer_ns)
    GPUIPC__CHECK(send_live(c->k.fd, wdeadline));
  if (x->ring) {
    /* Size 0 and no memfd: declined. */
    bool have = x->ring_map != NULL;
    gpuipc__w_ring w = {have ? GPUIPC__RING_SIZE : 0, 1, 0};
    GPUIPC__CHECK(hs_write_fds(c->k.fd, GPUIPC__F_RING, &w, sizeof w,
                               have ? &x->ring_fd : NULL, have ? 1 : 0,
                               wdeadline));
    if (have) {
      close(x->ring_fd); /* the mapping is what we keep */
      x->ring_fd = -1;
    }
  }
  return GPUIPC_OK;
}

/* Moves the handshake on with what has arrived (never waits for the
 * peer; our own small frames go out at once). GPUIPC_OK when it is
 * complete, GPUIPC_E_WOULD_BLOCK while it waits for the peer, else the
 * reason it failed. The stages: HS_HELLO (the peer's HELLO is awaited),
 * HS_VERDICT (its ACCEPT), HS_LIVE (its LIVE, after an ACCEPT from a peer
 * that speaks of pid namespaces), HS_RING (its RING, after its ACCEPT and
 * LIVE when both sides offered the ring carrier). A REFUSE ends it at any
 * stage. */
gpuipc_status gpuipc__hs_step(hs *x, uint64_t wdeadline) {
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
    switch (x->stage) {
    case HS_HELLO:
      GPUIPC__CHECK(hs_on_hello(x, &h, p, wdeadline));
      x->stage = HS_VERDICT;
      continue;
    case HS_VERDICT:
      if (h.type == GPUIPC__F_ACCEPT && x->peer_ns) {
        /* The peer's liveness table comes next. */
        x->stage = HS_LIVE;
        continue;
      }
      if (h.type == GPUIPC__F_ACCEPT && x->ring) {
        x->stage = HS_RING;
        continue;
      }
      return hs_on_verdict(x, &h);
    case HS_LIVE: /* the verdict, ACCEPT, was read before */
      GPUIPC__CHECK(hs_on_live(x, &h, p));
      if (x->ring) {
        x->stage = HS_RING;
        continue;
      }
      x->stage = HS_VERDICT;
      h.type = GPUIPC__F_ACCEPT;
      return hs_on_verdict(x, &h);
    default: /* HS_RING: ACCEPT (and LIVE) were read before */
      GPUIPC__CHECK(hs_on_ring(x, &h, p));
      x->stage = HS_VERDICT;
      h.type = GPUIPC__F_ACCEPT;
      return hs_on_verdict(x, &h);
    }
  }
}

/* ---- making a connection: both sides ------------------------------------------ */

/* A connection on fd with the fast path's hooks installed, and its
 * handshake's record. NULL without memory (fd closed). */
static hs *hs_new(int fd, const gpuipc_conn_options *o,
                  const struct ucred *pre) {
  gpuipc_conn *c = gpuipc__conn_new(fd, o);
  hs *x = c ? calloc(1, sizeof *x) : NULL;
  if (x == NULL) {
    if (c)
      gpuipc__conn_free(c);
    gpuipc__fail(GPUIPC_E_NO_MEMORY, "connection object");
    return NULL;
  }
  gpuipc__handoff_install(c);
  x->c = c;
  x->o = *o;
  x->ring_fd = -1;
  if (pre) {
    x->pre = *pre;
    x->have_pre = true;
  }
  return x;
}

gpuipc_status gpuipc__hs_accepted(int fd, const gpuipc_conn_options *o,
                                  const struct ucred *pre, uint64_t wdeadline,
                                  gpuipc__hs **out) {
  *out = NULL;
  hs *x = hs_new(fd, o, pre);
  if (x == NULL)
    return GPUIPC_E_NO_MEMORY;
  gpuipc_status s = hs_start(x, wdeadline);
  if (s != GPUIPC_OK) {
    gpuipc__conn_free(gpuipc__hs_end(x));
    return s;
  }
  *out = x;
  return GPUIPC_OK;
}

int gpuipc__hs_stage(const gpuipc__hs *x) { return x->stage; }

gpuipc_conn *gpuipc__hs_conn(const gpuipc__hs *x) { return x->c; }

gpuipc_conn *gpuipc__hs_end(gpuipc__hs *x) {
  gpuipc_conn *c = x->c;
  if (x->ring_fd >= 0)
    close(x->ring_fd);
  gpuipc__ring_unmake(x->ring_map, GPUIPC__RING_SIZE);
  free(x);
  return c;
}

gpuipc_status gpuipc__hs_connect(int fd, const gpuipc_conn_options *o,
                                 const struct ucred *pre, gpuipc_conn **out) {
  hs *x = hs_new(fd, o, pre);
  if (x == NULL)
    return GPUIPC_E_NO_MEMORY;
  gpuipc_conn *c = x->c;
  /* The handshake may wait even on a non-blocking connection: it is part of
   * making the connection, and bounded by the timeout. */
  int t = o->timeout_ms;
  uint64_t deadline = gpuipc__deadline_ms(t == 0 ? 10000 : t);
  gpuipc_status s = hs_start(x, deadline);
  while (s == GPUIPC_OK) {
    s = gpuipc__hs_step(x, deadline);
    if (s != GPUIPC_E_WOULD_BLOCK)
      break;
    int ev = gpuipc__wait_fd(c->k.fd, POLLIN, deadline);
    if (ev < 0)
      s = gpuipc__fail_errno(errno, "poll", "handshake");
    else if (ev == 0)
      s = gpuipc__fail(GPUIPC_E_TIMEOUT,
                       "handshake: the peer did not answer in time");
    else
      s = GPUIPC_OK;
  }
  (void)gpuipc__hs_end(x);
  if (s == GPUIPC_OK && o->watch_peer)
    s = gpuipc__watch_add(c);
  if (s != GPUIPC_OK) {
    gpuipc__conn_free(c);
    return s;
  }
  *out = c;
  return GPUIPC_OK;
}
