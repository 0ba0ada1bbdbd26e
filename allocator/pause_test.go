// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/pools"
)

// Tags and pause/resume (allocator/tags.go, pause.go) on the simulator.

// tagEnv is an allocator over the simulator with helpers for tags.
type tagEnv struct {
	t   *testing.T
	a   *allocator.Allocator
	drv *sim.Driver
}

func newTagEnv(t *testing.T, devices int, mem uint64, conf string) *tagEnv {
	t.Helper()
	lockThread(t)
	a, drv := newAlloc(t, devices, mem, conf)
	return &tagEnv{t: t, a: a, drv: drv}
}

func (e *tagEnv) tag(name string) uint32 {
	e.t.Helper()
	id, err := e.a.TagID(name)
	require.NoError(e.t, err)
	return id
}

func (e *tagEnv) malloc(dev int, size uint64, s cuda.Stream, tag uint32) cuda.Ptr {
	e.t.Helper()
	p, err := e.a.Malloc(&allocator.MallocRequest{Dev: dev, Size: size, Stream: s, Tag: tag})
	require.NoError(e.t, err)
	require.NotZero(e.t, p)
	return p
}

func (e *tagEnv) free(p cuda.Ptr) {
	e.t.Helper()
	require.NoError(e.t, e.a.Free(allocator.FreeRequest{Dev: -1, Ptr: p}))
}

// fill writes a pattern of n bytes at p (a kernel's writes) and returns it.
func (e *tagEnv) fill(dev int, p cuda.Ptr, n uint64, seed byte) []byte {
	e.t.Helper()
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>12)
	}
	require.NoError(e.t, e.drv.WriteDevice(dev, p, b))
	return b
}

func (e *tagEnv) read(dev int, p cuda.Ptr, n uint64) []byte {
	e.t.Helper()
	b, err := e.drv.ReadDevice(dev, p, n)
	require.NoError(e.t, err)
	return b
}

func (e *tagEnv) ok() {
	e.t.Helper()
	require.NoError(e.t, e.a.CheckInvariants())
	require.Zero(e.t, e.drv.Violations(), "%v", e.drv.ViolationLog())
}

func (e *tagEnv) reserved(dev int) int64 {
	return stats(e.t, e.a, dev).ReservedBytes[pools.StatAll].Current
}

func (e *tagEnv) allocated(dev int) int64 {
	return stats(e.t, e.a, dev).AllocatedBytes[pools.StatAll].Current
}

func (e *tagEnv) paused(dev int) uint64 {
	e.t.Helper()
	n, err := e.a.PausedBytes(dev)
	require.NoError(e.t, err)
	return n
}

// segmentOf returns the snapshot's segment holding p.
func (e *tagEnv) segmentOf(p cuda.Ptr) allocator.SegmentInfo {
	e.t.Helper()
	for _, s := range e.a.Snapshot(nil, false).Segments {
		if uint64(p) >= s.Address && uint64(p) < s.Address+s.TotalSize {
			return s
		}
	}
	e.t.Fatalf("no segment holds %#x", p)
	return allocator.SegmentInfo{}
}

// A tag's memory comes from ranges of its own, mapped through virtual
// memory even with expandable segments off; best fit never crosses tags.
func TestTagRouting(t *testing.T) {
	e := newTagEnv(t, 1, 4*GiB, "expandable_segments:False")
	kv, w := e.tag("kv"), e.tag("weights")
	require.Equal(t, kv, e.tag("kv"), "one id per name")
	require.NotEqual(t, kv, w)
	require.Equal(t, "kv", e.a.TagName(kv))

	plain := e.malloc(0, 8*MiB, 0, 0)
	require.Equal(t, int64(1), e.drv.Allocs(0), "untagged: an ordinary segment")
	p := e.malloc(0, 8*MiB, 0, kv)
	q := e.malloc(0, 8*MiB, 0, w)
	small := e.malloc(0, 4*KiB, 0, kv)
	require.Equal(t, int64(1), e.drv.Allocs(0), "tagged memory is never cuMemAlloc'd")
	require.Positive(t, e.drv.Mapped(0))
	for ptr, tag := range map[cuda.Ptr]string{p: "kv", q: "weights", small: "kv", plain: ""} {
		s := e.segmentOf(ptr)
		require.Equal(t, tag, s.Tag, "%#x", ptr)
		require.Equal(t, tag != "", s.IsExpandable)
	}
	// Freed, a tag's block serves only its tag.
	e.free(p)
	r := e.malloc(0, 8*MiB, 0, 0)
	require.NotEqual(t, p, r, "an untagged malloc does not take the tag's free block")
	s := e.malloc(0, 8*MiB, 0, w)
	require.NotEqual(t, p, s, "nor another tag's malloc")
	p2 := e.malloc(0, 8*MiB, 0, kv)
	require.Equal(t, p, p2, "the tag's own malloc does")

	// A tagged malloc is never tracked by a front.
	e.a.SetFront(&fakeFront{})
	e.a.ExpectAnnouncements()
	req := &allocator.MallocRequest{Size: 4 * KiB}
	tiny, err := e.a.Malloc(req)
	require.NoError(t, err)
	require.NotZero(t, req.Track.Tag, "an untagged block is tracked")
	req = &allocator.MallocRequest{Size: 4 * KiB, Tag: kv}
	tiny2, err := e.a.Malloc(req)
	require.NoError(t, err)
	require.Equal(t, allocator.Tracking{}, req.Track, "a tagged one is not")
	for _, x := range []cuda.Ptr{plain, p2, q, small, r, s, tiny, tiny2} {
		e.free(x)
	}
	e.ok()
}

// Bad names.
func TestTagNames(t *testing.T) {
	e := newTagEnv(t, 1, GiB, "")
	for _, bad := range []string{"", string(make([]byte, allocator.MaxTagName+1)), "\xff\xfe"} {
		_, err := e.a.TagID(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidArgument, "%q", bad)
	}
	_, err := e.a.TagID(string(bytes.Repeat([]byte("x"), allocator.MaxTagName)))
	require.NoError(t, err)
	_, err = e.a.Malloc(&allocator.MallocRequest{Size: 4096, Tag: 999})
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.Contains(t, err.Error(), "no tag has id 999")
	require.ErrorContains(t, e.a.Pause("never", false), `no tag is named "never"`)
	require.ErrorContains(t, e.a.Resume("never"), `no tag is named "never"`)
	require.NoError(t, e.a.Pause("", true), "no tag holds memory: nothing to do")
	require.NoError(t, e.a.Resume(""))
}

// Pause with keep: the memory goes back to the driver (reserved and the
// driver's use drop by what the tag held, paused_bytes rises by as much,
// allocated stays), mallocs of the tag are refused, frees are allowed;
// resume maps memory at the same addresses with the same bytes.
func TestPauseResumeKeep(t *testing.T) {
	for _, conf := range []string{"expandable_segments:False", "expandable_segments:True,stitch:False", "expandable_segments:True"} {
		t.Run(conf, func(t *testing.T) {
			e := newTagEnv(t, 1, 4*GiB, conf)
			kv := e.tag("kv")
			other := e.malloc(0, 64*MiB, 0, 0)
			otherData := e.fill(0, other, 64*MiB, 9)
			untagged := e.reserved(0)
			wantUntagged := int64(64 * MiB)
			if conf == "expandable_segments:True,stitch:False" {
				wantUntagged = 80 * MiB // whole 20 MiB chunks
			}
			require.Equal(t, wantUntagged, untagged, "the untagged block's memory")
			var ptrs []cuda.Ptr
			var want [][]byte
			for i, size := range []uint64{256 * MiB, 3 * MiB, 5000, 100 * MiB} {
				p := e.malloc(0, size, 0, kv)
				ptrs = append(ptrs, p)
				want = append(want, e.fill(0, p, size, byte(i)))
			}
			doomed := e.malloc(0, 10*MiB, 0, kv)
			res, alloc, used := e.reserved(0), e.allocated(0), e.drv.Used(0)
			tagHeld := uint64(res - untagged)
			require.NoError(t, e.a.Pause("kv", true))
			e.ok()
			require.Equal(t, tagHeld, e.paused(0))
			require.Equal(t, res-int64(tagHeld), e.reserved(0))
			require.Equal(t, alloc, e.allocated(0), "allocated unchanged")
			require.Equal(t, used-tagHeld, e.drv.Used(0), "the driver has the memory back")
			require.False(t, e.drv.Accessible(0, ptrs[0], 1))
			require.True(t, e.segmentOf(ptrs[0]).Paused)
			require.False(t, e.segmentOf(other).Paused)
			require.Equal(t, []allocator.TagState{{Tag: "kv", Paused: true, PausedBytes: []uint64{tagHeld}}}, e.a.Paused())

			_, err := e.a.Malloc(&allocator.MallocRequest{Size: 4096, Tag: kv})
			require.ErrorIs(t, err, allocator.ErrPaused)
			require.ErrorContains(t, err, `tag "kv" is paused`)
			e.free(doomed) // allowed while paused
			require.NoError(t, e.a.Pause("kv", false), "a second pause is a no-op")
			// The rest of the device works meanwhile, and empty_cache
			// leaves the paused tag alone.
			x := e.malloc(0, 32*MiB, 0, 0)
			e.free(x)
			ranges, _ := e.drv.Reservations(0)
			require.NoError(t, e.a.EmptyCache(0))
			require.Equal(t, tagHeld, e.paused(0))
			after, _ := e.drv.Reservations(0)
			require.Equal(t, ranges, after, "the paused tag's reservations stay")
			e.ok()

			require.NoError(t, e.a.Resume("kv"))
			e.ok()
			require.Zero(t, e.paused(0))
			for i, p := range ptrs {
				require.True(t, bytes.Equal(want[i], e.read(0, p, uint64(len(want[i])))), "contents of block %d", i)
			}
			require.True(t, bytes.Equal(otherData, e.read(0, other, 64*MiB)), "untagged memory untouched")
			require.Equal(t, alloc-stats(t, e.a, 0).AllocatedBytes[pools.StatAll].Current, int64(10*MiB), "only the freed block left")
			require.Empty(t, e.a.Paused())
			require.NoError(t, e.a.Resume("kv"), "resume of a tag not paused is a no-op")
			p := e.malloc(0, 4096, 0, kv)
			for _, q := range append(ptrs, p, other) {
				e.free(q)
			}
			e.ok()
		})
	}
}

// Without keep nothing is copied, and the memory mapped back is new (the
// simulator's reads zeros).
func TestPauseDiscard(t *testing.T) {
	e := newTagEnv(t, 1, 4*GiB, "")
	kv := e.tag("kv")
	p := e.malloc(0, 64*MiB, 0, kv)
	e.fill(0, p, 64*MiB, 3)
	require.NoError(t, e.a.Pause("kv", false))
	n, _ := e.drv.Copies()
	require.Zero(t, n, "no copy")
	require.NoError(t, e.a.Resume("kv"))
	require.Equal(t, make([]byte, 64*MiB), e.read(0, p, 64*MiB))
	require.Zero(t, e.a.HostMemoryStats().Held)
	e.free(p)
	e.ok()
}

// Pinned memory is kept for the next pause, and freed on request.
func TestPauseHostMemory(t *testing.T) {
	e := newTagEnv(t, 1, 4*GiB, "")
	kv := e.tag("kv")
	p := e.malloc(0, 64*MiB, 0, kv)
	require.NoError(t, e.a.Pause("kv", true))
	st := e.a.HostMemoryStats()
	require.Equal(t, uint64(64*MiB), st.Held)
	require.NoError(t, e.a.Resume("kv"))
	require.Equal(t, uint64(64*MiB), e.a.HostMemoryStats().Pooled)
	calls := e.drv.HostAllocCalls()
	require.NoError(t, e.a.Pause("kv", true))
	require.NoError(t, e.a.Resume("kv"))
	require.Equal(t, calls, e.drv.HostAllocCalls(), "the second pause reuses the pinned memory")
	freed, err := e.a.ReleaseHostMemory()
	require.NoError(t, err)
	require.Equal(t, uint64(64*MiB), freed)
	n, bytes := e.drv.HostMemory()
	require.Zero(t, n)
	require.Zero(t, bytes)
	require.Zero(t, e.drv.CopyStreams())
	// Kept contents are not freed by it.
	require.NoError(t, e.a.Pause("kv", true))
	freed, err = e.a.ReleaseHostMemory()
	require.NoError(t, err)
	require.Zero(t, freed)
	require.NoError(t, e.a.Resume("kv"))
	e.free(p)
	e.ok()
}

// Pausing every tag, on every device; one tag's pause leaves the others.
func TestPauseAllTagsDevices(t *testing.T) {
	e := newTagEnv(t, 2, 2*GiB, "")
	a, b := e.tag("a"), e.tag("b")
	pa0 := e.malloc(0, 40*MiB, 0, a)
	pa1 := e.malloc(1, 40*MiB, 0, a)
	pb0 := e.malloc(0, 40*MiB, 0, b)
	da := e.fill(1, pa1, 40*MiB, 1)
	db := e.fill(0, pb0, 40*MiB, 2)
	require.NoError(t, e.a.Pause("a", true))
	require.Positive(t, e.paused(0))
	require.Positive(t, e.paused(1))
	require.True(t, e.drv.Accessible(0, pb0, 40*MiB), "b untouched")
	pb := e.malloc(0, 4096, 0, b) // b still allocates
	require.NoError(t, e.a.Pause("", true))
	require.Len(t, e.a.Paused(), 2)
	require.False(t, e.drv.Accessible(0, pb0, 1))
	require.NoError(t, e.a.Resume("b"))
	require.Len(t, e.a.Paused(), 1)
	require.Equal(t, db, e.read(0, pb0, 40*MiB))
	require.NoError(t, e.a.Resume(""))
	require.Equal(t, da, e.read(1, pa1, 40*MiB))
	require.Zero(t, e.paused(0)+e.paused(1))
	for _, p := range []cuda.Ptr{pa0, pa1, pb0, pb} {
		e.free(p)
	}
	e.ok()
}

// A graph captured under a tag: its private pool is the tag's, paused with
// it, and its addresses are the same after resume. So is the automatic
// pool of a capture nobody announced, made by a tagged malloc. The untagged
// pools hold expandable segments with stitching (the default) or ordinary
// segments.
func TestPauseGraphPools(t *testing.T) {
	for _, conf := range []string{"", ordinary} {
		t.Run(conf, func(t *testing.T) { testPauseGraphPools(t, conf) })
	}
}

func testPauseGraphPools(t *testing.T, conf string) {
	e := newTagEnv(t, 1, 4*GiB, conf)
	eng := e.tag("engine")
	pool := allocator.PoolID{A: 1}
	cs := cuda.Stream(7)
	require.NoError(t, e.a.BeginAllocateToPoolTagged(0, pool, eng, func(s cuda.Stream) bool { return s == cs }))
	require.NoError(t, e.drv.BeginCapture(cs, cuda.CaptureModeGlobal))
	out := e.malloc(0, 30*MiB, cs, 0) // untagged thread: the pool decides
	scratch := e.malloc(0, 50*MiB, cs, 0)
	e.free(scratch)
	require.NoError(t, e.drv.EndCapture(cs))
	require.NoError(t, e.a.EndAllocateToPool(0, pool))
	require.Equal(t, "engine", e.segmentOf(out).Tag)
	require.Equal(t, [2]uint64{1, 0}, e.segmentOf(out).SegmentPoolID)
	data := e.fill(0, out, 30*MiB, 5)
	// A capture may not begin into a paused tag's pool.
	require.NoError(t, e.a.Pause("engine", true))
	require.False(t, e.drv.Accessible(0, scratch, 1), "the graph's scratch memory is given back too")
	err := e.a.BeginAllocateToPoolTagged(0, pool, 0, nil)
	require.ErrorIs(t, err, allocator.ErrPaused)
	require.NoError(t, e.a.Resume("engine"))
	require.True(t, e.drv.Accessible(0, scratch, 50*MiB), "the replay's memory is back at its address")
	require.Equal(t, data, e.read(0, out, 30*MiB))
	// A begin under another tag is refused; one under none keeps the tag.
	other := e.tag("other")
	err = e.a.BeginAllocateToPoolTagged(0, pool, other, nil)
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.ErrorContains(t, err, `belongs to tag "engine"`)
	require.NoError(t, e.a.BeginAllocateToPoolTagged(0, pool, 0, nil))
	q := e.malloc(0, 1*MiB, 0, other)
	require.Equal(t, "engine", e.segmentOf(q).Tag, "the pool's allocations follow the pool")
	require.NoError(t, e.a.EndAllocateToPool(0, pool))
	// A pool holding untagged memory takes no tag.
	plain := allocator.PoolID{A: 2}
	require.NoError(t, e.a.BeginAllocateToPool(0, plain, nil))
	u := e.malloc(0, 1*MiB, 0, 0)
	require.NoError(t, e.a.EndAllocateToPool(0, plain))
	err = e.a.BeginAllocateToPoolTagged(0, plain, other, nil)
	require.ErrorContains(t, err, "holds memory allocated under no tag")

	// Unannounced: the automatic pool of a capture met by a tagged malloc.
	f := newTagEnv(t, 1, 4*GiB, conf)
	ft := f.tag("cupy")
	require.NoError(t, f.drv.BeginCapture(cs, cuda.CaptureModeThreadLocal))
	g := f.malloc(0, 8*MiB, cs, ft)
	require.NoError(t, f.drv.EndCapture(cs))
	seg := f.segmentOf(g)
	require.Equal(t, "cupy", seg.Tag)
	require.NotEqual(t, [2]uint64{0, 0}, seg.SegmentPoolID, "an automatic private pool")
	require.NoError(t, f.a.Pause("cupy", false))
	require.False(t, f.drv.Accessible(0, g, 1))
	require.NoError(t, f.a.Resume("cupy"))
	require.True(t, f.drv.Accessible(0, g, 8*MiB))
	f.ok()

	for _, p := range []cuda.Ptr{out, q, u} {
		e.free(p)
	}
	require.NoError(t, e.a.ReleasePool(0, pool))
	require.NoError(t, e.a.ReleasePool(0, plain))
	require.NoError(t, e.a.EmptyCache(0))
	e.ok()
}

// A pause is refused while a capture is under way, leaving the tag usable.
func TestPauseRefusedDuringCapture(t *testing.T) {
	e := newTagEnv(t, 1, GiB, "")
	kv := e.tag("kv")
	p := e.malloc(0, 8*MiB, 0, kv)
	require.NoError(t, e.a.BeginAllocateToPool(0, allocator.PoolID{A: 1}, func(s cuda.Stream) bool { return s == 5 }))
	err := e.a.Pause("kv", true)
	require.ErrorIs(t, err, allocator.ErrCaptureUnderway)
	require.ErrorContains(t, err, "pause after it ends")
	q := e.malloc(0, 4096, 0, kv) // usable
	require.NoError(t, e.a.EndAllocateToPool(0, allocator.PoolID{A: 1}))
	require.NoError(t, e.a.Pause("kv", true))
	require.NoError(t, e.a.Resume("kv"))
	e.free(p)
	e.free(q)
	e.ok()
}

// Work queued on the tag's memory is waited for before it is unmapped (the
// simulator logs a violation otherwise), and the copies read what the work
// wrote.
func TestPauseWaitsForQueuedWork(t *testing.T) {
	e := newTagEnv(t, 1, GiB, "")
	kv := e.tag("kv")
	p := e.malloc(0, 8*MiB, 3, kv)
	e.drv.Use(0, 3, p, 8*MiB) // a kernel, still queued
	require.NoError(t, e.a.Pause("kv", false))
	require.NoError(t, e.a.Resume("kv"))
	// A block another stream used: the device is synchronized.
	require.NoError(t, e.a.RecordStream(p, 4))
	e.drv.Use(0, 4, p, 8*MiB)
	require.NoError(t, e.a.Pause("kv", false))
	require.NoError(t, e.a.Resume("kv"))
	e.free(p)
	e.ok()
}

// A tag's block shared with another process cannot be paused until it is
// freed; without virtual memory management a tag cannot be paused at all.
func TestPauseRefusals(t *testing.T) {
	lockThread(t)
	drv := sim.New(sim.Options{Memory: GiB})
	a, err := allocator.New(noVMMIPC{drv}, allocator.DefaultConfig())
	require.NoError(t, err)
	kv, err := a.TagID("kv")
	require.NoError(t, err)
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4 * MiB, Tag: kv})
	require.NoError(t, err)
	_, _, _, err = a.IpcHandle(p)
	require.NoError(t, err)
	err = a.Pause("kv", true)
	require.ErrorIs(t, err, allocator.ErrInUse)
	require.ErrorContains(t, err, "shared with another process")
	q, err := a.Malloc(&allocator.MallocRequest{Size: 4 * MiB, Tag: kv})
	require.NoError(t, err, "the tag stays usable")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	err = a.Pause("kv", true)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.ErrorContains(t, err, "no virtual memory management")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.CheckInvariants())
}

// noVMMIPC is the simulator without virtual memory management, with CUDA
// IPC.
type noVMMIPC struct{ *sim.Driver }

func (d noVMMIPC) MemGranularity(int) (uint64, error) { return 0, cuda.ErrNotSupported }

// Resume of a device short of memory gives back the cache first
// (expandable segments with stitching, the default, or ordinary segments),
// then fails clearly when that is not enough; a later resume maps the rest.
func TestResumeOutOfMemory(t *testing.T) {
	for _, conf := range []string{"", ordinary} {
		t.Run(conf, func(t *testing.T) { testResumeOutOfMemory(t, conf) })
	}
}

func testResumeOutOfMemory(t *testing.T, conf string) {
	e := newTagEnv(t, 1, 512*MiB, conf)
	kv := e.tag("kv")
	p := e.malloc(0, 300*MiB, 0, kv)
	require.NoError(t, e.a.Pause("kv", true))
	q := e.malloc(0, 300*MiB, 0, 0)
	e.free(q) // cached: resume gives it back first
	require.NoError(t, e.a.Resume("kv"))
	require.Zero(t, e.paused(0))
	require.NoError(t, e.a.Pause("kv", true))
	q = e.malloc(0, 300*MiB, 0, 0) // in use: resume cannot fit
	err := e.a.Resume("kv")
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.ErrorContains(t, err, "resume again")
	require.Len(t, e.a.Paused(), 1)
	e.ok()
	e.free(q)
	require.NoError(t, e.a.Resume("kv"))
	e.free(p)
	e.ok()
}

// Stitching never moves pages between tags: a tag's growth maps new
// memory rather than the default pools' idle pages, and the default pools'
// growth never takes a tag's.
func TestStitchingKeepsTags(t *testing.T) {
	e := newTagEnv(t, 1, 4*GiB, "expandable_segments:True,stitch:True")
	kv := e.tag("kv")
	var ps []cuda.Ptr
	for i := 0; i < 8; i++ {
		ps = append(ps, e.malloc(0, 20*MiB, 0, 0))
	}
	for i := 0; i < 8; i += 2 {
		e.free(ps[i]) // idle holes in the default pool
	}
	before, err := e.a.StitchStats(0)
	require.NoError(t, err)
	t1 := e.malloc(0, 40*MiB, 0, kv)
	after, err := e.a.StitchStats(0)
	require.NoError(t, err)
	require.Equal(t, before.Remaps, after.Remaps, "no page moved into the tag")
	e.free(t1) // a free hole of the tag
	big := e.malloc(0, 200*MiB, 0, 0)
	require.Equal(t, "", e.segmentOf(big).Tag)
	require.True(t, e.drv.Accessible(0, t1, 40*MiB), "the tag's free pages stay where they are")
	e.free(big)
	for i := 1; i < 8; i += 2 {
		e.free(ps[i])
	}
	e.ok()
}

// With stitching the small and large pools share one page pool, and a
// tag's small pool maps page by page like theirs: its free pages are
// still no donors (stitching takes the default pools' pages only), and
// its growth takes none of theirs.
func TestStitchingKeepsTagSmallPages(t *testing.T) {
	e := newTagEnv(t, 1, 4*GiB, stitching)
	kv := e.tag("kv")
	var tagged, plain []cuda.Ptr
	for i := 0; i < 16; i++ { // 1 MiB blocks, two to a 2 MiB page: 8 pages each
		tagged = append(tagged, e.malloc(0, MiB, 0, kv))
		plain = append(plain, e.malloc(0, MiB, 0, 0))
	}
	for i := range tagged {
		e.free(tagged[i])
		e.free(plain[i])
	}
	before, err := e.a.StitchStats(0)
	require.NoError(t, err)
	reserved := e.reserved(0)
	big := e.malloc(0, 40*MiB, 0, 0) // above the peak: stitching looks for pages
	after, err := e.a.StitchStats(0)
	require.NoError(t, err)
	require.Equal(t, int64(8), after.Remaps-before.Remaps, "the default small pool's eight pages moved, no more")
	require.Equal(t, reserved+24*MiB, e.reserved(0), "the rest was new memory")
	for _, p := range tagged {
		require.True(t, e.drv.Accessible(0, p, MiB), "the tag's free page at %#x stays", p)
		require.Equal(t, "kv", e.segmentOf(p).Tag)
	}
	e.free(big)
	p := e.malloc(0, 2*MiB+MiB/2, 0, kv) // the tag grows: new memory, never the default pools' pages
	again, err := e.a.StitchStats(0)
	require.NoError(t, err)
	require.Equal(t, after.Remaps, again.Remaps)
	e.free(p)
	require.NoError(t, e.a.Pause("kv", false))
	require.Equal(t, uint64(16*MiB+20*MiB), e.paused(0), "the tag's own memory, all of it, goes back: 8 small pages and a 20 MiB unit")
	require.NoError(t, e.a.Resume("kv"))
	e.ok()
}

func TestPauseStatsNames(t *testing.T) {
	e := newTagEnv(t, 1, GiB, "")
	for i := 0; i < 3; i++ {
		id := e.tag(fmt.Sprintf("t%d", i))
		e.free(e.malloc(0, MiB, 0, id))
	}
	sn := e.a.Snapshot(nil, false)
	tags, ok := sn.AllocatorSettings["tags"].([]allocator.TagState)
	require.True(t, ok)
	require.Len(t, tags, 3)
	require.Equal(t, "t2", tags[2].Tag)
}

// A resume's allocations count in the free-memory estimate growth keeps
// (vmem's freeMemory): after a resume takes most of what is free, a growth
// that cannot fit is refused before it creates anything.
func TestResumeCountsInFreeMemoryEstimate(t *testing.T) {
	lockThread(t)
	cfg, _, err := allocator.ParseConfig("")
	require.NoError(t, err)
	f := fault.New(sim.New(sim.Options{Devices: 1, Memory: 32 * GiB}))
	a, err := allocator.New(f, cfg)
	require.NoError(t, err)
	kv, err := a.TagID("kv")
	require.NoError(t, err)
	malloc := func(size uint64, tag uint32) (cuda.Ptr, error) {
		return a.Malloc(&allocator.MallocRequest{Size: size, Tag: tag})
	}
	p, err := malloc(20*GiB, kv)
	require.NoError(t, err)
	require.NoError(t, a.Pause("kv", false)) // 32 GiB free, the estimate still 12
	q, err := malloc(11*GiB, 0)              // within the margin of 12: read, 32 free
	require.NoError(t, err)
	require.NoError(t, a.Resume("kv")) // 20 GiB more: 1 GiB free
	created := f.Calls("MemCreate") + f.Calls("MemCreateShareable")
	_, err = malloc(4*GiB, 0)
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.Equal(t, created, f.Calls("MemCreate")+f.Calls("MemCreateShareable"), "refused before creating anything")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}, allocator.FreeRequest{Ptr: q}))
	require.NoError(t, a.CheckInvariants())
}
