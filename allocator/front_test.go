// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"sync/atomic"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// fakeFront is a Go stand-in for capi's C front: a log the test fills; it
// keeps the policies it is given and the pointers Go invalidates.
type fakeFront struct {
	log      []allocator.PendingFree
	policies []allocator.FrontPolicy
	invalid  []cuda.Ptr
}

func (f *fakeFront) Pending(dev int) bool { return len(f.log) != 0 }
func (f *fakeFront) Holding(dev int) bool { return false }
func (f *fakeFront) Take(dev int, buf []allocator.PendingFree, keep bool) []allocator.PendingFree {
	buf = append(buf, f.log...)
	f.log = f.log[:0]
	return buf
}
func (f *fakeFront) SetPolicy(p *allocator.FrontPolicy) {
	c := *p
	c.Phases = append([]uint32(nil), p.Phases...)
	f.policies = append(f.policies, c)
}
func (f *fakeFront) Invalidate(dev int, p cuda.Ptr) { f.invalid = append(f.invalid, p) }
func (f *fakeFront) Capacity() int                  { return 64 }
func (f *fakeFront) policy() allocator.FrontPolicy  { return f.policies[len(f.policies)-1] }

// small is the tag of a default-pool block the front may hold.
const small = allocator.TagDefault | allocator.TagHold

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
	p, tr, err, _ := mallocTracked(a, 0, 4096, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.Tracking{Tag: small}, tr)
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
	p, tr, err, _ := mallocTracked(a, 0, 4096, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, small, tr.Tag)
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
	return frontAllocConf(t, mem, f, "")
}

func frontAllocConf(t *testing.T, mem uint64, f allocator.Front, conf string) *allocator.Allocator {
	lockThread(t)
	a, _ := newAlloc(t, 1, mem, conf)
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
	p, tr, err, _ := mallocTracked(a, 0, 60*MiB, 5, 0, nil)
	require.NoError(t, err)
	require.Equal(t, cached, p)
	require.True(t, inPool(t, a, pool, p), "a private pool's block")
	require.Equal(t, allocator.Tracking{}, tr, "the front must not track a private pool's block")
}

// The policy SetFront pushes: off until captures are announced, the hold
// limit and cold mode's numbers, no phases.
func TestFrontPolicy(t *testing.T) {
	lockThread(t)
	f := &fakeFront{}
	a, _ := newAlloc(t, 2, 8*GiB, "")
	a.SetFront(f)
	p := f.policy()
	require.False(t, p.On, "captures not announced yet")
	require.Equal(t, 64, p.Hold)
	require.Equal(t, []int{256, 4096, 6}, []int{p.ColdWindow, p.ColdSkip, p.ColdMaxShift})
	require.Equal(t, []uint32{0, 0}, p.Phases)
	a.ExpectAnnouncements()
	require.True(t, f.policy().On)
	require.NoError(t, a.RecordHistory(allocator.HistoryOptions{Enabled: true, MaxEntries: 10}))
	require.False(t, f.policy().On, "memory history turns it off")
	require.NoError(t, a.RecordHistory(allocator.HistoryOptions{}))
	require.True(t, f.policy().On)
}

// During allocate-to-pool phases the front keeps serving whatever the
// filter: each begin and end gives the device's phases a new generation,
// and a malloc routed to a phase's pool returns the pool's tag as its
// route, with the generation; a malloc the filters send to the default
// pools returns none (only a yes may be kept).
func TestFrontRoutesPhases(t *testing.T) {
	f := &fakeFront{}
	a := frontAlloc(t, 8*GiB, f)
	require.True(t, f.policy().On)

	pool := allocator.PoolID{A: 3}
	require.NoError(t, a.BeginAllocateToPool(0, pool, func(s cuda.Stream) bool { return s == 7 }))
	require.True(t, a.FrontEnabled(), "any filter: Go routes")
	gen1 := f.policy().Phases[0]
	require.NotZero(t, gen1)

	p, tr, err, _ := mallocTracked(a, 0, 4096, 7, 0, nil)
	require.NoError(t, err)
	require.True(t, inPool(t, a, pool, p))
	tag := tr.Route
	require.GreaterOrEqual(t, tag, uint32(2), "a private pool's tag")
	require.Equal(t, allocator.Tracking{Tag: tag | allocator.TagHold, Route: tag, Phases: gen1}, tr,
		"tracked with its pool's tag; the route and its generation")
	q, tr, err, _ := mallocTracked(a, 0, 4096, 8, 0, nil)
	require.NoError(t, err)
	require.False(t, inPool(t, a, pool, q))
	require.Equal(t, allocator.Tracking{Tag: small}, tr, "the filter refuses stream 8: the default pools, no route")

	// A second phase, with a nil filter: a new generation, and the newest
	// phase wins.
	pool2 := allocator.PoolID{A: 4}
	require.NoError(t, a.BeginAllocateToPool(0, pool2, nil))
	gen2 := f.policy().Phases[0]
	require.NotZero(t, gen2)
	require.NotEqual(t, gen1, gen2)
	r, tr, err, _ := mallocTracked(a, 0, 4096, 7, 0, nil)
	require.NoError(t, err)
	require.True(t, inPool(t, a, pool2, r), "the newest phase wins")
	require.NotEqual(t, tag, tr.Route)
	require.Equal(t, allocator.Tracking{Tag: tr.Route | allocator.TagHold, Route: tr.Route, Phases: gen2}, tr)

	require.NoError(t, a.EndAllocateToPool(0, pool))
	gen3 := f.policy().Phases[0]
	require.NotZero(t, gen3)
	require.NotEqual(t, gen2, gen3, "an end is a new generation too")
	require.NoError(t, a.EndAllocateToPool(0, pool2))
	require.Zero(t, f.policy().Phases[0], "no phase under way")
	require.True(t, a.FrontEnabled())
	_, tr, err, _ = mallocTracked(a, 0, 4096, 7, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.Tracking{Tag: small}, tr)
	for _, x := range []cuda.Ptr{p, q, r} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
}

// A private pool's blocks are tracked with its pool's tag, held at any
// size; with expandable segments only small ones may be held (see
// privateTag). The default pools' are tracked either way, held if small.
func TestFrontTagsExpandablePrivatePools(t *testing.T) {
	for _, conf := range []string{ordinary, "expandable_segments:True,stitch:False", ""} {
		t.Run(conf, func(t *testing.T) {
			lockThread(t)
			f := &fakeFront{}
			a, _ := newAlloc(t, 1, 8*GiB, conf)
			a.SetFront(f)
			a.ExpectAnnouncements()
			pool := allocator.PoolID{A: 3}
			require.NoError(t, a.BeginAllocateToPool(0, pool, func(s cuda.Stream) bool { return s == 7 }))
			var ps, inpool []cuda.Ptr
			for _, size := range []uint64{4096, 3 * MiB} { // the small and the large pool
				p, tr, err, _ := mallocTracked(a, 0, size, 7, 0, nil)
				require.NoError(t, err)
				inpool = append(inpool, p)
				require.True(t, inPool(t, a, pool, inpool...))
				want := tr.Route | allocator.TagHold
				if conf != ordinary && size > 4096 {
					want = tr.Route
				}
				require.Equal(t, want, tr.Tag, "tracked with its pool's tag (%d bytes)", size)
				q, tr, err, _ := mallocTracked(a, 0, size, 8, 0, nil)
				require.NoError(t, err)
				want = small
				if size > 4096 {
					want = allocator.TagDefault
				}
				require.Equal(t, want, tr.Tag, "the default pools' blocks are tracked (%d bytes)", size)
				ps = append(ps, p, q)
			}
			require.NoError(t, a.EndAllocateToPool(0, pool))
			for _, x := range ps {
				require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
			}
		})
	}
}

// A block handed out whole with spare bytes is not tracked if it shares its
// segment (the front would pass its spare bytes on: the design note's
// "Spare bytes"); a whole segment with spare bytes is.
func TestFrontLeavesSpareBlocks(t *testing.T) {
	f := &fakeFront{}
	a := frontAllocConf(t, 8*GiB, f, ordinary)
	const n = 10*MiB - 512 // two per 20 MiB segment, the second with 1024 bytes to spare
	p, tr, err, _ := mallocTracked(a, 0, n, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.TagDefault, tr.Tag, "split from its segment: no spare bytes")
	q, tr, err, _ := mallocTracked(a, 0, n, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, p+n, q, "the segment's tail")
	require.Equal(t, allocator.TagNone, tr.Tag, "1024 bytes to spare, in a shared segment: left to Go")
	const w = 12*MiB - 512*KiB // a 12 MiB segment, 512 KiB to spare
	r, tr, err, _ := mallocTracked(a, 0, w, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.TagDefault, tr.Tag, "a whole segment with spare bytes is tracked")
	st, _ := a.Stats(0)
	require.EqualValues(t, 2*n+1024+12*MiB, st.ActiveBytes[0].Current, "(the spare bytes as the test expects)")
	for _, x := range []cuda.Ptr{p, q, r} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
}

// Go tells the front of the blocks it changes behind its back:
// record_stream, an IPC export, a checkpoint restore (freed and allocated
// blocks); nothing else does.
func TestFrontInvalidations(t *testing.T) {
	lockThread(t)
	f := &fakeFront{}
	a, drv := newAlloc(t, 1, 8*GiB, ordinary)
	a.SetFront(f)
	p := mustMalloc(t, a, 0, 4096, 1)
	q := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.Empty(t, f.invalid, "mallocs and frees invalidate nothing")
	require.NoError(t, a.RecordStream(p, 2))
	require.Equal(t, []cuda.Ptr{p}, f.invalid)
	_, _, _, err := a.IpcHandle(p)
	require.NoError(t, err)
	require.Equal(t, []cuda.Ptr{p, p}, f.invalid)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	g := allocator.PoolID{A: 1}
	const cs = cuda.Stream(7)
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeThreadLocal)
	x := mustMalloc(t, a, 0, 1000, cs)
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	cp, err := a.CheckpointPool(0, g)
	require.NoError(t, err)
	f.invalid = nil
	res, err := a.RestoreCheckpoint(0, cp)
	require.NoError(t, err)
	require.Equal(t, append(append([]cuda.Ptr(nil), res.Freed...), res.Allocated...), f.invalid)
	require.Equal(t, []cuda.Ptr{x}, res.Allocated)
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
func (f *holdFront) SetPolicy(p *allocator.FrontPolicy) {}
func (f *holdFront) Invalidate(dev int, p cuda.Ptr)     {}
func (f *holdFront) Capacity() int                      { return 128 }

// A held block: its free is counted at once, the block stays allocated
// while mallocs run, a malloc that finds no other block releases it rather
// than grow, and every other operation releases it first.
func TestFrontHeldBlocks(t *testing.T) {
	f := &holdFront{}
	a := frontAlloc(t, 8*GiB, f)

	p, tr, err, _ := mallocTracked(a, 0, 60*MiB, 0, 0, nil)
	require.NoError(t, err)
	require.Equal(t, allocator.TagDefault, tr.Tag)
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
