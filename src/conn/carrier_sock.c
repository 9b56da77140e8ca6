/*
 * carrier_sock.c: the socket carrier: a connection's frames go over its
 * Unix stream socket, through the core socket helpers (the one
 * sendmsg/recvmsg of the library, core/sock.c). The socket is always
 * O_NONBLOCK; waiting is poll(2) bounded by the caller's deadline.
 */
#include "carrier.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

gpuipc_status gpuipc__sock_carrier_write(gpuipc__carrier *k, const struct iovec *iov,
                                int niov, const int *fds, int nfds,
                                size_t *written) {
  if (k->fd < 0)
    return GPUIPC_E_PEER_GONE;
  return gpuipc__sock_send(k->fd, iov, niov, fds, nfds, false, MSG_DONTWAIT,
                           written);
}

gpuipc_status gpuipc__sock_carrier_read(gpuipc__carrier *k, unsigned char *buf,
                               size_t cap, int *fds, int fcap, int *nfds,
                               size_t *got) {
  *nfds = 0;
  if (k->fd < 0)
    return GPUIPC_E_PEER_GONE;
  return gpuipc__sock_recv(k->fd, buf, cap, MSG_DONTWAIT, fds, fcap, nfds,
                           NULL, NULL, got);
}

/* A spin here looks at the socket with poll(2) and no timeout (a system
 * call each time, but no sleep and no wake-up); only when asked for. */
static int sock_wait(gpuipc__carrier *k, short events, uint64_t deadline,
                     int spin_us) {
  int fd = gpuipc__carrier_fd_now(k);
  if (fd < 0)
    return POLLHUP;
  if (spin_us > 0) {
    uint64_t until = gpuipc__now_ns() + (uint64_t)spin_us * 1000;
    if (deadline < until)
      until = deadline;
    do {
      struct pollfd p = {fd, events, 0};
      int r = poll(&p, 1, 0);
      if (r > 0)
        return p.revents;
      if (r < 0 && errno != EINTR)
        return -1;
    } while (gpuipc__now_ns() < until);
  }
  return gpuipc__wait_fd(fd, events, deadline);
}

int gpuipc__sock_carrier_fd(const gpuipc__carrier *k) { return k->fd; }

static void sock_hangup(gpuipc__carrier *k) { gpuipc__carrier_close_fd(k); }

static const gpuipc__carrier_ops sock_ops = {
    .name = "socket",
    .write = gpuipc__sock_carrier_write,
    .read = gpuipc__sock_carrier_read,
    .wait = sock_wait,
    .fd = gpuipc__sock_carrier_fd,
    .hangup = sock_hangup,
    .release = sock_hangup,
};

void gpuipc__carrier_sock_init(gpuipc__carrier *k, int fd) {
  k->ops = &sock_ops;
  k->fd = fd;
  k->impl = NULL;
}
