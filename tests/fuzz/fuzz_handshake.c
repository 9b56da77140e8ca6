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
 * check; the HELLO's pid, uid and gid set to this process's, which the
 * kernel's credentials must match).
 */
#include "fuzz_conn.h"

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
  (void)fuzz_send(fd, p, n, 0);
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
  fuzz_fix_checks(copy, size);
  const size_t id_off = sizeof(gpuipc__frame_hdr) + 8; /* pid, uid, gid */
  if (size >= id_off + 12) {
    int32_t pid = getpid();
    uint32_t uid = geteuid(), gid = getegid();
    memcpy(copy + id_off, &pid, 4);
    memcpy(copy + id_off + 4, &uid, 4);
    memcpy(copy + id_off + 8, &gid, 4);
  }
  via_listener(copy, size);
  fuzz_check_fds("fuzz-handshake (listener, made right)");
  free(copy);
  return 0;
}
