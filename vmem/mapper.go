// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"cmp"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Physical allocations: made, mapped, unmapped and released here only.
//
// Running out of memory leaves nothing mapped (Map creates every chunk before
// mapping any). Nothing needs unmapping or releasing during a capture: Map
// reports the pages it did map, handles it could not use wait in the spares
// for the next Map, and the rare pages that must be dropped during a capture
// (a failed cuMemSetAccess) are parked in the orphans; both are released at
// the next Release. Unmap keeps the handles it unmaps in the spares, and its
// callers decide: stitching maps them again at once, release and trimming
// release them (releaseSpares). Every successful release of a handle also
// forgets its export and closes its descriptor (Space.released, export.go).

// physical is a physical allocation (cuMemCreate) not mapped in any range.
type physical struct {
	h    cuda.MemHandle
	size uint64
}

// orphan is physical memory to give back once no capture is under way: a
// mapping (p, size) to unmap, if size > 0, and its handle to release.
type orphan struct {
	p    cuda.Ptr
	size uint64
	h    cuda.MemHandle
}

// physicalMemory is the physical memory a Space holds outside its ranges'
// mappings.
type physicalMemory struct {
	// spare: created or unmapped, not mapped; the next Map uses them
	// first. A handle lent by stitching is among them until mapped.
	spare []physical
	// orphans: dropped while a capture may be under way.
	orphans []orphan
	// capturing: a capture may be under way during the Map in progress
	// (Grow's argument): what it drops waits instead of being released.
	capturing bool
	// freeEst: the device's free memory as last read, less what has been
	// created since (freeMemory, create).
	freeEst uint64
}

// mapper is a Space's pools.Mapper. Its methods run with the owner's lock
// held, Map on a thread in relaxed capture mode.
type mapper struct{ s *Space }

// Map creates the physical allocations (chunks of at most seg.ChunkSize,
// one cuMemCreate and one cuMemMap each), then maps them and sets access
// on what it mapped. It creates them all before mapping any, so that
// running out of memory part way leaves nothing mapped: the handles made
// are released at once, or, during a capture (when nothing may be
// released), kept as spares for the next Map. It does not start when the
// driver reports too little free memory (freeMemory), so that a request
// that cannot fit does not take the device's last pages with it. Spare
// handles (moved by stitching, or left by a capture) are used first and
// mapped even when the rest cannot be had (the error is then returned
// after): they take no new memory, and a handle lent by stitching must not
// be released while its old mapping lives (stitch.go). A spare is used only
// where it fits whole (at most the rest of the range and seg.ChunkSize), so
// that a range never holds a chunk larger than its ChunkSize.
func (m mapper) Map(seg *pools.Segment, off, size uint64) (uint64, error) {
	s := m.s
	ph := &s.phys
	base := seg.Base + cuda.Ptr(off)
	limit := min(size, seg.ChunkSize)
	var short error // set: map only the spares, then fail with it
	if fresh := size - min(size, ph.spareBytes(limit)); fresh > 0 {
		// During a capture what a failed growth created stays (as spares,
		// outside reserved memory) until the next Release: a growth that
		// takes more than one creation then reads afresh.
		exact := ph.capturing && fresh > limit
		if free, ok := s.freeMemory(fresh, exact); ok && free < fresh {
			if size == fresh {
				return 0, cuda.ErrOutOfMemory
			}
			size, short = size-fresh, cuda.ErrOutOfMemory
		}
	}
	hs, spare := s.handles[:0], s.fromSpare[:0]
	spares := 0
	var err error
	for n := uint64(0); n < size; {
		if h, ok := ph.takeSpare(min(size-n, limit)); ok {
			hs, spare = append(hs, h), append(spare, true)
			n += h.size
			spares++
			continue
		}
		if short != nil {
			break // (only spares may be mapped; none fits what is left)
		}
		c := min(size-n, limit)
		var h cuda.MemHandle
		if h, err = s.create(c); err != nil {
			break
		}
		hs, spare = append(hs, physical{h, c}), append(spare, false)
		n += c
	}
	s.handles, s.fromSpare = hs[:0], spare[:0]
	if err != nil {
		if spares == 0 {
			ph.dropHandles(s, hs)
			return 0, err
		}
		short = err // map what there is
	}
	var done uint64
	for i, h := range hs {
		if err = s.drv.MemMap(s.dev, base+cuda.Ptr(done), h.size, h.h); err != nil {
			// The spares go back where they were: a handle stitching lent
			// must outlive its old mapping (restoreUnused gives it back).
			for j := i; j < len(hs); j++ {
				if spare[j] {
					ph.spare = append(ph.spare, hs[j])
				} else {
					ph.dropHandles(s, hs[j:j+1])
				}
			}
			break
		}
		seg.SetChunk(off+done, h.size, h.h)
		done += h.size
	}
	if done == 0 {
		return 0, cmp.Or(err, short)
	}
	if aerr := s.drv.MemSetAccess(s.dev, base, done); aerr != nil {
		// Memory the device cannot reach must not be handed out. Mapped
		// spares go back to the spares once unmapped, as above (during a
		// capture, when nothing may be unmapped, they are dropped later).
		var o uint64
		for i := 0; o < done; i++ {
			h := hs[i]
			seg.SetChunk(off+o, h.size, 0)
			p := base + cuda.Ptr(o)
			if spare[i] && !ph.capturing && s.drv.MemUnmap(s.dev, p, h.size) == nil {
				ph.spare = append(ph.spare, h)
			} else {
				ph.dropPhysical(s, orphan{p, h.size, h.h})
			}
			o += h.size
		}
		return 0, aerr
	}
	s.rec.Mapped(seg, off, done)
	return done, cmp.Or(err, short)
}

// freeMemory returns the device's free memory as far as Map needs it: to
// refuse a growth of need new bytes that cannot fit. cuMemGetInfo costs
// about 7 us on an idle device and 9-72 us inside a capture, where a
// capture's growth would pay it at every Map, so the reading is kept, less
// what is created since (create: growth and resumes), and read again when
// that estimate comes within 1/16 of the device (at least 1 GiB) of need,
// or when exact asks for a reading. Allocations made since the reading by
// other processes, or by this one outside create (ordinary segments, a
// pool's segment source, libraries), can make the estimate too high: a
// creation then fails as out of memory and the next Map reads again. What
// the failed growth created is released at once, or, during a capture, kept
// as spares: Map asks for an exact reading there when a growth takes more
// than one creation. ok is false when the driver cannot say (the check is
// advice: growth goes ahead).
func (s *Space) freeMemory(need uint64, exact bool) (free uint64, ok bool) {
	ph := &s.phys
	margin := uint64(1 << 30)
	if total, err := s.capacity(); err == nil {
		margin = max(margin, total/16)
	}
	if !exact && ph.freeEst >= need && ph.freeEst-need >= margin {
		return ph.freeEst, true
	}
	free, _, err := s.drv.MemGetInfo(s.dev)
	if err != nil {
		ph.freeEst = 0
		return 0, false
	}
	ph.freeEst = free
	return free, true
}

// create creates a physical allocation of size bytes, shareable with the
// device's handle kind once chosen (export.go): Map and a resume
// (pause.go) create every allocation a Space maps.
// It keeps freeMemory's estimate: less what it creates, and read again
// after a failure.
func (s *Space) create(size uint64) (h cuda.MemHandle, err error) {
	if k := s.share.kind; k != 0 {
		h, err = s.share.drv.MemCreateShareable(s.dev, size, k)
	} else {
		h, err = s.drv.MemCreate(s.dev, size)
	}
	if ph := &s.phys; err != nil {
		ph.freeEst = 0
	} else {
		ph.freeEst -= min(ph.freeEst, size)
	}
	return h, err
}

// Unmap unmaps the physical allocations of the range (the range holds
// whole ones: pools unmaps whole chunks only), in one call where it can
// (unmapRun), and keeps their handles in the spares (see the file comment),
// with their exports if they have one (export.go: a move keeps the
// descriptor, a release closes it).
func (m mapper) Unmap(seg *pools.Segment, off, size uint64) (uint64, error) {
	s, page := m.s, seg.PageSize
	end := off
	for end < off+size {
		n := seg.ChunkAt(end)
		if end+n > off+size {
			break
		}
		end += n
	}
	var err error
	if end < off+size {
		err = fmt.Errorf("unmapping %#x: %d bytes would split a physical allocation of %d", uintptr(seg.Base+cuda.Ptr(end)), off+size-end, seg.ChunkAt(end))
	}
	done, uerr := s.unmapRun(seg.Base+cuda.Ptr(off), end-off, func(o uint64) uint64 { return seg.ChunkAt(off + o) })
	for o := off; o < off+done; {
		n := seg.ChunkAt(o)
		s.phys.spare = append(s.phys.spare, physical{seg.Page(o / page), n})
		seg.SetChunk(o, n, 0)
		o += n
	}
	if done > 0 {
		s.rec.Unmapped(seg, off, done, false)
	}
	return done, cmp.Or(uerr, err)
}

// unmapRun unmaps the size bytes at p, a run of whole adjacent mappings
// (chunk(o): the size of the one at offset o), and returns the bytes it
// unmapped. A move unmaps a hole's pages, each its own mapping, so one
// cuMemUnmap over the run (as CUDA's own samples unmap a range mapped in
// parts) saves a call per page. Where that call fails, the mappings are
// unmapped one by one; if they all unmap and no run ever did, the driver
// takes no runs, and is asked mapping by mapping from then on
// (Space.unmapOne).
func (s *Space) unmapRun(p cuda.Ptr, size uint64, chunk func(o uint64) uint64) (uint64, error) {
	var runErr error
	if !s.unmapOne && size > 0 && chunk(0) < size {
		if runErr = s.drv.MemUnmap(s.dev, p, size); runErr == nil {
			s.unmapRuns = true
			return size, nil
		}
	}
	var o uint64
	for o < size {
		n := chunk(o)
		if err := s.drv.MemUnmap(s.dev, p+cuda.Ptr(o), n); err != nil {
			return o, fmt.Errorf("unmapping %#x: %w", uintptr(p+cuda.Ptr(o)), err)
		}
		o += n
	}
	if runErr != nil && !s.unmapRuns {
		s.unmapOne = true
	}
	return o, nil
}

// Lend moves the handles of the pages of the range to the spares, for the
// Map that follows; the old mapping stays until the stream's work allows
// unmapping it (stitch.go: lent).
func (m mapper) Lend(seg *pools.Segment, off, size uint64) {
	s, page := m.s, seg.PageSize
	for o := off; o < off+size; {
		n := seg.ChunkAt(o) // (whole chunks: pools.Donors)
		s.phys.spare = append(s.phys.spare, physical{seg.Page(o / page), n})
		seg.SetChunk(o, n, 0)
		o += n
	}
	s.rec.Unmapped(seg, off, size, true)
}

// Free gives back a range with nothing mapped.
func (m mapper) Free(seg *pools.Segment) error {
	s := m.s
	if err := s.drv.MemAddressFree(s.dev, seg.Base, seg.Size); err != nil {
		return fmt.Errorf("freeing the address range %#x: %w", uintptr(seg.Base), err)
	}
	return nil
}

// spareBytes is the bytes of the spare handles of at most limit bytes.
func (ph *physicalMemory) spareBytes(limit uint64) uint64 {
	var n uint64
	for _, h := range ph.spare {
		if h.size <= limit {
			n += h.size
		}
	}
	return n
}

// takeSpare removes from the spares and returns the newest spare handle of
// at most limit bytes, if any.
func (ph *physicalMemory) takeSpare(limit uint64) (physical, bool) {
	for i := len(ph.spare) - 1; i >= 0; i-- {
		if h := ph.spare[i]; h.size <= limit {
			ph.spare = append(ph.spare[:i], ph.spare[i+1:]...)
			return h, true
		}
	}
	return physical{}, false
}

// takeHandle removes h from the spares, and reports whether it was there.
func (ph *physicalMemory) takeHandle(h cuda.MemHandle) bool {
	for i := len(ph.spare) - 1; i >= 0; i-- {
		if ph.spare[i].h == h {
			ph.spare = append(ph.spare[:i], ph.spare[i+1:]...)
			return true
		}
	}
	return false
}

// dropHandles gives back handles that were not mapped: at once, or, while a
// capture may be under way, into the spares.
func (ph *physicalMemory) dropHandles(s *Space, hs []physical) {
	for _, h := range hs {
		if ph.capturing || s.drv.MemRelease(s.dev, h.h) != nil {
			ph.spare = append(ph.spare, h)
		} else {
			s.released(h.h)
		}
	}
}

// dropPhysical gives back a mapping and its handle after a failed map: at
// once, or after the captures if one may be under way.
func (ph *physicalMemory) dropPhysical(s *Space, o orphan) {
	if ph.capturing {
		ph.orphans = append(ph.orphans, o)
		return
	}
	if ph.releaseOrphan(s, &o) != nil {
		ph.orphans = append(ph.orphans, o) // tried again at the next release
	}
}

// releaseOrphan unmaps and releases o. Once the unmap succeeded, o records
// it (size 0), so that a retry after a failed release does not unmap twice.
func (ph *physicalMemory) releaseOrphan(s *Space, o *orphan) error {
	if o.size > 0 {
		if err := s.drv.MemUnmap(s.dev, o.p, o.size); err != nil {
			return err
		}
		o.size = 0
	}
	if err := s.drv.MemRelease(s.dev, o.h); err != nil {
		return err
	}
	s.released(o.h)
	return nil
}

// releaseSpares releases the spare handles (a release that fails leaves
// its handle there for releaseOrphans). Never during a capture.
func (ph *physicalMemory) releaseSpares(s *Space) {
	kept := ph.spare[:0]
	for _, h := range ph.spare {
		if s.drv.MemRelease(s.dev, h.h) != nil {
			kept = append(kept, h)
		} else {
			s.released(h.h)
		}
	}
	ph.spare = kept
}

// releaseOrphans gives back the orphans and the spare handles, or fails with the
// first error. Never during a capture.
func (ph *physicalMemory) releaseOrphans(s *Space, op string) error {
	for len(ph.spare) > 0 {
		h := ph.spare[len(ph.spare)-1].h
		if err := s.drv.MemRelease(s.dev, h); err != nil {
			return s.fail(op, fmt.Sprintf("releasing spare physical memory on device %d", s.dev), err)
		}
		s.released(h)
		ph.spare = ph.spare[:len(ph.spare)-1]
	}
	for len(ph.orphans) > 0 {
		if err := ph.releaseOrphan(s, &ph.orphans[len(ph.orphans)-1]); err != nil {
			return s.fail(op, fmt.Sprintf("releasing memory whose mapping failed on device %d", s.dev), err)
		}
		ph.orphans = ph.orphans[:len(ph.orphans)-1]
	}
	return nil
}

// empty reports whether nothing is held.
func (ph *physicalMemory) empty() bool { return len(ph.spare)+len(ph.orphans) == 0 }
