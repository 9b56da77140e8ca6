/*
 * test-handle-event.c: interprocess events. A producer process's GPU work
 * is held back (its stream waits on a flag word that only the consumer's
 * go-ahead releases), it records an exported event after writing the
 * buffer, and the consumer's copy waits on that event: the copy must see
 * the producer's data, never the poison written before. No timing: the
 * consumer checks that its copy has not completed while the producer is
 * held, and the data after.
 *
 * Every copy issued while a stream is held has device memory at one end:
 * a cuMemcpyAsync from host memory to host memory (pinned or not) is
 * "fully synchronous with respect to the host" (CUDA driver API, "API
 * synchronization behavior"): the call returns only once the copy is
 * done, i.e. after the stream's earlier work, so on a held stream it never
 * returns. With a PINNED_HOST buffer, writing it from pinned memory (or
 * reading it into pinned memory) is such a copy; the tests stage through
 * cuMemAlloc memory instead, which makes the copy a DMA (device to pinned
 * host, pinned host to device, or device to device) for every kind.
 */
#include "test-handle.h"

#include <unistd.h>

#define N_BYTES (1u << 20)
#define POISON 0xDEADu
#define GOOD 0x600Du

enum { EV_GO = 1, EV_RECORDED, EV_WAITING, EV_RELEASED, EV_DONE };

HELPER_IMPL(handle_event_producer) {
  int sock = harness_helper_fd();
  ASSERT_OK(gpuipc_init());
  ASSERT_GE(argc, 1); /* argv[0]: the pool kind */
  gpuipc_pool_kind kind = (gpuipc_pool_kind)atoi(argv[0]);
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = kind;
  gpuipc_pool *pool;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *buf;
  ASSERT_OK(gpuipc_buffer_alloc(pool, N_BYTES, NULL, &buf));
  th_sync(0);
  th_fill(buf, 0, N_BYTES, POISON);
  gpuipc_event *ev;
  ASSERT_OK(gpuipc_event_create(NULL, &ev));
  ASSERT_NOT_NULL(gpuipc_event_get_handle(ev));

  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  ASSERT_OK(gpuipc_event_export(ev, d, sizeof d, &len));
  harness_send(sock, d, len, NULL, 0);
  int fds[1] = {-1}, nfds = 1;
  ASSERT_OK(gpuipc_buffer_export(buf, d, sizeof d, &len, fds, &nfds));
  harness_send(sock, d, len, fds, nfds);
  th_close_fds(fds, nfds);

  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUstream s, s2;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  /* The "held producer" flag word is cuMemAlloc memory whatever the
   * buffer's kind: stream memory operations refuse memory-pool memory on
   * the real driver (CUDA_ERROR_INVALID_VALUE, driver 580). */
  CUdeviceptr flag;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&flag, 4));
  ASSERT_CU(gpuipc__cu.cuMemsetD32(flag, 0, 1));
  /* The producer's data comes from device memory (see the top of the
   * file), filled now, before s is held. */
  uint32_t *good = th_pattern(N_BYTES, GOOD);
  CUdeviceptr src;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&src, N_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(src, good, N_BYTES));
  gpuipc__ctx_leave(&g);
  ASSERT_EQ(harness_recv_u64(sock), EV_GO);

  /* The "slow work": held until the consumer has queued its wait. */
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuStreamWaitValue32(s, flag, 1,
                                           CU_STREAM_WAIT_VALUE_GEQ));
  /* Device to device, or device to pinned host: asynchronous. */
  ASSERT_CU(gpuipc__cu.cuMemcpyAsync(
      (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(buf), src, N_BYTES, s));
  gpuipc__ctx_leave(&g);
  ASSERT_OK(gpuipc_event_record(ev, s));
  ASSERT_STATUS(gpuipc_event_query(ev), GPUIPC_E_WOULD_BLOCK);
  harness_send_u64(sock, EV_RECORDED);
  ASSERT_EQ(harness_recv_u64(sock), EV_WAITING);
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuStreamWriteValue32(s2, flag, 1, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s2));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(s));
  gpuipc__ctx_leave(&g);
  ASSERT_OK(gpuipc_event_synchronize(ev));
  ASSERT_OK(gpuipc_event_query(ev));
  harness_send_u64(sock, EV_RELEASED);
  ASSERT_EQ(harness_recv_u64(sock), EV_DONE);

  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(s2));
  ASSERT_CU(gpuipc__cu.cuMemFree(flag));
  ASSERT_CU(gpuipc__cu.cuMemFree(src));
  gpuipc__ctx_leave(&g);
  free(good);
  ASSERT_OK(gpuipc_event_destroy(ev));
  ASSERT_OK(gpuipc_buffer_free(buf, NULL));
  th_sync(0);
  ASSERT_OK(gpuipc_pool_destroy(pool));
  return 0;
}

static int event_orders(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  char karg[16];
  snprintf(karg, sizeof karg, "%d", (int)kind);
  int sock;
  pid_t pid = spawn_helper("handle_event_producer", NULL, &sock, karg, NULL);
  uint8_t d[GPUIPC_DESC_MAX];
  ssize_t len = harness_recv(sock, d, sizeof d, NULL, NULL);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, (size_t)len, &info));
  ASSERT_EQ(info.type, GPUIPC_DESC_EVENT);
  ASSERT_EQ(info.nfds, 0);
  gpuipc_event *ev;
  ASSERT_OK(gpuipc_event_import(d, (size_t)len, NULL, &ev));
  /* An imported event cannot be re-exported. */
  size_t l2;
  uint8_t d2[GPUIPC_DESC_MAX];
  ASSERT_STATUS(gpuipc_event_export(ev, d2, sizeof d2, &l2),
                GPUIPC_E_NOT_SUPPORTED);
  int fds[1] = {-1}, nfds = 1;
  len = harness_recv(sock, d, sizeof d, fds, &nfds);
  gpuipc_buffer *buf;
  ASSERT_OK(gpuipc_buffer_import(d, (size_t)len, fds, nfds, NULL, &buf));
  th_close_fds(fds, nfds);
  ASSERT(th_check(buf, 0, N_BYTES, POISON));
  harness_send_u64(sock, EV_GO);
  ASSERT_EQ(harness_recv_u64(sock), EV_RECORDED);

  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUstream c;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&c, CU_STREAM_NON_BLOCKING));
  /* The consumer copies into device memory (see the top of the file):
   * device to device, or pinned host to device: asynchronous. */
  CUdeviceptr stage;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&stage, N_BYTES));
  ASSERT_CU(gpuipc__cu.cuMemsetD32(stage, 0, N_BYTES / 4));
  gpuipc__ctx_leave(&g);
  ASSERT_OK(gpuipc_event_wait(ev, c));
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuMemcpyAsync(
      stage, (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(buf), N_BYTES, c));
  /* The producer is held: our copy cannot have run. */
  ASSERT_CU_EQ(gpuipc__cu.cuStreamQuery(c), CUDA_ERROR_NOT_READY);
  gpuipc__ctx_leave(&g);
  ASSERT_STATUS(gpuipc_event_query(ev), GPUIPC_E_WOULD_BLOCK);
  harness_send_u64(sock, EV_WAITING);
  ASSERT_EQ(harness_recv_u64(sock), EV_RELEASED);
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuStreamSynchronize(c));
  uint32_t *host = malloc(N_BYTES);
  ASSERT_NOT_NULL(host);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(host, stage, N_BYTES));
  gpuipc__ctx_leave(&g);
  uint32_t *good = th_pattern(N_BYTES, GOOD);
  ASSERT_MEM_EQ(host, good, N_BYTES); /* never the poison */
  free(good);
  free(host);
  ASSERT_OK(gpuipc_event_synchronize(ev));
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(c));
  ASSERT_CU(gpuipc__cu.cuMemFree(stage));
  gpuipc__ctx_leave(&g);
  ASSERT_OK(gpuipc_buffer_close(buf));
  ASSERT_OK(gpuipc_event_destroy(ev));
  ASSERT_OK(gpuipc_event_destroy(NULL));
  harness_send_u64(sock, EV_DONE);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
  return 0;
}

TEST_IMPL(handle_event_orders_consumer_after_producer_legacy) {
  return event_orders(GPUIPC_POOL_LEGACY);
}
TEST_IMPL(handle_event_orders_consumer_after_producer_mempool) {
  return event_orders(GPUIPC_POOL_MEMPOOL);
}
TEST_IMPL(handle_event_orders_consumer_after_producer_pinned_host) {
  return event_orders(GPUIPC_POOL_PINNED_HOST);
}

/* Context hygiene: gpuipc calls leave the caller's current context as it
 * was (here: none, then the caller's own primary context pushed). */
TEST_IMPL(handle_context_restored) {
  ASSERT_OK(gpuipc_init());
  gpuipc__ctx_guard g;
  CUcontext before = (CUcontext)1, after = (CUcontext)1;
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&before));
  gpuipc_pool *pool;
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_MEMPOOL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *b;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096, NULL, &b));
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int nfds = 0;
  ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, NULL, &nfds));
  gpuipc_event *ev;
  ASSERT_OK(gpuipc_event_create(NULL, &ev));
  ASSERT_OK(gpuipc_event_record(ev, NULL));
  ASSERT_OK(gpuipc_event_synchronize(ev));
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&after));
  ASSERT_PTR_EQ(after, before);
  /* With the caller's own context current, it stays current. */
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUcontext mine = NULL;
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&mine));
  ASSERT_OK(gpuipc_event_destroy(ev));
  ASSERT_OK(gpuipc_buffer_free(b, NULL));
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&after));
  ASSERT_PTR_EQ(after, mine);
  gpuipc__ctx_leave(&g);
  th_sync(0);
  ASSERT_OK(gpuipc_pool_destroy(pool));
  ASSERT_CU(gpuipc__cu.cuCtxGetCurrent(&after));
  ASSERT_PTR_EQ(after, before);
  return 0;
}
