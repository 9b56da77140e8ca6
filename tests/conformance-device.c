/*
 * conformance-device.c: conformance checks for devices (count, UUIDs, the
 * attributes gpuipc depends on, peer access, CUDA_VISIBLE_DEVICES reordering
 * and hiding in another process), contexts (no current context, primary
 * context retain/release), cuMemGetInfo accounting, and a process forked
 * after cuInit. Written against the driver API directly.
 *
 * Every check must pass on the real driver and on the emulator.
 */
#include "harness.h"

#include "tree.h"

#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_DEVS 16

/* What a helper reports about the devices it sees. */
typedef struct device_view {
  int32_t init_result; /* cuInit's CUresult */
  int32_t count;
  CUuuid uuid[MAX_DEVS];
} device_view;

/* ---- small utilities ------------------------------------------------------ */

static int device_count(void) {
  ASSERT_OK(gpuipc__driver());
  int n = 0;
  ASSERT_CU(gpuipc__cu.cuDeviceGetCount(&n));
  return n;
}

static CUuuid device_uuid(int ordinal) {
  CUdevice dev;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, ordinal));
  CUuuid u;
  memset(&u, 0, sizeof u);
  ASSERT_CU(gpuipc__cu.cuDeviceGetUuid(&u, dev));
  return u;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", the form CUDA_VISIBLE_DEVICES
 * accepts (and nvidia-smi prints). */
static void format_uuid(const CUuuid *u, char out[48]) {
  const unsigned char *b = (const unsigned char *)u->bytes;
  snprintf(out, 48,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
           "%02x%02x%02x%02x%02x%02x",
           b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10],
           b[11], b[12], b[13], b[14], b[15]);
}

static int attribute(CUdevice dev, CUdevice_attribute a) {
  int v = -1;
  ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(&v, a, dev));
  return v;
}

/* ---- devices --------------------------------------------------------------- */

/* At least one device; an ordinal past the end is CUDA_ERROR_INVALID_DEVICE. */
TEST_IMPL(conformance_device_count_positive) {
  int n = device_count();
  printf("%d device(s)\n", n);
  ASSERT_GE(n, 1);
  CUdevice dev;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, n - 1));
  ASSERT_CU_EQ(gpuipc__cu.cuDeviceGet(&dev, n), CUDA_ERROR_INVALID_DEVICE);
  return 0;
}

/* Each device has a UUID, distinct from every other's (gpuipc names devices
 * across processes by UUID). */
TEST_IMPL(conformance_device_uuids_unique) {
  int n = device_count();
  ASSERT_LE(n, MAX_DEVS);
  CUuuid u[MAX_DEVS];
  static const CUuuid zero;
  for (int i = 0; i < n; i++) {
    u[i] = device_uuid(i);
    char text[48];
    format_uuid(&u[i], text);
    printf("device %d: %s\n", i, text);
    ASSERT_NE(memcmp(&u[i], &zero, sizeof zero), 0);
    for (int j = 0; j < i; j++)
      ASSERT_NE(memcmp(&u[i], &u[j], sizeof u[i]), 0);
  }
  return 0;
}

/* The capabilities gpuipc uses, as an H200 with driver 580 reports them.
 * Attributes whose value on that machine is not recorded are printed, not
 * asserted. */
TEST_IMPL(conformance_device_attributes_for_gpuipc) {
  int n = device_count();
  for (int i = 0; i < n; i++) {
    CUdevice dev;
    ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, i));
    int major = attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    int minor = attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    int nor = attribute(dev, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR);
    int host_ptr = attribute(dev, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM);
    int handle_types = attribute(dev, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES);
    char name[256] = "";
    ASSERT_CU(gpuipc__cu.cuDeviceGetName(name, (int)sizeof name, dev));
    printf("device %d: %s, compute capability %d.%d, mempool handle types "
           "0x%x, wait-value NOR %d, host pointer for registered memory %d\n",
           i, name, major, minor, handle_types, nor, host_ptr);

    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING), 1);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED), 1);
    ASSERT_EQ(handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED), 1);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED), 1);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED), 1);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS), 1);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY), 1);
    ASSERT_EQ(attribute(dev, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED), 1);
    size_t total = 0;
    ASSERT_CU(gpuipc__cu.cuDeviceTotalMem(&total, dev));
    ASSERT_GT(total, 0);
    char bus[32] = "";
    ASSERT_CU(gpuipc__cu.cuDeviceGetPCIBusId(bus, (int)sizeof bus, dev));
    CUdevice again = -1;
    ASSERT_CU(gpuipc__cu.cuDeviceGetByPCIBusId(&again, bus));
    ASSERT_EQ(again, dev);
  }
  return 0;
}

/* With two devices (two H200s on NVLink): peer access is possible both
 * ways. */
TEST_IMPL(conformance_device_can_access_peer) {
  REQUIRE_DEVICES(2);
  CUdevice d0, d1;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&d0, 0));
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&d1, 1));
  int can = -1;
  ASSERT_CU(gpuipc__cu.cuDeviceCanAccessPeer(&can, d0, d1));
  ASSERT_EQ(can, 1);
  can = -1;
  ASSERT_CU(gpuipc__cu.cuDeviceCanAccessPeer(&can, d1, d0));
  ASSERT_EQ(can, 1);
  int supported = -1;
  ASSERT_CU(gpuipc__cu.cuDeviceGetP2PAttribute(
      &supported, CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, d0, d1));
  ASSERT_EQ(supported, 1);
  return 0;
}

/* With two devices: enabling peer access from device 0's primary context
 * to device 1's works once; a second time is
 * CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED (cuda.h, cuCtxEnablePeerAccess).
 * cuMemcpyPeer then copies device 0's memory into device 1's, and back. */
TEST_IMPL(conformance_ctx_peer_access_and_copy) {
  REQUIRE_DEVICES(2);
  CUcontext c0, c1;
  ASSERT_OK(gpuipc__primary_ctx(0, &c0));
  ASSERT_OK(gpuipc__primary_ctx(1, &c1));
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuCtxEnablePeerAccess(c1, 0));
  ASSERT_CU_EQ(gpuipc__cu.cuCtxEnablePeerAccess(c1, 0),
               CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  const size_t n = (size_t)1 << 20;
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&a, n));
  uint32_t *h = malloc(n), *back = malloc(n);
  ASSERT_NOT_NULL(h);
  ASSERT_NOT_NULL(back);
  for (size_t i = 0; i < n / 4; i++)
    h[i] = (uint32_t)(i * 2654435761u + 7u);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(a, h, n));
  gpuipc__ctx_leave(&g);

  ASSERT_OK(gpuipc__ctx_enter(&g, 1));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&b, n));
  ASSERT_CU(gpuipc__cu.cuMemcpyPeer(b, c1, a, c0, n));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  memset(back, 0, n);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, b, n));
  ASSERT_MEM_EQ(back, h, n);
  int ordinal = -1;
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
      &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, b));
  ASSERT_EQ(ordinal, 1);
  ASSERT_CU(gpuipc__cu.cuMemFree(b));
  gpuipc__ctx_leave(&g);

  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuMemFree(a));
  gpuipc__ctx_leave(&g);
  free(h);
  free(back);
  return 0;
}

/* ---- CUDA_VISIBLE_DEVICES, seen from another process ----------------------- */

/* Reports what this process sees: cuInit's result, the count and UUIDs. */
HELPER_IMPL(conf_device_view) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  device_view v;
  memset(&v, 0, sizeof v);
  ASSERT_OK(gpuipc__driver_load());
  v.init_result = gpuipc__cu.cuInit(0);
  if (v.init_result == CUDA_SUCCESS) {
    int n = 0;
    ASSERT_CU(gpuipc__cu.cuDeviceGetCount(&n));
    ASSERT_LE(n, MAX_DEVS);
    v.count = n;
    for (int i = 0; i < n; i++) {
      CUdevice dev;
      ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, i));
      ASSERT_CU(gpuipc__cu.cuDeviceGetUuid(&v.uuid[i], dev));
    }
  }
  harness_send(sock, &v, sizeof v, NULL, 0);
  return 0;
}

static device_view view_with(const char *visible) {
  char var[512];
  snprintf(var, sizeof var, "CUDA_VISIBLE_DEVICES=%s", visible);
  char *env[] = {var, NULL};
  int sock = -1;
  pid_t pid = spawn_helper("conf_device_view", env, &sock, NULL);
  device_view v;
  ASSERT_EQ(harness_recv(sock, &v, sizeof v, NULL, NULL), (ssize_t)sizeof v);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  printf("CUDA_VISIBLE_DEVICES=%s: cuInit %s, %d device(s)\n", visible,
         harness_cuda_error_name(v.init_result), (int)v.count);
  return v;
}

static void assert_uuid_eq(const CUuuid *a, const CUuuid *b) {
  char ta[48], tb[48];
  format_uuid(a, ta);
  format_uuid(b, tb);
  ASSERT_STR_EQ(ta, tb);
}

/* CUDA_VISIBLE_DEVICES=1,0 in another process swaps the ordinals: its
 * device 0 is our device 1. Ordinals in the variable count in the driver's
 * own enumeration, so this runs only when this process sees that enumeration
 * (no CUDA_VISIBLE_DEVICES of its own). */
TEST_IMPL(conformance_visible_devices_reorder_ordinals) {
  REQUIRE_DEVICES(2);
  const char *mine = getenv("CUDA_VISIBLE_DEVICES");
  if (mine != NULL)
    SKIP("this process has CUDA_VISIBLE_DEVICES=%s; ordinals would not match",
         mine);
  CUuuid u0 = device_uuid(0), u1 = device_uuid(1);
  device_view v = view_with("1,0");
  ASSERT_CU(v.init_result);
  ASSERT_EQ(v.count, 2);
  assert_uuid_eq(&v.uuid[0], &u1);
  assert_uuid_eq(&v.uuid[1], &u0);
  return 0;
}

/* CUDA_VISIBLE_DEVICES accepts UUIDs ("GPU-..."), in any order. */
TEST_IMPL(conformance_visible_devices_reorder_uuids) {
  REQUIRE_DEVICES(2);
  CUuuid u0 = device_uuid(0), u1 = device_uuid(1);
  char t0[48], t1[48], list[100];
  format_uuid(&u0, t0);
  format_uuid(&u1, t1);
  snprintf(list, sizeof list, "%s,%s", t1, t0);
  device_view v = view_with(list);
  ASSERT_CU(v.init_result);
  ASSERT_EQ(v.count, 2);
  assert_uuid_eq(&v.uuid[0], &u1);
  assert_uuid_eq(&v.uuid[1], &u0);
  return 0;
}

/* Naming one device hides the others: the process sees one device, ours
 * number 1, as its device 0. */
TEST_IMPL(conformance_visible_devices_hide_one) {
  REQUIRE_DEVICES(2);
  CUuuid u1 = device_uuid(1);
  char t1[48];
  format_uuid(&u1, t1);
  device_view v = view_with(t1);
  ASSERT_CU(v.init_result);
  ASSERT_EQ(v.count, 1);
  assert_uuid_eq(&v.uuid[0], &u1);
  return 0;
}

/* An invalid entry first hides every device: cuInit fails with
 * CUDA_ERROR_NO_DEVICE (the usual "CUDA_VISIBLE_DEVICES=-1"). */
TEST_IMPL(conformance_visible_devices_hide_all) {
  ASSERT_GE(device_count(), 1);
  device_view v = view_with("-1");
  ASSERT_CU_EQ(v.init_result, CUDA_ERROR_NO_DEVICE);
  return 0;
}

/* ---- contexts ----------------------------------------------------------- */

typedef struct no_ctx_result {
  CUresult get_current;
  CUcontext current;
  CUresult alloc;
} no_ctx_result;

static void *no_ctx_thread(void *arg) {
  no_ctx_result *r = arg;
  r->current = (CUcontext)(uintptr_t)1;
  r->get_current = gpuipc__cu.cuCtxGetCurrent(&r->current);
  CUdeviceptr p = 0;
  r->alloc = gpuipc__cu.cuMemAlloc(&p, 4096);
  if (r->alloc == CUDA_SUCCESS)
    gpuipc__cu.cuMemFree(p);
  return NULL;
}

/* A call that needs a context fails with CUDA_ERROR_INVALID_CONTEXT when
 * none is current: on a fresh thread (even while another thread has the
 * primary context current; the driver API never makes one current by
 * itself), and on the main thread before any context was made current. */
TEST_IMPL(conformance_ctx_none_current_invalid_context) {
  ASSERT_OK(gpuipc__driver());
  CUdeviceptr p = 0;
  CUcontext cur = (CUcontext)(uintptr_t)1;
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&cur));
  ASSERT_NULL(cur);
  ASSERT_CU_EQ(gpuipc__cu.cuMemAlloc(&p, 4096), CUDA_ERROR_INVALID_CONTEXT);

  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  no_ctx_result r;
  memset(&r, 0, sizeof r);
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, no_ctx_thread, &r), 0);
  ASSERT_EQ(pthread_join(t, NULL), 0);
  ASSERT_CU(r.get_current);
  ASSERT_NULL(r.current);
  ASSERT_CU_EQ(r.alloc, CUDA_ERROR_INVALID_CONTEXT);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The primary context: inactive in a fresh process, active and the same
 * context on every retain, current on push with its device, and reset when
 * the last retain is released. (This test does not use gpuipc's context
 * cache, which retains for the life of the process.) */
TEST_IMPL(conformance_ctx_primary_retain_release) {
  ASSERT_OK(gpuipc__driver());
  CUdevice dev;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  unsigned int flags = 0;
  int active = -1;
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxGetState(dev, &flags, &active));
  ASSERT_EQ(active, 0);

  CUcontext a = NULL, b = NULL;
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxRetain(&a, dev));
  ASSERT_NOT_NULL(a);
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxGetState(dev, &flags, &active));
  ASSERT_EQ(active, 1);
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxRetain(&b, dev));
  ASSERT_PTR_EQ(a, b);

  ASSERT_CU(gpuipc__cu.cuCtxPushCurrent(a));
  CUcontext cur = NULL;
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&cur));
  ASSERT_PTR_EQ(cur, a);
  CUdevice cdev = -1;
  ASSERT_CU(gpuipc__cu.cuCtxGetDevice(&cdev));
  ASSERT_EQ(cdev, dev);
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 4096));
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  CUcontext popped = NULL;
  ASSERT_CU(gpuipc__cu.cuCtxPopCurrent(&popped));
  ASSERT_PTR_EQ(popped, a);
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&cur));
  ASSERT_NULL(cur);

  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxRelease(dev));
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxGetState(dev, &flags, &active));
  ASSERT_EQ(active, 1);
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxRelease(dev));
  ASSERT_CU(gpuipc__cu.cuDevicePrimaryCtxGetState(dev, &flags, &active));
  ASSERT_EQ(active, 0);
  return 0;
}

/* cuMemGetInfo: free memory drops by about 64 MiB after a 64 MiB
 * allocation and comes back after the free. On a real GPU other processes
 * (other tests, run in parallel) allocate too, so each difference is allowed
 * a margin and the measurement is retried. */
TEST_IMPL(conformance_mem_get_info_tracks_alloc) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  const size_t n = (size_t)64 << 20;
  const long long margin = 8ll << 20;
  size_t total = 0;
  long long took = 0, returned = 0;
  bool ok = false;
  for (int attempt = 0; attempt < 20 && !ok; attempt++) {
    size_t f0 = 0, f1 = 0, f2 = 0;
    ASSERT_CU(gpuipc__cu.cuMemGetInfo(&f0, &total));
    CUdeviceptr p = 0;
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, n));
    ASSERT_CU(gpuipc__cu.cuMemGetInfo(&f1, &total));
    ASSERT_CU(gpuipc__cu.cuMemFree(p));
    ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
    ASSERT_CU(gpuipc__cu.cuMemGetInfo(&f2, &total));
    ASSERT_LE(f0, total);
    took = (long long)f0 - (long long)f1;
    returned = (long long)f2 - (long long)f1;
    ok = llabs(took - (long long)n) <= margin &&
         llabs(returned - (long long)n) <= margin;
    if (!ok)
      usleep(100 * 1000);
  }
  printf("64 MiB allocation: free memory dropped by %lld, came back by %lld "
         "(total %zu)\n",
         took, returned, total);
  ASSERT(ok);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- fork ---------------------------------------------------------------- */

/* A process forked after cuInit cannot use CUDA (DESIGN): gpuipc refuses in
 * the child with GPUIPC_E_FORKED, without calling the driver. The child
 * leaves with _exit so that no exit handler touches the driver either. */
TEST_IMPL(conformance_fork_after_init_refused) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  fflush(NULL);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    gpuipc_status s = gpuipc__driver();
    _exit(s == GPUIPC_E_FORKED ? 0 : 10 + (int)s);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT(WIFEXITED(st));
  ASSERT_EQ(WEXITSTATUS(st), 0);
  /* The parent is unaffected. */
  ASSERT_OK(gpuipc__driver());
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 4096));
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}
