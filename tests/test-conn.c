/*
 * test-conn.c: the connection transport (no CUDA): pairs, names, the
 * runtime directory's checks, credentials, framing, descriptors, hostile
 * frames, timeouts, EINTR and partial I/O, many peers.
 */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tree.h"

static const char *rt_dir(void) {
  static char dir[300];
  snprintf(dir, sizeof dir, "%s/rt", harness_tmpdir());
  return dir;
}

static gpuipc_conn_options opts_ms(int timeout_ms) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  o.runtime_dir = rt_dir();
  return o;
}

/* Echo helper: returns every message (with its descriptors) until the peer
 * closes. argv[0]: "pair" (use the harness fd), or a name to connect to
 * (argv[1]: runtime dir, or "@" for an abstract name). */
static gpuipc_conn *helper_conn(int argc, char **argv) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 20000;
  gpuipc_conn *c = NULL;
  if (argc >= 1 && strcmp(argv[0], "pair") == 0) {
    ASSERT_OK(gpuipc_conn_from_fd(dup(harness_helper_fd()), &o, &c));
  } else {
    ASSERT(argc >= 2);
    if (strcmp(argv[1], "@") == 0)
      o.abstract_name = 1;
    else
      o.runtime_dir = argv[1];
    ASSERT_OK(gpuipc_connect(argv[0], &o, &c));
  }
  return c;
}

HELPER_IMPL(conn_echo) {
  gpuipc_conn *c = helper_conn(argc, argv);
  static unsigned char buf[GPUIPC_CONN_MSG_MAX];
  for (;;) {
    size_t len = 0;
    int fds[GPUIPC_CONN_FDS_MAX];
    int nfds = GPUIPC_CONN_FDS_MAX;
    gpuipc_status s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, fds, &nfds);
    if (s == GPUIPC_E_PEER_GONE)
      break;
    ASSERT_OK(s);
    ASSERT_OK(gpuipc_conn_send_msg(c, buf, len, fds, nfds));
    for (int i = 0; i < nfds; i++)
      close(fds[i]);
  }
  gpuipc_conn_close(c);
  return 0;
}

/* Sends a message with a pipe's read end; checks that the echo comes back
 * whole and that the descriptor still reaches the same pipe. */
static void roundtrip(gpuipc_conn *c, size_t len, int tag) {
  static unsigned char out[GPUIPC_CONN_MSG_MAX], in[GPUIPC_CONN_MSG_MAX];
  for (size_t i = 0; i < len; i++)
    out[i] = (unsigned char)(i * 7 + (size_t)tag);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, out, len, &p[0], 1));
  close(p[0]);
  size_t got = 0;
  int fd = -1, nfds = 1;
  ASSERT_OK(gpuipc_conn_recv_msg(c, in, sizeof in, &got, &fd, &nfds));
  ASSERT_EQ(got, len);
  ASSERT_MEM_EQ(in, out, len);
  ASSERT_EQ(nfds, 1);
  ASSERT_EQ(write(p[1], "x", 1), 1);
  char ch = 0;
  ASSERT_EQ(read(fd, &ch, 1), 1);
  ASSERT_EQ(ch, 'x');
  ASSERT(fcntl(fd, F_GETFD) & FD_CLOEXEC);
  close(fd);
  close(p[1]);
}

TEST_IMPL(conn_pair_messages) {
  int fd;
  pid_t pid = spawn_helper("conn_echo", NULL, &fd, "pair", NULL);
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.pid, pid);
  ASSERT_EQ(pi.uid, geteuid());
  roundtrip(c, 0, 1);
  roundtrip(c, 1, 2);
  roundtrip(c, 1000, 3);
  roundtrip(c, GPUIPC_CONN_MSG_MAX, 4);
  /* Many small messages queued back to back arrive in order. */
  for (int i = 0; i < 100; i++)
    ASSERT_OK(gpuipc_conn_send_msg(c, &i, sizeof i, NULL, 0));
  for (int i = 0; i < 100; i++) {
    int v = -1;
    size_t len = 0;
    ASSERT_OK(gpuipc_conn_recv_msg(c, &v, sizeof v, &len, NULL, NULL));
    ASSERT_EQ(len, sizeof v);
    ASSERT_EQ(v, i);
  }
  /* A message longer than the buffer: consumed, TRUNCATED, full length. */
  char big[100] = {0}, small[10];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_send_msg(c, big, sizeof big, NULL, 0));
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, small, sizeof small, &len, NULL, NULL),
                GPUIPC_E_TRUNCATED);
  ASSERT_EQ(len, sizeof big);
  /* Bad arguments. */
  ASSERT_STATUS(gpuipc_conn_send_msg(c, big, GPUIPC_CONN_MSG_MAX + 1, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  int badfd = 1000;
  ASSERT_STATUS(gpuipc_conn_send_msg(c, big, 1, &badfd, 1),
                GPUIPC_E_INVALID_ARG);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

TEST_IMPL(conn_listen_connect) {
  int base_fds = harness_count_fds();
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("echo-1", &o, &l));
  ASSERT_STR_CONTAINS(gpuipc_listener_get_path(l), "/rt/echo-1.sock");
  struct stat st;
  ASSERT_EQ(stat(rt_dir(), &st), 0);
  ASSERT_EQ(st.st_mode & 07777, 0700);
  /* A second listener on the same live name is refused. */
  gpuipc_listener *l2 = NULL;
  ASSERT_STATUS(gpuipc_listen("echo-1", &o, &l2), GPUIPC_E_EXISTS);
  pid_t pid = spawn_helper("conn_echo", NULL, NULL, "echo-1", (char *)rt_dir(),
                           NULL);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_accept(l, &c));
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.pid, pid);
  roundtrip(c, 123, 9);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  /* Bad names. */
  ASSERT_STATUS(gpuipc_listen("a/b", &o, &l2), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_listen("", &o, &l2), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_listen("..", &o, &l2), GPUIPC_E_INVALID_ARG);
  /* Nobody listening. */
  gpuipc_conn *c2 = NULL;
  ASSERT_STATUS(gpuipc_connect("nobody-here", &o, &c2), GPUIPC_E_NOT_FOUND);
  char path[300];
  snprintf(path, sizeof path, "%s", gpuipc_listener_get_path(l));
  gpuipc_listener_close(l);
  ASSERT_NE(access(path, F_OK), 0);
  /* The file is gone and the name can be listened on again; a stale socket
   * file left by a dead listener is replaced. */
  ASSERT_OK(gpuipc_listen("echo-1", &o, &l));
  pid_t child = fork();
  if (child == 0) {
    gpuipc_listener *ls = NULL;
    _exit(gpuipc_listen("stale", &o, &ls) == GPUIPC_OK ? 0 : 1);
  }
  ASSERT_EQ(wait_helper(child, 30), 0);
  gpuipc_listener *ls = NULL;
  ASSERT_OK(gpuipc_listen("stale", &o, &ls));
  gpuipc_listener_close(ls);
  gpuipc_listener_close(l);
  ASSERT_EQ(harness_count_fds(), base_fds);
  return 0;
}

TEST_IMPL(conn_abstract_name) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1;
  char name[64];
  snprintf(name, sizeof name, "abs-%d", (int)getpid());
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen(name, &o, &l));
  ASSERT_EQ(gpuipc_listener_get_path(l)[0], '@');
  pid_t pid = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_accept(l, &c));
  roundtrip(c, 77, 5);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_listener_close(l);
  return 0;
}

TEST_IMPL(conn_runtime_dir_checks) {
  char dir[400];
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  gpuipc_listener *l = NULL;
  /* Too open. */
  snprintf(dir, sizeof dir, "%s/open", harness_tmpdir());
  ASSERT_EQ(mkdir(dir, 0755), 0);
  ASSERT_EQ(chmod(dir, 0755), 0);
  o.runtime_dir = dir;
  ASSERT_STATUS(gpuipc_listen("x", &o, &l), GPUIPC_E_PERMISSION);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "0755");
  gpuipc_conn *c = NULL;
  ASSERT_STATUS(gpuipc_connect("x", &o, &c), GPUIPC_E_PERMISSION);
  /* A symbolic link, even to a good directory. */
  char good[400], link[400];
  snprintf(good, sizeof good, "%s/good", harness_tmpdir());
  snprintf(link, sizeof link, "%s/link", harness_tmpdir());
  ASSERT_EQ(mkdir(good, 0700), 0);
  ASSERT_EQ(symlink(good, link), 0);
  o.runtime_dir = link;
  ASSERT_STATUS(gpuipc_listen("x", &o, &l), GPUIPC_E_PERMISSION);
  /* A file. */
  char file[400];
  snprintf(file, sizeof file, "%s/file", harness_tmpdir());
  int fd = open(file, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  close(fd);
  o.runtime_dir = file;
  ASSERT_STATUS(gpuipc_listen("x", &o, &l), GPUIPC_E_PERMISSION);
  /* Owned by someone else (root can make one). */
  if (geteuid() == 0) {
    char other[400];
    snprintf(other, sizeof other, "%s/other", harness_tmpdir());
    ASSERT_EQ(mkdir(other, 0700), 0);
    ASSERT_EQ(chown(other, 65534, 65534), 0);
    o.runtime_dir = other;
    ASSERT_STATUS(gpuipc_listen("x", &o, &l), GPUIPC_E_PERMISSION);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "belongs to uid 65534");
  }
  /* Created fresh with 0700 even under a permissive umask. */
  mode_t old = umask(0);
  snprintf(dir, sizeof dir, "%s/fresh", harness_tmpdir());
  o.runtime_dir = dir;
  ASSERT_OK(gpuipc_listen("x", &o, &l));
  umask(old);
  struct stat st;
  ASSERT_EQ(lstat(dir, &st), 0);
  ASSERT_EQ(st.st_mode & 07777, 0700);
  gpuipc_listener_close(l);
  /* XDG_RUNTIME_DIR is used when no directory is given. */
  char xdg[400];
  snprintf(xdg, sizeof xdg, "%s/xdg", harness_tmpdir());
  ASSERT_EQ(mkdir(xdg, 0700), 0);
  setenv("XDG_RUNTIME_DIR", xdg, 1);
  o.runtime_dir = NULL;
  ASSERT_OK(gpuipc_listen("y", &o, &l));
  ASSERT_STR_CONTAINS(gpuipc_listener_get_path(l), "/xdg/gpuipc/y.sock");
  gpuipc_listener_close(l);
  /* Without XDG_RUNTIME_DIR: /tmp/gpuipc-UID, with the same checks. */
  unsetenv("XDG_RUNTIME_DIR");
  char name[64], want[128];
  snprintf(name, sizeof name, "fallback-%d", (int)getpid());
  snprintf(want, sizeof want, "/tmp/gpuipc-%u/%s.sock", (unsigned)geteuid(),
           name);
  gpuipc_status s = gpuipc_listen(name, &o, &l);
  if (s == GPUIPC_E_PERMISSION)
    SKIP("/tmp/gpuipc-%u exists and is not ours/0700: %s", (unsigned)geteuid(),
         gpuipc_last_error());
  ASSERT_OK(s);
  ASSERT_STR_EQ(gpuipc_listener_get_path(l), want);
  struct stat st2;
  char dir2[64];
  snprintf(dir2, sizeof dir2, "/tmp/gpuipc-%u", (unsigned)geteuid());
  ASSERT_EQ(lstat(dir2, &st2), 0);
  ASSERT_EQ(st2.st_mode & 07777, 0700);
  ASSERT_EQ(st2.st_uid, geteuid());
  gpuipc_listener_close(l);
  return 0;
}

/* ---- credentials ---------------------------------------------------------------- */

/* Runs as uid/gid 65534 (nobody) and tries to connect to an abstract name;
 * argv[0] name, argv[1] "refused" or "accepted". */
HELPER_IMPL(conn_other_uid) {
  ASSERT(argc >= 2);
  ASSERT_EQ(setgroups(0, NULL), 0);
  ASSERT_EQ(setresgid(65534, 65534, 65534), 0);
  ASSERT_EQ(setresuid(65534, 65534, 65534), 0);
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1;
  o.timeout_ms = 20000;
  uint32_t root = 0;
  o.allow_uids = &root; /* we accept the listener (root) */
  o.n_allow_uids = 1;
  gpuipc_conn *c = NULL;
  gpuipc_status s = gpuipc_connect(argv[0], &o, &c);
  if (strcmp(argv[1], "refused") == 0) {
    ASSERT_STATUS(s, GPUIPC_E_PEER_REFUSED);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "not allowed");
    return 0;
  }
  ASSERT_OK(s);
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.uid, 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "hi", 2, NULL, 0));
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(conn_refuses_other_uid) {
  if (geteuid() != 0)
    SKIP("needs root to run a helper under another uid (setresuid); the "
         "same check runs whenever the suite runs as root");
  char name[64];
  snprintf(name, sizeof name, "uid-%d", (int)getpid());
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1; /* a 0700 directory would stop the helper earlier */
  o.timeout_ms = 20000;
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen(name, &o, &l));
  pid_t pid = spawn_helper("conn_other_uid", NULL, NULL, name, "refused", NULL);
  gpuipc_conn *c = NULL;
  ASSERT_STATUS(gpuipc_accept(l, &c), GPUIPC_E_PEER_REFUSED);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "uid 65534");
  ASSERT_NULL(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_listener_close(l);

  /* With the uid on the allow-list the same peer is accepted. */
  uint32_t nobody = 65534;
  o.allow_uids = &nobody;
  o.n_allow_uids = 1;
  ASSERT_OK(gpuipc_listen(name, &o, &l));
  pid = spawn_helper("conn_other_uid", NULL, NULL, name, "accepted", NULL);
  ASSERT_OK(gpuipc_accept(l, &c));
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.uid, 65534);
  char buf[8];
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, 2);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_listener_close(l);

  /* A gid allow-list works as well. */
  o.allow_uids = NULL;
  o.n_allow_uids = 0;
  o.allow_gids = &nobody;
  o.n_allow_gids = 1;
  ASSERT_OK(gpuipc_listen(name, &o, &l));
  pid = spawn_helper("conn_other_uid", NULL, NULL, name, "accepted", NULL);
  ASSERT_OK(gpuipc_accept(l, &c));
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_listener_close(l);
  return 0;
}

/* ---- hostile peers ------------------------------------------------------------------ */

/* Completes the handshake, then writes raw bytes the test sends it on the
 * harness fd: each message is [u32 mode][bytes]; mode 1: write bytes on the
 * connection; mode 2: write bytes with one descriptor; mode 3: close. */
HELPER_IMPL(conn_raw) {
  int ctl = harness_helper_fd();
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1;
  o.timeout_ms = 20000;
  gpuipc_conn *c = NULL;
  ASSERT(argc >= 1);
  ASSERT_OK(gpuipc_connect(argv[0], &o, &c));
  int fd = gpuipc_conn_get_fd(c);
  static unsigned char buf[1 << 17];
  for (;;) {
    ssize_t n = harness_recv(ctl, buf, sizeof buf, NULL, NULL);
    if (n < 4)
      break;
    uint32_t mode;
    memcpy(&mode, buf, 4);
    if (mode == 3)
      break;
    struct iovec iov = {buf + 4, (size_t)n - 4};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    union {
      char b[CMSG_SPACE(sizeof(int))];
      struct cmsghdr a;
    } cb;
    if (mode == 2) {
      memset(&cb, 0, sizeof cb);
      mh.msg_control = cb.b;
      mh.msg_controllen = sizeof cb.b;
      struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int));
      int zero = 0;
      memcpy(CMSG_DATA(cm), &zero, sizeof zero);
    }
    ASSERT_EQ(sendmsg(fd, &mh, MSG_NOSIGNAL), (ssize_t)iov.iov_len);
    harness_send_u64(ctl, 1); /* written */
  }
  gpuipc_conn_close(c);
  return 0;
}

static void raw_send(int ctl, uint32_t mode, const void *p, size_t n) {
  unsigned char buf[4096];
  ASSERT_LE(n + 4, sizeof buf);
  memcpy(buf, &mode, 4);
  if (n)
    memcpy(buf + 4, p, n);
  harness_send(ctl, buf, n + 4, NULL, 0);
  if (mode != 3)
    ASSERT_EQ(harness_recv_u64(ctl), 1);
}

static gpuipc__frame_hdr good_hdr(int type, uint32_t len, uint16_t nfds) {
  gpuipc__frame_hdr h = {GPUIPC__FRAME_MAGIC, GPUIPC__FRAME_VERSION,
                         (uint8_t)type, nfds, len, 0};
  h.check = gpuipc__frame_check(&h);
  return h;
}

typedef struct bad_case {
  const char *what;
  unsigned char bytes[64];
  size_t n;
  uint32_t mode;
  gpuipc_status want; /* of the receive */
  const char *text;
} bad_case;

TEST_IMPL(conn_rejects_garbage) {
  char name[64];
  snprintf(name, sizeof name, "raw-%d", (int)getpid());
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1;
  o.timeout_ms = 10000;
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen(name, &o, &l));
  int base_fds = harness_count_fds();

  bad_case cases[8];
  memset(cases, 0, sizeof cases);
  int nc = 0;
  /* Plain garbage. */
  cases[nc] = (bad_case){"garbage", {0}, 32, 1, GPUIPC_E_PROTOCOL, "magic"};
  memcpy(cases[nc].bytes, "GET / HTTP/1.1\r\nHost: x\r\n\r\n....", 32);
  nc++;
  /* A forged length, far over the maximum, with a correct header check. */
  {
    gpuipc__frame_hdr h = good_hdr(GPUIPC__F_MSG, 0x7fffffffu, 0);
    cases[nc] = (bad_case){"forged length", {0}, sizeof h, 1, GPUIPC_E_PROTOCOL,
                           "exceeds the maximum"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }
  /* A header whose check does not match (a length changed in transit). */
  {
    gpuipc__frame_hdr h = good_hdr(GPUIPC__F_MSG, 4, 0);
    h.len = 40;
    cases[nc] = (bad_case){"bad check", {0}, sizeof h, 1, GPUIPC_E_PROTOCOL,
                           "check"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }
  /* Another version. */
  {
    gpuipc__frame_hdr h = good_hdr(GPUIPC__F_MSG, 0, 0);
    h.version = 99;
    h.check = gpuipc__frame_check(&h);
    cases[nc] = (bad_case){"version", {0}, sizeof h, 1, GPUIPC_E_PROTOCOL,
                           "version 99"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }
  /* An unknown type. */
  {
    gpuipc__frame_hdr h = good_hdr(200, 0, 0);
    cases[nc] = (bad_case){"type", {0}, sizeof h, 1, GPUIPC_E_PROTOCOL,
                           "type 200"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }
  /* A frame that declares descriptors it does not carry. */
  {
    gpuipc__frame_hdr h = good_hdr(GPUIPC__F_MSG, 0, 3);
    cases[nc] = (bad_case){"missing fds", {0}, sizeof h, 1, GPUIPC_E_PROTOCOL,
                           "3 file descriptors"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }
  /* Descriptors without a frame that declares them. */
  {
    gpuipc__frame_hdr h = good_hdr(GPUIPC__F_MSG, 0, 0);
    cases[nc] = (bad_case){"stray fds", {0}, sizeof h, 2, GPUIPC_E_PROTOCOL,
                           "without a frame"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }
  /* A truncated frame, then the peer leaves: not a protocol error of ours
   * to report beyond "gone", and nothing is delivered. */
  {
    gpuipc__frame_hdr h = good_hdr(GPUIPC__F_MSG, 100, 0);
    cases[nc] = (bad_case){"truncated", {0}, sizeof h + 10, 1,
                           GPUIPC_E_PEER_GONE, "gone"};
    memcpy(cases[nc].bytes, &h, sizeof h);
    nc++;
  }

  /* A well-behaved connection stays open next to the hostile ones. */
  pid_t good_pid = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
  gpuipc_conn *good = NULL;
  ASSERT_OK(gpuipc_accept(l, &good));

  for (int i = 0; i < nc; i++) {
    int ctl;
    pid_t pid = spawn_helper("conn_raw", NULL, &ctl, name, NULL);
    gpuipc_conn *c = NULL;
    ASSERT_OK(gpuipc_accept(l, &c));
    raw_send(ctl, cases[i].mode, cases[i].bytes, cases[i].n);
    if (cases[i].want == GPUIPC_E_PEER_GONE)
      raw_send(ctl, 3, NULL, 0);
    char buf[64];
    size_t len = 0;
    gpuipc_status s = GPUIPC_OK;
    /* A frame that came before the violation in the same read may still be
     * delivered; the violation then shows on the next call. */
    for (int k = 0; k < 3 && s == GPUIPC_OK; k++)
      s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
    if (s == GPUIPC_E_CLOSED)
      s = GPUIPC_E_PROTOCOL;
    if (s != cases[i].want)
      harness_fail(__FILE__, __LINE__, "case %s: got %s (%s), want %s",
                   cases[i].what, gpuipc_status_name(s), gpuipc_last_error(),
                   gpuipc_status_name(cases[i].want));
    ASSERT_STR_CONTAINS(gpuipc_last_error(), cases[i].text);
    if (s == GPUIPC_E_PROTOCOL) {
      ASSERT_EQ(gpuipc_conn_get_fd(c), -1);
      ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                    GPUIPC_E_CLOSED);
      ASSERT_STATUS(gpuipc_conn_send_msg(c, buf, 1, NULL, 0), GPUIPC_E_CLOSED);
      raw_send(ctl, 3, NULL, 0);
    }
    gpuipc_conn_close(c);
    close(ctl);
    ASSERT_EQ(wait_helper(pid, 30), 0);
    roundtrip(good, 10, i);
  }
  /* Garbage instead of a handshake: accept fails for that peer only. */
  {
    int raw = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "gpuipc/%s", name);
    ASSERT_EQ(connect(raw, (struct sockaddr *)&sa,
                      (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 +
                                  (size_t)n)),
              0);
    ASSERT_EQ(write(raw, "garbage garbage garbage!", 24), 24);
    gpuipc_conn *c = NULL;
    ASSERT_STATUS(gpuipc_accept(l, &c), GPUIPC_E_PROTOCOL);
    ASSERT_NULL(c);
    close(raw);
  }
  /* A peer that connects and leaves without a word is skipped: accept
   * returns the next real one. */
  {
    int raw = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "gpuipc/%s", name);
    ASSERT_EQ(connect(raw, (struct sockaddr *)&sa,
                      (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 +
                                  (size_t)n)),
              0);
    close(raw);
    pid_t pid2 = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
    gpuipc_conn *c = NULL;
    ASSERT_OK(gpuipc_accept(l, &c));
    gpuipc_peer_info pi;
    ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
    ASSERT_EQ(pi.pid, pid2);
    roundtrip(c, 5, 1);
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid2, 30), 0);
  }
  roundtrip(good, 10, 99);
  gpuipc_conn_close(good);
  ASSERT_EQ(wait_helper(good_pid, 30), 0);
  ASSERT_EQ(harness_count_fds(), base_fds);
  gpuipc_listener_close(l);
  return 0;
}

/* ---- timeouts ---------------------------------------------------------------------- */

/* Connects and then does nothing until told (one u64 on the harness fd). */
HELPER_IMPL(conn_silent) {
  gpuipc_conn *c = helper_conn(argc, argv);
  (void)harness_recv_u64(harness_helper_fd());
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(conn_timeouts) {
  gpuipc_conn_options o = opts_ms(150);
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("slow", &o, &l));
  /* accept with nobody coming. */
  gpuipc_conn *c = NULL;
  ASSERT_STATUS(gpuipc_accept(l, &c), GPUIPC_E_TIMEOUT);
  /* Non-blocking accept. */
  gpuipc_listener *lnb = NULL;
  gpuipc_conn_options onb = opts_ms(150);
  onb.nonblocking = 1;
  ASSERT_OK(gpuipc_listen("slow-nb", &onb, &lnb));
  ASSERT_STATUS(gpuipc_accept(lnb, &c), GPUIPC_E_WOULD_BLOCK);
  gpuipc_listener_close(lnb);

  /* A peer that never completes the handshake: connect times out. */
  {
    int raw = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char mpath[400];
    snprintf(mpath, sizeof mpath, "%s/mute.sock", rt_dir());
    ASSERT_LT(strlen(mpath), sizeof sa.sun_path);
    memcpy(sa.sun_path, mpath, strlen(mpath) + 1);
    ASSERT_EQ(bind(raw, (struct sockaddr *)&sa, sizeof sa), 0);
    ASSERT_EQ(listen(raw, 4), 0);
    ASSERT_STATUS(gpuipc_connect("mute", &o, &c), GPUIPC_E_TIMEOUT);
    close(raw);
    unlink(sa.sun_path);
  }

  int ctl;
  pid_t pid = spawn_helper("conn_silent", NULL, &ctl, "slow", (char *)rt_dir(),
                           NULL);
  /* The listener's timeout is short; the helper may take longer to start. */
  gpuipc_status as = GPUIPC_E_TIMEOUT;
  for (int i = 0; i < 200 && as == GPUIPC_E_TIMEOUT; i++)
    as = gpuipc_accept(l, &c);
  ASSERT_OK(as);
  char buf[16];
  size_t len;
  uint64_t t0 = (uint64_t)time(NULL);
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                GPUIPC_E_WOULD_BLOCK);
  ASSERT_OK(gpuipc_conn_progress(c, 0));
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 0));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 0));
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                GPUIPC_E_WOULD_BLOCK);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 100));
  /* A peer that does not read: frames with descriptors time out once the
   * socket is full; frames without are queued up to a bound, then time out
   * too. Nothing blocks for longer than the timeout. */
  int one = 4096;
  ASSERT_EQ(setsockopt(gpuipc_conn_get_fd(c), SOL_SOCKET, SO_SNDBUF, &one,
                       sizeof one),
            0);
  static char chunk[GPUIPC_CONN_MSG_MAX];
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  gpuipc_status s = GPUIPC_OK;
  int sent = 0;
  for (int i = 0; i < 100000 && s == GPUIPC_OK; i++, sent++)
    s = gpuipc_conn_send_msg(c, chunk, sizeof chunk, &p[0], 1);
  ASSERT_STATUS(s, GPUIPC_E_TIMEOUT);
  ASSERT_GT(sent, 0);
  s = GPUIPC_OK;
  for (int i = 0; i < 100000 && s == GPUIPC_OK; i++)
    s = gpuipc_conn_send_msg(c, chunk, sizeof chunk, NULL, 0);
  ASSERT_STATUS(s, GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 1));
  ASSERT_STATUS(gpuipc_conn_send_msg(c, chunk, sizeof chunk, NULL, 0),
                GPUIPC_E_WOULD_BLOCK);
  ASSERT_LT((uint64_t)time(NULL) - t0, 20);
  close(p[0]);
  close(p[1]);
  harness_send_u64(ctl, 1);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  /* The helper is gone: calls say so. */
  ASSERT_OK(gpuipc_conn_set_nonblocking(c, 0));
  ASSERT_OK(gpuipc_conn_set_timeout(c, 5000));
  s = GPUIPC_OK;
  for (int i = 0; i < 1000 && s == GPUIPC_OK; i++)
    s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT_STATUS(s, GPUIPC_E_PEER_GONE);
  ASSERT_STATUS(gpuipc_conn_progress(c, 0), GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  close(ctl);
  gpuipc_listener_close(l);
  return 0;
}

/* ---- EINTR and partial I/O -------------------------------------------------------------- */

static volatile sig_atomic_t alarms;
static void on_alarm(int sig) {
  (void)sig;
  alarms++;
}

/* Sends messages slowly (argv[1] ms apart), large ones split by a tiny
 * send buffer. */
HELPER_IMPL(conn_slow_sender) {
  gpuipc_conn *c = helper_conn(argc, argv);
  int one = 2048;
  setsockopt(gpuipc_conn_get_fd(c), SOL_SOCKET, SO_SNDBUF, &one, sizeof one);
  static unsigned char buf[GPUIPC_CONN_MSG_MAX];
  for (int i = 0; i < 20; i++) {
    for (size_t k = 0; k < sizeof buf; k++)
      buf[k] = (unsigned char)(k + (size_t)i);
    int p[2];
    ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
    ASSERT_OK(gpuipc_conn_send_msg(c, buf, sizeof buf, p, 2));
    close(p[0]);
    close(p[1]);
    if (i % 5 == 0)
      usleep(30000);
  }
  ASSERT_OK(gpuipc_conn_progress(c, 0));
  /* Drain what is queued before leaving. */
  char b;
  size_t len;
  gpuipc_conn_set_timeout(c, 20000);
  ASSERT_OK(gpuipc_conn_recv_msg(c, &b, 1, &len, NULL, NULL));
  gpuipc_conn_close(c);
  return 0;
}

TEST_IMPL(conn_eintr_partial_io) {
  struct sigaction sa = {0};
  sa.sa_handler = on_alarm;
  sa.sa_flags = 0; /* no SA_RESTART: poll and recvmsg see EINTR */
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGALRM, &sa, NULL), 0);
  struct itimerval it = {{0, 2000}, {0, 2000}};
  ASSERT_EQ(setitimer(ITIMER_REAL, &it, NULL), 0);

  int fd;
  pid_t pid = spawn_helper("conn_slow_sender", NULL, &fd, "pair", NULL);
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  int one = 2048;
  setsockopt(gpuipc_conn_get_fd(c), SOL_SOCKET, SO_RCVBUF, &one, sizeof one);
  static unsigned char buf[GPUIPC_CONN_MSG_MAX];
  for (int i = 0; i < 20; i++) {
    size_t len = 0;
    int fds[4], nfds = 4;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, fds, &nfds));
    ASSERT_EQ(len, sizeof buf);
    for (size_t k = 0; k < sizeof buf; k++)
      if (buf[k] != (unsigned char)(k + (size_t)i))
        harness_fail(__FILE__, __LINE__, "message %d byte %zu", i, k);
    ASSERT_EQ(nfds, 2);
    close(fds[0]);
    close(fds[1]);
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  struct itimerval off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &off, NULL);
  ASSERT_GT(alarms, 0);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_conn_close(c);
  return 0;
}

/* ---- poll integration -------------------------------------------------------------------- */

TEST_IMPL(conn_poll_fd) {
  int fd;
  pid_t pid = spawn_helper("conn_echo", NULL, &fd, "pair", NULL);
  gpuipc_conn_options o = opts_ms(20000);
  o.nonblocking = 1;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  ASSERT_OK(gpuipc_conn_send_msg(c, "ping", 4, NULL, 0));
  char buf[8];
  size_t len = 0;
  gpuipc_status s;
  int rounds = 0;
  while ((s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL)) ==
         GPUIPC_E_WOULD_BLOCK) {
    struct pollfd p = {gpuipc_conn_get_fd(c), POLLIN, 0};
    ASSERT_EQ(poll(&p, 1, 20000), 1);
    rounds++;
  }
  ASSERT_OK(s);
  ASSERT_EQ(len, 4);
  ASSERT_MEM_EQ(buf, "ping", 4);
  ASSERT_LE(rounds, 2);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* ---- many peers ------------------------------------------------------------------------------ */

TEST_IMPL(conn_64_peers) {
  enum { N = 64 };
  gpuipc_conn_options o = opts_ms(30000);
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen("many", &o, &l));
  int base_fds = harness_count_fds();
  pid_t pids[N];
  gpuipc_conn *cs[N];
  for (int i = 0; i < N; i++)
    pids[i] = spawn_helper("conn_echo", NULL, NULL, "many", (char *)rt_dir(),
                           NULL);
  for (int i = 0; i < N; i++)
    ASSERT_OK(gpuipc_accept(l, &cs[i]));
  /* Send to all, then collect all: every peer is served concurrently. */
  for (int r = 0; r < 3; r++) {
    for (int i = 0; i < N; i++) {
      int v = i * 1000 + r;
      ASSERT_OK(gpuipc_conn_send_msg(cs[i], &v, sizeof v, NULL, 0));
    }
    for (int i = 0; i < N; i++) {
      int v = -1;
      size_t len;
      ASSERT_OK(gpuipc_conn_recv_msg(cs[i], &v, sizeof v, &len, NULL, NULL));
      ASSERT_EQ(v, i * 1000 + r);
    }
  }
  /* Each peer is who the kernel says. */
  for (int i = 0; i < N; i++) {
    gpuipc_peer_info pi;
    ASSERT_OK(gpuipc_conn_get_peer(cs[i], &pi));
    bool found = false;
    for (int k = 0; k < N; k++)
      found |= pi.pid == pids[k];
    ASSERT(found);
  }
  for (int i = 0; i < N; i++)
    gpuipc_conn_close(cs[i]);
  for (int i = 0; i < N; i++)
    ASSERT_EQ(wait_helper(pids[i], 60), 0);
  ASSERT_EQ(harness_count_fds(), base_fds);
  gpuipc_listener_close(l);
  return 0;
}

/* ---- this process's limits ------------------------------------------------------------ */

/* A receiver that has no descriptor left when a message with descriptors
 * arrives: the kernel drops them (MSG_CTRUNC). That is this process's
 * limit, not a peer that sent too many, and the status says so. */
TEST_IMPL(conn_recv_out_of_fds_says_so) {
  int fd;
  pid_t pid = spawn_helper("conn_echo", NULL, &fd, "pair", NULL);
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  /* The echo comes back with two descriptors. */
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "fds", 3, p, 2));
  close(p[0]);
  close(p[1]);
  /* Wait until the echo is there, then fill the descriptor table. */
  struct pollfd pf = {gpuipc_conn_get_fd(c), POLLIN, 0};
  ASSERT_EQ(poll(&pf, 1, 20000), 1);
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  struct rlimit low = old;
  low.rlim_cur = 256;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  static int dups[256];
  int ndups = 0;
  for (;;) {
    int d = fcntl(0, F_DUPFD_CLOEXEC, 0);
    if (d < 0) {
      ASSERT_EQ(errno, EMFILE);
      break;
    }
    ASSERT_LT(ndups, 256);
    dups[ndups++] = d;
  }
  char buf[16];
  size_t len = 0;
  int got[4], ngot = 4;
  gpuipc_status s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, got, &ngot);
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", gpuipc_last_error());
  for (int i = 0; i < ndups; i++)
    close(dups[i]);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  if (s != GPUIPC_E_LIMIT)
    harness_fail(__FILE__, __LINE__, "receive without fds left: got %s (%s), "
                 "want GPUIPC_E_LIMIT",
                 gpuipc_status_name(s), msg);
  ASSERT_STR_CONTAINS(msg, "this process has no file descriptor left");
  ASSERT_STR_CONTAINS(msg, "RLIMIT_NOFILE is 256");
  /* The connection ended on our side; later calls say so and why. */
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL),
                GPUIPC_E_CLOSED);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "no file descriptor left");
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}

/* ---- bounded queues and backpressure ---------------------------------------------------- */

/* Floods the test with messages as fast as the connection takes them:
 * argv[1] "fds": 400 messages of 4 bytes with 16 descriptors each;
 * "bytes": 2,000 messages of 64 KiB. Each starts with its index. Then
 * waits for one message and leaves. */
HELPER_IMPL(conn_flood) {
  ASSERT(argc >= 2);
  gpuipc_conn *c = helper_conn(argc, argv);
  ASSERT_OK(gpuipc_conn_set_timeout(c, 60000));
  static unsigned char buf[GPUIPC_CONN_MSG_MAX];
  bool fds_mode = strcmp(argv[1], "fds") == 0;
  int fds[GPUIPC_CONN_FDS_MAX];
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  for (int i = 0; i < GPUIPC_CONN_FDS_MAX; i++)
    fds[i] = i % 2 ? p[1] : p[0];
  int n = fds_mode ? 400 : 2000;
  for (int i = 0; i < n; i++) {
    memcpy(buf, &i, sizeof i);
    if (fds_mode)
      ASSERT_OK(gpuipc_conn_send_msg(c, buf, sizeof i, fds,
                                     GPUIPC_CONN_FDS_MAX));
    else {
      memset(buf + sizeof i, (unsigned char)i, sizeof buf - sizeof i);
      ASSERT_OK(gpuipc_conn_send_msg(c, buf, sizeof buf, NULL, 0));
    }
  }
  close(p[0]);
  close(p[1]);
  size_t len;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  gpuipc_conn_close(c);
  return 0;
}

static void flood_case(const char *mode) {
  bool fds_mode = strcmp(mode, "fds") == 0;
  int n = fds_mode ? 400 : 2000;
  int fd;
  pid_t pid = spawn_helper("conn_flood", NULL, &fd, "pair", (char *)mode, NULL);
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_conn *c = NULL;
  int start_fds = harness_count_fds(); /* the socket, before it is ours */
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  int base_fds = harness_count_fds();
  /* The application only makes progress for a while: what the connection
   * holds must stay within its bounds, and reach them (the flood is held
   * back, not lost). */
  int max_fds = 0;
  size_t max_msgs = 0, max_bytes = 0, max_qfds = 0;
  bool paused = false;
  uint64_t t0 = (uint64_t)time(NULL);
  /* Until the connection has held back the flood for a while (the helper
   * may be slow to start). */
  for (int i = 0, held = 0; held < 50; i++) {
    ASSERT_LT(i, 5000);
    ASSERT_OK(gpuipc_conn_progress(c, 10));
    size_t m, b, f;
    gpuipc__conn_queued(c, &m, &b, &f, &paused);
    int open_fds = harness_count_fds() - base_fds;
    if (open_fds > max_fds)
      max_fds = open_fds;
    if (m > max_msgs)
      max_msgs = m;
    if (b > max_bytes)
      max_bytes = b;
    if (f > max_qfds)
      max_qfds = f;
    held = paused ? held + 1 : 0;
    if (paused)
      usleep(1000); /* the helper keeps trying meanwhile */
  }
  ASSERT_LT((uint64_t)time(NULL) - t0, 60); /* progress never waited long */
  ASSERT(paused);
  ASSERT_LE(max_msgs, GPUIPC_CONN_QUEUE_MSGS);
  ASSERT_LE(max_bytes, GPUIPC_CONN_QUEUE_BYTES);
  ASSERT_LE(max_qfds, GPUIPC_CONN_QUEUE_FDS);
  /* Open descriptors: the queue's, plus at most what one read brings for
   * frames not yet parsed (64). */
  ASSERT_LE(max_fds, GPUIPC_CONN_QUEUE_FDS + 64);
  if (fds_mode)
    ASSERT_GE(max_qfds, GPUIPC_CONN_QUEUE_FDS - GPUIPC_CONN_FDS_MAX);
  else
    ASSERT_GE(max_bytes, GPUIPC_CONN_QUEUE_BYTES - GPUIPC_CONN_MSG_MAX);
  /* A call that waits for something behind the held messages says why it
   * cannot get it instead of waiting out its timeout. */
  gpuipc_received r = GPUIPC_RECEIVED_INIT;
  uint64_t t1 = (uint64_t)time(NULL);
  ASSERT_STATUS(gpuipc_conn_recv(c, NULL, &r), GPUIPC_E_BUSY);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "wait to be taken");
  ASSERT_LT((uint64_t)time(NULL) - t1, 5);
  char one[4];
  size_t len = 0;
  /* The honest reader then gets every message, whole and in order. */
  static unsigned char buf[GPUIPC_CONN_MSG_MAX];
  for (int i = 0; i < n; i++) {
    int got[GPUIPC_CONN_FDS_MAX], ngot = GPUIPC_CONN_FDS_MAX;
    ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, got, &ngot));
    int idx = -1;
    memcpy(&idx, buf, sizeof idx);
    if (idx != i)
      harness_fail(__FILE__, __LINE__, "message %d came as %d", i, idx);
    if (fds_mode) {
      ASSERT_EQ(len, sizeof idx);
      ASSERT_EQ(ngot, GPUIPC_CONN_FDS_MAX);
    } else {
      ASSERT_EQ(len, sizeof buf);
      ASSERT_EQ(ngot, 0);
      ASSERT_EQ(buf[len - 1], (unsigned char)i);
    }
    for (int k = 0; k < ngot; k++)
      close(got[k]);
    int open_fds = harness_count_fds() - base_fds;
    if (open_fds > GPUIPC_CONN_QUEUE_FDS + 64)
      harness_fail(__FILE__, __LINE__, "%d descriptors open at message %d",
                   open_fds, i);
  }
  size_t m, b, f;
  gpuipc__conn_queued(c, &m, &b, &f, &paused);
  ASSERT_EQ(m, 0);
  ASSERT_EQ(b, 0);
  ASSERT_EQ(f, 0);
  ASSERT_OK(gpuipc_conn_send_msg(c, "k", 1, NULL, 0));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_STATUS(gpuipc_conn_recv_msg(c, one, sizeof one, &len, NULL, NULL),
                GPUIPC_E_PEER_GONE);
  gpuipc_conn_close(c);
  /* Everything the connection held is closed, the socket with it. */
  ASSERT_EQ(harness_count_fds(), start_fds - 1);
}

TEST_IMPL(conn_msg_flood_fds_bounded) {
  flood_case("fds");
  return 0;
}

TEST_IMPL(conn_msg_flood_bytes_bounded) {
  flood_case("bytes");
  return 0;
}

/* ---- concurrent handshakes ---------------------------------------------------------------- */

/* A client that connects to the abstract name and says nothing. */
static int silent_client(const char *name) {
  int raw = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(raw, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int n = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "gpuipc/%s", name);
  ASSERT_EQ(connect(raw, (struct sockaddr *)&sa,
                    (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 +
                                (size_t)n)),
            0);
  return raw;
}

/* True when the listener dropped this silent client: what it sent (its
 * HELLO) is followed by the end of the stream. */
static bool silent_client_dropped(int raw) {
  char buf[4096];
  for (;;) {
    ssize_t r = recv(raw, buf, sizeof buf, MSG_DONTWAIT);
    if (r == 0)
      return true;
    if (r < 0)
      return false;
  }
}

typedef struct accept_job {
  gpuipc_listener *l;
  gpuipc_conn *c;
  gpuipc_status s;
  char err[512];
} accept_job;

static void *accept_thread(void *arg) {
  accept_job *j = arg;
  j->s = gpuipc_accept(j->l, &j->c);
  snprintf(j->err, sizeof j->err, "%s", gpuipc_last_error());
  return NULL;
}

/* Accepts in a thread, bounded by limit_s seconds of waiting here: the
 * honest peer that connected after `silent` mute ones must come out. */
static gpuipc_conn *accept_within(gpuipc_listener *l, int limit_s,
                                  double *elapsed_s) {
  accept_job j = {l, NULL, GPUIPC_OK, ""};
  pthread_t t;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  ASSERT_EQ(pthread_create(&t, NULL, accept_thread, &j), 0);
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += limit_s;
  int r = pthread_timedjoin_np(t, NULL, &until);
  if (r != 0)
    harness_fail(__FILE__, __LINE__,
                 "gpuipc_accept did not return within %d s: handshakes of "
                 "silent peers hold up the honest one",
                 limit_s);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  *elapsed_s = (double)(t1.tv_sec - t0.tv_sec) +
               (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  if (j.s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "gpuipc_accept: %s (%s)",
                 gpuipc_status_name(j.s), j.err);
  return j.c;
}

TEST_IMPL(conn_accept_handshakes_concurrent) {
  char name[64];
  snprintf(name, sizeof name, "hs-%d", (int)getpid());
  int base_fds = harness_count_fds();
  for (int round = 0; round < 2; round++) {
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.abstract_name = 1;
    /* Round 0: accept may wait 120 s; round 1: forever. Each handshake
     * has 60 s. Serial handshakes would hold the honest peer for 3 x 60 s
     * (or forever); concurrent ones hand it out at once. */
    o.timeout_ms = round == 0 ? 120000 : -1;
    o.handshake_timeout_ms = 60000;
    gpuipc_listener *l = NULL;
    ASSERT_OK(gpuipc_listen(name, &o, &l));
    int mute[3];
    for (int i = 0; i < 3; i++)
      mute[i] = silent_client(name);
    pid_t pid = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
    double el = 0;
    gpuipc_conn *c = accept_within(l, 30, &el);
    gpuipc_peer_info pi;
    ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
    ASSERT_EQ(pi.pid, pid);
    if (el > 30.0)
      harness_fail(__FILE__, __LINE__, "round %d: accept took %.1f s", round,
                   el);
    roundtrip(c, 40, round);
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid, 30), 0);
    /* The silent ones are still pending, not dropped. */
    for (int i = 0; i < 3; i++)
      ASSERT(!silent_client_dropped(mute[i]));
    gpuipc_listener_close(l);
    /* Closing the listener drops them. */
    for (int i = 0; i < 3; i++) {
      ASSERT(silent_client_dropped(mute[i]));
      close(mute[i]);
    }
  }
  /* Each handshake has its own deadline: a silent peer is dropped when it
   * passes, while accept goes on waiting for its own. */
  {
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.abstract_name = 1;
    o.timeout_ms = 1500;
    o.handshake_timeout_ms = 200;
    gpuipc_listener *l = NULL;
    ASSERT_OK(gpuipc_listen(name, &o, &l));
    int mute = silent_client(name);
    gpuipc_conn *c = NULL;
    ASSERT_STATUS(gpuipc_accept(l, &c), GPUIPC_E_TIMEOUT);
    ASSERT(silent_client_dropped(mute));
    close(mute);
    gpuipc_listener_close(l);
  }
  /* The deadline bounds how long a peer keeps us waiting, not how long the
   * application takes to call accept again: two honest peers, one after
   * the other, a short handshake deadline, and before every call of
   * accept a pause longer than it; both come out. The listener is
   * non-blocking and accept is called only once its descriptor says the
   * peer answered (then the pause): the peer never has to answer within
   * the deadline, so a slow peer on a loaded machine cannot be dropped,
   * while every answer waits past the deadline for the next call. (With
   * blocking accepts and one pause between them, each peer had to answer
   * within 300 ms inside the accepts, and the second peer was pending
   * during the pause only if it had connected in time.) */
  {
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.abstract_name = 1;
    o.nonblocking = 1;
    o.handshake_timeout_ms = 300;
    gpuipc_listener *l = NULL;
    ASSERT_OK(gpuipc_listen(name, &o, &l));
    pid_t pids[2];
    gpuipc_conn *cs[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
      pids[k] = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
      gpuipc_status s;
      int rounds = 0;
      do {
        struct pollfd p = {gpuipc_listener_get_fd(l), POLLIN, 0};
        ASSERT_EQ(poll(&p, 1, 60000), 1);
        usleep(400 * 1000); /* past the handshake deadline */
        ASSERT_LT(++rounds, 20);
      } while ((s = gpuipc_accept(l, &cs[k])) == GPUIPC_E_WOULD_BLOCK);
      ASSERT_OK(s);
      ASSERT_OK(gpuipc_conn_set_nonblocking(cs[k], 0));
      ASSERT_OK(gpuipc_conn_set_timeout(cs[k], 30000));
    }
    gpuipc_conn *c1 = cs[0], *c2 = cs[1];
    pid_t p1 = pids[0], p2 = pids[1];
    gpuipc_peer_info a, b;
    ASSERT_OK(gpuipc_conn_get_peer(c1, &a));
    ASSERT_OK(gpuipc_conn_get_peer(c2, &b));
    ASSERT(a.pid == p1 && b.pid == p2);
    roundtrip(c1, 5, 1);
    roundtrip(c2, 5, 2);
    gpuipc_conn_close(c1);
    gpuipc_conn_close(c2);
    ASSERT_EQ(wait_helper(p1, 30), 0);
    ASSERT_EQ(wait_helper(p2, 30), 0);
    gpuipc_listener_close(l);
  }
  /* A non-blocking listener: handshakes move on in later calls, and the
   * listener's descriptor becomes readable when one can. */
  {
    gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
    o.abstract_name = 1;
    o.nonblocking = 1;
    gpuipc_listener *l = NULL;
    ASSERT_OK(gpuipc_listen(name, &o, &l));
    int mute = silent_client(name);
    pid_t pid = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
    gpuipc_conn *c = NULL;
    gpuipc_status s;
    int rounds = 0;
    while ((s = gpuipc_accept(l, &c)) == GPUIPC_E_WOULD_BLOCK) {
      struct pollfd p = {gpuipc_listener_get_fd(l), POLLIN, 0};
      ASSERT_EQ(poll(&p, 1, 20000), 1);
      ASSERT_LT(++rounds, 20);
    }
    ASSERT_OK(s);
    gpuipc_peer_info pi;
    ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
    ASSERT_EQ(pi.pid, pid);
    ASSERT_OK(gpuipc_conn_set_nonblocking(c, 0));
    roundtrip(c, 3, 3);
    gpuipc_conn_close(c);
    ASSERT_EQ(wait_helper(pid, 30), 0);
    gpuipc_listener_close(l);
    close(mute);
  }
  ASSERT_EQ(harness_count_fds(), base_fds);
  return 0;
}

TEST_IMPL(conn_accept_pending_bounded) {
  enum { MUTE = 200 };
  char name[64];
  snprintf(name, sizeof name, "hsb-%d", (int)getpid());
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.abstract_name = 1;
  o.timeout_ms = 120000;
  o.handshake_timeout_ms = 60000;
  int base_fds = harness_count_fds();
  gpuipc_listener *l = NULL;
  ASSERT_OK(gpuipc_listen(name, &o, &l));
  static int mute[MUTE];
  for (int i = 0; i < MUTE; i++)
    mute[i] = silent_client(name);
  pid_t pid = spawn_helper("conn_echo", NULL, NULL, name, "@", NULL);
  double el = 0;
  gpuipc_conn *c = accept_within(l, 30, &el);
  gpuipc_peer_info pi;
  ASSERT_OK(gpuipc_conn_get_peer(c, &pi));
  ASSERT_EQ(pi.pid, pid);
  /* This process holds the mute clients' own ends, the honest connection
   * (its socket and the liveness table its peer passed), and at most
   * GPUIPC_CONN_HANDSHAKES_MAX pending handshakes. */
  ASSERT_LE(harness_count_fds() - base_fds,
            2 + MUTE + 2 + GPUIPC_CONN_HANDSHAKES_MAX);
  int dropped = 0;
  for (int i = 0; i < MUTE; i++)
    dropped += silent_client_dropped(mute[i]);
  ASSERT_GE(dropped, MUTE - GPUIPC_CONN_HANDSHAKES_MAX);
  roundtrip(c, 10, 1);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  gpuipc_listener_close(l);
  for (int i = 0; i < MUTE; i++)
    close(mute[i]);
  ASSERT_EQ(harness_count_fds(), base_fds);
  return 0;
}

/* ---- listening over a stale socket file ---------------------------------------------------- */

/* Two processes listen on one name over a stale socket file at the same
 * moment, round after round: exactly one wins, the other is told the name
 * is in use, and the winner is the one reachable at the path. */
TEST_IMPL(conn_listen_stale_race) {
  enum { ROUNDS = 200 };
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_listener *l0 = NULL;
  ASSERT_OK(gpuipc_listen("race-setup", &o, &l0)); /* makes the directory */
  gpuipc_listener_close(l0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  int n = snprintf(sa.sun_path, sizeof sa.sun_path, "%s/race.sock", rt_dir());
  ASSERT_LT(n, (int)sizeof sa.sun_path);
  int both_won = 0, none_won = 0, unreachable = 0;
  for (int round = 0; round < ROUNDS; round++) {
    /* A dead listener's leftover: bound, never listening, file kept. */
    int stale = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(stale, 0);
    ASSERT_EQ(bind(stale, (struct sockaddr *)&sa, sizeof sa), 0);
    close(stale);
    int go[2], res[2], quit[2];
    ASSERT_EQ(pipe2(go, O_CLOEXEC), 0);
    ASSERT_EQ(pipe2(res, O_CLOEXEC), 0);
    ASSERT_EQ(pipe2(quit, O_CLOEXEC), 0);
    pid_t kids[2];
    for (int k = 0; k < 2; k++) {
      kids[k] = fork();
      ASSERT_GE(kids[k], 0);
      if (kids[k] == 0) {
        close(go[1]);
        close(res[0]);
        close(quit[1]);
        char ch;
        if (read(go[0], &ch, 1) != 1)
          _exit(2);
        gpuipc_listener *l = NULL;
        gpuipc_status s = gpuipc_listen("race", &o, &l);
        unsigned char r = (unsigned char)s;
        if (write(res[1], &r, 1) != 1)
          _exit(3);
        if (s == GPUIPC_OK) {
          if (read(quit[0], &ch, 1) < 0)
            _exit(4);
          gpuipc_listener_close(l);
        }
        _exit(0);
      }
    }
    close(go[0]);
    close(res[1]);
    close(quit[0]);
    ASSERT_EQ(write(go[1], "gg", 2), 2);
    unsigned char r[2];
    for (int k = 0; k < 2; k++)
      ASSERT_EQ(read(res[0], &r[k], 1), 1);
    int ok = (r[0] == GPUIPC_OK) + (r[1] == GPUIPC_OK);
    if (ok == 2)
      both_won++;
    if (ok == 0)
      none_won++;
    for (int k = 0; k < 2; k++)
      if (r[k] != GPUIPC_OK && r[k] != GPUIPC_E_EXISTS)
        harness_fail(__FILE__, __LINE__, "round %d: listen returned %s",
                     round, gpuipc_status_name((gpuipc_status)r[k]));
    /* The winner is the one at the path. */
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ok >= 1 && connect(probe, (struct sockaddr *)&sa, sizeof sa) != 0)
      unreachable++;
    close(probe);
    close(quit[1]);
    close(go[1]);
    close(res[0]);
    for (int k = 0; k < 2; k++)
      ASSERT_EQ(wait_helper(kids[k], 30), 0);
  }
  if (both_won || none_won || unreachable)
    harness_fail(__FILE__, __LINE__,
                 "of %d rounds: %d with two winners, %d with none, %d with "
                 "the winner unreachable",
                 ROUNDS, both_won, none_won, unreachable);
  return 0;
}

/* ---- host allocation failures ---------------------------------------------------------------- */

/* A frame that cannot be queued whole is never started: the stream stays
 * intact (before, its first bytes left and the rest was dropped, and the
 * peer then read garbage), the call says E_NO_MEMORY, and the connection
 * goes on. A message whose queue entry cannot be allocated stays in the
 * receive buffer for a later call (before, it was lost and the frames
 * ahead of it were dispatched again). */
TEST_IMPL(conn_alloc_failure_keeps_stream_whole) {
  int fd;
  pid_t pid = spawn_helper("conn_echo", NULL, &fd, "pair", NULL);
  gpuipc_conn_options o = opts_ms(20000);
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  /* A small send buffer: a large message leaves in parts. */
  int small = 4096;
  ASSERT_EQ(setsockopt(gpuipc_conn_get_fd(c), SOL_SOCKET, SO_SNDBUF, &small,
                       sizeof small),
            0);
  static unsigned char big[GPUIPC_CONN_MSG_MAX];
  memset(big, 0xab, sizeof big);
  harness_fail_allocs(4096, (size_t)1 << 20, 1000);
  gpuipc_status s = gpuipc_conn_send_msg(c, big, sizeof big, NULL, 0);
  int failed = harness_fail_allocs(0, 0, 0);
  ASSERT_GT(failed, 0);
  ASSERT_STATUS(s, GPUIPC_E_NO_MEMORY);
  /* The stream is whole: the next messages arrive as sent. */
  roundtrip(c, 100, 7);
  ASSERT_OK(gpuipc_conn_send_msg(c, big, sizeof big, NULL, 0));
  static unsigned char in[GPUIPC_CONN_MSG_MAX];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, in, sizeof in, &len, NULL, NULL));
  ASSERT_EQ(len, sizeof big);
  ASSERT_MEM_EQ(in, big, sizeof big);

  /* Receiving: three messages (5000, 6000, 7000 bytes) are echoed; the
   * queue entries of the first, then of the second, cannot be allocated at
   * first. */
  static unsigned char m[3][7000];
  size_t mlen[3] = {5000, 6000, 7000};
  int roomy = 1 << 20;
  ASSERT_EQ(setsockopt(gpuipc_conn_get_fd(c), SOL_SOCKET, SO_SNDBUF, &roomy,
                       sizeof roomy),
            0);
  for (int i = 0; i < 3; i++) {
    memset(m[i], 'a' + i, mlen[i]);
    ASSERT_OK(gpuipc_conn_send_msg(c, m[i], mlen[i], NULL, 0));
  }
  /* Wait until the three echoes are all in the socket. */
  for (int tries = 0;; tries++) {
    int q = 0;
    ASSERT_EQ(ioctl(gpuipc_conn_get_fd(c), FIONREAD, &q), 0);
    if (q >= (int)(mlen[0] + mlen[1] + mlen[2] + 3 * 16))
      break;
    ASSERT_LT(tries, 2000);
    usleep(10000);
  }
  harness_fail_allocs(5000, 5200, 1);
  s = gpuipc_conn_recv_msg(c, in, sizeof in, &len, NULL, NULL);
  ASSERT_EQ(harness_fail_allocs(6000, 6200, 1), 1);
  ASSERT_STATUS(s, GPUIPC_E_NO_MEMORY);
  for (int i = 0; i < 3; i++) {
    ASSERT_OK(gpuipc_conn_recv_msg(c, in, sizeof in, &len, NULL, NULL));
    if (i == 0)
      ASSERT_EQ(harness_fail_allocs(0, 0, 0), 1);
    ASSERT_EQ(len, mlen[i]);
    if (memcmp(in, m[i], len) != 0)
      harness_fail(__FILE__, __LINE__, "message %d came as '%c...' (%zu "
                   "bytes)", i, in[0], len);
  }
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 30), 0);
  return 0;
}
