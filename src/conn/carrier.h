/*
 * carrier.h: what carries a connection's frames between the two
 * processes, as the frame layer (frames.c) sees it: a small table of
 * operations in the manner of curl's connection filters or Redis's
 * ConnectionType, so that the code above never knows which carrier is
 * below it (src/conn/ only).
 *
 * A carrier moves bytes of frames and the file descriptors that go with
 * them, never waits unless asked to (wait), and says the peer left as
 * GPUIPC_E_PEER_GONE or an orderly end of stream. It knows nothing of
 * frames: the framing, the transmit queue and every check of what arrives
 * are the frame layer's. Every carrier keeps a Unix stream socket to the
 * peer (the handshake runs on it before any carrier is chosen, and it
 * carries descriptors and credentials, the wake of a sleeping peer and the
 * sign of its death), and gpuipc_conn_get_fd is the carrier's pollable fd.
 *
 * Carriers: the socket itself (carrier_sock.c). A shared-memory ring for
 * the fast-path frames (docs/ring.md) is the planned second one.
 */
#ifndef GPUIPC_CONN_CARRIER_H
#define GPUIPC_CONN_CARRIER_H

#include "core/core.h"

struct iovec;
struct gpuipc__carrier;

typedef struct gpuipc__carrier_ops {
  const char *name; /* "socket" */
  /* Writes as much of the bytes of iov as goes without waiting, the fds
   * (0..GPUIPC__SOCK_FDS_MAX) with the first byte. GPUIPC_OK with
   * *written bytes (maybe fewer than given; never 0), GPUIPC_E_WOULD_BLOCK
   * when nothing went, GPUIPC_E_PEER_GONE, or the system error's status. */
  gpuipc_status (*write)(struct gpuipc__carrier *k, const struct iovec *iov,
                         int niov, const int *fds, int nfds,
                         size_t *written /* OUT */);
  /* Reads what is there without waiting: bytes of frames into
   * buf[0..cap), up to fcap descriptors that came with them into fds.
   * GPUIPC_OK with *got bytes (0: the peer's orderly end of stream),
   * GPUIPC_E_WOULD_BLOCK when nothing is there, GPUIPC_E_PEER_GONE (reset);
   * with the bytes consumed all the same, GPUIPC_E_PROTOCOL when more
   * descriptors came than fcap and GPUIPC_E_LIMIT when the kernel dropped
   * them for want of a descriptor here (no descriptor kept in both). */
  gpuipc_status (*read)(struct gpuipc__carrier *k, unsigned char *buf,
                        size_t cap, int *fds, int fcap, int *nfds /* OUT */,
                        size_t *got /* OUT */);
  /* Waits until the carrier is readable (POLLIN), writable (POLLOUT) or
   * hung up, or the deadline (gpuipc__now_ns; UINT64_MAX: none) passes.
   * The poll(2) revents, 0 at the deadline, -1 with errno. */
  int (*wait)(struct gpuipc__carrier *k, short events, uint64_t deadline);
  /* After frames were written: makes a peer that sleeps on its pollable fd
   * look at them (the socket needs nothing: its bytes wake the peer). */
  void (*wake)(struct gpuipc__carrier *k);
  /* The fd a caller polls for this connection: readable when something
   * arrived or the peer left (-1 once hung up). */
  int (*fd)(const struct gpuipc__carrier *k);
  /* Ends the carrier on our side (idempotent): the peer sees the end of
   * the stream; later writes and reads say GPUIPC_E_PEER_GONE. */
  void (*hangup)(struct gpuipc__carrier *k);
} gpuipc__carrier_ops;

/* A connection's carrier: its operations, the socket every carrier keeps
 * (-1 once hung up; the handshake reads and writes it directly), and the
 * carrier's own state. */
typedef struct gpuipc__carrier {
  const gpuipc__carrier_ops *ops;
  int fd;
  void *impl;
} gpuipc__carrier;

/* The socket carrier on the connected Unix stream socket fd (owned from
 * now on; O_NONBLOCK). */
void gpuipc__carrier_sock_init(gpuipc__carrier *k, int fd);

#endif /* GPUIPC_CONN_CARRIER_H */
