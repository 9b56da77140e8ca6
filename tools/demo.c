/*
 * demo.c: `gpuipc demo`: the two-process CUDA IPC hello world, done right.
 *
 * The parent makes a connected pair, starts a second process (this same
 * program, re-executed through /proc/self/exe with a hidden argument, so it
 * starts with a fresh CUDA driver: a process forked after CUDA was
 * initialized cannot use CUDA) and hands it one end. The producer writes
 * "Hello, World!" and a larger pattern into GPU memory, sends the buffer
 * (stream-ordered: the consumer's stream waits on the GPU for the copy),
 * the consumer copies it back on its stream, checks every byte and prints
 * the greeting, and releases it; then they swap roles.
 *
 * Without a GPU (with --emulator PATH, as `make demo` passes) it runs on
 * the CUDA driver emulator and says so.
 */
#include "bench.h"
#include "cli.h"
#include "tree.h"

#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define HELLO "Hello, World!"
#define HELLO_AREA 64 /* the greeting lives in the first 64 bytes */

typedef struct demo_meta {
  char text[16];
  uint64_t pattern_bytes;
  uint32_t seed;
} demo_meta;

static void fill(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed | 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (uint8_t)(x >> 16);
  }
}

static int fail(const char *who, const char *what, gpuipc_status s) {
  fprintf(stderr, "gpuipc demo [%s pid %d]: %s: %s (%s)\n", who, (int)getpid(),
          what, gpuipc_strerror(s), gpuipc_last_error());
  return 1;
}

static gpuipc_status make_current(void) {
  CUcontext ctx;
  GPUIPC__CHECK(gpuipc__primary_ctx(0, &ctx));
  GPUIPC__CU_CHECK(cuCtxSetCurrent, ctx);
  return GPUIPC_OK;
}

/* Produces one buffer on conn and waits until the peer gave it back. */
static int produce(gpuipc_conn *c, const char *who, size_t pattern_bytes,
                   uint32_t seed) {
  gpuipc_status s;
  gpuipc_arena *a = NULL;
  gpuipc_block *b = NULL;
  uint8_t *host = NULL;
  CUstream st = NULL;
  int rc = 1;
  size_t n = HELLO_AREA + pattern_bytes;
  gpuipc_arena_options ao = GPUIPC_ARENA_OPTIONS_INIT;
  ao.chunk_bytes = n + ((size_t)1 << 20);
  if ((s = gpuipc_arena_create(&ao, &a)) != GPUIPC_OK ||
      (s = make_current()) != GPUIPC_OK) {
    rc = fail(who, "creating an arena", s);
    goto out;
  }
  CUresult r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) {
    rc = fail(who, "cuStreamCreate", gpuipc__fail_cuda(r, "cuStreamCreate", NULL));
    goto out;
  }
  if ((s = gpuipc_arena_alloc(a, n, (struct CUstream_st *)st, &b)) != GPUIPC_OK) {
    rc = fail(who, "allocating a GPU buffer", s);
    goto out;
  }
  host = calloc(1, n);
  if (host == NULL)
    goto out;
  memcpy(host, HELLO, sizeof HELLO);
  fill(host + HELLO_AREA, pattern_bytes, seed);
  /* Asynchronous: the consumer's stream waits for this copy on the GPU. */
  r = GPUIPC__CU(cuMemcpyHtoDAsync, (CUdeviceptr)(uintptr_t)gpuipc_block_get_ptr(b),
                 host, n, st);
  if (r != CUDA_SUCCESS) {
    rc = fail(who, "cuMemcpyHtoDAsync",
              gpuipc__fail_cuda(r, "cuMemcpyHtoDAsync", NULL));
    goto out;
  }
  demo_meta m = {HELLO, pattern_bytes, seed};
  printf("[%s pid %d] wrote \"%s\" and a %zu KiB pattern into GPU memory at "
         "%p; handing it over\n",
         who, (int)getpid(), HELLO, pattern_bytes >> 10, gpuipc_block_get_ptr(b));
  fflush(stdout);
  if ((s = gpuipc_conn_send(c, b, (struct CUstream_st *)st, &m, sizeof m)) !=
      GPUIPC_OK) {
    rc = fail(who, "gpuipc_conn_send", s);
    goto out;
  }
  /* The buffer is ours again once the consumer released it (and, on the
   * GPU, once its work on it is done: the arena orders reuse after it). */
  while (gpuipc_block_get_holders(b) > 0) {
    if ((s = gpuipc_conn_progress(c, 1000)) != GPUIPC_OK) {
      rc = fail(who, "waiting for the release", s);
      goto out;
    }
  }
  printf("[%s pid %d] the buffer came back\n", who, (int)getpid());
  fflush(stdout);
  rc = 0;
out:
  if (b)
    gpuipc_block_free(b, (struct CUstream_st *)st);
  if (st) {
    GPUIPC__CU(cuStreamSynchronize, st);
    GPUIPC__CU(cuStreamDestroy, st);
  }
  if (a && (s = gpuipc_arena_destroy(a)) != GPUIPC_OK && rc == 0)
    rc = fail(who, "gpuipc_arena_destroy", s);
  free(host);
  return rc;
}

/* Receives one buffer, checks it, prints the greeting, releases it. */
static int consume(gpuipc_conn *c, const char *who) {
  gpuipc_status s;
  CUstream st = NULL;
  uint8_t *host = NULL, *want = NULL;
  int rc = 1;
  if ((s = gpuipc_init()) != GPUIPC_OK || (s = make_current()) != GPUIPC_OK)
    return fail(who, "initializing CUDA", s);
  CUresult r = GPUIPC__CU(cuStreamCreate, &st, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS)
    return fail(who, "cuStreamCreate", gpuipc__fail_cuda(r, "cuStreamCreate", NULL));
  gpuipc_received in = GPUIPC_RECEIVED_INIT;
  if ((s = gpuipc_conn_recv(c, (struct CUstream_st *)st, &in)) != GPUIPC_OK) {
    rc = fail(who, "gpuipc_conn_recv", s);
    goto out;
  }
  demo_meta m;
  if (in.meta_len != sizeof m) {
    fprintf(stderr, "gpuipc demo [%s]: unexpected metadata\n", who);
    goto out;
  }
  memcpy(&m, in.meta, sizeof m);
  host = malloc(in.length);
  want = malloc(in.length);
  if (host == NULL || want == NULL || in.length != HELLO_AREA + m.pattern_bytes)
    goto out;
  /* Queued on our stream after recv: runs only once the producer's copy
   * is done, without either host waiting for the other. */
  r = GPUIPC__CU(cuMemcpyDtoHAsync, host, (CUdeviceptr)(uintptr_t)in.ptr,
                 in.length, st);
  if (r == CUDA_SUCCESS)
    r = GPUIPC__CU(cuStreamSynchronize, st);
  if (r != CUDA_SUCCESS) {
    rc = fail(who, "reading the buffer", gpuipc__fail_cuda(r, "cuMemcpyDtoHAsync", NULL));
    goto out;
  }
  memset(want, 0, HELLO_AREA);
  memcpy(want, HELLO, sizeof HELLO);
  fill(want + HELLO_AREA, m.pattern_bytes, m.seed);
  bool ok = memcmp(host, want, in.length) == 0;
  printf("[%s pid %d] received %zu KiB at %p (this process's mapping): \"%s\"; "
         "the %zu KiB pattern %s\n",
         who, (int)getpid(), in.length >> 10, in.ptr, (const char *)host,
         (size_t)(m.pattern_bytes >> 10), ok ? "matches" : "DOES NOT MATCH");
  fflush(stdout);
  if ((s = gpuipc_conn_release(c, in.id, (struct CUstream_st *)st)) != GPUIPC_OK) {
    rc = fail(who, "gpuipc_conn_release", s);
    goto out;
  }
  rc = ok ? 0 : 1;
out:
  if (st) {
    GPUIPC__CU(cuStreamSynchronize, st);
    GPUIPC__CU(cuStreamDestroy, st);
  }
  free(host);
  free(want);
  return rc;
}

static int child_main(int fd, size_t pattern_bytes) {
  gpuipc_conn *c = NULL;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 60000;
  gpuipc_status s = gpuipc_conn_from_fd(fd, &o, &c);
  if (s != GPUIPC_OK)
    return fail("child", "gpuipc_conn_from_fd", s);
  int rc = consume(c, "consumer");
  if (rc == 0)
    rc = produce(c, "producer", pattern_bytes, 2);
  gpuipc_conn_close(c);
  return rc;
}

static void demo_usage(FILE *f) {
  gpuipc_cli_usage_line(f, "demo");
  fprintf(f, "  two processes sharing GPU memory: one fills a buffer, the "
             "other checks it\n"
             "  --emulator PATH  the CUDA driver emulator, when no GPU driver "
             "is usable\n");
}

int gpuipc_cmd_demo(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      demo_usage(stdout);
      return 0;
    }
  int emu = gpuipc_bench_pick_driver(&argc, argv, "demo");
  if (emu < 0)
    return 1;
  size_t pattern_bytes = emu ? (size_t)4 << 20 : (size_t)64 << 20;
  if (argc >= 3 && strcmp(argv[1], "--child") == 0)
    return child_main(atoi(argv[2]), pattern_bytes);
  if (argc >= 2) {
    fprintf(stderr, "gpuipc demo: unknown option '%s'\n", argv[1]);
    demo_usage(stderr);
    return 2;
  }

  /* Start the second process before this one touches CUDA. */
  int fds[2];
  gpuipc_status s = gpuipc_conn_pair(fds);
  if (s != GPUIPC_OK)
    return fail("parent", "gpuipc_conn_pair", s);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 3); /* dup2 clears CLOEXEC */
  char *args[] = {"gpuipc", "demo", "--child", "3", NULL};
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, args, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(fds[1]);
  if (err != 0) {
    fprintf(stderr, "gpuipc demo: cannot start the second process: %s\n",
            strerror(err));
    close(fds[0]);
    return 1;
  }
  int rc = 1;
  gpuipc_conn *c = NULL;
  gpuipc_conn_options o = GPUIPC_CONN_OPTIONS_INIT;
  o.timeout_ms = 60000;
  if ((s = gpuipc_conn_from_fd(fds[0], &o, &c)) != GPUIPC_OK) {
    rc = fail("parent", "gpuipc_conn_from_fd", s);
  } else if ((s = gpuipc_init()) != GPUIPC_OK) {
    rc = fail("parent", "gpuipc_init", s);
  } else {
    char name[128] = "?";
    CUdevice dev;
    if (GPUIPC__CU(cuDeviceGet, &dev, 0) == CUDA_SUCCESS)
      GPUIPC__CU(cuDeviceGetName, name, (int)sizeof name, dev);
    printf("gpuipc demo: two processes (pids %d and %d) on device 0 (%s)%s\n",
           (int)getpid(), (int)pid, name,
           emu ? ", emulated" : "");
    fflush(stdout);
    rc = produce(c, "producer", pattern_bytes, 1);
    if (rc == 0) {
      printf("-- swapping roles --\n");
      fflush(stdout);
      rc = consume(c, "consumer");
    }
  }
  gpuipc_conn_close(c);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
    ;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    rc = 1;
  printf("gpuipc demo: %s\n", rc == 0 ? "OK" : "FAILED");
  return rc;
}
