/*
 * conn_internal.h: what the connection modules share: the frame format, the
 * connection object, and the entry points between the transport (conn.c),
 * the handoff fast path (handoff.c), arenas (arena.c) and leases (lease.c).
 *
 * Frame format (all integers little-endian; x86-64 and aarch64 Linux are
 * little-endian, so the structs below are the wire format on every platform
 * gpuipc builds on, and a static assertion says so):
 *
 *   u32 magic    GPUIPC__FRAME_MAGIC
 *   u8  version  GPUIPC__FRAME_VERSION
 *   u8  type     GPUIPC__F_*
 *   u16 nfds     file descriptors that came with the frame's first byte
 *   u32 len      payload bytes that follow (<= GPUIPC__FRAME_MAX)
 *   u32 check    header check: magic ^ len ^ (type << 8 | nfds) ^ 0x5a5a5a5a
 *
 * The header check catches a stream that lost sync (a peer that writes
 * garbage, or bytes from the middle of a payload taken for a header).
 */
#ifndef GPUIPC_CONN_INTERNAL_H
#define GPUIPC_CONN_INTERNAL_H

#include "internal.h"

#include <sys/types.h>

#define GPUIPC__FRAME_MAGIC 0x43504947u /* "GIPC" */
#define GPUIPC__FRAME_VERSION 1
#define GPUIPC__FRAME_MAX (GPUIPC_CONN_MSG_MAX + 1024)
#define GPUIPC__FRAME_FDS_MAX 16
#define GPUIPC__PROTO_VERSION 1

enum {
  GPUIPC__F_HELLO = 1,  /* handshake: who I am */
  GPUIPC__F_ACCEPT = 2, /* handshake: I accept you */
  GPUIPC__F_REFUSE = 3, /* handshake: I refuse you (text reason) */
  GPUIPC__F_MSG = 4,    /* user message (+ fds) */
  GPUIPC__F_CHUNK = 5,  /* an arena chunk: descriptor (+ fd) */
  GPUIPC__F_CTL = 6,    /* where the sender's flag words live */
  GPUIPC__F_BUF = 7,    /* one buffer (the fast path) */
  GPUIPC__F_REL = 8,    /* releases of buffers */
  GPUIPC__F_BYE = 9,    /* orderly close: everything I held is released */
  GPUIPC__F_TYPE_MAX = 9
};

typedef struct gpuipc__frame_hdr {
  uint32_t magic;
  uint8_t version;
  uint8_t type;
  uint16_t nfds;
  uint32_t len;
  uint32_t check;
} gpuipc__frame_hdr;

_Static_assert(sizeof(gpuipc__frame_hdr) == 16, "frame header is 16 bytes");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gpuipc's wire format assumes a little-endian host"
#endif

static inline uint32_t gpuipc__frame_check(const gpuipc__frame_hdr *h) {
  return h->magic ^ h->len ^ ((uint32_t)h->type << 8 | h->nfds) ^ 0x5a5a5a5au;
}

/* HELLO payload. */
typedef struct gpuipc__hello {
  uint32_t proto;
  uint32_t flags;
  int32_t pid;
  uint32_t uid;
  uint32_t gid;
  uint32_t max_outstanding;
  uint64_t start_time;
  uint8_t boot_id[16];
} gpuipc__hello;

/* A queued user message. */
typedef struct gpuipc__msg {
  struct gpuipc__msg *next;
  size_t len;
  int nfds;
  int fds[GPUIPC__FRAME_FDS_MAX];
  unsigned char data[]; /* len bytes */
} gpuipc__msg;

typedef enum gpuipc__conn_state {
  GPUIPC__CONN_OPEN = 0,
  GPUIPC__CONN_PEER_GONE, /* EOF / reset / BYE: the peer left */
  GPUIPC__CONN_BROKEN     /* we disconnected it (protocol error) */
} gpuipc__conn_state;

struct gpuipc__ho; /* handoff state, handoff.c */

struct gpuipc_conn {
  int fd;
  gpuipc__conn_state state;
  gpuipc_status broken_status; /* why it broke (E_PROTOCOL ...) */
  char broken_why[200];
  int timeout_ms;
  int nonblocking;
  uint32_t max_outstanding;
  gpuipc_order_mode order;
  /* Peer, as the kernel vouched for it (SCM_CREDENTIALS at handshake). */
  int peer_pid;
  uint32_t peer_uid, peer_gid;
  uint64_t peer_start_time;
  uint32_t peer_max_outstanding;
  int peer_said_bye;
  /* Receive side: bytes read and not yet parsed; descriptors received and
   * not yet claimed by a frame. */
  unsigned char *rx;
  size_t rx_len, rx_cap;
  int rx_fds[64];
  int rx_nfds;
  /* Transmit side: bytes of frames not yet written (the first bytes of the
   * oldest frame already went out, with its descriptors). */
  unsigned char *tx;
  size_t tx_off, tx_len, tx_cap;
  /* User messages received, oldest first. */
  gpuipc__msg *msg_head, *msg_tail;
  size_t msg_count;
  /* The fast path (NULL until first used). */
  struct gpuipc__ho *ho;
};

/* ---- transport (conn.c) --------------------------------------------------- */

/* A deadline for the calls of one API call: from the connection's timeout
 * (UINT64_MAX: none; 0: do not wait). */
uint64_t gpuipc__conn_deadline(const gpuipc_conn *c);

/* Queues one frame and writes as much as the socket takes. The payload is
 * given as up to 3 pieces (NULL/0 for unused). fds are sent with the
 * frame's first byte (the caller keeps its copies). When the socket is full:
 * waits (until deadline, reading incoming frames meanwhile) for frames with
 * fds; frames without fds are queued and flushed later. Returns E_TIMEOUT /
 * E_WOULD_BLOCK when nothing of the frame was sent, E_PEER_GONE, E_CLOSED. */
gpuipc_status gpuipc__conn_send_frame(gpuipc_conn *c, int type,
                                      const void *p1, size_t n1,
                                      const void *p2, size_t n2,
                                      const int *fds, int nfds,
                                      uint64_t deadline);

/* Reads what is available and dispatches complete frames; then, if
 * `wait_for` returns false and the deadline allows, waits for more. Returns
 * GPUIPC_OK when wait_for(c, arg) became true (or wait_for is NULL and the
 * pass is done), E_TIMEOUT / E_WOULD_BLOCK when the deadline passed first,
 * E_PEER_GONE / E_CLOSED / E_PROTOCOL when the connection ended (after
 * dispatching what came before). */
gpuipc_status gpuipc__conn_pump(gpuipc_conn *c, uint64_t deadline,
                                bool (*wait_for)(gpuipc_conn *, void *),
                                void *arg);

/* Status for a call on a connection that is no longer open. */
gpuipc_status gpuipc__conn_ended(gpuipc_conn *c);

/* Marks the connection broken by a protocol violation: logs, closes the
 * socket, runs the peer-gone cleanup; returns E_PROTOCOL. */
gpuipc_status gpuipc__conn_break(gpuipc_conn *c, const char *fmt, ...)
    GPUIPC__PRINTF(2, 3);

/* ---- handoff (handoff.c) ---------------------------------------------------- */

/* Handles a fast-path frame (CHUNK, CTL, BUF, REL, BYE). The fds belong to
 * the callee (close what you do not keep). A non-OK return breaks the
 * connection with that status (the message says why). */
gpuipc_status gpuipc__ho_frame(gpuipc_conn *c, int type, const unsigned char *p,
                               size_t len, int *fds, int nfds);
/* The peer is gone (EOF, reset, protocol break): unblock our streams that
 * wait on its flag words; hand its leases to the reclaim logic. */
void gpuipc__ho_peer_gone(gpuipc_conn *c);
/* Periodic: reclaim what a dead peer held once its process is gone. */
void gpuipc__ho_poll(gpuipc_conn *c);
/* On close: release what we hold, tell the peer, free the state. */
void gpuipc__ho_close(gpuipc_conn *c);

#endif /* GPUIPC_CONN_INTERNAL_H */
