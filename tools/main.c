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
          "  ls [--json]                 every gpuipc process of this user: "
          "what it shares, with whom\n"
          "  top [--interval S]          the same, refreshed\n"
          "  bench <what>                benchmarks (gpuipc bench --help)\n"
          "  version                     print the version (also --version)\n"
          "\n"
          "gpuipc <command> --help describes each; see also gpuipc(1).\n");
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
  if (strcmp(cmd, "ls") == 0)
    return gpuipc_cmd_ls(argc - 1, argv + 1);
  if (strcmp(cmd, "top") == 0)
    return gpuipc_cmd_top(argc - 1, argv + 1);
  if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0 ||
      strcmp(cmd, "-V") == 0) {
    if (argc > 2 &&
        (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0)) {
      printf("usage: gpuipc version\n\n  prints the version of gpuipc\n");
      return 0;
    }
    if (argc > 2) {
      fprintf(stderr, "gpuipc version: unknown option '%s'\n"
                      "usage: gpuipc version\n", argv[2]);
      return 2;
    }
    printf("gpuipc %s\n", gpuipc_version_string());
    return 0;
  }
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 ||
      strcmp(cmd, "-h") == 0) {
    usage(stdout);
    return 0;
  }
  if (cmd[0] == '-')
    fprintf(stderr, "gpuipc: unknown option '%s'\n", cmd);
  else
    fprintf(stderr, "gpuipc: unknown command '%s'\n", cmd);
  usage(stderr);
  return 2;
}
