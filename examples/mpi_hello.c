/*
 * mpi_hello.c: the classic two-rank CUDA IPC sample, done with gpuipc's
 * descriptors over plain MPI messages.
 *
 * Ranks work in pairs (0 -> 1, 2 -> 3, ...): the even rank allocates device
 * memory, writes "Hello, World!" into it and sends its descriptor with
 * MPI_Send; the odd rank imports it, copies it to the host and prints it,
 * then tells the even rank it is done, so the memory is freed only after
 * the importer closed it. With an odd number of ranks the last one idles.
 *
 * The buffers come from a LEGACY pool: legacy descriptors need no file
 * descriptor beside them, so they can travel in any message, MPI's
 * included (memory-pool and VMM buffers need their fd, which MPI cannot
 * carry: use the MPI helper's connections for those, see mpi_node.c).
 * A pair whose ranks run on different machines is reported as such: CUDA
 * IPC cannot cross machines (use CUDA-aware MPI, UCX or NCCL there).
 *
 *   mpirun -n 2 ./mpi_hello
 */
#include <mpi.h>

#include <gpuipc.h>

#include <stdio.h>
#include <string.h>

#define TAG_DESC 1
#define TAG_DONE 2

static int fail(const char *what, gpuipc_status s) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  fprintf(stderr, "rank %d: %s: %s: %s\n", rank, what, gpuipc_status_name(s),
          gpuipc_last_error());
  return 1;
}

#define CHECK(what, expr)                                                      \
  do {                                                                         \
    gpuipc_status s_ = (expr);                                                 \
    if (s_ != GPUIPC_OK) {                                                     \
      rc = fail(what, s_);                                                     \
      goto out;                                                                \
    }                                                                          \
  } while (0)

static int producer(int peer, int device) {
  int rc = 0;
  gpuipc_pool *pool = NULL;
  gpuipc_buffer *buf = NULL;
  gpuipc_xfer *x = NULL;
  char msg[64];
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  snprintf(msg, sizeof msg, "Hello, World! (from rank %d)", rank);

  /* gpuipc names devices by UUID (ordinals differ between processes). */
  gpuipc_uuid dev;
  CHECK("gpuipc_device_uuid", gpuipc_device_uuid(device, &dev));
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_LEGACY;
  po.device = &dev;
  CHECK("gpuipc_pool_create", gpuipc_pool_create(&po, &pool));
  CHECK("gpuipc_buffer_alloc", gpuipc_buffer_alloc(pool, sizeof msg, NULL, &buf));
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(&dev, NULL, &x));
  CHECK("gpuipc_xfer_to_device",
        gpuipc_xfer_to_device(x, gpuipc_buffer_get_ptr(buf), msg, sizeof msg, NULL,
                              GPUIPC_XFER_SYNC));
  uint8_t desc[GPUIPC_DESC_MAX];
  size_t len = 0;
  CHECK("gpuipc_buffer_export",
        gpuipc_buffer_export(buf, desc, sizeof desc, &len, NULL, NULL));
  MPI_Send(desc, (int)len, MPI_BYTE, peer, TAG_DESC, MPI_COMM_WORLD);
  /* Keep the memory until the importer has closed it: the driver would let
   * it read freed memory without complaint. */
  int done = 0;
  MPI_Recv(&done, 1, MPI_INT, peer, TAG_DONE, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  if (done != 1)
    rc = 1;
out:
  gpuipc_xfer_destroy(x);
  gpuipc_buffer_free(buf, NULL);
  gpuipc_pool_destroy(pool);
  return rc;
}

static int consumer(int peer) {
  int rc = 0;
  gpuipc_buffer *buf = NULL;
  gpuipc_xfer *x = NULL;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  uint8_t desc[GPUIPC_DESC_MAX];
  MPI_Status st;
  MPI_Recv(desc, sizeof desc, MPI_BYTE, peer, TAG_DESC, MPI_COMM_WORLD, &st);
  int len = 0;
  MPI_Get_count(&st, MPI_BYTE, &len);
  gpuipc_status s = gpuipc_buffer_import(desc, (size_t)len, NULL, 0, NULL, &buf);
  if (s == GPUIPC_E_FOREIGN_MACHINE) {
    fprintf(stderr,
            "rank %d: rank %d runs on another machine: CUDA IPC cannot share "
            "memory across machines (use CUDA-aware MPI, UCX or NCCL)\n",
            rank, peer);
    rc = 1;
    goto out;
  }
  CHECK("gpuipc_buffer_import", s);
  gpuipc_uuid dev;
  CHECK("gpuipc_buffer_get_mapped_device", gpuipc_buffer_get_mapped_device(buf, &dev));
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(&dev, NULL, &x));
  char text[64];
  memset(text, 0, sizeof text);
  size_t n = gpuipc_buffer_get_size(buf) < sizeof text - 1 ? gpuipc_buffer_get_size(buf)
                                                       : sizeof text - 1;
  CHECK("gpuipc_xfer_to_host",
        gpuipc_xfer_to_host(x, text, gpuipc_buffer_get_ptr(buf), n, NULL,
                            GPUIPC_XFER_SYNC));
  printf("rank %d got from rank %d: %s\n", rank, peer, text);
  fflush(stdout);
  if (strncmp(text, "Hello, World!", 13) != 0) {
    fprintf(stderr, "rank %d: unexpected contents\n", rank);
    rc = 1;
  }
out:
  gpuipc_xfer_destroy(x);
  gpuipc_buffer_close(buf);
  /* Whatever happened, release the producer. */
  int done = rc == 0 ? 1 : 0;
  MPI_Send(&done, 1, MPI_INT, peer, TAG_DONE, MPI_COMM_WORLD);
  return rc;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  /* One GPU per rank of a machine, round robin. */
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank,
                      MPI_INFO_NULL, &local);
  int local_rank = 0;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_free(&local);

  int rc = 0;
  int count = 0;
  gpuipc_status s = gpuipc_device_count(&count);
  if (s != GPUIPC_OK || count == 0) {
    rc = s != GPUIPC_OK ? fail("gpuipc_device_count", s) : 1;
    if (s == GPUIPC_OK)
      fprintf(stderr, "rank %d: no CUDA device\n", rank);
  }
  /* Nobody starts a pair whose partner cannot take part. */
  int setup = 0;
  MPI_Allreduce(&rc, &setup, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (setup != 0) {
    rc = 1;
  } else if (rank % 2 == 0 && rank + 1 < size) {
    rc = producer(rank + 1, local_rank % count);
  } else if (rank % 2 == 1) {
    rc = consumer(rank - 1);
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    printf("mpi_hello: %d ranks, %s\n", size, worst ? "FAILED" : "ok");
  MPI_Finalize();
  return worst ? 1 : 0;
}
