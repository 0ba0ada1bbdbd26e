// SPDX-License-Identifier: Apache-2.0

package warm

import (
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// driver runs a keeper's naps one at a time: each nap announces itself on
// napping and waits for a step.
type driver struct{ napping, steps chan struct{} }

func newKeeper(idleChecks int) (*Keeper, *driver) {
	d := &driver{napping: make(chan struct{}), steps: make(chan struct{})}
	k := &Keeper{nap: func() { d.napping <- struct{}{}; <-d.steps }, napsPerCheck: 1, idleChecks: idleChecks}
	return k, d
}

// waitNap waits until the keeper naps; false if it is not running (parked
// or off) and so will not.
func (d *driver) waitNap(k *Keeper) bool {
	for {
		select {
		case <-d.napping:
			return true
		default:
		}
		if !k.running() {
			// It stopped, or is about to nap after a Touch that raced this
			// check: look once more.
			select {
			case <-d.napping:
				return true
			case <-time.After(20 * time.Millisecond):
				return false
			}
		}
		runtime.Gosched()
	}
}

// step ends the nap under way (one check follows, napsPerCheck being 1) and
// reports whether the keeper naps again.
func (d *driver) step(k *Keeper) bool {
	d.steps <- struct{}{}
	return d.waitNap(k)
}

func TestKeeperStartsOnTouchAndParksWhenIdle(t *testing.T) {
	k, d := newKeeper(2)
	require.False(t, k.running(), "the zero keeper is parked")
	k.Touch()
	require.True(t, d.waitNap(k))
	require.True(t, k.running())
	require.EqualValues(t, 1, k.wakes.Load())
	require.True(t, d.step(k), "check 1 saw the Touch")
	require.True(t, d.step(k), "check 2: one idle check of 2")
	require.False(t, d.step(k), "check 3: two idle checks: parked")
	require.False(t, k.running())
	require.EqualValues(t, 1, k.parks.Load())

	k.Touch() // wakes it again
	require.True(t, d.waitNap(k))
	require.EqualValues(t, 2, k.wakes.Load())
	require.True(t, d.step(k))
	require.True(t, d.step(k))
	require.False(t, d.step(k))
	require.EqualValues(t, 2, k.parks.Load())
}

func TestKeeperRunsWhileTouched(t *testing.T) {
	k, d := newKeeper(2)
	k.Touch()
	require.True(t, d.waitNap(k))
	for i := 0; i < 20; i++ {
		k.Touch()
		require.True(t, d.step(k), "check %d followed a Touch", i)
	}
	require.EqualValues(t, 0, k.parks.Load())
	require.EqualValues(t, 1, k.wakes.Load(), "touches of a running keeper do not wake it")
	require.True(t, d.step(k), "idle check 1 of 2")
	require.False(t, d.step(k), "idle check 2: parked")
}

func TestKeeperDisabled(t *testing.T) {
	k, d := newKeeper(2)
	k.Touch()
	require.True(t, d.waitNap(k))
	k.SetEnabled(false)
	require.False(t, k.running())
	k.Touch()
	require.False(t, d.step(k), "a disabled keeper stops at its next check")
	k.Touch()
	require.False(t, d.waitNap(k), "Touch does not wake a disabled keeper")
	require.EqualValues(t, 1, k.wakes.Load())

	k.SetEnabled(true)
	require.False(t, k.running(), "enabled again, it waits for a call")
	k.Touch()
	require.True(t, d.waitNap(k))
	require.EqualValues(t, 2, k.wakes.Load())

	// Off and on again while it naps: it stops at its check, and the next
	// Touch starts it again.
	k.SetEnabled(false)
	k.SetEnabled(true)
	require.False(t, d.step(k))
	k.Touch()
	require.True(t, d.waitNap(k))
	require.True(t, d.step(k))
	require.True(t, d.step(k))
	require.False(t, d.step(k))
}

func TestTouchAllocatesNothing(t *testing.T) {
	k, d := newKeeper(2)
	k.Touch()
	require.True(t, d.waitNap(k))
	require.Zero(t, testing.AllocsPerRun(1000, k.Touch), "running, a call seen")
	require.Zero(t, testing.AllocsPerRun(1000, func() { k.state.Store(asking); k.Touch() }), "running, asked")
	k.SetEnabled(false)
	require.Zero(t, testing.AllocsPerRun(1000, k.Touch), "off")
	require.False(t, d.step(k))
}

// Many callers, a keeper with real naps and toggles of SetEnabled: no call
// blocks, and the keeper parks once the calls stop (run with -race).
func TestKeeperConcurrent(t *testing.T) {
	ts := syscall.Timespec{Nsec: 50_000}
	k := &Keeper{nap: func() { _ = syscall.Nanosleep(&ts, nil) }, napsPerCheck: 4, idleChecks: 3}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 20000; i++ {
				k.Touch()
				if g == 0 && i%1000 == 999 {
					k.SetEnabled(i%2000 == 999)
				}
			}
		}(g)
	}
	wg.Wait()
	k.SetEnabled(true)
	k.Touch()
	require.True(t, k.running())
	require.Eventually(t, func() bool { return !k.running() }, 5*time.Second, time.Millisecond)
	require.GreaterOrEqual(t, k.parks.Load(), int64(1))
}

// The default keeper naps in nanosleep: started by a Touch, it parks about a
// second after the last one (4 checks of 50 naps of 5 ms).
func TestDefaultKeeperParks(t *testing.T) {
	if testing.Short() {
		t.Skip("takes about a second")
	}
	var k Keeper
	k.Touch()
	require.True(t, k.running())
	require.Eventually(t, func() bool { return !k.running() }, 10*time.Second, 10*time.Millisecond)
	require.EqualValues(t, 1, k.parks.Load())
}

// With one P the keeper would take it from the callers: it stays off.
func TestKeeperOffWithOneP(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	k, d := newKeeper(2)
	k.Touch()
	require.False(t, d.waitNap(k))
	require.False(t, k.running())
	k.SetEnabled(true)
	k.Touch()
	require.False(t, k.running(), "still off")
	require.Zero(t, k.wakes.Load())
}
