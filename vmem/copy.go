// SPDX-License-Identifier: Apache-2.0

package vmem

// Copies of device memory to pinned host memory and back, for pausing
// memory with its contents kept: a pause saves the live ranges of a tag,
// unmaps and releases their physical memory, and a resume maps new memory
// at the same addresses and restores the bytes.
//
// Design:
//
//   - Plan (PlanCopies, CopyPlan.Layout): the ranges to save are sorted by
//     device and address and merged where they touch or overlap; ranges of
//     one mapped extent (the same non-zero Seg) separated by a small gap are
//     merged too, gap included, since copying a few hundred KiB more costs
//     less than a copy's fixed overhead (about 5 us, or 250 KiB at the host
//     link's 48 GiB/s). The merged spans are laid out one after the other
//     in the host blocks, each starting on a CopyAlign boundary, cut into
//     pieces of at most Chunk bytes (and at host block ends), and the pieces
//     of each device are dealt round-robin to its Streams copy streams. Large
//     pieces on a couple of streams keep the link busy in both directions:
//     one 64 MiB copy takes 1.3 ms, against microseconds between two copies
//     on one stream, and the second stream covers even those.
//
//   - Host memory (Copier): pinned memory comes in blocks of at most
//     HostBlock bytes, allocated portable so that any device's copies may
//     use any block. A save takes blocks from the Copier's pool (the
//     smallest block that holds it all, else the largest first), allocates
//     what is missing, and holds them until its Restore or Discard gives
//     them back to the pool: saved contents live in the pool's blocks, and a
//     later pause reuses them without pinning memory again. ReleaseHost
//     frees the pool's blocks that no save holds.
//
//   - Failure: Save copies only from the device, so when it fails the
//     device's contents are as they were, and the caller, which unmaps only
//     after Save returned, has lost nothing. Before a failed Save returns it
//     waits for every copy it queued; if that wait fails too, copies may
//     still be writing to its blocks, so they are neither reused nor freed
//     (Stranded counts them). Restore copies only from the host: when it
//     fails, the Saved keeps its blocks and bytes, and Restore may be called
//     again.
//
//   - Waiting for the work already queued on the memory is the caller's
//     part: Save starts copying at once, on streams of its own.
//
// A Copier's methods are safe for concurrent use; one mutex serialises them
// (pause and resume are cold calls, and a copy in progress owns the
// streams).

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/cudapool/cudapool/cuda"
)

// CopyDriver is what the Copier needs from CUDA; cuda/driver and cuda/sim
// implement it.
type CopyDriver interface {
	// HostAlloc allocates portable pinned host memory in dev's context.
	HostAlloc(dev int, size uint64) (cuda.HostPtr, error)
	// HostFree frees it, naming the device it was allocated on.
	HostFree(dev int, p cuda.HostPtr) error
	// StreamCreate makes a non-blocking stream of dev.
	StreamCreate(dev int) (cuda.Stream, error)
	StreamDestroy(dev int, s cuda.Stream) error
	// MemcpyDtoHAsync and MemcpyHtoDAsync queue a copy on s.
	MemcpyDtoHAsync(dev int, dst cuda.HostPtr, src cuda.Ptr, size uint64, s cuda.Stream) error
	MemcpyHtoDAsync(dev int, dst cuda.Ptr, src cuda.HostPtr, size uint64, s cuda.Stream) error
	StreamSynchronize(dev int, s cuda.Stream) error
}

// CopyAlign aligns each span's place in host memory; host blocks are
// multiples of copyHostRound, hence of CopyAlign.
const CopyAlign = 512

// copyHostRound rounds the size of the pinned blocks the Copier allocates.
const copyHostRound = 2 << 20

// CopyOptions tunes the copies; zero fields take their defaults.
type CopyOptions struct {
	Chunk     uint64 // the largest single copy (default 64 MiB)
	Streams   int    // copy streams per device (default 2)
	HostBlock uint64 // the largest pinned allocation (default 256 MiB)
	MaxGap    uint64 // the largest gap merged within one Seg (default 256 KiB)
}

func (o CopyOptions) withDefaults() CopyOptions {
	if o.Chunk == 0 {
		o.Chunk = 64 << 20
	}
	if o.Streams <= 0 {
		o.Streams = 2
	}
	if o.HostBlock == 0 {
		o.HostBlock = 256 << 20
	}
	o.HostBlock = copyRound(o.HostBlock, copyHostRound)
	if o.MaxGap == 0 {
		o.MaxGap = 256 << 10
	}
	return o
}

func copyRound(n, k uint64) uint64 { return (n + k - 1) / k * k }

// CopyRange is device memory whose contents a pause keeps.
type CopyRange struct {
	Dev  int
	Ptr  cuda.Ptr
	Size uint64
	// Seg, when not zero, names the mapped extent that holds the range:
	// the gap between two ranges of one Seg is mapped too, so the plan may
	// copy it along (see CopyOptions.MaxGap). Zero: never merged across a
	// gap.
	Seg uint64
}

// CopySpan is a run of device memory copied in one or more pieces.
type CopySpan struct {
	Dev  int
	Ptr  cuda.Ptr
	Size uint64
}

// CopyPiece is one asynchronous copy: Size bytes at Ptr on device Dev,
// from or to offset Off of host block Block, on the device's copy stream
// number Stream.
type CopyPiece struct {
	Dev    int
	Ptr    cuda.Ptr
	Size   uint64
	Block  int
	Off    uint64
	Stream int
}

// CopyPlan says what a save copies and where the bytes go.
type CopyPlan struct {
	Spans  []CopySpan  // merged ranges, by device and address
	Live   uint64      // bytes of the ranges asked for (their union)
	Bytes  uint64      // bytes copied: Live and the gaps merged
	Host   uint64      // host bytes the layout needs (spans CopyAlign-aligned)
	Pieces []CopyPiece // set by Layout
}

// PlanCopies merges ranges into spans. Empty ranges are ignored; a range
// that wraps around the address space, or names a negative device, is an
// error.
func PlanCopies(ranges []CopyRange, opt CopyOptions) (CopyPlan, error) {
	opt = opt.withDefaults()
	rs := make([]CopyRange, 0, len(ranges))
	for _, r := range ranges {
		if r.Size == 0 {
			continue
		}
		if r.Dev < 0 || uint64(r.Ptr)+r.Size < uint64(r.Ptr) {
			return CopyPlan{}, fmt.Errorf("vmem: bad range to copy: device %d, %#x+%d", r.Dev, uint64(r.Ptr), r.Size)
		}
		rs = append(rs, r)
	}
	sort.Slice(rs, func(i, j int) bool {
		if rs[i].Dev != rs[j].Dev {
			return rs[i].Dev < rs[j].Dev
		}
		return rs[i].Ptr < rs[j].Ptr
	})
	var p CopyPlan
	var lastSeg uint64 // the Seg of the range that ends the last span
	for _, r := range rs {
		end := uint64(r.Ptr) + r.Size
		if n := len(p.Spans); n > 0 && p.Spans[n-1].Dev == r.Dev {
			last := &p.Spans[n-1]
			lastEnd := uint64(last.Ptr) + last.Size
			switch {
			case uint64(r.Ptr) <= lastEnd: // touches or overlaps
				if end > lastEnd {
					p.Live += end - lastEnd
					last.Size = end - uint64(last.Ptr)
					lastSeg = r.Seg
				}
				continue
			case r.Seg != 0 && r.Seg == lastSeg && uint64(r.Ptr)-lastEnd <= opt.MaxGap:
				p.Live += r.Size
				last.Size = end - uint64(last.Ptr)
				continue
			}
		}
		p.Spans = append(p.Spans, CopySpan{Dev: r.Dev, Ptr: r.Ptr, Size: r.Size})
		p.Live += r.Size
		lastSeg = r.Seg
	}
	for _, s := range p.Spans {
		p.Bytes += s.Size
		p.Host += copyRound(s.Size, CopyAlign)
	}
	return p, nil
}

// Layout places the spans in host blocks of the given sizes (multiples of
// CopyAlign), in order, and cuts them into pieces; it fails when the
// blocks hold less than p.Host.
func (p *CopyPlan) Layout(blocks []uint64, opt CopyOptions) error {
	opt = opt.withDefaults()
	p.Pieces = p.Pieces[:0]
	next := map[int]int{} // pieces dealt so far, by device
	bi, off := 0, uint64(0)
	for _, s := range p.Spans {
		ptr, left := s.Ptr, s.Size
		off = copyRound(off, CopyAlign)
		for left > 0 {
			for bi < len(blocks) && off >= blocks[bi] {
				bi, off = bi+1, 0
			}
			if bi == len(blocks) {
				p.Pieces = p.Pieces[:0]
				return fmt.Errorf("vmem: %d bytes of host blocks cannot hold a plan of %d", sumSizes(blocks), p.Host)
			}
			n := min(left, opt.Chunk, blocks[bi]-off)
			k := next[s.Dev]
			next[s.Dev] = k + 1
			p.Pieces = append(p.Pieces, CopyPiece{Dev: s.Dev, Ptr: ptr, Size: n, Block: bi, Off: off, Stream: k % opt.Streams})
			ptr, left, off = ptr+cuda.Ptr(n), left-n, off+n
		}
	}
	return nil
}

func sumSizes(xs []uint64) (n uint64) {
	for _, x := range xs {
		n += x
	}
	return n
}

// Copier copies device memory to pinned host memory and back, keeping a
// pool of pinned blocks and a few copy streams per device.
type Copier struct {
	drv CopyDriver
	opt CopyOptions

	mu         sync.Mutex
	streams    map[int][]cuda.Stream // guarded by mu; copy streams by device
	free       []hostBlock           // guarded by mu; blocks no save holds
	held       uint64                // guarded by mu; bytes of blocks saves hold
	stranded   uint64                // guarded by mu; see CopyStats
	hostAllocs int64                 // guarded by mu
}

type hostBlock struct {
	dev  int // the device whose context allocated it
	p    cuda.HostPtr
	size uint64
}

// NewCopier returns a Copier with an empty pool.
func NewCopier(drv CopyDriver, opt CopyOptions) *Copier {
	return &Copier{drv: drv, opt: opt.withDefaults(), streams: map[int][]cuda.Stream{}}
}

// Saved is the contents of device memory kept in pinned host memory by
// Save, until Restore or Discard.
type Saved struct {
	c      *Copier
	plan   CopyPlan
	blocks []hostBlock
	done   bool // guarded by c.mu; restored or discarded
}

// Live returns the bytes of the ranges saved.
func (s *Saved) Live() uint64 { return s.plan.Live }

// Bytes returns the bytes copied each way (Live and merged gaps).
func (s *Saved) Bytes() uint64 { return s.plan.Bytes }

// HostBytes returns the pinned bytes s holds.
func (s *Saved) HostBytes() uint64 { return blockBytes(s.blocks) }

// Pieces returns the number of copies each way.
func (s *Saved) Pieces() int { return len(s.plan.Pieces) }

func blockBytes(bs []hostBlock) (n uint64) {
	for _, b := range bs {
		n += b.size
	}
	return n
}

// CopyStats describes a Copier's pinned memory and streams.
type CopyStats struct {
	Pooled     uint64 // pinned bytes no save holds, kept for reuse
	Held       uint64 // pinned bytes holding saved contents
	Stranded   uint64 // pinned bytes given up: copies into them could not be waited for
	HostAllocs int64  // HostAlloc calls made
	Streams    int    // live copy streams
}

// Stats returns c's statistics.
func (c *Copier) Stats() CopyStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := CopyStats{Pooled: blockBytes(c.free), Held: c.held, Stranded: c.stranded, HostAllocs: c.hostAllocs}
	for _, ss := range c.streams {
		st.Streams += len(ss)
	}
	return st
}

// Save copies the contents of ranges to pinned host memory and returns
// them once every copy has completed. The caller must have waited for the
// work queued on the ranges. On error nothing is saved and the device
// memory is untouched.
func (c *Copier) Save(ranges []CopyRange) (*Saved, error) {
	plan, err := PlanCopies(ranges, c.opt)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	s := &Saved{c: c, plan: plan}
	if plan.Bytes == 0 {
		return s, nil
	}
	if err := c.ensureStreams(plan.Spans); err != nil {
		return nil, err
	}
	blocks, err := c.takeHost(plan.Spans[0].Dev, plan.Host)
	if err != nil {
		return nil, err
	}
	sizes := make([]uint64, len(blocks))
	for i, b := range blocks {
		sizes[i] = b.size
	}
	if err := s.plan.Layout(sizes, c.opt); err != nil {
		c.free = append(c.free, blocks...)
		return nil, err
	}
	if quiet, err := c.run(&s.plan, blocks, true); err != nil {
		if quiet {
			c.free = append(c.free, blocks...)
		} else {
			c.stranded += blockBytes(blocks)
		}
		return nil, err
	}
	s.blocks = blocks
	c.held += blockBytes(blocks)
	return s, nil
}

// Restore copies saved contents back to the same device addresses, which
// must be mapped again, and returns once every copy has completed; then the
// host memory goes back to the pool. On error s keeps its contents and
// Restore may be called again.
func (c *Copier) Restore(s *Saved) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check(s); err != nil {
		return err
	}
	if len(s.plan.Pieces) > 0 {
		if err := c.ensureStreams(s.plan.Spans); err != nil {
			return err
		}
		if _, err := c.run(&s.plan, s.blocks, false); err != nil {
			return err
		}
	}
	c.release(s)
	return nil
}

// Discard gives s's host memory back to the pool without copying.
func (c *Copier) Discard(s *Saved) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check(s); err != nil {
		return err
	}
	c.release(s)
	return nil
}

// check: mu is held.
func (c *Copier) check(s *Saved) error {
	switch {
	case s == nil || s.c != c:
		return errors.New("vmem: contents saved by another copier")
	case s.done:
		return errors.New("vmem: contents already restored or discarded")
	}
	return nil
}

// release: mu is held.
func (c *Copier) release(s *Saved) {
	c.free = append(c.free, s.blocks...)
	c.held -= blockBytes(s.blocks)
	s.blocks = nil
	s.done = true
}

// ReleaseHost frees the pinned blocks no save holds and returns their
// bytes. A block the driver fails to free stays in the pool.
func (c *Copier) ReleaseHost() (uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.releaseHost()
}

func (c *Copier) releaseHost() (uint64, error) {
	var errs []error
	var freed uint64
	kept := c.free[:0]
	for _, b := range c.free {
		if err := c.drv.HostFree(b.dev, b.p); err != nil {
			errs = append(errs, fmt.Errorf("vmem: freeing %d bytes of pinned memory: %w", b.size, err))
			kept = append(kept, b)
			continue
		}
		freed += b.size
	}
	clear(c.free[len(kept):])
	c.free = kept
	return freed, errors.Join(errs...)
}

// Close frees the pool's blocks (as ReleaseHost) and destroys the copy
// streams. Saved contents stay valid, and c usable: streams are made again
// when needed.
func (c *Copier) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, err := c.releaseHost()
	errs := []error{err}
	for dev, ss := range c.streams {
		kept := ss[:0]
		for _, s := range ss {
			if err := c.drv.StreamDestroy(dev, s); err != nil {
				errs = append(errs, fmt.Errorf("vmem: destroying a copy stream of device %d: %w", dev, err))
				kept = append(kept, s)
			}
		}
		if len(kept) == 0 {
			delete(c.streams, dev)
		} else {
			c.streams[dev] = kept
		}
	}
	return errors.Join(errs...)
}

// ensureStreams makes the copy streams of the spans' devices; mu is held.
// A device whose streams were only partly made (a failed Close) gets the
// rest.
func (c *Copier) ensureStreams(spans []CopySpan) error {
	for i, sp := range spans {
		if i > 0 && spans[i-1].Dev == sp.Dev {
			continue
		}
		for len(c.streams[sp.Dev]) < c.opt.Streams {
			s, err := c.drv.StreamCreate(sp.Dev)
			if err != nil {
				return fmt.Errorf("vmem: creating a copy stream on device %d: %w", sp.Dev, err)
			}
			c.streams[sp.Dev] = append(c.streams[sp.Dev], s)
		}
	}
	return nil
}

// takeHost takes pinned blocks holding at least need bytes from the pool,
// allocating what is missing in dev's context; mu is held. On error the
// pool keeps every block, new ones included.
func (c *Copier) takeHost(dev int, need uint64) ([]hostBlock, error) {
	// Best fit: the smallest free block that holds everything.
	best := -1
	for i, b := range c.free {
		if b.size >= need && (best < 0 || b.size < c.free[best].size) {
			best = i
		}
	}
	if best >= 0 {
		b := c.free[best]
		c.free = slices.Delete(c.free, best, best+1)
		return []hostBlock{b}, nil
	}
	// Else every free block (they hold less than need together or
	// apart), largest first, then new ones.
	slices.SortFunc(c.free, func(a, b hostBlock) int { return cmp.Compare(b.size, a.size) })
	var taken []hostBlock
	have := uint64(0)
	for len(c.free) > 0 && have < need {
		taken = append(taken, c.free[0])
		have += c.free[0].size
		c.free = c.free[1:]
	}
	for have < need {
		size := min(c.opt.HostBlock, copyRound(need-have, copyHostRound))
		p, err := c.drv.HostAlloc(dev, size)
		if err != nil {
			c.free = append(c.free, taken...)
			return nil, fmt.Errorf("vmem: allocating %d bytes of pinned memory (%d of %d in hand): %w", size, have, need, err)
		}
		c.hostAllocs++
		taken = append(taken, hostBlock{dev: dev, p: p, size: size})
		have += size
	}
	return taken, nil
}

// run queues the plan's copies, to the host or back, and waits for every
// stream it used. quiet reports that no copy it queued can still be
// running (every wait succeeded), whatever err says; mu is held.
func (c *Copier) run(p *CopyPlan, blocks []hostBlock, toHost bool) (quiet bool, err error) {
	type key struct{ dev, stream int }
	used := map[key]bool{}
	var errs []error
	for _, pc := range p.Pieces {
		s := c.streams[pc.Dev][pc.Stream]
		h := blocks[pc.Block].p + cuda.HostPtr(pc.Off)
		var err error
		if toHost {
			err = c.drv.MemcpyDtoHAsync(pc.Dev, h, pc.Ptr, pc.Size, s)
		} else {
			err = c.drv.MemcpyHtoDAsync(pc.Dev, pc.Ptr, h, pc.Size, s)
		}
		if err != nil {
			dir := "to the host"
			if !toHost {
				dir = "back to the device"
			}
			errs = append(errs, fmt.Errorf("vmem: copying %d bytes at %#x of device %d %s: %w", pc.Size, uint64(pc.Ptr), pc.Dev, dir, err))
			break
		}
		used[key{pc.Dev, pc.Stream}] = true
	}
	quiet = true
	for k := range used {
		if err := c.drv.StreamSynchronize(k.dev, c.streams[k.dev][k.stream]); err != nil {
			errs = append(errs, fmt.Errorf("vmem: waiting for the copies on device %d: %w", k.dev, err))
			quiet = false
		}
	}
	return quiet, errors.Join(errs...)
}
