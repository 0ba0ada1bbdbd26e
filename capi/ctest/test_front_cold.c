// SPDX-License-Identifier: Apache-2.0
/*
 * test_front_cold.c - the front cache's cold mode (capi/front.c), tested on
 * front.c alone: it is compiled into this program, with no library and no
 * Go, and driven the way capi's shells and Go drive it (track after a malloc
 * through Go, free, malloc, take). What it checks:
 *   - a device whose blocks are freed for real and never reused stops being
 *     tracked for COLD_SKIP blocks after a window of COLD_WINDOW;
 *   - each further cold verdict in a row doubles the skip, up to
 *     COLD_SKIP << COLD_MAX_SHIFT;
 *   - a window with reuse resets the skip to COLD_SKIP;
 *   - another device is not affected;
 *   - allocate-to-pool phases beginning end a cold stretch;
 *   - during phases a malloc is served only from the pool Go routed the
 *     thread's stream to in the same generation (the route of cp_track),
 *     on that thread only;
 *   - a malloc's take (keep) holds blocks Go marked CP_TAG_HOLD, up to the
 *     policy's hold, which the front serves later; a take without keep
 *     releases them;
 *   - a free that must reach Go now (CP_FREE_NOW) is not logged, and
 *     cp_front_invalidate forgets a live block but not a waiting one;
 *   - the counters of cudapool_get_front_counters.
 * The policy is what Go pushes (allocator/front.go's numbers).
 */
#include <pthread.h>
#include <stdio.h>

#include "front.c"

/* The policy, as Go pushes it. */
enum { COLD_WINDOW = 256, COLD_SKIP = 4096, COLD_MAX_SHIFT = 6, HOLD = CP_FRONT_HOLD };
static cp_front_policy policy = {
    .on = 1, .hold = HOLD, .cold_window = COLD_WINDOW, .cold_skip = COLD_SKIP, .cold_max_shift = COLD_MAX_SHIFT};

/* Go's answers: a block of the default pools (held if hold), of pool tag,
 * and a route. */
static cp_track dflt(int hold) { return (cp_track){.tag = 1 | (hold ? CP_TAG_HOLD : 0)}; }
static cp_track pooltag(uint32_t tag, int hold) { return (cp_track){.tag = tag | (hold ? CP_TAG_HOLD : 0)}; }

static int passed, failed;

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		int ok_ = !!(cond);                                                                \
		printf(ok_ ? "ok    " : "FAIL  ");                                                 \
		printf(__VA_ARGS__);                                                               \
		printf(ok_ ? "\n" : "\n      %s:%d: %s\n", __FILE__, __LINE__, #cond);               \
		if (ok_)                                                                           \
			passed++;                                                                  \
		else                                                                               \
			failed++;                                                                  \
	} while (0)

static uintptr_t next_ptr = 0x10000000;

/* One block that Go hands out and the program frees for good: returns
 * whether the front tracked it (its free was logged in front). Go takes the
 * log at its next operation on the device, as a malloc through Go does. */
static int wasted_block(int dev) {
	uintptr_t p = next_ptr += 4096;
	cp_front_track(p, 4096, 0, dev, dflt(1));
	int logged = cp_front_free(p, 4096, dev, 0) == 1;
	cp_front_take(dev, 0);
	return logged;
}

/* A block freed and reused at once (a hit), then freed for real. */
static int reused_block(int dev) {
	uintptr_t p = next_ptr += 4096;
	cp_front_track(p, 512, 7, dev, dflt(1));
	if (cp_front_free(p, 512, dev, 0) != 1)
		return 0;
	int hit = (uintptr_t)cp_front_malloc(512, dev, 7) == p;
	cp_front_free(p, 512, dev, 0);
	cp_front_take(dev, 0);
	return hit;
}

/* Runs wasted blocks until a cold stretch has begun and ended; returns its
 * length (blocks left untracked), or -1 if none began within limit. */
static long cold_stretch(int dev, long limit) {
	long i = 0;
	while (i < limit && wasted_block(dev))
		i++;
	if (i == limit)
		return -1;
	long skipped = 1; /* the block that found the device cold */
	while (skipped < limit && !wasted_block(dev))
		skipped++;
	return skipped;
}

/* Another thread's malloc (the routes Go returns are per thread). */
struct other_malloc {
	size_t size;
	int dev;
	uintptr_t stream;
	void *got;
};

static void *other_malloc_run(void *arg) {
	struct other_malloc *m = arg;
	m->got = cp_front_malloc(m->size, m->dev, m->stream);
	return NULL;
}

static void *malloc_on_other_thread(size_t size, int dev, uintptr_t stream) {
	struct other_malloc m = {size, dev, stream, NULL};
	pthread_t t;
	if (pthread_create(&t, NULL, other_malloc_run, &m) != 0)
		return (void *)1;
	pthread_join(t, NULL);
	return m.got;
}

int main(void) {
	CHECK(cp_front_malloc(512, 0, 0) == NULL, "no policy yet: the front is off");
	cp_front_set_policy(&policy);

	/* A first window: tracked until COLD_WINDOW blocks were freed for real. */
	long tracked_first = 0;
	while (tracked_first < 10 * COLD_WINDOW && wasted_block(0))
		tracked_first++;
	CHECK(tracked_first == COLD_WINDOW, "the first %d wasted blocks are tracked (got %ld)", COLD_WINDOW, tracked_first);
	long skipped = 1;
	while (skipped < 10L * COLD_SKIP && !wasted_block(0))
		skipped++;
	CHECK(skipped == COLD_SKIP, "then %d blocks are not tracked (got %ld)", COLD_SKIP, skipped);
	long untracked0 = skipped; /* device 0's blocks left untracked, for the counters */

	/* Cold verdicts in a row: the skip doubles, then stays at its cap. The
	 * block that ends a stretch is tracked and opens the next window. */
	long want = COLD_SKIP;
	for (int k = 1; k <= COLD_MAX_SHIFT + 2; k++) {
		if (want < ((long)COLD_SKIP << COLD_MAX_SHIFT))
			want *= 2;
		long got = cold_stretch(0, 4L * (COLD_SKIP << COLD_MAX_SHIFT));
		untracked0 += got;
		CHECK(got == want, "cold verdict %d in a row: %ld blocks untracked (got %ld)", k + 1, want, got);
	}

	/* Device 1 was never cold. */
	CHECK(wasted_block(1), "another device still tracks its blocks");

	/* A window with reuse resets the skip: reuse until a window closes
	 * warm (the first reused block ends the current cold stretch). */
	long n = 0;
	while (!reused_block(0) && n < 4L * (COLD_SKIP << COLD_MAX_SHIFT))
		n++;
	untracked0 += n;
	int hits = 1;
	for (int i = 0; i < 2 * COLD_WINDOW; i++)
		hits += reused_block(0);
	CHECK(hits == 2 * COLD_WINDOW + 1, "reused blocks are served by the front (%d of %d)", hits, 2 * COLD_WINDOW + 1);
	long got = cold_stretch(0, 4L * (COLD_SKIP << COLD_MAX_SHIFT));
	untracked0 += got;
	CHECK(got == COLD_SKIP, "after a window with reuse, the next cold stretch is %d blocks again (got %ld)", COLD_SKIP,
	      got);

	/* Phases beginning (a capture) end a cold stretch: a new pattern. */
	while (wasted_block(2))
		;
	CHECK(!wasted_block(2), "device 2 is cold");
	policy.phases[2] = 11;
	cp_front_set_policy(&policy);
	CHECK(wasted_block(2), "phases began: device 2 tracks its blocks again");
	unsigned long long c2[4];
	CHECK(cp_front_counters(2, c2) == 0 && c2[2] == 2 && c2[3] == 1,
	      "device 2: 2 blocks left untracked (got %llu), the rest of its stretch cancelled; 1 verdict (got %llu)", c2[2],
	      c2[3]);

	/* Routes. A pool block of device 2 waits; no route: a miss. */
	uintptr_t rp = next_ptr += 4096;
	cp_front_track(rp, 4096, 9, 2, pooltag(7, 1));
	CHECK(cp_front_free(rp, 4096, 2, 0) == 1, "a pool block's free is logged");
	CHECK(cp_front_malloc(4096, 2, 9) == NULL, "during phases, no route from Go: a miss");
	/* Go routed this thread's stream 9 to pool 7 in generation 11 (a malloc
	 * through Go that returned no block to track). */
	cp_front_track(0, 0, 9, 2, (cp_track){.route = 7, .phases = 11});
	CHECK(cp_front_malloc(4096, 2, 8) == NULL, "another stream has no route");
	CHECK(malloc_on_other_thread(4096, 2, 9) == NULL, "another thread has no route");
	CHECK((uintptr_t)cp_front_malloc(4096, 2, 9) == rp, "the routed thread and stream are served the pool's block");
	cp_front_free(rp, 4096, 2, 0);
	cp_front_track(0, 0, 9, 2, (cp_track){.route = 8, .phases = 11});
	CHECK(cp_front_malloc(4096, 2, 9) == NULL, "routed to another pool: not served the block");
	cp_front_track(0, 0, 9, 2, (cp_track){.route = 7, .phases = 11});
	policy.phases[2] = 12;
	cp_front_set_policy(&policy);
	CHECK(cp_front_malloc(4096, 2, 9) == NULL, "a new generation: the route is stale");
	cp_front_track(0, 0, 9, 2, (cp_track){.route = 7, .phases = 12});
	CHECK((uintptr_t)cp_front_malloc(4096, 2, 9) == rp, "routed again in the new generation: served");
	cp_front_free(rp, 4096, 2, 0);
	policy.phases[2] = 0;
	cp_front_set_policy(&policy);
	CHECK(cp_front_malloc(4096, 2, 9) == NULL, "the phases end: a default request is not served the pool's block");
	cp_front_take(2, 0);

	/* Frees that must reach Go, and invalidations. */
	uintptr_t fp = next_ptr += 4096;
	cp_front_track(fp, 4096, 9, 2, dflt(1));
	CHECK(cp_front_free(fp, 4096, 2, CP_FREE_NOW) == 0, "a free that must reach Go now is not logged");
	CHECK(cp_front_free(fp, 4096, 2, 0) == 0, "and the block is forgotten");
	cp_front_track(fp, 4096, 9, 2, dflt(1));
	cp_front_invalidate(fp);
	CHECK(cp_front_free(fp, 4096, 2, 0) == 0, "an invalidated block is forgotten");
	cp_front_track(fp, 4096, 9, 2, dflt(1));
	CHECK(cp_front_free(fp, 4096, -1, CP_FREE_ANY_DEV) == 1, "an unknown device may be the block's");
	cp_front_invalidate(fp);
	CHECK(cp_front_free(fp, 4096, 2, 0) == CP_FRONT_TWICE, "a waiting block is not forgotten: a second free is one");
	cp_front_take(2, 0);

	/* Held blocks (device 3). */
	uintptr_t h = next_ptr += 4096;
	cp_front_track(h, 4096, 5, 3, dflt(1));
	CHECK(cp_front_free(h, 4096, 3, 0) == 1, "a tracked block's free is logged");
	CHECK(cp_front_take(3, 1) == 1 && cp_front_out[3][0].op == CP_OP_HOLD && cp_front_held[3] == 1,
	      "a take with keep: the block is held");
	CHECK(cp_front_free(h, 4096, 3, 0) == CP_FRONT_TWICE, "a held block freed again is a double free");
	CHECK((uintptr_t)cp_front_malloc(4096, 3, 5) == h && cp_front_held[3] == 0, "the front serves the held block");
	CHECK(cp_front_take(3, 1) == 1 && cp_front_out[3][0].op == CP_OP_REUSE, "its reuse is logged");
	cp_front_free(h, 4096, 3, 0);
	cp_front_take(3, 1);
	CHECK(cp_front_held[3] == 1, "held again");
	CHECK(cp_front_take(3, 0) == 1 && cp_front_out[3][0].op == CP_OP_RELEASE && cp_front_out[3][0].ptr == h &&
	          cp_front_held[3] == 0,
	      "a take without keep releases it");
	CHECK(cp_front_malloc(4096, 3, 5) == NULL, "and the front no longer has it");
	/* Two takes, the second over the limit (a log holds CP_FRONT_LOG frees). */
	size_t nt = 0;
	int frees = 0;
	for (int batch = 0; batch < 2; batch++) {
		int nb = batch == 0 ? HOLD - 4 : 9;
		for (int i = 0; i < nb; i++) {
			uintptr_t q = next_ptr += 4096;
			cp_front_track(q, 8192, 5, 3, dflt(1));
			cp_front_free(q, 8192, 3, 0);
		}
		nt = cp_front_take(3, 1);
	}
	for (size_t i = 0; i < nt; i++)
		frees += cp_front_out[3][i].op == CP_OP_FREE;
	CHECK(nt == 9 && frees == 5 && cp_front_held[3] == HOLD,
	      "at most %d blocks held: %d held, %d of the last take's 9 freed for real", HOLD, cp_front_held[3], frees);
	int served = 0;
	while (cp_front_malloc(8192, 3, 5) != NULL)
		served++;
	CHECK(served == HOLD && cp_front_held[3] == 0, "the held blocks are served (%d)", served);
	/* Only the blocks Go marked CP_TAG_HOLD are held; the mark is not part
	 * of the pool's tag: a malloc routed to the pool is served. */
	cp_front_take(3, 1);
	uintptr_t big = next_ptr += 4096, pbig = next_ptr += 4096;
	cp_front_track(big, 3 << 20, 5, 3, dflt(0));
	cp_front_track(pbig, 3 << 20, 5, 3, pooltag(7, 1));
	cp_front_free(big, 3 << 20, 3, 0);
	cp_front_free(pbig, 3 << 20, 3, 0);
	CHECK(cp_front_take(3, 1) == 2 && cp_front_out[3][0].op == CP_OP_FREE && cp_front_out[3][1].op == CP_OP_HOLD &&
	          cp_front_held[3] == 1,
	      "at a take with keep, a block without the mark is freed for real, one with it held");
	cp_front_take(3, 0);
	policy.phases[3] = 21;
	cp_front_set_policy(&policy);
	cp_front_track(0, 0, 5, 3, (cp_track){.route = 7, .phases = 21});
	uintptr_t xs = next_ptr += 4096;
	cp_front_track(xs, 4096, 5, 3, pooltag(7, 1));
	cp_front_free(xs, 4096, 3, 0);
	CHECK(cp_front_take(3, 1) == 1 && cp_front_out[3][0].op == CP_OP_HOLD, "a marked pool block is held");
	CHECK((uintptr_t)cp_front_malloc(4096, 3, 5) == xs, "the held block is served to the pool's route");
	policy.phases[3] = 0;
	cp_front_set_policy(&policy);
	cp_front_take(3, 0);
	policy.hold = 0;
	cp_front_set_policy(&policy);
	uintptr_t h0 = next_ptr += 4096;
	cp_front_track(h0, 512, 5, 3, dflt(1));
	cp_front_free(h0, 512, 3, 0);
	CHECK(cp_front_take(3, 1) == 1 && cp_front_out[3][0].op == CP_OP_FREE && cp_front_held[3] == 0,
	      "a policy that holds none: freed for real");
	policy.hold = HOLD;
	cp_front_set_policy(&policy);

	uintptr_t o = next_ptr += 4096;
	cp_front_track(o, 512, 5, 3, dflt(1));
	cp_front_free(o, 512, 3, 0);
	policy.on = 0;
	cp_front_set_policy(&policy);
	CHECK(cp_front_take(3, 1) >= 1 && cp_front_held[3] == 0, "with the front off, a take with keep holds nothing");
	policy.on = 1;
	cp_front_set_policy(&policy);

	/* The counters. Device 0: every hit above; cold verdicts 1 (the first
	 * window) + COLD_MAX_SHIFT + 2 in a row + 1 after the reset. */
	unsigned long long c[4];
	CHECK(cp_front_counters(0, c) == 0, "device 0's counters");
	CHECK(c[0] == (unsigned long long)hits && c[1] == 0, "hits %llu (expected %d), pool hits %llu (0)", c[0], hits, c[1]);
	CHECK(c[3] == COLD_MAX_SHIFT + 4, "cold verdicts %llu (expected %d)", c[3], COLD_MAX_SHIFT + 4);
	CHECK(c[2] == (unsigned long long)untracked0, "blocks left untracked: %llu (expected %ld)", c[2], untracked0);
	CHECK(cp_front_counters(CP_FRONT_MAXDEV, c) == -1, "no counters for a device the front does not serve");

	printf("%d passed, %d failed\n", passed, failed);
	return failed != 0;
}
