// SPDX-License-Identifier: Apache-2.0

//go:build !(linux && cgo)

// Package driver is cudapool's real CUDA backend. This build has no backend:
// it needs linux and cgo. Open always fails; the methods exist so that code
// naming *Driver still compiles.
package driver

import (
	"errors"

	"github.com/cudapool/cudapool/cuda"
)

// LibraryName is the CUDA driver library that Open loads.
const LibraryName = "libcuda.so.1"

var errUnsupported = errors.New("cudapool: the CUDA driver backend needs linux and cgo")

// Driver is the CUDA driver API (unavailable in this build).
type Driver struct{}

// Open always fails in this build.
func Open() (*Driver, error) { return nil, errUnsupported }

func (d *Driver) Version() int                  { return 0 }
func (d *Driver) CaptureInfoEntryPoint() string { return "" }
func (d *Driver) Close() error                  { return errUnsupported }
func (d *Driver) DeviceCount() (int, error)     { return 0, errUnsupported }
func (d *Driver) MemGetInfo(int) (uint64, uint64, error) {
	return 0, 0, errUnsupported
}
func (d *Driver) MemAlloc(int, uint64) (cuda.Ptr, error)        { return 0, errUnsupported }
func (d *Driver) MemAllocRelaxed(int, uint64) (cuda.Ptr, error) { return 0, errUnsupported }
func (d *Driver) MemFree(int, cuda.Ptr) error                   { return errUnsupported }
func (d *Driver) DeviceSynchronize(int) error                   { return errUnsupported }
func (d *Driver) StreamCaptureInfo(int, cuda.Stream) (cuda.CaptureStatus, uint64, error) {
	return cuda.CaptureNone, 0, errUnsupported
}
func (d *Driver) ExchangeCaptureMode(m cuda.CaptureMode) (cuda.CaptureMode, error) {
	return m, errUnsupported
}
func (d *Driver) EventCreate(int) (cuda.Event, error)            { return 0, errUnsupported }
func (d *Driver) EventRecord(int, cuda.Event, cuda.Stream) error { return errUnsupported }
func (d *Driver) EventQuery(int, cuda.Event) (bool, error)       { return false, errUnsupported }
func (d *Driver) EventSynchronize(int, cuda.Event) error         { return errUnsupported }
func (d *Driver) EventDestroy(int, cuda.Event) error             { return errUnsupported }
func (d *Driver) DeviceProcesses(int) ([]cuda.ProcessMemory, error) {
	return nil, errUnsupported
}

func (d *Driver) MemGranularity(int) (uint64, error)              { return 0, errUnsupported }
func (d *Driver) MemAddressReserve(int, uint64) (cuda.Ptr, error) { return 0, errUnsupported }
func (d *Driver) MemAddressFree(int, cuda.Ptr, uint64) error      { return errUnsupported }
func (d *Driver) MemCreate(int, uint64) (cuda.MemHandle, error)   { return 0, errUnsupported }
func (d *Driver) MemCreateShareable(int, uint64, cuda.ShareableKind) (cuda.MemHandle, error) {
	return 0, errUnsupported
}
func (d *Driver) MemRelease(int, cuda.MemHandle) error               { return errUnsupported }
func (d *Driver) MemMap(int, cuda.Ptr, uint64, cuda.MemHandle) error { return errUnsupported }
func (d *Driver) MemSetAccess(int, cuda.Ptr, uint64) error           { return errUnsupported }
func (d *Driver) MemUnmap(int, cuda.Ptr, uint64) error               { return errUnsupported }

func (d *Driver) IpcEntryPoint() string { return "" }
func (d *Driver) IpcGetMemHandle(int, cuda.Ptr) (cuda.IpcHandle, error) {
	return cuda.IpcHandle{}, errUnsupported
}
func (d *Driver) IpcOpenMemHandle(int, cuda.IpcHandle) (cuda.Ptr, error) { return 0, errUnsupported }
func (d *Driver) IpcCloseMemHandle(int, cuda.Ptr) error                  { return errUnsupported }

func (d *Driver) ShareableKinds(int) (cuda.ShareableKind, error) { return 0, errUnsupported }
func (d *Driver) ProbeFabric(int) error                          { return errUnsupported }
func (d *Driver) MemExportShareable(int, cuda.MemHandle, cuda.ShareableKind) (cuda.ShareableHandle, error) {
	return cuda.ShareableHandle{}, errUnsupported
}
func (d *Driver) MemImportShareable(int, cuda.ShareableHandle) (cuda.MemHandle, error) {
	return 0, errUnsupported
}
