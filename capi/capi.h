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

/* ---- The front cache (front.c; design in allocator/front.go). ---- */

/* Devices the front serves (others always go to Go) and records per
 * device log. */
#define CP_FRONT_MAXDEV 16
#define CP_FRONT_LOG 64
/* Blocks a device's front may hold across takes (allocator/front.go). */
#define CP_FRONT_HOLD 64

/* Log lengths, and how many blocks are held, read by Go without the lock. */
extern volatile int cp_front_n[CP_FRONT_MAXDEV];
extern volatile int cp_front_held[CP_FRONT_MAXDEV];
/* The largest default-pool block (or block tagged CP_TAG_HOLD_SMALL) held
 * across takes: set by Go when the library loads (capi/front.go: the small
 * pool's limit, pools.SmallSize); until then none is held. */
extern size_t cp_front_hold_max;
/* Where cp_front_take writes a device's log (and the releases of held blocks). */
extern cp_pending_free cp_front_out[CP_FRONT_MAXDEV][CP_FRONT_LOG + CP_FRONT_HOLD];

/* Serves a malloc from the blocks waiting in front, or returns NULL. */
void *cp_front_malloc(size_t size, int dev, uintptr_t stream);
/* Takes the free of a tracked block (1), or leaves it to Go (0), or says
 * the block waits in front already (CP_FRONT_TWICE: a double free, which
 * must reach Go at once). dev must be the block's device, or -1 if
 * any_dev. */
#define CP_FRONT_TWICE 2
int cp_front_free(uintptr_t p, size_t size, int dev, int any_dev);
/* After a malloc through Go: tracks the block at p if Go says so (track:
 * its pool's tag, with CP_TAG_HOLD_SMALL when it may be held across takes
 * only up to cp_front_hold_max, as the default pools' blocks are), else
 * drops any stale entry for p. allocator/front.go's TagHoldSmall. */
#define CP_TAG_HOLD_SMALL (1 << 30)
void cp_front_track(uintptr_t p, size_t size, uintptr_t stream, int dev, int track);
/* Stops tracking p (before record_stream, IPC and frees through Go). */
void cp_front_untrack(uintptr_t p);
/* Moves device dev's log to cp_front_out[dev]; returns its length. With
 * keep (a malloc's take) the blocks whose last free is in the log stay in
 * front, held, as long as the front is on and has room; without, every held
 * block is released too. Called by Go under the device lock. */
size_t cp_front_take(int dev, int keep);
/* Go: whether the front may serve. */
void cp_front_set_on(int on);
/* cudapool_get_front_counters's four counters of device dev; 0 or -1. */
int cp_front_counters(int dev, unsigned long long out[4]);

/* Allocate-to-pool phases as the front routes them (allocator/routing.go):
 * the pool's tag and the phase's stream filter. kind: CP_ROUTE_ALL (every
 * stream; allocator.FilterAll), CP_ROUTE_C (a cudapool_stream_filter a and
 * its context b), CP_ROUTE_STD (the std::function handle a of torch.cpp). */
enum { CP_ROUTE_ALL = 1, CP_ROUTE_C = 2, CP_ROUTE_STD = 3 };
#define CP_FRONT_MAXROUTES 8
typedef struct {
	uintptr_t a, b;
	uint32_t tag;
	uint32_t kind;
} cp_route;
/* Replaces device dev's phases (oldest first); 0 if the front cannot route
 * them (too many, or a device it does not serve). Go calls it under the
 * device lock. */
int cp_front_set_routes(int dev, const cp_route *routes, int n);

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
	CP_FN_MALLOC_CTX = 1,
	CP_FN_CUPY_MALLOC,
	CP_FN_FREE_DEFERRED,
	CP_FN_TORCH_FREE,
	CP_FN_CUPY_FREE,
	CP_FN_END_ALLOCATE_TO_POOL,
	CP_FN_TORCH_END_ALLOCATE_TO_POOL,
	CP_FN_RELEASE_POOL,
	CP_FN_TORCH_RELEASE_POOL,
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
extern uintptr_t cpgo_malloc(size_t size, int device, uintptr_t stream, int *track);
extern uintptr_t cpgo_torch_malloc(size_t size, int device, uintptr_t stream, cp_pending_free *frees, size_t nfrees,
                                   int *track);
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
                                        uintptr_t ctx);
extern void cpgo_torch_begin_allocate_to_pool(int device, unsigned long long a, unsigned long long b,
                                              uintptr_t handle);
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
extern long long cpgo_sim_violations(void);

/* ---- Go exports for PyTorch's CUDAAllocator interface (torchabi.go). ---- */
extern uintptr_t cpgo_malloc_ctx(size_t size, int device, uintptr_t stream, unsigned long long ctx,
                                 cp_pending_free *frees, size_t nfrees, int *track, int fn);
extern void cpgo_expect_announced(void);
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
extern int cpgo_allocation_info(uintptr_t ptr, size_t *size, int *device);
extern int cpgo_set_caching(int on);
extern int cpgo_caching(void);

/* Segment sources of MemPools (cudapool.c): call the C function pointers. */
uintptr_t cp_call_segment_alloc(uintptr_t fn, uintptr_t ctx, size_t size, int device, uintptr_t stream);
int cp_call_segment_free(uintptr_t fn, uintptr_t ctx, uintptr_t ptr, size_t size, int device);

/* ---- C helpers (cudapool.c). ---- */

/* Records msg (len bytes, not NUL-terminated) as this thread's last error. */
void cp_set_error(const char *msg, size_t len);

/* Non-zero in a forked child; then also records the fork error. */
int cp_forked_child(void);

/* Calls a C stream filter. */
int cp_call_c_filter(uintptr_t filter, uintptr_t ctx, uintptr_t stream);

/* ---- C++ helpers (torch.cpp). ---- */

/* Calls the heap copy of a std::function<bool(cudaStream_t)>; an exception
 * it throws counts as "no". */
int cp_call_std_filter(uintptr_t handle, uintptr_t stream);

/* Destroys the heap copy. */
void cp_delete_std_filter(uintptr_t handle);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* CUDAPOOL_CAPI_H */
