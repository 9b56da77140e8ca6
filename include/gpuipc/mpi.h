/*
 * gpuipc/mpi.h: the MPI helper: connects the ranks of an MPI program that
 * share a machine with gpuipc connections, so that they can hand GPU
 * buffers to each other in a few calls.
 *
 * Not included from gpuipc.h: include it after <mpi.h> and <gpuipc.h>, and
 * link the static library gpuipc_mpi together with the static gpuipc
 * (CMake: target gpuipc::gpuipc_mpi; it is built only where MPI was found,
 * and libgpuipc itself never depends on MPI).
 *
 *   MPI_Init(&argc, &argv);
 *   gpuipc_mpi *g;
 *   gpuipc_mpi_init(MPI_COMM_WORLD, NULL, &g);       (collective)
 *   gpuipc_conn *c = gpuipc_mpi_get_conn(g, peer_rank);   (a rank on this node)
 *   gpuipc_conn_send_buffer(c, buf, ...) / gpuipc_conn_recv(c, ...)  (conn.h)
 *   ... or arena blocks: gpuipc_conn_send / gpuipc_conn_recv ...
 *   gpuipc_mpi_finalize(g);                           (collective)
 *
 * Ranks are grouped by machine with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED),
 * and gpuipc checks what MPI says against the kernel's boot id: ranks with
 * different boot ids are on different machines, whatever MPI's grouping,
 * and GPU memory cannot be shared with them through CUDA IPC. The helper
 * never fakes that: gpuipc_mpi_get_conn() returns NULL for such a rank and
 * gpuipc_mpi_peer_check() says GPUIPC_E_FOREIGN_MACHINE. Across machines use
 * CUDA-aware MPI, UCX or NCCL.
 *
 * Connections are made by name (gpuipc_listen / gpuipc_connect in the
 * runtime directory of opts, or the default) between every pair of ranks of
 * one machine, so they carry file descriptors: memory-pool and VMM buffers
 * travel as well as legacy ones. Descriptors of LEGACY buffers need no fd
 * and may also travel in plain MPI messages (examples/mpi_hello.c).
 *
 * Testing aid: GPUIPC_MPI_SIMULATE_MACHINES=k makes gpuipc_mpi_init
 * pretend the ranks run on k machines (rank % k), each with a boot id of
 * its own, so that the cross-machine reporting can be exercised on one
 * machine. Never set it in production.
 *
 * Thread safety: gpuipc_mpi_init and gpuipc_mpi_finalize are collective
 * over the communicator and follow MPI's threading rules; the accessors are
 * thread-safe; each connection follows conn.h's rules.
 */
#ifndef GPUIPC_MPI_H
#define GPUIPC_MPI_H

#include <mpi.h>

#include "gpuipc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpuipc_mpi gpuipc_mpi;

/*
 * Collective over comm. Groups the ranks by machine, checks each group's
 * boot ids, and connects every pair of ranks of this rank's group. opts:
 * options of the connections (NULL: defaults; the timeout bounds each
 * connect and accept). Needs no CUDA.
 * Returns GPUIPC_E_FOREIGN_MACHINE when MPI put ranks with different boot
 * ids into one shared-memory group (the message names them), connection
 * errors otherwise; in either case every rank of the group fails (the
 * outcome is agreed on with an MPI_Allreduce), so no rank is left waiting.
 * On success *g is owned by the caller: gpuipc_mpi_finalize().
 */
gpuipc_status gpuipc_mpi_init(MPI_Comm comm, const gpuipc_conn_options *opts,
                              gpuipc_mpi **g /* OUT */);

/* Collective over the communicator given to gpuipc_mpi_init: closes the
 * connections and frees g. NULL is a no-op (and not collective). */
void gpuipc_mpi_finalize(gpuipc_mpi *g);

/* This rank's rank and the size of the communicator given to init. */
int gpuipc_mpi_get_rank(const gpuipc_mpi *g);
int gpuipc_mpi_get_size(const gpuipc_mpi *g);
/* This rank's index among the ranks of its machine, and their number. */
int gpuipc_mpi_get_local_rank(const gpuipc_mpi *g);
int gpuipc_mpi_get_local_size(const gpuipc_mpi *g);
/* The communicator of this machine's ranks (owned by g). */
MPI_Comm gpuipc_mpi_get_local_comm(const gpuipc_mpi *g);
/* Number of distinct machines (boot ids) among all ranks, and the index
 * (0..) of the machine of rank r (-1 when out of range). Ranks on one
 * machine have the same index. */
int gpuipc_mpi_get_machines(const gpuipc_mpi *g);
int gpuipc_mpi_get_machine_of(const gpuipc_mpi *g, int rank);

/*
 * Can this rank share GPU memory with rank `rank` (of the communicator
 * given to init)? GPUIPC_OK when it is on this machine and is not this
 * rank; GPUIPC_E_FOREIGN_MACHINE, with a message naming both boot ids and
 * pointing to CUDA-aware MPI / UCX / NCCL, when it is on another machine;
 * GPUIPC_E_INVALID_ARG for this rank itself or a rank out of range.
 */
gpuipc_status gpuipc_mpi_peer_check(const gpuipc_mpi *g, int rank);

/* The connection to rank `rank` (of the communicator given to init), owned
 * by g; NULL when gpuipc_mpi_peer_check() is not GPUIPC_OK for it. */
gpuipc_conn *gpuipc_mpi_get_conn(const gpuipc_mpi *g, int rank);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_MPI_H */
