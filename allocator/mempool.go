// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"github.com/cudapool/cudapool/privatepool"
)

// User memory pools (torch.cuda.MemPool) and the cache queries PyTorch's
// allocator interface has beyond malloc and free.
//
// # Design
//
// A MemPool is a private pool like a graph's (privatepool): MemPool()
// creates it holding it once (CreateOrIncrefPool), each use_mem_pool block
// begins allocating to it with a filter for its thread (holding it once
// more) and ends by EndAllocateToPool and ReleasePool, and the MemPool's
// destructor releases it and empties it (EmptyPool). As in PyTorch:
//   - no_split (SetPoolNoSplit): the pool never splits a block, so every
//     allocation keeps a whole segment (or expandable run) to itself;
//   - use_on_oom (SetPoolUseOnOOM): when a request of the default pools
//     finds no memory for a new segment, it may take a cached block of
//     the pool before anything cached is freed (device.borrow);
//   - a pool may get its segments from elsewhere (MemPool(allocator=X),
//     SetPoolSource): allocated like driver segments (relaxed capture
//     mode, the memory fraction applies, never expandable), given back
//     through the source wherever the pool's segments are freed (the OOM
//     retry, EmptyCache and EmptyPool once the pool is released), never
//     through the driver.
//
// Where PyTorch does not check its input (flags on a pool that does not
// exist yet, which it records by id), these functions return ErrUnknownPool
// instead; clearing use_on_oom of a pool that is gone is not an error.

// SegmentSource supplies a private pool's segments instead of the driver
// (privatepool.SegmentSource).
type SegmentSource = privatepool.SegmentSource

// CreateOrIncrefPool creates private pool id on dev with use count 1, or
// adds a holder to it (native createOrIncrefPool). User pools are {0,n},
// graph pools {n,0}. A released pool that still holds memory becomes live
// again.
func (a *Allocator) CreateOrIncrefPool(dev int, id PoolID) error {
	const op = "create_or_incref_pool"
	return a.withDevice(op, dev, func(d *device) error {
		if _, err := d.graphs.Pools.Incref(id, d.newPools); err != nil {
			return poolError(op, err)
		}
		return nil
	})
}

// PoolUseCount returns the number of holders of pool id (native
// getPoolUseCount): 0 for a released pool that still holds memory,
// ErrUnknownPool for a pool that does not exist (PyTorch asserts).
func (a *Allocator) PoolUseCount(dev int, id PoolID) (int, error) {
	const op = "get_pool_use_count"
	return onDevice(a, op, dev, func(d *device) (int, error) {
		n, err := d.graphs.Pools.UseCount(id)
		if err != nil {
			return 0, poolError(op, err)
		}
		return n, nil
	})
}

// SetPoolNoSplit makes pool id hand out whole blocks, never splitting one
// (native setNoSplit). It cannot be undone, as in PyTorch.
func (a *Allocator) SetPoolNoSplit(dev int, id PoolID) error {
	const op = "set_no_split"
	return a.withDevice(op, dev, func(d *device) error {
		pp, err := d.graphs.Pools.Known(dev, id)
		if err != nil {
			return poolError(op, err)
		}
		pp.SetNoSplit()
		return nil
	})
}

// SetPoolUseOnOOM marks pool id as a last resort for the default pools'
// requests before an out-of-memory error (native setUseOnOOM), or unmarks
// it.
func (a *Allocator) SetPoolUseOnOOM(dev int, id PoolID, use bool) error {
	const op = "set_use_on_oom"
	return a.withDevice(op, dev, func(d *device) error {
		if d.graphs.Pools.Get(id) == nil && !use {
			return nil // nothing to clear (MemPool's destructor, after EmptyPool)
		}
		pp, err := d.graphs.Pools.Known(dev, id)
		if err != nil {
			return poolError(op, err)
		}
		pp.UseOnOOM = use
		return nil
	})
}

// SetPoolSource makes src supply pool id's segments (nil: the driver
// again). The pool must exist and hold no segment yet, since each segment
// goes back to where it came from.
func (a *Allocator) SetPoolSource(dev int, id PoolID, src SegmentSource) error {
	const op = "set_pool_source"
	return a.withDevice(op, dev, func(d *device) error {
		pp, err := d.graphs.Pools.Known(dev, id)
		if err != nil {
			return poolError(op, err)
		}
		if n := pp.Segments(); n > 0 {
			return newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d already holds %d segments; its source must be set before it allocates", id.A, id.B, dev, n)
		}
		pp.Source = src
		return nil
	})
}

// EmptyPool gives back the cached memory of pool id on dev (native
// emptyCache(mempool_id)); {0,0} is EmptyCache(0). As in PyTorch only a
// released pool gives memory back, and the pool is forgotten once it holds
// none; a pool still held, or unknown, is left alone without error.
func (a *Allocator) EmptyPool(dev int, id PoolID) error {
	const op = "empty_cache"
	if _, err := a.device(op, dev); err != nil || id.IsDefault() {
		if err != nil {
			return err
		}
		return a.EmptyCache(0) // (outside any device's lock: it takes them all)
	}
	return a.withDevice(op, dev, func(d *device) error {
		pp := d.graphs.Pools.Get(id)
		if pp == nil || !pp.Freeable() {
			return nil
		}
		if !d.enterUnsafe() {
			// A capture, or another thread's use_mem_pool (cudapool cannot
			// tell them apart), is under way: nothing may be freed now.
			// PyTorch calls this from MemPool's destructor, where an error
			// would end the process; the released pool's memory goes back
			// at the next empty_cache or OOM retry made with no capture
			// under way.
			return nil
		}
		defer d.leaveUnsafe()
		// Blocks of the pool may wait for other streams: wait for them
		// (PyTorch waits for the pool's events only; cudapool for all the
		// device's, which returns other finished blocks early and changes
		// nothing else).
		if err := d.syncAll(op); err != nil {
			return err
		}
		err := d.releasePrivate(op, pp)
		if d.debug {
			d.mustCheck()
		}
		return err
	})
}

// CacheInfo is PyTorch's cacheInfo, which cuDNN's benchmark mode uses to
// size workspaces: largest is raised to the largest cached free block of
// any pool on dev (default and private, released ones included); a largest
// of 0 is first the device's free memory.
func (a *Allocator) CacheInfo(dev int, largest uint64) (uint64, error) {
	const op = "cache_info"
	return onDevice(a, op, dev, func(d *device) (uint64, error) {
		if largest == 0 {
			free, _, err := d.drv.MemGetInfo(dev)
			if err != nil {
				return 0, driverError(op, err, "reading device %d's free memory", dev)
			}
			largest = free
		}
		largest = max(largest, d.cache.LargestFree(d.cache.Small), d.cache.LargestFree(d.cache.Large))
		d.graphs.Pools.Each(func(pp *privatepool.Pool) {
			largest = max(largest, d.cache.LargestFree(pp.Small), d.cache.LargestFree(pp.Large))
		})
		return largest, nil
	})
}

// MemoryFraction returns dev's memory fraction (native getMemoryFraction):
// 1 when none is set, as in PyTorch.
func (a *Allocator) MemoryFraction(dev int) (float64, error) {
	return onDevice(a, "get_memory_fraction", dev, func(d *device) (float64, error) {
		if d.limit.pending {
			if err := d.applyFraction(); err != nil {
				return 0, err
			}
		}
		// As PyTorch: the limit in bytes (truncated) over the device's memory,
		// a hair under the fraction that was set.
		if allowed, ok := d.cache.Allowed(); ok && d.limit.total > 0 {
			return float64(allowed) / float64(d.limit.total), nil
		}
		return 1, nil
	})
}
