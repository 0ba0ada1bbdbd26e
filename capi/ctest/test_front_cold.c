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
 *   - a malloc's take (keep) holds blocks, up to CP_FRONT_HOLD, which the
 *     front serves later; a take without keep releases them; in the
 *     default pools, and in a private pool's blocks tagged CP_TAG_HOLD_SMALL
 *     (expandable segments), blocks up to cp_front_hold_max only;
 *   - the counters of cudapool_get_front_counters.
 */
#include <stdio.h>

#include "front.c"

/* The filters a route names live in cudapool.c and torch.cpp; this program
 * makes no routes (test_front.c tests them through the library). */
int cp_call_c_filter(uintptr_t filter, uintptr_t ctx, uintptr_t stream) {
	(void)filter, (void)ctx, (void)stream;
	return 0;
}
int cp_call_std_filter(uintptr_t handle, uintptr_t stream) {
	(void)handle, (void)stream;
	return 0;
}

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
	cp_front_track(p, 4096, 0, dev, 1);
	int logged = cp_front_free(p, 4096, dev, 0) == 1;
	cp_front_take(dev, 0);
	return logged;
}

/* A block freed and reused at once (a hit), then freed for real. */
static int reused_block(int dev) {
	uintptr_t p = next_ptr += 4096;
	cp_front_track(p, 512, 7, dev, 1);
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

/* The small pool's limit, which Go tells the front when the library loads
 * (capi/front.go); the test stands in for Go. */
enum { HOLD_MAX = 1 << 20 };

int main(void) {
	cp_front_hold_max = HOLD_MAX;
	cp_front_set_on(1);

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
	cp_route all = {.tag = 2, .kind = CP_ROUTE_ALL};
	CHECK(cp_front_set_routes(2, &all, 1), "a phase with a NULL filter can be routed");
	CHECK(wasted_block(2), "phases began: device 2 tracks its blocks again");
	unsigned long long c2[4];
	CHECK(cp_front_counters(2, c2) == 0 && c2[2] == 2 && c2[3] == 1,
	      "device 2: 2 blocks left untracked (got %llu), the rest of its stretch cancelled; 1 verdict (got %llu)", c2[2],
	      c2[3]);
	CHECK(cp_front_set_routes(2, NULL, 0), "the phase ends");
	cp_route many[CP_FRONT_MAXROUTES + 1] = {{0}};
	CHECK(!cp_front_set_routes(2, many, CP_FRONT_MAXROUTES + 1), "more phases than the front keeps are refused");

	/* Held blocks (device 3). */
	uintptr_t h = next_ptr += 4096;
	cp_front_track(h, 4096, 5, 3, 1);
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
		int nb = batch == 0 ? CP_FRONT_HOLD - 4 : 9;
		for (int i = 0; i < nb; i++) {
			uintptr_t q = next_ptr += 4096;
			cp_front_track(q, 8192, 5, 3, 1);
			cp_front_free(q, 8192, 3, 0);
		}
		nt = cp_front_take(3, 1);
	}
	for (size_t i = 0; i < nt; i++)
		frees += cp_front_out[3][i].op == CP_OP_FREE;
	CHECK(nt == 9 && frees == 5 && cp_front_held[3] == CP_FRONT_HOLD,
	      "at most %d blocks held: %d held, %d of the last take's 9 freed for real", CP_FRONT_HOLD, cp_front_held[3],
	      frees);
	int served = 0;
	while (cp_front_malloc(8192, 3, 5) != NULL)
		served++;
	CHECK(served == CP_FRONT_HOLD && cp_front_held[3] == 0, "the held blocks are served (%d)", served);
	/* In the default pools only blocks up to cp_front_hold_max are held; a
	 * private pool's are held at any size. After a take of the reuses above. */
	cp_front_take(3, 1);
	uintptr_t big = next_ptr += 4096, pbig = next_ptr += 4096;
	cp_front_track(big, HOLD_MAX + 512, 5, 3, 1);
	cp_front_track(pbig, HOLD_MAX + 512, 5, 3, 7);
	cp_front_free(big, HOLD_MAX + 512, 3, 0);
	cp_front_free(pbig, HOLD_MAX + 512, 3, 0);
	CHECK(cp_front_take(3, 1) == 2 && cp_front_out[3][0].op == CP_OP_FREE && cp_front_out[3][1].op == CP_OP_HOLD &&
	          cp_front_held[3] == 1,
	      "a large default-pool block is freed for real at a take with keep, a private pool's is held");
	cp_front_take(3, 0);
	/* A private pool's blocks tagged CP_TAG_HOLD_SMALL (expandable
	 * segments) are held up to cp_front_hold_max only, and the flag is not
	 * part of the pool's tag: a malloc routed to the pool is served. */
	cp_route pool7 = {.tag = 7, .kind = CP_ROUTE_ALL};
	CHECK(cp_front_set_routes(3, &pool7, 1), "a phase of pool 7 on device 3");
	uintptr_t xs = next_ptr += 4096, xb = next_ptr += 4096;
	cp_front_track(xs, 4096, 5, 3, 7 | CP_TAG_HOLD_SMALL);
	cp_front_track(xb, HOLD_MAX + 512, 5, 3, 7 | CP_TAG_HOLD_SMALL);
	cp_front_free(xb, HOLD_MAX + 512, 3, 0);
	CHECK((uintptr_t)cp_front_malloc(HOLD_MAX + 512, 3, 5) == xb, "a block tagged hold-small is served within a log");
	cp_front_free(xs, 4096, 3, 0);
	cp_front_free(xb, HOLD_MAX + 512, 3, 0);
	nt = cp_front_take(3, 1);
	int held_small = 0, freed_big = 0;
	for (size_t i = 0; i < nt; i++) {
		held_small += cp_front_out[3][i].ptr == xs && cp_front_out[3][i].op == CP_OP_HOLD;
		freed_big += cp_front_out[3][i].ptr == xb && cp_front_out[3][i].op == CP_OP_FREE;
	}
	CHECK(held_small == 1 && freed_big == 1 && cp_front_held[3] == 1,
	      "at a take with keep the small one is held, the large one freed for real (held %d, freed %d)", held_small,
	      freed_big);
	CHECK((uintptr_t)cp_front_malloc(4096, 3, 5) == xs, "the held small block is served to the pool's phase");
	CHECK(cp_front_set_routes(3, NULL, 0), "the phase ends");
	cp_front_take(3, 0);

	cp_front_set_on(0);
	uintptr_t o = next_ptr += 4096;
	cp_front_set_on(1);
	cp_front_track(o, 512, 5, 3, 1);
	cp_front_free(o, 512, 3, 0);
	cp_front_set_on(0);
	CHECK(cp_front_take(3, 1) >= 1 && cp_front_held[3] == 0, "with the front off, a take with keep holds nothing");
	cp_front_set_on(1);

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
