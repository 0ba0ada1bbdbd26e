// SPDX-License-Identifier: Apache-2.0

// Command cshared is built by the tests with -buildmode=c-shared to check that
// a library importing cuda/driver leaves no CUDA or NVML symbol undefined.
package main

import "C"

import "github.com/cudapool/cudapool/cuda/driver"

// CudapoolProbe opens the driver and lists device 0's processes; it returns
// the number of devices, or -1 if the driver cannot be opened.
//
//export CudapoolProbe
func CudapoolProbe() C.int {
	d, err := driver.Open()
	if err != nil {
		return -1
	}
	_, _ = d.DeviceProcesses(0)
	n, _ := d.DeviceCount()
	return C.int(n)
}

func main() {}
