/*
 * test-emu.c: tests of the CUDA driver emulator (tests/emu) itself: what it
 * promises beyond the conformance suite (robustness when peer processes die,
 * stubs for unimplemented calls, bounds checks, its settings). They skip on
 * the real driver.
 */
#include "harness.h"

#include "tree.h"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

static void recv_exact(int sock, void *buf, size_t n) {
  ssize_t got = harness_recv(sock, buf, n, NULL, NULL);
  if (got != (ssize_t)n)
    harness_fail(__FILE__, __LINE__, "expected a %zu-byte message, got %zd", n, got);
}

/* A CUDA entry point the emulator does not implement resolves to a stub that
 * fails with CUDA_ERROR_NOT_SUPPORTED; a name that is not CUDA's at all is
 * not found. */
TEST_IMPL(emu_unimplemented_is_not_supported) {
  REQUIRE_EMULATOR("stubs are the emulator's");
  void *lib = dlopen(harness_emulator_path(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NOT_NULL(lib);
  CUresult (*gp)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
  void *sym = dlsym(lib, "cuGetProcAddress_v2");
  ASSERT_NOT_NULL(sym);
  memcpy(&gp, &sym, sizeof sym);
  void *fn = NULL;
  CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  ASSERT_CU(gp("cuGraphCreate", &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &q));
  ASSERT_EQ(q, CU_GET_PROC_ADDRESS_SUCCESS);
  ASSERT_NOT_NULL(fn);
  CUresult (*graph_create)(CUgraph *, unsigned int);
  memcpy(&graph_create, &fn, sizeof fn);
  CUgraph graph;
  ASSERT_CU_EQ(graph_create(&graph, 0), CUDA_ERROR_NOT_SUPPORTED);
  fn = (void *)1;
  ASSERT_CU_EQ(gp("gpuipcNoSuchFunction", &fn, CUDA_VERSION, 0, &q), CUDA_ERROR_NOT_FOUND);
  ASSERT_NULL(fn);
  ASSERT_EQ(q, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  dlclose(lib);
  return 0;
}

/* Copies are checked against the allocation they touch: past its end, or a
 * host pointer where a device pointer is required, is CUDA_ERROR_INVALID_VALUE
 * instead of a silent overrun. */
TEST_IMPL(emu_copy_bounds_checked) {
  REQUIRE_EMULATOR("the real driver does not check every extent");
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 4096));
  char buf[8192] = {0};
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(p, buf, 4096));
  ASSERT_CU_EQ(gpuipc__cu.cuMemcpyHtoD(p, buf, 4097), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU_EQ(gpuipc__cu.cuMemcpyHtoD(p + 4000, buf, 200), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU_EQ(gpuipc__cu.cuMemcpyDtoH(buf, (CUdeviceptr)(uintptr_t)(buf + 4096), 16),
               CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU_EQ(gpuipc__cu.cuMemsetD32(p + 2, 0, 1), CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  ASSERT_CU_EQ(gpuipc__cu.cuMemcpyHtoD(p, buf, 16), CUDA_ERROR_INVALID_VALUE);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* With slow stream copies (GPUIPC_EMU_COPY_DELAY_US), the legacy default
 * stream still waits for earlier work on a blocking stream, and
 * cuStreamDestroy lets queued work finish (cuCtxSynchronize covers it). */
TEST_IMPL(emu_copy_delay_keeps_ordering) {
  REQUIRE_EMULATOR("GPUIPC_EMU_COPY_DELAY_US is an emulator setting");
  setenv("GPUIPC_EMU_COPY_DELAY_US", "20000", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 1 << 16));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(p, 0, 1 << 16));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, 0));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(p, 0x5a, 1 << 16, s));
  unsigned char h[16];
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, sizeof h)); /* legacy: waits for s */
  ASSERT_EQ(h[0], 0x5a);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(p, 0x6b, 1 << 16, s));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  CUstream nb;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(h, p, sizeof h, nb)); /* pageable: done on return */
  ASSERT_EQ(h[15], 0x6b);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(nb));
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* CU_STREAM_PER_THREAD names a stream of its own in each thread. */
TEST_IMPL(emu_per_thread_stream) {
  REQUIRE_EMULATOR("checks the emulator's per-thread stream");
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 4096));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(p, 0x01020304u, 1024, CU_STREAM_PER_THREAD));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(CU_STREAM_PER_THREAD));
  ASSERT_CU(gpuipc__cu.cuStreamQuery(CU_STREAM_PER_THREAD));
  uint32_t w = 0;
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(&w, p + 4092, 4));
  ASSERT_UEQ(w, 0x01020304u);
  ASSERT_CU(gpuipc__cu.cuMemFree(p));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- peers that die -------------------------------------------------------- */

typedef struct exp_msg {
  CUipcMemHandle mem;
  CUipcEventHandle ev;
  uint32_t word;
  uint32_t pad;
} exp_msg;

/* Exports 1 MiB holding `word`, and an interprocess event recorded behind a
 * stream wait that nobody will satisfy; then waits to be killed. */
HELPER_IMPL(emu_exporter_then_die) {
  (void)argc;
  (void)argv;
  int sock = harness_helper_fd();
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr p;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 1 << 20));
  exp_msg m;
  memset(&m, 0, sizeof m);
  m.word = 0xfeedf00du;
  ASSERT_CU(gpuipc__cu.cuMemsetD32(p, m.word, (1 << 20) / 4));
  ASSERT_CU(gpuipc__cu.cuMemsetD32(p, 0, 1)); /* the flag nobody writes */
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&m.mem, p));
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(s, p, 1, CU_STREAM_WAIT_VALUE_EQ));
  ASSERT_CU(gpuipc__cu.cuEventRecord(ev, s));
  ASSERT_CU(gpuipc__cu.cuIpcGetEventHandle(&m.ev, ev));
  harness_send(sock, &m, sizeof m, NULL, 0);
  for (;;)
    pause();
  return 0;
}

/* An importer's mapping outlives its exporter's death; a handle opened after
 * the exporter died fails cleanly; an event recorded by a process that died
 * does not leave its waiters hanging. */
TEST_IMPL(emu_exporter_killed) {
  REQUIRE_EMULATOR("what a dead peer leaves is emulator behaviour here");
  gpuipc__ctx_guard g;
  enter0(&g);
  int sock = -1;
  pid_t pid = spawn_helper("emu_exporter_then_die", NULL, &sock, NULL);
  exp_msg m;
  recv_exact(sock, &m, sizeof m);
  CUdeviceptr p;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&p, m.mem, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuIpcOpenEventHandle(&ev, m.ev));
  ASSERT_CU_EQ(gpuipc__cu.cuEventQuery(ev), CUDA_ERROR_NOT_READY);
  kill(pid, SIGKILL);
  ASSERT_EQ(wait_helper(pid, 30), 128 + SIGKILL);
  close(sock);
  uint32_t w = 0;
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(&w, p + 4096, 4));
  ASSERT_UEQ(w, m.word);
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(ev));
  ASSERT_CU(gpuipc__cu.cuEventQuery(ev));
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(p));
  CUdeviceptr q;
  ASSERT_CU_EQ(gpuipc__cu.cuIpcOpenMemHandle(&q, m.mem, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Destroyed or made-up stream and event handles are refused with
 * CUDA_ERROR_INVALID_HANDLE rather than dereferenced. */
TEST_IMPL(emu_stale_handles_refused) {
  REQUIRE_EMULATOR("the real driver may crash on a stale handle");
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, 0));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  ASSERT_CU_EQ(gpuipc__cu.cuStreamDestroy(s), CUDA_ERROR_INVALID_HANDLE);
  ASSERT_CU_EQ(gpuipc__cu.cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE);
  CUevent e;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(e));
  ASSERT_CU_EQ(gpuipc__cu.cuEventDestroy(e), CUDA_ERROR_INVALID_HANDLE);
  ASSERT_CU_EQ(gpuipc__cu.cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
  int junk[16] = {0};
  ASSERT_CU_EQ(gpuipc__cu.cuStreamQuery((CUstream)(void *)junk), CUDA_ERROR_INVALID_HANDLE);
  ASSERT_CU_EQ(gpuipc__cu.cuEventRecord((CUevent)(void *)junk, NULL), CUDA_ERROR_INVALID_HANDLE);
  gpuipc__ctx_leave(&g);
  return 0;
}
