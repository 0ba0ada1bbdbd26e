// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/events"
)

// Driver is the CUDA the allocator needs. cuda/driver implements it over the
// real driver API and cuda/sim over a simulator with capture-mode rules.
//
// Methods that name a device must work whatever device is current on the
// calling thread and leave the thread's current context as they found it.
type Driver interface {
	DeviceCount() (int, error)
	// MemGetInfo returns the device's free and total memory in bytes.
	MemGetInfo(dev int) (free, total uint64, err error)
	// MemAlloc allocates device memory. It obeys the calling thread's capture
	// mode, so the allocator switches the thread to relaxed mode around it.
	MemAlloc(dev int, size uint64) (cuda.Ptr, error)
	MemFree(dev int, p cuda.Ptr) error
	DeviceSynchronize(dev int) error
	// StreamCaptureInfo reports whether s is capturing and the capture
	// sequence's id. It is legal during capture.
	StreamCaptureInfo(dev int, s cuda.Stream) (cuda.CaptureStatus, uint64, error)
	// ExchangeCaptureMode sets the calling OS thread's capture mode and
	// returns the previous one (cuThreadExchangeStreamCaptureMode).
	ExchangeCaptureMode(mode cuda.CaptureMode) (cuda.CaptureMode, error)
	events.Driver
}

// relaxedAllocator is implemented by drivers that can switch the calling
// thread to relaxed capture mode, allocate and switch back in one call
// (the real driver does it in C, with no goroutine pinning).
type relaxedAllocator interface {
	MemAllocRelaxed(dev int, size uint64) (cuda.Ptr, error)
}

// processLister is implemented by drivers that can name the processes using a
// device (the real driver, through NVML). The OOM message lists them.
type processLister interface {
	DeviceProcesses(dev int) ([]cuda.ProcessMemory, error)
}

// ipcDriver is implemented by drivers with CUDA IPC of memory (cuda/driver,
// where the driver has it, and cuda/sim), which lets another process map
// memory from MemAlloc; see ipc.go. None of the calls is stream-ordered, and
// none disturbs a capture under way (tried on the driver with a global-mode
// capture and the calling thread in global mode), so they need no
// capture-mode switching.
type ipcDriver interface {
	// IpcGetMemHandle returns the IPC handle of the MemAlloc allocation
	// holding p. Memory of other kinds (VMM-mapped, or itself opened from
	// another process) fails with cuda.ErrInvalidValue.
	IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error)
	// IpcOpenMemHandle maps the memory h names into dev's primary context.
	// The driver counts references: a handle already open returns the same
	// address.
	IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error)
	// IpcCloseMemHandle drops one reference to a mapping IpcOpenMemHandle
	// returned on dev; the last one unmaps it.
	IpcCloseMemHandle(dev int, p cuda.Ptr) error
}
