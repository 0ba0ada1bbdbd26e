package allocator_test

import (
	"sync/atomic"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// fakeFront is a Go stand-in for capi's C front: a log the test fills.
type fakeFront struct{ log []allocator.PendingFree }

func (f *fakeFront) Pending(dev int) bool { return len(f.log) != 0 }
func (f *fakeFront) Holding(dev int) bool { return false }
func (f *fakeFront) Take(dev int, buf []allocator.PendingFree, keep bool) []allocator.PendingFree {
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
	n    int32 // non-zero while the log holds operations
	held int32 // never set: no block is held
}

func (f *flagFront) Pending(dev int) bool       { return atomic.LoadInt32(&f.n) != 0 }
func (f *flagFront) PendingFlag(dev int) *int32 { return &f.n }
func (f *flagFront) HeldFlag(dev int) *int32    { return &f.held }
func (f *flagFront) Take(dev int, buf []allocator.PendingFree, keep bool) []allocator.PendingFree {
	buf = f.fakeFront.Take(dev, buf, keep)
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
	p, track, err, _ := mallocTracked(a, 0, 4096, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.TagDefault, track)
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
	f := &fakeFront{log: make([]allocator.PendingFree, 0, 64)}
	a := frontAlloc(t, 8*GiB, f)
	require.True(t, a.FrontEnabled())
	p, track, err, _ := mallocTracked(a, 0, 4096, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.TagDefault, track)
	allocs := testing.AllocsPerRun(1000, func() {
		f.log = append(f.log,
			allocator.PendingFree{Ptr: p, Op: allocator.OpFreeStats},
			allocator.PendingFree{Ptr: p, Op: allocator.OpReuse},
			allocator.PendingFree{Ptr: p, Op: allocator.OpCycles, Count: 3})
		q, _, _, _ := mallocTracked(a, 0, 8192, 0, 0, nil)
		_ = a.Free(allocator.FreeRequest{Ptr: q})
	})
	require.Zero(t, allocs)
	st, _ := a.Stats(0)
	require.EqualValues(t, 1, st.Allocation[0].Current)
}

// frontAlloc is a one-device allocator of mem bytes with front f, captures
// announced, its test pinned to one thread (as the C front's callers are).
func frontAlloc(t *testing.T, mem uint64, f allocator.Front) *allocator.Allocator {
	lockThread(t)
	a, _ := newAlloc(t, 1, mem, "")
	a.SetFront(f)
	a.ExpectAnnouncements()
	return a
}

// A default-pool request that borrows a use_on_oom pool's block is not
// trackable: the front would hold and re-serve a private-pool block.
func TestFrontTracksBorrowedBlock(t *testing.T) {
	f := &fakeFront{}
	a := frontAlloc(t, 100*MiB, f)
	pool := allocator.PoolID{B: 4}
	cached := oomPoolBlock(t, a, pool)
	require.True(t, a.FrontEnabled())
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: cached}))
	p, track, err, _ := mallocTracked(a, 0, 60*MiB, 5, 0, nil)
	require.NoError(t, err)
	require.Equal(t, cached, p)
	require.True(t, inPool(t, a, pool, p), "a private pool's block")
	require.Equal(t, allocator.TagNone, track, "the front must not track a private pool's block")
}

// routerFront is fakeFront as an allocator.FrontRouter: it keeps the routes
// it is given.
type routerFront struct {
	fakeFront
	routes [][]allocator.FrontRoute // per call of SetRoutes
	on     bool
	refuse bool // SetRoutes reports that it cannot route
}

func (f *routerFront) SetEnabled(on bool) { f.on = on }
func (f *routerFront) SetRoutes(dev int, routes []allocator.FrontRoute) bool {
	f.routes = append(f.routes, append([]allocator.FrontRoute(nil), routes...))
	return !f.refuse
}
func (f *routerFront) last() []allocator.FrontRoute { return f.routes[len(f.routes)-1] }

// During an allocate-to-pool phase whose filter the front can call, the
// front keeps serving: it is given the phase, and a block is tracked with
// the tag of the pool its malloc routed to.
func TestFrontRoutesPhases(t *testing.T) {
	f := &routerFront{}
	a := frontAlloc(t, 8*GiB, f)
	require.True(t, f.on)

	pool := allocator.PoolID{A: 3}
	ref := allocator.FilterRef{Kind: 2, A: 0x1234, B: 0x5678}
	require.NoError(t, a.BeginAllocateToPoolRef(0, pool, func(s cuda.Stream) bool { return s == 7 }, ref))
	require.True(t, a.FrontEnabled(), "the front routes the phase")
	require.True(t, f.on)
	require.Len(t, f.last(), 1)
	route := f.last()[0]
	require.Equal(t, ref, route.Filter)
	require.GreaterOrEqual(t, route.Tag, uint32(2), "a private pool's tag")

	p, track, err, _ := mallocTracked(a, 0, 4096, 7, 0, nil)
	require.NoError(t, err)
	require.True(t, inPool(t, a, pool, p))
	require.Equal(t, route.Tag, track, "tracked with its pool's tag")
	q, track, err, _ := mallocTracked(a, 0, 4096, 8, 0, nil)
	require.NoError(t, err)
	require.False(t, inPool(t, a, pool, q))
	require.Equal(t, allocator.TagDefault, track, "the filter refuses stream 8: the default pools")

	// A second phase, with a nil filter: oldest first, kind FilterAll.
	pool2 := allocator.PoolID{A: 4}
	require.NoError(t, a.BeginAllocateToPoolRef(0, pool2, nil, allocator.FilterRef{}))
	require.Len(t, f.last(), 2)
	require.Equal(t, route, f.last()[0])
	require.Equal(t, allocator.FilterAll, f.last()[1].Filter.Kind)
	require.NotEqual(t, route.Tag, f.last()[1].Tag)
	r, track, err, _ := mallocTracked(a, 0, 4096, 7, 0, nil)
	require.NoError(t, err)
	require.True(t, inPool(t, a, pool2, r), "the newest phase wins")
	require.Equal(t, f.last()[1].Tag, track)

	second := f.last()[1]
	require.NoError(t, a.EndAllocateToPool(0, pool))
	require.Equal(t, []allocator.FrontRoute{second}, f.last())
	require.NoError(t, a.EndAllocateToPool(0, pool2))
	require.Empty(t, f.last())
	require.True(t, a.FrontEnabled())
	for _, x := range []cuda.Ptr{p, q, r} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
}

// A private pool's blocks are tracked with its pool's tag; with expandable
// segments the tag carries TagHoldSmall, so that the front holds only small
// ones across takes (see privateTag). The default pools' are tracked either way.
func TestFrontTagsExpandablePrivatePools(t *testing.T) {
	for _, conf := range []string{"", "expandable_segments:True"} {
		t.Run(conf, func(t *testing.T) {
			lockThread(t)
			f := &routerFront{}
			a, _ := newAlloc(t, 1, 8*GiB, conf)
			a.SetFront(f)
			a.ExpectAnnouncements()
			pool := allocator.PoolID{A: 3}
			require.NoError(t, a.BeginAllocateToPoolRef(0, pool, func(s cuda.Stream) bool { return s == 7 },
				allocator.FilterRef{Kind: 2, A: 0x1234, B: 0x5678}))
			require.Len(t, f.last(), 1)
			var ps, inpool []cuda.Ptr
			for _, size := range []uint64{4096, 3 * MiB} { // the small and the large pool
				p, track, err, _ := mallocTracked(a, 0, size, 7, 0, nil)
				require.NoError(t, err)
				inpool = append(inpool, p)
				require.True(t, inPool(t, a, pool, inpool...))
				if conf == "" {
					require.Equal(t, f.last()[0].Tag, track, "tracked with its pool's tag")
				} else {
					require.Equal(t, f.last()[0].Tag|allocator.TagHoldSmall, track,
						"an expandable private pool's block is tracked with its pool's tag, held only if small")
				}
				q, track, err, _ := mallocTracked(a, 0, size, 8, 0, nil)
				require.NoError(t, err)
				require.Equal(t, allocator.TagDefault, track, "the default pools' blocks are tracked")
				ps = append(ps, p, q)
			}
			require.NoError(t, a.EndAllocateToPool(0, pool))
			for _, x := range ps {
				require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
			}
		})
	}
}

// The front stops serving while a phase it cannot route is under way: a
// filter only Go can call, a front that refuses the routes, or a front that
// is no FrontRouter.
func TestFrontBlockedByPhases(t *testing.T) {
	lockThread(t)
	filter := func(s cuda.Stream) bool { return true }
	cases := []struct {
		name  string
		front allocator.Front
		begin func(a *allocator.Allocator, id allocator.PoolID) error
	}{
		{"opaque filter", &routerFront{}, func(a *allocator.Allocator, id allocator.PoolID) error {
			return a.BeginAllocateToPool(0, id, filter)
		}},
		{"refused routes", &routerFront{refuse: true}, func(a *allocator.Allocator, id allocator.PoolID) error {
			return a.BeginAllocateToPoolRef(0, id, filter, allocator.FilterRef{Kind: 2})
		}},
		{"no router", &fakeFront{}, func(a *allocator.Allocator, id allocator.PoolID) error {
			return a.BeginAllocateToPoolRef(0, id, nil, allocator.FilterRef{})
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a, _ := newAlloc(t, 1, 8*GiB, "")
			a.SetFront(c.front)
			a.ExpectAnnouncements()
			require.True(t, a.FrontEnabled())
			id := allocator.PoolID{A: 9}
			require.NoError(t, c.begin(a, id))
			require.False(t, a.FrontEnabled(), "a phase the front cannot route")
			p, track, err, _ := mallocTracked(a, 0, 4096, 1, 0, nil)
			require.NoError(t, err)
			require.Equal(t, allocator.TagNone, track)
			require.NoError(t, a.EndAllocateToPool(0, id))
			require.True(t, a.FrontEnabled(), "serves again after the phase")
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		})
	}
}

// holdFront is a Go front that holds blocks across takes as capi's does:
// the test logs a free as statistics only and marks the block held; a take
// without keep releases it.
type holdFront struct {
	log  []allocator.PendingFree
	held []cuda.Ptr
	keep []bool // what each Take was asked
}

func (f *holdFront) Pending(dev int) bool { return len(f.log) != 0 }
func (f *holdFront) Holding(dev int) bool { return len(f.held) != 0 }
func (f *holdFront) Take(dev int, buf []allocator.PendingFree, keep bool) []allocator.PendingFree {
	f.keep = append(f.keep, keep)
	buf = append(buf, f.log...)
	f.log = f.log[:0]
	if !keep {
		for _, p := range f.held {
			buf = append(buf, allocator.PendingFree{Ptr: p, Op: allocator.OpRelease})
		}
		f.held = f.held[:0]
	}
	return buf
}
func (f *holdFront) SetEnabled(on bool) {}
func (f *holdFront) Capacity() int      { return 128 }

// A held block: its free is counted at once, the block stays allocated
// while mallocs run, a malloc that finds no other block releases it rather
// than grow, and every other operation releases it first.
func TestFrontHeldBlocks(t *testing.T) {
	f := &holdFront{}
	a := frontAlloc(t, 8*GiB, f)

	p, track, err, _ := mallocTracked(a, 0, 60*MiB, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.TagDefault, track)
	f.log = append(f.log, allocator.PendingFree{Ptr: p, Op: allocator.OpHold})
	f.held = append(f.held, p)

	// A malloc keeps it held (its take has keep), then, finding no free
	// block, releases it and splits it instead of growing.
	q, _, err, _ := mallocTracked(a, 0, 50*MiB, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, []bool{true, false}, f.keep, "the malloc's take keeps, the release before growing does not")
	require.Equal(t, p, q, "the held block's memory, split")
	st, err := a.Stats(0)
	require.NoError(t, err)
	require.EqualValues(t, 1, st.NumDeviceAlloc, "no second segment")
	require.Equal(t, pools.Stat{Current: 1, Peak: 1, Allocated: 2, Freed: 1}, st.Allocation[0],
		"the held block's free counted once")
	require.EqualValues(t, 50*MiB, st.AllocatedBytes[0].Current)

	// Held again; a statistics read (any operation but a malloc) releases it.
	f.log = append(f.log, allocator.PendingFree{Ptr: q, Op: allocator.OpHold})
	f.held = append(f.held, q)
	st, err = a.Stats(0)
	require.NoError(t, err)
	require.Empty(t, f.held)
	require.Equal(t, pools.Stat{Current: 0, Peak: 1, Allocated: 2, Freed: 2}, st.Allocation[0])
	require.Zero(t, st.Active[0].Current)
	require.Zero(t, st.InactiveSplit[0].Current, "released and merged: no split block left")
	require.Error(t, a.Free(allocator.FreeRequest{Ptr: q}), "the block is free: a second free is an error")
}
