/*
 * demo.c: `gpuipc demo`: until the connection layer lands, runs doctor.
 */
#include "cli.h"
#include <stddef.h>

int gpuipc_cmd_demo(int argc, char **argv) {
  char *args[] = {"doctor", NULL};
  (void)argc;
  (void)argv;
  return gpuipc_cmd_doctor(1, args);
}
