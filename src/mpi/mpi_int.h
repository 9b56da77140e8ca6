/*
 * mpi_int.h: the MPI helper's private state, shared by mpi.c (init, the
 * node's connections, accessors) and sendrecv.c (gpuipc_mpi_send / recv).
 */
#ifndef GPUIPC_MPI_INT_H
#define GPUIPC_MPI_INT_H

#include "gpuipc/mpi.h"

#include <stdint.h>

/* What sendrecv.c keeps per local device, made on first use. */
typedef struct gpuipc__mpi_dev {
  gpuipc_xfer *x;                              /* copy engine */
  gpuipc_event *ev[GPUIPC_MPI_STAGING_SLOTS];  /* one per staging slot */
} gpuipc__mpi_dev;

struct gpuipc_mpi {
  MPI_Comm comm;       /* the caller's (not owned) */
  MPI_Comm local;      /* this machine's ranks (owned) */
  /* Duplicates of comm for gpuipc_mpi_send / recv (owned): headers and the
   * sender's final status (sender -> receiver), replies and the receiver's
   * final status (receiver -> sender), data chunks. */
  MPI_Comm c_s2r, c_r2s, c_data;
  int rank, size;
  int local_rank, local_size;
  int machines;
  int *machine_of;     /* [size]: machine index of each rank */
  int *local_of;       /* [size]: local rank of each rank, -1 elsewhere */
  uint8_t *boot_ids;   /* [size][16] */
  gpuipc_conn **conns; /* [local_size], NULL for this rank: the user's */
  gpuipc_conn **priv;  /* [local_size]: gpuipc_mpi_send / recv's own */
  int timeout_ms;      /* of the connections (-1: forever) */
  /* gpuipc_mpi_send / recv */
  int cuda_aware;      /* take the MPI library as CUDA-aware */
  int local_path;      /* 0: never the node-local path */
  size_t chunk_env;    /* GPUIPC_MPI_CHUNK_BYTES, 0 when unset */
  int ndev;            /* entries of dev (0 until first needed) */
  gpuipc__mpi_dev *dev;
  gpuipc_pool *stage_pool;  /* PINNED_HOST, made on first staged transfer */
  gpuipc_buffer *stage;     /* GPUIPC_MPI_STAGING_SLOTS slots */
  size_t stage_slot;        /* bytes per slot of stage */
};

/* sendrecv.c: reads the environment and asks MPI whether it is
 * CUDA-aware (called by gpuipc_mpi_init), and frees what send / recv made
 * (called when g is freed). */
void gpuipc__mpi_sendrecv_init(gpuipc_mpi *g);
void gpuipc__mpi_sendrecv_free(gpuipc_mpi *g);

#endif /* GPUIPC_MPI_INT_H */
