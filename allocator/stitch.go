package allocator

import (
	"cmp"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Stitching (stitch:True): free physical pages move to where a miss needs
// them instead of new memory being mapped. The idea is GMLake's (ASPLOS
// 2024); pools/stitch.go has the block side.
//
// # Design
//
// On a miss that grows an expandable segment (no capture under way), for
// the part of the growth that would raise reserved memory above its
// high-water mark (limit), stitchFor takes whole pages inside free blocks of
// the default pools' expandable segments (any stream, either size class,
// holes of the request's own range outside the run it grows into) and puts
// their physical handles in d.spare, which Map uses before creating any.
// Reserved memory stays the same. Below the limit new pages cost no more
// than moved ones and the holes stay for the requests that fit them.
//
// A page is taken in one of two ways:
//   - Unmapped at once, when no queued work can touch it. cuMemUnmap does
//     not wait for such work (PyTorch synchronizes before it unmaps), and a
//     free block may have kernels that used it still queued on its own
//     stream (other streams' uses were waited for before the block became
//     free: events.go). Each stream that owns donor candidates keeps up to
//     markerDepth marker events, recorded at successive misses, each right
//     after the cache's clock ticks; once one has completed, every block of
//     the stream freed before its tick (Block.FreedAt) is idle. Markers
//     complete in stream order, so only the oldest pending are queried. On
//     an idle stream a new marker completes at once. Nothing waits.
//   - Lent, when it is not certified idle but belongs to the requesting
//     stream: its handle is mapped at the new place at once (work on the new
//     block is queued behind the old work, as for any reuse of a cached
//     block on its stream), and its old mapping stays, the block Lent,
//     neither free nor mappable, until a marker recorded after the lend
//     has completed (stitchPrepare, at a later miss) or empty_cache and the
//     OOM retry synchronize the device (releaseStitch). Without lending a
//     GPU running behind the host would leave almost nothing to move.
//
// Private pools (graphs, MemPools) neither give pages nor are searched: a
// graph's replays use memory its pool counts as free. Nothing is stitched
// or unlent while any capture may be under way: unmapping is illegal then.
// Pages moved are counted (StitchStats; the snapshot's stitch_remaps and
// stitch_lent).
//
// Before any other unmapping (empty_cache, the OOM retry) the device is
// synchronized, for the same reason (unmapFree).

// stitchState is a device's stitching state, guarded by its mu.
type stitchState struct {
	on     bool          // the configuration asks for stitching
	lent   []lent        // blocks whose old mapping waits to be unmapped
	donors []pools.Donor // scratch
	// kind is donorKind for a request on stream (stitchFor's).
	kind   func(*pools.Block) pools.DonorKind
	stream cuda.Stream
	// keep makes the mapper's Unmap keep the handles it unmaps (in
	// d.spare) instead of releasing them.
	keep bool
	// limit is the most memory the device has had reserved after a
	// growth: stitching keeps growth from going above it, and growth that
	// goes above it all the same (too few idle pages) raises it.
	limit uint64
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
}

// StitchStats returns device dev's stitching counters.
func (a *Allocator) StitchStats(dev int) (StitchStats, error) {
	d, err := a.device("stitch_stats", dev)
	if err != nil {
		return StitchStats{}, err
	}
	d.lock()
	defer d.mu.Unlock()
	return d.stitch.stats, nil
}

// recordable reports whether a mark may be recorded on s now: not while s
// is in a capture nobody announced, where the event would be captured, not
// recorded (an error counts as capturing).
func (d *device) recordable(s cuda.Stream) bool {
	if d.announced.Load() {
		return true
	}
	st, _, err := d.drv.StreamCaptureInfo(d.id, s)
	return err == nil && st == cuda.CaptureNone
}

// donorKind is the verdict on the free block b as a donor for a request
// on stream s: unmapped now if no queued work can touch it (its stream's
// marker certifies a tick after b became free), else lent if it is s's
// (work on the new block is queued behind the old), else left alone.
// d.mu is held.
func (d *device) donorKind(b *pools.Block, s cuda.Stream) pools.DonorKind {
	if !d.ev.Watched(b.Stream) {
		d.ev.Watch(b.Stream) // (stitching turned on after the stream grew)
	} else if d.ev.Passed(b.Stream, b.FreedAt) {
		return pools.DonorUnmap
	}
	if b.Stream == s {
		return pools.DonorLend
	}
	d.stitch.stats.SkippedBusy++
	return pools.NoDonor
}

// lent is a block whose pages were lent (see the file comment): its old
// mapping is unmapped once a marker of its stream recorded after clock
// has completed.
type lent struct {
	b     *pools.Block
	clock uint64
	done  uint64 // bytes of the old mapping already unmapped (a failed unlend)
}

// unlend unmaps the old mappings of the lent blocks whose streams'
// markers allow it, or, with all set (after a device synchronize), of all
// of them. A block whose unmap fails stays lent, its old mapping (and the
// physical memory it holds) tried again at the next unlend (reported; op
// names the operation). Never during a capture. d.mu is held.
func (d *device) unlend(all bool, op string) error {
	kept := d.stitch.lent[:0]
	var first error
	for _, l := range d.stitch.lent {
		if !all && !d.ev.Passed(l.b.Stream, l.clock) {
			kept = append(kept, l)
			continue
		}
		if err := d.unmapLent(&l, op); err != nil {
			first = cmp.Or(first, err)
			kept = append(kept, l)
			continue
		}
		d.cache.Unlend(l.b)
	}
	clear(d.stitch.lent[len(kept):])
	d.stitch.lent = kept
	return first
}

// unmapLent unmaps the old mapping of the lent block l.b, page by page as
// it was mapped, from l.done on (what a failed try left). d.mu is held.
func (d *device) unmapLent(l *lent, op string) error {
	b := l.b
	page := b.Seg.PageSize
	for ; l.done < b.Size; l.done += page {
		p := b.Ptr + cuda.Ptr(l.done)
		if err := d.vmm.MemUnmap(d.id, p, page); err != nil {
			return driverError(op, err, "unmapping the old mapping of stitched page %#x on device %d (tried again later)", uintptr(p), d.id)
		}
	}
	return nil
}

// stitchPrepare advances the markers and unmaps the old mappings of the
// lent blocks they allow; it runs before a growth looks for its run, since
// unlent blocks merge. Never during a capture. d.mu is held.
func (d *device) stitchPrepare() {
	if !d.ev.Watching() {
		return
	}
	d.ev.Advance(d.cache, d.recordable, d.ret)
	if err := d.unlend(false, "malloc"); err != nil {
		d.warn(err.Error())
	}
}

// stitchFor unmaps or lends, keeping their physical memory in d.spare, up
// to the pages that growing r from start would map above the limit, taken
// from free holes of the default pools; it returns the bytes it took.
// start's run is left alone, but the blocks around it may have changed:
// the caller looks for its run again. Never during a capture. d.mu is held.
func (d *device) stitchFor(r *pools.Request, start *pools.Block, unit uint64) uint64 {
	want := d.cache.GrowthNeed(r, start, unit)
	// Only what would raise reserved memory above the limit moves: below
	// it, new pages cost no more than moved ones and leave the holes to
	// the requests that fit them (fewer misses, fewer remaps).
	if high := d.stitch.limit; d.cache.Reserved+want <= high {
		want = 0
	} else if d.cache.Reserved < high {
		want -= high - d.cache.Reserved
	}
	if want == 0 || !d.ev.Watching() {
		return 0
	}
	// The run start's growth covers: from start to what GrowthNeed counts,
	// bounded generously by want past the request.
	seg := start.Seg
	lo := uint64(start.Ptr - seg.Base)
	hi := lo + r.Size + want + seg.PageSize
	donors := d.stitch.donors[:0]
	var got uint64
	if d.stitch.kind == nil {
		// Built once: a closure over r would move every malloc's
		// request to the heap.
		d.stitch.kind = func(b *pools.Block) pools.DonorKind { return d.donorKind(b, d.stitch.stream) }
	}
	d.stitch.stream = r.Stream
	kind := d.stitch.kind
	for _, p := range [2]*pools.BlockPool{d.cache.Large, d.cache.Small} {
		var n uint64
		donors, n = d.cache.Donors(p, want-got, kind, seg, lo, hi, donors)
		if got += n; got >= want {
			break
		}
	}
	var unmapped uint64
	d.stitch.keep = true
	for _, dn := range donors {
		n, err := d.cache.UnmapDonor(dn, d.mapper)
		unmapped += n
		if dn.Lend {
			d.stitch.lent = append(d.stitch.lent, lent{b: dn.B, clock: d.cache.Clock()})
			d.stitch.stats.Lent += int64(n / dn.B.Seg.PageSize)
		}
		if err != nil {
			// What was unmapped is recorded; the rest stays mapped.
			d.warn(err.Error())
			break
		}
	}
	d.stitch.keep = false
	clear(donors) // no dangling block pointers in the scratch space
	d.stitch.donors = donors[:0]
	return unmapped
}

// countRemaps records that Map used moved handles: used bytes of the
// donated ones (counted in pages of page bytes). Leftover handles are released at once
// (Map uses every spare unless the driver failed; a lent handle released
// then keeps its memory until its old mapping goes at unlend, and the
// driver counts it meanwhile). d.mu is held; never during a capture.
func (d *device) countRemaps(donated, used, page uint64) {
	n := min(donated, used) / page
	if n > 0 {
		d.stitch.stats.Remaps += int64(n)
		d.stitch.stats.RemappedBytes += int64(n * page)
		d.stitch.stats.Stitches++
	}
	d.releaseSpares()
}

// releaseSpares releases the unmapped handles kept in d.spare (a release
// that fails leaves its handle there for releaseOrphans). Never during a
// capture. d.mu is held.
func (d *device) releaseSpares() {
	kept := d.spare[:0]
	for _, h := range d.spare {
		if d.vmm.MemRelease(d.id, h.h) != nil {
			kept = append(kept, h)
		}
	}
	d.spare = kept
}

// releaseStitch unmaps the old mappings of every lent block, after
// synchronizing the device, and destroys the marker events (empty_cache
// and the OOM retry give back what they can); the next miss records new
// ones. op names the operation in errors. Never during a capture. d.mu is
// held.
func (d *device) releaseStitch(op string) error {
	if len(d.stitch.lent) > 0 {
		if err := d.drv.DeviceSynchronize(d.id); err != nil {
			return driverError(op, err, "synchronizing device %d before unmapping the old mappings of stitched pages", d.id)
		}
		if err := d.unlend(true, op); err != nil {
			return err
		}
	}
	d.ev.ResetProgress()
	return nil
}
