/*
 * copy.c: the device-to-device copies of a whole set (a consumer's
 * copy_into, a producer's copy_from) with the fewest driver calls: ranges
 * are sorted by source, and ranges contiguous on both sides are merged, so
 * a consumer whose tensors lie in one allocation in the producer's order
 * copies a piece with one call (never across allocations: see below; two
 * cuMemGetAddressRange lookups per merged range say where they end). Each
 * merged range is one cuMemcpyDtoDAsync (the driver's batched copy,
 * cuMemcpyBatchAsync, is not in the driver table: the emulator does not
 * implement it yet).
 */
#include "sets_int.h"

#include <stdlib.h>

typedef struct range {
  CUdeviceptr src, dst;
  uint64_t len;
} range;

static int by_src(const void *a, const void *b) {
  const range *x = a, *y = b;
  return x->src < y->src ? -1 : x->src > y->src;
}

gpuipc_status gpuipc__tset_copy(int ordinal, const CUdeviceptr *srcs,
                                const CUdeviceptr *dsts, const uint64_t *lens,
                                size_t n, CUstream stream) {
  range *r = malloc((n ? n : 1) * sizeof *r);
  if (r == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set copy of %zu ranges", n);
  size_t m = 0;
  bool sorted = true;
  for (size_t i = 0; i < n; i++) {
    if (srcs[i] == 0 || dsts[i] == 0 || lens[i] == 0)
      continue;
    r[m] = (range){srcs[i], dsts[i], lens[i]};
    if (m && r[m].src < r[m - 1].src)
      sorted = false;
    m++;
  }
  if (!sorted)
    qsort(r, m, sizeof *r, by_src);
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, ordinal);
  if (s != GPUIPC_OK) {
    free(r);
    return s;
  }
  /* Merging: two ranges contiguous on both sides become one copy, but only
   * inside one allocation on each side (allocations made one after the
   * other may be adjacent in the address space, and a copy may not span
   * two). The allocations are looked up only when a merge is possible,
   * once per merged range. */
  size_t k = 0;
  CUdeviceptr sb = 0, db = 0;
  size_t sl = 0, dl = 0;
  bool known = false;
  for (size_t i = 0; i < m; i++) {
    if (k && r[k - 1].src + r[k - 1].len == r[i].src &&
        r[k - 1].dst + r[k - 1].len == r[i].dst) {
      if (!known) {
        known = GPUIPC__CU(cuMemGetAddressRange, &sb, &sl, r[k - 1].src) ==
                    CUDA_SUCCESS &&
                GPUIPC__CU(cuMemGetAddressRange, &db, &dl, r[k - 1].dst) ==
                    CUDA_SUCCESS;
        if (!known)
          sb = db = 0, sl = dl = 0; /* unknown: never merge this range */
        known = true;
      }
      if (r[i].src + r[i].len <= sb + sl && r[i].dst + r[i].len <= db + dl &&
          r[k - 1].src >= sb && r[k - 1].dst >= db) {
        r[k - 1].len += r[i].len;
        continue;
      }
    }
    r[k++] = r[i];
    known = false;
  }
  for (size_t i = 0; i < k && s == GPUIPC_OK; i++) {
    CUresult cr = GPUIPC__CU(cuMemcpyDtoDAsync, r[i].dst, r[i].src,
                             (size_t)r[i].len, stream);
    if (cr != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(cr, "cuMemcpyDtoDAsync", "range %zu of %zu, %llu "
                            "bytes", i, k, (unsigned long long)r[i].len);
  }
  gpuipc__ctx_leave(&g);
  free(r);
  return s;
}
