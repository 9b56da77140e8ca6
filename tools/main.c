/*
 * main.c: the gpuipc command's entry point: dispatches to a subcommand.
 */
#include "cli.h"
#include "gpuipc.h"

#include <stdio.h>
#include <string.h>

static void usage(FILE *f) {
  fprintf(f,
          "usage: gpuipc <command> [options]\n"
          "\n"
          "commands:\n"
          "  doctor [--json] [--quiet]   can this machine share GPU memory "
          "between processes, and how\n"
          "  demo                        two processes sharing GPU memory\n"
          "  bench <what>                benchmarks (gpuipc bench --help)\n"
          "  version                     print the version\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "doctor") == 0)
    return gpuipc_cmd_doctor(argc - 1, argv + 1);
  if (strcmp(cmd, "demo") == 0)
    return gpuipc_cmd_demo(argc - 1, argv + 1);
  if (strcmp(cmd, "bench") == 0)
    return gpuipc_cmd_bench(argc - 1, argv + 1);
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
    printf("gpuipc %s\n", gpuipc_version_string());
    return 0;
  }
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 ||
      strcmp(cmd, "-h") == 0) {
    usage(stdout);
    return 0;
  }
  fprintf(stderr, "gpuipc: unknown command '%s'\n", cmd);
  usage(stderr);
  return 2;
}
