/*
 * event.c: owns interprocess events: creating them (timing disabled, as
 * CUDA requires of CU_EVENT_INTERPROCESS), exporting them as descriptors
 * (a legacy CUipcEventHandle inside: a bearer token), opening them in
 * another process, and record / wait / query / synchronize in the event's
 * device context. Kept for interop with code that speaks IPC events (CuPy,
 * cuda.core); gpuipc's own fast path orders work with stream memory
 * operations instead.
 */
#include "handle_int.h"

#include <stdlib.h>
#include <string.h>

gpuipc_status gpuipc_event_create(const gpuipc_uuid *device,
                                  gpuipc_event **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_create: NULL");
  *out = NULL;
  GPUIPC__CHECK(gpuipc__driver());
  int ordinal = 0;
  GPUIPC__CHECK(gpuipc__resolve_device(device, 0, &ordinal));
  gpuipc_event *e = calloc(1, sizeof *e);
  if (e == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "event");
  e->ordinal = ordinal;
  gpuipc_status s = gpuipc_device_uuid(ordinal, &e->uuid);
  if (s != GPUIPC_OK)
    goto fail;
  gpuipc__ctx_guard g;
  GPUIPC__CHECK_GOTO(gpuipc__ctx_enter(&g, ordinal), s, fail);
  CUresult r = GPUIPC__CU(cuEventCreate, &e->ev,
                          CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuEventCreate", "interprocess, device %d",
                          ordinal);
    gpuipc__ctx_leave(&g);
    goto fail;
  }
  CUipcEventHandle h;
  r = GPUIPC__CU(cuIpcGetEventHandle, &h, e->ev);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuIpcGetEventHandle", NULL);
    (void)GPUIPC__CU(cuEventDestroy, e->ev);
    gpuipc__ctx_leave(&g);
    goto fail;
  }
  memcpy(e->handle, &h, 64);
  gpuipc__ctx_leave(&g);
  *out = e;
  return GPUIPC_OK;
fail:
  free(e);
  return s;
}

gpuipc_status gpuipc_event_export(gpuipc_event *e, uint8_t *desc, size_t cap,
                                  size_t *len) {
  if (e == NULL || desc == NULL || len == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_export: NULL");
  if (e->imported)
    return gpuipc__fail(GPUIPC_E_NOT_SUPPORTED,
                        "gpuipc_event_export: re-exporting an imported event "
                        "is not supported: pass on its descriptor");
  gpuipc__desc d;
  memset(&d, 0, sizeof d);
  d.type = GPUIPC_DESC_EVENT;
  d.kind = GPUIPC__KIND_IPC_EVENT;
  d.exporter_fd = -1;
  d.handle_len = 64;
  memcpy(d.handle, e->handle, 64);
  memcpy(d.device, e->uuid.bytes, 16);
  GPUIPC__CHECK(gpuipc__desc_set_exporter(&d));
  return gpuipc__desc_encode(&d, desc, cap, len);
}

gpuipc_status gpuipc_event_import(const uint8_t *desc, size_t len,
                                  const gpuipc_import_options *opts_in,
                                  gpuipc_event **out) {
  if (desc == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_import: NULL");
  *out = NULL;
  gpuipc_import_options opts;
  gpuipc__desc d;
  GPUIPC__CHECK(gpuipc__desc_open("gpuipc_event_import", desc, len, opts_in,
                                  GPUIPC_DESC_EVENT, "an event", NULL, &opts, &d));
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc_uuid dev;
  memcpy(dev.bytes, d.device, 16);
  int ordinal = -1;
  GPUIPC__CHECK(gpuipc_device_from_uuid(&dev, &ordinal));
  if (opts.device)
    GPUIPC__CHECK(gpuipc_device_from_uuid(opts.device, &ordinal));
  gpuipc_event *e = calloc(1, sizeof *e);
  if (e == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "event");
  e->imported = true;
  e->ordinal = ordinal;
  e->uuid = dev;
  memcpy(e->handle, d.handle, 64);
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, ordinal);
  if (s != GPUIPC_OK) {
    free(e);
    return s;
  }
  CUipcEventHandle h;
  memcpy(&h, d.handle, 64);
  CUresult r = GPUIPC__CU(cuIpcOpenEventHandle, &e->ev, h);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS) {
    free(e);
    return gpuipc__fail_cuda(r, "cuIpcOpenEventHandle", "event of pid %d",
                             (int)d.exporter.pid);
  }
  *out = e;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_event_destroy(gpuipc_event *e) {
  if (e == NULL)
    return GPUIPC_OK;
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, e->ordinal);
  if (s == GPUIPC_OK) {
    CUresult r = GPUIPC__CU(cuEventDestroy, e->ev);
    if (r != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(r, "cuEventDestroy", NULL);
    gpuipc__ctx_leave(&g);
  }
  free(e);
  return s;
}

gpuipc_status gpuipc_event_record(gpuipc_event *e, struct CUstream_st *stream) {
  if (e == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_record: NULL");
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, e->ordinal));
  CUresult r = GPUIPC__CU(cuEventRecord, e->ev, (CUstream)stream);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventRecord", NULL);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_event_wait(gpuipc_event *e, struct CUstream_st *stream) {
  if (e == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_wait: NULL");
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, e->ordinal));
  CUresult r = GPUIPC__CU(cuStreamWaitEvent, (CUstream)stream, e->ev, 0);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuStreamWaitEvent", NULL);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_event_synchronize(gpuipc_event *e) {
  if (e == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_synchronize: NULL");
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, e->ordinal));
  CUresult r = GPUIPC__CU(cuEventSynchronize, e->ev);
  gpuipc__ctx_leave(&g);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventSynchronize", NULL);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_event_query(gpuipc_event *e) {
  if (e == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "gpuipc_event_query: NULL");
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, e->ordinal));
  CUresult r = GPUIPC__CU(cuEventQuery, e->ev);
  gpuipc__ctx_leave(&g);
  if (r == CUDA_ERROR_NOT_READY)
    return GPUIPC_E_WOULD_BLOCK;
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventQuery", NULL);
  return GPUIPC_OK;
}

struct CUevent_st *gpuipc_event_get_handle(const gpuipc_event *e) {
  return e ? e->ev : NULL;
}
