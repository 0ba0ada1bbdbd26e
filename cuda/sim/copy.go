// SPDX-License-Identifier: Apache-2.0

package sim

import (
	"fmt"
	"syscall"

	"github.com/cudapool/cudapool/cuda"
)

// The copy engine: pinned host memory (cuMemHostAlloc, cuMemFreeHost),
// streams made for copies (cuStreamCreate, cuStreamDestroy), asynchronous
// copies between device and host (cuMemcpyDtoHAsync, cuMemcpyHtoDAsync) and
// cuStreamSynchronize, which pausing memory with its contents uses.
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
// A copy outside capture moves bytes when its stream completes it; the
// content model, its rules and the host buffers' bytes are in contents.go.

const (
	// hostBase is where fake pinned host addresses start.
	hostBase = 0x7f0000000000
	// hostPage aligns pinned allocations and separates them.
	hostPage = 4096
	// streamBase numbers the streams StreamCreate makes, far from the small
	// stream values tests pick.
	streamBase = 0x5e0000000000
)

// copyState is the copy engine's state; guarded by Driver.mu. The maps are
// made on first use (init).
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

	pending []*pendingCopy // copies queued and not yet applied, in order (contents.go)
}

type hostAlloc struct {
	base cuda.HostPtr
	dev  int
	size uint64
	data pages // contents (contents.go); nil until written
}

// init makes the maps; mu is held.
func (cs *copyState) init() *copyState {
	if cs.host == nil {
		cs.host = make(map[cuda.HostPtr]*hostAlloc)
		cs.nextHost = hostBase
		cs.streams = make(map[cuda.Stream]int)
		cs.lastStream = streamBase
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
// it still completes as usual, and a later call naming it is a violation
// (refuseDestroyed). A stream taking part in a capture cannot be destroyed
// (ErrInvalidValue).
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
	d.stream(s).destroyed = true // (refuseDestroyed)
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
	if d.destroyed(s) {
		return d.refuseDestroyed(call, s)
	}
	if err := d.checkUnsafe(tid, call); err != nil {
		return err
	}
	if c := d.captureOf(s); c != nil {
		d.violate(fmt.Sprintf("%s on thread %d: the stream is capturing", call, tid), []*capture{c})
		return cuda.ErrCaptureUnsupported
	}
	st := d.stream(s)
	st.completed = st.submitted
	d.applyCopies()
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
	if d.destroyed(s) {
		call := "MemcpyHtoDAsync"
		if toHost {
			call = "MemcpyDtoHAsync"
		}
		return d.refuseDestroyed(fmt.Sprintf("%s(dev=%d)", call, dev), s)
	}
	if size == 0 {
		return nil
	}
	cs := &d.cp
	ha, hoff, ok := cs.hostAt(hp, size)
	if !ok {
		return cuda.ErrInvalidValue
	}
	segs, ok := d.backing(dv, dev, p, size)
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
	d.queueCopy(&pendingCopy{s: s, seq: st.submitted, toHost: toHost, dev: segs, host: ha, hostOff: hoff})
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
