// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"cmp"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Stitching (on by default; stitch:False or expandable_segments:False turn
// it off): free physical pages move to where a miss needs them instead of
// new memory being mapped. The idea is GMLake's (ASPLOS 2024). The policy
// is all here; pools/stitch.go keeps the blocks' bookkeeping (splitting a
// free block around the pages taken, Block.Lent). doc.go's "One page pool
// for both size classes" says what takes part.
//
// # Design
//
// On a miss that grows an expandable segment (no capture under way), for
// the part of the growth that would raise reserved memory above its
// high-water mark, stitchFor takes whole pages inside free blocks of
// the default pools' expandable segments (any stream, either size class,
// holes of the request's own range outside the run it grows into, unless
// that range holds plenty of free memory: "Fragmented ranges") and puts
// their physical handles in the spares, which Map uses before creating any.
// Reserved memory stays the same. Below the mark new pages cost no more
// than moved ones and the holes stay for the requests that fit them. The
// mark is the peak of the reserved_bytes statistic, the figure the user
// watches: growth that goes above it all the same (too few idle pages)
// raises it, and reset_peak_memory_stats lowers it to what is reserved
// now, from when on stitching keeps reserved memory there.
//
// A page is taken in one of two ways:
//   - Unmapped at once, when no queued work can touch it. cuMemUnmap does
//     not wait for such work (PyTorch synchronizes before it unmaps), and a
//     free block may have kernels that used it still queued on its own
//     stream (other streams' uses were waited for before the block became
//     free: package events). The owner's stream progress (Progress, the
//     device's events.Tracker) tells: each stream that owns donor
//     candidates is watched, and at each miss (stitchPrepare) it learns
//     which ticks of the cache's clock the stream has run past; every block
//     of the stream freed before such a tick (Block.FreedAt) is idle. A
//     tick is certified by a mark recorded on the stream after it, and
//     marks go only on the stream of a request at hand and the legacy
//     default stream: a stream named in an earlier call may have been
//     destroyed since, and naming it to the driver would be undefined
//     behaviour (events' "Stream progress"). So another stream's pages
//     freed after its last mark move once a request of its own has marked
//     it: its own miss, or any request of it after a miss here passed over
//     its pages (donorKind asks for that mark: Progress.WantMark), so that
//     a stream whose requests all hit its cache still gives its idle pages
//     up. On an idle stream the mark completes at once. Nothing waits
//     for a mark (but see "Synchronizing").
//   - Lent, when it is not certified idle but belongs to the requesting
//     stream: its handle is mapped at the new place at once (work on the new
//     block is queued behind the old work, as for any reuse of a cached
//     block on its stream), and its old mapping stays, the block Lent,
//     neither free nor mappable, until its stream has run past the lend
//     (stitchPrepare, at a later miss that marks it) or empty_cache and
//     the OOM retry synchronize the device (releaseStitch). Without lending
//     a GPU running behind the host would leave almost nothing to move.
//
// # Synchronizing
//
// A growth above the mark that finds too few certified pages, where the
// other streams' free blocks it passed over hold at least the missing
// whole pages, synchronizes the device (which names no stream) and
// searches again: every page freed before then is idle. Without it, the
// pages a stream freed wait for its next request (a prefill stream
// between prefills, while the decode stream frees the KV caches the
// prefills allocated), and the misses in between map new memory, which
// raises the mark for good: bench/kvcache.py's trace with a prefill
// stream crept to 1.160 reserved / allocated over three passes, and stays
// at 1.009 with it (bench/simreplay). It happens only where reserved
// memory would otherwise rise above its peak and other streams' memory
// would serve: never with one stream; on that trace 110 times in the
// first pass, then about 12 per pass of its 2,451 decode steps. Like empty_cache and the OOM
// retry it runs under the device lock, and never during a capture.
// stitch_sync:False turns it off (new memory is mapped instead).
//
// # Chunks
//
// What a move costs on the GPU is per physical allocation (cuMemSetAccess
// and cuMemUnmap, tens of microseconds each), not per byte. stitch_chunk_mb
// maps the default large pool's new ranges in larger allocations (chunk),
// which move whole: pools.Donors gives only whole allocations of the
// growing range's own size, so that moving pages never mixes sizes in a
// range (CUDA IPC's handle needs one size), and a lent block is unmapped
// and restored allocation by allocation (lent.chunk). The large pool then
// no longer trades pages with the small pool, which maps page by page.
// A growth cut short to its request (by the memory fraction) may still end
// in a smaller allocation than a chunk, which no moved chunk fits: it is
// made new, while a lent chunk it could not use goes back to its block, so
// reserved memory may pass the fraction by less than a chunk, and such a
// range is not shared (export.go, "One size"). docs/fragmentation.md,
// "Chunks", has what chunks save and cost.
//
// # Fragmented ranges
//
// A miss in a range that holds plenty of free memory (roomy: at least
// four times the request, and an eighth of what the range has mapped)
// comes from fragmentation: the range's free memory lies in pieces between
// live blocks, none large enough. Taking pages from the range's own holes
// would mend it for this request only: a working set that keeps replacing
// blocks of other sizes fragments the range again at once, and each later
// miss would move pages again, two driver calls per page (tens of
// microseconds each on the GPU), for as long as the working set lives.
// Such a miss leaves its own range's holes alone: it takes pages from other
// ranges only (other streams, the other size class), whose idle pages serve
// no request of its range otherwise, and maps new memory for the rest, as
// expandable segments without stitching do, at the range's lowest run
// (Grow; elsewhere growth takes the run needing the fewest new pages where
// that saves more than a mapping unit: pools/expandable.go, "Which run"). The range grows once to the
// slack at which its working set fits, and its misses stop
// (allocator/steadycalls_test.go holds bench/workloads.h's mix of 256 live
// blocks of 512 B to 144 MiB to no driver call in its steady state). Near a
// peak of live memory a range holds little free memory, so the misses that
// would raise the high-water mark there still take pages from its holes:
// stitching's saving is kept where the peak is made.
//
// The growth may use fewer pages than were taken (the memory fraction or
// the device stops it, or its run needed less than GrowthNeed foresaw):
// the pages unmapped outright are used first, and the lent ones left over
// go back to their blocks (restoreUnused), their old mapping intact, so
// that no physical memory is held outside what reserved memory counts.
//
// Private pools (graphs, MemPools) neither give pages nor are searched: a
// graph's replays use memory its pool counts as free. Nothing is stitched
// or unlent while any capture may be under way: unmapping is illegal then.
// Pages moved are counted (StitchStats; the snapshot's stitch_remaps and
// stitch_lent).
//
// Before any other unmapping (empty_cache, the OOM retry) the device is
// synchronized, for the same reason (UnmapFree).

// stitchState is a Space's stitching state.
type stitchState struct {
	on     bool          // the configuration asks for stitching
	lent   []lent        // blocks whose old mapping waits to be unmapped
	donors []pools.Donor // scratch
	// kind is donorKind for a request on stream (stitchFor's).
	kind   func(*pools.Block) pools.DonorKind
	stream cuda.Stream
	noSync bool   // stitch_sync:False: never synchronize ("Synchronizing")
	chunk  uint64 // Config.StitchChunk ("Chunks")
	// fresh is the index in lent of the first block lent by the growth in
	// progress, and pages the handles of its lent chunks, block after
	// block in lent's order, chunk by chunk: restoreUnused gives back
	// those Map did not use.
	fresh int
	pages []cuda.MemHandle
	stats StitchStats
}

// StitchStats counts a device's stitching.
type StitchStats struct {
	// Remaps is the number of pages unmapped from a free hole and mapped
	// again where a miss needed them; RemappedBytes their bytes.
	Remaps        int64 `json:"remaps"`
	RemappedBytes int64 `json:"remapped_bytes"`
	// Lent is the number of those pages that were lent: mapped at their
	// new place before their old mapping could be unmapped (see above).
	Lent int64 `json:"lent"`
	// Stitches is the number of misses that moved at least one page.
	Stitches int64 `json:"stitches"`
	// SkippedBusy counts candidate blocks passed over because work queued
	// on their stream (not the requesting one) might still use them.
	SkippedBusy int64 `json:"skipped_busy"`
	// Fragmented counts the misses whose own range held plenty of free
	// memory, and whose holes were left alone (see "Fragmented ranges").
	Fragmented int64 `json:"fragmented"`
	// Syncs counts the device synchronizations that certified other
	// streams' idle pages (see "Synchronizing").
	Syncs int64 `json:"syncs"`
}

// A range holds plenty of free memory for a request (see "Fragmented
// ranges") when its free mapped blocks sum to at least roomyRequests times
// the request and to at least 1/roomyShare of its mapped bytes. Both are
// needed: a small request finds four times its size free in any large
// range, and a large range's eighth may be less than a large request. The
// recorded training and serving traces (bench/simreplay) keep their
// figures: their misses find less free memory in their range than that,
// but for a few of the two-stream serving trace's, which the other
// stream's idle pages serve. A looser share (a sixteenth) would let the
// single-stream serving trace grow by a tenth.
const (
	roomyRequests = 4
	roomyShare    = 8
)

// roomy reports whether seg holds plenty of free memory for a request of
// size bytes.
func roomy(seg *pools.Segment, size uint64) bool {
	need := max(roomyRequests*size, seg.Mapped/roomyShare, 1)
	var free uint64
	for b := seg.Head; b != nil && free < need; b = b.Next {
		if !b.Unmapped && !b.Active() {
			free += b.Size
		}
	}
	return free >= need
}

// donorKind is the verdict on the free block b as a donor for a request
// on stream s: unmapped now if no queued work can touch it (its stream has
// run past a tick after b became free), else lent if it is s's (work on
// the new block is queued behind the old), else left alone.
func (s *Space) donorKind(b *pools.Block, rs cuda.Stream) pools.DonorKind {
	if !s.progress.Watched(b.Stream) {
		s.progress.Watch(b.Stream) // (stitching turned on after the stream grew)
	} else if s.progress.Passed(b.Stream, b.FreedAt) {
		return pools.DonorUnmap
	}
	if b.Stream == rs {
		return pools.DonorLend
	}
	s.stitch.stats.SkippedBusy++
	s.progress.WantMark(b.Stream)
	return pools.NoDonor
}

// lent is a block whose pages were lent (see the file comment): its old
// mapping is unmapped once its stream has run past clock.
type lent struct {
	b     *pools.Block
	clock uint64
	done  uint64 // bytes of the old mapping already unmapped (a failed unlend)
	chunk uint64 // the size of each of its physical allocations (pools.Donors)
}

// unlend unmaps the old mappings of the lent blocks whose streams have run
// past their lends, or, with all set (after a device synchronize), of all
// of them. A block whose unmap fails stays lent, its old mapping (and the
// physical memory it holds) tried again at the next unlend (reported; op
// names the operation). Never during a capture.
func (s *Space) unlend(all bool, op string) error {
	kept := s.stitch.lent[:0]
	var first error
	for _, l := range s.stitch.lent {
		if !all && !s.progress.Passed(l.b.Stream, l.clock) {
			kept = append(kept, l)
			continue
		}
		if err := s.unmapLent(&l, op); err != nil {
			first = cmp.Or(first, err)
			kept = append(kept, l)
			continue
		}
		s.cache.Unlend(l.b)
	}
	clear(s.stitch.lent[len(kept):])
	s.stitch.lent = kept
	return first
}

// unmapLent unmaps the old mapping of the lent block l.b, its chunks
// adjacent mappings (unmapRun), from l.done on (what a failed try left).
func (s *Space) unmapLent(l *lent, op string) error {
	b := l.b
	done, err := s.unmapRun(b.Ptr+cuda.Ptr(l.done), b.Size-l.done, func(uint64) uint64 { return l.chunk })
	l.done += done
	if err != nil {
		return s.fail(op, fmt.Sprintf("unmapping the old mapping of stitched page %#x on device %d (tried again later)", uintptr(b.Ptr+cuda.Ptr(l.done)), s.dev), err)
	}
	return nil
}

// stitchPrepare learns the watched streams' progress (and asks to learn
// more of rs, the stream of the growth) and unmaps the old mappings of the
// lent blocks it allows; it runs before a growth looks for its run, since
// unlent blocks merge. Never during a capture.
func (s *Space) stitchPrepare(rs cuda.Stream) {
	if !s.progress.Watching() {
		return
	}
	s.progress.Advance(rs)
	if err := s.unlend(false, "malloc"); err != nil {
		s.warn(err.Error())
	}
}

// stitchFor unmaps or lends, keeping their physical memory in the spares,
// up to the pages that growing r from start would map above the high-water
// mark, taken from free holes of the default pools; it returns the bytes it
// took.
// start's run is left alone, but the blocks around it may have changed:
// the caller looks for its run again. Never during a capture.
func (s *Space) stitchFor(r *pools.Request, start *pools.Block, unit uint64) uint64 {
	c := s.cache
	want := c.GrowthNeed(r, start, unit)
	// Only what would raise reserved memory above its peak moves: below
	// it, new pages cost no more than moved ones and leave the holes to
	// the requests that fit them (fewer misses, fewer remaps).
	if high := uint64(c.Stats.ReservedBytes[pools.StatAll].Peak); c.Reserved+want <= high {
		want = 0
	} else if c.Reserved < high {
		want -= high - c.Reserved
	}
	if want == 0 || !s.progress.Watching() {
		return 0
	}
	// The run start's growth covers: from start to what GrowthNeed counts,
	// bounded generously by want past the request; or, where the range
	// holds plenty of free memory, all of the range.
	seg := start.Seg
	lo := uint64(start.Ptr - seg.Base)
	hi := lo + r.Size + want + seg.PageSize
	if roomy(seg, r.Size) {
		lo, hi = 0, seg.Size
		s.stitch.stats.Fragmented++
	}
	if s.stitch.kind == nil {
		// Built once: a closure over r would move every malloc's
		// request to the heap.
		s.stitch.kind = func(b *pools.Block) pools.DonorKind { return s.donorKind(b, s.stitch.stream) }
	}
	s.stitch.stream = r.Stream
	donors, got, refused := s.gatherDonors(want, seg, lo, hi, s.stitch.donors[:0])
	if got < want && refused >= want-got && !s.stitch.noSync {
		// Other streams hold enough free pages that no mark certifies
		// idle: synchronizing certifies them all ("Synchronizing", above).
		if err := s.drv.DeviceSynchronize(s.dev); err != nil {
			s.warn(s.fail("malloc", fmt.Sprintf("synchronizing device %d to move other streams' idle pages (new memory is mapped instead)", s.dev), err).Error())
		} else {
			s.progress.Synchronized()
			s.stitch.stats.Syncs++
			clear(donors)
			donors, got, _ = s.gatherDonors(want, seg, lo, hi, donors[:0])
		}
	}
	// Lent pages go to the spares first: Map takes the newest spares
	// first, so the pages unmapped outright are used before lent ones, and
	// what a growth leaves unused (it failed, or the memory fraction
	// stopped it, or it needed less than GrowthNeed foresaw) is lent pages,
	// which go back where they were (restoreUnused), rather than pages
	// whose memory would outlive their release until their old mapping
	// goes.
	s.stitch.fresh = len(s.stitch.lent)
	s.stitch.pages = s.stitch.pages[:0]
	var unmapped uint64
	for _, dn := range donors {
		if !dn.Lend {
			continue
		}
		from := len(s.phys.spare)
		n, _ := c.UnmapDonor(dn, s.mapper) // (a loan makes no driver call)
		unmapped += n
		for _, h := range s.phys.spare[from:] {
			s.stitch.pages = append(s.stitch.pages, h.h)
		}
		s.stitch.lent = append(s.stitch.lent, lent{b: dn.B, clock: c.Clock(), chunk: dn.B.Seg.ChunkSize})
	}
	for _, dn := range donors {
		if dn.Lend {
			continue
		}
		n, err := c.UnmapDonor(dn, s.mapper)
		unmapped += n
		if err != nil {
			// What was unmapped is recorded; the rest stays mapped.
			s.warn(err.Error())
			break
		}
	}
	clear(donors) // no dangling block pointers in the scratch space
	s.stitch.donors = donors[:0]
	return unmapped
}

// gatherDonors appends to donors the free blocks whose pages a growth
// takes, up to want bytes, large pool first, and returns them with their
// bytes and those of the whole pages it passed over (other streams' pages
// no mark certifies idle: donorKind).
func (s *Space) gatherDonors(want uint64, seg *pools.Segment, lo, hi uint64, donors []pools.Donor) (_ []pools.Donor, got, refused uint64) {
	c := s.cache
	for _, p := range [2]*pools.BlockPool{c.Large, c.Small} {
		var n, r uint64
		donors, n, r = c.Donors(p, want-got, s.stitch.kind, seg, lo, hi, donors)
		refused += r
		if got += n; got >= want {
			break
		}
	}
	return donors, got, refused
}

// countRemaps records that Map used moved handles: used bytes of the
// donated ones (counted in pages of page bytes). The lent pages it did not
// use go back where they were (restoreUnused); the other leftover handles
// are released at once. Never during a capture.
func (s *Space) countRemaps(donated, used, page uint64) {
	lentPages := s.restoreUnused()
	n := min(donated, used) / page
	if n > 0 {
		s.stitch.stats.Remaps += int64(n)
		s.stitch.stats.RemappedBytes += int64(n * page)
		s.stitch.stats.Stitches++
	}
	s.stitch.stats.Lent += int64(lentPages)
	s.stitch.pages = s.stitch.pages[:0]
	s.phys.releaseSpares(s)
}

// restoreUnused gives the pages the growth in progress lent but Map did
// not use back to their blocks (pools.Restore), where their old mapping
// still holds them, and returns how many pages the growth kept lent. Were their
// handles released instead, their memory would stay with the old mapping
// until unlend while counted nowhere: reserved memory, and the memory
// fraction, would understate what the device holds. Map takes the newest
// spares first and each block's pages went in in ascending order, so a
// block's unused pages are its first ones.
func (s *Space) restoreUnused() (lentPages int) {
	ph := &s.phys
	k := 0
	kept := s.stitch.lent[:s.stitch.fresh]
	for _, l := range s.stitch.lent[s.stitch.fresh:] {
		b, seg := l.b, l.b.Seg
		page := seg.PageSize
		lentPages += int(b.Size / page)
		hs := s.stitch.pages[k : k+int(b.Size/l.chunk)]
		k += len(hs)
		u := 0
		for u < len(hs) && ph.takeHandle(hs[u]) {
			u++
		}
		if u > 0 {
			off := uint64(b.Ptr - seg.Base)
			for i, h := range hs[:u] {
				seg.SetChunk(off+uint64(i)*l.chunk, l.chunk, h)
			}
			size := uint64(u) * l.chunk
			l.b = s.cache.Restore(b, size)
			s.rec.Mapped(seg, off, size)
			lentPages -= int(size / page)
			if l.b == nil {
				continue
			}
		}
		kept = append(kept, l)
	}
	clear(s.stitch.lent[len(kept):])
	s.stitch.lent = kept
	return lentPages
}

// releaseStitch unmaps the old mappings of every lent block, after
// synchronizing the device, and forgets the streams' progress (empty_cache
// and the OOM retry give back what they can); the next miss learns it
// anew. op names the operation in errors. Never during a capture.
func (s *Space) releaseStitch(op string) error {
	if len(s.stitch.lent) > 0 {
		if err := s.drv.DeviceSynchronize(s.dev); err != nil {
			return s.fail(op, fmt.Sprintf("synchronizing device %d before unmapping the old mappings of stitched pages", s.dev), err)
		}
		if err := s.unlend(true, op); err != nil {
			return err
		}
	}
	s.progress.Reset()
	return nil
}
