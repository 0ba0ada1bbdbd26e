// SPDX-License-Identifier: Apache-2.0

package main

// The Go side of the front cache (front.c; the protocol is FRONT.md, the
// design allocator/front.go): the allocator.Front that reads the C logs and
// pushes Go's policy and invalidations.

/*
#cgo noescape cp_front_take
#cgo nocallback cp_front_take
#cgo noescape cp_front_set_policy
#cgo nocallback cp_front_set_policy
#cgo nocallback cp_front_invalidate
#include "capi.h"
*/
import "C"

import (
	"sync/atomic"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
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

// SetPolicy copies the policy into the C front's block. Devices past
// CP_FRONT_MAXDEV are not served: their phases need no generation.
func (cFront) SetPolicy(p *allocator.FrontPolicy) {
	var c C.cp_front_policy
	if p.On {
		c.on = 1
	}
	c.hold = C.uint32_t(p.Hold)
	c.cold_window, c.cold_skip, c.cold_max_shift = C.uint32_t(p.ColdWindow), C.uint32_t(p.ColdSkip), C.uint32_t(p.ColdMaxShift)
	for i, g := range p.Phases {
		if i < C.CP_FRONT_MAXDEV {
			c.phases[i] = C.uint32_t(g)
		}
	}
	C.cp_front_set_policy(&c)
}

func (cFront) Invalidate(dev int, p cuda.Ptr) { C.cp_front_invalidate(C.uintptr_t(p)) }

// frontPolicy is the C front's policy as Go would write it (for the tests).
func frontPolicy() allocator.FrontPolicy {
	var c C.cp_front_policy
	C.cp_front_get_policy(&c)
	p := allocator.FrontPolicy{On: c.on != 0, Hold: int(c.hold), ColdWindow: int(c.cold_window),
		ColdSkip: int(c.cold_skip), ColdMaxShift: int(c.cold_max_shift)}
	for _, g := range c.phases {
		p.Phases = append(p.Phases, uint32(g))
	}
	return p
}

// frontOff turns the front off for good (a disabled library).
func frontOff() { C.cp_front_set_policy(nil) }

func (cFront) Capacity() int { return C.CP_FRONT_LOG + C.CP_FRONT_HOLD }
