// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
)

// A capture announced on one device while another device is freeing cached
// memory (here empty_cache; the OOM retry is the same section) must not
// return before that free is done: the caller begins capturing right
// after, and a free then would invalidate the capture. Found by the soak
// (a global capture on device 1 invalidated by device 0's OOM retry).
func TestCaptureBeginWaitsForOtherDevicesFrees(t *testing.T) {
	lockThread(t)
	s := sim.New(sim.Options{Devices: 2, Memory: GiB})
	f := fault.New(s)
	a, err := allocator.New(f, allocator.Config{})
	require.NoError(t, err)
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 4096}))

	inFree := make(chan struct{})
	var freed time.Time
	f.Before("MemFree", "", func() {
		close(inFree)
		time.Sleep(50 * time.Millisecond) // a slow cudaFree
		freed = time.Now()
	})
	done := make(chan error)
	go func() { done <- a.EmptyCache(0) }()
	<-inFree
	cs := cuda.Stream(7)
	require.NoError(t, a.BeginAllocateToPool(1, allocator.PoolID{A: 1}, func(x cuda.Stream) bool { return x == cs }))
	begun := time.Now()
	require.NoError(t, s.BeginCapture(cs, cuda.CaptureModeGlobal))
	err = <-done // device 0 emptied; device 1 then had a capture under way
	require.ErrorIs(t, err, allocator.ErrCaptureUnderway)
	require.Contains(t, err.Error(), "device 1:")
	require.False(t, begun.Before(freed), "BeginAllocateToPool returned while device 0 was still freeing")
	require.Zero(t, s.Violations(), "%v", s.ViolationLog())
	require.Zero(t, s.Live(0))

	// And while the capture runs, no device frees.
	p, err = a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 1})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 4096}))
	require.ErrorIs(t, a.EmptyCache(0), allocator.ErrCaptureUnderway)
	require.NoError(t, s.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(1, allocator.PoolID{A: 1}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, s.Violations(), "%v", s.ViolationLog())
}
