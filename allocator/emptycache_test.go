// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"math/rand"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/stretchr/testify/require"
)

// empty_cache skips its full path when the device has nothing to release
// (device.nothingToRelease); each kind of cached thing turns the skip off
// until a release gives it back.
func TestEmptyCacheNothingToRelease(t *testing.T) {
	a, drv := newAlloc(t, 1, 8*GiB, ordinary)
	a.ExpectAnnouncements()
	require.True(t, allocator.NothingToRelease(a, 0), "a new device")

	// A whole free segment of the default pools.
	p := mustMalloc(t, a, 0, 4*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.False(t, allocator.NothingToRelease(a, 0))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	require.True(t, allocator.NothingToRelease(a, 0))

	// A free block of a split segment is not whole, but it was inserted:
	// one full pass finds nothing and clears the flag.
	p = mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 0, 4096, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.False(t, allocator.NothingToRelease(a, 0))
	require.NoError(t, a.EmptyCache(0))
	require.NotZero(t, drv.Used(0), "the segment is still in use")
	require.True(t, allocator.NothingToRelease(a, 0))

	// An event: a free on another stream's behalf.
	require.NoError(t, a.RecordStream(q, 5))
	drv.Submit(5)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.False(t, allocator.NothingToRelease(a, 0))
	drv.CompleteAll()
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.LiveEvents(), "pooled events are destroyed")
	require.Zero(t, drv.Used(0))
	require.True(t, allocator.NothingToRelease(a, 0))

	// A released private pool.
	id := allocator.PoolID{A: 7}
	require.NoError(t, a.BeginAllocateToPool(0, id, nil))
	p = mustMalloc(t, a, 0, 4*MiB, 0)
	require.NoError(t, a.EndAllocateToPool(0, id))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.True(t, allocator.NothingToRelease(a, 0), "the pool is still held")
	require.NoError(t, a.ReleasePool(0, id))
	require.False(t, allocator.NothingToRelease(a, 0))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Used(0))
	require.True(t, allocator.NothingToRelease(a, 0))
}

// Expandable segments: free mapped pages turn the skip off.
func TestEmptyCacheNothingToReleaseExpandable(t *testing.T) {
	a, drv := newAlloc(t, 1, 8*GiB, "expandable_segments:True")
	p := mustMalloc(t, a, 0, 40*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NotZero(t, drv.Mapped(0))
	require.False(t, allocator.NothingToRelease(a, 0))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Mapped(0))
	require.True(t, allocator.NothingToRelease(a, 0))
}

// The skip changes nothing anyone can see: the randomized machine (every
// operation, empty_cache among them, with every invariant checked after
// each step, the releasable flags and the count of released pools among
// them) run once with the skip and once with empty_cache's full path every
// time places every block alike and leaves the driver alike. Both paths
// trust the releasable flags (ReleasePool and UnmapFree skip an unflagged
// pool), so a flag missing where it is needed is caught by those
// invariants (Cache.Check), not by the comparison.
func TestEmptyCacheSkipMatchesFullPath(t *testing.T) {
	confs := []string{ordinary, ordinary + ",garbage_collection_threshold:0.7", "expandable_segments:True,stitch:False", ""}
	seeds := 4
	if testing.Short() || raceOn {
		seeds = 2
	}
	var skips int64
	for _, conf := range confs {
		for seed := 0; seed < seeds; seed++ {
			rng := rand.New(rand.NewSource(int64(100 + seed)))
			data := make([]byte, 6000)
			rng.Read(data)
			t.Run(conf+"/"+string(rune('a'+seed)), func(t *testing.T) {
				lockThread(t)
				stop := allocator.CountEmptyCacheSkips()
				fast := newMachine(t, conf, append([]byte(nil), data...))
				fast.run()
				skips += stop()
				prev := allocator.EmptyCacheFull(true)
				defer allocator.EmptyCacheFull(prev)
				full := newMachine(t, conf, append([]byte(nil), data...))
				full.run()
				require.Equal(t, full.placed, fast.placed)
				for dev := 0; dev < devices; dev++ {
					require.Equal(t, driverState(full.drv, dev), driverState(fast.drv, dev), "device %d", dev)
				}
			})
		}
	}
	require.Positive(t, skips, "the runs took the skip")
}

type drvState struct {
	allocs, frees, maps, unmaps int64
	used, mapped                uint64
	live, handles, events, res  int
}

func driverState(d interface {
	Allocs(int) int64
	Frees(int) int64
	MapCalls(int) (int64, int64)
	Used(int) uint64
	Mapped(int) uint64
	Live(int) int
	Handles(int) int
	LiveEvents() int
	Reservations(int) (int, uint64)
}, dev int) drvState {
	s := drvState{allocs: d.Allocs(dev), frees: d.Frees(dev), used: d.Used(dev), mapped: d.Mapped(dev),
		live: d.Live(dev), handles: d.Handles(dev), events: d.LiveEvents()}
	s.maps, s.unmaps = d.MapCalls(dev)
	s.res, _ = d.Reservations(dev)
	return s
}
