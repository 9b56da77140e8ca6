/*
 * copy.c: the device-to-device copies of a whole set (a consumer's
 * copy_into, a producer's copy_from) with the fewest launches and driver
 * calls: ranges are sorted by source, and ranges contiguous on both sides
 * are merged, so a consumer whose tensors lie in one allocation in the
 * producer's order copies a piece with one call (never across
 * allocations: see below; two cuMemGetAddressRange lookups per merged
 * range say where they end).
 *
 * The merged ranges then go three ways, tried in this order:
 *
 *  1. The gather kernel (gather.cu, its image gather_image.h): ranges
 *     shorter than GPUIPC__GATHER_LEN_MAX, both ends in device memory of
 *     the copy's device (another device's memory and mapped host memory
 *     go by the driver's copies, which reach them), in launches of up to
 *     GPUIPC__GATHER_N, the ranges in the launch's parameter (copied by
 *     the driver at the launch: nothing on the host outlives it). A set of
 *     many small tensors that are not adjacent (a paged KV cache, a
 *     model's experts) costs one launch per 1360 ranges, where the
 *     driver's copies, batched or not, are issued one by one (each some
 *     microseconds on the GPU). The module is loaded per device on the
 *     first copy that can use it, in the device's primary context; a
 *     device that cannot load it (no SASS nor PTX the driver takes, a
 *     driver before 12.1, which has not the room for the parameter) logs
 *     it once and stays on ways 2 and 3; a launch refused as an invalid
 *     handle (the user reset the primary context, so the module is gone)
 *     loads it again once; a launch refused otherwise copies that chunk
 *     the other ways, and when those succeed, the device leaves the
 *     kernel for good.
 *  2. The batched copy (cuMemcpyBatchAsync, CUDA 13.0's form, in chunks of
 *     BATCH_MAX) for the ranges left: those of 1 MiB and longer (the
 *     driver's copies are at the bandwidth bound there), or all of them
 *     without the kernel.
 *  3. Per-range cuMemcpyDtoDAsync copies where neither can go: a driver
 *     before 13.0 or without the batched call, the legacy NULL stream (the
 *     batch refuses it; the kernel takes it), one range, destinations that
 *     overlap each other or a source (the kernel's and a batch's copies run
 *     in no given order), a batch the driver refused (then the chunk is
 *     copied per range, which writes the same bytes).
 *
 * All in stream order like every copy (the source read in stream order),
 * so the guarantees of the per-range copies hold whichever way is taken:
 * after the producer's writes, before the release, no host wait. The ways
 * mix within one copy (the ranges do not overlap, so their order does not
 * matter). Tests force the kernel off with gpuipc__tset_copy_kernel and
 * the batch off with gpuipc__tset_copy_batch, and count the launches and
 * calls of each way.
 */
#include "sets_int.h"

#include "gather_image.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

/* The gather kernel and the batched copy: 1 allowed (where the device and
 * the driver have them), 0 never (tests force the ways after them). Counts
 * of the launches and calls made, for tests. */
int gpuipc__tset_copy_kernel = 1;
int gpuipc__tset_copy_batch = 1;
atomic_ullong gpuipc__tset_copy_kernels, gpuipc__tset_copy_batches,
    gpuipc__tset_copy_singles;

GPUIPC__PARAM(copy_kernel, "GPUIPC_COPY_KERNEL", GPUIPC__PARAM_ONCE, "1",
              "1: whole-set copies of many small ranges use the gather "
              "kernel; 0: the driver's copies only")

/* GPUIPC_COPY_KERNEL: whether the process may use the gather kernel. */
static bool kernel_allowed(void) {
  static atomic_int allowed; /* 0: not read yet; 1 yes; -1 no */
  int a = atomic_load_explicit(&allowed, memory_order_relaxed);
  if (a == 0) {
    const char *e = gpuipc__param_get(&gpuipc__param_copy_kernel);
    a = 1;
    if (e != NULL && strcmp(e, "0") == 0)
      a = -1;
    else if (e != NULL && *e != 0 && strcmp(e, "1") != 0)
      GPUIPC__WARN("sets", "GPUIPC_COPY_KERNEL=%s: not 0 or 1; using 1", e);
    atomic_store_explicit(&allowed, a, memory_order_relaxed);
  }
  return a > 0;
}

_Static_assert(sizeof(gpuipc__gather_args) <= 32764,
               "the gather kernel's parameter exceeds CUDA's 32,764 bytes");
_Static_assert(sizeof(gpuipc__gather_entry) == 24 &&
                   offsetof(gpuipc__gather_args, e) == 8,
               "the gather kernel's parameter layout is that of gather.cu");

/* The gather module of each device ordinal (of its primary context), under
 * gather_mu: state 0 not loaded yet, 1 loaded (fn usable), -1 not usable on
 * this device (said once). */
enum { GATHER_DEVICES = 64 };
static pthread_mutex_t gather_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  int state;
  CUmodule mod;
  CUfunction fn;
} gather_mods[GATHER_DEVICES];

enum { BATCH_MAX = 8192 };

/* -1: the batch is unusable in this process (driver older than 13.0, or
 * without the call, or it refused a well-formed batch); 0: not looked at
 * yet; 1: usable. */
static atomic_int batch_state;

typedef struct range {
  CUdeviceptr src, dst;
  uint64_t len;
} range;

static int by_src(const void *a, const void *b) {
  const range *x = a, *y = b;
  return x->src < y->src ? -1 : x->src > y->src;
}

static int by_dst(const void *a, const void *b) {
  const range *x = a, *y = b;
  return x->dst < y->dst ? -1 : x->dst > y->dst;
}

static uint64_t key_of(const range *x, bool dst) {
  return dst ? x->dst : x->src;
}

/* Sorts the n ranges by source, or by destination: an LSD radix sort, a
 * byte a pass, a pass skipped where every key has the same byte there (the
 * addresses of one copy differ in a few bytes only, so a few linear
 * passes, where qsort of 100,000 ranges took milliseconds); qsort for a
 * few ranges, or when the scratch memory cannot be had. */
static void sort_ranges(range *r, size_t n, bool dst) {
  if (n < 2)
    return;
  range *tmp = n < 64 ? NULL : malloc(n * sizeof *tmp);
  size_t(*cnt)[256] = tmp ? calloc(8, sizeof *cnt) : NULL;
  if (cnt == NULL) {
    free(tmp);
    qsort(r, n, sizeof *r, dst ? by_dst : by_src);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    uint64_t k = key_of(&r[i], dst);
    for (int b = 0; b < 8; b++)
      cnt[b][(k >> (8 * b)) & 255]++;
  }
  range *from = r, *to = tmp;
  for (int b = 0; b < 8; b++) {
    size_t *c = cnt[b];
    if (c[(key_of(&from[0], dst) >> (8 * b)) & 255] == n)
      continue; /* one byte value for all: the order stays */
    size_t sum = 0;
    for (int d = 0; d < 256; d++) {
      size_t t = c[d];
      c[d] = sum;
      sum += t;
    }
    for (size_t i = 0; i < n; i++)
      to[c[(key_of(&from[i], dst) >> (8 * b)) & 255]++] = from[i];
    range *t = from;
    from = to;
    to = t;
  }
  if (from != r)
    memcpy(r, from, n * sizeof *r);
  free(tmp);
  free(cnt);
}

static bool batch_usable(void) {
  int st = atomic_load_explicit(&batch_state, memory_order_relaxed);
  if (st == 0) {
    int v = 0;
    st = gpuipc__cu.cuMemcpyBatchAsync != NULL &&
                 GPUIPC__CU(cuDriverGetVersion, &v) == CUDA_SUCCESS &&
                 v >= 13000
             ? 1
             : -1;
    GPUIPC__DEBUG("sets", "batched copies: %s (driver %d)",
                  st > 0 ? "cuMemcpyBatchAsync" : "per range", v);
    atomic_store_explicit(&batch_state, st, memory_order_relaxed);
  }
  return st > 0;
}

/* The kernel of device ordinal (its primary context current), loaded on
 * first use; NULL where it cannot be. stale: a function a launch refused
 * as an invalid handle: if it is still the one cached, the module is
 * loaded again (the one it came from went with its context, so it is not
 * unloaded). */
static CUfunction gather_fn(int ordinal, CUfunction stale) {
  if (ordinal < 0 || ordinal >= GATHER_DEVICES)
    return NULL;
  pthread_mutex_lock(&gather_mu);
  if (stale != NULL && gather_mods[ordinal].state == 1 &&
      gather_mods[ordinal].fn == stale)
    gather_mods[ordinal].state = 0;
  if (gather_mods[ordinal].state == 0) {
    int v = 0;
    CUmodule mod = NULL;
    CUfunction fn = NULL;
    CUresult cr = GPUIPC__CU(cuDriverGetVersion, &v);
    if (cr == CUDA_SUCCESS && v < 12010)
      cr = CUDA_ERROR_NOT_SUPPORTED; /* 4 KiB of parameters at most */
    if (cr == CUDA_SUCCESS)
      cr = GPUIPC__CU(cuModuleLoadData, &mod, gpuipc__gather_image);
    if (cr == CUDA_SUCCESS) {
      cr = GPUIPC__CU(cuModuleGetFunction, &fn, mod, GPUIPC__GATHER_NAME);
      if (cr != CUDA_SUCCESS)
        (void)GPUIPC__CU(cuModuleUnload, mod);
    }
    if (cr == CUDA_SUCCESS) {
      gather_mods[ordinal].mod = mod;
      gather_mods[ordinal].fn = fn;
      gather_mods[ordinal].state = 1;
      GPUIPC__DEBUG("sets", "device %d: gather kernel loaded%s", ordinal,
                    stale ? " again" : "");
    } else {
      gather_mods[ordinal].state = -1;
      GPUIPC__INFO("sets", "device %d: the gather copy kernel cannot be "
                   "loaded (%s, driver %d); whole-set copies use the "
                   "driver's copies", ordinal, gpuipc__cuda_error_name(cr), v);
    }
  }
  CUfunction fn = gather_mods[ordinal].state == 1 ? gather_mods[ordinal].fn
                                                  : NULL;
  pthread_mutex_unlock(&gather_mu);
  return fn;
}

/* Device ordinal leaves the kernel for good (a launch of good ranges was
 * refused). */
static void gather_off(int ordinal, size_t n, CUresult cr) {
  pthread_mutex_lock(&gather_mu);
  if (gather_mods[ordinal].state == 1)
    GPUIPC__INFO("sets", "device %d: a gather kernel launch (a copy of %zu "
                 "ranges): %s; copying without it from now on", ordinal, n,
                 gpuipc__cuda_error_name(cr));
  gather_mods[ordinal].state = -1;
  pthread_mutex_unlock(&gather_mu);
}

/* Whether device ordinal is known to copy without the kernel (then a copy
 * does not build a launch's parameter to learn it). */
static bool gather_off_already(int ordinal) {
  if (ordinal < 0 || ordinal >= GATHER_DEVICES)
    return true;
  pthread_mutex_lock(&gather_mu);
  bool off = gather_mods[ordinal].state < 0;
  pthread_mutex_unlock(&gather_mu);
  return off;
}

/* One launch for the a->n ranges of a (1 to GPUIPC__GATHER_N). Returns
 * CUDA_SUCCESS, or why not (then nothing was enqueued): CUDA_ERROR_
 * NOT_SUPPORTED where the device has no kernel, or the launch's error. */
static CUresult gather_launch(int ordinal, gpuipc__gather_args *a,
                              CUstream stream) {
  uint64_t maxlen = 0;
  for (uint64_t i = 0; i < a->n; i++)
    if (a->e[i].len > maxlen)
      maxlen = a->e[i].len;
  uint64_t split = (maxlen + GPUIPC__GATHER_SLICE - 1) / GPUIPC__GATHER_SLICE;
  if (split < 1)
    split = 1;
  if (split > GPUIPC__GATHER_SPLIT_MAX)
    split = GPUIPC__GATHER_SPLIT_MAX;
  void *params[] = {a};
  CUfunction stale = NULL;
  for (int attempt = 0;; attempt++) {
    CUfunction fn = gather_fn(ordinal, stale);
    if (fn == NULL)
      return CUDA_ERROR_NOT_SUPPORTED;
    CUresult cr = GPUIPC__CU(cuLaunchKernel, fn, (unsigned)a->n,
                             (unsigned)split, 1, GPUIPC__GATHER_THREADS, 1, 1,
                             0, stream, params, NULL);
    if (cr == CUDA_SUCCESS) {
      atomic_fetch_add_explicit(&gpuipc__tset_copy_kernels, 1,
                                memory_order_relaxed);
      return cr;
    }
    if (attempt > 0 || (cr != CUDA_ERROR_INVALID_HANDLE &&
                        cr != CUDA_ERROR_INVALID_CONTEXT &&
                        cr != CUDA_ERROR_CONTEXT_IS_DESTROYED))
      return cr;
    stale = fn;
  }
}

gpuipc_status gpuipc__tset_gather(int ordinal, const CUdeviceptr *srcs,
                                  const CUdeviceptr *dsts,
                                  const uint64_t *lens, size_t n,
                                  CUstream stream) {
  gpuipc__gather_args *a = malloc(sizeof *a);
  if (a == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "gather of %zu ranges", n);
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, ordinal);
  if (s != GPUIPC_OK) {
    free(a);
    return s;
  }
  for (size_t from = 0; from < n && s == GPUIPC_OK; from += a->n) {
    a->n = n - from < GPUIPC__GATHER_N ? n - from : GPUIPC__GATHER_N;
    for (uint64_t i = 0; i < a->n; i++)
      a->e[i] = (gpuipc__gather_entry){srcs[from + i], dsts[from + i],
                                       lens[from + i]};
    CUresult cr = gather_launch(ordinal, a, stream);
    if (cr == CUDA_ERROR_NOT_SUPPORTED)
      s = gpuipc__fail(GPUIPC_E_NOT_SUPPORTED, "device %d cannot load the "
                       "gather kernel", ordinal);
    else if (cr != CUDA_SUCCESS)
      s = gpuipc__fail_cuda(cr, "cuLaunchKernel", "gather of %llu ranges",
                            (unsigned long long)a->n);
  }
  gpuipc__ctx_leave(&g);
  free(a);
  return s;
}

/* Whether the k ranges (sorted by source) may be copied in any order: no
 * destination overlaps another or a source. */
static bool order_free(const range *r, size_t k) {
  range *byd = malloc(k * sizeof *byd);
  if (byd == NULL)
    return false;
  memcpy(byd, r, k * sizeof *byd);
  bool sorted = true;
  for (size_t i = 1; i < k && sorted; i++)
    sorted = byd[i - 1].dst <= byd[i].dst;
  if (!sorted)
    sort_ranges(byd, k, true);
  bool ok = true;
  for (size_t i = 1; i < k && ok; i++)
    ok = byd[i - 1].dst + byd[i - 1].len <= byd[i].dst;
  /* Both lists sorted by start: a sweep finds any destination that meets a
   * source. */
  for (size_t i = 0, j = 0; ok && i < k && j < k;) {
    if (byd[i].dst + byd[i].len <= r[j].src)
      i++;
    else if (r[j].src + r[j].len <= byd[i].dst)
      j++;
    else
      ok = false;
  }
  free(byd);
  return ok;
}

/* Ranges [from, to) of the k, one call each. */
static gpuipc_status copy_each(const range *r, size_t from, size_t to,
                               size_t k, CUstream stream) {
  for (size_t i = from; i < to; i++) {
    CUresult cr = GPUIPC__CU(cuMemcpyDtoDAsync, r[i].dst, r[i].src,
                             (size_t)r[i].len, stream);
    if (cr != CUDA_SUCCESS)
      return gpuipc__fail_cuda(cr, "cuMemcpyDtoDAsync", "range %zu of %zu, "
                               "%llu bytes", i, k,
                               (unsigned long long)r[i].len);
    atomic_fetch_add_explicit(&gpuipc__tset_copy_singles, 1,
                              memory_order_relaxed);
  }
  return GPUIPC_OK;
}

/* The k ranges as batches of at most BATCH_MAX; a chunk the driver refuses
 * goes per range. */
static gpuipc_status copy_batched(int ordinal, const range *r, size_t k,
                                  CUstream stream) {
  size_t cap = k < BATCH_MAX ? k : BATCH_MAX;
  CUdeviceptr *dsts = malloc(cap * sizeof *dsts);
  CUdeviceptr *srcs = malloc(cap * sizeof *srcs);
  size_t *sizes = malloc(cap * sizeof *sizes);
  if (dsts == NULL || srcs == NULL || sizes == NULL) {
    free(dsts);
    free(srcs);
    free(sizes);
    return copy_each(r, 0, k, k, stream);
  }
  CUmemcpyAttributes at;
  memset(&at, 0, sizeof at);
  at.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  at.srcLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
  at.srcLocHint.id = ordinal;
  at.dstLocHint = at.srcLocHint;
  size_t at_idx = 0;
  gpuipc_status s = GPUIPC_OK;
  for (size_t from = 0; from < k && s == GPUIPC_OK; from += cap) {
    size_t n = k - from < cap ? k - from : cap;
    for (size_t i = 0; i < n; i++) {
      dsts[i] = r[from + i].dst;
      srcs[i] = r[from + i].src;
      sizes[i] = (size_t)r[from + i].len;
    }
    CUresult cr = n < 2 ? CUDA_ERROR_NOT_SUPPORTED
                        : GPUIPC__CU(cuMemcpyBatchAsync, dsts, srcs, sizes, n,
                                     &at, &at_idx, 1, stream);
    if (cr == CUDA_SUCCESS) {
      atomic_fetch_add_explicit(&gpuipc__tset_copy_batches, 1,
                                memory_order_relaxed);
      continue;
    }
    s = copy_each(r, from, from + n, k, stream);
    if (s == GPUIPC_OK && n >= 2) {
      /* The ranges were good: the driver refused the batch itself. */
      GPUIPC__INFO("sets", "cuMemcpyBatchAsync of %zu ranges: %s; copying "
                   "per range from now on", n, gpuipc__cuda_error_name(cr));
      atomic_store_explicit(&batch_state, -1, memory_order_relaxed);
    }
  }
  free(dsts);
  free(srcs);
  free(sizes);
  return s;
}

/* What is known of the allocations a copy's ranges lie in: whether one is
 * device memory of the copy's device, which the kernel may read and write
 * (the driver's copies also reach another device's memory, or host memory
 * mapped for the device; the kernel would fault there). A few entries:
 * sources come sorted, destinations in any order (a paged cache is one
 * allocation, a model's tensors many). */
enum { WHERE_N = 4 };
typedef struct where {
  struct {
    CUdeviceptr base;
    size_t size;
    bool ok;
  } e[WHERE_N];
  unsigned next;
} where;

/* Whether [p, p + len) lies in one allocation that is device memory of
 * device ordinal. */
static bool on_device(where *w, CUdeviceptr p, uint64_t len, int ordinal) {
  for (int i = 0; i < WHERE_N; i++)
    if (w->e[i].size && p >= w->e[i].base &&
        p - w->e[i].base < w->e[i].size)
      return w->e[i].ok && len <= w->e[i].size - (p - w->e[i].base);
  CUdeviceptr base = 0;
  size_t size = 0;
  int type = 0, dev = -1;
  bool ok = GPUIPC__CU(cuMemGetAddressRange, &base, &size, p) ==
                CUDA_SUCCESS &&
            size > 0 &&
            GPUIPC__CU(cuPointerGetAttribute, &type,
                       CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p) == CUDA_SUCCESS &&
            type == CU_MEMORYTYPE_DEVICE &&
            GPUIPC__CU(cuPointerGetAttribute, &dev,
                       CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) ==
                CUDA_SUCCESS &&
            dev == ordinal;
  if (size == 0) { /* unknown to the driver: this range only */
    base = p;
    size = len ? (size_t)len : 1;
  }
  unsigned i = w->next++ % WHERE_N;
  w->e[i].base = base;
  w->e[i].size = size;
  w->e[i].ok = ok;
  return ok && len <= size - (p - base);
}

/* The ranges of r shorter than GPUIPC__GATHER_LEN_MAX whose source and
 * destination are device memory of device ordinal (on_device) through the
 * kernel, where there are two or more and the device has it. Returns how many
 * ranges are left for the other ways, moved to the front of r: the long
 * ones, and from a chunk the driver did not launch on, every short one
 * too (*refused is then the launch's error, CUDA_SUCCESS else). */
static size_t copy_gathered(int ordinal, range *r, size_t k, CUstream stream,
                            CUresult *refused) {
  *refused = CUDA_SUCCESS;
  size_t shorts = 0;
  for (size_t i = 0; i < k; i++)
    shorts += r[i].len < GPUIPC__GATHER_LEN_MAX;
  if (shorts < 2 || gather_off_already(ordinal))
    return k;
  gpuipc__gather_args *a = malloc(sizeof *a);
  if (a == NULL)
    return k;
  a->n = 0;
  size_t left = 0; /* r[left..i) is free: each range there went to a */
  bool on = true;
  where ws, wd;
  memset(&ws, 0, sizeof ws);
  memset(&wd, 0, sizeof wd);
  for (size_t i = 0; i < k; i++) {
    if (on && r[i].len < GPUIPC__GATHER_LEN_MAX &&
        on_device(&ws, r[i].src, r[i].len, ordinal) &&
        on_device(&wd, r[i].dst, r[i].len, ordinal))
      a->e[a->n++] = (gpuipc__gather_entry){r[i].src, r[i].dst, r[i].len};
    else
      r[left++] = r[i];
    if (a->n > 0 && (a->n == GPUIPC__GATHER_N || i + 1 == k)) {
      CUresult cr = gather_launch(ordinal, a, stream);
      if (cr != CUDA_SUCCESS) {
        for (uint64_t j = 0; j < a->n; j++)
          r[left++] = (range){a->e[j].src, a->e[j].dst, a->e[j].len};
        if (cr != CUDA_ERROR_NOT_SUPPORTED)
          *refused = cr;
        on = false;
      }
      a->n = 0;
    }
  }
  free(a);
  return left;
}

gpuipc_status gpuipc__tset_copy(int ordinal, const CUdeviceptr *srcs,
                                const CUdeviceptr *dsts, const uint64_t *lens,
                                size_t n, CUstream stream) {
  range *r = malloc((n ? n : 1) * sizeof *r);
  if (r == NULL)
    return gpuipc__fail(GPUIPC_E_NO_MEMORY, "tensor-set copy of %zu ranges", n);
  size_t m = 0;
  bool sorted = true;
  for (size_t i = 0; i < n; i++) {
    if (srcs[i] == 0 || dsts[i] == 0 || lens[i] == 0)
      continue;
    r[m] = (range){srcs[i], dsts[i], lens[i]};
    if (m && r[m].src < r[m - 1].src)
      sorted = false;
    m++;
  }
  if (!sorted)
    sort_ranges(r, m, false);
  gpuipc__ctx_guard g;
  gpuipc_status s = gpuipc__ctx_enter(&g, ordinal);
  if (s != GPUIPC_OK) {
    free(r);
    return s;
  }
  /* Merging: two ranges contiguous on both sides become one copy, but only
   * inside one allocation on each side (allocations made one after the
   * other may be adjacent in the address space, and a copy may not span
   * two). The allocations are looked up only when a merge is possible,
   * once per merged range. */
  size_t k = 0;
  CUdeviceptr sb = 0, db = 0;
  size_t sl = 0, dl = 0;
  bool known = false;
  for (size_t i = 0; i < m; i++) {
    if (k && r[k - 1].src + r[k - 1].len == r[i].src &&
        r[k - 1].dst + r[k - 1].len == r[i].dst) {
      if (!known) {
        known = GPUIPC__CU(cuMemGetAddressRange, &sb, &sl, r[k - 1].src) ==
                    CUDA_SUCCESS &&
                GPUIPC__CU(cuMemGetAddressRange, &db, &dl, r[k - 1].dst) ==
                    CUDA_SUCCESS;
        if (!known)
          sb = db = 0, sl = dl = 0; /* unknown: never merge this range */
        known = true;
      }
      if (r[i].src + r[i].len <= sb + sl && r[i].dst + r[i].len <= db + dl &&
          r[k - 1].src >= sb && r[k - 1].dst >= db) {
        r[k - 1].len += r[i].len;
        continue;
      }
    }
    r[k++] = r[i];
    known = false;
  }
  /* The kernel first, then the batch or single copies for what is left. */
  bool any_order = k >= 2 && order_free(r, k);
  size_t all = k;
  CUresult refused = CUDA_SUCCESS;
  if (any_order && gpuipc__tset_copy_kernel && kernel_allowed())
    k = copy_gathered(ordinal, r, k, stream, &refused);
  if (k >= 2 && any_order && gpuipc__tset_copy_batch && stream != NULL &&
      stream != CU_STREAM_LEGACY && batch_usable())
    s = copy_batched(ordinal, r, k, stream);
  else
    s = copy_each(r, 0, k, k, stream);
  if (s == GPUIPC_OK && refused != CUDA_SUCCESS)
    gather_off(ordinal, all, refused); /* the ranges were good */
  gpuipc__ctx_leave(&g);
  free(r);
  return s;
}
