/*
 * selftest.c: a quick check of libcuda-emu.so on its own, without gpuipc.
 * It loads the emulator as gpuipc does (dlopen + cuGetProcAddress_v2) and
 * exercises each area once, across two real processes where the behaviour
 * is about processes (the program re-executes itself as the child). The
 * semantic checks against the real driver are the conformance suite's job.
 */
#include <cuda.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define FUNCS(X)                                                               \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGet) X(cuDeviceGetCount)               \
  X(cuDeviceGetAttribute) X(cuDeviceGetUuid) X(cuDevicePrimaryCtxRetain)       \
  X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxSynchronize) X(cuMemAlloc)      \
  X(cuMemFree) X(cuMemGetInfo) X(cuMemcpyHtoD) X(cuMemcpyDtoH)                 \
  X(cuMemcpyHtoDAsync) X(cuMemcpyDtoHAsync) X(cuMemsetD32) X(cuMemsetD8Async) \
  X(cuPointerGetAttribute) X(cuMemGetAddressRange) X(cuIpcGetMemHandle)        \
  X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle) X(cuIpcGetEventHandle)          \
  X(cuIpcOpenEventHandle) X(cuStreamCreate) X(cuStreamDestroy)                 \
  X(cuStreamSynchronize) X(cuStreamQuery) X(cuStreamWaitEvent)                 \
  X(cuStreamWriteValue32) X(cuStreamWaitValue32) X(cuEventCreate)              \
  X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy)     \
  X(cuLaunchHostFunc) X(cuMemPoolCreate) X(cuMemPoolDestroy)                   \
  X(cuMemPoolExportToShareableHandle) X(cuMemPoolImportFromShareableHandle)    \
  X(cuMemPoolExportPointer) X(cuMemPoolImportPointer)                          \
  X(cuMemAllocFromPoolAsync) X(cuMemFreeAsync) X(cuMemCreate) X(cuMemRelease)  \
  X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)            \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap)         \
  X(cuMemSetAccess) X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemHostRegister)    \
  X(cuMemHostUnregister)

#define MEMBER(n) static __typeof__(&n) p_##n;
FUNCS(MEMBER)
#undef MEMBER

static int failures;
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                              \
    }                                                                          \
  } while (0)
#define CU(expr, want)                                                         \
  do {                                                                         \
    CUresult r_ = (expr);                                                      \
    if (r_ != (want)) {                                                        \
      const char *n_ = "?";                                                    \
      p_cuGetErrorName(r_, &n_);                                               \
      fprintf(stderr, "%s:%d: %s returned %s (%d), want %d\n", __FILE__,       \
              __LINE__, #expr, n_, (int)r_, (int)(want));                      \
      failures++;                                                              \
    }                                                                          \
  } while (0)
#define OK(expr) CU(expr, CUDA_SUCCESS)

static void load(void) {
  void *h = dlopen(EMU_LIB_PATH, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    exit(1);
  }
  CUresult (*gp)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
      (CUresult(*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))
          dlsym(h, "cuGetProcAddress_v2");
  if (!gp) {
    fprintf(stderr, "no cuGetProcAddress_v2\n");
    exit(1);
  }
#define RESOLVE(n)                                                             \
  {                                                                            \
    void *f = NULL;                                                            \
    CUdriverProcAddressQueryResult q;                                          \
    if (gp(#n, &f, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &q) != 0 || !f) {        \
      fprintf(stderr, "cannot resolve %s\n", #n);                              \
      exit(1);                                                                 \
    }                                                                          \
    memcpy(&p_##n, &f, sizeof f);                                              \
  }
  FUNCS(RESOLVE)
#undef RESOLVE
  /* Asked at 13.0, cuCtxSynchronize is the variant that takes a context (as
   * on the real driver), which is why the table above asks at 12.0, where
   * every name used here has the variant cuda.h declares. */
  void *f2 = NULL;
  CUdriverProcAddressQueryResult q2;
  CHECK(gp("cuCtxSynchronize", &f2, 13000, 0, &q2) == CUDA_SUCCESS && f2 != NULL);
  CHECK(f2 != (void *)p_cuCtxSynchronize);
  CHECK(gp("cuMemAlloc", &f2, 3000, 0, &q2) == CUDA_SUCCESS); /* the old variant: a stub */
  CHECK(f2 != (void *)p_cuMemAlloc);
  CHECK(gp("cuMemAlloc", &f2, 1000, 0, &q2) == CUDA_ERROR_NOT_FOUND &&
        q2 == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  /* A CUDA name the emulator lacks: a stub. A non-CUDA name: not found. */
  void *f = NULL;
  CUdriverProcAddressQueryResult q;
  CHECK(gp("cuGraphCreate", &f, CUDA_VERSION, 0, &q) == CUDA_SUCCESS && f != NULL);
  CHECK(gp("notACudaFunction", &f, CUDA_VERSION, 0, &q) == CUDA_ERROR_NOT_FOUND && f == NULL);
}

static void send_fd(int sock, const void *buf, size_t n, int fd) {
  struct msghdr m = {0};
  struct iovec iov = {(void *)buf, n};
  char ctl[CMSG_SPACE(sizeof(int))];
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (fd >= 0) {
    memset(ctl, 0, sizeof ctl);
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  if (sendmsg(sock, &m, 0) != (ssize_t)n) {
    perror("sendmsg");
    exit(1);
  }
}

static int recv_fd(int sock, void *buf, size_t n) {
  struct msghdr m = {0};
  struct iovec iov = {buf, n};
  char ctl[CMSG_SPACE(sizeof(int))];
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  ssize_t r = recvmsg(sock, &m, MSG_WAITALL);
  if (r != (ssize_t)n) {
    fprintf(stderr, "recvmsg: short (%zd)\n", r);
    exit(1);
  }
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  int fd = -1;
  if (c && c->cmsg_type == SCM_RIGHTS)
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

/* What the parent sends the child. */
typedef struct msg {
  CUipcMemHandle mem;
  CUipcEventHandle ev;
  CUmemPoolPtrExportData pool_ptr;
  CUdeviceptr parent_ptr;
  unsigned long long buffer_id;
} msg;

static void setup(void) {
  OK(p_cuInit(0));
  CUdevice d;
  OK(p_cuDeviceGet(&d, 0));
  CUcontext c;
  OK(p_cuDevicePrimaryCtxRetain(&c, d));
  OK(p_cuCtxSetCurrent(c));
}

static int child(int sock) {
  load();
  setup();
  msg m;
  recv_fd(sock, &m, sizeof m);
  char tag;
  int pool_fd = recv_fd(sock, &tag, 1); /* then the pool's and the VMM fd */
  int vmm_fd = recv_fd(sock, &tag, 1);
  (void)vmm_fd;

  /* Legacy IPC: open, read, and the address differs from the exporter's. */
  CUdeviceptr p, p2;
  OK(p_cuIpcOpenMemHandle(&p, m.mem, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  OK(p_cuIpcOpenMemHandle(&p2, m.mem, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CHECK(p == p2);
  CHECK(p != m.parent_ptr);
  unsigned long long bid = 0;
  OK(p_cuPointerGetAttribute(&bid, CU_POINTER_ATTRIBUTE_BUFFER_ID, p));
  /* As on the real driver, the importer's mapping has a buffer id of its
   * own, not the exporter's. */
  CHECK(bid != 0 && bid != m.buffer_id);
  uint32_t v[4];
  OK(p_cuMemcpyDtoH(v, p, sizeof v));
  CHECK(v[0] == 0xabcd1234u && v[3] == 0xabcd1234u);

  /* GPU-side handshake: the parent's stream waits for our flag. */
  CUstream s;
  OK(p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  OK(p_cuStreamWriteValue32(s, p + 64, 7, 0));
  OK(p_cuStreamSynchronize(s));

  /* IPC event: wait for the parent's record. */
  CUevent ev;
  OK(p_cuIpcOpenEventHandle(&ev, m.ev));
  OK(p_cuStreamWaitEvent(s, ev, 0));
  OK(p_cuStreamSynchronize(s));
  OK(p_cuEventQuery(ev));

  /* Pool import: twice gives the same pool and pointer. */
  CUmemoryPool pool, pool2;
  OK(p_cuMemPoolImportFromShareableHandle(&pool, (void *)(intptr_t)pool_fd,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  int fd2 = dup(pool_fd);
  OK(p_cuMemPoolImportFromShareableHandle(&pool2, (void *)(intptr_t)fd2,
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CHECK(pool == pool2);
  CUdeviceptr q, q2;
  OK(p_cuMemPoolImportPointer(&q, pool, &m.pool_ptr));
  OK(p_cuMemPoolImportPointer(&q2, pool, &m.pool_ptr));
  CHECK(q == q2);
  OK(p_cuMemcpyDtoH(v, q, sizeof v));
  CHECK(v[0] == 0x55555555u);
  CUdeviceptr bad;
  CU(p_cuMemAllocFromPoolAsync(&bad, 4096, pool, s), CUDA_ERROR_INVALID_VALUE);
  /* The real driver refuses to destroy an imported pool while pointers
   * imported from it are live, and accepts it afterwards. */
  CU(p_cuMemPoolDestroy(pool), CUDA_ERROR_INVALID_VALUE);
  OK(p_cuMemFreeAsync(q, s));
  OK(p_cuMemFreeAsync(q2, s));
  OK(p_cuStreamSynchronize(s));
  OK(p_cuMemPoolDestroy(pool));

  /* VMM import. */
  CUmemGenericAllocationHandle h;
  OK(p_cuMemImportFromShareableHandle(&h, (void *)(intptr_t)vmm_fd,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  CUdeviceptr va;
  size_t sz = 2 << 20;
  OK(p_cuMemAddressReserve(&va, sz, 0, 0, 0));
  OK(p_cuMemMap(va, sz, 0, h, 0));
  CUmemAccessDesc ad = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  OK(p_cuMemSetAccess(va, sz, &ad, 1));
  OK(p_cuMemcpyDtoH(v, va, sizeof v));
  CHECK(v[0] == 0x77777777u);
  OK(p_cuMemUnmap(va, sz));
  OK(p_cuMemAddressFree(va, sz));
  OK(p_cuMemRelease(h));

  OK(p_cuIpcCloseMemHandle(p));
  OK(p_cuIpcCloseMemHandle(p2));
  CU(p_cuIpcCloseMemHandle(p), CUDA_ERROR_INVALID_VALUE);
  OK(p_cuEventDestroy(ev));
  OK(p_cuStreamDestroy(s));
  char done = 1;
  send_fd(sock, &done, 1, -1);
  return failures ? 1 : 0;
}

static atomic_int host_fn_ran;
static void host_fn(void *arg) { atomic_store(&host_fn_ran, *(int *)arg); }

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "child") == 0)
    return child(atoi(argv[2]));
  setenv("GPUIPC_EMU_COPY_DELAY_US", "200", 1);
  load();
  setup();

  int n = 0;
  OK(p_cuDeviceGetCount(&n));
  CHECK(n >= 1);
  int a = 0;
  OK(p_cuDeviceGetAttribute(&a, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0));
  CHECK(a == 9);

  size_t free0, total;
  OK(p_cuMemGetInfo(&free0, &total));
  CUdeviceptr d;
  OK(p_cuMemAlloc(&d, 1 << 20));
  size_t free1;
  OK(p_cuMemGetInfo(&free1, &total));
  CHECK(free1 + (1 << 20) == free0);
  OK(p_cuMemsetD32(d, 0xabcd1234u, (1 << 20) / 4));
  OK(p_cuMemsetD32(d + 64, 0, 1));
  CUdeviceptr base;
  size_t bsz;
  OK(p_cuMemGetAddressRange(&base, &bsz, d + 100));
  CHECK(base == d && bsz == 1 << 20);
  unsigned long long bid = 0;
  OK(p_cuPointerGetAttribute(&bid, CU_POINTER_ATTRIBUTE_BUFFER_ID, d));
  int host_word = 0;
  CU(p_cuPointerGetAttribute(&bid, CU_POINTER_ATTRIBUTE_BUFFER_ID, (CUdeviceptr)&host_word),
     CUDA_ERROR_INVALID_VALUE);

  /* Legacy handle: interior pointer gives the same bytes; own open fails. */
  CUipcMemHandle mh, mh2;
  OK(p_cuIpcGetMemHandle(&mh, d));
  OK(p_cuIpcGetMemHandle(&mh2, d + 4096));
  CHECK(memcmp(&mh, &mh2, sizeof mh) == 0);
  CUdeviceptr own;
  CU(p_cuIpcOpenMemHandle(&own, mh, 1), CUDA_ERROR_INVALID_CONTEXT);

  /* Streams: async copies in order, query, host function. */
  CUstream s;
  OK(p_cuStreamCreate(&s, 0));
  static uint32_t src[1024], dst[1024];
  for (int i = 0; i < 1024; i++)
    src[i] = (uint32_t)i;
  CUdeviceptr d2;
  OK(p_cuMemAlloc(&d2, sizeof src));
  OK(p_cuMemcpyHtoDAsync(d2, src, sizeof src, s));
  memset(src, 0, sizeof src); /* pageable source: staged at the call */
  OK(p_cuMemcpyDtoHAsync(dst, d2, sizeof dst, s));
  CHECK(dst[1023] == 1023); /* pageable destination: complete on return */
  int arg = 42;
  OK(p_cuLaunchHostFunc(s, host_fn, &arg));
  OK(p_cuStreamSynchronize(s));
  CHECK(atomic_load(&host_fn_ran) == 42);
  OK(p_cuStreamQuery(s));

  /* Events. */
  CUevent ev;
  CU(p_cuEventCreate(&ev, CU_EVENT_INTERPROCESS), CUDA_ERROR_INVALID_VALUE);
  OK(p_cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CUipcEventHandle eh;
  OK(p_cuIpcGetEventHandle(&eh, ev));

  /* Pool. */
  CUmemPoolProps pp;
  memset(&pp, 0, sizeof pp);
  pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  pp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  pp.location.id = 0;
  CUmemoryPool pool;
  OK(p_cuMemPoolCreate(&pool, &pp));
  CUdeviceptr pa;
  OK(p_cuMemAllocFromPoolAsync(&pa, 8192, pool, s));
  OK(p_cuMemsetD8Async(pa, 0x55, 8192, s));
  OK(p_cuStreamSynchronize(s));
  /* Like the real driver, a pointer exports only once its pool has been
   * exported, and export fills the first 48 bytes only. */
  CUmemPoolPtrExportData ed, ed2;
  memset(&ed, 0, sizeof ed);
  memset(&ed2, 0xa5, sizeof ed2);
  CU(p_cuMemPoolExportPointer(&ed, pa), CUDA_ERROR_INVALID_VALUE);
  int pool_fd = -1;
  OK(p_cuMemPoolExportToShareableHandle(&pool_fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  OK(p_cuMemPoolExportPointer(&ed, pa));
  OK(p_cuMemPoolExportPointer(&ed2, pa));
  CHECK(memcmp(&ed, &ed2, 48) == 0);
  CHECK(ed2.reserved[48] == 0xa5 && ed2.reserved[63] == 0xa5);
  CU(p_cuMemPoolExportPointer(&ed2, pa + 512), CUDA_ERROR_INVALID_VALUE);
  CU(p_cuIpcGetMemHandle(&mh2, pa), CUDA_ERROR_INVALID_VALUE);

  /* VMM. */
  CUmemAllocationProp vp;
  memset(&vp, 0, sizeof vp);
  vp.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  vp.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  vp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  vp.location.id = 0;
  CUmemGenericAllocationHandle vh;
  CU(p_cuMemCreate(&vh, 4096, &vp, 0), CUDA_ERROR_INVALID_VALUE);
  OK(p_cuMemCreate(&vh, 2 << 20, &vp, 0));
  CUdeviceptr va;
  OK(p_cuMemAddressReserve(&va, 2 << 20, 0, 0, 0));
  OK(p_cuMemMap(va, 2 << 20, 0, vh, 0));
  CUmemAccessDesc ad = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  OK(p_cuMemSetAccess(va, 2 << 20, &ad, 1));
  OK(p_cuMemsetD32(va, 0x77777777u, 16));
  int vmm_fd = -1;
  OK(p_cuMemExportToShareableHandle(&vmm_fd, vh, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));

  /* Pinned host memory over a shared mapping. */
  void *shm = mmap(NULL, 1 << 16, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  OK(p_cuMemHostRegister(shm, 1 << 16, CU_MEMHOSTREGISTER_DEVICEMAP));
  CU(p_cuMemHostRegister(shm, 4096, 0), CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  unsigned mt = 0;
  OK(p_cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)shm));
  CHECK(mt == CU_MEMORYTYPE_HOST);
  OK(p_cuMemHostUnregister(shm));
  munmap(shm, 1 << 16);

  /* The child. */
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    return 1;
  char fdarg[16];
  snprintf(fdarg, sizeof fdarg, "%d", sv[1]);
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    execl("/proc/self/exe", argv[0], "child", fdarg, (char *)NULL);
    _exit(127);
  }
  close(sv[1]);
  /* Our stream waits for the child's flag, then records the IPC event. */
  OK(p_cuStreamWaitValue32(s, d + 64, 7, CU_STREAM_WAIT_VALUE_EQ));
  OK(p_cuEventRecord(ev, s));
  msg m;
  memset(&m, 0, sizeof m);
  m.mem = mh;
  m.ev = eh;
  m.pool_ptr = ed;
  m.parent_ptr = d;
  m.buffer_id = bid;
  send_fd(sv[0], &m, sizeof m, -1);
  send_fd(sv[0], "p", 1, pool_fd);
  send_fd(sv[0], "v", 1, vmm_fd);
  close(pool_fd);
  close(vmm_fd);
  char done;
  if (read(sv[0], &done, 1) != 1)
    CHECK(!"child died");
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  OK(p_cuEventSynchronize(ev));

  /* Free and re-allocate: the same address, a new buffer id; the old handle
   * no longer opens. */
  OK(p_cuMemFree(d));
  CUdeviceptr d3;
  OK(p_cuMemAlloc(&d3, 1 << 20));
  CHECK(d3 == d);
  unsigned long long bid2 = 0;
  OK(p_cuPointerGetAttribute(&bid2, CU_POINTER_ATTRIBUTE_BUFFER_ID, d3));
  CHECK(bid2 != bid);
  OK(p_cuMemFree(d3));
  OK(p_cuMemFree(d2));
  OK(p_cuMemFreeAsync(pa, s));
  OK(p_cuStreamSynchronize(s));
  OK(p_cuMemPoolDestroy(pool));
  OK(p_cuMemUnmap(va, 2 << 20));
  OK(p_cuMemAddressFree(va, 2 << 20));
  OK(p_cuMemRelease(vh));
  OK(p_cuEventDestroy(ev));
  OK(p_cuStreamDestroy(s));
  OK(p_cuCtxSynchronize());
  size_t free2;
  OK(p_cuMemGetInfo(&free2, &total));
  CHECK(free2 == free0);
  if (failures)
    fprintf(stderr, "%d check(s) failed\n", failures);
  else
    printf("emulator self-test passed\n");
  return failures ? 1 : 0;
}
