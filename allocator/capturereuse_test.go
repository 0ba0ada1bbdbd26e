// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

const reuseConf = "graph_capture_record_stream_reuse:True,debug_checks:True"

// endCapture ends the capture on s and pool g's allocation to it, with no
// capture rule broken and the invariants intact.
func endCapture(t *testing.T, a *allocator.Allocator, drv *sim.Driver, g allocator.PoolID, s cuda.Stream) {
	t.Helper()
	require.NoError(t, drv.EndCapture(s))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.CheckInvariants())
}

// fork makes to wait on from's captured work, as torch's wait_stream does.
func fork(t *testing.T, drv *sim.Driver, from, to cuda.Stream) {
	t.Helper()
	ev, err := drv.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, drv.EventRecord(0, ev, from))
	require.NoError(t, drv.StreamWaitEvent(0, to, ev))
	require.NoError(t, drv.EventDestroy(0, ev))
}

// PyTorch's test_graph_capture_reclaim_2_streams on the simulator: a block
// read on a forked stream and freed is not reused before the join, and is
// after it, within the same capture.
func TestCaptureReuseTwoStreams(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, reuseConf)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, s1, cuda.CaptureModeThreadLocal)

	sink := mustMalloc(t, a, 0, 32, s1)
	data1 := mustMalloc(t, a, 0, 32, s1)
	fork(t, drv, s1, s2)
	buf2 := mustMalloc(t, a, 0, 32, s2)
	drv.Submit(s2) // buf2 = data1 + 2 on s2
	require.NoError(t, a.RecordStream(data1, s2))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: data1}))

	data2 := mustMalloc(t, a, 0, 32, s1)
	require.NotEqual(t, data1, data2, "before the join s2 may still read data1")

	fork(t, drv, s2, s1) // join
	drv.Submit(s1)       // sink.fill_(1) on s1
	data3 := mustMalloc(t, a, 0, 32, s1)
	require.Equal(t, data1, data3, "after the join all of s2's work precedes s1's new work")

	for _, p := range []cuda.Ptr{sink, buf2, data2, data3} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	endCapture(t, a, drv, g, s1)
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Live(0), "nothing lost")
}

// PyTorch's test_graph_capture_reclaim_4_streams: partial joins are not
// enough; every use stream's work must precede the allocating stream's.
func TestCaptureReuseFourStreamsPartialJoins(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, reuseConf)
	const s1, s2, s3, s4 = cuda.Stream(1), cuda.Stream(2), cuda.Stream(3), cuda.Stream(4)
	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, s1, cuda.CaptureModeThreadLocal)

	data1 := mustMalloc(t, a, 0, 32, s1)
	drv.Submit(s1) // torch.ones
	var live []cuda.Ptr
	for _, s := range []cuda.Stream{s2, s3, s4} {
		fork(t, drv, s1, s)
		live = append(live, mustMalloc(t, a, 0, 32, s))
		drv.Submit(s)
		require.NoError(t, a.RecordStream(data1, s))
	}
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: data1}))

	fork(t, drv, s2, s1) // s1 joins s2 only
	drv.Submit(s1)
	fork(t, drv, s4, s3) // s3 joins s4
	drv.Submit(s3)
	p := mustMalloc(t, a, 0, 32, s1)
	require.NotEqual(t, data1, p, "s3 and s4 are not yet joined into s1")
	live = append(live, p)

	fork(t, drv, s3, s1) // s1 joins s3 (and through it s4)
	drv.Submit(s1)
	q := mustMalloc(t, a, 0, 32, s1)
	require.Equal(t, data1, q, "every use now precedes s1's new work")
	live = append(live, q)

	for _, p := range live {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	endCapture(t, a, drv, g, s1)
}

// Without the option, or when a use stream is not in the capture (another
// thread's stream), the block waits for the capture's end and its events.
func TestCaptureReuseOffOrOutsideStream(t *testing.T) {
	for _, tc := range []struct {
		name, conf string
		joinUse    bool
	}{
		{"option off", "debug_checks:True", true},
		{"use stream outside the capture", reuseConf, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lockThread(t)
			a, drv := newAlloc(t, 1, GiB, tc.conf)
			const s1, s2 = cuda.Stream(1), cuda.Stream(2)
			g := allocator.PoolID{A: 1}
			beginCapture(t, a, drv, g, s1, cuda.CaptureModeThreadLocal)
			data1 := mustMalloc(t, a, 0, 32, s1)
			if tc.joinUse {
				fork(t, drv, s1, s2)
			}
			drv.Submit(s2)
			require.NoError(t, a.RecordStream(data1, s2))
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: data1}))
			if tc.joinUse {
				fork(t, drv, s2, s1)
			}
			drv.Submit(s1)
			p := mustMalloc(t, a, 0, 32, s1)
			require.NotEqual(t, data1, p, "reused inside the capture")
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
			endCapture(t, a, drv, g, s1)

			drv.CompleteAll()
			// Ordinary frees after the capture: the deferred block gets its
			// events, and comes back once they complete.
			require.NoError(t, a.CheckInvariants())
			require.NoError(t, a.ReleasePool(0, g))
			require.NoError(t, a.EmptyCache(0))
			require.Zero(t, drv.Live(0), "nothing lost")
		})
	}
}

// A block still deferred when its capture ends and then returned by
// empty_cache (or a checkpoint's settle) takes its free markers with it:
// left behind, they pointed at a block that could be recycled, and kept
// every later capture's walked nodes alive (seen is only cleared once no
// markers are left).
func TestCaptureReuseMarkersDroppedWithDeferred(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, reuseConf)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, s1, cuda.CaptureModeThreadLocal)
	data1 := mustMalloc(t, a, 0, 32, s1)
	fork(t, drv, s1, s2)
	drv.Submit(s2)
	require.NoError(t, a.RecordStream(data1, s2))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: data1})) // s2 not joined yet: deferred
	drv.Submit(s1)
	p := mustMalloc(t, a, 0, 32, s1) // walks s1's graph
	markers, walks := allocator.CaptureReuseState(a, 0)
	require.Equal(t, 1, markers)
	require.Equal(t, 1, walks)
	fork(t, drv, s2, s1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, drv.EndCapture(s1))
	require.NoError(t, a.EndAllocateToPool(0, g))

	drv.CompleteAll()
	require.NoError(t, a.EmptyCache(0)) // returns the deferred block
	markers, walks = allocator.CaptureReuseState(a, 0)
	require.Zero(t, markers, "markers of a block no longer deferred")
	require.Zero(t, walks)
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.CheckInvariants())
}

// While blocks wait for their markers, a cache-hit malloc and free in the
// capture allocate no Go memory: the option's trace arguments (boxed into
// ...any, and a second walk of each block's markers) were built on every
// malloc even with tracing off.
func TestCaptureReuseMallocAllocatesNothing(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "graph_capture_record_stream_reuse:True")
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, s1, cuda.CaptureModeThreadLocal)
	drv.Submit(s1)
	var held []cuda.Ptr
	for i := 0; i < 4; i++ {
		data := mustMalloc(t, a, 0, 4096, s1)
		fork(t, drv, s1, s2)
		drv.Submit(s2)
		require.NoError(t, a.RecordStream(data, s2))
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: data})) // waits: s2 is not joined
		held = append(held, data)
	}
	markers, _ := allocator.CaptureReuseState(a, 0)
	require.Equal(t, 4, markers)
	warm := mustMalloc(t, a, 0, 4096, s1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: warm}))
	allocs := testing.AllocsPerRun(200, func() {
		p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: s1})
		_ = a.Free(allocator.FreeRequest{Ptr: p})
	})
	require.Zero(t, allocs)
	markers, _ = allocator.CaptureReuseState(a, 0)
	require.Equal(t, 4, markers, "still waiting")

	fork(t, drv, s2, s1) // join
	drv.Submit(s1)
	p := mustMalloc(t, a, 0, 4096, s1)
	require.Contains(t, held, p, "reused after the join")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	endCapture(t, a, drv, g, s1)
}
