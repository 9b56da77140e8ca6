/*
 * gather.cu: the gather/scatter copy kernel of whole-set copies (copy.c).
 * Compiled by tools/gen-gather into src/sets/gather_image.h (a fatbin with
 * SASS for the common architectures and compute_75 PTX), which the
 * library loads through the driver API (cuModuleLoadData); no CUDA runtime
 * library is involved.
 *
 * One launch copies up to GPUIPC__GATHER_N ranges given by value in the
 * parameter: block (x, y) copies slice y of entry x (grid.y slices, each a
 * multiple of 16 bytes but the last). Its threads move 16-byte vectors
 * where source and destination are both 16-byte aligned, else 8, 4, 2 or
 * 1 bytes as the two addresses allow, and the bytes past the last whole
 * vector one by one: correct for any alignment and length. The ranges must
 * not overlap each other (copy.c sends only ranges that may be copied in
 * any order).
 */
#include "gather.h"

/* Bytes [lo, hi) of the entry, in T-sized moves (src and dst aligned to
 * sizeof(T), lo a multiple of 16), then the bytes past the last whole T.
 * Four loads in flight per thread before their stores (the ranges do not
 * overlap: __restrict__ lets them be issued together). */
template <typename T>
__device__ __forceinline__ void copy_as(uint64_t src, uint64_t dst,
                                        uint64_t lo, uint64_t hi) {
  const uint64_t w = sizeof(T);
  const uint64_t body = lo + (hi - lo) / w * w;
  const T *__restrict__ s = reinterpret_cast<const T *>(src);
  T *__restrict__ d = reinterpret_cast<T *>(dst);
  const uint64_t step = blockDim.x, end = body / w;
  uint64_t i = lo / w + threadIdx.x;
  for (; i + 3 * step < end; i += 4 * step) {
    const T a0 = s[i], a1 = s[i + step], a2 = s[i + 2 * step],
            a3 = s[i + 3 * step];
    d[i] = a0;
    d[i + step] = a1;
    d[i + 2 * step] = a2;
    d[i + 3 * step] = a3;
  }
  for (; i < end; i += step)
    d[i] = s[i];
  const unsigned char *__restrict__ sb =
      reinterpret_cast<const unsigned char *>(src);
  unsigned char *__restrict__ db = reinterpret_cast<unsigned char *>(dst);
  for (uint64_t j = body + threadIdx.x; j < hi; j += step)
    db[j] = sb[j];
}

extern "C" __global__ void __launch_bounds__(GPUIPC__GATHER_THREADS)
    gpuipc_gather(const __grid_constant__ gpuipc__gather_args a) {
  if (blockIdx.x >= a.n)
    return;
  const gpuipc__gather_entry *e = &a.e[blockIdx.x];
  const uint64_t src = e->src, dst = e->dst, len = e->len;
  /* Slices are multiples of 16 bytes, so every slice starts as aligned as
   * the entry itself. */
  uint64_t per = (len + gridDim.y - 1) / gridDim.y;
  per = (per + 15) & ~(uint64_t)15;
  const uint64_t lo = per * blockIdx.y < len ? per * blockIdx.y : len;
  const uint64_t hi = len - lo > per ? lo + per : len;
  if (lo >= hi)
    return;
  const uint64_t al = src | dst;
  if (al % 16 == 0)
    copy_as<uint4>(src, dst, lo, hi);
  else if (al % 8 == 0)
    copy_as<uint2>(src, dst, lo, hi);
  else if (al % 4 == 0)
    copy_as<unsigned int>(src, dst, lo, hi);
  else if (al % 2 == 0)
    copy_as<unsigned short>(src, dst, lo, hi);
  else
    copy_as<unsigned char>(src, dst, lo, hi);
}
