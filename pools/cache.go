// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"fmt"
	"sort"

	"github.com/cudapool/cudapool/cuda"
)

// BlockPool is one set of free blocks: a device's default small or large
// pool, or one half of a private pool.
type BlockPool struct {
	Blocks FreeSet
	// Unmapped holds the unmapped blocks of the pool's expandable segments,
	// in the same order as Blocks.
	Unmapped FreeSet
	Small    bool
	// Tag is the tag whose memory the pool holds (0: none): the
	// allocator's (pause by tag), carried here so that every segment and
	// block names it. A tagged pool's segments are expandable ones.
	Tag uint32
	ID  PoolID
	// NoSplit (a MemPool made with no_split=True) hands out whole free
	// blocks: a block of this pool is never split, so each allocation
	// keeps a segment, or an expandable run, to itself.
	NoSplit bool
	// Segments is the number of live segments whose blocks belong here;
	// a private pool can be dropped once it reaches zero.
	Segments int
	// freeCalls counts best-fit searches, the clock by which garbage
	// collection measures a cached block's age.
	freeCalls uint64
	// releasable is false only when the pool holds nothing that
	// ReleasePool and UnmapFree give back: no whole free ordinary segment
	// and no free block of an expandable segment with a whole physical
	// allocation inside (in Blocks), no segment left with nothing mapped
	// (in Unmapped). Every insert into either set sets it (the only way
	// such a block gets there); MarkReleased clears it once both have run.
	// So empty_cache with nothing to give back skips the walks over every
	// free block, which on a cold cache cost more than the rest of the
	// call, and the allocator can tell at a glance (Releasable) that it
	// has nothing to do. Check verifies it.
	releasable bool
}

// Releasable reports whether p may hold something ReleasePool or
// UnmapFree would give back (false: certainly nothing).
func (p *BlockPool) Releasable() bool { return p.releasable }

// MarkReleased notes that ReleasePool and UnmapFree have both given back
// everything p held (the caller's release succeeded).
func (c *Cache) MarkReleased(p *BlockPool) { p.releasable = false }

// FreeFunc gives a whole segment back to the driver.
type FreeFunc func(base cuda.Ptr, size uint64) error

// Request is one malloc in progress.
type Request struct {
	Requested uint64      // bytes asked for
	Size      uint64      // rounded block size
	SegSize   uint64      // segment size if a new segment is needed
	Stream    cuda.Stream // the allocating stream
	Pool      *BlockPool
}

// Cache is one device's blocks, segments and statistics. See the package
// comment; the owner's lock guards every field and call.
//
// The fields a cache-hit malloc or free reads come first, together, so
// that they share cache lines (after an eviction each line is a miss): in
// the first 120 bytes, which are two lines wherever the object starts (Go
// puts an 8-byte header before objects of this size, so the struct starts 8
// bytes into a line), including cfg's MaxSplitSize and first
// RoundupDivisions entry (the one of every size below 2 MiB).
type Cache struct {
	Small  *BlockPool // the default pools
	Large  *BlockPool
	active ptrMap // allocated blocks by address
	// spare is a list of recycled Block structs linked through Next
	// (intrusive: taking one reads only the block itself); nSpare counts it.
	spare  *Block
	nSpare int
	// hot holds the statistics every allocation and free changes, in a
	// separate object that Go aligns to a cache line (stats.go).
	hot *hotStats
	// clock orders frees and stitching's marker events (Tick, FreedAt).
	clock uint64
	// allowed is the memory-fraction limit, fraction (below) the fraction
	// it was set from; fractionSet is false when there is no limit.
	fractionSet bool
	cfg         Config
	allowed     uint64
	// Stats are the other statistics. Read all of them through ReadStats.
	Stats ColdStats
	// Reserved is the bytes of all live segments (PyTorch's
	// total_allocated_memory), the quantity the memory fraction bounds.
	Reserved uint64
	fraction float64

	segments map[cuda.Ptr]*Segment // live segments by base address

	// newPools are empty block pools made ahead, of free sets of kind
	// newPoolsKind (NewPool).
	newPools     []*BlockPool
	newPoolsKind FreeSetKind
}

// ReadStats returns the statistics: ColdStats and the per-allocation
// statistics in one Stats (see stats.go). Every reader goes through it.
func (c *Cache) ReadStats() Stats {
	st := Stats{ColdStats: c.Stats}
	c.hot.fill(&st)
	return st
}

// ResetPeak sets every peak statistic to its current value.
func (c *Cache) ResetPeak() {
	c.Stats.resetPeak()
	c.hot.resetPeak()
}

// ResetAccumulated zeroes the accumulated statistics (the sums of increases
// and decreases, and the event counters).
func (c *Cache) ResetAccumulated() {
	c.Stats.resetAccumulated()
	c.hot.resetAccumulated()
}

// NewCache returns an empty cache with the given policy.
func NewCache(cfg Config) *Cache {
	c := &Cache{active: newPtrMap(1024), hot: new(hotStats), segments: make(map[cuda.Ptr]*Segment)}
	c.SetConfig(cfg)
	c.Small = c.NewPool(true, PoolID{})
	c.Large = c.NewPool(false, PoolID{})
	return c
}

// Config returns the policy in force.
func (c *Cache) Config() Config { return c.cfg }

// SetConfig changes the policy. Blocks already cached keep their sizes.
func (c *Cache) SetConfig(cfg Config) {
	c.cfg = cfg
	c.Stats.MaxSplitSize = -1
	if cfg.MaxSplitSize != Unlimited {
		c.Stats.MaxSplitSize = int64(cfg.MaxSplitSize)
	}
	// Blocks and segments are counted as oversize against the threshold in
	// force; recount under the new one so that their frees balance.
	allocs, segs := c.countOversize()
	adjust(&c.Stats.OversizeAllocations, allocs)
	adjust(&c.Stats.OversizeSegments, segs)
}

// countOversize counts the allocated blocks and the (ordinary) segments at
// or above max_split_size.
func (c *Cache) countOversize() (allocs, segs int64) {
	max := c.cfg.MaxSplitSize
	c.active.each(func(b *Block) {
		if b.Size >= max && !b.Held { // a held block's free was counted
			allocs++
		}
	})
	for _, s := range c.segments {
		if !s.Expandable && s.Size >= max {
			segs++
		}
	}
	return allocs, segs
}

// adjust moves st's current value to want through an increase or decrease.
func adjust(st *Stat, want int64) {
	if d := want - st.Current; d > 0 {
		st.Increase(d)
	} else if d < 0 {
		st.Decrease(-d)
	}
}

// poolBatch is how many block pools NewPool makes at a time. A capture's
// begin hook makes two, after the interpreter has made the caches cold, and
// Go's allocator then costs about a microsecond per object on the
// development box (six objects: 7 us of the hook's 15); from a batch the
// hook takes two pointers off a slice (docs/hot-path.md, "During graph
// captures").
const poolBatch = 16

// NewPool returns an empty block pool for a private pool.
func (c *Cache) NewPool(small bool, id PoolID) *BlockPool {
	if len(c.newPools) == 0 || c.newPoolsKind != c.cfg.FreeSet {
		c.makePools()
	}
	n := len(c.newPools) - 1
	p := c.newPools[n]
	c.newPools[n] = nil
	c.newPools = c.newPools[:n]
	p.Small, p.ID = small, id
	return p
}

// DropPool lets go of the free sets of p, a private pool's block pool with
// no segment left that its owner forgets: p lives on while any pool of its
// batch does, and an emptied segregated fit keeps its per-stream arrays.
func (c *Cache) DropPool(p *BlockPool) {
	if p.Segments != 0 || p.Blocks.Len() != 0 || p.Unmapped.Len() != 0 {
		panic("pools: dropping a block pool that holds memory")
	}
	p.Blocks, p.Unmapped = nil, nil
}

// makePools makes the next batch of empty block pools.
func (c *Cache) makePools() {
	ps := make([]BlockPool, poolBatch)
	sets := newFreeSets(c.cfg.FreeSet, 2*poolBatch)
	c.newPools = c.newPools[:0]
	for i := range ps {
		ps[i].Blocks, ps[i].Unmapped = sets[2*i], sets[2*i+1]
		c.newPools = append(c.newPools, &ps[i])
	}
	c.newPoolsKind = c.cfg.FreeSet
}

// SetFraction limits Reserved to fraction × total. Fraction must be in
// [0, 1]; 1 removes the limit, as in PyTorch (which then also leaves
// garbage collection off: it needs a limit).
func (c *Cache) SetFraction(fraction float64, total uint64) {
	c.allowed, c.fraction, c.fractionSet = 0, 0, false
	if fraction < 1 {
		c.allowed = uint64(fraction * float64(total))
		c.fraction, c.fractionSet = fraction, true
	}
}

// Fraction returns the memory fraction in force and whether one is set.
func (c *Cache) Fraction() (float64, bool) { return c.fraction, c.fractionSet }

// Allowed returns the memory-fraction limit and whether one is set.
func (c *Cache) Allowed() (uint64, bool) { return c.allowed, c.fractionSet }

// SetRequest rounds size, picks the pool among small and large, and writes
// the request into *r. It takes r by address because the allocator's malloc
// passes its request by address to TakeFree and Allocate: a returned Request
// would be built in temporaries and copied into r, and that copy's 16-byte
// loads of two 8-byte stores just made cannot take the stores' data
// (store-to-load forwarding fails): about 18% of the malloc's own samples
// on the C benchmark's mixed sizes (development box).
func (c *Cache) SetRequest(r *Request, size uint64, s cuda.Stream, small, large *BlockPool) {
	rounded := c.cfg.RoundSize(size)
	r.Pool = large
	if IsSmall(rounded) {
		r.Pool = small
	}
	r.Requested, r.Size, r.SegSize, r.Stream = size, rounded, c.cfg.SegmentSize(rounded), s
}

func (c *Cache) gcEnabled() bool { return c.fractionSet && c.cfg.GCThreshold > 0 }

// TakeFree removes and returns the best-fitting free block for r, or nil:
// the smallest block on r's stream that is large enough, subject to the
// max_split_size rules (an oversize block is not given to a request below
// max_split_size, nor a block more than MaxNonSplitRounding larger to one
// above it).
func (c *Cache) TakeFree(r *Request) *Block {
	p := r.Pool
	if c.gcEnabled() {
		p.freeCalls++
	}
	b := p.Blocks.LowerBound(r.Stream, r.Size)
	if b == nil || b.Stream != r.Stream {
		return nil
	}
	if b.Seg.Expandable {
		b = preferInterior(p, b)
	}
	if r.Size < c.cfg.MaxSplitSize && b.Size >= c.cfg.MaxSplitSize {
		return nil
	}
	if r.Size >= c.cfg.MaxSplitSize && b.Size >= r.Size+c.cfg.MaxNonSplitRounding {
		return nil
	}
	p.Blocks.Remove(b)
	return b
}

// CanGrow reports whether a new segment of size bytes fits the memory
// fraction.
func (c *Cache) CanGrow(size uint64) bool {
	return !c.fractionSet || c.Reserved+size <= c.allowed
}

// AddSegment records a new driver allocation made for r and returns its one
// block, ready for Allocate.
func (c *Cache) AddSegment(r *Request, base cuda.Ptr) *Block {
	seg := &Segment{Base: base, Size: r.SegSize, Stream: r.Stream, Pool: r.Pool}
	b := c.newBlock()
	b.Ptr, b.Size, b.Stream, b.Pool, b.Seg = base, r.SegSize, r.Stream, r.Pool, seg
	seg.Head = b
	c.segments[base] = seg
	r.Pool.Segments++
	c.Reserved += r.SegSize
	c.Stats.Segment.Increase(r.Pool.Small, 1)
	c.Stats.ReservedBytes.Increase(r.Pool.Small, int64(r.SegSize))
	if r.SegSize >= c.cfg.MaxSplitSize {
		c.Stats.OversizeSegments.Increase(1)
	}
	c.Stats.NumDeviceAlloc++
	return b
}

func (c *Cache) shouldSplit(b *Block, size uint64) bool {
	if b.Pool.NoSplit {
		return false
	}
	rest := b.Size - size
	if b.Pool.Small || b.Seg.Expandable {
		return rest >= MinBlockSize
	}
	return size < c.cfg.MaxSplitSize && rest > SmallSize
}

// Allocate hands b (from TakeFree or AddSegment) to the user for r,
// splitting off the unneeded tail into r's pool.
func (c *Cache) Allocate(r *Request, b *Block) *Block {
	small := r.Pool.Small
	wasSplit := b.IsSplit()
	if c.shouldSplit(b, r.Size) {
		rest := b
		b = c.newBlock()
		b.Ptr, b.Size, b.Stream, b.Pool, b.Seg = rest.Ptr, r.Size, r.Stream, r.Pool, rest.Seg
		b.Prev, b.Next = rest.Prev, rest
		if b.Prev != nil {
			b.Prev.Next = b
		} else {
			b.Seg.Head = b
		}
		rest.Prev = b
		rest.Ptr += cuda.Ptr(r.Size)
		rest.Size -= r.Size
		freedAt := rest.FreedAt
		c.insertFree(rest)
		rest.FreedAt = freedAt // free all along
		if b.Seg.Expandable {
			// inactive_split leaves expandable segments out, as PyTorch
			// does: their free pages can always be given back.
		} else if wasSplit {
			// An inactive split block shrank by the allocated size.
			c.hot.decrease(small, hInactiveSplitBytes, int64(b.Size))
		} else {
			// A whole block became split; its tail is inactive.
			c.hot.increase(small, hInactiveSplitBytes, int64(rest.Size))
			c.hot.increase(small, hInactiveSplit, 1)
		}
	} else if wasSplit && !b.Seg.Expandable {
		c.hot.decrease(small, hInactiveSplitBytes, int64(b.Size))
		c.hot.decrease(small, hInactiveSplit, 1)
	}
	b.Allocated = true
	b.Requested = r.Requested
	if s := b.Seg; s.Expandable && b.End() > s.UsedEnd {
		s.UsedEnd = b.End()
	}
	// c.countAllocated(b), written out (over the inliner's budget).
	c.active.put(b.Ptr, b)
	c.hot.allocated(small, int64(b.Size), int64(b.Requested))
	if b.Size >= c.cfg.MaxSplitSize {
		c.Stats.OversizeAllocations.Increase(1)
	}
	return b
}

// countAllocated indexes the newly allocated block b and counts it in the
// statistics. (Allocate has these lines written out.)
func (c *Cache) countAllocated(b *Block) {
	small := b.Pool.Small
	c.active.put(b.Ptr, b)
	c.hot.allocated(small, int64(b.Size), int64(b.Requested))
	if b.Size >= c.cfg.MaxSplitSize {
		c.Stats.OversizeAllocations.Increase(1)
	}
}

// Front-cache accounting. A front cache (allocator/front.go) serves a malloc
// with a block the user freed since the allocator last looked, without
// the block ever leaving its allocation: to the structures the block stays
// allocated throughout, and these record only what the statistics would
// have seen. The caller replays them in the order they happened, so the
// peaks stay exact.

// CountFrontFree counts the user's free of the allocated block b, which
// stays allocated in the structures (its reuse follows, or a real free).
//
// While it waits in front, a block is free and unmerged: a split block
// counts as an inactive split one, as a free block whose neighbours are
// allocated would.
func (c *Cache) CountFrontFree(b *Block) {
	small := b.Pool.Small
	c.hot.freed(small, int64(b.Size), int64(b.Requested))
	if b.Size >= c.cfg.MaxSplitSize {
		c.Stats.OversizeAllocations.Decrease(1)
	}
	if waitsAsInactiveSplit(b) {
		c.countWaiting(small, b, true)
	}
}

// waitsAsInactiveSplit reports whether b, while it waits in front, counts as
// an inactive split block.
func waitsAsInactiveSplit(b *Block) bool { return b.IsSplit() && !b.Seg.Expandable }

// countWaiting counts b in (start) or out of the inactive split statistics.
func (c *Cache) countWaiting(small bool, b *Block, start bool) {
	if start {
		c.hot.increase(small, hInactiveSplit, 1)
		c.hot.increase(small, hInactiveSplitBytes, int64(b.Size))
	} else {
		c.hot.decrease(small, hInactiveSplit, 1)
		c.hot.decrease(small, hInactiveSplitBytes, int64(b.Size))
	}
}

// CountFrontHold is CountFrontFree for a block the front keeps across
// calls: it stays allocated here, Held, until CountFrontReuse or
// ReleaseWaiting.
func (c *Cache) CountFrontHold(b *Block) {
	c.CountFrontFree(b)
	b.Held = true
}

// CountFrontReuse counts b's reallocation after CountFrontFree.
func (c *Cache) CountFrontReuse(b *Block) {
	b.Held = false
	small := b.Pool.Small
	c.hot.allocated(small, int64(b.Size), int64(b.Requested))
	if b.Size >= c.cfg.MaxSplitSize {
		c.Stats.OversizeAllocations.Increase(1)
	}
	if waitsAsInactiveSplit(b) {
		c.countWaiting(small, b, false)
	}
}

// CountFrontCycles counts k frees of the allocated block b, each followed at
// once by its reuse.
func (c *Cache) CountFrontCycles(b *Block, k int64) {
	small := b.Pool.Small
	c.hot.cycled(small, int64(b.Size), int64(b.Requested), k)
	if b.Size >= c.cfg.MaxSplitSize {
		o := &c.Stats.OversizeAllocations
		o.Allocated += k
		o.Freed += k
	}
	if waitsAsInactiveSplit(b) {
		// The first wait raises the peaks as CountFrontFree does; the
		// others add to the sums only.
		c.countWaiting(small, b, true)
		c.countWaiting(small, b, false)
		p := c.hot.pool(small)
		p.inc[hInactiveSplit] += k - 1
		p.inc[hInactiveSplitBytes] += (k - 1) * int64(b.Size)
	}
}

// ReleaseWaiting frees for real the allocated block b whose free
// CountFrontFree counted already (a block a front cache held across calls):
// it leaves the active set and returns to its pool, merged with its free
// neighbours, and only the inactive-split statistics change: the waiting
// split block's count ends and the merges count as Return counts them.
// Written apart from Release and Return, whose statistics it must not
// repeat, so that their hot path stays as it is. The merge lines repeat
// Return's: a helper shared by both (inlined into Return only with a
// regenerated PGO profile) made the C mixed pair 4-5% slower on the
// development box (two runs of 15 interleaved rounds).
func (c *Cache) ReleaseWaiting(b *Block) {
	if !b.Held || !b.Allocated || b.EventCount > 0 || !b.Uses.Empty() {
		panic("pools: ReleaseWaiting of a block not held in front")
	}
	b.Held = false
	small := b.Pool.Small
	if waitsAsInactiveSplit(b) {
		c.countWaiting(small, b, false)
	}
	c.active.del(b.Ptr)
	b.Allocated = false
	var splitBlocks, splitBytes int64
	if sub := c.tryMerge(b, b.Prev); sub > 0 {
		splitBlocks--
		splitBytes -= int64(sub)
	}
	if sub := c.tryMerge(b, b.Next); sub > 0 {
		splitBlocks--
		splitBytes -= int64(sub)
	}
	if b.IsSplit() {
		splitBlocks++
		splitBytes += int64(b.Size)
	}
	c.insertFree(b)
	if !b.Seg.Expandable {
		p := c.hot.pool(small)
		c.hot.change(p, hInactiveSplit, splitBlocks)
		c.hot.change(p, hInactiveSplitBytes, splitBytes)
	}
}

// Lookup returns the allocated block at p, or nil.
func (c *Cache) Lookup(p cuda.Ptr) *Block { return c.active.get(p) }

// Release marks the allocated block b as freed by the user. It stays active
// until Return; the caller first waits for its other streams' uses.
func (c *Cache) Release(b *Block) {
	if !b.Allocated {
		panic("pools: Release of a block that is not allocated")
	}
	c.active.del(b.Ptr)
	b.Allocated, b.Shared = false, false
	c.hot.released(b.Pool.Small, int64(b.Size))
	if b.Size >= c.cfg.MaxSplitSize {
		c.Stats.OversizeAllocations.Decrease(1)
	}
}

// Return puts a released block, with no pending uses, back in its pool,
// merged with its free neighbours.
func (c *Cache) Return(b *Block) {
	if b.Allocated || b.EventCount > 0 || !b.Uses.Empty() {
		panic("pools: Return of a block still in use")
	}
	size, requested := b.Size, b.Requested
	var splitBlocks, splitBytes int64
	if sub := c.tryMerge(b, b.Prev); sub > 0 {
		splitBlocks--
		splitBytes -= int64(sub)
	}
	if sub := c.tryMerge(b, b.Next); sub > 0 {
		splitBlocks--
		splitBytes -= int64(sub)
	}
	if b.IsSplit() {
		splitBlocks++
		splitBytes += int64(b.Size)
	}
	// b.Requested stays: as in PyTorch, a free block shows the requested
	// size of its last allocation in snapshots (memory tools read it).
	c.insertFree(b)
	c.hot.returned(b.Pool.Small, int64(size), int64(requested), !b.Seg.Expandable, splitBlocks, splitBytes)
}

// tryMerge absorbs the neighbour n into b if n is free and mapped alike,
// returning n's size. b must be in no set.
//
// A block in a set is never active (Check verifies it), so inSet alone says
// whether n is free: testing Active too would read EventCount and Uses, a
// cache line or two of the neighbour's that nothing else here touches.
func (c *Cache) tryMerge(b, n *Block) uint64 {
	if n == nil || !n.inSet || n.Unmapped != b.Unmapped {
		return 0
	}
	if n.Unmapped {
		n.Pool.Unmapped.Remove(n)
	} else {
		n.Pool.Blocks.Remove(n)
	}
	if n == b.Prev {
		b.Ptr = n.Ptr
		b.Prev = n.Prev
		if b.Prev != nil {
			b.Prev.Next = b
		} else {
			b.Seg.Head = b
		}
	} else {
		b.Next = n.Next
		if b.Next != nil {
			b.Next.Prev = b
		}
	}
	size := n.Size
	b.Size += size
	c.putBlock(n)
	return size
}

func (c *Cache) insertFree(b *Block) {
	p := b.Pool
	b.gcBase = p.freeCalls
	p.releasable = true // on the line just read: cheaper than testing b
	b.FreedAt = c.clock
	p.Blocks.Insert(b)
}

// releaseSegment gives the free whole-segment block b back through free.
func (c *Cache) releaseSegment(b *Block, free FreeFunc) error {
	if !b.wholeSegment() || b.Active() {
		panic("pools: releasing a block that is not a whole free segment")
	}
	if err := free(b.Ptr, b.Size); err != nil {
		return err
	}
	p := b.Pool
	p.Blocks.Remove(b)
	p.Segments--
	delete(c.segments, b.Ptr)
	c.Reserved -= b.Size
	c.Stats.Segment.Decrease(p.Small, 1)
	c.Stats.ReservedBytes.Decrease(p.Small, int64(b.Size))
	if b.Size >= c.cfg.MaxSplitSize {
		c.Stats.OversizeSegments.Decrease(1)
	}
	c.Stats.NumDeviceFree++
	c.putBlock(b)
	return nil
}

// ReleaseAvailable frees cached oversize segments of r's pool and stream to
// make room for r: the smallest single one that is large enough, else the
// largest ones until their sum covers the request. It reports whether it
// freed enough. It does nothing when max_split_size is unlimited.
func (c *Cache) ReleaseAvailable(r *Request, free FreeFunc) (bool, error) {
	max := c.cfg.MaxSplitSize
	if max == Unlimited {
		return false, nil
	}
	p := r.Pool
	want := r.Size
	if want < max {
		want = max
	}
	if b := p.Blocks.LowerBound(r.Stream, want); b != nil && b.Stream == r.Stream {
		if !b.wholeSegment() {
			return false, nil
		}
		return true, c.releaseSegment(b, free)
	}
	var released uint64
	for b := p.Blocks.Before(r.Stream, want, 0); b != nil && released < want &&
		b.Stream == r.Stream && b.Size >= max; {
		prev := p.Blocks.Before(b.Stream, b.Size, b.Ptr)
		if b.wholeSegment() {
			size := b.Size
			if err := c.releaseSegment(b, free); err != nil {
				return false, err
			}
			released += size
		}
		b = prev
	}
	return released >= want, nil
}

// ReleasePool frees every whole free ordinary segment cached in p (see
// UnmapFree for expandable segments; MarkReleased once both have run).
func (c *Cache) ReleasePool(p *BlockPool, free FreeFunc) error {
	if !p.releasable {
		return nil
	}
	var whole []*Block
	p.Blocks.Ascend(func(b *Block) bool {
		if b.wholeSegment() {
			whole = append(whole, b)
		}
		return true
	})
	for _, b := range whole {
		if err := c.releaseSegment(b, free); err != nil {
			return err // releasable stays set: the rest are still there
		}
	}
	return nil
}

// GarbageCollect frees old whole segments of the default large pool once
// Reserved exceeds GCThreshold × the fraction limit, oldest (least recently
// reusable) first, until the excess is gone. It is a no-op unless both a
// memory fraction and a threshold are set.
func (c *Cache) GarbageCollect(free FreeFunc) error {
	if !c.gcEnabled() {
		return nil
	}
	threshold := uint64(c.cfg.GCThreshold * float64(c.allowed))
	if c.Reserved <= threshold {
		return nil
	}
	target := c.Reserved - threshold
	p := c.Large
	age := func(b *Block) uint64 { return p.freeCalls - b.gcBase }
	var totalAge uint64
	var n int
	p.Blocks.Ascend(func(b *Block) bool {
		if b.wholeSegment() {
			totalAge += age(b)
			n++
		}
		return true
	})
	var reclaimed uint64
	for freed := true; reclaimed < target && freed && n > 0; {
		// Free everything at or above the mean age, not just up to the
		// target, so that GC does not run again at once.
		mean := float64(totalAge) / float64(n)
		freed = false
		var victims []*Block
		p.Blocks.Ascend(func(b *Block) bool {
			if b.wholeSegment() && float64(age(b)) >= mean {
				victims = append(victims, b)
			}
			return true
		})
		for _, b := range victims {
			a, size := age(b), b.Size
			if err := c.releaseSegment(b, free); err != nil {
				return err
			}
			freed = true
			reclaimed += size
			totalAge -= a
			n--
		}
	}
	return nil
}

// Segments returns the live segments ordered by address.
func (c *Cache) Segments() []*Segment {
	out := make([]*Segment, 0, len(c.segments))
	for _, s := range c.segments {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Base < out[j].Base })
	return out
}

// SegmentAt returns the live segment containing p, or nil. It scans, so it
// is for error reporting and introspection only.
func (c *Cache) SegmentAt(p cuda.Ptr) *Segment {
	for _, s := range c.segments {
		if p >= s.Base && p < s.Base+cuda.Ptr(s.Size) {
			return s
		}
	}
	return nil
}

// SegmentOf returns the live segment whose base is base, or nil.
func (c *Cache) SegmentOf(base cuda.Ptr) *Segment { return c.segments[base] }

// ActiveCount is the number of allocated blocks.
func (c *Cache) ActiveCount() int { return c.active.n }

func (c *Cache) newBlock() *Block {
	if b := c.spare; b != nil {
		c.spare, b.Next = b.Next, nil
		c.nSpare--
		return b
	}
	return new(Block)
}

func (c *Cache) putBlock(b *Block) {
	more := b.Uses.more[:0]
	*b = Block{}
	b.Uses.more = more
	b.Next, c.spare = c.spare, b
	c.nSpare++
}

// Check verifies the cache's invariants and returns the first violation:
// blocks tile their segments, neighbours are never both free (and mapped
// alike), free blocks are in their pool's set and allocated ones indexed,
// and the statistics equal a recount. In expandable segments the unmapped
// blocks are whole pages in their pool's Unmapped set, the mapped blocks
// add up to Segment.Mapped, and reserved memory is mapped memory. It walks
// everything; tests and the debug switch call it.
func (c *Cache) Check() error {
	var alloc, active, split [3]int64
	var allocB, activeB, splitB, reqB, resB, segs [3]int64
	var held int64
	inSets := map[*BlockPool]int{c.Small: 0, c.Large: 0}
	unmapped := map[*BlockPool]int{c.Small: 0, c.Large: 0}
	var reserved uint64
	for base, s := range c.segments {
		if s.Base != base || s.Head == nil || s.Head.Ptr != base || s.Head.Prev != nil {
			return fmt.Errorf("segment %#x: bad head", base)
		}
		inSets[s.Pool] += 0
		unmapped[s.Pool] += 0
		t := poolStat(s.Pool.Small)
		if s.Expandable {
			if s.PageSize == 0 || s.Size%s.PageSize != 0 || uint64(len(s.pages)) > s.PageCount() {
				return fmt.Errorf("expandable segment %#x: size %d, page %d, %d pages recorded", base, s.Size, s.PageSize, len(s.pages))
			}
		} else {
			segs[t]++
			resB[t] += int64(s.Size)
			reserved += s.Size
		}
		paused, err := checkPaused(s)
		if err != nil {
			return err
		}
		var mapped uint64
		next := s.Base
		for b := s.Head; b != nil; b = b.Next {
			if b.Ptr != next || b.Seg != s || b.Pool != s.Pool || b.Size == 0 || b.Stream != s.Stream {
				return fmt.Errorf("segment %#x: block %#x+%d does not tile it (expected %#x)", base, b.Ptr, b.Size, next)
			}
			if b.Next != nil && b.Next.Prev != b {
				return fmt.Errorf("block %#x: broken links", b.Ptr)
			}
			next = b.End()
			if s.Expandable {
				// The owner's page table agrees: every page a mapped block
				// touches has memory, no page of an unmapped block has.
				first := uint64(b.Ptr-s.Base) / s.PageSize
				last := (uint64(b.End()-s.Base) - 1) / s.PageSize
				// A paused page has none, under a mapped block.
				for i := first; i <= last; i++ {
					p := paused != nil && paused[i]
					if p && b.Unmapped {
						return fmt.Errorf("expandable segment %#x: paused page %d under the unmapped block %#x", base, i, b.Ptr)
					}
					if (s.Page(i) == 0) != (b.Unmapped || p) {
						return fmt.Errorf("expandable segment %#x: page %d has handle %d, block %#x unmapped=%v paused=%v", base, i, s.Page(i), b.Ptr, b.Unmapped, p)
					}
				}
			}
			if b.Unmapped {
				switch {
				case !s.Expandable:
					return fmt.Errorf("block %#x: unmapped in an ordinary segment", b.Ptr)
				case uint64(b.Ptr-s.Base)%s.PageSize != 0 || b.Size%s.PageSize != 0:
					return fmt.Errorf("unmapped block %#x+%d: not whole pages", b.Ptr, b.Size)
				case b.Active() || b.inSet == b.Lent:
					return fmt.Errorf("unmapped block %#x: active=%v, in its set=%v, lent=%v", b.Ptr, b.Active(), b.inSet, b.Lent)
				case b.Next != nil && b.Next.Unmapped && !b.Lent && !b.Next.Lent:
					return fmt.Errorf("unmapped blocks %#x and %#x not merged", b.Ptr, b.Next.Ptr)
				}
				if !b.Lent {
					unmapped[b.Pool]++
					if !b.IsSplit() && !b.Pool.releasable {
						return fmt.Errorf("segment %#x: nothing mapped, and its pool does not flag it (releasable)", s.Base)
					}
				}
				continue
			}
			mapped += b.Size
			free := !b.Active()
			if free != b.inSet {
				return fmt.Errorf("block %#x: free=%v but in free set=%v", b.Ptr, free, b.inSet)
			}
			if b.Held {
				// Counted free (CountFrontHold), a split one as inactive
				// split, though it stays allocated and indexed here.
				if !b.Allocated || c.active.get(b.Ptr) != b {
					return fmt.Errorf("block %#x: held in front but not allocated and indexed", b.Ptr)
				}
				held++
				if b.IsSplit() && !s.Expandable {
					split[t]++
					splitB[t] += int64(b.Size)
				}
				continue
			}
			if free {
				inSets[b.Pool]++
				if !b.Pool.releasable && !b.IsSplit() && !s.Expandable {
					return fmt.Errorf("block %#x: a whole free segment its pool does not flag (releasable)", b.Ptr)
				}
				if s.Expandable && !b.Pool.releasable && s.PausedBytes == 0 {
					if lo, hi := wholePages(b); hi > lo {
						return fmt.Errorf("block %#x: free whole pages its pool does not flag (releasable)", b.Ptr)
					}
				}
				if b.Next != nil && !b.Next.Active() && !b.Next.Unmapped {
					return fmt.Errorf("blocks %#x and %#x: adjacent free blocks not merged", b.Ptr, b.Next.Ptr)
				}
				if b.IsSplit() && !s.Expandable {
					split[t]++
					splitB[t] += int64(b.Size)
				}
			} else {
				active[t]++
				activeB[t] += int64(b.Size)
				reqB[t] += int64(b.Requested)
			}
			if b.Allocated {
				alloc[t]++
				allocB[t] += int64(b.Size)
				if c.active.get(b.Ptr) != b {
					return fmt.Errorf("block %#x: allocated but not indexed", b.Ptr)
				}
			}
		}
		if next != s.Base+cuda.Ptr(s.Size) {
			return fmt.Errorf("segment %#x: blocks end at %#x, segment at %#x", base, next, s.Base+cuda.Ptr(s.Size))
		}
		if s.Expandable {
			if mapped != s.Mapped {
				return fmt.Errorf("expandable segment %#x: blocks map %d bytes, segment says %d", base, mapped, s.Mapped)
			}
			resB[t] += int64(mapped - s.PausedBytes)
			reserved += mapped - s.PausedBytes
		}
	}
	for p, n := range inSets {
		if p.Blocks.Len() != n {
			return fmt.Errorf("pool %v small=%v: free set holds %d blocks, segments have %d free", p.ID, p.Small, p.Blocks.Len(), n)
		}
	}
	for p, n := range unmapped {
		if p.Unmapped.Len() != n {
			return fmt.Errorf("pool %v small=%v: unmapped set holds %d blocks, segments have %d unmapped", p.ID, p.Small, p.Unmapped.Len(), n)
		}
	}
	if int(alloc[1]+alloc[2]+held) != c.active.n {
		return fmt.Errorf("index holds %d blocks, %d allocated and %d held in front", c.active.n, alloc[1]+alloc[2], held)
	}
	if allocs, segs := c.countOversize(); allocs != c.Stats.OversizeAllocations.Current || segs != c.Stats.OversizeSegments.Current {
		return fmt.Errorf("oversize stats %d allocations, %d segments; recount %d, %d",
			c.Stats.OversizeAllocations.Current, c.Stats.OversizeSegments.Current, allocs, segs)
	}
	if reserved != c.Reserved {
		return fmt.Errorf("reserved %d, segments sum to %d", c.Reserved, reserved)
	}
	st := c.ReadStats()
	for _, e := range []struct {
		name string
		a    *StatArray
		want [3]int64
	}{
		{"allocation", &st.Allocation, alloc}, {"allocated_bytes", &st.AllocatedBytes, allocB},
		{"active", &st.Active, active}, {"active_bytes", &st.ActiveBytes, activeB},
		{"inactive_split", &st.InactiveSplit, split}, {"inactive_split_bytes", &st.InactiveSplitBytes, splitB},
		{"requested_bytes", &st.RequestedBytes, reqB},
		{"segment", &st.Segment, segs}, {"reserved_bytes", &st.ReservedBytes, resB},
	} {
		e.want[0] = e.want[1] + e.want[2]
		for t := 0; t < 3; t++ {
			if e.a[t].Current != e.want[t] {
				return fmt.Errorf("stat %s.%s = %d, recount %d", e.name, statTypeNames[t], e.a[t].Current, e.want[t])
			}
			if e.a[t].Peak < e.a[t].Current {
				return fmt.Errorf("stat %s.%s inconsistent: %+v", e.name, statTypeNames[t], e.a[t])
			}
		}
	}
	return nil
}
