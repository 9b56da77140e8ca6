/*
 * proc_int.h: what the process layer's files share (src/proc/ only). proc.c
 * builds on the public connection and descriptor API and the core layer;
 * the layers above (mpi) use its public API only.
 */
#ifndef GPUIPC_PROC_INT_H
#define GPUIPC_PROC_INT_H

#include "conn/conn.h"

#endif /* GPUIPC_PROC_INT_H */
