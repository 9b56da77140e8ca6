/*
 * cli.h: the subcommands of the gpuipc command, one file each.
 */
#ifndef GPUIPC_CLI_H
#define GPUIPC_CLI_H

int gpuipc_cmd_doctor(int argc, char **argv);
int gpuipc_cmd_demo(int argc, char **argv);
int gpuipc_cmd_bench(int argc, char **argv);

/* Benchmarks, one file each under bench/; each parses its own options. */
int gpuipc_bench_copy(int argc, char **argv);    /* bench/copy.c */
int gpuipc_bench_handoff(int argc, char **argv); /* bench/handoff.c */
int gpuipc_bench_handle(int argc, char **argv);  /* bench/handle.c */
int gpuipc_bench_sets(int argc, char **argv);    /* bench/sets.c */

/* If argv holds "--emulator PATH" and no GPU driver is usable, sets
 * GPUIPC_CUDA_DRIVER=PATH and prints a line saying the emulator is in use.
 * Removes the option from argv. Returns 1 when the emulator was chosen,
 * 0 when the real driver is used. */
int gpuipc_cli_pick_driver(int *argc, char **argv, const char *what);

#endif
