/*
 * xfer_int.h: what the transfer layer's files share (src/xfer/ only): no
 * more than xfer.h. The copy engine's and the shared segment's structs are
 * private to xfer.c and xfer_shared.c, which share nothing with each other;
 * the host copy helpers xfer.c takes from xfer_host.c are declared in
 * xfer.h, because the tests drive them too.
 */
#ifndef GPUIPC_XFER_INT_H
#define GPUIPC_XFER_INT_H

#include "xfer.h"

#endif /* GPUIPC_XFER_INT_H */
