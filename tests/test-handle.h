/*
 * test-handle.h: what the handle layer's tests share: data patterns, and a
 * peer process ("handle_peer" helper, in test-handle.c) that exports and
 * imports on command over its socketpair.
 */
#ifndef GPUIPC_TEST_HANDLE_H
#define GPUIPC_TEST_HANDLE_H

#include "harness.h"

#include "tree.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the handle layer says of a buffer (gpuipc__buffer_info_get); a
 * failure fails the test. */
static inline gpuipc__buffer_info th_info(const gpuipc_buffer *b) {
  gpuipc__buffer_info i;
  memset(&i, 0, sizeof i);
  if (gpuipc__buffer_info_get(b, &i) != GPUIPC_OK) {
    fprintf(stderr, "gpuipc__buffer_info_get: %s\n", gpuipc_last_error());
    abort();
  }
  return i;
}

/* A malloc'ed host copy of the pattern (n bytes, a multiple of 4). */
uint32_t *th_pattern(size_t n, uint32_t seed);
/* Fills / checks a buffer's bytes (as seen in this process) with a pattern
 * derived from seed, through the driver (or memcpy for pinned host memory),
 * in the primary context of local device ordinal. th_check returns true
 * when the pattern matches. [off, off+n) of the buffer. */
void th_fill(const gpuipc_buffer *b, size_t off, size_t n, uint32_t seed);
bool th_check(const gpuipc_buffer *b, size_t off, size_t n, uint32_t seed);
/* The same on a raw device pointer of device ordinal. */
void th_fill_ptr(CUdeviceptr p, size_t n, uint32_t seed, int ordinal);
bool th_check_ptr(CUdeviceptr p, size_t n, uint32_t seed, int ordinal);
/* Synchronizes the primary context of ordinal. */
void th_sync(int ordinal);
/* Free bytes of device ordinal (cuMemGetInfo), after a sync. */
size_t th_mem_free(int ordinal);

/* Peer commands (u64 op, then arguments, see test-handle.c). */
enum {
  TH_OP_EXIT = 1,
  TH_OP_EXPORT,       /* kind, size, seed -> desc(+fds), u64 slot */
  TH_OP_CHECK,        /* slot, off, n, seed -> u64 ok */
  TH_OP_FREE,         /* slot -> u64 0 */
  TH_OP_IMPORT,       /* desc(+fds), seed_in, seed_out, device index (-1:
                         exporter's) -> u64 status, string error */
  TH_OP_CLOSE_ALL,    /* -> u64 0 */
  TH_OP_REALLOC,      /* slot, seed -> desc(+fds), u64 same_address */
  TH_OP_WRAP,         /* kind (legacy|mempool), alloc, off, size, seed ->
                         desc(+fds), u64 slot */
  TH_OP_EVENT_PRODUCE, /* -> event desc (created, exported, recorded) */
  TH_OP_POOL_EXPORT,   /* kind -> pool desc(+fd) of the peer's pool */
  TH_OP_ALLOC_PRIVATE  /* kind, size, seed -> u64 slot, u64 fd number (-1:
                          none yet), u64 generation: allocated, never
                          exported */
};

/* Starts a peer (env: extra environment, may be NULL). */
pid_t th_peer_start(char *const env[], int *sock);
/* Stops it (TH_OP_EXIT) and checks it exited 0. */
void th_peer_stop(pid_t pid, int sock);
/* Asks the peer to export a new buffer of kind with size bytes filled with
 * seed: the descriptor lands in desc/len, its fds in fds/nfds (nfds: in
 * capacity, out count). Returns the peer's slot. */
uint64_t th_peer_export(int sock, gpuipc_pool_kind kind, size_t size,
                        uint32_t seed, uint8_t *desc, size_t *len, int *fds,
                        int *nfds);
/* Asks the peer to check its exported buffer slot. */
bool th_peer_check(int sock, uint64_t slot, size_t off, size_t n,
                   uint32_t seed);
void th_peer_free(int sock, uint64_t slot);
/* Asks the peer to import desc (+fds), check seed_in over the whole buffer,
 * write seed_out. Returns the peer's status; its error text in err. */
gpuipc_status th_peer_import(int sock, const uint8_t *desc, size_t len,
                             const int *fds, int nfds, uint32_t seed_in,
                             uint32_t seed_out, int device_index, char *err,
                             size_t errcap);
void th_peer_close_all(int sock);

void th_close_fds(int *fds, int nfds);

#endif /* GPUIPC_TEST_HANDLE_H */
