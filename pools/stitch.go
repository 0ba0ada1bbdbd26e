// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"cmp"

	"github.com/cudapool/cudapool/cuda"
)

// Stitching (on by default): the blocks' side of the policy in
// vmem/stitch.go.
//
// # Design
//
// With expandable segments, a miss maps fresh physical pages at the end of
// the request's range while whole free pages may sit idle in holes of other
// ranges (other streams, the small pool, interior holes of the same range)
// that no request of the right stream and size can use. Stitching moves
// such pages: Donors picks whole pages inside free mapped blocks, the owner
// unmaps them keeping their physical handles (UnmapDonor: the blocks'
// bookkeeping is that of UnmapFree), and the growth that follows maps those
// handles where the request needs them before creating any new memory. The
// bytes reserved do not change; the hole becomes unmapped address space.
//
// Which pages may move is the owner's decision (the kind function): a page
// may still be read or written by work queued on its stream before its
// block was freed. Blocks carry FreedAt, the Cache's Clock when they last
// became free; the owner records a marker event on a stream right after
// Tick and, once it has completed, knows that every block of that stream
// with FreedAt below the tick is idle: its pages can be unmapped now. A
// page of the request's own stream need not be idle, since work on the new
// block is queued after the old work: it is lent instead (the physical
// memory is mapped at the new place while the old mapping stays, the block
// Lent, neither free nor mappable) until the owner can unmap the old
// mapping (Unlend).
//
// Donors are taken smallest block first (the holes least likely to be
// reused whole), from the end of each block (so a free tail before unmapped
// space extends that space instead of opening a hole).
//
// Donors come only from ranges whose physical allocations are the growing
// range's size (Segment.ChunkSize): one page, as the owner maps the default
// pools' ranges when stitching is on (vmem/space.go says why), or the
// default large pool's stitch_chunk_mb.

// Donor is whole pages [Lo, Hi) (offsets in its segment) of a free mapped
// block to unmap for stitching, or, if Lend, to lend: their memory is mapped
// elsewhere at once, and their old mapping stays (the block Lent) until the
// owner unmaps it and calls Unlend.
type Donor struct {
	B      *Block
	Lo, Hi uint64
	Lend   bool
}

// DonorKind is the owner's verdict on a free block: not a donor, a donor
// whose pages can be unmapped now, or one whose pages may be lent.
type DonorKind int8

const (
	NoDonor DonorKind = iota
	DonorUnmap
	DonorLend
)

// Tick advances the clock that FreedAt stamps and returns its new value:
// every block free now has FreedAt below it.
func (c *Cache) Tick() uint64 {
	c.clock++
	return c.clock
}

// Donors appends to out whole pages of p's free expandable blocks that
// kind accepts, up to want bytes in all, and returns out, their bytes, and
// the bytes of whole pages in the blocks kind refused (NoDonor) on the way.
// skip excludes [skipLo, skipHi) of segment skip (the run the request will
// grow into); only segments of skip's chunk size give pages, whole chunks.
func (c *Cache) Donors(p *BlockPool, want uint64, kind func(*Block) DonorKind, skip *Segment, skipLo, skipHi uint64, out []Donor) (_ []Donor, got, refused uint64) {
	var need uint64 // the donors' chunk size: skip's, or one page
	if skip != nil {
		need = skip.ChunkSize
	}
	if p.Tag != 0 {
		// A tag's pages stay in its ranges, so that pausing it gives back
		// its memory and no other's (paused.go): never a donor.
		return out, 0, 0
	}
	p.Blocks.Ascend(func(b *Block) bool {
		if got >= want {
			return false
		}
		chunk := cmp.Or(need, b.Seg.PageSize)
		if !b.Seg.Expandable || b.Seg.ChunkSize != chunk {
			// Only ranges mapped in the growing range's chunk size give
			// pages (the owner's stitching ranges: one page, or
			// stitch_chunk_mb; a range made before stitching was turned
			// on gives its chunks to ranges of its size only), so that
			// moves never mix sizes in a range (CUDA IPC's handle needs
			// one size).
			return true
		}
		lo, hi := wholePages(b)
		if hi <= lo || b.Seg == skip && lo < skipHi && hi > skipLo || !b.Seg.uniform(lo, hi, chunk) {
			return true
		}
		k := kind(b)
		if k == NoDonor {
			refused += hi - lo
			return true
		}
		if n := hi - lo; n > want-got {
			lo = b.Seg.chunkAfter(hi-roundUp(want-got, chunk), hi)
		}
		out = append(out, Donor{b, lo, hi, k == DonorLend})
		got += hi - lo
		return true
	})
	return out, got, refused
}

// uniform reports whether [lo, hi) of s holds physical allocations of
// chunk bytes only (the owner unmaps and restores a lent block chunk by
// chunk). A range mapped page by page always does.
func (s *Segment) uniform(lo, hi, chunk uint64) bool {
	if chunk == s.PageSize {
		return true
	}
	for o := lo; o < hi; o += chunk {
		if s.ChunkAt(o) != chunk {
			return false
		}
	}
	return true
}

// UnmapDonor unmaps d's pages through m (which keeps their physical
// memory for the growth that follows) and records them as unmapped. It
// returns the bytes unmapped. The donors of one Donors call stay valid
// across UnmapDonor calls: a free mapped block's neighbours are allocated
// or unmapped, so unmapping merges only unmapped blocks.
func (c *Cache) UnmapDonor(d Donor, m Mapper) (uint64, error) {
	mapped := d.B.Seg.Mapped
	err := c.unmapRange(d.B, d.Lo, d.Hi, m, d.Lend)
	return mapped - d.B.Seg.Mapped, err
}

// Clock is the clock's value now (see Tick).
func (c *Cache) Clock() uint64 { return c.clock }

// Unlend makes the lent block b, whose old mapping the owner has unmapped,
// an ordinary unmapped block again, merged with its unmapped neighbours.
func (c *Cache) Unlend(b *Block) {
	if !b.Lent {
		panic("pools: Unlend of a block that is not lent")
	}
	b.Lent = false
	c.tryMerge(b, b.Prev)
	c.tryMerge(b, b.Next)
	b.Pool.Unmapped.Insert(b)
	b.Pool.releasable = true
	c.Stats.NumDeviceFree++
}

// Restore gives the first size bytes (whole pages) of the lent block b back
// to its pool as a free mapped block, merged with its free mapped
// neighbours: their physical memory was taken for a growth that did not
// use it (it failed, or needed less than stitching foresaw), and their old
// mapping, which never went, still holds it. It returns what stays lent
// (the rest of b), or nil. The restored block keeps b's FreedAt: work
// queued before b became free may still use it.
func (c *Cache) Restore(b *Block, size uint64) *Block {
	if !b.Lent || size == 0 || size > b.Size {
		panic("pools: Restore of a block that is not lent, or of more than it holds")
	}
	seg, p := b.Seg, b.Pool
	var rest *Block
	if size < b.Size {
		rest = c.newBlock()
		rest.Ptr, rest.Size, rest.Stream, rest.Pool, rest.Seg = b.Ptr+cuda.Ptr(size), b.Size-size, b.Stream, p, seg
		rest.Unmapped, rest.Lent, rest.FreedAt = true, true, b.FreedAt
		rest.Prev, rest.Next = b, b.Next
		if b.Next != nil {
			b.Next.Prev = rest
		}
		b.Next = rest
		b.Size = size
	}
	b.Lent, b.Unmapped = false, false
	freedAt := b.FreedAt
	for _, n := range [2]*Block{b.Prev, b.Next} {
		if n != nil && n.inSet && !n.Unmapped {
			freedAt = max(freedAt, n.FreedAt)
		}
	}
	c.tryMerge(b, b.Prev)
	c.tryMerge(b, b.Next)
	c.insertFree(b)
	b.FreedAt = freedAt
	seg.Mapped += size
	c.Reserved += size
	c.Stats.ReservedBytes.Increase(p.Small, int64(size))
	return rest
}
