// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// The handle names the segment and the offset places the block in it: the
// mapping another process opens, plus the offset, aliases the block.
func TestIpcHandleOfBlockInSharedSegment(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 2, GiB, ordinary)
	for _, tc := range []struct {
		name string
		dev  int
		size uint64
	}{
		{"small pool", 0, 1000},
		{"large pool", 1, 3 * MiB}, // blocks of one 20 MiB segment
	} {
		t.Run(tc.name, func(t *testing.T) {
			p1 := mustMalloc(t, a, tc.dev, tc.size, 0)
			p2 := mustMalloc(t, a, tc.dev, tc.size, 0)
			p3 := mustMalloc(t, a, tc.dev, tc.size, 0)
			base, _, err := a.BaseAllocation(p1)
			require.NoError(t, err)
			for _, p := range []cuda.Ptr{p2, p3} {
				b, _, err := a.BaseAllocation(p)
				require.NoError(t, err)
				require.Equal(t, base, b, "the blocks share one segment")
			}

			h, off, dev, err := a.IpcHandle(p3)
			require.NoError(t, err)
			require.Equal(t, tc.dev, dev)
			require.Equal(t, uint64(p3-base), off)
			require.NotZero(t, off)
			want, err := drv.IpcGetMemHandle(tc.dev, base)
			require.NoError(t, err)
			require.Equal(t, want, h, "the segment's handle")
			h1, off1, _, err := a.IpcHandle(p1)
			require.NoError(t, err)
			require.Equal(t, h, h1, "one handle per segment")
			require.Equal(t, uint64(p1-base), off1)

			// The receiving side, here on the other device.
			other := 1 - tc.dev
			q, err := a.IpcOpen(other, h)
			require.NoError(t, err)
			srcDev, src, ok := drv.IpcSource(other, q+cuda.Ptr(off))
			require.True(t, ok)
			require.Equal(t, tc.dev, srcDev)
			require.Equal(t, p3, src, "mapping + offset is the block")
			require.True(t, drv.Accessible(other, q+cuda.Ptr(off), tc.size))
			require.NoError(t, a.IpcClose(q))

			for _, p := range []cuda.Ptr{p1, p2, p3} {
				require.NoError(t, a.Free(allocator.FreeRequest{Dev: tc.dev, Ptr: p}))
			}
		})
	}
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.CheckInvariants())
}

// The 64-byte handle (cudaIpcMemHandle_t) cannot name memory in an
// expandable segment: the error says so and names the entry point whose
// handle can (ShareIpcHandle, share_test.go).
func TestIpcHandleRefusesExpandableSegments(t *testing.T) {
	lockThread(t)
	a, _ := newAlloc(t, 1, GiB, expandable)
	p := mustMalloc(t, a, 0, 3*MiB, 0)
	_, _, _, err := a.IpcHandle(p)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.Contains(t, err.Error(), "is in an expandable segment (expandable_segments:True, on by default with stitching), whose pages are CUDA virtual memory with no 64-byte cudaIpcMemHandle")
	require.Contains(t, err.Error(), "share it with cudapool_ipc_share")
	var ae *allocator.Error
	require.ErrorAs(t, err, &ae)
	require.Equal(t, "ipc_handle", ae.Op)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
}

// One handle opened twice maps once; each open needs a close, the last one
// unmaps, and a further close is an error.
func TestIpcOpenIsReferenceCounted(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, ordinary)
	p := mustMalloc(t, a, 0, 5*MiB, 0)
	h, _, _, err := a.IpcHandle(p)
	require.NoError(t, err)

	q, err := a.IpcOpen(0, h)
	require.NoError(t, err)
	q2, err := a.IpcOpen(0, h)
	require.NoError(t, err)
	require.Equal(t, q, q2)
	n, refs := drv.IpcMappings(0)
	require.Equal(t, [2]int{1, 1}, [2]int{n, refs}, "one mapping, opened once in the driver")

	err = a.IpcClose(q + 512)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer, "not the mapping's address")
	require.NoError(t, a.IpcClose(q))
	n, _ = drv.IpcMappings(0)
	require.Equal(t, 1, n, "still mapped for the second user")
	require.NoError(t, a.IpcClose(q))
	n, _ = drv.IpcMappings(0)
	require.Zero(t, n, "unmapped by the last close")
	err = a.IpcClose(q)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
	require.Contains(t, err.Error(), "not a CUDA IPC mapping opened with IpcOpen")

	// Open again after the last close: a new mapping.
	q3, err := a.IpcOpen(0, h)
	require.NoError(t, err)
	require.NoError(t, a.IpcClose(q3))

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// twoHandles makes handles whose last byte differs name the same memory, as
// a driver might if it gave one allocation differing handles.
type twoHandles struct{ *sim.Driver }

func (d twoHandles) IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error) {
	h[63] = 0
	return d.Driver.IpcOpenMemHandle(dev, h)
}

// Two handles of one allocation share a mapping, which the driver counts
// once.
func TestIpcOpenTwoHandlesOfOneAllocation(t *testing.T) {
	drv := twoHandles{sim.New(sim.Options{Memory: GiB})}
	a, err := allocator.New(drv, ipcTestConfig(t))
	require.NoError(t, err)
	p := mustMalloc(t, a, 0, 5*MiB, 0)
	h, _, _, err := a.IpcHandle(p)
	require.NoError(t, err)
	h2 := h
	h2[63] = 1
	q, err := a.IpcOpen(0, h)
	require.NoError(t, err)
	q2, err := a.IpcOpen(0, h2)
	require.NoError(t, err)
	require.Equal(t, q, q2)
	n, refs := drv.IpcMappings(0)
	require.Equal(t, [2]int{1, 1}, [2]int{n, refs})
	q3, err := a.IpcOpen(0, h2)
	require.NoError(t, err)
	require.Equal(t, q, q3)
	for i := 0; i < 3; i++ {
		require.NoError(t, a.IpcClose(q))
	}
	n, _ = drv.IpcMappings(0)
	require.Zero(t, n)
	require.ErrorIs(t, a.IpcClose(q), allocator.ErrUnknownPointer)
}

func TestIpcUnknownPointers(t *testing.T) {
	a, drv := newAlloc(t, 2, GiB, ordinary)
	p := mustMalloc(t, a, 0, 4*KiB, 0)
	q := mustMalloc(t, a, 0, 4*KiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))

	_, _, _, err := a.IpcHandle(0x1234)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
	require.Contains(t, err.Error(), "not allocated by cudapool")
	_, _, _, err = a.IpcHandle(q)
	require.ErrorIs(t, err, allocator.ErrAlreadyFreed)
	_, _, _, err = a.IpcHandle(p + 16)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
	require.Contains(t, err.Error(), "inside the block")

	// A mapping is not an allocation, and an allocation is not a mapping.
	h, _, _, err := a.IpcHandle(p)
	require.NoError(t, err)
	m, err := a.IpcOpen(1, h)
	require.NoError(t, err)
	_, _, _, err = a.IpcHandle(m)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
	err = a.IpcClose(p)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
	require.Contains(t, err.Error(), "cudapool's own allocation")
	require.NoError(t, a.IpcClose(m))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.Zero(t, drv.Violations())
}

func TestIpcOpenBadHandles(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, ordinary)
	p := mustMalloc(t, a, 0, 30*MiB, 0)
	h, _, _, err := a.IpcHandle(p)
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.EmptyCache(0)) // the segment goes back to the driver

	for name, x := range map[string]cuda.IpcHandle{"stale": h, "zero": {}} {
		_, err := a.IpcOpen(0, x)
		require.ErrorIs(t, err, allocator.ErrInvalidArgument, name)
		require.ErrorIs(t, err, cuda.ErrInvalidValue, name)
		require.Contains(t, err.Error(), "names no memory the driver can map", name)
	}
	_, err = a.IpcOpen(1, h)
	require.ErrorIs(t, err, allocator.ErrInvalidDevice)
	_, err = a.IpcOpen(-1, h)
	require.ErrorIs(t, err, allocator.ErrInvalidDevice)
}

// noIPC hides the simulator's IPC (and VMM) methods.
type noIPC struct{ allocator.Driver }

func TestIpcWithoutDriverSupport(t *testing.T) {
	a, err := allocator.New(noIPC{sim.New(sim.Options{Memory: GiB})}, ipcTestConfig(t))
	require.NoError(t, err)
	p := mustMalloc(t, a, 0, MiB, 0)
	_, _, _, err = a.IpcHandle(p)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.Contains(t, err.Error(), "no CUDA IPC")
	_, err = a.IpcOpen(0, cuda.IpcHandle{})
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.ErrorIs(t, a.IpcClose(0x1000), allocator.ErrNotSupported)

	_, _, _, err = a.IpcHandle(0x1234)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer, "a bad pointer is named first")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
}

// failingIPC's driver reports errors the allocator passes on.
type failingIPC struct {
	*sim.Driver
	get, open, close error
}

func (f *failingIPC) IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error) {
	if f.get != nil {
		return cuda.IpcHandle{}, f.get
	}
	return f.Driver.IpcGetMemHandle(dev, p)
}

func (f *failingIPC) IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error) {
	if f.open != nil {
		return 0, f.open
	}
	return f.Driver.IpcOpenMemHandle(dev, h)
}

func (f *failingIPC) IpcCloseMemHandle(dev int, p cuda.Ptr) error {
	if f.close != nil {
		return f.close
	}
	return f.Driver.IpcCloseMemHandle(dev, p)
}

func TestIpcDriverErrors(t *testing.T) {
	drv := &failingIPC{Driver: sim.New(sim.Options{Memory: GiB})}
	a, err := allocator.New(drv, ipcTestConfig(t))
	require.NoError(t, err)
	p := mustMalloc(t, a, 0, MiB, 0)

	drv.get = cuda.ErrNotSupported
	_, _, _, err = a.IpcHandle(p)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	drv.get = cuda.ErrUnknown
	_, _, _, err = a.IpcHandle(p)
	require.ErrorIs(t, err, allocator.ErrDriver)
	require.ErrorIs(t, err, cuda.ErrUnknown)
	require.Contains(t, err.Error(), "cuIpcGetMemHandle of the segment at")
	drv.get = nil
	h, _, _, err := a.IpcHandle(p)
	require.NoError(t, err)

	drv.open = cuda.ErrInvalidContext // what the driver says to the exporting process
	_, err = a.IpcOpen(0, h)
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.Contains(t, err.Error(), "this process made it")
	drv.open = cuda.ErrOutOfMemory
	_, err = a.IpcOpen(0, h)
	require.ErrorIs(t, err, allocator.ErrDriver)
	drv.open = nil

	q, err := a.IpcOpen(0, h)
	require.NoError(t, err)
	drv.close = cuda.ErrUnknown
	err = a.IpcClose(q)
	require.ErrorIs(t, err, allocator.ErrDriver)
	drv.close = nil
	require.ErrorIs(t, a.IpcClose(q), allocator.ErrUnknownPointer, "a failed close still forgets the mapping")
	require.NoError(t, drv.Driver.IpcCloseMemHandle(0, q))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
}

// Sharing works during a graph capture: the block is in the graph's private
// pool, and no IPC call breaks a capture rule.
func TestIpcDuringCapture(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	const s = cuda.Stream(0x51)
	pool := allocator.PoolID{A: 1}
	require.NoError(t, a.BeginAllocateToPool(0, pool, nil))
	require.NoError(t, drv.BeginCapture(s, cuda.CaptureModeGlobal))
	p := mustMalloc(t, a, 0, 3*MiB, s)
	h, off, _, err := a.IpcHandle(p)
	require.NoError(t, err)
	require.Zero(t, off)
	q, err := a.IpcOpen(0, h)
	require.NoError(t, err)
	require.NoError(t, a.IpcClose(q))
	require.NoError(t, drv.EndCapture(s))
	require.NoError(t, a.EndAllocateToPool(0, pool))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.ReleasePool(0, pool))
}

// Concurrent opens and closes of one handle keep one mapping and close it
// exactly once.
func TestIpcConcurrentOpenClose(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, ordinary)
	ps := []cuda.Ptr{mustMalloc(t, a, 0, 30*MiB, 0), mustMalloc(t, a, 0, 30*MiB, 0)}
	var hs []cuda.IpcHandle
	for _, p := range ps {
		h, _, _, err := a.IpcHandle(p)
		require.NoError(t, err)
		hs = append(hs, h)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			h := hs[w%2]
			for i := 0; i < 200; i++ {
				q, err := a.IpcOpen(0, h)
				if err == nil {
					_, _, ok := drv.IpcSource(0, q)
					if !ok {
						err = errors.New("opened mapping not mapped")
					}
				}
				if err == nil {
					err = a.IpcClose(q)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	n, refs := drv.IpcMappings(0)
	require.Equal(t, [2]int{0, 0}, [2]int{n, refs})
	for _, p := range ps {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
}

// ipcTestConfig is ordinary segments: the tests of cuIpcGetMemHandle's
// handles share cuMemAlloc'd segments.
func ipcTestConfig(t testing.TB) allocator.Config {
	t.Helper()
	cfg, _, err := allocator.ParseConfig(ordinary)
	require.NoError(t, err)
	return cfg
}
