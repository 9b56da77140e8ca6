/*
 * cli.h: the subcommands of the gpuipc command, one file each.
 */
#ifndef GPUIPC_CLI_H
#define GPUIPC_CLI_H

#include <stdio.h>

int gpuipc_cmd_doctor(int argc, char **argv);
int gpuipc_cmd_demo(int argc, char **argv);
int gpuipc_cmd_bench(int argc, char **argv);
int gpuipc_cmd_ls(int argc, char **argv);  /* tools/ls.c */
int gpuipc_cmd_top(int argc, char **argv); /* tools/ls.c */

/* Writes "usage: gpuipc NAME SYNOPSIS\n" from the one table of commands
 * (tools/main.c), which `gpuipc --help` lists too, so that a command's own
 * --help and the list cannot say different things; tools/check-man checks
 * the man page against both. */
void gpuipc_cli_usage_line(FILE *f, const char *name);

/* The benchmarks, their --json record and the driver choice that bench and
 * demo share are declared in bench/bench.h: bench/ is below tools/. */

#endif
