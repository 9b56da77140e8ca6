/*
 * xfer.h: the transfer layer, as the in-tree tools and tests see it (not
 * part of the public API; no layer above uses it): leak counters and the
 * staging ring's base, the shared segment's header check (a decoder of
 * another process's input), the host copy helpers, and the size below
 * which a pageable copy goes to the driver's own path.
 */
#ifndef GPUIPC_XFER_LAYER_H
#define GPUIPC_XFER_LAYER_H

#include "core/core.h"

/* Pinned host allocations (cuMemHostAlloc) that copy engines of this process
 * hold right now, and their bytes: leak checks after failures. */
uint64_t gpuipc__xfer_pinned_live(uint64_t *bytes /* OUT, may be NULL */);

/* Device scratch allocations (cuMemAlloc) of the pipeline that copy engines
 * of this process hold right now, and their bytes. */
uint64_t gpuipc__xfer_scratch_live(uint64_t *bytes /* OUT, may be NULL */);

/* The base of an engine's staging ring (NULL before its first staged copy),
 * so that a test can ask the driver whether it is still pinned. */
void *gpuipc__xfer_staging_base(const gpuipc_xfer *x);

/* Validates the header of a shared segment at mem, of which avail bytes are
 * readable (fewer than the header's 40: GPUIPC_E_TRUNCATED). exact: the segment
 * must be exactly avail bytes (a memfd of its own) rather than lie at the start
 * of a larger buffer. fn names the caller in the message. The decoder of input
 * from another process: a fuzz target may call it directly. */
gpuipc_status gpuipc__xfer_shared_check_header(const void *mem, size_t avail,
                                               int exact, const char *fn);

/* ---- host copy helpers (xfer_host.c) ------------------------------------- */

#define GPUIPC__HCOPY_MAX_THREADS 16
/* A copy is split between threads only in parts of at least this much
 * (xfer_host.c); the benchmark sets the variable to compare. */
#define GPUIPC__HCOPY_MIN_PART ((size_t)256 << 10)
extern size_t gpuipc__hcopy_min_part;
typedef struct gpuipc__hcopy gpuipc__hcopy;

/* Starts threads - 1 helper threads (the caller of run is the last one).
 * Starting fewer is not an error: copies are only slower. */
gpuipc_status gpuipc__hcopy_create(int threads, gpuipc__hcopy **out /* OUT */);
void gpuipc__hcopy_destroy(gpuipc__hcopy *p);
/* Threads that share a copy, the caller included (1 for NULL). */
int gpuipc__hcopy_threads(const gpuipc__hcopy *p);
/* memcpy(dst, src, n), split between the helpers and the caller when n is
 * large enough; returns when all of it is done. One caller at a time.
 * p may be NULL (plain memcpy). nt: dst is a large destination nobody reads
 * soon (pageable memory being drained into), written with streaming stores
 * where the machine has them. */
void gpuipc__hcopy_run(gpuipc__hcopy *p, void *dst, const void *src, size_t n,
                       bool nt);

/* A pageable source into the device of MIN to MAX bytes (MAX excluded)
 * goes to the driver's own pageable copy when the caller's stream is idle,
 * and a pageable destination below OUT_MAX bytes at any time (xfer.c, run).
 * Tests set the variables to 0 to exercise staging at every size; the
 * benchmark sets them to compare. */
#define GPUIPC__XFER_DRIVER_PAGEABLE_MIN ((size_t)256 << 10)
#define GPUIPC__XFER_DRIVER_PAGEABLE_MAX ((size_t)4 << 20)
#define GPUIPC__XFER_DRIVER_PAGEABLE_OUT_MAX ((size_t)256 << 10)
extern size_t gpuipc__xfer_driver_pageable_min;
extern size_t gpuipc__xfer_driver_pageable_max;
extern size_t gpuipc__xfer_driver_pageable_out_max;
/* The smallest chunk of a staged copy (xfer.c, staged_chunk); the benchmark
 * sets the variable to compare. */
#define GPUIPC__XFER_STAGED_MIN_CHUNK ((size_t)1 << 20)
extern size_t gpuipc__xfer_staged_min_chunk;

#endif /* GPUIPC_XFER_LAYER_H */
