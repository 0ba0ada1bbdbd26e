// SPDX-License-Identifier: Apache-2.0
/*
 * test_front.c - a randomized test of the front cache (allocator/front.go,
 * capi/front.c) through the public C ABI, on the simulated devices: run with
 * CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2 (make test-c does, twice: with
 * the front on and with front_cache:False, both with debug_checks:True).
 *
 *   test_front [seed [ops [thread_pairs]]]
 *
 * Part 1 replays a seeded random sequence of mallocs and frees through every
 * entry point that meets the front (the C API, the PyTorch class's
 * malloc_ctx / free_deferred, cudapool_torch_malloc / torch_free, CuPy's,
 * free_ctx), on three streams and both devices, with record_stream, IPC
 * handles, allocate-to-pool phases (two pools per device, nested or not,
 * each with a NULL filter or a C filter accepting a random set of streams,
 * which the front evaluates itself; allocator/routing.go), memory history,
 * caching off,
 * empty_cache, snapshots and deliberate bad frees in between. A model of
 * the live blocks checks every malloc (no overlap with a live block, right
 * pool), every bad free (an error, nothing lost), and at each statistics
 * check the allocation and requested_bytes statistics exactly, peaks and
 * sums included. The call sequence depends only on the seed, never on the
 * pointers returned, so both runs make the same calls: every statistics
 * check prints a "cmp" line of placement-independent numbers, and the two
 * runs' cmp lines must be identical.
 *
 * Part 2 runs 4 threads of malloc/free through the front on both devices,
 * with a thread reading statistics and emptying the cache meanwhile. Part 3
 * runs short fixed sequences for rules the random parts reach too rarely
 * (a free with a context, then a double free) or leave out on purpose (a
 * malloc after other streams' work finished: see USE_STREAM).
 *
 * The front-on run fails unless the front served mallocs (lifo_probe), also
 * during allocate-to-pool phases, and only from the routed pool's blocks
 * (phase_probe).
 * stderr is kept in a file and checked for the allocator's internal errors
 * (the front's replay reports a block it cannot find there).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cudapool.h"
#include "cudapool_testing.h"

#include "check.h"

/* Declared for C++ only in cudapool.h (they may throw); exported with C
 * linkage. They throw only when a malloc fails, which this test makes a
 * failure anyway. */
void *cudapool_torch_malloc(size_t size, int device, cudapool_stream stream);
void cudapool_torch_free(void *ptr, size_t size, int device, cudapool_stream stream);

/* Per-operation checks print only failures (the first few), so that a run
 * of 10^5 operations does not print 10^6 "ok" lines. */
static long quiet_passed;
static int quiet_printed;

#define QCHECK(cond, ...)                                                              \
	do {                                                                           \
		if (cond) {                                                            \
			quiet_passed++;                                                \
		} else if (quiet_printed++ < 40) {                                     \
			check_at(0, __FILE__, __LINE__, #cond, __VA_ARGS__);           \
		} else {                                                               \
			failed++;                                                      \
		}                                                                      \
	} while (0)

static uint64_t rng;

static uint64_t rnd(void) {
	/* xorshift64*: the sequence depends only on the seed. */
	rng ^= rng >> 12;
	rng ^= rng << 25;
	rng ^= rng >> 27;
	return rng * 2685821657736338717ULL;
}

static unsigned pick(unsigned n) { return (unsigned)(rnd() % n); }

/* ------------------------------------------------------------------ */
/* The model of part 1. */

enum { PATH_C, PATH_CLASS, PATH_TORCH, PATH_CUPY, PATH_FREE_CTX };

typedef struct {
	uintptr_t p, stream;
	size_t size;
	int dev;
	int counted;  /* allocated while caching was on: in the statistics */
	int inpool;   /* routed to the device's private pool 1 (POOL_A) or 2 (POOL_B); 0: default */
	int recorded; /* record_stream'd: its free waits for USE_STREAM's work */
} blk;

#define MAXLIVE 384
static blk live[MAXLIVE];
static int nlive;

/* One statistic of the model: current, peak, sum of increases, of decreases. */
typedef struct {
	long long cur, peak, allocd, freed;
} mstat;

/* Per device, [0] all, [1] small pool, [2] large pool. Freed blocks that
 * wait for another stream's work stay active and keep their requested
 * bytes (as in PyTorch) until the allocator sees that work done: aw_n and
 * aw_req count them. */
static struct {
	mstat n[3], req[3];
	long long aw_n[3], aw_req[3];
} model[2];

/* The stream record_stream names. Work is submitted to it before every free
 * of a block that uses it, so that the block waits until the next
 * sim_complete_all + empty_cache: when the allocator notices finished work
 * otherwise (at its next malloc) depends on which mallocs reach it, which
 * part 3 tests on its own. */
#define USE_STREAM 0x3000

static int ndev;
/* Allocate-to-pool phases under way on the device: [d][0] of pool
 * {POOL_A, d}, [d][1] of pool {POOL_B, d}, begun later if both run. */
static int routing[2][2];
static int routing_order[2][2]; /* which began first: 0 or 1 at [d][0] */
static long long max_split; /* bytes; -1: unlimited */
static int front_expected; /* front_cache is not False in this run */

static const unsigned long long POOL_A = 0xF00D, POOL_B = 0xBEEF; /* private pools {POOL_*, dev} */
static int pool_begun[2][2];

/* A phase's stream filter: the streams it accepts, as bits of stream_bit. */
typedef struct {
	unsigned mask;
	int null; /* begun with a NULL filter: every stream */
} route_filter;
static route_filter filters[2][2];
static atomic_long filter_calls;

static unsigned stream_bit(uintptr_t s) {
	switch (s) {
	case 0:
		return 1;
	case 0x1000:
		return 2;
	case 0x2000:
		return 4;
	default:
		return 8;
	}
}

static int filter_accepts(void *ctx, cudapool_stream s) {
	atomic_fetch_add(&filter_calls, 1);
	return (((route_filter *)ctx)->mask & stream_bit((uintptr_t)s)) != 0;
}

static int phase_accepts(int d, int k, uintptr_t s) {
	return routing[d][k] && (filters[d][k].null || (filters[d][k].mask & stream_bit(s)) != 0);
}

/* The pool (1, 2) a malloc on s routes to, newest phase first; 0: default. */
static int route_of(int d, uintptr_t s) {
	int newest = routing_order[d][1], oldest = routing_order[d][0];
	if (phase_accepts(d, newest, s))
		return newest + 1;
	if (phase_accepts(d, oldest, s))
		return oldest + 1;
	return 0;
}
static int history_on, caching_off;
static unsigned long long next_ctx = 1;

/* Segments of the private pools, from base_allocation of their blocks. */
#define MAXRANGES 512
typedef struct {
	uintptr_t base;
	size_t size;
	int dev;
	int pool; /* 1, 2: blk.inpool */
} range;
static range pool_ranges[MAXRANGES];
static int npool_ranges;

/* Recently freed blocks: targets of double frees, and how reuses are
 * counted (a malloc returning a pointer freed earlier with the same size,
 * stream and device). */
#define RING 64
static blk freed_ring[RING];
static int ring_valid[RING];
static unsigned ring_next;

/* TEST_FRONT_TRACE=1: print every operation and check the statistics after
 * each (to cut a failing seed down to a reproduction). */
static int trace;
static int expandable; /* expandable segments are on (the default) */
#define TRACE(...)                           \
	do {                                 \
		if (trace)                   \
			printf(__VA_ARGS__); \
	} while (0)

/* stderr goes to err_path while the test runs; err_fd is the real one. */
static int err_fd = -1;
static char err_path[] = "/tmp/cudapool_test_front_stderr_XXXXXX";

static long n_reuses_routed;
static long n_mallocs, n_frees, n_reuses, n_bad, n_bad_skipped, n_checks, n_snapshots;

static int pool_of(size_t size) { return size <= MiB ? 1 : 2; } /* PyTorch's kSmallSize */

static void bump(mstat *s, long long by) {
	s->cur += by;
	if (by > 0) {
		s->allocd += by;
		if (s->cur > s->peak)
			s->peak = s->cur;
	} else {
		s->freed -= by;
	}
}

static void model_count(const blk *b, int sign) {
	if (!b->counted)
		return;
	int k = pool_of(b->size);
	for (int i = 0; i < 2; i++) {
		int j = i == 0 ? 0 : k;
		bump(&model[b->dev].n[j], sign);
		if (sign < 0 && b->recorded) {
			model[b->dev].aw_n[j]++;
			model[b->dev].aw_req[j] += (long long)b->size;
		} else {
			bump(&model[b->dev].req[j], sign * (long long)b->size);
		}
	}
}

/* The allocator synchronized with every stream (empty_cache): the blocks
 * that waited are free. */
static void model_release_waiting(void) {
	for (int d = 0; d < 2; d++)
		for (int k = 0; k < 3; k++) {
			if (model[d].aw_req[k] > 0)
				bump(&model[d].req[k], -model[d].aw_req[k]);
			model[d].aw_n[k] = model[d].aw_req[k] = 0;
		}
}

static int any_routing(void) { return routing[0][0] || routing[0][1] || routing[1][0] || routing[1][1]; }

static int live_index(uintptr_t p, int dev) {
	for (int i = 0; i < nlive; i++)
		if (live[i].p == p && live[i].dev == dev)
			return i;
	return -1;
}

static int in_pool_range(uintptr_t p, int dev) {
	for (int i = 0; i < npool_ranges; i++)
		if (pool_ranges[i].dev == dev && p >= pool_ranges[i].base && p < pool_ranges[i].base + pool_ranges[i].size)
			return 1;
	return 0;
}

static size_t pick_size(void) {
	static const size_t common[] = {512, 1000, 4096, 12296, 65536, 200000, 1 * MiB, 2 * MiB, 3 * MiB + 512};
	static const size_t large[] = {4 * MiB, 12 * MiB, 25 * MiB + 4096, 60 * MiB};
	unsigned r = pick(100);
	if (r < 75)
		return common[pick(sizeof common / sizeof common[0])];
	if (r < 85) {
		if (max_split > 0 && pick(2) == 0) /* above max_split_size: oversize blocks */
			return (size_t)max_split + (size_t[]){0, MiB, 7 * MiB + 123}[pick(3)];
		return large[pick(sizeof large / sizeof large[0])];
	}
	if (r < 86)
		return 0; /* NULL without an error */
	return 1 + pick(3 * MiB); /* odd sizes */
}

static uintptr_t pick_stream(void) {
	static const uintptr_t s[] = {0, 0x1000, 0x2000};
	return s[pick(3)];
}

/* The context a PyTorch class would pass: one only while history wants it. */
static unsigned long long ctx_for(unsigned bit) { return (cudapool_gather_mask() & bit) ? next_ctx++ : 0; }

static void do_malloc(size_t size, int dev, uintptr_t stream, int path) {
	void *p;
	unsigned long long ctx = 0;
	switch (path) {
	case PATH_CLASS:
		ctx = ctx_for(CUDAPOOL_GATHER_ALLOC);
		p = cudapool_malloc_ctx(size, dev, (cudapool_stream)stream, ctx);
		break;
	case PATH_TORCH:
		p = size == 0 ? NULL : cudapool_torch_malloc(size, dev, (cudapool_stream)stream);
		break;
	case PATH_CUPY:
		stream = 0; /* a NULL param: the legacy default stream */
		p = cudapool_cupy_malloc(NULL, size, dev);
		break;
	default:
		p = cudapool_malloc(size, dev, (cudapool_stream)stream);
	}
	TRACE("      malloc(%zu, dev %d, stream %#lx, path %d, ctx %llu) = %p\n", size, dev, (unsigned long)stream, path, ctx, p);
	if (size == 0) {
		QCHECK(p == NULL, "malloc(0) returns NULL");
		return;
	}
	QCHECK(p != NULL, "malloc(%zu) on device %d (path %d) succeeds", size, dev, path);
	if (p == NULL)
		return;
	uintptr_t u = (uintptr_t)p;
	QCHECK(u % 512 == 0, "malloc result %p is 512-aligned", p);
	/* Not live already, and no overlap with a live block's requested bytes. */
	int overlap = -1;
	for (int i = 0; i < nlive; i++)
		if (live[i].dev == dev && u < live[i].p + live[i].size && live[i].p < u + size)
			overlap = i;
	QCHECK(overlap < 0, "malloc(%zu, dev %d) returned %p, which overlaps live block %#lx (%zu bytes)", size, dev, p,
	       overlap < 0 ? 0UL : (unsigned long)live[overlap].p, overlap < 0 ? (size_t)0 : live[overlap].size);
	if (overlap >= 0)
		return; /* left out of the model, which has failed already */
	blk b = {.p = u, .stream = stream, .size = size, .dev = dev, .counted = !caching_off,
	         .inpool = caching_off ? 0 : route_of(dev, stream)};
	if (b.inpool) {
		size_t seg = 0;
		void *base = cudapool_base_allocation(p, &seg);
		QCHECK(base != NULL, "base_allocation of a pool block");
		int known = 0, other = 0;
		for (int i = 0; i < npool_ranges; i++)
			if (pool_ranges[i].dev == dev && pool_ranges[i].base == (uintptr_t)base) {
				known = 1;
				other |= pool_ranges[i].pool != b.inpool;
			}
		QCHECK(!other, "a malloc routed to pool %d (dev %d, stream %#lx, %zu bytes) returned %p, in the other pool",
		       b.inpool, dev, (unsigned long)stream, size, p);
		if (base != NULL && !known && npool_ranges < MAXRANGES)
			pool_ranges[npool_ranges++] = (range){(uintptr_t)base, seg, dev, b.inpool};
	} else {
		QCHECK(!in_pool_range(u, dev), "a malloc outside the pool (dev %d, %zu bytes) returned %p, in the private pool",
		       dev, size, p);
	}
	/* Now and then ask Go what it thinks the block is. */
	if (pick(8) == 0 && b.counted) {
		size_t asz = 0;
		int adev = -1;
		QCHECK(cudapool_allocation_info(p, &asz, &adev) == 0 && asz == size && adev == dev,
		       "allocation_info(%p) = %zu bytes on device %d (expected %zu on %d)", p, asz, adev, size, dev);
	}
	for (int i = 0; i < RING; i++)
		if (ring_valid[i] && freed_ring[i].p == u && freed_ring[i].dev == dev) {
			if (freed_ring[i].size == size && freed_ring[i].stream == stream) {
				n_reuses++;
				n_reuses_routed += b.inpool != 0;
			}
			ring_valid[i] = 0;
		}
	live[nlive++] = b;
	n_mallocs++;
	model_count(&b, +1);
}

/* Frees live[i] through path; 0 if the free was not made: while a pool
 * route is under way an uncached block cannot be freed, and a recorded
 * block's free would wait for the route's end, then for a malloc. */
static int do_free(int i, int path) {
	blk b = live[i];
	if ((!b.counted || b.recorded) && any_routing())
		return 0;
	if (b.recorded)
		cudapool_sim_submit((cudapool_stream)USE_STREAM);
	int size_known = pick(2), dev_known = pick(2);
	size_t size = size_known ? b.size : 0;
	TRACE("      free(%#lx, %zu of %zu, dev %d, stream %#lx, path %d)\n", (unsigned long)b.p, size, b.size,
	      dev_known ? b.dev : -1, (unsigned long)b.stream, path);
	switch (path) {
	case PATH_CLASS:
		cudapool_free_deferred((void *)b.p, size, dev_known ? b.dev : -1, ctx_for(CUDAPOOL_GATHER_FREE));
		break;
	case PATH_TORCH:
		cudapool_torch_free((void *)b.p, b.size, b.dev, (cudapool_stream)b.stream);
		break;
	case PATH_CUPY:
		cudapool_cupy_free(NULL, (void *)b.p, b.dev);
		break;
	case PATH_FREE_CTX: {
		int rc = cudapool_free_ctx((void *)b.p, size, dev_known ? b.dev : -1, ctx_for(CUDAPOOL_GATHER_FREE));
		QCHECK(rc == 0, "free_ctx(%#lx) of a live block succeeds", (unsigned long)b.p);
		break;
	}
	default:
		cudapool_clear_error();
		cudapool_free((void *)b.p, size, b.dev, (cudapool_stream)b.stream);
		QCHECK(cudapool_last_error() == NULL, "free(%#lx, %zu, dev %d) of a live block reports no error",
		       (unsigned long)b.p, size, b.dev);
	}
	live[i] = live[--nlive];
	n_frees++;
	model_count(&b, -1);
	freed_ring[ring_next % RING] = b;
	ring_valid[ring_next % RING] = 1;
	ring_next++;
	return 1;
}

/* Device 0's front counters (cudapool_get_front_counters). */
static cudapool_front_counters counters0(void) {
	cudapool_front_counters c;
	memset(&c, 0xff, sizeof c);
	QCHECK(cudapool_get_front_counters(0, &c) == 0, "get_front_counters(0)");
	return c;
}

static const char *stat_names[] = {"all", "small", "large"};

static int stat_eq(cudapool_stat s, mstat m) {
	return s.current == m.cur && s.peak == m.peak && s.allocated == m.allocd && s.freed == m.freed;
}

/* Reads every device's statistics, checks them against the model and the
 * invariants, and prints the cmp line. */
static void check_stats(long step) {
	n_checks++;
	for (int d = 0; d < ndev; d++) {
		cudapool_device_stats st;
		memset(&st, 0, sizeof st);
		QCHECK(cudapool_get_device_stats(d, &st) == 0, "get_device_stats(%d)", d);
		for (int k = 0; k < 3; k++) {
			cudapool_stat a = st.allocation[k], r = st.requested_bytes[k];
			mstat ma = model[d].n[k], mr = model[d].req[k];
			QCHECK(stat_eq(a, ma),
			       "step %ld dev %d allocation.%s: current/peak/allocated/freed %lld/%lld/%lld/%lld, model %lld/%lld/%lld/%lld",
			       step, d, stat_names[k], a.current, a.peak, a.allocated, a.freed, ma.cur, ma.peak, ma.allocd, ma.freed);
			QCHECK(stat_eq(r, mr),
			       "step %ld dev %d requested_bytes.%s: current/peak/allocated/freed %lld/%lld/%lld/%lld, model %lld/%lld/%lld/%lld",
			       step, d, stat_names[k], r.current, r.peak, r.allocated, r.freed, mr.cur, mr.peak, mr.allocd, mr.freed);
			QCHECK(st.active[k].current == a.current + model[d].aw_n[k],
			       "step %ld dev %d active.%s: %lld, model %lld allocated + %lld waiting", step, d, stat_names[k],
			       st.active[k].current, ma.cur, model[d].aw_n[k]);
			QCHECK(st.reserved_bytes[k].current >= st.active_bytes[k].current &&
			           st.active_bytes[k].current >= st.allocated_bytes[k].current && st.active_bytes[k].current >= r.current,
			       "step %ld dev %d %s: reserved >= active bytes >= allocated bytes, requested", step, d, stat_names[k]);
			QCHECK(st.allocated_bytes[k].peak >= st.allocated_bytes[k].current &&
			           st.reserved_bytes[k].peak >= st.reserved_bytes[k].current && st.active[k].peak >= st.active[k].current,
			       "step %ld dev %d %s: peaks >= currents", step, d, stat_names[k]);
		}
		QCHECK(st.allocated_bytes[0].current == st.allocated_bytes[1].current + st.allocated_bytes[2].current &&
		           st.reserved_bytes[0].current == st.reserved_bytes[1].current + st.reserved_bytes[2].current,
		       "step %ld dev %d: all == small + large", step, d);
		QCHECK(st.num_ooms == 0 && st.max_split_size == max_split, "step %ld dev %d: no OOM, max_split_size as configured",
		       step, d);
		/* Placement-independent numbers only: segments, reserved, allocated
		 * bytes and split blocks depend on where blocks are placed. */
		printf("cmp %ld d%d alloc", step, d);
		for (int k = 0; k < 3; k++)
			printf(" %lld/%lld/%lld/%lld", st.allocation[k].current, st.allocation[k].peak, st.allocation[k].allocated,
			       st.allocation[k].freed);
		printf(" req");
		for (int k = 0; k < 3; k++)
			printf(" %lld/%lld/%lld/%lld", st.requested_bytes[k].current, st.requested_bytes[k].peak,
			       st.requested_bytes[k].allocated, st.requested_bytes[k].freed);
		printf(" active %lld oversize %lld/%lld/%lld/%lld ooms %lld\n", st.active[0].current,
		       st.oversize_allocations.current, st.oversize_allocations.peak, st.oversize_allocations.allocated,
		       st.oversize_allocations.freed, st.num_ooms);
	}
}

static int cmp_blk(const void *x, const void *y) {
	const blk *a = x, *b = y;
	if (a->dev != b->dev)
		return a->dev - b->dev;
	return a->p < b->p ? -1 : a->p > b->p;
}

/* The snapshot holds exactly the model's live cached blocks, each in its
 * pool, and agrees with the statistics. */
static void check_snapshot(long step) {
	n_snapshots++;
	static blk sorted[MAXLIVE];
	memcpy(sorted, live, (size_t)nlive * sizeof live[0]);
	qsort(sorted, (size_t)nlive, sizeof sorted[0], cmp_blk);
	cudapool_snapshot *s = cudapool_snapshot_take(0, 0, 0, 0);
	QCHECK(s != NULL, "snapshot_take");
	if (s == NULL)
		return;
	long long nalloc[2] = {0}, bytes[2] = {0}, req[2] = {0}, total[2] = {0}, active[2] = {0};
	int unknown = 0, wrong = 0, nsorted_found = 0;
	for (size_t i = 0; i < s->nsegments; i++) {
		cudapool_segment_info *g = &s->segments[i];
		int d = g->device;
		if (d < 0 || d >= ndev)
			continue;
		total[d] += (long long)g->total_size;
		int pooled = g->pool_b != (unsigned long long)d ? 0 : g->pool_a == POOL_A ? 1 : g->pool_a == POOL_B ? 2 : 0;
		size_t addr = g->address;
		for (size_t j = g->first_block; j < g->first_block + g->nblocks; j++) {
			cudapool_block_info *bi = &s->blocks[j];
			active[d] += bi->active;
			if (bi->active)
				req[d] += (long long)bi->requested_size;
			if (bi->allocated) {
				nalloc[d]++;
				bytes[d] += (long long)bi->size;
				blk key = {.p = addr, .dev = d};
				blk *m = bsearch(&key, sorted, (size_t)nlive, sizeof sorted[0], cmp_blk);
				if (m == NULL || !m->counted) {
					if (unknown++ < 3)
						printf("      step %ld: the snapshot's allocated block %#zx (dev %d, %zu bytes) is not live in the model\n",
						       step, addr, d, bi->requested_size);
				} else {
					nsorted_found++;
					if (m->size != bi->requested_size || m->inpool != pooled) {
						if (wrong++ < 3)
							printf("      step %ld: block %#zx: %zu requested (model %zu), pool %d (model %d)\n", step,
							       addr, bi->requested_size, m->size, pooled, m->inpool);
					}
				}
			}
			addr += bi->size;
		}
		QCHECK(addr == g->address + g->total_size, "step %ld: segment %#zx's blocks add up to its size", step, g->address);
	}
	int counted_live = 0, uncached_in_segment = 0;
	for (int i = 0; i < nlive; i++) {
		counted_live += live[i].counted;
		if (!live[i].counted)
			for (size_t k = 0; k < s->nsegments; k++)
				uncached_in_segment += s->segments[k].device == live[i].dev && live[i].p >= s->segments[k].address &&
				                       live[i].p < s->segments[k].address + s->segments[k].total_size;
	}
	QCHECK(unknown == 0 && wrong == 0 && nsorted_found == counted_live,
	       "step %ld: the snapshot's allocated blocks are the model's %d live cached blocks (found %d, %d unknown, %d wrong)",
	       step, counted_live, nsorted_found, unknown, wrong);
	QCHECK(uncached_in_segment == 0, "step %ld: blocks allocated with caching off are in no segment", step);
	cudapool_snapshot_free(s);
	for (int d = 0; d < ndev; d++) {
		cudapool_device_stats st;
		cudapool_get_device_stats(d, &st);
		QCHECK(st.allocation[0].current == nalloc[d] && st.allocated_bytes[0].current == bytes[d] &&
		           st.requested_bytes[0].current == req[d] && st.reserved_bytes[0].current == total[d] &&
		           st.active[0].current == active[d],
		       "step %ld dev %d: snapshot and statistics agree (allocation %lld/%lld, bytes %lld/%lld, requested %lld/%lld, "
		       "reserved %lld/%lld, active %lld/%lld)",
		       step, d, nalloc[d], st.allocation[0].current, bytes[d], st.allocated_bytes[0].current, req[d],
		       st.requested_bytes[0].current, total[d], st.reserved_bytes[0].current, active[d], st.active[0].current);
	}
}

/* A deliberate bad free: it must fail with an error and change nothing. */
static void bad_free(void) {
	unsigned kind = pick(6), r1 = pick(RING), r2 = (unsigned)nlive > 0 ? pick((unsigned)nlive) : 0, via = pick(4);
	if (pick(2) == 0)
		r1 = RING - 1 - r1 % 4; /* half of the double frees: one of the last four frees */
	n_bad++;
	cudapool_clear_error();
	if (kind == 0 || kind == 5) {
		/* A double free of a recently freed block, unless it is live again
		 * (whether it is depends on placement: a skip changes no statistic). */
		blk b = freed_ring[(ring_next + r1) % RING];
		if (!ring_valid[(ring_next + r1) % RING] || live_index(b.p, b.dev) >= 0) {
			n_bad_skipped++;
			return;
		}
		if (kind == 5) {
			/* Queued: the call that performs it (any next one) reports it. */
			cudapool_free_deferred((void *)b.p, 0, -1, 0);
			cudapool_device_stats st;
			QCHECK(cudapool_get_device_stats(0, &st) == 0 && cudapool_last_error() != NULL,
			       "a queued double free of %#lx is reported by the next call", (unsigned long)b.p);
			return;
		}
		if (via == 0) {
			QCHECK(cudapool_free_ctx((void *)b.p, b.size, b.dev, 0) == -1 && cudapool_last_error() != NULL,
			       "free_ctx of the freed block %#lx fails", (unsigned long)b.p);
		} else {
			cudapool_free((void *)b.p, b.size, b.dev, (cudapool_stream)b.stream);
			QCHECK(cudapool_last_error() != NULL, "double free of %#lx (%zu bytes, dev %d, stream %#lx) reports an error",
			       (unsigned long)b.p, b.size, b.dev, (unsigned long)b.stream);
		}
		return;
	}
	if (kind == 4) {
		uintptr_t p = 0x1000 + 512 * (uintptr_t)r1;
		cudapool_free((void *)p, 4096, 0, NULL);
		QCHECK(cudapool_last_error() != NULL, "free of the unknown pointer %#lx reports an error", (unsigned long)p);
		return;
	}
	if (nlive == 0 || !live[r2].counted || (kind == 2 && ndev < 2)) {
		n_bad_skipped++; /* caching off frees ignore the size and device */
		return;
	}
	blk b = live[r2];
	const char *what = kind == 1 ? "the wrong size" : kind == 2 ? "the wrong device" : "an interior pointer";
	if (kind == 1)
		cudapool_free((void *)b.p, b.size + 1, b.dev, (cudapool_stream)b.stream);
	else if (kind == 2)
		cudapool_free((void *)b.p, b.size, 1 - b.dev, (cudapool_stream)b.stream);
	else
		cudapool_free((void *)(b.p + 8), b.size, b.dev, (cudapool_stream)b.stream);
	QCHECK(err_has(kind == 1 ? "freed with" : kind == 2 ? "not device" : "inside the block"),
	       "free of %#lx with %s reports it", (unsigned long)b.p, what);
	size_t asz = 0;
	int adev = -1;
	QCHECK(cudapool_allocation_info((void *)b.p, &asz, &adev) == 0 && asz == b.size && adev == b.dev,
	       "after a free with %s, %#lx is still allocated (%zu bytes on %d)", what, (unsigned long)b.p, asz, adev);
}

/* Begins (with a random filter) or ends the phase of pool k+1 on device d. */
static void set_routing(int d, int k, int on) {
	unsigned long long id = k == 0 ? POOL_A : POOL_B;
	cudapool_clear_error();
	if (on) {
		route_filter *f = &filters[d][k];
		f->null = pick(4) == 0;
		f->mask = pick(16);
		cudapool_begin_allocate_to_pool(d, id, (unsigned long long)d, f->null ? NULL : filter_accepts, f);
		pool_begun[d][k]++;
		if (routing[d][1 - k]) { /* the other began first */
			routing_order[d][0] = 1 - k;
			routing_order[d][1] = k;
		} else {
			routing_order[d][0] = routing_order[d][1] = k;
		}
	} else {
		cudapool_end_allocate_to_pool(d, id, (unsigned long long)d);
		routing_order[d][0] = routing_order[d][1] = 1 - k;
	}
	QCHECK(cudapool_last_error() == NULL, "%s_allocate_to_pool of pool %d on device %d", on ? "begin" : "end", k + 1, d);
	routing[d][k] = on;
}

/* capture_like: random_part's second run, shaped like a captured forward
 * pass: phases are under way most of the time and most frees are followed
 * by a malloc of the same size and stream, so that the front serves the
 * phases' pools (the first run's frees are mostly for good, and the front's
 * cold mode stops tracking then). */
static void random_part(uint64_t seed, long nops, int capture_like) {
	printf("-- random sequence%s: seed %llu, %ld operations, %d device(s)\n", capture_like ? ", capture-like" : "",
	       (unsigned long long)seed, nops, ndev);
	cudapool_front_counters k0 = counters0();
	rng = seed * 0x9E3779B97F4A7C15ULL + 1;
	for (long step = 0; step < nops; step++) {
		/* Phases: pool 1's on for ~100 operations, off for ~700; pool 2's
		 * on for ~60, off for ~1,000. */
		for (int d = 0; d < ndev; d++) {
			if (pick(capture_like ? (routing[d][0] ? 3000 : 30) : (routing[d][0] ? 100 : 700)) == 0)
				set_routing(d, 0, !routing[d][0]);
			if (pick(routing[d][1] ? 60 : 1000) == 0)
				set_routing(d, 1, !routing[d][1]);
		}
		/* The capture-like run keeps history and caching as they are: either
		 * turns the front off (uncached blocks until they are all freed). */
		if (pick(history_on ? 100 : 700) == 0 && !capture_like) {
			history_on = !history_on;
			QCHECK(cudapool_record_history(history_on, 4096, 3, 0, NULL) == 0 && cudapool_history_enabled() == history_on,
			       "record_history(%d)", history_on);
		}
		if (pick(caching_off ? 60 : 900) == 0 && !capture_like) {
			caching_off = !caching_off;
			QCHECK(cudapool_set_caching(!caching_off) == 0 && cudapool_caching() == !caching_off, "set_caching(%d)",
			       !caching_off);
		}

		unsigned r = pick(1000), a = pick(1u << 30), path = pick(10);
		if (capture_like) /* malloc 30%, free 25%, free then malloc 40%, the rest 5% */
			r = r < 300 ? r * 420 / 300 : r < 550 ? 420 + (r - 300) * 380 / 250 : r < 950 ? 800 + (r - 550) / 4 : 900 + (r - 950) * 2;
		if (r < 420 && nlive < MAXLIVE - 1) {
			/* malloc: C 40%, PyTorch class 30%, torch 15%, CuPy 15% */
			size_t size = pick_size();
			int dev = (int)pick((unsigned)ndev);
			uintptr_t s = pick_stream();
			do_malloc(size, dev, s, path < 4 ? PATH_C : path < 7 ? PATH_CLASS : path < 8 ? PATH_TORCH : PATH_CUPY);
		} else if (r < 800) {
			/* free: C 40%, class 30%, torch 10%, CuPy 10%, free_ctx 10% */
			if (nlive > 0)
				do_free((int)(a % (unsigned)nlive),
				        path < 4 ? PATH_C : path < 7 ? PATH_CLASS : path < 8 ? PATH_TORCH : path < 9 ? PATH_CUPY : PATH_FREE_CTX);
		} else if (r < 900) {
			/* free, then a malloc of the same size, stream and device: what
			 * the front serves */
			if (nlive > 0) {
				/* During a phase, often the newest block: most likely one
				 * of the phase's pool, which the front then serves again. */
				int i = any_routing() && pick(capture_like ? 4 : 2) ? nlive - 1 : (int)(a % (unsigned)nlive);
				blk b = live[i];
				unsigned p2 = pick(3);
				if (do_free(i, path < 5 ? PATH_C : PATH_CLASS))
					do_malloc(b.size, b.dev, b.stream, p2 == 0 ? PATH_C : p2 == 1 ? PATH_CLASS : PATH_TORCH);
			}
		} else if (r < 930) {
			if (nlive > 0) {
				blk *b = &live[a % (unsigned)nlive];
				cudapool_clear_error();
				cudapool_record_stream((void *)b->p, (cudapool_stream)USE_STREAM);
				QCHECK(!b->counted || cudapool_last_error() == NULL, "record_stream(%#lx)", (unsigned long)b->p);
				b->recorded |= b->counted; /* ignored for blocks allocated with caching off */
				cudapool_sim_submit((cudapool_stream)USE_STREAM);
			}
		} else if (r < 940) {
			/* Work done and seen at once (see USE_STREAM); during a route
			 * empty_cache is refused, so the work stays pending. */
			if (!any_routing()) {
				cudapool_sim_complete_all();
				cudapool_clear_error();
				cudapool_empty_cache();
				QCHECK(cudapool_last_error() == NULL, "empty_cache after sim_complete_all");
				model_release_waiting();
			}
		} else if (r < 960) {
			bad_free();
		} else if (r < 970) {
			cudapool_clear_error();
			cudapool_empty_cache();
			if (any_routing()) {
				QCHECK(err_has("capture is under way"), "empty_cache is refused while a pool route is under way");
				cudapool_clear_error();
			} else {
				QCHECK(cudapool_last_error() == NULL, "empty_cache");
				model_release_waiting(); /* it synchronizes with every stream first */
			}
		} else if (r < 976) {
			if (nlive > 0 && live[a % (unsigned)nlive].counted && !expandable) {
				blk *b = &live[a % (unsigned)nlive];
				unsigned char h[64];
				size_t off = 0;
				int dev = -1;
				QCHECK(cudapool_ipc_handle((void *)b->p, h, &off, &dev) == 0 && dev == b->dev,
				       "ipc_handle(%#lx) on device %d", (unsigned long)b->p, b->dev);
			}
		} else if (r < 980) {
			check_snapshot(step);
		} else if (r < 990) {
			check_stats(step);
		}
		if (step % 256 == 255 || trace)
			check_stats(step);
	}

	/* Everything back: routes ended, history and caching as at the start,
	 * every block freed, then the pools released. */
	for (int d = 0; d < ndev; d++)
		for (int k = 0; k < 2; k++)
			if (routing[d][k])
				set_routing(d, k, 0);
	if (history_on) {
		history_on = 0;
		cudapool_record_history(0, 0, 0, 0, NULL);
	}
	if (caching_off) {
		caching_off = 0;
		cudapool_set_caching(1);
	}
	check_snapshot(nops);
	while (nlive > 0)
		do_free(nlive - 1, (int)pick(5));
	cudapool_empty_cache();
	model_release_waiting();
	check_stats(nops);
	check_snapshot(nops);
	for (int d = 0; d < ndev; d++) {
		CHECK(model[d].n[0].cur == 0 && model[d].req[0].cur == 0, "device %d: the model has freed everything", d);
		CHECK(model[d].n[0].allocd == model[d].n[0].freed, "device %d: %lld counted mallocs, as many frees", d,
		      model[d].n[0].allocd);
		for (int i = 0; i < pool_begun[d][0]; i++)
			cudapool_release_pool(d, POOL_A, (unsigned long long)d);
		for (int i = 0; i < pool_begun[d][1]; i++)
			cudapool_release_pool(d, POOL_B, (unsigned long long)d);
		pool_begun[d][0] = pool_begun[d][1] = 0;
	}
	cudapool_empty_cache();
	cudapool_sim_complete_all();
	cudapool_empty_cache();
	for (int d = 0; d < ndev; d++) {
		cudapool_device_stats st;
		memset(&st, 0xff, sizeof st);
		int rc = cudapool_get_device_stats(d, &st);
		CHECK(rc == 0 && st.reserved_bytes[0].current == 0,
		      "device %d: every segment returned after the pools' release (%lld bytes reserved)", d,
		      st.reserved_bytes[0].current);
	}
	npool_ranges = 0; /* the pools' segments are gone */
	CHECK(quiet_printed == 0, "%ld per-operation checks of %ld operations (%ld mallocs, %ld frees, %ld statistics checks, "
	                          "%ld snapshots) passed",
	      quiet_passed, nops, n_mallocs, n_frees, n_checks, n_snapshots);
	printf("      %ld bad frees (%ld skipped: their block was live again or uncached)\n", n_bad, n_bad_skipped);
	printf("      %ld mallocs returned the block last freed at that address with the same size, stream and device "
	       "(%ld of them routed to a private pool); the filters were called %ld times\n",
	       n_reuses, n_reuses_routed, atomic_load(&filter_calls));
	if (front_expected)
		CHECK(n_reuses > 0, "with the front on, mallocs reused freed blocks (%ld)", n_reuses);
	cudapool_front_counters k1 = counters0();
	printf("      device 0's front: %llu hits, %llu of them in a private pool; %llu blocks left untracked in cold mode, "
	       "%llu cold verdicts\n", k1.hits - k0.hits, k1.pool_hits - k0.pool_hits, k1.cold_skipped - k0.cold_skipped,
	       k1.cold_verdicts - k0.cold_verdicts);
	if (capture_like)
		CHECK(front_expected ? k1.pool_hits - k0.pool_hits >= 100 : k1.hits == k0.hits,
		      "the front served the phases' pools %llu times (front %s)", k1.pool_hits - k0.pool_hits,
		      front_expected ? "on: at least 100" : "off: never");
}

/* ------------------------------------------------------------------ */
/* The front serves the block freed last: two blocks of one size freed in
 * address order come back newest first, where best fit would give the
 * lower one. Shows that the front, not the allocator, served them. */
static void lifo_probe(void) {
	printf("-- the front serves the block freed last\n");
	cudapool_front_counters c0 = counters0();
	cudapool_stream s = STREAM(0x9000);
	void *a = cudapool_malloc(8192, 0, s), *b = cudapool_malloc(8192, 0, s);
	cudapool_free(a, 8192, 0, s);
	cudapool_free(b, 8192, 0, s);
	void *c = cudapool_malloc(8192, 0, s), *d = cudapool_malloc(8192, 0, s);
	cudapool_front_counters c1 = counters0();
	if (front_expected)
		CHECK(a && b && c == b && d == a, "freed a then b, malloc gives b then a (front on)");
	else
		CHECK(a && b && c && d && c != d, "two mallocs, two blocks (front off)");
	CHECK(c1.hits - c0.hits == (front_expected ? 2u : 0u) && c1.pool_hits == c0.pool_hits,
	      "the front counted %llu hits (expected %d), no pool hit", c1.hits - c0.hits, front_expected ? 2 : 0);
	cudapool_free(c, 8192, 0, s);
	cudapool_free(d, 8192, 0, s);
	/* Counted in the model, so that its peaks and sums stay those of the
	 * library: two mallocs, two frees, twice. */
	blk x = {.p = 0, .stream = 0x9000, .size = 8192, .dev = 0, .counted = 1};
	model_count(&x, +1);
	model_count(&x, +1);
	model_count(&x, -1);
	model_count(&x, -1);
	model_count(&x, +1);
	model_count(&x, +1);
	model_count(&x, -1);
	model_count(&x, -1);
	check_stats(-1);
}

/* The probe's mallocs and frees, counted in the model as the random part's. */
static void *probe_malloc(size_t size, uintptr_t stream) {
	void *p = cudapool_malloc(size, 0, (cudapool_stream)stream);
	blk x = {.size = size, .dev = 0, .counted = 1};
	if (p != NULL)
		model_count(&x, +1);
	return p;
}

static void probe_free(void *p, size_t size) {
	cudapool_free(p, size, 0, NULL);
	blk x = {.size = size, .dev = 0, .counted = 1};
	model_count(&x, -1);
}

static uintptr_t base_of(void *p) {
	size_t seg = 0;
	return (uintptr_t)cudapool_base_allocation(p, &seg);
}

/* During allocate-to-pool phases the front serves a malloc only from the
 * blocks of the pool Go routed the thread's stream to (allocator/routing.go):
 * the LIFO order shows the front served, the segments which pool a block is
 * of. */
static void phase_probe(void) {
	printf("-- during allocate-to-pool phases the front serves the routed pool's blocks\n");
	const uintptr_t s = 0x9000, other = 0x1000; /* bits 8 and 2 of stream_bit */
	const size_t n = 8192;
	const unsigned long long P = 0xA1, Q = 0xA2;
	route_filter fp = {.mask = 8}, fq = {.mask = 8};

	void *x = probe_malloc(n, s); /* a default block, freed during the phase */
	cudapool_clear_error();
	cudapool_begin_allocate_to_pool(0, P, 0, filter_accepts, &fp);
	CHECK(cudapool_last_error() == NULL, "begin_allocate_to_pool({%#llx,0}) with a C filter", P);
	void *a = probe_malloc(n, s), *b = probe_malloc(n, s);
	CHECK(a && b && base_of(a) == base_of(b) && base_of(a) != base_of(x), "two blocks of the pool's segment");
	probe_free(x, n);
	probe_free(a, n);
	probe_free(b, n);
	long calls0 = atomic_load(&filter_calls);
	cudapool_front_counters k0 = counters0();
	void *c = probe_malloc(n, s), *d = probe_malloc(n, s);
	if (front_expected) {
		CHECK(c == b && d == a, "freed a then b during the phase, malloc gives b then a (the front served)");
		CHECK(atomic_load(&filter_calls) == calls0,
		      "the front served from the route Go returned, asking no filter (%ld calls)",
		      atomic_load(&filter_calls) - calls0);
	} else {
		CHECK(c && d && c != d && base_of(c) == base_of(a) && base_of(d) == base_of(a), "two blocks of the pool");
	}
	void *e = probe_malloc(n, s);
	CHECK(e != x && base_of(e) == base_of(a), "the default block freed during the phase is not served to it");
	void *m = probe_malloc(n, other);
	CHECK(m && base_of(m) != base_of(a), "a stream the filter refuses gets a default block");

	/* A newer phase that accepts s too takes precedence; at its end, its
	 * freed block is not served to the older phase's pool. */
	cudapool_begin_allocate_to_pool(0, Q, 0, filter_accepts, &fq);
	void *q = probe_malloc(n, s);
	CHECK(q && base_of(q) != base_of(a) && base_of(q) != base_of(m), "the newest phase's pool");
	probe_free(q, n);
	void *q2 = probe_malloc(n, s);
	CHECK(q2 == q || !front_expected, "the newest phase's block back from the front");
	probe_free(q2, n);
	cudapool_end_allocate_to_pool(0, Q, 0);
	void *r = probe_malloc(n, s);
	CHECK(r && r != q2 && base_of(r) == base_of(a), "after the newer phase's end: the older pool, not its block");

	/* A pool block freed after its phase ended is not served to a default
	 * request. */
	cudapool_end_allocate_to_pool(0, P, 0);
	probe_free(e, n);
	void *g = probe_malloc(n, s);
	CHECK(g && g != e && base_of(g) != base_of(a), "after the phase: a default block, not the pool's");
	CHECK(cudapool_last_error() == NULL, "no error in the probe (%s)", cudapool_last_error() ? cudapool_last_error() : "");
	cudapool_front_counters k1 = counters0();
	CHECK(k1.pool_hits - k0.pool_hits == (front_expected ? 3u : 0u) && k1.hits - k0.hits == k1.pool_hits - k0.pool_hits,
	      "the front counted %llu pool hits of %llu (expected 3 of 3 with the front on)", k1.pool_hits - k0.pool_hits,
	      k1.hits - k0.hits);

	probe_free(c, n);
	probe_free(d, n);
	probe_free(m, n);
	probe_free(r, n);
	probe_free(g, n);
	cudapool_release_pool(0, P, 0);
	cudapool_release_pool(0, Q, 0);
	check_stats(-2);
}

/* ------------------------------------------------------------------ */
/* Part 2: threads. */

#define NWORKERS 4
#define SLOTS 4

static long thread_pairs = 200000; /* mallocs per worker */

/* The blocks live across all threads, keyed by device and pointer: a block
 * handed to two threads at once is found here. Striped spin locks. */
#define STRIPES 1024
#define PER_STRIPE 16
static struct {
	atomic_flag lk;
	int n;
	uintptr_t key[PER_STRIPE];
} live_set[STRIPES];
static atomic_long set_errors;

static unsigned stripe_of(uintptr_t key) { return (unsigned)((key * 0x9E3779B97F4A7C15ULL) >> 54) % STRIPES; }

static void set_lock(unsigned s) {
	while (atomic_flag_test_and_set_explicit(&live_set[s].lk, memory_order_acquire))
		;
}

static void set_unlock(unsigned s) { atomic_flag_clear_explicit(&live_set[s].lk, memory_order_release); }

/* Adds key (1) or removes it (0); counts an error if it was already
 * there, or missing. */
static void set_change(uintptr_t key, int add) {
	unsigned s = stripe_of(key);
	set_lock(s);
	int at = -1;
	for (int i = 0; i < live_set[s].n; i++)
		if (live_set[s].key[i] == key)
			at = i;
	if (add && at < 0 && live_set[s].n < PER_STRIPE)
		live_set[s].key[live_set[s].n++] = key;
	else if (!add && at >= 0)
		live_set[s].key[at] = live_set[s].key[--live_set[s].n];
	else
		atomic_fetch_add(&set_errors, 1);
	set_unlock(s);
}

static uintptr_t key_of(int dev, void *p) { return (uintptr_t)p ^ ((uintptr_t)dev << 62); }

struct worker {
	int id, dev;
	long mallocs, failures;
};

static atomic_int workers_done;

static void *worker(void *arg) {
	struct worker *w = arg;
	static const size_t sizes[] = {512, 4096, 65536, 1536 * KiB, 3 * MiB};
	cudapool_stream s = STREAM(0x7000 + w->id);
	uint64_t x = 0x1234567ULL * (uint64_t)(w->id + 1);
	void *slot[SLOTS] = {0};
	size_t size[SLOTS] = {0};
	/* A disabled library (an internal error) fails every malloc: stop. */
	while (w->mallocs < thread_pairs && w->failures < 1000) {
		x ^= x >> 12;
		x ^= x << 25;
		x ^= x >> 27;
		uint64_t r = x * 2685821657736338717ULL;
		int k = (int)(r % SLOTS);
		if (slot[k] != NULL) {
			set_change(key_of(w->dev, slot[k]), 0);
			if ((r >> 8) & 1)
				cudapool_free(slot[k], size[k], w->dev, s);
			else
				cudapool_free_deferred(slot[k], 0, -1, 0);
			slot[k] = NULL;
			continue;
		}
		size[k] = sizes[(r >> 12) % 5];
		slot[k] = (r >> 16) & 1 ? cudapool_malloc(size[k], w->dev, s) : cudapool_malloc_ctx(size[k], w->dev, s, 0);
		if (slot[k] == NULL) {
			w->failures++;
			continue;
		}
		w->mallocs++;
		set_change(key_of(w->dev, slot[k]), 1);
		/* Now and then another stream uses it: the front lets go of it. */
		if ((r >> 20) % 2048 == 0)
			cudapool_record_stream(slot[k], STREAM(0x7100 + w->id));
	}
	for (int k = 0; k < SLOTS; k++)
		if (slot[k] != NULL) {
			set_change(key_of(w->dev, slot[k]), 0);
			cudapool_free(slot[k], size[k], w->dev, s);
		}
	atomic_fetch_add(&workers_done, 1);
	return NULL;
}

struct observer {
	long reads, bad;
};

static void *observer(void *arg) {
	struct observer *o = arg;
	while (atomic_load(&workers_done) < NWORKERS) {
		for (int d = 0; d < ndev; d++) {
			cudapool_device_stats st;
			if (cudapool_get_device_stats(d, &st) != 0) {
				o->bad++;
				continue;
			}
			o->reads++;
			for (int k = 0; k < 3; k++)
				if (st.allocation[k].current < 0 || st.requested_bytes[k].current < 0 ||
				    st.active[k].current < st.allocation[k].current ||
				    st.active_bytes[k].current < st.requested_bytes[k].current ||
				    st.reserved_bytes[k].current < st.active_bytes[k].current ||
				    st.allocation[k].peak < st.allocation[k].current)
					o->bad++;
		}
		cudapool_empty_cache();
		if (o->reads % 64 == 0)
			cudapool_snapshot_free(cudapool_snapshot_take(0, 0, 0, 0));
	}
	return NULL;
}

static void threads_part(void) {
	printf("-- %d threads x %ld malloc/free through the front, with statistics and empty_cache\n", NWORKERS,
	       thread_pairs);
	cudapool_device_stats before[2], after[2];
	for (int d = 0; d < ndev; d++)
		cudapool_get_device_stats(d, &before[d]);
	struct worker w[NWORKERS];
	struct observer o = {0, 0};
	pthread_t t[NWORKERS], ot;
	for (int i = 0; i < NWORKERS; i++) {
		w[i] = (struct worker){.id = i, .dev = i % ndev};
		pthread_create(&t[i], NULL, worker, &w[i]);
	}
	pthread_create(&ot, NULL, observer, &o);
	long mallocs[2] = {0, 0}, failures = 0;
	for (int i = 0; i < NWORKERS; i++) {
		pthread_join(t[i], NULL);
		mallocs[w[i].dev] += w[i].mallocs;
		failures += w[i].failures;
	}
	pthread_join(ot, NULL);
	cudapool_empty_cache(); /* the record_stream'd blocks' work is seen done */
	CHECK(failures == 0, "no malloc failed");
	CHECK(atomic_load(&set_errors) == 0, "no block was live in two places at once (%ld errors)",
	      (long)atomic_load(&set_errors));
	CHECK(o.bad == 0 && o.reads > 0, "%ld concurrent statistics reads, all consistent", o.reads);
	for (int d = 0; d < ndev; d++) {
		CHECK(cudapool_get_device_stats(d, &after[d]) == 0, "statistics of device %d", d);
		CHECK(after[d].allocation[0].current == 0 && after[d].requested_bytes[0].current == 0,
		      "device %d: all freed: allocation %lld, requested bytes %lld", d, after[d].allocation[0].current,
		      after[d].requested_bytes[0].current);
		long long na = after[d].allocation[0].allocated - before[d].allocation[0].allocated;
		long long nf = after[d].allocation[0].freed - before[d].allocation[0].freed;
		CHECK(na == mallocs[d] && nf == mallocs[d], "device %d: %ld mallocs and frees counted (%lld, %lld)", d,
		      mallocs[d], na, nf);
		printf("cmp threads d%d allocation %lld/%lld requested %lld/%lld\n", d, after[d].allocation[0].current, na,
		       after[d].requested_bytes[0].current,
		       after[d].requested_bytes[0].allocated - before[d].requested_bytes[0].allocated);
	}
}

/* ------------------------------------------------------------------ */
/* Part 3: fixed sequences. */

/* PyTorch's test_graph_memory_stats_and_use_result_after_destroy_graph
 * (test_cuda.py), run first in the process as it is when run alone, through
 * the class path (malloc_ctx, free_deferred): for each size, a tensor a on a
 * side stream s, then a capture on s (its two one-element RNG holders are
 * allocated on s before the pool's phase begins), in which b = a.clone()
 * and five times b = b.clone() + 1; the statistics of the size's pool
 * (PyTorch's kSmallSize rule) must rise by PyTorch's numbers, with the front
 * on or off, during the capture and after the graph's deletion. The large
 * sizes' blocks are not all split: 10 MiB - 512 bytes takes 20 MiB segments
 * whose second block has 1024 bytes to spare (too few to split), so which
 * blocks the front reuses shows in active_bytes. Expandable segments have
 * other expected numbers in PyTorch's test: left out. */
static void *graph_malloc(size_t size, uintptr_t stream) {
	void *p = cudapool_malloc_ctx(size, 0, (cudapool_stream)stream, 0);
	blk x = {.size = size, .dev = 0, .counted = 1};
	if (p != NULL)
		model_count(&x, +1);
	return p;
}

static void graph_free(void *p, size_t size) {
	cudapool_free_deferred(p, 0, -1, 0);
	blk x = {.size = size, .dev = 0, .counted = 1};
	model_count(&x, -1);
}

static void graph_memory_stats(void) {
	printf("-- PyTorch's graph memory statistics test: the capture's deltas (front %s)\n", front_expected ? "on" : "off");
	if (expandable) {
		printf("      (expandable segments: PyTorch expects other numbers; left out)\n");
		return;
	}
	const long long kSmallSize = MiB, kSmallBuffer = 2 * MiB, kLargeBuffer = 20 * MiB, kMinLargeAlloc = 10 * MiB,
	                kRoundLarge = 2 * MiB;
	const long long big = kRoundLarge * ((kMinLargeAlloc + 512 + kRoundLarge - 1) / kRoundLarge);
	const struct {
		long long bytes, segs, reserved, reserved_after;
		int pool; /* 1: small, 2: large */
	} cases[] = {
	    {512, 1, kSmallBuffer, kSmallBuffer, 1},
	    {kSmallSize, 2, 2 * kSmallBuffer, kSmallBuffer, 1},
	    {kSmallSize + 512, 1, kLargeBuffer, kLargeBuffer, 2},
	    {kMinLargeAlloc - 512, 2, 2 * kLargeBuffer, kLargeBuffer, 2},
	    {kMinLargeAlloc + 512, 3, 3 * big, big, 2},
	};
	const uintptr_t s = 0xC000;
	cudapool_empty_cache();
	for (unsigned c = 0; c < sizeof cases / sizeof cases[0]; c++) {
		size_t n = (size_t)cases[c].bytes;
		int k = cases[c].pool;
		/* The small pool's figures also count the RNG holders. */
		long long blocks = k == 1 ? 3 : 1, bytes = cases[c].bytes + (k == 1 ? 1024 : 0);
		unsigned long long uid = 0x600 + c;
		cudapool_clear_error();
		void *a = graph_malloc(n, s);
		cudapool_device_stats pre, post, del;
		cudapool_get_device_stats(0, &pre);
		void *seed = graph_malloc(8, s), *offset = graph_malloc(8, s);
		cudapool_begin_allocate_to_pool(0, 0, uid, cudapool_filter_stream_is, (void *)s);
		CHECK(cudapool_sim_begin_capture((cudapool_stream)s, 0) == 0, "case %u: capture begins on s", c + 1);
		void *b = graph_malloc(n, s);
		for (int i = 0; i < 5; i++) {
			void *t = graph_malloc(n, s), *r = graph_malloc(n, s);
			graph_free(t, n);
			graph_free(b, n);
			b = r;
		}
		CHECK(cudapool_sim_end_capture((cudapool_stream)s) == 0, "case %u: capture ends", c + 1);
		cudapool_end_allocate_to_pool(0, 0, uid);
		cudapool_get_device_stats(0, &post);
		long long d[4] = {post.segment[k].current - pre.segment[k].current,
		                  post.reserved_bytes[k].current - pre.reserved_bytes[k].current,
		                  post.active[k].current - pre.active[k].current,
		                  post.active_bytes[k].current - pre.active_bytes[k].current};
		CHECK(a && b && seed && offset && d[0] == cases[c].segs && d[1] == cases[c].reserved && d[2] == blocks &&
		          d[3] == bytes,
		      "case %u (%lld bytes, %s pool) in capture: segment %+lld (%lld), reserved_bytes %+lld (%lld), active "
		      "%+lld (%lld), active_bytes %+lld (%lld)",
		      c + 1, cases[c].bytes, k == 1 ? "small" : "large", d[0], cases[c].segs, d[1], cases[c].reserved, d[2],
		      blocks, d[3], bytes);
		cudapool_empty_cache();
		/* del g: the generator's holders go, then the graph's pool. */
		graph_free(seed, 8);
		graph_free(offset, 8);
		cudapool_release_pool(0, 0, uid);
		cudapool_empty_cache();
		cudapool_get_device_stats(0, &del);
		long long e[4] = {del.segment[k].current - pre.segment[k].current,
		                  del.reserved_bytes[k].current - pre.reserved_bytes[k].current,
		                  del.active[k].current - pre.active[k].current,
		                  del.active_bytes[k].current - pre.active_bytes[k].current};
		CHECK(e[0] == 1 && e[1] == cases[c].reserved_after && e[2] == 1 && e[3] == cases[c].bytes,
		      "case %u after the graph's deletion: segment %+lld (1), reserved_bytes %+lld (%lld), active %+lld (1), "
		      "active_bytes %+lld (%lld)",
		      c + 1, e[0], e[1], cases[c].reserved_after, e[2], e[3], cases[c].bytes);
		graph_free(a, n);
		graph_free(b, n);
		cudapool_sim_complete_all();
		cudapool_empty_cache();
		CHECK(cudapool_last_error() == NULL, "case %u: no error (%s)", c + 1,
		      cudapool_last_error() ? cudapool_last_error() : "");
	}
	CHECK(cudapool_sim_violations() == 0, "no capture violations");
	check_stats(-3);
}

/* A malloc through the allocator first returns the freed blocks whose
 * other streams' work has finished (PyTorch's process_events); a malloc the
 * front serves must leave the statistics as that one would. */
static void malloc_after_finished_work(void) {
	printf("-- a malloc after another stream's work finished\n");
	cudapool_stream s = STREAM(0xB000), use = STREAM(0xB100);
	cudapool_empty_cache(); /* nothing waits any more */
	cudapool_device_stats st0, st;
	cudapool_get_device_stats(0, &st0);
	void *a = cudapool_malloc(4096, 0, s), *b = cudapool_malloc(8192, 0, s);
	cudapool_record_stream(a, use);
	cudapool_sim_submit(use);
	cudapool_free(a, 4096, 0, s); /* waits for use's work */
	cudapool_sim_complete_all();
	/* b's free goes to Go, so that the malloc is not served in front (which
	 * does not look at events: allocator/front.go), whether or not the
	 * front's cold mode tracks b after the parts before. */
	cudapool_free_ctx(b, 8192, 0, 0);
	void *c = cudapool_malloc(8192, 0, s); /* a is free from here on */
	cudapool_get_device_stats(0, &st);
	long long req = st.requested_bytes[0].current - st0.requested_bytes[0].current,
	          active = st.active[0].current - st0.active[0].current;
	CHECK(c != NULL && req == 8192 && active == 1,
	      "the malloc freed the block whose work finished: requested bytes +%lld (expected +8192), active +%lld (+1)",
	      req, active);
	printf("cmp finished-work requested %lld active %lld\n", req, active);
	cudapool_free(c, 8192, 0, s);
}

/* A free with a context (memory history) goes to Go and skips the front;
 * the front must then not think the block still allocated: a double free
 * is an error, and no block is handed out twice. */
static void ctx_free_then_double_free(void) {
	printf("-- a free with a context, then a double free\n");
	cudapool_stream s = STREAM(0xA000);
	void *p = cudapool_malloc_ctx(4096, 0, s, 0);
	cudapool_free_deferred(p, 0, -1, 7);
	cudapool_device_stats st;
	cudapool_get_device_stats(0, &st); /* performs the queued free */
	long long base = st.allocation[0].current;
	cudapool_clear_error();
	cudapool_free(p, 4096, 0, s);
	CHECK(cudapool_last_error() != NULL, "the double free reports an error");
	void *q = cudapool_malloc(4096, 0, s), *r = cudapool_malloc(4096, 0, s);
	CHECK(q != NULL && r != NULL && q != r, "two mallocs get two blocks (%p, %p)", q, r);
	cudapool_get_device_stats(0, &st);
	CHECK(st.allocation[0].current == base + 2, "and both are counted (%lld, expected %lld)", st.allocation[0].current,
	      base + 2);
	cudapool_free(q, 4096, 0, s);
	if (r != q)
		cudapool_free(r, 4096, 0, s);
}

/* A stream filter or a segment source that calls cudapool: the inner call
 * fails at once with an error saying why, and the outer call returns (the
 * callbacks run with a device lock held, which the inner call would wait
 * for forever). */
static void *inner_result = (void *)1;
static char inner_error[512];

static void note_inner(void *r) {
	inner_result = r;
	const char *e = cudapool_last_error();
	snprintf(inner_error, sizeof inner_error, "%s", e ? e : "");
}

static int f(void *c, cudapool_stream s) {
	(void)c;
	note_inner(cudapool_malloc(512, 0, s));
	return 1;
}

/* Entry points that share their body with others, called from a filter:
 * each refusal names the function called. */
static const char *const named_calls[] = {"cudapool_malloc_ctx", "cudapool_cupy_malloc", "cudapool_free_deferred",
                                          "cudapool_cupy_free", "cudapool_end_allocate_to_pool"};
#define NNAMED (sizeof named_calls / sizeof named_calls[0])
static char named_errors[NNAMED][512];
static void *named_results[2] = {(void *)1, (void *)1};

static void note_named(size_t i) {
	const char *e = cudapool_last_error();
	snprintf(named_errors[i], sizeof named_errors[i], "%s", e ? e : "");
	cudapool_clear_error();
}

static int g(void *c, cudapool_stream s) {
	(void)c;
	named_results[0] = cudapool_malloc_ctx(512, 0, s, 0);
	note_named(0);
	named_results[1] = cudapool_cupy_malloc(NULL, 512, 0);
	note_named(1);
	cudapool_free_deferred((void *)0x1000, 512, 0, 0);
	note_named(2);
	cudapool_cupy_free(NULL, (void *)0x1000, 0);
	note_named(3);
	cudapool_end_allocate_to_pool(0, 3, 3);
	note_named(4);
	return 1;
}

static void *reentrant_source(void *ctx, size_t size, int device, cudapool_stream stream) {
	(void)ctx, (void)size, (void)device;
	note_inner(cudapool_malloc(512, 0, stream));
	return NULL; /* no memory to give */
}

static int reentrant_source_free(void *ctx, void *ptr, size_t size, int device) {
	(void)ctx, (void)ptr, (void)size, (void)device;
	return 0;
}

static void reentrant_callbacks(void) {
	printf("-- a stream filter and a segment source that call cudapool\n");
	cudapool_clear_error();
	cudapool_begin_allocate_to_pool(0, 1, 1, f, NULL);
	void *p = cudapool_malloc(4096, 0, (cudapool_stream)0x42); /* must return */
	CHECK(p != NULL, "the malloc whose filter calls cudapool_malloc returns, with memory (%p)", p);
	CHECK(inner_result == NULL && strstr(inner_error, "cudapool_malloc: called from inside a stream filter") != NULL,
	      "the inner call fails with a clear error (%p, \"%s\")", inner_result, inner_error);
	cudapool_end_allocate_to_pool(0, 1, 1);
	cudapool_free(p, 4096, 0, (cudapool_stream)0x42);
	cudapool_release_pool(0, 1, 1);

	inner_result = (void *)1;
	inner_error[0] = 0;
	cudapool_clear_error();
	CHECK(cudapool_pool_create_or_incref(0, 2, 2) == 0 &&
	          cudapool_pool_set_source(0, 2, 2, reentrant_source, reentrant_source_free, NULL) == 0,
	      "a pool whose segment source calls cudapool");
	cudapool_begin_allocate_to_pool(0, 2, 2, NULL, NULL);
	void *q = cudapool_malloc(4096, 0, (cudapool_stream)0x43); /* must return */
	CHECK(q == NULL && err_has("out of memory"),
	      "the malloc whose source calls cudapool returns, without memory (the source gave none)");
	CHECK(inner_result == NULL &&
	          strstr(inner_error, "cudapool_malloc: called from inside a stream filter or segment source") != NULL,
	      "the inner call fails with a clear error (%p, \"%s\")", inner_result, inner_error);
	cudapool_end_allocate_to_pool(0, 2, 2);
	cudapool_release_pool(0, 2, 2);
	cudapool_release_pool(0, 2, 2);

	cudapool_clear_error();
	cudapool_begin_allocate_to_pool(0, 3, 3, g, NULL);
	void *n = cudapool_malloc(4096, 0, (cudapool_stream)0x44); /* must return */
	CHECK(n != NULL && cudapool_last_error() == NULL, "the malloc whose filter calls five entry points returns (%p)",
	      n);
	CHECK(named_results[0] == NULL && named_results[1] == NULL, "the inner mallocs return NULL");
	for (size_t i = 0; i < NNAMED; i++) {
		char want[128];
		snprintf(want, sizeof want, "%s: called from inside a stream filter or segment source", named_calls[i]);
		CHECK(strncmp(named_errors[i], want, strlen(want)) == 0, "%s refused in its own name (\"%s\")",
		      named_calls[i], named_errors[i]);
	}
	cudapool_end_allocate_to_pool(0, 3, 3);
	cudapool_free(n, 4096, 0, (cudapool_stream)0x44);
	cudapool_release_pool(0, 3, 3);
	cudapool_clear_error();
	void *r = cudapool_malloc(4096, 0, (cudapool_stream)0x42);
	CHECK(r != NULL && cudapool_last_error() == NULL, "after the callbacks, calls work");
	cudapool_free(r, 4096, 0, (cudapool_stream)0x42);
}

/* ------------------------------------------------------------------ */


/* stderr goes to a file until the end, to be checked. */
static void capture_stderr(void) {
	int fd = mkstemp(err_path);
	if (fd < 0)
		return;
	fflush(stderr);
	err_fd = dup(2);
	dup2(fd, 2);
	close(fd);
	printf("      stderr goes to %s until the end\n", err_path);
}

/* Restores stderr and checks the captured text: the reports of the
 * deliberate queued double frees are counted, anything else is shown (on
 * stdout, in order with the checks; the first 20 lines). */
static void check_stderr(void) {
	if (err_fd < 0)
		return;
	fflush(stderr);
	dup2(err_fd, 2);
	close(err_fd);
	FILE *f = fopen(err_path, "r");
	static char line[8192];
	int expected = 0, other = 0, bad = 0;
	while (f != NULL && fgets(line, sizeof line, f) != NULL) {
		int internal = strstr(line, "internal error") != NULL || strstr(line, "front cache") != NULL;
		if (strstr(line, "(a free queued by") != NULL && !internal) {
			expected++;
			continue;
		}
		if (other++ < 20)
			printf("      stderr: %s", line);
		bad += internal;
	}
	if (f != NULL)
		fclose(f);
	printf("      stderr: %d reports of queued bad frees (not shown), %d other lines\n", expected, other);
	CHECK(f != NULL && bad == 0, "stderr reports no internal error and no front-cache failure (%d lines do)", bad);
	unlink(err_path);
}

/* A hang fails the test, with stderr left in its file for a look. */
static void on_alarm(int sig) {
	(void)sig;
	static const char msg[] = "FAIL  timed out: a call into the library does not return; stderr is in ";
	if (write(1, msg, sizeof msg - 1) < 0 || write(1, err_path, strlen(err_path)) < 0 || write(1, "\n", 1) < 0)
		_exit(3);
	_exit(2);
}

int main(int argc, char **argv) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGALRM, on_alarm);
	alarm(60);
	uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 1;
	long nops = argc > 2 ? strtol(argv[2], NULL, 0) : 60000;
	if (argc > 3)
		thread_pairs = strtol(argv[3], NULL, 0);
	trace = getenv("TEST_FRONT_TRACE") != NULL;
	capture_stderr();

	cudapool_expect_announced_captures(); /* else the front never serves */
	cudapool_device_stats st;
	CHECK(cudapool_get_device_stats(0, &st) == 0, "device 0's statistics");
	max_split = st.max_split_size;
	ndev = cudapool_get_device_stats(1, &st) == 0 ? 2 : 1;
	cudapool_clear_error();
	cudapool_snapshot *s = cudapool_snapshot_take(0, 0, 0, 0);
	front_expected = s != NULL && s->config.settings != NULL && strstr(s->config.settings, "front_cache:False") == NULL;
	/* Expandable segments' memory (the default, with or without stitching)
	 * has no 64-byte IPC handle: the random part skips that operation (the
	 * "cmp" lines do not depend on it). */
	expandable = s != NULL && s->config.expandable_segments;
	printf("      settings \"%s\": front %s, %d device(s)\n", s && s->config.settings ? s->config.settings : "?",
	       front_expected ? "on" : "off", ndev);
	cudapool_snapshot_free(s);

	graph_memory_stats();
	lifo_probe();
	phase_probe();
	random_part(seed, nops, 0);
	random_part(seed + 1, nops / 3, 1);
	threads_part();
	malloc_after_finished_work();
	ctx_free_then_double_free();
	reentrant_callbacks();
	check_stderr();

	printf("front cache test: %d passed, %d failed\n", passed, failed);
	return failed != 0;
}
