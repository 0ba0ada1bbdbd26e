// SPDX-License-Identifier: Apache-2.0

package graphs

// graph_capture_record_stream_reuse: reusing record_stream'd blocks inside
// the capture that freed them.
//
// A block freed during a capture while other streams use it (record_stream)
// waits for the capture to end (events.Tracker.Defer): no event recorded now
// could be queried before then. With this option on, the free also notes the
// block's free markers: the capture graph's current terminal nodes of the
// block's stream and of every use stream. All of them must be capturing into
// one graph, else the block simply waits as before.
//
// Every later malloc during that capture on the block's stream walks the
// graph backwards from the stream's own terminals. Once every marker is an
// ancestor, all work the stream captures from now on runs after the block's
// last uses, so the block goes back to its pool at once, without events.
// The walk is incremental: the nodes seen stay seen for that capture and
// stream, and the graph only grows at its terminals, so each node is visited
// once per stream. Only topology queries are made (cuStreamGetCaptureInfo,
// cuGraphNodeGetDependencies), which are legal during capture.
//
// PyTorch 2.10+ has the same rule (free_safe_blocks_in_capture). The state
// is dropped once no capture is under way: the blocks still deferred then
// get events the usual way. Reuse is the state and the walk; the owner (the
// allocator's device) calls it under its lock, with the driver's topology
// queries and its deferred frees.

import (
	"fmt"
	"os"
	"slices"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// traceReuse (CUDAPOOL_TRACE_CAPTURE_REUSE=1) prints each decision to
// stderr, for diagnosing the option on a real driver. Callers test it
// before calling tracef: the arguments, boxed into ...any, would otherwise
// cost allocations on every malloc of a capture.
var traceReuse = os.Getenv("CUDAPOOL_TRACE_CAPTURE_REUSE") == "1"

func tracef(format string, args ...any) {
	if traceReuse {
		fmt.Fprintf(os.Stderr, "cudapool capture reuse: "+format+"\n", args...)
	}
}

// GraphDriver is the capture-topology queries the option needs
// (cuStreamGetCaptureInfo's terminal nodes and cuGraphNodeGetDependencies),
// both legal during capture. Each appends to buf and returns it, so that a
// caller can reuse one buffer; a driver that lacks the entry points returns
// cuda.ErrNotSupported.
type GraphDriver interface {
	StreamCaptureGraph(dev int, s cuda.Stream, buf []cuda.GraphNode) (cuda.CaptureStatus, uint64, []cuda.GraphNode, error)
	GraphNodeDependencies(dev int, n cuda.GraphNode, buf []cuda.GraphNode) ([]cuda.GraphNode, error)
}

// Deferred holds the frees that wait for the end of all captures (the
// owner's events.Tracker).
type Deferred interface {
	// Reclaim takes b back out of the deferred frees and reports whether
	// it was there; b keeps its uses.
	Reclaim(b *pools.Block) bool
}

// QueryError is a failed topology query on Stream: the blocks concerned
// wait for the capture's end, as without the option.
type QueryError struct {
	Stream cuda.Stream
	Err    error
}

func (e *QueryError) Error() string {
	return fmt.Sprintf("reading the capture graph of stream %#x: %v", uintptr(e.Stream), e.Err)
}

func (e *QueryError) Unwrap() error { return e.Err }

// Reuse is one device's state for the option; the owner's lock guards it.
type Reuse struct {
	On bool // the configuration asks for it
	// markers holds the blocks freed in a capture with their free markers.
	markers map[*pools.Block]freeMarkers
	// seen is, per capture and stream, the nodes known to precede the
	// stream's terminals.
	seen map[reuseKey]map[cuda.GraphNode]struct{}
	// Scratch space for driver queries and the walk.
	buf, stack []cuda.GraphNode
}
type freeMarkers struct {
	capture uint64
	nodes   []cuda.GraphNode
}

type reuseKey struct {
	capture uint64
	s       cuda.Stream
}

// NoteFree records b's free markers, if the option is on and b's stream
// and every use stream of device dev capture into one graph (drv nil: the
// driver has no topology queries). b was just deferred. A failed query is
// returned (a *QueryError); b then waits for the capture's end.
func (r *Reuse) NoteFree(drv GraphDriver, dev int, b *pools.Block) error {
	if !r.On {
		return nil
	}
	if drv == nil {
		tracef("the driver has no capture-graph queries")
		return nil
	}
	var m freeMarkers
	var qerr error
	ok := true
	mark := func(s cuda.Stream) {
		if !ok {
			return
		}
		st, id, terms, err := drv.StreamCaptureGraph(dev, s, r.buf[:0])
		r.buf = terms
		if traceReuse {
			tracef("  stream %#x: status %d capture %d terminals %v err %v", uintptr(s), st, id, terms, err)
		}
		if err != nil {
			qerr = &QueryError{s, err}
		}
		if err != nil || st != cuda.CaptureActive || (m.capture != 0 && id != m.capture) {
			ok = false // a stream outside the capture: wait for its end
			return
		}
		m.capture = id
		for _, n := range terms {
			if !slices.Contains(m.nodes, n) {
				m.nodes = append(m.nodes, n)
			}
		}
	}
	mark(b.Stream)
	b.Uses.Each(mark)
	if traceReuse {
		tracef("free %#x (stream %#x): capture %d, markers %v, usable %v", uintptr(b.Ptr), uintptr(b.Stream), m.capture, m.nodes, ok)
	}
	if !ok || len(m.nodes) == 0 {
		delete(r.markers, b)
		return qerr
	}
	if r.markers == nil {
		r.markers = make(map[*pools.Block]freeMarkers)
	}
	r.markers[b] = m
	return nil
}

// Reclaim returns (through ret) the blocks allocated on s whose free
// markers now all precede s's terminals, taking them out of deferred. The
// owner calls it from malloc during a capture, before looking for a free
// block. A failed query is returned (a *QueryError); the blocks concerned
// wait.
func (r *Reuse) Reclaim(drv GraphDriver, dev int, s cuda.Stream, deferred Deferred, ret func(*pools.Block)) error {
	if drv == nil || len(r.markers) == 0 {
		return nil
	}
	st, id, terms, err := drv.StreamCaptureGraph(dev, s, r.buf[:0])
	r.buf = terms
	if err != nil {
		return &QueryError{s, err}
	}
	if traceReuse {
		tracef("malloc on stream %#x: status %d capture %d terminals %v, %d marked blocks", uintptr(s), st, id, terms, len(r.markers))
	}
	if st != cuda.CaptureActive || len(terms) == 0 {
		return nil
	}
	if r.seen == nil {
		r.seen = make(map[reuseKey]map[cuda.GraphNode]struct{})
	}
	key := reuseKey{id, s}
	seen := r.seen[key]
	if seen == nil {
		seen = make(map[cuda.GraphNode]struct{})
		r.seen[key] = seen
	}
	r.stack = append(r.stack[:0], terms...)
	for len(r.stack) > 0 {
		n := r.stack[len(r.stack)-1]
		r.stack = r.stack[:len(r.stack)-1]
		if _, ok := seen[n]; ok {
			continue
		}
		deps, err := drv.GraphNodeDependencies(dev, n, r.buf[:0])
		r.buf = deps
		if err != nil {
			// Unknown ancestry. Nodes already marked seen may have had
			// their dependencies dropped with the stack: forget the walk
			// so that the next malloc walks afresh.
			delete(r.seen, key)
			return &QueryError{s, err}
		}
		seen[n] = struct{}{}
		r.stack = append(r.stack, deps...)
	}
	for b, m := range r.markers {
		if traceReuse {
			tracef("  block %#x stream %#x capture %d markers %v all seen %v (%d nodes seen)", uintptr(b.Ptr), uintptr(b.Stream), m.capture, m.nodes, allSeen(m.nodes, seen), len(seen))
		}
		if b.Stream != s || m.capture != id || !allSeen(m.nodes, seen) {
			continue
		}
		delete(r.markers, b)
		if !deferred.Reclaim(b) {
			continue // no longer deferred: its events were recorded
		}
		// The graph orders every use before the stream's later work: no
		// event is needed.
		b.Uses.Clear()
		ret(b)
	}
	if len(r.markers) == 0 {
		clear(r.seen) // nothing left to prove; a later free walks afresh
	}
	return nil
}

// Drop forgets the markers and walks once no capture is under way; blocks
// still deferred get events the usual way. Every path that hands the
// deferred blocks to the event tracker (malloc, synchronize, checkpoints)
// calls it first: a marker left behind would name a block that may since
// have been merged and recycled, and would keep seen from ever being
// cleared.
func (r *Reuse) Drop() {
	if len(r.markers)+len(r.seen) > 0 {
		clear(r.markers)
		clear(r.seen)
	}
}

// Empty reports whether Drop has nothing to forget.
func (r *Reuse) Empty() bool { return len(r.markers)+len(r.seen) == 0 }

// State returns the number of blocks with free markers and of walked
// (capture, stream) pairs.
func (r *Reuse) State() (markers, walks int) { return len(r.markers), len(r.seen) }

func allSeen(ns []cuda.GraphNode, seen map[cuda.GraphNode]struct{}) bool {
	for _, n := range ns {
		if _, ok := seen[n]; !ok {
			return false
		}
	}
	return true
}
