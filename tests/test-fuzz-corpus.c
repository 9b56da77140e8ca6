/*
 * test-fuzz-corpus.c: replays the seed corpora of the connection and xfer
 * fuzz targets (tests/fuzz/corpus/{frames,handshake,ring,ring-records,
 * xfer-header}) and of the tensor-set consumer's (sets-consumer) through
 * the targets' own harnesses, compiled in here under other names, as
 * ordinary tests: every input must run through without a crash, a hang, a
 * leaked descriptor (the harness aborts on one) or, under ASan, leaked
 * memory. The descriptor corpus is replayed by test-handle-fuzz-corpus.c.
 */
#include "harness.h"

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>

int fuzz_frames_init(int *argc, char ***argv);
int fuzz_frames_one(const uint8_t *data, size_t size);
int fuzz_handshake_init(int *argc, char ***argv);
int fuzz_handshake_one(const uint8_t *data, size_t size);
int fuzz_ring_init(int *argc, char ***argv);
int fuzz_ring_one(const uint8_t *data, size_t size);
int fuzz_xfer_header_one(const uint8_t *data, size_t size);
int fuzz_ring_records_one(const uint8_t *data, size_t size);
int fuzz_sets_consumer_init(int *argc, char ***argv);
int fuzz_sets_consumer_one(const uint8_t *data, size_t size);

#define LLVMFuzzerInitialize fuzz_frames_init
#define LLVMFuzzerTestOneInput fuzz_frames_one
#include "fuzz/fuzz_frames.c"
#undef LLVMFuzzerInitialize
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerInitialize fuzz_handshake_init
#define LLVMFuzzerTestOneInput fuzz_handshake_one
#include "fuzz/fuzz_handshake.c"
#undef LLVMFuzzerInitialize
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerInitialize fuzz_ring_init
#define LLVMFuzzerTestOneInput fuzz_ring_one
#include "fuzz/fuzz_ring.c"
#undef LLVMFuzzerInitialize
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_xfer_header_one
#include "fuzz/fuzz_xfer_header.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerTestOneInput fuzz_ring_records_one
#include "fuzz/fuzz_ring_records.c"
#undef LLVMFuzzerTestOneInput
#define LLVMFuzzerInitialize fuzz_sets_consumer_init
#define LLVMFuzzerTestOneInput fuzz_sets_consumer_one
#include "fuzz/fuzz_sets_consumer.c"
#undef LLVMFuzzerInitialize
#undef LLVMFuzzerTestOneInput

/* Runs every file of corpus/<name> through one; returns the count. */
static int replay(const char *name, int (*one)(const uint8_t *, size_t)) {
  char dir[1024];
  snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus/%s", GPUIPC_SOURCE_DIR,
           name);
  DIR *d = opendir(dir);
  if (d == NULL)
    return -1;
  static uint8_t buf[4 * GPUIPC__FRAME_MAX];
  int files = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    ASSERT_NOT_NULL(f);
    size_t n = fread(buf, 1, sizeof buf, f);
    ASSERT(!ferror(f));
    fclose(f);
    printf("%s/%s (%zu bytes)\n", name, e->d_name, n);
    fflush(stdout);
    uint8_t *copy = malloc(n ? n : 1);
    ASSERT_NOT_NULL(copy);
    memcpy(copy, buf, n);
    ASSERT_EQ(one(copy, n), 0);
    free(copy);
    files++;
  }
  closedir(d);
  printf("replayed %d file(s) of corpus/%s\n", files, name);
  return files;
}

TEST_IMPL(fuzz_corpus_frames) {
  REQUIRE_EMULATOR("the harness makes the emulator the driver");
  fuzz_frames_init(NULL, NULL);
  fuzz_fd_baseline = -1;
  int n = replay("frames", fuzz_frames_one);
  if (n < 0)
    SKIP("no corpus");
  ASSERT_GT(n, 20);
  return 0;
}

TEST_IMPL(fuzz_corpus_handshake) {
  REQUIRE_EMULATOR("the harness makes the emulator the driver");
  fuzz_handshake_init(NULL, NULL);
  fuzz_fd_baseline = -1;
  int n = replay("handshake", fuzz_handshake_one);
  gpuipc_listener_close(listener);
  listener = NULL;
  if (n < 0)
    SKIP("no corpus");
  ASSERT_GT(n, 15);
  return 0;
}

/* The ring carrier's hostile peer (fuzz_ring.c). Its harness takes its
 * own descriptor baseline at init (after warm-up sends), and checks after
 * each input that a killed peer's blocks were reclaimed. */
/* Under ThreadSanitizer: the peers' pidfds come from the kernel without
 * a call TSan intercepts (SO_PEERPIDFD, pidfd_open by syscall), so when
 * the watcher thread closes one whose number another thread used before,
 * TSan reports a race on it and its report then fails its own check
 * (CHECK in AddLocation: the fd's creating thread is unknown). */
#if defined(__SANITIZE_THREAD__)
#define FUZZ_RING_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FUZZ_RING_UNDER_TSAN 1
#endif
#endif

TEST_IMPL(fuzz_corpus_ring) {
  REQUIRE_EMULATOR("the harness makes the emulator the driver");
#ifdef FUZZ_RING_UNDER_TSAN
  SKIP("under ThreadSanitizer, which cannot track the pidfds the kernel "
       "hands out and fails its own check reporting their close by the "
       "watcher thread; the replay runs in the other builds");
#endif
  fuzz_ring_init(NULL, NULL);
  int n = replay("ring", fuzz_ring_one);
  if (n < 0)
    SKIP("no corpus");
  ASSERT_GT(n, 40);
  return 0;
}

TEST_IMPL(fuzz_corpus_ring_records) {
  int n = replay("ring-records", fuzz_ring_records_one);
  if (n < 0)
    SKIP("no corpus");
  ASSERT_GT(n, 10);
  return 0;
}

/* A hostile producer's frame sequence to a tensor-set consumer
 * (fuzz_sets_consumer.c): its harness records a real producer first. */
TEST_IMPL(fuzz_corpus_sets_consumer) {
  REQUIRE_EMULATOR("the harness makes the emulator the driver");
  fuzz_sets_consumer_init(NULL, NULL);
  fuzz_fd_baseline = -1;
  int n = replay("sets-consumer", fuzz_sets_consumer_one);
  if (n < 0)
    SKIP("no corpus");
  ASSERT_GT(n, 40);
  return 0;
}

TEST_IMPL(fuzz_corpus_xfer_header) {
  int n = replay("xfer-header", fuzz_xfer_header_one);
  if (n < 0)
    SKIP("no corpus");
  ASSERT_GT(n, 10);
  return 0;
}

/* A live peer sends a valid chunk and flag words, then a BUF frame (slot
 * 2, sequence 3) whose ready word it never writes. gpuipc_conn_recv
 * queues a stream wait for it; gpuipc_conn_close must still return within
 * the connection's timeout (1 s here), not wait on the GPU forever (a
 * peer must not make any call wait past its timeout). Run in a child, so
 * that a hang is reported as a failure rather than stalling the suite. */
TEST_IMPL(conn_hostile_buf_close_is_bounded) {
  REQUIRE_EMULATOR("the harness makes the emulator the driver");
  char path[1024];
  snprintf(path, sizeof path, "%s/tests/fuzz/corpus/frames/real-then-buf.bin",
           GPUIPC_SOURCE_DIR);
  static uint8_t in[4096];
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    SKIP("no %s", path);
  size_t n = fread(in, 1, sizeof in, f);
  fclose(f);
  ASSERT_GT(n, 1);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    setenv("FUZZ_FRAMES_STALL", "1", 1); /* the harness does not play the peer */
    fuzz_frames_init(NULL, NULL);
    fuzz_frames_one(in, n);
    _exit(0);
  }
  int status = 0;
  pid_t w = 0;
  for (int i = 0; i < 150 && (w = waitpid(pid, &status, WNOHANG)) == 0; i++)
    usleep(100000);
  if (w == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    harness_fail(__FILE__, __LINE__,
                 "after a live peer's unsignalled BUF frame, receive + close "
                 "did not return within 15 s (gpuipc_conn_close waits in "
                 "cuCtxSynchronize, src/conn/depart.c ho_close, for "
                 "a stream wait on a flag word the peer never writes)");
  }
  ASSERT(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  return 0;
}
