// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/vmem"
)

// The device's virtual memory: expandable segments and stitching belong to
// package vmem (its doc.go has the design). The device reaches it through
// virtualMemory and lends it what it owns itself: stream progress (events),
// the history's record of mappings, the device's capacity, and errors in
// the allocator's form.

// virtualMemory is a device's owner of virtual memory (vmem.Space). Every
// method runs with d.mu held.
type virtualMemory interface {
	// Configure applies the configuration's expandable_segments,
	// expandable_map_unit_mb and stitch keys.
	Configure(vmem.Config)
	// Expandable reports whether growth maps pages (probing the driver
	// once).
	Expandable() bool
	// Grow maps memory for r; capturing: a capture may be under way.
	// Running out of memory is (nil, nil).
	Grow(r pools.Request, capturing bool) (*pools.Block, error)
	// Trims reports whether TrimUnused may give anything back;
	// TrimUnused gives back the pages a private pool's large pool mapped
	// ahead. The caller holds the gate.
	Trims() bool
	TrimUnused(p *pools.BlockPool) error
	// UnmapFree unmaps the free pages of p (synchronizing first). Never
	// during a capture.
	UnmapFree(p *pools.BlockPool) error
	// Release gives back the physical memory held outside mappings and
	// the old mappings of lent pages. Never during a capture.
	Release(op string) error
	// Idle reports whether Release would find nothing to do.
	Idle() bool
	StitchStats() vmem.StitchStats
	// Share exports the physical allocations under the allocated block b
	// for another process (vmem's export.go); Exported counts the
	// exported allocations and the descriptors they hold.
	Share(b *pools.Block, op string) (vmem.SegmentShare, uint64, error)
	Exported() (allocations, fds int)
	// VMM reports whether the driver's virtual memory management works
	// (probing it once, quietly): a tag's pools grow through Grow then.
	VMM() bool
	// Pause unmaps and releases the mapped chunks of a tag's segment,
	// Resume maps new memory for its paused ones (pause.go); each returns
	// the bytes it did. The caller holds the gate.
	Pause(seg *pools.Segment) (uint64, error)
	Resume(seg *pools.Segment) (uint64, error)
}

// StitchStats counts a device's stitching (vmem.StitchStats).
type StitchStats = vmem.StitchStats

// StitchStats returns device dev's stitching counters.
func (a *Allocator) StitchStats(dev int) (StitchStats, error) {
	return onDevice(a, "stitch_stats", dev, func(d *device) (StitchStats, error) {
		return d.vm.StitchStats(), nil
	})
}

// vmemConfig is the virtual memory's part of cfg.
func vmemConfig(cfg *Config) vmem.Config {
	c := vmem.Config{Expandable: cfg.ExpandableSegments, MapUnit: cfg.ExpandableMapUnit, Stitch: cfg.Stitch,
		NoSync: cfg.NoStitchSync, StitchChunk: cfg.StitchChunk}
	switch {
	case cfg.StitchSet && cfg.Stitch:
		c.Named = "stitch:True"
	case cfg.ExpandableSet && cfg.ExpandableSegments:
		c.Named = "expandable_segments:True"
	}
	return c
}

// newVirtualMemory makes d's virtual memory over drv.
func (d *device) newVirtualMemory(drv Driver, cfg *Config) virtualMemory {
	vd, _ := drv.(vmem.Driver)      // nil: no VMM API (expandable segments fall back)
	sd, _ := drv.(vmem.ShareDriver) // nil: its memory cannot be shared
	return vmem.New(vmem.Deps{
		Dev: d.id, Driver: vd, Share: sd, Cache: d.cache,
		Progress: progress{d}, Recorder: mapRecorder{d},
		Capacity: d.capacity,
		Fail:     func(op, what string, err error) error { return driverError(op, err, "%s", what) },
		Warn:     d.warn,
	}, vmemConfig(cfg))
}

// progress is the device's stream progress (its events.Tracker) as vmem
// asks for it: points are ticks of the cache's clock, and no mark is
// recorded on a stream in a capture nobody announced.
type progress struct{ d *device }

func (p progress) Watch(s cuda.Stream)                  { p.d.ev.Watch(s) }
func (p progress) Watched(s cuda.Stream) bool           { return p.d.ev.Watched(s) }
func (p progress) Watching() bool                       { return p.d.ev.Watching() }
func (p progress) Passed(s cuda.Stream, at uint64) bool { return p.d.ev.Passed(s, at) }
func (p progress) Advance(rs cuda.Stream)               { p.d.ev.Advance(p.d.cache, rs, p.d.recordable, p.d.ret) }
func (p progress) Reset()                               { p.d.ev.ResetProgress() }
func (p progress) WantMark(s cuda.Stream)               { p.d.ev.WantMark(s) }
func (p progress) Synchronized()                        { p.d.ev.Synchronized(p.d.cache) }

// recordable reports whether a mark may be recorded on s now: not while s
// is in a capture nobody announced, where the event would be captured, not
// recorded (an error counts as capturing).
func (d *device) recordable(s cuda.Stream) bool {
	if d.a.announced.Load() {
		return true
	}
	st, _, err := d.drv.StreamCaptureInfo(d.id, s)
	return err == nil && st == cuda.CaptureNone
}

// trimUnused gives back, when routing to pool id ends and no capture is
// under way, the pages its large pool mapped ahead and never handed out
// (vmem's TrimUnused). It holds the capture gate (enterUnsafe) while it
// unmaps: a capture beginning on another device meanwhile would be
// invalidated. d.mu is held.
func (d *device) trimUnused(id PoolID) {
	if !d.vm.Trims() {
		return
	}
	pp := d.graphs.Pools.Get(id)
	if pp == nil || !d.enterUnsafe() {
		return
	}
	defer d.leaveUnsafe()
	if err := d.vm.TrimUnused(pp.Large); err != nil {
		d.warn(driverError("end_allocate_to_pool", err, "unmapping pages mapped ahead in pool {%d,%d} on device %d", id.A, id.B, d.id).Error())
	}
}
