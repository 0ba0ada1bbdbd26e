// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/stretchr/testify/require"
)

// poolHarness allocates into one private pool (a small and a large half)
// the way the allocator does, with ordinary or expandable segments.
type poolHarness struct {
	t            *testing.T
	c            *Cache
	small, large *BlockPool
	m            *fakeMapper // nil: ordinary segments
	next         cuda.Ptr
}

func newPoolHarness(t *testing.T, expandable bool) *poolHarness {
	c := NewCache(DefaultConfig())
	id := PoolID{A: 1}
	h := &poolHarness{t: t, c: c, small: c.NewPool(true, id), large: c.NewPool(false, id), next: 1 << 40}
	if expandable {
		h.m = newFakeMapper()
	}
	return h
}

func (h *poolHarness) malloc(size uint64, s cuda.Stream) *Block {
	r := h.c.NewRequest(size, s, h.small, h.large)
	b := h.c.TakeFree(&r)
	if b == nil && h.m == nil {
		b = h.c.AddSegment(&r, h.next)
		h.next += cuda.Ptr(r.SegSize) + 2*MiB
	}
	if b == nil {
		start := h.c.FindExpandable(&r, LowestRun)
		if start == nil {
			start = h.c.AddExpandable(&r, h.next, 64*page, page, page)
			h.next += 66 * page
		}
		var err error
		b, err = h.c.MapExpandable(&r, start, h.m, page)
		require.NoError(h.t, err)
	}
	b = h.c.Allocate(&r, b)
	require.NoError(h.t, h.c.Check())
	return b
}

func (h *poolHarness) free(b *Block) {
	h.c.Release(b)
	h.c.Return(b)
	require.NoError(h.t, h.c.Check())
}

// restore does what the allocator does: free every allocated block of the
// pool, then carve.
func (h *poolHarness) restore(saved []SegmentState) []*Block {
	require.NoError(h.t, h.c.CheckLayout(h.small, h.large, saved))
	for _, b := range h.c.PoolAllocated(h.small, h.large) {
		h.free(b)
	}
	out := h.c.RestoreLayout(h.small, h.large, saved)
	require.NoError(h.t, h.c.Check())
	return out
}

func (h *poolHarness) layout() []SegmentState {
	l, err := h.c.SaveLayout(h.small, h.large)
	require.NoError(h.t, err)
	return l
}

func ptrsOf(bs []*Block) []cuda.Ptr {
	var out []cuda.Ptr
	for _, b := range bs {
		out = append(out, b.Ptr)
	}
	return out
}

func allocatedIn(l []SegmentState) []cuda.Ptr {
	var out []cuda.Ptr
	for _, s := range l {
		for _, b := range s.Blocks {
			if b.Allocated {
				out = append(out, b.Ptr)
			}
		}
	}
	return out
}

// A checkpoint restored after frees, new allocations, a new segment and
// changes to requested sizes and contexts gives back exactly the saved
// layout (the new segment stays, free) with statistics equal to a recount.
func TestCheckpointLayoutRoundTrip(t *testing.T) {
	h := newPoolHarness(t, false)
	a := h.malloc(1000, 0)
	b := h.malloc(3000, 0)
	c := h.malloc(5*MiB, 0) // large: 20 MiB segment, split
	d := h.malloc(700, 0)
	a.Context, c.Context = 11, 33
	// Blocks are recycled once freed: keep the addresses.
	pa, pc, pd := a.Ptr, c.Ptr, d.Ptr
	h.free(b) // a hole between a and d
	saved := h.layout()
	require.Len(t, saved, 2)
	require.Equal(t, []cuda.Ptr{pa, pd, pc}, allocatedIn(saved))

	// Diverge: free, allocate into the hole and into a new segment.
	h.free(a)
	h.free(c)
	e := h.malloc(2000, 0)
	require.Equal(t, pa, e.Ptr, "the hole is reused")
	f := h.malloc(30*MiB, 0) // a new segment
	g := h.malloc(5*MiB, 0)
	require.Equal(t, pc, g.Ptr)
	h.free(f)

	got := h.restore(saved)
	require.Equal(t, []cuda.Ptr{pa, pd, pc}, ptrsOf(got))
	now := h.layout()
	require.Len(t, now, 3, "the segment made since stays")
	require.Equal(t, saved, now[:2], "the checkpoint's segments are exactly as saved")
	require.Len(t, now[2].Blocks, 1)
	require.False(t, now[2].Blocks[0].Allocated, "the new segment is one free block")
	ctx := map[cuda.Ptr]uint64{}
	req := map[cuda.Ptr]uint64{}
	for _, x := range got {
		ctx[x.Ptr], req[x.Ptr] = x.Context, x.Requested
	}
	require.Equal(t, map[cuda.Ptr]uint64{pa: 11, pd: 0, pc: 33}, ctx)
	require.Equal(t, map[cuda.Ptr]uint64{pa: 1000, pd: 700, pc: 5 * MiB}, req)
	require.Equal(t, int64(3), h.c.ReadStats().Allocation[StatAll].Current)
	require.Equal(t, int64(1000+700+5*MiB), h.c.ReadStats().RequestedBytes[StatAll].Current)

	// The carve counts no allocation that never was: from a state with
	// less allocated, the peak after the restore is the restored state.
	for _, x := range h.c.PoolAllocated(h.small, h.large) {
		if x.Ptr != pd {
			h.free(x)
		}
	}
	h.c.ResetPeak()
	allocs := h.c.ReadStats().Allocation[StatAll].Allocated
	h.restore(saved)
	st := h.c.ReadStats().AllocatedBytes[StatAll]
	require.Equal(t, st.Current, st.Peak)
	require.Equal(t, allocs+3, h.c.ReadStats().Allocation[StatAll].Allocated, "d freed and allocated again, a and c allocated")

	// Restoring twice gives the same again.
	got2 := h.restore(saved)
	require.Equal(t, []cuda.Ptr{pa, pd, pc}, ptrsOf(got2))
	require.Equal(t, saved, h.layout()[:2])
}

// An empty checkpoint frees everything; a checkpoint of a pool with no
// segments restores to all-free segments.
func TestCheckpointLayoutEmpty(t *testing.T) {
	h := newPoolHarness(t, false)
	empty := h.layout()
	require.Empty(t, empty)
	h.malloc(4096, 0)
	h.malloc(8*MiB, 1)
	require.Empty(t, h.restore(empty))
	require.Empty(t, h.c.PoolAllocated(h.small, h.large))
	require.Zero(t, h.c.ReadStats().Allocation[StatAll].Current)
	require.Zero(t, h.c.ReadStats().InactiveSplit[StatAll].Current, "whole free segments are not split")
}

// Expandable segments: pages mapped since the checkpoint stay mapped and
// free; saved blocks on pages unmapped since make the restore refuse.
func TestCheckpointLayoutExpandable(t *testing.T) {
	h := newPoolHarness(t, true)
	a := h.malloc(3*MiB, 0)
	b := h.malloc(3*MiB, 0)
	pa, pb := a.Ptr, b.Ptr
	saved := h.layout()
	require.Len(t, saved, 1)
	require.True(t, saved[0].Blocks[len(saved[0].Blocks)-1].Unmapped, "the unmapped tail is part of the layout")
	h.free(a)
	big := h.malloc(20*MiB, 0) // maps more pages
	pbig := big.Ptr
	reserved := h.c.Reserved
	got := h.restore(saved)
	require.Equal(t, []cuda.Ptr{pa, pb}, ptrsOf(got))
	require.Equal(t, reserved, h.c.Reserved, "a restore maps and unmaps nothing")
	require.Equal(t, allocatedIn(saved), allocatedIn(h.layout()))
	now := h.layout()[0].Blocks
	require.Equal(t, saved[0].Blocks[:2], now[:2])
	require.False(t, now[2].Allocated || now[2].Unmapped, "the pages mapped since are one free block")

	// Pages given back since (freed while a block beyond them kept the
	// segment): the saved blocks lie on unmapped memory.
	y := h.malloc(20*MiB, 0)
	require.Equal(t, pbig, y.Ptr, "the pages mapped since")
	for _, x := range got {
		h.free(x)
	}
	require.NoError(t, h.c.UnmapFree(h.large, h.m))
	require.NoError(t, h.c.Check())
	require.ErrorContains(t, h.c.CheckLayout(h.small, h.large, saved), "unmapped memory")

	// Everything given back: the range itself is gone.
	h.free(y)
	require.NoError(t, h.c.UnmapFree(h.large, h.m))
	require.ErrorContains(t, h.c.CheckLayout(h.small, h.large, saved), "no longer in the pool")
}

func TestCheckpointLayoutRefusals(t *testing.T) {
	h := newPoolHarness(t, false)
	a := h.malloc(4096, 0)
	saved := h.layout()

	// A block awaiting other streams' events: neither saved nor restored.
	h.c.Release(a)
	a.Uses.Add(5)
	_, err := h.c.SaveLayout(h.small, h.large)
	require.ErrorContains(t, err, "other streams may still use it")
	require.ErrorContains(t, h.c.CheckLayout(h.small, h.large, saved), "other streams may still use it")
	a.Uses.Clear()
	h.c.Return(a)
	require.NoError(t, h.c.Check())

	// An allocated block with uses: freeing it would need events.
	x := h.malloc(4096, 0)
	x.Uses.Add(5)
	require.ErrorContains(t, h.c.CheckLayout(h.small, h.large, saved), "used by other streams")
	x.Uses.Clear()

	// A segment given back since.
	h.free(x)
	require.NoError(t, h.c.ReleasePool(h.small, func(cuda.Ptr, uint64) error { return nil }))
	require.ErrorContains(t, h.c.CheckLayout(h.small, h.large, saved), "no longer in the pool")

	// A segment found in the other half of the pool is refused.
	other := newPoolHarness(t, false)
	other.malloc(4096, 0)
	require.ErrorContains(t, other.c.CheckLayout(other.large, other.small, other.layout()), "no longer in the pool")
	require.NoError(t, h.c.Check())
}

func TestLargestFree(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	require.Zero(t, h.c.LargestFree(h.c.Large))
	a := h.malloc(30*MiB, 1)
	h.malloc(4*MiB, 0)
	h.freeBlock(a)
	require.Equal(t, uint64(30*MiB), h.c.LargestFree(h.c.Large), "the largest over all streams")
	require.Zero(t, h.c.LargestFree(h.c.Small), "nothing small cached")
}

func TestNoSplitPool(t *testing.T) {
	h := newPoolHarness(t, false)
	h.small.NoSplit, h.large.NoSplit = true, true
	a := h.malloc(512, 0)
	require.Equal(t, uint64(SmallBuffer), a.Size, "the whole segment, not split")
	b := h.malloc(512, 0)
	require.NotEqual(t, a.Seg, b.Seg, "each allocation its own segment")
	c := h.malloc(3*MiB, 0)
	require.Equal(t, uint64(LargeBuffer), c.Size)
	require.Zero(t, h.c.ReadStats().InactiveSplit[StatAll].Current)
}
