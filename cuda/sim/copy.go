package sim

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/cudapool/cudapool/cuda"
)

// The copy engine: pinned host memory (cuMemHostAlloc, cuMemFreeHost),
// streams made for copies (cuStreamCreate, cuStreamDestroy), asynchronous
// copies between device and host (cuMemcpyDtoHAsync, cuMemcpyHtoDAsync) and
// cuStreamSynchronize, which pausing memory with its contents uses; and an
// opt-in model of memory contents, so that a test can check that a pause
// and resume keep every byte.
//
// The model:
//   - Pinned host allocations are counted (HostMemory) and get fake
//     addresses from a bump pointer, never reused, with a guard page between
//     them so that a copy overrunning one is caught. SetHostLimit caps them
//     (ErrOutOfMemory beyond it). Allocating is a potentially unsafe call, as
//     cudaMallocHost is; freeing is refused during any capture and, as on the
//     driver, waits for all work first.
//   - StreamCreate makes streams that belong to a device: a copy or a
//     synchronisation naming another device fails with ErrInvalidHandle.
//     Copies may also run on any other stream value, as elsewhere in the
//     simulator.
//   - A copy is one unit of work on its stream (Submit), which completes
//     like any other (Complete, CompleteAll, EventSynchronize,
//     DeviceSynchronize, StreamSynchronize). Its device range must be
//     accessible memory of the device (a MemAlloc allocation, or mapped with
//     access set) and its host range must lie in one live pinned allocation
//     (ErrInvalidValue otherwise: the driver would accept pageable memory,
//     but cudapool never copies from it). Like work from Use, a copy that
//     has not completed makes MemUnmap of its device range a violation. On a
//     capturing stream a copy becomes a graph node and moves nothing.
//     StreamSynchronize is a potentially unsafe call; on a capturing stream
//     it is a violation that invalidates the capture.
//
// Contents (EnableContents, off by default, so that nothing here costs the
// other tests anything) follow the physical memory, not the address: bytes
// are kept per physical allocation (a MemCreate handle, or a MemAlloc
// allocation) in sparse pages, absent pages reading as zeros. Unmapping and
// releasing memory loses its bytes; memory newly mapped at the same address
// reads as zeros; a handle mapped twice shows the same bytes at both
// addresses. WriteDevice and ReadDevice stand for kernels (immediate, as if
// the caller had synchronised), WriteHost and ReadHost for the CPU.
//
// A copy resolves its device range to physical memory when it is queued and
// moves its bytes once its stream has completed it. Stream completion has no
// hook, so completed copies are applied lazily, in the order they were
// queued, before any content is read or written (settleCopies) and before pinned
// memory is freed. That is exact, since only the calls here change
// contents, except for copies on different streams that touch the same
// bytes and complete in another order than they were queued (a race in the
// caller, which CUDA does not order either).

const (
	// hostBase is where fake pinned host addresses start.
	hostBase = 0x7f0000000000
	// hostPage aligns pinned allocations and separates them.
	hostPage = 4096
	// streamBase numbers the streams StreamCreate makes, far from the small
	// stream values tests pick.
	streamBase = 0x5e0000000000
	// contentPage is the unit of the sparse content store.
	contentPage = 64 << 10
)

// copyState is the copy engine's state and the content model; guarded by
// Driver.mu. The maps are made on first use (init).
type copyState struct {
	host      map[cuda.HostPtr]*hostAlloc // live pinned allocations by base
	nextHost  uint64                      // bump pointer of host addresses
	hostBytes uint64                      // bytes of live pinned allocations
	hostLimit uint64                      // 0: no limit
	hostCalls int64                       // successful HostAlloc calls

	streams    map[cuda.Stream]int // streams StreamCreate made -> device
	lastStream cuda.Stream

	copies      int64  // copies queued outside capture
	copiedBytes uint64 // their bytes

	contents bool              // EnableContents was called
	mem      map[physKey]pages // device bytes by physical allocation
	pending  []*pendingCopy    // queued copies not applied yet, in order
}

type hostAlloc struct {
	base cuda.HostPtr
	dev  int
	size uint64
	data pages // nil until written
}

// physKey names a physical allocation: a MemCreate handle of dev, or the
// MemAlloc allocation of dev at base (h zero).
type physKey struct {
	dev  int
	h    cuda.MemHandle
	base cuda.Ptr
}

// physSeg is part of a device range: n bytes at off in one physical
// allocation.
type physSeg struct {
	key    physKey
	off, n uint64
}

type pendingCopy struct {
	s       cuda.Stream
	seq     uint64 // complete when s's completed count reaches it
	toHost  bool
	dev     []physSeg
	host    *hostAlloc
	hostOff uint64
}

// pages is sparse memory: page index -> bytes; an absent page is zeros.
type pages map[uint64]*[contentPage]byte

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

func (pg pages) write(off uint64, src []byte) {
	for len(src) > 0 {
		i, o := off/contentPage, off%contentPage
		n := min(uint64(len(src)), contentPage-o)
		p := pg[i]
		if p == nil {
			p = new([contentPage]byte)
			pg[i] = p
		}
		copy(p[o:], src[:n])
		src, off = src[n:], off+n
	}
}

// copyPages copies n bytes from src at soff to dst at doff, touching only
// pages that hold bytes (src may be nil: zeros).
func copyPages(dst pages, doff uint64, src pages, soff, n uint64) {
	for n > 0 {
		k := min(n, contentPage-soff%contentPage, contentPage-doff%contentPage)
		var sp *[contentPage]byte
		if src != nil {
			sp = src[soff/contentPage]
		}
		di, do := doff/contentPage, doff%contentPage
		switch dp := dst[di]; {
		case sp != nil:
			if dp == nil {
				dp = new([contentPage]byte)
				dst[di] = dp
			}
			copy(dp[do:do+k], sp[soff%contentPage:])
		case dp != nil:
			clear(dp[do : do+k])
		}
		soff, doff, n = soff+k, doff+k, n-k
	}
}

// init makes the maps; mu is held.
func (cs *copyState) init() *copyState {
	if cs.host == nil {
		cs.host = make(map[cuda.HostPtr]*hostAlloc)
		cs.nextHost = hostBase
		cs.streams = make(map[cuda.Stream]int)
		cs.lastStream = streamBase
		cs.mem = make(map[physKey]pages)
	}
	return cs
}

// hostAt returns the pinned allocation holding [p, p+size) and p's offset
// in it; mu is held.
func (cs *copyState) hostAt(p cuda.HostPtr, size uint64) (*hostAlloc, uint64, bool) {
	if ha := cs.host[p]; ha != nil && size <= ha.size {
		return ha, 0, true
	}
	for _, ha := range cs.host {
		if p > ha.base && uint64(p-ha.base) < ha.size && size <= ha.size-uint64(p-ha.base) {
			return ha, uint64(p - ha.base), true
		}
	}
	return nil, 0, false
}

// backing resolves [p, p+size) of device dev into the physical memory that
// backs it, or false if any byte of it is not accessible; mu is held.
func (dv *device) backing(dev int, p cuda.Ptr, size uint64) ([]physSeg, bool) {
	if size == 0 || uint64(p)+size < uint64(p) {
		return nil, false
	}
	var segs []physSeg
	for q, left := p, size; left > 0; {
		if base, ok := dv.vmm.pages[q/Granularity*Granularity]; ok {
			m := dv.vmm.mappings[base]
			if !m.accessible {
				return nil, false
			}
			off := uint64(q - base)
			n := min(left, m.size-off)
			segs = append(segs, physSeg{physKey{dev: dev, h: m.h}, off, n})
			q, left = q+cuda.Ptr(n), left-n
			continue
		}
		found := false
		for base, sz := range dv.live {
			if q >= base && uint64(q-base) < sz {
				off := uint64(q - base)
				n := min(left, sz-off)
				segs = append(segs, physSeg{physKey{dev: dev, base: base}, off, n})
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

// alive reports whether the physical allocation k still exists; mu is
// held.
func (d *Driver) alive(k physKey) bool {
	dv := d.devs[k.dev]
	if k.h != 0 {
		return dv.vmm.handles[k.h] != nil || dv.vmm.released[k.h] != nil
	}
	_, ok := dv.live[k.base]
	return ok
}

// settleCopies applies the copies whose streams have completed them, in the
// order they were queued, then forgets the bytes of physical memory that is
// gone; mu is held.
func (d *Driver) settleCopies() {
	cs := &d.cp
	if !cs.contents {
		return
	}
	kept := cs.pending[:0]
	for _, pc := range cs.pending {
		if d.stream(pc.s).completed < pc.seq {
			kept = append(kept, pc)
			continue
		}
		off := pc.hostOff
		for _, sg := range pc.dev {
			if pc.toHost {
				if pc.host.data == nil {
					pc.host.data = make(pages)
				}
				copyPages(pc.host.data, off, cs.mem[sg.key], sg.off, sg.n)
			} else {
				dst := cs.mem[sg.key]
				if dst == nil {
					dst = make(pages)
					cs.mem[sg.key] = dst
				}
				copyPages(dst, sg.off, pc.host.data, off, sg.n)
			}
			off += sg.n
		}
	}
	clear(cs.pending[len(kept):])
	cs.pending = kept
	for k := range cs.mem {
		if !d.alive(k) && !d.pendingOn(k) {
			delete(cs.mem, k)
		}
	}
}

// pendingOn reports whether a queued copy touches k; mu is held.
func (d *Driver) pendingOn(k physKey) bool {
	for _, pc := range d.cp.pending {
		for _, sg := range pc.dev {
			if sg.key == k {
				return true
			}
		}
	}
	return false
}

// HostAlloc allocates size bytes of pinned host memory, on behalf of dev's
// context. It is a potentially unsafe call, and fails with ErrOutOfMemory
// beyond the limit SetHostLimit set.
func (d *Driver) HostAlloc(dev int, size uint64) (cuda.HostPtr, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return 0, err
	}
	if size == 0 || size > 1<<48 {
		return 0, cuda.ErrInvalidValue
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("HostAlloc(dev=%d, size=%d)", dev, size)); err != nil {
		return 0, err
	}
	cs := d.cp.init()
	if cs.hostLimit != 0 && cs.hostBytes+size > cs.hostLimit {
		return 0, cuda.ErrOutOfMemory
	}
	p := cuda.HostPtr(cs.nextHost)
	cs.nextHost += (size+hostPage-1)/hostPage*hostPage + hostPage
	cs.host[p] = &hostAlloc{base: p, dev: dev, size: size}
	cs.hostBytes += size
	cs.hostCalls++
	return p, nil
}

// HostFree frees a pinned allocation by its base address, after completing
// all work (the driver synchronises). It is refused during any capture.
func (d *Driver) HostFree(dev int, p cuda.HostPtr) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return err
	}
	if err := d.checkNoCapture(fmt.Sprintf("HostFree(dev=%d, ptr=%#x) on thread %d", dev, uintptr(p), tid)); err != nil {
		return err
	}
	cs := d.cp.init()
	ha := cs.host[p]
	if ha == nil {
		return cuda.ErrInvalidValue
	}
	d.completeAll()
	d.settleCopies()
	delete(cs.host, p)
	cs.hostBytes -= ha.size
	return nil
}

// StreamCreate makes a stream of dev. It is legal during capture.
func (d *Driver) StreamCreate(dev int) (cuda.Stream, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return 0, err
	}
	cs := d.cp.init()
	cs.lastStream++
	cs.streams[cs.lastStream] = dev
	return cs.lastStream, nil
}

// StreamDestroy destroys a stream StreamCreate made on dev; work queued on
// it still completes as usual. A stream taking part in a capture cannot be
// destroyed (ErrInvalidValue).
func (d *Driver) StreamDestroy(dev int, s cuda.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return err
	}
	cs := d.cp.init()
	if owner, ok := cs.streams[s]; !ok || owner != dev {
		return cuda.ErrInvalidHandle
	}
	if d.captureOf(s) != nil {
		return cuda.ErrInvalidValue
	}
	delete(cs.streams, s)
	return nil
}

// checkStream fails when s is a stream StreamCreate made on another device
// than dev; mu is held.
func (d *Driver) checkStream(dev int, s cuda.Stream) error {
	if owner, ok := d.cp.init().streams[s]; ok && owner != dev {
		return cuda.ErrInvalidHandle
	}
	return nil
}

// StreamSynchronize completes the work queued on s. It is a potentially
// unsafe call, and a violation on a stream taking part in a capture.
func (d *Driver) StreamSynchronize(dev int, s cuda.Stream) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return err
	}
	if err := d.checkStream(dev, s); err != nil {
		return err
	}
	call := fmt.Sprintf("StreamSynchronize(dev=%d, stream=%#x)", dev, uintptr(s))
	if err := d.checkUnsafe(tid, call); err != nil {
		return err
	}
	if c := d.captureOf(s); c != nil {
		d.violate(fmt.Sprintf("%s on thread %d: the stream is capturing", call, tid), []*capture{c})
		return cuda.ErrCaptureUnsupported
	}
	st := d.stream(s)
	st.completed = st.submitted
	return nil
}

// MemcpyDtoHAsync queues a copy of size bytes of dev's memory at src to
// pinned memory at dst on s.
func (d *Driver) MemcpyDtoHAsync(dev int, dst cuda.HostPtr, src cuda.Ptr, size uint64, s cuda.Stream) error {
	return d.memcpyAsync(dev, true, src, dst, size, s)
}

// MemcpyHtoDAsync queues a copy of size bytes of pinned memory at src to
// dev's memory at dst on s.
func (d *Driver) MemcpyHtoDAsync(dev int, dst cuda.Ptr, src cuda.HostPtr, size uint64, s cuda.Stream) error {
	return d.memcpyAsync(dev, false, dst, src, size, s)
}

func (d *Driver) memcpyAsync(dev int, toHost bool, p cuda.Ptr, hp cuda.HostPtr, size uint64, s cuda.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	if err := d.checkStream(dev, s); err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	cs := &d.cp
	ha, hoff, ok := cs.hostAt(hp, size)
	if !ok {
		return cuda.ErrInvalidValue
	}
	segs, ok := dv.backing(dev, p, size)
	if !ok {
		return cuda.ErrInvalidValue
	}
	if c := d.captureOf(s); c != nil {
		if c.invalidated {
			return cuda.ErrCaptureInvalidated
		}
		d.addNode(c.g, s)
		return nil
	}
	st := d.stream(s)
	st.submitted++
	d.pruneUses(dv)
	dv.vmm.uses = append(dv.vmm.uses, use{s, st.submitted, p, size})
	cs.copies++
	cs.copiedBytes += size
	if cs.contents {
		cs.pending = append(cs.pending, &pendingCopy{s: s, seq: st.submitted, toHost: toHost, dev: segs, host: ha, hostOff: hoff})
	}
	return nil
}

// pruneUses forgets completed work in dv's use list once it is long, as
// Use does; mu is held.
func (d *Driver) pruneUses(dv *device) {
	if len(dv.vmm.uses) < 64 {
		return
	}
	kept := dv.vmm.uses[:0]
	for _, u := range dv.vmm.uses {
		if d.stream(u.s).completed < u.seq {
			kept = append(kept, u)
		}
	}
	dv.vmm.uses = kept
}

// The test controls below panic on a bad device index, like the others.

// errNoContents is what the content controls return before EnableContents.
var errNoContents = errors.New("sim: memory contents are not modelled; call EnableContents first")

// EnableContents turns the content model on: from now on WriteDevice,
// WriteHost and completed copies store bytes.
func (d *Driver) EnableContents() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cp.init().contents = true
}

// WriteDevice writes data at p on dev, as a kernel would (immediately). The
// range must be accessible memory of dev (ErrInvalidValue).
func (d *Driver) WriteDevice(dev int, p cuda.Ptr, data []byte) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.deviceBytes(dev, p, data, true)
}

// ReadDevice returns n bytes at p on dev, as a kernel would see them.
func (d *Driver) ReadDevice(dev int, p cuda.Ptr, n uint64) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	buf := make([]byte, n)
	if err := d.deviceBytes(dev, p, buf, false); err != nil {
		return nil, err
	}
	return buf, nil
}

func (d *Driver) deviceBytes(dev int, p cuda.Ptr, buf []byte, write bool) error {
	dv := d.mustDevice(dev)
	cs := d.cp.init()
	if !cs.contents {
		return errNoContents
	}
	if len(buf) == 0 {
		return nil
	}
	segs, ok := dv.backing(dev, p, uint64(len(buf)))
	if !ok {
		return cuda.ErrInvalidValue
	}
	d.settleCopies()
	for _, sg := range segs {
		pg := cs.mem[sg.key]
		if write {
			if pg == nil {
				pg = make(pages)
				cs.mem[sg.key] = pg
			}
			pg.write(sg.off, buf[:sg.n])
		} else {
			pg.read(sg.off, buf[:sg.n])
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

// ReadHost returns n bytes of pinned memory at p.
func (d *Driver) ReadHost(p cuda.HostPtr, n uint64) ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	buf := make([]byte, n)
	if err := d.hostBytes(p, buf, false); err != nil {
		return nil, err
	}
	return buf, nil
}

func (d *Driver) hostBytes(p cuda.HostPtr, buf []byte, write bool) error {
	cs := d.cp.init()
	if !cs.contents {
		return errNoContents
	}
	if len(buf) == 0 {
		return nil
	}
	ha, off, ok := cs.hostAt(p, uint64(len(buf)))
	if !ok {
		return cuda.ErrInvalidValue
	}
	d.settleCopies()
	if ha.data == nil {
		ha.data = make(pages)
	}
	if write {
		ha.data.write(off, buf)
	} else {
		ha.data.read(off, buf)
	}
	return nil
}

// SetHostLimit caps the bytes of live pinned allocations (0: no cap).
func (d *Driver) SetHostLimit(bytes uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.cp.init().hostLimit = bytes
}

// HostMemory returns the number of live pinned allocations and their bytes.
func (d *Driver) HostMemory() (allocs int, bytes uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	cs := d.cp.init()
	return len(cs.host), cs.hostBytes
}

// HostAllocCalls returns the number of successful HostAlloc calls.
func (d *Driver) HostAllocCalls() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cp.hostCalls
}

// CopyStreams returns the number of live streams StreamCreate made.
func (d *Driver) CopyStreams() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.cp.init().streams)
}

// Copies returns the number of asynchronous copies queued outside capture
// and their bytes.
func (d *Driver) Copies() (n int64, bytes uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cp.copies, d.cp.copiedBytes
}
