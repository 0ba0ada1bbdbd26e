// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo && amd64

package driver

// NVMLProcesses exposes nvmlProcesses (DeviceProcesses after the CUDA
// ordinal has become a PCI bus id).
var NVMLProcesses = nvmlProcesses
