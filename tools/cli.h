/*
 * cli.h: the subcommands of the gpuipc command, one file each.
 */
#ifndef GPUIPC_CLI_H
#define GPUIPC_CLI_H

int gpuipc_cmd_doctor(int argc, char **argv);
int gpuipc_cmd_demo(int argc, char **argv);
int gpuipc_cmd_bench(int argc, char **argv);
int gpuipc_cmd_ls(int argc, char **argv);  /* tools/ls.c */
int gpuipc_cmd_top(int argc, char **argv); /* tools/ls.c */

/* Benchmarks, one file each under bench/; each parses its own options. */
int gpuipc_bench_copy(int argc, char **argv);    /* bench/copy.c */
int gpuipc_bench_handoff(int argc, char **argv); /* bench/handoff.c */
int gpuipc_bench_handle(int argc, char **argv);  /* bench/handle.c */
int gpuipc_bench_sets(int argc, char **argv);    /* bench/sets.c */
int gpuipc_bench_ring(int argc, char **argv);    /* bench/ring.c */

/* The --json FILE record of a benchmark run (bench/report.c). take removes
 * "--json FILE" from argv (-1: no file named); the benchmarks call begin
 * once, then row_begin, str/num..., row_end per printed row (str/num
 * outside a row describe the benchmark itself); write saves the file
 * (argv: the command line as typed; rc: the run's exit status) and
 * returns 1 when it could not. All do nothing without --json. */
int gpuipc_bench_json_take(int *argc, char **argv);
void gpuipc_bench_json_emulated(int emulated);
void gpuipc_bench_json_begin(const char *bench);
void gpuipc_bench_json_row_begin(const char *table);
void gpuipc_bench_json_row_end(void);
void gpuipc_bench_json_str(const char *key, const char *val);
void gpuipc_bench_json_num(const char *key, double val);
int gpuipc_bench_json_write(int argc, char **argv, int rc);

/* If argv holds "--emulator PATH" and no GPU driver is usable, sets
 * GPUIPC_CUDA_DRIVER=PATH and prints a line saying the emulator is in use.
 * Removes the option from argv. Returns 1 when the emulator was chosen,
 * 0 when the real driver is used. */
int gpuipc_cli_pick_driver(int *argc, char **argv, const char *what);

#endif
