// SPDX-License-Identifier: Apache-2.0

// Package warm keeps the library's Go runtime ready for the next call from
// C while the library is in use.
//
// # Design
//
// A call from C into Go (a cgo callback) finds the runtime in one of two
// states. While some P is busy (running Go code, or in a system call made
// from Go), sysmon, the runtime's monitor thread, polls every 20 us to
// 10 ms. Once every P is idle (the P a C caller leaves behind is taken back
// from it 10 ms after its call returned), sysmon sleeps until it is woken,
// and the next call from C wakes it: a futex wake on the caller's thread.
// Every allocator call after a pause of 10 ms or more pays that, e.g. the
// empty_cache and the beginAllocateToPool of every CUDA graph capture:
// after 30 ms idle a near-empty call through ctypes cost 48 us on the H100
// host and 37 us with sysmon kept awake (docs/hot-path.md, "The Go runtime
// between calls"). GODEBUG=schedtrace keeps sysmon awake too,
// but it must be in the environment the process starts with, and a process
// started on a host up more than 24.8 days prints a trace line at once (the
// longest period schedtrace takes).
//
// So while calls come, one goroutine, the keeper, naps in a system call in
// a loop: its P is never idle, so sysmon never sleeps deeply; the P's
// syscall tick moves at every nap, so sysmon does not take it back; and
// runtime.Gosched between naps moves its schedule tick, since a P on one
// tick for 10 ms is taken back as well. (With GOMAXPROCS 1 it stays off:
// it would hold the only P.) The keeper asks every check period
// whether a call came (Touch) and parks after idleChecks periods without
// one, so an idle process gets no wake-ups from it; the next call wakes it.
//
// Touch costs a call one atomic load; the first call after each of the
// keeper's asks also stores (at most once per check period).
package warm

import (
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
)

// The keeper's states (Keeper.state).
const (
	parked int32 = iota // not running: waiting for a call (the zero Keeper)
	asking              // running; no call since it last asked
	seen                // running; a call came since it last asked
	off                 // disabled (SetEnabled(false)): Touch does nothing
)

// Defaults: a 5 ms nap, a check every 50 naps (about 250 ms), parked after
// 4 checks without a call (about a second).
const (
	defaultNap          = 5_000_000 // ns
	defaultNapsPerCheck = 50
	defaultIdleChecks   = 4
)

// A Keeper keeps the runtime warm while Touch is called. The zero Keeper
// is enabled and parked; its goroutine starts at the first Touch.
type Keeper struct {
	state atomic.Int32

	// Set by tests before the first Touch; zero: the defaults.
	nap          func() // one nap in a system call
	napsPerCheck int
	idleChecks   int

	start  sync.Once
	wake   chan struct{} // made by start; a send restarts a parked keeper
	single atomic.Bool   // GOMAXPROCS was 1 at start: the keeper stays off

	// What the keeper did, for the tests.
	parks, wakes atomic.Int64
}

// Touch reports a call from C. Inlined: a load and a branch, unless the
// keeper asked since the last call.
func (k *Keeper) Touch() {
	if k.state.Load() != seen {
		k.touchSlow()
	}
}

//go:noinline
func (k *Keeper) touchSlow() {
	k.start.Do(k.launch)
	for {
		switch s := k.state.Load(); s {
		case seen, off:
			return
		case asking:
			if k.state.CompareAndSwap(asking, seen) {
				return
			}
		case parked:
			if k.state.CompareAndSwap(parked, seen) {
				k.wakes.Add(1)
				select {
				case k.wake <- struct{}{}:
				default: // a wake is pending already
				}
				return
			}
		}
	}
}

// SetEnabled turns the keeper on or off. Off, it stops after its current
// nap and Touch does nothing.
func (k *Keeper) SetEnabled(on bool) {
	if !on || k.single.Load() {
		k.state.Store(off)
		return
	}
	k.state.CompareAndSwap(off, parked) // the next Touch wakes it
}

// running reports whether the keeper is awake (not parked or off).
func (k *Keeper) running() bool {
	s := k.state.Load()
	return s == asking || s == seen
}

func (k *Keeper) launch() {
	k.wake = make(chan struct{}, 1)
	if runtime.GOMAXPROCS(0) < 2 {
		// With one P the keeper would hold it in its naps and each call
		// from C would take it back: worse than letting sysmon sleep.
		k.single.Store(true)
		k.state.Store(off)
		return
	}
	if k.nap == nil {
		ts := syscall.Timespec{Nsec: defaultNap}
		k.nap = func() { _ = syscall.Nanosleep(&ts, nil) } // a Syscall: its P stays in syscall state
	}
	if k.napsPerCheck <= 0 {
		k.napsPerCheck = defaultNapsPerCheck
	}
	if k.idleChecks <= 0 {
		k.idleChecks = defaultIdleChecks
	}
	go k.run()
}

func (k *Keeper) run() {
	for {
		<-k.wake
		k.keep()
	}
}

// keep naps until idleChecks checks in a row have seen no call, then
// parks; or until it finds the keeper disabled (after any nap). A CAS that
// fails met a Touch or SetEnabled, which the next check sees.
func (k *Keeper) keep() {
	for idle := 0; ; {
		for i := 0; i < k.napsPerCheck; i++ {
			k.nap()
			runtime.Gosched()
			if s := k.state.Load(); s == off || s == parked {
				return // disabled: stop within a nap
			}
		}
		switch k.state.Load() {
		case seen:
			if k.state.CompareAndSwap(seen, asking) {
				idle = 0
			}
		case asking:
			if idle++; idle >= k.idleChecks && k.state.CompareAndSwap(asking, parked) {
				k.parks.Add(1)
				return
			}
		default: // off, or parked by SetEnabled(true) after an off: the next Touch wakes it
			return
		}
	}
}
