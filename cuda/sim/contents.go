// SPDX-License-Identifier: Apache-2.0

package sim

import (
	"github.com/cudapool/cudapool/cuda"
)

// Memory contents: the bytes of device and pinned host memory, for tests
// that check that memory shared with another process shows the same bytes,
// or that a pause and resume keep every byte.
//
// Design note.
//   - Bytes belong to the physical allocation, not to the address: a
//     *memory (share.go) holds them, one per cuMemCreate allocation, which
//     every process that imported it maps, and one per MemAlloc allocation,
//     made when its contents are first touched (allocContents). So a write
//     through one process's mapping is read through another's, a handle
//     mapped twice shows the same bytes at both addresses, and remapping a
//     handle (unmap, map elsewhere) keeps its bytes. When the last reference
//     goes (memory.unref: every process's handle released and unmapped,
//     every exported descriptor closed; or MemFree) the bytes go too, so
//     memory newly mapped at the same address reads as zeros.
//   - One representation for every buffer, device or pinned host: sparse
//     pages of 64 KiB made at their first write, an absent page reading as
//     zeros, so a 40 GiB allocation costs only the pages that hold bytes,
//     and a copy visits only those (copyPages).
//   - Always on. Nothing is stored until something writes, so a test that
//     never writes pays one small record per asynchronous copy and nothing
//     else; and memory shared across processes cannot have a per-process
//     switch that both sides agree on.
//   - WriteDevice and ReadDevice stand for kernels (immediate, as if the
//     caller had synchronised): the range must be accessible memory of the
//     device, a MemAlloc allocation or mapped with access set, and may span
//     several allocations; otherwise ErrInvalidValue, and nothing is
//     written. WriteHost and ReadHost stand for the CPU, on one live pinned
//     allocation (copy.go).
//   - An asynchronous copy (copy.go) resolves its device range to physical
//     memory when it is queued and moves its bytes when its stream completes
//     it: every place that advances a stream's completed count calls
//     applyCopies, which applies the completed copies in the order they
//     were queued. A queued copy keeps the bytes of the memory it names
//     (memory.copies) even if that memory goes first: it reads what was
//     there, as the driver's copy, already running, would.
//
// Lock order: Driver.mu, then machine.mu. Pinned host bytes are the
// process's own (Driver.mu); device bytes may be shared (machine.mu).

// contentPage is the unit of the sparse content store.
const contentPage = 64 << 10

// pages is sparse memory: page index -> bytes; an absent page is zeros.
type pages map[uint64]*[contentPage]byte

// read fills dst with the bytes at off.
func (pg pages) read(off uint64, dst []byte) {
	for len(dst) > 0 {
		i, o := off/contentPage, off%contentPage
		n := min(uint64(len(dst)), contentPage-o)
		if p := pg[i]; p != nil {
			copy(dst[:n], p[o:])
		} else {
			clear(dst[:n])
		}
		dst, off = dst[n:], off+n
	}
}

// write stores src at off, making the map and the pages it needs.
func (pg *pages) write(off uint64, src []byte) {
	for len(src) > 0 {
		i, o := off/contentPage, off%contentPage
		n := min(uint64(len(src)), contentPage-o)
		if *pg == nil {
			*pg = make(pages)
		}
		p := (*pg)[i]
		if p == nil {
			p = new([contentPage]byte)
			(*pg)[i] = p
		}
		copy(p[o:], src[:n])
		src, off = src[n:], off+n
	}
}

// copyPages copies n bytes from src at soff to dst at doff (src and dst
// distinct), making pages in dst only where src holds bytes. It visits the
// pages of the range or the pages that hold bytes, whichever are fewer.
func copyPages(dst *pages, doff uint64, src pages, soff, n uint64) {
	held := uint64(len(src) + len(*dst))
	switch {
	case held == 0 || n == 0:
		return
	case held < n/contentPage+2:
		for i, dp := range *dst {
			lo, hi := max(doff, i*contentPage), min(doff+n, (i+1)*contentPage)
			if lo < hi {
				clear(dp[lo-i*contentPage : hi-i*contentPage])
			}
		}
		for i, sp := range src {
			lo, hi := max(soff, i*contentPage), min(soff+n, (i+1)*contentPage)
			if lo < hi {
				dst.write(doff+lo-soff, sp[lo-i*contentPage:hi-i*contentPage])
			}
		}
		return
	}
	for n > 0 {
		k := min(n, contentPage-soff%contentPage, contentPage-doff%contentPage)
		sp := src[soff/contentPage]
		so, do := soff%contentPage, doff%contentPage
		switch dp := (*dst)[doff/contentPage]; {
		case sp != nil:
			dst.write(doff, sp[so:so+k])
		case dp != nil:
			clear(dp[do : do+k])
		}
		soff, doff, n = soff+k, doff+k, n-k
	}
}

// physSeg is part of a device range: n bytes at off in one physical
// allocation.
type physSeg struct {
	mem    *memory
	off, n uint64
}

// pendingCopy is a copy queued on a stream, not yet applied.
type pendingCopy struct {
	s       cuda.Stream
	seq     uint64 // complete when s's completed count reaches it
	toHost  bool
	dev     []physSeg
	host    *hostAlloc
	hostOff uint64
}

// mappedAt returns the mapping of dv that holds address p and p's offset in
// it; mu must be held.
func (dv *device) mappedAt(p cuda.Ptr) (*mapping, uint64, bool) {
	q, ok := dv.vmm.pages[p/Granularity*Granularity]
	if !ok {
		return nil, 0, false
	}
	return dv.vmm.mappings[q], uint64(p - q), true
}

// backing resolves [p, p+size) of device dev into the physical memory that
// backs it, or false if any byte of it is not accessible memory of dev (a
// MemAlloc allocation, or mapped with access set); d.mu is held.
func (d *Driver) backing(dv *device, dev int, p cuda.Ptr, size uint64) ([]physSeg, bool) {
	if size == 0 || uint64(p)+size < uint64(p) {
		return nil, false
	}
	var segs []physSeg
	for q, left := p, size; left > 0; {
		if m, off, ok := dv.mappedAt(q); ok {
			if !m.accessible {
				return nil, false
			}
			n := min(left, m.size-off)
			segs = append(segs, physSeg{m.phys.mem, off, n})
			q, left = q+cuda.Ptr(n), left-n
			continue
		}
		found := false
		for base, sz := range dv.live {
			if q >= base && uint64(q-base) < sz {
				off := uint64(q - base)
				n := min(left, sz-off)
				segs = append(segs, physSeg{d.allocContents(dv, dev, base, sz), off, n})
				q, left = q+cuda.Ptr(n), left-n
				found = true
				break
			}
		}
		if !found {
			return nil, false
		}
	}
	return segs, true
}

// allocContents returns the memory that holds the bytes of dv's MemAlloc
// allocation at base, making it on first use; d.mu is held.
func (d *Driver) allocContents(dv *device, dev int, base cuda.Ptr, size uint64) *memory {
	if m := dv.allocMem[base]; m != nil {
		return m
	}
	if dv.allocMem == nil {
		dv.allocMem = make(map[cuda.Ptr]*memory)
	}
	m := newMemory(d, dev, size, 0)
	dv.allocMem[base] = m
	return m
}

// freeContents lets go of the bytes of dv's MemAlloc allocation at base,
// which MemFree is freeing; d.mu is held.
func (dv *device) freeContents(base cuda.Ptr) {
	m := dv.allocMem[base]
	if m == nil {
		return
	}
	delete(dv.allocMem, base)
	machine.mu.Lock()
	defer machine.mu.Unlock()
	m.unref()
}

// queueCopy records a copy the stream s will complete as its seq-th unit of
// work; d.mu is held.
func (d *Driver) queueCopy(pc *pendingCopy) {
	machine.mu.Lock()
	for _, sg := range pc.dev {
		sg.mem.copies++
	}
	machine.mu.Unlock()
	d.cp.pending = append(d.cp.pending, pc)
}

// applyCopies applies the queued copies whose streams have completed them,
// in the order they were queued. Every place that advances a stream's
// completed count calls it; d.mu is held.
func (d *Driver) applyCopies() {
	cs := &d.cp
	if len(cs.pending) == 0 {
		return
	}
	machine.mu.Lock()
	defer machine.mu.Unlock()
	kept := cs.pending[:0]
	for _, pc := range cs.pending {
		if d.stream(pc.s).completed < pc.seq {
			kept = append(kept, pc)
			continue
		}
		off := pc.hostOff
		for _, sg := range pc.dev {
			if pc.toHost {
				copyPages(&pc.host.data, off, sg.mem.data, sg.off, sg.n)
			} else {
				copyPages(&sg.mem.data, sg.off, pc.host.data, off, sg.n)
			}
			off += sg.n
			sg.mem.copies--
			if sg.mem.gone && sg.mem.copies == 0 {
				sg.mem.data = nil
			}
		}
	}
	clear(cs.pending[len(kept):])
	cs.pending = kept
}

// WriteDevice writes data at p on dev, as a kernel would (immediately). The
// range must be accessible memory of dev, and may span allocations; else
// it is ErrInvalidValue and nothing is written.
func (d *Driver) WriteDevice(dev int, p cuda.Ptr, data []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.deviceBytes(dev, p, data, true)
}

// ReadDevice returns n bytes at p on dev, as a kernel would see them (zeros
// where nothing was written), under WriteDevice's rules.
func (d *Driver) ReadDevice(dev int, p cuda.Ptr, n uint64) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	buf := make([]byte, n)
	if err := d.deviceBytes(dev, p, buf, false); err != nil {
		return nil, err
	}
	return buf, nil
}

// deviceBytes writes buf at p on dev, or reads into it; d.mu is held.
func (d *Driver) deviceBytes(dev int, p cuda.Ptr, buf []byte, write bool) error {
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	if len(buf) == 0 {
		return nil
	}
	segs, ok := d.backing(dv, dev, p, uint64(len(buf)))
	if !ok {
		return cuda.ErrInvalidValue
	}
	machine.mu.Lock()
	defer machine.mu.Unlock()
	for _, sg := range segs {
		if write {
			sg.mem.data.write(sg.off, buf[:sg.n])
		} else {
			sg.mem.data.read(sg.off, buf[:sg.n])
		}
		buf = buf[sg.n:]
	}
	return nil
}

// WriteHost writes data into pinned memory at p, as the CPU would. The
// range must lie in one live pinned allocation (ErrInvalidValue).
func (d *Driver) WriteHost(p cuda.HostPtr, data []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.hostBytes(p, data, true)
}

// ReadHost returns n bytes of pinned memory at p, under WriteHost's rules.
func (d *Driver) ReadHost(p cuda.HostPtr, n uint64) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	buf := make([]byte, n)
	if err := d.hostBytes(p, buf, false); err != nil {
		return nil, err
	}
	return buf, nil
}

// hostBytes writes buf into pinned memory at p, or reads into it; d.mu is
// held.
func (d *Driver) hostBytes(p cuda.HostPtr, buf []byte, write bool) error {
	if len(buf) == 0 {
		return nil
	}
	ha, off, ok := d.cp.init().hostAt(p, uint64(len(buf)))
	if !ok {
		return cuda.ErrInvalidValue
	}
	if write {
		ha.data.write(off, buf)
	} else {
		ha.data.read(off, buf)
	}
	return nil
}

// PhysicalAt names the physical memory behind p, an address mapped on dev
// with the VMM calls (accessible or not): an id that every process mapping
// the same allocation sees (a handle imported from another process has its
// exporter's id), and p's offset in it. ok is false for an address nothing
// is mapped at.
func (d *Driver) PhysicalAt(dev int, p cuda.Ptr) (id, offset uint64, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m, off, ok := d.mustDevice(dev).mappedAt(p)
	if !ok {
		return 0, 0, false
	}
	return m.phys.mem.id, off, true
}
