// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/vmem"
)

// Sharing memory with other processes in PyTorch's handle format, whatever
// the memory: a block of an ordinary segment as its segment's CUDA IPC
// handle (type 'c', ipc.go's mechanism), a block of an expandable segment,
// stitched or not, as the physical allocations under it (type 'e': vmem's
// export.go exports them, share.go holds the format). PyTorch's
// torch.multiprocessing sends what ShareIpcHandle returns and the receiver
// calls OpenIpcHandle with it, so a cudapool process and a native PyTorch
// process exchange tensors in both directions.
//
// The receiving side routes by type: 'c' to IpcOpen (the driver's
// cuIpcOpenMemHandle, cached per handle), 'e' to the Allocator's import
// cache (vmem.ImportCache: one per Allocator, so one per process through
// the C ABI), which maps only the bytes the handle covers and counts
// references; IpcClose closes either. Opening imports runs with the thread
// in relaxed capture mode, like every mapping the allocator makes; the last
// close of an import synchronizes the device (as PyTorch's does), which a
// capture under way forbids.
//
// The import cache has its own lock (vmem), taken with no allocator lock
// held; ShareIpcHandle holds the block's device lock across the export,
// so that the block cannot be freed meanwhile.

// ShareIpcHandle returns PyTorch's shareable handle of the memory of the
// allocated block at p (the version byte, the type byte and the payload),
// p's offset from the start of the memory the handle names, and p's device.
// Another process opens it with OpenIpcHandle (or PyTorch's getIpcDevPtr)
// and finds p's memory at the returned address plus offset. The block must
// stay allocated until the other process has opened the handle (PyTorch
// keeps a shared storage alive until its receivers let go). A shared
// block's tag cannot be paused until the block is freed, and a block of a
// paused tag cannot be shared (ErrPaused).
func (a *Allocator) ShareIpcHandle(p cuda.Ptr) (handle []byte, offset uint64, dev int, err error) {
	const op = "ipc_share"
	d, b, err := a.findShared(op, p)
	if err != nil {
		return nil, 0, 0, err
	}
	defer d.leave()
	if !b.Seg.Expandable {
		h, off, err := a.segmentIpcHandle(op, d, b.Seg.Base, p)
		if err != nil {
			return nil, 0, 0, err
		}
		b.Shared = true // until its free: a pause of its tag is refused (pause.go)
		return vmem.EncodeCudaMalloc(h), off, d.id, nil
	}
	s, off, err := d.vm.Share(b, op)
	if err != nil {
		if errors.Is(err, vmem.ErrNotShareable) {
			return nil, 0, 0, &Error{Op: op, Kind: ErrNotSupported, Msg: err.Error()}
		}
		return nil, 0, 0, err
	}
	h, err := vmem.EncodeSegment(s)
	if err != nil {
		return nil, 0, 0, newError(op, ErrInvalidArgument, "encoding the handle of pointer %#x on device %d: %v", uintptr(p), d.id, err)
	}
	b.Shared = true // as above
	return h, off, d.id, nil
}

// OpenIpcHandle maps the memory another process shared with
// ShareIpcHandle (or PyTorch's shareIpcHandle) into device dev and returns
// its address, where the handle's offset starts. Opening a handle of memory
// already open here returns the same address and counts one more
// reference; each OpenIpcHandle needs one IpcClose.
//
// Bytes that are no handle, or a handle of a PyTorch newer than cudapool
// reads, are ErrInvalidArgument. A kernel or a permission that does not
// let this process take the exporter's file descriptors (pidfd_open,
// pidfd_getfd) is ErrNotSupported and says what is missing; the error wraps
// the *cuda.PidfdError.
func (a *Allocator) OpenIpcHandle(dev int, handle []byte) (cuda.Ptr, error) {
	const op = "ipc_open_shared"
	if _, err := a.device(op, dev); err != nil {
		return 0, err
	}
	h, err := vmem.ParseStorageHandle(handle)
	if err != nil {
		return 0, &Error{Op: op, Kind: ErrInvalidArgument, Msg: fmt.Sprintf("a handle of %d bytes", len(handle)), Err: err}
	}
	if h.Type == vmem.TypeCudaMalloc {
		p, err := a.IpcOpen(dev, h.IPC)
		if e := (*Error)(nil); errors.As(err, &e) {
			e.Op = op
		}
		return p, err
	}
	c, err := a.imports.get(a.drv)
	if err != nil {
		return 0, newError(op, ErrNotSupported, "%v", err)
	}
	var base cuda.Ptr
	err = cuda.WithThreadRelaxed(a.drv, func() (err error) {
		base, err = c.Open(dev, h.Segment)
		return err
	}, func(prev cuda.CaptureMode, err error) {
		a.warn(fmt.Sprintf("restoring the calling thread's capture mode (%v) after importing shared memory failed (%v); the thread may stay in relaxed capture mode", prev, err))
	})
	if err != nil {
		return 0, importError(op, dev, err)
	}
	return base, nil
}

// importError gives an import's failure the allocator's form.
func importError(op string, dev int, err error) error {
	kind := ErrDriver
	var pe *cuda.PidfdError
	switch {
	case errors.Is(err, vmem.ErrBadHandle):
		kind = ErrInvalidArgument
	case errors.As(err, &pe):
		kind = ErrInvalidArgument // a stale handle, or an exporter that exited
		if pe.Errno == syscall.ENOSYS || pe.Errno == syscall.EPERM || pe.Errno == syscall.EMFILE {
			kind = ErrNotSupported // what this system does not allow
		}
	}
	return &Error{Op: op, Kind: kind, Msg: fmt.Sprintf("device %d", dev), Err: err}
}

// shareImports is an Allocator's import cache, made at its first use.
type shareImports struct {
	mu    sync.Mutex // serializes the making
	cache atomic.Pointer[vmem.ImportCache]
}

// get returns the import cache over drv.
func (s *shareImports) get(drv Driver) (*vmem.ImportCache, error) {
	if c := s.cache.Load(); c != nil {
		return c, nil
	}
	id, ok := drv.(vmem.ImportDriver)
	if !ok {
		return nil, errors.New("the CUDA driver in use cannot import memory shared by another process (cuMemImportFromShareableHandle)")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache.Load() == nil {
		s.cache.Store(vmem.NewImportCache(id))
	}
	return s.cache.Load(), nil
}

// closeImport drops one reference to the import at p, if p is one: done
// reports whether it was.
func (s *shareImports) closeImport(p cuda.Ptr) (done bool, err error) {
	c := s.cache.Load()
	if c == nil {
		return false, nil
	}
	err = c.Release(p)
	if errors.Is(err, vmem.ErrUnknownImport) {
		return false, nil
	}
	return true, err
}

// ImportStats returns the imports open here (vmem.ImportCache.Stats): the
// mappings, the references to them and the address space they reserve.
func (a *Allocator) ImportStats() (entries, refs int, reserved uint64) {
	c, err := a.imports.get(a.drv)
	if err != nil {
		return 0, 0, 0
	}
	return c.Stats()
}

// ExportStats returns device dev's exported physical allocations and the
// file descriptors they hold (vmem's export.go).
func (a *Allocator) ExportStats(dev int) (allocations, fds int, err error) {
	err = a.withDevice("export_stats", dev, func(d *device) error {
		allocations, fds = d.vm.Exported()
		return nil
	})
	return allocations, fds, err
}

// findShared is the prologue of an export named op: p's block, its device
// entered (the caller leaves it), p taken from the front cache (shared with
// another process, its free goes to Go), and the tag's refusal (shareable).
// On error no device is held.
func (a *Allocator) findShared(op string, p cuda.Ptr) (*device, *pools.Block, error) {
	d, b := a.find(p)
	if d == nil {
		return nil, nil, a.explainUnknown(op, -1, p)
	}
	d.invalidate(p)
	if err := d.shareable(op, b); err != nil {
		d.leave()
		return nil, nil, err
	}
	return d, b, nil
}
