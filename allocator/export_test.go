// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Internals exposed to this package's tests only.

// PoolLayout returns the current block layout of private pool id on dev.
func PoolLayout(a *Allocator, dev int, id PoolID) ([]pools.SegmentState, error) {
	d := a.devs[dev]
	d.enter()
	defer d.leave()
	pp := d.graphs.Pools.Get(id)
	if pp == nil {
		return nil, nil
	}
	return d.cache.SaveLayout(pp.Small, pp.Large)
}

// CheckpointLayout returns the layout a checkpoint holds.
func CheckpointLayout(cp *Checkpoint) []pools.SegmentState { return cp.Layout() }

// SetContext sets the context id of the allocated block at p, as a malloc
// recording its caller's context would.
func SetContext(a *Allocator, p cuda.Ptr, ctx uint64) bool {
	d, b := a.find(p)
	if d == nil {
		return false
	}
	b.Context = ctx
	d.leave()
	return true
}

// ContextOf returns the context id of the allocated block at p.
func ContextOf(a *Allocator, p cuda.Ptr) uint64 {
	d, b := a.find(p)
	if d == nil {
		return 0
	}
	defer d.leave()
	return b.Context
}

// CaptureReuseState returns the number of blocks with free markers and of
// walked (capture, stream) pairs that graph_capture_record_stream_reuse
// holds on dev.
func CaptureReuseState(a *Allocator, dev int) (markers, walks int) {
	d := a.devs[dev]
	d.enter()
	defer d.leave()
	return d.graphs.Reuse.State()
}

// EmptyCacheFull makes empty_cache take its full path even when the device
// has nothing to release (on) and returns the previous setting.
func EmptyCacheFull(on bool) bool { return emptyCacheFull.Swap(on) }

// CountEmptyCacheSkips starts counting the empty_cache calls that found
// nothing to release; the returned function returns the count since.
func CountEmptyCacheSkips() func() int64 {
	start := emptyCacheSkips.Load()
	return func() int64 { return emptyCacheSkips.Load() - start }
}

// NothingToRelease reports whether empty_cache would find nothing to do on
// dev.
func NothingToRelease(a *Allocator, dev int) bool {
	d := a.devs[dev]
	d.enter()
	defer d.leave()
	return d.nothingToRelease()
}
