/*
 * test-xfer-shared.c: pinned host memory shared between processes
 * (gpuipc_xfer_shared): the host side of the sequence-word protocol, the
 * validation of a received segment, and the two-process cases: a filler
 * process writes messages that a GPU process's stream copies to the device
 * as they are published (its stream waits on the segment's words, the
 * filler waits for "consumed" before reusing a slot), and the reverse, a
 * GPU stream filling the segment for a host reader in another process.
 * Destinations and slots are poisoned first, so a copy that runs before its
 * message is published, or a slot refilled before it was copied, shows.
 */
#include "harness.h"

#include "tree.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MSGS 9
#define SLOTS 2
#define SLOT_BYTES ((size_t)64 << 10)

static size_t msg_len(uint64_t seq) { return 1000 + (size_t)seq * 6007; }
static uint8_t msg_byte(uint64_t seq, size_t i) {
  return (uint8_t)(seq * 37 + i * 13 + (i >> 8) + 1);
}

static void enter0(gpuipc__ctx_guard *g) {
  ASSERT_OK(gpuipc__driver());
  ASSERT_OK(gpuipc__ctx_enter(g, 0));
}

static CUresult stream_done(CUstream s, int timeout_s) {
  time_t deadline = time(NULL) + timeout_s;
  for (;;) {
    CUresult r = gpuipc__cu.cuStreamQuery(s);
    if (r != CUDA_ERROR_NOT_READY || time(NULL) > deadline)
      return r;
    usleep(500);
  }
}

/* ---- one process: the host protocol and validation ----------------------- */

TEST_IMPL(xfer_shared_host_protocol) {
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_STATUS(gpuipc_xfer_shared_create(100, 0, &sh), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_xfer_shared_create(0, 1, &sh), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(
      gpuipc_xfer_shared_create(100, GPUIPC_XFER_SHARED_MAX_SLOTS + 1, &sh),
      GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_xfer_shared_close(NULL));
  ASSERT_OK(gpuipc_xfer_shared_create(100, 1, &sh));
  ASSERT_EQ(gpuipc_xfer_shared_get_slots(sh), 1);
  size_t cap = gpuipc_xfer_shared_get_slot_bytes(sh);
  ASSERT_GE(cap, 100);
  ASSERT_EQ(cap % (size_t)sysconf(_SC_PAGESIZE), 0);

  /* A second view of the same segment, as another process would have. */
  gpuipc_xfer_shared *peer = NULL;
  ASSERT_OK(gpuipc_xfer_shared_open(gpuipc_xfer_shared_get_fd(sh), &peer));
  ASSERT_EQ(gpuipc_xfer_shared_get_slots(peer), 1);
  ASSERT_UEQ(gpuipc_xfer_shared_get_slot_bytes(peer), cap);

  void *p = NULL;
  size_t c = 0;
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, 0, 0, &p, &c));
  ASSERT_UEQ(c, cap);
  memset(p, 0x5A, 50);
  size_t len = 0;
  ASSERT_STATUS(gpuipc_xfer_shared_wait_filled(peer, 0, 0, &len),
                GPUIPC_E_TIMEOUT);
  ASSERT_STATUS(gpuipc_xfer_shared_publish(sh, 0, cap + 1),
                GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_xfer_shared_publish(sh, 0, 50));
  ASSERT_OK(gpuipc_xfer_shared_wait_filled(peer, 0, 0, &len));
  ASSERT_UEQ(len, 50);
  ASSERT_EQ(((uint8_t *)gpuipc_xfer_shared_get_slot(peer, 0))[49], 0x5A);
  /* One slot: message 1 needs message 0 consumed. */
  ASSERT_STATUS(gpuipc_xfer_shared_acquire(sh, 1, 0, &p, &c), GPUIPC_E_TIMEOUT);
  ASSERT_STATUS(gpuipc_xfer_shared_acquire(sh, 1, 30, &p, &c),
                GPUIPC_E_TIMEOUT);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "message 1");
  ASSERT_STATUS(gpuipc_xfer_shared_wait_filled(peer, 1, 0, &len),
                GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_xfer_shared_release(peer, 0));
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, 1, 0, &p, &c));
  ASSERT_OK(gpuipc_xfer_shared_publish(sh, 1, cap));
  ASSERT_OK(gpuipc_xfer_shared_wait_filled(peer, 1, 0, &len));
  ASSERT_UEQ(len, cap);

  /* The _device functions need the segment pinned in this process. */
  ASSERT_STATUS(gpuipc_xfer_shared_to_device(peer, 2, (void *)16, 1, NULL, 0),
                GPUIPC_E_INVALID_ARG);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "pin");
  ASSERT_OK(gpuipc_xfer_shared_close(peer));
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  return 0;
}

/* Sequence words compare cyclically, as cuStreamWaitValue32's GEQ does:
 * message numbers far beyond 2^32 generations keep working. */
TEST_IMPL(xfer_shared_wraparound) {
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(4096, 1, &sh));
  void *p;
  size_t c, len;
  uint64_t base = ((uint64_t)1 << 32) - 2; /* generations around 2^32 */
  /* Bring the words to generation base (message base-1) first. */
  ASSERT_OK(gpuipc_xfer_shared_publish(sh, base - 1, 1));
  ASSERT_OK(gpuipc_xfer_shared_release(sh, base - 1));
  for (uint64_t seq = base; seq < base + 5; seq++) {
    ASSERT_OK(gpuipc_xfer_shared_acquire(sh, seq, 0, &p, &c));
    ASSERT_STATUS(gpuipc_xfer_shared_wait_filled(sh, seq, 0, &len),
                  GPUIPC_E_TIMEOUT);
    ASSERT_OK(gpuipc_xfer_shared_publish(sh, seq, 7));
    ASSERT_STATUS(gpuipc_xfer_shared_acquire(sh, seq + 1, 0, &p, &c),
                  GPUIPC_E_TIMEOUT);
    ASSERT_OK(gpuipc_xfer_shared_wait_filled(sh, seq, 0, &len));
    ASSERT_OK(gpuipc_xfer_shared_release(sh, seq));
  }
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  return 0;
}

/* Only a sealed segment with a consistent header opens. */
TEST_IMPL(xfer_shared_open_rejects) {
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_STATUS(gpuipc_xfer_shared_open(-1, &sh), GPUIPC_E_INVALID_ARG);
  /* Not sealed. */
  int fd = memfd_create("not-a-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 16), 0);
  ASSERT_STATUS(gpuipc_xfer_shared_open(fd, &sh), GPUIPC_E_BAD_KIND);
  /* Sealed but all zero: bad magic. */
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  ASSERT_STATUS(gpuipc_xfer_shared_open(fd, &sh), GPUIPC_E_BAD_MAGIC);
  close(fd);

  /* A copy of a real header with one field changed at a time. */
  gpuipc_xfer_shared *good = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(8192, 3, &good));
  int gfd = gpuipc_xfer_shared_get_fd(good);
  struct stat st;
  ASSERT_EQ(fstat(gfd, &st), 0);
  uint8_t hdr[64];
  ASSERT_EQ(pread(gfd, hdr, sizeof hdr, 0), (ssize_t)sizeof hdr);
  struct {
    size_t at;
    uint32_t value;
    gpuipc_status want;
  } cases[] = {
      {4, 2, GPUIPC_E_BAD_VERSION},      /* version */
      {12, 0, GPUIPC_E_OUT_OF_RANGE},    /* nslots */
      {12, 4, GPUIPC_E_OUT_OF_RANGE},    /* nslots disagrees with the size */
      {12, 5000, GPUIPC_E_OUT_OF_RANGE}, /* too many */
      {16, 100, GPUIPC_E_OUT_OF_RANGE},  /* slot_bytes not a page multiple */
      {32, 1, GPUIPC_E_OUT_OF_RANGE},    /* total_bytes */
  };
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(cases); i++) {
    int f = memfd_create("bad-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(f, 0);
    ASSERT_EQ(ftruncate(f, st.st_size), 0);
    uint8_t h[64];
    memcpy(h, hdr, sizeof h);
    memcpy(h + cases[i].at, &cases[i].value, 4);
    ASSERT_EQ(pwrite(f, h, sizeof h, 0), (ssize_t)sizeof h);
    ASSERT_EQ(fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    gpuipc_status s = gpuipc_xfer_shared_open(f, &sh);
    if (s != cases[i].want)
      harness_fail(__FILE__, __LINE__, "case %zu: %s, want %s (%s)", i,
                   gpuipc_status_name(s), gpuipc_status_name(cases[i].want),
                   gpuipc_last_error());
    ASSERT_NULL(sh);
    close(f);
  }
  /* Truncated (smaller than a page). */
  int f = memfd_create("short-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(f, 64), 0);
  ASSERT_EQ(pwrite(f, hdr, sizeof hdr, 0), (ssize_t)sizeof hdr);
  ASSERT_EQ(fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  ASSERT_STATUS(gpuipc_xfer_shared_open(f, &sh), GPUIPC_E_TRUNCATED);
  close(f);
  ASSERT_OK(gpuipc_xfer_shared_close(good));
  return 0;
}

/* ---- two processes ------------------------------------------------------- */

/* The filler: needs no GPU. Opens the segment from the fd it receives and
 * writes MSGS messages, each only after its slot was consumed. */
HELPER_IMPL(xfer_shared_filler) {
  int sock = harness_helper_fd();
  int fd = -1, nfd = 1;
  uint8_t msg[GPUIPC_DESC_MAX];
  ssize_t mlen = harness_recv(sock, msg, sizeof msg, &fd, &nfd);
  ASSERT_GE(mlen, 0);
  ASSERT_EQ(nfd, 1);
  gpuipc_xfer_shared *sh = NULL;
  gpuipc_buffer *buf = NULL;
  if (argc > 0 && strcmp(argv[0], "buffer") == 0) {
    /* A pinned-host buffer of the handle layer: import, then attach. */
    ASSERT_OK(gpuipc_buffer_import(msg, (size_t)mlen, &fd, 1, NULL, &buf));
    ASSERT_OK(gpuipc_xfer_shared_attach(buf, &sh));
    ASSERT_EQ(gpuipc_xfer_shared_get_fd(sh), -1);
  } else {
    ASSERT_OK(gpuipc_xfer_shared_open(fd, &sh));
  }
  close(fd);
  for (uint64_t seq = 0; seq < MSGS; seq++) {
    void *p = NULL;
    size_t cap = 0;
    ASSERT_OK(gpuipc_xfer_shared_acquire(sh, seq, 60000, &p, &cap));
    ASSERT_LE(msg_len(seq), cap);
    uint8_t *b = p;
    for (size_t i = 0; i < msg_len(seq); i++)
      b[i] = msg_byte(seq, i);
    /* Give a copier that does not wait a chance to copy too early. */
    usleep(2000);
    ASSERT_OK(gpuipc_xfer_shared_publish(sh, seq, msg_len(seq)));
  }
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  ASSERT_OK(gpuipc_buffer_close(buf));
  harness_send_u64(sock, 1);
  return 0;
}

/* The copier's half of the two-process test: everything enqueued before the
 * filler starts, then the check of every destination. over_buffer: the
 * segment lies over a pinned-host buffer of the handle layer. */
static void copier_run(gpuipc_xfer_shared *sh, const uint8_t *desc, size_t dlen,
                       int fd, const char *mode) {
  for (uint64_t s = 0; s < SLOTS; s++)
    memset(gpuipc_xfer_shared_get_slot(sh, s), 0xEE, SLOT_BYTES);
  CUstream st = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr dst[MSGS];
  for (int m = 0; m < MSGS; m++) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&dst[m], SLOT_BYTES));
    /* On st: a synchronous memset may still be running on the legacy
     * stream (real GPUs), which the non-blocking st does not wait for. */
    ASSERT_CU(gpuipc__cu.cuMemsetD8Async(dst[m], 0xCC, SLOT_BYTES, st));
  }
  /* The stream waits on the segment's words, the host does not. */
  for (uint64_t seq = 0; seq < MSGS; seq++)
    ASSERT_OK(gpuipc_xfer_shared_to_device(sh, seq, (void *)(uintptr_t)dst[seq],
                                           msg_len(seq), st, 0));
  ASSERT_CU_EQ(gpuipc__cu.cuStreamQuery(st), CUDA_ERROR_NOT_READY);

  int sock = -1;
  pid_t pid = spawn_helper("xfer_shared_filler", NULL, &sock, mode, NULL);
  harness_send(sock, desc, dlen, &fd, 1);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  close(sock);
  ASSERT_CU(stream_done(st, 120));

  uint8_t *h = malloc(SLOT_BYTES);
  for (uint64_t seq = 0; seq < MSGS; seq++) {
    ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, dst[seq], SLOT_BYTES));
    for (size_t i = 0; i < msg_len(seq); i++)
      if (h[i] != msg_byte(seq, i))
        harness_fail(
            __FILE__, __LINE__, "message %llu byte %zu: 0x%02x, want 0x%02x%s",
            (unsigned long long)seq, i, h[i], msg_byte(seq, i),
            h[i] == 0xEE ? " (the slot's poison: copied too early)" : "");
    for (size_t i = msg_len(seq); i < SLOT_BYTES; i++)
      ASSERT_EQ(h[i], 0xCC);
    ASSERT_CU(gpuipc__cu.cuMemFree(dst[seq]));
  }
  free(h);
  /* The GPU marked every message consumed: the next ones' slots are free. */
  void *p;
  size_t c;
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, MSGS, 0, &p, &c));
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, MSGS + 1, 0, &p, &c));
  ASSERT_STATUS(gpuipc_xfer_shared_acquire(sh, MSGS + SLOTS, 0, &p, &c),
                GPUIPC_E_TIMEOUT);
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
}

/* The same over the handle layer's pinned-host pool: the buffer travels as
 * a buffer descriptor and is pinned by the handle layer on both sides. */
TEST_IMPL(xfer_shared_over_pinned_host_pool) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "500", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_PINNED_HOST;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  gpuipc_buffer *buf = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, 4096 + SLOTS * SLOT_BYTES, NULL, &buf));
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_STATUS(gpuipc_xfer_shared_format(buf, SLOT_BYTES, SLOTS + 1, &sh),
                GPUIPC_E_OUT_OF_RANGE);
  ASSERT_STATUS(gpuipc_xfer_shared_attach(buf, &sh), GPUIPC_E_BAD_MAGIC);
  ASSERT_OK(gpuipc_xfer_shared_format(buf, SLOT_BYTES, SLOTS, &sh));
  ASSERT_UEQ(gpuipc_xfer_shared_get_slot_bytes(sh), SLOT_BYTES);
  ASSERT_OK(gpuipc_xfer_shared_pin(sh, NULL)); /* pinned already: nothing */
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t dlen = 0;
  int fds[GPUIPC_DESC_MAX_FDS];
  int nfds = GPUIPC_DESC_MAX_FDS;
  ASSERT_OK(gpuipc_buffer_export(buf, desc, sizeof desc, &dlen, fds, &nfds));
  ASSERT_EQ(nfds, 1);
  copier_run(sh, desc, dlen, fds[0], "buffer");
  close(fds[0]);
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  ASSERT_OK(gpuipc_buffer_free(buf, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));

  /* Device memory is refused. */
  po.kind = GPUIPC_POOL_LEGACY;
  ASSERT_OK(gpuipc_pool_create(&po, &pool));
  ASSERT_OK(gpuipc_buffer_alloc(pool, 1 << 16, NULL, &buf));
  ASSERT_STATUS(gpuipc_xfer_shared_format(buf, 0, 1, &sh), GPUIPC_E_BAD_KIND);
  ASSERT_OK(gpuipc_buffer_free(buf, NULL));
  ASSERT_OK(gpuipc_pool_destroy(pool));
  gpuipc__ctx_leave(&g);
  return 0;
}

TEST_IMPL(xfer_shared_filler_to_gpu) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "500", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(SLOT_BYTES, SLOTS, &sh));
  gpuipc_uuid nowhere, u0;
  memset(&nowhere, 0xEE, sizeof nowhere);
  ASSERT_STATUS(gpuipc_xfer_shared_pin(sh, &nowhere),
                GPUIPC_E_DEVICE_NOT_VISIBLE);
  ASSERT_OK(gpuipc_xfer_shared_pin(sh, NULL));
  ASSERT_OK(gpuipc_device_uuid(0, &u0));
  ASSERT_OK(gpuipc_xfer_shared_pin(sh, &u0)); /* idempotent: device 0 */
  copier_run(sh, (const uint8_t *)"go", 2, gpuipc_xfer_shared_get_fd(sh), "fd");
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* The reader: takes MSGS messages off the segment on the host, checking
 * each, and releases each slot after reading it. */
HELPER_IMPL(xfer_shared_reader) {
  int sock = harness_helper_fd();
  int fd = -1, nfd = 1;
  char go[8];
  ASSERT_GE(harness_recv(sock, go, sizeof go, &fd, &nfd), 0);
  ASSERT_EQ(nfd, 1);
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_OK(gpuipc_xfer_shared_open(fd, &sh));
  close(fd);
  for (uint64_t seq = 0; seq < MSGS; seq++) {
    size_t len = 0;
    ASSERT_OK(gpuipc_xfer_shared_wait_filled(sh, seq, 60000, &len));
    ASSERT_UEQ(len, msg_len(seq));
    const uint8_t *b = gpuipc_xfer_shared_get_slot(sh, seq);
    for (size_t i = 0; i < len; i++)
      if (b[i] != msg_byte(seq, i))
        harness_fail(__FILE__, __LINE__,
                     "message %llu byte %zu: 0x%02x, want 0x%02x",
                     (unsigned long long)seq, i, b[i], msg_byte(seq, i));
    /* Poison what was read: a GPU that refilled the slot before this
     * release would have its data overwritten, and the check of that
     * message would fail. */
    memset((void *)b, 0xEE, len);
    ASSERT_OK(gpuipc_xfer_shared_release(sh, seq));
  }
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  harness_send_u64(sock, 1);
  return 0;
}

TEST_IMPL(xfer_shared_gpu_to_reader) {
  setenv("GPUIPC_EMU_COPY_DELAY_US", "500", 1);
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(SLOT_BYTES, SLOTS, &sh));
  ASSERT_OK(gpuipc_xfer_shared_pin(sh, NULL));
  CUstream st = NULL;
  ASSERT_CU(gpuipc__cu.cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr src[MSGS];
  uint8_t *h = malloc(SLOT_BYTES);
  for (uint64_t m = 0; m < MSGS; m++) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&src[m], SLOT_BYTES));
    for (size_t i = 0; i < msg_len(m); i++)
      h[i] = msg_byte(m, i);
    ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(src[m], h, msg_len(m)));
  }
  free(h);
  for (uint64_t seq = 0; seq < MSGS; seq++)
    ASSERT_OK(gpuipc_xfer_shared_from_device(
        sh, seq, (void *)(uintptr_t)src[seq], msg_len(seq), st, 0));

  int sock = -1;
  pid_t pid = spawn_helper("xfer_shared_reader", NULL, &sock, NULL);
  int fd = gpuipc_xfer_shared_get_fd(sh);
  harness_send(sock, "go", 2, &fd, 1);
  ASSERT_UEQ(harness_recv_u64(sock), 1);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  close(sock);
  ASSERT_CU(stream_done(st, 120));
  for (uint64_t m = 0; m < MSGS; m++)
    ASSERT_CU(gpuipc__cu.cuMemFree(src[m]));
  ASSERT_CU(gpuipc__cu.cuStreamDestroy(st));
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* GPUIPC_XFER_SYNC on the device side: the message is on the device when
 * the call returns; and a published message copies at once. */
TEST_IMPL(xfer_shared_sync) {
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(4096, 1, &sh));
  ASSERT_OK(gpuipc_xfer_shared_pin(sh, NULL));
  void *p;
  size_t c;
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, 0, 0, &p, &c));
  memset(p, 0x42, 100);
  ASSERT_OK(gpuipc_xfer_shared_publish(sh, 0, 100));
  CUdeviceptr d;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, 4096));
  ASSERT_OK(gpuipc_xfer_shared_to_device(sh, 0, (void *)(uintptr_t)d, 100, NULL,
                                         GPUIPC_XFER_SYNC));
  uint8_t h[100];
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, d, 100));
  for (int i = 0; i < 100; i++)
    ASSERT_EQ(h[i], 0x42);
  /* Consumed by the GPU: the slot is free again. */
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, 1, 0, &p, &c));
  ASSERT_STATUS(
      gpuipc_xfer_shared_to_device(sh, 1, (void *)(uintptr_t)d, c + 1, NULL, 0),
      GPUIPC_E_INVALID_ARG);
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  gpuipc__ctx_leave(&g);
  return 0;
}

/* Injected driver failures on the copier's side come back as statuses that
 * name the call, and leave the segment usable. */
HELPER_IMPL(xfer_shared_fault) {
  gpuipc__ctx_guard g;
  enter0(&g);
  gpuipc_xfer_shared *sh = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(4096, 1, &sh));
  ASSERT_STATUS(gpuipc_xfer_shared_pin(sh, NULL), GPUIPC_E_DRIVER);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "cuMemHostRegister");
  ASSERT_OK(gpuipc_xfer_shared_pin(sh, NULL));
  void *p;
  size_t c;
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, 0, 0, &p, &c));
  memset(p, 0x61, 64);
  ASSERT_OK(gpuipc_xfer_shared_publish(sh, 0, 64));
  CUdeviceptr d;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&d, 4096));
  ASSERT_STATUS(gpuipc_xfer_shared_to_device(sh, 0, (void *)(uintptr_t)d, 64,
                                             NULL, GPUIPC_XFER_SYNC),
                GPUIPC_E_DRIVER);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "cuStreamWriteValue32");
  /* Not marked consumed: the slot is not free. */
  ASSERT_STATUS(gpuipc_xfer_shared_acquire(sh, 1, 0, &p, &c), GPUIPC_E_TIMEOUT);
  ASSERT_OK(gpuipc_xfer_shared_to_device(sh, 0, (void *)(uintptr_t)d, 64, NULL,
                                         GPUIPC_XFER_SYNC));
  ASSERT_OK(gpuipc_xfer_shared_acquire(sh, 1, 0, &p, &c));
  uint8_t h[64];
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, d, 64));
  ASSERT_EQ(h[63], 0x61);
  ASSERT_CU(gpuipc__cu.cuMemFree(d));
  ASSERT_OK(gpuipc_xfer_shared_close(sh));
  gpuipc__ctx_leave(&g);
  return 0;
}

TEST_IMPL(xfer_shared_faults) {
  REQUIRE_EMULATOR("GPUIPC_EMU_FAIL");
  char *env[] = {"GPUIPC_EMU_FAIL=cuMemHostRegister:1,cuStreamWriteValue32:1",
                 NULL};
  pid_t pid = spawn_helper("xfer_shared_fault", env, NULL, NULL);
  ASSERT_EQ(wait_helper(pid, 120), 0);
  return 0;
}

/* The header is hostile input: random corruptions of a real header either
 * open (with a geometry inside the file) or fail with a status, never crash.
 * (A cheap stand-in for a fuzzer of this one decoder.) */
TEST_IMPL(xfer_shared_open_corrupt) {
  gpuipc_xfer_shared *good = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(8192, 3, &good));
  int gfd = gpuipc_xfer_shared_get_fd(good);
  struct stat st;
  ASSERT_EQ(fstat(gfd, &st), 0);
  uint8_t hdr[64];
  ASSERT_EQ(pread(gfd, hdr, sizeof hdr, 0), (ssize_t)sizeof hdr);
  int f = memfd_create("fuzz-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(f, 0);
  ASSERT_EQ(ftruncate(f, st.st_size), 0);
  ASSERT_EQ(fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  /* The decoder itself, on short input (what a fuzzer would feed it). */
  ASSERT_STATUS(gpuipc__xfer_shared_check_header(hdr, 39, 0, "test"),
                GPUIPC_E_TRUNCATED);
  ASSERT_STATUS(gpuipc__xfer_shared_check_header(hdr, sizeof hdr, 0, "test"),
                GPUIPC_E_OUT_OF_RANGE); /* declares more than 64 bytes */
  uint64_t rs = 0x9e3779b97f4a7c15ull;
  int opened = 0;
  for (int it = 0; it < 3000; it++) {
    uint8_t h[64];
    memcpy(h, hdr, sizeof h);
    int flips = 1 + (int)(rs % 3);
    for (int k = 0; k < flips; k++) {
      rs ^= rs << 13;
      rs ^= rs >> 7;
      rs ^= rs << 17;
      h[rs % 40] ^= (uint8_t)(1u << ((rs >> 8) % 8));
    }
    ASSERT_EQ(pwrite(f, h, sizeof h, 0), (ssize_t)sizeof h);
    gpuipc_xfer_shared *sh = NULL;
    gpuipc_status s = gpuipc_xfer_shared_open(f, &sh);
    if (s == GPUIPC_OK) {
      opened++;
      size_t end =
          (size_t)((char *)gpuipc_xfer_shared_get_slot(
                       sh, (uint64_t)gpuipc_xfer_shared_get_slots(sh) - 1) -
                   (char *)gpuipc_xfer_shared_get_slot(sh, 0)) +
          gpuipc_xfer_shared_get_slot_bytes(sh);
      ASSERT_LE(end, (size_t)st.st_size);
      ASSERT_OK(gpuipc_xfer_shared_close(sh));
    } else {
      ASSERT_NULL(sh);
      ASSERT(s == GPUIPC_E_BAD_MAGIC || s == GPUIPC_E_BAD_VERSION ||
             s == GPUIPC_E_OUT_OF_RANGE);
    }
  }
  close(f);
  ASSERT_OK(gpuipc_xfer_shared_close(good));
  return 0;
}

/* The peer keeps its own writable mapping of the segment, so the header can
 * change between the check and its use: what the segment is opened with
 * must be what was checked. A thread stands in for the hostile peer,
 * flipping the slot count and size between valid values and values that
 * would put slots outside the file (or divide by zero) while the segment is
 * opened and attached again and again. */
struct header_flipper {
  volatile uint32_t *nslots;
  volatile uint64_t *slot_bytes;
  _Atomic int stop;
};

static void *flip_header(void *arg) {
  struct header_flipper *f = arg;
  uint32_t good_n = *f->nslots;
  uint64_t good_b = *f->slot_bytes;
  for (unsigned k = 0; !atomic_load(&f->stop); k++) {
    *f->nslots = (k & 1) ? 0 : good_n;
    *f->slot_bytes = (k & 2) ? (uint64_t)1 << 40 : good_b;
  }
  *f->nslots = good_n;
  *f->slot_bytes = good_b;
  return NULL;
}

TEST_IMPL(xfer_shared_header_changed_after_check) {
  gpuipc_xfer_shared *good = NULL;
  ASSERT_OK(gpuipc_xfer_shared_create(8192, 3, &good));
  int fd = gpuipc_xfer_shared_get_fd(good);
  size_t slot_bytes = gpuipc_xfer_shared_get_slot_bytes(good);
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  uint8_t *peer = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                       MAP_SHARED, fd, 0);
  ASSERT(peer != MAP_FAILED);
  struct header_flipper f = {(volatile uint32_t *)(peer + 12),
                             (volatile uint64_t *)(peer + 16), 0};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, flip_header, &f), 0);
  long opened = 0, refused = 0, bad = 0;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long it = 0; it < 400000; it++) {
    gpuipc_xfer_shared *sh = NULL;
    gpuipc_status s = gpuipc_xfer_shared_open(fd, &sh);
    if (s == GPUIPC_OK) {
      opened++;
      if (gpuipc_xfer_shared_get_slots(sh) != 3 ||
          gpuipc_xfer_shared_get_slot_bytes(sh) != slot_bytes)
        bad++;
      ASSERT_OK(gpuipc_xfer_shared_close(sh));
    } else {
      ASSERT_NULL(sh);
      ASSERT_STATUS(s, GPUIPC_E_OUT_OF_RANGE);
      refused++;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (t1.tv_sec - t0.tv_sec >= 4 && opened > 100 && refused > 100)
      break;
  }
  atomic_store(&f.stop, 1);
  ASSERT_EQ(pthread_join(t, NULL), 0);
  printf("# %ld opened, %ld refused, %ld opened with a geometry that was "
         "never checked\n", opened, refused, bad);
  ASSERT_EQ(bad, 0);
  ASSERT_GT(opened, 0);
  munmap(peer, (size_t)st.st_size);
  ASSERT_OK(gpuipc_xfer_shared_close(good));
  return 0;
}
