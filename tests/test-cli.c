/*
 * test-cli.c: the gpuipc command's surface as a packager and a script see
 * it: --help and -h of every command and subcommand print usage to stdout
 * and exit 0; --version prints the version; unknown commands and options
 * exit 2 (doctor: 64, its verdicts own 0..2) with usage on stderr and
 * nothing on stdout; bench --json writes a record bench/plot.py accepts;
 * bench ring runs every case and ends cleanly when its peer dies or writes
 * garbage into the ring.
 */
#include "harness.h"

#include <unistd.h>

/* Runs the CLI with up to 16 arguments; stdout into out, and (when err is
 * not NULL) stderr into err instead, through a shell redirect. */
static int cli(const char *const args[], char *out, size_t cap, char *err,
               size_t ecap) {
  char *argv[24];
  int n = 0;
  if (err) {
    argv[n++] = "/bin/sh";
    argv[n++] = "-c";
    argv[n++] = "out=$1; shift; \"$0\" \"$@\" 2>&1 >\"$out\"";
    argv[n++] = GPUIPC_CLI_PATH;
    static char path[600];
    snprintf(path, sizeof path, "%s/stdout", harness_tmpdir());
    argv[n++] = path;
    for (int i = 0; args[i] && n < 23; i++)
      argv[n++] = (char *)args[i];
    argv[n] = NULL;
    int rc = harness_run(argv, NULL, err, ecap);
    FILE *f = fopen(path, "r");
    ASSERT_NOT_NULL(f);
    size_t got = fread(out, 1, cap - 1, f);
    out[got] = '\0';
    fclose(f);
    return rc;
  }
  argv[n++] = GPUIPC_CLI_PATH;
  for (int i = 0; args[i] && n < 23; i++)
    argv[n++] = (char *)args[i];
  argv[n] = NULL;
  return harness_run(argv, NULL, out, cap);
}

static void show(const char *const args[], char *buf, size_t cap) {
  buf[0] = '\0';
  for (int i = 0; args[i]; i++)
    snprintf(buf + strlen(buf), cap - strlen(buf), " %s", args[i]);
}

TEST_IMPL(cli_help_of_every_command) {
  static const char *const cases[][4] = {
      {"--help"},           {"-h"},
      {"help"},             {"doctor", "--help"},
      {"doctor", "-h"},     {"demo", "--help"},
      {"demo", "-h"},       {"ls", "--help"},
      {"ls", "-h"},         {"top", "--help"},
      {"top", "-h"},        {"version", "--help"},
      {"bench", "--help"},  {"bench", "-h"},
      {"bench", "handle", "--help"}, {"bench", "handle", "-h"},
      {"bench", "handoff", "--help"}, {"bench", "handoff", "-h"},
      {"bench", "copy", "--help"},   {"bench", "copy", "-h"},
      {"bench", "ring", "--help"},   {"bench", "ring", "-h"},
      {"bench", "all", "--help"},
      {"bench", "sets", "--help"},   {"bench", "sets", "-h"},
      {"bench", "mpi", "--help"},    {"bench", "mpi", "-h"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    static char out[16384], err[16384];
    char what[128];
    show(cases[i], what, sizeof what);
    int rc = cli(cases[i], out, sizeof out, err, sizeof err);
    if (rc != 0 || strncmp(out, "usage: gpuipc", 13) != 0 || err[0] != '\0')
      harness_fail(__FILE__, __LINE__,
                   "gpuipc%s: exit %d (want 0), stdout:\n%s\nstderr:\n%s",
                   what, rc, out, err);
  }
  return 0;
}

/* A build without MPI has no gpuipc-bench-mpi beside the command: `bench
 * mpi` says so and why, and exits 1, rather than leave mpirun to say it
 * cannot find an executable. */
TEST_IMPL(cli_bench_mpi_without_its_program_says_why) {
  char prog[600];
  snprintf(prog, sizeof prog, "%s", GPUIPC_CLI_PATH);
  char *slash = strrchr(prog, '/');
  ASSERT_NOT_NULL(slash);
  snprintf(slash + 1, sizeof prog - (size_t)(slash + 1 - prog),
           "gpuipc-bench-mpi");
  if (access(prog, X_OK) == 0)
    SKIP("this build found MPI: %s exists (the message is for a build "
         "without it)", prog);
  static const char *const args[] = {"bench", "mpi", "--quick", NULL};
  char out[4096], err[4096];
  int rc = cli(args, out, sizeof out, err, sizeof err);
  if (rc != 1 || strstr(err, "gpuipc-bench-mpi was not built") == NULL ||
      strstr(err, "MPI") == NULL)
    harness_fail(__FILE__, __LINE__, "gpuipc bench mpi without its program: "
                 "exit %d, stderr: %s", rc, err);
  ASSERT_EQ(out[0], '\0');
  return 0;
}

TEST_IMPL(cli_version) {
  static const char *const cases[][2] = {{"--version"}, {"version"}};
  for (size_t i = 0; i < 2; i++) {
    char out[256], want[64];
    ASSERT_EQ(cli(cases[i], out, sizeof out, NULL, 0), 0);
    snprintf(want, sizeof want, "gpuipc %s\n", gpuipc_version_string());
    ASSERT_STR_EQ(out, want);
  }
  return 0;
}

TEST_IMPL(cli_unknown_options_exit_2_with_usage_on_stderr) {
  static const struct {
    const char *args[5];
    int rc;
  } cases[] = {
      {{"no-such-command"}, 2},
      {{"--no-such-option"}, 2},
      {{}, 2},
      {{"demo", "--no-such-option"}, 2},
      {{"ls", "--no-such-option"}, 2},
      {{"top", "--no-such-option"}, 2},
      {{"top", "--interval", "0"}, 2},
      {{"top", "--count", "x"}, 2},
      {{"version", "--no-such-option"}, 2},
      {{"bench"}, 2},
      {{"bench", "no-such-bench"}, 2},
      {{"bench", "--no-such-option"}, 2},
      {{"bench", "handle", "--no-such-option"}, 2},
      {{"bench", "handoff", "--no-such-option"}, 2},
      {{"bench", "copy", "--no-such-option"}, 2},
      {{"bench", "ring", "--no-such-option"}, 2},
      {{"bench", "ring", "--iters", "0"}, 2},
      {{"bench", "ring", "--burst"}, 2},
      {{"bench", "ring", "--test-fault", "exit:no-such-case:1"}, 2},
      {{"bench", "ring", "--test-fault", "garbage:socket_poll:1"}, 2},
      {{"bench", "handle", "--json"}, 2},
      /* doctor's exit status is its verdict (0, 1, 2): a usage error is 64
       * (docs/doctor.md). */
      {{"doctor", "--no-such-option"}, 64},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    static char out[16384], err[16384];
    char what[128];
    show(cases[i].args, what, sizeof what);
    int rc = cli(cases[i].args, out, sizeof out, err, sizeof err);
    if (rc != cases[i].rc || out[0] != '\0' || strstr(err, "usage:") == NULL)
      harness_fail(__FILE__, __LINE__,
                   "gpuipc%s: exit %d (want %d, usage on stderr only), "
                   "stdout:\n%s\nstderr:\n%s",
                   what, rc, cases[i].rc, out, err);
  }
  return 0;
}

TEST_IMPL(bench_json_record_and_plot_check) {
  REQUIRE_EMULATOR("a benchmark run short enough for the suite");
  char path[600];
  snprintf(path, sizeof path, "%s/handoff.json", harness_tmpdir());
  const char *args[] = {"bench", "handoff", "--quick", "--iters", "10",
                        "--json", path, NULL};
  static char out[1 << 16];
  ASSERT_EQ(cli(args, out, sizeof out, NULL, 0), 0);
  /* What it printed is also in the record. */
  ASSERT(strstr(out, "summary (4 KiB; one pair over the ring carrier") !=
         NULL);
  ASSERT(strstr(out, "  stream-ordered handoff, busy producer stream") != NULL);
  ASSERT(strstr(out, " target(s) missed") != NULL);
  FILE *f = fopen(path, "r");
  ASSERT_NOT_NULL(f);
  static char rec[1 << 16];
  size_t n = fread(rec, 1, sizeof rec - 1, f);
  rec[n] = '\0';
  fclose(f);
  char want[800];
  snprintf(want, sizeof want,
           "\"command\": \"gpuipc bench handoff --quick --iters 10 --json %s\"",
           path);
  const char *const keys[] = {
      "\"format\": \"gpuipc-bench\"", "\"machine\": {\"hostname\": ",
      "\"driver\": {\"library\": ",   "\"emulated\": true",
      "\"gpus\": [\n    {\"ordinal\": 0, \"name\": ",
      "{\"name\": \"handoff\", \"info\": {\"device\": ",
      "\"iterations\": 10",           "\"raw\": [",
      "{\"path\": \"legacy\", \"get_us\": ",
      "{\"path\": \"memop_round_trip\", \"per_buffer_us\": ",
      "\"handoff\": [",
      "{\"size_bytes\": 4096, \"consumers\": 1, \"median_us\": ",
      "{\"size_bytes\": 1048576, \"consumers\": 8, \"median_us\": ",
      "{\"path\": \"shared_word_one_way\", \"per_buffer_us\": ",
      "\"target\": [",
      "{\"what\": \"stream-ordered handoff, busy producer stream\", "
      "\"value\": ",
      "\"pair_4k_ordered_median_us\": ",
      /* --quick: fan-out to 16, flatness to 10,000 (64 and 100,000 in a
       * full run) */
      "{\"mode\": \"broadcast\", \"size_bytes\": 4096, \"consumers\": 16, "
      "\"median_last_us\": ",
      "{\"batch\": 256, \"size_bytes\": 4096, \"buffers_per_s\": ",
      "{\"live_leases\": 10000, \"size_bytes\": 4096, \"buffers_per_s\": ",
      "\"batch_16_buffers_per_s\": ", want};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
    if (strstr(rec, keys[i]) == NULL)
      harness_fail(__FILE__, __LINE__, "record lacks %s:\n%s", keys[i], rec);
  /* bench/plot.py accepts it (--check needs no matplotlib). */
  if (access("/usr/bin/python3", X_OK) != 0)
    SKIP("no python3 for bench/plot.py");
  char plot[600];
  snprintf(plot, sizeof plot, "%s/bench/plot.py", GPUIPC_SOURCE_DIR);
  char *pargv[] = {"/usr/bin/python3", plot, "--check", "--out", "figs", path,
                   NULL};
  ASSERT_EQ(harness_run(pargv, NULL, out, sizeof out), 0);
  ASSERT(strstr(out, "would draw figs/handoff-latency.png") != NULL);
  ASSERT(strstr(out, "would draw figs/handoff-throughput.png") != NULL);
  /* Something that is not a record is refused. */
  char *bad[] = {"/usr/bin/python3", plot, "--check", GPUIPC_SOURCE_DIR "/docs/ls.md", NULL};
  ASSERT_NE(harness_run(bad, NULL, out, sizeof out), 0);
  return 0;
}

/* The cases of `gpuipc bench ring`, as its JSON record names them. */
static const char *const ring_cases[] = {
    "socket_polled",     "socket_poll",  "socket_blocking",
    "ring_spin",         "ring_futex_spin", "ring_futex",
    "ring_eventfd_spin", "ring_eventfd", "ring_sockwake_spin",
    "ring_sockwake"};

TEST_IMPL(bench_ring_runs_every_case) {
  /* No GPU is involved: the same on the emulator and on a GPU machine. */
  char path[600];
  snprintf(path, sizeof path, "%s/ring.json", harness_tmpdir());
  const char *args[] = {"bench", "ring", "--quick", "--iters", "100",
                        "--burst", "3000", "--json", path, NULL};
  static char out[1 << 16], err[1 << 16];
  int rc = cli(args, out, sizeof out, err, sizeof err);
  if (rc != 0 || err[0] != '\0')
    harness_fail(__FILE__, __LINE__,
                 "exit %d (want 0), stdout:\n%s\nstderr:\n%s", rc, out, err);
  const char *const lines[] = {
      "socket, receiver polls recvmsg", "socket, receiver sleeps in poll()",
      "socket, receiver blocks in recvmsg", "ring, receiver spins",
      "ring, spin, then futex",
      "ring, futex (sleeps at once)", "ring, spin, then eventfd",
      "ring, eventfd (sleeps at once)", "ring, spin, then socket wake",
      "ring, socket wake (sleeps at once)", "median one way, receiver awake"};
  for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
    ASSERT_STR_CONTAINS(out, lines[i]);
  FILE *f = fopen(path, "r");
  ASSERT_NOT_NULL(f);
  static char rec[1 << 16];
  size_t n = fread(rec, 1, sizeof rec - 1, f);
  rec[n] = '\0';
  fclose(f);
  ASSERT_STR_CONTAINS(rec, "{\"name\": \"ring\", \"info\": {\"iterations\": "
                           "100, \"burst\": 3000, \"quick\": 1, "
                           "\"message_bytes\": 64");
  ASSERT_STR_CONTAINS(rec, "\"ring\": [");
  for (size_t i = 0; i < sizeof ring_cases / sizeof ring_cases[0]; i++) {
    char want[128];
    snprintf(want, sizeof want, "{\"case\": \"%s\", \"transport\": ",
             ring_cases[i]);
    if (strstr(rec, want) == NULL)
      harness_fail(__FILE__, __LINE__, "record lacks %s:\n%s", want, rec);
  }
  ASSERT_STR_CONTAINS(rec, "\"wake\": \"futex\", \"spin_us\": 0, "
                           "\"one_way_median_us\": ");
  ASSERT_STR_CONTAINS(rec, "\"wake\": \"none\", \"spin_us\": null, ");
  ASSERT_STR_CONTAINS(rec, "\"wake\": \"blocking\", \"spin_us\": 0, ");
  return 0;
}

/* A child that exits, or publishes a ring index far outside the ring, in
 * the middle of a case (spinning, or asleep on each kind of wake) ends the
 * run with exit 1 and the reason, seen when it happens: not the timeout
 * that bounds a silent peer ("no word from"). */
TEST_IMPL(bench_ring_peer_death_and_garbage_end_the_run) {
  static const struct {
    const char *fault, *want;
  } faults[] = {
      {"exit:socket_poll:20", "is gone (the socket hung up)"},
      {"exit:socket_blocking:20", "is gone (the socket hung up)"},
      {"exit:ring_spin:20", "is gone (the socket hung up)"},
      {"exit:ring_futex:20", "is gone (the socket hung up)"},
      {"exit:ring_eventfd:20", "is gone (the socket hung up)"},
      {"exit:ring_sockwake:20", "is gone (the socket hung up)"},
      {"garbage:ring_spin:20", "outside the ring"},
      {"garbage:ring_futex:20", "outside the ring"},
      {"garbage:ring_eventfd:20", "outside the ring"},
      {"garbage:ring_sockwake:20", "outside the ring"},
  };
  for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) {
    const char *args[] = {"bench", "ring",         "--iters",       "50",
                          "--burst", "500", "--test-fault", faults[i].fault,
                          NULL};
    static char out[1 << 16], err[1 << 16];
    int rc = cli(args, out, sizeof out, err, sizeof err);
    if (rc != 1 || strstr(err, faults[i].want) == NULL ||
        strstr(err, "no word from") != NULL ||
        (strncmp(faults[i].fault, "exit", 4) == 0 &&
         strstr(err, "the child exited with status 3") == NULL))
      harness_fail(__FILE__, __LINE__,
                   "--test-fault %s: exit %d (want 1 with \"%s\"), "
                   "stdout:\n%s\nstderr:\n%s",
                   faults[i].fault, rc, faults[i].want, out, err);
  }
  return 0;
}
