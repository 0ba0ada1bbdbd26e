// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Donors picks whole pages of free expandable blocks, smallest block first
// and from the end of a block when fewer are wanted; the owner's verdict and
// the skipped run are respected. Unmapped donors become unmapped space;
// lent ones are neither free nor mappable until Unlend.
func TestStitchDonorsLendUnlend(t *testing.T) {
	c := NewCache(DefaultConfig())
	m := newFakeMapper()
	a := expAlloc(t, c, m, 6*MiB, 0)  // [0, 6): pages 0-2
	g1 := expAlloc(t, c, m, 2*MiB, 0) // (large pool guards)
	b := expAlloc(t, c, m, 6*MiB, 0)  // [8, 14): pages 4-6
	g2 := expAlloc(t, c, m, 2*MiB, 0)
	base := a.Ptr
	expFree(t, c, a)
	expFree(t, c, b)
	require.True(t, c.HasUnmappable(c.Large))
	all := func(*Block) DonorKind { return DonorUnmap }

	ds, got, refused := c.Donors(c.Large, 4*page, all, nil, 0, 0, nil)
	require.Equal(t, uint64(4*page), got)
	require.Zero(t, refused)
	require.Len(t, ds, 2)
	require.Equal(t, base, ds[0].B.Ptr, "equal sizes: the lower address first")
	require.Equal(t, [2]uint64{0, 3 * page}, [2]uint64{ds[0].Lo, ds[0].Hi})
	require.Equal(t, [2]uint64{6 * page, 7 * page}, [2]uint64{ds[1].Lo, ds[1].Hi}, "one page, from the end")

	notA := func(x *Block) DonorKind {
		if x.Ptr == base {
			return NoDonor
		}
		return DonorLend
	}
	ds, got, refused = c.Donors(c.Large, 8*page, notA, nil, 0, 0, nil)
	require.Equal(t, uint64(3*page), got)
	require.Equal(t, uint64(3*page), refused, "a's three pages")
	require.Len(t, ds, 1)
	require.True(t, ds[0].Lend)
	ds2, got2, _ := c.Donors(c.Large, 8*page, all, a.Seg, 4*page, 16*page, nil)
	require.Equal(t, uint64(3*page), got2, "b lies in the skipped run")
	require.Len(t, ds2, 1)

	// Lend b's three pages: their old mapping stays.
	before := c.Reserved
	n, err := c.UnmapDonor(ds[0], m)
	require.NoError(t, err)
	require.Equal(t, uint64(3*page), n)
	require.Equal(t, before-3*page, c.Reserved, "the pages are counted where they go")
	require.Equal(t, 3, m.lent)
	require.Len(t, m.mapped, 8, "the fake mapper still maps all eight pages")
	lentBlock := ds[0].B
	require.True(t, lentBlock.Lent && lentBlock.Unmapped)
	require.NoError(t, c.Check())

	// Growth never maps over a lent range: a 6 MiB request's run is the
	// unmapped end, not [8, 14).
	r := c.NewRequest(6*MiB, 0, c.Small, c.Large)
	start := c.FindExpandable(&r, LowestRun)
	require.NotNil(t, start)
	require.Greater(t, start.Ptr, lentBlock.End())
	got8, err := c.MapExpandable(&r, start, m, page)
	require.NoError(t, err)
	c.Allocate(&r, got8)
	require.NoError(t, c.Check())

	// The owner unmaps the old mapping, then Unlend: ordinary unmapped
	// space again, which growth may map.
	for p := lentBlock.Ptr; p < lentBlock.End(); p += page {
		delete(m.mapped, p)
	}
	c.Unlend(lentBlock)
	require.False(t, lentBlock.Lent)
	require.NoError(t, c.Check())
	r = c.NewRequest(5*MiB, 0, c.Small, c.Large)
	start = c.FindExpandable(&r, LowestRun)
	require.Equal(t, g1.End(), start.Ptr, "b's unmapped pages span 5 MiB")
	require.Equal(t, uint64(3*page), c.GrowthNeed(&r, start, page), "5 MiB in whole pages")

	// Unmapping a's three pages for good.
	n, err = c.UnmapDonor(Donor{B: c.Large.Blocks.LowerBound(0, 6*MiB), Lo: 0, Hi: 3 * page}, m)
	require.NoError(t, err)
	require.Equal(t, uint64(3*page), n)
	require.NoError(t, c.Check())
	require.Equal(t, 3, c.Large.Unmapped.Len(), "a's, b's and the end's unmapped space")
	expFree(t, c, g1)
	expFree(t, c, g2)
	require.Panics(t, func() { c.Unlend(lentBlock) })
}

// A tag's pool is never a donor, though its small pool maps page by page
// as the default ones do: pausing a tag gives back its pages, so none of
// them may be mapped elsewhere (paused.go).
func TestStitchDonorsSkipTags(t *testing.T) {
	c := NewCache(DefaultConfig())
	m := newFakeMapper()
	tp := c.NewPool(true, PoolID{})
	tp.Tag = 1
	r := c.NewRequest(MiB, 0, tp, tp)
	start := c.AddExpandable(&r, 0x20000000000, 64*page, page, page)
	b, err := c.MapExpandable(&r, start, m, 4*page)
	require.NoError(t, err)
	b = c.Allocate(&r, b)
	require.True(t, b.Seg.Expandable && b.Seg.ChunkSize == b.Seg.PageSize, "page by page")
	expFree(t, c, b)
	require.True(t, c.HasUnmappable(tp), "whole free pages a default pool would give")
	all := func(*Block) DonorKind { return DonorUnmap }
	ds, got, _ := c.Donors(tp, 4*page, all, nil, 0, 0, nil)
	require.Zero(t, got)
	require.Empty(t, ds)
	tp.Tag = 0
	_, got, _ = c.Donors(tp, 4*page, all, nil, 0, 0, nil)
	require.Positive(t, got, "the same pool untagged gives pages")
}
