/*
 * stream_gate.c: which driver calls wait behind a stream that is blocked on
 * a host-signalled cuStreamWaitValue32 (the "gate" of gpuipc bench
 * handoff's ordered rows)? Each step named on the command line runs in a
 * fresh child with the gate closed and a 4 s alarm; a step that does not
 * return is reported HUNG. EXTRA=N creates N more streams between the
 * gated one and the one the step uses (to find hardware-queue sharing).
 * Not part of the build; on a machine with a GPU:
 *
 *   gcc -O1 -I/usr/local/cuda/include -o /tmp/stream_gate \
 *       tests/gpu-probes/stream_gate.c -lcuda
 *   /tmp/stream_gate query memset_sync_other memalloc vmm pool streamcreate
 *   /tmp/stream_gate streamcount prewarm prekeep eventcreate hostalloc
 *
 * streamcount creates streams one at a time and prints each count (the
 * last printed is where creation waits); prewarm creates and destroys 256
 * streams before the gate closes, prekeep creates 256 and keeps them; both
 * then create 128 behind the gate.
 */
#include <cuda.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#define CK(x) do { CUresult r_ = (x); if (r_) { printf("  %s -> %d\n", #x, r_); fflush(stdout); _exit(2);} } while (0)
static void step(const char *name) {
  CUcontext ctx; CUdevice dev;
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUstream pre[256];
  if (!strcmp(name, "prewarm") || !strcmp(name, "prekeep")) {
    for (int i = 0; i < 256; i++) CK(cuStreamCreate(&pre[i], CU_STREAM_NON_BLOCKING));
    if (!strcmp(name, "prewarm")) for (int i = 0; i < 256; i++) CK(cuStreamDestroy(pre[i]));
  }
  CUstream s, o; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  int nextra = atoi(getenv("EXTRA") ? getenv("EXTRA") : "0");
  for (int i = 0; i < nextra; i++) { CUstream x; CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING)); }
  CK(cuStreamCreate(&o, CU_STREAM_NON_BLOCKING));
  unsigned *h; CUdeviceptr hd; CK(cuMemHostAlloc((void **)&h, 4096, CU_MEMHOSTALLOC_DEVICEMAP)); *h = 0;
  CK(cuMemHostGetDevicePointer(&hd, h, 0));
  CK(cuStreamWaitValue32(s, hd, 1, CU_STREAM_WAIT_VALUE_GEQ)); /* the gate */
  alarm(4);
  if (!strcmp(name, "memset_sync_other")) { CUdeviceptr p; CK(cuMemAlloc(&p, 1 << 20)); CK(cuMemsetD32Async(p, 0, 1 << 18, o)); CK(cuStreamSynchronize(o)); }
  else if (!strcmp(name, "memalloc")) { CUdeviceptr p; CK(cuMemAlloc(&p, 1 << 20)); }
  else if (!strcmp(name, "vmm")) {
    CUmemAllocationProp pr; memset(&pr, 0, sizeof pr); pr.type = CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type = CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id = 0; pr.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t n = 2 << 20; CUmemGenericAllocationHandle g; CK(cuMemCreate(&g, n, &pr, 0)); printf("  create ok\n"); fflush(stdout);
    CUdeviceptr va; CK(cuMemAddressReserve(&va, n, 0, 0, 0)); CK(cuMemMap(va, n, 0, g, 0)); printf("  map ok\n"); fflush(stdout);
    CUmemAccessDesc ad; memset(&ad, 0, sizeof ad); ad.location = pr.location; ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(va, n, &ad, 1)); printf("  setaccess ok\n"); fflush(stdout);
    int fd; CK(cuMemExportToShareableHandle(&fd, g, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)); printf("  export ok\n"); fflush(stdout);
    CK(cuMemsetD32Async(va, 0, n / 4, o)); CK(cuStreamSynchronize(o)); printf("  memset+sync other ok\n"); fflush(stdout);
  } else if (!strcmp(name, "pool")) {
    CUmemPoolProps pp; memset(&pp, 0, sizeof pp); pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED; pp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE; pp.location.id = 0;
    CUmemoryPool mp; CK(cuMemPoolCreate(&mp, &pp)); CUdeviceptr p; CK(cuMemAllocFromPoolAsync(&p, 1 << 20, mp, o)); CK(cuStreamSynchronize(o));
  } else if (!strcmp(name, "streamcreate")) { for (int i = 0; i < 64; i++) { CUstream x; CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING)); } }
  else if (!strcmp(name, "streamcount")) { for (int i = 0; i < 512; i++) { CUstream x; CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING)); printf("  streams created behind the gate: %d\n", i + 1); fflush(stdout); } }
  else if (!strcmp(name, "prewarm") || !strcmp(name, "prekeep")) { for (int i = 0; i < 128; i++) { CUstream x; CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING)); } }
  else if (!strcmp(name, "eventcreate")) { for (int i = 0; i < 512; i++) { CUevent e; CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS)); } }
  else if (!strcmp(name, "hostalloc")) { for (int i = 0; i < 64; i++) { void *p; CK(cuMemHostAlloc(&p, 1 << 20, CU_MEMHOSTALLOC_DEVICEMAP)); } }
  else if (!strcmp(name, "query")) { CUresult q = cuStreamQuery(s); printf("  query %d\n", q); }
  printf("%s (extra streams %d): returned\n", name, nextra); fflush(stdout);
  *h = 1; CK(cuStreamSynchronize(s));
  _exit(0);
}
int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    pid_t p = fork();
    if (p == 0) step(argv[i]);
    int st; waitpid(p, &st, 0);
    if (WIFSIGNALED(st)) printf("%s (extra %s): HUNG (killed by signal %d after 4 s)\n", argv[i], getenv("EXTRA") ? getenv("EXTRA") : "0", WTERMSIG(st));
    fflush(stdout);
  }
  return 0;
}
