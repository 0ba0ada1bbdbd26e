// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"errors"
	"sync"
	"syscall"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// threadFilter accepts every stream on the calling OS thread only, as
// use_mem_pool's filter does. The caller must be locked to its thread.
func threadFilter() func(cuda.Stream) bool {
	tid := syscall.Gettid()
	return func(cuda.Stream) bool { return syscall.Gettid() == tid }
}

// useMemPool is torch.cuda.use_mem_pool: begin for this thread; the
// returned function ends and releases.
func useMemPool(t testing.TB, a *allocator.Allocator, id allocator.PoolID) func() {
	t.Helper()
	require.NoError(t, a.BeginAllocateToPool(0, id, threadFilter()))
	return func() {
		require.NoError(t, a.EndAllocateToPool(0, id))
		require.NoError(t, a.ReleasePool(0, id))
	}
}

func useCount(t testing.TB, a *allocator.Allocator, id allocator.PoolID) int {
	t.Helper()
	n, err := a.PoolUseCount(0, id)
	require.NoError(t, err)
	return n
}

func inPool(t testing.TB, a *allocator.Allocator, id allocator.PoolID, ps ...cuda.Ptr) bool {
	t.Helper()
	live, err := a.CheckPoolLive(0, id, ps)
	require.NoError(t, err)
	return live
}

// MemPool's life: created (1 holder), used (a holder more while a
// use_mem_pool block runs), destroyed (released, then emptied).
func TestMemPoolLifecycle(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	pool := allocator.PoolID{B: 1}
	require.NoError(t, a.CreateOrIncrefPool(0, pool))
	require.Equal(t, 1, useCount(t, a, pool))
	done := useMemPool(t, a, pool)
	require.Equal(t, 2, useCount(t, a, pool), "use_mem_pool holds the pool while it runs")
	x := mustMalloc(t, a, 0, 4096, 3)
	y := mustMalloc(t, a, 0, 30*MiB, 4)
	done()
	require.Equal(t, 1, useCount(t, a, pool))
	z := mustMalloc(t, a, 0, 4096, 3)
	require.True(t, inPool(t, a, pool, x, y), "the block's allocations went to the pool, z did not")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: z}))

	live := drv.Live(0)
	require.NoError(t, a.EmptyPool(0, pool), "a held pool gives nothing back")
	require.Equal(t, live, drv.Live(0))
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 2, drv.Live(0), "empty_cache keeps a held pool's segments")

	// ~MemPool: release, then empty the pool.
	require.NoError(t, a.ReleasePool(0, pool))
	require.Zero(t, useCount(t, a, pool), "released, not yet emptied")
	require.NoError(t, a.EmptyPool(0, pool))
	require.Zero(t, drv.Live(0))
	_, err := a.PoolUseCount(0, pool)
	require.ErrorIs(t, err, allocator.ErrUnknownPool, "the pool is gone")
	require.NoError(t, a.EmptyPool(0, pool), "emptying a pool that is gone does nothing, as in PyTorch")
	require.NoError(t, a.EmptyPool(0, allocator.PoolID{}), "{0,0}: empty_cache")

	// A graph pool id works the same; a released pool held again lives.
	g := allocator.PoolID{A: 5}
	require.NoError(t, a.CreateOrIncrefPool(0, g))
	require.NoError(t, a.CreateOrIncrefPool(0, g))
	require.Equal(t, 2, useCount(t, a, g))
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.CreateOrIncrefPool(0, g))
	require.Equal(t, 1, useCount(t, a, g))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

func TestMemPoolErrors(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, "")
	// An unannounced capture's automatic pool (before any announcement).
	require.NoError(t, drv.BeginCapture(9, cuda.CaptureModeRelaxed))
	_, cid, _ := drv.StreamCaptureInfo(0, 9)
	mustMalloc(t, a, 0, 4096, 9)
	require.NoError(t, drv.EndCapture(9))
	auto := allocator.PoolID{A: 1<<63 | cid}
	require.Equal(t, 1, useCount(t, a, auto))
	held := allocator.PoolID{B: 1}
	require.NoError(t, a.CreateOrIncrefPool(0, held))
	require.NoError(t, a.BeginAllocateToPool(0, held, nil))
	mustMalloc(t, a, 0, 4096, 0)
	require.NoError(t, a.EndAllocateToPool(0, held))
	require.NoError(t, a.ReleasePool(0, held))
	before := stats(t, a, 0)
	unknown := allocator.PoolID{B: 99}
	src := &fakeSource{drv: drv}

	errOfInt := func(_ int, err error) error { return err }
	errOfU64 := func(_ uint64, err error) error { return err }
	errOfF := func(_ float64, err error) error { return err }
	for _, tc := range []struct {
		name string
		err  error
		kind error
		msg  string
	}{
		{"create: default pool", a.CreateOrIncrefPool(0, allocator.PoolID{}), allocator.ErrUnknownPool, "default pool"},
		{"create: automatic pool", a.CreateOrIncrefPool(0, auto), allocator.ErrUnknownPool, "automatic pool"},
		{"create: bad device", a.CreateOrIncrefPool(1, held), allocator.ErrInvalidDevice, "device 1 does not exist"},
		{"use count: unknown pool", errOfInt(a.PoolUseCount(0, unknown)), allocator.ErrUnknownPool, "{0,99}"},
		{"use count: bad device", errOfInt(a.PoolUseCount(-1, held)), allocator.ErrInvalidDevice, "device -1"},
		{"no split: unknown pool", a.SetPoolNoSplit(0, unknown), allocator.ErrUnknownPool, "create it first"},
		{"no split: automatic pool", a.SetPoolNoSplit(0, auto), allocator.ErrUnknownPool, "no pool"},
		{"use on oom: unknown pool", a.SetPoolUseOnOOM(0, unknown, true), allocator.ErrUnknownPool, "{0,99}"},
		{"use on oom: bad device", a.SetPoolUseOnOOM(3, held, false), allocator.ErrInvalidDevice, "device 3"},
		{"source: unknown pool", a.SetPoolSource(0, unknown, src), allocator.ErrUnknownPool, "{0,99}"},
		{"source: pool with segments", a.SetPoolSource(0, held, src), allocator.ErrInvalidArgument, "already holds 1 segments"},
		{"empty pool: bad device", a.EmptyPool(2, held), allocator.ErrInvalidDevice, "device 2"},
		{"cache info: bad device", errOfU64(a.CacheInfo(1, 0)), allocator.ErrInvalidDevice, "device 1"},
		{"memory fraction: bad device", errOfF(a.MemoryFraction(1)), allocator.ErrInvalidDevice, "device 1"},
	} {
		require.ErrorIs(t, tc.err, tc.kind, tc.name)
		require.ErrorContains(t, tc.err, tc.msg, tc.name)
		var e *allocator.Error
		require.ErrorAs(t, tc.err, &e, tc.name)
	}
	require.NoError(t, a.SetPoolUseOnOOM(0, unknown, false), "nothing to clear: no error")
	require.Equal(t, before, stats(t, a, 0), "bad input changed nothing")
	require.Equal(t, 1, useCount(t, a, held))
	require.Equal(t, 1, useCount(t, a, auto))
	require.Zero(t, src.allocs+src.frees)
	require.NoError(t, a.CheckInvariants())
}

// Threads and pools, as in PyTorch: while one thread is in use_mem_pool of
// a pool, a second thread's begin of the same pool is refused (and holds
// nothing); threads in different pools route independently, each thread's
// allocations going to its own pool only.
func TestMemPoolThreads(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	pool, other := allocator.PoolID{B: 2}, allocator.PoolID{B: 3}
	require.NoError(t, a.CreateOrIncrefPool(0, pool))
	require.NoError(t, a.CreateOrIncrefPool(0, other))

	type step struct {
		do   func() // run on the worker's thread
		done chan struct{}
	}
	worker := func() chan step {
		ch := make(chan step)
		go func() {
			lockThread(t)
			for s := range ch {
				s.do()
				close(s.done)
			}
		}()
		return ch
	}
	on := func(w chan step, fn func()) {
		s := step{fn, make(chan struct{})}
		w <- s
		<-s.done
	}
	w1, w2, w3 := worker(), worker(), worker()
	defer close(w1)
	defer close(w2)
	defer close(w3)
	malloc := func(w chan step) (p cuda.Ptr) {
		on(w, func() { p = mustMalloc(t, a, 0, 4096, 0) })
		return p
	}

	var end1, end2 func()
	on(w1, func() { end1 = useMemPool(t, a, pool) })
	on(w2, func() {
		err := a.BeginAllocateToPool(0, pool, nil)
		require.ErrorIs(t, err, allocator.ErrAlreadyRecording, "the pool is in use by thread 1")
	})
	require.Equal(t, 2, useCount(t, a, pool), "the refused begin holds nothing")
	on(w2, func() { end2 = useMemPool(t, a, other) })
	p1, p2, p3 := malloc(w1), malloc(w2), malloc(w3)
	// inPool: the pool's allocated blocks are exactly these.
	require.True(t, inPool(t, a, pool, p1), "thread 1 allocates from its pool")
	require.True(t, inPool(t, a, other, p2), "thread 2 from its own; thread 3 (p3) from neither")

	on(w2, end2) // the second thread leaves first
	q2, q1 := malloc(w2), malloc(w1)
	require.True(t, inPool(t, a, other, p2), "thread 2 no more (q2 is not in its pool)")
	require.True(t, inPool(t, a, pool, p1, q1), "thread 1 still")
	on(w1, end1)
	r1 := malloc(w1)
	require.True(t, inPool(t, a, pool, p1, q1), "nor thread 1 after its end (r1)")
	require.Equal(t, 1, useCount(t, a, pool))
	require.Equal(t, 1, useCount(t, a, other))
	for _, p := range []cuda.Ptr{p1, p2, p3, q1, q2, r1} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations())

	// The same with threads running freely, each with its own pool.
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func(own allocator.PoolID) {
			defer wg.Done()
			lockThread(t)
			require.NoError(t, a.CreateOrIncrefPool(0, own))
			for k := 0; k < 50; k++ {
				end := useMemPool(t, a, own)
				p := mustMalloc(t, a, 0, uint64(k+1)*KiB, 0)
				q := mustMalloc(t, a, 0, 4096, 0)
				end()
				r := mustMalloc(t, a, 0, 4096, 0)
				for _, x := range []cuda.Ptr{p, q, r} {
					require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
				}
			}
			require.Equal(t, 1, useCount(t, a, own))
		}(allocator.PoolID{B: uint64(10 + i)})
	}
	wg.Wait()
	require.NoError(t, a.CheckInvariants())
}

// no_split: every allocation of the pool keeps a segment to itself.
func TestMemPoolNoSplit(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	pool := allocator.PoolID{B: 3}
	require.NoError(t, a.CreateOrIncrefPool(0, pool))
	require.NoError(t, a.SetPoolNoSplit(0, pool))
	done := useMemPool(t, a, pool)
	x := mustMalloc(t, a, 0, 512, 0)
	y := mustMalloc(t, a, 0, 512, 0)
	z := mustMalloc(t, a, 0, 3*MiB, 0)
	done()
	require.Equal(t, int64(3), drv.Allocs(0), "one segment each")
	st := stats(t, a, 0)
	require.Equal(t, int64(2*pools.SmallBuffer+pools.LargeBuffer), st.AllocatedBytes[pools.StatAll].Current, "whole segments handed out")
	require.Zero(t, st.InactiveSplit[pools.StatAll].Current)
	for _, p := range []cuda.Ptr{x, y, z} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	// The default pool still splits.
	p := mustMalloc(t, a, 0, 512, 0)
	q := mustMalloc(t, a, 0, 512, 0)
	require.Equal(t, p+512, q)
	require.NoError(t, a.CheckInvariants())
}

// oomPoolBlock makes pool a use_on_oom pool of device 0 and allocates a
// 60 MiB block in it on stream 5 (still allocated; of a 100 MiB device).
func oomPoolBlock(t testing.TB, a *allocator.Allocator, pool allocator.PoolID) cuda.Ptr {
	t.Helper()
	require.NoError(t, a.CreateOrIncrefPool(0, pool))
	require.NoError(t, a.SetPoolUseOnOOM(0, pool, true))
	done := useMemPool(t, a, pool)
	defer done()
	return mustMalloc(t, a, 0, 60*MiB, 5)
}

// use_on_oom: when the device is out of memory, a request of the default
// pools takes a cached block of the pool before anything is freed.
func TestMemPoolUseOnOOM(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 100*MiB, ordinary)
	pool := allocator.PoolID{B: 4}
	cached := oomPoolBlock(t, a, pool)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: cached})) // cached in the pool

	p := mustMalloc(t, a, 0, 60*MiB, 5) // 40 MiB left on the device
	require.Equal(t, cached, p, "the pool's cached block")
	require.True(t, inPool(t, a, pool, p), "it belongs to the pool: its free returns it there")
	st := stats(t, a, 0)
	require.Zero(t, st.NumOOMs)
	require.Zero(t, st.NumAllocRetries, "taken before any cached memory is freed")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.True(t, inPool(t, a, pool))

	// Another stream's request: the pool has nothing cached on it.
	_, err := a.Malloc(&allocator.MallocRequest{Size: 60 * MiB, Stream: 6})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	// A failing driver (no memory limit involved) leads to the pool too.
	drv.FailAllocs(0, 3)
	q := mustMalloc(t, a, 0, 50*MiB, 5)
	require.Equal(t, cached, q, "the pool's cached block, split")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	drv.FailAllocs(0, 0)

	// A request routed to another private pool does not borrow.
	other := allocator.PoolID{B: 5}
	require.NoError(t, a.CreateOrIncrefPool(0, other))
	done := useMemPool(t, a, other)
	_, err = a.Malloc(&allocator.MallocRequest{Size: 60 * MiB, Stream: 5})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	done()

	// Unmarked, the pool lends nothing.
	require.NoError(t, a.SetPoolUseOnOOM(0, pool, false))
	_, err = a.Malloc(&allocator.MallocRequest{Size: 60 * MiB, Stream: 5})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)

	// Marked but released: its memory is given back instead, and the
	// request gets a new segment.
	require.NoError(t, a.SetPoolUseOnOOM(0, pool, true))
	require.NoError(t, a.ReleasePool(0, pool))
	frees := drv.Frees(0)
	r := mustMalloc(t, a, 0, 60*MiB, 5)
	require.NotEqual(t, cached, r)
	require.Greater(t, drv.Frees(0), frees, "the released pool's segment went back first")
	_, err = a.PoolUseCount(0, pool)
	require.ErrorIs(t, err, allocator.ErrUnknownPool)
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations())
}

// fakeSource is a segment source with its own address range that counts
// its calls and checks the capture mode it is called in.
type fakeSource struct {
	drv        *sim.Driver
	mu         sync.Mutex
	next       cuda.Ptr
	live       map[cuda.Ptr]uint64
	allocs     int
	frees      int
	notRelaxed int
	failOOM    bool
	failOther  error
}

func (f *fakeSource) Alloc(dev int, size uint64, s cuda.Stream) (cuda.Ptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	// Read this thread's capture mode: exchange it and put it back.
	mode, err := f.drv.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
	if err != nil {
		return 0, err
	}
	if _, err := f.drv.ExchangeCaptureMode(mode); err != nil {
		return 0, err
	}
	if mode != cuda.CaptureModeRelaxed {
		f.notRelaxed++
	}
	switch {
	case f.failOOM:
		return 0, errors.Join(errors.New("fake source: no memory"), cuda.ErrOutOfMemory)
	case f.failOther != nil:
		return 0, f.failOther
	}
	if f.live == nil {
		f.live, f.next = map[cuda.Ptr]uint64{}, 60<<44
	}
	p := f.next
	f.next += cuda.Ptr(size+2*MiB) &^ (2*MiB - 1)
	f.live[p] = size
	f.allocs++
	return p, nil
}

func (f *fakeSource) Free(dev int, p cuda.Ptr, size uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.live[p] != size {
		return errors.New("fake source: freeing what it did not allocate")
	}
	delete(f.live, p)
	f.frees++
	return nil
}

func TestMemPoolSegmentSource(t *testing.T) {
	for _, conf := range []string{ordinary, ""} {
		t.Run(conf, func(t *testing.T) { testMemPoolSegmentSource(t, conf) })
	}
}

func testMemPoolSegmentSource(t *testing.T, conf string) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, conf)
	src := &fakeSource{drv: drv}
	pool := allocator.PoolID{B: 6}
	require.NoError(t, a.CreateOrIncrefPool(0, pool))
	require.NoError(t, a.SetPoolSource(0, pool, src))

	// Inside a global-mode capture: the source is called in relaxed mode.
	beginCapture(t, a, drv, pool, 7, cuda.CaptureModeGlobal)
	x := mustMalloc(t, a, 0, 4096, 7)
	y := mustMalloc(t, a, 0, 30*MiB, 7)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y}))
	require.NoError(t, drv.EndCapture(7))
	require.NoError(t, a.EndAllocateToPool(0, pool))
	require.Equal(t, 2, src.allocs, "two segments, from the source")
	require.Zero(t, src.notRelaxed, "called in relaxed capture mode")
	require.Zero(t, drv.Allocs(0), "nothing from the driver")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	seen := false
	for _, s := range a.Snapshot(nil, true).Segments {
		if s.Address == uint64(x) {
			seen = true
			require.False(t, s.IsExpandable, "a source's segments are ordinary ones")
		}
	}
	require.True(t, seen)
	mustMalloc(t, a, 0, 4096, 1) // the default pool: the driver
	require.Equal(t, 2, src.allocs)

	// Out of memory from the source: an out-of-memory error.
	done := useMemPool(t, a, pool)
	src.failOOM = true
	_, err := a.Malloc(&allocator.MallocRequest{Size: 100 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	src.failOOM, src.failOther = false, errors.New("fake source broke")
	_, err = a.Malloc(&allocator.MallocRequest{Size: 100 * MiB})
	require.ErrorIs(t, err, allocator.ErrDriver)
	require.ErrorContains(t, err, "segment source of pool {0,6}")
	require.ErrorContains(t, err, "fake source broke")
	src.failOther = nil
	done()

	// The pool held: nothing goes back. Released: its free segments go
	// back through the source, at empty_cache or EmptyPool, never through
	// the driver.
	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, src.frees)
	require.NoError(t, a.ReleasePool(0, pool)) // the graph dies
	require.NoError(t, a.EmptyPool(0, pool))
	require.Zero(t, src.frees, "the MemPool still holds it")
	require.NoError(t, a.ReleasePool(0, pool)) // the MemPool dies
	require.NoError(t, a.EmptyPool(0, pool))
	require.Equal(t, 1, src.frees, "y's segment; x's holds x")
	require.Zero(t, drv.Frees(0))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 2, src.frees)
	require.Empty(t, src.live)
	require.Zero(t, drv.Frees(0), "the default pool's segment holds a live block")
	_, err = a.PoolUseCount(0, pool)
	require.ErrorIs(t, err, allocator.ErrUnknownPool, "the pool and its source are gone")

	// A source can be set, and unset, while the pool holds no segment.
	again := allocator.PoolID{B: 7}
	require.NoError(t, a.CreateOrIncrefPool(0, again))
	require.NoError(t, a.SetPoolSource(0, again, src))
	require.NoError(t, a.SetPoolSource(0, again, nil))
	done = useMemPool(t, a, again)
	mustMalloc(t, a, 0, 4096, 0)
	done()
	require.Equal(t, 2, src.allocs, "unset: the driver again")
	require.NoError(t, a.CheckInvariants())
}

func TestCacheInfo(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 2*GiB, "")
	n, err := a.CacheInfo(0, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(2*GiB), n, "nothing cached: the device's free memory, PyTorch's first guess")

	p := mustMalloc(t, a, 0, 300*MiB, 0)
	pool := allocator.PoolID{A: 9}
	require.NoError(t, a.BeginAllocateToPool(0, pool, nil))
	q := mustMalloc(t, a, 0, 500*MiB, 3)
	require.NoError(t, a.EndAllocateToPool(0, pool))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	drv.SetExternalUse(0, 1200*MiB) // 48 MiB free on the device
	n, err = a.CacheInfo(0, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(500*MiB), n, "a graph pool's cached block counts too")

	require.NoError(t, a.ReleasePool(0, pool))
	require.NoError(t, a.EmptyCache(0))
	n, err = a.CacheInfo(0, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(2*GiB-1200*MiB), n, "empty_cache gave everything back")
	drv.SetExternalUse(0, 1700*MiB)
	p = mustMalloc(t, a, 0, 300*MiB, 0) // 48 MiB left free
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	n, err = a.CacheInfo(0, 0)
	require.NoError(t, err)
	require.Equal(t, uint64(300*MiB), n)
	n, err = a.CacheInfo(0, 1)
	require.NoError(t, err)
	require.Equal(t, uint64(300*MiB), n, "a caller's lower bound is raised to the largest cached block")
	n, err = a.CacheInfo(0, GiB)
	require.NoError(t, err)
	require.Equal(t, uint64(GiB), n, "and kept when larger (no free-memory guess then)")
}

func TestMemoryFractionQueries(t *testing.T) {
	a, _ := newAlloc(t, 2, 1000*MiB, "")
	f, err := a.MemoryFraction(0)
	require.NoError(t, err)
	require.Equal(t, 1.0, f, "never set: 1, as in PyTorch")
	require.NoError(t, a.SetMemoryFraction(0, 0.3))
	f, err = a.MemoryFraction(0)
	require.NoError(t, err)
	require.Equal(t, 0.3, f)
	require.NoError(t, a.SetMemoryFraction(0, 1))
	f, err = a.MemoryFraction(0)
	require.NoError(t, err)
	require.Equal(t, 1.0, f)
	_, err = a.Malloc(&allocator.MallocRequest{Size: 2000 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.NotContains(t, err.Error(), "allowed", "fraction 1 is no limit")
}

func TestPerProcessMemoryFraction(t *testing.T) {
	cfg, warn, err := allocator.ParseConfig("per_process_memory_fraction:0.25")
	require.NoError(t, err)
	require.Empty(t, warn)
	require.True(t, cfg.MemoryFractionSet)
	require.Equal(t, 0.25, cfg.MemoryFraction)
	round, _, err := allocator.ParseConfig(cfg.String())
	require.NoError(t, err)
	require.Equal(t, cfg, round, "String() round-trips")
	require.Contains(t, cfg.String(), "per_process_memory_fraction:0.25")
	def, _, _ := allocator.ParseConfig("")
	require.NotContains(t, def.String(), "per_process_memory_fraction")
	for _, v := range []string{"0", "1", "0.125", "1e-3"} {
		c, _, err := allocator.ParseConfig("per_process_memory_fraction:" + v)
		require.NoError(t, err, v)
		r, _, err := allocator.ParseConfig(c.String())
		require.NoError(t, err)
		require.Equal(t, c, r, v)
	}
	for _, bad := range []struct{ val, msg string }{
		{"1.5", "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"},
		{"-0.1", "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"},
		{"NaN", "per_process_memory_fraction is invalid"},
		{"half", "expected a number"},
	} {
		_, _, err := allocator.ParseConfig("per_process_memory_fraction:" + bad.val)
		require.ErrorIs(t, err, allocator.ErrInvalidConfig, bad.val)
		require.ErrorContains(t, err, bad.msg, bad.val)
	}

	// Applied to every device when the allocator is made.
	a, _ := newAlloc(t, 2, 1000*MiB, "per_process_memory_fraction:0.25")
	for dev := 0; dev < 2; dev++ {
		f, err := a.MemoryFraction(dev)
		require.NoError(t, err)
		require.Equal(t, 0.25, f, "device %d", dev)
	}
	_, err = a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 300 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.Contains(t, err.Error(), "250.00 MiB allowed;")
	p := mustMalloc(t, a, 1, 200*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Dev: 1, Ptr: p}))

	// SetMemoryFraction overrides it on one device.
	require.NoError(t, a.SetMemoryFraction(0, 0.5))
	mustMalloc(t, a, 0, 400*MiB, 0)
	f, _ := a.MemoryFraction(1)
	require.Equal(t, 0.25, f)

	// Configure applies a new one to every device; without the key the
	// devices keep theirs.
	c75, _, err := allocator.ParseConfig("per_process_memory_fraction:0.75")
	require.NoError(t, err)
	a.Configure(c75)
	for dev := 0; dev < 2; dev++ {
		f, _ := a.MemoryFraction(dev)
		require.Equal(t, 0.75, f)
	}
	mustMalloc(t, a, 1, 700*MiB, 0)
	_, err = a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 100 * MiB})
	require.ErrorContains(t, err, "750.00 MiB allowed;")
	plain, _, _ := allocator.ParseConfig("")
	a.Configure(plain)
	f, _ = a.MemoryFraction(1)
	require.Equal(t, 0.75, f)
	require.NoError(t, a.CheckInvariants())
}

// ~MemPool on one thread while another thread allocates inside use_mem_pool
// (PyTorch's MemPool tests do this from a thread pool): the pool cannot give
// its memory back while a routing is active, but the destructor must not
// fail (an error there ends the process); the memory comes back later.
func TestEmptyPoolWhileAnotherPoolIsInUse(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "debug_checks:True")
	mine, theirs := allocator.PoolID{B: 1}, allocator.PoolID{B: 2}
	require.NoError(t, a.CreateOrIncrefPool(0, mine))
	require.NoError(t, a.CreateOrIncrefPool(0, theirs))
	done := useMemPool(t, a, mine)
	x := mustMalloc(t, a, 0, 4096, 3)
	done()
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))

	other := useMemPool(t, a, theirs) // another thread's use_mem_pool
	require.NoError(t, a.ReleasePool(0, mine))
	live := drv.Live(0)
	require.NoError(t, a.EmptyPool(0, mine), "no error from the destructor")
	require.Equal(t, live, drv.Live(0), "nothing freed while a routing is active")
	other()

	require.NoError(t, a.EmptyCache(0))
	require.Zero(t, drv.Live(0), "the released pool's memory came back at the next empty_cache")
	require.NoError(t, a.CheckInvariants())
}
