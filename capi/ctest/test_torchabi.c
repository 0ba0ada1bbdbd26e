// SPDX-License-Identifier: Apache-2.0
/*
 * test_torchabi.c - the C ABI that cudapool's C++ allocator class for
 * PyTorch uses (include/cudapool.h, "PyTorch's CUDAAllocator interface"), on
 * the simulated device: run with CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2
 * CUDAPOOL_SIM_MEMORY=8G (make test does). The last line is
 * "torch ABI: N passed, M failed"; the exit status is non-zero on failure.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudapool.h"
#include "cudapool_testing.h"

#include "check.h"

static cudapool_device_stats stats(int dev) {
	cudapool_device_stats s;
	memset(&s, 0xff, sizeof s);
	if (cudapool_get_device_stats(dev, &s) != 0)
		printf("      (stats of device %d failed)\n", dev);
	return s;
}

static void test_errors_and_stats(void) {
	printf("-- errors, statistics, cache info, fraction, settings\n");
	cudapool_clear_error();
	CHECK(cudapool_last_error() == NULL, "no error after cudapool_clear_error");
	CHECK(cudapool_malloc_ctx(64, 7, NULL, 0) == NULL && err_has("device 7"), "a bad device fails with a message");
	cudapool_clear_error();
	CHECK(cudapool_last_error() == NULL, "cudapool_clear_error clears it");

	cudapool_device_stats s0 = stats(1);
	void *p = cudapool_malloc_ctx(3000, 1, NULL, 0);
	cudapool_device_stats s1 = stats(1);
	CHECK(p != NULL && s1.allocation[0].current == s0.allocation[0].current + 1, "malloc_ctx counts an allocation");
	CHECK(s1.allocated_bytes[1].current == s0.allocated_bytes[1].current + 3072, "in the small pool, rounded to 3072");
	CHECK(s1.requested_bytes[0].current == s0.requested_bytes[0].current + 3000, "requested bytes are the request");
	char *js = cudapool_memory_stats_json(1);
	char want[64];
	snprintf(want, sizeof want, "\"allocation.all.current\":%lld", s1.allocation[0].current);
	CHECK(js && strstr(js, want), "the struct agrees with the JSON statistics");
	cudapool_string_free(js);
	CHECK(s1.max_split_size == -1, "max_split_size is -1 when unlimited");

	cudapool_free_deferred(p, 0, -1, 0); /* device and size unknown */
	s1 = stats(1);                       /* drains the queue first */
	CHECK(s1.allocation[0].current == s0.allocation[0].current, "a deferred free of unknown device is performed");
	CHECK(cudapool_free_ctx(p, 0, -1, 0) == -1 && err_has("not allocated"), "freeing it again fails at once");

	size_t largest = 0;
	CHECK(cudapool_cache_info(1, &largest) == 0 && largest >= 4 * GiB, "cache_info from 0 starts at the free memory");
	largest = 1;
	CHECK(cudapool_cache_info(1, &largest) == 0 && largest == 2 * MiB, "else it is the largest cached block (2 MiB)");

	CHECK(cudapool_get_memory_fraction(0) == 1.0, "the memory fraction is 1 when none is set");
	cudapool_set_memory_fraction(0.25, 0);
	CHECK(cudapool_get_memory_fraction(0) > 0.249 && cudapool_get_memory_fraction(0) <= 0.25, "then what was set");
	cudapool_set_memory_fraction(1.0, 0);
	CHECK(cudapool_get_memory_fraction(0) == 1.0, "1 removes the limit");

	CHECK(cudapool_configure_update("roundup_power2_divisions:4") == 0, "run-time settings apply");
	s0 = stats(0);
	void *q = cudapool_malloc_ctx(84 * MiB, 0, NULL, 0);
	s1 = stats(0);
	CHECK(s1.allocated_bytes[0].current - s0.allocated_bytes[0].current == (long long)(96 * MiB),
	      "roundup_power2_divisions:4 rounds 84 MiB to 96 MiB");
	cudapool_free(q, 84 * MiB, 0, NULL);
	CHECK(cudapool_configure_update("max_split_size_mb:200") == 0, "another update");
	s0 = stats(0);
	q = cudapool_malloc_ctx(84 * MiB, 0, NULL, 0);
	s1 = stats(0);
	CHECK(s1.allocated_bytes[0].current - s0.allocated_bytes[0].current == (long long)(84 * MiB),
	      "resets roundup_power2_divisions, as PyTorch's parser does (84 MiB stays 84 MiB)");
	CHECK(s1.max_split_size == (long long)(200 * MiB), "and applies max_split_size_mb");
	cudapool_free(q, 84 * MiB, 0, NULL);
	CHECK(cudapool_configure_update("max_split_size_mb:1") == -1 && err_has("max_split_size_mb"), "bad values fail");
	CHECK(cudapool_configure("") == 0, "configuration back to the defaults");
	cudapool_empty_cache();

	CHECK(cudapool_malloc_ctx(1ULL << 61, 0, NULL, 0) == NULL && err_has("Tried to allocate more than 1EB memory"),
	      "an absurd size gives PyTorch's message");
	cudapool_oom_info oi;
	CHECK(cudapool_last_oom(&oi) == -1, "and is not an out-of-memory failure for the observers");
	cudapool_set_memory_fraction(0.01, 1);
	CHECK(cudapool_malloc_ctx(1 * GiB, 1, NULL, 0) == NULL && err_has("CUDA out of memory. Tried to allocate 1024.00 MiB"),
	      "out of memory under a memory fraction");
	CHECK(cudapool_last_oom(&oi) == 0 && oi.device == 1 && oi.size == GiB && oi.device_total < GiB / 8,
	      "the observers' numbers: device, size, the fraction's limit");
	cudapool_set_memory_fraction(1.0, 1);
}

static void test_pools_and_checkpoints(void) {
	printf("-- memory pools and checkpoints\n");
	CHECK(cudapool_pool_use_count(0, 0, 7) == -1 && err_has("unknown memory pool"), "an unknown pool is an error");
	CHECK(cudapool_pool_create_or_incref(0, 0, 7) == 0 && cudapool_pool_use_count(0, 0, 7) == 1, "created");
	CHECK(cudapool_pool_create_or_incref(0, 0, 7) == 0 && cudapool_pool_use_count(0, 0, 7) == 2, "incref");
	cudapool_begin_allocate_to_pool(0, 0, 7, NULL, NULL);
	CHECK(cudapool_pool_use_count(0, 0, 7) == 3, "begin holds it too");
	cudapool_clear_error();
	cudapool_begin_allocate_to_pool(0, 0, 7, NULL, NULL);
	CHECK(err_has("already"), "a second begin of the pool is refused, as in PyTorch");
	void *a = cudapool_malloc_ctx(1 * MiB, 0, NULL, 0);
	void *b = cudapool_malloc_ctx(1 * MiB, 0, NULL, 0);
	void *c = cudapool_malloc_ctx(1 * MiB, 0, NULL, 0);
	unsigned long long cp = cudapool_checkpoint_pool(0, 0, 7);
	CHECK(cp != 0, "checkpoint of a pool with three blocks");
	void *abc[] = {a, b, c};
	CHECK(cudapool_pool_check_live(0, 0, 7, abc, 3) == 1, "live allocations: exactly a, b, c");
	CHECK(cudapool_pool_check_live(0, 0, 7, abc, 2) == 0, "a subset is not");
	cudapool_free(b, 1 * MiB, 0, NULL);
	void *d = cudapool_malloc_ctx(4 * MiB, 0, NULL, 0);
	cudapool_snapshot *s = cudapool_snapshot_take(1, 0, 7, 0);
	size_t nseg = s ? s->nsegments : 0;
	int pooled = s != NULL;
	for (size_t i = 0; s && i < s->nsegments; i++)
		pooled &= s->segments[i].pool_a == 0 && s->segments[i].pool_b == 7;
	CHECK(s && nseg >= 1 && pooled && s->ntraces == 0, "a pool's snapshot has only its segments (%zu), no traces", nseg);
	cudapool_snapshot_free(s);
	cudapool_end_allocate_to_pool(0, 0, 7);
	cudapool_release_pool(0, 0, 7);

	cudapool_restore_result r;
	CHECK(cudapool_checkpoint_restore(0, cp, &r) == 0, "restore");
	int freed_d = 0, has_b = 0;
	for (size_t i = 0; i < r.nfreed; i++)
		freed_d |= r.freed[i] == d;
	for (size_t i = 0; i < r.nallocated; i++)
		has_b |= r.allocated[i] == b;
	CHECK(r.nfreed == 3 && freed_d, "frees what was allocated (a, c, d)");
	CHECK(r.nallocated == 3 && has_b, "allocates the checkpoint's blocks (a, b, c)");
	cudapool_restore_result_free(&r);
	CHECK(cudapool_pool_check_live(0, 0, 7, abc, 3) == 1, "the pool holds a, b, c again");
	CHECK(cudapool_checkpoint_restore(0, cp + 1000, &r) == -1 && err_has("does not exist"), "an unknown checkpoint");
	cudapool_checkpoint_release(cp);
	for (int i = 0; i < 3; i++)
		cudapool_free(abc[i], 1 * MiB, 0, NULL);
	cudapool_pool_set_use_on_oom(0, 0, 7, 0); /* what ~MemPool does first */
	cudapool_release_pool(0, 0, 7);
	cudapool_release_pool(0, 0, 7);
	CHECK(cudapool_pool_use_count(0, 0, 7) == 0, "released by every holder");
	CHECK(cudapool_empty_pool(-1, 0, 7) == 0, "empty_cache of the pool");
	s = cudapool_snapshot_take(1, 0, 7, 0);
	CHECK(s && s->nsegments == 0, "gave its memory back");
	cudapool_snapshot_free(s);
}

static void test_history(void) {
	printf("-- memory history\n");
	CHECK(cudapool_gather_mask() == 0 && !cudapool_history_enabled(), "off at first");
	CHECK(cudapool_record_history(1, 1000, 3, 0, "") == 0, "on, contexts of everything (all)");
	CHECK(cudapool_gather_mask() == (CUDAPOOL_GATHER_ALLOC | CUDAPOOL_GATHER_FREE | CUDAPOOL_GATHER_RELEASE),
	      "the caller gathers contexts for malloc, free and empty_cache");
	cudapool_set_user_metadata("step 7");
	cudapool_push_compile_context("region A");
	void *p = cudapool_malloc_ctx(5000, 0, STREAM(3), 42);
	cudapool_free_deferred(p, 0, -1, 43);
	const char *keys[] = {"name"}, *vals[] = {"fwd"};
	CHECK(cudapool_record_annotation(0, keys, vals, 1) == 0, "an annotation");
	unsigned long long ids[16];
	size_t n = cudapool_live_contexts(ids, 16);
	int has42 = 0, has43 = 0;
	for (size_t i = 0; i < n && i < 16; i++) {
		has42 |= ids[i] == 42;
		has43 |= ids[i] == 43;
	}
	CHECK(has42 && has43, "the malloc's and the free's contexts are live (in the trace)");
	cudapool_snapshot *s = cudapool_snapshot_take(0, 0, 0, 1);
	int alloc42 = 0, free43 = 0, meta = 0, comp = 0;
	for (size_t i = 0; s && i < s->ntraces; i++) {
		cudapool_trace_entry *t = &s->traces[i];
		if (t->action == 0 && t->addr == (size_t)p && t->context == 42 && t->stream == 3 && t->size == 5000)
			alloc42 = 1;
		if (t->action == 1 && t->addr == (size_t)p && t->context == 43)
			free43 = 1;
		meta |= t->user_metadata && strcmp(t->user_metadata, "step 7") == 0;
		comp |= t->compile_context && strcmp(t->compile_context, "region A") == 0;
	}
	CHECK(alloc42, "the alloc entry has the malloc's context, stream and requested size");
	CHECK(free43, "the free_requested entry has the free's context");
	CHECK(meta && comp, "entries carry the user metadata and the compile context");
	CHECK(s && s->nannotations == 1 && s->annotations[0].n == 1 && strcmp(s->annotations[0].values[0], "fwd") == 0,
	      "the annotation");
	CHECK(s && s->config.nroundup == 16 && s->config.settings != NULL, "the settings");
	cudapool_snapshot_free(s);
	char *md = cudapool_get_user_metadata();
	CHECK(md && strcmp(md, "step 7") == 0, "user metadata reads back");
	cudapool_string_free(md);
	cudapool_pop_compile_context();
	cudapool_set_user_metadata("");
	CHECK(cudapool_record_history(1, 10, 1, 0, "bogus_action") == -1 && err_has("bogus_action"), "unknown skip actions fail");
	CHECK(cudapool_record_history(0, 0, 0, 0, NULL) == 0 && cudapool_gather_mask() == 0 && !cudapool_history_enabled(),
	      "off again");
	cudapool_empty_cache();
	CHECK(cudapool_live_contexts(ids, 16) == 0, "no context is live once the trace is gone");
}

static void test_caching_off(void) {
	printf("-- caching off\n");
	CHECK(cudapool_caching() == 1, "caching is on by default");
	cudapool_device_stats s0 = stats(0);
	CHECK(cudapool_set_caching(0) == 0 && cudapool_caching() == 0, "off");
	void *p = cudapool_malloc_ctx(1 * MiB, 0, NULL, 0);
	cudapool_device_stats s1 = stats(0);
	CHECK(p != NULL && s1.allocation[0].allocated == s0.allocation[0].allocated, "allocations are not counted");
	CHECK(s1.num_device_alloc == s0.num_device_alloc, "nor are they the cache's segments");
	cudapool_set_caching(1);
	CHECK(cudapool_free_ctx(p, 0, -1, 0) == 0, "freed straight to the driver, after caching is back on");
	CHECK(cudapool_free_ctx(p, 0, -1, 0) == -1, "once");
}

static void test_ipc(void) {
	printf("-- CUDA IPC\n");
	/* cuIpcGetMemHandle names cuMemAlloc'd segments: ordinary segments (the
	 * default maps pages of expandable segments). */
	CHECK(cudapool_configure("expandable_segments:False") == 0, "ordinary segments");
	void *a = cudapool_malloc_ctx(4096, 0, NULL, 0);
	void *b = cudapool_malloc_ctx(4096, 0, NULL, 0);
	unsigned char h[64];
	size_t off = 99;
	int dev = -1;
	CHECK(cudapool_ipc_handle(b, h, &off, &dev) == 0 && dev == 0 && off == (size_t)((char *)b - (char *)a),
	      "a block's handle and its offset in the segment");
	void *m = cudapool_ipc_open(0, h);
	CHECK(m != NULL && cudapool_ipc_open(0, h) == m, "opening a handle twice maps once");
	CHECK(cudapool_ipc_close(m) == 0 && cudapool_ipc_close(m) == 0, "closed twice");
	CHECK(cudapool_ipc_close(m) == -1, "a third close fails");
	CHECK(cudapool_ipc_handle((char *)b + 8, h, &off, &dev) == -1, "not the start of an allocation");
	cudapool_free(a, 4096, 0, NULL);
	cudapool_free(b, 4096, 0, NULL);
	cudapool_empty_cache();
	CHECK(cudapool_configure("") == 0, "back to the defaults");
}

/* PyTorch's handle format (cudapool_ipc_share, cudapool_ipc_open_shared),
 * for ordinary memory ('c', expandable_segments:False), expandable memory
 * without stitching ('e', the large pool's 20 MiB chunks) and with the
 * default, stitching ('e', 2 MiB pages).
 * The simulated process imports its own exports: pidfd_open of itself
 * works as across processes (the Go tests use two simulated processes). */
static void test_ipc_share(void) {
	printf("-- CUDA IPC in PyTorch's handle format\n");
	unsigned char buf[256], h64[64];
	size_t len = 0, off = 99, off64 = 0;
	int dev = -1, dev64 = -1;
	CHECK(cudapool_configure("expandable_segments:False") == 0, "ordinary segments");
	void *a = cudapool_malloc_ctx(4096, 0, NULL, 0);
	CHECK(cudapool_ipc_share(a, buf, sizeof buf, &len, &off, &dev) == 0 && len == 66 && buf[0] == 2 && buf[1] == 'c' &&
	          dev == 0,
	      "ordinary memory: version 2, type 'c', 66 bytes");
	CHECK(cudapool_ipc_handle(a, h64, &off64, &dev64) == 0 && memcmp(buf + 2, h64, 64) == 0 && off == off64,
	      "carrying the segment's cudaIpcMemHandle_t and offset");
	void *m = cudapool_ipc_open_shared(0, buf, len);
	CHECK(m != NULL && cudapool_ipc_open(0, h64) == m, "opened through either entry point: one mapping");
	CHECK(cudapool_ipc_close(m) == 0 && cudapool_ipc_close(m) == 0 && cudapool_ipc_close(m) == -1, "closed as often as opened");
	cudapool_free(a, 4096, 0, NULL);

	CHECK(cudapool_configure_update("expandable_segments:True,stitch:False") == 0, "expandable segments on, no stitching");
	void *e = cudapool_malloc_ctx(5 * MiB, 0, NULL, 0);
	CHECK(cudapool_ipc_handle(e, h64, &off64, &dev64) == -1 && err_has("share it with cudapool_ipc_share"),
	      "the 64-byte handle cannot name expandable memory, and says what can");
	len = 0;
	CHECK(cudapool_ipc_share(e, NULL, 0, &len, &off, &dev) == -1 && len == 2 + 24 + 4 &&
	          err_has("cudapool_ipc_share: ") && err_has("call again with a buffer of *len bytes"),
	      "too small a buffer: -1, and *len says how long the handle is (%zu)", len);
	CHECK(cudapool_ipc_share(e, buf, len, &len, &off, &dev) == 0 && buf[1] == 'e' && dev == 0,
	      "expandable memory: type 'e', one descriptor");
	unsigned char again[64];
	size_t len2 = 0;
	CHECK(cudapool_ipc_share(e, again, sizeof again, &len2, &off64, &dev64) == 0 && len2 == len && memcmp(buf, again, len) == 0,
	      "the same bytes every time");
	unsigned char data[4096], got[4096];
	for (size_t i = 0; i < sizeof data; i++)
		data[i] = (unsigned char)(i * 13 + 1);
	CHECK(cudapool_sim_write(0, e, data, sizeof data) == 0, "the exporter writes");
	m = cudapool_ipc_open_shared(0, buf, len);
	CHECK(m != NULL && cudapool_sim_read(0, (char *)m + off, got, sizeof got) == 0 && memcmp(data, got, sizeof data) == 0,
	      "the import shows the exporter's bytes at its address plus the offset");
	CHECK(m != (void *)e, "at an address of its own");
	CHECK(cudapool_ipc_open_shared(0, buf, len) == m, "a second open maps once");
	CHECK(cudapool_ipc_close(m) == 0 && cudapool_ipc_close(m) == 0, "closed twice");
	CHECK(cudapool_ipc_close(m) == -1 && err_has("cudapool_ipc_close: "), "a third close fails");

	CHECK(cudapool_sim_set_pidfd_errors(0, EPERM) == 0, "pidfd_getfd forbidden (ptrace rules)");
	CHECK(cudapool_ipc_open_shared(0, buf, len) == NULL && err_has("cudapool_ipc_open_shared: ") &&
	          err_has("ptrace permission to process") && err_has("kernel.yama.ptrace_scope"),
	      "the error says what permission is missing");
	CHECK(cudapool_sim_set_pidfd_errors(ENOSYS, 0) == 0, "a kernel without pidfd_open");
	CHECK(cudapool_ipc_open_shared(0, buf, len) == NULL && err_has("the kernel lacks pidfd_open (Linux 5.3+)"),
	      "the error says what the kernel lacks");
	cudapool_sim_set_pidfd_errors(0, 0);
	CHECK(cudapool_ipc_open_shared(0, "\x03" "e", 2) == NULL && err_has("version 3"), "a newer PyTorch's handle is refused");
	CHECK(cudapool_ipc_open_shared(0, NULL, 5) == NULL && err_has("the handle is NULL"), "a NULL handle is refused");
	CHECK(cudapool_ipc_open_shared(0, buf, 3) == NULL && err_has("not a readable CUDA IPC handle"), "a cut handle is refused");
	CHECK(cudapool_ipc_share(e, buf, sizeof buf, NULL, &off, &dev) == -1 && err_has("an output pointer is NULL"),
	      "a NULL output is refused");
	CHECK(cudapool_ipc_share((char *)e + 8, buf, sizeof buf, &len, &off, &dev) == -1 && err_has("not at its start"),
	      "not the start of an allocation");
	cudapool_free(e, 5 * MiB, 0, NULL);
	cudapool_empty_cache(); /* the chunked range goes */

	/* The default, stitching, maps 2 MiB pages, one descriptor each. */
	CHECK(cudapool_configure("") == 0, "the defaults: expandable segments with stitching");
	void *d = cudapool_malloc_ctx(5 * MiB, 0, NULL, 0);
	CHECK(cudapool_sim_write(0, d, data, sizeof data) == 0, "the exporter writes");
	CHECK(cudapool_ipc_share(d, buf, sizeof buf, &len, &off, &dev) == 0 && buf[1] == 'e' && len == 2 + 24 + 3 * 4,
	      "with stitching: type 'e', a descriptor for each of the three pages under 5 MiB (%zu bytes)", len);
	m = cudapool_ipc_open_shared(0, buf, len);
	CHECK(m != NULL && cudapool_sim_read(0, (char *)m + off, got, sizeof got) == 0 && memcmp(data, got, sizeof data) == 0,
	      "the import shows the exporter's bytes");
	CHECK(cudapool_ipc_close(m) == 0, "closed");
	cudapool_free(d, 5 * MiB, 0, NULL);
	cudapool_empty_cache();
	CHECK(cudapool_configure("") == 0, "back to the defaults");
}

int main(void) {
	test_errors_and_stats();
	test_pools_and_checkpoints();
	test_history();
	test_ipc();
	test_ipc_share();
	test_caching_off();
	CHECK(cudapool_sim_violations() == 0, "no call broke the capture rules");
	printf("torch ABI: %d passed, %d failed\n", passed, failed);
	return failed != 0;
}
