// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"math/rand"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
)

// Many goroutines allocate, free and record uses on several streams and two
// devices at once; run with -race.
func TestConcurrentMallocFree(t *testing.T) {
	for _, conf := range []string{ordinary, ""} {
		t.Run(conf, func(t *testing.T) { testConcurrentMallocFree(t, conf) })
	}
}

func testConcurrentMallocFree(t *testing.T, conf string) {
	a, drv := newAlloc(t, 2, 4*GiB, conf)
	a.ExpectAnnouncements()
	const workers = 16
	iters := 3000
	if testing.Short() {
		iters = 500
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(w)))
			dev, s := w%2, cuda.Stream(w%4)
			var live []cuda.Ptr
			for i := 0; i < iters; i++ {
				if len(live) < 32 && (len(live) == 0 || rng.Intn(2) == 0) {
					size := uint64(rng.Intn(2*MiB) + 1)
					if rng.Intn(20) == 0 {
						size = uint64(rng.Intn(30*MiB) + 1)
					}
					p, err := a.Malloc(&allocator.MallocRequest{Dev: dev, Size: size, Stream: s})
					if err != nil {
						t.Error(err)
						return
					}
					live = append(live, p)
					if rng.Intn(10) == 0 {
						if err := a.RecordStream(p, cuda.Stream(10+w)); err != nil {
							t.Error(err)
							return
						}
					}
				} else {
					k := rng.Intn(len(live))
					if err := a.Free(allocator.FreeRequest{Dev: dev, Ptr: live[k]}); err != nil {
						t.Error(err)
						return
					}
					live[k] = live[len(live)-1]
					live = live[:len(live)-1]
				}
				if i%500 == 0 {
					drv.CompleteAll()
				}
			}
			for _, p := range live {
				if err := a.Free(allocator.FreeRequest{Dev: dev, Ptr: p}); err != nil {
					t.Error(err)
				}
			}
		}(w)
	}
	// Introspection runs alongside.
	stop := make(chan struct{})
	var intro sync.WaitGroup
	intro.Add(1)
	go func() {
		defer intro.Done()
		for {
			select {
			case <-stop:
				return
			default:
				_ = a.Snapshot(nil, true)
				_, _ = a.Stats(0)
			}
		}
	}()
	wg.Wait()
	close(stop)
	intro.Wait()
	require.NoError(t, a.CheckInvariants())
	drv.CompleteAll()
	require.NoError(t, a.EmptyCache(0))
	for dev := 0; dev < 2; dev++ {
		require.Zero(t, drv.Live(dev))
		require.Zero(t, drv.Used(dev), "no physical memory left mapped")
		require.Zero(t, stats(t, a, dev).Allocation[pools.StatAll].Current)
	}
}
