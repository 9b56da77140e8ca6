/*
 * test-ls.c: `gpuipc ls` / `gpuipc top` and the stats segment behind them
 * (src/core/stats.c, tools/ls.c): two processes in a known state (an arena
 * with blocks out over a connection, a deferred free, imports in the
 * receiver's cache) listed field by field through --json; a killed
 * process shown as gone and its entry removed; a process that exits
 * removes its own. Each test lists its own runtime directory
 * (XDG_RUNTIME_DIR in a fresh temporary directory, for it and its
 * helpers), so tests running at once do not see each other.
 */
#include "harness.h"
#include "tree.h"

#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* A private XDG_RUNTIME_DIR for this test and the helpers it starts. */
static const char *private_runtime(void) {
  static char dir[512];
  snprintf(dir, sizeof dir, "%s/xdg", harness_tmpdir());
  ASSERT_EQ(mkdir(dir, 0700) == 0 || errno == EEXIST, 1);
  ASSERT_EQ(setenv("XDG_RUNTIME_DIR", dir, 1), 0);
  return dir;
}

static int run_cli(const char *a1, const char *a2, char *out, size_t cap) {
  char *argv[] = {GPUIPC_CLI_PATH, (char *)a1, (char *)a2, NULL};
  return harness_run(argv, NULL, out, cap);
}

/* The JSON object of process pid in an `ls --json` listing (up to the next
 * process), copied into obj; false when the pid is not listed. */
static bool proc_object(const char *json, int pid, char *obj, size_t cap) {
  char key[64];
  snprintf(key, sizeof key, "{\"pid\": %d,", pid);
  const char *p = strstr(json, key);
  if (p == NULL)
    return false;
  const char *end = strstr(p + 1, "\n  {\"pid\": ");
  size_t n = end ? (size_t)(end - p) : strlen(p);
  if (n >= cap)
    n = cap - 1;
  memcpy(obj, p, n);
  obj[n] = '\0';
  return true;
}

#define ASSERT_HAS(hay, needle)                                                \
  do {                                                                         \
    if (strstr((hay), (needle)) == NULL)                                       \
      harness_fail(__FILE__, __LINE__, "expected %s in:\n%s", (needle),        \
                   (hay));                                                     \
  } while (0)

static gpuipc_conn *ls_conn(int fd) {
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 120000;
  gpuipc_conn *c = NULL;
  ASSERT_OK(gpuipc_conn_from_fd(fd, &o, &c));
  return c;
}

static void expect_msg(gpuipc_conn *c, const char *what) {
  char buf[16];
  size_t len = 0;
  ASSERT_OK(gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL));
  ASSERT_EQ(len, strlen(what));
  ASSERT_MEM_EQ(buf, what, len);
}

/* A helper's end: waits for the test's last word (or its close), closes. */
static int wait_end(gpuipc_conn *c) {
  char buf[8];
  size_t len;
  gpuipc_status s = gpuipc_conn_recv_msg(c, buf, sizeof buf, &len, NULL, NULL);
  ASSERT(s == GPUIPC_E_PEER_GONE || s == GPUIPC_OK);
  gpuipc_conn_close(c);
  return 0;
}

/* Receives two buffers and holds them until told, then releases them. */
HELPER_IMPL(ls_holder) {
  gpuipc_conn *c = ls_conn(dup(harness_helper_fd()));
  gpuipc_received r[2];
  for (int i = 0; i < 2; i++) {
    r[i] = (gpuipc_received)GPUIPC_RECEIVED_INIT;
    ASSERT_OK(gpuipc_conn_recv(c, NULL, &r[i]));
  }
  ASSERT_OK(gpuipc_conn_send_msg(c, "held", 4, NULL, 0));
  expect_msg(c, "go");
  for (int i = 0; i < 2; i++)
    ASSERT_OK(gpuipc_conn_release(c, r[i].id, NULL));
  ASSERT_OK(gpuipc_conn_send_msg(c, "done", 4, NULL, 0));
  return wait_end(c);
}

TEST_IMPL(ls_two_processes_field_by_field) {
  REQUIRE_DEVICES(1);
  private_runtime();
  int fd;
  pid_t pid = spawn_helper("ls_holder", NULL, &fd, NULL);
  gpuipc_conn *c = ls_conn(fd);
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)1 << 20;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  gpuipc_block *b[3];
  for (int i = 0; i < 3; i++)
    ASSERT_OK(gpuipc_arena_alloc(a, 4096, NULL, &b[i]));
  ASSERT_OK(gpuipc_conn_send(c, b[0], NULL, NULL, 0));
  ASSERT_OK(gpuipc_conn_send(c, b[1], NULL, NULL, 0));
  expect_msg(c, "held");
  ASSERT_OK(gpuipc_block_free(b[0], NULL)); /* deferred: the peer holds it */

  static char json[1 << 16], me[8192], peer[8192];
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(proc_object(json, (int)getpid(), me, sizeof me));
  ASSERT(proc_object(json, (int)pid, peer, sizeof peer));

  /* This process: the producer. */
  gpuipc_arena_stats st = GPUIPC_ARENA_STATS_INIT;
  ASSERT_OK(gpuipc_arena_get_stats(a, &st));
  char want[256];
  ASSERT_HAS(me, "\"alive\": true");
  ASSERT_HAS(me, "gpuipc-tests ls_two_processes_field_by_field");
  gpuipc_uuid u;
  char ut[64];
  ASSERT_OK(gpuipc_device_uuid(0, &u));
  gpuipc_uuid_format(&u, ut);
  snprintf(want, sizeof want, "\"devices\": [{\"ordinal\": 0, \"uuid\": \"%s\"}]",
           ut);
  ASSERT_HAS(me, want);
  /* Two arenas: ours and the connection's flag words (one block in it). */
  /* The flag-word arena's chunk size is the library's choice: check the
   * fixed fields, then the bytes as at least our chunk. */
  ASSERT_HAS(me, "\"arenas\": {\"count\": 2, \"chunks\": 2, \"bytes\": ");
  ASSERT_HAS(me, "\"blocks_out\": 4, \"deferred_frees\": 1}");
  {
    const char *p = strstr(me, "\"arenas\": {\"count\": 2, \"chunks\": 2, \"bytes\": ");
    long long bytes = atoll(p + strlen("\"arenas\": {\"count\": 2, \"chunks\": 2, \"bytes\": "));
    ASSERT_GT(bytes, (long long)st.bytes_total - 1);
  }
  ASSERT_HAS(me, "\"connections_total\": 1, \"connections_untracked\": 0");
  snprintf(want, sizeof want,
           "{\"peer_pid\": %d, \"peer_start_time\": %llu, \"state\": \"open\", "
           "\"order\": \"memop\", \"held_by_peer\": 2, \"held_here\": 0,",
           (int)pid, (unsigned long long)gpuipc__process_start_time((int)pid));
  ASSERT_HAS(me, want);
  ASSERT(strstr(me, "\"oldest_lease_ms\": null") == NULL);

  /* The helper: the consumer, holding both, its imports in the cache. */
  ASSERT_HAS(peer, "\"alive\": true");
  ASSERT_HAS(peer, "ls_holder");
  snprintf(want, sizeof want,
           "{\"peer_pid\": %d, \"peer_start_time\": %llu, \"state\": \"open\", "
           "\"order\": \"memop\", \"held_by_peer\": 0, \"held_here\": 2,",
           (int)getpid(),
           (unsigned long long)gpuipc__process_start_time((int)getpid()));
  ASSERT_HAS(peer, want);
  ASSERT_HAS(peer, "\"oldest_lease_ms\": null");
  ASSERT_HAS(peer, "\"import_cache\": {\"live\": 2, \"hits\": 0, \"misses\": 2, "
                   "\"stale\": 0}");

  /* The text form says the same. */
  static char text[1 << 16];
  ASSERT_EQ(run_cli("ls", NULL, text, sizeof text), 0);
  snprintf(want, sizeof want, "conn peer %-7d open      memop peer holds 2, we hold 0",
           (int)pid);
  ASSERT_HAS(text, want);
  ASSERT_HAS(text, "4 blocks out, 1 deferred frees");

  /* The peer gives both back: nothing is held any more on either side. */
  ASSERT_OK(gpuipc_conn_send_msg(c, "go", 2, NULL, 0));
  expect_msg(c, "done");
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(proc_object(json, (int)getpid(), me, sizeof me));
  ASSERT_HAS(me, "\"blocks_out\": 3, \"deferred_frees\": 0}");
  ASSERT_HAS(me, "\"held_by_peer\": 0, \"held_here\": 0,");
  ASSERT_HAS(me, "\"oldest_lease_ms\": null");

  ASSERT_OK(gpuipc_block_free(b[1], NULL));
  ASSERT_OK(gpuipc_block_free(b[2], NULL));
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  ASSERT_OK(gpuipc_arena_destroy(a));
  /* The helper exited: its entry went with it. */
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(!proc_object(json, (int)pid, peer, sizeof peer));
  ASSERT(proc_object(json, (int)getpid(), me, sizeof me));
  ASSERT_HAS(me, "\"connections_total\": 0, \"connections_untracked\": 0, "
                 "\"connections\": []");
  return 0;
}

/* Makes an arena (so its segment exists), says so, waits to be killed. */
HELPER_IMPL(ls_victim) {
  gpuipc_conn *c = ls_conn(dup(harness_helper_fd()));
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = (size_t)1 << 20;
  gpuipc_arena *a = NULL;
  ASSERT_OK(gpuipc_arena_create(&ao, &a));
  ASSERT_OK(gpuipc_conn_send_msg(c, "up", 2, NULL, 0));
  for (;;)
    pause();
  return 0;
}

TEST_IMPL(ls_killed_process_shown_gone_and_removed) {
  REQUIRE_DEVICES(1);
  const char *xdg = private_runtime();
  int fd;
  pid_t pid = spawn_helper("ls_victim", NULL, &fd, NULL);
  gpuipc_conn *c = ls_conn(fd);
  expect_msg(c, "up");
  uint64_t start = gpuipc__process_start_time((int)pid);
  char dir[600], path[700];
  snprintf(dir, sizeof dir, "%s/gpuipc", xdg);
  ASSERT_EQ(gpuipc__stats_path(path, sizeof path, dir, (int)pid, start), 0);
  struct stat st;
  ASSERT_EQ(stat(path, &st), 0);
  ASSERT_EQ(st.st_mode & 0777, 0600);
  ASSERT_EQ(st.st_uid, geteuid());

  static char json[1 << 16], obj[8192];
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(proc_object(json, (int)pid, obj, sizeof obj));
  ASSERT_HAS(obj, "\"alive\": true");
  ASSERT_HAS(obj, "\"arenas\": {\"count\": 1, \"chunks\": 1, \"bytes\": 1048576,");

  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  gpuipc_conn_close(c);
  ASSERT_EQ(stat(path, &st), 0); /* a killed process cannot clean up */
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(proc_object(json, (int)pid, obj, sizeof obj));
  ASSERT_HAS(obj, "\"alive\": false");
  ASSERT(stat(path, &st) != 0 && errno == ENOENT); /* ls removed it */
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(!proc_object(json, (int)pid, obj, sizeof obj));
  return 0;
}

/* A segment of another shape, or a file that is not a segment, is not
 * listed and not removed. */
TEST_IMPL(ls_ignores_foreign_files) {
  const char *xdg = private_runtime();
  char dir[600], path[700];
  snprintf(dir, sizeof dir, "%s/gpuipc", xdg);
  ASSERT_EQ(mkdir(dir, 0700), 0);
  /* A name of the right form for a process that does not exist, but too
   * short to be a segment. */
  snprintf(path, sizeof path, "%s/proc-999999-1.stats", dir);
  FILE *f = fopen(path, "w");
  ASSERT_NOT_NULL(f);
  fputs("not a segment", f);
  fclose(f);
  static char json[1 << 16];
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(strstr(json, "\"pid\": 999999") == NULL);
  struct stat st;
  ASSERT_EQ(stat(path, &st), 0);
  return 0;
}

TEST_IMPL(top_count_refreshes) {
  private_runtime();
  static char out[1 << 16];
  char *argv[] = {GPUIPC_CLI_PATH, "top", "--interval", "0.01", "--count",
                  "3", NULL};
  ASSERT_EQ(harness_run(argv, NULL, out, sizeof out), 0);
  int n = 0;
  for (const char *p = out; (p = strstr(p, "gpuipc top ")) != NULL; p++)
    n++;
  ASSERT_EQ(n, 3);
  ASSERT_HAS(out, "no gpuipc process of this user");
  return 0;
}

/* ---- hostile or broken segments ---------------------------------------------- */

/* The runtime directory ls reads, made (0700) under a private
 * XDG_RUNTIME_DIR. */
static const char *ls_dir(void) {
  static char dir[600];
  snprintf(dir, sizeof dir, "%s/gpuipc", private_runtime());
  ASSERT_EQ(mkdir(dir, 0700) == 0 || errno == EEXIST, 1);
  return dir;
}

/* Writes a segment that passes ls's checks for (pid, start) at fd. */
static void forge_segment(int fd, int pid, uint64_t start, const char *command) {
  gpuipc__stats_seg *s = calloc(1, sizeof *s);
  ASSERT_NOT_NULL(s);
  atomic_store(&s->magic, GPUIPC__STATS_MAGIC);
  s->version = GPUIPC__STATS_VERSION;
  s->size = (uint32_t)sizeof *s;
  s->pid = pid;
  s->uid = (uint32_t)geteuid();
  s->start_time = start;
  snprintf(s->command, sizeof s->command, "%s", command);
  ASSERT_EQ(pwrite(fd, s, sizeof *s, 0), (ssize_t)sizeof *s);
  free(s);
}

/* Runs `gpuipc ls [arg]` under timeout(1): 124 when it hung. */
static int run_ls_bounded(const char *arg, char *out, size_t cap) {
  char *argv[] = {"timeout", "20", GPUIPC_CLI_PATH, "ls", (char *)arg, NULL};
  return harness_run(argv, NULL, out, cap);
}

/* A FIFO named like a segment: opening it for reading would wait for a
 * writer that never comes. */
TEST_IMPL(ls_fifo_in_place_of_segment) {
  const char *dir = ls_dir();
  char path[700];
  snprintf(path, sizeof path, "%s/proc-999999-1.stats", dir);
  ASSERT_EQ(mkfifo(path, 0600), 0);
  static char out[1 << 16];
  ASSERT_EQ(run_ls_bounded("--json", out, sizeof out), 0);
  ASSERT(strstr(out, "\"pid\": 999999") == NULL);
  ASSERT_EQ(run_ls_bounded(NULL, out, sizeof out), 0);
  ASSERT_HAS(out, "no gpuipc process of this user");
  struct stat st;
  ASSERT_EQ(lstat(path, &st), 0); /* not ours to remove */
  return 0;
}

/* A live process whose segment shrinks and grows again while ls reads it:
 * a mapping of it would raise SIGBUS in ls. */
TEST_IMPL(ls_segment_shrinking_while_read) {
  const char *dir = ls_dir();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    uint64_t start = gpuipc__process_start_time((int)getpid());
    char path[700];
    if (gpuipc__stats_path(path, sizeof path, dir, (int)getpid(), start) != 0)
      _exit(1);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
      _exit(1);
    forge_segment(fd, (int)getpid(), start, "shrinker");
    if (write(ready[1], "r", 1) != 1)
      _exit(1);
    for (;;) {
      if (ftruncate(fd, 0) != 0)
        _exit(1);
      forge_segment(fd, (int)getpid(), start, "shrinker");
    }
  }
  close(ready[1]);
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  static char out[1 << 16];
  int crashed = 0, runs = 0;
  for (; runs < 300 && crashed == 0; runs++) {
    int rc = run_ls_bounded("--json", out, sizeof out);
    if (rc != 0) {
      printf("# run %d: gpuipc ls exited with %d\n", runs, rc);
      crashed++;
    }
  }
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_EQ(wait_helper(pid, 60), 128 + SIGKILL);
  ASSERT_EQ(crashed, 0);
  return 0;
}

/* A segment's command is the writer's to choose: terminal control
 * sequences in it are not passed to the terminal of ls or top (they could
 * clear the screen or rewrite the lines of other processes). */
TEST_IMPL(ls_command_control_characters) {
  const char *dir = ls_dir();
  char path[700];
  snprintf(path, sizeof path, "%s/proc-999997-5.stats", dir);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  forge_segment(fd, 999997, 5, "evil\033[2J\033[Hfake\r\n12345 \xc2\x9b" "2Jx\x7f");
  close(fd);
  static char out[1 << 16];
  ASSERT_EQ(run_ls_bounded(NULL, out, sizeof out), 0);
  ASSERT_HAS(out, "999997");
  ASSERT_HAS(out, "evil");
  for (const char *p = out; *p; p++) {
    unsigned char ch = (unsigned char)*p;
    if ((ch < 0x20 && ch != '\n') || ch == 0x7f ||
        (ch == 0xc2 && (unsigned char)p[1] >= 0x80 &&
         (unsigned char)p[1] <= 0x9f))
      harness_fail(__FILE__, __LINE__, "control byte 0x%02x at %zu in:\n%s",
                   ch, (size_t)(p - out), out);
  }
  /* One line for the process: the newline in its command made none. */
  const char *line = strstr(out, "999997");
  ASSERT_NOT_NULL(line);
  const char *end = strchr(line, '\n'), *later = strstr(line, "12345");
  ASSERT(end != NULL && later != NULL && later < end);
  return 0;
}

/* Connects, says so, and waits for the end (its command line carries
 * whatever bytes the test gave it). */
HELPER_IMPL(ls_named) {
  (void)argc;
  (void)argv;
  gpuipc_conn *c = ls_conn(dup(harness_helper_fd()));
  ASSERT_OK(gpuipc_conn_send_msg(c, "up", 2, NULL, 0));
  return wait_end(c);
}

/* A command line that is not UTF-8 (Latin-1 "café", a stray continuation
 * byte) is escaped in `ls --json`: the listing is ASCII here, valid JSON. */
TEST_IMPL(ls_json_escapes_bytes_that_are_not_utf8) {
  private_runtime();
  int fd;
  pid_t pid = spawn_helper("ls_named", NULL, &fd, "caf\xe9", "x\x80y", NULL);
  gpuipc_conn *c = ls_conn(fd);
  expect_msg(c, "up");
  static char json[1 << 16], obj[8192];
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(proc_object(json, (int)pid, obj, sizeof obj));
  ASSERT_HAS(obj, "caf\\u00e9 x\\u0080y");
  for (const char *p = json; *p; p++)
    ASSERT((unsigned char)*p < 0x80);
  gpuipc_conn_close(c);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  return 0;
}

/* Writes a segment file as a process of pid namespace ns would (pid, a
 * start time no process here has). */
static void fake_segment(const char *dir, int pid, uint64_t ns, char *path,
                         size_t cap) {
  static gpuipc__stats_seg s;
  memset(&s, 0, sizeof s);
  s.version = GPUIPC__STATS_VERSION;
  s.size = (uint32_t)sizeof s;
  s.pid = pid;
  s.uid = (uint32_t)geteuid();
  s.start_time = 12345;
  s.pid_ns = ns;
  snprintf(s.command, sizeof s.command, "fake-%d", pid);
  atomic_store(&s.magic, GPUIPC__STATS_MAGIC);
  ASSERT_EQ(gpuipc__stats_path(path, cap, dir, pid, s.start_time), 0);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, &s, sizeof s), (ssize_t)sizeof s);
  close(fd);
}

/* A segment of another pid namespace sharing the directory is listed and
 * left alone (its pid names another process here, or none); one of ours
 * whose process is gone is removed. */
TEST_IMPL(ls_keeps_segments_of_other_pid_namespaces) {
  uint64_t ns = gpuipc__pid_namespace();
  if (ns == 0)
    SKIP("no /proc/self/ns/pid here");
  char dir[512];
  snprintf(dir, sizeof dir, "%s/gpuipc", private_runtime());
  ASSERT_EQ(mkdir(dir, 0700) == 0 || errno == EEXIST, 1);
  char theirs[600], ours[600];
  /* pid 1 here is init, with another start time: "gone" if judged. */
  fake_segment(dir, 1, ns + 1, theirs, sizeof theirs);
  fake_segment(dir, 2, ns, ours, sizeof ours);
  static char json[1 << 16], obj[8192];
  ASSERT_EQ(run_cli("ls", "--json", json, sizeof json), 0);
  ASSERT(proc_object(json, 1, obj, sizeof obj));
  ASSERT_HAS(obj, "\"alive\": true, \"own_pid_namespace\": false");
  ASSERT(proc_object(json, 2, obj, sizeof obj));
  ASSERT_HAS(obj, "\"alive\": false, \"own_pid_namespace\": true");
  ASSERT_EQ(access(theirs, F_OK), 0);
  ASSERT(access(ours, F_OK) != 0);
  unlink(theirs);
  return 0;
}
