// SPDX-License-Identifier: Apache-2.0

package allocator_test

// Driver fault injection: every place where the allocator calls the driver
// is made to fail once (cuda/sim/fault wraps the simulator), and each test
// checks that the failure gives a clear error (or the documented fallback),
// loses no block, counts nothing twice, and that the next call works.
//
// TestFaultCallSitesCovered finds the call sites by reading the source of
// the allocator and of the packages that call the driver for it: a new
// driver call without an entry in faultCases fails the suite.

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/pools"
)

// errInjected is what failed calls return: an error no code path treats
// specially (unlike out of memory or an invalid handle).
var errInjected = cuda.ErrUnknown

// fenv is one fault test's allocator over a fault-injecting simulator.
type fenv struct {
	t        *testing.T
	f        *fault.Driver
	a        *allocator.Allocator
	warnings []string
	live     map[cuda.Ptr]uint64 // our allocations and their sizes
	// pending: blocks freed while another stream used them, which stay
	// allocated in the statistics until the allocator sees that use end.
	pending map[cuda.Ptr]uint64
}

// newFault builds a 1 GiB, two-device allocator with configuration conf;
// relaxed adds MemAllocRelaxed to the driver.
func newFault(t *testing.T, conf string, relaxed bool) *fenv {
	t.Helper()
	lockThread(t)
	cfg, _, err := allocator.ParseConfig(conf)
	require.NoError(t, err)
	s := sim.New(sim.Options{Devices: 2, Memory: GiB})
	// Growth creates memory with MemCreate, as with a driver that cannot
	// share it; the sharing cases (share_test.go's shareFault) turn
	// sharing on.
	s.SetShareableKinds(0)
	e := &fenv{t: t, live: map[cuda.Ptr]uint64{}, pending: map[cuda.Ptr]uint64{}}
	var drv allocator.Driver
	if relaxed {
		r := fault.NewRelaxed(s)
		e.f, drv = r.Driver, r
	} else {
		e.f = fault.New(s)
		drv = e.f
	}
	e.a, err = allocator.New(drv, cfg)
	require.NoError(t, err)
	e.a.SetWarningHandler(func(m string) { e.warnings = append(e.warnings, m) })
	return e
}

func (e *fenv) sim() *sim.Driver { return e.f.Sim }

// fail makes the next call of method from site fail (after skip matching
// calls).
func (e *fenv) fail(method, site string, skip int) *fault.Rule {
	return e.f.Fail(method, site, skip, errInjected)
}

// fired requires that r failed exactly one call.
func (e *fenv) fired(r *fault.Rule) {
	e.t.Helper()
	require.Equal(e.t, 1, e.f.Hits(r), "the fault %s at %q was not reached", r.Method, r.Site)
}

func (e *fenv) malloc(size uint64, s cuda.Stream) cuda.Ptr {
	e.t.Helper()
	p, err := e.a.Malloc(&allocator.MallocRequest{Size: size, Stream: s})
	require.NoError(e.t, err)
	require.NotZero(e.t, p)
	_, dup := e.live[p]
	require.False(e.t, dup, "pointer %#x handed out twice", p)
	e.live[p] = size
	return p
}

func (e *fenv) free(p cuda.Ptr) {
	e.t.Helper()
	require.NoError(e.t, e.a.Free(allocator.FreeRequest{Ptr: p, Size: e.live[p]}))
	delete(e.live, p)
}

// driverErr requires err to be a driver error of op that names the
// injected CUDA error and says what was being done (want).
func (e *fenv) driverErr(err error, op, want string) {
	e.t.Helper()
	require.Error(e.t, err)
	require.ErrorIs(e.t, err, allocator.ErrDriver)
	require.ErrorIs(e.t, err, errInjected)
	msg := err.Error()
	require.True(e.t, strings.HasPrefix(msg, "cudapool: "+op+": "), "error %q does not name the operation %s", msg, op)
	require.Contains(e.t, msg, want)
	require.Contains(e.t, msg, "CUDA_ERROR_UNKNOWN")
}

// consistent checks the invariants, the statistics against our live
// allocations, and the memory the driver handed out against what the
// allocator counts as reserved (extra is physical memory the allocator
// holds outside any segment: spare pages after a failed release).
func (e *fenv) consistent(extra uint64) {
	e.t.Helper()
	require.NoError(e.t, e.a.CheckInvariants())
	st := stats(e.t, e.a, 0)
	var req, pend int64
	for _, n := range e.live {
		req += int64(n)
	}
	for _, n := range e.pending {
		pend += int64(n)
	}
	n := int64(len(e.live))
	require.True(e.t, st.Allocation[pools.StatAll].Current >= n && st.Allocation[pools.StatAll].Current <= n+int64(len(e.pending)),
		"allocations counted: %d, %d live, %d pending", st.Allocation[pools.StatAll].Current, n, len(e.pending))
	rb := st.RequestedBytes[pools.StatAll].Current
	require.True(e.t, rb >= req && rb <= req+pend, "requested bytes counted: %d, %d live, %d pending", rb, req, pend)
	require.Equal(e.t, e.sim().Used(0), uint64(st.ReservedBytes[pools.StatAll].Current)+extra, "driver memory vs reserved bytes")
	require.Equal(e.t, int64(e.sim().Live(0)), st.Segment[pools.StatAll].Current, "segments counted")
	require.Zero(e.t, e.sim().Violations(), "%v", e.sim().ViolationLog())
}

// nothingLost frees everything, lets all work complete, empties the cache
// and requires that the driver holds nothing of ours any more: no memory,
// no physical pages, no address range, no event.
func (e *fenv) nothingLost() {
	e.t.Helper()
	e.f.Clear()
	for p := range e.live {
		e.free(p)
	}
	e.sim().CompleteAll()
	require.NoError(e.t, e.a.EmptyCache(0))
	clear(e.pending)
	e.consistent(0)
	for dev := 0; dev < 2; dev++ {
		require.Zero(e.t, e.sim().Live(dev), "device %d: segments left", dev)
		require.Zero(e.t, e.sim().Handles(dev), "device %d: physical allocations left", dev)
		n, _ := e.sim().Reservations(dev)
		require.Zero(e.t, n, "device %d: address ranges left", dev)
	}
	require.Zero(e.t, e.sim().LiveEvents(), "events left")
	st := stats(e.t, e.a, 0)
	require.Zero(e.t, st.ReservedBytes[pools.StatAll].Current)
	require.Zero(e.t, st.Active[pools.StatAll].Current)
}

// usedOnSide frees p after recording a use of it on side, whose work (a
// delayed reader) is still running.
func (e *fenv) usedOnSide(p cuda.Ptr, side cuda.Stream) error {
	require.NoError(e.t, e.a.RecordStream(p, side))
	e.sim().Submit(side)
	err := e.a.Free(allocator.FreeRequest{Ptr: p, Size: e.live[p]})
	e.pending[p] = e.live[p]
	delete(e.live, p)
	return err
}

// notReusedUntil requires that a request like p's on stream s does not
// get p while side's work runs, and gets it back once it completed.
func (e *fenv) notReusedUntil(p cuda.Ptr, size uint64, s, side cuda.Stream) {
	e.t.Helper()
	q := e.malloc(size, s)
	require.NotEqual(e.t, p, q, "a block still read by another stream was reused")
	e.free(q)
	e.sim().Complete(side)
	r := e.malloc(size, s)
	require.Contains(e.t, []cuda.Ptr{p, q}, r)
	e.free(r)
}

// faultCase tests the call site named by its key in faultCases
// ("file:function.Method", "#n" for the nth call of a method in one
// function).
type faultCase struct {
	run func(t *testing.T)
	// unreachable says why the simulator cannot reach the site (no run).
	unreachable string
}

const (
	// Ordinary segments: the default is expandable segments with stitching.
	confOrdinary = "expandable_segments:False"
	// Expandable segments without stitching (which would move the pages
	// these cases count on finding where they were).
	confExpandable = "expandable_segments:True,stitch:False"
	// Page by page (the default maps 20 MiB at a time in large pools), for
	// the tests that count pages.
	confPages  = "expandable_segments:True,stitch:False,expandable_map_unit_mb:2"
	confStitch = "stitch:True,expandable_map_unit_mb:2"
)

var faultCases = map[string]faultCase{
	"allocator.go:New.DeviceCount": {run: func(t *testing.T) {
		f := fault.New(sim.New(sim.Options{}))
		r := f.Fail("DeviceCount", "", 0, errInjected)
		_, err := allocator.New(f, allocator.Config{})
		require.Equal(t, 1, f.Hits(r))
		require.ErrorIs(t, err, allocator.ErrDriver)
		require.Contains(t, err.Error(), "cudapool: init: counting devices")
		a, err := allocator.New(f, allocator.Config{})
		require.NoError(t, err)
		require.Equal(t, 1, a.DeviceCount())
	}},
	// The query of unannounced captures' streams (graphs.Router.Underway):
	// an error counts as a capture still running, so nothing is freed.
	"allocator.go:New.StreamCaptureInfo": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		cs := cuda.Stream(9)
		require.NoError(t, e.sim().BeginCapture(cs, cuda.CaptureModeThreadLocal))
		e.malloc(4096, cs) // met by the allocator: an automatic private pool
		require.NoError(t, e.sim().EndCapture(cs))
		// The capture ended, but the allocator cannot tell: it keeps
		// behaving as during a capture (the malloc works).
		r := e.fail("StreamCaptureInfo", "allocator.New.func", 0)
		p := e.malloc(4096, 1)
		e.fired(r)
		e.free(p)
		e.consistent(0)
		require.NoError(t, e.a.EmptyCache(0))
		require.Equal(t, 1, e.sim().Live(0), "only the automatic pool's segment is left")
		e.consistent(0)
	}},
	"request.go:(*Allocator).unannouncedCapture.StreamCaptureInfo": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("StreamCaptureInfo", "unannouncedCapture", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "querying the capture status of stream 0x1")
		e.consistent(0)
		e.malloc(4096, 1)
		e.nothingLost()
	}},
	"cuda/relaxed.go:WithThreadRelaxed.ExchangeCaptureMode": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("ExchangeCaptureMode", "withThreadRelaxed", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "allocating a 2097152-byte segment")
		require.Zero(t, e.sim().Live(0))
		e.consistent(0)
		e.malloc(4096, 1)
		e.nothingLost()
	}},
	// Switching the thread back failed after the allocation succeeded: the
	// allocation stands (the memory is the caller's) and a warning says
	// the thread may be left in relaxed mode.
	"cuda/relaxed.go:WithThreadRelaxed.ExchangeCaptureMode#2": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("ExchangeCaptureMode", "withThreadRelaxed", 1)
		e.malloc(4096, 1)
		e.fired(r)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "restoring the calling thread's capture mode")
		e.consistent(0)
		e.nothingLost()
	}},
	"device.go:(*device).newSegment.MemAlloc": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("MemAlloc", "newSegment", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 30 * MiB, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "allocating a 31457280-byte segment on device 0")
		e.consistent(0)
		// Out of memory from the driver instead: the retry sequence runs
		// (a cached segment is freed) and the malloc succeeds.
		p := e.malloc(2*MiB, 1)
		e.free(p)
		e.f.Fail("MemAlloc", "newSegment", 0, cuda.ErrOutOfMemory)
		e.malloc(30*MiB, 1)
		require.Equal(t, int64(1), stats(t, e.a, 0).NumAllocRetries)
		e.consistent(0)
		e.nothingLost()
	}},
	"device.go:(*device).newSegment.MemAllocRelaxed": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, true)
		r := e.fail("MemAllocRelaxed", "newSegment", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "allocating a 2097152-byte segment on device 0")
		e.consistent(0)
		e.malloc(4096, 1)
		require.Zero(t, e.f.Calls("MemAlloc"), "the relaxed path is the only one taken")
		e.nothingLost()
	}},
	// Freeing a cached segment fails: at empty_cache and at the OOM retry.
	// The segment stays cached and counted, and goes at the next try.
	"device.go:(*device).freeSegment.MemFree": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		p := e.malloc(4096, 1)
		e.free(p)
		r := e.fail("MemFree", "freeSegment", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "freeing cached segments on device 0")
		require.Equal(t, 1, e.sim().Live(0))
		e.consistent(0)
		require.NoError(t, e.a.EmptyCache(0))
		require.Zero(t, e.sim().Live(0))
		// The OOM retry: 600 MiB cached on stream 1, 600 MiB wanted on 2.
		p = e.malloc(600*MiB, 1)
		e.free(p)
		r = e.fail("MemFree", "freeSegment", 0)
		_, err = e.a.Malloc(&allocator.MallocRequest{Size: 600 * MiB, Stream: 2})
		e.fired(r)
		e.driverErr(err, "malloc", "freeing cached")
		e.consistent(0)
		e.malloc(600*MiB, 2)
		e.consistent(0)
		e.nothingLost()
	}},
	// Without announcements, a free asks whether the use streams capture;
	// an error there counts as not capturing (the event is recorded as
	// usual), and the block still waits for the use.
	"device.go:(*device).useCapturing.StreamCaptureInfo": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		p := e.malloc(4096, 1)
		r := e.fail("StreamCaptureInfo", "useCapturing", 0)
		require.NoError(t, e.usedOnSide(p, 5))
		e.fired(r)
		e.consistent(0)
		e.notReusedUntil(p, 4096, 1, 5)
		e.nothingLost()
	}},
	"device.go:(*device).capacity.MemGetInfo": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("MemGetInfo", "capacity", 0)
		err := e.a.SetMemoryFraction(0, 0.5)
		e.fired(r)
		e.driverErr(err, "set_memory_fraction", "reading device 0's memory size")
		require.NoError(t, e.a.SetMemoryFraction(0, 0.5))
		_, err = e.a.Malloc(&allocator.MallocRequest{Size: 600 * MiB, Stream: 1})
		require.ErrorIs(t, err, allocator.ErrOutOfMemory, "the fraction is in force")
		e.consistent(0)
		e.nothingLost()
	}},
	"device.go:(*device).outOfMemory.MemGetInfo": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("MemGetInfo", "outOfMemory", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 2 * GiB, Stream: 1})
		e.fired(r)
		require.ErrorIs(t, err, allocator.ErrOutOfMemory)
		require.Contains(t, err.Error(), "memory info unavailable: CUDA_ERROR_UNKNOWN")
		require.Equal(t, int64(1), stats(t, e.a, 0).NumOOMs)
		e.consistent(0)
		e.malloc(4096, 1)
		e.nothingLost()
	}},
	"device.go:(*device).outOfMemory.DeviceProcesses": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("DeviceProcesses", "outOfMemory", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 2 * GiB, Stream: 1})
		e.fired(r)
		require.ErrorIs(t, err, allocator.ErrOutOfMemory)
		require.Contains(t, err.Error(), "has a total capacity of 1024.00 MiB", "the message without the process list")
		require.NotContains(t, err.Error(), "this process has")
		e.consistent(0)
		e.malloc(4096, 1)
		e.nothingLost()
	}},
	"errors.go:(*Allocator).OOMText.DeviceProcesses": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 2 * GiB, Stream: 1})
		require.ErrorIs(t, err, allocator.ErrOutOfMemory)
		r := e.fail("DeviceProcesses", "OOMText", 0)
		text, ok := e.a.OOMText(err, 2*GiB)
		e.fired(r)
		require.True(t, ok)
		require.Contains(t, text, "free of 1024.00 MiB", "the message without the process list")
		require.NotContains(t, text, "in use on it")
		e.consistent(0)
		e.malloc(4096, 1)
		e.nothingLost()
	}},
	"mempool.go:(*Allocator).CacheInfo.MemGetInfo": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		r := e.fail("MemGetInfo", "CacheInfo", 0)
		_, err := e.a.CacheInfo(0, 0)
		e.fired(r)
		e.driverErr(err, "cache_info", "reading device 0's free memory")
		n, err := e.a.CacheInfo(0, 0)
		require.NoError(t, err)
		require.Equal(t, uint64(GiB), n)
		e.nothingLost()
	}},
	// The probe of VMM support fails: ordinary segments, with a warning
	// (expandable segments were named).
	"vmem/space.go:(*Space).Expandable.MemGranularity": {run: func(t *testing.T) {
		e := newFault(t, confExpandable, false)
		r := e.fail("MemGranularity", "", 0)
		e.malloc(4096, 1)
		e.fired(r)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "does not support virtual memory management")
		require.Equal(t, 1, e.sim().Live(0), "an ordinary segment")
		e.consistent(0)
		e.nothingLost()
		// By default (nothing named), quietly.
		e = newFault(t, "", false)
		r = e.fail("MemGranularity", "", 0)
		e.malloc(4096, 1)
		e.fired(r)
		require.Empty(t, e.warnings)
		require.Equal(t, 1, e.sim().Live(0), "an ordinary segment")
		e.consistent(0)
		e.nothingLost()
		// Ordinary segments never probe.
		e = newFault(t, confOrdinary, false)
		r = e.fail("MemGranularity", "", 0)
		e.malloc(4096, 1)
		require.Zero(t, e.f.Hits(r), "expandable_segments:False asks nothing of virtual memory management")
		require.Empty(t, e.warnings)
		require.Equal(t, 1, e.sim().Live(0), "an ordinary segment")
		e.consistent(0)
		e.nothingLost()
	}},
	"vmem/space.go:(*Space).Grow.MemAddressReserve": {run: func(t *testing.T) {
		e := newFault(t, confExpandable, false)
		r := e.fail("MemAddressReserve", "", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "reserving")
		n, _ := e.sim().Reservations(0)
		require.Zero(t, n)
		e.consistent(0)
		e.malloc(4096, 1)
		e.nothingLost()
	}},
	// The free-memory check before mapping is advice: without it, mapping
	// goes ahead.
	"vmem/mapper.go:(*Space).freeMemory.MemGetInfo": {run: func(t *testing.T) {
		e := newFault(t, confExpandable, false)
		r := e.fail("MemGetInfo", "mapper.Map", 0)
		e.malloc(3*MiB, 1)
		e.fired(r)
		e.consistent(0)
		e.nothingLost()
	}},
	// The second of three pages cannot be created: the first is released,
	// nothing is mapped.
	"vmem/mapper.go:(*Space).create.MemCreate": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		r := e.fail("MemCreate", "", 1)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "mapping memory for a 5242880-byte block")
		require.Zero(t, e.sim().Handles(0))
		e.consistent(0)
		e.malloc(5*MiB, 1)
		e.nothingLost()
	}},
	// The second of three pages cannot be mapped: the first stays mapped
	// (free, counted as reserved), the others are released.
	"vmem/mapper.go:mapper.Map.MemMap": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		r := e.fail("MemMap", "", 1)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "mapping memory for a 5242880-byte block")
		require.Equal(t, 1, e.sim().Handles(0))
		e.consistent(0)
		e.malloc(5*MiB, 1)
		e.consistent(0)
		e.nothingLost()
	}},
	// Access cannot be set: the pages are unmapped and released at once
	// (no capture under way).
	"vmem/mapper.go:mapper.Map.MemSetAccess": {run: func(t *testing.T) {
		e := newFault(t, confExpandable, false)
		r := e.fail("MemSetAccess", "", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "mapping memory")
		require.Zero(t, e.sim().Handles(0))
		require.Zero(t, e.sim().Mapped(0))
		e.consistent(0)
		p := e.malloc(5*MiB, 1)
		require.True(t, e.sim().Accessible(0, p, 5*MiB))
		e.nothingLost()
	}},
	// Access cannot be set on a growth that mapped lent pages: they are
	// unmapped from their new place and go back to their hole, where their
	// old mapping holds them; one whose unmap fails there is dropped (its
	// memory stays under the old mapping, uncounted, until the stream's
	// work is done and the lend ends).
	"vmem/mapper.go:mapper.Map.MemUnmap": {run: func(t *testing.T) {
		e, h := stitchScene(t, true)
		used := e.sim().Used(0)
		ra := e.fail("MemSetAccess", "", 0)
		ru := e.fail("MemUnmap", "mapper.Map", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 40 * MiB, Stream: 0})
		e.fired(ra)
		e.fired(ru)
		e.driverErr(err, "malloc", "mapping memory")
		require.Equal(t, used, e.sim().Used(0), "no new memory kept")
		require.True(t, e.sim().Accessible(0, h+2*MiB, 8*MiB), "the pages put back are where they were")
		e.consistent(2 * MiB) // the dropped page, under its old mapping
		e.sim().CompleteAll()
		e.malloc(40*MiB, 0) // a miss: the lend ends
		e.consistent(0)
		e.nothingLost()
	}},
	// A page that could not be released after a failed creation waits in
	// the spares, and goes at the next release of cached memory.
	"vmem/mapper.go:(*physicalMemory).dropHandles.MemRelease": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		e.fail("MemCreate", "", 1)
		r := e.fail("MemRelease", "dropHandles", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "mapping memory")
		require.Equal(t, 1, e.sim().Handles(0), "the spare page")
		e.consistent(2 * MiB)
		require.NoError(t, e.a.EmptyCache(0))
		require.Zero(t, e.sim().Handles(0))
		e.consistent(0)
		e.nothingLost()
	}},
	// A cuMemUnmap over a run of mappings fails: the run's mappings are
	// unmapped one by one. Where no run ever unmapped (a driver that takes
	// none), each is unmapped alone from then on; where runs did, the next
	// one is a run again. The same for a lent block's old mapping, at the
	// miss that unlends it.
	"vmem/mapper.go:(*Space).unmapRun.MemUnmap": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		e.free(e.malloc(5*MiB, 1))
		calls := e.f.Calls("MemUnmap")
		r := e.fail("MemUnmap", "unmapRun", 0)
		require.NoError(t, e.a.EmptyCache(0))
		e.fired(r)
		require.Equal(t, 4, e.f.Calls("MemUnmap")-calls, "the run, then its three pages")
		require.Zero(t, e.sim().Mapped(0))
		e.consistent(0)
		e.free(e.malloc(5*MiB, 1))
		calls = e.f.Calls("MemUnmap")
		require.NoError(t, e.a.EmptyCache(0))
		require.Equal(t, 3, e.f.Calls("MemUnmap")-calls, "page by page from then on")
		e.consistent(0)
		e.nothingLost()

		e = newFault(t, confPages, false)
		e.free(e.malloc(5*MiB, 1))
		calls = e.f.Calls("MemUnmap")
		require.NoError(t, e.a.EmptyCache(0))
		require.Equal(t, 1, e.f.Calls("MemUnmap")-calls, "one call for the three pages")
		e.free(e.malloc(5*MiB, 1))
		r = e.fail("MemUnmap", "unmapRun", 0)
		require.NoError(t, e.a.EmptyCache(0))
		e.fired(r)
		e.free(e.malloc(5*MiB, 1))
		calls = e.f.Calls("MemUnmap")
		require.NoError(t, e.a.EmptyCache(0))
		require.Equal(t, 1, e.f.Calls("MemUnmap")-calls, "runs again: they worked before")
		require.Zero(t, e.sim().Mapped(0))
		e.consistent(0)
		e.nothingLost()

		e, h := stitchScene(t, true)
		e.malloc(40*MiB, 0) // the busy hole's pages are lent
		e.sim().Complete(0)
		r = e.fail("MemUnmap", "unmapLent", 0)
		e.malloc(20*MiB, 2) // a miss: the markers allow unlending
		e.fired(r)
		require.Empty(t, e.warnings)
		require.False(t, e.sim().Accessible(0, h, 2*MiB), "the old mapping unmapped page by page")
		require.False(t, e.sim().Accessible(0, h+8*MiB, 2*MiB))
		e.consistent(0)
		e.nothingLost()
	}},
	// Unmapping a mapping alone fails (the second of a run of three, after
	// the run failed): the first page is unmapped, the others stay mapped;
	// an error, and the next empty_cache unmaps them. The old mapping of a
	// lent block: the miss unmaps its first page and warns; the next miss
	// unmaps the rest; at empty_cache, an error, and the next empty_cache
	// unmaps the rest.
	"vmem/mapper.go:(*Space).unmapRun.MemUnmap#2": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		e.free(e.malloc(5*MiB, 1))
		run := e.fail("MemUnmap", "unmapRun", 0)
		r := e.fail("MemUnmap", "unmapRun", 1)
		err := e.a.EmptyCache(0)
		e.fired(run)
		e.fired(r)
		e.driverErr(err, "empty_cache", "unmapping")
		require.Equal(t, uint64(4*MiB), e.sim().Mapped(0), "the first page unmapped alone")
		e.consistent(0)
		require.NoError(t, e.a.EmptyCache(0))
		require.Zero(t, e.sim().Mapped(0))
		e.nothingLost()

		e, h := stitchScene(t, true)
		e.malloc(40*MiB, 0) // the busy hole's pages are lent
		e.sim().Complete(0)
		run = e.fail("MemUnmap", "unmapLent", 0)
		r = e.fail("MemUnmap", "unmapLent", 1)
		e.malloc(20*MiB, 2)
		e.fired(run)
		e.fired(r)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "unmapping the old mapping of stitched page")
		require.False(t, e.sim().Accessible(0, h, 2*MiB))
		require.True(t, e.sim().Accessible(0, h+2*MiB, 8*MiB), "the last four pages are still mapped")
		e.consistent(0)
		e.malloc(20*MiB, 3)
		require.False(t, e.sim().Accessible(0, h+8*MiB, 2*MiB), "unmapped at the next miss")
		e.consistent(0)
		e.nothingLost()

		e, h = stitchScene(t, true)
		e.malloc(40*MiB, 0)
		run = e.fail("MemUnmap", "unmapLent", 0)
		r = e.fail("MemUnmap", "unmapLent", 0)
		err = e.a.EmptyCache(0)
		e.fired(run)
		e.fired(r)
		e.driverErr(err, "empty_cache", "unmapping the old mapping of stitched page")
		require.True(t, e.sim().Accessible(0, h, 10*MiB))
		e.consistent(0)
		require.NoError(t, e.a.EmptyCache(0))
		require.False(t, e.sim().Accessible(0, h, 2*MiB))
		e.nothingLost()
	}},
	"vmem/mapper.go:mapper.Free.MemAddressFree": {run: func(t *testing.T) {
		e := newFault(t, confExpandable, false)
		e.free(e.malloc(5*MiB, 1))
		r := e.fail("MemAddressFree", "", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "freeing the address range")
		n, _ := e.sim().Reservations(0)
		require.Equal(t, 1, n)
		e.consistent(0)
		e.malloc(5*MiB, 1) // the range is still usable
		e.nothingLost()
	}},
	"vmem/mapper.go:(*physicalMemory).releaseOrphan.MemUnmap": {run: func(t *testing.T) {
		e := orphaned(t)
		r := e.fail("MemUnmap", "releaseOrphan", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "releasing memory whose mapping failed")
		require.NotZero(t, e.sim().Mapped(0))
		require.NoError(t, e.a.EmptyCache(0))
		e.nothingLost()
	}},
	"vmem/mapper.go:(*physicalMemory).releaseOrphan.MemRelease": {run: func(t *testing.T) {
		e := orphaned(t)
		r := e.fail("MemRelease", "releaseOrphan", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "releasing memory whose mapping failed")
		require.NoError(t, e.a.EmptyCache(0))
		e.nothingLost()
	}},
	"vmem/mapper.go:(*physicalMemory).releaseOrphans.MemRelease": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		e.fail("MemCreate", "", 1)
		e.fail("MemRelease", "dropHandles", 0) // one spare page
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 1})
		require.Error(t, err)
		r := e.fail("MemRelease", "releaseOrphans", 0)
		err = e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "releasing spare physical memory")
		require.Equal(t, 1, e.sim().Handles(0))
		e.consistent(2 * MiB)
		e.nothingLost()
	}},
	// empty_cache and the OOM retry synchronize before unmapping free
	// pages: if that fails, nothing is unmapped, the error says so, and
	// the next try works.
	"vmem/space.go:(*Space).UnmapFree.DeviceSynchronize": {run: func(t *testing.T) {
		e := newFault(t, confPages, false)
		e.free(e.malloc(5*MiB, 1))
		r := e.fail("DeviceSynchronize", "UnmapFree", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "unmapping the free pages of expandable segments on device 0: synchronizing the device first")
		require.Equal(t, uint64(6*MiB), e.sim().Mapped(0), "nothing unmapped")
		e.consistent(0)
		require.NoError(t, e.a.EmptyCache(0))
		require.Zero(t, e.sim().Mapped(0))
		// The OOM retry: 600 MiB cached on stream 1, 600 MiB wanted on 2.
		e.free(e.malloc(600*MiB, 1))
		r = e.fail("DeviceSynchronize", "UnmapFree", 0)
		_, err = e.a.Malloc(&allocator.MallocRequest{Size: 600 * MiB, Stream: 2})
		e.fired(r)
		e.driverErr(err, "malloc", "synchronizing the device first")
		e.consistent(0)
		e.malloc(600*MiB, 2)
		e.nothingLost()
	}},
	// Stitching is an optimization: a mark (events.Tracker.Advance) that
	// cannot be created, recorded or queried (or a capture status that
	// cannot be read) leaves its stream uncertified for this miss, which
	// maps new memory instead of moving the stream's idle pages; the next
	// miss moves them. (The marks' creation and queries are the events
	// package's call sites, tested with them below.)
	"virtual.go:(*device).recordable.StreamCaptureInfo": {run: func(t *testing.T) {
		e, h := stitchScene(t, false)
		r := e.fail("StreamCaptureInfo", "recordable", 0)
		e.stitchMiss(r, h)
	}},
	// Under a memory fraction the growth maps less than the unit that
	// stitching moved pages for: the moved pages left over are released;
	// one whose release fails waits in the spares for the next release of
	// cached memory. The same for the pages empty_cache unmaps.
	"vmem/mapper.go:(*physicalMemory).releaseSpares.MemRelease": {run: func(t *testing.T) {
		e := newFault(t, "stitch:True", false) // the 20 MiB unit
		x := e.malloc(10*MiB, 0)               // stream 0 maps 20 MiB
		e.malloc(2*MiB, 0)
		e.free(x) // nine whole free pages around the 2 MiB block
		require.NoError(t, e.a.SetMemoryFraction(0, 21.0/1024))
		r := e.fail("MemRelease", "releaseSpares", 0)
		p := e.malloc(3*MiB, 1) // nine pages moved, two mapped
		e.fired(r)
		require.True(t, e.sim().Accessible(0, p, 3*MiB))
		st, err := e.a.StitchStats(0)
		require.NoError(t, err)
		require.Equal(t, int64(2), st.Remaps)
		e.consistent(2 * MiB)
		require.NoError(t, e.a.EmptyCache(0))
		e.consistent(0)
		e.nothingLost()

		// The pages empty_cache unmapped: the page counts as unmapped, its
		// handle waits in the spares.
		e = newFault(t, confPages, false)
		e.free(e.malloc(5*MiB, 1))
		r = e.fail("MemRelease", "UnmapFree", 0)
		require.NoError(t, e.a.EmptyCache(0))
		e.fired(r)
		require.Equal(t, 1, e.sim().Handles(0))
		e.consistent(2 * MiB)
		require.NoError(t, e.a.EmptyCache(0))
		e.nothingLost()
	}},
	// Synchronizing before unmapping the old mappings of lent pages fails:
	// they stay (a kernel may still use them), the error says so, at the
	// OOM retry and at empty_cache, and the next empty_cache unmaps them.
	"vmem/stitch.go:(*Space).releaseStitch.DeviceSynchronize": {run: func(t *testing.T) {
		e, h := stitchScene(t, true)
		e.malloc(40*MiB, 0) // the busy hole's pages are lent
		st, err := e.a.StitchStats(0)
		require.NoError(t, err)
		require.Equal(t, int64(5), st.Lent)
		require.True(t, e.sim().Accessible(0, h, 10*MiB), "the old mapping stays")
		e.consistent(0)
		r := e.fail("DeviceSynchronize", "releaseStitch", 0)
		_, err = e.a.Malloc(&allocator.MallocRequest{Size: 2 * GiB, Stream: 2})
		e.fired(r)
		e.driverErr(err, "malloc", "synchronizing device 0 before unmapping the old mappings of stitched pages")
		r = e.fail("DeviceSynchronize", "releaseStitch", 0)
		err = e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "synchronizing device 0 before unmapping the old mappings of stitched pages")
		require.True(t, e.sim().Accessible(0, h, 10*MiB), "the old mapping stays")
		e.consistent(0)
		require.NoError(t, e.a.EmptyCache(0))
		require.False(t, e.sim().Accessible(0, h, 2*MiB))
		e.consistent(0)
		e.nothingLost()
	}},
	// Synchronizing the device for other streams' pages fails: a warning,
	// and new memory is mapped; the hole's pages move at the next miss
	// that synchronizes.
	"vmem/stitch.go:(*Space).stitchFor.DeviceSynchronize": {run: func(t *testing.T) {
		e := newFault(t, confStitch, false)
		h := e.malloc(20*MiB, 1)
		e.malloc(2*MiB, 1)
		e.free(h)
		used := e.sim().Used(0)
		r := e.fail("DeviceSynchronize", "stitchFor", 0)
		e.malloc(16*MiB, 2)
		e.fired(r)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "synchronizing device 0 to move other streams' idle pages (new memory is mapped instead)")
		st := stitchStats(t, e.a)
		require.Zero(t, st.Remaps)
		require.Zero(t, st.Syncs)
		require.Equal(t, used+16*MiB, e.sim().Used(0), "new memory instead")
		require.True(t, e.sim().Accessible(0, h, 20*MiB), "the hole's pages stay")
		e.consistent(0)
		used = e.sim().Used(0)
		e.malloc(20*MiB, 3)
		st = stitchStats(t, e.a)
		require.Equal(t, int64(1), st.Syncs)
		require.Equal(t, int64(10), st.Remaps, "the hole's pages moved at the next miss")
		require.Equal(t, used, e.sim().Used(0))
		e.consistent(0)
		e.nothingLost()
	}},
	"uncached.go:(*Allocator).mallocUncached.MemAlloc": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.SetCaching(false)
		r := e.fail("MemAlloc", "mallocUncached", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "(caching is off)")
		e.malloc(4096, 1)
		require.Equal(t, 1, e.sim().Live(0))
		e.nothingLostUncached()
	}},
	"uncached.go:(*Allocator).mallocUncached.MemAllocRelaxed": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, true)
		e.a.SetCaching(false)
		r := e.fail("MemAllocRelaxed", "mallocUncached", 0)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "(caching is off)")
		e.malloc(4096, 1)
		e.nothingLostUncached()
	}},
	"uncached.go:(*Allocator).freeUncached.MemFree": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.SetCaching(false)
		p := e.malloc(4096, 1)
		r := e.fail("MemFree", "freeUncached", 0)
		err := e.a.Free(allocator.FreeRequest{Ptr: p, Size: 4096})
		e.fired(r)
		e.driverErr(err, "free", "allocated while caching was off")
		require.Equal(t, 1, e.sim().Live(0), "still allocated, still known")
		e.free(p)
		require.Zero(t, e.sim().Live(0))
		e.nothingLostUncached()
	}},
	// graph_capture_record_stream_reuse: a failed topology query warns and
	// the block waits, as without the option; nothing is reused early.
	"graphs/reuse.go:(*Reuse).NoteFree.StreamCaptureGraph": {run: func(t *testing.T) {
		e, data1 := reuseScene(t)
		r := e.fail("StreamCaptureGraph", "NoteFree", 0)
		require.NoError(t, e.usedOnSide(data1, 2))
		e.fired(r)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "cudapool: capture reuse: reading the capture graph of stream 0x1")
		fork(t, e.sim(), 2, 1) // the join that would let it be reused
		p := e.malloc(32, 1)
		require.NotEqual(t, data1, p, "no markers: the block waits for the capture's end")
		e.endReuseScene()
		e.nothingLost()
	}},
	"graphs/reuse.go:(*Reuse).Reclaim.StreamCaptureGraph": {run: func(t *testing.T) {
		e, data1 := reuseScene(t)
		require.NoError(t, e.usedOnSide(data1, 2))
		fork(t, e.sim(), 2, 1)
		r := e.fail("StreamCaptureGraph", "reclaimInCapture", 0)
		p := e.malloc(32, 1)
		e.fired(r)
		require.NotEqual(t, data1, p)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "reading the capture graph of stream 0x1")
		q := e.malloc(32, 1) // the next malloc walks the graph
		require.Equal(t, data1, q, "reused once the graph could be read")
		delete(e.pending, data1)
		e.endReuseScene()
		e.nothingLost()
	}},
	"graphs/reuse.go:(*Reuse).Reclaim.GraphNodeDependencies": {run: func(t *testing.T) {
		e, data1 := reuseScene(t)
		require.NoError(t, e.usedOnSide(data1, 2))
		fork(t, e.sim(), 2, 1)
		r := e.fail("GraphNodeDependencies", "", 0)
		p := e.malloc(32, 1)
		e.fired(r)
		require.NotEqual(t, data1, p)
		require.Len(t, e.warnings, 1)
		q := e.malloc(32, 1)
		require.Equal(t, data1, q, "reused once the graph could be read")
		delete(e.pending, data1)
		e.endReuseScene()
		e.nothingLost()
	}},
	"ipc.go:(*Allocator).segmentIpcHandle.IpcGetMemHandle": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		p := e.malloc(4096, 1)
		r := e.fail("IpcGetMemHandle", "", 0)
		_, _, _, err := e.a.IpcHandle(p)
		e.fired(r)
		e.driverErr(err, "ipc_handle", "cuIpcGetMemHandle of the segment")
		_, _, _, err = e.a.IpcHandle(p)
		require.NoError(t, err)
		// The same call site serves PyTorch's handle of the segment.
		r = e.fail("IpcGetMemHandle", "", 0)
		_, _, _, err = e.a.ShareIpcHandle(p)
		e.fired(r)
		e.driverErr(err, "ipc_share", "cuIpcGetMemHandle of the segment")
		_, _, _, err = e.a.ShareIpcHandle(p)
		require.NoError(t, err)
		e.nothingLost()
	}},
	"ipc.go:(*Allocator).IpcOpen.IpcOpenMemHandle": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		p := e.malloc(4096, 1)
		h, _, _, err := e.a.IpcHandle(p)
		require.NoError(t, err)
		r := e.fail("IpcOpenMemHandle", "", 0)
		_, err = e.a.IpcOpen(1, h)
		e.fired(r)
		e.driverErr(err, "ipc_open", "cuIpcOpenMemHandle on device 1")
		q, err := e.a.IpcOpen(1, h)
		require.NoError(t, err)
		require.NoError(t, e.a.IpcClose(q))
		m, refs := e.sim().IpcMappings(1)
		require.Zero(t, m+refs, "no mapping left open")
		e.nothingLost()
	}},
	"ipc.go:(*Allocator).IpcOpen.IpcCloseMemHandle": {unreachable: "it drops the driver's second reference when two different handles of one allocation are opened; the simulator, like the driver, gives one allocation a single handle"},
	// Closing the last reference fails: the mapping is forgotten (the
	// caller asked to close it; its address is unusable either way) and the
	// error says so.
	"ipc.go:(*Allocator).ipcClose.IpcCloseMemHandle": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		p := e.malloc(4096, 1)
		h, _, _, err := e.a.IpcHandle(p)
		require.NoError(t, err)
		q, err := e.a.IpcOpen(1, h)
		require.NoError(t, err)
		r := e.fail("IpcCloseMemHandle", "", 0)
		err = e.a.IpcClose(q)
		e.fired(r)
		e.driverErr(err, "ipc_close", "cuIpcCloseMemHandle of the mapping")
		require.ErrorIs(t, e.a.IpcClose(q), allocator.ErrUnknownPointer, "closed once only")
		// The driver's mapping is still open: close it as a retry would.
		require.NoError(t, e.sim().IpcCloseMemHandle(1, q))
		e.nothingLost()
	}},
	// Recording the event of a freed block with uses fails: the free says
	// so, the block is deferred, and the next malloc records it again.
	"events/events.go:(*Tracker).Insert.EventRecord": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		r := e.fail("EventRecord", "", 0)
		err := e.usedOnSide(p, 5)
		e.fired(r)
		e.driverErr(err, "free", "recording events for the streams that use")
		e.consistent(0)
		e.notReusedUntil(p, 4096, 1, 5)
		e.nothingLost()
	}},
	"events/events.go:(*Tracker).event.EventCreate": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		r := e.fail("EventCreate", "", 0)
		err := e.usedOnSide(p, 5)
		e.fired(r)
		e.driverErr(err, "free", "recording events for the streams that use")
		e.consistent(0)
		e.notReusedUntil(p, 4096, 1, 5)
		e.nothingLost()

		// A stitching mark's event: a miss under the limit records a mark
		// behind the kernel (the pool's only event); the next miss needs
		// a second one, which cannot be made. Nothing is lost, and once
		// the kernel has completed the next miss moves the hole's pages.
		e, h := stitchScene(t, true)
		e.malloc(12*MiB, 1)
		require.Equal(t, 1, e.sim().LiveEvents())
		r = e.fail("EventCreate", "Advance", 0)
		used := e.sim().Used(0)
		e.malloc(40*MiB, 3) // (stream 3's first growth: stream 0 alone is marked)
		e.fired(r)
		st, err := e.a.StitchStats(0)
		require.NoError(t, err)
		require.Zero(t, st.Remaps)
		require.Positive(t, st.SkippedBusy)
		require.Equal(t, used+40*MiB, e.sim().Used(0), "new memory instead")
		require.True(t, e.sim().Accessible(0, h, 10*MiB), "the hole's pages stay")
		e.consistent(0)
		e.sim().Complete(0)
		used = e.sim().Used(0)
		e.malloc(20*MiB, 2)
		st, err = e.a.StitchStats(0)
		require.NoError(t, err)
		require.Equal(t, int64(5), st.Remaps, "the hole's pages moved at the next miss")
		require.False(t, e.sim().Accessible(0, h, 2*MiB))
		require.Equal(t, used+10*MiB, e.sim().Used(0))
		e.consistent(0)
		e.nothingLost()
	}},
	// A stitching mark cannot be recorded: its event goes back to the
	// pool, the stream stays uncertified for this miss.
	"events/events.go:(*Tracker).mark.EventRecord": {run: func(t *testing.T) {
		e, h := stitchScene(t, false)
		r := e.fail("EventRecord", "Advance", 0)
		e.stitchMiss(r, h)
	}},
	// A query fails: malloc warns and succeeds; the block's event is
	// dropped and recorded anew, and the block still waits for its use.
	// A stitching mark's query fails: the mark stays pending, queried again
	// at the next miss.
	"events/events.go:(*Tracker).query.EventQuery": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		require.NoError(t, e.usedOnSide(p, 5))
		r := e.fail("EventQuery", "", 0)
		q := e.malloc(4096, 1)
		e.fired(r)
		require.NotEqual(t, p, q)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "querying the events of pending frees on device 0")
		e.consistent(0)
		e.free(q)
		e.notReusedUntil(p, 4096, 1, 5)
		e.nothingLost()

		// The query of the mark just recorded (stream 0 has none pending,
		// so it is queried at once).
		e, h := stitchScene(t, false)
		r = e.fail("EventQuery", "Advance", 0)
		e.stitchMiss(r, h)

		// The query of a pending mark: a miss under the limit records one
		// behind the kernel; the kernel completes; the query fails.
		e, h = stitchScene(t, true)
		e.malloc(12*MiB, 1) // 24 MiB reserved: no stitching
		e.sim().Complete(0)
		r = e.fail("EventQuery", "Advance", 0)
		e.stitchMiss(r, h)
	}},
	"events/events.go:(*Tracker).drainQueue.EventSynchronize": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		require.NoError(t, e.usedOnSide(p, 5))
		r := e.fail("EventSynchronize", "", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "synchronizing the events of pending frees")
		e.consistent(0)
		e.notReusedUntil(p, 4096, 1, 5)
		e.nothingLost()
	}},
	// After a failed query the event is destroyed; if that fails too, the
	// event is kept and destroyed with the spare events (empty_cache).
	"events/events.go:(*Tracker).drainQueue.EventDestroy": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		require.NoError(t, e.usedOnSide(p, 5))
		e.fail("EventQuery", "", 0)
		r := e.fail("EventDestroy", "drain", 0)
		q := e.malloc(4096, 1)
		e.fired(r)
		e.free(q)
		e.consistent(0)
		e.notReusedUntil(p, 4096, 1, 5)
		e.nothingLost()
	}},
	// Destroying an event kept after a failed destroy fails again: the
	// error says so, the event is kept for the next empty_cache.
	"events/events.go:(*Tracker).DestroySpare.EventDestroy": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		require.NoError(t, e.usedOnSide(p, 5))
		e.fail("EventQuery", "", 0)
		e.fail("EventDestroy", "drain", 0)
		e.free(e.malloc(4096, 1))
		r := e.fail("EventDestroy", "DestroySpare", 0)
		e.sim().Complete(5)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "destroying cached events on device 0")
		require.Equal(t, 2, e.sim().LiveEvents(), "the broken event and the block's new one")
		e.nothingLost()
	}},
	"events/events.go:(*Tracker).DestroySpare.EventDestroy#2": {run: func(t *testing.T) {
		e := newFault(t, confOrdinary, false)
		e.a.ExpectAnnouncements()
		p := e.malloc(4096, 1)
		require.NoError(t, e.usedOnSide(p, 5))
		e.sim().Complete(5)
		e.free(e.malloc(4096, 1)) // the event completes and goes to the spares
		r := e.fail("EventDestroy", "DestroySpare", 0)
		err := e.a.EmptyCache(0)
		e.fired(r)
		e.driverErr(err, "empty_cache", "destroying cached events on device 0")
		require.Equal(t, 1, e.sim().LiveEvents())
		e.nothingLost()
	}},
}

// reuseScene begins a thread-local capture on stream 1 into pool {1,0}
// with graph_capture_record_stream_reuse on, forks stream 2 from it, and
// returns a block allocated on stream 1 for stream 2 to read.
func reuseScene(t *testing.T) (*fenv, cuda.Ptr) {
	e := newFault(t, "graph_capture_record_stream_reuse:True", false)
	beginCapture(t, e.a, e.sim(), allocator.PoolID{A: 1}, 1, cuda.CaptureModeThreadLocal)
	data1 := e.malloc(32, 1)
	fork(t, e.sim(), 1, 2)
	return e, data1
}

// endReuseScene ends reuseScene's capture and releases its pool.
func (e *fenv) endReuseScene() {
	e.t.Helper()
	for p := range e.live { // the capture's blocks go back to its pool
		e.free(p)
	}
	require.NoError(e.t, e.sim().EndCapture(1))
	require.NoError(e.t, e.a.EndAllocateToPool(0, allocator.PoolID{A: 1}))
	require.NoError(e.t, e.a.ReleasePool(0, allocator.PoolID{A: 1}))
}

// stitchScene returns a stitching allocator whose limit is 40 MiB (a
// 40 MiB block was mapped and emptied) holding 12 MiB on the legacy stream
// (0), which every miss marks (events' "Stream progress"; another stream
// is marked at its own misses only): a free 10 MiB hole of five pages h
// before a live 2 MiB block; with busy, a kernel queued on stream 0 still
// uses the hole.
func stitchScene(t *testing.T, busy bool) (*fenv, cuda.Ptr) {
	e := newFault(t, confStitch, false)
	e.free(e.malloc(40*MiB, 0))
	require.NoError(t, e.a.EmptyCache(0))
	h := e.malloc(10*MiB, 0)
	e.malloc(2*MiB, 0)
	if busy {
		e.sim().Use(0, 0, h, 10*MiB)
	}
	e.free(h)
	e.consistent(0)
	return e, h
}

// stitchMiss: the fault r, met by a miss on stream 1 that would move the
// pages of stitchScene's hole h, leaves them where they are (new memory is
// mapped instead); the next miss moves them.
func (e *fenv) stitchMiss(r *fault.Rule, h cuda.Ptr) {
	e.t.Helper()
	used := e.sim().Used(0)
	e.malloc(40*MiB, 1)
	e.fired(r)
	st, err := e.a.StitchStats(0)
	require.NoError(e.t, err)
	require.Zero(e.t, st.Remaps)
	require.Positive(e.t, st.SkippedBusy)
	require.Equal(e.t, used+40*MiB, e.sim().Used(0), "new memory instead")
	require.True(e.t, e.sim().Accessible(0, h, 10*MiB), "the hole's pages stay")
	e.consistent(0)
	used = e.sim().Used(0)
	e.malloc(20*MiB, 2)
	st, err = e.a.StitchStats(0)
	require.NoError(e.t, err)
	require.Equal(e.t, int64(5), st.Remaps, "the hole's pages moved at the next miss")
	require.False(e.t, e.sim().Accessible(0, h, 2*MiB))
	require.Equal(e.t, used+10*MiB, e.sim().Used(0))
	e.consistent(0)
	e.nothingLost()
}

// nothingLostUncached frees what is left with caching off, then checks
// that the driver holds nothing.
func (e *fenv) nothingLostUncached() {
	e.t.Helper()
	for p := range e.live {
		e.free(p)
	}
	require.Zero(e.t, e.sim().Live(0))
	e.a.SetCaching(true)
	e.nothingLost()
}

// orphaned returns an allocator holding physical memory whose access could
// not be set during a capture (parked until the capture ends).
func orphaned(t *testing.T) *fenv {
	e := newFault(t, confPages, false)
	cs := cuda.Stream(9)
	pool := allocator.PoolID{A: 1}
	require.NoError(t, e.a.BeginAllocateToPool(0, pool, func(s cuda.Stream) bool { return s == cs }))
	require.NoError(t, e.sim().BeginCapture(cs, cuda.CaptureModeGlobal))
	r := e.fail("MemSetAccess", "", 0)
	_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: cs})
	e.fired(r)
	e.driverErr(err, "malloc", "mapping memory")
	require.NoError(t, e.sim().EndCapture(cs))
	require.NoError(t, e.a.EndAllocateToPool(0, pool))
	require.NoError(t, e.a.ReleasePool(0, pool))
	require.Equal(t, 3, e.sim().Handles(0), "the pages wait for the end of the capture")
	e.consistent(6 * MiB)
	return e
}

func TestFaultInjection(t *testing.T) {
	keys := make([]string, 0, len(faultCases))
	for k := range faultCases {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		c := faultCases[k]
		t.Run(k, func(t *testing.T) {
			if c.run == nil {
				t.Skip("unreachable on the simulator: " + c.unreachable)
			}
			c.run(t)
		})
	}
}

// The pages a capture mapped ahead are unmapped when it ends, holding the
// capture gate: a capture beginning on another device meanwhile waits
// (else the unmap would invalidate it; the soak found it).
func TestTrimUnusedHoldsTheGate(t *testing.T) {
	// A range made page by page, then grown with the 20 MiB unit: the
	// pages mapped ahead are single physical allocations, which trimUnused
	// can unmap (a range of 20 MiB chunks keeps a chunk it touched).
	e := newFault(t, confPages, false)
	g := allocator.PoolID{A: 1}
	const cs = cuda.Stream(7)
	beginCapture(t, e.a, e.sim(), g, cs, cuda.CaptureModeGlobal)
	p := e.malloc(3*MiB, cs)
	require.NoError(t, e.sim().EndCapture(cs))
	require.NoError(t, e.a.EndAllocateToPool(0, g))
	cfg, _, err := allocator.ParseConfig(confExpandable)
	require.NoError(t, err)
	e.a.Configure(cfg)
	beginCapture(t, e.a, e.sim(), g, cs, cuda.CaptureModeGlobal)
	q := e.malloc(2*MiB, cs)
	require.NoError(t, e.sim().EndCapture(cs))
	began := make(chan error, 1)
	r := e.f.Before("MemUnmap", "trimUnused", func() {
		go func() {
			began <- e.a.BeginAllocateToPool(1, allocator.PoolID{A: 2}, func(cuda.Stream) bool { return false })
		}()
		select {
		case err := <-began:
			t.Error("a capture began on device 1 while device 0 unmapped")
			began <- err
		case <-time.After(50 * time.Millisecond):
		}
	})
	require.NoError(t, e.a.EndAllocateToPool(0, g))
	e.fired(r)
	require.NoError(t, <-began, "it began once the unmapping was done")
	require.Equal(t, uint64(6*MiB), e.sim().Mapped(0), "three pages left")
	require.NoError(t, e.a.EndAllocateToPool(1, allocator.PoolID{A: 2}))
	require.NoError(t, e.a.ReleasePool(1, allocator.PoolID{A: 2}))
	e.free(p)
	e.free(q)
	require.NoError(t, e.a.ReleasePool(0, g))
	require.NoError(t, e.a.ReleasePool(0, g))
	e.nothingLost()
}

// TestFaultCallSitesCovered reads the source of the allocator and of the
// packages that call the driver for it (events, vmem, graphs, cuda), finds
// every call of a driver method, and requires a fault case for each; it
// also requires the fault driver to implement every method of every driver
// interface (so that it cannot miss one silently).
func TestFaultCallSitesCovered(t *testing.T) {
	sites, methods := driverCallSites(t)
	require.NotEmpty(t, sites)
	var missing, stale []string
	for _, s := range sites {
		if _, ok := faultCases[s]; !ok {
			missing = append(missing, s)
		}
	}
	have := map[string]bool{}
	for _, s := range sites {
		have[s] = true
	}
	for k := range faultCases {
		if !have[k] {
			stale = append(stale, k)
		}
	}
	sort.Strings(missing)
	sort.Strings(stale)
	require.Empty(t, missing, "driver call sites without a fault test (add them to faultCases)")
	require.Empty(t, stale, "fault tests of call sites that no longer exist")
	ft := reflect.TypeOf(&fault.Relaxed{})
	for m := range methods {
		_, ok := ft.MethodByName(m)
		require.True(t, ok, "cuda/sim/fault does not implement driver method %s", m)
	}
}

// TestFaultDriverIsTransparent: with no rule, the fault driver changes
// nothing (the randomized machine's checks pass through it).
func TestFaultDriverIsTransparent(t *testing.T) {
	e := newFault(t, confExpandable, true)
	p := e.malloc(5*MiB, 1)
	require.NoError(t, e.usedOnSide(p, 5))
	e.notReusedUntil(p, 5*MiB, 1, 5)
	e.nothingLost()
	require.Positive(t, e.f.Calls("MemCreate"))
	require.Empty(t, e.warnings)
}

// outsideAllocator are the files of the scanned packages whose driver
// calls the allocator never makes, which their own package's tests fail on
// the simulator: none now (vmem's imports of other processes' memory are
// the allocator's through share.go, its pinned copies, the Copier, through
// pause by tag: pause_fault_test.go).
var outsideAllocator = map[string]bool{}

// infallible are driver methods that cannot fail (facts of the process,
// with no error to inject): their calls are no fault sites.
var infallible = map[string]bool{"PID": true, "FDLimit": true}

// driverCallSites parses the non-test Go files of allocator/, events/,
// vmem/ (but for outsideAllocator's), graphs/ and cuda/ and returns the
// call sites of driver methods
// ("file:function.Method", "#n" for repeats) and the set of driver methods.
// Driver interfaces are the types named Driver and those the code asserts a
// driver to (drv.(vmem.Driver)); calls count when made on a driver: an
// expression ending in drv or vmm, or a variable assigned from such an
// assertion.
func driverCallSites(t *testing.T) ([]string, map[string]bool) {
	type file struct {
		name, pkg string
		f         *ast.File
	}
	fset := token.NewFileSet()
	var files []file
	for _, dir := range []string{".", "../events", "../vmem", "../graphs", "../cuda"} {
		names, err := filepath.Glob(filepath.Join(dir, "*.go"))
		require.NoError(t, err)
		for _, n := range names {
			if strings.HasSuffix(n, "_test.go") || outsideAllocator[filepath.Join(filepath.Base(dir), filepath.Base(n))] {
				continue
			}
			src, err := os.ReadFile(n)
			require.NoError(t, err)
			f, err := parser.ParseFile(fset, n, src, 0)
			require.NoError(t, err)
			name := filepath.Base(n)
			if dir != "." {
				name = filepath.Base(dir) + "/" + name
			}
			files = append(files, file{name, f.Name.Name, f})
		}
	}
	// Interfaces by name, and which are driver interfaces.
	ifaces := map[string]*ast.InterfaceType{}
	driverIfaces := map[string]bool{"allocator.Driver": true}
	driverVars := map[string]bool{}
	isDriverExpr := func(x ast.Expr) bool {
		s := exprString(x)
		return strings.HasSuffix(s, "drv") || strings.HasSuffix(s, "vmm") || driverVars[s]
	}
	for _, fl := range files {
		ast.Inspect(fl.f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.TypeSpec:
				if it, ok := n.Type.(*ast.InterfaceType); ok {
					ifaces[fl.pkg+"."+n.Name.Name] = it
				}
			case *ast.TypeAssertExpr:
				if n.Type != nil && strings.HasSuffix(exprString(n.X), "drv") {
					name := exprString(n.Type)
					if !strings.Contains(name, ".") {
						name = fl.pkg + "." + name
					}
					driverIfaces[name] = true
				}
			case *ast.AssignStmt:
				if len(n.Rhs) == 1 {
					if ta, ok := n.Rhs[0].(*ast.TypeAssertExpr); ok && strings.HasSuffix(exprString(ta.X), "drv") {
						driverVars[exprString(n.Lhs[0])] = true
					}
				}
			}
			return true
		})
	}
	methods := map[string]bool{}
	var addMethods func(name string)
	addMethods = func(name string) {
		it := ifaces[name]
		require.NotNil(t, it, "interface %s not found", name)
		for _, m := range it.Methods.List {
			if len(m.Names) == 0 { // embedded: events.Driver, or one of the same package
				emb := exprString(m.Type)
				if !strings.Contains(emb, ".") {
					emb = strings.Split(name, ".")[0] + "." + emb
				}
				addMethods(emb)
				continue
			}
			for _, n := range m.Names {
				methods[n.Name] = true
			}
		}
	}
	for name := range driverIfaces {
		addMethods(name)
	}
	var sites []string
	for _, fl := range files {
		for _, decl := range fl.f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			fn := fd.Name.Name
			if fd.Recv != nil {
				fn = exprString(fd.Recv.List[0].Type) + "." + fn
				if strings.HasPrefix(fn, "*") {
					fn = "(" + strings.Replace(fn, ".", ").", 1)
				}
			}
			seen := map[string]int{}
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok || !methods[sel.Sel.Name] || infallible[sel.Sel.Name] || !isDriverExpr(sel.X) {
					return true
				}
				key := fl.name + ":" + fn + "." + sel.Sel.Name
				seen[key]++
				if seen[key] > 1 {
					key += fmt.Sprintf("#%d", seen[key])
				}
				sites = append(sites, key)
				return true
			})
		}
	}
	return sites, methods
}

func exprString(x ast.Expr) string {
	switch x := x.(type) {
	case *ast.Ident:
		return x.Name
	case *ast.SelectorExpr:
		return exprString(x.X) + "." + x.Sel.Name
	case *ast.StarExpr:
		return "*" + exprString(x.X)
	case *ast.ParenExpr:
		return exprString(x.X)
	}
	return fmt.Sprintf("%T", x)
}

// A dependency query that fails in the middle of a walk: the nodes already
// walked may have lost the dependencies that were still on the stack, so
// the walk is forgotten and the next malloc walks afresh and reuses.
func TestFaultCaptureReuseMidWalk(t *testing.T) {
	e, data1 := reuseScene(t)
	require.NoError(t, e.usedOnSide(data1, 2))
	fork(t, e.sim(), 2, 1)
	e.sim().Submit(1) // a kernel after the join: two nodes to walk
	r := e.fail("GraphNodeDependencies", "", 1)
	p := e.malloc(32, 1)
	e.fired(r)
	require.NotEqual(t, data1, p)
	q := e.malloc(32, 1)
	require.Equal(t, data1, q, "reused by the next walk")
	delete(e.pending, data1)
	e.endReuseScene()
	e.nothingLost()
}
