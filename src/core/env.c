/*
 * env.c: owns the one getter of environment variables, gpuipc__getenv. It
 * depends on nothing else in the library, so that the logger (which reads
 * GPUIPC_LOG* through it) and the error module (which logs) sit above it
 * without a call cycle between core's files.
 */
#include "core_int.h"

#include <stdlib.h>

const char *gpuipc__getenv(const char *name) { return getenv(name); }
