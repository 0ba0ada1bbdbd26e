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
//     captures not announced (each malloc would have to ask the driver), an
//     unannounced capture still under way, an allocate-to-pool phase whose
//     routing the front cannot repeat (below), memory history (each
//     operation is a trace entry with a context), caching off or uncached
//     allocations alive, or front_cache:False. sync recomputes this whenever
//     one of them changes and tells the front. Blocks with other streams'
//     uses never reach it: record_stream untracks the pointer first.
//   - Captures and other allocate-to-pool phases (routing.go has the rules
//     the front follows then): a FrontRouter is given each device's phases,
//     with their stream filters in a form it can call without Go, and every
//     block it tracks carries the tag of its pool. A malloc that finds a
//     waiting block of its size and stream asks the filters, newest phase
//     first, as graphs.Router.Route does, which pool it routes to, and takes
//     the block only if it is that pool's. A capture's forward pass, whose
//     freed activations are reused by the next layers, is then served in
//     front as a loop outside a capture is.
//
// What differs from the same calls without the front is placement only: a
// freed block is reused as it is, instead of merging with free neighbours
// and being found again by best fit. It is the block best fit would often
// pick anyway, and nothing can run short for it. A call into Go for the
// device takes the log first; a malloc's take lets the front keep holding
// the blocks still waiting (at most CP_FRONT_HOLD, 64, per device, and in the
// default pools and expandable segments' private pools small ones only
// (TagHoldSmall), which cannot fragment the large pools or make an
// expandable range map further: capi/front.c; OpHold;
// to the structures they stay allocated, pools.Block.Held, while the
// statistics count them free), so that a miss does not empty the front; a
// malloc that then finds no free block releases them before it grows
// (heldFit), and every other operation (free through Go, statistics,
// snapshots, empty_cache, the pool hooks) releases them first (OpRelease).
// Two smaller differences: operations logged just before
// memory history starts are replayed after it has (their frees then appear
// in the trace, their reuses do not), and a block waiting in front keeps
// the size it was rounded to when a configuration change would round the
// same request differently (as a cached block does without the front).
// And a hit does not look at the events of blocks freed while other
// streams used them (a malloc through Go does, first): such a block becomes
// free, and leaves the active statistics, at the next call into Go.
//
// Spare bytes. Placement shows in the statistics through one thing: a block
// handed out whole although it is larger than its rounded request (the
// large pools split a block only if more than the small pool's limit would
// remain, so a 10 MiB - 512 request in a 20 MiB segment whose other half is
// allocated gets the 10 MiB + 512 tail). Freed, such a block merges with its
// free neighbours and best fit chooses afresh for the next request of its
// size; the front, reusing it as it is, would pass its spare bytes from
// tensor to tensor, and active_bytes and allocated_bytes would count them
// where PyTorch's do not (a capture whose result lands on it:
// test_graph_memory_stats_and_use_result_after_destroy_graph in PyTorch's
// test_cuda.py; capi/ctest/test_front.c, graph_memory_stats). So such a
// block, if it shares its segment, is not tracked. A whole segment with
// spare bytes (a large request rounded up to the segment size) merges with
// nothing, and best fit would hand it out as it is again: it is tracked.

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/pools"
)

// Front is a cache in front of the allocator whose operations it replays.
// Implemented by capi (the C front); nil: none.
type Front interface {
	// Pending reports whether device dev's log may hold operations. It is
	// called under the device lock on every operation and must be cheap
	// (an unlocked read; a stale answer is taken next time).
	Pending(dev int) bool
	// Holding reports whether the front may hold blocks of device dev
	// across takes (cheap, like Pending).
	Holding(dev int) bool
	// Take moves device dev's logged operations into buf, oldest first, and
	// returns them; the front forgets the blocks whose real free they hold.
	// With keep (a malloc's take), a block whose last free is in the log may
	// stay held (OpHold; see the design note); without, every held block is
	// released too (OpRelease).
	Take(dev int, buf []PendingFree, keep bool) []PendingFree
	// SetEnabled tells the front whether it may serve frees and mallocs.
	SetEnabled(on bool)
	// Capacity is the most operations one Take returns.
	Capacity() int
}

// FrontRouter is a Front that can route mallocs during allocate-to-pool
// phases itself (routing.go).
type FrontRouter interface {
	Front
	// SetRoutes replaces device dev's phases, oldest first, and reports
	// whether the front can evaluate all of them; when it cannot, it must
	// not serve while they are under way (the allocator turns it off).
	// Called under the device lock; after it returns the front no longer
	// calls a filter it was given before.
	SetRoutes(dev int, routes []FrontRoute) bool
}

// FrontRoute is an allocate-to-pool phase as a FrontRouter sees it.
type FrontRoute struct {
	Tag    uint32    // the pool's tag (PoolTag)
	Filter FilterRef // which of the phase's streams route to the pool
}

// FilterRef names a phase's stream filter so that a FrontRouter can call it
// without Go: capi passes the C function and context, or the handle of
// PyTorch's std::function, that the Go filter calls. Its kinds are the
// front's, except for the two below.
type FilterRef struct {
	Kind uint8
	A, B uintptr
}

// Filter kinds known here.
const (
	// FilterOpaque is a filter only Go can call: no front serves while its
	// phase is under way.
	FilterOpaque uint8 = 0
	// FilterAll is a nil filter: every stream of the device routes.
	FilterAll uint8 = 1
)

// Front tags: which pool a tracked block belongs to (MallocTracked).
const (
	// TagNone: the front must not track the block.
	TagNone uint32 = 0
	// TagDefault: the default pools.
	TagDefault uint32 = 1
	// TagHoldSmall, or'ed into a private pool's tag: the front may hold the
	// block across takes only if it is small (up to the small pool's limit,
	// as the default pools' blocks), not at any size. Go sets it for blocks
	// of expandable segments (privateTag); capi's CP_TAG_HOLD_SMALL.
	TagHoldSmall uint32 = 1 << 30
)

// PoolTag is the tag of the blocks of private pool serial (privatepool.Pool.Serial).
func PoolTag(serial uint32) uint32 { return serial + 1 }

// FrontFlags is a Front whose Pending(dev) reads a word that is non-zero
// while device dev's log holds operations: the device lock reads the word
// itself, without a call (a Front need not be one).
type FrontFlags interface {
	Front
	// PendingFlag returns the word Pending(dev) reads atomically, or nil
	// if Pending(dev) is not such a read; HeldFlag the word of Holding(dev).
	PendingFlag(dev int) *int32
	HeldFlag(dev int) *int32
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
	// OpRelease is the real free of a held block (OpHold).
	OpRelease
	// OpHold is the free of a block the front keeps across takes: counted
	// at once, the block stays allocated here (pools.Block.Held) until
	// its OpReuse or OpRelease.
	OpHold
)

// frontCtl is the allocator's side of its Front.
type frontCtl struct {
	f  Front
	a  *Allocator
	on atomic.Bool // what the front was last told
	// blocked counts the devices with a capture the front cannot route:
	// an unannounced one, or a phase with a filter it cannot call.
	blocked atomic.Int64
	mu      sync.Mutex // serializes sync's read of the conditions and its store
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
			d.frontFlag, d.frontHeld = ff.PendingFlag(d.id), ff.HeldFlag(d.id)
			if d.frontFlag == nil || d.frontHeld == nil {
				d.frontFlag, d.frontHeld = nil, nil
			}
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
	on := a.announced.Load() && fc.blocked.Load() == 0 && !a.cachingOff.Load() &&
		a.uncN.Load() == 0 && !a.hist.enabled.Load() && a.cfg.Load().FrontCache
	if on != fc.on.Load() {
		fc.on.Store(on)
		fc.f.SetEnabled(on)
	}
}

// lock takes the device lock and replays the front's log, releasing the
// blocks it holds: every operation but a malloc sees the structures as they
// would be without the front.
func (d *device) lock() {
	d.mu.Lock()
	if f := d.frontFlag; f != nil {
		if atomic.LoadInt32(f)|atomic.LoadInt32(d.frontHeld) != 0 {
			d.replayFront(false)
		}
	} else if d.front != nil && (d.front.Pending(d.id) || d.front.Holding(d.id)) {
		d.replayFront(false)
	}
}

// lockMalloc is lock for a malloc: the front may keep holding blocks (a
// malloc that finds no other block releases them before it grows: heldFit).
func (d *device) lockMalloc() {
	d.mu.Lock()
	if f := d.frontFlag; f != nil {
		if atomic.LoadInt32(f) != 0 {
			d.replayFront(true)
		}
	} else if d.front != nil && d.front.Pending(d.id) {
		d.replayFront(true)
	}
}

// heldFit releases the blocks the front holds and searches again, for a
// request that found no free block: held blocks never make a device grow.
// d.mu is held.
//
//go:noinline
func (d *device) heldFit(r *pools.Request) *pools.Block {
	if d.front == nil || !d.front.Holding(d.id) {
		return nil
	}
	d.replayFront(false)
	return d.cache.TakeFree(r)
}

// replayFront performs the front's logged operations in order. d.mu is held.
func (d *device) replayFront(keep bool) {
	ops := d.front.Take(d.id, d.frontBuf[:0], keep)
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
		case OpRelease:
			d.cache.ReleaseWaiting(b)
		case OpHold:
			d.cache.CountFrontHold(b)
		}
	}
}
