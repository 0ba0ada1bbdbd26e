// SPDX-License-Identifier: Apache-2.0
/*
 * c_bench.c - the C-level workloads of bench/workloads.h through
 * libcudapool.so (cudapool_malloc / cudapool_free on device 0).
 *
 *   c_bench --config cudapool [--trace demo/trace.txt] [options of workloads.h]
 *
 * Needs no CUDA headers or link-time libcuda: the few driver functions used
 * to make device 0's primary context current and to create streams are
 * looked up in libcuda.so.1 at run time. With CUDAPOOL_BACKEND=sim the
 * library's simulator is used and streams are made-up handles (for testing
 * the benchmark without a GPU).
 *
 * As under PyTorch (whose cudapool_torch_malloc declares it), the allocator
 * is told that every capture is announced, so malloc does not ask the driver
 * whether the stream is capturing: a never-used private pool is announced
 * once, as capi/ctest/replay.c does.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudapool.h"
#include "cudapool_testing.h"
#include "workloads.h"

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;

static struct {
	CUresult (*init)(unsigned int);
	CUresult (*deviceGet)(CUdevice *, int);
	CUresult (*primaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*ctxSetCurrent)(CUcontext);
	CUresult (*ctxSynchronize)(void);
	CUresult (*streamCreate)(CUstream *, unsigned int);
} cu;

static CUcontext g_ctx;
static int g_sim;
/* C_BENCH_FREE=deferred: frees through cudapool_free_deferred, performed by
 * the next cudapool_malloc_ctx in its own call into Go (one crossing per
 * pair, as PyTorch's class path; the C API's free reports a bad pointer at
 * the call and so cannot wait). For measuring what a crossing costs
 * (docs/hot-path.md, "Why it is built this way"). */
static int g_deferred;
static uintptr_t g_fake_stream = 0x5000;
static __thread char g_err[512];

static int reject_all(void *ctx, cudapool_stream s) {
	(void)ctx;
	(void)s;
	return 0;
}

static const char *bk_last_error(void) {
	if (g_err[0])
		return g_err;
	const char *e = cudapool_last_error();
	return e ? e : "";
}

#define LOAD(field, name)                                                                                   \
	do {                                                                                                    \
		*(void **)(&cu.field) = dlsym(h, name);                                                             \
		if (cu.field == NULL) {                                                                             \
			snprintf(g_err, sizeof g_err, "libcuda.so.1 has no %s", name);                                  \
			return -1;                                                                                      \
		}                                                                                                   \
	} while (0)

static int bk_init(char *name, size_t name_len) {
	const char *backend = getenv("CUDAPOOL_BACKEND");
	g_sim = backend != NULL && strcmp(backend, "sim") == 0;
	if (!g_sim) {
		void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
		if (h == NULL) {
			snprintf(g_err, sizeof g_err, "dlopen(libcuda.so.1): %s", dlerror());
			return -1;
		}
		LOAD(init, "cuInit");
		LOAD(deviceGet, "cuDeviceGet");
		LOAD(primaryCtxRetain, "cuDevicePrimaryCtxRetain");
		LOAD(ctxSetCurrent, "cuCtxSetCurrent");
		LOAD(ctxSynchronize, "cuCtxSynchronize");
		LOAD(streamCreate, "cuStreamCreate");
		CUdevice dev;
		CUresult r;
		if ((r = cu.init(0)) != 0 || (r = cu.deviceGet(&dev, 0)) != 0 || (r = cu.primaryCtxRetain(&g_ctx, dev)) != 0 ||
		    (r = cu.ctxSetCurrent(g_ctx)) != 0) {
			snprintf(g_err, sizeof g_err, "CUDA driver setup failed (CUresult %d)", r);
			return -1;
		}
	}
	const char *fm = getenv("C_BENCH_FREE");
	g_deferred = fm != NULL && strcmp(fm, "deferred") == 0;
	cudapool_init(-1);
	if (cudapool_last_error() != NULL)
		return -1;
	/* Announce a never-used private pool (see the comment at the top). */
	cudapool_begin_allocate_to_pool(0, 0, 1ULL << 62, reject_all, NULL);
	cudapool_end_allocate_to_pool(0, 0, 1ULL << 62);
	cudapool_release_pool(0, 0, 1ULL << 62);
	snprintf(name, name_len, "cudapool%s%s", g_sim ? " (simulator)" : "", g_deferred ? " (deferred frees)" : "");
	return 0;
}

static void *bk_malloc(size_t size, bk_stream s) {
	if (g_deferred)
		return cudapool_malloc_ctx(size, 0, (cudapool_stream)s, 0);
	return cudapool_malloc(size, 0, (cudapool_stream)s);
}

static void bk_free(void *p, size_t size, bk_stream s) {
	if (g_deferred)
		cudapool_free_deferred(p, size, 0, 0);
	else
		cudapool_free(p, size, 0, (cudapool_stream)s);
}

static bk_stream bk_stream_new(void) {
	if (g_sim) {
		g_fake_stream += 0x100;
		return (bk_stream)g_fake_stream;
	}
	CUstream s = NULL;
	CUresult r = cu.streamCreate(&s, 1 /* CU_STREAM_NON_BLOCKING */);
	if (r != 0) {
		snprintf(g_err, sizeof g_err, "cuStreamCreate: CUresult %d", r);
		return NULL;
	}
	return (bk_stream)s;
}

static void bk_thread_enter(void) {
	if (!g_sim)
		cu.ctxSetCurrent(g_ctx);
}

static void bk_empty_cache(void) {
	cudapool_empty_cache();
}

static void bk_sync(void) {
	if (!g_sim)
		cu.ctxSynchronize();
}

static long long stat_of(const char *js, const char *key) {
	char pat[128];
	snprintf(pat, sizeof pat, "\"%s\":", key);
	const char *p = js ? strstr(js, pat) : NULL;
	return p ? strtoll(p + strlen(pat), NULL, 10) : -1;
}

static int bk_stats(long long *cur_res, long long *peak_alloc, long long *peak_res, long long *peak_segs) {
	char *js = cudapool_memory_stats_json(0);
	if (js == NULL)
		return -1;
	*cur_res = stat_of(js, "reserved_bytes.all.current");
	*peak_alloc = stat_of(js, "allocated_bytes.all.peak");
	*peak_res = stat_of(js, "reserved_bytes.all.peak");
	*peak_segs = stat_of(js, "segment.all.peak");
	cudapool_string_free(js);
	return 0;
}

static int bk_current(long long *alloc, long long *res) {
	cudapool_device_stats st;
	if (cudapool_get_device_stats(0, &st) != 0)
		return -1;
	*alloc = st.allocated_bytes[0].current;
	*res = st.reserved_bytes[0].current;
	return 0;
}

static void bk_trace_extras(char *buf, size_t len) {
	char *js = cudapool_memory_stats_json(0);
	/* Stitching's page moves on device 0: the snapshot's
	 * allocator_settings.stitch_remaps, a list per device. */
	char *snap = cudapool_snapshot_json();
	const char *r = snap ? strstr(snap, "\"stitch_remaps\":[") : NULL;
	long long remaps = r ? strtoll(r + strlen("\"stitch_remaps\":["), NULL, 10) : -1;
	/* and its synchronizations for other streams' pages (stitch_syncs) */
	const char *y = snap ? strstr(snap, "\"stitch_syncs\":[") : NULL;
	long long syncs = y ? strtoll(y + strlen("\"stitch_syncs\":["), NULL, 10) : -1;
	/* Over every pass: mallocs the front served without entering Go, and
	 * blocks it left untracked in cold mode (-1: no counters). */
	cudapool_front_counters fc = {0};
	int ok = cudapool_get_front_counters(0, &fc) == 0;
	snprintf(buf, len,
	         "\"trace_device_allocs\":%lld,\"trace_alloc_retries\":%lld,\"trace_stitch_remaps\":%lld,"
	         "\"trace_stitch_syncs\":%lld,\"trace_front_hits\":%lld,\"trace_front_cold_skipped\":%lld",
	         stat_of(js, "num_device_alloc"), stat_of(js, "num_alloc_retries"), remaps, syncs, ok ? (long long)fc.hits : -1,
	         ok ? (long long)fc.cold_skipped : -1);
	cudapool_string_free(snap);
	cudapool_string_free(js);
}

#ifndef WL_PAIR_PREFIX /* bench/pair_bench.c has the main */
int main(int argc, char **argv) {
	return wl_main(argc, argv);
}
#endif
