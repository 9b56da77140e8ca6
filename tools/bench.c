/*
 * bench.c: `gpuipc bench`: dispatches to the benchmarks under bench/.
 */
#include "cli.h"

#include <stdio.h>

int gpuipc_cmd_bench(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "gpuipc bench: no benchmarks are built yet\n");
  return 2;
}
