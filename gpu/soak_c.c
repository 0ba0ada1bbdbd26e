// SPDX-License-Identifier: Apache-2.0
/* The C twin of gpu/soak.py: a GPU soak of libcudapool.so through its C ABI
 * only (no torch), with the same structure:
 *   - 4 worker threads, each on its own stream, allocate and free blocks of
 *     random sizes (512 B to 64 MiB, log-uniform), fill each with a value of
 *     their own and verify every live block (before its free, and all of
 *     them now and then);
 *   - delayed reads: a side stream spins, then counts the elements of a block
 *     that changed; the block gets cudapool_record_stream(side) and is freed
 *     at once, and the same size is allocated and filled at once on the
 *     freeing stream; every count is checked;
 *   - a capturing thread captures two graphs sharing a private pool in
 *     thread-local mode, announced as PyTorch does
 *     (cudapool_begin_allocate_to_pool with a stream filter), replays them
 *     between eager allocations, checks every replay, destroys them,
 *     releases the pool and captures again;
 *   - cudapool_empty_cache now and then (never during a capture);
 *   - before and after: allocate under cudapool_set_memory_fraction until
 *     out of memory, free, allocate again.
 * A watchdog thread ends the process (exit status 3) when a thread makes no
 * progress for WATCHDOG_S seconds (default 90). Leaks: allocated bytes back
 * to the baseline at the end. The last lines are a table and
 * "SOAK-RESULT {json}"; exit status 0 only if everything checked out.
 *
 * Built and run by gpu/soak.sh:
 *   nvcc -ptx -arch=sm_90 gpu/soak_kernels.cu -o build/gpu/soak_kernels.ptx
 *   gcc -O2 gpu/soak_c.c -I include -I $CUDA_HOME/include -L lib -lcudapool -lcuda -lpthread -lm -ldl
 *   KERNELS_PTX=build/gpu/soak_kernels.ptx build/gpu/soak_c SECONDS */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cudapool.h"

#define WORKERS 4
#define MAX_LIVE 24
#define SLOTS 4096 /* pinned counters per worker: delayed reads in flight */
#define MIN_SIZE 512.0
#define MAX_SIZE (64.0 * 1024 * 1024)
#define MiB (1ull << 20)

static CUcontext ctx;
static CUfunction k_fill, k_count, k_spin, k_add;
typedef CUresult (*capinfo_fn)(CUstream, CUstreamCaptureStatus *, cuuint64_t *);
static capinfo_fn capinfo;
static double soak_s = 60, watchdog_s = 90, t_start, deadline;
static atomic_int stop;
/* Held by the capturing thread while it captures: empty_cache waits. */
static pthread_mutex_t capture_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t err_mu = PTHREAD_MUTEX_INITIALIZER;
static char first_error[600];
static atomic_llong c_ops, c_allocs, c_frees, c_verified, c_corrupt, c_delayed, c_bad_delayed, c_captures, c_replays,
    c_bad_replays, c_empty, c_errors, c_ooms;
/* Heartbeats in ms since the start; 0: not watched. Index WORKERS is the
 * capturer, WORKERS+1 the main thread. */
static atomic_llong beat[WORKERS + 2];
static int oom_ok[2] = {-1, -1};
static long long leak = -1;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void beat_now(int i) { atomic_store(&beat[i], (long long)((now_s() - t_start) * 1000) + 1); }

static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&err_mu);
  if (atomic_fetch_add(&c_errors, 1) == 0) vsnprintf(first_error, sizeof first_error, fmt, ap);
  pthread_mutex_unlock(&err_mu);
  va_end(ap);
  atomic_store(&stop, 1);
}

#define CU(call)                                                                  \
  do {                                                                            \
    CUresult r_ = (call);                                                         \
    if (r_ != CUDA_SUCCESS) {                                                     \
      const char *s_ = "?";                                                       \
      cuGetErrorName(r_, &s_);                                                    \
      fail("%s:%d %s -> %s", __FILE__, __LINE__, #call, s_);                      \
    }                                                                             \
  } while (0)

static const char *lasterr(void) {
  const char *e = cudapool_last_error();
  return e ? e : "(none)";
}

static uint64_t rnd(uint64_t *s) { /* xorshift64* */
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}
static double unif(uint64_t *s) { return (rnd(s) >> 11) * (1.0 / 9007199254740992.0); }
static size_t log_size(uint64_t *s) {
  return (size_t)exp(log(MIN_SIZE) + unif(s) * (log(MAX_SIZE) - log(MIN_SIZE)));
}

static void launch(CUfunction f, CUstream s, unsigned long long n, void **args) {
  unsigned blocks = (unsigned)((n + 255) / 256);
  if (blocks > 1024) blocks = 1024;
  if (blocks == 0) blocks = 1;
  CU(cuLaunchKernel(f, blocks, 1, 1, 256, 1, 1, 0, s, args, NULL));
}

static void fill(CUstream s, void *p, size_t size, unsigned v) {
  CUdeviceptr d = (CUdeviceptr)p;
  unsigned long long n = size / 4;
  void *args[] = {&d, &n, &v};
  launch(k_fill, s, n, args);
}

/* Queues a count of the elements of p that are not v into *slot. */
static void count_ne(CUstream s, void *p, size_t size, unsigned v, unsigned long long *slot) {
  CUdeviceptr d = (CUdeviceptr)p, b = (CUdeviceptr)slot;
  unsigned long long n = size / 4;
  void *args[] = {&d, &n, &v, &b};
  launch(k_count, s, n, args);
}

/* The number of elements of p that are not v, now. */
static unsigned long long verify(CUstream s, void *p, size_t size, unsigned v, unsigned long long *slot) {
  *slot = 0;
  count_ne(s, p, size, v, slot);
  CU(cuStreamSynchronize(s));
  atomic_fetch_add(&c_verified, 1);
  atomic_fetch_add(&c_corrupt, (long long)*slot);
  return *slot;
}

static void *xmalloc(size_t size, CUstream s) {
  void *p = cudapool_malloc(size, 0, (cudapool_stream)s);
  if (!p) {
    if (strstr(lasterr(), "out of memory"))
      { if (atomic_fetch_add(&c_ooms, 1) == 0 && getenv("SOAK_DEBUG")) printf("first OOM: %s\n", lasterr()); }
    else
      fail("cudapool_malloc(%zu): %s", size, lasterr());
  }
  return p;
}

static void xfree(void *p, size_t size, CUstream s) {
  cudapool_clear_error();
  cudapool_free(p, size, 0, (cudapool_stream)s);
  if (cudapool_last_error()) fail("cudapool_free(%p, %zu): %s", p, size, lasterr());
}

struct live {
  void *p;
  size_t size;
  unsigned v;
};

struct pending {
  CUevent ev;
  int slot;
};

struct worker {
  int id;
  uint64_t rng;
  CUstream s, side;
  CUevent order;                 /* side waits for s */
  unsigned long long *slots;     /* pinned: [0] for verify, the rest for delayed reads */
  int next_slot;
  struct live live[MAX_LIVE + 1];
  int nlive;
  struct pending pend[SLOTS];
  int npend;
  CUevent spare[SLOTS];
  int nspare;
  unsigned serial;
};

static unsigned value(struct worker *w) { return ((unsigned)w->id << 24) | (++w->serial & 0xFFFFFF); }

static void take_live(struct worker *w, int i, struct live *out) {
  *out = w->live[i];
  w->live[i] = w->live[--w->nlive];
}

static void check_pending(struct worker *w, int block) {
  int k = 0;
  for (int i = 0; i < w->npend; i++) {
    struct pending pd = w->pend[i];
    CUresult r = block ? cuEventSynchronize(pd.ev) : cuEventQuery(pd.ev);
    if (r == CUDA_ERROR_NOT_READY) {
      w->pend[k++] = pd;
      continue;
    }
    if (r != CUDA_SUCCESS) fail("delayed read event: CUresult %d", (int)r);
    atomic_fetch_add(&c_delayed, 1);
    if (w->slots[pd.slot] != 0) atomic_fetch_add(&c_bad_delayed, 1);
    w->spare[w->nspare++] = pd.ev;
  }
  w->npend = k;
}

static void delayed_read(struct worker *w) {
  if (w->npend >= SLOTS - 2) check_pending(w, 1);
  struct live x;
  take_live(w, (int)(rnd(&w->rng) % (unsigned)w->nlive), &x);
  CU(cuEventRecord(w->order, w->s));
  CU(cuStreamWaitEvent(w->side, w->order, 0));
  unsigned long long ns = (unsigned long long)(500000 + unif(&w->rng) * 2500000); /* 0.5-3 ms */
  void *sargs[] = {&ns};
  CU(cuLaunchKernel(k_spin, 1, 1, 1, 1, 1, 1, 0, w->side, sargs, NULL));
  int slot = 1 + w->next_slot;
  w->next_slot = (w->next_slot + 1) % (SLOTS - 1);
  w->slots[slot] = 0;
  count_ne(w->side, x.p, x.size, x.v, &w->slots[slot]);
  CUevent ev;
  if (w->nspare > 0)
    ev = w->spare[--w->nspare];
  else
    CU(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CU(cuEventRecord(ev, w->side));
  w->pend[w->npend++] = (struct pending){ev, slot};
  cudapool_record_stream(x.p, (cudapool_stream)w->side);
  xfree(x.p, x.size, w->s); /* while the side stream still has to read it */
  atomic_fetch_add(&c_frees, 1);
  unsigned v2 = value(w);
  void *y = xmalloc(x.size, w->s); /* at once, same size, same stream */
  if (y) {
    fill(w->s, y, x.size, v2);
    w->live[w->nlive++] = (struct live){y, x.size, v2};
    atomic_fetch_add(&c_allocs, 1);
  }
}

static void *worker_main(void *arg) {
  struct worker *w = arg;
  CU(cuCtxSetCurrent(ctx));
  CU(cuStreamCreate(&w->s, CU_STREAM_NON_BLOCKING));
  CU(cuStreamCreate(&w->side, CU_STREAM_NON_BLOCKING));
  CU(cuEventCreate(&w->order, CU_EVENT_DISABLE_TIMING));
  CU(cuMemAllocHost((void **)&w->slots, SLOTS * sizeof *w->slots));
  while (!atomic_load(&stop) && now_s() < deadline) {
    beat_now(w->id);
    atomic_fetch_add(&c_ops, 1);
    double r = unif(&w->rng);
    if (r < 0.40 && w->nlive < MAX_LIVE) {
      size_t size = log_size(&w->rng);
      void *p = xmalloc(size, w->s);
      if (p) {
        unsigned v = value(w);
        fill(w->s, p, size, v);
        w->live[w->nlive++] = (struct live){p, size, v};
        atomic_fetch_add(&c_allocs, 1);
      }
    } else if (r < 0.70 && w->nlive > 0) {
      struct live x;
      take_live(w, (int)(rnd(&w->rng) % (unsigned)w->nlive), &x);
      if (verify(w->s, x.p, x.size, x.v, &w->slots[0]))
        fail("worker %d: a block lost its value %#x before its free", w->id, x.v);
      xfree(x.p, x.size, w->s);
      atomic_fetch_add(&c_frees, 1);
    } else if (r < 0.90 && w->nlive > 0) {
      delayed_read(w);
    } else if (r < 0.93) {
      for (int i = 0; i < w->nlive; i++)
        if (verify(w->s, w->live[i].p, w->live[i].size, w->live[i].v, &w->slots[0]))
          fail("worker %d: a live block lost its value %#x", w->id, w->live[i].v);
    } else if (r < 0.94) {
      if (pthread_mutex_trylock(&capture_mu) == 0) {
        cudapool_clear_error();
        cudapool_empty_cache();
        if (cudapool_last_error()) fail("empty_cache: %s", lasterr());
        atomic_fetch_add(&c_empty, 1);
        pthread_mutex_unlock(&capture_mu);
      }
    }
    check_pending(w, 0);
  }
  check_pending(w, 1);
  for (int i = 0; i < w->nlive; i++) {
    if (verify(w->s, w->live[i].p, w->live[i].size, w->live[i].v, &w->slots[0]))
      fail("worker %d: a live block lost its value (final check)", w->id);
    xfree(w->live[i].p, w->live[i].size, w->s);
  }
  w->nlive = 0;
  CU(cuStreamSynchronize(w->s));
  CU(cuStreamSynchronize(w->side));
  for (int i = 0; i < w->nspare; i++) CU(cuEventDestroy(w->spare[i]));
  CU(cuEventDestroy(w->order));
  CU(cuMemFreeHost(w->slots));
  atomic_store(&beat[w->id], 0);
  return NULL;
}

struct capctx {
  cuuint64_t id;
};

/* PyTorch's filter: is this stream capturing into our capture sequence? */
static int capture_filter(void *c, cudapool_stream s) {
  CUstreamCaptureStatus st;
  cuuint64_t id = 0;
  if (capinfo((CUstream)s, &st, &id) != CUDA_SUCCESS) return 0;
  return st == CU_STREAM_CAPTURE_STATUS_ACTIVE && id == ((struct capctx *)c)->id;
}

static void add_one(CUstream s, void *out, void *in, size_t size) {
  CUdeviceptr o = (CUdeviceptr)out, i = (CUdeviceptr)in;
  unsigned long long n = size / 4;
  void *args[] = {&o, &i, &n};
  launch(k_add, s, n, args);
}

/* Begins an announced thread-local capture of cs into pool {0, pid}. */
static void begin(CUstream cs, unsigned long long pid, struct capctx *c) {
  cudapool_clear_error();
  cudapool_begin_allocate_to_pool(0, 0, pid, capture_filter, c);
  if (cudapool_last_error()) fail("begin_allocate_to_pool: %s", lasterr());
  CU(cuStreamBeginCapture(cs, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  CUstreamCaptureStatus st;
  CU(capinfo(cs, &st, &c->id));
}

static CUgraphExec end(CUstream cs, unsigned long long pid, CUgraph *g) {
  CUresult r = cuStreamEndCapture(cs, g);
  cudapool_end_allocate_to_pool(0, 0, pid);
  if (r != CUDA_SUCCESS) {
    fail("a capture was invalidated (CUresult %d)", (int)r);
    *g = NULL;
    return NULL;
  }
  CUgraphExec e = NULL;
  CU(cuGraphInstantiate(&e, *g, 0));
  return e;
}

static void *capturer_main(void *arg) {
  (void)arg;
  const int me = WORKERS;
  uint64_t rng = 77;
  CU(cuCtxSetCurrent(ctx));
  CUstream cs;
  CU(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));
  unsigned long long *slot;
  CU(cuMemAllocHost((void **)&slot, sizeof *slot));
  const size_t size = 1u << 18; /* 64K elements */
  unsigned long long pid = 1000;
  while (!atomic_load(&stop) && now_s() < deadline) {
    beat_now(me);
    pid++;
    void *in = xmalloc(size, cs);
    if (!in) break;
    fill(cs, in, size, 0);
    size_t scratch_size = log_size(&rng);
    struct capctx c1 = {0}, c2 = {0};
    CUgraph g1 = NULL, g2 = NULL;
    void *out1 = NULL, *out2 = NULL;
    pthread_mutex_lock(&capture_mu);
    begin(cs, pid, &c1); /* g1: out1 = in + 2, with a temporary and a scratch block freed inside */
    void *tmp = xmalloc(size, cs);
    void *scratch = xmalloc(scratch_size, cs);
    out1 = xmalloc(size, cs);
    if (tmp && scratch && out1) {
      add_one(cs, tmp, in, size);
      fill(cs, scratch, scratch_size, 3);
      add_one(cs, out1, tmp, size);
    }
    if (tmp) xfree(tmp, size, cs);
    if (scratch) xfree(scratch, scratch_size, cs);
    CUgraphExec e1 = end(cs, pid, &g1);
    begin(cs, pid, &c2); /* g2, same pool: out2 = out1 + 1 */
    out2 = xmalloc(size, cs);
    if (out2 && out1) add_one(cs, out2, out1, size);
    CUgraphExec e2 = end(cs, pid, &g2);
    pthread_mutex_unlock(&capture_mu);
    atomic_fetch_add(&c_captures, 2);
    int replays = 5 + (int)(rnd(&rng) % 26);
    for (int k = 0; k < replays && e1 && e2 && out2 && !atomic_load(&stop); k++) {
      beat_now(me);
      unsigned v = (unsigned)rnd(&rng) & 0x0FFFFFFF;
      fill(cs, in, size, v);
      void *junk[3] = {0};
      int nj = (int)(rnd(&rng) % 4);
      for (int j = 0; j < nj; j++) { /* eager work between replays */
        size_t js = log_size(&rng);
        if ((junk[j] = xmalloc(js, cs)) != NULL) {
          fill(cs, junk[j], js, 5);
          xfree(junk[j], js, cs);
        }
      }
      CU(cuGraphLaunch(e1, cs));
      CU(cuGraphLaunch(e2, cs));
      atomic_fetch_add(&c_replays, 2);
      *slot = 0;
      count_ne(cs, out2, size, v + 3, slot);
      CU(cuStreamSynchronize(cs));
      if (*slot) atomic_fetch_add(&c_bad_replays, 1);
    }
    CU(cuStreamSynchronize(cs));
    if (e1) CU(cuGraphExecDestroy(e1));
    if (e2) CU(cuGraphExecDestroy(e2));
    if (g1) CU(cuGraphDestroy(g1));
    if (g2) CU(cuGraphDestroy(g2));
    if (out1) xfree(out1, size, cs);
    if (out2) xfree(out2, size, cs);
    xfree(in, size, cs);
    cudapool_release_pool(0, 0, pid); /* two graphs held the pool */
    cudapool_release_pool(0, 0, pid);
  }
  CU(cuStreamSynchronize(cs));
  CU(cuMemFreeHost(slot));
  atomic_store(&beat[me], 0);
  return NULL;
}

/* Allocate 256 MiB blocks under a memory fraction until out of memory, free
 * them, allocate again. */
static int oom_phase(double frac) {
  size_t fr = 0, total = 0;
  CU(cuMemGetInfo(&fr, &total));
  cudapool_set_memory_fraction(frac, 0);
  int limit = (int)(2 * total * frac / (256 * MiB)) + 8, n = 0, got_oom = 0; /* stops at the first NULL */
  void **held = calloc((size_t)limit, sizeof *held);
  for (; n < limit; n++) {
    held[n] = cudapool_malloc(256 * MiB, 0, NULL);
    if (!held[n]) {
      got_oom = strstr(lasterr(), "out of memory") != NULL;
      break;
    }
  }
  for (int i = 0; i < n; i++) cudapool_free(held[i], 256 * MiB, 0, NULL);
  free(held);
  cudapool_empty_cache();
  void *p = cudapool_malloc(64 * MiB, 0, NULL);
  if (!p) printf("OOM phase: the allocation after freeing failed: %.400s\n", lasterr());
  int ok = got_oom && p != NULL;
  if (p) cudapool_free(p, 64 * MiB, 0, NULL);
  cudapool_set_memory_fraction(1.0, 0);
  cudapool_empty_cache();
  printf("OOM phase: %d x 256 MiB under fraction %.2f, then %s; recovered: %s\n", n, frac,
         got_oom ? "out of memory" : "NO out-of-memory error", ok ? "yes" : "NO");
  return ok;
}

static long long allocated_bytes(void) {
  char *js = cudapool_memory_stats_json(0);
  long long v = -1;
  const char *k = js ? strstr(js, "\"allocated_bytes.all.current\":") : NULL;
  if (k) v = atoll(k + strlen("\"allocated_bytes.all.current\":"));
  cudapool_string_free(js);
  return v;
}

static void summary(const char *hang) {
  int ok = atomic_load(&c_errors) == 0 && atomic_load(&c_corrupt) == 0 && atomic_load(&c_bad_delayed) == 0 &&
           atomic_load(&c_bad_replays) == 0 && leak == 0 && oom_ok[0] == 1 && oom_ok[1] == 1 && !hang;
  const char *conf = getenv("CUDAPOOL_CONF") ? getenv("CUDAPOOL_CONF") : getenv("PYTORCH_CUDA_ALLOC_CONF");
  printf("\n%-32s %s\n", "allocator", "cudapool (C ABI)");
  printf("%-32s %s\n", "CUDAPOOL_CONF", conf && *conf ? conf : "-");
  printf("%-32s %.1f\n", "seconds", now_s() - t_start);
  printf("%-32s %lld\n", "operations", (long long)c_ops);
  printf("%-32s %lld\n", "verified blocks", (long long)c_verified);
  printf("%-32s %lld\n", "corrupted elements", (long long)c_corrupt);
  printf("%-32s %lld (%lld)\n", "delayed reads (bad)", (long long)c_delayed, (long long)c_bad_delayed);
  printf("%-32s %lld / %lld (%lld)\n", "graph captures / replays (bad)", (long long)c_captures, (long long)c_replays,
         (long long)c_bad_replays);
  printf("%-32s %lld\n", "empty_cache calls", (long long)c_empty);
  printf("%-32s %d / %d\n", "OOM + recovery before / after", oom_ok[0], oom_ok[1]);
  printf("%-32s %lld\n", "leak (bytes)", leak);
  printf("%-32s %lld %s\n", "errors", (long long)c_errors, first_error);
  printf("%-32s %s\n", "hang", hang ? hang : "no");
  printf("%-32s %s\n", "RESULT", ok ? "PASS" : "FAIL");
  printf("SOAK-RESULT {\"allocator\": \"cudapool-c\", \"conf\": \"%s\", \"seconds\": %.1f, \"ops\": %lld, "
         "\"allocs\": %lld, \"frees\": %lld, \"verified\": %lld, \"corrupted_elems\": %lld, \"delayed_reads\": %lld, "
         "\"bad_delayed_reads\": %lld, \"captures\": %lld, \"replays\": %lld, \"bad_replays\": %lld, "
         "\"empty_caches\": %lld, \"ooms_in_loop\": %lld, \"oom_phases\": \"%d / %d\", \"leak_bytes\": %lld, "
         "\"errors\": %lld, \"hang\": %s%s%s, \"ok\": %s}\n",
         conf ? conf : "", now_s() - t_start, (long long)c_ops, (long long)c_allocs, (long long)c_frees,
         (long long)c_verified, (long long)c_corrupt, (long long)c_delayed, (long long)c_bad_delayed,
         (long long)c_captures, (long long)c_replays, (long long)c_bad_replays, (long long)c_empty,
         (long long)c_ooms, oom_ok[0], oom_ok[1], leak, (long long)c_errors, hang ? "\"" : "",
         hang ? hang : "null", hang ? "\"" : "", ok ? "true" : "false");
  fflush(stdout);
}

static void *watchdog_main(void *arg) {
  (void)arg;
  for (;;) {
    sleep(2);
    double now = now_s();
    long long now_ms = (long long)((now - t_start) * 1000);
    for (int i = 0; i < WORKERS + 2; i++) {
      long long b = atomic_load(&beat[i]);
      if (b && now_ms - b > watchdog_s * 1000) {
        char what[64];
        snprintf(what, sizeof what, "thread %d stalled", i);
        printf("WATCHDOG: no progress for %.0f s in %s: hang\n", watchdog_s, what);
        summary(what);
        _exit(3);
      }
    }
    if (now > deadline + watchdog_s) {
      printf("WATCHDOG: the run overstayed its %.0f s by %.0f s: hang\n", soak_s, watchdog_s);
      summary("overran");
      _exit(3);
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc > 1) soak_s = atof(argv[1]);
  else if (getenv("SOAK_S")) soak_s = atof(getenv("SOAK_S"));
  if (getenv("WATCHDOG_S")) watchdog_s = atof(getenv("WATCHDOG_S"));
  t_start = now_s();
  deadline = t_start + soak_s + watchdog_s; /* setup, until the threads start */
  CU(cuInit(0));
  CUdevice dev;
  CU(cuDeviceGet(&dev, 0));
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  capinfo = (capinfo_fn)dlsym(RTLD_DEFAULT, "cuStreamGetCaptureInfo");
  const char *ptx = getenv("KERNELS_PTX") ? getenv("KERNELS_PTX") : "build/gpu/soak_kernels.ptx";
  CUmodule mod;
  CU(cuModuleLoad(&mod, ptx));
  CU(cuModuleGetFunction(&k_fill, mod, "soak_fill"));
  CU(cuModuleGetFunction(&k_count, mod, "soak_count_ne"));
  CU(cuModuleGetFunction(&k_spin, mod, "soak_spin"));
  CU(cuModuleGetFunction(&k_add, mod, "soak_add_one"));
  if (!capinfo || atomic_load(&c_errors)) {
    printf("FATAL: setup failed: %s\n", capinfo ? first_error : "cuStreamGetCaptureInfo not found");
    return 1;
  }
  int ndev = 0;
  CU(cuDeviceGetCount(&ndev));
  cudapool_init(ndev);
  pthread_t wd;
  beat_now(WORKERS + 1);
  pthread_create(&wd, NULL, watchdog_main, NULL);
  oom_ok[0] = oom_phase(0.15);
  long long baseline = allocated_bytes();
  atomic_store(&beat[WORKERS + 1], 0);
  deadline = now_s() + soak_s;
  static struct worker ws[WORKERS];
  pthread_t th[WORKERS + 1];
  for (int i = 0; i < WORKERS; i++) {
    ws[i].id = i;
    ws[i].rng = 0x9E3779B97F4A7C15ull * (i + 1);
    pthread_create(&th[i], NULL, worker_main, &ws[i]);
  }
  pthread_create(&th[WORKERS], NULL, capturer_main, NULL);
  for (int i = 0; i <= WORKERS; i++) pthread_join(th[i], NULL);
  beat_now(WORKERS + 1);
  CU(cuCtxSynchronize());
  cudapool_empty_cache(); /* also ends the deferred frees of the delayed reads */
  leak = allocated_bytes() - baseline;
  oom_ok[1] = oom_phase(0.15);
  summary(NULL);
  int ok = atomic_load(&c_errors) == 0 && c_corrupt == 0 && c_bad_delayed == 0 && c_bad_replays == 0 && leak == 0 &&
           oom_ok[0] == 1 && oom_ok[1] == 1;
  return ok ? 0 : 1;
}
