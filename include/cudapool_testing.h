// SPDX-License-Identifier: Apache-2.0
/*
 * cudapool_testing.h - libcudapool.so's testing and diagnostic interface:
 * the simulated device's controls and the front cache's counters.
 *
 * Not part of the stable ABI: these functions may change or go in any
 * release, and CUDAPOOL_ABI_VERSION does not count them. They are what
 * cudapool's own tests and benchmarks use; `make install` installs only
 * cudapool.h. Errors are reported as by every cudapool function
 * (cudapool_last_error).
 */
#ifndef CUDAPOOL_TESTING_H
#define CUDAPOOL_TESTING_H

#include "cudapool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The front cache (a cache in C that serves a malloc of the size and stream
 * of a block freed since the last call into Go, without entering Go;
 * front_cache:False turns it off): what it did on a device since the
 * process started. */
typedef struct {
	unsigned long long hits;          /* mallocs it served */
	unsigned long long pool_hits;     /* of those, routed to a private pool (a graph capture, a MemPool) */
	unsigned long long cold_skipped;  /* blocks it did not track, in cold mode (sizes that do not repeat) */
	unsigned long long cold_verdicts; /* how often it went cold */
} cudapool_front_counters;

/* 0 and *out filled, or -1 for a device the front does not serve (16 or more). */
int cudapool_get_front_counters(int device, cudapool_front_counters *out);

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

/* Destroys the application's stream s (as cudaStreamDestroy on a CuPy or
 * Numba stream): its pending work still completes, and every later call in
 * which the allocator names s to the driver is refused and counted as a
 * violation (CUDA's behaviour is undefined there: the driver may crash). */
void cudapool_sim_destroy_stream(cudapool_stream s);

/* Makes this simulated process's later pidfd_open and pidfd_getfd calls
 * fail with these errno values (0: work), as a kernel without them (ENOSYS)
 * or a ptrace rule (EPERM) would. 0 or -1. The handle kinds the simulated
 * devices export are CUDAPOOL_SIM_SHAREABLE's: fd (the default), fabric,
 * "fd,fabric" or none. */
int cudapool_sim_set_pidfd_errors(int open_errno, int getfd_errno);

/* Copies n bytes to (write) or from (read) simulated device memory at ptr,
 * which must be mapped (an allocation, or an opened IPC handle's memory).
 * 0 or -1. */
int cudapool_sim_write(int device, void *ptr, const void *src, size_t n);
int cudapool_sim_read(int device, const void *ptr, void *dst, size_t n);

/* The number of calls the allocator made that CUDA forbids under the stream
 * capture rules (each would have broken a CUDA graph capture) or that named
 * a destroyed stream; -1 when the backend is not the simulator. */
long long cudapool_sim_violations(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CUDAPOOL_TESTING_H */
