/*
 * test-handle-fault.c: fault injection (emulator only). For each driver
 * call the handle layer makes, a helper process runs a full export + import
 * scenario with the Nth call of that function failing (GPUIPC_EMU_FAIL,
 * read when the driver loads, hence a process per run), for N = 1, 2, ...
 * until the scenario no longer meets the fault. Each run must either
 * succeed or fail cleanly: a status, a message naming the failing call, and
 * afterwards device memory (cuMemGetInfo, which the emulator counts per
 * process) and open file descriptors back at their baseline.
 *
 * The scenario's own copies and measurements make the primary context
 * current directly (cuCtxSetCurrent), so that they neither use up nor trip
 * the injected faults of cuCtxGetCurrent/cuCtxPushCurrent.
 */
#include "test-handle.h"

#include <unistd.h>

#define RC_CLEAN_FAILURE 10
#define RC_SETUP_FAULT 11
#define NBYTES (1u << 20)

static CUcontext primary0;

static void raw_enter(void) { ASSERT_CU(gpuipc__cu.cuCtxSetCurrent(primary0)); }
static void raw_leave(void) { ASSERT_CU(gpuipc__cu.cuCtxSetCurrent(NULL)); }

static size_t raw_mem_free(void) {
  raw_enter();
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  size_t fr = 0, total = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetInfo(&fr, &total));
  raw_leave();
  return fr;
}

static void raw_fill(gpuipc_buffer *b, uint32_t seed) {
  uint32_t *h = th_pattern(NBYTES, seed);
  if (gpuipc_buffer_get_kind(b) == GPUIPC_POOL_PINNED_HOST) {
    memcpy(gpuipc_buffer_get_ptr(b), h, NBYTES);
  } else {
    raw_enter();
    ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b),
                                      h, NBYTES));
    raw_leave();
  }
  free(h);
}

static bool raw_check(gpuipc_buffer *b, uint32_t seed) {
  uint32_t *h = th_pattern(NBYTES, seed);
  uint32_t *g = malloc(NBYTES);
  ASSERT_NOT_NULL(g);
  if (gpuipc_buffer_get_kind(b) == GPUIPC_POOL_PINNED_HOST) {
    memcpy(g, gpuipc_buffer_get_ptr(b), NBYTES);
  } else {
    raw_enter();
    ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(g, (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b),
                                      NBYTES));
    raw_leave();
  }
  bool ok = memcmp(g, h, NBYTES) == 0;
  free(g);
  free(h);
  return ok;
}

/* A call under test: a failure ends the scenario (cleanly, we check). */
static const char *fault_fn;
static int failures;
static bool failed_in_release;
static bool is_release(const char *what);
static bool ok_or_clean(gpuipc_status s, const char *what) {
  if (s == GPUIPC_OK)
    return true;
  const char *msg = gpuipc_last_error();
  if (msg == NULL || msg[0] == '\0')
    harness_fail(__FILE__, __LINE__, "%s failed (%s) with no message", what,
                 gpuipc_status_name(s));
  if (strstr(msg, fault_fn) == NULL)
    harness_fail(__FILE__, __LINE__,
                 "%s failed (%s) with a message not naming the failed call "
                 "%s: %s",
                 what, gpuipc_status_name(s), fault_fn, msg);
  failures++;
  if (is_release(what))
    failed_in_release = true;
  return false;
}

static gpuipc_pool_kind kind_of(const char *k) {
  if (strcmp(k, "legacy") == 0)
    return GPUIPC_POOL_LEGACY;
  if (strcmp(k, "mempool") == 0)
    return GPUIPC_POOL_MEMPOOL;
  if (strcmp(k, "vmm") == 0)
    return GPUIPC_POOL_VMM;
  if (strcmp(k, "pinned") == 0)
    return GPUIPC_POOL_PINNED_HOST;
  return GPUIPC_POOL_AUTO;
}

static void scenario_buffers(gpuipc_pool_kind kind, int sock, int map_dev) {
  gpuipc_pool *pool = NULL;
  gpuipc_buffer *b = NULL, *ib = NULL;
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[1] = {-1}, nfds = 1;
  bool peer_has_slot = false;
  uint64_t slot = 0;

  gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
  o.kind = kind;
  if (!ok_or_clean(gpuipc_pool_create(&o, &pool), "gpuipc_pool_create"))
    goto out;
  gpuipc_pool_kind k = gpuipc_pool_get_kind(pool);
  if (!ok_or_clean(gpuipc_buffer_alloc(pool, NBYTES, NULL, &b),
                   "gpuipc_buffer_alloc"))
    goto out;
  raw_fill(b, 1);
  if (!ok_or_clean(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds),
                   "gpuipc_buffer_export"))
    goto out;
  char err[512];
  gpuipc_status s =
      th_peer_import(sock, d, len, fds, nfds, 1, 2, -1, err, sizeof err);
  th_close_fds(fds, nfds);
  if (s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "the peer could not import: %s: %s",
                 gpuipc_status_name(s), err);
  ASSERT(raw_check(b, 2));
  th_peer_close_all(sock);

  /* The other direction. */
  nfds = 1;
  slot = th_peer_export(sock, k, NBYTES, 3, d, &len, fds, &nfds);
  peer_has_slot = true;
  gpuipc_import_options io = GPUIPC_IMPORT_OPTIONS_INIT;
  gpuipc_uuid mu;
  if (map_dev > 0) {
    ASSERT_OK(gpuipc_device_uuid(map_dev, &mu));
    io.device = &mu;
  }
  s = gpuipc_buffer_import(d, len, fds, nfds, &io, &ib);
  th_close_fds(fds, nfds);
  if (!ok_or_clean(s, "gpuipc_buffer_import"))
    goto out;
  ASSERT(raw_check(ib, 3));
  raw_fill(ib, 4);
  ASSERT(th_peer_check(sock, slot, 0, NBYTES, 4));
out:
  if (ib)
    ok_or_clean(gpuipc_buffer_close(ib), "gpuipc_buffer_close");
  if (peer_has_slot)
    th_peer_free(sock, slot);
  if (b)
    ok_or_clean(gpuipc_buffer_free(b, NULL), "gpuipc_buffer_free");
  raw_enter();
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  raw_leave();
  if (pool)
    ok_or_clean(gpuipc_pool_destroy(pool), "gpuipc_pool_destroy");
}

static void scenario_event(int sock) {
  gpuipc_event *e = NULL, *ie = NULL;
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  if (!ok_or_clean(gpuipc_event_create(NULL, &e), "gpuipc_event_create"))
    goto out;
  if (!ok_or_clean(gpuipc_event_export(e, d, sizeof d, &len),
                   "gpuipc_event_export"))
    goto out;
  if (!ok_or_clean(gpuipc_event_record(e, NULL), "gpuipc_event_record"))
    goto out;
  if (!ok_or_clean(gpuipc_event_synchronize(e), "gpuipc_event_synchronize"))
    goto out;
  harness_send_u64(sock, TH_OP_EVENT_PRODUCE);
  ssize_t n = harness_recv(sock, d, sizeof d, NULL, NULL);
  ASSERT_GT(n, 0);
  if (!ok_or_clean(gpuipc_event_import(d, (size_t)n, NULL, &ie),
                   "gpuipc_event_import"))
    goto out;
  if (!ok_or_clean(gpuipc_event_wait(ie, NULL), "gpuipc_event_wait"))
    goto out;
  ok_or_clean(gpuipc_event_synchronize(ie), "gpuipc_event_synchronize");
out:
  if (ie)
    ok_or_clean(gpuipc_event_destroy(ie), "gpuipc_event_destroy");
  if (e)
    ok_or_clean(gpuipc_event_destroy(e), "gpuipc_event_destroy");
}

/* A release (free, close, destroy) that failed leaves its resource with
 * the driver: after one, only the error is checked. */
static bool is_release(const char *what) {
  return strcmp(what, "gpuipc_buffer_free") == 0 ||
         strcmp(what, "gpuipc_buffer_close") == 0 ||
         strcmp(what, "gpuipc_pool_destroy") == 0 ||
         strcmp(what, "gpuipc_event_destroy") == 0;
}

/* argv: kind fn */
HELPER_IMPL(handle_fault_run) {
  ASSERT_GE(argc, 2);
  const char *k = argv[0];
  fault_fn = argv[1];
  /* A fault that hits the set-up (before any handle-layer call) says
   * nothing about the handle layer: report it apart. */
  if (gpuipc_init() != GPUIPC_OK || gpuipc__primary_ctx(0, &primary0) != GPUIPC_OK)
    return RC_SETUP_FAULT;
  char *peer_env[] = {"GPUIPC_EMU_FAIL=", NULL};
  int sock;
  pid_t peer = th_peer_start(peer_env, &sock);
  size_t mem0 = raw_mem_free();
  int fds0 = harness_count_fds();

  if (strcmp(k, "event") == 0)
    scenario_event(sock);
  else if (strcmp(k, "mempool-dev1") == 0)
    scenario_buffers(GPUIPC_POOL_MEMPOOL, sock, 1);
  else
    scenario_buffers(kind_of(k), sock, 0);

  size_t mem1 = raw_mem_free();
  int fds1 = harness_count_fds();
  /* A failed release leaves its resource with the driver (the emulator
   * keeps the memory and its memfd): nothing to compare then. */
  bool released = !failed_in_release;
  if (released && fds1 != fds0)
    harness_fail(__FILE__, __LINE__, "%s with %s failing: %d fds open, %d "
                 "before", k, fault_fn, fds1, fds0);
  if (released && mem1 != mem0)
    harness_fail(__FILE__, __LINE__,
                 "%s with %s failing: %zu bytes of device memory free, %zu "
                 "before",
                 k, fault_fn, mem1, mem0);
  th_peer_stop(peer, sock);
  return failures ? RC_CLEAN_FAILURE : 0;
}

/* Runs the scenario with each listed call failing in turn. */
static int fault_each(const char *kind, const char *const *fns, size_t nfns) {
  REQUIRE_EMULATOR("fault injection (GPUIPC_EMU_FAIL)");
  bool two_devices = strcmp(kind, "mempool-dev1") == 0;
  int never_hit = 0;
  for (size_t i = 0; i < nfns; i++) {
    int hits = 0, clean_runs = 0;
    for (int nth = 1; nth <= 12 && clean_runs < 2; nth++) {
      char env[128];
      snprintf(env, sizeof env, "GPUIPC_EMU_FAIL=%s:%d", fns[i], nth);
      /* A release the driver refused leaves the driver's object alive, which
       * a leak checker would report against the emulator: device memory and
       * fds are what these runs check. */
      char asan[512];
      const char *prev = getenv("ASAN_OPTIONS");
      snprintf(asan, sizeof asan, "ASAN_OPTIONS=%s%sdetect_leaks=0",
               prev ? prev : "", prev && *prev ? ":" : "");
      char *envv[] = {env, asan, two_devices ? "GPUIPC_EMU_DEVICES=2" : NULL,
                      NULL};
      pid_t pid = spawn_helper("handle_fault_run", envv, NULL, kind, fns[i],
                               NULL);
      int rc = wait_helper(pid, 120);
      if (rc == RC_CLEAN_FAILURE) {
        hits++;
        clean_runs = 0;
      } else if (rc == RC_SETUP_FAULT) {
        continue;
      } else if (rc == 0) {
        clean_runs++;
      } else {
        harness_fail(__FILE__, __LINE__, "%s: %s failing at call %d: helper "
                     "exit %d (see above)", kind, fns[i], nth, rc);
      }
    }
    printf("%-8s %-40s failed cleanly %d time(s)\n", kind, fns[i], hits);
    if (hits == 0) {
      printf("  ... never reached: %s is not called by the %s scenario\n",
             fns[i], kind);
      never_hit++;
    }
  }
  ASSERT_EQ(never_hit, 0);
  return 0;
}

static const char *const handle_fault_legacy_fns[] = {
    "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid",
           "cuCtxGetCurrent", "cuCtxPushCurrent", "cuMemAlloc",
           "cuMemGetAddressRange", "cuPointerGetAttribute",
           "cuIpcGetMemHandle", "cuIpcOpenMemHandle", "cuIpcCloseMemHandle",
           "cuMemFree"};
TEST_IMPL(handle_fault_legacy) {
  return fault_each("legacy", handle_fault_legacy_fns, GPUIPC__ARRAY_SIZE(handle_fault_legacy_fns));
}

static const char *const handle_fault_mempool_fns[] = {
    "cuMemPoolCreate", "cuMemPoolExportToShareableHandle",
           "cuMemAllocFromPoolAsync", "cuPointerGetAttribute",
           "cuMemPoolExportPointer", "cuMemPoolImportFromShareableHandle",
           "cuMemPoolImportPointer",
           "cuMemGetAddressRange", "cuMemFree", "cuMemFreeAsync",
           "cuMemPoolDestroy", "cuCtxPushCurrent"};
TEST_IMPL(handle_fault_mempool) {
  return fault_each("mempool", handle_fault_mempool_fns, GPUIPC__ARRAY_SIZE(handle_fault_mempool_fns));
}

/* A pool imported on another device than its own needs access granted. */
static const char *const handle_fault_mempool_other_device_fns[] = {
    "cuMemPoolSetAccess", "cuMemPoolImportPointer", "cuCtxPushCurrent"};
TEST_IMPL(handle_fault_mempool_other_device) {
  return fault_each("mempool-dev1", handle_fault_mempool_other_device_fns,
                    GPUIPC__ARRAY_SIZE(handle_fault_mempool_other_device_fns));
}

static const char *const handle_fault_vmm_fns[] = {
    "cuMemGetAllocationGranularity", "cuMemCreate",
           "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess",
           "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
           "cuMemGetAllocationPropertiesFromHandle", "cuMemRelease",
           "cuMemUnmap", "cuMemAddressFree", "cuCtxPushCurrent"};
TEST_IMPL(handle_fault_vmm) {
  return fault_each("vmm", handle_fault_vmm_fns, GPUIPC__ARRAY_SIZE(handle_fault_vmm_fns));
}

static const char *const handle_fault_pinned_host_fns[] = {
    "cuMemHostRegister", "cuMemHostGetDevicePointer",
           "cuMemHostUnregister", "cuCtxPushCurrent"};
TEST_IMPL(handle_fault_pinned_host) {
  return fault_each("pinned", handle_fault_pinned_host_fns, GPUIPC__ARRAY_SIZE(handle_fault_pinned_host_fns));
}

static const char *const handle_fault_auto_fns[] = {
    "cuDeviceGetAttribute"};
TEST_IMPL(handle_fault_auto) {
  return fault_each("auto", handle_fault_auto_fns, GPUIPC__ARRAY_SIZE(handle_fault_auto_fns));
}

static const char *const handle_fault_event_fns[] = {
    "cuEventCreate", "cuIpcGetEventHandle", "cuEventRecord",
           "cuEventSynchronize", "cuIpcOpenEventHandle", "cuStreamWaitEvent",
           "cuEventDestroy", "cuCtxPushCurrent"};
TEST_IMPL(handle_fault_event) {
  return fault_each("event", handle_fault_event_fns, GPUIPC__ARRAY_SIZE(handle_fault_event_fns));
}
