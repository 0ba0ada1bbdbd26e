// SPDX-License-Identifier: Apache-2.0

package main

// Calls from Go into the C and C++ parts of the library. The preamble may
// define functions because this file exports nothing (cgo copies the
// preamble of files with //export into two C files).

/*
#cgo CFLAGS: -I${SRCDIR}/../include -Wall
#cgo CXXFLAGS: -I${SRCDIR}/../include -std=c++17 -Wall
#include <stdlib.h>
#include "capi.h"

const char *cudapool_last_error(void);
static inline void cp_set_error_go(_GoString_ s) { cp_set_error(_GoStringPtr(s), _GoStringLen(s)); }
*/
import "C"

import (
	"unsafe"

	"github.com/cudapool/cudapool/cuda"
)

// lookupEnv reads the process's environment as it is now, through libc.
// Go's os package sees only the environment the process started with (a
// c-shared runtime copies it at load), which misses what a Python program
// set in os.environ before the first allocation.
func lookupEnv(key string) (string, bool) {
	k := C.CString(key)
	defer C.free(unsafe.Pointer(k))
	v := C.getenv(k)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}

// setError records msg as the calling thread's last error.
func setError(msg string) { C.cp_set_error_go(msg) }

// cFilter wraps a C cudapool_stream_filter and its context; nil for a NULL
// filter (every stream).
func cFilter(fn, ctx C.uintptr_t) func(cuda.Stream) bool {
	if fn == 0 {
		return nil
	}
	return func(s cuda.Stream) bool { return C.cp_call_c_filter(fn, ctx, C.uintptr_t(s)) != 0 }
}

// stdFilter wraps the heap copy of a std::function made by torch.cpp.
func stdFilter(handle C.uintptr_t) func(cuda.Stream) bool {
	if handle == 0 {
		return nil
	}
	return func(s cuda.Stream) bool { return C.cp_call_std_filter(handle, C.uintptr_t(s)) != 0 }
}

// deleteStdFilter destroys the heap copy of a std::function.
func deleteStdFilter(handle C.uintptr_t) {
	if handle != 0 {
		C.cp_delete_std_filter(handle)
	}
}

// lastError returns the calling thread's last error ("" if none), for this
// package's tests, which cannot use cgo themselves.
func lastError() string {
	if e := C.cudapool_last_error(); e != nil {
		return C.GoString(e)
	}
	return ""
}
