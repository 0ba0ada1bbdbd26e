// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"errors"

	"github.com/cudapool/cudapool/cuda"
)

// Caching off: PyTorch's torch.cuda.caching_allocator_enable(False), a
// debugging switch (for memory checkers that must see every allocation)
// under which each malloc is a driver allocation of its own and each free
// gives it back at once. Such allocations are outside the cache: no pool,
// no statistics, no history; record_stream on them is ignored. Frees find
// them whether caching is on or off by then. The driver allocation follows
// the cache's rule (relaxed capture mode), but a free during a capture
// fails, as the driver's free would break the capture.

// uncached is the allocator's record of the allocations made while caching
// was off (Allocator.uncN is its size, read without the lock by the free
// path, so that it costs nothing while nothing is uncached).
type uncached struct {
	mu rankedMutex
	m  map[cuda.Ptr]int // pointer -> device; guarded by mu
}

// SetCaching turns caching on (true, the default) or off.
func (a *Allocator) SetCaching(on bool) {
	a.cachingOff.Store(!on)
	a.front.sync()
}

// Caching reports whether caching is on.
func (a *Allocator) Caching() bool { return !a.cachingOff.Load() }

// mallocUncached allocates size bytes on d straight from the driver.
func (a *Allocator) mallocUncached(d *device, size uint64) (cuda.Ptr, error) {
	var p cuda.Ptr
	var err error
	if ra, ok := d.drv.(relaxedAllocator); ok {
		p, err = ra.MemAllocRelaxed(d.id, size)
	} else {
		err = d.withThreadRelaxed(func() (err error) {
			p, err = d.drv.MemAlloc(d.id, size)
			return err
		})
	}
	if errors.Is(err, cuda.ErrOutOfMemory) {
		return 0, newError("malloc", ErrOutOfMemory, "CUDA out of memory. Tried to allocate %s on GPU %d (caching is off)", FormatSize(size), d.id)
	}
	if err != nil {
		return 0, driverError("malloc", err, "allocating %d bytes on device %d (caching is off)", size, d.id)
	}
	a.unc.mu.Lock()
	if a.unc.m == nil {
		a.unc.m = make(map[cuda.Ptr]int)
	}
	a.unc.m[p] = d.id
	a.uncN.Store(int64(len(a.unc.m)))
	a.front.sync()
	a.unc.mu.Unlock()
	return p, nil
}

// freeUncached gives p back to the driver if it was allocated while
// caching was off; found reports whether it was. The record is claimed
// (deleted) before the driver's free, under the lock: of two concurrent
// frees of p, one frees it and the other finds no record (an unknown
// pointer), instead of both reaching the driver, the second perhaps after
// the driver has handed the address to another allocation.
func (a *Allocator) freeUncached(p cuda.Ptr) (found bool, err error) {
	if !a.isUncached(p) {
		return false, nil
	}
	a.gate.RLock() // see device.go: no capture may begin during the free
	defer a.gate.RUnlock()
	a.unc.mu.Lock()
	dev, ok := a.unc.m[p]
	if ok && a.underway.Load() > 0 {
		a.unc.mu.Unlock()
		return true, newError("free", ErrCaptureUnderway, "pointer %#x was allocated while caching was off; it cannot be freed while a CUDA graph capture is under way", uintptr(p))
	}
	if ok {
		delete(a.unc.m, p)
		a.uncN.Store(int64(len(a.unc.m)))
		a.front.sync()
	}
	a.unc.mu.Unlock()
	if !ok {
		return false, nil // freed meanwhile by another thread
	}
	if err := a.drv.MemFree(dev, p); err != nil {
		// Still allocated: keep the record, so that a later free may retry.
		a.unc.mu.Lock()
		a.unc.m[p] = dev
		a.uncN.Store(int64(len(a.unc.m)))
		a.front.sync()
		a.unc.mu.Unlock()
		return true, driverError("free", err, "freeing %#x (allocated while caching was off) on device %d", uintptr(p), dev)
	}
	return true, nil
}

// isUncached reports whether p was allocated while caching was off.
func (a *Allocator) isUncached(p cuda.Ptr) bool {
	if a.uncN.Load() == 0 {
		return false
	}
	a.unc.mu.Lock()
	_, ok := a.unc.m[p]
	a.unc.mu.Unlock()
	return ok
}
