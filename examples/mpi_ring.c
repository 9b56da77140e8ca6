/*
 * mpi_ring.c: device buffers around a ring of ranks with gpuipc_mpi_send /
 * gpuipc_mpi_recv, whatever machines the ranks run on.
 *
 * Each rank fills a device buffer with its rank number, sends it to the
 * next rank and receives the previous rank's into a second buffer, all on
 * one stream (here the legacy default stream), then checks what arrived and
 * says which path it took: "local" (GPU to GPU over a gpuipc connection,
 * same machine), "cuda-aware" (device pointers to MPI) or "staged" (pinned
 * host memory in overlapping chunks). Even ranks send first and odd ranks
 * receive first, so that the blocking calls pair up (with an odd number of
 * ranks the last pair waits for the first).
 *
 *   mpirun -n 4 ./mpi_ring
 *   GPUIPC_MPI_SIMULATE_MACHINES=2 mpirun -n 4 ./mpi_ring   (two "machines")
 */
#include <mpi.h>

#include <gpuipc.h>
#include <gpuipc/mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BYTES ((size_t)3 << 20)

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  gpuipc_mpi *g = NULL;
  gpuipc_pool *pool = NULL;
  gpuipc_buffer *out = NULL, *in = NULL;
  gpuipc_xfer *x = NULL;
  unsigned char *host = malloc(BYTES);
  gpuipc_status s = gpuipc_mpi_init(MPI_COMM_WORLD, NULL, &g);
  int count = 0;
  gpuipc_uuid dev;
  if (s == GPUIPC_OK)
    s = gpuipc_device_count(&count);
  if (s == GPUIPC_OK)
    s = gpuipc_device_uuid(count ? gpuipc_mpi_get_local_rank(g) % count : 0, &dev);
  gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
  po.kind = GPUIPC_POOL_LEGACY; /* plain device memory, as cudaMalloc gives */
  po.device = &dev;
  if (s == GPUIPC_OK)
    s = gpuipc_pool_create(&po, &pool);
  if (s == GPUIPC_OK)
    s = gpuipc_buffer_alloc(pool, BYTES, NULL, &out);
  if (s == GPUIPC_OK)
    s = gpuipc_buffer_alloc(pool, BYTES, NULL, &in);
  if (s == GPUIPC_OK)
    s = gpuipc_xfer_create(&dev, NULL, &x);
  if (s == GPUIPC_OK) {
    memset(host, rank & 0xff, BYTES);
    s = gpuipc_xfer_to_device(x, gpuipc_buffer_get_ptr(out), host, BYTES, NULL,
                              GPUIPC_XFER_SYNC);
  }
  if (s != GPUIPC_OK) {
    fprintf(stderr, "rank %d: setup: %s: %s\n", rank, gpuipc_status_name(s),
            gpuipc_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  gpuipc_mpi_transfer_info si = GPUIPC_MPI_TRANSFER_INFO_INIT;
  gpuipc_mpi_transfer_info ri = GPUIPC_MPI_TRANSFER_INFO_INIT;
  gpuipc_status ss = GPUIPC_OK, rs = GPUIPC_OK;
  if (size > 1) {
    if (rank % 2 == 0) {
      ss = gpuipc_mpi_send(g, gpuipc_buffer_get_ptr(out), BYTES, next, 0, NULL, &si);
      rs = gpuipc_mpi_recv(g, gpuipc_buffer_get_ptr(in), BYTES, prev, 0, NULL, &ri);
    } else {
      rs = gpuipc_mpi_recv(g, gpuipc_buffer_get_ptr(in), BYTES, prev, 0, NULL, &ri);
      ss = gpuipc_mpi_send(g, gpuipc_buffer_get_ptr(out), BYTES, next, 0, NULL, &si);
    }
  }
  if (ss != GPUIPC_OK || rs != GPUIPC_OK) {
    fprintf(stderr, "rank %d: send %s, recv %s: %s\n", rank,
            gpuipc_status_name(ss), gpuipc_status_name(rs), gpuipc_last_error());
    rc = 1;
  } else if (size > 1) {
    /* The data is ordered on the stream passed to recv: a synchronous
     * copy on the same stream sees it. */
    s = gpuipc_xfer_to_host(x, host, gpuipc_buffer_get_ptr(in), BYTES, NULL,
                            GPUIPC_XFER_SYNC);
    for (size_t i = 0; i < BYTES && s == GPUIPC_OK; i++)
      if (host[i] != (unsigned char)(prev & 0xff)) {
        fprintf(stderr, "rank %d: byte %zu from rank %d is %d\n", rank, i,
                prev, host[i]);
        rc = 1;
        break;
      }
    if (s != GPUIPC_OK)
      rc = 1;
    printf("rank %d: sent %zu bytes to rank %d (%s), received from rank %d (%s)\n",
           rank, BYTES, next, gpuipc_mpi_path_name(si.path), prev,
           gpuipc_mpi_path_name(ri.path));
    fflush(stdout);
  }
  gpuipc_xfer_destroy(x);
  gpuipc_buffer_free(out, NULL);
  gpuipc_buffer_free(in, NULL);
  gpuipc_pool_destroy(pool);
  gpuipc_mpi_finalize(g);
  free(host);
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0)
    printf("mpi_ring: %d ranks, %s\n", size, worst ? "FAILED" : "ok");
  MPI_Finalize();
  return worst ? 1 : 0;
}
