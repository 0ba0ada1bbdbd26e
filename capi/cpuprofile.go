// SPDX-License-Identifier: Apache-2.0

//go:build cudapool_cpuprofile

package main

// A CPU profile of the library as a C program uses it, for profile-guided
// optimization (make pgo writes capi/default.pgo from such profiles; see
// docs/hot-path.md, "Why it is built this way"). Only in a library built with
// -tags cudapool_cpuprofile: with CUDAPOOL_CPUPROFILE=FILE set, profiling
// starts when the library loads and stops when the process exits
// (cpuprofile.c's destructor).

/*
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
)

var cpuProfile *os.File

func init() {
	path := os.Getenv("CUDAPOOL_CPUPROFILE")
	if path == "" {
		return
	}
	f, err := os.Create(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cudapool: CUDAPOOL_CPUPROFILE:", err)
		return
	}
	// 1 kHz instead of pprof's 100 Hz: more samples from a short run. (The
	// runtime warns on stderr that the rate was set before the profile.)
	runtime.SetCPUProfileRate(1000)
	if err := pprof.StartCPUProfile(f); err != nil {
		fmt.Fprintln(os.Stderr, "cudapool: CUDAPOOL_CPUPROFILE:", err)
		f.Close()
		return
	}
	cpuProfile = f
}

//export cpgo_cpuprofile_stop
func cpgo_cpuprofile_stop() {
	if cpuProfile != nil {
		pprof.StopCPUProfile()
		cpuProfile.Close()
		cpuProfile = nil
	}
}
