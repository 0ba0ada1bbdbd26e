// Package allocator is cudapool's caching allocator: the orchestration of
// the block cache (pools), deferred frees (events), private pools
// (privatepool) and capture routing (graphs) over a CUDA driver.
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
//     a new segment (with expandable_segments:True, map pages into the
//     pool's reserved range instead: package vmem); else, for a request
//     of the default pools, take a cached block of a user pool marked
//     use_on_oom (mempool.go); else free cached oversize segments and
//     retry; else wait for all pending events, free
//     every cached whole segment and unmap every free page (and the released
//     private pools') and retry. Steps that free memory are skipped while a
//     capture is under way.
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
// the callers' contexts on blocks, segments and entries) is in history.go;
// snapshots in snapshot.go.
package allocator

import (
	"errors"
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
	cfgMu      sync.Mutex // serializes Configure
	cfg        atomic.Pointer[Config]
	// underway counts the captures the devices believe under way. CUDA's
	// capture rules are process-wide (a free or synchronize on one device
	// can invalidate a capture on another), so every device consults it.
	underway atomic.Int64
	// gate orders the devices' unsafe sections (freeing memory, querying
	// and recording events outside captures) with announced capture
	// begins; see device.go.
	gate sync.RWMutex
	// onWarning reports conditions worth a message but not an error (each
	// message once); nil: stderr.
	onWarning atomic.Pointer[func(string)]
	warned    sync.Map
	hist      history // memory history (history.go)
	front     frontCtl
}

// device is one GPU's allocator state.
//
// The fields a cache-hit malloc and free read come first, together: after
// an eviction each cache line is a miss. Go puts an 8-byte header before an
// object of this size, so the struct starts 8 bytes into a line: mu through
// newPools fill the first line, underway and graphs the second, hist's
// first fields the third.
type device struct {
	mu    sync.Mutex
	cache *pools.Cache    // guarded by mu
	ev    *events.Tracker // guarded by mu
	// counted is this device's contribution to underway; guarded by mu.
	counted int64
	// inUnsafe: this device holds the gate shared (enterUnsafe); guarded
	// by mu.
	inUnsafe bool
	debug    bool // guarded by mu
	// Built once so that passing them costs no allocation.
	query    func(cuda.Stream) (cuda.CaptureStatus, uint64, error)
	newPools privatepool.NewPools
	underway *atomic.Int64 // the allocator's count of captures under way
	graphs   graphs.Router // guarded by mu
	rec      recorder      // the memory history (nil: off); guarded by mu
	// front is the allocator's Front (nil: none), set before use;
	// frontBuf receives its log, guarded by mu (front.go). frontFlag, if
	// not nil, is where front's Pending(id) reads (a FrontFlags).
	front     Front
	frontFlag *int32
	frontHeld *int32 // with frontFlag: where Holding(id) reads
	frontBuf  []PendingFree
	fc        *frontCtl // the allocator's
	// tag is the front tag of the last malloc's block (routing.go), set
	// when it succeeds; routed: that malloc routed to the private pool
	// routedTo (which only mallocSetup writes, so that the usual malloc
	// stores no pointer). Guarded by mu.
	tag      uint32
	routed   bool
	routedTo *privatepool.Pool
	// routesOK: the front routes the device's allocate-to-pool phases;
	// routeBuf: pushRoutes's scratch; blocked: counted in fc.blocked
	// (routing.go). Guarded by mu.
	routesOK bool
	routeBuf []FrontRoute
	blocked  bool

	id        int
	drv       Driver
	announced *atomic.Bool  // the allocator's: captures are announced
	gate      *sync.RWMutex // the allocator's gate (device.go)
	total     uint64        // device capacity; guarded by mu (0: not yet read)

	// vm is the device's virtual memory: expandable segments and
	// stitching (virtual.go); guarded by mu.
	vm   virtualMemory
	warn func(string)

	// fraction is the memory fraction the configuration asks for
	// (per_process_memory_fraction), applied when the device next grows,
	// since that needs the device's capacity from the driver;
	// fractionPending says it is not yet applied. Both guarded by mu.
	fraction        float64
	fractionPending bool

	// Built once so that passing them costs no allocation.
	freeSeg pools.FreeFunc
	ret     func(*pools.Block)
}

// New returns an allocator for every device of drv.
func New(drv Driver, cfg Config) (*Allocator, error) {
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, driverError("init", err, "counting devices")
	}
	a := &Allocator{drv: drv}
	a.cfg.Store(&cfg)
	a.hist.publish()
	for i := 0; i < n; i++ {
		d := &device{id: i, drv: drv, underway: &a.underway, announced: &a.announced, gate: &a.gate, cache: pools.NewCache(cfg.Pools), ev: events.New(drv, i)}
		a.hist.devs = append(a.hist.devs, &deviceHistory{labels: &a.hist.labels})
		d.fc = &a.front
		d.debug = cfg.DebugChecks
		d.freeSeg = d.freeSegment
		d.newPools = func(id pools.PoolID) (*pools.BlockPool, *pools.BlockPool) {
			return d.cache.NewPool(true, id), d.cache.NewPool(false, id)
		}
		d.query = func(s cuda.Stream) (cuda.CaptureStatus, uint64, error) {
			return drv.StreamCaptureInfo(d.id, s)
		}
		d.ret = d.returnBlock
		d.graphs.Reuse.On = cfg.GraphCaptureRecordStreamReuse
		d.fraction, d.fractionPending = cfg.MemoryFraction, cfg.MemoryFractionSet
		d.warn = a.warn
		d.vm = d.newVirtualMemory(drv, &cfg)
		a.devs = append(a.devs, d)
	}
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
		d.lock()
		d.cache.SetConfig(cfg.Pools)
		d.debug = cfg.DebugChecks
		d.vm.Configure(vmemConfig(&cfg))
		d.graphs.Reuse.On = cfg.GraphCaptureRecordStreamReuse
		if cfg.MemoryFractionSet {
			d.fraction, d.fractionPending = cfg.MemoryFraction, true
		}
		d.mu.Unlock()
	}
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

// device returns device dev, or the error for a device that does not exist.
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

// Malloc allocates size bytes on device dev for use on stream s. Size 0
// returns a nil pointer and no error, as PyTorch expects.
func (a *Allocator) Malloc(dev int, size uint64, s cuda.Stream) (cuda.Ptr, error) {
	return a.MallocCtx(dev, size, s, 0)
}

// MallocCtx is Malloc with the id of the caller's context (0: none), gathered
// when GatherMask has GatherAlloc (see history.go).
func (a *Allocator) MallocCtx(dev int, size uint64, s cuda.Stream, ctx uint64) (cuda.Ptr, error) {
	d, err := a.device("malloc", dev)
	if err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, nil
	}
	if size >= pools.MaxRequest {
		return 0, tooLarge()
	}
	if a.cachingOff.Load() {
		return a.mallocUncached(d, size)
	}
	capture, err := a.unannouncedCapture(dev, s)
	if err != nil {
		return 0, err
	}
	d.lock()
	d.begin(ctx, HistoryState)
	p, err := d.malloc(size, s, capture)
	d.end()
	if d.debug {
		d.mustCheck()
	}
	d.mu.Unlock()
	return p, err
}

// tooLarge is PyTorch's error, word for word, for a request of 1 EiB or
// more: an out-of-memory error (torch.OutOfMemoryError), counted nowhere.
func tooLarge() error {
	return newError("malloc", ErrOutOfMemory, "CUDA out of memory. Tried to allocate more than 1EB memory.")
}

// unannouncedCapture returns the capture sequence s belongs to (0: none)
// when nobody announces captures; then it asks the driver, outside any lock.
// Once captures are announced it returns 0 without a driver call.
func (a *Allocator) unannouncedCapture(dev int, s cuda.Stream) (uint64, error) {
	if a.announced.Load() {
		return 0, nil
	}
	st, id, err := a.drv.StreamCaptureInfo(dev, s)
	if err != nil {
		return 0, driverError("malloc", err, "querying the capture status of stream %#x", uintptr(s))
	}
	if st == cuda.CaptureNone {
		return 0, nil
	}
	return id, nil
}

// Free returns the block at p. size, if not zero, must be the size that was
// asked for (PyTorch passes it back); a mismatch frees nothing.
func (a *Allocator) Free(dev int, p cuda.Ptr, size uint64) error {
	return a.FreeCtx(dev, p, size, 0)
}

// FreeCtx is Free with the id of the caller's context (0: none), gathered
// when GatherMask has GatherFree (see history.go).
func (a *Allocator) FreeCtx(dev int, p cuda.Ptr, size uint64, ctx uint64) error {
	d, err := a.device("free", dev)
	if err != nil {
		return err
	}
	d.lock()
	d.begin(ctx, HistoryAll)
	err = d.freeLocked(p, size)
	d.end()
	if d.debug {
		d.mustCheck()
	}
	d.mu.Unlock()
	if err != nil {
		if found, ferr := a.freeUncached(p); found {
			return ferr
		}
		return a.explainFree(err)
	}
	return nil
}

// FreeAny frees the block at p on whichever device holds it (a caller that
// does not know the device). size is checked as in Free. It allocates
// nothing unless it fails.
func (a *Allocator) FreeAny(p cuda.Ptr, size uint64) error { return a.FreeAnyCtx(p, size, 0) }

// FreeAnyCtx is FreeAny with the free's context id (as for FreeCtx).
func (a *Allocator) FreeAnyCtx(p cuda.Ptr, size uint64, ctx uint64) error {
	d, b := a.find(p)
	if d == nil {
		if found, err := a.freeUncached(p); found {
			return err
		}
		return a.explainUnknown("free", -1, p)
	}
	d.begin(ctx, HistoryAll)
	err := d.freeBlock(b, size)
	d.end()
	if d.debug {
		d.mustCheck()
	}
	d.mu.Unlock()
	return err
}

// explainFree replaces the error of a free that found no block by one that
// says what the pointer is; it runs without any device lock held, since it
// looks at every device.
func (a *Allocator) explainFree(err error) error {
	var u unknownAt
	if errors.As(err, &u) {
		return a.explainUnknown("free", u.dev, u.p)
	}
	return err
}

// freeLocked frees the block at p. d.mu is held.
func (d *device) freeLocked(p cuda.Ptr, size uint64) error {
	b := d.cache.Lookup(p)
	if b == nil {
		return d.notAllocated(p)
	}
	return d.freeBlock(b, size)
}

// notAllocated is freeLocked's error for a pointer d has not allocated.
//
//go:noinline
func (d *device) notAllocated(p cuda.Ptr) error {
	return &Error{Op: "free", Kind: ErrUnknownPointer, Msg: "pointer not allocated on this device", Err: unknownAt{d.id, p}}
}

// freeBlock frees the allocated block b, whose requested size must be size
// unless size is 0: it returns the block, or queues it behind its other
// streams' uses. d.mu is held. The common case (no other stream used the
// block) is straight-line code; the rest is out of line.
func (d *device) freeBlock(b *pools.Block, size uint64) error {
	if size != 0 && size != b.Requested {
		return sizeMismatch(b, size)
	}
	d.cache.Release(b)
	if d.rec != nil {
		d.rec.freeRequested(b)
	}
	if !b.Uses.Empty() {
		return d.freeUsed(b)
	}
	// d.returnBlock(b), written out (over the inliner's budget).
	if d.rec != nil {
		d.rec.freeCompleted(b)
	}
	b.Context = 0
	d.cache.Return(b)
	return nil
}

//go:noinline
func sizeMismatch(b *pools.Block, size uint64) error {
	return newError("free", ErrInvalidArgument, "pointer %#x was allocated with %d bytes, freed with %d; not freed", uintptr(b.Ptr), b.Requested, size)
}

// unknownAt carries the device and pointer of a free that found no block.
type unknownAt struct {
	dev int
	p   cuda.Ptr
}

func (u unknownAt) Error() string {
	return fmt.Sprintf("pointer %#x on device %d", uintptr(u.p), u.dev)
}

// explainUnknown builds the error for a pointer that device dev has not
// allocated: freed already, another device's, inside an allocation, or
// never seen. It locks the devices one at a time.
func (a *Allocator) explainUnknown(op string, dev int, p cuda.Ptr) error {
	for _, o := range a.devs {
		o.lock()
		b, seg := o.cache.Lookup(p), o.cache.SegmentAt(p)
		var inside *pools.Block
		if b == nil && seg != nil {
			for x := seg.Head; x != nil; x = x.Next {
				if p >= x.Ptr && p < x.End() {
					inside = x
				}
			}
		}
		o.mu.Unlock()
		switch {
		case b != nil && o.id != dev:
			return newError(op, ErrWrongDevice, "pointer %#x was allocated on device %d, not device %d", uintptr(p), o.id, dev)
		case inside != nil && inside.Ptr == p && !inside.Allocated:
			return newError(op, ErrAlreadyFreed, "pointer %#x on device %d is not allocated (already freed?)", uintptr(p), o.id)
		case inside != nil:
			return newError(op, ErrUnknownPointer, "pointer %#x lies inside the block at %#x on device %d, not at its start", uintptr(p), uintptr(inside.Ptr), o.id)
		}
	}
	if dev >= 0 {
		return newError(op, ErrUnknownPointer, "pointer %#x was not allocated by cudapool on device %d (already freed, or never allocated)", uintptr(p), dev)
	}
	return newError(op, ErrUnknownPointer, "pointer %#x was not allocated by cudapool (already freed, or never allocated)", uintptr(p))
}

// find locks the device holding the allocated block at p and returns both;
// the caller unlocks. It returns nil if no device has allocated p.
func (a *Allocator) find(p cuda.Ptr) (*device, *pools.Block) {
	for _, d := range a.devs {
		d.lock()
		if b := d.cache.Lookup(p); b != nil {
			return d, b
		}
		d.mu.Unlock()
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
	d.mu.Unlock()
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
	d.mu.Unlock()
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
		d.mu.Unlock()
		return base, size, nil
	}
	for _, d := range a.devs {
		d.lock()
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
		d.mu.Unlock()
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
// alone and reported in the error.
func (a *Allocator) EmptyCache() error { return a.EmptyCacheCtx(0) }

// EmptyCacheCtx is EmptyCache with the id of the caller's context (0: none),
// gathered when GatherMask has GatherRelease (see history.go).
func (a *Allocator) EmptyCacheCtx(ctx uint64) error {
	// First let every device notice the unannounced captures that ended.
	for _, d := range a.devs {
		d.lock()
		d.capturing()
		d.mu.Unlock()
	}
	var first error
	for _, d := range a.devs {
		d.lock()
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
		d.mu.Unlock()
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
	d, err := a.device("set_memory_fraction", dev)
	if err != nil {
		return err
	}
	if !(fraction >= 0 && fraction <= 1) {
		return newError("set_memory_fraction", ErrInvalidArgument, "fraction %v is not in [0, 1]", fraction)
	}
	d.lock()
	defer d.mu.Unlock()
	total, err := d.capacity()
	if err != nil {
		return driverError("set_memory_fraction", err, "reading device %d's memory size", dev)
	}
	d.cache.SetFraction(fraction, total)
	d.fractionPending = false // this call overrides the configuration's
	return nil
}

// BeginAllocateToPool routes the allocations on dev whose stream filter
// accepts (nil: all streams) to the private pool id until EndAllocateToPool.
func (a *Allocator) BeginAllocateToPool(dev int, id PoolID, filter func(cuda.Stream) bool) error {
	return a.BeginAllocateToPoolRef(dev, id, filter, FilterRef{})
}

func (a *Allocator) beginAllocateToPool(dev int, id PoolID, filter func(cuda.Stream) bool, ref FilterRef) error {
	d, err := a.device("begin_allocate_to_pool", dev)
	if err != nil {
		return err
	}
	d.lock()
	defer d.mu.Unlock()
	if err := d.graphs.BeginRef(id, filter, ref, d.newPools); err != nil {
		return poolError("begin_allocate_to_pool", err)
	}
	d.pushRoutes()
	a.announced.Store(true)
	d.countCaptures()
	// The capture is counted: wait for the unsafe sections of the other
	// devices that began before it was, so that none is still freeing
	// memory or querying events when the caller begins capturing.
	a.gate.Lock()
	a.gate.Unlock() // an empty critical section: a barrier
	return nil
}

// EndAllocateToPool stops routing to the pool id.
func (a *Allocator) EndAllocateToPool(dev int, id PoolID) error {
	d, err := a.device("end_allocate_to_pool", dev)
	if err != nil {
		return err
	}
	d.lock()
	defer d.mu.Unlock()
	if err := d.graphs.End(id); err != nil {
		return poolError("end_allocate_to_pool", err)
	}
	d.pushRoutes()
	d.countCaptures()
	d.trimUnused(id)
	return nil
}

// ReleasePool drops one holder of the pool id. When none is left, its
// cached memory goes back to the driver at the next empty_cache or OOM retry.
func (a *Allocator) ReleasePool(dev int, id PoolID) error {
	d, err := a.device("release_pool", dev)
	if err != nil {
		return err
	}
	d.lock()
	defer d.mu.Unlock()
	if err := d.graphs.Release(id); err != nil {
		return poolError("release_pool", err)
	}
	return nil
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
	d, err := a.device("memory_stats", dev)
	if err != nil {
		return pools.Stats{}, err
	}
	d.lock()
	defer d.mu.Unlock()
	return d.cache.ReadStats(), nil
}

// ResetPeakStats sets every peak statistic of dev to its current value.
func (a *Allocator) ResetPeakStats(dev int) error {
	d, err := a.device("reset_peak_stats", dev)
	if err != nil {
		return err
	}
	d.lock()
	d.cache.ResetPeak()
	d.mu.Unlock()
	return nil
}

// ResetAccumulatedStats zeroes the accumulated statistics of dev.
func (a *Allocator) ResetAccumulatedStats(dev int) error {
	d, err := a.device("reset_accumulated_stats", dev)
	if err != nil {
		return err
	}
	d.lock()
	d.cache.ResetAccumulated()
	d.mu.Unlock()
	return nil
}

// CheckInvariants verifies every device's internal consistency.
func (a *Allocator) CheckInvariants() error {
	for _, d := range a.devs {
		d.lock()
		err := d.check()
		d.mu.Unlock()
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

// PendingFree is a free the caller deferred (the C ABI queues PyTorch's
// frees and hands them over with the next call; see capi). capi's C struct
// cp_pending_free has the same layout: change both together.
type PendingFree struct {
	Dev   int // -1: unknown, the device that holds Ptr (FreeAny)
	Ptr   cuda.Ptr
	Size  uint64
	Ctx   uint64  // the free's context id, as for FreeCtx (0: none)
	Op    FrontOp // OpFree, except in a Front's log (front.go)
	Count uint64  // OpCycles: how many
}

// MallocAfterFrees performs the pending frees, then the malloc (whose context
// id is ctx, as for MallocCtx). The frees of dev, and those of unknown
// device (Dev -1) that dev holds, happen under the same lock hold as the
// malloc, so a malloc+free pair costs one lock and one call. It returns the
// malloc's error and, separately, the first failed free's.
func (a *Allocator) MallocAfterFrees(dev int, size uint64, s cuda.Stream, ctx uint64, frees []PendingFree) (p cuda.Ptr, err, freeErr error) {
	p, _, err, freeErr = a.MallocTracked(dev, size, s, ctx, frees)
	return p, err, freeErr
}

// MallocTracked is MallocAfterFrees that also reports whether the block may
// be tracked by the allocator's Front (front.go): a default-pool block
// allocated while the front may serve.
//
// It is the PyTorch class's path (a queued free or two, then a malloc), so
// its common case is kept short: the rare cases (a request MallocCtx
// refuses or sends to the driver, captures nobody announces, frees of other
// devices, errors) leave it through functions of their own.
func (a *Allocator) MallocTracked(dev int, size uint64, s cuda.Stream, ctx uint64, frees []PendingFree) (p cuda.Ptr, track uint32, err, freeErr error) {
	// size-1 >= MaxRequest-1: size is 0 or at least MaxRequest.
	if uint(dev) >= uint(len(a.devs)) || size-1 >= pools.MaxRequest-1 || a.cachingOff.Load() || a.uncN.Load() != 0 {
		return a.mallocTrackedElse(dev, size, s, ctx, frees)
	}
	var capture uint64
	if !a.announced.Load() {
		if capture, err = a.unannouncedCapture(dev, s); err != nil {
			return 0, TagNone, err, a.FreeMany(frees)
		}
	}
	d := a.devs[dev]
	// done marks the frees of unknown device done under the lock (only the
	// first 128 are tried on dev first: the C queue holds 65).
	var done [2]uint64
	others := 0
	d.lockMalloc()
	for i := range frees {
		f := &frees[i]
		if f.Dev != dev {
			if d.freeUnknownDevice(f, i, &done, &freeErr) {
				others++
			}
			continue
		}
		d.begin(f.Ctx, HistoryAll)
		var e error
		if b := d.cache.Lookup(f.Ptr); b != nil {
			e = d.freeBlock(b, f.Size)
		} else {
			e = d.notAllocated(f.Ptr)
		}
		if e != nil && freeErr == nil {
			freeErr = e
		}
	}
	d.begin(ctx, HistoryState)
	p, err = d.malloc(size, s, capture)
	d.end()
	if err == nil && d.front != nil && a.front.on.Load() {
		track = d.tag
	}
	if d.debug {
		d.mustCheck()
	}
	d.mu.Unlock()
	if others > 0 || freeErr != nil {
		freeErr = a.freeOthers(dev, frees, &done, freeErr)
	}
	return p, track, err, freeErr
}

// mallocTrackedElse is MallocTracked for a device that does not exist, a
// size of 0 or 1 EiB or more, or while blocks go to the driver (uncached):
// the frees, then MallocCtx.
//
//go:noinline
func (a *Allocator) mallocTrackedElse(dev int, size uint64, s cuda.Stream, ctx uint64, frees []PendingFree) (p cuda.Ptr, track uint32, err, freeErr error) {
	freeErr = a.FreeMany(frees)
	p, err = a.MallocCtx(dev, size, s, ctx)
	return p, TagNone, err, freeErr
}

// freeUnknownDevice performs, under MallocTracked's lock of d, the free f
// (the i-th) of another device than d's or of unknown device (Dev -1): one
// of the latter that d holds is done here and marked in done, its error
// kept in *freeErr if that is the first. It reports whether f is left for
// freeOthers.
//
//go:noinline
func (d *device) freeUnknownDevice(f *PendingFree, i int, done *[2]uint64, freeErr *error) bool {
	var b *pools.Block
	if f.Dev == -1 && i < 128 {
		b = d.cache.Lookup(f.Ptr)
	}
	if b == nil {
		return true
	}
	d.begin(f.Ctx, HistoryAll)
	if e := d.freeBlock(b, f.Size); e != nil && *freeErr == nil {
		*freeErr = e
	}
	done[i/64] |= 1 << (i % 64)
	return false
}

// freeOthers ends MallocTracked after the lock hold: it performs the frees
// of other devices (those not marked in done), and returns the first error
// of all the frees (first, if not nil, is that of the lock hold's), made to
// say what a pointer that was not found is.
//
//go:noinline
func (a *Allocator) freeOthers(dev int, frees []PendingFree, done *[2]uint64, first error) error {
	for i := range frees {
		if f := &frees[i]; f.Dev != dev && (i >= 128 || done[i/64]&(1<<(i%64)) == 0) {
			if e := a.freePending(f); e != nil && first == nil {
				first = e
			}
		}
	}
	if first != nil {
		first = a.explainFree(first)
	}
	return first
}

// FreeMany performs deferred frees and returns the first error.
func (a *Allocator) FreeMany(frees []PendingFree) error {
	var first error
	for i := range frees {
		if err := a.freePending(&frees[i]); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (a *Allocator) freePending(f *PendingFree) error {
	if f.Dev == -1 {
		return a.FreeAnyCtx(f.Ptr, f.Size, f.Ctx)
	}
	return a.FreeCtx(f.Dev, f.Ptr, f.Size, f.Ctx)
}
