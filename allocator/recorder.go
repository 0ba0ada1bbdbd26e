// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// recorder is what the device tells the memory history (history.go): the
// operations it performs and what happens to blocks and segments during
// them. The history decides what to keep (the contexts, by level; the trace
// entries; the skipped actions). The device tells it under its lock, and
// holds none (d.rec nil) while the history is off: no context is kept then
// (blocks and segments carry 0) and nothing is recorded.
type recorder interface {
	// begin starts an operation whose caller passed context ctx (0: none),
	// kept if the history's level reaches need; end ends it.
	begin(ctx uint64, need HistoryLevel)
	end()
	// allocated: b was allocated for stream s; it takes the operation's
	// context.
	allocated(b *pools.Block, s cuda.Stream)
	// freeRequested: the user freed b; freeCompleted: b went back to its
	// pool (the device then clears its context).
	freeRequested(b *pools.Block)
	freeCompleted(b *pools.Block)
	// restored: a checkpoint's restore allocated b again, with its
	// context.
	restored(b *pools.Block)
	// segmentAllocated: seg was allocated; it takes the operation's
	// context. segmentFreed: seg (still in the cache) is given back.
	segmentAllocated(seg *pools.Segment)
	segmentFreed(seg *pools.Segment)
	// mapped, unmapped: pages of the expandable segment seg (vmem's
	// Recorder). lent: their physical memory went elsewhere while the old
	// mapping stays.
	mapped(seg *pools.Segment, off, size uint64)
	unmapped(seg *pools.Segment, off, size uint64, lent bool)
	// outOfMemory: r failed; free is the device's free memory. (r by
	// value: a pointer would move every malloc's request to the heap.)
	outOfMemory(r pools.Request, free uint64)
	// snapshot: a snapshot of pool (asked; {0,0}: all) saw active bytes.
	snapshot(active uint64, pool PoolID)
}

// deviceHistory is one device's recorder; the device's lock guards it.
type deviceHistory struct {
	on    bool         // record trace entries: enabled, with room for entries
	level HistoryLevel // which contexts are kept (HistoryNever when disabled)
	skip  uint32       // actions not recorded, one bit per action
	// op is the context of the operation in progress, 0 when it has none
	// or its level does not keep it (begin and end bracket operations).
	op uint64
	// inOp is set between begin and end; now is then the operation's time,
	// read at its first entry (0: none yet), so that an operation reads the
	// clock once however many entries it makes.
	inOp bool
	now  int64
	// The fields above are read or written by every malloc and free (one
	// cache line); those below only while recording.
	ring   ring[traceEntry]
	labels *atomic.Pointer[historyLabels] // the allocator's
}

func (h *deviceHistory) begin(ctx uint64, need HistoryLevel) {
	h.op, h.inOp, h.now = 0, true, 0
	if h.level >= need {
		h.op = ctx
	}
}

func (h *deviceHistory) end() { h.op, h.inOp, h.now = 0, false, 0 }

// ctxOr is the context of the operation in progress, else own.
func (h *deviceHistory) ctxOr(own uint64) uint64 {
	if h.op != 0 {
		return h.op
	}
	return own
}

func (h *deviceHistory) allocated(b *pools.Block, s cuda.Stream) {
	b.Context = h.op
	h.record(actionAlloc, b.Ptr, b.Requested, s, b.Pool.ID, b.Context)
}

func (h *deviceHistory) freeRequested(b *pools.Block) {
	h.record(actionFreeRequested, b.Ptr, b.Requested, b.Stream, b.Pool.ID, h.ctxOr(b.Context))
}

func (h *deviceHistory) freeCompleted(b *pools.Block) {
	h.record(actionFreeCompleted, b.Ptr, b.Requested, b.Stream, b.Pool.ID, h.ctxOr(b.Context))
}

func (h *deviceHistory) restored(b *pools.Block) {
	h.record(actionAlloc, b.Ptr, b.Requested, b.Stream, b.Pool.ID, b.Context)
}

func (h *deviceHistory) segmentAllocated(seg *pools.Segment) {
	h.record(actionSegmentAlloc, seg.Base, seg.Size, seg.Stream, seg.Pool.ID, h.op)
	seg.Context = h.op
}

func (h *deviceHistory) segmentFreed(seg *pools.Segment) {
	h.record(actionSegmentFree, seg.Base, seg.Size, seg.Stream, seg.Pool.ID, h.ctxOr(seg.Context))
}

// mapped records segment_map with the operation's context; the segment's
// context is the one that mapped its start.
func (h *deviceHistory) mapped(seg *pools.Segment, off, size uint64) {
	h.record(actionSegmentMap, seg.Base+cuda.Ptr(off), size, seg.Stream, seg.Pool.ID, h.op)
	if off == 0 && seg.Context == 0 {
		seg.Context = h.op
	}
}

// unmapped records segment_unmap: with the operation's context, else, if
// the unmapped range becomes the segment's start, the segment's (as
// PyTorch, whose head block carries it). A lent range's record has the
// operation's context only.
func (h *deviceHistory) unmapped(seg *pools.Segment, off, size uint64, lent bool) {
	ctx := h.op
	if !lent {
		var own uint64
		if hd := seg.Head; off == 0 || hd.Unmapped && hd.End() == seg.Base+cuda.Ptr(off) {
			own = seg.Context
		}
		ctx = h.ctxOr(own)
	}
	h.record(actionSegmentUnmap, seg.Base+cuda.Ptr(off), size, seg.Stream, seg.Pool.ID, ctx)
}

func (h *deviceHistory) outOfMemory(r pools.Request, free uint64) {
	h.record(actionOOM, cuda.Ptr(free), r.Size, r.Stream, r.Pool.ID, h.op)
}

func (h *deviceHistory) snapshot(active uint64, pool PoolID) {
	h.record(actionSnapshot, 0, active, 0, pool, 0)
}

// record adds a trace entry, unless the trace is off or skips act.
func (h *deviceHistory) record(act action, addr cuda.Ptr, size uint64, s cuda.Stream, pool PoolID, ctx uint64) {
	if !h.on || h.skip&(1<<act) != 0 {
		return
	}
	if h.level < HistoryAlloc {
		ctx = 0
	}
	t := h.now
	if t == 0 {
		t = time.Now().UnixMicro()
		if h.inOp {
			h.now = t
		}
	}
	h.ring.push(traceEntry{action: act, addr: addr, size: size, stream: s, timeUS: t,
		pool: pool, ctx: ctx, labels: h.labels.Load()})
}

// mapRecorder is vmem's Recorder over the device's recorder.
type mapRecorder struct{ d *device }

func (m mapRecorder) Mapped(seg *pools.Segment, off, size uint64) {
	if r := m.d.rec; r != nil {
		r.mapped(seg, off, size)
	}
}

func (m mapRecorder) Unmapped(seg *pools.Segment, off, size uint64, lent bool) {
	if r := m.d.rec; r != nil {
		r.unmapped(seg, off, size, lent)
	}
}
