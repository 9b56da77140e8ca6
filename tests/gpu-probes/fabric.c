/*
 * fabric.c: what does the driver answer to fabric handles
 * (CU_MEM_HANDLE_TYPE_FABRIC) on this machine? Prints the device attribute,
 * the pools' handle types, the IMEX channels (/dev/nvidia-caps-imex-channels
 * and nvidia-caps-imex-channels in /proc/devices, which cuda.h says fabric
 * handles need), then every answer of: a VMM allocation created with the
 * fabric type, exported into a CUmemFabricHandle and imported in the same
 * process; a pool with the fabric type, one allocation from it, the pool
 * and the pointer exported and imported in the same process; and both
 * handles' bytes (no file descriptor) sent to importers that import, map,
 * read the exporter's pattern and write their own:
 *   - a child of a fork (same pid namespace);
 *   - a child in a pid namespace of its own, made as `unshare -p -f` makes
 *     it (unshare(CLONE_NEWPID), then fork: the importer is pid 1 there);
 *     needs root (or CAP_SYS_ADMIN), else the refusal is printed.
 * The importers are forked before this process initializes CUDA (a CUDA
 * context does not survive fork). Not part of the build; on a machine with
 * a GPU:
 *
 *   gcc -O1 -I/usr/local/cuda/include -o /tmp/fabric tests/gpu-probes/fabric.c -lcuda
 *   /tmp/fabric            (as root for the other pid namespace too)
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *who = "exporter";
static const char *nm(CUresult r) { const char *s = NULL; cuGetErrorName(r, &s); return s ? s : "?"; }
/* Prints one answer; returns it. */
static CUresult say(const char *call, CUresult r) {
  printf("[%s pid %d] %s -> %s\n", who, (int)getpid(), call, nm(r));
  fflush(stdout);
  return r;
}
#define ASK(x) say(#x, (x))
static uint32_t word(uint32_t seed, size_t i) { return seed * 2654435761u + (uint32_t)i * 40503u + 1u; }
static void put(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = malloc(n);
  for (size_t i = 0; i < n / 4; i++) h[i] = word(seed, i);
  ASK(cuMemcpyHtoD(p, h, n)); ASK(cuCtxSynchronize());
  free(h);
}
/* 1 when the n bytes at p hold seed's pattern; prints the first mismatch. */
static int check(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = calloc(1, n); int ok = ASK(cuMemcpyDtoH(h, p, n)) == CUDA_SUCCESS;
  for (size_t i = 0; ok && i < n / 4; i++)
    if (h[i] != word(seed, i)) { printf("[%s] word %zu reads 0x%08x, want 0x%08x\n", who, i, h[i], word(seed, i)); ok = 0; }
  printf("[%s] pattern %u: %s\n", who, seed, ok ? "reads back" : "WRONG");
  free(h); return ok;
}

static void imex(void) {
  FILE *f = fopen("/proc/devices", "re"); char line[256]; int found = 0;
  while (f && fgets(line, sizeof line, f)) if (strstr(line, "nvidia-caps-imex-channels")) { printf("/proc/devices: %s", line); found = 1; }
  if (f) fclose(f);
  if (!found) printf("/proc/devices: no nvidia-caps-imex-channels\n");
  DIR *d = opendir("/dev/nvidia-caps-imex-channels");
  if (!d) { printf("/dev/nvidia-caps-imex-channels: %s\n", strerror(errno)); return; }
  struct dirent *e; int n = 0;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char p[512]; snprintf(p, sizeof p, "/dev/nvidia-caps-imex-channels/%s", e->d_name);
    int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    printf("/dev/nvidia-caps-imex-channels/%s: %s\n", e->d_name, fd >= 0 ? "opens" : strerror(errno));
    if (fd >= 0) close(fd);
    n++;
  }
  closedir(d);
  if (!n) printf("/dev/nvidia-caps-imex-channels: empty\n");
}

/* What the exporter sends: the handles' bytes and what to expect. */
struct msg {
  int vmm, pool;          /* which exports succeeded */
  uint64_t bytes;         /* of each allocation */
  uint32_t seed;          /* the exporter's pattern in both */
  CUmemFabricHandle vh, ph;
  CUmemPoolPtrExportData ptr;
};

static CUcontext ctx0(void) {
  CUdevice dev; CUcontext c = NULL;
  if (ASK(cuInit(0)) || ASK(cuDeviceGet(&dev, 0)) || ASK(cuDevicePrimaryCtxRetain(&c, dev)) || ASK(cuCtxSetCurrent(c))) exit(2);
  return c;
}

static CUdeviceptr map(CUmemGenericAllocationHandle h, size_t n) {
  CUdeviceptr va = 0; CUmemAccessDesc a; memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE; a.location.id = 0; a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (ASK(cuMemAddressReserve(&va, n, 0, 0, 0))) return 0;
  if (ASK(cuMemMap(va, n, 0, h, 0)) || ASK(cuMemSetAccess(va, n, &a, 1))) return 0;
  return va;
}

/* An importer: waits for the exporter's message, then imports both. Replies
 * with one byte: 1 when it wrote its pattern (seed + 1) into the VMM
 * allocation. */
static int importer(int sock) {
  struct msg m;
  if (read(sock, &m, sizeof m) != (ssize_t)sizeof m) return 3;
  char wrote = 0;
  if (!m.vmm && !m.pool) /* nothing was exported */
    return write(sock, &wrote, 1) == 1 ? 0 : 3;
  ctx0();
  if (m.vmm) {
    CUmemGenericAllocationHandle h = 0;
    if (!ASK(cuMemImportFromShareableHandle(&h, &m.vh, CU_MEM_HANDLE_TYPE_FABRIC))) {
      CUdeviceptr va = map(h, m.bytes);
      if (va && check(va, m.bytes, m.seed)) { put(va, m.bytes, m.seed + 1); wrote = 1; }
      if (va) { ASK(cuMemUnmap(va, m.bytes)); ASK(cuMemAddressFree(va, m.bytes)); }
      ASK(cuMemRelease(h));
    }
  }
  if (m.pool) {
    CUmemoryPool p = NULL; CUdeviceptr q = 0;
    if (!ASK(cuMemPoolImportFromShareableHandle(&p, &m.ph, CU_MEM_HANDLE_TYPE_FABRIC, 0))) {
      if (!ASK(cuMemPoolImportPointer(&q, p, &m.ptr))) {
        check(q, m.bytes, m.seed);
        ASK(cuMemFreeAsync(q, 0)); ASK(cuStreamSynchronize(0));
      }
      ASK(cuMemPoolDestroy(p));
    }
  }
  if (write(sock, &wrote, 1) != 1) return 3;
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* The importers, forked before CUDA starts here. */
  int sa[2], sb[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sa) || socketpair(AF_UNIX, SOCK_STREAM, 0, sb)) return 2;
  pid_t pa = fork();
  if (pa == 0) { close(sa[0]); close(sb[0]); close(sb[1]); who = "importer, same pid namespace"; _exit(importer(sa[1])); }
  pid_t pb = fork();
  if (pb == 0) {
    close(sa[0]); close(sa[1]); close(sb[0]);
    if (unshare(CLONE_NEWPID) != 0) {
      printf("[importer, own pid namespace] unshare(CLONE_NEWPID): %s (run as root)\n", strerror(errno));
      char no = 0; struct msg m;
      if (read(sb[1], &m, sizeof m) != (ssize_t)sizeof m || write(sb[1], &no, 1) != 1) _exit(3);
      _exit(0);
    }
    pid_t in = fork(); /* pid 1 of the new namespace */
    if (in == 0) { who = "importer, own pid namespace"; _exit(importer(sb[1])); }
    int st = 0; waitpid(in, &st, 0);
    _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  }
  close(sa[1]); close(sb[1]);

  imex();
  ctx0();
  CUdevice dev = 0; int attr = -1, types = -1, drv = 0;
  ASK(cuDriverGetVersion(&drv));
  ASK(cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev));
  ASK(cuDeviceGetAttribute(&types, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES, dev));
  printf("driver %d; HANDLE_TYPE_FABRIC_SUPPORTED = %d; MEMPOOL_SUPPORTED_HANDLE_TYPES = 0x%x\n", drv, attr, types);

  struct msg m; memset(&m, 0, sizeof m);
  m.seed = 71;
  /* VMM */
  CUmemAllocationProp prop; memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  size_t gran = 2u << 20;
  ASK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  m.bytes = gran;
  CUmemGenericAllocationHandle h = 0; CUdeviceptr va = 0;
  int created = !ASK(cuMemCreate(&h, gran, &prop, 0));
  if (created && !ASK(cuMemExportToShareableHandle(&m.vh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0))) {
    m.vmm = 1;
    CUmemGenericAllocationHandle h2 = 0;
    if (!say("cuMemImportFromShareableHandle (same process)",
             cuMemImportFromShareableHandle(&h2, &m.vh, CU_MEM_HANDLE_TYPE_FABRIC))) {
      printf("[exporter] same-process import: %s handle\n", h2 == h ? "the same" : "another");
      ASK(cuMemRelease(h2));
    }
    va = map(h, gran);
    if (va) put(va, gran, m.seed); else m.vmm = 0;
  }
  /* pool */
  CUmemPoolProps pp; memset(&pp, 0, sizeof pp);
  pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED; pp.handleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  CUmemoryPool pool = NULL; CUdeviceptr pptr = 0;
  if (!ASK(cuMemPoolCreate(&pool, &pp))) {
    if (!ASK(cuMemAllocFromPoolAsync(&pptr, gran, pool, 0)) && !ASK(cuStreamSynchronize(0))) {
      put(pptr, gran, m.seed);
      if (!ASK(cuMemPoolExportToShareableHandle(&m.ph, pool, CU_MEM_HANDLE_TYPE_FABRIC, 0)) &&
          !ASK(cuMemPoolExportPointer(&m.ptr, pptr))) {
        m.pool = 1;
        CUmemoryPool p2 = NULL; CUdeviceptr q = 0;
        if (!say("cuMemPoolImportFromShareableHandle (same process)",
                 cuMemPoolImportFromShareableHandle(&p2, &m.ph, CU_MEM_HANDLE_TYPE_FABRIC, 0))) {
          printf("[exporter] same-process pool import: %s pool\n", p2 == pool ? "the same" : "another");
          if (p2 != pool) {
            if (!say("cuMemPoolImportPointer (same process)", cuMemPoolImportPointer(&q, p2, &m.ptr))) {
              check(q, gran, m.seed);
              ASK(cuMemFreeAsync(q, 0)); ASK(cuStreamSynchronize(0));
            }
            ASK(cuMemPoolDestroy(p2));
          }
        }
      }
    }
  }

  /* Each importer in turn: the handles' bytes, then its answer. */
  int socks[2] = {sa[0], sb[0]}; pid_t pids[2] = {pa, pb};
  const char *names[2] = {"same pid namespace", "own pid namespace"};
  for (int k = 0; k < 2; k++) {
    char wrote = 0;
    if (write(socks[k], &m, sizeof m) != (ssize_t)sizeof m || read(socks[k], &wrote, 1) != 1)
      printf("[exporter] importer (%s) did not answer\n", names[k]);
    int st = 0; waitpid(pids[k], &st, 0);
    printf("[exporter] importer (%s): exit %d\n", names[k], WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
    if (wrote) {
      printf("[exporter] reading what the importer (%s) wrote:\n", names[k]);
      check(va, gran, m.seed + 1);
      put(va, gran, m.seed); /* for the next importer */
    }
  }

  if (va) { ASK(cuMemUnmap(va, gran)); ASK(cuMemAddressFree(va, gran)); }
  if (created) ASK(cuMemRelease(h));
  /* The clean-up calls say their name first: on the H200's 580.159.04
   * driver, after the pool's fabric export was refused (no IMEX channel),
   * one of these crashed the process (SIGSEGV) after cuMemFreeAsync had
   * returned. */
  if (pptr) {
    ASK(cuMemFreeAsync(pptr, 0));
    printf("[%s] calling cuStreamSynchronize(0)\n", who);
    fflush(stdout);
    ASK(cuStreamSynchronize(0));
  }
  if (pool) {
    printf("[%s] calling cuMemPoolDestroy(pool)\n", who);
    fflush(stdout);
    ASK(cuMemPoolDestroy(pool));
  }
  return 0;
}
