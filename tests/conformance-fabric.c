/*
 * conformance-fabric.c: fabric handles (CU_MEM_HANDLE_TYPE_FABRIC), written
 * against the driver API directly: a VMM allocation created with the
 * fabric handle type, exported into a CUmemFabricHandle, and the handle's
 * 64 bytes, no file descriptor, sent to another process, which imports,
 * maps and reads them, and writes back.
 *
 * gpuipc shares nothing by fabric handles yet; this test records what the
 * driver does with them (docs/driver-behaviour.md). cuda.h lets the driver
 * refuse them for two reasons: the device does not support them
 * (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0), or the process has
 * no IMEX channel it may open (/dev/nvidia-caps-imex-channels). So a
 * refusal must agree with the attribute:
 *   - attribute 0: some call must refuse (accepted, the test fails); the
 *     test then skips, naming the refusal: nothing was shared;
 *   - attribute 1 and refused (expected of an H200 without an IMEX
 *     channel): the test skips with the driver's answer and the channels'
 *     state, so it never passes without the data having crossed;
 *   - attribute 1 and accepted: the data must cross both ways.
 * Every driver answer is printed. On the emulator GPUIPC_EMU_FABRIC picks
 * which of these holds (conformance-emu.c runs all three).
 */
#include "conformance.h"
#include "harness.h"

#include "tree.h"

#include <unistd.h>

typedef struct fabric_msg {
  uint64_t bytes;
  uint32_t seed;  /* pattern the exporter wrote */
  uint32_t seed2; /* pattern the importer writes back */
  CUmemFabricHandle handle;
} fabric_msg;

static CUmemAllocationProp fabric_prop(void) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  return prop;
}

/* Reserves an address range for the allocation, maps it and grants device
 * 0 read-write access. */
static CUdeviceptr fabric_map(CUmemGenericAllocationHandle h, size_t bytes) {
  CUdeviceptr va = 0;
  ASSERT_CU(gpuipc__cu.cuMemAddressReserve(&va, bytes, 0, 0, 0));
  ASSERT_CU(gpuipc__cu.cuMemMap(va, bytes, 0, h, 0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU(gpuipc__cu.cuMemSetAccess(va, bytes, &d, 1));
  return va;
}

static void fabric_unmap(CUdeviceptr va, size_t bytes) {
  ASSERT_CU(gpuipc__cu.cuMemUnmap(va, bytes));
  ASSERT_CU(gpuipc__cu.cuMemAddressFree(va, bytes));
}

/* Prints one driver answer and returns it. */
static CUresult answer(const char *call, CUresult r) {
  printf("fabric: %s -> %s\n", call, harness_cuda_error_name(r));
  return r;
}

/* Importer: imports the fabric handle's bytes, maps the allocation, reads
 * the exporter's pattern and writes its own. It first reports the import's
 * answer (0: imported), and only then takes part in the exchange. */
HELPER_IMPL(conf_fabric_importer) {
  (void)argc;
  (void)argv;
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  fabric_msg msg;
  ASSERT_EQ(harness_recv(sock, &msg, sizeof msg, NULL, NULL), (ssize_t)sizeof msg);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUmemGenericAllocationHandle h = 0;
  CUresult r = gpuipc__cu.cuMemImportFromShareableHandle(&h, &msg.handle,
                                                          CU_MEM_HANDLE_TYPE_FABRIC);
  harness_send_u64(sock, (uint64_t)r);
  if (r != CUDA_SUCCESS) {
    gpuipc__ctx_leave(&g);
    return 0;
  }
  size_t bytes = (size_t)msg.bytes;
  CUdeviceptr va = fabric_map(h, bytes);
  conf_check_pattern(va, bytes, msg.seed);
  conf_put_pattern(va, bytes, msg.seed2);
  harness_send_u64(sock, 2);             /* read and written */
  ASSERT_UEQ(harness_recv_u64(sock), 3); /* the exporter has read it */
  fabric_unmap(va, bytes);
  ASSERT_CU(gpuipc__cu.cuMemRelease(h));
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The IMEX channels' state in words (gpuipc__imex_describe). */
static const char *imex_state(char *buf, size_t cap) {
  gpuipc__imex x;
  gpuipc__imex_probe(&x);
  gpuipc__imex_describe(&x, buf, cap);
  return buf;
}

TEST_IMPL(conformance_fabric_handle_export_import) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUdevice dev = 0;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  int attr = -1;
  ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(&attr, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
                                            dev));
  printf("fabric: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = %d\n", attr);
  char imex[1024];
  printf("fabric: IMEX channels: %s\n", imex_state(imex, sizeof imex));

  /* Export: the first call that refuses ends it. */
  CUmemAllocationProp prop = fabric_prop();
  size_t gran = 0;
  const char *refused = NULL;
  CUresult r = answer("cuMemGetAllocationGranularity",
                      gpuipc__cu.cuMemGetAllocationGranularity(&gran, &prop,
                                                               CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if (r != CUDA_SUCCESS)
    refused = "cuMemGetAllocationGranularity";
  CUmemGenericAllocationHandle h = 0;
  bool created = false;
  if (!refused) {
    ASSERT_GT(gran, 0);
    r = answer("cuMemCreate", gpuipc__cu.cuMemCreate(&h, gran, &prop, 0));
    created = r == CUDA_SUCCESS;
    if (!created)
      refused = "cuMemCreate";
  }
  fabric_msg msg;
  memset(&msg, 0, sizeof msg);
  if (!refused) {
    r = answer("cuMemExportToShareableHandle",
               gpuipc__cu.cuMemExportToShareableHandle(&msg.handle, h, CU_MEM_HANDLE_TYPE_FABRIC,
                                                       0));
    if (r != CUDA_SUCCESS)
      refused = "cuMemExportToShareableHandle";
  }
  if (refused) {
    if (created)
      ASSERT_CU(gpuipc__cu.cuMemRelease(h));
    gpuipc__ctx_leave(&g);
    if (attr == 0)
      SKIP("fabric handles not supported (attribute 0), and %s refused them with %s, as it "
           "should: nothing to share",
           refused, harness_cuda_error_name(r));
    SKIP("the device reports fabric handles supported (attribute %d), but %s returned %s; "
         "IMEX channels: %s",
         attr, refused, harness_cuda_error_name(r), imex);
  }
  /* The device says it does not support them, and the driver exported one. */
  if (attr == 0)
    harness_fail(__FILE__, __LINE__,
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0, yet cuMemCreate and "
                 "cuMemExportToShareableHandle accepted CU_MEM_HANDLE_TYPE_FABRIC");

  CUdeviceptr va = fabric_map(h, gran);
  conf_put_pattern(va, gran, 61);
  msg.bytes = gran;
  msg.seed = 61;
  msg.seed2 = 61 + 1000;
  int sock = -1;
  pid_t pid = spawn_helper("conf_fabric_importer", NULL, &sock, NULL);
  harness_send(sock, &msg, sizeof msg, NULL, 0); /* the handle's bytes only, no fd */
  r = (CUresult)harness_recv_u64(sock);
  answer("cuMemImportFromShareableHandle (another process)", r);
  if (r == CUDA_SUCCESS) {
    ASSERT_UEQ(harness_recv_u64(sock), 2);
    conf_check_pattern(va, gran, msg.seed2);
    harness_send_u64(sock, 3);
    ASSERT_UEQ(harness_recv_u64(sock), 1);
  }
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  fabric_unmap(va, gran);
  ASSERT_CU(gpuipc__cu.cuMemRelease(h));
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    SKIP("the export succeeded, but cuMemImportFromShareableHandle in another process "
         "returned %s; IMEX channels: %s",
         harness_cuda_error_name(r), imex);
  return 0;
}
