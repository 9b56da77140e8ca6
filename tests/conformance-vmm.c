/*
 * conformance-vmm.c: conformance checks for the virtual memory management
 * API with POSIX file descriptor handles (cuMemCreate,
 * cuMemExportToShareableHandle / cuMemImportFromShareableHandle,
 * cuMemAddressReserve / cuMemMap / cuMemSetAccess / cuMemUnmap /
 * cuMemRelease / cuMemAddressFree, allocation granularity), written against
 * the driver API directly.
 *
 * Every check must pass on the real driver and on the emulator (the cuda.h
 * documentation of these calls is the reference). Sharing runs in two real
 * processes; the allocation's descriptor travels through SCM_RIGHTS.
 */
#include "conformance.h"
#include "harness.h"

#include "tree.h"

#include <fcntl.h>
#include <unistd.h>

typedef struct vmm_msg {
  uint64_t bytes;
  uint32_t seed;  /* pattern the exporter wrote */
  uint32_t seed2; /* pattern the importer writes back */
} vmm_msg;

/* One allocation mapped into this process. */
typedef struct vmm_map {
  CUmemGenericAllocationHandle handle;
  CUdeviceptr va;
  size_t bytes;
  bool released;
} vmm_map;

/* ---- small utilities ------------------------------------------------------ */

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

/* Pinned memory of device 0, exportable as a POSIX file descriptor. */
static CUmemAllocationProp device_prop(void) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

static size_t granularity(CUmemAllocationGranularity_flags which) {
  CUmemAllocationProp prop = device_prop();
  size_t gran = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetAllocationGranularity(&gran, &prop, which));
  ASSERT_GT(gran, 0);
  return gran;
}

/* Reserves an address range for the handle, maps it and grants device 0
 * read-write access (a mapping starts with no access at all). */
static void map_handle(vmm_map *m) {
  ASSERT_CU(gpuipc__cu.cuMemAddressReserve(&m->va, m->bytes, 0, 0, 0));
  ASSERT_CU(gpuipc__cu.cuMemMap(m->va, m->bytes, 0, m->handle, 0));
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_CU(gpuipc__cu.cuMemSetAccess(m->va, m->bytes, &d, 1));
}

static void create_mapped(vmm_map *m, size_t bytes) {
  memset(m, 0, sizeof *m);
  m->bytes = bytes;
  CUmemAllocationProp prop = device_prop();
  ASSERT_CU(gpuipc__cu.cuMemCreate(&m->handle, bytes, &prop, 0));
  map_handle(m);
}

static void unmap_all(vmm_map *m) {
  ASSERT_CU(gpuipc__cu.cuMemUnmap(m->va, m->bytes));
  if (!m->released)
    ASSERT_CU(gpuipc__cu.cuMemRelease(m->handle));
  m->released = true;
  ASSERT_CU(gpuipc__cu.cuMemAddressFree(m->va, m->bytes));
}

/* ---- in-process checks --------------------------------------------------- */

/* The allocation granularity: the minimum is a power of two; the
 * recommended one is a multiple of it. */
TEST_IMPL(conformance_vmm_granularity) {
  gpuipc__ctx_guard g;
  enter0(&g);
  size_t min = granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  size_t rec = granularity(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  printf("granularity: minimum %zu, recommended %zu\n", min, rec);
  ASSERT_EQ(min & (min - 1), 0);
  ASSERT_GE(min, 4096);
  ASSERT_GE(rec, min);
  ASSERT_EQ(rec % min, 0);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuMemCreate): the size must be a multiple of the minimum
 * granularity; otherwise CUDA_ERROR_INVALID_VALUE. */
TEST_IMPL(conformance_vmm_create_non_multiple_fails) {
  gpuipc__ctx_guard g;
  enter0(&g);
  size_t min = granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  CUmemAllocationProp prop = device_prop();
  CUmemGenericAllocationHandle h = 0;
  ASSERT_CU_EQ(gpuipc__cu.cuMemCreate(&h, min + min / 2, &prop, 0),
               CUDA_ERROR_INVALID_VALUE);
  /* A multiple works. */
  ASSERT_CU(gpuipc__cu.cuMemCreate(&h, 2 * min, &prop, 0));
  ASSERT_CU(gpuipc__cu.cuMemRelease(h));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuMemRelease): releasing the handle while a mapping exists is
 * allowed, and the memory lives on until the mapping is unmapped. */
TEST_IMPL(conformance_vmm_release_keeps_mapping) {
  gpuipc__ctx_guard g;
  enter0(&g);
  vmm_map m;
  create_mapped(&m, granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  conf_put_pattern(m.va, m.bytes, 41);
  ASSERT_CU(gpuipc__cu.cuMemRelease(m.handle));
  m.released = true;
  conf_check_pattern(m.va, m.bytes, 41);
  conf_put_pattern(m.va, m.bytes, 42);
  conf_check_pattern(m.va, m.bytes, 42);
  unmap_all(&m);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuMemRetainAllocationHandle on an address inside a mapping gives a handle
 * whose properties are those the allocation was created with. */
TEST_IMPL(conformance_vmm_allocation_properties) {
  gpuipc__ctx_guard g;
  enter0(&g);
  size_t gran = granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  vmm_map m;
  create_mapped(&m, 2 * gran);
  CUmemGenericAllocationHandle r = 0;
  ASSERT_CU(gpuipc__cu.cuMemRetainAllocationHandle(&r, (void *)(uintptr_t)(m.va + gran)));
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  ASSERT_CU(gpuipc__cu.cuMemGetAllocationPropertiesFromHandle(&prop, r));
  ASSERT_EQ(prop.type, CU_MEM_ALLOCATION_TYPE_PINNED);
  ASSERT_EQ(prop.location.type, CU_MEM_LOCATION_TYPE_DEVICE);
  ASSERT_EQ(prop.location.id, 0);
  ASSERT_EQ(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  ASSERT_CU(gpuipc__cu.cuMemRelease(r));
  unmap_all(&m);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- across processes ------------------------------------------------------ */

/* Importer: imports the descriptor, maps it, reads the exporter's pattern
 * and writes its own; in mode "survive" it reads again after the exporter
 * dropped everything it had. */
HELPER_IMPL(conf_vmm_importer) {
  ASSERT_GE(argc, 1);
  const char *mode = argv[0];
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  vmm_msg msg;
  int fd = -1, nfds = 1;
  ASSERT_EQ(harness_recv(sock, &msg, sizeof msg, &fd, &nfds),
            (ssize_t)sizeof msg);
  ASSERT_EQ(nfds, 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  vmm_map m;
  memset(&m, 0, sizeof m);
  m.bytes = (size_t)msg.bytes;
  ASSERT_CU(gpuipc__cu.cuMemImportFromShareableHandle(
      &m.handle, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);
  map_handle(&m);
  conf_check_pattern(m.va, m.bytes, msg.seed);
  if (strcmp(mode, "survive") == 0) {
    harness_send_u64(sock, 2); /* mapped */
    ASSERT_UEQ(harness_recv_u64(sock), 3); /* exporter released everything */
    conf_check_pattern(m.va, m.bytes, msg.seed);
  } else {
    conf_put_pattern(m.va, m.bytes, msg.seed2);
    harness_send_u64(sock, 2); /* written */
    ASSERT_UEQ(harness_recv_u64(sock), 3); /* exporter has read it */
  }
  unmap_all(&m);
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

static pid_t start_importer(const char *mode, vmm_map *m, uint32_t seed,
                            int *sock) {
  int fd = -1;
  ASSERT_CU(gpuipc__cu.cuMemExportToShareableHandle(
      &fd, m->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  ASSERT_GE(fd, 0);
  vmm_msg msg = {m->bytes, seed, seed + 1000};
  pid_t pid = spawn_helper("conf_vmm_importer", NULL, sock, mode, NULL);
  harness_send(*sock, &msg, sizeof msg, &fd, 1);
  close(fd);
  return pid;
}

/* An allocation exported as a descriptor, imported in another process,
 * reserved, mapped and given access there: data flows both ways. */
TEST_IMPL(conformance_vmm_export_import_both_directions) {
  gpuipc__ctx_guard g;
  enter0(&g);
  vmm_map m;
  create_mapped(&m, granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  conf_put_pattern(m.va, m.bytes, 43);
  int sock = -1;
  pid_t pid = start_importer("both", &m, 43, &sock);
  ASSERT_UEQ(harness_recv_u64(sock), 2);
  conf_check_pattern(m.va, m.bytes, 43 + 1000);
  harness_send_u64(sock, 3);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  unmap_all(&m);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuMemRelease): the memory is freed only when every mapping is
 * unmapped and every handle, including imported ones, released. So an
 * importer's mapping stays valid after the exporter unmapped, released and
 * freed its address range. */
TEST_IMPL(conformance_vmm_import_survives_exporter_release) {
  gpuipc__ctx_guard g;
  enter0(&g);
  vmm_map m;
  create_mapped(&m, granularity(CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  conf_put_pattern(m.va, m.bytes, 44);
  int sock = -1;
  pid_t pid = start_importer("survive", &m, 44, &sock);
  ASSERT_UEQ(harness_recv_u64(sock), 2);
  unmap_all(&m);
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  harness_send_u64(sock, 3);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  gpuipc__ctx_leave(&g);
  return 0;
}
