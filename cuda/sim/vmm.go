// SPDX-License-Identifier: Apache-2.0

package sim

import (
	"fmt"
	"sort"
	"syscall"

	"github.com/cudapool/cudapool/cuda"
)

// The virtual memory management API, as cudapool's expandable segments use
// it: reserve an address range once, create physical allocations of the
// granularity, map them into the range, make the mapped range accessible,
// and later unmap and release pages one by one.
//
// The model keeps, per device:
//   - reservations: address ranges from cuMemAddressReserve, taken from the
//     same bump pointer as MemAlloc (so they never overlap an allocation),
//     or from ranges an earlier MemAddressFree gave back: the driver reuses
//     freed address space, and a process whose expandable segments are
//     released and made again (empty_cache in a loop) reserves far more
//     than the device's 16 TiB range over its life;
//   - handles: physical allocations from cuMemCreate. Their bytes count in
//     the device's used memory (MemGetInfo, Used) from creation until they are
//     both released and unmapped everywhere, as in CUDA, where a released
//     handle's memory lives on while a mapping refers to it;
//   - mappings: which handle backs which part of which reservation, and
//     whether cuMemSetAccess has made it accessible.
//
// Errors follow the driver: sizes and addresses must be multiples of the
// granularity (ErrInvalidValue), a map must lie inside one reservation and
// not overlap a mapping, an unmap must cover whole mappings, and an address
// range can only be freed once nothing is mapped in it. Creating, mapping
// and setting access are potentially unsafe calls (like MemAlloc: legal in
// relaxed mode); unmapping, releasing and freeing an address range are
// refused during any capture (like MemFree).
//
// Work that touches memory (Use) is remembered until its stream completes
// it: unmapping a range that such work may still read or write is refused
// and logged as a violation, since cuMemUnmap, unlike cuMemFree, does not
// wait for it (the kernel would fault, or write into memory that another
// mapping now shows).

// Granularity is the simulated allocation granularity
// (cuMemGetAllocationGranularity), 2 MiB as on current NVIDIA GPUs.
const Granularity = 2 << 20

type vmmState struct {
	reservations map[cuda.Ptr]uint64            // base -> size
	freeVA       []vaRange                      // freed reservations, by address, coalesced
	byReserve    map[cuda.Ptr]map[cuda.Ptr]bool // reservation -> its mapped addresses
	handles      map[cuda.MemHandle]*physical   // live (not released) handles
	released     map[cuda.MemHandle]*physical   // released but still mapped
	mappings     map[cuda.Ptr]*mapping          // by mapped address
	pages        map[cuda.Ptr]cuda.Ptr          // each mapped granule -> its mapping's address
	maps         int64                          // successful MemMap calls
	unmaps       int64                          // successful MemUnmap calls
	// The driver's work is per mapping, not per call (docs/fragmentation.md,
	// "What a page move costs"): accessed counts the mappings MemSetAccess
	// covered, unmappedAccessed the accessible mappings MemUnmap removed
	// (one never given access is cheap to unmap).
	accessed, unmappedAccessed int64
	uses                       []use // work touching memory, maybe pending
}

// vaRange is a range of address space a freed reservation gave back.
type vaRange struct {
	base cuda.Ptr
	size uint64
}

// takeVA returns the start of the first freed range of at least size bytes,
// taking size bytes from it, or false.
func (v *vmmState) takeVA(size uint64) (cuda.Ptr, bool) {
	for i, r := range v.freeVA {
		if r.size < size {
			continue
		}
		if r.size == size {
			v.freeVA = append(v.freeVA[:i], v.freeVA[i+1:]...)
		} else {
			v.freeVA[i] = vaRange{r.base + cuda.Ptr(size), r.size - size}
		}
		return r.base, true
	}
	return 0, false
}

// giveVA returns [p, p+size) to the freed ranges, merging it with its
// neighbours.
func (v *vmmState) giveVA(p cuda.Ptr, size uint64) {
	i := sort.Search(len(v.freeVA), func(i int) bool { return v.freeVA[i].base > p })
	v.freeVA = append(v.freeVA, vaRange{})
	copy(v.freeVA[i+1:], v.freeVA[i:])
	v.freeVA[i] = vaRange{p, size}
	if i+1 < len(v.freeVA) && v.freeVA[i].base+cuda.Ptr(v.freeVA[i].size) == v.freeVA[i+1].base {
		v.freeVA[i].size += v.freeVA[i+1].size
		v.freeVA = append(v.freeVA[:i+1], v.freeVA[i+2:]...)
	}
	if i > 0 && v.freeVA[i-1].base+cuda.Ptr(v.freeVA[i-1].size) == v.freeVA[i].base {
		v.freeVA[i-1].size += v.freeVA[i].size
		v.freeVA = append(v.freeVA[:i], v.freeVA[i+1:]...)
	}
}

// use is work submitted on a stream (its seq-th unit) that touches
// [p, p+size).
type use struct {
	s    cuda.Stream
	seq  uint64
	p    cuda.Ptr
	size uint64
}

// physical is one handle of a process: its own allocation (MemCreate,
// MemCreateShareable) or one it imported (MemImportShareable). The memory
// behind it is mem, which handles of several processes may share (share.go).
type physical struct {
	size     uint64
	mapCount int
	mem      *memory
	imported bool
}

type mapping struct {
	size       uint64
	h          cuda.MemHandle
	phys       *physical
	reserve    cuda.Ptr
	accessible bool
}

func newVMMState() vmmState {
	return vmmState{
		reservations: make(map[cuda.Ptr]uint64),
		handles:      make(map[cuda.MemHandle]*physical),
		mappings:     make(map[cuda.Ptr]*mapping),
		pages:        make(map[cuda.Ptr]cuda.Ptr),
		released:     make(map[cuda.MemHandle]*physical),
		byReserve:    make(map[cuda.Ptr]map[cuda.Ptr]bool),
	}
}

func granular(n uint64) bool { return n != 0 && n%Granularity == 0 }

// MemGranularity returns the allocation granularity for dev.
func (d *Driver) MemGranularity(dev int) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return 0, err
	}
	return Granularity, nil
}

// MemAddressReserve reserves size bytes of dev's address space. No memory is
// used. It is a potentially unsafe call.
func (d *Driver) MemAddressReserve(dev int, size uint64) (cuda.Ptr, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return 0, err
	}
	if !granular(size) {
		return 0, cuda.ErrInvalidValue
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("MemAddressReserve(dev=%d, size=%d)", dev, size)); err != nil {
		return 0, err
	}
	p, ok := dv.vmm.takeVA(size)
	if !ok {
		if size > dv.limit-dv.next {
			return 0, cuda.ErrOutOfMemory
		}
		p = cuda.Ptr(dv.next)
		dv.next += size
	}
	dv.vmm.reservations[p] = size
	dv.vmm.byReserve[p] = make(map[cuda.Ptr]bool)
	return p, nil
}

// MemAddressFree frees a reservation made by MemAddressReserve, with its
// exact base and size. Nothing may be mapped in it. It is refused during any
// capture.
func (d *Driver) MemAddressFree(dev int, p cuda.Ptr, size uint64) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	if err := d.checkNoCapture(fmt.Sprintf("MemAddressFree(dev=%d, ptr=%#x) on thread %d", dev, uintptr(p), tid)); err != nil {
		return err
	}
	if sz, ok := dv.vmm.reservations[p]; !ok || sz != size || len(dv.vmm.byReserve[p]) > 0 {
		return cuda.ErrInvalidValue
	}
	delete(dv.vmm.reservations, p)
	delete(dv.vmm.byReserve, p)
	dv.vmm.giveVA(p, size)
	return nil
}

// MemCreate allocates size bytes of physical memory on dev (a multiple of the
// granularity). It counts against the device's capacity, fails with
// ErrOutOfMemory when it does not fit or an injected failure (FailAllocs)
// remains, and is a potentially unsafe call.
func (d *Driver) MemCreate(dev int, size uint64) (cuda.MemHandle, error) {
	return d.MemCreateShareable(dev, size, 0)
}

// MemCreateShareable is MemCreate for memory that may be exported through
// the handle kinds in kinds (share.go); kinds the device cannot export
// (SetShareableKinds) fail with ErrNotPermitted, as cuMemCreate does for
// fabric handles without the system's support.
func (d *Driver) MemCreateShareable(dev int, size uint64, kinds cuda.ShareableKind) (cuda.MemHandle, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return 0, err
	}
	if !granular(size) || kinds&^(cuda.ShareablePOSIXFD|cuda.ShareableFabric) != 0 {
		return 0, cuda.ErrInvalidValue
	}
	if kinds&^d.shareKinds != 0 {
		return 0, cuda.ErrNotPermitted
	}
	if err := d.admitPhysical(tid, dv, fmt.Sprintf("MemCreate(dev=%d, size=%d)", dev, size), size); err != nil {
		return 0, err
	}
	d.lastHandle++
	dv.vmm.handles[d.lastHandle] = &physical{size: size, mem: newMemory(d, dev, size, kinds)}
	dv.used += size
	return d.lastHandle, nil
}

// MemRelease releases a handle of dev. Its memory is freed once no mapping
// refers to it. It is refused during any capture.
func (d *Driver) MemRelease(dev int, h cuda.MemHandle) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	if err := d.checkNoCapture(fmt.Sprintf("MemRelease(dev=%d, handle=%d) on thread %d", dev, h, tid)); err != nil {
		return err
	}
	ph := dv.vmm.handles[h]
	if ph == nil {
		return cuda.ErrInvalidHandle
	}
	delete(dv.vmm.handles, h)
	if ph.mapCount > 0 {
		dv.vmm.released[h] = ph
		return nil
	}
	d.dropPhysical(dv, ph)
	return nil
}

// reservationOf returns the reservation holding [p, p+size) on dv; mu must be
// held.
func (dv *device) reservationOf(p cuda.Ptr, size uint64) (cuda.Ptr, bool) {
	for base, sz := range dv.vmm.reservations {
		if p >= base && uint64(p-base)+size <= sz && uint64(p-base) < sz {
			return base, true
		}
	}
	return 0, false
}

// overlaps reports whether [p, p+size), granule aligned, meets a mapping of
// dv; mu must be held.
func (dv *device) overlaps(p cuda.Ptr, size uint64) bool {
	for q := p; q < p+cuda.Ptr(size); q += Granularity {
		if _, ok := dv.vmm.pages[q]; ok {
			return true
		}
	}
	return false
}

// MemMap maps the whole of dev's handle h (offset 0, size its size) at p,
// which must lie in a reservation of dev and meet no mapping. It is a
// potentially unsafe call.
func (d *Driver) MemMap(dev int, p cuda.Ptr, size uint64, h cuda.MemHandle) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	ph := dv.vmm.handles[h]
	if ph == nil {
		return cuda.ErrInvalidHandle
	}
	if size != ph.size || uint64(p)%Granularity != 0 {
		return cuda.ErrInvalidValue
	}
	base, ok := dv.reservationOf(p, size)
	if !ok || dv.overlaps(p, size) {
		return cuda.ErrInvalidValue
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("MemMap(ptr=%#x, size=%d)", uintptr(p), size)); err != nil {
		return err
	}
	ph.mapCount++
	dv.vmm.mappings[p] = &mapping{size: size, h: h, phys: ph, reserve: base}
	for q := p; q < p+cuda.Ptr(size); q += Granularity {
		dv.vmm.pages[q] = p
	}
	dv.vmm.byReserve[base][p] = true
	dv.vmm.maps++
	return nil
}

// mappedRun returns the mappings that tile [p, p+size) exactly, or nil; mu
// must be held.
func (dv *device) mappedRun(p cuda.Ptr, size uint64) []cuda.Ptr {
	var out []cuda.Ptr
	for q := p; q < p+cuda.Ptr(size); {
		m := dv.vmm.mappings[q]
		if m == nil {
			return nil
		}
		out = append(out, q)
		q += cuda.Ptr(m.size)
	}
	if len(out) == 0 {
		return nil
	}
	last := out[len(out)-1]
	if last+cuda.Ptr(dv.vmm.mappings[last].size) != p+cuda.Ptr(size) {
		return nil
	}
	return out
}

// MemSetAccess makes [p, p+size) readable and writable from dev. The range
// must be exactly covered by mappings on dev. It is a potentially unsafe
// call.
func (d *Driver) MemSetAccess(dev int, p cuda.Ptr, size uint64) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	run := dv.mappedRun(p, size)
	if run == nil {
		return cuda.ErrInvalidValue
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("MemSetAccess(dev=%d, ptr=%#x, size=%d)", dev, uintptr(p), size)); err != nil {
		return err
	}
	for _, q := range run {
		dv.vmm.mappings[q].accessible = true
	}
	dv.vmm.accessed += int64(len(run))
	return nil
}

// Use submits one unit of work on s that reads and writes [p, p+size) of
// dev (a kernel on a block). On a stream taking part in a capture (its
// origin, or one that joined it) the work goes into the graph as a node, as
// with Submit, and nothing is enqueued.
func (d *Driver) Use(dev int, s cuda.Stream, p cuda.Ptr, size uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv := d.mustDevice(dev)
	if c := d.captureOf(s); c != nil {
		if !c.invalidated {
			d.addNode(c.g, s)
		}
		return
	}
	st := d.stream(s)
	st.submitted++
	// Forget completed work now and then, so the list stays short.
	if len(dv.vmm.uses) >= 64 {
		kept := dv.vmm.uses[:0]
		for _, u := range dv.vmm.uses {
			if d.stream(u.s).completed < u.seq {
				kept = append(kept, u)
			}
		}
		dv.vmm.uses = kept
	}
	dv.vmm.uses = append(dv.vmm.uses, use{s, st.submitted, p, size})
}

// pendingUse returns a use of [p, p+size) on dv that its stream has not
// completed, or nil; mu must be held.
func (d *Driver) pendingUse(dv *device, p cuda.Ptr, size uint64) *use {
	for i := range dv.vmm.uses {
		u := &dv.vmm.uses[i]
		if u.p < p+cuda.Ptr(size) && p < u.p+cuda.Ptr(u.size) && d.stream(u.s).completed < u.seq {
			return u
		}
	}
	return nil
}

// MemUnmap unmaps [p, p+size) on dev, which must be exactly covered by
// mappings. A released handle's memory is freed with its last mapping. It is
// refused during any capture, and while work submitted with Use may still
// touch the range.
func (d *Driver) MemUnmap(dev int, p cuda.Ptr, size uint64) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	if err := d.checkNoCapture(fmt.Sprintf("MemUnmap(dev=%d, ptr=%#x, size=%d) on thread %d", dev, uintptr(p), size, tid)); err != nil {
		return err
	}
	if u := d.pendingUse(dv, p, size); u != nil {
		d.violate(fmt.Sprintf("MemUnmap(dev=%d, ptr=%#x, size=%d) on thread %d: pending work on stream %#x uses %#x+%d",
			dev, uintptr(p), size, tid, uintptr(u.s), uintptr(u.p), u.size), nil)
		return cuda.ErrInvalidValue
	}
	if run := dv.mappedRun(p, size); run != nil {
		for _, q := range run {
			m := dv.vmm.mappings[q]
			if m.accessible {
				dv.vmm.unmappedAccessed++
			}
			delete(dv.vmm.mappings, q)
			for g := q; g < q+cuda.Ptr(m.size); g += Granularity {
				delete(dv.vmm.pages, g)
			}
			delete(dv.vmm.byReserve[m.reserve], q)
			m.phys.mapCount--
			if m.phys.mapCount == 0 && dv.vmm.released[m.h] == m.phys {
				delete(dv.vmm.released, m.h)
				d.dropPhysical(dv, m.phys)
			}
		}
		dv.vmm.unmaps++
		return nil
	}
	return cuda.ErrInvalidValue
}

// Accessible reports whether every byte of [p, p+size) on dev is mapped and
// accessible (memory from MemAlloc always is, and so is an open IPC
// mapping).
func (d *Driver) Accessible(dev int, p cuda.Ptr, size uint64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv := d.mustDevice(dev)
	for q, sz := range dv.live {
		if p >= q && uint64(p-q)+size <= alignUp(sz) {
			return true
		}
	}
	if _, im := dv.importAt(p, size); im != nil {
		return true
	}
	if size == 0 {
		return true
	}
	end := p + cuda.Ptr(size)
	for g := p / Granularity * Granularity; g < end; g += Granularity {
		q, ok := dv.vmm.pages[g]
		if !ok || !dv.vmm.mappings[q].accessible {
			return false
		}
	}
	return true
}

// Mapped returns the bytes mapped in dev's reservations.
func (d *Driver) Mapped(dev int) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	var n uint64
	for _, m := range d.mustDevice(dev).vmm.mappings {
		n += m.size
	}
	return n
}

// Reservations returns the number of live address reservations on dev and
// their total size.
func (d *Driver) Reservations(dev int) (n int, bytes uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, sz := range d.mustDevice(dev).vmm.reservations {
		n++
		bytes += sz
	}
	return n, bytes
}

// Handles returns the number of this process's handles of physical memory
// on dev not yet freed (live handles, and released handles still mapped),
// imported ones included. Memory this process created and let go of while
// another process still holds it is in Used, not here.
func (d *Driver) Handles(dev int) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	v := &d.mustDevice(dev).vmm
	return len(v.handles) + len(v.released)
}

// MappingWork returns how many mappings on dev MemSetAccess has covered and
// how many accessible mappings MemUnmap has removed: what those calls cost
// on a GPU grows with (see vmmState).
func (d *Driver) MappingWork(dev int) (accessed, unmapped int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v := &d.mustDevice(dev).vmm
	return v.accessed, v.unmappedAccessed
}

// MapCalls returns the numbers of successful MemMap and MemUnmap calls on
// dev.
func (d *Driver) MapCalls(dev int) (maps, unmaps int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	v := &d.mustDevice(dev).vmm
	return v.maps, v.unmaps
}
