// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
)

// Pauses and resumes of one tag race with mallocs and frees of another
// tag and of the default pools (which never fail for it), with the
// paused tag's own mallocs (which succeed or are refused as paused), with
// empty_cache, and with graph captures begun on another thread (which
// never see memory unmapped or driver calls made under them: the
// simulator logs any such call). Run with -race.
func TestPauseConcurrency(t *testing.T) {
	e := newTagEnv(t, 2, 4*GiB, "expandable_segments:True")
	busy, other := e.tag("busy"), e.tag("other")
	// Memory of the paused tag that stays allocated throughout.
	var kept []cuda.Ptr
	for dev := 0; dev < 2; dev++ {
		kept = append(kept, e.malloc(dev, 40*MiB, 0, busy))
	}
	rounds := 30
	if testing.Short() {
		rounds = 10
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	report := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	// Workers: the other tag and the default pools, on both devices.
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			tag := other
			if w%2 == 1 {
				tag = 0
			}
			dev, s := w%2, cuda.Stream(10+w)
			var live []cuda.Ptr
			for i := 0; !stop.Load(); i++ {
				p, err := e.a.Malloc(&allocator.MallocRequest{Dev: dev, Size: uint64(1+i%7) * MiB, Stream: s, Tag: tag})
				if err != nil {
					report(err)
					return
				}
				live = append(live, p)
				if len(live) > 6 {
					if err := e.a.Free(allocator.FreeRequest{Dev: dev, Ptr: live[0]}); err != nil {
						report(err)
						return
					}
					live = live[1:]
				}
			}
			for _, p := range live {
				if err := e.a.Free(allocator.FreeRequest{Dev: dev, Ptr: p}); err != nil {
					report(err)
				}
			}
		}(w)
	}
	// The paused tag's own mallocs: served or refused, nothing else.
	var refused, served atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			p, err := e.a.Malloc(&allocator.MallocRequest{Size: 2 * MiB, Stream: 0, Tag: busy})
			switch {
			case errors.Is(err, allocator.ErrPaused):
				refused.Add(1)
				time.Sleep(20 * time.Microsecond)
			case err != nil:
				report(err)
				return
			default:
				served.Add(1)
				if err := e.a.Free(allocator.FreeRequest{Ptr: p}); err != nil {
					report(err)
					return
				}
			}
		}
	}()
	// Captures on a thread of their own, announced as PyTorch does.
	var captures atomic.Int64
	wg.Add(1)
	go func() {
		defer wg.Done()
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		cs := cuda.Stream(99)
		for i := 0; !stop.Load(); i++ {
			pool := allocator.PoolID{A: uint64(1 + i)}
			if err := e.a.BeginAllocateToPool(1, pool, func(s cuda.Stream) bool { return s == cs }); err != nil {
				report(err)
				return
			}
			if err := e.drv.BeginCapture(cs, cuda.CaptureModeGlobal); err != nil {
				report(err)
				return
			}
			p, err := e.a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 3 * MiB, Stream: cs})
			if err == nil {
				err = e.a.Free(allocator.FreeRequest{Dev: 1, Ptr: p})
			}
			if cerr := e.drv.EndCapture(cs); err == nil {
				err = cerr
			}
			if err == nil {
				err = e.a.EndAllocateToPool(1, pool)
			}
			if err == nil {
				err = e.a.ReleasePool(1, pool)
			}
			if err != nil {
				report(err)
				return
			}
			captures.Add(1)
			time.Sleep(100 * time.Microsecond) // room for the pauses between captures
		}
	}()
	var paused, refusedPauses, refusedResumes int
	// Until rounds pauses are done and captures ran meanwhile.
	deadline := time.Now().Add(time.Minute)
	for i := 0; i < rounds || captures.Load() < 5 && time.Now().Before(deadline); i++ {
		// A pause is refused while a capture runs, and goes through
		// between two.
		err := e.a.Pause("busy", i%2 == 0)
		for ; errors.Is(err, allocator.ErrCaptureUnderway); err = e.a.Pause("busy", i%2 == 0) {
			refusedPauses++
			time.Sleep(50 * time.Microsecond)
		}
		require.NoError(t, err)
		paused++
		if err := e.a.EmptyCache(0); err != nil && i%5 == 0 {
			require.ErrorIs(t, err, allocator.ErrCaptureUnderway) // (leaves the paused tag alone either way)
		}
		// A resume is refused while a capture runs, and goes through
		// between two.
		for err = e.a.Resume("busy"); errors.Is(err, allocator.ErrCaptureUnderway); err = e.a.Resume("busy") {
			refusedResumes++
			time.Sleep(50 * time.Microsecond)
		}
		require.NoError(t, err)
	}
	stop.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d pauses (%d refused during captures, and %d resumes), %d captures, the tag's mallocs: %d served, %d refused",
		paused, refusedPauses, refusedResumes, captures.Load(), served.Load(), refused.Load())
	require.GreaterOrEqual(t, paused, rounds)
	require.GreaterOrEqual(t, captures.Load(), int64(5))
	for _, p := range kept {
		e.free(p)
	}
	require.NoError(t, e.a.EmptyCache(0))
	e.ok()
}
