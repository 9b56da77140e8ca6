/* copy.c: placeholder until this benchmark lands. */
#include "cli.h"

#include <stdio.h>

int gpuipc_bench_copy(int argc, char **argv) {
  (void)argc;
  (void)argv;
  fprintf(stderr, "gpuipc bench copy: not built yet\n");
  return 2;
}
