/*
 * test-mpi-sendrecv.c: gpuipc_mpi_send / gpuipc_mpi_recv under mpirun
 * (4 ranks; registered by cmake/mpi.cmake in several environments).
 *
 * Each rank exchanges device buffers with rank ^ 1 and rank ^ 2 (with
 * GPUIPC_MPI_SIMULATE_MACHINES=2 the first is on the other machine, the
 * second on this one), both directions, for sizes 0, 1, below, at and
 * across the chunk size, not a multiple of it, and large; checks every
 * byte, the path each side reports, a size mismatch (GPUIPC_E_TRUNCATED on
 * both sides, and the pair still in step after it), a sender whose buffer
 * is not device memory (INVALID_ARG there, CANCELED at the receiver),
 * MPI_ANY_SOURCE / MPI_ANY_TAG, and that the application's own MPI
 * messages with the same tags are left alone. With GPUIPC_TEST_FAULT, a
 * driver failure in the middle of a transfer instead (fault_run).
 */
#include <mpi.h>

#include <gpuipc.h>
#include <gpuipc/mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank_;
static int failures_;

#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "rank %d: FAILED %s:%d: %s: ", rank_, __FILE__,          \
              __LINE__, #cond);                                                \
      fprintf(stderr, __VA_ARGS__);                                            \
      fprintf(stderr, " (last error: %s)\n", gpuipc_last_error());             \
      failures_++;                                                             \
    }                                                                          \
  } while (0)

static gpuipc_pool *pool_;
static gpuipc_xfer *x_;

static unsigned char pattern(int from, size_t i, int round) {
  return (unsigned char)(from * 31 + (int)(i % 251) + round * 7);
}

/* Device buffer of n bytes (at least 1), filled with pattern or `fill`. */
static gpuipc_buffer *dev_buffer(size_t n, int from, int round, int fill) {
  gpuipc_buffer *b = NULL;
  gpuipc_status s = gpuipc_buffer_alloc(pool_, n ? n : 1, NULL, &b);
  EXPECT(s == GPUIPC_OK, "alloc %zu", n);
  if (s != GPUIPC_OK)
    return NULL;
  unsigned char *h = malloc(n ? n : 1);
  for (size_t i = 0; i < (n ? n : 1); i++)
    h[i] = fill >= 0 ? (unsigned char)fill : pattern(from, i, round);
  s = gpuipc_xfer_to_device(x_, gpuipc_buffer_get_ptr(b), h, n ? n : 1, NULL,
                            GPUIPC_XFER_SYNC);
  EXPECT(s == GPUIPC_OK, "fill %zu", n);
  free(h);
  return b;
}

static void check_contents(gpuipc_buffer *b, size_t n, int from, int round) {
  if (n == 0)
    return;
  unsigned char *h = malloc(n);
  gpuipc_status s = gpuipc_xfer_to_host(x_, h, gpuipc_buffer_get_ptr(b), n,
                                        NULL, GPUIPC_XFER_SYNC);
  EXPECT(s == GPUIPC_OK, "read back %zu", n);
  for (size_t i = 0; i < n && s == GPUIPC_OK; i++)
    if (h[i] != pattern(from, i, round)) {
      EXPECT(0, "%zu bytes from rank %d: byte %zu is 0x%02x, expected 0x%02x",
             n, from, i, h[i], pattern(from, i, round));
      break;
    }
  free(h);
}

static gpuipc_mpi_path expected_path(gpuipc_mpi *g, int peer) {
  const char *local = getenv("GPUIPC_MPI_LOCAL");
  if (gpuipc_mpi_get_conn(g, peer) != NULL && !(local && strcmp(local, "0") == 0))
    return GPUIPC_MPI_PATH_LOCAL;
  return gpuipc_mpi_is_cuda_aware(g) ? GPUIPC_MPI_PATH_CUDA_AWARE
                                     : GPUIPC_MPI_PATH_STAGED;
}

/* One transfer of n bytes from `from` to `to` (this rank is one of them). */
static void one(gpuipc_mpi *g, int from, int to, size_t n, int tag, int round) {
  gpuipc_mpi_transfer_info info = GPUIPC_MPI_TRANSFER_INFO_INIT;
  if (rank_ == from) {
    gpuipc_buffer *b = dev_buffer(n, from, round, -1);
    gpuipc_status s = gpuipc_mpi_send(g, gpuipc_buffer_get_ptr(b), n, to, tag,
                                      NULL, &info);
    EXPECT(s == GPUIPC_OK, "send %zu bytes to %d: %s", n, to,
           gpuipc_status_name(s));
    EXPECT(info.path == expected_path(g, to), "send %zu to %d took path %s",
           n, to, gpuipc_mpi_path_name(info.path));
    EXPECT(info.bytes == n && info.peer == to && info.tag == tag, "info");
    gpuipc_buffer_free(b, NULL);
  } else {
    gpuipc_buffer *b = dev_buffer(n, from, round, 0);
    gpuipc_status s = gpuipc_mpi_recv(g, gpuipc_buffer_get_ptr(b), n, from,
                                      tag, NULL, &info);
    EXPECT(s == GPUIPC_OK, "recv %zu bytes from %d: %s", n, from,
           gpuipc_status_name(s));
    gpuipc_mpi_path want = expected_path(g, from);
    EXPECT(info.path == want, "recv %zu from %d took path %s, expected %s", n,
           from, gpuipc_mpi_path_name(info.path), gpuipc_mpi_path_name(want));
    if (s == GPUIPC_OK)
      check_contents(b, n, from, round);
    gpuipc_buffer_free(b, NULL);
  }
}

static void pair(gpuipc_mpi *g, int peer, int round) {
  size_t chunk = gpuipc_mpi_get_chunk_bytes(g, (size_t)64 << 20);
  size_t sizes[] = {0, 1, 4095, chunk - 1, chunk, chunk + 1,
                    3 * chunk + 123, ((size_t)24 << 20) + 17};
  int lo = rank_ < peer ? rank_ : peer, hi = rank_ < peer ? peer : rank_;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    one(g, lo, hi, sizes[i], (int)i, round);
    one(g, hi, lo, sizes[i], (int)i + 100, round);
  }

  /* Size mismatch: an error on both sides, nothing hangs, and the pair is
   * in step afterwards. */
  gpuipc_buffer *b = dev_buffer(1000, rank_, round, 0);
  void *p = gpuipc_buffer_get_ptr(b);
  gpuipc_status s = rank_ == lo ? gpuipc_mpi_send(g, p, 1000, hi, 7, NULL, NULL)
                                : gpuipc_mpi_recv(g, p, 999, lo, 7, NULL, NULL);
  EXPECT(s == GPUIPC_E_TRUNCATED, "mismatch gave %s", gpuipc_status_name(s));
  EXPECT(strstr(gpuipc_last_error(), "1000") && strstr(gpuipc_last_error(), "999"),
         "mismatch message names both sizes: %s", gpuipc_last_error());
  s = rank_ == hi ? gpuipc_mpi_send(g, p, 1000, lo, 7, NULL, NULL)
                  : gpuipc_mpi_recv(g, p, 1001, hi, 7, NULL, NULL);
  EXPECT(s == GPUIPC_E_TRUNCATED, "larger receive gave %s",
         gpuipc_status_name(s));
  gpuipc_buffer_free(b, NULL);
  one(g, lo, hi, 5000, 8, round);

  /* A sender whose buffer is not device memory: INVALID_ARG there,
   * CANCELED at the receiver. */
  b = dev_buffer(64, rank_, round, 0);
  char host[64];
  s = rank_ == lo ? gpuipc_mpi_send(g, host, sizeof host, hi, 9, NULL, NULL)
                  : gpuipc_mpi_recv(g, gpuipc_buffer_get_ptr(b), 64, lo, 9,
                                    NULL, NULL);
  EXPECT(s == (rank_ == lo ? GPUIPC_E_INVALID_ARG : GPUIPC_E_CANCELED),
         "bad sender buffer gave %s", gpuipc_status_name(s));
  gpuipc_buffer_free(b, NULL);

  /* The application's own messages with the same tag on the same
   * communicator are not taken, and do not take ours. */
  int mine = 1000 + rank_, theirs = -1;
  MPI_Request rq;
  MPI_Irecv(&theirs, 1, MPI_INT, peer, 3, MPI_COMM_WORLD, &rq);
  MPI_Send(&mine, 1, MPI_INT, peer, 3, MPI_COMM_WORLD);
  one(g, lo, hi, 3333, 3, round);
  MPI_Wait(&rq, MPI_STATUS_IGNORE);
  EXPECT(theirs == 1000 + peer, "application message %d", theirs);

  /* MPI_ANY_SOURCE / MPI_ANY_TAG: the info names the real ones. */
  if (rank_ == lo) {
    b = dev_buffer(777, lo, round, -1);
    s = gpuipc_mpi_send(g, gpuipc_buffer_get_ptr(b), 777, hi, 42, NULL, NULL);
    EXPECT(s == GPUIPC_OK, "send for ANY: %s", gpuipc_status_name(s));
  } else {
    b = dev_buffer(777, lo, round, 0);
    gpuipc_mpi_transfer_info info = GPUIPC_MPI_TRANSFER_INFO_INIT;
    /* Only lo sends to this rank now (other pairs run their own rounds,
     * and a rank is in one pair at a time). */
    s = gpuipc_mpi_recv(g, gpuipc_buffer_get_ptr(b), 777, MPI_ANY_SOURCE,
                        MPI_ANY_TAG, NULL, &info);
    EXPECT(s == GPUIPC_OK && info.peer == lo && info.tag == 42,
           "ANY: %s from %d tag %d", gpuipc_status_name(s), info.peer, info.tag);
    if (s == GPUIPC_OK)
      check_contents(b, 777, lo, round);
  }
  gpuipc_buffer_free(b, NULL);

  /* Bad arguments fail at once, nothing sent. */
  EXPECT(gpuipc_mpi_send(g, NULL, 0, rank_, 0, NULL, NULL) == GPUIPC_E_INVALID_ARG,
         "send to self");
  EXPECT(gpuipc_mpi_recv(g, NULL, 0, gpuipc_mpi_get_size(g), 0, NULL, NULL) ==
             GPUIPC_E_INVALID_ARG,
         "recv from out of range");
  EXPECT(gpuipc_mpi_send(g, NULL, 0, peer, -5, NULL, NULL) == GPUIPC_E_INVALID_ARG,
         "negative tag");
}

/* GPUIPC_TEST_FAULT=recv|send: a driver copy of the receiver (rank 1) or
 * of the sender (rank 0) fails during the first transfer from 0 to 1 (its
 * second chunk on the staged path; the copy on the local path): that side
 * returns the driver's error, the other GPUIPC_E_CANCELED, and the next
 * transfers both ways are whole. */
static void fault_run(gpuipc_mpi *g) {
  const char *f = getenv("GPUIPC_TEST_FAULT");
  int faulty = strcmp(f, "send") == 0 ? 0 : 1;
  size_t n = 300000;
  gpuipc_buffer *b = NULL;
  EXPECT(gpuipc_buffer_alloc(pool_, n, NULL, &b) == GPUIPC_OK, "alloc");
  if (rank_ == 0) {
    gpuipc_buffer_free(b, NULL);
    b = dev_buffer(n, 0, 0, -1);
  }
  void *p = gpuipc_buffer_get_ptr(b);
  gpuipc_status s = rank_ == 0 ? gpuipc_mpi_send(g, p, n, 1, 5, NULL, NULL)
                               : gpuipc_mpi_recv(g, p, n, 0, 5, NULL, NULL);
  if (rank_ == faulty)
    EXPECT(s != GPUIPC_OK && s != GPUIPC_E_CANCELED,
           "the failing side (%s) returned %s", f, gpuipc_status_name(s));
  else
    EXPECT(s == GPUIPC_E_CANCELED, "the other side of a %s failure returned %s",
           f, gpuipc_status_name(s));
  gpuipc_buffer_free(b, NULL);
  one(g, 0, 1, n, 6, 3);
  one(g, 1, 0, n + 1, 7, 3);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  const char *fault = getenv("GPUIPC_TEST_FAULT");
  /* Rank 1 makes no copy to the device before the transfer that fails
   * (its buffer is not filled), so the second one is that transfer's
   * second chunk; on the local path its one copy is device to device. */
  if (fault && strcmp(fault, "recv") == 0 && rank_ == 1)
    setenv("GPUIPC_EMU_FAIL",
           getenv("GPUIPC_MPI_SIMULATE_MACHINES") ? "cuMemcpyHtoDAsync:2"
                                                  : "cuMemcpyDtoDAsync:1",
           1);
  if (fault && strcmp(fault, "send") == 0 && rank_ == 0)
    setenv("GPUIPC_EMU_FAIL", "cuMemcpyDtoHAsync:2", 1);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  gpuipc_mpi *g = NULL;
  gpuipc_status s = gpuipc_mpi_init(MPI_COMM_WORLD, NULL, &g);
  EXPECT(s == GPUIPC_OK, "gpuipc_mpi_init: %s", gpuipc_status_name(s));
  if (s == GPUIPC_OK) {
    int count = 0;
    gpuipc_device_count(&count);
    gpuipc_uuid dev;
    s = gpuipc_device_uuid(count > 0 ? gpuipc_mpi_get_local_rank(g) % count : 0,
                           &dev);
    gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
    po.kind = GPUIPC_POOL_LEGACY; /* cudaMalloc-like memory */
    po.device = &dev;
    if (s == GPUIPC_OK)
      s = gpuipc_pool_create(&po, &pool_);
    if (s == GPUIPC_OK)
      s = gpuipc_xfer_create(&dev, NULL, &x_);
    EXPECT(s == GPUIPC_OK, "setup: %s", gpuipc_status_name(s));
  }
  if (s == GPUIPC_OK) {
    if (rank_ == 0)
      printf("test-mpi-sendrecv: %d ranks, %d machine(s), MPI %sCUDA-aware, "
             "chunk %zu\n",
             size, gpuipc_mpi_get_machines(g),
             gpuipc_mpi_is_cuda_aware(g) ? "" : "not ",
             gpuipc_mpi_get_chunk_bytes(g, (size_t)64 << 20));
    if (fault != NULL) {
      if (rank_ < 2 && size >= 2)
        fault_run(g);
    } else
    for (int round = 1; round <= 2; round++) {
      int peer = rank_ ^ round;
      if (peer < size)
        pair(g, peer, round);
      MPI_Barrier(MPI_COMM_WORLD);
    }
  }
  gpuipc_xfer_destroy(x_);
  gpuipc_pool_destroy(pool_);
  gpuipc_mpi_finalize(g);
  int worst = 0;
  MPI_Allreduce(&failures_, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank_ == 0)
    printf("test-mpi-sendrecv: %s\n", worst ? "FAILED" : "ok");
  MPI_Finalize();
  return worst ? 1 : 0;
}
