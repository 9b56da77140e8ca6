/*
 * test-xfer.c: the copy engine (gpuipc_xfer): arguments, every size
 * (0, 1, chunk +- 1, beyond the staging ring), random sizes and offsets for
 * pageable, pinned and device sides, the copy-in -> stage -> copy-out
 * pipeline with a stage whose output marks each chunk (a skipped, doubled
 * or misplaced chunk fails the check), ordering against the caller's
 * stream, a stage that fails, injected driver faults (the error comes back,
 * nothing leaks), and several engines at once.
 *
 * The shared pinned segment has its own file, test-xfer-shared.c.
 */
#include "harness.h"

#include "tree.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

/* ---- utilities ----------------------------------------------------------- */

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

static uint64_t rng_next(uint64_t *s) {
  /* xorshift64* */
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

static size_t rng_below(uint64_t *s, size_t n) {
  return n ? (size_t)(rng_next(s) % n) : 0;
}

static void fill_random(void *p, size_t n, uint64_t seed) {
  uint8_t *b = p;
  uint64_t s = seed | 1;
  for (size_t i = 0; i < n; i++)
    b[i] = (uint8_t)(rng_next(&s) >> 56);
}

static void *pinned_alloc(size_t n) {
  void *p = NULL;
  ASSERT_CU(gpuipc__cu.cuMemHostAlloc(&p, n ? n : 1, 0));
  return p;
}

static CUdeviceptr dev_alloc(size_t n) {
  CUdeviceptr d = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, n ? n : 1));
  return d;
}

static void *D(CUdeviceptr d) { return (void *)(uintptr_t)d; }

static CUstream new_stream(void) {
  CUstream s = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  return s;
}

static size_t dev_free_bytes(void) {
  size_t free_b = 0, total = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetInfo(&free_b, &total));
  return free_b;
}

/* No device memory leaked since free0 = dev_free_bytes(). The emulator's
 * cuMemGetInfo counts this process's memory only, so there it must be back
 * exactly. On a real GPU it is device-wide (other processes, other tests
 * running in parallel, the driver's own allocations move it): there the
 * engines' own count of their device scratch must be zero (call this only
 * once every engine is destroyed). */
static void check_dev_free(size_t free0, const char *file, int line) {
  if (harness_on_emulator()) {
    size_t now = dev_free_bytes();
    if (now != free0)
      harness_fail(file, line, "device memory: %zu bytes free, %zu before",
                   now, free0);
    return;
  }
  uint64_t bytes = 1;
  uint64_t live = gpuipc__xfer_scratch_live(&bytes);
  if (live != 0 || bytes != 0)
    harness_fail(file, line, "%llu scratch allocations (%llu bytes) live",
                 (unsigned long long)live, (unsigned long long)bytes);
}
#define CHECK_DEV_FREE(free0) check_dev_free((free0), __FILE__, __LINE__)

/* Polls a stream until done, for at most timeout_s seconds (a guard against
 * a hang, not a measurement). */
static CUresult stream_done(CUstream s, int timeout_s) {
  time_t deadline = time(NULL) + timeout_s;
  for (;;) {
    CUresult r = gpuipc__cu.cuStreamQuery(s);
    if (r != CUDA_ERROR_NOT_READY || time(NULL) > deadline)
      return r;
    usleep(500);
  }
}

/* A host function that holds its stream until the test opens it (as in the
 * conformance suite). Gates are opened at exit so that a failed assertion
 * never leaves a driver thread blocked. */
typedef struct gate {
  atomic_int open;
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
  while (!atomic_load(&g->open))
    usleep(200);
}
static gate *gate_launch(CUstream s) {
  ASSERT_LT(ngates, MAX_GATES);
  if (ngates == 0)
    atexit(open_all_gates);
  gate *g = &gates[ngates++];
  ASSERT_CU(gpuipc__cu.cuLaunchHostFunc(s, gate_fn, g));
  return g;
}

static gpuipc_xfer *engine(int streams, size_t chunk, size_t staging) {
  /* Staging at every size (small pageable sources into an idle stream
   * would go to the driver's pageable copy: see
   * xfer_small_pageable_to_device). */
  gpuipc__xfer_driver_pageable_max = 0;
  gpuipc__xfer_driver_pageable_out_max = 0;
  gpuipc_xfer_options o = GPUIPC_XFER_OPTIONS_INIT;
  o.streams = streams;
  o.chunk_bytes = chunk;
  o.staging_bytes = staging;
  gpuipc_xfer *x = NULL;
  ASSERT_OK(gpuipc_xfer_create(NULL, &o, &x));
  ASSERT_NOT_NULL(x);
  return x;
}

static gpuipc_xfer_info info_of(gpuipc_xfer *x) {
  gpuipc_xfer_info i;
  memset(&i, 0, sizeof i);
  i.size = sizeof i;
  ASSERT_OK(gpuipc_xfer_get_info(x, &i));
  return i;
}

/* Destroys an engine and checks, with the driver, that its staging ring is
 * no longer pinned memory, and that no engine of this process holds pinned
 * memory any more (when it was the last one). Returns destroy's status. */
static gpuipc_status destroy_checked(gpuipc_xfer *x, int last) {
  void *staging = gpuipc__xfer_staging_base(x);
  unsigned type = 0;
  if (staging) {
    ASSERT_CU(gpuipc__cu.cuPointerGetAttribute(
        &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        (CUdeviceptr)(uintptr_t)staging));
    ASSERT_EQ(type, CU_MEMORYTYPE_HOST);
  }
  gpuipc_status s = gpuipc_xfer_destroy(x);
  if (staging)
    ASSERT_CU_EQ(gpuipc__cu.cuPointerGetAttribute(
                     &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                     (CUdeviceptr)(uintptr_t)staging),
                 CUDA_ERROR_INVALID_VALUE);
  if (last) {
    uint64_t bytes = 1;
    ASSERT_UEQ(gpuipc__xfer_pinned_live(&bytes), 0);
    ASSERT_UEQ(bytes, 0);
  }
  return s;
}

/* ---- arguments ----------------------------------------------------------- */

TEST_IMPL(xfer_args) {
  gpuipc__ctx_guard g;
  enter0(&g);
  ASSERT_OK(gpuipc_xfer_destroy(NULL));
  gpuipc_xfer *x = NULL;
  ASSERT_STATUS(gpuipc_xfer_create(NULL, NULL, NULL), GPUIPC_E_INVALID_ARG);
  gpuipc_xfer_options o = GPUIPC_XFER_OPTIONS_INIT;
  o.streams = GPUIPC_XFER_MAX_STREAMS + 1;
  ASSERT_STATUS(gpuipc_xfer_create(NULL, &o, &x), GPUIPC_E_INVALID_ARG);
  ASSERT_NULL(x);
  o.streams = -1;
  ASSERT_STATUS(gpuipc_xfer_create(NULL, &o, &x), GPUIPC_E_INVALID_ARG);
  o.streams = 0;
  o.size = 0;
  ASSERT_STATUS(gpuipc_xfer_create(NULL, &o, &x), GPUIPC_E_INVALID_ARG);
  o = (gpuipc_xfer_options)GPUIPC_XFER_OPTIONS_INIT;
  o.staging_bytes = 1;
  ASSERT_STATUS(gpuipc_xfer_create(NULL, &o, &x), GPUIPC_E_INVALID_ARG);
  /* A device not visible here, by UUID. */
  gpuipc_uuid nowhere;
  memset(&nowhere, 0xEE, sizeof nowhere);
  ASSERT_STATUS(gpuipc_xfer_create(&nowhere, NULL, &x),
                GPUIPC_E_DEVICE_NOT_VISIBLE);
  ASSERT_NULL(x);

  /* An older caller's smaller struct: only `size` bytes are read. */
  struct {
    size_t size;
    int streams;
  } old = {sizeof old, 3};
  ASSERT_OK(
      gpuipc_xfer_create(NULL, (const gpuipc_xfer_options *)(void *)&old, &x));
  ASSERT_EQ(info_of(x).streams, 3);
  ASSERT_OK(gpuipc_xfer_destroy(x));

  /* By UUID, and NULL: device 0; the info names the device by UUID. */
  gpuipc_uuid u0;
  ASSERT_OK(gpuipc_device_uuid(0, &u0));
  ASSERT_OK(gpuipc_xfer_create(&u0, NULL, &x));
  ASSERT_MEM_EQ(info_of(x).device.bytes, u0.bytes, 16);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_OK(gpuipc_xfer_create(NULL, NULL, &x));
  ASSERT_MEM_EQ(info_of(x).device.bytes, u0.bytes, 16);
  ASSERT_OK(gpuipc_xfer_destroy(x));

  ASSERT_OK(gpuipc_xfer_create(NULL, NULL, &x));
  gpuipc_xfer_info in = info_of(x);
  ASSERT_GE(in.streams, 2);
  ASSERT_GE(in.staging_slots, 2);
  ASSERT_EQ(in.staging_allocated, 0); /* nothing pinned until needed */
  char h[16];
  CUdeviceptr d = dev_alloc(16);
  /* Zero bytes: nothing to do, NULL pointers allowed. */
  ASSERT_OK(gpuipc_xfer_to_device(x, NULL, NULL, 0, NULL, 0));
  ASSERT_OK(gpuipc_xfer_to_host(x, NULL, NULL, 0, NULL, GPUIPC_XFER_SYNC));
  ASSERT_OK(gpuipc_xfer_pipeline(x, NULL, NULL, 0, NULL, NULL, 0));
  ASSERT_EQ(info_of(x).transfers, 0);
  ASSERT_STATUS(gpuipc_xfer_to_device(NULL, D(d), h, 1, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_xfer_to_device(x, NULL, h, 1, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_xfer_to_host(x, h, NULL, 1, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_xfer_to_host(x, h, D(d), 1, NULL, 0x80),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "flags");
  ASSERT_STATUS(gpuipc_xfer_pipeline(x, h, h + 4, 8, NULL, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "overlap");
  gpuipc_xfer_stage st = GPUIPC_XFER_STAGE_INIT;
  st.size = 0;
  char h2[16];
  ASSERT_STATUS(gpuipc_xfer_pipeline(x, h2, h, 8, &st, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  size_t c = 0;
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, 100, &c));
  ASSERT_EQ(c, 100);
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, (size_t)1 << 30, &c));
  ASSERT_LE(c, in.max_chunk_bytes);
  ASSERT_GE(c, (size_t)1 << 20);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The heuristic as documented in xfer.h. */
TEST_IMPL(xfer_heuristic) {
  gpuipc_xfer *x = NULL;
  ASSERT_OK(gpuipc_xfer_create(NULL, NULL, &x));
  gpuipc_xfer_info in = info_of(x);
  ASSERT_EQ(in.streams, in.copy_engines >= 2 ? 4 : 2);
  ASSERT_UEQ(in.max_chunk_bytes, (size_t)8 << 20);
  ASSERT_UEQ(in.staging_slot_bytes, (size_t)8 << 20);
  ASSERT_EQ(in.staging_slots, 2 * in.streams);
  size_t c;
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, 1000, &c));
  ASSERT_UEQ(c, 1000);
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, (size_t)4 << 20, &c));
  ASSERT_UEQ(c, (size_t)1 << 20); /* n/16 is below the 1 MiB floor */
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, (size_t)64 << 20, &c));
  ASSERT_UEQ(c, (size_t)4 << 20);
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, ((size_t)64 << 20) + 1, &c));
  ASSERT_UEQ(c, ((size_t)4 << 20) + (64 << 10)); /* rounded up to 64 KiB */
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, (size_t)4 << 30, &c));
  ASSERT_UEQ(c, (size_t)8 << 20);
  /* Host threads: half the CPUs, 1 to 16. */
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  ASSERT_EQ(in.host_threads, cpus / 2 < 1 ? 1 : cpus / 2 > 16 ? 16 : cpus / 2);
  /* A pageable side: n/8 rounded up to 64 KiB (2 MiB + 64 KiB here), so 8
   * chunks, the first copy growing the ring to 4 MiB slots. */
  {
    gpuipc__ctx_guard g;
    enter0(&g);
    const size_t n = ((size_t)16 << 20) + 1;
    uint8_t *h = malloc(n);
    ASSERT_NOT_NULL(h);
    fill_random(h, n, 5);
    CUdeviceptr d = dev_alloc(n);
    ASSERT_OK(gpuipc_xfer_to_device(x, D(d), h, n, NULL, GPUIPC_XFER_SYNC));
    in = info_of(x);
    ASSERT_UEQ(in.chunks, 8);
    ASSERT_UEQ(in.staging_bytes, (size_t)in.staging_slots * (4 << 20));
    ASSERT_OK(gpuipc_xfer_to_host(x, h, D(d), (size_t)4 << 20, NULL, 0));
    ASSERT_UEQ(info_of(x).chunks, 8 + 4); /* the 1 MiB floor */
    ASSERT_CU(gpuipc__cu.cuMemFree(d));
    free(h);
    gpuipc__ctx_leave(&g);
  }
  ASSERT_OK(gpuipc_xfer_destroy(x));

  /* Overrides. A ring smaller than two chunks makes smaller slots. */
  x = engine(3, 10000, 12000);
  in = info_of(x);
  ASSERT_EQ(in.streams, 3);
  ASSERT_UEQ(in.max_chunk_bytes, 10000);
  ASSERT_UEQ(in.staging_slot_bytes, 6000);
  ASSERT_EQ(in.staging_slots, 2);
  ASSERT_OK(gpuipc_xfer_get_chunk_size(x, (size_t)1 << 30, &c));
  ASSERT_UEQ(c, 10000);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  return 0;
}

/* ---- every size ---------------------------------------------------------- */

enum { K_PAGEABLE, K_PINNED, K_DEVICE };
static const char *kind_name(int k) {
  return k == K_PAGEABLE ? "pageable" : k == K_PINNED ? "pinned" : "device";
}

/* One host -> device -> host round trip of n bytes at the given offsets,
 * with guard bytes around every destination. */
static void roundtrip(gpuipc_xfer *x, CUstream stream, size_t n, int src_kind,
                      size_t soff, int dst_kind, size_t doff, size_t devoff,
                      unsigned flags, uint64_t seed) {
  const size_t guard = 64;
  size_t hsz = soff + n + guard, dsz = doff + n + guard,
         devsz = devoff + n + guard;
  uint8_t *src = src_kind == K_PINNED ? pinned_alloc(hsz) : malloc(hsz);
  uint8_t *dst = dst_kind == K_PINNED ? pinned_alloc(dsz) : malloc(dsz);
  ASSERT_NOT_NULL(src);
  ASSERT_NOT_NULL(dst);
  fill_random(src, hsz, seed);
  memset(dst, 0xDD, dsz);
  CUdeviceptr dev = dev_alloc(devsz);
  /* The poison goes on the caller's stream, before the copy, as the
   * caller's earlier work: the engine must start after it. (A synchronous
   * cuMemsetD8 would be wrong here: on a real GPU it returns before the
   * memset has run, on the legacy default stream, which a non-blocking
   * stream does not wait for; the poison could then land after the copy.
   * The emulator completes synchronous memsets at once and hid that.) With
   * GPUIPC_EMU_COPY_DELAY_US the emulated memset is slow, so an engine that
   * does not wait for the caller's stream reads or overwrites the poison. */
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(dev, 0xEE, devsz, stream));

  gpuipc_status s =
      gpuipc_xfer_to_device(x, D(dev + devoff), src + soff, n, stream, flags);
  if (s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "to_device %zu bytes from %s: %s: %s", n,
                 kind_name(src_kind), gpuipc_status_name(s),
                 gpuipc_last_error());
  s = gpuipc_xfer_to_host(x, dst + doff, D(dev + devoff), n, stream, flags);
  if (s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "to_host %zu bytes to %s: %s: %s", n,
                 kind_name(dst_kind), gpuipc_status_name(s),
                 gpuipc_last_error());
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(stream));
  for (size_t i = 0; i < n; i++)
    if (dst[doff + i] != src[soff + i])
      harness_fail(__FILE__, __LINE__,
                   "%zu bytes %s -> device -> %s (src +%zu, dst +%zu, device "
                   "+%zu): byte %zu is 0x%02x, want 0x%02x",
                   n, kind_name(src_kind), kind_name(dst_kind), soff, doff,
                   devoff, i, dst[doff + i], src[soff + i]);
  for (size_t i = 0; i < doff; i++)
    ASSERT_EQ(dst[i], 0xDD);
  for (size_t i = doff + n; i < dsz; i++)
    ASSERT_EQ(dst[i], 0xDD);
  uint8_t *devcopy = malloc(devsz);
  ASSERT_NOT_NULL(devcopy);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(devcopy, dev, devsz));
  for (size_t i = 0; i < devoff; i++)
    ASSERT_EQ(devcopy[i], 0xEE);
  for (size_t i = devoff + n; i < devsz; i++)
    ASSERT_EQ(devcopy[i], 0xEE);
  ASSERT_MEM_EQ(devcopy + devoff, src + soff, n);
  free(devcopy);
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  if (src_kind == K_PINNED)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(src));
  else
    free(src);
  if (dst_kind == K_PINNED)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(dst));
  else
    free(dst);
}

TEST_IMPL(xfer_sizes) {
  /* Slow emulated copies and memsets: a copy that does not wait for the
   * caller's earlier work, or a staging slot reused too early, shows. */
  setenv("GPUIPC_EMU_COPY_DELAY_US", "100", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  const size_t chunk = 4096;
  /* 3 slots of 4 KiB: every size past 12 KiB wraps the ring. */
  gpuipc_xfer *x = engine(3, chunk, 3 * chunk);
  CUstream st = new_stream();
  const size_t sizes[] = {1,
                          2,
                          7,
                          chunk - 1,
                          chunk,
                          chunk + 1,
                          2 * chunk,
                          3 * chunk - 1,
                          3 * chunk,
                          3 * chunk + 1,
                          10 * chunk + 123,
                          64 * chunk + 5};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(sizes); i++)
    for (int sk = K_PAGEABLE; sk <= K_PINNED; sk++)
      for (int dk = K_PAGEABLE; dk <= K_PINNED; dk++)
        roundtrip(x, i % 2 ? st : NULL, sizes[i], sk, i % 5, dk, i % 3, i % 7,
                  i % 3 == 0 ? GPUIPC_XFER_SYNC : 0, 1000 + i);
  gpuipc_xfer_info in = info_of(x);
  ASSERT_EQ(in.staging_allocated, 1);
  ASSERT_GT(in.staged_bytes, 0);
  ASSERT_GT(in.direct_bytes, 0);
  ASSERT_OK(gpuipc_xfer_destroy(x));

  /* The automatic engine, around its own chunk size. */
  x = engine(0, 0, 0);
  const size_t mib = (size_t)1 << 20;
  const size_t sizes2[] = {1, mib - 1, mib + 1, 5 * mib + 3};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(sizes2); i++)
    roundtrip(x, st, sizes2[i], K_PAGEABLE, 3, K_PAGEABLE, 1, 5, 0, 77 + i);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Random sizes, offsets, memory kinds, streams and flags, on engines of
 * several shapes (odd chunk sizes included). A slow emulated copy engine
 * (GPUIPC_EMU_COPY_DELAY_US) keeps DMAs in flight long enough that a staging
 * slot written too early would be caught. */
TEST_IMPL(xfer_random) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "200", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  struct {
    int streams;
    size_t chunk, staging;
  } shapes[] = {{0, 0, 0},
                {3, 4096, 3 * 4096},
                {1, 1000, 2500},
                {5, 777, 0},
                {2, 65536, 2 * 65536}};
  CUstream st = new_stream();
  uint64_t rs = 0x1234567ull;
  for (size_t e = 0; e < GPUIPC__ARRAY_SIZE(shapes); e++) {
    gpuipc_xfer *x =
        engine(shapes[e].streams, shapes[e].chunk, shapes[e].staging);
    for (int it = 0; it < 12; it++) {
      size_t n = rng_below(&rs, 4) == 0 ? rng_below(&rs, 3)
                                        : 1 + rng_below(&rs, 200000);
      roundtrip(x, rng_below(&rs, 2) ? st : NULL, n, (int)rng_below(&rs, 2),
                rng_below(&rs, 100), (int)rng_below(&rs, 2),
                rng_below(&rs, 100), rng_below(&rs, 1000),
                rng_below(&rs, 2) ? GPUIPC_XFER_SYNC : 0, rng_next(&rs));
    }
    ASSERT_OK(gpuipc_xfer_destroy(x));
  }
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- the pipeline -------------------------------------------------------- */

/* The stage: copies the chunk (cuMemcpyDtoDAsync), then overwrites one byte
 * at a position and with a value derived from the chunk's offset, and
 * enqueues a host function that counts executions. The expected output is
 * the input with one marked byte per chunk: a skipped chunk keeps the
 * destination's poison, a chunk given the wrong offset or written to the
 * wrong place carries the wrong mark, and a stage run twice counts twice. */
#define MAX_CHUNKS 4096
typedef struct stage_log {
  size_t next_off;
  int calls;
  size_t offs[MAX_CHUNKS], lens[MAX_CHUNKS];
  atomic_int executed;
  int fail_at; /* return GPUIPC_E_USER at this call (-1: never) */
  CUdeviceptr dev_in, dev_out; /* when the caller gave buffers: check them */
  int bad_order;
} stage_log;

static size_t mark_pos(size_t off, size_t len) {
  return (size_t)((off * 2654435761u + 17) % len);
}
static uint8_t mark_val(size_t off) { return (uint8_t)(0xA5 ^ (off * 31 / 7)); }

static void CUDA_CB count_fn(void *arg) {
  atomic_fetch_add(&((stage_log *)arg)->executed, 1);
}

static gpuipc_status mark_stage(void *user, struct CUstream_st *stream,
                                void *din, void *dout, size_t off, size_t len) {
  stage_log *l = user;
  if (off != l->next_off || len == 0)
    l->bad_order = 1;
  if (l->dev_in && (CUdeviceptr)(uintptr_t)din != l->dev_in + off)
    l->bad_order = 1;
  if (l->dev_out && (CUdeviceptr)(uintptr_t)dout != l->dev_out + off)
    l->bad_order = 1;
  if (l->calls < MAX_CHUNKS) {
    l->offs[l->calls] = off;
    l->lens[l->calls] = len;
  }
  l->next_off = off + len;
  if (l->calls++ == l->fail_at)
    return GPUIPC_E_USER;
  if (din != dout && gpuipc__cu.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)dout,
                                                  (CUdeviceptr)(uintptr_t)din,
                                                  len, stream) != CUDA_SUCCESS)
    return GPUIPC_E_DRIVER;
  if (gpuipc__cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)dout +
                                     mark_pos(off, len),
                                 mark_val(off), 1, stream) != CUDA_SUCCESS)
    return GPUIPC_E_DRIVER;
  if (gpuipc__cu.cuLaunchHostFunc(stream, count_fn, l) != CUDA_SUCCESS)
    return GPUIPC_E_DRIVER;
  return GPUIPC_OK;
}

/* Checks dst against src with one mark per chunk of the log. */
static void check_marked(const uint8_t *dst, const uint8_t *src, size_t n,
                         const stage_log *l) {
  ASSERT_EQ(l->bad_order, 0);
  ASSERT_LE(l->calls, MAX_CHUNKS);
  ASSERT_UEQ(l->next_off, n);
  ASSERT_EQ(atomic_load(&l->executed), l->calls);
  uint8_t *want = malloc(n ? n : 1);
  ASSERT_NOT_NULL(want);
  memcpy(want, src, n);
  for (int c = 0; c < l->calls; c++)
    want[l->offs[c] + mark_pos(l->offs[c], l->lens[c])] = mark_val(l->offs[c]);
  for (size_t i = 0; i < n; i++)
    if (dst[i] != want[i])
      harness_fail(__FILE__, __LINE__,
                   "pipeline of %zu bytes in %d chunks: byte %zu is 0x%02x, "
                   "want 0x%02x",
                   n, l->calls, i, dst[i], want[i]);
  free(want);
}

static stage_log *new_log(void) {
  stage_log *l = calloc(1, sizeof *l);
  ASSERT_NOT_NULL(l);
  l->fail_at = -1;
  return l;
}

/* One pipeline run of n bytes; own_buffers: the caller gives dev_in/dev_out
 * (checked afterwards too). */
static void pipeline_once(gpuipc_xfer *x, CUstream st, size_t n, int src_kind,
                          int dst_kind, int own_buffers, unsigned flags,
                          uint64_t seed) {
  uint8_t *src = src_kind == K_PINNED ? pinned_alloc(n + 3) : malloc(n + 3);
  uint8_t *dst = dst_kind == K_PINNED ? pinned_alloc(n + 3) : malloc(n + 3);
  ASSERT_NOT_NULL(src);
  ASSERT_NOT_NULL(dst);
  fill_random(src, n + 3, seed);
  memset(dst, 0xDD, n + 3);
  stage_log *l = new_log();
  gpuipc_xfer_stage stage = GPUIPC_XFER_STAGE_INIT;
  stage.fn = mark_stage;
  stage.user = l;
  if (own_buffers) {
    l->dev_in = dev_alloc(n);
    l->dev_out = own_buffers == 2 ? l->dev_in : dev_alloc(n);
    stage.dev_in = D(l->dev_in);
    stage.dev_out = D(l->dev_out);
  }
  /* With dev_out == dev_in (in place) the stage only marks. */
  ASSERT_OK(gpuipc_xfer_pipeline(x, dst + 1, src + 2, n, &stage, st, flags));
  ASSERT_CU(stream_done(st, 120));
  check_marked(dst + 1, src + 2, n, l);
  ASSERT_EQ(dst[0], 0xDD);
  ASSERT_EQ(dst[n + 1], 0xDD);
  if (own_buffers) {
    uint8_t *h = malloc(n);
    ASSERT_NOT_NULL(h);
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, l->dev_out, n));
    ASSERT_MEM_EQ(h, dst + 1, n);
    if (own_buffers == 1) {
      ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, l->dev_in, n));
      ASSERT_MEM_EQ(h, src + 2, n);
      ASSERT_CU(gpuipc__cu.cuMemFree(l->dev_out));
    }
    ASSERT_CU(gpuipc__cu.cuMemFree(l->dev_in));
    free(h);
  }
  free(l);
  if (src_kind == K_PINNED)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(src));
  else
    free(src);
  if (dst_kind == K_PINNED)
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(dst));
  else
    free(dst);
}

TEST_IMPL(xfer_pipeline_integrity) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "100", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream st = new_stream();
  uint64_t rs = 99;
  struct {
    int streams;
    size_t chunk, staging;
  } shapes[] = {{0, 0, 0}, {4, 4096, 2 * 4096}, {2, 999, 0}, {3, 8192, 0}};
  for (size_t e = 0; e < GPUIPC__ARRAY_SIZE(shapes); e++) {
    gpuipc_xfer *x =
        engine(shapes[e].streams, shapes[e].chunk, shapes[e].staging);
    for (int it = 0; it < 10; it++) {
      size_t n = it == 0 ? 1 : 1 + rng_below(&rs, 150000);
      pipeline_once(x, it % 3 ? st : NULL, n, (int)rng_below(&rs, 2),
                    (int)rng_below(&rs, 2), (int)rng_below(&rs, 3),
                    rng_below(&rs, 2) ? GPUIPC_XFER_SYNC : 0, rng_next(&rs));
    }
    ASSERT_OK(gpuipc_xfer_destroy(x));
  }
  /* Larger than the automatic chunk, through the automatic engine. */
  gpuipc_xfer *x = engine(0, 0, 0);
  pipeline_once(x, st, ((size_t)3 << 20) + 12345, K_PAGEABLE, K_PAGEABLE, 0, 0,
                5);
  pipeline_once(x, st, ((size_t)3 << 20) + 1, K_PINNED, K_PINNED, 1, 0, 6);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* No stage: the input comes back unchanged. */
TEST_IMPL(xfer_pipeline_no_stage) {
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer *x = engine(2, 5000, 0);
  size_t n = 23456;
  uint8_t *src = malloc(n), *dst = malloc(n);
  fill_random(src, n, 3);
  memset(dst, 0, n);
  ASSERT_OK(gpuipc_xfer_pipeline(x, dst, src, n, NULL, NULL, GPUIPC_XFER_SYNC));
  ASSERT_MEM_EQ(dst, src, n);
  free(src);
  free(dst);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- ordering with the caller's stream ----------------------------------- */

/* The copy starts after the caller's earlier work on its stream, and the
 * caller's later work runs after the copy, although the copy runs on the
 * engine's own streams. A gate holds the caller's stream so that nothing
 * depends on timing: while it is closed, nothing of the copy may happen. */
TEST_IMPL(xfer_stream_order) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "300", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  const size_t n = 50000;
  gpuipc_xfer *x = engine(4, 4096, 0); /* 13 chunks over 4 streams */
  CUstream st = new_stream();
  CUdeviceptr dev = dev_alloc(n), dev2 = dev_alloc(n);
  uint8_t *pin = pinned_alloc(n), *back = pinned_alloc(n);
  ASSERT_CU(gpuipc__cu.cuMemsetD8(dev, 0x11, n));
  /* A synchronous memset may return before it ran (real GPUs), on the
   * legacy stream, which the non-blocking st does not wait for. */
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
  memset(pin, 0x22, n);
  memset(back, 0, n);

  /* device -> host: the copy must see the memset enqueued before it. */
  gate *gt = gate_launch(st);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(dev, 0x33, n, st));
  ASSERT_OK(gpuipc_xfer_to_host(x, pin, D(dev), n, st, 0));
  /* Later work on the caller's stream: must run after the copy read dev. */
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(dev, 0x44, n, st));
  usleep(20000);
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(pin[i], 0x22); /* gate closed: nothing happened yet */
  atomic_store(&gt->open, 1);
  ASSERT_CU(stream_done(st, 60));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(pin[i], 0x33);

  /* host -> device, then the caller's copy of the result. */
  memset(pin, 0x55, n);
  gt = gate_launch(st);
  ASSERT_OK(gpuipc_xfer_to_device(x, D(dev2), pin, n, st, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoHAsync(back, dev2, n, st));
  atomic_store(&gt->open, 1);
  ASSERT_CU(stream_done(st, 60));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(back[i], 0x55);

  /* The pipeline, caller buffers on the device, legacy default stream. */
  memset(back, 0, n);
  stage_log *l = new_log();
  gpuipc_xfer_stage stage = GPUIPC_XFER_STAGE_INIT;
  stage.fn = mark_stage;
  stage.user = l;
  ASSERT_OK(gpuipc_xfer_pipeline(x, back, pin, n, &stage, NULL, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
  check_marked(back, pin, n, l);
  free(l);

  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(back));
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  ASSERT_CU(gpuipc__cu.cuMemFree(dev2));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* One engine, two caller streams. The engine forks from each caller's
 * stream with an event; a copy for stream A that waits behind A's earlier
 * work must keep waiting when a later call records the fork again on an idle
 * stream B (each record is its own: cuStreamWaitEvent captures the record
 * current at the call). */
TEST_IMPL(xfer_two_caller_streams) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "100", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  const size_t n = 3000;
  gpuipc_xfer *x = engine(2, 0, 0);
  CUstream a = new_stream(), b = new_stream();
  CUdeviceptr da = dev_alloc(n), db = dev_alloc(n);
  ASSERT_CU(gpuipc__cu.cuMemsetD8(da, 0x11, n));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
  uint8_t *sa = malloc(n), *sb = malloc(n), *back = malloc(n);
  ASSERT_NOT_NULL(sa);
  ASSERT_NOT_NULL(sb);
  ASSERT_NOT_NULL(back);
  memset(sa, 0x5A, n);
  memset(sb, 0x6B, n);

  gate *gt = gate_launch(a);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(da, 0x22, n, a));
  ASSERT_OK(gpuipc_xfer_to_device(x, D(da), sa, n, a, 0)); /* pageable */
  ASSERT_OK(gpuipc_xfer_to_device(x, D(db), sb, n, b, 0));
  usleep(20000);
  /* A is held: the copy into da has not happened (the legacy stream's
   * synchronous copy does not wait for the non-blocking a). */
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, da, n));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(back[i], 0x11);
  atomic_store(&gt->open, 1);
  ASSERT_CU(stream_done(a, 60));
  ASSERT_CU(stream_done(b, 60));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, da, n));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(back[i], 0x5A); /* after the memset, not overwritten by it */
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, db, n));
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(back[i], 0x6B);

  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_CU(gpuipc__cu.cuMemFree(da));
  ASSERT_CU(gpuipc__cu.cuMemFree(db));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(a));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(b));
  free(sa);
  free(sb);
  free(back);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* A pageable source is consumed by the time the call returns (documented):
 * overwriting it at once does not change what arrives. GPUIPC_XFER_SYNC:
 * the destination is complete on return without synchronizing. */
TEST_IMPL(xfer_completion_modes) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "300", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  const size_t n = 100000;
  gpuipc_xfer *x = engine(2, 8192, 0);
  CUstream st = new_stream();
  CUdeviceptr dev = dev_alloc(n);
  uint8_t *src = malloc(n), *want = malloc(n), *back = malloc(n);
  fill_random(src, n, 11);
  memcpy(want, src, n);
  ASSERT_OK(gpuipc_xfer_to_device(x, D(dev), src, n, st, 0));
  memset(src, 0, n);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, dev, n));
  ASSERT_MEM_EQ(back, want, n);

  /* Pinned destination, SYNC: complete on return. */
  uint8_t *pin = pinned_alloc(n);
  memset(pin, 0, n);
  ASSERT_OK(gpuipc_xfer_to_host(x, pin, D(dev), n, st, GPUIPC_XFER_SYNC));
  ASSERT_MEM_EQ(pin, want, n);
  /* Unchunked pinned path (n <= chunk is one DMA on the caller's stream). */
  gpuipc_xfer *auto_x = engine(0, 0, 0);
  memset(pin, 0, n);
  ASSERT_OK(gpuipc_xfer_to_host(auto_x, pin, D(dev), n, st, GPUIPC_XFER_SYNC));
  ASSERT_MEM_EQ(pin, want, n);
  gpuipc_xfer_info in = info_of(auto_x);
  ASSERT_EQ(in.chunks, 1);
  ASSERT_EQ(in.staging_allocated, 0);
  ASSERT_UEQ(in.direct_bytes, n);
  /* Pageable destination: complete on return even without SYNC. */
  memset(back, 0, n);
  ASSERT_OK(gpuipc_xfer_to_host(x, back, D(dev), n, st, 0));
  ASSERT_MEM_EQ(back, want, n);
  /* Device "host" side: device to device through the same calls. */
  CUdeviceptr dev2 = dev_alloc(n);
  ASSERT_OK(gpuipc_xfer_to_device(x, D(dev2), D(dev), n, st, GPUIPC_XFER_SYNC));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, dev2, n));
  ASSERT_MEM_EQ(back, want, n);

  ASSERT_OK(gpuipc_xfer_destroy(auto_x));
  ASSERT_OK(gpuipc_xfer_destroy(x));
  ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin));
  ASSERT_CU(gpuipc__cu.cuMemFree(dev));
  ASSERT_CU(gpuipc__cu.cuMemFree(dev2));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  free(src);
  free(want);
  free(back);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- failures ------------------------------------------------------------ */

/* The stage fails at its 5th chunk: the call returns its status with a
 * message, the engine stays usable, and after destroy the device memory is
 * back where it was. */
TEST_IMPL(xfer_stage_error) {
  gpuipc__ctx_guard g;
  enter0(&g);
  size_t free0 = dev_free_bytes();
  gpuipc_xfer *x = engine(3, 4096, 3 * 4096);
  const size_t n = 40000;
  uint8_t *src = malloc(n), *dst = malloc(n);
  fill_random(src, n, 21);
  for (int round = 0; round < 2; round++) {
    stage_log *l = new_log();
    l->fail_at = 4;
    gpuipc_xfer_stage stage = GPUIPC_XFER_STAGE_INIT;
    stage.fn = mark_stage;
    stage.user = l;
    ASSERT_STATUS(gpuipc_xfer_pipeline(x, dst, src, n, &stage, NULL, 0),
                  GPUIPC_E_USER);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "stage");
    ASSERT_STR_CONTAINS(gpuipc_last_error(), "offset 16384");
    ASSERT_EQ(l->calls, 5);
    /* Everything enqueued before the failure has run (4 stages). */
    ASSERT_EQ(atomic_load(&l->executed), 4);
    free(l);
    /* Usable afterwards. */
    l = new_log();
    stage.user = l;
    memset(dst, 0, n);
    ASSERT_OK(
        gpuipc_xfer_pipeline(x, dst, src, n, &stage, NULL, GPUIPC_XFER_SYNC));
    check_marked(dst, src, n, l);
    free(l);
  }
  ASSERT_UEQ(gpuipc__xfer_pinned_live(NULL), 1);
  ASSERT_OK(destroy_checked(x, 1));
  CHECK_DEV_FREE(free0);
  free(src);
  free(dst);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Fault injection. The helper runs a fixed workload with one driver call
 * failing (GPUIPC_EMU_FAIL): the failure must come back as a status naming
 * the call, every later transfer must work and carry the right data, and
 * after destroy the process holds no more device memory and no more pinned
 * memory than before the engine was created. */
static int workload_op(gpuipc_xfer *x, int op, CUdeviceptr dev, uint8_t *pin,
                       size_t n, gpuipc_status *st_out) {
  uint8_t *src = malloc(n), *dst = malloc(n);
  fill_random(src, n, (uint64_t)op + 1);
  memset(dst, 0, n);
  gpuipc_status s = GPUIPC_OK;
  stage_log *l = new_log();
  gpuipc_xfer_stage stage = GPUIPC_XFER_STAGE_INIT;
  stage.fn = mark_stage;
  stage.user = l;
  int ok_data = 1;
  switch (op) {
  case 0: /* pageable both ways */
    s = gpuipc_xfer_to_device(x, D(dev), src, n, NULL, 0);
    if (s == GPUIPC_OK)
      s = gpuipc_xfer_to_host(x, dst, D(dev), n, NULL, GPUIPC_XFER_SYNC);
    ok_data = s != GPUIPC_OK || memcmp(dst, src, n) == 0;
    break;
  case 1: /* pinned, chunked */
    memcpy(pin, src, n);
    s = gpuipc_xfer_to_device(x, D(dev), pin, n, NULL, GPUIPC_XFER_SYNC);
    memset(pin, 0, n);
    if (s == GPUIPC_OK)
      s = gpuipc_xfer_to_host(x, pin, D(dev), n, NULL, GPUIPC_XFER_SYNC);
    ok_data = s != GPUIPC_OK || memcmp(pin, src, n) == 0;
    break;
  default: /* pipeline, pageable, engine scratch */
    s = gpuipc_xfer_pipeline(x, dst, src, n, &stage, NULL, GPUIPC_XFER_SYNC);
    if (s == GPUIPC_OK)
      check_marked(dst, src, n, l);
    break;
  }
  free(l);
  free(src);
  free(dst);
  *st_out = s;
  return ok_data;
}

HELPER_IMPL(xfer_fault) {
  const char *spec = argv[0];
  char fname[64];
  snprintf(fname, sizeof fname, "%s", spec);
  char *colon = strchr(fname, ':');
  if (colon)
    *colon = '\0';
  gpuipc__ctx_guard g;
  enter0(&g);
  const size_t n = 30000;
  /* The helper's own driver calls come first (the counts in the specs
   * assume one cuMemAlloc and one cuMemHostAlloc before the engine). */
  CUdeviceptr dev = dev_alloc(n);
  uint8_t *pin = pinned_alloc(n);
  size_t free0 = dev_free_bytes();

  gpuipc_xfer *x = NULL;
  gpuipc_status s = gpuipc_xfer_create(
      NULL,
      &(gpuipc_xfer_options){.size = sizeof(gpuipc_xfer_options),
                             .streams = 3,
                             .chunk_bytes = 4096,
                             .staging_bytes = 3 * 4096},
      &x);
  int failures = 0;
  if (s != GPUIPC_OK) {
    failures++;
    ASSERT_NULL(x);
    ASSERT_STR_CONTAINS(gpuipc_last_error(), fname);
    ASSERT_EQ(gpuipc_last_cuda_error(), CUDA_ERROR_UNKNOWN);
    CHECK_DEV_FREE(free0);
  } else {
    for (int round = 0; round < 2; round++)
      for (int op = 0; op < 3; op++) {
        gpuipc_status os;
        int ok = workload_op(x, op, dev, pin, n, &os);
        ASSERT(ok);
        if (os != GPUIPC_OK) {
          failures++;
          if (os != GPUIPC_E_DRIVER)
            harness_fail(__FILE__, __LINE__, "op %d: %s: %s", op,
                         gpuipc_status_name(os), gpuipc_last_error());
          /* The stage's own driver calls (the test's) report through the
           * stage's status; the engine's carry the call and the CUresult. */
          if (strcmp(fname, "cuMemsetD8Async") == 0 ||
              strcmp(fname, "cuMemcpyDtoDAsync") == 0 ||
              strcmp(fname, "cuLaunchHostFunc") == 0) {
            ASSERT_STR_CONTAINS(gpuipc_last_error(), "stage");
          } else {
            ASSERT_EQ(gpuipc_last_cuda_error(), CUDA_ERROR_UNKNOWN);
            ASSERT_STR_CONTAINS(gpuipc_last_error(), fname);
          }
        }
      }
    ASSERT_UEQ(gpuipc__xfer_pinned_live(NULL),
               gpuipc__xfer_staging_base(x) != NULL);
    /* A failed free leaves its memory behind (nothing else can be done):
     * no leak check then. */
    int frees =
        strcmp(fname, "cuMemFreeHost") == 0 || strcmp(fname, "cuMemFree") == 0;
    gpuipc_status ds = frees ? gpuipc_xfer_destroy(x) : destroy_checked(x, 1);
    if (ds != GPUIPC_OK) {
      failures++;
      ASSERT_STR_CONTAINS(gpuipc_last_error(), fname);
    }
    if (!frees)
      CHECK_DEV_FREE(free0);
  }
  /* The helper's own frees may be the ones failing (in the sweep). */
  (void)gpuipc__cu.cuMemFree(dev);
  (void)gpuipc__cu.cuMemFreeHost(pin);
  gpuipc__ctx_leave(&g);
  if (failures == 0)
    return 3;             /* the count was beyond the calls made: not fired */
  ASSERT_EQ(failures, 1); /* the injected fault fired, exactly once */
  return 0;
}

TEST_IMPL(xfer_fault_injection) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FAIL");
  static const char *specs[] = {
      "cuStreamCreate:2",     "cuEventCreate:3",      "cuMemHostAlloc:2",
      "cuMemAlloc:2",         "cuMemcpyHtoDAsync:3",  "cuMemcpyHtoDAsync:9",
      "cuMemcpyDtoHAsync:2",  "cuMemcpyDtoHAsync:12", "cuMemcpyDtoDAsync:3",
      "cuEventRecord:4",      "cuEventRecord:30",     "cuStreamWaitEvent:2",
      "cuStreamWaitEvent:25", "cuEventSynchronize:2", "cuEventSynchronize:20",
      "cuMemsetD8Async:2",    "cuStreamDestroy:1",
  };
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(specs); i++) {
    char env[128];
    snprintf(env, sizeof env, "GPUIPC_EMU_FAIL=%s", specs[i]);
    /* No stream room: its creations would take the counted calls. */
    char *envv[] = {env, "GPUIPC_STREAM_ROOM=0", NULL, NULL};
    if (strstr(specs[i], "Destroy"))
      envv[2] = "ASAN_OPTIONS=detect_leaks=0"; /* the driver's object stays */
    pid_t pid = spawn_helper("xfer_fault", envv, NULL, specs[i], NULL);
    int rc = wait_helper(pid, 120);
    if (rc != 0)
      harness_fail(__FILE__, __LINE__, "fault %s: helper exit %d", specs[i],
                   rc);
  }
  return 0;
}

/* SQLite-style: every driver call the engine makes, failing at its 1st,
 * 2nd, 3rd, 5th, ... call, until a count is beyond the calls the workload
 * makes. */
TEST_IMPL(xfer_fault_sweep) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FAIL");
  static const struct {
    const char *fn;
    int first; /* the helper's own calls come before */
  } fns[] = {
      {"cuStreamCreate", 1},     {"cuEventCreate", 1},
      {"cuMemHostAlloc", 2},     {"cuMemAlloc", 2},
      {"cuMemcpyHtoDAsync", 1},  {"cuMemcpyDtoHAsync", 1},
      {"cuEventRecord", 1},      {"cuStreamWaitEvent", 1},
      {"cuEventSynchronize", 1}, {"cuStreamSynchronize", 1},
      {"cuStreamDestroy", 1},    {"cuEventDestroy", 1},
      {"cuMemFreeHost", 1},      {"cuMemFree", 1},
  };
  static const int counts[] = {1, 2, 3, 5, 8, 13, 21, 34, 55, 89};
  int runs = 0;
  for (size_t f = 0; f < GPUIPC__ARRAY_SIZE(fns); f++) {
    int fired = 0;
    for (size_t c = 0; c < GPUIPC__ARRAY_SIZE(counts); c++) {
      int n = counts[c] + fns[f].first - 1;
      char spec[96], env[128];
      snprintf(spec, sizeof spec, "%s:%d", fns[f].fn, n);
      snprintf(env, sizeof env, "GPUIPC_EMU_FAIL=%s", spec);
      char *envv[] = {env, "GPUIPC_STREAM_ROOM=0", NULL, NULL};
      /* A destroy that fails leaves the driver's object behind: in the
       * emulator that is heap memory a leak checker would report. */
      if (strstr(fns[f].fn, "Destroy") || strstr(fns[f].fn, "Free"))
        envv[2] = "ASAN_OPTIONS=detect_leaks=0";
      pid_t pid = spawn_helper("xfer_fault", envv, NULL, spec, NULL);
      int rc = wait_helper(pid, 120);
      runs++;
      if (rc == 3)
        break; /* beyond the workload's calls */
      if (rc != 0)
        harness_fail(__FILE__, __LINE__, "fault %s: helper exit %d", spec, rc);
      fired++;
    }
    if (fired == 0)
      harness_fail(__FILE__, __LINE__, "%s never failed: not called?",
                   fns[f].fn);
  }
  printf("%d fault runs\n", runs);
  return 0;
}

/* ---- several engines at once --------------------------------------------- */

typedef struct worker {
  gpuipc_xfer *x;
  int id;
  int iters;
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  gpuipc__ctx_guard g;
  enter0(&g);
  CUstream st = new_stream();
  uint64_t rs = 1000 + (uint64_t)w->id;
  for (int it = 0; it < w->iters; it++) {
    size_t n = 1 + rng_below(&rs, 60000);
    if (it % 2)
      pipeline_once(w->x, st, n, (int)rng_below(&rs, 2), (int)rng_below(&rs, 2),
                    (int)rng_below(&rs, 2), 0, rng_next(&rs));
    else
      roundtrip(w->x, st, n, (int)rng_below(&rs, 2), rng_below(&rs, 9),
                (int)rng_below(&rs, 2), rng_below(&rs, 9), rng_below(&rs, 9), 0,
                rng_next(&rs));
  }
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return NULL;
}

TEST_IMPL(xfer_several_engines) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "50", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  size_t free0 = dev_free_bytes();
  /* Four threads with an engine each, and two threads sharing a fifth
   * (its lock serializes them). */
  enum { NT = 6 };
  gpuipc_xfer *xs[5];
  for (int i = 0; i < 5; i++)
    xs[i] = engine(1 + i % 4, 1000 + 3000 * (size_t)i, 0);
  pthread_t th[NT];
  worker w[NT];
  for (int i = 0; i < NT; i++) {
    w[i] = (worker){.x = xs[i < 4 ? i : 4], .id = i, .iters = 8};
    ASSERT_EQ(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
  }
  for (int i = 0; i < NT; i++)
    ASSERT_EQ(pthread_join(th[i], NULL), 0);
  for (int i = 0; i < 5; i++)
    ASSERT_OK(destroy_checked(xs[i], i == 4));
  CHECK_DEV_FREE(free0);
  gpuipc__ctx_leave(&g);
  return 0;
}

/* A stage that calls back into its own engine gets GPUIPC_E_BUSY (and the
 * pipeline reports the stage's failure) instead of a deadlock. */
static gpuipc_status reenter_stage(void *user, struct CUstream_st *stream,
                                   void *din, void *dout, size_t off,
                                   size_t len) {
  gpuipc_xfer *x = user;
  char b[4] = {0};
  gpuipc_status s = gpuipc_xfer_to_device(x, din, b, sizeof b, stream, 0);
  return s == GPUIPC_E_BUSY ? GPUIPC_E_USER : GPUIPC_E_INTERNAL;
}

TEST_IMPL(xfer_stage_reentry) {
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer *x = engine(2, 0, 0);
  uint8_t src[100] = {1}, dst[100];
  gpuipc_xfer_stage st = GPUIPC_XFER_STAGE_INIT;
  st.fn = reenter_stage;
  st.user = x;
  ASSERT_STATUS(gpuipc_xfer_pipeline(x, dst, src, sizeof src, &st, NULL, 0),
                GPUIPC_E_USER);
  ASSERT_OK(gpuipc_xfer_destroy(x));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Helper threads share the memcpy of large staged chunks (pieces of at
 * least 256 KiB); the data must come out the same. */
TEST_IMPL(xfer_host_threads) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "100", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer_options o = GPUIPC_XFER_OPTIONS_INIT;
  o.streams = 2;
  o.chunk_bytes = ((size_t)1 << 20) + 4096 * 3 + 17; /* odd pieces */
  o.host_threads = 4;
  gpuipc_xfer *x = NULL;
  o.host_threads = GPUIPC__HCOPY_MAX_THREADS + 1;
  ASSERT_STATUS(gpuipc_xfer_create(NULL, &o, &x), GPUIPC_E_INVALID_ARG);
  o.host_threads = 4;
  ASSERT_OK(gpuipc_xfer_create(NULL, &o, &x));
  ASSERT_EQ(info_of(x).host_threads, 4);
  CUstream st = new_stream();
  const size_t sizes[] = {1, 300000, ((size_t)1 << 20) - 5,
                          ((size_t)5 << 20) + 999};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(sizes); i++) {
    roundtrip(x, st, sizes[i], K_PAGEABLE, i, K_PAGEABLE, 2 * i, 3 * i, 0,
              500 + i);
    pipeline_once(x, st, sizes[i], K_PAGEABLE, K_PAGEABLE, 0, 0, 600 + i);
  }
  gpuipc_xfer_info in = info_of(x);
  ASSERT_EQ(in.host_threads, 4); /* all helpers started */
  ASSERT_OK(destroy_checked(x, 1));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The host copy threads alone: many jobs back to back, of sizes that give
 * from one part to all threads a part, at odd offsets, with cached and
 * streaming stores; every byte lands, and no part of one job is copied with
 * another job's pointers (helpers that wake late claim nothing). */
TEST_IMPL(xfer_hcopy_many_jobs) {
  gpuipc__hcopy *h = NULL;
  ASSERT_OK(gpuipc__hcopy_create(8, &h));
  ASSERT_EQ(gpuipc__hcopy_threads(h), 8);
  const size_t cap = (size_t)5 << 20;
  uint8_t *src = malloc(cap + 64), *dst = malloc(cap + 64);
  ASSERT_NOT_NULL(src);
  ASSERT_NOT_NULL(dst);
  uint64_t r = 12345;
  for (int k = 0; k < 300; k++) {
    r = r * 6364136223846793005u + 1442695040888963407u;
    size_t n = (size_t)(r >> 33) % cap + 1;
    size_t so = (size_t)(r >> 20) % 61, dof = (size_t)(r >> 10) % 37;
    if (n + so > cap + 64 || n + dof > cap + 64)
      n = cap - 64;
    fill_random(src + so, n, (uint64_t)k);
    memset(dst, 0, cap + 64);
    gpuipc__hcopy_run(h, dst + dof, src + so, n, (k & 1) != 0);
    ASSERT_MEM_EQ(dst + dof, src + so, n);
    for (size_t i = 0; i < dof; i++)
      ASSERT_EQ(dst[i], 0);
    for (size_t i = dof + n; i < cap + 64 && i < dof + n + 64; i++)
      ASSERT_EQ(dst[i], 0);
  }
  gpuipc__hcopy_destroy(h);
  free(src);
  free(dst);
  return 0;
}

/* A pageable source of 256 KiB to 4 MiB into the device goes to the
 * driver's own pageable copy when the caller's stream is idle (it is as
 * quick as staging there, or quicker), and is staged when the stream still
 * has work (the driver's copy would wait on the host for that work), below
 * 256 KiB and from 4 MiB. Either way the data arrives and the source may
 * be reused on return. */
/* Copies n pageable bytes (pattern `seed`) to d on st, overwrites the
 * source at once (it is consumed on return), and checks which way the
 * engine took (direct, or staged) and that the data arrived. busy_word: a
 * device word (0) that st waits on until it is 1, so that the stream has
 * work pending at the copy on any driver (a short memset completes at once
 * on a GPU); the word is set from a second stream after the copy was
 * issued. 0: none, the stream is idle. */
static void small_copy(gpuipc_xfer *x, CUstream st, CUdeviceptr d, uint8_t *a,
                       uint8_t *back, size_t n, uint64_t seed,
                       CUdeviceptr busy_word, bool direct) {
  fill_random(a, n, seed);
  CUstream opener = NULL;
  if (busy_word) {
    opener = new_stream();
    ASSERT_CU(gpuipc__cu.cuMemsetD32(busy_word, 0, 1));
    ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(st, busy_word, 1,
                                             CU_STREAM_WAIT_VALUE_EQ));
    ASSERT_CU_EQ(gpuipc__cu.cuStreamQuery(st), CUDA_ERROR_NOT_READY);
  }
  gpuipc_xfer_info before = info_of(x);
  gpuipc_status s = gpuipc_xfer_to_device(x, D(d), a, n, st, 0);
  if (busy_word) {
    /* Open the busy_word whatever the copy said, so that st drains. */
    ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(opener, busy_word, 1, 0));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(opener));
    ASSERT_CU(gpuipc__cu.cuStreamDestroy(opener));
  }
  ASSERT_OK(s);
  memset(a, 0xee, n);
  gpuipc_xfer_info after = info_of(x);
  ASSERT_UEQ(after.direct_bytes - before.direct_bytes, direct ? n : 0);
  ASSERT_UEQ(after.staged_bytes - before.staged_bytes, direct ? 0 : n);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, d, n));
  fill_random(a, n, seed);
  ASSERT_MEM_EQ(back, a, n);
}

TEST_IMPL(xfer_small_pageable_to_device) {
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer *x = engine(0, 0, 0);
  gpuipc__xfer_driver_pageable_max = GPUIPC__XFER_DRIVER_PAGEABLE_MAX;
  gpuipc__xfer_driver_pageable_out_max = GPUIPC__XFER_DRIVER_PAGEABLE_OUT_MAX;
  CUstream st = new_stream();
  const size_t n = (size_t)1 << 20;
  uint8_t *a = malloc(n), *back = malloc(n);
  ASSERT_NOT_NULL(a);
  ASSERT_NOT_NULL(back);
  CUdeviceptr d = dev_alloc(n), busy_word = dev_alloc(16);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  small_copy(x, st, d, a, back, n, 41, 0, true);     /* idle stream: direct */
  small_copy(x, st, d, a, back, n, 42, busy_word, false); /* busy stream: staged */
  /* Below 256 KiB: staged, the stream idle or not. */
  small_copy(x, st, d, a, back, (size_t)64 << 10, 44, 0, false);
  small_copy(x, st, d, a, back, GPUIPC__XFER_DRIVER_PAGEABLE_MIN - 4096, 45, 0,
             false);
  small_copy(x, st, d, a, back, GPUIPC__XFER_DRIVER_PAGEABLE_MIN, 46, 0, true);

  /* 4 MiB and up: staged even into an idle stream. */
  const size_t big = (size_t)16 << 20;
  uint8_t *b = malloc(big), *bback = malloc(big);
  ASSERT_NOT_NULL(b);
  ASSERT_NOT_NULL(bback);
  CUdeviceptr db = dev_alloc(big);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
  small_copy(x, st, db, b, bback, big, 43, 0, false);
  small_copy(x, st, db, b, bback, GPUIPC__XFER_DRIVER_PAGEABLE_MAX, 47, 0,
             false);
  small_copy(x, st, db, b, bback, GPUIPC__XFER_DRIVER_PAGEABLE_MAX - 4096, 48,
             0, true);
  ASSERT_OK(destroy_checked(x, 1));
  free(a);
  free(b);
  free(back);
  free(bback);
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuMemFree(db));
  ASSERT_CU(gpuipc__cu.cuMemFree(busy_word));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* A pageable destination below 256 KiB out of the device takes the
 * driver's pageable copy (complete when the call returns, after the
 * stream's earlier work, as the engine's own copy out is), the stream idle
 * or not; from 256 KiB it is staged. Either way the bytes are in the
 * destination when the call returns, with no synchronize, and they are
 * the ones the stream's earlier work wrote. */
TEST_IMPL(xfer_small_pageable_to_host) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "2000", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer *x = engine(0, 0, 0);
  gpuipc__xfer_driver_pageable_out_max = GPUIPC__XFER_DRIVER_PAGEABLE_OUT_MAX;
  CUstream st = new_stream();
  const size_t cap = (size_t)1 << 20;
  uint8_t *a = malloc(cap), *back = malloc(cap);
  ASSERT_NOT_NULL(a);
  ASSERT_NOT_NULL(back);
  CUdeviceptr d = dev_alloc(cap);
  static const struct {
    size_t n;
    bool direct;
  } cases[] = {{4096, true},
               {(size_t)64 << 10, true},
               {GPUIPC__XFER_DRIVER_PAGEABLE_OUT_MAX - 4096, true},
               {GPUIPC__XFER_DRIVER_PAGEABLE_OUT_MAX, false},
               {(size_t)1 << 20, false}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t n = cases[i].n;
    fill_random(a, n, 60 + i);
    /* The stream's earlier work writes what the copy must read: an H2D
     * from pinned memory the emulator delays (2 ms). */
    uint8_t *pin = NULL;
    ASSERT_CU(gpuipc__cu.cuMemHostAlloc((void **)&pin, n, 0));
    memcpy(pin, a, n);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoDAsync(d, pin, n, st));
    memset(back, 0, n);
    gpuipc_xfer_info before = info_of(x);
    ASSERT_OK(gpuipc_xfer_to_host(x, back, D(d), n, st, 0));
    gpuipc_xfer_info after = info_of(x);
    if (memcmp(back, a, n) != 0)
      harness_fail(__FILE__, __LINE__,
                   "%zu bytes: the destination did not hold the data when "
                   "gpuipc_xfer_to_host returned (%s path)",
                   n, cases[i].direct ? "driver's" : "staged");
    ASSERT_UEQ(after.direct_bytes - before.direct_bytes, cases[i].direct ? n : 0);
    ASSERT_UEQ(after.staged_bytes - before.staged_bytes, cases[i].direct ? 0 : n);
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));
    ASSERT_CU(gpuipc__cu.cuMemFreeHost(pin));
  }
  ASSERT_OK(destroy_checked(x, 1));
  free(a);
  free(back);
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The staging ring starts small and grows with the chunks it must hold,
 * waiting for the DMAs that still read the old ring before freeing it. */
TEST_IMPL(xfer_staging_grows) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "2000", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer *x = engine(0, 0, 0);
  gpuipc_xfer_info in = info_of(x);
  const size_t ring_slots = (size_t)in.staging_slots;
  CUstream st = new_stream();
  const size_t big = (size_t)8 << 20; /* chunks of 1 MiB */
  uint8_t *a = malloc(big), *b = malloc(big), *back = malloc(big);
  fill_random(a, big, 1);
  fill_random(b, big, 2);
  CUdeviceptr da = dev_alloc(big), db = dev_alloc(big);

  /* The stream is busy (a slow emulated memset) so that the small copies
   * are staged: into an idle stream they would go to the driver. */
  CUdeviceptr busy = dev_alloc(16);
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(busy, 0, 16, st));
  ASSERT_OK(gpuipc_xfer_to_device(x, D(da), a, 1000, st, 0));
  in = info_of(x);
  ASSERT_UEQ(in.staging_bytes, ring_slots * (64 << 10));
  uint64_t bytes = 0;
  ASSERT_UEQ(gpuipc__xfer_pinned_live(&bytes), 1);
  ASSERT_UEQ(bytes, in.staging_bytes);

  /* 3 MiB: chunks of 1 MiB (n/8 is below the 1 MiB floor), the ring grows
   * while the 1000 bytes may still be in flight from the old one. */
  ASSERT_OK(gpuipc_xfer_to_device(x, D(da), a, (size_t)3 << 20, st, 0));
  in = info_of(x);
  ASSERT_UEQ(in.staging_bytes, ring_slots * ((size_t)1 << 20));
  /* Tail of this one in flight while the next grows the ring again (the
   * emulated copies are slow, so they are). */
  ASSERT_OK(gpuipc_xfer_to_device(x, D(db), b, big, st, 0));
  ASSERT_OK(gpuipc_xfer_to_device(x, D(da), a, big, st, 0)); /* same size */
  size_t huge = (size_t)28 << 20; /* chunks of 3.5 MiB: slots of 4 MiB */
  uint8_t *c = malloc(huge);
  fill_random(c, huge, 3);
  CUdeviceptr dc = dev_alloc(huge);
  ASSERT_OK(gpuipc_xfer_to_device(x, D(dc), c, huge, st, 0));
  in = info_of(x);
  ASSERT_UEQ(in.staging_bytes, ring_slots * ((size_t)4 << 20));
  ASSERT_UEQ(gpuipc__xfer_pinned_live(&bytes), 1);
  ASSERT_UEQ(bytes, in.staging_bytes);
  /* A small copy afterwards keeps the large ring. */
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(busy, 0, 16, st));
  ASSERT_OK(gpuipc_xfer_to_device(x, D(db), b, 10, st, 0));
  ASSERT_UEQ(info_of(x).staging_bytes, in.staging_bytes);
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(st));

  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, da, big));
  ASSERT_MEM_EQ(back, a, big);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, db, big));
  ASSERT_MEM_EQ(back, b, big);
  uint8_t *cback = malloc(huge);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(cback, dc, huge));
  ASSERT_MEM_EQ(cback, c, huge);
  free(cback);
  ASSERT_OK(destroy_checked(x, 1));
  free(a);
  free(b);
  free(c);
  free(back);
  ASSERT_CU(gpuipc__cu.cuMemFree(da));
  ASSERT_CU(gpuipc__cu.cuMemFree(db));
  ASSERT_CU(gpuipc__cu.cuMemFree(dc));
  ASSERT_CU(gpuipc__cu.cuMemFree(busy));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Growing the ring fails (injected cuMemHostAlloc failure after the old
 * ring was freed): the error comes back, nothing stays pinned, and the next
 * copy allocates again. */
HELPER_IMPL(xfer_grow_fault) {
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer *x = engine(2, 0, 0);
  const size_t n = (size_t)3 << 20;
  uint8_t *a = malloc(n), *back = malloc(n);
  fill_random(a, n, 9);
  CUdeviceptr d = dev_alloc(n);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(d, a, n));
  /* Copies to pageable memory are always staged (small ones into the
   * device may go to the driver's own pageable copy). */
  ASSERT_OK(gpuipc_xfer_to_host(x, back, D(d), 100, NULL, 0)); /* alloc 1 */
  ASSERT_UEQ(gpuipc__xfer_pinned_live(NULL), 1);
  ASSERT_STATUS(gpuipc_xfer_to_host(x, back, D(d), n, NULL, 0), /* alloc 2 */
                GPUIPC_E_DRIVER);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "cuMemHostAlloc");
  ASSERT_UEQ(gpuipc__xfer_pinned_live(NULL), 0);
  memset(back, 0, n);
  ASSERT_OK(gpuipc_xfer_to_host(x, back, D(d), n, NULL, GPUIPC_XFER_SYNC));
  ASSERT_UEQ(gpuipc__xfer_pinned_live(NULL), 1);
  ASSERT_MEM_EQ(back, a, n);
  ASSERT_OK(destroy_checked(x, 1));
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  free(a);
  free(back);
  gpuipc__ctx_leave(&g);
  return 0;
}

TEST_IMPL(xfer_staging_grow_fault) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FAIL");
  char *env[] = {"GPUIPC_EMU_FAIL=cuMemHostAlloc:2", NULL};
  ASSERT_EQ(wait_helper(spawn_helper("xfer_grow_fault", env, NULL, NULL), 120),
            0);
  return 0;
}
