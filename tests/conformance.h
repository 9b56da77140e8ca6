/*
 * conformance.h: helpers shared by the conformance checks (driver API
 * directly, through gpuipc's entry-point table).
 */
#ifndef GPUIPC_TEST_CONFORMANCE_H
#define GPUIPC_TEST_CONFORMANCE_H

#include "tree.h"

#include <stddef.h>
#include <stdint.h>

/* Word i of the recognizable pattern of seed. */
uint32_t conf_pattern_word(uint32_t seed, size_t i);
/* Writes the pattern of seed to n bytes of device memory and waits until it
 * is there: a copy from pageable memory may return before the data reaches
 * the device (cuda.h, "API synchronization behavior"), and another process
 * is about to look. */
void conf_put_pattern(CUdeviceptr p, size_t n, uint32_t seed);
/* Reads n bytes back and fails the test unless they hold the pattern. */
void conf_check_pattern(CUdeviceptr p, size_t n, uint32_t seed);

#endif
