/*
 * device.h: device naming (UUID <-> local ordinal) and the capability probe
 * shared by the library and `gpuipc doctor`.
 */
#ifndef GPUIPC_DEVICE_H
#define GPUIPC_DEVICE_H

#include "driver.h"

#endif /* GPUIPC_DEVICE_H */
