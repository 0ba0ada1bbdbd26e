// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"errors"
	"runtime"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

const (
	KiB = 1 << 10
	MiB = 1 << 20
	GiB = 1 << 30
)

// ordinary is the configuration of the tests of ordinary segments (one
// cuMemAlloc each, the segment statistics): the default is expandable
// segments with stitching.
const ordinary = "expandable_segments:False"

// stitching is expandable segments with stitching (stitch follows
// expandable_segments), with the default 20 MiB map unit: the default,
// named by the tests of stitching's placements so that they do not depend
// on what the default is.
const stitching = "expandable_segments:True"

func newAlloc(t testing.TB, devices int, mem uint64, conf string) (*allocator.Allocator, *sim.Driver) {
	t.Helper()
	cfg, _, err := allocator.ParseConfig(conf)
	require.NoError(t, err)
	drv := sim.New(sim.Options{Devices: devices, Memory: mem})
	a, err := allocator.New(drv, cfg)
	require.NoError(t, err)
	return a, drv
}

func mustMalloc(t testing.TB, a *allocator.Allocator, dev int, size uint64, s cuda.Stream) cuda.Ptr {
	t.Helper()
	p, err := a.Malloc(&allocator.MallocRequest{Dev: dev, Size: size, Stream: s})
	require.NoError(t, err)
	require.NotZero(t, p)
	return p
}

func stats(t testing.TB, a *allocator.Allocator, dev int) pools.Stats {
	t.Helper()
	st, err := a.Stats(dev)
	require.NoError(t, err)
	return st
}

func TestMallocFreeReuse(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, ordinary)
	p := mustMalloc(t, a, 0, 4000, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 4000}))
	q := mustMalloc(t, a, 0, 4096, 0)
	require.Equal(t, p, q, "same rounded size on the same stream reuses the block")
	require.Equal(t, int64(1), drv.Allocs(0))
	st := stats(t, a, 0)
	require.Equal(t, int64(4096), st.AllocatedBytes[pools.StatSmall].Current)
	require.Equal(t, int64(2*MiB), st.ReservedBytes[pools.StatAll].Current)
	require.NoError(t, a.CheckInvariants())
}

func TestBadInput(t *testing.T) {
	a, drv := newAlloc(t, 2, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 0)
	before := stats(t, a, 0)

	for _, tc := range []struct {
		name string
		err  error
		kind error
	}{
		{"unknown pointer", a.Free(allocator.FreeRequest{Ptr: 0xdead000}), allocator.ErrUnknownPointer},
		{"interior pointer", a.Free(allocator.FreeRequest{Ptr: p + 512}), allocator.ErrUnknownPointer},
		{"other device", a.Free(allocator.FreeRequest{Dev: 1, Ptr: p}), allocator.ErrWrongDevice},
		{"size mismatch", a.Free(allocator.FreeRequest{Ptr: p, Size: 100}), allocator.ErrInvalidArgument},
		{"negative device", errOf(a.Malloc(&allocator.MallocRequest{Dev: -1, Size: 10})), allocator.ErrInvalidDevice},
		{"unknown device", errOf(a.Malloc(&allocator.MallocRequest{Dev: 2, Size: 10})), allocator.ErrInvalidDevice},
		{"absurd size", errOf(a.Malloc(&allocator.MallocRequest{Size: 1 << 61})), allocator.ErrOutOfMemory},
		{"1 EiB exactly", errOf(a.Malloc(&allocator.MallocRequest{Size: 1 << 60})), allocator.ErrOutOfMemory},
		{"record_stream unknown", a.RecordStream(0xbeef000, 3), allocator.ErrUnknownPointer},
		{"release unknown pool", a.ReleasePool(0, allocator.PoolID{A: 9}), allocator.ErrUnknownPool},
		{"end not recording", a.EndAllocateToPool(0, allocator.PoolID{A: 9}), allocator.ErrNotRecording},
		{"begin default pool", a.BeginAllocateToPool(0, allocator.PoolID{}, nil), allocator.ErrUnknownPool},
		{"fraction > 1", a.SetMemoryFraction(0, 1.5), allocator.ErrInvalidArgument},
		{"fraction NaN", a.SetMemoryFraction(0, nan()), allocator.ErrInvalidArgument},
		{"stats bad device", errOf2(a.Stats(5)), allocator.ErrInvalidDevice},
	} {
		require.Error(t, tc.err, tc.name)
		require.ErrorIs(t, tc.err, tc.kind, "%s: %v", tc.name, tc.err)
		var e *allocator.Error
		require.True(t, errors.As(tc.err, &e), tc.name)
		require.Contains(t, e.Error(), "cudapool: ")
	}
	require.Equal(t, before, stats(t, a, 0), "bad input changes nothing (an absurd size is no OOM in the stats)")
	_, err := a.Malloc(&allocator.MallocRequest{Size: 1 << 60})
	require.EqualError(t, err, "cudapool: malloc: CUDA out of memory. Tried to allocate more than 1EB memory.", "PyTorch's text")

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 4096}))
	err = a.Free(allocator.FreeRequest{Ptr: p, Size: 4096})
	require.ErrorIs(t, err, allocator.ErrAlreadyFreed, "double free is recognised: %v", err)

	z, err := a.Malloc(&allocator.MallocRequest{Size: 0})
	require.NoError(t, err, "size 0 is not an error")
	require.Zero(t, z)

	// A second begin of a recording pool is refused, as in PyTorch, and
	// holds nothing.
	require.NoError(t, a.BeginAllocateToPool(0, allocator.PoolID{A: 1}, nil))
	require.ErrorIs(t, a.BeginAllocateToPool(0, allocator.PoolID{A: 1}, nil), allocator.ErrAlreadyRecording)
	require.NoError(t, a.EndAllocateToPool(0, allocator.PoolID{A: 1}))
	require.ErrorIs(t, a.EndAllocateToPool(0, allocator.PoolID{A: 1}), allocator.ErrNotRecording, "ended twice")
	require.NoError(t, a.ReleasePool(0, allocator.PoolID{A: 1}))
	require.ErrorIs(t, a.ReleasePool(0, allocator.PoolID{A: 1}), allocator.ErrUnknownPool, "released twice")
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, drv.Violations())
}

func errOf(_ cuda.Ptr, err error) error     { return err }
func errOf2(_ pools.Stats, err error) error { return err }
func nan() float64                          { z := 0.0; return z / z }

// The OOM sequence: new segment, free oversize, free everything cached and
// retry, then out of memory, with the stats of each step.
func TestOOMRetrySequence(t *testing.T) {
	a, drv := newAlloc(t, 1, 100*MiB, ordinary)
	p := mustMalloc(t, a, 0, 60*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	st := stats(t, a, 0)
	require.Equal(t, int64(60*MiB), st.ReservedBytes[pools.StatAll].Current, "cached")

	q := mustMalloc(t, a, 0, 70*MiB, 0) // fails once, frees the cache, retries
	st = stats(t, a, 0)
	require.Equal(t, int64(1), st.NumAllocRetries)
	require.Equal(t, int64(1), st.NumSyncAllStreams)
	require.Equal(t, int64(1), st.NumDeviceFree)
	require.Equal(t, int64(2), st.NumDeviceAlloc)
	require.Equal(t, int64(70*MiB), st.ReservedBytes[pools.StatAll].Current)
	require.Zero(t, st.NumOOMs)

	drv.SetExternalUse(0, 10*MiB)
	_, err := a.Malloc(&allocator.MallocRequest{Size: 50 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	msg := err.Error()
	for _, want := range []string{
		"CUDA out of memory. Tried to allocate 50.00 MiB.",
		"GPU 0 has a total capacity of 100.00 MiB of which 20.00 MiB is free.",
		"Process 4242 has 10.00 MiB memory in use.",
		"70.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.",
	} {
		require.Contains(t, msg, want)
	}
	st = stats(t, a, 0)
	require.Equal(t, int64(1), st.NumOOMs)
	require.Equal(t, int64(2), st.NumAllocRetries)

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	mustMalloc(t, a, 0, 50*MiB, 0) // recovery after freeing
	require.NoError(t, a.CheckInvariants())
}

func TestOOMFreesOversizeFirst(t *testing.T) {
	a, drv := newAlloc(t, 1, 180*MiB, ordinary+",max_split_size_mb:40")
	big := mustMalloc(t, a, 0, 100*MiB, 0)
	small := mustMalloc(t, a, 0, 30*MiB, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: big}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: small}))
	// The cached 100 MiB block is too large for 70 MiB (>= 70+20) and the
	// device too full for a new segment: the oversize block goes first.
	mustMalloc(t, a, 0, 70*MiB, 0)
	st := stats(t, a, 0)
	require.Zero(t, st.NumAllocRetries, "freed the cached oversize block without a full retry")
	require.Equal(t, int64(1), st.NumDeviceFree)
	require.Equal(t, int64(30*MiB+70*MiB), st.ReservedBytes[pools.StatAll].Current, "the 30 MiB block stays cached")
	require.Equal(t, int64(1), st.OversizeSegments.Current)
	require.Zero(t, drv.Violations())
}

func TestMemoryFractionLimits(t *testing.T) {
	a, _ := newAlloc(t, 1, 1000*MiB, "")
	require.NoError(t, a.SetMemoryFraction(0, 0.1))
	p := mustMalloc(t, a, 0, 80*MiB, 0)
	_, err := a.Malloc(&allocator.MallocRequest{Size: 40 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.Contains(t, err.Error(), "100.00 MiB allowed;")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	mustMalloc(t, a, 0, 40*MiB, 0)
	require.NoError(t, a.SetMemoryFraction(0, 1))
	mustMalloc(t, a, 0, 500*MiB, 0)
}

func TestGarbageCollectionThreshold(t *testing.T) {
	a, drv := newAlloc(t, 1, 1000*MiB, ordinary+",garbage_collection_threshold:0.5")
	require.NoError(t, a.SetMemoryFraction(0, 0.999)) // GC needs a limit (1 is none)
	var ps []cuda.Ptr
	for i := 0; i < 9; i++ { // 540 MiB: above the 500 MiB threshold
		ps = append(ps, mustMalloc(t, a, 0, 60*MiB, 0))
	}
	for _, p := range ps {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	frees := drv.Frees(0)
	mustMalloc(t, a, 0, 100*MiB, 0) // no cached block fits: GC first
	require.Greater(t, drv.Frees(0), frees, "old cached segments collected")
	st := stats(t, a, 0)
	require.LessOrEqual(t, st.ReservedBytes[pools.StatAll].Current, int64(500*MiB+100*MiB))
	require.Zero(t, st.NumAllocRetries, "GC made room without the full retry")
}

func TestEmptyCacheReturnsEverythingFree(t *testing.T) {
	a, drv := newAlloc(t, 2, GiB, ordinary)
	keep := mustMalloc(t, a, 1, 4096, 0)
	var ps []cuda.Ptr
	for i := 1; i < 50; i++ {
		ps = append(ps, mustMalloc(t, a, i%2, uint64(i)*123*KiB, cuda.Stream(i%3)))
	}
	for _, p := range ps {
		dev := 0
		if err := a.Free(allocator.FreeRequest{Ptr: p}); errors.Is(err, allocator.ErrWrongDevice) {
			dev = 1
			require.NoError(t, a.Free(allocator.FreeRequest{Dev: dev, Ptr: p}))
		} else {
			require.NoError(t, err)
		}
	}
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 0, drv.Live(0))
	require.Equal(t, 1, drv.Live(1), "the segment holding a live block stays")
	require.NoError(t, a.Free(allocator.FreeRequest{Dev: 1, Ptr: keep}))
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, 0, drv.Live(1))
	require.Zero(t, drv.LiveEvents())
}

func TestBaseAllocation(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	p := mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 0, 8192, 0)
	base, size, err := a.BaseAllocation(q)
	require.NoError(t, err)
	require.Equal(t, p, base, "both blocks share the first small segment")
	require.Equal(t, uint64(2*MiB), size)
	base2, _, err := a.BaseAllocation(q + 100)
	require.NoError(t, err, "an interior address finds its segment")
	require.Equal(t, base, base2)
	_, _, err = a.BaseAllocation(0x1000)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
}

func TestConfigParse(t *testing.T) {
	cfg, warn, err := allocator.ParseConfig("max_split_size_mb:64, roundup_power2_divisions:[64:8,256:4,>:1],garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True,expandable_segments:False,record_history:100")
	require.NoError(t, err)
	require.Equal(t, uint64(64*MiB), cfg.Pools.MaxSplitSize)
	require.Equal(t, 0.6, cfg.Pools.GCThreshold)
	require.Equal(t, 100, cfg.HistoryEntries)
	d := cfg.Pools.RoundupDivisions
	require.Equal(t, uint64(8), d[0], "the first key covers the sizes below it")
	require.Equal(t, uint64(8), d[6])
	require.Equal(t, uint64(0), d[7], "PyTorch leaves intervals between keys unset")
	require.Equal(t, uint64(1), d[8], "'>' applies from the last key on")
	require.Equal(t, uint64(1), d[15])
	require.Empty(t, warn, "a pinned-memory key is PyTorch's host allocator's business")

	for _, bad := range []string{
		"max_split_size_mb:10", "max_split_size_mb:x", "garbage_collection_threshold:1",
		"garbage_collection_threshold:0", "roundup_power2_divisions:3", "roundup_power2_divisions:[64:3]",
		"roundup_power2_divisions:[65:4]", "expandable_segments:yes", "nocolon", "backend:cudaMallocAsync",
		"foo:bar",
	} {
		_, _, err := allocator.ParseConfig(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidConfig, bad)
	}
	exp, warn, err := allocator.ParseConfig("expandable_segments:True")
	require.NoError(t, err)
	require.Empty(t, warn, "expandable segments are implemented")
	require.True(t, exp.ExpandableSegments)

	round, _, err := allocator.ParseConfig(cfg.String())
	require.NoError(t, err)
	require.Equal(t, cfg.Pools, round.Pools, "String() parses back to the same policy")

	// cudapool's warm_runtime: on by default, off by key, printed when off.
	require.True(t, cfg.WarmRuntime)
	cold, warn, err := allocator.ParseConfig("warm_runtime:False")
	require.NoError(t, err)
	require.Empty(t, warn)
	require.False(t, cold.WarmRuntime)
	require.Contains(t, cold.String(), "warm_runtime:False")
	back, _, err := allocator.ParseConfig(cold.String())
	require.NoError(t, err)
	require.False(t, back.WarmRuntime)
	require.NotContains(t, cfg.String(), "warm_runtime")
	_, _, err = allocator.ParseConfig("warm_runtime:sometimes")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)

	// stitch_sync: on by default, off by key, printed when off.
	require.False(t, cfg.NoStitchSync)
	nosync, warn, err := allocator.ParseConfig("stitch_sync:False")
	require.NoError(t, err)
	require.Empty(t, warn)
	require.True(t, nosync.NoStitchSync)
	require.True(t, nosync.Stitch, "stitching itself stays on")
	require.Contains(t, nosync.String(), "stitch_sync:False")
	back, _, err = allocator.ParseConfig(nosync.String())
	require.NoError(t, err)
	require.True(t, back.NoStitchSync)
	require.NotContains(t, cfg.String(), "stitch_sync")
	_, _, err = allocator.ParseConfig("stitch_sync:maybe")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
}

func TestRoundupDivisionsApply(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "roundup_power2_divisions:4")
	p := mustMalloc(t, a, 0, 1200*KiB, 0)
	_ = p
	st := stats(t, a, 0)
	require.Equal(t, int64(1280*KiB), st.AllocatedBytes[pools.StatAll].Current)
	require.Equal(t, int64(1200*KiB), st.RequestedBytes[pools.StatAll].Current)
}

func TestSnapshotShape(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, ordinary+",record_history:16")
	p := mustMalloc(t, a, 0, 1000, 5)
	q := mustMalloc(t, a, 0, 3*MiB, 5)
	require.NoError(t, a.RecordStream(q, 6))
	drv.Submit(6)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	snap := a.Snapshot(nil, true)
	require.Len(t, snap.Segments, 2)
	states := map[string]int{}
	for _, s := range snap.Segments {
		var total uint64
		for _, b := range s.Blocks {
			states[b.State]++
			total += b.Size
		}
		require.Equal(t, s.TotalSize, total)
		require.Equal(t, uint64(5), s.Stream)
	}
	require.Equal(t, 1, states["active_allocated"])
	require.Equal(t, 1, states["active_awaiting_free"], "freed but still used by stream 6")
	require.Equal(t, "small", snap.Segments[0].SegmentType)
	actions := map[string]int{}
	for _, e := range snap.DeviceTraces[0] {
		actions[e.Action]++
	}
	require.Equal(t, map[string]int{"segment_alloc": 2, "alloc": 2, "free_requested": 1}, actions)
	drv.CompleteAll()
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	mustMalloc(t, a, 0, 512, 5) // processes events
	snap = a.Snapshot(nil, true)
	actions = map[string]int{}
	for _, e := range snap.DeviceTraces[0] {
		actions[e.Action]++
	}
	require.Equal(t, 2, actions["free_completed"])
}

func TestOOMTraceEntry(t *testing.T) {
	a, _ := newAlloc(t, 1, 100*MiB, "record_history:8")
	_, err := a.Malloc(&allocator.MallocRequest{Size: 200 * MiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	tr := a.Snapshot(nil, true).DeviceTraces[0]
	require.Len(t, tr, 1)
	require.Equal(t, "oom", tr[0].Action)
	require.NotNil(t, tr[0].DeviceFree, "the memory visualizer reads device_free")
	require.Equal(t, uint64(100*MiB), *tr[0].DeviceFree)
}

func TestMultiDevice(t *testing.T) {
	a, drv := newAlloc(t, 3, GiB, ordinary)
	require.Equal(t, 3, a.DeviceCount())
	ps := map[cuda.Ptr]int{}
	for dev := 0; dev < 3; dev++ {
		ps[mustMalloc(t, a, dev, 5*MiB, 0)] = dev
	}
	for dev := 0; dev < 3; dev++ {
		require.Equal(t, int64(1), drv.Allocs(dev))
	}
	for p, dev := range ps {
		require.NoError(t, a.Free(allocator.FreeRequest{Dev: dev, Ptr: p}))
	}
	require.NoError(t, a.CheckInvariants())
}

func lockThread(t testing.TB) {
	runtime.LockOSThread()
	t.Cleanup(runtime.UnlockOSThread)
}

// mallocAfterFrees performs the frees, then the malloc, in one request, and
// returns the pointer, the malloc's error and the first free's.
func mallocAfterFrees(a *allocator.Allocator, dev int, size uint64, s cuda.Stream, ctx uint64, frees []allocator.FreeRequest) (cuda.Ptr, error, error) {
	r := &allocator.MallocRequest{Dev: dev, Size: size, Stream: s, Ctx: ctx, Frees: frees}
	p, err := a.Malloc(r)
	return p, err, r.FreeErr
}

// mallocTracked is mallocAfterFrees that also returns the block's front
// tag.
func mallocTracked(a *allocator.Allocator, dev int, size uint64, s cuda.Stream, ctx uint64, frees []allocator.FreeRequest) (cuda.Ptr, allocator.Tracking, error, error) {
	r := &allocator.MallocRequest{Dev: dev, Size: size, Stream: s, Ctx: ctx, Frees: frees}
	p, err := a.Malloc(r)
	return p, r.Track, err, r.FreeErr
}
