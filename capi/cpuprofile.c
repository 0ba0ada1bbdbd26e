// SPDX-License-Identifier: Apache-2.0
//go:build cudapool_cpuprofile

/* Stops cpuprofile.go's profile when the process exits (the library's
 * destructor runs from exit(), with the Go runtime still up). */
#include "_cgo_export.h"

__attribute__((destructor)) static void cp_cpuprofile_stop(void) {
	cpgo_cpuprofile_stop();
}
