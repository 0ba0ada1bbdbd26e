/*
 * cuda_ctx.h - for the C programs that call cudapool on the real driver
 * (bench/hot_path.c, gpu/runtime_threads.c): cuda_ctx_setup retains device
 * 0's primary context and makes it current on the calling thread, as
 * PyTorch has it, through the driver loaded at run time (no CUDA toolkit);
 * under CUDAPOOL_BACKEND=sim it does nothing. cuda_ctx_enter makes the
 * context current on another thread. Header-only: each program includes it
 * once.
 */
#ifndef CUDAPOOL_BENCH_CUDA_CTX_H
#define CUDAPOOL_BENCH_CUDA_CTX_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef struct CUctx_st *CUcontext;
static CUcontext cuda_ctx;
static CUresult (*cuda_ctx_set_current)(CUcontext);

/* cuda_ctx_setup returns 0, or -1 after saying why on stderr (prog names
 * the program). */
static int cuda_ctx_setup(const char *prog) {
	const char *backend = getenv("CUDAPOOL_BACKEND");
	if (backend != NULL && strcmp(backend, "sim") == 0)
		return 0;
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
	if (h == NULL) {
		fprintf(stderr, "%s: no libcuda.so.1 (%s); set CUDAPOOL_BACKEND=sim to use the simulator\n", prog,
		        dlerror());
		return -1;
	}
	CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
	CUresult (*device_get)(int *, int) = (CUresult(*)(int *, int))dlsym(h, "cuDeviceGet");
	CUresult (*retain)(CUcontext *, int) = (CUresult(*)(CUcontext *, int))dlsym(h, "cuDevicePrimaryCtxRetain");
	cuda_ctx_set_current = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
	int dev;
	if (!init || !device_get || !retain || !cuda_ctx_set_current || init(0) || device_get(&dev, 0) ||
	    retain(&cuda_ctx, dev) || cuda_ctx_set_current(cuda_ctx)) {
		fprintf(stderr, "%s: CUDA driver setup failed\n", prog);
		return -1;
	}
	return 0;
}

static inline void cuda_ctx_enter(void) {
	if (cuda_ctx_set_current != NULL)
		cuda_ctx_set_current(cuda_ctx);
}

#endif
