// SPDX-License-Identifier: Apache-2.0

package main

// The Go exports, called only by the wrappers in cudapool.c and torch.cpp
// (see the package comment). Each recovers panics (guard), checks its
// arguments, records failures with fail and converts types. Pointers and
// streams arrive as uintptr_t.

/*
#include "capi.h"
*/
import "C"

import (
	"encoding/json"
	"strconv"
	"sync"
	"syscall"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
)

// The malloc export (torchabi.go's cpgo_malloc_ctx, the only one, behind
// cudapool_malloc, cudapool_malloc_ctx, cudapool_cupy_malloc and
// cudapool_torch_malloc) builds the request in place and calls Malloc
// itself (a call layer less; a request built as a variable is copied from a
// temporary just written, which stalls on store forwarding) and ends as
// follows: *out is what the front cache may do with the block
// (allocator/front.go, Tracking); failures, and the NULL out of this
// package's tests, are handled out of line by mallocEnd, told which public
// function the caller called (entry, a CP_FN_* number):
//
//	r := &allocator.MallocRequest{Dev: int(dev), Size: uint64(size), ...}
//	p, err := st.a.Malloc(r)
//	if err != nil || r.FreeErr != nil || out == nil {
//		return mallocEnd(entry, r, p, err, out)
//	}
//	*out = trackC(r.Track)
//	return C.uintptr_t(p)
//
// (A helper holding those lines is not inlined: over the inliner's budget.)

// trackC is tr for the C front.
func trackC(tr allocator.Tracking) C.cp_track {
	return C.cp_track{tag: C.uint32_t(tr.Tag), route: C.uint32_t(tr.Route), phases: C.uint32_t(tr.Phases)}
}

// mallocEnd ends the malloc r through entry whose queued frees (r.FreeErr)
// or own allocation (err) failed, or whose out is NULL. Out of memory is
// told in PyTorch's words for the entry points PyTorch calls
// (cudapool_torch_malloc, and cudapool_malloc_ctx of the C++ class).
//
//go:noinline
func mallocEnd(entry C.int, r *allocator.MallocRequest, p cuda.Ptr, err error, out *C.cp_track) C.uintptr_t {
	fn := entryName(entry)
	reportFreeError(fn, r.FreeErr)
	if err != nil {
		failMalloc(fn, entry == C.CP_FN_TORCH_MALLOC || entry == C.CP_FN_MALLOC_CTX, r.Size, err)
		return 0
	}
	if out != nil {
		*out = trackC(r.Track)
	}
	return C.uintptr_t(p)
}

//export cpgo_free_batch
func cpgo_free_batch(frees *C.cp_pending_free, n C.size_t, entry C.int) {
	fn := entryName(entry)
	defer guard(fn)
	st := load()
	if st.err != nil {
		return
	}
	keeper.Touch()
	reportFreeError(fn, st.a.Free(pendingFrees(frees, n)...))
}

//export cpgo_free
func cpgo_free(p C.uintptr_t, size C.size_t, dev C.int, _ C.uintptr_t) {
	const fn = "cudapool_free"
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return
	}
	if err := a.Free(allocator.FreeRequest{Dev: int(dev), Ptr: cuda.Ptr(p), Size: uint64(size)}); err != nil {
		fail(fn, err)
	}
}

//export cpgo_init
func cpgo_init(n C.int) {
	const fn = "cudapool_init"
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return
	}
	// Every initialization reports a refused configuration, not only the
	// library's first call: PyTorch's init comes after install() has made
	// calls of its own, and PyTorch itself refuses to start CUDA with it.
	if ce := load().confErr; ce != nil {
		fail(fn, ce)
		return
	}
	if n >= 0 && int(n) != a.DeviceCount() {
		failf(fn, "the caller counts %d devices, cudapool's %s backend %d", int(n), load().backend, a.DeviceCount())
	}
}

//export cpgo_empty_cache
func cpgo_empty_cache() {
	const fn = "cudapool_empty_cache"
	defer guard(fn)
	if a := ready(fn); a != nil {
		if err := a.EmptyCache(0); err != nil {
			fail(fn, err)
		}
	}
}

//export cpgo_set_memory_fraction
func cpgo_set_memory_fraction(fraction C.double, dev C.int) {
	const fn = "cudapool_set_memory_fraction"
	defer guard(fn)
	if a := ready(fn); a != nil {
		if err := a.SetMemoryFraction(int(dev), float64(fraction)); err != nil {
			fail(fn, err)
		}
	}
}

//export cpgo_base_allocation
func cpgo_base_allocation(p C.uintptr_t, size *C.size_t) C.uintptr_t {
	const fn = "cudapool_base_allocation"
	defer guard(fn)
	switch {
	case p == 0:
		failf(fn, "the pointer is NULL")
		return 0
	case size == nil:
		failf(fn, "the size pointer is NULL")
		return 0
	}
	a := ready(fn)
	if a == nil {
		return 0
	}
	base, n, err := a.BaseAllocation(cuda.Ptr(p))
	if err != nil {
		fail(fn, err)
		return 0
	}
	*size = C.size_t(n)
	return C.uintptr_t(base)
}

//export cpgo_record_stream
func cpgo_record_stream(p C.uintptr_t, stream C.uintptr_t) {
	const fn = "cudapool_record_stream"
	defer guard(fn)
	if p == 0 {
		failf(fn, "the pointer is NULL")
		return
	}
	if a := ready(fn); a != nil {
		if err := a.RecordStream(cuda.Ptr(p), cuda.Stream(stream)); err != nil {
			fail(fn, err)
		}
	}
}

// poolKey names a private pool of a device.
type poolKey struct {
	dev int
	id  allocator.PoolID
}

func key(dev C.int, a, b C.ulonglong) poolKey {
	return poolKey{int(dev), allocator.PoolID{A: uint64(a), B: uint64(b)}}
}

// stdFilters holds the std::function copies of the pools recording for
// PyTorch, deleted when the pool's end is processed. mu also serializes
// begin and end, so that a handle is registered before its end can run.
var stdFilters struct {
	mu sync.Mutex
	m  map[poolKey]C.uintptr_t
}

//export cpgo_begin_allocate_to_pool
func cpgo_begin_allocate_to_pool(dev C.int, a, b C.ulonglong, filter, ctx C.uintptr_t, tag C.uint32_t) {
	const fn = "cudapool_begin_allocate_to_pool"
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return
	}
	k := key(dev, a, b)
	stdFilters.mu.Lock()
	defer stdFilters.mu.Unlock()
	if err := al.BeginAllocateToPoolTagged(k.dev, k.id, uint32(tag), cFilter(filter, ctx)); err != nil {
		fail(fn, err)
	}
}

//export cpgo_torch_begin_allocate_to_pool
func cpgo_torch_begin_allocate_to_pool(dev C.int, a, b C.ulonglong, handle C.uintptr_t, tag C.uint32_t) {
	const fn = "cudapool_torch_begin_allocate_to_pool"
	defer guard(fn)
	owned := true // the copy is deleted on every path that does not keep it
	defer func() {
		if owned {
			deleteStdFilter(handle)
		}
	}()
	al := ready(fn)
	if al == nil {
		return
	}
	k := key(dev, a, b)
	stdFilters.mu.Lock()
	defer stdFilters.mu.Unlock()
	if err := al.BeginAllocateToPoolTagged(k.dev, k.id, uint32(tag), stdFilter(handle)); err != nil {
		fail(fn, err)
		return
	}
	if handle == 0 {
		return
	}
	if stdFilters.m == nil {
		stdFilters.m = make(map[poolKey]C.uintptr_t)
	}
	// An entry left for this key would belong to a capture whose end was
	// never processed; the router may still call it, so it is not deleted.
	stdFilters.m[k] = handle
	owned = false
}

//export cpgo_end_allocate_to_pool
func cpgo_end_allocate_to_pool(dev C.int, a, b C.ulonglong, entry C.int) {
	fn := entryName(entry)
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return
	}
	k := key(dev, a, b)
	stdFilters.mu.Lock()
	defer stdFilters.mu.Unlock()
	if err := al.EndAllocateToPool(k.dev, k.id); err != nil {
		fail(fn, err)
		return
	}
	// The router no longer calls the filter: its copy can go.
	if h, ok := stdFilters.m[k]; ok {
		delete(stdFilters.m, k)
		deleteStdFilter(h)
	}
}

//export cpgo_release_pool
func cpgo_release_pool(dev C.int, a, b C.ulonglong, entry C.int) {
	fn := entryName(entry)
	defer guard(fn)
	if al := ready(fn); al != nil {
		k := key(dev, a, b)
		if err := al.ReleasePool(k.dev, k.id); err != nil {
			fail(fn, err)
		}
	}
}

//export cpgo_memory_stats_json
func cpgo_memory_stats_json(dev C.int) *C.char {
	const fn = "cudapool_memory_stats_json"
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return nil
	}
	st, err := a.Stats(int(dev))
	if err != nil {
		fail(fn, err)
		return nil
	}
	return C.CString(string(statsJSON(&st)))
}

// statsJSON renders the 122 keys of torch.cuda.memory_stats() as a JSON
// object, in PyTorch's order.
func statsJSON(st *pools.Stats) []byte {
	buf := make([]byte, 0, 4096)
	buf = append(buf, '{')
	st.Each(func(k string, v int64) {
		if len(buf) > 1 {
			buf = append(buf, ',')
		}
		buf = strconv.AppendQuote(buf, k)
		buf = append(buf, ':')
		buf = strconv.AppendInt(buf, v, 10)
	})
	return append(buf, '}')
}

//export cpgo_snapshot_json
func cpgo_snapshot_json() *C.char {
	const fn = "cudapool_snapshot_json"
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return nil
	}
	b, err := json.Marshal(a.Snapshot(nil, true))
	if err != nil {
		failf(fn, "%v", err)
		return nil
	}
	return C.CString(string(b))
}

//export cpgo_reset_peak_stats
func cpgo_reset_peak_stats(dev C.int) {
	const fn = "cudapool_reset_peak_stats"
	defer guard(fn)
	if a := ready(fn); a != nil {
		if err := a.ResetStats(int(dev), allocator.ResetPeak); err != nil {
			fail(fn, err)
		}
	}
}

//export cpgo_reset_accumulated_stats
func cpgo_reset_accumulated_stats(dev C.int) {
	const fn = "cudapool_reset_accumulated_stats"
	defer guard(fn)
	if a := ready(fn); a != nil {
		if err := a.ResetStats(int(dev), allocator.ResetAccumulated); err != nil {
			fail(fn, err)
		}
	}
}

//export cpgo_configure
func cpgo_configure(conf *C.char) (rc C.int) {
	const fn = "cudapool_configure"
	rc = -1 // also the result after a recovered panic
	defer guard(fn)
	return configure(fn, conf, func(_ allocator.Config, s string) (allocator.Config, []string, error) {
		return allocator.ParseConfig(s)
	})
}

// configure parses conf with parse (given the configuration in force) and
// applies it; 0 or -1, as a call of fn. A refused configuration changes
// nothing: the one in force stays.
func configure(fn string, conf *C.char, parse func(allocator.Config, string) (allocator.Config, []string, error)) C.int {
	if conf == nil {
		failf(fn, "the configuration string is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	cfg, warnings, err := parse(a.Config(), C.GoString(conf))
	reportWarnings(warnings)
	if err != nil {
		fail(fn, err)
		return -1
	}
	a.Configure(cfg)
	keeper.SetEnabled(cfg.WarmRuntime)
	return 0
}

// simDriver returns the simulator, or records why there is none as a
// failure of fn.
func simDriver(fn string) *sim.Driver {
	if ready(fn) == nil {
		return nil
	}
	st := load()
	if st.sim == nil {
		failf(fn, "the simulator controls need CUDAPOOL_BACKEND=sim (the backend is %s)", st.backend)
		return nil
	}
	return st.sim
}

//export cpgo_sim_begin_capture
func cpgo_sim_begin_capture(stream C.uintptr_t, mode C.int) (rc C.int) {
	const fn = "cudapool_sim_begin_capture"
	rc = -1
	defer guard(fn)
	d := simDriver(fn)
	if d == nil {
		return -1
	}
	if stream == 0 {
		failf(fn, "the legacy default stream (NULL) cannot be captured")
		return -1
	}
	if err := d.BeginCapture(cuda.Stream(stream), cuda.CaptureMode(mode)); err != nil {
		failf(fn, "stream %#x, mode %d: %v", uintptr(stream), int(mode), err)
		return -1
	}
	return 0
}

//export cpgo_sim_end_capture
func cpgo_sim_end_capture(stream C.uintptr_t) (rc C.int) {
	const fn = "cudapool_sim_end_capture"
	rc = -1
	defer guard(fn)
	d := simDriver(fn)
	if d == nil {
		return -1
	}
	if err := d.EndCapture(cuda.Stream(stream)); err != nil {
		failf(fn, "stream %#x: %v", uintptr(stream), err)
		return -1
	}
	return 0
}

//export cpgo_sim_submit
func cpgo_sim_submit(stream C.uintptr_t) {
	const fn = "cudapool_sim_submit"
	defer guard(fn)
	if d := simDriver(fn); d != nil {
		d.Submit(cuda.Stream(stream))
	}
}

//export cpgo_sim_complete_all
func cpgo_sim_complete_all() {
	const fn = "cudapool_sim_complete_all"
	defer guard(fn)
	if d := simDriver(fn); d != nil {
		d.CompleteAll()
	}
}

//export cpgo_sim_destroy_stream
func cpgo_sim_destroy_stream(stream C.uintptr_t) {
	const fn = "cudapool_sim_destroy_stream"
	defer guard(fn)
	if d := simDriver(fn); d != nil {
		d.DestroyStream(cuda.Stream(stream))
	}
}

//export cpgo_sim_violations
func cpgo_sim_violations() (n C.longlong) {
	const fn = "cudapool_sim_violations"
	n = -1
	defer guard(fn)
	if d := simDriver(fn); d != nil {
		return C.longlong(d.Violations())
	}
	return -1
}

//export cpgo_sim_set_pidfd_errors
func cpgo_sim_set_pidfd_errors(open, getfd C.int) (rc C.int) {
	const fn = "cudapool_sim_set_pidfd_errors"
	rc = -1
	defer guard(fn)
	d := simDriver(fn)
	if d == nil {
		return -1
	}
	if open < 0 || getfd < 0 {
		failf(fn, "errno values are not negative (%d, %d)", int(open), int(getfd))
		return -1
	}
	d.SetPidfdErrors(syscall.Errno(open), syscall.Errno(getfd))
	return 0
}

//export cpgo_sim_write
func cpgo_sim_write(dev C.int, p C.uintptr_t, src unsafe.Pointer, n C.size_t) (rc C.int) {
	const fn = "cudapool_sim_write"
	rc = -1
	defer guard(fn)
	d := simDriver(fn)
	if d == nil {
		return -1
	}
	if src == nil && n != 0 {
		failf(fn, "the source is NULL")
		return -1
	}
	if err := d.WriteDevice(int(dev), cuda.Ptr(p), unsafe.Slice((*byte)(src), int(n))); err != nil {
		failf(fn, "%d bytes at %#x on device %d: %v", uint64(n), uintptr(p), int(dev), err)
		return -1
	}
	return 0
}

//export cpgo_sim_read
func cpgo_sim_read(dev C.int, p C.uintptr_t, dst unsafe.Pointer, n C.size_t) (rc C.int) {
	const fn = "cudapool_sim_read"
	rc = -1
	defer guard(fn)
	d := simDriver(fn)
	if d == nil {
		return -1
	}
	if dst == nil && n != 0 {
		failf(fn, "the destination is NULL")
		return -1
	}
	b, err := d.ReadDevice(int(dev), cuda.Ptr(p), uint64(n))
	if err != nil {
		failf(fn, "%d bytes at %#x on device %d: %v", uint64(n), uintptr(p), int(dev), err)
		return -1
	}
	copy(unsafe.Slice((*byte)(dst), int(n)), b)
	return 0
}
