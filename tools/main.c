/*
 * main.c: the gpuipc command's entry point: dispatches to a subcommand.
 */
#include "cli.h"
#include "gpuipc.h"

#include <stdio.h>
#include <string.h>

static int cmd_version(int argc, char **argv);

/* The commands: what dispatches, what `gpuipc --help` lists and the first
 * line of each command's own --help, from one place. */
static const struct {
  const char *name;
  int (*fn)(int, char **);
  const char *synopsis;
  const char *what;
} cmds[] = {
    {"doctor", gpuipc_cmd_doctor, "[--json] [--quiet]",
     "can this machine share GPU memory between processes, and how"},
    {"demo", gpuipc_cmd_demo, "[--emulator PATH]",
     "two processes sharing GPU memory"},
    {"ls", gpuipc_cmd_ls, "[--json]",
     "every gpuipc process of this user: what it shares, with whom"},
    {"top", gpuipc_cmd_top, "[--interval S] [--count N]", "the same, refreshed"},
    {"bench", gpuipc_cmd_bench, "<what> [options]",
     "benchmarks (gpuipc bench --help)"},
    {"version", cmd_version, "", "print the version (also --version)"},
};

void gpuipc_cli_usage_line(FILE *f, const char *name) {
  for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
    if (strcmp(cmds[i].name, name) == 0) {
      fprintf(f, "usage: gpuipc %s%s%s\n", name, *cmds[i].synopsis ? " " : "",
              cmds[i].synopsis);
      return;
    }
  fprintf(f, "usage: gpuipc %s\n", name);
}

static void usage(FILE *f) {
  fprintf(f, "usage: gpuipc <command> [options]\n\ncommands:\n");
  for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
    char head[64];
    snprintf(head, sizeof head, "%s %s", cmds[i].name, cmds[i].synopsis);
    fprintf(f, "  %-32s %s\n", head, cmds[i].what);
  }
  fprintf(f, "\ngpuipc <command> --help describes each; see also gpuipc(1).\n");
}

static int cmd_version(int argc, char **argv) {
  if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    gpuipc_cli_usage_line(stdout, "version");
    printf("\n  prints the version of gpuipc\n");
    return 0;
  }
  if (argc > 1) {
    fprintf(stderr, "gpuipc version: unknown option '%s'\n", argv[1]);
    gpuipc_cli_usage_line(stderr, "version");
    return 2;
  }
  printf("gpuipc %s\n", gpuipc_version_string());
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "-V") == 0)
    return cmd_version(argc - 1, argv + 1);
  for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
    if (strcmp(cmd, cmds[i].name) == 0)
      return cmds[i].fn(argc - 1, argv + 1);
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
