/*
 * tree.h: the one internal header the in-tree programs include (the gpuipc
 * CLI in tools/, the benchmarks in bench/, the tests in tests/), as curl's
 * tool includes only the curlx functions it is allowed. It brings each
 * layer's header for the layers above, never a layer's private *_int.h:
 *
 *   core/core.h      the driver table (gpuipc__cu), contexts, errors, clock,
 *                    the default runtime directory
 *   core/stats.h     the stats segment's layout (gpuipc ls reads it)
 *   handle/handle.h  descriptors (decode, encode, identity), buffer info,
 *                    liveness-table constants
 *   conn/conn.h      queued messages, block holders, arena chunk
 *                    counters, imports kept past a close
 *   conn/wire.h      the connection frame format (docs/protocol.md), for
 *                    the tests and fuzzers that play a peer
 *   conn/carrier.h   the carriers' ops table, for the fuzzer that drives
 *                    the ring carrier alone (fuzz-ring-records)
 *   sets/sets.h      the tensor-set table codec (docs/sets.md) and the
 *                    meta of a set's buffers
 *   xfer/xfer.h      copy-engine leak counters, host copy helpers, the
 *                    shared segment's header check
 *
 * Programs outside the tree use the public headers in include/ only.
 */
#ifndef GPUIPC_TREE_H
#define GPUIPC_TREE_H

#include "core/core.h"
#include "core/stats.h"
#include "handle/handle.h"
#include "conn/conn.h"
#include "conn/wire.h"
#include "conn/carrier.h"
#include "sets/sets.h"
#include "xfer/xfer.h"

#endif /* GPUIPC_TREE_H */
