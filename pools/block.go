// SPDX-License-Identifier: Apache-2.0

// Package pools holds the caching allocator's data and policy: blocks and
// segments, the free-block sets, size rounding, the small and large pools,
// splitting and merging, the max_split_size rules, garbage collection and the
// memory fraction, and PyTorch's statistics.
//
// # Design
//
// A segment is one driver allocation, or, with expandable segments, one
// reserved address range mapped page by page (expandable.go). It is tiled,
// without gaps, by a doubly linked list of blocks (Prev/Next). A block is in
// exactly one of these states:
//
//	allocated      handed to the user; indexed by address in Cache.active
//	awaiting free  freed by the user but still used by other streams
//	               (EventCount > 0 or Uses not empty); in no index
//	free           in its BlockPool's free set, ordered by (stream, size,
//	               address), so best fit on a stream is a lower-bound search
//	unmapped       (expandable segments only) address space with no memory
//	               behind it, in its BlockPool's Unmapped set; or lent
//	               (Lent): its memory was moved by stitching while its old
//	               mapping waits to be unmapped, in no set
//
// Adjacent free blocks of one segment are merged at once, so two neighbours
// are never both free. A block is reused only by the stream it was allocated
// on; other streams' uses delay its return through events (package events).
//
// Nothing here calls CUDA. Where a policy ends in giving memory back to the
// driver (release of cached blocks, garbage collection), the caller passes the
// function that does it; the allocator package supplies the driver calls, the
// order of the retries and the locking. Cache is not safe for concurrent use:
// its owner holds one lock around every call.
//
// The cache-hit path (TakeFree, Allocate, Lookup, Release, Return) allocates
// no Go memory: blocks are recycled through a free list, the free sets are
// intrusive, and the address index is an open-addressing table that only
// grows when the number of live blocks reaches a new high.
package pools

import "github.com/cudapool/cudapool/cuda"

// PoolID names a memory pool the way PyTorch's MempoolId_t does: {0,0} is the
// default pool, {n,0} a graph's private pool, {0,n} a user pool.
type PoolID struct{ A, B uint64 }

// IsDefault reports whether id is the default pool {0,0}.
func (id PoolID) IsDefault() bool { return id.A == 0 && id.B == 0 }

// Segment is one allocation from the driver, or one expandable segment (a
// reserved address range that is mapped page by page; see expandable.go).
type Segment struct {
	Base   cuda.Ptr
	Size   uint64      // bytes allocated; for an expandable segment, reserved
	Stream cuda.Stream // the stream the segment was allocated for
	Pool   *BlockPool  // the pool its free blocks return to
	Head   *Block      // the block at Base

	// Expandable marks a reserved range whose blocks are mapped or not
	// (Block.Unmapped); Mapped is the bytes mapped, PageSize the unit of
	// mapping. pages is the owner's record of the physical allocation
	// behind each page (index (addr-Base)/PageSize, 0 where unmapped: Page
	// and SetPage); the Mapper fills and empties it. It grows with the
	// highest page mapped, not with the reservation: a range reserves up to
	// the device's capacity and more, mostly never mapped, and a CUDA graph
	// capture makes two ranges. One
	// physical allocation (a chunk) may back several consecutive pages,
	// which then hold the same handle: ChunkSize (a multiple of PageSize)
	// is the most one chunk may cover, and chunks are unmapped only whole
	// (see expandable.go).
	Expandable bool
	PageSize   uint64
	ChunkSize  uint64
	Mapped     uint64
	pages      []cuda.MemHandle
	// WholeChunks makes growth map whole chunks where there is room (and
	// just the pages needed where there is not), so that the segment's
	// physical allocations are all ChunkSize: the owner asks for it where
	// memory may be shared with other processes, whose handle describes
	// allocations of one size (vmem/export.go).
	WholeChunks bool
	// UsedEnd is the end of the highest block ever handed out in an
	// expandable segment: memory above it was mapped but never used
	// (TrimUnused).
	UsedEnd cuda.Ptr
	// Paused lists the chunks of an expandable segment whose physical
	// memory a pause released while their blocks stayed (paused.go), in
	// address order; PausedBytes is their sum, left out of Reserved.
	Paused      []Chunk
	PausedBytes uint64

	// Context is the owner's opaque id of the caller's context (stack)
	// when the segment was allocated, or its first page mapped; 0: none.
	Context uint64
}

// PageCount is the number of pages of an expandable segment.
func (s *Segment) PageCount() uint64 { return s.Size / s.PageSize }

// Page returns the handle of the physical allocation behind page i of an
// expandable segment, 0 where it is unmapped.
func (s *Segment) Page(i uint64) cuda.MemHandle {
	if i < uint64(len(s.pages)) {
		return s.pages[i]
	}
	return 0
}

// SetPage records h (0: unmapped) as the allocation behind page i, growing
// the record (at least doubling it) when i lies beyond it.
func (s *Segment) SetPage(i uint64, h cuda.MemHandle) {
	if i >= uint64(len(s.pages)) {
		if h == 0 {
			return
		}
		n := min(max(i+1, 2*uint64(len(s.pages)), 64), s.PageCount())
		grown := make([]cuda.MemHandle, n)
		copy(grown, s.pages)
		s.pages = grown
	}
	s.pages[i] = h
}

// SetChunk records h (0: unmapped) as the allocation behind the pages of
// [off, off+size) (one chunk: its pages hold the same handle).
func (s *Segment) SetChunk(off, size uint64, h cuda.MemHandle) {
	for i := off / s.PageSize; i < (off+size)/s.PageSize; i++ {
		s.SetPage(i, h)
	}
}

// Block is a piece of a segment. The fields are guarded by the lock of the
// Cache that owns the block.
type Block struct {
	// The free-set key and links come first so that a tree search touches
	// one cache line per node. The treaps (the whole-pool treap and each
	// segfit bin) use left/right/prio; the sorted slice none of them.
	Ptr         cuda.Ptr
	Size        uint64
	Stream      cuda.Stream
	left, right *Block
	prio        uint64
	inSet       bool

	Allocated bool
	// Held marks an allocated block that waits in a front cache across
	// calls: the user freed it and the statistics count it free
	// (CountFrontHold) until its reuse or release (ReleaseWaiting).
	Held bool
	// Unmapped marks a block of an expandable segment with no memory
	// behind it: it is in its pool's Unmapped set, not in Blocks.
	Unmapped bool
	// Lent marks an unmapped block whose pages' physical memory stitching
	// mapped in another range while their old mapping waits to be
	// unmapped (pools/stitch.go): in no set, neither free nor mappable
	// until Unlend.
	Lent bool
	// Shared marks an allocated block the allocator exported to another
	// process (CUDA IPC): its memory may be in use there until the block
	// is freed (Release clears it).
	Shared    bool
	Requested uint64 // the size the user asked for (allocated blocks)
	Context   uint64 // opaque id of the caller's context (stack) when allocated; 0: none
	Pool      *BlockPool
	Seg       *Segment
	Prev      *Block // neighbours in the segment, by address
	Next      *Block
	// EventCount is the number of recorded events that must complete before
	// the block returns to its pool (package events).
	EventCount int
	// Uses are the streams other than Stream that used the block
	// (record_stream).
	Uses StreamSet

	gcBase uint64 // Pool.freeCalls when the block became free
	// FreedAt is the Cache's Clock when the block last became free (a free
	// block's every byte has been free since then): stitching (stitch.go)
	// compares it with the clock at which a stream's marker event was
	// recorded.
	FreedAt uint64
}

// IsSplit reports whether the block shares its segment with other blocks.
func (b *Block) IsSplit() bool { return b.Prev != nil || b.Next != nil }

// wholeSegment reports whether b is all of an ordinary segment, which can be
// given back to the driver in one free. Expandable segments give memory back
// page by page instead (UnmapFree).
func (b *Block) wholeSegment() bool { return !b.IsSplit() && !b.Seg.Expandable }

// Active reports whether the block is allocated or awaiting its free.
func (b *Block) Active() bool { return b.Allocated || b.EventCount > 0 || !b.Uses.Empty() }

// End is the first address after the block.
func (b *Block) End() cuda.Ptr { return b.Ptr + cuda.Ptr(b.Size) }

// StreamSet is a small set of streams, stored inline for the common case of
// one or two side streams so that record_stream rarely allocates.
type StreamSet struct {
	inline [2]cuda.Stream
	n      int
	more   []cuda.Stream
}

// Add inserts s if it is not present.
func (s *StreamSet) Add(st cuda.Stream) {
	if s.Has(st) {
		return
	}
	if s.n < len(s.inline) {
		s.inline[s.n] = st
		s.n++
		return
	}
	s.more = append(s.more, st)
}

// Has reports whether st is in the set.
func (s *StreamSet) Has(st cuda.Stream) bool {
	for i := 0; i < s.n; i++ {
		if s.inline[i] == st {
			return true
		}
	}
	for _, x := range s.more {
		if x == st {
			return true
		}
	}
	return false
}

// Len is the number of streams in the set.
func (s *StreamSet) Len() int { return s.n + len(s.more) }

// Empty reports whether the set is empty.
func (s *StreamSet) Empty() bool { return s.n == 0 }

// Each calls fn for every stream in the set.
func (s *StreamSet) Each(fn func(cuda.Stream)) {
	for i := 0; i < s.n; i++ {
		fn(s.inline[i])
	}
	for _, x := range s.more {
		fn(x)
	}
}

// Clear empties the set, keeping any overflow storage for reuse.
func (s *StreamSet) Clear() {
	s.n = 0
	s.inline = [2]cuda.Stream{}
	s.more = s.more[:0]
}
