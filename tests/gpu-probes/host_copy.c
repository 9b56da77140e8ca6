/*
 * host_copy.c: what bounds a staged pageable -> device copy on the host?
 * Measures memcpy from a pageable buffer into pinned staging with 1..16
 * threads (cached and streaming stores), the same from a buffer never
 * touched (first-touch faults), and the same while the copy engine's DMA
 * reads pinned memory at full speed (memory-bandwidth contention).
 * Not part of the build; on a machine with a GPU:
 *
 *   gcc -O2 -pthread -I/usr/local/cuda/include -o /tmp/host_copy \
 *       tests/gpu-probes/host_copy.c -lcuda
 *   /tmp/host_copy
 */
#include <cuda.h>
#include <emmintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#define CK(x) do { CUresult r_ = (x); if (r_) { printf("%s -> %d\n", #x, r_); exit(2);} } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
struct job { char *dst; const char *src; size_t n; int nt; };
static void nt_copy(char *d, const char *s, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a); _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c); _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  _mm_sfence();
  memcpy(d + i, s + i, n - i);
}
static void *worker(void *p) { struct job *j = p; if (j->nt) nt_copy(j->dst, j->src, j->n); else memcpy(j->dst, j->src, j->n); return NULL; }
/* one copy of n bytes split over t threads (fresh threads each time: the
 * figure is an upper bound of what a pool reaches) */
static double par_copy(char *dst, const char *src, size_t n, int t, int nt) {
  pthread_t th[64]; struct job j[64]; size_t part = n / t / 64 * 64;
  double t0 = now();
  for (int i = 0; i < t; i++) { j[i] = (struct job){dst + i * part, src + i * part, i == t - 1 ? n - i * part : part, nt}; pthread_create(&th[i], 0, worker, &j[i]); }
  for (int i = 0; i < t; i++) pthread_join(th[i], 0);
  return n / (now() - t0) / 1e9;
}
static volatile int dma_run;
static CUcontext ctx;
static void *dma(void *p) {
  CK(cuCtxSetCurrent(ctx)); CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  size_t n = 256u << 20; void *h; CUdeviceptr d; CK(cuMemHostAlloc(&h, n, 0)); CK(cuMemAlloc(&d, n)); memset(h, 1, n);
  double t0 = now(); size_t moved = 0;
  while (dma_run) { CK(cuMemcpyHtoDAsync(d, h, n, s)); CK(cuStreamSynchronize(s)); moved += n; }
  *(double *)p = moved / (now() - t0) / 1e9;
  return NULL;
}
int main(void) {
  CUdevice dev; CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  size_t n = 512u << 20;
  char *src = malloc(n); memset(src, 3, n);
  void *pin, *pinwc; CK(cuMemHostAlloc(&pin, n, 0)); CK(cuMemHostAlloc(&pinwc, n, CU_MEMHOSTALLOC_WRITECOMBINED));
  memset(pin, 0, n); memset(pinwc, 0, n);
  char *pag = malloc(n); memset(pag, 0, n);
  printf("CPUs online %ld; 512 MiB per copy, best of 5, GB/s\n", sysconf(_SC_NPROCESSORS_ONLN));
  int ts[] = {1, 2, 4, 8, 12, 16};
  const char *nm[] = {"pageable->pinned memcpy", "pageable->pinned stream", "pageable->pinnedWC memcpy", "pinned->pageable memcpy", "pinned->pageable stream", "pageable->pageable memcpy"};
  for (int c = 0; c < 6; c++) {
    printf("%-28s", nm[c]);
    for (int k = 0; k < 6; k++) {
      double best = 0;
      for (int r = 0; r < 5; r++) {
        double g = c == 0 ? par_copy(pin, src, n, ts[k], 0) : c == 1 ? par_copy(pin, src, n, ts[k], 1)
                 : c == 2 ? par_copy(pinwc, src, n, ts[k], 0) : c == 3 ? par_copy(pag, pin, n, ts[k], 0)
                 : c == 4 ? par_copy(pag, pin, n, ts[k], 1) : par_copy(pag, src, n, ts[k], 0);
        if (g > best) best = g;
      }
      printf("  t%-2d %6.1f", ts[k], best);
    }
    printf("\n"); fflush(stdout);
  }
  /* first touch: a fresh mapping each time */
  printf("%-28s", "untouched src->pinned");
  for (int k = 0; k < 6; k++) {
    char *f = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    printf("  t%-2d %6.1f", ts[k], par_copy(pin, f, n, ts[k], 0)); munmap(f, n);
  }
  printf("\n");
  printf("%-28s", "src->untouched pageable");
  for (int k = 0; k < 6; k++) {
    char *f = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    printf("  t%-2d %6.1f", ts[k], par_copy(f, pin, n, ts[k], 0)); munmap(f, n);
  }
  printf("\n");
  /* contention: a full-speed H2D DMA from other pinned memory meanwhile */
  double dgb = 0; dma_run = 1; pthread_t dt; pthread_create(&dt, 0, dma, &dgb); usleep(300000);
  printf("%-28s", "pageable->pinned during DMA");
  for (int k = 0; k < 6; k++) { double best = 0; for (int r = 0; r < 5; r++) { double g = par_copy(pin, src, n, ts[k], 0); if (g > best) best = g; } printf("  t%-2d %6.1f", ts[k], best); }
  printf("\n");
  dma_run = 0; pthread_join(dt, 0); printf("  (the DMA meanwhile: %.1f GB/s)\n", dgb);
  /* small parts: per-part cost of the split (1 MiB jobs) */
  printf("%-28s", "1 MiB job, pageable->pinned");
  for (int k = 0; k < 6; k++) { double best = 0; for (int r = 0; r < 50; r++) { double g = par_copy(pin, src, 1u << 20, ts[k], 0); if (g > best) best = g; } printf("  t%-2d %6.1f", ts[k], best); }
  printf("\n");
  /* the driver's own pageable copy: synchronous cuMemcpyHtoD against the
   * async call on a non-blocking stream then a synchronize (median of 21) */
  {
    CUstream st; CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING)); CUdeviceptr d; CK(cuMemAlloc(&d, 64u << 20));
    for (size_t sz = 1u << 20; sz <= (64u << 20); sz *= 4) {
      double a[21], b[21], c2[21];
      for (int r = 0; r < 21; r++) {
        double t0 = now(); CK(cuMemcpyHtoD(d, src, sz)); a[r] = now() - t0;
        t0 = now(); CK(cuMemcpyHtoDAsync(d, src, sz, st)); CK(cuStreamSynchronize(st)); b[r] = now() - t0;
        t0 = now(); CK(cuMemcpyHtoDAsync(d, src, sz, st)); c2[r] = now() - t0; CK(cuStreamSynchronize(st));
      }
      int cmp(const void *x, const void *y) { double u = *(const double *)x, v = *(const double *)y; return (u > v) - (u < v); }
      qsort(a, 21, sizeof *a, cmp); qsort(b, 21, sizeof *b, cmp); qsort(c2, 21, sizeof *c2, cmp);
      printf("H2D pageable %5zu KiB: cuMemcpyHtoD %6.2f GB/s, async+sync %6.2f GB/s (the async call returns after %.1f us of %.1f)\n",
             sz >> 10, sz / a[10] / 1e9, sz / b[10] / 1e9, c2[10] * 1e6, b[10] * 1e6);
    }
  }
  return 0;
}
