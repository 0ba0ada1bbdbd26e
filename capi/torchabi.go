// SPDX-License-Identifier: Apache-2.0

package main

// Exports for PyTorch's CUDAAllocator interface, called by the C wrappers in
// cudapool.c on behalf of cudapool's C++ allocator class
// (python/cudapool/csrc/torch_allocator.cpp). As in exports.go, each one
// recovers panics, records failures for the calling thread and converts
// types; the allocator package holds every rule.

/*
#include <stdlib.h>
#include <string.h>
#include "capi.h"
#include "cudapool.h"
*/
import "C"

import (
	"errors"
	"strings"
	"sync"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

//export cpgo_malloc_ctx
func cpgo_malloc_ctx(size C.size_t, dev C.int, stream C.uintptr_t, ctx C.ulonglong, frees *C.cp_pending_free, nfrees C.size_t, out *C.cp_track, entry C.int, tag C.uint32_t) C.uintptr_t {
	// guard, written out: a literal deferred is called directly, with no
	// wrapper around a deferred call's arguments (a call less per malloc).
	defer func() {
		if r := recover(); r != nil {
			panicked(entryName(entry), r)
		}
	}()
	st := current.Load()
	if st == nil || st.err != nil {
		// The process's first call (load initializes the state, and this
		// function runs again), or a failed state; out of line.
		return mallocCtxNoState(size, dev, stream, ctx, frees, nfrees, out, entry, tag)
	}
	keeper.Touch()
	r := &allocator.MallocRequest{Dev: int(dev), Size: uint64(size), Stream: cuda.Stream(stream), Ctx: uint64(ctx), Tag: uint32(tag), Frees: pendingFrees(frees, nfrees)}
	p, err := st.a.Malloc(r)
	if err != nil || r.FreeErr != nil || out == nil {
		return mallocEnd(entry, r, p, err, out)
	}
	*out = trackC(r.Track)
	return C.uintptr_t(p)
}

//go:noinline
func mallocCtxNoState(size C.size_t, dev C.int, stream C.uintptr_t, ctx C.ulonglong, frees *C.cp_pending_free, nfrees C.size_t, out *C.cp_track, entry C.int, tag C.uint32_t) C.uintptr_t {
	if st := load(); st.err != nil {
		return failState(entryName(entry), st)
	}
	return cpgo_malloc_ctx(size, dev, stream, ctx, frees, nfrees, out, entry, tag)
}

// failMalloc records a failed malloc of size bytes through the public
// function fn, and for out of memory the numbers PyTorch's out-of-memory
// observers receive. Out of memory is told in PyTorch's words for PyTorch's
// entry points (pytorch), in cudapool's for the others.
func failMalloc(fn string, pytorch bool, size uint64, err error) {
	if oom := allocator.OOMInfoOf(err); oom != nil {
		C.cp_set_oom(C.int(oom.Device), C.size_t(oom.Size), C.size_t(oom.Total), C.size_t(oom.Free))
	} else {
		C.cp_set_oom(-1, 0, 0, 0)
	}
	if !pytorch {
		if st := load(); st.a != nil {
			if text, ok := st.a.OOMText(err, size); ok {
				setError(fn + ": " + text)
				return
			}
		}
	}
	fail(fn, err)
}

//export cpgo_free_ctx
func cpgo_free_ctx(p C.uintptr_t, size C.size_t, dev C.int, ctx C.ulonglong) (rc C.int) {
	const fn = "cudapool_free_ctx"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	return result(fn, a.Free(allocator.FreeRequest{Dev: max(int(dev), -1), Ptr: cuda.Ptr(p), Size: uint64(size), Ctx: uint64(ctx)}))
}

// cpgo_expect_announced tells the allocator that every capture is
// announced, for cudapool_expect_announced_captures and for
// cudapool_torch_malloc's first call (entry names which); 0, or -1 if the
// library cannot run (then the caller's call fails: the announcement is
// made again by the next).
//
//export cpgo_expect_announced
func cpgo_expect_announced(entry C.int) (rc C.int) {
	fn := entryName(entry)
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	a.ExpectAnnouncements()
	return 0
}

//export cpgo_configure_update
func cpgo_configure_update(conf *C.char) (rc C.int) {
	const fn = "cudapool_configure_update"
	// (Concurrent updates are serialized by PyTorch's settings parser; a
	// cudapool_configure racing with one may lose one of the two.)
	rc = -1
	defer guard(fn)
	return configure(fn, conf, allocator.ParseConfigUpdate)
}

func statC(s pools.Stat) C.cudapool_stat {
	return C.cudapool_stat{current: C.longlong(s.Current), peak: C.longlong(s.Peak), allocated: C.longlong(s.Allocated), freed: C.longlong(s.Freed)}
}

func statArrayC(dst *[3]C.cudapool_stat, src *pools.StatArray) {
	for i := range src {
		dst[i] = statC(src[i])
	}
}

//export cpgo_get_device_stats
func cpgo_get_device_stats(dev C.int, out unsafe.Pointer) (rc C.int) {
	const fn = "cudapool_get_device_stats"
	rc = -1
	defer guard(fn)
	if out == nil {
		failf(fn, "the output pointer is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	st, err := a.Stats(int(dev))
	if err != nil {
		fail(fn, err)
		return -1
	}
	o := (*C.cudapool_device_stats)(out)
	statArrayC(&o.allocation, &st.Allocation)
	statArrayC(&o.segment, &st.Segment)
	statArrayC(&o.active, &st.Active)
	statArrayC(&o.inactive_split, &st.InactiveSplit)
	statArrayC(&o.allocated_bytes, &st.AllocatedBytes)
	statArrayC(&o.reserved_bytes, &st.ReservedBytes)
	statArrayC(&o.active_bytes, &st.ActiveBytes)
	statArrayC(&o.inactive_split_bytes, &st.InactiveSplitBytes)
	statArrayC(&o.requested_bytes, &st.RequestedBytes)
	o.num_alloc_retries = C.longlong(st.NumAllocRetries)
	o.num_ooms = C.longlong(st.NumOOMs)
	o.oversize_allocations = statC(st.OversizeAllocations)
	o.oversize_segments = statC(st.OversizeSegments)
	o.num_sync_all_streams = C.longlong(st.NumSyncAllStreams)
	o.num_device_alloc = C.longlong(st.NumDeviceAlloc)
	o.num_device_free = C.longlong(st.NumDeviceFree)
	o.max_split_size = C.longlong(st.MaxSplitSize)
	return 0
}

//export cpgo_cache_info
func cpgo_cache_info(dev C.int, largest *C.size_t) (rc C.int) {
	const fn = "cudapool_cache_info"
	rc = -1
	defer guard(fn)
	if largest == nil {
		failf(fn, "the size pointer is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	n, err := a.CacheInfo(int(dev), uint64(*largest))
	if err != nil {
		fail(fn, err)
		return -1
	}
	*largest = C.size_t(n)
	return 0
}

//export cpgo_get_memory_fraction
func cpgo_get_memory_fraction(dev C.int) (f C.double) {
	const fn = "cudapool_get_memory_fraction"
	f = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	v, err := a.MemoryFraction(int(dev))
	if err != nil {
		fail(fn, err)
		return -1
	}
	return C.double(v)
}

//export cpgo_empty_cache_ctx
func cpgo_empty_cache_ctx(ctx C.ulonglong) (rc C.int) {
	const fn = "cudapool_empty_cache_ctx"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	if err := a.EmptyCache(uint64(ctx)); err != nil {
		fail(fn, err)
		return -1
	}
	return 0
}

// result records err as a failure of fn and converts it to the C
// convention (0 / -1).
func result(fn string, err error) C.int {
	if err != nil {
		fail(fn, err)
		return -1
	}
	return 0
}

//export cpgo_pool_create_or_incref
func cpgo_pool_create_or_incref(dev C.int, a, b C.ulonglong) (rc C.int) {
	const fn = "cudapool_pool_create_or_incref"
	rc = -1
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return -1
	}
	k := key(dev, a, b)
	return result(fn, al.CreateOrIncrefPool(k.dev, k.id))
}

//export cpgo_pool_use_count
func cpgo_pool_use_count(dev C.int, a, b C.ulonglong) (rc C.int) {
	const fn = "cudapool_pool_use_count"
	rc = -1
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return -1
	}
	k := key(dev, a, b)
	n, err := al.PoolUseCount(k.dev, k.id)
	if err != nil {
		fail(fn, err)
		return -1
	}
	return C.int(n)
}

//export cpgo_pool_set_no_split
func cpgo_pool_set_no_split(dev C.int, a, b C.ulonglong) (rc C.int) {
	const fn = "cudapool_pool_set_no_split"
	rc = -1
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return -1
	}
	k := key(dev, a, b)
	return result(fn, al.SetPoolNoSplit(k.dev, k.id))
}

//export cpgo_pool_set_use_on_oom
func cpgo_pool_set_use_on_oom(dev C.int, a, b C.ulonglong, use C.int) (rc C.int) {
	const fn = "cudapool_pool_set_use_on_oom"
	rc = -1
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return -1
	}
	k := key(dev, a, b)
	return result(fn, al.SetPoolUseOnOOM(k.dev, k.id, use != 0))
}

//export cpgo_empty_pool
func cpgo_empty_pool(dev C.int, a, b C.ulonglong) (rc C.int) {
	const fn = "cudapool_empty_pool"
	rc = -1
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return -1
	}
	id := allocator.PoolID{A: uint64(a), B: uint64(b)}
	if dev >= 0 {
		return result(fn, al.EmptyPool(int(dev), id))
	}
	for d := 0; d < al.DeviceCount(); d++ {
		if err := al.EmptyPool(d, id); err != nil && !errors.Is(err, allocator.ErrUnknownPool) {
			return result(fn, err)
		}
	}
	return 0
}

// cSource is a MemPool's segment source given as C function pointers.
type cSource struct{ alloc, free, ctx C.uintptr_t }

func (s cSource) Alloc(dev int, size uint64, st cuda.Stream) (cuda.Ptr, error) {
	p := C.cp_call_segment_alloc(s.alloc, s.ctx, C.size_t(size), C.int(dev), C.uintptr_t(st))
	if p == 0 {
		return 0, cuda.ErrOutOfMemory
	}
	return cuda.Ptr(p), nil
}

func (s cSource) Free(dev int, p cuda.Ptr, size uint64) error {
	if C.cp_call_segment_free(s.free, s.ctx, C.uintptr_t(p), C.size_t(size), C.int(dev)) != 0 {
		return errSourceFree
	}
	return nil
}

var errSourceFree = sourceError("the MemPool's allocator failed to free a segment")

type sourceError string

func (e sourceError) Error() string { return string(e) }

//export cpgo_pool_set_source
func cpgo_pool_set_source(dev C.int, a, b C.ulonglong, alloc, free, ctx C.uintptr_t) (rc C.int) {
	const fn = "cudapool_pool_set_source"
	rc = -1
	defer guard(fn)
	if alloc == 0 || free == 0 {
		failf(fn, "the alloc and free functions must not be NULL")
		return -1
	}
	al := ready(fn)
	if al == nil {
		return -1
	}
	k := key(dev, a, b)
	return result(fn, al.SetPoolSource(k.dev, k.id, cSource{alloc, free, ctx}))
}

// checkpoints maps the ids handed to C to the allocator's checkpoints.
var checkpoints struct {
	mu   sync.Mutex
	next uint64
	m    map[uint64]*allocator.Checkpoint
}

//export cpgo_checkpoint_pool
func cpgo_checkpoint_pool(dev C.int, a, b C.ulonglong) (id C.ulonglong) {
	const fn = "cudapool_checkpoint_pool"
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return 0
	}
	k := key(dev, a, b)
	cp, err := al.CheckpointPool(k.dev, k.id)
	if err != nil {
		fail(fn, err)
		return 0
	}
	checkpoints.mu.Lock()
	defer checkpoints.mu.Unlock()
	if checkpoints.m == nil {
		checkpoints.m = make(map[uint64]*allocator.Checkpoint)
	}
	checkpoints.next++
	checkpoints.m[checkpoints.next] = cp
	return C.ulonglong(checkpoints.next)
}

//export cpgo_checkpoint_release
func cpgo_checkpoint_release(id C.ulonglong) {
	const fn = "cudapool_checkpoint_release"
	defer guard(fn)
	checkpoints.mu.Lock()
	cp := checkpoints.m[uint64(id)]
	delete(checkpoints.m, uint64(id))
	checkpoints.mu.Unlock()
	if cp == nil && id != 0 {
		failf(fn, "checkpoint %d does not exist (released twice?)", uint64(id))
	}
}

// cArray copies ptrs into a malloc'd array (NULL when empty).
func cArray(ptrs []cuda.Ptr) *unsafe.Pointer {
	if len(ptrs) == 0 {
		return nil
	}
	arr := (*unsafe.Pointer)(C.malloc(C.size_t(len(ptrs)) * C.size_t(unsafe.Sizeof(uintptr(0)))))
	s := unsafe.Slice((*uintptr)(unsafe.Pointer(arr)), len(ptrs))
	for i, p := range ptrs {
		s[i] = uintptr(p)
	}
	return arr
}

//export cpgo_checkpoint_restore
func cpgo_checkpoint_restore(dev C.int, id C.ulonglong, out unsafe.Pointer) (rc C.int) {
	const fn = "cudapool_checkpoint_restore"
	rc = -1
	defer guard(fn)
	if out == nil {
		failf(fn, "the result pointer is NULL")
		return -1
	}
	al := ready(fn)
	if al == nil {
		return -1
	}
	checkpoints.mu.Lock()
	cp := checkpoints.m[uint64(id)]
	checkpoints.mu.Unlock()
	if cp == nil {
		failf(fn, "checkpoint %d does not exist (released?)", uint64(id))
		return -1
	}
	res, err := al.RestoreCheckpoint(int(dev), cp)
	if err != nil {
		fail(fn, err)
		return -1
	}
	o := (*C.cudapool_restore_result)(out)
	o.nfreed, o.freed = C.size_t(len(res.Freed)), cArray(res.Freed)
	o.nallocated, o.allocated = C.size_t(len(res.Allocated)), cArray(res.Allocated)
	return 0
}

//export cpgo_pool_check_live
func cpgo_pool_check_live(dev C.int, a, b C.ulonglong, expected unsafe.Pointer, n C.size_t) (rc C.int) {
	const fn = "cudapool_pool_check_live"
	rc = -1
	defer guard(fn)
	if expected == nil && n > 0 {
		failf(fn, "the array is NULL")
		return -1
	}
	al := ready(fn)
	if al == nil {
		return -1
	}
	ptrs := make([]cuda.Ptr, int(n))
	if n > 0 {
		for i, p := range unsafe.Slice((*uintptr)(expected), int(n)) {
			ptrs[i] = cuda.Ptr(p)
		}
	}
	k := key(dev, a, b)
	ok, err := al.CheckPoolLive(k.dev, k.id, ptrs)
	if err != nil {
		fail(fn, err)
		return -1
	}
	if ok {
		return 1
	}
	return 0
}

//export cpgo_record_history
func cpgo_record_history(enabled C.int, max C.size_t, when C.int, clear C.int, skip *C.char) (rc C.int) {
	const fn = "cudapool_record_history"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	var actions []string
	if skip != nil {
		for _, s := range strings.Split(C.GoString(skip), ",") {
			if s = strings.TrimSpace(s); s != "" {
				actions = append(actions, s)
			}
		}
	}
	const maxEntries = 1 << 30 // an "unlimited" request from Python is sys.maxsize
	n := uint64(max)
	if n > maxEntries {
		n = maxEntries
	}
	err := a.RecordHistory(allocator.HistoryOptions{Enabled: enabled != 0, MaxEntries: int(n),
		When: allocator.HistoryLevel(when), Clear: clear != 0, SkipActions: actions})
	C.cp_gather_mask = C.uint(a.GatherMask())
	return result(fn, err)
}

//export cpgo_history_enabled
func cpgo_history_enabled() C.int {
	const fn = "cudapool_history_enabled"
	defer guard(fn)
	if a := ready(fn); a != nil && a.HistoryEnabled() {
		return 1
	}
	return 0
}

//export cpgo_live_contexts
func cpgo_live_contexts(out *C.ulonglong, cap C.size_t) C.size_t {
	const fn = "cudapool_live_contexts"
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return 0
	}
	ids := a.LiveContexts(nil)
	checkpoints.mu.Lock()
	for _, cp := range checkpoints.m {
		ids = cp.AppendContexts(ids)
	}
	checkpoints.mu.Unlock()
	if out != nil {
		dst := unsafe.Slice(out, int(cap))
		for i := 0; i < len(ids) && i < len(dst); i++ {
			dst[i] = C.ulonglong(ids[i])
		}
	}
	return C.size_t(len(ids))
}

//export cpgo_set_user_metadata
func cpgo_set_user_metadata(md *C.char) {
	const fn = "cudapool_set_user_metadata"
	defer guard(fn)
	if a := ready(fn); a != nil {
		s := ""
		if md != nil {
			s = C.GoString(md)
		}
		a.SetUserMetadata(s)
	}
}

//export cpgo_get_user_metadata
func cpgo_get_user_metadata() *C.char {
	const fn = "cudapool_get_user_metadata"
	defer guard(fn)
	if a := ready(fn); a != nil {
		return C.CString(a.UserMetadata())
	}
	return nil
}

//export cpgo_push_compile_context
func cpgo_push_compile_context(c *C.char) {
	const fn = "cudapool_push_compile_context"
	defer guard(fn)
	if a := ready(fn); a != nil && c != nil {
		a.PushCompileContext(C.GoString(c))
	}
}

//export cpgo_pop_compile_context
func cpgo_pop_compile_context() {
	const fn = "cudapool_pop_compile_context"
	defer guard(fn)
	if a := ready(fn); a != nil {
		a.PopCompileContext()
	}
}

//export cpgo_record_annotation
func cpgo_record_annotation(dev C.int, keys, values unsafe.Pointer, n C.size_t) (rc C.int) {
	const fn = "cudapool_record_annotation"
	rc = -1
	defer guard(fn)
	if n > 0 && (keys == nil || values == nil) {
		failf(fn, "the key or value array is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	kv := make([][2]string, int(n))
	if n > 0 {
		ks := unsafe.Slice((**C.char)(keys), int(n))
		vs := unsafe.Slice((**C.char)(values), int(n))
		for i := range kv {
			kv[i] = [2]string{C.GoString(ks[i]), C.GoString(vs[i])}
		}
	}
	return result(fn, a.RecordAnnotation(int(dev), kv))
}

// traceActions numbers the trace actions as PyTorch's TraceEntry::Action.
var traceActions = map[string]C.int{
	"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
	"segment_map": 5, "segment_unmap": 6, "snapshot": 7, "oom": 8,
}

// cmalloc allocates n elements of T with C.malloc, zeroed.
func cmalloc[T any](n int) *T {
	if n == 0 {
		return nil
	}
	var zero T
	return (*T)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(zero))))
}

func cstr(s string) *C.char {
	if s == "" {
		return nil
	}
	return C.CString(s)
}

//export cpgo_snapshot_take
func cpgo_snapshot_take(byPool C.int, a, b C.ulonglong, traces C.int) unsafe.Pointer {
	const fn = "cudapool_snapshot_take"
	defer guard(fn)
	al := ready(fn)
	if al == nil {
		return nil
	}
	var pool *allocator.PoolID
	if byPool != 0 {
		pool = &allocator.PoolID{A: uint64(a), B: uint64(b)}
	}
	snap := al.Snapshot(pool, traces != 0)
	out := cmalloc[C.cudapool_snapshot](1)

	nblocks := 0
	for _, s := range snap.Segments {
		nblocks += len(s.Blocks)
	}
	out.nsegments = C.size_t(len(snap.Segments))
	out.segments = cmalloc[C.cudapool_segment_info](len(snap.Segments))
	out.nblocks = C.size_t(nblocks)
	out.blocks = cmalloc[C.cudapool_block_info](nblocks)
	segs := unsafe.Slice(out.segments, len(snap.Segments))
	blocks := unsafe.Slice(out.blocks, nblocks)
	bi := 0
	for i, s := range snap.Segments {
		g := &segs[i]
		g.device, g.is_expandable = C.int(s.Device), cbool(s.IsExpandable)
		g.is_large = cbool(s.SegmentType == "large")
		g.address, g.total_size, g.requested_size = C.size_t(s.Address), C.size_t(s.TotalSize), C.size_t(s.RequestedSize)
		g.allocated_size, g.active_size = C.size_t(s.AllocatedSize), C.size_t(s.ActiveSize)
		g.stream = C.uintptr_t(s.Stream)
		g.pool_a, g.pool_b, g.context = C.ulonglong(s.SegmentPoolID[0]), C.ulonglong(s.SegmentPoolID[1]), C.ulonglong(s.Context)
		g.first_block, g.nblocks = C.size_t(bi), C.size_t(len(s.Blocks))
		for _, blk := range s.Blocks {
			blocks[bi] = C.cudapool_block_info{size: C.size_t(blk.Size), requested_size: C.size_t(blk.RequestedSize),
				allocated: cbool(blk.Allocated), active: cbool(blk.Active), context: C.ulonglong(blk.Context)}
			bi++
		}
	}

	out.ndevices = C.size_t(len(snap.DeviceTraces))
	ntraces := 0
	for _, t := range snap.DeviceTraces {
		ntraces += len(t)
	}
	out.ntraces = C.size_t(ntraces)
	out.traces = cmalloc[C.cudapool_trace_entry](ntraces)
	tr := unsafe.Slice(out.traces, ntraces)
	ti := 0
	for dev, entries := range snap.DeviceTraces {
		for _, e := range entries {
			t := &tr[ti]
			ti++
			t.action, t.device = traceActions[e.Action], C.int(dev)
			t.addr, t.size, t.stream = C.size_t(e.Addr), C.size_t(e.Size), C.uintptr_t(e.Stream)
			if e.DeviceFree != nil {
				t.addr = C.size_t(*e.DeviceFree) // PyTorch keeps the free memory of an oom in addr
			}
			t.pool_a, t.pool_b, t.context = C.ulonglong(e.PoolID[0]), C.ulonglong(e.PoolID[1]), C.ulonglong(e.Context)
			t.time_us = C.longlong(e.TimeUS)
			t.compile_context, t.user_metadata = cstr(e.CompileContext), cstr(e.UserMetadata)
		}
	}

	out.nannotations = C.size_t(len(snap.ExternalAnnotations))
	out.annotations = cmalloc[C.cudapool_annotation](len(snap.ExternalAnnotations))
	ann := unsafe.Slice(out.annotations, len(snap.ExternalAnnotations))
	for i, e := range snap.ExternalAnnotations {
		ann[i].device, ann[i].time_us, ann[i].n = C.int(e.Device), C.longlong(e.TimeUS), C.size_t(len(e.Metadata))
		keys := cmalloc[*C.char](len(e.Metadata))
		vals := cmalloc[*C.char](len(e.Metadata))
		ks, vs := unsafe.Slice(keys, len(e.Metadata)), unsafe.Slice(vals, len(e.Metadata))
		for k, kv := range e.Metadata {
			ks[k], vs[k] = C.CString(kv[0]), C.CString(kv[1])
		}
		ann[i].keys, ann[i].values = keys, vals
	}

	cfg := al.Config()
	c := &out.config
	c.garbage_collection_threshold = C.double(cfg.Pools.GCThreshold)
	c.max_split_size = C.size_t(cfg.Pools.MaxSplitSize)
	c.expandable_segments = cbool(cfg.ExpandableSegments)
	c.release_lock_on_malloc = cbool(cfg.ReleaseLockOnMalloc)
	c.settings = C.CString(cfg.String())
	divs := cfg.Pools.RoundupDivisions
	arr := cmalloc[C.size_t](len(divs))
	dst := unsafe.Slice(arr, len(divs))
	for i := range dst {
		dst[i] = C.size_t(divs[i])
	}
	c.nroundup, c.roundup_power2_divisions = C.size_t(len(divs)), arr
	return unsafe.Pointer(out)
}

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

//export cpgo_ipc_handle
func cpgo_ipc_handle(p C.uintptr_t, handle *C.uchar, offset *C.size_t, dev *C.int) (rc C.int) {
	const fn = "cudapool_ipc_handle"
	rc = -1
	defer guard(fn)
	if handle == nil || offset == nil || dev == nil {
		failf(fn, "an output pointer is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	h, off, d, err := a.IpcHandle(cuda.Ptr(p))
	if err != nil {
		fail(fn, err)
		return -1
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(handle)), len(h)), h[:])
	*offset, *dev = C.size_t(off), C.int(d)
	return 0
}

//export cpgo_ipc_open
func cpgo_ipc_open(dev C.int, handle *C.uchar) C.uintptr_t {
	const fn = "cudapool_ipc_open"
	defer guard(fn)
	if handle == nil {
		failf(fn, "the handle is NULL")
		return 0
	}
	a := ready(fn)
	if a == nil {
		return 0
	}
	var h cuda.IpcHandle
	copy(h[:], unsafe.Slice((*byte)(unsafe.Pointer(handle)), len(h)))
	p, err := a.IpcOpen(int(dev), h)
	if err != nil {
		fail(fn, err)
		return 0
	}
	return C.uintptr_t(p)
}

// maxShareHandle bounds a handle's length: the most physical allocations
// a handle may list (vmem) as fabric handles, and its header.
const maxShareHandle = 2 + 24 + 64<<20

//export cpgo_ipc_share
func cpgo_ipc_share(p C.uintptr_t, buf *C.uchar, capacity C.size_t, length, offset *C.size_t, dev *C.int) (rc C.int) {
	const fn = "cudapool_ipc_share"
	rc = -1
	defer guard(fn)
	if length == nil || offset == nil || dev == nil {
		failf(fn, "an output pointer is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	h, off, d, err := a.ShareIpcHandle(cuda.Ptr(p))
	if err != nil {
		fail(fn, err)
		return -1
	}
	*length = C.size_t(len(h))
	if buf == nil || uint64(capacity) < uint64(len(h)) {
		failf(fn, "the handle of pointer %#x is %d bytes, longer than the %d-byte buffer: call again with a buffer of *len bytes", uintptr(p), len(h), uint64(capacity))
		return -1
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(h)), h)
	*offset, *dev = C.size_t(off), C.int(d)
	return 0
}

//export cpgo_ipc_open_shared
func cpgo_ipc_open_shared(dev C.int, buf *C.uchar, n C.size_t) C.uintptr_t {
	const fn = "cudapool_ipc_open_shared"
	defer guard(fn)
	if buf == nil && n != 0 {
		failf(fn, "the handle is NULL")
		return 0
	}
	if uint64(n) > maxShareHandle {
		failf(fn, "a handle of %d bytes is longer than any handle (%d bytes)", uint64(n), maxShareHandle)
		return 0
	}
	a := ready(fn)
	if a == nil {
		return 0
	}
	var h []byte
	if n > 0 {
		h = C.GoBytes(unsafe.Pointer(buf), C.int(n))
	}
	p, err := a.OpenIpcHandle(int(dev), h)
	if err != nil {
		fail(fn, err)
		return 0
	}
	return C.uintptr_t(p)
}

//export cpgo_ipc_close
func cpgo_ipc_close(p C.uintptr_t) (rc C.int) {
	const fn = "cudapool_ipc_close"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	return result(fn, a.IpcClose(cuda.Ptr(p)))
}

//export cpgo_allocation_info
func cpgo_allocation_info(p C.uintptr_t, size *C.size_t, dev *C.int) (rc C.int) {
	const fn = "cudapool_allocation_info"
	rc = -1
	defer guard(fn)
	if size == nil || dev == nil {
		failf(fn, "an output pointer is NULL")
		return -1
	}
	a := ready(fn)
	if a == nil {
		return -1
	}
	d, n, err := a.AllocationInfo(cuda.Ptr(p))
	if err != nil {
		fail(fn, err)
		return -1
	}
	*size, *dev = C.size_t(n), C.int(d)
	return 0
}

//export cpgo_set_caching
func cpgo_set_caching(on C.int) (rc C.int) {
	const fn = "cudapool_set_caching"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	a.SetCaching(on != 0)
	return 0
}

//export cpgo_caching
func cpgo_caching() C.int {
	const fn = "cudapool_caching"
	defer guard(fn)
	if a := ready(fn); a != nil && !a.Caching() {
		return 0
	}
	return 1
}
