/*
 * conformance-host.c: conformance checks for pinned host memory
 * (cuMemHostAlloc, cuMemHostGetDevicePointer, cuMemHostRegister of memory
 * shared between processes) and for what cuPointerGetAttribute says about
 * each kind of memory, written against the driver API directly.
 *
 * Every check must pass on the real driver and on the emulator.
 */
#include "harness.h"

#include "tree.h"

#include <sys/mman.h>
#include <unistd.h>

#define HOST_BYTES ((size_t)1 << 20)

/* ---- small utilities ------------------------------------------------------ */

static uint32_t pattern_word(uint32_t seed, size_t i) {
  return seed * 2654435761u + (uint32_t)i * 40503u + 1u;
}

static void fill_host(void *p, size_t n, uint32_t seed) {
  uint32_t *h = p;
  for (size_t i = 0; i < n / 4; i++)
    h[i] = pattern_word(seed, i);
}

static void check_host(const void *p, size_t n, uint32_t seed) {
  const uint32_t *h = p;
  for (size_t i = 0; i < n / 4; i++)
    if (h[i] != pattern_word(seed, i))
      harness_fail(__FILE__, __LINE__,
                   "pattern %u: word %zu of %zu reads 0x%08x, want 0x%08x",
                   seed, i, n / 4, h[i], pattern_word(seed, i));
}

/* Reads device memory into a private host buffer and checks it. */
static void check_device(CUdeviceptr p, size_t n, uint32_t seed) {
  void *h = calloc(1, n);
  ASSERT_NOT_NULL(h);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, n));
  check_host(h, n, seed);
  free(h);
}

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

static unsigned int memory_type(CUdeviceptr p) {
  unsigned int type = 0;
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
      &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p));
  return type;
}

/* ---- checks ---------------------------------------------------------------- */

/* cuMemHostAlloc with DEVICEMAP: copies to and from the host pointer work,
 * and cuMemHostGetDevicePointer gives a device address of the same memory
 * that device-to-device copies can use. */
TEST_IMPL(conformance_host_alloc_device_pointer) {
  gpuipc__ctx_guard g;
  enter0(&g);
  void *hp = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc(
      &hp, HOST_BYTES, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  ASSERT_NOT_NULL(hp);
  CUdeviceptr dp = 0, dev = 0;
  ASSERT_CU(gpuipc__cu.cuMemHostGetDevicePointer(&dp, hp, 0));
  ASSERT_NE(dp, 0);
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dev, HOST_BYTES));

  /* host -> device through the host pointer */
  fill_host(hp, HOST_BYTES, 51);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(dev, hp, HOST_BYTES));
  check_device(dev, HOST_BYTES, 51);
  /* host memory -> device through the device pointer */
  fill_host(hp, HOST_BYTES, 52);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoD(dev, dp, HOST_BYTES));
  check_device(dev, HOST_BYTES, 52);
  /* device -> host memory through the device pointer */
  fill_host(hp, HOST_BYTES, 0);
  void *tmp = malloc(HOST_BYTES);
  ASSERT_NOT_NULL(tmp);
  fill_host(tmp, HOST_BYTES, 53);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(dev, tmp, HOST_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoD(dp, dev, HOST_BYTES));
  /* A device-to-device copy does not wait for completion (cuda.h, "API
   * synchronization behavior"): synchronize before the host reads. */
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  check_host(hp, HOST_BYTES, 53);
  free(tmp);

  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(hp));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE: device memory is DEVICE, pinned and
 * registered host memory is HOST. Device memory also reports its device
 * ordinal. */
TEST_IMPL(conformance_pointer_attribute_memory_types) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr dev = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dev, HOST_BYTES));
  ASSERT_EQ(memory_type(dev), CU_MEMORYTYPE_DEVICE);
  ASSERT_EQ(memory_type(dev + 4096), CU_MEMORYTYPE_DEVICE);
  int ordinal = -1;
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
      &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dev));
  ASSERT_EQ(ordinal, 0);

  void *hp = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc(&hp, HOST_BYTES,
                                      CU_MEMHOSTALLOC_DEVICEMAP));
  ASSERT_EQ(memory_type((CUdeviceptr)(uintptr_t)hp), CU_MEMORYTYPE_HOST);

  void *reg = mmap(NULL, HOST_BYTES, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT(reg != MAP_FAILED);
  ASSERT_CU(gpuipc__cu.cuMemHostRegister(reg, HOST_BYTES,
                                         CU_MEMHOSTREGISTER_DEVICEMAP));
  ASSERT_EQ(memory_type((CUdeviceptr)(uintptr_t)reg), CU_MEMORYTYPE_HOST);
  ASSERT_CU(gpuipc__cu.cuMemHostUnregister(reg));

  ASSERT_EQ(munmap(reg, HOST_BYTES), 0);
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(hp));
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuPointerGetAttributes answers several attributes at once, consistent
 * with cuPointerGetAttribute: memory type, device ordinal, buffer id and the
 * allocation's range for an interior pointer. */
TEST_IMPL(conformance_pointer_attributes_plural) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr dev = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dev, HOST_BYTES));
  unsigned int type = 0;
  int ordinal = -1;
  unsigned long long id = 0, id1 = 0;
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attrs[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
      CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void *data[] = {&type, &ordinal, &id, &start, &size};
  ASSERT_CU(gpuipc__cu.cuPointerGetAttributes(5, attrs, data, dev + 4096));
  ASSERT_EQ(type, CU_MEMORYTYPE_DEVICE);
  ASSERT_EQ(ordinal, 0);
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
      &id1, CU_POINTER_ATTRIBUTE_BUFFER_ID, dev));
  ASSERT_NE(id, 0);
  ASSERT_UEQ(id, id1);
  ASSERT_PTR_EQ((void *)(uintptr_t)start, (void *)(uintptr_t)dev);
  ASSERT_GE(size, HOST_BYTES);
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuPointerGetAttribute): a pointer not allocated, mapped or
 * registered by the driver gives CUDA_ERROR_INVALID_VALUE. To be confirmed
 * on the GPU: with HMM (heterogeneous memory management, open kernel
 * modules) the driver might describe pageable memory instead. */
TEST_IMPL(conformance_pointer_attribute_unknown_memory_invalid_value) {
  gpuipc__ctx_guard g;
  enter0(&g);
  void *p = mmap(NULL, HOST_BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT(p != MAP_FAILED);
  unsigned int type = 0;
  ASSERT_CU_EQ(gpuipc__cu.cuPointerGetAttribute(
                   &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                   (CUdeviceptr)(uintptr_t)p),
               CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(munmap(p, HOST_BYTES), 0);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (CUresult): registering a range that is already registered fails
 * with CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED; unregistering memory that
 * is not registered fails with CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED. */
TEST_IMPL(conformance_host_register_twice_and_unregistered) {
  gpuipc__ctx_guard g;
  enter0(&g);
  void *p = mmap(NULL, HOST_BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT(p != MAP_FAILED);
  ASSERT_CU_EQ(gpuipc__cu.cuMemHostUnregister(p),
               CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  ASSERT_CU(gpuipc__cu.cuMemHostRegister(p, HOST_BYTES, 0));
  ASSERT_CU_EQ(gpuipc__cu.cuMemHostRegister(p, HOST_BYTES, 0),
               CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  ASSERT_CU(gpuipc__cu.cuMemHostUnregister(p));
  ASSERT_CU_EQ(gpuipc__cu.cuMemHostUnregister(p),
               CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  ASSERT_EQ(munmap(p, HOST_BYTES), 0);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Maps a shared memory file and registers it with the driver. */
static void *map_registered(int fd) {
  void *p = mmap(NULL, HOST_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT(p != MAP_FAILED);
  ASSERT_CU(gpuipc__cu.cuMemHostRegister(
      p, HOST_BYTES, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
  return p;
}

static void unmap_registered(void *p) {
  ASSERT_CU(gpuipc__cu.cuMemHostUnregister(p));
  ASSERT_EQ(munmap(p, HOST_BYTES), 0);
}

/* The second process: registers its own mapping of the shared memory, reads
 * what the first wrote (a host-to-device copy, and a device-to-device copy
 * through the device pointer), and writes the upper half with a
 * device-to-host copy. */
HELPER_IMPL(conf_host_register_peer) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  int fd = -1, nfds = 1;
  uint32_t seed = 0;
  ASSERT_EQ(harness_recv(sock, &seed, sizeof seed, &fd, &nfds),
            (ssize_t)sizeof seed);
  ASSERT_EQ(nfds, 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  void *shared = map_registered(fd);
  close(fd);
  size_t half = HOST_BYTES / 2;
  CUdeviceptr dev = 0, dp = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dev, half));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(dev, shared, half));
  check_device(dev, half, seed);
  ASSERT_CU(gpuipc__cu.cuMemsetD8(dev, 0, half));
  ASSERT_CU(gpuipc__cu.cuMemHostGetDevicePointer(&dp, shared, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoD(dev, dp, half));
  check_device(dev, half, seed);

  void *tmp = malloc(half);
  ASSERT_NOT_NULL(tmp);
  fill_host(tmp, half, seed + 1);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(dev, tmp, half));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  free(tmp);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH((char *)shared + half, dev, half));
  harness_send_u64(sock, 2);
  ASSERT_UEQ(harness_recv_u64(sock), 3);
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  unmap_registered(shared);
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Host memory shared between two processes (a memfd mapped in both) and
 * registered with cuMemHostRegister in each: both copy to and from the
 * device through it, and see each other's writes. */
TEST_IMPL(conformance_host_register_shared_two_processes) {
  gpuipc__ctx_guard g;
  enter0(&g);
  int fd = memfd_create("gpuipc-conformance", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, (off_t)HOST_BYTES), 0);
  void *shared = map_registered(fd);
  size_t half = HOST_BYTES / 2;
  uint32_t seed = 54;
  fill_host(shared, half, seed);
  fill_host((char *)shared + half, half, 0);

  int sock = -1;
  pid_t pid = spawn_helper("conf_host_register_peer", NULL, &sock, NULL);
  harness_send(sock, &seed, sizeof seed, &fd, 1);
  ASSERT_UEQ(harness_recv_u64(sock), 2);
  /* The peer's device-to-host copy landed in our mapping... */
  check_host((char *)shared + half, half, seed + 1);
  /* ...and our registration copies it to the device. */
  CUdeviceptr dev = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dev, half));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(dev, (char *)shared + half, half));
  check_device(dev, half, seed + 1);
  harness_send_u64(sock, 3);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  unmap_registered(shared);
  close(fd);
  gpuipc__ctx_leave(&g);
  return 0;
}
