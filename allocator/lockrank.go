// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// Lock ranks: the order in which the allocator's locks may be taken,
// written once (as the Go runtime's lockrank.go). A goroutine may take a
// lock only while every lock it holds has a lower rank; two locks of one
// rank (two devices) are never held together. With debug_checks:True every
// acquisition of a ranked lock is checked against the locks the goroutine
// holds, and a violation panics; without it a ranked lock costs one load
// and a test per acquisition and release.
//
// Below the device lock, the packages the device orchestrates (pools,
// events, graphs, privatepool, vmem) have no locks: the device lock guards
// them. The C front cache's spin lock (capi/front.c) is C's: Go takes no
// lock while holding it.
type lockRank uint8

const (
	_ lockRank = iota // 0: no rank ("none")
	// rankConfig is Allocator.cfgMu: Configure, which then takes each
	// device in turn, and the history (record_history).
	rankConfig
	// rankHistory is history.mu: the history's allocator-wide state
	// (labels, annotations); RecordHistory then takes each device.
	rankHistory
	// rankPause is pauser.mu: pause and resume by tag (pause.go), which
	// take each device in turn; BeginAllocateToPool takes it shared, as a
	// barrier, after its device lock is released.
	rankPause
	// rankDevice is device.mu: one device's state, everything below it.
	rankDevice
	// rankGate is Allocator.gate, shared or exclusive: the unsafe sections
	// (freeing memory, querying events) against announced capture begins
	// (device.go). Taken under a device lock, never the other way round.
	rankGate
	// rankUncached is uncached.mu: the allocations made while caching was
	// off (a free of one holds the gate shared).
	rankUncached
	// rankFront is frontCtl.mu (front.go): the front's policy (sync's read
	// of the conditions and what it tells the front, the devices' phase
	// generations), under a device lock, the history's or the uncached
	// record's.
	rankFront
	// rankIPC is ipcMaps.mu: the cache of opened IPC handles; no other
	// lock is taken while it is held, nor is it taken under a device lock.
	// (The import cache of other processes' expandable memory,
	// vmem.ImportCache, has its own unranked mutex, taken the same way:
	// alone, under no lock of these.)
	rankIPC
	// rankTags is tagTable.mu: the tags' names (tags.go); a leaf, taken
	// alone or under pauser.mu.
	rankTags
)

var rankNames = [...]string{"none", "Allocator.cfgMu", "history.mu", "pauser.mu", "device.mu", "Allocator.gate", "uncached.mu", "frontCtl.mu", "ipcMaps.mu", "tagTable.mu"}

func (r lockRank) String() string { return rankNames[r] }

// rankedMutex is a sync.Mutex with a rank, checked while check is set.
type rankedMutex struct {
	sync.Mutex
	rank  lockRank
	check atomic.Bool // debug_checks
}

func (m *rankedMutex) Lock() {
	if m.check.Load() {
		heldRanks.acquire(m.rank)
	}
	m.Mutex.Lock()
}

func (m *rankedMutex) Unlock() {
	if heldRanks.n.Load() != 0 {
		heldRanks.release(m.rank)
	}
	m.Mutex.Unlock()
}

// rankedRWMutex is a sync.RWMutex with a rank, checked while check is
// set; shared and exclusive holds count alike.
type rankedRWMutex struct {
	sync.RWMutex
	rank  lockRank
	check atomic.Bool // debug_checks
}

func (m *rankedRWMutex) Lock() {
	if m.check.Load() {
		heldRanks.acquire(m.rank)
	}
	m.RWMutex.Lock()
}

func (m *rankedRWMutex) Unlock() {
	if heldRanks.n.Load() != 0 {
		heldRanks.release(m.rank)
	}
	m.RWMutex.Unlock()
}

func (m *rankedRWMutex) RLock() {
	if m.check.Load() {
		heldRanks.acquire(m.rank)
	}
	m.RWMutex.RLock()
}

func (m *rankedRWMutex) RUnlock() {
	if heldRanks.n.Load() != 0 {
		heldRanks.release(m.rank)
	}
	m.RWMutex.RUnlock()
}

// heldRanks is, for each goroutine that holds checked locks, their ranks
// in acquisition order. Go has no goroutine-local storage: the goroutine's
// id is read from its stack header (a microsecond; only under
// debug_checks).
var heldRanks rankTable

type rankTable struct {
	n    atomic.Int64 // entries in held: release looks only when some exist
	mu   sync.Mutex   // guards held; a leaf, unranked
	held map[uint64][]lockRank
}

// acquire checks that the calling goroutine may take a lock of rank r now
// and records it; a violation panics, naming both locks.
func (t *rankTable) acquire(r lockRank) {
	g := goroutineID()
	t.mu.Lock()
	held := t.held[g]
	if n := len(held); n > 0 && held[n-1] >= r {
		top := held[n-1]
		t.mu.Unlock()
		panic(fmt.Sprintf("cudapool: lock order violated (debug_checks): taking %v (rank %d) while holding %v (rank %d); see allocator/lockrank.go", r, r, top, top))
	}
	if t.held == nil {
		t.held = make(map[uint64][]lockRank)
	}
	t.held[g] = append(held, r)
	t.n.Add(1)
	t.mu.Unlock()
}

// release forgets the calling goroutine's newest hold of rank r, if it
// was recorded (checking may have been turned on while it was held).
func (t *rankTable) release(r lockRank) {
	g := goroutineID()
	t.mu.Lock()
	held := t.held[g]
	for i := len(held) - 1; i >= 0; i-- {
		if held[i] == r {
			held = append(held[:i], held[i+1:]...)
			t.n.Add(-1)
			break
		}
	}
	if len(held) == 0 {
		delete(t.held, g)
	} else {
		t.held[g] = held
	}
	t.mu.Unlock()
}

// goroutineID is the calling goroutine's id, from the first line of its
// stack trace ("goroutine 12 [running]:").
func goroutineID() uint64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	const prefix = "goroutine "
	var id uint64
	for i := len(prefix); i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
		id = id*10 + uint64(b[i]-'0')
	}
	return id
}

// checkRanks turns the rank checks of a's locks on or off (debug_checks).
// The IPC cache's lock is the process's: once any allocator checks, it is
// checked for all.
func (a *Allocator) checkRanks(on bool) {
	a.cfgMu.check.Store(on)
	a.hist.mu.check.Store(on)
	a.gate.check.Store(on)
	a.unc.mu.check.Store(on)
	a.front.mu.check.Store(on)
	a.pauser.mu.check.Store(on)
	a.tags.mu.check.Store(on)
	if on {
		ipcMaps.mu.check.Store(true)
	}
}
