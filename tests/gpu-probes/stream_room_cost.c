/*
 * stream_room_cost.c: what making room for N streams costs a context (the
 * device memory cuMemGetInfo sees go, and the time), with the streams
 * destroyed again (gpuipc's stream room) and kept. Each N in a fresh child
 * process; run alone on the GPU (cuMemGetInfo sees every process).
 *
 *   gcc -O1 -I/usr/local/cuda/include -o /tmp/stream_room_cost \
 *       tests/gpu-probes/stream_room_cost.c -lcuda
 *   /tmp/stream_room_cost
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#define CK(x) do { CUresult r_ = (x); if (r_) { printf("%s -> %d\n", #x, r_); _exit(2);} } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
  int ns[] = {0, 32, 64, 128, 256, 512};
  for (int keep = 0; keep < 2; keep++)
    for (unsigned k = 0; k < sizeof ns / sizeof *ns; k++) {
      pid_t p = fork();
      if (p == 0) {
        CUcontext c; CUdevice d; size_t f0, f1, f2, tot;
        CK(cuInit(0)); CK(cuDeviceGet(&d, 0));
        CK(cuDevicePrimaryCtxRetain(&c, d)); CK(cuCtxSetCurrent(c));
        CK(cuMemGetInfo(&f0, &tot));
        CUstream *s = calloc(ns[k] + 1, sizeof *s);
        double t0 = now();
        for (int i = 0; i < ns[k]; i++) CK(cuStreamCreate(&s[i], CU_STREAM_NON_BLOCKING));
        CK(cuMemGetInfo(&f1, &tot));
        if (!keep) for (int i = 0; i < ns[k]; i++) CK(cuStreamDestroy(s[i]));
        double t1 = now();
        CK(cuCtxSynchronize());
        CK(cuMemGetInfo(&f2, &tot));
        printf("%s %4d streams: %7.2f ms; device memory at the peak %+8.1f MiB, after %+8.1f MiB\n",
               keep ? "kept     " : "destroyed", ns[k], (t1 - t0) * 1e3,
               -((double)f1 - (double)f0) / 1048576, -((double)f2 - (double)f0) / 1048576);
        fflush(stdout);
        _exit(0);
      }
      int st; waitpid(p, &st, 0);
    }
  return 0;
}
