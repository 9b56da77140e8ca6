/*
 * bench.h: what bench/ offers the gpuipc command (tools/): the benchmarks'
 * entry points, the --json record of a run (report.c) and the choice
 * between the real driver and the emulator (pick.c, which `gpuipc demo`
 * uses too). bench/ is the lower of the two folders: its files include
 * nothing of tools/ and call nothing defined there; tools/ reaches bench/
 * through this header only (tools/check-layers and tools/check-calls fail
 * otherwise).
 */
#ifndef GPUIPC_BENCH_H
#define GPUIPC_BENCH_H

/* Benchmarks, one file each; each parses its own options. */
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
 * 0 when the real driver is used, -1 when neither is there. */
int gpuipc_bench_pick_driver(int *argc, char **argv, const char *what);

#endif
