/*
 * fuzz_sets_table.c: libFuzzer target for the tensor-set table decoder
 * (docs/sets.md). Any input must decode to a status without reading out of
 * bounds; a table that decodes must re-encode to the very same bytes (one
 * encoding per meaning: padding and reserved fields are zero), and must
 * satisfy what the decoder promises (entries inside their pieces, no two
 * overlapping, every name found by the index).
 */
#include "tree.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(const uint8_t *copy, size_t size) {
  gpuipc__tset_table t;
  if (gpuipc__tset_table_decode(copy, size, &t) != GPUIPC_OK)
    return;
  for (uint32_t i = 0; i < t.n_entries; i++) {
    const gpuipc__tset_entry *e = &t.e[i];
    if (e->piece >= t.n_pieces || e->offset + e->nbytes > t.piece_len[e->piece])
      abort();
    if (gpuipc__tset_table_find(&t, t.names + e->name_off, e->name_len) !=
        (long)i)
      abort();
  }
  uint8_t *again = NULL;
  size_t n = 0;
  if (gpuipc__tset_table_encode(&t, &again, &n) != GPUIPC_OK || n != size ||
      memcmp(again, copy, size) != 0)
    abort();
  free(again);
  gpuipc__tset_table_free(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy of exactly size bytes, so that ASan sees any overread. */
  uint8_t *copy = malloc(size ? size : 1);
  if (copy == NULL)
    return 0;
  if (size)
    memcpy(copy, data, size);
  check(copy, size);
  /* The checksum stops almost every mutation early; so also decode the
   * input with its checksum made right, which lets the fuzzer reach the
   * checks of the fields behind it. */
  if (size >= GPUIPC__TSET_HDR_LEN) {
    uint32_t declared = (uint32_t)copy[8] | (uint32_t)copy[9] << 8 |
                        (uint32_t)copy[10] << 16 | (uint32_t)copy[11] << 24;
    if (declared >= GPUIPC__TSET_HDR_LEN && declared <= size) {
      memset(copy + 12, 0, 4);
      uint32_t c = gpuipc__crc32c(0, copy, declared);
      for (int i = 0; i < 4; i++)
        copy[12 + i] = (uint8_t)(c >> (8 * i));
      gpuipc__tset_table t;
      if (gpuipc__tset_table_decode(copy, size, &t) == GPUIPC_E_BAD_CHECKSUM)
        abort();
      gpuipc__tset_table_free(&t);
      check(copy, size);
    }
  }
  free(copy);
  return 0;
}
