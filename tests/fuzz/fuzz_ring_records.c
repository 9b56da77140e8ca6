/*
 * fuzz_ring_records.c: libFuzzer target for the ring carrier's own code
 * (carrier_ring.c) in one process, fast enough for campaigns of tens of
 * millions of inputs (fuzz-ring drives whole connections, with a
 * handshake per input, and runs a few dozen inputs a second). A hostile
 * peer's page (head, tail, sleep word) and ring bytes are written by the
 * input, between the carrier's calls: get (the record decoder), put (which
 * reads the peer's tail of our ring), wake (the peer's sleep word), wait
 * (no sleep: a zero deadline), set_polling.
 *
 * What must hold, besides no out-of-bounds access (ASan) and no undefined
 * behaviour (UBSan): a record get returns is at most the buffer it was
 * given, was published whole (its bytes lie in [tail, head) as they stood)
 * and is what the peer wrote there; our published tail never passes the
 * peer's head; after get or put says GPUIPC_E_PROTOCOL the input stops (the
 * frame layer ends the connection there); put never writes past the room
 * the peer's tail leaves; no descriptor or memory outlives the input.
 *
 * Input: byte 0: bit 0 polling, bit 1 records' lengths as written (else
 * made to fit); then operations, an opcode byte each and its arguments
 * (bytes past the end read as zeros):
 *   0 REC   u16 len, u64 barrier, len bytes: a record at our head, head
 *           published after it
 *   1 HEAD  u64: publish this head
 *   2 TAIL  u64: publish this tail of the carrier's ring
 *   3 SLEEP u64: our sleep word
 *   4 GET   u16 cap: the carrier takes a record
 *   5 PUT   u16 len: the carrier publishes a record
 *   6 WAKE, 7 WAIT, 8 POLL (u8 on), 9 POKE u16 at, u8 byte: a published
 *           byte rewritten
 */
#include "tree.h"

#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define RR_SIZE 8192u /* small, so that inputs wrap around */
#define RR_HDR GPUIPC__RING_HDR
#define RR_RECMAX 4096u

typedef struct {
  const uint8_t *in;
  size_t len, at;
} rr_input;

static uint8_t rr_u8(rr_input *p) { return p->at < p->len ? p->in[p->at++] : 0; }
static uint16_t rr_u16(rr_input *p) { return (uint16_t)(rr_u8(p) | rr_u8(p) << 8); }
static uint64_t rr_u64(rr_input *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v |= (uint64_t)rr_u8(p) << (8 * i);
  return v;
}

static int rr_open_fds(void) {
  int n = 0;
  struct stat st;
  for (int fd = 0; fd < 256; fd++)
    if (fstat(fd, &st) == 0 && !S_ISFIFO(st.st_mode))
      n++;
  return n;
}

static int rr_baseline = -1;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  rr_input in = {data, size, 1};
  bool polling = data[0] & 1, lie = data[0] & 2;

  /* Both pages anonymous (the carrier unmaps both at release): the
   * memfd, its seals and the peer's checks belong to the handshake, which
   * fuzz-ring covers. One socket pair for the process; the carrier owns a
   * dup of its end. */
  static int sv[2] = {-1, -1};
  if (sv[0] < 0 &&
      socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
    abort();
  gpuipc__w_ring_page *mp = mmap(NULL, RR_HDR + RR_SIZE, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  gpuipc__w_ring_page *rr_peer = mmap(NULL, RR_HDR + RR_SIZE,
                                      PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mp == MAP_FAILED || rr_peer == MAP_FAILED)
    abort();
  for (int i = 0; i < 2; i++) {
    gpuipc__w_ring_page *pg = i ? rr_peer : mp;
    pg->magic = GPUIPC__RING_MAGIC;
    pg->version = GPUIPC__RING_VERSION;
    pg->size = RR_SIZE;
    atomic_store(&pg->sleep, 1);
  }
  unsigned char *pb = (unsigned char *)rr_peer + RR_HDR;
  gpuipc__carrier k = {0};
  k.fd = dup(sv[0]);
  if (k.fd < 0 ||
      gpuipc__carrier_ring_init(&k, mp, rr_peer, RR_SIZE, polling, 0) != GPUIPC_OK)
    abort();

  uint64_t head = 0; /* what we (the rr_peer) wrote */
  static unsigned char buf[RR_RECMAX + 64], out[RR_RECMAX];
  while (in.at < in.len) {
    uint8_t op = rr_u8(&in) % 10;
    gpuipc_status st = GPUIPC_OK;
    if (op == 0) {
      uint32_t len = rr_u16(&in) % (RR_RECMAX + 1);
      uint64_t bar = rr_u64(&in);
      uint32_t h[2] = {lie ? (uint32_t)rr_u16(&in) : len, lie ? rr_u8(&in) : 0u};
      unsigned char rr_rec[16 + RR_RECMAX];
      memcpy(rr_rec, h, 8);
      memcpy(rr_rec + 8, &bar, 8);
      for (uint32_t i = 0; i < len; i++)
        rr_rec[16 + i] = rr_u8(&in);
      uint64_t need = (16 + (uint64_t)len + 15) & ~15ull;
      for (uint64_t i = 0; i < 16 + len; i++)
        pb[(head + i) & (RR_SIZE - 1)] = rr_rec[i];
      head += need;
      atomic_store_explicit(&rr_peer->head, head, memory_order_release);
    } else if (op == 1) {
      head = rr_u64(&in);
      atomic_store_explicit(&rr_peer->head, head, memory_order_release);
    } else if (op == 2) {
      atomic_store_explicit(&rr_peer->tail, rr_u64(&in), memory_order_release);
    } else if (op == 3) {
      atomic_store(&rr_peer->sleep, rr_u64(&in));
    } else if (op == 4) {
      size_t cap = rr_u16(&in) % (RR_RECMAX + 64 + 1);
      uint64_t t0 = atomic_load(&mp->tail);
      uint64_t h0 = atomic_load(&rr_peer->head);
      size_t got = 0;
      uint64_t bar = 0;
      st = k.ops->get(&k, buf, cap, &got, &bar);
      if (st == GPUIPC_OK) {
        uint64_t t1 = atomic_load(&mp->tail);
        if (got == 0 || got > cap || t1 <= t0 || t1 > h0 || t1 - t0 < 16 + got)
          abort();
        for (size_t i = 0; i < got; i++)
          if (buf[i] != pb[(t0 + 16 + i) & (RR_SIZE - 1)])
            abort();
      } else if (st != GPUIPC_E_WOULD_BLOCK && st != GPUIPC_E_PROTOCOL) {
        abort();
      }
    } else if (op == 5) {
      size_t len = 1 + rr_u16(&in) % RR_RECMAX;
      memset(out, 0xab, len);
      struct iovec iov = {out, len};
      uint64_t h0 = atomic_load(&mp->head);
      uint64_t tail = atomic_load(&rr_peer->tail);
      st = k.ops->put(&k, &iov, 1, len, 7);
      if (st == GPUIPC_OK) {
        uint64_t h1 = atomic_load(&mp->head);
        if (tail > h0 || h1 <= h0 || h1 - tail > RR_SIZE)
          abort();
      } else if (st != GPUIPC_E_WOULD_BLOCK && st != GPUIPC_E_PROTOCOL &&
                 st != GPUIPC_E_PEER_GONE) {
        abort();
      }
    } else if (op == 6) {
      (void)k.ops->wake(&k);
    } else if (op == 7) {
      if (k.ops->wait(&k, POLLIN, 0, 0) < 0)
        abort();
    } else if (op == 8) {
      k.ops->set_polling(&k, rr_u8(&in) & 1);
    } else {
      uint16_t at = rr_u16(&in);
      pb[at % RR_SIZE] = rr_u8(&in);
    }
    if (st == GPUIPC_E_PROTOCOL)
      break;
  }
  k.ops->release(&k);
  /* What a peer wrote into the socket (WAKE frames) is drained, and the
   * descriptors are counted now and then (a scan costs more than an
   * input). */
  char junk[4096];
  while (read(sv[1], junk, sizeof junk) > 0)
    ;
  static unsigned runs;
  if (runs++ % 1024 == 0) {
    int n = rr_open_fds();
    if (rr_baseline < 0)
      rr_baseline = n;
    else if (n > rr_baseline)
      abort();
  }
  return 0;
}
