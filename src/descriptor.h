/*
 * descriptor.h: the descriptor wire format (docs/descriptor.md), its
 * decoded form, the exporter identity that every descriptor carries, and
 * CRC32C. Pure byte handling: nothing here touches the driver.
 */
#ifndef GPUIPC_DESCRIPTOR_H
#define GPUIPC_DESCRIPTOR_H

#include "internal.h"

/* "GIPC" in the first four bytes (little-endian 0x43504947). */
#define GPUIPC__DESC_MAGIC 0x43504947u
/* The format version this library writes and reads. */
#define GPUIPC__DESC_VERSION 1u
/* Length of a version 1 descriptor. */
#define GPUIPC__DESC_V1_LEN 192u
/* Bytes of handle data carried (a CUipcMemHandle, CUipcEventHandle or
 * CUmemPoolPtrExportData: 64 bytes each). */
#define GPUIPC__DESC_HANDLE_BYTES 64u

/* Handle kinds on the wire: the pool kinds 1..4 (gpuipc_pool_kind) for
 * buffers and pools, and this one for events. */
#define GPUIPC__KIND_IPC_EVENT 16u

/* Flags byte. */
#define GPUIPC__DESC_F_WRAPPED 0x1u /* a wrapped (foreign) allocation */
#define GPUIPC__DESC_F_ALL 0x1u

/* Who exported: names a process on a machine even across pid reuse. */
typedef struct gpuipc__identity {
  uint8_t boot_id[16];
  uint64_t pidns;      /* inode of the pid namespace */
  int32_t pid;         /* in that namespace */
  uint64_t start_time; /* clock ticks since boot */
} gpuipc__identity;

/* A decoded descriptor. Field meanings: docs/descriptor.md. */
typedef struct gpuipc__desc {
  uint16_t version;
  uint8_t type;  /* gpuipc_desc_type */
  uint8_t kind;  /* gpuipc_pool_kind or GPUIPC__KIND_IPC_EVENT */
  uint32_t length;
  uint8_t nfds;
  uint8_t flags;
  uint16_t handle_len;
  int32_t exporter_fd; /* the fd number in the exporter (pidfd route), -1 */
  uint8_t device[16];
  gpuipc__identity exporter;
  uint64_t pool_id;
  uint64_t buffer_id;
  uint64_t generation;
  uint64_t offset;
  uint64_t size;
  uint64_t alloc_size;
  uint8_t handle[GPUIPC__DESC_HANDLE_BYTES];
} gpuipc__desc;

/* CRC32C (Castagnoli), the checksum of the format. */
uint32_t gpuipc__crc32c(uint32_t crc, const void *data, size_t len);

/* Encodes d (version and length are filled in) into out[0..cap).
 * GPUIPC_E_LIMIT when cap is too small. */
gpuipc_status gpuipc__desc_encode(const gpuipc__desc *d, uint8_t *out,
                                  size_t cap, size_t *len);

/* Decodes and validates the structure: length, magic, version, checksum,
 * type and kind, reserved fields, offset + size <= alloc_size. Does not
 * check origin (see gpuipc__desc_check_origin). Never reads beyond len. */
gpuipc_status gpuipc__desc_decode(const uint8_t *in, size_t len,
                                  gpuipc__desc *d);

/* The common start of gpuipc_buffer_import, gpuipc_pool_import and
 * gpuipc_event_import (`fn`): reads the caller's options into *opts
 * (opts_in may be NULL), decodes the descriptor into *d, and checks that it
 * is of `type` (E_BAD_KIND naming `what`: "a buffer", ...) and comes from
 * another process of this machine and pid namespace. */
gpuipc_status gpuipc__desc_open(const char *fn, const uint8_t *desc,
                                size_t len,
                                const gpuipc_import_options *opts_in,
                                unsigned type, const char *what,
                                gpuipc_import_options *opts, gpuipc__desc *d);

/* This process's identity (computed once per process; recomputed after a
 * fork). */
gpuipc_status gpuipc__self_identity(gpuipc__identity *id);
/* Fills d->exporter with this process's identity. */
gpuipc_status gpuipc__desc_set_exporter(gpuipc__desc *d);

/* Refuses descriptors of another machine (E_FOREIGN_MACHINE), another pid
 * namespace (E_FOREIGN_NAMESPACE), and of this very process
 * (E_INVALID_ARG). */
gpuipc_status gpuipc__desc_check_origin(const gpuipc__desc *d);

/* True when both name the same process. */
bool gpuipc__identity_eq(const gpuipc__identity *a, const gpuipc__identity *b);

/* Fetches fd number remote_fd of the exporter through pidfd_getfd(2),
 * checking that the pid still names the exporter (start time). Returns the
 * new fd (close-on-exec) in *out. Errors: E_PERMISSION (naming the ptrace
 * permission), E_PEER_GONE, E_STALE (the exporter no longer has that fd),
 * E_NOT_SUPPORTED (kernel without pidfd_getfd). */
gpuipc_status gpuipc__pidfd_getfd(const gpuipc__identity *exporter,
                                  int remote_fd, int *out);

#endif /* GPUIPC_DESCRIPTOR_H */
