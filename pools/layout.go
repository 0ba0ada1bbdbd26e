// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"fmt"
	"sort"

	"github.com/cudapool/cudapool/cuda"
)

// Saved layouts: the block-level half of private-pool checkpoints.
//
// # Design
//
// CUDA graph trees (torch.compile's "reduce-overhead" mode) record graphs
// one after another into one private pool. Replaying a graph creates tensors
// behind the allocator's back, so before recording a new graph after some
// replays, PyTorch puts the pool back in the state it had when the last
// replayed graph was recorded (getCheckpointState / setCheckpointPoolState):
// the blocks allocated then must be allocated again, at the same addresses,
// and everything else in the pool free, or the new capture would hand out
// memory that live tensors occupy.
//
// A SegmentState is one segment of such a state: every block in address
// order, and for the allocated ones the requested size and the caller's
// context. The owner takes it with SaveLayout and restores it in two steps:
// it first frees every block allocated in the pool (each then merges with
// its free neighbours, so every mapped run of a segment becomes one free
// block), then RestoreLayout carves each free block that holds saved
// allocated blocks into those blocks and the free gaps between them. The
// saved free blocks need nothing more: two free blocks are never
// neighbours in a layout, so they are exactly the gaps. Segments, and pages
// of expandable segments, added since the layout was saved stay free.
//
// PyTorch restores by allocating every saved block and freeing the free
// ones again, which counts allocations that never were (peaks, allocated
// and freed totals); the carve sets the statistics of the final layout
// directly, and Check() recounts them.
//
// A restore must not fail half way, so CheckLayout verifies first what it
// needs: no block of the pool waits for other streams' events (its free
// cannot complete now), no allocated block has other streams' uses (freeing
// it would wait for events), every saved segment still exists in the same
// half of the pool with the same stream and size (a segment may have been
// given back since, by an OOM retry or after a release), and every saved
// allocated block lies on memory that is mapped now.

// BlockState is one block of a saved layout.
type BlockState struct {
	Ptr       cuda.Ptr
	Size      uint64
	Allocated bool
	Unmapped  bool   // address space of an expandable segment with no memory
	Requested uint64 // allocated blocks: the size the user asked for
	Context   uint64 // allocated blocks: the caller's context id
}

// End is the first address after the block.
func (b *BlockState) End() cuda.Ptr { return b.Ptr + cuda.Ptr(b.Size) }

// SegmentState is one segment of a saved layout, its blocks in address
// order.
type SegmentState struct {
	Base       cuda.Ptr
	Size       uint64
	Stream     cuda.Stream
	Small      bool // in the small half of its pool
	Expandable bool
	Blocks     []BlockState
}

// PoolSegments returns the live segments whose blocks belong to one of ps,
// ordered by address.
func (c *Cache) PoolSegments(ps ...*BlockPool) []*Segment {
	var out []*Segment
	for _, s := range c.segments {
		for _, p := range ps {
			if s.Pool == p {
				out = append(out, s)
				break
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Base < out[j].Base })
	return out
}

// PoolAllocated returns the allocated blocks of the pools ps, ordered by
// address.
func (c *Cache) PoolAllocated(ps ...*BlockPool) []*Block {
	var out []*Block
	for _, s := range c.PoolSegments(ps...) {
		for b := s.Head; b != nil; b = b.Next {
			if b.Allocated {
				out = append(out, b)
			}
		}
	}
	return out
}

// awaiting reports whether b was freed by its user but waits for other
// streams' uses: it is neither allocated nor free.
func awaiting(b *Block) bool { return !b.Allocated && b.Active() }

func awaitingError(b *Block) error {
	return fmt.Errorf("block %#x (%d bytes) was freed but other streams may still use it (record_stream); its events must complete first", uintptr(b.Ptr), b.Size)
}

// SaveLayout returns the layout of the private pool made of small and
// large. It fails, saving nothing, if a block of the pool waits for other
// streams' events, as PyTorch's checkpoint does: the layout of such a block
// is about to change.
func (c *Cache) SaveLayout(small, large *BlockPool) ([]SegmentState, error) {
	segs := c.PoolSegments(small, large)
	out := make([]SegmentState, 0, len(segs))
	for _, s := range segs {
		st := SegmentState{Base: s.Base, Size: s.Size, Stream: s.Stream, Small: s.Pool.Small, Expandable: s.Expandable}
		for b := s.Head; b != nil; b = b.Next {
			if awaiting(b) {
				return nil, awaitingError(b)
			}
			bs := BlockState{Ptr: b.Ptr, Size: b.Size, Allocated: b.Allocated, Unmapped: b.Unmapped}
			if b.Allocated {
				bs.Requested, bs.Context = b.Requested, b.Context
			}
			st.Blocks = append(st.Blocks, bs)
		}
		out = append(out, st)
	}
	return out, nil
}

// CheckLayout reports why saved cannot be restored into the pool made of
// small and large once every block allocated in it is freed, or nil if it
// can (see the file comment).
func (c *Cache) CheckLayout(small, large *BlockPool, saved []SegmentState) error {
	for _, s := range c.PoolSegments(small, large) {
		for b := s.Head; b != nil; b = b.Next {
			switch {
			case awaiting(b):
				return awaitingError(b)
			case b.Allocated && !b.Uses.Empty():
				return fmt.Errorf("block %#x (%d bytes) is used by other streams (record_stream): freeing it for the restore would have to wait for their work", uintptr(b.Ptr), b.Size)
			}
		}
	}
	for i := range saved {
		ss := &saved[i]
		half := large
		if ss.Small {
			half = small
		}
		seg := c.segments[ss.Base]
		if seg == nil || seg.Pool != half || seg.Size != ss.Size || seg.Stream != ss.Stream || seg.Expandable != ss.Expandable {
			return fmt.Errorf("segment %#x (%d bytes) of the saved layout is no longer in the pool (given back since?)", uintptr(ss.Base), ss.Size)
		}
		b := seg.Head
		for j := range ss.Blocks {
			a := &ss.Blocks[j]
			if !a.Allocated {
				continue
			}
			for b != nil && b.End() <= a.Ptr {
				b = b.Next
			}
			for x := b; x != nil && x.Ptr < a.End(); x = x.Next {
				if x.Unmapped {
					return fmt.Errorf("block %#x (%d bytes) of the saved layout lies on unmapped memory now", uintptr(a.Ptr), a.Size)
				}
			}
		}
	}
	return nil
}

// RestoreLayout makes the saved allocated blocks allocated again, with
// their requested sizes and contexts, and returns them in address order.
// Every block of the pool must be free (the owner has freed the allocated
// ones) and CheckLayout must have accepted saved.
func (c *Cache) RestoreLayout(small, large *BlockPool, saved []SegmentState) []*Block {
	var out []*Block
	var allocs []BlockState
	for i := range saved {
		ss := &saved[i]
		seg := c.segments[ss.Base]
		allocs = allocs[:0]
		for _, bs := range ss.Blocks {
			if bs.Allocated {
				allocs = append(allocs, bs)
			}
		}
		k := 0
		for b := seg.Head; b != nil && k < len(allocs); {
			next := b.Next
			if b.Unmapped || allocs[k].Ptr >= b.End() {
				b = next
				continue
			}
			n := k
			for n < len(allocs) && allocs[n].Ptr < b.End() {
				n++
			}
			out = c.carve(b, allocs[k:n], out)
			k = n
			b = next
		}
		if k < len(allocs) {
			panic("pools: RestoreLayout of a layout that CheckLayout refuses")
		}
	}
	return out
}

// carve replaces the free block f by the allocated blocks allocs (in
// address order, inside f) and free blocks in the gaps, appends the
// allocated ones to out and returns it.
func (c *Cache) carve(f *Block, allocs []BlockState, out []*Block) []*Block {
	if f.Active() || !f.inSet || f.Unmapped {
		panic("pools: carving a block that is not free")
	}
	p, seg, stream := f.Pool, f.Seg, f.Stream
	small := p.Small
	// inactive_split leaves expandable segments out (see Allocate).
	counted := !seg.Expandable
	if counted && f.IsSplit() {
		c.hot.decrease(small, hInactiveSplit, 1)
		c.hot.decrease(small, hInactiveSplitBytes, int64(f.Size))
	}
	p.Blocks.Remove(f)
	start, end := f.Ptr, f.End()
	prev, next := f.Prev, f.Next

	// The pieces, f first; then the links; then the sets and statistics,
	// which need the final links (IsSplit).
	var pieces []*Block
	add := func(ptr cuda.Ptr, size uint64, st *BlockState) {
		b := f
		if len(pieces) > 0 {
			b = c.newBlock()
			b.Stream, b.Pool, b.Seg = stream, p, seg
		}
		b.Ptr, b.Size = ptr, size
		b.Allocated, b.Requested, b.Context = false, 0, 0
		if st != nil {
			b.Allocated, b.Requested, b.Context = true, st.Requested, st.Context
		}
		pieces = append(pieces, b)
	}
	at := start
	for i := range allocs {
		a := &allocs[i]
		if a.Ptr < at || a.End() > end {
			panic("pools: a saved block does not fit the free block carved for it")
		}
		if a.Ptr > at {
			add(at, uint64(a.Ptr-at), nil)
		}
		add(a.Ptr, a.Size, a)
		at = a.End()
	}
	if at < end {
		add(at, uint64(end-at), nil)
	}
	for i, b := range pieces {
		if i == 0 {
			b.Prev = prev // f's own place: prev.Next or seg.Head is f already
			continue
		}
		b.Prev = pieces[i-1]
		pieces[i-1].Next = b
	}
	last := pieces[len(pieces)-1]
	last.Next = next
	if next != nil {
		next.Prev = last
	}

	for _, b := range pieces {
		if !b.Allocated {
			c.insertFree(b)
			if counted && b.IsSplit() {
				c.hot.increase(small, hInactiveSplit, 1)
				c.hot.increase(small, hInactiveSplitBytes, int64(b.Size))
			}
			continue
		}
		c.countAllocated(b)
		out = append(out, b)
	}
	return out
}

// LargestFree returns the size of p's largest free (mapped) block, 0 if it
// has none.
func (c *Cache) LargestFree(p *BlockPool) uint64 {
	var largest uint64
	p.Blocks.Ascend(func(b *Block) bool {
		largest = max(largest, b.Size)
		return true
	})
	return largest
}
