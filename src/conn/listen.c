/*
 * listen.c: owns making connections, above the frames and the handshake:
 * connection names and the per-user runtime directory, listening by name
 * (a file or an abstract name; a lock file beside a socket file makes
 * replacing a stale one race-free), accepting (the handshakes of all
 * pending peers proceed at once, watched by one epoll set, the oldest
 * dropped for a newer one when the table is full), connecting, connected
 * pairs and connections from a socket the caller made, and the options
 * every connection is made with. The handshake itself is handshake.c's.
 */
#include "conn_int.h"

#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* A handshake the listener waits on, with what the listener keeps of it. */
typedef struct pend {
  gpuipc__hs *hs;
  int pid;           /* the peer as the kernel recorded it at connect */
  uint64_t deadline; /* when this peer is dropped */
  bool ready;        /* epoll said its socket is readable */
} pend;

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
  pend *pending[GPUIPC_CONN_HANDSHAKES_MAX];
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
  if (out->o.carrier < GPUIPC_CARRIER_AUTO ||
      out->o.carrier > GPUIPC_CARRIER_RING)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "unknown carrier %d",
                        out->o.carrier);
  if (out->o.spin_us < 0 || out->o.spin_us > 1000000)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "spin_us %d: 0 to 1000000",
                        out->o.spin_us);
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
  pend *x = l->pending[i];
  gpuipc_conn *c = gpuipc__hs_end(x->hs);
  (void)epoll_ctl(l->ep, EPOLL_CTL_DEL, c->k.fd, NULL);
  free(x);
  memmove(&l->pending[i], &l->pending[i + 1],
          sizeof l->pending[0] * (size_t)(l->npending - i - 1));
  l->npending--;
  return c;
}

static void pending_drop(gpuipc_listener *l, int i) {
  gpuipc__conn_free(pending_take(l, i));
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
  gpuipc_status cs = gpuipc__peer_cred_check(fd, &o.o, &pre);
  if (cs == GPUIPC_E_PEER_REFUSED) {
    char why[160];
    snprintf(why, sizeof why,
             "uid %u gid %u is not allowed (same uid %u required, or an "
             "allow-list entry)",
             (unsigned)pre.uid, (unsigned)pre.gid, (unsigned)geteuid());
    GPUIPC__WARN("conn", "refusing peer pid %d on %s: %s", (int)pre.pid,
                 l->path, why);
    (void)gpuipc__hs_write(fd, GPUIPC__F_REFUSE, why, strlen(why),
                           gpuipc__deadline_ms(100));
    close(fd);
    return gpuipc__fail(GPUIPC_E_PEER_REFUSED, "refused peer pid %d: %s",
                        (int)pre.pid, why);
  }
  if (cs != GPUIPC_OK) {
    close(fd);
    return cs;
  }
  pend *x = calloc(1, sizeof *x);
  if (x == NULL) {
    close(fd);
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "connection object");
  }
  x->pid = (int)pre.pid;
  x->deadline = gpuipc__deadline_ms(o.o.handshake_timeout_ms);
  /* Our frames are small and the socket fresh: they never wait. */
  gpuipc_status s =
      gpuipc__hs_accepted(fd, &o.o, &pre, gpuipc__deadline_ms(100), &x->hs);
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = x};
  if (s == GPUIPC_OK && epoll_ctl(l->ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
    s = gpuipc__fail_errno(errno, "epoll_ctl", "%s", l->path);
    gpuipc__conn_free(gpuipc__hs_end(x->hs));
  }
  if (s != GPUIPC_OK) {
    free(x);
    return s;
  }
  if (l->npending == GPUIPC_CONN_HANDSHAKES_MAX) {
    /* Said once per thousand, not for each peer of a flood. */
    if (l->dropped++ % 1000 == 0)
      GPUIPC__WARN("conn",
                   "%d handshakes pending on %s: dropping the oldest (pid "
                   "%d; %llu dropped so far)",
                   l->npending, l->path, l->pending[0]->pid,
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
      l->opts.nonblocking ? 0 : gpuipc__deadline_ms(l->opts.timeout_ms);
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
      pend *x = l->pending[i];
      if (!step_all && !x->ready) {
        i++;
        continue;
      }
      x->ready = false;
      int stage = gpuipc__hs_stage(x->hs);
      gpuipc_status s = gpuipc__hs_step(x->hs, gpuipc__deadline_ms(100));
      if (s == GPUIPC_E_WOULD_BLOCK) {
        /* A peer that answered has its time again for the next answer:
         * the deadline bounds how long a peer keeps us waiting, not how
         * long the application took to call accept again. */
        if (gpuipc__hs_stage(x->hs) != stage)
          x->deadline = gpuipc__deadline_ms(l->opts.handshake_timeout_ms);
        i++;
        continue;
      }
      int pid = x->pid;
      gpuipc_conn *c = pending_take(l, i);
      if (s == GPUIPC_OK && l->opts.watch_peer)
        s = gpuipc__watch_add(c);
      if (s == GPUIPC_OK) {
        *out = c;
        return GPUIPC_OK;
      }
      gpuipc__conn_free(c);
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
      pend *x = l->pending[i];
      if (x->deadline <= now) {
        GPUIPC__WARN("conn",
                     "dropping peer pid %d on %s: no handshake within %d ms",
                     x->pid, l->path, l->opts.handshake_timeout_ms);
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
                       gpuipc__poll_ms(wake));
    if (n < 0 && errno != EINTR)
      return gpuipc__fail_errno(errno, "epoll_wait", "%s", l->path);
    for (int i = 0; i < n; i++)
      if (evs[i].data.ptr)
        ((pend *)evs[i].data.ptr)->ready = true;
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
  uint64_t deadline = gpuipc__deadline_ms(t == 0 ? 10000 : t);
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
  gpuipc_status cs = gpuipc__peer_cred_check(fd, &o.o, &pre);
  if (cs != GPUIPC_OK)
    close(fd);
  if (cs == GPUIPC_E_PEER_REFUSED) {
    GPUIPC__WARN("conn", "refusing listener %s: uid %u is not allowed", shown,
                 (unsigned)pre.uid);
    return gpuipc__fail(GPUIPC_E_PEER_REFUSED,
                        "connect %s: the listener runs as uid %u, which is "
                        "not allowed",
                        shown, (unsigned)pre.uid);
  }
  if (cs != GPUIPC_OK)
    return cs;
  return gpuipc__hs_connect(fd, &o.o, &pre, out);
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
  return gpuipc__hs_connect(fd, &o.o, NULL, out);
}
