// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
)

// CUDA IPC: sharing cudapool's memory with other processes, as PyTorch's
// torch.multiprocessing does with CUDA tensors.
//
// The sending process asks IpcHandle for the handle of the segment that
// holds a block and the block's offset in it, which is what PyTorch's own
// allocator sends (cudaIpcGetMemHandle of the segment's base, plus the
// offset): a handle names a whole cuMemAlloc allocation, and a segment is
// one. The receiving process maps the segment with IpcOpen and adds the
// offset; IpcClose unmaps it when the last user is done. Keeping the block
// alive meanwhile is the caller's business (PyTorch keeps the sender's
// storage alive until the receivers let go of it).
//
// Expandable segments cannot take part here: their pages are VMM
// allocations (cuMemCreate), which the driver cannot name with an IPC
// handle (it answers CUDA_ERROR_INVALID_VALUE), so IpcHandle refuses their
// blocks with ErrNotSupported and points to ShareIpcHandle, whose handle in
// PyTorch's format covers both kinds of memory (share.go); OpenIpcHandle
// opens either kind and IpcClose closes either.
//
// Opened handles are cached: opening a handle that is already open returns
// the same address and counts a reference, and IpcClose unmaps on the last
// one, as PyTorch's allocator does for its IPC users. The CUDA driver counts
// references too, but a caller that opens a handle per tensor would then pay
// for a driver call each time; the cache makes repeat opens cheap and keeps
// one driver reference per mapping.
//
// The cache is one table for every Allocator of the process, keyed by
// Allocator, and guarded by its own mutex, never a device lock. (Two
// Allocators over one driver keep separate entries; the driver's own
// reference counting keeps their mappings apart.) The mutex is held across
// the driver's open and close calls, so that two opens of one handle cannot
// race to map it twice; they are slow (a mapping, perhaps enabling peer
// access) but rare, and no malloc or free waits for them. IpcHandle instead holds the
// block's device lock across cuIpcGetMemHandle (a cheap lookup in the
// driver), so that the segment cannot be freed between finding it and
// naming it. Nothing takes a device lock while holding the cache's mutex.
//
// None of the driver's IPC calls is stream-ordered, and none of them
// disturbs a graph capture under way, so all three may be called during a
// capture.

// ErrNotSupported is the kind of an error for a feature that cudapool or the
// CUDA driver lacks (CUDA IPC of expandable segments, or a driver without
// CUDA IPC).
var ErrNotSupported = errors.New("not supported")

// ipcMaps is the open-handle cache. Entries go with their mapping's last
// IpcClose.
var ipcMaps = struct {
	mu       rankedMutex
	byHandle map[ipcKey]*ipcMapping // guarded by mu
	byAddr   map[ipcAddr]*ipcMapping
}{mu: rankedMutex{rank: rankIPC}, byHandle: make(map[ipcKey]*ipcMapping), byAddr: make(map[ipcAddr]*ipcMapping)}

// ipcKey is a handle an Allocator opened on a device.
type ipcKey struct {
	a   *Allocator
	dev int
	h   cuda.IpcHandle
}

// ipcAddr is a mapped address of an Allocator (the addresses of all devices
// share one space).
type ipcAddr struct {
	a *Allocator
	p cuda.Ptr
}

// ipcMapping is one mapping: one driver reference, refs users, and the
// handles it was opened with (two handles may name one allocation).
type ipcMapping struct {
	dev  int
	p    cuda.Ptr
	refs int
	keys []ipcKey
}

// IpcHandle returns the CUDA IPC handle of the segment that holds the
// allocated block at p, and p's offset in that segment, and the segment's
// device. Another process maps the segment with IpcOpen(dev, h) and finds
// p's memory at the returned address plus offset.
//
// p must be an allocated block's address. A block of an expandable segment
// (expandable_segments:True) cannot be shared: ErrNotSupported, as with a
// driver without CUDA IPC. As with ShareIpcHandle, a shared block's tag
// cannot be paused until the block is freed, and a paused tag's block
// cannot be shared (ErrPaused).
func (a *Allocator) IpcHandle(p cuda.Ptr) (h cuda.IpcHandle, offset uint64, dev int, err error) {
	const op = "ipc_handle"
	d, b, err := a.findShared(op, p)
	if err != nil {
		return h, 0, 0, err
	}
	defer d.leave()
	if b.Seg.Expandable {
		return h, 0, 0, newError(op, ErrNotSupported, "pointer %#x on device %d is in an expandable segment (expandable_segments:True, on by default with stitching), "+
			"whose pages are CUDA virtual memory with no 64-byte cudaIpcMemHandle; share it with cudapool_ipc_share (PyTorch's handle format, which covers expandable memory)",
			uintptr(p), d.id)
	}
	h, offset, err = a.segmentIpcHandle(op, d, b.Seg.Base, p)
	if err == nil {
		b.Shared = true // until its free: a pause of its tag is refused (pause.go)
	}
	return h, offset, d.id, err
}

// segmentIpcHandle returns the CUDA IPC handle of the ordinary segment at
// base on d, which holds p, and p's offset in it. d is locked.
func (a *Allocator) segmentIpcHandle(op string, d *device, base, p cuda.Ptr) (cuda.IpcHandle, uint64, error) {
	drv, ok := a.drv.(ipcDriver)
	if !ok {
		return cuda.IpcHandle{}, 0, noIPC(op)
	}
	h, err := drv.IpcGetMemHandle(d.id, base)
	if err != nil {
		if errors.Is(err, cuda.ErrNotSupported) {
			return h, 0, &Error{Op: op, Kind: ErrNotSupported, Msg: "the CUDA driver has no CUDA IPC (cuIpcGetMemHandle)", Err: err}
		}
		return h, 0, driverError(op, err, "cuIpcGetMemHandle of the segment at %#x on device %d, which holds pointer %#x", uintptr(base), d.id, uintptr(p))
	}
	return h, uint64(p - base), nil
}

// IpcOpen maps the memory another process shared with IpcHandle (or
// PyTorch's cudaIpcGetMemHandle) into device dev and returns its address. A
// handle already open on dev returns the same address and counts one more
// reference; each IpcOpen needs one IpcClose.
//
// A handle of memory that has been freed, or bytes that are no handle, are
// ErrInvalidArgument; so is a handle this same process made, which CUDA
// refuses to open (use the memory directly).
func (a *Allocator) IpcOpen(dev int, h cuda.IpcHandle) (cuda.Ptr, error) {
	const op = "ipc_open"
	if _, err := a.device(op, dev); err != nil {
		return 0, err
	}
	drv, ok := a.drv.(ipcDriver)
	if !ok {
		return 0, noIPC(op)
	}
	key := ipcKey{a: a, dev: dev, h: h}
	ipcMaps.mu.Lock()
	defer ipcMaps.mu.Unlock()
	if m := ipcMaps.byHandle[key]; m != nil {
		m.refs++
		return m.p, nil
	}
	p, err := drv.IpcOpenMemHandle(dev, h)
	if err != nil {
		return 0, openError(dev, err)
	}
	addr := ipcAddr{a: a, p: p}
	if m := ipcMaps.byAddr[addr]; m != nil {
		// Another handle of an allocation already open here: the driver
		// counted a second reference to the same mapping. Keep one.
		if err := drv.IpcCloseMemHandle(dev, p); err != nil {
			return 0, driverError(op, err, "dropping the driver's second reference to the mapping at %#x on device %d", uintptr(p), dev)
		}
		m.refs++
		m.keys = append(m.keys, key)
		ipcMaps.byHandle[key] = m
		return p, nil
	}
	m := &ipcMapping{dev: dev, p: p, refs: 1, keys: []ipcKey{key}}
	ipcMaps.byHandle[key] = m
	ipcMaps.byAddr[addr] = m
	return p, nil
}

// IpcClose drops one reference to a mapping IpcOpen or OpenIpcHandle
// returned; the last one unmaps it. p must be the address they returned.
func (a *Allocator) IpcClose(p cuda.Ptr) error {
	const op = "ipc_close"
	if done, err := a.imports.closeImport(p); done {
		if err != nil {
			return &Error{Op: op, Kind: ErrDriver, Msg: fmt.Sprintf("closing the import at %#x", uintptr(p)), Err: err}
		}
		return nil
	}
	drv, ok := a.drv.(ipcDriver)
	if !ok {
		return noIPC(op)
	}
	err := a.ipcClose(drv, p)
	if err != nil && errors.Is(err, ErrUnknownPointer) {
		// Say what p is, if cudapool allocated it, outside the cache's
		// mutex (this takes device locks).
		if d, b := a.find(p); d != nil {
			ptr, dev := b.Ptr, d.id
			d.leave()
			return newError(op, ErrUnknownPointer, "pointer %#x is cudapool's own allocation on device %d, not a mapping opened with IpcOpen; free it instead", uintptr(ptr), dev)
		}
	}
	return err
}

func (a *Allocator) ipcClose(drv ipcDriver, p cuda.Ptr) error {
	const op = "ipc_close"
	ipcMaps.mu.Lock()
	defer ipcMaps.mu.Unlock()
	addr := ipcAddr{a: a, p: p}
	m := ipcMaps.byAddr[addr]
	if m == nil {
		return newError(op, ErrUnknownPointer, "pointer %#x is not a CUDA IPC mapping opened with IpcOpen (never opened, closed already, or not the address IpcOpen returned)", uintptr(p))
	}
	if m.refs--; m.refs > 0 {
		return nil
	}
	delete(ipcMaps.byAddr, addr)
	for _, k := range m.keys {
		delete(ipcMaps.byHandle, k)
	}
	if err := drv.IpcCloseMemHandle(m.dev, p); err != nil {
		return driverError(op, err, "cuIpcCloseMemHandle of the mapping at %#x on device %d", uintptr(p), m.dev)
	}
	return nil
}

// openError explains a failed cuIpcOpenMemHandle.
func openError(dev int, err error) error {
	const op = "ipc_open"
	switch {
	case errors.Is(err, cuda.ErrInvalidValue):
		return &Error{Op: op, Kind: ErrInvalidArgument, Err: err, Msg: fmt.Sprintf(
			"device %d: the CUDA IPC handle names no memory the driver can map (the exporting process freed it or exited, or the bytes are not a handle)", dev)}
	case errors.Is(err, cuda.ErrInvalidContext):
		return &Error{Op: op, Kind: ErrInvalidArgument, Err: err, Msg: fmt.Sprintf(
			"device %d: CUDA refuses to open the IPC handle, most likely because this process made it (a process cannot open its own handles; use the memory directly)", dev)}
	case errors.Is(err, cuda.ErrNotSupported):
		return &Error{Op: op, Kind: ErrNotSupported, Err: err, Msg: "the CUDA driver has no CUDA IPC (cuIpcOpenMemHandle)"}
	}
	return driverError(op, err, "cuIpcOpenMemHandle on device %d", dev)
}

func noIPC(op string) error {
	return newError(op, ErrNotSupported, "the CUDA driver in use has no CUDA IPC (cuIpcGetMemHandle, cuIpcOpenMemHandle, cuIpcCloseMemHandle)")
}
