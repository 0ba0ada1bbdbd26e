// SPDX-License-Identifier: Apache-2.0

// Package graphs routes allocations made during CUDA graph capture to the
// private pool of the capture they belong to.
//
// PyTorch announces a capture with begin(pool id, filter) before it starts
// capturing and end(pool id) right after; the filter answers "does this
// stream capture into this graph". use_mem_pool does the same with a filter
// that accepts the calling thread's allocations. While any announced
// capture is under way, an allocation goes to the pool of the newest
// capture whose filter accepts its stream, and to the default pools
// otherwise. Unlike PyTorch, which refuses a second begin of a pool that is
// already being allocated to, one pool may be begun several times at once
// (two threads each in use_mem_pool of it); see End for which one ends.
//
// Code that captures without announcing anything (a C program calling
// cuStreamBeginCapture) is handled too: until the first announcement ever,
// the allocator asks the driver whether the allocating stream is capturing,
// and allocations of a capture sequence nobody announced go to an automatic
// private pool for that sequence. Such a pool is kept until the process ends,
// since nobody will say when its graph dies. The router remembers the
// streams of those captures and asks the driver, when it needs to know
// whether a capture is still under way, whether they still capture.
//
// Inside a capture, a block freed while other streams use it may be reused
// before the capture ends once the capture graph orders those uses before
// the stream's later work (graph_capture_record_stream_reuse: reuse.go).
//
// A Router belongs to one device and is guarded by that device's lock.
package graphs

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

// Errors for announcements that do not match the router's state.
var (
	// ErrAlreadyRecording is no longer returned: one pool may be begun
	// several times at once. Kept for callers that test for it.
	ErrAlreadyRecording = errors.New("pool is already recording a capture")
	ErrNotRecording     = errors.New("pool is not recording a capture")
)

// Filter reports whether an allocation on a stream belongs to a capture.
type Filter func(cuda.Stream) bool

type capture struct {
	pool   *privatepool.Pool
	filter Filter // nil: every stream
}

type autoCapture struct {
	stream cuda.Stream
	id     uint64
	pool   *privatepool.Pool
}

// Router is one device's captures under way, its private pools, and the
// reuse of record_stream'd blocks inside a capture (reuse.go).
type Router struct {
	Pools    privatepool.Registry
	captures []capture     // announced, in begin order
	auto     []autoCapture // unannounced captures seen allocating
	// Reuse comes last: every malloc reads captures and auto (Idle).
	Reuse Reuse
}

// AutoPoolID is the id of the automatic pool of capture sequence id. The top
// bit keeps it clear of the ids PyTorch hands out ({n,0} and {0,n}, counting
// up from 1).
func AutoPoolID(captureID uint64) pools.PoolID {
	return pools.PoolID{A: 1<<63 | captureID}
}

// Begin starts routing the allocations accepted by filter (nil: all) to the
// pool id, creating the pool or holding an existing one once more (pool
// sharing between captures, a MemPool made by CreateOrIncref).
func (r *Router) Begin(id pools.PoolID, filter Filter, mk privatepool.NewPools) error {
	// As PyTorch: one routing per pool at a time (a nested use_mem_pool of
	// the same pool, or two threads in it at once, is refused), checked
	// before the use count changes (PyTorch's check comes after its
	// increment, which then leaks).
	for _, c := range r.captures {
		if c.pool.ID == id {
			return fmt.Errorf("%w: {%d,%d}", ErrAlreadyRecording, id.A, id.B)
		}
	}
	p, err := r.Pools.Incref(id, mk)
	if err != nil {
		return err
	}
	r.captures = append(r.captures, capture{pool: p, filter: filter})
	return nil
}

// End stops routing to the pool id.
func (r *Router) End(id pools.PoolID) error {
	for i, c := range r.captures {
		if c.pool.ID == id {
			last := len(r.captures) - 1
			copy(r.captures[i:], r.captures[i+1:])
			r.captures[last] = capture{} // drop the references to the pool and filter
			r.captures = r.captures[:last]
			return nil
		}
	}
	return fmt.Errorf("%w: {%d,%d}", ErrNotRecording, id.A, id.B)
}

// IsRecording reports whether an announced capture routes to the pool id.
func (r *Router) IsRecording(id pools.PoolID) bool {
	for _, c := range r.captures {
		if c.pool.ID == id {
			return true
		}
	}
	return false
}

// Release drops one holder of the pool id (a graph that died).
func (r *Router) Release(id pools.PoolID) error { return r.Pools.Release(id) }

// Route returns the private pool for an allocation on s, or nil for the
// default pools. captureID is the stream's unannounced capture sequence
// (0: not capturing or not asked).
func (r *Router) Route(s cuda.Stream, captureID uint64, mk privatepool.NewPools) *privatepool.Pool {
	for i := len(r.captures) - 1; i >= 0; i-- {
		if c := r.captures[i]; c.filter == nil || c.filter(s) {
			return c.pool
		}
	}
	if captureID == 0 {
		return nil
	}
	for _, a := range r.auto {
		if a.id == captureID {
			return a.pool
		}
	}
	id := AutoPoolID(captureID)
	p := r.Pools.Get(id)
	if p == nil {
		p = r.Pools.Acquire(id, mk)
		p.Auto = true
	}
	r.auto = append(r.auto, autoCapture{stream: s, id: captureID, pool: p})
	return p
}

// Underway reports whether a capture may be running: an announced one, or
// an unannounced one that has not been seen to end. For the latter it asks
// query about each stream it knows, forgetting the captures that ended.
func (r *Router) Underway(query func(cuda.Stream) (cuda.CaptureStatus, uint64, error)) bool {
	if len(r.captures) > 0 {
		return true
	}
	if len(r.auto) == 0 {
		return false // the usual case: no write, no scan
	}
	live := r.auto[:0]
	for _, a := range r.auto {
		st, id, err := query(a.stream)
		// A stream that no longer exists (destroyed after its capture, the
		// usual C pattern) is not capturing. On any other error assume it
		// still runs: freeing during a capture is worse than keeping memory
		// a little longer.
		if streamGone(err) {
			continue
		}
		if err != nil || (st != cuda.CaptureNone && id == a.id) {
			live = append(live, a)
		}
	}
	for i := len(live); i < len(r.auto); i++ {
		r.auto[i] = autoCapture{}
	}
	r.auto = live
	return len(r.auto) > 0
}

func streamGone(err error) bool {
	return errors.Is(err, cuda.ErrInvalidHandle) || errors.Is(err, cuda.ErrInvalidContext) ||
		errors.Is(err, cuda.ErrInvalidValue)
}

// Announced is the number of announced captures under way.
func (r *Router) Announced() int { return len(r.captures) }

// Idle reports that the router knows of no capture: Underway is false
// without a query, and Route returns nil for a stream not capturing.
func (r *Router) Idle() bool { return len(r.captures) == 0 && len(r.auto) == 0 }

// Count is the number of captures the router believes under way.
func (r *Router) Count() int { return len(r.captures) + len(r.auto) }

// Recording returns the ids of the pools with an announced capture.
func (r *Router) Recording() []pools.PoolID {
	out := make([]pools.PoolID, len(r.captures))
	for i, c := range r.captures {
		out[i] = c.pool.ID
	}
	return out
}
