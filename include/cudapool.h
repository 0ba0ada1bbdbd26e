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
 * If initialization fails (no driver, invalid configuration), every call
 * fails with the reason, which is also printed once on stderr.
 */
#ifndef CUDAPOOL_H
#define CUDAPOOL_H

#include <stddef.h>

#ifdef __cplusplus
#include <functional>
#include <utility>
extern "C" {
#endif

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
 * recorded as an error. Pass -1 to skip the check. */
void cudapool_init(int device_count);

/* Returns every cached, unused segment to the driver (torch.cuda.empty_cache). */
void cudapool_empty_cache(void);

/* Limits the memory cudapool reserves on device to fraction (0..1) of it. */
void cudapool_set_memory_fraction(double fraction, int device);

/* Returns the base of the segment that contains ptr and writes its size to
 * *size; NULL (and an error) if ptr is not in any segment or an argument is
 * NULL. With expandable_segments:True the "segment" is the contiguous mapped
 * range around ptr (what snapshots show as one segment). */
void *cudapool_base_allocation(void *ptr, size_t *size);

/* Notes that stream uses the allocation ptr: after cudapool_free(ptr), the
 * memory is not reused until the work stream had queued by then completes. */
void cudapool_record_stream(void *ptr, cudapool_stream stream);

/* Answers whether an allocation on stream belongs to a pool's capture
 * (non-zero: yes). It is called during cudapool_malloc with the allocator's
 * lock held: it must not call cudapool functions. */
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
 * large_segment_size_mb, expandable_segments, release_lock_on_cudamalloc;
 * cudapool's own record_history:N, debug_checks:True, free_set:treap|sorted).
 * Unknown keys are reported once on stderr and ignored. Returns 0 on success,
 * -1 on an invalid value (the configuration is then unchanged) or when
 * cudapool could not initialize (the last error says why). */
int cudapool_configure(const char *conf);

/* This thread's last failure message, or NULL if nothing has failed on this
 * thread. Valid until the thread's next failing cudapool call. */
const char *cudapool_last_error(void);

/* ---- Simulator controls (CUDAPOOL_BACKEND=sim only; otherwise they fail
 * with an error and return -1 or do nothing). ---- */

/* Begins capturing stream (not NULL) on behalf of the calling thread, as
 * cudaStreamBeginCapture; mode 0 global, 1 thread-local, 2 relaxed.
 * 0 on success, -1 on failure. */
int cudapool_sim_begin_capture(cudapool_stream s, int mode);

/* Ends the capture of s (cudaStreamEndCapture); -1 if s was not capturing,
 * the capture was invalidated by an illegal call, or another thread began it. */
int cudapool_sim_end_capture(cudapool_stream s);

/* Enqueues one unit of work on s (as a kernel launch would); it stays pending
 * until cudapool_sim_complete_all. */
void cudapool_sim_submit(cudapool_stream s);

/* Completes all pending work on every stream. */
void cudapool_sim_complete_all(void);

/* The number of calls the allocator made that CUDA forbids under the stream
 * capture rules (each would have broken a CUDA graph capture); -1 when the
 * backend is not the simulator. */
long long cudapool_sim_violations(void);

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
