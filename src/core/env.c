/*
 * env.c: owns the reading of environment variables: gpuipc__param_get, the
 * getter behind every parameter that a file declares with GPUIPC__PARAM
 * (param.h), and gpuipc__params, the list of them, walked from the linker
 * section the declarations fill. It is the one caller of getenv() in the
 * library. It depends on nothing else in the library (no logging, no
 * errors), so that the logger, which reads its GPUIPC_LOG* parameters
 * through it, and the error module, which logs, sit above it without a call
 * cycle between core's files.
 */
#include "core_int.h"

#include <stdlib.h>

/* Stored for a ONCE parameter found unset. */
static const char unset_mark[1];

const char *gpuipc__param_get(gpuipc__param *p) {
  if (p->when != GPUIPC__PARAM_ONCE)
    return getenv(p->name);
  const char *v = atomic_load_explicit(&p->value, memory_order_acquire);
  if (v == NULL) {
    const char *e = getenv(p->name);
    const char *want = e ? e : unset_mark;
    const char *expected = NULL;
    /* A racing first reader stored what it found: that one stays. */
    if (atomic_compare_exchange_strong_explicit(&p->value, &expected, want,
                                                memory_order_acq_rel,
                                                memory_order_acquire))
      v = want;
    else
      v = expected;
  }
  return v == unset_mark ? NULL : v;
}

/* The bounds of the section of the GPUIPC__PARAM declarations, made by the
 * linker (weak: a program with none links too). */
extern gpuipc__param *const __start_gpuipc_params[]
    __attribute__((weak, visibility("hidden")));
extern gpuipc__param *const __stop_gpuipc_params[]
    __attribute__((weak, visibility("hidden")));

gpuipc__param *const *gpuipc__params(size_t *count) {
  if (__start_gpuipc_params == NULL || __stop_gpuipc_params == NULL) {
    *count = 0;
    return NULL;
  }
  *count = (size_t)(__stop_gpuipc_params - __start_gpuipc_params);
  return __start_gpuipc_params;
}
