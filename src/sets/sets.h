/*
 * sets/sets.h: what the tensor-set layer offers the in-tree programs
 * (through src/tree.h): the table codec of docs/sets.md and the meta
 * format of the buffers a set sends, so that tests and the fuzz target can
 * build and decode tables (hostile ones included) byte for byte, and the
 * gather kernel of whole-set copies, for the benchmark's floor.
 */
#ifndef GPUIPC_SETS_LAYER_H
#define GPUIPC_SETS_LAYER_H

#include "gpuipc.h"
#include "core/core.h"
#include "gather.h"

#include <stdatomic.h>
#include <stdbool.h>

/* The table (docs/sets.md). */
#define GPUIPC__TSET_MAGIC 0x53545047u      /* "GPTS" */
#define GPUIPC__TSET_VERSION 1
#define GPUIPC__TSET_HDR_LEN 48
/* One chunk message of a table: a 16-byte header, then table bytes. */
#define GPUIPC__TSET_CHUNK_MAGIC 0x43535447u /* "GTSC" */
#define GPUIPC__TSET_CHUNK_HDR 16
#define GPUIPC__TSET_CHUNK_DATA (GPUIPC_CONN_MSG_MAX - GPUIPC__TSET_CHUNK_HDR)
/* The meta of every buffer a set sends. */
#define GPUIPC__TSET_META_MAGIC 0x42535447u  /* "GTSB" */
#define GPUIPC__TSET_META_LEN 32
enum { GPUIPC__TSET_PIECE = 1, GPUIPC__TSET_VERSION_TOKEN = 2,
       GPUIPC__TSET_END = 3, GPUIPC__TSET_REPLACE = 4 };
/* Why an END: the `b` of its meta. */
enum { GPUIPC__TSET_END_UNSUBSCRIBED = 0, GPUIPC__TSET_END_HELD = 1 };

typedef struct gpuipc__tset_entry {
  uint32_t name_off; /* into the table's names (NUL-terminated) */
  uint16_t name_len;
  uint8_t dtype;
  uint8_t ndim;
  uint32_t piece; /* within one copy */
  uint64_t offset;
  uint64_t nbytes;
  int64_t shape[GPUIPC_TSET_NDIM_MAX];
  int64_t strides[GPUIPC_TSET_NDIM_MAX];
} gpuipc__tset_entry;

/* A decoded (or to-be-encoded) table. */
typedef struct gpuipc__tset_table {
  uint64_t layout_id;
  uint32_t n_entries;
  uint32_t n_pieces; /* per copy */
  uint32_t copies;
  uint64_t *piece_len;       /* n_pieces */
  gpuipc__tset_entry *e;     /* n_entries */
  char *names;               /* all names, each NUL-terminated */
  size_t names_len;
  uint32_t *hash;            /* name hash index (decode builds it) */
  uint32_t hash_cap;         /* power of two; 0: none */
} gpuipc__tset_table;

typedef struct gpuipc__tset_meta {
  uint16_t kind;
  uint64_t layout_id;
  uint64_t a; /* PIECE: index; VERSION: number; END: 0; REPLACE: copy */
  uint32_t b; /* PIECE, REPLACE: pieces in all copies; VERSION: copy;
                 END: why (GPUIPC__TSET_END_*) */
  uint32_t c; /* PIECE: the table's length; REPLACE: the copy's new
                 generation (the producer's count of its retirements: later
                 ones are larger); else 0 */
} gpuipc__tset_meta;

/* The byte extent of a tensor: 0 when any size is 0, else
 * elem * (1 + sum (shape[i]-1) * strides[i]). GPUIPC_E_OUT_OF_RANGE on
 * overflow (beyond 2^62). */
gpuipc_status gpuipc__tset_extent(int dtype, int ndim, const int64_t *shape,
                                  const int64_t *strides, uint64_t *out);

/* Checks a table's entries (names, dtypes, shapes, extents, pieces,
 * overlaps, unique names) and builds its name index. Encode and decode
 * both run it. */
gpuipc_status gpuipc__tset_table_check(gpuipc__tset_table *t);

/* Encodes a table (checked first) into a new malloc'ed buffer. */
gpuipc_status gpuipc__tset_table_encode(gpuipc__tset_table *t,
                                        uint8_t **out /* OUT */,
                                        size_t *len /* OUT */);
/* Decodes and validates len bytes; on success *t owns new memory
 * (gpuipc__tset_table_free). On failure nothing is kept and the status
 * says what: TRUNCATED, BAD_MAGIC, BAD_VERSION, BAD_CHECKSUM, PROTOCOL
 * (inconsistent fields, counts that do not match the bytes, reserved bits,
 * names), BAD_KIND (dtype), OUT_OF_RANGE (extents, pieces, overlaps). */
gpuipc_status gpuipc__tset_table_decode(const uint8_t *in, size_t len,
                                        gpuipc__tset_table *t /* OUT */);
void gpuipc__tset_table_free(gpuipc__tset_table *t);
/* Index of the entry named name (len bytes) in a checked table, or -1. */
long gpuipc__tset_table_find(const gpuipc__tset_table *t, const char *name,
                             size_t len);

void gpuipc__tset_meta_encode(const gpuipc__tset_meta *m,
                              uint8_t out[GPUIPC__TSET_META_LEN]);
gpuipc_status gpuipc__tset_meta_decode(const uint8_t *in, size_t len,
                                       gpuipc__tset_meta *m /* OUT */);

/* The whole-set copies (copy.c): gpuipc__tset_copy_kernel 0 keeps the
 * gather kernel off, gpuipc__tset_copy_batch 0 the batched call (tests
 * force the ways after them with these); the kernel launches, batched and
 * single copy calls made so far. */
extern int gpuipc__tset_copy_kernel, gpuipc__tset_copy_batch;
extern atomic_ullong gpuipc__tset_copy_kernels, gpuipc__tset_copy_batches,
    gpuipc__tset_copy_singles;

/* The fewest device-to-device copies for n (src, dst, len) ranges: sorted
 * by source, adjacent ranges (contiguous on both sides) merged, then the
 * gather kernel for the short ones that lie in device memory of device
 * ordinal, then one batched copy (cuMemcpyBatchAsync) where the driver and
 * the ranges allow, else one cuMemcpyDtoDAsync each (copy.c says when), on
 * stream in the device's primary context. srcs[i]/dsts[i]: 0 skips range
 * i. (Declared here for the tests.) */
gpuipc_status gpuipc__tset_copy(int ordinal, const CUdeviceptr *srcs,
                                const CUdeviceptr *dsts, const uint64_t *lens,
                                size_t n, CUstream stream);

/* The gather kernel alone (for the benchmark's floor): the n ranges as
 * they are (not sorted, not merged; each shorter than
 * GPUIPC__GATHER_LEN_MAX, none overlapping another), in launches of
 * GPUIPC__GATHER_N on stream, on device ordinal's primary context (made
 * current for the call). GPUIPC_E_NOT_SUPPORTED where the device cannot
 * load the kernel. */
gpuipc_status gpuipc__tset_gather(int ordinal, const CUdeviceptr *srcs,
                                  const CUdeviceptr *dsts,
                                  const uint64_t *lens, size_t n,
                                  CUstream stream);

#endif /* GPUIPC_SETS_LAYER_H */
