/*
 * xfer_shared.c: owns the shared pinned host segment (gpuipc_xfer_shared):
 * slots of host memory two processes map, one filling them and the other
 * consuming them, either side being the host or a GPU stream (to_device,
 * from_device); its header (another process's input: copied once, then
 * checked) and per-slot control words, and the generation-word protocol
 * between the two sides (host stores/loads with release/acquire semantics
 * on one side, cuStreamWaitValue32/cuStreamWriteValue32 on the host-mapped
 * words on the GPU side).
 *
 * The segment is either a sealed memfd of its own (create/open; pinned for
 * DMA with cuMemHostRegister by gpuipc_xfer_shared_pin), or laid over the
 * start of a pinned-host gpuipc_buffer (format/attach), which the handle
 * layer has pinned and shares: then only the event of GPUIPC_XFER_SYNC is
 * this file's.
 *
 * Why a memfd: it needs no name in a shared namespace, travels as a file
 * descriptor (a capability, as private as the socket that carries it), and
 * once sealed against shrinking its size can be trusted by the importer, so
 * a hostile or buggy peer cannot make our mapping raise SIGBUS.
 */
#include "xfer_int.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SHARED_MAGIC 0x53585047u /* "GPXS" little-endian */
#define SHARED_VERSION 1u
#define SHARED_CTRL_OFFSET 256u
#define SHARED_CTRL_STRIDE 128u /* two cache lines per slot: one per writer */
#define SHARED_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* The header, at offset 0 of the segment. Fixed-width fields; both sides run
 * on the same machine, so byte order is the host's. */
struct shared_header {
  uint32_t magic;
  uint32_t version;
  uint32_t header_bytes; /* sizeof(struct shared_header) */
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t data_offset;
  uint64_t total_bytes;
};

/* The control words of one slot. `filled`, `len_lo`, `len_hi` are written by
 * the filling side, `consumed` by the consuming side: on separate cache
 * lines so the two sides never write the same line. */
struct shared_ctrl {
  uint32_t filled; /* generation of the last message published */
  uint32_t len_lo;
  uint32_t len_hi;
  uint32_t pad0[13];
  uint32_t consumed; /* generation of the last message consumed */
  uint32_t pad1[15];
};

_Static_assert(sizeof(struct shared_ctrl) == SHARED_CTRL_STRIDE,
               "control block layout");

struct gpuipc_xfer_shared {
  int fd;       /* -1 over a gpuipc_buffer */
  int borrowed; /* over a gpuipc_buffer: the caller's memory, pinned by
                   the handle layer; close only forgets it */
  char *base;
  size_t total;
  uint32_t nslots;
  size_t slot_bytes;
  size_t data_offset;
  /* pinned in this process */
  int pinned_device; /* -1 when not pinned */
  CUdeviceptr dbase; /* device address of base */
  CUevent ev;        /* for GPUIPC_XFER_SYNC */
};

static size_t page_size(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (size_t)p : 4096;
}

static size_t layout_data_offset(uint32_t nslots, size_t page) {
  size_t ctrl_end = SHARED_CTRL_OFFSET + (size_t)nslots * SHARED_CTRL_STRIDE;
  return (ctrl_end + page - 1) / page * page;
}

static struct shared_ctrl *ctrl(const gpuipc_xfer_shared *sh, uint32_t slot) {
  return (struct shared_ctrl *)(sh->base + SHARED_CTRL_OFFSET +
                                (size_t)slot * SHARED_CTRL_STRIDE);
}

static uint32_t slot_of(const gpuipc_xfer_shared *sh, uint64_t seq) {
  return (uint32_t)(seq % sh->nslots);
}
/* Generation of message seq in its slot: 1 for the first use. Compared
 * cyclically, like cuStreamWaitValue32's GEQ: (int32_t)(word - want) >= 0. */
static uint32_t gen_of(const gpuipc_xfer_shared *sh, uint64_t seq) {
  return (uint32_t)(seq / sh->nslots + 1);
}

/* h: the header as checked, a private copy: the peer can still write the
 * shared one, so nothing of the geometry is read from there again. */
static gpuipc_status shared_new(int fd, char *base, size_t total,
                                const struct shared_header *h,
                                gpuipc_xfer_shared **out) {
  gpuipc_xfer_shared *sh = calloc(1, sizeof *sh);
  if (sh == NULL)
    return gpuipc__fail_errno(ENOMEM, "calloc", "shared segment");
  sh->fd = fd;
  sh->base = base;
  sh->total = total;
  sh->nslots = h->nslots;
  sh->slot_bytes = (size_t)h->slot_bytes;
  sh->data_offset = (size_t)h->data_offset;
  sh->pinned_device = -1;
  *out = sh;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_shared_create(size_t slot_bytes, int slots,
                                        gpuipc_xfer_shared **out) {
  if (out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_create: out is NULL");
  if (slots < 1 || slots > GPUIPC_XFER_SHARED_MAX_SLOTS)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_create: %d slots (want 1..%d)",
                        slots, GPUIPC_XFER_SHARED_MAX_SLOTS);
  size_t page = page_size();
  if (slot_bytes == 0 || slot_bytes > ((size_t)1 << 46))
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_create: slot_bytes %zu",
                        slot_bytes);
  slot_bytes = (slot_bytes + page - 1) / page * page;
  size_t data_off = layout_data_offset((uint32_t)slots, page);
  if (slot_bytes > (SIZE_MAX - data_off) / (size_t)slots)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_create: too large");
  size_t total = data_off + slot_bytes * (size_t)slots;

  gpuipc_status s = GPUIPC_OK;
  char *base = MAP_FAILED;
  int fd = memfd_create("gpuipc-xfer-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return gpuipc__fail_errno(errno, "memfd_create", "shared segment");
  int rc;
  GPUIPC__EINTR_RETRY(rc, ftruncate(fd, (off_t)total));
  if (rc != 0) {
    s = gpuipc__fail_errno(errno, "ftruncate", "%zu bytes", total);
    goto fail;
  }
  base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    s = gpuipc__fail_errno(errno, "mmap", "%zu bytes", total);
    goto fail;
  }
  struct shared_header *h = (struct shared_header *)base;
  h->magic = SHARED_MAGIC;
  h->version = SHARED_VERSION;
  h->header_bytes = sizeof *h;
  h->nslots = (uint32_t)slots;
  h->slot_bytes = slot_bytes;
  h->data_offset = data_off;
  h->total_bytes = total;
  /* The size can no longer change: an importer's mapping cannot be cut
   * short under it. */
  if (fcntl(fd, F_ADD_SEALS, SHARED_SEALS) != 0) {
    s = gpuipc__fail_errno(errno, "fcntl(F_ADD_SEALS)", "shared segment");
    goto fail;
  }
  struct shared_header mine = *h;
  s = shared_new(fd, base, total, &mine, out);
  if (s != GPUIPC_OK)
    goto fail;
  return GPUIPC_OK;

fail:
  if (base != MAP_FAILED)
    munmap(base, total);
  close(fd);
  return s;
}

/* The header is input from another process: it is copied once, out of the
 * peer's reach, and every field of the copy checked against the real size;
 * the copy (*out) is what the segment is then opened with. The peer keeps
 * a writable mapping, so reading the shared header again after the check
 * would let it swap in a slot count of 0 or slots beyond the mapping.
 * exact: the segment is the whole mapping (a memfd of ours) rather than
 * the start of a larger buffer. */
static gpuipc_status check_header(const void *mem, size_t avail, int exact,
                                  const char *fn, struct shared_header *out) {
  const char *base = mem;
  size_t page = page_size();
  struct shared_header h;
  if (avail < sizeof h)
    return gpuipc__fail(GPUIPC_E_TRUNCATED, "%s: %zu bytes", fn, avail);
  memcpy(&h, base, sizeof h);
  /* A compiler barrier: what follows uses the copy, never a re-load of
   * the peer's bytes. */
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  if (h.magic != SHARED_MAGIC)
    return gpuipc__fail(GPUIPC_E_BAD_MAGIC, "%s: magic 0x%08x", fn, h.magic);
  if (h.version != SHARED_VERSION || h.header_bytes != sizeof h)
    return gpuipc__fail(GPUIPC_E_BAD_VERSION, "%s: version %u (want %u)", fn,
                        h.version, SHARED_VERSION);
  if (h.nslots < 1 || h.nslots > GPUIPC_XFER_SHARED_MAX_SLOTS ||
      h.slot_bytes == 0 || h.slot_bytes % page != 0 ||
      h.data_offset != layout_data_offset(h.nslots, page) ||
      h.slot_bytes > (SIZE_MAX - h.data_offset) / h.nslots ||
      h.total_bytes != h.data_offset + h.slot_bytes * h.nslots ||
      (exact ? h.total_bytes != avail : h.total_bytes > avail))
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "%s: inconsistent header (%u slots of %llu bytes at "
                        "%llu, %llu bytes; the memory has %zu)",
                        fn, h.nslots, (unsigned long long)h.slot_bytes,
                        (unsigned long long)h.data_offset,
                        (unsigned long long)h.total_bytes, avail);
  *out = h;
  return GPUIPC_OK;
}

gpuipc_status gpuipc__xfer_shared_check_header(const void *mem, size_t avail,
                                               int exact, const char *fn) {
  struct shared_header h;
  return check_header(mem, avail, exact, fn, &h);
}

gpuipc_status gpuipc_xfer_shared_open(int fd, gpuipc_xfer_shared **out) {
  if (out == NULL || fd < 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_open: bad fd or out");
  struct stat st;
  if (fstat(fd, &st) != 0)
    return gpuipc__fail_errno(errno, "fstat", "shared segment fd %d", fd);
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return gpuipc__fail(GPUIPC_E_BAD_KIND,
                        "gpuipc_xfer_shared_open: fd %d is not a sealed "
                        "shared segment (seals 0x%x)",
                        fd, seals);
  size_t page = page_size();
  size_t total = (size_t)st.st_size;
  if (st.st_size < (off_t)page)
    return gpuipc__fail(GPUIPC_E_TRUNCATED,
                        "gpuipc_xfer_shared_open: %lld bytes",
                        (long long)st.st_size);
  gpuipc_status s = GPUIPC_OK;
  int myfd = -1;
  char *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return gpuipc__fail_errno(errno, "mmap", "shared segment of %zu bytes",
                              total);
  struct shared_header h;
  s = check_header(base, total, 1, "gpuipc_xfer_shared_open", &h);
  if (s != GPUIPC_OK)
    goto fail;
  myfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (myfd < 0) {
    s = gpuipc__fail_errno(errno, "fcntl(F_DUPFD_CLOEXEC)", "fd %d", fd);
    goto fail;
  }
  s = shared_new(myfd, base, total, &h, out);
  if (s != GPUIPC_OK)
    goto fail;
  return GPUIPC_OK;
fail:
  munmap(base, total);
  if (myfd >= 0)
    close(myfd);
  return s;
}

gpuipc_status gpuipc_xfer_shared_close(gpuipc_xfer_shared *sh) {
  if (sh == NULL)
    return GPUIPC_OK;
  gpuipc_status s = GPUIPC_OK;
  if (sh->borrowed) {
    if (sh->ev && gpuipc__driver() == GPUIPC_OK) {
      gpuipc__ctx_guard g;
      if (gpuipc__ctx_enter(&g, sh->pinned_device) == GPUIPC_OK) {
        CUresult r = GPUIPC__CU(cuEventDestroy, sh->ev);
        if (r != CUDA_SUCCESS)
          s = gpuipc__fail_cuda(r, "cuEventDestroy", "shared segment");
        gpuipc__ctx_leave(&g);
      }
    }
    free(sh);
    return s;
  }
  if (sh->pinned_device >= 0) {
    s = gpuipc__driver();
    gpuipc__ctx_guard g;
    if (s == GPUIPC_OK)
      s = gpuipc__ctx_enter(&g, sh->pinned_device);
    if (s == GPUIPC_OK) {
      if (sh->ev) {
        CUresult r = GPUIPC__CU(cuEventDestroy, sh->ev);
        if (r != CUDA_SUCCESS)
          s = gpuipc__fail_cuda(r, "cuEventDestroy", "shared segment");
      }
      CUresult r = GPUIPC__CU(cuMemHostUnregister, sh->base);
      if (r != CUDA_SUCCESS && s == GPUIPC_OK)
        s = gpuipc__fail_cuda(r, "cuMemHostUnregister", "shared segment");
      gpuipc__ctx_leave(&g);
    }
  }
  munmap(sh->base, sh->total);
  close(sh->fd);
  free(sh);
  return s;
}

int gpuipc_xfer_shared_get_fd(const gpuipc_xfer_shared *sh) {
  return sh ? sh->fd : -1;
}
int gpuipc_xfer_shared_get_slots(const gpuipc_xfer_shared *sh) {
  return sh ? (int)sh->nslots : 0;
}
size_t gpuipc_xfer_shared_get_slot_bytes(const gpuipc_xfer_shared *sh) {
  return sh ? sh->slot_bytes : 0;
}
void *gpuipc_xfer_shared_get_slot(const gpuipc_xfer_shared *sh, uint64_t seq) {
  if (sh == NULL)
    return NULL;
  return sh->base + sh->data_offset + (size_t)slot_of(sh, seq) * sh->slot_bytes;
}

gpuipc_status gpuipc_xfer_shared_pin(gpuipc_xfer_shared *sh,
                                     const gpuipc_uuid *uuid) {
  if (sh == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_pin: NULL segment");
  if (sh->borrowed)
    return GPUIPC_OK; /* a pinned-host buffer: pinned with it */
  GPUIPC__CHECK(gpuipc__driver());
  int device = 0;
  if (uuid != NULL)
    GPUIPC__CHECK(gpuipc_device_from_uuid(uuid, &device));
  if (sh->pinned_device >= 0) {
    if (sh->pinned_device == device)
      return GPUIPC_OK;
    return gpuipc__fail(GPUIPC_E_EXISTS,
                        "gpuipc_xfer_shared_pin: already pinned for device %d",
                        sh->pinned_device);
  }
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, device));
  gpuipc_status s = GPUIPC_OK;
  /* PORTABLE: pinned for every context of the process, not only the primary
   * context of this device; DEVICEMAP: the GPU can address the control
   * words, which cuStreamWaitValue32/cuStreamWriteValue32 need. */
  CUresult r =
      GPUIPC__CU(cuMemHostRegister, sh->base, sh->total,
                 CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemHostRegister", "shared segment of %zu bytes",
                          sh->total);
    goto out;
  }
  r = GPUIPC__CU(cuMemHostGetDevicePointer, &sh->dbase, sh->base, 0);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemHostGetDevicePointer", "shared segment");
    GPUIPC__CU(cuMemHostUnregister, sh->base);
    goto out;
  }
  r = GPUIPC__CU(cuEventCreate, &sh->ev, CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuEventCreate", "shared segment");
    sh->ev = NULL;
    GPUIPC__CU(cuMemHostUnregister, sh->base);
    goto out;
  }
  sh->pinned_device = device;
out:
  gpuipc__ctx_leave(&g);
  return s;
}

/* ---- over a pinned-host buffer of the handle layer ----------------------- */

/* The segment over buf's memory: already pinned by the handle layer in this
 * process (in every process that maps it), and its address is also its
 * device address; only the event for GPUIPC_XFER_SYNC is ours. */
static gpuipc_status over_buffer(gpuipc_buffer *buf, const char *fn,
                                 const struct shared_header *h,
                                 gpuipc_xfer_shared **out) {
  gpuipc_uuid u;
  int ordinal = -1;
  GPUIPC__CHECK(gpuipc_buffer_get_mapped_device(buf, &u));
  GPUIPC__CHECK(gpuipc_device_from_uuid(&u, &ordinal));
  GPUIPC__CHECK(gpuipc__driver());
  char *base = gpuipc_buffer_get_ptr(buf);
  gpuipc_xfer_shared *sh = NULL;
  GPUIPC__CHECK(shared_new(-1, base, gpuipc_buffer_get_size(buf), h, &sh));
  sh->borrowed = 1;
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, ordinal);
  if (s != GPUIPC_OK) {
    free(sh);
    return s;
  }
  CUresult r = GPUIPC__CU(cuMemHostGetDevicePointer, &sh->dbase, base, 0);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuMemHostGetDevicePointer",
                          "%s: the buffer is not pinned here", fn);
    goto fail;
  }
  r = GPUIPC__CU(cuEventCreate, &sh->ev, CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS) {
    sh->ev = NULL;
    s = gpuipc__fail_cuda(r, "cuEventCreate", "%s", fn);
    goto fail;
  }
  gpuipc__ctx_leave(&g);
  sh->pinned_device = ordinal;
  *out = sh;
  return GPUIPC_OK;
fail:
  gpuipc__ctx_leave(&g);
  free(sh);
  return s;
}

static gpuipc_status check_buffer(gpuipc_buffer *buf, const char *fn,
                                  gpuipc_xfer_shared **out) {
  if (buf == NULL || out == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: NULL", fn);
  *out = NULL;
  if (gpuipc_buffer_get_kind(buf) != GPUIPC_POOL_PINNED_HOST)
    return gpuipc__fail(GPUIPC_E_BAD_KIND,
                        "%s: the buffer is of kind %s, not pinned-host", fn,
                        gpuipc_pool_kind_name(gpuipc_buffer_get_kind(buf)));
  if (((uintptr_t)gpuipc_buffer_get_ptr(buf)) % page_size() != 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "%s: the buffer does not start on a page", fn);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_shared_format(gpuipc_buffer *buf, size_t slot_bytes,
                                        int slots, gpuipc_xfer_shared **out) {
  static const char fn[] = "gpuipc_xfer_shared_format";
  GPUIPC__CHECK(check_buffer(buf, fn, out));
  if (slots < 1 || slots > GPUIPC_XFER_SHARED_MAX_SLOTS)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: %d slots (want 1..%d)", fn,
                        slots, GPUIPC_XFER_SHARED_MAX_SLOTS);
  size_t page = page_size(), size = gpuipc_buffer_get_size(buf);
  size_t data_off = layout_data_offset((uint32_t)slots, page);
  if (size < data_off + page * (size_t)slots)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "%s: a buffer of %zu bytes cannot hold %d slots", fn,
                        size, slots);
  size_t fit = (size - data_off) / (size_t)slots / page * page;
  if (slot_bytes == 0)
    slot_bytes = fit;
  slot_bytes = (slot_bytes + page - 1) / page * page;
  if (slot_bytes > fit)
    return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                        "%s: %d slots of %zu bytes need %zu bytes; the buffer "
                        "has %zu",
                        fn, slots, slot_bytes,
                        data_off + slot_bytes * (size_t)slots, size);
  char *base = gpuipc_buffer_get_ptr(buf);
  memset(base, 0, data_off);
  /* Our own copy of the geometry, not the shared bytes a peer may already
   * be writing. */
  struct shared_header mine = {SHARED_MAGIC,      SHARED_VERSION,
                               sizeof mine,       (uint32_t)slots,
                               slot_bytes,        data_off,
                               data_off + slot_bytes * (size_t)slots};
  struct shared_header *h = (struct shared_header *)base;
  h->version = mine.version;
  h->header_bytes = mine.header_bytes;
  h->nslots = mine.nslots;
  h->slot_bytes = mine.slot_bytes;
  h->data_offset = mine.data_offset;
  h->total_bytes = mine.total_bytes;
  /* The magic last: a half-written header never looks valid. */
  __atomic_store_n(&h->magic, SHARED_MAGIC, __ATOMIC_RELEASE);
  return over_buffer(buf, fn, &mine, out);
}

gpuipc_status gpuipc_xfer_shared_attach(gpuipc_buffer *buf,
                                        gpuipc_xfer_shared **out) {
  static const char fn[] = "gpuipc_xfer_shared_attach";
  GPUIPC__CHECK(check_buffer(buf, fn, out));
  if (gpuipc_buffer_get_size(buf) < sizeof(struct shared_header))
    return gpuipc__fail(GPUIPC_E_TRUNCATED, "%s: %zu bytes", fn,
                        gpuipc_buffer_get_size(buf));
  struct shared_header h;
  GPUIPC__CHECK(check_header(gpuipc_buffer_get_ptr(buf),
                             gpuipc_buffer_get_size(buf), 0, fn, &h));
  return over_buffer(buf, fn, &h, out);
}

/* ---- host side of the protocol ------------------------------------------- */

static uint32_t load_acquire(const uint32_t *w) {
  return __atomic_load_n(w, __ATOMIC_ACQUIRE);
}
static void store_release(uint32_t *w, uint32_t v) {
  __atomic_store_n(w, v, __ATOMIC_RELEASE);
}

/* Waits until (int32_t)(*w - want) >= 0: spins briefly, then sleeps with a
 * growing period (at most 100 us), so a long wait costs little CPU. */
static gpuipc_status wait_word(const uint32_t *w, uint32_t want, int timeout_ms,
                               const char *fn, uint64_t seq) {
  uint64_t deadline =
      timeout_ms > 0 ? gpuipc__now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
  long nap = 1000;
  for (unsigned spin = 0;; spin++) {
    if ((int32_t)(load_acquire(w) - want) >= 0)
      return GPUIPC_OK;
    if (timeout_ms == 0 || (timeout_ms > 0 && gpuipc__now_ns() >= deadline))
      return gpuipc__fail(GPUIPC_E_TIMEOUT,
                          "%s: message %llu not ready after %d ms", fn,
                          (unsigned long long)seq, timeout_ms);
    if (spin < 256)
      continue;
    struct timespec ts = {0, nap};
    nanosleep(&ts, NULL);
    if (nap < 100000)
      nap *= 2;
  }
}

gpuipc_status gpuipc_xfer_shared_acquire(gpuipc_xfer_shared *sh, uint64_t seq,
                                         int timeout_ms, void **ptr,
                                         size_t *cap) {
  if (sh == NULL || ptr == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_acquire: NULL");
  struct shared_ctrl *c = ctrl(sh, slot_of(sh, seq));
  GPUIPC__CHECK(wait_word(&c->consumed, gen_of(sh, seq) - 1, timeout_ms,
                          "gpuipc_xfer_shared_acquire", seq));
  *ptr = gpuipc_xfer_shared_get_slot(sh, seq);
  if (cap)
    *cap = sh->slot_bytes;
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_shared_publish(gpuipc_xfer_shared *sh, uint64_t seq,
                                         size_t len) {
  if (sh == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_publish: NULL");
  if (len > sh->slot_bytes)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_publish: %zu bytes, slots hold %zu",
                        len, sh->slot_bytes);
  struct shared_ctrl *c = ctrl(sh, slot_of(sh, seq));
  c->len_lo = (uint32_t)len;
  c->len_hi = (uint32_t)((uint64_t)len >> 32);
  /* Release: whoever sees the new generation sees the data and the length. */
  store_release(&c->filled, gen_of(sh, seq));
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_shared_wait_filled(gpuipc_xfer_shared *sh,
                                             uint64_t seq, int timeout_ms,
                                             size_t *len) {
  if (sh == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_wait_filled: NULL");
  struct shared_ctrl *c = ctrl(sh, slot_of(sh, seq));
  GPUIPC__CHECK(wait_word(&c->filled, gen_of(sh, seq), timeout_ms,
                          "gpuipc_xfer_shared_wait_filled", seq));
  if (len) {
    uint64_t l = (uint64_t)__atomic_load_n(&c->len_hi, __ATOMIC_ACQUIRE) << 32 |
                 __atomic_load_n(&c->len_lo, __ATOMIC_ACQUIRE);
    if (l > sh->slot_bytes)
      return gpuipc__fail(GPUIPC_E_OUT_OF_RANGE,
                          "gpuipc_xfer_shared_wait_filled: message %llu claims "
                          "%llu bytes, slots hold %zu",
                          (unsigned long long)seq, (unsigned long long)l,
                          sh->slot_bytes);
    *len = (size_t)l;
  }
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_shared_release(gpuipc_xfer_shared *sh, uint64_t seq) {
  if (sh == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "gpuipc_xfer_shared_release: NULL");
  store_release(&ctrl(sh, slot_of(sh, seq))->consumed, gen_of(sh, seq));
  return GPUIPC_OK;
}

/* ---- GPU side of the protocol -------------------------------------------- */

static CUdeviceptr dword(const gpuipc_xfer_shared *sh, const uint32_t *w) {
  return sh->dbase + (CUdeviceptr)((const char *)w - sh->base);
}

static gpuipc_status gpu_check(const gpuipc_xfer_shared *sh, const char *fn,
                               const void *devp, size_t len, unsigned flags) {
  if (sh == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: NULL segment", fn);
  if (sh->pinned_device < 0)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG,
                        "%s: the segment is not pinned in this process "
                        "(gpuipc_xfer_shared_pin)",
                        fn);
  if (len > sh->slot_bytes)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: %zu bytes, slots hold %zu",
                        fn, len, sh->slot_bytes);
  if (len > 0 && devp == NULL)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: NULL device pointer", fn);
  if (flags & ~GPUIPC_XFER_SYNC)
    return gpuipc__fail(GPUIPC_E_INVALID_ARG, "%s: unknown flags 0x%x", fn,
                        flags);
  return GPUIPC_OK;
}

static gpuipc_status gpu_finish(gpuipc_xfer_shared *sh, CUstream stream,
                                unsigned flags, const char *fn) {
  if (!(flags & GPUIPC_XFER_SYNC))
    return GPUIPC_OK;
  GPUIPC__CU_CHECK(cuEventRecord, sh->ev, stream);
  CUresult r = GPUIPC__CU(cuEventSynchronize, sh->ev);
  if (r != CUDA_SUCCESS)
    return gpuipc__fail_cuda(r, "cuEventSynchronize", "%s", fn);
  return GPUIPC_OK;
}

gpuipc_status gpuipc_xfer_shared_to_device(gpuipc_xfer_shared *sh, uint64_t seq,
                                           void *dst, size_t len,
                                           struct CUstream_st *stream,
                                           unsigned flags) {
  static const char fn[] = "gpuipc_xfer_shared_to_device";
  GPUIPC__CHECK(gpu_check(sh, fn, dst, len, flags));
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, sh->pinned_device));
  gpuipc_status s = GPUIPC_OK;
  struct shared_ctrl *c = ctrl(sh, slot_of(sh, seq));
  uint32_t gen = gen_of(sh, seq);
  CUresult r = GPUIPC__CU(cuStreamWaitValue32, stream, dword(sh, &c->filled),
                          gen, CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuStreamWaitValue32", "message %llu",
                          (unsigned long long)seq);
    goto out;
  }
  if (len > 0) {
    /* Straight from the shared pages: they are pinned in this process. */
    r = GPUIPC__CU(cuMemcpyHtoDAsync, (CUdeviceptr)(uintptr_t)dst,
                   gpuipc_xfer_shared_get_slot(sh, seq), len, stream);
    if (r != CUDA_SUCCESS) {
      s = gpuipc__fail_cuda(r, "cuMemcpyHtoDAsync", "message %llu, %zu bytes",
                            (unsigned long long)seq, len);
      goto out;
    }
  }
  /* The default flags put a memory fence before the write: the filler that
   * sees "consumed" may overwrite the slot, the copy has read it. */
  r = GPUIPC__CU(cuStreamWriteValue32, stream, dword(sh, &c->consumed), gen,
                 CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS) {
    s = gpuipc__fail_cuda(r, "cuStreamWriteValue32", "message %llu",
                          (unsigned long long)seq);
    goto out;
  }
  s = gpu_finish(sh, stream, flags, fn);
out:
  gpuipc__ctx_leave(&g);
  return s;
}

gpuipc_status gpuipc_xfer_shared_from_device(gpuipc_xfer_shared *sh,
                                             uint64_t seq, const void *src,
                                             size_t len,
                                             struct CUstream_st *stream,
                                             unsigned flags) {
  static const char fn[] = "gpuipc_xfer_shared_from_device";
  GPUIPC__CHECK(gpu_check(sh, fn, src, len, flags));
  GPUIPC__CHECK(gpuipc__driver());
  gpuipc__ctx_guard g;
  GPUIPC__CHECK(gpuipc__ctx_enter(&g, sh->pinned_device));
  gpuipc_status s = GPUIPC_OK;
  struct shared_ctrl *c = ctrl(sh, slot_of(sh, seq));
  uint32_t gen = gen_of(sh, seq);
  CUresult r = GPUIPC__CU(cuStreamWaitValue32, stream, dword(sh, &c->consumed),
                          gen - 1, CU_STREAM_WAIT_VALUE_GEQ);
  const char *call = "cuStreamWaitValue32";
  if (r != CUDA_SUCCESS)
    goto driver_fail;
  if (len > 0) {
    call = "cuMemcpyDtoHAsync";
    r = GPUIPC__CU(cuMemcpyDtoHAsync, gpuipc_xfer_shared_get_slot(sh, seq),
                   (CUdeviceptr)(uintptr_t)src, len, stream);
    if (r != CUDA_SUCCESS)
      goto driver_fail;
  }
  call = "cuStreamWriteValue32";
  r = GPUIPC__CU(cuStreamWriteValue32, stream, dword(sh, &c->len_lo),
                 (cuuint32_t)len, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS)
    goto driver_fail;
  r = GPUIPC__CU(cuStreamWriteValue32, stream, dword(sh, &c->len_hi),
                 (cuuint32_t)((uint64_t)len >> 32),
                 CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS)
    goto driver_fail;
  /* Fenced after the copy and the length: a reader that sees the
   * generation sees both. */
  r = GPUIPC__CU(cuStreamWriteValue32, stream, dword(sh, &c->filled), gen,
                 CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != CUDA_SUCCESS)
    goto driver_fail;
  s = gpu_finish(sh, stream, flags, fn);
  goto out;
driver_fail:
  s = gpuipc__fail_cuda(r, call, "message %llu", (unsigned long long)seq);
out:
  gpuipc__ctx_leave(&g);
  return s;
}
