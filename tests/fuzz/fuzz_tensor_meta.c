/*
 * fuzz_tensor_meta.c: libFuzzer target for the tensor meta decoder
 * (include/gpuipc/tensor.h, docs/tensor-meta.md). Any input must decode to
 * a status without reading out of bounds; a meta that decodes must pass
 * the checks its decoder promises (an extent within 2^62 bytes, offset
 * included), and must re-encode to the very same bytes (one encoding per
 * tensor).
 */
#include "tree.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy of exactly size bytes, so that ASan sees any overread. */
  uint8_t *copy = malloc(size ? size : 1);
  if (copy == NULL)
    return 0;
  if (size)
    memcpy(copy, data, size);
  gpuipc_tensor_meta m;
  if (gpuipc_tensor_meta_decode(copy, size, &m) == GPUIPC_OK) {
    uint64_t ext = 0;
    if (gpuipc_tensor_meta_get_extent(&m, &ext) != GPUIPC_OK ||
        ext > ((uint64_t)1 << 62) || m.offset > ((uint64_t)1 << 62) - ext)
      abort();
    if (gpuipc_tensor_meta_check(&m, (size_t)(m.offset + ext)) != GPUIPC_OK)
      abort();
    if (m.user_len && (m.user < (const void *)copy ||
                       (const uint8_t *)m.user + m.user_len != copy + size))
      abort();
    uint8_t again[GPUIPC_TENSOR_META_HDR + 16 * GPUIPC_TENSOR_NDIM_MAX +
                  GPUIPC_TENSOR_META_USER_MAX];
    size_t n = 0;
    if (gpuipc_tensor_meta_encode(&m, again, sizeof again, &n) != GPUIPC_OK ||
        n != size || memcmp(again, copy, size) != 0)
      abort();
  }
  free(copy);
  return 0;
}
