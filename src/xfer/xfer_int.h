/*
 * xfer_int.h: what the transfer layer's files share (src/xfer/ only). The
 * copy engine's and the shared segment's structs are private to xfer.c and
 * xfer_shared.c; what they share with each other and with xfer_host.c is
 * declared in xfer.h, because the tests drive the host copy helpers too.
 */
#ifndef GPUIPC_XFER_INT_H
#define GPUIPC_XFER_INT_H

#include "xfer.h"

#endif /* GPUIPC_XFER_INT_H */
