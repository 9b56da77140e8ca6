/*
 * param.h: the environment variables gpuipc reads, one declared parameter
 * per variable, as NCCL's NCCL_PARAM does. A file that reads a variable
 * declares it once, beside its use, with its default and one line saying
 * what it sets:
 *
 *   GPUIPC__PARAM(log_level, "GPUIPC_LOG", GPUIPC__PARAM_ONCE, "warn",
 *                 "log level: off, error, warn, info, debug, trace")
 *
 * and reads it through the getter the declaration defines,
 * param_log_level() (the variable's text, or NULL when it is unset); the
 * file keeps its own parsing and its own messages for bad values. Every
 * declaration also lands in one linker section, so that the list of
 * variables (gpuipc__params(), what `gpuipc doctor` prints) is made by the
 * declarations themselves and cannot miss one; docs/environment.md lists the
 * same variables, and tools/check-env fails when the two differ or when a
 * file of src/ calls getenv() itself.
 */
#ifndef GPUIPC_CORE_PARAM_H
#define GPUIPC_CORE_PARAM_H

#include <stdatomic.h>
#include <stddef.h>

/* When a parameter is read. */
enum {
  /* At its first use; the process keeps that value (thread-safe: of racing
   * first reads, the first to store its value wins, and all return it). */
  GPUIPC__PARAM_ONCE,
  /* At each use: the variable is read when the thing it sets is made (a
   * connection, a listener, the driver's load), and programs and tests
   * set it between two of them. */
  GPUIPC__PARAM_EACH_USE,
  /* Set by gpuipc for a process it starts (the child's end of the
   * connection, a worker's index), read at each use. */
  GPUIPC__PARAM_CHILD,
};

typedef struct gpuipc__param {
  const char *name; /* the environment variable */
  int when;         /* GPUIPC__PARAM_ONCE, _EACH_USE or _CHILD */
  const char *dflt; /* what holds while it is unset, in words; NULL: nothing */
  const char *what; /* one line: what it sets */
  _Atomic(const char *) value; /* ONCE: what the first read found */
} gpuipc__param;

/* The variable's text, or NULL when it is unset: read now, or (ONCE) the
 * text the first read found. The string is the environment's own: glibc
 * never frees a value that setenv replaces, so it stays valid. */
const char *gpuipc__param_get(gpuipc__param *p);

/* Every parameter declared in the objects linked into this program (or
 * library): *count of them, in no particular order. */
gpuipc__param *const *gpuipc__params(size_t *count);

/* Declares the parameter `id` for the variable `env` and its getter
 * param_<id>(). One declaration per variable, in the file that reads it. */
#define GPUIPC__PARAM(id, env, when, dflt, what)                               \
  static gpuipc__param gpuipc__param_##id = {env, when, dflt, what, NULL};     \
  static gpuipc__param *const gpuipc__param_reg_##id                           \
      __attribute__((used, section("gpuipc_params"))) = &gpuipc__param_##id;   \
  __attribute__((unused)) static inline const char *param_##id(void) {         \
    return gpuipc__param_get(&gpuipc__param_##id);                             \
  }

#endif
