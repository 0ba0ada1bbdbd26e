// SPDX-License-Identifier: Apache-2.0
/* GPU test of libcudapool.so on a real device, through the C ABI only.
 * Built on the GPU machine: gcc test_gpu.c -I include -L lib -lcudapool -lcuda
 * (kernels come from kernels.ptx, made by nvcc -ptx). Run by gpu/run_tests.sh.
 * Prints one line per check and "GPU C ABI: N passed, M failed" last. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudapool.h"

static int passed, failed;
#define CHECK(cond, ...)                                            \
  do {                                                              \
    if (cond) {                                                     \
      passed++;                                                     \
      printf("ok   ");                                              \
    } else {                                                        \
      failed++;                                                     \
      printf("FAIL ");                                              \
    }                                                               \
    printf(__VA_ARGS__);                                            \
    printf("\n");                                                   \
    fflush(stdout);                                                 \
  } while (0)
#define CU(call)                                                            \
  do {                                                                      \
    CUresult r_ = (call);                                                   \
    if (r_ != CUDA_SUCCESS) {                                               \
      const char *s_ = "?";                                                 \
      cuGetErrorName(r_, &s_);                                              \
      printf("FAIL %s:%d %s -> %s\n", __FILE__, __LINE__, #call, s_);       \
      failed++;                                                             \
    }                                                                       \
  } while (0)

static CUmodule mod;
static CUfunction k_fill, k_spin, k_add;
typedef CUresult (*capinfo_fn)(CUstream, CUstreamCaptureStatus *, cuuint64_t *);
static capinfo_fn capinfo;

static const char *lasterr(void) {
  const char *e = cudapool_last_error();
  return e ? e : "(none)";
}

static void fill(CUstream s, void *p, unsigned n, unsigned v) {
  CUdeviceptr d = (CUdeviceptr)p;
  void *args[] = {&d, &n, &v};
  CU(cuLaunchKernel(k_fill, (n + 255) / 256, 1, 1, 256, 1, 1, 0, s, args, NULL));
}

static size_t mem_free(void) {
  size_t f = 0, t = 0;
  CU(cuMemGetInfo(&f, &t));
  return f;
}

struct capctx {
  cuuint64_t id;
};

/* PyTorch's filter: is this stream capturing into our capture sequence? */
static int capture_filter(void *ctx, cudapool_stream s) {
  CUstreamCaptureStatus st;
  cuuint64_t id = 0;
  if (capinfo((CUstream)s, &st, &id) != CUDA_SUCCESS) return 0;
  return st == CU_STREAM_CAPTURE_STATUS_ACTIVE && id == ((struct capctx *)ctx)->id;
}

static void test_reuse(CUstream s1, CUstream s2) {
  void *p = cudapool_malloc(4096, 0, (cudapool_stream)s1);
  CHECK(p != NULL, "malloc 4 KiB on a real stream (%s)", p ? "" : lasterr());
  fill(s1, p, 1024, 7);
  CU(cuStreamSynchronize(s1));
  cudapool_free(p, 4096, 0, (cudapool_stream)s1);
  void *q = cudapool_malloc(4096, 0, (cudapool_stream)s1);
  CHECK(q == p, "same size, same stream: the cached block is reused");
  cudapool_free(q, 4096, 0, (cudapool_stream)s1);
  void *r = cudapool_malloc(4096, 0, (cudapool_stream)s2);
  CHECK(r != p, "another stream does not get the block");
  cudapool_free(r, 4096, 0, (cudapool_stream)s2);
}

static void test_record_stream(CUstream s1, CUstream s2) {
  const unsigned n = 1 << 20; /* 4 MiB */
  unsigned *bad;
  CU(cuMemAllocHost((void **)&bad, sizeof *bad));
  *bad = 0;
  void *p = cudapool_malloc(n * 4, 0, (cudapool_stream)s1);
  fill(s1, p, n, 0xA);
  CU(cuStreamSynchronize(s1));
  /* s2 spins for 300 ms, then checks that p still holds 0xA. */
  CUdeviceptr dp = (CUdeviceptr)p, db = (CUdeviceptr)bad;
  unsigned v = 0xA;
  unsigned long long ns = 300ull * 1000 * 1000;
  unsigned nn = n;
  void *args[] = {&dp, &nn, &v, &ns, &db};
  CU(cuLaunchKernel(k_spin, 1, 1, 1, 256, 1, 1, 0, s2, args, NULL));
  cudapool_record_stream(p, (cudapool_stream)s2);
  cudapool_free(p, n * 4, 0, (cudapool_stream)s1);
  /* The same request on s1 at once must not get p: s2 still reads it. */
  void *q = cudapool_malloc(n * 4, 0, (cudapool_stream)s1);
  CHECK(q != p, "record_stream: no reuse while the side stream's kernel runs");
  fill(s1, q, n, 0xB); /* would corrupt s2's read if q aliased p */
  CU(cuCtxSynchronize());
  CHECK(*bad == 0, "record_stream: the side stream saw intact data (%u bad)", *bad);
  cudapool_free(q, n * 4, 0, (cudapool_stream)s1);
  void *r = cudapool_malloc(n * 4, 0, (cudapool_stream)s1);
  CHECK(r == p || r == q, "after the kernel finished the block is reusable");
  cudapool_free(r, n * 4, 0, (cudapool_stream)s1);
  CU(cuMemFreeHost(bad));
}

/* Capture with begin/end announcements, as PyTorch does. */
static void test_capture(CUstream cs, int announce, int mode) {
  const unsigned n = 1 << 18;
  struct capctx ctx = {0};
  unsigned long long pool_a = announce ? 1 : 0;
  if (announce) cudapool_begin_allocate_to_pool(0, pool_a, 0, capture_filter, &ctx);
  CU(cuStreamBeginCapture(cs, (CUstreamCaptureMode)mode));
  CUstreamCaptureStatus st;
  CU(capinfo(cs, &st, &ctx.id));
  void *in = cudapool_malloc(n * 4, 0, (cudapool_stream)cs);
  void *tmp = cudapool_malloc(n * 4, 0, (cudapool_stream)cs);
  void *big = cudapool_malloc(64u << 20, 0, (cudapool_stream)cs); /* a new large segment */
  CHECK(in && tmp && big, "%s capture (mode %d): malloc inside the capture (%s)",
        announce ? "announced" : "unannounced", mode, (in && tmp && big) ? "" : lasterr());
  fill(cs, in, n, 41);
  CUdeviceptr din = (CUdeviceptr)in, dtmp = (CUdeviceptr)tmp;
  unsigned nn = n;
  void *args[] = {&dtmp, &din, &nn};
  CU(cuLaunchKernel(k_add, (n + 255) / 256, 1, 1, 256, 1, 1, 0, cs, args, NULL));
  cudapool_free(big, 64u << 20, 0, (cudapool_stream)cs); /* free inside the capture */
  void *out = cudapool_malloc(n * 4, 0, (cudapool_stream)cs);
  void *args2[] = {(CUdeviceptr *)&out, &dtmp, &nn};
  CUdeviceptr dout = (CUdeviceptr)out;
  args2[0] = &dout;
  CU(cuLaunchKernel(k_add, (n + 255) / 256, 1, 1, 256, 1, 1, 0, cs, args2, NULL));
  cudapool_free(tmp, n * 4, 0, (cudapool_stream)cs);
  CUgraph g = NULL;
  CUresult er = cuStreamEndCapture(cs, &g);
  CHECK(er == CUDA_SUCCESS, "capture ended without invalidation (CUresult %d)", (int)er);
  if (announce) cudapool_end_allocate_to_pool(0, pool_a, 0);
  CUgraphExec ge = NULL;
  if (er == CUDA_SUCCESS) {
    CUresult ir = cuGraphInstantiate(&ge, g, 0);
    CHECK(ir == CUDA_SUCCESS, "graph instantiated (CUresult %d)", (int)ir);
    /* Eager work between replays must not touch the graph's memory. */
    void *eager = cudapool_malloc(n * 4, 0, (cudapool_stream)cs);
    CHECK(eager != in && eager != tmp && eager != out, "eager malloc after capture avoids the graph's blocks");
    for (int rep = 0; rep < 3; rep++) {
      fill(cs, eager, n, 999);
      CU(cuGraphLaunch(ge, cs));
    }
    CU(cuStreamSynchronize(cs));
    unsigned *host = malloc(n * 4);
    CU(cuMemcpyDtoH(host, dout, n * 4));
    int okv = 1;
    for (unsigned i = 0; i < n; i++) okv &= host[i] == 43;
    CHECK(okv, "graph replays computed 41+1+1 = 43 everywhere (got %u)", host[0]);
    free(host);
    cudapool_free(eager, n * 4, 0, (cudapool_stream)cs);
    CU(cuGraphExecDestroy(ge));
  }
  if (g) CU(cuGraphDestroy(g));
  cudapool_free(in, n * 4, 0, (cudapool_stream)cs);
  cudapool_free(out, n * 4, 0, (cudapool_stream)cs);
  if (announce) {
    size_t before = mem_free();
    cudapool_release_pool(0, pool_a, 0);
    cudapool_empty_cache();
    size_t after = mem_free();
    CHECK(after >= before + (64u << 20), "release_pool + empty_cache returned the graph's memory (+%zu MiB)",
          (after - before) >> 20);
  }
}

static void test_empty_cache(void) {
  size_t before = mem_free();
  void *p = cudapool_malloc(1ull << 30, 0, NULL);
  CHECK(p != NULL, "malloc 1 GiB");
  size_t held = mem_free();
  cudapool_free(p, 1ull << 30, 0, NULL);
  CHECK(mem_free() <= held + (1 << 20), "freed memory stays cached (reserved)");
  cudapool_empty_cache();
  size_t after = mem_free();
  CHECK(after + (4 << 20) >= before && after > held, "empty_cache gives it back (cuMemGetInfo +%zu MiB)",
        (after - held) >> 20);
}

static void test_fraction(size_t total) {
  cudapool_set_memory_fraction(0.05, 0);
  void *p = cudapool_malloc(total / 10, 0, NULL);
  CHECK(p == NULL, "memory fraction 0.05 refuses 10%% of the device");
  CHECK(strstr(lasterr(), "out of memory") && strstr(lasterr(), "per_process_memory_fraction 0.05 allows"),
        "the error says why: %.200s", lasterr());
  cudapool_set_memory_fraction(1.0, 0);
  p = cudapool_malloc(total / 10, 0, NULL);
  CHECK(p != NULL, "fraction 1.0 allows it again");
  cudapool_free(p, total / 10, 0, NULL);
  cudapool_empty_cache();
}

static void test_oom(void) {
  void *ps[256];
  int n = 0;
  for (; n < 256; n++) {
    ps[n] = cudapool_malloc(8ull << 30, 0, NULL);
    if (!ps[n]) break;
  }
  CHECK(n < 256 && n > 0, "allocated %d x 8 GiB, then ran out", n);
  const char *e = lasterr();
  CHECK(strstr(e, "cudapool_malloc: out of memory on device 0: cannot allocate 8.00 GiB") != NULL,
        "OOM message, in cudapool's words: %.200s", e);
  // The message names other processes ("process N ...") and this one
  // ("this process ..."); on a GPU of its own only the second appears.
  CHECK(strstr(e, "in use on it: this process ") != NULL, "OOM message gives this process's memory in use (NVML)");
  for (int i = 0; i < n; i++) cudapool_free(ps[i], 8ull << 30, 0, NULL);
  void *q = cudapool_malloc(8ull << 30, 0, NULL);
  CHECK(q != NULL, "allocation succeeds again after freeing");
  cudapool_free(q, 8ull << 30, 0, NULL);
  cudapool_empty_cache();
}

/* expandable_segments:True: blocks continue across 2 MiB page boundaries,
 * the memory is usable by kernels, captures map pages in relaxed mode, and
 * empty_cache unmaps. Runs after the other tests (announced captures only:
 * unannounced capture detection stops at the first announcement). */
static void test_expandable(CUstream s1, CUstream cs) {
  cudapool_empty_cache();
  CHECK(cudapool_configure("expandable_segments:True,expandable_map_unit_mb:2") == 0, "configure expandable_segments:True, page by page (%s)", lasterr());
  const unsigned n = (3u << 20) / 4;
  void *a = cudapool_malloc(3u << 20, 0, (cudapool_stream)s1);
  void *b = cudapool_malloc(3u << 20, 0, (cudapool_stream)s1);
  CHECK(a && b && (char *)b == (char *)a + (3u << 20),
        "expandable: consecutive blocks are contiguous across a page boundary (%p %p %s)", a, b, lasterr());
  if (a && b) {
    fill(s1, a, n, 5);
    fill(s1, b, n, 7);
    unsigned *host = malloc(6u << 20);
    CU(cuStreamSynchronize(s1));
    CU(cuMemcpyDtoH(host, (CUdeviceptr)a, 6u << 20));
    int okv = 1;
    for (unsigned i = 0; i < 2 * n; i++) okv &= host[i] == (i < n ? 5u : 7u);
    CHECK(okv, "expandable: kernels write both blocks, read back through the mapping");
    free(host);
    size_t bsize = 0;
    void *base = cudapool_base_allocation(b, &bsize);
    CHECK(base == a && bsize == (6u << 20), "expandable: base allocation is the mapped run (%p, %zu MiB)", base,
          bsize >> 20);
    cudapool_free(a, 3u << 20, 0, (cudapool_stream)s1);
    cudapool_free(b, 3u << 20, 0, (cudapool_stream)s1);
  }
  test_capture(cs, 1, CU_STREAM_CAPTURE_MODE_GLOBAL);
  test_capture(cs, 1, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  test_empty_cache();
  char *js = cudapool_snapshot_json();
  CHECK(js && strstr(js, "\"is_expandable\":true") == NULL, "after empty_cache no expandable segment is left");
  cudapool_string_free(js);
  void *c = cudapool_malloc(40u << 20, 0, (cudapool_stream)s1);
  js = cudapool_snapshot_json();
  CHECK(c && js && strstr(js, "\"is_expandable\":true") != NULL, "the snapshot marks expandable segments");
  cudapool_string_free(js);
  cudapool_free(c, 40u << 20, 0, (cudapool_stream)s1);
  cudapool_empty_cache();
  CHECK(cudapool_configure("expandable_segments:False") == 0, "configure expandable_segments:False");
}

static void test_two_devices(int ndev) {
  if (ndev < 2) {
    printf("skip two devices: only %d device\n", ndev);
    return;
  }
  CUcontext before = NULL, after = NULL;
  CU(cuCtxGetCurrent(&before));
  void *p = cudapool_malloc(1 << 20, 1, NULL);
  CU(cuCtxGetCurrent(&after));
  CHECK(p != NULL, "malloc on device 1 while device 0 is current");
  CHECK(before == after, "the thread's current context is unchanged");
  int ord = -1;
  CU(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)p));
  CHECK(ord == 1, "the memory is on device 1 (ordinal %d)", ord);
  cudapool_free(p, 0, 0, NULL);
  CHECK(strstr(lasterr(), "device 1") != NULL, "freeing it as device 0's is refused: %.100s", lasterr());
  cudapool_free(p, 1 << 20, 1, NULL);
}

int main(void) {
  CU(cuInit(0));
  int ndev = 0;
  CU(cuDeviceGetCount(&ndev));
  CUdevice dev;
  CU(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  size_t total = 0, fr = 0;
  CU(cuMemGetInfo(&fr, &total));
  char name[128];
  CU(cuDeviceGetName(name, sizeof name, dev));
  printf("device: %s, %d device(s), %zu MiB\n", name, ndev, total >> 20);
  capinfo = (capinfo_fn)dlsym(RTLD_DEFAULT, "cuStreamGetCaptureInfo");
  CHECK(capinfo != NULL, "legacy cuStreamGetCaptureInfo found");
  if (!capinfo) return 1;
  CU(cuModuleLoad(&mod, getenv("KERNELS_PTX") ? getenv("KERNELS_PTX") : "build/gpu/kernels.ptx"));
  CU(cuModuleGetFunction(&k_fill, mod, "fill"));
  CU(cuModuleGetFunction(&k_spin, mod, "spin_check"));
  CU(cuModuleGetFunction(&k_add, mod, "add_one"));
  cudapool_init(ndev);
  CUstream s1, s2, cs;
  CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
  CU(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
  CU(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));

  test_reuse(s1, s2);
  test_record_stream(s1, s2);
  test_capture(cs, 0, CU_STREAM_CAPTURE_MODE_GLOBAL); /* before any announcement */
  test_capture(cs, 1, CU_STREAM_CAPTURE_MODE_GLOBAL);
  test_capture(cs, 1, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  test_empty_cache();
  test_fraction(total);
  test_oom();
  test_expandable(s1, cs);
  test_two_devices(ndev);

  char *js = cudapool_memory_stats_json(0);
  int keys = 0;
  for (char *c = js; c && *c; c++) keys += *c == ':';
  CHECK(keys == 122, "memory_stats_json has 122 keys (%d)", keys);
  cudapool_string_free(js);
  printf("GPU C ABI: %d passed, %d failed\n", passed, failed);
  return failed != 0;
}
