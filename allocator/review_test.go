// SPDX-License-Identifier: Apache-2.0

package allocator_test

// Regressions found by review: unannounced captures and error paths.

import (
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/stretchr/testify/require"
)

// A free whose use stream is capturing (a capture the allocator has not seen
// allocate) records its event into the capture; once the capture is over,
// every later malloc on the device fails because Process aborts on that event.
func TestOneBadEventBreaksEveryMalloc(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.RecordStream(p, 2))
	require.NoError(t, drv.BeginCapture(2, cuda.CaptureModeRelaxed))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, drv.EndCapture(2))
	var got []cuda.Ptr
	for i := 0; i < 3; i++ {
		q, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
		require.NoError(t, err, "malloc %d after the capture ended", i)
		got = append(got, q)
	}
	require.Equal(t, p, got[0], "the free was deferred past the capture, then its event recorded and completed")
	require.Zero(t, drv.Violations(), "no event recorded into the unannounced capture: %v", drv.ViolationLog())
}

// Changing max_split_size at run time makes the oversize statistics drift:
// counted at malloc/segment time with one threshold, uncounted with another.
func TestOversizeStatsDriftAcrossConfigure(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 100*MiB, 1)
	cfg, _, err := allocator.ParseConfig("max_split_size_mb:20")
	require.NoError(t, err)
	a.Configure(cfg)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.EmptyCache(0))
	st := stats(t, a, 0)
	require.GreaterOrEqual(t, st.OversizeAllocations.Current, int64(0), "oversize_allocations.current")
	require.GreaterOrEqual(t, st.OversizeSegments.Current, int64(0), "oversize_segments.current")
}

// The first malloc of an unannounced capture processes pending events before
// the capture is registered: an EventQuery during a global-mode capture.
func TestFirstMallocOfUnannouncedCaptureQueriesEvents(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.RecordStream(p, 2))
	drv.Submit(2)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p})) // one pending event
	require.NoError(t, drv.BeginCapture(3, cuda.CaptureModeGlobal))
	_, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 3})
	require.NoError(t, err)
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, drv.EndCapture(3))
}
