package allocator

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
// get events the usual way.

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

// captureReuse is a device's state for the option; the device's mu guards
// all of it.
type captureReuse struct {
	on bool // the configuration asks for it
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

// noteFreeMarkers records b's free markers, if the option is on and b's
// stream and every use stream capture into one graph. b was just deferred.
// d.mu is held.
func (d *device) noteFreeMarkers(b *pools.Block) {
	r := &d.reuse
	if !r.on {
		return
	}
	drv, ok := d.drv.(captureGraphDriver)
	if !ok {
		tracef("the driver has no capture-graph queries")
		return
	}
	var m freeMarkers
	ok = true
	mark := func(s cuda.Stream) {
		if !ok {
			return
		}
		st, id, terms, err := drv.StreamCaptureGraph(d.id, s, r.buf[:0])
		r.buf = terms
		if traceReuse {
			tracef("  stream %#x: status %d capture %d terminals %v err %v", uintptr(s), st, id, terms, err)
		}
		if err != nil {
			d.warnCaptureGraph(err, s)
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
		return
	}
	if r.markers == nil {
		r.markers = make(map[*pools.Block]freeMarkers)
	}
	r.markers[b] = m
}

// reclaimInCapture returns to their pools the blocks allocated on s whose
// free markers now all precede s's terminals. Called by malloc during a
// capture, before looking for a free block. d.mu is held.
func (d *device) reclaimInCapture(s cuda.Stream) {
	r := &d.reuse
	drv, ok := d.drv.(captureGraphDriver)
	if !ok || len(r.markers) == 0 {
		return
	}
	st, id, terms, err := drv.StreamCaptureGraph(d.id, s, r.buf[:0])
	r.buf = terms
	if err != nil {
		d.warnCaptureGraph(err, s)
		return
	}
	if traceReuse {
		tracef("malloc on stream %#x: status %d capture %d terminals %v, %d marked blocks", uintptr(s), st, id, terms, len(r.markers))
	}
	if st != cuda.CaptureActive || len(terms) == 0 {
		return
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
		deps, err := drv.GraphNodeDependencies(d.id, n, r.buf[:0])
		r.buf = deps
		if err != nil {
			// Unknown ancestry. Nodes already marked seen may have had
			// their dependencies dropped with the stack: forget the walk
			// so that the next malloc walks afresh.
			d.warnCaptureGraph(err, s)
			delete(r.seen, key)
			return
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
		if !d.ev.Reclaim(b) {
			continue // no longer deferred: its events were recorded
		}
		// The graph orders every use before the stream's later work: no
		// event is needed.
		b.Uses.Clear()
		d.returnBlock(b)
	}
	if len(r.markers) == 0 {
		clear(r.seen) // nothing left to prove; a later free walks afresh
	}
}

// warnCaptureGraph reports a failed capture-graph query: the blocks
// concerned wait for the capture's end, as without the option.
func (d *device) warnCaptureGraph(err error, s cuda.Stream) {
	if errorsIs(err, cuda.ErrNotSupported) {
		d.warn("graph_capture_record_stream_reuse:True has no effect: the CUDA driver lacks cuGraphNodeGetDependencies or cuStreamGetCaptureInfo_v2")
		return
	}
	d.warn(driverError("capture reuse", err, "reading the capture graph of stream %#x (record_stream'd blocks wait for the capture's end)", uintptr(s)).Error())
}

// dropCaptureReuse forgets the markers and walks once no capture is under
// way; blocks still deferred get events the usual way. Every path that
// hands the deferred blocks to the event tracker (malloc, syncAll, settle)
// calls it first: a marker left behind would name a block that may since
// have been merged and recycled, and would keep seen from ever being
// cleared. d.mu is held.
func (d *device) dropCaptureReuse() {
	if len(d.reuse.markers)+len(d.reuse.seen) > 0 {
		clear(d.reuse.markers)
		clear(d.reuse.seen)
	}
}

func allSeen(ns []cuda.GraphNode, seen map[cuda.GraphNode]struct{}) bool {
	for _, n := range ns {
		if _, ok := seen[n]; !ok {
			return false
		}
	}
	return true
}
