/*
 * bench.c: `gpuipc bench <what>`: dispatches to the benchmarks under bench/.
 */
#include "cli.h"

#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

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
  int emu = help ? 0 : gpuipc_cli_pick_driver(&argc, argv, "bench");
  if (emu < 0) {
    free(argv0);
    return 2;
  }
  gpuipc_bench_json_emulated(emu);
  int rc = 0;
  bool all = strcmp(argv[1], "all") == 0;
  bool found = false;
  for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++) {
    if (all || strcmp(argv[1], benches[i].name) == 0) {
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
