/*
 * core_int.h: what the core layer's own files share (src/core/ only). The
 * layers above see core.h.
 */
#ifndef GPUIPC_CORE_INT_H
#define GPUIPC_CORE_INT_H

#include "core.h"

/* Stores the CUresult reported by gpuipc_last_cuda_error() (driver.c calls
 * it after gpuipc__fail; error.c owns the per-thread state). */
void gpuipc__set_cuda_error(int curesult);

#endif /* GPUIPC_CORE_INT_H */
