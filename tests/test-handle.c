/*
 * test-handle.c: the handle layer across processes: every pool kind
 * exported by one process and imported by another with the data checked
 * both ways; wrapped foreign allocations at a non-zero offset; devices by
 * UUID with CUDA_VISIBLE_DEVICES in opposite orders; a buffer of one device
 * imported on another. Also the shared test utilities and the peer helper
 * (test-handle.h).
 */
#include "test-handle.h"

#include <unistd.h>

/* ---- patterns ------------------------------------------------------------------ */

uint32_t *th_pattern(size_t n, uint32_t seed) {
  uint32_t *h = malloc(n + 4);
  ASSERT_NOT_NULL(h);
  for (size_t i = 0; i < n / 4; i++)
    h[i] = seed * 2654435761u + (uint32_t)i;
  return h;
}

void th_sync(int ordinal) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ordinal));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  gpuipc__ctx_leave(&g);
}

size_t th_mem_free(int ordinal) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ordinal));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  size_t fr = 0, total = 0;
  ASSERT_CU(gpuipc__cu.cuMemGetInfo(&fr, &total));
  gpuipc__ctx_leave(&g);
  return fr;
}

void th_fill_ptr(CUdeviceptr p, size_t n, uint32_t seed, int ordinal) {
  uint32_t *h = th_pattern(n, seed);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ordinal));
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(p, h, n));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  gpuipc__ctx_leave(&g);
  free(h);
}

bool th_check_ptr(CUdeviceptr p, size_t n, uint32_t seed, int ordinal) {
  uint32_t *want = th_pattern(n, seed);
  uint32_t *got = malloc(n + 4);
  ASSERT_NOT_NULL(got);
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, ordinal));
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(got, p, n));
  gpuipc__ctx_leave(&g);
  bool ok = memcmp(got, want, n) == 0;
  if (!ok)
    fprintf(stderr, "[pid %d] pattern %u mismatch at 0x%llx: first words "
                    "0x%08x 0x%08x, want 0x%08x 0x%08x\n",
            (int)getpid(), seed, (unsigned long long)p, got[0],
            n >= 8 ? got[1] : 0, want[0], n >= 8 ? want[1] : 0);
  free(want);
  free(got);
  return ok;
}

void th_fill(const gpuipc_buffer *b, size_t off, size_t n, uint32_t seed) {
  ASSERT_LE(off + n, gpuipc_buffer_get_size(b));
  if (gpuipc_buffer_get_kind(b) == GPUIPC_POOL_PINNED_HOST) {
    uint32_t *h = th_pattern(n, seed);
    memcpy((char *)gpuipc_buffer_get_ptr(b) + off, h, n);
    free(h);
    return;
  }
  th_fill_ptr((CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b) + off, n, seed,
              th_info(b).map_ordinal);
}

bool th_check(const gpuipc_buffer *b, size_t off, size_t n, uint32_t seed) {
  ASSERT_LE(off + n, gpuipc_buffer_get_size(b));
  if (gpuipc_buffer_get_kind(b) == GPUIPC_POOL_PINNED_HOST) {
    uint32_t *h = th_pattern(n, seed);
    bool ok = memcmp((char *)gpuipc_buffer_get_ptr(b) + off, h, n) == 0;
    free(h);
    return ok;
  }
  return th_check_ptr((CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b) + off, n,
                      seed, th_info(b).map_ordinal);
}

void th_close_fds(int *fds, int nfds) {
  for (int i = 0; i < nfds; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

/* ---- the peer -------------------------------------------------------------------- */

#define PEER_SLOTS 64

typedef struct peer {
  int sock;
  gpuipc_pool *pools[GPUIPC_POOL_PINNED_HOST + 1];
  gpuipc_buffer *exp[PEER_SLOTS];
  gpuipc_buffer *imp[PEER_SLOTS];
  int nimp;
  gpuipc_event *ev[PEER_SLOTS];
  int nev;
  CUmemoryPool raw_pool;
} peer;

static gpuipc_pool *peer_pool(peer *p, gpuipc_pool_kind kind) {
  if (p->pools[kind] == NULL) {
    gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
    o.kind = kind;
    ASSERT_OK(gpuipc_pool_create(&o, &p->pools[kind]));
  }
  return p->pools[kind];
}

static uint64_t peer_slot(peer *p, gpuipc_buffer *b) {
  for (uint64_t i = 0; i < PEER_SLOTS; i++)
    if (p->exp[i] == NULL) {
      p->exp[i] = b;
      return i;
    }
  harness_fail(__FILE__, __LINE__, "peer: out of slots");
}

static void send_export(peer *p, gpuipc_buffer *b) {
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[1] = {-1};
  int nfds = 1;
  ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds));
  harness_send(p->sock, d, len, fds, nfds);
  th_close_fds(fds, nfds);
}

static CUdeviceptr raw_alloc(peer *p, gpuipc_pool_kind kind, size_t n) {
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUdeviceptr ptr = 0;
  if (kind == GPUIPC_POOL_LEGACY) {
    ASSERT_CU(gpuipc__cu.cuMemAlloc(&ptr, n));
  } else if (kind == GPUIPC_POOL_VMM) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran = 0;
    ASSERT_CU(gpuipc__cu.cuMemGetAllocationGranularity(
        &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    ASSERT_EQ(n % gran, 0);
    CUmemGenericAllocationHandle h;
    ASSERT_CU(gpuipc__cu.cuMemCreate(&h, n, &prop, 0));
    ASSERT_CU(gpuipc__cu.cuMemAddressReserve(&ptr, n, gran, 0, 0));
    ASSERT_CU(gpuipc__cu.cuMemMap(ptr, n, 0, h, 0));
    ASSERT_CU(gpuipc__cu.cuMemRelease(h)); /* the mapping keeps it */
    CUmemAccessDesc ad;
    memset(&ad, 0, sizeof ad);
    ad.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ad.location.id = 0;
    ad.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_CU(gpuipc__cu.cuMemSetAccess(ptr, n, &ad, 1));
  } else {
    if (p->raw_pool == NULL) {
      CUmemPoolProps props;
      memset(&props, 0, sizeof props);
      props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
      props.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      props.location.id = 0;
      ASSERT_CU(gpuipc__cu.cuMemPoolCreate(&p->raw_pool, &props));
    }
    ASSERT_CU(gpuipc__cu.cuMemAllocFromPoolAsync(&ptr, n, p->raw_pool, NULL));
    ASSERT_CU(gpuipc__cu.cuStreamSynchronize(NULL));
  }
  gpuipc__ctx_leave(&g);
  return ptr;
}

HELPER_IMPL(handle_peer) {
  peer P;
  memset(&P, 0, sizeof P);
  P.sock = harness_helper_fd();
  ASSERT_OK(gpuipc_init());
  for (;;) {
    uint64_t op;
    {
      uint64_t v = 0;
      ssize_t n = harness_recv(P.sock, &v, sizeof v, NULL, NULL);
      if (n < 0)
        break;
      op = v;
    }
    switch (op) {
    case TH_OP_EXIT:
      goto done;
    case TH_OP_EXPORT: {
      gpuipc_pool_kind kind = (gpuipc_pool_kind)harness_recv_u64(P.sock);
      size_t size = harness_recv_u64(P.sock);
      uint32_t seed = (uint32_t)harness_recv_u64(P.sock);
      gpuipc_buffer *b = NULL;
      ASSERT_OK(gpuipc_buffer_alloc(peer_pool(&P, kind), size, NULL, &b));
      th_sync(0);
      th_fill(b, 0, size, seed);
      send_export(&P, b);
      harness_send_u64(P.sock, peer_slot(&P, b));
      break;
    }
    case TH_OP_ALLOC_PRIVATE: {
      gpuipc_pool_kind kind = (gpuipc_pool_kind)harness_recv_u64(P.sock);
      size_t size = harness_recv_u64(P.sock);
      uint32_t seed = (uint32_t)harness_recv_u64(P.sock);
      gpuipc_buffer *b = NULL;
      ASSERT_OK(gpuipc_buffer_alloc(peer_pool(&P, kind), size, NULL, &b));
      th_sync(0);
      th_fill(b, 0, size, seed);
      gpuipc__buffer_info i = th_info(b);
      harness_send_u64(P.sock, peer_slot(&P, b));
      harness_send_u64(P.sock, (uint64_t)(int64_t)i.fd);
      harness_send_u64(P.sock, i.generation);
      break;
    }
    case TH_OP_WRAP: {
      gpuipc_pool_kind kind = (gpuipc_pool_kind)harness_recv_u64(P.sock);
      size_t alloc = harness_recv_u64(P.sock);
      size_t off = harness_recv_u64(P.sock);
      size_t size = harness_recv_u64(P.sock);
      uint32_t seed = (uint32_t)harness_recv_u64(P.sock);
      CUdeviceptr raw = raw_alloc(&P, kind, alloc);
      th_fill_ptr(raw, alloc, seed ^ 0x5555u, 0); /* around the window */
      gpuipc_buffer *b = NULL;
      ASSERT_OK(gpuipc_buffer_wrap((void *)(uintptr_t)(raw + off), size, &b));
      ASSERT_EQ(gpuipc_buffer_get_kind(b), kind);
      ASSERT_PTR_EQ(gpuipc_buffer_get_ptr(b), (void *)(uintptr_t)(raw + off));
      th_fill(b, 0, size, seed);
      send_export(&P, b);
      harness_send_u64(P.sock, peer_slot(&P, b));
      break;
    }
    case TH_OP_CHECK: {
      uint64_t slot = harness_recv_u64(P.sock);
      size_t off = harness_recv_u64(P.sock);
      size_t n = harness_recv_u64(P.sock);
      uint32_t seed = (uint32_t)harness_recv_u64(P.sock);
      ASSERT_NOT_NULL(P.exp[slot]);
      harness_send_u64(P.sock, th_check(P.exp[slot], off, n, seed));
      break;
    }
    case TH_OP_FREE: {
      uint64_t slot = harness_recv_u64(P.sock);
      ASSERT_OK(gpuipc_buffer_free(P.exp[slot], NULL));
      P.exp[slot] = NULL;
      th_sync(0);
      harness_send_u64(P.sock, 0);
      break;
    }
    case TH_OP_REALLOC: {
      /* Frees the buffer in slot and allocates until the same address
       * comes back (holding the misses), so that importers see a new
       * allocation where the old one was. */
      uint64_t slot = harness_recv_u64(P.sock);
      uint32_t seed = (uint32_t)harness_recv_u64(P.sock);
      gpuipc_buffer *old = P.exp[slot];
      void *addr = gpuipc_buffer_get_ptr(old);
      size_t size = gpuipc_buffer_get_size(old);
      gpuipc_pool *pool = th_info(old).pool;
      ASSERT_OK(gpuipc_buffer_free(old, NULL));
      th_sync(0);
      P.exp[slot] = NULL;
      gpuipc_buffer *held[32];
      int nheld = 0;
      gpuipc_buffer *b = NULL;
      for (;;) {
        ASSERT_OK(gpuipc_buffer_alloc(pool, size, NULL, &b));
        if (gpuipc_buffer_get_ptr(b) == addr || nheld == 32)
          break;
        held[nheld++] = b;
      }
      for (int i = 0; i < nheld; i++)
        ASSERT_OK(gpuipc_buffer_free(held[i], NULL));
      th_sync(0);
      th_fill(b, 0, size, seed);
      P.exp[slot] = b;
      send_export(&P, b);
      harness_send_u64(P.sock, gpuipc_buffer_get_ptr(b) == addr);
      break;
    }
    case TH_OP_IMPORT: {
      uint8_t d[GPUIPC_DESC_MAX];
      int fds[1] = {-1};
      int nfds = 1;
      ssize_t len = harness_recv(P.sock, d, sizeof d, fds, &nfds);
      uint32_t seed_in = (uint32_t)harness_recv_u64(P.sock);
      uint32_t seed_out = (uint32_t)harness_recv_u64(P.sock);
      int64_t dev = (int64_t)harness_recv_u64(P.sock);
      gpuipc_import_options o = GPUIPC_IMPORT_OPTIONS_INIT;
      gpuipc_uuid u;
      if (dev >= 0) {
        ASSERT_OK(gpuipc_device_uuid((int)dev, &u));
        o.device = &u;
      }
      gpuipc_buffer *b = NULL;
      gpuipc_status s =
          gpuipc_buffer_import(d, (size_t)len, fds, nfds, &o, &b);
      th_close_fds(fds, nfds);
      char err[512] = "";
      if (s != GPUIPC_OK) {
        snprintf(err, sizeof err, "%s", gpuipc_last_error());
      } else {
        size_t n = gpuipc_buffer_get_size(b);
        gpuipc_uuid mu;
        ASSERT_OK(gpuipc_buffer_get_mapped_device(b, &mu));
        if (dev >= 0)
          ASSERT_MEM_EQ(mu.bytes, u.bytes, 16);
        if (!th_check(b, 0, n, seed_in)) {
          s = GPUIPC_E_USER;
          snprintf(err, sizeof err, "imported data does not match");
        } else {
          th_fill(b, 0, n, seed_out);
        }
        ASSERT_LT(P.nimp, PEER_SLOTS);
        P.imp[P.nimp++] = b;
      }
      harness_send_u64(P.sock, (uint64_t)s);
      harness_send(P.sock, err, strlen(err) + 1, NULL, 0);
      break;
    }
    case TH_OP_EVENT_PRODUCE: {
      /* An event, exported and recorded once; kept until the peer exits. */
      ASSERT_LT(P.nev, PEER_SLOTS);
      gpuipc_event *e = NULL;
      ASSERT_OK(gpuipc_event_create(NULL, &e));
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len;
      ASSERT_OK(gpuipc_event_export(e, d, sizeof d, &len));
      ASSERT_OK(gpuipc_event_record(e, NULL));
      P.ev[P.nev++] = e;
      harness_send(P.sock, d, len, NULL, 0);
      break;
    }
    case TH_OP_POOL_EXPORT: {
      gpuipc_pool_kind kind = (gpuipc_pool_kind)harness_recv_u64(P.sock);
      uint8_t d[GPUIPC_DESC_MAX];
      size_t len;
      int fd = -1;
      ASSERT_OK(gpuipc_pool_export(peer_pool(&P, kind), d, sizeof d, &len, &fd));
      harness_send(P.sock, d, len, &fd, 1);
      close(fd);
      break;
    }
    case TH_OP_CLOSE_ALL:
      for (int i = 0; i < P.nimp; i++)
        ASSERT_OK(gpuipc_buffer_close(P.imp[i]));
      P.nimp = 0;
      harness_send_u64(P.sock, 0);
      break;
    default:
      harness_fail(__FILE__, __LINE__, "peer: unknown op %llu",
                   (unsigned long long)op);
    }
  }
done:
  for (int i = 0; i < P.nev; i++)
    ASSERT_OK(gpuipc_event_destroy(P.ev[i]));
  for (int i = 0; i < P.nimp; i++)
    ASSERT_OK(gpuipc_buffer_close(P.imp[i]));
  for (int i = 0; i < PEER_SLOTS; i++)
    ASSERT_OK(gpuipc_buffer_free(P.exp[i], NULL));
  th_sync(0);
  for (int k = 0; k <= GPUIPC_POOL_PINNED_HOST; k++)
    ASSERT_OK(gpuipc_pool_destroy(P.pools[k]));
  return 0;
}

pid_t th_peer_start(char *const env[], int *sock) {
  return spawn_helper("handle_peer", env, sock, NULL);
}

void th_peer_stop(pid_t pid, int sock) {
  harness_send_u64(sock, TH_OP_EXIT);
  ASSERT_EQ(wait_helper(pid, 60), 0);
  close(sock);
}

uint64_t th_peer_export(int sock, gpuipc_pool_kind kind, size_t size,
                        uint32_t seed, uint8_t *desc, size_t *len, int *fds,
                        int *nfds) {
  harness_send_u64(sock, TH_OP_EXPORT);
  harness_send_u64(sock, (uint64_t)kind);
  harness_send_u64(sock, size);
  harness_send_u64(sock, seed);
  ssize_t n = harness_recv(sock, desc, GPUIPC_DESC_MAX, fds, nfds);
  ASSERT_GT(n, 0);
  *len = (size_t)n;
  return harness_recv_u64(sock);
}

bool th_peer_check(int sock, uint64_t slot, size_t off, size_t n,
                   uint32_t seed) {
  harness_send_u64(sock, TH_OP_CHECK);
  harness_send_u64(sock, slot);
  harness_send_u64(sock, off);
  harness_send_u64(sock, n);
  harness_send_u64(sock, seed);
  return harness_recv_u64(sock) != 0;
}

void th_peer_free(int sock, uint64_t slot) {
  harness_send_u64(sock, TH_OP_FREE);
  harness_send_u64(sock, slot);
  ASSERT_EQ(harness_recv_u64(sock), 0);
}

gpuipc_status th_peer_import(int sock, const uint8_t *desc, size_t len,
                             const int *fds, int nfds, uint32_t seed_in,
                             uint32_t seed_out, int device_index, char *err,
                             size_t errcap) {
  harness_send_u64(sock, TH_OP_IMPORT);
  harness_send(sock, desc, len, fds, nfds);
  harness_send_u64(sock, seed_in);
  harness_send_u64(sock, seed_out);
  harness_send_u64(sock, (uint64_t)(int64_t)device_index);
  gpuipc_status s = (gpuipc_status)harness_recv_u64(sock);
  char buf[512];
  ssize_t n = harness_recv(sock, buf, sizeof buf, NULL, NULL);
  ASSERT_GT(n, 0);
  if (err)
    snprintf(err, errcap, "%s", buf);
  return s;
}

void th_peer_close_all(int sock) {
  harness_send_u64(sock, TH_OP_CLOSE_ALL);
  ASSERT_EQ(harness_recv_u64(sock), 0);
}

/* ---- every kind, both directions ---------------------------------------------------- */

/* One round of sharing in both directions with the peer on sock. */
static int share_round(gpuipc_pool_kind kind, int sock) {
  /* This process exports, the peer imports, checks, writes back. */
  gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
  o.kind = kind;
  gpuipc_pool *pool = NULL;
  ASSERT_OK(gpuipc_pool_create(&o, &pool));
  if (kind == GPUIPC_POOL_AUTO)
    ASSERT_NE(gpuipc_pool_get_kind(pool), GPUIPC_POOL_AUTO);
  const size_t size = (1u << 20) + 4096;
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(pool, size, NULL, &b));
  ASSERT_EQ(gpuipc_buffer_get_size(b), size);
  ASSERT_EQ(gpuipc_buffer_get_kind(b), gpuipc_pool_get_kind(pool));
  ASSERT_EQ(gpuipc_buffer_is_imported(b), 0);
  gpuipc_uuid u0, ub;
  ASSERT_OK(gpuipc_device_uuid(0, &u0));
  ASSERT_OK(gpuipc_buffer_get_device(b, &ub));
  ASSERT_MEM_EQ(u0.bytes, ub.bytes, 16);
  th_sync(0);
  th_fill(b, 0, size, 11);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len = 0;
  int fds[1] = {-1}, nfds = 1;
  ASSERT_OK(gpuipc_buffer_export(b, d, sizeof d, &len, fds, &nfds));
  gpuipc_pool_kind k = gpuipc_pool_get_kind(pool);
  ASSERT_EQ(nfds, k == GPUIPC_POOL_LEGACY ? 0 : 1);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, len, &info));
  ASSERT_EQ(info.type, GPUIPC_DESC_BUFFER);
  ASSERT_EQ(info.kind, k);
  ASSERT_EQ(info.bytes, size);
  ASSERT_EQ(info.exporter_pid, getpid());
  ASSERT_EQ(info.same_machine, 1);
  /* A process may not import its own descriptors (the driver refuses). */
  gpuipc_buffer *self = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(d, len, fds, nfds, NULL, &self),
                GPUIPC_E_INVALID_ARG);
  char err[512];
  gpuipc_status s = th_peer_import(sock, d, len, fds, nfds, 11, 22, -1, err,
                                   sizeof err);
  if (s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "peer import: %s: %s",
                 gpuipc_status_name(s), err);
  th_close_fds(fds, nfds);
  ASSERT(th_check(b, 0, size, 22));
  th_peer_close_all(sock);

  /* The peer exports, this process imports. */
  nfds = 1;
  uint64_t slot = th_peer_export(sock, k, size, 33, d, &len, fds, &nfds);
  gpuipc_buffer *ib = NULL;
  gpuipc_cache_stats st0 = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&st0));
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &ib));
  th_close_fds(fds, nfds);
  ASSERT_EQ(gpuipc_buffer_is_imported(ib), 1);
  ASSERT_EQ(gpuipc_buffer_get_kind(ib), k);
  ASSERT_EQ(gpuipc_buffer_get_size(ib), size);
  ASSERT_OK(gpuipc_buffer_get_device(ib, &ub));
  ASSERT_MEM_EQ(u0.bytes, ub.bytes, 16);
  ASSERT(th_check(ib, 0, size, 33));
  th_fill(ib, 0, size, 44);
  ASSERT(th_peer_check(sock, slot, 0, size, 44));
  /* Re-exporting an import is refused. */
  nfds = 0;
  ASSERT_STATUS(gpuipc_buffer_export(ib, d, sizeof d, &len, NULL, &nfds),
                GPUIPC_E_NOT_SUPPORTED);
  ASSERT_OK(gpuipc_buffer_close(ib));
  gpuipc_cache_stats st1 = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&st1));
  ASSERT_EQ(st1.live_mappings, st0.live_mappings);
  ASSERT_EQ(st1.misses, st0.misses + 1);
  th_peer_free(sock, slot);

  /* Pools refuse to go while they have buffers. */
  ASSERT_STATUS(gpuipc_pool_destroy(pool), GPUIPC_E_BUSY);
  ASSERT_OK(gpuipc_buffer_free(b, NULL));
  th_sync(0);
  ASSERT_OK(gpuipc_pool_destroy(pool));
  ASSERT_OK(gpuipc_buffer_free(NULL, NULL));
  ASSERT_OK(gpuipc_buffer_close(NULL));
  ASSERT_OK(gpuipc_pool_destroy(NULL));
  return 0;
}

/* Two identical rounds: the real driver opens file descriptors lazily (its
 * device nodes, per context, per imported pool: 21 -> 41 after a first
 * import on driver 580), so the leak check's baseline is taken after the
 * first round and compared after the second. The emulator opens none
 * behind gpuipc's back: there the count is also back at the very start. */
static int share_both_ways(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int fds_start = harness_count_fds();
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  ASSERT_EQ(share_round(kind, sock), 0);
  int fds_warm = harness_count_fds();
  ASSERT_EQ(share_round(kind, sock), 0);
  ASSERT_EQ(harness_count_fds(), fds_warm);
  th_peer_stop(pid, sock);
  if (harness_on_emulator())
    ASSERT_EQ(harness_count_fds(), fds_start);
  return 0;
}

TEST_IMPL(handle_share_mempool) { return share_both_ways(GPUIPC_POOL_MEMPOOL); }
TEST_IMPL(handle_share_vmm) { return share_both_ways(GPUIPC_POOL_VMM); }
TEST_IMPL(handle_share_legacy) { return share_both_ways(GPUIPC_POOL_LEGACY); }
TEST_IMPL(handle_share_pinned_host) {
  return share_both_ways(GPUIPC_POOL_PINNED_HOST);
}
TEST_IMPL(handle_share_auto) { return share_both_ways(GPUIPC_POOL_AUTO); }

/* A mempool imported once: buffer descriptors then need no fd. */
TEST_IMPL(handle_pool_import_then_buffers_without_fd) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  uint64_t slot = th_peer_export(sock, GPUIPC_POOL_MEMPOOL, 65536, 5, d, &len,
                                 fds, &nfds);
  ASSERT_EQ(nfds, 1);
  /* Without the fd, and the pool not imported yet: E_NEED_FD. */
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b),
                GPUIPC_E_NEED_FD);
  ASSERT_STR_CONTAINS(gpuipc_last_error(), "gpuipc_pool_import");
  /* The first import with the fd imports the pool; later ones need none. */
  gpuipc_cache_stats a = GPUIPC_CACHE_STATS_INIT, c = GPUIPC_CACHE_STATS_INIT;
  ASSERT_OK(gpuipc_cache_get_stats(&a));
  ASSERT_OK(gpuipc_buffer_import(d, len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT(th_check(b, 0, 65536, 5));
  nfds = 1;
  uint64_t slot2 = th_peer_export(sock, GPUIPC_POOL_MEMPOOL, 8192, 6, d, &len,
                                  fds, &nfds);
  th_close_fds(fds, nfds);
  gpuipc_buffer *b2 = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, len, NULL, 0, NULL, &b2));
  ASSERT(th_check(b2, 0, 8192, 6));
  ASSERT_OK(gpuipc_cache_get_stats(&c));
  ASSERT_EQ(c.pool_imports, a.pool_imports + 1);
  ASSERT_GE(c.pool_hits, a.pool_hits + 1);
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_buffer_close(b2));
  th_peer_free(sock, slot);
  th_peer_free(sock, slot2);
  th_peer_stop(pid, sock);
  return 0;
}

/* A pool imported explicitly, once: buffers then need no fd; allocating
 * from it is refused; only mempools have a pool-level export. */
TEST_IMPL(handle_pool_export_import) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  harness_send_u64(sock, TH_OP_POOL_EXPORT);
  harness_send_u64(sock, GPUIPC_POOL_MEMPOOL);
  uint8_t d[GPUIPC_DESC_MAX];
  int fds[1] = {-1}, nfds = 1;
  ssize_t len = harness_recv(sock, d, sizeof d, fds, &nfds);
  ASSERT_EQ(nfds, 1);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, (size_t)len, &info));
  ASSERT_EQ(info.type, GPUIPC_DESC_POOL);
  ASSERT_EQ(info.kind, GPUIPC_POOL_MEMPOOL);
  gpuipc_pool *ip = NULL;
  ASSERT_STATUS(gpuipc_pool_import(d, (size_t)len, -1, NULL, &ip),
                GPUIPC_E_NEED_FD);
  ASSERT_OK(gpuipc_pool_import(d, (size_t)len, fds[0], NULL, &ip));
  gpuipc_pool *ip2 = NULL;
  ASSERT_OK(gpuipc_pool_import(d, (size_t)len, -1, NULL, &ip2)); /* cached */
  th_close_fds(fds, nfds);
  ASSERT_EQ(gpuipc_pool_get_kind(ip), GPUIPC_POOL_MEMPOOL);
  gpuipc_uuid u0, pu;
  ASSERT_OK(gpuipc_device_uuid(0, &u0));
  ASSERT_OK(gpuipc_pool_get_device(ip, &pu));
  ASSERT_MEM_EQ(u0.bytes, pu.bytes, 16);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_alloc(ip, 4096, NULL, &b), GPUIPC_E_NOT_SUPPORTED);
  size_t l2;
  ASSERT_STATUS(gpuipc_pool_export(ip, d, sizeof d, &l2, NULL),
                GPUIPC_E_NOT_SUPPORTED);
  /* Buffers of that pool now import without their fd. */
  nfds = 0;
  uint64_t slot = th_peer_export(sock, GPUIPC_POOL_MEMPOOL, 65536, 9, d, &l2,
                                 NULL, &nfds);
  ASSERT_OK(gpuipc_buffer_import(d, l2, NULL, 0, NULL, &b));
  ASSERT(th_check(b, 0, 65536, 9));
  ASSERT_OK(gpuipc_buffer_close(b));
  ASSERT_OK(gpuipc_pool_destroy(ip));
  ASSERT_OK(gpuipc_pool_destroy(ip2));
  th_peer_free(sock, slot);
  /* Other kinds have no pool-level export. */
  gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
  o.kind = GPUIPC_POOL_LEGACY;
  gpuipc_pool *lp;
  ASSERT_OK(gpuipc_pool_create(&o, &lp));
  int fd = 7;
  ASSERT_STATUS(gpuipc_pool_export(lp, d, sizeof d, &l2, &fd),
                GPUIPC_E_NOT_SUPPORTED);
  ASSERT_EQ(fd, -1);
  ASSERT_OK(gpuipc_pool_destroy(lp));
  th_peer_stop(pid, sock);
  return 0;
}

/* Bad pool options are refused before anything is created. */
TEST_IMPL(handle_pool_options) {
  ASSERT_OK(gpuipc_init());
  gpuipc_pool *p = NULL;
  gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
  o.kind = (gpuipc_pool_kind)42;
  ASSERT_STATUS(gpuipc_pool_create(&o, &p), GPUIPC_E_BAD_KIND);
  gpuipc_uuid ghost;
  memset(ghost.bytes, 0xEE, 16);
  o = (gpuipc_pool_options)GPUIPC_POOL_OPTIONS_INIT;
  o.device = &ghost;
  ASSERT_STATUS(gpuipc_pool_create(&o, &p), GPUIPC_E_DEVICE_NOT_VISIBLE);
  o = (gpuipc_pool_options)GPUIPC_POOL_OPTIONS_INIT;
  o.size = 0;
  ASSERT_STATUS(gpuipc_pool_create(&o, &p), GPUIPC_E_INVALID_ARG);
  ASSERT_STATUS(gpuipc_pool_create(NULL, NULL), GPUIPC_E_INVALID_ARG);
  /* An older caller's shorter struct: the fields it lacks take defaults. */
  o = (gpuipc_pool_options)GPUIPC_POOL_OPTIONS_INIT;
  o.kind = GPUIPC_POOL_LEGACY;
  o.size = offsetof(gpuipc_pool_options, capacity);
  ASSERT_OK(gpuipc_pool_create(&o, &p));
  ASSERT_EQ(gpuipc_pool_get_kind(p), GPUIPC_POOL_LEGACY);
  /* Capacity is enforced for non-mempool kinds. */
  ASSERT_OK(gpuipc_pool_destroy(p));
  o = (gpuipc_pool_options)GPUIPC_POOL_OPTIONS_INIT;
  o.kind = GPUIPC_POOL_LEGACY;
  o.capacity = 1u << 20;
  ASSERT_OK(gpuipc_pool_create(&o, &p));
  gpuipc_buffer *a = NULL, *b = NULL;
  ASSERT_OK(gpuipc_buffer_alloc(p, 768u << 10, NULL, &a));
  ASSERT_STATUS(gpuipc_buffer_alloc(p, 512u << 10, NULL, &b), GPUIPC_E_LIMIT);
  ASSERT_OK(gpuipc_buffer_alloc(p, 256u << 10, NULL, &b));
  ASSERT_STATUS(gpuipc_buffer_alloc(p, 0, NULL, &b), GPUIPC_E_INVALID_ARG);
  ASSERT_OK(gpuipc_buffer_free(a, NULL));
  ASSERT_OK(gpuipc_buffer_free(b, NULL));
  ASSERT_OK(gpuipc_pool_destroy(p));
  return 0;
}

/* ---- wrapped foreign allocations ------------------------------------------------------ */

static int wrap_offset(gpuipc_pool_kind kind) {
  ASSERT_OK(gpuipc_init());
  int sock;
  pid_t pid = th_peer_start(NULL, &sock);
  const size_t alloc = 4u << 20, off = 12288 + 64, size = 65536;
  harness_send_u64(sock, TH_OP_WRAP);
  harness_send_u64(sock, (uint64_t)kind);
  harness_send_u64(sock, alloc);
  harness_send_u64(sock, off);
  harness_send_u64(sock, size);
  harness_send_u64(sock, 77);
  uint8_t d[GPUIPC_DESC_MAX];
  int fds[1] = {-1}, nfds = 1;
  ssize_t len = harness_recv(sock, d, sizeof d, fds, &nfds);
  ASSERT_GT(len, 0);
  uint64_t slot = harness_recv_u64(sock);
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  ASSERT_OK(gpuipc_desc_get_info(d, (size_t)len, &info));
  ASSERT_EQ(info.offset, off);
  ASSERT_EQ(info.bytes, size);
  ASSERT_GE(info.alloc_bytes, alloc);
  ASSERT_EQ(info.kind, kind);
  gpuipc_buffer *b = NULL;
  ASSERT_OK(gpuipc_buffer_import(d, (size_t)len, fds, nfds, NULL, &b));
  th_close_fds(fds, nfds);
  ASSERT_EQ(gpuipc_buffer_get_size(b), size);
  ASSERT(th_check(b, 0, size, 77));
  /* The base of the mapping holds the exporter's data around the window. */
  ASSERT(th_check_ptr(th_info(b).base, off, 77 ^ 0x5555u, th_info(b).map_ordinal));
  th_fill(b, 0, size, 78);
  ASSERT(th_peer_check(sock, slot, 0, size, 78));
  ASSERT_OK(gpuipc_buffer_close(b));
  th_peer_stop(pid, sock);
  return 0;
}

TEST_IMPL(handle_wrap_legacy_offset) { return wrap_offset(GPUIPC_POOL_LEGACY); }
TEST_IMPL(handle_wrap_mempool_offset) {
  return wrap_offset(GPUIPC_POOL_MEMPOOL);
}
TEST_IMPL(handle_wrap_vmm_offset) { return wrap_offset(GPUIPC_POOL_VMM); }

/* Wrapping a range that leaves its allocation is refused. */
TEST_IMPL(handle_wrap_out_of_range) {
  ASSERT_OK(gpuipc_init());
  gpuipc__ctx_guard g;
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  CUdeviceptr p = 0;
  ASSERT_CU(gpuipc__cu.cuMemAlloc(&p, 65536));
  gpuipc__ctx_leave(&g);
  gpuipc_buffer *b = NULL;
  ASSERT_STATUS(gpuipc_buffer_wrap((void *)(uintptr_t)(p + 4096), 65536, &b),
                GPUIPC_E_OUT_OF_RANGE);
  ASSERT_NULL(b);
  ASSERT_OK(gpuipc_buffer_wrap((void *)(uintptr_t)(p + 4096), 65536 - 4096, &b));
  ASSERT_EQ(gpuipc_buffer_get_kind(b), GPUIPC_POOL_LEGACY);
  ASSERT_OK(gpuipc_buffer_free(b, NULL)); /* the wrapper only */
  ASSERT_OK(gpuipc__ctx_enter(&g, 0));
  ASSERT_CU(gpuipc__cu.cuMemFree(p)); /* still ours to free */
  gpuipc__ctx_leave(&g);
  return 0;
}

/* ---- devices by UUID ------------------------------------------------------------------- */

/* With two devices and CUDA_VISIBLE_DEVICES in opposite orders, the
 * exporter's device 1 is the importer's device 0: the descriptor names the
 * device by UUID, and the importer maps it on the right one. */
TEST_IMPL(handle_visible_devices_opposite_orders) {
  char *env_a[] = {"GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=0,1", NULL};
  char *env_b[] = {"GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=1,0", NULL};
  if (!harness_on_emulator())
    REQUIRE_DEVICES(2);
  int sa, sb;
  pid_t pa = th_peer_start(env_a, &sa);
  pid_t pb = th_peer_start(env_b, &sb);
  /* The peer exports on its device 0 = physical 0; for B that is its
   * device 1. Both directions. */
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  char err[512];
  gpuipc_pool_kind kinds[] = {GPUIPC_POOL_LEGACY, GPUIPC_POOL_MEMPOOL,
                              GPUIPC_POOL_VMM};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(kinds); i++) {
    nfds = 1;
    uint64_t slot =
        th_peer_export(sa, kinds[i], 65536, 100 + (uint32_t)i, d, &len, fds,
                       &nfds);
    gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
    ASSERT_OK(gpuipc_desc_get_info(d, len, &info));
    gpuipc_status s = th_peer_import(sb, d, len, fds, nfds, 100 + (uint32_t)i,
                                     200 + (uint32_t)i, -1, err, sizeof err);
    th_close_fds(fds, nfds);
    if (s != GPUIPC_OK)
      harness_fail(__FILE__, __LINE__, "%s: import in B: %s: %s",
                   gpuipc_pool_kind_name(kinds[i]), gpuipc_status_name(s),
                   err);
    ASSERT(th_peer_check(sa, slot, 0, 65536, 200 + (uint32_t)i));
    th_peer_close_all(sb);
    th_peer_free(sa, slot);
  }
  /* B's device 0 is physical 1, which A sees as its device 1: A importing
   * a buffer of B's device 0 works only if it maps on its device 1. */
  nfds = 1;
  uint64_t slot =
      th_peer_export(sb, GPUIPC_POOL_LEGACY, 65536, 300, d, &len, fds, &nfds);
  gpuipc_status s =
      th_peer_import(sa, d, len, fds, nfds, 300, 301, -1, err, sizeof err);
  th_close_fds(fds, nfds);
  if (s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "import in A: %s: %s",
                 gpuipc_status_name(s), err);
  ASSERT(th_peer_check(sb, slot, 0, 65536, 301));
  th_peer_close_all(sa);
  th_peer_free(sb, slot);
  th_peer_stop(pa, sa);
  th_peer_stop(pb, sb);
  return 0;
}

/* A buffer on device 0 imported on device 1 (peer access): the data is
 * checked through device 1's context. */
TEST_IMPL(handle_import_on_other_device) {
  char *env[] = {"GPUIPC_EMU_DEVICES=2", NULL};
  if (!harness_on_emulator())
    REQUIRE_DEVICES(2);
  int sa, sb;
  pid_t pa = th_peer_start(env, &sa);
  pid_t pb = th_peer_start(env, &sb);
  gpuipc_pool_kind kinds[] = {GPUIPC_POOL_LEGACY, GPUIPC_POOL_MEMPOOL,
                              GPUIPC_POOL_VMM};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(kinds); i++) {
    uint8_t d[GPUIPC_DESC_MAX];
    size_t len;
    int fds[1] = {-1}, nfds = 1;
    char err[512];
    uint64_t slot = th_peer_export(sa, kinds[i], 1u << 20, 400 + (uint32_t)i,
                                   d, &len, fds, &nfds);
    gpuipc_status s = th_peer_import(sb, d, len, fds, nfds, 400 + (uint32_t)i,
                                     500 + (uint32_t)i, 1, err, sizeof err);
    th_close_fds(fds, nfds);
    if (s != GPUIPC_OK)
      harness_fail(__FILE__, __LINE__, "%s on device 1: %s: %s",
                   gpuipc_pool_kind_name(kinds[i]), gpuipc_status_name(s),
                   err);
    ASSERT(th_peer_check(sa, slot, 0, 1u << 20, 500 + (uint32_t)i));
    th_peer_close_all(sb);
    th_peer_free(sa, slot);
  }
  th_peer_stop(pa, sa);
  th_peer_stop(pb, sb);
  return 0;
}

/* The exporter's device hidden from the importer: device memory cannot be
 * imported (GPUIPC_E_DEVICE_NOT_VISIBLE), pinned host memory can. */
TEST_IMPL(handle_exporter_device_hidden) {
  char *env_a[] = {"GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=0,1", NULL};
  char *env_b[] = {"GPUIPC_EMU_DEVICES=2", "CUDA_VISIBLE_DEVICES=1", NULL};
  if (!harness_on_emulator())
    REQUIRE_DEVICES(2);
  int sa, sb;
  pid_t pa = th_peer_start(env_a, &sa);
  pid_t pb = th_peer_start(env_b, &sb);
  uint8_t d[GPUIPC_DESC_MAX];
  size_t len;
  int fds[1] = {-1}, nfds = 1;
  char err[512];
  uint64_t slot =
      th_peer_export(sa, GPUIPC_POOL_LEGACY, 65536, 1, d, &len, fds, &nfds);
  ASSERT_EQ(th_peer_import(sb, d, len, fds, nfds, 1, 2, -1, err, sizeof err),
            GPUIPC_E_DEVICE_NOT_VISIBLE);
  ASSERT_STR_CONTAINS(err, "not visible");
  th_close_fds(fds, nfds);
  th_peer_free(sa, slot);
  nfds = 1;
  slot = th_peer_export(sa, GPUIPC_POOL_PINNED_HOST, 65536, 3, d, &len, fds,
                        &nfds);
  gpuipc_status s =
      th_peer_import(sb, d, len, fds, nfds, 3, 4, -1, err, sizeof err);
  th_close_fds(fds, nfds);
  if (s != GPUIPC_OK)
    harness_fail(__FILE__, __LINE__, "pinned host import: %s: %s",
                 gpuipc_status_name(s), err);
  ASSERT(th_peer_check(sa, slot, 0, 65536, 4));
  th_peer_close_all(sb);
  th_peer_free(sa, slot);
  th_peer_stop(pa, sa);
  th_peer_stop(pb, sb);
  return 0;
}

/* A pool whose memory another local device may access (peer access
 * granted at creation): device 1 reads and writes device 0's buffer. */
HELPER_IMPL(handle_access_devices_run) {
  ASSERT_OK(gpuipc_init());
  REQUIRE_DEVICES(2);
  gpuipc_uuid u1;
  ASSERT_OK(gpuipc_device_uuid(1, &u1));
  gpuipc_pool_kind kinds[] = {GPUIPC_POOL_MEMPOOL, GPUIPC_POOL_VMM};
  for (size_t i = 0; i < GPUIPC__ARRAY_SIZE(kinds); i++) {
    gpuipc_pool_options o = GPUIPC_POOL_OPTIONS_INIT;
    o.kind = kinds[i];
    o.access_devices = &u1;
    o.n_access_devices = 1;
    gpuipc_pool *p;
    ASSERT_OK(gpuipc_pool_create(&o, &p));
    gpuipc_buffer *b;
    ASSERT_OK(gpuipc_buffer_alloc(p, 65536, NULL, &b));
    th_sync(0);
    CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)gpuipc_buffer_get_ptr(b);
    th_fill_ptr(ptr, 65536, 70, 1); /* through device 1's context */
    ASSERT(th_check_ptr(ptr, 65536, 70, 0));
    ASSERT_OK(gpuipc_buffer_free(b, NULL));
    th_sync(0);
    ASSERT_OK(gpuipc_pool_destroy(p));
  }
  return 0;
}

TEST_IMPL(handle_pool_access_devices) {
  char *env[] = {"GPUIPC_EMU_DEVICES=2", NULL};
  if (!harness_on_emulator())
    REQUIRE_DEVICES(2);
  pid_t pid = spawn_helper("handle_access_devices_run", env, NULL, NULL);
  int rc = wait_helper(pid, 60);
  if (rc == TEST_SKIP)
    SKIP("the helper sees fewer than 2 devices");
  ASSERT_EQ(rc, 0);
  return 0;
}
