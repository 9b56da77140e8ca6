/*
 * xfer_host.c: owns the host-side copy helpers of the copy engine: a few
 * threads that split one large memcpy between pageable memory and a pinned
 * staging slot.
 *
 * Why: a pageable copy must pass through the CPU, and one core copies
 * memory at roughly 10 GB/s, well under a PCIe 5 link (55 GB/s each way on
 * an H200) and not far above the driver's own pageable path (6 GB/s). A few
 * cores together keep up with the DMA. The threads are started on the
 * engine's first staged copy, block all signals (they belong to the
 * library, not the application), and only ever copy memory (memcpy, or
 * streaming stores into a destination nobody reads soon): they make no
 * driver call.
 */
#include "xfer_int.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Below this much per thread, waking a helper costs more than it saves
 * (GPUIPC__HCOPY_MIN_PART; the benchmark varies it). */
size_t gpuipc__hcopy_min_part = GPUIPC__HCOPY_MIN_PART;
/* In a pipeline the next job follows within microseconds: a helper that has
 * finished watches for it this long before it sleeps (waking a sleeping
 * thread costs tens of microseconds, a good part of a 2 MiB memcpy), and the
 * caller watches its helpers finish as long. */
#define HCOPY_SPIN_NS 50000u

struct gpuipc__hcopy {
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  int nthreads; /* helpers started (the caller is one more) */
  pthread_t th[GPUIPC__HCOPY_MAX_THREADS];
  _Atomic uint64_t gen; /* job number, bumped (under mu) for each job */
  /* The job's parts are claimed, by the caller and the helpers alike, from
   * `claim`: the job number in the high 32 bits, the next part in the low
   * 32. A helper that comes late (the job over, another begun) sees another
   * number and claims nothing with its stale view of the job. */
  _Atomic uint64_t claim;
  char *dst;
  const char *src;
  size_t n, part; /* part: bytes per part (the last takes the rest) */
  bool nt;        /* streaming stores (see copy_part) */
  int parts;
  atomic_int pending; /* parts not finished */
  int stop;
};

/* Watches *w (without the lock) until it differs from `from` or the spin
 * time is over; the caller then takes the lock to act on it. */
static void spin_while_u64(_Atomic uint64_t *w, uint64_t from) {
  uint64_t end = gpuipc__now_ns() + HCOPY_SPIN_NS;
  for (unsigned i = 1;; i++) {
    if (atomic_load_explicit(w, memory_order_relaxed) != from)
      return;
    if (i % 64 == 0 && gpuipc__now_ns() >= end)
      return;
  }
}
static void spin_while_nonzero(atomic_int *w) {
  uint64_t end = gpuipc__now_ns() + HCOPY_SPIN_NS;
  for (unsigned i = 1;; i++) {
    if (atomic_load_explicit(w, memory_order_relaxed) == 0)
      return;
    if (i % 64 == 0 && gpuipc__now_ns() >= end)
      return;
  }
}

/* One thread's part of a copy. `nt`: the destination is a large pageable
 * buffer, which nobody reads soon: streaming stores skip reading each
 * destination line into the cache before writing it (a third of the memory
 * traffic of a cached copy, which the DMA filling the next staging slot
 * competes for). glibc's memcpy streams only above a size near the cache's,
 * which the parts of a pipelined copy stay under. Measured on an H200 host,
 * device to pageable at 1-4 GiB went from 37-40 to 45-52 GB/s. Into a
 * staging slot, whose next reader is the DMA engine, cached stores are
 * better (the DMA reads them from the cache; streaming them cost up to a
 * third at 4 GiB). SSE2 is part of x86-64; elsewhere memcpy. */
static void copy_part(char *dst, const char *src, size_t n, bool nt) {
#if defined(__x86_64__)
  if (nt && n >= GPUIPC__HCOPY_MIN_PART) {
    size_t head = (size_t)(-(uintptr_t)dst & 15u);
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
      __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(src + i));
      __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 16));
      __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 32));
      __m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + i + 48));
      _mm_stream_si128((__m128i *)(void *)(dst + i), a);
      _mm_stream_si128((__m128i *)(void *)(dst + i + 16), b);
      _mm_stream_si128((__m128i *)(void *)(dst + i + 32), c);
      _mm_stream_si128((__m128i *)(void *)(dst + i + 48), d);
    }
    /* Streaming stores are weakly ordered: fenced before the part is
     * reported done (the release that follows then publishes them). */
    _mm_sfence();
    memcpy(dst + body, src + body, n - body);
    return;
  }
#else
  (void)nt;
#endif
  memcpy(dst, src, n);
}

/* The job a thread copies parts of, as read under the lock. */
struct job {
  uint32_t gen;
  char *dst;
  const char *src;
  size_t n, part;
  int parts;
  bool nt;
};

/* Claims and copies parts of job j until none is left; returns whether
 * this thread finished the job's last part. */
static bool copy_parts(gpuipc__hcopy *p, const struct job *j) {
  bool last = false;
  uint64_t v = atomic_load(&p->claim);
  for (;;) {
    if ((uint32_t)(v >> 32) != j->gen || (int)(uint32_t)v >= j->parts)
      return last;
    if (!atomic_compare_exchange_weak(&p->claim, &v, v + 1))
      continue;
    int i = (int)(uint32_t)v;
    size_t off = (size_t)i * j->part;
    size_t len = i == j->parts - 1 ? j->n - off : j->part;
    copy_part(j->dst + off, j->src + off, len, j->nt);
    if (atomic_fetch_sub(&p->pending, 1) == 1)
      last = true;
    v = atomic_load(&p->claim);
  }
}

static struct job job_of(const gpuipc__hcopy *p) { /* mu held */
  struct job j = {(uint32_t)atomic_load(&p->gen), p->dst, p->src, p->n,
                  p->part, p->parts, p->nt};
  return j;
}

static void *helper_main(void *arg) {
  gpuipc__hcopy *p = arg;
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    if (atomic_load(&p->gen) == seen && !p->stop) {
      pthread_mutex_unlock(&p->mu);
      spin_while_u64(&p->gen, seen);
      pthread_mutex_lock(&p->mu);
    }
    while (atomic_load(&p->gen) == seen && !p->stop)
      pthread_cond_wait(&p->work, &p->mu);
    if (p->stop)
      break;
    seen = atomic_load(&p->gen);
    struct job j = job_of(p);
    pthread_mutex_unlock(&p->mu);
    bool last = copy_parts(p, &j);
    pthread_mutex_lock(&p->mu);
    if (last)
      pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

gpuipc_status gpuipc__hcopy_create(int threads, gpuipc__hcopy **out) {
  *out = NULL;
  gpuipc__hcopy *p = calloc(1, sizeof *p);
  if (p == NULL)
    return gpuipc__fail_errno(ENOMEM, "calloc", "host copy helpers");
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->done, NULL);
  if (threads > GPUIPC__HCOPY_MAX_THREADS)
    threads = GPUIPC__HCOPY_MAX_THREADS;
  /* Helpers inherit this mask: signals stay with the application's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  for (int i = 0; i < threads - 1; i++) {
    if (pthread_create(&p->th[i], NULL, helper_main, p) != 0) {
      /* Fewer helpers only means slower copies. */
      GPUIPC__DEBUG("xfer", "host copy helper %d not started", i + 1);
      break;
    }
    p->nthreads++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  *out = p;
  return GPUIPC_OK;
}

void gpuipc__hcopy_destroy(gpuipc__hcopy *p) {
  if (p == NULL)
    return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->nthreads; i++)
    pthread_join(p->th[i], NULL);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->done);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

int gpuipc__hcopy_threads(const gpuipc__hcopy *p) {
  return p ? p->nthreads + 1 : 1;
}

void gpuipc__hcopy_run(gpuipc__hcopy *p, void *dst, const void *src, size_t n,
                       bool nt) {
  int parts = p ? p->nthreads + 1 : 1;
  size_t min_part = gpuipc__hcopy_min_part ? gpuipc__hcopy_min_part : 4096;
  if ((size_t)parts > n / min_part)
    parts = (int)(n / min_part);
  if (parts <= 1) {
    copy_part(dst, src, n, nt);
    return;
  }
  /* Parts are multiples of 4 KiB so that no two threads write one page. */
  size_t part = n / (size_t)parts / 4096 * 4096;
  pthread_mutex_lock(&p->mu);
  p->dst = dst;
  p->src = src;
  p->n = n;
  p->part = part;
  p->parts = parts;
  p->nt = nt;
  atomic_store(&p->pending, parts);
  uint64_t gen = atomic_load(&p->gen) + 1;
  atomic_store(&p->claim, (gen & 0xffffffffu) << 32);
  atomic_store(&p->gen, gen);
  struct job j = job_of(p);
  /* Wake only as many helpers as there are parts besides ours (a helper
   * still watching for work takes one without being woken; whoever comes
   * first copies). */
  for (int i = 0; i < parts - 1; i++)
    pthread_cond_signal(&p->work);
  pthread_mutex_unlock(&p->mu);
  (void)copy_parts(p, &j);
  spin_while_nonzero(&p->pending);
  /* The lock, taken after the helpers' last unlock, is also what makes
   * their copies visible here (and so to the DMA that follows). */
  pthread_mutex_lock(&p->mu);
  while (atomic_load(&p->pending) > 0)
    pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}
