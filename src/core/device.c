/*
 * device.c: owns device naming. Devices cross process boundaries as UUIDs,
 * never ordinals, because CUDA_VISIBLE_DEVICES may differ between processes
 * (DESIGN rule 4); this file maps between the two. It also reads the IMEX
 * channels that fabric handles need (gpuipc__imex_probe), for the reports
 * that say why the driver refuses them.
 */
#include "core_int.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* ---- IMEX channels ------------------------------------------------------ */

/* The major number of a character device named name in /proc/devices
 * ("Character devices:" lines "234 nvidia-caps-imex-channels"), -1 when
 * it is not listed. */
static int char_device_major(const char *name) {
  FILE *f = fopen("/proc/devices", "re");
  if (f == NULL)
    return -1;
  char line[256];
  bool chars = false;
  int major = -1;
  while (major < 0 && fgets(line, sizeof line, f) != NULL) {
    if (strncmp(line, "Character devices:", 18) == 0) {
      chars = true;
      continue;
    }
    if (strncmp(line, "Block devices:", 14) == 0)
      chars = false;
    int m;
    char dev[128];
    if (chars && sscanf(line, "%d %127s", &m, dev) == 2 && strcmp(dev, name) == 0)
      major = m;
  }
  fclose(f);
  return major;
}

static int imex_name_cmp(const void *a, const void *b) {
  return strcmp((const char *)a, (const char *)b);
}

void gpuipc__imex_probe(gpuipc__imex *x) {
  memset(x, 0, sizeof *x);
  x->major = char_device_major("nvidia-caps-imex-channels");
  DIR *d = opendir(GPUIPC__IMEX_DIR);
  if (d == NULL) {
    x->dir_errno = errno;
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    if (x->count < GPUIPC__IMEX_MAX)
      snprintf(x->channel[x->count].name, sizeof x->channel[0].name, "%s", e->d_name);
    x->count++;
  }
  closedir(d);
  int n = x->count < GPUIPC__IMEX_MAX ? x->count : GPUIPC__IMEX_MAX;
  qsort(x->channel, (size_t)n, sizeof x->channel[0], imex_name_cmp);
  /* Opening a channel read-only and closing it again is what tells
   * whether this user may use it (the driver checks the same access). */
  for (int i = 0; i < n; i++) {
    char path[sizeof GPUIPC__IMEX_DIR + sizeof x->channel[0].name + 1];
    snprintf(path, sizeof path, "%s/%s", GPUIPC__IMEX_DIR, x->channel[i].name);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
      x->channel[i].open_errno = errno;
    } else {
      close(fd);
    }
  }
}

void gpuipc__imex_describe(const gpuipc__imex *x, char *buf, size_t cap) {
  if (cap == 0)
    return;
  buf[0] = '\0';
  bool usable = false;
  if (x->dir_errno == ENOENT) {
    gpuipc__appendf(buf, cap, "%s is missing", GPUIPC__IMEX_DIR);
  } else if (x->dir_errno != 0) {
    gpuipc__appendf(buf, cap, "%s cannot be listed (%s)", GPUIPC__IMEX_DIR,
                strerror(x->dir_errno));
  } else if (x->count == 0) {
    gpuipc__appendf(buf, cap, "%s is empty", GPUIPC__IMEX_DIR);
  } else {
    gpuipc__appendf(buf, cap, "%s:", GPUIPC__IMEX_DIR);
    int n = x->count < GPUIPC__IMEX_MAX ? x->count : GPUIPC__IMEX_MAX;
    for (int i = 0; i < n; i++) {
      if (x->channel[i].open_errno == 0)
        usable = true;
      gpuipc__appendf(buf, cap, "%s %s (%s%s)", i ? "," : "", x->channel[i].name,
                  x->channel[i].open_errno ? "cannot open: " : "opens",
                  x->channel[i].open_errno ? strerror(x->channel[i].open_errno) : "");
    }
    if (x->count > n)
      gpuipc__appendf(buf, cap, " and %d more", x->count - n);
  }
  if (usable)
    return;
  if (x->major < 0)
    gpuipc__appendf(buf, cap, "; /proc/devices does not list nvidia-caps-imex-channels");
  else
    gpuipc__appendf(buf, cap,
                "; /proc/devices lists nvidia-caps-imex-channels as major %d "
                "(cuda.h: mknod %s/channel0 c %d 0 makes channel 0)",
                x->major, GPUIPC__IMEX_DIR, x->major);
}
