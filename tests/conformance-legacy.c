/*
 * conformance-legacy.c: conformance checks for legacy CUDA IPC memory
 * handles (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle),
 * written against the driver API directly.
 *
 * Every check here must pass on the real driver (make gpu-test) and on the
 * emulator (make test): each asserts a behaviour of the real driver that
 * gpuipc relies on (DESIGN.md, "Driver semantics observed", and the
 * cuda.h documentation). Behaviours about processes run in real separate
 * processes: the test is the exporter, a helper (this binary re-executed) is
 * the importer, and they talk over a socketpair.
 */
#include "conformance.h"
#include "harness.h"

#include "tree.h"

#include <unistd.h>

#define LEGACY_BYTES ((size_t)1 << 20)

/* What an exporter sends to an importer helper. */
typedef struct legacy_msg {
  CUipcMemHandle handle;
  uint64_t bytes;    /* bytes the importer may touch */
  uint64_t buffer_id; /* the exporter's CU_POINTER_ATTRIBUTE_BUFFER_ID */
  uint32_t seed;     /* pattern the exporter wrote */
  uint32_t seed2;    /* pattern the importer is to write back */
  int32_t device;    /* ordinal the importer works on */
  int32_t pad;
} legacy_msg;

/* ---- small utilities (patterns: conformance.h) --------------------------- */

static void recv_exact(int sock, void *buf, size_t n) {
  ssize_t got = harness_recv(sock, buf, n, NULL, NULL);
  if (got != (ssize_t)n)
    harness_fail(__FILE__, __LINE__, "expected a %zu-byte message, got %zd",
                 n, got);
}

static uint64_t buffer_id(CUdeviceptr p) {
  unsigned long long id = 0;
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                             p));
  return id;
}

/* Exporter side: allocates LEGACY_BYTES on device 0, writes the pattern of
 * seed and fills the message. */
static CUdeviceptr export_buffer(legacy_msg *m, uint32_t seed) {
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, LEGACY_BYTES));
  conf_put_pattern(p, LEGACY_BYTES, seed);
  memset(m, 0, sizeof *m);
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&m->handle, p));
  m->bytes = LEGACY_BYTES;
  m->buffer_id = buffer_id(p);
  m->seed = seed;
  m->seed2 = seed + 1000;
  return p;
}

/* Importer side: driver up, the device's primary context current, and the
 * exporter's message received. */
static int importer_begin(gpuipc__ctx_guard *g, legacy_msg *m) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  recv_exact(sock, m, sizeof *m);
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, m->device));
  return sock;
}

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

/* ---- in-process checks --------------------------------------------------- */

/* DESIGN: a legacy handle of an interior pointer has the same bytes as the
 * handle of the allocation's base, so an exporter must send the offset. Also:
 * asking twice for the same allocation's handle gives the same bytes
 * (cuda.h: "may be called multiple times on an allocation"). */
TEST_IMPL(conformance_legacy_interior_handle_equals_base) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, LEGACY_BYTES));
  CUipcMemHandle base, again, mid, last;
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&base, p));
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&again, p));
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&mid, p + 4096));
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&last, p + LEGACY_BYTES - 4));
  ASSERT_MEM_EQ(&again, &base, sizeof base);
  ASSERT_MEM_EQ(&mid, &base, sizeof base);
  ASSERT_MEM_EQ(&last, &base, sizeof base);
  /* The exporter finds the base (and so the offset to send) of an interior
   * pointer with cuMemGetAddressRange. */
  CUdeviceptr found = 0;
  size_t size = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetAddressRange(&found, &size, p + 4096));
  ASSERT_PTR_EQ((void *)(uintptr_t)found, (void *)(uintptr_t)p);
  ASSERT_GE(size, LEGACY_BYTES);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* DESIGN: opening one's own legacy handle fails with
 * CUDA_ERROR_INVALID_CONTEXT. */
TEST_IMPL(conformance_legacy_open_own_handle_invalid_context) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p = 0, q = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, LEGACY_BYTES));
  CUipcMemHandle h;
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&h, p));
  ASSERT_CU_EQ(gpuipc__cu.cuIpcOpenMemHandle(&q, h,
                                             CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               CUDA_ERROR_INVALID_CONTEXT);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuIpcGetMemHandle): when memory is freed and a later cuMemAlloc
 * returns the same address, the new memory gets a unique handle. DESIGN: the
 * re-allocation has a new CU_POINTER_ATTRIBUTE_BUFFER_ID (in the exporter;
 * an importer sees ids of its own, see
 * conformance_legacy_importer_buffer_id_own_and_fresh). The same address
 * coming back is usual but not promised, so it is reported, and the handle
 * check applies only when it does. */
TEST_IMPL(conformance_legacy_realloc_new_buffer_id) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p1 = 0, p2 = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p1, LEGACY_BYTES));
  uint64_t id1 = buffer_id(p1);
  CUipcMemHandle h1, h2;
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&h1, p1));
  ASSERT_CU(gpuipc__cu.cuMemFree(p1));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p2, LEGACY_BYTES));
  uint64_t id2 = buffer_id(p2);
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&h2, p2));
  printf("re-allocation %s the same address (0x%llx, 0x%llx); buffer ids "
         "%llu, %llu\n",
         p1 == p2 ? "returned" : "did not return", (unsigned long long)p1,
         (unsigned long long)p2, (unsigned long long)id1,
         (unsigned long long)id2);
  ASSERT_NE(id1, 0);
  ASSERT_NE(id2, 0);
  ASSERT_UEQ(id1 != id2, 1);
  if (p1 == p2)
    ASSERT_NE(memcmp(&h1, &h2, sizeof h1), 0);
  ASSERT_CU(gpuipc__cu.cuMemFree(p2));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- across processes -------------------------------------------------- */

/* Importer: tries to open the handle and reports the CUresult (closing the
 * mapping if the open succeeded). */
HELPER_IMPL(conf_legacy_open_result) {
  gpuipc__ctx_guard g;
  legacy_msg m;
  int sock = importer_begin(&g, &m);
  CUdeviceptr q = 0;
  CUresult r = gpuipc__cu.cuIpcOpenMemHandle(&q, m.handle,
                                             CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (r == CUDA_SUCCESS)
    ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(q));
  harness_send_u64(sock, (uint64_t)r);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* DESIGN: opening a handle whose allocation was freed fails with
 * CUDA_ERROR_INVALID_VALUE (in another process; the exporter stays alive). */
TEST_IMPL(conformance_legacy_open_freed_handle_invalid_value) {
  gpuipc__ctx_guard g;
  enter0(&g);
  legacy_msg m;
  CUdeviceptr p = export_buffer(&m, 11);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  int sock = -1;
  pid_t pid = spawn_helper("conf_legacy_open_result", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_CU_EQ((int)harness_recv_u64(sock), CUDA_ERROR_INVALID_VALUE);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Importer: opens the handle twice (same pointer), closes once, reads the
 * data through the still-open mapping, closes again. */
HELPER_IMPL(conf_legacy_open_twice) {
  gpuipc__ctx_guard g;
  legacy_msg m;
  int sock = importer_begin(&g, &m);
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&a, m.handle,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&b, m.handle,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  ASSERT_PTR_EQ((void *)(uintptr_t)a, (void *)(uintptr_t)b);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(a));
  /* Reference counted: one close leaves the second open's mapping valid. */
  conf_check_pattern(b, (size_t)m.bytes, m.seed);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(b));
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* DESIGN + cuda.h (cuIpcOpenMemHandle): the same handle opened twice in one
 * process gives the same pointer, with a reference count: it takes two
 * closes, and the mapping stays valid after the first. */
TEST_IMPL(conformance_legacy_open_twice_same_pointer) {
  gpuipc__ctx_guard g;
  enter0(&g);
  legacy_msg m;
  CUdeviceptr p = export_buffer(&m, 12);
  int sock = -1;
  pid_t pid = spawn_helper("conf_legacy_open_twice", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Importer: reads the exporter's data, checks what the driver says about its
 * mapping, writes its own pattern, and tells the exporter. */
HELPER_IMPL(conf_legacy_both_directions) {
  gpuipc__ctx_guard g;
  legacy_msg m;
  int sock = importer_begin(&g, &m);
  CUdeviceptr q = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&q, m.handle,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  conf_check_pattern(q, (size_t)m.bytes, m.seed);

  /* The mapping is device memory, and its range covers what was shared. */
  unsigned int type = 0;
  ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
      &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, q + 4096));
  ASSERT_EQ(type, CU_MEMORYTYPE_DEVICE);
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetAddressRange(&base, &size, q + 4096));
  ASSERT_PTR_EQ((void *)(uintptr_t)base, (void *)(uintptr_t)q);
  ASSERT_GE(size, m.bytes);

  conf_put_pattern(q, (size_t)m.bytes, m.seed2);
  harness_send_u64(sock, 1);
  /* Keep the mapping until the exporter has read the data back. */
  ASSERT_UEQ(harness_recv_u64(sock), 2);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(q));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Data written by the exporter is visible to the importer, and data written
 * by the importer is visible to the exporter. */
TEST_IMPL(conformance_legacy_data_both_directions) {
  gpuipc__ctx_guard g;
  enter0(&g);
  legacy_msg m;
  CUdeviceptr p = export_buffer(&m, 13);
  int sock = -1;
  pid_t pid = spawn_helper("conf_legacy_both_directions", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  conf_check_pattern(p, LEGACY_BYTES, m.seed2);
  harness_send_u64(sock, 2);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Importer: opens, waits until the exporter has freed the memory, then reads
 * it through its mapping. */
HELPER_IMPL(conf_legacy_read_after_free) {
  gpuipc__ctx_guard g;
  legacy_msg m;
  int sock = importer_begin(&g, &m);
  CUdeviceptr q = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&q, m.handle,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  harness_send_u64(sock, 1);
  ASSERT_UEQ(harness_recv_u64(sock), 2); /* exporter freed it */
  conf_check_pattern(q, (size_t)m.bytes, m.seed);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(q));
  harness_send_u64(sock, 3);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* DESIGN: legacy memory freed by its exporter stays readable by an importer
 * until the importer closes it (cuda.h calls the exporter's early free
 * undefined behaviour; the observed behaviour is what gpuipc must guard
 * against, so the emulator has to reproduce it). */
TEST_IMPL(conformance_legacy_freed_by_exporter_stays_readable) {
  gpuipc__ctx_guard g;
  enter0(&g);
  legacy_msg m;
  CUdeviceptr p = export_buffer(&m, 14);
  int sock = -1;
  pid_t pid = spawn_helper("conf_legacy_read_after_free", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_UEQ(harness_recv_u64(sock), 1); /* importer has it open */
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  harness_send_u64(sock, 2);
  ASSERT_UEQ(harness_recv_u64(sock), 3);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Importer: opens a handle, checks the data, reads its mapping's buffer id
 * twice, closes the mapping and reports the id; then the same for a second
 * handle (a new allocation of the exporter), whose id must differ from the
 * first one's. */
static uint64_t import_and_read_id(int sock, legacy_msg *m) {
  recv_exact(sock, m, sizeof *m);
  CUdeviceptr q = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&q, m->handle,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  conf_check_pattern(q, (size_t)m->bytes, m->seed);
  uint64_t id = buffer_id(q);
  ASSERT_NE(id, 0);
  ASSERT_UEQ(buffer_id(q + 4096), id); /* stable, and the same inside */
  ASSERT_UEQ(buffer_id(q), id);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(q));
  return id;
}

HELPER_IMPL(conf_legacy_buffer_id) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  ASSERT_OK(gpuipc__driver());
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  legacy_msg m;
  uint64_t first = import_and_read_id(sock, &m);
  harness_send_u64(sock, first);
  uint64_t second = import_and_read_id(sock, &m);
  ASSERT_UEQ(second != first, 1);
  harness_send_u64(sock, second);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The importer's CU_POINTER_ATTRIBUTE_BUFFER_ID on a legacy mapping is the
 * importer's own: on the real driver (580, H200) it is NOT the exporter's
 * (importer read 908 where the exporter had 909; DESIGN.md's claim that an
 * importer sees the exporter's id does not hold), so a stale import cannot
 * be detected by comparing ids across processes. What holds on every
 * driver: the importer's id is nonzero and stable, and a new allocation of
 * the exporter (freed and re-allocated, usually at the same address), closed
 * and re-opened by the importer, gets a different importer-side id. Nothing
 * is asserted between the two processes' ids: per-process counters can
 * coincide. */
TEST_IMPL(conformance_legacy_importer_buffer_id_own_and_fresh) {
  gpuipc__ctx_guard g;
  enter0(&g);
  legacy_msg m1, m2;
  CUdeviceptr p1 = export_buffer(&m1, 15);
  int sock = -1;
  pid_t pid = spawn_helper("conf_legacy_buffer_id", NULL, &sock, NULL);
  harness_send(sock, &m1, sizeof m1, NULL, 0);
  uint64_t id1 = harness_recv_u64(sock); /* imported, read, closed */
  ASSERT_CU(gpuipc__cu.cuMemFree(p1));
  CUdeviceptr p2 = export_buffer(&m2, 16);
  harness_send(sock, &m2, sizeof m2, NULL, 0);
  uint64_t id2 = harness_recv_u64(sock);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  printf("exporter buffer ids %llu, %llu (address %s); importer ids %llu, "
         "%llu\n",
         (unsigned long long)m1.buffer_id, (unsigned long long)m2.buffer_id,
         p1 == p2 ? "reused" : "not reused", (unsigned long long)id1,
         (unsigned long long)id2);
  ASSERT_NE(id1, 0);
  ASSERT_UEQ(id1 != id2, 1);
  ASSERT_UEQ(m1.buffer_id != m2.buffer_id, 1);
  ASSERT_CU(gpuipc__cu.cuMemFree(p2));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Importer on another device: opens a handle of device 0's memory (the
 * driver enables peer access lazily) and copies it into its own device's
 * memory. */
HELPER_IMPL(conf_legacy_cross_gpu) {
  gpuipc__ctx_guard g;
  legacy_msg m;
  int sock = importer_begin(&g, &m);
  CUdevice cur = -1;
  ASSERT_CU(gpuipc__cu.cuCtxGetDevice(&cur));
  ASSERT_EQ(cur, m.device);
  CUdeviceptr q = 0, local = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&q, m.handle,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&local, (size_t)m.bytes));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoD(local, q, (size_t)m.bytes));
  conf_check_pattern(local, (size_t)m.bytes, m.seed);
  /* Which device the driver names for a mapping of another device's memory
   * is not recorded for the real driver: report it, assert nothing. */
  int ordinal = -1;
  CUresult r = gpuipc__cu.cuPointerGetAttribute(
      &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, q);
  printf("imported mapping of device 0 memory on device %d: device ordinal "
         "attribute %d (%s)\n",
         (int)m.device, ordinal, harness_cuda_error_name(r));
  harness_send_u64(sock, 1);
  ASSERT_CU(gpuipc__cu.cuMemFree(local));
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(q));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* With two devices: memory of device 0 opened by a process working on
 * device 1 reads correctly through a device-to-device copy into device 1's
 * memory. */
TEST_IMPL(conformance_legacy_cross_gpu_open) {
  REQUIRE_DEVICES(2);
  gpuipc__ctx_guard g;
  enter0(&g);
  legacy_msg m;
  CUdeviceptr p = export_buffer(&m, 16);
  m.device = 1;
  int sock = -1;
  pid_t pid = spawn_helper("conf_legacy_cross_gpu", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}
