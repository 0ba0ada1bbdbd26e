// SPDX-License-Identifier: Apache-2.0
/*
 * test_tags.c - tags, pause and resume through the C ABI (include/cudapool.h,
 * "Pause and resume by tag"), on the simulated device: run with
 * CUDAPOOL_BACKEND=sim, two devices and no CUDAPOOL_CONF /
 * PYTORCH_CUDA_ALLOC_CONF (make test does). The contents a pause keeps are
 * checked by the Go tests (allocator/pause_test.go), which can read the
 * simulated memory.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cudapool.h"
#include "cudapool_testing.h"

#include "check.h"

/* Whether the snapshot's segment holding p says "tag":tag (tag NULL: has
 * no tag). Segments are printed in address order, one object each. */
static int segment_tag_is(void *p, const char *tag) {
	char *js = cudapool_snapshot_json();
	char addr[64];
	snprintf(addr, sizeof addr, "{\"address\":%llu,", (unsigned long long)(uintptr_t)p);
	int ok = 0;
	const char *b = js ? strstr(js, addr) : NULL;
	if (b != NULL) {
		/* the segment's object: up to its block list's end */
		const char *seg = b, *start = b;
		while (seg > js && strncmp(seg, "{\"device\"", 9) != 0)
			seg--;
		start = seg;
		const char *tagp = strstr(start, "\"tag\":\"");
		const char *next = strstr(start + 1, "{\"device\"");
		if (next == NULL)
			next = strstr(start, "\"device_traces\"");
		int has = tagp != NULL && (next == NULL || tagp < next);
		if (tag == NULL)
			ok = !has;
		else if (has)
			ok = strncmp(tagp + 7, tag, strlen(tag)) == 0 && tagp[7 + strlen(tag)] == '"';
	}
	cudapool_string_free(js);
	return ok;
}

static void test_stack(void) {
	printf("-- the tag stack\n");
	cudapool_clear_error();
	CHECK(cudapool_tag_pop() == -1 && err_has("cudapool_tag_pop: no tag is pushed on this thread"), "pop of an empty stack fails");
	CHECK(cudapool_tag_push(NULL) == -1 && err_has("cudapool_tag_push: the tag is NULL"), "a NULL tag is refused");
	CHECK(cudapool_tag_push("") == -1 && err_has("cudapool_tag_push: the tag is empty"), "an empty tag is refused");
	char big[300];
	memset(big, 'x', sizeof big - 1);
	big[sizeof big - 1] = 0;
	CHECK(cudapool_tag_push(big) == -1 && err_has("at most 256"), "a tag over 256 bytes is refused");

	void *plain = cudapool_malloc(4096, 0, NULL);
	CHECK(cudapool_tag_push("outer") == 0, "push outer");
	void *o = cudapool_malloc(8 * MiB, 0, NULL);
	CHECK(cudapool_tag_push("inner") == 0, "push inner");
	void *i = cudapool_malloc(8 * MiB, 0, NULL);
	CHECK(cudapool_tag_pop() == 0, "pop inner");
	void *o2 = cudapool_malloc(8 * MiB, 0, NULL);
	CHECK(cudapool_tag_pop() == 0, "pop outer");
	void *plain2 = cudapool_malloc(8 * MiB, 0, NULL);
	CHECK(segment_tag_is(o, "outer") && segment_tag_is(o2, "outer"), "allocations under outer are outer's");
	CHECK(segment_tag_is(i, "inner"), "the innermost tag wins");
	CHECK(segment_tag_is(plain, NULL) && segment_tag_is(plain2, NULL), "untagged allocations have no tag");
	void *ps[] = {plain, o, i, o2, plain2};
	for (size_t k = 0; k < 5; k++)
		cudapool_free(ps[k], 0, 0, NULL);

	/* 1024 deep, then refused */
	int pushed = 0;
	while (pushed < 1100 && cudapool_tag_push("deep") == 0)
		pushed++;
	CHECK(pushed == 1024 && err_has("1024 tags are pushed"), "the stack holds 1024 tags (%d)", pushed);
	while (cudapool_tag_pop() == 0)
		pushed--;
	CHECK(pushed == 0, "and pops them all");
}

static void *other_thread(void *arg) {
	(void)arg;
	/* This thread pushed nothing: its allocations have no tag. */
	void *p = cudapool_malloc(8 * MiB, 0, NULL);
	int ok = segment_tag_is(p, NULL);
	cudapool_free(p, 0, 0, NULL);
	/* Its own tag, not popped: freed with the thread. */
	cudapool_tag_push("thread");
	void *q = cudapool_malloc(8 * MiB, 0, NULL);
	ok = ok && segment_tag_is(q, "thread");
	cudapool_free(q, 0, 0, NULL);
	return ok ? (void *)1 : NULL;
}

static void test_threads(void) {
	printf("-- a tag is the calling thread's\n");
	CHECK(cudapool_tag_push("main") == 0, "push on the main thread");
	pthread_t th;
	void *ok = NULL;
	pthread_create(&th, NULL, other_thread, NULL);
	pthread_join(th, &ok);
	CHECK(ok != NULL, "another thread allocates under its own tags only");
	void *p = cudapool_malloc(8 * MiB, 0, NULL);
	CHECK(segment_tag_is(p, "main"), "the main thread's tag is untouched");
	cudapool_free(p, 0, 0, NULL);
	CHECK(cudapool_tag_pop() == 0, "pop");
}

static void test_pause_resume(void) {
	printf("-- pause and resume\n");
	CHECK(cudapool_tag_push("kv") == 0, "push kv");
	void *a = cudapool_malloc(64 * MiB, 0, NULL);
	void *b = cudapool_malloc(64 * MiB, 1, NULL);
	void *s = cudapool_cupy_malloc(NULL, 4000, 0); /* CuPy's entry point: the same tag */
	CHECK(a && b && s, "tagged allocations on both devices");
	CHECK(segment_tag_is(s, "kv"), "CuPy's malloc carries the thread's tag");
	CHECK(cudapool_tag_pop() == 0, "pop");
	CHECK(cudapool_paused_bytes(0) == 0 && cudapool_paused_bytes(1) == 0, "nothing paused yet");

	CHECK(cudapool_pause("kv", 1) == 0, "pause kv, keeping its contents");
	CHECK(cudapool_paused_bytes(0) >= (long long)(64 * MiB) && cudapool_paused_bytes(1) >= (long long)(64 * MiB),
	      "paused bytes on both devices (%lld, %lld)", cudapool_paused_bytes(0), cudapool_paused_bytes(1));
	CHECK(snapshot_count("\"paused\":true") >= 2, "the snapshot marks paused segments");
	CHECK(cudapool_pause("kv", 0) == 0, "a second pause does nothing");
	cudapool_tag_push("kv");
	cudapool_clear_error();
	void *x = cudapool_malloc(4096, 0, NULL);
	CHECK(x == NULL && err_has("cudapool_malloc: tag \"kv\" is paused"), "a malloc from a paused tag fails, clearly");
	cudapool_tag_pop();
	cudapool_clear_error();
	cudapool_cupy_free(NULL, s, 0); /* freeing is allowed (queued, performed by the next call) */
	CHECK(cudapool_resume("kv") == 0, "resume kv");
	CHECK(cudapool_last_error() == NULL, "the queued free of the paused block succeeded");
	CHECK(cudapool_paused_bytes(0) == 0 && cudapool_paused_bytes(1) == 0, "nothing paused after resume");
	CHECK(cudapool_resume("kv") == 0, "resume of a tag not paused does nothing");
	cudapool_tag_push("kv");
	void *y = cudapool_malloc(4096, 0, NULL);
	cudapool_tag_pop();
	CHECK(y != NULL, "the tag allocates again");

	CHECK(cudapool_pause(NULL, 0) == 0 && cudapool_paused_bytes(0) > 0, "pause every tag");
	CHECK(cudapool_resume(NULL) == 0 && cudapool_paused_bytes(0) == 0, "resume every tag");
	CHECK(cudapool_release_host_memory() == 0, "release the pinned memory");

	CHECK(cudapool_pause("", 1) == -1 && err_has("cudapool_pause: the tag is empty"), "an empty tag is refused");
	CHECK(cudapool_pause("never", 1) == -1 && err_has("cudapool_pause: no tag is named \"never\""), "an unknown tag is refused");
	CHECK(cudapool_resume("never") == -1 && err_has("cudapool_resume: no tag is named"), "resume too");
	CHECK(cudapool_paused_bytes(7) == -1 && err_has("device 7 does not exist"), "paused bytes of a device that does not exist");
	void *ps[] = {a, b, y};
	for (size_t k = 0; k < 3; k++)
		cudapool_free(ps[k], 0, -1, NULL);
}

/* A tag's allocation shared with another process (PyTorch's handle format:
 * a tag's memory is expandable memory whatever the configuration) keeps the
 * tag from pausing until it is freed; a paused tag's allocation cannot be
 * shared. */
static void test_shared(void) {
	printf("-- pause and CUDA IPC\n");
	unsigned char buf[256];
	size_t len = 0, off = 0;
	int dev = -1;
	CHECK(cudapool_tag_push("ipc") == 0, "push ipc");
	void *a = cudapool_malloc(4 * MiB, 0, NULL);
	void *b = cudapool_malloc(4 * MiB, 0, NULL);
	CHECK(cudapool_tag_pop() == 0 && a && b, "two tagged allocations");
	CHECK(cudapool_ipc_share(a, buf, sizeof buf, &len, &off, &dev) == 0 && buf[1] == 'e', "a tag's memory is shared as expandable memory");
	CHECK(cudapool_pause("ipc", 0) == -1 && err_has("cudapool_pause: tag \"ipc\": the block at") &&
	          err_has("shared with another process"),
	      "the pause is refused, and says which block");
	CHECK(cudapool_paused_bytes(0) == 0, "nothing paused");
	cudapool_free(a, 0, -1, NULL);
	CHECK(cudapool_pause("ipc", 0) == 0 && cudapool_paused_bytes(0) > 0, "freed, the tag pauses");
	CHECK(cudapool_ipc_share(b, buf, sizeof buf, &len, &off, &dev) == -1 && err_has("cudapool_ipc_share: ") &&
	          err_has("which is paused or being paused"),
	      "a paused tag's allocation cannot be shared");
	CHECK(cudapool_resume("ipc") == 0, "resume");
	CHECK(cudapool_ipc_share(b, buf, sizeof buf, &len, &off, &dev) == 0, "resumed memory is shared again");
	cudapool_free(b, 0, -1, NULL);
}

static void test_capture(void) {
	printf("-- a capture begun under a tag\n");
	cudapool_stream cs = STREAM(0x7100);
	CHECK(cudapool_tag_push("graph") == 0, "push graph");
	cudapool_begin_allocate_to_pool(0, 5, 0, cudapool_filter_stream_is, (void *)cs);
	CHECK(cudapool_tag_pop() == 0, "pop before capturing: the pool keeps the tag");
	CHECK(cudapool_sim_begin_capture(cs, 0) == 0, "begin capturing");
	void *p = cudapool_malloc(30 * MiB, 0, cs);
	CHECK(p != NULL && segment_tag_is(p, "graph"), "the capture's memory is the tag's");
	CHECK(cudapool_pause("graph", 0) == -1 && err_has("capture"), "no pause during the capture");
	CHECK(cudapool_sim_end_capture(cs) == 0, "end capturing");
	cudapool_end_allocate_to_pool(0, 5, 0);
	CHECK(cudapool_pause("graph", 0) == 0 && cudapool_paused_bytes(0) >= (long long)(30 * MiB), "the graph's pool is paused");
	cudapool_clear_error();
	cudapool_begin_allocate_to_pool(0, 5, 0, cudapool_filter_stream_is, (void *)cs);
	CHECK(err_has("which is paused"), "no capture into a paused tag's pool");
	CHECK(cudapool_resume("graph") == 0, "resume");
	cudapool_free(p, 0, 0, NULL);
	cudapool_release_pool(0, 5, 0);
}

/* A filter that tries to push a tag: refused (filters run under the
 * allocator's lock). */
static int pushed_in_filter = 99;
static int pushing_filter(void *ctx, cudapool_stream s) {
	(void)ctx;
	(void)s;
	pushed_in_filter = cudapool_tag_push("x");
	return 1;
}

static void test_front(void) {
	printf("-- tagged blocks skip the front cache\n");
	cudapool_expect_announced_captures();
	cudapool_front_counters c0, c1, c2;
	cudapool_get_front_counters(0, &c0);
	for (int k = 0; k < 50; k++)
		cudapool_free(cudapool_malloc(4096, 0, NULL), 4096, 0, NULL);
	cudapool_get_front_counters(0, &c1);
	cudapool_tag_push("front");
	for (int k = 0; k < 50; k++)
		cudapool_free(cudapool_malloc(4096, 0, NULL), 4096, 0, NULL);
	cudapool_tag_pop();
	cudapool_get_front_counters(0, &c2);
	CHECK(c1.hits > c0.hits, "untagged mallocs are served in front (%llu)", c1.hits - c0.hits);
	CHECK(c2.hits == c1.hits, "tagged ones are not (%llu)", c2.hits - c1.hits);

	cudapool_begin_allocate_to_pool(0, 6, 0, pushing_filter, NULL);
	void *p = cudapool_malloc(4096, 0, STREAM(0x7200));
	CHECK(pushed_in_filter == -1, "a filter cannot push a tag");
	cudapool_end_allocate_to_pool(0, 6, 0);
	cudapool_free(p, 0, 0, NULL);
	cudapool_release_pool(0, 6, 0);
}

int main(void) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	test_stack();
	test_threads();
	test_pause_resume();
	test_shared();
	test_capture();
	test_front();
	CHECK(cudapool_sim_violations() == 0, "no capture violations in the whole run");
	printf("C tags ABI: %d passed, %d failed\n", passed, failed);
	return failed == 0 ? 0 : 1;
}
