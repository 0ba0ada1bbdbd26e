// SPDX-License-Identifier: Apache-2.0
/*
 * front.c - the front cache, C half: capi/FRONT.md is its protocol (entry
 * states, log records, which side owns which rule, lock ranks) and
 * allocator/front.go the Go half. In short: Go marks the blocks this file
 * may track; a free of a tracked block is logged here and the block waits,
 * still allocated to Go; a malloc of the same requested size, stream and
 * device takes it back (logged as a reuse); Go takes each device's log under
 * its device lock before anything else and replays it. Everything else goes
 * to Go.
 *
 * This file decides nothing about the allocator. What it may do is Go's
 * policy block (cp_front_set_policy: the enable bit, how many blocks a
 * device may hold, cold mode's numbers, each device's allocate-to-pool
 * phases), what it tracks is Go's answer to each malloc (cp_front_track:
 * the block's pool tag, whether it may be held, and the pool the malloc's
 * stream routed to), and what it must forget Go says too
 * (cp_front_invalidate). During phases it serves a malloc only from the pool
 * Go routed the same thread's last malloc on that stream to, within the same
 * phases (a per-thread table of Go's answers, route_of): it never calls a
 * stream filter.
 *
 * One spin lock guards everything here. It is held for a few dozen
 * instructions and never across a call out of this file, and Go takes it
 * only through the functions below, so the lock order is: device lock (Go),
 * then this.
 *
 * The table of tracked blocks is an open-addressing hash (linear probing,
 * deletion by backward shift) over a fixed array of entries; when it is
 * full a block is simply not tracked. A device's waiting blocks are linked
 * in lists hashed by (size, stream), newest first.
 *
 * A malloc's take (cp_front_take with keep) leaves the blocks still waiting
 * in front, HELD, up to the policy's hold per device, if Go marked them
 * holdable (CP_TAG_HOLD); any other take releases them. Which blocks Go marks,
 * and why, is in allocator/front.go ("Held blocks").
 *
 * The log of a device holds at most CP_FRONT_LOG records. A reuse that
 * follows the free of the same block is folded into that record (a cycle),
 * so a loop of malloc+free of one size never fills it. When it is full a
 * free goes to Go and a malloc misses; Go then takes the log.
 *
 * Cold mode: when, over the last cold_window blocks a device's front took or
 * gave back, more than twice as many were freed for real (never reused) as
 * were reused, the next cold_skip blocks of that device are not tracked;
 * each further verdict in a row doubles the skip, up to cold_skip <<
 * cold_max_shift, and a window that finds reuse resets it. The numbers are
 * Go's (allocator/front.go, the policy's), the sampling is here.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "capi.h"

#define ENTS (1 << 13)  /* tracked blocks, all devices together */
#define SLOTS (1 << 14) /* hash slots: at most half full */
#define BUCKETS 64      /* reuse lists per device */

/* Entry states (capi/FRONT.md, "Entry states"). LIVE: tracked, allocated
 * to the user. FREED: waiting in front, its free in the device's log.
 * HELD: waiting in front across takes, its free already counted by Go, to
 * which it is still allocated. RELEASING: within a take, a waiting block Go
 * frees for real. DEAD: forgotten while its device's log still names it;
 * recycled by the device's next take, so that a record never names another
 * block. 0: unused. */
enum { LIVE = 1, FREED = 2, DEAD = 3, HELD = 4, RELEASING = 5 };
enum { R_FREE = 1, R_REUSE, R_CYCLE };

typedef struct {
	uintptr_t ptr, stream;
	size_t size;      /* the requested size */
	int32_t dev;
	int32_t next;     /* FREED, HELD: next in its reuse list; unused, DEAD: next free or dead entry (index + 1, 0: none) */
	int32_t lastfree; /* FREED: the index of its free in the log */
	uint32_t tag;     /* its pool's (1: the default pools) */
	uint8_t state;
	uint8_t inlog; /* a record of its device's log names it */
	uint8_t hold;  /* Go let it be held across takes (CP_TAG_HOLD) */
} ent;

typedef struct {
	int32_t kind;
	int32_t ent; /* index + 1 */
	uint64_t count;
} rec;

typedef struct {
	rec log[CP_FRONT_LOG];
	int32_t bucket[BUCKETS]; /* heads of the reuse lists (index + 1, 0: empty) */
	int32_t dead;            /* DEAD entries (index + 1), linked by next */
	uint32_t reused, wasted; /* blocks reused, and freed for real, in this window */
	uint32_t cold_streak;    /* cold verdicts in a row */
	/* Blocks still to leave untracked (cold mode). Counted down without the
	 * lock by a plain load and store, not a read-modify-write: every malloc
	 * through Go of a cold device passes here, and the two locked
	 * instructions there took 4% of the C benchmark's mixed pair's samples
	 * (1% now, on a development machine). Two mallocs racing may count one
	 * block, which lengthens the stretch by one; a store racing with a reset
	 * or a verdict may revive what is left of the old stretch. Either only
	 * changes which blocks the front tracks (and the counter of untracked
	 * blocks by as much), never what an operation does. */
	atomic_int cold;
	int32_t gone[CP_FRONT_LOG + CP_FRONT_HOLD]; /* a take's RELEASING entries */
	/* cudapool_get_front_counters: hits, of which pool hits, and cold
	 * verdicts; cold_granted, the blocks the verdicts set to leave
	 * untracked, less those a reset cancelled: the blocks left untracked
	 * are cold_granted less what cold still counts. */
	unsigned long long hits, pool_hits, cold_verdicts, cold_granted;
} devfront;

/* A hash slot: the pointer is kept here too, so that probing reads only
 * the slots. */
typedef struct {
	uintptr_t ptr;
	int32_t e; /* index + 1; 0: empty */
} slot;

/* All guarded by lock_word, except where said. */
static ent ents[ENTS];
static slot slots[SLOTS];
static int32_t free_ents; /* head of the unused entries (index + 1) */
static int32_t used_ents; /* entries ever handed out: [used_ents, ENTS) never were */
static devfront devs[CP_FRONT_MAXDEV];
static cp_front_policy pol; /* Go's policy block (cp_front_set_policy) */
static atomic_int lock_word;

/* Log lengths and held blocks, written under the lock and read by Go without
 * it (a hint). */
volatile int cp_front_n[CP_FRONT_MAXDEV];
volatile int cp_front_held[CP_FRONT_MAXDEV];
/* Where cp_front_take writes a device's log for Go (guarded by Go's device lock). */
cp_pending_free cp_front_out[CP_FRONT_MAXDEV][CP_FRONT_LOG + CP_FRONT_HOLD];
/* pol.on, also read without the lock as a hint (and again under it). */
static atomic_int front_on;
/* How many blocks are tracked: read without the lock to skip the lock when
 * there are none. */
static atomic_int tracked;

/* ---- Go's routes, per thread ----
 *
 * During allocate-to-pool phases a malloc on a stream goes to the pool of
 * the newest phase whose stream filter accepts the stream. Go alone decides
 * that (graphs.Router.Route): a malloc through Go returns, with its block,
 * the pool's tag and the phases' generation (cp_track's route, phases), and
 * this table keeps the answer for the calling thread and stream, so that
 * the thread's later mallocs on the stream find their pool here. The table
 * is per thread because a filter may answer by thread (use_mem_pool's
 * accepts its thread's allocations); only a yes is kept (a stream may join
 * a capture later, and a no must be asked again); a new generation (any
 * begin or end) makes every entry stale. ROUTES entries, reused round
 * robin; allocated on a thread's first route (the library's thread-local
 * storage is static, which every library loaded with dlopen shares) and
 * freed when the thread exits. */
#define ROUTES 4
typedef struct {
	struct {
		uintptr_t stream;
		uint32_t phases, tag;
	} e[ROUTES];
	unsigned next;
} routes_t;

static __thread routes_t *my_routes __attribute__((tls_model("initial-exec")));
static pthread_key_t routes_key;
static pthread_once_t routes_once = PTHREAD_ONCE_INIT;

static void routes_free(void *r) {
	if (my_routes == r)
		my_routes = NULL;
	free(r);
}

static void routes_key_init(void) { pthread_key_create(&routes_key, routes_free); }

/* route_of is the tag of the pool a malloc of this thread on stream routes
 * to during the phases of generation phases, or 0 if Go has not said. */
static inline uint32_t route_of(uintptr_t stream, uint32_t phases) {
	routes_t *r = my_routes;
	if (r == NULL)
		return 0;
	for (int i = 0; i < ROUTES; i++)
		if (r->e[i].phases == phases && r->e[i].stream == stream)
			return r->e[i].tag;
	return 0;
}

/* note_route keeps Go's answer for this thread (no lock: the table is the
 * thread's own). */
static void note_route(uintptr_t stream, uint32_t phases, uint32_t tag) {
	routes_t *r = my_routes;
	if (r == NULL) {
		r = calloc(1, sizeof *r);
		if (r == NULL)
			return; /* no table: Go routes this thread's mallocs */
		pthread_once(&routes_once, routes_key_init);
		pthread_setspecific(routes_key, r);
		my_routes = r;
	}
	int i = 0;
	while (i < ROUTES && !(r->e[i].stream == stream && r->e[i].phases == phases))
		i++;
	if (i == ROUTES)
		i = (int)(r->next++ % ROUTES);
	r->e[i].stream = stream;
	r->e[i].phases = phases;
	r->e[i].tag = tag;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

void cp_spin_lock_wait(atomic_int *w) {
	do {
		for (int spins = 0; atomic_load_explicit(w, memory_order_relaxed);) {
			if (++spins < 128) {
				cpu_relax();
			} else {
				sched_yield(); /* the holder may have been descheduled */
				spins = 0;
			}
		}
	} while (atomic_exchange_explicit(w, 1, memory_order_acquire));
}

static void lock(void) { cp_spin_lock(&lock_word); }
static void unlock(void) { cp_spin_unlock(&lock_word); }

static inline uint32_t slot_of(uintptr_t p) {
	return (uint32_t)(((uint64_t)p * 0x9E3779B97F4A7C15ull) >> 47) & (SLOTS - 1);
}

static inline uint32_t bucket_of(size_t size, uintptr_t stream) {
	return (uint32_t)((((uint64_t)size ^ ((uint64_t)stream << 7)) * 0x9E3779B97F4A7C15ull) >> 58) & (BUCKETS - 1);
}

/* find returns the slot holding p, or -1. */
static int32_t find(uintptr_t p) {
	for (uint32_t i = slot_of(p);; i = (i + 1) & (SLOTS - 1)) {
		if (slots[i].e == 0)
			return -1;
		if (slots[i].ptr == p)
			return (int32_t)i;
	}
}

/* forget removes the entry in slot i from the table. An entry its device's
 * log still names waits, DEAD, for the device's next take: the log's
 * records read the entry's pointer. */
static void forget(uint32_t i) {
	int32_t e = slots[i].e;
	ent *x = &ents[e - 1];
	if (x->inlog) {
		x->state = DEAD;
		x->next = devs[x->dev].dead;
		devs[x->dev].dead = e;
	} else {
		x->state = 0;
		x->next = free_ents;
		free_ents = e;
	}
	atomic_fetch_sub_explicit(&tracked, 1, memory_order_relaxed);
	/* Backward-shift deletion: move up every later entry of the run whose
	 * home slot is not between the hole and it. */
	slots[i] = (slot){0, 0};
	for (uint32_t j = (i + 1) & (SLOTS - 1); slots[j].e != 0; j = (j + 1) & (SLOTS - 1)) {
		uint32_t k = slot_of(slots[j].ptr);
		int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
		if (!stays) {
			slots[i] = slots[j];
			slots[j] = (slot){0, 0};
			i = j;
		}
	}
}

/* cold_reset ends device d's cold stretch and starts a fresh window. The
 * lock is held. */
static void cold_reset(devfront *d) {
	d->cold_granted -= (unsigned)atomic_exchange_explicit(&d->cold, 0, memory_order_relaxed);
	d->cold_streak = 0;
	d->reused = d->wasted = 0;
}

void cp_front_set_policy(const cp_front_policy *p) {
	cp_front_policy next = {0};
	if (p != NULL)
		next = *p;
	if (next.hold > CP_FRONT_HOLD)
		next.hold = CP_FRONT_HOLD;
	lock();
	for (int dev = 0; dev < CP_FRONT_MAXDEV; dev++)
		if (next.phases[dev] != 0 && pol.phases[dev] == 0) {
			/* Phases begin (a capture): a new pattern, which a cold
			 * verdict on what came before (model set-up, weights
			 * converted and freed) says nothing about. Sample it
			 * afresh: at most one window. */
			cold_reset(&devs[dev]);
		}
	pol = next;
	atomic_store_explicit(&front_on, next.on != 0, memory_order_relaxed);
	unlock();
}

void cp_front_get_policy(cp_front_policy *out) {
	lock();
	*out = pol;
	unlock();
}

/* invalidate forgets p if it is LIVE (a waiting block's free is in the log,
 * and Go sees it there). The lock is held. */
static void invalidate(uintptr_t p) {
	int32_t i = find(p);
	if (i >= 0 && ents[slots[i].e - 1].state == LIVE)
		forget((uint32_t)i);
}

void cp_front_invalidate(uintptr_t p) {
	if (atomic_load_explicit(&tracked, memory_order_relaxed) == 0)
		return;
	lock();
	invalidate(p);
	unlock();
}

void cp_front_track(uintptr_t p, size_t size, uintptr_t stream, int dev, cp_track t) {
	if (__builtin_expect(t.route != 0, 0))
		note_route(stream, t.phases, t.route);
	if (p == 0)
		return;
	if (t.tag == 0 || (unsigned)dev >= CP_FRONT_MAXDEV) {
		/* An untracked block at p: drop a stale entry, should one be left. */
		cp_front_invalidate(p);
		return;
	}
	atomic_int *cold = &devs[dev].cold;
	int c = atomic_load_explicit(cold, memory_order_relaxed);
	if (c > 0) {
		/* Cold: not tracked. */
		atomic_store_explicit(cold, c - 1, memory_order_relaxed);
		cp_front_invalidate(p); /* a stale entry, should one be left */
		return;
	}
	lock();
	int32_t i = find(p), e;
	if (i >= 0) {
		if (ents[slots[i].e - 1].state != LIVE) { /* cannot happen: Go never hands out a waiting block */
			unlock();
			return;
		}
		/* A stale entry (Go freed p without the front seeing it): a new
		 * block, perhaps of another device, takes a new entry. */
		forget((uint32_t)i);
	}
	if (free_ents != 0) {
		e = free_ents;
		free_ents = ents[e - 1].next;
	} else if (used_ents < ENTS) {
		e = ++used_ents;
	} else {
		unlock(); /* full: this block is not tracked */
		return;
	}
	uint32_t s = slot_of(p);
	while (slots[s].e != 0)
		s = (s + 1) & (SLOTS - 1);
	slots[s] = (slot){p, e};
	ents[e - 1] = (ent){.ptr = p, .stream = stream, .size = size, .dev = dev, .tag = t.tag & ~CP_TAG_HOLD,
	                    .hold = (t.tag & CP_TAG_HOLD) != 0, .state = LIVE};
	atomic_fetch_add_explicit(&tracked, 1, memory_order_relaxed);
	unlock();
}

int cp_front_free(uintptr_t p, size_t size, int dev, int flags) {
	if (atomic_load_explicit(&tracked, memory_order_relaxed) == 0)
		return 0;
	lock();
	int32_t i = find(p);
	if (i < 0) {
		unlock();
		return 0;
	}
	int32_t e = slots[i].e;
	ent *x = &ents[e - 1];
	if (x->state != LIVE) {
		/* Freed twice: Go must see it now (it takes the log, then reports
		 * the second free), before a malloc could hand the block out. */
		unlock();
		return CP_FRONT_TWICE;
	}
	int n = cp_front_n[x->dev];
	if (!atomic_load_explicit(&front_on, memory_order_relaxed) || (size != 0 && size != x->size) ||
	    (dev != x->dev && !(dev == -1 && (flags & CP_FREE_ANY_DEV))) || n == CP_FRONT_LOG || (flags & CP_FREE_NOW)) {
		/* Go frees it (and reports a wrong size or device). */
		forget((uint32_t)i);
		unlock();
		return 0;
	}
	devfront *d = &devs[x->dev];
	d->log[n] = (rec){.kind = R_FREE, .ent = e};
	x->inlog = 1;
	x->state = FREED;
	x->lastfree = n;
	int32_t *head = &d->bucket[bucket_of(x->size, x->stream)];
	x->next = *head;
	*head = e;
	__atomic_store_n(&cp_front_n[x->dev], n + 1, __ATOMIC_RELEASE);
	unlock();
	return 1;
}

int cp_front_counters(int dev, unsigned long long out[4]) {
	if ((unsigned)dev >= CP_FRONT_MAXDEV)
		return -1;
	lock();
	devfront *d = &devs[dev];
	out[0] = d->hits;
	out[1] = d->pool_hits;
	unsigned long long left = (unsigned)atomic_load_explicit(&d->cold, memory_order_relaxed);
	out[2] = d->cold_granted > left ? d->cold_granted - left : 0;
	out[3] = d->cold_verdicts;
	unlock();
	return 0;
}

void *cp_front_malloc(size_t size, int dev, uintptr_t stream) {
	if (!atomic_load_explicit(&front_on, memory_order_relaxed) || (unsigned)dev >= CP_FRONT_MAXDEV ||
	    (cp_front_n[dev] == 0 && cp_front_held[dev] == 0))
		return NULL; /* no block waits on this device */
	lock();
	devfront *d = &devs[dev];
	int n = cp_front_n[dev];
	int32_t *link = &d->bucket[bucket_of(size, stream)], e;
	uint32_t want = 0; /* the routed pool's tag, looked up at the first candidate */
	for (e = *link; e != 0; link = &ents[e - 1].next, e = *link) {
		ent *x = &ents[e - 1];
		if (x->size != size || x->stream != stream)
			continue;
		if (want == 0) {
			uint32_t phases = pol.phases[dev];
			want = phases == 0 ? 1 : route_of(stream, phases);
			if (want == 0) {
				e = 0; /* Go has not routed this thread's stream in these phases */
				break;
			}
		}
		if (x->tag == want)
			break;
	}
	if (e == 0 || !atomic_load_explicit(&front_on, memory_order_relaxed)) {
		unlock();
		return NULL;
	}
	if (n > 0 && d->log[n - 1].kind == R_FREE && d->log[n - 1].ent == e) {
		/* Freed just before: free and reuse fold into a cycle. */
		if (n > 1 && d->log[n - 2].kind == R_CYCLE && d->log[n - 2].ent == e) {
			d->log[n - 2].count++;
			n--;
		} else {
			d->log[n - 1] = (rec){.kind = R_CYCLE, .ent = e, .count = 1};
		}
	} else if (n < CP_FRONT_LOG) {
		d->log[n++] = (rec){.kind = R_REUSE, .ent = e};
	} else {
		unlock(); /* full: a miss; Go takes the log */
		return NULL;
	}
	ent *x = &ents[e - 1];
	*link = x->next;
	x->next = 0;
	if (x->state == HELD)
		__atomic_store_n(&cp_front_held[dev], cp_front_held[dev] - 1, __ATOMIC_RELAXED);
	x->inlog = 1; /* a held block's free is not in the log: its reuse is the record that names it */
	x->state = LIVE;
	d->reused++;
	d->hits++;
	d->pool_hits += x->tag > 1;
	__atomic_store_n(&cp_front_n[dev], n, __ATOMIC_RELEASE);
	unlock();
	return (void *)x->ptr;
}

size_t cp_front_take(int dev, int keep) {
	if ((unsigned)dev >= CP_FRONT_MAXDEV)
		return 0;
	lock();
	devfront *d = &devs[dev];
	int n = cp_front_n[dev], out_n = n, ngone = 0;
	int held = cp_front_held[dev];
	keep = keep && atomic_load_explicit(&front_on, memory_order_relaxed);
	cp_pending_free *out = cp_front_out[dev];
	for (int i = 0; i < n; i++) {
		rec r = d->log[i];
		ent *x = &ents[r.ent - 1];
		cp_pending_free f = {.ptr = x->ptr, .device = dev};
		x->inlog = 0;
		switch (r.kind) {
		case R_FREE:
			if (x->state == FREED && x->lastfree == i) {
				/* Its last free, and no reuse followed: the block stays
				 * in front, held (Go counts the free and keeps the block
				 * allocated), or Go frees it for real and it leaves. */
				if (keep && x->hold && held < (int)pol.hold) {
					f.op = CP_OP_HOLD;
					x->state = HELD;
					held++;
				} else {
					f.op = CP_OP_FREE;
					x->state = RELEASING;
					d->gone[ngone++] = r.ent;
					d->wasted++;
				}
			} else {
				f.op = CP_OP_FREE_STATS;
			}
			break;
		case R_REUSE:
			f.op = CP_OP_REUSE;
			break;
		default:
			f.op = CP_OP_CYCLES;
			f.count = r.count;
		}
		out[i] = f;
	}
	/* Every waiting block of the device is now HELD or RELEASING (a FREED
	 * one had its free in this log): the reuse lists keep the held ones,
	 * in order, and without keep these are released too. */
	for (int b = 0; b < BUCKETS; b++) {
		int32_t *link = &d->bucket[b];
		for (int32_t e = *link; e != 0; e = *link) {
			ent *x = &ents[e - 1];
			if (x->state == HELD && keep) {
				link = &x->next;
				continue;
			}
			*link = x->next;
			if (x->state == HELD) {
				out[out_n++] = (cp_pending_free){.ptr = x->ptr, .device = dev, .op = CP_OP_RELEASE};
				x->state = RELEASING;
				d->gone[ngone++] = e;
				held--;
				d->wasted++;
			}
		}
	}
	/* The released blocks leave the table (forget reuses their links). */
	for (int k = 0; k < ngone; k++)
		forget((uint32_t)find(ents[d->gone[k] - 1].ptr));
	while (d->dead != 0) {
		int32_t e = d->dead;
		d->dead = ents[e - 1].next;
		ents[e - 1].state = 0;
		ents[e - 1].next = free_ents;
		free_ents = e;
	}
	if (pol.cold_window != 0 && d->reused + d->wasted >= pol.cold_window) {
		if (d->wasted > 2 * d->reused) {
			/* (What a stretch still under way had left is cancelled.) */
			int skip = (int)(pol.cold_skip << d->cold_streak);
			d->cold_granted -= (unsigned)atomic_exchange_explicit(&d->cold, skip, memory_order_relaxed);
			d->cold_granted += (unsigned)skip;
			d->cold_verdicts++;
			if (d->cold_streak < pol.cold_max_shift)
				d->cold_streak++;
		} else {
			d->cold_streak = 0;
		}
		d->reused = d->wasted = 0;
	}
	__atomic_store_n(&cp_front_held[dev], held, __ATOMIC_RELAXED);
	__atomic_store_n(&cp_front_n[dev], 0, __ATOMIC_RELEASE);
	unlock();
	return (size_t)out_n;
}
