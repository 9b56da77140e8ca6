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
 *   ... or, between any two ranks, on this machine or not:
 *   gpuipc_mpi_send(g, dev_ptr, bytes, dest, tag, stream, NULL) /
 *   gpuipc_mpi_recv(g, dev_ptr, bytes, source, tag, stream, NULL)
 *   gpuipc_mpi_finalize(g);                           (collective)
 *
 * Ranks are grouped by machine with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED),
 * and gpuipc checks what MPI says against the kernel's boot id: ranks with
 * different boot ids are on different machines, whatever MPI's grouping,
 * and GPU memory cannot be shared with them through CUDA IPC. The helper
 * never fakes that: gpuipc_mpi_get_conn() returns NULL for such a rank and
 * gpuipc_mpi_peer_check() says GPUIPC_E_FOREIGN_MACHINE. Across machines,
 * gpuipc_mpi_send / gpuipc_mpi_recv (below) move device buffers through
 * MPI itself (directly when the library is CUDA-aware, else staged through
 * pinned host memory).
 *
 * Connections are made by name (gpuipc_listen / gpuipc_connect in the
 * runtime directory of opts, or the default) between every pair of ranks of
 * one machine (two per pair: the one gpuipc_mpi_get_conn returns, for the
 * application alone, and one of gpuipc_mpi_send / recv's own), so they
 * carry file descriptors: memory-pool and VMM buffers
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
 * thread-safe; each connection follows conn.h's rules; gpuipc_mpi_send /
 * recv on one gpuipc_mpi from one thread at a time.
 */
#ifndef GPUIPC_MPI_H
#define GPUIPC_MPI_H

#include <mpi.h>

#include "gpuipc.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpuipc_mpi gpuipc_mpi;

/*
 * Collective over comm. Groups the ranks by machine, checks each group's
 * boot ids, connects every pair of ranks of this rank's group, and
 * duplicates comm three times for gpuipc_mpi_send / recv (MPI_Comm_dup). opts:
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
 * pointing to gpuipc_mpi_send / recv (or CUDA-aware MPI / UCX / NCCL),
 * when it is on another machine;
 * GPUIPC_E_INVALID_ARG for this rank itself or a rank out of range.
 */
gpuipc_status gpuipc_mpi_peer_check(const gpuipc_mpi *g, int rank);

/* The connection to rank `rank` (of the communicator given to init), owned
 * by g; NULL when gpuipc_mpi_peer_check() is not GPUIPC_OK for it. */
gpuipc_conn *gpuipc_mpi_get_conn(const gpuipc_mpi *g, int rank);

/* ------------------------------------------------------------------------ */
/* Sending device buffers between any two ranks                             */
/* ------------------------------------------------------------------------ */

/*
 * gpuipc_mpi_send / gpuipc_mpi_recv move `bytes` bytes of device memory
 * from one rank's buffer into another rank's buffer, MPI_Send / MPI_Recv
 * style, whichever machines the two ranks run on. The data always lands in
 * the receiver's own buffer (the receiver never gets a view of the
 * sender's memory), and both sides order the transfer on the stream they
 * pass (a CUstream / cudaStream_t of the buffer's device's primary
 * context; NULL: the legacy default stream):
 *   - the data sent is what `buf` holds once the work the sender enqueued
 *     on its stream before the call has run;
 *   - the receiver's work enqueued on its stream after gpuipc_mpi_recv
 *     returns sees the data; its work enqueued before the call has run
 *     before the data is written;
 *   - when gpuipc_mpi_send returns, `buf` may be overwritten by work the
 *     sender enqueues on its stream after the call (the host may also
 *     free it once that stream has passed that point).
 * Both calls block the host like MPI_Send / MPI_Recv of a large message
 * (rendezvous): until the peer has called its side, and until the transfer
 * is done or, on the node-local path, enqueued on both streams.
 *
 * Paths (the sender picks, the header tells the receiver;
 * gpuipc_mpi_transfer_info.path says which was taken):
 *   GPUIPC_MPI_PATH_LOCAL: the peer is on this machine (gpuipc_mpi_get_conn
 *     is not NULL). The sender shares `buf` itself over a private gpuipc
 *     connection (gpuipc_buffer_wrap: cudaMalloc / cuMemAlloc memory,
 *     memory of a pool with POSIX fd export, VMM with fd export), the
 *     receiver copies it into its buffer on its stream, GPU to GPU, one
 *     copy, no host memory, ordered on both streams by the connection's
 *     flag words; the sender's stream then waits (on the GPU) for the
 *     receiver's copy. Memory the driver cannot share this way (cudaMallocAsync
 *     of the default pool, for one) takes one of the MPI paths below.
 *     Cost: the wrap, export and import of the buffer per message (tens of
 *     microseconds), so it suits buffers of a few hundred KiB and more.
 *   GPUIPC_MPI_PATH_CUDA_AWARE: the MPI library is CUDA-aware (asked at run
 *     time: MPIX_Query_cuda_support where the library has it): device
 *     pointers go straight to MPI, in chunks. Each side first waits on the
 *     host for its stream's earlier work (MPI knows no streams).
 *   GPUIPC_MPI_PATH_STAGED: otherwise. The buffer travels through pinned
 *     host memory in chunks, with copy engines (gpuipc_xfer) on the
 *     caller's stream and MPI_Isend / MPI_Irecv, GPUIPC_MPI_STAGING_SLOTS
 *     chunks in flight, so that the device<->host copy of one chunk
 *     overlaps the MPI transfer of others. Either side decides alone
 *     whether it stages (one side may be CUDA-aware and the other not);
 *     the two agree on the chunk size in the header exchange.
 *   The MPI paths complete on the host before the call returns.
 *
 * Matching: a send to rank `dest` with `tag` is received by a
 * gpuipc_mpi_recv from that rank (or MPI_ANY_SOURCE) with that tag (or
 * MPI_ANY_TAG), in send order, as in MPI; tag is 0..MPI_TAG_UB. These
 * messages travel on communicators of their own (duplicated by
 * gpuipc_mpi_init), so they never match the application's MPI messages
 * and the application's never match them.
 *
 * Errors (both sides always learn the outcome; nothing hangs on a
 * mismatch): each side first sends the other a small header (size, chunk
 * size, its own status), so
 *   - sizes that differ are GPUIPC_E_TRUNCATED on both sides (a larger
 *     receive buffer too: a size mismatch is a bug), with a message naming
 *     both sizes, ranks and the tag, and no data moved;
 *   - a side that fails before the data moves (a pointer that is not device
 *     memory: GPUIPC_E_INVALID_ARG) fails the other side with
 *     GPUIPC_E_CANCELED (the message says why);
 *   - a failure while data moves (a driver error) is returned where it
 *     happened and makes the other side return GPUIPC_E_CANCELED: the
 *     exchange still runs to its end (the last step is a status exchange),
 *     and the receiver's buffer then holds partial data.
 * bytes == 0 sends and receives nothing but the headers (buf may be NULL).
 * A dest / source that is this rank or out of range is GPUIPC_E_INVALID_ARG
 * (returned at once, nothing sent).
 *
 * Environment (testing aids and overrides, read by gpuipc_mpi_init):
 *   GPUIPC_MPI_CUDA_AWARE=0|1   force the library to be taken as not
 *                               CUDA-aware / CUDA-aware (1 with an MPI that
 *                               is not only works where device memory is
 *                               host-addressable, as on the emulator);
 *   GPUIPC_MPI_LOCAL=0          never take the node-local path;
 *   GPUIPC_MPI_CHUNK_BYTES=n    the chunk of the MPI paths (at least 4096;
 *                               default: see gpuipc_mpi_get_chunk_bytes).
 *
 * Threads: calls on one gpuipc_mpi from one thread at a time.
 */
typedef enum gpuipc_mpi_path {
  GPUIPC_MPI_PATH_NONE = 0,       /* nothing moved (an error before data) */
  GPUIPC_MPI_PATH_LOCAL = 1,      /* gpuipc connection, same machine */
  GPUIPC_MPI_PATH_CUDA_AWARE = 2, /* device pointers to MPI */
  GPUIPC_MPI_PATH_STAGED = 3      /* through pinned host memory */
} gpuipc_mpi_path;

/* "none", "local", "cuda-aware", "staged". */
const char *gpuipc_mpi_path_name(gpuipc_mpi_path path);

/* Chunks of the staged path in flight per call (pinned host slots). */
#define GPUIPC_MPI_STAGING_SLOTS 4

/* What one send or receive did (optional OUT of both calls). */
typedef struct gpuipc_mpi_transfer_info {
  size_t size;          /* sizeof(gpuipc_mpi_transfer_info): set by INIT */
  int peer;             /* the other rank (the source, for MPI_ANY_SOURCE) */
  int tag;              /* the tag (the sender's, for MPI_ANY_TAG) */
  size_t bytes;         /* the sender's size */
  gpuipc_mpi_path path; /* how the data went (this side's view: a
                           receiver that stages from a CUDA-aware sender
                           says STAGED) */
  size_t chunk_bytes;   /* chunk of the MPI paths (0 on the local path) */
} gpuipc_mpi_transfer_info;
#define GPUIPC_MPI_TRANSFER_INFO_INIT                                          \
  {sizeof(gpuipc_mpi_transfer_info), -1, -1, 0, GPUIPC_MPI_PATH_NONE, 0}

/*
 * Sends `bytes` bytes of device memory at `buf` to rank `dest` (of the
 * communicator given to gpuipc_mpi_init) with `tag`, ordered on `stream`
 * as described above. info may be NULL.
 */
gpuipc_status gpuipc_mpi_send(gpuipc_mpi *g, const void *buf, size_t bytes,
                              int dest, int tag, struct CUstream_st *stream,
                              gpuipc_mpi_transfer_info *info /* OUT */);

/*
 * Receives into `bytes` bytes of device memory at `buf` a message from
 * rank `source` (or MPI_ANY_SOURCE) with `tag` (or MPI_ANY_TAG), ordered on
 * `stream` as described above. The sizes must match. info may be NULL.
 */
gpuipc_status gpuipc_mpi_recv(gpuipc_mpi *g, void *buf, size_t bytes,
                              int source, int tag, struct CUstream_st *stream,
                              gpuipc_mpi_transfer_info *info /* OUT */);

/* 1 when this rank takes its MPI library as CUDA-aware (after the
 * GPUIPC_MPI_CUDA_AWARE override), else 0. */
int gpuipc_mpi_is_cuda_aware(const gpuipc_mpi *g);

/* The chunk size this rank proposes for an MPI-path transfer of `bytes`
 * bytes: GPUIPC_MPI_CHUNK_BYTES when set, else bytes / 8 rounded up to
 * 64 KiB, at least 256 KiB, at most 4 MiB (8 chunks or more keep the
 * pipeline's fill and drain small from 2 MiB on; 4 slots of 4 MiB pin
 * 16 MiB). The transfer uses the smaller of the two sides' proposals. */
size_t gpuipc_mpi_get_chunk_bytes(const gpuipc_mpi *g, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_MPI_H */
