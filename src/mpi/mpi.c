/*
 * mpi.c: owns the MPI helper (library gpuipc_mpi, built only where MPI is
 * found): groups the ranks of a communicator by machine, checks MPI's
 * grouping against the kernel's boot ids, and connects every pair of ranks
 * of one machine with gpuipc connections.
 *
 * Connecting without deadlock: every rank of a machine listens first (an
 * MPI_Allreduce over the machine's ranks makes sure all listen, and
 * agrees on a failure to), then each connects to the local ranks below it
 * in order and accepts the local ranks above it. A connect completes when
 * its peer accepts; the lowest rank only accepts, and each rank's connects
 * wait only on ranks below it, which accept once their own connects (to
 * ranks further below) are done, so no cycle can form. The connecting
 * side says who it is, and which of its two connections this is, in its
 * first user message: each pair has one connection for the application
 * (gpuipc_mpi_get_conn) and one of gpuipc_mpi_send / recv's own
 * (sendrecv.c), so that neither ever takes a buffer meant for the other.
 * Init also duplicates the caller's communicator three times for
 * sendrecv.c's messages. GPUIPC_MPI_SIMULATE_MACHINES (testing only)
 * makes the ranks pretend to run on several machines.
 */
#include "core/core.h"

#include "mpi_int.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


static void format_boot_id(const uint8_t *b, char out[33]) {
  for (int i = 0; i < 16; i++)
    snprintf(out + 2 * i, 3, "%02x", b[i]);
}

static void free_g(gpuipc_mpi *g) {
  if (g == NULL)
    return;
  gpuipc__mpi_sendrecv_free(g);
  for (int i = 0; i < g->local_size; i++) {
    if (g->conns)
      gpuipc_conn_close(g->conns[i]);
    if (g->priv)
      gpuipc_conn_close(g->priv[i]);
  }
  MPI_Comm *comms[] = {&g->local, &g->c_s2r, &g->c_r2s, &g->c_data};
  for (size_t i = 0; i < sizeof comms / sizeof comms[0]; i++)
    if (*comms[i] != MPI_COMM_NULL)
      MPI_Comm_free(comms[i]);
  free(g->conns);
  free(g->priv);
  free(g->machine_of);
  free(g->local_of);
  free(g->boot_ids);
  free(g);
}

GPUIPC__PARAM(mpi_simulate, "GPUIPC_MPI_SIMULATE_MACHINES",
              GPUIPC__PARAM_EACH_USE, NULL,
              "testing only: pretend the ranks are spread over this many "
              "machines (rank % k); read at each gpuipc_mpi_init")

/* Every rank of the local group learns whether all succeeded: the worst
 * status wins, and the ranks that did not fail themselves say which did. */
static gpuipc_status agree(gpuipc_mpi *g, gpuipc_status mine) {
  int in[2] = {mine != GPUIPC_OK ? 1 : 0, (int)mine};
  int out[2] = {0, 0};
  if (MPI_Allreduce(in, out, 2, MPI_INT, MPI_MAX, g->local) != MPI_SUCCESS)
    return gpuipc__fail(GPUIPC_E_SYSTEM, "gpuipc_mpi_init: MPI_Allreduce");
  if (out[0] == 0)
    return GPUIPC_OK;
  if (mine != GPUIPC_OK)
    return mine;
  return gpuipc__fail((gpuipc_status)out[1],
                      "gpuipc_mpi_init: another rank of this machine failed "
                      "to connect (%s)",
                      gpuipc_status_name((gpuipc_status)out[1]));
}

static gpuipc_status connect_all(gpuipc_mpi *g,
                                 const gpuipc_conn_options *opts,
                                 uint64_t token) {
  char name[GPUIPC_CONN_NAME_MAX];
  snprintf(name, sizeof name, "mpi-%016llx-%d", (unsigned long long)token,
           g->local_rank);
  gpuipc_listener *l = NULL;
  gpuipc_status s = gpuipc_listen(name, opts, &l);
  /* Everyone must listen before anyone connects; a failure to listen is
   * agreed on right here. */
  s = agree(g, s);
  if (s != GPUIPC_OK) {
    gpuipc_listener_close(l);
    return s;
  }
  /* Connect to every rank below, in order: two connections each, the
   * application's (channel 0) and gpuipc_mpi_send / recv's (channel 1). */
  for (int i = 0; i < g->local_rank && s == GPUIPC_OK; i++) {
    snprintf(name, sizeof name, "mpi-%016llx-%d", (unsigned long long)token,
             i);
    for (int ch = 0; ch < 2 && s == GPUIPC_OK; ch++) {
      gpuipc_conn **slot = ch == 0 ? &g->conns[i] : &g->priv[i];
      s = gpuipc_connect(name, opts, slot);
      if (s == GPUIPC_OK) {
        int32_t me[2] = {g->local_rank, ch};
        s = gpuipc_conn_send_msg(*slot, me, sizeof me, NULL, 0);
      }
    }
    if (s != GPUIPC_OK) {
      char why[256];
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
      s = gpuipc__fail(s, "gpuipc_mpi_init: local rank %d connecting to "
                          "local rank %d: %s",
                       g->local_rank, i, why);
    }
  }
  /* Accept every rank above, twice: they say who they are and which
   * channel this is. */
  for (int k = 2 * (g->local_rank + 1); k < 2 * g->local_size && s == GPUIPC_OK;
       k++) {
    gpuipc_conn *c = NULL;
    s = gpuipc_accept(l, &c);
    int32_t who[2] = {-1, -1};
    size_t len = 0;
    if (s == GPUIPC_OK)
      s = gpuipc_conn_recv_msg(c, who, sizeof who, &len, NULL, NULL);
    gpuipc_conn **slot = NULL;
    if (s == GPUIPC_OK && len == sizeof who && who[0] > g->local_rank &&
        who[0] < g->local_size && (who[1] == 0 || who[1] == 1))
      slot = who[1] == 0 ? &g->conns[who[0]] : &g->priv[who[0]];
    if (s == GPUIPC_OK && (slot == NULL || *slot != NULL))
      s = gpuipc__fail(GPUIPC_E_PROTOCOL,
                       "gpuipc_mpi_init: a peer introduced itself as local "
                       "rank %d channel %d (%zu bytes)",
                       (int)who[0], (int)who[1], len);
    if (s != GPUIPC_OK) {
      gpuipc_conn_close(c);
      char why[256];
      snprintf(why, sizeof why, "%s", gpuipc_last_error());
      s = gpuipc__fail(s, "gpuipc_mpi_init: local rank %d accepting: %s",
                       g->local_rank, why);
      break;
    }
    *slot = c;
  }
  gpuipc_listener_close(l);
  return agree(g, s);
}

gpuipc_status gpuipc_mpi_init(MPI_Comm comm, const gpuipc_conn_options *opts,
                              gpuipc_mpi **out) {
  if (out == NULL || comm == MPI_COMM_NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_mpi_init: NULL out or MPI_COMM_NULL");
  *out = NULL;
  gpuipc_mpi *g = calloc(1, sizeof *g);
  if (g == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_mpi_init");
  g->comm = comm;
  g->local = g->c_s2r = g->c_r2s = g->c_data = MPI_COMM_NULL;
  g->timeout_ms = opts && opts->size >= offsetof(gpuipc_conn_options, timeout_ms) +
                                           sizeof opts->timeout_ms
                      ? opts->timeout_ms
                      : 10000;
  gpuipc_status s = GPUIPC_OK;
  MPI_Comm_rank(comm, &g->rank);
  MPI_Comm_size(comm, &g->size);
  /* A testing aid: GPUIPC_MPI_SIMULATE_MACHINES=k pretends the ranks run
   * on k machines (rank % k), each with its own boot id, so that one
   * machine can exercise the cross-machine reporting. */
  const char *sim_env = param_mpi_simulate();
  int sim = sim_env ? atoi(sim_env) : 0;
  if (sim > 1)
    GPUIPC__WARN("mpi", "GPUIPC_MPI_SIMULATE_MACHINES=%d: pretending the "
                 "ranks run on %d machines", sim, sim);
  int split = sim > 1 ? MPI_Comm_split(comm, g->rank % sim, g->rank, &g->local)
                      : MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, g->rank,
                                            MPI_INFO_NULL, &g->local);
  if (split != MPI_SUCCESS) {
    s = gpuipc__fail(GPUIPC_E_SYSTEM,
                     "gpuipc_mpi_init: MPI_Comm_split_type failed");
    goto fail;
  }
  MPI_Comm_rank(g->local, &g->local_rank);
  MPI_Comm_size(g->local, &g->local_size);

  /* Boot ids of everyone: which ranks really share a machine. A rank
   * that cannot read its boot id contributes zeros (it then matches
   * nobody, which is what the check below reports). */
  uint8_t mine[16];
  memset(mine, 0, sizeof mine);
  gpuipc_status bs = gpuipc__boot_id(mine);
  if (sim > 1)
    mine[15] ^= (uint8_t)(1 + g->rank % sim);
  g->boot_ids = calloc((size_t)g->size, 16);
  g->machine_of = calloc((size_t)g->size, sizeof(int));
  g->local_of = calloc((size_t)g->size, sizeof(int));
  g->conns = calloc((size_t)g->local_size, sizeof *g->conns);
  g->priv = calloc((size_t)g->local_size, sizeof *g->priv);
  int *local_ranks = calloc((size_t)g->local_size, sizeof(int));
  if (!g->boot_ids || !g->machine_of || !g->local_of || !g->conns ||
      !g->priv || !local_ranks) {
    free(local_ranks);
    s = gpuipc__fail(GPUIPC_E_NO_MEMORY, "gpuipc_mpi_init");
    goto fail; /* collective calls below would hang the others: MPI's
                  own out-of-memory handling applies there anyway */
  }
  MPI_Allgather(mine, 16, MPI_BYTE, g->boot_ids, 16, MPI_BYTE, comm);
  /* Communicators of gpuipc_mpi_send / recv's own. Collective over comm:
   * made here, where every rank of comm still takes part (later failures
   * are agreed on within one machine only). */
  int dup_ok = MPI_Comm_dup(comm, &g->c_s2r) == MPI_SUCCESS &&
               MPI_Comm_dup(comm, &g->c_r2s) == MPI_SUCCESS &&
               MPI_Comm_dup(comm, &g->c_data) == MPI_SUCCESS;
  /* Machines, numbered by first appearance. */
  g->machines = 0;
  for (int r = 0; r < g->size; r++) {
    int m = -1;
    for (int q = 0; q < r && m < 0; q++)
      if (memcmp(g->boot_ids + 16 * q, g->boot_ids + 16 * r, 16) == 0)
        m = g->machine_of[q];
    g->machine_of[r] = m >= 0 ? m : g->machines++;
    g->local_of[r] = -1;
  }
  /* Local ranks: which rank of comm is which local rank. */
  MPI_Allgather(&g->rank, 1, MPI_INT, local_ranks, 1, MPI_INT, g->local);
  for (int i = 0; i < g->local_size; i++)
    if (local_ranks[i] >= 0 && local_ranks[i] < g->size)
      g->local_of[local_ranks[i]] = i;
  /* MPI's shared-memory group must be one machine. */
  gpuipc_status check = bs;
  if (!dup_ok && check == GPUIPC_OK)
    check = gpuipc__fail(GPUIPC_E_SYSTEM, "gpuipc_mpi_init: MPI_Comm_dup failed");
  for (int i = 0; i < g->local_size && check == GPUIPC_OK; i++) {
    int r = local_ranks[i];
    if (g->machine_of[r] != g->machine_of[g->rank]) {
      char a[33], b[33];
      format_boot_id(g->boot_ids + 16 * g->rank, a);
      format_boot_id(g->boot_ids + 16 * r, b);
      check = gpuipc__fail(GPUIPC_E_FOREIGN_MACHINE,
                           "gpuipc_mpi_init: MPI groups rank %d with rank %d "
                           "as one shared-memory node, but their boot ids "
                           "differ (%s vs %s): they run on different "
                           "machines (or kernels), where CUDA IPC cannot "
                           "share memory; use CUDA-aware MPI, UCX or NCCL "
                           "between them",
                           g->rank, r, a, b);
    }
  }
  free(local_ranks);
  s = agree(g, check);
  if (s != GPUIPC_OK)
    goto fail;

  /* A token naming this job's sockets: rank 0 of the machine picks it. */
  uint64_t token = 0;
  if (g->local_rank == 0)
    token = (gpuipc__now_ns() << 16) ^ ((uint64_t)getpid() << 1) ^
            ((uint64_t)(uintptr_t)g);
  MPI_Bcast(&token, 1, MPI_UINT64_T, 0, g->local);
  s = connect_all(g, opts, token);
  if (s != GPUIPC_OK)
    goto fail;
  gpuipc__mpi_sendrecv_init(g);
  *out = g;
  return GPUIPC_OK;
fail:
  free_g(g);
  return s;
}

void gpuipc_mpi_finalize(gpuipc_mpi *g) {
  if (g == NULL)
    return;
  /* Nobody closes while a peer may still be reading its last messages. */
  if (g->local != MPI_COMM_NULL)
    MPI_Barrier(g->local);
  free_g(g);
}

int gpuipc_mpi_get_rank(const gpuipc_mpi *g) { return g ? g->rank : -1; }
int gpuipc_mpi_get_size(const gpuipc_mpi *g) { return g ? g->size : 0; }
int gpuipc_mpi_get_local_rank(const gpuipc_mpi *g) {
  return g ? g->local_rank : -1;
}
int gpuipc_mpi_get_local_size(const gpuipc_mpi *g) {
  return g ? g->local_size : 0;
}
MPI_Comm gpuipc_mpi_get_local_comm(const gpuipc_mpi *g) {
  return g ? g->local : MPI_COMM_NULL;
}
int gpuipc_mpi_get_machines(const gpuipc_mpi *g) { return g ? g->machines : 0; }
int gpuipc_mpi_get_machine_of(const gpuipc_mpi *g, int rank) {
  return g && rank >= 0 && rank < g->size ? g->machine_of[rank] : -1;
}

gpuipc_status gpuipc_mpi_peer_check(const gpuipc_mpi *g, int rank) {
  if (g == NULL || rank < 0 || rank >= g->size)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_mpi_peer_check: rank %d out of range", rank);
  if (rank == g->rank)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_mpi_peer_check: rank %d is this rank", rank);
  if (g->machine_of[rank] != g->machine_of[g->rank] || g->local_of[rank] < 0) {
    char a[33], b[33];
    format_boot_id(g->boot_ids + 16 * g->rank, a);
    format_boot_id(g->boot_ids + 16 * rank, b);
    return gpuipc__fail(GPUIPC_E_FOREIGN_MACHINE,
                        "rank %d runs on another machine than rank %d (boot "
                        "id %s vs %s): CUDA IPC cannot share GPU memory "
                        "across machines; move buffers with gpuipc_mpi_send "
                        "/ recv (through MPI), or CUDA-aware MPI, UCX or NCCL",
                        rank, g->rank, b, a);
  }
  return GPUIPC_OK;
}

gpuipc_conn *gpuipc_mpi_get_conn(const gpuipc_mpi *g, int rank) {
  if (g == NULL || rank < 0 || rank >= g->size || rank == g->rank)
    return NULL;
  if (g->machine_of[rank] != g->machine_of[g->rank])
    return NULL;
  int l = g->local_of[rank];
  return l >= 0 ? g->conns[l] : NULL;
}
