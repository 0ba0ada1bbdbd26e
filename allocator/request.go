// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Requests: the one way to allocate (MallocRequest) and the one way to free
// (FreeRequest). Every malloc of the C ABI is a request with the frees the
// caller queued since its last call, performed under the same lock hold as
// the allocation: a malloc+free pair costs one lock and one call.

// MallocRequest is one allocation: Size bytes on device Dev for use on
// Stream, after the frees Frees. Malloc sets Track and FreeErr.
type MallocRequest struct {
	Dev    int
	Size   uint64
	Stream cuda.Stream
	// Ctx is the id of the caller's context (0: none), gathered when
	// GatherMask has GatherAlloc (history.go).
	Ctx uint64
	// Tag is the id of the tag the block belongs to (0: none; TagID names
	// one): it comes from the tag's pools (tags.go), and is never tracked
	// by a Front.
	Tag uint32
	// Frees are performed first: those of Dev, and those of unknown device
	// (Dev -1) that Dev holds, under the allocation's lock hold.
	Frees []FreeRequest

	// Track is set to what the allocator's Front may do with the block and
	// the malloc's route (front.go, Tracking; the zero value: nothing).
	Track Tracking
	// FreeErr is set to the first failed free of Frees (its error says
	// what the pointer is); the allocation's own error is Malloc's.
	FreeErr error
}

// FreeRequest is one free: the block at Ptr on device Dev (-1: whichever
// device holds it, for a caller that does not know). Size, if not zero,
// must be the size that was asked for (PyTorch passes it back); a mismatch
// frees nothing. capi's C struct cp_pending_free has the same layout (the C
// ABI queues PyTorch's frees and hands them over with the next call):
// change both together.
type FreeRequest struct {
	Dev  int // -1: unknown, the device that holds Ptr
	Ptr  cuda.Ptr
	Size uint64
	// Ctx is the free's context id (0: none), gathered when GatherMask has
	// GatherFree (history.go).
	Ctx   uint64
	Op    FrontOp // OpFree, except in a Front's log (front.go)
	Count uint64  // OpCycles: how many
}

// PendingFree is the name a Front's log gives a FreeRequest (front.go).
type PendingFree = FreeRequest

// Malloc performs r: its frees, then the allocation, which it returns. Size
// 0 returns a nil pointer and no error, as PyTorch expects. It allocates
// nothing unless it fails or the device grows.
//
// Its common case (a queued free or two, then a malloc: the PyTorch class's
// path) is kept short: the rare cases (a request it refuses or sends to
// the driver, captures nobody announces, frees of other devices, errors)
// leave it through functions of their own.
func (a *Allocator) Malloc(r *MallocRequest) (cuda.Ptr, error) {
	dev, size := r.Dev, r.Size
	// size-1 >= MaxRequest-1: size is 0 or at least MaxRequest.
	if uint(dev) >= uint(len(a.devs)) || size-1 >= pools.MaxRequest-1 || a.cachingOff.Load() || a.uncN.Load() != 0 || r.Tag != 0 {
		return a.mallocElse(r)
	}
	var capture uint64
	var err, freeErr error
	if !a.announced.Load() {
		if capture, err = a.unannouncedCapture(dev, r.Stream); err != nil {
			r.Track, r.FreeErr = Tracking{}, a.Free(r.Frees...)
			return 0, err
		}
	}
	d := a.devs[dev]
	// done marks the frees of unknown device done under the lock (only the
	// first 128 are tried on dev first: the C queue holds 65).
	var done [2]uint64
	others := 0
	d.lockMalloc() // (enter, written out: see device.enter)
	if d.debug {
		heldRanks.acquire(rankDevice)
	}
	for i := range r.Frees {
		f := &r.Frees[i]
		if f.Dev != dev {
			if d.freeUnknownDevice(f, i, &done, &freeErr) {
				others++
			}
			continue
		}
		d.begin(f.Ctx, HistoryAll)
		var e error
		if b := d.cache.Lookup(f.Ptr); b != nil {
			e = d.freeBlock(b, f.Size)
		} else {
			e = d.notAllocated(f.Ptr)
		}
		if e != nil && freeErr == nil {
			freeErr = e
		}
	}
	d.begin(r.Ctx, HistoryState)
	p, err := d.malloc(size, r.Stream, capture)
	d.end()
	var track Tracking
	if err == nil && d.front.f != nil && a.front.on.Load() {
		track = d.front.tracking(size)
	}
	if d.debug {
		d.mustCheck()
		heldRanks.release(rankDevice)
	}
	d.mu.Unlock()
	if others > 0 || freeErr != nil {
		freeErr = a.freeOthers(dev, r.Frees, &done, freeErr)
	}
	r.Track, r.FreeErr = track, freeErr
	return p, err
}

// mallocElse is Malloc for a device that does not exist, a size of 0 or 1
// EiB or more, while blocks go to the driver (uncached), or under a tag:
// the frees, then the allocation, under a lock hold of its own.
//
//go:noinline
func (a *Allocator) mallocElse(r *MallocRequest) (cuda.Ptr, error) {
	r.Track, r.FreeErr = Tracking{}, a.Free(r.Frees...)
	d, err := a.device("malloc", r.Dev)
	if err != nil {
		return 0, err
	}
	size := r.Size
	if size == 0 {
		return 0, nil
	}
	if size >= pools.MaxRequest {
		return 0, tooLarge()
	}
	if a.cachingOff.Load() {
		return a.mallocUncached(d, size)
	}
	capture, err := a.unannouncedCapture(r.Dev, r.Stream)
	if err != nil {
		return 0, err
	}
	d.enter()
	d.begin(r.Ctx, HistoryState)
	var p cuda.Ptr
	if r.Tag != 0 {
		p, err = d.mallocTagged(size, r.Stream, capture, r.Tag)
	} else {
		p, err = d.malloc(size, r.Stream, capture)
	}
	d.end()
	if d.debug {
		d.mustCheck()
	}
	d.leave()
	return p, err
}

// tooLarge is PyTorch's error, word for word, for a request of 1 EiB or
// more: an out-of-memory error (torch.OutOfMemoryError), counted nowhere.
func tooLarge() error {
	return newError("malloc", ErrOutOfMemory, "CUDA out of memory. Tried to allocate more than 1EB memory.")
}

// unannouncedCapture returns the capture sequence s belongs to (0: none)
// when nobody announces captures; then it asks the driver, outside any lock.
// Once captures are announced it returns 0 without a driver call.
func (a *Allocator) unannouncedCapture(dev int, s cuda.Stream) (uint64, error) {
	if a.announced.Load() {
		return 0, nil
	}
	st, id, err := a.drv.StreamCaptureInfo(dev, s)
	if err != nil {
		return 0, driverError("malloc", err, "querying the capture status of stream %#x", uintptr(s))
	}
	if st == cuda.CaptureNone {
		return 0, nil
	}
	return id, nil
}

// Free performs the frees in order and returns the first error (one that
// says what a pointer it did not find is). A free of a known device
// allocates nothing unless it fails.
func (a *Allocator) Free(frees ...FreeRequest) error { return a.free(frees) }

// free is Free (which is inlined, so that a free costs one call).
func (a *Allocator) free(frees []FreeRequest) error {
	var first error
	for i := range frees {
		f := &frees[i]
		var err error
		if f.Dev == -1 {
			err = a.freeAny(f)
		} else if d, derr := a.device("free", f.Dev); derr != nil {
			err = derr
		} else {
			d.lock() // (enter and leave, written out: see device.enter)
			if d.debug {
				heldRanks.acquire(rankDevice)
			}
			d.begin(f.Ctx, HistoryAll)
			err = d.freeLocked(f.Ptr, f.Size)
			d.end()
			if d.debug {
				d.mustCheck()
				heldRanks.release(rankDevice)
			}
			d.mu.Unlock()
			if err != nil {
				err = a.freeUnknown(f.Ptr, err)
			}
		}
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}

// freeUnknown ends a free that found no block at p on its device (err):
// p may be an allocation made while caching was off; else the error says
// what p is.
//
//go:noinline
func (a *Allocator) freeUnknown(p cuda.Ptr, err error) error {
	if found, ferr := a.freeUncached(p); found {
		return ferr
	}
	return a.explainFree(err)
}

// freeAny performs f, a free of unknown device, on whichever device holds
// its block.
func (a *Allocator) freeAny(f *FreeRequest) error {
	d, b := a.find(f.Ptr)
	if d == nil {
		if found, err := a.freeUncached(f.Ptr); found {
			return err
		}
		return a.explainUnknown("free", -1, f.Ptr)
	}
	d.begin(f.Ctx, HistoryAll)
	err := d.freeBlock(b, f.Size)
	d.end()
	if d.debug {
		d.mustCheck()
	}
	d.leave()
	return err
}

// freeUnknownDevice performs, under Malloc's lock of d, the free f (the
// i-th) of another device than d's or of unknown device (Dev -1): one of
// the latter that d holds is done here and marked in done, its error kept
// in *freeErr if that is the first. It reports whether f is left for
// freeOthers.
//
//go:noinline
func (d *device) freeUnknownDevice(f *FreeRequest, i int, done *[2]uint64, freeErr *error) bool {
	var b *pools.Block
	if f.Dev == -1 && i < 128 {
		b = d.cache.Lookup(f.Ptr)
	}
	if b == nil {
		return true
	}
	d.begin(f.Ctx, HistoryAll)
	if e := d.freeBlock(b, f.Size); e != nil && *freeErr == nil {
		*freeErr = e
	}
	done[i/64] |= 1 << (i % 64)
	return false
}

// freeOthers ends Malloc after the lock hold: it performs the frees of
// other devices (those not marked in done), and returns the first error of
// all the frees (first, if not nil, is that of the lock hold's), made to
// say what a pointer that was not found is.
//
//go:noinline
func (a *Allocator) freeOthers(dev int, frees []FreeRequest, done *[2]uint64, first error) error {
	for i := range frees {
		if f := &frees[i]; f.Dev != dev && (i >= 128 || done[i/64]&(1<<(i%64)) == 0) {
			if e := a.free(frees[i : i+1]); e != nil && first == nil {
				first = e
			}
		}
	}
	if first != nil {
		first = a.explainFree(first)
	}
	return first
}

// explainFree replaces the error of a free that found no block by one that
// says what the pointer is; it runs without any device lock held, since it
// looks at every device.
func (a *Allocator) explainFree(err error) error {
	var u unknownAt
	if errors.As(err, &u) {
		return a.explainUnknown("free", u.dev, u.p)
	}
	return err
}

// freeLocked frees the block at p. d.mu is held.
func (d *device) freeLocked(p cuda.Ptr, size uint64) error {
	b := d.cache.Lookup(p)
	if b == nil {
		return d.notAllocated(p)
	}
	return d.freeBlock(b, size)
}

// notAllocated is freeLocked's error for a pointer d has not allocated.
//
//go:noinline
func (d *device) notAllocated(p cuda.Ptr) error {
	return &Error{Op: "free", Kind: ErrUnknownPointer, Msg: "pointer not allocated on this device", Err: unknownAt{d.id, p}}
}

// freeBlock frees the allocated block b, whose requested size must be size
// unless size is 0: it returns the block, or queues it behind its other
// streams' uses. d.mu is held. The common case (no other stream used the
// block) is straight-line code; the rest is out of line.
func (d *device) freeBlock(b *pools.Block, size uint64) error {
	if size != 0 && size != b.Requested {
		return sizeMismatch(b, size)
	}
	d.cache.Release(b)
	if d.rec != nil {
		d.rec.freeRequested(b)
	}
	if !b.Uses.Empty() {
		return d.freeUsed(b)
	}
	// d.returnBlock(b), written out (over the inliner's budget).
	if d.rec != nil {
		d.rec.freeCompleted(b)
	}
	b.Context = 0
	d.cache.Return(b)
	return nil
}

//go:noinline
func sizeMismatch(b *pools.Block, size uint64) error {
	return newError("free", ErrInvalidArgument, "pointer %#x was allocated with %d bytes, freed with %d; not freed", uintptr(b.Ptr), b.Requested, size)
}

// unknownAt carries the device and pointer of a free that found no block.
type unknownAt struct {
	dev int
	p   cuda.Ptr
}

func (u unknownAt) Error() string {
	return fmt.Sprintf("pointer %#x on device %d", uintptr(u.p), u.dev)
}

// explainUnknown builds the error for a pointer that device dev has not
// allocated: freed already, another device's, inside an allocation, or
// never seen. It locks the devices one at a time.
func (a *Allocator) explainUnknown(op string, dev int, p cuda.Ptr) error {
	for _, o := range a.devs {
		o.enter()
		b, seg := o.cache.Lookup(p), o.cache.SegmentAt(p)
		var inside *pools.Block
		if b == nil && seg != nil {
			for x := seg.Head; x != nil; x = x.Next {
				if p >= x.Ptr && p < x.End() {
					inside = x
				}
			}
		}
		o.leave()
		switch {
		case b != nil && o.id != dev:
			return newError(op, ErrWrongDevice, "pointer %#x was allocated on device %d, not device %d", uintptr(p), o.id, dev)
		case inside != nil && inside.Ptr == p && !inside.Allocated:
			return newError(op, ErrAlreadyFreed, "pointer %#x on device %d is not allocated (already freed?)", uintptr(p), o.id)
		case inside != nil:
			return newError(op, ErrUnknownPointer, "pointer %#x lies inside the block at %#x on device %d, not at its start", uintptr(p), uintptr(inside.Ptr), o.id)
		}
	}
	if dev >= 0 {
		return newError(op, ErrUnknownPointer, "pointer %#x was not allocated by cudapool on device %d (already freed, or never allocated)", uintptr(p), dev)
	}
	return newError(op, ErrUnknownPointer, "pointer %#x was not allocated by cudapool (already freed, or never allocated)", uintptr(p))
}
