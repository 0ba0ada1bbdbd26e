// SPDX-License-Identifier: Apache-2.0

package sim

// Capture graphs: the topology of the work captured so far.
//
// A capture records work as graph nodes. Each stream taking part has a set
// of terminal nodes, the nodes its next captured work will depend on. Work
// submitted on a capturing stream (Submit) becomes a node that depends on
// the stream's terminals and is then its only terminal. An event recorded on
// a capturing stream remembers that stream's terminals; a stream that waits
// on it (StreamWaitEvent) takes them on: a stream that was not capturing
// joins the capture with them as its terminals (a fork), a stream already in
// that capture adds them to its own (a join). Ending the capture on its
// origin stream fails with ErrCaptureUnjoined unless every joined stream's
// terminals are ancestors of the origin's, as CUDA requires.
//
// This is what graph_capture_record_stream_reuse needs (the allocator asks
// StreamCaptureGraph and GraphNodeDependencies, both legal during capture)
// and what PyTorch's multi-stream captures do (wait_stream forks and joins).
// Nodes stand for work only; they are not replayed.

import (
	"fmt"
	"slices"

	"github.com/cudapool/cudapool/cuda"
)

// graph is one capture's nodes and its streams' terminals; d.mu guards it.
type graph struct {
	deps      map[cuda.GraphNode][]cuda.GraphNode // every node's dependencies
	terminals map[cuda.Stream][]cuda.GraphNode    // each stream's terminals
}

func newGraph() *graph {
	return &graph{deps: make(map[cuda.GraphNode][]cuda.GraphNode), terminals: make(map[cuda.Stream][]cuda.GraphNode)}
}

// addNode records one unit of work captured on s; d.mu is held.
func (d *Driver) addNode(g *graph, s cuda.Stream) {
	d.lastNode++
	n := d.lastNode
	g.deps[n] = g.terminals[s]
	g.terminals[s] = []cuda.GraphNode{n}
}

// captureOf returns the capture s takes part in, as its origin or joined;
// d.mu is held.
func (d *Driver) captureOf(s cuda.Stream) *capture {
	if c := d.captures[s]; c != nil {
		return c
	}
	return d.joined[s]
}

// captureByID returns the capture in progress with that id; d.mu is held.
func (d *Driver) captureByID(id uint64) *capture {
	for _, c := range d.captures {
		if c.id == id {
			return c
		}
	}
	return nil
}

// StreamWaitEvent makes s's later work depend on the work e recorded. Only
// captured events are modelled (see the file comment): s forks into e's
// capture or joins it. Waiting on an event of another capture fails with
// ErrCaptureIsolation, as does a capturing stream waiting on an event
// recorded outside capture (CUDA calls that an isolation violation too); a
// wait between streams that do not capture is accepted and has no effect
// here, since completion is driven by the test.
func (d *Driver) StreamWaitEvent(dev int, s cuda.Stream, e cuda.Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, err := d.event(dev, e)
	if err != nil {
		return err
	}
	if d.destroyed(s) {
		return d.refuseDestroyed(fmt.Sprintf("StreamWaitEvent(dev=%d, event=%d)", dev, e), s)
	}
	mine := d.captureOf(s)
	if ev.captureID == 0 {
		if mine != nil {
			mine.invalidated = true
			return cuda.ErrCaptureIsolation
		}
		return nil
	}
	c := d.captureByID(ev.captureID)
	switch {
	case c == nil:
		// The event's capture has ended: it stands for a node of a graph
		// that is no longer being built.
		return cuda.ErrCaptureIsolation
	case mine == nil:
		d.joined[s] = c
		c.g.terminals[s] = append([]cuda.GraphNode(nil), ev.nodes...)
	case mine != c:
		return cuda.ErrCaptureIsolation
	default:
		c.g.terminals[s] = union(c.g.terminals[s], ev.nodes)
	}
	return nil
}

// StreamCaptureGraph reports s's capture status and id, as StreamCaptureInfo
// does, and appends the capture's current terminal nodes of s to buf. It is
// legal during capture.
func (d *Driver) StreamCaptureGraph(dev int, s cuda.Stream, buf []cuda.GraphNode) (cuda.CaptureStatus, uint64, []cuda.GraphNode, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return cuda.CaptureNone, 0, buf, err
	}
	c := d.captureOf(s)
	switch {
	case c == nil:
		return cuda.CaptureNone, 0, buf, nil
	case c.invalidated:
		return cuda.CaptureInvalidated, c.id, buf, nil
	}
	return cuda.CaptureActive, c.id, append(buf, c.g.terminals[s]...), nil
}

// GraphNodeDependencies appends n's dependencies to buf. n must be a node of
// a capture in progress (ErrInvalidValue otherwise).
func (d *Driver) GraphNodeDependencies(dev int, n cuda.GraphNode, buf []cuda.GraphNode) ([]cuda.GraphNode, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return buf, err
	}
	for _, c := range d.captures {
		if deps, ok := c.g.deps[n]; ok {
			return append(buf, deps...), nil
		}
	}
	return buf, cuda.ErrInvalidValue
}

// unjoined reports whether a stream that joined c has work the origin
// stream's terminals do not depend on; d.mu is held.
func (d *Driver) unjoined(c *capture) bool {
	seen := make(map[cuda.GraphNode]bool)
	stack := append([]cuda.GraphNode(nil), c.g.terminals[c.s]...)
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if !seen[n] {
			seen[n] = true
			stack = append(stack, c.g.deps[n]...)
		}
	}
	for s, j := range d.joined {
		if j != c {
			continue
		}
		for _, n := range c.g.terminals[s] {
			if !seen[n] {
				return true
			}
		}
	}
	return false
}

// endJoined removes the streams that joined c; d.mu is held.
func (d *Driver) endJoined(c *capture) {
	for s, j := range d.joined {
		if j == c {
			delete(d.joined, s)
		}
	}
}

// union returns a followed by the nodes of b not in a.
func union(a, b []cuda.GraphNode) []cuda.GraphNode {
	out := append([]cuda.GraphNode(nil), a...)
	for _, n := range b {
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}
