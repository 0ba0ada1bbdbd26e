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
