// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/pools"
)

// Caching off (torch.cuda.caching_allocator_enable(False)): each malloc is a
// driver allocation, each free gives it back at once, nothing is counted;
// frees of such memory work after caching is back on, and cached memory
// allocated before is freed as usual.
func TestCachingOff(t *testing.T) {
	a, drv := newAlloc(t, 2, GiB, "")
	cached := mustMalloc(t, a, 0, 4096, 0)
	allocs := drv.Allocs(0)
	a.SetCaching(false)
	require.False(t, a.Caching())
	p := mustMalloc(t, a, 0, 1<<20, 0)
	q := mustMalloc(t, a, 1, 4096, 0)
	require.Equal(t, allocs+1, drv.Allocs(0), "one driver allocation for p")
	st := stats(t, a, 0)
	require.Equal(t, int64(1), st.Allocation[pools.StatAll].Current, "only the cached block is counted")
	require.NoError(t, a.RecordStream(p, 5), "record_stream on uncached memory is ignored")
	frees := drv.Frees(0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.Equal(t, frees+1, drv.Frees(0), "given back at once")
	require.ErrorIs(t, a.Free(allocator.FreeRequest{Ptr: p}), allocator.ErrUnknownPointer, "freed once only")
	a.SetCaching(true)
	require.NoError(t, a.Free(allocator.FreeRequest{Dev: -1, Ptr: q}), "found on its device after caching is back on")
	_, _, ferr := mallocAfterFrees(a, 0, 4096, 0, 0, []allocator.FreeRequest{{Dev: -1, Ptr: cached}})
	require.NoError(t, ferr)
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations())
}

// Two threads freeing the same uncached pointer at once: one frees it, the
// other gets ErrUnknownPointer, and the driver sees one free per allocation
// (before the fix both reached the driver).
func TestCachingOffConcurrentDoubleFree(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	a.SetCaching(false)
	const rounds = 2000
	frees := drv.Frees(0)
	for i := 0; i < rounds; i++ {
		p := mustMalloc(t, a, 0, 4096, 0)
		errs := make(chan error, 2)
		start := make(chan struct{})
		for k := 0; k < 2; k++ {
			go func() { <-start; errs <- a.Free(allocator.FreeRequest{Ptr: p}) }()
		}
		close(start)
		e1, e2 := <-errs, <-errs
		if e1 != nil {
			e1, e2 = e2, e1
		}
		require.NoError(t, e1, "round %d: one of the frees succeeds", i)
		require.ErrorIs(t, e2, allocator.ErrUnknownPointer, "round %d: the other reports the pointer", i)
	}
	require.Equal(t, frees+rounds, drv.Frees(0), "one driver free per allocation")
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations())
}
