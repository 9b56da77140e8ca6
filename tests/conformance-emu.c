/*
 * conformance-emu.c: checks of the CUDA driver emulator's own features,
 * which make sense only on the emulator (each test starts with
 * REQUIRE_EMULATOR and is skipped on a real GPU): fault injection
 * (GPUIPC_EMU_FAIL), capabilities turned off (GPUIPC_EMU_DISABLE), the
 * number of emulated devices (GPUIPC_EMU_DEVICES), fabric handles
 * (GPUIPC_EMU_FABRIC: the fabric conformance test in each mode), the
 * promise that two processes never see one allocation at the same address,
 * and the conformance checks that need two devices, run with two emulated
 * devices.
 *
 * Settings are read by the emulator once, at its first call, so every
 * scenario runs in a helper process started with the setting in its
 * environment.
 */
#include "harness.h"

#include "tree.h"

#include <unistd.h>

/* ---- fault injection -------------------------------------------------------- */

/* Three cuMemAlloc calls; reports their results. */
HELPER_IMPL(conf_emu_three_allocs) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  int32_t results[4];
  for (int i = 0; i < 3; i++) {
    CUdeviceptr p = 0;
    results[i] = gpuipc__cu.cuMemAlloc(&p, 4096);
    if (results[i] == CUDA_SUCCESS)
      ASSERT_CU(gpuipc__cu.cuMemFree(p));
  }
  size_t free_b = 0, total = 0;
  results[3] = gpuipc__cu.cuMemGetInfo(&free_b, &total);
  harness_send(sock, results, sizeof results, NULL, 0);
  gpuipc__ctx_leave(&g);
  return 0;
}

static void three_allocs(const char *fail, int32_t results[4]) {
  char var[256];
  snprintf(var, sizeof var, "GPUIPC_EMU_FAIL=%s", fail);
  char *env[] = {var, NULL};
  int sock = -1;
  pid_t pid = spawn_helper("conf_emu_three_allocs", env, &sock, NULL);
  ASSERT_EQ(harness_recv(sock, results, 4 * sizeof(int32_t), NULL, NULL),
            (ssize_t)(4 * sizeof(int32_t)));
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
}

/* GPUIPC_EMU_FAIL=NAME:N:ERROR fails exactly the Nth call, with ERROR. */
TEST_IMPL(emu_fail_nth_call) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FAIL is an emulator setting");
  int32_t r[4];
  three_allocs("cuMemAlloc:2:CUDA_ERROR_OUT_OF_MEMORY", r);
  ASSERT_CU(r[0]);
  ASSERT_CU_EQ(r[1], CUDA_ERROR_OUT_OF_MEMORY);
  ASSERT_CU(r[2]);
  ASSERT_CU(r[3]);
  return 0;
}

/* GPUIPC_EMU_FAIL=NAME:* fails every call, by default with
 * CUDA_ERROR_UNKNOWN; a versioned name (cuMemAlloc_v2) is the same function,
 * and other functions are unaffected. */
TEST_IMPL(emu_fail_every_call) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FAIL is an emulator setting");
  int32_t r[4];
  three_allocs("cuMemAlloc:*", r);
  for (int i = 0; i < 3; i++)
    ASSERT_CU_EQ(r[i], CUDA_ERROR_UNKNOWN);
  ASSERT_CU(r[3]);
  three_allocs("cuMemAlloc_v2:*:2", r); /* an error by number */
  for (int i = 0; i < 3; i++)
    ASSERT_CU_EQ(r[i], CUDA_ERROR_OUT_OF_MEMORY);
  ASSERT_CU(r[3]);
  return 0;
}

/* ---- capabilities turned off ------------------------------------------------ */

typedef struct emu_caps {
  int32_t vmm, posix_fd, pools, pool_handle_types, ipc_event, memops64,
      unified;
  int32_t mem_create;  /* cuMemCreate with a POSIX-fd handle type */
  int32_t event_ipc;   /* cuEventCreate(INTERPROCESS | DISABLE_TIMING) */
  int32_t pool_create; /* cuMemPoolCreate with a POSIX-fd handle type */
  int32_t wait64;      /* cuStreamWaitValue64 */
} emu_caps;

static int32_t attr0(CUdevice_attribute a) {
  int v = -1;
  ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(&v, a, 0));
  return v;
}

/* Reports device 0's capability attributes and whether the calls behind
 * them work. */
HELPER_IMPL(conf_emu_caps) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  emu_caps c;
  memset(&c, 0, sizeof c);
  c.vmm = attr0(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  c.posix_fd = attr0(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  c.pools = attr0(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
  c.pool_handle_types = attr0(CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES);
  c.ipc_event = attr0(CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED);
  c.memops64 = attr0(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS);
  c.unified = attr0(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);

  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 2u << 20;
  (void)gpuipc__cu.cuMemGetAllocationGranularity(
      &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  CUmemGenericAllocationHandle h = 0;
  c.mem_create = gpuipc__cu.cuMemCreate(&h, gran, &prop, 0);
  if (c.mem_create == CUDA_SUCCESS)
    ASSERT_CU(gpuipc__cu.cuMemRelease(h));

  CUevent ev = NULL;
  c.event_ipc = gpuipc__cu.cuEventCreate(
      &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
  if (c.event_ipc == CUDA_SUCCESS)
    ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));

  CUmemPoolProps pp;
  memset(&pp, 0, sizeof pp);
  pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  pp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  pp.location.id = 0;
  CUmemoryPool pool = NULL;
  c.pool_create = gpuipc__cu.cuMemPoolCreate(&pool, &pp);
  if (c.pool_create == CUDA_SUCCESS)
    ASSERT_CU(gpuipc__cu.cuMemPoolDestroy(pool));

  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr flag = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&flag, 4096));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(flag, 0, 8, s));
  c.wait64 = gpuipc__cu.cuStreamWaitValue64(s, flag, 0, CU_STREAM_WAIT_VALUE_GEQ);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFree(flag));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));

  harness_send(sock, &c, sizeof c, NULL, 0);
  gpuipc__ctx_leave(&g);
  return 0;
}

static emu_caps caps_with(const char *disable) {
  char var[256];
  snprintf(var, sizeof var, "GPUIPC_EMU_DISABLE=%s", disable ? disable : "");
  char *env[] = {var, NULL};
  int sock = -1;
  pid_t pid = spawn_helper("conf_emu_caps", disable ? env : NULL, &sock, NULL);
  emu_caps c;
  ASSERT_EQ(harness_recv(sock, &c, sizeof c, NULL, NULL), (ssize_t)sizeof c);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  return c;
}

/* Without GPUIPC_EMU_DISABLE every capability gpuipc uses is on. */
TEST_IMPL(emu_capabilities_default_on) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DISABLE is an emulator setting");
  emu_caps c = caps_with(NULL);
  ASSERT_EQ(c.vmm, 1);
  ASSERT_EQ(c.posix_fd, 1);
  ASSERT_EQ(c.pools, 1);
  ASSERT_NE(c.pool_handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  ASSERT_EQ(c.ipc_event, 1);
  ASSERT_EQ(c.memops64, 1);
  ASSERT_EQ(c.unified, 1);
  ASSERT_CU(c.mem_create);
  ASSERT_CU(c.event_ipc);
  ASSERT_CU(c.pool_create);
  ASSERT_CU(c.wait64);
  return 0;
}

/* GPUIPC_EMU_DISABLE=vmm: the attribute says no and cuMemCreate fails;
 * nothing else changes. */
TEST_IMPL(emu_disable_vmm) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DISABLE is an emulator setting");
  emu_caps c = caps_with("vmm");
  ASSERT_EQ(c.vmm, 0);
  ASSERT_NE(c.mem_create, CUDA_SUCCESS);
  ASSERT_EQ(c.pools, 1);
  ASSERT_CU(c.pool_create);
  ASSERT_CU(c.event_ipc);
  return 0;
}

/* GPUIPC_EMU_DISABLE=ipc_event: the attribute says no and an interprocess
 * event cannot be created. */
TEST_IMPL(emu_disable_ipc_event) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DISABLE is an emulator setting");
  emu_caps c = caps_with("ipc_event");
  ASSERT_EQ(c.ipc_event, 0);
  ASSERT_NE(c.event_ipc, CUDA_SUCCESS);
  ASSERT_EQ(c.vmm, 1);
  ASSERT_CU(c.mem_create);
  return 0;
}

/* GPUIPC_EMU_DISABLE=mempool: no memory pools. */
TEST_IMPL(emu_disable_mempool) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DISABLE is an emulator setting");
  emu_caps c = caps_with("mempool");
  ASSERT_EQ(c.pools, 0);
  ASSERT_NE(c.pool_create, CUDA_SUCCESS);
  ASSERT_CU(c.mem_create);
  return 0;
}

/* GPUIPC_EMU_DISABLE=posix_fd: no POSIX-fd handles for VMM or pools. */
TEST_IMPL(emu_disable_posix_fd) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DISABLE is an emulator setting");
  emu_caps c = caps_with("posix_fd");
  ASSERT_EQ(c.posix_fd, 0);
  ASSERT_EQ(c.pool_handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  ASSERT_NE(c.mem_create, CUDA_SUCCESS);
  ASSERT_NE(c.pool_create, CUDA_SUCCESS);
  return 0;
}

/* GPUIPC_EMU_DISABLE=memops64 (and memops, which implies it): no 64-bit
 * stream memory operations. */
TEST_IMPL(emu_disable_memops64) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DISABLE is an emulator setting");
  emu_caps c = caps_with("memops64");
  ASSERT_EQ(c.memops64, 0);
  ASSERT_NE(c.wait64, CUDA_SUCCESS);
  c = caps_with("memops");
  ASSERT_EQ(c.memops64, 0);
  ASSERT_NE(c.wait64, CUDA_SUCCESS);
  return 0;
}

/* ---- emulated devices ------------------------------------------------------- */

typedef struct emu_devs {
  int32_t count;
  int32_t major[8], minor[8];
  CUuuid uuid[8];
} emu_devs;

HELPER_IMPL(conf_emu_devices) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  ASSERT_OK(gpuipc__driver());
  emu_devs d;
  memset(&d, 0, sizeof d);
  int n = 0;
  ASSERT_CU(gpuipc__cu.cuDeviceGetCount(&n));
  ASSERT_LE(n, 8);
  d.count = n;
  for (int i = 0; i < n; i++) {
    int v = 0;
    ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, i));
    d.major[i] = v;
    ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(
        &v, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, i));
    d.minor[i] = v;
    ASSERT_CU(gpuipc__cu.cuDeviceGetUuid(&d.uuid[i], i));
  }
  harness_send(sock, &d, sizeof d, NULL, 0);
  return 0;
}

static emu_devs devices_with(const char *count) {
  char var[64];
  snprintf(var, sizeof var, "GPUIPC_EMU_DEVICES=%s", count);
  /* An outer CUDA_VISIBLE_DEVICES would hide some: remove it. */
  char unset[] = "CUDA_VISIBLE_DEVICES=";
  char *env[] = {var, unset, NULL};
  int sock = -1;
  pid_t pid = spawn_helper("conf_emu_devices", env, &sock, NULL);
  emu_devs d;
  ASSERT_EQ(harness_recv(sock, &d, sizeof d, NULL, NULL), (ssize_t)sizeof d);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  return d;
}

/* GPUIPC_EMU_DEVICES=N gives N devices of compute capability 9.0 with
 * distinct UUIDs, stable from one process to the next. */
TEST_IMPL(emu_devices_setting) {
  REQUIRE_EMULATOR("GPUIPC_EMU_DEVICES is an emulator setting");
  emu_devs a = devices_with("3");
  ASSERT_EQ(a.count, 3);
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(a.major[i], 9);
    ASSERT_EQ(a.minor[i], 0);
    for (int j = 0; j < i; j++)
      ASSERT_NE(memcmp(&a.uuid[i], &a.uuid[j], sizeof a.uuid[i]), 0);
  }
  emu_devs b = devices_with("3");
  ASSERT_MEM_EQ(b.uuid, a.uuid, 3 * sizeof a.uuid[0]);
  emu_devs one = devices_with("1");
  ASSERT_EQ(one.count, 1);
  ASSERT_MEM_EQ(&one.uuid[0], &a.uuid[0], sizeof a.uuid[0]);
  return 0;
}

/* ---- distinct addresses across processes ------------------------------------ */

/* Opens a legacy handle (or imports a pool pointer) and reports the
 * address it got. */
HELPER_IMPL(conf_emu_import_address) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  struct {
    CUipcMemHandle legacy;
    CUmemPoolPtrExportData pool_ptr;
  } m;
  int fd = -1, nfds = 1;
  ASSERT_EQ(harness_recv(sock, &m, sizeof m, &fd, &nfds), (ssize_t)sizeof m);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUdeviceptr q = 0;
  if (nfds == 0) {
    ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&q, m.legacy,
                                            CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    harness_send_u64(sock, q);
    ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(q));
  } else {
    CUmemoryPool pool;
    ASSERT_CU(gpuipc__cu.cuMemPoolImportFromShareableHandle(
        &pool, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        0));
    close(fd);
    ASSERT_CU(gpuipc__cu.cuMemPoolImportPointer(&q, pool, &m.pool_ptr));
    harness_send_u64(sock, q);
    ASSERT_CU(gpuipc__cu.cuMemFree(q));
  }
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The emulator promises that two processes never see one allocation at the
 * same address, so code that wrongly assumes equal addresses fails in CI.
 * (The real driver promises nothing either way: cuda.h, cuIpcOpenMemHandle.) */
TEST_IMPL(emu_legacy_import_address_differs) {
  REQUIRE_EMULATOR("only the emulator promises distinct addresses");
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 1 << 20));
  struct {
    CUipcMemHandle legacy;
    CUmemPoolPtrExportData pool_ptr;
  } m;
  memset(&m, 0, sizeof m);
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&m.legacy, p));
  int sock = -1;
  pid_t pid = spawn_helper("conf_emu_import_address", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  uint64_t q = harness_recv_u64(sock);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_NE(q, 0);
  ASSERT_NE(q, p);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

TEST_IMPL(emu_pool_import_address_differs) {
  REQUIRE_EMULATOR("only the emulator promises distinct addresses");
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUmemPoolProps pp;
  memset(&pp, 0, sizeof pp);
  pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  pp.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  pp.location.id = 0;
  CUmemoryPool pool;
  ASSERT_CU(gpuipc__cu.cuMemPoolCreate(&pool, &pp));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAllocFromPoolAsync(&p, 1 << 20, pool, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  struct {
    CUipcMemHandle legacy;
    CUmemPoolPtrExportData pool_ptr;
  } m;
  memset(&m, 0, sizeof m);
  int fd = -1;
  ASSERT_CU(gpuipc__cu.cuMemPoolExportToShareableHandle(
      &fd, pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  ASSERT_CU(gpuipc__cu.cuMemPoolExportPointer(&m.pool_ptr, p));
  int sock = -1;
  pid_t pid = spawn_helper("conf_emu_import_address", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, &fd, 1);
  close(fd);
  uint64_t q = harness_recv_u64(sock);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_NE(q, 0);
  ASSERT_NE(q, p);
  ASSERT_CU(gpuipc__cu.cuMemFreeAsync(p, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemPoolDestroy(pool));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- two-device conformance checks on two emulated devices ------------------ */

/* Runs one conformance test of this binary in a child process that has two
 * emulated devices; it must pass (not skip). */
static int run_with_two_devices(const char *test) {
  REQUIRE_EMULATOR("emulated devices");
  char devices[] = "GPUIPC_EMU_DEVICES=2";
  char unset[] = "CUDA_VISIBLE_DEVICES=";
  char *env[] = {devices, unset, NULL};
  char *argv[] = {"/proc/self/exe", (char *)test, NULL};
  char out[8192];
  int st = harness_run(argv, env, out, sizeof out);
  printf("%s", out);
  ASSERT_EQ(st, 0);
  return 0;
}

TEST_IMPL(emu_two_devices_uuids_unique) {
  return run_with_two_devices("conformance_device_uuids_unique");
}
TEST_IMPL(emu_two_devices_attributes) {
  return run_with_two_devices("conformance_device_attributes_for_gpuipc");
}
TEST_IMPL(emu_two_devices_can_access_peer) {
  return run_with_two_devices("conformance_device_can_access_peer");
}
TEST_IMPL(emu_two_devices_visible_reorder_ordinals) {
  return run_with_two_devices("conformance_visible_devices_reorder_ordinals");
}
TEST_IMPL(emu_two_devices_visible_reorder_uuids) {
  return run_with_two_devices("conformance_visible_devices_reorder_uuids");
}
TEST_IMPL(emu_two_devices_visible_hide_one) {
  return run_with_two_devices("conformance_visible_devices_hide_one");
}
TEST_IMPL(emu_two_devices_legacy_cross_gpu_open) {
  return run_with_two_devices("conformance_legacy_cross_gpu_open");
}
TEST_IMPL(emu_two_devices_pool_cross_gpu_import) {
  return run_with_two_devices("conformance_pool_cross_gpu_import");
}
TEST_IMPL(emu_two_devices_peer_access_and_copy) {
  return run_with_two_devices("conformance_ctx_peer_access_and_copy");
}
TEST_IMPL(emu_two_devices_stream_wait_event_other_device) {
  return run_with_two_devices("conformance_stream_wait_event_other_device");
}

/* ---- fabric handles ----------------------------------------------------------- */

/* Runs conformance_fabric_handle_export_import in a child with
 * GPUIPC_EMU_FABRIC=mode (empty: unset) and, when fail is not NULL,
 * GPUIPC_EMU_FAIL=fail; returns its exit status, its output in out. */
static int run_fabric(const char *mode, const char *fail, char *out, size_t cap) {
  char fabric[64], faults[128];
  snprintf(fabric, sizeof fabric, "GPUIPC_EMU_FABRIC=%s", mode);
  snprintf(faults, sizeof faults, "GPUIPC_EMU_FAIL=%s", fail ? fail : "");
  char *env[] = {fabric, faults, NULL};
  char *argv[] = {"/proc/self/exe", "conformance_fabric_handle_export_import", NULL};
  int st = harness_run(argv, env, out, cap);
  printf("GPUIPC_EMU_FABRIC=%s%s%s: exit %d\n%s", mode, fail ? " GPUIPC_EMU_FAIL=" : "",
         fail ? fail : "", st, out);
  return st;
}

/* What the skip line says of the IMEX channels: this machine's state, as
 * the library describes it. */
static void imex_line(char *buf, size_t cap) {
  gpuipc__imex x;
  gpuipc__imex_probe(&x);
  char state[1024];
  gpuipc__imex_describe(&x, state, sizeof state);
  snprintf(buf, cap, "IMEX channels: %s\n", state);
}

/* Unsupported (the default): the attribute is 0 and cuMemCreate refuses;
 * the fabric test skips, saying so. */
TEST_IMPL(emu_fabric_unsupported_is_refused) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FABRIC");
  char out[8192];
  ASSERT_EQ(run_fabric("", NULL, out, sizeof out), TEST_SKIP);
  ASSERT_STR_CONTAINS(out, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0\n");
  ASSERT_STR_CONTAINS(out, "fabric: cuMemCreate -> CUDA_ERROR_NOT_SUPPORTED\n");
  ASSERT_STR_CONTAINS(out, "SKIP: fabric handles not supported (attribute 0), and cuMemCreate "
                           "refused them with CUDA_ERROR_NOT_SUPPORTED");
  return 0;
}

/* Supported, no IMEX channel: cuMemCreate refuses with NOT_PERMITTED and
 * the test skips with that answer and the channels' state; it does not
 * pass. */
TEST_IMPL(emu_fabric_no_channel_skips_with_the_answer) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FABRIC");
  char out[8192], imex[1100];
  ASSERT_EQ(run_fabric("no-channel", NULL, out, sizeof out), TEST_SKIP);
  ASSERT_STR_CONTAINS(out, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 1\n");
  ASSERT_STR_CONTAINS(out, "SKIP: the device reports fabric handles supported (attribute 1), "
                           "but cuMemCreate returned CUDA_ERROR_NOT_PERMITTED; IMEX channels: "
                           GPUIPC__IMEX_DIR);
  imex_line(imex, sizeof imex);
  ASSERT_STR_CONTAINS(out, imex);
  return 0;
}

/* Fabric handles that work: the allocation's bytes cross to the importer
 * and back, and the test passes. */
TEST_IMPL(emu_fabric_handles_cross_processes) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FABRIC");
  char out[8192];
  ASSERT_EQ(run_fabric("yes", NULL, out, sizeof out), 0);
  ASSERT_STR_CONTAINS(out, "fabric: cuMemExportToShareableHandle -> CUDA_SUCCESS\n");
  ASSERT_STR_CONTAINS(out, "fabric: cuMemImportFromShareableHandle (another process) -> "
                           "CUDA_SUCCESS\n");
  return 0;
}

/* The export works but the other process's import is refused (injected
 * into the importer, a process of its own): a skip with the import's
 * answer, not a pass. */
TEST_IMPL(emu_fabric_import_refused_skips) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FABRIC");
  char out[8192];
  ASSERT_EQ(run_fabric("yes", "cuMemImportFromShareableHandle:1:CUDA_ERROR_NOT_PERMITTED", out,
                       sizeof out),
            TEST_SKIP);
  ASSERT_STR_CONTAINS(out, "SKIP: the export succeeded, but cuMemImportFromShareableHandle in "
                           "another process returned CUDA_ERROR_NOT_PERMITTED; IMEX channels: ");
  return 0;
}

/* ---- the one kernel ----------------------------------------------------------- */

/* The emulator's modules and its gather kernel (the library's whole-set
 * copies launch it; on a GPU the real image runs, tested by the sets_
 * tests): an image that is no fatbin is refused, a fatbin's functions are
 * gpuipc_gather alone, a launch checks the parameter and the grid, copies
 * in stream order (after a memset queued before it), and fails after the
 * module is unloaded. */
TEST_IMPL(emu_gather_kernel) {
  REQUIRE_EMULATOR("the emulator's stand-in for a kernel");
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUmodule mod = NULL;
  static const uint32_t not_fatbin[4] = {0x464c457fu, 0, 0, 0}; /* ELF */
  static const uint32_t fatbin[4] = {0xBA55ED50u, 0x00100001u, 0, 0};
  ASSERT_EQ(gpuipc__cu.cuModuleLoadData(&mod, not_fatbin), CUDA_ERROR_INVALID_IMAGE);
  ASSERT_CU(gpuipc__cu.cuModuleLoadData(&mod, fatbin));
  CUfunction fn = NULL;
  ASSERT_EQ(gpuipc__cu.cuModuleGetFunction(&fn, mod, "other"), CUDA_ERROR_NOT_FOUND);
  ASSERT_CU(gpuipc__cu.cuModuleGetFunction(&fn, mod, GPUIPC__GATHER_NAME));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  enum { LEN = 4096 };
  CUdeviceptr src, dst;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&src, 2 * LEN));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dst, 2 * LEN));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(src, 7, 2 * LEN));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(dst, 0, 2 * LEN));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(src, 9, LEN, s));
  static gpuipc__gather_args a;
  a.n = 2;
  a.e[0] = (gpuipc__gather_entry){src, dst + LEN, LEN};
  a.e[1] = (gpuipc__gather_entry){src + LEN, dst + 1, LEN - 1};
  void *params[] = {&a};
  /* grid.x must be the count. */
  ASSERT_EQ(gpuipc__cu.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, params, NULL),
            CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(gpuipc__cu.cuLaunchKernel(fn, 2, 1, 1, 512, 1, 1, 0, s, params, NULL),
            CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(gpuipc__cu.cuLaunchKernel(fn, 2, 4, 1, 256, 1, 1, 0, s, params, NULL));
  a.n = 0; /* the parameter was taken at the launch */
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  static uint8_t back[2 * LEN];
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, dst, sizeof back));
  ASSERT_EQ(back[0], 0);
  for (size_t k = 1; k < LEN; k++)
    ASSERT_EQ(back[k], 7);
  for (size_t k = LEN; k < 2 * LEN; k++)
    ASSERT_EQ(back[k], 9);
  /* A range outside device memory fails the launch. */
  a.n = 1;
  a.e[0] = (gpuipc__gather_entry){src, dst + LEN, 2 * LEN};
  ASSERT_EQ(gpuipc__cu.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, params, NULL),
            CUDA_ERROR_ILLEGAL_ADDRESS);
  ASSERT_CU(gpuipc__cu.cuModuleUnload(mod));
  a.e[0].len = LEN;
  ASSERT_EQ(gpuipc__cu.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, s, params, NULL),
            CUDA_ERROR_INVALID_HANDLE);
  ASSERT_CU(gpuipc__cu.cuMemFree(src));
  ASSERT_CU(gpuipc__cu.cuMemFree(dst));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}
