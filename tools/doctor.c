/* doctor.c: placeholder until the doctor lands. */
#include "cli.h"
#include <stdio.h>
int gpuipc_cmd_doctor(int argc, char **argv) {
  (void)argc;
  (void)argv;
  return 2;
}
