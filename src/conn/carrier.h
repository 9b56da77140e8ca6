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
 * Carriers: the socket itself (carrier_sock.c), and the socket with a
 * shared-memory ring per direction for the fast-path frames
 * (carrier_ring.c, docs/ring.md), chosen at the handshake.
 */
#ifndef GPUIPC_CONN_CARRIER_H
#define GPUIPC_CONN_CARRIER_H

#include "core/core.h"

#include <stdbool.h>
#include <unistd.h>

struct iovec;
struct gpuipc__carrier;

typedef struct gpuipc__carrier_ops {
  const char *name; /* "socket", "ring" */
  /* Writes as much of the bytes of iov to the socket as goes without
   * waiting, the fds (0..GPUIPC__SOCK_FDS_MAX) with the first byte.
   * GPUIPC_OK with *written bytes (maybe fewer than given; never 0),
   * GPUIPC_E_WOULD_BLOCK when nothing went, GPUIPC_E_PEER_GONE, or the
   * system error's status. */
  gpuipc_status (*write)(struct gpuipc__carrier *k, const struct iovec *iov,
                         int niov, const int *fds, int nfds,
                         size_t *written /* OUT */);
  /* Reads what the socket has without waiting: bytes of frames into
   * buf[0..cap), up to fcap descriptors that came with them into fds.
   * GPUIPC_OK with *got bytes (0: the peer's orderly end of stream),
   * GPUIPC_E_WOULD_BLOCK when nothing is there, GPUIPC_E_PEER_GONE (reset);
   * with the bytes consumed all the same, GPUIPC_E_PROTOCOL when more
   * descriptors came than fcap and GPUIPC_E_LIMIT when the kernel dropped
   * them for want of a descriptor here (no descriptor kept in both). */
  gpuipc_status (*read)(struct gpuipc__carrier *k, unsigned char *buf,
                        size_t cap, int *fds, int fcap, int *nfds /* OUT */,
                        size_t *got /* OUT */);
  /* Waits until there is something to read (POLLIN: on the socket or, for
   * a carrier with records, a record), the socket is writable (POLLOUT)
   * or hung up, or the deadline (gpuipc__now_ns; UINT64_MAX: none)
   * passes; first, for POLLIN, it looks without sleeping for spin_us
   * (-1: the carrier's own setting). The poll(2) revents, 0 at the
   * deadline, -1 with errno. It changes nothing a call of another thread
   * reads without atomics (gpuipc_conn_wait calls it beside one). */
  int (*wait)(struct gpuipc__carrier *k, short events, uint64_t deadline,
              int spin_us);
  /* The fd a caller polls for this connection: the socket, readable when
   * something arrived or the peer left (-1 once hung up). */
  int (*fd)(const struct gpuipc__carrier *k);
  /* Ends the carrier on our side (idempotent): the peer sees the end of
   * the socket's stream; later writes say GPUIPC_E_PEER_GONE, reads and
   * records find nothing. */
  void (*hangup)(struct gpuipc__carrier *k);
  /* Hangs up and frees what the carrier holds. */
  void (*release)(struct gpuipc__carrier *k);

  /* A carrier of records beside the socket (NULL in the socket carrier):
   * whole frames without descriptors, each with the number of socket
   * frames its writer had written whole before it (the barrier). */
  /* Publishes one record of `len` bytes (iov) whole, or nothing:
   * GPUIPC_OK, GPUIPC_E_WOULD_BLOCK when it does not fit now (send it on
   * the socket), GPUIPC_E_PROTOCOL when the peer's indices lie. */
  gpuipc_status (*put)(struct gpuipc__carrier *k, const struct iovec *iov,
                       int niov, size_t len, uint64_t barrier);
  /* After a put: true when the peer may sleep and has not been woken for
   * this sleep yet (the frame layer then sends it a WAKE frame). */
  bool (*wake)(struct gpuipc__carrier *k);
  /* Takes the next record into buf[0..cap) (private memory): GPUIPC_OK
   * with *len and *barrier, GPUIPC_E_WOULD_BLOCK when there is none,
   * GPUIPC_E_PROTOCOL (reason recorded) when the peer's ring lies. */
  gpuipc_status (*get)(struct gpuipc__carrier *k, unsigned char *buf,
                       size_t cap, size_t *len /* OUT */,
                       uint64_t *barrier /* OUT */);
  /* The application says it calls into the connection often and never
   * sleeps on the fd without telling (on), or no longer (off). */
  void (*set_polling)(struct gpuipc__carrier *k, bool on);
  /* True when our sleep word was made odd (a value a sender may wake with
   * a WAKE frame) since the last time this was asked; asking clears it.
   * The frame layer reads the socket in the same pass as the records then,
   * so the WAKE that came with them is not left to make the fd readable
   * for nothing after the call. */
  bool (*slept)(struct gpuipc__carrier *k);
  /* Publishes n, the socket frames we wrote whole so far, for the peer. */
  void (*sent)(struct gpuipc__carrier *k, uint64_t n);
  /* What the peer published as its socket frames written whole: a hint
   * (a lying peer only makes our reads of its socket come later or for
   * nothing). */
  uint64_t (*peer_sent)(const struct gpuipc__carrier *k);
} gpuipc__carrier_ops;

/* A connection's carrier: its operations, the socket every carrier keeps
 * (-1 once hung up; the handshake reads and writes it directly), and the
 * carrier's own state. */
typedef struct gpuipc__carrier {
  const gpuipc__carrier_ops *ops;
  int fd; /* written only by the thread of the calls, atomically at hang-up */
  void *impl;
} gpuipc__carrier;

/* The fd as a second thread (gpuipc_conn_wait) reads it. */
static inline int gpuipc__carrier_fd_now(const gpuipc__carrier *k) {
  return __atomic_load_n(&k->fd, __ATOMIC_RELAXED);
}

/* Closes the fd (once) and makes it -1. */
static inline void gpuipc__carrier_close_fd(gpuipc__carrier *k) {
  int fd = k->fd;
  if (fd >= 0) {
    __atomic_store_n(&k->fd, -1, __ATOMIC_RELAXED);
    close(fd);
  }
}

/* The socket carrier on the connected Unix stream socket fd (owned from
 * now on; O_NONBLOCK). */
void gpuipc__carrier_sock_init(gpuipc__carrier *k, int fd);

/* The socket carrier's write, read and fd, which the ring carrier uses
 * for its socket as they are. */
gpuipc_status gpuipc__sock_carrier_write(gpuipc__carrier *k,
                                         const struct iovec *iov, int niov,
                                         const int *fds, int nfds,
                                         size_t *written);
gpuipc_status gpuipc__sock_carrier_read(gpuipc__carrier *k, unsigned char *buf,
                                        size_t cap, int *fds, int fcap,
                                        int *nfds, size_t *got);
int gpuipc__sock_carrier_fd(const gpuipc__carrier *k);

/* ---- the ring carrier (carrier_ring.c) ------------------------------------------ */

/* Makes the memfd of the ring this side writes (size bytes, a power of
 * two), sealed against shrinking and growing, and maps it read-write. */
gpuipc_status gpuipc__ring_make(size_t size, int *fd /* OUT */,
                                void **map /* OUT */);
void gpuipc__ring_unmake(void *map, size_t size);
/* Checks the peer's memfd (a sealed memfd of exactly the size, with a
 * ring header that says so) and maps it read-only. */
gpuipc_status gpuipc__ring_open_peer(int fd, size_t size,
                                     const void **map /* OUT */);
/* Makes k (whose socket is k->fd) a ring carrier over our mapping and the
 * peer's (both owned from now on). */
gpuipc_status gpuipc__carrier_ring_init(gpuipc__carrier *k, void *mine,
                                        const void *peer, size_t size,
                                        bool polling, int spin_us);

#endif /* GPUIPC_CONN_CARRIER_H */
