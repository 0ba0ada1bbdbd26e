package allocator

// The front cache.
//
// Design. On the GPU host a call into Go and the allocator's work under the
// device lock cost about 500 ns per malloc+free pair, more than PyTorch's
// whole native pair (docs/hot-path.md). Most pairs of a training loop or a
// tight C loop free a block and soon ask again for the same size on the
// same stream. A Front (capi's C front, capi/front.c) serves those without
// entering Go, while this package stays the only owner of the allocator's
// state:
//
//   - The front knows only blocks that malloc marked trackable: default-pool
//     blocks allocated while the front is enabled (see sync below). For each
//     it keeps the pointer, requested size, stream and device.
//   - A free of a tracked block, while enabled, is logged in the front and
//     the block waits there; to this package it is still allocated. A later
//     malloc of the same requested size, stream and device takes it back
//     (logged as a reuse). Nothing else is decided in front: a miss, an
//     untracked pointer, a double free or a mismatched size or device goes
//     to Go, which reports errors as before.
//   - Every device operation here starts by taking the device's log, under
//     the device lock (device.lock), and replaying it in order: a free whose
//     block was reused afterwards, and the reuse, touch only the statistics
//     (pools.Cache.CountFront*); the last free of a block still waiting is a
//     real free. So the structures never see a block that was reused, and
//     the statistics see every free and malloc in the order they happened:
//     allocations, allocated, active and requested bytes and oversize
//     allocations (current values, sums and peaks) are exactly those of the
//     same calls without the front. inactive_split describes what happened:
//     a split block that waited in front was an unmerged free block. Anything
//     that reads state (statistics, snapshots, empty_cache, OOM retry, a
//     miss) on a device takes that device's log first.
//   - The front serves nothing while any rule it cannot see might apply:
//     captures not announced (each malloc would have to ask the driver), a
//     capture or allocate-to-pool under way on any device (allocations route
//     to private pools, frees have capture rules), memory history (each
//     operation is a trace entry with a context), caching off or uncached
//     allocations alive, or front_cache:False. sync recomputes this whenever
//     one of them changes and tells the front. Blocks with other streams'
//     uses never reach it: record_stream untracks the pointer first.
//
// What differs from the same calls without the front is placement only: a
// freed block is reused as it is, instead of merging with free neighbours
// and being found again by best fit. It is the block best fit would often
// pick anyway, and nothing can run short for it: the front holds a device's
// blocks only until the next call into Go for that device, which takes
// them back first. Two smaller differences: operations logged just before
// memory history starts are replayed after it has (their frees then appear
// in the trace, their reuses do not), and a block waiting in front keeps
// the size it was rounded to when a configuration change would round the
// same request differently (as a cached block does without the front).
// And a hit does not look at the events of blocks freed while other
// streams used them (a malloc through Go does, first): such a block becomes
// free, and leaves the active statistics, at the next call into Go.

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Front is a cache in front of the allocator whose operations it replays.
// Implemented by capi (the C front); nil: none.
type Front interface {
	// Pending reports whether device dev's log may hold operations. It is
	// called under the device lock on every operation and must be cheap
	// (an unlocked read; a stale answer is taken next time).
	Pending(dev int) bool
	// Take moves device dev's logged operations into buf, oldest first, and
	// returns them; the front forgets the blocks whose real free they hold.
	Take(dev int, buf []PendingFree) []PendingFree
	// SetEnabled tells the front whether it may serve frees and mallocs.
	SetEnabled(on bool)
	// Capacity is the most operations one Take returns.
	Capacity() int
}

// FrontFlags is a Front whose Pending(dev) reads a word that is non-zero
// while device dev's log holds operations: the device lock reads the word
// itself, without a call (a Front need not be one).
type FrontFlags interface {
	Front
	// PendingFlag returns the word Pending(dev) reads atomically, or nil
	// if Pending(dev) is not such a read.
	PendingFlag(dev int) *int32
}

// FrontOp says what a PendingFree replays.
type FrontOp uint8

const (
	// OpFree is a real free (the queued frees of capi, and a front's last
	// free of a block it still holds).
	OpFree FrontOp = iota
	// OpFreeStats is a free of a block the front handed out again later.
	OpFreeStats
	// OpReuse is the front's reallocation of a block after OpFreeStats.
	OpReuse
	// OpCycles is Count frees of a block, each followed at once by its
	// reuse.
	OpCycles
)

// frontCtl is the allocator's side of its Front.
type frontCtl struct {
	f  Front
	a  *Allocator
	on atomic.Bool // what the front was last told
	mu sync.Mutex  // serializes sync's read of the conditions and its store
}

// SetFront installs f (once, before the allocator is shared). From then on
// malloc reports which blocks f may track (MallocTracked), every device
// operation replays f's log first, and f is told when it may serve.
func (a *Allocator) SetFront(f Front) {
	a.front.f, a.front.a = f, a
	ff, _ := f.(FrontFlags)
	for _, d := range a.devs {
		d.front = f
		if ff != nil {
			d.frontFlag = ff.PendingFlag(d.id)
		}
		d.frontBuf = make([]PendingFree, 0, f.Capacity())
	}
	a.front.sync()
}

// FrontEnabled reports whether the front may serve operations now.
func (a *Allocator) FrontEnabled() bool { return a.front.on.Load() }

// sync recomputes whether the front may serve and tells it. Called after
// every change of a condition the front cannot see (see the design note).
func (fc *frontCtl) sync() {
	if fc.f == nil {
		return
	}
	fc.mu.Lock()
	defer fc.mu.Unlock()
	a := fc.a
	// underway counts every allocate-to-pool route too (MemPools).
	on := a.announced.Load() && a.underway.Load() == 0 && !a.cachingOff.Load() &&
		a.uncN.Load() == 0 && !a.hist.enabled.Load() && a.cfg.Load().FrontCache
	if on != fc.on.Load() {
		fc.on.Store(on)
		fc.f.SetEnabled(on)
	}
}

// lock takes the device lock and replays the front's log.
func (d *device) lock() {
	d.mu.Lock()
	if f := d.frontFlag; f != nil {
		if atomic.LoadInt32(f) != 0 {
			d.replayFront()
		}
	} else if d.front != nil && d.front.Pending(d.id) {
		d.replayFront()
	}
}

// replayFront performs the front's logged operations in order. d.mu is held.
func (d *device) replayFront() {
	ops := d.front.Take(d.id, d.frontBuf[:0])
	for i := range ops {
		op := &ops[i]
		if op.Op == OpFree {
			if err := d.freeLocked(op.Ptr, op.Size); err != nil {
				d.warn("cudapool: a free made through the front cache failed: " + err.Error())
			}
			continue
		}
		b := d.cache.Lookup(op.Ptr)
		if b == nil {
			// The front holds only blocks allocated here: a bug, not the
			// user's error. The statistics miss this operation.
			d.warn(fmt.Sprintf("cudapool: internal error: the front cache replays an operation on %#x, which device %d has not allocated", uintptr(op.Ptr), d.id))
			continue
		}
		switch op.Op {
		case OpFreeStats:
			d.cache.CountFrontFree(b)
		case OpReuse:
			d.cache.CountFrontReuse(b)
		case OpCycles:
			d.cache.CountFrontCycles(b, int64(op.Count))
		}
	}
}
