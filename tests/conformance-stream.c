/*
 * conformance-stream.c: conformance checks for streams, events and stream
 * memory operations: stream order, cuStreamWaitEvent capturing the record
 * current at the time of the call, IPC events between processes,
 * cuStreamWriteValue32/64 and cuStreamWaitValue32/64 on flag words in
 * memory shared between processes, cuStreamQuery, cuLaunchHostFunc, and the
 * legacy default stream versus blocking and non-blocking streams. Written
 * against the driver API directly.
 *
 * Every check must pass on the real driver and on the emulator. No check
 * depends on speed: where work must stay pending, a host function holds its
 * stream closed (a "gate") or a stream wait is unsatisfied, and the test
 * watches it stay pending for a short window (which a correct driver cannot
 * fail; it gives a wrong one time to show itself); where work must complete,
 * the test polls with a generous deadline that only guards against a hang.
 */
#include "harness.h"

#include "tree.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DATA_BYTES ((size_t)64 << 10)

/* ---- small utilities ------------------------------------------------------ */

static uint32_t pattern_word(uint32_t seed, size_t i) {
  return seed * 2654435761u + (uint32_t)i * 40503u + 1u;
}

static void check_pattern(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = calloc(1, n);
  ASSERT_NOT_NULL(h);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, n));
  for (size_t i = 0; i < n / 4; i++)
    if (h[i] != pattern_word(seed, i))
      harness_fail(__FILE__, __LINE__,
                   "pattern %u: word %zu of %zu reads 0x%08x, want 0x%08x",
                   seed, i, n / 4, h[i], pattern_word(seed, i));
  free(h);
}

static void check_words(CUdeviceptr p, size_t n, uint32_t want) {
  uint32_t *h = calloc(1, n);
  ASSERT_NOT_NULL(h);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, n));
  for (size_t i = 0; i < n / 4; i++)
    if (h[i] != want)
      harness_fail(__FILE__, __LINE__,
                   "word %zu of %zu reads 0x%08x, want 0x%08x", i, n / 4,
                   h[i], want);
  free(h);
}

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

static CUstream new_stream(unsigned int flags) {
  CUstream s = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, flags));
  return s;
}

/* Polls until the stream's work is done, for at most timeout_s seconds
 * (a guard against a hang, not a measurement). Returns the last
 * cuStreamQuery result: CUDA_SUCCESS, or CUDA_ERROR_NOT_READY on timeout. */
static CUresult stream_done(CUstream s, int timeout_s) {
  time_t deadline = time(NULL) + timeout_s;
  for (;;) {
    CUresult r = gpuipc__cu.cuStreamQuery(s);
    if (r != CUDA_ERROR_NOT_READY || time(NULL) > deadline)
      return r;
    usleep(1000);
  }
}

/* Asserts that a stream's work stays pending: cuStreamQuery must report
 * CUDA_ERROR_NOT_READY now and all through a short observation window. A
 * correct driver cannot fail this (the work is blocked by a gate or an
 * unsatisfied wait); the window only gives a wrong one, whose worker may not
 * have run yet at the first query, time to show itself. */
#define HOLD_MS 50
static void expect_held_at(CUstream s, const char *file, int line) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    CUresult r = gpuipc__cu.cuStreamQuery(s);
    if (r != CUDA_ERROR_NOT_READY)
      harness_fail(file, line,
                   "work that must stay pending finished (cuStreamQuery "
                   "returned %s, want CUDA_ERROR_NOT_READY)",
                   harness_cuda_error_name(r));
    clock_gettime(CLOCK_MONOTONIC, &t);
    long ms = (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
    if (ms >= HOLD_MS)
      return;
    usleep(1000);
  }
}
#define expect_held(s) expect_held_at((s), __FILE__, __LINE__)

/* A gate: a host function that holds its stream until the test opens it.
 * Gates live in static storage and are all opened at exit, so that a failed
 * assertion never leaves a driver thread blocked while the process exits. */
typedef struct gate {
  atomic_int open;
  atomic_int entered;
} gate;

#define MAX_GATES 8
static gate gates[MAX_GATES];
static int ngates;

static void open_all_gates(void) {
  for (int i = 0; i < ngates; i++)
    atomic_store(&gates[i].open, 1);
}

static void CUDA_CB gate_fn(void *arg) {
  gate *g = arg;
  atomic_store(&g->entered, 1);
  while (!atomic_load(&g->open))
    usleep(200);
}

/* Enqueues a closed gate on s. */
static gate *gate_launch(CUstream s) {
  ASSERT_LT(ngates, MAX_GATES);
  if (ngates == 0)
    atexit(open_all_gates);
  gate *g = &gates[ngates++];
  ASSERT_CU(gpuipc__cu.cuLaunchHostFunc(s, gate_fn, g));
  return g;
}

static void gate_open(gate *g) { atomic_store(&g->open, 1); }

/* ---- stream order and events, in one process -------------------------- */

/* Work on one stream runs in issue order: a copy sees the memset before it
 * and not the one after it, even when everything is queued before anything
 * runs. */
TEST_IMPL(conformance_stream_order) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr a = 0, b = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&a, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&b, DATA_BYTES));
  uint32_t *h = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&h, 2 * DATA_BYTES, 0));
  memset(h, 0, 2 * DATA_BYTES);

  gate *gt = gate_launch(s);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(a, 0x11111111u, DATA_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(b, a, DATA_BYTES, s));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(a, 0x22222222u, DATA_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(h, b, DATA_BYTES, s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(h + DATA_BYTES / 4, a, DATA_BYTES, s));
  expect_held(s);
  gate_open(gt);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuStreamQuery(s));
  for (size_t i = 0; i < DATA_BYTES / 4; i++) {
    ASSERT_UEQ(h[i], 0x11111111u);
    ASSERT_UEQ(h[DATA_BYTES / 4 + i], 0x22222222u);
  }
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(h));
  ASSERT_CU(gpuipc__cu.cuMemFree(a));
  ASSERT_CU(gpuipc__cu.cuMemFree(b));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuEventRecord / cuStreamWaitEvent): a wait covers the work the
 * event captured at its most recent record *at the time of the wait call*;
 * recording the event again later does not change an earlier wait. Here
 * the wait must hold while the first record is pending, and must be released
 * by the first record although a second record, issued after the wait, stays
 * blocked. */
TEST_IMPL(conformance_stream_wait_event_uses_record_at_call_time) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s1 = new_stream(CU_STREAM_NON_BLOCKING);
  CUstream s2 = new_stream(CU_STREAM_NON_BLOCKING);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CUdeviceptr buf = 0, out = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&buf, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&out, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(out, 0xDEADBEEFu, DATA_BYTES / 4, s2));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s2));

  gate *g1 = gate_launch(s1);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(buf, 1, DATA_BYTES / 4, s1));
  ASSERT_CU(gpuipc__cu.cuEventRecord(ev, s1)); /* record 1, pending */
  ASSERT_CU(gpuipc__cu.cuStreamWaitEvent(s2, ev, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(out, buf, DATA_BYTES, s2));
  gate *g2 = gate_launch(s1);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(buf, 2, DATA_BYTES / 4, s1));
  ASSERT_CU(gpuipc__cu.cuEventRecord(ev, s1)); /* record 2, after the wait */

  /* Record 1 is behind gate 1: the wait holds. */
  expect_held(s2);
  ASSERT_CU_EQ(gpuipc__cu.cuEventQuery(ev), CUDA_ERROR_NOT_READY);
  gate_open(g1);
  /* Record 1 completes; gate 2 holds record 2. The wait must be released. */
  ASSERT_CU(stream_done(s2, 60));
  ASSERT_EQ(atomic_load(&g2->open), 0);
  check_words(out, DATA_BYTES, 1);
  ASSERT_CU_EQ(gpuipc__cu.cuEventQuery(ev), CUDA_ERROR_NOT_READY);
  gate_open(g2);
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(ev));
  ASSERT_CU(gpuipc__cu.cuEventQuery(ev));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s1));
  check_words(buf, DATA_BYTES, 2);

  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuMemFree(buf));
  ASSERT_CU(gpuipc__cu.cuMemFree(out));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s1));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s2));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* An event never recorded captures no work: cuEventQuery reports it
 * complete, and a stream waiting on it is not held. */
TEST_IMPL(conformance_event_never_recorded_is_complete) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  ASSERT_CU(gpuipc__cu.cuEventQuery(ev));
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(ev));
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  ASSERT_CU(gpuipc__cu.cuStreamWaitEvent(s, ev, 0));
  ASSERT_CU(stream_done(s, 60));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuEventElapsedTime): a time between two completed timing events;
 * CUDA_ERROR_NOT_READY while one is pending; CUDA_ERROR_INVALID_HANDLE for an
 * event never recorded or created with CU_EVENT_DISABLE_TIMING. */
TEST_IMPL(conformance_event_elapsed_time) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUevent a, b, never, untimed;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&a, CU_EVENT_DEFAULT));
  ASSERT_CU(gpuipc__cu.cuEventCreate(&b, CU_EVENT_DEFAULT));
  ASSERT_CU(gpuipc__cu.cuEventCreate(&never, CU_EVENT_DEFAULT));
  ASSERT_CU(gpuipc__cu.cuEventCreate(&untimed, CU_EVENT_DISABLE_TIMING));
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, DATA_BYTES));
  float ms = -1;
  ASSERT_CU(gpuipc__cu.cuEventRecord(a, s));
  gate *gt = gate_launch(s);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(d, 5, DATA_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuEventRecord(b, s));
  ASSERT_CU(gpuipc__cu.cuEventRecord(untimed, s));
  ASSERT_CU_EQ(gpuipc__cu.cuEventElapsedTime(&ms, a, b), CUDA_ERROR_NOT_READY);
  gate_open(gt);
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(b));
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(untimed));
  ASSERT_CU(gpuipc__cu.cuEventElapsedTime(&ms, a, b));
  ASSERT(ms >= 0.0f);
  ASSERT_CU_EQ(gpuipc__cu.cuEventElapsedTime(&ms, a, never),
               CUDA_ERROR_INVALID_HANDLE);
  ASSERT_CU_EQ(gpuipc__cu.cuEventElapsedTime(&ms, a, untimed),
               CUDA_ERROR_INVALID_HANDLE);
  ASSERT_CU(gpuipc__cu.cuEventDestroy(a));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(b));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(never));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(untimed));
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuEventCreate): CU_EVENT_INTERPROCESS must be specified along with
 * CU_EVENT_DISABLE_TIMING; without it creation fails with
 * CUDA_ERROR_INVALID_VALUE. (Where the real driver fails - at creation or at
 * cuIpcGetEventHandle - is to be confirmed on the GPU.) */
TEST_IMPL(conformance_event_interprocess_requires_disable_timing) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUevent ev = NULL;
  ASSERT_CU_EQ(gpuipc__cu.cuEventCreate(&ev, CU_EVENT_INTERPROCESS),
               CUDA_ERROR_INVALID_VALUE);
  ASSERT_CU(gpuipc__cu.cuEventCreate(
      &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  CUipcEventHandle h;
  ASSERT_CU(gpuipc__cu.cuIpcGetEventHandle(&h, ev));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  /* An event created without CU_EVENT_INTERPROCESS has no IPC handle. */
  ASSERT_CU(gpuipc__cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  ASSERT_NE(gpuipc__cu.cuIpcGetEventHandle(&h, ev), CUDA_SUCCESS);
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuLaunchHostFunc runs in stream order: each host function sees the
 * effect of the copies before it and none after it, and host functions run
 * in issue order. */
typedef struct host_log {
  const uint32_t *watch; /* pinned word the copies write */
  uint32_t seen[4];
  atomic_int n;
} host_log;

static void CUDA_CB log_fn(void *arg) {
  host_log *l = arg;
  int i = atomic_load(&l->n);
  if (i < 4)
    l->seen[i] = *(volatile const uint32_t *)l->watch;
  atomic_store(&l->n, i + 1);
}

TEST_IMPL(conformance_launch_host_func_order) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, 4096));
  uint32_t *h = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&h, 4096, 0));
  *h = 0;
  host_log l;
  memset(&l, 0, sizeof l);
  l.watch = h;
  gate *gt = gate_launch(s);
  for (uint32_t v = 1; v <= 4; v++) {
    ASSERT_CU(gpuipc__cu.cuMemsetD32Async(d, 0xA0u + v, 1, s));
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(h, d, 4, s));
    ASSERT_CU(gpuipc__cu.cuLaunchHostFunc(s, log_fn, &l));
  }
  ASSERT_EQ(atomic_load(&l.n), 0);
  gate_open(gt);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_EQ(atomic_load(&l.n), 4);
  for (uint32_t v = 1; v <= 4; v++)
    ASSERT_UEQ(l.seen[v - 1], 0xA0u + v);
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(h));
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The legacy default stream (NULL) waits for prior work of blocking streams,
 * and blocking streams wait for prior work of the legacy stream. */
TEST_IMPL(conformance_stream_legacy_default_syncs_blocking_streams) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream blk = new_stream(CU_STREAM_DEFAULT);
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());

  /* blocking stream first, legacy stream after */
  gate *g1 = gate_launch(blk);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(d, 1, DATA_BYTES / 4, NULL));
  expect_held(NULL);
  gate_open(g1);
  ASSERT_CU(stream_done(NULL, 60));
  check_words(d, DATA_BYTES, 1);

  /* legacy stream first, blocking stream after */
  gate *g2 = gate_launch(NULL);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(d, 2, DATA_BYTES / 4, blk));
  expect_held(blk);
  gate_open(g2);
  ASSERT_CU(stream_done(blk, 60));
  check_words(d, DATA_BYTES, 2);

  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(blk));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* A non-blocking stream does not synchronize with the legacy default
 * stream, in either direction. */
TEST_IMPL(conformance_stream_nonblocking_independent_of_legacy) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream nb = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr d = 0, e = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&e, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());

  /* legacy stream held: the non-blocking stream's work completes */
  gate *g1 = gate_launch(NULL);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(d, 3, DATA_BYTES / 4, nb));
  ASSERT_CU(stream_done(nb, 60));
  ASSERT_EQ(atomic_load(&g1->open), 0);
  expect_held(NULL);
  gate_open(g1);
  ASSERT_CU(stream_done(NULL, 60));
  check_words(d, DATA_BYTES, 3);

  /* non-blocking stream held: the legacy stream's work completes */
  gate *g2 = gate_launch(nb);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(e, 4, DATA_BYTES / 4, NULL));
  ASSERT_CU(stream_done(NULL, 60));
  ASSERT_EQ(atomic_load(&g2->open), 0);
  expect_held(nb);
  gate_open(g2);
  ASSERT_CU(stream_done(nb, 60));
  check_words(e, DATA_BYTES, 4);

  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuMemFree(e));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(nb));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- stream memory operations, in one process ---------------------------- */

/* A flag word in device memory, set with a stream write so that its order
 * with the waits is explicit. */
static void set_flag32(CUdeviceptr flag, uint32_t v, CUstream s) {
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(s, flag, v, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
}

/* cuStreamQuery reports CUDA_ERROR_NOT_READY while a cuStreamWaitValue32 is
 * unsatisfied, and the stream completes once another stream writes the
 * value. */
TEST_IMPL(conformance_stream_query_not_ready_while_wait_value_blocks) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream waiter = new_stream(CU_STREAM_NON_BLOCKING);
  CUstream writer = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr flag = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&flag, 4096));
  set_flag32(flag, 0, writer);
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(waiter, flag, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  expect_held(waiter);
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(writer, flag, 1, 0));
  ASSERT_CU(stream_done(waiter, 60));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(writer));
  ASSERT_CU(gpuipc__cu.cuMemFree(flag));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(waiter));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(writer));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (CU_STREAM_WAIT_VALUE_GEQ): the test is (int32_t)(*addr - value)
 * >= 0, a cyclic comparison: 5 satisfies GEQ 0xFFFFFFF0 (5 - 0xFFFFFFF0
 * wraps to 21), and 0x0F does not satisfy GEQ 0x10. */
TEST_IMPL(conformance_stream_wait_value32_geq_is_cyclic) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream waiter = new_stream(CU_STREAM_NON_BLOCKING);
  CUstream writer = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr flag = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&flag, 4096));
  set_flag32(flag, 5, writer);
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(waiter, flag, 0xFFFFFFF0u,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  ASSERT_CU(stream_done(waiter, 60));
  set_flag32(flag, 0x0F, writer);
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(waiter, flag, 0x10,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  expect_held(waiter);
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(writer, flag, 0x10, 0));
  ASSERT_CU(stream_done(waiter, 60));
  ASSERT_CU(gpuipc__cu.cuMemFree(flag));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(waiter));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(writer));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* CU_STREAM_WAIT_VALUE_AND: wait until (*addr & value) != 0. */
TEST_IMPL(conformance_stream_wait_value32_and) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream waiter = new_stream(CU_STREAM_NON_BLOCKING);
  CUstream writer = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr flag = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&flag, 4096));
  set_flag32(flag, 0, writer);
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(waiter, flag, 0x4,
                                           CU_STREAM_WAIT_VALUE_AND));
  expect_held(waiter);
  set_flag32(flag, 0x3, writer);
  expect_held(waiter);
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(writer, flag, 0xC, 0));
  ASSERT_CU(stream_done(waiter, 60));
  ASSERT_CU(gpuipc__cu.cuMemFree(flag));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(waiter));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(writer));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* CU_STREAM_WAIT_VALUE_NOR: wait until ~(*addr | value) != 0; supported
 * where CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR says so. */
TEST_IMPL(conformance_stream_wait_value32_nor) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdevice dev;
  ASSERT_CU(gpuipc__cu.cuDeviceGet(&dev, 0));
  int nor = 0;
  ASSERT_CU(gpuipc__cu.cuDeviceGetAttribute(
      &nor, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, dev));
  if (!nor)
    SKIP("device 0 does not support CU_STREAM_WAIT_VALUE_NOR");
  CUstream waiter = new_stream(CU_STREAM_NON_BLOCKING);
  CUstream writer = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr flag = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&flag, 4096));
  set_flag32(flag, 0xF, writer);
  /* ~(0xF | 0xFFFFFFF0) == 0: not satisfied */
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(waiter, flag, 0xFFFFFFF0u,
                                           CU_STREAM_WAIT_VALUE_NOR));
  expect_held(waiter);
  /* ~(0x7 | 0xFFFFFFF0) == 0x8: satisfied */
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(writer, flag, 0x7, 0));
  ASSERT_CU(stream_done(waiter, 60));
  ASSERT_CU(gpuipc__cu.cuMemFree(flag));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(waiter));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(writer));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuStreamWriteValue64 writes the 8 bytes of the value (host byte order),
 * cuStreamWriteValue32 exactly 4 bytes, leaving the neighbours alone. */
TEST_IMPL(conformance_stream_write_value_widths) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, 4096));
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(d, 0xEE, 32, s));
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue64(s, d + 8, 0x0123456789ABCDEFull, 0));
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(s, d + 20, 0x76543210u, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  unsigned char h[32];
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, d, sizeof h));
  uint64_t v64;
  uint32_t v32;
  memcpy(&v64, h + 8, 8);
  memcpy(&v32, h + 20, 4);
  ASSERT_UEQ(v64, 0x0123456789ABCDEFull);
  ASSERT_UEQ(v32, 0x76543210u);
  for (int i = 0; i < 32; i++)
    if (i < 8 || (i >= 16 && i < 20) || i >= 24)
      ASSERT_EQ(h[i], 0xEE);
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- across processes: IPC events ---------------------------------------- */

typedef struct event_msg {
  CUipcEventHandle event;
  CUipcMemHandle mem;
  uint64_t bytes;
  uint32_t seed;
  uint32_t poison;
} event_msg;

/* The producer: owns an interprocess event and a buffer (poisoned), shares
 * both, then queues "gate; write the data; record the event" and tells the
 * consumer the record is issued. The gate opens when the consumer says so,
 * after it has checked that its wait holds. */
HELPER_IMPL(conf_event_producer) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuEventCreate(
      &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  event_msg m;
  memset(&m, 0, sizeof m);
  m.bytes = DATA_BYTES;
  m.seed = 61;
  m.poison = 0xDEADBEEFu;
  CUdeviceptr buf = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&buf, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(buf, m.poison, DATA_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuIpcGetEventHandle(&m.event, ev));
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&m.mem, buf));
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_UEQ(harness_recv_u64(sock), 2); /* consumer opened both */

  /* The pattern's source is pinned: an asynchronous copy from pageable
   * memory may synchronize with the stream (cuda.h, "API synchronization
   * behavior"), which the gate holds. */
  uint32_t *h = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&h, DATA_BYTES, 0));
  for (size_t i = 0; i < DATA_BYTES / 4; i++)
    h[i] = pattern_word(m.seed, i);
  gate *gt = gate_launch(s);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(buf, h, DATA_BYTES, s));
  ASSERT_CU(gpuipc__cu.cuEventRecord(ev, s));
  harness_send_u64(sock, 3); /* recorded */
  ASSERT_UEQ(harness_recv_u64(sock), 4); /* consumer: my wait holds */
  gate_open(gt);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(h));
  ASSERT_UEQ(harness_recv_u64(sock), 5); /* consumer done with everything */
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuMemFree(buf));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* An interprocess event: the consumer's stream waits on the producer's
 * record (issued before the consumer's wait call) and only then copies the
 * data; the buffer was poisoned first, so a missed wait reads poison. */
TEST_IMPL(conformance_event_ipc_wait_across_processes) {
  gpuipc__ctx_guard g;
  enter0(&g);
  int sock = -1;
  pid_t pid = spawn_helper("conf_event_producer", NULL, &sock, NULL);
  event_msg m;
  ASSERT_EQ(harness_recv(sock, &m, sizeof m, NULL, NULL), (ssize_t)sizeof m);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuIpcOpenEventHandle(&ev, m.event));
  CUdeviceptr buf = 0, out = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&buf, m.mem,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&out, DATA_BYTES));
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  harness_send_u64(sock, 2);
  ASSERT_UEQ(harness_recv_u64(sock), 3); /* producer's record is issued */

  ASSERT_CU(gpuipc__cu.cuStreamWaitEvent(s, ev, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(out, buf, DATA_BYTES, s));
  /* The producer's gate is closed: the record is pending, the wait holds. */
  expect_held(s);
  ASSERT_CU_EQ(gpuipc__cu.cuEventQuery(ev), CUDA_ERROR_NOT_READY);
  harness_send_u64(sock, 4);
  ASSERT_CU(stream_done(s, 60));
  check_pattern(out, DATA_BYTES, m.seed);
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(ev));

  ASSERT_CU(gpuipc__cu.cuMemFree(out));
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(buf));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  harness_send_u64(sock, 5);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The other direction: the importer of an interprocess event records it
 * (cuda.h, cuIpcGetEventHandle: record, synchronize, stream-wait and query
 * may be used in either process), and the exporter's stream waits on its
 * own event. This is how a producer learns that a consumer's GPU work on a
 * buffer is done. The importer writes the data through its mapping of the
 * exporter's (poisoned) buffer, behind a gate. */
HELPER_IMPL(conf_event_importer_records) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  event_msg m;
  ASSERT_EQ(harness_recv(sock, &m, sizeof m, NULL, NULL), (ssize_t)sizeof m);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuIpcOpenEventHandle(&ev, m.event));
  CUdeviceptr buf = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&buf, m.mem,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  uint32_t *h = NULL; /* pinned: see conf_event_producer */
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&h, DATA_BYTES, 0));
  for (size_t i = 0; i < DATA_BYTES / 4; i++)
    h[i] = pattern_word(m.seed, i);
  gate *gt = gate_launch(s);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(buf, h, DATA_BYTES, s));
  ASSERT_CU(gpuipc__cu.cuEventRecord(ev, s));
  harness_send_u64(sock, 3); /* recorded */
  ASSERT_UEQ(harness_recv_u64(sock), 4); /* exporter: my wait holds */
  gate_open(gt);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(h));
  ASSERT_UEQ(harness_recv_u64(sock), 5);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(buf));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

TEST_IMPL(conformance_event_ipc_record_in_importer) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuEventCreate(
      &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
  event_msg m;
  memset(&m, 0, sizeof m);
  m.bytes = DATA_BYTES;
  m.seed = 62;
  m.poison = 0xDEADBEEFu;
  CUdeviceptr buf = 0, out = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&buf, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&out, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(buf, m.poison, DATA_BYTES / 4, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuIpcGetEventHandle(&m.event, ev));
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&m.mem, buf));
  int sock = -1;
  pid_t pid = spawn_helper("conf_event_importer_records", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  ASSERT_UEQ(harness_recv_u64(sock), 3); /* the importer's record is issued */
  ASSERT_CU(gpuipc__cu.cuStreamWaitEvent(s, ev, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(out, buf, DATA_BYTES, s));
  expect_held(s);
  ASSERT_CU_EQ(gpuipc__cu.cuEventQuery(ev), CUDA_ERROR_NOT_READY);
  harness_send_u64(sock, 4);
  ASSERT_CU(stream_done(s, 60));
  check_pattern(out, DATA_BYTES, m.seed);
  ASSERT_CU(gpuipc__cu.cuEventSynchronize(ev));
  harness_send_u64(sock, 5);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuMemFree(buf));
  ASSERT_CU(gpuipc__cu.cuMemFree(out));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* cuda.h (cuStreamWaitEvent): the event may be from a different context or
 * device than the stream. With two devices: a stream of device 1 waits on an
 * event recorded by a stream of device 0. */
TEST_IMPL(conformance_stream_wait_event_other_device) {
  REQUIRE_DEVICES(2);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream s0 = new_stream(CU_STREAM_NON_BLOCKING);
  CUevent ev;
  ASSERT_CU(gpuipc__cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  gate *gt = gate_launch(s0);
  ASSERT_CU(gpuipc__cu.cuEventRecord(ev, s0));
  gpuipc__ctx_leave(&g);

  ASSERT_OK(gpuipc__ctx_enter(&g, 1));
  CUstream s1 = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuStreamWaitEvent(s1, ev, 0));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(d, 9, DATA_BYTES / 4, s1));
  expect_held(s1);
  gate_open(gt);
  ASSERT_CU(stream_done(s1, 60));
  check_words(d, DATA_BYTES, 9);
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s1));
  gpuipc__ctx_leave(&g);

  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s0));
  ASSERT_CU(gpuipc__cu.cuEventDestroy(ev));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s0));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- across processes: stream memory operations on shared memory --------- */

/* A flag word at offset 0 of a shared allocation, data at FLAG_DATA_OFF.
 * The waiter queues "wait for the flag; copy the data out"; the writer
 * first writes a value that must not release the wait, then the data and
 * a releasing value, stream-ordered. */
#define FLAG_DATA_OFF ((size_t)64 << 10)
#define FLAG_ALLOC (FLAG_DATA_OFF + DATA_BYTES)

typedef struct value_msg {
  CUipcMemHandle mem;
  uint32_t width; /* 32 or 64 */
  uint32_t op;    /* CU_STREAM_WAIT_VALUE_GEQ or _EQ */
  uint64_t wait_value;
  uint64_t hold_value;    /* written first: must not satisfy the wait */
  uint64_t release_value; /* written after the data: satisfies it */
  uint32_t seed;
  uint32_t helper_waits; /* 1: the helper waits, the test writes */
} value_msg;

static void value_wait(CUstream s, CUdeviceptr flag, const value_msg *m) {
  if (m->width == 64)
    ASSERT_CU(gpuipc__cu.cuStreamWaitValue64(s, flag, m->wait_value, m->op));
  else
    ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(s, flag,
                                             (cuuint32_t)m->wait_value, m->op));
}

static void value_write(CUstream s, CUdeviceptr flag, uint64_t v,
                        const value_msg *m) {
  if (m->width == 64)
    ASSERT_CU(gpuipc__cu.cuStreamWriteValue64(s, flag, v, 0));
  else
    ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(s, flag, (cuuint32_t)v, 0));
}

/* The waiting side of the protocol (messages 2..6). */
static void value_waiter(int sock, CUdeviceptr base, const value_msg *m) {
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  CUdeviceptr out = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&out, DATA_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(out, 0xDEADBEEFu, DATA_BYTES / 4, s));
  value_wait(s, base, m);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoDAsync(out, base + FLAG_DATA_OFF, DATA_BYTES,
                                         s));
  expect_held(s);
  harness_send_u64(sock, 2); /* armed */
  ASSERT_UEQ(harness_recv_u64(sock), 3); /* hold value written */
  expect_held(s);
  harness_send_u64(sock, 4); /* still waiting */
  ASSERT_UEQ(harness_recv_u64(sock), 5); /* data and release value issued */
  ASSERT_CU(stream_done(s, 60));
  check_pattern(out, DATA_BYTES, m->seed);
  harness_send_u64(sock, 6);
  ASSERT_CU(gpuipc__cu.cuMemFree(out));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
}

/* The writing side of the protocol. */
static void value_writer(int sock, CUdeviceptr base, const value_msg *m) {
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  ASSERT_UEQ(harness_recv_u64(sock), 2);
  value_write(s, base, m->hold_value, m);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  harness_send_u64(sock, 3);
  ASSERT_UEQ(harness_recv_u64(sock), 4);
  uint32_t *h = malloc(DATA_BYTES);
  ASSERT_NOT_NULL(h);
  for (size_t i = 0; i < DATA_BYTES / 4; i++)
    h[i] = pattern_word(m->seed, i);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(base + FLAG_DATA_OFF, h, DATA_BYTES,
                                         s));
  value_write(s, base, m->release_value, m);
  harness_send_u64(sock, 5);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  free(h);
  ASSERT_UEQ(harness_recv_u64(sock), 6);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
}

HELPER_IMPL(conf_value_peer) {
  int sock = harness_helper_fd();
  ASSERT_GE(sock, 0);
  value_msg m;
  ASSERT_EQ(harness_recv(sock, &m, sizeof m, NULL, NULL), (ssize_t)sizeof m);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr base = 0;
  ASSERT_CU(gpuipc__cu.cuIpcOpenMemHandle(&base, m.mem,
                                          CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  if (m.helper_waits)
    value_waiter(sock, base, &m);
  else
    value_writer(sock, base, &m);
  ASSERT_CU(gpuipc__cu.cuIpcCloseMemHandle(base));
  harness_send_u64(sock, 1);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The test owns the shared allocation (flag cleared to 0) and plays the
 * other side. */
static int value_interprocess(uint32_t width, uint32_t op, uint64_t wait,
                              uint64_t hold, uint64_t release,
                              bool helper_waits) {
  gpuipc__ctx_guard g;
  enter0(&g);
  CUdeviceptr base = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&base, FLAG_ALLOC));
  CUstream s = new_stream(CU_STREAM_NON_BLOCKING);
  ASSERT_CU(gpuipc__cu.cuMemsetD32Async(base, 0, FLAG_ALLOC / 4, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  value_msg m;
  memset(&m, 0, sizeof m);
  ASSERT_CU(gpuipc__cu.cuIpcGetMemHandle(&m.mem, base));
  m.width = width;
  m.op = op;
  m.wait_value = wait;
  m.hold_value = hold;
  m.release_value = release;
  m.seed = 70 + width + op;
  m.helper_waits = helper_waits;
  int sock = -1;
  pid_t pid = spawn_helper("conf_value_peer", NULL, &sock, NULL);
  harness_send(sock, &m, sizeof m, NULL, 0);
  if (helper_waits)
    value_writer(sock, base, &m);
  else
    value_waiter(sock, base, &m);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  ASSERT_CU(gpuipc__cu.cuMemFree(base));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* GEQ, 32-bit: the importer waits on its mapping of the exporter's flag;
 * the exporter writes 4 (holds GEQ 5), then the data and 9 (releases). */
TEST_IMPL(conformance_stream_value32_geq_interprocess) {
  return value_interprocess(32, CU_STREAM_WAIT_VALUE_GEQ, 5, 4, 9, true);
}

/* EQ, 32-bit: the exporter waits on its own flag; the importer writes 4
 * through its mapping (holds EQ 3: greater is not equal), then the data and
 * 3 (releases). */
TEST_IMPL(conformance_stream_value32_eq_interprocess) {
  return value_interprocess(32, CU_STREAM_WAIT_VALUE_EQ, 3, 4, 3, false);
}

/* GEQ, 64-bit: 0x5 must hold GEQ 0x100000005 (a 32-bit comparison would
 * release it); 0x100000007 releases. */
TEST_IMPL(conformance_stream_value64_geq_interprocess) {
  return value_interprocess(64, CU_STREAM_WAIT_VALUE_GEQ, 0x100000005ull, 0x5,
                            0x100000007ull, true);
}

/* EQ, 64-bit: 0x3 must hold EQ 0x200000003 (equal low halves); the full
 * value releases. */
TEST_IMPL(conformance_stream_value64_eq_interprocess) {
  return value_interprocess(64, CU_STREAM_WAIT_VALUE_EQ, 0x200000003ull, 0x3,
                            0x200000003ull, false);
}

/* ---- the stream room ---------------------------------------------------------- */

enum { ROOM_STREAMS = 200 };
static atomic_int room_made, room_over, room_want;
static CUcontext room_ctx;

static void *room_creator(void *arg) {
  CUstream *st = arg;
  if (gpuipc__cu.cuCtxSetCurrent(room_ctx) == CUDA_SUCCESS)
    for (int i = 0; i < atomic_load(&room_want); i++) {
      if (gpuipc__cu.cuStreamCreate(&st[i], CU_STREAM_NON_BLOCKING) !=
          CUDA_SUCCESS)
        break;
      atomic_store(&room_made, i + 1);
    }
  atomic_store(&room_over, 1);
  return NULL;
}

/* In a fresh process (argv[0] says what it expects): a stream is held on
 * a host word; a thread creates more, one at a time. "waits" (200):
 * the creation must stop (no stream made for a second, fewer than all)
 * until the host opens the gate, then finish; "free": all must be made
 * while the stream is still held. Prints where creation stopped. */
HELPER_IMPL(conf_stream_room) {
  ASSERT(argc >= 1);
  bool want_wait = strcmp(argv[0], "waits") == 0;
  int want = want_wait ? ROOM_STREAMS : 100; /* "free": within the room */
  atomic_store(&room_want, want);
  gpuipc__ctx_guard g;
  enter0(&g);
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&room_ctx));
  CUstream held = new_stream(CU_STREAM_NON_BLOCKING);
  void *gate_h = NULL;
  CUdeviceptr gate_d = 0;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc(&gate_h, 4096, CU_MEMHOSTALLOC_DEVICEMAP));
  memset(gate_h, 0, 4096);
  ASSERT_CU(gpuipc__cu.cuMemHostGetDevicePointer(&gate_d, gate_h, 0));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(held, gate_d, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  expect_held(held);
  static CUstream st[ROOM_STREAMS];
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, room_creator, st), 0);
  /* Free: all made within 30 s (fast; the bound guards against a hang).
   * Waits: made stops growing for a second before all are made. */
  int last = -1, still = 0;
  for (int i = 0; i < 30000 && !atomic_load(&room_over); i++) {
    usleep(1000);
    int m = atomic_load(&room_made);
    still = m == last ? still + 1 : 0;
    last = m;
    if (want_wait && still >= 1000)
      break;
  }
  bool over = atomic_load(&room_over);
  int made = atomic_load(&room_made);
  printf("streams made behind the held stream: %d of %d%s\n", made, want,
         over ? "" : " (creation waiting)");
  __atomic_store_n((uint32_t *)gate_h, 1u, __ATOMIC_RELEASE);
  for (int i = 0; i < 60000 && !atomic_load(&room_over); i++)
    usleep(1000);
  if (!atomic_load(&room_over))
    harness_fail(__FILE__, __LINE__, "stream creation did not finish within "
                 "60 s of the held stream's release");
  pthread_join(t, NULL);
  ASSERT_EQ(atomic_load(&room_made), want);
  if (want_wait && over)
    harness_fail(__FILE__, __LINE__, "all %d streams were made behind a held "
                 "stream: the driver's stream creation did not wait (the "
                 "emulator models a wait from the 33rd stream)", want);
  if (!want_wait && !over)
    harness_fail(__FILE__, __LINE__, "stream creation waited behind a held "
                 "stream after %d of %d, with gpuipc's stream room reserved",
                 made, want);
  ASSERT_CU(stream_done(held, 60));
  for (int i = 0; i < want; i++)
    ASSERT_CU(gpuipc__cu.cuStreamDestroy(st[i]));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(held));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(gate_h));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The driver keeps a context's stream resources in a pool that grows in
 * steps, and a cuStreamCreate that needs a step waits until the context's
 * streams drain: behind a stream held on a wait it waits until the stream
 * is released (the H200, driver 580: the 34th stream of a context). A
 * fresh process, told to reserve no room. */
TEST_IMPL(conformance_stream_create_waits_for_room_behind_a_held_stream) {
  char *const env[] = {"GPUIPC_STREAM_ROOM=", NULL};
  pid_t p = spawn_helper("conf_stream_room", env, NULL, "waits", NULL);
  ASSERT_EQ(wait_helper(p, 120), 0);
  return 0;
}

/* What gpuipc does about it: told GPUIPC_STREAM_ROOM=128, its first use of
 * a device makes room for 128 streams, so 100 are made behind a held
 * stream without waiting. */
TEST_IMPL(stream_room_reserved_behind_a_held_stream) {
  char *const env[] = {"GPUIPC_STREAM_ROOM=128", NULL};
  pid_t p = spawn_helper("conf_stream_room", env, NULL, "free", NULL);
  ASSERT_EQ(wait_helper(p, 120), 0);
  return 0;
}
