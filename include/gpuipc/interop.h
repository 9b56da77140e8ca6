/*
 * gpuipc/interop.h: buffers and events shared with programs that do not
 * use gpuipc, in the raw forms they already speak.
 *
 * Included from gpuipc.h; do not include it on its own.
 *
 * Two families of peers:
 *
 * - Legacy CUDA IPC (CuPy's cupy.cuda.runtime.ipcGetMemHandle /
 *   ipcOpenMemHandle, cudaIpcGetMemHandle in C++, most Python stacks):
 *   a 64-byte cudaIpcMemHandle_t of an allocation, plus what gpuipc adds
 *   beside it: the offset of the buffer inside the allocation (the handle of
 *   an interior pointer is the handle of its allocation's base, so an array
 *   that a caching allocator carved out of a larger block must travel with
 *   its offset), its size, and the device's UUID. Legacy handles are BEARER
 *   TOKENS: any process on the machine that has the 64 bytes can open the
 *   memory. Events travel as 64-byte cudaIpcEventHandle_t.
 *
 * - Stream-ordered memory pools with POSIX file-descriptor export (cuda.core's
 *   IPC-enabled DeviceMemoryResource, cudaMemPoolExportToShareableHandle): the
 *   pool's file descriptor (sent once, by SCM_RIGHTS) plus, per buffer, the
 *   64-byte cudaMemPoolPtrExportData (cuda.core: the payload of an
 *   IPCBufferDescriptor), an offset and a size.
 *
 * What a raw import does not know. A gpuipc descriptor names its exporter
 * (machine, pid namespace, process) and the allocation's buffer id, so gpuipc
 * refuses foreign or stale descriptors. Raw bytes carry none of this: a raw
 * import trusts the caller that the bytes come from this machine and name
 * live memory. Imports still go through the import cache (importing the same
 * raw handle twice gives the same mapping, counted), and offset + size are
 * still checked against the real mapped range.
 *
 * Costs (one process, the driver's own): a legacy open is ~47 us for 1 MiB
 * (grows with the allocation) and a close ~35 us; a pool import (first
 * buffer of a pool) ~170 us, then ~1 us per buffer. Raw exports cost what
 * gpuipc_buffer_export costs (cuIpcGetMemHandle ~2 us; the first
 * cuMemPoolExportPointer of a buffer ~50 us).
 *
 * Thread safety: as the handle layer (any thread, different objects).
 */
#ifndef GPUIPC_INTEROP_H
#define GPUIPC_INTEROP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of a cudaIpcMemHandle_t, cudaIpcEventHandle_t and
 * cudaMemPoolPtrExportData. */
#define GPUIPC_RAW_HANDLE_BYTES 64

/* ------------------------------------------------------------------------ */
/* Legacy CUDA IPC (CuPy)                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Opens memory exported by another process as a legacy IPC handle:
 * handle: the 64 bytes of its cudaIpcMemHandle_t (the handle of the
 * allocation's base); offset/size: the buffer inside that allocation
 * (size > 0); device: the UUID of the device the memory lives on (NULL:
 * local device 0). opts may be NULL; opts->device maps it on another local
 * device (peer access), opts->flags is ignored.
 *
 * Returns GPUIPC_E_STALE when the driver refuses the handle
 * (CUDA_ERROR_INVALID_VALUE: the exporter freed the memory or exited, or the
 * bytes are not a handle), GPUIPC_E_INVALID_ARG when the handle was exported
 * by this very process (the driver refuses that: use the pointer itself),
 * GPUIPC_E_OUT_OF_RANGE when offset + size leaves the mapped allocation,
 * GPUIPC_E_DEVICE_NOT_VISIBLE for a device not visible here.
 * *buf is an imported buffer owned by the caller: gpuipc_buffer_get_ptr() is the
 * buffer's first byte here; release it with gpuipc_buffer_close(). It
 * cannot be re-exported (pass the raw bytes on instead).
 */
GPUIPC_API gpuipc_status gpuipc_buffer_import_legacy_raw(
    const uint8_t handle[GPUIPC_RAW_HANDLE_BYTES], size_t offset, size_t size,
    const gpuipc_uuid *device, const gpuipc_import_options *opts,
    gpuipc_buffer **buf /* OUT */);

/*
 * Exports a buffer of kind LEGACY (allocated from a LEGACY pool, or wrapped
 * cuMemAlloc memory, e.g. an array of another library) in the raw form:
 * the allocation's 64-byte handle, the buffer's offset inside it, its size,
 * and its device's UUID. A peer opens it with nothing but the runtime API:
 *   base = cudaIpcOpenMemHandle(handle); ptr = base + offset
 * (CuPy: cupy.cuda.runtime.ipcOpenMemHandle(handle_bytes) + offset). Any
 * out pointer may be NULL. GPUIPC_E_NOT_SUPPORTED for other kinds (the
 * message names the kind) and for imported buffers. The buffer must stay
 * allocated while peers use it; the handle is a bearer token.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_export_legacy_raw(
    gpuipc_buffer *buf, uint8_t handle[GPUIPC_RAW_HANDLE_BYTES] /* OUT */,
    size_t *offset /* OUT */, size_t *size /* OUT */,
    gpuipc_uuid *device /* OUT */);

/* ------------------------------------------------------------------------ */
/* Memory pools with fd export (cuda.core)                                   */
/* ------------------------------------------------------------------------ */

/*
 * Opens a buffer of another process's IPC-capable memory pool: pool_fd: the
 * pool's shareable handle (cuMemPoolExportToShareableHandle with
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; cuda.core:
 * DeviceMemoryResource.get_allocation_handle().handle), received by
 * SCM_RIGHTS; it stays owned by the caller. export_data: the buffer's
 * 64-byte cudaMemPoolPtrExportData (cuda.core: the payload of the buffer's
 * IPCBufferDescriptor). offset/size: the buffer inside the exported
 * allocation (cuda.core: 0 and IPCBufferDescriptor.size). device: the UUID
 * of the pool's device (NULL: local device 0).
 *
 * The pool is imported once per pool and stays imported for the life of
 * the process (the driver cannot release an imported pool). Later buffers
 * of the pool cost one pointer import when their fd is the same open file
 * as one seen before (the same fd, a dup, or another SCM_RIGHTS copy of the
 * same export: gpuipc keeps a dup and compares with kcmp); an fd of another
 * export of an already imported pool costs one more driver call, which
 * finds the pool already imported. Errors as
 * gpuipc_buffer_import_legacy_raw, plus the driver's for a bad fd.
 * *buf: owned by the caller, gpuipc_buffer_close().
 */
GPUIPC_API gpuipc_status gpuipc_buffer_import_mempool_raw(
    int pool_fd, const uint8_t export_data[GPUIPC_RAW_HANDLE_BYTES],
    size_t offset, size_t size, const gpuipc_uuid *device,
    const gpuipc_import_options *opts, gpuipc_buffer **buf /* OUT */);

/*
 * Exports a buffer of kind MEMPOOL (allocated from a MEMPOOL pool, or
 * wrapped memory of an IPC-capable pool) in the raw form: *pool_fd: a new
 * file descriptor for the pool, owned by the caller (close it once sent;
 * NULL: none made), export_data: the allocation's 64-byte
 * cudaMemPoolPtrExportData, *offset and *size: the buffer inside that
 * allocation (offset is 0 for buffers allocated by gpuipc), *device: the
 * pool's device. A cuda.core process opens it with
 *   mr = DeviceMemoryResource.from_allocation_handle(device, pool_fd)
 *   buf = Buffer.from_ipc_descriptor(mr, <descriptor of export_data, size>)
 * (see tests/python/cuda_core_interop.py for what cuda.core's public API
 * lacks to build that descriptor from bytes). GPUIPC_E_NOT_SUPPORTED for
 * other kinds and for imported buffers.
 */
GPUIPC_API gpuipc_status gpuipc_buffer_export_mempool_raw(
    gpuipc_buffer *buf, int *pool_fd /* OUT */,
    uint8_t export_data[GPUIPC_RAW_HANDLE_BYTES] /* OUT */,
    size_t *offset /* OUT */, size_t *size /* OUT */,
    gpuipc_uuid *device /* OUT */);

/* ------------------------------------------------------------------------ */
/* Interprocess events                                                      */
/* ------------------------------------------------------------------------ */

/*
 * Opens an interprocess event exported by another process
 * (cudaIpcGetEventHandle of an event created with cudaEventInterprocess |
 * cudaEventDisableTiming; CuPy: cupy.cuda.runtime.ipcGetEventHandle).
 * device: the UUID of the event's device (NULL: local device 0). The event
 * is opened anew each time (the driver gives a distinct CUevent); release
 * it with gpuipc_event_destroy(). Record/wait/synchronize as any gpuipc
 * event.
 */
GPUIPC_API gpuipc_status gpuipc_event_import_raw(
    const uint8_t handle[GPUIPC_RAW_HANDLE_BYTES], const gpuipc_uuid *device,
    gpuipc_event **ev /* OUT */);

/*
 * The 64-byte cudaIpcEventHandle_t of an event created by
 * gpuipc_event_create (and its device, may be NULL): a peer opens it with
 * cudaIpcOpenEventHandle (CuPy: cupy.cuda.runtime.ipcOpenEventHandle).
 * GPUIPC_E_NOT_SUPPORTED for an imported event. Bearer token.
 */
GPUIPC_API gpuipc_status gpuipc_event_export_raw(
    gpuipc_event *ev, uint8_t handle[GPUIPC_RAW_HANDLE_BYTES] /* OUT */,
    gpuipc_uuid *device /* OUT */);

#ifdef __cplusplus
}
#endif

#endif /* GPUIPC_INTEROP_H */
