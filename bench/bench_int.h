/*
 * bench_int.h: what the benchmarks share among themselves, and only they
 * (tools/ includes bench.h): the checks that end a benchmark on a failed
 * call, and the order statistics every table is made of.
 *
 * A file names itself before it includes this header, and its messages on
 * stderr start with "gpuipc bench NAME: ":
 *
 *   #define BENCH_NAME "handoff"   (any expression of type const char *)
 *   #include "bench_int.h"
 *
 * The checks expand where they are used, so CU needs the driver's types
 * and gpuipc__cuda_error_name (tree.h) there, not here.
 */
#ifndef GPUIPC_BENCH_INT_H
#define GPUIPC_BENCH_INT_H

#include "gpuipc.h"

#include <stdio.h>
#include <stdlib.h>

/* Run by DIE before it exits (sets.c says there how its consumer ended). */
#ifndef BENCH_AT_DIE
#define BENCH_AT_DIE() ((void)0)
#endif

/* One line on stderr: "gpuipc bench NAME: " and the message. */
#define BENCH_SAY(...)                                                         \
  do {                                                                         \
    fprintf(stderr, "gpuipc bench %s: ", BENCH_NAME);                          \
    fprintf(stderr, __VA_ARGS__);                                              \
    fprintf(stderr, "\n");                                                     \
  } while (0)

/* DIE: the line with the library's last error, then exit(1): a benchmark's
 * processes give up whole, and the parent sees its child's exit status.
 * OK / CU: a gpuipc call / a driver call that must succeed. */
#define DIE(...)                                                               \
  do {                                                                         \
    fprintf(stderr, "gpuipc bench %s: ", BENCH_NAME);                          \
    fprintf(stderr, __VA_ARGS__);                                              \
    fprintf(stderr, " (%s)\n", gpuipc_last_error());                           \
    BENCH_AT_DIE();                                                            \
    exit(1);                                                                   \
  } while (0)
#define OK(expr)                                                               \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK)                                                       \
      DIE("%s: %s", #expr, gpuipc_strerror(s_));                               \
  } while (0)
#define CU(expr)                                                               \
  do {                                                                         \
    CUresult r_ = (expr);                                                      \
    if (r_ != CUDA_SUCCESS)                                                    \
      DIE("%s: %s", #expr, gpuipc__cuda_error_name(r_));                       \
  } while (0)

/* OK_OR / CU_OR: the same checks where the function unwinds instead of
 * exiting: the line (the call, and the last error or the driver's), then
 * `then` (return -1; goto out). */
#define OK_OR(expr, then)                                                      \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK) {                                                     \
      BENCH_SAY("%s: %s", #expr, gpuipc_last_error());                         \
      then;                                                                    \
    }                                                                          \
  } while (0)
#define CU_OR(expr, then)                                                      \
  do {                                                                         \
    CUresult r_ = (expr);                                                      \
    if (r_ != CUDA_SUCCESS) {                                                  \
      BENCH_SAY("%s: %s", #expr, gpuipc__cuda_error_name(r_));                 \
      then;                                                                    \
    }                                                                          \
  } while (0)

static inline int bench_cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return a < b ? -1 : a > b;
}

/* The p-quantile of v[0..n): the element at p*(n-1), rounded to the
 * nearest; 0 when there is none. Sorts v in place. */
static inline double bench_pct(double *v, long n, double p) {
  if (n <= 0)
    return 0;
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
  return v[(size_t)(p * (double)(n - 1) + 0.5)];
}

/* The median of v[0..n): the middle element, or the mean of the middle two
 * when n is even; 0 when there is none. Sorts v in place. */
static inline double bench_median(double *v, long n) {
  if (n <= 0)
    return 0;
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#endif
