// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"encoding/json"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// Expandable segments without stitching (on by default with them), page by
// page: these tests count pages and find them where they left them.
const expandable = "expandable_segments:True,stitch:False,expandable_map_unit_mb:2"

// Blocks grow across page boundaries inside one mapped range; nothing is
// allocated with cuMemAlloc, and reserved memory is mapped memory.
func TestExpandableGrowsAcrossPages(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, expandable)
	p1 := mustMalloc(t, a, 0, 3*MiB, 0)
	p2 := mustMalloc(t, a, 0, 3*MiB, 0)
	require.Equal(t, p1+3*MiB, p2, "the second block continues the first, across a page boundary")
	p3 := mustMalloc(t, a, 0, 25*MiB, 0) // would be its own 26 MiB segment
	require.Equal(t, p2+3*MiB, p3)
	require.Zero(t, drv.Allocs(0), "no cuMemAlloc")
	require.Equal(t, uint64(32*MiB), drv.Mapped(0), "31 MiB of blocks in 16 pages")
	st := stats(t, a, 0)
	require.Equal(t, int64(32*MiB), st.ReservedBytes[pools.StatAll].Current)
	require.Equal(t, int64(31*MiB), st.AllocatedBytes[pools.StatAll].Current)
	require.Zero(t, st.Segment[pools.StatAll].Current, "as in PyTorch, expandable ranges are not segments")
	require.Zero(t, st.InactiveSplit[pools.StatAll].Current)

	base, size, err := a.BaseAllocation(p2)
	require.NoError(t, err)
	require.Equal(t, p1, base)
	require.Equal(t, uint64(32*MiB), size, "the contiguous mapped run")
	base, size, err = a.BaseAllocation(p2 + 100)
	require.NoError(t, err)
	require.Equal(t, p1, base)
	require.Equal(t, uint64(32*MiB), size)

	// A freed tail grows into new pages rather than a new range.
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p3}))
	p4 := mustMalloc(t, a, 0, 40*MiB, 0)
	require.Equal(t, p3, p4)
	require.Equal(t, uint64(46*MiB), drv.Mapped(0))
	n, _ := drv.Reservations(0)
	require.Equal(t, 1, n)

	// The small pool and other streams get ranges of their own.
	s := mustMalloc(t, a, 0, 4096, 0)
	o := mustMalloc(t, a, 0, 4096, 1)
	n, _ = drv.Reservations(0)
	require.Equal(t, 3, n)
	for _, p := range []cuda.Ptr{p1, p2, p4, s, o} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// empty_cache unmaps the whole free pages and gives back ranges with nothing
// mapped; pages partly in use stay.
func TestExpandableEmptyCacheUnmaps(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, expandable)
	keep := mustMalloc(t, a, 0, 3*MiB, 0)    // pages 0-1
	gone := mustMalloc(t, a, 0, 20*MiB, 0)   // pages 1-11
	small := mustMalloc(t, a, 0, 512*KiB, 0) // the small pool's range
	require.Equal(t, uint64(26*MiB), drv.Mapped(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: gone}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: small}))
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, uint64(4*MiB), drv.Mapped(0), "keep's two pages stay mapped")
	require.Equal(t, uint64(4*MiB), drv.Used(0))
	n, _ := drv.Reservations(0)
	require.Equal(t, 1, n, "the small pool's range went back")
	st := stats(t, a, 0)
	require.Equal(t, int64(4*MiB), st.ReservedBytes[pools.StatAll].Current)
	require.Equal(t, st.NumDeviceAlloc, st.NumDeviceFree+1, "one mapped run left")

	// The unmapped pages are mapped again on demand, at the same addresses.
	again := mustMalloc(t, a, 0, 20*MiB, 0)
	require.Equal(t, gone, again)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: again}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: keep}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Mapped(0))
	require.Zero(t, drv.Used(0))
	require.Zero(t, drv.Handles(0))
	n, _ = drv.Reservations(0)
	require.Zero(t, n)
	require.NoError(t, a.CheckInvariants())
}

// Segments released by empty_cache and made again, many more times than
// the device's address range holds reservations of their size (the
// simulator's 16 TiB; 90 GiB each here): every release frees its
// reservation, and the driver reuses the address space.
func TestExpandableMadeAgainAfterEmptyCache(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 80*GiB, expandable)
	for i := 0; i < 400; i++ {
		p, err := a.Malloc(&allocator.MallocRequest{Size: 2 * MiB})
		require.NoError(t, err, "round %d", i)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 2 * MiB}))
		require.NoError(t, a.EmptyCache(0))
		n, _ := drv.Reservations(0)
		require.Zero(t, n, "round %d: every reservation freed", i)
	}
	require.NoError(t, a.CheckInvariants())
}

// Out of memory: the free pages of other streams' ranges are unmapped, then
// the mapping is retried.
func TestExpandableOOMUnmapsThenRetries(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 64*MiB, expandable)
	p := mustMalloc(t, a, 0, 40*MiB, 1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p})) // 40 MiB mapped, cached on stream 1
	q := mustMalloc(t, a, 0, 40*MiB, 2)
	st := stats(t, a, 0)
	require.Equal(t, int64(1), st.NumAllocRetries)
	require.Zero(t, st.NumOOMs)
	require.Equal(t, uint64(40*MiB), drv.Mapped(0), "stream 1's pages were unmapped")
	require.Equal(t, int64(40*MiB), st.ReservedBytes[pools.StatAll].Current)

	_, err := a.Malloc(&allocator.MallocRequest{Size: 40 * MiB, Stream: 3})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.NoError(t, a.CheckInvariants())
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))

	// Injected failures part way through a mapping leave nothing behind.
	drv.FailAllocs(0, 1)
	r := mustMalloc(t, a, 0, 8*MiB, 0) // the first page fails, the retry maps
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: r}))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	// With stitching, the other stream's idle pages move to stream 2's
	// range instead: no retry, no new memory. (Every miss marks the legacy
	// stream; stream 1 has no mark after its free, and the device is
	// synchronized to certify its pages.)
	for _, from := range []cuda.Stream{0, 1} {
		a, drv = newAlloc(t, 1, 64*MiB, "expandable_segments:True,expandable_map_unit_mb:2")
		p = mustMalloc(t, a, 0, 40*MiB, from)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		q = mustMalloc(t, a, 0, 40*MiB, 2)
		st = stats(t, a, 0)
		require.Zero(t, st.NumAllocRetries)
		require.Equal(t, int64(20), stitchStats(t, a).Remaps, "the twenty pages moved")
		require.Equal(t, int64(from), stitchStats(t, a).Syncs)
		require.Equal(t, uint64(40*MiB), drv.Used(0))
		require.True(t, drv.Accessible(0, q, 40*MiB))
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
		require.NoError(t, a.EmptyCache(0))
		require.Zero(t, drv.Used(0))
		require.NoError(t, a.CheckInvariants())
		require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	}
}

// The memory fraction bounds mapped memory.
func TestExpandableMemoryFraction(t *testing.T) {
	lockThread(t)
	a, _ := newAlloc(t, 1, 100*MiB, expandable)
	require.NoError(t, a.SetMemoryFraction(0, 0.5))
	p := mustMalloc(t, a, 0, 40*MiB, 0)
	_, err := a.Malloc(&allocator.MallocRequest{Size: 20 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory, "40 + 20 MiB > 50 MiB allowed")
	q := mustMalloc(t, a, 0, 10*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.CheckInvariants())
}

// During a capture pages are mapped in relaxed mode and nothing is
// unmapped; the graph's pool keeps its pages until released.
func TestExpandableCapture(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, expandable)
	const cs = cuda.Stream(7)
	eager := mustMalloc(t, a, 0, 8*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: eager}))
	g := allocator.PoolID{A: 1}
	for _, mode := range []cuda.CaptureMode{cuda.CaptureModeGlobal, cuda.CaptureModeThreadLocal} {
		beginCapture(t, a, drv, g, cs, mode)
		x := mustMalloc(t, a, 0, 5*MiB, cs)
		y := mustMalloc(t, a, 0, 5*MiB, cs)
		require.Equal(t, x+5*MiB, y, "the private pool's range grows too")
		side := mustMalloc(t, a, 0, 30*MiB, 0) // eager work beside the capture
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: side}))
		mapped := drv.Mapped(0)
		require.ErrorIs(t, a.EmptyCache(0), allocator.ErrCaptureUnderway)
		require.Equal(t, mapped, drv.Mapped(0), "nothing unmapped during the capture")
		_, err := a.Malloc(&allocator.MallocRequest{Size: 2 * GiB, Stream: cs})
		require.ErrorIs(t, err, allocator.ErrOutOfMemory, "no release and retry during a capture")
		require.Equal(t, mapped, drv.Mapped(0))
		require.NoError(t, drv.EndCapture(cs), "the capture stayed valid")
		require.NoError(t, a.EndAllocateToPool(0, g))
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
		require.NoError(t, a.EmptyCache(0))
		require.Greater(t, drv.Mapped(0), uint64(0), "the live graph's pages stay")
		require.NoError(t, a.ReleasePool(0, g))
		require.NoError(t, a.EmptyCache(0))
		require.Zero(t, drv.Mapped(0), "the released pool's pages and range went back")
		n, _ := drv.Reservations(0)
		require.Zero(t, n)
		require.NoError(t, a.CheckInvariants())
	}
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// record_stream delays the reuse of expandable blocks as of any other; a
// block waiting on events is never unmapped.
func TestExpandableRecordStream(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, expandable)
	p := mustMalloc(t, a, 0, 4*MiB, 1)
	require.NoError(t, a.RecordStream(p, 2))
	drv.Submit(2)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	q := mustMalloc(t, a, 0, 4*MiB, 1)
	require.Equal(t, p+4*MiB, q, "p still in use by stream 2: new pages instead")
	require.True(t, drv.Accessible(0, p, 4*MiB))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	drv.Complete(2)
	r := mustMalloc(t, a, 0, 8*MiB, 1)
	require.Equal(t, p, r, "p's pages merged with q's once stream 2 finished")
	require.NoError(t, a.RecordStream(r, 3))
	drv.Submit(3)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: r}))
	require.NoError(t, a.EmptyCache(0), "waits for stream 3, then unmaps")
	require.Zero(t, drv.Mapped(0))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.LiveEvents())
}

// Snapshots show each mapped run as an expandable segment.
func TestExpandableSnapshot(t *testing.T) {
	lockThread(t)
	a, _ := newAlloc(t, 1, GiB, expandable+",record_history:100")
	p := mustMalloc(t, a, 0, 3*MiB, 0)
	q := mustMalloc(t, a, 0, 5*MiB, 0)
	r := mustMalloc(t, a, 0, 3*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.EmptyCache(0)) // unmaps pages 2-3: two runs remain
	snap := a.Snapshot(nil, true)
	require.Len(t, snap.Segments, 2)
	for _, s := range snap.Segments {
		require.True(t, s.IsExpandable)
		require.Equal(t, "large", s.SegmentType)
		var sum uint64
		for _, b := range s.Blocks {
			sum += b.Size
		}
		require.Equal(t, s.TotalSize, sum)
		require.Zero(t, s.TotalSize%(2*MiB))
	}
	require.Equal(t, uint64(p), snap.Segments[0].Address)
	require.Equal(t, uint64(4*MiB), snap.Segments[0].TotalSize)
	require.Equal(t, uint64(p+8*MiB), snap.Segments[1].Address)
	require.Equal(t, uint64(4*MiB), snap.Segments[1].TotalSize)
	require.Equal(t, true, snap.AllocatorSettings["expandable_segments"])
	var actions []string
	for _, e := range snap.DeviceTraces[0] {
		actions = append(actions, e.Action)
	}
	require.Contains(t, actions, "segment_map")
	require.Contains(t, actions, "segment_unmap")
	_, err := json.Marshal(snap)
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: r}))
}

// noVMM hides the simulator's virtual memory management methods.
type noVMM struct{ allocator.Driver }

// Without the driver's VMM API the option falls back to ordinary segments,
// with one warning where the configuration named it; the default
// (stitching, and so expandable segments) falls back quietly, and
// expandable_segments:False never asks for it.
func TestExpandableFallback(t *testing.T) {
	lockThread(t)
	cfg, _, err := allocator.ParseConfig(expandable)
	require.NoError(t, err)
	drv := sim.New(sim.Options{Memory: GiB})
	a, err := allocator.New(noVMM{drv}, cfg)
	require.NoError(t, err)
	var warnings []string
	a.SetWarningHandler(func(msg string) { warnings = append(warnings, msg) })
	p := mustMalloc(t, a, 0, 3*MiB, 0)
	q := mustMalloc(t, a, 0, 30*MiB, 0)
	require.Equal(t, int64(2), drv.Allocs(0))
	require.Len(t, warnings, 1)
	require.Equal(t, "expandable_segments:True: the CUDA driver has no virtual memory management API; using ordinary segments", warnings[0])
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.CheckInvariants())

	for _, c := range []struct{ conf, note string }{
		{"", ""},
		{"max_split_size_mb:64", ""},
		{ordinary, ""},
		{"stitch:True", "stitch:True: the CUDA driver has no virtual memory management API; using ordinary segments"},
		{"expandable_segments:True", "expandable_segments:True: the CUDA driver has no virtual memory management API; using ordinary segments"},
	} {
		cfg, _, err := allocator.ParseConfig(c.conf)
		require.NoError(t, err)
		drv := sim.New(sim.Options{Memory: GiB})
		a, err := allocator.New(noVMM{drv}, cfg)
		require.NoError(t, err)
		var warnings []string
		a.SetWarningHandler(func(msg string) { warnings = append(warnings, msg) })
		p := mustMalloc(t, a, 0, 3*MiB, 0)
		require.Equal(t, int64(1), drv.Allocs(0), c.conf)
		if c.note == "" {
			require.Empty(t, warnings, "%q: no note", c.conf)
			// Naming it later earns the note at the next growth.
			cfg, _, err = allocator.ParseConfigUpdate(a.Config(), "expandable_segments:True")
			require.NoError(t, err)
			a.Configure(cfg)
			q := mustMalloc(t, a, 0, 30*MiB, 0)
			require.Equal(t, int64(2), drv.Allocs(0), c.conf)
			require.Equal(t, []string{"expandable_segments:True: the CUDA driver has no virtual memory management API; using ordinary segments"}, warnings, c.conf)
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
		} else {
			require.Equal(t, []string{c.note}, warnings, c.conf)
		}
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		require.NoError(t, a.CheckInvariants())
	}
}

// Switching the option at run time: blocks already in expandable ranges
// keep working, new growth follows the new setting.
func TestExpandableToggle(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, expandable)
	p := mustMalloc(t, a, 0, 30*MiB, 0)
	cfg, _, err := allocator.ParseConfig(ordinary)
	require.NoError(t, err)
	a.Configure(cfg)
	q := mustMalloc(t, a, 0, 30*MiB, 0)
	require.Equal(t, int64(1), drv.Allocs(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	require.NoError(t, a.CheckInvariants())
}

// flakyVMM fails chosen VMM calls of the simulator.
type flakyVMM struct {
	*sim.Driver
	failUnmaps, failReleases, failAccess int
}

func (f *flakyVMM) MemUnmap(dev int, p cuda.Ptr, size uint64) error {
	if f.failUnmaps > 0 {
		f.failUnmaps--
		return cuda.ErrUnknown
	}
	return f.Driver.MemUnmap(dev, p, size)
}

func (f *flakyVMM) MemRelease(dev int, h cuda.MemHandle) error {
	if f.failReleases > 0 {
		f.failReleases--
		return cuda.ErrUnknown
	}
	return f.Driver.MemRelease(dev, h)
}

func (f *flakyVMM) MemSetAccess(dev int, p cuda.Ptr, size uint64) error {
	if f.failAccess > 0 {
		f.failAccess--
		return cuda.ErrUnknown
	}
	return f.Driver.MemSetAccess(dev, p, size)
}

// Driver failures while mapping or unmapping leave the allocator consistent
// with the driver and leak nothing once the driver works again.
func TestExpandableDriverFailures(t *testing.T) {
	lockThread(t)
	cfg, _, err := allocator.ParseConfig(expandable)
	require.NoError(t, err)
	s := sim.New(sim.Options{Memory: GiB})
	drv := &flakyVMM{Driver: s}
	a, err := allocator.New(drv, cfg)
	require.NoError(t, err)
	check := func() {
		t.Helper()
		require.NoError(t, a.CheckInvariants())
		st := stats(t, a, 0)
		require.Equal(t, uint64(st.ReservedBytes[pools.StatAll].Current), s.Mapped(0), "reserved is what the driver has mapped")
	}

	drv.failAccess = 1
	_, err = a.Malloc(&allocator.MallocRequest{Size: 10 * MiB})
	require.Error(t, err, "memory without access is not handed out")
	check()
	p := mustMalloc(t, a, 0, 10*MiB, 0)
	require.True(t, s.Accessible(0, p, 10*MiB))

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	drv.failReleases = 1
	require.NoError(t, a.EmptyCache(0), "a failed release keeps the handle for later")
	check()
	require.Zero(t, s.Mapped(0))
	require.NoError(t, a.EmptyCache(0), "the spare handle is released now")
	require.Zero(t, s.Used(0))

	q := mustMalloc(t, a, 0, 10*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	drv.failUnmaps = 1 // the run's call: its mappings are unmapped one by one
	require.NoError(t, a.EmptyCache(0))
	check()
	q = mustMalloc(t, a, 0, 10*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	drv.failUnmaps = 2 // the run's call and its first mapping's
	require.Error(t, a.EmptyCache(0))
	check()
	require.NoError(t, a.EmptyCache(0))
	check()
	require.Zero(t, s.Used(0))
	require.Zero(t, s.Handles(0))
	n, _ := s.Reservations(0)
	require.Zero(t, n)
}
