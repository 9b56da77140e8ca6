/*
 * sendrecv.c: owns gpuipc_mpi_send / gpuipc_mpi_recv: device buffers
 * between any two ranks, over the node's private gpuipc connection
 * (same machine), straight through a CUDA-aware MPI, or staged through
 * pinned host memory in overlapping chunks (gpuipc_xfer copies on the
 * caller's stream, MPI_Isend / MPI_Irecv of other chunks meanwhile).
 *
 * One transfer, on three communicators that gpuipc_mpi_init duplicated
 * from its communicator (c_s2r: sender -> receiver, c_r2s: receiver ->
 * sender, c_data: chunks), all messages with the caller's tag:
 *   1. sender -> receiver: header (magic, version, size, chunk proposal,
 *      path, the sender's status so far);
 *   2. receiver -> sender: reply (its size, the agreed chunk: the smaller
 *      proposal, its status). A size mismatch or a failure of either side
 *      ends both calls here, with nothing moved;
 *   3. the data: chunks on c_data (MPI paths) or, on the local path, the
 *      sender's memory itself, wrapped and sent on the private connection
 *      (gpuipc_conn_send_buffer), which the receiver copies into its own
 *      buffer on its stream. Memory the driver wraps but will not export
 *      takes an MPI path, decided before the header is sent;
 *   4. sender -> receiver, then receiver -> sender: each side's status of
 *      step 3, so a failure on one side is known on the other. On the
 *      local path the receiver takes the buffer only after the sender's
 *      status said it was sent, and releases it before it answers; the
 *      sender then waits (host, bounded by the connection's timeout) for
 *      that release and orders its stream after the receiver's copy.
 * The only driver call made here is the pointer's device lookup
 * (cuPointerGetAttribute); everything else is the public API.
 */
#include "core/core.h"

#include "mpi_int.h"

#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#define HDR_MAGIC 0x4d504947u /* "GIPM" */
#define HDR_VERSION 1u
#define META_MAGIC 0x4d504947u

typedef struct wire_hdr {
  uint32_t magic, version;
  uint64_t bytes;
  uint64_t chunk;
  int32_t status; /* GPUIPC_OK, or why this side gives up */
  int32_t path;   /* sender: the path it takes */
} wire_hdr;

typedef struct wire_meta {
  uint32_t magic;
  int32_t tag;
  uint64_t bytes;
} wire_meta;

/* ---- setup ------------------------------------------------------------------------- */

/* Does the MPI library say it is CUDA-aware? MPIX_Query_cuda_support
 * (Open MPI's cuda extension, MPICH 4) answers at run time; it is looked
 * up by name in the loaded program, so that a library without it (or a
 * header without its declaration) builds and says no. A header whose
 * MPIX_CUDA_AWARE_SUPPORT is 0 still gets the run-time answer: the
 * library run may not be the one built against. */
static int query_cuda_aware(void) {
  int (*fn)(void) = NULL;
  void *sym = dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support");
  memcpy(&fn, &sym, sizeof fn);
  return fn != NULL && fn() == 1;
}

GPUIPC__PARAM(mpi_cuda_aware, "GPUIPC_MPI_CUDA_AWARE", GPUIPC__PARAM_EACH_USE,
              "asked of MPI",
              "0 / 1: take the MPI library as not CUDA-aware / CUDA-aware in "
              "gpuipc_mpi_send/recv; read at each gpuipc_mpi_init")
GPUIPC__PARAM(mpi_local, "GPUIPC_MPI_LOCAL", GPUIPC__PARAM_EACH_USE, "1",
              "0: gpuipc_mpi_send never takes the node-local path; read at "
              "each gpuipc_mpi_init")
GPUIPC__PARAM(mpi_chunk_bytes, "GPUIPC_MPI_CHUNK_BYTES", GPUIPC__PARAM_EACH_USE,
              "bytes/8, 256 KiB to 4 MiB",
              "chunk of the MPI paths of gpuipc_mpi_send/recv (4096 to 1 GiB); "
              "read at each gpuipc_mpi_init")

void gpuipc__mpi_sendrecv_init(gpuipc_mpi *g) {
  const char *e = param_mpi_cuda_aware();
  int forced = e != NULL && (strcmp(e, "0") == 0 || strcmp(e, "1") == 0);
  g->cuda_aware = forced ? e[0] == '1' : query_cuda_aware();
  e = param_mpi_local();
  g->local_path = !(e != NULL && strcmp(e, "0") == 0);
  e = param_mpi_chunk_bytes();
  g->chunk_env = 0;
  if (e != NULL) {
    char *end = NULL;
    unsigned long long v = strtoull(e, &end, 0);
    if (end != e && *end == '\0' && v >= 4096 && v <= ((size_t)1 << 30))
      g->chunk_env = (size_t)v;
    else
      GPUIPC__WARN("mpi", "GPUIPC_MPI_CHUNK_BYTES=%s ignored (4096..1 GiB)", e);
  }
  GPUIPC__DEBUG("mpi", "rank %d: MPI library taken as %sCUDA-aware%s", g->rank,
                g->cuda_aware ? "" : "not ",
                forced ? " (GPUIPC_MPI_CUDA_AWARE)" : "");
  /* A peer that fails part way sends short chunks; a receive into a
   * smaller buffer must come back as an error code, not abort the job. */
  MPI_Comm_set_errhandler(g->c_data, MPI_ERRORS_RETURN);
}

void gpuipc__mpi_sendrecv_free(gpuipc_mpi *g) {
  for (int d = 0; d < g->ndev; d++) {
    gpuipc_xfer_destroy(g->dev[d].x);
    for (int i = 0; i < GPUIPC_MPI_STAGING_SLOTS; i++)
      gpuipc_event_destroy(g->dev[d].ev[i]);
  }
  free(g->dev);
  g->dev = NULL;
  g->ndev = 0;
  gpuipc_buffer_free(g->stage, NULL);
  gpuipc_pool_destroy(g->stage_pool);
  g->stage = NULL;
  g->stage_pool = NULL;
}

const char *gpuipc_mpi_path_name(gpuipc_mpi_path path) {
  switch (path) {
  case GPUIPC_MPI_PATH_NONE: return "none";
  case GPUIPC_MPI_PATH_LOCAL: return "local";
  case GPUIPC_MPI_PATH_CUDA_AWARE: return "cuda-aware";
  case GPUIPC_MPI_PATH_STAGED: return "staged";
  }
  return "unknown";
}

int gpuipc_mpi_is_cuda_aware(const gpuipc_mpi *g) {
  return g ? g->cuda_aware : 0;
}

size_t gpuipc_mpi_get_chunk_bytes(const gpuipc_mpi *g, size_t bytes) {
  if (g != NULL && g->chunk_env != 0)
    return g->chunk_env;
  size_t c = (bytes / 8 + 65535) & ~(size_t)65535;
  if (c < ((size_t)256 << 10))
    c = (size_t)256 << 10;
  if (c > ((size_t)4 << 20))
    c = (size_t)4 << 20;
  return c;
}

/* The local device of device memory at p, and what send / recv keep for
 * it (copy engine, events), made on first use. */
static gpuipc_status device_of(gpuipc_mpi *g, const void *p, const char *who,
                               gpuipc__mpi_dev **out) {
  GPUIPC__CHECK(gpuipc__driver());
  int ordinal = -1;
  CUresult r = GPUIPC__CU(cuPointerGetAttribute, &ordinal,
                          CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                          (CUdeviceptr)(uintptr_t)p);
  if (r != CUDA_SUCCESS || ordinal < 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "%s: %p is not device memory known to the driver (%s)",
                        who, p, gpuipc__cuda_error_name((int)r));
  if (g->ndev == 0) {
    int n = 0;
    GPUIPC__CHECK(gpuipc_device_count(&n));
    g->dev = calloc((size_t)(n > 0 ? n : 1), sizeof *g->dev);
    if (g->dev == NULL)
      return gpuipc__fail(GPUIPC_E_NO_MEMORY, "%s", who);
    g->ndev = n;
  }
  if (ordinal >= g->ndev)
    return gpuipc__fail(GPUIPC_E_DEVICE_NOT_VISIBLE,
                        "%s: %p lives on device %d of %d", who, p, ordinal,
                        g->ndev);
  gpuipc__mpi_dev *d = &g->dev[ordinal];
  if (d->x == NULL) {
    gpuipc_uuid uuid;
    GPUIPC__CHECK(gpuipc_device_uuid(ordinal, &uuid));
    for (int i = 0; i < GPUIPC_MPI_STAGING_SLOTS; i++)
      if (d->ev[i] == NULL)
        GPUIPC__CHECK(gpuipc_event_create(&uuid, &d->ev[i]));
    /* The copy engine of the buffer's device (named by UUID). */
    GPUIPC__CHECK(gpuipc_xfer_create(&uuid, NULL, &d->x));
  }
  *out = d;
  return GPUIPC_OK;
}

/* GPUIPC_MPI_STAGING_SLOTS pinned host slots of at least `slot` bytes. */
static gpuipc_status staging(gpuipc_mpi *g, size_t slot, uint8_t **out) {
  if (g->stage == NULL || g->stage_slot < slot) {
    gpuipc_buffer_free(g->stage, NULL);
    g->stage = NULL;
    g->stage_slot = 0;
    if (g->stage_pool == NULL) {
      gpuipc_pool_options po = GPUIPC_POOL_OPTIONS_INIT;
      po.kind = GPUIPC_POOL_PINNED_HOST;
      GPUIPC__CHECK(gpuipc_pool_create(&po, &g->stage_pool));
    }
    GPUIPC__CHECK(gpuipc_buffer_alloc(
        g->stage_pool, slot * GPUIPC_MPI_STAGING_SLOTS, NULL, &g->stage));
    g->stage_slot = slot;
  }
  *out = gpuipc_buffer_get_ptr(g->stage);
  return GPUIPC_OK;
}

/* ---- the data phase of the MPI paths --------------------------------------------------- */

enum { SLOT_FREE, SLOT_COPYING, SLOT_MPI };

/* Sender, staged: chunk i goes device -> slot i % SLOTS (on the caller's
 * stream) -> MPI_Isend. A copy that fails stops the copies; the chunks are
 * still all sent (the receiver expects them), with whatever the slots hold. */
static gpuipc_status staged_send(gpuipc_mpi *g, gpuipc__mpi_dev *d,
                                 const uint8_t *src, size_t bytes, size_t chunk,
                                 int dest, int tag, struct CUstream_st *stream) {
  uint8_t *slots = NULL;
  gpuipc_status s = staging(g, chunk, &slots);
  size_t n = (bytes + chunk - 1) / chunk;
  int state[GPUIPC_MPI_STAGING_SLOTS] = {0};
  int evented[GPUIPC_MPI_STAGING_SLOTS] = {0};
  MPI_Request req[GPUIPC_MPI_STAGING_SLOTS];
  for (int i = 0; i < GPUIPC_MPI_STAGING_SLOTS; i++)
    req[i] = MPI_REQUEST_NULL;
  if (s != GPUIPC_OK) /* no staging: nothing can be sent from; the peer
                         learns it in the final status exchange, after it
                         was sent n empty chunks */
    slots = NULL;
  size_t copied = 0, sent = 0, done = 0;
  while (done < n) {
    int moved = 0;
    size_t k = copied % GPUIPC_MPI_STAGING_SLOTS;
    if (copied < n && state[k] == SLOT_FREE) {
      size_t off = copied * chunk;
      size_t len = bytes - off < chunk ? bytes - off : chunk;
      evented[k] = 0;
      if (s == GPUIPC_OK) {
        s = gpuipc_xfer_to_host(d->x, slots + k * chunk, src + off, len,
                                stream, 0);
        if (s == GPUIPC_OK)
          s = gpuipc_event_record(d->ev[k], stream);
        evented[k] = s == GPUIPC_OK;
      }
      state[k] = SLOT_COPYING;
      copied++;
      moved = 1;
    }
    k = sent % GPUIPC_MPI_STAGING_SLOTS;
    if (sent < copied && state[k] == SLOT_COPYING) {
      gpuipc_status q = evented[k] ? gpuipc_event_query(d->ev[k]) : GPUIPC_OK;
      if (q != GPUIPC_OK && q != GPUIPC_E_WOULD_BLOCK) {
        if (s == GPUIPC_OK)
          s = q;
        (void)gpuipc_event_synchronize(d->ev[k]);
        q = GPUIPC_OK;
      }
      if (q == GPUIPC_OK) {
        size_t off = sent * chunk;
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        static uint8_t none[1];
        MPI_Isend(slots ? slots + k * chunk : none, slots ? (int)len : 0,
                  MPI_BYTE, dest, tag, g->c_data, &req[k]);
        state[k] = SLOT_MPI;
        sent++;
        moved = 1;
      }
    }
    for (int i = 0; i < GPUIPC_MPI_STAGING_SLOTS; i++) {
      if (state[i] != SLOT_MPI)
        continue;
      int flag = 0;
      MPI_Test(&req[i], &flag, MPI_STATUS_IGNORE);
      if (flag) {
        state[i] = SLOT_FREE;
        done++;
        moved = 1;
      }
    }
    if (!moved)
      sched_yield();
  }
  return s;
}

/* Receiver, staged: MPI_Irecv into slot i % SLOTS -> slot -> device (on
 * the caller's stream). Waits until every copy has completed (the slots
 * are reused by the next transfer). */
static gpuipc_status staged_recv(gpuipc_mpi *g, gpuipc__mpi_dev *d,
                                 uint8_t *dst, size_t bytes, size_t chunk,
                                 int source, int tag,
                                 struct CUstream_st *stream) {
  uint8_t *slots = NULL;
  gpuipc_status s = staging(g, chunk, &slots);
  size_t n = (bytes + chunk - 1) / chunk;
  int state[GPUIPC_MPI_STAGING_SLOTS] = {0};
  int evented[GPUIPC_MPI_STAGING_SLOTS] = {0};
  MPI_Request req[GPUIPC_MPI_STAGING_SLOTS];
  for (int i = 0; i < GPUIPC_MPI_STAGING_SLOTS; i++)
    req[i] = MPI_REQUEST_NULL;
  uint8_t *sink = NULL; /* without staging, chunks are received and dropped */
  if (s != GPUIPC_OK) {
    slots = NULL;
    sink = malloc(chunk);
  }
  size_t posted = 0, landed = 0, done = 0;
  while (done < n) {
    int moved = 0;
    size_t k = posted % GPUIPC_MPI_STAGING_SLOTS;
    if (posted < n && state[k] == SLOT_FREE) {
      size_t off = posted * chunk;
      size_t len = bytes - off < chunk ? bytes - off : chunk;
      uint8_t *into = slots ? slots + k * chunk : sink;
      /* With neither staging nor a sink, only the message envelope is
       * taken (MPI_ERR_TRUNCATE is expected and ignored below). */
      MPI_Irecv(into, into ? (int)len : 0, MPI_BYTE, source, tag, g->c_data,
                &req[k]);
      state[k] = SLOT_MPI;
      posted++;
      moved = 1;
    }
    k = landed % GPUIPC_MPI_STAGING_SLOTS;
    if (landed < posted && state[k] == SLOT_MPI) {
      int flag = 0;
      MPI_Status st;
      MPI_Test(&req[k], &flag, &st);
      if (flag) {
        size_t off = landed * chunk;
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        int got = 0;
        MPI_Get_count(&st, MPI_BYTE, &got);
        evented[k] = 0;
        if (s == GPUIPC_OK && (size_t)got != len)
          s = gpuipc__fail(GPUIPC_E_CANCELED,
                           "gpuipc_mpi_recv: chunk %zu from rank %d came with "
                           "%d bytes, not %zu (the sender failed)",
                           landed, source, got, len);
        if (s == GPUIPC_OK) {
          s = gpuipc_xfer_to_device(d->x, dst + off, slots + k * chunk, len,
                                    stream, 0);
          if (s == GPUIPC_OK)
            s = gpuipc_event_record(d->ev[k], stream);
          evented[k] = s == GPUIPC_OK;
        }
        state[k] = SLOT_COPYING;
        landed++;
        moved = 1;
      }
    }
    for (int i = 0; i < GPUIPC_MPI_STAGING_SLOTS; i++) {
      if (state[i] != SLOT_COPYING)
        continue;
      gpuipc_status q = evented[i] ? gpuipc_event_query(d->ev[i]) : GPUIPC_OK;
      if (q != GPUIPC_OK && q != GPUIPC_E_WOULD_BLOCK) {
        if (s == GPUIPC_OK)
          s = q;
        (void)gpuipc_event_synchronize(d->ev[i]);
        q = GPUIPC_OK;
      }
      if (q == GPUIPC_OK) {
        state[i] = SLOT_FREE;
        done++;
        moved = 1;
      }
    }
    if (!moved)
      sched_yield();
  }
  free(sink);
  return s;
}

/* Both sides, CUDA-aware: the caller's stream is waited for on the host
 * (MPI knows no streams), then device memory goes to MPI, SLOTS chunks in
 * flight. `sending` says which way. */
static gpuipc_status direct(gpuipc_mpi *g, gpuipc__mpi_dev *d, uint8_t *p,
                            size_t bytes, size_t chunk, int peer, int tag,
                            struct CUstream_st *stream, int sending) {
  gpuipc_status s = gpuipc_event_record(d->ev[0], stream);
  if (s == GPUIPC_OK)
    s = gpuipc_event_synchronize(d->ev[0]);
  size_t n = (bytes + chunk - 1) / chunk;
  MPI_Request req[GPUIPC_MPI_STAGING_SLOTS];
  uint8_t *sink = NULL;
  if (s != GPUIPC_OK && !sending)
    sink = malloc(chunk); /* receive and drop: the peer sends anyway */
  for (size_t i = 0; i < n; i++) {
    size_t k = i % GPUIPC_MPI_STAGING_SLOTS;
    if (i >= GPUIPC_MPI_STAGING_SLOTS)
      MPI_Wait(&req[k], MPI_STATUS_IGNORE);
    size_t off = i * chunk;
    int len = (int)(bytes - off < chunk ? bytes - off : chunk);
    if (sending) {
      /* After a failure the chunks still go, empty: the receiver sees the
       * short count and the final status says why. */
      MPI_Isend(p + off, s == GPUIPC_OK ? len : 0, MPI_BYTE, peer, tag,
                g->c_data, &req[k]);
    } else {
      uint8_t *into = s == GPUIPC_OK ? p + off : sink;
      MPI_Irecv(into, into ? len : 0, MPI_BYTE, peer, tag, g->c_data, &req[k]);
    }
  }
  size_t inflight = n < GPUIPC_MPI_STAGING_SLOTS ? n : GPUIPC_MPI_STAGING_SLOTS;
  for (size_t i = n - inflight; i < n; i++) {
    MPI_Status st;
    MPI_Wait(&req[i % GPUIPC_MPI_STAGING_SLOTS], &st);
  }
  free(sink);
  return s;
}

/* ---- send / recv ----------------------------------------------------------------------- */

static gpuipc_status check_peer(const gpuipc_mpi *g, int peer, int any,
                                int tag, const char *who) {
  if (g == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: NULL gpuipc_mpi", who);
  if (!(any && peer == MPI_ANY_SOURCE) &&
      (peer < 0 || peer >= g->size || peer == g->rank))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "%s: rank %d is %s (this is rank %d of %d)", who, peer,
                        peer == g->rank ? "this rank" : "out of range", g->rank,
                        g->size);
  int *ub = NULL, flag = 0;
  MPI_Comm_get_attr(g->comm, MPI_TAG_UB, &ub, &flag);
  if (!(any && tag == MPI_ANY_TAG) &&
      (tag < 0 || (flag && ub != NULL && tag > *ub)))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: tag %d out of range (0..%d)",
                        who, tag, flag && ub ? *ub : 32767);
  return GPUIPC_OK;
}

static void fill_info(gpuipc_mpi_transfer_info *info, int peer, int tag,
                      size_t bytes, gpuipc_mpi_path path, size_t chunk) {
  if (info == NULL || info->size < sizeof *info)
    return;
  info->peer = peer;
  info->tag = tag;
  info->bytes = bytes;
  info->path = path;
  info->chunk_bytes = path == GPUIPC_MPI_PATH_LOCAL ? 0 : chunk;
}

/* The status the other side's failure gives this side. */
static gpuipc_status peer_failed(const char *who, int peer, int32_t theirs,
                                 const char *when) {
  return gpuipc__fail(GPUIPC_E_CANCELED, "%s: rank %d failed %s (%s)", who,
                      peer, when, gpuipc_status_name((gpuipc_status)theirs));
}

gpuipc_status gpuipc_mpi_send(gpuipc_mpi *g, const void *buf, size_t bytes,
                              int dest, int tag, struct CUstream_st *stream,
                              gpuipc_mpi_transfer_info *info) {
  static const char who[] = "gpuipc_mpi_send";
  GPUIPC__CHECK(check_peer(g, dest, 0, tag, who));
  fill_info(info, dest, tag, bytes, GPUIPC_MPI_PATH_NONE, 0);
  gpuipc_status s = GPUIPC_OK;
  gpuipc__mpi_dev *d = NULL;
  gpuipc_buffer *wrapped = NULL;
  gpuipc_conn *conn = NULL;
  if (bytes > 0 && buf == NULL)
    s = gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: NULL buffer of %zu bytes", who,
                     bytes);
  if (s == GPUIPC_OK && bytes > 0)
    s = device_of(g, buf, who, &d);
  /* The path: the private connection when the peer is on this machine and
   * the driver can share this memory, else MPI. */
  gpuipc_mpi_path path =
      g->cuda_aware ? GPUIPC_MPI_PATH_CUDA_AWARE : GPUIPC_MPI_PATH_STAGED;
  int l = g->local_of[dest];
  if (g->local_path && g->machine_of[dest] == g->machine_of[g->rank] &&
      l >= 0 && g->priv[l] != NULL) {
    conn = g->priv[l];
    if (bytes == 0) {
      path = GPUIPC_MPI_PATH_LOCAL;
    } else if (s == GPUIPC_OK) {
      gpuipc_status w = gpuipc_buffer_wrap((void *)(uintptr_t)buf, bytes,
                                           &wrapped);
      if (w == GPUIPC_OK) {
        /* Memory the driver wraps but will not export (the export is kept
         * by the buffer, so the send below reuses it) goes through MPI
         * too, decided before the peer is told the path. */
        uint8_t desc[GPUIPC_DESC_MAX];
        int fds[4], nfds = 4;
        size_t len = 0;
        w = gpuipc_buffer_export(wrapped, desc, sizeof desc, &len, fds, &nfds);
        for (int i = 0; w == GPUIPC_OK && i < nfds; i++)
          close(fds[i]);
        if (w != GPUIPC_OK) {
          gpuipc_buffer_free(wrapped, NULL);
          wrapped = NULL;
        }
      }
      if (w == GPUIPC_OK)
        path = GPUIPC_MPI_PATH_LOCAL;
      else
        GPUIPC__DEBUG("mpi", "%s: %p cannot be shared (%s): through MPI", who,
                      buf, gpuipc_last_error());
    }
  }
  size_t chunk = gpuipc_mpi_get_chunk_bytes(g, bytes);
  wire_hdr h = {HDR_MAGIC, HDR_VERSION, bytes, chunk, (int32_t)s, (int32_t)path};
  MPI_Send(&h, (int)sizeof h, MPI_BYTE, dest, tag, g->c_s2r);
  wire_hdr r;
  MPI_Recv(&r, (int)sizeof r, MPI_BYTE, dest, tag, g->c_r2s, MPI_STATUS_IGNORE);
  if (s != GPUIPC_OK)
    goto out;
  if (r.magic != HDR_MAGIC || r.version != HDR_VERSION) {
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "%s: rank %d answered with a bad reply",
                     who, dest);
    goto out;
  }
  if (r.bytes != bytes) {
    s = gpuipc__fail(GPUIPC_E_TRUNCATED,
                     "%s: rank %d sends %zu bytes with tag %d, rank %d "
                     "receives %llu: sizes differ, nothing sent",
                     who, g->rank, bytes, tag, dest,
                     (unsigned long long)r.bytes);
    goto out;
  }
  if (r.status != GPUIPC_OK) {
    s = peer_failed(who, dest, r.status, "before the data moved");
    goto out;
  }
  chunk = r.chunk;
  fill_info(info, dest, tag, bytes, path, chunk);
  if (bytes > 0 && path != GPUIPC_MPI_PATH_LOCAL &&
      (chunk < 4096 || chunk > ((size_t)1 << 30))) {
    /* Cannot happen with an honest peer; both sides check alike. */
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "%s: chunk %zu agreed", who, chunk);
    goto out;
  }

  /* The data. */
  gpuipc_status ds = GPUIPC_OK;
  if (bytes > 0 && path == GPUIPC_MPI_PATH_LOCAL) {
    wire_meta m = {META_MAGIC, tag, bytes};
    ds = gpuipc_conn_send_buffer(conn, wrapped, stream, &m, sizeof m);
  } else if (bytes > 0 && path == GPUIPC_MPI_PATH_CUDA_AWARE) {
    ds = direct(g, d, (uint8_t *)(uintptr_t)buf, bytes, chunk, dest, tag,
                stream, 1);
  } else if (bytes > 0) {
    ds = staged_send(g, d, buf, bytes, chunk, dest, tag, stream);
  }
  char why[512] = "";
  if (ds != GPUIPC_OK)
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
  int32_t mine = ds, theirs = GPUIPC_OK;
  MPI_Send(&mine, 1, MPI_INT32_T, dest, tag, g->c_s2r);
  MPI_Recv(&theirs, 1, MPI_INT32_T, dest, tag, g->c_r2s, MPI_STATUS_IGNORE);
  if (ds != GPUIPC_OK) {
    s = gpuipc__fail(ds, "%s", why);
    goto out;
  }
  if (bytes > 0 && path == GPUIPC_MPI_PATH_LOCAL) {
    /* The receiver released the buffer before it answered: wait for the
     * release to be read, then order our stream after its copy. */
    uint64_t deadline =
        g->timeout_ms < 0 ? UINT64_MAX
                          : gpuipc__now_ns() + (uint64_t)g->timeout_ms * 1000000u;
    while (s == GPUIPC_OK && gpuipc_conn_get_buffer_holders(conn, wrapped) > 0) {
      if (gpuipc__now_ns() > deadline)
        s = gpuipc__fail(GPUIPC_E_TIMEOUT,
                         "%s: rank %d did not release the buffer within %d ms",
                         who, dest, g->timeout_ms);
      else
        s = gpuipc_conn_progress(conn, 10);
    }
    if (s == GPUIPC_OK)
      s = gpuipc_conn_buffer_wait(conn, wrapped, stream);
    if (s != GPUIPC_OK)
      goto out;
  }
  if (theirs != GPUIPC_OK)
    s = peer_failed(who, dest, theirs, "while receiving the data");
out:
  /* Only the wrapper: the memory is the caller's. When the receiver still
   * holds it (a failure above), the wrapper is kept until it lets go. */
  if (wrapped != NULL && (conn == NULL ||
                          gpuipc_conn_get_buffer_holders(conn, wrapped) == 0))
    gpuipc_buffer_free(wrapped, NULL);
  return s;
}

gpuipc_status gpuipc_mpi_recv(gpuipc_mpi *g, void *buf, size_t bytes,
                              int source, int tag, struct CUstream_st *stream,
                              gpuipc_mpi_transfer_info *info) {
  static const char who[] = "gpuipc_mpi_recv";
  GPUIPC__CHECK(check_peer(g, source, 1, tag, who));
  fill_info(info, source, tag, bytes, GPUIPC_MPI_PATH_NONE, 0);
  wire_hdr h;
  MPI_Status st;
  MPI_Recv(&h, (int)sizeof h, MPI_BYTE, source, tag, g->c_s2r, &st);
  source = st.MPI_SOURCE;
  tag = st.MPI_TAG;
  int got = 0;
  MPI_Get_count(&st, MPI_BYTE, &got);
  gpuipc_status s = GPUIPC_OK;
  gpuipc__mpi_dev *d = NULL;
  size_t chunk = gpuipc_mpi_get_chunk_bytes(g, bytes);
  if (got != (int)sizeof h || h.magic != HDR_MAGIC || h.version != HDR_VERSION)
    s = gpuipc__fail(GPUIPC_E_PROTOCOL,
                     "%s: rank %d sent a bad header (%d bytes)", who, source,
                     got);
  else if (h.bytes != bytes)
    s = gpuipc__fail(GPUIPC_E_TRUNCATED,
                     "%s: rank %d sends %llu bytes with tag %d, rank %d "
                     "receives %zu: sizes differ, nothing received",
                     who, source, (unsigned long long)h.bytes, tag, g->rank,
                     bytes);
  else if (h.status != GPUIPC_OK)
    s = peer_failed(who, source, h.status, "before the data moved");
  else if (bytes > 0 && buf == NULL)
    s = gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: NULL buffer of %zu bytes", who,
                     bytes);
  else if (bytes > 0)
    s = device_of(g, buf, who, &d);
  if (s == GPUIPC_OK && h.chunk < chunk)
    chunk = (size_t)h.chunk;
  gpuipc_mpi_path path = (gpuipc_mpi_path)h.path;
  int l = g->local_of[source];
  gpuipc_conn *conn = l >= 0 && g->machine_of[source] == g->machine_of[g->rank]
                          ? g->priv[l]
                          : NULL;
  if (s == GPUIPC_OK && path == GPUIPC_MPI_PATH_LOCAL && conn == NULL)
    s = gpuipc__fail(GPUIPC_E_PROTOCOL,
                     "%s: rank %d, on another machine, chose the local path",
                     who, source);
  if (s == GPUIPC_OK && path != GPUIPC_MPI_PATH_LOCAL)
    path = g->cuda_aware ? GPUIPC_MPI_PATH_CUDA_AWARE : GPUIPC_MPI_PATH_STAGED;
  if (s == GPUIPC_OK && bytes > 0 && path != GPUIPC_MPI_PATH_LOCAL &&
      (chunk < 4096 || chunk > ((size_t)1 << 30)))
    s = gpuipc__fail(GPUIPC_E_PROTOCOL, "%s: rank %d proposed chunk %zu", who,
                     source, chunk);
  wire_hdr r = {HDR_MAGIC, HDR_VERSION, bytes, chunk, (int32_t)s, 0};
  MPI_Send(&r, (int)sizeof r, MPI_BYTE, source, tag, g->c_r2s);
  if (s != GPUIPC_OK)
    return s;
  fill_info(info, source, tag, bytes, path, chunk);

  gpuipc_status ds = GPUIPC_OK;
  int32_t theirs = GPUIPC_OK;
  if (path == GPUIPC_MPI_PATH_LOCAL) {
    /* The buffer is on the connection once the sender says so. */
    MPI_Recv(&theirs, 1, MPI_INT32_T, source, tag, g->c_s2r, MPI_STATUS_IGNORE);
    if (theirs == GPUIPC_OK && bytes > 0) {
      gpuipc_received in = GPUIPC_RECEIVED_INIT;
      ds = gpuipc_conn_recv(conn, stream, &in);
      if (ds == GPUIPC_OK) {
        wire_meta m;
        memcpy(&m, in.meta, sizeof m);
        if (in.meta_len != sizeof m || m.magic != META_MAGIC || m.tag != tag ||
            m.bytes != bytes || in.length != bytes)
          ds = gpuipc__fail(GPUIPC_E_PROTOCOL,
                            "%s: rank %d's buffer came with %zu bytes and "
                            "other metadata than its header",
                            who, source, in.length);
        else
          ds = gpuipc_xfer_to_device(d->x, buf, in.ptr, bytes, stream, 0);
        gpuipc_status rs = gpuipc_conn_release(conn, in.id, stream);
        if (ds == GPUIPC_OK)
          ds = rs;
      }
    }
  } else {
    ds = bytes == 0 ? GPUIPC_OK
         : path == GPUIPC_MPI_PATH_CUDA_AWARE
             ? direct(g, d, buf, bytes, chunk, source, tag, stream, 0)
             : staged_recv(g, d, buf, bytes, chunk, source, tag, stream);
    MPI_Recv(&theirs, 1, MPI_INT32_T, source, tag, g->c_s2r, MPI_STATUS_IGNORE);
  }
  char why[512] = "";
  if (ds != GPUIPC_OK)
    snprintf(why, sizeof why, "%s", gpuipc_last_error());
  int32_t mine = ds;
  MPI_Send(&mine, 1, MPI_INT32_T, source, tag, g->c_r2s);
  if (ds != GPUIPC_OK) /* this side's own failure first */
    return gpuipc__fail(ds, "%s", why);
  if (theirs != GPUIPC_OK)
    return peer_failed(who, source, theirs, "while sending the data");
  return GPUIPC_OK;
}
