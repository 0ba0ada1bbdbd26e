// SPDX-License-Identifier: Apache-2.0

package allocator

// The front cache during allocate-to-pool phases.
//
// A capture announces itself (BeginAllocateToPool) with a stream filter;
// while it runs, a malloc goes to the private pool of the newest phase whose
// filter accepts the malloc's stream, and to the default pools otherwise.
// graphs.Router.Route alone decides that, calling the filters under the
// device lock (as PyTorch calls them under its allocator's mutex). The
// front repeats no routing and calls no filter:
//
//   - Every begin and end gives the device's phases a new generation, which
//     the front is given in the policy (pushPhases; 0 while none is under
//     way). A new generation makes every route the front keeps stale.
//   - A malloc through Go that routed to an announced phase's pool returns,
//     with its block, the pool's tag and the generation (Tracking.Route,
//     Phases). The front keeps that answer for the calling thread and the
//     malloc's stream, and serves the thread's later mallocs on the stream
//     from that pool's waiting blocks while the generation lasts.
//   - A block is tracked with the tag of the pool it came from, and only if
//     that is the pool its malloc routed to: a block a default request
//     borrowed from a private pool (use_on_oom) is not tracked.
//   - Frees are unchanged: a tracked block's free is logged whatever its
//     pool; the replay frees it into its own pool. A capture forbids
//     driver frees, event queries and synchronization, which the front never
//     does; its frees and reuses are replayed under the capture rules at the
//     next call into Go.
//
// A route is kept per thread because a filter may answer by thread
// (use_mem_pool's accepts its own thread's allocations), and only a yes is
// kept: a stream that joins a capture later (it waits on an event of a
// capturing stream) must then go to the capture's pool, so until Go has
// routed a stream to a pool on a thread, that thread's mallocs on it go to
// Go. The filters must therefore not turn a yes for a stream on a thread
// into a no while their phase lasts. PyTorch's do not: a capture's says yes
// while the stream captures into its graph, until the capture ends just
// before the phase does (an invalidated capture ends in an error), and
// use_mem_pool's says yes to its thread (include/cudapool.h says so of C
// filters).
//
// What a served malloc skips is what a hit skips outside captures (front.go):
// the best-fit search and merging, and, during a capture with
// graph_capture_record_stream_reuse, the reclaim walk that a malloc through
// Go makes first (a block waiting for it is reclaimed at the next one).

import (
	"sync/atomic"

	"github.com/cudapool/cudapool/pools"
)

// phaseGen numbers the devices' phase generations, process-wide, so that a
// route names one device's phases only.
var phaseGen atomic.Uint32

// pushPhases gives the device's phases a new generation and the front the
// policy with it. d.mu is held.
func (d *device) pushPhases() {
	var gen uint32
	if d.graphs.Announced() > 0 {
		if gen = phaseGen.Add(1); gen == 0 {
			gen = phaseGen.Add(1)
		}
	}
	d.front.phases = gen
	d.front.ctl.setPhases(d.id, gen)
}

// frontBlocked recomputes whether the device has a capture the front
// cannot see: an unannounced one (countCaptures calls it when the count
// changes). d.mu is held.
func (d *device) frontBlocked(captures int64) {
	b := captures != int64(d.graphs.Announced())
	if s := &d.front; b != s.blocked {
		s.blocked = b
		if b {
			s.ctl.blocked.Add(1)
		} else {
			s.ctl.blocked.Add(-1)
		}
	}
}

// privateTag is the front tag of b, a block of a private pool: its pool's
// tag if the malloc routed to that pool (not an automatic one), else
// TagNone. d.mu is held.
//
// A block of an expandable segment may be held only if small (tracking
// adds TagHold then): a held block stays allocated to Go, so it neither
// merges with its free neighbours nor serves a malloc of another size; in
// a pool that grows by mapping pages at the end of its range, the mallocs
// meanwhile split the free tail instead, and the capture maps more. A
// GPT-2 forward's capture on the H100 took 246 MiB with the front holding
// its blocks at any size and 204 with the front off (native expandable
// segments: 222; docs/hot-path.md, "During graph captures"). Left to Go entirely, though, 168
// of its 215 mallocs crossed into Go, against 41 with ordinary segments, and
// the captured forward took 1.042x native's in one process. Held small
// only, the pool took 212 MiB and the front served 139 of the mallocs
// (docs/hot-path.md, "During graph captures").
//
//go:noinline
func (d *device) privateTag(b *pools.Block) uint32 {
	p := d.front.routedTo
	if !d.front.routed || p == nil || p.Auto || (b.Pool != p.Small && b.Pool != p.Large) {
		return TagNone
	}
	if b.Seg.Expandable {
		return PoolTag(p.Serial)
	}
	return PoolTag(p.Serial) | TagHold
}
