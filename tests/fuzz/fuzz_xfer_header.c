/*
 * fuzz_xfer_header.c: libFuzzer target for the check of a shared segment's
 * header (gpuipc__xfer_shared_check_header), the decoder of what another
 * process wrote at the start of a segment it hands over. Any input must
 * give a status without reading past the bytes it was given, both as a
 * whole segment (exact) and as the start of a larger buffer; a header
 * accepted for the exact size must also be accepted for any larger buffer,
 * and one accepted at the start of a buffer must fit in it.
 *
 * Input: the header bytes (the rest of a real segment is not read).
 * The checked size is the input's length, and, as the start of a larger
 * buffer, the size the header itself declares (when it is plausible).
 */
#include "tree.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t *copy = malloc(size ? size : 1);
  if (copy == NULL)
    return 0;
  if (size)
    memcpy(copy, data, size);
  gpuipc_status exact = gpuipc__xfer_shared_check_header(copy, size, 1, "fuzz");
  gpuipc_status part = gpuipc__xfer_shared_check_header(copy, size, 0, "fuzz");
  if (exact < 0 || exact >= GPUIPC__STATUS_END || part < 0 ||
      part >= GPUIPC__STATUS_END)
    abort();
  /* Exactly the size it declares implies "at most" that size. */
  if (exact == GPUIPC_OK && part != GPUIPC_OK)
    abort();
  if (size >= 40) {
    uint64_t total;
    memcpy(&total, copy + 32, sizeof total);
    /* The declared total, checked as the avail of a larger mapping: the
     * function reads only the header, so the buffer need not be that big. */
    if (total >= 40 && total <= ((uint64_t)1 << 40)) {
      gpuipc_status e2 =
          gpuipc__xfer_shared_check_header(copy, (size_t)total, 1, "fuzz");
      gpuipc_status p2 =
          gpuipc__xfer_shared_check_header(copy, (size_t)total, 0, "fuzz");
      if (e2 == GPUIPC_OK && p2 != GPUIPC_OK)
        abort();
      if (part == GPUIPC_OK && p2 != GPUIPC_OK)
        abort(); /* fits in size bytes, so in total >= ... bytes */
    }
  }
  free(copy);
  return 0;
}
