/*
 * carrier_ring.c: the ring carrier: the connection's socket, as the
 * socket carrier has it, plus one shared-memory ring per direction for the
 * fast-path frames that carry no descriptors (docs/ring.md). Each side
 * makes the memfd of the ring it writes at the handshake, seals its size
 * and sends it over the socket; the peer maps it read-only. A memfd holds,
 * on cache lines of their own in its first page, what its writer
 * publishes: the head of its ring (bytes published), the tail of the
 * peer's ring (bytes consumed from it), and its sleep word as a receiver;
 * the ring's bytes follow. So neither side can write what the other
 * publishes, and what one side writes the other only reads.
 *
 * The peer writes its memfd whenever it likes, also while we read it
 * (what a peer writes into shared memory is read once, docs/design.md's
 * hostile-peer rule). Every index of ours lives in private
 * memory and is the only thing a byte address is computed from (masked to
 * the ring); the peer's head and tail are only bounds, checked each time
 * they are read (a head that runs back or more than the ring ahead, a tail
 * outside the bytes we published, ends the connection); a record is
 * copied to private memory, its length checked against what was
 * published, before the frame layer decodes it with the same checks as a
 * frame from the socket. The memfd's seals and exact size are checked
 * before it is mapped, so the peer cannot shrink it under us.
 *
 * A record: u32 len (the frame's bytes, header included), u32 zero, u64
 * barrier (how many socket frames the writer had written whole before it:
 * the frame layer acts on the record only after as many socket frames),
 * the frame, padding to 16 bytes. A full ring refuses the record; the
 * frame layer sends it on the socket then, so a peer that never frees
 * room slows nothing but itself.
 *
 * Wakes. The socket stays the fd a caller polls. A receiver's sleep word
 * is odd whenever it may be asleep: between calls, and while the library
 * sleeps in poll() for it; even while the library spins on the ring inside
 * a call, and between calls for a connection whose application said it
 * polls (gpuipc_conn_set_polling). A sender that published looks at the
 * peer's word (after a fence, the Dekker pattern of bench/ring.c) and asks
 * the frame layer for a WAKE frame on the socket when the word is odd and
 * not one it woke already; a receiver that consumed records makes its
 * word a new odd value before it finds the ring empty, and looks once
 * more after that, so no record is left without a wake.
 */
#include "carrier.h"
#include "wire.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define REC_HDR 16
#define RING_HDR GPUIPC__RING_HDR

typedef gpuipc__w_ring_page ring_page;

typedef struct ring {
  ring_page *mine;        /* our memfd, read-write */
  const ring_page *peer;  /* the peer's, read-only */
  unsigned char *tx;      /* our ring's bytes */
  const unsigned char *rx; /* the peer's ring's bytes */
  size_t map_len;         /* each mapping: RING_HDR + size */
  uint64_t size, mask;
  /* Private copies: the only indices addresses come from. */
  uint64_t head;      /* published into our ring */
  uint64_t tail;      /* consumed from the peer's */
  uint64_t woken;     /* the peer's sleep value we sent a WAKE for */
  /* What gpuipc_conn_wait may touch from a second thread while the first
   * makes calls: our sleep word (mine->sleep, changed only by the
   * transitions below), and these. */
  atomic_bool consumed; /* records taken since our word last changed */
  atomic_bool slept;    /* our word made odd since the frame layer asked */
  atomic_int sleepers;  /* threads in gpuipc_conn_wait's sleep */
  atomic_bool polling;  /* the application polls: even between calls */
  atomic_bool dead;     /* hung up: no more reads or writes */
  int spin_us;
} ring;

static ring *ring_of(gpuipc__carrier *k) { return k->impl; }

/* ---- setup ----------------------------------------------------------------------- */

gpuipc_status gpuipc__ring_make(size_t size, int *fd_out, void **map_out) {
  *fd_out = -1;
  *map_out = NULL;
  if (size < 4096 || (size & (size - 1)))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "ring of %zu bytes", size);
  int fd = memfd_create("gpuipc-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return gpuipc__fail_errno(errno, "memfd_create", "ring");
  size_t len = RING_HDR + size;
  if (ftruncate(fd, (off_t)len) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = errno;
    close(fd);
    return gpuipc__fail_errno(err, "ftruncate/F_ADD_SEALS", "ring");
  }
  void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    int err = errno;
    close(fd);
    return gpuipc__fail_errno(err, "mmap", "ring of %zu bytes", len);
  }
  ring_page *p = m;
  p->magic = GPUIPC__RING_MAGIC;
  p->version = GPUIPC__RING_VERSION;
  p->size = size;
  atomic_store_explicit(&p->sleep, 1, memory_order_relaxed);
  *fd_out = fd;
  *map_out = m;
  return GPUIPC_OK;
}

void gpuipc__ring_unmake(void *map, size_t size) {
  if (map)
    munmap(map, RING_HDR + size);
}

gpuipc_status gpuipc__ring_open_peer(int fd, size_t size, const void **out) {
  *out = NULL;
  struct stat st;
  if (fstat(fd, &st) != 0)
    return gpuipc__fail_errno(errno, "fstat", "the peer's ring");
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "the peer's ring is not a sealable memfd (%s)",
                        strerror(errno));
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "the peer's ring is not sealed against shrinking "
                        "and growing (seals 0x%x)",
                        (unsigned)seals);
  if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != RING_HDR + size)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "the peer's ring is %lld bytes, not %zu",
                        (long long)st.st_size, (size_t)RING_HDR + size);
  void *m = mmap(NULL, RING_HDR + size, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED)
    return gpuipc__fail_errno(errno, "mmap", "the peer's ring");
  const ring_page *p = m;
  if (p->magic != GPUIPC__RING_MAGIC || p->version != GPUIPC__RING_VERSION ||
      p->size != size) {
    munmap(m, RING_HDR + size);
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "the peer's ring has a bad header (magic 0x%08x, "
                        "version %u, size %llu)",
                        p->magic, p->version, (unsigned long long)p->size);
  }
  *out = m;
  return GPUIPC_OK;
}

/* ---- records ----------------------------------------------------------------------- */

static void copy_in(ring *r, uint64_t at, const void *p, size_t n) {
  size_t o = (size_t)(at & r->mask);
  size_t first = n < r->size - o ? n : (size_t)(r->size - o);
  memcpy(r->tx + o, p, first);
  if (n > first)
    memcpy(r->tx, (const unsigned char *)p + first, n - first);
}

static void copy_out(const ring *r, uint64_t at, void *p, size_t n) {
  size_t o = (size_t)(at & r->mask);
  size_t first = n < r->size - o ? n : (size_t)(r->size - o);
  memcpy(p, r->rx + o, first);
  if (n > first)
    memcpy((unsigned char *)p + first, r->rx, n - first);
}

static uint64_t rec_bytes(uint64_t len) { return (REC_HDR + len + 15) & ~15ull; }

static gpuipc_status ring_put(gpuipc__carrier *k, const struct iovec *iov,
                              int niov, size_t len, uint64_t barrier) {
  ring *r = ring_of(k);
  if (atomic_load_explicit(&r->dead, memory_order_relaxed))
    return GPUIPC_E_PEER_GONE;
  uint64_t tail = atomic_load_explicit(&r->peer->tail, memory_order_acquire);
  if (tail > r->head || r->head - tail > r->size)
    return gpuipc__fail(GPUIPC_E_PROTOCOL,
                        "the peer's ring tail %llu lies outside the %llu "
                        "bytes published (ring of %llu)",
                        (unsigned long long)tail, (unsigned long long)r->head,
                        (unsigned long long)r->size);
  uint64_t need = rec_bytes(len);
  if (need > r->size / 4 || r->size - (r->head - tail) < need)
    return GPUIPC_E_WOULD_BLOCK;
  uint32_t h32[2] = {(uint32_t)len, 0};
  uint64_t at = r->head;
  copy_in(r, at, h32, sizeof h32);
  copy_in(r, at + 8, &barrier, sizeof barrier);
  at += REC_HDR;
  for (int i = 0; i < niov; i++) {
    copy_in(r, at, iov[i].iov_base, iov[i].iov_len);
    at += iov[i].iov_len;
  }
  r->head += need;
  atomic_store_explicit(&r->mine->head, r->head, memory_order_release);
  return GPUIPC_OK;
}

static bool ring_wake(gpuipc__carrier *k) {
  ring *r = ring_of(k);
  /* Our head store, then the peer's word: with the peer's word store,
   * then its look at our head, one of the two sees the other. */
  atomic_thread_fence(memory_order_seq_cst);
  uint64_t w = atomic_load_explicit(&r->peer->sleep, memory_order_relaxed);
  if (!(w & 1) || w == r->woken)
    return false;
  r->woken = w;
  return true;
}

/* Our sleep word. Two threads may change it (a call and gpuipc_conn_wait),
 * so each change is one atomic step from the value it finds; after it, a
 * fence, so that a sender's look at it after its publish and our next
 * look at its head cannot both miss. */
static uint64_t sleep_word(const ring *r) {
  return atomic_load_explicit(&r->mine->sleep, memory_order_relaxed);
}

/* Even (awake: no sender need wake us), if it was odd. */
static void stay_awake(ring *r) {
  uint64_t v = sleep_word(r);
  while ((v & 1) && !atomic_compare_exchange_weak_explicit(
                        &r->mine->sleep, &v, v + 1, memory_order_relaxed,
                        memory_order_relaxed))
    ;
  atomic_thread_fence(memory_order_seq_cst);
}

/* Even, as stay_awake, unless a thread sleeps on the word (another
 * waiter): the application polls, and its calls need no wake-up, but a
 * sleeper does. A sleeper counts itself before it sets a new odd value,
 * so either the count is seen here, or its value comes after the CAS
 * (which then fails and looks again, or is overwritten by it). */
static void stay_awake_unless_asleep(ring *r) {
  uint64_t v = atomic_load(&r->mine->sleep);
  while ((v & 1) && atomic_load(&r->sleepers) == 0 &&
         !atomic_compare_exchange_weak(&r->mine->sleep, &v, v + 1))
    ;
  atomic_thread_fence(memory_order_seq_cst);
}

/* A new odd value, one no sender woke yet. */
static void sleep_again(ring *r) {
  atomic_store_explicit(&r->consumed, false, memory_order_relaxed);
  atomic_store_explicit(&r->slept, true, memory_order_relaxed);
  uint64_t v = sleep_word(r);
  while (!atomic_compare_exchange_weak_explicit(&r->mine->sleep, &v,
                                                (v | 1) + 2,
                                                memory_order_relaxed,
                                                memory_order_relaxed))
    ;
  atomic_thread_fence(memory_order_seq_cst);
}

static gpuipc_status ring_get(gpuipc__carrier *k, unsigned char *buf,
                              size_t cap, size_t *len, uint64_t *barrier) {
  ring *r = ring_of(k);
  if (atomic_load_explicit(&r->dead, memory_order_relaxed))
    return GPUIPC_E_WOULD_BLOCK;
  for (int look = 0; look < 2; look++) {
    uint64_t head = atomic_load_explicit(&r->peer->head, memory_order_acquire);
    if (head < r->tail || head - r->tail > r->size)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "the peer's ring head %llu lies outside [%llu, "
                          "%llu]",
                          (unsigned long long)head,
                          (unsigned long long)r->tail,
                          (unsigned long long)(r->tail + r->size));
    if (head == r->tail) {
      /* Empty. Having taken records, make our word a new odd value (the
       * peer may have woken the old one) and look once more. */
      if (look == 0 && atomic_load_explicit(&r->consumed, memory_order_relaxed) &&
          !atomic_load_explicit(&r->polling, memory_order_relaxed)) {
        sleep_again(r);
        continue;
      }
      return GPUIPC_E_WOULD_BLOCK;
    }
    uint64_t avail = head - r->tail;
    uint32_t h32[2];
    uint64_t bar;
    if (avail < REC_HDR)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "the peer's ring publishes %llu bytes, less than a "
                          "record header",
                          (unsigned long long)avail);
    copy_out(r, r->tail, h32, sizeof h32);
    copy_out(r, r->tail + 8, &bar, sizeof bar);
    uint64_t need = rec_bytes(h32[0]);
    if (h32[0] == 0 || h32[0] > cap || h32[1] != 0 || need > avail)
      return gpuipc__fail(GPUIPC_E_PROTOCOL,
                          "the peer's ring has a record of %u bytes (flags "
                          "%u) where %llu are published and at most %zu "
                          "allowed",
                          h32[0], h32[1], (unsigned long long)avail, cap);
    copy_out(r, r->tail + REC_HDR, buf, h32[0]);
    r->tail += need;
    atomic_store_explicit(&r->mine->tail, r->tail, memory_order_release);
    atomic_store_explicit(&r->consumed, true, memory_order_relaxed);
    *len = h32[0];
    *barrier = bar;
    return GPUIPC_OK;
  }
  return GPUIPC_E_WOULD_BLOCK;
}

/* Reads only what gpuipc_conn_wait may read from a second thread: our
 * published tail, not the private copy. */
static bool ring_ready(const ring *r) {
  return !atomic_load_explicit(&r->dead, memory_order_relaxed) &&
         atomic_load_explicit(&r->peer->head, memory_order_acquire) !=
             atomic_load_explicit(&r->mine->tail, memory_order_relaxed);
}

/* Waits as the socket carrier does, but first looks at the ring: for
 * spin_us (-1: the connection's), awake (the peer need not wake us), then
 * asleep. Safe beside a call of another thread (see ring). */
static int ring_wait(gpuipc__carrier *k, short events, uint64_t deadline,
                     int spin_us) {
  ring *r = ring_of(k);
  int fd = gpuipc__carrier_fd_now(k);
  if (spin_us < 0)
    spin_us = r->spin_us;
  if ((events & POLLIN) && ring_ready(r))
    return POLLIN;
  if (fd < 0)
    return POLLHUP;
  if ((events & POLLIN) && spin_us > 0 &&
      !atomic_load_explicit(&r->dead, memory_order_relaxed)) {
    uint64_t until = gpuipc__now_ns() + (uint64_t)spin_us * 1000;
    if (deadline < until)
      until = deadline;
    stay_awake(r);
    for (unsigned n = 1;; n++) {
      if (ring_ready(r))
        break;
      if ((n & 255) == 0) {
        struct pollfd p = {fd, events, 0};
        if (poll(&p, 1, 0) > 0) {
          sleep_again(r);
          return p.revents;
        }
        if (gpuipc__now_ns() >= until)
          break;
      }
    }
  }
  /* Asleep from here: a value no sender woke yet, so that a record
   * published from now on brings a WAKE frame. */
  atomic_fetch_add(&r->sleepers, 1);
  sleep_again(r);
  if ((events & POLLIN) && ring_ready(r)) {
    atomic_fetch_sub(&r->sleepers, 1);
    return POLLIN;
  }
  int ev = gpuipc__wait_fd(fd, events, deadline);
  atomic_fetch_sub(&r->sleepers, 1);
  /* Awake again between calls when the application polls, unless another
   * thread still sleeps on the word. */
  if (atomic_load_explicit(&r->polling, memory_order_relaxed))
    stay_awake_unless_asleep(r);
  return ev;
}

static void ring_hangup(gpuipc__carrier *k) {
  ring *r = ring_of(k);
  atomic_store_explicit(&r->dead, true, memory_order_relaxed);
  gpuipc__carrier_close_fd(k);
}

static void ring_release(gpuipc__carrier *k) {
  ring *r = ring_of(k);
  ring_hangup(k);
  gpuipc__ring_unmake(r->mine, (size_t)r->size);
  if (r->peer)
    munmap((void *)r->peer, r->map_len);
  free(r);
  k->impl = NULL;
}

static void ring_set_polling(gpuipc__carrier *k, bool on) {
  ring *r = ring_of(k);
  atomic_store_explicit(&r->polling, on, memory_order_relaxed);
  if (on)
    stay_awake_unless_asleep(r);
  else if (!(sleep_word(r) & 1))
    sleep_again(r);
}

static bool ring_slept(gpuipc__carrier *k) {
  return atomic_exchange_explicit(&ring_of(k)->slept, false,
                                  memory_order_relaxed);
}

static void ring_sent(gpuipc__carrier *k, uint64_t n) {
  atomic_store_explicit(&ring_of(k)->mine->sock_frames, n,
                        memory_order_release);
}

static uint64_t ring_peer_sent(const gpuipc__carrier *k) {
  const ring *r = k->impl;
  return atomic_load_explicit(&r->peer->sock_frames, memory_order_acquire);
}

static const gpuipc__carrier_ops ring_ops = {
    .name = "ring",
    .write = gpuipc__sock_carrier_write,
    .read = gpuipc__sock_carrier_read,
    .wait = ring_wait,
    .fd = gpuipc__sock_carrier_fd,
    .hangup = ring_hangup,
    .release = ring_release,
    .put = ring_put,
    .wake = ring_wake,
    .get = ring_get,
    .set_polling = ring_set_polling,
    .slept = ring_slept,
    .sent = ring_sent,
    .peer_sent = ring_peer_sent,
};

gpuipc_status gpuipc__carrier_ring_init(gpuipc__carrier *k, void *mine,
                                        const void *peer, size_t size,
                                        bool polling, int spin_us) {
  ring *r = calloc(1, sizeof *r);
  if (r == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "ring carrier");
  r->mine = mine;
  r->peer = peer;
  r->tx = (unsigned char *)mine + RING_HDR;
  r->rx = (const unsigned char *)peer + RING_HDR;
  r->map_len = RING_HDR + size;
  r->size = size;
  r->mask = size - 1;
  r->spin_us = spin_us;
  k->ops = &ring_ops;
  k->impl = r;
  ring_set_polling(k, polling);
  return GPUIPC_OK;
}
