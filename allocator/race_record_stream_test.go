// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
)

// The capture-time record_stream race (gpu/race_record_stream.py is its
// GPU twin). One thread captures a graph in thread-local mode; on
// another thread a block that a side stream still reads (record_stream,
// then a delayed kernel) is freed while that capture runs, and the same
// size is allocated on the freeing stream right after the capture ends.
// PyTorch's allocator defers the block's events during the capture and, at
// its end, frees the block without waiting for the side stream, so the new
// allocation overwrites memory the kernel still reads. cudapool must keep
// the block until the side stream's event completes after the capture.
func TestRecordStreamFreedDuringOtherThreadsCapture(t *testing.T) {
	for _, mode := range []cuda.CaptureMode{cuda.CaptureModeThreadLocal, cuda.CaptureModeRelaxed, cuda.CaptureModeGlobal} {
		t.Run(mode.String(), func(t *testing.T) {
			lockThread(t)
			a, drv := newAlloc(t, 1, GiB, "")
			a.ExpectAnnouncements()
			const size = 4 * MiB
			s, side, cs := cuda.Stream(1), cuda.Stream(2), cuda.Stream(3)
			pool := allocator.PoolID{A: 1}

			// The capturing thread.
			begun, end, ended := make(chan error), make(chan struct{}), make(chan error)
			go func() {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				err := a.BeginAllocateToPool(0, pool, func(x cuda.Stream) bool { return x == cs })
				if err == nil {
					err = drv.BeginCapture(cs, mode)
				}
				if err == nil {
					_, err = a.Malloc(&allocator.MallocRequest{Size: size, Stream: cs}) // the graph allocates too
				}
				begun <- err
				<-end
				err = drv.EndCapture(cs)
				if err == nil {
					err = a.EndAllocateToPool(0, pool)
				}
				ended <- err
			}()

			x := mustMalloc(t, a, 0, size, s)
			require.NoError(t, <-begun)
			require.NoError(t, a.RecordStream(x, side))
			drv.Submit(side) // the delayed reader of x
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x, Size: size}))
			close(end)
			require.NoError(t, <-ended)

			// Right after the capture: x must not come back while side
			// still reads it, however often we ask.
			var held []cuda.Ptr
			for i := 0; i < 3; i++ {
				y := mustMalloc(t, a, 0, size, s)
				require.NotEqual(t, x, y, "a block still read by another stream was reused after the capture ended")
				held = append(held, y)
			}
			for _, y := range held {
				require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y, Size: size}))
			}
			// Once the reader is done, x is reusable.
			drv.Complete(side)
			seen := false
			for i := 0; i < 4; i++ {
				y := mustMalloc(t, a, 0, size, s)
				seen = seen || y == x
				defer func() { require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y, Size: size})) }()
			}
			require.True(t, seen, "x never came back after its reader finished")
			require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
			require.NoError(t, a.CheckInvariants())
		})
	}
}
