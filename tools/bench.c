/*
 * bench.c: `gpuipc bench <what>`: dispatches to the benchmarks under bench/.
 */
#include "cli.h"

#include <stdio.h>
#include <stdbool.h>
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

int gpuipc_cmd_bench(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0) {
    fprintf(argc < 2 ? stderr : stdout,
            "usage: gpuipc bench <what> [options] [--emulator PATH]\n");
    for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++)
      fprintf(argc < 2 ? stderr : stdout, "  %-8s %s\n", benches[i].name,
              benches[i].what);
    fprintf(argc < 2 ? stderr : stdout, "  %-8s every one of them\n", "all");
    return argc < 2 ? 2 : 0;
  }
  /* Choose the driver once, here: "bench all" hands the same argv to each
   * benchmark, and each would otherwise remove --emulator from it again. */
  if (gpuipc_cli_pick_driver(&argc, argv, "bench") < 0)
    return 2;
  int rc = 0;
  bool all = strcmp(argv[1], "all") == 0;
  bool found = false;
  for (size_t i = 0; i < sizeof benches / sizeof benches[0]; i++) {
    if (all || strcmp(argv[1], benches[i].name) == 0) {
      found = true;
      int r = benches[i].fn(argc - 1, argv + 1);
      if (r != 0)
        rc = r;
    }
  }
  if (!found) {
    fprintf(stderr, "gpuipc bench: unknown benchmark '%s'\n", argv[1]);
    return 2;
  }
  return rc;
}
