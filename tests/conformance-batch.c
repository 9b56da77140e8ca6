/*
 * conformance-batch.c: conformance checks for the driver's batched copy,
 * cuMemcpyBatchAsync in its CUDA 13.0 form (no failIdx), written against
 * the driver API directly: the copies of one call all arrive, after the
 * stream's earlier work (the source read in stream order), and the call
 * refuses the legacy NULL stream, an empty batch and attribute indices that
 * do not start at 0. The tensor sets' whole-set copies rely on each of
 * these (src/sets/copy.c). Every check must pass on the real driver and on
 * the emulator.
 */
#include "harness.h"

#include "tree.h"

#include <string.h>

/* The driver's version when it has the call, else 0. */
static int batch_driver(int *v) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_CU(gpuipc__cu.cuDriverGetVersion(v));
  return *v >= 13000 && gpuipc__cu.cuMemcpyBatchAsync != NULL;
}
#define NEED_BATCH()                                                           \
  do {                                                                         \
    int need_v = 0;                                                            \
    if (!batch_driver(&need_v))                                                \
      SKIP("the driver (version %d) has no cuMemcpyBatchAsync of CUDA 13.0",   \
           need_v);                                                            \
  } while (0)

static CUmemcpyAttributes stream_order(void) {
  CUmemcpyAttributes a;
  memset(&a, 0, sizeof a);
  a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  a.srcLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.srcLocHint.id = 0;
  a.dstLocHint = a.srcLocHint;
  return a;
}

enum { N = 64, LEN = 4096 };

/* N copies of LEN bytes from every other slot of one allocation into the
 * reversed slots of another, after a memset on the same stream that the
 * copies must see. */
TEST_IMPL(conformance_batch_copy_arrives_in_stream_order) {
  REQUIRE_DEVICES(1);
  NEED_BATCH();
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr src, dst;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&src, 2 * N * LEN));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&dst, N * LEN));
  static uint8_t host[2 * N * LEN], back[N * LEN];
  for (size_t k = 0; k < sizeof host; k++)
    host[k] = (uint8_t)(k * 13 + (k >> 12));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(src, host, sizeof host));
  ASSERT_CU(gpuipc__cu.cuMemsetD8(dst, 0, N * LEN));
  /* The first slot is overwritten on the stream before the batch. */
  ASSERT_CU(gpuipc__cu.cuMemsetD8Async(src, 0x5A, LEN, s));
  memset(host, 0x5A, LEN);
  CUdeviceptr dsts[N], srcs[N];
  size_t sizes[N];
  for (int i = 0; i < N; i++) {
    srcs[i] = src + (CUdeviceptr)(2 * i) * LEN;
    dsts[i] = dst + (CUdeviceptr)(N - 1 - i) * LEN;
    sizes[i] = LEN;
  }
  CUmemcpyAttributes a = stream_order();
  size_t idx = 0;
  ASSERT_CU(gpuipc__cu.cuMemcpyBatchAsync(dsts, srcs, sizes, N, &a, &idx, 1, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(back, dst, sizeof back));
  for (int i = 0; i < N; i++)
    ASSERT_MEM_EQ(back + (size_t)(N - 1 - i) * LEN, host + (size_t)(2 * i) * LEN,
                  LEN);
  ASSERT_CU(gpuipc__cu.cuMemFree(src));
  ASSERT_CU(gpuipc__cu.cuMemFree(dst));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* What the call refuses (the answers are printed: they are what
 * docs/driver-behaviour.md records). */
TEST_IMPL(conformance_batch_copy_refusals) {
  REQUIRE_DEVICES(1);
  NEED_BATCH();
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUstream s;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr a, b;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&a, 2 * LEN));
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&b, 2 * LEN));
  CUdeviceptr dsts[2] = {b, b + LEN}, srcs[2] = {a, a + LEN};
  size_t sizes[2] = {LEN, LEN};
  CUmemcpyAttributes at = stream_order();
  size_t idx = 0, bad_idx = 1;
  CUresult r;
  r = gpuipc__cu.cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &at, &idx, 1, NULL);
  printf("legacy NULL stream: %d\n", (int)r);
  ASSERT_CU_EQ(r, CUDA_ERROR_INVALID_VALUE);
  r = gpuipc__cu.cuMemcpyBatchAsync(dsts, srcs, sizes, 0, &at, &idx, 1, s);
  printf("no copies: %d\n", (int)r);
  ASSERT_CU_EQ(r, CUDA_ERROR_INVALID_VALUE);
  r = gpuipc__cu.cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &at, &bad_idx, 1, s);
  printf("attribute indices from 1: %d\n", (int)r);
  ASSERT_CU_EQ(r, CUDA_ERROR_INVALID_VALUE);
  CUmemcpyAttributes none;
  memset(&none, 0, sizeof none); /* CU_MEMCPY_SRC_ACCESS_ORDER_INVALID */
  r = gpuipc__cu.cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &none, &idx, 1, s);
  printf("no source access order: %d\n", (int)r);
  ASSERT_CU_EQ(r, CUDA_ERROR_INVALID_VALUE);
  /* The stream still works after the refusals. */
  ASSERT_CU(gpuipc__cu.cuMemcpyBatchAsync(dsts, srcs, sizes, 2, &at, &idx, 1, s));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  ASSERT_CU(gpuipc__cu.cuMemFree(a));
  ASSERT_CU(gpuipc__cu.cuMemFree(b));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  gpuipc__ctx_leave(&g);
  return 0;
}
