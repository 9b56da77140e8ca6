/*
 * cli.h: the subcommands of the gpuipc command, one file each.
 */
#ifndef GPUIPC_CLI_H
#define GPUIPC_CLI_H

int gpuipc_cmd_doctor(int argc, char **argv);
int gpuipc_cmd_demo(int argc, char **argv);
int gpuipc_cmd_bench(int argc, char **argv);

#endif
