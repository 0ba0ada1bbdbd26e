// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

// Checkpoints of private pools (privatepool/checkpoint.go has the design):
// the operations, under the device lock, with what only the device has:
// pending frees returned first, the capture under way, the history.

// Checkpoint is the block layout of one private pool at one moment
// (privatepool.Checkpoint).
type Checkpoint = privatepool.Checkpoint

// RestoreResult is what RestoreCheckpoint changed (PyTorch's
// CheckpointDelta).
type RestoreResult struct {
	Freed     []cuda.Ptr // blocks allocated in the pool before the restore that it freed (native's ptrs_freed)
	Allocated []cuda.Ptr // blocks the restore left allocated: the checkpoint's allocated blocks (native's dataptrs_allocd), address order
}

// CheckpointPool returns the layout of private pool id on device dev.
func (a *Allocator) CheckpointPool(dev int, id PoolID) (*Checkpoint, error) {
	const op = "checkpoint_pool"
	return onDevice(a, op, dev, func(d *device) (*Checkpoint, error) {
		pp, err := d.graphs.Pools.Existing(dev, id)
		if err != nil {
			return nil, poolError(op, err)
		}
		d.settle()
		cp, err := privatepool.Save(d.cache, dev, pp)
		if err != nil {
			return nil, newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d: %v", id.A, id.B, dev, err)
		}
		return cp, nil
	})
}

// RestoreCheckpoint puts the checkpointed pool back in the checkpoint's
// layout (see privatepool/checkpoint.go).
func (a *Allocator) RestoreCheckpoint(dev int, cp *Checkpoint) (RestoreResult, error) {
	const op = "restore_checkpoint"
	return onDevice(a, op, dev, func(d *device) (RestoreResult, error) {
		if cp == nil {
			return RestoreResult{}, newError(op, ErrInvalidArgument, "no checkpoint (nil)")
		}
		id := cp.Pool()
		if cp.Device() != dev {
			return RestoreResult{}, newError(op, ErrInvalidArgument, "the checkpoint is of pool {%d,%d} on device %d, not device %d", id.A, id.B, cp.Device(), dev)
		}
		pp, err := d.graphs.Pools.Restorable(dev, id)
		if err != nil {
			return RestoreResult{}, poolError(op, err)
		}
		if d.graphs.IsRecording(id) {
			return RestoreResult{}, newError(op, ErrCaptureUnderway, "pool {%d,%d} on device %d is being allocated to (a capture or use_mem_pool is under way); restore it between captures", id.A, id.B, dev)
		}
		d.settle()
		var res RestoreResult
		res.Freed, res.Allocated, err = privatepool.Restore(d.cache, pp, cp, d.restoreFree, d.restoreAlloc)
		if err != nil {
			return RestoreResult{}, newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d: %v; nothing restored", id.A, id.B, dev, err)
		}
		if d.debug {
			d.mustCheck()
		}
		return res, nil
	})
}

// restoreFree frees the allocated block b for a restore: no other stream
// uses it (verified), so it goes straight back to its pool, with no event
// and no driver call. d.mu is held.
func (d *device) restoreFree(b *pools.Block) {
	d.invalidate(b.Ptr) // freed here, and perhaps allocated again, behind the front's back
	d.cache.Release(b)
	if d.rec != nil {
		d.rec.freeRequested(b)
	}
	d.returnBlock(b)
}

// restoreAlloc records the allocation of b that a restore made. d.mu is
// held.
func (d *device) restoreAlloc(b *pools.Block) {
	d.invalidate(b.Ptr)
	if d.rec != nil {
		d.rec.restored(b)
	}
}

// CheckPoolLive reports whether the blocks allocated in pool id are exactly
// expected (native checkPoolLiveAllocations; duplicates in expected count
// once). The pool may be released but must still exist.
func (a *Allocator) CheckPoolLive(dev int, id PoolID, expected []cuda.Ptr) (bool, error) {
	const op = "check_pool_live_allocations"
	return onDevice(a, op, dev, func(d *device) (bool, error) {
		pp, err := d.graphs.Pools.Existing(dev, id)
		if err != nil {
			return false, poolError(op, err)
		}
		want := make(map[cuda.Ptr]struct{}, len(expected))
		for _, p := range expected {
			want[p] = struct{}{}
		}
		return privatepool.Live(d.cache, pp, want), nil
	})
}

// settle returns the blocks whose pending frees have completed, as malloc
// does first, unless a capture may be under way: no event may be queried
// then. d.mu is held.
func (d *device) settle() {
	if d.ev.Idle() || !d.enterUnsafe() {
		return
	}
	defer d.leaveUnsafe()
	d.graphs.Reuse.Drop()
	if err := d.ev.Process(d.ret); err != nil {
		// The blocks concerned stay queued; the layout check reports them.
		d.warn(driverError("checkpoint", err, "querying the events of pending frees on device %d", d.id).Error())
	}
}
