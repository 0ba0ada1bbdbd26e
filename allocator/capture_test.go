// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

func TestFreedBlockNotReusedByOtherStream(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	q := mustMalloc(t, a, 0, 4096, 2)
	require.NotEqual(t, p, q)
	r := mustMalloc(t, a, 0, 4096, 1)
	require.Equal(t, p, r)
}

func TestRecordStreamDelaysReuse(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.RecordStream(p, 1), "the allocating stream needs no event")
	require.NoError(t, a.RecordStream(p, 2))
	require.NoError(t, a.RecordStream(p, 3))
	drv.Submit(2) // a kernel on stream 2 still reads p
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	st := stats(t, a, 0)
	require.Equal(t, int64(0), st.Allocation[pools.StatAll].Current, "freed for the user")
	require.Equal(t, int64(1), st.Active[pools.StatAll].Current, "but still active")
	q := mustMalloc(t, a, 0, 4096, 1)
	require.NotEqual(t, p, q, "stream 2's work has not completed")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))

	drv.Complete(3)
	r := mustMalloc(t, a, 0, 4096, 1)
	require.NotEqual(t, p, r, "every use must complete, not just one")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: r}))

	drv.Complete(2)
	s := mustMalloc(t, a, 0, 4096, 1)
	require.Equal(t, p, s, "reused once all uses completed")
	require.Equal(t, int64(1), stats(t, a, 0).Active[pools.StatAll].Current)
	require.NoError(t, a.CheckInvariants())
}

func TestEmptyCacheWaitsForEvents(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.RecordStream(p, 2))
	drv.Submit(2)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.EmptyCache(0), "synchronizes the pending event, then frees")
	require.Equal(t, 0, drv.Live(0))
	require.Equal(t, int64(1), stats(t, a, 0).NumSyncAllStreams)
	require.Zero(t, drv.LiveEvents(), "pooled events destroyed")
}

// captureFilter answers like PyTorch's: is s capturing into capture id?
func captureFilter(drv *sim.Driver, id *uint64) func(cuda.Stream) bool {
	return func(s cuda.Stream) bool {
		st, cid, err := drv.StreamCaptureInfo(0, s)
		return err == nil && st == cuda.CaptureActive && cid == atomic.LoadUint64(id)
	}
}

func beginCapture(t *testing.T, a *allocator.Allocator, drv *sim.Driver, pool allocator.PoolID, s cuda.Stream, mode cuda.CaptureMode) *uint64 {
	t.Helper()
	id := new(uint64)
	require.NoError(t, a.BeginAllocateToPool(0, pool, captureFilter(drv, id)))
	require.NoError(t, drv.BeginCapture(s, mode))
	_, cid, _ := drv.StreamCaptureInfo(0, s)
	atomic.StoreUint64(id, cid)
	return id
}

func TestCaptureRoutesToPrivatePool(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	const cs = cuda.Stream(7)
	eager := mustMalloc(t, a, 0, 4096, cs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: eager})) // cached in the default pool

	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	x := mustMalloc(t, a, 0, 4096, cs)
	require.NotEqual(t, eager, x, "a capture never takes default-pool memory")
	side := mustMalloc(t, a, 0, 4096, 8)
	require.NotEqual(t, x, side)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	y := mustMalloc(t, a, 0, 4096, cs)
	require.Equal(t, x, y, "memory freed during the capture is reused within it")
	require.ErrorIs(t, a.EmptyCache(0), allocator.ErrCaptureUnderway)
	require.NoError(t, drv.EndCapture(cs), "the capture stayed valid")
	require.NoError(t, a.EndAllocateToPool(0, g))

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y})) // output freed while the graph lives
	z := mustMalloc(t, a, 0, 4096, cs)
	require.NotEqual(t, y, z, "eager code never gets the graph's memory")
	require.Equal(t, eager, z)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: side}))
	live := drv.Live(0)
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, live-1, drv.Live(0), "side's free segment goes; the private pool's stays reserved")

	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 1, drv.Live(0), "the released pool's segment went back; z's remains")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.CheckInvariants())
}

func TestSharedPoolAndReleaseOrder(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	const cs = cuda.Stream(7)
	g := allocator.PoolID{B: 1} // graph_pool_handle()
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	x := mustMalloc(t, a, 0, 4096, cs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))

	// A second graph shares the pool: it may reuse what the first freed.
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	y := mustMalloc(t, a, 0, 4096, cs)
	require.Equal(t, x, y, "graphs sharing a pool share its free blocks")
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))

	require.NoError(t, a.ReleasePool(0, g)) // first graph dies
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 1, drv.Live(0), "the second graph still holds the pool")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.ReleasePool(0, g)) // second graph dies
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 0, drv.Live(0))
	require.ErrorIs(t, a.ReleasePool(0, g), allocator.ErrUnknownPool, "the pool is gone")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

func TestReleaseBeforeFreeKeepsPoolUntilEmpty(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	g := allocator.PoolID{A: 3}
	beginCapture(t, a, drv, g, 7, cuda.CaptureModeThreadLocal)
	x := mustMalloc(t, a, 0, 30*MiB, 7)
	require.NoError(t, drv.EndCapture(7))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.NoError(t, a.ReleasePool(0, g)) // graph gone, but x still allocated
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 1, drv.Live(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x})) // returns into the released pool
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 0, drv.Live(0))
	require.Zero(t, drv.Violations())
}

func TestDeferredFreesDuringCapture(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.RecordStream(p, 2))
	drv.Submit(2)
	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, 7, cuda.CaptureModeGlobal)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p})) // needs an event: deferred, no record
	mustMalloc(t, a, 0, 4096, 7)                              // no event query during capture
	mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, drv.EndCapture(7))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	q := mustMalloc(t, a, 0, 4096, 1) // records the deferred event; 2 still busy
	require.NotEqual(t, p, q)
	drv.Complete(2)
	r := mustMalloc(t, a, 0, 4096, 1)
	require.Equal(t, p, r, "returned once the capture ended and stream 2 finished")
	require.NoError(t, a.CheckInvariants())
}

func TestTwoConcurrentCaptures(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	type result struct{ inside []cuda.Ptr }
	var wg sync.WaitGroup
	var mu sync.Mutex
	ready := make(chan struct{})
	results := map[int]*result{}
	for i := 1; i <= 2; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			lockThread(t)
			s := cuda.Stream(100 + i)
			id := new(uint64)
			pool := allocator.PoolID{A: uint64(i)}
			require.NoError(t, a.BeginAllocateToPool(0, pool, captureFilter(drv, id)))
			require.NoError(t, drv.BeginCapture(s, cuda.CaptureModeThreadLocal))
			_, cid, _ := drv.StreamCaptureInfo(0, s)
			atomic.StoreUint64(id, cid)
			<-ready // both captures under way together
			res := &result{}
			for k := 0; k < 20; k++ {
				p := mustMalloc(t, a, 0, uint64(k+1)*KiB, s)
				res.inside = append(res.inside, p)
			}
			require.NoError(t, drv.EndCapture(s))
			require.NoError(t, a.EndAllocateToPool(0, pool))
			mu.Lock()
			results[i] = res
			mu.Unlock()
		}(i)
	}
	close(ready)
	wg.Wait()
	// Each capture's blocks lie in segments no other capture touched.
	segOf := map[cuda.Ptr]int{}
	for i, r := range results {
		for _, p := range r.inside {
			base, _, err := a.BaseAllocation(p)
			require.NoError(t, err)
			if o, ok := segOf[base]; ok {
				require.Equal(t, i, o, "captures must not share segments")
			}
			segOf[base] = i
		}
	}
	snap := a.Snapshot(nil, true)
	byPool := map[[2]uint64]int{}
	for _, s := range snap.Segments {
		byPool[s.SegmentPoolID]++
	}
	require.Equal(t, 2, len(byPool))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

func TestUnannouncedCaptureGetsAutomaticPool(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	const cs = cuda.Stream(9)
	eager := mustMalloc(t, a, 0, 4096, cs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: eager}))
	require.NoError(t, drv.BeginCapture(cs, cuda.CaptureModeGlobal))
	x := mustMalloc(t, a, 0, 4096, cs)
	require.NotEqual(t, eager, x, "the capture got its own pool")
	require.ErrorIs(t, a.EmptyCache(0), allocator.ErrCaptureUnderway, "the allocator knows a capture runs")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	y := mustMalloc(t, a, 0, 4096, cs)
	require.Equal(t, x, y)
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	z := mustMalloc(t, a, 0, 4096, cs)
	require.Equal(t, eager, z, "after the capture, eager code gets default memory")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: z}))
	require.NoError(t, a.EmptyCache(0), "the capture ended: empty_cache works again")
	require.Equal(t, 1, drv.Live(0), "the automatic pool is kept for the graph's life (the process)")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	snap := a.Snapshot(nil, true)
	require.Len(t, snap.Segments, 1)
	require.NotZero(t, snap.Segments[0].SegmentPoolID[0]&(1<<63))
}

func TestAnnouncedAllocatorDoesNotQueryCapture(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "")
	a.ExpectAnnouncements()
	require.NoError(t, drv.BeginCapture(9, cuda.CaptureModeThreadLocal))
	x := mustMalloc(t, a, 0, 4096, 9) // trusted: default pool
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, drv.EndCapture(9))
	require.Zero(t, drv.Violations(), "segments are still allocated in relaxed mode")
	require.Len(t, a.Snapshot(nil, true).Segments, 1)
	require.Equal(t, [2]uint64{0, 0}, a.Snapshot(nil, true).Segments[0].SegmentPoolID)
}
