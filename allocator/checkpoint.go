package allocator

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

// Checkpoints of private pools: PyTorch's getCheckpointState,
// setCheckpointPoolState and checkPoolLiveAllocations, which CUDA graph
// trees (torch.compile's "reduce-overhead" mode) use to record a new graph
// into a pool after replaying others.
//
// # Design
//
// A Checkpoint is the block layout of one private pool (pools/layout.go):
// its segments, their blocks, and for each allocated block its requested
// size and context. Restoring it frees every block allocated in the pool,
// then makes the checkpoint's allocated blocks allocated again at their
// addresses; segments made since stay in the pool, free. RestoreResult
// reports both sides as PyTorch's CheckpointDelta does: Freed is every
// block that was allocated in the pool before (PyTorch frees them all,
// even those the checkpoint allocates again, so a pointer can be in both
// lists), Allocated the checkpoint's allocated blocks.
//
// Rules beyond PyTorch's:
//   - A restore changes nothing or everything. What could stop it half way
//     is verified first (pools.CheckLayout): a block of the pool freed but
//     waiting for other streams' events, an allocated block with other
//     streams' uses (record_stream; freeing it would have to wait), a
//     segment of the checkpoint given back since, or pages unmapped since.
//     PyTorch refuses the first case when checkpointing ("Events should
//     have synchronized") and fails part way in the others.
//   - Before either, the events of pending frees that have completed are
//     processed, as malloc does, unless a capture may be under way (no
//     event may be queried then). Nothing else reaches the driver: the
//     frees and allocations of a restore stay in the pool.
//   - A pool that an announced capture is recording into is not restored:
//     its capture's blocks would be freed under it. (Graph trees restore
//     between captures.) Other devices' and pools' captures do not matter.
//   - As in PyTorch, a released pool (use count 0) that still exists can be
//     checkpointed but not restored into; a checkpoint names its device,
//     and restoring it on another is an error.
//   - Statistics after a restore are those of the restored layout (no
//     allocation that never was is counted), and Check() holds.

// Checkpoint is the block layout of one private pool at one moment. It is
// opaque and immutable; restoring it does not consume it.
type Checkpoint struct {
	dev  int
	id   PoolID
	segs []pools.SegmentState
}

// Device is the device of the checkpointed pool.
func (c *Checkpoint) Device() int { return c.dev }

// Pool is the id of the checkpointed pool.
func (c *Checkpoint) Pool() PoolID { return c.id }

// AppendContexts appends the context ids the checkpoint holds (those of its
// allocated blocks, which a restore gives back to them), for a caller that
// keeps the objects behind the ids (see LiveContexts).
func (c *Checkpoint) AppendContexts(dst []uint64) []uint64 {
	for i := range c.segs {
		for _, b := range c.segs[i].Blocks {
			if b.Allocated && b.Context != 0 {
				dst = append(dst, b.Context)
			}
		}
	}
	return dst
}

// Allocated returns the blocks allocated in the pool at the checkpoint, in
// address order.
func (c *Checkpoint) Allocated() []cuda.Ptr {
	var out []cuda.Ptr
	for _, s := range c.segs {
		for _, b := range s.Blocks {
			if b.Allocated {
				out = append(out, b.Ptr)
			}
		}
	}
	return out
}

// RestoreResult is what RestoreCheckpoint changed (PyTorch's
// CheckpointDelta).
type RestoreResult struct {
	Freed     []cuda.Ptr // blocks allocated in the pool before the restore that it freed (native's ptrs_freed)
	Allocated []cuda.Ptr // blocks the restore left allocated: the checkpoint's allocated blocks (native's dataptrs_allocd), address order
}

// CheckpointPool returns the layout of private pool id on device dev.
func (a *Allocator) CheckpointPool(dev int, id PoolID) (*Checkpoint, error) {
	const op = "checkpoint_pool"
	d, err := a.device(op, dev)
	if err != nil {
		return nil, err
	}
	d.lock()
	defer d.mu.Unlock()
	pp := d.graphs.Pools.Get(id)
	if pp == nil {
		return nil, newError(op, ErrUnknownPool, "device %d has no private pool {%d,%d}", dev, id.A, id.B)
	}
	d.settle()
	segs, err := d.cache.SaveLayout(pp.Small, pp.Large)
	if err != nil {
		return nil, newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d: %v", id.A, id.B, dev, err)
	}
	return &Checkpoint{dev: dev, id: id, segs: segs}, nil
}

// RestoreCheckpoint puts the checkpointed pool back in the checkpoint's
// layout (see the file comment).
func (a *Allocator) RestoreCheckpoint(dev int, cp *Checkpoint) (RestoreResult, error) {
	const op = "restore_checkpoint"
	d, err := a.device(op, dev)
	if err != nil {
		return RestoreResult{}, err
	}
	if cp == nil {
		return RestoreResult{}, newError(op, ErrInvalidArgument, "no checkpoint (nil)")
	}
	if cp.dev != dev {
		return RestoreResult{}, newError(op, ErrInvalidArgument, "the checkpoint is of pool {%d,%d} on device %d, not device %d", cp.id.A, cp.id.B, cp.dev, dev)
	}
	d.lock()
	defer d.mu.Unlock()
	pp, err := d.livePool(op, cp.id)
	if err != nil {
		return RestoreResult{}, err
	}
	if d.graphs.IsRecording(cp.id) {
		return RestoreResult{}, newError(op, ErrCaptureUnderway, "pool {%d,%d} on device %d is being allocated to (a capture or use_mem_pool is under way); restore it between captures", cp.id.A, cp.id.B, dev)
	}
	d.settle()
	if err := d.cache.CheckLayout(pp.Small, pp.Large, cp.segs); err != nil {
		return RestoreResult{}, newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d: %v; nothing restored", cp.id.A, cp.id.B, dev, err)
	}
	var res RestoreResult
	for _, b := range d.cache.PoolAllocated(pp.Small, pp.Large) {
		// No other stream uses b (CheckLayout): it goes straight back to
		// the pool, with no event and no driver call.
		res.Freed = append(res.Freed, b.Ptr)
		d.invalidate(b.Ptr) // freed here, and allocated again below, behind the front's back
		d.cache.Release(b)
		d.record(actionFreeRequested, b.Ptr, b.Requested, b.Stream, b.Pool.ID, d.hist.ctxOr(b.Context))
		d.returnBlock(b)
	}
	for _, b := range d.cache.RestoreLayout(pp.Small, pp.Large, cp.segs) {
		res.Allocated = append(res.Allocated, b.Ptr)
		d.invalidate(b.Ptr)
		d.record(actionAlloc, b.Ptr, b.Requested, b.Stream, b.Pool.ID, b.Context)
	}
	if d.debug {
		d.mustCheck()
	}
	return res, nil
}

// CheckPoolLive reports whether the blocks allocated in pool id are exactly
// expected (native checkPoolLiveAllocations; duplicates in expected count
// once). The pool may be released but must still exist.
func (a *Allocator) CheckPoolLive(dev int, id PoolID, expected []cuda.Ptr) (bool, error) {
	const op = "check_pool_live_allocations"
	d, err := a.device(op, dev)
	if err != nil {
		return false, err
	}
	want := make(map[cuda.Ptr]struct{}, len(expected))
	for _, p := range expected {
		want[p] = struct{}{}
	}
	d.lock()
	defer d.mu.Unlock()
	pp := d.graphs.Pools.Get(id)
	if pp == nil {
		return false, newError(op, ErrUnknownPool, "device %d has no private pool {%d,%d}", dev, id.A, id.B)
	}
	n := 0
	for _, b := range d.cache.PoolAllocated(pp.Small, pp.Large) {
		if _, ok := want[b.Ptr]; !ok {
			return false, nil
		}
		n++
	}
	return n == len(want), nil
}

// livePool returns private pool id, which must exist, be held (a restore
// into a released pool would allocate in it again) and be announced. d.mu
// is held.
func (d *device) livePool(op string, id PoolID) (*privatepool.Pool, error) {
	pp := d.graphs.Pools.Get(id)
	switch {
	case pp == nil:
		return nil, newError(op, ErrUnknownPool, "device %d has no private pool {%d,%d}", d.id, id.A, id.B)
	case pp.Freeable():
		return nil, newError(op, ErrUnknownPool, "pool {%d,%d} on device %d was released by all its holders; a checkpoint cannot be restored into it", id.A, id.B, d.id)
	case pp.Auto:
		// Its capture may be under way, and nothing says when it is not.
		return nil, newError(op, ErrUnknownPool, "pool {%d,%d} on device %d is the automatic pool of an unannounced capture; a checkpoint cannot be restored into it", id.A, id.B, d.id)
	}
	return pp, nil
}

// settle returns the blocks whose pending frees have completed, as malloc
// does first, unless a capture may be under way: no event may be queried
// then. d.mu is held.
func (d *device) settle() {
	if d.ev.Idle() || !d.enterUnsafe() {
		return
	}
	defer d.leaveUnsafe()
	d.dropCaptureReuse()
	if err := d.ev.Process(d.ret); err != nil {
		// The blocks concerned stay queued; the layout check reports them.
		d.warn(driverError("checkpoint", err, "querying the events of pending frees on device %d", d.id).Error())
	}
}
