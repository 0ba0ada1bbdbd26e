// SPDX-License-Identifier: Apache-2.0

package main

/*
#include "capi.h"
*/
import "C"

// The library's version. VERSION at the repository root is the one version
// string; this copy, include/cudapool.h's CUDAPOOL_VERSION_* macros and
// python/cudapool/_version.py must equal it (TestVersionsAgree checks).
const (
	versionMajor = 0
	versionMinor = 1
	versionPatch = 0
)

// abiVersion changes when a program built against an earlier
// include/cudapool.h can no longer use the library (a function removed or
// its meaning changed); appending functions leaves it alone.
const abiVersion = 1

//export cpgo_version
func cpgo_version(major, minor, patch *C.int) C.int {
	*major, *minor, *patch = versionMajor, versionMinor, versionPatch
	return abiVersion
}
