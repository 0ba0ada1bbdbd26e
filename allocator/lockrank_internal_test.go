// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// debugAllocator is an allocator under debug_checks: with the default
// configuration (expandable segments with stitching: mapping, unmapping and
// moving pages take locks of their own) where stitch, else with ordinary
// segments.
func debugAllocator(t *testing.T, devices int, stitch bool) *Allocator {
	t.Helper()
	cfg := DefaultConfig()
	cfg.DebugChecks = true
	cfg.ExpandableSegments, cfg.Stitch = stitch, stitch
	a, err := New(sim.New(sim.Options{Devices: devices, Memory: 1 << 30}), cfg)
	require.NoError(t, err)
	return a
}

// Under debug_checks the allocator's own paths respect the ranks: every
// operation that takes several locks (configuration, history, captures
// and the gate, empty_cache, caching off) runs without a violation, and
// every recorded hold is released.
func TestLockRanksHeld(t *testing.T) {
	for _, stitch := range []bool{false, true} {
		t.Run(fmt.Sprintf("stitch=%v", stitch), func(t *testing.T) { testLockRanksHeld(t, stitch) })
	}
}

func testLockRanksHeld(t *testing.T, stitch bool) {
	a := debugAllocator(t, 2, stitch)
	require.Zero(t, heldRanks.n.Load())
	cfg := a.Config()
	a.Configure(cfg) // cfgMu, then each device, then the front
	require.NoError(t, a.RecordHistory(HistoryOptions{Enabled: true, MaxEntries: 10, When: HistoryAll}))
	p, err := a.Malloc(&MallocRequest{Size: 4096, Stream: 1})
	require.NoError(t, err)
	require.NoError(t, a.RecordStream(p, 2))
	require.NoError(t, a.Free(FreeRequest{Dev: -1, Ptr: p})) // device, then the gate (events)
	pool := PoolID{A: 1}
	require.NoError(t, a.BeginAllocateToPool(1, pool, func(s cuda.Stream) bool { return s == 7 })) // device, then the gate exclusive
	q, err := a.Malloc(&MallocRequest{Dev: 1, Size: 4096, Stream: 7})
	require.NoError(t, err)
	require.NoError(t, a.EndAllocateToPool(1, pool))
	require.NoError(t, a.Free(FreeRequest{Dev: 1, Ptr: q}))
	require.NoError(t, a.ReleasePool(1, pool))
	require.NoError(t, a.EmptyCache(0)) // each device, then the gate
	a.SetCaching(false)
	u, err := a.Malloc(&MallocRequest{Size: 4096})
	require.NoError(t, err)
	require.NoError(t, a.Free(FreeRequest{Ptr: u})) // the gate, then the uncached record
	a.SetCaching(true)
	a.Snapshot(nil, true) // history, then each device
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, heldRanks.n.Load(), "every hold released")

	// Turning the checks off while locks are held leaves nothing behind.
	cfg.DebugChecks = false
	a.Configure(cfg)
	require.Zero(t, heldRanks.n.Load())
	require.False(t, a.devs[0].debug)
	require.False(t, a.gate.check.Load())
}

// A path that takes locks out of order fails under debug_checks, naming
// both locks; without the checks nothing is recorded.
func TestLockRanksViolated(t *testing.T) {
	a := debugAllocator(t, 2, false)
	d0, d1 := a.devs[0], a.devs[1]
	for _, tc := range []struct {
		name, msg    string
		outer, inner func()
		undo         []func()
	}{
		{"configuration under a device", "taking Allocator.cfgMu (rank 1) while holding device.mu (rank 4)",
			d0.enter, a.cfgMu.Lock, []func(){d0.leave}},
		{"history under a device", "taking history.mu (rank 2) while holding device.mu (rank 4)",
			d0.enter, a.hist.mu.Lock, []func(){d0.leave}},
		// A device lock is checked once taken: the panic leaves it held.
		{"two devices", "taking device.mu (rank 4) while holding device.mu (rank 4)",
			d0.enter, d1.enter, []func(){d1.leave, d0.leave}},
		{"a device under the gate", "taking device.mu (rank 4) while holding Allocator.gate (rank 5)",
			a.gate.RLock, d0.enter, []func(){d0.leave, a.gate.RUnlock}},
		{"the gate under the uncached record", "taking Allocator.gate (rank 5) while holding uncached.mu (rank 6)",
			a.unc.mu.Lock, a.gate.RLock, []func(){a.unc.mu.Unlock}},
		{"a device under the front's policy", "taking device.mu (rank 4) while holding frontCtl.mu (rank 7)",
			a.front.mu.Lock, d0.enter, []func(){d0.leave, a.front.mu.Unlock}},
		{"a device under the IPC cache", "taking device.mu (rank 4) while holding ipcMaps.mu (rank 8)",
			ipcMaps.mu.Lock, d1.enter, []func(){d1.leave, ipcMaps.mu.Unlock}},
		{"the pause mutex under a device", "taking pauser.mu (rank 3) while holding device.mu (rank 4)",
			d0.enter, a.pauser.mu.RLock, []func(){d0.leave}},
		{"a device under the tags' names", "taking device.mu (rank 4) while holding tagTable.mu (rank 9)",
			a.tags.mu.Lock, d0.enter, []func(){d0.leave, a.tags.mu.Unlock}},
	} {
		tc.outer()
		require.PanicsWithValue(t, "cudapool: lock order violated (debug_checks): "+tc.msg+"; see allocator/lockrank.go", tc.inner, tc.name)
		for _, u := range tc.undo {
			u()
		}
		require.Zero(t, heldRanks.n.Load(), tc.name)
	}

	// Without debug_checks the same order goes unchecked.
	b, err := New(sim.New(sim.Options{Memory: 1 << 30}), DefaultConfig())
	require.NoError(t, err)
	b.devs[0].enter()
	b.cfgMu.Lock()
	require.Zero(t, heldRanks.n.Load())
	b.cfgMu.Unlock()
	b.devs[0].leave()
}

// nopFront is a Front that holds nothing: what the allocator tells it is
// counted.
type nopFront struct{ policies, invalid int }

func (f *nopFront) Pending(int) bool                                    { return false }
func (f *nopFront) Holding(int) bool                                    { return false }
func (f *nopFront) Take(_ int, buf []PendingFree, _ bool) []PendingFree { return buf }
func (f *nopFront) SetPolicy(*FrontPolicy)                              { f.policies++ }
func (f *nopFront) Invalidate(int, cuda.Ptr)                            { f.invalid++ }
func (f *nopFront) Capacity() int                                       { return 8 }

// With a front, the policy's lock (frontCtl.mu) is taken under the device
// lock (phases, captures counted), the history's (its start and stop) and
// the uncached record's (caching off) without a violation.
func TestLockRanksFront(t *testing.T) {
	for _, stitch := range []bool{false, true} {
		t.Run(fmt.Sprintf("stitch=%v", stitch), func(t *testing.T) { testLockRanksFront(t, stitch) })
	}
}

func testLockRanksFront(t *testing.T, stitch bool) {
	a := debugAllocator(t, 1, stitch)
	f := &nopFront{}
	a.SetFront(f)
	a.ExpectAnnouncements()
	require.True(t, a.FrontEnabled())
	pool := PoolID{A: 1}
	require.NoError(t, a.BeginAllocateToPool(0, pool, nil)) // device, then the front's phases
	p, err := a.Malloc(&MallocRequest{Size: 4096, Stream: 1})
	require.NoError(t, err)
	require.NotZero(t, p)
	require.NoError(t, a.RecordStream(p, 2)) // invalidates p under the device lock
	require.NoError(t, a.EndAllocateToPool(0, pool))
	require.NoError(t, a.Free(FreeRequest{Ptr: p}))
	require.NoError(t, a.RecordHistory(HistoryOptions{Enabled: true, MaxEntries: 10, When: HistoryAll}))
	require.False(t, a.FrontEnabled(), "the history turns the front off")
	require.NoError(t, a.RecordHistory(HistoryOptions{}))
	a.SetCaching(false)
	u, err := a.Malloc(&MallocRequest{Size: 4096})
	require.NoError(t, err)
	require.NoError(t, a.Free(FreeRequest{Ptr: u}))
	a.SetCaching(true)
	a.Configure(a.Config())
	require.True(t, a.FrontEnabled())
	require.GreaterOrEqual(t, f.policies, 6, "the policy was pushed at each change")
	require.Equal(t, 1, f.invalid)
	require.Zero(t, heldRanks.n.Load(), "every hold released")
}

// Tags, pause and resume respect the ranks too: the pause mutex, then each
// device, then the gate; the tags' names alone.
func TestLockRanksPause(t *testing.T) {
	for _, stitch := range []bool{false, true} {
		t.Run(fmt.Sprintf("stitch=%v", stitch), func(t *testing.T) { testLockRanksPause(t, stitch) })
	}
}

func testLockRanksPause(t *testing.T, stitch bool) {
	a := debugAllocator(t, 2, stitch)
	id, err := a.TagID("kv")
	require.NoError(t, err)
	p, err := a.Malloc(&MallocRequest{Dev: 1, Size: 4 << 20, Tag: id})
	require.NoError(t, err)
	pool := PoolID{A: 1}
	require.NoError(t, a.BeginAllocateToPoolTagged(0, pool, id, nil)) // device, gate, then the pause mutex
	q, err := a.Malloc(&MallocRequest{Size: 4096})
	require.NoError(t, err)
	require.NoError(t, a.EndAllocateToPool(0, pool))
	require.NoError(t, a.Pause("", true)) // the pause mutex, the tags' names, each device, the gate
	require.Len(t, a.Paused(), 1)
	require.NoError(t, a.EmptyCache(0))
	require.NoError(t, a.Resume("kv"))
	_, err = a.ReleaseHostMemory()
	require.NoError(t, err)
	require.NoError(t, a.Free(FreeRequest{Dev: -1, Ptr: p}, FreeRequest{Dev: -1, Ptr: q}))
	require.NoError(t, a.ReleasePool(0, pool))
	a.Snapshot(nil, false)
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, heldRanks.n.Load(), "every hold released")
}
