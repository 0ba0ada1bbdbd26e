// SPDX-License-Identifier: Apache-2.0
/*
 * test_cudapool.c - tests libcudapool.so through its C ABI (include/cudapool.h),
 * on the simulated device: run with CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2
 * and no CUDAPOOL_CONF / PYTORCH_CUDA_ALLOC_CONF (make test does).
 *
 * Every check prints one line; the last line is "C ABI: N passed, M failed"
 * and the exit status is non-zero if anything failed. Environment handling
 * (configuration variables, backends) is tested in child processes that
 * re-execute this program with "--child MODE" and another environment.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cudapool.h"
#include "cudapool_testing.h"

#include "check.h"

/* A copy of the current last error, to check that calls leave it alone. */
static char saved_error[4096];
static void save_error(void) {
	const char *e = cudapool_last_error();
	snprintf(saved_error, sizeof saved_error, "%s", e ? e : "");
}
static int error_unchanged(void) {
	const char *e = cudapool_last_error();
	return strcmp(saved_error, e ? e : "") == 0;
}

/* A statistic from the stats JSON; LLONG_MIN if absent. */
static long long json_int(const char *json, const char *key) {
	char pat[256];
	snprintf(pat, sizeof pat, "\"%s\":", key);
	const char *p = json ? strstr(json, pat) : NULL;
	if (p == NULL)
		return -0x7fffffffffffffffLL - 1;
	return strtoll(p + strlen(pat), NULL, 10);
}

static long long stat_of(int dev, const char *key) {
	char *js = cudapool_memory_stats_json(dev);
	long long v = json_int(js, key);
	cudapool_string_free(js);
	return v;
}

static int count_substr(const char *s, const char *sub) {
	int n = 0;
	for (const char *p = s; p && (p = strstr(p, sub)) != NULL; p += strlen(sub))
		n++;
	return n;
}

/* The snapshot contains sub. */
static int snapshot_has(const char *sub) {
	char *js = cudapool_snapshot_json();
	int ok = js != NULL && strstr(js, sub) != NULL;
	cudapool_string_free(js);
	return ok;
}

/* Crude JSON check: balanced brackets and braces outside strings. */
static int json_balanced(const char *s) {
	int depth = 0, in_str = 0;
	for (; *s; s++) {
		if (in_str) {
			if (*s == '\\' && s[1])
				s++;
			else if (*s == '"')
				in_str = 0;
			continue;
		}
		switch (*s) {
		case '"': in_str = 1; break;
		case '{': case '[': depth++; break;
		case '}': case ']':
			if (--depth < 0)
				return 0;
			break;
		}
	}
	return depth == 0 && !in_str;
}

/* ------------------------------------------------------------------ */

/* First of all: the version needs no device and no earlier call. */
static void test_version(void) {
	printf("-- version\n");
	char hdr[32];
	snprintf(hdr, sizeof hdr, "%d.%d.%d", CUDAPOOL_VERSION_MAJOR, CUDAPOOL_VERSION_MINOR, CUDAPOOL_VERSION_PATCH);
	CHECK(strcmp(hdr, CUDAPOOL_VERSION_STRING) == 0, "the header's version macros agree (%s)", hdr);
	const char *v = cudapool_version();
	CHECK(v != NULL && strcmp(v, CUDAPOOL_VERSION_STRING) == 0, "cudapool_version() is the header's: %s",
	      v ? v : "(NULL)");
	CHECK(cudapool_version() == v, "... the same static string every time");
	CHECK(cudapool_abi_version() == CUDAPOOL_ABI_VERSION, "cudapool_abi_version() is the header's (%d)",
	      cudapool_abi_version());
	CHECK(cudapool_last_error() == NULL, "... and asking records no error");
}

static void test_basics(void) {
	printf("-- basics\n");
	cudapool_init(2);
	CHECK(cudapool_last_error() == NULL, "init(2) on 2 simulated devices records no error");
	cudapool_init(-1);
	CHECK(cudapool_last_error() == NULL, "init(-1) skips the device count check");
	cudapool_init(5);
	CHECK(err_has("counts 5 devices"), "init(5) with 2 devices records an error");

	save_error();
	CHECK(cudapool_malloc(0, 0, NULL) == NULL, "malloc(0) returns NULL");
	CHECK(error_unchanged(), "malloc(0) records no error");

	void *p = cudapool_malloc(1000, 0, NULL);
	CHECK(p != NULL, "malloc(1000) succeeds");
	CHECK(((uintptr_t)p % 512) == 0, "malloc result is 512-byte aligned");
	CHECK(error_unchanged(), "a successful malloc leaves the last error alone");

	char *js = cudapool_memory_stats_json(0);
	CHECK(js != NULL, "memory_stats_json(0) returns JSON");
	CHECK(js && count_substr(js, "\":") == 122, "stats JSON has 122 keys (found %d)", js ? count_substr(js, "\":") : -1);
	CHECK(js && js[0] == '{' && json_balanced(js), "stats JSON is a balanced object");
	CHECK(json_int(js, "allocation.all.current") == 1, "allocation.all.current == 1");
	CHECK(json_int(js, "allocated_bytes.all.current") == 1024, "allocated_bytes.all.current == 1024 (1000 rounded)");
	CHECK(json_int(js, "requested_bytes.all.current") == 1000, "requested_bytes.all.current == 1000");
	CHECK(json_int(js, "reserved_bytes.small_pool.current") == (long long)(2 * MiB), "a 2 MiB small segment is reserved");
	CHECK(json_int(js, "max_split_size") == -1, "max_split_size == -1 (unlimited)");
	CHECK(json_int(js, "num_device_alloc") >= 1, "num_device_alloc counts the segment");
	cudapool_string_free(js);

	size_t sz = 0;
	void *base = cudapool_base_allocation(p, &sz);
	CHECK(base != NULL && (uintptr_t)base <= (uintptr_t)p && sz == 2 * MiB, "base_allocation gives the 2 MiB segment");
	sz = 0;
	void *base2 = cudapool_base_allocation((char *)p + 100, &sz);
	CHECK(base2 == base && sz == 2 * MiB, "base_allocation of an interior address gives the segment");

	cudapool_free(p, 1000, 0, NULL);
	CHECK(error_unchanged(), "free records no error");
	CHECK(stat_of(0, "allocation.all.current") == 0, "free: allocation.all.current == 0");
	CHECK(stat_of(0, "reserved_bytes.all.current") == (long long)(2 * MiB), "free keeps the segment cached");
	void *q = cudapool_malloc(1000, 0, NULL);
	CHECK(q == p, "the cached block is reused by the same size and stream");
	cudapool_free(q, 0, 0, NULL);
	CHECK(error_unchanged(), "free with size 0 (unknown) works");
	cudapool_free(NULL, 0, 0, NULL);
	CHECK(error_unchanged(), "free(NULL) does nothing");

	/* Device 1 is independent. */
	void *d1 = cudapool_malloc(3 * MiB, 1, NULL);
	CHECK(d1 != NULL, "malloc on device 1");
	CHECK(stat_of(1, "allocation.all.current") == 1 && stat_of(0, "allocation.all.current") == 0, "stats are per device");
	cudapool_free(d1, 3 * MiB, 1, NULL);

	char *snap = cudapool_snapshot_json();
	CHECK(snap != NULL && snap[0] == '{' && json_balanced(snap), "snapshot_json returns balanced JSON");
	CHECK(snap && strstr(snap, "\"segments\":") && strstr(snap, "\"device_traces\":") &&
	          strstr(snap, "\"allocator_settings\":") && strstr(snap, "\"external_annotations\":"),
	      "snapshot has segments, device_traces, allocator_settings, external_annotations");
	CHECK(snap && strstr(snap, "\"segment_type\":\"small\"") && strstr(snap, "\"state\":\"inactive\""),
	      "snapshot describes segments and blocks");
	cudapool_string_free(snap);
	cudapool_string_free(NULL);
	CHECK(1, "string_free(NULL) does nothing");
}

static void test_bad_input(void) {
	printf("-- bad input\n");
	cudapool_free((void *)0x1234, 0, 0, NULL);
	CHECK(err_has("not allocated by cudapool"), "free of an unknown pointer fails cleanly");

	void *p = cudapool_malloc(4096, 0, NULL);
	cudapool_free(p, 4096, 0, NULL);
	cudapool_free(p, 4096, 0, NULL);
	CHECK(err_has("already freed"), "double free fails cleanly");

	p = cudapool_malloc(4096, 0, NULL);
	cudapool_free(p, 999, 0, NULL);
	CHECK(err_has("allocated with 4096 bytes, freed with 999"), "free with the wrong size fails and frees nothing");
	cudapool_free(p, 4096, 1, NULL);
	CHECK(err_has("allocated on device 0, not device 1"), "free on the wrong device fails");
	cudapool_free(p, 4096, 99, NULL);
	CHECK(err_has("device 99 does not exist"), "free on a bad device fails");
	CHECK(stat_of(0, "allocation.all.current") == 1, "the failed frees freed nothing");
	cudapool_free((char *)p + 512, 0, 0, NULL);
	CHECK(err_has("inside the block"), "free of an interior pointer fails");
	cudapool_free(p, 4096, 0, NULL);
	CHECK(stat_of(0, "allocation.all.current") == 0, "the right free works afterwards");

	CHECK(cudapool_malloc(16, 7, NULL) == NULL && err_has("device 7 does not exist"), "malloc on device 7 fails");
	CHECK(cudapool_malloc(16, -1, NULL) == NULL && err_has("device -1 does not exist"), "malloc on device -1 fails");
	CHECK(cudapool_malloc((size_t)-1, 0, NULL) == NULL && err_has("Tried to allocate more than 1EB memory"), "malloc(SIZE_MAX) fails");
	CHECK(cudapool_malloc(100 * GiB, 0, NULL) == NULL &&
	          err_has("cudapool_malloc: out of memory on device 0: cannot allocate 100.00 GiB (107374182400 bytes)") &&
	          err_has("the device has 80.00 GiB free of 80.00 GiB") && err_has("cudapool holds "),
	      "malloc(100 GiB) on an 80 GiB device fails with cudapool's out-of-memory message: what was asked, what is free and held");
	CHECK(err_has("With expandable segments and stitching (the default)") && err_has("private pools (CUDA graphs, MemPools)") &&
	          !err_has("max_split_size_mb") && err_has("cudapool_empty_cache()") &&
	          !err_has("PYTORCH_CUDA_ALLOC_CONF") && !err_has("pytorch.org") && !err_has("PyTorch"),
	      "... with hints in cudapool's terms, not PyTorch's: with stitching (the default), where reserved memory may still be");
	CHECK(cudapool_configure("expandable_segments:False") == 0 && cudapool_malloc(100 * GiB, 0, NULL) == NULL &&
	          err_has("leave out expandable_segments:False from CUDAPOOL_CONF") && err_has("max_split_size_mb"),
	      "with ordinary segments, the hint names the default configuration");
	CHECK(cudapool_configure("expandable_segments:True,stitch:False") == 0 && cudapool_malloc(100 * GiB, 0, NULL) == NULL &&
	          err_has("leave out stitch:False from CUDAPOOL_CONF") && !err_has("max_split_size_mb"),
	      "with expandable segments without stitching, stitching");
	CHECK(cudapool_configure("") == 0, "back to the defaults");
	CHECK(stat_of(0, "num_ooms") == 3, "num_ooms == 3");

	size_t sz = 7;
	CHECK(cudapool_base_allocation(NULL, &sz) == NULL && err_has("pointer is NULL"), "base_allocation(NULL, size) fails");
	p = cudapool_malloc(4096, 0, NULL);
	CHECK(cudapool_base_allocation(p, NULL) == NULL && err_has("size pointer is NULL"), "base_allocation(p, NULL) fails");
	CHECK(cudapool_base_allocation((void *)0x1234, &sz) == NULL && err_has("not in any cudapool segment"),
	      "base_allocation of an unknown pointer fails");
	cudapool_record_stream(NULL, STREAM(0x10));
	CHECK(err_has("record_stream: the pointer is NULL"), "record_stream(NULL) fails");
	cudapool_record_stream((void *)0x1234, STREAM(0x10));
	CHECK(err_has("record_stream") && err_has("not allocated by cudapool"), "record_stream of an unknown pointer fails");
	cudapool_free(p, 4096, 0, NULL);

	CHECK(cudapool_memory_stats_json(5) == NULL && err_has("device 5 does not exist"), "memory_stats_json(5) fails");
	CHECK(cudapool_memory_stats_json(-3) == NULL && err_has("device -3 does not exist"), "memory_stats_json(-3) fails");
	cudapool_reset_peak_stats(9);
	CHECK(err_has("reset_peak_stats") && err_has("device 9"), "reset_peak_stats(9) fails");
	cudapool_reset_accumulated_stats(9);
	CHECK(err_has("reset_accumulated_stats") && err_has("device 9"), "reset_accumulated_stats(9) fails");
	cudapool_set_memory_fraction(1.5, 0);
	CHECK(err_has("not in [0, 1]"), "set_memory_fraction(1.5) fails");
	cudapool_set_memory_fraction(0.5, 9);
	CHECK(err_has("set_memory_fraction") && err_has("device 9"), "set_memory_fraction on device 9 fails");

	CHECK(cudapool_configure(NULL) == -1 && err_has("configuration string is NULL"), "configure(NULL) fails");
	CHECK(cudapool_configure("max_split_size_mb:1") == -1 && err_has("max_split_size_mb=1 is too small"),
	      "configure with max_split_size_mb:1 fails with a clear message");
	CHECK(cudapool_configure("garbage_collection_threshold:2") == -1 && err_has("strictly between 0 and 1"),
	      "configure with garbage_collection_threshold:2 fails");
	CHECK(cudapool_configure("nonsense") == -1 && err_has("expected key:value"), "configure(\"nonsense\") fails");
	CHECK(stat_of(0, "max_split_size") == -1, "a failed configure changes nothing");
	CHECK(cudapool_configure("max_split_size_mb:200,roundup_power2_divisions:4") == 0, "configure with valid options");
	CHECK(stat_of(0, "max_split_size") == (long long)(200 * MiB), "max_split_size is now 200 MiB");
	char *snap = cudapool_snapshot_json();
	CHECK(snap && strstr(snap, "max_split_size_mb:200"), "the snapshot's allocator_settings show the configuration");
	cudapool_string_free(snap);
	CHECK(cudapool_configure("") == 0 && stat_of(0, "max_split_size") == -1, "configure(\"\") restores the defaults");
	CHECK(snapshot_has("\"stitch\":true") && snapshot_has("\"expandable_segments\":true"),
	      "the defaults: stitching, with expandable segments");
	CHECK(cudapool_configure("expandable_segments:True") == 0 && snapshot_has("\"stitch\":true") &&
	          snapshot_has("\"expandable_segments\":true"),
	      "expandable_segments:True turns stitching on too");
	CHECK(cudapool_configure("expandable_segments:False,stitch:True") == -1 &&
	          err_has("cudapool_configure: stitch:True and expandable_segments:False contradict each other"),
	      "stitch:True with expandable_segments:False is an error, not a choice by key order");
	CHECK(cudapool_configure("stitch:True,expandable_segments:False") == -1 && err_has("contradict each other"),
	      "in either order");
	CHECK(snapshot_has("\"stitch\":true"), "and changes nothing");
	CHECK(cudapool_configure("expandable_segments:False") == 0 && snapshot_has("\"stitch\":false") &&
	          snapshot_has("\"expandable_segments\":false"),
	      "expandable_segments:False turns stitching off too");
	CHECK(cudapool_configure("expandable_segments:True,stitch:False") == 0 && snapshot_has("\"stitch\":false") &&
	          snapshot_has("\"expandable_segments\":true"),
	      "stitch:False keeps expandable segments");
	CHECK(cudapool_configure("stitch:True") == 0 && snapshot_has("\"expandable_segments\":true"),
	      "stitch:True alone implies expandable segments");
	CHECK(cudapool_configure_update("expandable_segments:False") == -1 &&
	          err_has("cudapool_configure_update: stitch:True and expandable_segments:False contradict each other "
	                  "(stitch:True is in force from an earlier configuration)"),
	      "an update contradicting the stitch:True in force is an error");
	CHECK(cudapool_configure_update("expandable_segments:False,stitch:False") == 0 && snapshot_has("\"stitch\":false"),
	      "an update that names both settles it");
	CHECK(cudapool_configure("") == 0 && snapshot_has("\"stitch\":true") && snapshot_has("\"expandable_segments\":true"),
	      "back to the defaults");

	cudapool_end_allocate_to_pool(0, 42, 0);
	CHECK(err_has("end_allocate_to_pool"), "end_allocate_to_pool of an unknown pool fails");
	cudapool_release_pool(0, 42, 0);
	CHECK(err_has("release_pool"), "release_pool of an unknown pool fails");
	cudapool_begin_allocate_to_pool(5, 1, 0, NULL, NULL);
	CHECK(err_has("device 5 does not exist"), "begin_allocate_to_pool on a bad device fails");
	cudapool_end_allocate_to_pool(-1, 1, 0);
	CHECK(err_has("device -1 does not exist"), "end_allocate_to_pool on a bad device fails");
	cudapool_release_pool(8, 1, 0);
	CHECK(err_has("device 8 does not exist"), "release_pool on a bad device fails");

	CHECK(cudapool_sim_begin_capture(NULL, 0) == -1 && err_has("cannot be captured"), "sim_begin_capture(NULL) fails");
	CHECK(cudapool_sim_begin_capture(STREAM(0x77), 9) == -1 && err_has("INVALID_VALUE"), "sim_begin_capture with mode 9 fails");
	CHECK(cudapool_sim_end_capture(STREAM(0x77)) == -1 && err_has("sim_end_capture"), "sim_end_capture of an idle stream fails");
	CHECK(cudapool_sim_violations() == 0, "no capture violations so far");
}

static void test_fraction_and_cache(void) {
	printf("-- memory fraction, empty_cache, statistics resets\n");
	cudapool_set_memory_fraction(0.25, 0); /* 20 GiB of 80 */
	CHECK(cudapool_malloc(30 * GiB, 0, NULL) == NULL && err_has("out of memory") &&
	          err_has("per_process_memory_fraction 0.25 allows cudapool 20.00 GiB"),
	      "with fraction 0.25, 30 GiB is out of memory, and the message says why");
	void *p = cudapool_malloc(10 * GiB, 0, NULL);
	CHECK(p != NULL, "with fraction 0.25, 10 GiB fits");
	cudapool_free(p, 10 * GiB, 0, NULL);
	cudapool_set_memory_fraction(1.0, 0);
	p = cudapool_malloc(30 * GiB, 0, NULL);
	CHECK(p != NULL, "with fraction 1, 30 GiB fits");
	cudapool_free(p, 30 * GiB, 0, NULL);

	CHECK(stat_of(0, "reserved_bytes.all.current") > 0, "freed memory stays reserved");
	long long frees = stat_of(0, "num_device_free");
	cudapool_empty_cache();
	CHECK(stat_of(0, "reserved_bytes.all.current") == 0, "empty_cache returns every cached segment");
	CHECK(stat_of(0, "num_device_free") > frees, "num_device_free counts them");

	p = cudapool_malloc(8 * MiB, 0, NULL);
	cudapool_free(p, 8 * MiB, 0, NULL);
	CHECK(stat_of(0, "allocated_bytes.all.peak") > stat_of(0, "allocated_bytes.all.current"), "peak > current after a free");
	cudapool_reset_peak_stats(0);
	CHECK(stat_of(0, "allocated_bytes.all.peak") == stat_of(0, "allocated_bytes.all.current"), "reset_peak_stats: peak == current");
	CHECK(stat_of(0, "allocation.all.allocated") > 0, "allocation.all.allocated counts allocations");
	cudapool_reset_accumulated_stats(0);
	CHECK(stat_of(0, "allocation.all.allocated") == 0 && stat_of(0, "num_ooms") == 0,
	      "reset_accumulated_stats zeroes the accumulated counters");
	cudapool_empty_cache();
}

static void test_streams(void) {
	printf("-- streams and record_stream\n");
	cudapool_stream s1 = STREAM(0x1000), s2 = STREAM(0x2000);

	void *e = cudapool_malloc(4096, 0, s1);
	cudapool_free(e, 4096, 0, s1);
	void *f = cudapool_malloc(4096, 0, s2);
	CHECK(f != NULL && f != e, "a block freed on stream 1 is not reused by stream 2");
	cudapool_free(f, 4096, 0, s2);

	void *a = cudapool_malloc(4096, 0, s1);
	cudapool_record_stream(a, s2);
	cudapool_sim_submit(s2); /* s2 has work pending */
	cudapool_free(a, 4096, 0, s1);
	CHECK(snapshot_has("active_awaiting_free"), "a freed block used by a busy stream awaits its event");
	void *b = cudapool_malloc(4096, 0, s1);
	CHECK(b != NULL && b != a, "it is not reused while stream 2's work is pending");
	cudapool_sim_complete_all();
	void *c = cudapool_malloc(4096, 0, s1);
	CHECK(c == a, "it is reused once the work completed");
	CHECK(!snapshot_has("active_awaiting_free"), "nothing awaits anymore");
	cudapool_free(b, 4096, 0, s1);
	cudapool_free(c, 4096, 0, s1);

	void *d = cudapool_malloc(4096, 0, s1);
	cudapool_record_stream(d, s1); /* the allocating stream: ignored */
	cudapool_sim_submit(s1);
	cudapool_free(d, 4096, 0, s1);
	void *d2 = cudapool_malloc(4096, 0, s1);
	CHECK(d2 == d, "record_stream on the allocating stream is ignored");
	cudapool_free(d2, 4096, 0, s1);
	cudapool_sim_complete_all();
	cudapool_empty_cache();
}

/* A capture that nobody announces (a C program using cuStreamBeginCapture
 * directly): the allocator asks the driver. Must run before any
 * begin_allocate_to_pool, which switches to announced mode for good. */
static void test_unannounced_capture(void) {
	printf("-- capture without begin_allocate_to_pool\n");
	cudapool_stream cs = STREAM(0x4000);
	CHECK(cudapool_sim_begin_capture(cs, 0) == 0, "sim_begin_capture (global mode)");
	void *x = cudapool_malloc(4000, 0, cs);
	CHECK(x != NULL, "malloc on the capturing stream");
	void *y = cudapool_malloc(64 * MiB, 0, cs);
	CHECK(y != NULL, "a large malloc on the capturing stream (new segment)");
	cudapool_free(x, 4000, 0, cs);
	cudapool_free(y, 64 * MiB, 0, cs);
	cudapool_empty_cache();
	CHECK(err_has("capture is under way"), "empty_cache during the capture keeps the cache and says why");
	CHECK(cudapool_sim_end_capture(cs) == 0, "sim_end_capture: the capture was not invalidated");
	CHECK(cudapool_sim_violations() == 0, "no capture violations");
	cudapool_empty_cache();
}

struct filter_ctx {
	cudapool_stream target;
	int calls;
};

static int capture_filter(void *ctx, cudapool_stream s) {
	struct filter_ctx *fc = ctx;
	fc->calls++;
	return s == fc->target;
}

static void test_capture(void) {
	printf("-- capture with begin/end_allocate_to_pool\n");
	cudapool_stream cs = STREAM(0x5000), other = STREAM(0x1000);
	struct filter_ctx fc = {cs, 0};

	cudapool_empty_cache();
	long long reserved = stat_of(0, "reserved_bytes.all.current");
	cudapool_begin_allocate_to_pool(0, 0, 0, NULL, NULL);
	CHECK(err_has("default pool"), "begin_allocate_to_pool on {0,0} fails");
	save_error();
	cudapool_begin_allocate_to_pool(0, 7, 0, capture_filter, &fc);
	CHECK(error_unchanged(), "begin_allocate_to_pool(0, {7,0}, filter)");
	cudapool_begin_allocate_to_pool(0, 7, 0, capture_filter, &fc);
	CHECK(err_has("already"), "a second begin for a recording pool fails");
	CHECK(cudapool_sim_begin_capture(cs, 0) == 0, "sim_begin_capture (global mode)");

	void *x = cudapool_malloc(4000, 0, cs);
	CHECK(x != NULL, "malloc on the capture stream inside the capture");
	CHECK(fc.calls > 0, "the filter was asked");
	void *y = cudapool_malloc(24 * MiB, 0, cs);
	CHECK(y != NULL, "a large malloc on the capture stream");
	void *z = cudapool_malloc(4000, 0, other);
	CHECK(z != NULL, "malloc on another stream during the capture");
	char *snap = cudapool_snapshot_json();
	CHECK(snap && count_substr(snap, "\"segment_pool_id\":[7,0]") == 2, "the capture's two segments are in pool {7,0}");
	cudapool_string_free(snap);
	CHECK(cudapool_base_allocation(x, &(size_t){0}) != NULL, "base_allocation works during capture");

	save_error();
	cudapool_free(x, 4000, 0, cs);
	CHECK(error_unchanged(), "free inside the capture");
	cudapool_record_stream(y, other);
	cudapool_free(y, 24 * MiB, 0, cs); /* needs an event: deferred until the capture ends */
	CHECK(error_unchanged(), "free of a block used by another stream inside the capture (deferred)");
	cudapool_free(z, 4000, 0, other);
	cudapool_empty_cache();
	CHECK(err_has("capture is under way"), "empty_cache during the capture is refused");

	CHECK(cudapool_sim_end_capture(cs) == 0, "sim_end_capture: the capture was not invalidated");
	save_error();
	cudapool_end_allocate_to_pool(0, 7, 0);
	CHECK(error_unchanged(), "end_allocate_to_pool");
	CHECK(cudapool_sim_violations() == 0, "no capture violations (no cuMemFree, event query or sync in capture)");

	void *w = cudapool_malloc(4000, 0, cs);
	CHECK(w != NULL && w != x, "after end, the stream allocates from the default pool, not the graph's");
	cudapool_free(w, 4000, 0, cs);
	cudapool_sim_complete_all();
	cudapool_empty_cache();
	CHECK(snapshot_has("\"segment_pool_id\":[7,0]"), "the graph's pool keeps its memory until released");
	save_error();
	cudapool_release_pool(0, 7, 0);
	CHECK(error_unchanged(), "release_pool");
	cudapool_empty_cache();
	CHECK(!snapshot_has("\"segment_pool_id\":[7,0]"), "after release, empty_cache returns the pool's memory");
	CHECK(stat_of(0, "reserved_bytes.all.current") == reserved, "all the capture's memory is returned");

	/* NULL filter: every stream; pools shared by a second begin. */
	cudapool_begin_allocate_to_pool(0, 0, 9, NULL, NULL);
	void *u = cudapool_malloc(4000, 0, STREAM(0x9999));
	CHECK(u != NULL && snapshot_has("\"segment_pool_id\":[0,9]"), "a NULL filter routes every stream to the pool");
	cudapool_free(u, 4000, 0, STREAM(0x9999));
	cudapool_end_allocate_to_pool(0, 0, 9);
	save_error();
	cudapool_begin_allocate_to_pool(0, 0, 9, NULL, NULL);
	void *u2 = cudapool_malloc(4000, 0, STREAM(0x9999));
	CHECK(error_unchanged() && u2 == u, "begin again with the same id shares the pool and its cached blocks");
	cudapool_free(u2, 4000, 0, STREAM(0x9999));
	cudapool_end_allocate_to_pool(0, 0, 9);
	cudapool_release_pool(0, 0, 9);
	cudapool_empty_cache();
	CHECK(snapshot_has("\"segment_pool_id\":[0,9]"), "a pool with a holder left keeps its memory");
	cudapool_release_pool(0, 0, 9);
	cudapool_empty_cache();
	CHECK(!snapshot_has("\"segment_pool_id\":[0,9]"), "the last release frees it");
	CHECK(cudapool_sim_violations() == 0, "still no capture violations");
}

/* ------------------------------------------------------------------ */

#define THREADS 16
#define ITERS 2000
#define HELD 24

struct held {
	uintptr_t p;
	size_t size;
};

static struct held held_all[THREADS * HELD];
static int thread_failures;
static volatile int stop_observer;

static void *worker(void *arg) {
	int id = (int)(intptr_t)arg;
	cudapool_stream s = STREAM(0x100 + id);
	unsigned x = 12345u + (unsigned)id * 7919u;
	void *live[8] = {0};
	size_t sizes[8] = {0};
	int fails = 0;
	for (int i = 0; i < ITERS; i++) {
		x = x * 1103515245u + 12345u;
		int slot = (x >> 8) % 8;
		if (live[slot]) {
			cudapool_free(live[slot], sizes[slot], 0, s);
			live[slot] = NULL;
		} else {
			size_t size = 512 + ((x >> 4) % (4 * MiB));
			live[slot] = cudapool_malloc(size, 0, s);
			sizes[slot] = size;
			if (live[slot] == NULL)
				fails++;
		}
	}
	for (int k = 0; k < 8; k++)
		if (live[k])
			cudapool_free(live[k], sizes[k], 0, s);
	for (int k = 0; k < HELD; k++) {
		size_t size = 512 + (size_t)(k * 37 + id) * 1000;
		void *p = cudapool_malloc(size, 0, s);
		if (p == NULL)
			fails++;
		held_all[id * HELD + k] = (struct held){(uintptr_t)p, size};
	}
	__atomic_add_fetch(&thread_failures, fails, __ATOMIC_RELAXED);
	return NULL;
}

static void *observer(void *arg) {
	(void)arg;
	while (!stop_observer) {
		cudapool_string_free(cudapool_memory_stats_json(0));
		cudapool_string_free(cudapool_snapshot_json());
		cudapool_empty_cache(); /* may race with the workers: must be safe */
	}
	return NULL;
}

static int cmp_held(const void *a, const void *b) {
	uintptr_t x = ((const struct held *)a)->p, y = ((const struct held *)b)->p;
	return x < y ? -1 : x > y;
}

static void test_expandable(void) {
	printf("-- expandable_segments:True\n");
	cudapool_stream cs = STREAM(0x5000);
	struct filter_ctx fc = {cs, 0};
	cudapool_empty_cache();
	/* Earlier tests may keep memory (live graph pools): compare with it. */
	long long r0 = stat_of(0, "reserved_bytes.all.current"), s0 = stat_of(0, "segment.all.current");
	CHECK(cudapool_configure("expandable_segments:True,stitch:False,expandable_map_unit_mb:2") == 0,
	      "configure expandable_segments:True without stitching, mapping page by page");
	/* Earlier tests ran with the default (expandable segments too). */
	char *snap = cudapool_snapshot_json();
	int e0 = snap ? count_substr(snap, "\"is_expandable\":true") : -1;
	cudapool_string_free(snap);
	void *a = cudapool_malloc(3 * MiB, 0, 0);
	void *b = cudapool_malloc(3 * MiB, 0, 0);
	CHECK(a && b && (char *)b == (char *)a + 3 * MiB, "the second block continues the first across a page boundary");
	size_t sz = 0;
	CHECK(cudapool_base_allocation(b, &sz) == a && sz == 6 * MiB, "base_allocation gives the mapped run");
	CHECK(stat_of(0, "reserved_bytes.all.current") == r0 + (long long)(6 * MiB), "reserved bytes are mapped bytes");
	CHECK(stat_of(0, "segment.all.current") == s0, "expandable ranges are not counted as segments (as in PyTorch)");
	snap = cudapool_snapshot_json();
	CHECK(snap && count_substr(snap, "\"is_expandable\":true") == e0 + 1, "the snapshot shows one more expandable segment");
	cudapool_string_free(snap);

	/* A capture maps pages for its private pool in relaxed mode. */
	cudapool_begin_allocate_to_pool(0, 8, 0, capture_filter, &fc);
	CHECK(cudapool_sim_begin_capture(cs, 0) == 0, "sim_begin_capture (global mode)");
	void *x = cudapool_malloc(24 * MiB, 0, cs);
	CHECK(x != NULL, "a large malloc inside the capture maps pages");
	cudapool_free(x, 24 * MiB, 0, cs);
	cudapool_free(a, 3 * MiB, 0, 0);
	cudapool_empty_cache();
	CHECK(err_has("capture is under way"), "empty_cache during the capture is refused");
	CHECK(stat_of(0, "reserved_bytes.all.current") == r0 + (long long)(30 * MiB), "nothing was unmapped");
	CHECK(cudapool_sim_end_capture(cs) == 0, "the capture was not invalidated");
	cudapool_end_allocate_to_pool(0, 8, 0);
	cudapool_release_pool(0, 8, 0);
	cudapool_free(b, 3 * MiB, 0, 0);
	cudapool_empty_cache();
	CHECK(stat_of(0, "reserved_bytes.all.current") == r0, "empty_cache unmapped every page");
	CHECK(cudapool_sim_violations() == 0, "no capture violations");
	CHECK(cudapool_configure("") == 0, "back to the defaults");
}

static void test_threads(void) {
	printf("-- %d threads\n", THREADS);
	long long base = stat_of(0, "allocation.all.current");
	pthread_t t[THREADS], obs;
	pthread_create(&obs, NULL, observer, NULL);
	for (int i = 0; i < THREADS; i++)
		pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
	for (int i = 0; i < THREADS; i++)
		pthread_join(t[i], NULL);
	stop_observer = 1;
	pthread_join(obs, NULL);
	CHECK(thread_failures == 0, "%d threads x %d malloc/free with an observer thread: no failure", THREADS, ITERS);
	qsort(held_all, THREADS * HELD, sizeof held_all[0], cmp_held);
	int overlap = 0;
	for (int i = 0; i + 1 < THREADS * HELD; i++)
		if (held_all[i].p + held_all[i].size > held_all[i + 1].p)
			overlap++;
	CHECK(overlap == 0, "%d live allocations from %d threads never overlap", THREADS * HELD, THREADS);
	CHECK(stat_of(0, "allocation.all.current") == base + THREADS * HELD, "the statistics count them all");
	for (int i = 0; i < THREADS * HELD; i++)
		cudapool_free((void *)held_all[i].p, held_all[i].size, 0, NULL);
	CHECK(stat_of(0, "allocation.all.current") == base, "all freed from another thread");
	cudapool_empty_cache();
}

/* ------------------------------------------------------------------ */

static void test_fork(void) {
	printf("-- fork\n");
	void *p = cudapool_malloc(4096, 0, NULL);
	pid_t pid = fork();
	if (pid == 0) {
		alarm(10); /* a hang fails the test instead of blocking it */
		int bad = 0;
		if (cudapool_malloc(1024, 0, NULL) != NULL)
			bad |= 1;
		if (!err_has("forked child"))
			bad |= 2;
		cudapool_free(p, 4096, 0, NULL);
		cudapool_record_stream(p, STREAM(1));
		cudapool_init(2);
		cudapool_empty_cache();
		cudapool_set_memory_fraction(0.5, 0);
		cudapool_reset_peak_stats(0);
		cudapool_reset_accumulated_stats(0);
		cudapool_begin_allocate_to_pool(0, 1, 0, NULL, NULL);
		cudapool_end_allocate_to_pool(0, 1, 0);
		cudapool_release_pool(0, 1, 0);
		cudapool_sim_submit(STREAM(1));
		cudapool_sim_complete_all();
		size_t sz;
		if (cudapool_base_allocation(p, &sz) != NULL)
			bad |= 4;
		if (cudapool_memory_stats_json(0) != NULL || cudapool_snapshot_json() != NULL)
			bad |= 8;
		if (cudapool_configure("") != -1 || cudapool_sim_violations() != -1)
			bad |= 16;
		if (cudapool_sim_begin_capture(STREAM(1), 0) != -1 || cudapool_sim_end_capture(STREAM(1)) != -1)
			bad |= 32;
		/* asked before the fork (test_version): still answered, without Go */
		const char *v = cudapool_version();
		if (v == NULL || strcmp(v, CUDAPOOL_VERSION_STRING) != 0 || cudapool_abi_version() != CUDAPOOL_ABI_VERSION)
			bad |= 64;
		_exit(bad);
	}
	int status = 0;
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork and wait");
	CHECK(WIFEXITED(status), "the child did not hang or crash (status %#x)", status);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "in the child every call returns at once: malloc NULL with the fork error (failures %#x)", WEXITSTATUS(status));
	CHECK(stat_of(0, "allocation.all.current") == 1, "the child's free did not touch the parent's allocator");
	void *q = cudapool_malloc(4096, 0, NULL);
	CHECK(q != NULL, "the parent still allocates after the fork");
	cudapool_free(q, 4096, 0, NULL);
	cudapool_free(p, 4096, 0, NULL);
}

/* ------------------------------------------------------------------ */
/* Environment: child processes re-executing this program. */

extern char **environ;

/* Runs "self --child mode" with the environment changed by sets ("K=V"
 * adds or replaces, "K" removes), capturing its stderr into err. Returns the
 * exit status, or -1. */
static int run_child(const char *self, const char *mode, const char **sets, char *err, size_t errsz) {
	char *envp[512];
	int n = 0;
	for (char **e = environ; *e && n < 480; e++) {
		int drop = 0;
		for (const char **s = sets; *s; s++) {
			size_t k = strcspn(*s, "=");
			if (strncmp(*e, *s, k) == 0 && (*e)[k] == '=')
				drop = 1;
		}
		if (!drop)
			envp[n++] = *e;
	}
	for (const char **s = sets; *s; s++)
		if (strchr(*s, '='))
			envp[n++] = (char *)*s;
	envp[n] = NULL;
	char *argv[] = {(char *)self, "--child", (char *)mode, NULL};

	int fd[2];
	if (pipe(fd) != 0)
		return -1;
	pid_t pid = fork();
	if (pid == 0) {
		dup2(fd[1], 2);
		close(fd[0]);
		close(fd[1]);
		execve("/proc/self/exe", argv, envp);
		_exit(127);
	}
	close(fd[1]);
	size_t len = 0;
	ssize_t r;
	while ((r = read(fd[0], err + len, errsz - 1 - len)) > 0 && len + 1 < errsz)
		len += (size_t)r;
	err[len] = 0;
	close(fd[0]);
	int status;
	if (pid < 0 || waitpid(pid, &status, 0) != pid)
		return -1;
	if (len > 0)
		printf("      [child %s stderr] %s", mode, err);
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

/* The checks made inside a child; the exit status counts the failures. */
static int child_main(const char *mode) {
	alarm(30);
	int bad = 0;
#define EXPECT(c)                                                                                          \
	do {                                                                                               \
		if (!(c)) {                                                                                \
			bad++;                                                                             \
			const char *e_ = cudapool_last_error();                                            \
			printf("      [child %s] failed: %s (last error: %s)\n", mode, #c, e_ ? e_ : "(none)"); \
		}                                                                                          \
	} while (0)
	if (strcmp(mode, "bad-conf") == 0) {
		/* The first call fails with the reason; the rest run with the
		 * default configuration. */
		EXPECT(cudapool_malloc(16, 0, NULL) == NULL);
		EXPECT(err_has("cudapool_malloc: CUDAPOOL_CONF: max_split_size_mb=1 is too small") &&
		       err_has("default configuration"));
		cudapool_clear_error();
		char *js = cudapool_memory_stats_json(0);
		EXPECT(js != NULL && cudapool_last_error() == NULL);
		cudapool_string_free(js);
		EXPECT(stat_of(0, "max_split_size") == -1);
		void *p = cudapool_malloc(16, 0, NULL);
		EXPECT(p != NULL);
		cudapool_free(p, 16, 0, NULL);
		EXPECT(cudapool_configure("max_split_size_mb:64") == 0);
		EXPECT(stat_of(0, "max_split_size") == (long long)(64 * MiB));
	} else if (strcmp(mode, "bad-conf-init") == 0) {
		/* Every cudapool_init reports the refused configuration, also
		 * after other calls (PyTorch's init comes after install()'s). */
		EXPECT(cudapool_memory_stats_json(0) == NULL && err_has("max_split_size_mb=1 is too small"));
		cudapool_clear_error();
		for (int i = 0; i < 2; i++) {
			cudapool_init(-1);
			EXPECT(err_has("cudapool_init: CUDAPOOL_CONF: max_split_size_mb=1 is too small"));
			cudapool_clear_error();
		}
		void *p = cudapool_malloc(16, 0, NULL);
		EXPECT(p != NULL && cudapool_last_error() == NULL);
		cudapool_free(p, 16, 0, NULL);
	} else if (strcmp(mode, "bad-first-configure") == 0) {
		/* Whichever call comes first reports the environment's mistake;
		 * the next one is the caller's own. */
		EXPECT(cudapool_configure("max_split_size_mb:64") == -1 && err_has("cudapool_configure: CUDAPOOL_CONF: "));
		EXPECT(cudapool_configure("max_split_size_mb:64") == 0);
		EXPECT(stat_of(0, "max_split_size") == (long long)(64 * MiB));
	} else if (strcmp(mode, "unknown-keys") == 0) {
		EXPECT(cudapool_malloc(16, 0, NULL) == NULL);
		EXPECT(err_has("cudapool_malloc: CUDAPOOL_CONF: unknown key \"bogus_key\"; the known keys are PyTorch's ") &&
		       err_has("max_split_size_mb") && err_has("cudapool's own ") && err_has("record_history"));
		void *p = cudapool_malloc(16, 0, NULL);
		EXPECT(p != NULL);
		cudapool_free(p, 16, 0, NULL);
		EXPECT(cudapool_configure("max_split_size_mb:64") == 0);
		EXPECT(cudapool_configure("max_split_size_mb:128,another_bogus:2") == -1 &&
		       err_has("cudapool_configure: unknown key \"another_bogus\"; the known keys are "));
		EXPECT(stat_of(0, "max_split_size") == (long long)(64 * MiB)); /* the configuration in force stays */
		EXPECT(cudapool_configure("Expandable_Segments:True") == -1 &&
		       err_has("unknown key \"Expandable_Segments\" (keys are case-sensitive: did you mean \"expandable_segments\"?)"));
		EXPECT(cudapool_configure_update("EXPANDABLE_SEGMENTS:True") == -1 && err_has("cudapool_configure_update: unknown key"));
		EXPECT(cudapool_configure("max_split_size_mb:64,pinned_use_cuda_host_register:True,pinned_num_register_threads:8,"
		                          "pinned_use_background_threads:True,pinned_reserve_segment_size_mb:64") == 0);
	} else if (strcmp(mode, "long-conf") == 0) {
		EXPECT(cudapool_malloc(16, 0, NULL) == NULL && err_has("... (120001 bytes)"));
		const char *e = cudapool_last_error();
		EXPECT(e != NULL && strlen(e) < 1000);
		EXPECT(cudapool_malloc(16, 0, NULL) != NULL);
	} else if (strcmp(mode, "names") == 0) {
		/* Each error names the public function called. */
		cudapool_free_deferred((void *)0x7f0000001000, 4096, 0, 0); /* queued, performed by the next call */
		cudapool_empty_cache();
		EXPECT(strncmp(cudapool_last_error(), "cudapool_empty_cache: ", 22) == 0 &&
		       err_has("0x7f0000001000 was not allocated by cudapool") && err_has("(a free queued by cudapool_free_deferred)"));
		/* A full queue is performed by the free that finds it full. */
		for (int i = 0; i <= 64; i++)
			cudapool_free_deferred((void *)0x7f0000002000, 4096, 0, 0);
		EXPECT(strncmp(cudapool_last_error(), "cudapool_free_deferred: ", 24) == 0 &&
		       err_has("(a free queued by cudapool_free_deferred)") && !err_has("torch"));
		for (int i = 0; i <= 64; i++)
			cudapool_cupy_free(NULL, (void *)0x7f0000003000, 0);
		EXPECT(strncmp(cudapool_last_error(), "cudapool_cupy_free: ", 20) == 0 &&
		       err_has("(a free queued by cudapool_free_deferred or cudapool_cupy_free)"));
		EXPECT(cudapool_malloc_ctx(16, 9, NULL, 0) == NULL && err_has("cudapool_malloc_ctx: device 9 does not exist"));
		EXPECT(cudapool_cupy_malloc(NULL, 16, 9) == NULL && err_has("cudapool_cupy_malloc: device 9 does not exist"));
		EXPECT(cudapool_malloc(16, 9, NULL) == NULL && err_has("cudapool_malloc: device 9 does not exist"));
		cudapool_end_allocate_to_pool(0, 0, 77);
		EXPECT(strncmp(cudapool_last_error(), "cudapool_end_allocate_to_pool: ", 31) == 0);
		cudapool_release_pool(0, 0, 77);
		EXPECT(strncmp(cudapool_last_error(), "cudapool_release_pool: ", 23) == 0);
		cudapool_device_stats st;
		EXPECT(cudapool_get_device_stats(9, &st) == -1 && err_has("cudapool_get_device_stats: device 9"));
		EXPECT(cudapool_pool_use_count(0, 0, 77) == -1 && err_has("cudapool_pool_use_count: "));
		EXPECT(cudapool_pool_set_source(0, 0, 77, NULL, NULL, NULL) == -1 &&
		       err_has("cudapool_pool_set_source: the alloc and free functions must not be NULL"));
		EXPECT(cudapool_checkpoint_pool(0, 0, 77) == 0 && err_has("cudapool_checkpoint_pool: "));
		EXPECT(cudapool_base_allocation(NULL, NULL) == NULL && err_has("cudapool_base_allocation: the pointer is NULL"));
		EXPECT(cudapool_configure(NULL) == -1 && err_has("cudapool_configure: the configuration string is NULL"));
		EXPECT(cudapool_ipc_close((void *)0x1000) == -1 && err_has("cudapool_ipc_close: "));
		cudapool_free((void *)0x1000, 16, 0, NULL);
		EXPECT(err_has("cudapool_free: "));
		/* Out of memory: PyTorch's words for the C++ class's malloc, cudapool's for C programs'. */
		EXPECT(cudapool_malloc_ctx(100 * GiB, 0, NULL, 0) == NULL &&
		       err_has("cudapool_malloc_ctx: CUDA out of memory. Tried to allocate 100.00 GiB") &&
		       err_has("PYTORCH_CUDA_ALLOC_CONF"));
		EXPECT(cudapool_cupy_malloc(NULL, 100 * GiB, 0) == NULL &&
		       err_has("cudapool_cupy_malloc: out of memory on device 0: cannot allocate 100.00 GiB") &&
		       !err_has("PYTORCH_CUDA_ALLOC_CONF"));
	} else if (strcmp(mode, "pytorch-conf") == 0) {
		EXPECT(stat_of(0, "max_split_size") == (long long)(100 * MiB));
	} else if (strcmp(mode, "cudapool-conf-wins") == 0) {
		EXPECT(stat_of(0, "max_split_size") == (long long)(300 * MiB));
	} else if (strcmp(mode, "no-driver") == 0) {
		EXPECT(cudapool_malloc(16, 0, NULL) == NULL);
		EXPECT(err_has("install the NVIDIA driver, or set CUDAPOOL_BACKEND=sim"));
		EXPECT(cudapool_sim_violations() == -1);
		EXPECT(cudapool_snapshot_json() == NULL);
	} else if (strcmp(mode, "bad-backend") == 0) {
		EXPECT(cudapool_malloc(16, 0, NULL) == NULL);
		EXPECT(err_has("CUDAPOOL_BACKEND=\"bogus\": expected cuda"));
		/* the version does not depend on a working backend */
		EXPECT(cudapool_version() != NULL && strcmp(cudapool_version(), CUDAPOOL_VERSION_STRING) == 0);
	} else if (strcmp(mode, "bad-sim-memory") == 0) {
		EXPECT(cudapool_malloc(16, 0, NULL) == NULL);
		EXPECT(err_has("CUDAPOOL_SIM_MEMORY=\"lots\""));
	} else if (strcmp(mode, "sim-memory") == 0) {
		EXPECT(cudapool_malloc(2 * GiB, 0, NULL) == NULL && err_has("free of 1024.00 MiB"));
		EXPECT(cudapool_malloc(512 * MiB, 0, NULL) != NULL);
		EXPECT(cudapool_malloc(16, 3, NULL) != NULL); /* CUDAPOOL_SIM_DEVICES=4 */
		EXPECT(cudapool_malloc(16, 4, NULL) == NULL);
	} else {
		printf("unknown child mode %s\n", mode);
		return 99;
	}
	return bad;
}

static void test_environment(const char *self) {
	printf("-- environment (child processes)\n");
	char err[8192];

	const char *bad_conf[] = {"CUDAPOOL_CONF=max_split_size_mb:1", NULL};
	CHECK(run_child(self, "bad-conf", bad_conf, err, sizeof err) == 0,
	      "an invalid CUDAPOOL_CONF fails the first call with its message; later calls run with the default configuration");
	CHECK(count_substr(err, "max_split_size_mb=1 is too small") == 1, "... printed once on stderr");
	CHECK(run_child(self, "bad-conf-init", bad_conf, err, sizeof err) == 0,
	      "... and every cudapool_init fails with it, also after other calls");
	CHECK(run_child(self, "bad-first-configure", bad_conf, err, sizeof err) == 0,
	      "... also when the first call is cudapool_configure");

	const char *unknown[] = {"CUDAPOOL_CONF=bogus_key:1", NULL};
	CHECK(run_child(self, "unknown-keys", unknown, err, sizeof err) == 0,
	      "an unknown or wrongly-cased configuration key is an error naming it and the known keys; "
	      "cudapool_configure leaves the configuration in force; PyTorch's pinned-memory keys are accepted");
	CHECK(count_substr(err, "cudapool: CUDAPOOL_CONF: unknown key \"bogus_key\"") == 1 &&
	          count_substr(err, "another_bogus") == 0,
	      "... the environment's is reported once on stderr, cudapool_configure's only to its caller");

	static char long_conf[200000];
	snprintf(long_conf, sizeof long_conf, "CUDAPOOL_CONF=max_split_size_mb:x");
	memset(long_conf + strlen(long_conf), 'y', 120000);
	const char *longc[] = {long_conf, NULL};
	CHECK(run_child(self, "long-conf", longc, err, sizeof err) == 0, "a 120 KB bad CUDAPOOL_CONF fails the first call with it cut");
	CHECK(count_substr(err, "max_split_size_mb=x") == 1 && count_substr(err, "... (120001 bytes)") == 1 && strlen(err) < 1000,
	      "... and is printed once on stderr, cut (%zu bytes)", strlen(err));

	const char *names[] = {"CUDAPOOL_SIM_DEVICES=1", NULL};
	CHECK(run_child(self, "names", names, err, sizeof err) == 0,
	      "errors name the public function called; out of memory in PyTorch's words for the C++ class, cudapool's for C");

	const char *pt[] = {"CUDAPOOL_CONF", "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:100", NULL};
	CHECK(run_child(self, "pytorch-conf", pt, err, sizeof err) == 0, "PYTORCH_CUDA_ALLOC_CONF is read");
	const char *both[] = {"CUDAPOOL_CONF=max_split_size_mb:300", "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:100", NULL};
	CHECK(run_child(self, "cudapool-conf-wins", both, err, sizeof err) == 0,
	      "CUDAPOOL_CONF wins over PYTORCH_CUDA_ALLOC_CONF");

	if (access("/dev/nvidia0", F_OK) != 0 && access("/dev/nvidiactl", F_OK) != 0) {
		const char *nodrv[] = {"CUDAPOOL_BACKEND", NULL};
		CHECK(run_child(self, "no-driver", nodrv, err, sizeof err) == 0,
		      "without a driver, the default backend fails every call with advice; sim controls fail");
		CHECK(count_substr(err, "CUDAPOOL_BACKEND=sim") == 1, "... the reason is printed once on stderr");
	} else {
		printf("skip  no-driver check: an NVIDIA device is present\n");
	}
	const char *bogus[] = {"CUDAPOOL_BACKEND=bogus", NULL};
	CHECK(run_child(self, "bad-backend", bogus, err, sizeof err) == 0, "an unknown CUDAPOOL_BACKEND fails clearly (the version is still answered)");
	const char *badmem[] = {"CUDAPOOL_SIM_MEMORY=lots", NULL};
	CHECK(run_child(self, "bad-sim-memory", badmem, err, sizeof err) == 0, "an invalid CUDAPOOL_SIM_MEMORY fails clearly");
	const char *mem[] = {"CUDAPOOL_SIM_MEMORY=1G", "CUDAPOOL_SIM_DEVICES=4", NULL};
	CHECK(run_child(self, "sim-memory", mem, err, sizeof err) == 0, "CUDAPOOL_SIM_MEMORY and CUDAPOOL_SIM_DEVICES are honoured");
}

int main(int argc, char **argv) {
	if (argc == 3 && strcmp(argv[1], "--child") == 0)
		return child_main(argv[2]);
	setvbuf(stdout, NULL, _IOLBF, 0);

	test_version();
	test_basics();
	test_bad_input();
	test_fraction_and_cache();
	test_streams();
	test_unannounced_capture();
	test_capture();
	test_expandable();
	test_threads();
	test_fork();
	test_environment(argv[0]);

	CHECK(cudapool_sim_violations() == 0, "no capture violations in the whole run");
	printf("C ABI: %d passed, %d failed\n", passed, failed);
	return failed == 0 ? 0 : 1;
}
