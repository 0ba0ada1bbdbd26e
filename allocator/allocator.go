// SPDX-License-Identifier: Apache-2.0

// Package allocator is cudapool's caching allocator: it orchestrates, for
// each device of a CUDA driver, the owners of the allocator's mechanisms.
//
// # Owners
//
// Each mechanism has one owner; the device (device, in this package) holds
// one of each and calls them under its lock. Locks are listed in rank
// order (lockrank.go).
//
//	package      owns                                           locks
//	allocator    the devices and what crosses them: the         Allocator.cfgMu,
//	             configuration, captures under way and the      history.mu,
//	             capture gate (device.go), caching off          pauser.mu,
//	             (uncached.go), the memory history's            device.mu,
//	             allocator-wide state (history.go), the front   Allocator.gate,
//	             cache's control (front.go), the IPC cache      uncached.mu,
//	             (ipc.go), PyTorch's handles and the imports    frontCtl.mu,
//	             of other processes' memory (share.go), tags    ipcMaps.mu,
//	             and their pools (tags.go), pause and resume    tagTable.mu,
//	             (pause.go); per device: the lock, the          the import
//	             request paths (request.go), the retry          cache's (vmem)
//	             sequence, the memory fraction, the device's
//	             recorder (recorder.go)
//	pools        blocks, segments, free sets, best fit, split   none (device.mu)
//	             and merge, statistics, the clock of frees,
//	             the block side of expandable segments,
//	             stitching and paused memory
//	events       deferred frees and stream progress: per-       none (device.mu)
//	             stream queues of events, pooled events,
//	             "has stream S run past point T"
//	graphs       capture routing (announced and unannounced     none (device.mu)
//	             captures) and capture-time reuse of
//	             record_stream'd blocks (graphs.Reuse)
//	privatepool  private pools' lifetime (holders, release,     none (device.mu)
//	             which pools may be named or restored into),
//	             segment sources, checkpoints
//	vmem         virtual memory: reservations, physical         none (device.mu);
//	             allocations (map unit, spares, orphans),       ImportCache's
//	             map/unmap/lend, stitching's policy, exports    own, alone; the
//	             to other processes, a paused tag's release     Copier's own
//	             and remapping, pinned copies; the import
//	             cache
//	cuda         the driver (cuda/driver), the simulator        the driver's and
//	             (cuda/sim), relaxed capture mode               simulator's own
//	capi         the C ABI and the C front cache                C's spin lock
//
// The device talks to vmem through virtualMemory (virtual.go), to the
// history through recorder (recorder.go), and to events, graphs and
// privatepool through their types; vmem, graphs and events reach the
// driver through interfaces of their own, and vmem learns stream progress
// and records mappings through interfaces the device implements.
//
// # Design
//
// Each device has its own state and one mutex; every operation on a device
// takes that lock once and does all its work under it. A cache-hit malloc
// and a free are a best-fit search, a split or merge and a few statistics
// updates under the lock, with no driver call and no Go allocation.
//
// malloc(size, stream), as in PyTorch:
//
//  1. No capture under way: return the blocks whose events have completed.
//  2. Route: an announced capture whose filter accepts the stream (newest
//     first), or an unannounced capture on the stream, selects its private
//     pool; otherwise the default pools. Small or large by rounded size.
//  3. Best fit on the stream in that pool.
//  4. Else grow: garbage-collect old cached segments if configured; allocate
//     a new segment (with expandable segments, the default, map pages into
//     the pool's reserved range instead: package vmem); else, for a request
//     of the default pools, take a cached block of a user pool marked
//     use_on_oom (mempool.go); else free cached oversize segments and
//     retry; else wait for all pending events, free every cached whole
//     segment and unmap every free page (and the released private pools')
//     and retry. Steps that free memory are skipped while a capture is
//     under way.
//  5. Else out of memory, with PyTorch's message.
//
// New segments are allocated with the calling thread switched to relaxed
// capture mode ("malloc maybe capturing"): legal during any capture, whose
// graph then owns the memory through its private pool. While any capture
// runs, nothing is freed to the driver, no event is queried and no stream is
// synchronized; a free that needs events is deferred until the captures end.
//
// The driver is reached only through the Driver interface, so the same code
// runs on the GPU (cuda/driver) and on the simulator (cuda/sim).
//
// The memory history (PyTorch's _record_memory_history: a trace of actions,
// the callers' contexts on blocks, segments and entries) is in history.go
// and recorder.go; snapshots in snapshot.go.
package allocator

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/events"
	"github.com/cudapool/cudapool/graphs"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

// PoolID names a private pool ({0,0} is the default pool).
type PoolID = pools.PoolID

// Allocator is a caching allocator over all devices of a driver.
//
// The fields every malloc reads (devs, announced, cachingOff) come first, in
// 32 bytes: one cache line wherever Go places the struct (its size class
// aligns it to 32 bytes).
type Allocator struct {
	devs []*device
	// announced is set once anyone announces captures (Begin, or
	// ExpectAnnouncements); from then on malloc no longer asks the driver
	// whether its stream is capturing.
	announced atomic.Bool
	// cachingOff: every malloc goes to the driver (uncached.go); unc holds
	// those allocations, uncN their number.
	cachingOff atomic.Bool
	uncN       atomic.Int64
	unc        uncached
	drv        Driver
	cfgMu      rankedMutex // serializes Configure
	cfg        atomic.Pointer[Config]
	// underway counts the captures the devices believe under way. CUDA's
	// capture rules are process-wide (a free or synchronize on one device
	// can invalidate a capture on another), so every device consults it.
	underway atomic.Int64
	// gate orders the devices' unsafe sections (freeing memory, querying
	// and recording events outside captures) with announced capture
	// begins; see device.go.
	gate rankedRWMutex
	// onWarning reports conditions worth a message but not an error (each
	// message once); nil: stderr.
	onWarning atomic.Pointer[func(string)]
	warned    sync.Map
	hist      history // memory history (history.go)
	front     frontCtl
	imports   shareImports // memory other processes shared (share.go)
	tags      tagTable     // the tags' names (tags.go)
	pauser    pauser       // pause and resume by tag (pause.go)
}

// device is one GPU's allocator state: what one lock, mu, guards, and the
// owners it orchestrates (see the package comment).
//
// The fields a cache-hit malloc and free read come first, together: after
// an eviction each cache line is a miss. Go puts an 8-byte header before an
// object of this size, so the struct starts 8 bytes into a line: mu through
// newPools fill the first line; a and graphs' private pools and captures
// (which every malloc's Idle reads) the second and the start of the third;
// rec and the front's fields follow graphs' Reuse, read during captures.
type device struct {
	mu    sync.Mutex
	cache *pools.Cache    // guarded by mu
	ev    *events.Tracker // guarded by mu
	// counted is this device's contribution to a.underway; guarded by mu.
	counted int64
	// inUnsafe: this device holds the gate shared (enterUnsafe); guarded
	// by mu.
	inUnsafe bool
	debug    bool // debug_checks; guarded by mu
	// Built once so that passing them costs no allocation.
	query    func(cuda.Stream) (cuda.CaptureStatus, uint64, error)
	newPools privatepool.NewPools
	a        *Allocator    // the allocator: captures under way, the gate, warnings
	graphs   graphs.Router // captures, private pools, capture reuse; guarded by mu
	rec      recorder      // the memory history (nil: off); guarded by mu
	front    frontState    // the front cache's side (front.go); its fields name their guards
	tags     deviceTags    // the tags' pools (tags.go); guarded by mu

	id    int
	drv   Driver
	vm    virtualMemory // expandable segments and stitching (virtual.go); guarded by mu
	limit memoryLimit   // capacity and memory fraction; guarded by mu

	// Built once so that passing them costs no allocation.
	freeSeg pools.FreeFunc
	ret     func(*pools.Block)
}

// memoryLimit is the device's capacity, read once, and the memory fraction
// the configuration asks for (per_process_memory_fraction), applied to the
// cache when the device next grows, since that needs the capacity from the
// driver.
type memoryLimit struct {
	total    uint64 // device capacity (0: not yet read)
	fraction float64
	pending  bool // fraction is not yet applied
}

// New returns an allocator for every device of drv.
func New(drv Driver, cfg Config) (*Allocator, error) {
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, driverError("init", err, "counting devices")
	}
	a := &Allocator{drv: drv}
	a.cfgMu.rank, a.gate.rank, a.hist.mu.rank, a.unc.mu.rank, a.front.mu.rank = rankConfig, rankGate, rankHistory, rankUncached, rankFront
	a.pauser.mu.rank, a.tags.mu.rank = rankPause, rankTags
	a.cfg.Store(&cfg)
	a.hist.publish()
	for i := 0; i < n; i++ {
		d := &device{id: i, drv: drv, a: a, cache: pools.NewCache(cfg.Pools), ev: events.New(drv, i)}
		a.hist.devs = append(a.hist.devs, &deviceHistory{labels: &a.hist.labels})
		d.front.ctl = &a.front
		d.debug = cfg.DebugChecks
		d.freeSeg = d.freeSegment
		d.newPools = func(id pools.PoolID) (*pools.BlockPool, *pools.BlockPool) {
			small, large := d.cache.NewPool(true, id), d.cache.NewPool(false, id)
			// An automatic pool made for a tagged malloc is the tag's
			// (tags.go); a begun pool gets its tag from the begin.
			small.Tag, large.Tag = d.tags.cur, d.tags.cur
			return small, large
		}
		d.query = func(s cuda.Stream) (cuda.CaptureStatus, uint64, error) {
			return drv.StreamCaptureInfo(d.id, s)
		}
		d.ret = d.returnBlock
		d.graphs.Reuse.On = cfg.GraphCaptureRecordStreamReuse
		d.limit.fraction, d.limit.pending = cfg.MemoryFraction, cfg.MemoryFractionSet
		d.vm = d.newVirtualMemory(drv, &cfg)
		a.devs = append(a.devs, d)
	}
	a.checkRanks(cfg.DebugChecks)
	if cfg.HistoryEntries > 0 {
		a.historyFromConfig(cfg.HistoryEntries)
	}
	return a, nil
}

// historyFromConfig applies the record_history:N configuration key: N > 0
// records the trace of the last N actions per device, without contexts (the
// key predates them, and gathering stacks costs time nobody asked to spend);
// N = 0 stops the history. RecordHistory asks for more.
func (a *Allocator) historyFromConfig(n int) {
	_ = a.RecordHistory(HistoryOptions{Enabled: n > 0, MaxEntries: max(n, 0)})
}

// DeviceCount is the number of devices.
func (a *Allocator) DeviceCount() int { return len(a.devs) }

// Config returns the configuration in force.
func (a *Allocator) Config() Config { return *a.cfg.Load() }

// Configure replaces the configuration. Cached blocks keep their sizes. A
// changed record_history key restarts the history (see historyFromConfig);
// per_process_memory_fraction in cfg becomes every device's memory
// fraction; without one, the devices keep theirs.
func (a *Allocator) Configure(cfg Config) {
	a.cfgMu.Lock()
	defer a.cfgMu.Unlock()
	old := a.cfg.Swap(&cfg)
	for _, d := range a.devs {
		d.enter()
		d.cache.SetConfig(cfg.Pools)
		if d.debug != cfg.DebugChecks {
			// This hold was (not) recorded: make leave's match.
			if d.debug {
				heldRanks.release(rankDevice)
			} else {
				heldRanks.acquire(rankDevice)
			}
			d.debug = cfg.DebugChecks
		}
		d.vm.Configure(vmemConfig(&cfg))
		d.graphs.Reuse.On = cfg.GraphCaptureRecordStreamReuse
		if cfg.MemoryFractionSet {
			d.limit.fraction, d.limit.pending = cfg.MemoryFraction, true
		}
		d.leave()
	}
	a.checkRanks(cfg.DebugChecks)
	if cfg.HistoryEntries != old.HistoryEntries {
		a.historyFromConfig(cfg.HistoryEntries)
	}
	a.front.sync()
}

// SetWarningHandler routes the allocator's warnings (conditions that are not
// errors, such as expandable segments falling back to ordinary ones) to fn,
// once per message. By default they go to stderr.
func (a *Allocator) SetWarningHandler(fn func(msg string)) { a.onWarning.Store(&fn) }

func (a *Allocator) warn(msg string) {
	if _, dup := a.warned.LoadOrStore(msg, true); dup {
		return
	}
	if fn := a.onWarning.Load(); fn != nil && *fn != nil {
		(*fn)(msg)
		return
	}
	fmt.Fprintln(os.Stderr, "cudapool: "+msg)
}

// ExpectAnnouncements tells the allocator that every capture will be
// announced with BeginAllocateToPool (PyTorch does this), so malloc need not
// ask the driver whether its stream is capturing.
func (a *Allocator) ExpectAnnouncements() {
	a.announced.Store(true)
	a.front.sync()
}

// device returns device dev, or op's error for a device that does not exist.
// Small enough to be inlined into every operation (the error is built out of
// line): a call frame less on the hot path.
func (a *Allocator) device(op string, dev int) (*device, error) {
	if uint(dev) < uint(len(a.devs)) {
		return a.devs[dev], nil
	}
	return nil, a.noDevice(op, dev)
}

//go:noinline
func (a *Allocator) noDevice(op string, dev int) error {
	return newError(op, ErrInvalidDevice, "device %d does not exist (%d devices)", dev, len(a.devs))
}

// onDevice is the prologue and epilogue of an operation on one device: it
// runs fn on device dev with the device locked (lock: the front's log
// replayed first; unlock after fn), or fails with op's error for a device
// that does not exist.
func onDevice[T any](a *Allocator, op string, dev int, fn func(d *device) (T, error)) (T, error) {
	d, err := a.device(op, dev)
	if err != nil {
		var zero T
		return zero, err
	}
	d.enter()
	defer d.leave()
	return fn(d)
}

// withDevice is onDevice for an operation that returns only an error.
func (a *Allocator) withDevice(op string, dev int, fn func(d *device) error) error {
	_, err := onDevice(a, op, dev, func(d *device) (struct{}, error) { return struct{}{}, fn(d) })
	return err
}

// enter begins an operation on d and leave ends it. enter takes the device
// lock by lock (front.go), which then replays the front's log, so that the
// structures are what the same calls without the front would have left;
// under debug_checks it checks the hold against the lock ranks
// (lockrank.go). leave releases the lock. The common paths of Malloc and
// of a free write the pair out (Malloc with lockMalloc, which lets the
// front keep holding blocks), their rank checks sharing the debug_checks
// test of the invariant check.
func (d *device) enter() {
	d.lock()
	if d.debug {
		heldRanks.acquire(rankDevice)
	}
}

func (d *device) leave() {
	if d.debug {
		heldRanks.release(rankDevice)
	}
	d.mu.Unlock()
}

// warn reports a condition that is not an error (Allocator.warn).
func (d *device) warn(msg string) { d.a.warn(msg) }

// find locks the device holding the allocated block at p and returns both;
// the caller unlocks. It returns nil if no device has allocated p.
func (a *Allocator) find(p cuda.Ptr) (*device, *pools.Block) {
	for _, d := range a.devs {
		d.enter()
		if b := d.cache.Lookup(p); b != nil {
			return d, b
		}
		d.leave()
	}
	return nil, nil
}

// AllocationInfo returns the device and requested size of the allocation
// at p (for profilers that report frees with their size).
func (a *Allocator) AllocationInfo(p cuda.Ptr) (dev int, size uint64, err error) {
	d, b := a.find(p)
	if d == nil {
		return -1, 0, a.explainUnknown("allocation_info", -1, p)
	}
	dev, size = d.id, b.Requested
	d.leave()
	return dev, size, nil
}

// RecordStream notes that stream s uses the allocation at p, so that its
// memory is not reused until the work s has queued by the time of the free
// completes.
func (a *Allocator) RecordStream(p cuda.Ptr, s cuda.Stream) error {
	d, b := a.find(p)
	if d == nil {
		if a.isUncached(p) {
			return nil // freed straight to the driver: nothing to delay
		}
		return a.explainUnknown("record_stream", -1, p)
	}
	events.RecordUse(b, s)
	d.invalidate(p) // its free must wait for s's work, which only Go sees
	d.leave()
	return nil
}

// BaseAllocation returns the segment that contains p (an allocated pointer,
// or any address inside a segment). In an expandable segment that is the
// contiguous mapped run containing p, the unit a snapshot shows as a
// segment: the largest range around p that is all accessible memory.
// (PyTorch refuses expandable blocks here, because its callers share the
// range with other processes through cudaIpcGetMemHandle, which VMM memory
// does not support; a range is more useful to in-process callers, and an IPC
// caller fails on the driver's side either way.)
func (a *Allocator) BaseAllocation(p cuda.Ptr) (cuda.Ptr, uint64, error) {
	if d, b := a.find(p); d != nil {
		base, size := b.Seg.Base, b.Seg.Size
		if b.Seg.Expandable {
			base, size, _ = d.cache.MappedRun(b.Seg, b.Ptr)
		}
		d.leave()
		return base, size, nil
	}
	for _, d := range a.devs {
		d.enter()
		seg := d.cache.SegmentAt(p)
		var base cuda.Ptr
		var size uint64
		ok := seg != nil
		if ok {
			base, size = seg.Base, seg.Size
			if seg.Expandable {
				base, size, ok = d.cache.MappedRun(seg, p)
			}
		}
		d.leave()
		if ok {
			return base, size, nil
		}
	}
	return 0, 0, newError("base_allocation", ErrUnknownPointer, "pointer %#x is not in any cudapool segment", uintptr(p))
}

// For tests (export_test.go): emptyCacheFull makes empty_cache take its
// full path even with nothing to release; emptyCacheSkips counts the calls
// that did not.
var (
	emptyCacheFull  atomic.Bool
	emptyCacheSkips atomic.Int64
)

// EmptyCache returns every cached whole segment, and the memory of released
// private pools, to the driver. A device with a capture under way is left
// alone and reported in the error. ctx is the id of the caller's context
// (0: none), gathered when GatherMask has GatherRelease (history.go).
func (a *Allocator) EmptyCache(ctx uint64) error {
	// First let every device notice the unannounced captures that ended.
	for _, d := range a.devs {
		d.enter()
		d.capturing()
		d.leave()
	}
	var first error
	for _, d := range a.devs {
		d.enter()
		var err error
		if !d.enterUnsafe() {
			err = newError("empty_cache", ErrCaptureUnderway, "device %d: a CUDA graph capture is under way; its cache is kept", d.id)
		} else if !emptyCacheFull.Load() && d.nothingToRelease() {
			d.cache.Stats.NumSyncAllStreams++ // as syncAll counts
			emptyCacheSkips.Add(1)
			d.leaveUnsafe()
		} else {
			d.begin(ctx, HistoryAll)
			err = d.releaseCached("empty_cache")
			d.end()
			if err == nil {
				if derr := d.ev.DestroySpare(); derr != nil {
					err = driverError("empty_cache", derr, "destroying cached events on device %d", d.id)
				}
			}
			d.leaveUnsafe()
		}
		if d.debug {
			d.mustCheck()
		}
		d.leave()
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}

// SetMemoryFraction limits the memory cudapool reserves on dev to fraction
// of the device's capacity. As in PyTorch, 1 means no limit (and garbage
// collection, which needs a limit, stays off).
func (a *Allocator) SetMemoryFraction(dev int, fraction float64) error {
	const op = "set_memory_fraction"
	return a.withDevice(op, dev, func(d *device) error {
		if !(fraction >= 0 && fraction <= 1) {
			return newError(op, ErrInvalidArgument, "fraction %v is not in [0, 1]", fraction)
		}
		total, err := d.capacity()
		if err != nil {
			return driverError(op, err, "reading device %d's memory size", dev)
		}
		d.cache.SetFraction(fraction, total)
		d.limit.pending = false // this call overrides the configuration's
		return nil
	})
}

// BeginAllocateToPool routes the allocations on dev whose stream filter
// accepts (nil: all streams) to the private pool id until EndAllocateToPool.
// (BeginAllocateToPoolTagged, tags.go, does it for a thread under a tag.)
func (a *Allocator) BeginAllocateToPool(dev int, id PoolID, filter func(cuda.Stream) bool) error {
	return a.BeginAllocateToPoolTagged(dev, id, 0, filter)
}

// EndAllocateToPool stops routing to the pool id.
func (a *Allocator) EndAllocateToPool(dev int, id PoolID) error {
	const op = "end_allocate_to_pool"
	return a.withDevice(op, dev, func(d *device) error {
		if err := d.graphs.End(id); err != nil {
			return poolError(op, err)
		}
		d.pushPhases()
		d.countCaptures()
		d.trimUnused(id)
		return nil
	})
}

// ReleasePool drops one holder of the pool id. When none is left, its
// cached memory goes back to the driver at the next empty_cache or OOM retry.
func (a *Allocator) ReleasePool(dev int, id PoolID) error {
	const op = "release_pool"
	return a.withDevice(op, dev, func(d *device) error {
		if err := d.graphs.Release(id); err != nil {
			return poolError(op, err)
		}
		return nil
	})
}

func poolError(op string, err error) error {
	kind := ErrUnknownPool
	switch {
	case errorsIs(err, graphs.ErrAlreadyRecording):
		kind = ErrAlreadyRecording
	case errorsIs(err, graphs.ErrNotRecording):
		kind = ErrNotRecording
	}
	return &Error{Op: op, Kind: kind, Msg: err.Error()}
}

// Stats returns device dev's statistics.
func (a *Allocator) Stats(dev int) (pools.Stats, error) {
	return onDevice(a, "memory_stats", dev, func(d *device) (pools.Stats, error) {
		return d.cache.ReadStats(), nil
	})
}

// StatsReset says which statistics ResetStats resets.
type StatsReset uint8

const (
	// ResetPeak sets every peak statistic to its current value.
	ResetPeak StatsReset = 1 << iota
	// ResetAccumulated zeroes the accumulated statistics.
	ResetAccumulated
)

// ResetStats resets the statistics of dev that what names.
func (a *Allocator) ResetStats(dev int, what StatsReset) error {
	op := "reset_peak_stats"
	if what == ResetAccumulated {
		op = "reset_accumulated_stats"
	}
	return a.withDevice(op, dev, func(d *device) error {
		if what&ResetPeak != 0 {
			d.cache.ResetPeak()
		}
		if what&ResetAccumulated != 0 {
			d.cache.ResetAccumulated()
		}
		return nil
	})
}

// CheckInvariants verifies every device's internal consistency.
func (a *Allocator) CheckInvariants() error {
	for _, d := range a.devs {
		d.enter()
		err := d.check()
		d.leave()
		if err != nil {
			return err
		}
	}
	return nil
}

// withThreadRelaxed runs fn with the calling OS thread in relaxed capture
// mode (cuda.WithThreadRelaxed): a failure to switch back is a warning.
func (d *device) withThreadRelaxed(fn func() error) error {
	return cuda.WithThreadRelaxed(d.drv, fn, d.restoreFailed)
}

// restoreFailed warns that the calling thread could not be switched back
// to capture mode prev after a driver allocation.
func (d *device) restoreFailed(prev cuda.CaptureMode, err error) {
	d.warn(fmt.Sprintf("restoring the calling thread's capture mode (%v) after a driver allocation on device %d failed (%v); the thread may stay in relaxed capture mode", prev, d.id, err))
}
