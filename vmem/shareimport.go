// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cudapool/cudapool/cuda"
)

// ImportCache maps memory other processes shared from their expandable
// segments (SegmentShare), once per segment range, with reference counting.
//
// Design note. Open does what PyTorch's ExpandableSegment::fromShared does,
// within the bound stated in share.go: for file descriptors, pidfd_open the
// exporter once and pidfd_getfd each descriptor, import it and close the
// copy at once (the imported handle keeps the memory); for fabric handles,
// import each. Then it reserves exactly the bytes the handle covers, maps
// entry i at base + i*SegmentSize and grants access (the driver's
// MemSetAccess grants the device and its peers). Any failure undoes what
// was done and says which step failed; a missing pidfd_getfd is the
// driver's *cuda.PidfdError, whose message says what is missing.
//
// Entries are keyed by device and SegmentShare.Key (never by the handle's
// bytes, whose padding may differ for one segment). A second Open of the
// same key returns the same base and counts a reference; the last Close
// synchronises the device (cuMemUnmap does not wait for work that may still
// use the memory, which is why PyTorch's unmapHandles synchronises too),
// then unmaps, releases and frees the range. The exporter's memory lives on
// while any process maps it (the driver counts references), so an
// exporter's free never pulls memory from under an open entry; keeping the
// exported block itself alive until the importer is done is the caller's
// protocol (PyTorch's ref-counter file).
//
// mu is held across the driver calls of Open and Close, so that two opens
// of one key cannot both map it; they are slow (system calls, mappings) and
// rare, and nothing on the malloc/free path waits for this lock.
type ImportCache struct {
	drv ImportDriver

	mu      sync.Mutex
	byKey   map[importKey]*imported // guarded by mu
	byBase  map[cuda.Ptr]*imported  // guarded by mu
	closed  bool                    // guarded by mu
	reserve uint64                  // guarded by mu; bytes reserved by open entries
}

// ImportDriver is what ImportCache needs of the driver: cuda/driver.Driver
// and cuda/sim.Driver both have it.
type ImportDriver interface {
	MemAddressReserve(dev int, size uint64) (cuda.Ptr, error)
	MemAddressFree(dev int, p cuda.Ptr, size uint64) error
	MemImportShareable(dev int, sh cuda.ShareableHandle) (cuda.MemHandle, error)
	MemMap(dev int, p cuda.Ptr, size uint64, h cuda.MemHandle) error
	MemSetAccess(dev int, p cuda.Ptr, size uint64) error
	MemUnmap(dev int, p cuda.Ptr, size uint64) error
	MemRelease(dev int, h cuda.MemHandle) error
	MemGranularity(dev int) (uint64, error)
	DeviceSynchronize(dev int) error
	PidfdOpen(pid int) (int, error)
	PidfdGetfd(pidfd, pid, fd int) (int, error)
	CloseFD(fd int) error
}

// ErrImportCacheClosed is returned by Open after Close.
var ErrImportCacheClosed = errors.New("the import cache is closed")

// ErrUnknownImport is returned by Release for an address Open did not
// return, or whose references are all released.
var ErrUnknownImport = errors.New("not an open import")

type importKey struct {
	dev int
	key string
}

// imported is one open entry: a reservation of size bytes at base on dev,
// with handles mapped in order, used by refs opens.
type imported struct {
	k       importKey
	dev     int
	base    cuda.Ptr
	size    uint64
	seg     uint64
	handles []cuda.MemHandle
	refs    int
}

// NewImportCache returns an empty cache over drv.
func NewImportCache(drv ImportDriver) *ImportCache {
	return &ImportCache{drv: drv, byKey: make(map[importKey]*imported), byBase: make(map[cuda.Ptr]*imported)}
}

// Open maps the memory s shares on device dev, or counts another reference
// to its mapping, and returns the mapping's base: the handle's offset is
// from there. Each Open needs one Release.
func (c *ImportCache) Open(dev int, s SegmentShare) (cuda.Ptr, error) {
	if err := s.validate(); err != nil {
		return 0, err
	}
	k := importKey{dev: dev, key: s.Key()}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return 0, ErrImportCacheClosed
	}
	if e := c.byKey[k]; e != nil {
		e.refs++
		return e.base, nil
	}
	g, err := c.drv.MemGranularity(dev)
	if err != nil {
		return 0, fmt.Errorf("importing memory shared by process %d: the device's granularity: %w", s.PID, err)
	}
	if s.SegmentSize%g != 0 {
		return 0, fmt.Errorf("%w: its allocations of %d bytes are not a multiple of device %d's granularity (%d)", ErrBadHandle, s.SegmentSize, dev, g)
	}
	e := &imported{k: k, dev: dev, size: s.Bytes(), seg: s.SegmentSize, refs: 1}
	if err := c.importHandles(e, s); err != nil {
		return 0, err
	}
	if err := c.mapAll(e); err != nil {
		return 0, err
	}
	c.byKey[k] = e
	c.byBase[e.base] = e
	c.reserve += e.size
	return e.base, nil
}

// importHandles fills e.handles from s; on failure it releases what it
// imported.
func (c *ImportCache) importHandles(e *imported, s SegmentShare) (err error) {
	defer func() {
		if err != nil {
			_ = c.releaseHandles(e) // (best effort: the import failed already)
		}
	}()
	if s.Kind == cuda.ShareableFabric {
		for i := range s.Fabric {
			h, err := c.drv.MemImportShareable(e.dev, cuda.ShareableHandle{Kind: cuda.ShareableFabric, FD: -1, Fabric: s.Fabric[i]})
			if err != nil {
				return fmt.Errorf("importing fabric handle %d of %d shared by process %d: %w", i+1, len(s.Fabric), s.PID, err)
			}
			e.handles = append(e.handles, h)
		}
		return nil
	}
	pid := int(s.PID)
	pidfd, err := c.drv.PidfdOpen(pid)
	if err != nil {
		return fmt.Errorf("importing memory shared by process %d: %w", pid, err)
	}
	defer c.drv.CloseFD(pidfd)
	for i, fd := range s.FDs {
		mine, err := c.drv.PidfdGetfd(pidfd, pid, int(fd))
		if err != nil {
			return fmt.Errorf("importing memory shared by process %d: %w", pid, err)
		}
		h, err := c.drv.MemImportShareable(e.dev, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: mine})
		c.drv.CloseFD(mine) // the imported handle holds the memory
		if err != nil {
			return fmt.Errorf("importing file descriptor %d (%d of %d) of process %d: %w", fd, i+1, len(s.FDs), pid, err)
		}
		e.handles = append(e.handles, h)
	}
	return nil
}

// mapAll reserves e's range, maps its handles in order and grants access;
// on failure it undoes all of it, handles included.
func (c *ImportCache) mapAll(e *imported) error {
	base, err := c.drv.MemAddressReserve(e.dev, e.size)
	if err != nil {
		_ = c.releaseHandles(e)
		return fmt.Errorf("reserving %d bytes of address space for an import: %w", e.size, err)
	}
	e.base = base
	mapped := 0
	fail := func(what string, err error) error {
		// Undone best effort; what cannot be undone is said, since it
		// stays (mapped memory stays allocated, an address range
		// reserved).
		var undo []error
		for i := mapped - 1; i >= 0; i-- {
			if uerr := c.drv.MemUnmap(e.dev, base+cuda.Ptr(uint64(i)*e.seg), e.seg); uerr != nil {
				undo = append(undo, fmt.Errorf("unmapping allocation %d: %w", i+1, uerr))
			}
		}
		if ferr := c.drv.MemAddressFree(e.dev, base, e.size); ferr != nil {
			undo = append(undo, fmt.Errorf("freeing the %d-byte address range at %#x: %w", e.size, uintptr(base), ferr))
		}
		if rerr := c.releaseHandles(e); rerr != nil {
			undo = append(undo, rerr)
		}
		if len(undo) > 0 {
			return fmt.Errorf("%s of an import: %w (undoing it failed too: %w)", what, err, errors.Join(undo...))
		}
		return fmt.Errorf("%s of an import: %w", what, err)
	}
	for i, h := range e.handles {
		if err := c.drv.MemMap(e.dev, base+cuda.Ptr(uint64(i)*e.seg), e.seg, h); err != nil {
			return fail(fmt.Sprintf("mapping allocation %d of %d", i+1, len(e.handles)), err)
		}
		mapped++
	}
	if err := c.drv.MemSetAccess(e.dev, base, e.size); err != nil {
		return fail("granting access", err)
	}
	return nil
}

// releaseHandles releases e's imported handles, every one tried, and
// returns the first failure.
func (c *ImportCache) releaseHandles(e *imported) error {
	var first error
	for i, h := range e.handles {
		if err := c.drv.MemRelease(e.dev, h); err != nil && first == nil {
			first = fmt.Errorf("releasing imported allocation %d of %d: %w", i+1, len(e.handles), err)
		}
	}
	e.handles = nil
	return first
}

// Release drops one reference to the mapping at base, which Open returned;
// the last one synchronises the device and unmaps the mapping.
func (c *ImportCache) Release(base cuda.Ptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.byBase[base]
	if e == nil {
		return fmt.Errorf("releasing an import at %#x: %w", uintptr(base), ErrUnknownImport)
	}
	if e.refs--; e.refs > 0 {
		return nil
	}
	return c.unmap(e)
}

// unmap tears e down and forgets it; mu is held. The first error is
// reported, but every step is tried.
func (c *ImportCache) unmap(e *imported) error {
	delete(c.byKey, e.k)
	delete(c.byBase, e.base)
	c.reserve -= e.size
	var errs []error
	if err := c.drv.DeviceSynchronize(e.dev); err != nil {
		errs = append(errs, fmt.Errorf("synchronising device %d: %w", e.dev, err))
	}
	if err := c.drv.MemUnmap(e.dev, e.base, e.size); err != nil {
		errs = append(errs, fmt.Errorf("unmapping %#x (%d bytes): %w", uintptr(e.base), e.size, err))
	}
	if err := c.releaseHandles(e); err != nil {
		errs = append(errs, err)
	}
	if err := c.drv.MemAddressFree(e.dev, e.base, e.size); err != nil {
		errs = append(errs, fmt.Errorf("freeing the reservation at %#x: %w", uintptr(e.base), err))
	}
	if len(errs) > 0 {
		return fmt.Errorf("closing an import: %w", errors.Join(errs...))
	}
	return nil
}

// Close unmaps every open entry, whatever its references, and refuses later
// opens: for a process that is shutting down its allocator.
func (c *ImportCache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	var errs []error
	for _, e := range c.byBase {
		if err := c.unmap(e); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Stats returns the number of open entries, the references to them and the
// address space they reserve.
func (c *ImportCache) Stats() (entries, refs int, reserved uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range c.byBase {
		refs += e.refs
	}
	return len(c.byBase), refs, c.reserve
}
