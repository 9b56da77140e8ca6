/*
 * fuzz_conn.h: what the connection fuzz targets (fuzz_frames.c,
 * fuzz_handshake.c) share: the emulator set up as the driver, a hostile
 * peer's end of a socket pair (bytes sent with the kernel's credentials and,
 * on request, with file descriptors), frame header checks made right so
 * that mutations reach the payload decoders, driving a connection until it
 * stops, and the fd leak check.
 */
#ifndef GPUIPC_FUZZ_CONN_H
#define GPUIPC_FUZZ_CONN_H

#include "tree.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_FD_SCAN 512

/* Open descriptors below FUZZ_FD_SCAN, pipes left out: neither the
 * library nor the emulator makes pipes, and the sanitizer's symbolizer
 * (started when libFuzzer first prints a new function) keeps two. */
static inline int fuzz_open_fds(void) {
  int n = 0;
  struct stat st;
  for (int fd = 0; fd < FUZZ_FD_SCAN; fd++)
    if (fstat(fd, &st) == 0 && !S_ISFIFO(st.st_mode))
      n++;
  return n;
}

static int fuzz_fd_baseline = -1;

/* The driver is the emulator (unless GPUIPC_CUDA_DRIVER names another),
 * the log quiet (refusals warn), and the driver loaded before the fd
 * baseline is taken, so that its own descriptors do not count as leaks. */
static inline void fuzz_conn_init(void) {
#ifdef GPUIPC_EMU_PATH
  setenv("GPUIPC_CUDA_DRIVER", GPUIPC_EMU_PATH, 0);
#endif
  /* Imports close with their last reference (the import cache's linger
   * would keep a mapping, and its descriptor, past the input's check). */
  setenv("GPUIPC_IMPORT_LINGER_MS", "0", 0);
  if (getenv("GPUIPC_LOG") == NULL)
    gpuipc_log_set_level(GPUIPC_LOG_OFF);
  (void)gpuipc__driver();
}

/* Called after each input, when every object of it is gone. */
static inline void fuzz_check_fds(const char *what) {
  int n = fuzz_open_fds();
  if (fuzz_fd_baseline < 0) {
    fuzz_fd_baseline = n;
    return;
  }
  if (n > fuzz_fd_baseline) {
    fprintf(stderr, "%s: %d file descriptor(s) leaked (%d open, %d before)\n",
            what, n - fuzz_fd_baseline, n, fuzz_fd_baseline);
    for (int fd = 0; fd < FUZZ_FD_SCAN; fd++) {
      char path[64], target[256];
      snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
      ssize_t k = readlink(path, target, sizeof target - 1);
      if (k >= 0)
        fprintf(stderr, "  fd %d: %.*s\n", fd, (int)k, target);
    }
    abort();
  }
}

/* Sends len bytes on fd in one sendmsg with our credentials and nfds of
 * the descriptors fds (the caller keeps its copies). Returns 0 when all
 * went. */
static inline int fuzz_send_fds(int fd, const uint8_t *p, size_t len,
                                const int *fds, int nfds) {
  if (len == 0)
    return 0;
  union {
    char b[CMSG_SPACE(sizeof(struct ucred)) +
           CMSG_SPACE(sizeof(int) * (GPUIPC__FRAME_FDS_MAX + 2))];
    struct cmsghdr align;
  } cb;
  memset(&cb, 0, sizeof cb);
  struct iovec iov = {(void *)p, len};
  struct msghdr mh = {0};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cb.b;
  mh.msg_controllen = CMSG_SPACE(sizeof(struct ucred)) +
                      (nfds > 0 ? CMSG_SPACE(sizeof(int) * (size_t)nfds) : 0);
  struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_CREDENTIALS;
  cm->cmsg_len = CMSG_LEN(sizeof(struct ucred));
  struct ucred uc = {getpid(), geteuid(), getegid()};
  memcpy(CMSG_DATA(cm), &uc, sizeof uc);
  if (nfds > 0) {
    cm = CMSG_NXTHDR(&mh, cm);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
  }
  ssize_t w;
  do
    w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  while (w < 0 && errno == EINTR);
  return w == (ssize_t)len ? 0 : -1;
}

/* As fuzz_send_fds, with nfds copies of /dev/null. */
static inline int fuzz_send(int fd, const uint8_t *p, size_t len, int nfds) {
  int fds[GPUIPC__FRAME_FDS_MAX + 2];
  if (len == 0)
    return 0;
  if (nfds > (int)(sizeof fds / sizeof fds[0]))
    nfds = (int)(sizeof fds / sizeof fds[0]);
  int k = 0;
  while (k < nfds && (fds[k] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
    k++;
  int r = fuzz_send_fds(fd, p, len, fds, k);
  for (int i = 0; i < k; i++)
    close(fds[i]);
  return r;
}

/* Makes the header check of every frame in p right (walking by the
 * declared lengths), leaving magic, version, type, nfds and len as they
 * are: the fuzzer then reaches the checks behind the header check. */
static inline void fuzz_fix_checks(uint8_t *p, size_t len) {
  size_t off = 0;
  while (len - off >= sizeof(gpuipc__frame_hdr)) {
    gpuipc__frame_hdr h;
    memcpy(&h, p + off, sizeof h);
    h.check = gpuipc__frame_check(&h);
    memcpy(p + off, &h, sizeof h);
    if (h.len > len - off - sizeof h)
      break;
    off += sizeof h + h.len;
  }
}

/* A HELLO frame as this process's library would send it. */
static inline size_t fuzz_hello(uint8_t *out, uint32_t max_outstanding) {
  gpuipc__hello me = {0};
  me.proto = GPUIPC__PROTO_VERSION;
  me.pid = getpid();
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = max_outstanding;
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         GPUIPC__F_HELLO, 0, sizeof me, 0};
  h.check = gpuipc__frame_check(&h);
  memcpy(out, &h, sizeof h);
  memcpy(out + sizeof h, &me, sizeof me);
  return sizeof h + sizeof me;
}

static inline size_t fuzz_accept_frame(uint8_t *out) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         GPUIPC__F_ACCEPT, 0, 0, 0};
  h.check = gpuipc__frame_check(&h);
  memcpy(out, &h, sizeof h);
  return sizeof h;
}

/* Sends on fd what a peer of this process sends in the handshake: HELLO
 * (a peer of 256 outstanding buffers), then ACCEPT. */
static inline void fuzz_hello_accept(int fd) {
  uint8_t hs[128];
  size_t hl = fuzz_hello(hs, 256);
  hl += fuzz_accept_frame(hs + hl);
  if (fuzz_send(fd, hs, hl, 0) != 0)
    abort();
}

/* Starts a recorded peer: a child process that runs peer_main(sv, life)
 * on its end of a socket pair (a connection's handshake, then what it
 * sends) and exits when the parent's end of `life` closes (kept open for
 * the parent's lifetime), or with the parent. Answers the child's HELLO
 * as a peer of its pid would (the kernel vouches for our credentials, and
 * the HELLO must agree with them). Returns our end of the pair. */
static inline int fuzz_spawn_peer(void (*peer_main)(int sv, int life)) {
  int sv[2], life[2];
  if (gpuipc_conn_pair(sv) != GPUIPC_OK || gpuipc_conn_pair(life) != GPUIPC_OK)
    abort();
  pid_t pid = fork();
  if (pid < 0)
    abort();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(sv[1]);
    close(life[0]);
    peer_main(sv[0], life[1]);
    _exit(0);
  }
  close(sv[0]);
  close(life[1]);
  fuzz_hello_accept(sv[1]);
  return sv[1];
}

/* Reads what a recorded peer sends on fd into buf (cap bytes), the
 * descriptors that come with it into fds (at most maxfds, *nfds of them),
 * until done(buf, got) says it is all there, the peer is silent for
 * quiet_ms, or it hangs up. Returns the bytes read. */
static inline size_t fuzz_record(int fd, uint8_t *buf, size_t cap, int *fds,
                                 int maxfds, int *nfds,
                                 bool (*done)(const uint8_t *, size_t),
                                 int quiet_ms) {
  size_t got = 0;
  *nfds = 0;
  while (!done(buf, got) && got < cap) {
    union {
      char b[CMSG_SPACE(sizeof(int) * GPUIPC__FRAME_FDS_MAX)];
      struct cmsghdr align;
    } cb;
    struct iovec iov = {buf + got, cap - got};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.b;
    mh.msg_controllen = sizeof cb.b;
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, quiet_ms) <= 0)
      break;
    ssize_t r = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; i++) {
          int d;
          memcpy(&d, CMSG_DATA(cm) + sizeof(int) * (size_t)i, sizeof d);
          if (*nfds < maxfds)
            fds[(*nfds)++] = d;
          else
            close(d);
        }
      }
    got += (size_t)r;
  }
  return got;
}

/* Whether the legacy stream's work completes within ms milliseconds. */
static inline bool fuzz_drain_legacy(int ms) {
  for (int i = 0; i < ms; i++) {
    CUresult r = gpuipc__cu.cuStreamQuery(NULL);
    if (r != CUDA_ERROR_NOT_READY)
      return true;
    usleep(1000);
  }
  return false;
}

static inline void fuzz_die(const char *what, gpuipc_status s) {
  fprintf(stderr, "%s: %s (%s)\n", what, gpuipc_status_name(s),
          gpuipc_last_error());
  abort();
}

/* Drives an open connection with zero timeouts until nothing more
 * happens: progress, user messages, buffers (each released at once). A
 * connection that ended must stay ended and say so (E_CLOSED or
 * E_PEER_GONE), and no call may return a status outside the enum. */
static inline void fuzz_drive(gpuipc_conn *c) {
  static uint8_t buf[GPUIPC_CONN_MSG_MAX];
  gpuipc_status ended = GPUIPC_OK;
  for (int round = 0; round < 256; round++) {
    int moved = 0;
    gpuipc_status s = gpuipc_conn_progress(c, 0);
    if (s < 0 || s >= GPUIPC__STATUS_END)
      fuzz_die("progress: status out of range", s);
    if (s != GPUIPC_OK) {
      if (ended != GPUIPC_OK && s != GPUIPC_E_CLOSED &&
          s != GPUIPC_E_PEER_GONE)
        fuzz_die("progress on an ended connection", s);
      if (ended != GPUIPC_OK)
        break;
      ended = s;
      moved = 1;
    }
    size_t len = 0;
    int fds[GPUIPC_CONN_FDS_MAX];
    int nfds = GPUIPC_CONN_FDS_MAX;
    s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, fds, &nfds);
    if (s == GPUIPC_OK || s == GPUIPC_E_TRUNCATED) {
      if (nfds < 0 || nfds > GPUIPC_CONN_FDS_MAX || len > GPUIPC_CONN_MSG_MAX)
        fuzz_die("recv_msg: bad counts", s);
      for (int i = 0; i < nfds; i++)
        close(fds[i]);
      moved = 1;
    }
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    s = gpuipc_conn_recv(c, NULL, &r);
    if (s == GPUIPC_OK) {
      if (r.meta_len > GPUIPC_META_MAX)
        fuzz_die("recv: meta_len", s);
      gpuipc_status rs = gpuipc_conn_release(c, r.id, NULL);
      if (rs != GPUIPC_OK)
        fuzz_die("release of a received buffer", rs);
      moved = 1;
    }
    size_t by_peer = 0, here = 0;
    (void)gpuipc_conn_get_outstanding(c, &by_peer, &here);
    if (!moved)
      break;
  }
}

#endif /* GPUIPC_FUZZ_CONN_H */
