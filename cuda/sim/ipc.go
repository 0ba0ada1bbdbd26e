// SPDX-License-Identifier: Apache-2.0

package sim

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sync/atomic"

	"github.com/cudapool/cudapool/cuda"
)

// CUDA IPC of memory (cuIpcGetMemHandle, cuIpcOpenMemHandle,
// cuIpcCloseMemHandle), through which PyTorch shares CUDA tensors between
// processes.
//
// The simulator plays both processes: a handle it made can be opened by the
// same Driver (the real driver refuses a process its own handles with
// CUDA_ERROR_INVALID_CONTEXT), and by no other Driver. What the real driver
// does was checked on an H100 with driver 580 (CUDA 13), and the model
// follows it:
//
//   - IpcGetMemHandle names the live MemAlloc allocation that holds the
//     address; any address inside it names the whole allocation, as on the
//     driver. Anything else (VMM-mapped memory, an IPC mapping, freed or
//     unknown memory) is ErrInvalidValue. A handle is
//     "cudapool-sim-ipc" (16 bytes), the Driver's instance number, the
//     device, the allocation's base and size, and a generation number given
//     at its first export, so that a handle of memory freed since is
//     detected as stale (addresses are never reused here, but the
//     generation does not rely on that). Exporting again returns the same
//     handle.
//   - IpcOpenMemHandle maps the allocation into device dev's context at a
//     fresh address range of dev's (taken from the same bump pointer as
//     MemAlloc, so it meets nothing else), which aliases it: IpcSource
//     translates an address in it back to the exported address. The mapping
//     uses no memory of its own. Opening a handle already open on dev
//     returns the same address and adds a reference, as on the driver. A
//     stale handle, a handle of another Driver, or bytes that are no handle,
//     are ErrInvalidValue.
//   - IpcCloseMemHandle drops a reference to the mapping whose exact address
//     it is given, on the device that opened it; the last one unmaps.
//     Anything else is ErrInvalidValue.
//   - None of the three is stream-ordered, and none is refused during a
//     capture, whatever the thread's capture mode: the driver neither
//     refuses them nor invalidates the capture (tried with a global-mode
//     capture and a thread in global mode).
//   - Freeing (MemFree) an allocation while an IPC mapping of it is open is
//     undefined behaviour in CUDA: the importer's memory may become another
//     allocation's. The free succeeds, as on the driver, and is recorded as
//     a violation (Violations, ViolationLog), so that a test catches an
//     allocator that frees memory another "process" still uses; the mapping
//     stays open until closed, and the handle is stale from then on.

// ipcMagic starts every simulated handle.
const ipcMagic = "cudapool-sim-ipc"

// instances numbers Drivers, so that a handle names its Driver.
var instances atomic.Uint64

// ipcState is one device's IPC state; guarded by Driver.mu.
type ipcState struct {
	// exported maps the base of each live allocation exported at least once
	// to its handle's generation.
	exported map[cuda.Ptr]uint64
	// imports are the mappings open in this device's context, by address;
	// byHandle finds them by what they map.
	imports  map[cuda.Ptr]*ipcImport
	byHandle map[ipcSource]cuda.Ptr
}

// ipcSource is what a handle names.
type ipcSource struct {
	dev  int
	base cuda.Ptr
	size uint64
	gen  uint64
}

type ipcImport struct {
	src  ipcSource
	refs int
}

func newIPCState() ipcState {
	return ipcState{
		exported: make(map[cuda.Ptr]uint64),
		imports:  make(map[cuda.Ptr]*ipcImport),
		byHandle: make(map[ipcSource]cuda.Ptr),
	}
}

func (d *Driver) encodeHandle(src ipcSource) cuda.IpcHandle {
	var h cuda.IpcHandle
	copy(h[:16], ipcMagic)
	binary.LittleEndian.PutUint64(h[16:], d.instance)
	binary.LittleEndian.PutUint32(h[24:], uint32(src.dev))
	binary.LittleEndian.PutUint64(h[32:], uint64(src.base))
	binary.LittleEndian.PutUint64(h[40:], src.size)
	binary.LittleEndian.PutUint64(h[48:], src.gen)
	return h
}

// decodeHandle returns what h names, if h is a well-formed handle of this
// Driver; it does not check that the memory is still live.
func (d *Driver) decodeHandle(h cuda.IpcHandle) (ipcSource, bool) {
	if !bytes.Equal(h[:16], []byte(ipcMagic)) || binary.LittleEndian.Uint64(h[16:]) != d.instance ||
		binary.LittleEndian.Uint32(h[28:]) != 0 || binary.LittleEndian.Uint64(h[56:]) != 0 {
		return ipcSource{}, false
	}
	src := ipcSource{
		dev:  int(binary.LittleEndian.Uint32(h[24:])),
		base: cuda.Ptr(binary.LittleEndian.Uint64(h[32:])),
		size: binary.LittleEndian.Uint64(h[40:]),
		gen:  binary.LittleEndian.Uint64(h[48:]),
	}
	return src, src.dev < len(d.devs) && src.gen != 0
}

// allocationAt returns the base and size of dv's live MemAlloc allocation
// holding p; mu must be held.
func (dv *device) allocationAt(p cuda.Ptr) (cuda.Ptr, uint64, bool) {
	if size, ok := dv.live[p]; ok {
		return p, size, true
	}
	for base, size := range dv.live {
		if p > base && uint64(p-base) < size {
			return base, size, true
		}
	}
	return 0, 0, false
}

// IpcGetMemHandle returns the IPC handle of dev's live MemAlloc allocation
// that holds p. It is legal during capture.
func (d *Driver) IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return cuda.IpcHandle{}, err
	}
	base, size, ok := dv.allocationAt(p)
	if !ok {
		return cuda.IpcHandle{}, cuda.ErrInvalidValue
	}
	gen, ok := dv.ipc.exported[base]
	if !ok {
		d.lastIpcGen++
		gen = d.lastIpcGen
		dv.ipc.exported[base] = gen
	}
	return d.encodeHandle(ipcSource{dev: dev, base: base, size: size, gen: gen}), nil
}

// IpcOpenMemHandle maps the allocation h names into dev's context, or adds a
// reference to its mapping there. It is legal during capture.
func (d *Driver) IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return 0, err
	}
	src, ok := d.decodeHandle(h)
	if !ok {
		return 0, cuda.ErrInvalidValue
	}
	if gen, ok := d.devs[src.dev].ipc.exported[src.base]; !ok || gen != src.gen {
		return 0, cuda.ErrInvalidValue // freed since: stale
	}
	if p, ok := dv.ipc.byHandle[src]; ok {
		dv.ipc.imports[p].refs++
		return p, nil
	}
	room := dv.limit - dv.next
	if src.size > room || alignUp(src.size) > room {
		return 0, cuda.ErrOutOfMemory
	}
	p := cuda.Ptr(dv.next)
	dv.next += alignUp(src.size)
	dv.ipc.imports[p] = &ipcImport{src: src, refs: 1}
	dv.ipc.byHandle[src] = p
	return p, nil
}

// IpcCloseMemHandle drops a reference to the mapping at p that
// IpcOpenMemHandle returned on dev; the last one unmaps it. It is legal
// during capture.
func (d *Driver) IpcCloseMemHandle(dev int, p cuda.Ptr) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	im := dv.ipc.imports[p]
	if im == nil {
		return cuda.ErrInvalidValue
	}
	if im.refs--; im.refs == 0 {
		delete(dv.ipc.imports, p)
		delete(dv.ipc.byHandle, im.src)
	}
	return nil
}

// ipcFreed forgets the export of dev's allocation at p, which MemFree is
// freeing, and records a violation for each IPC mapping of it still open;
// mu must be held.
func (d *Driver) ipcFreed(tid, dev int, p cuda.Ptr) {
	dv := d.devs[dev]
	gen, ok := dv.ipc.exported[p]
	if !ok {
		return
	}
	delete(dv.ipc.exported, p)
	for i, o := range d.devs {
		for q, im := range o.ipc.imports {
			if im.src.dev == dev && im.src.base == p && im.src.gen == gen {
				d.violate(fmt.Sprintf("MemFree(dev=%d, ptr=%#x) on thread %d while a CUDA IPC mapping of it is open (at %#x on device %d, %d references): undefined behaviour in CUDA", dev, uintptr(p), tid, uintptr(q), i, im.refs), nil)
			}
		}
	}
}

// importAt returns the IPC mapping of dv holding [p, p+size); mu must be
// held.
func (dv *device) importAt(p cuda.Ptr, size uint64) (cuda.Ptr, *ipcImport) {
	for q, im := range dv.ipc.imports {
		if p >= q && uint64(p-q) < im.src.size && uint64(p-q)+size <= im.src.size {
			return q, im
		}
	}
	return 0, nil
}

// IpcSource translates p, an address inside an IPC mapping open on dev, to
// the address it aliases: the exporting device and the address in the
// exported allocation. ok is false if no mapping on dev holds p.
func (d *Driver) IpcSource(dev int, p cuda.Ptr) (srcDev int, src cuda.Ptr, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	q, im := d.mustDevice(dev).importAt(p, 0)
	if im == nil {
		return 0, 0, false
	}
	return im.src.dev, im.src.base + (p - q), true
}

// IpcMappings returns the number of IPC mappings open on dev and the
// references to them (each IpcOpenMemHandle not yet closed).
func (d *Driver) IpcMappings(dev int) (mappings, refs int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, im := range d.mustDevice(dev).ipc.imports {
		mappings++
		refs += im.refs
	}
	return mappings, refs
}
