package allocator_test

import (
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

func TestMallocAfterFrees(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 1, 4096, 0)
	// The pending frees happen first, so the malloc reuses p's block.
	r, err, ferr := a.MallocAfterFrees(0, 4096, 0, 0, []allocator.PendingFree{{Dev: 0, Ptr: p, Size: 4096}, {Dev: 1, Ptr: q}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	require.Equal(t, p, r)
	require.Zero(t, stats(t, a, 1).Allocation[pools.StatAll].Current, "the other device's free was done too")

	// A bad free is reported separately and does not fail the malloc.
	s, err, ferr := a.MallocAfterFrees(0, 4096, 0, 0, []allocator.PendingFree{{Dev: 1, Ptr: q}})
	require.NoError(t, err)
	require.NotZero(t, s)
	require.ErrorIs(t, ferr, allocator.ErrAlreadyFreed, "q was freed by the first batch: %v", ferr)
	require.NoError(t, a.CheckInvariants())

	// Size 0 and bad devices still behave as Malloc does.
	z, err, ferr := a.MallocAfterFrees(0, 0, 0, 0, []allocator.PendingFree{{Dev: 0, Ptr: r, Size: 4096}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	require.Zero(t, z)
	_, err, _ = a.MallocAfterFrees(7, 10, 0, 0, nil)
	require.ErrorIs(t, err, allocator.ErrInvalidDevice)
	require.ErrorIs(t, a.FreeMany([]allocator.PendingFree{{Dev: 0, Ptr: 0xbad000}}), allocator.ErrUnknownPointer)
}

func TestMallocAfterFreesAllocatesNothing(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	a.ExpectAnnouncements()
	p := mustMalloc(t, a, 0, 4096, 0)
	batch := make([]allocator.PendingFree, 1)
	allocs := testing.AllocsPerRun(1000, func() {
		batch[0] = allocator.PendingFree{Dev: 0, Ptr: p, Size: 4096}
		p, _, _ = a.MallocAfterFrees(0, 4096, 0, 0, batch)
	})
	require.Zero(t, allocs)
}
