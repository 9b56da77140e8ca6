/*
 * copy.c: the device-to-device copies of a whole set (a consumer's
 * copy_into, a producer's copy_from) with the fewest driver calls: ranges
 * are sorted by source, and ranges contiguous on both sides are merged, so
 * a consumer whose tensors lie in one allocation in the producer's order
 * copies a piece with one call (never across allocations: see below; two
 * cuMemGetAddressRange lookups per merged range say where they end).
 *
 * The merged ranges then go to the driver as one batched copy
 * (cuMemcpyBatchAsync, CUDA 13.0's form, in chunks of BATCH_MAX), so that
 * a set of many small tensors that are not adjacent (a paged KV cache, a
 * model's experts) costs one call, not one per tensor. In stream order
 * like every copy (the source read in stream order), so the guarantees of
 * the per-range copies hold: after the producer's writes, before the
 * release, no host wait. The per-range cuMemcpyDtoDAsync copies stay the
 * way where the batch cannot go: a driver before 13.0 or without the call,
 * the legacy NULL stream (the batch refuses it), one range, destinations
 * that overlap each other or a source (a batch's copies run in no given
 * order), a batch the driver refused (then the chunk is copied per range,
 * which writes the same bytes).
 */
#include "sets_int.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* The batched copy: 1 allowed (where the driver has it), 0 never (tests
 * force the per-range way with it). Counts of the calls made, for tests. */
int gpuipc__tset_copy_batch = 1;
atomic_ullong gpuipc__tset_copy_batches, gpuipc__tset_copy_singles;

enum { BATCH_MAX = 8192 };

/* -1: the batch is unusable in this process (driver older than 13.0, or
 * without the call, or it refused a well-formed batch); 0: not looked at
 * yet; 1: usable. */
static atomic_int batch_state;

typedef struct range {
  CUdeviceptr src, dst;
  uint64_t len;
} range;

static int by_src(const void *a, const void *b) {
  const range *x = a, *y = b;
  return x->src < y->src ? -1 : x->src > y->src;
}

static int by_dst(const void *a, const void *b) {
  const range *x = a, *y = b;
  return x->dst < y->dst ? -1 : x->dst > y->dst;
}

static bool batch_usable(void) {
  int st = atomic_load_explicit(&batch_state, memory_order_relaxed);
  if (st == 0) {
    int v = 0;
    st = gpuipc__cu.cuMemcpyBatchAsync != NULL &&
                 GPUIPC__CU(cuDriverGetVersion, &v) == CUDA_SUCCESS &&
                 v >= 13000
             ? 1
             : -1;
    GPUIPC__DEBUG("sets", "batched copies: %s (driver %d)",
                  st > 0 ? "cuMemcpyBatchAsync" : "per range", v);
    atomic_store_explicit(&batch_state, st, memory_order_relaxed);
  }
  return st > 0;
}

/* Whether the k ranges (sorted by source) may be copied in any order: no
 * destination overlaps another or a source. */
static bool order_free(const range *r, size_t k) {
  range *byd = malloc(k * sizeof *byd);
  if (byd == NULL)
    return false;
  memcpy(byd, r, k * sizeof *byd);
  bool sorted = true;
  for (size_t i = 1; i < k && sorted; i++)
    sorted = byd[i - 1].dst <= byd[i].dst;
  if (!sorted)
    qsort(byd, k, sizeof *byd, by_dst);
  bool ok = true;
  for (size_t i = 1; i < k && ok; i++)
    ok = byd[i - 1].dst + byd[i - 1].len <= byd[i].dst;
  /* Both lists sorted by start: a sweep finds any destination that meets a
   * source. */
  for (size_t i = 0, j = 0; ok && i < k && j < k;) {
    if (byd[i].dst + byd[i].len <= r[j].src)
      i++;
    else if (r[j].src + r[j].len <= byd[i].dst)
      j++;
    else
      ok = false;
  }
  free(byd);
  return ok;
}

/* Ranges [from, to) of the k, one call each. */
static gpuipc_status copy_each(const range *r, size_t from, size_t to,
                               size_t k, CUstream stream) {
  for (size_t i = from; i < to; i++) {
    CUresult cr = GPUIPC__CU(cuMemcpyDtoDAsync, r[i].dst, r[i].src,
                             (size_t)r[i].len, stream);
    if (cr != CUDA_SUCCESS)
      return gpuipc__fail_cuda(cr, "cuMemcpyDtoDAsync", "range %zu of %zu, "
                               "%llu bytes", i, k,
                               (unsigned long long)r[i].len);
    atomic_fetch_add_explicit(&gpuipc__tset_copy_singles, 1,
                              memory_order_relaxed);
  }
  return GPUIPC_OK;
}

/* The k ranges as batches of at most BATCH_MAX; a chunk the driver refuses
 * goes per range. */
static gpuipc_status copy_batched(int ordinal, const range *r, size_t k,
                                  CUstream stream) {
  size_t cap = k < BATCH_MAX ? k : BATCH_MAX;
  CUdeviceptr *dsts = malloc(cap * sizeof *dsts);
  CUdeviceptr *srcs = malloc(cap * sizeof *srcs);
  size_t *sizes = malloc(cap * sizeof *sizes);
  if (dsts == NULL || srcs == NULL || sizes == NULL) {
    free(dsts);
    free(srcs);
    free(sizes);
    return copy_each(r, 0, k, k, stream);
  }
  CUmemcpyAttributes at;
  memset(&at, 0, sizeof at);
  at.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  at.srcLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
  at.srcLocHint.id = ordinal;
  at.dstLocHint = at.srcLocHint;
  size_t at_idx = 0;
  gpuipc_status s = GPUIPC_OK;
  for (size_t from = 0; from < k && s == GPUIPC_OK; from += cap) {
    size_t n = k - from < cap ? k - from : cap;
    for (size_t i = 0; i < n; i++) {
      dsts[i] = r[from + i].dst;
      srcs[i] = r[from + i].src;
      sizes[i] = (size_t)r[from + i].len;
    }
    CUresult cr = n < 2 ? CUDA_ERROR_NOT_SUPPORTED
                        : GPUIPC__CU(cuMemcpyBatchAsync, dsts, srcs, sizes, n,
                                     &at, &at_idx, 1, stream);
    if (cr == CUDA_SUCCESS) {
      atomic_fetch_add_explicit(&gpuipc__tset_copy_batches, 1,
                                memory_order_relaxed);
      continue;
    }
    s = copy_each(r, from, from + n, k, stream);
    if (s == GPUIPC_OK && n >= 2) {
      /* The ranges were good: the driver refused the batch itself. */
      const char *name = NULL;
      (void)GPUIPC__CU(cuGetErrorName, cr, &name);
      GPUIPC__INFO("sets", "cuMemcpyBatchAsync of %zu ranges: %s; copying "
                   "per range from now on", n, name ? name : "error");
      atomic_store_explicit(&batch_state, -1, memory_order_relaxed);
    }
  }
  free(dsts);
  free(srcs);
  free(sizes);
  return s;
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
  if (k >= 2 && gpuipc__tset_copy_batch && stream != NULL &&
      stream != CU_STREAM_LEGACY && batch_usable() && order_free(r, k))
    s = copy_batched(ordinal, r, k, stream);
  else
    s = copy_each(r, 0, k, k, stream);
  gpuipc__ctx_leave(&g);
  free(r);
  return s;
}
