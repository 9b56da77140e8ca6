/*
 * fuzz_descriptor.c: libFuzzer target for the descriptor decoder. Any input
 * must decode to a status without reading out of bounds; a descriptor that
 * decodes must re-encode to the very same bytes (the format has one
 * encoding per meaning: unused bytes and reserved fields must be zero).
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
  gpuipc__desc d;
  gpuipc_status s = gpuipc__desc_decode(copy, size, &d);
  if (s == GPUIPC_OK && size == GPUIPC__DESC_LEN) {
    uint8_t again[GPUIPC_DESC_MAX];
    size_t n = 0;
    if (gpuipc__desc_encode(&d, again, sizeof again, &n) != GPUIPC_OK ||
        n != size || memcmp(again, copy, size) != 0)
      abort();
  }
  gpuipc_desc_info info = GPUIPC_DESC_INFO_INIT;
  gpuipc_status s2 = gpuipc_desc_get_info(copy, size, &info);
  if (s2 != s)
    abort();
  /* The checksum stops almost every mutation early; so also decode the
   * input with its checksum made right, which lets the fuzzer reach the
   * checks of the fields behind it. */
  if (size >= 16) {
    uint32_t declared = (uint32_t)copy[8] | (uint32_t)copy[9] << 8 |
                        (uint32_t)copy[10] << 16 | (uint32_t)copy[11] << 24;
    if (declared >= 16 && declared <= size) {
      memset(copy + 12, 0, 4);
      uint32_t c = gpuipc__crc32c(0, copy, declared);
      for (int i = 0; i < 4; i++)
        copy[12 + i] = (uint8_t)(c >> (8 * i));
      s = gpuipc__desc_decode(copy, size, &d);
      if (s == GPUIPC_E_BAD_CHECKSUM)
        abort();
      if (s == GPUIPC_OK && size == GPUIPC__DESC_LEN) {
        uint8_t again[GPUIPC_DESC_MAX];
        size_t n = 0;
        if (gpuipc__desc_encode(&d, again, sizeof again, &n) != GPUIPC_OK ||
            n != size || memcmp(again, copy, size) != 0)
          abort();
      }
    }
  }
  free(copy);
  return 0;
}
