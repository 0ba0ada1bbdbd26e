// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"encoding/json"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// Page by page, so that the tests can count pages.
const stitch = "stitch:True,expandable_map_unit_mb:2"

func stitchStats(t *testing.T, a *allocator.Allocator) allocator.StitchStats {
	t.Helper()
	st, err := a.StitchStats(0)
	require.NoError(t, err)
	return st
}

// holes allocates 10, 2, 10 and 2 MiB on s and frees the two 10 MiB
// blocks: two holes of five whole pages that a 16 MiB request cannot use.
func holes(t *testing.T, a *allocator.Allocator, s cuda.Stream) (h1, h2 cuda.Ptr, keep []cuda.Ptr) {
	h1 = mustMalloc(t, a, 0, 10*MiB, s)
	keep = append(keep, mustMalloc(t, a, 0, 2*MiB, s))
	h2 = mustMalloc(t, a, 0, 10*MiB, s)
	keep = append(keep, mustMalloc(t, a, 0, 2*MiB, s))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h1}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h2}))
	return h1, h2, keep
}

// A miss takes the idle free pages of holes instead of mapping new memory:
// reserved memory does not grow, the moved pages are unmapped where they
// were and mapped where the request is, and the remaps are counted.
func TestStitchMovesIdlePages(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	h1, h2, keep := holes(t, a, 0)
	used := drv.Used(0)
	require.Equal(t, uint64(24*MiB), used)

	p := mustMalloc(t, a, 0, 16*MiB, 0)
	require.Equal(t, used, drv.Used(0), "no new physical memory")
	require.Equal(t, int64(used), stats(t, a, 0).ReservedBytes[pools.StatAll].Current)
	require.True(t, drv.Accessible(0, p, 16*MiB))
	require.False(t, drv.Accessible(0, h1, 2*MiB), "the first hole's pages moved")
	require.True(t, drv.Accessible(0, h2, 4*MiB), "only three of the second hole's five pages were needed (from its end)")
	require.False(t, drv.Accessible(0, h2+4*MiB, 2*MiB))
	st := stitchStats(t, a)
	require.Equal(t, int64(8), st.Remaps)
	require.Equal(t, int64(16*MiB), st.RemappedBytes)
	require.Equal(t, int64(1), st.Stitches)
	require.Zero(t, st.Fragmented, "20 MiB free for 16: the range is short of free memory")

	// The snapshot shows the count, and the moved pages are no memory.
	var snap struct {
		Settings map[string]any `json:"allocator_settings"`
	}
	raw, err := json.Marshal(a.Snapshot(nil, true))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &snap))
	require.Equal(t, []any{float64(8)}, snap.Settings["stitch_remaps"])
	require.Equal(t, true, snap.Settings["stitch"])

	// The hole's address space is mapped again (with stitched pages or
	// new ones) when a request needs it.
	q := mustMalloc(t, a, 0, 10*MiB, 0)
	require.True(t, drv.Accessible(0, q, 10*MiB))
	for _, x := range append(keep, p, q) {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	require.Zero(t, drv.LiveEvents(), "the marker events went with empty_cache")
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// Stitching keeps reserved memory from rising above its peak statistic:
// empty_cache leaves the peak where it was (growth up to it maps new
// memory), reset_peak_memory_stats lowers it to what is reserved now, from
// when on the holes' pages move first.
func TestStitchLimitFollowsPeakReset(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	big := mustMalloc(t, a, 0, 100*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: big}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	_, _, keep := holes(t, a, 0)
	p := mustMalloc(t, a, 0, 16*MiB, 0)
	require.Equal(t, uint64(40*MiB), drv.Used(0), "below the 100 MiB peak: new memory")
	require.Zero(t, stitchStats(t, a).Remaps)
	for _, x := range append(keep, p) {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	require.NoError(t, a.EmptyCache(0))

	require.NoError(t, a.ResetStats(0, allocator.ResetPeak))
	_, _, keep = holes(t, a, 0)
	p = mustMalloc(t, a, 0, 16*MiB, 0)
	require.Equal(t, uint64(24*MiB), drv.Used(0), "the holes' pages moved: no new memory")
	require.Equal(t, int64(8), stitchStats(t, a).Remaps)
	for _, x := range append(keep, p) {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// A miss in a range that holds plenty of free memory (four times the
// request, an eighth of the range) leaves the range's own holes mapped:
// it takes another range's idle pages, and maps new memory for the rest.
func TestStitchLeavesAFragmentedRangesHoles(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	// Stream 1: ten 4 MiB holes between 2 MiB live blocks, 40 MiB free of
	// 60 mapped, none large enough for 8 MiB; the legacy stream 0 (marked
	// at every miss, so its idle pages are known idle): an idle 6 MiB hole
	// (made last: a growth takes the idle holes there are).
	var holes, keep []cuda.Ptr
	for i := 0; i < 10; i++ {
		holes = append(holes, mustMalloc(t, a, 0, 4*MiB, 1))
		keep = append(keep, mustMalloc(t, a, 0, 2*MiB, 1))
	}
	o := mustMalloc(t, a, 0, 6*MiB, 0)
	keep = append(keep, mustMalloc(t, a, 0, 2*MiB, 0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: o}))
	for _, h := range holes {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h}))
	}
	used := drv.Used(0)
	require.Equal(t, uint64(68*MiB), used)

	p := mustMalloc(t, a, 0, 8*MiB, 1)
	st := stitchStats(t, a)
	require.Equal(t, int64(1), st.Fragmented)
	require.Equal(t, int64(3), st.Remaps, "stream 0's three pages moved")
	require.False(t, drv.Accessible(0, o, 2*MiB))
	require.Equal(t, used+2*MiB, drv.Used(0), "one page of new memory for the rest")
	for _, h := range holes {
		require.True(t, drv.Accessible(0, h, 4*MiB), "stream 1's holes stay mapped")
	}
	require.True(t, drv.Accessible(0, p, 8*MiB))

	// With no other range's page left, a miss maps new memory only.
	q := mustMalloc(t, a, 0, 8*MiB, 1)
	st = stitchStats(t, a)
	require.Equal(t, int64(2), st.Fragmented)
	require.Equal(t, int64(3), st.Remaps)
	require.Equal(t, used+10*MiB, drv.Used(0))
	for _, h := range holes {
		require.True(t, drv.Accessible(0, h, 4*MiB))
	}

	// Filled, the range is short of free memory again: its holes move.
	var fill []cuda.Ptr
	for i := 0; i < 8; i++ {
		fill = append(fill, mustMalloc(t, a, 0, 4*MiB, 1))
	}
	r := mustMalloc(t, a, 0, 8*MiB, 1)
	st = stitchStats(t, a)
	require.Equal(t, int64(2), st.Fragmented, "8 MiB free for 8: not plenty")
	require.Equal(t, int64(7), st.Remaps, "the last two holes' pages moved")
	require.Equal(t, used+10*MiB, drv.Used(0), "no new memory")
	require.True(t, drv.Accessible(0, r, 8*MiB))
	for _, x := range append(append(keep, fill...), p, q, r) {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// A page of another stream that work queued before its free may still
// touch stays where it is until a marker event recorded after the free has
// completed. The legacy stream (0) is marked at every miss; another stream
// at its own misses only (TestStitchNeverNamesADestroyedStream).
func TestStitchWaitsForQueuedWork(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	h1 := mustMalloc(t, a, 0, 10*MiB, 0)
	k1 := mustMalloc(t, a, 0, 2*MiB, 0)
	drv.Use(0, 0, h1, 10*MiB) // a kernel on h1, still running when h1 is freed
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h1}))

	p := mustMalloc(t, a, 0, 16*MiB, 1)
	st := stitchStats(t, a)
	require.Zero(t, st.Remaps, "stream 0 is busy")
	require.Greater(t, st.SkippedBusy, int64(0))
	require.Equal(t, uint64(12*MiB+16*MiB), drv.Used(0), "new memory instead")
	require.True(t, drv.Accessible(0, h1, 10*MiB), "the busy hole is still mapped")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	// The marker recorded at that miss completes with stream 0's work:
	// the hole's pages may move now.
	drv.Complete(0)
	q := mustMalloc(t, a, 0, 40*MiB, 1)
	require.Equal(t, int64(5), stitchStats(t, a).Remaps, "the hole's five whole pages")
	require.False(t, drv.Accessible(0, h1, 2*MiB), "the hole's pages moved")
	require.True(t, drv.Accessible(0, q, 40*MiB))
	for _, x := range []cuda.Ptr{k1, q} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// A stream the application destroyed (CuPy's and Numba's streams come and
// go while memory allocated on them lives on) is never named to the driver
// again: a stream's progress marks are recorded at its own misses only, so
// the misses of other streams, empty_cache, and the blocks still cached on
// the dead stream leave it alone. (Recording on a destroyed stream is
// undefined behaviour in CUDA: the driver reads the freed stream, and may
// crash.) Its pages go back at empty_cache.
func TestStitchNeverNamesADestroyedStream(t *testing.T) {
	lockThread(t)
	for i, conf := range []string{"", stitch, "", stitch} {
		a, drv := newAlloc(t, 1, GiB, conf)
		if i >= 2 {
			a.ExpectAnnouncements() // as under PyTorch: no capture query at all
		}
		const gone = cuda.Stream(0x5551000)
		// Large and small blocks on the stream, each size class missing
		// twice: the stream is watched and has marks.
		var ps []cuda.Ptr
		for _, size := range []uint64{4 * MiB, 4 * MiB, 30 * MiB, 512, 4096, 2 * MiB} {
			ps = append(ps, mustMalloc(t, a, 0, size, gone))
		}
		last := ps[len(ps)-1]
		for _, p := range ps[:len(ps)-1] {
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		}
		drv.DestroyStream(gone)

		// Misses on stream 0, before and after empty_cache, both size
		// classes; and a block of the dead stream freed in between.
		p := mustMalloc(t, a, 0, 64*MiB, 0)
		small := mustMalloc(t, a, 0, 1*MiB, 0)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: last}))
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		require.NoError(t, a.EmptyCache(0))
		q := mustMalloc(t, a, 0, 256*MiB, 0)
		r := mustMalloc(t, a, 0, 300*MiB, 0)
		for _, x := range []cuda.Ptr{small, q, r} {
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
		}
		require.NoError(t, a.EmptyCache(0))
		require.Zero(t, drv.Used(0), conf)
		require.NoError(t, a.CheckInvariants())
		require.Zero(t, drv.Violations(), "%d %q: %v", i, conf, drv.ViolationLog())
	}
}

// A stream other than the legacy one is marked at its own requests only:
// its pages freed after its last mark stay where they are at other
// streams' misses, and move once a request of its own (here a miss) has
// marked it.
func TestStitchMarksAStreamAtItsOwnMisses(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	h := mustMalloc(t, a, 0, 10*MiB, s1)
	k := mustMalloc(t, a, 0, 2*MiB, s1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h}))

	p := mustMalloc(t, a, 0, 16*MiB, s2)
	st := stitchStats(t, a)
	require.Zero(t, st.Remaps, "no mark of stream 1 since its free")
	require.Positive(t, st.SkippedBusy)
	require.True(t, drv.Accessible(0, h, 10*MiB))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	// Stream 1's own miss marks it; idle, the mark completes at once, and
	// the miss takes one of the hole's pages for its small pool.
	mapped := func() (n int) {
		for o := uint64(0); o < 10*MiB; o += 2 * MiB {
			if drv.Accessible(0, h+cuda.Ptr(o), 2*MiB) {
				n++
			}
		}
		return n
	}
	small := mustMalloc(t, a, 0, 4096, s1)
	require.Equal(t, int64(1), stitchStats(t, a).Remaps)
	require.Equal(t, 4, mapped())

	// Stream 2's next miss moves the rest.
	q := mustMalloc(t, a, 0, 40*MiB, s2)
	require.Equal(t, int64(5), stitchStats(t, a).Remaps, "the hole's other four pages")
	require.Zero(t, mapped())
	require.True(t, drv.Accessible(0, q, 40*MiB))
	freeAndRelease(t, a, drv, k, small, q)
}

// A stream whose free pages a miss of another stream passed over is marked
// at its next request, a cache hit too: a stream that only ever hits its
// cache still lets its idle pages go.
func TestStitchMarksAWantedStreamAtAHit(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	j := mustMalloc(t, a, 0, 2*MiB, s1)
	k1 := mustMalloc(t, a, 0, 2*MiB, s1)
	h := mustMalloc(t, a, 0, 10*MiB, s1)
	k2 := mustMalloc(t, a, 0, 2*MiB, s1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: j}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h}))

	p := mustMalloc(t, a, 0, 16*MiB, s2)
	st := stitchStats(t, a)
	require.Zero(t, st.Remaps, "no mark of stream 1 since its frees")
	require.Positive(t, st.SkippedBusy)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	// Stream 1's next request hits its cache (j's block) and marks it.
	hit := mustMalloc(t, a, 0, 2*MiB, s1)
	require.Equal(t, j, hit, "a cache hit")
	require.Zero(t, stitchStats(t, a).Remaps)

	// Stream 2's next miss takes the hole's five pages.
	q := mustMalloc(t, a, 0, 40*MiB, s2)
	require.Equal(t, int64(5), stitchStats(t, a).Remaps)
	require.False(t, drv.Accessible(0, h, 2*MiB), "the hole's pages moved")
	require.True(t, drv.Accessible(0, q, 40*MiB))
	freeAndRelease(t, a, drv, k1, k2, hit, q)
}

// A growth above the high-water mark that lacks certified pages, where the
// other streams' free pages it passed over would make up for them,
// synchronizes the device (naming no stream) and takes them, work queued on
// them included once done; where they would not, nothing waits and new
// memory is mapped.
func TestStitchSynchronizesForOtherStreams(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	h := mustMalloc(t, a, 0, 20*MiB, s1)
	k := mustMalloc(t, a, 0, 2*MiB, s1)
	drv.Use(0, s1, h, 20*MiB) // a kernel on h, queued
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h}))
	used := drv.Used(0)

	p := mustMalloc(t, a, 0, 16*MiB, s2)
	st := stitchStats(t, a)
	require.Equal(t, int64(1), st.Syncs)
	require.Equal(t, int64(8), st.Remaps, "eight of the hole's ten pages")
	require.Equal(t, used, drv.Used(0), "no new memory")
	require.True(t, drv.Accessible(0, p, 16*MiB))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	// Stream 1's last two free pages cannot make up for a 40 MiB growth:
	// no synchronization, new memory.
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	drv.Use(0, s1, k, 2*MiB)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: k}))
	q := mustMalloc(t, a, 0, 40*MiB, 3)
	st = stitchStats(t, a)
	require.Equal(t, int64(1), st.Syncs, "two pages do not make up for the rest")
	require.True(t, drv.Accessible(0, q, 40*MiB))
	drv.CompleteAll()
	freeAndRelease(t, a, drv, q)

	// stitch_sync:False: no synchronization, new memory.
	a, drv = newAlloc(t, 1, GiB, stitch+",stitch_sync:False")
	h = mustMalloc(t, a, 0, 20*MiB, s1)
	mustMalloc(t, a, 0, 2*MiB, s1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: h}))
	used = drv.Used(0)
	mustMalloc(t, a, 0, 16*MiB, s2)
	st = stitchStats(t, a)
	require.Zero(t, st.Syncs)
	require.Zero(t, st.Remaps)
	require.Equal(t, used+16*MiB, drv.Used(0))
	require.True(t, drv.Accessible(0, h, 20*MiB), "stream 1's hole stays")
	require.NoError(t, a.CheckInvariants())
}

// A busy page of the request's own stream is lent: its memory is mapped at
// the new place at once (work on the new block is queued behind the old
// work), and its old mapping stays until the stream has finished that work.
func TestStitchLendsOnItsOwnStream(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	h1, h2, keep := holes(t, a, 0)
	drv.Use(0, 0, h1, 24*MiB) // kernels on all of it, queued
	used := drv.Used(0)

	p := mustMalloc(t, a, 0, 16*MiB, 0)
	st := stitchStats(t, a)
	require.Equal(t, int64(8), st.Remaps)
	require.Equal(t, int64(8), st.Lent)
	require.Equal(t, used, drv.Used(0), "no new physical memory")
	require.Equal(t, int64(used), stats(t, a, 0).ReservedBytes[pools.StatAll].Current)
	require.True(t, drv.Accessible(0, p, 16*MiB))
	require.Equal(t, used+16*MiB, drv.Mapped(0), "the old mappings are still there")
	require.True(t, drv.Accessible(0, h1, 10*MiB), "(so pending kernels do not fault)")
	require.NoError(t, a.CheckInvariants())

	// Nothing is mapped over a lent range: a request that would fit the
	// first hole's address space goes elsewhere.
	q := mustMalloc(t, a, 0, 10*MiB, 0)
	require.NotEqual(t, h1, q)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))

	// Once the stream's work is done, the next miss unmaps the old
	// mappings.
	drv.Complete(0)
	x := mustMalloc(t, a, 0, 1*MiB, 1) // a miss: the markers advance
	y := mustMalloc(t, a, 0, 30*MiB, 0)
	require.False(t, drv.Accessible(0, h1, 2*MiB), "the old mapping is gone")
	require.False(t, drv.Accessible(0, h2+4*MiB, 2*MiB))
	require.NoError(t, a.CheckInvariants())

	// empty_cache synchronizes and unmaps every old mapping left.
	drv.Use(0, 0, y, 30*MiB)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	z := mustMalloc(t, a, 0, 30*MiB, 0) // reuses y's block: no miss
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: z}))
	freeAndRelease(t, a, drv, append(keep, p, x)...)
}

// The small and the large pool share one pool of pages (vmem/doc.go, "One
// page pool for both size classes"): with stitching, a small request takes an
// idle page of a free large block, and a large request the pages the small
// pool no longer uses, instead of new memory.
func TestStitchSizeClassesSharePages(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitching)
	big := mustMalloc(t, a, 0, 30*MiB, 0)
	require.Equal(t, uint64(30*MiB), drv.Used(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: big}))
	var small []cuda.Ptr
	for i := 0; i < 6; i++ { // three pages of small blocks
		small = append(small, mustMalloc(t, a, 0, 700*KiB, 0))
	}
	require.Equal(t, uint64(30*MiB), drv.Used(0), "the small pool's pages came from the large block")
	require.Equal(t, int64(3), stitchStats(t, a).Remaps)
	st := stats(t, a, 0)
	require.Equal(t, int64(6*MiB), st.ReservedBytes[pools.StatSmall].Current)
	require.Equal(t, int64(24*MiB), st.ReservedBytes[pools.StatLarge].Current)

	for _, x := range small {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	// 24 MiB free at the start of the large range, 6 in the small pool: a
	// 40 MiB block grows the large one by the 20 MiB unit, the small
	// pool's three pages and 14 MiB of new memory.
	p := mustMalloc(t, a, 0, 40*MiB, 0)
	require.Equal(t, uint64(44*MiB), drv.Used(0), "14 MiB of new memory")
	require.True(t, drv.Accessible(0, p, 40*MiB))
	st = stats(t, a, 0)
	require.Zero(t, st.ReservedBytes[pools.StatSmall].Current, "the small pool's pages moved to the large pool")
	require.Equal(t, int64(3+3), stitchStats(t, a).Remaps)
	freeAndRelease(t, a, drv, p)
}

// Lent pages that the growth did not use go back to their holes: here the
// memory fraction, lowered below what is reserved, lets the growth map 18
// MiB of the 20 MiB unit that stitching lent pages for. Were the spare lent
// page released instead, its memory would stay behind its old mapping,
// counted nowhere (reserved memory below what the device holds).
func TestStitchRestoresUnusedLentPages(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitching) // 20 MiB unit
	x := mustMalloc(t, a, 0, 16*MiB, 0)
	k1 := mustMalloc(t, a, 0, 2*MiB, 0)
	y := mustMalloc(t, a, 0, 6*MiB, 0)
	k2 := mustMalloc(t, a, 0, 16*MiB, 0)
	require.Equal(t, uint64(40*MiB), drv.Used(0))
	drv.Use(0, 0, x, 16*MiB) // queued work: the holes' pages can only be lent
	drv.Use(0, 0, y, 6*MiB)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.SetMemoryFraction(0, 38.0/1024))

	p := mustMalloc(t, a, 0, 18*MiB, 0)
	st := stitchStats(t, a)
	require.Equal(t, int64(9), st.Remaps, "nine pages moved")
	require.Equal(t, int64(9), st.Lent, "all of them lent; the tenth lent page went back")
	require.Equal(t, uint64(40*MiB), drv.Used(0), "no new memory")
	require.Equal(t, int64(drv.Used(0)), stats(t, a, 0).ReservedBytes[pools.StatAll].Current, "reserved is what the device holds")
	require.True(t, drv.Accessible(0, p, 18*MiB))
	require.True(t, drv.Accessible(0, x, 16*MiB) && drv.Accessible(0, y, 6*MiB), "old mappings stay while the work runs")
	require.NoError(t, a.CheckInvariants())

	drv.CompleteAll()
	freeAndRelease(t, a, drv, k1, k2, p)
}

// Pages come from other streams' ranges and from the small pool's empty
// pages; a private pool's free pages never move, and nothing moves during a
// capture. Another stream's pages move once a mark recorded after their
// free has completed: the legacy stream's (0) at any miss, a stream's own
// at its own misses (TestStitchNeverNamesADestroyedStream).
func TestStitchSourcesAndRules(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, stitch)
	// The legacy stream's range: a 6 MiB hole.
	o := mustMalloc(t, a, 0, 6*MiB, 0)
	ok := mustMalloc(t, a, 0, 2*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: o}))
	// Stream 1's small pool: two pages of small blocks, then all freed.
	var small []cuda.Ptr
	for i := 0; i < 6; i++ {
		small = append(small, mustMalloc(t, a, 0, 700*KiB, 1))
	}
	for _, x := range small {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	// A graph's pool with a free 8 MiB block, its graph alive.
	g := allocator.PoolID{A: 1}
	const cs = cuda.Stream(9)
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	gx := mustMalloc(t, a, 0, 8*MiB, cs)
	gk := mustMalloc(t, a, 0, 2*MiB, cs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: gx}))
	before := stitchStats(t, a).Remaps
	side := mustMalloc(t, a, 0, 12*MiB, 0) // a miss during the capture
	require.Equal(t, before, stitchStats(t, a).Remaps, "no stitching during a capture")
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: side}))
	require.NoError(t, a.EmptyCache(0)) // side's pages go: a clean start
	require.Equal(t, int64(3), before, "the small pool's pages came from the legacy stream's hole")

	before = stitchStats(t, a).Remaps
	p := mustMalloc(t, a, 0, 20*MiB, 2) // stream 2: a range of its own
	require.Equal(t, before, stitchStats(t, a).Remaps, "empty_cache unmapped the holes before")

	o = mustMalloc(t, a, 0, 6*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: o}))
	for i := range small {
		small[i] = mustMalloc(t, a, 0, 700*KiB, 0)
	}
	for _, x := range small {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	// Stream 2 frees p after its last request: no mark certifies that
	// free, and its ten pages are fewer than the miss below lacks, so the
	// device is not synchronized for them (TestStitchSynchronizesForOtherStreams).
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	used := drv.Used(0)
	graphMapped := mappedIn(t, a, g)
	before = stitchStats(t, a).Remaps
	legacy, others := freePagesOf(a, 0), freePagesOf(a, 2)
	require.Equal(t, int64(3), legacy, "the legacy stream's hole, moved to its small pool")
	require.Equal(t, int64(10), others, "stream 2's")
	q := mustMalloc(t, a, 0, 40*MiB, 3)
	require.Equal(t, before+legacy, stitchStats(t, a).Remaps, "every idle free page of the legacy stream moved")
	require.Equal(t, others, freePages(a), "the other streams' pages stay")
	require.Equal(t, used+uint64(20-legacy)*2*MiB, drv.Used(0), "the rest is new memory")
	require.Equal(t, graphMapped, mappedIn(t, a, g), "the live graph's pool kept its pages")
	require.True(t, drv.Accessible(0, q, 40*MiB))
	require.Zero(t, stitchStats(t, a).Syncs)

	for _, x := range []cuda.Ptr{ok, gk, q} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// freePages counts the whole pages inside free blocks of the default
// pools' expandable segments, from the snapshot.
func freePages(a *allocator.Allocator) int64 { return freePagesOf(a, -1) }

// freePagesOf is freePages of stream s's segments (-1: every stream's).
func freePagesOf(a *allocator.Allocator, stream int64) int64 {
	var n int64
	for _, s := range a.Snapshot(nil, true).Segments {
		if !s.IsExpandable || s.SegmentPoolID != [2]uint64{} || stream >= 0 && s.Stream != uint64(stream) {
			continue
		}
		for _, b := range s.Blocks {
			if b.State == "inactive" {
				lo := (b.Address + 2*MiB - 1) / (2 * MiB)
				hi := (b.Address + b.Size) / (2 * MiB)
				if hi > lo {
					n += int64(hi - lo)
				}
			}
		}
	}
	return n
}

// mappedIn is the memory pool g's snapshot segments show.
func mappedIn(t *testing.T, a *allocator.Allocator, g allocator.PoolID) uint64 {
	t.Helper()
	var n uint64
	for _, s := range a.Snapshot(&g, false).Segments {
		n += s.TotalSize
	}
	require.NotZero(t, n)
	return n
}

// empty_cache synchronizes before it unmaps: cuMemUnmap does not wait for
// work still using the pages (the simulator refuses such an unmap).
func TestExpandableUnmapWaitsForWork(t *testing.T) {
	lockThread(t)
	for _, conf := range []string{expandable, stitch} {
		a, drv := newAlloc(t, 1, GiB, conf)
		p := mustMalloc(t, a, 0, 10*MiB, 1)
		drv.Use(0, 1, p, 10*MiB)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		require.NoError(t, a.EmptyCache(0))
		require.Zero(t, drv.Used(0))
		require.Zero(t, drv.Violations(), "%s: %v", conf, drv.ViolationLog())
	}
}

// Growth maps at least the mapping unit at once in large pools (one
// cuMemSetAccess for several small steps), falls back to what is needed
// when the memory fraction does not allow more, and small pools map page
// by page. With stitching the default large pool maps the
// same unit in page-sized physical allocations, the pieces stitching moves.
func TestExpandableMapUnit(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "expandable_segments:True,stitch:False")
	require.Equal(t, uint64(allocator.DefaultMapUnit), a.Config().ExpandableMapUnit)
	var ps []cuda.Ptr
	for i := 0; i < 6; i++ {
		ps = append(ps, mustMalloc(t, a, 0, 3*MiB, 0))
	}
	maps, _ := drv.MapCalls(0)
	require.Equal(t, uint64(20*MiB), drv.Mapped(0), "18 MiB in one 20 MiB step")
	require.Equal(t, int64(1), maps, "one 20 MiB physical allocation, one cuMemMap")
	ps = append(ps, mustMalloc(t, a, 0, 3*MiB, 0))
	require.Equal(t, uint64(40*MiB), drv.Mapped(0))
	ps = append(ps, mustMalloc(t, a, 0, 100*KiB, 0))
	require.Equal(t, uint64(42*MiB), drv.Mapped(0), "the small pool maps one page")
	for _, p := range ps {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.EmptyCache(0))

	// Under a memory fraction of 30 MiB: 24 MiB of blocks fit only if
	// the last step maps just what it needs.
	require.NoError(t, a.SetMemoryFraction(0, 30.0/1024))
	x := mustMalloc(t, a, 0, 20*MiB, 0)
	y := mustMalloc(t, a, 0, 4*MiB, 0)
	require.Equal(t, uint64(24*MiB), drv.Mapped(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	// On a 24 MiB device: the first step maps 20 MiB; the second needs
	// one more page, and the device has no room for a whole unit.
	a, drv = newAlloc(t, 1, 24*MiB, "expandable_segments:True,stitch:False")
	x = mustMalloc(t, a, 0, 3*MiB, 0)
	require.Equal(t, uint64(20*MiB), drv.Mapped(0))
	y = mustMalloc(t, a, 0, 18*MiB, 0)
	require.Equal(t, uint64(22*MiB), drv.Mapped(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	a, drv = newAlloc(t, 1, GiB, stitching)
	for i := 0; i < 6; i++ {
		mustMalloc(t, a, 0, 3*MiB, 0)
	}
	maps, _ = drv.MapCalls(0)
	require.Equal(t, uint64(20*MiB), drv.Mapped(0), "18 MiB in one 20 MiB step")
	require.Equal(t, int64(10), maps, "ten 2 MiB physical allocations")
	require.Equal(t, 10, drv.Handles(0))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// Stitching is on by default, with expandable segments
// (expandable_segments:True means the same); stitch:False keeps expandable
// segments without it, expandable_segments:False turns both off (ordinary
// segments), stitch:True alone implies expandable segments; a named
// stitch:True with expandable_segments:False is an error whatever the order
// of the keys; the string form parses back to the same configuration.
func TestStitchConfig(t *testing.T) {
	def, _, err := allocator.ParseConfig("")
	require.NoError(t, err)
	require.True(t, def.Stitch, "on by default")
	require.True(t, def.ExpandableSegments, "expandable segments by default")
	require.False(t, def.StitchSet || def.ExpandableSet, "nothing named")
	require.Empty(t, def.String(), "the defaults are not written out")
	require.Equal(t, allocator.DefaultConfig(), def)

	for _, c := range []struct {
		conf, str   string
		exp, stitch bool
	}{
		{"stitch:True,expandable_map_unit_mb:4", "expandable_map_unit_mb:4,stitch:True", true, true},
		{"expandable_segments:True", "expandable_segments:True", true, true},
		{"stitch:True", "stitch:True", true, true},
		{"stitch:False", "stitch:False", true, false},
		{"expandable_segments:False", "expandable_segments:False", false, false},
		{"stitch:False,expandable_segments:False", "expandable_segments:False,stitch:False", false, false},
		{"expandable_segments:False,stitch:False", "expandable_segments:False,stitch:False", false, false},
		{"stitch:True,stitch:False,expandable_segments:False", "expandable_segments:False,stitch:False", false, false},
		{"expandable_segments:True,stitch:True", "expandable_segments:True,stitch:True", true, true},
		{"expandable_segments:True,stitch:False", "expandable_segments:True,stitch:False", true, false},
		{"stitch_chunk_mb:4", "stitch_chunk_mb:4", true, true},
		{"stitch_chunk_mb:2", "", true, true},
	} {
		cfg, warn, err := allocator.ParseConfig(c.conf)
		require.NoError(t, err, c.conf)
		require.Empty(t, warn, c.conf)
		require.Equal(t, c.exp, cfg.ExpandableSegments, c.conf)
		require.Equal(t, c.stitch, cfg.Stitch, c.conf)
		require.Equal(t, c.str, cfg.String(), c.conf)
		again, _, err := allocator.ParseConfig(cfg.String())
		require.NoError(t, err)
		require.Equal(t, cfg, again, c.conf)
	}
	for _, bad := range []string{"stitch:yes", "expandable_map_unit_mb:3", "expandable_map_unit_mb:0", "expandable_map_unit_mb:-2", "expandable_map_unit_mb:x",
		"stitch_chunk_mb:3", "stitch_chunk_mb:0", "stitch_chunk_mb:2048", "stitch_chunk_mb:x"} {
		_, _, err := allocator.ParseConfig(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidConfig, bad)
	}

	// The contradictory pair, in either order, whatever lies between.
	for _, bad := range []string{"stitch:True,expandable_segments:False", "expandable_segments:False,stitch:True",
		"expandable_segments:False,max_split_size_mb:64,stitch:True", "stitch:False,stitch:True,expandable_segments:False"} {
		_, _, err := allocator.ParseConfig(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidConfig, bad)
		require.EqualError(t, err, "cudapool: configure: stitch:True and expandable_segments:False contradict each other: "+
			"stitching moves the pages of expandable segments. Keep one: expandable_segments:False alone turns stitching off too, "+
			"stitch:False keeps expandable segments without stitching", bad)
	}

	// Across run-time updates (PyTorch's _set_allocator_settings): the keys
	// named earlier count as named, so the pair in force is judged as one
	// configuration; an update that names both settles it; a stitch never
	// named follows expandable_segments both ways.
	named, _, err := allocator.ParseConfig("stitch:True")
	require.NoError(t, err)
	got, _, err := allocator.ParseConfigUpdate(named, "expandable_segments:False")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
	require.Contains(t, err.Error(), "contradict each other (stitch:True is in force from an earlier configuration)")
	require.Equal(t, named, got, "unchanged")
	got, _, err = allocator.ParseConfigUpdate(named, "expandable_segments:False,stitch:False")
	require.NoError(t, err)
	require.False(t, got.ExpandableSegments || got.Stitch)
	got, _, err = allocator.ParseConfigUpdate(got, "expandable_segments:True")
	require.NoError(t, err)
	require.True(t, got.ExpandableSegments)
	require.False(t, got.Stitch, "stitch:False was named: it stays")

	off, _, err := allocator.ParseConfig("expandable_segments:False")
	require.NoError(t, err)
	_, _, err = allocator.ParseConfigUpdate(off, "stitch:True")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
	require.Contains(t, err.Error(), "contradict each other (expandable_segments:False is in force from an earlier configuration)")
	got, _, err = allocator.ParseConfigUpdate(off, "max_split_size_mb:64")
	require.NoError(t, err)
	require.False(t, got.Stitch, "still off")

	got, _, err = allocator.ParseConfigUpdate(def, "expandable_segments:False")
	require.NoError(t, err)
	require.False(t, got.Stitch, "stitch follows expandable_segments off")
	got, _, err = allocator.ParseConfigUpdate(got, "expandable_segments:True")
	require.NoError(t, err)
	require.True(t, got.Stitch, "and back on")
	got, _, err = allocator.ParseConfigUpdate(def, "stitch:False")
	require.NoError(t, err)
	require.True(t, got.ExpandableSegments, "stitch:False keeps expandable segments")
	require.False(t, got.Stitch)
	got, _, err = allocator.ParseConfigUpdate(def, "stitch:True")
	require.NoError(t, err)
	require.True(t, got.ExpandableSegments, "a named stitch:True implies expandable segments")
	require.True(t, got.Stitch)

	// The default, stitch:True and expandable_segments:True all map pages
	// with stitching; expandable_segments:False allocates ordinary segments.
	lockThread(t)
	for _, conf := range []string{"", "stitch:True", stitching} {
		a, drv := newAlloc(t, 1, GiB, conf)
		p := mustMalloc(t, a, 0, 3*MiB, 0)
		require.Zero(t, drv.Allocs(0), "%q: no cuMemAlloc: pages are mapped", conf)
		maps, _ := drv.MapCalls(0)
		require.NotZero(t, maps, conf)
		require.True(t, a.Config().Stitch, conf)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	a, drv := newAlloc(t, 1, GiB, ordinary)
	p := mustMalloc(t, a, 0, 3*MiB, 0)
	require.Equal(t, int64(1), drv.Allocs(0), "ordinary segments: one cuMemAlloc")
	maps, _ := drv.MapCalls(0)
	require.Zero(t, maps, "ordinary segments map nothing")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	// The configuration in force changes the next growth, both ways.
	cfg, _, err := allocator.ParseConfigUpdate(a.Config(), "expandable_segments:True")
	require.NoError(t, err)
	a.Configure(cfg)
	mustMalloc(t, a, 0, 30*MiB, 0)
	require.Equal(t, int64(1), drv.Allocs(0), "pages are mapped")
	maps, _ = drv.MapCalls(0)
	require.NotZero(t, maps)
	a, drv = newAlloc(t, 1, GiB, "")
	cfg, _, err = allocator.ParseConfigUpdate(a.Config(), "expandable_segments:False")
	require.NoError(t, err)
	a.Configure(cfg)
	mustMalloc(t, a, 0, 3*MiB, 0)
	require.Equal(t, int64(1), drv.Allocs(0))
}

// On a full device, the moved pages are mapped even though the whole
// mapping unit cannot be: the request is served from them, with no retry.
func TestStitchFullDeviceUsesMovedPages(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 21*MiB, "stitch:True")
	x := mustMalloc(t, a, 0, 10*MiB, 0) // stream 0 maps a 20 MiB unit
	g := mustMalloc(t, a, 0, 2*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x})) // nine whole free pages around g
	require.Equal(t, uint64(20*MiB), drv.Used(0))

	y := mustMalloc(t, a, 0, 3*MiB, 1) // wants a 20 MiB unit; 1 MiB is free
	require.True(t, drv.Accessible(0, y, 3*MiB))
	require.Equal(t, uint64(20*MiB), drv.Used(0))
	require.Equal(t, int64(9), stitchStats(t, a).Remaps)
	st := stats(t, a, 0)
	require.Zero(t, st.NumAllocRetries)
	require.Zero(t, st.NumOOMs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: g}))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// A capture maps its private pool 20 MiB at a time, each step one physical
// allocation (one cuMemCreate, one cuMemMap), as PyTorch's 20 MiB pages.
// When the capture ends nothing it touched goes back: the chunk it used a
// part of stays whole (cuMemUnmap takes whole mappings), its free tail
// serving the pool's later captures. A range mapped page by page (mapped
// before the unit was raised) gives back the pages mapped ahead and never
// handed out.
func TestCaptureTrimsPagesMappedAhead(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "expandable_segments:True")
	g := allocator.PoolID{A: 1}
	const cs = cuda.Stream(7)
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	x := mustMalloc(t, a, 0, 3*MiB, cs)
	y := mustMalloc(t, a, 0, 4*MiB, cs)
	tmp := mustMalloc(t, a, 0, 5*MiB, cs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: tmp})) // used by the graph: stays
	maps, _ := drv.MapCalls(0)
	require.Equal(t, int64(1), maps, "one 20 MiB step, one physical allocation")
	require.Equal(t, uint64(20*MiB), drv.Mapped(0))
	require.NoError(t, drv.EndCapture(cs), "the capture stayed valid")
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.Equal(t, uint64(20*MiB), drv.Mapped(0), "a chunk in use stays whole")
	require.Equal(t, uint64(20*MiB), mappedIn(t, a, g))
	require.True(t, drv.Accessible(0, x, 20*MiB))
	require.NoError(t, a.CheckInvariants())

	// The pool's later capture uses the chunk's free tail: nothing mapped.
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	z := mustMalloc(t, a, 0, 6*MiB, cs)
	require.True(t, drv.Accessible(0, z, 6*MiB))
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	maps, _ = drv.MapCalls(0)
	require.Equal(t, int64(1), maps)
	for _, p := range []cuda.Ptr{x, y, z} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.ReleasePool(0, g)) // both graphs
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Mapped(0))
	require.NoError(t, a.CheckInvariants())

	// A pool whose range was made page by page (unit 2 MiB), then grown
	// 20 MiB at a time: the pages mapped ahead go back at the end.
	a, drv = newAlloc(t, 1, GiB, expandable)
	g = allocator.PoolID{A: 2}
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	x = mustMalloc(t, a, 0, 3*MiB, cs)
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	cfg, _, err := allocator.ParseConfig("expandable_segments:True")
	require.NoError(t, err)
	a.Configure(cfg)
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	y = mustMalloc(t, a, 0, 4*MiB, cs)
	require.Equal(t, uint64(24*MiB), drv.Mapped(0), "4 MiB, then a 20 MiB step in pages")
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.Equal(t, uint64(8*MiB), drv.Mapped(0), "x and y: four pages")
	require.True(t, drv.Accessible(0, x, 8*MiB))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Mapped(0))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// A private pool maps each growth as one allocation of up to 128 MiB, and
// memory goes back in whole allocations: a block that outlives its pool
// keeps the allocation it lies on, 128 MiB of a 512 MiB growth, until it
// is freed.
func TestPrivateGrowthAllocations(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "expandable_segments:True")
	g := allocator.PoolID{A: 1}
	const cs = cuda.Stream(7)
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	big := mustMalloc(t, a, 0, 512*MiB, cs)
	maps, _ := drv.MapCalls(0)
	require.Equal(t, int64(4), maps, "512 MiB in four allocations of 128 MiB")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: big}))
	out := mustMalloc(t, a, 0, 2*MiB, cs) // the graph's output
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, uint64(128*MiB), drv.Mapped(0), "the output keeps the allocation it lies on")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: out}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Mapped(0))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// With stitch_chunk_mb:4 the default large pool's ranges are mapped in
// 4 MiB allocations and give and take them whole, two pages at a time; the
// small pool, mapped page by page, neither gives to them nor takes from
// them, so that every range holds allocations of one size (CUDA IPC's
// handle needs it: vmem/export.go).
func TestStitchChunks(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "stitch_chunk_mb:4")
	const s1 = cuda.Stream(1)
	big := mustMalloc(t, a, 0, 40*MiB, 0)
	keep := mustMalloc(t, a, 0, 20*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: big}))
	used := drv.Used(0)
	require.Equal(t, uint64(60*MiB), used)

	// Another stream's miss takes the hole's chunks instead of new memory.
	p := mustMalloc(t, a, 0, 16*MiB, s1)
	st := stitchStats(t, a)
	require.Positive(t, st.Remaps)
	require.Zero(t, st.Remaps%2, "whole 4 MiB chunks: %d pages", st.Remaps)
	require.Equal(t, used, drv.Used(0), "no new physical memory")
	require.True(t, drv.Accessible(0, p, 16*MiB))
	require.False(t, drv.Accessible(0, big+cuda.Ptr(40*MiB)-4*MiB, 4*MiB), "the hole's last chunk moved")

	// A small block needs a 2 MiB page: the large pool's chunks stay.
	small := mustMalloc(t, a, 0, 700*KiB, 0)
	require.Equal(t, st.Remaps, stitchStats(t, a).Remaps)
	require.Equal(t, used+2*MiB, drv.Used(0), "a new page")

	freeAndRelease(t, a, drv, keep, p, small)
}

// A growth whose cuMemMap or cuMemSetAccess fails part way gives the lent
// pages it had taken back to their blocks, where their old mapping still
// holds them: no physical memory is left uncounted by reserved memory (nor
// released under a live mapping).
func TestStitchMapFaultKeepsLentPages(t *testing.T) {
	lockThread(t)
	for _, c := range []struct{ conf, call string }{
		{"", "MemMap"}, {"stitch_chunk_mb:4", "MemMap"}, {"", "MemSetAccess"}, {"stitch_chunk_mb:4", "MemSetAccess"},
	} {
		conf := c.conf + " (" + c.call + ")"
		cfg, _, err := allocator.ParseConfig(c.conf)
		require.NoError(t, err)
		drv := sim.New(sim.Options{Devices: 1, Memory: GiB})
		f := fault.New(drv)
		a, err := allocator.New(f, cfg)
		require.NoError(t, err)
		a.SetWarningHandler(func(string) {})
		x := mustMalloc(t, a, 0, 16*MiB, 0)
		k := mustMalloc(t, a, 0, 4*MiB, 0)
		drv.Use(0, 0, x, 16*MiB) // busy on the request's stream: lent
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
		skip := 1 // (the second chunk's map; the access of the whole run)
		if c.call == "MemSetAccess" {
			skip = 0
		}
		f.Fail(c.call, "", skip, cuda.ErrUnknown)
		p, err := a.Malloc(&allocator.MallocRequest{Dev: 0, Size: 20 * MiB})
		require.Error(t, err, conf)
		require.Zero(t, p)
		require.Equal(t, int64(drv.Used(0)), stats(t, a, 0).ReservedBytes[pools.StatAll].Current,
			"%q: reserved memory counts every physical allocation", conf)
		require.True(t, drv.Accessible(0, x, 16*MiB), "%q: the lent pages are back where they were", conf)
		require.NoError(t, a.CheckInvariants())
		drv.CompleteAll()
		freeAndRelease(t, a, drv, k)
	}
}

// freeAndRelease frees ps, empties the cache of device 0, and requires
// that nothing is left there and that the driver saw no violation.
func freeAndRelease(t *testing.T, a *allocator.Allocator, drv *sim.Driver, ps ...cuda.Ptr) {
	t.Helper()
	for _, p := range ps {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	require.Zero(t, drv.Mapped(0))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}
