// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/bench/workload"
	"github.com/cudapool/cudapool/cuda"
)

// BenchmarkPGOCapture is the Go part of the profile that make pgo writes into
// capi/default.pgo (docs/hot-path.md, "Why it is built this way"): the
// mallocs of a CUDA graph capture, as PyTorch's class makes them (one request
// with the previous free queued). Each op is one capture: empty_cache, a
// private pool, 64 mallocs on the capturing stream and 8 on a side stream
// that the filter rejects, half the capture's blocks freed during it, the
// rest after it, the pool released. The class path's mixed pairs and the C
// API come from bench/c_bench.c run through the library itself.
func BenchmarkPGOCapture(b *testing.B) {
	const cs, side = cuda.Stream(7), cuda.Stream(8)
	a, _ := newAlloc(b, 1, 80*GiB, "")
	a.ExpectAnnouncements()
	all, _ := workload.Sequence()
	var sizes []uint64
	for _, s := range all {
		if s < 16*MiB {
			sizes = append(sizes, s)
		}
	}
	// The queued frees (PyTorch's class queues each free for the next malloc).
	var queue [4]allocator.FreeRequest
	frees := queue[:0]
	malloc := func(size uint64, s cuda.Stream) cuda.Ptr {
		p, _, err, ferr := mallocTracked(a, 0, size, s, 0, frees)
		if err != nil || ferr != nil {
			b.Fatal(err, ferr)
		}
		frees = queue[:0]
		return p
	}
	free := func(p cuda.Ptr) {
		if len(frees) == len(queue) {
			if err := a.Free(frees...); err != nil {
				b.Fatal(err)
			}
			frees = queue[:0]
		}
		frees = append(frees, allocator.FreeRequest{Ptr: p})
	}
	var live [64]cuda.Ptr
	var sideLive [8]cuda.Ptr
	k, j := uint64(0), 0
	b.ReportAllocs()
	for b.Loop() {
		k++
		if err := a.EmptyCache(0); err != nil {
			b.Fatal(err)
		}
		pool := allocator.PoolID{A: k}
		if err := a.BeginAllocateToPool(0, pool, onStream(cs)); err != nil {
			b.Fatal(err)
		}
		for i := range live {
			live[i] = malloc(sizes[j%len(sizes)], cs)
			j++
			if i%8 == 7 {
				sideLive[i/8] = malloc(sizes[j%len(sizes)], side)
				j++
			}
			if i%2 == 1 {
				free(live[i-1]) // an intermediate, freed within the capture
			}
		}
		if err := a.EndAllocateToPool(0, pool); err != nil {
			b.Fatal(err)
		}
		for i := 1; i < len(live); i += 2 {
			free(live[i])
			free(malloc(4096, side)) // eager work after the capture
		}
		for _, p := range sideLive {
			free(p)
		}
		free(malloc(512, side))
		if err := a.ReleasePool(0, pool); err != nil {
			b.Fatal(err)
		}
	}
}
