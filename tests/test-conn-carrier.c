/*
 * test-conn-carrier.c: the carriers under the frames. Which carrier a
 * connection gets (the ring by default where both sides offer it, the
 * socket when either side says so, a refusal when one side requires the
 * ring and the other does not offer it); the ring's order with the socket
 * (a record is acted on only after the socket frames its writer had sent
 * before it, and a record that names socket frames never sent ends the
 * connection); a hostile ring (a memfd without seals or of the wrong size,
 * a head that runs past the ring or back, a record whose length or frame
 * lies, a tail outside what was published, a peer that never frees room,
 * a ring rewritten while it is read); and wakes (a consumer asleep in a
 * call, or in its own poll() between calls, is woken by a buffer sent over
 * the ring).
 *
 * The hostile peer (helper "ring_hostile") speaks the handshake by hand
 * and needs no CUDA: it makes its own ring as it likes, maps ours, and
 * plays one attack, named by its first argument.
 */
#include "test-conn-handoff.h"

#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

static gpuipc_conn *conn_with(int fd, int carrier) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 10000;
  o.carrier = carrier;
  o.order = GPUIPC_ORDER_NONE;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  return c;
}

/* ---- which carrier ---------------------------------------------------------------- */

/* A peer over the helper's socket: says which carrier it got, then waits
 * for the test to end the connection. argv[0]: the carrier option. */
HELPER_IMPL(carrier_peer) {
  ASSERT(argc >= 1);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 10000;
  o.carrier = atoi(argv[0]);
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_conn_from_fd(dup(harness_helper_fd()), &o, &c);
  if (s != GPUIPC_OK)
    return 10 + (int)s; /* the test checks why */
  const char *name = gpuipc__conn_carrier_name(c);
  ASSERT_OK(gpuipc_conn_send_msg(c, name, strlen(name), NULL, 0));
  char buf[8];
  size_t len;
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  return 0;
}

static void expect_carrier(char *const env[], int here, int there,
                           const char *want) {
  char arg[8];
  snprintf(arg, sizeof arg, "%d", there);
  int fd;
  pid_t pid = spawn_helper("carrier_peer", env, &fd, arg, NULL);
  gpuipc_conn *c = conn_with(fd, here);
  ASSERT_STR_EQ(gpuipc__conn_carrier_name(c), want);
  char buf[16] = {0};
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf - 1, &len, NULL, NULL));
  ASSERT_STR_EQ(buf, want);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
}

TEST_IMPL(conn_carrier_ring_by_default) {
  expect_carrier(NULL, GPUIPC_CARRIER_AUTO, GPUIPC_CARRIER_AUTO, "ring");
  expect_carrier(NULL, GPUIPC_CARRIER_RING, GPUIPC_CARRIER_AUTO, "ring");
  return 0;
}

TEST_IMPL(conn_carrier_socket_when_either_side_says_so) {
  expect_carrier(NULL, GPUIPC_CARRIER_AUTO, GPUIPC_CARRIER_SOCKET, "socket");
  expect_carrier(NULL, GPUIPC_CARRIER_SOCKET, GPUIPC_CARRIER_AUTO, "socket");
  char *env[] = {"GPUIPC_CARRIER=socket", NULL};
  expect_carrier(env, GPUIPC_CARRIER_AUTO, GPUIPC_CARRIER_AUTO, "socket");
  return 0;
}

/* One side requires the ring, the other does not offer it: refused, with
 * the reason on the side that required it. */
TEST_IMPL(conn_carrier_ring_required_refused) {
  char arg[8];
  snprintf(arg, sizeof arg, "%d", GPUIPC_CARRIER_SOCKET);
  int fd;
  pid_t pid = spawn_helper("carrier_peer", NULL, &fd, arg, NULL);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 10000;
  o.carrier = GPUIPC_CARRIER_RING;
  gpuipc_conn *c = NULL;
  ASSERT_STATUS(gpuipc_conn_from_fd(fd, &o, &c), GPUIPC_E_NOT_SUPPORTED);
  ASSERT(strstr(gpuipc_last_error(), "ring carrier is required") != NULL);
  ASSERT_NULL(c);
  /* The helper is refused, or finds us gone while it answers our HELLO. */
  int st = wait_helper(pid, 30);
  ASSERT(st == 10 + (int)GPUIPC_E_PEER_REFUSED ||
         st == 10 + (int)GPUIPC_E_PEER_GONE);
  return 0;
}

TEST_IMPL(conn_carrier_bad_choice_refused) {
  int sv[2];
  ASSERT_OK(gpuipc_conn_pair(sv));
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.carrier = 7;
  gpuipc_conn *c = NULL;
  ASSERT_STATUS(gpuipc_conn_from_fd(sv[0], &o, &c), GPUIPC_E_INVALID_ARG);
  setenv("GPUIPC_CARRIER", "fast", 1);
  o.carrier = GPUIPC_CARRIER_AUTO;
  gpuipc_status s = gpuipc_conn_from_fd(sv[1], &o, &c);
  unsetenv("GPUIPC_CARRIER");
  ASSERT_STATUS(s, GPUIPC_E_INVALID_ARG);
  ASSERT(strstr(gpuipc_last_error(), "GPUIPC_CARRIER=fast") != NULL);
  return 0;
}

/* ---- a hostile ring --------------------------------------------------------------- */

typedef struct hostile {
  int sock;
  gpuipc__w_ring_page *mine; /* our ring, as we like it */
  unsigned char *mine_bytes;
  const gpuipc__w_ring_page *theirs; /* the test's, read-only */
  const unsigned char *their_bytes;
  uint64_t head, tail;
  size_t size;
  uint32_t hello_flags; /* beside NS and RING */
} hostile;

/* A frame written whole on the socket, with our credentials (the HELLO
 * needs them) and up to one fd. */
static void h_frame(int sock, int type, const void *p, size_t n, int fd) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, (uint16_t)(fd >= 0), (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  struct iovec iov[2] = {{&h, sizeof h}, {(void *)p, n}};
  size_t w = 0;
  ASSERT_OK(gpuipc__sock_send(sock, iov, n ? 2 : 1, fd >= 0 ? &fd : NULL,
                              fd >= 0, true, 0, &w));
  ASSERT_EQ(w, sizeof h + n);
}

/* A WAKE frame that may find the test gone already (it ends the
 * connection on what we did). */
static void h_wake(int sock) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         GPUIPC__F_WAKE, 0, 0, 0};
  h.check = gpuipc__frame_check(&h);
  (void)!send(sock, &h, sizeof h, MSG_NOSIGNAL);
}

/* Reads one frame whole (blocking), its fd (if any) into *fd. */
static int h_read(int sock, void *p, size_t cap, int *fd) {
  gpuipc__frame_hdr h;
  size_t got = 0;
  if (fd)
    *fd = -1;
  while (got < sizeof h) {
    size_t r = 0;
    int k = 0;
    ASSERT_OK(gpuipc__sock_recv(sock, (unsigned char *)&h + got,
                                sizeof h - got, 0, got == 0 ? fd : NULL,
                                got == 0 && fd ? 1 : 0, &k, NULL, NULL, &r));
    ASSERT(r > 0);
    got += r;
  }
  ASSERT_LE(h.len, cap);
  got = 0;
  while (got < h.len) {
    size_t r = 0;
    int k = 0;
    ASSERT_OK(gpuipc__sock_recv(sock, (unsigned char *)p + got, h.len - got,
                                0, NULL, 0, &k, NULL, NULL, &r));
    ASSERT(r > 0);
    got += r;
  }
  return h.type;
}

/* How the hostile ring is made. */
enum { RING_GOOD, RING_UNSEALED, RING_WRONG_SIZE };

/* The handshake by hand (HELLO with the ring, our verdict, LIVE without a
 * table, RING with our memfd made as `how` says; then the test's verdict,
 * LIVE and RING), mapping the test's ring read-only. */
static void h_handshake(hostile *x, int how) {
  x->size = GPUIPC__RING_SIZE;
  int sock = x->sock;
  int one = 1;
  ASSERT_EQ(setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &one, sizeof one), 0);
  gpuipc__hello me = {0};
  me.proto = GPUIPC__PROTO_VERSION;
  me.pid = getpid();
  me.uid = geteuid();
  me.gid = getegid();
  me.max_outstanding = 256;
  me.pidns = gpuipc__pid_namespace();
  me.flags = GPUIPC__HELLO_F_NS | GPUIPC__HELLO_F_RING | x->hello_flags;
  (void)gpuipc__boot_id(me.boot_id);
  h_frame(sock, GPUIPC__F_HELLO, &me, sizeof me, -1);
  unsigned char buf[512];
  ASSERT_EQ(h_read(sock, buf, sizeof buf, NULL), GPUIPC__F_HELLO);
  h_frame(sock, GPUIPC__F_ACCEPT, NULL, 0, -1);
  gpuipc__w_live lv = {0};
  h_frame(sock, GPUIPC__F_LIVE, &lv, sizeof lv, -1);
  /* Our ring. */
  int mfd = memfd_create("hostile-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT(mfd >= 0);
  size_t len = GPUIPC__RING_HDR + x->size + (how == RING_WRONG_SIZE ? 4096 : 0);
  ASSERT_EQ(ftruncate(mfd, (off_t)len), 0);
  if (how != RING_UNSEALED)
    ASSERT_EQ(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  x->mine = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
  ASSERT(x->mine != MAP_FAILED);
  x->mine->magic = GPUIPC__RING_MAGIC;
  x->mine->version = GPUIPC__RING_VERSION;
  x->mine->size = x->size;
  x->mine_bytes = (unsigned char *)x->mine + GPUIPC__RING_HDR;
  gpuipc__w_ring w = {GPUIPC__RING_SIZE, 1, 0};
  h_frame(sock, GPUIPC__F_RING, &w, sizeof w, mfd);
  close(mfd);
  if (how != RING_GOOD)
    return; /* the test refuses it */
  /* The test's verdict, its LIVE (with its liveness table's fd) and its
   * ring. */
  int fd = -1;
  ASSERT_EQ(h_read(sock, buf, sizeof buf, NULL), GPUIPC__F_ACCEPT);
  ASSERT_EQ(h_read(sock, buf, sizeof buf, &fd), GPUIPC__F_LIVE);
  if (fd >= 0)
    close(fd);
  ASSERT_EQ(h_read(sock, buf, sizeof buf, &fd), GPUIPC__F_RING);
  ASSERT(fd >= 0);
  x->theirs = mmap(NULL, GPUIPC__RING_HDR + x->size, PROT_READ, MAP_SHARED,
                   fd, 0);
  ASSERT(x->theirs != MAP_FAILED);
  x->their_bytes = (const unsigned char *)x->theirs + GPUIPC__RING_HDR;
  close(fd);
}

/* Publishes a record (may wrap) of frame bytes f[0..n) with `barrier`. */
static void h_put_raw(hostile *x, uint32_t len_field, const void *f, size_t n,
                      uint64_t barrier) {
  unsigned char rec[2048];
  uint32_t h32[2] = {len_field, 0};
  memcpy(rec, h32, 8);
  memcpy(rec + 8, &barrier, 8);
  ASSERT_LE(16 + n, sizeof rec);
  memcpy(rec + 16, f, n);
  size_t total = (16 + n + 15) & ~(size_t)15;
  for (size_t i = 0; i < total; i++)
    x->mine_bytes[(x->head + i) & (x->size - 1)] = rec[i];
  x->head += total;
  atomic_store(&x->mine->head, x->head);
}

/* A frame's bytes (header + payload) in out; returns their length. */
static size_t frame_bytes(unsigned char *out, int type, const void *p,
                          size_t n) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, 0, (uint32_t)n, 0};
  h.check = gpuipc__frame_check(&h);
  memcpy(out, &h, sizeof h);
  if (n)
    memcpy(out + sizeof h, p, n);
  return sizeof h + n;
}

static void h_put_frame(hostile *x, int type, const void *p, size_t n,
                        uint64_t barrier) {
  unsigned char f[1024];
  size_t len = frame_bytes(f, type, p, n);
  h_put_raw(x, (uint32_t)len, f, len, barrier);
}

/* The next record of the test's ring, when there is one (its frame bytes
 * into f); reads the socket meanwhile so the test's sends never block. */
static bool h_take(hostile *x, unsigned char *f, size_t cap, size_t *n) {
  uint64_t head = atomic_load(&x->theirs->head);
  if (head == x->tail)
    return false;
  uint32_t len;
  for (int i = 0; i < 4; i++)
    ((unsigned char *)&len)[i] = x->their_bytes[(x->tail + i) & (x->size - 1)];
  ASSERT_LE(len, cap);
  for (uint32_t i = 0; i < len; i++)
    f[i] = x->their_bytes[(x->tail + 16 + i) & (x->size - 1)];
  x->tail += (16 + len + 15) & ~(uint64_t)15;
  *n = len;
  return true;
}

/* Reads whatever the test wrote on the socket, counting frames of `type`
 * (0: none counted); returns the count. Never blocks. */
static int h_drain_socket(hostile *x, int type) {
  static unsigned char acc[1 << 20];
  static size_t have;
  int count = 0;
  for (;;) {
    size_t r = 0;
    int fds[16], k = 0;
    gpuipc_status s = gpuipc__sock_recv(x->sock, acc + have,
                                        sizeof acc - have, MSG_DONTWAIT, fds,
                                        16, &k, NULL, NULL, &r);
    for (int i = 0; i < k; i++)
      close(fds[i]);
    if (s != GPUIPC_OK || r == 0)
      break;
    have += r;
    size_t off = 0;
    while (have - off >= sizeof(gpuipc__frame_hdr)) {
      gpuipc__frame_hdr h;
      memcpy(&h, acc + off, sizeof h);
      if (have - off < sizeof h + h.len)
        break;
      if (type && h.type == type)
        count++;
      off += sizeof h + h.len;
    }
    memmove(acc, acc + off, have - off);
    have -= off;
  }
  return count;
}

/* The attacks, each after the handshake (argv[0] names it). */
HELPER_IMPL(ring_hostile) {
  ASSERT(argc >= 1);
  const char *mode = argv[0];
  hostile x = {0};
  x.sock = harness_helper_fd();
  int how = strcmp(mode, "unsealed") == 0     ? RING_UNSEALED
            : strcmp(mode, "wrong_size") == 0 ? RING_WRONG_SIZE
                                              : RING_GOOD;
  if (strncmp(mode, "sfc_", 4) == 0)
    x.hello_flags = GPUIPC__HELLO_F_SFC;
  h_handshake(&x, how);
  if (how != RING_GOOD) {
    /* The test refuses the ring: it closes the connection. Its frames
     * until then (LIVE with a descriptor among them) are read and dropped. */
    unsigned char b[512];
    size_t r = 1;
    while (r > 0) {
      int k = 0, fds[16];
      gpuipc_status st = gpuipc__sock_recv(x.sock, b, sizeof b, 0, fds, 16,
                                           &k, NULL, NULL, &r);
      for (int i = 0; i < k; i++)
        close(fds[i]);
      if (st != GPUIPC_OK)
        break;
    }
    return 0;
  }
  gpuipc__w_rel rel = {1, 0, 0};
  if (strcmp(mode, "many_fds") == 0) {
    /* One message with 20 descriptors: more than any frame carries. */
    int fds[20];
    for (int i = 0; i < 20; i++)
      fds[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    gpuipc__frame_hdr fh = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                            GPUIPC__F_MSG, 16, 0, 0};
    fh.check = gpuipc__frame_check(&fh);
    struct iovec iov = {&fh, sizeof fh};
    union {
      char b[CMSG_SPACE(sizeof fds)];
      struct cmsghdr a;
    } cb;
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cb.b;
    mh.msg_controllen = sizeof cb.b;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(cm), fds, sizeof fds);
    ASSERT_EQ(sendmsg(x.sock, &mh, MSG_NOSIGNAL), (ssize_t)sizeof fh);
    for (int i = 0; i < 20; i++)
      close(fds[i]);
  } else if (strcmp(mode, "sfc_lies") == 0) {
    /* Says it counts its socket frames in its ring page, and never does:
     * a message on the socket all the same, which the test's polling
     * calls must still read (at the look for a hang-up). Then the test's
     * answer, whose frame its own page must count: one more than before.
     * Then it leaves without a word, which the test's polling calls must
     * still see. */
    uint64_t before = atomic_load(&x.theirs->sock_frames);
    h_frame(x.sock, GPUIPC__F_MSG, "uncounted", 9, -1);
    unsigned char b[64];
    int type;
    while ((type = h_read(x.sock, b, sizeof b, NULL)) != GPUIPC__F_MSG)
      ;
    ASSERT_EQ(memcmp(b, "ack", 3), 0);
    /* Published once its write returned: maybe after we read it. */
    uint64_t after = atomic_load(&x.theirs->sock_frames);
    for (int i = 0; i < 2000 && after == before; i++) {
      usleep(1000);
      after = atomic_load(&x.theirs->sock_frames);
    }
    char msg[64];
    int m = snprintf(msg, sizeof msg, "%llu %llu", (unsigned long long)before,
                     (unsigned long long)after);
    h_frame(x.sock, GPUIPC__F_MSG, msg, (size_t)m, -1);
    atomic_store(&x.mine->sock_frames, 2); /* the two messages, late */
    /* The test's "bye", then gone. */
    while (h_read(x.sock, b, sizeof b, NULL) != GPUIPC__F_MSG)
      ;
    return 0;
  } else if (strcmp(mode, "head_past_ring") == 0) {
    atomic_store(&x.mine->head, (uint64_t)x.size + 64);
  } else if (strcmp(mode, "len_lies") == 0) {
    unsigned char f[64];
    size_t n = frame_bytes(f, GPUIPC__F_REL, &rel, sizeof rel);
    h_put_raw(&x, 1000, f, n, 0);
  } else if (strcmp(mode, "not_a_frame") == 0) {
    unsigned char f[32] = "this is not a frame at all....";
    h_put_raw(&x, 32, f, 32, 0);
  } else if (strcmp(mode, "msg_on_ring") == 0) {
    h_put_frame(&x, GPUIPC__F_MSG, "hi", 2, 0);
  } else if (strcmp(mode, "barrier_lies") == 0) {
    h_put_frame(&x, GPUIPC__F_REL, &rel, sizeof rel, 5);
  } else if (strcmp(mode, "barrier_after_msg") == 0) {
    /* A user message on the socket, then a record that follows it: the
     * message comes first, then the record (a release of nothing) ends
     * the connection. */
    h_frame(x.sock, GPUIPC__F_MSG, "first", 5, -1);
    h_put_frame(&x, GPUIPC__F_REL, &rel, sizeof rel, 1);
    h_wake(x.sock);
  } else if (strcmp(mode, "barrier_before_msg") == 0) {
    /* The record first (barrier 0), then the message: the record ends the
     * connection before the message is queued. */
    h_put_frame(&x, GPUIPC__F_REL, &rel, sizeof rel, 0);
    h_frame(x.sock, GPUIPC__F_MSG, "late", 4, -1);
  } else if (strcmp(mode, "rewrite") == 0) {
    /* A record rewritten without end while the test reads: its length,
     * its frame header and the head flip between lies and truths. */
    unsigned char f[64];
    size_t n = frame_bytes(f, GPUIPC__F_REL, &rel, sizeof rel);
    for (uint64_t i = 0; i < 20000000; i++) {
      h_put_raw(&x, (uint32_t)(i % 3 ? n : 4096), f, n, 0);
      x.mine_bytes[(x.head - 16) & (x.size - 1)] ^= (unsigned char)i;
      x.head -= (i & 1) ? 0 : 32;
      if (x.head > x.size)
        x.head = 0;
      if (poll(&(struct pollfd){x.sock, POLLIN, 0}, 1, 0) > 0 &&
          h_drain_socket(&x, 0) == 0 &&
          poll(&(struct pollfd){x.sock, POLLRDHUP, 0}, 1, 0) > 0)
        break;
    }
  } else if (strcmp(mode, "release_then_head_back") == 0 ||
             strcmp(mode, "tail_lies") == 0 ||
             strcmp(mode, "never_frees") == 0) {
    /* The test sends buffers; they come as records. */
    unsigned char f[1024];
    size_t n = 0;
    if (strcmp(mode, "never_frees") == 0) {
      /* Never takes a record, reads the socket: counts the buffers that
       * came there once the ring was full, then tells the test. */
      int on_socket = 0;
      for (int i = 0; i < 20000 && on_socket == 0; i++) {
        on_socket += h_drain_socket(&x, GPUIPC__F_BUF);
        usleep(1000);
      }
      uint64_t in_ring = atomic_load(&x.theirs->head);
      char msg[64];
      int m = snprintf(msg, sizeof msg, "%d %llu", on_socket,
                       (unsigned long long)in_ring);
      h_frame(x.sock, GPUIPC__F_MSG, msg, (size_t)m, -1);
    } else {
      for (int i = 0; i < 10000 && !h_take(&x, f, sizeof f, &n); i++) {
        h_drain_socket(&x, 0);
        usleep(1000);
      }
      ASSERT(n > 0);
      gpuipc__frame_hdr fh;
      memcpy(&fh, f, sizeof fh);
      ASSERT_EQ(fh.type, GPUIPC__F_BUF);
      gpuipc__w_buf wb;
      memcpy(&wb, f + sizeof fh, sizeof wb);
      atomic_store(&x.mine->tail, x.tail);
      if (strcmp(mode, "tail_lies") == 0) {
        atomic_store(&x.mine->tail, x.tail + 4096);
      } else {
        /* An honest release of it on our ring, then the head back. */
        gpuipc__w_rel r = {wb.seq, wb.slot, 0};
        h_put_frame(&x, GPUIPC__F_REL, &r, sizeof r, 0);
        h_wake(x.sock);
        /* The test's "ok" says it applied the release. */
        int msgs = 0;
        for (int i = 0; i < 10000 && msgs == 0; i++) {
          msgs = h_drain_socket(&x, GPUIPC__F_MSG);
          usleep(1000);
        }
        ASSERT_EQ(msgs, 1);
        atomic_store(&x.mine->head, 0);
      }
    }
  }
  /* Makes the test look (its fd readable), then waits for its end. */
  h_wake(x.sock);
  unsigned char b[4096];
  for (;;) {
    size_t r = 0;
    int k = 0;
    int fds[16];
    if (gpuipc__sock_recv(x.sock, b, sizeof b, 0, fds, 16, &k, NULL, NULL,
                          &r) != GPUIPC_OK ||
        r == 0)
      break;
    for (int i = 0; i < k; i++)
      close(fds[i]);
  }
  return 0;
}

/* Runs the hostile peer `mode` against a connection of ours and returns
 * it (the ring carrier, the handshake done). */
static gpuipc_conn *hostile_conn(const char *mode, pid_t *pid) {
  int fd;
  *pid = spawn_helper("ring_hostile", NULL, &fd, mode, NULL);
  gpuipc_conn *c = conn_with(fd, GPUIPC_CARRIER_RING);
  ASSERT_STR_EQ(gpuipc__conn_carrier_name(c), "ring");
  return c;
}

/* Progress until the connection ends; its status and reason. */
static gpuipc_status until_broken(gpuipc_conn *c, const char *why) {
  gpuipc_status s = GPUIPC_OK;
  for (int i = 0; i < 500 && s == GPUIPC_OK; i++)
    s = gpuipc_conn_progress(c, 10);
  if (why && strstr(gpuipc_last_error(), why) == NULL)
    harness_fail(__FILE__, __LINE__, "status %s, reason '%s': wanted '%s'",
                 gpuipc_status_name(s), gpuipc_last_error(), why);
  return s;
}

static int refused_with(const char *mode, const char *why) {
  int base = harness_count_fds();
  pid_t pid;
  gpuipc_conn *c = hostile_conn(mode, &pid);
  ASSERT_STATUS(until_broken(c, why), GPUIPC_E_PROTOCOL);
  ASSERT_STATUS(gpuipc_conn_progress(c, 0), GPUIPC_E_CLOSED);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  ASSERT_LE(harness_count_fds(), base);
  return 0;
}

/* A frame that comes with more descriptors than any frame carries ends
 * the connection, and none of them stays open here: peer after peer.
 * Before, the 16 the socket helper had room for leaked with each one. */
TEST_IMPL(conn_frame_with_too_many_fds_leaks_nothing) {
  int base = harness_count_fds();
  for (int i = 0; i < 5; i++)
    ASSERT_EQ(refused_with("many_fds", "file descriptor"), 0);
  ASSERT_EQ(harness_count_fds(), base);
  return 0;
}

TEST_IMPL(conn_ring_head_past_the_ring_refused) {
  return refused_with("head_past_ring", "head");
}

TEST_IMPL(conn_ring_record_length_lies_refused) {
  return refused_with("len_lies", "record of 1000 bytes");
}

TEST_IMPL(conn_ring_record_not_a_frame_refused) {
  return refused_with("not_a_frame", "not a fast-path frame");
}

/* A user message may carry descriptors: it has no place on the ring. */
TEST_IMPL(conn_ring_message_on_the_ring_refused) {
  return refused_with("msg_on_ring", "not a fast-path frame");
}

/* Nonblocking receives that poll, until one says something other than
 * GPUIPC_E_WOULD_BLOCK, or until *until (a test's condition) holds, or 5 s
 * passed; returns the last status. */
static gpuipc_status polled_recv(gpuipc_conn *c, bool (*until)(gpuipc_conn *)) {
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  ASSERT_OK(gpuipc_conn_set_polling(c, 1));
  uint64_t end = gpuipc__now_ns() + 5000000000ull;
  gpuipc_status s;
  do {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    s = gpuipc_conn_recv(c, NULL, &r);
    if (s == GPUIPC_OK)
      ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
  } while (s == GPUIPC_E_WOULD_BLOCK && !(until && until(c)) &&
           gpuipc__now_ns() < end);
  return s;
}

static bool msg_queued(gpuipc_conn *c) {
  size_t n = 0;
  gpuipc__conn_queued(c, &n, NULL, NULL, NULL);
  return n > 0;
}

/* A peer whose ring page counts its socket frames (HELLO_F_SFC) lets a
 * polling receiver leave the socket unread while the count says nothing
 * came; a peer that says so and does not count still has its frames read,
 * and its departure seen, by receives that only poll; our own page counts
 * our socket frames. */
TEST_IMPL(conn_ring_socket_count_that_lies) {
  pid_t pid;
  gpuipc_conn *c = hostile_conn("sfc_lies", &pid);
  /* Its message, on the socket and never counted, reaches the queue in a
   * receive's passes (the look for a hang-up reads it). */
  ASSERT_STATUS(polled_recv(c, msg_queued), GPUIPC_E_WOULD_BLOCK);
  if (!msg_queued(c))
    harness_fail(__FILE__, __LINE__,
                 "an uncounted socket frame was not read in 5 s of "
                 "polling receives");
  char buf[64] = {0};
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf - 1, &len, NULL, NULL));
  ASSERT_EQ(len, 9);
  ASSERT_EQ(memcmp(buf, "uncounted", 9), 0);
  /* Receives that find nothing leave the socket alone: at most every 16th
   * looks at the clock, and one a millisecond reads. */
  uint64_t reads0 = gpuipc__conn_socket_reads(c);
  uint64_t t0 = gpuipc__now_ns();
  enum { CALLS = 1000 };
  for (int i = 0; i < CALLS; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r), GPUIPC_E_WOULD_BLOCK);
  }
  uint64_t ms = (gpuipc__now_ns() - t0) / 1000000;
  uint64_t reads = gpuipc__conn_socket_reads(c) - reads0;
  if (reads > CALLS / 16 + ms + 2)
    harness_fail(__FILE__, __LINE__,
                 "%d empty receives in %llu ms read the socket %llu times: "
                 "want at most one a millisecond",
                 CALLS, (unsigned long long)ms, (unsigned long long)reads);
  /* Our count: one more after our message. */
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 0));
  ASSERT_OK(gpuipc_conn_send_msg(c, "ack", 3, NULL, 0));
  memset(buf, 0, sizeof buf);
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf - 1, &len, NULL, NULL));
  unsigned long long before = 0, after = 0;
  ASSERT_EQ(sscanf(buf, "%llu %llu", &before, &after), 2);
  if (after != before + 1)
    harness_fail(__FILE__, __LINE__,
                 "our ring page counted %llu socket frames before the "
                 "message and %llu after it: want one more",
                 before, after);
  /* Gone without a word: polling receives see it. */
  ASSERT_OK(gpuipc_conn_send_msg(c, "bye", 3, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_status s = polled_recv(c, NULL);
  if (s != GPUIPC_E_PEER_GONE && s != GPUIPC_E_CLOSED)
    harness_fail(__FILE__, __LINE__,
                 "a peer gone without a word: polling receives said %s (%s)",
                 gpuipc_status_name(s), gpuipc_last_error());
  gpuipc_conn_close(c);
  return 0;
}

/* A record that names socket frames that never came. */
TEST_IMPL(conn_ring_barrier_that_lies_refused) {
  return refused_with("barrier_lies", "follows 5 socket frames");
}

/* The record follows the message on the socket: the message first. */
TEST_IMPL(conn_ring_barrier_orders_after_the_socket) {
  pid_t pid;
  gpuipc_conn *c = hostile_conn("barrier_after_msg", &pid);
  char buf[16] = {0};
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_STR_EQ(buf, "first");
  /* Broken by the record, in that call (after the message was taken from
   * the socket) or the next. */
  gpuipc_status s = until_broken(c, "bad REL frame");
  ASSERT(s == GPUIPC_E_PROTOCOL || s == GPUIPC_E_CLOSED);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* The record comes before the message: it is acted on first, and the
 * message it broke the connection before is never handed out. */
TEST_IMPL(conn_ring_barrier_orders_before_the_socket) {
  pid_t pid;
  gpuipc_conn *c = hostile_conn("barrier_before_msg", &pid);
  char buf[16];
  size_t len;
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                GPUIPC_E_PROTOCOL);
  ASSERT(strstr(gpuipc_last_error(), "bad REL frame") != NULL);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* A ring whose memfd is not sealed, or not of the size it says, is
 * refused at the handshake, before anything is mapped. */
TEST_IMPL(conn_ring_unsealed_or_wrong_size_refused) {
  const char *modes[] = {"unsealed", "wrong_size"};
  const char *why[] = {"not sealed", "bytes, not"};
  for (int i = 0; i < 2; i++) {
    int base = harness_count_fds();
    int fd;
    pid_t pid = spawn_helper("ring_hostile", NULL, &fd, modes[i], NULL);
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.timeout_ms = 10000;
    gpuipc_conn *c = NULL;
    ASSERT_STATUS(gpuipc_conn_from_fd(fd, &o, &c), GPUIPC_E_PROTOCOL);
    ASSERT(strstr(gpuipc_last_error(), why[i]) != NULL);
    ASSERT_EQ(wait_helper(pid, 30), 0);
    ASSERT_LE(harness_count_fds(), base);
  }
  return 0;
}

/* A ring rewritten while it is read: whatever the peer does, the
 * connection either goes on or ends with a protocol error; nothing reads
 * outside the ring (the sanitizer builds check that). */
TEST_IMPL(conn_ring_rewritten_while_read) {
  pid_t pid;
  gpuipc_conn *c = hostile_conn("rewrite", &pid);
  gpuipc_status s = GPUIPC_OK;
  for (int i = 0; i < 2000 && s == GPUIPC_OK; i++)
    s = gpuipc_conn_progress(c, 0);
  ASSERT(s == GPUIPC_OK || s == GPUIPC_E_PROTOCOL);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  return 0;
}

/* ---- a hostile ring, the test sending ----------------------------------------------- */

static gpuipc_block *send_one(gpuipc_conn *c, gpuipc_arena *a) {
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
  ASSERT_OK(gpuipc_conn_send(c, b, NULL, NULL, 0));
  return b;
}

/* The peer takes the record of a buffer, releases it on its ring (an
 * honest record, applied), then runs its head back: refused. */
TEST_IMPL(conn_ring_head_runs_back_refused) {
  REQUIRE_DEVICES(1);
  pid_t pid;
  gpuipc_conn *c = hostile_conn("release_then_head_back", &pid);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b = send_one(c, a);
  size_t out = 1;
  for (int i = 0; i < 1000 && out > 0; i++) {
    ASSERT_OK(gpuipc_conn_progress(c, 10));
    ASSERT_OK(gpuipc_conn_get_outstanding(c, &out, NULL));
  }
  ASSERT_EQ(out, 0); /* the release on the ring was applied */
  ASSERT_OK(gpuipc_conn_send_msg(c, "ok", 2, NULL, 0));
  ASSERT_STATUS(until_broken(c, "head"), GPUIPC_E_PROTOCOL);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* The peer's tail claims more than we published: the next send ends the
 * connection. */
TEST_IMPL(conn_ring_tail_lies_refused) {
  REQUIRE_DEVICES(1);
  pid_t pid;
  gpuipc_conn *c = hostile_conn("tail_lies", &pid);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b = send_one(c, a);
  gpuipc_block *b2 = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b2));
  gpuipc_status s = GPUIPC_OK;
  for (int i = 0; i < 1000 && s == GPUIPC_OK; i++) {
    s = gpuipc_conn_send(c, b2, NULL, NULL, 0);
    if (s == GPUIPC_OK)
      s = gpuipc_conn_progress(c, 1);
  }
  ASSERT_STATUS(s, GPUIPC_E_PROTOCOL);
  ASSERT(strstr(gpuipc_last_error(), "tail") != NULL);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  ASSERT_OK(gpuipc_block_free(b2, NULL));
  gpuipc_conn_close(c);
  /* The peer held them: they come back once it is gone. */
  ASSERT_EQ(wait_helper(pid, 30), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* A peer that never frees room: once the ring is full the buffers go on
 * the socket, and no send waits for the ring. */
TEST_IMPL(conn_ring_full_falls_back_to_the_socket) {
  REQUIRE_DEVICES(1);
  enum { N = 3000 };
  int fd;
  pid_t pid = spawn_helper("ring_hostile", NULL, &fd, "never_frees", NULL);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 10000;
  o.order = GPUIPC_ORDER_NONE;
  o.max_outstanding = 4096;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  ASSERT_STR_EQ(gpuipc__conn_carrier_name(c), "ring");
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  gpuipc_block *b = NULL;
  ASSERT_OK(gpuipc_arena_alloc(a, 256, NULL, &b));
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_conn_send(c, b, NULL, NULL, 0));
  char buf[64] = {0};
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf - 1, &len, NULL, NULL));
  int on_socket = 0;
  unsigned long long in_ring = 0;
  ASSERT_EQ(sscanf(buf, "%d %llu", &on_socket, &in_ring), 2);
  ASSERT(on_socket > 0);
  ASSERT_GE(in_ring, (unsigned long long)GPUIPC__RING_SIZE - 512);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  /* The peer's leases come back once its process is gone, as the watcher
   * or a later call finds (not necessarily by the time it was reaped). */
  for (int i = 0; i < 10000 && gpuipc_block_get_holders(b) > 0; i++) {
    (void)gpuipc_conn_collect();
    usleep(1000);
  }
  ASSERT_EQ(gpuipc_block_get_holders(b), 0);
  ASSERT_OK(gpuipc_block_free(b, NULL));
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* ---- wakes -------------------------------------------------------------------------- */

/* A producer: ready (its CUDA started: on a loaded GPU machine that takes
 * seconds), then after the test's "go" sends argv[0] buffers, 50 ms apart,
 * then waits for the test's end. */
HELPER_IMPL(ring_producer) {
  ASSERT(argc >= 1);
  int n = atoi(argv[0]);
  gpuipc_conn *c = conn_with(dup(harness_helper_fd()), GPUIPC_CARRIER_RING);
  gpuipc_arena *a = mkarena((size_t)1 << 20);
  ASSERT_OK(gpuipc_conn_send_msg(c, "ready", 5, NULL, 0));
  char go[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, go, sizeof go, &len, NULL, NULL));
  for (int i = 0; i < n; i++) {
    usleep(50000);
    gpuipc_block *b = NULL;
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b));
    ASSERT_OK(gpuipc_conn_send(c, b, NULL, &i, sizeof i));
    ASSERT_OK(gpuipc_block_free(b, NULL));
  }
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, go, sizeof go, &len, NULL, NULL),
                GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  ASSERT_OK(gpuipc_arena_destroy(a));
  return 0;
}

/* Waits for the producer's "ready", then says "go". */
static void producer_ready(gpuipc_conn *c) {
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_set_timeout(c, 120000));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 5);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 30000));
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
}

/* A consumer asleep inside gpuipc_conn_recv, and one asleep in its own
 * poll() between calls, with and without spinning first: each buffer
 * wakes it. */
TEST_IMPL(conn_ring_sleeping_consumer_woken) {
  REQUIRE_DEVICES(1);
  for (int round = 0; round < 3; round++) {
    int fd;
    pid_t pid = spawn_helper("ring_producer", NULL, &fd, "3", NULL);
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.timeout_ms = 10000;
    o.order = GPUIPC_ORDER_NONE;
    o.carrier = GPUIPC_CARRIER_RING;
    o.spin_us = round == 1 ? 200 : 0;
    gpuipc_conn *c = NULL;
    ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
    ASSERT_STR_EQ(gpuipc__conn_carrier_name(c), "ring");
    producer_ready(c);
    for (int i = 0; i < 3; i++) {
      gpuipc_received r = GPUIPC_RECEIVED_INIT;
      if (round < 2) {
        ASSERT_OK(gpuipc_conn_recv(c, NULL, &r));
      } else {
        /* Its own poll() between calls, as an event loop's. */
        ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
        gpuipc_status s;
        while ((s = gpuipc_conn_recv(c, NULL, &r)) == GPUIPC_E_WOULD_BLOCK) {
          struct pollfd p = {gpuipc_conn_get_fd(c), POLLIN, 0};
          ASSERT_EQ(poll(&p, 1, 30000), 1);
        }
        ASSERT_OK(s);
      }
      int seq;
      memcpy(&seq, r.meta, sizeof seq);
      ASSERT_EQ(seq, i);
      ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
    }
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid, 30), 0);
  }
  return 0;
}

/* A consumer that said it polls gets every buffer by calls alone. */
TEST_IMPL(conn_ring_polling_consumer) {
  REQUIRE_DEVICES(1);
  int fd;
  pid_t pid = spawn_helper("ring_producer", NULL, &fd, "3", NULL);
  gpuipc_conn *c = conn_with(fd, GPUIPC_CARRIER_RING);
  producer_ready(c);
  ASSERT_OK(gpuipc_conn_set_polling(c, 1));
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  for (int i = 0; i < 3; i++) {
    gpuipc_received r = GPUIPC_RECEIVED_INIT;
    gpuipc_status s;
    while ((s = gpuipc_conn_recv(c, NULL, &r)) == GPUIPC_E_WOULD_BLOCK)
      usleep(100);
    ASSERT_OK(s);
    ASSERT_OK(gpuipc_conn_release(c, r.id, NULL));
  }
  ASSERT_STATUS(gpuipc_conn_set_polling(NULL, 1), GPUIPC_E_INVALID_ARG);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}
