/*
 * gather.h: the parameter of the gather copy kernel (gather.cu), shared by
 * the kernel, the host code that launches it (copy.c) and the benchmark.
 * Plain C, read by nvcc as well.
 *
 * The whole struct is the kernel's one parameter, passed by value: CUDA
 * 12.1 and later take up to 32,764 bytes of kernel parameters on sm_70 and
 * newer, and the driver copies them at the launch, so the host's copy need
 * not outlive cuLaunchKernel and nothing waits on the host.
 */
#ifndef GPUIPC_SETS_GATHER_H
#define GPUIPC_SETS_GATHER_H

#include <stdint.h>

/* Entries per launch: 8 + 1360 * 24 = 32,648 bytes, under 32,764. */
#define GPUIPC__GATHER_N 1360
/* Only ranges shorter than this go to the kernel (longer ones: the
 * driver's copies, which are at the bandwidth bound there). */
#define GPUIPC__GATHER_LEN_MAX ((uint64_t)1 << 20)
/* Threads per block, and the most blocks one entry is split over
 * (grid.y), each slice at least GPUIPC__GATHER_SLICE bytes. */
#define GPUIPC__GATHER_THREADS 256
#define GPUIPC__GATHER_SPLIT_MAX 64
#define GPUIPC__GATHER_SLICE ((uint64_t)64 << 10)
/* The kernel's name in the image. */
#define GPUIPC__GATHER_NAME "gpuipc_gather"

typedef struct gpuipc__gather_entry {
  uint64_t src, dst, len;
} gpuipc__gather_entry;

typedef struct gpuipc__gather_args {
  uint64_t n; /* entries used, 1..GPUIPC__GATHER_N; grid.x == n */
  gpuipc__gather_entry e[GPUIPC__GATHER_N];
} gpuipc__gather_args;

#endif
