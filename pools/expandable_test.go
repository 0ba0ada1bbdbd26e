// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/stretchr/testify/require"
)

const page = 2 * MiB

// fakeMapper records page states and can fail.
type fakeMapper struct {
	mapped    map[cuda.Ptr]bool
	fail      error
	failAfter uint64 // bytes mapped (or unmapped) before failing
	unmapFail error
	freed     int
	lent      int
	handles   cuda.MemHandle // the last handle given out: one per page
}

func newFakeMapper() *fakeMapper { return &fakeMapper{mapped: map[cuda.Ptr]bool{}} }

func (m *fakeMapper) Map(seg *Segment, off, size uint64) (uint64, error) {
	for o := off; o < off+size; o += seg.PageSize {
		p := seg.Base + cuda.Ptr(o)
		if m.fail != nil && (m.failAfter == 0 || o-off >= m.failAfter) {
			return o - off, m.fail
		}
		if m.mapped[p] {
			return o - off, errors.New("mapped twice")
		}
		m.mapped[p] = true
		m.handles++
		seg.SetPage(o/seg.PageSize, m.handles)
	}
	return size, nil
}

func (m *fakeMapper) Unmap(seg *Segment, off, size uint64) (uint64, error) {
	for o := off; o < off+size; o += seg.PageSize {
		p := seg.Base + cuda.Ptr(o)
		if m.unmapFail != nil && o-off >= m.failAfter {
			return o - off, m.unmapFail
		}
		if !m.mapped[p] {
			return o - off, errors.New("unmapping an unmapped page")
		}
		delete(m.mapped, p)
		seg.SetPage(o/seg.PageSize, 0)
	}
	return size, nil
}

func (m *fakeMapper) Free(seg *Segment) error { m.freed++; return nil }

// Lend forgets the pages' handles; the test unmaps the old mapping
// (unlendFake) before Unlend.
func (m *fakeMapper) Lend(seg *Segment, off, size uint64) {
	for o := off; o < off+size; o += seg.PageSize {
		seg.SetPage(o/seg.PageSize, 0)
		m.lent++
	}
}

// expAlloc is the allocator's growth path in miniature.
func expAlloc(t *testing.T, c *Cache, m Mapper, size uint64, s cuda.Stream) *Block {
	t.Helper()
	r := c.NewRequest(size, s, c.Small, c.Large)
	b := c.TakeFree(&r)
	if b == nil {
		start := c.FindExpandable(&r, LowestRun)
		if start == nil {
			start = c.AddExpandable(&r, cuda.Ptr(0x10000000000)*cuda.Ptr(len(c.segments)+1), 64*page, page, page)
		}
		var err error
		b, err = c.MapExpandable(&r, start, m, page)
		require.NoError(t, err)
	}
	b = c.Allocate(&r, b)
	require.NoError(t, c.Check())
	return b
}

func expFree(t *testing.T, c *Cache, b *Block) {
	t.Helper()
	c.Release(b)
	c.Return(b)
	require.NoError(t, c.Check())
}

// A block grows across page boundaries: consecutive allocations tile one
// range, and a freed tail merges with newly mapped pages.
func TestExpandableGrowsAcrossPages(t *testing.T) {
	c := NewCache(DefaultConfig())
	m := newFakeMapper()
	a := expAlloc(t, c, m, 3*MiB, 0) // maps 2 pages
	require.Equal(t, 1, len(c.segments))
	require.Equal(t, uint64(2*page), c.Reserved)
	require.Zero(t, c.Stats.Segment[StatAll].Current, "expandable segments are not counted as segments")
	b := expAlloc(t, c, m, 3*MiB, 0) // 1 MiB free after a, maps 1 more page
	require.Equal(t, a.End(), b.Ptr, "b continues where a ends, across the page boundary")
	require.Equal(t, uint64(3*page), c.Reserved)
	require.Len(t, m.mapped, 3)

	// Freeing b leaves a free tail of 4 MiB followed by unmapped space; a
	// 7 MiB request maps 2 more pages and spans all of it.
	expFree(t, c, b)
	d := expAlloc(t, c, m, 7*MiB, 0)
	require.Equal(t, a.End(), d.Ptr)
	require.Equal(t, uint64(5*page), c.Reserved)
	require.Zero(t, c.ReadStats().InactiveSplit[StatAll].Current)

	// Another stream gets its own range.
	e := expAlloc(t, c, m, 512, 1)
	require.Equal(t, 2, len(c.segments))
	require.True(t, c.Small.Unmapped.Len() == 1)
	expFree(t, c, e)

	// Release unmaps the whole free pages; the partial page after d stays.
	expFree(t, c, a)
	require.NoError(t, c.UnmapFree(c.Large, m))
	require.NoError(t, c.UnmapFree(c.Small, m))
	require.NoError(t, c.Check())
	require.Equal(t, 1, m.freed, "the small range had nothing mapped left and was given back")
	// d covers [3 MiB, 10 MiB): pages 1..4 stay mapped, page 0 does not.
	require.Equal(t, uint64(4*page), c.Reserved)
	base, size, ok := c.MappedRun(d.Seg, d.Ptr)
	require.True(t, ok)
	require.Equal(t, d.Seg.Base+page, base)
	require.Equal(t, uint64(4*page), size)

	expFree(t, c, d)
	require.NoError(t, c.UnmapFree(c.Large, m))
	require.NoError(t, c.Check())
	require.Zero(t, c.Reserved)
	require.Empty(t, m.mapped)
	require.Equal(t, 2, m.freed)
	require.Empty(t, c.segments)
}

// Best fit keeps the growing end of a segment for requests that need to
// grow, and mapping failures leave a consistent cache.
func TestExpandablePreferInteriorAndFailures(t *testing.T) {
	c := NewCache(DefaultConfig())
	m := newFakeMapper()
	a := expAlloc(t, c, m, 4*MiB, 0)
	expAlloc(t, c, m, 9*MiB/2, 0) // 10 MiB mapped: 1.5 MiB free at the end, then unmapped space
	base := a.Ptr
	expFree(t, c, a) // a 4 MiB hole inside
	// A 1.25 MiB request: the end block (1.5 MiB, could grow) and the 4 MiB
	// hole both fit; the hole, which cannot grow, is taken.
	y := expAlloc(t, c, m, 5*MiB/4, 0)
	require.Equal(t, base, y.Ptr)

	m.fail = cuda.ErrOutOfMemory
	r := c.NewRequest(40*MiB, 0, c.Small, c.Large)
	start := c.FindExpandable(&r, LowestRun)
	require.NotNil(t, start)
	_, err := c.MapExpandable(&r, start, m, page)
	require.ErrorIs(t, err, cuda.ErrOutOfMemory)
	require.NoError(t, c.Check())
	// A failure part way: what was mapped is recorded, nothing is lost.
	m.failAfter = 2 * page
	before := c.Reserved
	_, err = c.MapExpandable(&r, start, m, page)
	require.ErrorIs(t, err, cuda.ErrOutOfMemory)
	require.NoError(t, c.Check())
	require.Equal(t, before+2*page, c.Reserved)
	require.Len(t, m.mapped, int(c.Reserved/page))
	m.failAfter = 0

	// Unmapping that fails part way records what it did unmap.
	m.fail = nil
	m.unmapFail, m.failAfter = cuda.ErrUnknown, page // the 2-page tail fails half way
	require.ErrorIs(t, c.UnmapFree(c.Large, m), cuda.ErrUnknown)
	require.NoError(t, c.Check())
	require.Len(t, m.mapped, int(c.Reserved/page))
	m.unmapFail, m.failAfter = nil, 0
	require.NoError(t, c.UnmapFree(c.Large, m))
	require.NoError(t, c.Check())
	require.Len(t, m.mapped, int(c.Reserved/page))
	mapped := c.Reserved
	big, err := c.MapExpandable(&r, c.FindExpandable(&r, LowestRun), m, page) // the unmapped pages are mapped again
	require.NoError(t, err)
	require.Greater(t, c.Reserved, mapped)
	expFree(t, c, c.Allocate(&r, big))
	require.NoError(t, c.UnmapFree(c.Large, m))
	require.NoError(t, c.Check())

	c.SetFraction(0.5, 40*MiB) // 20 MiB allowed
	start = c.FindExpandable(&r, LowestRun)
	_, err = c.MapExpandable(&r, start, m, page)
	require.ErrorIs(t, err, ErrFraction)
	require.NoError(t, c.Check())
}

// LeastGrowth takes the run whose first request-size bytes hold the most
// free mapped memory (the fewest new pages), ties to the lower address;
// LowestRun the lowest-addressed run that fits.
func TestFindExpandableLeastGrowth(t *testing.T) {
	c := NewCache(DefaultConfig())
	m := newFakeMapper()
	a := expAlloc(t, c, m, 5*page, 0) // pages 0-4
	g1 := expAlloc(t, c, m, page, 0)  // 5 (guards keep the runs apart)
	b := expAlloc(t, c, m, 5*page, 0) // 6-10
	g2 := expAlloc(t, c, m, page, 0)  // 11
	d := expAlloc(t, c, m, 5*page, 0) // 12-16
	g3 := expAlloc(t, c, m, page, 0)  // 17; 18-63 unmapped
	base := a.Ptr
	for _, x := range []*Block{a, b, d} {
		expFree(t, c, x)
	}
	// Runs: [0, 1) mapped + [1, 5) unmapped; [6, 9) + [9, 11);
	// [12, 15) + [15, 16) + [16, 17) mapped; the end, [18, 64), unmapped.
	// (The unmapped set is in size order: [15, 16) comes first.)
	for _, hole := range []struct {
		b      *Block
		lo, hi uint64
	}{{a, 1, 5}, {b, 9, 11}, {d, 15, 16}} {
		_, err := c.UnmapDonor(Donor{B: hole.b, Lo: hole.lo * page, Hi: hole.hi * page}, m)
		require.NoError(t, err)
	}
	require.NoError(t, c.Check())
	at := func(pg uint64) cuda.Ptr { return base + cuda.Ptr(pg*page) }

	r := c.NewRequest(4*page, 0, c.Small, c.Large)
	require.Equal(t, at(0), c.FindExpandable(&r, LowestRun).Ptr, "the lowest run that fits")
	// Needs: 3 pages at 0, 1 at 6 and at 12, 4 at the end: the tie goes
	// to the lower address.
	start := c.FindExpandable(&r, LeastGrowth)
	require.Equal(t, at(6), start.Ptr, "the higher run needs fewer new pages")
	require.Equal(t, uint64(page), c.GrowthNeed(&r, start, page))
	before := c.Reserved
	got, err := c.MapExpandable(&r, start, m, page)
	require.NoError(t, err)
	require.Equal(t, before+page, c.Reserved, "one new page")
	x := c.Allocate(&r, got)
	require.Equal(t, at(6), x.Ptr)
	require.NoError(t, c.Check())

	// 7 MiB: 2 MiB mapped at 0 and 5 new; 6 MiB mapped at 12 and 1 new.
	// (At 6 only page 10 is left: x ends at 10.)
	r = c.NewRequest(7*MiB, 0, c.Small, c.Large)
	require.Equal(t, at(0), c.FindExpandable(&r, LowestRun).Ptr)
	require.Equal(t, at(12), c.FindExpandable(&r, LeastGrowth).Ptr)
	// Larger than every hole: only the end fits, whatever the rule.
	r = c.NewRequest(20*page, 0, c.Small, c.Large)
	require.Equal(t, at(18), c.FindExpandable(&r, LeastGrowth).Ptr)
	require.Equal(t, at(18), c.FindExpandable(&r, LowestRun).Ptr)
	// Another stream has no run.
	r = c.NewRequest(page, 1, c.Small, c.Large)
	require.Nil(t, c.FindExpandable(&r, LeastGrowth))

	expFree(t, c, x)
	for _, g := range []*Block{g1, g2, g3} {
		expFree(t, c, g)
	}
}

// A segment's page record grows with the highest page mapped, not with the
// reservation: a range reserves up to the device's capacity and more.
func TestSegmentPagesGrowWithMapping(t *testing.T) {
	const page = 2 << 20
	seg := &Segment{Base: 1 << 40, Size: 90 << 30, PageSize: page, Expandable: true}
	require.Zero(t, cap(seg.pages), "nothing recorded for an unmapped range")
	require.Equal(t, uint64(46080), seg.PageCount())
	require.Zero(t, seg.Page(46079))
	seg.SetPage(46079, 0) // unmapping beyond the record: nothing to grow
	require.Zero(t, cap(seg.pages))
	seg.SetPage(3, 7)
	require.Equal(t, cuda.MemHandle(7), seg.Page(3))
	require.Zero(t, seg.Page(2))
	require.Zero(t, seg.Page(4))
	require.LessOrEqual(t, len(seg.pages), 64, "a small record for a few pages")
	seg.SetPage(1000, 9)
	require.Equal(t, cuda.MemHandle(7), seg.Page(3), "kept across growth")
	require.Equal(t, cuda.MemHandle(9), seg.Page(1000))
	seg.SetPage(46079, 11)
	require.Equal(t, seg.PageCount(), uint64(len(seg.pages)), "never beyond the range")
	require.Equal(t, cuda.MemHandle(11), seg.Page(46079))
	require.True(t, seg.ChunkBoundary(1000*page), "a lone page begins")
	require.True(t, seg.ChunkBoundary(1001*page), "and ends")
	require.Equal(t, uint64(page), seg.ChunkAt(1000*page))
	seg.SetChunk(2000*page, 3*page, 13) // one chunk of three pages
	require.Equal(t, uint64(3*page), seg.ChunkAt(2000*page))
	require.Zero(t, seg.Page(2003))
	seg.SetChunk(2000*page, 3*page, 0)
	require.Zero(t, seg.Page(2000)+seg.Page(2001)+seg.Page(2002))
}
