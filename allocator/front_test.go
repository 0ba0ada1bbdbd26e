package allocator_test

import (
	"sync/atomic"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/stretchr/testify/require"
)

// fakeFront is a Go stand-in for capi's C front: a log the test fills.
type fakeFront struct{ log []allocator.PendingFree }

func (f *fakeFront) Pending(dev int) bool { return len(f.log) != 0 }
func (f *fakeFront) Take(dev int, buf []allocator.PendingFree) []allocator.PendingFree {
	buf = append(buf, f.log...)
	f.log = f.log[:0]
	return buf
}
func (f *fakeFront) SetEnabled(on bool) {}
func (f *fakeFront) Capacity() int      { return 64 }

// flagFront is fakeFront with the word its Pending reads, offered as an
// allocator.FrontFlags (as capi's C front does).
type flagFront struct {
	fakeFront
	n int32 // non-zero while the log holds operations
}

func (f *flagFront) Pending(dev int) bool       { return atomic.LoadInt32(&f.n) != 0 }
func (f *flagFront) PendingFlag(dev int) *int32 { return &f.n }
func (f *flagFront) Take(dev int, buf []allocator.PendingFree) []allocator.PendingFree {
	buf = f.fakeFront.Take(dev, buf)
	atomic.StoreInt32(&f.n, 0)
	return buf
}

// With a FrontFlags the device lock reads its word: a log is replayed once
// the word says it holds operations.
func TestFrontFlagsReplay(t *testing.T) {
	a, _ := newAlloc(t, 1, 8*GiB, "")
	f := &flagFront{}
	a.SetFront(f)
	a.ExpectAnnouncements()
	p, track, err, _ := a.MallocTracked(0, 4096, 0, 0, nil)
	require.NoError(t, err)
	require.True(t, track)
	f.log = append(f.log, allocator.PendingFree{Ptr: p, Op: allocator.OpFree})
	st, _ := a.Stats(0)
	require.EqualValues(t, 1, st.Allocation[0].Current, "the word is 0: nothing to replay")
	atomic.StoreInt32(&f.n, 1)
	st, _ = a.Stats(0)
	require.EqualValues(t, 0, st.Allocation[0].Current, "the word is set: the free is replayed")
	require.Empty(t, f.log)
}

// Replaying a log in the hot path allocates nothing.
func TestFrontReplayAllocatesNothing(t *testing.T) {
	lockThread(t)
	a, _ := newAlloc(t, 1, 8*GiB, "")
	f := &fakeFront{log: make([]allocator.PendingFree, 0, 64)}
	a.SetFront(f)
	a.ExpectAnnouncements()
	require.True(t, a.FrontEnabled())
	p, track, err, _ := a.MallocTracked(0, 4096, 0, 0, nil)
	require.NoError(t, err)
	require.True(t, track)
	allocs := testing.AllocsPerRun(1000, func() {
		f.log = append(f.log,
			allocator.PendingFree{Ptr: p, Op: allocator.OpFreeStats},
			allocator.PendingFree{Ptr: p, Op: allocator.OpReuse},
			allocator.PendingFree{Ptr: p, Op: allocator.OpCycles, Count: 3})
		q, _, _, _ := a.MallocTracked(0, 8192, 0, 0, nil)
		_ = a.Free(0, q, 0)
	})
	require.Zero(t, allocs)
	st, _ := a.Stats(0)
	require.EqualValues(t, 1, st.Allocation[0].Current)
}

// A default-pool request that borrows a use_on_oom pool's block is not
// trackable: the front would hold and re-serve a private-pool block.
func TestFrontTracksBorrowedBlock(t *testing.T) {
	lockThread(t)
	a, _ := newAlloc(t, 1, 100*MiB, "")
	f := &fakeFront{}
	a.SetFront(f)
	a.ExpectAnnouncements()
	pool := allocator.PoolID{B: 4}
	cached := oomPoolBlock(t, a, pool)
	require.True(t, a.FrontEnabled())
	require.NoError(t, a.Free(0, cached, 0))
	p, track, err, _ := a.MallocTracked(0, 60*MiB, 5, 0, nil)
	require.NoError(t, err)
	require.Equal(t, cached, p)
	require.True(t, inPool(t, a, pool, p), "a private pool's block")
	require.False(t, track, "the front must not track a private pool's block")
}
