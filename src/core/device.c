/*
 * device.c: owns device naming. Devices cross process boundaries as UUIDs,
 * never ordinals, because CUDA_VISIBLE_DEVICES may differ between processes
 * (DESIGN rule 4); this file maps between the two.
 */
#include "core_int.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

gpuipc_status gpuipc_device_count(int *count) {
  if (count == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_device_count: NULL");
  GPUIPC__CHECK(gpuipc__driver());
  GPUIPC__CU_CHECK(cuDeviceGetCount, count);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_device_uuid(int ordinal, gpuipc_uuid *uuid) {
  if (uuid == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_device_uuid: NULL");
  GPUIPC__CHECK(gpuipc__driver());
  CUdevice dev;
  CUresult r = GPUIPC__CU(cuDeviceGet, &dev, ordinal);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuDeviceGet", "ordinal %d", ordinal);
  CUuuid u;
  r = GPUIPC__CU(cuDeviceGetUuid, &u, dev);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuDeviceGetUuid", "ordinal %d", ordinal);
  memcpy(uuid->bytes, u.bytes, 16);
  return GPUIPC_OK;
}

/* The visible devices' UUIDs, read once: the set a process sees never
 * changes after cuInit, and every import resolves a UUID, so this saves two
 * driver calls per device per lookup. */
#define GPUIPC__UUID_TABLE_MAX 64
static pthread_mutex_t uuid_lock = PTHREAD_MUTEX_INITIALIZER;
static bool uuids_read;
static int n_uuids;
static gpuipc_uuid uuids[GPUIPC__UUID_TABLE_MAX];

static gpuipc_status read_uuid_table(void) { /* uuid_lock held */
  if (uuids_read)
    return GPUIPC_OK;
  int n = 0;
  GPUIPC__CHECK(gpuipc_device_count(&n));
  if (n > GPUIPC__UUID_TABLE_MAX)
    n = GPUIPC__UUID_TABLE_MAX;
  for (int i = 0; i < n; i++)
    GPUIPC__CHECK(gpuipc_device_uuid(i, &uuids[i]));
  n_uuids = n;
  uuids_read = true;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_device_from_uuid(const gpuipc_uuid *uuid, int *ordinal) {
  if (uuid == NULL || ordinal == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_device_from_uuid: NULL");
  GPUIPC__CHECK(gpuipc__driver());
  pthread_mutex_lock(&uuid_lock);
  gpuipc_status s = read_uuid_table();
  int n = n_uuids;
  for (int i = 0; s == GPUIPC_OK && i < n; i++)
    if (memcmp(uuids[i].bytes, uuid->bytes, 16) == 0) {
      pthread_mutex_unlock(&uuid_lock);
      *ordinal = i;
      return GPUIPC_OK;
    }
  pthread_mutex_unlock(&uuid_lock);
  if (s != GPUIPC_OK)
    return s;
  char text[GPUIPC_UUID_STRLEN];
  gpuipc_uuid_format(uuid, text);
  return gpuipc__fail(GPUIPC_E_DEVICE_NOT_VISIBLE,
                      "device %s is not visible in this process (%d visible "
                      "device(s); check CUDA_VISIBLE_DEVICES)",
                      text, n);
}

gpuipc_status gpuipc__resolve_device(const gpuipc_uuid *uuid, int ordinal,
                                     int *out) {
  if (uuid)
    return gpuipc_device_from_uuid(uuid, out);
  int n = 0;
  GPUIPC__CHECK(gpuipc_device_count(&n));
  if (ordinal < 0 || ordinal >= n)
    return gpuipc__fail(GPUIPC_E_NO_DEVICE,
                        "device ordinal %d: %d device(s) visible", ordinal, n);
  *out = ordinal;
  return GPUIPC_OK;
}

void gpuipc_uuid_format(const gpuipc_uuid *uuid, char *buf) {
  static const char hex[] = "0123456789abcdef";
  char *p = buf;
  memcpy(p, "GPU-", 4);
  p += 4;
  for (int i = 0; i < 16; i++) {
    if (i == 4 || i == 6 || i == 8 || i == 10)
      *p++ = '-';
    *p++ = hex[uuid->bytes[i] >> 4];
    *p++ = hex[uuid->bytes[i] & 15];
  }
  *p = '\0';
}

gpuipc_status gpuipc_uuid_parse(const char *text, gpuipc_uuid *uuid) {
  if (text == NULL || uuid == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_uuid_parse: NULL");
  const char *p = text;
  if (strncmp(p, "GPU-", 4) == 0)
    p += 4;
  int k = 0;
  uint8_t out[16];
  for (; *p && k < 32; p++) {
    if (*p == '-')
      continue;
    int v = (*p >= '0' && *p <= '9')   ? *p - '0'
            : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
            : (*p >= 'A' && *p <= 'F') ? *p - 'A' + 10
                                       : -1;
    if (v < 0)
      break;
    if (k % 2 == 0)
      out[k / 2] = (uint8_t)(v << 4);
    else
      out[k / 2] |= (uint8_t)v;
    k++;
  }
  if (k != 32 || *p != '\0')
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "'%s' is not a device UUID (GPU-xxxxxxxx-xxxx-xxxx-"
                        "xxxx-xxxxxxxxxxxx)",
                        text);
  memcpy(uuid->bytes, out, 16);
  return GPUIPC_OK;
}
