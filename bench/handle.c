/* handle.c: placeholder until this benchmark lands. */
#include "cli.h"

#include <stdio.h>

int gpuipc_bench_handle(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "gpuipc bench handle: not built yet\n");
  return 2;
}
