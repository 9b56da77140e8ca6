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

#endif /* GPUIPC_XFER_INTERNAL_H */
