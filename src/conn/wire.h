/*
 * wire.h: the connection frame format, as the structs below lay it out
 * (src/conn/ and, through src/tree.h, the in-tree tests and fuzzers).
 * docs/protocol.md documents every frame type and payload, the handshake,
 * the fast path and its ordering and lease rules. The header:
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
 * All integers are little-endian; x86-64 and aarch64 Linux are
 * little-endian, so the structs are the wire format on every platform
 * gpuipc builds on, and a static assertion says so.
 */
#ifndef GPUIPC_CONN_WIRE_H
#define GPUIPC_CONN_WIRE_H

#include "handle/handle.h"

#define GPUIPC__FRAME_MAGIC 0x43504947u /* "GIPC" */
#define GPUIPC__FRAME_VERSION 1
#define GPUIPC__FRAME_MAX (GPUIPC_CONN_MSG_MAX + 1024)
#define GPUIPC__FRAME_FDS_MAX 16
/* 2: batches (BUFS), broadcast (BUFW), sends without signals (BUF DONE),
 * releases signalled by the next (REL BY_NEXT), the HELLO's pid namespace
 * and the LIVE frame. A peer of version 1 would take a DONE buffer for an
 * ordered one and wait for a signal that never comes: versions must match,
 * and a peer of another one is refused with both numbers. */
#define GPUIPC__PROTO_VERSION 2

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
  GPUIPC__F_BUFD = 10,  /* one buffer by descriptor (+ fds) */
  GPUIPC__F_EVD = 11,   /* event mode: a slot's interprocess event */
  GPUIPC__F_ABANDON = 12, /* I end this connection on my own error: I
                           * still hold these; the rest is untouched */
  GPUIPC__F_BUFS = 13,    /* a batch of buffers, one ready signal */
  GPUIPC__F_BUFW = 14,    /* one buffer ordered by a shared ready word */
  GPUIPC__F_TYPE_MAX = 14,
  /* Handshake only (after ACCEPT, when both HELLOs have
   * GPUIPC__HELLO_F_NS): my liveness table, u64 key + its fd (or key 0 and
   * no fd: I have none). Outside the handshake it ends the connection, as
   * every type above GPUIPC__F_TYPE_MAX does. */
  GPUIPC__F_LIVE = 15,
  /* With the ring carrier only: a sender published a record while our
   * sleep word said we may sleep; it makes our fd readable, and nothing
   * else (no payload). */
  GPUIPC__F_WAKE = 16,
  /* Handshake only (after ACCEPT and LIVE, when both HELLOs have
   * GPUIPC__HELLO_F_RING): the ring this side writes, a gpuipc__w_ring +
   * its memfd. */
  GPUIPC__F_RING = 17
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

/* HELLO payload. A peer of an older library sends the first
 * GPUIPC__HELLO_V1_LEN bytes only, without flags. */
typedef struct gpuipc__hello {
  uint32_t proto;
  uint32_t flags; /* GPUIPC__HELLO_F_* */
  int32_t pid;    /* in the sender's own pid namespace */
  uint32_t uid;
  uint32_t gid;
  uint32_t max_outstanding;
  uint64_t start_time;
  uint8_t boot_id[16];
  uint64_t pidns; /* F_NS: the inode of the sender's pid namespace */
} gpuipc__hello;
#define GPUIPC__HELLO_V1_LEN 48u
/* pidns is set, and a LIVE frame follows this side's ACCEPT when the
 * peer's HELLO has this flag too. */
#define GPUIPC__HELLO_F_NS 0x1u
/* This side carries fast-path frames on a shared-memory ring, and sends a
 * RING frame after its ACCEPT (and LIVE) when the peer's HELLO has the flag
 * too (docs/ring.md). */
#define GPUIPC__HELLO_F_RING 0x2u
/* This side takes REL entries flagged GPUIPC__REL_COMPLETE. */
#define GPUIPC__HELLO_F_RELC 0x4u
/* This side publishes its socket frames written whole in its ring page
 * (sock_frames), so that the peer need not read the socket for frames
 * that were not sent (docs/ring.md). */
#define GPUIPC__HELLO_F_SFC 0x8u
_Static_assert(sizeof(gpuipc__hello) == 56, "wire layout");

/* A ring's memfd (docs/ring.md), as its writer lays it out: this page,
 * then the ring's bytes. Each word on a cache line of its own; the peer
 * maps it read-only. A record in the ring: u32 len (the frame's bytes,
 * header included), u32 0, u64 barrier (socket frames written whole before
 * it), the frame, padding to 16 bytes; it may wrap around the ring's end. */
#define GPUIPC__RING_MAGIC 0x474e4952u /* "RING" */
#define GPUIPC__RING_VERSION 1
#define GPUIPC__RING_HDR 4096
/* Bytes of each direction's ring (the RING frame says it; both sides must
 * agree), and the largest frame a record carries (larger ones go on the
 * socket). */
#define GPUIPC__RING_SIZE ((size_t)128 << 10)
#define GPUIPC__RING_FRAME_MAX (GPUIPC__RING_SIZE / 4 - 32)
typedef struct gpuipc__w_ring_page {
  uint32_t magic, version;
  uint64_t size; /* bytes of the ring (a power of two) */
  unsigned char pad0[48];
  _Atomic uint64_t head; /* bytes of this side's ring published */
  unsigned char pad1[56];
  _Atomic uint64_t tail; /* bytes of the peer's ring consumed */
  unsigned char pad2[56];
  _Atomic uint64_t sleep; /* odd: the writer of this page may sleep */
  unsigned char pad3[56];
  /* GPUIPC__HELLO_F_SFC: socket frames the writer of this page wrote
   * whole, published after each one (a hint: see docs/ring.md). */
  _Atomic uint64_t sock_frames;
} gpuipc__w_ring_page;
_Static_assert(sizeof(gpuipc__w_ring_page) <= GPUIPC__RING_HDR, "ring page");

/* RING payload (+ the memfd): the ring's bytes (GPUIPC__RING_SIZE). */
typedef struct gpuipc__w_ring {
  uint64_t size;
  uint32_t version; /* 1 */
  uint32_t pad;     /* 0 */
} gpuipc__w_ring;
_Static_assert(sizeof(gpuipc__w_ring) == 16, "wire layout");

/* LIVE payload (+ the table's fd when key is not 0). */
typedef struct gpuipc__w_live {
  uint64_t key;
} gpuipc__w_live;

/* Wire formats of the fast-path frames (little-endian, packed by layout). */
typedef struct gpuipc__w_chunk { /* CHUNK: + desc bytes, + fds */
  uint64_t arena_id;
  uint64_t size;
  uint32_t chunk;
  uint32_t desc_len;
} gpuipc__w_chunk;

typedef struct gpuipc__w_ctl { /* CTL */
  uint64_t arena_id;
  uint64_t off;
  uint32_t chunk;
  uint32_t nslots;
} gpuipc__w_ctl;

#define GPUIPC__BUF_ORDERED 0x1u
#define GPUIPC__BUF_DESC 0x2u  /* BUFD: not an arena block */
#define GPUIPC__BUF_EVENT 0x4u /* ordered by the slot's interprocess event */
/* With ORDERED (BUF, BUFS): the sender's work before the send had
 * completed when it sent the frame (its stream was idle), so no ready word
 * is written for it and the receiver enqueues no wait. */
#define GPUIPC__BUF_DONE 0x8u

typedef struct gpuipc__w_evd { /* EVD: + event descriptor */
  uint32_t slot;
  uint32_t which; /* 0: the sender's ready event; 1: the receiver's release */
  uint32_t len;
  uint32_t pad;
} gpuipc__w_evd;
_Static_assert(sizeof(gpuipc__w_evd) == 16, "wire layout");
/* Sequence numbers on the wire lie in [1, GPUIPC__SEQ_LIMIT). The GPU
 * compares flag words cyclically (cuStreamWaitValue64 GEQ is a signed
 * difference), so two values more than 2^63 apart compare backwards: a
 * peer that sent such a pair could make the unblocking write at close
 * (the newest value) fail a wait for an older one, and keep our streams
 * blocked for ever. Within the limit the cyclic order is the plain order.
 * A sender that counts one per buffer reaches it after 2^62 buffers. */
#define GPUIPC__SEQ_LIMIT ((uint64_t)1 << 62)

typedef struct gpuipc__w_buf { /* BUF: + meta bytes */
  uint64_t seq;
  uint64_t arena_id;
  uint64_t off;
  uint64_t len;
  uint32_t slot;
  uint32_t chunk;
  uint32_t flags;
  uint32_t meta_len;
} gpuipc__w_buf;

/* BUFS: this header, then `count` gpuipc__w_buf entries (arena blocks, as
 * in BUF; GPUIPC__BUF_DESC is refused), then their metadata back to back
 * (entry i's meta_len bytes, in entry order). In memop mode the sender
 * writes one ready word for the whole batch: that of entry `ready` (its
 * slot, its sequence number, the highest of the batch), after the work of
 * every entry; each ORDERED entry is awaited on that word. The frame is
 * applied whole or refused whole. */
typedef struct gpuipc__w_bufs {
  uint32_t count; /* 1 .. GPUIPC_BATCH_MAX */
  uint32_t ready; /* index of the entry whose ready word signals the batch */
  uint32_t flags; /* 0 */
  uint32_t pad;   /* 0 */
} gpuipc__w_bufs;

/* BUFW (a broadcast, gpuipc_conn_broadcast): a gpuipc__w_buf (ORDERED,
 * arena block), then this, then the metadata. The buffer is ready once the
 * 64-bit word at [off, off + 8) of the sender's chunk `chunk` of arena
 * `arena_id` (exported before, like any chunk) holds `value` or more: a
 * word the sender writes once for all the consumers of one broadcast, its
 * values growing, each in [1, GPUIPC__SEQ_LIMIT). A receiver keeps at most
 * GPUIPC__BWORDS_MAX such words per connection. */
typedef struct gpuipc__w_word {
  uint64_t arena_id;
  uint64_t off;
  uint32_t chunk;
  uint32_t pad; /* 0 */
  uint64_t value;
} gpuipc__w_word;
#define GPUIPC__BWORDS_MAX 8

typedef struct gpuipc__w_rel { /* REL: n of these */
  uint64_t seq;
  uint32_t slot;
  uint32_t flags; /* GPUIPC__REL_* */
} gpuipc__w_rel;
/* REL flag: this lease's release word was not written; the release of the
 * next entry of the frame signals it too (its word was written on the same
 * stream after this release's work). Only between two ORDERED leases; the
 * last entry of a frame never has it. */
#define GPUIPC__REL_BY_NEXT 0x1u
/* REL flag: the releaser asserts that its use of this lease completed (it
 * queued no wait for it, and its own work on the memory is done): no
 * word was written, and the memory may be used again at once. Never with
 * BY_NEXT, nor on the entry a BY_NEXT entry names. Sent only to a peer
 * whose HELLO has GPUIPC__HELLO_F_RELC. */
#define GPUIPC__REL_COMPLETE 0x2u

_Static_assert(sizeof(gpuipc__w_chunk) == 24, "wire layout");
_Static_assert(sizeof(gpuipc__w_ctl) == 24, "wire layout");
_Static_assert(sizeof(gpuipc__w_buf) == 48, "wire layout");
_Static_assert(sizeof(gpuipc__w_rel) == 16, "wire layout");
_Static_assert(sizeof(gpuipc__w_bufs) == 16, "wire layout");
_Static_assert(sizeof(gpuipc__w_word) == 32, "wire layout");
/* Entries of one REL frame. */
#define GPUIPC__REL_MAX 64

#endif /* GPUIPC_CONN_WIRE_H */
