// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"

	"github.com/cudapool/cudapool/cuda"
)

// Expandable segments (expandable_segments:True).
//
// # Design
//
// An ordinary segment is one cuMemAlloc: its size is fixed, so a block can
// never grow past the segment's end, and a free block stranded between two
// allocated ones of another segment is fragmentation that only empty_cache
// can return. An expandable segment is instead one large reserved address
// range (cuMemAddressReserve) per pool and stream, backed page by page with
// physical memory (cuMemCreate + cuMemMap + cuMemSetAccess) as it is needed,
// so the pool's memory grows at the end of one range and a block can span
// what would have been segment boundaries.
//
// The segment's blocks tile the whole reserved range. A block is mapped
// (an ordinary block: allocated, awaiting its free, or free in the pool's
// Blocks) or unmapped (Block.Unmapped: in the pool's Unmapped set, always
// whole pages). Neighbours that are both free and mapped alike are merged, so free
// mapped and unmapped blocks alternate between allocated ones. Reserved
// memory is mapped memory: Segment.Mapped, counted in Cache.Reserved and
// reserved_bytes.
//
// Growth (no mapped free block fits): FindExpandable picks, on the request's
// stream, a run: an unmapped block that, with the free mapped block just
// before it and the free and unmapped blocks after it, spans the request
// (Which run, below); MapExpandable maps pages at its start, merging each
// newly mapped piece with the free mapped neighbours, until one free block
// covers the request: at least the owner's mapping unit per Mapper call
// where there is room (one call per unmapped block, fewer calls for many small
// growths), in whole chunks where the segment asks for them
// (Segment.WholeChunks), or just the pages needed when the memory fraction
// or the device has no room for more. With no such room the owner reserves a new
// segment (AddExpandable). Best fit prefers, among blocks that fit, one
// that is not the growing end of a segment (preferInterior), so that the
// end stays free to grow. Segment.UsedEnd remembers the highest byte ever
// handed out; TrimUnused unmaps the pages mapped ahead above it, which no
// work has touched, when a capture into the pool ends.
//
// # Which run
//
// Without stitching a range is unmapped only at its end, save after
// empty_cache, and growth takes the lowest-addressed run (LowestRun), as
// PyTorch's expandable segments grow at the end of their range. With
// stitching (the owner's choice: the default pools, whose pages stitching
// moves) holes open at every stitching miss, and growth takes the run whose
// first request-size bytes take the fewest new pages, that is hold the most
// free mapped memory (LeastGrowth; ties to the lower address). Why: the
// part of a growth above the reserved high-water mark is what stitching
// must find as idle pages elsewhere, and while the GPU runs behind the host
// most free pages are still busy, so what stitching cannot move is new
// memory, which raises the mark for good. Reusing the run with the most
// mapped free memory needs fewer new pages at all: on the 75-step training
// trace with the GPU 200 operations behind (bench/simreplay -lag 200),
// reserved/allocated fell from 1.078, above expandable segments without
// stitching, to 1.011. The owner keeps the lowest run where that saves
// little: in a range that holds plenty of free memory (vmem's "Fragmented
// ranges"), as without stitching, and where the run needing the fewest new
// pages needs no more than one mapping unit less than the lowest run (about
// what one growth maps ahead anyway). Each growth moved away from the
// lowest run scatters the working set, and with the small savings too a
// steady mixed working set still created and moved pages after 100,000
// pairs (allocator/steadycalls_test.go). The scan visits each unmapped block
// of the stream, as the lowest-run one does, and leaves a candidate's walk
// once it needs more than the best so far; it runs on misses only. Private
// pools grow during captures, where nothing is unmapped, and keep LowestRun
// (the same on the traces measured).
//
// Stitching (stitch.go) may take whole pages out of free mapped blocks,
// unmapping them, or lending them: a lent block (Block.Lent) is unmapped
// for the pools' purposes but its old mapping still exists, so it is in no
// set, is never merged, mapped or counted as free, until the owner has
// unmapped the old mapping and calls Unlend.
//
// Release (empty_cache, the OOM retry; never during a capture): UnmapFree
// unmaps the whole physical allocations (chunks: Segment.ChunkSize; pages
// of one chunk hold the same handle) inside each free mapped block; the
// partial chunks at its ends stay mapped as free blocks (cuMemUnmap takes
// whole mappings). A segment left with nothing mapped gives its address
// range back.
//
// Splitting follows the small-pool rule in expandable segments (any
// remainder of at least 512 B), since unneeded pages can be unmapped
// later, and inactive_split counts leave expandable blocks out: both as in
// PyTorch. The segment statistic counts ordinary segments only; snapshots
// show each contiguous mapped run as a segment.
//
// The driver work is the owner's (package vmem), through Mapper.

// Mapper does the driver work for expandable segments.
type Mapper interface {
	// Map backs [seg.Base+off, +size), whole pages, with physical memory
	// and makes it accessible, from the start. It returns the bytes it did
	// map (all of them unless it fails): nothing needs undoing on an error,
	// which matters during a capture, when nothing may be unmapped.
	Map(seg *Segment, off, size uint64) (uint64, error)
	// Unmap unmaps and releases the pages of [seg.Base+off, +size), from
	// the start, and returns the bytes it did unmap (all of them unless it
	// fails), which are then recorded as unmapped: memory that may be gone
	// is never handed out.
	Unmap(seg *Segment, off, size uint64) (uint64, error)
	// Free gives back the address range of seg, which has nothing mapped.
	Free(seg *Segment) error
	// Lend takes the physical memory of the pages of [seg.Base+off, +size)
	// for a mapping elsewhere (stitching); their old mapping stays until
	// the owner unmaps it (Unlend).
	Lend(seg *Segment, off, size uint64)
}

// ErrFraction is MapExpandable's answer when mapping would exceed the
// memory fraction.
var ErrFraction = errors.New("pools: the memory fraction does not allow mapping more")

// AddExpandable records a new reserved range of size bytes at base for r's
// pool and stream, mapped in pages of page bytes by physical allocations
// of at most chunk bytes (a multiple of page), and returns its one
// (unmapped) block, a candidate for MapExpandable.
func (c *Cache) AddExpandable(r *Request, base cuda.Ptr, size, page, chunk uint64) *Block {
	seg := &Segment{Base: base, Size: size, Stream: r.Stream, Pool: r.Pool,
		Expandable: true, PageSize: page, ChunkSize: max(chunk, page)}
	b := c.newBlock()
	b.Ptr, b.Size, b.Stream, b.Pool, b.Seg, b.Unmapped = base, size, r.Stream, r.Pool, seg, true
	seg.Head = b
	c.segments[base] = seg
	r.Pool.Segments++
	r.Pool.Unmapped.Insert(b)
	r.Pool.releasable = true
	return b
}

// allocatable reports whether b is free, mapped or not (a lent block is
// neither).
func allocatable(b *Block) bool { return b != nil && !b.Active() && !b.Lent }

// FindExpandable returns the start of a run of free and unmapped blocks on
// r's stream, in r's pool, that contains an unmapped block and spans
// r.Size, or nil. LowestRun takes the lowest-addressed such run;
// LeastGrowth the one whose first r.Size bytes take the fewest new pages
// (the most free mapped memory), ties to the lower address.
func (c *Cache) FindExpandable(r *Request, choice RunChoice) *Block {
	p := r.Pool
	var best *Block
	bestNeed := ^uint64(0) // LowestRun leaves it so: no bound
	for u := p.Unmapped.LowerBound(r.Stream, 0); u != nil && u.Stream == r.Stream; u = p.Unmapped.After(u) {
		start := u
		if allocatable(u.Prev) {
			start = u.Prev
		}
		if choice == LowestRun && best != nil && best.Ptr <= start.Ptr {
			continue
		}
		// need: the new pages (in bytes) that the run's first r.Size
		// take. A run that needs more than best already is left at once,
		// so each candidate's walk stays short.
		var n, need uint64
		for b := start; n < r.Size && allocatable(b) && need <= bestNeed; b = b.Next {
			if b.Unmapped {
				need += min(b.Size, r.Size-n)
			}
			n += b.Size
		}
		need = roundUp(need, start.Seg.PageSize)
		// (The set is in size order: ties compare addresses.)
		if n >= r.Size && (need < bestNeed || need == bestNeed && start.Ptr < best.Ptr) {
			best = start
			if choice == LeastGrowth {
				bestNeed = need
			}
		}
	}
	return best
}

// RunNeed is LeastGrowth's measure of the run at start (FindExpandable's
// answer): the new pages, in bytes, that r's first r.Size bytes take there.
func RunNeed(r *Request, start *Block) uint64 {
	var n, need uint64
	for b := start; n < r.Size && allocatable(b); b = b.Next {
		if b.Unmapped {
			need += min(b.Size, r.Size-n)
		}
		n += b.Size
	}
	return roundUp(need, start.Seg.PageSize)
}

// RunChoice is FindExpandable's rule among the runs that can hold a
// request (see the design note).
type RunChoice int

const (
	// LowestRun takes the lowest-addressed run: PyTorch's expandable
	// segments grow at the end of their one range.
	LowestRun RunChoice = iota
	// LeastGrowth takes the run that needs the fewest new pages.
	LeastGrowth
)

// MapExpandable maps pages at the start of the run that FindExpandable (or
// AddExpandable) returned until one free block covers r, and returns that
// block, out of the free set and ready for Allocate. Each unmapped block is
// mapped in one Mapper call of at least unit bytes where it has room (the
// mapping unit: fewer, larger calls; see vmem/space.go), so up
// to unit bytes beyond the request may end up mapped and free. On an
// error (the Mapper's, or ErrFraction) the pages mapped so far stay mapped
// as free blocks.
func (c *Cache) MapExpandable(r *Request, start *Block, m Mapper, unit uint64) (*Block, error) {
	b := start
	if b.Unmapped {
		var err error
		if b, err = c.mapAhead(b, r.Size, unit, m); err != nil {
			return nil, err
		}
	}
	for b.Size < r.Size {
		// The run alternates: b (free, mapped) is followed by an unmapped
		// block, which mapBlock maps and merges into b.
		next := b.Next
		var err error
		if b, err = c.mapAhead(next, r.Size-b.Size, unit, m); err != nil {
			return nil, err
		}
	}
	b.Pool.Blocks.Remove(b)
	return b, nil
}

// mapAhead maps the first need bytes of the unmapped block u, and more up
// to the mapping unit where the memory fraction and the driver allow it.
func (c *Cache) mapAhead(u *Block, need, unit uint64, m Mapper) (*Block, error) {
	need = min(u.Size, need)
	page := u.Seg.PageSize
	if ahead := growSize(u, need, unit); ahead > roundUp(need, page) && c.CanGrow(ahead) {
		b, done, err := c.mapBlock(u, ahead, m)
		switch {
		case err == nil:
			return b, nil
		case done > 0 && errors.Is(err, cuda.ErrOutOfMemory):
			// Part mapped (the Mapper's spare pages): u is now the free
			// block holding them; the caller maps what is still missing.
			return u, nil
		case done > 0 || !errors.Is(err, cuda.ErrOutOfMemory):
			return nil, err
		}
		// Nothing mapped for lack of memory: map only what is needed.
	}
	b, _, err := c.mapBlock(u, need, m)
	return b, err
}

// growSize is how much of the unmapped block u to map when need bytes are
// missing: need, or the mapping unit if larger, within u, in whole pages,
// or in whole chunks where the segment asks for them (WholeChunks).
func growSize(u *Block, need, unit uint64) uint64 {
	g := u.Seg.PageSize
	if u.Seg.WholeChunks {
		g = u.Seg.ChunkSize
	}
	return min(u.Size, roundUp(max(need, unit), g))
}

// GrowthNeed is the bytes MapExpandable(r, start, _, unit) would map: what
// stitching tries to find in free pages elsewhere first.
func (c *Cache) GrowthNeed(r *Request, start *Block, unit uint64) uint64 {
	var n, covered uint64
	for b := start; b != nil && covered < r.Size; b = b.Next {
		if !b.Unmapped {
			covered += b.Size
			continue
		}
		k := growSize(b, r.Size-covered, unit)
		n += k
		covered += k
	}
	return n
}

// mapBlock maps the first size bytes (rounded up to pages) of the unmapped
// block u and returns the free mapped block that contains them after merging
// with its free mapped neighbours, and the bytes mapped. What the Mapper
// mapped before failing is recorded all the same.
func (c *Cache) mapBlock(u *Block, size uint64, m Mapper) (*Block, uint64, error) {
	seg := u.Seg
	size = roundUp(size, seg.PageSize)
	if !c.CanGrow(size) {
		return nil, 0, ErrFraction
	}
	done, err := m.Map(seg, uint64(u.Ptr-seg.Base), size)
	if done > 0 {
		u = c.recordMapped(u, done)
	}
	if err != nil {
		return nil, done, err
	}
	return u, done, nil
}

// recordMapped turns the first size bytes of the unmapped block u into a
// free mapped block, merged with its free mapped neighbours, and returns it.
func (c *Cache) recordMapped(u *Block, size uint64) *Block {
	seg := u.Seg
	p := u.Pool
	p.Unmapped.Remove(u)
	if size < u.Size {
		rest := c.newBlock()
		rest.Ptr, rest.Size, rest.Stream, rest.Pool, rest.Seg, rest.Unmapped = u.Ptr+cuda.Ptr(size), u.Size-size, u.Stream, p, seg, true
		rest.Prev, rest.Next = u, u.Next
		if u.Next != nil {
			u.Next.Prev = rest
		}
		u.Next = rest
		u.Size = size
		p.Unmapped.Insert(rest)
		p.releasable = true
	}
	u.Unmapped = false
	// Fresh pages carry no work: the merged block has been free since its
	// mapped neighbours were.
	var freedAt uint64
	for _, n := range [2]*Block{u.Prev, u.Next} {
		if n != nil && !n.Unmapped && !n.Active() {
			freedAt = max(freedAt, n.FreedAt)
		}
	}
	c.tryMerge(u, u.Prev)
	c.tryMerge(u, u.Next)
	c.insertFree(u)
	u.FreedAt = freedAt
	seg.Mapped += size
	c.Reserved += size
	c.Stats.ReservedBytes.Increase(p.Small, int64(size))
	c.Stats.NumDeviceAlloc++
	return u
}

// preferInterior is best fit's rule in expandable segments: b fits, but if
// it is the growing end of its segment (followed by unmapped space), a
// later block of the stream that fits and could grow less is taken instead.
func preferInterior(p *BlockPool, b *Block) *Block {
	for n := p.Blocks.After(b); b.Seg.Expandable && n != nil && n.Stream == b.Stream &&
		expandableSize(n) < expandableSize(b); n = p.Blocks.After(n) {
		b = n
	}
	return b
}

// expandableSize is the size b could grow to by mapping what follows it.
func expandableSize(b *Block) uint64 {
	if b.Next != nil && b.Next.Unmapped {
		return b.Size + b.Next.Size
	}
	return b.Size
}

// UnmapFree unmaps the whole pages of every free mapped block of p's
// expandable segments and gives back the address ranges of the segments left
// with nothing mapped. Never during a capture.
func (c *Cache) UnmapFree(p *BlockPool, m Mapper) error {
	var free []*Block
	p.Blocks.Ascend(func(b *Block) bool {
		if b.Seg.Expandable {
			free = append(free, b)
		}
		return true
	})
	for _, b := range free {
		if err := c.unmapBlock(b, m); err != nil {
			return err
		}
	}
	var empty []*Block
	p.Unmapped.Ascend(func(b *Block) bool {
		if !b.IsSplit() {
			empty = append(empty, b)
		}
		return true
	})
	for _, b := range empty {
		if err := m.Free(b.Seg); err != nil {
			return err
		}
		p.Unmapped.Remove(b)
		p.Segments--
		delete(c.segments, b.Seg.Base)
		c.putBlock(b)
	}
	return nil
}

// TrimUnused unmaps the whole pages of p's free expandable blocks that lie
// above their segment's UsedEnd: mapped ahead (the mapping unit) and never
// handed out, so no work, captured or not, has touched them. The owner
// calls it when a capture into p ends, so that mapping ahead costs the
// graph's pool no memory; never while a capture is under way.
func (c *Cache) TrimUnused(p *BlockPool, m Mapper) error {
	var ds []Donor
	p.Blocks.Ascend(func(b *Block) bool {
		if s := b.Seg; s.Expandable && b.End() > s.UsedEnd {
			lo, hi := wholePages(b)
			lo = s.chunkAfter(max(lo, roundUp(uint64(max(s.UsedEnd, s.Base)-s.Base), s.PageSize)), hi)
			if hi > lo {
				ds = append(ds, Donor{B: b, Lo: lo, Hi: hi})
			}
		}
		return true
	})
	for _, d := range ds {
		if err := c.unmapRange(d.B, d.Lo, d.Hi, m, false); err != nil {
			return err
		}
	}
	return nil
}

// HasUnmappable reports whether UnmapFree(p) would unmap anything: a free
// block of an expandable segment with a whole page inside.
func (c *Cache) HasUnmappable(p *BlockPool) bool {
	found := false
	p.Blocks.Ascend(func(b *Block) bool {
		if b.Seg.Expandable {
			lo, hi := wholePages(b)
			found = hi > lo
		}
		return !found
	})
	return found
}

// unmapBlock unmaps the whole pages inside the free mapped block b, leaving
// the partial pages at its ends as free mapped blocks.
func (c *Cache) unmapBlock(b *Block, m Mapper) error {
	lo, hi := wholePages(b)
	if hi <= lo {
		return nil
	}
	return c.unmapRange(b, lo, hi, m, false)
}

// wholePages returns the offsets in b's segment of the whole physical
// allocations (chunks) inside b: [lo, hi), empty when hi <= lo. Only they
// can be unmapped and released: cuMemUnmap takes whole mappings.
func wholePages(b *Block) (lo, hi uint64) {
	seg := b.Seg
	lo = roundUp(uint64(b.Ptr-seg.Base), seg.PageSize)
	hi = uint64(b.End()-seg.Base) / seg.PageSize * seg.PageSize
	lo = seg.chunkAfter(lo, hi)
	for hi > lo && !seg.ChunkBoundary(hi) {
		hi -= seg.PageSize
	}
	return lo, hi
}

// chunkAfter is the first chunk boundary at or after the page offset lo,
// or hi if there is none before it.
func (s *Segment) chunkAfter(lo, hi uint64) uint64 {
	for lo < hi && !s.ChunkBoundary(lo) {
		lo += s.PageSize
	}
	return min(lo, hi)
}

// ChunkAt is the size of the physical allocation mapped at the page
// offset o of s (the run of pages holding its handle), or one page where
// nothing is mapped.
func (s *Segment) ChunkAt(o uint64) uint64 {
	i := o / s.PageSize
	h := s.Page(i)
	j := i + 1
	for h != 0 && j < uint64(len(s.pages)) && s.pages[j] == h {
		j++
	}
	return (j - i) * s.PageSize
}

// ChunkBoundary reports whether the page offset o of s separates two
// physical allocations (or an allocation from unmapped space, or lies at
// an end of the range): pages of one chunk hold the same handle, and no
// handle backs two places of a segment.
func (s *Segment) ChunkBoundary(o uint64) bool {
	i := o / s.PageSize
	if i == 0 || i >= s.PageCount() {
		return true
	}
	return s.Page(i) == 0 || s.Page(i-1) != s.Page(i)
}

// unmapRange unmaps the pages [lo, hi) (offsets in its segment, whole
// pages inside it) of the free mapped block b, or lends them (Mapper.Lend),
// which leaves b as the lent block; what lies before and after stays
// mapped as free blocks.
func (c *Cache) unmapRange(b *Block, lo, hi uint64, m Mapper, lend bool) error {
	seg := b.Seg
	var done uint64
	var err error
	if lend {
		m.Lend(seg, lo, hi-lo)
		done = hi - lo
	} else if done, err = m.Unmap(seg, lo, hi-lo); done == 0 {
		return err
	}
	hi = lo + done
	p := b.Pool
	p.Blocks.Remove(b)
	if start := seg.Base + cuda.Ptr(lo); b.Ptr < start {
		before := c.newBlock()
		before.Ptr, before.Size, before.Stream, before.Pool, before.Seg = b.Ptr, uint64(start-b.Ptr), b.Stream, p, seg
		before.Prev, before.Next = b.Prev, b
		if b.Prev != nil {
			b.Prev.Next = before
		} else {
			seg.Head = before
		}
		b.Prev = before
		b.Ptr, b.Size = start, b.Size-before.Size
		c.insertFree(before)
		before.FreedAt = b.FreedAt // free all along
	}
	if end := seg.Base + cuda.Ptr(hi); end < b.End() {
		after := c.newBlock()
		after.Ptr, after.Size, after.Stream, after.Pool, after.Seg = end, uint64(b.End()-end), b.Stream, p, seg
		after.Prev, after.Next = b, b.Next
		if b.Next != nil {
			b.Next.Prev = after
		}
		b.Next = after
		b.Size -= after.Size
		c.insertFree(after)
		after.FreedAt = b.FreedAt
	}
	b.Unmapped = true
	n := hi - lo
	seg.Mapped -= n
	c.Reserved -= n
	c.Stats.ReservedBytes.Decrease(p.Small, int64(n))
	if lend {
		b.Lent = true
		return nil
	}
	c.tryMerge(b, b.Prev)
	c.tryMerge(b, b.Next)
	p.Unmapped.Insert(b)
	p.releasable = true
	c.Stats.NumDeviceFree++
	return err
}

// MappedRun returns the contiguous mapped range of an expandable segment
// that contains p (what a snapshot shows as one segment), or false if p is
// in no mapped block.
func (c *Cache) MappedRun(seg *Segment, p cuda.Ptr) (cuda.Ptr, uint64, bool) {
	for b := seg.Head; b != nil; b = b.Next {
		if b.Unmapped || p < b.Ptr || p >= b.End() {
			continue
		}
		first, last := b, b
		for first.Prev != nil && !first.Prev.Unmapped {
			first = first.Prev
		}
		for last.Next != nil && !last.Next.Unmapped {
			last = last.Next
		}
		return first.Ptr, uint64(last.End() - first.Ptr), true
	}
	return 0, 0, false
}
