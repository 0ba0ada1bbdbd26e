// SPDX-License-Identifier: Apache-2.0

package allocator

// The front cache.
//
// Design. On the GPU host a call into Go and the allocator's work under the
// device lock cost about 500 ns per malloc+free pair, more than PyTorch's
// whole native pair (docs/hot-path.md). Most pairs of a training loop or a
// tight C loop free a block and soon ask again for the same size on the
// same stream. A Front (capi's C front, capi/front.c; its protocol is
// capi/FRONT.md) serves those without entering Go, while this package stays
// the only owner of the allocator's state and of every rule:
//
//   - The front knows only blocks that malloc marked trackable (Tracking):
//     blocks allocated while the front is enabled, with their pool's tag.
//     For each it keeps the pointer, requested size, stream and device.
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
//     same calls without the front, but for placement (below). inactive_split
//     describes what happened: a split block that waited in front was an
//     unmerged free block. Anything that reads state (statistics, snapshots,
//     empty_cache, OOM retry, a miss) on a device takes that device's log
//     first.
//   - What the front may do is one policy block (FrontPolicy) that this
//     package pushes whenever it changes: the enable bit, how many blocks a
//     device may hold across calls, cold mode's numbers, and each device's
//     allocate-to-pool phases. The front serves nothing while any rule it
//     cannot see might apply: captures not announced (each malloc would
//     have to ask the driver), an unannounced capture still under way,
//     memory history (each operation is a trace entry with a context),
//     caching off or uncached allocations alive, or front_cache:False. sync
//     recomputes the bit whenever one of them changes.
//   - When this package changes a tracked block behind the front's back it
//     says so (Front.Invalidate): record_stream (the block's free must wait
//     for other streams' work), an IPC export, a checkpoint restore (which
//     frees and allocates blocks). The front forgets the pointer.
//   - Captures and other allocate-to-pool phases (routing.go): this package
//     alone routes a malloc to its pool; a malloc through it returns the
//     route with its block, the front keeps it for the calling thread and
//     stream, and serves that thread's later mallocs on the stream from the
//     pool's blocks while the phases last. A capture's forward pass, whose
//     freed activations are reused by the next layers, is then served in
//     front as a loop outside a capture is.
//
// What differs from the same calls without the front is placement only: a
// freed block is reused as it is, instead of merging with free neighbours
// and being found again by best fit. It is the block best fit would often
// pick anyway, and nothing can run short for it. A call into Go for the
// device takes the log first; a malloc's take lets the front keep holding
// the blocks still waiting (Held blocks, below; OpHold: to the structures
// they stay allocated, pools.Block.Held, while the statistics count them
// free), so that a miss does not empty the front; a malloc that then finds
// no free block releases them before it grows (heldFit), and every other
// operation (free through Go, statistics, snapshots, empty_cache, the pool
// hooks) releases them first (OpRelease). Two smaller differences:
// operations logged just before memory history starts are replayed after
// it has (their frees then appear in the trace, their reuses do not), and a
// block waiting in front keeps the size it was rounded to when a
// configuration change would round the same request differently (as a
// cached block does without the front). And a hit does not look at the
// events of blocks freed while other streams used them (a malloc through Go
// does, first): such a block becomes free, and leaves the active
// statistics, at the next call into Go.
//
// Held blocks. A held block is neither merged with its free neighbours nor
// seen by best fit. In the large default pools that fragments the segments
// over many steps of varying sizes: replaying the 75-step recorded training
// run (demo/train75.txt.gz) on the simulator, the peak reserved memory was
// 6.195 GiB holding any size (the first 64 held), 6.266 holding the 64 most
// recently freed, and 6.160 without the front or holding small blocks only
// (the GPU run it was recorded from, PyTorch's allocator: 6.160). Rules
// that made held large blocks neutral instead (claimed back for merges and
// for best fit) kept 6.160 with twice the hits but cost 50% more per
// operation (docs/hot-path.md, "Holding blocks across calls"). So the
// default pools' blocks may be held up to the small pool's limit only. A
// private pool's blocks are held at any size: a capture's forward reuses
// its freed activations, and its pool stays the size of PyTorch's (the
// CUDA graph private pool row); except in expandable segments, where a
// held block keeps the mallocs that miss from reusing its range, they map
// the free tail instead, and the pool grows: there, small ones only
// (privateTag). TagHold marks the blocks that may be held; at
// most frontHold per device are.
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
	"sync/atomic"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

// Front is a cache in front of the allocator whose operations it replays.
// Implemented by capi (the C front); nil: none. capi/FRONT.md is the
// protocol.
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
	// SetPolicy replaces what the front may do. Calls are serialized (the
	// allocator's policy mutex); once it returns the front follows p.
	SetPolicy(p *FrontPolicy)
	// Invalidate makes the front forget p, a block of device dev allocated
	// to the user, which this package has just changed behind its back.
	// Called under the device lock.
	Invalidate(dev int, p cuda.Ptr)
	// Capacity is the most operations one Take returns.
	Capacity() int
}

// FrontPolicy is everything the front may do (see the design note).
type FrontPolicy struct {
	On   bool // it may log frees and serve mallocs
	Hold int  // blocks a device's front may hold across takes
	// Cold mode: over a window of ColdWindow blocks the front took or gave
	// back, more than twice as many freed for real as reused sets the next
	// ColdSkip blocks of the device untracked, doubling with each verdict
	// in a row up to ColdSkip << ColdMaxShift (frontCold*). 0: none.
	ColdWindow, ColdSkip, ColdMaxShift int
	// Phases is, per device, the generation of its allocate-to-pool phases
	// (0: none under way): a route (Tracking) is good for the generation it
	// names only.
	Phases []uint32
}

// The policy's numbers.
const (
	// frontHold is how many blocks a device's front may hold across takes.
	frontHold = 64
	// Cold mode. A workload whose sizes rarely repeat (the C benchmark's
	// mixed sizes) pays for the front only in the windows where it samples
	// again. The longest skip, 262,144 blocks, is a fraction of a second
	// of such a workload; a sampling window costs every free and malloc a
	// lock hold and a lookup until the window's blocks are all freed: for
	// the C benchmark's mixed sizes (256 live blocks replaced at random)
	// about 1,600 pairs, 40% of a 4,096-block skip, so a workload that
	// stays cold should sample rarely (docs/hot-path.md, "Cold mode").
	frontColdWindow   = 256
	frontColdSkip     = 4096
	frontColdMaxShift = 6
)

// Tracking is what a malloc tells the front about its block
// (MallocRequest.Track).
type Tracking struct {
	// Tag is TagNone if the front must not track the block, else its
	// pool's tag (TagDefault, PoolTag), with TagHold if the front may hold
	// it across takes.
	Tag uint32
	// Route, if not 0, is the tag of the pool the malloc's stream routed
	// to, good on the calling thread while the device's phases are of
	// generation Phases (routing.go).
	Route, Phases uint32
}

// Front tags: which pool a tracked block belongs to.
const (
	// TagNone: the front must not track the block.
	TagNone uint32 = 0
	// TagDefault: the default pools.
	TagDefault uint32 = 1
	// TagHold, or'ed into a tag: the front may hold the block across takes
	// (Held blocks in the design note); capi's CP_TAG_HOLD.
	TagHold uint32 = 1 << 30
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
	// blocked counts the devices with an unannounced capture under way.
	blocked atomic.Int64
	// mu serializes the policy's changes and pushes (sync's read of the
	// conditions and its store, the devices' phases); taken after a
	// device's mu, if both are (rankFront, lockrank.go).
	mu     rankedMutex
	policy FrontPolicy // guarded by mu
}

// frontState is a device's side of the front cache.
type frontState struct {
	// f is the allocator's Front (nil: none), set before use; buf receives
	// its log, guarded by mu. flag, if not nil, is where f's Pending(id)
	// reads (a FrontFlags), held where Holding(id) reads.
	f    Front
	flag *int32
	held *int32
	buf  []PendingFree
	ctl  *frontCtl // the allocator's
	// tag is the front tag of the last malloc's block, set when it
	// succeeds; routed: that malloc routed to the private pool routedTo
	// (which only mallocSetup writes, so that the usual malloc stores no
	// pointer), whose tag is route if the front may keep it (routing.go).
	// Guarded by mu.
	tag      uint32
	routed   bool
	routedTo *privatepool.Pool
	route    uint32
	// phases is the generation of the device's allocate-to-pool phases
	// that the front was given (0: none under way); blocked: counted in
	// ctl.blocked (routing.go). Guarded by mu.
	phases  uint32
	blocked bool
}

// tracking is what Malloc tells the front after a malloc of size
// bytes: the block's tag (held only if small, unless its pool allows more:
// privateTag) and the route. mu is held.
func (s *frontState) tracking(size uint64) Tracking {
	t := Tracking{Tag: s.tag}
	if t.Tag != TagNone && size <= pools.SmallSize {
		t.Tag |= TagHold
	}
	if s.routed {
		t.Route, t.Phases = s.route, s.phases
	}
	return t
}

// SetFront installs f (once, before the allocator is shared). From then on
// malloc reports which blocks f may track (MallocRequest.Track), every device
// operation replays f's log first, and f is given the policy.
func (a *Allocator) SetFront(f Front) {
	fc := &a.front
	fc.f, fc.a = f, a
	ff, _ := f.(FrontFlags)
	for _, d := range a.devs {
		s := &d.front
		s.f = f
		if ff != nil {
			s.flag, s.held = ff.PendingFlag(d.id), ff.HeldFlag(d.id)
			if s.flag == nil || s.held == nil {
				s.flag, s.held = nil, nil
			}
		}
		s.buf = make([]PendingFree, 0, f.Capacity())
	}
	fc.mu.Lock()
	fc.policy = FrontPolicy{Hold: frontHold, ColdWindow: frontColdWindow, ColdSkip: frontColdSkip,
		ColdMaxShift: frontColdMaxShift, Phases: make([]uint32, len(a.devs))}
	f.SetPolicy(&fc.policy)
	fc.mu.Unlock()
	fc.sync()
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
		fc.policy.On = on
		fc.f.SetPolicy(&fc.policy)
	}
}

// setPhases gives the front device dev's phase generation. The device's mu
// is held.
func (fc *frontCtl) setPhases(dev int, gen uint32) {
	if fc.f == nil {
		return
	}
	fc.mu.Lock()
	fc.policy.Phases[dev] = gen
	fc.f.SetPolicy(&fc.policy)
	fc.mu.Unlock()
}

// invalidate tells the front that the block at p changed behind its back
// (record_stream, an IPC export, a restore). d.mu is held.
func (d *device) invalidate(p cuda.Ptr) {
	if f := d.front.f; f != nil {
		f.Invalidate(d.id, p)
	}
}

// lock takes the device lock and replays the front's log, releasing the
// blocks it holds: every operation but a malloc sees the structures as they
// would be without the front.
func (d *device) lock() {
	d.mu.Lock()
	if f := d.front.flag; f != nil {
		if atomic.LoadInt32(f)|atomic.LoadInt32(d.front.held) != 0 {
			d.replayFront(false)
		}
	} else if d.front.f != nil && (d.front.f.Pending(d.id) || d.front.f.Holding(d.id)) {
		d.replayFront(false)
	}
}

// lockMalloc is lock for a malloc: the front may keep holding blocks (a
// malloc that finds no other block releases them before it grows: heldFit).
func (d *device) lockMalloc() {
	d.mu.Lock()
	if f := d.front.flag; f != nil {
		if atomic.LoadInt32(f) != 0 {
			d.replayFront(true)
		}
	} else if d.front.f != nil && d.front.f.Pending(d.id) {
		d.replayFront(true)
	}
}

// heldFit releases the blocks the front holds and searches again, for a
// request that found no free block: held blocks never make a device grow.
// d.mu is held.
//
//go:noinline
func (d *device) heldFit(r *pools.Request) *pools.Block {
	if d.front.f == nil || !d.front.f.Holding(d.id) {
		return nil
	}
	d.replayFront(false)
	return d.cache.TakeFree(r)
}

// replayFront performs the front's logged operations in order. d.mu is held.
func (d *device) replayFront(keep bool) {
	ops := d.front.f.Take(d.id, d.front.buf[:0], keep)
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
