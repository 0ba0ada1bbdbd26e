// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// The simulator must stand in for the real driver wherever the allocator
// takes one, including the optional process listing its OOM message uses
// and CUDA IPC.
var (
	_ allocator.Driver = (*sim.Driver)(nil)
	_ interface {
		DeviceProcesses(dev int) ([]cuda.ProcessMemory, error)
	} = (*sim.Driver)(nil)
	_ interface {
		IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error)
		IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error)
		IpcCloseMemHandle(dev int, p cuda.Ptr) error
	} = (*sim.Driver)(nil)
)
