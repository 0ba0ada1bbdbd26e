// SPDX-License-Identifier: Apache-2.0

package main

import (
	"runtime"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
)

// Driver failures reach a C caller as a NULL or nothing done, with the
// allocator's message as the thread's last error, named after the public
// function called; the library stays usable
// (a driver failure is not an internal error) and the next call works.
func TestFaultThroughCABI(t *testing.T) {
	runtime.LockOSThread() // the last error is per C thread
	defer runtime.UnlockOSThread()
	s := sim.New(sim.Options{Memory: 1 << 30})
	f := fault.New(s)
	a, err := allocator.New(f, allocator.Config{})
	if err != nil {
		t.Fatal(err)
	}
	old := current.Load()
	defer current.Store(old)
	current.Store(&state{a: a, sim: s, backend: "sim"})

	expect := func(what, want string) {
		t.Helper()
		if got := lastError(); !strings.Contains(got, want) || !strings.Contains(got, "CUDA_ERROR_UNKNOWN") {
			t.Errorf("%s: last error %q, want it to contain %q and the CUDA error", what, got, want)
		}
		if st := current.Load(); st.err != nil {
			t.Fatalf("%s: the library was disabled: %v", what, st.err)
		}
	}

	f.Fail("MemAlloc", "", 0, cuda.ErrUnknown)
	if p := cpgo_malloc_ctx(4096, 0, 1, 0, nil, 0, nil, fnMalloc, 0); p != 0 {
		t.Fatalf("malloc with a failing driver returned %#x", p)
	}
	expect("malloc", "cudapool_malloc: allocating a 2097152-byte segment on device 0")
	p := cpgo_malloc_ctx(4096, 0, 1, 0, nil, 0, nil, fnMalloc, 0)
	if p == 0 {
		t.Fatalf("the next malloc failed: %s", lastError())
	}

	// A free whose event cannot be recorded says so; the block is not lost.
	cpgo_record_stream(p, 5)
	s.Submit(5)
	f.Fail("EventRecord", "", 0, cuda.ErrUnknown)
	cpgo_free(p, 4096, 0, 1)
	expect("free", "cudapool_free: recording events for the streams that use")
	if q := cpgo_malloc_ctx(4096, 0, 1, 0, nil, 0, nil, fnMalloc, 0); q == 0 || q == p {
		t.Fatalf("malloc after the failed free: %#x (the freed block is %#x; it is still read)", q, p)
	} else {
		cpgo_free(q, 4096, 0, 1)
	}
	s.Complete(5)

	f.Fail("MemFree", "", 0, cuda.ErrUnknown)
	cpgo_empty_cache()
	expect("empty_cache", "cudapool_empty_cache: freeing cached segments on device 0")
	f.Fail("MemGetInfo", "", 0, cuda.ErrUnknown)
	cpgo_set_memory_fraction(0.5, 0)
	expect("set_memory_fraction", "cudapool_set_memory_fraction: reading device 0's memory size")

	cpgo_empty_cache()
	if err := a.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
	if n := s.Live(0); n != 0 {
		t.Errorf("%d segments left after empty_cache", n)
	}
	if n := s.LiveEvents(); n != 0 {
		t.Errorf("%d events left after empty_cache", n)
	}
}
