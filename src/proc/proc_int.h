/*
 * proc_int.h: what the process layer's files share (src/proc/ only). Its one
 * file, proc.c, needs nothing private of a lower layer: the public
 * connection API (a socket pair, a connection from an inherited fd,
 * progress, close) and the core layer's errors and clock, which conn/conn.h
 * brings. No layer above calls it: mpi makes its connections itself.
 */
#ifndef GPUIPC_PROC_INT_H
#define GPUIPC_PROC_INT_H

#include "conn/conn.h"

#endif /* GPUIPC_PROC_INT_H */
