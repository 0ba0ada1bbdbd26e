// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

func TestMallocRequestFrees(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 1, 4096, 0)
	// The pending frees happen first, so the malloc reuses p's block.
	r, err, ferr := mallocAfterFrees(a, 0, 4096, 0, 0, []allocator.FreeRequest{{Ptr: p, Size: 4096}, {Dev: 1, Ptr: q}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	require.Equal(t, p, r)
	require.Zero(t, stats(t, a, 1).Allocation[pools.StatAll].Current, "the other device's free was done too")

	// A bad free is reported separately and does not fail the malloc.
	s, err, ferr := mallocAfterFrees(a, 0, 4096, 0, 0, []allocator.FreeRequest{{Dev: 1, Ptr: q}})
	require.NoError(t, err)
	require.NotZero(t, s)
	require.ErrorIs(t, ferr, allocator.ErrAlreadyFreed, "q was freed by the first batch: %v", ferr)
	require.NoError(t, a.CheckInvariants())

	// Size 0 and bad devices still behave as Malloc does.
	z, err, ferr := mallocAfterFrees(a, 0, 0, 0, 0, []allocator.FreeRequest{{Ptr: r, Size: 4096}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	require.Zero(t, z)
	_, err, _ = mallocAfterFrees(a, 7, 10, 0, 0, nil)
	require.ErrorIs(t, err, allocator.ErrInvalidDevice)
	require.ErrorIs(t, a.Free(allocator.FreeRequest{Ptr: 0xbad000}), allocator.ErrUnknownPointer)
}

func TestMallocRequestFreesAllocatesNothing(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	a.ExpectAnnouncements()
	p := mustMalloc(t, a, 0, 4096, 0)
	batch := make([]allocator.FreeRequest, 1)
	allocs := testing.AllocsPerRun(1000, func() {
		batch[0] = allocator.FreeRequest{Ptr: p, Size: 4096}
		p, _, _ = mallocAfterFrees(a, 0, 4096, 0, 0, batch)
	})
	require.Zero(t, allocs)
}

// Frees of unknown device (Dev -1): found on the malloc's device first,
// else on whichever device holds them.
func TestFreesOfUnknownDevice(t *testing.T) {
	a, _ := newAlloc(t, 3, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 2, 4096, 0)
	r, err, ferr := mallocAfterFrees(a, 0, 4096, 0, 0, []allocator.FreeRequest{{Dev: -1, Ptr: p, Size: 4096}, {Dev: -1, Ptr: q}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	require.Equal(t, p, r, "p was freed before the malloc, under its lock")
	require.Zero(t, stats(t, a, 2).Allocation[pools.StatAll].Current, "q found on device 2")

	_, _, ferr = mallocAfterFrees(a, 1, 4096, 0, 0, []allocator.FreeRequest{{Dev: -1, Ptr: q}})
	require.ErrorIs(t, ferr, allocator.ErrAlreadyFreed, "%v", ferr)
	_, _, ferr = mallocAfterFrees(a, 1, 4096, 0, 0, []allocator.FreeRequest{{Dev: -1, Ptr: r, Size: 99}})
	require.ErrorIs(t, ferr, allocator.ErrInvalidArgument, "size mismatch: %v", ferr)
	require.Equal(t, int64(1), stats(t, a, 0).Allocation[pools.StatAll].Current, "r not freed")

	require.ErrorIs(t, a.Free(allocator.FreeRequest{Dev: -1, Ptr: 0xbad000}), allocator.ErrUnknownPointer)
	require.NoError(t, a.Free(allocator.FreeRequest{Dev: -1, Ptr: r, Size: 4096}))
	require.ErrorIs(t, a.Free(allocator.FreeRequest{Dev: -2, Ptr: r}), allocator.ErrInvalidDevice, "only -1 means unknown")
	require.NoError(t, a.CheckInvariants())
}

func TestFreeUnknownDevice(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	p := mustMalloc(t, a, 1, 30*MiB, 0)
	for _, tc := range []struct {
		name string
		p    cuda.Ptr
		size uint64
		kind error
	}{
		{"unknown", 0xbad000, 0, allocator.ErrUnknownPointer},
		{"interior", p + 512, 0, allocator.ErrUnknownPointer},
		{"size mismatch", p, 1, allocator.ErrInvalidArgument},
	} {
		err := a.Free(allocator.FreeRequest{Dev: -1, Ptr: tc.p, Size: tc.size})
		require.ErrorIs(t, err, tc.kind, tc.name)
		var e *allocator.Error
		require.ErrorAs(t, err, &e, tc.name)
	}
	require.Equal(t, int64(1), stats(t, a, 1).Allocation[pools.StatAll].Current, "bad input freed nothing")
	require.NoError(t, a.Free(allocator.FreeRequest{Dev: -1, Ptr: p, Size: 30 * MiB}))
	require.Zero(t, stats(t, a, 1).Allocation[pools.StatAll].Current)
	require.ErrorIs(t, a.Free(allocator.FreeRequest{Dev: -1, Ptr: p}), allocator.ErrAlreadyFreed)
}

func TestFreesOfUnknownDeviceAllocateNothing(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	a.ExpectAnnouncements()
	p := mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 1, 4096, 0)
	batch := make([]allocator.FreeRequest, 2)
	allocs := testing.AllocsPerRun(1000, func() {
		batch[0] = allocator.FreeRequest{Dev: -1, Ptr: p, Size: 4096} // on the malloc's device
		batch[1] = allocator.FreeRequest{Dev: -1, Ptr: q, Size: 4096} // on the other
		p, _, _ = mallocAfterFrees(a, 0, 4096, 0, 0, batch)
		q, _ = a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 4096})
	})
	require.Zero(t, allocs, "a malloc request with frees of unknown device")
	allocs = testing.AllocsPerRun(1000, func() {
		_ = a.Free(allocator.FreeRequest{Dev: -1, Ptr: q, Size: 4096})
		q, _ = a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 4096})
	})
	require.Zero(t, allocs, "a free of unknown device")
	require.NoError(t, a.CheckInvariants())
}
