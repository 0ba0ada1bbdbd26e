// SPDX-License-Identifier: Apache-2.0

package privatepool

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
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
// addresses; segments made since stay in the pool, free. Restore reports
// both sides as PyTorch's CheckpointDelta does: freed is every block that
// was allocated in the pool before (PyTorch frees them all, even those the
// checkpoint allocates again, so a pointer can be in both lists),
// allocated the checkpoint's allocated blocks.
//
// Rules beyond PyTorch's:
//   - A restore changes nothing or everything. What could stop it half way
//     is verified first (pools.CheckLayout): a block of the pool freed but
//     waiting for other streams' events, an allocated block with other
//     streams' uses (record_stream; freeing it would have to wait), a
//     segment of the checkpoint given back since, or pages unmapped since.
//     PyTorch refuses the first case when checkpointing ("Events should
//     have synchronized") and fails part way in the others.
//   - Nothing reaches the driver: the frees and allocations of a restore
//     stay in the pool. (The owner first returns the blocks whose pending
//     frees have completed, as malloc does, unless a capture may be under
//     way.)
//   - A pool that an announced capture is recording into is not restored:
//     its capture's blocks would be freed under it. (Graph trees restore
//     between captures.) Other devices' and pools' captures do not matter.
//   - As in PyTorch, a released pool (use count 0) that still exists can be
//     checkpointed but not restored into (Registry.Restorable); a
//     checkpoint names its device, and restoring it on another is an error.
//   - Statistics after a restore are those of the restored layout (no
//     allocation that never was is counted), and the cache's checks hold.

// Checkpoint is the block layout of one private pool at one moment. It is
// opaque and immutable; restoring it does not consume it.
type Checkpoint struct {
	dev  int
	id   pools.PoolID
	segs []pools.SegmentState
}

// Device is the device of the checkpointed pool.
func (c *Checkpoint) Device() int { return c.dev }

// Pool is the id of the checkpointed pool.
func (c *Checkpoint) Pool() pools.PoolID { return c.id }

// Layout is the layout the checkpoint holds.
func (c *Checkpoint) Layout() []pools.SegmentState { return c.segs }

// AppendContexts appends the context ids the checkpoint holds (those of its
// allocated blocks, which a restore gives back to them), for a caller that
// keeps the objects behind the ids.
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

// Save returns the layout of p, a pool of device dev whose blocks are in c.
func Save(c *pools.Cache, dev int, p *Pool) (*Checkpoint, error) {
	segs, err := c.SaveLayout(p.Small, p.Large)
	if err != nil {
		return nil, err
	}
	return &Checkpoint{dev: dev, id: p.ID, segs: segs}, nil
}

// Restore puts p back in cp's layout, or changes nothing and returns why
// (see the file comment). Each block allocated in p goes to free, which
// returns it to the pool (no other stream uses it: verified); each block
// the checkpoint allocates again goes to allocated. It returns their
// addresses, allocated ones in address order.
func Restore(c *pools.Cache, p *Pool, cp *Checkpoint, free, allocated func(*pools.Block)) (freedPtrs, allocatedPtrs []cuda.Ptr, err error) {
	if err := c.CheckLayout(p.Small, p.Large, cp.segs); err != nil {
		return nil, nil, err
	}
	for _, b := range c.PoolAllocated(p.Small, p.Large) {
		freedPtrs = append(freedPtrs, b.Ptr)
		free(b)
	}
	for _, b := range c.RestoreLayout(p.Small, p.Large, cp.segs) {
		allocatedPtrs = append(allocatedPtrs, b.Ptr)
		allocated(b)
	}
	return freedPtrs, allocatedPtrs, nil
}

// Live reports whether the blocks allocated in p are exactly want.
func Live(c *pools.Cache, p *Pool, want map[cuda.Ptr]struct{}) bool {
	n := 0
	for _, b := range c.PoolAllocated(p.Small, p.Large) {
		if _, ok := want[b.Ptr]; !ok {
			return false
		}
		n++
	}
	return n == len(want)
}
