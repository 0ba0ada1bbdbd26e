// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"
	"time"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/bench/workload"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// The hot path allocates no Go memory: a cache-hit malloc and its free, on
// one size and on a mix, once the cache is warm.
func TestHotPathAllocatesNothing(t *testing.T) {
	for _, conf := range []string{ordinary, "expandable_segments:True,stitch:False", "", "stitch:True", "graph_capture_record_stream_reuse:True"} {
		for _, k := range pools.FreeSetKinds {
			c := join(conf, "free_set:"+k.String())
			t.Run(c, func(t *testing.T) { testHotPathAllocatesNothing(t, c) })
		}
	}
}

// join joins configuration strings with commas, skipping empty ones.
func join(confs ...string) string {
	out := ""
	for _, c := range confs {
		if c != "" && out != "" {
			out += ","
		}
		out += c
	}
	return out
}

// freeSetConfs are the free-set settings the benchmarks compare; the
// default first.
func freeSetConfs() []string {
	out := []string{"free_set:" + pools.DefaultFreeSet.String()}
	for _, k := range pools.FreeSetKinds {
		if k != pools.DefaultFreeSet && k != pools.FreeSetSorted {
			out = append(out, "free_set:"+k.String())
		}
	}
	return out
}

func testHotPathAllocatesNothing(t *testing.T, conf string) {
	lockThread(t)
	a, _ := newAlloc(t, 1, 8*GiB, conf)
	a.ExpectAnnouncements()
	warm := func(size uint64) {
		p := mustMalloc(t, a, 0, size, 0)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	warm(4096)
	allocs := testing.AllocsPerRun(1000, func() {
		p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
		_ = a.Free(allocator.FreeRequest{Ptr: p})
	})
	require.Zero(t, allocs, "cache-hit malloc+free of one size")

	m := workload.NewMixed(a, 256)
	m.Run(20000) // warm: segments, block free list and index at their high water
	allocs = testing.AllocsPerRun(2000, func() { m.Run(1) })
	require.Zero(t, allocs, "mixed sizes with many live blocks (splits and merges)")

	// The same holds with stream uses recorded on the allocating stream.
	p := mustMalloc(t, a, 0, 4096, 0)
	allocs = testing.AllocsPerRun(1000, func() {
		_ = a.RecordStream(p, 0)
	})
	require.Zero(t, allocs)
}

func BenchmarkHotPair(b *testing.B) {
	for _, fs := range freeSetConfs() {
		b.Run(fs, func(b *testing.B) { benchmarkHotPair(b, fs) })
	}
}

func benchmarkHotPair(b *testing.B, conf string) {
	a, _ := newAlloc(b, 1, 8*GiB, conf)
	a.ExpectAnnouncements()
	p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
	_ = a.Free(allocator.FreeRequest{Ptr: p})
	b.ReportAllocs()
	for b.Loop() {
		p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
		_ = a.Free(allocator.FreeRequest{Ptr: p})
	}
}

func BenchmarkMixedPairs(b *testing.B) {
	for _, conf := range []string{ordinary, "expandable_segments:True,stitch:False", "", "stitch:True", "graph_capture_record_stream_reuse:True"} {
		for _, fs := range freeSetConfs() {
			c := join(conf, fs)
			b.Run(c, func(b *testing.B) { benchmarkMixedPairs(b, c) })
		}
	}
}

func benchmarkMixedPairs(b *testing.B, conf string) {
	a, _ := newAlloc(b, 1, 80*GiB, conf)
	a.ExpectAnnouncements()
	m := workload.NewMixed(a, 256)
	m.Run(20000)
	b.ReportAllocs()
	for b.Loop() {
		m.Run(1)
	}
}

// Unannounced mode asks the driver about capture on every malloc.
func BenchmarkHotPairCaptureQuery(b *testing.B) {
	a, _ := newAlloc(b, 1, 8*GiB, "")
	b.ReportAllocs()
	for b.Loop() {
		p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
		_ = a.Free(allocator.FreeRequest{Ptr: p})
	}
}

func BenchmarkParallelPairs(b *testing.B) {
	a, _ := newAlloc(b, 1, 8*GiB, "")
	a.ExpectAnnouncements()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
			_ = a.Free(allocator.FreeRequest{Ptr: p})
		}
	})
}

func BenchmarkMixedWorkloadsH(b *testing.B) {
	for _, fs := range freeSetConfs() {
		b.Run(fs, func(b *testing.B) { benchmarkMixedWorkloadsH(b, fs) })
	}
}

func benchmarkMixedWorkloadsH(b *testing.B, conf string) {
	a, _ := newAlloc(b, 1, 140*GiB, conf)
	a.ExpectAnnouncements()
	w := workload.NewSlots(a)
	for k := 0; k < workload.SequenceLen; k++ {
		w.Step()
	}
	b.ReportAllocs()
	for b.Loop() {
		w.Step()
	}
}

// BenchmarkTorchPair is the C++ class's cache-hit pair: the previous
// tensor's free queued, performed with the next malloc under one lock.
func BenchmarkTorchPair(b *testing.B) {
	a, _ := newAlloc(b, 1, 8*GiB, "")
	a.ExpectAnnouncements()
	var pend [1]allocator.FreeRequest
	var frees []allocator.FreeRequest
	b.ReportAllocs()
	for b.Loop() {
		// As the C ABI does: a request per malloc, with the queued frees.
		r := &allocator.MallocRequest{Size: 4096, Frees: frees}
		p, _ := a.Malloc(r)
		pend[0] = allocator.FreeRequest{Dev: -1, Ptr: p}
		frees = pend[:]
	}
}

// BenchmarkCaptureEnterCold is the allocator's part of a capture's enter
// phase (torch.cuda.graph: gc.collect, synchronize, empty_cache, then
// beginAllocateToPool) with the host's caches evicted before each call, as
// Python's gc.collect evicts them on the GPU host: 300 live and 300 freed
// blocks in the default pools, 12 graphs' private pools kept (each with
// live and free blocks). Each call is timed alone (ns/call): b.StopTimer
// would stop the world on every iteration and disturb what it measures.
// docs/hot-path.md, "During graph captures".
func BenchmarkCaptureEnterCold(b *testing.B) {
	evict := make([]byte, 48<<20) // more than this box's last-level cache
	setup := func(b *testing.B) *allocator.Allocator {
		a, _ := newAlloc(b, 1, 80*GiB, "")
		a.ExpectAnnouncements()
		sizes, _ := workload.Sequence()
		var live []cuda.Ptr
		for i := 0; i < 600; i++ {
			live = append(live, mustMalloc(b, a, 0, sizes[i]%(64*MiB)+512, 0))
		}
		for i := 0; i < 600; i += 2 {
			require.NoError(b, a.Free(allocator.FreeRequest{Ptr: live[i]}))
		}
		for k := uint64(1); k <= 12; k++ {
			pool := allocator.PoolID{A: k}
			require.NoError(b, a.BeginAllocateToPool(0, pool, onStream(7)))
			var ps []cuda.Ptr
			for i := 0; i < 200; i++ {
				ps = append(ps, mustMalloc(b, a, 0, sizes[1000+i]%(16*MiB)+512, 7))
			}
			for i := 0; i < 200; i += 3 {
				require.NoError(b, a.Free(allocator.FreeRequest{Ptr: ps[i]}))
			}
			require.NoError(b, a.EndAllocateToPool(0, pool))
		}
		require.NoError(b, a.EmptyCache(0))
		return a
	}
	// timed runs call(k) with cold caches, then after(k) (untimed).
	timed := func(b *testing.B, call, after func(k uint64) error) {
		var sum time.Duration
		k := uint64(100)
		for b.Loop() {
			k++
			for i := 0; i < len(evict); i += 64 {
				evict[i]++
			}
			t := time.Now()
			err := call(k)
			sum += time.Since(t)
			if err == nil && after != nil {
				err = after(k)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(sum.Nanoseconds())/float64(b.N), "ns/call")
	}
	b.Run("empty_cache", func(b *testing.B) {
		a := setup(b)
		timed(b, func(uint64) error { return a.EmptyCache(0) }, nil)
	})
	b.Run("begin_allocate_to_pool", func(b *testing.B) {
		a := setup(b)
		pool := func(k uint64) allocator.PoolID { return allocator.PoolID{A: k} }
		timed(b, func(k uint64) error { return a.BeginAllocateToPool(0, pool(k), onStream(7)) },
			func(k uint64) error { return a.EndAllocateToPool(0, pool(k)) })
	})
}
