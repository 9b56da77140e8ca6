/*
 * sock.c: the one place that calls sendmsg(2) and recvmsg(2) with
 * ancillary data (file descriptors by SCM_RIGHTS, credentials by
 * SCM_CREDENTIALS), as libuv keeps a single uv__recvmsg. The connection
 * transport, its handshake and gpuipc_desc_send/recv all go through these
 * two functions, so that the rules below hold everywhere:
 *
 * - EINTR is retried; SIGPIPE is never raised (MSG_NOSIGNAL).
 * - Received descriptors are close-on-exec (MSG_CMSG_CLOEXEC) and never
 *   leak: those beyond the caller's room are closed and reported.
 * - When the kernel truncated the control data (MSG_CTRUNC), the caller is
 *   told why as far as this process can know: if this process has no
 *   descriptor left (EMFILE/ENFILE) the kernel dropped the peer's
 *   descriptors and that is our limit (GPUIPC_E_LIMIT), otherwise the peer
 *   sent more than any message carries (GPUIPC_E_PROTOCOL).
 *
 * The bounded wait on a socket (poll until a deadline, EINTR only
 * shortening one round) is here too, for the carriers, the handshake and
 * the listener alike.
 */
#include "core_int.h"

#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

gpuipc_status gpuipc__sock_send(int fd, const struct iovec *iov, int niov,
                                const int *fds, int nfds, bool with_cred,
                                int flags, size_t *sent) {
  *sent = 0;
  if (nfds < 0 || nfds > GPUIPC__SOCK_FDS_MAX || (nfds > 0 && fds == NULL))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "sendmsg: %d descriptors", nfds);
  union {
    char buf[CMSG_SPACE(sizeof(int) * GPUIPC__SOCK_FDS_MAX) +
             CMSG_SPACE(sizeof(struct ucred))];
    struct cmsghdr align;
  } cb;
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = (struct iovec *)iov;
  mh.msg_iovlen = (size_t)niov;
  if (nfds > 0 || with_cred) {
    memset(&cb, 0, sizeof cb);
    mh.msg_control = cb.buf;
    mh.msg_controllen = (nfds > 0 ? CMSG_SPACE(sizeof(int) * (size_t)nfds) : 0) +
                        (with_cred ? CMSG_SPACE(sizeof(struct ucred)) : 0);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    if (nfds > 0) {
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
      memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
      cm = CMSG_NXTHDR(&mh, cm);
    }
    if (with_cred) {
      struct ucred uc = {getpid(), geteuid(), getegid()};
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_CREDENTIALS;
      cm->cmsg_len = CMSG_LEN(sizeof uc);
      memcpy(CMSG_DATA(cm), &uc, sizeof uc);
    }
  }
  ssize_t w;
  GPUIPC__EINTR_RETRY(w, sendmsg(fd, &mh, MSG_NOSIGNAL | flags));
  if (w >= 0) {
    *sent = (size_t)w;
    return GPUIPC_OK;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK)
    return GPUIPC_E_WOULD_BLOCK; /* not an error: nothing recorded */
  if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)
    return gpuipc__fail(GPUIPC_E_PEER_GONE, "sendmsg: the peer closed the "
                                            "connection");
  return gpuipc__fail_errno(errno, "sendmsg", NULL);
}

/* True when this process cannot open one more descriptor. */
static bool out_of_fds(void) {
  int probe = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 0);
  if (probe < 0) {
    if (errno == EMFILE || errno == ENFILE)
      return true;
    /* stderr may be closed: any fd of ours will do. */
    probe = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (probe < 0)
      return errno == EMFILE || errno == ENFILE;
  }
  close(probe);
  return false;
}

gpuipc_status gpuipc__sock_recv(int fd, void *buf, size_t cap, int flags,
                                int *fds, int fds_cap, int *nfds,
                                struct ucred *cred, bool *have_cred,
                                size_t *got) {
  *got = 0;
  if (nfds)
    *nfds = 0;
  if (have_cred)
    *have_cred = false;
  union {
    char buf[CMSG_SPACE(sizeof(int) * GPUIPC__SOCK_FDS_MAX) +
             CMSG_SPACE(sizeof(struct ucred))];
    struct cmsghdr align;
  } cb;
  struct iovec iov = {buf, cap};
  struct msghdr mh;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cb.buf;
  mh.msg_controllen = sizeof cb.buf;
  ssize_t r;
  GPUIPC__EINTR_RETRY(r, recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | flags));
  if (r < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return GPUIPC_E_WOULD_BLOCK; /* not an error: nothing recorded */
    if (errno == ECONNRESET || errno == ENOTCONN)
      return gpuipc__fail(GPUIPC_E_PEER_GONE, "recvmsg: the peer reset the "
                                              "connection");
    return gpuipc__fail_errno(errno, "recvmsg", NULL);
  }
  *got = (size_t)r;
  int kept = 0, extra = 0;
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level != SOL_SOCKET)
      continue;
    if (cm->cmsg_type == SCM_CREDENTIALS &&
        cm->cmsg_len >= CMSG_LEN(sizeof(struct ucred))) {
      if (cred && have_cred) {
        memcpy(cred, CMSG_DATA(cm), sizeof *cred);
        *have_cred = true;
      }
    } else if (cm->cmsg_type == SCM_RIGHTS) {
      size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; i++) {
        int f;
        memcpy(&f, CMSG_DATA(cm) + sizeof(int) * i, sizeof f);
        if (fds && kept < fds_cap)
          fds[kept++] = f;
        else {
          close(f);
          extra++;
        }
      }
    }
  }
  if (mh.msg_flags & MSG_CTRUNC) {
    /* What came is incomplete: keep none of it. */
    for (int i = 0; i < kept; i++)
      close(fds[i]);
    if (out_of_fds())
      return gpuipc__fail(GPUIPC_E_LIMIT,
                          "recvmsg: this process has no file descriptor left "
                          "(EMFILE): the kernel dropped the descriptors the "
                          "peer sent");
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "recvmsg: the peer sent more than %d file "
                        "descriptors with one message",
                        GPUIPC__SOCK_FDS_MAX);
  }
  if (extra > 0) {
    /* More than the caller has room for: the message's descriptors are
     * all refused, those kept included (the caller breaks the stream and
     * would not know to close them). */
    for (int i = 0; i < kept; i++)
      close(fds[i]);
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "recvmsg: %d unexpected file descriptor%s (closed)",
                        extra, extra == 1 ? "" : "s");
  }
  if (nfds)
    *nfds = kept;
  return GPUIPC_OK;
}

uint64_t gpuipc__deadline_ms(int timeout_ms) {
  if (timeout_ms < 0)
    return UINT64_MAX;
  if (timeout_ms == 0)
    return 0;
  return gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

int gpuipc__poll_ms(uint64_t deadline) {
  if (deadline == UINT64_MAX)
    return -1;
  uint64_t now = gpuipc__now_ns();
  if (now >= deadline)
    return 0;
  uint64_t ms = (deadline - now + 999999) / 1000000;
  return ms > 1000000 ? 1000000 : (int)ms;
}

int gpuipc__wait_fd(int fd, short events, uint64_t deadline) {
  for (;;) {
    struct pollfd p = {fd, events, 0};
    int ms = gpuipc__poll_ms(deadline);
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
