/*
 * import.c: owns the steps of opening an import that need the import cache
 * or the exporter's liveness table, shared by the kinds' openers: the fd an
 * import maps (carried with the descriptor, or fetched from the exporter
 * by pidfd_getfd and proven to be its export), and the check that the
 * driver did not hand back an earlier import of other memory at the same
 * address. It sits above cache.c and live.c and below the kinds.
 */
#include "handle_int.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

gpuipc_status gpuipc__import_check_shadow(const gpuipc__desc *d,
                                          int map_ordinal, CUdeviceptr base,
                                          unsigned flags, bool *existing) {
  int owner = gpuipc__cache_base_owner(d->kind, map_ordinal, base, d);
  *existing = owner != 0;
  if (owner == 2 && !(flags & GPUIPC__IMPORT_RAW))
    return gpuipc__fail(GPUIPC_E_STALE,
                        "this %s descriptor (pid %d, buffer id %llu, "
                        "generation %llu) opened at 0x%llx, where this "
                        "process still holds an import of another allocation "
                        "of that exporter: the exporter freed that one and "
                        "reused its address, and the driver hands back the "
                        "old mapping; close the old import first",
                        gpuipc_pool_kind_name((gpuipc_pool_kind)d->kind),
                        (int)d->exporter.pid, (unsigned long long)d->buffer_id,
                        (unsigned long long)d->generation,
                        (unsigned long long)base);
  return GPUIPC_OK;
}

gpuipc_status gpuipc__import_fd(const gpuipc__desc *d, const int *fds,
                                int nfds, unsigned flags, int *fd,
                                int *fetched) {
  *fetched = -1;
  if (nfds > 0) {
    *fd = fds[0];
    return GPUIPC_OK;
  }
  if (flags & GPUIPC_IMPORT_PIDFD_GETFD) {
    /* Proven to be the export the descriptor names, not any file of the
     * process it names (the descriptor may be forged). */
    GPUIPC__CHECK(gpuipc__live_fetch_fd(d, d->generation, fetched));
    *fd = *fetched;
    return GPUIPC_OK;
  }
  return gpuipc__fail(GPUIPC_E_NEED_FD,
                      "%s buffer of pid %d: its file descriptor must come "
                      "with the descriptor (SCM_RIGHTS), or allow "
                      "GPUIPC_IMPORT_PIDFD_GETFD",
                      gpuipc_pool_kind_name((gpuipc_pool_kind)d->kind),
                      (int)d->exporter.pid);
}
