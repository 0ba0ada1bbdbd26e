// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"fmt"
	"math/rand"
	"sort"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// onStream routes the allocations of one stream, as a capture's filter does.
func onStream(cs cuda.Stream) func(cuda.Stream) bool {
	return func(s cuda.Stream) bool { return s == cs }
}

func sortedPtrs(ps []cuda.Ptr) []cuda.Ptr {
	out := append([]cuda.Ptr(nil), ps...)
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

func poolLayout(t testing.TB, a *allocator.Allocator, id allocator.PoolID) []pools.SegmentState {
	t.Helper()
	l, err := allocator.PoolLayout(a, 0, id)
	require.NoError(t, err)
	return l
}

// requireLayoutRestored checks that every segment of the checkpoint is in
// the pool as saved: block for block with ordinary segments; with
// expandable ones the allocated blocks (pages mapped since are free).
func requireLayoutRestored(t testing.TB, a *allocator.Allocator, cp *allocator.Checkpoint) {
	t.Helper()
	now := map[cuda.Ptr]pools.SegmentState{}
	for _, s := range poolLayout(t, a, cp.Pool()) {
		now[s.Base] = s
	}
	for _, s := range allocator.CheckpointLayout(cp) {
		n, ok := now[s.Base]
		require.True(t, ok, "segment %#x of the checkpoint is gone", s.Base)
		if !s.Expandable {
			require.Equal(t, s, n, "segment %#x", s.Base)
			continue
		}
		var want, got []pools.BlockState
		for _, b := range s.Blocks {
			if b.Allocated {
				want = append(want, b)
			}
		}
		for _, b := range n.Blocks {
			if b.Allocated {
				got = append(got, b)
			}
		}
		require.Equal(t, want, got, "expandable segment %#x", s.Base)
	}
}

func TestCheckpointRestore(t *testing.T) {
	for _, conf := range []string{ordinary, ""} {
		t.Run(conf, func(t *testing.T) { testCheckpointRestore(t, conf) })
	}
}

// A graph-tree sequence: record into a pool, checkpoint, let the pool
// diverge (an output dies, another capture allocates), restore.
func testCheckpointRestore(t *testing.T, conf string) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 4*GiB, conf+",record_history:64")
	g := allocator.PoolID{A: 1}
	const cs = cuda.Stream(7)
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeThreadLocal)
	x := mustMalloc(t, a, 0, 1000, cs)
	y := mustMalloc(t, a, 0, 3*MiB, cs)
	tmp := mustMalloc(t, a, 0, 40*MiB, cs)
	z := mustMalloc(t, a, 0, 5000, cs)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: tmp})) // a temporary of the graph
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.True(t, allocator.SetContext(a, y, 42))
	eager := mustMalloc(t, a, 0, 4096, 1) // default pool, untouched by all this

	cp, err := a.CheckpointPool(0, g)
	require.NoError(t, err)
	require.Equal(t, 0, cp.Device())
	require.Equal(t, g, cp.Pool())
	require.Equal(t, sortedPtrs([]cuda.Ptr{x, y, z}), cp.Allocated())
	live, err := a.CheckPoolLive(0, g, []cuda.Ptr{z, x, y, x})
	require.NoError(t, err)
	require.True(t, live, "order and duplicates do not matter")
	before := stats(t, a, 0)

	// Diverge: y dies, a second recording allocates more (a new segment too).
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y, Size: 3 * MiB}))
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeThreadLocal)
	w := mustMalloc(t, a, 0, 2*MiB, cs)
	v := mustMalloc(t, a, 0, 100*MiB, cs)
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	live, err = a.CheckPoolLive(0, g, cp.Allocated())
	require.NoError(t, err)
	require.False(t, live)
	reserved := stats(t, a, 0).ReservedBytes[pools.StatAll].Current

	res, err := a.RestoreCheckpoint(0, cp)
	require.NoError(t, err)
	require.Equal(t, sortedPtrs([]cuda.Ptr{x, z, w, v}), res.Freed, "every block allocated before, as PyTorch's ptrs_freed")
	require.Equal(t, cp.Allocated(), res.Allocated)
	live, err = a.CheckPoolLive(0, g, res.Allocated)
	require.NoError(t, err)
	require.True(t, live)
	require.NoError(t, a.CheckInvariants(), "statistics equal a recount")
	requireLayoutRestored(t, a, cp)
	require.Equal(t, uint64(42), allocator.ContextOf(a, y), "contexts come back")
	after := stats(t, a, 0)
	require.Equal(t, reserved, after.ReservedBytes[pools.StatAll].Current, "segments made since stay (free)")
	for _, k := range []struct {
		name    string
		b, a    pools.StatArray
		current bool
	}{
		{"allocation", before.Allocation, after.Allocation, true},
		{"allocated_bytes", before.AllocatedBytes, after.AllocatedBytes, true},
		{"requested_bytes", before.RequestedBytes, after.RequestedBytes, true},
	} {
		require.Equal(t, k.b[pools.StatAll].Current, k.a[pools.StatAll].Current, k.name)
	}
	// The restored blocks keep their requested sizes: freeing with the
	// size asked for works, with another size not.
	require.ErrorIs(t, a.Free(allocator.FreeRequest{Ptr: y, Size: 3*MiB + 1}), allocator.ErrInvalidArgument)

	// Twice: the same.
	res2, err := a.RestoreCheckpoint(0, cp)
	require.NoError(t, err)
	require.Equal(t, res.Allocated, res2.Allocated)
	require.Equal(t, res.Allocated, res2.Freed)
	requireLayoutRestored(t, a, cp)

	// The trace shows the frees and allocations the restore made.
	actions := map[string]int{}
	for _, e := range a.Snapshot(nil, true).DeviceTraces[0] {
		actions[e.Action]++
	}
	require.Positive(t, actions["free_completed"])

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y, Size: 3 * MiB}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: eager, Size: 4096}))
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// Restoring one pool while another captures: no driver free, no event
// query (the sim logs any as a violation), though frees are pending.
func TestCheckpointRestoreDuringAnotherCapture(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, 4*GiB, "")
	g, other := allocator.PoolID{A: 1}, allocator.PoolID{A: 2}
	require.NoError(t, a.BeginAllocateToPool(0, g, onStream(7)))
	x := mustMalloc(t, a, 0, 4096, 7)
	require.NoError(t, a.EndAllocateToPool(0, g))
	cp, err := a.CheckpointPool(0, g)
	require.NoError(t, err)
	require.NoError(t, a.BeginAllocateToPool(0, g, onStream(7)))
	mustMalloc(t, a, 0, 8*MiB, 7)
	require.NoError(t, a.EndAllocateToPool(0, g))

	// A pending free with an event, in the default pool.
	p := mustMalloc(t, a, 0, 4096, 1)
	require.NoError(t, a.RecordStream(p, 2))
	drv.Submit(2)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	beginCapture(t, a, drv, other, 9, cuda.CaptureModeGlobal)
	mustMalloc(t, a, 0, 4096, 9)
	res, err := a.RestoreCheckpoint(0, cp)
	require.NoError(t, err)
	require.Equal(t, []cuda.Ptr{x}, res.Allocated)
	_, err = a.CheckpointPool(0, g)
	require.NoError(t, err)
	require.NoError(t, drv.EndCapture(9))
	require.NoError(t, a.EndAllocateToPool(0, other))
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
	require.NoError(t, a.CheckInvariants())
}

// Blocks of the pool that other streams use (record_stream), as PyTorch
// decides: a freed block waiting for its events stops the checkpoint (and
// the restore) until the events complete; an allocated block with other
// streams' uses stops the restore, which would have to free it.
func TestCheckpointAwaitingEvents(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, "")
	g := allocator.PoolID{B: 1}
	require.NoError(t, a.CreateOrIncrefPool(0, g))
	require.NoError(t, a.BeginAllocateToPool(0, g, onStream(7)))
	x := mustMalloc(t, a, 0, 4096, 7)
	y := mustMalloc(t, a, 0, 4096, 7)
	require.NoError(t, a.EndAllocateToPool(0, g))
	cp, err := a.CheckpointPool(0, g)
	require.NoError(t, err)

	require.NoError(t, a.RecordStream(y, 3))
	drv.Submit(3) // stream 3 still reads y
	before := stats(t, a, 0)
	_, err = a.RestoreCheckpoint(0, cp)
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.ErrorContains(t, err, "used by other streams")
	require.Equal(t, before, stats(t, a, 0), "nothing changed")

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: y})) // waits for stream 3
	_, err = a.CheckpointPool(0, g)
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.ErrorContains(t, err, "events must complete")
	_, err = a.RestoreCheckpoint(0, cp)
	require.ErrorContains(t, err, "events must complete")
	live, err := a.CheckPoolLive(0, g, []cuda.Ptr{x})
	require.NoError(t, err)
	require.True(t, live, "nothing changed")

	drv.Complete(3) // the events complete: both work again
	_, err = a.CheckpointPool(0, g)
	require.NoError(t, err)
	res, err := a.RestoreCheckpoint(0, cp)
	require.NoError(t, err)
	require.Equal(t, sortedPtrs([]cuda.Ptr{x, y}), res.Allocated)
	require.NoError(t, a.CheckInvariants())
}

func TestCheckpointErrors(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 2, GiB, ordinary)
	g, gone := allocator.PoolID{A: 1}, allocator.PoolID{A: 2}
	require.NoError(t, a.BeginAllocateToPool(0, g, onStream(7)))
	mustMalloc(t, a, 0, 4096, 7)
	require.NoError(t, a.EndAllocateToPool(0, g))
	cp, err := a.CheckpointPool(0, g)
	require.NoError(t, err)
	require.NoError(t, a.CreateOrIncrefPool(0, gone))
	require.NoError(t, a.ReleasePool(0, gone)) // released, not yet emptied
	cpGone, err := a.CheckpointPool(0, gone)
	require.NoError(t, err, "as in PyTorch, a released pool that still exists can be checkpointed")
	require.Empty(t, cpGone.Allocated())
	require.NoError(t, a.CreateOrIncrefPool(1, g))
	cp1, err := a.CheckpointPool(1, g) // the same id on device 1
	require.NoError(t, err)
	before := stats(t, a, 0)

	errOfCP := func(_ *allocator.Checkpoint, err error) error { return err }
	errOfRR := func(_ allocator.RestoreResult, err error) error { return err }
	errOfLive := func(_ bool, err error) error { return err }
	for _, tc := range []struct {
		name string
		err  error
		kind error
		msg  string
	}{
		{"checkpoint: bad device", errOfCP(a.CheckpointPool(2, g)), allocator.ErrInvalidDevice, "device 2 does not exist"},
		{"checkpoint: unknown pool", errOfCP(a.CheckpointPool(0, allocator.PoolID{A: 9})), allocator.ErrUnknownPool, "no private pool {9,0}"},
		{"checkpoint: default pool", errOfCP(a.CheckpointPool(0, allocator.PoolID{})), allocator.ErrUnknownPool, "no private pool {0,0}"},
		{"restore: released pool", errOfRR(a.RestoreCheckpoint(0, cpGone)), allocator.ErrUnknownPool, "released by all its holders"},
		{"restore: bad device", errOfRR(a.RestoreCheckpoint(-1, cp)), allocator.ErrInvalidDevice, "device -1"},
		{"restore: nil checkpoint", errOfRR(a.RestoreCheckpoint(0, nil)), allocator.ErrInvalidArgument, "no checkpoint"},
		{"restore: another device's checkpoint", errOfRR(a.RestoreCheckpoint(0, cp1)), allocator.ErrInvalidArgument, "device 1, not device 0"},
		{"live: bad device", errOfLive(a.CheckPoolLive(5, g, nil)), allocator.ErrInvalidDevice, "device 5"},
		{"live: unknown pool", errOfLive(a.CheckPoolLive(0, allocator.PoolID{B: 9}, nil)), allocator.ErrUnknownPool, "{0,9}"},
	} {
		require.ErrorIs(t, tc.err, tc.kind, tc.name)
		require.ErrorContains(t, tc.err, tc.msg, tc.name)
		var e *allocator.Error
		require.ErrorAs(t, tc.err, &e, tc.name)
	}
	live, err := a.CheckPoolLive(0, gone, nil)
	require.NoError(t, err, "a released pool that still exists can be asked")
	require.True(t, live)

	// An unannounced capture's automatic pool: checkpointed, not restored
	// into (its capture may still be under way).
	b, err := allocator.New(drv, allocator.DefaultConfig())
	require.NoError(t, err)
	require.NoError(t, drv.BeginCapture(11, cuda.CaptureModeRelaxed))
	_, cid, _ := drv.StreamCaptureInfo(0, 11)
	mustMalloc(t, b, 0, 4096, 11)
	cpAuto, err := b.CheckpointPool(0, allocator.PoolID{A: 1<<63 | cid})
	require.NoError(t, err)
	require.Len(t, cpAuto.Allocated(), 1)
	_, err = b.RestoreCheckpoint(0, cpAuto)
	require.ErrorIs(t, err, allocator.ErrUnknownPool)
	require.ErrorContains(t, err, "automatic pool")
	require.NoError(t, drv.EndCapture(11))

	// Restoring a pool that a capture is recording into: refused.
	beginCapture(t, a, drv, g, 7, cuda.CaptureModeThreadLocal)
	_, err = a.RestoreCheckpoint(0, cp)
	require.ErrorIs(t, err, allocator.ErrCaptureUnderway)
	require.NoError(t, drv.EndCapture(7))
	require.NoError(t, a.EndAllocateToPool(0, g))

	// A segment of the checkpoint given back since: the pool was released
	// and emptied, then held again.
	require.NoError(t, a.ReleasePool(0, g)) // both graphs (recordings) die
	require.NoError(t, a.ReleasePool(0, g))
	_, err = a.RestoreCheckpoint(0, cp)
	require.ErrorIs(t, err, allocator.ErrUnknownPool, "released")
	ps, err := a.CheckPoolLive(0, g, cp.Allocated())
	require.NoError(t, err)
	require.True(t, ps)
	for _, p := range cp.Allocated() {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.EmptyCache(0))
	require.NoError(t, a.CreateOrIncrefPool(0, g)) // a new pool under the old id
	require.NoError(t, a.BeginAllocateToPool(0, g, onStream(7)))
	mustMalloc(t, a, 0, 4096, 7)
	require.NoError(t, a.EndAllocateToPool(0, g))
	mid := stats(t, a, 0)
	_, err = a.RestoreCheckpoint(0, cp)
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.ErrorContains(t, err, "no longer in the pool")
	require.Equal(t, mid, stats(t, a, 0), "nothing changed")
	require.NotEqual(t, before, mid)
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

func TestCheckpointRandomized(t *testing.T) {
	for _, conf := range []string{ordinary, "", "max_split_size_mb:40,roundup_power2_divisions:4"} {
		for seed := int64(1); seed <= 4; seed++ {
			t.Run(fmt.Sprintf("%s/%d", conf, seed), func(t *testing.T) {
				newCheckpointMachine(t, conf, seed).run(1500)
			})
		}
	}
}

// checkpointMachine runs capture-like sequences into a private pool on the
// simulator, with a second pool capturing now and then, takes checkpoints
// at random points and restores random earlier ones, mirroring what should
// be allocated and checking everything after each step.
type checkpointMachine struct {
	t        *testing.T
	a        *allocator.Allocator
	drv      *sim.Driver
	rng      *rand.Rand
	conf     string
	live     map[cuda.Ptr]mirrored
	recP     bool
	recQ     bool
	cps      []savedCheckpoint
	restores int
	holdsP   int // CreateOrIncref and each recording (a graph) hold P
	refused  map[string]int
}

type mirrored struct {
	size   uint64
	inPool bool // allocated in P
}

type savedCheckpoint struct {
	cp   *allocator.Checkpoint
	pool map[cuda.Ptr]uint64 // P's allocations then, with their sizes
}

var (
	poolP   = allocator.PoolID{A: 1}
	poolQ   = allocator.PoolID{B: 1}
	streamP = cuda.Stream(7)
	streamQ = cuda.Stream(8)
)

func newCheckpointMachine(t *testing.T, conf string, seed int64) *checkpointMachine {
	lockThread(t)
	a, drv := newAlloc(t, 1, 2*GiB, conf)
	require.NoError(t, a.CreateOrIncrefPool(0, poolP))
	return &checkpointMachine{t: t, a: a, drv: drv, rng: rand.New(rand.NewSource(seed)), conf: conf, live: map[cuda.Ptr]mirrored{}, holdsP: 1, refused: map[string]int{}}
}

func (m *checkpointMachine) size() uint64 {
	switch m.rng.Intn(10) {
	case 0:
		return uint64(m.rng.Intn(60*MiB)) + 1
	case 1, 2, 3:
		return uint64(m.rng.Intn(8*MiB)) + 1
	default:
		return uint64(m.rng.Intn(MiB)) + 1
	}
}

func (m *checkpointMachine) poolSet() map[cuda.Ptr]uint64 {
	out := map[cuda.Ptr]uint64{}
	for p, l := range m.live {
		if l.inPool {
			out[p] = l.size
		}
	}
	return out
}

func keys(set map[cuda.Ptr]uint64) []cuda.Ptr {
	var out []cuda.Ptr
	for p := range set {
		out = append(out, p)
	}
	return sortedPtrs(out)
}

func (m *checkpointMachine) pick() (cuda.Ptr, bool) {
	if len(m.live) == 0 {
		return 0, false
	}
	ps := make([]cuda.Ptr, 0, len(m.live))
	for p := range m.live {
		ps = append(ps, p)
	}
	ps = sortedPtrs(ps)
	return ps[m.rng.Intn(len(ps))], true
}

func (m *checkpointMachine) malloc(s cuda.Stream) {
	size := m.size()
	p, err := m.a.Malloc(&allocator.MallocRequest{Size: size, Stream: s})
	if err != nil {
		require.ErrorIs(m.t, err, allocator.ErrOutOfMemory)
		return
	}
	_, dup := m.live[p]
	require.False(m.t, dup, "%#x handed out twice", p)
	m.live[p] = mirrored{size: size, inPool: s == streamP && m.recP}
}

func (m *checkpointMachine) step() {
	t := m.t
	switch op := m.rng.Intn(100); {
	case op < 30:
		m.malloc(streamP)
	case op < 36:
		m.malloc([]cuda.Stream{streamQ, 1}[m.rng.Intn(2)])
	case op < 58:
		if p, ok := m.pick(); ok {
			require.NoError(t, m.a.Free(allocator.FreeRequest{Ptr: p, Size: m.live[p].size}))
			delete(m.live, p)
		}
	case op < 66: // begin or end recording into P
		if m.recP {
			require.NoError(t, m.drv.EndCapture(streamP))
			require.NoError(t, m.a.EndAllocateToPool(0, poolP))
		} else {
			beginCapture(t, m.a, m.drv, poolP, streamP, cuda.CaptureModeThreadLocal)
			m.holdsP++
		}
		m.recP = !m.recP
	case op < 70: // another pool's capture, now and then
		if m.recQ {
			require.NoError(t, m.drv.EndCapture(streamQ))
			require.NoError(t, m.a.EndAllocateToPool(0, poolQ))
			require.NoError(t, m.a.ReleasePool(0, poolQ))
		} else {
			beginCapture(t, m.a, m.drv, poolQ, streamQ, cuda.CaptureModeThreadLocal)
		}
		m.recQ = !m.recQ
	case op < 72: // another stream uses a block
		if p, ok := m.pick(); ok {
			require.NoError(t, m.a.RecordStream(p, 3))
			m.drv.Submit(3)
		}
	case op < 76:
		m.drv.CompleteAll()
	case op < 86:
		m.checkpoint()
	default:
		m.restore()
	}
}

func (m *checkpointMachine) checkpoint() {
	cp, err := m.a.CheckpointPool(0, poolP)
	if err != nil {
		require.ErrorIs(m.t, err, allocator.ErrInvalidArgument, "only blocks awaiting events stop a checkpoint")
		require.ErrorContains(m.t, err, "events must complete")
		return
	}
	set := m.poolSet()
	require.Equal(m.t, keys(set), cp.Allocated(), "the checkpoint holds the pool's allocations")
	m.cps = append(m.cps, savedCheckpoint{cp, set})
}

func (m *checkpointMachine) restore() {
	if len(m.cps) == 0 {
		return
	}
	sc := m.cps[m.rng.Intn(len(m.cps))]
	before := m.poolSet()
	res, err := m.a.RestoreCheckpoint(0, sc.cp)
	if err != nil {
		switch {
		case m.recP:
			require.ErrorIs(m.t, err, allocator.ErrCaptureUnderway)
			m.refused["recording"]++
		default:
			require.ErrorIs(m.t, err, allocator.ErrInvalidArgument)
			m.refused["other streams"]++
		}
		return // the per-step check verifies that nothing changed
	}
	require.False(m.t, m.recP)
	m.restores++
	require.Equal(m.t, keys(before), res.Freed)
	require.Equal(m.t, sc.cp.Allocated(), res.Allocated)
	for p := range before {
		delete(m.live, p)
	}
	for p, size := range sc.pool {
		_, dup := m.live[p]
		require.False(m.t, dup, "restored %#x is allocated elsewhere", p)
		m.live[p] = mirrored{size: size, inPool: true}
	}
	requireLayoutRestored(m.t, m.a, sc.cp)
}

func (m *checkpointMachine) check() {
	t := m.t
	require.NoError(t, m.a.CheckInvariants())
	require.Zero(t, m.drv.Violations(), "%v", m.drv.ViolationLog())
	live, err := m.a.CheckPoolLive(0, poolP, keys(m.poolSet()))
	require.NoError(t, err)
	require.True(t, live, "the pool's allocated set is the mirror's")
}

func (m *checkpointMachine) run(steps int) {
	for i := 0; i < steps; i++ {
		m.step()
		m.check()
	}
	m.t.Logf("%d checkpoints, %d restores, refused: %v", len(m.cps), m.restores, m.refused)
	require.Positive(m.t, m.restores, "the sequence restored something")
	if m.recP {
		require.NoError(m.t, m.drv.EndCapture(streamP))
		require.NoError(m.t, m.a.EndAllocateToPool(0, poolP))
	}
	if m.recQ {
		require.NoError(m.t, m.drv.EndCapture(streamQ))
		require.NoError(m.t, m.a.EndAllocateToPool(0, poolQ))
		require.NoError(m.t, m.a.ReleasePool(0, poolQ))
	}
	m.drv.CompleteAll()
	for p, l := range m.live {
		require.NoError(m.t, m.a.Free(allocator.FreeRequest{Ptr: p, Size: l.size}))
	}
	for ; m.holdsP > 0; m.holdsP-- {
		n, err := m.a.PoolUseCount(0, poolP)
		require.NoError(m.t, err)
		require.Equal(m.t, m.holdsP, n)
		require.NoError(m.t, m.a.ReleasePool(0, poolP))
	}
	require.NoError(m.t, m.a.EmptyCache(0))
	require.NoError(m.t, m.a.CheckInvariants())
	st := stats(m.t, m.a, 0)
	require.Zero(m.t, st.ReservedBytes[pools.StatAll].Current, "everything given back")
	require.Zero(m.t, m.drv.Used(0))
}
