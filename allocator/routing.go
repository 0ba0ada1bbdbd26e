package allocator

// The front cache during allocate-to-pool phases.
//
// A capture announces itself (BeginAllocateToPool) with a stream filter;
// while it runs, a malloc goes to the private pool of the newest phase whose
// filter accepts the malloc's stream, and to the default pools otherwise
// (graphs.Router.Route). Before this file the front served nothing while
// any phase was under way, so each of a captured forward pass's mallocs
// entered Go and called the filter from there (docs/hot-path.md section 11).
//
// Now a FrontRouter repeats the routing itself:
//
//   - Each device's phases (graphs.Router.Phases: the router keeps each
//     one's FilterRef) are handed to the front (SetRoutes), oldest
//     first, under the device lock, whenever they change, with each phase's
//     pool tag (PoolTag of the pool's Serial; TagDefault for the default
//     pools) and a FilterRef: the C function or std::function that the Go
//     filter itself calls. A phase begun with a filter only Go can call
//     (FilterOpaque), or more phases than the front keeps, blocks the front
//     while they run, as before.
//   - A block is tracked with the tag of the pool it came from, and only if
//     that is the pool its malloc routed to: a block a default request
//     borrowed from a private pool (use_on_oom) is not tracked.
//   - A malloc in front that finds a waiting block of its size and stream
//     evaluates the filters, newest first, and takes the block only if its
//     tag is the routed pool's. The filters run under the front's lock, as
//     PyTorch's run under its allocator's mutex; SetRoutes takes that lock,
//     so once it returns no filter it replaced is running or will run (capi
//     may then delete PyTorch's std::function).
//   - Frees are unchanged: a tracked block's free is logged whatever its
//     pool; the replay frees it into its own pool. A capture forbids
//     driver frees, event queries and synchronization, which the front never
//     does; its frees and reuses are replayed under the capture rules at the
//     next call into Go, as before.
//
// What a served malloc skips is what a hit skips outside captures (front.go):
// the best-fit search and merging, and, during a capture with
// graph_capture_record_stream_reuse, the reclaim walk that a malloc through
// Go makes first (a block waiting for it is reclaimed at the next one).

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

// BeginAllocateToPoolRef is BeginAllocateToPool with ref, the same filter in
// a form the front cache can call (FilterOpaque: none).
func (a *Allocator) BeginAllocateToPoolRef(dev int, id PoolID, filter func(cuda.Stream) bool, ref FilterRef) error {
	if filter == nil {
		ref = FilterRef{Kind: FilterAll}
	}
	return a.beginAllocateToPool(dev, id, filter, ref)
}

// pushRoutes gives the device's phases (d.graphs') to the front and notes
// whether it can route them. d.mu is held.
func (d *device) pushRoutes() {
	fr, _ := d.front.(FrontRouter)
	if fr == nil {
		d.routesOK = d.graphs.Announced() == 0
		return
	}
	ok := true
	d.routeBuf = d.routeBuf[:0]
	d.graphs.Phases(func(p *privatepool.Pool, ref any) {
		f, _ := ref.(FilterRef) // a begin without one is FilterOpaque
		ok = ok && f.Kind != FilterOpaque
		d.routeBuf = append(d.routeBuf, FrontRoute{Tag: PoolTag(p.Serial), Filter: f})
	})
	if !ok {
		fr.SetRoutes(d.id, nil) // serves nothing meanwhile: blocked below
		d.routesOK = false
		return
	}
	d.routesOK = fr.SetRoutes(d.id, d.routeBuf)
}

// frontBlocked recomputes whether the device has a capture the front
// cannot route (countCaptures calls it when the count changes). d.mu is
// held.
func (d *device) frontBlocked(captures int64) {
	announced := int64(d.graphs.Announced())
	b := captures != announced || (announced > 0 && !d.routesOK)
	if b != d.blocked {
		d.blocked = b
		if b {
			d.fc.blocked.Add(1)
		} else {
			d.fc.blocked.Add(-1)
		}
	}
}

// privateTag is the front tag of b, a block of a private pool: its pool's
// tag if the malloc routed to that pool (not an automatic one) and the
// front routes the device's phases, else TagNone. d.mu is held.
//
// Blocks of expandable segments carry TagHoldSmall: the front serves them,
// but across takes it holds only small ones. A held block stays allocated
// to Go, so it neither merges with its free neighbours nor serves a malloc
// of another size; in a pool that grows by mapping pages at the end of its
// range, the mallocs meanwhile split the free tail instead, and the capture
// maps more. A GPT-2 forward's capture on the H100 took 246 MiB with the
// front holding its blocks at any size and 204 with the front off (native
// expandable segments: 222; docs/hot-path.md section 16). Left to Go
// entirely, though, 168 of its 215 mallocs crossed into Go, against 41 with
// ordinary segments, and the captured forward took 1.042x native's in one
// process. Held small only, the pool took 212 MiB and the front served 139
// of the mallocs (section 25).
//
//go:noinline
func (d *device) privateTag(b *pools.Block) uint32 {
	p := d.routedTo
	if !d.routed || p == nil || p.Auto || !d.routesOK || (b.Pool != p.Small && b.Pool != p.Large) {
		return TagNone
	}
	if b.Seg.Expandable {
		return PoolTag(p.Serial) | TagHoldSmall
	}
	return PoolTag(p.Serial)
}
