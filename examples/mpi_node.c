/*
 * mpi_node.c: the MPI helper at work: every rank shares a buffer with every
 * other rank of its machine over the gpuipc connections gpuipc_mpi_init
 * made, and checks what the others shared with it.
 *
 * Each rank allocates a buffer (the best pool kind the device supports:
 * memory pools travel with their file descriptor, which the connection
 * carries), writes its rank into it, and sends it to every other local rank
 * with gpuipc_conn_send_buffer; then it receives one buffer from each
 * (gpuipc_conn_recv), checks its contents and releases it. Each rank frees
 * its buffer only once no peer holds it any more. Ranks on other machines
 * are listed as such, never faked.
 *
 *   mpirun -n 4 ./mpi_node
 */
#include <mpi.h>

#include <gpuipc.h>
#include <gpuipc/mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BYTES 4096

static int rank_;

static int fail(const char *what, gpuipc_status s) {
  fprintf(stderr, "rank %d: %s: %s: %s\n", rank_, what, gpuipc_status_name(s),
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

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  int rc = 0;
  gpuipc_mpi *g = NULL;
  gpuipc_pool *pool = NULL;
  gpuipc_buffer *mine = NULL;
  gpuipc_xfer *x = NULL;
  unsigned char *host = malloc(BYTES);
  int shared = 0;

  gpuipc_status s = gpuipc_mpi_init(MPI_COMM_WORLD, NULL, &g);
  if (s != GPUIPC_OK) {
    rc = fail("gpuipc_mpi_init", s);
    goto out; /* every rank of the machine failed alike */
  }
  int size = gpuipc_mpi_get_size(g);
  int lsize = gpuipc_mpi_get_local_size(g);
  int lrank = gpuipc_mpi_get_local_rank(g);
  if (rank_ == 0)
    printf("mpi_node: %d ranks on %d machine(s)\n", size,
           gpuipc_mpi_get_machines(g));
  int foreign = 0;
  for (int r = 0; r < size; r++)
    if (r != rank_ && gpuipc_mpi_peer_check(g, r) == GPUIPC_E_FOREIGN_MACHINE) {
      printf("rank %d: %s\n", rank_, gpuipc_last_error());
      foreign++;
    }
  /* Every rank is either on this machine or reported as foreign. */
  if (foreign != size - lsize) {
    fprintf(stderr, "rank %d: %d ranks reported on other machines, expected %d\n",
            rank_, foreign, size - lsize);
    rc = 1;
    goto out;
  }

  int count = 0;
  CHECK("gpuipc_device_count", gpuipc_device_count(&count));
  if (count == 0) {
    fprintf(stderr, "rank %d: no CUDA device\n", rank_);
    rc = 1;
    goto out;
  }
  /* One device per local rank, round robin; gpuipc names it by UUID. */
  int device = lrank % count;
  gpuipc_uuid dev;
  CHECK("gpuipc_device_uuid", gpuipc_device_uuid(device, &dev));
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.device = &dev;
  CHECK("gpuipc_pool_create", gpuipc_pool_create(&po, &pool));
  CHECK("gpuipc_buffer_alloc", gpuipc_buffer_alloc(pool, BYTES, NULL, &mine));
  CHECK("gpuipc_xfer_create", gpuipc_xfer_create(&dev, NULL, &x));
  memset(host, 0x40 + rank_ % 64, BYTES);
  CHECK("gpuipc_xfer_to_device",
        gpuipc_xfer_to_device(x, gpuipc_buffer_get_ptr(mine), host, BYTES, NULL,
                              GPUIPC_XFER_SYNC));
  for (int r = 0; r < size; r++)
    if (gpuipc_mpi_get_conn(g, r))
      CHECK("gpuipc_conn_send_buffer",
            gpuipc_conn_send_buffer(gpuipc_mpi_get_conn(g, r), mine, NULL, NULL, 0));
  for (int r = 0; r < size; r++) {
    gpuipc_conn *c = gpuipc_mpi_get_conn(g, r);
    if (c == NULL)
      continue;
    gpuipc_received theirs = GPUIPC_RECEIVED_INIT;
    CHECK("gpuipc_conn_recv", gpuipc_conn_recv(c, NULL, &theirs));
    memset(host, 0, BYTES);
    /* The buffer is mapped on its owner's device: copy with an engine of
     * that device. */
    gpuipc_uuid where;
    gpuipc_xfer *y = NULL;
    s = gpuipc_device_uuid(theirs.device, &where);
    if (s == GPUIPC_OK && theirs.device != device)
      s = gpuipc_xfer_create(&where, NULL, &y);
    if (s == GPUIPC_OK)
      s = theirs.length == BYTES
              ? gpuipc_xfer_to_host(y ? y : x, host, theirs.ptr, BYTES, NULL,
                                    GPUIPC_XFER_SYNC)
              : GPUIPC_E_OUT_OF_RANGE;
    gpuipc_xfer_destroy(y);
    gpuipc_status rs = gpuipc_conn_release(c, theirs.id, NULL);
    CHECK("reading a peer's buffer", s);
    CHECK("gpuipc_conn_release", rs);
    for (int i = 0; i < BYTES; i++)
      if (host[i] != (unsigned char)(0x40 + r % 64)) {
        fprintf(stderr, "rank %d: byte %d of rank %d's buffer is 0x%02x\n",
                rank_, i, r, host[i]);
        rc = 1;
        goto out;
      }
    shared++;
  }
  printf("rank %d (local %d of %d): read the buffers of %d peer(s)\n", rank_,
         lrank, lsize, shared);
  fflush(stdout);
out:;
  /* Everyone keeps its buffer until no peer holds it: asking makes
   * progress, which also sends our own releases. */
  for (int r = 0; mine && g && r < gpuipc_mpi_get_size(g); r++) {
    gpuipc_conn *c = gpuipc_mpi_get_conn(g, r);
    for (int waited = 0; c && gpuipc_conn_get_buffer_holders(c, mine) > 0;
         waited++) {
      if (waited == 30000) {
        fprintf(stderr, "rank %d: rank %d still holds our buffer\n", rank_, r);
        rc = 1;
        break;
      }
      gpuipc_conn_progress(c, 1);
    }
  }
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  rc = worst;
  gpuipc_xfer_destroy(x);
  gpuipc_buffer_free(mine, NULL);
  gpuipc_pool_destroy(pool);
  gpuipc_mpi_finalize(g);
  free(host);
  if (rank_ == 0)
    printf("mpi_node: %s\n", rc ? "FAILED" : "ok");
  MPI_Finalize();
  return rc ? 1 : 0;
}
