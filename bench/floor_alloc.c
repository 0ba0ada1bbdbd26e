// SPDX-License-Identifier: Apache-2.0
/*
 * floor_alloc.c - the cheapest possible pluggable allocator, to measure what
 * PyTorch's CUDAPluggableAllocator path itself costs per torch.empty.
 *
 * It caches freed blocks by exact size under one mutex and never returns
 * memory; it ignores streams. It is NOT a usable allocator: it exists only so
 * that bench/torch_bench.py can time torch.empty(4 KiB) through the same
 * PyTorch machinery cudapool uses, with (nearly) no allocator work behind it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define SLOTS 1024
#define DEPTH 64

static struct {
	size_t size;
	int n;
	void *ptrs[DEPTH];
} cache[SLOTS];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int (*mem_alloc)(uintptr_t *, size_t);

static int slot(size_t size) {
	size_t i = (size * 0x9e3779b97f4a7c15ull >> 20) & (SLOTS - 1);
	for (int k = 0; k < SLOTS; k++, i = (i + 1) & (SLOTS - 1))
		if (cache[i].size == size || cache[i].size == 0) {
			cache[i].size = size;
			return (int)i;
		}
	return -1;
}

void *floor_malloc(size_t size, int device, void *stream) {
	(void)device, (void)stream;
	if (size == 0)
		return NULL;
	pthread_mutex_lock(&mu);
	int i = slot(size);
	if (i >= 0 && cache[i].n > 0) {
		void *p = cache[i].ptrs[--cache[i].n];
		pthread_mutex_unlock(&mu);
		return p;
	}
	pthread_mutex_unlock(&mu);
	if (!mem_alloc) {
		void *h = dlopen("libcuda.so.1", RTLD_NOW);
		mem_alloc = h ? (int (*)(uintptr_t *, size_t))dlsym(h, "cuMemAlloc_v2") : NULL;
		if (!mem_alloc)
			return NULL;
	}
	uintptr_t d = 0;
	return mem_alloc(&d, size) == 0 ? (void *)d : NULL;
}

void floor_free(void *p, size_t size, int device, void *stream) {
	(void)device, (void)stream;
	pthread_mutex_lock(&mu);
	int i = slot(size);
	if (i >= 0 && cache[i].n < DEPTH)
		cache[i].ptrs[cache[i].n++] = p; /* else leaked: never in the benchmark */
	pthread_mutex_unlock(&mu);
}
