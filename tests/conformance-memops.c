/*
 * conformance-memops.c: conformance checks for which memory the stream
 * memory operations (cuStreamWriteValue32/64, cuStreamWaitValue32/64)
 * accept, written against the driver API directly.
 *
 * Measured on the real driver (580, H200): the operations refuse memory
 * from a stream-ordered memory pool (cuMemAllocFromPoolAsync of an IPC pool,
 * and pointers imported from a pool) with CUDA_ERROR_INVALID_VALUE, and
 * accept cuMemAlloc memory, VMM memory (cuMemCreate + cuMemMap +
 * cuMemSetAccess) and host memory registered with
 * CU_MEMHOSTREGISTER_DEVICEMAP. gpuipc's flag words therefore never live in
 * a pool allocation. Every check must pass on the real driver and on the
 * emulator.
 */
#include "harness.h"

#include "tree.h"

#include <sys/mman.h>
#include <unistd.h>

#define MEMOPS_BYTES ((size_t)64 << 10)

/* What the exporter sends an importer helper with the pool's descriptor. */
typedef struct memops_msg {
  CUmemPoolPtrExportData export_data;
  uint32_t word; /* what the first 32-bit word of the buffer holds */
  int32_t has64; /* the device supports the 64-bit operations */
} memops_msg;

/* ---- small utilities ------------------------------------------------------ */

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

/* Whether device 0 supports cuStreamWriteValue64/cuStreamWaitValue64 (the
 * 32-bit operations are what CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR
 * and the rest of the suite rely on; the 64-bit ones have their own
 * attribute). */
static bool has_memops64(void) {
  CUdevice dev;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  int v = 0;
  ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(
      &v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev));
  return v != 0;
}

/* Asserts that every stream memory operation on p is refused with
 * CUDA_ERROR_INVALID_VALUE, and that none of them ran: after the stream
 * drains, the word still holds what it held. The waits ask for a value that
 * is already there (a wrongly accepted wait must not hang the stream). */
static void expect_refused_at(CUstream s, CUdeviceptr p, uint32_t word,
                              bool has64, const char *file, int line) {
  CUresult r[4];
  r[0] = gpuipc__cu.cuStreamWriteValue32(s, p, word + 1, 0);
  r[1] = gpuipc__cu.cuStreamWaitValue32(s, p, word, CU_STREAM_WAIT_VALUE_EQ);
  r[2] = has64 ? gpuipc__cu.cuStreamWriteValue64(s, p, 0xFEEDull << 32, 0)
               : CUDA_ERROR_INVALID_VALUE;
  r[3] = has64 ? gpuipc__cu.cuStreamWaitValue64(s, p, 0,
                                                CU_STREAM_WAIT_VALUE_GEQ)
               : CUDA_ERROR_INVALID_VALUE;
  static const char *const names[4] = {
      "cuStreamWriteValue32", "cuStreamWaitValue32", "cuStreamWriteValue64",
      "cuStreamWaitValue64"};
  for (int i = 0; i < 4; i++)
    if (r[i] != CUDA_ERROR_INVALID_VALUE)
      harness_fail(file, line,
                   "%s on memory-pool memory returned %s, want "
                   "CUDA_ERROR_INVALID_VALUE",
                   names[i], harness_cuda_error_name(r[i]));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  uint32_t now = 0;
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(&now, p, sizeof now));
  if (now != word)
    harness_fail(file, line,
                 "a refused stream write changed the word: 0x%08x, was "
                 "0x%08x",
                 now, word);
}
#define expect_refused(s, p, word, has64)                                     \
  expect_refused_at((s), (p), (word), (has64), __FILE__, __LINE__)

/* Writes a 32-bit and a 64-bit value with stream memory operations, waits
 * on both in the same stream (satisfied by the writes before them), and
 * checks, after cuStreamSynchronize, that the values landed. host, when not
 * NULL, is the host view of p (registered memory): the values are read
 * there too. */
static void expect_accepted_at(CUstream s, CUdeviceptr p, const void *host,
                               bool has64, const char *what,
                               const char *file, int line) {
  const uint32_t v32 = 0x5A5A1234u;
  const uint64_t v64 = 0x0123456789ABCDEFull;
  CUresult r[4];
  r[0] = gpuipc__cu.cuStreamWriteValue32(s, p, v32, 0);
  r[1] = has64 ? gpuipc__cu.cuStreamWriteValue64(s, p + 8, v64, 0)
               : CUDA_SUCCESS;
  r[2] = gpuipc__cu.cuStreamWaitValue32(s, p, v32, CU_STREAM_WAIT_VALUE_EQ);
  r[3] = has64 ? gpuipc__cu.cuStreamWaitValue64(s, p + 8, v64,
                                                CU_STREAM_WAIT_VALUE_EQ)
               : CUDA_SUCCESS;
  static const char *const names[4] = {
      "cuStreamWriteValue32", "cuStreamWriteValue64", "cuStreamWaitValue32",
      "cuStreamWaitValue64"};
  for (int i = 0; i < 4; i++)
    if (r[i] != CUDA_SUCCESS)
      harness_fail(file, line, "%s on %s returned %s, want CUDA_SUCCESS",
                   names[i], what, harness_cuda_error_name(r[i]));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  unsigned char h[16];
  memset(h, 0, sizeof h);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, sizeof h));
  uint32_t got32;
  uint64_t got64;
  memcpy(&got32, h, 4);
  memcpy(&got64, h + 8, 8);
  if (got32 != v32 || (has64 && got64 != v64))
    harness_fail(file, line,
                 "%s: stream writes read back 0x%08x / 0x%016llx, want "
                 "0x%08x / 0x%016llx",
                 what, got32, (unsigned long long)got64, v32,
                 (unsigned long long)v64);
  if (host) {
    memcpy(&got32, host, 4);
    memcpy(&got64, (const char *)host + 8, 8);
    if (got32 != v32 || (has64 && got64 != v64))
      harness_fail(file, line,
                   "%s: host view reads 0x%08x / 0x%016llx after the stream "
                   "writes",
                   what, got32, (unsigned long long)got64);
  }
}
#define expect_accepted(s, p, host, has64, what)                              \
  expect_accepted_at((s), (p), (host), (has64), (what), __FILE__, __LINE__)

/* An IPC-capable pool on device 0 (pinned device memory, shareable as a
 * POSIX file descriptor), as gpuipc creates them. */
static CUmemoryPool make_ipc_pool(void) {
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  CUmemoryPool pool = NULL;
  ASSERT_CU(gpuipc__cu.cuMemPoolCreate(&pool, &props));
  return pool;
}

/* ---- pool memory is refused ------------------------------------------------ */

/* The importer: imports the pool and the pointer, and checks that the
 * stream memory operations refuse the imported pointer too. */
HELPER_IMPL(conf_memops_pool_importer) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  memops_msg m;
  int fd = -1, nfds = 1;
  ASSERT_EQ(harness_recv(sock, &m, sizeof m, &fd, &nfds), (ssize_t)sizeof m);
  ASSERT_EQ(nfds, 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUmemoryPool pool = NULL;
  ASSERT_CU(gpuipc__cu.cuMemPoolImportFromShareableHandle(
      &pool, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU(gpuipc__cu.cuMemPoolSetAccess(pool, &d, 1));
  CUdeviceptr q = 0;
  ASSERT_CU(gpuipc__cu.cuMemPoolImportPointer(&q, pool, &m.export_data));
  CUstream s = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  expect_refused(s, q, m.word, m.has64 != 0);
  ASSERT_CU(gpuipc__cu.cuMemFreeAsync(q, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  close(fd);
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Real driver (580, H200): cuStreamWriteValue32/64 and
 * cuStreamWaitValue32/64 on a pointer from cuMemAllocFromPoolAsync of an
 * IPC pool fail with CUDA_ERROR_INVALID_VALUE, and so they do on that
 * pointer imported into another process (next check). A refused write
 * changes nothing. */
TEST_IMPL(conformance_memops_refuse_pool_memory) {
  gpuipc__ctx_guard g;
  enter0(&g);
  bool has64 = has_memops64();
  CUmemoryPool pool = make_ipc_pool();
  CUstream s = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAllocFromPoolAsync(&p, MEMOPS_BYTES, pool, s));
  const uint32_t word = 0x600DF00Du;
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(p, word, MEMOPS_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  expect_refused(s, p, word, has64);
  /* ...and an interior pointer of the allocation likewise. */
  expect_refused(s, p + 4096, word, has64);

  ASSERT_CU(gpuipc__cu.cuMemFreeAsync(p, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemPoolDestroy(pool));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The same refusal on a pool pointer imported by another process. (The
 * pool is exported before the pointer: the real driver refuses to export a
 * pointer of a pool never exported; see
 * conformance_pool_export_pointer_needs_pool_export.) */
TEST_IMPL(conformance_memops_refuse_imported_pool_memory) {
  gpuipc__ctx_guard g;
  enter0(&g);
  bool has64 = has_memops64();
  CUmemoryPool pool = make_ipc_pool();
  CUstream s = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAllocFromPoolAsync(&p, (size_t)1 << 20, pool, s));
  const uint32_t word = 0x600DF00Du;
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(p, word, MEMOPS_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));

  /* The same pointer imported by another process. */
  memops_msg m;
  memset(&m, 0, sizeof m); /* the driver writes only part of export data */
  m.word = word;
  m.has64 = has64;
  int fd = -1;
  ASSERT_CU(gpuipc__cu.cuMemPoolExportToShareableHandle(
      &fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  ASSERT_GE(fd, 0);
  ASSERT_CU(gpuipc__cu.cuMemPoolExportPointer(&m.export_data, p));
  int sock = -1;
  pid_t pid = spawn_helper("conf_memops_pool_importer", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, &fd, 1);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  close(fd);

  ASSERT_CU(gpuipc__cu.cuMemFreeAsync(p, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemPoolDestroy(pool));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- cuMemAlloc, VMM and registered host memory are accepted --------------- */

/* Real driver (580, H200): the stream memory operations succeed, and the
 * values land, on cuMemAlloc memory, on VMM memory (cuMemCreate + cuMemMap
 * + cuMemSetAccess) and on host memory registered with
 * CU_MEMHOSTREGISTER_DEVICEMAP (through the device pointer from
 * cuMemHostGetDevicePointer): the three places gpuipc keeps flag words. */
TEST_IMPL(conformance_memops_accept_alloc_vmm_host) {
  gpuipc__ctx_guard g;
  enter0(&g);
  bool has64 = has_memops64();
  CUstream s = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

  /* cuMemAlloc */
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, MEMOPS_BYTES));
  /* Zeroed in the stream's own order (a non-blocking stream does not wait
   * for the legacy default stream). */
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(d, 0, MEMOPS_BYTES, s));
  expect_accepted(s, d, NULL, has64, "cuMemAlloc memory");
  expect_accepted(s, d + 4096, NULL, has64, "cuMemAlloc memory (interior)");
  ASSERT_CU(gpuipc__cu.cuMemFree(d));

  /* VMM: pinned device memory exportable as a POSIX file descriptor, as
   * gpuipc's VMM pools allocate it. */
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetAllocationGranularity(
      &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  ASSERT_GT(gran, 0);
  size_t vbytes = (MEMOPS_BYTES + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h = 0;
  ASSERT_CU(gpuipc__cu.cuMemCreate(&h, vbytes, &prop, 0));
  CUdeviceptr va = 0;
  ASSERT_CU(gpuipc__cu.cuMemAddressReserve(&va, vbytes, 0, 0, 0));
  ASSERT_CU(gpuipc__cu.cuMemMap(va, vbytes, 0, h, 0));
  CUmemAccessDesc acc;
  memset(&acc, 0, sizeof acc);
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU(gpuipc__cu.cuMemSetAccess(va, vbytes, &acc, 1));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(va, 0, vbytes, s));
  expect_accepted(s, va, NULL, has64, "VMM memory");
  expect_accepted(s, va + 4096, NULL, has64, "VMM memory (interior)");
  ASSERT_CU(gpuipc__cu.cuMemUnmap(va, vbytes));
  ASSERT_CU(gpuipc__cu.cuMemRelease(h));
  ASSERT_CU(gpuipc__cu.cuMemAddressFree(va, vbytes));

  /* Registered host memory, through its device pointer. */
  void *host = mmap(NULL, MEMOPS_BYTES, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT(host != MAP_FAILED);
  ASSERT_CU(gpuipc__cu.cuMemHostRegister(host, MEMOPS_BYTES,
                                         CU_MEMHOSTREGISTER_DEVICEMAP));
  CUdeviceptr hp = 0;
  ASSERT_CU(gpuipc__cu.cuMemHostGetDevicePointer(&hp, host, 0));
  ASSERT_NE(hp, 0);
  expect_accepted(s, hp, host, has64, "registered host memory");
  expect_accepted(s, hp + 4096, (char *)host + 4096, has64,
                  "registered host memory (interior)");
  ASSERT_CU(gpuipc__cu.cuMemHostUnregister(host));
  ASSERT_EQ(munmap(host, MEMOPS_BYTES), 0);

  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}
