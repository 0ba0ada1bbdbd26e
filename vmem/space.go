// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Expandable segments: growth maps pages instead of allocating segments.
//
// With expandable segments (the default), growth allocates no segment: each
// (pool, stream) pair, private pools included, has one reserved address range
// (or more, should one fill up) whose pages are mapped on demand. The page
// size is the driver's allocation granularity (2 MiB on current GPUs), the
// finest unit that can be mapped and unmapped alone. Growth of a large pool
// maps at least the mapping unit (expandable_map_unit_mb, 20 MiB by
// default; see mapUnit), so reserved memory may exceed what the blocks need
// by up to one unit per range; a private pool gives back what it mapped
// ahead when its capture ends (TrimUnused). Unmapping happens only where
// ordinary segments are freed (empty_cache, the OOM retry, released private
// pools), at the end of routing to a pool (TrimUnused) and on a stitching
// miss (stitch.go), each with the owner holding its capture gate: never
// while a capture may be under way.
//
// Physical allocations (chunks, one cuMemCreate and one cuMemMap each) are
// as large as one Map call's range allows, up to the range's ChunkSize
// (in the default pools' chunked ranges growth maps whole chunks where
// there is room, so that their allocations are one size, which PyTorch's
// IPC handle needs: export.go):
// the mapping unit (20 MiB, PyTorch's large-pool page) in the default
// large pool, so that growth costs one create and one map per 20 MiB rather
// than per 2 MiB page, and one growth in a private pool's (chunkSize: a
// GPT-2 forward's capture makes 7 of each, where page by page made 87; each
// costs 10-70 us on the GPU), and access is set once per mapped run. cuMemUnmap
// takes whole mappings, so memory goes back only in whole chunks: empty_cache,
// the OOM retry and TrimUnused release the chunks wholly inside free
// blocks (pools.wholePages). A growth touches the first chunk it maps, so a
// capture's pool keeps the chunk it used a part of (up to one unit less a
// page per range; PyTorch's 20 MiB pages and segments keep the same);
// TrimUnused still gives back whole chunks above the used end (a range made
// page by page before the unit was raised). Small pools map page by page
// (their requests need less than a page), and so does the default large
// pool when stitching is on: stitching moves single pages out of holes,
// which with 20 MiB chunks would rarely hold a whole one (private pools,
// never donors, are not).
//
// Reservation sizes: the default large pool (and a tag's, which may hold
// most of the device: pause.go) reserves the device's capacity plus an
// eighth (as PyTorch does, so that pages unmapped in the middle of the range
// can be mapped again at its end); the small pools and the private
// pools an eighth of the capacity, since virtual address space, though large,
// is not endless and a process may hold many graphs. A request larger than
// that gets a range of its own size.

// Driver is the CUDA virtual memory management API a Space uses (cuda/driver
// where the driver has it, and cuda/sim), with the three other calls it
// needs.
//
// MemAddressReserve, MemCreate, MemMap and MemSetAccess obey the calling
// thread's capture mode like cuMemAlloc (a Space calls them in relaxed mode);
// MemUnmap, MemRelease and MemAddressFree are never called while a capture
// may be under way.
type Driver interface {
	// MemGranularity is the size and alignment unit of physical
	// allocations and mappings on dev.
	MemGranularity(dev int) (uint64, error)
	// MemAddressReserve reserves size bytes of dev's address space.
	MemAddressReserve(dev int, size uint64) (cuda.Ptr, error)
	// MemAddressFree frees a whole reservation.
	MemAddressFree(dev int, p cuda.Ptr, size uint64) error
	// MemCreate allocates size bytes of physical memory on dev.
	MemCreate(dev int, size uint64) (cuda.MemHandle, error)
	// MemRelease releases a handle; its memory goes once it is unmapped.
	MemRelease(dev int, h cuda.MemHandle) error
	// MemMap maps all of h at p, inside a reservation.
	MemMap(dev int, p cuda.Ptr, size uint64, h cuda.MemHandle) error
	// MemSetAccess makes a mapped range readable and writable from dev
	// (the real driver: and from the devices that can access it as peers).
	MemSetAccess(dev int, p cuda.Ptr, size uint64) error
	// MemUnmap unmaps a range that mappings cover exactly.
	MemUnmap(dev int, p cuda.Ptr, size uint64) error
	// MemGetInfo returns the device's free and total memory in bytes.
	MemGetInfo(dev int) (free, total uint64, err error)
	DeviceSynchronize(dev int) error
	cuda.CaptureModeExchanger
}

// Progress is what stitching asks about queued work: the owner's stream
// progress (events.Tracker), whose points are ticks of the cache's clock
// (pools.cache.Tick; Block.FreedAt).
type Progress interface {
	// Watch makes Advance follow stream s's progress.
	Watch(s cuda.Stream)
	// Watched reports whether s is watched; Watching whether any is.
	Watched(s cuda.Stream) bool
	Watching() bool
	// Passed reports whether stream s is known to have run past tick at.
	Passed(s cuda.Stream, at uint64) bool
	// Advance learns what the watched streams have run past, and asks to
	// learn more of rs, the stream of the request at hand, by the next
	// call: rs is the one stream it may name to the driver (a stream named
	// earlier may have been destroyed since). Never during a capture.
	Advance(rs cuda.Stream)
	// WantMark asks that s be marked at its next request, whatever it
	// asks for: a miss found its free blocks uncertified.
	WantMark(s cuda.Stream)
	// Synchronized tells that the device was just synchronized: every
	// stream has run past every point before now.
	Synchronized()
	// Reset forgets what is known (the device is being synchronized).
	Reset()
}

// Recorder is told of every mapping change, for the memory history.
type Recorder interface {
	// Mapped: [seg.Base+off, +size) was mapped.
	Mapped(seg *pools.Segment, off, size uint64)
	// Unmapped: [seg.Base+off, +size) was unmapped; lent: its physical
	// memory went elsewhere while its old mapping stays (stitching).
	Unmapped(seg *pools.Segment, off, size uint64, lent bool)
}

// Deps is what a Space needs from its owner.
type Deps struct {
	Dev      int
	Driver   Driver      // nil: the driver has no virtual memory management API
	Share    ShareDriver // nil: physical memory cannot be shared (export.go)
	Cache    *pools.Cache
	Progress Progress
	Recorder Recorder
	// Capacity returns the device's memory size.
	Capacity func() (uint64, error)
	// Fail builds the error of operation op, which failed doing what.
	Fail func(op, what string, err error) error
	// Warn reports a condition that is not an error.
	Warn func(msg string)
}

// Config is a Space's part of the allocator's configuration.
type Config struct {
	Expandable bool   // expandable_segments:True
	MapUnit    uint64 // expandable_map_unit_mb, in bytes
	Stitch     bool   // stitch:True (which implies Expandable)
	NoSync     bool   // stitch_sync:False (stitch.go, "Synchronizing")
	// StitchChunk is stitch_chunk_mb, in bytes (0: one page): the
	// physical allocations of the default large pool's new ranges with
	// stitching (stitch.go, "Chunks").
	StitchChunk uint64
	// Named is the key the configuration named to ask for expandable
	// memory ("expandable_segments:True" or "stitch:True"), or "" where
	// it is on by default: only a named key earns a note when the driver
	// cannot honour it (the default falls back to ordinary segments
	// quietly).
	Named string
}

// Space is one device's virtual memory. Its owner's lock guards it.
type Space struct {
	dev      int
	drv      Driver // nil: no VMM API
	cache    *pools.Cache
	progress Progress
	rec      Recorder
	capacity func() (uint64, error)
	fail     func(op, what string, err error) error
	warn     func(msg string)
	mapper   pools.Mapper // mapper{s}, made once

	want    bool   // expandable segments asked for
	named   string // Config.Named
	unitCfg uint64 // Config.MapUnit
	state   int8   // VMM support: 0 not probed yet, 1 usable, -1 not
	noVMM   bool   // VMM found missing by VMM (pause.go), which does not warn
	page    uint64 // the mapping unit, once probed
	why     string // why not, once probed (state -1)

	phys    physicalMemory // spares and orphans (mapper.go)
	stitch  stitchState    // stitch.go
	share   shareState     // exports to other processes (export.go)
	handles []physical     // Map's scratch space
	// unmapRuns: a cuMemUnmap over several mappings has worked; unmapOne:
	// the driver refused one while each of its mappings unmapped alone, and
	// never took one (mapper.go, unmapRun).
	unmapRuns, unmapOne bool
	// fromSpare: which of handles Map took from the spares (scratch).
	fromSpare []bool
}

// New returns the Space of d.Dev.
func New(d Deps, c Config) *Space {
	s := &Space{dev: d.Dev, drv: d.Driver, cache: d.Cache, progress: d.Progress, rec: d.Recorder,
		capacity: d.Capacity, fail: d.Fail, warn: d.Warn}
	s.mapper = mapper{s}
	s.share.drv = d.Share
	s.Configure(c)
	return s
}

// Configure applies c from the next growth on. A configuration that names
// expandable memory where the driver was found to lack it earns the note
// now (Expandable).
func (s *Space) Configure(c Config) {
	s.want = c.Expandable || c.Stitch
	s.unitCfg, s.stitch.on, s.named = c.MapUnit, c.Stitch, c.Named
	s.stitch.noSync = c.NoSync
	s.stitch.chunk = c.StitchChunk
	if s.want && s.state == -1 {
		s.note()
	}
}

// Expandable reports whether growth maps pages of expandable segments. On
// first use it probes the driver's support; where it is missing, growth
// allocates ordinary segments, with a note if the configuration named
// expandable memory (by default, quietly: a driver without it loses
// nothing it was promised).
func (s *Space) Expandable() bool {
	if !s.want {
		return false
	}
	if s.state == 0 {
		s.state = -1
		if s.drv == nil {
			s.why = "the CUDA driver has no virtual memory management API"
		} else if g, err := s.drv.MemGranularity(s.dev); err != nil || g == 0 {
			s.why = fmt.Sprintf("device %d does not support virtual memory management (granularity %d, %v)", s.dev, g, err)
		} else {
			// Pages of at least 2 MiB: a smaller granularity would only
			// multiply the driver calls.
			s.page = (pools.RoundLarge + g - 1) / g * g
			s.state = 1
		}
		s.note()
	}
	return s.state == 1
}

// note reports, if the configuration named expandable memory, that the
// driver lacks it (the owner's Warn reports each message once).
func (s *Space) note() {
	if s.state == -1 && s.named != "" {
		s.warn(s.named + ": " + s.why + "; using ordinary segments")
	}
}

// Grow maps pages for r, reserving a new range if none has room. capturing:
// a capture may be under way (nothing may be unmapped or released, and
// stitching waits). Running out of memory (or of the memory fraction) is
// (nil, nil): the owner decides what to try next.
func (s *Space) Grow(req pools.Request, capturing bool) (*pools.Block, error) {
	c, r := s.cache, &req
	stitch := s.stitch.on && !capturing && !tagged(r) // (tags are never stitched: pause.go)
	if stitch {
		s.stitchPrepare(r.Stream)
	}
	choice := s.runChoice(r)
	unit := s.mapUnit(r)
	start := c.FindExpandable(r, choice)
	if choice == pools.LeastGrowth && start != nil {
		// The lowest run all the same (pools/expandable.go, "Which run")
		// in a fragmented range, which grows as without stitching
		// (stitch.go, "Fragmented ranges"), and where the run needing the
		// fewest new pages saves no more than one mapping unit: so that a
		// steady working set settles.
		low := c.FindExpandable(r, pools.LowestRun)
		if roomy(start.Seg, r.Size) || pools.RunNeed(r, low) <= pools.RunNeed(r, start)+unit {
			choice, start = pools.LowestRun, low
		}
	}
	if start == nil {
		size, err := s.reserveSize(r)
		if err != nil {
			return nil, s.fail("malloc", fmt.Sprintf("reading device %d's memory size", s.dev), err)
		}
		var p cuda.Ptr
		err = s.withThreadRelaxed(func() (err error) {
			p, err = s.drv.MemAddressReserve(s.dev, size)
			return err
		})
		if errors.Is(err, cuda.ErrOutOfMemory) {
			return nil, nil
		}
		if err != nil {
			return nil, s.fail("malloc", fmt.Sprintf("reserving %d bytes of address space on device %d", size, s.dev), err)
		}
		start = c.AddExpandable(r, p, size, s.page, s.chunkSize(r))
		// The default pools' blocks are what processes share: their
		// chunked ranges grow by whole chunks (export.go, "One size").
		// A private pool keeps to the pages its graph needs, and a tag's
		// to what it asks for (its chunks are up to 1 GiB: pause.go).
		start.Seg.WholeChunks = r.Pool.ID.IsDefault() && !tagged(r)
	}
	if !s.share.chosen {
		s.chooseKind(capturing)
	}
	var donated uint64
	if stitch {
		if r.Pool == c.Large || r.Pool == c.Small {
			s.progress.Watch(r.Stream)
		}
		if donated = s.stitchFor(r, start, unit); donated > 0 {
			start = c.FindExpandable(r, choice) // the blocks around start may have merged
		}
	}
	var b *pools.Block
	s.phys.capturing = capturing
	spares := s.phys.spareBytes(^uint64(0))
	err := s.withThreadRelaxed(func() (err error) {
		b, err = c.MapExpandable(r, start, s.mapper, unit)
		return err
	})
	if donated > 0 {
		s.countRemaps(donated, spares-min(spares, s.phys.spareBytes(^uint64(0))), s.page)
	}
	switch {
	case errors.Is(err, cuda.ErrOutOfMemory), errors.Is(err, pools.ErrFraction):
		return nil, nil
	case err != nil:
		return nil, s.fail("malloc", fmt.Sprintf("mapping memory for a %d-byte block on device %d", r.Size, s.dev), err)
	}
	return b, nil
}

// runChoice is the run growth maps into (pools/expandable.go, "Which
// run"): the one needing the fewest new pages in the pools whose pages
// stitching moves, the lowest-addressed one elsewhere (and, Grow decides,
// in a fragmented range or where the fewest new pages save no more than a
// mapping unit).
func (s *Space) runChoice(r *pools.Request) pools.RunChoice {
	if s.stitch.on && (r.Pool == s.cache.Large || r.Pool == s.cache.Small) {
		return pools.LeastGrowth
	}
	return pools.LowestRun
}

// withThreadRelaxed runs fn with the calling thread in relaxed capture
// mode (cuda.WithThreadRelaxed); a failure to switch back is a warning.
func (s *Space) withThreadRelaxed(fn func() error) error {
	return cuda.WithThreadRelaxed(s.drv, fn, s.restoreFailed)
}

func (s *Space) restoreFailed(prev cuda.CaptureMode, err error) {
	s.warn(fmt.Sprintf("restoring the calling thread's capture mode (%v) after a driver allocation on device %d failed (%v); the thread may stay in relaxed capture mode", prev, s.dev, err))
}

// mapUnit is the least that growth maps at once in r's pool: the
// configured unit (expandable_map_unit_mb, 20 MiB by default, as PyTorch's
// large-pool pages) in large pools, one page in small ones, whose requests
// need less than a page. One Map call costs a cuMemSetAccess (about 26 us)
// whatever its size, so a capture that grows a pool by many small steps
// pays for every step; mapping ahead trades up to one unit of free mapped
// memory per range for fewer calls.
func (s *Space) mapUnit(r *pools.Request) uint64 {
	if r.Pool.Small {
		return s.page
	}
	return (max(s.unitCfg, s.page) + s.page - 1) / s.page * s.page
}

// chunkSize is the most one physical allocation covers in a new range of
// r's pool: the mapping unit in the default large pool, as PyTorch's 20 MiB
// pages, so that growth costs one cuMemCreate and one cuMemMap per unit
// instead of one per 2 MiB page, and its allocations are one size (the IPC
// handle's need: export.go); one page in small pools (they map page by
// page) and, unless stitch_chunk_mb says more (stitch.go, "Chunks"), in the
// default large pool when stitching is on, whose holes give single pages
// (pools.Donors). A private pool's large range maps each growth as one
// allocation of up to privateChunk: it is never a donor, its growths happen
// during captures, where each allocation costs a cuMemCreate, a cuMemMap
// and its share of the cuMemSetAccess (together 40-70 us there, on an
// H200), and a growth maps ahead only up to the mapping unit, as one unit
// chunk did. The cost is that memory goes back in whole allocations: a
// block that outlives its pool (a graph's output) keeps the allocations it
// lies on, up to privateChunk each, where 20 MiB chunks kept 20 MiB. With a
// mapping unit of one page the range maps page by page as asked, and
// TrimUnused gives back what a later, larger unit mapped ahead; a unit
// raised after a range was made maps ahead inside the growth's one
// allocation, which TrimUnused cannot split.
func (s *Space) chunkSize(r *pools.Request) uint64 {
	if tagged(r) && !r.Pool.Small {
		return max(tagChunk/s.page*s.page, s.mapUnit(r)) // (pause.go)
	}
	if unit := s.mapUnit(r); !r.Pool.ID.IsDefault() && unit > s.page {
		return max(privateChunk/s.page*s.page, unit)
	}
	if s.stitch.on && r.Pool == s.cache.Large {
		return max((s.stitch.chunk+s.page-1)/s.page*s.page, s.page)
	}
	return s.mapUnit(r)
}

// privateChunk is the most one physical allocation covers in a private
// pool's large range (chunkSize): a GPT-2 forward's capture grows by up to
// 70 MiB at once, and a block that outlives its pool keeps no more than
// this beyond itself at either end.
const privateChunk = 128 << 20

// reserveSize is the address range reserved for a new expandable segment
// of r's pool (see the file comment).
func (s *Space) reserveSize(r *pools.Request) (uint64, error) {
	total, err := s.capacity()
	if err != nil {
		return 0, err
	}
	size := total / 8
	if r.Pool == s.cache.Large || tagged(r) && !r.Pool.Small && r.Pool.ID.IsDefault() {
		size += total // (a tag's large pool may hold most of the device)
	}
	size = max(size, r.Size)
	return (size + s.page - 1) / s.page * s.page, nil
}

// Trims reports whether TrimUnused may find pages to give back: expandable
// segments are in use with a mapping unit above one page.
func (s *Space) Trims() bool { return s.state == 1 && s.unitCfg > s.page }

// TrimUnused gives back the pages the large pool p (a private pool's, whose
// routing has ended) mapped ahead and never handed out (pools.TrimUnused):
// a graph's pool then holds what its allocations needed, in whole pages,
// whatever the mapping unit. No work has touched those pages, so no
// synchronize is needed. The owner holds its capture gate.
func (s *Space) TrimUnused(p *pools.BlockPool) error {
	err := s.cache.TrimUnused(p, s.mapper)
	s.phys.releaseSpares(s)
	return err
}

// UnmapFree unmaps the free pages of p's expandable segments
// (pools.UnmapFree), after synchronizing the device if there is anything to
// unmap: unlike cuMemFree, cuMemUnmap does not wait for work still using
// the memory (PyTorch synchronizes too). Never during a capture.
func (s *Space) UnmapFree(p *pools.BlockPool) error {
	if s.state != 1 || !p.Releasable() {
		return nil
	}
	if s.cache.HasUnmappable(p) {
		if err := s.drv.DeviceSynchronize(s.dev); err != nil {
			return fmt.Errorf("synchronizing the device first: %w", err)
		}
	}
	err := s.cache.UnmapFree(p, s.mapper)
	s.phys.releaseSpares(s)
	return err
}

// Release gives back the physical memory held outside any mapping: the
// spares and orphans, and the old mappings of lent pages (after
// synchronizing the device); what stitching knew of the streams' progress
// is forgotten. op names the operation in errors (empty_cache, or malloc for
// the OOM retry). Never during a capture.
func (s *Space) Release(op string) error {
	if err := s.phys.releaseOrphans(s, op); err != nil {
		return err
	}
	return s.releaseStitch(op)
}

// Idle reports whether Release would find nothing to give back.
func (s *Space) Idle() bool { return s.phys.empty() && len(s.stitch.lent) == 0 }

// StitchStats returns the stitching counters.
func (s *Space) StitchStats() StitchStats { return s.stitch.stats }
