/*
 * fuzz_handshake.c: libFuzzer target for the handshake: the input is what
 * the peer sends first (its HELLO, then whatever follows), fed to both ways
 * of making a connection: gpuipc_conn_from_fd (a socket pair) and
 * gpuipc_accept (a listener on an abstract name, which also checks the
 * kernel's SO_PEERCRED record). The peer's end is shut down after the
 * input, so every read ends; the handshake must fail cleanly or succeed,
 * and a connection it makes is then driven until it stops. No crash, hang,
 * leaked memory or descriptor.
 *
 * Each input runs twice: as it is, and with its first frame made to look
 * right where a checksum-like field would stop every mutation (header
 * check; the HELLO's protocol version set to ours, its pid, uid, gid,
 * start time and boot id to this process's, which the kernel's
 * credentials and /proc must confirm). The second pass also sends
 * descriptors, for a LIVE frame (see live_fds).
 */
#include "fuzz_conn.h"

#include <sys/mman.h>
#include <sys/un.h>

static gpuipc_listener *listener;
static char lname[64];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_conn_init();
  snprintf(lname, sizeof lname, "fuzz-handshake-%d", (int)getpid());
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1;
  o.nonblocking = 1;
  o.timeout_ms = 1000;
  gpuipc_status s = gpuipc_listen(lname, &o, &listener);
  if (s != GPUIPC_OK)
    fuzz_die("listen", s);
  return 0;
}

static void run_conn(gpuipc_conn *c) {
  fuzz_drive(c);
  gpuipc_conn_close(c);
}

/* The socket pair: the connection's side is sv[0]. */
static void via_pair(const uint8_t *p, size_t n) {
  int sv[2];
  if (gpuipc_conn_pair(sv) != GPUIPC_OK)
    abort();
  (void)fuzz_send(sv[1], p, n, 0);
  shutdown(sv[1], SHUT_WR);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.nonblocking = 1;
  o.timeout_ms = 1000;
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_conn_from_fd(sv[0], &o, &c);
  if (s == GPUIPC_OK)
    run_conn(c);
  else if (c != NULL)
    fuzz_die("conn_from_fd failed but set *out", s);
  close(sv[1]);
}

/* Descriptors sent with the "made right" pass, chosen by the input's last
 * byte: bit 0 a copy of /dev/null, bit 1 a memfd holding the bytes after
 * the input's last complete frame (a liveness table whose bytes the input
 * controls, for a LIVE frame; those bytes are not sent on the socket),
 * sealed against shrinking and growing when bit 2 is set too, and of a
 * table's size when bit 3 is (the input at its start, zeros after). */
static int live_fds(const uint8_t *p, size_t n, uint8_t ctl, int *fds) {
  int k = 0;
  if (ctl & 1)
    fds[k++] = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (ctl & 2) {
    int m = memfd_create("fuzz-live", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (m >= 0 && n && write(m, p, n) != (ssize_t)n) {
      close(m);
      m = -1;
    }
    if (m >= 0 && (ctl & 8) &&
        ftruncate(m, (off_t)gpuipc__live_table_bytes()) != 0) {
      close(m);
      m = -1;
    }
    if (m >= 0 && (ctl & 4))
      (void)fcntl(m, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
    fds[k++] = m;
  }
  int j = 0;
  for (int i = 0; i < k; i++)
    if (fds[i] >= 0)
      fds[j++] = fds[i];
  return j;
}

/* Where the input's first LIVE frame starts (first) and ends (end): the
 * frame goes with the descriptors (they arrive with the bytes they were
 * sent with), what follows it is the memfd's content. Without a LIVE
 * frame, all of the input goes on the socket, the descriptors with its
 * last frame. */
static void live_split(const uint8_t *p, size_t n, size_t *first,
                       size_t *end) {
  size_t f = 0, e = 0;
  bool live = false;
  for (size_t off = 0; n - off >= sizeof(gpuipc__frame_hdr);) {
    gpuipc__frame_hdr h;
    memcpy(&h, p + off, sizeof h);
    if (h.len > n - off - sizeof h)
      break;
    f = off;
    off += sizeof h + h.len;
    e = off;
    if (h.type == GPUIPC__F_LIVE) {
      live = true;
      break;
    }
  }
  *first = f;
  *end = live ? e : n;
}

/* The listener: connect to it, send, then accept. */
static void via_listener(const uint8_t *p, size_t n) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    abort();
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  int k = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "gpuipc/%s", lname);
  socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)k);
  if (connect(fd, (struct sockaddr *)&sa, sl) != 0)
    abort();
  size_t first, end;
  live_split(p, n, &first, &end);
  int fds[2];
  int nfds = live_fds(p + end, n - end, n ? p[n - 1] : 0, fds);
  (void)fuzz_send_fds(fd, p, first, NULL, 0);
  (void)fuzz_send_fds(fd, p + first, end - first, fds, nfds);
  for (int i = 0; i < nfds; i++)
    close(fds[i]);
  shutdown(fd, SHUT_WR);
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_accept(listener, &c);
  if (s == GPUIPC_OK)
    run_conn(c);
  else if (c != NULL)
    fuzz_die("accept failed but set *out", s);
  close(fd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 8192)
    return 0;
  uint8_t *copy = malloc(size ? size : 1);
  if (copy == NULL)
    return 0;
  if (size)
    memcpy(copy, data, size);
  via_pair(copy, size);
  fuzz_check_fds("fuzz-handshake (pair, as is)");

  /* Made to look right: the header check of every frame, and the
   * HELLO's identity fields where the first frame is long enough. */
  size_t first, end;
  live_split(copy, size, &first, &end);
  fuzz_fix_checks(copy, end); /* not the table's bytes after a LIVE frame */
  const size_t id_off = sizeof(gpuipc__frame_hdr) + 8; /* pid, uid, gid */
  if (size >= sizeof(gpuipc__frame_hdr) + 4) {
    uint32_t proto = GPUIPC__PROTO_VERSION;
    memcpy(copy + sizeof(gpuipc__frame_hdr), &proto, 4);
  }
  if (size >= id_off + 12) {
    int32_t pid = getpid();
    uint32_t uid = geteuid(), gid = getegid();
    memcpy(copy + id_off, &pid, 4);
    memcpy(copy + id_off + 4, &uid, 4);
    memcpy(copy + id_off + 8, &gid, 4);
  }
  /* ... and its start time and boot id, which /proc must confirm. */
  const size_t st_off = sizeof(gpuipc__frame_hdr) + offsetof(gpuipc__hello, start_time);
  if (size >= st_off + 8 + 16) {
    uint64_t st = gpuipc__process_start_time(getpid());
    uint8_t boot[16];
    memcpy(copy + st_off, &st, 8);
    if (gpuipc__boot_id(boot) == GPUIPC_OK)
      memcpy(copy + st_off + 8, boot, 16);
  }
  via_listener(copy, size);
  fuzz_check_fds("fuzz-handshake (listener, made right)");
  free(copy);
  return 0;
}
