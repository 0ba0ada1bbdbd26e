// SPDX-License-Identifier: Apache-2.0
/*
 * test_interop.c - the entry points for other libraries' allocator
 * interfaces (CuPy's CFunctionAllocator, a stream-equality capture filter),
 * on the simulated device: run with CUDAPOOL_BACKEND=sim and no
 * CUDAPOOL_CONF / PYTORCH_CUDA_ALLOC_CONF (make test does). CuPy calls these
 * functions exactly as done here: malloc(param, size, device) and
 * free(param, ptr, device).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <stdlib.h>
#include <string.h>

#include "cudapool.h"
#include "cudapool_testing.h"

#include "check.h"

static long long stat_of(int dev, const char *key) {
	char *js = cudapool_memory_stats_json(dev);
	char pat[256];
	snprintf(pat, sizeof pat, "\"%s\":", key);
	const char *p = js ? strstr(js, pat) : NULL;
	long long v = p ? strtoll(p + strlen(pat), NULL, 10) : -1;
	cudapool_string_free(js);
	return v;
}

/* The "current stream" CuPy would report: what cudapool_cupy_malloc asks. */
static intptr_t current_stream;
static int stream_calls;
static intptr_t get_current_stream(void) {
	stream_calls++;
	return current_stream;
}

/* The CuPy signatures, called through pointers of exactly CuPy's types. */
typedef void *(*cupy_malloc_fn)(void *, size_t, int);
typedef void (*cupy_free_fn)(void *, void *, int);
static cupy_malloc_fn cmalloc = cudapool_cupy_malloc;
static cupy_free_fn cfree = cudapool_cupy_free;

static void test_cupy_default_stream(void) {
	printf("-- CuPy malloc/free with no stream function (legacy default stream)\n");
	long long allocs = stat_of(0, "allocation.all.current");
	void *p = cmalloc(NULL, 4000, 0);
	CHECK(p != NULL, "cupy_malloc(NULL param, 4000, device 0)");
	CHECK(stat_of(0, "allocation.all.current") == allocs + 1, "counted in cudapool's statistics");
	cfree(NULL, p, 0);
	/* The free is queued; the statistics call performs it first. */
	CHECK(stat_of(0, "allocation.all.current") == allocs, "the queued free is performed by the next call");
	void *q = cmalloc(NULL, 4000, 0);
	CHECK(q == p, "the freed block is reused by the next malloc on the same stream");
	cfree(NULL, q, 0);
	cudapool_clear_error();
	CHECK(cmalloc(NULL, 0, 0) == NULL && cudapool_last_error() == NULL, "size 0: NULL without an error");
	CHECK(cmalloc(NULL, 4000, 7) == NULL && err_has("device"), "a bad device fails with a message");
}

static void test_cupy_current_stream(void) {
	printf("-- CuPy malloc on the current stream\n");
	cudapool_stream a = STREAM(0x6100), b = STREAM(0x6200);
	current_stream = (intptr_t)a;
	stream_calls = 0;
	void *p = cmalloc((void *)get_current_stream, 4000, 0);
	CHECK(p != NULL && stream_calls == 1, "malloc asks the stream function once");
	cfree((void *)get_current_stream, p, 0);
	CHECK(stream_calls == 1, "free does not ask for the stream (the block knows it)");
	current_stream = (intptr_t)b;
	void *q = cmalloc((void *)get_current_stream, 4000, 0);
	CHECK(q != NULL && q != p, "a block freed on stream a is not reused on stream b");
	current_stream = (intptr_t)a;
	void *r = cmalloc((void *)get_current_stream, 4000, 0);
	CHECK(r == p, "it is reused on stream a");
	CHECK(snapshot_count("\"stream\":24832") >= 1, "the snapshot shows a segment of stream a (0x6100)");
	cfree(NULL, q, 0);
	cfree(NULL, r, 0);

	current_stream = -1;
	CHECK(cmalloc((void *)get_current_stream, 4000, 0) == NULL && err_has("current-stream function failed"),
	      "a failing stream function (-1) fails the malloc with a message");
	current_stream = 0;
	CHECK(stat_of(0, "allocation.all.current") == 0, "nothing left allocated");
}

static void test_cupy_bad_free(void) {
	printf("-- CuPy free of a pointer cudapool does not know\n");
	long long before = stat_of(0, "allocation.all.current");
	cfree(NULL, (void *)(uintptr_t)0x1234, 0); /* reported on stderr when performed */
	cfree(NULL, NULL, 0);                       /* nothing */
	void *p = cmalloc(NULL, 4000, 0);
	CHECK(p != NULL, "the next malloc works after a bad free was queued");
	cfree(NULL, p, 0);
	CHECK(stat_of(0, "allocation.all.current") == before, "statistics are unaffected");
}

/* A stand-in for the Python C API cudapool_cupy_malloc_raising calls: the
 * handler is a struct, its "call" returns the next scripted answer (a
 * retry, a refusal, or NULL: it raised) and records the arguments. */
typedef struct {
	int refs;      /* Py_IncRef minus Py_DecRef on the handler */
	int calls;     /* handler calls */
	int attempts[4];
	size_t sizes[4];
	int answers[4]; /* per call: 1 retry, 0 no, -1 raise */
	int live_results;
} fake_handler;

static int gil_held = 1;
static int fake_gil_check(void) { return gil_held; }
static int result_true = 1, result_false = 0;
static void fake_incref(void *o) {
	if (o != &result_true && o != &result_false)
		((fake_handler *)o)->refs++;
}
static fake_handler *current_handler;
static void fake_decref(void *o) {
	if (o == &result_true || o == &result_false)
		current_handler->live_results--;
	else
		((fake_handler *)o)->refs--;
}
static void *fake_call(void *callable, const char *fmt, ...) {
	fake_handler *h = callable;
	va_list ap;
	va_start(ap, fmt);
	ssize_t size = va_arg(ap, ssize_t);
	(void)va_arg(ap, int); /* device */
	int attempt = va_arg(ap, int);
	va_end(ap);
	int k = h->calls++;
	h->sizes[k & 3] = (size_t)size;
	h->attempts[k & 3] = attempt;
	int a = h->answers[k & 3];
	if (a < 0)
		return NULL;
	h->live_results++;
	return a ? (void *)&result_true : (void *)&result_false;
}
static int fake_is_true(void *o) { return o == &result_true; }

static void test_cupy_raising(void) {
	printf("-- cudapool_cupy_malloc_raising and its failure handler\n");
	void *api[5] = {(void *)fake_gil_check, (void *)fake_incref, (void *)fake_decref, (void *)fake_call,
	                (void *)fake_is_true};
	cupy_malloc_fn rmalloc = cudapool_cupy_malloc_raising;
	long long allocs = stat_of(0, "allocation.all.current");
	void *p = rmalloc(NULL, 4000, 0);
	CHECK(p != NULL, "it allocates as cudapool_cupy_malloc");
	cfree(NULL, p, 0);
	cudapool_clear_error();
	CHECK(rmalloc(NULL, 1024 * GiB, 0) == NULL && err_has("cudapool_cupy_malloc_raising: out of memory"),
	      "with no handler a failure is NULL with the error, as cudapool_cupy_malloc");
	CHECK(rmalloc(NULL, CUDAPOOL_CUPY_PROBE_SIZE, 0) == NULL, "so is the probe size");

	CHECK(cudapool_cupy_set_failure_handler((void *)1, api, 4) == -1 && err_has("5 functions"),
	      "the handler needs all five functions");
	api[2] = NULL;
	CHECK(cudapool_cupy_set_failure_handler((void *)1, api, 5) == -1 && err_has("NULL"), "none NULL");
	api[2] = (void *)fake_decref;

	fake_handler h = {.answers = {1, -1}};
	current_handler = &h;
	CHECK(cudapool_cupy_set_failure_handler(&h, api, 5) == 0, "a handler is registered");
	void *q = rmalloc(NULL, 4000, 0);
	CHECK(q != NULL && h.calls == 0, "a success does not call it");
	cfree(NULL, q, 0);
	void *r = rmalloc(NULL, 1024 * GiB, 0);
	CHECK(r == (void *)-1, "a failure the handler raises for is -1 (its exception set, for CuPy)");
	CHECK(h.calls == 2 && h.attempts[0] == 0 && h.attempts[1] == 1 && h.sizes[0] == 1024 * GiB,
	      "attempt 0 asked for a retry, which failed, then attempt 1 raised");
	CHECK(h.refs == 0 && h.live_results == 0, "every reference taken is given back");

	h = (fake_handler){.answers = {1, 0}};
	CHECK(rmalloc(NULL, 1024 * GiB, 0) == NULL && h.calls == 2, "a handler that neither retries nor raises: NULL");

	h = (fake_handler){.answers = {-1}};
	CHECK(rmalloc(NULL, CUDAPOOL_CUPY_PROBE_SIZE, 0) == (void *)-1 && h.calls == 1 &&
	          h.sizes[0] == CUDAPOOL_CUPY_PROBE_SIZE,
	      "the probe size calls the handler at once");
	h = (fake_handler){.answers = {1}};
	CHECK(rmalloc(NULL, CUDAPOOL_CUPY_PROBE_SIZE, 0) == NULL && h.calls == 1, "and never retries");

	h = (fake_handler){.answers = {1}};
	current_stream = -1;
	CHECK(rmalloc((void *)get_current_stream, 4000, 0) == (void *)-1 && h.calls == 0,
	      "a failing current-stream function: -1 (its own exception), the handler not called");
	current_stream = 0;

	h = (fake_handler){.answers = {-1}};
	gil_held = 0;
	CHECK(rmalloc(NULL, 1024 * GiB, 0) == NULL && h.calls == 0, "a caller without the GIL gets NULL, no call");
	gil_held = 1;

	CHECK(cudapool_cupy_set_failure_handler(NULL, NULL, 0) == 0, "unregistered");
	CHECK(rmalloc(NULL, 1024 * GiB, 0) == NULL && h.calls == 0, "then failures are NULL again");

	cudapool_clear_error();
	cfree(NULL, (void *)-1, 0);
	CHECK(stat_of(0, "allocation.all.current") == allocs && cudapool_last_error() == NULL,
	      "a free of -1 (a failure a CuPy kept) is ignored");
}

static void test_capture_filter(void) {
	printf("-- a CuPy capture announced with cudapool_filter_stream_is\n");
	cudapool_stream cs = STREAM(0x6300), other = STREAM(0x6400);
	CHECK(cudapool_filter_stream_is((void *)cs, cs) == 1, "the filter accepts its stream");
	CHECK(cudapool_filter_stream_is((void *)cs, other) == 0, "and no other");

	cudapool_empty_cache();
	long long reserved = stat_of(0, "reserved_bytes.all.current");
	cudapool_clear_error();
	cudapool_begin_allocate_to_pool(0, 1ULL << 62, 0, cudapool_filter_stream_is, (void *)cs);
	CHECK(cudapool_last_error() == NULL, "begin_allocate_to_pool with the stream filter");
	CHECK(cudapool_sim_begin_capture(cs, 2) == 0, "sim_begin_capture (relaxed, as CuPy's default)");
	current_stream = (intptr_t)cs;
	void *x = cmalloc((void *)get_current_stream, 4000, 0);
	void *y = cmalloc((void *)get_current_stream, 24 * MiB, 0);
	current_stream = (intptr_t)other;
	void *z = cmalloc((void *)get_current_stream, 4000, 0);
	CHECK(x && y && z, "mallocs during the capture");
	CHECK(snapshot_count("\"segment_pool_id\":[4611686018427387904,0]") == 2,
	      "the capture stream's two segments are in the private pool, the other stream's not");
	cfree(NULL, x, 0);
	cfree(NULL, z, 0);
	cudapool_empty_cache(); /* performs the queued frees inside the capture, refuses to free segments */
	CHECK(err_has("capture is under way"), "empty_cache during the capture is refused");
	CHECK(cudapool_sim_end_capture(cs) == 0, "the capture was not invalidated");
	cudapool_end_allocate_to_pool(0, 1ULL << 62, 0);
	CHECK(cudapool_sim_violations() == 0, "no capture violations");
	cfree(NULL, y, 0);
	cudapool_empty_cache();
	CHECK(snapshot_count("[4611686018427387904,0]") == 2, "the graph's pool keeps its memory until released");
	cudapool_release_pool(0, 1ULL << 62, 0);
	cudapool_empty_cache();
	CHECK(snapshot_count("[4611686018427387904,0]") == 0, "released, empty_cache returns it");
	CHECK(stat_of(0, "reserved_bytes.all.current") == reserved, "all the capture's memory is returned");
	current_stream = 0;
}

/* The GPU interop tests' order: a CuPy stream
 * allocates large and small blocks, frees them and is destroyed (CuPy
 * destroys its Stream when the object dies) while its memory stays cached;
 * then CuPy, Numba (cudapool_malloc_ctx on the legacy stream) and PyTorch
 * grow the device, before and after empty_cache, with stitching (the
 * default). The allocator must never name the dead stream to the driver
 * again: recording an event on it reads freed driver memory. Announced
 * captures, as under cudapool.cupy.install() and PyTorch. Run last: the
 * announcement stays for the process. */
static void test_destroyed_stream(void) {
	printf("-- a CuPy stream destroyed while its memory is cached; other streams grow the device\n");
	cudapool_expect_announced_captures();
	long long violations = cudapool_sim_violations();
	cudapool_stream s = STREAM(0x6500);
	current_stream = (intptr_t)s;
	void *on_s[] = {cmalloc((void *)get_current_stream, 4 * MiB, 0), cmalloc((void *)get_current_stream, 4 * MiB, 0),
	                cmalloc((void *)get_current_stream, 512, 0), cmalloc((void *)get_current_stream, 4096, 0)};
	for (int i = 0; i < 4; i++) {
		CHECK(on_s[i] != NULL, "malloc on the CuPy stream");
		cfree((void *)get_current_stream, on_s[i], 0);
	}
	cudapool_sim_destroy_stream(s);
	current_stream = 0; /* CuPy's null stream from now on */

	void *x = cmalloc((void *)get_current_stream, 256 * KiB, 0);
	void *n = cudapool_malloc_ctx(1 * MiB, 0, STREAM(0), 0);
	CHECK(x != NULL && n != NULL, "CuPy and Numba allocate on the legacy stream");
	cfree((void *)get_current_stream, x, 0);
	CHECK(cudapool_free_ctx(n, 1 * MiB, 0, 0) == 0, "Numba's free");
	cudapool_clear_error();
	cudapool_empty_cache();
	CHECK(cudapool_last_error() == NULL, "empty_cache");
	void *big = cmalloc((void *)get_current_stream, 256 * MiB, 0);
	CHECK(big != NULL, "256 MiB after empty_cache");
	cfree((void *)get_current_stream, big, 0);
	void *t = cudapool_malloc_ctx(300 * MiB, 0, STREAM(0), 0);
	CHECK(t != NULL, "PyTorch's class grows the device further");
	cudapool_free_deferred(t, 0, -1, 0);
	cudapool_empty_cache();
	CHECK(cudapool_sim_violations() == violations, "the destroyed stream was never named to the driver");
}

int main(void) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	test_cupy_default_stream();
	test_cupy_current_stream();
	test_cupy_bad_free();
	test_cupy_raising();
	test_capture_filter();
	test_destroyed_stream();
	CHECK(cudapool_sim_violations() == 0, "no violations in the whole run");
	printf("C interop ABI: %d passed, %d failed\n", passed, failed);
	return failed == 0 ? 0 : 1;
}
