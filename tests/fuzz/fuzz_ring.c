/*
 * fuzz_ring.c: libFuzzer target for the ring carrier (carrier_ring.c) and
 * the frame layer's use of its records (frames.c: the barrier,
 * drain_records, record_frame, put_record, the WAKE frame). The peer
 * speaks the handshake by hand, offering the ring (HELLO with
 * GPUIPC__HELLO_F_RING, ACCEPT, LIVE without a table when it says it has
 * pid namespaces, RING with a sealed memfd of its own), maps the
 * receiver's ring read-only, and then plays a program the input writes:
 * records in its ring (mostly well-formed frames of the four ring types
 * with forged fields, sometimes garbage, with length fields and barriers
 * that may lie), the head it publishes (running back, past the ring,
 * anywhere), the tail it publishes of the receiver's ring, its sleep
 * word, bytes rewritten after they were published, and socket frames
 * between them (MSG, WAKE, garbage). The receiver runs
 * gpuipc_conn_progress, gpuipc_conn_recv and gpuipc_conn_recv_msg and, in
 * a mode the input chooses, sends buffers (so its put path reads the
 * forged tail), which the peer may release honestly or with forged
 * releases. The program may also cycle sends and honest releases until
 * both rings wrap around their ends.
 *
 * Every call must return within its timeout (a slack of a second), the
 * connection must end cleanly or keep working, and after the close the
 * process must hold nothing of the input: no descriptor (fuzz_conn.h), no
 * memory (LeakSanitizer), no lease on the blocks it sent.
 *
 * Input: byte 0 chooses the mode,
 *   bits 0-1  the connection's order mode (3: MEMOP)
 *   bit 2     the connection polls (gpuipc_conn_options.polling)
 *   bit 3     the peer's HELLO speaks of pid namespaces (a LIVE frame)
 *   bit 4     the receiver sends buffers (SEND, CYCLE); else they do nothing
 *   bit 5     records' frame header checks as written (else made right)
 *   bit 6     waits spin 20 us on the ring first (gpuipc_conn_options.spin_us)
 *   bit 7     calls wait up to 1 ms (else nonblocking, zero timeouts)
 * then operations, each an opcode byte and its arguments (see the OP_*
 * list; bytes past the end read as zeros).
 */
#include "fuzz_conn.h"

#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>

#define RSIZE GPUIPC__RING_SIZE
#define RMASK (RSIZE - 1)

/* Our ring: one memfd for the process, sent with every input's RING frame
 * (the receiver maps it anew each time and unmaps it at its close), its
 * page and bytes reset before each input. */
static int ring_fd = -1;
static gpuipc__w_ring_page *ring_pg;
static unsigned char *ring_b;

/* The blocks a sending receiver sends (the same ones, again and again: a
 * block may be sent to one connection many times), from one arena. */
#define NBLOCKS 4
static gpuipc_arena *arena;
static gpuipc_block *blocks[NBLOCKS];

/* One input's state: the socket's peer end, our ring's private head (what
 * we wrote) and published head, the receiver's ring mapped here and how
 * far we read it, the buffers it sent (seq, slot), the socket frames we
 * wrote whole (for honest barriers). */
typedef struct peer {
  int sock;
  int mode;
  uint64_t head;
  const gpuipc__w_ring_page *theirs;
  const unsigned char *their_b;
  uint64_t taken;
  struct {
    uint64_t seq;
    uint32_t slot;
  } sent[256];
  int nsent;
  uint64_t frames;
  bool shut;
  const uint8_t *in;
  size_t len, at;
} peer;

static uint8_t in_u8(peer *p) { return p->at < p->len ? p->in[p->at++] : 0; }

static void in_bytes(peer *p, void *out, size_t n) {
  unsigned char *o = out;
  for (size_t i = 0; i < n; i++)
    o[i] = in_u8(p);
}

static uint64_t in_u64(peer *p) {
  uint64_t v;
  in_bytes(p, &v, sizeof v);
  return v;
}

/* ---- the peer's identity ------------------------------------------------------------ */

/* The blocks a peer holds when its connection ends stay leased until the
 * peer's process is gone (a closed socket is not enough: gpuipc/conn.h),
 * and the peer here is this process. So the HELLO, whose credentials name
 * the peer, is sent by a child (its pid the peer's), and when an input
 * leaves blocks held, the child is killed and a new one started: the
 * receiver must then reclaim everything (the check after each input). */
static pid_t ident_pid = -1;
static bool warming; /* LLVMFuzzerInitialize's inputs: no baseline yet */
static int ident_ctl = -1;

static void ident_main(int ctl) {
  for (;;) {
    uint8_t b[256];
    int fd = -1;
    union {
      char c[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } cb;
    struct iovec iov = {b, sizeof b};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.c;
    mh.msg_controllen = sizeof cb.c;
    ssize_t r = recvmsg(ctl, &mh, 0);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      _exit(0);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    if (cm && cm->cmsg_type == SCM_RIGHTS)
      memcpy(&fd, CMSG_DATA(cm), sizeof fd);
    char ok = fd >= 0 && fuzz_send_fds(fd, b, (size_t)r, NULL, 0) == 0;
    if (fd >= 0)
      close(fd);
    if (write(ctl, &ok, 1) != 1)
      _exit(0);
  }
}

static void ident_start(void) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    abort();
  pid_t pid = fork();
  if (pid < 0)
    abort();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(sv[0]);
    ident_main(sv[1]);
  }
  close(sv[1]);
  ident_pid = pid;
  ident_ctl = sv[0];
}

static void ident_stop(void) {
  if (ident_pid < 0)
    return;
  close(ident_ctl);
  kill(ident_pid, SIGKILL);
  while (waitpid(ident_pid, NULL, 0) < 0 && errno == EINTR)
    ;
  ident_pid = -1;
  ident_ctl = -1;
}

/* Sends b[0..n) on sock from the child, with its credentials. */
static void ident_send(int sock, const void *b, size_t n) {
  if (ident_pid < 0)
    ident_start();
  if (fuzz_send_fds(ident_ctl, b, n, &sock, 1) != 0)
    abort();
  char ok = 0;
  struct pollfd pf = {ident_ctl, POLLIN, 0};
  if (poll(&pf, 1, 10000) != 1 || read(ident_ctl, &ok, 1) != 1 || !ok)
    fuzz_die("the identity child did not send the HELLO", GPUIPC_OK);
}

/* ---- the handshake by hand --------------------------------------------------------- */

static size_t frame(uint8_t *out, int type, const void *pl, size_t n) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, 0, (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  memcpy(out, &h, sizeof h);
  if (n)
    memcpy(out + sizeof h, pl, n);
  return sizeof h + n;
}

static void send_frame(peer *p, int type, const void *pl, size_t n,
                       const int *fds, int nfds) {
  static uint8_t b[sizeof(gpuipc__frame_hdr) + 1024];
  size_t l = frame(b, type, pl, n);
  gpuipc__frame_hdr h;
  memcpy(&h, b, sizeof h);
  h.nfds = (uint16_t)nfds;
  h.check = gpuipc__frame_check(&h);
  memcpy(b, &h, sizeof h);
  if (fuzz_send_fds(p->sock, b, l, fds, nfds) == 0)
    p->frames++;
}

/* Reads what the receiver wrote on the socket, without waiting: whole
 * frames are dropped and the descriptors that came with them closed; the
 * RING frame's memfd is mapped first (the receiver's ring). */
static int fdq[64]; /* descriptors whose frame is not whole yet */
static int nfdq;

static void drain_socket(peer *p) {
  static uint8_t acc[1 << 18];
  static size_t have;
  if (p->sock < 0)
    return;
  if (p->theirs == NULL)
    have = 0; /* a new input (the last one's descriptors are closed) */
  for (;;) {
    union {
      char b[CMSG_SPACE(sizeof(int) * GPUIPC__FRAME_FDS_MAX)];
      struct cmsghdr align;
    } cb;
    struct iovec iov = {acc + have, sizeof acc - have};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.b;
    mh.msg_controllen = sizeof cb.b;
    ssize_t r = recvmsg(p->sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    have += (size_t)r;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; i++) {
          int fd;
          memcpy(&fd, CMSG_DATA(cm) + sizeof(int) * (size_t)i, sizeof fd);
          if (nfdq < 64)
            fdq[nfdq++] = fd;
          else
            close(fd);
        }
      }
    size_t off = 0;
    while (have - off >= sizeof(gpuipc__frame_hdr)) {
      gpuipc__frame_hdr h;
      memcpy(&h, acc + off, sizeof h);
      if (have - off < sizeof h + h.len)
        break;
      int k = h.nfds < nfdq ? h.nfds : nfdq;
      if (h.type == GPUIPC__F_RING && k > 0 && p->theirs == NULL) {
        void *m = mmap(NULL, GPUIPC__RING_HDR + RSIZE, PROT_READ, MAP_SHARED,
                       fdq[0], 0);
        if (m != MAP_FAILED) {
          p->theirs = m;
          p->their_b = (const unsigned char *)m + GPUIPC__RING_HDR;
        }
      }
      for (int i = 0; i < k; i++)
        close(fdq[i]);
      memmove(fdq, fdq + k, sizeof(int) * (size_t)(nfdq - k));
      nfdq -= k;
      off += sizeof h + h.len;
    }
    memmove(acc, acc + off, have - off);
    have -= off;
  }
}

/* After an input: the descriptors of a frame that never came whole. */
static void drop_fds(void) {
  while (nfdq > 0)
    close(fdq[--nfdq]);
}

/* HELLO (with the ring), ACCEPT, LIVE (when the mode says), RING. */
static void handshake(peer *p) {
  gpuipc__hello me = {0};
  me.proto = GPUIPC__PROTO_VERSION;
  if (ident_pid < 0)
    ident_start();
  me.pid = ident_pid;
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = 256;
  me.flags = GPUIPC__HELLO_F_RING;
  if (p->mode & 0x08) {
    me.flags |= GPUIPC__HELLO_F_NS;
    me.pidns = gpuipc__pid_namespace();
  }
  uint8_t b[sizeof(gpuipc__frame_hdr) + sizeof me];
  ident_send(p->sock, b, frame(b, GPUIPC__F_HELLO, &me, sizeof me));
  send_frame(p, GPUIPC__F_ACCEPT, NULL, 0, NULL, 0);
  if (p->mode & 0x08) {
    gpuipc__w_live lv = {0};
    send_frame(p, GPUIPC__F_LIVE, &lv, sizeof lv, NULL, 0);
  }
  gpuipc__w_ring w = {RSIZE, 1, 0};
  send_frame(p, GPUIPC__F_RING, &w, sizeof w, &ring_fd, 1);
  p->frames = 0; /* the barrier counts frames after the handshake */
}

/* ---- our ring ------------------------------------------------------------------------ */

static void publish(peer *p) {
  atomic_store_explicit(&ring_pg->head, p->head, memory_order_release);
}

/* Writes a record (len field, flags word, barrier, n frame bytes) at our
 * private head, wrapping at the ring's end, and advances it. */
static void put_raw(peer *p, uint32_t len_field, uint32_t flags,
                    uint64_t barrier, const void *f, size_t n) {
  uint32_t h32[2] = {len_field, flags};
  unsigned char hdr[16];
  memcpy(hdr, h32, 8);
  memcpy(hdr + 8, &barrier, 8);
  for (size_t i = 0; i < 16; i++)
    ring_b[(p->head + i) & RMASK] = hdr[i];
  for (size_t i = 0; i < n; i++)
    ring_b[(p->head + 16 + i) & RMASK] = ((const unsigned char *)f)[i];
  p->head += (16 + n + 15) & ~(uint64_t)15;
}

/* A well-formed record of frame `type` with payload pl[0..n). */
static void put_frame(peer *p, int type, const void *pl, size_t n,
                      uint64_t barrier) {
  static uint8_t f[sizeof(gpuipc__frame_hdr) + 8192];
  size_t l = frame(f, type, pl, n);
  if (p->mode & 0x20) {
    /* The check as the input wrote it: the first byte of the payload
     * area is mixed into it, so that it is sometimes right. */
    gpuipc__frame_hdr h;
    memcpy(&h, f, sizeof h);
    h.check ^= n ? ((const uint8_t *)pl)[0] & 1 : 1;
    memcpy(f, &h, sizeof h);
  }
  put_raw(p, (uint32_t)l, 0, barrier, f, l);
}

/* The receiver's ring: records taken (BUF and BUFS: what it sent). */
static void take(peer *p) {
  if (p->theirs == NULL)
    return;
  uint64_t head = atomic_load_explicit(&p->theirs->head, memory_order_acquire);
  while (head - p->taken >= 16 && head - p->taken <= RSIZE) {
    uint32_t len;
    for (int i = 0; i < 4; i++)
      ((unsigned char *)&len)[i] = p->their_b[(p->taken + i) & RMASK];
    uint64_t need = (16 + (uint64_t)len + 15) & ~(uint64_t)15;
    if (len < sizeof(gpuipc__frame_hdr) || need > head - p->taken)
      abort(); /* our own library wrote it */
    static unsigned char f[GPUIPC__RING_FRAME_MAX];
    for (uint32_t i = 0; i < len && i < sizeof f; i++)
      f[i] = p->their_b[(p->taken + 16 + i) & RMASK];
    p->taken += need;
    gpuipc__frame_hdr h;
    memcpy(&h, f, sizeof h);
    const unsigned char *pl = f + sizeof h;
    size_t count = 0;
    if (h.type == GPUIPC__F_BUF || h.type == GPUIPC__F_BUFW)
      count = 1;
    else if (h.type == GPUIPC__F_BUFS) {
      gpuipc__w_bufs bs;
      memcpy(&bs, pl, sizeof bs);
      count = bs.count;
      pl += sizeof bs;
    }
    for (size_t i = 0; i < count && p->nsent < 256; i++) {
      gpuipc__w_buf b;
      memcpy(&b, pl + i * sizeof b, sizeof b);
      p->sent[p->nsent].seq = b.seq;
      p->sent[p->nsent++].slot = b.slot;
    }
  }
}

/* ---- the receiver's calls ---------------------------------------------------------------- */

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* A call took longer than its timeout (ms) allows. */
static void bounded(const char *what, uint64_t t0, int timeout_ms) {
  uint64_t took = now_ms() - t0;
  if (took > (uint64_t)timeout_ms + 1000) {
    fprintf(stderr, "%s took %llu ms (timeout %d ms)\n", what,
            (unsigned long long)took, timeout_ms);
    abort();
  }
}

static void check_status(const char *what, gpuipc_status s) {
  if (s < 0 || s >= GPUIPC__STATUS_END)
    fuzz_die(what, s);
}

/* One round of the receiver's calls: progress, a message, a buffer
 * (released at once). */
static void drive_once(gpuipc_conn *c, int timeout_ms) {
  static uint8_t buf[GPUIPC_CONN_MSG_MAX];
  uint64_t t0 = now_ms();
  gpuipc_status s = gpuipc_conn_progress(c, timeout_ms);
  bounded("progress", t0, timeout_ms);
  check_status("progress: status out of range", s);
  size_t len = 0;
  int fds[GPUIPC_CONN_FDS_MAX];
  int nfds = GPUIPC_CONN_FDS_MAX;
  t0 = now_ms();
  s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, fds, &nfds);
  bounded("recv_msg", t0, timeout_ms);
  check_status("recv_msg: status out of range", s);
  if (s == GPUIPC_OK || s == GPUIPC_E_TRUNCATED) {
    if (nfds < 0 || nfds > GPUIPC_CONN_FDS_MAX || len > GPUIPC_CONN_MSG_MAX)
      fuzz_die("recv_msg: bad counts", s);
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
  }
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  t0 = now_ms();
  s = gpuipc_conn_recv(c, NULL, &r);
  bounded("recv", t0, timeout_ms);
  check_status("recv: status out of range", s);
  if (s == GPUIPC_OK) {
    gpuipc_status rs = gpuipc_conn_release(c, r.id, NULL);
    if (rs != GPUIPC_OK)
      fuzz_die("release of a received buffer", rs);
  }
}

/* The receiver sends n blocks (a batch when n > 1) with meta_len bytes of
 * metadata each. */
static void send_blocks(peer *p, gpuipc_conn *c, size_t n, size_t meta_len,
                        int timeout_ms) {
  static gpuipc_block *bl[GPUIPC__REL_MAX];
  static const void *metas[GPUIPC__REL_MAX];
  static size_t mlens[GPUIPC__REL_MAX];
  static uint8_t meta[GPUIPC_META_MAX];
  memset(meta, 0x5a, sizeof meta);
  for (size_t i = 0; i < n; i++) {
    bl[i] = blocks[i % NBLOCKS];
    metas[i] = meta;
    mlens[i] = meta_len;
  }
  uint64_t t0 = now_ms();
  gpuipc_status s =
      n == 1 ? gpuipc_conn_send(c, bl[0], NULL, meta, meta_len)
             : gpuipc_conn_send_batch(c, bl, n, NULL, metas, mlens);
  bounded("send", t0, timeout_ms);
  check_status("send: status out of range", s);
  drain_socket(p);
  take(p);
}

/* Honest releases of everything taken, in REL records of up to 64. */
static void release_all(peer *p, uint32_t flags_mask) {
  gpuipc__w_rel rel[GPUIPC__REL_MAX];
  int k = 0;
  for (int i = 0; i < p->nsent; i++) {
    rel[k].seq = p->sent[i].seq;
    rel[k].slot = p->sent[i].slot;
    rel[k].flags = 0;
    if (++k == GPUIPC__REL_MAX || i == p->nsent - 1) {
      if (k > 1)
        rel[k - 2].flags = flags_mask;
      put_frame(p, GPUIPC__F_REL, rel, sizeof rel[0] * (size_t)k, p->frames);
      k = 0;
    }
  }
  p->nsent = 0;
  publish(p);
}

/* ---- the program ---------------------------------------------------------------------------- */

enum {
  OP_REC,      /* a ring-type frame, forged fields */
  OP_RAW,      /* a record of garbage, its header as the input says */
  OP_HEAD,     /* publish a head: honest, back, ahead, past the ring, any */
  OP_TAIL,     /* publish a tail of the receiver's ring */
  OP_SLEEP,    /* our sleep word */
  OP_MSG,      /* a MSG frame on the socket, with descriptors */
  OP_WAKE,     /* a WAKE frame (or one with a payload) */
  OP_SOCKRAW,  /* bytes on the socket */
  OP_DRIVE,    /* the receiver's calls */
  OP_SEND,     /* the receiver sends a block or a batch */
  OP_REWRITE,  /* bytes of our ring rewritten after they were published */
  OP_SHUT,     /* the peer's end: shut down for writing */
  OP_RELALL,   /* honest releases of what the receiver sent */
  OP_CYCLE,    /* sends and honest releases until the rings wrap */
  OP_SENDMSG,  /* the receiver sends a user message */
  OP_COUNT
};

static uint64_t barrier_of(peer *p, uint8_t sel) {
  switch (sel & 3) {
  case 0:
    return p->frames;
  case 1:
    return p->frames + 1 + (sel >> 2 & 3);
  case 2:
    return in_u64(p);
  default:
    return p->frames > 0 ? p->frames - 1 : 0;
  }
}

static void op_rec(peer *p) {
  uint8_t sel = in_u8(p);
  uint64_t barrier = barrier_of(p, in_u8(p));
  static uint8_t pl[8192];
  size_t n = 0;
  int type;
  switch (sel & 3) {
  case 0: { /* BUF: the fields as given, meta_len what follows */
    type = GPUIPC__F_BUF;
    gpuipc__w_buf b;
    in_bytes(p, &b, sizeof b);
    size_t meta = in_u8(p) % (GPUIPC_META_MAX + 8);
    if (!(sel & 0x80))
      b.meta_len = (uint32_t)meta;
    memcpy(pl, &b, sizeof b);
    n = sizeof b;
    in_bytes(p, pl + n, meta);
    n += meta;
    break;
  }
  case 1: { /* BUFS: count entries, then their metadata */
    type = GPUIPC__F_BUFS;
    gpuipc__w_bufs bs = {0};
    uint8_t cnt = in_u8(p);
    bs.count = (sel & 0x80) ? (uint32_t)in_u64(p) : (uint32_t)(cnt % 8 + 1);
    bs.ready = in_u8(p) % (bs.count ? bs.count : 1);
    memcpy(pl, &bs, sizeof bs);
    n = sizeof bs;
    size_t ents = cnt % 8 + 1;
    for (size_t i = 0; i < ents; i++) {
      gpuipc__w_buf b;
      in_bytes(p, &b, sizeof b);
      b.meta_len %= 9;
      memcpy(pl + n, &b, sizeof b);
      n += sizeof b;
    }
    size_t meta = in_u8(p) % 64;
    in_bytes(p, pl + n, meta);
    n += meta;
    break;
  }
  case 2: { /* BUFW: a buffer, its word, its metadata */
    type = GPUIPC__F_BUFW;
    gpuipc__w_buf b;
    gpuipc__w_word w;
    in_bytes(p, &b, sizeof b);
    in_bytes(p, &w, sizeof w);
    size_t meta = in_u8(p) % 32;
    b.meta_len = (uint32_t)meta;
    memcpy(pl, &b, sizeof b);
    memcpy(pl + sizeof b, &w, sizeof w);
    n = sizeof b + sizeof w;
    in_bytes(p, pl + n, meta);
    n += meta;
    break;
  }
  default: { /* REL: entries forged, or those of buffers sent, mutated */
    type = GPUIPC__F_REL;
    size_t k = (sel >> 2 & 7) + 1;
    gpuipc__w_rel rel[8];
    for (size_t i = 0; i < k; i++) {
      uint8_t how = in_u8(p);
      if (p->nsent > 0 && !(how & 1)) {
        int j = (how >> 1) % p->nsent;
        rel[i].seq = p->sent[j].seq + (how & 0x40 ? 1 : 0);
        rel[i].slot = p->sent[j].slot + (how & 0x80 ? 1 : 0);
        rel[i].flags = (how >> 5) & 1;
      } else {
        in_bytes(p, &rel[i], sizeof rel[i]);
      }
    }
    memcpy(pl, rel, sizeof rel[0] * k);
    n = sizeof rel[0] * k;
    break;
  }
  }
  put_frame(p, type, pl, n, barrier);
  if (!(sel & 0x40))
    publish(p);
}

static void op_raw(peer *p) {
  uint8_t sel = in_u8(p);
  uint32_t len_field;
  if (sel & 1) {
    in_bytes(p, &len_field, sizeof len_field);
  } else {
    uint16_t l16;
    in_bytes(p, &l16, sizeof l16);
    len_field = l16;
  }
  uint32_t flags = 0;
  if (sel & 2)
    in_bytes(p, &flags, sizeof flags);
  uint64_t barrier = barrier_of(p, in_u8(p));
  uint8_t f[256];
  size_t n = in_u8(p);
  in_bytes(p, f, n);
  if ((sel & 4) && n >= sizeof(gpuipc__frame_hdr)) {
    /* A header of its own that checks, over garbage. */
    gpuipc__frame_hdr h;
    memcpy(&h, f, sizeof h);
    h.magic = GPUIPC__FRAME_MAGIC;
    h.version = GPUIPC__FRAME_VERSION;
    h.check = gpuipc__frame_check(&h);
    memcpy(f, &h, sizeof h);
  }
  put_raw(p, len_field, flags, barrier, f, n);
  if (!(sel & 0x40))
    publish(p);
}

static void op_head(peer *p) {
  uint8_t sel = in_u8(p);
  uint64_t k = (uint64_t)in_u8(p) * 16;
  uint64_t v;
  switch (sel % 8) {
  case 0:
    v = p->head;
    break;
  case 1:
    v = p->head - k;
    break;
  case 2:
    v = p->head + k;
    break;
  case 3:
    v = p->head + RSIZE + 16;
    break;
  case 4:
    v = in_u64(p);
    break;
  case 5: /* our private head back as well: records written again */
    p->head = p->head > k ? p->head - k : 0;
    v = p->head;
    break;
  case 6:
    v = p->head + 1 + (k >> 4); /* not on a record's boundary */
    break;
  default:
    v = p->head - RSIZE - 16;
    break;
  }
  atomic_store_explicit(&ring_pg->head, v, memory_order_release);
}

static void op_tail(peer *p) {
  uint8_t sel = in_u8(p);
  uint64_t k = (uint64_t)in_u8(p) * 16;
  take(p);
  uint64_t their = p->theirs ? atomic_load(&p->theirs->head) : 0;
  uint64_t v;
  switch (sel % 6) {
  case 0:
    v = p->taken;
    break;
  case 1:
    v = their + k + 16;
    break;
  case 2:
    v = in_u64(p);
    break;
  case 3:
    v = p->taken - k - 16;
    break;
  case 4:
    v = their - RSIZE - 16;
    break;
  default:
    v = p->taken - k; /* back, perhaps still inside */
    break;
  }
  atomic_store_explicit(&ring_pg->tail, v, memory_order_release);
}

static void op_msg(peer *p) {
  uint8_t sel = in_u8(p);
  uint8_t b[256];
  size_t n = in_u8(p);
  in_bytes(p, b, n);
  int fds[4], k = 0;
  while (k < (sel & 3) && (fds[k] = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0)
    k++;
  send_frame(p, GPUIPC__F_MSG, b, n, fds, k);
  for (int i = 0; i < k; i++)
    close(fds[i]);
}

static void op_wake(peer *p) {
  uint8_t sel = in_u8(p);
  uint8_t b[4] = {0};
  send_frame(p, GPUIPC__F_WAKE, b, sel & 1 ? 4 : 0, NULL, 0);
}

static void op_sockraw(peer *p) {
  uint8_t b[256];
  size_t n = in_u8(p);
  in_bytes(p, b, n);
  fuzz_fix_checks(b, n);
  (void)fuzz_send(p->sock, b, n, 0);
}

static void op_rewrite(peer *p) {
  uint64_t back = (uint64_t)in_u8(p) + 1;
  size_t n = in_u8(p) % 17;
  for (size_t i = 0; i < n; i++)
    ring_b[(p->head - back + i) & RMASK] = in_u8(p);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_conn_init();
  ring_fd = memfd_create("fuzz-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (ring_fd < 0 ||
      ftruncate(ring_fd, (off_t)(GPUIPC__RING_HDR + RSIZE)) != 0 ||
      fcntl(ring_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    abort();
  void *m = mmap(NULL, GPUIPC__RING_HDR + RSIZE, PROT_READ | PROT_WRITE,
                 MAP_SHARED, ring_fd, 0);
  if (m == MAP_FAILED)
    abort();
  ring_pg = m;
  ring_b = (unsigned char *)m + GPUIPC__RING_HDR;
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = 1 << 20;
  gpuipc_status s = gpuipc_arena_create(&ao, &arena);
  if (s != GPUIPC_OK)
    fuzz_die("arena_create (is the emulator the driver?)", s);
  for (int i = 0; i < NBLOCKS; i++) {
    s = gpuipc_arena_alloc(arena, 4096, NULL, &blocks[i]);
    if (s != GPUIPC_OK)
      fuzz_die("arena_alloc", s);
  }
  /* What the first sends make once per process (the chunk's export,
   * the liveness table, each order mode's objects), before the baseline
   * of descriptors is taken: each order mode sends a block and a batch,
   * which the peer releases. */
  warming = true;
  fuzz_fd_baseline = -1;
  for (uint8_t mode = 0x18; mode < 0x1c; mode++) {
    const uint8_t warm[] = {mode, OP_SEND, 0, OP_SEND, 1, OP_RELALL, 0, OP_DRIVE, 0};
    LLVMFuzzerTestOneInput(warm, sizeof warm);
  }
  warming = false;
  if (ident_pid < 0)
    ident_start();
  fuzz_fd_baseline = fuzz_open_fds(); /* with the control socket */
  return 0;
}

/* Whether the peer holds a block, or the library a descriptor more than
 * before the input (with the identity child's control socket counted). */
static bool held_by_peer(void) {
  for (int i = 0; i < NBLOCKS; i++)
    if (gpuipc_block_get_holders(blocks[i]) != 0)
      return true;
  return fuzz_fd_baseline >= 0 &&
         fuzz_open_fds() - (ident_pid < 0 ? 0 : 1) > fuzz_fd_baseline - 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 65536)
    return 0;
  peer p = {0};
  p.mode = data[0];
  p.in = data + 1;
  p.len = size - 1;
  memset(ring_pg, 0, sizeof *ring_pg);
  ring_pg->magic = GPUIPC__RING_MAGIC;
  ring_pg->version = GPUIPC__RING_VERSION;
  ring_pg->size = RSIZE;
  memset(ring_b, 0, RSIZE);

  int sv[2];
  if (gpuipc_conn_pair(sv) != GPUIPC_OK)
    abort();
  int big = 1 << 20;
  (void)setsockopt(sv[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  (void)setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  p.sock = sv[1];
  handshake(&p);

  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  int timeout_ms = (p.mode & 0x80) ? 1 : 0;
  o.nonblocking = timeout_ms == 0;
  o.timeout_ms = timeout_ms ? timeout_ms : 1000;
  int om = p.mode & 3;
  o.order = om == 3 ? GPUIPC_ORDER_MEMOP : (gpuipc_order_mode)om;
  o.carrier = GPUIPC_CARRIER_RING;
  o.polling = (p.mode & 0x04) != 0;
  o.spin_us = (p.mode & 0x40) ? 20 : 0;
  o.watch_peer = 0;
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_conn_from_fd(sv[0], &o, &c);
  if (s != GPUIPC_OK)
    fuzz_die("the handshake (valid) failed", s);
  if (strcmp(gpuipc__conn_carrier_name(c), "ring") != 0)
    fuzz_die("the connection is not on the ring", GPUIPC_OK);
  drain_socket(&p);
  if (p.theirs == NULL)
    fuzz_die("no RING frame from the receiver", GPUIPC_OK);
  if (gpuipc_conn_set_timeout(c, timeout_ms) != GPUIPC_OK)
    abort();

  bool sender = (p.mode & 0x10) != 0;
  for (int ops = 0; p.at < p.len && ops < 512; ops++) {
    switch (in_u8(&p) % OP_COUNT) {
    case OP_REC:
      op_rec(&p);
      break;
    case OP_RAW:
      op_raw(&p);
      break;
    case OP_HEAD:
      op_head(&p);
      break;
    case OP_TAIL:
      op_tail(&p);
      break;
    case OP_SLEEP: {
      uint8_t sel = in_u8(&p);
      uint64_t v = sel & 1 ? in_u64(&p) : sel;
      atomic_store(&ring_pg->sleep, v);
      break;
    }
    case OP_MSG:
      op_msg(&p);
      break;
    case OP_WAKE:
      op_wake(&p);
      break;
    case OP_SOCKRAW:
      op_sockraw(&p);
      break;
    case OP_DRIVE: {
      int rounds = in_u8(&p) % 4 + 1;
      for (int i = 0; i < rounds; i++)
        drive_once(c, timeout_ms);
      drain_socket(&p);
      break;
    }
    case OP_SEND: {
      uint8_t sel = in_u8(&p);
      if (sender)
        send_blocks(&p, c, (size_t)(sel & 7) + 1, (sel >> 3) * 8u,
                    timeout_ms);
      break;
    }
    case OP_REWRITE:
      op_rewrite(&p);
      break;
    case OP_SHUT:
      if (!p.shut)
        shutdown(p.sock, SHUT_WR);
      p.shut = true;
      break;
    case OP_RELALL:
      take(&p);
      release_all(&p, in_u8(&p) & 1 ? GPUIPC__REL_BY_NEXT : 0);
      break;
    case OP_CYCLE: {
      /* Batches of 64 sent and released, the tail published, until each
       * ring went round `laps` times (or the connection ended). */
      uint8_t sel = in_u8(&p);
      if (!sender)
        break;
      uint64_t want = ((uint64_t)(sel & 1) + 1) * RSIZE + (sel >> 1) * 16u;
      for (int i = 0; i < 400 && p.head < want; i++) {
        send_blocks(&p, c, GPUIPC__REL_MAX, 0, timeout_ms);
        if (p.nsent == 0)
          break; /* nothing went: the connection is over */
        atomic_store(&ring_pg->tail, p.taken);
        release_all(&p, 0);
        drive_once(c, timeout_ms);
      }
      break;
    }
    case OP_SENDMSG: {
      uint8_t n = in_u8(&p);
      uint8_t b[256] = {0};
      uint64_t t0 = now_ms();
      check_status("send_msg", gpuipc_conn_send_msg(c, b, n, NULL, 0));
      bounded("send_msg", t0, timeout_ms);
      break;
    }
    }
  }
  /* What is left (without waiting: fuzz_drive also checks that an ended
   * connection stays ended), then the close. */
  publish(&p);
  drain_socket(&p);
  (void)gpuipc_conn_set_nonblocking(c, 1);
  uint64_t t1 = now_ms();
  fuzz_drive(c);
  bounded("the last calls", t1, 0);
  drain_socket(&p);
  uint64_t t0 = now_ms();
  gpuipc_conn_close(c);
  bounded("close", t0, 100);
  close(p.sock);
  drop_fds();
  munmap((void *)p.theirs, GPUIPC__RING_HDR + RSIZE);
  /* What the peer still holds (blocks, or the lease table of a closed
   * connection, with its pidfd, waiting for release words the peer never
   * wrote): reclaimed once its process is gone. */
  if (held_by_peer()) {
    ident_stop();
    bool held = true;
    for (int t = 0; t < 2000 && held; t++) {
      gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
      (void)gpuipc_arena_get_stats(arena, &st); /* reaps the orphans */
      held = held_by_peer();
      if (held)
        usleep(1000);
    }
    if (held) {
      for (int i = 0; i < NBLOCKS; i++)
        fprintf(stderr, "block %d: %u holders\n", i,
                gpuipc_block_get_holders(blocks[i]));
      if (!warming)
        fuzz_check_fds("fuzz-ring (a dead peer's)");
      fuzz_die("what a dead peer held was not reclaimed", GPUIPC_OK);
    }
  }
  if (!warming)
    fuzz_check_fds("fuzz-ring");
  return 0;
}
