package allocator

import (
	"cmp"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Expandable segments: the driver side of pools/expandable.go.
//
// With expandable_segments:True, growth no longer allocates a segment: each
// (pool, stream) pair, private pools included, has one reserved address range
// (or more, should one fill up) whose pages are mapped on demand. The page
// size is the driver's allocation granularity (2 MiB on current GPUs), the
// finest unit that can be mapped and unmapped alone. Growth of a large pool
// maps at least the mapping unit (expandable_map_unit_mb, 20 MiB by
// default; see mapUnit), so reserved memory may exceed what the blocks need
// by up to one unit per range; a private pool gives back what it mapped
// ahead when its capture ends (trimUnused). Reserving and mapping follow the
// rule of new segments: the thread is switched to relaxed capture mode, so
// both are legal during a capture, whose graph then owns the pages through
// its private pool. Unmapping happens only where ordinary segments are
// freed (empty_cache, the OOM retry, released private pools), at the end of
// routing to a pool (trimUnused) and on a stitching miss (stitch.go), each
// holding the capture gate (device.go): never while a capture may be under
// way.
//
// Physical allocations (chunks, one cuMemCreate and one cuMemMap each) are
// as large as one Map call's range allows, up to the range's ChunkSize:
// the mapping unit (20 MiB, PyTorch's large-pool page) in large pools, so
// that growth costs one create and one map per 20 MiB rather than per 2 MiB
// page (a GPT-2 forward's capture: 87 of each before, 11 now; each costs
// 10-26 us on the GPU), and access is set once per mapped run. cuMemUnmap
// takes whole mappings, so memory goes back only in whole chunks: empty_cache,
// the OOM retry and trimUnused release the chunks wholly inside free
// blocks (pools.wholePages). A growth touches the first chunk it maps, so a
// capture's pool keeps the chunk it used a part of (up to one unit less a
// page per range; PyTorch's 20 MiB pages and segments keep the same);
// trimUnused still gives back whole chunks above the used end (a range made
// page by page before the unit was raised). Small pools map page by page
// (their requests need less than a page), and so does the default large
// pool when stitching is on: stitching moves single pages out of holes,
// which with 20 MiB chunks would rarely hold a whole one (its private pools,
// never donors, are chunked).
// Running out of memory leaves nothing mapped (Map creates every page before
// mapping any). Nothing needs unmapping or releasing during a capture: Map
// reports the pages it did map, handles it could not use wait in spare for
// the next Map, and the rare pages that must be dropped during a capture (a
// failed cuMemSetAccess) are parked in orphans; both are released at the
// next release of cached memory.
//
// Reservation sizes: the default large pool reserves the device's capacity
// plus an eighth (as PyTorch does, so that pages unmapped in the middle of
// the range can be mapped again at its end); the small pools and the private
// pools an eighth of the capacity, since virtual address space, though large,
// is not endless and a process may hold many graphs. A request larger than
// that gets a range of its own size.

// orphan is physical memory to give back once no capture is under way: a
// mapping (p, size) to unmap, if size > 0, and its handle to release.
type orphan struct {
	p    cuda.Ptr
	size uint64
	h    cuda.MemHandle
}

// expandable reports whether growth maps pages of expandable segments. On
// first use it probes the driver's VMM support and warns once if it is
// missing. d.mu is held.
func (d *device) expandable() bool {
	if !d.wantExpandable {
		return false
	}
	if d.vmmState == 0 {
		d.vmmState = -1
		if d.vmm == nil {
			d.warn("expandable_segments:True: the CUDA driver has no virtual memory management API; using ordinary segments")
		} else if g, err := d.vmm.MemGranularity(d.id); err != nil || g == 0 {
			d.warn(fmt.Sprintf("expandable_segments:True: device %d does not support virtual memory management (granularity %d, %v); using ordinary segments", d.id, g, err))
		} else {
			// Pages of at least 2 MiB: a smaller granularity would only
			// multiply the driver calls.
			d.page = (pools.RoundLarge + g - 1) / g * g
			d.vmmState = 1
		}
	}
	return d.vmmState == 1
}

// growExpandable maps pages for r, reserving a new range if none has room.
// Running out of memory (or of the memory fraction) is (nil, nil), as in
// newSegment. d.mu is held.
func (d *device) growExpandable(r *pools.Request, capturing bool) (*pools.Block, error) {
	if d.stitch.on && !capturing {
		d.stitchPrepare()
	}
	start := d.cache.FindExpandable(r)
	if start == nil {
		size, err := d.reserveSize(r)
		if err != nil {
			return nil, driverError("malloc", err, "reading device %d's memory size", d.id)
		}
		var p cuda.Ptr
		err = d.withThreadRelaxed(func() (err error) {
			p, err = d.vmm.MemAddressReserve(d.id, size)
			return err
		})
		if errors.Is(err, cuda.ErrOutOfMemory) {
			return nil, nil
		}
		if err != nil {
			return nil, driverError("malloc", err, "reserving %d bytes of address space on device %d", size, d.id)
		}
		start = d.cache.AddExpandable(r, p, size, d.page, d.chunkSize(r))
	}
	unit := d.mapUnit(r)
	var donated uint64
	if d.stitch.on && !capturing {
		if r.Pool == d.cache.Large || r.Pool == d.cache.Small {
			d.ev.Watch(r.Stream)
		}
		if donated = d.stitchFor(r, start, unit); donated > 0 {
			start = d.cache.FindExpandable(r) // the blocks around start may have merged
		}
	}
	var b *pools.Block
	d.mapCapturing = capturing
	spares := d.spareBytes(^uint64(0))
	err := d.withThreadRelaxed(func() (err error) {
		b, err = d.cache.MapExpandable(r, start, d.mapper, unit)
		return err
	})
	if donated > 0 {
		d.countRemaps(donated, spares-min(spares, d.spareBytes(^uint64(0))), d.page)
	}
	d.stitch.limit = max(d.stitch.limit, d.cache.Reserved)
	switch {
	case errors.Is(err, cuda.ErrOutOfMemory), errors.Is(err, pools.ErrFraction):
		return nil, nil
	case err != nil:
		return nil, driverError("malloc", err, "mapping memory for a %d-byte block on device %d", r.Size, d.id)
	}
	return b, nil
}

// mapUnit is the least that growth maps at once in r's pool: the
// configured unit (expandable_map_unit_mb, 20 MiB by default, as PyTorch's
// large-pool pages) in large pools, one page in small ones, whose requests
// need less than a page. One Map call costs a cuMemSetAccess (about 26 us)
// whatever its size, so a capture that grows a pool by many small steps
// pays for every step; mapping ahead trades up to one unit of free mapped
// memory per range for fewer calls. d.mu is held.
func (d *device) mapUnit(r *pools.Request) uint64 {
	if r.Pool.Small {
		return d.page
	}
	return (max(d.mapUnitCfg, d.page) + d.page - 1) / d.page * d.page
}

// chunkSize is the most one physical allocation covers in a new range of
// r's pool: the mapping unit in large pools, as PyTorch's 20 MiB pages, so
// that growth costs one cuMemCreate and one cuMemMap per unit instead of
// one per 2 MiB page; one page in small pools (they map page by page) and
// in the default large pool when stitching is on, whose holes give single
// pages (pools.Donors). d.mu is held.
func (d *device) chunkSize(r *pools.Request) uint64 {
	if d.stitch.on && r.Pool == d.cache.Large {
		return d.page
	}
	return d.mapUnit(r)
}

// trimUnused gives back, when routing to pool id ends and no capture is
// under way, the pages its large pool mapped ahead and never handed out
// (pools.TrimUnused): a graph's pool then holds what its allocations
// needed, in whole pages, whatever the mapping unit. No work has touched
// those pages, so no synchronize is needed. It holds the capture gate
// (enterUnsafe) while it unmaps: a capture beginning on another device
// meanwhile would be invalidated. d.mu is held.
func (d *device) trimUnused(id PoolID) {
	if d.vmmState != 1 || d.mapUnitCfg <= d.page {
		return
	}
	pp := d.graphs.Pools.Get(id)
	if pp == nil || !d.enterUnsafe() {
		return
	}
	defer d.leaveUnsafe()
	if err := d.cache.TrimUnused(pp.Large, d.mapper); err != nil {
		d.warn(driverError("end_allocate_to_pool", err, "unmapping pages mapped ahead in pool {%d,%d} on device %d", id.A, id.B, d.id).Error())
	}
}

// unmapFree unmaps the free pages of p's expandable segments (UnmapFree),
// after synchronizing the device if there is anything to unmap: unlike
// cuMemFree, cuMemUnmap does not wait for work still using the memory
// (PyTorch synchronizes too). Never during a capture. d.mu is held.
func (d *device) unmapFree(p *pools.BlockPool) error {
	if d.vmmState != 1 || !p.Releasable() {
		return nil
	}
	if d.cache.HasUnmappable(p) {
		if err := d.drv.DeviceSynchronize(d.id); err != nil {
			return fmt.Errorf("synchronizing the device first: %w", err)
		}
	}
	return d.cache.UnmapFree(p, d.mapper)
}

// reserveSize is the address range reserved for a new expandable segment
// of r's pool (see the file comment).
func (d *device) reserveSize(r *pools.Request) (uint64, error) {
	total, err := d.capacity()
	if err != nil {
		return 0, err
	}
	size := total / 8
	if r.Pool == d.cache.Large {
		size += total
	}
	size = max(size, r.Size)
	return (size + d.page - 1) / d.page * d.page, nil
}

// vmmMapper is the pools.Mapper of a device, over its vmmDriver. Its
// methods run with d.mu held, Map on a thread in relaxed capture mode.
type vmmMapper struct{ d *device }

// Map creates the physical allocations (chunks of at most seg.ChunkSize,
// one cuMemCreate and one cuMemMap each), then maps them and sets access
// on what it mapped. It creates them all before mapping any, so that
// running out of memory part way leaves nothing mapped: the handles made
// are released at once, or, during a capture (when nothing may be
// released), kept as spares for the next Map. It does not start when the
// driver reports too little free memory, so that a request that cannot fit
// does not take the device's last pages with it. Spare handles (moved by
// stitching, or left by a capture) are used first and mapped even when the
// rest cannot be had (the error is then returned after): they take no new
// memory, and a handle lent by stitching must not be released while its
// old mapping lives (stitch.go). A spare is used only where it fits whole
// (at most the rest of the range and seg.ChunkSize), so that a range never
// holds a chunk larger than its ChunkSize.
func (m vmmMapper) Map(seg *pools.Segment, off, size uint64) (uint64, error) {
	d, page := m.d, seg.PageSize
	base := seg.Base + cuda.Ptr(off)
	limit := min(size, seg.ChunkSize)
	var short error // set: map only the spares, then fail with it
	if fresh := size - min(size, d.spareBytes(limit)); fresh > 0 {
		if free, _, err := d.drv.MemGetInfo(d.id); err == nil && free < fresh {
			if size == fresh {
				return 0, cuda.ErrOutOfMemory
			}
			size, short = size-fresh, cuda.ErrOutOfMemory
		}
	}
	hs := d.handles[:0]
	spares := 0
	var err error
	for n := uint64(0); n < size; {
		if h, ok := d.takeSpare(min(size-n, limit)); ok {
			hs = append(hs, h)
			n += h.size
			spares++
			continue
		}
		if short != nil {
			break // (only spares may be mapped; none fits what is left)
		}
		c := min(size-n, limit)
		var h cuda.MemHandle
		if h, err = d.vmm.MemCreate(d.id, c); err != nil {
			break
		}
		hs = append(hs, physical{h, c})
		n += c
	}
	d.handles = hs[:0]
	if err != nil {
		if spares == 0 {
			d.dropHandles(hs)
			return 0, err
		}
		short = err // map what there is
	}
	var done uint64
	for i, h := range hs {
		if err = d.vmm.MemMap(d.id, base+cuda.Ptr(done), h.size, h.h); err != nil {
			d.dropHandles(hs[i:])
			break
		}
		for o := uint64(0); o < h.size; o += page {
			seg.Pages[(off+done+o)/page] = h.h
		}
		done += h.size
	}
	if done == 0 {
		return 0, cmp.Or(err, short)
	}
	if aerr := d.vmm.MemSetAccess(d.id, base, done); aerr != nil {
		// Memory the device cannot reach must not be handed out.
		for o := uint64(0); o < done; {
			h := seg.Pages[(off+o)/page]
			n := seg.ChunkAt(off + o)
			for q := uint64(0); q < n; q += page {
				seg.Pages[(off+o+q)/page] = 0
			}
			d.dropPhysical(orphan{base + cuda.Ptr(o), n, h})
			o += n
		}
		return 0, aerr
	}
	d.record(actionSegmentMap, base, done, seg.Stream, seg.Pool.ID, d.hist.op)
	if off == 0 && seg.Context == 0 {
		// The segment's context is the one that mapped its start.
		seg.Context = d.hist.op
	}
	return done, cmp.Or(err, short)
}

// physical is a physical allocation (cuMemCreate) not mapped in any range.
type physical struct {
	h    cuda.MemHandle
	size uint64
}

// spareBytes is the bytes of the spare handles of at most limit bytes.
func (d *device) spareBytes(limit uint64) uint64 {
	var n uint64
	for _, h := range d.spare {
		if h.size <= limit {
			n += h.size
		}
	}
	return n
}

// takeSpare removes from d.spare and returns the newest spare handle of at
// most limit bytes, if any.
func (d *device) takeSpare(limit uint64) (physical, bool) {
	for i := len(d.spare) - 1; i >= 0; i-- {
		if h := d.spare[i]; h.size <= limit {
			d.spare = append(d.spare[:i], d.spare[i+1:]...)
			return h, true
		}
	}
	return physical{}, false
}

// dropHandles gives back handles that were not mapped: at once, or, while a
// capture may be under way, into the spares.
func (d *device) dropHandles(hs []physical) {
	for _, h := range hs {
		if d.mapCapturing || d.vmm.MemRelease(d.id, h.h) != nil {
			d.spare = append(d.spare, h)
		}
	}
}

// Unmap unmaps and releases each physical allocation of the range in turn
// (the range holds whole ones: pools unmaps whole chunks only). One whose
// unmap succeeded counts as unmapped even if its release fails; its handle
// then waits in spare (released at the next release of cached memory, or
// reused).
func (m vmmMapper) Unmap(seg *pools.Segment, off, size uint64) (uint64, error) {
	d, page := m.d, seg.PageSize
	var err error
	o := off
	for o < off+size {
		i := o / page
		p := seg.Base + cuda.Ptr(o)
		n := seg.ChunkAt(o)
		if o+n > off+size {
			err = fmt.Errorf("unmapping %#x: %d bytes would split a physical allocation of %d", uintptr(p), off+size-o, n)
			break
		}
		if err = d.vmm.MemUnmap(d.id, p, n); err != nil {
			err = fmt.Errorf("unmapping %#x: %w", uintptr(p), err)
			break
		}
		h := physical{seg.Pages[i], n}
		for q := uint64(0); q < n; q += page {
			seg.Pages[(o+q)/page] = 0
		}
		if d.stitch.keep {
			d.spare = append(d.spare, h) // to be mapped again (stitch.go)
		} else if rerr := d.vmm.MemRelease(d.id, h.h); rerr != nil {
			d.spare = append(d.spare, h)
		}
		o += n
	}
	if o > off {
		// Without an operation's context, the segment's, if the unmapped
		// range becomes the segment's start (as PyTorch, whose head block
		// carries it).
		var own uint64
		if h := seg.Head; off == 0 || h.Unmapped && h.End() == seg.Base+cuda.Ptr(off) {
			own = seg.Context
		}
		d.record(actionSegmentUnmap, seg.Base+cuda.Ptr(off), o-off, seg.Stream, seg.Pool.ID, d.hist.ctxOr(own))
	}
	return o - off, err
}

// Lend moves the handles of the pages of the range to d.spare, for the
// Map that follows; the old mapping stays until the stream's work allows
// unmapping it (stitch.go: lent).
func (m vmmMapper) Lend(seg *pools.Segment, off, size uint64) {
	d, page := m.d, seg.PageSize
	for o := off; o < off+size; o += page {
		i := o / page
		d.spare = append(d.spare, physical{seg.Pages[i], page}) // (pages: pools.Donors)
		seg.Pages[i] = 0
	}
	d.record(actionSegmentUnmap, seg.Base+cuda.Ptr(off), size, seg.Stream, seg.Pool.ID, d.hist.op)
}

// Free gives back a range with nothing mapped.
func (m vmmMapper) Free(seg *pools.Segment) error {
	d := m.d
	if err := d.vmm.MemAddressFree(d.id, seg.Base, seg.Size); err != nil {
		return fmt.Errorf("freeing the address range %#x: %w", uintptr(seg.Base), err)
	}
	return nil
}

// dropPhysical gives back a mapping and its handle after a failed map: at
// once, or after the captures if one may be under way.
func (d *device) dropPhysical(o orphan) {
	if d.mapCapturing {
		d.orphans = append(d.orphans, o)
		return
	}
	if d.releaseOrphan(&o) != nil {
		d.orphans = append(d.orphans, o) // tried again at the next release
	}
}

// releaseOrphan unmaps and releases o. Once the unmap succeeded, o records
// it (size 0), so that a retry after a failed release does not unmap twice.
func (d *device) releaseOrphan(o *orphan) error {
	if o.size > 0 {
		if err := d.vmm.MemUnmap(d.id, o.p, o.size); err != nil {
			return err
		}
		o.size = 0
	}
	return d.vmm.MemRelease(d.id, o.h)
}

// releaseOrphans gives back the parked physical memory and the spare
// handles. Never during a capture.
func (d *device) releaseOrphans(op string) error {
	for len(d.spare) > 0 {
		if err := d.vmm.MemRelease(d.id, d.spare[len(d.spare)-1].h); err != nil {
			return driverError(op, err, "releasing spare physical memory on device %d", d.id)
		}
		d.spare = d.spare[:len(d.spare)-1]
	}
	for len(d.orphans) > 0 {
		if err := d.releaseOrphan(&d.orphans[len(d.orphans)-1]); err != nil {
			return driverError(op, err, "releasing memory whose mapping failed on device %d", d.id)
		}
		d.orphans = d.orphans[:len(d.orphans)-1]
	}
	return nil
}
