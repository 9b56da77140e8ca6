/*
 * conformance-common.c: the helpers of conformance.h.
 */
#include "conformance.h"
#include "harness.h"

uint32_t conf_pattern_word(uint32_t seed, size_t i) {
  return seed * 2654435761u + (uint32_t)i * 40503u + 1u;
}

void conf_put_pattern(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = malloc(n);
  ASSERT_NOT_NULL(h);
  for (size_t i = 0; i < n / 4; i++)
    h[i] = conf_pattern_word(seed, i);
  ASSERT_CU(gpuipc__cu.cuMemcpyHtoD(p, h, n));
  free(h);
  ASSERT_CU(gpuipc__cu.cuCtxSynchronize());
}

void conf_check_pattern(CUdeviceptr p, size_t n, uint32_t seed) {
  uint32_t *h = malloc(n);
  ASSERT_NOT_NULL(h);
  memset(h, 0, n);
  ASSERT_CU(gpuipc__cu.cuMemcpyDtoH(h, p, n));
  for (size_t i = 0; i < n / 4; i++)
    if (h[i] != conf_pattern_word(seed, i))
      harness_fail(__FILE__, __LINE__,
                   "pattern %u: word %zu of %zu reads 0x%08x, want 0x%08x",
                   seed, i, n / 4, h[i], conf_pattern_word(seed, i));
  free(h);
}
