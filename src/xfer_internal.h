/*
 * xfer_internal.h: what the copy engine shows to tests and tools inside the
 * tree (not part of the public API).
 */
#ifndef GPUIPC_XFER_INTERNAL_H
#define GPUIPC_XFER_INTERNAL_H

#include "internal.h"

/* Pinned host allocations (cuMemHostAlloc) that copy engines of this process
 * hold right now, and their bytes: leak checks after failures. */
uint64_t gpuipc__xfer_pinned_live(uint64_t *bytes /* OUT, may be NULL */);

/* The base of an engine's staging ring (NULL before its first staged copy),
 * so that a test can ask the driver whether it is still pinned. */
void *gpuipc__xfer_staging_base(const gpuipc_xfer *x);

/* ---- host copy helpers (xfer_host.c) ------------------------------------- */

#define GPUIPC__HCOPY_MAX_THREADS 16
typedef struct gpuipc__hcopy gpuipc__hcopy;

/* Starts threads - 1 helper threads (the caller of run is the last one).
 * Starting fewer is not an error: copies are only slower. */
gpuipc_status gpuipc__hcopy_create(int threads, gpuipc__hcopy **out /* OUT */);
void gpuipc__hcopy_destroy(gpuipc__hcopy *p);
/* Threads that share a copy, the caller included (1 for NULL). */
int gpuipc__hcopy_threads(const gpuipc__hcopy *p);
/* memcpy(dst, src, n), split between the helpers and the caller when n is
 * large enough; returns when all of it is done. One caller at a time.
 * p may be NULL (plain memcpy). */
void gpuipc__hcopy_run(gpuipc__hcopy *p, void *dst, const void *src, size_t n);

#endif /* GPUIPC_XFER_INTERNAL_H */
