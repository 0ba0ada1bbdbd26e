// SPDX-License-Identifier: Apache-2.0

package allocator_test

// The soak: randomized operations from many goroutines at once, with the
// invariant checker after every batch (make soak runs 10^7 operations,
// SOAK_OPS sets the count; make test runs about 10^5).
//
// # Design
//
// Each phase is one allocator over a two-device simulator with a
// configuration of its own (ordinary or expandable segments, stitching,
// garbage collection, rounding) and either announced captures (as PyTorch makes
// them) or unannounced ones (a C program calling cuStreamBeginCapture). A
// phase runs in batches: every worker goroutine (locked to its OS thread,
// since capture modes are per thread) performs its share of the batch's
// operations on its own device and streams, ends any capture it has open,
// and stops; then every invariant is checked with nothing running.
//
// The simulator has no memory contents, so the delayed reads of the GPU
// soak become events: when a worker frees a block that another of its
// streams still reads (record_stream, then work submitted on that stream),
// it records its own "guard" event on the reading stream first. Whenever a
// malloc returns memory overlapping a guarded range, the guard must have
// completed; otherwise the allocator handed out memory a kernel still
// reads (the corruption the GPU soak detects by content). The freeing
// worker allocates again at once on the freeing stream, as in the race
// PyTorch's allocator loses under thread-local captures.
//
// Unannounced captures are unknown to the allocator until their first
// allocation, so in those phases a worker starts a capture and makes that
// allocation while holding gate exclusively, and every other operation
// that may free memory to the driver holds it shared: a capture is never
// under way unseen while memory is being freed (the simulator would count
// a violation, as CUDA would invalidate the capture).

import (
	"fmt"
	"math"
	"math/rand"
	"os"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/pools"
)

const (
	soakDevices = 2
	soakWorkers = 8
	soakBatch   = 256 // operations per worker per batch
	soakMemory  = 1 * GiB
	soakMaxLive = 24 // live allocations per worker
	// soakMaxAutoPools bounds each worker's unannounced captures: their
	// pools are never released (nobody says when such a graph dies).
	soakMaxAutoPools = 16
	soakMaxGraphs    = 4 // graphs a worker keeps alive
)

// soakOps is SOAK_OPS, else 10^5 (2*10^4 with -short).
func soakOps(t *testing.T) int {
	if v := os.Getenv("SOAK_OPS"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		require.NoError(t, err, "SOAK_OPS=%q", v)
		require.GreaterOrEqual(t, f, 1.0)
		return int(f)
	}
	if testing.Short() {
		return 2e4
	}
	return 1e5
}

type soakPhase struct {
	name      string
	conf      string
	announced bool
	// faults: driver calls fail at random (cuda/sim/fault), so driver
	// errors are expected results; every other check still holds, and
	// once the faults stop, nothing may be lost.
	faults bool
}

var soakPhases = []soakPhase{
	{"ordinary", "expandable_segments:False", true, false},
	{"expandable", "expandable_segments:True,stitch:False", true, false},
	{"unannounced", "expandable_segments:False,max_split_size_mb:40", false, false},
	{"gc+rounding", "expandable_segments:False,garbage_collection_threshold:0.7,roundup_power2_divisions:4", true, false},
	{"expandable+gc+unannounced", "expandable_segments:True,stitch:False,garbage_collection_threshold:0.8", false, false},
	{"capture reuse", "graph_capture_record_stream_reuse:True,expandable_segments:True,stitch:False", true, false},
	{"stitch", "expandable_segments:True", true, false},
	{"stitch+unannounced+split limit", "expandable_segments:True,max_split_size_mb:40", false, false},
	{"stitch+unannounced, page by page", "stitch:True,expandable_map_unit_mb:2", false, false},
	{"stitch in 4 MiB chunks", "stitch_chunk_mb:4", true, false},
	{"driver faults", "expandable_segments:True,stitch:False", true, true},
	{"driver faults, ordinary segments", "expandable_segments:False", true, true},
	{"driver faults, stitch", "expandable_segments:True", true, true},
	{"driver faults, stitch in 6 MiB chunks", "stitch_chunk_mb:6", true, true},
}

// soakFaultMethods fail at random in the fault phases: every driver call
// whose failure the allocator reports or works around. (A failed switch
// back from relaxed capture mode would leave the thread relaxed, which the
// simulator would then let make calls a capture forbids: left out.)
var soakFaultMethods = []string{"MemAlloc", "MemFree", "MemGetInfo", "EventCreate", "EventRecord",
	"EventQuery", "EventSynchronize", "EventDestroy", "MemAddressReserve", "MemAddressFree", "MemCreate",
	"MemRelease", "MemMap", "MemSetAccess", "MemUnmap", "DeviceProcesses", "DeviceSynchronize"}

func TestSoak(t *testing.T) {
	total := soakOps(t)
	start := time.Now()
	var all soakCounts
	for _, ph := range soakPhases {
		ok := t.Run(ph.name, func(t *testing.T) { runSoak(t, ph, total/len(soakPhases), &all) })
		if !ok {
			break
		}
	}
	el := time.Since(start)
	t.Logf("soak: %d operations in %v (%.0f ops/s) over %d phases, %d goroutines, invariants checked %d times",
		all.ops, el.Round(time.Millisecond), float64(all.ops)/el.Seconds(), len(soakPhases), soakWorkers, all.checks)
	t.Logf("soak: %s", all.String())
	require.Zero(t, all.badReuse, "blocks reused while another stream still read them")
	if all.stitchPhases > 0 {
		require.Positive(t, all.stitched, "the stitch phases moved no page")
	}
}

// soakCounts are a phase's tallies.
type soakCounts struct {
	ops, mallocs, frees, ooms, raceReuse, captures, captureMallocs, releases, emptyCaches, fractions, hugeOOMs int64
	guardsChecked, badReuse, checks, captureForks, reusedInCapture                                             int64
	injected, driverErrs, warnings                                                                             int64
	// stitchPhases and stitched: the phases with stitch:True and the pages
	// they moved (a phase alone may meet no stitchable miss: stitching
	// waits while any capture runs, and the workers capture often).
	stitchPhases, stitched int64
}

func (c *soakCounts) add(o *soakCounts) {
	for _, p := range [][2]*int64{{&c.ops, &o.ops}, {&c.mallocs, &o.mallocs}, {&c.frees, &o.frees}, {&c.ooms, &o.ooms},
		{&c.raceReuse, &o.raceReuse}, {&c.captures, &o.captures}, {&c.captureMallocs, &o.captureMallocs},
		{&c.releases, &o.releases}, {&c.emptyCaches, &o.emptyCaches}, {&c.fractions, &o.fractions},
		{&c.hugeOOMs, &o.hugeOOMs}, {&c.guardsChecked, &o.guardsChecked}, {&c.badReuse, &o.badReuse}, {&c.checks, &o.checks},
		{&c.captureForks, &o.captureForks}, {&c.reusedInCapture, &o.reusedInCapture},
		{&c.injected, &o.injected}, {&c.driverErrs, &o.driverErrs}, {&c.warnings, &o.warnings},
		{&c.stitchPhases, &o.stitchPhases}, {&c.stitched, &o.stitched}} {
		atomic.AddInt64(p[0], atomic.LoadInt64(p[1]))
	}
}

func (c *soakCounts) String() string {
	return fmt.Sprintf("mallocs %d (OOM %d), frees %d, record_stream frees with immediate reallocation %d, "+
		"captures %d (mallocs inside %d), graph releases %d, empty_cache %d, memory fractions %d, "+
		"forced OOMs %d, reuses of guarded memory checked %d, bad reuses %d, "+
		"record_stream frees in captures with a forked stream %d (reused in the capture %d), "+
		"driver calls failed on purpose %d (driver errors reported %d, warnings %d)",
		c.mallocs, c.ooms, c.frees, c.raceReuse, c.captures, c.captureMallocs, c.releases, c.emptyCaches,
		c.fractions, c.hugeOOMs, c.guardsChecked, c.badReuse, c.captureForks, c.reusedInCapture,
		c.injected, c.driverErrs, c.warnings)
}

// soak is one phase's shared state.
type soak struct {
	t     *testing.T
	ph    soakPhase
	a     *allocator.Allocator
	drv   *sim.Driver
	gate  sync.RWMutex // unannounced phases: see the file comment
	guard [soakDevices]struct {
		mu   sync.Mutex
		list []soakGuard // guarded by mu
	}
	nextPool atomic.Uint64
	counts   soakCounts
}

// soakGuard: [lo, hi) on dev must not be handed out before ev completes.
type soakGuard struct {
	lo, hi cuda.Ptr
	ev     cuda.Event
}

type soakAlloc struct {
	p    cuda.Ptr
	size uint64
	s    cuda.Stream
}

// soakWorker is one goroutine's state, touched only by that goroutine (and
// by the test goroutine between batches).
type soakWorker struct {
	s                *soak
	id, dev          int
	rng              *rand.Rand
	main, side, capS cuda.Stream
	capSide          cuda.Stream // forked into the worker's captures
	forked           bool        // capSide is in the open capture
	live             []soakAlloc
	graphs           []allocator.PoolID // pools of captured graphs still alive
	capturing        bool
	pool             allocator.PoolID // the open capture's pool
	autoPools        int              // unannounced captures made
	fail             string           // the first failure, reported by the test goroutine
}

// runSoak runs one phase of ops operations and adds its tallies to into.
func runSoak(t *testing.T, ph soakPhase, ops int, into *soakCounts) {
	cfg, _, err := allocator.ParseConfig(ph.conf)
	require.NoError(t, err)
	drv := sim.New(sim.Options{Devices: soakDevices, Memory: soakMemory})
	var f *fault.Driver
	var adrv allocator.Driver = drv
	if ph.faults {
		f = fault.New(drv)
		adrv = f
	}
	a, err := allocator.New(adrv, cfg)
	require.NoError(t, err)
	s := &soak{t: t, ph: ph, a: a, drv: drv}
	a.SetWarningHandler(func(m string) {
		if ph.faults {
			atomic.AddInt64(&s.counts.warnings, 1)
			return
		}
		t.Errorf("warning: %s", m)
	})
	if f != nil {
		f.FailRandomly(0.002, int64(len(ph.name)), cuda.ErrUnknown, soakFaultMethods...)
	}
	if ph.announced {
		a.ExpectAnnouncements()
	}
	defer into.add(&s.counts)
	ws := make([]*soakWorker, soakWorkers)
	for i := range ws {
		base := cuda.Stream(100 + 10*i)
		ws[i] = &soakWorker{s: s, id: i, dev: i % soakDevices, rng: rand.New(rand.NewSource(int64(i) + int64(len(ph.name))*1000)),
			main: base, side: base + 1, capS: base + 2, capSide: base + 3}
	}
	for done := 0; done < ops; done += soakWorkers * soakBatch {
		var wg sync.WaitGroup
		for _, w := range ws {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				w.batch(soakBatch)
			}()
		}
		wg.Wait()
		for _, w := range ws {
			require.Empty(t, w.fail, "worker %d", w.id)
		}
		s.check(ws)
	}
	if f != nil {
		f.Clear()
		s.counts.injected = int64(f.RandomHits())
		require.Positive(t, s.counts.injected, "no fault was injected")
	}
	s.drain(ws)
	if cfg.Stitch {
		var st allocator.StitchStats
		for dev := 0; dev < soakDevices; dev++ {
			d, err := a.StitchStats(dev)
			require.NoError(t, err)
			st.Remaps, st.Lent, st.Stitches = st.Remaps+d.Remaps, st.Lent+d.Lent, st.Stitches+d.Stitches
		}
		t.Logf("%s: %d pages moved (%d lent) at %d misses", ph.name, st.Remaps, st.Lent, st.Stitches)
		s.counts.stitchPhases++
		s.counts.stitched += int64(st.Remaps)
	}
	t.Logf("%s: %d operations, %d mallocs of which %d out of memory (%d deliberate), %d captures; "+
		"%d driver calls failed on purpose, %d driver errors reported, %d warnings",
		ph.name, s.counts.ops, s.counts.mallocs, s.counts.ooms, s.counts.hugeOOMs, s.counts.captures,
		s.counts.injected, s.counts.driverErrs, s.counts.warnings)
}

func (w *soakWorker) failf(format string, args ...any) {
	if w.fail == "" {
		w.fail = fmt.Sprintf(format, args...)
	}
}

// smallSize is a small-pool size: the memory of unannounced captures'
// pools stays reserved until the process ends, so they stay small.
func (w *soakWorker) smallSize() uint64 { return uint64(w.rng.Intn(MiB) + 1) }

// size is log-uniform from 512 B to 64 MiB.
func (w *soakWorker) size() uint64 {
	return uint64(math.Exp(math.Log(512) + w.rng.Float64()*(math.Log(64*MiB)-math.Log(512))))
}

// locked runs fn holding the gate shared in unannounced phases.
func (w *soakWorker) locked(fn func()) {
	if !w.s.ph.announced {
		w.s.gate.RLock()
		defer w.s.gate.RUnlock()
	}
	fn()
}

func (w *soakWorker) batch(n int) {
	for i := 0; i < n && w.fail == ""; i++ {
		atomic.AddInt64(&w.s.counts.ops, 1)
		w.step()
	}
	if w.capturing {
		w.endCapture()
	}
}

func (w *soakWorker) step() {
	r := w.rng.Intn(100)
	switch {
	case r < 35:
		if len(w.live) >= soakMaxLive {
			w.free(w.rng.Intn(len(w.live)))
			return
		}
		if w.capturing && w.rng.Intn(2) == 0 {
			size := w.size()
			if !w.s.ph.announced {
				size = w.smallSize()
			}
			w.malloc(size, w.capS)
			return
		}
		w.malloc(w.size(), w.main)
	case r < 62:
		if len(w.live) > 0 {
			w.free(w.rng.Intn(len(w.live)))
		}
	case r < 74:
		w.raceReuse()
	case r < 78:
		w.s.drv.Complete(w.side)
	case r < 80:
		if w.capturing && w.s.ph.announced {
			w.captureFork()
		}
	case r < 88:
		switch {
		case w.capturing:
			w.endCapture()
		case w.s.ph.announced || w.autoPools < soakMaxAutoPools:
			w.beginCapture()
		}
	case r < 91:
		w.releaseGraph()
	case r < 94:
		w.locked(func() {
			if err := w.s.a.EmptyCache(0); !w.s.expected(err, allocator.ErrCaptureUnderway) {
				w.failf("empty_cache: %v", err)
			}
		})
		atomic.AddInt64(&w.s.counts.emptyCaches, 1)
	case r < 95:
		f := 0.5 + 0.5*w.rng.Float64()
		if w.rng.Intn(3) == 0 {
			f = 1
		}
		if err := w.s.a.SetMemoryFraction(w.dev, f); !w.s.expected(err) {
			w.failf("set_memory_fraction: %v", err)
		}
		atomic.AddInt64(&w.s.counts.fractions, 1)
	case r < 96:
		// More than the device has: out of memory, with PyTorch's message;
		// the allocator must keep working (checked after the batch).
		w.locked(func() {
			_, err := w.s.a.Malloc(&allocator.MallocRequest{Dev: w.dev, Size: 2 * soakMemory, Stream: w.main})
			if err == nil || !w.s.expected(err, allocator.ErrOutOfMemory) {
				w.failf("a %d-byte malloc: %v, want out of memory", 2*soakMemory, err)
			}
		})
		atomic.AddInt64(&w.s.counts.hugeOOMs, 1)
	default:
		w.malloc(w.size(), w.main)
	}
}

func isErr(err, kind error) bool {
	e, ok := err.(*allocator.Error)
	return ok && e.Kind == kind
}

// expected reports whether err is nil, of one of kinds, or (in a fault
// phase) a driver error, which it counts.
func (s *soak) expected(err error, kinds ...error) bool {
	if err == nil {
		return true
	}
	for _, k := range kinds {
		if isErr(err, k) {
			return true
		}
	}
	if s.ph.faults && isErr(err, allocator.ErrDriver) {
		atomic.AddInt64(&s.counts.driverErrs, 1)
		return true
	}
	return false
}

// malloc allocates, accepting out of memory (other workers hold memory
// too), and checks the memory against the guards.
func (w *soakWorker) malloc(size uint64, s cuda.Stream) (cuda.Ptr, bool) {
	var p cuda.Ptr
	var err error
	w.locked(func() { p, err = w.s.a.Malloc(&allocator.MallocRequest{Dev: w.dev, Size: size, Stream: s}) })
	atomic.AddInt64(&w.s.counts.mallocs, 1)
	if s == w.capS {
		atomic.AddInt64(&w.s.counts.captureMallocs, 1)
	}
	if err != nil {
		if !w.s.expected(err, allocator.ErrOutOfMemory) {
			w.failf("malloc(%d) on stream %#x: %v", size, s, err)
		}
		if isErr(err, allocator.ErrOutOfMemory) {
			atomic.AddInt64(&w.s.counts.ooms, 1)
		}
		return 0, false
	}
	w.s.checkGuards(w, p, size)
	w.live = append(w.live, soakAlloc{p, size, s})
	return p, true
}

func (w *soakWorker) free(i int) {
	al := w.live[i]
	w.live[i] = w.live[len(w.live)-1]
	w.live = w.live[:len(w.live)-1]
	// A driver error (an event that could not be recorded) still frees:
	// the block waits for a later try.
	if err := w.s.a.Free(allocator.FreeRequest{Dev: w.dev, Ptr: al.p, Size: al.size}); !w.s.expected(err) {
		w.failf("free(%#x, %d): %v", al.p, al.size, err)
	}
	atomic.AddInt64(&w.s.counts.frees, 1)
}

// raceReuse hands a block to the side stream, whose (simulated) kernel
// still reads it, frees it at once and allocates the same size at once on
// the freeing stream.
func (w *soakWorker) raceReuse() {
	idx := -1
	for i, al := range w.live {
		if al.s == w.main {
			idx = i
			break
		}
	}
	if idx < 0 {
		return
	}
	al := w.live[idx]
	if err := w.s.a.RecordStream(al.p, w.side); err != nil {
		w.failf("record_stream: %v", err)
		return
	}
	w.s.drv.Submit(w.side)
	w.s.addGuard(w, al.p, al.size)
	w.free(idx)
	w.malloc(al.size, w.main)
	atomic.AddInt64(&w.s.counts.raceReuse, 1)
}

func (w *soakWorker) beginCapture() {
	modes := []cuda.CaptureMode{cuda.CaptureModeGlobal, cuda.CaptureModeThreadLocal, cuda.CaptureModeRelaxed}
	mode := modes[w.rng.Intn(3)]
	if !w.s.ph.announced {
		// The allocator meets the capture at its first allocation, made
		// before anyone may free memory again.
		w.s.gate.Lock()
		defer w.s.gate.Unlock()
		if err := w.s.drv.BeginCapture(w.capS, mode); err != nil {
			w.failf("begin capture: %v", err)
			return
		}
		w.capturing = true
		w.autoPools++
		atomic.AddInt64(&w.s.counts.captures, 1)
		sz := w.smallSize()
		p, err := w.s.a.Malloc(&allocator.MallocRequest{Dev: w.dev, Size: sz, Stream: w.capS})
		atomic.AddInt64(&w.s.counts.mallocs, 1)
		atomic.AddInt64(&w.s.counts.captureMallocs, 1)
		switch {
		case err == nil:
			w.s.checkGuards(w, p, sz)
			w.live = append(w.live, soakAlloc{p, sz, w.capS})
		case !w.s.expected(err, allocator.ErrOutOfMemory):
			w.failf("malloc in an unannounced capture: %v", err)
		}
		return
	}
	// A program keeps a few graphs alive, not all it ever captured.
	for len(w.graphs) >= soakMaxGraphs {
		w.releaseGraph()
	}
	// A new graph, or one sharing the pool of a graph still alive.
	var pool allocator.PoolID
	if len(w.graphs) > 0 && w.rng.Intn(3) == 0 {
		pool = w.graphs[w.rng.Intn(len(w.graphs))]
	} else {
		pool = allocator.PoolID{A: w.s.nextPool.Add(1)}
	}
	cs := w.capS
	if err := w.s.a.BeginAllocateToPool(w.dev, pool, func(s cuda.Stream) bool { return s == cs }); err != nil {
		w.failf("begin_allocate_to_pool: %v", err)
		return
	}
	if err := w.s.drv.BeginCapture(cs, mode); err != nil {
		w.failf("begin capture: %v", err)
		return
	}
	w.capturing, w.pool = true, pool
	w.graphs = append(w.graphs, pool)
	atomic.AddInt64(&w.s.counts.captures, 1)
}

// captureFork forks a second stream into the open capture, frees a block
// of the capture stream that the forked stream reads (record_stream), and
// allocates again on the capture stream, sometimes after joining the forked
// stream back (then graph_capture_record_stream_reuse may reuse the block
// within the capture).
func (w *soakWorker) captureFork() {
	if !w.forked {
		w.wait(w.capS, w.capSide)
		w.forked = true
	}
	p, ok := w.malloc(w.smallSize(), w.capS)
	if !ok {
		return
	}
	al := w.live[len(w.live)-1]
	if err := w.s.a.RecordStream(p, w.capSide); err != nil {
		w.failf("record_stream in a capture: %v", err)
		return
	}
	w.s.drv.Submit(w.capSide)
	w.free(len(w.live) - 1)
	joined := w.rng.Intn(2) == 0
	if joined {
		w.wait(w.capSide, w.capS)
	}
	atomic.AddInt64(&w.s.counts.captureForks, 1)
	if q, ok := w.malloc(al.size, w.capS); ok && q == p {
		atomic.AddInt64(&w.s.counts.reusedInCapture, 1)
		if !joined {
			// The forked stream's read is not ordered before the capture
			// stream's next work: reusing the block now corrupts it.
			atomic.AddInt64(&w.s.counts.badReuse, 1)
			w.failf("a block read by a forked stream was reused in the capture before the join")
		}
	}
}

// wait makes to wait for from's captured work (an event recorded on from,
// waited for on to), as torch's wait_stream does.
func (w *soakWorker) wait(from, to cuda.Stream) {
	ev, err := w.s.drv.EventCreate(w.dev)
	if err == nil {
		err = w.s.drv.EventRecord(w.dev, ev, from)
	}
	if err == nil {
		err = w.s.drv.StreamWaitEvent(w.dev, to, ev)
	}
	if err == nil {
		err = w.s.drv.EventDestroy(w.dev, ev)
	}
	if err != nil {
		w.failf("fork or join in a capture: %v %v", err, w.s.drv.ViolationLog())
	}
}

func (w *soakWorker) endCapture() {
	if w.forked {
		w.wait(w.capSide, w.capS) // a capture ends with its forks joined
		w.forked = false
	}
	w.capturing = false
	if err := w.s.drv.EndCapture(w.capS); err != nil {
		w.failf("end capture: %v (a driver call of the allocator invalidated it) %v", err, w.s.drv.ViolationLog())
		return
	}
	if w.s.ph.announced {
		if err := w.s.a.EndAllocateToPool(w.dev, w.pool); err != nil {
			w.failf("end_allocate_to_pool: %v", err)
		}
	}
}

// releaseGraph destroys one of the worker's graphs (PyTorch's release_pool);
// its pool's memory goes back at the next empty_cache or OOM retry.
func (w *soakWorker) releaseGraph() {
	if len(w.graphs) == 0 {
		return
	}
	i := w.rng.Intn(len(w.graphs))
	pool := w.graphs[i]
	if w.capturing && pool == w.pool {
		return
	}
	w.graphs[i] = w.graphs[len(w.graphs)-1]
	w.graphs = w.graphs[:len(w.graphs)-1]
	if err := w.s.a.ReleasePool(w.dev, pool); err != nil {
		w.failf("release_pool: %v", err)
	}
	atomic.AddInt64(&w.s.counts.releases, 1)
}

func (s *soak) addGuard(w *soakWorker, p cuda.Ptr, size uint64) {
	ev, err := s.drv.EventCreate(w.dev)
	if err == nil {
		err = s.drv.EventRecord(w.dev, ev, w.side)
	}
	if err != nil {
		w.failf("guard event: %v", err)
		return
	}
	g := &s.guard[w.dev]
	g.mu.Lock()
	g.list = append(g.list, soakGuard{p, p + cuda.Ptr(max(size, 1)), ev})
	g.mu.Unlock()
}

// checkGuards fails the worker if [p, p+size) overlaps a guarded range
// whose event has not completed, and forgets the completed guards it
// meets. The query is made in relaxed capture mode: it is the test's own
// call, legal whatever captures run.
func (s *soak) checkGuards(w *soakWorker, p cuda.Ptr, size uint64) {
	hi := p + cuda.Ptr(max(size, 1))
	g := &s.guard[w.dev]
	g.mu.Lock()
	defer g.mu.Unlock()
	for i := 0; i < len(g.list); i++ {
		gd := g.list[i]
		if gd.hi <= p || gd.lo >= hi {
			continue
		}
		atomic.AddInt64(&s.counts.guardsChecked, 1)
		done, err := s.relaxedQuery(w.dev, gd.ev)
		if err != nil {
			w.failf("guard query: %v", err)
			return
		}
		if !done {
			atomic.AddInt64(&s.counts.badReuse, 1)
			w.failf("malloc returned %#x+%d, inside a freed block [%#x, %#x) that another stream still reads", p, size, gd.lo, gd.hi)
			return
		}
		_ = s.drv.EventDestroy(w.dev, gd.ev)
		g.list[i] = g.list[len(g.list)-1]
		g.list = g.list[:len(g.list)-1]
		i--
	}
}

func (s *soak) relaxedQuery(dev int, ev cuda.Event) (bool, error) {
	prev, err := s.drv.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
	if err != nil {
		return false, err
	}
	done, err := s.drv.EventQuery(dev, ev)
	_, _ = s.drv.ExchangeCaptureMode(prev)
	return done, err
}

// pruneGuards forgets the guards whose events have completed, so that the
// list stays short. Between batches only.
func (s *soak) pruneGuards() {
	for dev := range s.guard {
		g := &s.guard[dev]
		keep := g.list[:0]
		for _, gd := range g.list {
			done, err := s.drv.EventQuery(dev, gd.ev)
			require.NoError(s.t, err)
			if done {
				require.NoError(s.t, s.drv.EventDestroy(dev, gd.ev))
			} else {
				keep = append(keep, gd)
			}
		}
		g.list = keep
	}
}

// check runs between batches, with nothing running and no capture open.
func (s *soak) check(ws []*soakWorker) {
	t := s.t
	s.counts.checks++
	require.NoError(t, s.a.CheckInvariants())
	require.Zero(t, s.drv.Violations(), "capture rules broken: %v", s.drv.ViolationLog())
	require.Zero(t, s.drv.ActiveCaptures())
	s.pruneGuards()
	type iv struct{ lo, hi cuda.Ptr }
	var per [soakDevices][]iv
	var live [soakDevices]int64
	for _, w := range ws {
		for _, al := range w.live {
			per[w.dev] = append(per[w.dev], iv{al.p, al.p + cuda.Ptr(max(al.size, 1))})
			require.True(t, s.drv.Accessible(w.dev, al.p, max(al.size, 1)), "live allocation %#x+%d is not accessible memory", al.p, al.size)
		}
		live[w.dev] += int64(len(w.live))
	}
	for dev := range per {
		ivs := per[dev]
		sort.Slice(ivs, func(i, j int) bool { return ivs[i].lo < ivs[j].lo })
		for i := 1; i < len(ivs); i++ {
			require.LessOrEqual(t, ivs[i-1].hi, ivs[i].lo, "device %d: live allocations overlap", dev)
		}
		st := stats(t, s.a, dev)
		if s.ph.faults {
			// Pages whose release failed wait as spares: driver memory the
			// allocator holds outside any segment, until the next release.
			require.LessOrEqual(t, uint64(st.ReservedBytes[pools.StatAll].Current), s.drv.Used(dev), "device %d: reserved bytes vs driver memory", dev)
		} else {
			require.Equal(t, uint64(st.ReservedBytes[pools.StatAll].Current), s.drv.Used(dev), "device %d: reserved bytes vs driver memory", dev)
		}
		// Blocks freed with uses still count until their events are seen.
		require.GreaterOrEqual(t, st.Allocation[pools.StatAll].Current, live[dev], "device %d: allocations counted", dev)
		// The allocator still works after whatever the batch did.
		p, err := s.a.Malloc(&allocator.MallocRequest{Dev: dev, Size: 4096, Stream: 999})
		if err != nil {
			require.True(t, s.expected(err, allocator.ErrOutOfMemory), "device %d: %v", dev, err)
		} else {
			s.checkGuards(&soakWorker{s: s, dev: dev}, p, 4096)
			require.NoError(t, s.a.Free(allocator.FreeRequest{Dev: dev, Ptr: p, Size: 4096}))
		}
	}
}

// drain frees everything and checks that nothing was lost or counted twice.
func (s *soak) drain(ws []*soakWorker) {
	t := s.t
	for _, w := range ws {
		for len(w.live) > 0 {
			w.free(0)
		}
		for _, p := range w.graphs {
			require.NoError(t, s.a.ReleasePool(w.dev, p))
		}
		w.graphs = nil
		require.Empty(t, w.fail)
	}
	s.drv.CompleteAll()
	require.NoError(t, s.a.EmptyCache(0))
	require.NoError(t, s.a.CheckInvariants())
	for dev := range s.guard {
		for _, g := range s.guard[dev].list {
			require.NoError(t, s.drv.EventDestroy(dev, g.ev))
		}
		s.guard[dev].list = nil
	}
	for dev := 0; dev < soakDevices; dev++ {
		st := stats(t, s.a, dev)
		for _, arr := range []pools.StatArray{st.Allocation, st.Active, st.AllocatedBytes, st.RequestedBytes, st.ActiveBytes} {
			require.Zero(t, arr[pools.StatAll].Current, "device %d: counted after freeing everything", dev)
		}
		if s.ph.announced {
			// Unannounced captures' pools stay until the process ends.
			require.Zero(t, s.drv.Live(dev), "device %d: segments left", dev)
			require.Zero(t, s.drv.Handles(dev), "device %d: physical allocations left", dev)
			n, _ := s.drv.Reservations(dev)
			require.Zero(t, n, "device %d: address ranges left", dev)
			require.Zero(t, st.ReservedBytes[pools.StatAll].Current)
		}
		require.Equal(t, uint64(st.ReservedBytes[pools.StatAll].Current), s.drv.Used(dev))
	}
	require.Zero(t, s.drv.LiveEvents(), "events left")
	require.Zero(t, s.drv.Violations(), "%v", s.drv.ViolationLog())
}
