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
	"sync/atomic"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
)

//export cpgo_malloc
func cpgo_malloc(size C.size_t, dev C.int, stream C.uintptr_t, track *C.int) C.uintptr_t {
	defer guardMalloc()
	st := load()
	if st.err != nil {
		setError(st.err.Error())
		return 0
	}
	keeper.Touch()
	var frees []allocator.PendingFree
	if C.cp_freeq_n != 0 {
		var buf [C.CP_FREEQ_CAP]allocator.PendingFree
		frees = takeFrees(&buf)
	}
	r := &allocator.MallocRequest{Dev: int(dev), Size: uint64(size), Stream: cuda.Stream(stream), Frees: frees}
	p, err := st.a.Malloc(r)
	if err != nil || r.FreeErr != nil || track == nil {
		return mallocEnd(p, r.Track, err, r.FreeErr, track)
	}
	if r.Track != 0 {
		*track = C.int(r.Track)
	}
	return C.uintptr_t(p)
}

// The malloc exports build the request and call Malloc themselves (a call
// layer less) and end as follows: *track is set when the front cache may
// track the block (allocator/front.go); failures, and the NULL track of
// this package's tests, are handled out of line by mallocEnd:
//
//	if err != nil || r.FreeErr != nil || track == nil {
//		return mallocEnd(p, r.Track, err, r.FreeErr, track)
//	}
//	if r.Track != 0 {
//		*track = C.int(r.Track)
//	}
//	return C.uintptr_t(p)
//
// (A helper holding those lines is not inlined: over the inliner's budget.)

// mallocEnd ends a malloc whose queued frees (ferr) or own allocation (err)
// failed, or whose track is NULL.
//
//go:noinline
func mallocEnd(p cuda.Ptr, tr uint32, err, ferr error, track *C.int) C.uintptr_t {
	reportFreeError(ferr)
	if err != nil {
		failMalloc(err)
		return 0
	}
	if tr != 0 && track != nil {
		*track = C.int(tr)
	}
	return C.uintptr_t(p)
}

//export cpgo_free_batch
func cpgo_free_batch(frees *C.cp_pending_free, n C.size_t) {
	defer guard("free")
	st := load()
	if st.err != nil {
		return
	}
	keeper.Touch()
	reportFreeError(st.a.Free(pendingFrees(frees, n)...))
}

// torchAnnounced is set once cudapool_torch_malloc has told the allocator
// that every capture is announced (PyTorch calls the begin hook for each).
var torchAnnounced atomic.Bool

//export cpgo_torch_malloc
func cpgo_torch_malloc(size C.size_t, dev C.int, stream C.uintptr_t, frees *C.cp_pending_free, nfrees C.size_t, track *C.int) C.uintptr_t {
	defer guardMalloc()
	st := load()
	if st.err != nil {
		setError(st.err.Error())
		return 0
	}
	keeper.Touch()
	a := st.a
	if !torchAnnounced.Load() {
		a.ExpectAnnouncements()
		torchAnnounced.Store(true)
	}
	r := &allocator.MallocRequest{Dev: int(dev), Size: uint64(size), Stream: cuda.Stream(stream), Frees: pendingFrees(frees, nfrees)}
	p, err := a.Malloc(r)
	if err != nil || r.FreeErr != nil || track == nil {
		return mallocEnd(p, r.Track, err, r.FreeErr, track)
	}
	if r.Track != 0 {
		*track = C.int(r.Track)
	}
	return C.uintptr_t(p)
}

//export cpgo_free
func cpgo_free(p C.uintptr_t, size C.size_t, dev C.int, _ C.uintptr_t) {
	defer guard("free")
	a := ready()
	if a == nil {
		return
	}
	if err := a.Free(allocator.FreeRequest{Dev: int(dev), Ptr: cuda.Ptr(p), Size: uint64(size)}); err != nil {
		fail(err)
	}
}

//export cpgo_init
func cpgo_init(n C.int) {
	defer guard("init")
	a := ready()
	if a == nil {
		return
	}
	if n >= 0 && int(n) != a.DeviceCount() {
		failf("cudapool: init: the caller counts %d devices, cudapool's %s backend %d", int(n), load().backend, a.DeviceCount())
	}
}

//export cpgo_empty_cache
func cpgo_empty_cache() {
	defer guard("empty_cache")
	if a := ready(); a != nil {
		if err := a.EmptyCache(0); err != nil {
			fail(err)
		}
	}
}

//export cpgo_set_memory_fraction
func cpgo_set_memory_fraction(fraction C.double, dev C.int) {
	defer guard("set_memory_fraction")
	if a := ready(); a != nil {
		if err := a.SetMemoryFraction(int(dev), float64(fraction)); err != nil {
			fail(err)
		}
	}
}

//export cpgo_base_allocation
func cpgo_base_allocation(p C.uintptr_t, size *C.size_t) C.uintptr_t {
	defer guard("base_allocation")
	switch {
	case p == 0:
		failf("cudapool: base_allocation: the pointer is NULL")
		return 0
	case size == nil:
		failf("cudapool: base_allocation: the size pointer is NULL")
		return 0
	}
	a := ready()
	if a == nil {
		return 0
	}
	base, n, err := a.BaseAllocation(cuda.Ptr(p))
	if err != nil {
		fail(err)
		return 0
	}
	*size = C.size_t(n)
	return C.uintptr_t(base)
}

//export cpgo_record_stream
func cpgo_record_stream(p C.uintptr_t, stream C.uintptr_t) {
	defer guard("record_stream")
	if p == 0 {
		failf("cudapool: record_stream: the pointer is NULL")
		return
	}
	if a := ready(); a != nil {
		if err := a.RecordStream(cuda.Ptr(p), cuda.Stream(stream)); err != nil {
			fail(err)
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
func cpgo_begin_allocate_to_pool(dev C.int, a, b C.ulonglong, filter, ctx C.uintptr_t) {
	defer guard("begin_allocate_to_pool")
	al := ready()
	if al == nil {
		return
	}
	k := key(dev, a, b)
	stdFilters.mu.Lock()
	defer stdFilters.mu.Unlock()
	ref := allocator.FilterRef{Kind: C.CP_ROUTE_C, A: uintptr(filter), B: uintptr(ctx)}
	if err := al.BeginAllocateToPoolRef(k.dev, k.id, cFilter(filter, ctx), ref); err != nil {
		fail(err)
	}
}

//export cpgo_torch_begin_allocate_to_pool
func cpgo_torch_begin_allocate_to_pool(dev C.int, a, b C.ulonglong, handle C.uintptr_t) {
	defer guard("begin_allocate_to_pool")
	owned := true // the copy is deleted on every path that does not keep it
	defer func() {
		if owned {
			deleteStdFilter(handle)
		}
	}()
	al := ready()
	if al == nil {
		return
	}
	k := key(dev, a, b)
	stdFilters.mu.Lock()
	defer stdFilters.mu.Unlock()
	ref := allocator.FilterRef{Kind: C.CP_ROUTE_STD, A: uintptr(handle)}
	if err := al.BeginAllocateToPoolRef(k.dev, k.id, stdFilter(handle), ref); err != nil {
		fail(err)
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
func cpgo_end_allocate_to_pool(dev C.int, a, b C.ulonglong) {
	defer guard("end_allocate_to_pool")
	al := ready()
	if al == nil {
		return
	}
	k := key(dev, a, b)
	stdFilters.mu.Lock()
	defer stdFilters.mu.Unlock()
	if err := al.EndAllocateToPool(k.dev, k.id); err != nil {
		fail(err)
		return
	}
	// The router no longer calls the filter: its copy can go.
	if h, ok := stdFilters.m[k]; ok {
		delete(stdFilters.m, k)
		deleteStdFilter(h)
	}
}

//export cpgo_release_pool
func cpgo_release_pool(dev C.int, a, b C.ulonglong) {
	defer guard("release_pool")
	if al := ready(); al != nil {
		k := key(dev, a, b)
		if err := al.ReleasePool(k.dev, k.id); err != nil {
			fail(err)
		}
	}
}

//export cpgo_memory_stats_json
func cpgo_memory_stats_json(dev C.int) *C.char {
	defer guard("memory_stats")
	a := ready()
	if a == nil {
		return nil
	}
	st, err := a.Stats(int(dev))
	if err != nil {
		fail(err)
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
	defer guard("snapshot")
	a := ready()
	if a == nil {
		return nil
	}
	b, err := json.Marshal(a.Snapshot(nil, true))
	if err != nil {
		failf("cudapool: snapshot: %v", err)
		return nil
	}
	return C.CString(string(b))
}

//export cpgo_reset_peak_stats
func cpgo_reset_peak_stats(dev C.int) {
	defer guard("reset_peak_stats")
	if a := ready(); a != nil {
		if err := a.ResetStats(int(dev), allocator.ResetPeak); err != nil {
			fail(err)
		}
	}
}

//export cpgo_reset_accumulated_stats
func cpgo_reset_accumulated_stats(dev C.int) {
	defer guard("reset_accumulated_stats")
	if a := ready(); a != nil {
		if err := a.ResetStats(int(dev), allocator.ResetAccumulated); err != nil {
			fail(err)
		}
	}
}

//export cpgo_configure
func cpgo_configure(conf *C.char) (rc C.int) {
	rc = -1 // also the result after a recovered panic
	defer guard("configure")
	return configure(conf, func(_ allocator.Config, s string) (allocator.Config, []string, error) {
		return allocator.ParseConfig(s)
	})
}

// configure parses conf with parse (given the configuration in force) and
// applies it; 0 or -1.
func configure(conf *C.char, parse func(allocator.Config, string) (allocator.Config, []string, error)) C.int {
	if conf == nil {
		failf("cudapool: configure: the configuration string is NULL")
		return -1
	}
	a := ready()
	if a == nil {
		return -1
	}
	cfg, warnings, err := parse(a.Config(), C.GoString(conf))
	reportWarnings(warnings)
	if err != nil {
		fail(err)
		return -1
	}
	a.Configure(cfg)
	keeper.SetEnabled(cfg.WarmRuntime)
	return 0
}

// simDriver returns the simulator, or records why there is none.
func simDriver(op string) *sim.Driver {
	if ready() == nil {
		return nil
	}
	st := load()
	if st.sim == nil {
		failf("cudapool: %s: the simulator controls need CUDAPOOL_BACKEND=sim (the backend is %s)", op, st.backend)
		return nil
	}
	return st.sim
}

//export cpgo_sim_begin_capture
func cpgo_sim_begin_capture(stream C.uintptr_t, mode C.int) (rc C.int) {
	rc = -1
	defer guard("sim_begin_capture")
	d := simDriver("sim_begin_capture")
	if d == nil {
		return -1
	}
	if stream == 0 {
		failf("cudapool: sim_begin_capture: the legacy default stream (NULL) cannot be captured")
		return -1
	}
	if err := d.BeginCapture(cuda.Stream(stream), cuda.CaptureMode(mode)); err != nil {
		failf("cudapool: sim_begin_capture(stream %#x, mode %d): %v", uintptr(stream), int(mode), err)
		return -1
	}
	return 0
}

//export cpgo_sim_end_capture
func cpgo_sim_end_capture(stream C.uintptr_t) (rc C.int) {
	rc = -1
	defer guard("sim_end_capture")
	d := simDriver("sim_end_capture")
	if d == nil {
		return -1
	}
	if err := d.EndCapture(cuda.Stream(stream)); err != nil {
		failf("cudapool: sim_end_capture(stream %#x): %v", uintptr(stream), err)
		return -1
	}
	return 0
}

//export cpgo_sim_submit
func cpgo_sim_submit(stream C.uintptr_t) {
	defer guard("sim_submit")
	if d := simDriver("sim_submit"); d != nil {
		d.Submit(cuda.Stream(stream))
	}
}

//export cpgo_sim_complete_all
func cpgo_sim_complete_all() {
	defer guard("sim_complete_all")
	if d := simDriver("sim_complete_all"); d != nil {
		d.CompleteAll()
	}
}

//export cpgo_sim_violations
func cpgo_sim_violations() (n C.longlong) {
	n = -1
	defer guard("sim_violations")
	if d := simDriver("sim_violations"); d != nil {
		return C.longlong(d.Violations())
	}
	return -1
}
