// SPDX-License-Identifier: Apache-2.0
/*
 * cudapool.h - the C ABI of libcudapool.so, a CUDA caching memory allocator.
 *
 * Usable from C and C++ without the CUDA headers. A cudapool_stream is the
 * same pointer type as CUDA's cudaStream_t and CUstream, so CUDA streams can
 * be passed directly; NULL is the legacy default stream.
 *
 * Errors: a function that fails records a message for the calling thread,
 * read with cudapool_last_error(). The message stays until the next failure
 * on the same thread (like errno, success does not clear it), so check the
 * return value first. Functions never crash on bad input (unknown or freed
 * pointers, bad devices, NULL arguments, bad configuration strings): they
 * fail and record why.
 *
 * Threads: every function may be called from many threads at once.
 *
 * fork: in a child process created by fork() (PyTorch's DataLoader workers),
 * every function returns at once and fails ("called in a forked child"):
 * CUDA memory cannot be used after fork.
 *
 * Environment, read on the first call:
 *   CUDAPOOL_BACKEND      "cuda" (default): the NVIDIA driver (libcuda.so.1);
 *                         "sim": a simulated device, for testing without a GPU.
 *   CUDAPOOL_SIM_DEVICES  simulated devices (default 1).
 *   CUDAPOOL_SIM_MEMORY   bytes per simulated device (default 80 GiB); a
 *                         suffix K, M, G or T (powers of 1024) is allowed.
 *   CUDAPOOL_CONF, else PYTORCH_CUDA_ALLOC_CONF: the configuration, in
 *                         PYTORCH_CUDA_ALLOC_CONF syntax (see cudapool_configure).
 * If initialization fails (no driver), every call fails with the reason,
 * which is also printed once on stderr. An invalid configuration in the
 * environment fails the first call with the reason (printed once on
 * stderr); cudapool then runs with the default configuration, and
 * cudapool_configure can apply a corrected one.
 *
 * The library holds a Go runtime, built from the unmodified Go toolchain; it
 * reads its own variables from the environment the process started with
 * (setting them later, e.g. in os.environ, has no effect):
 *   GOMAXPROCS            how many threads may run Go code at once. Unset, the
 *                         library raises the Go default (the usable CPUs) to at
 *                         least 8, so that each thread calling in finds a free
 *                         scheduler slot (P) and one is left for the keeper;
 *                         set, it is used as given.
 *   GODEBUG, GOGC, GOMEMLIMIT  as for any Go program.
 * The keeper: while calls come, one goroutine naps in short system calls so
 * that the runtime's monitor thread stays out of its deep sleep, and a call
 * after a pause in C does not pay to wake it (about 10 us on a GPU host). It
 * parks after about a second without calls, stays off with GOMAXPROCS 1, and
 * the configuration option warm_runtime:False turns it off.
 * docs/go-runtime-proposal.md describes what the runtime costs a C caller.
 */
#ifndef CUDAPOOL_H
#define CUDAPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#include <functional>
#include <utility>
extern "C" {
#endif

/* The version of this header; VERSION at the repository root holds it. A
 * program can compare it with cudapool_version() of the library it runs
 * with. CUDAPOOL_ABI_VERSION changes when programs built against an earlier
 * header can no longer use the library (a function removed or changed);
 * adding functions leaves it alone. */
#define CUDAPOOL_VERSION_MAJOR 0
#define CUDAPOOL_VERSION_MINOR 1
#define CUDAPOOL_VERSION_PATCH 0
#define CUDAPOOL_VERSION_STRING "0.1.0"
#define CUDAPOOL_ABI_VERSION 1

/* The library's version, "MAJOR.MINOR.PATCH" (static storage: do not free).
 * Works without a device and before any other call; NULL only in a forked
 * child that never asked before the fork. */
const char *cudapool_version(void);

/* The library's ABI version (CUDAPOOL_ABI_VERSION of the header it was built
 * with); -1 only where cudapool_version() returns NULL. */
int cudapool_abi_version(void);

/* A CUDA stream (cudaStream_t / CUstream). */
typedef struct CUstream_st *cudapool_stream;

/* Allocates size bytes on device for use on stream. Returns NULL on failure
 * (out of memory, bad device, absurd size), and for size 0 (without error). */
void *cudapool_malloc(size_t size, int device, cudapool_stream stream);

/* Frees ptr. size is the size it was allocated with, or 0 if unknown; stream
 * and device are those it was allocated with (device is checked, stream is
 * ignored). Freeing NULL does nothing; an unknown or already freed pointer
 * fails without effect. */
void cudapool_free(void *ptr, size_t size, int device, cudapool_stream stream);

/* Initializes the allocator (otherwise done on the first call). PyTorch calls
 * it with its device count; a count that differs from the backend's is
 * recorded as an error. Pass -1 to skip the check. A configuration that
 * cudapool refused (CUDAPOOL_CONF, PYTORCH_CUDA_ALLOC_CONF) is recorded as
 * its error on every call, as PyTorch refuses to start CUDA with a bad
 * PYTORCH_CUDA_ALLOC_CONF; the other functions run with the default
 * configuration. */
void cudapool_init(int device_count);

/* Returns every cached, unused segment to the driver (torch.cuda.empty_cache). */
void cudapool_empty_cache(void);

/* Limits the memory cudapool reserves on device to fraction (0..1) of it. */
void cudapool_set_memory_fraction(double fraction, int device);

/* Returns the base of the segment that contains ptr and writes its size to
 * *size; NULL (and an error) if ptr is not in any segment or an argument is
 * NULL. With expandable segments (the default) the "segment" is the
 * contiguous mapped range around ptr (what snapshots show as one segment). */
void *cudapool_base_allocation(void *ptr, size_t *size);

/* Notes that stream uses the allocation ptr: after cudapool_free(ptr), the
 * memory is not reused until the work stream had queued by then completes. */
void cudapool_record_stream(void *ptr, cudapool_stream stream);

/* Answers whether an allocation on stream belongs to a pool's capture
 * (non-zero: yes). It is called during a malloc with the device's lock
 * held: a cudapool function it calls fails at once (cudapool_last_error
 * says why). Once it says yes for a stream on a thread it must keep saying
 * yes until the pool's phase ends: the allocator may remember a yes for the
 * thread and stream until the device's next begin or end (a no it asks
 * again, since a stream may join a capture later). */
typedef int (*cudapool_stream_filter)(void *ctx, cudapool_stream stream);

/* Routes the allocations on device whose stream filter accepts (NULL filter:
 * all streams) to the private pool {pool_a, pool_b} (a CUDA graph's pool),
 * until cudapool_end_allocate_to_pool. Begin again with the same id (after
 * its end) to share the pool. {0,0} is the default pool and is refused. */
void cudapool_begin_allocate_to_pool(int device, unsigned long long pool_a, unsigned long long pool_b,
                                     cudapool_stream_filter filter, void *ctx);

/* Stops routing allocations to the pool. Memory freed into the pool stays
 * reserved for it until it is released. */
void cudapool_end_allocate_to_pool(int device, unsigned long long pool_a, unsigned long long pool_b);

/* Drops one holder of the pool (each begin adds one); at none, its cached
 * memory goes back to the driver at the next empty_cache or out-of-memory
 * retry. */
void cudapool_release_pool(int device, unsigned long long pool_a, unsigned long long pool_b);

/* torch.cuda.memory_stats(device) as a JSON object (the 122 keys, flattened
 * as "allocated_bytes.all.current", ...). Free with cudapool_string_free.
 * NULL on failure. */
char *cudapool_memory_stats_json(int device);

/* torch.cuda.memory._snapshot() as JSON: {"segments", "device_traces",
 * "allocator_settings", "external_annotations"}. Traces are recorded only with
 * the record_history:N option. Free with cudapool_string_free. */
char *cudapool_snapshot_json(void);

/* Frees a string returned by cudapool. NULL is ignored. */
void cudapool_string_free(char *s);

void cudapool_reset_peak_stats(int device);
void cudapool_reset_accumulated_stats(int device);

/* Replaces the configuration, in PYTORCH_CUDA_ALLOC_CONF syntax: comma
 * separated key:value pairs (max_split_size_mb, roundup_power2_divisions,
 * garbage_collection_threshold, max_non_split_rounding_mb,
 * large_segment_size_mb, expandable_segments, release_lock_on_cudamalloc,
 * per_process_memory_fraction, graph_capture_record_stream_reuse; cudapool's
 * own record_history:N, debug_checks:True, free_set:segfit|treap|sorted,
 * expandable_map_unit_mb:N, stitch:True|False, stitch_sync:False,
 * stitch_chunk_mb:N, front_cache:False, warm_runtime:False); keys left out
 * take their defaults. stitch_sync:False keeps stitching from synchronizing
 * the device in a malloc that would raise reserved memory above its peak,
 * to take other streams' idle pages. stitch_chunk_mb:N (a multiple of 2,
 * default 2) maps the default large pool in N MiB allocations that move
 * whole: fewer driver calls per byte moved, and the large pool no longer
 * trades pages with the small one.
 * Defaults that differ from PyTorch's: expandable segments with stitching
 * (expandable_segments:True means the same; free physical pages move to
 * where a request needs them, for less memory reserved:
 * docs/fragmentation.md). stitch:False keeps expandable segments without
 * stitching; expandable_segments:False gives ordinary segments (one
 * cuMemAlloc each, PyTorch's default) and turns stitching off too. Memory of
 * either kind is shared with cudapool_ipc_share. stitch:True with
 * expandable_segments:False is an error in either order; so is, in
 * cudapool_configure_update, one of the two contradicting the other in force
 * (from CUDAPOOL_CONF or an earlier update): name both to change both. Where
 * the driver has no virtual memory management API, growth falls back to
 * ordinary segments: quietly by default, with a note on stderr only if the
 * configuration named expandable_segments:True or stitch:True.
 * Keys are case-sensitive, as in PyTorch. The other keys PyTorch accepts are
 * accepted and have no effect: the pinned-memory ones (PyTorch's host
 * allocator reads them), throw_on_cudamalloc_oom, expandable_segments_reserve
 * and expandable_segments_reserve_by_class (the last three noted once on
 * stderr when set), and the ROCm spellings release_lock_on_hipmalloc and
 * pinned_use_hip_host_register.
 * Returns 0 on success. Returns -1, leaving the configuration in force as it
 * was, for a key that neither cudapool nor PyTorch knows (the last error
 * names it, suggests the right case, and lists the known keys), an invalid
 * value (the last error names the key), a NULL conf, or when cudapool could
 * not initialize (the last error says why). Text quoted from conf in an
 * error is cut to its first 200 bytes and its length.
 * CUDAPOOL_CONF and PYTORCH_CUDA_ALLOC_CONF follow the same rules when the
 * first call reads them. A configuration refused there makes that first
 * call, whichever it is, fail with the reason (as PyTorch throws at its
 * first allocation), printed once on stderr too; cudapool then runs with the
 * default configuration, so later calls work and cudapool_configure can
 * apply a corrected one. */
int cudapool_configure(const char *conf);

/* This thread's last failure message, or NULL if nothing has failed on this
 * thread. Valid until the thread's next failing cudapool call; at most 4095
 * bytes. A message starts with the name of the function the caller called
 * ("cudapool_free: pointer 0x... was not allocated by cudapool ..."). A free
 * queued by cudapool_free_deferred, cudapool_torch_free or
 * cudapool_cupy_free that fails is reported by the call that performs it,
 * under that call's name, saying which of those queued frees. Out of memory
 * is told in cudapool's words (what was asked, what the device has free,
 * what cudapool holds, what to try with CUDAPOOL_CONF) except by PyTorch's
 * entry points, cudapool_torch_malloc and cudapool_malloc_ctx (which
 * cudapool's C++ allocator class calls), whose message is PyTorch's own. */
const char *cudapool_last_error(void);

/* Clears this thread's last error, so that a call whose result does not
 * say whether it failed can be checked with cudapool_last_error() after it. */
void cudapool_clear_error(void);

/* ---- PyTorch's CUDAAllocator interface ----
 *
 * What cudapool's C++ allocator class (python/cudapool/csrc) needs beyond
 * malloc and free. Every function records a message on failure, as above.
 * A "context" is an opaque non-zero id the caller chose for a captured
 * stack (memory history); 0 means none. */

/* cudapool_malloc, after performing the frees queued with
 * cudapool_free_deferred / cudapool_torch_free (one call into the allocator
 * for both), recording context as the allocation's context. */
void *cudapool_malloc_ctx(size_t size, int device, cudapool_stream stream, unsigned long long context);

/* Queues the free of ptr (size 0: unknown; device -1: unknown, found by
 * cudapool), performed by the next call into the library; context is the
 * free's context. Failures are reported on stderr. */
void cudapool_free_deferred(void *ptr, size_t size, int device, unsigned long long context);

/* Frees ptr at once, as cudapool_free, but size 0 and device -1 may be
 * unknown; context is the free's context. 0 on success, -1 on failure. */
int cudapool_free_ctx(void *ptr, size_t size, int device, unsigned long long context);

/* Declares that every CUDA graph capture will be announced with
 * begin_allocate_to_pool (PyTorch does), so malloc need not ask the driver
 * whether its stream captures. */
void cudapool_expect_announced_captures(void);

/* Applies the keys of conf on top of the configuration in force (as
 * torch.cuda.memory._set_allocator_settings does); 0 = ok, -1 = error
 * (configuration unchanged). The stitch and expandable_segments keys named
 * by earlier configurations count as named (see cudapool_configure). */
int cudapool_configure_update(const char *conf);

/* One statistic, and torch.cuda.memory_stats()'s values of one device;
 * arrays are indexed all (0), small pool (1), large pool (2). */
typedef struct {
	long long current, peak, allocated, freed;
} cudapool_stat;

typedef struct {
	cudapool_stat allocation[3], segment[3], active[3], inactive_split[3], allocated_bytes[3], reserved_bytes[3],
	    active_bytes[3], inactive_split_bytes[3], requested_bytes[3];
	long long num_alloc_retries, num_ooms;
	cudapool_stat oversize_allocations, oversize_segments;
	long long num_sync_all_streams, num_device_alloc, num_device_free, max_split_size;
} cudapool_device_stats;

/* 0 on success, -1 on failure. */
int cudapool_get_device_stats(int device, cudapool_device_stats *out);

/* The front cache's counters and the simulated device's controls are in
 * cudapool_testing.h: for tests and benchmarks, not part of the stable ABI. */

/* The largest block cudapool could hand out on device without asking the
 * driver, PyTorch's cacheInfo: *largest is raised to the largest cached free
 * block; a *largest of 0 first becomes the device's free memory. */
int cudapool_cache_info(int device, size_t *largest);

/* The memory fraction in force on device (1 when none was set); -1 on
 * failure. */
double cudapool_get_memory_fraction(int device);

/* Returns the cached, unused segments to the driver, as cudapool_empty_cache,
 * recording context on the segment frees. */
int cudapool_empty_cache_ctx(unsigned long long context);

/* ---- Memory pools (torch.cuda.MemPool) ---- */

/* Creates the private pool {a,b} on device with one holder, or adds one. */
int cudapool_pool_create_or_incref(int device, unsigned long long a, unsigned long long b);
/* The pool's holders (0 once released by all); -1 on failure, e.g. for a
 * pool that does not exist. */
int cudapool_pool_use_count(int device, unsigned long long a, unsigned long long b);
/* Blocks of the pool are never split (each allocation its own segment). */
int cudapool_pool_set_no_split(int device, unsigned long long a, unsigned long long b);
/* The pool serves allocations that would otherwise fail out of memory. */
int cudapool_pool_set_use_on_oom(int device, unsigned long long a, unsigned long long b, int use);
/* Returns the pool's cached, unused segments (device -1: on every device). */
int cudapool_empty_pool(int device, unsigned long long a, unsigned long long b);

/* A pool's segment source (torch.cuda.MemPool(allocator=...)): called with an
 * allocator lock held, in relaxed capture mode; a cudapool function they
 * call fails at once (cudapool_last_error says why). alloc returns NULL when
 * out of memory; free returns 0 on success. */
typedef void *(*cudapool_segment_alloc_fn)(void *ctx, size_t size, int device, cudapool_stream stream);
typedef int (*cudapool_segment_free_fn)(void *ctx, void *ptr, size_t size, int device);
int cudapool_pool_set_source(int device, unsigned long long a, unsigned long long b, cudapool_segment_alloc_fn alloc,
                             cudapool_segment_free_fn free_fn, void *ctx);

/* ---- Private-pool checkpoints (torch.compile's CUDA graph trees) ---- */

/* Records the block layout of pool {a,b}; returns a checkpoint id, 0 on
 * failure. Release it with cudapool_checkpoint_release. */
unsigned long long cudapool_checkpoint_pool(int device, unsigned long long a, unsigned long long b);
void cudapool_checkpoint_release(unsigned long long checkpoint);

typedef struct {
	size_t nfreed;
	void **freed; /* blocks the restore freed */
	size_t nallocated;
	void **allocated; /* blocks allocated after the restore: the checkpoint's */
} cudapool_restore_result;

/* Restores the checkpoint's pool to its layout: every block allocated in the
 * pool now is freed, and the checkpoint's allocated blocks are allocated
 * again at their addresses. Fills *out (release with
 * cudapool_restore_result_free); 0 on success, -1 on failure. */
int cudapool_checkpoint_restore(int device, unsigned long long checkpoint, cudapool_restore_result *out);
void cudapool_restore_result_free(cudapool_restore_result *r);

/* 1 if the blocks allocated in pool {a,b} are exactly expected[0..n), 0 if
 * not, -1 on failure. */
int cudapool_pool_check_live(int device, unsigned long long a, unsigned long long b, void *const *expected, size_t n);

/* ---- Memory history ---- */

/* Which operations the caller should gather a context for (bits). */
#define CUDAPOOL_GATHER_ALLOC 1u
#define CUDAPOOL_GATHER_FREE 2u
#define CUDAPOOL_GATHER_RELEASE 4u
unsigned cudapool_gather_mask(void);

/* PyTorch's recordHistory: when is RecordContext (0 never, 1 state, 2 alloc,
 * 3 all); skip_actions is a comma-separated list of trace actions not to
 * record ("" or NULL: none). 0 on success, -1 on failure. */
int cudapool_record_history(int enabled, size_t max_entries, int when, int clear, const char *skip_actions);
int cudapool_history_enabled(void);
/* Writes up to cap context ids still referenced; returns how many exist. */
size_t cudapool_live_contexts(unsigned long long *out, size_t cap);
void cudapool_set_user_metadata(const char *metadata);
/* The user metadata; free with cudapool_string_free. */
char *cudapool_get_user_metadata(void);
void cudapool_push_compile_context(const char *context);
void cudapool_pop_compile_context(void);
int cudapool_record_annotation(int device, const char *const *keys, const char *const *values, size_t n);

/* ---- Snapshots with PyTorch's structure ---- */

typedef struct {
	size_t size, requested_size;
	int gc_counter, allocated, active;
	unsigned long long context;
} cudapool_block_info;

typedef struct {
	int device, is_large, is_expandable;
	size_t address, total_size, requested_size, allocated_size, active_size;
	uintptr_t stream;
	unsigned long long pool_a, pool_b, context;
	size_t first_block, nblocks; /* its blocks in cudapool_snapshot.blocks */
} cudapool_segment_info;

/* action: PyTorch's TraceEntry::Action (0 alloc, 1 free_requested,
 * 2 free_completed, 3 segment_alloc, 4 segment_free, 5 segment_map,
 * 6 segment_unmap, 7 snapshot, 8 oom; for oom, addr is the device's free
 * memory). */
typedef struct {
	int action, device;
	size_t addr, size;
	uintptr_t stream;
	unsigned long long pool_a, pool_b, context;
	long long time_us;
	const char *compile_context, *user_metadata;
} cudapool_trace_entry;

typedef struct {
	int device;
	long long time_us;
	size_t n;
	const char *const *keys, *const *values;
} cudapool_annotation;

typedef struct {
	double garbage_collection_threshold;
	size_t max_split_size;
	int expandable_segments, release_lock_on_malloc;
	const char *settings;
	size_t nroundup;
	const size_t *roundup_power2_divisions;
} cudapool_config_info;

typedef struct {
	size_t nsegments;
	cudapool_segment_info *segments;
	size_t nblocks;
	cudapool_block_info *blocks;
	size_t ndevices, ntraces;
	cudapool_trace_entry *traces; /* every device's, oldest first per device */
	size_t nannotations;
	cudapool_annotation *annotations;
	cudapool_config_info config;
} cudapool_snapshot;

/* The segments of every pool (by_pool 0) or of pool {a,b}, and the traces if
 * include_traces. NULL on failure. Free with cudapool_snapshot_free. */
cudapool_snapshot *cudapool_snapshot_take(int by_pool, unsigned long long a, unsigned long long b, int include_traces);
void cudapool_snapshot_free(cudapool_snapshot *s);

/* Caching on (1, the default) or off (0: every malloc is a driver
 * allocation of its own, freed at once; PyTorch's caching_allocator_enable). */
int cudapool_set_caching(int on);
/* 1 when caching is on, 0 when off. */
int cudapool_caching(void);

/* The requested size and device of the allocation ptr; 0 or -1. */
int cudapool_allocation_info(void *ptr, size_t *size, int *device);

/* ---- Out of memory and CUDA IPC ---- */

typedef struct {
	int device;
	size_t size;         /* the request, rounded */
	size_t device_total; /* the device's memory, or the memory fraction's limit */
	size_t device_free;
} cudapool_oom_info;

/* This thread's last out-of-memory failure: 0 and *out filled, or -1. */
int cudapool_last_oom(cudapool_oom_info *out);

/* The CUDA IPC handle (cudaIpcMemHandle_t, 64 bytes) of the segment holding
 * the allocation ptr, and ptr's offset in it; 0 or -1. Memory in
 * expandable segments (the default, and a tag's memory) has no such handle:
 * share it with cudapool_ipc_share; with expandable_segments:False it is in
 * ordinary segments, which this handle names. */
int cudapool_ipc_handle(void *ptr, unsigned char handle[64], size_t *offset, int *device);
/* Opens another process's handle on device; one handle opened twice maps
 * once. NULL on failure. */
void *cudapool_ipc_open(int device, const unsigned char handle[64]);
/* Drops one cudapool_ipc_open or cudapool_ipc_open_shared of ptr (the
 * address they returned); the last closes the mapping. */
int cudapool_ipc_close(void *ptr);

/* PyTorch's shareable handle of the memory of the allocation ptr (what
 * torch.multiprocessing sends for a CUDA tensor; docs/interop.md, "CUDA
 * IPC between processes"), for another process to open with cudapool_ipc_open_shared or with
 * PyTorch, cudapool's or native: a version byte (2), a type byte, then
 *   'c'  the 64-byte cudaIpcMemHandle_t of ptr's ordinary segment;
 *   'e'  for memory in an expandable segment (the default, stitched or
 *        not, and a tag's memory): a 24-byte header (this process's id, the size of
 *        each physical allocation, their number), then each physical
 *        allocation under ptr as a file descriptor of this process (4
 *        bytes) or, where the system supports them, a fabric handle (64).
 * Writes it to buf if it fits in cap bytes; *len is its length either way,
 * so a call with too small a buffer (buf may be NULL) fails having set
 * *len: call again with *len bytes. *offset is ptr's offset from the start
 * of the memory the handle names, *device ptr's device. 0 or -1.
 * Errors (cudapool_last_error): ptr is not the start of an allocation;
 * an allocation of a paused tag (a shared allocation keeps its tag from
 * pausing until it is freed: cudapool_pause); memory that cannot be shared (a driver without the sharing API, or a
 * block over physical allocations of two sizes, which PyTorch's handle
 * cannot describe: a range mapped short near the memory limit); an export
 * the driver refuses. Each physical allocation exported as a file
 * descriptor holds one descriptor until its memory is released, so the
 * process's limit of open files (RLIMIT_NOFILE) bounds how much memory can
 * be exported at once; the error says how many are held and the limit.
 * The same memory gives the same bytes every time. Keep the allocation
 * allocated until the other process has opened the handle (PyTorch keeps
 * a shared tensor's memory until its receivers let go): descriptors stay
 * valid while it is, whatever else this process allocates, frees, stitches
 * or empties. */
int cudapool_ipc_share(void *ptr, void *buf, size_t cap, size_t *len, size_t *offset, int *device);
/* Maps the memory another process shared (a handle of len bytes from
 * cudapool_ipc_share or PyTorch's shareIpcHandle, or a bare 64-byte
 * cudaIpcMemHandle_t) on device and returns its address, where the
 * handle's offset starts. Memory already open here returns the same
 * address and counts one more reference; close each open with
 * cudapool_ipc_close. An expandable segment's handle is imported by
 * taking the exporter's descriptors (pidfd_open, pidfd_getfd) and maps
 * exactly the bytes it covers, so address space grows with the memory
 * opened, not with the device's size per import. NULL on failure
 * (cudapool_last_error): bytes that are no handle, or a handle of a
 * PyTorch newer than this cudapool reads; a kernel without pidfd_open
 * (Linux 5.3) or pidfd_getfd (5.6); no ptrace permission to the exporter
 * (same user, and kernel.yama.ptrace_scope 0, or 1 with the exporter a
 * descendant of this process or naming it with PR_SET_PTRACER; or
 * CAP_SYS_PTRACE); an exporter that has exited or closed the memory; the
 * message says which. */
void *cudapool_ipc_open_shared(int device, const void *buf, size_t len);

/* ---- Pause and resume by tag ----
 *
 * A tag names memory that can be given back to the driver and brought
 * back at the same addresses: an inference engine's weights, KV cache and
 * CUDA graphs, paused while a trainer uses the same GPU, and resumed for
 * the next generation, its graphs replayed without being captured again.
 *
 * Every allocation a thread makes while a tag is pushed belongs to the tag,
 * whichever entry point it goes through (cudapool_malloc, the PyTorch
 * class, cudapool_cupy_malloc, Numba's plugin): the tag stack is the
 * thread's, read on the malloc path. So does the private pool of a graph
 * capture (or an allocate-to-pool phase, such as use_mem_pool) begun by a
 * thread under the tag (a pool keeps the tag it was first begun under, and
 * cannot be begun under another), and the automatic pool of a capture
 * nobody announced, met by a tagged malloc. A tag's memory comes from
 * ranges of its own on each device, CUDA virtual memory whatever
 * expandable_segments says, so pausing one tag never touches another's
 * memory. While caching is off (cudapool_set_caching(0)), allocations go
 * to the driver and belong to no tag.
 *
 * Errors are recorded as everywhere (cudapool_last_error): a tag is 1 to
 * 256 bytes of UTF-8; a tag never pushed cannot be paused or resumed. */

/* Pushes tag on the calling thread's stack (at most 1024 deep): the
 * thread's allocations belong to it until the matching pop. 0 or -1. */
int cudapool_tag_push(const char *tag);
/* Pops the calling thread's top tag; -1 when none is pushed. */
int cudapool_tag_pop(void);

/* Gives back the device memory of tag (NULL: every tag) on every device:
 * it waits for the work already queued on the memory, copies the contents
 * of the live allocations to pinned host memory if keep != 0, then unmaps
 * and releases the physical memory; the addresses stay reserved, and the
 * allocations stay allocated (cudapool's reserved_bytes drops by what was
 * released; cudapool_paused_bytes rises by as much). While a tag is paused
 * its allocations fail ("tag X is paused") and freeing its pointers is
 * allowed; its memory must not be touched. Pausing a paused tag does
 * nothing more (after a pause that failed part way, it releases the rest).
 * 0, or -1:
 *   - a graph capture, or an allocate-to-pool phase, is under way;
 *   - a block of the tag is shared with another process (CUDA IPC:
 *     cudapool_ipc_handle or cudapool_ipc_share), until it is freed;
 *   - the tag holds ordinary segments (a driver without virtual memory
 *     management, or a pool with its own allocator): not supported;
 *   - a driver call failed: before anything was released, the tag is
 *     usable as before; part way, the tag is paused and another
 *     cudapool_pause releases the rest.
 * The pinned host memory the copies use is kept for the next pause (see
 * cudapool_release_host_memory). */
int cudapool_pause(const char *tag, int keep);
/* Maps new memory at the addresses of tag's paused memory (NULL: every
 * paused tag), restores the contents kept, and lets the tag allocate again.
 * A tag that is not paused is left alone (0). A device short of memory
 * gives back cudapool's cached memory first. 0, or -1 with the tag still
 * paused (what was mapped stays mapped; call it again). */
int cudapool_resume(const char *tag);
/* The device memory of device that pauses gave back and no resume has
 * mapped again, in bytes; -1 for a device that does not exist. */
long long cudapool_paused_bytes(int device);
/* Frees the pinned host memory kept for the copies of later pauses (not
 * the contents a paused tag keeps) and the copy streams. 0 or -1. */
int cudapool_release_host_memory(void);

/* ---- Other libraries' allocator interfaces (CuPy, any caller that cannot
 * pass a C callback cheaply) ---- */

/* Returns the calling thread's current stream, or -1 on failure (with the
 * caller's own error state set). CuPy's C API function
 * cupy.cuda.stream.get_current_stream_ptr (in cupy.cuda.stream.__pyx_capi__,
 * signature "intptr_t (void)") has this type. */
typedef intptr_t (*cudapool_current_stream_fn)(void);

/* CuPy's cupy.cuda.memory.CFunctionAllocator malloc, void *(void *param,
 * size_t size, int device_id). param is NULL (allocate on the legacy default
 * stream) or a cudapool_current_stream_fn, called to find the stream to
 * allocate on (CuPy calls malloc with the GIL held, as that function needs).
 * As cudapool_malloc_ctx: the queued frees are performed first, in the same
 * call. NULL on failure (CuPy does not check it: the caller must). */
void *cudapool_cupy_malloc(void *param, size_t size, int device);

/* cudapool_cupy_malloc for a CuPy that propagates its C malloc's Python
 * exceptions (a result of -1 with an exception set: CuPy built by Cython 3),
 * so that CuPy needs no Python function around the allocator to check for
 * NULL. On a failure, if a handler is registered
 * (cudapool_cupy_set_failure_handler) and the calling thread holds the GIL,
 * it calls handler(size, device, attempt): with attempt 0 the handler may
 * free memory and return True for one retry; else, or with attempt 1, it
 * raises, and the result is -1 with its exception set; where param (the
 * current-stream function) fails, with the exception it set. Without a
 * handler or the GIL it returns NULL, as cudapool_cupy_malloc. A size of
 * CUDAPOOL_CUPY_PROBE_SIZE allocates nothing and calls the handler at once
 * (attempt 0, no retry): cudapool.cupy's install() learns that way whether
 * this CuPy propagates the exception. */
void *cudapool_cupy_malloc_raising(void *param, size_t size, int device);
#define CUDAPOOL_CUPY_PROBE_SIZE ((size_t)-1)

/* Registers the Python callable handler for cudapool_cupy_malloc_raising
 * (NULL: none), with the process's Python C API functions it needs, in this
 * order (n = 5): PyGILState_Check, Py_IncRef, Py_DecRef,
 * PyObject_CallFunction, PyObject_IsTrue (ctypes.pythonapi has them). The
 * caller keeps handler alive while it is registered. 0, or -1 with the
 * error set. */
int cudapool_cupy_set_failure_handler(void *handler, void *const *python_api, int n);

/* CuPy's CFunctionAllocator free, void (void *param, void *ptr, int
 * device_id): queues the free (size unknown) like cudapool_free_deferred, so
 * that a malloc+free pair costs one call into the allocator; the block goes
 * back on the stream it was allocated on. param is ignored, and so is a ptr
 * of -1 (cudapool_cupy_malloc_raising's failure, where a CuPy that does not
 * propagate the exception kept it). */
void cudapool_cupy_free(void *param, void *ptr, int device);

/* A cudapool_stream_filter that accepts exactly the stream ctx: announce a
 * capture of one stream with cudapool_begin_allocate_to_pool(dev, a, b,
 * cudapool_filter_stream_is, stream). The filter runs under the allocator's
 * lock, so a filter written in Python (which needs the GIL) could deadlock;
 * this one never blocks. */
int cudapool_filter_stream_is(void *ctx, cudapool_stream stream);

#ifdef __cplusplus
} /* extern "C" */

/* ---- PyTorch entry points (C++ only), with the exact types that
 * torch.cuda.memory.CUDAPluggableAllocator and its _allocator setters call.
 * Use cudapool_torch_malloc and cudapool_torch_free as the allocator's
 * alloc and free functions; cudapool_init, cudapool_empty_cache,
 * cudapool_set_memory_fraction, cudapool_base_allocation and
 * cudapool_record_stream as the other hooks. ---- */
extern "C" {

/* cudapool_malloc that throws a C++ exception (std::runtime_error) carrying
 * the out-of-memory message instead of returning NULL (PyTorch does not
 * check for NULL). Size 0 returns NULL. Declares that every capture is
 * announced through cudapool_torch_begin_allocate_to_pool. */
void *cudapool_torch_malloc(size_t size, int device, cudapool_stream stream);

/* cudapool_free for PyTorch's free hook: the free is queued and performed by
 * the next call into the library (first thing, on any thread), which halves
 * the calls into Go per allocation. Failures (PyTorch ignores them) are
 * reported on stderr and as the last error of the thread that performs it. */
void cudapool_torch_free(void *ptr, size_t size, int device, cudapool_stream stream);

/* PyTorch's MempoolId_t and stream filter. The filter is copied; the copy is
 * destroyed when the pool's end is processed. */
void cudapool_torch_begin_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> id,
                                           std::function<bool(cudapool_stream)> filter);
void cudapool_torch_end_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> id);
void cudapool_torch_release_pool(int device, std::pair<unsigned long long, unsigned long long> id);

} /* extern "C" */
#endif /* __cplusplus */

#endif /* CUDAPOOL_H */
