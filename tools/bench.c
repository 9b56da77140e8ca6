/*
 * bench.c: `gpuipc bench <what>`: dispatches to the benchmarks under bench/.
 */
#include "bench.h"
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* `gpuipc bench mpi`: the MPI benchmark is a program of its own,
 * gpuipc-bench-mpi (built where MPI was found; this command never links
 * MPI), run here under mpirun with two ranks: the one beside this program
 * (a build without MPI says so); mpirun from $GPUIPC_MPIRUN or PATH. */
/* Replays the records gpuipc-bench-mpi wrote ("info\tnum|str\tkey\tvalue",
 * "row\ttable", "num|str\tkey\tvalue", "end") into the JSON report. */
static void replay_rows(const char *path) {
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return;
  char line[512];
  bool in_row = false;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    char *f1 = line, *f2 = strchr(f1, '\t');
    if (f2)
      *f2++ = '\0';
    if (strcmp(f1, "end") == 0) {
      if (in_row)
        gpuipc_bench_json_row_end();
      in_row = false;
      continue;
    }
    if (f2 == NULL)
      continue;
    if (strcmp(f1, "row") == 0) {
      if (in_row)
        gpuipc_bench_json_row_end();
      gpuipc_bench_json_row_begin(f2);
      in_row = true;
      continue;
    }
    if (strcmp(f1, "info") == 0) {
      if (in_row) /* info belongs outside rows */
        continue;
      f1 = f2;
      f2 = strchr(f1, '\t');
      if (f2 == NULL)
        continue;
      *f2++ = '\0';
    }
    char *val = strchr(f2, '\t');
    if (val == NULL)
      continue;
    *val++ = '\0';
    if (strcmp(f1, "num") == 0)
      gpuipc_bench_json_num(f2, strtod(val, NULL));
    else if (strcmp(f1, "str") == 0)
      gpuipc_bench_json_str(f2, val);
  }
  if (in_row)
    gpuipc_bench_json_row_end();
  fclose(f);
}

static int bench_mpi(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      printf("usage: gpuipc bench mpi [--quick] [--iters N] [--max-mib N]\n"
             "  runs gpuipc-bench-mpi under mpirun with 2 ranks: node-local\n"
             "  gpuipc_mpi_send/recv against MPI's host-memory transfer of the\n"
             "  same bytes, and the staged path of ranks on other machines\n"
             "  (GPUIPC_MPI_SIMULATE_MACHINES) against a plain copy and a\n"
             "  plain MPI transfer. mpirun: $GPUIPC_MPIRUN, else PATH.\n");
      return 0;
    }
  /* The MPI program lives beside this command (the build folder, or the
   * installed bin/); without it, say why rather than leave mpirun to say
   * that it cannot find an executable. */
  char self[PATH_MAX], bench[PATH_MAX + 32];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  bool found = false;
  if (n > 0) {
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) {
      *slash = '\0';
      snprintf(bench, sizeof bench, "%s/gpuipc-bench-mpi", self);
      found = access(bench, X_OK) == 0;
    }
  }
  if (!found) {
    fprintf(stderr,
            "gpuipc bench mpi: gpuipc-bench-mpi was not built: the build "
            "found no MPI\n  (CMake's find_package(MPI) when the build was "
            "configured; it prints \"gpuipc: MPI found\"\n  when it finds "
            "one). Install an MPI with its compiler wrapper (Debian: "
            "libopenmpi-dev)\n  and configure again.\n");
    return 1;
  }
  const char *mpirun = getenv("GPUIPC_MPIRUN");
  if (mpirun == NULL || *mpirun == '\0')
    mpirun = "mpirun";
  char **args = calloc((size_t)argc + 8, sizeof *args);
  if (args == NULL)
    return 1;
  int k = 0;
  args[k++] = (char *)mpirun;
  args[k++] = "-n";
  args[k++] = "2";
  if (getuid() == 0) { /* Open MPI refuses root without being told */
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  args[k++] = bench;
  for (int i = 1; i < argc; i++)
    args[k++] = argv[i];
  /* The figures come back as records in a file (see bench-mpi.c). */
  char rows[] = "/tmp/gpuipc-bench-mpi-XXXXXX";
  int rfd = mkstemp(rows);
  if (rfd >= 0)
    close(rfd);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    if (rfd >= 0)
      setenv("GPUIPC_BENCH_ROWS", rows, 1);
    execvp(args[0], args);
    fprintf(stderr, "gpuipc bench mpi: cannot run %s (%s): install MPI, or "
                    "set GPUIPC_MPIRUN; the benchmark is %s\n",
            args[0], strerror(errno), bench);
    _exit(127);
  }
  free(args);
  int st = 0;
  int rc = 1;
  if (pid >= 0 && waitpid(pid, &st, 0) == pid)
    rc = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
  if (rfd >= 0) {
    replay_rows(rows);
    unlink(rows);
  }
  return rc;
}

static const struct {
  const char *name;
  int (*fn)(int, char **);
  const char *what;
} benches[] = {
    {"handle", gpuipc_bench_handle,
     "export/import per buffer for each pool kind vs the raw driver"},
    {"handoff", gpuipc_bench_handoff,
     "per-buffer handoff latency and throughput over a connection"},
    {"copy", gpuipc_bench_copy, "pipelined host<->device copies"},
    {"sets", gpuipc_bench_sets,
     "tensor sets: 7B weight sync and KV blocks, producer -> consumer process"},
    {"ring", gpuipc_bench_ring,
     "64-byte messages: the transport's socket vs a shared-memory ring (no GPU)"},
    {"mpi", bench_mpi,
     "gpuipc_mpi_send/recv vs MPI (runs gpuipc-bench-mpi under mpirun)"},
};

static void usage(FILE *f) {
  fprintf(f, "usage: gpuipc bench <what> [options] [--json FILE] "
             "[--emulator PATH]\n");
  for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++)
    fprintf(f, "  %-8s %s\n", benches[i].name, benches[i].what);
  fprintf(f, "  %-8s every one of them\n"
             "  --json FILE      also write every figure, with the machine, "
             "driver, GPUs and\n"
             "                   command line, to FILE (bench/plot.py draws "
             "it)\n"
             "  --emulator PATH  the CUDA driver emulator, when no GPU driver "
             "is usable\n"
             "gpuipc bench <what> --help: the options of one benchmark\n",
          "all");
}

int gpuipc_cmd_bench(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    usage(stdout);
    return 0;
  }
  /* The command line as typed, for the record, before options are taken
   * out of argv. */
  int argc0 = argc;
  char **argv0 = calloc((size_t)argc + 1, sizeof *argv0);
  if (argv0 == NULL)
    return 1;
  for (int i = 0; i < argc; i++)
    argv0[i] = argv[i];
  /* A benchmark's --help needs no driver. */
  bool help = false;
  for (int i = 2; i < argc; i++)
    help |= strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0;
  if (gpuipc_bench_json_take(&argc, argv) < 0) {
    usage(stderr);
    free(argv0);
    return 2;
  }
  /* Choose the driver once, here: "bench all" hands the same argv to each
   * benchmark, and each would otherwise remove --emulator from it again. */
  int emu = help ? 0 : gpuipc_bench_pick_driver(&argc, argv, "bench");
  if (emu < 0) {
    free(argv0);
    return 2;
  }
  gpuipc_bench_json_emulated(emu);
  int rc = 0;
  bool all = strcmp(argv[1], "all") == 0;
  if (all && help) { /* every benchmark's options: each one's --help */
    usage(stdout);
    free(argv0);
    return 0;
  }
  bool found = false;
  for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++) {
    /* "all" runs the in-process benchmarks; mpi needs mpirun and ranks. */
    if ((all && benches[i].fn != bench_mpi) ||
        strcmp(argv[1], benches[i].name) == 0) {
      found = true;
      gpuipc_bench_json_begin(benches[i].name);
      int r = benches[i].fn(argc - 1, argv + 1);
      if (r != 0)
        rc = r;
      if (help)
        break;
    }
  }
  if (!found) {
    fprintf(stderr, "gpuipc bench: unknown benchmark '%s'\n", argv[1]);
    usage(stderr);
    free(argv0);
    return 2;
  }
  /* Children of a benchmark (its re-executed consumers) never see --json:
   * only the run that was asked for writes the file. */
  if (!help && gpuipc_bench_json_write(argc0, argv0, rc) != 0 &&
      rc == 0)
    rc = 1;
  free(argv0);
  return rc;
}
