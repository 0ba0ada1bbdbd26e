// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo && !amd64

package driver

import (
	"errors"

	"github.com/cudapool/cudapool/cuda"
)

// DeviceProcesses is not available on this architecture: go-nvml leaves its
// nvml* symbols undefined, and the trampolines that fix that for a c-shared
// library (nvml.go) exist for x86-64 only, so go-nvml is not linked here.
func (d *Driver) DeviceProcesses(dev int) ([]cuda.ProcessMemory, error) {
	return nil, errors.New("cudapool: listing GPU processes through NVML is only built for linux/amd64")
}
