package main

// The Go side of the front cache (front.c; the design is in
// allocator/front.go): the allocator.Front that reads the C logs.

/*
#cgo noescape cp_front_take
#cgo nocallback cp_front_take
#cgo nocallback cp_front_set_on
#include "capi.h"
*/
import "C"

import (
	"sync/atomic"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
)

type cFront struct{}

func (f cFront) Pending(dev int) bool {
	p := f.PendingFlag(dev)
	return p != nil && atomic.LoadInt32(p) != 0
}

// PendingFlag makes cFront an allocator.FrontFlags: the device lock reads
// the log's length itself.
func (cFront) PendingFlag(dev int) *int32 {
	if uint(dev) >= C.CP_FRONT_MAXDEV {
		return nil
	}
	return (*int32)(unsafe.Pointer(&C.cp_front_n[dev]))
}

func (cFront) Take(dev int, buf []allocator.PendingFree) []allocator.PendingFree {
	n := int(C.cp_front_take(C.int(dev)))
	if n == 0 {
		return buf
	}
	return append(buf, pendingFrees(&C.cp_front_out[dev][0], C.size_t(n))...)
}

func (cFront) SetEnabled(on bool) {
	v := C.int(0)
	if on {
		v = 1
	}
	C.cp_front_set_on(v)
}

func (cFront) Capacity() int { return C.CP_FRONT_LOG }
