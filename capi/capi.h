// SPDX-License-Identifier: Apache-2.0
/*
 * capi.h - declarations shared by the Go, C and C++ parts of libcudapool.so.
 * Internal: nothing here is exported (see exports.map).
 */
#ifndef CUDAPOOL_CAPI_H
#define CUDAPOOL_CAPI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Nothing declared here is part of the library's interface: hidden
 * visibility keeps these symbols out of the dynamic symbol table however the
 * library is linked. (The Go exports get it from these declarations, which
 * cgo's own definitions follow.) */
#pragma GCC visibility push(hidden)

/* A free PyTorch made that waits in the queue (cudapool.c), or an
 * operation of the front cache's log (front.c) as Go replays it. Laid out
 * as allocator.PendingFree (Go reads it in place; main.go checks the layout
 * at compile time). */
typedef struct {
	intptr_t device; /* -1: unknown, found by the allocator */
	uintptr_t ptr;
	size_t size;
	unsigned long long ctx;   /* the free's context (memory history), 0: none */
	unsigned char op;         /* CP_OP_*: allocator.FrontOp */
	unsigned long long count; /* CP_OP_CYCLES: how many */
} cp_pending_free;

/* allocator.FrontOp's values (capi's tests check they agree). */
enum { CP_OP_FREE = 0, CP_OP_FREE_STATS = 1, CP_OP_REUSE = 2, CP_OP_CYCLES = 3, CP_OP_RELEASE = 4, CP_OP_HOLD = 5 };

/* ---- The front cache (front.c; protocol in FRONT.md). ---- */

/* Devices the front serves (others always go to Go) and records per
 * device log. */
#define CP_FRONT_MAXDEV 16
#define CP_FRONT_LOG 64
/* The most blocks a device's front can hold across takes (the policy's
 * hold is at most this). */
#define CP_FRONT_HOLD 64

/* Log lengths, and how many blocks are held, read by Go without the lock. */
extern volatile int cp_front_n[CP_FRONT_MAXDEV];
extern volatile int cp_front_held[CP_FRONT_MAXDEV];
/* Where cp_front_take writes a device's log (and the releases of held blocks). */
extern cp_pending_free cp_front_out[CP_FRONT_MAXDEV][CP_FRONT_LOG + CP_FRONT_HOLD];

/* Go's policy block (allocator.FrontPolicy): all the front may do. Until
 * Go pushes one, the front is off. */
typedef struct {
	uint32_t on;   /* it may log frees and serve mallocs */
	uint32_t hold; /* blocks a device may hold across takes (at most CP_FRONT_HOLD) */
	/* Cold mode: the window, the first skip and how often it doubles (0
	 * window: no cold mode). */
	uint32_t cold_window, cold_skip, cold_max_shift;
	/* Per device: the generation of its allocate-to-pool phases, 0 while
	 * none is under way (a route Go returned names one). */
	uint32_t phases[CP_FRONT_MAXDEV];
} cp_front_policy;
/* Replaces the policy (NULL: all off); Go calls it with its policy mutex,
 * perhaps also a device lock, held. */
void cp_front_set_policy(const cp_front_policy *p);
/* The policy in force (capi's tests). */
void cp_front_get_policy(cp_front_policy *out);

/* Go's answer to a malloc through it (allocator.Tracking). */
#define CP_TAG_HOLD (1u << 30)
typedef struct {
	/* 0: not to be tracked; else the block's pool tag (1: the default
	 * pools), with CP_TAG_HOLD if it may be held across takes. */
	uint32_t tag;
	/* Non-zero: the malloc's stream, on the calling thread, routes to the
	 * pool of this tag while the device's phases are of generation
	 * phases. */
	uint32_t route, phases;
} cp_track;

/* Serves a malloc from the blocks waiting in front, or returns NULL. */
void *cp_front_malloc(size_t size, int dev, uintptr_t stream);
/* Takes the free of a tracked block (1), or leaves it to Go (0; the front
 * forgets the block), or says the block waits in front already
 * (CP_FRONT_TWICE: a double free, which must reach Go at once). flags:
 * CP_FREE_ANY_DEV, dev may be -1 (unknown); CP_FREE_NOW, the free must
 * reach Go now (it has a context to record or an error to return). */
#define CP_FRONT_TWICE 2
#define CP_FREE_ANY_DEV 1
#define CP_FREE_NOW 2
int cp_front_free(uintptr_t p, size_t size, int dev, int flags);
/* After a malloc through Go (cp_malloc_go): applies Go's answer t for the
 * block at p of size bytes (p 0: the malloc failed). */
void cp_front_track(uintptr_t p, size_t size, uintptr_t stream, int dev, cp_track t);
/* Forgets p (Go's invalidation: Go gave the block other streams' uses,
 * shared it with another process, or freed or allocated it behind the
 * front's back). */
void cp_front_invalidate(uintptr_t p);
/* Moves device dev's log to cp_front_out[dev]; returns its length. With
 * keep (a malloc's take) the blocks whose last free is in the log stay in
 * front, held, as long as the front is on, Go let them be held and there
 * is room; without, every held block is released too. Called by Go under
 * the device lock. */
size_t cp_front_take(int dev, int keep);
/* cudapool_get_front_counters's four counters of device dev; 0 or -1. */
int cp_front_counters(int dev, unsigned long long out[4]);

/* ---- Tags (cudapool.c) ----
 *
 * The id of the tag on top of the calling thread's stack (0: none), which
 * every malloc reads: one initial-exec TLS load. The rest of the stack is
 * on the heap; Go alone knows what an id means (allocator/tags.go). */
extern __thread uint32_t cp_tag_cur __attribute__((tls_model("initial-exec")));

/* ---- The malloc every entry point makes (cudapool.c) ----
 *
 * A malloc without a context or a tag tries the front, then goes to Go
 * with the queued frees and the thread's tag, and applies Go's answer:
 * cp_malloc_go. (A context is for memory history, which the front's log
 * cannot carry; a tagged block is Go's alone.) fn (CP_FN_*) names the
 * public function called, for Go's errors and the wording of out of
 * memory. cp_malloc_go reads the tag again rather than being passed it:
 * a value kept across the front's call costs the hit path a saved
 * register. */
void *cp_malloc_go(size_t size, int device, uintptr_t stream, unsigned long long ctx, int fn);
static inline void *cp_malloc(size_t size, int device, uintptr_t stream, unsigned long long ctx, int fn) {
	if ((ctx | cp_tag_cur) == 0) {
		void *p = cp_front_malloc(size, device, stream);
		if (p != 0)
			return p;
	}
	return cp_malloc_go(size, device, stream, ctx, fn);
}

/* ---- Entry points refused (cudapool.c) ----
 *
 * In a forked child (the Go runtime does not survive fork), and inside a
 * stream filter or a segment source: those run with Go's device lock held,
 * and a call back into the library would wait for it forever. cp_refused
 * records why in the thread's last error and returns 1. */
extern volatile int cp_forked;
extern __thread int cp_in_callback __attribute__((tls_model("initial-exec")));
int cp_refuse(const char *fn);
static inline int cp_refused(const char *fn) {
	if (__builtin_expect(cp_forked | cp_in_callback, 0))
		return cp_refuse(fn);
	return 0;
}
/* Around every call of a user's filter or segment source. */
static inline void cp_callback_enter(void) { cp_in_callback++; }
static inline void cp_callback_leave(void) { cp_in_callback--; }

/* The spin lock of the front and of the free queue: short critical
 * sections, never held across a call into Go; yields while a holder that
 * was descheduled keeps it. */
#ifndef __cplusplus
#include <stdatomic.h>
/* The waiting, when the lock is held (front.c). */
void cp_spin_lock_wait(atomic_int *w);
/* Inline: taking a free lock is one exchange, releasing it one store (each
 * malloc and free of the class path takes two or three). */
static inline void cp_spin_lock(atomic_int *w) {
	if (__builtin_expect(atomic_exchange_explicit(w, 1, memory_order_acquire), 0))
		cp_spin_lock_wait(w);
}
static inline void cp_spin_unlock(atomic_int *w) { atomic_store_explicit(w, 0, memory_order_release); }
#endif

/* The queue's capacity: the most frees one call hands to Go. */
#define CP_FREEQ_CAP 64

/* The number of queued frees: read without the lock as a hint. */
extern volatile int cp_freeq_n;

/* Moves up to cap queued frees to out and returns how many. */
size_t cp_take_frees(cp_pending_free *out, size_t cap);

/* The public functions that share a Go export, numbered so that the export
 * can name the one its caller called in an error (capi/main.go,
 * entryNames). */
enum {
	CP_FN_MALLOC = 1,
	CP_FN_MALLOC_CTX,
	CP_FN_CUPY_MALLOC,
	CP_FN_TORCH_MALLOC,
	CP_FN_FREE_DEFERRED,
	CP_FN_TORCH_FREE,
	CP_FN_CUPY_FREE,
	CP_FN_END_ALLOCATE_TO_POOL,
	CP_FN_TORCH_END_ALLOCATE_TO_POOL,
	CP_FN_RELEASE_POOL,
	CP_FN_TORCH_RELEASE_POOL,
	CP_FN_EXPECT_ANNOUNCED_CAPTURES,
	CP_FN_CUPY_MALLOC_RAISING,
};

/* The functions that have queued frees, as bits 1 << CP_FN_*: a queued free
 * that fails later is reported with their names. */
extern volatile unsigned cp_freeq_from;

/* Which operations need a context (CUDAPOOL_GATHER_*), written by Go when
 * history settings change, read by cudapool_gather_mask without a Go call. */
extern volatile unsigned cp_gather_mask;

/* This thread's last out-of-memory failure (cudapool_last_oom), written by
 * Go through cp_set_oom on the failing thread; a device of -1 says the last
 * failure was not out of memory. */
void cp_set_oom(int device, size_t size, size_t device_total, size_t device_free);

/* ---- Go exports (exports.go), called by the C and C++ wrappers. Pointers
 * and streams cross as uintptr_t. ---- */
extern void cpgo_free_batch(cp_pending_free *frees, size_t nfrees, int fn);
extern void cpgo_free(uintptr_t ptr, size_t size, int device, uintptr_t stream);
extern void cpgo_init(int device_count);
/* Writes the version numbers and returns the ABI version (version.go). */
extern int cpgo_version(int *major, int *minor, int *patch);
extern void cpgo_empty_cache(void);
extern void cpgo_set_memory_fraction(double fraction, int device);
extern uintptr_t cpgo_base_allocation(uintptr_t ptr, size_t *size);
extern void cpgo_record_stream(uintptr_t ptr, uintptr_t stream);
extern void cpgo_begin_allocate_to_pool(int device, unsigned long long a, unsigned long long b, uintptr_t filter,
                                        uintptr_t ctx, uint32_t tag);
extern void cpgo_torch_begin_allocate_to_pool(int device, unsigned long long a, unsigned long long b,
                                              uintptr_t handle, uint32_t tag);
extern void cpgo_end_allocate_to_pool(int device, unsigned long long a, unsigned long long b, int fn);
extern void cpgo_release_pool(int device, unsigned long long a, unsigned long long b, int fn);
extern char *cpgo_memory_stats_json(int device);
extern char *cpgo_snapshot_json(void);
extern void cpgo_reset_peak_stats(int device);
extern void cpgo_reset_accumulated_stats(int device);
extern int cpgo_configure(char *conf);
extern int cpgo_sim_begin_capture(uintptr_t stream, int mode);
extern int cpgo_sim_end_capture(uintptr_t stream);
extern void cpgo_sim_submit(uintptr_t stream);
extern void cpgo_sim_complete_all(void);
extern void cpgo_sim_destroy_stream(uintptr_t stream);
extern long long cpgo_sim_violations(void);
extern int cpgo_sim_set_pidfd_errors(int open_errno, int getfd_errno);
extern int cpgo_sim_write(int device, uintptr_t ptr, void *src, size_t n);
extern int cpgo_sim_read(int device, uintptr_t ptr, void *dst, size_t n);

/* ---- Go exports for PyTorch's CUDAAllocator interface (torchabi.go). ---- */
extern uintptr_t cpgo_malloc_ctx(size_t size, int device, uintptr_t stream, unsigned long long ctx,
                                 cp_pending_free *frees, size_t nfrees, cp_track *out, int fn, uint32_t tag);
extern int cpgo_expect_announced(int fn);
extern int cpgo_free_ctx(uintptr_t ptr, size_t size, int device, unsigned long long ctx);
extern int cpgo_configure_update(char *conf);
extern int cpgo_get_device_stats(int device, void *out);
extern int cpgo_cache_info(int device, size_t *largest);
extern double cpgo_get_memory_fraction(int device);
extern int cpgo_empty_cache_ctx(unsigned long long ctx);
extern int cpgo_pool_create_or_incref(int device, unsigned long long a, unsigned long long b);
extern int cpgo_pool_use_count(int device, unsigned long long a, unsigned long long b);
extern int cpgo_pool_set_no_split(int device, unsigned long long a, unsigned long long b);
extern int cpgo_pool_set_use_on_oom(int device, unsigned long long a, unsigned long long b, int use);
extern int cpgo_empty_pool(int device, unsigned long long a, unsigned long long b);
extern int cpgo_pool_set_source(int device, unsigned long long a, unsigned long long b, uintptr_t alloc,
                                uintptr_t free_fn, uintptr_t ctx);
extern unsigned long long cpgo_checkpoint_pool(int device, unsigned long long a, unsigned long long b);
extern void cpgo_checkpoint_release(unsigned long long cp);
extern int cpgo_checkpoint_restore(int device, unsigned long long cp, void *out);
extern int cpgo_pool_check_live(int device, unsigned long long a, unsigned long long b, void *expected, size_t n);
extern int cpgo_record_history(int enabled, size_t max_entries, int when, int clear, char *skip);
extern int cpgo_history_enabled(void);
extern size_t cpgo_live_contexts(unsigned long long *out, size_t cap);
extern void cpgo_set_user_metadata(char *md);
extern char *cpgo_get_user_metadata(void);
extern void cpgo_push_compile_context(char *c);
extern void cpgo_pop_compile_context(void);
extern int cpgo_record_annotation(int device, void *keys, void *values, size_t n);
extern void *cpgo_snapshot_take(int by_pool, unsigned long long a, unsigned long long b, int traces);
extern int cpgo_ipc_handle(uintptr_t ptr, unsigned char *handle, size_t *offset, int *device);
extern uintptr_t cpgo_ipc_open(int device, unsigned char *handle);
extern int cpgo_ipc_close(uintptr_t ptr);
extern int cpgo_ipc_share(uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len, size_t *offset, int *device);
extern uintptr_t cpgo_ipc_open_shared(int device, unsigned char *buf, size_t len);
extern int cpgo_allocation_info(uintptr_t ptr, size_t *size, int *device);
extern int cpgo_set_caching(int on);
extern int cpgo_caching(void);

/* ---- Go exports for tags, pause and resume (tags.go). ---- */
extern uint32_t cpgo_tag_id(char *name);
extern int cpgo_pause(char *tag, int keep);
extern int cpgo_resume(char *tag);
extern long long cpgo_paused_bytes(int device);
extern int cpgo_release_host_memory(void);

/* Segment sources of MemPools (cudapool.c): call the C function pointers. */
uintptr_t cp_call_segment_alloc(uintptr_t fn, uintptr_t ctx, size_t size, int device, uintptr_t stream);
int cp_call_segment_free(uintptr_t fn, uintptr_t ctx, uintptr_t ptr, size_t size, int device);

/* ---- C helpers (cudapool.c). ---- */

/* Records msg (len bytes, not NUL-terminated) as this thread's last error. */
void cp_set_error(const char *msg, size_t len);

/* Non-zero in a forked child; then also records the fork error (for the
 * entry points a callback may call: cp_refused refuses more). */
int cp_forked_child(void);

/* Calls a C stream filter (for Go's router; cp_callback_enter). */
int cp_call_c_filter(uintptr_t filter, uintptr_t ctx, uintptr_t stream);

/* ---- C++ helpers (torch.cpp). ---- */

/* Calls the heap copy of a std::function<bool(cudaStream_t)> (for Go's
 * router; cp_callback_enter); an exception it throws counts as "no". */
int cp_call_std_filter(uintptr_t handle, uintptr_t stream);

/* Destroys the heap copy. */
void cp_delete_std_filter(uintptr_t handle);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* CUDAPOOL_CAPI_H */
