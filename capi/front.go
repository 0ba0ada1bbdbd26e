package main

// The Go side of the front cache (front.c; the design is in
// allocator/front.go): the allocator.Front that reads the C logs.

/*
#cgo noescape cp_front_take
#cgo nocallback cp_front_take
#cgo nocallback cp_front_set_on
#cgo noescape cp_front_set_routes
#cgo nocallback cp_front_set_routes
#include "capi.h"
*/
import "C"

import (
	"sync/atomic"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/pools"
)

// The front holds default-pool blocks across takes only up to the small
// pool's limit: larger held blocks, neither merged nor seen by best fit,
// fragment the large pools (front.c; docs/hot-path.md, 'The front's held
// blocks and fragmentation; FSDP2 measured').
func init() { C.cp_front_hold_max = C.size_t(pools.SmallSize) }

// frontHoldMax is what the front was told (for the tests).
func frontHoldMax() uint64 { return uint64(C.cp_front_hold_max) }

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

// HeldFlag is the word Holding(dev) reads: the blocks held across takes.
func (cFront) HeldFlag(dev int) *int32 {
	if uint(dev) >= C.CP_FRONT_MAXDEV {
		return nil
	}
	return (*int32)(unsafe.Pointer(&C.cp_front_held[dev]))
}

func (f cFront) Holding(dev int) bool {
	p := f.HeldFlag(dev)
	return p != nil && atomic.LoadInt32(p) != 0
}

func (cFront) Take(dev int, buf []allocator.PendingFree, keep bool) []allocator.PendingFree {
	k := C.int(0)
	if keep {
		k = 1
	}
	n := int(C.cp_front_take(C.int(dev), k))
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

func (cFront) Capacity() int { return C.CP_FRONT_LOG + C.CP_FRONT_HOLD }

// SetRoutes makes cFront an allocator.FrontRouter: the C front calls the
// filters that capi's Go filters call (cp_call_c_filter, cp_call_std_filter).
func (cFront) SetRoutes(dev int, routes []allocator.FrontRoute) bool {
	if len(routes) > C.CP_FRONT_MAXROUTES {
		C.cp_front_set_routes(C.int(dev), nil, 0)
		return false
	}
	var rs [C.CP_FRONT_MAXROUTES]C.cp_route
	for i, r := range routes {
		rs[i] = C.cp_route{a: C.uintptr_t(r.Filter.A), b: C.uintptr_t(r.Filter.B), tag: C.uint32_t(r.Tag), kind: C.uint32_t(r.Filter.Kind)}
	}
	return C.cp_front_set_routes(C.int(dev), &rs[0], C.int(len(routes))) != 0
}
