// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo && amd64

// Package shimtest calls cuda/driver's NVML trampolines directly from C, for
// the tests only: go-nvml itself never calls a function before nvml.Init has
// loaded the library, so it cannot reach the stubs or choose which call
// takes the lazy-resolution path.
package shimtest

/*
// The trampolines are hidden symbols of package driver, linked into the same
// binary. Their prototypes here are what the tests need, not NVML's: a
// trampoline forwards whatever registers and stack it is given.
extern int nvmlInit_v2(void);
extern int nvmlDeviceGetCount_v2(unsigned int *count);
extern const char *nvmlErrorString(int result);
extern int nvmlSystemGetHicVersion(long, long, long, long, long, long,
	double, double, double, double, double, double, double, double, long, long);

static int shim_device_count(unsigned int *n) { return nvmlDeviceGetCount_v2(n); }

static int shim_many_args(void) {
	return nvmlSystemGetHicVersion(0x1111, 0x2222, 0x3333, 0x4444, 0x5555, 0x6666,
		0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 0x7777, 0x8888);
}
*/
import "C"

import _ "github.com/cudapool/cudapool/cuda/driver" // defines the trampolines

// Init calls nvmlInit_v2.
func Init() int { return int(C.nvmlInit_v2()) }

// DeviceCount calls nvmlDeviceGetCount_v2.
func DeviceCount() (uint32, int) {
	var n C.uint
	r := C.shim_device_count(&n)
	return uint32(n), int(r)
}

// ErrorString calls nvmlErrorString.
func ErrorString(r int) string { return C.GoString(C.nvmlErrorString(C.int(r))) }

// ManyArgs calls nvmlSystemGetHicVersion with the fake library's made-up
// 16-argument signature (testdata/fakenvml.c); 0 means every argument
// register and stack slot arrived intact.
func ManyArgs() int { return int(C.shim_many_args()) }
