// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/graphs"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
)

var errorsIs = errors.Is

// capturing reports whether a capture may be under way on any device. It is
// the guard in front of every driver free, event query and synchronize.
// Unannounced captures of other devices are noticed to have ended when those
// devices next look (and by EmptyCache); until then this errs on the safe
// side.
func (d *device) capturing() bool {
	local := d.graphs.Underway(d.query)
	d.countCaptures()
	return local || d.a.underway.Load() > 0
}

// The capture gate.
//
// CUDA's capture rules are process-wide but each device has its own lock:
// a device could see no capture under way, then free memory or query
// events while a thread begins a capture on another device (device 0 runs
// its OOM retry while a graph is captured on device 1), and the driver would
// invalidate that capture. So each such unsafe section holds the
// allocator's gate shared, from its check that no capture is under way to
// its last driver call (enterUnsafe, leaveUnsafe), and BeginAllocateToPool,
// once its capture is counted, takes the gate exclusively once: the
// sections under way end before it returns (PyTorch begins capturing after
// the hook returns) and later ones see the capture. The gate is taken
// after d.mu and never the other way round (lockrank.go); the cache-hit
// paths do not take it. Unannounced captures cannot be waited for: nobody
// says when they begin.

// enterUnsafe reports whether no capture is under way and, if so, holds
// the gate shared until leaveUnsafe. d.mu is held.
func (d *device) enterUnsafe() bool {
	d.a.gate.RLock()
	if d.capturing() {
		d.a.gate.RUnlock()
		return false
	}
	d.inUnsafe = true
	return true
}

func (d *device) leaveUnsafe() {
	d.inUnsafe = false
	d.a.gate.RUnlock()
}

// countCaptures publishes the device's number of captures under way.
func (d *device) countCaptures() {
	if n := int64(d.graphs.Count()); n != d.counted {
		d.a.underway.Add(n - d.counted)
		d.counted = n
		d.frontBlocked(n)
		d.front.ctl.sync()
	}
}

// malloc is the allocation algorithm (see the package comment). d.mu is held.
func (d *device) malloc(size uint64, s cuda.Stream, capture uint64) (cuda.Ptr, error) {
	small, large := d.cache.Small, d.cache.Large
	capturing := false
	if capture != 0 || !d.graphs.Idle() || d.counted != 0 || d.a.underway.Load() > 0 || !d.ev.Idle() {
		small, large, capturing = d.mallocSetup(s, capture)
	} else {
		// No capture known or counted anywhere and no event pending:
		// mallocSetup would find nothing to do and the default pools.
		d.front.routed = false
	}
	var r pools.Request
	d.cache.SetRequest(&r, size, s, small, large)
	b, err := d.take(&r, capturing)
	if err != nil {
		return 0, err
	}
	if d.ev.Wanted() && !capturing && d.ev.WantedOn(s) && d.enterUnsafe() {
		// A miss of another stream met s's free pages uncertified: s is
		// marked at this request, hit or miss (vmem's stitching), under
		// the capture gate as any event query outside a capture.
		d.ev.MarkWanted(d.cache, s, d.recordable, d.ret)
		d.leaveUnsafe()
	}
	// A block borrowed from a private pool under OOM (grow) is not tracked.
	if d.front.tag = TagDefault; d.front.routed || !b.Pool.ID.IsDefault() {
		d.front.tag = d.privateTag(b)
	}
	// A block with spare bytes (handed out whole: its remainder was too
	// small to split) that shares its segment is left to Go (front.go,
	// "Spare bytes").
	if b.Size != r.Size && b.IsSplit() {
		d.front.tag = TagNone
	}
	b.Context = 0
	if d.rec != nil {
		d.rec.allocated(b, s)
	}
	return b.Ptr, nil
}

// mallocSetup is malloc's first part when a capture may be under way or
// events are pending: it reclaims capture-reused blocks or returns the
// blocks whose events completed, and routes the request. It returns the
// pools to allocate from and whether a capture may be under way.
//
//go:noinline
func (d *device) mallocSetup(s cuda.Stream, capture uint64) (small, large *pools.BlockPool, capturing bool) {
	// capture != 0: the stream captures, though Route has not yet counted it.
	capturing = capture != 0 || d.capturing()
	switch {
	case capturing:
		if d.graphs.Reuse.On {
			d.reclaimInCapture(s)
		}
	case !d.ev.Idle():
		d.processEvents()
	}
	small, large = d.cache.Small, d.cache.Large
	p := d.graphs.Route(s, capture, d.newPools)
	d.front.routedTo, d.front.routed = p, p != nil
	if p != nil {
		if d.front.route = TagNone; !p.Auto {
			d.front.route = PoolTag(p.Serial)
		}
		small, large = p.Small, p.Large
		capturing = true
		d.countCaptures() // Route may have met a new unannounced capture
	}
	return small, large, capturing
}

// processEvents returns the blocks whose pending frees' events have
// completed, when no capture is under way. d.mu is held.
//
//go:noinline
func (d *device) processEvents() {
	if !d.enterUnsafe() {
		return
	}
	d.graphs.Reuse.Drop()
	if err := d.ev.Process(d.ret); err != nil {
		// Not the malloc's failure: the blocks concerned stay queued.
		d.warn(driverError("malloc", err, "querying the events of pending frees on device %d (the blocks concerned wait for new events)", d.id).Error())
	}
	d.leaveUnsafe()
}

// grow finds memory for r when no cached block fits: a new segment, after
// freeing what may be freed, or an out-of-memory error.
func (d *device) grow(r *pools.Request, capturing bool) (*pools.Block, error) {
	if d.limit.pending {
		if err := d.applyFraction(); err != nil {
			return nil, err
		}
	}
	// Growth is slow anyway (driver calls): it holds the gate throughout,
	// so that a failed map can give back what it made at once.
	unsafe := !capturing && d.enterUnsafe()
	if unsafe {
		defer d.leaveUnsafe()
		if err := d.cache.GarbageCollect(d.freeSeg); err != nil {
			return nil, driverError("malloc", err, "freeing cached segments (garbage collection) on device %d", d.id)
		}
	}
	if b, err := d.newSegment(r, false); b != nil || err != nil {
		return b, err
	}
	if b := d.borrow(r); b != nil {
		return b, nil
	}
	if unsafe {
		if b, err := d.releaseAndRetry(r); b != nil || err != nil {
			return b, err
		}
	}
	return nil, d.outOfMemory(r)
}

// releaseAndRetry frees cached oversize segments, then all cached memory,
// retrying r after each. d.mu is held, and the gate (enterUnsafe).
func (d *device) releaseAndRetry(r *pools.Request) (*pools.Block, error) {
	ok, err := d.cache.ReleaseAvailable(r, d.freeFor(r.Pool))
	if err != nil {
		return nil, driverError("malloc", err, "freeing cached oversize segments on device %d", d.id)
	}
	if ok {
		if b, err := d.newSegment(r, false); b != nil || err != nil {
			return b, err
		}
	}
	if err := d.releaseCached("malloc"); err != nil {
		return nil, err
	}
	return d.newSegment(r, true)
}

// applyFraction applies the configuration's memory fraction, now that the
// device's capacity can be read. d.mu is held.
func (d *device) applyFraction() error {
	total, err := d.capacity()
	if err != nil {
		return driverError("malloc", err, "reading device %d's memory size for per_process_memory_fraction", d.id)
	}
	d.cache.SetFraction(d.limit.fraction, total)
	d.limit.pending = false
	return nil
}

// borrow is PyTorch's last resort before freeing cached memory: a request
// of the default pools takes a cached block of a live pool marked
// use_on_oom, which the block then belongs to (its free returns it there).
// It changes r's pool to that pool's. d.mu is held.
func (d *device) borrow(r *pools.Request) *pools.Block {
	if !r.Pool.ID.IsDefault() || r.Pool.Tag != 0 {
		return nil // already in a private pool, or a tag's: no other pool is tried
	}
	def := r.Pool
	for _, pp := range d.graphs.Pools.UseOnOOM() {
		r.Pool = pp.Large
		if def.Small {
			r.Pool = pp.Small
		}
		if b := d.cache.TakeFree(r); b != nil {
			return b
		}
	}
	r.Pool = def
	return nil
}

// newSegment allocates a segment for r from the driver, or from the
// pool's segment source. Running out of memory is (nil, nil): the caller
// decides what to try next.
func (d *device) newSegment(r *pools.Request, retry bool) (*pools.Block, error) {
	if retry {
		d.cache.Stats.NumAllocRetries++
	}
	src := d.sourceOf(r.Pool)
	// A tag's pools map pages whenever the driver can (tags.go).
	if src == nil && (d.vm.Expandable() || r.Pool.Tag != 0 && d.vm.VMM()) {
		// Outside the gate a capture may begin at any time: what a
		// failed map would release waits for the next release instead.
		return d.vm.Grow(*r, !d.inUnsafe || d.capturing())
	}
	if !d.cache.CanGrow(r.SegSize) {
		return nil, nil
	}
	var p cuda.Ptr
	var err error
	if src != nil {
		// Like a driver allocation, in relaxed capture mode: legal during
		// any capture.
		err = d.withThreadRelaxed(func() (err error) {
			p, err = src.Alloc(d.id, r.SegSize, r.Stream)
			return err
		})
		if err == nil && p == 0 {
			err = cuda.ErrOutOfMemory // PyTorch: a null segment is out of memory
		}
		if err != nil && !errors.Is(err, cuda.ErrOutOfMemory) {
			return nil, &Error{Op: "malloc", Kind: ErrDriver, Err: err,
				Msg: fmt.Sprintf("the segment source of pool {%d,%d} failed to allocate %d bytes on device %d", r.Pool.ID.A, r.Pool.ID.B, r.SegSize, d.id)}
		}
	} else if ra, ok := d.drv.(relaxedAllocator); ok {
		p, err = ra.MemAllocRelaxed(d.id, r.SegSize)
	} else {
		err = d.withThreadRelaxed(func() (err error) {
			p, err = d.drv.MemAlloc(d.id, r.SegSize)
			return err
		})
	}
	if errors.Is(err, cuda.ErrOutOfMemory) {
		return nil, nil
	}
	if err != nil {
		return nil, driverError("malloc", err, "allocating a %d-byte segment on device %d", r.SegSize, d.id)
	}
	b := d.cache.AddSegment(r, p)
	if d.rec != nil {
		d.rec.segmentAllocated(b.Seg)
	}
	return b, nil
}

// sourceOf returns the segment source of the pool p belongs to, or nil for
// the driver.
func (d *device) sourceOf(p *pools.BlockPool) SegmentSource {
	if p.ID.IsDefault() {
		return nil
	}
	if pp := d.graphs.Pools.Get(p.ID); pp != nil {
		return pp.Source
	}
	return nil
}

// freeFor returns the function that gives p's segments back: to the pool's
// segment source if it has one, else to the driver (d.freeSeg).
func (d *device) freeFor(p *pools.BlockPool) pools.FreeFunc {
	src := d.sourceOf(p)
	if src == nil {
		return d.freeSeg
	}
	return func(base cuda.Ptr, size uint64) error {
		if err := src.Free(d.id, base, size); err != nil {
			return err
		}
		d.recordSegmentFree(base, size)
		return nil
	}
}

// freeSegment gives a whole cached segment back to the driver (the cache's
// FreeFunc, d.freeSeg) and records it. d.mu is held.
func (d *device) freeSegment(base cuda.Ptr, size uint64) error {
	if err := d.drv.MemFree(d.id, base); err != nil {
		return err
	}
	d.recordSegmentFree(base, size)
	return nil
}

// recordSegmentFree tells the history of the free of the segment at base
// (still in the cache).
func (d *device) recordSegmentFree(base cuda.Ptr, _ uint64) {
	if d.rec != nil {
		if seg := d.cache.SegmentOf(base); seg != nil {
			d.rec.segmentFreed(seg)
		}
	}
}

// releaseCached waits for all pending frees, then returns every cached whole
// segment, and every free page of expandable segments, of the default pools
// and of the released private pools to the driver (PyTorch's
// release_cached_blocks). Never during capture. op names the caller's
// operation in errors (empty_cache, or malloc for the OOM retry).
func (d *device) releaseCached(op string) error {
	if err := d.syncAll(op); err != nil {
		return err
	}
	if err := d.vm.Release(op); err != nil {
		return err
	}
	free := d.freeSeg
	for _, p := range []*pools.BlockPool{d.cache.Large, d.cache.Small} {
		if err := d.cache.ReleasePool(p, free); err != nil {
			return driverError(op, err, "freeing cached segments on device %d", d.id)
		}
		if err := d.vm.UnmapFree(p); err != nil {
			return driverError(op, err, "unmapping the free pages of expandable segments on device %d", d.id)
		}
		d.cache.MarkReleased(p)
	}
	for _, pp := range d.graphs.Pools.Freeable() {
		if err := d.releasePrivate(op, pp); err != nil {
			return err
		}
	}
	return d.releaseTags(op)
}

// nothingToRelease reports whether releaseCached would find nothing to do:
// no event alive (pending or pooled) and no deferred free, no free marker
// of graph_capture_record_stream_reuse, no physical memory of expandable
// segments or stitching waiting, nothing to give back in the default pools
// (BlockPool.Releasable) and no released private pool. Each test reads a
// field. torch.cuda.graph calls empty_cache before every capture, after
// the interpreter has made the caches cold, and the full path's dozen
// functions then cost about 10 us on the development box (docs/hot-path.md,
// "During graph captures"). d.mu is held.
func (d *device) nothingToRelease() bool {
	return d.ev.Empty() && d.graphs.Reuse.Empty() &&
		d.vm.Idle() &&
		!d.cache.Large.Releasable() && !d.cache.Small.Releasable() && d.graphs.Pools.Released() == 0 &&
		!d.tagsReleasable()
}

// syncAll waits for the events of every pending free and returns those
// blocks to their pools (PyTorch's synchronize_and_free_events). Never
// during a capture.
func (d *device) syncAll(op string) error {
	d.graphs.Reuse.Drop()
	if err := d.ev.Synchronize(d.ret); err != nil {
		return driverError(op, err, "synchronizing the events of pending frees on device %d", d.id)
	}
	d.cache.Stats.NumSyncAllStreams++
	return nil
}

// releasePrivate gives back the cached segments and free pages of the
// released private pool pp, and forgets the pool once it holds nothing.
// Never during a capture.
func (d *device) releasePrivate(op string, pp *privatepool.Pool) error {
	if !d.a.tagActive(pp.Large.Tag) {
		return nil // its tag is paused: its memory stays as it is (pause.go)
	}
	for _, p := range []*pools.BlockPool{pp.Small, pp.Large} {
		if err := d.cache.ReleasePool(p, d.freeFor(p)); err != nil {
			return driverError(op, err, "freeing the segments of released pool {%d,%d} on device %d", pp.ID.A, pp.ID.B, d.id)
		}
		if err := d.vm.UnmapFree(p); err != nil {
			return driverError(op, err, "unmapping the pages of released pool {%d,%d} on device %d", pp.ID.A, pp.ID.B, d.id)
		}
		d.cache.MarkReleased(p)
	}
	if pp.Segments() == 0 {
		small, large := pp.Small, pp.Large
		d.graphs.Pools.Drop(pp)
		d.cache.DropPool(small)
		d.cache.DropPool(large)
	}
	return nil
}

// freeUsed queues the released block b behind its other streams' uses
// (freeBlock's uncommon case).
//
//go:noinline
func (d *device) freeUsed(b *pools.Block) error {
	if !d.enterUnsafe() {
		// No event may be recorded for later query during a capture.
		d.deferFree(b)
		return nil
	}
	defer d.leaveUnsafe()
	if d.useCapturing(b) {
		d.deferFree(b)
		return nil
	}
	if err := d.ev.Insert(b); err != nil {
		// The block stays queued (or deferred) for a later try: nothing is
		// reused early and nothing is lost, but tell the caller.
		return driverError("free", err, "recording events for the streams that use %#x", uintptr(b.Ptr))
	}
	return nil
}

// deferFree parks the released block b until no capture is under way,
// noting its free markers for graph_capture_record_stream_reuse.
func (d *device) deferFree(b *pools.Block) {
	d.ev.Defer(b)
	if d.graphs.Reuse.On {
		if err := d.graphs.Reuse.NoteFree(d.graphDriver(), d.id, b); err != nil {
			d.warnCaptureGraph(err)
		}
	}
}

// reclaimInCapture returns to their pools the blocks allocated on s that
// graph_capture_record_stream_reuse proves unused (graphs.Reuse.Reclaim).
// Called by malloc during a capture. d.mu is held.
func (d *device) reclaimInCapture(s cuda.Stream) {
	if err := d.graphs.Reuse.Reclaim(d.graphDriver(), d.id, s, d.ev, d.ret); err != nil {
		d.warnCaptureGraph(err)
	}
}

// graphDriver is the driver's capture-topology queries, nil without them.
func (d *device) graphDriver() graphs.GraphDriver {
	gd, _ := d.drv.(graphs.GraphDriver)
	return gd
}

// warnCaptureGraph reports a failed capture-graph query: the blocks
// concerned wait for the capture's end, as without the option.
func (d *device) warnCaptureGraph(err error) {
	if errorsIs(err, cuda.ErrNotSupported) {
		d.warn("graph_capture_record_stream_reuse:True has no effect: the CUDA driver lacks cuGraphNodeGetDependencies or cuStreamGetCaptureInfo_v2")
		return
	}
	var qe *graphs.QueryError
	if errors.As(err, &qe) {
		d.warn(driverError("capture reuse", qe.Err, "reading the capture graph of stream %#x (record_stream'd blocks wait for the capture's end)", uintptr(qe.Stream)).Error())
		return
	}
	d.warn(driverError("capture reuse", err, "reading the capture graph").Error())
}

// useCapturing reports, when nobody announces captures, whether one of b's
// use streams is capturing: an event recorded there could not be queried.
func (d *device) useCapturing(b *pools.Block) bool {
	if d.a.announced.Load() {
		return false
	}
	capturing := false
	b.Uses.Each(func(s cuda.Stream) {
		if st, _, err := d.drv.StreamCaptureInfo(d.id, s); err == nil && st != cuda.CaptureNone {
			capturing = true
		}
	})
	return capturing
}

// begin and end bracket an operation whose caller passed context ctx,
// for the history (recorder.go).
func (d *device) begin(ctx uint64, need HistoryLevel) {
	if d.rec != nil {
		d.rec.begin(ctx, need)
	}
}

func (d *device) end() {
	if d.rec != nil {
		d.rec.end()
	}
}

// returnBlock puts a block whose uses are over back in its pool; its
// context goes. (freeBlock has these lines written out.)
func (d *device) returnBlock(b *pools.Block) {
	if d.rec != nil {
		d.rec.freeCompleted(b)
	}
	b.Context = 0
	d.cache.Return(b)
}

// capacity returns the device's total memory, read once.
func (d *device) capacity() (uint64, error) {
	if d.limit.total == 0 {
		_, total, err := d.drv.MemGetInfo(d.id)
		if err != nil {
			return 0, err
		}
		d.limit.total = total
	}
	return d.limit.total, nil
}

// outOfMemory counts the failure and builds PyTorch 2.11's message; the
// error carries the numbers PyTorch's out-of-memory observers receive.
func (d *device) outOfMemory(r *pools.Request) error {
	d.cache.Stats.NumOOMs++
	free, total, err := d.drv.MemGetInfo(d.id)
	if d.rec != nil {
		d.rec.outOfMemory(*r, free)
	}
	info := &OOMInfo{Device: d.id, Size: r.SegSize, Total: total, Free: free}
	var b strings.Builder
	fmt.Fprintf(&b, "CUDA out of memory. Tried to allocate %s. GPU %d", FormatSize(r.SegSize), d.id)
	if err == nil {
		fmt.Fprintf(&b, " has a total capacity of %s of which %s is free. ", FormatSize(total), FormatSize(free))
	} else {
		fmt.Fprintf(&b, " (memory info unavailable: %v). ", err)
	}
	if pl, ok := d.drv.(processLister); ok {
		if procs, err := pl.DeviceProcesses(d.id); err == nil {
			for _, p := range procs {
				if int(p.PID) == os.Getpid() {
					fmt.Fprintf(&b, "Including non-PyTorch memory, this process has %s memory in use. ", FormatSize(p.Bytes))
				} else {
					fmt.Fprintf(&b, "Process %d has %s memory in use. ", p.PID, FormatSize(p.Bytes))
				}
			}
		}
	}
	if allowed, ok := d.cache.Allowed(); ok {
		info.Total = allowed
		if err != nil || allowed < total {
			fmt.Fprintf(&b, "%s allowed; ", FormatSize(allowed))
		}
	}
	st := d.cache.ReadStats()
	allocated := uint64(st.AllocatedBytes[pools.StatAll].Current)
	reserved := uint64(st.ReservedBytes[pools.StatAll].Current)
	// Free memory cached in private pools counts as allocated: only their
	// graphs can use it.
	var private uint64
	d.graphs.Pools.Each(func(p *privatepool.Pool) {
		for _, bp := range [2]*pools.BlockPool{p.Small, p.Large} {
			bp.Blocks.Ascend(func(blk *pools.Block) bool { private += blk.Size; return true })
		}
	})
	fmt.Fprintf(&b, "Of the allocated memory %s is allocated by PyTorch, ", FormatSize(allocated+private))
	if private > 0 {
		fmt.Fprintf(&b, "with %s allocated in private pools (e.g., CUDA Graphs), ", FormatSize(private))
	}
	unallocated := uint64(0)
	if reserved > allocated+private {
		unallocated = reserved - allocated - private
	}
	fmt.Fprintf(&b, "and %s is reserved by PyTorch but unallocated.", FormatSize(unallocated))
	b.WriteString(" If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
	return &Error{Op: "malloc", Kind: ErrOutOfMemory, Msg: b.String(), OOM: info}
}

// FormatSize renders a byte count as PyTorch's messages do.
func FormatSize(n uint64) string {
	switch {
	case n <= 1024:
		return fmt.Sprintf("%d bytes", n)
	case n <= 1<<20:
		return fmt.Sprintf("%.2f KiB", float64(n)/1024)
	case n <= 1<<30:
		return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20))
	default:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	}
}

// check verifies the device's invariants beyond the cache's own: the
// private pools' count, and blocks waiting on events are neither free nor
// allocated.
func (d *device) check() error {
	if err := d.cache.Check(); err != nil {
		return fmt.Errorf("device %d: %w", d.id, err)
	}
	if err := d.graphs.Pools.Check(); err != nil {
		return fmt.Errorf("device %d: %w", d.id, err)
	}
	var err error
	d.ev.Each(func(b *pools.Block) {
		if err == nil && (b.Allocated || !b.Active()) {
			err = fmt.Errorf("device %d: block %#x waits on events but is allocated=%v active=%v", d.id, b.Ptr, b.Allocated, b.Active())
		}
	})
	return err
}

func (d *device) mustCheck() {
	if err := d.check(); err != nil {
		panic("cudapool: invariant violated (debug_checks): " + err.Error())
	}
}

// take finds r its block (a cached free one, else one the front held, else
// new memory: grow) and allocates from it. d.mu is held.
func (d *device) take(r *pools.Request, capturing bool) (*pools.Block, error) {
	b := d.cache.TakeFree(r)
	if b == nil {
		if b = d.heldFit(r); b == nil {
			var err error
			if b, err = d.grow(r, capturing); err != nil {
				return nil, err
			}
		}
	}
	return d.cache.Allocate(r, b), nil
}
